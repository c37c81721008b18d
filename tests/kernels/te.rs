//! The `Te<B>` decorator, recipes, autocast and autodiff on Burn tensors: FP8 vs f32 within TE's tolerances,
//! delayed scaling bit-exact against the host, a 2-layer MLP of plain `burn::nn::Linear` trained in FP8, the
//! host paths (Flex, NdArray), and bad inputs.

use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, NdArray};
use burn::module::Param;
use burn::nn::Linear;
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;
use burn_te::PlainLinearStates;
use burn_te::backends::Wgpu;
use burn_te::{
    AmaxComputeAlgo, DelayedScaling, DelayedScalingHistory, Float8BlockScaling,
    Float8CurrentScaling, Format, Fp8Format, MXFP8BlockScaling, NVFP4BlockScaling, Recipe, Scaling,
    Te, TeBackend, TeError, TensorRole, fp8_autocast, fp8_autocast_with, pow2_margin,
};

use crate::common::*;

type Dev = Te<Wgpu>;

pub fn device() -> WgpuDevice {
    // Fails loudly, with the install hint, when there is no device.
    let _ = client();
    WgpuDevice::default()
}

pub fn tensor<B: Backend, const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(values, shape), device)
}

pub fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

fn recipes() -> Vec<Recipe> {
    vec![
        DelayedScaling::default().into(),
        Float8CurrentScaling::default().into(),
        Float8BlockScaling::default().into(),
        MXFP8BlockScaling::default().into(),
        NVFP4BlockScaling::default().into(),
    ]
}

/// TE's FP8 tolerances on a GEMM output, scale-aware. TE applies `|a - e| <= atol + rtol * |e|` to single
/// quantizations of unit-scale tensors; a GEMM output is a sum of quantized products, so here the tensors are first
/// divided by the reference's amax (unit scale), and additionally the relative Frobenius error must be <= rtol.
pub fn assert_within(what: &str, actual: &[f32], expected: &[f32], rtol: f32, atol: f32) {
    assert_within_except(what, actual, expected, rtol, atol, 0.0);
}

/// [`assert_within`], with up to `outliers` (a fraction) of the elements allowed outside the elementwise bounds:
/// gradients through ReLU-like activations, whose derivative jumps at 0, differ by the full value wherever FP8
/// rounding moves a pre-activation across 0.
pub fn assert_within_except(
    what: &str,
    actual: &[f32],
    expected: &[f32],
    rtol: f32,
    atol: f32,
    outliers: f64,
) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths");
    let amax = expected.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let mut worst = 0.0f32;
    let (mut err2, mut ref2) = (0.0f64, 0.0f64);
    let mut failures = Vec::new();
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        let (an, en) = (a / amax, e / amax);
        if (an - en).abs() > atol + rtol * en.abs() {
            failures.push(format!("[{i}] {a} vs {e}"));
        }
        worst = worst.max((a - e).abs());
        err2 += ((a - e) as f64).powi(2);
        ref2 += (*e as f64).powi(2);
    }
    assert!(
        failures.len() as f64 <= (outliers * actual.len() as f64).ceil(),
        "{what}: {} of {} outside rtol {rtol} / atol {atol} (max error {worst}): {:?}",
        failures.len(),
        actual.len(),
        &failures[..failures.len().min(5)]
    );
    let relative = (err2 / ref2).sqrt();
    assert!(
        relative <= rtol as f64,
        "{what}: relative Frobenius error {relative}"
    );
    assert!(
        worst > 0.0,
        "{what}: FP8 result identical to f32 — did the FP8 path run?"
    );
    eprintln!("{what}: max error {worst:.4}, relative Frobenius error {relative:.4}");
}

/// NVFP4's tolerance on a GEMM output, in [`assert_within`]'s terms (`rtol`, `atol`). E2M1 keeps one mantissa bit:
/// with a block's amax mapped to 6, a value rounds by up to 1/12 of its block's amax below 2 and 1/6 above 4, so
/// one quantized Gaussian operand carries about 9 % relative RMS error and a product of two about 13 %; elementwise,
/// a few outputs (near zero, where the errors of K products do not cancel) reach a quarter of the amax.
pub const NVFP4_TOLERANCE: (f32, f32) = (0.25, 0.25);

