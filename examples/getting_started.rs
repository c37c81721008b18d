//! Getting started: Transformer Engine's `train.py` (the debug docs' example) in Rust — a TransformerLayer
//! (hidden 512, FFN 512, 8 heads) trained for 5 iterations on a synthetic [10, 32, 512] input against a synthetic
//! target, MSE loss, Adam with lr 1e-4, the forward pass in FP8 (TE's default recipe, delayed scaling, HYBRID).
//!
//! Device choice (`burn_te_suite::device`): CUDA (with `--features cuda` and a driver), else a wgpu GPU, else the
//! CPU host path (`Autodiff<Te<Flex>>`: the FP8 GEMM on the CPU's fastest exact instruction), also where wgpu's only
//! adapter is a CPU rasterizer (lavapipe). `BURN_TE_DEVICE=cpu|wgpu|cuda` forces one. The output names the device,
//! why it was chosen, and the path (instruction) each FP8 GEMM ran on.
//!
//! Debugging, as the docs' second part: the backend is wrapped in the debug decorator (`Autodiff<Debug<Te<_>>>`),
//! `burn_te_debug::initialize` reads the docs' `config.yaml` (here `examples/getting_started_config.yaml`, found
//! through the manifest dir wherever the example runs from; `--config <file>` picks another) and `step()` closes
//! each iteration. `./log` then holds `nvdlfw_inspect_logs/` (fc1 and fc2 fprop in high precision) and
//! `nvdlfw_inspect_statistics_logs/` (the layernorm_qkv activation stats of iterations 2 to 4).
//!
//! Run: `cargo run --example getting_started` (add `--release` for a faster host path)

use burn::backend::{Autodiff, Flex};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::backend::AutodiffBackend;
use burn_te::nn::TransformerLayerConfig;
use burn_te::{DelayedScaling, Te, TeBackend, fp8_autocast};
use burn_te_debug::{Debug, DebugOptions};
use burn_te_suite::device::{DeviceChoice, ExampleDevice};

type Error = Box<dyn std::error::Error>;

const HIDDEN_SIZE: usize = 512;
const NUM_ATTENTION_HEADS: usize = 8;
/// `[sequence, batch, hidden]`: TE's default `sbhd` layout.
const INPUT_SHAPE: [usize; 3] = [10, 32, HIDDEN_SIZE];

/// Trains the layer on `device` and returns the loss of every iteration.
fn train<B: AutodiffBackend + TeBackend>(device: &B::Device) -> Result<Vec<f32>, Error> {
    B::seed(device, 0);
    let mut transformer_layer =
        TransformerLayerConfig::new(HIDDEN_SIZE, HIDDEN_SIZE, NUM_ATTENTION_HEADS)
            .with_name(Some("transformer_layer".into()))
            .try_init::<B>(device)?;
    let dummy_input = Tensor::<B, 3>::random(INPUT_SHAPE, Distribution::Normal(0.0, 1.0), device);
    let dummy_target = Tensor::<B, 3>::random(INPUT_SHAPE, Distribution::Normal(0.0, 1.0), device);
    let mut optimizer = AdamConfig::new().init();

    let mut losses = Vec::new();
    for epoch in 0..5 {
        let output = fp8_autocast(true, DelayedScaling::default(), || {
            transformer_layer.try_forward(dummy_input.clone(), None)
        })??;
        let loss = (output - dummy_target.clone()).square().mean();
        let value = loss.clone().into_scalar().elem::<f32>();
        println!("epoch {epoch}: loss {value:.6}");
        losses.push(value);
        let grads = GradientsParams::from_grads(loss.backward(), &transformer_layer);
        transformer_layer = optimizer.step(1e-4, transformer_layer, grads);
        burn_te_debug::step()?;
    }
    Ok(losses)
}

/// TE's getting-started example in Burn: a TransformerLayer trained for five steps in FP8 under a debug config
/// (LogFp8TensorStats); the stats go to ./log. On CUDA (`--features cuda`), else a wgpu GPU, else
/// the CPU host path; `BURN_TE_DEVICE=cpu|wgpu|cuda` forces one.
#[derive(clap::Parser, Debug)]
#[command(version)]
struct Args {
    /// The debug config (TE's YAML format).
    #[arg(long, value_name = "FILE", value_parser = burn_te_suite::cli::existing_file,
          default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/getting_started_config.yaml"))]
    config: std::path::PathBuf,
}

fn main() {
    burn_te_suite::show_warnings();
    burn_te_suite::exit_on_error(try_main());
}

fn try_main() -> Result<(), Error> {
    let args = <Args as clap::Parser>::parse();
    let choice = burn_te_suite::device::choose()?;
    burn_te_debug::initialize(DebugOptions::new(args.config).log_dir("./log"))?;
    run(choice)?;
    burn_te_debug::end()?;
    println!("debug logs: ./log/nvdlfw_inspect_logs and ./log/nvdlfw_inspect_statistics_logs");
    Ok(())
}

/// Trains on the chosen device and prints the path of each FP8 GEMM.
fn run(choice: DeviceChoice) -> Result<(), Error> {
    match &choice.device {
        #[cfg(feature = "cuda")]
        ExampleDevice::Cuda(device) => {
            println!("device: {choice}, backend Autodiff<Debug<Te<Cuda>>>");
            // Burn's own CUDA backend: fused with the default `fusion` feature.
            train::<Autodiff<Debug<Te<burn::backend::Cuda>>>>(device)?;
        }
        #[cfg(feature = "wgpu")]
        ExampleDevice::Wgpu(device) => {
            println!("device: {choice}, backend Autodiff<Debug<Te<Wgpu>>>");
            // Burn's own wgpu backend: fused with the default `fusion` feature.
            train::<Autodiff<Debug<Te<burn::backend::Wgpu>>>>(device)?;
        }
        ExampleDevice::Host => {
            println!("device: {choice}, backend Autodiff<Debug<Te<Flex>>>");
            train::<Autodiff<Debug<Te<Flex>>>>(&Default::default())?;
        }
    }
    burn_te_suite::device::print_fp8_gemm_paths();
    Ok(())
}
