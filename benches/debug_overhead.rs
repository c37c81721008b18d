//! What the debug decorator costs: a TransformerLayer FP8 training step under `Autodiff<Debug<Te<B>>>` vs the same
//! step under `Autodiff<Te<B>>`, in one run, on two devices:
//! - wgpu (lavapipe on CPU-only machines), hidden 256, FFN 1024, 256 tokens;
//! - the host path (`Flex`), hidden 1024, FFN 4096, 1024 tokens: the layer of the host-path benches.
//!
//! What each measures:
//! - no debug session, a session without config, a config that matches no layer: target ≤ 1 % (the layers take the
//!   plain path and are not asked again until a feature may run);
//! - LogTensorStats (all eight stats) of all six tensors of every layer at every step: the cost of the statistics
//!   kernels and the one read per step;
//! - LogQuantizationError (sqnr, rel_l2_error, max_abs_error) of the three GEMMs of every layer at every step: one
//!   extra high-precision GEMM per GEMM, a subtraction and two statistics passes per output (and the backward
//!   keeps its high-precision operands for the reference).
//!
//! Each step ends with `burn_te_debug::step()` where a session runs, and a device sync. Read the ratios. One
//! device: `cargo bench --bench debug_overhead -- Flex` (or `-- Wgpu`).

mod common;

use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, Flex};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::backend::AutodiffBackend;
use burn_te::backends::Wgpu;
use burn_te::nn::{TransformerLayer, TransformerLayerConfig};
use burn_te::{Te, TeBackend};
use burn_te_debug::{Debug, DebugOptions};
use criterion::{Criterion, criterion_group, criterion_main};

const NO_MATCH: &str = "no_layer:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: 'no_such_layer'\n  transformer_engine:\n    LogTensorStats:\n      enabled: True\n      stats: [min, max, mean, std, l1_norm, l2_norm, cur_amax, dynamic_range]\n      tensors: [activation, weight, gradient, output, wgrad, dgrad]\n";

const QUANTIZATION_ERROR: &str = "error:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: '.*'\n  transformer_engine:\n    LogQuantizationError:\n      enabled: True\n      gemms: [fprop, dgrad, wgrad]\n      stats: [sqnr, rel_l2_error, max_abs_error]\n";

/// One FP8 step: forward, MSE loss, backward, `step()` when a session runs, device sync.
fn train_step<B: AutodiffBackend + TeBackend>(
    layer: &TransformerLayer<B>,
    x: &Tensor<B, 3>,
    target: &Tensor<B, 3>,
    debug_step: bool,
) {
    common::train_step(layer, x, target, true);
    if debug_step {
        burn_te_debug::step().expect("debug step");
    }
    B::sync(&x.device()).expect("sync");
}

/// A layer of `hidden` (FFN 4×, 64 values per head) and `[seq, batch, hidden]` input and target.
fn inputs<B: Backend>(
    (hidden, seq, batch): (usize, usize, usize),
    device: &B::Device,
) -> (TransformerLayer<B>, Tensor<B, 3>, Tensor<B, 3>) {
    let layer = TransformerLayerConfig::new(hidden, 4 * hidden, hidden / 64)
        // No dropout, as the baselines (and PyTorch's layer in the comparisons) have none.
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0)
        .with_name(Some("layer".into()))
        .init::<B>(device);
    let x = Tensor::random([seq, batch, hidden], Distribution::Normal(0.0, 1.0), device);
    let target = Tensor::random([seq, batch, hidden], Distribution::Normal(0.0, 1.0), device);
    (layer, x, target)
}

fn debug_overhead(c: &mut Criterion) {
    overhead_on::<Wgpu>(c, "Wgpu", (256, 32, 8), 20, &WgpuDevice::default());
    overhead_on::<Flex>(c, "Flex", (1024, 128, 8), 10, &Default::default());
}

/// Every stack and config of the module's list on inner backend `B`, one criterion group named after `device_name`
/// and the layer.
fn overhead_on<B>(
    c: &mut Criterion,
    device_name: &str,
    (hidden, seq, batch): (usize, usize, usize),
    samples: usize,
    device: &B::Device,
) where
    B: Backend,
    Autodiff<Te<B>>: AutodiffBackend + TeBackend<Device = B::Device>,
    Autodiff<Debug<Te<B>>>: AutodiffBackend + TeBackend<Device = B::Device>,
{
    let plain_name = format!("Autodiff<Te<{device_name}>>");
    let dir = std::env::temp_dir().join(format!(
        "burn-te-debug-bench-{device_name}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let no_match = dir.join("no_match.yaml");
    std::fs::write(&no_match, NO_MATCH).expect("config");
    let all_layers = dir.join("all_layers.yaml");
    std::fs::write(&all_layers, NO_MATCH.replace("'no_such_layer'", "'.*'")).expect("config");
    let error = dir.join("quantization_error.yaml");
    std::fs::write(&error, QUANTIZATION_ERROR).expect("config");

    let dims = (hidden, seq, batch);
    let (plain, x, target) = inputs::<Autodiff<Te<B>>>(dims, device);
    let (debugged, dx, dtarget) = inputs::<Autodiff<Debug<Te<B>>>>(dims, device);
    let mut group = c.benchmark_group(format!(
        "debug_overhead {device_name} transformer_layer h{hidden} ffn{} tokens{} fp8 step",
        4 * hidden,
        seq * batch
    ));
    group.sample_size(samples);
    group.bench_function(plain_name.as_str(), |b| {
        b.iter(|| train_step(&plain, &x, &target, false))
    });
    group.bench_function("Debug, no session", |b| {
        b.iter(|| train_step(&debugged, &dx, &dtarget, false))
    });
    let sessions = [
        (
            "Debug, session without config",
            DebugOptions::without_config(),
        ),
        (
            "Debug, config matching no layer",
            DebugOptions::new(&no_match),
        ),
        (
            "Debug, LogTensorStats 8 stats x 6 tensors x all layers, freq 1",
            DebugOptions::new(&all_layers),
        ),
        (
            "Debug, LogQuantizationError 3 stats x 3 GEMMs x all layers, freq 1",
            DebugOptions::new(&error),
        ),
    ];
    for (name, options) in sessions {
        burn_te_debug::initialize(options.log_dir(&dir)).expect("initialize");
        group.bench_function(name, |b| {
            b.iter(|| train_step(&debugged, &dx, &dtarget, true))
        });
        burn_te_debug::end().expect("end");
    }
    // The baseline again: the two baseline runs bracket the noise of this machine.
    group.bench_function(format!("{plain_name} (again)"), |b| {
        b.iter(|| train_step(&plain, &x, &target, false))
    });
    group.finish();
}

criterion_group!(benches, debug_overhead);
criterion_main!(benches);
