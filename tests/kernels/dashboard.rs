//! The debug stats outside the log files: TensorBoard event files (read back with an independent, spec-only
//! reader), the `DebugConfig` Burn config (JSON round trip, `init`), and the burn-train bridge (a real
//! `SupervisedTraining` run with a headless renderer and burn-train's file metric logger).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use burn::backend::{Autodiff, NdArray};
use burn::config::Config;
use burn::prelude::*;
use burn_te::nn::LinearConfig;
use burn_te::{Float8CurrentScaling, Te, fp8_autocast};
use burn_te_debug::stats::StatValue;
use burn_te_debug::tensorboard::{TagStyle, TensorBoardLogger};
use burn_te_debug::{Debug, DebugConfig, DebugOptions};

use crate::debug::{Collect, SESSION, temp_dir};

type B = Autodiff<Debug<Te<NdArray>>>;

// ---- An independent TensorBoard reader, from the TFRecord and protobuf specs ----

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// TFRecord's mask: rotate right by 15, add 0xa282ead8.
fn masked(crc: u32) -> u32 {
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// The records of a TFRecord file, every checksum verified.
fn records(path: &Path) -> Vec<Vec<u8>> {
    let bytes = std::fs::read(path).unwrap();
    let mut at = 0;
    let mut out = Vec::new();
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    while at < bytes.len() {
        let len_bytes = &bytes[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        assert_eq!(u32_at(at + 8), masked(crc32c(len_bytes)), "length checksum");
        let data = &bytes[at + 12..at + 12 + len];
        assert_eq!(u32_at(at + 12 + len), masked(crc32c(data)), "data checksum");
        out.push(data.to_vec());
        at += 16 + len;
    }
    out
}

/// A protobuf field's value.
#[derive(Debug, Clone)]
enum Field {
    Varint(u64),
    Fixed64([u8; 8]),
    Bytes(Vec<u8>),
    Fixed32([u8; 4]),
}

/// Decodes a protobuf message into (field number, value) pairs.
fn fields(mut data: &[u8]) -> Vec<(u64, Field)> {
    fn varint(data: &mut &[u8]) -> u64 {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = data[0];
            *data = &data[1..];
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                break;
            }
        }
        value
    }
    let mut out = Vec::new();
    while !data.is_empty() {
        let key = varint(&mut data);
        let field = match key & 7 {
            0 => Field::Varint(varint(&mut data)),
            1 => {
                let v = data[..8].try_into().unwrap();
                data = &data[8..];
                Field::Fixed64(v)
            }
            2 => {
                let len = varint(&mut data) as usize;
                let v = data[..len].to_vec();
                data = &data[len..];
                Field::Bytes(v)
            }
            5 => {
                let v = data[..4].try_into().unwrap();
                data = &data[4..];
                Field::Fixed32(v)
            }
            wire => panic!("unexpected wire type {wire}"),
        };
        out.push((key >> 3, field));
    }
    out
}

/// One event: step, and either the file version or the summary's (tag, simple_value) pairs.
#[derive(Debug)]
struct Event {
    wall_time: f64,
    step: i64,
    file_version: Option<String>,
    scalars: Vec<(String, f32)>,
}

fn events(path: &Path) -> Vec<Event> {
    records(path)
        .into_iter()
        .map(|record| {
            let mut event = Event {
                wall_time: 0.0,
                step: 0,
                file_version: None,
                scalars: Vec::new(),
            };
            for (number, field) in fields(&record) {
                match (number, field) {
                    (1, Field::Fixed64(v)) => event.wall_time = f64::from_le_bytes(v),
                    (2, Field::Varint(v)) => event.step = v as i64,
                    (3, Field::Bytes(v)) => {
                        event.file_version = Some(String::from_utf8(v).unwrap())
                    }
                    (5, Field::Bytes(summary)) => {
                        for (n, value) in fields(&summary) {
                            let (1, Field::Bytes(value)) = (n, value) else {
                                panic!("Summary.value expected")
                            };
                            let mut tag = String::new();
                            let mut simple = None;
                            for (n, f) in fields(&value) {
                                match (n, f) {
                                    (1, Field::Bytes(t)) => tag = String::from_utf8(t).unwrap(),
                                    (2, Field::Fixed32(v)) => simple = Some(f32::from_le_bytes(v)),
                                    other => panic!("unexpected Summary.Value field {other:?}"),
                                }
                            }
                            event.scalars.push((tag, simple.expect("simple_value")));
                        }
                    }
                    other => panic!("unexpected Event field {other:?}"),
                }
            }
            event
        })
        .collect()
}

