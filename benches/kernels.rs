//! Kernel throughput on the default wgpu device (lavapipe on CPU-only machines), each against a baseline in the
//! same run:
//! - `quantize` (E4M3, fused amax off) vs a plain f32 copy kernel with the same launch shape;
//! - one-pass `stats` vs `amax` alone.
//!
//! - the GEMM with NVFP4 operands vs FP8 operands (512³, 1024³), and NVFP4 quantization.
//!
//! Sizes: 1M and 16M elements. Throughput is bytes moved (quantize 5 B/elem: 4 read + 1 written; copy 8 B/elem;
//! stats and amax 4 B/elem read). Run: `cargo bench --bench kernels`.

use burn_te_kernels::cubecl::prelude::*;
use burn_te_kernels::cubecl::server::Handle;
use burn_te_kernels::cubecl::wgpu::{WgpuDevice, WgpuRuntime};
use burn_te_kernels::cubecl::{CubeDim, calculate_cube_count_elemwise, future::block_on};
use burn_te_kernels::gemm::{GemmOperand, OperandCodes, fp8_gemm};
use burn_te_kernels::nvfp4::{self, Nvfp4Rounding, Nvfp4Tile};
use burn_te_kernels::{Fp8Format, ops};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

type R = WgpuRuntime;

/// The baseline: four f32 per unit, like the quantize kernel.
#[cube(launch_unchecked)]
fn copy_kernel(input: &Array<f32>, output: &mut Array<f32>, len: u32) {
    let first = ABSOLUTE_POS * 4;
    #[unroll]
    for k in 0..4u32 {
        let index = first + k as usize;
        if index < len as usize {
            output[index] = input[index];
        }
    }
}

fn copy(client: &ComputeClient<R>, input: &Handle, output: &Handle, len: usize) {
    let cube_dim = CubeDim::new_1d(256);
    let cube_count = calculate_cube_count_elemwise(client, len.div_ceil(4), cube_dim);
    unsafe {
        copy_kernel::launch_unchecked::<R>(
            client,
            cube_count,
            cube_dim,
            ArrayArg::from_raw_parts(input.clone(), len),
            ArrayArg::from_raw_parts(output.clone(), len),
            len as u32,
        );
    }
}

fn sync(client: &ComputeClient<R>) {
    block_on(client.sync()).expect("device sync");
}

fn bench_kernels(c: &mut Criterion) {
    let client = R::client(&WgpuDevice::default());
    for len in [1usize << 20, 1 << 24] {
        let data: Vec<f32> = (0..len)
            .map(|i| ((i as f32) * 0.618).sin() * 100.0)
            .collect();
        let input = client.create_from_slice(f32::as_bytes(&data));
        let output = client.empty(len * 4);
        let scale = ops::scalar_buffer(&client, 4.0);
        let label = format!("{}M", len >> 20);

        let mut group = c.benchmark_group("quantize_vs_copy");
        group.sample_size(10);
        group.throughput(Throughput::Bytes(len as u64 * 8));
        group.bench_function(BenchmarkId::new("copy_f32", &label), |b| {
            b.iter(|| {
                copy(&client, &input, &output, len);
                sync(&client);
            })
        });
        group.throughput(Throughput::Bytes(len as u64 * 5));
        group.bench_function(BenchmarkId::new("quantize_e4m3", &label), |b| {
            b.iter(|| {
                ops::quantize::<R, f32>(&client, &input, len, &scale, Fp8Format::E4M3, None)
                    .unwrap();
                sync(&client);
            })
        });
        group.finish();

        let mut group = c.benchmark_group("stats_vs_amax");
        group.sample_size(10);
        group.throughput(Throughput::Bytes(len as u64 * 4));
        group.bench_function(BenchmarkId::new("amax", &label), |b| {
            b.iter(|| {
                ops::amax::<R, f32>(&client, &input, len).unwrap();
                sync(&client);
            })
        });
        group.bench_function(BenchmarkId::new("stats", &label), |b| {
            b.iter(|| {
                ops::tensor_stats::<R, f32>(&client, &input, len)
                    .unwrap()
                    .read(&client)
                    .unwrap()
            })
        });
        group.bench_function(BenchmarkId::new("fp8_stats", &label), |b| {
            b.iter(|| {
                ops::fp8_tensor_stats::<R, f32>(&client, &input, len, Fp8Format::E4M3, &scale)
                    .unwrap()
                    .read_fp8(&client)
                    .unwrap()
            })
        });
        group.finish();
    }
}

/// The GEMM with NVFP4 operands (E2M1 codes, 1×16 activation blocks, 16×16 weight tiles) vs FP8 operands (E4M3,
/// per-tensor scale) in the same tiled kernel, fprop-shaped `X·Wᵀ`; and the NVFP4 quantization of both operands.
fn bench_nvfp4_gemm(c: &mut Criterion) {
    let client = R::client(&WgpuDevice::default());
    for (m, k, n) in [(512, 512, 512), (1024, 1024, 1024)] {
        let values = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 250.0)
                .collect()
        };
        let x = client.create_from_slice(f32::as_bytes(&values(m * k)));
        let w = client.create_from_slice(f32::as_bytes(&values(n * k)));
        let one = ops::scalar_buffer(&client, 1.0);
        let fp8 = |input: &Handle, len| {
            ops::quantize::<R, f32>(&client, input, len, &one, Fp8Format::E4M3, None).unwrap()
        };
        let (x8, w8) = (fp8(&x, m * k), fp8(&w, n * k));
        let nvfp4 = |input: &Handle, rows, cols, tile| {
            let amax = ops::amax::<R, f32>(&client, input, rows * cols).unwrap();
            nvfp4::nvfp4_quantize::<R, f32>(
                &client,
                input,
                rows,
                cols,
                tile,
                &amax,
                Nvfp4Rounding::Nearest,
            )
            .unwrap()
        };
        let x4 = nvfp4(&x, m, k, Nvfp4Tile::Row1x16);
        let w4 = nvfp4(&w, n, k, Nvfp4Tile::Tile16x16);
        let (x4f, w4f) = (
            nvfp4::nvfp4_block_factors(&client, &x4).unwrap(),
            nvfp4::nvfp4_block_factors(&client, &w4).unwrap(),
        );
        let operand = |codes, rows, cols, transposed| GemmOperand {
            codes: OperandCodes::Fp8(codes),
            scale_inv: &one,
            batch: 1,
            rows,
            cols,
            block: None,
            transposed,
        };
        let mut group = c.benchmark_group(format!("gemm operands {m}x{k}x{n}"));
        group.sample_size(10);
        group.bench_function("fp8 e4m3 operands", |b| {
            b.iter(|| {
                fp8_gemm::<R, f32>(
                    &client,
                    &operand(&x8, m, k, false),
                    &operand(&w8, n, k, true),
                )
                .unwrap();
                sync(&client);
            })
        });
        group.bench_function("nvfp4 operands", |b| {
            b.iter(|| {
                fp8_gemm::<R, f32>(
                    &client,
                    &x4.gemm_operand(&x4f, false),
                    &w4.gemm_operand(&w4f, true),
                )
                .unwrap();
                sync(&client);
            })
        });
        group.bench_function("nvfp4 quantize both operands", |b| {
            b.iter(|| {
                nvfp4(&x, m, k, Nvfp4Tile::Row1x16);
                nvfp4(&w, n, k, Nvfp4Tile::Tile16x16);
                sync(&client);
            })
        });
        group.finish();
    }
}

criterion_group!(benches, bench_kernels, bench_nvfp4_gemm);
criterion_main!(benches);
