//! A norm or activation writing the FP8 input of the GEMM that follows (`LayerNormLinear`, `LayerNormMLP` under
//! DelayedScaling on the host path; TE's LayerNorm and GELU kernels with an FP8 output): the kernels' codes and amax
//! are the op's output quantized, and a layer's training iterations follow an f64 re-computation of its GEMMs and
//! amax history at every step, with the same bits as the op and the GEMM run apart.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_te::fused::{NormKind, NormSpec, with_input_cast_unfused};
use burn_te::nn::{LayerNormLinear, LayerNormLinearConfig, LayerNormMLPConfig, Normalization};
use burn_te::{DelayedScaling, Fp8Format, Te, TensorRole, fp8_autocast};
use burn_te_kernels::host::fused::norm::{norm_forward, norm_forward_quantized};

use crate::common::Rng;
use crate::fp8_state::{amax, assert_gemm, delayed_scale, matmul, quantized, transpose};

type B = Autodiff<Te<Flex>>;

const ITERATIONS: usize = 4;
const BATCH: usize = 2;
const SEQ: usize = 12;
const D_IN: usize = 48;
const D_OUT: usize = 24;
const TOKENS: usize = BATCH * SEQ;

/// The counters of the norms and activations that wrote their GEMM's FP8 input.
const CASTS: [&str; 2] = ["FusedNormCast", "FusedActivationCast"];

fn counter(name: &str) -> u64 {
    burn_te::diagnostics::thread_counter_value(name).unwrap_or(0)
}

fn values<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().into_vec::<f32>().expect("f32 data")
}

fn tensor<const D: usize>(values: Vec<f32>, shape: [usize; D]) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

/// The kernel's codes, amax and row statistics are those of the norm's output quantized by the quantize kernel,
/// bit for bit: LayerNorm with and without β, RMSNorm, a zero-centred γ; both formats; rows over several blocks of
/// the pool (a width that is no multiple of 8, a NaN row); and the amax is the f64 maximum of |y|.
#[test]
fn norm_cast_codes_are_the_norm_output_quantized() {
    let (rows, width) = (700, 75);
    let mut rng = Rng::new(3);
    let mut x = rng.normal(rows * width, 0.5, 2.0);
    let gamma = rng.normal(width, 1.0, 0.5);
    let beta = rng.normal(width, 0.0, 0.5);
    let cases = [
        (NormKind::LayerNorm, Some(&beta[..]), false),
        (NormKind::LayerNorm, None, true),
        (NormKind::RmsNorm, None, false),
    ];
    for (kind, beta, zero_centered_gamma) in cases {
        let spec = NormSpec {
            kind,
            eps: 1e-5,
            zero_centered_gamma,
        };
        for (format, scale) in [(Fp8Format::E4M3, 37.5f32), (Fp8Format::E5M2, 0.75)] {
            let what = format!("{kind:?} β {} {format:?}", beta.is_some());
            let (y, stats) = norm_forward(&x, &gamma, beta, spec);
            let (codes, amax_bits, fused_stats) =
                norm_forward_quantized(&x, &gamma, beta, spec, (scale, format));
            let (expected, expected_amax) =
                burn_te_kernels::host::quantize_with_amax(&y, scale, format);
            assert_eq!(codes, expected, "{what}: codes");
            assert_eq!(amax_bits.to_bits(), expected_amax.to_bits(), "{what}: amax");
            assert_eq!(fused_stats, stats, "{what}: row statistics");
            let f64_amax = y.iter().fold(0f64, |a, v| a.max(f64::from(v.abs())));
            assert_eq!(f64::from(amax_bits), f64_amax, "{what}: amax against f64");
        }
    }
    // A NaN input row: the amax is NaN, as the quantize kernel's (a NaN wins the maximum).
    x[5 * width] = f32::NAN;
    let spec = NormSpec {
        kind: NormKind::LayerNorm,
        eps: 1e-5,
        zero_centered_gamma: false,
    };
    let (_, amax, _) =
        norm_forward_quantized(&x, &gamma, Some(&beta), spec, (1.0, Fp8Format::E4M3));
    assert!(amax.is_nan(), "a NaN row's amax: {amax}");
}