/// The only file in `dir`.
fn only_file(dir: &Path) -> PathBuf {
    let files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}

/// Trains a TE Linear named `layer` for `steps` iterations in FP8 (current scaling), one `step()` each.
fn train_linear(layer_name: &str, steps: usize) {
    let device = Default::default();
    let layer = LinearConfig::new(16, 8)
        .with_name(Some(layer_name.into()))
        .init::<B>(&device);
    for _ in 0..steps {
        let x = Tensor::<B, 2>::random(
            [6, 16],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &device,
        );
        let y = fp8_autocast(true, Float8CurrentScaling::default(), || layer.forward(x)).unwrap();
        y.sum().backward();
        burn_te_debug::step().unwrap();
    }
}

fn write_config(dir: &Path, layer: &str, features: &str) -> PathBuf {
    let path = dir.join("config.yaml");
    std::fs::write(
        &path,
        format!(
            "sec:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: '{layer}'\n  transformer_engine:\n{features}"
        ),
    )
    .unwrap();
    path
}

const STATS_FEATURES: &str = "    LogTensorStats:\n      enabled: True\n      stats: [mean, max, l1_norm]\n      tensors: [activation, weight]\n    LogFp8TensorStats:\n      enabled: True\n      stats: [underflows%, scale_inv_min]\n      tensors: [activation]\n      freq: 2\n";

#[test]
fn tensorboard_event_files_read_back_with_the_logged_values() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let dir = temp_dir("tensorboard");
    let config = write_config(&dir, "tb", STATS_FEATURES);
    let collect = Collect::default();
    let hierarchical = TensorBoardLogger::new(dir.join("tb")).unwrap();
    let te_names = TensorBoardLogger::new(dir.join("tb-te"))
        .unwrap()
        .tag_style(TagStyle::TeName);
    burn_te_debug::initialize(
        DebugOptions::new(&config)
            .log_dir(&dir)
            .logger(collect.clone())
            .logger(hierarchical)
            .logger(te_names)
            .init_training_step(3),
    )
    .unwrap();
    train_linear("tb", 4);
    burn_te_debug::end().unwrap();

    let logged = collect.0.lock().unwrap().clone();
    // 6 LogTensorStats values per step, LogFp8TensorStats's 2 at iterations 4 and 6.
    assert_eq!(logged.len(), 4 * 6 + 2 * 2, "{logged:?}");
    let base = dir;
    for (dir, tag_of) in [
        (
            "tb",
            (|v: &StatValue| format!("{}/{}/{}", v.layer, v.tensor.unwrap().name(), v.stat))
                as fn(&StatValue) -> String,
        ),
        ("tb-te", |v: &StatValue| v.name.clone()),
    ] {
        let file = only_file(&base.join(dir));
        assert!(
            file.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("events.out.tfevents."),
            "{file:?}"
        );
        let events = events(&file);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        let scalars: Vec<(i64, String, f32)> = events[1..]
            .iter()
            .flat_map(|e| {
                assert!(e.wall_time > 1.6e9, "wall time in seconds since the epoch");
                e.scalars.iter().map(|(t, v)| (e.step, t.clone(), *v))
            })
            .collect();
        let expected: Vec<(i64, String, f32)> = logged
            .iter()
            .map(|(it, v)| (*it as i64, tag_of(v), v.value as f32))
            .collect();
        assert_eq!(scalars.len(), expected.len());
        for (got, want) in scalars.iter().zip(&expected) {
            assert_eq!((got.0, &got.1), (want.0, &want.1));
            assert_eq!(got.2.to_bits(), want.2.to_bits(), "{}", got.1);
        }
        assert!(
            scalars
                .iter()
                .any(|s| s.1.contains("underflows%") && s.0 == 4)
        );
    }
}

