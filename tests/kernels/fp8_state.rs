//! One truth for FP8 state: under DelayedScaling, the GEMMs' outputs and what the debug tools report (logged
//! `scale_inv`, `underflows%`, dumped codes and `scale_inv`) follow an independent host re-computation of TE's
//! rule at every iteration, on every backend stack; frozen layers; checkpoints; two models in one thread; autocast
//! guards dropped out of order.

use std::path::Path;

use burn::module::{Module, Param};
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn_te::Gemm;
use burn_te::backends::Wgpu;
use burn_te::nn::{Linear, LinearConfig};
use burn_te::{
    AmaxComputeAlgo, DelayedScaling, Fp8Format, PlainLinearStates, Te, TeBackend, TensorRole,
    fp8_autocast, fp8_autocast_with,
};
use burn_te_debug::features::{
    DebugTensor, Feature, Inspection, Namespace, Routing, register_feature,
};
use burn_te_debug::{Debug, DebugError, DebugOptions, TensorName};

use crate::common::Rng;
use crate::debug::{Collect, SESSION, f32s, main_log, read_safetensors, start_session, temp_dir};
use crate::te::{device, tensor, values};

pub(crate) const TOKENS: usize = 24;
pub(crate) const D_IN: usize = 32;
pub(crate) const D_OUT: usize = 16;
const ITERATIONS: usize = 5;
const ROLES: [TensorRole; 3] = [
    TensorRole::Activation,
    TensorRole::Weight,
    TensorRole::Gradient,
];

/// The iterations' activations, weights and output gradients: amplitudes that rise and fall (so the `max` and
/// `most_recent` windows differ), with small gradients that underflow E5M2 at scale 1.
struct Data {
    x: Vec<Vec<f32>>,
    w: Vec<Vec<f32>>,
    g: Vec<Vec<f32>>,
}

impl Data {
    fn new(seed: u64) -> Self {
        let amplitude = [1.0, 4.0, 0.5, 2.0, 0.25];
        let make = |role: u64, len: usize, base: f64| {
            (0..ITERATIONS)
                .map(|n| {
                    Rng::new(seed + 10 * role + n as u64).normal(len, 0.0, base * amplitude[n])
                })
                .collect()
        };
        Data {
            x: make(0, TOKENS * D_IN, 1.0),
            w: make(1, D_IN * D_OUT, 0.1),
            g: make(2, TOKENS * D_OUT, 1e-5),
        }
    }

    fn of(&self, role: TensorRole) -> &[Vec<f32>] {
        match role {
            TensorRole::Activation => &self.x,
            TensorRole::Weight => &self.w,
            TensorRole::Gradient => &self.g,
        }
    }
}

pub(crate) fn amax(values: &[f32]) -> f32 {
    values.iter().fold(0f32, |a, v| a.max(v.abs()))
}

/// TE's delayed scale of `role` at iteration `n`, recomputed from the earlier iterations' amaxes independently of
/// the code under test: `(fp8_max / 2^margin) / amax(window before n)` in f32 (1 at n = 0; an amax of 0 keeps the
/// previous scale and stays out of the window), the window being the last `amax_history_len` nonzero amaxes
/// (`max`) or the newest (`most_recent`).
fn expected_scale(data: &Data, role: TensorRole, n: usize, recipe: &DelayedScaling) -> f32 {
    let amaxes: Vec<f32> = data.of(role).iter().map(|v| amax(v)).collect();
    delayed_scale(&amaxes, role, n, recipe)
}

