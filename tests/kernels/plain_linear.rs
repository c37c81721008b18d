//! Plain `burn::nn::Linear` layers keep their identity from forward to backward in a branching graph: a layer used
//! twice, two layers fed the same input, a frozen layer, an input without a gradient. The reference is the same
//! graph built from TE modules, whose GEMM sites travel with Burn's autograd node: outputs, gradients and the
//! delayed-scaling states must be bit-identical at every iteration.

use burn::module::Param;
use burn::nn::LinearConfig as PlainConfig;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_te::backends::Wgpu;
use burn_te::nn::LinearConfig;
use burn_te::{
    DelayedScaling, Fp8Format, LayerFp8State, PlainLinearStates, Te, TeBackend, TensorRole,
    fp8_autocast, fp8_autocast_with,
};
use burn_te_debug::Debug;

use crate::common::Rng;
use crate::te::{device, tensor, values};

const TOKENS: usize = 12;
const D: usize = 16;
const ITERATIONS: usize = 4;

/// The weights of `a`, `b`, `c` (magnitudes apart, so a GEMM matched to the wrong layer quantizes with another
/// scale) and the iterations' inputs and loss weights.
struct Data {
    weights: [Vec<f32>; 3],
    x: Vec<Vec<f32>>,
    r: Vec<Vec<f32>>,
}

impl Data {
    fn new() -> Data {
        let weights = [(1, 1.0), (2, 0.05), (3, 3.0)]
            .map(|(seed, std)| Rng::new(seed).normal(D * D, 0.0, std));
        let amplitude = [1.0, 8.0, 0.25, 2.0];
        let per_iteration = |seed: u64, std: f64| {
            (0..ITERATIONS)
                .map(|n| Rng::new(seed + n as u64).normal(TOKENS * D, 0.0, std * amplitude[n]))
                .collect()
        };
        Data {
            weights,
            x: per_iteration(10, 1.0),
            r: per_iteration(20, 0.01),
        }
    }
}

/// `z = b(2·b(h) + c(h))` with `h = a(x)`: `b` used twice, `b` and `c` fed the same `h` with different gradients,
/// `c` frozen (no wgrad), `x` without a gradient (no dgrad for `a`). Returns `z` and the gradients.
fn run<B: AutodiffBackend>(
    linear: &dyn Fn(usize, Tensor<B, 2>) -> Tensor<B, 2>,
    data: &Data,
    n: usize,
    device: &B::Device,
) -> (Vec<f32>, B::Gradients) {
    let x = tensor::<B, 2>(data.x[n].clone(), [TOKENS, D], device);
    let h = linear(0, x);
    let y = linear(1, h.clone()).mul_scalar(2.0) + linear(2, h);
    let z = linear(1, y);
    let r = tensor::<B, 2>(data.r[n].clone(), [TOKENS, D], device);
    let grads = (z.clone() * r).sum().backward();
    (values(z), grads)
}

/// Layer `i`'s weight as a parameter: `c` (i = 2) frozen.
fn weight<B: AutodiffBackend>(data: &Data, i: usize, device: &B::Device) -> Param<Tensor<B, 2>> {
    let w = tensor::<B, 2>(data.weights[i].clone(), [D, D], device);
    Param::from_tensor(w).set_require_grad(i != 2)
}

/// The gradients of the trainable weights `a` and `b`.
fn weight_grads<B: AutodiffBackend>(
    weights: [&Param<Tensor<B, 2>>; 2],
    grads: &B::Gradients,
) -> Vec<Vec<f32>> {
    weights
        .iter()
        .map(|w| values(w.val().grad(grads).expect("a trainable weight")))
        .collect()
}

/// Every role's history and scale, bit for bit.
fn state_bits(state: &LayerFp8State, recipe: &DelayedScaling) -> Vec<u32> {
    [
        TensorRole::Activation,
        TensorRole::Weight,
        TensorRole::Gradient,
    ]
    .into_iter()
    .flat_map(|role| {
        let format = recipe.fp8_format.for_role(role);
        let view = state
            .read(role, recipe, format)
            .unwrap()
            .expect("state used");
        let mut bits: Vec<u32> = view.history.iter().map(|v| v.to_bits()).collect();
        bits.push(view.scale.to_bits());
        bits
    })
    .collect()
}