#[test]
fn debug_config_round_trips_through_json_and_turns_debugging_on() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let dir = temp_dir("burn-config");
    let yaml = write_config(
        &dir,
        "cfg",
        "    LogTensorStats:\n      enabled: True\n      stats: [max]\n      tensors: [activation]\n    DumpTensors:\n      enabled: True\n      tensors: [weight]\n      high_precision_tensor: True\n",
    );
    let config = DebugConfig::new()
        .with_config_file(Some(yaml.to_string_lossy().into()))
        .with_log_dir(dir.join("log").to_string_lossy().into())
        .with_tensorboard(true)
        .with_tensorboard_tags(TagStyle::TeName)
        .with_dump_dir(Some(dir.join("dumps").to_string_lossy().into()))
        .with_init_training_step(7);
    let json = dir.join("debug.json");
    config.save(&json).unwrap();
    let loaded = DebugConfig::load(&json).unwrap();
    assert_eq!(format!("{loaded:?}"), format!("{config:?}"));
    // As every Burn config: the JSON holds every key; a missing key or a wrong type is an error naming it.
    let saved = std::fs::read_to_string(&json).unwrap();
    for key in [
        "config_file",
        "log_dir",
        "log_files",
        "tensorboard",
        "tensorboard_tags",
        "dump_dir",
    ] {
        assert!(
            saved.contains(&format!("\"{key}\"")),
            "{key} missing from {saved}"
        );
    }
    let err = DebugConfig::load_binary(b"{}").unwrap_err();
    assert!(
        format!("{err:?}").contains("config_file") || format!("{err:?}").contains("log_dir"),
        "{err:?}"
    );
    let mut value: serde_json::Value = serde_json::from_str(&saved).unwrap();
    value["log_dir"] = serde_json::json!(3);
    let err = DebugConfig::load_binary(value.to_string().as_bytes()).unwrap_err();
    assert!(format!("{err:?}").contains("invalid type"), "{err:?}");
    let defaults = DebugConfig::new();
    assert_eq!(defaults.log_dir, "./log");
    assert!(defaults.log_files && !defaults.tensorboard && defaults.config_file.is_none());

    loaded.init().unwrap();
    assert_eq!(burn_te_debug::iteration(), Some(7));
    train_linear("cfg", 2);
    burn_te_debug::end().unwrap();
    let stats = std::fs::read_to_string(
        dir.join("log/nvdlfw_inspect_statistics_logs/nvdlfw_inspect_globalrank-0.log"),
    )
    .unwrap();
    assert!(
        stats.contains("cfg_activation_max") && stats.contains("iteration=000008"),
        "{stats}"
    );
    assert!(
        dir.join("dumps/tensor_dumps/rank_0/iter_000007/cfg_weight.safetensors")
            .is_file()
    );
    assert!(!dir.join("log/tensor_dumps").exists());
    let events = events(&only_file(&dir.join("log/tensorboard")));
    let tags: Vec<(i64, &str)> = events
        .iter()
        .flat_map(|e| e.scalars.iter().map(move |(t, _)| (e.step, t.as_str())))
        .collect();
    assert_eq!(tags, [(7, "cfg_activation_max"), (8, "cfg_activation_max")]);
}

// ---- The burn-train bridge in a real SupervisedTraining run ----

mod learner {
    use super::*;
    use burn::data::dataloader::DataLoaderBuilder;
    use burn::data::dataloader::batcher::Batcher;
    use burn::data::dataset::InMemDataset;
    use burn::module::Module;
    use burn::optim::AdamConfig;
    use burn_te::nn::Linear;
    use burn_train::metric::{LossMetric, MetricDefinition, MetricId};
    use burn_train::renderer::{
        EvaluationName, EvaluationProgress, MetricState, MetricsRenderer,
        MetricsRendererEvaluation, MetricsRendererTraining, ProgressType, TrainingProgress,
    };
    use burn_train::{
        InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput, TrainStep,
    };

    type Inner = Debug<Te<NdArray>>;

    // The module derive expects its backend parameter to be called `B` (it shadows the alias inside).
    #[derive(Module, Debug)]
    pub struct Regressor<B: Backend> {
        fc: Linear<B>,
    }

    #[derive(Clone, Debug)]
    pub struct Batch<B: Backend> {
        x: Tensor<B, 2>,
        y: Tensor<B, 2>,
    }

