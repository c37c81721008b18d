//! A custom debug feature: Transformer Engine's tutorial feature `PercentageGreaterThanThreshold` in Rust.
//!
//! A feature implements [`Feature`] (TE's call API: routing calls answer `Some(Routing { enabled, next })`,
//! `inspect_tensor` records what it found) and is registered by name before `initialize`; the config then uses it
//! like a built-in one. The config is TE's `custom_feature_example_config.yaml` verbatim
//! (`examples/custom_feature_config.yaml`): on every layer, the percentage of activation entries with
//! |x| > 0.1 every 5 iterations, beside LogTensorStats' `min`.
//!
//! The model is a two-layer MLP of TE `Linear`s trained in FP8 for 11 iterations on the CPU host path
//! (`Autodiff<Debug<Te<Flex>>>`, so it runs anywhere; `Te<Wgpu>` and `Te<Cuda>` work the same). The stats go to
//! `./log/nvdlfw_inspect_statistics_logs/`, and are printed at the end.
//!
//! Run: `cargo run --example custom_feature`

use burn::backend::{Autodiff, Flex};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_te::nn::{Linear, LinearConfig};
use burn_te::{Float8CurrentScaling, Te, fp8_autocast};
use burn_te_debug::config::{FeatureSpec, Need, SCHEDULE_KEYS};
use burn_te_debug::features::{
    DebugTensor, Feature, Inspection, Namespace, Routing, Scheduled, register_feature,
};
use burn_te_debug::{ConfigError, Debug, DebugError, DebugOptions, TensorName};

type B = Autodiff<Debug<Te<Flex>>>;
type Error = Box<dyn std::error::Error>;

/// Logs `<layer>_<tensor>_percentage_greater_than_threshold`: the fraction of entries with |x| > threshold.
struct PercentageGreaterThanThreshold {
    /// Per configured tensor: its schedule and threshold.
    entries: Scheduled<f64>,
}

impl PercentageGreaterThanThreshold {
    /// Builds the feature from its config entry: `tensors`/`tensors_struct`, `threshold`, the schedule keys. Any
    /// other key is an error that names the section, feature, key and line.
    fn from_spec(spec: &FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> {
        let keys: Vec<&str> = SCHEDULE_KEYS.iter().copied().chain(["threshold"]).collect();
        let entries = spec
            .items(Need::No, Need::Required, &TensorName::ALL, Some(&keys))?
            .into_iter()
            .map(|item| {
                let tensor = item.tensor.expect("tensors are required");
                let threshold = item.f64("threshold")?.unwrap_or(0.0);
                Ok((tensor, item.schedule()?, threshold))
            })
            .collect::<Result<_, ConfigError>>()?;
        Ok(Box::new(PercentageGreaterThanThreshold {
            entries: Scheduled(entries),
        }))
    }
}

impl Feature for PercentageGreaterThanThreshold {
    fn name(&self) -> &str {
        "PercentageGreaterThanThreshold"
    }

    /// On when a schedule of this tensor runs; `next` lets a layer skip the debug path until then.
    fn inspect_tensor_enabled(
        &self,
        _: &str,
        tensor: TensorName,
        iteration: u64,
    ) -> Option<Routing> {
        self.entries.routing(tensor, iteration)
    }

    fn inspect_tensor(
        &self,
        layer: &str,
        tensor: TensorName,
        x: &dyn DebugTensor,
        iteration: u64,
        out: &mut Inspection,
    ) -> Result<(), DebugError> {
        // `to_vec` reads the tensor from the device (a sync point, fine every few iterations). The built-in stats
        // features instead launch kernels here and read the results once per step.
        let values = x.to_vec()?;
        for threshold in self.entries.due(tensor, iteration) {
            let count = values
                .iter()
                .filter(|v| f64::from(v.abs()) > *threshold)
                .count();
            let percentage = count as f64 / values.len().max(1) as f64;
            out.log_scalar(
                format!("{layer}_{tensor}_percentage_greater_than_threshold"),
                percentage,
            );
        }
        Ok(())
    }
}

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
}

/// A custom debug feature (TE's tutorial `PercentageGreaterThanThreshold`) registered by name and used from TE's
/// example config, on a two-layer MLP trained in FP8 on the CPU host path; the stats go to ./log.
#[derive(clap::Parser, Debug)]
#[command(version)]
struct Args {}

fn main() {
    burn_te_suite::show_warnings();
    <Args as clap::Parser>::parse();
    burn_te_suite::exit_on_error(try_main());
}

fn try_main() -> Result<(), Error> {
    register_feature(
        Namespace::TransformerEngine,
        "PercentageGreaterThanThreshold",
        PercentageGreaterThanThreshold::from_spec,
    )?;
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/custom_feature_config.yaml"
    );
    burn_te_debug::initialize(DebugOptions::new(config).log_dir("./log"))?;

    let device = Default::default();
    B::seed(&device, 0);
    let mut model = Mlp {
        fc1: LinearConfig::new(64, 128)
            .with_name(Some("fc1".into()))
            .init::<B>(&device),
        fc2: LinearConfig::new(128, 64)
            .with_name(Some("fc2".into()))
            .init::<B>(&device),
    };
    let mut optimizer = SgdConfig::new().init();
    let x = Tensor::<B, 2>::random([32, 64], Distribution::Normal(0.0, 1.0), &device);
    let target = x.clone().tanh();
    for iteration in 0..11 {
        let output = fp8_autocast(true, Float8CurrentScaling::default(), || {
            model
                .fc2
                .forward(burn::tensor::activation::gelu(model.fc1.forward(x.clone())))
        })?;
        let loss = (output - target.clone()).square().mean();
        println!(
            "iteration {iteration}: loss {:.5}",
            loss.clone().into_scalar()
        );
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(0.05, model, grads);
        burn_te_debug::step()?;
    }
    burn_te_debug::end()?;

    let stats = std::fs::read_to_string(
        "log/nvdlfw_inspect_statistics_logs/nvdlfw_inspect_globalrank-0.log",
    )?;
    println!("\n./log/nvdlfw_inspect_statistics_logs/nvdlfw_inspect_globalrank-0.log:");
    for line in stats.lines().filter(|l| l.contains("iteration=")) {
        println!("{}", line.split(" - INFO - ").nth(1).unwrap_or(line));
    }
    Ok(())
}