#[test]
fn linear_fprop_dgrad_wgrad_within_te_tolerances() {
    let device = device();
    let (tokens, d_in, d_out) = (48, 96, 40);
    let mut rng = Rng::new(21);
    let x = rng.normal(tokens * d_in, 0.0, 1.0);
    let w = rng.normal(d_in * d_out, 0.0, 1.0 / (d_in as f64).sqrt());
    let b = rng.normal(d_out, 0.0, 0.1);
    let g = rng.normal(tokens * d_out, 0.0, 1.0);

    // f32 reference on the same device.
    type Ref = Autodiff<Wgpu>;
    let run_ref = || {
        let x = tensor::<Ref, 2>(x.clone(), [tokens, d_in], &device).require_grad();
        let w = tensor::<Ref, 2>(w.clone(), [d_in, d_out], &device).require_grad();
        let b = tensor::<Ref, 1>(b.clone(), [d_out], &device).require_grad();
        let y = burn::tensor::module::linear(x.clone(), w.clone(), Some(b));
        let grads = (y.clone() * tensor::<Ref, 2>(g.clone(), [tokens, d_out], &device))
            .sum()
            .backward();
        (
            values(y),
            values(x.grad(&grads).unwrap()),
            values(w.grad(&grads).unwrap()),
        )
    };
    let (y_ref, dx_ref, dw_ref) = run_ref();

    for recipe in recipes() {
        type B = Autodiff<Dev>;
        // A fresh state per recipe. Delayed scaling starts from scale 1 (TE too): one warm-up iteration fills
        // the amax histories, so the measured iteration uses scales from real amaxes.
        let states = PlainLinearStates::new();
        for attempt in 0..2 {
            let x_t = tensor::<B, 2>(x.clone(), [tokens, d_in], &device).require_grad();
            let w_t = tensor::<B, 2>(w.clone(), [d_in, d_out], &device).require_grad();
            let b_t = tensor::<B, 1>(b.clone(), [d_out], &device).require_grad();
            let y = fp8_autocast_with(&states, true, recipe.clone(), || {
                burn::tensor::module::linear(x_t.clone(), w_t.clone(), Some(b_t.clone()))
            })
            .unwrap();
            let grads = (y.clone() * tensor::<B, 2>(g.clone(), [tokens, d_out], &device))
                .sum()
                .backward();
            if attempt == 0 {
                continue;
            }
            let name = recipe.name();
            // Forward in E4M3; gradients in E5M2 under HYBRID (delayed, current), E4M3 otherwise.
            let (rtol, atol) = if matches!(recipe, Recipe::Nvfp4(_)) {
                NVFP4_TOLERANCE
            } else {
                (0.125, 0.0675)
            };
            assert_within(&format!("{name} y"), &values(y), &y_ref, rtol, atol);
            let (rtol, atol) = match recipe {
                Recipe::Nvfp4(_) => NVFP4_TOLERANCE,
                _ if recipe.format() == Format::Hybrid => (0.25, 0.125),
                _ => (0.125, 0.0675),
            };
            let dx = values(x_t.grad(&grads).unwrap());
            let dw = values(w_t.grad(&grads).unwrap());
            assert_within(&format!("{name} dx"), &dx, &dx_ref, rtol, atol);
            assert_within(&format!("{name} dw"), &dw, &dw_ref, rtol, atol);
        }
    }
}

