//! Which host FP8 GEMM runs, and the bf16 one: on a CPU with AVX512-BF16 the FP8 GEMM of the CPU backends (Flex,
//! NdArray) multiplies the FP8 values as bf16 on its dot-product units with f32 accumulation
//! ([`burn_te_kernels::host::bf16_gemm`]); elsewhere it decodes the operands to f32 for the backend's f32 GEMM.
//!
//! The bf16 operands are exact: per-tensor scales (DelayedScaling, Float8CurrentScaling) and NVFP4's global scales
//! are applied to the f32 output as one factor; power-of-two block scales (Float8BlockScaling, MXFP8) and NVFP4's
//! E4M3 block scales are folded into the elements. An operand that would not be exact (a block scale that is not a
//! power of two, or one outside bf16's normal range) runs on the f32 path, recorded as a fallback.
//!
//! The path: [`with_host_gemm_path`] on this thread, else `BURN_TE_HOST_GEMM` (`auto`, `avx512bf16`, `f32`; read
//! once), else the best this CPU has. A path the CPU lacks runs on f32, recorded as a fallback. Each GEMM counts
//! under `HostFp8Gemm(<path>)` in the metrics report.

use std::cell::Cell;
use std::sync::OnceLock;

use burn_te_kernels::host::bf16_gemm::{self, NotBf16, PackedLhs, PackedRhs};
use burn_te_kernels::{Fp8Format, ScaleBlock};

pub use burn_te_kernels::host::bf16_gemm::HostGemmPath;

use crate::metrics;
use crate::primitive::{ElementFormat, Nvfp4Scales};

/// The metrics report's counter prefix of host FP8 GEMMs by path (`HostFp8Gemm(avx512bf16)`).
pub const HOST_FP8_GEMM: &str = "HostFp8Gemm";

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

/// `BURN_TE_HOST_GEMM`, read once: `None` for `auto` or unset; an unknown value is reported once and read as auto.
fn configured() -> Option<HostGemmPath> {
    static CONFIGURED: OnceLock<Option<HostGemmPath>> = OnceLock::new();
    *CONFIGURED.get_or_init(|| {
        let value = std::env::var("BURN_TE_HOST_GEMM").ok()?;
        match value.as_str() {
            "" | "auto" => None,
            name => HostGemmPath::from_name(name).or_else(|| {
                crate::fallback::record(
                    "BURN_TE_HOST_GEMM",
                    format!(
                        "BURN_TE_HOST_GEMM={name:?} is not a host GEMM path (auto, avx512bf16, f32): using auto"
                    ),
                );
                None
            }),
        }
    })
}

/// The path this thread's host FP8 GEMMs are asked to take: forced, configured, or the best this CPU has.
pub fn requested_host_gemm_path() -> HostGemmPath {
    FORCED
        .with(Cell::get)
        .or_else(configured)
        .unwrap_or_else(bf16_gemm::best_path)
}

/// The path of this thread's next host FP8 GEMM: the requested one, or f32 where the CPU lacks it (recorded as a
/// fallback).
pub(crate) fn path_to_run() -> HostGemmPath {
    let requested = requested_host_gemm_path();
    if requested.available() {
        return requested;
    }
    crate::fallback::record(
        "host GEMM path unavailable",
        format!(
            "the host FP8 GEMM was asked to run on {} but this CPU lacks it: ran on f32",
            requested.name()
        ),
    );
    HostGemmPath::F32
}

/// One operand of a host FP8 GEMM, as the CPU backends hold it.
pub(crate) struct HostOperand<'a> {
    /// The codes, row-major, one per byte.
    pub codes: &'a [u8],
    /// Their format.
    pub format: ElementFormat,
    /// `None`: one scale; `Some`: one per block of the tensor viewed as `[leading dims folded, last dim]`.
    pub block: Option<ScaleBlock>,
    /// The `scale_inv` values (NVFP4: each block's dequantization factor).
    pub scale_inv: &'a [f32],
    /// NVFP4's E4M3 block scales and global amax.
    pub nvfp4: Option<&'a Nvfp4Scales>,
    /// `(batch, rows, cols)` of the stored matrices.
    pub dims: (usize, usize, usize),
    /// Whether the GEMM reads the stored matrix transposed.
    pub transposed: bool,
}

/// How an operand's stored elements become exact bf16 values: `value(code) · fold[slot]`, and the factor left for
/// the output.
struct Decoding<'a> {
    /// Each code's value.
    table: [f32; 256],
    /// One factor per block folded into the elements (`None`: nothing folded).
    fold: Option<(ScaleBlock, Folded<'a>)>,
    /// The factor applied to the output (per-tensor scale, NVFP4's global part).
    alpha: f64,
}

