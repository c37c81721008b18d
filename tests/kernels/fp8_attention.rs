//! FP8 attention (TE's `fp8_dpa`) on `Autodiff<Te<Flex>>`: `DotProductAttention`'s two GEMMs and their backward
//! against an f64 attention whose operands are quantized here as the recipe says (per-tensor current scaling: q, k,
//! v and p in E4M3, dO and dS in E5M2; the softmax in high precision); the delayed-scaling histories of both GEMMs
//! against the amaxes of the tensors, step by step, and through a saved record; DisableFP8GEMM on both GEMMs gives
//! the f32 attention bit for bit.

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use burn_te::nn::{AttnMaskType, DotProductAttention, DotProductAttentionConfig, QkvFormat};
use burn_te::{
    DelayedScaling, Float8CurrentScaling, Fp8Format, RecipePlan, ScopeRecipe, TensorRole,
    fp8_autocast,
};

use crate::common::Rng;
use crate::debug::{SESSION, start_session};
use crate::feature_effects::current;
use crate::te::{tensor, values};

type B = Autodiff<burn_te::Te<Flex>>;

const SHAPE: [usize; 4] = [2, 2, 24, 16]; // [b, h, s, d]

fn attention<A: burn_te::TeBackend>(name: &str) -> DotProductAttention<A> {
    DotProductAttentionConfig::new(SHAPE[1], SHAPE[3])
        .with_attn_mask_type(AttnMaskType::Causal)
        .with_qkv_format(QkvFormat::Bshd)
        .with_name(Some(name.into()))
        .init()
}

/// q, k, v and the output's weights `r` (`loss = Σ out ⊙ r`), `[b, h, s, d]` row-major.
fn operands(seed: u64) -> [Vec<f32>; 4] {
    let n = SHAPE.iter().product();
    let mut rng = Rng::new(seed);
    [0.0, 0.0, 0.0, 0.0].map(|_| rng.normal(n, 0.0, 1.0))
}

/// Output and q, k, v gradients `[b, h, s, d]` of the layer on `A` under `recipe` (`None`: f32).
fn run<A: burn::tensor::backend::AutodiffBackend + burn_te::TeBackend>(
    layer: &DotProductAttention<A>,
    [q, k, v, r]: &[Vec<f32>; 4],
    recipe: Option<ScopeRecipe>,
) -> [Vec<f32>; 4] {
    let device = Default::default();
    let leaf = |x: &Vec<f32>| tensor::<A, 4>(x.clone(), SHAPE, &device).require_grad();
    let (tq, tk, tv) = (leaf(q), leaf(k), leaf(v));
    let forward = || {
        layer.forward(
            tq.clone().swap_dims(1, 2),
            tk.clone().swap_dims(1, 2),
            tv.clone().swap_dims(1, 2),
            None,
        )
    };
    let out = match recipe {
        Some(recipe) => fp8_autocast(true, recipe, forward).unwrap(),
        None => forward(),
    };
    let [b, h, s, d] = SHAPE;
    let out = out.reshape([b, s, h, d]).swap_dims(1, 2);
    let grads = (out.clone() * tensor::<A, 4>(r.clone(), SHAPE, &device))
        .sum()
        .backward();
    [
        values(out),
        values(tq.grad(&grads).unwrap()),
        values(tk.grad(&grads).unwrap()),
        values(tv.grad(&grads).unwrap()),
    ]
}

