//! The precision advisor: on a model whose last layer takes inputs with a few outlier channels (hundreds of times
//! the rest, as the outlier features of large LMs), it ranks that layer's fprop first, keeps it in high precision
//! within the FLOP budget, and its YAML loads through the debug config and routes that GEMM to high precision; its
//! recipe plan gives that GEMM a finer format than NVFP4 and leaves the others in NVFP4, from candidate SQNRs that
//! equal each recipe's own GEMM on the same tensors.

use burn::module::Initializer;
use burn::tensor::{Tensor, TensorData};
use burn_te::nn::LinearConfig;
use burn_te::plan::{RecipePlan, recipe_named};
use burn_te::{Gemm, NVFP4BlockScaling, fp8_autocast};
use burn_te_debug::TensorName;
use burn_te_debug::advisor::{Advisor, AdvisorOptions, PlanBound, PlanOptions, kurtosis};
use burn_te_debug::config::{Config, Namespace};
use burn_te_debug::stats::StatValue;

use crate::debug::{B, SESSION, start_session};

/// (name, in, out, outlier channels) of the outlier model.
const LAYERS: [(&str, usize, usize, bool); 3] = [
    ("fc0", 64, 64, false),
    ("fc1", 64, 64, false),
    ("fc_out", 64, 32, true),
];
const TOKENS: usize = 32;

/// What a probe run of the outlier model gives: the stats, the layers, each step's inputs and the largest
/// kurtosis of the outlier layer's input.
struct Probe {
    stats: Vec<(u64, StatValue)>,
    modules: Vec<burn_te::nn::Linear<B>>,
    inputs: Vec<Vec<Vec<f32>>>,
    outlier_kurtosis: f64,
}

/// `steps` steps of three layers under NVFP4 with the advisor's config, the last layer's inputs with a few outlier
/// channels (hundreds of times the rest, as the outlier features of large LMs).
fn probe(name: &str, steps: usize) -> Probe {
    let config = Advisor::config(".*", 1).unwrap();
    let (_dir, collect) = start_session(name, &config);
    let device = Default::default();
    let modules: Vec<_> = LAYERS
        .iter()
        .map(|&(name, d_in, d_out, _)| {
            LinearConfig::new(d_in, d_out)
                .with_name(Some(name.into()))
                .init::<B>(&device)
        })
        .collect();
    let mut rng = crate::common::Rng::new(7);
    let mut outlier_kurtosis = f64::NEG_INFINITY;
    let mut inputs = Vec::new();
    for _ in 0..steps {
        let mut loss = None;
        let mut step_inputs = Vec::new();
        for (&(_, d_in, d_out, outliers), layer) in LAYERS.iter().zip(&modules) {
            let mut x = rng.normal(TOKENS * d_in, 0.0, 1.0);
            if outliers {
                for row in 0..TOKENS {
                    for channel in [3, 17, 40, 59] {
                        x[row * d_in + channel] *= 300.0;
                    }
                }
                outlier_kurtosis = outlier_kurtosis.max(kurtosis(&x));
            }
            step_inputs.push(x.clone());
            let x = Tensor::<B, 2>::from_data(TensorData::new(x, [TOKENS, d_in]), &device)
                .require_grad();
            let g = rng.normal(TOKENS * d_out, 0.0, 1.0);
            let g = Tensor::<B, 2>::from_data(TensorData::new(g, [TOKENS, d_out]), &device);
            let y = fp8_autocast(true, NVFP4BlockScaling::default(), || layer.forward(x)).unwrap();
            let term = (y * g).sum();
            loss = Some(match loss {
                None => term,
                Some(loss) => loss + term,
            });
        }
        inputs.push(step_inputs);
        loss.unwrap().backward();
        burn_te_debug::step().unwrap();
    }
    burn_te_debug::end().unwrap();
    let stats = collect.0.lock().unwrap().clone();
    Probe {
        stats,
        modules,
        inputs,
        outlier_kurtosis,
    }
}

