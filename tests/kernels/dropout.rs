//! Dropout in the TE modules (`hidden_dropout`, `attention_dropout`) on `Autodiff<Te<Flex>>`, where burn-te's fused
//! dropout runs (the host path): its mask replayed from the seed it draws from the backend's RNG (the ChaCha8
//! stream's words in order, generated here) for the kernel, the layer's residual branches and the fused and
//! composed attention cores; the attention probabilities dropped at the rate and scaled by `1/(1 − p)`, forward
//! and backward against an f64 re-computation with the same mask, on every path (fused core, composed core,
//! Burn's `Dropout`); FC2's bias gradient through the replayed mask against f64; rate 0 and `valid()`
//! bit-identical to the layer without dropout; the seed makes runs repeat.

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_te::Te;
use burn_te::fused::{DropoutMask, with_composed_attention_core, with_composed_elementwise};
use burn_te::nn::{
    AttnMaskType, DotProductAttentionConfig, QkvFormat, TransformerLayer, TransformerLayerConfig,
};

use chacha20::ChaCha8Rng;
use rand_core::{Rng as _, SeedableRng};

use crate::common::{Rng, alone};
use crate::te::{tensor, values};

type B = Autodiff<Te<Flex>>;

/// The seed a fused dropout draws: the backend RNG's next 64-bit draw.
fn drawn_seed(device: &burn::tensor::Device<B>) -> u64 {
    let draws = Tensor::<B, 1, Int>::random([4], Distribution::Uniform(0.0, 65536.0), device);
    let draws: Vec<i64> = draws.into_data().iter::<i64>().collect();
    draws[0] as u64 | (draws[1] as u64) << 16 | (draws[2] as u64) << 32 | (draws[3] as u64) << 48
}

/// The seeds span 64 bits on both host backends (burn-ndarray draws an integer of `Distribution::Default` from
/// 0..255, Flex's integers are 32 bits: one such draw would repeat masks), and differ from call to call: eight
/// seeds all below 2³² would happen once in 2²⁵⁶.
#[test]
fn dropout_seeds_span_64_bits_on_flex_and_ndarray() {
    use burn::backend::NdArray;
    use burn_te::TeBackend;
    fn seeds<H: TeBackend>() -> Vec<u64> {
        let device = Default::default();
        (0..8)
            .map(|_| H::te_dropout_seed(&device).expect("the host path has a fused dropout"))
            .collect()
    }
    for (backend, seeds) in [("Flex", seeds::<Flex>()), ("NdArray", seeds::<NdArray>())] {
        assert!(
            seeds.iter().any(|&s| s >= 1 << 32),
            "{backend}: every seed below 2^32: {seeds:?}"
        );
        let mut distinct = seeds.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(
            distinct.len(),
            seeds.len(),
            "{backend}: repeated seeds {seeds:?}"
        );
    }
}

/// burn-te's dropout mask of `n` elements (`true` = kept), replayed in order: element `i` is kept when word `i` of
/// `ChaCha8Rng::seed_from_u64(seed)` is below `(1 − p) · 2³²` (rounded).
fn replayed_mask(seed: u64, n: usize, keep: f64) -> Vec<bool> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let below = (keep * 4_294_967_296.0).round() as u64;
    (0..n).map(|_| u64::from(rng.next_u32()) < below).collect()
}

