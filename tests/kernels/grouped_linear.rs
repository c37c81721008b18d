//! `GroupedLinear` (`burn_te::nn`) on `Autodiff<Te<Flex>>`: every expert's output rows, input gradient rows and
//! weight and bias gradients equal, bit for bit, those of the expert's own `Linear` with the same parameters and
//! name, in f32 and under every recipe, over steps in which the delayed-scaling histories evolve (so each expert
//! keeps its own state); zero-sized splits; experts named `{group}.{i}`, explicitly or by their place in a model,
//! and routed by those names in the debug tools; bad splits named.

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_te::nn::{GroupedLinear, GroupedLinearConfig, Linear, LinearConfig, infer_layer_names};
use burn_te::{
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Fp8Format, MXFP8BlockScaling,
    NVFP4BlockScaling, Recipe, TeBackend, TensorRole, fp8_autocast,
};

use crate::common::Rng;
use crate::debug::{SESSION, start_session};
use crate::te::{tensor, values};

type B = Autodiff<burn_te::Te<Flex>>;

const IN: usize = 64;
const OUT: usize = 48;

/// Each expert's `Linear`, with the group's parameters (copied, so the two train apart) and the expert's name.
fn standalone<A: AutodiffBackend + TeBackend>(group: &GroupedLinear<A>) -> Vec<Linear<A>> {
    let device = group.weights[0].device();
    let [inputs, outputs] = group.weights[0].dims();
    group
        .gemm_layers()
        .into_iter()
        .enumerate()
        .map(|(i, name)| {
            let mut linear = LinearConfig::new(inputs, outputs)
                .with_name(Some(name))
                .init::<A>(&device);
            linear.weight = Param::from_tensor(group.weights[i].val().detach().require_grad());
            linear.bias = Some(Param::from_tensor(
                group.biases[i].val().detach().require_grad(),
            ));
            linear
        })
        .collect()
}

fn bits(t: Vec<f32>) -> Vec<u32> {
    t.into_iter().map(f32::to_bits).collect()
}

/// One step of both: the group on `x`, each expert's `Linear` on its rows, one loss `Σ y·r` over both (one autocast
/// scope, so both run in the same iteration: NVFP4's stochastic rounding draws the same bits for the same layer).
/// Asserts the outputs and every gradient equal bit for bit. An expert without rows is compared with its `Linear` on
/// no rows (TE's empty split: the same FP8 state follows) where `linear_on_no_rows`; burn-cubecl 0.21 cannot take
/// the backward of an output without rows (it broadcasts the gradient to one row), so on wgpu that `Linear` does
/// not run.
fn step<A: AutodiffBackend + TeBackend>(
    what: &str,
    group: &GroupedLinear<A>,
    (experts, linear_on_no_rows): (&[Linear<A>], bool),
    splits: &[usize],
    recipe: Option<&Recipe>,
    seed: u64,
) {
    let device = group.weights[0].device();
    let [inputs, outputs] = group.weights[0].dims();
    let rows: usize = splits.iter().sum();
    let mut rng = Rng::new(seed);
    let x = rng.normal(rows * inputs, 0.0, 1.0);
    let r = rng.normal(rows * outputs, 0.0, 1.0);
    let xg = tensor::<A, 2>(x.clone(), [rows, inputs], &device).require_grad();
    let xs = tensor::<A, 2>(x, [rows, inputs], &device).require_grad();
    let r = tensor::<A, 2>(r, [rows, outputs], &device);
    let forward = || {
        let grouped = group.forward(xg.clone(), splits);
        let mut start = 0;
        let (mut alone, mut empty) = (Vec::new(), Vec::new());
        for (expert, &m) in experts.iter().zip(splits) {
            // Burn's `cat` drops empty tensors: an output without rows reaches the loss on its own (so that its
            // backward runs).
            if m > 0 || linear_on_no_rows {
                let y = expert.forward(xs.clone().slice(burn::tensor::s![start..start + m]));
                match m {
                    0 => empty.push(y.sum()),
                    _ => alone.push(y),
                }
            }
            start += m;
        }
        (grouped, Tensor::cat(alone, 0), empty)
    };
    let (grouped, alone, empty) = match recipe {
        Some(recipe) => fp8_autocast(true, recipe.clone(), forward).unwrap(),
        None => forward(),
    };
    let loss = (grouped.clone() * r.clone()).sum() + (alone.clone() * r).sum();
    let grads = empty.into_iter().fold(loss, |loss, e| loss + e).backward();
    assert_eq!(bits(values(grouped)), bits(values(alone)), "{what}: output");
    assert_eq!(
        bits(values(xg.grad(&grads).unwrap())),
        bits(values(xs.grad(&grads).unwrap())),
        "{what}: input gradient"
    );
    for (i, (expert, &m)) in experts.iter().zip(splits).enumerate() {
        let grad = |p: &Param<Tensor<A, 2>>| p.val().grad(&grads);
        let (dw, dw_alone) = (grad(&group.weights[i]), grad(&expert.weight));
        assert_eq!(
            dw.is_some(),
            m > 0,
            "{what}: expert {i} has a weight gradient iff it has rows"
        );
        if let (Some(dw), Some(dw_alone)) = (dw, dw_alone) {
            assert_eq!(
                bits(values(dw)),
                bits(values(dw_alone)),
                "{what}: expert {i} dW"
            );
            let db = group.biases[i].val().grad(&grads).unwrap();
            let db_alone = expert.bias.as_ref().unwrap().val().grad(&grads).unwrap();
            assert_eq!(
                bits(values(db)),
                bits(values(db_alone)),
                "{what}: expert {i} db"
            );
        }
    }
}