/// A block's folded factor: a power-of-two `scale_inv`, or an E4M3 block-scale code (NVFP4).
enum Folded<'a> {
    ScaleInv(&'a [f32]),
    E4m3(&'a [u8]),
}

impl<'a> Decoding<'a> {
    fn new(operand: &HostOperand<'a>) -> Result<Self, String> {
        let mut table = [0f32; 256];
        for (code, value) in table.iter_mut().enumerate() {
            *value = operand.format.decode(code as u8);
        }
        let (fold, alpha) = match (operand.block, operand.nvfp4) {
            (None, _) => (None, f64::from(operand.scale_inv[0])),
            (Some(block), Some(nvfp4)) => (
                Some((block, Folded::E4m3(&nvfp4.block_scales))),
                f64::from(nvfp4.global_amax) / 2688.0,
            ),
            (Some(block), None) => {
                if let Some(&s) = operand
                    .scale_inv
                    .iter()
                    .find(|s| s.to_bits() & 0x7f_ffff != 0 || !s.is_finite())
                {
                    return Err(format!("block scale_inv {s:e} is not a power of two"));
                }
                (Some((block, Folded::ScaleInv(operand.scale_inv))), 1.0)
            }
        };
        Ok(Self { table, fold, alpha })
    }

    /// The value of element `index` (row-major over the whole stored tensor with `cols` columns).
    #[inline(always)]
    fn value(&self, codes: &[u8], index: usize, cols: usize) -> f32 {
        let value = self.table[codes[index] as usize];
        match &self.fold {
            None => value,
            Some((block, Folded::ScaleInv(scales))) => value * scales[block.slot(index, cols)],
            Some((block, Folded::E4m3(scales))) => {
                value * Fp8Format::E4M3.decode(scales[block.slot(index, cols)])
            }
        }
    }
}

/// The element `(row, depth)` of batch `b`'s GEMM view of `operand` (lhs: `m × k`; rhs read as `k × n` with
/// `(depth, col)`): its index in the stored tensor.
#[inline(always)]
fn index(operand: &HostOperand<'_>, b: usize, i: usize, j: usize) -> usize {
    let (batch, rows, cols) = operand.dims;
    let base = if batch > 1 { b * rows * cols } else { 0 };
    if operand.transposed {
        base + j * cols + i
    } else {
        base + i * cols + j
    }
}

/// `out[b] = lhs[b] · rhs[b]` (`m × n` each, `batch` of them, row-major) on the bf16 path; `Err` with the reason
/// when an operand is not exact in bf16 (the caller runs the f32 path then).
pub(crate) fn bf16_gemm(
    lhs: &HostOperand<'_>,
    rhs: &HostOperand<'_>,
    (m, n, k): (usize, usize, usize),
    out: &mut [f32],
) -> Result<(), String> {
    let (lhs_decoding, rhs_decoding) = (Decoding::new(lhs)?, Decoding::new(rhs)?);
    let alpha = (lhs_decoding.alpha * rhs_decoding.alpha) as f32;
    let (lhs_cols, rhs_cols) = (lhs.dims.2, rhs.dims.2);
    let not_exact = |side: &str, err: NotBf16| format!("{side} operand: {err}");
    let pack_lhs = |b: usize| -> Result<PackedLhs, String> {
        bf16_gemm::pack_lhs(m, k, |r, d| {
            lhs_decoding.value(lhs.codes, index(lhs, b, r, d), lhs_cols)
        })
        .map_err(|err| not_exact("left", err))
    };
    let pack_rhs = |b: usize| -> Result<PackedRhs, String> {
        bf16_gemm::pack_rhs(k, n, |d, c| {
            rhs_decoding.value(rhs.codes, index(rhs, b, d, c), rhs_cols)
        })
        .map_err(|err| not_exact("right", err))
    };
    let (shared_lhs, shared_rhs) = (
        (lhs.dims.0 <= 1).then(|| pack_lhs(0)).transpose()?,
        (rhs.dims.0 <= 1).then(|| pack_rhs(0)).transpose()?,
    );
    for (b, dst) in out.chunks_mut((m * n).max(1)).enumerate() {
        let own_lhs = shared_lhs.is_none().then(|| pack_lhs(b)).transpose()?;
        let own_rhs = shared_rhs.is_none().then(|| pack_rhs(b)).transpose()?;
        let a = shared_lhs
            .as_ref()
            .or(own_lhs.as_ref())
            .expect("one of the two");
        let w = shared_rhs
            .as_ref()
            .or(own_rhs.as_ref())
            .expect("one of the two");
        bf16_gemm::gemm(a, w, alpha, dst)?;
    }
    Ok(())
}

/// Counts a host FP8 GEMM on `path` in the metrics report.
pub(crate) fn count(path: HostGemmPath) {
    metrics::increment_counter(&format!("{HOST_FP8_GEMM}({})", path.name()), 1);
}