/// The fused kernel over a tensor of several tasks' blocks (16 384 elements each, a partial last one): every
/// element is `x · 1/(1 − p)` where the replayed mask keeps it and `x · 0` where it drops it, bit for bit, so a
/// dropped ∞ is NaN as in Burn's `Dropout`; the rate holds; the factor is Burn's `1/(1 − p)` in f64.
#[test]
fn the_fused_kernel_applies_the_replayed_mask_at_every_index_across_tasks() {
    use burn_te_kernels::host::fused::dropout::dropout;
    let n = 3 * 16_384 + 1_234;
    let normal = Rng::new(8).normal(n, 0.0, 1.0);
    for (prob, seed) in [(0.1, 1), (0.3, 42), (0.5, u64::MAX)] {
        let mask = DropoutMask { prob, seed };
        let kept = replayed_mask(seed, n, 1.0 - prob);
        // ∞ and NaN where the mask drops (in the first and third task's block) and where it keeps.
        let mut x = normal.clone();
        let dropped_at = |from: usize| (from..n).find(|&i| !kept[i]).expect("a dropped element");
        let kept_at = |from: usize| (from..n).find(|&i| kept[i]).expect("a kept element");
        let specials = [
            (dropped_at(7), f32::INFINITY),
            (dropped_at(40_000), f32::NAN),
            (kept_at(20_000), f32::NEG_INFINITY),
            (kept_at(30_000), f32::NAN),
        ];
        for (i, v) in specials {
            x[i] = v;
        }
        let y = dropout(&x, mask);
        for (i, v) in specials {
            // Dropped: `v · 0`, NaN for ∞ and NaN alike (Burn's `Dropout` multiplies too); kept: `v · 1/(1 − p)`.
            let nan = !kept[i] || v.is_nan();
            assert!(
                y[i].is_nan() == nan && (nan || y[i] == v),
                "rate {prob}, seed {seed}: {v} at {i} (kept: {}) gave {}",
                kept[i],
                y[i]
            );
        }
        let factor = (1.0 / (1.0 - prob)) as f32;
        for (i, ((y, x), kept)) in y.iter().zip(&x).zip(&kept).enumerate() {
            let want = x * if *kept { factor } else { 0.0 };
            assert!(
                y.to_bits() == want.to_bits(),
                "rate {prob}, seed {seed}, element {i}: {y} (expected {want})"
            );
        }
        let zeros = kept.iter().filter(|k| !**k).count();
        assert_rate(&format!("kernel at rate {prob}"), zeros, n, prob);
    }
}

/// The mask applied to a part of a tensor at its index (`MaskStream::apply`, what the attention core does per row of
/// probabilities, and the kernel per task): every element is `x · 1/(1 − p)` where the replayed mask keeps it and
/// `x · 0` where it drops it, bit for bit, for parts that start inside a ChaCha block and span several of the
/// stream's 1 KiB chunks, and at rate 0 (every draw kept); from the words made 16 blocks at a time on AVX-512 and
/// from the crate's RNG alike. Fails on an x86-64 CPU without AVX-512 (the first would not be tested).
#[test]
fn the_mask_applies_at_any_index_from_any_offset() {
    #[cfg(target_arch = "x86_64")]
    assert!(
        std::arch::is_x86_feature_detected!("avx512f"),
        "this CPU lacks AVX-512F: the 16-block keystream cannot be tested here"
    );
    let parts = [
        (0, 1),
        (1, 3),
        (5, 16),
        (15, 255),
        (16, 256),
        (17, 257),
        (255, 700),
        (1_000, 1_031),
    ];
    let n = parts.iter().map(|(first, len)| first + len).max().unwrap();
    let x = Rng::new(9).normal(n, 0.0, 1.0);
    for (prob, seed) in [(0.0, 3), (0.1, 5), (0.5, u64::MAX)] {
        let mask = DropoutMask { prob, seed };
        let kept = replayed_mask(seed, n, 1.0 - prob);
        let factor = (1.0 / (1.0 - prob)) as f32;
        for (first, len) in parts {
            for (source, mut stream) in [("AVX-512", mask.stream()), ("RNG", mask.rng_stream())] {
                let mut part = x[first..first + len].to_vec();
                stream.apply(&mut part, first);
                for (j, y) in part.iter().enumerate() {
                    let i = first + j;
                    let want = x[i] * if kept[i] { factor } else { 0.0 };
                    assert_eq!(
                        y.to_bits(),
                        want.to_bits(),
                        "{source}: rate {prob}, seed {seed}, part {first}..+{len}, element {i}: {y} (expected {want})"
                    );
                }
            }
        }
    }
}

/// `|zeros − n·p|` within 4.5 binomial standard deviations (a false failure about once in 150 000 runs).
fn assert_rate(what: &str, zeros: usize, n: usize, p: f64) {
    let (expected, sd) = (n as f64 * p, (n as f64 * p * (1.0 - p)).sqrt());
    assert!(
        (zeros as f64 - expected).abs() <= 4.5 * sd,
        "{what}: {zeros} of {n} dropped, expected {expected:.0} ± {:.0} at rate {p}",
        4.5 * sd
    );
}