/// TE's delayed scale of `role` at iteration `n` from the amaxes of iterations `0..n` (see [`expected_scale`]).
pub(crate) fn delayed_scale(
    amaxes: &[f32],
    role: TensorRole,
    n: usize,
    recipe: &DelayedScaling,
) -> f32 {
    let format = recipe.fp8_format.for_role(role);
    let mut scale = 1.0f32;
    // The amaxes the window took in: a 0 leaves window and scale as they were (TE's fused update).
    let mut taken = Vec::new();
    for &newest in &amaxes[..n] {
        if newest == 0.0 {
            continue;
        }
        taken.push(newest);
        let window = &taken[taken.len().saturating_sub(recipe.amax_history_len)..];
        let amax = match recipe.amax_compute_algo {
            AmaxComputeAlgo::Max => window.iter().fold(0f32, |a, &v| a.max(v)),
            AmaxComputeAlgo::MostRecent => window[window.len() - 1],
        };
        if amax > 0.0 {
            scale = (format.max() / 2f32.powf(recipe.margin)) / amax;
        }
    }
    scale
}

/// The codes and dequantized values of `values` at `scale` (the conformance-verified encoder).
pub(crate) fn quantized(values: &[f32], scale: f32, format: Fp8Format) -> (Vec<u8>, Vec<f32>) {
    let codes: Vec<u8> = values.iter().map(|v| format.encode(v * scale)).collect();
    let dequantized = codes.iter().map(|&c| format.decode(c) / scale).collect();
    (codes, dequantized)
}

/// `a [m, k] · b [k, n]` in f64 with each output's Σ|terms| (for an accumulation-order tolerance).
pub(crate) fn matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<(f64, f64)> {
    let mut out = vec![(0.0, 0.0); m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                let term = a[i * k + p] as f64 * b[p * n + j] as f64;
                out[i * n + j].0 += term;
                out[i * n + j].1 += term.abs();
            }
        }
    }
    out
}

pub(crate) fn transpose(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols * rows)
        .map(|i| a[(i % rows) * cols + i / rows])
        .collect()
}

/// `actual` equals the f64 reference up to f32 accumulation order.
pub(crate) fn assert_gemm(what: &str, actual: &[f32], expected: &[(f64, f64)]) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    for (i, (a, (e, magnitude))) in actual.iter().zip(expected).enumerate() {
        let tolerance = 1e-5 * magnitude + 1e-30;
        assert!(
            (*a as f64 - e).abs() <= tolerance,
            "{what}[{i}]: {a} vs {e} (±{tolerance})"
        );
    }
}

/// The dequantized operands of iteration `n` as the GEMMs must use them: every use of a tensor in the iteration
/// (fprop, dgrad, wgrad) with the scale from the history before `n`.
fn dequantized_operands(data: &Data, n: usize, recipe: &DelayedScaling) -> [Vec<f32>; 3] {
    ROLES.map(|role| {
        let scale = expected_scale(data, role, n, recipe);
        quantized(&data.of(role)[n], scale, recipe.fp8_format.for_role(role)).1
    })
}

fn layer<B: TeBackend>(device: &B::Device) -> Linear<B> {
    LinearConfig::new(D_IN, D_OUT)
        .with_bias(false)
        .with_name(Some("fc".into()))
        .init(device)
}

/// One training iteration on an autodiff stack: fprop in a DelayedScaling scope, backward of `sum(y ⊙ g)` (so the
/// output gradient is exactly `g`). Returns `(y, dx, dw)` (dw `None` for a frozen weight).
fn train_iteration<B: AutodiffBackend + TeBackend>(
    layer: &Linear<B>,
    data: &Data,
    n: usize,
    recipe: &DelayedScaling,
    device: &B::Device,
) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    let x = tensor::<B, 2>(data.x[n].clone(), [TOKENS, D_IN], device).require_grad();
    let y = fp8_autocast(true, recipe.clone(), || layer.forward(x.clone())).unwrap();
    let g = tensor::<B, 2>(data.g[n].clone(), [TOKENS, D_OUT], device);
    let grads = (y.clone() * g).sum().backward();
    let dw = layer.weight.val().grad(&grads).map(values);
    (values(y), values(x.grad(&grads).unwrap()), dw)
}

/// Checks the three GEMMs of iteration `n` against the host re-computation.
fn check_gemms(
    what: &str,
    data: &Data,
    n: usize,
    recipe: &DelayedScaling,
    (y, dx, dw): &(Vec<f32>, Vec<f32>, Option<Vec<f32>>),
) {
    let operands = dequantized_operands(data, n, recipe);
    assert_linear_gemms(&format!("{what} it {n}"), &operands, y, dx, dw.as_deref());
}

