//! A TransformerLayer training step (forward + backward) in FP8 vs the same step in f32, on the same runtime in
//! one run (wgpu; lavapipe on CPU-only machines). The ratio is what to read: these machines are noisy.

use burn::backend::Autodiff;
use burn::backend::wgpu::WgpuDevice;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_te::backends::Wgpu;
use burn_te::nn::{TransformerLayer, TransformerLayerConfig};
use burn_te::{DelayedScaling, Te, fp8_autocast};
use criterion::{Criterion, criterion_group, criterion_main};

type B = Autodiff<Te<Wgpu>>;

/// One step: forward (in FP8 when `fp8`), MSE loss, backward; synchronized so the device work is timed.
fn step(layer: &TransformerLayer<B>, x: &Tensor<B, 3>, target: &Tensor<B, 3>, fp8: bool) {
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

fn transformer_layer(c: &mut Criterion) {
    let device = WgpuDevice::default();
    // (hidden, ffn, heads, seq, batch)
    for (hidden, ffn, heads, seq, batch) in [(256, 1024, 4, 32, 8), (512, 2048, 8, 32, 8)] {
        let layer = TransformerLayerConfig::new(hidden, ffn, heads).init::<B>(&device);
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
        let mut group = c.benchmark_group(format!(
            "transformer_layer h{hidden} ffn{ffn} tokens{}",
            seq * batch
        ));
        group.sample_size(10);
        group.bench_function("f32 step", |b| b.iter(|| step(&layer, &x, &target, false)));
        group.bench_function("fp8 step", |b| b.iter(|| step(&layer, &x, &target, true)));
        group.finish();
    }
}

criterion_group!(benches, transformer_layer);
criterion_main!(benches);
