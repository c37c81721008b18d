//! burn-te-debug: config loading and errors, selectors, schedules, routing, and the Debug<B> decorator end to end
//! (statistics against f64 host recomputations, micro-batches, log files).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once};

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Distribution, Tensor};
use burn_te::nn::LinearConfig;
use burn_te::{DelayedScaling, Gemm, Te, fp8_autocast};
use burn_te_debug::config::{Config, Schedule, layer_number};
use burn_te_debug::features::{
    DebugTensor, Feature, Inspection, Namespace, Routing, register_feature,
};
use burn_te_debug::stats::StatValue;
use burn_te_debug::{ConfigErrorKind, Debug, DebugError, DebugOptions, StatLogger, TensorName};

/// TE's test configs (a verbatim copy of `shared/conformance/te-configs` kept in the repository).
const CONFIGS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/te-configs");

/// The debug session is global: tests that use it run one at a time.
pub(crate) static SESSION: Mutex<()> = Mutex::new(());

/// TE's test feature `TestDummyFeature`: takes tensors, gemms and `inspect_only_once`, does nothing.
struct TestDummyFeature;
impl Feature for TestDummyFeature {
    fn name(&self) -> &str {
        "TestDummyFeature"
    }
}

/// TE's documented custom feature: logs the percentage of |x| > threshold.
struct PercentageGreaterThanThreshold {
    threshold: f64,
    schedule: Schedule,
}
impl Feature for PercentageGreaterThanThreshold {
    fn name(&self) -> &str {
        "PercentageGreaterThanThreshold"
    }
    fn inspect_tensor_enabled(&self, _: &str, tensor: TensorName, it: u64) -> Option<Routing> {
        (tensor == TensorName::Activation).then(|| Routing {
            enabled: self.schedule.runs_at(it),
            next: self.schedule.next_after(it),
        })
    }
    fn inspect_tensor(
        &self,
        layer: &str,
        tensor: TensorName,
        x: &dyn DebugTensor,
        _: u64,
        out: &mut Inspection,
    ) -> Result<(), DebugError> {
        let values = x.to_vec()?;
        let count = values
            .iter()
            .filter(|v| (v.abs() as f64) > self.threshold)
            .count();
        out.log_scalar(
            format!("{layer}_{tensor}_percentage_greater_than_threshold"),
            count as f64 / values.len() as f64,
        );
        Ok(())
    }
}

fn register_test_features() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        use burn_te_debug::config::Need;
        register_feature(Namespace::TransformerEngine, "TestDummyFeature", |spec| {
            spec.items(
                Need::Optional,
                Need::Optional,
                &TensorName::ALL,
                Some(&["inspect_only_once"]),
            )?;
            Ok(Box::new(TestDummyFeature))
        })
        .unwrap();
        register_feature(
            Namespace::TransformerEngine,
            "PercentageGreaterThanThreshold",
            |spec| {
                let keys = [
                    "threshold",
                    "freq",
                    "start_step",
                    "end_step",
                    "start_end_list",
                ];
                let items = spec.items(
                    Need::No,
                    Need::Required,
                    &[TensorName::Activation],
                    Some(&keys),
                )?;
                let item = &items[0];
                Ok(Box::new(PercentageGreaterThanThreshold {
                    threshold: item.f64("threshold")?.unwrap_or(0.0),
                    schedule: item.schedule()?,
                }))
            },
        )
        .unwrap();
    });
}

#[test]
fn every_te_config_loads() {
    register_test_features();
    let mut count = 0;
    for entry in std::fs::read_dir(CONFIGS).unwrap() {
        let path = entry.unwrap().path();
        let config = Config::from_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(!config.sections.is_empty(), "{}", path.display());
        count += 1;
    }
    assert_eq!(count, 11, "all TE test configs");
}

fn error_of(yaml: &str) -> burn_te_debug::ConfigError {
    register_test_features();
    match Config::parse(yaml, "bad.yaml") {
        Ok(_) => panic!("expected an error for:\n{yaml}"),
        Err(err) => err,
    }
}

const SECTION: &str =
    "sec:\n  enabled: True\n  layers:\n    layer_types: [fc1]\n  transformer_engine:\n";