/// Three plain Burn linears (no bias) with `weight(i)`, and the reference: TE modules with the same weights, named
/// as the plain linears are (by weight, in first-call order: `linear0`, ...).
#[allow(clippy::type_complexity)]
fn both_linears<B: AutodiffBackend + TeBackend>(
    weight: impl Fn(usize) -> Param<Tensor<B, 2>>,
    device: &B::Device,
) -> (Vec<burn::nn::Linear<B>>, Vec<burn_te::nn::Linear<B>>) {
    let plain = (0..3)
        .map(|i| {
            let mut layer = PlainConfig::new(D, D).with_bias(false).init::<B>(device);
            layer.weight = weight(i);
            layer
        })
        .collect();
    let te = (0..3)
        .map(|i| {
            let mut layer = LinearConfig::new(D, D)
                .with_bias(false)
                .with_name(Some(format!("linear{i}")))
                .init::<B>(device);
            layer.weight = weight(i);
            layer
        })
        .collect();
    (plain, te)
}

fn branching_graph_matches_te_modules<B: AutodiffBackend + TeBackend>(
    what: &str,
    device: &B::Device,
) {
    let data = Data::new();
    let recipe = DelayedScaling::default();
    // Plain Burn linears, their states in one PlainLinearStates; the reference TE modules.
    let (plain, te) = both_linears::<B>(|i| weight(&data, i, device), device);
    let states = PlainLinearStates::new();
    for n in 0..ITERATIONS {
        let (plain_z, plain_grads) = fp8_autocast_with(&states, true, recipe.clone(), || {
            run::<B>(&|i, x| plain[i].forward(x), &data, n, device)
        })
        .unwrap();
        let (te_z, te_grads) = fp8_autocast(true, recipe.clone(), || {
            run::<B>(&|i, x| te[i].forward(x), &data, n, device)
        })
        .unwrap();
        let mut plain_out = vec![plain_z];
        plain_out.extend(weight_grads::<B>(
            [&plain[0].weight, &plain[1].weight],
            &plain_grads,
        ));
        let mut te_out = vec![te_z];
        te_out.extend(weight_grads::<B>([&te[0].weight, &te[1].weight], &te_grads));
        for (k, name) in ["z", "da", "db"].iter().enumerate() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&plain_out[k]),
                bits(&te_out[k]),
                "{what} it {n}: {name} of the plain linears differs from the TE modules'"
            );
        }
        let mut names = states.names();
        names.sort();
        assert_eq!(
            names,
            ["linear0", "linear1", "linear2"],
            "{what}: one state per weight"
        );
        for (i, layer) in te.iter().enumerate() {
            assert_eq!(
                state_bits(&states.layer(&format!("linear{i}")), &recipe),
                state_bits(layer.fp8_meta.state(), &recipe),
                "{what} it {n}: linear{i}'s FP8 state"
            );
        }
    }
    // The FP8 path ran (the states hold real scales, not the initial 1).
    let view = states
        .layer("linear2")
        .read(TensorRole::Gradient, &recipe, Fp8Format::E5M2)
        .unwrap()
        .unwrap();
    assert_ne!(
        view.scale, 1.0,
        "{what}: the frozen layer's gradient scale must update"
    );
}

#[test]
fn plain_linears_in_a_branching_graph_match_te_modules_wgpu() {
    branching_graph_matches_te_modules::<burn::backend::Autodiff<Te<Wgpu>>>("te<wgpu>", &device());
    branching_graph_matches_te_modules::<burn::backend::Autodiff<Debug<Te<Wgpu>>>>(
        "debug<te<wgpu>>",
        &device(),
    );
    // Burn's fused wgpu backend (`burn::backend::Wgpu` with the `fusion` feature).
    branching_graph_matches_te_modules::<burn::backend::Autodiff<Te<burn::backend::Wgpu>>>(
        "te<fusion<wgpu>>",
        &device(),
    );
}

