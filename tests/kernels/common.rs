//! Test support: the device under test, conformance files, random data and f64 references.

use std::path::PathBuf;
use std::sync::OnceLock;

use burn_te_kernels::cubecl::prelude::*;
use burn_te_kernels::cubecl::server::Handle;

/// The runtime the device tests run on: CUDA device 0 with `--features cuda`, else the default wgpu device.
#[cfg(feature = "cuda")]
mod runtime {
    pub use burn_te_kernels::cubecl::cuda::CudaRuntime as TestRuntime;
    pub fn device() -> burn_te_kernels::cubecl::cuda::CudaDevice {
        burn_te_kernels::cubecl::cuda::CudaDevice::new(0)
    }
    pub const MISSING: &str =
        "no CUDA device found: `--features cuda` runs the device tests on CUDA device 0";
}
#[cfg(not(feature = "cuda"))]
mod runtime {
    pub use burn_te_kernels::cubecl::wgpu::WgpuRuntime as TestRuntime;
    pub fn device() -> burn_te_kernels::cubecl::wgpu::WgpuDevice {
        burn_te_kernels::cubecl::wgpu::WgpuDevice::default()
    }
    pub const MISSING: &str = "no wgpu device found: these tests need a Vulkan (or Metal/DX12) device; on a \
                               CPU-only Linux machine install Mesa's lavapipe: `apt-get install -y mesa-vulkan-drivers`";
}
pub use runtime::TestRuntime;

/// The client of the device under test. Panics with instructions when there is none: device tests never skip.
pub fn client() -> ComputeClient<TestRuntime> {
    static CLIENT: OnceLock<ComputeClient<TestRuntime>> = OnceLock::new();
    CLIENT
        .get_or_init(|| {
            std::panic::catch_unwind(|| TestRuntime::client(&runtime::device()))
                .unwrap_or_else(|_| panic!("{}", runtime::MISSING))
        })
        .clone()
}

/// Uploads f32 values.
pub fn upload(values: &[f32]) -> Handle {
    client().create_from_slice(f32::as_bytes(values))
}

/// Reads `len` f32 values back.
pub fn download(handle: &Handle, len: usize) -> Vec<f32> {
    let bytes = client().read_one(handle.clone()).expect("read back");
    f32::from_bytes(&bytes)[..len].to_vec()
}

/// Reads `len` u32 words back.
pub fn download_words(handle: &Handle, len: usize) -> Vec<u32> {
    let bytes = client().read_one(handle.clone()).expect("read back");
    u32::from_bytes(&bytes)[..len].to_vec()
}

/// Path of a conformance file (a verbatim copy of `shared/conformance/fp8` kept in the repository).
pub fn conformance_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/fp8")
        .join(name)
}

/// The data lines of a TSV conformance file, split on tabs.
pub fn tsv_rows(name: &str) -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(conformance_file(name)).expect("conformance file");
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split('\t').map(|s| s.trim().to_string()).collect())
        .collect()
}

/// Parses hex f32 bits, or `nan`.
pub fn f32_from_hex(s: &str) -> f32 {
    if s == "nan" {
        f32::NAN
    } else {
        f32::from_bits(u32::from_str_radix(s, 16).expect("hex bits"))
    }
}

/// Deterministic random numbers (SplitMix64), so failures reproduce.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Normal(mean, std) values as f32 (Box-Muller).
    pub fn normal(&mut self, len: usize, mean: f64, std: f64) -> Vec<f32> {
        (0..len)
            .map(|_| {
                let (u1, u2) = (self.uniform().max(1e-300), self.uniform());
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                (mean + std * z) as f32
            })
            .collect()
    }
}

/// Statistics computed independently in f64 with the textbook two-pass formulas over all elements.
#[derive(Debug)]
pub struct Reference {
    pub min: f64,
    pub max: f64,
    pub sum: f64,
    pub mean: f64,
    pub std: f64,
    pub l1: f64,
    pub l2: f64,
    pub amax: f64,
    pub dynamic_range: f64,
    pub nonzero: u64,
}

