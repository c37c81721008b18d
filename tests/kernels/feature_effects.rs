//! The GEMM-changing debug features proven by their effect on the GEMM outputs, not by the routing answers: for
//! fprop, dgrad and wgrad (autodiff runs the backward GEMMs), on `Autodiff<Debug<Te<Wgpu>>>` and on the host stack
//! `Autodiff<Debug<Te<NdArray>>>`, under DelayedScaling (iteration 0) and Float8CurrentScaling (iteration 1).
//!
//! The expected values never come from the code path under test:
//! - high precision: the same GEMM as a plain `matmul` on the plain backend (`Wgpu` / `NdArray`, no `Te`, no
//!   debug, no autodiff): the kernel the high-precision path must end in, so the comparison is bit for bit;
//! - FP8: the operands quantized on the host (amax, scale, the conformance-tested host encoder, dequantized), then
//!   a host GEMM with f32 accumulation;
//! - fake quantization: the operands fake-quantized on the host, then the plain backend's high-precision GEMM (the
//!   same kernel as the feature's GEMM, so bit for bit).
//!
//! Each test also shows that the unmodified FP8 GEMM differs from what the feature must produce, so a feature that
//! does nothing fails.

use burn::backend::{Autodiff, NdArray};
use burn::module::Param;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn_te::backends::Wgpu;
use burn_te::nn::{Linear, LinearConfig};
use burn_te::{
    DelayedScaling, Float8CurrentScaling, Fp8Format, Gemm, Recipe, Te, TeBackend, fp8_autocast,
};
use burn_te_debug::Debug;

use crate::common::Rng;
use crate::debug::{SESSION, main_log, start_session};
use crate::te::{device, tensor, values};

type WgpuStack = Autodiff<Debug<Te<Wgpu>>>;
type HostStack = Autodiff<Debug<Te<NdArray>>>;

/// Tokens, input and output features.
const T: usize = 64;
const I: usize = 64;
const O: usize = 32;
const GEMMS: [Gemm; 3] = [Gemm::Fprop, Gemm::Dgrad, Gemm::Wgrad];

/// Iteration 0 runs under DelayedScaling (every delayed scale is still 1, TE's initial value), iteration 1 under
/// Float8CurrentScaling (each tensor scaled by its own amax, margin 0).
fn recipes() -> [Recipe; 2] {
    [
        DelayedScaling::default().into(),
        Float8CurrentScaling::default().into(),
    ]
}

/// A layer's activation `x [T, I]`, weight `w [I, O]` and output gradient `g [T, O]`.
struct Operands {
    x: Vec<f32>,
    w: Vec<f32>,
    g: Vec<f32>,
}

/// Normal values whose rows and columns step down by `2^-step` (8 steps each way), so some rows and some columns
/// lie wholly in the FP8 subnormal range of a per-tensor scale: there a power-of-two margin changes the rounding
/// (in the normal range it would only shift the exponent), and the GEMM outputs made of those rows or columns
/// change by far more than accumulation rounding.
fn graded(seed: u64, rows: usize, cols: usize, std: f64, step: i32) -> Vec<f32> {
    let mut values = Rng::new(seed).normal(rows * cols, 0.0, std);
    for (i, v) in values.iter_mut().enumerate() {
        *v *= 2f32.powi(-step * ((i / cols) % 8 + (i % cols) % 8) as i32);
    }
    values
}

impl Operands {
    fn new() -> Self {
        Operands {
            x: graded(71, T, I, 1.0, 2),
            w: graded(72, I, O, 0.1, 2),
            // E5M2 spans 2^32: steps of 2^-4 reach its subnormals.
            g: graded(73, T, O, 1.0, 4),
        }
    }
}

/// The outputs of a layer's three GEMMs in one iteration: `y = x·w`, `dx = g·wᵀ`, `dw = xᵀ·g`.
#[derive(Clone, Debug)]
struct Gemms([Vec<f32>; 3]);

impl Gemms {
    fn of(&self, gemm: Gemm) -> &[f32] {
        &self.0[gemm as usize]
    }
}

