//! The GPU targets of the FP8 GEMM, on CUDA device 0, in one run
//! (`cargo bench --features cuda,autotune --bench cuda`; a few minutes on an H100):
//! - GEMM throughput (criterion's `elem/s` are FLOP/s: 2·M·N·K per GEMM) at 4096³ and a TransformerLayer's FC1
//!   shape: Burn's f32 and bf16 matmul (autotuned, as users get them), and FP8 E4M3 with per-tensor scales on
//!   cuBLASLt (fprop's K-major layout, and dgrad's, which takes a transposed copy), on cubek's tiled routines, on
//!   Burn's f16 matmul over codes decoded ahead (with Burn's bf16 and f16 matmuls in the same process) and on the
//!   SIMT kernel; MXFP8 and NVFP4 (block scales cuBLASLt does not take before sm100) decoded ahead and on the SIMT
//!   kernel.
//! - A TransformerLayer training step (forward, MSE, backward): f32, bf16 and f16 on Burn's `Cuda` (fused), FP8
//!   (DelayedScaling) on `Te<Cuda>` with f32, f16 and bf16 activations (TE's usual setting: the last).
//! - cuBLASLt on its own stream (host waits around each call) and on CubeCL's stream (no waits), both in GEMM and
//!   step rows.
//!
//! Burn 0.21 fixes a device's float type at its first tensor (the device's default dtype, whatever the backend's
//! element type), so each float type is measured in a process of its own: the bench runs itself once per type with
//! `BURN_TE_BENCH_FLOAT` set, and that process sets the type before its first tensor. Each measured function first
//! runs once untimed, so that Burn's autotune of its kernels stays out of the measurement; functions a filter leaves
//! out are not run at all.
//!
//! Targets (issue 44): FP8 GEMM ≥ 1.5× Burn's bf16 matmul at 4096³ on sm89/sm90; the FP8 step ≤ 0.8× the bf16 step.

mod common;

use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, TensorPrimitive};
use burn_te::backends::cube::gemm_path::{
    CublasLtStream, DeviceGemmPath, with_cublaslt_stream, with_device_gemm_path, with_tiled_routine,
};
use burn_te::nn::TransformerLayerConfig;
use burn_te::{Fp8Format, Scaling, Te, TeBackend};
use burn_te_kernels::cubecl::cuda::CudaDevice;
use burn_te_kernels::gemm::cubek::CubekRoutine;
use common::BlockScaled;
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput};
use half::{bf16, f16};
use std::cell::Cell;
use std::time::{Duration, Instant};

/// burn-te's FP8 ops on CUDA: `CubeBackend<CudaRuntime, f32>` (no fusion).
type Plain = burn_te::backends::Cuda;
/// Burn's CUDA backend as users get it (fused), with float element `F`.
type Fused<F> = burn::backend::Cuda<F>;

fn device() -> CudaDevice {
    CudaDevice::new(0)
}

fn sync<B: Backend<Device = CudaDevice>>() {
    B::sync(&device()).expect("sync");
}

/// Runs `warm_up` the first time a measured function is entered, so that Burn's autotune stays out of its times.
/// Criterion enters only the functions its filter selects: the others cost no autotune.
fn untimed_once(done: &Cell<bool>, warm_up: impl FnOnce()) {
    if !done.replace(true) {
        warm_up();
    }
}

fn bench_matmul<B: Backend<Device = CudaDevice>>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    (m, k, n): (usize, usize, usize),
) {
    let a = Tensor::<B, 2>::random([m, k], Distribution::Normal(0.0, 1.0), &device());
    let b = Tensor::<B, 2>::random([k, n], Distribution::Normal(0.0, 1.0), &device());
    let warmed = Cell::new(false);
    group.bench_function(name, |bench| {
        untimed_once(&warmed, || {
            drop(a.clone().matmul(b.clone()));
            sync::<B>();
        });
        bench.iter(|| {
            let out = a.clone().matmul(b.clone());
            sync::<B>();
            out
        })
    });
}