#[test]
fn outside_autocast_runs_high_precision() {
    let device = device();
    let x = Rng::new(3).normal(8 * 16, 0.0, 1.0);
    let w = Rng::new(4).normal(16 * 4, 0.0, 0.25);
    let te = burn::tensor::module::linear(
        tensor::<Dev, 2>(x.clone(), [8, 16], &device),
        tensor::<Dev, 2>(w.clone(), [16, 4], &device),
        None,
    );
    let plain = burn::tensor::module::linear(
        tensor::<Wgpu, 2>(x.clone(), [8, 16], &device),
        tensor::<Wgpu, 2>(w.clone(), [16, 4], &device),
        None,
    );
    assert_eq!(values(te), values(plain));
    // A disabled inner scope inside an enabled one is high precision too; matmul follows the scope.
    let y = fp8_autocast(true, Float8CurrentScaling::default(), || {
        fp8_autocast(false, Float8CurrentScaling::default(), || {
            tensor::<Dev, 2>(x.clone(), [8, 16], &device).matmul(tensor::<Dev, 2>(
                w.clone(),
                [16, 4],
                &device,
            ))
        })
        .unwrap()
    })
    .unwrap();
    let y_ref = tensor::<Wgpu, 2>(x.clone(), [8, 16], &device).matmul(tensor::<Wgpu, 2>(
        w.clone(),
        [16, 4],
        &device,
    ));
    assert_eq!(values(y), values(y_ref.clone()));
    let y8 = fp8_autocast(true, Float8CurrentScaling::default(), || {
        tensor::<Dev, 2>(x.clone(), [8, 16], &device).matmul(tensor::<Dev, 2>(
            w.clone(),
            [16, 4],
            &device,
        ))
    })
    .unwrap();
    assert_within("matmul", &values(y8), &values(y_ref), 0.125, 0.0675);
}

#[test]
fn delayed_scaling_20_steps_bit_exact_against_host() {
    let device = device();
    for (algo, len, margin) in [
        (AmaxComputeAlgo::Max, 4, 0.0),
        (AmaxComputeAlgo::MostRecent, 1024, 1.0),
    ] {
        let state = Wgpu::fp8_delayed_state(&device, len).unwrap();
        let mut host = DelayedScalingHistory::new(len).unwrap();
        for step in 0..20 {
            // Amplitudes that rise and fall, with an all-zero step (keeps the scale).
            let amplitude = if step == 7 {
                0.0
            } else {
                2f64.powi((step % 9) as i32 - 3)
            };
            let x = Rng::new(100 + step).normal(
                1000,
                0.0,
                amplitude.max(1e-30) * (amplitude > 0.0) as u8 as f64,
            );
            let x: Vec<f32> = x
                .iter()
                .map(|v| if amplitude == 0.0 { 0.0 } else { *v })
                .collect();
            let scaling = Scaling::Delayed {
                state: &state,
                record: true,
            };
            let q = Wgpu::fp8_quantize(
                tensor::<Wgpu, 1>(x.clone(), [1000], &device)
                    .into_primitive()
                    .tensor(),
                Fp8Format::E4M3,
                scaling,
            )
            .unwrap();
            let deq = values(Tensor::<Wgpu, 1>::from_primitive(TensorPrimitive::Float(
                Wgpu::fp8_dequantize(q).unwrap(),
            )));
            // Step n quantizes with the scale from the history before step n.
            let expected: Vec<f32> = x
                .iter()
                .map(|&v| {
                    Fp8Format::E4M3.decode(Fp8Format::E4M3.encode(v * host.scale)) * host.scale_inv
                })
                .collect();
            assert_eq!(
                deq.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{algo:?} step {step}: dequantized values"
            );
            host.record(burn_te_kernels::host::amax(&x));
            host.update(algo, Fp8Format::E4M3, pow2_margin(margin).unwrap());
            Wgpu::fp8_delayed_state_update(&state, algo, Fp8Format::E4M3, margin).unwrap();
            let (history, scale) = Wgpu::fp8_delayed_state_read(&state).unwrap();
            assert_eq!(
                scale.to_bits(),
                host.scale.to_bits(),
                "{algo:?} step {step}: scale"
            );
            assert_eq!(history, host.history, "{algo:?} step {step}: history");
        }
    }
}

/// A 2-layer MLP of plain Burn `Linear`s.
#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device, (d_in, hidden, d_out): (usize, usize, usize)) -> Self {
        let mut rng = Rng::new(5);
        let mut linear = |i: usize, o: usize| Linear {
            weight: Param::from_tensor(tensor(
                rng.normal(i * o, 0.0, 1.0 / (i as f64).sqrt()),
                [i, o],
                device,
            )),
            bias: Some(Param::from_tensor(tensor(vec![0.0; o], [o], device))),
        };
        Mlp {
            fc1: linear(d_in, hidden),
            fc2: linear(hidden, d_out),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.fc2
            .forward(burn::tensor::activation::relu(self.fc1.forward(x)))
    }
}

