//! Diagnostics (seed 004's toolbox): a small MLP of TE linears (`embed` → `hidden` → `head`) trained in FP8 for 6
//! iterations, in which the `hidden` layer's weights overflow to ±inf at iteration 3 (a weight update ×1e39).
//!
//! The run shows:
//! - where the first non-finite value appeared (layer, GEMM, tensor, iteration), found at `step()` with no extra
//!   sync from the statistics kernel's NaN/Inf counts (`track_non_finite`);
//! - the loss of each iteration printed at the step's sync (`print_at_step`, no extra sync);
//! - a snapshot of that step's GEMMs (safetensors + manifest) under `./diagnostics/snapshots/`;
//! - a Chrome/Perfetto trace of the run (user spans, every layer GEMM) in `./diagnostics/trace.json`;
//! - the metrics report (torch-xla's layout): step time, read-back time, GEMMs by precision, ops by name.
//!
//! `BURN_TE_EAGER_DEBUG_MODE=1` turns eager debug mode on: every op is synced and checked, and the report names the
//! op that made the first non-finite value. The device: CUDA (`--features cuda`), else a wgpu GPU, else the host
//! path (`Te<Flex>`); `BURN_TE_DEVICE=cpu|wgpu|cuda` forces one.
//!
//! Run: `cargo run --example diagnostics`

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::backend::AutodiffBackend;
use burn_te::diagnostics::{self, DiagnosticsConfig, SnapshotConfig};
use burn_te::nn::{Linear, LinearConfig};
use burn_te::{DelayedScaling, Te, TeBackend, fp8_autocast};
use burn_te_suite::device::{DeviceChoice, ExampleDevice};

type Error = Box<dyn std::error::Error>;

/// The iteration at which `hidden`'s weights overflow.
const OVERFLOW_AT: u64 = 3;
const OUT_DIR: &str = "./diagnostics";

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    embed: Linear<B>,
    hidden: Linear<B>,
    head: Linear<B>,
}

impl<B: Backend + TeBackend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        let linear = |i, o, name: &str| {
            LinearConfig::new(i, o)
                .with_name(Some(name.into()))
                .init(device)
        };
        Self {
            embed: linear(64, 128, "embed"),
            hidden: linear(128, 128, "hidden"),
            head: linear(128, 16, "head"),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let x = self.embed.forward(x).tanh();
        let x = self.hidden.forward(x).tanh();
        self.head.forward(x)
    }
}

fn train<B: AutodiffBackend + TeBackend>(device: &B::Device) -> Result<(), Error> {
    B::seed(device, 0);
    let mut model = Mlp::<B>::new(device);
    let mut optimizer = AdamConfig::new().init();
    let input = Tensor::<B, 2>::random([32, 64], Distribution::Normal(0.0, 1.0), device);
    let target = Tensor::<B, 2>::random([32, 16], Distribution::Normal(0.0, 1.0), device);
    for iteration in 0..6 {
        if iteration == OVERFLOW_AT {
            println!("iteration {iteration}: the hidden layer's weights overflow (×1e39)");
            let weight = model.hidden.weight.val().inner() * 1e39;
            model.hidden.weight = Param::from_tensor(Tensor::from_inner(weight).require_grad());
        }
        let loss = diagnostics::trace("forward", || {
            fp8_autocast(true, DelayedScaling::default(), || {
                (model.forward(input.clone()) - target.clone())
                    .square()
                    .mean()
            })
        })?;
        diagnostics::print_at_step("loss", &loss);
        let grads = diagnostics::trace("backward", || {
            GradientsParams::from_grads(loss.backward(), &model)
        });
        model = diagnostics::trace("optimizer", || optimizer.step(1e-3, model, grads));
        diagnostics::step()?;
    }
    Ok(())
}

/// Seed 004's diagnostics on a small MLP whose `hidden` weights overflow at iteration 3: where the first non-finite
/// value appeared, a snapshot and a Chrome trace under ./diagnostics, and the metrics report.
/// BURN_TE_EAGER_DEBUG_MODE=1 syncs and checks every op.
#[derive(clap::Parser, Debug)]
#[command(version)]
struct Args {}

fn main() {
    burn_te_suite::show_warnings();
    <Args as clap::Parser>::parse();
    burn_te_suite::exit_on_error(try_main());
}

fn try_main() -> Result<(), Error> {
    let choice = burn_te_suite::device::choose()?;
    let _ = std::fs::remove_dir_all(OUT_DIR);
    let snapshots = format!("{OUT_DIR}/snapshots");
    diagnostics::configure(
        DiagnosticsConfig::new()
            .with_track_non_finite(true)
            .with_snapshot(Some(SnapshotConfig::new().with_dir(snapshots))),
    )?;
    if diagnostics::eager_mode() {
        println!("eager debug mode: every op is synced and checked");
    }
    let trace = diagnostics::start_trace(format!("{OUT_DIR}/trace.json"))?;
    run(choice)?;
    let trace = trace.finish();

    println!("\n{}", diagnostics::metrics_report());
    match diagnostics::first_non_finite() {
        Some(origin) => {
            println!("first non-finite value: {origin}");
            if let Some(dir) = diagnostics::snapshot_dir(origin.iteration) {
                println!("snapshot of that step: {}", dir.display());
            }
        }
        None => println!("no non-finite value"),
    }
    println!(
        "trace: {} (open in https://ui.perfetto.dev or chrome://tracing)",
        trace.display()
    );
    Ok(())
}

/// Trains on the chosen device.
fn run(choice: DeviceChoice) -> Result<(), Error> {
    match &choice.device {
        #[cfg(feature = "cuda")]
        ExampleDevice::Cuda(device) => {
            println!("device: {choice}, backend Autodiff<Te<Cuda>>");
            train::<Autodiff<Te<burn::backend::Cuda>>>(device)
        }
        #[cfg(feature = "wgpu")]
        ExampleDevice::Wgpu(device) => {
            println!("device: {choice}, backend Autodiff<Te<Wgpu>>");
            train::<Autodiff<Te<burn::backend::Wgpu>>>(device)
        }
        ExampleDevice::Host => {
            println!("device: {choice}, backend Autodiff<Te<Flex>>");
            train::<Autodiff<Te<Flex>>>(&Default::default())
        }
    }
}
