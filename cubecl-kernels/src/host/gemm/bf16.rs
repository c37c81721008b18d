//! The bf16 path: FP8 values as bf16 pairs on AVX512-BF16's dot-product units (`vdpbf16ps`), bf16 × bf16
//! products accumulated in f32 — exactly TE's FP8 GEMM, because every FP8 value is a bf16 value.
//!
//! [`exact_bf16`] gives a value's bf16 bits, or `None` where it is not exactly a bf16 normal number (or zero, inf,
//! NaN): `vdpbf16ps` flushes bf16 subnormals to zero, so those would not be exact. The callers check their folded
//! scales with it. Output values below f32's normal range are flushed to zero by the instruction (as with the
//! DAZ/FTZ modes).

#[cfg(target_arch = "x86_64")]
use super::zmm_tile;
use super::{HostGemmPath, Kernel, OutTile, Update};

/// The bf16 path's micro-kernel: 12 × 32 output tiles in 24 registers.
pub struct Avx512Bf16Kernel;

impl Kernel for Avx512Bf16Kernel {
    const PATH: HostGemmPath = HostGemmPath::Avx512Bf16;
    type Element = u16;
    const MR: usize = 12;
    const NR: usize = 32;
    /// Depth pairs per block: a right panel of `KC × NR` pairs (24 KiB) and a left one of `KC × MR` (9 KiB) fit a
    /// 48 KiB L1 cache together (the best of the sizes tried on the AMD EPYC it was tuned on).
    const KC: usize = 192;
    /// A task's left block (`MC × KC` pairs, 387 KiB) and right block (`KC × NC`, 192 KiB) in L2: 516 rows, so
    /// that a right block packed in a task serves a layer's 1 024 tokens in two tasks.
    const MC: usize = 516;
    const NC: usize = 256;
    /// Each task packs its right block into its thread's buffer, and each left panel (9 KiB) stays in L1 against
    /// the task's right panels, as on `avx512fma`: the whole right operand packed ahead went to memory and back.
    /// On a 2-core AMD EPYC of family 26 model 2 (Zen 5, 2026-12-06), two step servers alternating FP8
    /// TransformerLayer steps turn by turn: hidden 1024 0.93–0.94× the time of 144-row tasks with the operand
    /// packed ahead (30 turns, quartiles 0.93–0.96), hidden 2048 0.92× (12 turns, 0.90–0.93). In-task packing
    /// alone: 0.95×; left panels outer alone: 0.98×; 264 or 1 032 rows, or 128 or 256 depth pairs: within
    /// ±2.5 % of this.
    const RHS_IN_TASKS: bool = true;
    const ROW_PANELS_OUTER: bool = true;

    unsafe fn micro_kernel(a: *const u32, b: *const u32, kc: usize, tile: *mut f32) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        unsafe {
            micro_kernel(a, b, kc, tile)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!(
            "the bf16 path runs only where AVX512-BF16 was detected: {a:?} {b:?} {kc} {tile:?}"
        )
    }

    /// From the registers (no pass through a tile on the stack).
    unsafe fn update_whole(a: *const u32, b: *const u32, kc: usize, out: OutTile, update: Update) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        unsafe {
            update_whole(a, b, kc, out.ptr, out.ld, update)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("a path of x86-64 kernels: {a:?} {b:?} {kc} {out:?} {update:?}")
    }
}

/// The bf16 bits of `x` when `x` is exactly a bf16 zero, normal number or infinity; a NaN gives bf16's quiet NaN.
/// `None` for a value with more than 8 significant bits or a bf16 subnormal (which `vdpbf16ps` flushes to zero).
#[inline(always)]
pub fn exact_bf16(x: f32) -> Option<u16> {
    let bits = x.to_bits();
    let abs = bits & 0x7fff_ffff;
    if abs > 0x7f80_0000 {
        return Some((bits >> 16) as u16 & 0x8000 | 0x7fc0);
    }
    let subnormal = abs != 0 && abs < 0x0080_0000;
    (bits & 0xffff == 0 && !subnormal).then_some((bits >> 16) as u16)
}

/// The sums of one 12 × 32 tile over `kc` depth pairs in 24 registers (row `r`'s columns 0–15 in `2r`, 16–31 in
/// `2r + 1`): `a` the panel's `kc × 12` pairs, `b` the panel's `kc × 32` pairs.
///
/// # Safety
/// The CPU has AVX512-BF16; `a` holds `kc · 12` pairs, `b` `kc · 32`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn sums(a: *const u32, b: *const u32, kc: usize) -> zmm_tile::Sums {
    use std::arch::x86_64::*;
    const MR: usize = Avx512Bf16Kernel::MR;
    const NR: usize = Avx512Bf16Kernel::NR;
    let mut acc = [_mm512_setzero_ps(); 2 * MR];
    for p in 0..kc {
        // SAFETY: in bounds by the function's contract; bf16 pairs are 32-bit lanes of the same bits.
        unsafe {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16).cast()));
            for r in 0..MR {
                let pair = *a.add(p * MR + r) as i32;
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                acc[2 * r] = _mm512_dpbf16_ps(acc[2 * r], av, b0);
                acc[2 * r + 1] = _mm512_dpbf16_ps(acc[2 * r + 1], av, b1);
            }
        }
    }
    acc
}

/// `tile = a · b` for one 12 × 32 tile over `kc` depth pairs.
///
/// # Safety
/// As [`sums`]; `tile` holds 384 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn micro_kernel(a: *const u32, b: *const u32, kc: usize, tile: *mut f32) {
    // SAFETY: the function's contract.
    unsafe { zmm_tile::store(&sums(a, b, kc), tile) }
}

/// The whole 12 × 32 output tile at `out` (row stride `ld`) updated with `a · b` as `update` says, from the
/// registers.
///
/// # Safety
/// As [`sums`]; `out` holds 12 rows of 32 values at stride `ld`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn update_whole(
    a: *const u32,
    b: *const u32,
    kc: usize,
    out: *mut f32,
    ld: usize,
    update: Update,
) {
    // SAFETY: the function's contract.
    unsafe { zmm_tile::update(&sums(a, b, kc), out, ld, update) }
}
