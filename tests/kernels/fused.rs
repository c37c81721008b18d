//! The fused element-wise ops of the host path (LayerNorm/RMSNorm, the MLP activations, the attention's masked
//! softmax), forward and backward through `Autodiff<Flex>`, against the same functions composed of Burn ops in
//! f64 on `Autodiff<NdArray<f64>>` and differentiated by Burn's autodiff (TE's own formulas, e.g. GELU's
//! `0.5 x (1 + tanh u)`): an independent reference for the values and for the hand-written backward.

use burn::backend::{Autodiff, Flex, NdArray};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::activation::softmax;
use burn_te::TeBackend;
use burn_te::fused::{AttentionMask, NormKind, NormSpec, with_composed_elementwise};
use burn_te::nn::{Activation, TransformerLayer, TransformerLayerConfig};

use crate::common::Rng;

type F = Autodiff<Flex>;
type R = Autodiff<NdArray<f64>>;

fn fused<const D: usize>(values: &[f32], shape: [usize; D]) -> Tensor<F, D> {
    Tensor::from_data(TensorData::new(values.to_vec(), shape), &Default::default()).require_grad()
}

fn reference<const D: usize>(values: &[f32], shape: [usize; D]) -> Tensor<R, D> {
    let values: Vec<f64> = values.iter().map(|&v| f64::from(v)).collect();
    Tensor::from_data(TensorData::new(values, shape), &Default::default()).require_grad()
}

fn host<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f64> {
    t.into_data()
        .convert::<f64>()
        .into_vec::<f64>()
        .expect("float data")
}

fn primitive<const D: usize>(t: &Tensor<F, D>) -> burn::tensor::ops::FloatTensor<F> {
    t.clone().into_primitive().tensor()
}

fn tensor<const D: usize>(t: burn::tensor::ops::FloatTensor<F>) -> Tensor<F, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Every element within `tol · (|expected| + mean |expected|)` (mean over the tensor: the scale of its values);
/// returns the largest error in that unit.
fn assert_close(what: &str, actual: &[f64], expected: &[f64], tol: f64) -> f64 {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths");
    let scale = expected.iter().map(|v| v.abs()).sum::<f64>() / expected.len().max(1) as f64;
    let mut worst = 0.0f64;
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        let unit = e.abs() + scale;
        let err = (a - e).abs() / unit.max(f64::MIN_POSITIVE);
        assert!(
            err <= tol,
            "{what}: element {i} = {a:e}, f64 reference {e:e} (error {err:e} of |e| + mean |e|, > {tol:e})"
        );
        worst = worst.max(err);
    }
    worst
}

/// The gradient of `fused` (from `grads`) against that of `reference` (from `rgrads`), as [`assert_close`].
fn assert_grad<const D: usize, const E: usize>(
    what: &str,
    (fused, grads): (
        &Tensor<F, D>,
        &<F as burn::tensor::backend::AutodiffBackend>::Gradients,
    ),
    (reference, rgrads): (
        &Tensor<R, E>,
        &<R as burn::tensor::backend::AutodiffBackend>::Gradients,
    ),
) {
    let actual = host(
        fused
            .grad(grads)
            .unwrap_or_else(|| panic!("{what}: no gradient")),
    );
    let expected = host(
        reference
            .grad(rgrads)
            .unwrap_or_else(|| panic!("{what}: no reference gradient")),
    );
    assert_close(what, &actual, &expected, TOL);
}

/// f32 results of row reductions over a few hundred elements: a few units of f32's 2⁻²⁴ per reduction step.
const TOL: f64 = 2e-5;

#[test]
fn norms_forward_and_backward_match_f64() {
    // 183 rows of 97: several row blocks per task split, a width that is no multiple of the 8 lanes.
    let (shape, width) = ([3, 61, 97], 97);
    let mut rng = Rng::new(11);
    let x = rng.normal(3 * 61 * width, 0.5, 2.0);
    let upstream = rng.normal(3 * 61 * width, 0.0, 1.0);
    for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
        for zero_centered_gamma in [false, true] {
            let what = format!("{kind:?} (zero-centred γ: {zero_centered_gamma})");
            let gamma = rng.normal(width, if zero_centered_gamma { 0.0 } else { 1.0 }, 0.3);
            let beta = rng.normal(width, 0.0, 0.3);
            let with_beta = kind == NormKind::LayerNorm;
            let spec = NormSpec {
                kind,
                eps: 1e-5,
                zero_centered_gamma,
            };

            let (fx, fg, fb) = (
                fused(&x, shape),
                fused(&gamma, [width]),
                fused(&beta, [width]),
            );
            let y = F::te_norm(
                primitive(&fx),
                primitive(&fg),
                with_beta.then(|| primitive(&fb)),
                spec,
            )
            .expect("norm")
            .expect("Flex has the fused norm");
            let y: Tensor<F, 3> = tensor(y);
            let grads = (y.clone() * fused(&upstream, shape)).sum().backward();

            let (rx, rg, rb) = (
                reference(&x, shape),
                reference(&gamma, [width]),
                reference(&beta, [width]),
            );
            let applied = if zero_centered_gamma {
                rg.clone() + 1.0
            } else {
                rg.clone()
            };
            let applied = applied.unsqueeze::<3>();
            let ry = match kind {
                NormKind::LayerNorm => {
                    let (var, mean) = rx.clone().var_mean_bias(2);
                    (rx.clone() - mean) / (var + 1e-5).sqrt() * applied + rb.clone().unsqueeze()
                }
                NormKind::RmsNorm => {
                    rx.clone() / (rx.clone().square().mean_dim(2) + 1e-5).sqrt() * applied
                }
            };
            let rgrads = (ry.clone() * reference(&upstream, shape)).sum().backward();

            assert_close(&format!("{what} y"), &host(y), &host(ry), TOL);
            assert_grad(&format!("{what} dx"), (&fx, &grads), (&rx, &rgrads));
            assert_grad(&format!("{what} dγ"), (&fg, &grads), (&rg, &rgrads));
            if with_beta {
                assert_grad(&format!("{what} dβ"), (&fb, &grads), (&rb, &rgrads));
            }
        }
    }
}