#[test]
fn the_advisor_ranks_the_outlier_layer_first_and_its_yaml_round_trips() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let steps = 3;
    let Probe {
        stats,
        outlier_kurtosis,
        ..
    } = probe("advisor", steps);
    let (layers, tokens) = (LAYERS, TOKENS);
    let advice = Advisor::advise(&stats, AdvisorOptions::default());
    assert_eq!(advice.steps, steps);
    assert_eq!(advice.ranked.len(), 9, "{:#?}", advice.ranked);
    let first = &advice.ranked[0];
    assert_eq!(
        (first.layer.as_str(), first.gemm),
        ("fc_out", Gemm::Fprop),
        "{}",
        advice.to_yaml()
    );
    // The outliers flush most of the other values of their NVFP4 blocks to zero. The output's SQNR does not show
    // it (the outlier channels carry most of the output's energy, and they are quantized well): the underflows
    // and the kurtosis rank it first.
    for other in advice
        .ranked
        .iter()
        .filter(|e| e.gemm == Gemm::Fprop && e.layer != "fc_out")
    {
        assert!(
            first.underflows > 5.0 * other.underflows,
            "{first:?} vs {other:?}"
        );
        assert!(first.score > 5.0 * other.score, "{first:?} vs {other:?}");
    }
    // The probe's kurtosis is the activation's, recomputed here in f64 (the largest over the steps).
    assert!(
        (first.kurtosis - outlier_kurtosis).abs() <= 1e-9 * outlier_kurtosis,
        "{} vs {outlier_kurtosis}",
        first.kurtosis
    );
    // FLOPs: 2·tokens·in·out per GEMM; fc_out's fprop is 2048 / (3 · 10240) of the total, within the 10 % budget,
    // and no second GEMM fits beside it.
    assert_eq!(first.flops, (2 * tokens * 64 * 32) as f64);
    assert_eq!(advice.chosen, vec![0]);
    assert!(
        (advice.fraction - 2048.0 / 30720.0).abs() < 1e-12,
        "{}",
        advice.fraction
    );

    // The YAML loads through the config loader and routes exactly the chosen GEMM to high precision.
    let yaml = advice.to_yaml();
    let config = Config::parse(&yaml, "advisor.yaml").unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    for (name, ..) in layers {
        let section = config.section_for(name, None).unwrap();
        for gemm in [Gemm::Fprop, Gemm::Dgrad, Gemm::Wgrad] {
            let fp8 = section.is_none_or(|s| {
                s.features
                    .iter()
                    .filter_map(|f| f.fp8_gemm_enabled(name, gemm, 0))
                    .all(|r| r.enabled)
            });
            assert_eq!(
                fp8,
                !(name == "fc_out" && gemm == Gemm::Fprop),
                "{name} {gemm:?}\n{yaml}"
            );
        }
    }
    // TE's newer names load too.
    let newer = Advisor::advise(
        &stats,
        AdvisorOptions {
            new_names: true,
            budget: 1.0,
            good_enough_db: f64::INFINITY,
        },
    );
    let yaml = newer.to_yaml();
    assert!(yaml.contains("DisableQuantizationLayer:"), "{yaml}");
    Config::parse(&yaml, "advisor_new_names.yaml").unwrap_or_else(|e| panic!("{e}\n{yaml}"));
}

/// The values of a tensor.
fn host<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