/// Trains the MLP on a fixed regression task and returns the mean loss of the last 10 steps.
fn train<B: burn::tensor::backend::AutodiffBackend>(
    device: &B::Device,
    recipe: Option<Recipe>,
    states: &PlainLinearStates,
) -> f32 {
    let dims = (32, 64, 8);
    let mut model = Mlp::<B>::new(device, dims);
    let mut optim = SgdConfig::new().init::<B, Mlp<B>>();
    let teacher = Rng::new(77).normal(dims.0 * dims.2, 0.0, 0.5);
    let teacher = tensor::<B, 2>(teacher, [dims.0, dims.2], device);
    let mut losses = Vec::new();
    for step in 0..150 {
        let x = tensor::<B, 2>(
            Rng::new(1000 + step).normal(64 * dims.0, 0.0, 1.0),
            [64, dims.0],
            device,
        );
        let target = x.clone().matmul(teacher.clone()).tanh();
        let forward = || {
            let y = model.forward(x.clone());
            (y - target.clone()).powi_scalar(2).mean()
        };
        let loss = match &recipe {
            Some(recipe) => fp8_autocast_with(states, true, recipe.clone(), forward).unwrap(),
            None => forward(),
        };
        losses.push(values(loss.clone())[0]);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(0.05, model, grads);
    }
    losses[losses.len() - 10..].iter().sum::<f32>() / 10.0
}

#[test]
fn mlp_of_plain_linears_trains_in_fp8_within_10_percent_of_f32() {
    let device = device();
    let f32_loss = train::<Autodiff<Wgpu>>(&device, None, &PlainLinearStates::new());
    let initial = {
        let model = Mlp::<Wgpu>::new(&device, (32, 64, 8));
        let x = tensor::<Wgpu, 2>(Rng::new(1000).normal(64 * 32, 0.0, 1.0), [64, 32], &device);
        let t = tensor::<Wgpu, 2>(Rng::new(77).normal(32 * 8, 0.0, 0.5), [32, 8], &device);
        values(
            (model.forward(x.clone()) - x.matmul(t).tanh())
                .powi_scalar(2)
                .mean(),
        )[0]
    };
    assert!(
        f32_loss < 0.5 * initial,
        "the f32 run must learn: {initial} -> {f32_loss}"
    );
    let delayed_states = PlainLinearStates::new();
    for recipe in recipes() {
        let states = match recipe {
            Recipe::Delayed(_) => delayed_states.clone(),
            _ => PlainLinearStates::new(),
        };
        let fp8_loss = train::<Autodiff<Dev>>(&device, Some(recipe.clone()), &states);
        let ratio = fp8_loss / f32_loss;
        eprintln!(
            "{}: final loss {fp8_loss} vs f32 {f32_loss} (ratio {ratio:.4})",
            recipe.name()
        );
        assert!(
            (ratio - 1.0).abs() <= 0.10,
            "{}: {fp8_loss} vs f32 {f32_loss}",
            recipe.name()
        );
    }
    // The delayed-scaling histories of both layers' activations, weights and gradients advanced.
    assert_eq!(delayed_states.names(), ["linear0", "linear1"]);
    let recipe = DelayedScaling::default();
    for layer in ["linear0", "linear1"] {
        for role in [
            TensorRole::Activation,
            TensorRole::Weight,
            TensorRole::Gradient,
        ] {
            let format = recipe.fp8_format.for_role(role);
            let view = delayed_states
                .layer(layer)
                .read(role, &recipe, format)
                .unwrap()
                .unwrap();
            let (history, scale) = (view.history, view.scale);
            assert!(
                history.iter().any(|&a| a > 0.0) && scale != 1.0,
                "{layer} {role:?}: {scale}"
            );
        }
    }
}

