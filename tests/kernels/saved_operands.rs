//! What a linear layer's backward keeps (`burn_te::gemm::saved`): under every recipe, a TransformerLayer trained with
//! its operands kept in FP8 by the forward gives the same losses, every parameter gradient and the same parameters,
//! bit for bit, as with the high-precision operands kept and quantized again in the backward (the behaviour
//! before, still there under `save_original_operands`) — on `Te`, on the debug tools' stack (with a feature that
//! makes one GEMM need its original operand) and under Burn's balanced checkpointing. The bytes kept are counted
//! against the layer's shapes: one per input and weight element plus one scale per tensor.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_te::backends::Wgpu;
use burn_te::diagnostics::{names, thread_counter_value};
use burn_te::nn::{TransformerLayer, TransformerLayerConfig, infer_layer_names};
use burn_te::{
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling,
    Recipe, Te, TeBackend, fp8_autocast, save_original_operands,
};
use burn_te_debug::{Debug, DebugOptions};

use crate::common::Rng;
use crate::te::{device, tensor, values};

const HIDDEN: usize = 64;
const FFN: usize = 128;
pub(crate) const SHAPE: [usize; 3] = [6, 4, HIDDEN];
const STEPS: usize = 2;

/// Every weight matrix replaced with seeded normal values (the same model on every backend).
struct Reinit(Rng);

impl<A: Backend> ModuleMapper<A> for Reinit {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<A, D>>) -> Param<Tensor<A, D>> {
        if D != 2 {
            return param;
        }
        param.map(|t| {
            let dims = t.dims();
            let values = self.0.normal(dims.iter().product(), 0.0, 0.2);
            tensor::<A, D>(values, dims, &t.device()).require_grad()
        })
    }
}

/// The bits of every parameter gradient, in visiting order.
pub(crate) struct GradBits<'a, A: AutodiffBackend> {
    pub(crate) grads: &'a A::Gradients,
    pub(crate) out: Vec<Vec<u32>>,
}

impl<A: AutodiffBackend> ModuleVisitor<A> for GradBits<'_, A> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
        if let Some(grad) = param.val().grad(self.grads) {
            self.out.push(bits(values(grad)));
        }
    }
}

/// The bits of every parameter, in visiting order.
pub(crate) struct ParamBits(pub(crate) Vec<Vec<u32>>);

impl<A: Backend> ModuleVisitor<A> for ParamBits {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
        self.0.push(bits(values(param.val())));
    }
}

pub(crate) fn bits(values: Vec<f32>) -> Vec<u32> {
    values.into_iter().map(f32::to_bits).collect()
}

/// A training run: the loss before each step, every gradient of each step, the parameters after, and the
/// counters of what the forward kept.
#[derive(PartialEq)]
pub(crate) struct Run {
    pub(crate) losses: Vec<u32>,
    pub(crate) grads: Vec<Vec<Vec<u32>>>,
    pub(crate) params: Vec<Vec<u32>>,
}

struct Kept {
    fp8_bytes: u64,
    high_precision: u64,
    /// Quantize passes, forward and backward.
    quantizes: u64,
}

pub(crate) fn counter(name: &str) -> u64 {
    thread_counter_value(name).unwrap_or(0)
}

/// A TransformerLayer named `block` with seeded weights.
pub(crate) fn model<A: AutodiffBackend + TeBackend>() -> TransformerLayer<A> {
    let layer: TransformerLayer<A> = TransformerLayerConfig::new(HIDDEN, FFN, 4)
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0)
        .init::<A>(&Default::default())
        .map(&mut Reinit(Rng::new(7)));
    infer_layer_names(&layer, "block");
    layer
}

/// One training run in progress.
struct Trainer<A: AutodiffBackend> {
    layer: TransformerLayer<A>,
    optim: burn::optim::adaptor::OptimizerAdaptor<
        burn::optim::Sgd<A::InnerBackend>,
        TransformerLayer<A>,
        A,
    >,
    run: Run,
    kept: Kept,
    original: bool,
}

impl<A: AutodiffBackend + TeBackend> Trainer<A> {
    fn new(original: bool) -> Self {
        Self {
            layer: model(),
            optim: SgdConfig::new().init(),
            run: Run {
                losses: vec![],
                grads: vec![],
                params: vec![],
            },
            kept: Kept {
                fp8_bytes: 0,
                high_precision: 0,
                quantizes: 0,
            },
            original,
        }
    }

