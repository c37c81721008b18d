//! The host FP8 GEMM's paths (`burn_te::backends::host::gemm`): the decode to bf16 is exact for every code; every recipe's
//! GEMM — fprop, dgrad and wgrad layouts, batches — agrees with an f64 re-computation from the FP8 codes and scales
//! on every path this CPU has, each test naming the paths it ran and failing where one this CPU's flags promise
//! (`/proc/cpuinfo`) is missing; the packed kernels are bit-exact across several depth, row and column blocks; the
//! probe picks its fastest path; the packing buffers kept per thread stay within their bound.
//!
//! The bound: a GEMM of depth `k` accumulated in f32 differs from the exact sum of its (exact) products by at most
//! `γ_k · Σ|a·b|`, `γ_k = k·u / (1 − k·u)`, `u = 2⁻²⁴`; the output factor and the f32 path's decode (`code ·
//! scale_inv`, NVFP4's factor rounded in f32) add a few `u · Σ|a·b|` more. The tests allow `γ_(k+4) · Σ|a·b|`.

use burn::backend::{Autodiff, Flex};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn_te::backends::host::gemm::{HostGemmPath, with_host_gemm_path};
use burn_te::gemm::fp8::{k_along_cols, quantize_operand};
use burn_te::nn::{TransformerLayer, TransformerLayerConfig};
use burn_te::{
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Fp8Primitive, Gemm, GemmSite,
    MXFP8BlockScaling, NVFP4BlockScaling, Recipe, Te, TeBackend, TensorRole, fp8_autocast,
};
use burn_te_kernels::host::gemm::bf16::{Avx512Bf16Kernel as Bf16, exact_bf16};
use burn_te_kernels::nvfp4::decode_e2m1;
use burn_te_kernels::{Fp8Format, ScaleBlock};

use crate::common::{Rng, alone, f32_from_hex, tsv_rows};
use crate::nvfp4::nvfp4_tsv;

type B = Flex;

/// The paths this CPU runs, checked against the flags the kernel reports in `/proc/cpuinfo` (read independently of
/// the crate's detection): a path those flags promise must be available, so that no test drops one silently.
fn paths() -> Vec<HostGemmPath> {
    let paths = HostGemmPath::available_paths();
    for path in expected_paths() {
        assert!(
            paths.contains(&path),
            "this CPU's flags promise the {path} path, but only {paths:?} are available"
        );
    }
    assert!(paths.contains(&HostGemmPath::F32), "f32 runs everywhere");
    paths
}

/// The packed paths `/proc/cpuinfo`'s flags promise (none where the file is missing: not Linux, not x86-64).
fn expected_paths() -> Vec<HostGemmPath> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find(|line| line.starts_with("flags"))
        .map(|line| line.split_whitespace().collect())
        .unwrap_or_default();
    let has = |flag: &str| flags.contains(&flag);
    let mut expected = vec![];
    // The kernel lists AMX's flags only where it manages the tile state, and grants it to a process that asks.
    if cfg!(target_arch = "x86_64") && has("amx_tile") && has("amx_bf16") {
        expected.push(HostGemmPath::AmxBf16);
    }
    if cfg!(target_arch = "x86_64") && has("avx512f") && has("avx512_bf16") {
        expected.push(HostGemmPath::Avx512Bf16);
    }
    if cfg!(target_arch = "x86_64") && has("avx512f") {
        expected.push(HostGemmPath::Avx512Fma);
    }
    if cfg!(target_arch = "x86_64") && has("avx2") && has("fma") {
        expected.push(HostGemmPath::Avx2Fma);
    }
    expected
}

fn bf16_value(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

#[test]
fn every_fp8_and_nvfp4_value_is_exactly_a_bf16_value() {
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        let rows = tsv_rows(&format!("{}_decode.tsv", format.name()));
        assert_eq!(rows.len(), 256, "{format}: every code is listed");
        for row in rows {
            let code = u8::from_str_radix(&row[0], 16).unwrap();
            let expected = f32_from_hex(&row[1]);
            let bits = exact_bf16(format.decode(code))
                .unwrap_or_else(|| panic!("{format} code {code:02x} is not a bf16 value"));
            let value = bf16_value(bits);
            if expected.is_nan() {
                assert!(value.is_nan(), "{format} {code:02x}: {value} vs NaN");
            } else {
                assert_eq!(
                    value.to_bits(),
                    expected.to_bits(),
                    "{format} {code:02x}: {value:e} vs {expected:e}"
                );
            }
        }
    }
    // E2M1 × E4M3 block scale (NVFP4's folded element): every code with every finite scale, against f64.
    let e2m1 = nvfp4_tsv("e2m1_decode.tsv");
    assert_eq!(e2m1.len(), 16);
    let mut checked = 0;
    for row in &e2m1 {
        let code = u8::from_str_radix(&row[0], 16).unwrap();
        let value = f64::from(f32_from_hex(&row[1]));
        assert_eq!(f64::from(decode_e2m1(code)), value);
        for scale_code in 0..=255u8 {
            let scale = Fp8Format::E4M3.decode(scale_code);
            if scale.is_nan() {
                continue;
            }
            let product = decode_e2m1(code) * scale;
            let bits = exact_bf16(product).unwrap_or_else(|| {
                panic!("e2m1 {code:x} × e4m3 {scale_code:02x} = {product:e} is not a bf16 value")
            });
            assert_eq!(f64::from(bf16_value(bits)), value * f64::from(scale));
            checked += 1;
        }
    }
    assert_eq!(checked, 16 * 254);
    // Not exact: more than 8 significant bits, or a bf16 subnormal (flushed by the instruction).
    assert_eq!(exact_bf16(1.0 + 1.0 / 512.0), None);
    assert_eq!(exact_bf16(f32::from_bits(0x0040_0000)), None);
}

/// The stored matrices of a quantized tensor in f64 (`decode(code) · factor`, NVFP4's factor as `e4m3(s) · amax /
/// 2688` in f64), and its `(batch, rows, cols)`.
pub(crate) fn stored_f64<T: TeBackend>(
    tensor: &Fp8Primitive<T>,
) -> (Vec<f64>, (usize, usize, usize)) {
    let data = T::fp8_read(tensor).expect("read");
    let dims = tensor.matrix_dims();
    let cols = dims.2;
    let values = data
        .codes
        .iter()
        .enumerate()
        .map(|(i, &code)| {
            let value = f64::from(tensor.format.decode(code));
            let factor = match (tensor.block, &data.nvfp4) {
                (None, _) => f64::from(data.scale_inv[0]),
                (Some(block), Some(nvfp4)) => {
                    f64::from(Fp8Format::E4M3.decode(nvfp4.block_scales[block.slot(i, cols)]))
                        * f64::from(nvfp4.global_amax)
                        / 2688.0
                }
                (Some(block), None) => f64::from(data.scale_inv[block.slot(i, cols)]),
            };
            value * factor
        })
        .collect();
    (values, dims)
}

/// `lhs · rhs` of the stored matrices read as the GEMM reads them, in f64, with `Σ|a·b|` of each output.
pub(crate) fn reference(
    (a, (ab, ar, ac)): &(Vec<f64>, (usize, usize, usize)),
    lhs_t: bool,
    (w, (wb, wr, wc)): &(Vec<f64>, (usize, usize, usize)),
    rhs_t: bool,
) -> (Vec<f64>, Vec<f64>, usize) {
    let (m, k) = if lhs_t { (*ac, *ar) } else { (*ar, *ac) };
    let n = if rhs_t { *wr } else { *wc };
    let batch = (*ab).max(*wb);
    let mut out = Vec::with_capacity(batch * m * n);
    let mut abs = Vec::with_capacity(batch * m * n);
    for b in 0..batch {
        let lhs = |r: usize, d: usize| {
            let base = if *ab > 1 { b * ar * ac } else { 0 };
            a[base + if lhs_t { d * ac + r } else { r * ac + d }]
        };
        let rhs = |d: usize, c: usize| {
            let base = if *wb > 1 { b * wr * wc } else { 0 };
            w[base + if rhs_t { c * wc + d } else { d * wc + c }]
        };
        for r in 0..m {
            for c in 0..n {
                let (mut sum, mut sum_abs) = (0.0, 0.0);
                for d in 0..k {
                    sum += lhs(r, d) * rhs(d, c);
                    sum_abs += (lhs(r, d) * rhs(d, c)).abs();
                }
                out.push(sum);
                abs.push(sum_abs);
            }
        }
    }
    (out, abs, k)
}

fn check_gemm(what: &str, actual: &[f32], expected: &(Vec<f64>, Vec<f64>, usize)) {
    let k = expected.2 as f64;
    let u = 2f64.powi(-24);
    check_gemm_within(
        what,
        actual,
        expected,
        (k + 4.0) * u / (1.0 - (k + 4.0) * u),
    );
}

/// Checks every output against the f64 reference: `|y − e| ≤ gamma · Σ|a·b| + k · f32::MIN_POSITIVE`.
pub(crate) fn check_gemm_within(
    what: &str,
    actual: &[f32],
    (expected, abs, k): &(Vec<f64>, Vec<f64>, usize),
    gamma: f64,
) {
    assert_eq!(actual.len(), expected.len(), "{what}: output size");
    for (i, ((&y, &e), &s)) in actual.iter().zip(expected).zip(abs).enumerate() {
        let bound = gamma * s + f64::from(f32::MIN_POSITIVE) * (*k as f64);
        assert!(
            (f64::from(y) - e).abs() <= bound,
            "{what}: output {i} = {y:e}, f64 {e:e}, error {:e} > bound {bound:e}",
            (f64::from(y) - e).abs()
        );
    }
}

fn counted(path: HostGemmPath) -> u64 {
    burn_te::diagnostics::thread_counter_value(&format!("HostFp8Gemm({})", path.name()))
        .unwrap_or(0)
}

fn float(values: Vec<f32>, shape: [usize; 2]) -> burn::tensor::ops::FloatTensor<B> {
    Tensor::<B, 2>::from_data(TensorData::new(values, shape), &Default::default())
        .into_primitive()
        .tensor()
}

/// Each recipe's fprop, dgrad and wgrad GEMMs (as `burn_te::gemm::fp8` quantizes and lays out their operands) on
/// every path, against f64 from the codes and scales. The fprop's depth (560) runs past every path's first depth
/// block (AMX's 512 values, the bf16 path's 384, the FMA paths' 256) into a partial one.
#[test]
fn every_recipe_and_gemm_layout_matches_f64_on_every_path() {
    let (m, k, n) = (70, 560, 100);
    let mut rng = Rng::new(37);
    let x = rng.normal(m * k, 0.0, 1.0);
    let w = rng.normal(k * n, 0.0, 0.05);
    let dy = rng.normal(m * n, 0.0, 1e-3);
    let recipes: Vec<Recipe> = vec![
        Float8CurrentScaling::default().into(),
        Float8BlockScaling::default().into(),
        MXFP8BlockScaling::default().into(),
        NVFP4BlockScaling::default().into(),
        NVFP4BlockScaling {
            disable_rht: true,
            disable_stochastic_rounding: true,
            disable_2d_quantization: true,
        }
        .into(),
    ];
    for recipe in &recipes {
        // (gemm, lhs tensor, its shape, its role, lhs transposed, rhs tensor, shape, role, rhs transposed)
        let layouts = [
            (
                Gemm::Fprop,
                (&x, [m, k], TensorRole::Activation, false),
                (&w, [k, n], TensorRole::Weight, false),
            ),
            (
                Gemm::Dgrad,
                (&dy, [m, n], TensorRole::Gradient, false),
                (&w, [k, n], TensorRole::Weight, true),
            ),
            (
                Gemm::Wgrad,
                (&x, [m, k], TensorRole::Activation, true),
                (&dy, [m, n], TensorRole::Gradient, false),
            ),
        ];
        for (gemm, (lv, ls, lrole, lt), (rv, rs, rrole, rt)) in layouts {
            let site = GemmSite::new("host_gemm", gemm);
            let quantize = |values: &Vec<f32>, shape, role| {
                quantize_operand::<B>(
                    float(values.clone(), shape),
                    recipe,
                    &site,
                    role,
                    k_along_cols(gemm, role),
                    false,
                    None,
                )
                .expect("quantize")
            };
            let (lhs, rhs) = (quantize(lv, ls, lrole), quantize(rv, rs, rrole));
            let (lhs_t, rhs_t) = (lt != lhs.transposed, rt != rhs.transposed);
            let expected = reference(
                &stored_f64::<B>(&lhs.tensor),
                lhs_t,
                &stored_f64::<B>(&rhs.tensor),
                rhs_t,
            );
            let ran = paths();
            for &path in &ran {
                let before = counted(path);
                let out = with_host_gemm_path(path, || {
                    B::fp8_gemm(lhs.tensor.clone(), lhs_t, rhs.tensor.clone(), rhs_t)
                })
                .expect("gemm");
                assert_eq!(
                    counted(path),
                    before + 1,
                    "{recipe:?} {gemm:?} ran on {path:?}"
                );
                let actual = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(out))
                    .into_data()
                    .into_vec::<f32>()
                    .unwrap();
                check_gemm(
                    &format!("{} {gemm:?} on {}", recipe.name(), path.name()),
                    &actual,
                    &expected,
                );
            }
            println!("{} {gemm:?}: ran on {ran:?}", recipe.name());
        }
    }
}

/// `values` (`shape`) quantized by `recipe` as the fprop operand `role` at `site`.
fn fprop_operand(
    recipe: &Recipe,
    site: &GemmSite,
    values: Vec<f32>,
    shape: [usize; 2],
    role: TensorRole,
) -> burn_te::gemm::fp8::QuantizedOperand<B> {
    quantize_operand::<B>(
        float(values, shape),
        recipe,
        site,
        role,
        k_along_cols(Gemm::Fprop, role),
        false,
        None,
    )
    .expect("quantize")
}

