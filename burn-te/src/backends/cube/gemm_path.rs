//! Which implementation runs a CubeCL device's FP8 GEMM. On CUDA, cuBLASLt's FP8 matmul on the tensor cores (the
//! library Transformer Engine calls) where it takes the operands exactly: E4M3/E5M2 with per-tensor scales, K a
//! multiple of 16. Elsewhere, and for what cuBLASLt does not take, the autotune ([`super::gemm_tune`]) picks per
//! device and shape between the SIMT kernel of `burn-te-kernels`, cubek-matmul's tiled routines with the codes
//! decoded on load (`burn_te_kernels::gemm::cubek`: rows of whole code words) and Burn's own matmul on codes decoded
//! ahead into f16, or bf16 with block scales ([`super::gemm_decoded`]: FP8 codes).
//!
//! [`with_device_gemm_path`] forces a path on this thread, `BURN_TE_DEVICE_GEMM` (`auto`, `simt`, `tiled`,
//! `decoded`, `cublaslt`; read once) in the process. [`with_cublaslt_stream`] and `BURN_TE_CUBLASLT_STREAM` (`own`, `cubecl`)
//! choose the stream cuBLASLt runs on ([`CublasLtStream`]). Each GEMM counts under `DeviceFp8Gemm(<path>)` in the metrics report; a GEMM
//! that asked for cuBLASLt, the tiled or the decoded path and ran on the kernel is recorded as a fallback (`device GEMM
//! path`) with the reason.

use std::cell::Cell;
use std::sync::OnceLock;

use burn_cubecl::CubeRuntime;
use burn_te_kernels::KernelError;
use burn_te_kernels::cubecl::prelude::*;
use burn_te_kernels::cubecl::server::Handle;
use burn_te_kernels::gemm::cubek::{CubekRoutine, cubek_refusal};
use burn_te_kernels::gemm::{GemmOperand, fp8_gemm_grouped};

use super::gemm_decoded;
use super::gemm_tune::{self, GemmKernel};

use crate::error::TeError;
use crate::metrics;
use crate::settings::setting::Setting;

/// The metrics report's counter prefix of device FP8 GEMMs by path (`DeviceFp8Gemm(cublaslt)`).
pub const DEVICE_FP8_GEMM: &str = "DeviceFp8Gemm";

/// The fallback reason of a GEMM that asked for cuBLASLt and ran on the SIMT kernel.
pub const DEVICE_GEMM_FALLBACK: &str = "device GEMM path";

/// The fallback reason of cuBLASLt GEMMs asked to run on CubeCL's stream that ran on the library's own.
pub const CUBLASLT_STREAM_FALLBACK: &str = "cuBLASLt stream";

/// An implementation of the device FP8 GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceGemmPath {
    /// burn-te's CubeCL kernel: f32 multiply-adds on the general cores, codes decoded while staging. Every runtime,
    /// every recipe.
    Simt,
    /// cubek-matmul's tiled matmul (Burn's own) with the codes decoded on load: cooperative matrices on f16 stages
    /// where the device has them (per-tensor FP8), the unit routines on f32 stages elsewhere (every recipe); stored
    /// rows of whole code words.
    Tiled,
    /// Burn's own matmul, as its autotune picks for the shape and device, on the codes decoded ahead into f16, or
    /// bf16 times their block scales (f32 where the device lacks the type), accumulating in f32. Every recipe
    /// (NVFP4 as f16 codes times their E4M3 block scales, its global factors on the product).
    Decoded,
    /// cuBLASLt's FP8 matmul on the tensor cores (CUDA, sm ≥ 89, `--features cuda`).
    CublasLt,
}

impl DeviceGemmPath {
    /// The name in the metrics report and in `BURN_TE_DEVICE_GEMM`.
    pub const fn name(self) -> &'static str {
        match self {
            DeviceGemmPath::Simt => "simt",
            DeviceGemmPath::Tiled => "tiled",
            DeviceGemmPath::Decoded => "decoded",
            DeviceGemmPath::CublasLt => "cublaslt",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        [
            DeviceGemmPath::Simt,
            DeviceGemmPath::Tiled,
            DeviceGemmPath::Decoded,
            DeviceGemmPath::CublasLt,
        ]
        .into_iter()
        .find(|path| path.name() == name)
    }
}