#[test]
fn the_advisor_plan_gives_the_outlier_layer_a_finer_format_from_candidates_on_the_same_tensors() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let steps = 3;
    let probe = probe("advisor_plan", steps);
    let base = burn_te::Recipe::from(NVFP4BlockScaling::default());
    // Each candidate's logged SQNR is its own FP8 GEMM on the step's tensors: recomputed here for the outlier
    // layer's fprop at every step, the layer run under the candidate alone against x·W + b in f64.
    let layer = &probe.modules[2];
    let (d_in, d_out) = (LAYERS[2].1, LAYERS[2].2);
    let w = host(layer.weight.val());
    let b = host(layer.bias.as_ref().unwrap().val());
    for recipe in ["nvfp4", "fp8_current_scaling", "fp8_block_scaling", "mxfp8"] {
        let logged: Vec<f64> = probe
            .stats
            .iter()
            .filter(|(_, v)| {
                v.layer == "fc_out"
                    && v.tensor == Some(TensorName::Output)
                    && v.stat == format!("{recipe}_sqnr")
            })
            .map(|(_, v)| v.value)
            .collect();
        assert_eq!(logged.len(), steps, "{recipe}");
        let candidate = recipe_named(recipe, None, &base).unwrap().unwrap();
        for (step, inputs) in probe.inputs.iter().enumerate() {
            let x = &inputs[2];
            let xt = Tensor::<B, 2>::from_data(
                TensorData::new(x.clone(), [TOKENS, d_in]),
                &Default::default(),
            );
            let y = host(fp8_autocast(true, candidate.clone(), || layer.forward(xt)).unwrap());
            let (mut signal, mut noise) = (0.0f64, 0.0f64);
            for t in 0..TOKENS {
                for o in 0..d_out {
                    let r: f64 = (0..d_in)
                        .map(|i| f64::from(x[t * d_in + i]) * f64::from(w[i * d_out + o]))
                        .sum::<f64>()
                        + f64::from(b[o]);
                    signal += r * r;
                    noise += (f64::from(y[t * d_out + o]) - r).powi(2);
                }
            }
            let sqnr = 10.0 * (signal / noise).log10();
            assert!(
                (logged[step] - sqnr).abs() < 1e-3,
                "{recipe} step {step}: logged {} vs {sqnr}",
                logged[step]
            );
        }
    }

    let advice = Advisor::plan(&probe.stats, PlanOptions::over(base.clone()));
    let yaml = advice.to_yaml();
    assert_eq!(advice.choices.len(), 9, "{yaml}");
    assert_eq!(advice.options.bound, PlanBound::AtLeastDb(10.0));
    // The selection, recomputed from the candidates: of those with an effective SQNR of 10 dB or more (every GEMM
    // has one here), the narrowest format (4 bits, then 8), and of that width the best effective SQNR (on a tie,
    // the first in the candidates' order: block scaling and MXFP8 cost the same).
    let bits = |recipe: &str| if recipe == "nvfp4" { 4 } else { 8 };
    for choice in &advice.choices {
        let passing: Vec<_> = choice.candidates.iter().filter(|c| c.2 >= 10.0).collect();
        let width = passing.iter().map(|c| bits(&c.0)).min().unwrap();
        let expected = passing
            .iter()
            .filter(|c| bits(&c.0) == width)
            .min_by(|a, b| b.2.total_cmp(&a.2))
            .unwrap();
        assert_eq!(choice.chosen, expected.0, "{yaml}");
        // The GEMMs that take the outlier activation leave NVFP4; every other GEMM keeps it.
        let outlier = choice.layer == "fc_out" && choice.gemm != Gemm::Dgrad;
        assert_eq!(
            choice.chosen != "nvfp4",
            outlier,
            "{} {:?}\n{yaml}",
            choice.layer,
            choice.gemm
        );
    }
    assert!(!advice.fractions().contains_key("high_precision"), "{yaml}");
    // The file loads as the plan it describes, and runs the chosen recipe there.
    let plan = RecipePlan::from_yaml(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    assert_eq!(plan, advice.plan());
    let planned = plan.over(base).unwrap();
    let chosen = &advice
        .choices
        .iter()
        .find(|c| c.layer == "fc_out" && c.gemm == Gemm::Fprop)
        .unwrap()
        .chosen;
    let recipes = planned.layer("fc_out", Some("linear")).unwrap();
    assert_eq!(recipes.recipe(Gemm::Fprop).unwrap().name(), chosen);
    assert_eq!(recipes.recipe(Gemm::Dgrad).unwrap().name(), "nvfp4");
    println!("{yaml}");

    // An absolute bound no candidate reaches sends the worst GEMMs to high precision within the budget.
    let strict = Advisor::plan(
        &probe.stats,
        PlanOptions {
            bound: PlanBound::AtLeastDb(1000.0),
            budget: 0.10,
            ..PlanOptions::over(NVFP4BlockScaling::default())
        },
    );
    let share = strict
        .fractions()
        .get("high_precision")
        .copied()
        .unwrap_or(0.0);
    assert!(share > 0.0 && share <= 0.10 + 1e-12, "{}", strict.to_yaml());

    // A bound every GEMM misses, no high precision: each GEMM wants its best 8-bit candidate. At most 30 % of the
    // FLOPs may leave NVFP4's width: recomputed here, the GEMMs NVFP4 serves worst take their choice, in that
    // order, while their FLOPs fit; the others keep NVFP4.
    let options = |wider_budget| PlanOptions {
        bound: PlanBound::AtLeastDb(1000.0),
        budget: 0.0,
        wider_budget,
        ..PlanOptions::over(NVFP4BlockScaling::default())
    };
    let unlimited = Advisor::plan(&probe.stats, options(1.0));
    let limited = Advisor::plan(&probe.stats, options(0.3));
    let total: f64 = unlimited.choices.iter().map(|c| c.flops).sum();
    let under_nvfp4 = |c: &burn_te_debug::advisor::GemmChoice| {
        c.candidates.iter().find(|c| c.0 == "nvfp4").unwrap().2
    };
    let mut order: Vec<_> = unlimited.choices.iter().collect();
    order.sort_by(|a, b| under_nvfp4(a).total_cmp(&under_nvfp4(b)));
    let mut used = 0.0;
    let mut moved = 0;
    for want in order {
        let got = limited
            .choices
            .iter()
            .find(|c| (&c.layer, c.gemm) == (&want.layer, want.gemm))
            .unwrap();
        assert_ne!(want.chosen, "nvfp4");
        let expected = if (used + want.flops) / total <= 0.3 + 1e-12 {
            used += want.flops;
            moved += 1;
            want.chosen.as_str()
        } else {
            "nvfp4"
        };
        assert_eq!(
            got.chosen,
            expected,
            "{} {:?}\n{}",
            got.layer,
            got.gemm,
            limited.to_yaml()
        );
    }
    assert!(
        moved > 0 && moved < unlimited.choices.len(),
        "{moved} GEMMs moved"
    );
    assert!(
        limited.fractions()["nvfp4"] >= 0.7 - 1e-12,
        "{}",
        limited.to_yaml()
    );
    assert!(
        limited
            .to_yaml()
            .contains("at most 30.0 % of the FLOPs leave nvfp4's width")
    );
}