#[test]
fn bad_configs_name_section_feature_key_and_line() {
    let err = error_of(&format!(
        "{SECTION}    NoSuchFeature:\n      enabled: True\n"
    ));
    assert!(
        matches!(err.kind, ConfigErrorKind::UnknownFeature { ref feature, .. } if feature == "NoSuchFeature")
    );
    assert_eq!(err.location.section.as_deref(), Some("sec"));
    assert_eq!(err.location.line, Some(6));

    let err = error_of(&format!(
        "{SECTION}    LogTensorStats:\n      enabled: True\n      tensors: [activation]\n      stats: [min, maxx]\n"
    ));
    assert!(
        matches!(err.kind, ConfigErrorKind::UnknownStat { ref stat, .. } if stat == "maxx"),
        "{err}"
    );
    assert_eq!(
        err.location.feature.as_deref(),
        Some("transformer_engine.LogTensorStats")
    );
    assert_eq!(
        (err.location.key.as_deref(), err.location.line),
        (Some("stats"), Some(9))
    );
    // An error in a struct entry names that entry's line, not the first line with the same key.
    let err = error_of(&format!(
        "{SECTION}    LogTensorStats:\n      enabled: True\n      tensors_struct:\n        - tensor: activation\n          stats: [min]\n        - tensor: gradient\n          stats: [minn]\n"
    ));
    assert!(
        matches!(err.kind, ConfigErrorKind::UnknownStat { ref stat, .. } if stat == "minn"),
        "{err}"
    );
    assert_eq!(
        (err.location.key.as_deref(), err.location.line),
        (Some("stats"), Some(12))
    );
    let err = error_of(&format!(
        "{SECTION}    LogTensorStats:\n      enabled: True\n      freq: 2\n      tensors_struct:\n        - tensor: activation\n          stats: [min]\n          freq: 0\n"
    ));
    assert_eq!(
        (err.location.key.as_deref(), err.location.line),
        (Some("freq"), Some(12)),
        "{err}"
    );
    // A key the entry inherits: the feature's line of it.
    let err = error_of(&format!(
        "{SECTION}    LogTensorStats:\n      enabled: True\n      freq: -1\n      tensors_struct:\n        - tensor: activation\n          stats: [min]\n"
    ));
    assert_eq!(
        (err.location.key.as_deref(), err.location.line),
        (Some("freq"), Some(8)),
        "{err}"
    );
    // A per-tensor scale has one orientation: no `_columnwise` for the per-tensor what-ifs (TE rejects it too).
    let err = error_of(&format!(
        "{SECTION}    LogFp8TensorStats:\n      enabled: True\n      tensors: [activation]\n      stats: [mxfp8_mse_columnwise, fp8_current_scaling_underflows%_columnwise]\n"
    ));
    assert!(
        matches!(err.kind, ConfigErrorKind::UnknownStat { ref stat, ref known }
            if stat == "fp8_current_scaling_underflows%_columnwise" && known.contains("mxfp8_mse_columnwise")),
        "{err}"
    );

    // TE checks every feature name of an enabled section, the disabled features' too.
    let err = error_of(&format!(
        "{SECTION}    LogTensorStatz:\n      enabled: False\n"
    ));
    assert!(
        matches!(err.kind, ConfigErrorKind::UnknownFeature { ref feature, .. } if feature == "LogTensorStatz"),
        "{err}"
    );
    assert_eq!(err.location.line, Some(6));
    // TE sets max_over_orientations from the tensor and refuses the key; so do we. And overflows% is TE's for
    // delayed scaling only: the current, MXFP8 and block what-ifs are refused.
    let err = error_of(&format!(
        "{SECTION}    LogTensorStats:\n      enabled: True\n      tensors: [gradient]\n      stats: [{{max_blockwise_dynamic_range: {{block_size: 3, max_over_orientations: true}}}}]\n"
    ));
    assert!(
        matches!(err.kind, ConfigErrorKind::InvalidValue(ref m) if m.contains("max_over_orientations is not a key")),
        "{err}"
    );
    for stat in [
        "fp8_current_scaling_overflows%",
        "mxfp8_overflows%",
        "fp8_block_scaling_overflows%_columnwise",
    ] {
        let err = error_of(&format!(
            "{SECTION}    LogFp8TensorStats:\n      enabled: True\n      tensors: [activation]\n      stats: [fp8_delayed_scaling_overflows%, nvfp4_overflows%, {stat}]\n"
        ));
        assert!(
            matches!(err.kind, ConfigErrorKind::UnknownStat { stat: ref s, .. } if s == stat),
            "{err}"
        );
    }
    // `enabled` belongs to the feature, not to a gemms_struct item (TE asserts it).
    let err = error_of(&format!(
        "{SECTION}    FakeQuant:\n      enabled: True\n      quant_format: FP8E4M3\n      gemms_struct:\n        - gemm: fprop\n          enabled: False\n          tensors: [activation]\n"
    ));
    assert!(
        matches!(err.kind, ConfigErrorKind::InvalidValue(ref m) if m.contains("gemms_struct")),
        "{err}"
    );
    assert_eq!(
        (err.location.key.as_deref(), err.location.line),
        (Some("gemms_struct"), Some(9))
    );

    let err = error_of(&format!(
        "{SECTION}    DisableFP8GEMM:\n      enabled: True\n      gemms: [fprop, xgrad]\n"
    ));
    assert_eq!(err.kind, ConfigErrorKind::UnknownGemm("xgrad".into()));
    assert_eq!(err.location.line, Some(8));

    let err = error_of(&format!(
        "{SECTION}    LogFp8TensorStats:\n      enabled: True\n      tensors: [output]\n      stats: [mse]\n"
    ));
    assert!(
        matches!(err.kind, ConfigErrorKind::UnknownTensor { ref tensor, .. } if tensor == "output"),
        "{err}"
    );

    let err = error_of(&format!(
        "{SECTION}    DisableFP8GEMM:\n      enabled: True\n      gemms: [fprop]\n      margin: 2\n"
    ));
    assert_eq!(err.kind, ConfigErrorKind::UnexpectedKey("margin".into()));
    assert_eq!(
        err.to_string(),
        "bad.yaml:9, section \"sec\", feature \"transformer_engine.DisableFP8GEMM\", key \"margin\": Unexpected key in config: \"margin\""
    );

    let err = error_of("sec:\n  layers:\n    layer_types: [fc1]\n");
    assert_eq!(err.kind, ConfigErrorKind::MissingKey("enabled".into()));
    let err = error_of(&format!(
        "{SECTION}    DisableFP8Layer:\n      gemms: [fprop]\n"
    ));
    assert_eq!(err.kind, ConfigErrorKind::MissingKey("enabled".into()));
    assert_eq!(
        err.location.feature.as_deref(),
        Some("transformer_engine.DisableFP8Layer")
    );

    let err = error_of(
        "sec:\n  enabled: True\n  layers: {}\n  transformer_engine:\n    DisableFP8Layer:\n      enabled: True\n",
    );
    assert_eq!(err.kind, ConfigErrorKind::NoSelector);

    let err = error_of(
        "sec:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: 'fc(1'\n  transformer_engine:\n    DisableFP8Layer:\n      enabled: True\n",
    );
    assert!(matches!(err.kind, ConfigErrorKind::Regex(_)), "{err}");
    assert_eq!(
        (err.location.key.as_deref(), err.location.line),
        (Some("layer_name_regex_pattern"), Some(4))
    );

    let err = error_of("sec:\n  enabled: True\n  layers:\n    layer_typos: [fc1]\n");
    assert_eq!(
        err.kind,
        ConfigErrorKind::UnexpectedKey("layer_typos".into())
    );

    let err = error_of("sec:\n  enabled: True\n  layers: [fc1\n");
    assert!(matches!(err.kind, ConfigErrorKind::Syntax(_)), "{err}");
    assert!(err.location.line.is_some(), "{err}");

    // Overlapping sections are found when a layer is looked up.
    let two = "a:\n  enabled: True\n  layers:\n    layer_types: [fc]\n  transformer_engine:\n    DisableFP8Layer:\n      enabled: True\nb:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: fc1$\n  transformer_engine:\n    DisableFP8Layer:\n      enabled: True\n";
    let config = Config::parse(two, "two.yaml").unwrap();
    assert!(config.section_for("decoder.fc2", None).unwrap().is_some());
    let err = config.section_for("decoder.fc1", None).unwrap_err();
    assert!(
        matches!(err.kind, ConfigErrorKind::Overlap { ref first, ref second, .. } if first == "a" && second == "b")
    );
}

/// The iterations of 0..10 at which `feature` inspects `layer`'s activation.
fn activation_runs(feature: &dyn Feature, layer: &str) -> Vec<u64> {
    (0..10)
        .filter(|&i| {
            feature
                .inspect_tensor_enabled(layer, TensorName::Activation, i)
                .is_some_and(|r| r.enabled)
        })
        .collect()
}