/// A `[TOKENS, D_IN] · [D_IN, D_OUT]` linear's fprop `y = x·w`, dgrad `dx = g·wᵀ` and wgrad `dw = xᵀ·g` (if any)
/// against the f64 products of the operands `[x, w, g]` as the GEMMs must use them.
pub(crate) fn assert_linear_gemms(
    what: &str,
    [x, w, g]: &[Vec<f32>; 3],
    y: &[f32],
    dx: &[f32],
    dw: Option<&[f32]>,
) {
    assert_gemm(
        &format!("{what} fprop"),
        y,
        &matmul(x, w, TOKENS, D_IN, D_OUT),
    );
    let wt = transpose(w, D_IN, D_OUT);
    assert_gemm(
        &format!("{what} dgrad"),
        dx,
        &matmul(g, &wt, TOKENS, D_OUT, D_IN),
    );
    if let Some(dw) = dw {
        let xt = transpose(x, TOKENS, D_IN);
        assert_gemm(
            &format!("{what} wgrad"),
            dw,
            &matmul(&xt, g, D_IN, TOKENS, D_OUT),
        );
    }
}

fn set_weight<B: TeBackend>(layer: &mut Linear<B>, data: &Data, n: usize, device: &B::Device) {
    let weight = tensor::<B, 2>(data.w[n].clone(), [D_IN, D_OUT], device);
    layer.weight = Param::from_tensor(weight);
}

const CONFIG: &str = r#"fp8_state:
  enabled: True
  layers:
    layer_name_regex_pattern: '^fc$'
  transformer_engine:
    LogFp8TensorStats:
      enabled: True
      stats: [underflows%, scale_inv_min, scale_inv_max]
      tensors: [activation, weight, gradient]
    DumpTensors:
      enabled: True
      tensors_struct:
        - tensor: activation
          quantized_tensor: True
          amax_history: True
        - tensor: weight
          quantized_tensor: True
          amax_history: True
        - tensor: gradient
          quantized_tensor: True
          amax_history: True
"#;