/// The activation kernel's codes and amax are its output quantized by the quantize kernel, bit for bit: every
/// pointwise function, plain and gated, both formats, rows over several blocks; the amax is the f64 maximum of |y|.
#[test]
fn activation_cast_codes_are_the_activation_output_quantized() {
    use burn_te::fused::Pointwise;
    use burn_te_kernels::host::fused::activation::{
        activation_forward, activation_forward_quantized,
    };
    let (rows, width) = (500, 132);
    let x = Rng::new(4).normal(rows * width, 0.0, 3.0);
    let functions = [
        Pointwise::Gelu,
        Pointwise::QuickGelu,
        Pointwise::Relu,
        Pointwise::SquaredRelu,
        Pointwise::Silu,
    ];
    for f in functions {
        for gated in [false, true] {
            for (format, scale) in [(Fp8Format::E4M3, 21.0f32), (Fp8Format::E5M2, 0.5)] {
                let what = format!("{f:?} gated {gated} {format:?}");
                let y = activation_forward(&x, width, f, gated);
                let (codes, amax) =
                    activation_forward_quantized(&x, width, (f, gated), (scale, format));
                let (expected, expected_amax) =
                    burn_te_kernels::host::quantize_with_amax(&y, scale, format);
                assert_eq!(codes, expected, "{what}: codes");
                assert_eq!(amax.to_bits(), expected_amax.to_bits(), "{what}: amax");
                let f64_amax = y.iter().fold(0f64, |a, v| a.max(f64::from(v.abs())));
                assert_eq!(f64::from(amax), f64_amax, "{what}: amax against f64");
            }
        }
    }
}

/// Every parameter of `module` replaced by seeded normal values (γ around 1, the rest around 0), so that γ, β and
/// the bias take part in the values compared.
struct Randomize(Rng);

impl<Bk: Backend> ModuleMapper<Bk> for Randomize {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<Bk, D>>) -> Param<Tensor<Bk, D>> {
        param.map(|t| {
            let dims = t.dims();
            let mean = if D == 1 && t.clone().mean().into_scalar().elem::<f32>() == 1.0 {
                1.0
            } else {
                0.0
            };
            let values = self.0.normal(dims.iter().product(), mean, 0.3);
            Tensor::from_data(TensorData::new(values, dims), &t.device()).require_grad()
        })
    }
}

/// One iteration's results: the output, the input's gradient, every parameter's gradient (in visit order) and
/// the layer's activation, weight and gradient (history, scale) after it.
struct Iteration {
    y: Vec<f32>,
    dx: Vec<f32>,
    grads: Vec<(ParamId, Vec<f32>)>,
    states: Vec<(Vec<f32>, f32)>,
}

/// Two bit-identical slices, or the first element that differs.
fn assert_bits(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        panic!("{what}[{i}]: {} against {} apart", a[i], b[i]);
    }
}

impl Iteration {
    /// The same bits in every result (the parameters in visit order: the two layers' ids differ).
    fn assert_same(&self, apart: &Iteration, what: &str) {
        assert_bits(&format!("{what} y"), &self.y, &apart.y);
        assert_bits(&format!("{what} dx"), &self.dx, &apart.dx);
        assert_eq!(self.grads.len(), apart.grads.len(), "{what}: gradients");
        for (i, ((_, a), (_, b))) in self.grads.iter().zip(&apart.grads).enumerate() {
            assert_bits(&format!("{what} parameter {i}'s gradient"), a, b);
        }
        assert_eq!(self.states, apart.states, "{what}: FP8 states");
    }
}