/// TE's activation formulas in f64 (GELU as `0.5 x (1 + tanh u)`, not the σ form the kernel uses).
fn reference_activation(activation: Activation, x: Tensor<R, 2>) -> Tensor<R, 2> {
    use burn::tensor::activation::{relu, sigmoid, tanh};
    let f = |x: Tensor<R, 2>| match activation {
        Activation::Gelu | Activation::Geglu => {
            let u = (x.clone() + x.clone().powi_scalar(3) * 0.044715)
                * (2.0 / std::f64::consts::PI).sqrt();
            x * (tanh(u) + 1.0) * 0.5
        }
        Activation::Qgelu | Activation::Qgeglu => x.clone() * sigmoid(x * 1.702),
        Activation::Relu | Activation::Reglu => relu(x),
        Activation::Srelu | Activation::Sreglu => relu(x).powi_scalar(2),
        Activation::Silu | Activation::Swiglu => x.clone() * sigmoid(x),
    };
    if !activation.is_gated() {
        return f(x);
    }
    let [rows, width] = x.dims();
    let value = x.clone().slice([0..rows, width / 2..width]);
    f(x.slice([0..rows, 0..width / 2])) * value
}

#[test]
fn activations_forward_and_backward_match_f64() {
    let (rows, width) = (300, 2 * 45);
    let mut rng = Rng::new(12);
    // Wide enough to reach GELU's and σ's tails (|x| up to ~12), with exact zeros for ReLU's kink.
    let mut x = rng.normal(rows * width, 0.0, 3.0);
    x.iter_mut().step_by(53).for_each(|v| *v = 0.0);
    for activation in Activation::ALL {
        let out = if activation.is_gated() {
            width / 2
        } else {
            width
        };
        let upstream = rng.normal(rows * out, 0.0, 1.0);
        let fx = fused(&x, [rows, width]);
        let launches = counter("FusedActivation");
        let y = activation.apply(fx.clone()).expect("activation");
        assert_eq!(
            counter("FusedActivation"),
            launches + 1,
            "{activation:?}: the fused op ran"
        );
        let grads = (y.clone() * fused(&upstream, [rows, out])).sum().backward();
        let rx = reference(&x, [rows, width]);
        let ry = reference_activation(activation, rx.clone());
        let rgrads = (ry.clone() * reference(&upstream, [rows, out]))
            .sum()
            .backward();
        let what = format!("{activation:?}");
        assert_close(&format!("{what} y"), &host(y), &host(ry), TOL);
        assert_grad(&format!("{what} dx"), (&fx, &grads), (&rx, &rgrads));
    }
}

fn counter(name: &str) -> u64 {
    burn_te::diagnostics::thread_counter_value(name).unwrap_or(0)
}

#[test]
fn masked_softmax_forward_and_backward_match_f64() {
    let [batch, heads, queries, keys] = [2, 3, 37, 37];
    let shape = [batch, heads, queries, keys];
    let scale = 0.125f32;
    let mut rng = Rng::new(13);
    let scores = rng.normal(batch * heads * queries * keys, 0.0, 8.0);
    let upstream = rng.normal(batch * heads * queries * keys, 0.0, 1.0);
    // Batch 0 pads its last 5 keys; batch 1 pads every key (its rows are all zeros, with zero gradients).
    let padding: Vec<bool> = (0..batch * keys)
        .map(|i| i / keys == 1 || i % keys >= keys - 5)
        .collect();
    for (causal, padded) in [(false, false), (true, false), (false, true), (true, true)] {
        let what = format!("softmax (causal {causal}, padding {padded})");
        let device = Default::default();
        let pad = || {
            padded.then(|| {
                Tensor::<F, 2, Bool>::from_data(
                    TensorData::new(padding.clone(), [batch, keys]),
                    &device,
                )
            })
        };
        let fs = fused(&scores, shape);
        let mask = AttentionMask {
            causal,
            padding: pad().map(|p| p.into_primitive()),
        };
        let p = F::te_softmax(primitive(&fs), scale, mask)
            .expect("softmax")
            .expect("Flex has the fused softmax");
        let p: Tensor<F, 4> = tensor(p);
        let grads = (p.clone() * fused(&upstream, shape)).sum().backward();

        // The composed attention softmax, in f64.
        let rs = reference(&scores, shape);
        let masked: Vec<bool> = (0..batch * heads * queries * keys)
            .map(|i| {
                let (b, q, k) = (i / (heads * queries * keys), i / keys % queries, i % keys);
                (causal && k > q) || (padded && padding[b * keys + k])
            })
            .collect();
        let rmask =
            Tensor::<R, 4, Bool>::from_data(TensorData::new(masked, shape), &Default::default());
        let rp = softmax(
            (rs.clone() * f64::from(scale)).mask_fill(rmask.clone(), -1.0e30),
            3,
        )
        .mask_fill(rmask, 0.0);
        let rgrads = (rp.clone() * reference(&upstream, shape)).sum().backward();

        let (p, rp) = (host(p), host(rp));
        if padded {
            let row = heads * queries * keys;
            assert!(
                p[row..].iter().all(|&v| v == 0.0),
                "{what}: a fully padded batch gives zeros"
            );
        }
        assert_close(&format!("{what} p"), &p, &rp, TOL);
        assert_grad(&format!("{what} ds"), (&fs, &grads), (&rs, &rgrads));
    }
}

/// The attention core of `DotProductAttention` composed of Burn ops in f64: q `[s, b, h, d]`, k and v
/// `[s, b, g, d]` (`[b, s, ..]` unless `seq_first`) to `[s, b, h · d]`, masked keys at 0.
fn reference_attention(
    [q, k, v]: [Tensor<R, 4>; 3],
    seq_first: bool,
    scale: f64,
    causal: bool,
    padding: Option<&[bool]>,
) -> Tensor<R, 3> {
    let bhsd = |t: Tensor<R, 4>| {
        if seq_first {
            t.permute([1, 2, 0, 3])
        } else {
            t.swap_dims(1, 2)
        }
    };
    let (q, k, v) = (bhsd(q), bhsd(k), bhsd(v));
    let [batch, heads, queries, d] = q.dims();
    let [_, groups, keys, _] = k.dims();
    let repeat = |t: Tensor<R, 4>| {
        t.unsqueeze_dim::<5>(2)
            .expand([batch, groups, heads / groups, keys, d])
            .reshape([batch, heads, keys, d])
    };
    let (k, v) = (repeat(k), repeat(v));
    let masked: Vec<bool> = (0..batch * heads * queries * keys)
        .map(|i| {
            let (b, qi, ki) = (i / (heads * queries * keys), i / keys % queries, i % keys);
            (causal && ki > qi) || padding.is_some_and(|p| p[b * keys + ki])
        })
        .collect();
    let mask = Tensor::<R, 4, Bool>::from_data(
        TensorData::new(masked, [batch, heads, queries, keys]),
        &Default::default(),
    );
    let scores = q.matmul(k.swap_dims(2, 3)) * scale;
    let p = softmax(scores.mask_fill(mask.clone(), -1.0e30), 3).mask_fill(mask, 0.0);
    let out = p.matmul(v);
    if seq_first {
        out.permute([2, 0, 1, 3])
            .reshape([queries, batch, heads * d])
    } else {
        out.swap_dims(1, 2).reshape([batch, queries, heads * d])
    }
}