pub fn reference_stats(xs: &[f32]) -> Reference {
    let v: Vec<f64> = xs.iter().map(|&x| x as f64).collect();
    let n = v.len() as f64;
    let has_nan = v.iter().any(|x| x.is_nan());
    let pick = |f: fn(f64, f64) -> f64, init: f64| {
        if has_nan {
            f64::NAN
        } else {
            v.iter().copied().fold(init, f)
        }
    };
    let sum: f64 = v.iter().sum();
    let mean = sum / n;
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
    let nonzero_abs: Vec<f64> = v.iter().map(|x| x.abs()).filter(|&a| a != 0.0).collect();
    let amax = pick(|a, x| a.max(x.abs()), 0.0);
    let dynamic_range = if has_nan {
        f64::NAN
    } else if nonzero_abs.is_empty() {
        0.0
    } else {
        let hi = nonzero_abs.iter().copied().fold(0.0, f64::max);
        let lo = nonzero_abs.iter().copied().fold(f64::INFINITY, f64::min);
        hi.log2() - lo.log2()
    };
    Reference {
        min: pick(f64::min, f64::INFINITY),
        max: pick(f64::max, f64::NEG_INFINITY),
        sum,
        mean,
        std: if v.len() < 2 || v.iter().any(|x| !x.is_finite()) {
            f64::NAN
        } else {
            var.sqrt()
        },
        l1: v.iter().map(|x| x.abs()).sum(),
        l2: v.iter().map(|x| x * x).sum::<f64>().sqrt(),
        amax,
        dynamic_range,
        nonzero: v.iter().filter(|&&x| x != 0.0).count() as u64,
    }
}

/// `actual` equals `expected` within `rel` relative error (`abs_floor` absolute below it); NaN equals NaN,
/// infinities must match exactly.
pub fn assert_close(what: &str, actual: f64, expected: f64, rel: f64, abs_floor: f64) {
    if expected.is_nan() {
        assert!(actual.is_nan(), "{what}: expected NaN, got {actual}");
        return;
    }
    if expected.is_infinite() {
        assert_eq!(actual, expected, "{what}");
        return;
    }
    let tolerance = (rel * expected.abs()).max(abs_floor);
    assert!(
        (actual - expected).abs() <= tolerance,
        "{what}: got {actual}, expected {expected} (|diff| {} > {tolerance})",
        (actual - expected).abs()
    );
}

/// Runs `body` in a child process of this test binary that runs only `test`: for what is process-global in Burn, the
/// backend seed (Flex keeps one generator; a test that replays the draws after `B::seed` must not share its process
/// with tests that draw at the same time) and a device's float type (fixed at its first tensor).
pub fn alone(test: &str, body: impl FnOnce()) {
    alone_with(test, &[], body)
}

/// As [`alone`], the child process with the environment variables `vars` set (a setting read once per process).
pub fn alone_with(test: &str, vars: &[(&str, &str)], body: impl FnOnce()) {
    const CHILD: &str = "BURN_TE_TEST_ALONE";
    if std::env::var_os(CHILD).is_some() {
        return body();
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let output = std::process::Command::new(exe)
        .args([test, "--exact", "--test-threads=1", "--nocapture"])
        .envs(vars.iter().copied())
        .env(CHILD, "1")
        .output()
        .expect("the test binary runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "{test} in its own process:\n{stdout}\n{stderr}"
    );
}

/// The command of example `name`, as cargo built it beside the tests (`target/<profile>/examples/<name>`).
pub fn example(name: &str) -> std::process::Command {
    let dir = std::env::current_exe()
        .expect("the test binary's path")
        .parent()
        .and_then(std::path::Path::parent)
        .map(|target| target.join("examples"))
        .expect("target/<profile>/examples");
    std::process::Command::new(dir.join(name))
}
