//! Recipe plans (`burn_te::plan`) on the host path (`Autodiff<Te<Flex>>`): each GEMM of each layer equals, bit for
//! bit, the same GEMM run under the recipe the plan names for it; nested scopes; the delayed-scaling state reset on
//! a recipe change, against scales computed here from the inputs; plans saved, loaded and edited by hand; bad plans
//! named by file, rule, key and line.

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::prelude::*;
use burn_te::diagnostics::thread_counter_value;
use burn_te::nn::{Linear, LinearConfig};
use burn_te::plan::{LayerSelection, RecipeOptions};
use burn_te::{
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Fp8Format, Gemm, MXFP8BlockScaling,
    NVFP4BlockScaling, PlanRule, RecipePlan, ScopeRecipe, Te, TeError, TensorRole, fp8_autocast,
};

use crate::common::Rng;
use crate::te::{tensor, values};

type B = Autodiff<Te<Flex>>;

const TOKENS: usize = 64;
const IN: usize = 128;
const OUT: usize = 64;
/// The three independent layers of a run: each takes its own input, so each GEMM's result is seen alone.
const LAYERS: [&str; 3] = ["a", "b", "c"];

/// What a run produced per layer: fprop output, dgrad (input gradient) and wgrad (weight gradient), as bits.
#[derive(Debug)]
struct Run {
    gemms: Vec<[Vec<u32>; 3]>,
}

impl Run {
    fn of(&self, layer: usize, gemm: Gemm) -> &Vec<u32> {
        &self.gemms[layer][gemm.index()]
    }
}

fn bits(t: Vec<f32>) -> Vec<u32> {
    t.into_iter().map(f32::to_bits).collect()
}

/// Layer `name` under `prefix` with the fixed weight of layer `index`.
fn layer(prefix: &str, name: &str, index: usize) -> Linear<B> {
    let device = Default::default();
    let mut linear = LinearConfig::new(IN, OUT)
        .with_bias(false)
        .with_name(Some(format!("{prefix}.{name}")))
        .init::<B>(&device);
    let weight = Rng::new(100 + index as u64).normal(IN * OUT, 0.0, 0.05);
    linear.weight = Param::from_tensor(tensor::<B, 2>(weight, [IN, OUT], &device));
    linear
}

/// The three layers (`prefix.a`, `.b`, `.c`).
fn layers(prefix: &str) -> Vec<Linear<B>> {
    LAYERS
        .iter()
        .enumerate()
        .map(|(i, name)| layer(prefix, name, i))
        .collect()
}

/// Each layer's fixed input.
fn inputs() -> Vec<Tensor<B, 2>> {
    (0..3)
        .map(|i| {
            let x = Rng::new(200 + i).normal(TOKENS * IN, 0.0, 1.0);
            tensor::<B, 2>(x, [TOKENS, IN], &Default::default()).require_grad()
        })
        .collect()
}

/// The backward of the loss `Σ y·g` with fixed output gradients `g` (so every run's backward starts from the same
/// gradients), and each layer's fprop output, input gradient and weight gradient.
fn backward(layers: &[Linear<B>], xs: &[Tensor<B, 2>], ys: &[Tensor<B, 2>]) -> Run {
    let device = Default::default();
    let mut loss = Tensor::<B, 1>::zeros([1], &device);
    for (i, y) in ys.iter().enumerate() {
        let g = Rng::new(300 + i as u64).normal(TOKENS * OUT, 0.0, 1.0);
        loss = loss + (y.clone() * tensor::<B, 2>(g, [TOKENS, OUT], &device)).sum();
    }
    let grads = loss.backward();
    let gemms = (0..3)
        .map(|i| {
            [
                bits(values(ys[i].clone().inner())),
                bits(values(xs[i].grad(&grads).unwrap())),
                bits(values(layers[i].weight.grad(&grads).unwrap())),
            ]
        })
        .collect();
    Run { gemms }
}