/// `(rows, cols, depth)` of `gemm`: its output is `[rows, cols]`, its reduction runs over `depth`.
fn dims(gemm: Gemm) -> (usize, usize, usize) {
    match gemm {
        Gemm::Fprop => (T, O, I),
        Gemm::Dgrad => (T, I, O),
        Gemm::Wgrad => (I, O, T),
    }
}

/// The high-precision GEMM: a plain `matmul` on the plain backend `P` (no `Te`, no debug path, no autodiff), from
/// the operands as stored: fprop `x·w`, dgrad `g·wᵀ`, wgrad `xᵀ·g`.
fn high_precision<P: Backend>(
    gemm: Gemm,
    lhs: &[f32],
    rhs: &[f32],
    device: &P::Device,
) -> Vec<f32> {
    let t = |v: &[f32], shape| tensor::<P, 2>(v.to_vec(), shape, device);
    values(match gemm {
        Gemm::Fprop => t(lhs, [T, I]).matmul(t(rhs, [I, O])),
        Gemm::Dgrad => t(lhs, [T, O]).matmul(t(rhs, [I, O]).transpose()),
        Gemm::Wgrad => t(lhs, [T, I]).transpose().matmul(t(rhs, [T, O])),
    })
}

/// The high-precision GEMMs of the unmodified operands.
fn high_precision_all<P: Backend>(ops: &Operands, device: &P::Device) -> Gemms {
    Gemms([
        high_precision::<P>(Gemm::Fprop, &ops.x, &ops.w, device),
        high_precision::<P>(Gemm::Dgrad, &ops.g, &ops.w, device),
        high_precision::<P>(Gemm::Wgrad, &ops.x, &ops.g, device),
    ])
}

/// `values` quantized at `scale` with the host encoder (conformance-tested bit-exact against ml_dtypes) and
/// dequantized as `decode(code) · (1 / scale)`.
pub(crate) fn quantized_at(values: &[f32], scale: f32, format: Fp8Format) -> Vec<f32> {
    let codes = burn_te_kernels::host::quantize(values, scale, format);
    burn_te_kernels::host::dequantize(&codes, 1.0 / scale, format)
}

/// Per-tensor current scaling recomputed here: `scale = fp8_max / amax / 2^margin` over the whole tensor.
pub(crate) fn current(values: &[f32], format: Fp8Format, margin: i32) -> Vec<f32> {
    let amax = values.iter().fold(0f32, |a, v| a.max(v.abs()));
    assert!(amax > 0.0 && amax.is_finite());
    let scale = format.max() / amax / 2f32.powi(margin);
    quantized_at(values, scale, format)
}

/// MXFP8 of a `[rows, cols]` tensor reduced along its rows (wgrad's activation): one power-of-two
/// `scale_inv = 2^⌈log2(block amax / fp8_max)⌉` (OCP MX, E8M0) per 32×1 block, computed in f64 here.
fn mx_along_rows(values: &[f32], rows: usize, cols: usize, format: Fp8Format) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for c in 0..cols {
        for r0 in (0..rows).step_by(32) {
            let block: Vec<usize> = (r0..(r0 + 32).min(rows)).map(|r| r * cols + c).collect();
            let amax = block.iter().fold(0f32, |a, &i| a.max(values[i].abs()));
            let scale_inv = if amax > 0.0 {
                (f64::from(amax) / f64::from(format.max()))
                    .log2()
                    .ceil()
                    .exp2() as f32
            } else {
                1.0
            };
            for i in block {
                out[i] = format.decode(format.encode(values[i] / scale_inv)) * scale_inv;
            }
        }
    }
    out
}

/// A GEMM of dequantized FP8 operands recomputed on the host: each output summed over k in order in f32 (`f32`),
/// and in f64 with `Σ|terms|` (`f64`, `magnitude`).
struct HostGemm {
    f32: Vec<f32>,
    f64: Vec<f64>,
    magnitude: Vec<f64>,
}