#[test]
fn selectors_and_schedules_follow_te() {
    assert_eq!(layer_number("decoder.1.fc1"), Some(1));
    assert_eq!(layer_number("decoder.12.fc2"), Some(12));
    assert_eq!(layer_number("model.1.block.2"), None);
    let config = Config::parse(
        "s:\n  enabled: True\n  layers:\n    layer_numbers: [1, '3-4']\n    layer_types: [fc1, fc2]\n  transformer_engine:\n    DisableFP8Layer:\n      enabled: True\n",
        "x",
    )
    .unwrap();
    let picks = |name| config.section_for(name, None).unwrap().is_some();
    assert!(picks("decoder.1.fc1") && picks("decoder.4.fc2") && picks("decoder.3.fc1"));
    assert!(!picks("decoder.12.fc1") && !picks("decoder.2.fc1") && !picks("decoder.1.proj"));
    // Python's `re` syntax, as TE reads the pattern (with `search`): a negative look-ahead and a back-reference.
    for (pattern, picked, passed) in [
        ("^(?!.*fc2$)decoder", "decoder.1.fc1", "decoder.1.fc2"),
        (r"(\d)\.fc\1", "decoder.1.fc1", "decoder.1.fc2"),
    ] {
        let config = Config::parse(
            &format!("s:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: '{pattern}'\n  transformer_engine:\n    DisableFP8Layer:\n      enabled: True\n"),
            "x",
        )
        .unwrap();
        let picks = |name| config.section_for(name, None).unwrap().is_some();
        assert!(picks(picked) && !picks(passed), "{pattern}");
    }

    // TE: freq counts from 0, both ends inclusive.
    let s = Schedule {
        freq: 3,
        ranges: vec![(1, 9)],
    };
    let runs: Vec<u64> = (0..12).filter(|&i| s.runs_at(i)).collect();
    assert_eq!(runs, [3, 6, 9]);
    assert_eq!(
        (s.next_after(0), s.next_after(3), s.next_after(9)),
        (Some(3), Some(6), None)
    );
    let s = Schedule {
        freq: 1,
        ranges: vec![(2, 3), (7, 7)],
    };
    assert_eq!((s.next_after(3), s.next_after(7)), (Some(7), None));

    // YAML merge keys, as TE's reader (PyYAML) applies them: a section's own keys win over the merged ones.
    let config = Config::parse(
        "s:\n  enabled: True\n  layers:\n    layer_types: [fc1]\n  transformer_engine:\n    LogTensorStats: &stats\n      enabled: True\n      tensors: [activation]\n      stats: [max]\n      freq: 3\nt:\n  enabled: True\n  layers:\n    layer_types: [fc2]\n  transformer_engine:\n    LogTensorStats:\n      <<: *stats\n      freq: 2\n",
        "x",
    )
    .unwrap();
    for (section, layer, expected) in [
        (0, "fc1", vec![0, 3, 6, 9]),
        (1, "fc2", vec![0, 2, 4, 6, 8]),
    ] {
        let feature = &config.sections[section].features[0];
        let runs = activation_runs(feature.as_ref(), layer);
        assert_eq!(runs, expected, "section {section}");
    }

    // An empty start_end_list is no list (TE's `if start_end_list:`): start_step and end_step apply.
    for (list, expected) in [("[]", vec![2, 4]), ("[[5, 6]]", vec![6])] {
        let config = Config::parse(
            &format!("s:\n  enabled: True\n  layers:\n    layer_types: [fc1]\n  transformer_engine:\n    LogTensorStats:\n      enabled: True\n      tensors: [activation]\n      stats: [max]\n      freq: 2\n      start_step: 1\n      end_step: 4\n      start_end_list: {list}\n"),
            "x",
        )
        .unwrap();
        let feature = &config.sections[0].features[0];
        let runs = activation_runs(feature.as_ref(), "fc1");
        assert_eq!(runs, expected, "start_end_list: {list}");
    }
}

#[test]
fn routing_answers_match_te_configs() {
    register_test_features();
    let config = Config::from_file(Path::new(CONFIGS).join("disable_fp8_gemms.yaml")).unwrap();
    let section = config
        .section_for("decoder.1.self_attention.qkv", None)
        .unwrap()
        .unwrap();
    let fp8 = |gemm| {
        section.features[0]
            .fp8_gemm_enabled("x", gemm, 0)
            .map(|r| r.enabled)
    };
    assert_eq!(
        (fp8(Gemm::Fprop), fp8(Gemm::Dgrad), fp8(Gemm::Wgrad)),
        (None, Some(false), Some(false))
    );

    let config = Config::from_file(Path::new(CONFIGS).join("per_tensor_scaling.yaml")).unwrap();
    let section = config.section_for("decoder.1.fc1", None).unwrap().unwrap();
    assert!(config.section_for("decoder.2.fc1", None).unwrap().is_none());
    let modify = |gemm, tensor| {
        section
            .features
            .iter()
            .filter_map(|f| f.modify_tensor_enabled("x", gemm, tensor, 0))
            .any(|r| r.enabled)
    };
    assert!(modify(Gemm::Fprop, TensorName::Activation) && modify(Gemm::Fprop, TensorName::Weight));
    assert!(modify(Gemm::Dgrad, TensorName::Gradient) && !modify(Gemm::Dgrad, TensorName::Weight));
    assert!(!modify(Gemm::Wgrad, TensorName::Activation));
    let wgrad = section
        .features
        .iter()
        .filter_map(|f| f.fp8_gemm_enabled("x", Gemm::Wgrad, 0))
        .any(|r| !r.enabled);
    assert!(wgrad, "DisableFP8GEMM wgrad");

    let config =
        Config::from_file(Path::new(CONFIGS).join("fake_quantization_config.yaml")).unwrap();
    let section = config.section_for("decoder.1.fc2", None).unwrap().unwrap();
    let f = &section.features[0];
    assert_eq!(
        f.fp8_gemm_enabled("x", Gemm::Fprop, 0).map(|r| r.enabled),
        Some(false)
    );
    assert_eq!(f.fp8_gemm_enabled("x", Gemm::Wgrad, 0), None);
    assert!(
        f.modify_tensor_enabled("x", Gemm::Dgrad, TensorName::Gradient, 0)
            .unwrap()
            .enabled
    );
    assert!(
        f.modify_tensor_enabled("x", Gemm::Fprop, TensorName::Weight, 0)
            .is_none()
    );
}

/// Collects each step's values.
#[derive(Clone, Default)]
pub(crate) struct Collect(pub(crate) std::sync::Arc<Mutex<Vec<(u64, StatValue)>>>);
impl StatLogger for Collect {
    fn log(&mut self, iteration: u64, values: &[StatValue]) {
        let mut all = self.0.lock().unwrap();
        all.extend(values.iter().map(|v| (iteration, v.clone())));
    }
}