    /// The forward (inside the caller's autocast scope), keeping the original operands with `original`.
    fn forward(&mut self) -> Tensor<A, 1> {
        let device = Default::default();
        let x = tensor::<A, 3>(
            Rng::new(8).normal(SHAPE.iter().product(), 0.0, 1.0),
            SHAPE,
            &device,
        );
        let target = tensor::<A, 3>(
            Rng::new(9).normal(SHAPE.iter().product(), 0.0, 1.0),
            SHAPE,
            &device,
        );
        let before = (
            counter(names::KEPT_FP8_BYTES),
            counter(names::KEPT_HIGH_PRECISION),
            counter(names::QUANTIZE_LAUNCHES),
        );
        let keep_original = self.original.then(save_original_operands);
        let loss = (self.layer.forward(x, None) - target).square().mean();
        drop(keep_original);
        self.kept.fp8_bytes += counter(names::KEPT_FP8_BYTES) - before.0;
        self.kept.high_precision += counter(names::KEPT_HIGH_PRECISION) - before.1;
        self.kept.quantizes += counter(names::QUANTIZE_LAUNCHES) - before.2;
        loss
    }

    /// The backward and the SGD step.
    fn step(&mut self, loss: Tensor<A, 1>) {
        self.run.losses.push(values(loss.clone())[0].to_bits());
        let before = counter(names::QUANTIZE_LAUNCHES);
        let gradients = loss.backward();
        self.kept.quantizes += counter(names::QUANTIZE_LAUNCHES) - before;
        let mut step_grads = GradBits::<A> {
            grads: &gradients,
            out: vec![],
        };
        self.layer.visit(&mut step_grads);
        self.run.grads.push(step_grads.out);
        let gradients = GradientsParams::from_grads(gradients, &self.layer);
        self.layer = self.optim.step(0.05, self.layer.clone(), gradients);
    }

    fn finish(self) -> (Run, Kept) {
        let mut params = ParamBits(vec![]);
        self.layer.visit(&mut params);
        (
            Run {
                params: params.0,
                ..self.run
            },
            self.kept,
        )
    }
}

/// `STEPS` SGD steps of a TransformerLayer under `recipe`, keeping the original operands with `original`.
fn train<A: AutodiffBackend + TeBackend>(
    recipe: &Recipe,
    original: bool,
    debug_step: bool,
) -> (Run, Kept) {
    let mut trainer = Trainer::<A>::new(original);
    for _ in 0..STEPS {
        let loss = fp8_autocast(true, recipe.clone(), || trainer.forward()).unwrap();
        trainer.step(loss);
        if debug_step {
            burn_te_debug::step().unwrap();
        }
    }
    trainer.finish()
}

/// [`train`] of four models in lock step — on `A` and on `B`, each with the original operands kept and with FP8
/// ones — each step's forwards in one autocast scope: one generation, so NVFP4's stochastic rounding (seeded by
/// layer, GEMM, role and generation) draws the same bits for all four.
fn train_in_lock_step<A, B>(recipe: &Recipe) -> [(Run, Kept); 4]
where
    A: AutodiffBackend + TeBackend,
    B: AutodiffBackend + TeBackend,
{
    let mut a = [Trainer::<A>::new(true), Trainer::<A>::new(false)];
    let mut b = [Trainer::<B>::new(true), Trainer::<B>::new(false)];
    for _ in 0..STEPS {
        let (loss_a, loss_b) = fp8_autocast(true, recipe.clone(), || {
            (
                a.each_mut().map(Trainer::forward),
                b.each_mut().map(Trainer::forward),
            )
        })
        .unwrap();
        for (trainer, loss) in a.iter_mut().zip(loss_a) {
            trainer.step(loss);
        }
        for (trainer, loss) in b.iter_mut().zip(loss_b) {
            trainer.step(loss);
        }
    }
    let [a0, a1] = a.map(Trainer::finish);
    let [b0, b1] = b.map(Trainer::finish);
    [a0, a1, b0, b1]
}

