//! The packed paths (`amxbf16`, `avx512bf16`, `avx512fma`, `avx2fma`): each operand's codes become the path's
//! element exactly as they are packed — through a table of the 256 codes when nothing is folded, else with the
//! block's scale folded in ([`BlockCodes`]) — and
//! [`burn_te_kernels::host::gemm`] packs and multiplies them; per-tensor scales and NVFP4's global scales are
//! applied to the f32 output as one factor.
//!
//! bf16 holds every FP8 value, E2M1 × E4M3 (NVFP4's element times its block scale) and an FP8 value times a power
//! of two inside bf16's normal range; an operand with another block scale is not exact in bf16 and runs on f32,
//! recorded as a fallback. f32 holds all of these too, and folds any other block scale with one rounding (as the
//! `f32` path's decode does).

use std::borrow::Cow;

use burn_te_kernels::Fp8Format;
use burn_te_kernels::ScaleBlock;
use burn_te_kernels::host::gemm::bf16::exact_bf16;
use burn_te_kernels::host::gemm::{self, BlockCodes, Elements, Kernel, PackedElement, Source};

use rayon::prelude::*;

use super::operand::HostOperand;

/// A packed path's element made from a decoded value.
pub(super) trait PathElement: PackedElement {
    /// Whether `value` is exactly an element (and not flushed by the instruction): then
    /// [`PackedElement::of_value`] gives it exactly.
    fn is_exact(value: f32) -> bool;
    /// Whether a block scale that keeps some value inexact may be folded anyway, rounded once (f32), or must make
    /// the operand fall back (bf16).
    const ROUNDED_FOLDS: bool;
}

/// bf16 bits (`vdpbf16ps`).
impl PathElement for u16 {
    fn is_exact(value: f32) -> bool {
        exact_bf16(value).is_some()
    }
    const ROUNDED_FOLDS: bool = false;
}

/// f32 bits (`vfmadd231ps`).
impl PathElement for u32 {
    fn is_exact(_: f32) -> bool {
        true
    }
    const ROUNDED_FOLDS: bool = true;
}

/// How an operand's stored codes become elements `E`: `value(code) · fold[block]`, and the factor left for the
/// output.
struct Decoding<'a, E> {
    /// Each code's value.
    table: [f32; 256],
    /// Each code's element (nothing folded).
    elements: [E; 256],
    /// One factor per block folded into the elements (`None`: nothing folded): a block's `scale_inv` (borrowed),
    /// or the value of NVFP4's E4M3 block-scale code.
    fold: Option<(ScaleBlock, Cow<'a, [f32]>)>,
    /// The factor applied to the output (the per-tensor scale, NVFP4's global part).
    alpha: f64,
    codes: &'a [u8],
}

impl<'a, E: PathElement> Decoding<'a, E> {
    /// The decoding of `operand`, or why it is not exact in `E`.
    fn new(operand: &HostOperand<'a>) -> Result<Self, String> {
        let table: [f32; 256] = std::array::from_fn(|code| operand.format.decode(code as u8));
        if let Some(value) = table.iter().find(|&&v| !E::is_exact(v)) {
            return Err(format!(
                "the {} value {value:e} is not exact in the path's element",
                operand.format.name()
            ));
        }
        let elements = table.map(E::of_value);
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
                        .collect::<Vec<f32>>()
                        .into(),
                )),
                f64::from(nvfp4.global_amax) / 2688.0,
            ),
            (Some(block), None) => {
                if !E::ROUNDED_FOLDS {
                    check_exact_folds::<E>(&table, operand)?;
                }
                (Some((block, Cow::Borrowed(operand.scale_inv))), 1.0)
            }
        };
        Ok(Self {
            table,
            elements,
            fold,
            alpha,
            codes: operand.codes,
        })
    }

    /// The stored tensor's elements (row-major, `cols` columns): the codes through the table when nothing is
    /// folded, else with each block's factor folded in as they are packed.
    fn elements(&self, cols: usize) -> Elements<'_, E> {
        match &self.fold {
            None => Elements::Codes(self.codes, &self.elements),
            Some((block, factors)) => Elements::Blocks(BlockCodes {
                codes: self.codes,
                values: &self.table,
                cols,
                block: *block,
                factors,
            }),
        }
    }
}