/// [`run`] with q, k and v the parts of one packed leaf `[b, s, 3h, d]` split by `TeBackend::te_split` (what
/// `MultiheadAttention` does with its QKV projection), whose gradient is joined from the parts' once; the
/// gradients are that leaf's, cut back into q's, k's and v's `[b, h, s, d]`.
fn run_packed<A: burn::tensor::backend::AutodiffBackend + burn_te::TeBackend>(
    layer: &DotProductAttention<A>,
    [q, k, v, r]: &[Vec<f32>; 4],
    recipe: ScopeRecipe,
) -> [Vec<f32>; 4] {
    use burn::tensor::{Tensor, TensorPrimitive};
    let device = Default::default();
    let [b, h, s, d] = SHAPE;
    let at = |bi: usize, hi: usize, si: usize, di: usize| ((bi * h + hi) * s + si) * d + di;
    let mut packed = vec![0.0; 3 * q.len()];
    for (i, p) in packed.iter_mut().enumerate() {
        let (bi, si, slot, di) = (
            i / (s * 3 * h * d),
            i / (3 * h * d) % s,
            i / d % (3 * h),
            i % d,
        );
        *p = [q, k, v][slot / h][at(bi, slot % h, si, di)];
    }
    let leaf = tensor::<A, 4>(packed, [b, s, 3 * h, d], &device).require_grad();
    let parts = A::te_split(leaf.clone().into_primitive().tensor(), 2, &[h, h, h]);
    let [tq, tk, tv] = <[_; 3]>::try_from(parts)
        .unwrap()
        .map(|p| Tensor::<A, 4>::from_primitive(TensorPrimitive::Float(p)));
    let out = fp8_autocast(true, recipe, || layer.forward(tq, tk, tv, None)).unwrap();
    let out = out.reshape([b, s, h, d]).swap_dims(1, 2);
    let grads = (out.clone() * tensor::<A, 4>(r.clone(), SHAPE, &device))
        .sum()
        .backward();
    let joined = values(leaf.grad(&grads).unwrap());
    let part = |p: usize| -> Vec<f32> {
        (0..q.len())
            .map(|i| {
                let (bi, hi, si, di) = (i / (h * s * d), i / (s * d) % h, i / d % s, i % d);
                joined[((bi * s + si) * 3 * h + p * h + hi) * d + di]
            })
            .collect()
    };
    [values(out), part(0), part(1), part(2)]
}

/// `[rows, inner] · [inner, cols]` per head in f64; `ta`/`tb` read the operand transposed.
fn bmm(
    a: &[f64],
    b: &[f64],
    (rows, inner, cols): (usize, usize, usize),
    ta: bool,
    tb: bool,
) -> Vec<f64> {
    let heads = a.len() / (rows * inner);
    let mut out = vec![0.0; heads * rows * cols];
    for hd in 0..heads {
        let (a, b) = (&a[hd * rows * inner..], &b[hd * inner * cols..]);
        for i in 0..rows {
            for j in 0..cols {
                out[(hd * rows + i) * cols + j] = (0..inner)
                    .map(|p| {
                        let x = if ta {
                            a[p * rows + i]
                        } else {
                            a[i * inner + p]
                        };
                        let y = if tb {
                            b[j * inner + p]
                        } else {
                            b[p * cols + j]
                        };
                        x * y
                    })
                    .sum();
            }
        }
    }
    out
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Current scaling of a whole tensor in `format`, here in f64 values.
fn quantized(x: &[f64], format: Fp8Format) -> Vec<f64> {
    f64s(&current(
        &x.iter().map(|&v| v as f32).collect::<Vec<_>>(),
        format,
        0,
    ))
}

/// The f64 reference of TE's FP8 attention under current scaling: output and q, k, v gradients.
fn reference([q, k, v, r]: &[Vec<f32>; 4]) -> [Vec<f64>; 4] {
    let [_, _, s, d] = SHAPE;
    let scale = 1.0 / (d as f64).sqrt();
    let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
    let (q8, k8, v8) = (
        quantized(&f64s(q), e4),
        quantized(&f64s(k), e4),
        quantized(&f64s(v), e4),
    );
    let scores = bmm(&q8, &k8, (s, d, s), false, true);
    // Causal softmax of scale · scores, in high precision.
    let mut p = vec![0.0; scores.len()];
    for row in 0..scores.len() / s {
        let i = row % s;
        let x = &scores[row * s..row * s + i + 1];
        let max = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let total: f64 = x.iter().map(|v| ((v - max) * scale).exp()).sum();
        for (j, v) in x.iter().enumerate() {
            p[row * s + j] = ((v - max) * scale).exp() / total;
        }
    }
    let p8 = quantized(&p, e4);
    let out = bmm(&p8, &v8, (s, s, d), false, false);
    // Backward: dO in E5M2; bmm2's dgrad and wgrad on the forward's quantized p and v.
    let do8 = quantized(&f64s(r), e5);
    let dp = bmm(&do8, &v8, (s, d, s), false, true);
    let dv = bmm(&p8, &do8, (s, s, d), true, false);
    // The softmax's backward on its high-precision output, then dS in E5M2 for bmm1's dgrad and wgrad.
    let mut ds = vec![0.0; dp.len()];
    for row in 0..dp.len() / s {
        let cells = row * s..(row + 1) * s;
        let dot: f64 = cells.clone().map(|c| dp[c] * p[c]).sum();
        for c in cells {
            ds[c] = scale * p[c] * (dp[c] - dot);
        }
    }
    let ds8 = quantized(&ds, e5);
    let dq = bmm(&ds8, &k8, (s, s, d), false, false);
    let dk = bmm(&ds8, &q8, (s, s, d), true, false);
    [out, dq, dk, dv]
}

/// The largest difference from `want`, relative to `want`'s largest magnitude.
fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    got.iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0.0, f64::max)
        / scale
}