pub(crate) fn recipes() -> Vec<(&'static str, Recipe)> {
    vec![
        ("DelayedScaling", DelayedScaling::default().into()),
        (
            "Float8CurrentScaling",
            Float8CurrentScaling::default().into(),
        ),
        ("Float8BlockScaling", Float8BlockScaling::default().into()),
        ("MXFP8BlockScaling", MXFP8BlockScaling::default().into()),
        ("NVFP4BlockScaling", NVFP4BlockScaling::default().into()),
    ]
}

/// The FP8 bytes a TransformerLayer's four linears keep per step under a per-tensor recipe: their inputs (for
/// wgrad) and their weights as the fprop quantized them (for dgrad, TE's saved `weightmat`), one byte per element
/// and one f32 scale each.
fn per_tensor_kept_bytes() -> u64 {
    let tokens = SHAPE[0] * SHAPE[1];
    let inputs = [HIDDEN, HIDDEN, HIDDEN, FFN].map(|width| tokens * width);
    let weights = [
        HIDDEN * 3 * HIDDEN,
        HIDDEN * HIDDEN,
        HIDDEN * FFN,
        FFN * HIDDEN,
    ];
    let per_step: usize = inputs
        .iter()
        .chain(&weights)
        .map(|elements| elements + 4)
        .sum();
    (per_step * STEPS) as u64
}

pub(crate) fn assert_same(what: &str, kept: &Run, original: &Run) {
    assert_eq!(kept.losses, original.losses, "{what}: losses differ");
    for (step, (a, b)) in kept.grads.iter().zip(&original.grads).enumerate() {
        assert_eq!(a.len(), b.len(), "{what}: gradients of step {step}");
        for (index, (a, b)) in a.iter().zip(b).enumerate() {
            let differing = a.iter().zip(b).filter(|(a, b)| a != b).count();
            assert_eq!(
                differing, 0,
                "{what}: step {step}, gradient {index}: {differing} elements differ"
            );
        }
    }
    assert!(kept.params == original.params, "{what}: parameters differ");
}

#[test]
fn fp8_kept_operands_train_bit_identically_on_te_and_balanced_checkpointing() {
    let _ = device();
    type Plain = Autodiff<Te<Wgpu>>;
    type Balanced = Autodiff<Te<Wgpu>, BalancedCheckpointing>;
    for (name, recipe) in recipes() {
        let [
            (original, kept_original),
            (kept, counted),
            balanced_original,
            balanced,
        ] = train_in_lock_step::<Plain, Balanced>(&recipe);
        let (balanced_original, balanced) = (balanced_original.0, balanced.0);
        assert_eq!(kept_original.fp8_bytes, 0, "{name}: original operands kept");
        assert_eq!(kept_original.high_precision, (4 * STEPS) as u64, "{name}");
        assert_same(name, &kept, &original);
        assert_eq!(
            counted.high_precision, 0,
            "{name}: every operand kept in FP8"
        );
        if matches!(recipe, Recipe::Delayed(_) | Recipe::Current(_)) {
            assert_eq!(
                counted.fp8_bytes,
                per_tensor_kept_bytes(),
                "{name}: bytes kept"
            );
        } else {
            // Scales per block on top of the codes (NVFP4: half a byte per code).
            assert!(counted.fp8_bytes > 0, "{name}: kept FP8 operands");
        }
        assert_same(
            &format!("{name}, balanced checkpointing"),
            &balanced,
            &original,
        );
        assert_same(
            &format!("{name}, balanced checkpointing, original operands"),
            &balanced_original,
            &original,
        );
    }
}

/// Under a per-tensor recipe a linear layer's backward quantizes its output gradient once for dgrad and wgrad, as
/// TE quantizes `grad_output` once, and takes the weight the fprop quantized: per step and linear, the forward
/// quantizes x and the weight, the backward the gradient — 3 passes, where each backward GEMM quantizing the
/// gradient itself (the debug tools' stack) takes 4, and keeping the original operands adds the weight and x again
/// (5, 6). The same bits as the debug tools' stack (no session), which runs each GEMM by itself. On this backend
/// a block recipe's two layouts take two passes: the other recipes take as many passes on both stacks.
#[test]
fn one_quantization_of_the_gradient_serves_both_backward_gemms() {
    let _ = device();
    gradient_quantized_once::<Autodiff<Te<Wgpu>>, Autodiff<Debug<Te<Wgpu>>>>(|recipe| {
        matches!(recipe, Recipe::Delayed(_) | Recipe::Current(_))
    });
}