fn recipe() -> DelayedScaling {
    DelayedScaling {
        amax_history_len: 2,
        ..DelayedScaling::default()
    }
}

/// The iterations' inputs and output gradients, amplitudes rising and falling so that the scales move.
fn data(n: usize) -> (Vec<f32>, Vec<f32>) {
    let amplitude = [1.0, 6.0, 0.5, 3.0][n];
    let x = Rng::new(100 + n as u64).normal(TOKENS * D_IN, 0.3, amplitude);
    let g = Rng::new(200 + n as u64).normal(TOKENS * D_OUT, 0.0, 1e-3 * amplitude);
    (x, g)
}

/// Runs iteration `n` of `module` (its forward `forward`) in a DelayedScaling scope, backward of `sum(y ⊙ g)`
/// (so the output gradient is exactly `g`), with the fused casts counted ([`CASTS`]).
fn iteration<M: Module<B>>(
    module: &M,
    n: usize,
    forward: impl Fn(&M, Tensor<B, 3>) -> Tensor<B, 3>,
    states: impl Fn(&M) -> Vec<(Vec<f32>, f32)>,
) -> (Iteration, [u64; 2]) {
    let (x, g) = data(n);
    let x = tensor(x, [BATCH, SEQ, D_IN]).require_grad();
    let before = CASTS.map(counter);
    let y = fp8_autocast(true, recipe(), || forward(module, x.clone())).unwrap();
    let fused = [0, 1].map(|i| counter(CASTS[i]) - before[i]);
    let gradients = (y.clone() * tensor(g, [BATCH, SEQ, D_OUT]))
        .sum()
        .backward();
    let mut grads = Vec::new();
    struct Collect<'a>(
        &'a <B as AutodiffBackend>::Gradients,
        &'a mut Vec<(ParamId, Vec<f32>)>,
    );
    impl burn::module::ModuleVisitor<B> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = param.val().grad(self.0) {
                let grad = grad.into_data().into_vec::<f32>().expect("f32 data");
                self.1.push((param.id, grad));
            }
        }
    }
    module.visit(&mut Collect(&gradients, &mut grads));
    let dx = x.grad(&gradients).expect("dx").into_data();
    let result = Iteration {
        y: values(y),
        dx: dx.into_vec::<f32>().expect("f32 data"),
        grads,
        states: states(module),
    };
    (result, fused)
}

/// The layer's (history, scale) of each role as the next iteration will use them.
fn layer_states(layer: &LayerNormLinear<B>) -> Vec<(Vec<f32>, f32)> {
    let recipe = recipe();
    [
        TensorRole::Activation,
        TensorRole::Weight,
        TensorRole::Gradient,
    ]
    .map(|role| {
        let format = recipe.fp8_format.for_role(role);
        let view = layer
            .fp8_meta
            .read(role, &recipe, format)
            .unwrap()
            .expect("state");
        (view.history, view.scale)
    })
    .to_vec()
}