/// Under Float8CurrentScaling with `fp8_dpa`, the output and the q, k, v gradients equal the f64 attention with
/// TE's quantizations within f32 accumulation (1e-5 of the largest value; the layer quantizes its f32 p and dS, the
/// reference its f64 ones: at these values no FP8 code differs), where the f32 attention is percents away; q, k
/// and v split from a packed projection give the same bits, read in place; without `fp8_dpa` the recipe leaves the
/// attention in f32.
#[test]
fn fp8_attention_matches_the_f64_attention_of_the_quantized_operands() {
    let ops = operands(1);
    let want = reference(&ops);
    let layer = attention::<B>("attn");
    let dpa = Float8CurrentScaling {
        fp8_dpa: true,
        ..Default::default()
    };
    let fp8 = run(&layer, &ops, Some(dpa.clone().into()));
    // q, k, v split from one packed leaf: the same numbers, the packed gradient joined from the parts'.
    let copies = || burn_te::diagnostics::thread_counter_value("HostLayoutCopies").unwrap_or(0);
    let before = copies();
    let packed = run_packed(&layer, &ops, dpa.into());
    // The permuted q, v and dO and the transposed kᵀ are quantized where they lie; what is copied: the context
    // reshaped for the projection, the loss's gradient reshaped back here, and the three gradients joined.
    assert_eq!(
        copies() - before,
        3,
        "layout copies of the packed FP8 attention"
    );
    for (i, what) in ["output", "dq", "dk", "dv"].iter().enumerate() {
        let differs = (0..fp8[i].len()).find(|&j| fp8[i][j].to_bits() != packed[i][j].to_bits());
        assert_eq!(
            differs, None,
            "{what}: packed q, k, v against separate ones"
        );
    }
    let f32_run = run(&layer, &ops, None);
    let without = run(&layer, &ops, Some(Float8CurrentScaling::default().into()));
    for (i, what) in ["output", "dq", "dk", "dv"].iter().enumerate() {
        let (err, f32_err) = (
            relative_error(&fp8[i], &want[i]),
            relative_error(&f32_run[i], &want[i]),
        );
        eprintln!("{what}: FP8 {err:.2e}, f32 {f32_err:.2e} from the quantized f64 reference");
        assert!(err < 1e-5, "{what}: FP8 {err:e}, f32 {f32_err:e}");
        assert_eq!(
            without[i], f32_run[i],
            "{what}: no fp8_dpa, no FP8 attention"
        );
    }
}