/// fprop's bias in the host GEMM's epilogue (`fp8_gemm_bias`), on every path at a shape that crosses row, column
/// and depth blocks: the bits of the GEMM followed by `te_add_bias` (which it replaces, so that pass is not
/// launched), within f64's bound of the exact `x·W + b`; a bias of the wrong length is an error naming it.
#[test]
fn fprop_bias_in_the_epilogue_gives_the_bits_of_adding_it_after_on_every_path() {
    let (m, k, n) = (530, 1100, 300);
    let mut rng = Rng::new(53);
    let (x, w, b) = (
        rng.normal(m * k, 0.0, 1.0),
        rng.normal(k * n, 0.0, 0.05),
        rng.normal(n, 0.0, 0.5),
    );
    let recipe: Recipe = Float8CurrentScaling::default().into();
    let site = GemmSite::new("host_gemm_bias", Gemm::Fprop);
    let (lhs, rhs) = (
        fprop_operand(&recipe, &site, x, [m, k], TensorRole::Activation).tensor,
        fprop_operand(&recipe, &site, w, [k, n], TensorRole::Weight).tensor,
    );
    let (mut expected, mut abs, _) =
        reference(&stored_f64::<B>(&lhs), false, &stored_f64::<B>(&rhs), false);
    for (i, (e, s)) in expected.iter_mut().zip(&mut abs).enumerate() {
        *e += f64::from(b[i % n]);
        *s += f64::from(b[i % n]).abs();
    }
    let vector = |values: &[f32]| {
        Tensor::<B, 1>::from_floats(values, &Default::default())
            .into_primitive()
            .tensor()
    };
    let bias = || vector(&b);
    let values = |out| {
        Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(out))
            .into_data()
            .into_vec::<f32>()
            .unwrap()
    };
    let bias_passes = || burn_te::diagnostics::thread_counter_value("FusedBias").unwrap_or(0);
    for path in paths() {
        let (fused, after, passes) = with_host_gemm_path(path, || {
            let before = bias_passes();
            let fused = B::fp8_gemm_bias(lhs.clone(), false, rhs.clone(), false, bias())
                .expect("gemm with bias");
            let passes = bias_passes() - before;
            let gemm = B::fp8_gemm(lhs.clone(), false, rhs.clone(), false).expect("gemm");
            (values(fused), values(B::te_add_bias(gemm, bias())), passes)
        });
        assert_eq!(passes, 0, "{path}: the bias ran as a pass of its own");
        for (i, (f, a)) in fused.iter().zip(&after).enumerate() {
            assert_eq!(
                f.to_bits(),
                a.to_bits(),
                "{path}: output {i}: {f:e} in the epilogue, {a:e} added after"
            );
        }
        let u = 2f64.powi(-24);
        let gamma = (k as f64 + 5.0) * u / (1.0 - (k as f64 + 5.0) * u);
        check_gemm_within(
            &format!("bias epilogue on {path}"),
            &fused,
            &(expected.clone(), abs.clone(), k),
            gamma,
        );
    }
    let short = vector(&b[..n - 1]);
    let err = B::fp8_gemm_bias(lhs, false, rhs, false, short).expect_err("a short bias");
    assert!(
        err.to_string().contains("bias") && err.to_string().contains(&format!("{}", n - 1)),
        "{err}"
    );
}

/// Batched operands (a batch against a batch, and one matrix broadcast against a batch), transposed both ways.
#[test]
fn batched_and_transposed_gemms_match_f64_on_every_path() {
    let mut rng = Rng::new(38);
    let quantize = |values: Vec<f32>, shape: [usize; 3]| -> Fp8Primitive<B> {
        let t = Tensor::<B, 3>::from_data(TensorData::new(values, shape), &Default::default());
        B::fp8_quantize(
            t.into_primitive().tensor(),
            Fp8Format::E4M3,
            burn_te::Scaling::Current { margin: 0.0 },
        )
        .expect("quantize")
    };
    for (lhs_t, rhs_t) in [(false, false), (true, false), (false, true), (true, true)] {
        for rhs_batch in [3, 1] {
            let (m, k, n) = (13, 45, 33);
            let lshape = if lhs_t { [3, k, m] } else { [3, m, k] };
            let rshape = if rhs_t {
                [rhs_batch, n, k]
            } else {
                [rhs_batch, k, n]
            };
            let lhs = quantize(rng.normal(3 * m * k, 0.0, 1.0), lshape);
            let rhs = quantize(rng.normal(rhs_batch * k * n, 0.0, 1.0), rshape);
            let expected = reference(&stored_f64::<B>(&lhs), lhs_t, &stored_f64::<B>(&rhs), rhs_t);
            for path in paths() {
                let out = with_host_gemm_path(path, || {
                    B::fp8_gemm(lhs.clone(), lhs_t, rhs.clone(), rhs_t)
                })
                .expect("gemm");
                let actual = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out));
                assert_eq!(actual.dims(), [3, m, n]);
                check_gemm(
                    &format!(
                        "batch 3 × {rhs_batch}, lhs_t {lhs_t}, rhs_t {rhs_t}, {}",
                        path.name()
                    ),
                    &actual.into_data().into_vec::<f32>().unwrap(),
                    &expected,
                );
            }
        }
    }
}

/// An operand quantized per tensor (current scaling, E4M3).
fn quantized<const D: usize>(values: Vec<f32>, shape: [usize; D]) -> Fp8Primitive<B> {
    let t = Tensor::<B, D>::from_data(TensorData::new(values, shape), &Default::default());
    B::fp8_quantize(
        t.into_primitive().tensor(),
        Fp8Format::E4M3,
        burn_te::Scaling::Current { margin: 0.0 },
    )
    .expect("quantize")
}

/// An empty batch against a batch of one broadcasts to an empty batch, in either order, as `torch.matmul` does
/// (`ones(0, 4, 8) @ ones(1, 8, 16)` and `ones(1, 4, 8) @ ones(0, 8, 16)` are both `[0, 4, 16]`); the batch of one
/// is the one broadcast, so nothing is read from the empty operand.
#[test]
fn an_empty_batch_against_a_batch_of_one_gives_an_empty_output() {
    for (lshape, rshape) in [([0, 4, 8], [1, 8, 16]), ([1, 4, 8], [0, 8, 16])] {
        let operand = |shape: [usize; 3]| quantized(vec![1.0; shape.iter().product()], shape);
        for path in paths() {
            let out = with_host_gemm_path(path, || {
                B::fp8_gemm(operand(lshape), false, operand(rshape), false)
            })
            .expect("gemm");
            let out = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out));
            assert_eq!(out.dims(), [0, 4, 16], "{lshape:?} · {rshape:?} on {path}");
            assert_eq!(out.into_data().num_elements(), 0);
        }
    }
}

/// A host FP8 tensor whose public fields were changed apart — codes that do not fill its shape, scales that do not
/// fit its block grid — is refused by the GEMM (on every path) and the dequantization, with an error naming the
/// operand and what does not fit, before anything reads its buffers.
#[test]
fn a_quantized_tensor_whose_buffers_do_not_fit_its_shape_is_refused() {
    let mut rng = Rng::new(45);
    let fits = quantized(rng.normal(64 * 64, 0.0, 1.0), [64, 64]);
    // Four codes claimed to be a 64 × 64 matrix.
    let mut short = quantized(vec![1.0; 4], [2, 2]);
    short.shape = Shape::new([64, 64]);
    // Block scales (1 × 128 blocks of a 128 × 256 activation: 128 · 2 of them), one dropped.
    let site = GemmSite::new("refused", Gemm::Fprop);
    let recipe: Recipe = Float8BlockScaling::default().into();
    let mut blocks = quantize_operand::<B>(
        float(rng.normal(128 * 256, 0.0, 1.0), [128, 256]),
        &recipe,
        &site,
        TensorRole::Activation,
        true,
        false,
        None,
    )
    .expect("quantize")
    .tensor;
    let block = blocks.block.expect("block scales");
    let grid = 128usize.div_ceil(block.rows) * 256usize.div_ceil(block.cols);
    assert_eq!(blocks.data.scale_inv.len(), grid);
    blocks.data.scale_inv = std::sync::Arc::new(vec![1.0; grid - 1]);
    let refusals = [
        (
            &short,
            "fp8_gemm lhs",
            "4 codes for 4096 elements".to_string(),
        ),
        (
            &blocks,
            "fp8_gemm lhs",
            format!("{} scale_inv values for {grid}", grid - 1),
        ),
    ];
    for (operand, what, reason) in refusals {
        let k = operand.shape.as_slice()[1];
        let rhs = quantized(rng.normal(k * 8, 0.0, 1.0), [k, 8]);
        for path in paths() {
            let error = with_host_gemm_path(path, || {
                B::fp8_gemm(operand.clone(), false, rhs.clone(), false)
            })
            .expect_err("a tensor that does not fit its shape");
            let message = error.to_string();
            assert!(
                message.contains(what) && message.contains(&reason),
                "on {path}: {message}"
            );
        }
        let error = B::fp8_dequantize(operand.clone()).expect_err("dequantize refuses it");
        assert!(error.to_string().contains(&reason), "{error}");
    }
    // The same operand as the right one is named so.
    let error = B::fp8_gemm(fits.clone(), false, short.clone(), false).expect_err("rhs");
    assert!(error.to_string().contains("fp8_gemm rhs"), "{error}");
    B::fp8_gemm(fits.clone(), false, fits, false).expect("a tensor that fits runs");
}

/// A GEMM output large enough to come from the pool (4 MiB; pooled from 1 MiB) is copied like any tensor's data: `TensorData::clone`
/// and a `slice_assign` on a shared tensor copy its bytes with the alignment the pool reports, which Burn's byte
/// buffers must accept. Operands of 1.75 (scale 448 / 1.75 = 256, a power of two): every output is `k · 3.0625`
/// exactly.
#[test]
fn a_pooled_gemm_output_copies_with_its_values() {
    let (m, k, n) = (512, 32, 2048);
    assert!(m * n * 4 >= burn_te_kernels::host::pool::POOLED_FROM);
    let out = B::fp8_gemm(
        quantized(vec![1.75; m * k], [m, k]),
        false,
        quantized(vec![1.75; k * n], [k, n]),
        false,
    )
    .expect("gemm");
    let expected = k as f32 * 3.0625;
    let y = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(out));
    let data = y.clone().into_data();
    let copy = data.clone();
    assert!(
        copy.as_slice::<f32>()
            .unwrap()
            .iter()
            .all(|&v| v == expected)
    );
    assert_eq!(copy, data);
    // The tensor shared by `y` and its clone: the write copies it first.
    let zeros = Tensor::<B, 2>::zeros([1, n], &Default::default());
    let written = y.clone().slice_assign([0..1, 0..n], zeros);
    let written = written.into_data().into_vec::<f32>().unwrap();
    assert!(written[..n].iter().all(|&v| v == 0.0));
    assert!(written[n..].iter().all(|&v| v == expected));
    let original = y.into_data().into_vec::<f32>().unwrap();
    assert!(
        original.iter().all(|&v| v == expected),
        "the shared output is unchanged"
    );
}

/// A packed path falls back to f32 — recorded, and still right — where it cannot run, and takes what it can: a
/// block scale that leaves bf16's normal range makes the bf16 path fall back on a CPU with AVX512-BF16 (elsewhere
/// the path itself is missing), while the f32 FMA paths fold it and run (each where its CPU has it). Two such
/// blocks, each among blocks of ordinary scales: values near f32's smallest normal (amax 3e-38 in row 0: its
/// `scale_inv` 2^-127 is itself subnormal), and a normal `scale_inv` of 2^-118 (amax 1e-33 in row 2) that takes
/// E4M3's smallest value, 2^-9, below bf16's normal range.
#[test]
fn a_packed_path_falls_back_to_f32_and_says_so() {
    for (row, tiny) in [(0, 3e-38f32), (2, 1e-33)] {
        tiny_block_falls_back(row, tiny);
    }
}

/// [`a_packed_path_falls_back_to_f32_and_says_so`] with `row`'s 1×128 block of amax `tiny`.
fn tiny_block_falls_back(row: usize, tiny: f32) {
    let (m, k, n) = (4, 128, 8);
    let mut x = vec![1.0f32; m * k];
    x[row * k..][..k].iter_mut().for_each(|v| *v = tiny);
    let w = vec![0.5f32; k * n];
    let recipe: Recipe = Float8BlockScaling::default().into();
    let site = GemmSite::new("tiny_block", Gemm::Fprop);
    let (lhs, rhs) = (
        fprop_operand(&recipe, &site, x, [m, k], TensorRole::Activation),
        fprop_operand(&recipe, &site, w, [k, n], TensorRole::Weight),
    );
    let expected = reference(
        &stored_f64::<B>(&lhs.tensor),
        lhs.transposed,
        &stored_f64::<B>(&rhs.tensor),
        rhs.transposed,
    );
    let run = |path| {
        let out = with_host_gemm_path(path, || {
            B::fp8_gemm(
                lhs.tensor.clone(),
                lhs.transposed,
                rhs.tensor.clone(),
                rhs.transposed,
            )
        })
        .expect("gemm");
        Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(out))
            .into_data()
            .into_vec::<f32>()
            .unwrap()
    };
    let recorded = |reason: &str| burn_te::fallback_counts().get(reason).copied().unwrap_or(0);
    for path in [
        HostGemmPath::AmxBf16,
        HostGemmPath::Avx512Bf16,
        HostGemmPath::Avx512Fma,
        HostGemmPath::Avx2Fma,
    ] {
        let reason = if path.available() {
            "host GEMM path not exact"
        } else {
            "host GEMM path unavailable"
        };
        let bf16 = [HostGemmPath::AmxBf16, HostGemmPath::Avx512Bf16];
        let falls_back = bf16.contains(&path) || !path.available();
        let (before, f32_before, path_before) =
            (recorded(reason), counted(HostGemmPath::F32), counted(path));
        let actual = run(path);
        if falls_back {
            assert_eq!(
                counted(HostGemmPath::F32),
                f32_before + 1,
                "{path}: ran on f32"
            );
            assert!(
                recorded(reason) > before,
                "{path}: the fallback {reason:?} is recorded"
            );
        } else {
            assert_eq!(counted(path), path_before + 1, "{path}: ran on {path}");
            assert_eq!(recorded(reason), before, "{path}: no fallback");
        }
        check_gemm(
            &format!("the tiny block {tiny:e} on {path}"),
            &actual,
            &expected,
        );
    }
}