/// The debug main log written under `dir`.
pub(crate) fn main_log(dir: &Path) -> String {
    let path = dir.join("nvdlfw_inspect_logs/nvdlfw_inspect_globalrank-0.log");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub(crate) fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-te-debug-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A debug session on the YAML `config`, logging into a fresh temp dir `name` (returned), its stats also collected.
pub(crate) fn start_session(name: &str, config: &str) -> (PathBuf, Collect) {
    let dir = temp_dir(name);
    let path = dir.join("config.yaml");
    std::fs::write(&path, config).unwrap();
    let collect = Collect::default();
    burn_te_debug::initialize(
        DebugOptions::new(&path)
            .log_dir(&dir)
            .logger(collect.clone()),
    )
    .unwrap();
    (dir, collect)
}

fn f64_stats(values: &[f32]) -> (f64, f64, f64, f64, f64) {
    let v: Vec<f64> = values.iter().map(|&x| x as f64).collect();
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
    let min = v.iter().cloned().fold(f64::INFINITY, f64::min);
    let max = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    (min, max, mean, std, v.iter().map(|x| x.abs()).sum())
}

/// [`f64_stats`] by LogTensorStats' names: min, max, mean, std, l1_norm.
fn f64_named_stats(values: &[f32]) -> [(&'static str, f64); 5] {
    let (min, max, mean, std, l1) = f64_stats(values);
    [
        ("min", min),
        ("max", max),
        ("mean", mean),
        ("std", std),
        ("l1_norm", l1),
    ]
}

pub(crate) type B = Autodiff<Debug<Te<NdArray>>>;

#[test]
fn debug_decorator_routes_logs_and_merges_micro_batches() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let dir = temp_dir("e2e");
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        "fc1_hp:\n  enabled: True\n  layers:\n    layer_types: [fc1]\n  transformer_engine:\n    DisableFP8GEMM:\n      enabled: True\n      gemms: [fprop]\n\
stats:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: 'fc0$'\n  transformer_engine:\n    LogTensorStats:\n      enabled: True\n      stats: [min, max, mean, std, l1_norm]\n      tensors: [activation, weight]\n      start_step: 1\n    LogFp8TensorStats:\n      enabled: True\n      stats: [underflows%, fp8_current_scaling_mse]\n      tensors: [activation]\n      start_step: 1\n",
    )
    .unwrap();
    let collect = Collect::default();
    burn_te_debug::initialize(
        DebugOptions::new(&config)
            .log_dir(&dir)
            .logger(collect.clone()),
    )
    .unwrap();
    assert!(matches!(
        burn_te_debug::initialize(DebugOptions::without_config()),
        Err(DebugError::AlreadyInitialized)
    ));
    let device = Default::default();
    let fc0 = LinearConfig::new(16, 16)
        .with_name(Some("fc0".into()))
        .init::<B>(&device);
    let fc1 = LinearConfig::new(16, 8)
        .with_name(Some("fc1".into()))
        .init::<B>(&device);
    let mut inputs = Vec::new();
    for step in 0..2 {
        // Two micro-batches with different means in step 1.
        for shift in [0.0, 3.0] {
            let x = Tensor::<B, 2>::random([8, 16], Distribution::Normal(shift, 1.0), &device);
            if step == 1 {
                inputs.extend(x.clone().into_data().to_vec::<f32>().unwrap());
            }
            let y = fp8_autocast(true, DelayedScaling::default(), || {
                fc1.forward(fc0.forward(x))
            })
            .unwrap();
            y.sum().backward();
        }
        burn_te_debug::step().unwrap();
    }
    burn_te_debug::end().unwrap();

    let values = collect.0.lock().unwrap().clone();
    let get = |name: &str| {
        values
            .iter()
            .find(|(_, v)| v.name == name)
            .map(|(it, v)| (*it, v.value))
            .unwrap_or_else(|| panic!("{name} not logged: {values:?}"))
    };
    // Iteration 0 is before start_step: nothing logged.
    assert!(values.iter().all(|(it, _)| *it == 1), "{values:?}");
    for (stat, expected) in f64_named_stats(&inputs) {
        let (_, value) = get(&format!("fc0_activation_{stat}"));
        assert!(
            (value - expected).abs() <= 1e-4 * expected.abs().max(1.0),
            "{stat}: {value} vs {expected}"
        );
    }
    // Weight: first feed of the step only (its numel is one weight's).
    let weight = fc0.weight.val().into_data().to_vec::<f32>().unwrap();
    let (_, weight_l1) = get("fc0_weight_l1_norm");
    assert!((weight_l1 - f64_stats(&weight).4).abs() < 1e-3);
    let (_, underflows) = get("fc0_activation_underflows%");
    assert!((0.0..=100.0).contains(&underflows));
    assert!(get("fc0_activation_fp8_current_scaling_mse").1 > 0.0);

    let main = main_log(&dir);
    assert!(
        main.contains("INFO - Loaded configs for dict_keys(['fc1_hp', 'stats'])."),
        "{main}"
    );
    assert!(
        main.contains("INFO - fc1: Tensor: activation, gemm fprop - High precision"),
        "{main}"
    );
    assert!(
        main.contains("INFO - fc1: Tensor: activation, gemm wgrad - FP8 quantization"),
        "{main}"
    );
    assert!(
        main.contains("INFO - fc0: Tensor: weight, gemm fprop - FP8 quantization"),
        "{main}"
    );
    let stats = std::fs::read_to_string(
        dir.join("nvdlfw_inspect_statistics_logs/nvdlfw_inspect_globalrank-0.log"),
    )
    .unwrap();
    let line = stats
        .lines()
        .find(|l| l.contains("fc0_activation_mean"))
        .unwrap();
    let message = line.split(" - INFO - ").nth(1).unwrap();
    assert_eq!(
        message,
        burn_te_debug::stat_message("fc0_activation_mean", 1, get("fc0_activation_mean").1)
    );
    assert!(
        message.starts_with("fc0_activation_mean ")
            && message.contains("iteration=000001")
            && message.contains("value=")
    );
}

/// Two sections selecting one layer: TE raises at that layer's forward. The GEMM cannot fail here, so it runs
/// without the features and the `step()` that ends the iteration returns the overlap; the other layer's stats of
/// that step are logged all the same.
#[test]
fn sections_overlapping_on_a_layer_fail_the_step() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let (dir, collect) = start_session(
        "overlap",
        "a:\n  enabled: True\n  layers:\n    layer_types: [fc]\n  transformer_engine:\n    LogTensorStats:\n      enabled: True\n      stats: [max]\n      tensors: [activation]\nb:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: 'fc1$'\n  transformer_engine:\n    DisableFP8GEMM:\n      enabled: True\n      gemms: [fprop]\n",
    );
    let device = Default::default();
    let fc0 = LinearConfig::new(4, 4)
        .with_name(Some("fc0".into()))
        .init::<B>(&device);
    let fc1 = LinearConfig::new(4, 4)
        .with_name(Some("fc1".into()))
        .init::<B>(&device);
    let x = Tensor::<B, 2>::ones([2, 4], &device);
    let y = fp8_autocast(true, DelayedScaling::default(), || {
        fc1.forward(fc0.forward(x))
    })
    .unwrap();
    y.sum().backward();
    let err = burn_te_debug::step().unwrap_err();
    assert!(
        matches!(&err, DebugError::Config(c) if matches!(&c.kind, ConfigErrorKind::Overlap { first, second, .. }
            if first == "a" && second == "b")),
        "{err}"
    );
    assert!(err.to_string().contains("fc1"), "{err}");
    let logged = collect.0.lock().unwrap().clone();
    assert!(
        logged.iter().any(|(_, v)| v.name == "fc0_activation_max"),
        "fc0's stat of the step is logged: {logged:?}"
    );
    burn_te_debug::end().unwrap();
    assert!(main_log(&dir).contains("step() returns this error"));
}

#[test]
fn missing_config_warns_and_unwritable_log_dir_fails() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let dir = temp_dir("missing");
    burn_te_debug::initialize(DebugOptions::new(dir.join("nope.yaml")).log_dir(&dir)).unwrap();
    burn_te_debug::step().unwrap();
    burn_te_debug::end().unwrap();
    let main = main_log(&dir);
    assert!(
        main.contains("not found: running with no debug features"),
        "{main}"
    );
    let file = dir.join("a_file");
    std::fs::write(&file, "x").unwrap();
    let err = burn_te_debug::initialize(DebugOptions::without_config().log_dir(file.join("sub")))
        .unwrap_err();
    assert!(matches!(err, DebugError::LogDir { .. }), "{err}");
    // Without a session the loop's calls do nothing: one training loop runs with and without the debug tools.
    assert!(burn_te_debug::step().is_ok());
    assert!(burn_te_debug::initialize_training_step(3).is_ok());
    assert!(burn_te_debug::end().is_ok());
    assert_eq!(burn_te_debug::iteration(), None);
    assert!(matches!(
        burn_te_debug::check_layers(["fc"]),
        Err(DebugError::NotInitialized)
    ));
}

/// A safetensors file read with nothing but its spec: `(key → (dtype, shape, bytes), metadata)`.
pub(crate) type SafetensorsFile = (
    std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)>,
    serde_json::Map<String, serde_json::Value>,
);