/// Under DelayedScaling with `fp8_dpa`, each step records the amaxes of q and k (bmm1) and of v and dO (bmm2) into
/// the layer's histories, as recomputed here from each step's tensors (p and dS are the layer's own); a saved record
/// carries the histories.
#[test]
fn fp8_attention_keeps_delayed_scaling_histories_per_gemm_in_the_record() {
    let layer = attention::<B>("attn_delayed");
    let recipe = DelayedScaling {
        fp8_dpa: true,
        amax_history_len: 4,
        ..Default::default()
    };
    let amax = |x: &[f32]| x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let mut expected: [Vec<f32>; 4] = Default::default(); // q, k, v, dO
    for step in 0..3 {
        let ops = operands(10 + step);
        run(&layer, &ops, Some(recipe.clone().into()));
        for (slot, x) in expected.iter_mut().zip(&ops) {
            slot.insert(0, amax(x));
        }
        let history = |meta: &burn_te::Fp8Meta<B>, role, format| {
            meta.read(role, &recipe, format).unwrap().unwrap().history
        };
        let e4 = Fp8Format::E4M3;
        let recorded = [
            history(&layer.bmm1_fp8_meta, TensorRole::Activation, e4),
            history(&layer.bmm1_fp8_meta, TensorRole::Weight, e4),
            history(&layer.bmm2_fp8_meta, TensorRole::Weight, e4),
            history(&layer.bmm2_fp8_meta, TensorRole::Gradient, Fp8Format::E5M2),
        ];
        for (what, (got, want)) in ["q", "k", "v", "dO"]
            .iter()
            .zip(recorded.iter().zip(&expected))
        {
            // As the next step will use it (TE's roll): slot 0 that step's (empty), slot len − 1 − k the amax of k
            // steps before it.
            let mut rolled = vec![0.0; 4];
            for (k, &a) in want.iter().enumerate() {
                rolled[3 - k] = a;
            }
            assert_eq!(got, &rolled, "step {step}: {what}'s history");
        }
    }
    let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
    let bytes = recorder.record(layer.clone().into_record(), ()).unwrap();
    let loaded = attention::<B>("attn_loaded")
        .load_record(recorder.load(bytes, &Default::default()).unwrap());
    for (a, b) in [
        (&layer.bmm1_fp8_meta, &loaded.bmm1_fp8_meta),
        (&layer.bmm2_fp8_meta, &loaded.bmm2_fp8_meta),
    ] {
        for role in [TensorRole::Activation, TensorRole::Weight] {
            let read = |m: &burn_te::Fp8Meta<B>| m.read(role, &recipe, Fp8Format::E4M3).unwrap();
            assert_eq!(read(a), read(b), "{role:?} through the record");
        }
    }
}

/// The debug tools see the attention GEMMs as `{layer}.bmm1` and `{layer}.bmm2`: DisableFP8GEMM on both (every
/// GEMM) gives the f32 attention bit for bit, output and gradients.
#[test]
fn disable_fp8_gemm_on_the_attention_gemms_gives_f32() {
    type S = Autodiff<burn_te_debug::Debug<burn_te::Te<Flex>>>;
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let config = "off_attention:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: '^dbg_attn\\.bmm[12]$'\n  \
                  transformer_engine:\n    DisableFP8GEMM:\n      enabled: True\n      gemms: [fprop, dgrad, wgrad]\n";
    start_session("fp8-attention-disabled", config);
    let layer = attention::<S>("dbg_attn");
    let ops = operands(3);
    let dpa = Float8CurrentScaling {
        fp8_dpa: true,
        ..Default::default()
    };
    let disabled = run(&layer, &ops, Some(dpa.into()));
    // The high-precision attention of the same path: its core composed of the two batched GEMMs (as the
    // disabled FP8 GEMMs run) rather than the fused core.
    let f32_run = burn_te::fused::with_composed_attention_core(|| run(&layer, &ops, None));
    burn_te_debug::end().unwrap();
    assert_eq!(disabled, f32_run);
    let fp8 = run(
        &attention::<B>("other_attn"),
        &ops,
        Some(
            Float8CurrentScaling {
                fp8_dpa: true,
                ..Default::default()
            }
            .into(),
        ),
    );
    assert_ne!(fp8[0], f32_run[0], "FP8 differs from f32");
}