/// The same multi-step TransformerLayer training on every path this CPU has (DelayedScaling, whose scales evolve
/// with the amaxes of the GEMMs' inputs): every FP8 GEMM of the run counted under its path and none under another,
/// and the losses within the accumulation-order tolerance of the f32 path's at every step.
#[test]
fn training_on_every_path_follows_the_f32_path() {
    type A = Autodiff<Te<Flex>>;
    let launches = || burn_te::diagnostics::thread_counter_value("Fp8GemmLaunches").unwrap_or(0);
    let run = |path: HostGemmPath| -> Vec<f32> {
        let before: Vec<u64> = HostGemmPath::ALL.iter().map(|&p| counted(p)).collect();
        let launched = launches();
        let losses = with_host_gemm_path(path, || {
            let device = Default::default();
            A::seed(&device, 7);
            let layer: TransformerLayer<A> = TransformerLayerConfig::new(64, 256, 4)
                .with_hidden_dropout(0.0)
                .with_attention_dropout(0.0)
                .init(&device);
            let x = Tensor::<A, 3>::random(
                [16, 4, 64],
                burn::tensor::Distribution::Normal(0.0, 1.0),
                &device,
            );
            let target = Tensor::<A, 3>::random(
                [16, 4, 64],
                burn::tensor::Distribution::Normal(0.0, 1.0),
                &device,
            );
            sgd_steps(layer, x, target, 6)
        });
        let gemms = launches() - launched;
        assert!(gemms >= 6 * 12, "{path}: {gemms} FP8 GEMMs in 6 steps");
        for (&p, before) in HostGemmPath::ALL.iter().zip(before) {
            let expected = if p == path { before + gemms } else { before };
            assert_eq!(
                counted(p),
                expected,
                "HostFp8Gemm({p}) after the run on {path}"
            );
        }
        losses
    };
    let reference = run(HostGemmPath::F32);
    for path in paths() {
        let losses = run(path);
        for (step, (a, b)) in losses.iter().zip(&reference).enumerate() {
            // Same FP8 codes up to the accumulation order: the losses agree to ~1e-5 relative; a wrong GEMM (a
            // scale applied twice, a transposed operand) moves them by percent.
            assert!(
                ((a - b) / b).abs() < 1e-4,
                "step {step}: loss {a} on {path} vs {b} on f32"
            );
        }
        assert!(
            losses[5] < losses[0],
            "the layer learns on {path}: {losses:?}"
        );
        println!("trained on {path}: {losses:?}");
    }
}

/// Values that make every product and partial sum exact in f32: code `c` is `(c − 8) / 4`, a multiple of 1/4 in
/// [-2, 2); at depth `k` every sum is a multiple of 1/16 below `4k`, exact for `k` up to 2¹⁸.
fn quarter(c: u8) -> f32 {
    (f32::from(c) - 8.0) / 4.0
}

/// `a · b` of such codes (`m × k` and `k × n`, row-major) in integers, as f32.
fn exact_product(a: &[u8], b: &[u8], (m, k, n): (usize, usize, usize)) -> Vec<f32> {
    let mut out = vec![0i64; m * n];
    for r in 0..m {
        for d in 0..k {
            let x = i64::from(a[r * k + d]) - 8;
            for (o, &y) in out[r * n..][..n].iter_mut().zip(&b[d * n..][..n]) {
                *o += x * (i64::from(y) - 8);
            }
        }
    }
    out.into_iter().map(|v| v as f32 / 16.0).collect()
}

/// One packed kernel on every layout and both element sources, bit for bit against [`exact_product`] (codes
/// through a table) or an f64 re-computation (codes with a power-of-two factor per block); `Err` from the GEMM
/// where the CPU lacks the path.
fn packed_gemm_matches<K: burn_te_kernels::host::gemm::Kernel>(
    (m, k, n): (usize, usize, usize),
    element: impl Fn(f32) -> K::Element,
    seed: u64,
) -> Result<(), burn_te_kernels::host::gemm::HostGemmError> {
    use burn_te_kernels::host::gemm::{self, Elements, Source};

    let mut rng = Rng::new(seed);
    let mut draw =
        |len: usize| -> Vec<u8> { (0..len).map(|_| (rng.next_u64() % 16) as u8).collect() };
    let table: [K::Element; 256] = std::array::from_fn(|c| element(quarter(c as u8)));
    let (a, b) = (draw(m * k), draw(k * n));
    let bias: Vec<f32> = draw(n).iter().map(|&c| f32::from(c) / 4.0 - 2.0).collect();
    let expected = exact_product(&a, &b, (m, k, n));
    // The matrix `values` (rows × cols, row-major) stored at `offset` with `strides`, the rest filled with 0xff
    // (a value no element has).
    let store =
        |values: &[u8], (rows, cols): (usize, usize), offset: usize, strides: (usize, usize)| {
            let len = offset + (rows - 1) * strides.0 + (cols - 1) * strides.1 + 1;
            let mut stored = vec![0xffu8; len];
            for i in 0..rows * cols {
                stored[offset + i / cols * strides.0 + i % cols * strides.1] = values[i];
            }
            stored
        };
    let layouts = |(rows, cols): (usize, usize)| {
        [
            ("rows of contiguous columns", 0, (cols, 1)),
            ("columns of contiguous rows", 0, (1, rows)),
            ("neither contiguous", 5, (2 * cols + 3, 2)),
        ]
    };
    // Codes with a factor per block: the stored codes read as a row-major matrix of `stored_cols` columns (padded
    // to whole rows), cut into `block`s (partial at the edges), each with a power of two from 1/2 to 4, so that
    // every product and sum stays exact in f32.
    let values: [f32; 256] = std::array::from_fn(|c| quarter(c as u8));
    let mut factor_rng = Rng::new(seed ^ 0xb10c);
    let mut blocked = |mut stored: Vec<u8>, stored_cols: usize, block: ScaleBlock| {
        stored.resize(stored.len().div_ceil(stored_cols) * stored_cols, 0xff);
        let grid =
            (stored.len() / stored_cols).div_ceil(block.rows) * stored_cols.div_ceil(block.cols);
        let factors: Vec<f32> = (0..grid)
            .map(|_| [0.5, 1.0, 2.0, 4.0][(factor_rng.next_u64() % 4) as usize])
            .collect();
        let element = |i: usize| {
            let (row, col) = (i / stored_cols, i % stored_cols);
            let factor =
                factors[row / block.rows * stored_cols.div_ceil(block.cols) + col / block.cols];
            f64::from(values[usize::from(stored[i])]) * f64::from(factor)
        };
        let decoded: Vec<f64> = (0..stored.len()).map(element).collect();
        (stored, factors, decoded)
    };
    for (lhs_layout, lhs_offset, lhs_strides) in layouts((m, k)) {
        for (rhs_layout, rhs_offset, rhs_strides) in layouts((k, n)) {
            let lhs_codes = store(&a, (m, k), lhs_offset, lhs_strides);
            let rhs_codes = store(&b, (k, n), rhs_offset, rhs_strides);
            let as_codes = (
                Elements::Codes(&lhs_codes, &table),
                Elements::Codes(&rhs_codes, &table),
            );
            // The stored matrix's columns: one fewer than the larger stride, so that a lane's contiguous depth
            // (or a depth's contiguous lanes) runs across the stored rows and their blocks, not only along one
            // (the burn-te tests above cover the layouts the backends store).
            let stored_cols = |(rs, cs): (usize, usize)| rs.max(cs) - 1;
            let (lhs_cols, rhs_cols) = (stored_cols(lhs_strides), stored_cols(rhs_strides));
            let (lhs_blocked, lhs_factors, lhs_decoded) =
                blocked(lhs_codes.clone(), lhs_cols, ScaleBlock::new(2, 7));
            let (rhs_blocked, rhs_factors, rhs_decoded) =
                blocked(rhs_codes.clone(), rhs_cols, ScaleBlock::new(7, 2));
            let blocks = |codes, cols, block, factors| {
                Elements::Blocks(gemm::BlockCodes {
                    codes,
                    values: &values,
                    cols,
                    block,
                    factors,
                })
            };
            let as_blocks = (
                blocks(&lhs_blocked, lhs_cols, ScaleBlock::new(2, 7), &lhs_factors),
                blocks(&rhs_blocked, rhs_cols, ScaleBlock::new(7, 2), &rhs_factors),
            );
            // The blocked operands as dense matrices from each element's position, their product in f64 (exact,
            // so the order of the sums does not matter). At the large shape, each layout of each operand once
            // (the pairs of the same layout), for the test's time.
            let lhs_dense: Vec<f64> = (0..m * k)
                .map(|i| lhs_decoded[lhs_offset + i / k * lhs_strides.0 + i % k * lhs_strides.1])
                .collect();
            let rhs_dense: Vec<f64> = (0..k * n)
                .map(|i| rhs_decoded[rhs_offset + i / n * rhs_strides.0 + i % n * rhs_strides.1])
                .collect();
            let mut expected_blocks = vec![0f64; m * n];
            let with_blocks = lhs_layout == rhs_layout || m * k * n < 100_000;
            if with_blocks {
                for (row, out) in expected_blocks.chunks_exact_mut(n).enumerate() {
                    for (&x, w) in lhs_dense[row * k..][..k]
                        .iter()
                        .zip(rhs_dense.chunks_exact(n))
                    {
                        out.iter_mut().zip(w).for_each(|(o, &y)| *o += x * y);
                    }
                }
            }
            let expected_blocks: Vec<f32> = expected_blocks.into_iter().map(|v| v as f32).collect();
            let mut sources = vec![("codes", as_codes, &expected)];
            if with_blocks {
                sources.push(("codes with block factors", as_blocks, &expected_blocks));
            }
            for (source, (lhs_elements, rhs_elements), expected) in sources {
                let what = format!(
                    "{} {m}×{k}×{n}: lhs {lhs_layout}, rhs {rhs_layout}, {source}",
                    K::PATH
                );
                let source = |elements, offset, strides| Source {
                    elements,
                    offset,
                    strides,
                };
                let lhs = gemm::pack_lhs::<K>(m, k, &source(lhs_elements, lhs_offset, lhs_strides))
                    .expect("in bounds");
                let rhs = gemm::pack_rhs::<K>(k, n, &source(rhs_elements, rhs_offset, rhs_strides))
                    .expect("in bounds");
                // NaN where the GEMM may not read: the first depth block writes without reading.
                let mut out = vec![std::mem::MaybeUninit::new(f32::NAN); m * n];
                let plain = gemm::Epilogue {
                    alpha: 1.0,
                    bias: None,
                };
                gemm::gemm(&lhs, &rhs, plain, &mut out)?;
                // SAFETY: every value was initialized (NaN) before the GEMM wrote it.
                let out = unsafe { burn_te_kernels::host::assume_init(out) };
                for (i, (got, want)) in out.iter().zip(expected.iter()).enumerate() {
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{what}: output {i} = {got}, exact {want}"
                    );
                }
                // The epilogue: a factor and a bias (multiples of 1/4), every sum still exact in f32.
                let mut out = vec![std::mem::MaybeUninit::new(f32::NAN); m * n];
                let epilogue = gemm::Epilogue {
                    alpha: 0.5,
                    bias: Some(&bias),
                };
                gemm::gemm(&lhs, &rhs, epilogue, &mut out)?;
                // SAFETY: as above.
                let out = unsafe { burn_te_kernels::host::assume_init(out) };
                for (i, (got, want)) in out.iter().zip(expected.iter()).enumerate() {
                    let want = (f64::from(*want) * 0.5 + f64::from(bias[i % n])) as f32;
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{what}, alpha 0.5 and a bias: output {i} = {got}, exact {want}"
                    );
                }
                // The right operand packed block by block inside the tasks (AMX's way, any path's units): the same
                // bits.
                let in_tasks =
                    gemm::rhs_in_tasks::<K>(k, n, &source(rhs_elements, rhs_offset, rhs_strides))
                        .expect("in bounds");
                let mut out = vec![std::mem::MaybeUninit::new(f32::NAN); m * n];
                gemm::gemm(&lhs, &in_tasks, epilogue, &mut out)?;
                // SAFETY: as above.
                let out = unsafe { burn_te_kernels::host::assume_init(out) };
                for (i, (got, want)) in out.iter().zip(expected.iter()).enumerate() {
                    let want = (f64::from(*want) * 0.5 + f64::from(bias[i % n])) as f32;
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{what}, right operand packed in the tasks: output {i} = {got}, exact {want}"
                    );
                }
            }
        }
    }
    Ok(())
}

/// The bf16 path's packing and blocking with a scalar micro-kernel in place of `vdpbf16ps` (each pair's two
/// products added to an f32 accumulator), so that the pair layout, the 12 × 32 tiles and the bf16 blocks are
/// checked on CPUs without AVX512-BF16 too. It claims the `f32` path, which every CPU has.
struct EmulatedBf16;

impl burn_te_kernels::host::gemm::Kernel for EmulatedBf16 {
    const PATH: HostGemmPath = HostGemmPath::F32;
    type Element = u16;
    const MR: usize = Bf16::MR;
    const NR: usize = Bf16::NR;
    const KC: usize = Bf16::KC;
    const MC: usize = Bf16::MC;
    const NC: usize = Bf16::NC;

    unsafe fn micro_kernel(a: *const u32, b: *const u32, kc: usize, tile: *mut f32) {
        let value = |bits: u32| f32::from_bits(bits << 16);
        let (mr, nr) = (Self::MR, Self::NR);
        for r in 0..mr {
            for c in 0..nr {
                let mut acc = 0f32;
                for p in 0..kc {
                    // SAFETY: the trait's contract: `a` holds `kc · MR` units, `b` `kc · NR`, `tile` MR · NR.
                    let (x, y) = unsafe { (*a.add(p * mr + r), *b.add(p * nr + c)) };
                    acc += value(x & 0xffff) * value(y & 0xffff);
                    acc += value(x >> 16) * value(y >> 16);
                }
                unsafe { *tile.add(r * nr + c) = acc };
            }
        }
    }
}

