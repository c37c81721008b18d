//! Which implementation runs a CubeCL device's FP8 GEMM. On CUDA, cuBLASLt's FP8 matmul on the tensor cores (the
//! library Transformer Engine calls) where it takes the operands exactly: E4M3/E5M2 with per-tensor scales, K a
//! multiple of 16. Elsewhere, and for what cuBLASLt does not take (block scales, NVFP4, odd shapes), the SIMT kernel
//! of `burn-te-kernels`.
//!
//! [`with_device_gemm_path`] forces a path on this thread, `BURN_TE_DEVICE_GEMM` (`auto`, `simt`, `cublaslt`; read
//! once) in the process. Each GEMM counts under `DeviceFp8Gemm(<path>)` in the metrics report; a GEMM that asked for
//! cuBLASLt and ran on the kernel is recorded as a fallback (`device GEMM path`) with the reason.

use std::cell::Cell;
use std::sync::OnceLock;

use burn_te_kernels::KernelError;
use burn_te_kernels::cubecl::prelude::*;
use burn_te_kernels::cubecl::server::Handle;
use burn_te_kernels::gemm::{GemmOperand, fp8_gemm_grouped};

use crate::error::TeError;
use crate::metrics;

/// The metrics report's counter prefix of device FP8 GEMMs by path (`DeviceFp8Gemm(cublaslt)`).
pub const DEVICE_FP8_GEMM: &str = "DeviceFp8Gemm";

/// The fallback reason of a GEMM that asked for cuBLASLt and ran on the SIMT kernel.
pub const DEVICE_GEMM_FALLBACK: &str = "device GEMM path";

/// An implementation of the device FP8 GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceGemmPath {
    /// burn-te's CubeCL kernel: f32 multiply-adds on the general cores, codes decoded while staging. Every runtime,
    /// every recipe.
    Simt,
    /// cuBLASLt's FP8 matmul on the tensor cores (CUDA, sm ≥ 89, `--features cuda`).
    CublasLt,
}

impl DeviceGemmPath {
    /// The name in the metrics report and in `BURN_TE_DEVICE_GEMM`.
    pub const fn name(self) -> &'static str {
        match self {
            DeviceGemmPath::Simt => "simt",
            DeviceGemmPath::CublasLt => "cublaslt",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        [DeviceGemmPath::Simt, DeviceGemmPath::CublasLt]
            .into_iter()
            .find(|path| path.name() == name)
    }
}

impl core::fmt::Display for DeviceGemmPath {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

thread_local! {
    static FORCED: Cell<Option<DeviceGemmPath>> = const { Cell::new(None) };
}

/// Runs `f` with this thread's device FP8 GEMMs asking for `path` (a test of a path, a comparison of two); back to
/// the default when `f` returns or panics. A path the device cannot take runs on the kernel, recorded as a fallback.
pub fn with_device_gemm_path<T>(path: DeviceGemmPath, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<DeviceGemmPath>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.with(|forced| forced.set(self.0));
        }
    }
    let _restore = Restore(FORCED.with(|forced| forced.replace(Some(path))));
    f()
}

/// `BURN_TE_DEVICE_GEMM`, read once: `None` for `auto` or unset; an unknown value is reported once and read as auto.
fn configured() -> Option<DeviceGemmPath> {
    static CONFIGURED: OnceLock<Option<DeviceGemmPath>> = OnceLock::new();
    *CONFIGURED.get_or_init(|| {
        let value = std::env::var("BURN_TE_DEVICE_GEMM").ok()?;
        match value.as_str() {
            "" | "auto" => None,
            name => DeviceGemmPath::from_name(name).or_else(|| {
                crate::fallback::record(
                    "BURN_TE_DEVICE_GEMM",
                    format!(
                        "BURN_TE_DEVICE_GEMM={name:?} is not a device GEMM path (auto, simt, cublaslt): using auto"
                    ),
                );
                None
            }),
        }
    })
}