/// As above on the host path, where a block recipe's operand is quantized in both its layouts in one pass
/// (`fp8_quantize_block_pair`: Float8BlockScaling's and MXFP8's activation and gradient, MXFP8's weight): every
/// recipe but NVFP4 takes 3 passes per linear and step, as the per-tensor ones do, with the bits of quantizing for
/// each GEMM by itself.
#[test]
fn one_pass_quantizes_both_layouts_of_a_block_recipe_on_the_host() {
    use burn::backend::Flex;
    gradient_quantized_once::<Autodiff<Te<Flex>>, Autodiff<Debug<Te<Flex>>>>(|recipe| {
        !matches!(recipe, Recipe::Nvfp4(_))
    });
}

/// Trains on `Shared` (the backward quantizes the gradient once for both GEMMs) and on `InTurn` (each GEMM by
/// itself) under every recipe: the same bits, and the passes counted where `once(recipe)`.
fn gradient_quantized_once<Shared, InTurn>(once: impl Fn(&Recipe) -> bool)
where
    Shared: AutodiffBackend + TeBackend,
    InTurn: AutodiffBackend + TeBackend,
{
    let _guard = crate::debug::SESSION
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let linears = 4;
    for (name, recipe) in recipes() {
        let [
            (shared_original, shared_original_kept),
            (shared, shared_kept),
            (in_turn_original, in_turn_original_kept),
            (in_turn, in_turn_kept),
        ] = train_in_lock_step::<Shared, InTurn>(&recipe);
        assert_same(name, &shared, &in_turn);
        assert_same(name, &shared_original, &in_turn_original);
        let quantizes = [
            shared_kept.quantizes,
            shared_original_kept.quantizes,
            in_turn_kept.quantizes,
            in_turn_original_kept.quantizes,
        ];
        if once(&recipe) {
            let expected = [3, 5, 4, 6].map(|per_linear| (per_linear * linears * STEPS) as u64);
            assert_eq!(quantizes, expected, "{name}: quantize passes");
        } else {
            assert_eq!(quantizes[..2], quantizes[2..], "{name}: quantize passes");
        }
    }
}

#[test]
fn fp8_kept_operands_train_bit_identically_through_the_debug_tools() {
    let _ = device();
    type D = Autodiff<Debug<Te<Wgpu>>>;
    let _guard = crate::debug::SESSION
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let dir = crate::debug::temp_dir("saved_operands");
    let config = dir.join("config.yaml");
    // fc2's wgrad runs in high precision (its input must be kept in high precision); every layer logs its stats.
    std::fs::write(
        &config,
        "fc2:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: '.*fc2'\n  transformer_engine:\n    DisableFP8GEMM:\n      enabled: True\n      gemms: [wgrad]\n    LogTensorStats:\n      enabled: True\n      tensors: [activation, gradient, weight]\n      stats: [min, max]\nrest:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: '.*(qkv|proj|fc1)'\n  transformer_engine:\n    LogTensorStats:\n      enabled: True\n      tensors: [activation, gradient, weight]\n      stats: [min, max]\n",
    )
    .unwrap();
    let stats = dir.join("nvdlfw_inspect_statistics_logs/nvdlfw_inspect_globalrank-0.log");
    // Runs one after the other are in different generations: NVFP4's stochastic rounding (seeded by generation)
    // is off here; the lock-step test above covers it.
    let nvfp4 = NVFP4BlockScaling {
        disable_stochastic_rounding: true,
        ..Default::default()
    };
    let mut recipes = recipes();
    recipes.pop();
    recipes.push((
        "NVFP4BlockScaling without stochastic rounding",
        nvfp4.into(),
    ));
    for (name, recipe) in recipes {
        let mut logged = vec![];
        let mut runs = vec![];
        for original in [true, false] {
            burn_te_debug::initialize(DebugOptions::new(&config).log_dir(&dir)).unwrap();
            let (run, kept) = train::<D>(&recipe, original, true);
            burn_te_debug::end().unwrap();
            let expected_high_precision = if original { 4 } else { 1 };
            assert_eq!(
                kept.high_precision,
                (expected_high_precision * STEPS) as u64,
                "{name}, original {original}: operands kept in high precision"
            );
            logged.push(std::fs::read_to_string(&stats).unwrap());
            runs.push(run);
        }
        assert_same(&format!("{name}, debug tools"), &runs[1], &runs[0]);
        // The statistics the debug tools logged are those of the same tensors.
        let lines = |log: &str| -> Vec<String> {
            log.lines()
                .filter_map(|l| l.split_once(" - INFO - ").map(|(_, rest)| rest.to_string()))
                .collect()
        };
        assert!(!lines(&logged[0]).is_empty(), "{name}: statistics logged");
        assert_eq!(lines(&logged[1]), lines(&logged[0]), "{name}: statistics");
    }
}