fn bench_fp8(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    (path, stream): (DeviceGemmPath, CublasLtStream),
    routine: Option<CubekRoutine>,
    rhs_transposed: bool,
    (m, k, n): (usize, usize, usize),
) {
    let quantize = |shape: [usize; 2]| {
        let t = Tensor::<Plain, 2>::random(shape, Distribution::Normal(0.0, 1.0), &device());
        Plain::fp8_quantize(
            t.into_primitive().tensor(),
            Fp8Format::E4M3,
            Scaling::Current { margin: 0.0 },
        )
        .expect("quantize")
    };
    let a = quantize([m, k]);
    let b = quantize(if rhs_transposed { [n, k] } else { [k, n] });
    time_fp8(
        group,
        name,
        (path, stream),
        routine,
        (&a, &b),
        rhs_transposed,
    );
}

/// `A·Bᵀ` (fprop's layout) with `recipe`'s operands on `path`.
fn bench_fp8_block_scaled(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    path: DeviceGemmPath,
    recipe: BlockScaled,
    (m, k, n): (usize, usize, usize),
) {
    let quantize = |shape: [usize; 2], weight: bool| {
        let t = Tensor::<Plain, 2>::random(shape, Distribution::Normal(0.0, 1.0), &device());
        let scaling = recipe.scaling(weight);
        Plain::fp8_quantize(t.into_primitive().tensor(), Fp8Format::E4M3, scaling)
            .expect("block-scaled quantize")
    };
    let (a, b) = (quantize([m, k], false), quantize([n, k], true));
    time_fp8(
        group,
        name,
        (path, CublasLtStream::Own),
        None,
        (&a, &b),
        true,
    );
}

/// Times `a · b` (or `a · bᵀ`) asking for `path` (and `routine`), each run synchronised.
fn time_fp8(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    (path, stream): (DeviceGemmPath, CublasLtStream),
    routine: Option<CubekRoutine>,
    (a, b): (&burn_te::Fp8Primitive<Plain>, &burn_te::Fp8Primitive<Plain>),
    rhs_transposed: bool,
) {
    group.bench_function(name, |bench| {
        bench.iter(|| {
            let run = || {
                with_cublaslt_stream(stream, || {
                    with_device_gemm_path(path, || {
                        Plain::fp8_gemm(a.clone(), false, b.clone(), rhs_transposed)
                    })
                })
            };
            let out = match routine {
                Some(routine) => with_tiled_routine(routine, run),
                None => run(),
            }
            .expect("gemm");
            sync::<Plain>();
            Tensor::<Plain, 2>::from_primitive(TensorPrimitive::Float(out))
        })
    });
}

/// Burn's matmul on `dtype` tensors, in whatever process: the call a model in `dtype` makes (`float_matmul`: the
/// output in `dtype`, Burn's autotune choosing the routine), on `CubeTensor`s made in that type directly, so that the
/// f32 process's FP8 rows have their bf16 and f16 baselines in the same run.
fn bench_cube_matmul(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    dtype: burn::tensor::DType,
    (m, k, n): (usize, usize, usize),
) {
    use burn::tensor::DType;
    use burn_cubecl::kernel::matmul::{MatmulStrategy, matmul};
    use burn_cubecl::tensor::CubeTensor;
    use burn_te_kernels::cubecl::Runtime;
    use burn_te_kernels::cubecl::cuda::CudaRuntime;
    let client = CudaRuntime::client(&device());
    let make = |rows: usize, cols: usize| {
        let values = (0..rows * cols).map(|i| ((i * 7919) % 17) as f32 / 8.0 - 1.0);
        let bytes: Vec<u8> = match dtype {
            DType::BF16 => values
                .flat_map(|v| bf16::from_f32(v).to_le_bytes())
                .collect(),
            _ => values
                .flat_map(|v| f16::from_f32(v).to_le_bytes())
                .collect(),
        };
        CubeTensor::<CudaRuntime>::new_contiguous(
            client.clone(),
            device(),
            burn::tensor::Shape::new([rows, cols]),
            client.create_from_slice(&bytes),
            dtype,
        )
    };
    let (a, b) = (make(m, k), make(k, n));
    let run = || {
        let out = matmul(a.clone(), b.clone(), None, MatmulStrategy::default(), dtype)
            .expect("Burn's matmul");
        sync::<Plain>();
        out
    };
    let warmed = Cell::new(false);
    group.bench_function(name, |bench| {
        untimed_once(&warmed, || drop(run()));
        bench.iter(run)
    });
}