/// One forward and backward of the three layers (`prefix.a`, `.b`, `.c`) inside `scope`.
fn run(prefix: &str, enabled: bool, scope: impl Into<ScopeRecipe>) -> Run {
    let (layers, xs) = (layers(prefix), inputs());
    let ys = fp8_autocast(enabled, scope, || {
        layers
            .iter()
            .zip(&xs)
            .map(|(l, x)| l.try_forward(x.clone()))
            .collect::<Result<Vec<_>, _>>()
    })
    .unwrap()
    .unwrap();
    backward(&layers, &xs, &ys)
}

fn nvfp4_plain() -> NVFP4BlockScaling {
    NVFP4BlockScaling {
        disable_rht: true,
        disable_stochastic_rounding: true,
        disable_2d_quantization: true,
    }
}

/// `b`: fprop in MXFP8, its backward in current scaling; `c`: fprop in high precision, the GEMMs that take the
/// gradient (dgrad, wgrad) in block scaling; `a`: the scope's recipe.
const ROUTING_PLAN: &str = r"# b and c leave the scope's recipe
rules:
  - name: b_forward
    layers:
      layer_name_regex_pattern: '\.b$'
    gemms: [fprop]
    recipe: mxfp8
  - name: b_backward
    layers:
      layer_name_regex_pattern: '\.b$'
    gemms: [dgrad, wgrad]
    recipe: fp8_current_scaling
  - name: c_gradient
    layers:
      layer_name_regex_pattern: '\.c$'
    tensors: [gradient]
    recipe: fp8_block_scaling
  - name: c_forward
    layers:
      layer_name_regex_pattern: '\.c$'
    gemms: [fprop]
    recipe: high_precision
";

#[test]
fn each_gemm_of_a_plan_equals_its_recipe_alone_bit_for_bit() {
    let plan = RecipePlan::from_yaml(ROUTING_PLAN).unwrap();
    let planned = run("routing", true, plan.over(nvfp4_plain()).unwrap());
    let nvfp4 = run("routing_nvfp4", true, nvfp4_plain());
    let mxfp8 = run("routing_mxfp8", true, MXFP8BlockScaling::default());
    let current = run("routing_current", true, Float8CurrentScaling::default());
    let block = run("routing_block", true, Float8BlockScaling::default());
    let f32_run = run("routing_f32", false, Float8CurrentScaling::default());
    let expected: [[&Run; 3]; 3] = [
        [&nvfp4, &nvfp4, &nvfp4],
        [&mxfp8, &current, &current],
        [&f32_run, &block, &block],
    ];
    for (layer, name) in LAYERS.iter().enumerate() {
        for gemm in Gemm::ALL {
            let want = expected[layer][gemm.index()].of(layer, gemm);
            assert!(
                planned.of(layer, gemm) == want,
                "layer {name} {}: not the chosen recipe's result",
                gemm.name()
            );
            // The recipes differ in what they give, so the equality above names one of them.
            if !std::ptr::eq(expected[layer][gemm.index()], &nvfp4) {
                assert!(
                    nvfp4.of(layer, gemm) != want,
                    "layer {name} {}",
                    gemm.name()
                );
            }
        }
    }
    // The metrics report says which recipe ran where.
    for (site, recipe) in [
        ("routing.a.fprop", "nvfp4"),
        ("routing.a.wgrad", "nvfp4"),
        ("routing.b.fprop", "mxfp8"),
        ("routing.b.dgrad", "fp8_current_scaling"),
        ("routing.b.wgrad", "fp8_current_scaling"),
        ("routing.c.fprop", "high_precision"),
        ("routing.c.dgrad", "fp8_block_scaling"),
    ] {
        let counter = format!("GemmRecipe({site}={recipe})");
        assert_eq!(thread_counter_value(&counter), Some(1), "{counter}");
    }
}

