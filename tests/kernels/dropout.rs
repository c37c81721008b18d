//! Dropout in the TE modules (`hidden_dropout`, `attention_dropout`) on `Autodiff<Te<Flex>>`: the attention
//! probabilities dropped at the rate and scaled by `1/(1 - p)`, forward and backward against an f64 re-computation
//! with the same mask; the layer's two residual-branch masks replayed from the backend seed, with FC2's bias
//! gradient against f64; rate 0 and `valid()` bit-identical to the layer without dropout; the seed makes runs repeat.

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_te::Te;
use burn_te::nn::{
    AttnMaskType, DotProductAttentionConfig, QkvFormat, TransformerLayer, TransformerLayerConfig,
};

use crate::common::{Rng, alone};
use crate::te::{tensor, values};

type B = Autodiff<Te<Flex>>;

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

/// The attention probabilities are dropped at `attention_dropout` and the survivors scaled by `1/(1 − p)`; the
/// output and the gradients of q, k and v equal an f64 attention with the same mask. With `v` the identity the
/// output *is* the dropped probability matrix, so the mask is read off it.
#[test]
fn attention_dropout_drops_probabilities_at_the_rate_and_backpropagates_through_the_mask() {
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
    let (out, dq, dk, dv) = (
        values(out),
        values(tq.grad(&grads).unwrap()),
        values(tk.grad(&grads).unwrap()),
        values(tv.grad(&grads).unwrap()),
    );

    let (mut zeros, mut allowed) = (0, 0);
    for head in 0..b * h {
        let at = |x: &[f32]| x[head * s * d..(head + 1) * s * d].to_vec();
        let mask: Vec<bool> = at(&out).iter().map(|&x| x != 0.0).collect();
        for i in 0..s {
            allowed += i + 1;
            zeros += (0..=i).filter(|&j| !mask[i * s + j]).count();
        }
        let want = head_reference(
            (&at(&q), &at(&k), &at(&v), &at(&r)),
            &mask,
            (s, d),
            1.0 - rate,
        );
        assert_close_f64(&format!("head {head} output"), &at(&out), &want.out);
        assert_close_f64(&format!("head {head} dq"), &at(&dq), &want.dq);
        assert_close_f64(&format!("head {head} dk"), &at(&dk), &want.dk);
        assert_close_f64(&format!("head {head} dv"), &at(&dv), &want.dv);
    }
    assert_rate("attention probabilities", zeros, allowed, rate);
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

/// `hidden_dropout` masks each block's output before its residual add with the backend's next two Bernoulli draws
/// (replayed here from the same seed), and FC2's bias gradient is the incoming gradient through the second mask,
/// against f64. Both masks drop at the rate.
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

    B::seed(&device, 17);
    let masks: Vec<Tensor<B, 3>> = (0..2)
        .map(|_| Tensor::random(SHAPE, Distribution::Bernoulli(keep), &device))
        .collect();
    let h = x.clone() + layer.self_attention.forward(x, None) * masks[0].clone() * (1.0 / keep);
    let want = h.clone() + layer.layernorm_mlp.forward(h) * masks[1].clone() * (1.0 / keep);
    assert_eq!(
        values(out),
        values(want),
        "the layer's output with the replayed masks"
    );

    let n = SHAPE.iter().product::<usize>();
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
