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

use burn_te_kernels::host::bf16_gemm::{self, Elements, Source, exact_bf16};
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

/// How an operand's stored elements become exact bf16 values: `value(code) · fold[block]`, and the factor left for
/// the output.
struct Decoding<'a> {
    /// Each code's value.
    table: [f32; 256],
    /// Each code's bf16 bits (nothing folded).
    bits: [u16; 256],
    /// One factor per block folded into the elements (`None`: nothing folded): a power-of-two `scale_inv`, or the
    /// value of NVFP4's E4M3 block-scale code.
    fold: Option<(ScaleBlock, Vec<f32>)>,
    /// The factor applied to the output (the per-tensor scale, NVFP4's global part).
    alpha: f64,
    codes: &'a [u8],
}

impl<'a> Decoding<'a> {
    /// The decoding of `operand`, or why it is not exact in bf16.
    fn new(operand: &HostOperand<'a>) -> Result<Self, String> {
        let mut table = [0f32; 256];
        let mut bits = [0u16; 256];
        for code in 0..=255u8 {
            let value = operand.format.decode(code);
            table[code as usize] = value;
            bits[code as usize] = exact_bf16(value).ok_or_else(|| {
                format!(
                    "the {} value {value:e} is not a bf16 value",
                    operand.format.name()
                )
            })?;
        }
        let (fold, alpha) = match (operand.block, operand.nvfp4) {
            (None, _) => (None, f64::from(operand.scale_inv[0])),
            // E2M1 × E4M3: at most 5 significant bits, exponents far inside bf16's (tested for every pair).
            (Some(block), Some(nvfp4)) => (
                Some((
                    block,
                    nvfp4
                        .block_scales
                        .iter()
                        .map(|&code| Fp8Format::E4M3.decode(code))
                        .collect(),
                )),
                f64::from(nvfp4.global_amax) / 2688.0,
            ),
            (Some(block), None) => {
                let finite = table.iter().filter(|v| v.is_finite()).map(|v| v.abs());
                let smallest = finite
                    .clone()
                    .filter(|&v| v > 0.0)
                    .fold(f32::INFINITY, f32::min);
                let largest = finite.fold(0.0, f32::max);
                for &scale in operand.scale_inv {
                    let power_of_two =
                        scale.is_finite() && scale > 0.0 && scale.to_bits() & 0x7f_ffff == 0;
                    if !power_of_two
                        || exact_bf16(smallest * scale).is_none()
                        || !(largest * scale).is_finite()
                    {
                        return Err(format!(
                            "block scale_inv {scale:e} is not a power of two that keeps every {} value a bf16 \
                             normal number",
                            operand.format.name()
                        ));
                    }
                }
                (Some((block, operand.scale_inv.to_vec())), 1.0)
            }
        };
        Ok(Self {
            table,
            bits,
            fold,
            alpha,
            codes: operand.codes,
        })
    }

    /// The stored tensor's elements as bf16 bits: the codes through a table when nothing is folded, else decoded
    /// (row-major, `cols` columns), exact by [`Decoding::new`]'s checks.
    fn bits(&self, cols: usize) -> Bits<'_> {
        use rayon::prelude::*;
        let Some((block, factors)) = &self.fold else {
            return Bits::Table(self.codes, &self.bits);
        };
        let mut out = vec![0u16; self.codes.len()];
        let grid_cols = cols.div_ceil(block.cols);
        out.par_chunks_mut(cols.max(1))
            .zip(self.codes.par_chunks(cols.max(1)))
            .enumerate()
            .for_each(|(row, (out, codes))| {
                let base = row / block.rows * grid_cols;
                for (b, (out, codes)) in out
                    .chunks_mut(block.cols)
                    .zip(codes.chunks(block.cols))
                    .enumerate()
                {
                    let factor = factors[base + b];
                    for (o, &c) in out.iter_mut().zip(codes) {
                        // Exact: a power of two (or an E4M3 value) times a value of at most 4 significant bits,
                        // inside bf16's normal range; a NaN stays a quiet NaN.
                        *o = ((self.table[c as usize] * factor).to_bits() >> 16) as u16;
                    }
                }
            });
        Bits::Decoded(out)
    }
}

/// An operand's elements as bf16 bits.
enum Bits<'a> {
    /// Codes and the bits of each code.
    Table(&'a [u8], &'a [u16; 256]),
    /// The bits of each element.
    Decoded(Vec<u16>),
}

/// Batch `b`'s matrix of `operand` as the GEMM reads it, its elements from `bits`.
fn source<'a>(operand: &HostOperand<'_>, bits: &'a Bits<'_>, b: usize) -> Source<'a> {
    let (batch, rows, cols) = operand.dims;
    Source {
        elements: match bits {
            Bits::Table(codes, table) => Elements::Codes(codes, table),
            Bits::Decoded(bits) => Elements::Bits(bits),
        },
        offset: if batch > 1 { b * rows * cols } else { 0 },
        strides: if operand.transposed {
            (1, cols)
        } else {
            (cols, 1)
        },
    }
}

/// `out[b] = lhs[b] · rhs[b]` (`m × n` each, row-major) on the bf16 path; `Err` with the reason when an operand is
/// not exact in bf16 (the caller runs the f32 path then).
pub(crate) fn bf16_gemm(
    lhs: &HostOperand<'_>,
    rhs: &HostOperand<'_>,
    (m, n, k): (usize, usize, usize),
    out: &mut [f32],
) -> Result<(), String> {
    let (lhs_decoding, rhs_decoding) = (
        Decoding::new(lhs).map_err(|err| format!("left operand: {err}"))?,
        Decoding::new(rhs).map_err(|err| format!("right operand: {err}"))?,
    );
    let alpha = (lhs_decoding.alpha * rhs_decoding.alpha) as f32;
    let (lhs_bits, rhs_bits) = (lhs_decoding.bits(lhs.dims.2), rhs_decoding.bits(rhs.dims.2));
    let shared_lhs = (lhs.dims.0 <= 1)
        .then(|| bf16_gemm::pack_lhs(m, k, &source(lhs, &lhs_bits, 0)))
        .transpose()?;
    let shared_rhs = (rhs.dims.0 <= 1)
        .then(|| bf16_gemm::pack_rhs(k, n, &source(rhs, &rhs_bits, 0)))
        .transpose()?;
    for (b, dst) in out.chunks_mut((m * n).max(1)).enumerate() {
        let own_lhs = shared_lhs
            .is_none()
            .then(|| bf16_gemm::pack_lhs(m, k, &source(lhs, &lhs_bits, b)))
            .transpose()?;
        let own_rhs = shared_rhs
            .is_none()
            .then(|| bf16_gemm::pack_rhs(k, n, &source(rhs, &rhs_bits, b)))
            .transpose()?;
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