/// f64 causal attention of one head (`s × d` row-major q, k, v), its probabilities dropped by `mask` (`s × s`,
/// `true` = kept) and scaled by `1/keep`, and the gradients of `Σ out ⊙ r` for q, k and v.
struct HeadReference {
    out: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

fn head_reference(
    (q, k, v, r): (&[f32], &[f32], &[f32], &[f32]),
    mask: &[bool],
    (s, d): (usize, usize),
    keep: f64,
) -> HeadReference {
    let scale = 1.0 / (d as f64).sqrt();
    let at = |x: &[f32], i: usize, c: usize| x[i * d + c] as f64;
    // Probabilities (causal: row i sees keys j ≤ i).
    let mut p = vec![0.0; s * s];
    for i in 0..s {
        let scores: Vec<f64> = (0..=i)
            .map(|j| (0..d).map(|c| at(q, i, c) * at(k, j, c)).sum::<f64>() * scale)
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let total: f64 = scores.iter().map(|x| (x - max).exp()).sum();
        for (j, x) in scores.iter().enumerate() {
            p[i * s + j] = (x - max).exp() / total;
        }
    }
    let dropped = |i: usize, j: usize| if mask[i * s + j] { 1.0 / keep } else { 0.0 };
    let mut out = vec![0.0; s * d];
    let mut dv = vec![0.0; s * d];
    let mut ds = vec![0.0; s * s];
    for i in 0..s {
        for c in 0..d {
            out[i * d + c] = (0..=i)
                .map(|j| p[i * s + j] * dropped(i, j) * at(v, j, c))
                .sum();
        }
        // dP = (r · vᵀ) ⊙ mask / keep; dS = P ⊙ (dP − Σ_j dP ⊙ P).
        let dp: Vec<f64> = (0..=i)
            .map(|j| (0..d).map(|c| at(r, i, c) * at(v, j, c)).sum::<f64>() * dropped(i, j))
            .collect();
        let dot: f64 = (0..=i).map(|j| dp[j] * p[i * s + j]).sum();
        for j in 0..=i {
            ds[i * s + j] = p[i * s + j] * (dp[j] - dot);
            for c in 0..d {
                dv[j * d + c] += p[i * s + j] * dropped(i, j) * at(r, i, c);
            }
        }
    }
    let mut dq = vec![0.0; s * d];
    let mut dk = vec![0.0; s * d];
    for i in 0..s {
        for j in 0..=i {
            for c in 0..d {
                dq[i * d + c] += ds[i * s + j] * at(k, j, c) * scale;
                dk[j * d + c] += ds[i * s + j] * at(q, i, c) * scale;
            }
        }
    }
    HeadReference { out, dq, dk, dv }
}

fn assert_close_f64(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    let err = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0.0, f64::max);
    assert!(
        err <= 2e-5 * scale,
        "{what}: max error {err:e} (scale {scale:e})"
    );
}

/// Which path runs the attention core's dropout.
#[derive(Clone, Copy, Debug, PartialEq)]
enum AttentionPath {
    /// The fused core, dropping the probabilities in its pass (the default on the host path).
    FusedCore,
    /// Two batched GEMMs around the fused softmax, the probabilities dropped by the fused dropout.
    ComposedCore,
    /// Burn's ops and Burn's `Dropout` (a backend without fused ops).
    BurnOps,
}

/// The attention probabilities are dropped at `attention_dropout` and the survivors scaled by `1/(1 − p)`; the
/// output and the gradients of q, k and v equal an f64 attention with the same mask, on each path. With `v` the
/// identity the output *is* the dropped probability matrix, so the mask is read off it: on the fused core and the
/// composed one it is the mask replayed from the drawn seed at the probabilities' `[b, h, q, k]` indices, and
/// each path counts the ops it ran.
#[test]
fn attention_dropout_drops_probabilities_at_the_rate_and_backpropagates_through_the_mask() {
    alone(
        "dropout::attention_dropout_drops_probabilities_at_the_rate_and_backpropagates_through_the_mask",
        || {
            attention_dropout_on(AttentionPath::FusedCore);
            with_composed_attention_core(|| attention_dropout_on(AttentionPath::ComposedCore));
            with_composed_elementwise(|| attention_dropout_on(AttentionPath::BurnOps));
        },
    );
}