/// The float types measured, each in a process of its own.
#[derive(Clone, Copy, PartialEq)]
enum Float {
    F32,
    Bf16,
    F16,
}

impl Float {
    const ALL: [Float; 3] = [Float::F32, Float::Bf16, Float::F16];
    const VAR: &str = "BURN_TE_BENCH_FLOAT";

    fn name(self) -> &'static str {
        match self {
            Float::F32 => "f32",
            Float::Bf16 => "bf16",
            Float::F16 => "f16",
        }
    }

    /// Sets this type as the device's before its first tensor.
    fn set_default(self) {
        use burn::tensor::FloatDType;
        let dtype = match self {
            Float::F32 => FloatDType::F32,
            Float::Bf16 => FloatDType::BF16,
            Float::F16 => FloatDType::F16,
        };
        burn::tensor::backend::set_default_float_dtype::<Plain>(&device(), dtype)
            .expect("the device's float type, set before its first tensor");
    }
}

fn gemm(c: &mut Criterion, float: Float) {
    for shape in [(4096, 4096, 4096), (8192, 2048, 8192)] {
        let (m, k, n) = shape;
        let mut group = c.benchmark_group(format!("cuda gemm {m}x{k}x{n}"));
        group.sample_size(10);
        group.throughput(Throughput::Elements((2 * m * n * k) as u64));
        match float {
            Float::F32 => {
                bench_matmul::<Fused<f32>>(&mut group, "burn f32 matmul", shape);
                bench_fp8(
                    &mut group,
                    "fp8 cublaslt (A·Bᵀ)",
                    (DeviceGemmPath::CublasLt, CublasLtStream::Own),
                    None,
                    true,
                    shape,
                );
                bench_fp8(
                    &mut group,
                    "fp8 cublaslt on CubeCL's stream (A·Bᵀ)",
                    (DeviceGemmPath::CublasLt, CublasLtStream::CubeCl),
                    None,
                    true,
                    shape,
                );
                bench_fp8(
                    &mut group,
                    "fp8 cublaslt (A·B, transposed copy)",
                    (DeviceGemmPath::CublasLt, CublasLtStream::Own),
                    None,
                    false,
                    shape,
                );
                bench_fp8(
                    &mut group,
                    "fp8 simt kernel",
                    (DeviceGemmPath::Simt, CublasLtStream::Own),
                    None,
                    true,
                    shape,
                );
                // cubek's Simple routine on CMMA tiles with f16 stages, the codes decoded on load.
                bench_fp8(
                    &mut group,
                    "fp8 tiled cubek (A·Bᵀ)",
                    (DeviceGemmPath::Tiled, CublasLtStream::Own),
                    None,
                    true,
                    shape,
                );
                bench_fp8(
                    &mut group,
                    "fp8 tiled cubek (A·B)",
                    (DeviceGemmPath::Tiled, CublasLtStream::Own),
                    None,
                    false,
                    shape,
                );
                // Burn's own matmul (its autotune's routine for f16) on the codes decoded ahead into f16, beside
                // Burn's bf16 and f16 matmuls in this process.
                bench_cube_matmul(
                    &mut group,
                    "burn bf16 matmul, this process",
                    burn::tensor::DType::BF16,
                    shape,
                );
                bench_cube_matmul(
                    &mut group,
                    "burn f16 matmul, this process",
                    burn::tensor::DType::F16,
                    shape,
                );
                bench_fp8(
                    &mut group,
                    "fp8 decoded + burn f16 matmul (A·Bᵀ)",
                    (DeviceGemmPath::Decoded, CublasLtStream::Own),
                    None,
                    true,
                    shape,
                );
                bench_fp8(
                    &mut group,
                    "fp8 decoded + burn f16 matmul (A·B)",
                    (DeviceGemmPath::Decoded, CublasLtStream::Own),
                    None,
                    false,
                    shape,
                );
                // MXFP8 and NVFP4: the decoded path (MXFP8 as bf16 values with the block scales folded in,
                // NVFP4 as f16 values with their E4M3 block scales, the global factor on the product) against the
                // SIMT kernel.
                for recipe in [BlockScaled::Mxfp8, BlockScaled::Nvfp4] {
                    for (path, on) in [
                        (DeviceGemmPath::Decoded, "decoded"),
                        (DeviceGemmPath::Simt, "simt kernel"),
                    ] {
                        bench_fp8_block_scaled(
                            &mut group,
                            &format!("fp8 {} {on} (A·Bᵀ)", recipe.name()),
                            path,
                            recipe,
                            shape,
                        );
                    }
                }
                // Each of cubek's plane routines on matrix units (the families Burn's own matmul tunes among), at
                // 4096³ in fprop's layout: what `BURN_TE_TILED_ROUTINES=all` lets the autotune choose from.
                if shape == (4096, 4096, 4096) {
                    for routine in CubekRoutine::ALL
                        .into_iter()
                        .filter(|r| r.on_matrix_units())
                    {
                        bench_fp8(
                            &mut group,
                            &format!("fp8 tiled cubek {} (A·Bᵀ)", routine.name()),
                            (DeviceGemmPath::Tiled, CublasLtStream::Own),
                            Some(routine),
                            true,
                            shape,
                        );
                    }
                }
            }
            Float::Bf16 => bench_matmul::<Fused<bf16>>(&mut group, "burn bf16 matmul", shape),
            Float::F16 => bench_matmul::<Fused<f16>>(&mut group, "burn f16 matmul", shape),
        }
        group.finish();
    }
    print_paths("gemm");
}