impl core::fmt::Display for DeviceGemmPath {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

/// The CUDA stream cuBLASLt's FP8 GEMMs run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CublasLtStream {
    /// The library's own stream: the host waits for CubeCL's queue before each call, or group of calls, and for
    /// the library's stream after it.
    Own,
    /// CubeCL's stream of the calling thread (the default): each call goes through CubeCL's launch queue as a host
    /// task of the vendored cubecl-cuda, enqueued in order with CubeCL's kernels, and nothing waits. On an H200 the
    /// FP8 TransformerLayer step takes 0.57–0.63× the own stream's time, with the same losses (tests
    /// `device_gemm::*`).
    CubeCl,
}

impl CublasLtStream {
    /// The name in `BURN_TE_CUBLASLT_STREAM`.
    pub const fn name(self) -> &'static str {
        match self {
            CublasLtStream::Own => "own",
            CublasLtStream::CubeCl => "cubecl",
        }
    }
}

thread_local! {
    static FORCED: Cell<Option<DeviceGemmPath>> = const { Cell::new(None) };
    static FORCED_STREAM: Cell<Option<CublasLtStream>> = const { Cell::new(None) };
    static FORCED_ROUTINE: Cell<Option<CubekRoutine>> = const { Cell::new(None) };
}

/// Runs `f` with this thread's `setting` at `value`; the previous value back when `f` returns or panics.
fn with_setting<S: Copy + 'static, T>(
    setting: &'static std::thread::LocalKey<Cell<Option<S>>>,
    value: S,
    f: impl FnOnce() -> T,
) -> T {
    struct Restore<S: Copy + 'static>(&'static std::thread::LocalKey<Cell<Option<S>>>, Option<S>);
    impl<S: Copy + 'static> Drop for Restore<S> {
        fn drop(&mut self) {
            self.0.with(|cell| cell.set(self.1));
        }
    }
    let _restore = Restore(setting, setting.with(|cell| cell.replace(Some(value))));
    f()
}

/// Runs `f` with this thread's cuBLASLt GEMMs on `stream`; back to the default when `f` returns or panics.
pub fn with_cublaslt_stream<T>(stream: CublasLtStream, f: impl FnOnce() -> T) -> T {
    with_setting(&FORCED_STREAM, stream, f)
}

/// The stream this thread's cuBLASLt GEMMs run on: forced, `BURN_TE_CUBLASLT_STREAM` (read once; an unknown value
/// is reported once and read as `cubecl`), or [`CublasLtStream::CubeCl`].
pub fn cublaslt_stream() -> CublasLtStream {
    static CONFIGURED: OnceLock<CublasLtStream> = OnceLock::new();
    FORCED_STREAM.with(Cell::get).unwrap_or_else(|| {
        *CONFIGURED.get_or_init(|| CUBLASLT_STREAM.read().unwrap_or(CublasLtStream::CubeCl))
    })
}

/// Runs `f` with this thread's tiled GEMMs (those forced onto [`DeviceGemmPath::Tiled`]) on cubek's `routine`
/// (a test or a bench of one routine); back to the default (cooperative matrices where the device has them, else
/// the first unit routine that takes the GEMM) when `f` returns or panics. A GEMM the routine cannot take, or a
/// device without the routine's matrix units, runs on the SIMT kernel, recorded as a fallback with the reason.
pub fn with_tiled_routine<T>(routine: CubekRoutine, f: impl FnOnce() -> T) -> T {
    with_setting(&FORCED_ROUTINE, routine, f)
}