/// In f32 and under each recipe, three steps with different inputs and splits (one expert empty in the second):
/// under DelayedScaling each step quantizes with the scales the expert's own history gives, so equality at steps 2
/// and 3 says each expert kept its own state, as its `Linear` does.
#[test]
fn every_expert_equals_its_own_linear_bit_for_bit_under_every_recipe() {
    let recipes: Vec<Option<Recipe>> = vec![
        None,
        Some(DelayedScaling::default().into()),
        Some(Float8CurrentScaling::default().into()),
        Some(Float8BlockScaling::default().into()),
        Some(MXFP8BlockScaling::default().into()),
        Some(NVFP4BlockScaling::default().into()),
    ];
    for recipe in recipes {
        let name = recipe
            .as_ref()
            .map_or("f32".to_string(), |r| r.name().to_string());
        let group = GroupedLinearConfig::new(4, IN, OUT)
            .with_name(Some(format!("moe_{name}.experts")))
            .init::<B>(&Default::default());
        let experts = standalone(&group);
        for (step_index, splits) in [[40, 8, 24, 56], [16, 0, 96, 16], [32, 32, 32, 32]]
            .iter()
            .enumerate()
        {
            step(
                &format!("{name} step {step_index}"),
                &group,
                (&experts, true),
                splits,
                recipe.as_ref(),
                100 + step_index as u64,
            );
        }
        if let Some(Recipe::Delayed(delayed)) = &recipe {
            // Each expert's histories equal its Linear's, and differ from the other experts'.
            let read = |meta: &burn_te::Fp8Meta<B>, role: TensorRole| {
                meta.read(role, delayed, delayed.fp8_format.for_role(role))
                    .unwrap()
                    .unwrap()
                    .history
            };
            for role in [
                TensorRole::Activation,
                TensorRole::Weight,
                TensorRole::Gradient,
            ] {
                let histories: Vec<Vec<f32>> =
                    group.fp8_meta.iter().map(|m| read(m, role)).collect();
                for (i, expert) in experts.iter().enumerate() {
                    assert_eq!(
                        histories[i],
                        read(&expert.fp8_meta, role),
                        "expert {i} {role:?}"
                    );
                }
                assert!(
                    histories.windows(2).all(|w| w[0] != w[1]),
                    "the experts share a {role:?} history: {histories:?}"
                );
            }
        }
    }
}

/// All splits zero: an empty output; names `{group}.{i}` explicit and inferred from the model; bad splits and
/// widths are errors naming the group.
#[test]
fn empty_splits_names_and_errors() {
    let device = Default::default();
    let group = GroupedLinearConfig::new(3, IN, OUT)
        .with_name(Some("moe.experts".into()))
        .init::<B>(&device);
    assert_eq!(
        group.gemm_layers(),
        ["moe.experts.0", "moe.experts.1", "moe.experts.2"]
    );
    let empty = group.forward(Tensor::zeros([0, IN], &device), &[0, 0, 0]);
    assert_eq!(empty.dims(), [0, OUT]);

    #[derive(Module, Debug)]
    struct Moe<B: Backend> {
        experts: GroupedLinear<B>,
    }
    let model = Moe {
        experts: GroupedLinearConfig::new(2, IN, OUT).init::<B>(&device),
    };
    infer_layer_names(&model, "layers.3");
    assert_eq!(
        model.experts.gemm_layers(),
        ["layers.3.experts.0", "layers.3.experts.1"]
    );

    let x = Tensor::<B, 2>::zeros([10, IN], &device);
    for splits in [&[4, 6][..], &[4, 6, 1], &[5, 5, 5]] {
        let message = group
            .try_forward(x.clone(), splits)
            .unwrap_err()
            .to_string();
        assert!(
            message.starts_with("moe.experts: m_splits") && message.contains("[10, 64]"),
            "{message}"
        );
    }
    let message = group
        .try_forward(Tensor::zeros([10, 32], &device), &[4, 6, 0])
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("moe.experts") && message.contains("64"),
        "{message}"
    );
    assert!(
        GroupedLinearConfig::new(0, IN, OUT)
            .try_init::<B>(&device)
            .is_err()
    );
}