/// The packed kernels read through strides (a depth-contiguous, a lane-contiguous and a general layout with an
/// offset; codes through a table, and codes with a factor per block), bit-exact against an integer (or f64)
/// re-computation, without and with the epilogue's factor and bias, the right operand packed whole and in the
/// tasks (`rhs_in_tasks`): at a small shape, and at one that crosses several depth blocks, row blocks and column
/// blocks of every path with partial last blocks (bf16: 384 depths per block, the FMA paths 256, AMX 512 in groups
/// of 32; 144 rows per task, AMX 512; 256 columns), so that the loop adding each later depth block into the output is what the result depends on. A
/// path this CPU lacks must say so; the bf16 path's packing and blocking run everywhere with an emulated
/// instruction.
#[test]
fn packed_kernels_are_exact_across_layouts_and_blocks() {
    use burn_te_kernels::host::gemm::HostGemmError;
    use burn_te_kernels::host::gemm::amx::AmxBf16Kernel;
    use burn_te_kernels::host::gemm::bf16::Avx512Bf16Kernel;
    use burn_te_kernels::host::gemm::fma::Avx2FmaKernel;
    use burn_te_kernels::host::gemm::fma512::Avx512FmaKernel;

    let bf16 = |v: f32| exact_bf16(v).expect("a multiple of 1/4");
    let f32_bits = |v: f32| v.to_bits();
    let mut ran = vec![];
    for (shape, seed) in [((13, 45, 33), 41), ((530, 1100, 300), 42)] {
        // The bf16 path's packing (pairs), tiles and blocks run on every CPU, its instruction emulated.
        packed_gemm_matches::<EmulatedBf16>(shape, bf16, seed).expect("runs everywhere");
        let results = [
            (
                HostGemmPath::AmxBf16,
                packed_gemm_matches::<AmxBf16Kernel>(shape, bf16, seed),
            ),
            (
                HostGemmPath::Avx512Bf16,
                packed_gemm_matches::<Avx512Bf16Kernel>(shape, bf16, seed),
            ),
            (
                HostGemmPath::Avx512Fma,
                packed_gemm_matches::<Avx512FmaKernel>(shape, f32_bits, seed),
            ),
            (
                HostGemmPath::Avx2Fma,
                packed_gemm_matches::<Avx2FmaKernel>(shape, f32_bits, seed),
            ),
        ];
        for (path, result) in results {
            match result {
                Ok(()) => ran.push((path, shape)),
                Err(err) => {
                    assert!(!path.available(), "{path} at {shape:?}: {err}");
                    assert_eq!(err, HostGemmError::Unavailable(path));
                    assert!(err.to_string().contains(path.name()), "{err}");
                }
            }
        }
    }
    let packed: Vec<_> = paths()
        .into_iter()
        .filter(|&p| p != HostGemmPath::F32)
        .collect();
    for path in &packed {
        assert_eq!(
            ran.iter().filter(|(p, _)| p == path).count(),
            2,
            "{path} ran at both shapes"
        );
    }
    println!("packed kernels run: {ran:?}");
}

/// `a · b` (`m × k` and `k × n` E4M3 codes, row-major) on an f32 FMA path, or why it did not run.
fn fma_path_gemm<K: burn_te_kernels::host::gemm::Kernel<Element = u32>>(
    a: &[u8],
    b: &[u8],
    (m, k, n): (usize, usize, usize),
) -> Result<Vec<f32>, burn_te_kernels::host::gemm::HostGemmError> {
    use burn_te_kernels::host::gemm::{self, Elements, Source};
    let table: [u32; 256] = std::array::from_fn(|c| Fp8Format::E4M3.decode(c as u8).to_bits());
    let source = |codes, strides| Source {
        elements: Elements::Codes(codes, &table),
        offset: 0,
        strides,
    };
    let lhs = gemm::pack_lhs::<K>(m, k, &source(a, (k, 1)))?;
    let rhs = gemm::pack_rhs::<K>(k, n, &source(b, (n, 1)))?;
    let mut out = burn_te_kernels::host::uninit(m * n);
    let plain = gemm::Epilogue {
        alpha: 1.0,
        bias: None,
    };
    gemm::gemm(&lhs, &rhs, plain, &mut out)?;
    // SAFETY: the GEMM wrote every value.
    Ok(out
        .into_iter()
        .map(|v| unsafe { v.assume_init() })
        .collect())
}

/// The two FMA paths add the same products in the same order over the same depth blocks, so switching between
/// them moves no bits: E4M3 codes of every magnitude (sums that round), a depth of three blocks with a partial
/// last one, partial tiles at both edges. Both run where `/proc/cpuinfo` promises them.
#[test]
fn the_two_fma_paths_give_the_same_bits() {
    use burn_te_kernels::host::gemm::fma::Avx2FmaKernel;
    use burn_te_kernels::host::gemm::fma512::Avx512FmaKernel;

    let dims @ (m, k, n) = (37, 700, 83);
    let mut rng = Rng::new(11);
    // Every finite E4M3 code (0x7f and 0xff are NaN).
    let mut draw = |len: usize| -> Vec<u8> {
        (0..len)
            .map(|_| (rng.next_u64() % 0x7f) as u8 | (rng.next_u64() as u8 & 0x80))
            .collect()
    };
    let (a, b) = (draw(m * k), draw(k * n));
    let promised = expected_paths();
    let results = [
        (
            HostGemmPath::Avx512Fma,
            fma_path_gemm::<Avx512FmaKernel>(&a, &b, dims),
        ),
        (
            HostGemmPath::Avx2Fma,
            fma_path_gemm::<Avx2FmaKernel>(&a, &b, dims),
        ),
    ];
    let mut outputs = vec![];
    for (path, result) in results {
        match result {
            Ok(out) => outputs.push((path, out)),
            Err(err) => assert!(!promised.contains(&path), "{path}: {err}"),
        }
    }
    let [(_, wide), (_, narrow)] = outputs.as_slice() else {
        println!(
            "only {:?} on this CPU: nothing to compare",
            outputs.iter().map(|o| o.0).collect::<Vec<_>>()
        );
        return;
    };
    // The sums round: the f32 results are not the exact ones (so equal bits are not equal exact values).
    let decode = |c: u8| f64::from(Fp8Format::E4M3.decode(c));
    let rounded = (0..m * n)
        .filter(|&i| {
            let (r, c) = (i / n, i % n);
            let exact: f64 = (0..k)
                .map(|p| decode(a[r * k + p]) * decode(b[p * n + c]))
                .sum();
            f64::from(wide[i]) != exact
        })
        .count();
    assert!(
        rounded > m * n / 2,
        "only {rounded} of {} sums round",
        m * n
    );
    for (i, (x, y)) in wide.iter().zip(narrow).enumerate() {
        assert_eq!(
            x.to_bits(),
            y.to_bits(),
            "output {i}: avx512fma {x:e}, avx2fma {y:e}"
        );
    }
}

/// FP8 codes packed as bf16 pairs (the bf16 and AMX paths) and as f32 values (both FMA paths), every one of the 256
/// codes through an arbitrary table, unit by unit against the layout `PackedLhs`/`PackedRhs` document (panel `i`'s
/// unit `p` of lane `l` at `(i · units + p) · width + l`, a pair `lo | hi << 16`, zero past the lanes and an odd
/// depth; AMX's units padded to groups of 16, its left panels group by group row by row):
/// lanes contiguous, depth contiguous and neither, with an offset, for lane counts and depths around the vector
/// packing's 32 lanes and 64-code chunks. Where the flags in `/proc/cpuinfo` promise AVX512-VBMI the vector
/// packing must be the one that runs: for f32 values, where every table entry is a bf16 value shifted up (a
/// table with a scale folded in takes the scalar packing, checked here too).
#[test]
fn fp8_codes_pack_into_bf16_pairs_as_documented() {
    use burn_te_kernels::host::gemm::amx::AmxBf16Kernel;
    use burn_te_kernels::host::gemm::fma::Avx2FmaKernel;
    use burn_te_kernels::host::gemm::fma512::Avx512FmaKernel;
    use burn_te_kernels::host::gemm::{Elements, PackedElement, pack_vbmi};

    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = cpuinfo
        .lines()
        .find(|line| line.starts_with("flags"))
        .unwrap_or_default();
    let has = |flag: &str| flags.split_whitespace().any(|f| f == flag);
    let promised = cfg!(target_arch = "x86_64") && has("avx512vbmi") && has("avx512bw");
    assert_eq!(
        pack_vbmi::available(),
        promised,
        "the vector packing's availability against /proc/cpuinfo's avx512vbmi and avx512bw"
    );
    let mut rng = Rng::new(7);
    let table: [u16; 256] = std::array::from_fn(|_| rng.next_u64() as u16);
    // f32 values: the same bf16 bits shifted up (the vector packing takes them), and with one low bit set (a scaled
    // value that is not a bf16 value: the scalar packing).
    let values: [u32; 256] = table.map(|bits| u32::from(bits) << 16);
    let mut scaled = values;
    scaled[200] |= 1;
    // The gates the packing goes through: a prepared table where the CPU has the instructions, none elsewhere; f32
    // tables only where every entry is a bf16 value.
    assert_eq!(
        pack_vbmi::lookup(table, 2).is_some(),
        promised,
        "the vector packing's table against /proc/cpuinfo"
    );
    assert_eq!(u32::bf16_table(&values), Some(table));
    assert_eq!(u32::bf16_table(&scaled), None);
    let mut checked = 0;
    for lanes in [1, 12, 31, 32, 45, 100] {
        for depth in [1, 2, 63, 64, 65, 130, 257] {
            let codes: Vec<u8> = (0..lanes * depth).map(|_| rng.next_u64() as u8).collect();
            let layouts = [
                ("depth contiguous", 3, (depth, 1)),
                ("lanes contiguous", 3, (1, lanes)),
                ("neither", 3, (2 * depth + 1, 2)),
            ];
            for (layout, offset, (lane_stride, depth_stride)) in layouts {
                let len = offset + (lanes - 1) * lane_stride + (depth - 1) * depth_stride + 1;
                let mut stored = vec![0u8; len];
                for l in 0..lanes {
                    for d in 0..depth {
                        stored[offset + l * lane_stride + d * depth_stride] = codes[l * depth + d];
                    }
                }
                let code = |l: usize, d: usize| codes[l * depth + d];
                // Pairs with the units padded to a multiple of `group`, grouped row by row where `grouped`.
                let grouped_pairs = |group: usize, width: usize, grouped: bool| -> Vec<u32> {
                    let units = depth.div_ceil(2).div_ceil(group) * group;
                    let mut out = vec![0u32; lanes.div_ceil(width) * width * units];
                    for l in 0..lanes {
                        for p in 0..depth.div_ceil(2) {
                            let lo = u32::from(table[usize::from(code(l, 2 * p))]);
                            let hi = if 2 * p + 1 < depth {
                                u32::from(table[usize::from(code(l, 2 * p + 1))])
                            } else {
                                0
                            };
                            let (panel, lane) = (l / width, l % width);
                            let at = if grouped {
                                let q = p % group;
                                (panel * units + p - q) * width + lane * group + q
                            } else {
                                (panel * units + p) * width + lane
                            };
                            out[at] = lo | hi << 16;
                        }
                    }
                    out
                };
                let pairs = |width: usize, _: bool| grouped_pairs(1, width, false);
                let amx_pairs = |width: usize, grouped: bool| grouped_pairs(16, width, grouped);
                let singles = |table: &[u32; 256], width: usize| -> Vec<u32> {
                    let mut out = vec![0u32; lanes.div_ceil(width) * width * depth];
                    for l in 0..lanes {
                        for p in 0..depth {
                            out[(l / width * depth + p) * width + l % width] =
                                table[usize::from(code(l, p))];
                        }
                    }
                    out
                };
                let what = format!("{lanes} lanes × depth {depth}, {layout}");
                let shape = (offset, lanes, depth, lane_stride, depth_stride);
                let bf16 = format!("bf16, {what}");
                packs_as_expected::<Bf16>(Elements::Codes(&stored, &table), shape, pairs, &bf16);
                let amx = format!("amx, {what}");
                packs_as_expected::<AmxBf16Kernel>(
                    Elements::Codes(&stored, &table),
                    shape,
                    amx_pairs,
                    &amx,
                );
                for (name, table) in [("f32", &values), ("f32 scaled", &scaled)] {
                    let expected = |width, _| singles(table, width);
                    let what = format!("{name}, {what}");
                    packs_as_expected::<Avx2FmaKernel>(
                        Elements::Codes(&stored, table),
                        shape,
                        expected,
                        &what,
                    );
                    packs_as_expected::<Avx512FmaKernel>(
                        Elements::Codes(&stored, table),
                        shape,
                        expected,
                        &what,
                    );
                }
                checked += 12;
            }
        }
    }
    println!(
        "{checked} packings checked, {} packing",
        if pack_vbmi::available() {
            "AVX512-VBMI vector"
        } else {
            "scalar"
        }
    );
}