    #[derive(Clone)]
    struct Batches;
    impl<B: Backend> Batcher<B, [f32; 5], Batch<B>> for Batches {
        fn batch(&self, items: Vec<[f32; 5]>, device: &B::Device) -> Batch<B> {
            let n = items.len();
            let x: Vec<f32> = items.iter().flat_map(|i| i[..4].to_vec()).collect();
            let y: Vec<f32> = items.iter().map(|i| i[4]).collect();
            Batch {
                x: Tensor::from_data(TensorData::new(x, [n, 4]), device),
                y: Tensor::from_data(TensorData::new(y, [n, 1]), device),
            }
        }
    }

    impl<B: Backend + burn_te::TeBackend> Regressor<B> {
        fn output(&self, batch: Batch<B>) -> RegressionOutput<B> {
            let output = fp8_autocast(true, Float8CurrentScaling::default(), || {
                self.fc.forward(batch.x)
            })
            .unwrap();
            let loss = (output.clone() - batch.y.clone()).square().mean();
            RegressionOutput::new(loss, output, batch.y)
        }
    }

    impl TrainStep for Regressor<B> {
        type Input = Batch<B>;
        type Output = RegressionOutput<B>;
        fn step(&self, batch: Batch<B>) -> TrainOutput<RegressionOutput<B>> {
            let item = self.output(batch);
            let grads = item.loss.backward();
            // The one line a model adds: close the debug step of this iteration.
            burn_te_debug::step().unwrap();
            TrainOutput::new::<B, _>(self, grads, item)
        }
    }

    impl InferenceStep for Regressor<Inner> {
        type Input = Batch<Inner>;
        type Output = RegressionOutput<Inner>;
        fn step(&self, batch: Batch<Inner>) -> RegressionOutput<Inner> {
            burn_te_debug::paused(|| self.output(batch))
        }
    }

    /// What a renderer receives: the registered metrics and every numeric training update, by metric name.
    #[derive(Clone, Default)]
    pub struct Headless {
        names: Arc<Mutex<BTreeMap<String, String>>>,
        pub train: Arc<Mutex<BTreeMap<String, Vec<f64>>>>,
        pub iterations: Arc<Mutex<Vec<usize>>>,
    }

    fn id_key(id: &MetricId) -> String {
        format!("{id:?}")
    }

    impl MetricsRendererTraining for Headless {
        fn update_train(&mut self, state: MetricState) {
            if let MetricState::Numeric(entry, value) = state {
                let name = self.names.lock().unwrap()[&id_key(&entry.metric_id)].clone();
                self.train
                    .lock()
                    .unwrap()
                    .entry(name)
                    .or_default()
                    .push(value.current());
            }
        }
        fn update_valid(&mut self, _state: MetricState) {}
        fn render_train(&mut self, item: TrainingProgress, _: Vec<ProgressType>) {
            if let Some(iteration) = item.iteration {
                self.iterations.lock().unwrap().push(iteration);
            }
        }
        fn render_valid(&mut self, _: TrainingProgress, _: Vec<ProgressType>) {}
        fn on_train_end(
            &mut self,
            _: Option<burn_train::LearnerSummary>,
        ) -> Result<(), Box<dyn core::error::Error>> {
            Ok(())
        }
    }
    impl MetricsRendererEvaluation for Headless {
        fn update_test(&mut self, _: EvaluationName, _: MetricState) {}
        fn render_test(&mut self, _: EvaluationProgress, _: Vec<ProgressType>) {}
    }
    impl MetricsRenderer for Headless {
        fn manual_close(&mut self) {}
        fn register_metric(&mut self, definition: MetricDefinition) {
            self.names
                .lock()
                .unwrap()
                .insert(id_key(&definition.metric_id), definition.name.clone());
        }
    }