fn host_gemm(gemm: Gemm, lhs: &[f32], rhs: &[f32]) -> HostGemm {
    let (m, n, k) = dims(gemm);
    let a = |i: usize, p: usize| match gemm {
        Gemm::Fprop | Gemm::Dgrad => lhs[i * k + p],
        Gemm::Wgrad => lhs[p * I + i],
    };
    let b = |p: usize, j: usize| match gemm {
        Gemm::Fprop | Gemm::Wgrad => rhs[p * n + j],
        Gemm::Dgrad => rhs[j * O + p],
    };
    let mut out = HostGemm {
        f32: vec![0.0; m * n],
        f64: vec![0.0; m * n],
        magnitude: vec![0.0; m * n],
    };
    for i in 0..m {
        for j in 0..n {
            let (mut acc, mut exact, mut magnitude) = (0f32, 0f64, 0f64);
            for p in 0..k {
                acc += a(i, p) * b(p, j);
                let term = f64::from(a(i, p)) * f64::from(b(p, j));
                exact += term;
                magnitude += term.abs();
            }
            out.f32[i * n + j] = acc;
            out.f64[i * n + j] = exact;
            out.magnitude[i * n + j] = magnitude;
        }
    }
    out
}

/// Relative bound on a device FP8 GEMM against the f64 sum: the kernels accumulate in f32 over k in the same order
/// as the host (one accumulator per output), but a device compiler may contract `acc + a·b` into a fused
/// multiply-add (one rounding instead of two), so the device result is only within f32 accumulation error
/// (`≤ k·2^-24·Σ|terms|`, k ≤ 64) of the exact sum. The host path's GEMM is the CPU backend's blocked matmul, with
/// its own summation order: the same bound.
const DEVICE_BOUND: f64 = 1e-5;

fn outside_bound(got: &[f32], reference: &HostGemm) -> Option<String> {
    got.iter().enumerate().find_map(|(i, &v)| {
        let tolerance = DEVICE_BOUND * reference.magnitude[i] + 1e-30;
        ((f64::from(v) - reference.f64[i]).abs() > tolerance)
            .then(|| format!("[{i}] {v} vs {} (±{tolerance:e})", reference.f64[i] as f32))
    })
}

/// `got` is the FP8 GEMM `reference`, within [`DEVICE_BOUND`].
fn assert_fp8_gemm(what: &str, got: &[f32], reference: &HostGemm) {
    assert_eq!(got.len(), reference.f32.len(), "{what}: length");
    if let Some(failure) = outside_bound(got, reference) {
        panic!("{what}: not the host FP8 GEMM: {failure}");
    }
}

/// `got` and `other` differ by more than the comparison of [`assert_fp8_gemm`] allows.
fn assert_not_fp8_gemm(what: &str, got: &[f32], reference: &HostGemm) {
    assert!(
        outside_bound(got, reference).is_some(),
        "{what}: indistinguishable from the reference"
    );
}

fn assert_bits(what: &str, got: &[f32], expected: &[f32]) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    let differing: Vec<usize> = (0..got.len())
        .filter(|&i| got[i].to_bits() != expected[i].to_bits())
        .collect();
    if let Some(&i) = differing.first() {
        panic!(
            "{what}: {} of {} elements differ, first [{i}]: {} vs {}",
            differing.len(),
            got.len(),
            got[i],
            expected[i]
        );
    }
}

fn assert_differs(what: &str, got: &[f32], other: &[f32]) {
    assert!(
        got.iter()
            .zip(other)
            .any(|(a, b)| a.to_bits() != b.to_bits()),
        "{what}: equal bit for bit"
    );
}