/// A recipe plan turns FP8 attention on for chosen layers: `fp8_dpa` in a rule's options over a scope without it
/// gives, bit for bit, the run under the recipe with `fp8_dpa`; the option on a block recipe is an error naming it.
#[test]
fn recipe_plans_turn_fp8_attention_on_per_layer() {
    let plan = burn_te::RecipePlan::from_yaml(
        "rules:\n  - name: fp8_attention\n    layers:\n      layer_name_regex_pattern: '^plan_attn\\.bmm[12]$'\n    \
         recipe: fp8_current_scaling\n    options: {fp8_dpa: true}\n",
    )
    .unwrap();
    let ops = operands(5);
    let layer = attention::<B>("plan_attn");
    let device = Default::default();
    let leaf = |x: &Vec<f32>| tensor::<B, 4>(x.clone(), SHAPE, &device).swap_dims(1, 2);
    let forward = || layer.forward(leaf(&ops[0]), leaf(&ops[1]), leaf(&ops[2]), None);
    let under_plan = fp8_autocast(
        true,
        plan.over(Float8CurrentScaling::default()).unwrap(),
        forward,
    )
    .unwrap();
    let dpa = Float8CurrentScaling {
        fp8_dpa: true,
        ..Default::default()
    };
    let under_dpa = fp8_autocast(true, dpa, forward).unwrap();
    let plain = fp8_autocast(true, Float8CurrentScaling::default(), forward).unwrap();
    assert_eq!(values(under_plan.clone()), values(under_dpa));
    assert_ne!(values(under_plan), values(plain));

    let message = burn_te::RecipePlan::from_yaml(
        "rules:\n  - name: bad\n    layers:\n      layer_name_regex_pattern: '.*'\n    recipe: mxfp8\n    options: {fp8_dpa: true}\n",
    )
    .and_then(|plan| plan.over(Float8CurrentScaling::default()).map(|_| ()))
    .unwrap_err()
    .to_string();
    assert!(
        message.contains(
            "fp8_dpa applies to fp8_delayed_scaling and fp8_current_scaling, not to mxfp8"
        ),
        "{message}"
    );
}

/// The attention core under a recipe plan is fused exactly where neither of its GEMMs runs in FP8, as the plan
/// gives their forward recipes:
/// - a rule selecting `bmm1` without FP8 attention (block scaling, no `fp8_dpa`) over current scaling: fused, and
///   the output and q, k, v gradients equal, bit for bit, the run under current scaling alone;
/// - a plan over current scaling with `fp8_dpa` whose rule keeps both GEMMs in high precision: fused, the same bits;
/// - a rule giving only `bmm2` FP8 attention: composed (no fused core counted), and other bits.
///
/// Each run counts its fused cores (forward, backward). The composed core gives other bits than the fused one here,
/// so the comparisons tell the two apart. (Every core under a plan used to take the composed path: the char-GPT's
/// FP8 step took 1.5–1.7× as long with a plan that only kept `lm_head` in high precision.)
#[test]
fn a_plan_keeps_the_attention_core_fused_where_neither_gemm_runs_in_fp8() {
    let rule = |layers: &str, recipe: &str| {
        RecipePlan::from_yaml(&format!(
            "rules:\n  - name: attention\n    layers:\n      layer_name_regex_pattern: '{layers}'\n    {recipe}\n"
        ))
        .unwrap()
    };
    let dpa = Float8CurrentScaling {
        fp8_dpa: true,
        ..Default::default()
    };
    let plans = [
        (
            rule("^kept_attn\\.bmm1$", "recipe: fp8_block_scaling"),
            Float8CurrentScaling::default(),
            [1, 1],
        ),
        (
            rule("^kept_attn\\.bmm[12]$", "recipe: high_precision"),
            dpa,
            [1, 1],
        ),
        (
            rule(
                "^kept_attn\\.bmm2$",
                "recipe: fp8_current_scaling\n    options: {fp8_dpa: true}",
            ),
            Float8CurrentScaling::default(),
            [0, 0],
        ),
    ];
    let ops = operands(7);
    let layer = attention::<B>("kept_attn");
    let alone = run(&layer, &ops, Some(Float8CurrentScaling::default().into()));
    let names = ["FusedAttention", "FusedAttentionBackward"];
    let count = || names.map(|n| burn_te::diagnostics::thread_counter_value(n).unwrap_or(0));
    for (i, (plan, base, fused)) in plans.into_iter().enumerate() {
        let planned = || Some(plan.over(base.clone()).unwrap().into());
        let before = count();
        let under_plan = run(&layer, &ops, planned());
        let after = count();
        let counted = [after[0] - before[0], after[1] - before[1]];
        assert_eq!(counted, fused, "plan {i}: fused cores (forward, backward)");
        if fused == [1, 1] {
            assert_eq!(under_plan, alone, "plan {i}: output and q, k, v gradients");
            let composed =
                burn_te::fused::with_composed_attention_core(|| run(&layer, &ops, planned()));
            assert_ne!(composed, alone, "plan {i}: the composed core's bits");
        } else {
            assert_ne!(under_plan, alone, "plan {i}: bmm2 in FP8");
        }
    }
}