pub(crate) fn read_safetensors(path: &Path) -> SafetensorsFile {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut tensors = std::collections::BTreeMap::new();
    let mut metadata = serde_json::Map::new();
    for (key, value) in header {
        if key == "__metadata__" {
            metadata = value.as_object().unwrap().clone();
            continue;
        }
        let dtype = value["dtype"].as_str().unwrap().to_string();
        let shape = value["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let offsets = value["data_offsets"].as_array().unwrap();
        let (start, end) = (
            offsets[0].as_u64().unwrap() as usize,
            offsets[1].as_u64().unwrap() as usize,
        );
        tensors.insert(key, (dtype, shape, data[start..end].to_vec()));
    }
    (tensors, metadata)
}

/// A dump's `high_precision` tensor is f32 of `shape` holding `values`, bit for bit.
fn assert_high_precision(
    dump: &std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)>,
    shape: &[usize],
    values: &[f32],
) {
    let (dtype, dumped_shape, bytes) = &dump["high_precision"];
    assert_eq!((dtype.as_str(), dumped_shape.as_slice()), ("F32", shape));
    assert_eq!(
        f32s(bytes).iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        values.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

pub(crate) fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

type W = Autodiff<Debug<Te<burn_te::backends::Wgpu>>>;

#[test]
fn debug_on_wgpu_dumps_tensors_logs_blockwise_ranges_and_exact_underflows() {
    use burn_te_kernels::Fp8Format;
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let dir = temp_dir("wgpu");
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        r#"inspect:
  enabled: True
  layers:
    layer_name_regex_pattern: 'fc0'
  transformer_engine:
    DumpTensors:
      enabled: True
      tensors_struct:
        - tensor: activation
          high_precision_tensor: True
          quantized_tensor: True
        - tensor: weight
          quantized_tensor: True
          freq: 2
    LogTensorStats:
      enabled: True
      stats: [max, {max_blockwise_dynamic_range: {block_size: 4, dims: 2}}, max_blockwise_dynamic_range]
      tensors: [activation]
    LogFp8TensorStats:
      enabled: True
      stats: [underflows%]
      tensors: [activation]
"#,
    )
    .unwrap();
    let collect = Collect::default();
    burn_te_debug::initialize(
        DebugOptions::new(&config)
            .log_dir(&dir)
            .default_logging(true)
            .logger(collect.clone())
            .init_training_step(5),
    )
    .unwrap();
    assert_eq!(burn_te_debug::iteration(), Some(5));
    // Resuming from a checkpoint at step 10.
    burn_te_debug::initialize_training_step(10).unwrap();
    assert_eq!(burn_te_debug::iteration(), Some(10));
    burn_te_debug::log_message("resumed from checkpoint", Some("blocks.0.fc0")).unwrap();

    let device = crate::te::device();
    let layer = LinearConfig::new(64, 32)
        .with_name(Some("blocks.0.fc0".into()))
        .init::<W>(&device);
    // Normal values with -0.0 entries, zeros and values that underflow E4M3 at amax ~4.
    let (rows, cols) = (16, 64);
    let mut values = crate::common::Rng::new(5).normal(rows * cols, 0.0, 1.0);
    for i in (0..values.len()).step_by(9) {
        values[i] = -0.0;
    }
    for i in (3..values.len()).step_by(13) {
        values[i] = 1e-7;
    }
    values[100] = 4.0;
    let recipe = burn_te::Float8CurrentScaling::default();
    let run = |x: Tensor<W, 2>| {
        let empty = x.dims()[0] == 0;
        let y = fp8_autocast(true, recipe.clone(), || layer.forward(x)).unwrap();
        // Burn's own sum backward does not take an empty tensor (a debug assertion in its broadcasting).
        if !empty {
            y.sum().backward();
        }
    };
    run(Tensor::from_data(
        burn::tensor::TensorData::new(values.clone(), [rows, cols]),
        &device,
    ));
    burn_te_debug::step().unwrap();
    // Iteration 11: an empty batch (forward). No activation stats (TE skips empty tensors), no panic.
    run(Tensor::<W, 2>::zeros([0, cols], &device));
    burn_te_debug::step().unwrap();
    burn_te_debug::end().unwrap();

    let logged = collect.0.lock().unwrap().clone();
    let get = |name: &str, it: u64| {
        logged
            .iter()
            .find(|(i, v)| *i == it && v.name == name)
            .map(|(_, v)| v.value)
            .unwrap_or_else(|| panic!("{name} at {it} not logged: {logged:?}"))
    };
    // Exact underflows% against the conformance-verified encoder at TE's current scale (448 / amax).
    let amax = values.iter().fold(0f32, |a, v| a.max(v.abs()));
    let scale = 448.0 / amax;
    let codes: Vec<u8> = values
        .iter()
        .map(|v| Fp8Format::E4M3.encode(v * scale))
        .collect();
    let nonzero_x = values.iter().filter(|v| **v != 0.0).count();
    let nonzero_q = codes.iter().filter(|c| **c & 0x7f != 0).count();
    assert!(nonzero_x > nonzero_q, "the data must underflow");
    let expected = 100.0 * (nonzero_x - nonzero_q) as f64 / values.len() as f64;
    let underflows = get("blocks.0.fc0_activation_underflows%", 10);
    assert!(
        (underflows - expected).abs() < 1e-9,
        "{underflows} vs {expected}"
    );
    // Blockwise dynamic ranges against a tile-by-tile reference; the activation's over both orientations (TE).
    let tiles = crate::statistics::reference_block_range(&values, rows, cols, 4, 4);
    let rows_of_32 = crate::statistics::reference_block_range(&values, rows, cols, 1, 32);
    let cols_of_32 = crate::statistics::reference_block_range(&values, rows, cols, 32, 1);
    for (name, expected) in [
        (
            "max_blockwise_dynamic_range_block_size_4_dims_2_max_over_orientations",
            tiles,
        ),
        (
            "max_blockwise_dynamic_range_block_size_32_dims_1_max_over_orientations",
            rows_of_32.max(cols_of_32),
        ),
    ] {
        let value = get(&format!("blocks.0.fc0_activation_{name}"), 10);
        assert!(
            (value - expected).abs() < 1e-4,
            "{name}: {value} vs {expected}"
        );
    }
    assert!(
        logged
            .iter()
            .all(|(it, v)| *it == 10 || !v.name.contains("activation")),
        "an empty activation logs nothing: {logged:?}"
    );

    // Dumps: TE's layout and sanitizing, f32 values and FP8 codes with scale_inv.
    let iter_dir = dir.join("tensor_dumps/rank_0/iter_000010");
    let (activation, meta) =
        read_safetensors(&iter_dir.join("blocks_0_fc0_activation.safetensors"));
    assert_high_precision(&activation, &[rows, cols], &values);
    let (dtype, shape, bytes) = &activation["quantized"];
    assert_eq!(
        (dtype.as_str(), shape.as_slice()),
        ("U8", &[rows, cols][..])
    );
    assert_eq!(bytes, &codes);
    let (_, _, scale_inv) = &activation["scale_inv"];
    assert!((f32s(scale_inv)[0] - 1.0 / scale).abs() <= f32::EPSILON * (1.0 / scale));
    assert_eq!(meta["layer"], "blocks.0.fc0");
    assert_eq!(meta["fp8_format"], "e4m3");
    // The weight: quantized only, every second iteration (10 yes, 11 no).
    let (weight, _) = read_safetensors(&iter_dir.join("blocks_0_fc0_weight.safetensors"));
    assert!(weight.contains_key("quantized") && !weight.contains_key("high_precision"));
    assert!(
        !dir.join("tensor_dumps/rank_0/iter_000011/blocks_0_fc0_weight.safetensors")
            .exists()
    );
    let (empty, _) = read_safetensors(
        &dir.join("tensor_dumps/rank_0/iter_000011/blocks_0_fc0_activation.safetensors"),
    );
    assert_eq!(empty["high_precision"].1, vec![0, cols]);

    let main = main_log(&dir);
    assert!(
        main.contains("INFO - blocks.0.fc0: resumed from checkpoint"),
        "{main}"
    );
    assert!(
        main.contains("Feature=DumpTensors, API=inspect_tensor: Dumped activation at iteration 10"),
        "{main}"
    );
    let stats = std::fs::read_to_string(
        dir.join("nvdlfw_inspect_statistics_logs/nvdlfw_inspect_globalrank-0.log"),
    )
    .unwrap();
    assert!(
        stats.contains(
            "blocks.0.fc0_activation_max_blockwise_dynamic_range_block_size_4_dims_2_max_over_orientations"
        )
    );
    assert!(stats.contains("iteration=000010") && !stats.contains("iteration=000005"));
}

#[test]
fn fake_quant_mxfp8_quantizes_32_value_blocks_along_k() {
    use burn_te_kernels::block::host_block_quantize;
    use burn_te_kernels::{BlockScaleRule, Fp8Format, ScaleBlock};
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let dir = temp_dir("mxfp8");
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        "fq:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: 'fq'\n  transformer_engine:\n    FakeQuant:\n      enabled: True\n      gemms_struct:\n        - gemm: fprop\n          tensors_struct:\n            - tensor: activation\n              quant_format: MXFP8E4M3\n",
    )
    .unwrap();
    burn_te_debug::initialize(DebugOptions::new(&config).log_dir(&dir)).unwrap();
    let device = Default::default();
    let layer = LinearConfig::new(64, 8)
        .with_name(Some("fq".into()))
        .init::<B>(&device);
    let (rows, cols) = (4, 64);
    // Magnitudes spanning 2^-12..2^6 so 32-value blocks get different E8M0 scales.
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 37 % 19) as f32 - 9.0) * 1.37 * 2f32.powi((i / 16) as i32 % 18 - 12))
        .collect();
    let x = Tensor::<B, 2>::from_data(
        burn::tensor::TensorData::new(values.clone(), [rows, cols]),
        &device,
    );
    let y = fp8_autocast(true, DelayedScaling::default(), || layer.forward(x))
        .unwrap()
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    burn_te_debug::end().unwrap();

    // Reference: MXFP8 E4M3 blocks of 1×32 along K (the activation's columns) from the host quantizer, then the
    // high-precision GEMM in f64.
    let (codes, scale_inv) = host_block_quantize(
        &values,
        rows,
        cols,
        ScaleBlock::new(1, 32),
        BlockScaleRule::E8m0,
        Fp8Format::E4M3,
    )
    .unwrap();
    let dq: Vec<f64> = codes
        .iter()
        .enumerate()
        .map(|(i, &c)| f64::from(Fp8Format::E4M3.decode(c)) * f64::from(scale_inv[i / 32]))
        .collect();
    let w = layer.weight.val().into_data().to_vec::<f32>().unwrap();
    let b = layer
        .bias
        .as_ref()
        .map(|b| b.val().into_data().to_vec::<f32>().unwrap())
        .unwrap_or(vec![0.0; 8]);
    let mut changed = 0.0f64;
    for r in 0..rows {
        for o in 0..8 {
            let dot = |v: &dyn Fn(usize) -> f64| {
                (0..cols)
                    .map(|k| v(r * cols + k) * f64::from(w[k * 8 + o]))
                    .sum::<f64>()
                    + f64::from(b[o])
            };
            let expected = dot(&|i| dq[i]);
            let plain = dot(&|i| f64::from(values[i]));
            let got = f64::from(y[r * 8 + o]);
            assert!(
                (got - expected).abs() <= 1e-5 * expected.abs().max(1.0),
                "[{r},{o}]: {got} vs {expected}"
            );
            changed = changed.max((expected - plain).abs());
        }
    }
    assert!(
        changed > 1e-3,
        "the fake quantization must change the output"
    );
}