/// Block-scaled codes (`BlockCodes`: E4M3 codes, one factor per block) packed as bf16 pairs (the bf16 path) and as
/// f32 values (both FMA paths), unit by unit against the layout `PackedLhs`/`PackedRhs` document and each element
/// re-computed here: `value(code) · factor` rounded once in f32, as bf16 its top half with a NaN made quiet (sign
/// kept, payload dropped). Every code (NaNs with a payload included) with factors that are powers of two from 2⁻¹³⁰ (products below f32's normal
/// range) to 2¹⁰⁰ (products that overflow) and factors that are not (bf16's truncation shows): lanes contiguous in
/// one row's columns (the vector packing on AVX512-VBMI; depths one or two stored rows apart), each lane's depth
/// inside one stored row (vector too, from an offset inside the row or from its start, where a block a multiple of
/// 16 wide gives each vector of 16 one factor), and the layouts the scalar packing keeps
/// (runs that cross a row's end, neither contiguous), for block shapes along either side, square, and of one
/// element, around the vector packing's 32 lanes and 64-code chunks.
#[test]
fn block_scaled_codes_pack_as_documented() {
    use burn_te_kernels::host::gemm::fma::Avx2FmaKernel;
    use burn_te_kernels::host::gemm::fma512::Avx512FmaKernel;
    use burn_te_kernels::host::gemm::{BlockCodes, Elements, pack_vbmi};

    // E4M3's values, its two NaN codes as signalling NaNs with a payload in their top halves (bf16 values still,
    // so the vector packing takes them): each product is then a quiet NaN with that payload, which the bf16 element
    // must drop for the canonical quiet NaN of its sign.
    let mut values: [f32; 256] = std::array::from_fn(|c| Fp8Format::E4M3.decode(c as u8));
    values[0x7f] = f32::from_bits(0x7fa1_0000);
    values[0xff] = f32::from_bits(0xffb0_0000);
    let mut rng = Rng::new(11);
    let scales = [
        2f32.powi(-130),
        2f32.powi(-3),
        1.0,
        4.0,
        2f32.powi(100),
        1.3,
        0.7,
    ];
    /// The stored element `i` as a unit's element: f32 bits, or bf16 bits (the top half, a NaN quiet).
    fn bf16_of(value: f32) -> u32 {
        let bits = value.to_bits();
        if value.is_nan() {
            (bits >> 16) & 0x8000 | 0x7fc0
        } else {
            bits >> 16
        }
    }
    /// The documented layout of `lanes × depth` elements in units of `per` depths, lane `l`'s depth `d` the element
    /// at `offset + l · lane_stride + d · depth_stride` as a unit's half (`unit_of`), for panels `width` wide.
    fn documented(
        (offset, lanes, depth, lane_stride, depth_stride): (usize, usize, usize, usize, usize),
        per: usize,
        width: usize,
        element: &dyn Fn(usize) -> f32,
        unit_of: fn(f32) -> u32,
    ) -> Vec<u32> {
        let units = depth.div_ceil(per);
        let mut out = vec![0u32; lanes.div_ceil(width) * width * units];
        for l in 0..lanes {
            for p in 0..units {
                let at = |d: usize| offset + l * lane_stride + d * depth_stride;
                let lo = unit_of(element(at(per * p)));
                let hi = if per == 2 && 2 * p + 1 < depth {
                    unit_of(element(at(2 * p + 1)))
                } else {
                    0
                };
                out[(l / width * units + p) * width + l % width] = lo | hi << 16;
            }
        }
        out
    }

    let mut checked = 0;
    for (block_rows, block_cols) in [(1, 32), (32, 1), (2, 7), (7, 2), (16, 16), (1, 1)] {
        let block = ScaleBlock::new(block_rows, block_cols);
        for lanes in [1, 12, 32, 45] {
            for depth in [1usize, 2, 64, 65, 130] {
                // (layout, stored columns, offset, lane stride, depth stride)
                let layouts = [
                    (
                        "depth contiguous in one row",
                        depth + 5,
                        2usize,
                        depth + 5,
                        1usize,
                    ),
                    (
                        "depth contiguous from a row's start",
                        depth.next_multiple_of(16) + 16,
                        0,
                        depth.next_multiple_of(16) + 16,
                        1,
                    ),
                    ("depth contiguous across rows", 7, 0, depth + 1, 1),
                    ("lanes contiguous in one row", lanes + 5, 3, 1, lanes + 5),
                    (
                        "lanes contiguous, depths two rows apart",
                        lanes + 5,
                        3,
                        1,
                        2 * lanes + 10,
                    ),
                    (
                        "lanes contiguous across rows",
                        lanes / 2 + 1,
                        1,
                        1,
                        lanes + 1,
                    ),
                    ("neither", 9, 5, 2 * depth + 1, 2),
                ];
                for (layout, cols, offset, lane_stride, depth_stride) in layouts {
                    let reach = offset + (lanes - 1) * lane_stride + (depth - 1) * depth_stride + 1;
                    let rows = reach.div_ceil(cols);
                    let codes: Vec<u8> = (0..rows * cols).map(|_| rng.next_u64() as u8).collect();
                    let grid = rows.div_ceil(block_rows) * cols.div_ceil(block_cols);
                    let factors: Vec<f32> = (0..grid)
                        .map(|_| scales[(rng.next_u64() % scales.len() as u64) as usize])
                        .collect();
                    let blocks = BlockCodes {
                        codes: &codes,
                        values: &values,
                        cols,
                        block,
                        factors: &factors,
                    };
                    let element = |i: usize| {
                        let (row, col) = (i / cols, i % cols);
                        let factor = factors
                            [row / block_rows * cols.div_ceil(block_cols) + col / block_cols];
                        values[usize::from(codes[i])] * factor
                    };
                    let what = format!(
                        "{lanes} lanes × depth {depth}, {layout}, blocks {block_rows} × {block_cols}"
                    );
                    let shape = (offset, lanes, depth, lane_stride, depth_stride);
                    let pairs = |width, _| documented(shape, 2, width, &element, bf16_of);
                    let singles = |width, _| documented(shape, 1, width, &element, f32::to_bits);
                    let bf16 = format!("bf16, {what}");
                    packs_as_expected::<Bf16>(Elements::Blocks(blocks), shape, pairs, &bf16);
                    let what = format!("f32, {what}");
                    let source = Elements::Blocks(blocks);
                    packs_as_expected::<Avx2FmaKernel>(source, shape, singles, &what);
                    packs_as_expected::<Avx512FmaKernel>(source, shape, singles, &what);
                    checked += 6;
                }
            }
        }
    }
    println!(
        "{checked} block-scaled packings checked, {} packing where a layout allows",
        if pack_vbmi::available() {
            "AVX512-VBMI vector"
        } else {
            "scalar"
        }
    );
}

/// Packs `lanes × depth` from `elements` as both operands of `K` (the lanes are the left operand's rows, its strides
/// (row, depth); or the right one's columns, its strides (depth, column)) and compares each with
/// `expected(width, grouped)` (`grouped`: the left operand where `K` lays each group of units out row by row).
fn packs_as_expected<K: burn_te_kernels::host::gemm::Kernel>(
    elements: burn_te_kernels::host::gemm::Elements<'_, K::Element>,
    (offset, lanes, depth, lane_stride, depth_stride): (usize, usize, usize, usize, usize),
    expected: impl Fn(usize, bool) -> Vec<u32>,
    what: &str,
) {
    use burn_te_kernels::host::gemm::{self, Source};
    let source = |strides| Source {
        elements,
        offset,
        strides,
    };
    let lhs =
        gemm::pack_lhs::<K>(lanes, depth, &source((lane_stride, depth_stride))).expect("in bounds");
    same_units(
        lhs.units(),
        &expected(K::MR, K::LHS_ROW_GROUPS),
        &format!("left operand, {what}"),
    );
    let rhs =
        gemm::pack_rhs::<K>(depth, lanes, &source((depth_stride, lane_stride))).expect("in bounds");
    same_units(
        rhs.units(),
        &expected(K::NR, false),
        &format!("right operand, {what}"),
    );
}

/// Packed units equal, or a failure naming the first unit that differs (and how many do).
fn same_units(actual: &[u32], expected: &[u32], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: packed length");
    let wrong: Vec<usize> = (0..actual.len())
        .filter(|&i| actual[i] != expected[i])
        .collect();
    if let Some(&i) = wrong.first() {
        panic!(
            "{what}: {} of {} units differ, the first at {i}: {:#010x}, expected {:#010x}",
            wrong.len(),
            actual.len(),
            actual[i],
            expected[i]
        );
    }
}

