//! `burn_te::optim::FusedAdam` (TE's `FusedAdam`): the host kernel's parameter and moments against an f64
//! re-computation of Adam's evolution at every step, and the optimizer against Burn's own `Adam` bit for bit over
//! several steps (weight decay, gradient clipping, a parameter spread over several of the kernel's blocks),
//! including a run resumed from Burn's `Adam` checkpoint.

use burn::backend::{Autodiff, Flex, NdArray};
use burn::grad_clipping::GradientClippingConfig;
use burn::module::{Module, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::{Adam, AdamConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn_te::optim::{AdamStep, FusedAdam, FusedAdamConfig};
use burn_te_kernels::host::optim::adam_step;

use crate::common::Rng;

type F = Autodiff<Flex>;

/// Adam's evolution in f64 for one value: (param, moment_1, moment_2) after step `t` (Burn's formula).
#[allow(clippy::too_many_arguments)]
fn adam_f64(
    (x, m, v): (f64, f64, f64),
    g: f64,
    t: i32,
    (beta_1, beta_2, epsilon): (f64, f64, f64),
    lr: f64,
    penalty: Option<f64>,
) -> (f64, f64, f64) {
    let g = g + penalty.unwrap_or(0.0) * x;
    let m = beta_1 * m + (1.0 - beta_1) * g;
    let v = beta_2 * v + (1.0 - beta_2) * g * g;
    let m_hat = m / (1.0 - beta_1.powi(t));
    let v_hat = v / (1.0 - beta_2.powi(t));
    (x - lr * m_hat / (v_hat.sqrt() + epsilon), m, v)
}

#[test]
fn fused_adam_kernel_follows_an_f64_adam_at_every_step() {
    let (beta_1, beta_2, epsilon, lr) = (0.9f32, 0.95f32, 1e-6f32, 3e-3);
    // Two blocks of the kernel's 2^15 values and a partial third.
    let len = (1 << 16) + 1234;
    let mut rng = Rng::new(7);
    for penalty in [None, Some(0.05f32)] {
        let mut x32 = rng.normal(len, 0.0, 1.0);
        let mut state64: Vec<(f64, f64, f64)> =
            x32.iter().map(|&x| (f64::from(x), 0.0, 0.0)).collect();
        // The moments' sums of their terms' magnitudes: the sums cancel (the penalty's term against the gradient,
        // a step's gradient against the history), their rounding errors do not.
        let mut magnitude_1 = vec![0f64; len];
        let mut magnitude_2 = vec![0f64; len];
        let mut moments: Option<(Vec<f32>, Vec<f32>)> = None;
        for t in 1..=6 {
            // Gradients of changing scale, so that the moments' history matters.
            let g = rng.normal(len, 0.1, 0.5 * t as f64);
            let step = AdamStep::new(beta_1, beta_2, epsilon, lr, penalty, t);
            let out = adam_step(
                &x32,
                &g,
                moments.as_ref().map(|(m, v)| (&m[..], &v[..])),
                step,
            );
            let (b1, b2) = (f64::from(beta_1), f64::from(beta_2));
            let steps = t as f64;
            for i in 0..len {
                let x_before = state64[i].0;
                state64[i] = adam_f64(
                    state64[i],
                    f64::from(g[i]),
                    t as i32,
                    (b1, b2, epsilon.into()),
                    lr,
                    penalty.map(f64::from),
                );
                let (x, m, v) = state64[i];
                let g_magnitude = f64::from(g[i]).abs()
                    + penalty.map_or(0.0, |p| (f64::from(p) * x_before).abs());
                magnitude_1[i] = b1 * magnitude_1[i] + (1.0 - b1) * g_magnitude;
                magnitude_2[i] = b2 * magnitude_2[i] + (1.0 - b2) * g_magnitude * g_magnitude;
                // f32's rounding (2⁻²⁴) a few times per step, on each quantity's own scale; the parameter's
                // update inherits the first moment's error relative to its magnitude.
                let m_hat_bound = magnitude_1[i] / (1.0 - b1.powi(t as i32));
                let v_hat_sqrt = (v / (1.0 - b2.powi(t as i32))).sqrt() + f64::from(epsilon);
                let checks = [
                    (
                        "moment_1",
                        out.moment_1[i],
                        m,
                        3e-7 * steps * magnitude_1[i],
                    ),
                    (
                        "moment_2",
                        out.moment_2[i],
                        v,
                        6e-7 * steps * magnitude_2[i],
                    ),
                    (
                        "param",
                        out.param[i],
                        x,
                        3e-7 * steps * (x.abs() + 4.0 * lr * (1.0 + m_hat_bound / v_hat_sqrt)),
                    ),
                ];
                for (what, actual, expected, tolerance) in checks {
                    assert!(
                        (f64::from(actual) - expected).abs() <= tolerance,
                        "{what}[{i}] at step {t} (penalty {penalty:?}): {actual} vs f64 {expected} (tolerance {tolerance:e})"
                    );
                }
            }
            x32 = out.param.to_vec();
            moments = Some((out.moment_1.to_vec(), out.moment_2.to_vec()));
        }
    }
}

/// Three parameters: one spread over several of the kernel's blocks, one small, and one that the loss reads
/// transposed (its gradient a transposed view on Flex).
#[derive(Module, Debug)]
struct Params<B: Backend> {
    w: Param<Tensor<B, 2>>,
    b: Param<Tensor<B, 1>>,
    u: Param<Tensor<B, 2>>,
}

/// `u`'s shape.
const U: [usize; 2] = [180, 250];

fn params<B: Backend>(device: &B::Device) -> Params<B> {
    let mut rng = Rng::new(11);
    let [rows, cols] = [300, 251];
    let w = Tensor::from_data(
        TensorData::new(rng.normal(rows * cols, 0.0, 0.3), [rows, cols]),
        device,
    );
    let b = Tensor::from_data(TensorData::new(rng.normal(37, 0.5, 1.0), [37]), device);
    let u = Tensor::from_data(
        TensorData::new(rng.normal(U[0] * U[1], 0.0, 0.3), U),
        device,
    );
    Params {
        w: Param::from_tensor(w),
        b: Param::from_tensor(b),
        u: Param::from_tensor(u),
    }
}

/// A loss whose gradients change with the parameters: Σ c ⊙ (p − target)² over each (`u` as `uᵀ`).
fn loss<B: Backend>(model: &Params<B>, step: usize) -> Tensor<B, 1> {
    let w = model.w.val();
    let b = model.b.val();
    let device = w.device();
    let [rows, cols] = w.dims();
    let mut rng = Rng::new(100 + step as u64);
    let target_w = Tensor::<B, 2>::from_data(
        TensorData::new(rng.normal(rows * cols, 0.0, 1.0), [rows, cols]),
        &device,
    );
    let scale_w = Tensor::<B, 2>::from_data(
        TensorData::new(rng.normal(rows * cols, 1.0, 0.5), [rows, cols]),
        &device,
    );
    let target_b =
        Tensor::<B, 1>::from_data(TensorData::new(rng.normal(37, 0.0, 1.0), [37]), &device);
    let target_u = Tensor::<B, 2>::from_data(
        TensorData::new(rng.normal(U[0] * U[1], 0.0, 1.0), [U[1], U[0]]),
        &device,
    );
    ((w - target_w).powi_scalar(2) * scale_w).sum()
        + (b - target_b).powi_scalar(2).sum()
        + (model.u.val().transpose() - target_u).powi_scalar(2).sum()
}

/// The parameters' bits after each of `steps` steps of `optimizer`, from `model`, numbering steps from `first`.
fn train<B: AutodiffBackend, O: Optimizer<Params<B>, B>>(
    optimizer: &mut O,
    mut model: Params<B>,
    first: usize,
    steps: usize,
) -> (Params<B>, Vec<Vec<u32>>) {
    let mut history = Vec::new();
    for step in first..first + steps {
        let grads = loss(&model, step).backward();
        let grads = GradientsParams::from_grads(grads, &model);
        model = optimizer.step(3e-3, model, grads);
        let bits = [
            model.w.val().into_data(),
            model.b.val().into_data(),
            model.u.val().into_data(),
        ]
        .iter()
        .flat_map(|data| data.to_vec::<f32>().expect("f32 parameters"))
        .map(f32::to_bits)
        .collect();
        history.push(bits);
    }
    (model, history)
}

fn counter(name: &str) -> u64 {
    burn_te::diagnostics::thread_counter_value(name).unwrap_or(0)
}

/// Each parameter's gradient norm at the first step, in f64 from the gradient's values: `[w, b, u]`.
fn first_gradient_norms<B: AutodiffBackend>(device: &B::Device) -> [f64; 3] {
    let model = params::<B>(device);
    let grads = loss(&model, 0).backward();
    let norm = |data: TensorData| {
        let values = data.to_vec::<f32>().expect("f32 gradients");
        values
            .iter()
            .map(|&g| f64::from(g).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    [
        norm(model.w.grad(&grads).expect("w's gradient").into_data()),
        norm(model.b.grad(&grads).expect("b's gradient").into_data()),
        norm(model.u.grad(&grads).expect("u's gradient").into_data()),
    ]
}

/// FusedAdam against Burn's Adam, bit for bit at every step, on backend `B`: without clipping and decay; clipping
/// by norm where it scales every parameter's gradient (1), all but `b`'s (100, between the norms) and with decay;
/// clipping by value. Every step fused.
fn fused_adam_gives_burns_adam_bits_on<B: AutodiffBackend>(device: &B::Device)
where
    B::InnerBackend: burn_te::TeBackend,
{
    let [norm_w, norm_b, norm_u] = first_gradient_norms::<B>(device);
    assert!(
        norm_w > 100.0 && norm_u > 100.0 && norm_b > 1.0 && norm_b < 100.0,
        "the cases below clip every gradient at 1 and all but b's at 100: norms w {norm_w}, b {norm_b}, u {norm_u}"
    );
    let decay = || Some(WeightDecayConfig::new(0.01));
    let cases = [
        (None, None),
        (decay(), Some(GradientClippingConfig::Norm(1.0))),
        (None, Some(GradientClippingConfig::Norm(100.0))),
        (decay(), Some(GradientClippingConfig::Norm(100.0))),
        (None, Some(GradientClippingConfig::Value(0.5))),
    ];
    for (weight_decay, grad_clipping) in cases {
        let burn_adam = AdamConfig::new()
            .with_beta_2(0.98)
            .with_weight_decay(weight_decay.clone())
            .with_grad_clipping(grad_clipping.clone())
            .init::<B, Params<B>>();
        let fused_adam = FusedAdamConfig::new()
            .with_beta_2(0.98)
            .with_weight_decay(weight_decay.clone())
            .with_grad_clipping(grad_clipping.clone())
            .init::<B, Params<B>>();
        let (_, expected) = train(&mut { burn_adam }, params::<B>(device), 0, 5);
        let fused_before = counter("FusedAdam");
        let (_, actual) = train(&mut { fused_adam }, params::<B>(device), 0, 5);
        assert_eq!(
            counter("FusedAdam") - fused_before,
            3 * 5,
            "every step of the three parameters fused on {}",
            B::name(device)
        );
        for (step, (actual, expected)) in actual.iter().zip(&expected).enumerate() {
            let differ = actual.iter().zip(expected).filter(|(a, e)| a != e).count();
            assert_eq!(
                differ,
                0,
                "step {step} on {} (weight decay {weight_decay:?}, clipping {grad_clipping:?}): {differ} of {} \
                 parameter values differ from Burn's Adam",
                B::name(device),
                actual.len()
            );
        }
    }
}

#[test]
fn fused_adam_gives_burns_adam_bits_at_every_step() {
    // `u`'s case: on Flex its gradient is a transposed view, which Flex's `square` and `sum` read in storage order.
    let model = params::<F>(&Default::default());
    let grad_u = model
        .u
        .grad(&loss(&model, 0).backward())
        .expect("u's gradient");
    assert!(
        !grad_u.into_primitive().tensor().is_contiguous(),
        "u's gradient is a transposed view on Flex"
    );
    fused_adam_gives_burns_adam_bits_on::<F>(&Default::default());
    fused_adam_gives_burns_adam_bits_on::<Autodiff<NdArray>>(&Default::default());
}

#[test]
fn fused_adam_resumes_from_a_burn_adam_checkpoint() {
    let device = Default::default();
    let mut burn_adam: OptimizerAdaptor<Adam, Params<F>, F> = AdamConfig::new().init();
    let (model, _) = train(&mut burn_adam, params(&device), 0, 3);
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = recorder
        .record(burn_adam.to_record(), ())
        .expect("Burn's Adam state serializes");
    // Both continue from the same state: Burn's Adam as it is, FusedAdam from the checkpoint's bytes.
    let (_, expected) = train(&mut burn_adam, model.clone(), 3, 3);
    type FusedRecord =
        <OptimizerAdaptor<FusedAdam, Params<F>, F> as Optimizer<Params<F>, F>>::Record;
    let record: FusedRecord = recorder
        .load(bytes, &device)
        .expect("Burn's Adam checkpoint loads as FusedAdam's state");
    let mut fused_adam = FusedAdamConfig::new()
        .init::<F, Params<F>>()
        .load_record(record);
    let (_, actual) = train(&mut fused_adam, model, 3, 3);
    assert_eq!(actual, expected, "FusedAdam resumed from Burn's Adam state");
}