/// What the debug tools reported for `roles` at every iteration equals the host re-computation: `scale_inv_min`
/// and `scale_inv_max` bit for bit, `underflows%` exactly, the dumps' codes and `scale_inv` bit for bit.
fn check_reports(
    what: &str,
    dir: &Path,
    collect: &Collect,
    data: &Data,
    recipe: &DelayedScaling,
    roles: &[TensorRole],
) {
    let logged = collect.0.lock().unwrap().clone();
    let get = |name: &str, it: usize| {
        logged
            .iter()
            .find(|(i, v)| *i == it as u64 && v.name == name)
            .map(|(_, v)| v.value)
            .unwrap_or_else(|| panic!("{what}: {name} at {it} not logged"))
    };
    for n in 0..ITERATIONS {
        for &role in roles {
            let format = recipe.fp8_format.for_role(role);
            let scale = expected_scale(data, role, n, recipe);
            let values = &data.of(role)[n];
            let (codes, _) = quantized(values, scale, format);
            let scale_inv = 1.0 / scale;
            let name = role.name();
            for stat in ["scale_inv_min", "scale_inv_max"] {
                let logged = get(&format!("fc_{name}_{stat}"), n) as f32;
                assert_eq!(
                    logged.to_bits(),
                    scale_inv.to_bits(),
                    "{what} it {n} {name} {stat}: {logged} vs {scale_inv}"
                );
            }
            let underflows = values
                .iter()
                .zip(&codes)
                .filter(|(v, c)| **v != 0.0 && **c & 0x7f == 0)
                .count();
            let expected = 100.0 * underflows as f64 / values.len() as f64;
            let logged = get(&format!("fc_{name}_underflows%"), n);
            assert!(
                (logged - expected).abs() < 1e-9,
                "{what} it {n} {name} underflows%: {logged} vs {expected}"
            );
            let file = dir.join(format!(
                "tensor_dumps/rank_0/iter_{n:06}/fc_{name}.safetensors"
            ));
            let (dump, meta) = read_safetensors(&file);
            assert_eq!(
                dump["quantized"].2, codes,
                "{what} it {n} {name}: dumped codes"
            );
            assert_eq!(
                f32s(&dump["scale_inv"].2)[0].to_bits(),
                scale_inv.to_bits(),
                "{what} it {n} {name}: dumped scale_inv"
            );
            assert_eq!(meta["fp8_format"], format.name(), "{what}");
            // The layer's delayed-scaling state for this tensor: the scale the GEMM quantized with, and the history
            // behind it in TE's layout (slot 0 this iteration's amax once a GEMM of it has recorded it, 0 before;
            // slot len − k the amax of k iterations ago).
            assert_eq!(
                f32s(&dump["scale"].2)[0].to_bits(),
                scale.to_bits(),
                "{what} it {n} {name}: dumped scale"
            );
            let history = f32s(&dump["amax_history"].2);
            assert_eq!(
                history.len(),
                recipe.amax_history_len,
                "{what} it {n} {name}"
            );
            let amaxes: Vec<f32> = data.of(role).iter().map(|v| amax(v)).collect();
            assert!(
                history[0] == 0.0 || history[0] == amaxes[n],
                "{what} it {n} {name}: newest slot {}",
                history[0]
            );
            let len = history.len();
            for (slot, &h) in history.iter().enumerate().skip(1) {
                let ago = len - slot;
                let want = if ago <= n { amaxes[n - ago] } else { 0.0 };
                assert_eq!(
                    h.to_bits(),
                    want.to_bits(),
                    "{what} it {n} {name}: amax_history[{slot}] ({ago} iterations ago)"
                );
            }
        }
    }
}

fn recipes() -> [DelayedScaling; 3] {
    [
        DelayedScaling::default(),
        DelayedScaling {
            margin: 1.0,
            amax_compute_algo: AmaxComputeAlgo::MostRecent,
            ..DelayedScaling::default()
        },
        // A window of two iterations: the amax of iteration 1 (the largest) leaves it at iteration 4.
        DelayedScaling {
            amax_history_len: 2,
            ..DelayedScaling::default()
        },
    ]
}

/// Five DelayedScaling iterations under `Autodiff<Debug<Te<B>>>` with the debug tools on: every GEMM's output
/// and every report follow the host re-computation.
fn debug_autodiff_stack<S: AutodiffBackend + TeBackend>(
    what: &str,
    device: &S::Device,
    recipe: &DelayedScaling,
) {
    let (dir, collect) = start_session(&format!("fp8-state-{what}"), CONFIG);
    let data = Data::new(1);
    let mut fc = layer::<S>(device);
    for n in 0..ITERATIONS {
        set_weight(&mut fc, &data, n, device);
        let out = train_iteration(&fc, &data, n, recipe, device);
        check_gemms(what, &data, n, recipe, &out);
        burn_te_debug::step().unwrap();
    }
    burn_te_debug::end().unwrap();
    check_reports(what, &dir, &collect, &data, recipe, &ROLES);
}