/// A CPU backend's host path computes what the device computes: the same codes and scales, the GEMM's f32
/// accumulation order aside (a linear under every recipe, and a batched matmul with a broadcast batch).
/// A linear layer's output and its input and weight gradients (`y·g` summed) in FP8 under `recipe`.
fn linear_and_grads<B: AutodiffBackend>(
    recipe: &Recipe,
    (x, w, g): (&[f32], &[f32], &[f32]),
    [m, k, n]: [usize; 3],
    device: &B::Device,
) -> [Vec<f32>; 3] {
    let x = tensor::<B, 2>(x.to_vec(), [m, k], device).require_grad();
    let w = tensor::<B, 2>(w.to_vec(), [k, n], device).require_grad();
    let y = fp8_autocast_with(&PlainLinearStates::new(), true, recipe.clone(), || {
        burn::tensor::module::linear(x.clone(), w.clone(), None)
    })
    .unwrap();
    let grads = (y.clone() * tensor::<B, 2>(g.to_vec(), [m, n], device))
        .sum()
        .backward();
    [
        values(y),
        values(x.grad(&grads).unwrap()),
        values(w.grad(&grads).unwrap()),
    ]
}

/// `lhs · rhs` in FP8 under `recipe`, batched with the given shapes.
fn fp8_matmul<B: Backend>(
    recipe: &Recipe,
    (lhs, rhs): (&[f32], &[f32]),
    (lhs_shape, rhs_shape): ([usize; 3], [usize; 3]),
    device: &B::Device,
) -> Vec<f32> {
    let (l, r) = (
        lhs_shape.iter().product::<usize>(),
        rhs_shape.iter().product::<usize>(),
    );
    values(
        fp8_autocast(true, recipe.clone(), || {
            tensor::<B, 3>(lhs[..l].to_vec(), lhs_shape, device).matmul(tensor::<B, 3>(
                rhs[..r].to_vec(),
                rhs_shape,
                device,
            ))
        })
        .unwrap(),
    )
}

fn host_path_matches_the_device<H: TeBackend>(what: &str) {
    let device = device();
    let host_device = Default::default();
    let x = Rng::new(8).normal(40 * 128, 0.0, 2.0);
    let w = Rng::new(9).normal(128 * 30 * 2, 0.0, 0.2);
    let g = Rng::new(10).normal(40 * 30, 0.0, 1.0);
    let close = |case: String, on_device: Vec<f32>, on_host: Vec<f32>| {
        assert_eq!(on_device.len(), on_host.len(), "{what} {case}");
        for (a, b) in on_device.iter().zip(on_host) {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "{what} {case}: {a} vs {b}"
            );
        }
    };
    // Stochastic rounding draws its bits per iteration (the autocast generation, which the two runs do not share).
    let deterministic = |recipe: Recipe| match recipe {
        Recipe::Nvfp4(r) => NVFP4BlockScaling {
            disable_stochastic_rounding: true,
            ..r
        }
        .into(),
        recipe => recipe,
    };
    for recipe in recipes().into_iter().map(deterministic) {
        let name = recipe.name();
        // fprop, and dgrad and wgrad (their operands read transposed).
        let operands = (&x[..40 * 70], &w[..70 * 30], &g[..]);
        let on_device = linear_and_grads::<Autodiff<Dev>>(&recipe, operands, [40, 70, 30], &device);
        let on_host =
            linear_and_grads::<Autodiff<Te<H>>>(&recipe, operands, [40, 70, 30], &host_device);
        for ((what, d), h) in ["y", "dx", "dw"].iter().zip(on_device).zip(on_host) {
            close(format!("{name} linear {what}"), d, h);
        }
        // Batched: a batch of one broadcasts on either side; equal batches. (A batched operand's scale blocks
        // along K must not straddle its matrices, so K = 128.)
        for shapes in [
            ([2, 20, 70], [1, 70, 30]),
            ([1, 40, 128], [2, 128, 30]),
            ([2, 20, 128], [2, 128, 30]),
        ] {
            let on_device = fp8_matmul::<Dev>(&recipe, (&x, &w), shapes, &device);
            let on_host = fp8_matmul::<Te<H>>(&recipe, (&x, &w), shapes, &host_device);
            close(format!("{name} matmul {shapes:?}"), on_device, on_host);
        }
    }
}

#[test]
fn host_paths_match_the_device() {
    host_path_matches_the_device::<burn::backend::Flex>("flex");
    host_path_matches_the_device::<NdArray>("ndarray");
}