/// The debug tools route each expert by its name: DisableFP8GEMM on `dbg.experts.1`'s fprop gives that expert's rows
/// in high precision (bit for bit its Linear outside autocast), and leaves experts 0 and 2 in FP8 (bit for bit their
/// Linears under the recipe).
#[test]
fn debug_features_apply_per_expert() {
    type S = Autodiff<burn_te_debug::Debug<burn_te::Te<Flex>>>;
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let config = "off_expert_1:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: '^dbg\\.experts\\.1$'\n  \
                  transformer_engine:\n    DisableFP8GEMM:\n      enabled: True\n      gemms: [fprop]\n";
    start_session("grouped-linear-experts", config);
    let device = Default::default();
    let group = GroupedLinearConfig::new(3, IN, OUT)
        .with_name(Some("dbg.experts".into()))
        .init::<S>(&device);
    let linear = |i: usize, name: &str| {
        let mut linear = LinearConfig::new(IN, OUT)
            .with_name(Some(name.into()))
            .init::<S>(&device);
        linear.weight = Param::from_tensor(group.weights[i].val());
        linear.bias = Some(Param::from_tensor(group.biases[i].val()));
        linear
    };
    let rows = 16;
    let x = tensor::<S, 2>(
        Rng::new(3).normal(3 * rows * IN, 0.0, 1.0),
        [3 * rows, IN],
        &device,
    );
    let block = |i: usize| x.clone().narrow(0, i * rows, rows);
    let recipe = Float8CurrentScaling::default();
    let fp8 =
        |layer: &Linear<S>, x| fp8_autocast(true, recipe.clone(), || layer.forward(x)).unwrap();
    let grouped = fp8_autocast(true, recipe.clone(), || {
        group.forward(x.clone(), &[rows; 3])
    })
    .unwrap();
    let got = |i: usize| bits(values(grouped.clone().narrow(0, i * rows, rows)));
    for i in [0, 2] {
        let want = fp8(&linear(i, &format!("dbg.experts.{i}")), block(i));
        assert_eq!(got(i), bits(values(want)), "expert {i} in FP8");
    }
    let high = linear(1, "plain").forward(block(1));
    assert_eq!(got(1), bits(values(high)), "expert 1 in high precision");
    let fp8_one = fp8(&linear(1, "solo.1"), block(1));
    assert_ne!(got(1), bits(values(fp8_one)), "the FP8 GEMM differs");
    burn_te_debug::end().unwrap();
}

/// A recipe plan selects experts by name: `plan.experts.1` under MXFP8 and the others under the scope's current
/// scaling, each expert's rows bit for bit its `Linear` under the recipe the plan names for it.
#[test]
fn recipe_plans_select_experts_by_name() {
    let plan = burn_te::RecipePlan::from_yaml(
        "rules:\n  - name: expert_1_in_mxfp8\n    layers:\n      exact_layer_names: [plan.experts.1]\n    recipe: mxfp8\n",
    )
    .unwrap();
    let device = Default::default();
    let group = GroupedLinearConfig::new(3, IN, OUT)
        .with_name(Some("plan.experts".into()))
        .init::<B>(&device);
    let experts = standalone(&group);
    let rows = 32;
    let x = tensor::<B, 2>(
        Rng::new(8).normal(3 * rows * IN, 0.0, 1.0),
        [3 * rows, IN],
        &device,
    );
    let current = Float8CurrentScaling::default();
    let grouped = fp8_autocast(true, plan.over(current.clone()).unwrap(), || {
        group.forward(x.clone(), &[rows; 3])
    })
    .unwrap();
    for (i, expert) in experts.iter().enumerate() {
        let recipe: Recipe = match i {
            1 => MXFP8BlockScaling::default().into(),
            _ => current.clone().into(),
        };
        let want = fp8_autocast(true, recipe, || {
            expert.forward(x.clone().narrow(0, i * rows, rows))
        })
        .unwrap();
        assert_eq!(
            bits(values(grouped.clone().narrow(0, i * rows, rows))),
            bits(values(want)),
            "expert {i}"
        );
    }
}