/// One layer's LogFp8TensorStats under MXFP8BlockScaling (iteration 0) and Float8CurrentScaling (iteration 1) on
/// backend `BK`: the values logged by name and iteration, and the activation and weight.
fn block_recipe_stats<BK: burn::tensor::backend::AutodiffBackend + burn_te::TeBackend>(
    device: &BK::Device,
    name: &str,
) -> (Vec<(u64, StatValue)>, Vec<f32>, Vec<f32>) {
    let dir = temp_dir(name);
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        r#"blocks:
  enabled: True
  layers:
    layer_name_regex_pattern: 'fc0'
  transformer_engine:
    LogFp8TensorStats:
      enabled: True
      tensors: [activation, weight]
      stats: [underflows%, scale_inv_min, scale_inv_max, mse, underflows%_columnwise, scale_inv_min_columnwise,
              mxfp8_underflows%, mxfp8_mse_columnwise, fp8_block_scaling_underflows%, fp8_block_scaling_scale_inv_max,
              fp8_current_scaling_underflows%]
"#,
    )
    .unwrap();
    let collect = Collect::default();
    burn_te_debug::initialize(
        DebugOptions::new(&config)
            .log_dir(&dir)
            .logger(collect.clone()),
    )
    .unwrap();
    let mut layer = LinearConfig::new(192, 160)
        .with_name(Some("fc0".into()))
        .init::<BK>(device);
    // A weight whose rows and columns differ in magnitude, so its two orientations' blocks differ.
    let mut w = crate::common::Rng::new(22).normal(192 * 160, 0.0, 0.05);
    for (i, v) in w.iter_mut().enumerate() {
        *v *= 2f32.powi(((i / 160) % 8) as i32 - 4) * 2f32.powi(((i % 160) / 40) as i32 - 2);
    }
    layer.weight = burn::module::Param::from_tensor(Tensor::from_data(
        burn::tensor::TensorData::new(w, [192, 160]),
        device,
    ));
    // Rows and columns of different magnitudes (2^-12 .. 2^6), so blocks of either orientation differ in scale,
    // and tiny entries that underflow their block.
    let (rows, cols) = (48, 192);
    let mut x = crate::common::Rng::new(21).normal(rows * cols, 0.0, 1.0);
    for (i, v) in x.iter_mut().enumerate() {
        *v *= 2f32.powi(((i / cols) % 10) as i32 - 6) * 2f32.powi(((i % cols) / 48) as i32 - 3);
        if i % 7 == 0 {
            *v *= 1e-5;
        }
    }
    let run = |recipe: burn_te::Recipe| {
        let input = Tensor::<BK, 2>::from_data(
            burn::tensor::TensorData::new(x.clone(), [rows, cols]),
            device,
        );
        let y = fp8_autocast(true, recipe, || layer.forward(input)).unwrap();
        y.sum().backward();
        burn_te_debug::step().unwrap();
    };
    run(burn_te::MXFP8BlockScaling::default().into());
    run(burn_te::Float8CurrentScaling::default().into());
    burn_te_debug::end().unwrap();
    let weight = layer.weight.val().into_data().to_vec::<f32>().unwrap();
    let logged = collect.0.lock().unwrap().clone();
    (logged, x, weight)
}