/// Runs the named layers (the same operands each, no bias) for the two [`recipes`] in a debug session with
/// `config`: the GEMMs of every layer at every iteration, `[iteration][layer]`. Fails if the main log reports an
/// FP8 fallback or a feature error for one of these layers.
fn run_session<S: AutodiffBackend + TeBackend>(
    what: &str,
    config: &str,
    names: &[&str],
    ops: &Operands,
    device: &S::Device,
) -> Vec<Vec<Gemms>> {
    let (dir, _) = start_session(&format!("feature-effects-{what}"), config);
    let layers: Vec<Linear<S>> = names
        .iter()
        .map(|name| {
            let mut layer = LinearConfig::new(I, O)
                .with_bias(false)
                .with_name(Some(name.to_string()))
                .init::<S>(device);
            layer.weight = Param::from_tensor(tensor(ops.w.clone(), [I, O], device));
            layer
        })
        .collect();
    let mut runs = Vec::new();
    for recipe in recipes() {
        let mut iteration = Vec::new();
        for layer in &layers {
            let x = tensor::<S, 2>(ops.x.clone(), [T, I], device).require_grad();
            let y = fp8_autocast(true, recipe.clone(), || layer.forward(x.clone())).unwrap();
            // The gradient of sum(y ⊙ g) with respect to y is g exactly.
            let g = tensor::<S, 2>(ops.g.clone(), [T, O], device);
            let grads = (y.clone() * g).sum().backward();
            iteration.push(Gemms([
                values(y),
                values(x.grad(&grads).unwrap()),
                values(layer.weight.val().grad(&grads).unwrap()),
            ]));
        }
        runs.push(iteration);
        burn_te_debug::step().unwrap();
    }
    burn_te_debug::end().unwrap();
    let main = main_log(&dir);
    for line in main.lines() {
        let ours = names.iter().any(|name| line.contains(&format!("{name}.")));
        assert!(
            !(ours && (line.contains("FP8 GEMM not possible") || line.contains("unmodified"))),
            "{what}: {line}"
        );
    }
    runs
}

const DISABLE_CONFIG: &str = r#"off_fprop:
  enabled: True
  layers:
    layer_name_regex_pattern: '^fx_off_fprop$'
  transformer_engine:
    DisableFP8GEMM:
      enabled: True
      gemms: [fprop]
off_dgrad:
  enabled: True
  layers:
    layer_name_regex_pattern: '^fx_off_dgrad$'
  transformer_engine:
    DisableFP8GEMM:
      enabled: True
      gemms: [dgrad]
off_wgrad:
  enabled: True
  layers:
    layer_name_regex_pattern: '^fx_off_wgrad$'
  transformer_engine:
    DisableFP8GEMM:
      enabled: True
      gemms: [wgrad]
off_layer:
  enabled: True
  layers:
    layer_name_regex_pattern: '^fx_off_layer$'
  transformer_engine:
    DisableFP8Layer:
      enabled: True
"#;

/// DisableFP8GEMM and DisableFP8Layer on stack `S`: each disabled GEMM equals the plain backend's high-precision
/// GEMM bit for bit; every other GEMM equals the unmodified layer's FP8 GEMM bit for bit (same kernel, same
/// inputs), which differs from the high-precision one.
fn check_disable<S: AutodiffBackend + TeBackend, P: Backend<Device = S::Device>>(
    what: &str,
    device: &S::Device,
) {
    let ops = Operands::new();
    let names = [
        "fx_fp8",
        "fx_off_fprop",
        "fx_off_dgrad",
        "fx_off_wgrad",
        "fx_off_layer",
    ];
    let disabled: [&[Gemm]; 5] = [&[], &[Gemm::Fprop], &[Gemm::Dgrad], &[Gemm::Wgrad], &GEMMS];
    let runs = run_session::<S>(
        &format!("disable-{what}"),
        DISABLE_CONFIG,
        &names,
        &ops,
        device,
    );
    let hp = high_precision_all::<P>(&ops, device);
    for (recipe, layers) in recipes().iter().zip(&runs) {
        let fp8 = &layers[0];
        for gemm in GEMMS {
            let at = format!("{what} {} {}", recipe.name(), gemm.name());
            assert_differs(
                &format!("{at}: the FP8 GEMM vs high precision"),
                fp8.of(gemm),
                hp.of(gemm),
            );
            for (layer, (name, off)) in layers.iter().zip(names.iter().zip(disabled)).skip(1) {
                let expected = if off.contains(&gemm) { &hp } else { fp8 };
                assert_bits(&format!("{at} {name}"), layer.of(gemm), expected.of(gemm));
            }
        }
    }
}

#[test]
fn disable_fp8_gemm_and_layer_give_the_high_precision_gemms_bit_for_bit() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    check_disable::<WgpuStack, Wgpu>("wgpu", &device());
    check_disable::<HostStack, NdArray>("ndarray", &Default::default());
}