/// The fused attention core against the composed f64 attention, forward and backward: q, k and v as views of one
/// packed projection output (`sbhd` and `bshd`, strided, no copy; its gradient written packed) and as separate
/// `bshd` tensors, grouped-query heads,
/// causal with more queries than one block of rows (`ROWS`), padding (one batch fully padded: zeros, zero
/// gradients), and cross-attention with fewer keys than queries.
#[test]
fn attention_core_forward_and_backward_match_f64() {
    use burn_te::fused::AttentionSpec;
    let rows = burn_te_kernels::host::fused::attention::ROWS;
    let (batch, heads, groups) = (2, 4, 2);
    let mut rng = Rng::new(17);
    // A head of 40 values spans three of the core's 16-column panels, the last one partial: a causal block of
    // queries reads a leading part of each head's keys and values, packed once for all blocks.
    let cases = [
        // (seq_first, queries, keys, causal, padded, head_dim)
        (true, rows + 6, rows + 6, true, false, 16),
        (true, rows + 6, rows + 6, false, true, 16),
        (false, rows + 6, rows + 6, true, true, 40),
        (false, rows + 6, 37, false, false, 16),
        (false, rows + 6, rows + 6, true, false, 40),
    ];
    for (seq_first, queries, keys, causal, padded, d) in cases {
        let what = format!(
            "attention (sbhd {seq_first}, {queries} queries, {keys} keys, causal {causal}, padding {padded}, \
             head_dim {d})"
        );
        let device = Default::default();
        let lead = |s: usize| if seq_first { [s, batch] } else { [batch, s] };
        let [q0, q1] = lead(queries);
        let [k0, k1] = lead(keys);
        // Batch 0 pads its last 5 keys; batch 1 pads every key.
        let padding: Vec<bool> = (0..batch * keys)
            .map(|i| i / keys == 1 || i % keys >= keys - 5)
            .collect();
        let padding = padded.then_some(padding);
        let scale = 1.0 / (d as f32).sqrt();
        let upstream = rng.normal(q0 * q1 * heads * d, 0.0, 1.0);
        let spec = AttentionSpec {
            seq_first,
            scale,
            dropout: None,
        };
        let pad_tensor = || {
            padding.clone().map(|p| {
                Tensor::<F, 2, Bool>::from_data(TensorData::new(p, [batch, keys]), &device)
                    .into_primitive()
            })
        };
        let run = |[q, k, v]: [Tensor<F, 4>; 3]| {
            let mask = AttentionMask {
                causal,
                padding: pad_tensor(),
            };
            let out = F::te_attention(primitive(&q), primitive(&k), primitive(&v), spec, mask)
                .expect("attention")
                .expect("Flex has the fused attention");
            tensor::<3>(out)
        };
        let reference_of = |[q, k, v]: [Tensor<R, 4>; 3]| {
            reference_attention(
                [q, k, v],
                seq_first,
                f64::from(scale),
                causal,
                padding.as_deref(),
            )
        };
        // The inputs whose gradients are compared (fused, f64 reference, name), and both outputs.
        let (inputs, out, rout) = if queries == keys && (seq_first || !padded) {
            // One packed [s, b, heads + 2·groups, d] (or [b, s, ..]) tensor: given whole to
            // `te_attention_packed` (one backward node, whose gradient the backend writes packed) in the causal
            // cases, as q, k and v views of it to `te_attention` in the other.
            let values = rng.normal(q0 * q1 * (heads + 2 * groups) * d, 0.0, 1.0);
            let shape = [q0, q1, heads + 2 * groups, d];
            let (fp, rp) = (fused(&values, shape), reference(&values, shape));
            let (out, name) = if causal {
                let mask = AttentionMask {
                    causal,
                    padding: pad_tensor(),
                };
                let out = F::te_attention_packed(primitive(&fp), (heads, groups), spec, mask)
                    .expect("attention")
                    .expect("Flex has the fused attention");
                (tensor::<3>(out), "d(qkv), packed op")
            } else {
                let out = run([
                    fp.clone().narrow(2, 0, heads),
                    fp.clone().narrow(2, heads, groups),
                    fp.clone().narrow(2, heads + groups, groups),
                ]);
                (out, "d(qkv), views")
            };
            let rout = reference_of([
                rp.clone().narrow(2, 0, heads),
                rp.clone().narrow(2, heads, groups),
                rp.clone().narrow(2, heads + groups, groups),
            ]);
            (vec![(fp, rp, name)], out, rout)
        } else {
            let (qs, ks) = ([q0, q1, heads, d], [k0, k1, groups, d]);
            let mut pair = |shape: [usize; 4]| {
                let values = rng.normal(shape.iter().product(), 0.0, 1.0);
                (fused(&values, shape), reference(&values, shape))
            };
            let ((fq, rq), (fk, rk), (fv, rv)) = (pair(qs), pair(ks), pair(ks));
            let out = run([fq.clone(), fk.clone(), fv.clone()]);
            let rout = reference_of([rq.clone(), rk.clone(), rv.clone()]);
            (
                vec![(fq, rq, "dq"), (fk, rk, "dk"), (fv, rv, "dv")],
                out,
                rout,
            )
        };
        let grads = (out.clone() * fused(&upstream, [q0, q1, heads * d]))
            .sum()
            .backward();
        let rgrads = (rout.clone() * reference(&upstream, [q0, q1, heads * d]))
            .sum()
            .backward();
        let (out, rout) = (host(out), host(rout));
        if padded && !seq_first {
            // Batch 1 (the second half of [b, s, ..]) is fully padded: zeros.
            let batch1 = &out[out.len() / 2..];
            assert!(
                batch1.iter().all(|&v| v == 0.0),
                "{what}: a fully padded batch gives zeros"
            );
        }
        assert_close(&format!("{what} output"), &out, &rout, TOL);
        for (fused_input, reference_input, name) in &inputs {
            assert_grad(
                &format!("{what} {name}"),
                (fused_input, &grads),
                (reference_input, &rgrads),
            );
        }
    }
}