#[test]
fn an_inner_scope_replaces_the_plan_and_the_backward_keeps_the_forwards_recipes() {
    // A rule for a: b and c run in inner scopes, where the plan does not reach (a rule for them would select no
    // layer, an error).
    let plan = RecipePlan::new().rule(
        PlanRule::new("a_forward", LayerSelection::regex(r"\.a$"), "mxfp8").gemms([Gemm::Fprop]),
    );
    let mxfp8 = run("nested_mxfp8", true, MXFP8BlockScaling::default());
    let f32_run = run("nested_f32", false, Float8CurrentScaling::default());
    let nvfp4 = run("nested_nvfp4", true, nvfp4_plain());
    let (layers, xs) = (layers("nested"), inputs());
    // a under the plan, b in an inner high-precision scope, c in an inner MXFP8 scope.
    let ys = fp8_autocast(true, plan.over(nvfp4_plain()).unwrap(), || {
        let a = layers[0].forward(xs[0].clone());
        let b = fp8_autocast(false, MXFP8BlockScaling::default(), || {
            layers[1].forward(xs[1].clone())
        })
        .unwrap();
        let c = fp8_autocast(true, MXFP8BlockScaling::default(), || {
            layers[2].forward(xs[2].clone())
        })
        .unwrap();
        // Back in the plan's scope.
        assert_eq!(burn_te::active_recipe().unwrap().name(), "nvfp4");
        assert!(burn_te::active_plan().is_some());
        vec![a, b, c]
    })
    .unwrap();
    // The backward runs outside any scope, with the recipes of each forward.
    let got = backward(&layers, &xs, &ys);
    // a: fprop by the plan's rule, its backward the scope's NVFP4; b: high precision; c: MXFP8.
    let expected: [[&Run; 3]; 3] = [
        [&mxfp8, &nvfp4, &nvfp4],
        [&f32_run, &f32_run, &f32_run],
        [&mxfp8, &mxfp8, &mxfp8],
    ];
    for (i, want) in expected.iter().enumerate() {
        for gemm in Gemm::ALL {
            assert!(
                got.of(i, gemm) == want[gemm.index()].of(i, gemm),
                "layer {} {}",
                LAYERS[i],
                gemm.name()
            );
        }
    }
}

/// The activation scale the layer's delayed state holds for the next step.
fn activation_scale(layer: &Linear<B>, recipe: &DelayedScaling) -> f32 {
    layer
        .fp8_meta
        .read(TensorRole::Activation, recipe, Fp8Format::E4M3)
        .unwrap()
        .unwrap()
        .scale
}

#[test]
fn a_layer_switching_recipe_restarts_its_delayed_state_and_high_precision_keeps_it() {
    let device = Default::default();
    let delayed = DelayedScaling {
        amax_history_len: 4,
        ..DelayedScaling::default()
    };
    // Steps 1-2 and 4 run delayed scaling; step 3 moves `switch` to current scaling by a plan, and runs `keep` in
    // high precision by a plan.
    let step3 = RecipePlan::new()
        .rule(PlanRule::new(
            "switch_to_current",
            LayerSelection::exact(["reset.switch"]),
            "fp8_current_scaling",
        ))
        .rule(PlanRule::new(
            "keep_in_high_precision",
            LayerSelection::exact(["reset.keep"]),
            "high_precision",
        ));
    let layers: Vec<Linear<B>> = ["switch", "keep"]
        .iter()
        .enumerate()
        .map(|(i, name)| layer("reset", name, i))
        .collect();
    let amplitudes = [8.0f32, 4.0, 1.0, 2.0];
    let mut amaxes: Vec<Vec<f64>> = vec![Vec::new(); 2];
    for (step, amplitude) in amplitudes.iter().enumerate() {
        let x = Rng::new(400 + step as u64).normal(TOKENS * IN, 0.0, 0.3);
        let x: Vec<f32> = x.iter().map(|v| v.clamp(-1.0, 1.0) * amplitude).collect();
        let amax = x.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
        let scope: ScopeRecipe = if step == 2 {
            step3.over(delayed.clone()).unwrap().into()
        } else {
            delayed.clone().into()
        };
        fp8_autocast(true, scope, || {
            for l in &layers {
                l.forward(tensor::<B, 2>(x.clone(), [TOKENS, IN], &device));
            }
        })
        .unwrap();
        // The independent re-computation: a layer's history holds the amaxes of its delayed steps since its last
        // reset (switch: reset by step 3's current scaling; keep: high precision leaves it), at most 4 of them;
        // the next scale is 448 / their max (E4M3, margin 0).
        for (i, history) in amaxes.iter_mut().enumerate() {
            if step == 2 {
                if i == 0 {
                    history.clear();
                }
                continue;
            }
            history.push(amax);
        }
        for (i, l) in layers.iter().enumerate() {
            let want = if amaxes[i].is_empty() {
                None
            } else {
                let max = amaxes[i]
                    .iter()
                    .rev()
                    .take(4)
                    .fold(0.0f64, |m, &a| m.max(a));
                Some(448.0f32 / max as f32)
            };
            let got = l
                .fp8_meta
                .read(TensorRole::Activation, &delayed, Fp8Format::E4M3)
                .unwrap()
                .map(|view| view.scale);
            assert_eq!(got, want, "step {} layer {i}", step + 1);
        }
    }
    // After step 4: the switched layer's history holds step 4 alone, the kept one steps 1, 2 and 4.
    assert_eq!(
        activation_scale(&layers[0], &delayed),
        448.0f32 / amaxes[0][0] as f32
    );
}