/// A group larger than one backward node (32 experts) runs in chunks: 35 experts, some without rows, each bit for
/// bit its own `Linear` (outputs, input and parameter gradients) over two DelayedScaling steps.
#[test]
fn groups_beyond_one_node_run_in_chunks_bit_for_bit() {
    let group = GroupedLinearConfig::new(35, IN, OUT)
        .with_name(Some("wide.experts".into()))
        .init::<B>(&Default::default());
    let experts = standalone(&group);
    let recipe: Recipe = DelayedScaling::default().into();
    for (step_index, rows) in [[3, 0, 5, 1, 2], [0, 4, 1, 6, 2]].iter().enumerate() {
        let splits: Vec<usize> = (0..35).map(|i| rows[i % rows.len()]).collect();
        step(
            &format!("35 experts step {step_index}"),
            &group,
            (&experts, true),
            &splits,
            Some(&recipe),
            300 + step_index as u64,
        );
    }
}

/// The backward takes what the grouped forward kept through Burn's checkpointer: under balanced checkpointing, with
/// the input a memory-bound op's output (recomputed in the backward), the outputs and weight gradients equal the
/// default strategy's bit for bit, in f32 (the input kept in high precision) and in FP8; an input that needs no
/// gradient gets none, and the weights still do.
#[test]
fn checkpointed_inputs_and_inputs_without_gradient() {
    use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
    type Bc = Autodiff<burn_te::Te<Flex>, BalancedCheckpointing>;
    fn run<A: burn::tensor::backend::AutodiffBackend + burn_te::TeBackend>(
        recipe: Option<Recipe>,
        input_grad: bool,
    ) -> (Vec<u32>, Option<Vec<u32>>, Vec<Vec<u32>>) {
        let device = Default::default();
        let group = GroupedLinearConfig::new(3, IN, OUT)
            .with_name(Some("ckpt.experts".into()))
            .init::<A>(&device);
        let mut rng = Rng::new(11);
        let weights: Vec<Tensor<A, 2>> = (0..3)
            .map(|_| tensor::<A, 2>(rng.normal(IN * OUT, 0.0, 0.1), [IN, OUT], &device))
            .collect();
        let mut group = group;
        for (param, w) in group.weights.iter_mut().zip(&weights) {
            *param = Param::from_tensor(w.clone().require_grad());
        }
        let input = tensor::<A, 2>(rng.normal(40 * IN, 0.0, 1.0), [40, IN], &device);
        let input = if input_grad {
            input.require_grad()
        } else {
            input
        };
        let r = tensor::<A, 2>(rng.normal(40 * OUT, 0.0, 1.0), [40, OUT], &device);
        let forward = || group.forward(burn::tensor::activation::gelu(input.clone()), &[16, 0, 24]);
        let y = match recipe {
            Some(recipe) => fp8_autocast(true, recipe, forward).unwrap(),
            None => forward(),
        };
        let grads = (y.clone() * r).sum().backward();
        let dx = input.grad(&grads).map(|g| bits(values(g)));
        let dws = group
            .weights
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 1)
            .map(|(_, w)| bits(values(w.val().grad(&grads).expect("a weight gradient"))))
            .collect();
        assert!(group.weights[1].val().grad(&grads).is_none());
        (bits(values(y)), dx, dws)
    }
    for recipe in [None, Some(Float8CurrentScaling::default().into())] {
        for input_grad in [true, false] {
            let what = format!(
                "{:?}, input gradient {input_grad}",
                recipe.as_ref().map(Recipe::name)
            );
            let default = run::<B>(recipe.clone(), input_grad);
            let balanced = run::<Bc>(recipe.clone(), input_grad);
            assert_eq!(default.1.is_some(), input_grad, "{what}");
            assert_eq!(default, balanced, "{what}");
        }
    }
}