/// The attention core's GEMM sums each output element over the depth in order, one rounding per product (a fused
/// multiply-add where the CPU has FMA), whatever block of rows and panel of columns it falls in, then writes
/// `beta · sum` or adds it: the bits of that loop, for every layout its operands come in (a transposed right operand,
/// a row-major one, strided ones), row counts around its row blocks and column counts around its 32-column panels.
#[test]
fn head_gemm_sums_each_element_in_depth_order_on_every_layout() {
    use burn_te_kernels::host::fused::head_gemm::{PackedRhs, Strided, head_gemm};
    #[cfg(target_arch = "x86_64")]
    let fma = std::arch::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    let fma = true;
    let mut rng = Rng::new(5);
    let mut panels = PackedRhs::default();
    let mut cases = 0;
    for (m, n, k) in [
        (1, 1, 1),
        (5, 31, 16),
        (6, 32, 64),
        (7, 33, 65),
        (8, 32, 64),
        (13, 40, 3),
        (15, 33, 17),
        (16, 64, 9),
        (70, 128, 64),
    ] {
        let a = rng.normal(m * k, 0.0, 1.0);
        let b = rng.normal(k * n, 0.0, 1.0);
        let start = rng.normal(m * n, 0.0, 1.0);
        // (row stride, column stride) of each operand: row-major, or transposed (the other one contiguous).
        for lhs_t in [false, true] {
            for rhs_layout in 0..3 {
                for dst_t in [false, true] {
                    for (accumulate, beta) in [(false, 0.125f32), (true, 0.7)] {
                        let lhs_strides = if lhs_t { (1, m) } else { (k, 1) };
                        // 0: row-major; 1: transposed (the depth contiguous, kᵀ of the core); 2: each element 3 apart.
                        let (rhs_strides, rhs_len) = match rhs_layout {
                            0 => ((n, 1), k * n),
                            1 => ((1, k), k * n),
                            _ => ((3 * n, 3), 3 * k * n),
                        };
                        let dst_strides = if dst_t { (1, m) } else { (n, 1) };
                        let at = |(rs, cs): (usize, usize), r: usize, c: usize| r * rs + c * cs;
                        let lhs: Vec<f32> = {
                            let mut v = vec![0.0; m * k];
                            for r in 0..m {
                                for p in 0..k {
                                    v[at(lhs_strides, r, p)] = a[r * k + p];
                                }
                            }
                            v
                        };
                        let rhs: Vec<f32> = {
                            let mut v = vec![f32::NAN; rhs_len];
                            for p in 0..k {
                                for c in 0..n {
                                    v[at(rhs_strides, p, c)] = b[p * n + c];
                                }
                            }
                            v
                        };
                        let mut dst = vec![0.0f32; m * n];
                        for r in 0..m {
                            for c in 0..n {
                                dst[at(dst_strides, r, c)] = start[r * n + c];
                            }
                        }
                        let strided = |ptr: *const f32, (row_stride, col_stride)| Strided {
                            ptr,
                            row_stride,
                            col_stride,
                        };
                        // SAFETY: every element of the three m × k, k × n and m × n matrices lies in its vector at
                        // its strides; `dst` is a vector of its own.
                        unsafe {
                            head_gemm(
                                (m, n, k),
                                (dst.as_mut_ptr(), dst_strides.0, dst_strides.1),
                                accumulate,
                                strided(lhs.as_ptr(), lhs_strides),
                                strided(rhs.as_ptr(), rhs_strides),
                                beta,
                                &mut panels,
                            )
                        };
                        for r in 0..m {
                            for c in 0..n {
                                let mut sum = 0.0f32;
                                for p in 0..k {
                                    let (x, y) = (a[r * k + p], b[p * n + c]);
                                    sum = if fma { x.mul_add(y, sum) } else { sum + x * y };
                                }
                                let old = start[r * n + c];
                                let want = if accumulate {
                                    old + beta * sum
                                } else {
                                    beta * sum
                                };
                                let got = dst[at(dst_strides, r, c)];
                                assert_eq!(
                                    got.to_bits(),
                                    want.to_bits(),
                                    "{m}×{n}×{k}, lhs transposed {lhs_t}, rhs layout {rhs_layout}, dst transposed \
                                     {dst_t}, accumulate {accumulate}: ({r}, {c}) is {got}, the in-order sum gives {want}"
                                );
                            }
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 9 * 2 * 3 * 2 * 2);
}

/// The fused kernels' `exp` (what GELU's σ and the softmax use) against f64 over the whole f32 range it takes.
#[test]
fn fused_exp_is_within_two_ulp() {
    use burn_te_kernels::host::fused::exp;
    let mut worst = 0.0f64;
    for i in 0..=200_000 {
        let x = -87.0 + 175.0 * f64::from(i) / 200_000.0;
        let x = x as f32;
        let expected = f64::from(x).exp();
        let ulp = f64::from(f32::EPSILON) * 2f64.powi(expected.log2().floor() as i32);
        let err = (f64::from(exp(x)) - expected).abs() / ulp;
        assert!(
            err <= 2.0,
            "exp({x}) = {:e}, f64 {expected:e}: {err} ulp",
            exp(x)
        );
        worst = worst.max(err);
    }
    assert!(exp(f32::NAN).is_nan());
    assert_eq!(exp(-1000.0), exp(-87.336_54), "clamped below");
    assert_eq!(exp(1000.0), exp(88.0), "clamped above");
}

/// Column sums (dγ, dβ) add fixed row blocks in order: the same bits on one thread as on the whole pool.
#[test]
fn fused_norm_gradients_do_not_depend_on_the_thread_count() {
    use burn_te_kernels::host::fused::norm::{NormSpec, norm_backward, norm_forward};
    let (rows, width) = (4096, 64);
    let mut rng = Rng::new(14);
    let x = rng.normal(rows * width, 0.0, 1.0);
    let dy = rng.normal(rows * width, 0.0, 1.0);
    let gamma = rng.normal(width, 1.0, 0.1);
    let spec = NormSpec {
        kind: NormKind::LayerNorm,
        eps: 1e-5,
        zero_centered_gamma: false,
    };
    let run = || {
        let (_, stats) = norm_forward(&x, &gamma, None, spec);
        let (dx, dgamma, dbeta) = norm_backward(&dy, &x, &gamma, &stats, spec);
        (dx.to_vec(), dgamma, dbeta)
    };
    let pooled = run();
    let single = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool")
        .install(run);
    assert_eq!(pooled, single);
}

/// A TransformerLayer's forward and backward with the fused ops against the same layer composing Burn ops: the
/// output and every parameter's gradient within the f32 tolerance, and each fused op counted as it ran (two norms,
/// one activation, one attention core, each forward and backward).
#[test]
fn transformer_layer_with_fused_ops_matches_the_composed_layer() {
    let device = Default::default();
    F::seed(&device, 5);
    let layer: TransformerLayer<F> = TransformerLayerConfig::new(64, 256, 4)
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0)
        .init(&device);
    let x = Tensor::<F, 3>::random(
        [24, 2, 64],
        burn::tensor::Distribution::Normal(0.0, 1.0),
        &device,
    );
    let names = [
        "FusedNorm",
        "FusedNormBackward",
        "FusedActivation",
        "FusedActivationBackward",
        "FusedSoftmax",
        "FusedSoftmaxBackward",
        "FusedAttention",
        "FusedAttentionBackward",
    ];
    let run = || {
        let before: Vec<u64> = names.iter().map(|n| counter(n)).collect();
        let y = layer.forward(x.clone(), None);
        let grads = (y.clone() * y.clone()).sum().backward();
        let counts: Vec<u64> = names
            .iter()
            .zip(&before)
            .map(|(n, b)| counter(n) - b)
            .collect();
        let mut params = Vec::new();
        struct Collect<'a>(
            &'a burn::backend::autodiff::grads::Gradients,
            &'a mut Vec<Vec<f64>>,
        );
        impl burn::module::ModuleVisitor<F> for Collect<'_> {
            fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<F, D>>) {
                if let Some(grad) = param.val().grad(self.0) {
                    self.1.push(host(grad));
                }
            }
        }
        layer.visit(&mut Collect(&grads, &mut params));
        (host(y), params, counts)
    };
    let (y, grads, counts) = run();
    // The attention core runs as one fused op (its softmax is inside it).
    assert_eq!(
        counts,
        vec![2, 2, 1, 1, 0, 0, 1, 1],
        "fused ops run ({names:?})"
    );
    let (ry, rgrads, rcounts) = with_composed_elementwise(run);
    assert_eq!(rcounts, vec![0; 8], "the composed layer runs none");
    assert_close("layer output", &y, &ry, 1e-4);
    assert_eq!(grads.len(), rgrads.len());
    for (i, (g, r)) in grads.iter().zip(&rgrads).enumerate() {
        assert_close(&format!("parameter {i}'s gradient"), g, r, 1e-4);
    }
}

/// Under `Te<B>` the fused ops are ops like any other: eager mode names the one whose output first holds a NaN.
#[test]
fn eager_mode_names_the_fused_op_that_made_the_first_nan() {
    use burn_te::Te;
    use burn_te::diagnostics::{self, DiagnosticsConfig};
    use burn_te::nn::LayerNormConfig;
    type T = Te<Flex>;
    diagnostics::configure_thread(DiagnosticsConfig::new().with_eager(true)).expect("config");
    diagnostics::clear_non_finite();
    let device = Default::default();
    let norm = LayerNormConfig::new(16).init::<T>(&device);
    // Row 1's sum overflows f32: its mean is +inf, and every output of the row NaN.
    let mut values = vec![0.5f32; 4 * 16];
    values[16..32].fill(3.0e38);
    let _ = norm.forward(Tensor::<T, 2>::from_data(
        TensorData::new(values, [4, 16]),
        &device,
    ));
    let origin = diagnostics::first_non_finite();
    diagnostics::clear_thread_config();
    let origin = origin.expect("reported");
    assert_eq!(origin.op, "te_norm", "{origin}");
    assert_eq!(origin.nan_count, 16, "the overflowing row: {origin}");
}

/// The ops themselves name bad shapes (the modules check before calling them; a direct caller gets the error).
#[test]
fn fused_ops_name_bad_shapes() {
    let spec = NormSpec {
        kind: NormKind::LayerNorm,
        eps: 1e-5,
        zero_centered_gamma: false,
    };
    let x = fused(&[1.0; 24], [4, 6]);
    let err = F::te_norm(primitive(&x), primitive(&fused(&[1.0; 5], [5])), None, spec)
        .expect_err("γ of 5 for rows of 6");
    assert!(
        err.to_string().contains("te_norm") && err.to_string().contains("[6]"),
        "{err}"
    );
    let odd = fused(&[1.0; 20], [4, 5]);
    let err = F::te_activation(primitive(&odd), burn_te::fused::Pointwise::Gelu, true)
        .expect_err("gated on an odd width");
    assert!(err.to_string().contains("te_activation"), "{err}");
    let err = F::te_softmax(
        primitive(&x),
        1.0,
        AttentionMask {
            causal: true,
            padding: None,
        },
    )
    .expect_err("scores of rank 2");
    assert!(
        err.to_string().contains("[batch, heads, queries, keys]"),
        "{err}"
    );
}

/// Each column's sum over the rows, in row order, in f32 (what the bias gradient kernel promises bit for bit), and
/// its f64 sum with the bound of an in-order f32 sum (`rows · ε · Σ|x|`) checked against it.
fn column_sums_in_row_order(values: &[f32], width: usize) -> Vec<f32> {
    let rows = values.len() / width;
    (0..width)
        .map(|c| {
            let (mut sum, mut exact, mut magnitude) = (0.0f32, 0.0f64, 0.0f64);
            for r in 0..rows {
                let v = values[r * width + c];
                sum += v;
                exact += f64::from(v);
                magnitude += f64::from(v).abs();
            }
            let bound = rows as f64 * f64::from(f32::EPSILON) * magnitude;
            assert!(
                (f64::from(sum) - exact).abs() <= bound,
                "column {c}: the in-order f32 sum {sum} is off f64's {exact} by more than {bound}"
            );
            sum
        })
        .collect()
}

/// The bias gradient (`TeBackend::te_bias_grad`: the output gradient's column sums in blocks of 128 columns on
/// every core on Flex) is each column summed in row order, bit for bit, for widths of whole and partial blocks,
/// small tensors (one thread) and large ones, contiguous and transposed; and a TE `Linear`'s bias gradient in an FP8
/// scope on `Autodiff<Te<Flex>>` goes through it (the output gradient is exactly `g` there).
#[test]
fn bias_gradient_sums_each_column_in_row_order() {
    use burn_te::nn::LinearConfig;
    use burn_te::{DelayedScaling, Te, fp8_autocast};
    let device = Default::default();
    let mut rng = Rng::new(22);
    for [batch, rows, width] in [
        [3, 5, 7],
        [1, 1024, 1],
        [4, 256, 129],
        [2, 300, 1000],
        [1, 40_000, 2],
    ] {
        let g = rng.normal(batch * rows * width, 0.5, 2.0);
        let expected = column_sums_in_row_order(&g, width);
        let gs =
            Tensor::<Flex, 3>::from_data(TensorData::new(g.clone(), [batch, rows, width]), &device);
        // A transposed view of a [batch, width, rows] tensor holding the same values.
        let gt = Tensor::<Flex, 3>::from_data(gs.clone().swap_dims(1, 2).into_data(), &device)
            .swap_dims(1, 2);
        for (what, grad) in [("contiguous", gs), ("transposed", gt)] {
            let before = counter("FusedBiasGrad");
            let sums = <Flex as TeBackend>::te_bias_grad(grad.into_primitive().tensor());
            assert_eq!(
                counter("FusedBiasGrad") - before,
                1,
                "{what}: the host kernel ran"
            );
            let sums = Tensor::<Flex, 1>::from_primitive(TensorPrimitive::Float(sums));
            assert_eq!(sums.dims(), [width]);
            let sums = sums.into_data().to_vec::<f32>().expect("f32");
            for (c, (s, e)) in sums.iter().zip(&expected).enumerate() {
                assert_eq!(
                    s.to_bits(),
                    e.to_bits(),
                    "{what} [{batch}, {rows}, {width}] column {c}: {s} vs {e}"
                );
            }
        }
    }

    type T = Autodiff<Te<Flex>>;
    let (rows, d_in, d_out) = (300, 64, 200);
    let layer = LinearConfig::new(d_in, d_out)
        .with_name(Some("fc".into()))
        .init::<T>(&device);
    let x = Tensor::<T, 2>::from_data(
        TensorData::new(rng.normal(rows * d_in, 0.0, 1.0), [rows, d_in]),
        &device,
    );
    let g = rng.normal(rows * d_out, 0.25, 1.0);
    let before = counter("FusedBiasGrad");
    let y = fp8_autocast(true, DelayedScaling::default(), || layer.forward(x.clone())).unwrap();
    let grads = (y * Tensor::<T, 2>::from_data(TensorData::new(g.clone(), [rows, d_out]), &device))
        .sum()
        .backward();
    assert_eq!(
        counter("FusedBiasGrad") - before,
        1,
        "the layer's bias gradient ran on the host kernel"
    );
    let bias = layer.bias.as_ref().expect("a bias").val();
    let dbias = bias.grad(&grads).expect("the bias's gradient");
    let dbias = dbias.into_data().to_vec::<f32>().expect("f32");
    for (c, (s, e)) in dbias
        .iter()
        .zip(column_sums_in_row_order(&g, d_out))
        .enumerate()
    {
        assert_eq!(
            s.to_bits(),
            e.to_bits(),
            "TE Linear's dbias column {c}: {s} vs {e}"
        );
    }
}

/// The fprop GEMM's bias (`TeBackend::te_add_bias`, row by row on every core on Flex) against the sums computed in
/// f64 and rounded once (what `x + b` in f32 is), for contiguous and transposed outputs over several blocks of
/// rows; a bias that is not the last dimension keeps Burn's broadcasting.
#[test]
fn bias_added_row_by_row_is_each_sum_rounded_once() {
    let device = Default::default();
    let mut rng = Rng::new(21);
    let [batch, rows, width] = [7, 100, 53];
    let x = rng.normal(batch * rows * width, 0.0, 3.0);
    let b = rng.normal(width, 1.0, 2.0);
    let xs =
        Tensor::<Flex, 3>::from_data(TensorData::new(x.clone(), [batch, rows, width]), &device);
    let bias = Tensor::<Flex, 1>::from_data(TensorData::new(b.clone(), [width]), &device);
    // Contiguous, and a transposed view of a [batch, width, rows] tensor (read through its strides).
    let xt = Tensor::<Flex, 3>::from_data(xs.clone().swap_dims(1, 2).into_data(), &device)
        .swap_dims(1, 2);
    for (what, out) in [("contiguous", xs), ("transposed", xt)] {
        let before = counter("FusedBias");
        let sum = <Flex as TeBackend>::te_add_bias(
            out.into_primitive().tensor(),
            bias.clone().into_primitive().tensor(),
        );
        assert_eq!(
            counter("FusedBias") - before,
            1,
            "{what}: the host kernel ran"
        );
        let sum = Tensor::<Flex, 3>::from_primitive(TensorPrimitive::Float(sum));
        assert_eq!(sum.dims(), [batch, rows, width]);
        let sum = sum.into_data().to_vec::<f32>().expect("f32");
        for (i, (&s, &x)) in sum.iter().zip(&x).enumerate() {
            let expected = (f64::from(x) + f64::from(b[i % width])) as f32;
            assert_eq!(
                s.to_bits(),
                expected.to_bits(),
                "{what}: value {i}: {s} vs {expected}"
            );
        }
    }
    // A one-value bias broadcasts as Burn's add does.
    let x = Tensor::<Flex, 2>::from_data(
        TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2]),
        &device,
    );
    let one = Tensor::<Flex, 1>::from_data(TensorData::new(vec![0.5f32], [1]), &device);
    let sum = <Flex as TeBackend>::te_add_bias(
        x.into_primitive().tensor(),
        one.into_primitive().tensor(),
    );
    let sum = Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(sum));
    assert_eq!(
        sum.into_data().to_vec::<f32>().unwrap(),
        vec![1.5, 2.5, 3.5, 4.5]
    );
}