#[test]
fn plans_save_load_and_edit_by_hand_in_yaml_and_json() {
    let dir = std::env::temp_dir().join(format!("burn-te-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plan = RecipePlan::from_yaml(ROUTING_PLAN).unwrap().rule(
        PlanRule::new(
            "a_delayed",
            LayerSelection::regex(r"\.a$"),
            "fp8_delayed_scaling",
        )
        .gemms([Gemm::Fprop, Gemm::Dgrad])
        .options(RecipeOptions {
            margin: Some(1.0),
            amax_history_len: Some(16),
            ..RecipeOptions::default()
        }),
    );
    for file in ["plan.yaml", "plan.json"] {
        let path = dir.join(file);
        plan.save(&path).unwrap();
        assert_eq!(RecipePlan::load(&path).unwrap(), plan, "{file}");
    }
    // Burn's Config API writes and reads the same plan (JSON).
    let burn_path = dir.join("burn.json");
    burn::config::Config::save(&plan, &burn_path).unwrap();
    assert_eq!(
        <RecipePlan as burn::config::Config>::load(&burn_path).unwrap(),
        plan
    );

    // Edited by hand: b's forward moves from MXFP8 to current scaling; its fprop then equals current scaling's.
    let path = dir.join("plan.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("recipe: mxfp8"), "{text}");
    std::fs::write(
        &path,
        text.replacen("recipe: mxfp8", "recipe: fp8_current_scaling", 1),
    )
    .unwrap();
    let edited = RecipePlan::load(&path).unwrap();
    let planned = run("edited", true, edited.over(nvfp4_plain()).unwrap());
    let current = run("edited_current", true, Float8CurrentScaling::default());
    assert!(planned.of(1, Gemm::Fprop) == current.of(1, Gemm::Fprop));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The plan error of a result, or a panic naming what came instead.
fn plan_error<T: std::fmt::Debug>(result: Result<T, TeError>) -> burn_te::PlanError {
    match result {
        Err(TeError::Plan(err)) => err,
        other => panic!("expected a plan error, got {other:?}"),
    }
}

#[test]
fn bad_plans_name_the_file_rule_key_and_line() {
    // An unknown recipe: the rule's `recipe` line.
    let text = "rules:\n  - name: first\n    layers:\n      layer_types: [fc1]\n    recipe: nvfp4\n  - name: typo\n    layers:\n      layer_types: [fc2]\n    recipe: nvfp5\n";
    let err = RecipePlan::from_yaml(text).unwrap_err();
    assert_eq!(err.location.rule.as_deref(), Some("typo"));
    assert_eq!(err.location.key.as_deref(), Some("recipe"));
    assert_eq!(err.location.line, Some(9), "{err}");
    assert!(err.reason.contains("unknown recipe \"nvfp5\""), "{err}");
    assert!(
        err.reason.contains("mxfp8"),
        "names the known recipes: {err}"
    );

    // A misspelt key is not ignored.
    let err =
        RecipePlan::from_yaml(&text.replace("recipe: nvfp5", "recipe: mxfp8\n    gemm: [fprop]"))
            .unwrap_err();
    assert!(err.reason.contains("unknown field `gemm`"), "{err}");
    assert_eq!(err.location.line, Some(10), "{err}");

    // An option of another recipe.
    let text_options = "rules:\n  - name: opts\n    layers:\n      layer_types: [fc1]\n    recipe: mxfp8\n    options:\n      margin: 1\n";
    let err = RecipePlan::from_yaml(text_options).unwrap_err();
    assert_eq!(err.location.line, Some(6), "{err}");
    assert!(
        err.reason.contains("margin applies to fp8_delayed_scaling"),
        "{err}"
    );

    // A selector matching no layer of the model: found when the first scope ends, with the file and line.
    let dir = std::env::temp_dir().join(format!("burn-te-bad-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("nothing.yaml");
    std::fs::write(
        &path,
        "rules:\n  - name: matches\n    layers:\n      layer_name_regex_pattern: '^bad\\.'\n    recipe: mxfp8\n\n  - name: nothing\n    layers:\n      exact_layer_names: [no_such_layer]\n    recipe: mxfp8\n",
    )
    .unwrap();
    let planned = RecipePlan::load_over(&path, Float8CurrentScaling::default()).unwrap();
    let l = layer("bad", "a", 0);
    let x = tensor::<B, 2>(vec![0.5; TOKENS * IN], [TOKENS, IN], &Default::default());
    let err = plan_error(fp8_autocast(true, planned.clone(), || l.forward(x.clone())));
    assert_eq!(err.location.rule.as_deref(), Some("nothing"));
    assert_eq!(err.location.line, Some(8), "{err}");
    assert_eq!(
        err.location.file.as_deref(),
        Some(path.display().to_string().as_str())
    );
    assert!(
        err.reason.contains("selects no layer") && err.reason.contains("bad.a"),
        "{err}"
    );
    assert_eq!(planned.unmatched(), vec!["nothing".to_string()]);

    // A role delayed scaling cannot take: a delayed dgrad whose fprop records no amax. The forward names the
    // layer and the rules.
    std::fs::write(
        &path,
        "rules:\n  - name: forward_current\n    layers:\n      layer_name_regex_pattern: '\\.a$'\n    gemms: [fprop]\n    recipe: fp8_current_scaling\n",
    )
    .unwrap();
    let planned = RecipePlan::load_over(&path, DelayedScaling::default()).unwrap();
    let err = plan_error(fp8_autocast(true, planned, || l.try_forward(x.clone())).unwrap());
    assert!(err.reason.contains("layer \"bad.a\""), "{err}");
    assert!(
        err.reason
            .contains("dgrad runs fp8_delayed_scaling (the scope's recipe)"),
        "{err}"
    );
    assert!(
        err.reason
            .contains("fprop runs fp8_current_scaling (rule \"forward_current\")"),
        "{err}"
    );
    assert!(err.to_string().contains("nothing.yaml:6"), "{err}");

    // Two rules of one name.
    let twice = "rules:\n  - name: same\n    layers: {layer_types: [fc1]}\n    recipe: mxfp8\n  - name: same\n    layers: {layer_types: [fc2]}\n    recipe: mxfp8\n";
    assert!(
        RecipePlan::from_yaml(twice)
            .unwrap_err()
            .reason
            .contains("two rules")
    );
    let _ = std::fs::remove_dir_all(&dir);
}