#[test]
fn bad_inputs_give_clear_errors_or_te_behaviour() {
    let device = device();
    // Pure E5M2 is rejected by every recipe; bad delayed-scaling settings too.
    let e5m2 = [
        Recipe::from(DelayedScaling {
            fp8_format: Format::E5M2,
            ..Default::default()
        }),
        Float8CurrentScaling {
            fp8_format: Format::E5M2,
            ..Default::default()
        }
        .into(),
        Float8BlockScaling {
            fp8_format: Format::E5M2,
        }
        .into(),
        MXFP8BlockScaling {
            fp8_format: Format::E5M2,
        }
        .into(),
    ];
    for recipe in e5m2 {
        let err = fp8_autocast(true, recipe, || ()).unwrap_err();
        assert!(
            matches!(err, TeError::InvalidRecipe(_)) && err.to_string().contains("E5M2"),
            "{err}"
        );
    }
    // A margin of 128 passes "finite and >= 0" but 2^128 overflows f32: refused at the scope, not at the first
    // scale update.
    for margin in [-1.0, 128.0, f32::NAN] {
        let err = fp8_autocast(
            true,
            DelayedScaling {
                margin,
                ..Default::default()
            },
            || (),
        )
        .unwrap_err();
        assert!(err.to_string().contains("margin"), "{margin}: {err}");
    }
    let err = fp8_autocast(
        true,
        DelayedScaling {
            amax_history_len: 0,
            ..Default::default()
        },
        || (),
    )
    .unwrap_err();
    assert!(err.to_string().contains("amax_history_len"), "{err}");

    // Mismatched GEMM shapes: a typed error naming both shapes.
    let a = Wgpu::fp8_quantize(
        tensor::<Wgpu, 2>(vec![1.0; 6], [2, 3], &device)
            .into_primitive()
            .tensor(),
        Fp8Format::E4M3,
        Scaling::Current { margin: 0.0 },
    )
    .unwrap();
    let b = Wgpu::fp8_quantize(
        tensor::<Wgpu, 2>(vec![1.0; 8], [4, 2], &device)
            .into_primitive()
            .tensor(),
        Fp8Format::E4M3,
        Scaling::Current { margin: 0.0 },
    )
    .unwrap();
    let err = Wgpu::fp8_gemm(a, false, b, false).unwrap_err();
    assert!(
        matches!(err, TeError::ShapeMismatch { .. }) && err.to_string().contains("[2, 3]"),
        "{err}"
    );

    // Empty tensors: an empty batch gives an empty output, no panic.
    let y = fp8_autocast(true, DelayedScaling::default(), || {
        burn::tensor::module::linear(
            tensor::<Dev, 2>(vec![], [0, 16], &device),
            tensor::<Dev, 2>(vec![0.5; 16 * 4], [16, 4], &device),
            None,
        )
    })
    .unwrap();
    assert_eq!(y.dims(), [0, 4]);

    // Non-finite values (TE's behaviour): inf saturates to ±max, NaN stays NaN, and the inf/NaN amax keeps the
    // previous delayed scale.
    let mut x = vec![1.0f32; 16];
    x[0] = f32::INFINITY;
    x[1] = f32::NAN;
    let w = [vec![1.0f32], vec![0.0; 3]].concat().repeat(16);
    let y = values(
        fp8_autocast(true, Float8CurrentScaling::default(), || {
            burn::tensor::module::linear(
                tensor::<Dev, 2>(x.clone(), [1, 16], &device),
                tensor::<Dev, 2>(w.clone(), [16, 4], &device),
                None,
            )
        })
        .unwrap(),
    );
    assert!(y[0].is_nan(), "NaN propagates: {y:?}");
    let y = values(
        fp8_autocast(true, Float8CurrentScaling::default(), || {
            burn::tensor::module::linear(
                tensor::<Dev, 2>(vec![f32::INFINITY, 1.0], [1, 2], &device),
                tensor::<Dev, 2>(vec![1.0, 1.0], [2, 1], &device),
                None,
            )
        })
        .unwrap(),
    );
    // amax inf keeps scale 1: inf → 448, 1 → 1.
    assert_eq!(y, vec![449.0]);
}