/// On every host GEMM path this CPU runs, the experts' GEMMs issued together (a large expert's by itself, split
/// across threads; the small ones side by side in one parallel region) give each expert's `Linear`'s
/// numbers bit for bit, over DelayedScaling steps and under MXFP8; the grouped call counts two FP8 GEMM launches
/// per GEMM kind (the large expert's, the small ones' together), and one per expert's GEMM with the experts in turn
/// (the same output and input gradient bit for bit), every expert's GEMM under the path asked for.
#[test]
fn grouped_gemms_issue_together_on_every_host_path() {
    use burn_te::backends::host::gemm::{HostGemmPath, with_host_gemm_path};
    // Expert 0: 300 × 256 × 192, split across threads; the others a few rows each.
    let splits = [300, 5, 0, 17, 64, 1];
    let paths = HostGemmPath::available_paths();
    assert!(
        paths.contains(&HostGemmPath::F32),
        "the f32 path runs everywhere: {paths:?}"
    );
    for path in paths {
        for recipe in [
            Recipe::from(DelayedScaling::default()),
            MXFP8BlockScaling::default().into(),
        ] {
            let what = format!("{path}, {}", recipe.name());
            let group = GroupedLinearConfig::new(splits.len(), 256, 192)
                .with_name(Some(format!("paths.{path}.{}", recipe.name())))
                .init::<B>(&Default::default());
            let experts = standalone(&group);
            with_host_gemm_path(path, || {
                for seed in 0..2 {
                    step(
                        &what,
                        &group,
                        (&experts, true),
                        &splits,
                        Some(&recipe),
                        500 + seed,
                    );
                }
            });
        }
        // Counted: the group alone, one step, its experts' GEMMs together and in turn (the same numbers).
        let group = GroupedLinearConfig::new(splits.len(), 256, 192).init::<B>(&Default::default());
        let x = tensor::<B, 2>(
            Rng::new(9).normal(387 * 256, 0.0, 1.0),
            [387, 256],
            &Default::default(),
        )
        .require_grad();
        with_host_gemm_path(path, || {
            together_and_in_turn(
                &path.to_string(),
                &group,
                &x,
                &splits,
                &format!("HostFp8Gemm({path})"),
                // Per GEMM kind: expert 0's (300 × 256 × 192, large enough to split) issued by itself as soon as
                // it is quantized, the four small ones together.
                3 * 2,
                5,
            )
        });
    }
}

/// One Float8CurrentScaling step of `group` on `x`, its experts' GEMMs together and then in turn: together,
/// `launches` FP8 GEMM launches; in turn, one per expert's GEMM; both with `3 · experts` GEMMs (the experts with
/// rows) counted under `path_counter`, and the same output, input-gradient and weight-gradient bits. Together, each
/// expert's gradient rows are quantized once for its dgrad and wgrad (3 quantize launches per expert: x, the
/// weight kept for dgrad, the gradient); in turn, by each GEMM (4).
fn together_and_in_turn<A: AutodiffBackend + TeBackend>(
    what: &str,
    group: &GroupedLinear<A>,
    x: &Tensor<A, 2>,
    splits: &[usize],
    path_counter: &str,
    launches: u64,
    experts: u64,
) {
    use burn_te::diagnostics::thread_counter_value;
    use burn_te::linear::grouped::with_experts_in_turn;
    let counter = |name: &str| thread_counter_value(name).unwrap_or(0);
    let run = || {
        let names = ["Fp8GemmLaunches", path_counter, "QuantizeLaunches"];
        let before = names.map(counter);
        let y = fp8_autocast(true, Float8CurrentScaling::default(), || {
            group.forward(x.clone(), splits)
        })
        .unwrap();
        let grads = y.clone().sum().backward();
        let (y, dx) = (bits(values(y)), bits(values(x.grad(&grads).unwrap())));
        let dw: Vec<Vec<u32>> = (group.weights.iter())
            .filter_map(|w| w.val().grad(&grads).map(|dw| bits(values(dw))))
            .collect();
        let counted = names.map(counter);
        let [gemm_launches, on_path, quantizes] = [0, 1, 2].map(|i| counted[i] - before[i]);
        (gemm_launches, on_path, y, dx, dw, quantizes)
    };
    let together = run();
    assert_eq!(together.0, launches, "{what}: FP8 GEMM launches together");
    assert_eq!(
        together.1,
        3 * experts,
        "{what}: three GEMMs of each expert with rows under {path_counter}"
    );
    assert_eq!(
        together.5,
        3 * experts,
        "{what}: each expert's gradient quantized once"
    );
    assert_eq!(together.4.len() as u64, experts, "{what}: weight gradients");
    let in_turn = with_experts_in_turn(run);
    assert_eq!(
        in_turn.0,
        3 * experts,
        "{what}: one launch per expert's GEMM in turn"
    );
    assert_eq!(in_turn.1, together.1, "{what}: in turn, counted");
    assert_eq!(
        in_turn.5,
        4 * experts,
        "{what}: in turn, the gradient by each GEMM"
    );
    assert_eq!(
        (&in_turn.2, &in_turn.3, &in_turn.4),
        (&together.2, &together.3, &together.4),
        "{what}: in turn, bits"
    );
}