/// The GEMMs counted per device path so far (the autotune's picks in the steps), and the fallbacks.
fn print_paths(after: &str) {
    let paths = burn_te::diagnostics::counter_names()
        .into_iter()
        .filter(|name| name.starts_with("DeviceFp8Gemm"))
        .map(|name| {
            format!(
                "{name} = {}",
                burn_te::diagnostics::counter_value(&name).unwrap_or(0)
            )
        })
        .collect::<Vec<_>>();
    println!(
        "device GEMM paths after {after}: {paths:?}; fallbacks: {:?}",
        burn_te::fallback_counts()
    );
}

fn bench_step<B: AutodiffBackend + TeBackend<Device = CudaDevice>>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    (hidden, ffn, heads, seq, batch): (usize, usize, usize, usize, usize),
    fp8: bool,
    stream: CublasLtStream,
) {
    let layer = TransformerLayerConfig::new(hidden, ffn, heads)
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0)
        .init::<B>(&device());
    let x = Tensor::<B, 3>::random(
        [seq, batch, hidden],
        Distribution::Normal(0.0, 1.0),
        &device(),
    );
    let target = Tensor::random(
        [seq, batch, hidden],
        Distribution::Normal(0.0, 1.0),
        &device(),
    );
    let step = || with_cublaslt_stream(stream, || common::train_step(&layer, &x, &target, fp8));
    let warmed = Cell::new(false);
    group.bench_function(name, |b| {
        untimed_once(&warmed, || {
            step();
            B::sync(&device()).expect("sync");
        });
        b.iter(|| {
            step();
            B::sync(&device()).expect("sync")
        })
    });
    if warmed.get() {
        // The host's share: the time until the step returns (recording, launching, cuBLASLt's calls and waits)
        // against the time until the device is done, over 20 steps. Near 1, the device waits for the host.
        let (mut returned, mut done) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..20 {
            let start = Instant::now();
            step();
            returned += start.elapsed();
            B::sync(&device()).expect("sync");
            done += start.elapsed();
        }
        println!(
            "{name}: the step returns after {:.2} ms, the device is done after {:.2} ms (mean of 20)",
            returned.as_secs_f64() * 50.0,
            done.as_secs_f64() * 50.0
        );
    }
}

/// The step in high precision (`float`), and in FP8 with cuBLASLt on CubeCL's stream (the default) and on its own.
fn steps<B: AutodiffBackend + TeBackend<Device = CudaDevice>>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    float: &str,
    shape: (usize, usize, usize, usize, usize),
) {
    use CublasLtStream::{CubeCl, Own};
    bench_step::<B>(group, &format!("{float} Cuda (fused)"), shape, false, Own);
    let on_cubecl = format!("fp8 Te<Cuda> {float}, on CubeCL's stream");
    bench_step::<B>(group, &on_cubecl, shape, true, CubeCl);
    let on_own = format!("fp8 Te<Cuda> {float}, on cuBLASLt's own stream");
    bench_step::<B>(group, &on_own, shape, true, Own);
}