/// `Te<Flex>`'s layout ops (`TeBackend::te_reshape`, `te_slice_assign`: a strided view copied on every core)
/// against the element each output position must hold, found one index at a time from the source values: the
/// attention's context `[b, h, s, d]` permuted and reshaped to `[s, b, h·d]` (as `DotProductAttention` does
/// before its projection), a 2-D transpose flattened over several copy tasks, a flipped view (Flex's own copy),
/// contiguous views (no strided copy), and a permuted value written into a packed `[s, b, slots, d]` tensor (the
/// backward of `narrow`); then both through `Autodiff<Te<Flex>>`'s backward, whose gradients are the upstream
/// values moved back by the same index maps.
#[test]
fn te_flex_layout_ops_move_every_value_where_its_index_says() {
    use burn_te::Te;
    type T = Te<Flex>;
    let device = Default::default();
    let mut rng = Rng::new(45);
    let copies = || counter("HostLayoutCopies");
    // The first element whose bits differ, named.
    let same = |what: &str, got: Vec<f32>, want: Vec<f32>| {
        assert_eq!(got.len(), want.len(), "{what}: length");
        if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            panic!("{what}: element {i} is {}, expected {}", got[i], want[i]);
        }
    };

    // The context: [b, h, s, d] permuted to [s, b, h, d], reshaped to [s, b, h·d].
    let (b, h, s, d) = (3, 5, 37, 24);
    let ctx = rng.normal(b * h * s * d, 0.0, 1.0);
    let t = Tensor::<T, 4>::from_data(TensorData::new(ctx.clone(), [b, h, s, d]), &device);
    let before = copies();
    let out = t.permute([2, 0, 1, 3]).reshape([s, b, h * d]);
    assert_eq!(copies() - before, 1, "the context was copied on the pool");
    let mut want = vec![0.0; ctx.len()];
    for (i, w) in want.iter_mut().enumerate() {
        let (si, bi, hi, di) = (i / (b * h * d), i / (h * d) % b, i / d % h, i % d);
        *w = ctx[((bi * h + hi) * s + si) * d + di];
    }
    same("context", out.into_data().to_vec().unwrap(), want);

    // A transpose of [301, 173] flattened: several tasks of the copy.
    let (r, c) = (301, 173);
    let m = rng.normal(r * c, 0.0, 1.0);
    let t = Tensor::<T, 2>::from_data(TensorData::new(m.clone(), [r, c]), &device);
    let before = copies();
    let flat = t.clone().transpose().reshape([r * c]);
    assert_eq!(copies() - before, 1);
    let want: Vec<f32> = (0..r * c).map(|i| m[(i % r) * c + i / r]).collect();
    same("transpose", flat.into_data().to_vec().unwrap(), want);

    // A flipped view: Flex copies it itself.
    let before = copies();
    let flipped = t.clone().flip([1]).reshape([r * c]);
    assert_eq!(copies() - before, 0, "a negative stride is Flex's copy");
    let want: Vec<f32> = (0..r * c).map(|i| m[i / c * c + (c - 1 - i % c)]).collect();
    same("flip", flipped.into_data().to_vec().unwrap(), want);

    // A contiguous tensor's reshape is a view, and a contiguous narrow at an offset is Flex's copy: neither is a
    // strided copy.
    let before = copies();
    let viewed = t.clone().reshape([c, r]);
    let narrowed = t.narrow(0, 100, 7).reshape([7 * c]);
    assert_eq!(copies() - before, 0, "contiguous views are Flex's");
    same("view", viewed.into_data().to_vec().unwrap(), m.clone());
    let want = m[100 * c..107 * c].to_vec();
    same("narrow", narrowed.into_data().to_vec().unwrap(), want);

    // A permuted [b, h, s, d] value into slots 2.. of a packed [s, b, slots, d] tensor.
    let slots = h + 4;
    let packed = rng.normal(s * b * slots * d, 0.0, 1.0);
    let dst = Tensor::<T, 4>::from_data(TensorData::new(packed.clone(), [s, b, slots, d]), &device);
    let value = Tensor::<T, 4>::from_data(TensorData::new(ctx.clone(), [b, h, s, d]), &device)
        .permute([2, 0, 1, 3]);
    let before = copies();
    let assigned = dst.slice_assign([0..s, 0..b, 2..2 + h, 0..d], value);
    assert_eq!(copies() - before, 1, "the value was copied on the pool");
    let mut want = packed.clone();
    for (i, w) in want.iter_mut().enumerate() {
        let (si, bi, slot, di) = (
            i / (b * slots * d),
            i / (slots * d) % b,
            i / d % slots,
            i % d,
        );
        if (2..2 + h).contains(&slot) {
            *w = ctx[((bi * h + slot - 2) * s + si) * d + di];
        }
    }
    same("slice assign", assigned.into_data().to_vec().unwrap(), want);

    // Through autodiff: packed [s, b, slots, d] → narrow to slots 2.. → permuted to [b, h, s, d] → reshaped to
    // [b, h·s·d] (a strided copy) → times an upstream gradient g, summed. d/d packed = g moved back by both maps,
    // zero off the slots; the backward writes the permuted gradient into the packed one (a strided slice assign).
    type A = Autodiff<Te<Flex>>;
    let g = rng.normal(b * h * s * d, 0.0, 1.0);
    let x = Tensor::<A, 4>::from_data(TensorData::new(packed, [s, b, slots, d]), &device)
        .require_grad();
    let upstream = Tensor::<A, 2>::from_data(TensorData::new(g.clone(), [b, h * s * d]), &device);
    let before = copies();
    let bhsd = x.clone().narrow(2, 2, h).permute([1, 2, 0, 3]);
    let loss = (bhsd.reshape([b, h * s * d]) * upstream).sum();
    let grads = loss.backward();
    assert_eq!(
        copies() - before,
        2,
        "the forward's reshape and the backward's slice assign"
    );
    let dx = x
        .grad(&grads)
        .expect("packed gradient")
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    for (i, &got) in dx.iter().enumerate() {
        let (si, bi, slot, di) = (
            i / (b * slots * d),
            i / (slots * d) % b,
            i / d % slots,
            i % d,
        );
        let want = if (2..2 + h).contains(&slot) {
            g[bi * h * s * d + ((slot - 2) * s + si) * d + di]
        } else {
            0.0
        };
        assert_eq!(got.to_bits(), want.to_bits(), "gradient {i}");
    }
}