/// PerTensorScaling: fprop's activation (margin 2) and weight (margin 0), dgrad's gradient (margin 3) and wgrad's
/// activation (margin 1); dgrad's weight and wgrad's gradient keep the recipe's scaling.
const PER_TENSOR_CONFIG: &str = r#"pts:
  enabled: True
  layers:
    layer_name_regex_pattern: '^fx_pts$'
  transformer_engine:
    PerTensorScaling:
      enabled: True
      gemms_struct:
        - gemm: fprop
          tensors_struct:
            - tensor: activation
              margin: 2
            - tensor: weight
        - gemm: dgrad
          tensors: [gradient]
          margin: 3
        - gemm: wgrad
          tensors: [activation]
          margin: 1
"#;

/// The margin PerTensorScaling applies to `tensor` (0 = activation, 1 = weight, 2 = gradient) in `gemm`, if any.
fn per_tensor_margin(gemm: Gemm, tensor: usize) -> Option<i32> {
    match (gemm, tensor) {
        (Gemm::Fprop, 0) => Some(2),
        (Gemm::Fprop, 1) => Some(0),
        (Gemm::Dgrad, 2) => Some(3),
        (Gemm::Wgrad, 0) => Some(1),
        _ => None,
    }
}

/// The host FP8 GEMM of `gemm` at `iteration`: each operand in its role's format (E4M3 activation and weight,
/// E5M2 gradient: the recipes' Hybrid default), quantized with the current scale and `margins(gemm, tensor)` where
/// that is `Some`, else with the recipe's scale (delayed at iteration 0: 1; current at iteration 1: margin 0).
fn fp8_reference(
    ops: &Operands,
    gemm: Gemm,
    iteration: usize,
    margins: impl Fn(Gemm, usize) -> Option<i32>,
) -> HostGemm {
    let (lhs, rhs) = match gemm {
        Gemm::Fprop => (0, 1),
        Gemm::Dgrad => (2, 1),
        Gemm::Wgrad => (0, 2),
    };
    let operand = |tensor: usize| {
        let (v, format) = match tensor {
            0 => (&ops.x, Fp8Format::E4M3),
            1 => (&ops.w, Fp8Format::E4M3),
            _ => (&ops.g, Fp8Format::E5M2),
        };
        match (margins(gemm, tensor), iteration) {
            (Some(margin), _) => current(v, format, margin),
            (None, 0) => quantized_at(v, 1.0, format),
            (None, _) => current(v, format, 0),
        }
    };
    host_gemm(gemm, &operand(lhs), &operand(rhs))
}

/// PerTensorScaling on stack `S`: each GEMM equals the host FP8 GEMM of its operands quantized with the current
/// scale and the configured margin (within f32 accumulation rounding: each backend sums in its own order); the
/// unmodified layer's FP8 GEMM equals the recipe's reference and is outside that comparison, and so would be the
/// GEMM with the margins ignored.
fn check_per_tensor<S: AutodiffBackend + TeBackend>(what: &str, device: &S::Device) {
    let ops = Operands::new();
    let names = ["fx_fp8", "fx_pts"];
    let runs = run_session::<S>(
        &format!("per-tensor-{what}"),
        PER_TENSOR_CONFIG,
        &names,
        &ops,
        device,
    );
    for (n, (recipe, layers)) in recipes().iter().zip(&runs).enumerate() {
        let [fp8, pts] = [&layers[0], &layers[1]];
        for gemm in GEMMS {
            let at = format!("{what} {} {}", recipe.name(), gemm.name());
            let reference = fp8_reference(&ops, gemm, n, per_tensor_margin);
            let recipe_only = fp8_reference(&ops, gemm, n, |_, _| None);
            let margin_0 = fp8_reference(&ops, gemm, n, |g, t| per_tensor_margin(g, t).map(|_| 0));
            assert_fp8_gemm(&format!("{at} PerTensorScaling"), pts.of(gemm), &reference);
            assert_fp8_gemm(&format!("{at} unmodified FP8"), fp8.of(gemm), &recipe_only);
            assert_not_fp8_gemm(
                &format!("{at} unmodified FP8 vs PerTensorScaling"),
                fp8.of(gemm),
                &reference,
            );
            assert_not_fp8_gemm(
                &format!("{at} margins ignored vs PerTensorScaling"),
                &margin_0.f32,
                &reference,
            );
        }
    }
}