fn counter(name: &str) -> u64 {
    burn_te::diagnostics::thread_counter_value(name).unwrap_or(0)
}

fn attention_dropout_on(path: AttentionPath) {
    let device = Default::default();
    let (b, h, s) = (4, 2, 32);
    let d = s;
    let rate = 0.25;
    let attention = DotProductAttentionConfig::new(h, d)
        .with_attn_mask_type(AttnMaskType::Causal)
        .with_qkv_format(QkvFormat::Bshd)
        .with_attention_dropout(rate)
        .init::<B>();
    let mut rng = Rng::new(5);
    let (q, k) = (
        rng.normal(b * h * s * d, 0.0, 1.0),
        rng.normal(b * h * s * d, 0.0, 1.0),
    );
    let v: Vec<f32> = (0..b * h * s * d)
        .map(|i| f32::from((i / d) % s == i % d))
        .collect();
    let r = rng.normal(b * h * s * d, 0.0, 1.0);
    let leaf = |x: &Vec<f32>| tensor::<B, 4>(x.clone(), [b, h, s, d], &device).require_grad();
    let (tq, tk, tv) = (leaf(&q), leaf(&k), leaf(&v));
    B::seed(&device, 11);
    let seed = drawn_seed(&device);
    B::seed(&device, 11);
    let names = [
        "FusedAttention",
        "FusedAttentionBackward",
        "FusedDropout",
        "FusedDropoutBackward",
    ];
    let before: Vec<u64> = names.iter().map(|n| counter(n)).collect();
    let out = attention
        .forward(
            tq.clone().swap_dims(1, 2),
            tk.clone().swap_dims(1, 2),
            tv.clone().swap_dims(1, 2),
            None,
        )
        .reshape([b, s, h, d])
        .swap_dims(1, 2);
    let grads = (out.clone() * tensor::<B, 4>(r.clone(), [b, h, s, d], &device))
        .sum()
        .backward();
    let counts: Vec<u64> = names
        .iter()
        .zip(&before)
        .map(|(n, b)| counter(n) - b)
        .collect();
    let expected = match path {
        AttentionPath::FusedCore => [1, 1, 0, 0],
        AttentionPath::ComposedCore => [0, 0, 1, 1],
        AttentionPath::BurnOps => [0, 0, 0, 0],
    };
    assert_eq!(counts, expected, "{path:?}: ops run ({names:?})");
    let (out, dq, dk, dv) = (
        values(out),
        values(tq.grad(&grads).unwrap()),
        values(tk.grad(&grads).unwrap()),
        values(tv.grad(&grads).unwrap()),
    );

    let replayed = replayed_mask(seed, b * h * s * s, 1.0 - rate);
    let (mut zeros, mut allowed) = (0, 0);
    for head in 0..b * h {
        let at = |x: &[f32]| x[head * s * d..(head + 1) * s * d].to_vec();
        let mask: Vec<bool> = at(&out).iter().map(|&x| x != 0.0).collect();
        for i in 0..s {
            allowed += i + 1;
            zeros += (0..=i).filter(|&j| !mask[i * s + j]).count();
            if path != AttentionPath::BurnOps {
                for j in 0..=i {
                    assert_eq!(
                        mask[i * s + j],
                        replayed[(head * s + i) * s + j],
                        "{path:?}: head {head}, query {i}, key {j} against the replayed mask"
                    );
                }
            }
        }
        let want = head_reference(
            (&at(&q), &at(&k), &at(&v), &at(&r)),
            &mask,
            (s, d),
            1.0 - rate,
        );
        let what = |t: &str| format!("{path:?}: head {head} {t}");
        assert_close_f64(&what("output"), &at(&out), &want.out);
        assert_close_f64(&what("dq"), &at(&dq), &want.dq);
        assert_close_f64(&what("dk"), &at(&dk), &want.dk);
        assert_close_f64(&what("dv"), &at(&dv), &want.dv);
    }
    assert_rate(
        &format!("{path:?}: attention probabilities"),
        zeros,
        allowed,
        rate,
    );
}

const SHAPE: [usize; 3] = [16, 4, 32];