fn transformer_layer(c: &mut Criterion, float: Float) {
    // (hidden, ffn, heads, seq, batch): 4096 tokens.
    let shape = (2048, 8192, 16, 1024, 4);
    let mut group = c.benchmark_group("cuda transformer_layer h2048 ffn8192 tokens4096");
    group.sample_size(10);
    match float {
        Float::F32 => steps::<Autodiff<Te<Fused<f32>>>>(&mut group, float.name(), shape),
        Float::Bf16 => steps::<Autodiff<Te<Fused<bf16>>>>(&mut group, float.name(), shape),
        Float::F16 => steps::<Autodiff<Te<Fused<f16>>>>(&mut group, float.name(), shape),
    }
    group.finish();
    print_paths("the steps");
}

fn main() {
    if let Ok(name) = std::env::var(Float::VAR) {
        let float = Float::ALL
            .into_iter()
            .find(|float| float.name() == name)
            .unwrap_or_else(|| panic!("{}={name:?}: one of f32, bf16, f16", Float::VAR));
        float.set_default();
        let mut criterion = Criterion::default().configure_from_args();
        gemm(&mut criterion, float);
        transformer_layer(&mut criterion, float);
        criterion.final_summary();
        return;
    }
    // One process per float type, with this run's arguments (criterion's filter and options).
    let exe = std::env::current_exe().expect("the bench's own path");
    for float in Float::ALL {
        let status = std::process::Command::new(&exe)
            .args(std::env::args_os().skip(1))
            .env(Float::VAR, float.name())
            .status()
            .expect("runs the bench for one float type");
        assert!(
            status.success(),
            "the {} run failed: {status}",
            float.name()
        );
    }
    common::chart("burn-te-cuda-gemm.svg", draw_chart);
}

/// TFLOP/s of each GEMM shape per function as grouped bars.
fn draw_chart(
    criterion: &std::path::Path,
    svg: &std::path::Path,
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let results: Vec<_> = common::measured(criterion)
        .into_iter()
        .filter_map(|(g, f, gflops)| {
            Some((g.strip_prefix("cuda gemm ")?.to_string(), f, gflops / 1e3))
        })
        .collect();
    let mut shapes: Vec<String> = results.iter().map(|r| r.0.clone()).collect();
    shapes.sort();
    shapes.dedup();
    let series = [
        ("burn f32 matmul", RGBColor(90, 90, 90)),
        ("burn bf16 matmul", RGBColor(150, 150, 150)),
        ("burn f16 matmul", RGBColor(190, 190, 190)),
        ("fp8 simt kernel", RGBColor(230, 150, 60)),
        (
            "fp8 cublaslt (A·B, transposed copy)",
            RGBColor(120, 190, 120),
        ),
        ("fp8 cublaslt (A·Bᵀ)", RGBColor(40, 140, 70)),
    ];
    let value = |shape: &str, function: &str| {
        results
            .iter()
            .find(|(g, f, _)| g == shape && f == function)
            .map(|r| r.2)
    };
    let top = results.iter().map(|r| r.2).fold(0.0, f64::max) * 1.25;
    let root = SVGBackend::new(svg, (1000, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "FP8 GEMM on CUDA vs Burn's matmul (TFLOP/s)",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..shapes.len() as f64, 0f64..top.max(1.0))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("TFLOP/s")
        .draw()?;
    for (index, &(function, color)) in series.iter().enumerate() {
        let bars = shapes.iter().enumerate().filter_map(|(i, shape)| {
            let x0 = i as f64 + 0.06 + 0.148 * index as f64;
            value(shape, function)
                .map(|v| Rectangle::new([(x0, 0.0), (x0 + 0.13, v)], color.filled()))
        });
        chart
            .draw_series(bars)?
            .label(function)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 12, y + 6)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    for (i, shape) in shapes.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(i as f64 + 0.4, 0.0));
        root.draw(&Text::new(shape.clone(), (x, y + 10), ("sans-serif", 15)))?;
    }
    root.present()?;
    Ok(())
}