/// Runs `f` with this thread's device FP8 GEMMs asking for `path` (a test of a path, a comparison of two); back to
/// the default when `f` returns or panics. A path the device cannot take runs on the kernel, recorded as a fallback.
pub fn with_device_gemm_path<T>(path: DeviceGemmPath, f: impl FnOnce() -> T) -> T {
    with_setting(&FORCED, path, f)
}

/// `BURN_TE_DEVICE_GEMM`: `auto` (or empty) for `None`, else a path's name.
pub const DEVICE_GEMM: Setting<Option<DeviceGemmPath>> = Setting {
    name: "BURN_TE_DEVICE_GEMM",
    takes: "auto, simt, tiled, decoded, cublaslt",
    otherwise: "auto",
    parse: |value| match value {
        "" | "auto" => Some(None),
        name => DeviceGemmPath::from_name(name).map(Some),
    },
};

/// `BURN_TE_CUBLASLT_STREAM`: the stream cuBLASLt's GEMMs run on.
pub const CUBLASLT_STREAM: Setting<CublasLtStream> = Setting {
    name: "BURN_TE_CUBLASLT_STREAM",
    takes: "cubecl, own",
    otherwise: "cubecl",
    parse: |value| match value {
        "" | "cubecl" => Some(CublasLtStream::CubeCl),
        "own" => Some(CublasLtStream::Own),
        _ => None,
    },
};

/// `BURN_TE_DEVICE_GEMM`, read once: `None` for `auto` or unset; an unknown value is reported once and read as auto.
fn configured() -> Option<DeviceGemmPath> {
    static CONFIGURED: OnceLock<Option<DeviceGemmPath>> = OnceLock::new();
    *CONFIGURED.get_or_init(|| DEVICE_GEMM.read().flatten())
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
/// CUDA); `None`: the autotune's choice.
pub fn requested_device_gemm_path<R: Runtime>() -> Option<DeviceGemmPath> {
    FORCED
        .with(Cell::get)
        .or_else(configured)
        .or(is_cuda::<R>().then_some(DeviceGemmPath::CublasLt))
}

/// Each `(A, B)`'s `out[b] = dequant(A[b]) × dequant(B[b])` as `F` on this thread's path
/// ([`requested_device_gemm_path`]): on cuBLASLt one call each, on the tiled path one launch each (a GEMM either
/// cannot take recorded as a fallback), unforced on the autotune's choice; the GEMMs on the SIMT kernel in as few
/// launches as the device allows (`burn_te_kernels::gemm::fp8_gemm_grouped`: a grouped linear layer's experts
/// together). Each GEMM is counted under the path that ran it, each launch under `Fp8GemmLaunches`.
pub(crate) fn device_fp8_gemm_grouped<R: CubeRuntime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    device: &R::Device,
    gemms: &[(GemmOperand<'_>, GemmOperand<'_>)],
) -> Result<Vec<Handle>, TeError> {
    let mut outputs: Vec<Option<Handle>> = vec![None; gemms.len()];
    let request = requested_device_gemm_path::<R>();
    if request == Some(DeviceGemmPath::CublasLt) {
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
                Err(Refused(reason)) => record_refusal(a, DeviceGemmPath::CublasLt, &reason),
            }
        }
    }
    // The rest: forced onto the kernel or the tiled path, or the autotune's choice (cuBLASLt's refusals too).
    let mut simt = Vec::new();
    for (i, (a, b)) in gemms.iter().enumerate() {
        if outputs[i].is_some() {
            continue;
        }
        let kernel = match request {
            Some(DeviceGemmPath::Simt) => GemmKernel::Simt,
            Some(DeviceGemmPath::Tiled) => match forced_tiled(client, a, b) {
                Ok(kernel) => kernel,
                Err(Refused(reason)) => {
                    record_refusal(a, DeviceGemmPath::Tiled, &reason);
                    GemmKernel::Simt
                }
            },
            Some(DeviceGemmPath::Decoded) => match gemm_decoded::refusal(a, b) {
                None => GemmKernel::Decoded,
                Some(reason) => {
                    record_refusal(a, DeviceGemmPath::Decoded, &reason);
                    GemmKernel::Simt
                }
            },
            None | Some(DeviceGemmPath::CublasLt) => {
                gemm_tune::tuned_kernel::<R, F>(client, device, a, b)?
            }
        };
        match kernel {
            GemmKernel::Simt => simt.push(i),
            GemmKernel::Tiled(_) | GemmKernel::Decoded => {
                let handle = gemm_tune::run_kernel::<R, F>(client, device, a, b, kernel)?;
                count_path(match kernel {
                    GemmKernel::Decoded => DeviceGemmPath::Decoded,
                    _ => DeviceGemmPath::Tiled,
                });
                metrics::count_launch(metrics::names::FP8_GEMM_LAUNCHES);
                outputs[i] = Some(handle);
            }
        }
    }
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