#[test]
fn plain_linears_in_a_branching_graph_match_te_modules_host() {
    branching_graph_matches_te_modules::<burn::backend::Autodiff<Te<burn::backend::NdArray>>>(
        "te<ndarray>",
        &Default::default(),
    );
    branching_graph_matches_te_modules::<burn::backend::Autodiff<Te<burn::backend::Flex>>>(
        "te<flex>",
        &Default::default(),
    );
}

/// A plain linear run outside the scope after FP8 ones (a high-precision head, as TE advises) leaves their backward
/// GEMMs in FP8: `z = c(b(a(x)))` with `a`, `b` in the scope and `c` after it, and the backward after both. The
/// reference is the same graph of TE modules (`c` outside the scope: high precision); the output and every weight
/// gradient must be bit-identical at every iteration, and the plain layers' states the TE modules'.
fn a_head_outside_the_scope_leaves_the_body_fp8<B: AutodiffBackend + TeBackend>(
    what: &str,
    device: &B::Device,
) {
    let data = Data::new();
    let recipe = DelayedScaling::default();
    let trainable = |i: usize| weight::<B>(&data, i, device).set_require_grad(true);
    let (plain, te) = both_linears::<B>(trainable, device);
    let states = PlainLinearStates::new();
    for n in 0..ITERATIONS {
        let x = || tensor::<B, 2>(data.x[n].clone(), [TOKENS, D], device);
        let r = || tensor::<B, 2>(data.r[n].clone(), [TOKENS, D], device);
        let plain_h = fp8_autocast_with(&states, true, recipe.clone(), || {
            plain[1].forward(plain[0].forward(x()))
        })
        .unwrap();
        let plain_z = plain[2].forward(plain_h);
        let plain_grads = (plain_z.clone() * r()).sum().backward();
        let te_h =
            fp8_autocast(true, recipe.clone(), || te[1].forward(te[0].forward(x()))).unwrap();
        let te_z = te[2].forward(te_h);
        let te_grads = (te_z.clone() * r()).sum().backward();
        let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(values(plain_z)),
            bits(values(te_z)),
            "{what} it {n}: z"
        );
        for i in 0..3 {
            let grad = |w: &Param<Tensor<B, 2>>, grads| bits(values(w.val().grad(grads).unwrap()));
            assert_eq!(
                grad(&plain[i].weight, &plain_grads),
                grad(&te[i].weight, &te_grads),
                "{what} it {n}: the gradient of linear{i}'s weight"
            );
        }
        for (i, layer) in te.iter().enumerate().take(2) {
            assert_eq!(
                state_bits(&states.layer(&format!("linear{i}")), &recipe),
                state_bits(layer.fp8_meta.state(), &recipe),
                "{what} it {n}: linear{i}'s FP8 state"
            );
        }
    }
}

#[test]
fn a_plain_head_outside_the_scope_leaves_the_body_fp8() {
    a_head_outside_the_scope_leaves_the_body_fp8::<
        burn::backend::Autodiff<Te<burn::backend::NdArray>>,
    >("te<ndarray>", &Default::default());
    a_head_outside_the_scope_leaves_the_body_fp8::<burn::backend::Autodiff<Te<Wgpu>>>(
        "te<wgpu>",
        &device(),
    );
}

/// The identity the backward GEMMs match by: shared by clones, distinct for live tensors.
fn buffer_ids<B: TeBackend>(what: &str, device: &B::Device) {
    let a = tensor::<B, 2>(vec![1.0; 12], [3, 4], device);
    let b = tensor::<B, 2>(vec![1.0; 12], [3, 4], device);
    let id = |t: &Tensor<B, 2>| {
        let TensorPrimitive::Float(p) = t.clone().into_primitive() else {
            unreachable!("a float tensor")
        };
        B::buffer_id(&p)
    };
    let (ia, ib) = (id(&a), id(&b));
    assert!(ia.is_some(), "{what}: no buffer id");
    assert_eq!(ia, id(&a.clone()), "{what}: a clone has its tensor's id");
    assert_ne!(ia, ib, "{what}: two live tensors share an id");
}

