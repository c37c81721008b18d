//! Which path a host FP8 GEMM takes: [`with_host_gemm_path`] on this thread, else `BURN_TE_HOST_GEMM` (`auto`,
//! `amxbf16`, `avx512bf16`, `avx512fma`, `avx2fma`, `f32`; read once), else the path the autotune keeps for the
//! GEMM's shape class ([`super::tune`]; the [`probe`]'s choice for small GEMMs). A path the CPU lacks, or a packed
//! path that cannot take the operands exactly, runs on `f32`, recorded as a fallback. Each GEMM counts under
//! `HostFp8Gemm(<path>)` in the metrics report, each tuned class under `HostFp8GemmTunings`, and the probe's times
//! under `HostGemmProbe(<path>)` (`HostGemmProbeCached(<path>)` where the cache on disk gave them).

use std::cell::Cell;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

use burn_te_kernels::host::gemm::HostGemmPath;

use crate::settings::setting::Setting;

use super::operand::HostOperand;
use super::probe::probe;
use super::run::{count_path, host_fp8_gemm_asking};
use super::tune::{host_gemm_tunings, run_tuned};

thread_local! {
    static FORCED: Cell<Option<HostGemmPath>> = const { Cell::new(None) };
}

/// Runs `f` with this thread's host FP8 GEMMs on `path` (a test of a path, a comparison of two); back to the
/// default when `f` returns or panics. A path this CPU lacks runs on f32, recorded as a fallback.
pub fn with_host_gemm_path<T>(path: HostGemmPath, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<HostGemmPath>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.with(|forced| forced.set(self.0));
        }
    }
    let _restore = Restore(FORCED.with(|forced| forced.replace(Some(path))));
    f()
}

/// `BURN_TE_HOST_GEMM`: `auto` (or empty) for `None`, else a path's name.
pub const HOST_GEMM: Setting<Option<HostGemmPath>> = Setting {
    name: "BURN_TE_HOST_GEMM",
    takes: "auto, amxbf16, avx512bf16, avx512fma, avx2fma, f32",
    otherwise: "auto",
    parse: |value| match value {
        "" | "auto" => Some(None),
        name => HostGemmPath::from_name(name).map(Some),
    },
};

/// `BURN_TE_HOST_GEMM`, read once: `None` for `auto` or unset; an unknown value is reported once and read as auto.
fn configured() -> Option<HostGemmPath> {
    static CONFIGURED: OnceLock<Option<HostGemmPath>> = OnceLock::new();
    *CONFIGURED.get_or_init(|| HOST_GEMM.read().flatten())
}

/// The path this thread forces ([`with_host_gemm_path`]) or `BURN_TE_HOST_GEMM` names; `None`: auto.
pub(super) fn forced_host_gemm_path() -> Option<HostGemmPath> {
    FORCED.with(Cell::get).or_else(configured)
}

/// The path this thread's host FP8 GEMMs are asked to take where no shape decides: forced, configured, or the
/// probe's choice (the path of GEMMs too small to tune; larger ones take their class's tuned path).
pub fn requested_host_gemm_path() -> HostGemmPath {
    forced_host_gemm_path().unwrap_or_else(|| probe().chosen)
}

/// What decides this thread's host FP8 GEMMs' paths, for a run's summary: the forced path, or each tuned shape
/// class (as `HostGemmTuning` displays it) and the probe's path for the rest.
pub fn host_gemm_choices() -> String {
    if let Some(path) = forced_host_gemm_path() {
        return format!(
            "every host FP8 GEMM on `{path}` (forced: BURN_TE_HOST_GEMM or with_host_gemm_path)"
        );
    }
    let probed = probe().chosen;
    let tuned: Vec<String> = host_gemm_tunings()
        .iter()
        .map(|tuning| format!("\n  tuned {tuning}"))
        .collect();
    if tuned.is_empty() {
        return format!(
            "host FP8 GEMMs on `{probed}` (the probe's choice: no GEMM large enough to tune its shape)"
        );
    }
    format!(
        "host FP8 GEMM paths by shape class:{}\n  smaller GEMMs and a grouped layer's experts on `{probed}` (the probe's)",
        tuned.concat()
    )
}

/// `out[b] = lhs[b] · rhs[b] (+ bias)` (every value of `out` written; `bias` one value per column) on the forced
/// path, or (auto) the path tuned for its shape class; on f32 where that path is missing or cannot take the
/// operands exactly (recorded as a fallback); counted under its path. Returns the path that ran.
pub(crate) fn host_fp8_gemm(
    lhs: &HostOperand<'_>,
    rhs: &HostOperand<'_>,
    dims: (usize, usize, usize),
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) -> HostGemmPath {
    let path = host_fp8_gemm_forced_or_tuned(forced_host_gemm_path(), lhs, rhs, dims, bias, out);
    count_path(path);
    path
}

/// [`host_fp8_gemm`] with the forced path read by the caller (`forced`, on the thread that issued the GEMM: a GEMM
/// run on a worker thread takes the issuing thread's), not counted (the issuing thread counts it).
pub(super) fn host_fp8_gemm_forced_or_tuned(
    forced: Option<HostGemmPath>,
    lhs: &HostOperand<'_>,
    rhs: &HostOperand<'_>,
    dims: (usize, usize, usize),
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) -> HostGemmPath {
    match forced {
        Some(path) => host_fp8_gemm_asking(path, lhs, rhs, dims, bias, out),
        None => run_tuned(lhs, rhs, dims, bias, out),
    }
}