#[test]
fn debug_tools_report_the_scales_codes_and_counts_the_gemms_used() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let device = device();
    for (i, recipe) in recipes().iter().enumerate() {
        debug_autodiff_stack::<burn::backend::Autodiff<Debug<Te<Wgpu>>>>(
            &format!("wgpu-{i}"),
            &device,
            recipe,
        );
    }
    // Burn's fused wgpu backend (`burn::backend::Wgpu` with the `fusion` feature).
    debug_autodiff_stack::<burn::backend::Autodiff<Debug<Te<burn::backend::Wgpu>>>>(
        "wgpu-fusion",
        &device,
        &recipes()[0],
    );
    // The host path, with the sliding window.
    debug_autodiff_stack::<burn::backend::Autodiff<Debug<Te<burn::backend::NdArray>>>>(
        "ndarray",
        &Default::default(),
        &recipes()[2],
    );
    debug_autodiff_stack::<burn::backend::Autodiff<Debug<Te<burn::backend::Flex>>>>(
        "flex",
        &Default::default(),
        &recipes()[1],
    );

    // Without autodiff: forward only, activation and weight.
    let recipe = &recipes()[1];
    let (dir, collect) = start_session("fp8-state-forward", CONFIG);
    let data = Data::new(1);
    let mut fc = layer::<Debug<Te<Wgpu>>>(&device);
    for n in 0..ITERATIONS {
        set_weight(&mut fc, &data, n, &device);
        let x = tensor::<Debug<Te<Wgpu>>, 2>(data.x[n].clone(), [TOKENS, D_IN], &device);
        let y = fp8_autocast(true, recipe.clone(), || fc.forward(x)).unwrap();
        let [x, w, _] = dequantized_operands(&data, n, recipe);
        assert_gemm(
            &format!("forward it {n}"),
            &values(y),
            &matmul(&x, &w, TOKENS, D_IN, D_OUT),
        );
        burn_te_debug::step().unwrap();
    }
    burn_te_debug::end().unwrap();
    check_reports(
        "forward",
        &dir,
        &collect,
        &data,
        recipe,
        &[TensorRole::Activation, TensorRole::Weight],
    );
}

#[test]
fn te_stack_gemms_follow_the_delayed_scales_and_frozen_weights_update_the_gradient_history() {
    let device = device();
    let data = Data::new(2);
    for recipe in recipes() {
        for frozen in [false, true] {
            let mut fc = layer::<burn::backend::Autodiff<Te<Wgpu>>>(&device);
            for n in 0..ITERATIONS {
                set_weight(&mut fc, &data, n, &device);
                if frozen {
                    fc = fc.no_grad();
                }
                let out = train_iteration(&fc, &data, n, &recipe, &device);
                assert_eq!(out.2.is_none(), frozen);
                // dgrad's gradient scale comes from the gradient amaxes of the earlier iterations, which only
                // dgrad records when the weight is frozen.
                check_gemms(&format!("frozen={frozen}"), &data, n, &recipe, &out);
            }
            // The state the next iteration would use.
            for role in ROLES {
                let view = fc
                    .fp8_meta
                    .read(role, &recipe, recipe.fp8_format.for_role(role))
                    .unwrap()
                    .unwrap();
                let expected = expected_scale(&data, role, ITERATIONS, &recipe);
                assert_eq!(
                    view.scale.to_bits(),
                    expected.to_bits(),
                    "frozen={frozen} {role:?}"
                );
            }
        }
    }
}

/// A layer trained for iterations 0–2 under delayed scaling with a 4-long history, and the recipe.
fn trained_three_iterations<B: AutodiffBackend + TeBackend>(
    data: &Data,
    device: &B::Device,
) -> (Linear<B>, DelayedScaling) {
    let recipe = DelayedScaling {
        amax_history_len: 4,
        ..DelayedScaling::default()
    };
    let mut fc = layer::<B>(device);
    for n in 0..3 {
        set_weight(&mut fc, data, n, device);
        train_iteration(&fc, data, n, &recipe, device);
    }
    (fc, recipe)
}