    /// Trains for `epochs` epochs of `batches` batches with the bridge registered; returns the renderer.
    pub fn train(
        dir: &Path,
        epochs: usize,
        batches: usize,
        stats: &burn_te_debug::train::TrainStats,
    ) -> Headless {
        let device = Default::default();
        let mut rng = crate::common::Rng::new(3);
        let items: Vec<[f32; 5]> = (0..batches * 4)
            .map(|_| {
                let v = rng.normal(4, 0.0, 1.0);
                [v[0], v[1], v[2], v[3], v[0] - 2.0 * v[1] + 0.5 * v[3]]
            })
            .collect();
        let train = DataLoaderBuilder::new(Batches)
            .batch_size(4)
            .build(InMemDataset::new(items.clone()));
        let valid = DataLoaderBuilder::new(Batches)
            .batch_size(4)
            .build(InMemDataset::new(items[..4].to_vec()));
        let model = Regressor::<B> {
            fc: LinearConfig::new(4, 1)
                .with_name(Some("fc".into()))
                .init(&device),
        };
        let renderer = Headless::default();
        let metrics = stats.metrics_for_layers(["fc"]).unwrap();
        let training = SupervisedTraining::new(dir, train, valid)
            .metric_train_numeric(LossMetric::new())
            .metrics(metrics)
            .renderer(renderer.clone())
            .with_application_logger(None)
            .num_epochs(epochs);
        let _trained = training.launch(Learner::new(
            model,
            AdamConfig::new().init::<B, Regressor<B>>(),
            1e-2,
        ));
        renderer
    }
}

#[test]
fn stats_reach_burn_train_metrics_with_their_names_and_iterations() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let dir = temp_dir("burn-train");
    let config = write_config(&dir, "fc", STATS_FEATURES);
    let collect = Collect::default();
    let stats = burn_te_debug::train::TrainStats::new();
    burn_te_debug::initialize(
        DebugOptions::new(&config)
            .log_dir(&dir)
            .logger(collect.clone())
            .boxed_logger(stats.logger()),
    )
    .unwrap();
    // The names the config gives layer `fc` (what the dashboard registers before training).
    let names = burn_te_debug::stat_names(["fc"]).unwrap();
    assert_eq!(
        names,
        [
            "fc_activation_mean",
            "fc_activation_max",
            "fc_activation_l1_norm",
            "fc_weight_mean",
            "fc_weight_max",
            "fc_weight_l1_norm",
            "fc_activation_underflows%",
            "fc_activation_scale_inv_min",
        ]
    );
    let (epochs, batches) = (2, 3);
    let renderer = learner::train(&dir.join("run"), epochs, batches, &stats);
    burn_te_debug::end().unwrap();

    let logged = collect.0.lock().unwrap().clone();
    let iterations = epochs * batches;
    // Validation runs `paused`: its forward passes add nothing (they would otherwise show up at `end()`, after the
    // last step, or inside the first step of the next epoch).
    assert!(
        logged.iter().all(|(it, _)| *it < iterations as u64),
        "{logged:?}"
    );
    let train = renderer.train.lock().unwrap().clone();
    assert_eq!(
        train["Loss"].len(),
        iterations,
        "one loss per training iteration"
    );
    for name in &names {
        let shown = train
            .get(name)
            .unwrap_or_else(|| panic!("{name} not shown: {train:?}"));
        assert_eq!(shown.len(), iterations, "{name}: one point per iteration");
        // The k-th point is step k's value; a stat with freq 2 holds its last value in between.
        let mut last = f64::NAN;
        for (k, value) in shown.iter().enumerate() {
            if let Some((_, v)) = logged
                .iter()
                .find(|(it, v)| *it == k as u64 && v.name == *name)
            {
                last = v.value;
            }
            assert!(
                (value.is_nan() && last.is_nan()) || *value == last,
                "{name} at iteration {k}: shown {value}, logged {last}"
            );
        }
    }
    // Activation means differ between batches: the points follow the steps, not one repeated value.
    let means = &train["fc_activation_mean"];
    assert!(means.windows(2).any(|w| w[0] != w[1]));
    // burn-train's file metric logger has them too, one line per iteration of each epoch.
    for epoch in 1..=epochs {
        let file = dir.join(format!("run/train/epoch-{epoch}/fc_activation_max.log"));
        let lines = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
        let values: Vec<f64> = lines.lines().map(|l| l.parse().unwrap()).collect();
        let expected: Vec<f64> = (0..batches)
            .map(|b| {
                let it = ((epoch - 1) * batches + b) as u64;
                logged
                    .iter()
                    .find(|(i, v)| *i == it && v.name == "fc_activation_max")
                    .unwrap()
                    .1
                    .value
            })
            .collect();
        assert_eq!(values, expected, "epoch {epoch}");
    }
}
