//! Several host FP8 GEMMs issued together (a grouped linear layer's experts). Each GEMM runs as
//! [`host_fp8_gemm`](super::host_fp8_gemm) runs it alone (the issuing thread's path, its own split across threads
//! when large, its fallback; counted on the issuing thread), so each result is the same bit for bit. What changes is
//! the scheduling: GEMMs too small to split (most of a mixture-of-experts layer's, a few rows per expert) run side
//! by side in one parallel region on rayon's pool instead of one after another on one thread.

use rayon::prelude::*;

use super::choice::{forced_host_gemm_path, host_fp8_gemm_forced_or_tuned};
use super::decoded::PARALLEL_GEMM;
use super::operand::HostOperand;
use super::run::count_path;

/// One GEMM of [`host_fp8_gemm_grouped`]: its operands, `(m, n, k)`, and its output (`batch · m · n` values).
pub(crate) struct GroupedHostGemm<'a> {
    pub lhs: HostOperand<'a>,
    pub rhs: HostOperand<'a>,
    pub dims: (usize, usize, usize),
    pub out: burn_te_kernels::host::pool::HostOutput,
}

/// Runs every GEMM of `gemms` into its `out` on the path this thread forces or, unforced, the path tuned for its
/// shape class (the probe's for the small ones, [`super::tune`]): those large enough to split across
/// the threads one after another (two at once would contend for the same threads and caches), then the small ones
/// side by side in one parallel region.
pub(crate) fn host_fp8_gemm_grouped(gemms: &mut [GroupedHostGemm<'_>]) {
    let forced = forced_host_gemm_path();
    let run = |gemm: &mut GroupedHostGemm<'_>| {
        host_fp8_gemm_forced_or_tuned(forced, &gemm.lhs, &gemm.rhs, gemm.dims, None, &mut gemm.out)
    };
    let (mut large, mut small): (Vec<_>, Vec<_>) = gemms
        .iter_mut()
        .partition(|gemm| gemm.dims.0 * gemm.dims.1 * gemm.dims.2 >= PARALLEL_GEMM);
    let mut paths: Vec<_> = large.iter_mut().map(|gemm| run(gemm)).collect();
    paths.extend(
        small
            .par_iter_mut()
            .map(|gemm| run(gemm))
            .collect::<Vec<_>>(),
    );
    paths.into_iter().for_each(count_path);
}