#[test]
fn fp8_state_is_saved_and_restored_with_the_model_record() {
    type B = burn::backend::Autodiff<Te<Wgpu>>;
    let device = device();
    let data = Data::new(3);
    let (fc, recipe) = trained_three_iterations::<B>(&data, &device);
    let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
    let bytes = recorder.record(fc.clone().into_record(), ()).unwrap();

    // A fresh process would start here: a new model, its record loaded.
    let restored = layer::<B>(&device).load_record(recorder.load(bytes, &device).unwrap());
    assert_ne!(
        restored.fp8_meta.state(),
        fc.fp8_meta.state(),
        "the loaded state is its own"
    );
    for role in ROLES {
        let format = recipe.fp8_format.for_role(role);
        assert_eq!(
            restored.fp8_meta.read(role, &recipe, format).unwrap(),
            fc.fp8_meta.read(role, &recipe, format).unwrap(),
            "{role:?}"
        );
    }
    // Step 4 (and 5): bit-identical outputs and gradients, and they follow the host re-computation.
    let (mut a, mut b) = (fc, restored);
    for n in 3..ITERATIONS {
        set_weight(&mut a, &data, n, &device);
        set_weight(&mut b, &data, n, &device);
        let out_a = train_iteration(&a, &data, n, &recipe, &device);
        let out_b = train_iteration(&b, &data, n, &recipe, &device);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out_a.0), bits(&out_b.0), "it {n} y");
        assert_eq!(bits(&out_a.1), bits(&out_b.1), "it {n} dx");
        assert_eq!(
            bits(out_a.2.as_ref().unwrap()),
            bits(out_b.2.as_ref().unwrap()),
            "it {n} dw"
        );
        check_gemms("restored", &data, n, &recipe, &out_b);
    }
}

/// A forked replica (burn-train's multi-device learners fork one per device) has its own FP8 state: equal to the
/// model's at the fork, then each evolves with its own iterations only. The model trained after its replica ran
/// an iteration still follows the host re-computation of its own history (a shared state would have rolled twice),
/// and both give the same bits for the same iteration.
#[test]
fn a_forked_replica_keeps_its_own_fp8_state() {
    type B = burn::backend::Autodiff<Te<burn::backend::NdArray>>;
    let device = Default::default();
    let data = Data::new(6);
    let (mut fc, recipe) = trained_three_iterations::<B>(&data, &device);
    let mut replica = fc.clone().fork(&device);
    assert_ne!(
        replica.fp8_meta.state(),
        fc.fp8_meta.state(),
        "its own state"
    );
    let read = |fc: &Linear<B>| {
        ROLES.map(|role| {
            let format = recipe.fp8_format.for_role(role);
            fc.fp8_meta.read(role, &recipe, format).unwrap()
        })
    };
    let at_fork = read(&fc);
    assert_eq!(read(&replica), at_fork, "equal at the fork");
    set_weight(&mut replica, &data, 3, &device);
    let out_replica = train_iteration(&replica, &data, 3, &recipe, &device);
    assert_eq!(
        read(&fc),
        at_fork,
        "the replica's iteration leaves the model's state"
    );
    assert_ne!(read(&replica), at_fork, "the replica's state rolled");
    set_weight(&mut fc, &data, 3, &device);
    let out = train_iteration(&fc, &data, 3, &recipe, &device);
    check_gemms(
        "model after its replica's iteration",
        &data,
        3,
        &recipe,
        &out,
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&out.0), bits(&out_replica.0), "y");
    assert_eq!(
        read(&fc),
        read(&replica),
        "the same history after the same iteration"
    );
}

#[test]
fn two_models_in_one_thread_keep_their_own_histories() {
    type B = Te<Wgpu>;
    let device = device();
    let recipe = DelayedScaling::default();
    // Teacher and student: same layer name, different data.
    let (teacher_data, student_data) = (Data::new(4), Data::new(5));
    let (mut teacher, mut student) = (layer::<B>(&device), layer::<B>(&device));
    for n in 0..3 {
        for (fc, data) in [(&mut teacher, &teacher_data), (&mut student, &student_data)] {
            set_weight(fc, data, n, &device);
            let x = tensor::<B, 2>(data.x[n].clone(), [TOKENS, D_IN], &device);
            let y = fp8_autocast(true, recipe.clone(), || fc.forward(x)).unwrap();
            let [x, w, _] = dequantized_operands(data, n, &recipe);
            assert_gemm(
                &format!("model it {n}"),
                &values(y),
                &matmul(&x, &w, TOKENS, D_IN, D_OUT),
            );
        }
    }
    // Plain Burn linears: one PlainLinearStates per model.
    let (a, b) = (PlainLinearStates::new(), PlainLinearStates::new());
    let w = tensor::<B, 2>(vec![0.5; 4 * 2], [4, 2], &device);
    for (states, amplitude) in [(&a, 2.0f32), (&b, 8.0)] {
        let x = tensor::<B, 2>(vec![amplitude; 3 * 4], [3, 4], &device);
        fp8_autocast_with(states, true, recipe.clone(), || {
            burn::tensor::module::linear(x, w.clone(), None)
        })
        .unwrap();
    }
    for (states, amplitude) in [(&a, 2.0f32), (&b, 8.0)] {
        let view = states
            .layer("linear0")
            .read(TensorRole::Activation, &recipe, Fp8Format::E4M3)
            .unwrap()
            .unwrap();
        assert_eq!(view.scale, 448.0 / amplitude);
    }
}

