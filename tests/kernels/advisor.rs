//! The precision advisor: on a model whose last layer takes inputs with a few outlier channels (hundreds of times
//! the rest, as the outlier features of large LMs), it ranks that layer's fprop first, keeps it in high precision
//! within the FLOP budget, and its YAML loads through the debug config and routes that GEMM to high precision.

use burn::tensor::{Tensor, TensorData};
use burn_te::nn::LinearConfig;
use burn_te::{Gemm, NVFP4BlockScaling, fp8_autocast};
use burn_te_debug::advisor::{Advisor, AdvisorOptions, kurtosis};
use burn_te_debug::config::Config;

use crate::debug::{B, SESSION, start_session};

#[test]
fn the_advisor_ranks_the_outlier_layer_first_and_its_yaml_round_trips() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let config = Advisor::config(".*", 1).unwrap();
    let (_dir, collect) = start_session("advisor", &config);
    let device = Default::default();
    let tokens = 32;
    // (name, in, out, outlier channels)
    let layers = [
        ("fc0", 64, 64, false),
        ("fc1", 64, 64, false),
        ("fc_out", 64, 32, true),
    ];
    let modules: Vec<_> = layers
        .iter()
        .map(|&(name, d_in, d_out, _)| {
            LinearConfig::new(d_in, d_out)
                .with_name(Some(name.into()))
                .init::<B>(&device)
        })
        .collect();
    let mut rng = crate::common::Rng::new(7);
    let mut outlier_kurtosis = f64::NEG_INFINITY;
    let steps = 3;
    for _ in 0..steps {
        let mut loss = None;
        for (&(name, d_in, d_out, outliers), layer) in layers.iter().zip(&modules) {
            let mut x = rng.normal(tokens * d_in, 0.0, 1.0);
            if outliers {
                for row in 0..tokens {
                    for channel in [3, 17, 40, 59] {
                        x[row * d_in + channel] *= 300.0;
                    }
                }
                outlier_kurtosis = outlier_kurtosis.max(kurtosis(&x));
            }
            let _ = name;
            let x = Tensor::<B, 2>::from_data(TensorData::new(x, [tokens, d_in]), &device)
                .require_grad();
            let g = rng.normal(tokens * d_out, 0.0, 1.0);
            let g = Tensor::<B, 2>::from_data(TensorData::new(g, [tokens, d_out]), &device);
            let y = fp8_autocast(true, NVFP4BlockScaling::default(), || layer.forward(x)).unwrap();
            let term = (y * g).sum();
            loss = Some(match loss {
                None => term,
                Some(loss) => loss + term,
            });
        }
        loss.unwrap().backward();
        burn_te_debug::step().unwrap();
    }
    burn_te_debug::end().unwrap();

    let stats = collect.0.lock().unwrap().clone();
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