/// The packing's bounds: a source one element short is an error naming the element it would read, and strides
/// whose reach overflows `usize` are an error too (checked arithmetic, not a wrapped index that passes the check).
#[test]
fn packing_out_of_bounds_is_an_error() {
    use burn_te_kernels::host::gemm::fma::Avx2FmaKernel;
    use burn_te_kernels::host::gemm::{self, Elements, HostGemmError, Source};

    let (m, k) = (13, 45);
    let table = [0u32; 256];
    let short = vec![0u8; m * k - 1];
    let source = |codes, strides| Source {
        elements: Elements::Codes(codes, &table),
        offset: 0,
        strides,
    };
    let err = gemm::pack_lhs::<Avx2FmaKernel>(m, k, &source(&short, (k, 1)))
        .err()
        .expect("out of bounds");
    assert!(
        err.to_string()
            .contains(&format!("reads element {}", m * k - 1)),
        "{err}"
    );
    // Three rows 2⁶³ apart: a wrapping product would reach element 0 + (k − 1), inside the stored codes.
    let codes = vec![0u8; 4096];
    let err = gemm::pack_lhs::<Avx2FmaKernel>(3, k, &source(&codes, (1 << 63, 1)))
        .err()
        .expect("overflowing strides");
    assert!(
        matches!(err, HostGemmError::OutOfBounds { last: None, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("beyond usize::MAX"), "{err}");
    // Codes with block factors: one factor short of the 13 × 45 grid's 7 × 2 blocks of 2 × 32, and codes that do
    // not fill whole rows.
    let values = [1f32; 256];
    let factors = [1f32; 14];
    let codes = vec![0u8; m * k];
    let blocks = |codes, cols, factors| Source {
        elements: Elements::Blocks(gemm::BlockCodes {
            codes,
            values: &values,
            cols,
            block: ScaleBlock::new(2, 32),
            factors,
        }),
        offset: 0,
        strides: (k, 1),
    };
    gemm::pack_lhs::<Avx2FmaKernel>(m, k, &blocks(&codes, k, &factors))
        .expect("one factor per block");
    for (codes, cols, factors) in [
        (&codes[..], k, &factors[..13]),
        (&codes[..m * k - 1], k, &factors[..]),
    ] {
        let err = gemm::pack_lhs::<Avx2FmaKernel>(m, k, &blocks(codes, cols, factors))
            .err()
            .expect("the factors do not fit the blocks");
        assert!(
            matches!(err, HostGemmError::BlockFactors { factors: f, .. } if f == factors.len()),
            "{err:?}"
        );
        let message = err.to_string();
        assert!(
            message.contains(&format!(
                "{} codes of {k} columns in blocks of 2 × 32",
                codes.len()
            )) && message.contains(&format!("not {}", factors.len())),
            "{message}"
        );
    }
}

/// Packed operands of 1 MiB and more come from the host outputs' process-wide pool, within its bound: a freed
/// packing buffer is reused by the next operand of its size and overwritten whole (the units, and the zeros of the
/// lanes past the last row, re-computed from the codes after a pack of other codes into the same block), at most
/// the bound stays held (the least recently freed released), a small operand is a plain allocation, and with the
/// pool off nothing is pooled. Alone in its process (the pool is process-wide), with a 24 MiB bound.
#[test]
fn large_packing_buffers_come_from_the_pool_within_its_bound() {
    alone(
        "host_gemm::large_packing_buffers_come_from_the_pool_within_its_bound",
        || {
            use burn_te_kernels::host::gemm::fma::Avx2FmaKernel;
            use burn_te_kernels::host::gemm::{self, Elements, Source};
            use burn_te_kernels::host::pool::{
                PoolStats, pool_stats, set_held_limit, set_overwrite_check,
            };

            set_held_limit(24 << 20);
            // Reused blocks keep their old values, as in release builds.
            set_overwrite_check(false);
            let depth = 1024;
            let table: [u32; 256] = std::array::from_fn(|code| (code as f32 - 128.0).to_bits());
            let pack = |codes: &[u8], rows: usize| {
                let source = Source {
                    elements: Elements::Codes(codes, &table),
                    offset: 0,
                    strides: (depth, 1),
                };
                gemm::pack_lhs::<Avx2FmaKernel>(rows, depth, &source).expect("packs")
            };
            // Panel `i`'s unit `p` of lane `r` at `(i · depth + p) · 6 + r`, zero past the last row.
            let expected = |codes: &[u8], rows: usize| -> Vec<u32> {
                let mut units = vec![0; rows.div_ceil(6) * 6 * depth];
                for lane in 0..rows {
                    for p in 0..depth {
                        units[(lane / 6 * depth + p) * 6 + lane % 6] =
                            table[usize::from(codes[lane * depth + p])];
                    }
                }
                units
            };
            let mut rng = Rng::new(5);
            let mut codes = |rows: usize| -> Vec<u8> {
                (0..rows * depth).map(|_| rng.next_u64() as u8).collect()
            };
            let start = pool_stats();
            let stats = |reused, allocated, held_mib: usize| PoolStats {
                reused: start.reused + reused,
                allocated: start.allocated + allocated,
                held_bytes: held_mib << 20,
            };
            // 1536 rows (1534 padded to panels of 6) × 1024 f32: 6 MiB.
            let (rows, short) = (1536, 1534);
            let first_codes = codes(rows);
            let first = pack(&first_codes, rows);
            assert_eq!(first.units(), expected(&first_codes, rows));
            assert_eq!(pool_stats(), stats(0, 1, 0), "a fresh block");
            drop(first);
            assert_eq!(pool_stats(), stats(0, 1, 6), "the freed block held");
            // Other codes, two rows fewer, into the block that holds the first's units.
            let second_codes = codes(short);
            let second = pack(&second_codes, short);
            assert_eq!(pool_stats(), stats(1, 1, 0), "the freed block reused");
            assert_eq!(
                second.units(),
                expected(&second_codes, short),
                "a reused block overwritten whole"
            );
            drop(second);
            // Five alive at once (one reused, four fresh), then freed: four stay in the 24 MiB bound.
            let all = codes(rows);
            let packed: Vec<_> = (0..5).map(|_| pack(&all, rows)).collect();
            assert_eq!(pool_stats(), stats(2, 5, 0));
            drop(packed);
            assert_eq!(pool_stats(), stats(2, 5, 24), "held within the bound");
            // Below 1 MiB: a plain allocation.
            let small = codes(6);
            assert_eq!(pack(&small, 6).units(), expected(&small, 6));
            assert_eq!(
                pool_stats(),
                stats(2, 5, 24),
                "a small operand is not pooled"
            );
            // The pool off: a plain allocation, the pool's counts unchanged.
            set_held_limit(0);
            assert_eq!(pack(&all, rows).units(), expected(&all, rows));
            let now = pool_stats();
            assert_eq!(
                (now.reused, now.allocated),
                (start.reused + 2, start.allocated + 5),
                "the pool off: a plain allocation"
            );
        },
    );
}

/// The minor page faults of the calling thread so far (`/proc/thread-self/stat`, field 10).
fn thread_minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("/proc/thread-self/stat");
    let after_name = stat
        .rsplit_once(')')
        .expect("the stat line names the thread")
        .1;
    after_name
        .split_whitespace()
        .nth(7)
        .and_then(|f| f.parse().ok())
        .expect("minflt")
}

/// glibc's malloc thresholds fixed by `keep_freed_memory`: a step's buffers (16 of 2 MiB, each written, then all
/// freed) allocated again step after step come back without page faults. With glibc's own moving thresholds (the
/// first part, before they are fixed) the 32 MiB freed at the arena's top went back to the OS, and each step
/// faulted its 8 192 pages in again. Alone in its process (the thresholds are process-wide).
#[test]
fn freed_step_buffers_stay_mapped_with_the_malloc_thresholds_kept() {
    alone(
        "host_gemm::freed_step_buffers_stay_mapped_with_the_malloc_thresholds_kept",
        || {
            use burn_te_kernels::host::malloc::{MallocThresholds, keep_freed_memory};
            const PAGES: u64 = 16 * (2 << 20) / 4096;
            // One step's faults: its buffers written whole, then freed together.
            let step = || {
                let before = thread_minor_faults();
                let buffers: Vec<Vec<u8>> = (0..16).map(|i| vec![i as u8 + 1; 2 << 20]).collect();
                std::hint::black_box(&buffers);
                drop(buffers);
                thread_minor_faults() - before
            };
            let moving: Vec<u64> = (0..4).map(|_| step()).collect();
            assert!(
                moving[1..].iter().all(|&f| f >= PAGES / 2),
                "with glibc's own thresholds each step faults its pages in again: {moving:?}"
            );
            assert_eq!(keep_freed_memory(), MallocThresholds::Set);
            let kept: Vec<u64> = (0..4).map(|_| step()).collect();
            assert!(
                kept[1..].iter().all(|&f| f < 64),
                "with the thresholds kept a step reuses the pages freed by the step before: {kept:?} faults per \
                 step (glibc's own: {moving:?})"
            );
        },
    );
}

/// The host path applies the thresholds at its first output and says so in the metrics report
/// (`HostMallocThresholds(set)`); `BURN_TE_HOST_MALLOC=glibc` leaves glibc's own, and an unknown value is recorded
/// as a fallback naming the variable, the default taken. Each alone in its process with the variable set.
#[test]
fn the_host_path_reports_what_it_did_to_the_malloc_thresholds() {
    let cases = [
        (None, "set"),
        (Some("glibc"), "left to glibc"),
        (Some("sometimes"), "set"),
    ];
    let test = "host_gemm::the_host_path_reports_what_it_did_to_the_malloc_thresholds";
    if std::env::var_os("BURN_TE_TEST_ALONE").is_some() {
        let value = std::env::var(burn_te::backends::host::HOST_MALLOC_ENV).ok();
        let (_, expected) = cases
            .iter()
            .find(|(v, _)| v.map(str::to_string) == value)
            .expect("a case of this test");
        // One host FP8 GEMM: the host path's first output.
        let device = Default::default();
        let a = Tensor::<Autodiff<Te<Flex>>, 2>::ones([4, 4], &device);
        let out =
            fp8_autocast(true, DelayedScaling::default(), || a.clone().matmul(a)).expect("recipe");
        // Four products of ones, through DelayedScaling's scale 448 and its f32 inverse.
        let values = out.into_data().to_vec::<f32>().unwrap();
        assert!(values.iter().all(|v| (v - 4.0).abs() < 4e-6), "{values:?}");
        let counter = format!(
            "{}({expected})",
            burn_te::backends::host::HOST_MALLOC_THRESHOLDS
        );
        assert_eq!(
            burn_te::diagnostics::counter_value(&counter),
            Some(1),
            "{counter}"
        );
        let fallback = burn_te::fallback_counts()
            .get(burn_te::backends::host::HOST_MALLOC_ENV)
            .copied();
        let unknown = value.as_deref() == Some("sometimes");
        assert_eq!(
            fallback,
            unknown.then_some(1),
            "the fallback of an unknown value"
        );
        return;
    }
    for (value, _) in cases {
        let vars: Vec<(&str, &str)> = value
            .map(|v| (burn_te::backends::host::HOST_MALLOC_ENV, v))
            .into_iter()
            .collect();
        crate::common::alone_with(test, &vars, || unreachable!("the parent only spawns"));
    }
}

/// Large GEMM outputs reuse freed memory from the pool (`burn_te_kernels::host::pool`) within its bound, and a
/// reused block is overwritten whole: a GEMM whose every output differs in sign from the block's previous contents
/// matches f64; a fused norm's output and a zeroed buffer from dirty blocks hold what they should, and a buffer for
/// overwrite keeps a reused block's values (zeroing only what no output wrote). Alone in its
/// process (the pool and its bound are process-wide), with a 24 MiB bound.
#[test]
fn large_gemm_outputs_reuse_pooled_memory_within_the_bound() {
    alone(
        "host_gemm::large_gemm_outputs_reuse_pooled_memory_within_the_bound",
        || {
            use burn_te_kernels::host::pool::{POOLED_FROM, PoolStats, pool_stats};
            // SAFETY: this process runs this test alone, on one thread, before anything reads the variable.
            unsafe { std::env::set_var("BURN_TE_HOST_POOL_MIB", "24") };
            // A 4 MiB output (512 × 2048 f32): pooled.
            let (m, k, n) = (512, 32, 2048);
            assert!(m * n * 4 >= POOLED_FROM);
            let mut rng = Rng::new(41);
            let x = rng.normal(m * k, 0.0, 1.0);
            let w = rng.normal(k * n, 0.0, 0.05);
            let site = GemmSite::new("pooled", Gemm::Fprop);
            let recipe: Recipe = Float8CurrentScaling::default().into();
            let quantize = |values: Vec<f32>, shape, role| {
                quantize_operand::<B>(
                    float(values, shape),
                    &recipe,
                    &site,
                    role,
                    true,
                    false,
                    None,
                )
                .expect("quantize")
                .tensor
            };
            let wq = quantize(w, [k, n], TensorRole::Weight);
            let gemm = |x: &[f32]| {
                let xq = quantize(x.to_vec(), [m, k], TensorRole::Activation);
                let expected =
                    reference(&stored_f64::<B>(&xq), false, &stored_f64::<B>(&wq), false);
                (
                    B::fp8_gemm(xq, false, wq.clone(), false).expect("gemm"),
                    expected,
                )
            };
            let values = |out| {
                Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(out))
                    .into_data()
                    .into_vec::<f32>()
                    .unwrap()
            };
            let start = pool_stats();
            let stats = |reused, allocated, held_mib: usize| PoolStats {
                reused: start.reused + reused,
                allocated: start.allocated + allocated,
                held_bytes: held_mib << 20,
            };
            let (first, expected) = gemm(&x);
            assert_eq!(pool_stats(), stats(0, 1, 0), "a fresh block");
            let first_values = values(first);
            check_gemm("first", &first_values, &expected);
            // The tensor dropped: its block is held.
            assert_eq!(pool_stats(), stats(0, 1, 4));
            // -x: every output the negation of what the block holds.
            let negated: Vec<f32> = x.iter().map(|v| -v).collect();
            let (second, expected) = gemm(&negated);
            assert_eq!(pool_stats(), stats(1, 1, 0), "the freed block reused");
            let second_values = values(second);
            check_gemm("reused block", &second_values, &expected);
            assert!(
                first_values
                    .iter()
                    .zip(&second_values)
                    .all(|(a, b)| *a == -b)
            );
            // Seven outputs alive at once (one reused, six fresh), then freed: 24 MiB stay, the first freed goes.
            let outputs: Vec<_> = (0..7).map(|_| gemm(&x).0).collect();
            assert_eq!(pool_stats(), stats(2, 7, 0));
            drop(outputs);
            assert_eq!(
                pool_stats(),
                stats(2, 7, 24),
                "held within the 24 MiB bound"
            );
            // Below the pooled size: a plain allocation, the pool untouched.
            let small = quantize(x[..64 * k].to_vec(), [64, k], TensorRole::Activation);
            drop(B::fp8_gemm(small, false, wq.clone(), false).expect("gemm"));
            assert_eq!(
                pool_stats(),
                stats(2, 7, 24),
                "a 512 KiB output is not pooled"
            );
            // The metrics report counts the GEMM outputs the pool served.
            let pool_counter = |kind: &str| {
                burn_te::diagnostics::thread_counter_value(&format!("HostOutputPool({kind})"))
            };
            assert_eq!(
                (pool_counter("fresh"), pool_counter("reused")),
                (Some(7), Some(2))
            );
            // A fused op's output from a dirty block (the GEMM's values): the same bits as the op on 1024-row
            // pieces, whose outputs are too small to be pooled; then zeros from a dirty block.
            use burn_te_kernels::host::fused::norm::{NormKind, NormSpec, norm_forward};
            let spec = NormSpec {
                kind: NormKind::LayerNorm,
                eps: 1e-5,
                zero_centered_gamma: false,
            };
            let (rows, width) = (16384, 64);
            let input = Rng::new(43).normal(rows * width, 0.0, 1.0);
            let gamma = Rng::new(44).normal(width, 1.0, 0.1);
            let (y, _) = norm_forward(&input, &gamma, None, spec);
            assert_eq!(
                pool_stats(),
                stats(3, 7, 20),
                "the norm's output from the pool"
            );
            let pieces: Vec<f32> = input
                .chunks(1024 * width)
                .flat_map(|piece| norm_forward(piece, &gamma, None, spec).0.to_vec())
                .collect();
            assert_eq!(&y[..], &pieces[..]);
            drop(y);
            let zeros = burn_te_kernels::host::pool::OutputValues::zeroed(rows * width);
            assert_eq!(pool_stats(), stats(4, 7, 20), "zeros from the pool");
            assert!(zeros.iter().all(|&v| v == 0.0));
            // Buffers for overwrite (the fused ops' outputs): a reused block keeps what an earlier output wrote,
            // with no zero-fill pass, and only what none wrote is zeroed; with the check on, every value is NaN.
            use burn_te_kernels::host::pool::{OutputValues, set_overwrite_check};
            set_overwrite_check(false);
            let (written, len) = ((5 << 20) / 4, (6 << 20) / 4); // both in one 6 MiB block
            let mut first = OutputValues::for_overwrite(written);
            assert_eq!(pool_stats(), stats(4, 8, 20), "a fresh 6 MiB block");
            assert!(first.iter().all(|&v| v == 0.0), "fresh: zeros");
            first
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = i as f32);
            drop(first);
            let again = OutputValues::for_overwrite(len);
            // Freed, it took the pool to 26 MiB: the least recently freed 4 MiB block went, then it was reused.
            assert_eq!(pool_stats(), stats(5, 8, 16), "the 6 MiB block reused");
            for (i, &v) in again.iter().enumerate() {
                let kept = if i < written { i as f32 } else { 0.0 };
                assert_eq!(v, kept, "value {i} of a reused block for overwrite");
            }
            drop(again);
            set_overwrite_check(true);
            let checked = OutputValues::for_overwrite(len);
            assert!(checked.iter().all(|v| v.is_nan()), "the check fills NaN");
        },
    );
}

/// The probe: every path this CPU runs timed (f32 always), the first within 10 % of the fastest chosen (instruction
/// order), the choice made once per process
/// and the one an unforced GEMM asks for (unless `BURN_TE_HOST_GEMM` names one).
#[test]
fn the_probe_times_every_path_and_chooses_the_preferred_one() {
    use burn_te::backends::host::gemm::{measure, probe, requested_host_gemm_path};

    let available = paths();
    let measured = measure(&available);
    let timed: Vec<HostGemmPath> = measured.times.iter().map(|(p, _)| *p).collect();
    assert_eq!(timed, available, "every available path timed, in order");
    assert_eq!(measured.chosen, first_within_a_tenth(&measured.times));
    // A path this CPU lacks is not timed; f32 always is.
    let only_missing: Vec<HostGemmPath> = HostGemmPath::ALL
        .into_iter()
        .filter(|p| !p.available())
        .collect();
    let fallback = measure(&only_missing);
    assert_eq!(fallback.chosen, HostGemmPath::F32);
    assert_eq!(fallback.times.len(), 1);
    let first = probe();
    assert!(std::ptr::eq(first, probe()), "measured once per process");
    assert!(available.contains(&first.chosen));
    if std::env::var("BURN_TE_HOST_GEMM").is_err() {
        assert_eq!(requested_host_gemm_path(), first.chosen);
    }
    println!("probe: {:?}", first);
}

/// The child test that [`the_first_gemms_end_while_rayons_workers_wait_for_the_probe`] runs.
const PROBE_CHILD: &str = "host_gemm::probe_child_first_gemms_off_and_on_the_pool";