/// Every block scale of `operand` a power of two that keeps each finite value of `table` exactly an element.
fn check_exact_folds<E: PathElement>(
    table: &[f32; 256],
    operand: &HostOperand<'_>,
) -> Result<(), String> {
    let finite = table.iter().filter(|v| v.is_finite()).map(|v| v.abs());
    let smallest = finite
        .clone()
        .filter(|&v| v > 0.0)
        .fold(f32::INFINITY, f32::min);
    let largest = finite.fold(0.0, f32::max);
    let fits = |scale: f32| {
        let power_of_two = scale.is_finite() && scale > 0.0 && scale.to_bits() & 0x7f_ffff == 0;
        power_of_two && E::is_exact(smallest * scale) && (largest * scale).is_finite()
    };
    // One pass over the bits: the smallest and largest scale, and any sign or mantissa bit. Where every scale is a
    // positive normal power of two, the smallest and largest decide for all: bf16 has f32's exponent range, so a
    // power of two moves a value's exponent only, and a smaller one underflows first, a larger one overflows first.
    let (mut low, mut high, mut stray) = (u32::MAX, 0u32, 0u32);
    for &scale in operand.scale_inv {
        let bits = scale.to_bits();
        (low, high, stray) = (low.min(bits), high.max(bits), stray | (bits & 0x807f_ffff));
    }
    let normal = |bits: u32| (0x80_0000..0x7f80_0000).contains(&bits);
    let all_fit = operand.scale_inv.is_empty()
        || (stray == 0
            && normal(low)
            && normal(high)
            && fits(f32::from_bits(low))
            && fits(f32::from_bits(high)));
    if all_fit {
        return Ok(());
    }
    // Name the first that does not fit.
    match operand.scale_inv.iter().find(|&&scale| !fits(scale)) {
        None => Ok(()),
        Some(scale) => Err(format!(
            "block scale_inv {scale:e} is not a power of two that keeps every {} value exact in the path's \
             element",
            operand.format.name()
        )),
    }
}

/// Batch `b`'s matrix of `operand` as the GEMM reads it, its stored `elements`.
fn source<'a, E: Copy>(
    operand: &HostOperand<'_>,
    elements: Elements<'a, E>,
    b: usize,
) -> Source<'a, E> {
    let (offset, strides) = operand.layout(b);
    Source {
        elements,
        offset,
        strides,
    }
}

/// `out[b] = lhs[b] · rhs[b] (+ bias)` (`m × n` each, row-major) on `K`'s path, the bias added in the GEMM's
/// epilogue; `Err` with the reason when an operand is not exact in the path's element or the path cannot run (the
/// caller runs the f32 path then).
pub(super) fn gemm<K: Kernel>(
    lhs: &HostOperand<'_>,
    rhs: &HostOperand<'_>,
    (m, n, k): (usize, usize, usize),
    bias: Option<&[f32]>,
    out: &mut [std::mem::MaybeUninit<f32>],
) -> Result<(), String>
where
    K::Element: PathElement,
{
    let (lhs_decoding, rhs_decoding) = (
        Decoding::<K::Element>::new(lhs).map_err(|err| format!("left operand: {err}"))?,
        Decoding::<K::Element>::new(rhs).map_err(|err| format!("right operand: {err}"))?,
    );
    let alpha = (lhs_decoding.alpha * rhs_decoding.alpha) as f32;
    let (lhs_elements, rhs_elements) = (
        lhs_decoding.elements(lhs.dims.2),
        rhs_decoding.elements(rhs.dims.2),
    );
    let pack_lhs = |b| gemm::pack_lhs::<K>(m, k, &source(lhs, lhs_elements, b));
    let pack_rhs = |b| gemm::pack_rhs::<K>(k, n, &source(rhs, rhs_elements, b));
    let shared_lhs = (lhs.dims.0 <= 1).then(|| pack_lhs(0)).transpose();
    // A right operand the tasks pack block by block (`Kernel::RHS_IN_TASKS`) is only checked here, per matrix.
    let shared_rhs = (rhs.dims.0 <= 1 && !K::RHS_IN_TASKS)
        .then(|| pack_rhs(0))
        .transpose();
    let (shared_lhs, shared_rhs) = (
        shared_lhs.map_err(|err| err.to_string())?,
        shared_rhs.map_err(|err| err.to_string())?,
    );
    let one = |(b, dst): (usize, &mut [std::mem::MaybeUninit<f32>])| {
        let own_lhs = shared_lhs.is_none().then(|| pack_lhs(b)).transpose();
        let own_lhs = own_lhs.map_err(|err| err.to_string())?;
        let a = shared_lhs
            .as_ref()
            .or(own_lhs.as_ref())
            .expect("one of the two");
        let epilogue = gemm::Epilogue { alpha, bias };
        if K::RHS_IN_TASKS {
            let w = gemm::rhs_in_tasks::<K>(k, n, &source(rhs, rhs_elements, b))
                .map_err(|err| err.to_string())?;
            return gemm::gemm(a, &w, epilogue, dst).map_err(|err| err.to_string());
        }
        let own_rhs = shared_rhs.is_none().then(|| pack_rhs(b)).transpose();
        let own_rhs = own_rhs.map_err(|err| err.to_string())?;
        let w = shared_rhs
            .as_ref()
            .or(own_rhs.as_ref())
            .expect("one of the two");
        gemm::gemm(a, w, epilogue, dst).map_err(|err| err.to_string())
    };
    // A batch's matrices run side by side (an attention's per-head GEMMs are one task each, so one at a time would
    // leave the other threads idle); each matrix's own tasks still spread where it is large. The same sums either
    // way: a matrix's bits do not depend on the thread that runs it.
    let chunks = (m * n).max(1);
    if out.len() > chunks {
        out.par_chunks_mut(chunks).enumerate().try_for_each(one)
    } else {
        out.chunks_mut(chunks).enumerate().try_for_each(one)
    }
}