/// A layer with its parameters materialized: Burn initializes them lazily, at their first use, and that draw
/// would come between a test's `B::seed` and the masks.
fn layer(hidden_dropout: f64, attention_dropout: f64) -> TransformerLayer<B> {
    B::seed(&Default::default(), 3);
    let layer = TransformerLayerConfig::new(SHAPE[2], 64, 4)
        .with_hidden_dropout(hidden_dropout)
        .with_attention_dropout(attention_dropout)
        .init(&Default::default());
    let _ = layer.forward(input(0), None);
    layer
}

fn input(seed: u64) -> Tensor<B, 3> {
    let n = SHAPE.iter().product();
    tensor(
        Rng::new(seed).normal(n, 0.0, 1.0),
        SHAPE,
        &Default::default(),
    )
}

/// The layer without dropout, composed by hand: `h = x + attn(x)`, `out = h + mlp(h)`.
fn without_dropout<A: burn_te::TeBackend>(
    layer: &TransformerLayer<A>,
    x: Tensor<A, 3>,
) -> Tensor<A, 3> {
    let h = x.clone() + layer.self_attention.forward(x, None);
    h.clone() + layer.layernorm_mlp.forward(h)
}

/// `hidden_dropout` masks each block's output before its residual add with the fused dropout, each mask from the
/// next seed drawn from the backend's RNG (replayed here: the output bit for bit), and FC2's bias gradient is the
/// incoming gradient through the second mask, against f64. Both masks drop at the rate.
#[test]
fn hidden_dropout_masks_both_residual_branches_from_the_backend_seed() {
    alone(
        "dropout::hidden_dropout_masks_both_residual_branches_from_the_backend_seed",
        hidden_dropout_masks,
    );
}

fn hidden_dropout_masks() {
    let device = Default::default();
    let rate = 0.3;
    let keep = 1.0 - rate;
    let layer = layer(rate, 0.0);
    let x = input(1);
    let r = Rng::new(2).normal(SHAPE.iter().product(), 0.0, 1.0);
    B::seed(&device, 17);
    let out = layer.forward(x.clone(), None);
    let grads = (out.clone() * tensor::<B, 3>(r.clone(), SHAPE, &device))
        .sum()
        .backward();
    let fc2_bias = values(
        layer
            .layernorm_mlp
            .fc2
            .bias
            .as_ref()
            .unwrap()
            .val()
            .grad(&grads)
            .unwrap(),
    );

    // The two masks, replayed from the two seeds the branches drew.
    B::seed(&device, 17);
    let n = SHAPE.iter().product::<usize>();
    let masks: Vec<Tensor<B, 3>> = [drawn_seed(&device), drawn_seed(&device)]
        .map(|seed| {
            let kept = replayed_mask(seed, n, keep);
            let mask = kept.into_iter().map(f32::from).collect();
            tensor::<B, 3>(mask, SHAPE, &device)
        })
        .into();
    let h = x.clone() + layer.self_attention.forward(x, None) * masks[0].clone() * (1.0 / keep);
    let want = h.clone() + layer.layernorm_mlp.forward(h) * masks[1].clone() * (1.0 / keep);
    assert_eq!(
        values(out),
        values(want),
        "the layer's output with the replayed masks"
    );

    let hidden = SHAPE[2];
    let m2 = values(masks[1].clone());
    let want: Vec<f64> = (0..hidden)
        .map(|c| {
            (c..n)
                .step_by(hidden)
                .map(|i| r[i] as f64 * m2[i] as f64 / keep)
                .sum()
        })
        .collect();
    assert_close_f64("fc2 bias gradient", &fc2_bias, &want);
    for (i, mask) in masks.into_iter().enumerate() {
        let zeros = values(mask).iter().filter(|&&m| m == 0.0).count();
        assert_rate(&format!("hidden mask {i}"), zeros, n, rate);
    }
}

/// A TransformerLayer (grouped-query heads, 80 positions: two blocks of queries per head, QKV packed) with
/// `attention_dropout` drops the same probabilities in the fused attention core, backward included, as the composed
/// core does with the fused dropout (which the test above checks against f64), for the same seed: the output and
/// every parameter's gradient agree within f32 rounding.
#[test]
fn a_layer_drops_the_same_probabilities_in_the_fused_core_as_in_the_composed_one() {
    alone(
        "dropout::a_layer_drops_the_same_probabilities_in_the_fused_core_as_in_the_composed_one",
        fused_core_against_composed,
    );
}