/// `Te<Flex>`'s `cat` (`TeBackend::te_cat`: strided views joined on every core) and `te_split` on
/// `Autodiff<Te<Flex>>` (views whose gradients are joined once) against the element each position must hold,
/// found one index at a time: permuted `[b, hᵢ, s, d]` parts joined along the heads of `[s, b, Σhᵢ, d]` (one an
/// empty part), transposed matrices joined along rows (elements not adjacent), and the cases left to Flex (the last
/// dimension; contiguous along the first); then a packed `[s, b, h + 2g, d]` leaf split into q, k, v, each permuted
/// and weighted by its own upstream values: its gradient is those values moved back, joined by one copy.
#[test]
fn te_flex_cat_and_te_split_move_every_value_where_its_index_says() {
    use burn_te::Te;
    type T = Te<Flex>;
    type A = Autodiff<Te<Flex>>;
    let device = Default::default();
    let mut rng = Rng::new(46);
    let copies = || counter("HostLayoutCopies");
    let same = |what: &str, got: Vec<f32>, want: &[f32]| {
        assert_eq!(got.len(), want.len(), "{what}: length");
        if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            panic!("{what}: element {i} is {}, expected {}", got[i], want[i]);
        }
    };

    // Permuted heads, joined along dimension 2 of [s, b, heads, d].
    let (s, b, d) = (37, 3, 24);
    let heads = [5, 0, 2, 7];
    let total: usize = heads.iter().sum();
    let sources: Vec<Vec<f32>> = heads
        .iter()
        .map(|&h| rng.normal(b * h * s * d, 0.0, 1.0))
        .collect();
    let parts: Vec<Tensor<T, 4>> = sources
        .iter()
        .zip(heads)
        .map(|(x, h)| {
            Tensor::<T, 4>::from_data(TensorData::new(x.clone(), [b, h, s, d]), &device)
                .permute([2, 0, 1, 3])
        })
        .collect();
    let before = copies();
    let joined = Tensor::cat(parts, 2);
    assert_eq!(copies() - before, 1, "joined on the pool");
    let want: Vec<f32> = (0..s * b * total * d)
        .map(|i| {
            let (si, bi, slot, di) = (
                i / (b * total * d),
                i / (total * d) % b,
                i / d % total,
                i % d,
            );
            let p = (0..heads.len())
                .find(|&p| slot < heads[..=p].iter().sum())
                .unwrap();
            let hi = slot - heads[..p].iter().sum::<usize>();
            sources[p][((bi * heads[p] + hi) * s + si) * d + di]
        })
        .collect();
    same("heads", joined.into_data().to_vec().unwrap(), &want);

    // Transposes [cᵢ, r] of row-major [r, cᵢ] matrices joined along dimension 0: a row's elements lie cᵢ apart.
    let (r, cols) = (301, [173, 40]);
    let mats: Vec<Vec<f32>> = cols.iter().map(|&c| rng.normal(r * c, 0.0, 1.0)).collect();
    let parts: Vec<Tensor<T, 2>> = mats
        .iter()
        .zip(cols)
        .map(|(m, c)| {
            Tensor::<T, 2>::from_data(TensorData::new(m.clone(), [r, c]), &device).transpose()
        })
        .collect();
    // Which matrix index `x` of the joined `Σcᵢ` falls in, and where in it.
    let matrix = |x: usize| match x.checked_sub(cols[0]) {
        None => (0, x),
        Some(at) => (1, at),
    };
    let before = copies();
    let joined = Tensor::cat(parts.clone(), 0);
    assert_eq!(copies() - before, 1, "joined on the pool");
    let want: Vec<f32> = (0..(cols[0] + cols[1]) * r)
        .map(|i| {
            let (p, at) = matrix(i / r);
            mats[p][(i % r) * cols[p] + at]
        })
        .collect();
    same("transposes", joined.into_data().to_vec().unwrap(), &want);

    // Left to Flex: the last dimension (of views of the transposes above), and contiguous tensors along the first.
    let before = copies();
    let last = Tensor::cat(parts.iter().map(|t| t.clone().transpose()).collect(), 1);
    let stacked = Tensor::cat(
        mats.iter()
            .map(|m| Tensor::<T, 1>::from_data(TensorData::new(m.clone(), [m.len()]), &device))
            .collect(),
        0,
    );
    assert_eq!(copies() - before, 0, "Flex's own");
    let width = cols[0] + cols[1];
    let want: Vec<f32> = (0..r * width)
        .map(|i| {
            let (p, at) = matrix(i % width);
            mats[p][(i / width) * cols[p] + at]
        })
        .collect();
    same("last dimension", last.into_data().to_vec().unwrap(), &want);
    same(
        "contiguous",
        stacked.into_data().to_vec().unwrap(),
        &mats.concat(),
    );

    // A packed [s, b, h + 2g, d] leaf split into q, k, v on Autodiff; each part permuted to [b, heads, s, d] and
    // weighted by its own upstream values uᵢ. d/d packed = each uᵢ moved back into its slots, joined once.
    let (h, g) = (5, 2);
    let slots = h + 2 * g;
    let packed = rng.normal(s * b * slots * d, 0.0, 1.0);
    let x = Tensor::<A, 4>::from_data(TensorData::new(packed.clone(), [s, b, slots, d]), &device)
        .require_grad();
    let sizes = [h, g, g];
    let upstream: Vec<Vec<f32>> = sizes
        .iter()
        .map(|&n| rng.normal(b * n * s * d, 0.0, 1.0))
        .collect();
    let before = copies();
    let parts = A::te_split(x.clone().into_primitive().tensor(), 2, &sizes);
    let mut loss = Tensor::<A, 1>::zeros([1], &device);
    let starts = [0, h, h + g];
    for (p, part) in parts.into_iter().enumerate() {
        let part = Tensor::<A, 4>::from_primitive(TensorPrimitive::Float(part));
        let n = sizes[p];
        let want: Vec<f32> = (0..s * b * n * d)
            .map(|i| {
                let (si, bi, hi, di) = (i / (b * n * d), i / (n * d) % b, i / d % n, i % d);
                packed[((si * b + bi) * slots + starts[p] + hi) * d + di]
            })
            .collect();
        same("part", part.clone().into_data().to_vec().unwrap(), &want);
        let u =
            Tensor::<A, 4>::from_data(TensorData::new(upstream[p].clone(), [b, n, s, d]), &device);
        loss = loss + (part.permute([1, 2, 0, 3]) * u).sum();
    }
    let grads = loss.backward();
    assert_eq!(
        copies() - before,
        1,
        "the parts' gradients joined by one copy"
    );
    let want: Vec<f32> = (0..packed.len())
        .map(|i| {
            let (si, bi, slot, di) = (
                i / (b * slots * d),
                i / (slots * d) % b,
                i / d % slots,
                i % d,
            );
            let p = starts.iter().rposition(|&start| start <= slot).unwrap();
            let (n, hi) = (sizes[p], slot - starts[p]);
            upstream[p][((bi * n + hi) * s + si) * d + di]
        })
        .collect();
    same(
        "packed gradient",
        x.grad(&grads)
            .expect("packed gradient")
            .into_data()
            .to_vec()
            .unwrap(),
        &want,
    );
}
