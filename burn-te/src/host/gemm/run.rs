//! One host FP8 GEMM on a given path.

use std::mem::MaybeUninit;

use burn_te_kernels::host::gemm::HostGemmPath;
use burn_te_kernels::host::gemm::amx::AmxBf16Kernel;
use burn_te_kernels::host::gemm::bf16::Avx512Bf16Kernel;
use burn_te_kernels::host::gemm::fma::Avx2FmaKernel;
use burn_te_kernels::host::gemm::fma512::Avx512FmaKernel;

use super::operand::HostOperand;
use super::{decoded, packed};

/// `out[b] = lhs[b] · rhs[b]` (`m × n` each, row-major, every value written, none read) on `path`; `Err` with the reason where a
/// packed path cannot take the operands exactly or the CPU lacks it (`out` is then to be overwritten by another
/// path).
pub(super) fn run_on(
    path: HostGemmPath,
    lhs: &HostOperand<'_>,
    rhs: &HostOperand<'_>,
    dims: (usize, usize, usize),
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
        out.fill(MaybeUninit::new(0.0));
        return Ok(());
    }
    match path {
        HostGemmPath::AmxBf16 => packed::gemm::<AmxBf16Kernel>(lhs, rhs, dims, out),
        HostGemmPath::Avx512Bf16 => packed::gemm::<Avx512Bf16Kernel>(lhs, rhs, dims, out),
        HostGemmPath::Avx512Fma => packed::gemm::<Avx512FmaKernel>(lhs, rhs, dims, out),
        HostGemmPath::Avx2Fma => packed::gemm::<Avx2FmaKernel>(lhs, rhs, dims, out),
        HostGemmPath::F32 => {
            decoded::gemm(lhs, rhs, dims, out);
            Ok(())
        }
    }
}