#[test]
fn log_fp8_tensor_stats_block_recipes_and_what_ifs_match_a_block_by_block_reference() {
    use burn_te_kernels::{BlockScaleRule, Fp8Format, ScaleBlock};
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let reference = |v: &[f32], rows, cols, block, rule| {
        crate::statistics::reference_block_fp8_stats(v, rows, cols, block, rule, Fp8Format::E4M3)
    };
    let (mx, pow2) = (BlockScaleRule::E8m0, BlockScaleRule::Pow2);
    let runs = [
        (
            "wgpu",
            block_recipe_stats::<W>(&crate::te::device(), "blocks-wgpu"),
        ),
        (
            "ndarray",
            block_recipe_stats::<B>(&Default::default(), "blocks-host"),
        ),
    ];
    for (backend, (logged, x, w)) in runs {
        let get = |name: &str, it: u64| {
            logged
                .iter()
                .find(|(i, v)| *i == it && v.name == format!("fc0_{name}"))
                .map(|(_, v)| v.value)
        };
        let expect = |name: &str, it: u64, expected: f64| {
            let value =
                get(name, it).unwrap_or_else(|| panic!("{backend}: {name} at {it} not logged"));
            assert!(
                (value - expected).abs() <= 1e-5 * expected.abs() + 1e-12,
                "{backend}: {name} at {it}: {value} vs {expected}"
            );
        };
        let percent = |s: &burn_te_kernels::Fp8Stats| {
            100.0 * s.underflow_count as f64 / s.tensor.numel as f64
        };
        let mse = |s: &burn_te_kernels::Fp8Stats| s.squared_error_sum / s.tensor.numel as f64;
        // The activation [48, 192]: rowwise (fprop) blocks run along its columns, columnwise (wgrad) along rows.
        let (ar, ac) = (48, 192);
        let mx_row = reference(&x, ar, ac, ScaleBlock::new(1, 32), mx);
        let mx_col = reference(&x, ar, ac, ScaleBlock::new(32, 1), mx);
        let tile = reference(&x, ar, ac, ScaleBlock::new(1, 128), pow2);
        assert!(mx_row.underflow_count > 0 && mx_row.underflow_count != mx_col.underflow_count);
        // Iteration 0, MXFP8BlockScaling: the unprefixed stats are the recipe's own blocks.
        expect("activation_underflows%", 0, percent(&mx_row));
        expect("activation_underflows%_columnwise", 0, percent(&mx_col));
        expect("activation_scale_inv_min", 0, mx_row.scale_inv_min);
        expect("activation_scale_inv_max", 0, mx_row.scale_inv_max);
        expect(
            "activation_scale_inv_min_columnwise",
            0,
            mx_col.scale_inv_min,
        );
        expect("activation_mse", 0, mse(&mx_row));
        expect("activation_mxfp8_underflows%", 0, percent(&mx_row));
        expect("activation_mxfp8_mse_columnwise", 0, mse(&mx_col));
        expect(
            "activation_fp8_block_scaling_underflows%",
            0,
            percent(&tile),
        );
        expect(
            "activation_fp8_block_scaling_scale_inv_max",
            0,
            tile.scale_inv_max,
        );
        // The weight, stored [in 192, out 160]: rowwise (fprop) blocks run along its rows (K = in).
        let (wr, wc) = (192, 160);
        let w_row = reference(&w, wr, wc, ScaleBlock::new(32, 1), mx);
        let w_col = reference(&w, wr, wc, ScaleBlock::new(1, 32), mx);
        let w_block = reference(&w, wr, wc, ScaleBlock::new(128, 128), pow2);
        assert!(w_row.scale_inv_min != w_col.scale_inv_min && mse(&w_row) != mse(&w_col));
        expect("weight_scale_inv_min", 0, w_row.scale_inv_min);
        expect("weight_scale_inv_min_columnwise", 0, w_col.scale_inv_min);
        expect("weight_mse", 0, mse(&w_row));
        expect(
            "weight_fp8_block_scaling_scale_inv_max",
            0,
            w_block.scale_inv_max,
        );
        // Iteration 1, Float8CurrentScaling: the what-ifs give the same values; the unprefixed stats are the
        // per-tensor ones, and a per-tensor scale has no columnwise orientation (skipped with a warning).
        expect("activation_mxfp8_underflows%", 1, percent(&mx_row));
        expect(
            "activation_fp8_block_scaling_underflows%",
            1,
            percent(&tile),
        );
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = 448.0 / amax;
        let current = burn_te_kernels::host::fp8_tensor_stats(&x, Fp8Format::E4M3, scale);
        expect("activation_underflows%", 1, percent(&current));
        expect(
            "activation_fp8_current_scaling_underflows%",
            1,
            percent(&current),
        );
        expect("activation_scale_inv_min", 1, f64::from(1.0 / scale));
        assert!(
            percent(&current) > percent(&mx_row),
            "per-block scales must underflow less"
        );
        assert_eq!(get("activation_underflows%_columnwise", 1), None);
    }
}

/// What `CallsBack` saw: (iteration given, `iteration()`, `step()` refused).
type Seen = std::sync::Arc<Mutex<Vec<(u64, Option<u64>, bool)>>>;

/// A custom feature that calls back into the debug API from its code.
struct CallsBack {
    seen: Seen,
}
impl Feature for CallsBack {
    fn name(&self) -> &str {
        "CallsBack"
    }
    fn inspect_tensor_enabled(&self, _: &str, tensor: TensorName, _: u64) -> Option<Routing> {
        (tensor == TensorName::Activation).then_some(Routing {
            enabled: true,
            next: None,
        })
    }
    fn inspect_tensor(
        &self,
        layer: &str,
        _: TensorName,
        _: &dyn DebugTensor,
        iteration: u64,
        _: &mut Inspection,
    ) -> Result<(), DebugError> {
        let current = burn_te_debug::iteration();
        burn_te_debug::log_message(&format!("called back at {iteration}"), Some(layer))?;
        // From another thread (a worker pool inside the feature): features never run under the session's lock,
        // so this returns instead of waiting forever.
        let (send, receive) = std::sync::mpsc::channel();
        let layer_name = layer.to_string();
        std::thread::spawn(move || {
            let result = burn_te_debug::log_message("from a worker thread", Some(&layer_name));
            let _ = send.send((result.is_ok(), burn_te_debug::iteration()));
        });
        let worker = receive
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("a worker thread calling the debug API from a feature deadlocked");
        assert_eq!(worker, (true, Some(iteration)));
        let step_refused = matches!(burn_te_debug::step(), Err(DebugError::Reentrant("step")));
        self.seen
            .lock()
            .unwrap()
            .push((iteration, current, step_refused));
        Ok(())
    }
}

#[test]
fn a_feature_calling_the_debug_api_does_not_deadlock() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let seen = std::sync::Arc::new(Mutex::new(Vec::new()));
    static ONCE: Once = Once::new();
    let for_factory = seen.clone();
    let factory_seen = std::sync::Mutex::new(Some(for_factory));
    ONCE.call_once(|| {
        let seen = factory_seen.lock().unwrap().take().unwrap();
        register_feature(Namespace::TransformerEngine, "CallsBack", move |_| {
            Ok(Box::new(CallsBack { seen: seen.clone() }))
        })
        .unwrap();
    });
    let dir = temp_dir("calls-back");
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        "calls_back:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: 'cb'\n  transformer_engine:\n    CallsBack:\n      enabled: True\n",
    )
    .unwrap();
    burn_te_debug::initialize(DebugOptions::new(&config).log_dir(&dir)).unwrap();
    burn_te_debug::initialize_training_step(7).unwrap();
    // The training step on its own thread, awaited with a deadline: a deadlock fails the test instead of hanging it.
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let device = Default::default();
        let layer = LinearConfig::new(8, 4)
            .with_name(Some("cb".into()))
            .init::<B>(&device);
        let x = Tensor::<B, 2>::random([3, 8], Distribution::Normal(0.0, 1.0), &device);
        let y = fp8_autocast(true, DelayedScaling::default(), || layer.forward(x)).unwrap();
        y.sum().backward();
        let _ = done.send(());
    });
    finished
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("a feature calling the debug API deadlocked the training step");
    burn_te_debug::step().unwrap();
    burn_te_debug::end().unwrap();
    // Called (at fprop): it saw the iteration, and step() was refused with an error instead of a deadlock.
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen, vec![(7, Some(7), true)]);
    let main = main_log(&dir);
    assert!(main.contains("cb: called back at 7"), "{main}");
    assert!(main.contains("cb: from a worker thread"), "{main}");
}