#[test]
fn buffer_ids_follow_clones_and_tell_tensors_apart() {
    buffer_ids::<Wgpu>("wgpu", &device());
    buffer_ids::<burn::backend::NdArray>("ndarray", &Default::default());
    buffer_ids::<burn::backend::Flex>("flex", &Default::default());
    buffer_ids::<burn::backend::Wgpu>("fusion<wgpu>", &device());
    buffer_ids::<burn::backend::Autodiff<Te<Wgpu>>>("autodiff<te<wgpu>>", &device());
}

/// `burn_te::nn::Linear::from` a plain linear: the same parameters (ids and values); over iterations of evolving
/// delayed scales the same outputs and input, weight and bias gradients as the plain layer, bit for bit; and its
/// input and weight kept for the backward as FP8 (`tokens · in` and `in · out` codes, each with a 4-byte scale, per
/// step) where the plain layer's node keeps the f32 input (no FP8 bytes).
#[test]
fn a_plain_linear_converted_to_te_keeps_fp8_with_the_same_results() {
    use burn_te::diagnostics::thread_counter_value;
    type B = burn::backend::Autodiff<Te<burn::backend::Flex>>;
    let device = Default::default();
    let data = Data::new();
    let recipe = DelayedScaling::default();
    let plain = PlainConfig::new(D, D).init::<B>(&device);
    // Burn's parameters initialize lazily, and a clone of an uninitialized one draws its own values: read them
    // first, so the clone converted carries the same.
    let initial = (
        values(plain.weight.val()),
        values(plain.bias.as_ref().unwrap().val()),
    );
    let converted = burn_te::nn::Linear::from(plain.clone());
    assert_eq!(converted.weight.id, plain.weight.id);
    let (plain_bias, converted_bias) = (
        plain.bias.as_ref().unwrap(),
        converted.bias.as_ref().unwrap(),
    );
    assert_eq!(converted_bias.id, plain_bias.id);
    assert_eq!(values(converted.weight.val()), initial.0);
    assert_eq!(values(converted_bias.val()), initial.1);
    let states = PlainLinearStates::new();
    let kept = || thread_counter_value("KeptForBackwardFp8Bytes").unwrap_or(0);
    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for n in 0..ITERATIONS {
        let x = tensor::<B, 2>(data.x[n].clone(), [TOKENS, D], &device).require_grad();
        let r = tensor::<B, 2>(data.r[n].clone(), [TOKENS, D], &device);
        // Output, then the gradients of x, the weight and the bias.
        let step = |forward: &dyn Fn(Tensor<B, 2>) -> Tensor<B, 2>,
                    weight: &Param<Tensor<B, 2>>,
                    bias: &Param<Tensor<B, 1>>| {
            let z = forward(x.clone());
            let grads = (z.clone() * r.clone()).sum().backward();
            [
                values(z),
                values(x.grad(&grads).unwrap()),
                values(weight.val().grad(&grads).unwrap()),
                values(bias.val().grad(&grads).unwrap()),
            ]
        };
        let before = kept();
        let from_plain = fp8_autocast_with(&states, true, recipe.clone(), || {
            step(&|x| plain.forward(x), &plain.weight, plain_bias)
        })
        .unwrap();
        assert_eq!(
            kept(),
            before,
            "it {n}: the plain linear keeps no FP8 input"
        );
        let from_converted = fp8_autocast(true, recipe.clone(), || {
            step(&|x| converted.forward(x), &converted.weight, converted_bias)
        })
        .unwrap();
        assert_eq!(
            kept() - before,
            ((TOKENS * D + 4) + (D * D + 4)) as u64,
            "it {n}: the converted linear keeps its input and weight as FP8 codes and a scale each"
        );
        for (k, name) in ["z", "dx", "dw", "db"].iter().enumerate() {
            assert_eq!(
                bits(from_plain[k].clone()),
                bits(from_converted[k].clone()),
                "it {n}: {name} of the converted linear differs from the plain one's"
            );
        }
    }
}