/// Statistics and quantization errors apply to the attention GEMMs like any layer's: LogTensorStats' max of q
/// (bmm1's activation), k (its weight), v (bmm2's weight) and dO (bmm2's gradient) equal the inputs' maxima, and
/// LogQuantizationError's SQNR of bmm1's output equals `10·log10(Σ s² / Σ (s − s₈)²)` recomputed in f64 from
/// `s = q·kᵀ` and `s₈` of the current-scaled q and k.
#[test]
fn statistics_and_quantization_error_apply_to_the_attention_gemms() {
    type S = Autodiff<burn_te_debug::Debug<burn_te::Te<Flex>>>;
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let config = "attention_stats:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: '^stats_attn\\.bmm[12]$'\n  \
                  transformer_engine:\n    LogTensorStats:\n      enabled: True\n      tensors: [activation, weight, gradient]\n      \
                  stats: [max]\n    LogQuantizationError:\n      enabled: True\n      gemms: [fprop]\n      stats: [sqnr]\n";
    let (_, collect) = start_session("fp8-attention-stats", config);
    let layer = attention::<S>("stats_attn");
    let ops = operands(4);
    let dpa = Float8CurrentScaling {
        fp8_dpa: true,
        ..Default::default()
    };
    run(&layer, &ops, Some(dpa.into()));
    burn_te_debug::step().unwrap();
    burn_te_debug::end().unwrap();
    let logged = collect.0.lock().unwrap().clone();
    let get = |name: &str| {
        logged
            .iter()
            .find(|(_, v)| v.name == name)
            .map(|(_, v)| v.value)
            .unwrap_or_else(|| panic!("{name} not logged: {logged:?}"))
    };
    let max = |x: &[f32]| x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    for (name, x) in [
        ("stats_attn.bmm1_activation_max", &ops[0]),
        ("stats_attn.bmm1_weight_max", &ops[1]),
        ("stats_attn.bmm2_weight_max", &ops[2]),
        ("stats_attn.bmm2_gradient_max", &ops[3]),
    ] {
        assert_eq!(get(name), max(x), "{name}");
    }
    let [_, _, s, d] = SHAPE;
    let (q, k) = (f64s(&ops[0]), f64s(&ops[1]));
    let exact = bmm(&q, &k, (s, d, s), false, true);
    let e4 = Fp8Format::E4M3;
    let fp8 = bmm(
        &quantized(&q, e4),
        &quantized(&k, e4),
        (s, d, s),
        false,
        true,
    );
    let noise: f64 = exact.iter().zip(&fp8).map(|(a, b)| (a - b).powi(2)).sum();
    let signal: f64 = exact.iter().map(|a| a * a).sum();
    let sqnr = 10.0 * (signal / noise).log10();
    let logged_sqnr = get("stats_attn.bmm1_output_sqnr");
    assert!(
        (logged_sqnr - sqnr).abs() < 1e-3,
        "bmm1 SQNR: logged {logged_sqnr}, f64 {sqnr}"
    );
}