/// On wgpu (lavapipe here), unfused and through Burn's fusion (`burn::backend::Wgpu`, what users get): each expert's
/// numbers equal its own `Linear`'s bit for bit over two DelayedScaling steps (each expert quantizing with its own
/// history), with the experts' GEMMs launched together: one grouped kernel launch per GEMM kind (fprop, dgrad,
/// wgrad), where the experts in turn launch one per expert's GEMM, with the same output and input gradient bits.
#[test]
fn experts_equal_their_linears_on_wgpu() {
    fn check<W: AutodiffBackend + TeBackend>(what: &str) {
        let splits = [24, 0, 40, 8];
        let recipe = Recipe::from(DelayedScaling::default());
        let group = GroupedLinearConfig::new(splits.len(), IN, OUT)
            .with_name(Some(format!("{what}.experts")))
            .init::<W>(&Default::default());
        let experts = standalone(&group);
        for seed in 0..2 {
            step(
                what,
                &group,
                (&experts, false),
                &splits,
                Some(&recipe),
                700 + seed,
            );
        }
        let x = tensor::<W, 2>(
            Rng::new(11).normal(72 * IN, 0.0, 1.0),
            [72, IN],
            &Default::default(),
        )
        .require_grad();
        // One launch each for fprop, dgrad and wgrad; three experts with rows.
        together_and_in_turn(what, &group, &x, &splits, "DeviceFp8Gemm(simt)", 3, 3);
    }
    check::<Autodiff<burn_te::Te<burn_te::backends::Wgpu>>>("wgpu");
    check::<Autodiff<burn_te::Te<burn::backend::Wgpu>>>("wgpu_fusion");
}

/// Each expert's delayed-scaling state goes through the group's record: after two DelayedScaling steps, a group
/// loaded from the record (under another name, so nothing but the record carries the state) has every expert's
/// histories and runs the third step bit for bit as the original (output and input gradient), where a fresh group
/// with the same parameters does not.
#[test]
fn experts_fp8_state_goes_through_the_record() {
    use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
    let device = Default::default();
    let config = |name: &str| GroupedLinearConfig::new(3, IN, OUT).with_name(Some(name.into()));
    let group = config("rec.experts").init::<B>(&device);
    let recipe = DelayedScaling::default();
    let splits = [16, 8, 24];
    let run = |g: &GroupedLinear<B>, seed| {
        let x = tensor::<B, 2>(Rng::new(seed).normal(48 * IN, 0.0, 1.0), [48, IN], &device)
            .require_grad();
        let y = fp8_autocast(true, recipe.clone(), || g.forward(x.clone(), &splits)).unwrap();
        let grads = y.clone().sum().backward();
        (bits(values(y)), bits(values(x.grad(&grads).unwrap())))
    };
    run(&group, 1);
    run(&group, 2);
    let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
    let bytes = recorder.record(group.clone().into_record(), ()).unwrap();
    let record = recorder.load(bytes, &device).unwrap();
    let loaded = config("rec_loaded.experts")
        .init::<B>(&device)
        .load_record(record);
    let history = |meta: &burn_te::Fp8Meta<B>, role| {
        meta.read(role, &recipe, Fp8Format::E4M3)
            .unwrap()
            .unwrap()
            .history
    };
    for role in [TensorRole::Activation, TensorRole::Weight] {
        for i in 0..3 {
            let want = history(&group.fp8_meta[i], role);
            assert!(
                want.iter().any(|&a| a > 0.0),
                "expert {i} {role:?} recorded"
            );
            assert_eq!(
                history(&loaded.fp8_meta[i], role),
                want,
                "expert {i} {role:?}"
            );
        }
    }
    let mut fresh = config("rec_fresh.experts").init::<B>(&device);
    fresh.weights = group.weights.clone();
    fresh.biases = group.biases.clone();
    let want = run(&group, 3);
    assert_eq!(run(&loaded, 3), want, "the loaded group's third step");
    assert_ne!(
        run(&fresh, 3).0,
        want.0,
        "a fresh state quantizes otherwise"
    );
}
