//! One host FP8 GEMM on a given path ([`run_on`]), with the f32 fallback ([`host_fp8_gemm_asking`]) and its count.

use std::mem::MaybeUninit;

use burn_te_kernels::host::gemm::HostGemmPath;
use burn_te_kernels::host::gemm::amx::AmxBf16Kernel;
use burn_te_kernels::host::gemm::bf16::Avx512Bf16Kernel;
use burn_te_kernels::host::gemm::fma::Avx2FmaKernel;
use burn_te_kernels::host::gemm::fma512::Avx512FmaKernel;

use super::operand::HostOperand;
use super::{decoded, packed};
use crate::metrics;

/// The metrics report's counter prefix of host FP8 GEMMs by path (`HostFp8Gemm(avx2fma)`).
pub const HOST_FP8_GEMM: &str = "HostFp8Gemm";

/// `out[b] = lhs[b] · rhs[b] (+ bias)` (`m × n` each, row-major, every value written, none read; `bias` one value
/// per column, checked by the caller) on `path`; `Err` with the reason where a packed path cannot take the operands exactly or the CPU
/// lacks it (`out` is then to be overwritten by another path). The packed paths add the bias in their epilogue,
/// the `f32` path after its GEMM.
pub(super) fn run_on(
    path: HostGemmPath,
    lhs: &HostOperand<'_>,
    rhs: &HostOperand<'_>,
    dims: (usize, usize, usize),
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) -> Result<(), String> {
    if !path.available() {
        return Err(format!("this CPU lacks the {path} path's instructions"));
    }
    let (m, n, k) = dims;
    if m * n == 0 {
        return Ok(());
    }
    if k == 0 {
        burn_te_kernels::host::gemm::fill_bias_rows(out, n, bias);
        return Ok(());
    }
    match path {
        HostGemmPath::AmxBf16 => packed::gemm::<AmxBf16Kernel>(lhs, rhs, dims, bias, out),
        HostGemmPath::Avx512Bf16 => packed::gemm::<Avx512Bf16Kernel>(lhs, rhs, dims, bias, out),
        HostGemmPath::Avx512Fma => packed::gemm::<Avx512FmaKernel>(lhs, rhs, dims, bias, out),
        HostGemmPath::Avx2Fma => packed::gemm::<Avx2FmaKernel>(lhs, rhs, dims, bias, out),
        HostGemmPath::F32 => {
            decoded::gemm(lhs, rhs, dims, out);
            // SAFETY: the f32 path writes every value.
            add_bias(unsafe { assume_init_mut(out) }, bias);
            Ok(())
        }
    }
}

/// Counts a host FP8 GEMM under its path (`HostFp8Gemm(<path>)`), on the thread that issued it.
pub(crate) fn count_path(path: HostGemmPath) {
    metrics::increment_counter(&format!("{HOST_FP8_GEMM}({path})"), 1);
}

/// A host FP8 GEMM on path `requested`, or on f32 where the CPU lacks it or it cannot take the operands exactly
/// (recorded as a fallback); not counted (the thread that issued it counts it, [`count_path`]). Returns the path
/// that ran.
pub(crate) fn host_fp8_gemm_asking(
    requested: HostGemmPath,
    lhs: &HostOperand<'_>,
    rhs: &HostOperand<'_>,
    dims: (usize, usize, usize),
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) -> HostGemmPath {
    match run_on(requested, lhs, rhs, dims, bias, out) {
        Ok(()) => requested,
        Err(reason) => {
            let (m, n, k) = dims;
            let kind = if requested.available() {
                "host GEMM path not exact"
            } else {
                "host GEMM path unavailable"
            };
            crate::fallback::record(
                kind,
                format!("host FP8 GEMM {m}x{n}x{k}: ran on f32, not on {requested}: {reason}"),
            );
            run_on(HostGemmPath::F32, lhs, rhs, dims, bias, out)
                .expect("the f32 path runs everywhere");
            HostGemmPath::F32
        }
    }
}

/// `bias` added to every row of `out` (rows of `bias.len()` values).
fn add_bias(out: &mut [f32], bias: Option<&[f32]>) {
    if let Some(bias) = bias.filter(|bias| !bias.is_empty()) {
        burn_te_kernels::host::fused::bias::add_bias_in_place(out, bias);
    }
}

/// `out` as initialized values.
///
/// # Safety
/// Every value of `out` is initialized.
unsafe fn assume_init_mut(out: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and every value is initialized (the caller's contract).
    unsafe { &mut *(std::ptr::from_mut(out) as *mut [f32]) }
}