fn fused_core_against_composed() {
    let device = Default::default();
    let shape = [80, 2, 64];
    B::seed(&device, 3);
    let layer = TransformerLayerConfig::new(shape[2], 128, 4)
        .with_num_gqa_groups(Some(2))
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.3)
        .with_self_attn_mask_type(AttnMaskType::Causal)
        .init::<B>(&device);
    let x = tensor::<B, 3>(
        Rng::new(6).normal(shape.iter().product(), 0.0, 1.0),
        shape,
        &device,
    );
    // Parameters materialized before the seeded runs (see `layer`).
    let _ = layer.forward(x.clone(), None);
    let run = || {
        B::seed(&device, 23);
        let before = counter("FusedAttention");
        let y = layer.forward(x.clone(), None);
        let fused = counter("FusedAttention") - before;
        let grads = (y.clone() * y.clone()).sum().backward();
        struct Collect<'a>(&'a burn::backend::autodiff::grads::Gradients, Vec<Vec<f32>>);
        impl burn::module::ModuleVisitor<B> for Collect<'_> {
            fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
                if let Some(grad) = param.val().grad(self.0) {
                    self.1.push(values(grad));
                }
            }
        }
        let mut collect = Collect(&grads, Vec::new());
        layer.visit(&mut collect);
        (values(y), collect.1, fused)
    };
    let (y, grads, fused) = run();
    let (ry, rgrads, rfused) = with_composed_attention_core(run);
    assert_eq!((fused, rfused), (1, 0), "fused cores run");
    let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    assert_close_f64("layer output", &y, &wide(&ry));
    assert_eq!(grads.len(), rgrads.len());
    for (i, (g, r)) in grads.iter().zip(&rgrads).enumerate() {
        assert_close_f64(&format!("parameter {i}'s gradient"), g, &wide(r));
    }
    let (none, _, _) = with_composed_elementwise(run);
    assert_ne!(y, none, "Burn's Dropout draws another mask");
}

/// At rate 0 the layer is bit-identical to the layer without dropout; under `valid()` (no autodiff) a layer with
/// dropout is too; with dropout, the same seed repeats the output bit for bit and another seed changes it.
#[test]
fn dropout_is_off_at_rate_zero_and_in_valid_and_repeats_with_the_seed() {
    let device = Default::default();
    let x = input(4);
    let plain = layer(0.0, 0.0);
    assert_eq!(
        values(plain.forward(x.clone(), None)),
        values(without_dropout(&plain, x.clone())),
        "rate 0"
    );

    let dropping = layer(0.2, 0.2);
    let valid = dropping.valid();
    let x_valid = x.clone().inner();
    assert_eq!(
        values(valid.forward(x_valid.clone(), None)),
        values(without_dropout(&valid, x_valid)),
        "valid()"
    );

    alone(
        "dropout::dropout_is_off_at_rate_zero_and_in_valid_and_repeats_with_the_seed",
        || {
            let run = |seed| {
                B::seed(&device, seed);
                values(dropping.forward(x.clone(), None))
            };
            let first = run(9);
            assert_eq!(first, run(9), "the same seed");
            assert_ne!(first, run(10), "another seed");
            assert_ne!(first, values(without_dropout(&dropping, x)), "dropout on");
        },
    );
}

/// A probability outside `[0, 1)` is a config error naming the key.
#[test]
fn dropout_rates_outside_zero_to_one_are_config_errors() {
    let device = Default::default();
    for (hidden, attention, key) in [
        (1.0, 0.1, "hidden_dropout"),
        (0.1, -0.5, "attention_dropout"),
    ] {
        let message = TransformerLayerConfig::new(32, 64, 4)
            .with_hidden_dropout(hidden)
            .with_attention_dropout(attention)
            .try_init::<B>(&device)
            .unwrap_err()
            .to_string();
        assert!(
            message.contains(key) && message.contains("[0, 1)"),
            "{message}"
        );
    }
}