#[test]
fn autocast_guards_dropped_out_of_order_end_their_own_scopes() {
    let outer = burn_te::fp8_autocast_guard(true, DelayedScaling::default()).unwrap();
    let inner =
        burn_te::fp8_autocast_guard(true, burn_te::Float8CurrentScaling::default()).unwrap();
    assert_eq!(
        burn_te::active_recipe().unwrap().name(),
        "fp8_current_scaling"
    );
    drop(outer);
    // The inner scope is still the one in force.
    assert_eq!(
        burn_te::active_recipe().unwrap().name(),
        "fp8_current_scaling"
    );
    drop(inner);
    assert!(burn_te::active_recipe().is_none());
}

#[test]
fn a_fallback_to_high_precision_is_counted_and_written_to_the_main_log() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    type D = Debug<Te<Wgpu>>;
    let device = device();
    let dir = temp_dir("fp8-state-fallback");
    burn_te_debug::initialize(DebugOptions::without_config().log_dir(&dir)).unwrap();
    // A batch broadcast the FP8 GEMM does not take ([2, 3] against [2, 1]); Burn's matmul does.
    let lhs = Rng::new(7).normal(2 * 3 * 4 * 8, 0.0, 1.0);
    let rhs = Rng::new(8).normal(2 * 8 * 5, 0.0, 1.0);
    let before = burn_te::fallback_counts()
        .get("shape")
        .copied()
        .unwrap_or(0);
    let y = fp8_autocast(true, DelayedScaling::default(), || {
        tensor::<D, 4>(lhs.clone(), [2, 3, 4, 8], &device).matmul(tensor::<D, 4>(
            rhs.clone(),
            [2, 1, 8, 5],
            &device,
        ))
    })
    .unwrap();
    let after = burn_te::fallback_counts()
        .get("shape")
        .copied()
        .unwrap_or(0);
    assert!(after > before, "counted: {before} -> {after}");
    // It ran in high precision: bit for bit Burn's matmul.
    let reference = tensor::<Wgpu, 4>(lhs, [2, 3, 4, 8], &device).matmul(tensor::<Wgpu, 4>(
        rhs,
        [2, 1, 8, 5],
        &device,
    ));
    assert_eq!(values(y), values(reference));
    burn_te_debug::step().unwrap();
    burn_te_debug::end().unwrap();
    let main = main_log(&dir);
    assert!(
        main.contains("matmul: FP8 GEMM not possible, ran in high precision"),
        "{main}"
    );
}

/// What `RecordPostquantize` saw: (iteration, layer, gemm, tensor, values).
type Postquantized = Vec<(u64, String, Gemm, TensorName, Vec<f32>)>;
static POSTQUANTIZED: std::sync::Mutex<Postquantized> = std::sync::Mutex::new(Vec::new());