/// LayerNormLinear (LayerNorm with a bias; RMSNorm with a zero-centred γ and no bias) under DelayedScaling: each
/// iteration takes the fused op once, and its output, its weight gradient and its activation's amax history and
/// scale follow an f64 re-computation from the norm's f32 output (TE's delayed scale, the conformance encoder, f64
/// products). The output, every gradient and every state equal, bit for bit, those of the same layer with the norm
/// and the GEMM run apart.
#[test]
fn layernorm_linear_with_the_norm_writing_fp8_follows_the_f64_recomputation() {
    let recipe = recipe();
    for (normalization, bias, zero_centered) in [
        (Normalization::LayerNorm, true, false),
        (Normalization::RMSNorm, false, true),
    ] {
        let what = format!("{normalization:?}");
        let make = || {
            let layer = LayerNormLinearConfig::new(D_IN, D_OUT)
                .with_normalization(normalization)
                .with_bias(bias)
                .with_zero_centered_gamma(zero_centered)
                .with_name(Some("ln_fc".into()))
                .init::<B>(&Default::default());
            layer.map(&mut Randomize(Rng::new(7)))
        };
        let (fused_layer, unfused_layer) = (make(), make());
        let forward = |m: &LayerNormLinear<B>, x| m.forward(x);
        let weight = values(fused_layer.weight.val());
        let bias_values = fused_layer.bias.as_ref().map(|b| values(b.val()));
        let mut act_amaxes = Vec::new();
        let mut grad_amaxes = Vec::new();
        for n in 0..ITERATIONS {
            let (fused, count) = iteration(&fused_layer, n, forward, layer_states);
            let (unfused, unfused_count) =
                with_input_cast_unfused(|| iteration(&unfused_layer, n, forward, layer_states));
            let counts = [count, unfused_count];
            assert_eq!(counts, [[1, 0], [0, 0]], "{what} it {n}: {CASTS:?}");
            fused.assert_same(&unfused, &format!("{what} it {n}"));

            // The re-computation: the norm's f32 output (the norm op alone), quantized with TE's delayed scales.
            let (x, g) = data(n);
            let normalized = values(
                fused_layer
                    .layer_norm
                    .try_forward(tensor(x, [BATCH, SEQ, D_IN]))
                    .unwrap(),
            );
            act_amaxes.push(amax(&normalized));
            grad_amaxes.push(amax(&g));
            let scale = |amaxes: &[f32], role| delayed_scale(amaxes, role, n, &recipe);
            let format = |role| recipe.fp8_format.for_role(role);
            let act = TensorRole::Activation;
            let (_, qx) = quantized(&normalized, scale(&act_amaxes, act), format(act));
            let w_amaxes = vec![amax(&weight); n + 1];
            let (_, qw) = quantized(
                &weight,
                scale(&w_amaxes, TensorRole::Weight),
                format(TensorRole::Weight),
            );
            let grad = TensorRole::Gradient;
            let (_, qg) = quantized(&g, scale(&grad_amaxes, grad), format(grad));
            let mut expected_y = matmul(&qx, &qw, TOKENS, D_IN, D_OUT);
            if let Some(b) = &bias_values {
                for (i, (e, m)) in expected_y.iter_mut().enumerate() {
                    *e += f64::from(b[i % D_OUT]);
                    *m += f64::from(b[i % D_OUT].abs());
                }
            }
            assert_gemm(&format!("{what} it {n} fprop"), &fused.y, &expected_y);
            let dw = &fused
                .grads
                .iter()
                .find(|(id, _)| *id == fused_layer.weight.id)
                .expect("dw")
                .1;
            let expected_dw = matmul(&transpose(&qx, TOKENS, D_IN), &qg, D_IN, TOKENS, D_OUT);
            assert_gemm(&format!("{what} it {n} wgrad"), dw, &expected_dw);
            let (history, next_scale) = &fused.states[0];
            // Rolled for the next iteration (TE's `roll(-1)`, slot 0 zeroed): this iteration's amax last.
            assert_eq!(
                history[history.len() - 1],
                act_amaxes[n],
                "{what} it {n}: activation amax recorded"
            );
            let expected_next = delayed_scale(&act_amaxes, act, n + 1, &recipe);
            assert_eq!(
                *next_scale, expected_next,
                "{what} it {n}: next activation scale"
            );
        }
    }
}