/// `nan_count` and `inf_count` (beyond TE) in LogTensorStats: the statistics kernel's counts, on the host path and
/// on wgpu, merged over two micro-batches.
fn nan_and_inf_counts<D: burn::tensor::backend::AutodiffBackend + burn_te::TeBackend>(
    device: &D::Device,
    stack: &str,
) {
    let dir = temp_dir(&format!("nan-counts-{stack}"));
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        "counts:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: 'fc0$'\n  transformer_engine:\n    LogTensorStats:\n      enabled: True\n      stats: [nan_count, inf_count, max]\n      tensors: [activation]\n",
    )
    .unwrap();
    let collect = Collect::default();
    burn_te_debug::initialize(
        DebugOptions::new(&config)
            .log_dir(&dir)
            .logger(collect.clone()),
    )
    .unwrap();
    let fc0 = LinearConfig::new(8, 4)
        .with_name(Some("fc0".into()))
        .init::<D>(device);
    // 2 + 1 NaN, 3 + 0 +inf, 1 + 2 -inf over the two micro-batches; the finite max is 5.
    let batches = [
        vec![
            f32::NAN,
            f32::NAN,
            f32::INFINITY,
            f32::INFINITY,
            f32::INFINITY,
            f32::NEG_INFINITY,
            5.0,
            1.0,
        ],
        vec![
            f32::NAN,
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            0.5,
            0.0,
            -1.0,
            2.0,
            3.0,
        ],
    ];
    for batch in batches {
        let x = crate::te::tensor::<D, 2>(batch, [1, 8], device);
        let _ = fp8_autocast(true, DelayedScaling::default(), || fc0.forward(x)).unwrap();
    }
    burn_te_debug::step().unwrap();
    burn_te_debug::end().unwrap();
    let values = collect.0.lock().unwrap().clone();
    let get = |name: &str| {
        values
            .iter()
            .find(|(_, v)| v.name == name)
            .map(|(_, v)| v.value)
            .unwrap_or_else(|| panic!("{stack}: {name} not logged: {values:?}"))
    };
    assert_eq!(get("fc0_activation_nan_count"), 3.0, "{stack}");
    assert_eq!(get("fc0_activation_inf_count"), 6.0, "{stack}");
}

#[test]
fn log_tensor_stats_counts_nan_and_inf_on_the_host_and_wgpu() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    nan_and_inf_counts::<B>(&Default::default(), "ndarray");
    nan_and_inf_counts::<Autodiff<Debug<Te<burn_te::backends::Wgpu>>>>(
        &crate::te::device(),
        "wgpu",
    );
}

/// A frozen layer (weight `no_grad()`, as in fine-tuning with adapters) runs its dgrad but no wgrad: its incoming
/// gradient is still inspected, logged and dumped once per iteration, as TE does for every layer that runs a
/// backward GEMM; a trainable layer's gradient is logged once per iteration as before. Both paths: the TE module's
/// `te_linear` and a plain Burn linear. Checked against an f64 re-computation of the gradient (the last layer's
/// incoming gradient is `g` of the loss `sum(y * g)`).
#[test]
fn a_frozen_layers_gradient_is_logged_and_dumped_once_per_iteration() {
    use burn::module::Module;
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let (dir, collect) = start_session(
        "frozen",
        "grads:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: '.*'\n  transformer_engine:\n    LogTensorStats:\n      enabled: True\n      stats: [min, max, mean, std, l1_norm]\n      tensors: [gradient]\n    DumpTensors:\n      enabled: True\n      tensors_struct:\n        - tensor: gradient\n          high_precision_tensor: True\n",
    );
    let device = Default::default();
    let (tokens, d_in, d_mid, d_out) = (8, 16, 12, 8);
    let mut rng = crate::common::Rng::new(11);
    let fc0 = LinearConfig::new(d_in, d_mid)
        .with_name(Some("fc0".into()))
        .init::<B>(&device);
    let fc_mid = LinearConfig::new(d_mid, d_mid)
        .with_name(Some("fc_mid".into()))
        .init::<B>(&device);
    let fc1 = LinearConfig::new(d_mid, d_out)
        .with_name(Some("fc1".into()))
        .init::<B>(&device)
        .no_grad();
    // The plain path: Burn's own linears, the last frozen (named linear0..linear2 in the FP8 scope).
    let plain0 = burn::nn::LinearConfig::new(d_in, d_mid).init::<B>(&device);
    let plain_mid = burn::nn::LinearConfig::new(d_mid, d_mid).init::<B>(&device);
    let plain1 = burn::nn::LinearConfig::new(d_mid, d_out)
        .init::<B>(&device)
        .no_grad();
    let iterations = 2;
    let mut gs = Vec::new();
    for _ in 0..iterations {
        let x = Tensor::<B, 2>::from_data(
            burn::tensor::TensorData::new(rng.normal(tokens * d_in, 0.0, 1.0), [tokens, d_in]),
            &device,
        );
        let g = rng.normal(tokens * d_out, 0.0, 0.5);
        let g_tensor = Tensor::<B, 2>::from_data(
            burn::tensor::TensorData::new(g.clone(), [tokens, d_out]),
            &device,
        );
        let (y, y_plain) = fp8_autocast(true, DelayedScaling::default(), || {
            (
                fc1.forward(fc_mid.forward(fc0.forward(x.clone()))),
                plain1.forward(plain_mid.forward(plain0.forward(x))),
            )
        })
        .unwrap();
        let grads = (y * g_tensor.clone() + y_plain * g_tensor).sum().backward();
        // The frozen layers have no weight gradient; the trainable ones do.
        assert!(fc1.weight.val().grad(&grads).is_none());
        assert!(fc0.weight.val().grad(&grads).is_some());
        burn_te_debug::step().unwrap();
        gs.push(g);
    }
    burn_te_debug::end().unwrap();

    let logged = collect.0.lock().unwrap().clone();
    for (iteration, g) in gs.iter().enumerate() {
        for layer in ["fc1", "linear2"] {
            for (stat, expected) in f64_named_stats(g) {
                let name = format!("{layer}_gradient_{stat}");
                let values: Vec<f64> = logged
                    .iter()
                    .filter(|(it, v)| *it == iteration as u64 && v.name == name)
                    .map(|(_, v)| v.value)
                    .collect();
                assert_eq!(values.len(), 1, "{name} at {iteration}: {logged:?}");
                assert!(
                    (values[0] - expected).abs() <= 1e-5 * expected.abs().max(1.0),
                    "{name} at {iteration}: {} vs f64 {expected}",
                    values[0]
                );
            }
            let path = dir.join(format!(
                "tensor_dumps/rank_0/iter_{iteration:06}/{layer}_gradient.safetensors"
            ));
            let (dump, _) = read_safetensors(&path);
            assert_high_precision(&dump, &[tokens, d_out], g);
        }
        // The trainable layers log theirs once: at dgrad in the middle, at wgrad in front (whose input needs no
        // gradient).
        for layer in ["fc0", "fc_mid", "linear0", "linear1"] {
            let name = format!("{layer}_gradient_mean");
            let count = logged
                .iter()
                .filter(|(it, v)| *it == iteration as u64 && v.name == name)
                .count();
            assert_eq!(count, 1, "{name} at {iteration}: {logged:?}");
        }
    }
}