/// Whether `R` is CubeCL's CUDA runtime (never without the `cuda` feature).
#[cfg_attr(not(feature = "cuda"), allow(clippy::extra_unused_type_parameters))]
fn is_cuda<R: Runtime>() -> bool {
    #[cfg(feature = "cuda")]
    {
        core::any::TypeId::of::<R>()
            == core::any::TypeId::of::<burn_te_kernels::cubecl::cuda::CudaRuntime>()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// The path this thread's device FP8 GEMMs on runtime `R` ask for: forced, configured, or the default (cuBLASLt on
/// CUDA, the kernel elsewhere).
pub fn requested_device_gemm_path<R: Runtime>() -> DeviceGemmPath {
    FORCED
        .with(Cell::get)
        .or_else(configured)
        .unwrap_or(if is_cuda::<R>() {
            DeviceGemmPath::CublasLt
        } else {
            DeviceGemmPath::Simt
        })
}

/// Each `(A, B)`'s `out[b] = dequant(A[b]) × dequant(B[b])` as `F` on this thread's path
/// ([`requested_device_gemm_path`]): on cuBLASLt one call each (a GEMM it cannot take recorded as a fallback), on the
/// SIMT kernel as few launches as the device allows (`burn_te_kernels::gemm::fp8_gemm_grouped`: a grouped linear
/// layer's experts together). Each GEMM is counted under the path that ran it, each launch under
/// `Fp8GemmLaunches`.
pub(crate) fn device_fp8_gemm_grouped<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    device: &R::Device,
    gemms: &[(GemmOperand<'_>, GemmOperand<'_>)],
) -> Result<Vec<Handle>, TeError> {
    let mut outputs: Vec<Option<Handle>> = vec![None; gemms.len()];
    if requested_device_gemm_path::<R>() == DeviceGemmPath::CublasLt {
        let results = match cublaslt::<R, F>(client, device, gemms) {
            Ok(results) => results,
            Err(refused) => gemms
                .iter()
                .map(|_| Err(Refused(refused.0.clone())))
                .collect(),
        };
        for (((a, _), output), result) in gemms.iter().zip(&mut outputs).zip(results) {
            match result {
                Ok(handle) => {
                    count_path(DeviceGemmPath::CublasLt);
                    metrics::count_launch(metrics::names::FP8_GEMM_LAUNCHES);
                    *output = Some(handle);
                }
                Err(Refused(reason)) => {
                    let (m, k) = (a.rows, a.cols);
                    crate::fallback::record(
                        DEVICE_GEMM_FALLBACK,
                        format!(
                            "device FP8 GEMM (lhs {m}x{k}): ran on the SIMT kernel, not on cuBLASLt: {reason}"
                        ),
                    );
                }
            }
        }
    }
    let simt: Vec<usize> = (0..gemms.len()).filter(|&i| outputs[i].is_none()).collect();
    if !simt.is_empty() {
        let operands: Vec<_> = simt.iter().map(|&i| gemms[i]).collect();
        let grouped = fp8_gemm_grouped::<R, F>(client, &operands)?;
        metrics::increment_counter(metrics::names::FP8_GEMM_LAUNCHES, grouped.launches as u64);
        for (&i, handle) in simt.iter().zip(grouped.outputs) {
            count_path(DeviceGemmPath::Simt);
            outputs[i] = Some(handle);
        }
    }
    Ok(outputs
        .into_iter()
        .map(|o| o.expect("every GEMM ran"))
        .collect())
}

fn count_path(path: DeviceGemmPath) {
    metrics::increment_counter(&format!("{DEVICE_FP8_GEMM}({path})"), 1);
}

/// Why cuBLASLt did not run a GEMM.
struct Refused(String);

impl From<KernelError> for Refused {
    fn from(error: KernelError) -> Self {
        Refused(error.to_string())
    }
}

/// Each GEMM on cuBLASLt (one wait on each side for the group), or why it cannot run there; the whole group refused
/// where cuBLASLt cannot run at all (not CUDA, built without it) or the library failed.
#[cfg(feature = "cuda")]
fn cublaslt<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    device: &R::Device,
    gemms: &[(GemmOperand<'_>, GemmOperand<'_>)],
) -> Result<Vec<Result<Handle, Refused>>, Refused> {
    use burn_te_kernels::cubecl::cuda::{CudaDevice, CudaRuntime};
    use burn_te_kernels::cublaslt;
    let (Some(cuda_client), Some(cuda_device)) = (
        (client as &dyn core::any::Any).downcast_ref::<ComputeClient<CudaRuntime>>(),
        (device as &dyn core::any::Any).downcast_ref::<CudaDevice>(),
    ) else {
        return Err(Refused(format!(
            "cuBLASLt runs on CUDA only, not on {}",
            R::name(client)
        )));
    };
    // Operands cuBLASLt cannot take come back as an error naming why (`cublaslt::unsupported`).
    Ok(
        cublaslt::fp8_gemm_grouped::<F>(cuda_client, cuda_device, gemms)?
            .into_iter()
            .map(|result| result.map_err(Refused::from))
            .collect(),
    )
}

#[cfg(not(feature = "cuda"))]
#[allow(clippy::extra_unused_type_parameters)]
fn cublaslt<R: Runtime, F: Float + CubeElement>(
    _client: &ComputeClient<R>,
    _device: &R::Device,
    _gemms: &[(GemmOperand<'_>, GemmOperand<'_>)],
) -> Result<Vec<Result<Handle, Refused>>, Refused> {
    Err(Refused("built without the `cuda` feature".into()))
}