/// The routine a forced tiled GEMM runs on: the one [`with_tiled_routine`] names, else cooperative matrices where the
/// device has them and they take the operands, else the first unit routine that takes them; refused (with the
/// reason) where none does.
fn forced_tiled<R: Runtime>(
    client: &ComputeClient<R>,
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
) -> Result<GemmKernel, Refused> {
    if let Some(routine) = FORCED_ROUTINE.with(Cell::get) {
        return match cubek_refusal(a, b, routine).or_else(|| routine.missing_units(client)) {
            None => Ok(GemmKernel::Tiled(routine)),
            Some(reason) => Err(Refused(format!("{}: {reason}", routine.name()))),
        };
    }
    let routines = [
        CubekRoutine::SIMPLE_CMMA,
        CubekRoutine::SimpleUnit,
        CubekRoutine::DoubleUnit,
    ];
    routines
        .into_iter()
        .filter(|&routine| routine.missing_units(client).is_none())
        .find(|&routine| cubek_refusal(a, b, routine).is_none())
        .map(GemmKernel::Tiled)
        .ok_or_else(|| Refused(cubek_refusal(a, b, CubekRoutine::SimpleUnit).unwrap_or_default()))
}

/// Records a GEMM that asked for `path` and runs on the SIMT kernel.
fn record_refusal(a: &GemmOperand<'_>, path: DeviceGemmPath, reason: &str) {
    let (m, k) = (a.rows, a.cols);
    crate::fallback::record(
        DEVICE_GEMM_FALLBACK,
        format!("device FP8 GEMM (lhs {m}x{k}): ran on the SIMT kernel, not on {path}: {reason}"),
    );
}

fn count_path(path: DeviceGemmPath) {
    metrics::increment_counter(&format!("{DEVICE_FP8_GEMM}({path})"), 1);
}

/// Why cuBLASLt or the tiled path did not run a GEMM.
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
    use burn_te_kernels::gemm::cublaslt;
    let (Some(cuda_client), Some(cuda_device)) = (
        (client as &dyn core::any::Any).downcast_ref::<ComputeClient<CudaRuntime>>(),
        (device as &dyn core::any::Any).downcast_ref::<CudaDevice>(),
    ) else {
        return Err(Refused(format!(
            "cuBLASLt runs on CUDA only, not on {}",
            R::name(client)
        )));
    };
    let asked = cublaslt_stream();
    // Operands cuBLASLt cannot take come back as an error naming why (`cublaslt::unsupported`).
    let (outputs, ran_on) = cublaslt::fp8_gemm_grouped::<F>(
        cuda_client,
        cuda_device,
        gemms,
        match asked {
            CublasLtStream::Own => cublaslt::LtStream::Own,
            CublasLtStream::CubeCl => cublaslt::LtStream::CubeCl,
        },
    )?;
    if asked == CublasLtStream::CubeCl && ran_on == cublaslt::LtStream::Own {
        crate::fallback::record(
            CUBLASLT_STREAM_FALLBACK,
            "an operand comes from another thread's CubeCL stream: cuBLASLt ran on its own stream, with host waits"
                .to_string(),
        );
    }
    Ok(outputs
        .into_iter()
        .map(|result| result.map_err(Refused::from))
        .collect())
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
