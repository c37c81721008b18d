//! The main job until the training example exists: quantize a synthetic activation tensor to FP8 on the best
//! device available and print Transformer Engine's statistics of it.
//!
//! Device choice (`burn_te_suite::device`): CUDA (with `--features cuda` and a driver), else a wgpu GPU, else the
//! host path of burn-te-kernels (plain Rust, bit-identical), also where wgpu's only adapter is a CPU rasterizer
//! (lavapipe); `BURN_TE_DEVICE=cpu|wgpu|cuda` forces one.
//!
//! Run: `cargo run --example quantize_demo`

use burn_te_kernels::cubecl::prelude::*;
use burn_te_kernels::{Fp8Format, Fp8Stats, KernelError, host, ops, pow2_margin, scale_from_amax};
use burn_te_suite::device::ExampleDevice;

/// What one run computes, wherever it ran.
struct Report {
    amax: f32,
    scale: f32,
    stats: Fp8Stats,
    roundtrip: Vec<f32>,
}

/// Amax, TE's scale (margin 0, previous scale 1), quantize + dequantize and the FP8 statistics on a device.
fn run_on_device<R: Runtime>(
    client: &ComputeClient<R>,
    x: &[f32],
    format: Fp8Format,
) -> Result<Report, KernelError> {
    let input = client.create_from_slice(f32::as_bytes(x));
    let amax = ops::amax::<R, f32>(client, &input, x.len())?;
    let scales = ops::ScaleBuffers::new(client, 1, 1.0);
    ops::compute_scale(client, &amax, &scales, format, 0.0)?;
    let codes = ops::quantize::<R, f32>(client, &input, x.len(), &scales.scale, format, None)?;
    let roundtrip = ops::dequantize::<R, f32>(client, &codes, &scales.scale_inv)?;
    let stats = ops::fp8_tensor_stats::<R, f32>(client, &input, x.len(), format, &scales.scale)?
        .read_fp8(client)?;
    let bytes = client.read_one(roundtrip)?;
    Ok(Report {
        amax: ops::read_scalar(client, &amax)?,
        scale: ops::read_scalar(client, &scales.scale)?,
        stats,
        roundtrip: f32::from_bytes(&bytes)[..x.len()].to_vec(),
    })
}

/// The same on the host path.
fn run_on_host(x: &[f32], format: Fp8Format) -> Result<Report, KernelError> {
    let amax = host::amax(x);
    let scale = scale_from_amax(amax, 1.0, format, pow2_margin(0.0)?);
    let codes = host::quantize(x, scale, format);
    Ok(Report {
        amax,
        scale,
        stats: host::fp8_tensor_stats(x, format, scale),
        roundtrip: host::dequantize(&codes, 1.0 / scale, format),
    })
}

/// Runs both formats on the device `burn_te_suite::device` chooses; returns it, in words, and one report per format.
fn run(x: &[f32]) -> Result<(String, Vec<Report>), Box<dyn std::error::Error>> {
    let each = |f: &dyn Fn(Fp8Format) -> Result<Report, KernelError>| {
        Fp8Format::ALL
            .into_iter()
            .map(f)
            .collect::<Result<Vec<Report>, KernelError>>()
    };
    let choice = burn_te_suite::device::choose()?;
    let reports = match &choice.device {
        #[cfg(feature = "cuda")]
        ExampleDevice::Cuda(device) => {
            let client = burn_te_kernels::cubecl::cuda::CudaRuntime::client(device);
            each(&|format| run_on_device(&client, x, format))?
        }
        #[cfg(feature = "wgpu")]
        ExampleDevice::Wgpu(device) => {
            let client = burn_te_kernels::cubecl::wgpu::WgpuRuntime::client(device);
            each(&|format| run_on_device(&client, x, format))?
        }
        ExampleDevice::Host => each(&|format| run_on_host(x, format))?,
    };
    Ok((choice.to_string(), reports))
}

/// A [10, 32, 512] activation like seed 000's input: N(0, 1) with a few outliers and some tiny values.
fn synthetic_activation() -> Vec<f32> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..10 * 32 * 512)
        .map(|i| {
            let z = (-2.0 * uniform().max(1e-300).ln()).sqrt()
                * (2.0 * std::f64::consts::PI * uniform()).cos();
            match i % 4096 {
                0 => 60.0,
                1 => -1e-7,
                _ => z as f32,
            }
        })
        .collect()
}

/// Quantizes a synthetic activation tensor to FP8 on the best device available (CUDA, wgpu, else the host path)
/// and prints Transformer Engine's statistics of it.
#[derive(clap::Parser, Debug)]
#[command(version)]
struct Args {}

fn main() {
    burn_te_suite::show_warnings();
    <Args as clap::Parser>::parse();
    burn_te_suite::exit_on_error(try_main());
}

fn try_main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // wgpu's Vulkan loader complains without one; nothing else has started yet.
        let dir = std::env::temp_dir().join("burn-te-xdg-runtime");
        if std::fs::create_dir_all(&dir).is_ok() {
            unsafe { std::env::set_var("XDG_RUNTIME_DIR", dir) };
        }
    }
    let x = synthetic_activation();
    let (device, reports) = run(&x)?;
    for (format, report) in Fp8Format::ALL.into_iter().zip(reports) {
        let t = &report.stats.tensor;
        println!("== {format} on {device}: {} elements", x.len());
        println!(
            "   amax {:.4}  scale {:.6}  scale_inv {:.6e}",
            report.amax,
            report.scale,
            1.0 / report.scale
        );
        println!(
            "   min {:.4}  max {:.4}  mean {:.4}  std {:.4}  l1_norm {:.1}  l2_norm {:.2}  dynamic_range {:.2}",
            t.min().unwrap(),
            t.max().unwrap(),
            t.mean().unwrap(),
            t.std().unwrap(),
            t.l1_norm().unwrap(),
            t.l2_norm().unwrap(),
            t.dynamic_range().unwrap()
        );
        println!(
            "   underflows% {:.4}  overflows% {:.4}  mse {:.3e}",
            report.stats.underflows_percent().unwrap(),
            report.stats.overflows_percent().unwrap(),
            report.stats.mse().unwrap()
        );
        let worst = x
            .iter()
            .zip(&report.roundtrip)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        println!("   max |x - dequantize(quantize(x))| = {worst:.4e}");
    }
    Ok(())
}
