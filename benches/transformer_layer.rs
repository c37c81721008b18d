//! A TransformerLayer training step (forward + backward) on wgpu (lavapipe on CPU-only machines), in one run:
//! - f32 on Burn's `burn::backend::Wgpu` (with the `fusion` feature: `Fusion<CubeBackend>`, as users get it) and on
//!   `CubeBackend` without fusion;
//! - FP8 (delayed scaling) on `Te<CubeBackend>` and on `Te<burn::backend::Wgpu>` (fused: Burn's fused kernels for
//!   every op but the FP8 GEMMs).
//!
//! Hidden 256 to 2048 (FFN 4×hidden, 256 tokens), so the growth with size shows. The ratios are what to read: these
//! machines are noisy. Filter by size, e.g. `cargo bench --features autotune --bench transformer_layer -- h1024`.

use burn::backend::Autodiff;
use burn::backend::wgpu::WgpuDevice;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::backend::AutodiffBackend;
use burn_te::backends::Wgpu;
use burn_te::nn::{TransformerLayer, TransformerLayerConfig};
use burn_te::{DelayedScaling, Te, TeBackend, fp8_autocast};
use criterion::{
    BenchmarkGroup, Criterion, criterion_group, criterion_main, measurement::WallTime,
};

/// Burn's default wgpu backend (fused).
type Fused = burn::backend::Wgpu;

/// One step: forward (in FP8 when `fp8`), MSE loss, backward; synchronized so the device work is timed.
fn step<B: AutodiffBackend + TeBackend>(
    layer: &TransformerLayer<B>,
    x: &Tensor<B, 3>,
    target: &Tensor<B, 3>,
    fp8: bool,
) {
    let forward = || layer.forward(x.clone(), None);
    let y = if fp8 {
        fp8_autocast(true, DelayedScaling::default(), forward).expect("valid recipe")
    } else {
        forward()
    };
    let grads = (y - target.clone()).square().mean().backward();
    drop(grads);
    <B as Backend>::sync(&x.device()).expect("sync");
}

/// Benchmarks one step of a fresh layer on backend `B`.
fn bench_step<B: AutodiffBackend + TeBackend<Device = WgpuDevice>>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    (hidden, ffn, heads, seq, batch): (usize, usize, usize, usize, usize),
    fp8: bool,
) {
    let device = WgpuDevice::default();
    let layer = TransformerLayerConfig::new(hidden, ffn, heads)
        // No dropout, as the baselines (and PyTorch's layer in the comparisons) have none.
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0)
        .init::<B>(&device);
    let x = Tensor::<B, 3>::random(
        [seq, batch, hidden],
        Distribution::Normal(0.0, 1.0),
        &device,
    );
    let target = Tensor::random(
        [seq, batch, hidden],
        Distribution::Normal(0.0, 1.0),
        &device,
    );
    group.bench_function(name, |b| b.iter(|| step(&layer, &x, &target, fp8)));
}

fn transformer_layer(c: &mut Criterion) {
    // (hidden, ffn, heads, seq, batch)
    for shape in [
        (256, 1024, 4, 32, 8),
        (512, 2048, 8, 32, 8),
        (1024, 4096, 16, 32, 8),
        (2048, 8192, 32, 32, 8),
    ] {
        let (hidden, ffn, _, seq, batch) = shape;
        let mut group = c.benchmark_group(format!(
            "transformer_layer h{hidden} ffn{ffn} tokens{}",
            seq * batch
        ));
        group.sample_size(10);
        bench_step::<Autodiff<Fused>>(&mut group, "f32 Wgpu (fused)", shape, false);
        bench_step::<Autodiff<Wgpu>>(&mut group, "f32 CubeBackend", shape, false);
        bench_step::<Autodiff<Te<Wgpu>>>(&mut group, "fp8 Te<CubeBackend>", shape, true);
        bench_step::<Autodiff<Te<Fused>>>(&mut group, "fp8 Te<Wgpu> (fused)", shape, true);
        group.finish();
    }
}

criterion_group!(benches, transformer_layer);
criterion_main!(benches);