/// LayerNormMLP (a plain and a gated activation): FC1 takes its norm's FP8 output and FC2 its activation's, once
/// each per iteration, with the same bits as the ops apart in every output, gradient and FP8 state (both layers').
#[test]
fn layernorm_mlp_with_its_norm_and_activation_writing_fp8_equals_the_ops_apart() {
    use burn_te::nn::{Activation, LayerNormMLP};
    for activation in [Activation::Gelu, Activation::Swiglu] {
        let make = || {
            LayerNormMLPConfig::new(D_IN, 64)
                .with_activation(activation)
                .with_name(Some("mlp".into()))
                .init::<B>(&Default::default())
                .map(&mut Randomize(Rng::new(9)))
        };
        let (fused_mlp, unfused_mlp) = (make(), make());
        let forward = |m: &LayerNormMLP<B>, x: Tensor<B, 3>| {
            // Down to D_OUT features, so that the output gradient `g` fits.
            m.forward(x).slice([0..BATCH, 0..SEQ, 0..D_OUT])
        };
        let states = |m: &LayerNormMLP<B>| {
            let recipe = recipe();
            let mut states = Vec::new();
            for meta in [&m.fc1.fp8_meta, &m.fc2.fp8_meta] {
                for role in [
                    TensorRole::Activation,
                    TensorRole::Weight,
                    TensorRole::Gradient,
                ] {
                    let format = recipe.fp8_format.for_role(role);
                    let view = meta.read(role, &recipe, format).unwrap().expect("state");
                    states.push((view.history, view.scale));
                }
            }
            states
        };
        for n in 0..ITERATIONS {
            let what = format!("{} it {n}", activation.te_name());
            let (fused, count) = iteration(&fused_mlp, n, forward, states);
            let (unfused, unfused_count) =
                with_input_cast_unfused(|| iteration(&unfused_mlp, n, forward, states));
            assert_eq!(
                [count, unfused_count],
                [[1, 1], [0, 0]],
                "{what}: {CASTS:?}"
            );
            fused.assert_same(&unfused, &what);
        }
    }
}

/// What reads the norm's output keeps the two ops apart: the debug tools (`Debug<B>`: a feature may read the GEMM's
/// input in high precision) and diagnostics that look at each GEMM's operands (eager mode). Each gives the results
/// of the ops apart on `Te<Flex>`, bit for bit.
#[test]
fn debug_tools_and_eager_diagnostics_keep_the_norm_and_the_gemm_apart() {
    use burn_te::diagnostics::{self, DiagnosticsConfig};
    use burn_te_debug::Debug;
    type D = Autodiff<Debug<Te<Flex>>>;
    let (x, _) = data(0);
    let layer = || {
        LayerNormLinearConfig::new(D_IN, D_OUT)
            .with_name(Some("ln_fc".into()))
            .init::<B>(&Default::default())
            .map(&mut Randomize(Rng::new(11)))
    };
    let run = |layer: &LayerNormLinear<B>| {
        let before = counter(CASTS[0]);
        let y = fp8_autocast(true, recipe(), || {
            layer.forward(tensor(x.clone(), [BATCH, SEQ, D_IN]))
        })
        .unwrap();
        (values(y), counter(CASTS[0]) - before)
    };
    let (apart, _) = with_input_cast_unfused(|| run(&layer()));

    diagnostics::configure_thread(DiagnosticsConfig::new().with_eager(true)).expect("config");
    let eager = run(&layer());
    diagnostics::clear_thread_config();
    assert_eq!(eager.1, 0, "eager diagnostics: FusedNormCast");
    assert_bits("eager diagnostics y", &eager.0, &apart);

    let debug_layer: LayerNormLinear<D> = LayerNormLinearConfig::new(D_IN, D_OUT)
        .with_name(Some("ln_fc".into()))
        .init::<D>(&Default::default())
        .map(&mut Randomize(Rng::new(11)));
    let before = counter("FusedNormCast");
    let y = fp8_autocast(true, recipe(), || {
        debug_layer.forward(Tensor::<D, 3>::from_data(
            TensorData::new(x.clone(), [BATCH, SEQ, D_IN]),
            &Default::default(),
        ))
    })
    .unwrap();
    assert_eq!(
        counter("FusedNormCast") - before,
        0,
        "Debug<B>: FusedNormCast"
    );
    let y = y.into_data().into_vec::<f32>().expect("f32 data");
    assert_bits("Debug<B> y", &y, &apart);
}