#[test]
fn per_tensor_scaling_quantizes_with_the_current_scale_and_margin() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    check_per_tensor::<WgpuStack>("wgpu", &device());
    // The host GEMM is the backend's blocked f32 matmul: its own summation order, so the same bound.
    check_per_tensor::<HostStack>("ndarray", &Default::default());
}

/// FakeQuant: fprop's activation (FP8E4M3; the weight stays high precision), dgrad's gradient (FP8E5M2, margin 2)
/// and weight (FP8E4M3), wgrad's activation (MXFP8E4M3: 32-value blocks along the tokens, wgrad's reduction) and
/// gradient (FP8E4M3, not the recipe's E5M2, margin 1).
const FAKE_QUANT_CONFIG: &str = r#"fq:
  enabled: True
  layers:
    layer_name_regex_pattern: '^fx_fq$'
  transformer_engine:
    FakeQuant:
      enabled: True
      gemms_struct:
        - gemm: fprop
          tensors: [activation]
          quant_format: FP8E4M3
        - gemm: dgrad
          tensors_struct:
            - tensor: gradient
              quant_format: FP8E5M2
              margin: 2
            - tensor: weight
              quant_format: FP8E4M3
        - gemm: wgrad
          tensors_struct:
            - tensor: activation
              quant_format: MXFP8E4M3
            - tensor: gradient
              quant_format: FP8E4M3
              margin: 1
"#;

/// FakeQuant on stack `S` (plain backend `P`): each GEMM equals, bit for bit, `P`'s high-precision GEMM of the
/// operands fake-quantized on the host (the same kernel computes both); it differs from the high-precision GEMM of
/// the unmodified operands, from the unmodified layer's FP8 GEMM, and from the fake quantization without margins.
fn check_fake_quant<S: AutodiffBackend + TeBackend, P: Backend<Device = S::Device>>(
    what: &str,
    device: &S::Device,
) {
    let ops = Operands::new();
    let names = ["fx_fp8", "fx_fq"];
    let runs = run_session::<S>(
        &format!("fake-quant-{what}"),
        FAKE_QUANT_CONFIG,
        &names,
        &ops,
        device,
    );
    let hp = high_precision_all::<P>(&ops, device);
    let (e4m3, e5m2) = (Fp8Format::E4M3, Fp8Format::E5M2);
    let expected = |margins: bool| {
        let m = |margin: i32| if margins { margin } else { 0 };
        Gemms([
            high_precision::<P>(Gemm::Fprop, &current(&ops.x, e4m3, 0), &ops.w, device),
            high_precision::<P>(
                Gemm::Dgrad,
                &current(&ops.g, e5m2, m(2)),
                &current(&ops.w, e4m3, 0),
                device,
            ),
            high_precision::<P>(
                Gemm::Wgrad,
                &mx_along_rows(&ops.x, T, I, e4m3),
                &current(&ops.g, e4m3, m(1)),
                device,
            ),
        ])
    };
    let (expected, without_margins) = (expected(true), expected(false));
    for (recipe, layers) in recipes().iter().zip(&runs) {
        let [fp8, fq] = [&layers[0], &layers[1]];
        for gemm in GEMMS {
            let at = format!("{what} {} {}", recipe.name(), gemm.name());
            assert_bits(&format!("{at} FakeQuant"), fq.of(gemm), expected.of(gemm));
            assert_differs(
                &format!("{at} FakeQuant vs high precision"),
                fq.of(gemm),
                hp.of(gemm),
            );
            assert_differs(&format!("{at} FakeQuant vs FP8"), fq.of(gemm), fp8.of(gemm));
            if gemm != Gemm::Fprop {
                assert_differs(
                    &format!("{at} margins ignored"),
                    without_margins.of(gemm),
                    expected.of(gemm),
                );
            }
        }
    }
}

#[test]
fn fake_quant_gives_the_high_precision_gemm_of_the_fake_quantized_operands() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    check_fake_quant::<WgpuStack, Wgpu>("wgpu", &device());
    check_fake_quant::<HostStack, NdArray>("ndarray", &Default::default());
}