#[test]
fn a_zero_output_logs_sqnr_inf_and_is_not_chosen() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let config = Advisor::config(".*", 1).unwrap();
    let (_dir, collect) = start_session("advisor_zero", &config);
    let device = Default::default();
    let zero = LinearConfig::new(32, 32)
        .with_name(Some("zero".into()))
        .with_initializer(Initializer::Zeros)
        .init::<B>(&device);
    let mut rng = crate::common::Rng::new(3);
    for _ in 0..2 {
        let x = Tensor::<B, 2>::from_data(
            TensorData::new(rng.normal(16 * 32, 0.0, 1.0), [16, 32]),
            &device,
        )
        .require_grad();
        let g = Tensor::<B, 2>::from_data(
            TensorData::new(rng.normal(16 * 32, 0.0, 1.0), [16, 32]),
            &device,
        );
        let y = fp8_autocast(true, NVFP4BlockScaling::default(), || zero.forward(x)).unwrap();
        (y * g).sum().backward();
        burn_te_debug::step().unwrap();
    }
    burn_te_debug::end().unwrap();
    let stats = collect.0.lock().unwrap().clone();
    let fprop: Vec<f64> = stats
        .iter()
        .filter(|(_, v)| {
            v.layer == "zero" && v.tensor == Some(TensorName::Output) && v.stat == "sqnr"
        })
        .map(|(_, v)| v.value)
        .collect();
    // x·0 = 0 in FP8 and in high precision: nothing lost (0/0 was NaN).
    assert_eq!(fprop, vec![f64::INFINITY; 2]);
    let advice = Advisor::advise(
        &stats,
        AdvisorOptions {
            budget: 1.0,
            good_enough_db: f64::INFINITY,
            new_names: false,
        },
    );
    for &index in &advice.chosen {
        assert!(
            advice.ranked[index].gemm == Gemm::Wgrad,
            "{}",
            advice.to_yaml()
        );
    }
    assert!(
        advice.ranked.iter().all(|e| !e.score.is_nan()),
        "{:?}",
        advice.ranked
    );
}

#[test]
fn quotes_in_layer_names_stay_valid_yaml_and_the_probe_is_built_in() {
    // A pattern and a layer name with a quote.
    let config = Advisor::config("it's", 1).unwrap();
    Config::parse(&config, "advisor_quote.yaml").unwrap_or_else(|e| panic!("{e}\n{config}"));
    let stat = |stat: &str, value: f64| {
        (
            0,
            StatValue {
                name: format!("it's.fc_output_{stat}"),
                layer: "it's.fc".into(),
                tensor: Some(TensorName::Output),
                stat: stat.into(),
                value,
            },
        )
    };
    // The probe's FLOP scalars of the layer.
    let scalar = |suffix: &str, value: f64| {
        (
            0,
            StatValue {
                name: format!("it's.fc_{suffix}"),
                layer: "it's.fc".into(),
                tensor: None,
                stat: suffix.into(),
                value,
            },
        )
    };
    let advice = Advisor::advise(
        &[
            stat("sqnr", 5.0),
            scalar("activation_elements", 64.0),
            scalar("weight_out", 8.0),
        ],
        AdvisorOptions {
            budget: 1.0,
            ..AdvisorOptions::default()
        },
    );
    let yaml = advice.to_yaml();
    let parsed =
        Config::parse(&yaml, "advice_quote.yaml").unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    assert!(
        parsed.section_for("it's.fc", None).unwrap().is_some(),
        "{yaml}"
    );
    let plan = Advisor::plan(
        &[
            stat("sqnr", 5.0),
            stat("mxfp8_sqnr", 30.0),
            stat("nvfp4_sqnr", 5.0),
        ],
        PlanOptions::over(NVFP4BlockScaling::default()),
    );
    let yaml = plan.to_yaml();
    let loaded = RecipePlan::from_yaml(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    let planned = loaded.over(NVFP4BlockScaling::default()).unwrap();
    assert_eq!(
        planned
            .layer("it's.fc", None)
            .unwrap()
            .recipe(Gemm::Fprop)
            .unwrap()
            .name(),
        "mxfp8",
        "{yaml}"
    );
    // The probe is a built-in feature: nothing registers it at run time (a first registration's error can no
    // longer hide behind a `Once`), and a second one is refused by name.
    let taken = burn_te_debug::features::register_feature(Namespace::Base, "AdvisorProbe", |_| {
        unreachable!("never built")
    });
    assert!(taken.is_err(), "AdvisorProbe must be built in");
}