/// The backward of a forward that a newer forward of the same layer followed (two micro-batches' forwards, then
/// their backwards) under DelayedScaling, where the newer forward updated the scales: both backward GEMMs use the
/// FP8 operands the layer's own forward made (its input for wgrad, its weight for dgrad) — the same bits as running
/// the two steps one after the other — where keeping the original operands quantizes them again with the newer
/// scales (different bits, each counted as a fallback, never silent). The backward runs with its forward's recipe
/// wherever it is called: outside any scope, or inside a scope of another recipe.
#[test]
fn a_backward_after_a_newer_forward_uses_what_its_forward_quantized() {
    use burn_te::nn::LinearConfig;
    type A = Autodiff<Te<Wgpu>>;
    const REASON: &str = "delayed scale changed since the forward";
    let fallbacks = || burn_te::fallback_counts().get(REASON).copied().unwrap_or(0);
    let device = device();
    let input = |seed| tensor::<A, 2>(Rng::new(seed).normal(8 * 32, 0.0, 1.0), [8, 32], &device);
    let weights = tensor::<A, 2>(Rng::new(3).normal(8 * 16, 0.0, 1.0), [8, 16], &device);
    // Returns (the first backward's weight gradient, its input gradient, fallbacks counted).
    let run = |interleaved: bool, original: bool, backward_scope: Option<Recipe>| {
        let layer = LinearConfig::new(32, 16)
            .with_name(Some("lin".into()))
            .init::<A>(&device)
            .map(&mut Reinit(Rng::new(4)));
        let (x1, x2) = (input(1).require_grad(), input(2).require_grad());
        let forward = |x: Tensor<A, 2>| {
            let _original = original.then(save_original_operands);
            fp8_autocast(true, DelayedScaling::default(), || {
                (layer.forward(x) * weights.clone()).sum()
            })
            .unwrap()
        };
        let backward = |loss: Tensor<A, 1>| match &backward_scope {
            None => loss.backward(),
            Some(recipe) => fp8_autocast(true, recipe.clone(), || loss.backward()).unwrap(),
        };
        let before = fallbacks();
        let loss1 = forward(x1.clone());
        let grads1 = if interleaved {
            let loss2 = forward(x2.clone());
            let grads1 = backward(loss1);
            drop(backward(loss2));
            grads1
        } else {
            let grads1 = backward(loss1);
            drop(backward(forward(x2.clone())));
            grads1
        };
        let mut weight_grad = GradBits::<A> {
            grads: &grads1,
            out: vec![],
        };
        layer.visit(&mut weight_grad);
        let x_grad = bits(values(x1.grad(&grads1).unwrap()));
        (weight_grad.out, x_grad, fallbacks() - before)
    };
    let sequential = run(false, false, None);
    assert_eq!(
        sequential.2, 0,
        "one step after the other: no scale changed"
    );
    let interleaved = run(true, false, None);
    assert!(
        interleaved.0 == sequential.0,
        "the weight gradient uses the FP8 input of its own forward"
    );
    assert!(
        interleaved.1 == sequential.1,
        "the input gradient uses the FP8 weight of its own forward"
    );
    assert_eq!(interleaved.2, 0, "no operand quantized with a newer scale");
    let original = run(true, true, None);
    assert!(
        original.0 != sequential.0 && original.1 != sequential.1,
        "original operands are quantized again with the newer scales"
    );
    assert_eq!(
        original.2, 2,
        "input and weight quantized with newer scales, counted"
    );
    let in_another_scope = run(false, false, Some(Float8CurrentScaling::default().into()));
    assert!(
        in_another_scope.0 == sequential.0 && in_another_scope.1 == sequential.1,
        "a backward inside another recipe's scope runs with its forward's recipe"
    );
}