/// A process's first host FP8 GEMMs, which wait for the probe, issued where a probe on rayon's global pool
/// deadlocked: off the pool while every worker is about to issue one of its own, as a grouped layer's experts do
/// from the workers (the workers waited for a probe that needed them), and on the pool, several queued (the
/// worker that started the probe ran another queued GEMM while it waited, which waited for the probe it was
/// measuring). Each in a child process, since the probe runs once per process; a child that has not ended in two
/// minutes fails the test. (The kernels tests filtered to the grouped-layer tests hung both ways.)
#[test]
fn the_first_gemms_end_while_rayons_workers_wait_for_the_probe() {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    for mode in ["off the pool", "on the pool"] {
        let mut child = Command::new(std::env::current_exe().expect("the test binary"))
            .args([PROBE_CHILD, "--exact", "--ignored", "--test-threads=1"])
            .env_remove("BURN_TE_HOST_GEMM")
            // The probe measured, not taken from the cache on disk.
            .env(burn_te::backends::host::gemm::HOST_GEMM_CACHE_ENV, "off")
            .env(PROBE_CHILD_MODE, mode)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the child test starts");
        let deadline = Instant::now() + Duration::from_secs(120);
        while child.try_wait().expect("the child's status").is_none() {
            if Instant::now() > deadline {
                child.kill().ok();
                panic!("{mode}: the child's GEMMs did not end in 120 s: the probe deadlocked");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let output = child.wait_with_output().expect("the child's output");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && stdout.contains("1 passed"),
            "{mode}: the child test failed: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

/// Where the child issues its first GEMM.
const PROBE_CHILD_MODE: &str = "BURN_TE_TEST_PROBE_CHILD";

#[test]
#[ignore = "run in a child process by the_first_gemms_end_while_rayons_workers_wait_for_the_probe"]
fn probe_child_first_gemms_off_and_on_the_pool() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::Duration;
    static STARTED: AtomicUsize = AtomicUsize::new(0);
    static DONE: AtomicUsize = AtomicUsize::new(0);
    static GO: AtomicBool = AtomicBool::new(false);
    let gemm = || {
        let mut rng = Rng::new(5);
        let (lhs, rhs) = (rng.normal(32 * 48, 0.0, 1.0), rng.normal(48 * 16, 0.0, 1.0));
        B::fp8_gemm(
            quantized(lhs, [32, 48]),
            false,
            quantized(rhs, [48, 16]),
            false,
        )
        .expect("a small GEMM")
    };
    let workers = rayon::current_num_threads();
    if std::env::var(PROBE_CHILD_MODE).as_deref() == Ok("on the pool") {
        use rayon::prelude::*;
        (0..4 * workers).into_par_iter().for_each(|_| {
            gemm();
        });
        assert!(
            !burn_te::backends::host::gemm::probe().times.is_empty(),
            "the probe ran"
        );
        return;
    }
    for _ in 0..workers {
        rayon::spawn(move || {
            STARTED.fetch_add(1, Ordering::SeqCst);
            while !GO.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
            // After the GEMM below has started the probe: this worker waits for it.
            std::thread::sleep(Duration::from_millis(50));
            gemm();
            DONE.fetch_add(1, Ordering::SeqCst);
        });
    }
    // Every worker busy with a task above before the first GEMM.
    while STARTED.load(Ordering::SeqCst) < workers {
        std::thread::sleep(Duration::from_millis(1));
    }
    GO.store(true, Ordering::SeqCst);
    gemm();
    while DONE.load(Ordering::SeqCst) < workers {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        !burn_te::backends::host::gemm::probe().times.is_empty(),
        "the probe ran"
    );
}

/// The first of `times` (in instruction order) whose time is at most 1.1 × the fastest, computed in integer
/// nanoseconds (10 · t ≤ 11 · fastest).
fn first_within_a_tenth(times: &[(HostGemmPath, std::time::Duration)]) -> HostGemmPath {
    let fastest = times.iter().map(|(_, t)| t.as_nanos()).min().unwrap();
    times
        .iter()
        .find(|(_, t)| 10 * t.as_nanos() <= 11 * fastest)
        .unwrap()
        .0
}

/// Where a GEMM goes, for every case: small ones to the probe's path; a tuned class's to its kept path on any
/// thread, rayon's workers included (a grouped layer's experts); an untuned class's tuned on its first GEMM off
/// the pool, and on the probe's path from a worker, which never tunes.
#[test]
fn a_tuned_class_keeps_its_path_on_every_thread_and_tunes_only_off_the_pool() {
    use burn_te::backends::host::gemm::{TUNED_MIN_PRODUCT, TunedRoute, tuned_route};
    let (small, large) = (TUNED_MIN_PRODUCT - 1, TUNED_MIN_PRODUCT);
    let kept = HostGemmPath::Avx2Fma;
    for on_worker in [false, true] {
        for class in [None, Some(kept)] {
            assert_eq!(
                tuned_route(small, class, on_worker),
                TunedRoute::Probe,
                "small GEMM (class {class:?}, on a worker: {on_worker})"
            );
        }
        assert_eq!(
            tuned_route(large, Some(kept), on_worker),
            TunedRoute::Kept(kept),
            "a tuned class, on a worker: {on_worker}"
        );
    }
    assert_eq!(tuned_route(large, None, false), TunedRoute::Tune);
    assert_eq!(
        tuned_route(large, None, true),
        TunedRoute::Probe,
        "a worker does not tune"
    );
}

/// The choice from measured times: ties within 10 % go to the earlier path (the instruction before the decoded
/// `f32` path), a path more than 10 % faster than every earlier one wins, and nothing timed is `f32`.
#[test]
fn a_path_must_beat_the_earlier_ones_by_a_tenth_to_be_chosen() {
    use burn_te::backends::host::gemm::preferred;
    use std::time::Duration;
    let ms = Duration::from_millis;
    let (amx, bf16, fma, f32) = (
        HostGemmPath::AmxBf16,
        HostGemmPath::Avx512Bf16,
        HostGemmPath::Avx2Fma,
        HostGemmPath::F32,
    );
    assert_eq!(
        preferred(&[(fma, ms(100)), (f32, ms(95))]),
        fma,
        "within 10 %"
    );
    assert_eq!(
        preferred(&[(fma, ms(110)), (f32, ms(100))]),
        fma,
        "at 10 % exactly"
    );
    assert_eq!(
        preferred(&[(fma, ms(111)), (f32, ms(100))]),
        f32,
        "beyond 10 %"
    );
    assert_eq!(preferred(&[(fma, ms(20)), (f32, ms(100))]), fma);
    assert_eq!(
        preferred(&[(amx, ms(50)), (bf16, ms(43)), (f32, ms(40))]),
        bf16,
        "the first within 10 % of the fastest (44 ms), not the fastest"
    );
    assert_eq!(
        preferred(&[(amx, ms(50)), (bf16, ms(46)), (f32, ms(40))]),
        f32
    );
    assert_eq!(preferred(&[]), f32, "nothing timed");
}

/// The autotune stops timing a candidate once its best run over two runs or more is more than 1.5 × the fastest's
/// (at 1.5 × exactly it stays; after one run it stays whatever it took), and a candidate it stops timing is one the
/// choice would not have kept: for every best run from 1 to 300 ms against a fastest path of 100 ms, placed first
/// in instruction order (where ties favour it), a path dropped is not chosen.
#[test]
fn a_path_half_again_slower_than_the_fastest_is_timed_no_further() {
    use burn_te::backends::host::gemm::{outpaced, preferred};
    use std::time::Duration;
    let ms = Duration::from_millis;
    assert!(!outpaced(ms(100), ms(100)), "the fastest itself");
    assert!(!outpaced(ms(150), ms(100)), "at 1.5 × exactly");
    assert!(outpaced(ms(151), ms(100)), "beyond 1.5 ×");
    assert!(outpaced(Duration::from_micros(15_001), ms(10)));
    assert!(!outpaced(Duration::from_micros(14_999), ms(10)));
    let mut dropped = 0;
    for best in 1..=300 {
        let times = [
            (HostGemmPath::Avx512Bf16, ms(best)),
            (HostGemmPath::F32, ms(100)),
        ];
        let fastest = ms(best.min(100));
        if outpaced(ms(best), fastest) {
            dropped += 1;
            assert_eq!(
                preferred(&times),
                HostGemmPath::F32,
                "a path at {best} ms was dropped against 100 ms, yet the choice would keep it"
            );
        }
    }
    assert_eq!(dropped, 150, "151 ms to 300 ms are dropped");
    // Not after one run each: a first run ten times the fastest (another process took the core) keeps the path in
    // the race, and a second run can clear it; after two runs each, the rule applies.
    use burn_te::backends::host::gemm::{RUNS_BEFORE_DROP, dropped_after};
    assert_eq!(RUNS_BEFORE_DROP, 2);
    assert!(
        !dropped_after(1, ms(239), ms(23)),
        "one slow run decides nothing"
    );
    assert!(
        dropped_after(2, ms(239), ms(23)),
        "two runs each: beyond 1.5 ×"
    );
    assert!(
        !dropped_after(2, ms(30), ms(23)),
        "two runs each, within 1.5 ×"
    );
    assert!(dropped_after(5, ms(151), ms(100)));
}

/// Where no packed path that the probe saw faster takes the operands, the paths waiting after the probe are timed
/// after all: a Float8BlockScaling fprop whose first block holds 1e-33 (its `scale_inv` of 2^-118 takes E4M3's
/// smallest value below bf16's normal range, so the bf16 paths cannot take it) is tuned among the FMA paths and
/// `f32`, nothing skipped, and its output is the kept path's bits, within f64's bound.
#[test]
fn the_paths_waiting_after_the_probe_are_timed_where_the_faster_ones_cannot_take_the_operands() {
    use burn_te::backends::host::gemm::{host_gemm_tunings, outpaced_on_probe, probe};
    if std::env::var("BURN_TE_HOST_GEMM").is_ok_and(|v| !v.is_empty() && v != "auto") {
        panic!("BURN_TE_HOST_GEMM forces a path: unset it to test the autotune");
    }
    let available = paths();
    // 300 x 768 x 80: class [1, 512, 1024, 128], above the tuning threshold (256^3).
    let (m, k, n) = (300, 768, 80);
    let class = [1, 512, 1024, 128];
    let tuned_for = || -> Vec<burn_te::backends::host::gemm::HostGemmTuning> {
        host_gemm_tunings()
            .into_iter()
            .filter(|t| t.anchored == class)
            .collect()
    };
    assert!(tuned_for().is_empty(), "no other test uses this class");
    let mut rng = Rng::new(83);
    let mut x = rng.normal(m * k, 0.0, 1.0);
    x[..128].iter_mut().for_each(|v| *v = 1e-33);
    let recipe: Recipe = Float8BlockScaling::default().into();
    let site = GemmSite::new("waiting_paths", Gemm::Fprop);
    let (lhs, rhs) = (
        fprop_operand(&recipe, &site, x, [m, k], TensorRole::Activation),
        fprop_operand(
            &recipe,
            &site,
            rng.normal(k * n, 0.0, 1.0),
            [k, n],
            TensorRole::Weight,
        ),
    );
    let gemm = || {
        let out = B::fp8_gemm(
            lhs.tensor.clone(),
            lhs.transposed,
            rhs.tensor.clone(),
            rhs.transposed,
        )
        .expect("gemm");
        Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(out))
            .into_data()
            .into_vec::<f32>()
            .unwrap()
    };
    let out = gemm();
    let tuning = tuned_for();
    if available == [HostGemmPath::F32] {
        assert!(tuning.is_empty(), "one path: nothing tuned");
        return;
    }
    assert_eq!(tuning.len(), 1, "one tuning of the class: {tuning:?}");
    let tuning = &tuning[0];
    println!(
        "{tuning} (waiting after the probe: {:?})",
        outpaced_on_probe(&probe().times)
    );
    let bf16 = [HostGemmPath::AmxBf16, HostGemmPath::Avx512Bf16];
    let takes: Vec<HostGemmPath> = available
        .iter()
        .copied()
        .filter(|p| !bf16.contains(p))
        .collect();
    // The probe decides which paths wait: usually both FMA paths (the bf16 paths outrun them twice on Zen 4), but a
    // probe kept on disk from a busy moment may have seen one within the margin; that one then takes the operands
    // and the waiting ones stay untimed.
    let waiting = outpaced_on_probe(&probe().times);
    let unwaiting: Vec<HostGemmPath> = takes
        .iter()
        .copied()
        .filter(|p| *p != HostGemmPath::F32 && !waiting.contains(p))
        .collect();
    let (expected, expected_skipped): (Vec<_>, Vec<_>) = if unwaiting.is_empty() {
        (takes, vec![])
    } else {
        println!("a path that takes the operands was not outpaced on the probe: {unwaiting:?}");
        takes
            .into_iter()
            .partition(|p| *p == HostGemmPath::F32 || unwaiting.contains(p))
    };
    // A bf16 path the probe saw outpaced (`avx512bf16` behind AMX on an Intel Xeon) waits too, and is listed as
    // skipped whether it never ran or ran once in round 1 and could not take the operands.
    let expected_skipped: Vec<HostGemmPath> = available
        .iter()
        .copied()
        .filter(|p| waiting.contains(p) && (bf16.contains(p) || expected_skipped.contains(p)))
        .collect();
    let timed: Vec<HostGemmPath> = tuning.times.iter().map(|(p, _)| *p).collect();
    assert_eq!(
        timed, expected,
        "every path that takes the operands was timed, those waiting after the probe too where no other takes them"
    );
    assert_eq!(
        tuning.skipped, expected_skipped,
        "only waiting paths skipped, where another takes the operands: {tuning}"
    );
    let forced = with_host_gemm_path(tuning.chosen, gemm);
    assert!(
        out.iter()
            .zip(&forced)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "the tuned GEMM's output is the kept path's ({})",
        tuning.chosen
    );
    check_gemm(
        "waiting paths",
        &out,
        &reference(
            &stored_f64::<B>(&lhs.tensor),
            lhs.transposed,
            &stored_f64::<B>(&rhs.tensor),
            rhs.transposed,
        ),
    );
}

/// The packed paths the probe saw more than 1.5 × slower than the fastest packed path wait in the autotune; `f32`
/// never does, whatever its time, and at 1.5 × exactly a path is timed. Zen 4's probe (bf16 at twice the FMA rate),
/// Emerald Rapids' without AMX (bf16 at half the FMA rate) and a CPU with f32 alone.
#[test]
fn packed_paths_the_probe_saw_outpaced_wait() {
    use burn_te::backends::host::gemm::outpaced_on_probe;
    use std::time::Duration;
    let us = Duration::from_micros;
    let (bf16, fma512, fma, f32) = (
        HostGemmPath::Avx512Bf16,
        HostGemmPath::Avx512Fma,
        HostGemmPath::Avx2Fma,
        HostGemmPath::F32,
    );
    assert_eq!(
        outpaced_on_probe(&[
            (bf16, us(700)),
            (fma512, us(1330)),
            (fma, us(1360)),
            (f32, us(5000))
        ]),
        vec![fma512, fma],
        "Zen 4: the FMA paths wait, f32 does not"
    );
    assert_eq!(
        outpaced_on_probe(&[
            (bf16, us(1200)),
            (fma512, us(700)),
            (fma, us(1100)),
            (f32, us(900))
        ]),
        vec![bf16, fma],
        "Intel without AMX: bf16 (1.71x) and avx2fma (1.57x) wait"
    );
    assert_eq!(
        outpaced_on_probe(&[(bf16, us(1050)), (fma512, us(700)), (f32, us(100))]),
        vec![],
        "1.5x exactly is timed; f32's speed does not count"
    );
    assert_eq!(outpaced_on_probe(&[(f32, us(900))]), vec![], "f32 alone");
    assert_eq!(outpaced_on_probe(&[]), vec![], "nothing probed");
}

/// A tuning round times the candidates slowest first, so the likely winner runs last and its output is the one the
/// GEMM keeps (no run of the kept path after the rounds): before any run by the probe's times, then by each
/// candidate's best run on the class; a path the probe did not time goes first.
#[test]
fn a_tuning_round_times_the_likely_winner_last() {
    use burn_te::backends::host::gemm::timing_order;
    use std::time::Duration;
    let us = Duration::from_micros;
    let none = Duration::MAX;
    let (bf16, fma512, f32) = (
        HostGemmPath::Avx512Bf16,
        HostGemmPath::Avx512Fma,
        HostGemmPath::F32,
    );
    // Zen 4's probe: bf16 at twice the f32 rate.
    let probe = [(bf16, us(700)), (fma512, us(1330)), (f32, us(1400))];
    assert_eq!(
        timing_order(&[(bf16, none), (f32, none)], &probe),
        vec![1, 0],
        "round 0: f32, then bf16"
    );
    assert_eq!(
        timing_order(&[(bf16, us(5000)), (fma512, none), (f32, us(4000))], &probe),
        vec![1, 0, 2],
        "later: by the class's best runs (f32 won the first round), a waiting path by its probe time"
    );
    assert_eq!(
        timing_order(&[(bf16, none), (f32, none)], &[(bf16, us(700))]),
        vec![1, 0],
        "a path the probe did not time first"
    );
}

/// The autotune: the first unforced GEMM of a shape class (64 × 8192 × 64, rounded up to powers of two) times
/// every path this CPU runs and keeps the first (in instruction order) within 10 % of the fastest, whose output it returns (the bits of that path forced, within
/// f64's bound); a later GEMM of the class (60 × 7000 × 60) takes the kept path without timing again; a GEMM
/// below `TUNED_MIN_PRODUCT` takes the probe's path. Each GEMM counts once, under the path that gave its output.
/// On a CPU with `f32` alone (aarch64), no class is tuned and every GEMM runs on it.
#[test]
fn the_autotune_keeps_each_shape_classs_fastest_path() {
    use burn_te::backends::host::gemm::{
        TUNED_MIN_PRODUCT, host_gemm_tunings, outpaced_on_probe, probe,
    };

    if std::env::var("BURN_TE_HOST_GEMM").is_ok_and(|v| !v.is_empty() && v != "auto") {
        panic!("BURN_TE_HOST_GEMM forces a path: unset it to test the autotune");
    }
    let available = paths();
    let class = [1, 64, 8192, 64];
    let tuned_for = |anchored: [usize; 4]| -> Vec<burn_te::backends::host::gemm::HostGemmTuning> {
        host_gemm_tunings()
            .into_iter()
            .filter(|t| t.anchored == anchored)
            .collect()
    };
    assert!(tuned_for(class).is_empty(), "no other test uses this class");
    let mut rng = Rng::new(71);
    let gemm = |rng: &mut Rng, (m, k, n): (usize, usize, usize)| {
        let a = quantized(rng.normal(m * k, 0.0, 1.0), [m, k]);
        let b = quantized(rng.normal(k * n, 0.0, 1.0), [k, n]);
        let counts: Vec<u64> = HostGemmPath::ALL.iter().map(|&p| counted(p)).collect();
        let out = B::fp8_gemm(a.clone(), false, b.clone(), false).expect("gemm");
        let out: Vec<f32> = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(out))
            .into_data()
            .to_vec()
            .unwrap();
        let ran: Vec<HostGemmPath> = HostGemmPath::ALL
            .iter()
            .zip(counts)
            .filter(|&(&p, before)| counted(p) == before + 1)
            .map(|(&p, _)| p)
            .collect();
        let total: u64 = HostGemmPath::ALL.iter().map(|&p| counted(p)).sum();
        (a, b, out, ran, total)
    };

    let (m, k, n) = (64, 8192, 64);
    assert!(m * k * n >= TUNED_MIN_PRODUCT);
    let before: u64 = HostGemmPath::ALL.iter().map(|&p| counted(p)).sum();
    let (a, b, out, ran, after) = gemm(&mut rng, (m, k, n));
    assert_eq!(
        after,
        before + 1,
        "the tuning's timed runs count as one GEMM"
    );
    if available == [HostGemmPath::F32] {
        // A CPU without the packed paths' instructions (aarch64; x86-64 before AVX2): nothing to choose from, so no
        // class is tuned and every GEMM, whatever its size or thread, runs on `f32`, within f64's bound.
        assert_eq!(ran, vec![HostGemmPath::F32], "counted under f32");
        assert!(tuned_for(class).is_empty(), "one path: nothing tuned");
        check_gemm(
            "f32 alone",
            &out,
            &reference(&stored_f64::<B>(&a), false, &stored_f64::<B>(&b), false),
        );
        let (_, _, _, ran, _) = rayon::scope(|_| gemm(&mut rng, (64, 8000, 64)));
        assert_eq!(ran, vec![HostGemmPath::F32], "a worker's GEMM on f32");
        let (_, _, _, ran, _) = gemm(&mut rng, (32, 512, 32));
        assert_eq!(ran, vec![HostGemmPath::F32], "a small GEMM on f32");
        assert_eq!(probe().chosen, HostGemmPath::F32, "the probe's only path");
        return;
    }
    let tuning = tuned_for(class);
    assert_eq!(tuning.len(), 1, "one tuning of the class: {tuning:?}");
    let tuning = &tuning[0];
    assert_eq!(tuning.dims, [1, m, k, n]);
    let timed: Vec<HostGemmPath> = tuning.times.iter().map(|(p, _)| *p).collect();
    // The packed paths the probe saw more than 1.5x slower than the fastest packed one wait, and E4M3 fits that
    // one: they are not timed (on Zen 4, the FMA paths beside avx512bf16).
    let waiting = outpaced_on_probe(&probe().times);
    println!("paths {available:?}, waiting after the probe {waiting:?}");
    assert!(!waiting.contains(&HostGemmPath::F32), "f32 never waits");
    let expected: Vec<HostGemmPath> = available
        .iter()
        .copied()
        .filter(|p| !waiting.contains(p))
        .collect();
    assert_eq!(
        timed, expected,
        "every path this CPU runs was timed (E4M3 fits them all) but those outpaced on the probe"
    );
    assert_eq!(tuning.skipped, waiting, "the skipped paths are listed");
    assert_eq!(
        tuning.chosen,
        first_within_a_tenth(&tuning.times),
        "the first path within 10 % of the fastest is kept: {tuning:?}"
    );
    assert_eq!(ran, vec![tuning.chosen], "counted under the kept path");
    let forced = with_host_gemm_path(tuning.chosen, || {
        B::fp8_gemm(a.clone(), false, b.clone(), false).expect("gemm")
    });
    let forced: Vec<f32> = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(forced))
        .into_data()
        .to_vec()
        .unwrap();
    assert!(
        out.iter()
            .zip(&forced)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "the tuned GEMM's output is the kept path's ({})",
        tuning.chosen
    );
    check_gemm(
        "tuned",
        &out,
        &reference(&stored_f64::<B>(&a), false, &stored_f64::<B>(&b), false),
    );

    // Another GEMM of the class: the kept path, no second tuning.
    let (_, _, _, ran, _) = gemm(&mut rng, (60, 7000, 60));
    assert_eq!(ran, vec![tuning.chosen], "the class's kept path");
    assert_eq!(tuned_for(class).len(), 1, "tuned once");
    assert_eq!(tuned_for(class)[0].dims, [1, m, k, n], "by its first GEMM");

    // Issued from one of rayon's workers (where a grouped layer's experts run side by side): the class's kept path
    // as well. Workers never tune (their siblings' GEMMs would run beside the timed ones), but they take a choice
    // made elsewhere. This tells the two apart only where the probe chose another path than the class's (printed);
    // the rule itself is tested for every case in
    // `a_tuned_class_keeps_its_path_on_every_thread_and_tunes_only_off_the_pool`.
    println!(
        "class {class:?} kept {}, the probe's path {}",
        tuning.chosen,
        probe().chosen
    );
    let (_, _, _, ran, _) = rayon::scope(|_| {
        assert!(rayon::current_thread_index().is_some(), "on a worker");
        gemm(&mut rng, (64, 8000, 64))
    });
    assert_eq!(
        ran,
        vec![tuning.chosen],
        "a worker's GEMM of a tuned class takes the kept path"
    );
    assert_eq!(tuned_for(class).len(), 1, "still tuned once");

    // Below the threshold: the probe's path, no tuning.
    let (small_m, small_k, small_n) = (32, 512, 32);
    assert!(small_m * small_k * small_n < TUNED_MIN_PRODUCT);
    let (_, _, _, ran, _) = gemm(&mut rng, (small_m, small_k, small_n));
    assert_eq!(
        ran,
        vec![probe().chosen],
        "a small GEMM takes the probe's path"
    );
    assert!(tuned_for([1, 32, 512, 32]).is_empty(), "not tuned");
}