/// A custom feature on TE's per-GEMM `inspect_tensor_postquantize` call: records what it is given.
struct RecordPostquantize;
impl Feature for RecordPostquantize {
    fn name(&self) -> &str {
        "RecordPostquantize"
    }
    fn inspect_tensor_postquantize_enabled(
        &self,
        _: &str,
        _: Gemm,
        _: TensorName,
        _: u64,
    ) -> Option<Routing> {
        Some(Routing {
            enabled: true,
            next: None,
        })
    }
    fn inspect_tensor_postquantize(
        &self,
        layer: &str,
        gemm: Gemm,
        tensor: TensorName,
        x: &dyn DebugTensor,
        iteration: u64,
        _: &mut Inspection,
    ) -> Result<(), DebugError> {
        let values = x.to_vec()?;
        POSTQUANTIZED
            .lock()
            .unwrap()
            .push((iteration, layer.to_string(), gemm, tensor, values));
        Ok(())
    }
}

const POSTQUANTIZE_CONFIG: &str = r#"postquantize:
  enabled: True
  layers:
    layer_name_regex_pattern: '^fc$'
  transformer_engine:
    RecordPostquantize:
      enabled: True
    DisableFP8GEMM:
      enabled: True
      gemms: [wgrad]
"#;

/// `inspect_tensor_postquantize` is given, at every GEMM, the operand exactly as that GEMM multiplies it: the
/// values of the codes at the delayed scale recomputed on the host (`decode(code) · scale_inv`, bit for bit), for
/// the weight at fprop and at dgrad alike; a GEMM in high precision (wgrad, disabled here) is not called (TE).
fn postquantize_sees_the_gemms_operands<S: AutodiffBackend + TeBackend>(
    what: &str,
    device: &S::Device,
) {
    static REGISTER: std::sync::Once = std::sync::Once::new();
    REGISTER.call_once(|| {
        register_feature(Namespace::TransformerEngine, "RecordPostquantize", |_| {
            Ok(Box::new(RecordPostquantize))
        })
        .unwrap();
    });
    POSTQUANTIZED.lock().unwrap().clear();
    start_session(&format!("postquantize-{what}"), POSTQUANTIZE_CONFIG);
    let recipe = DelayedScaling::default();
    let data = Data::new(3);
    let mut fc = layer::<S>(device);
    for n in 0..ITERATIONS {
        set_weight(&mut fc, &data, n, device);
        train_iteration(&fc, &data, n, &recipe, device);
        burn_te_debug::step().unwrap();
    }
    burn_te_debug::end().unwrap();
    let seen = POSTQUANTIZED.lock().unwrap().clone();
    let operands = [
        (Gemm::Fprop, TensorRole::Activation),
        (Gemm::Fprop, TensorRole::Weight),
        (Gemm::Dgrad, TensorRole::Gradient),
        (Gemm::Dgrad, TensorRole::Weight),
    ];
    assert_eq!(seen.len(), ITERATIONS * operands.len(), "{what}: calls");
    for n in 0..ITERATIONS {
        for (gemm, role) in operands {
            let tensor = TensorName::from(role);
            let calls: Vec<_> = seen
                .iter()
                .filter(|(i, layer, g, t, _)| {
                    *i == n as u64 && layer == "fc" && *g == gemm && *t == tensor
                })
                .collect();
            assert_eq!(calls.len(), 1, "{what} it {n} {gemm:?} {tensor}: calls");
            let format = recipe.fp8_format.for_role(role);
            let scale = expected_scale(&data, role, n, &recipe);
            let (codes, _) = quantized(&data.of(role)[n], scale, format);
            let expected: Vec<u32> = codes
                .iter()
                .map(|&c| (format.decode(c) * (1.0 / scale)).to_bits())
                .collect();
            let actual: Vec<u32> = calls[0].4.iter().map(|v| v.to_bits()).collect();
            assert_eq!(actual, expected, "{what} it {n} {gemm:?} {tensor}");
        }
    }
}

#[test]
fn inspect_tensor_postquantize_sees_what_each_gemm_multiplies() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    postquantize_sees_the_gemms_operands::<burn::backend::Autodiff<Debug<Te<Wgpu>>>>(
        "wgpu",
        &device(),
    );
    postquantize_sees_the_gemms_operands::<
        burn::backend::Autodiff<Debug<Te<burn::backend::NdArray>>>,
    >("ndarray", &Default::default());
}
