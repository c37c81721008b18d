//! FP8 GEMM vs Burn's own f32 matmul on the same runtime (wgpu; lavapipe on CPU-only machines), as ratios in one
//! run: pre-quantized FP8 GEMM on each device path (the SIMT kernel, cubek's tiled routines with the codes decoded
//! on load, and the autotune's choice between them, which users get), and quantize (current scaling) + GEMM end to
//! end.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use burn_te::backends::Wgpu;
use burn_te::backends::cube::gemm_path::{DeviceGemmPath, with_device_gemm_path};
use burn_te::{Fp8Format, Fp8Primitive, Scaling, TeBackend};
use common::BlockScaled;
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, criterion_group, criterion_main};

mod common;

fn input(rows: usize, cols: usize, device: &WgpuDevice) -> Tensor<Wgpu, 2> {
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 250.0)
        .collect();
    Tensor::from_data(TensorData::new(values, [rows, cols]), device)
}

fn quantize(t: &Tensor<Wgpu, 2>) -> Fp8Primitive<Wgpu> {
    Wgpu::fp8_quantize(
        t.clone().into_primitive().tensor(),
        Fp8Format::E4M3,
        Scaling::Current { margin: 0.0 },
    )
    .expect("quantize")
}

fn sync(device: &WgpuDevice) {
    <Wgpu as burn::tensor::backend::Backend>::sync(device).expect("sync");
}

/// The pre-quantized `a · b` (`b` used transposed with `rhs_t`) unforced, as users get it (the autotune's choice),
/// and forced onto each device path.
fn bench_paths(
    group: &mut BenchmarkGroup<'_, WallTime>,
    device: &WgpuDevice,
    (qa, qb): (&Fp8Primitive<Wgpu>, &Fp8Primitive<Wgpu>),
    rhs_t: bool,
) {
    let run = |path: Option<DeviceGemmPath>| {
        let gemm = || Wgpu::fp8_gemm(qa.clone(), false, qb.clone(), rhs_t).expect("gemm");
        let out = match path {
            Some(path) => with_device_gemm_path(path, gemm),
            None => gemm(),
        };
        sync(device);
        Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(out))
    };
    group.bench_function("fp8 gemm (autotuned)", |bench| bench.iter(|| run(None)));
    for path in [
        DeviceGemmPath::Simt,
        DeviceGemmPath::Tiled,
        DeviceGemmPath::Decoded,
    ] {
        group.bench_function(format!("fp8 gemm ({path})"), |bench| {
            bench.iter(|| run(Some(path)))
        });
    }
}

fn gemm(c: &mut Criterion) {
    let device = WgpuDevice::default();
    for (m, k, n) in [(512, 512, 512), (1024, 1024, 1024), (2048, 1024, 2048)] {
        let mut group = c.benchmark_group(format!("gemm {m}x{k}x{n}"));
        group.sample_size(10);
        let (a, b) = (input(m, k, &device), input(k, n, &device));
        let (qa, qb) = (quantize(&a), quantize(&b));
        group.bench_function("burn f32 matmul", |bench| {
            bench.iter(|| {
                let out = a.clone().matmul(b.clone());
                sync(&device);
                out
            })
        });
        bench_paths(&mut group, &device, (&qa, &qb), false);
        group.bench_function("quantize + fp8 gemm", |bench| {
            bench.iter(|| {
                let out = Wgpu::fp8_gemm(quantize(&a), false, quantize(&b), false).expect("gemm");
                sync(&device);
                Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(out))
            })
        });
        group.finish();
    }
}

/// MXFP8 (1×32 E8M0 blocks along K on both operands) and NVFP4 (1×16 E4M3 blocks on the activations, 16×16 tiles
/// on the weights) in fprop's `A·Bᵀ` at 1024³ on each path: block scales take the tiled path's unit routines (each
/// value times its block's factor as it loads), the decoded path (the block scales folded in as the codes are decoded
/// ahead, NVFP4's global factor on the product; f32 values on wgpu) or the SIMT kernel.
fn gemm_block_scaled(c: &mut Criterion) {
    let device = WgpuDevice::default();
    let (m, k, n) = (1024, 1024, 1024);
    let quantize = |t: &Tensor<Wgpu, 2>, recipe: BlockScaled, weight: bool| {
        let scaling = recipe.scaling(weight);
        Wgpu::fp8_quantize(
            t.clone().into_primitive().tensor(),
            Fp8Format::E4M3,
            scaling,
        )
        .expect("quantize")
    };
    for recipe in [BlockScaled::Mxfp8, BlockScaled::Nvfp4] {
        let mut group = c.benchmark_group(format!("gemm {} {m}x{k}x{n}", recipe.name()));
        group.sample_size(10);
        let qa = quantize(&input(m, k, &device), recipe, false);
        let qb = quantize(&input(n, k, &device), recipe, true);
        bench_paths(&mut group, &device, (&qa, &qb), true);
        group.finish();
    }
}

criterion_group!(benches, gemm, gemm_block_scaled);
criterion_main!(benches);