/// FP8 training on the host path with bf16 or f16 as Flex's float type (Burn 0.21's `set_default_float_dtype`, fixed
/// at the device's first tensor, hence a process of its own): every host kernel's output takes the device's type, so
/// the FP8 GEMM's output meets the bias in the same type (it was f32 beside bf16: Flex's dtype assertion). Four SGD
/// steps follow the same layer's in f32 on `Te<NdArray>` within the type's rounding, and the output has the type.
fn training_in_half_precision_follows_f32(test: &str, dtype: burn::tensor::FloatDType, rel: f32) {
    use burn::backend::NdArray;
    use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
    alone(test, || {
        type Half = Autodiff<Te<Flex>>;
        type Full = Autodiff<Te<NdArray>>;
        let device = Default::default();
        burn::tensor::backend::set_default_float_dtype::<Half>(&device, dtype)
            .expect("the process's first tensor comes after");
        let config = TransformerLayerConfig::new(64, 256, 4)
            .with_hidden_dropout(0.0)
            .with_attention_dropout(0.0);
        let full_device = Default::default();
        let full: TransformerLayer<Full> = config.init(&full_device);
        let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
        let bytes = recorder.record(full.clone().into_record(), ()).unwrap();
        let half: TransformerLayer<Half> = config
            .init(&device)
            .load_record(recorder.load(bytes, &device).unwrap());
        let shape = [16, 4, 64];
        let n = shape.iter().product();
        let (x, target) = (
            Rng::new(5).normal(n, 0.0, 1.0),
            Rng::new(6).normal(n, 0.0, 1.0),
        );
        let full_losses = sgd_steps(
            full,
            crate::te::tensor(x.clone(), shape, &full_device),
            crate::te::tensor(target.clone(), shape, &full_device),
            4,
        );
        let half_losses = sgd_steps(
            half.clone(),
            crate::te::tensor(x.clone(), shape, &device),
            crate::te::tensor(target, shape, &device),
            4,
        );
        println!("{dtype:?} losses {half_losses:?}, f32 {full_losses:?}");
        for (step, (f, h)) in full_losses.iter().zip(&half_losses).enumerate() {
            assert!(
                (f - h).abs() <= rel * f.abs(),
                "step {step}: {dtype:?} loss {h} vs f32 {f}"
            );
        }
        let y = fp8_autocast(true, DelayedScaling::default(), || {
            half.forward(crate::te::tensor(x.clone(), shape, &device), None)
        })
        .unwrap();
        assert_eq!(y.dtype(), dtype.into(), "the layer's output type");
    });
}

/// The loss before each of `steps` SGD steps (rate 0.05) of `layer` in FP8 (DelayedScaling) towards `target`.
fn sgd_steps<A: burn::tensor::backend::AutodiffBackend + TeBackend>(
    mut layer: TransformerLayer<A>,
    x: Tensor<A, 3>,
    target: Tensor<A, 3>,
    steps: usize,
) -> Vec<f32> {
    let mut optim = SgdConfig::new().init();
    (0..steps)
        .map(|_| {
            let y = fp8_autocast(true, DelayedScaling::default(), || {
                layer.forward(x.clone(), None)
            })
            .expect("recipe");
            let loss = (y - target.clone()).square().mean();
            let value = crate::te::values(loss.clone())[0];
            let grads = GradientsParams::from_grads(loss.backward(), &layer);
            layer = optim.step(0.05, layer.clone(), grads);
            value
        })
        .collect()
}

#[test]
fn training_in_bf16_follows_f32() {
    training_in_half_precision_follows_f32(
        "host_gemm::training_in_bf16_follows_f32",
        burn::tensor::FloatDType::BF16,
        1e-2,
    );
}

#[test]
fn training_in_f16_follows_f32() {
    training_in_half_precision_follows_f32(
        "host_gemm::training_in_f16_follows_f32",
        burn::tensor::FloatDType::F16,
        5e-3,
    );
}
