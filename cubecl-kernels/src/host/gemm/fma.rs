//! The f32 path on AVX2's fused multiply-add (`vfmadd231ps`): FP8 values decoded exactly to f32, f32 products
//! accumulated in f32 with one rounding per step. The choice of CPUs without AVX512-BF16 (and of those whose
//! bf16 dot products run no faster than their f32 FMAs).

use super::{HostGemmPath, Kernel, OutTile, Update};

/// The FMA path's micro-kernel: 6 × 16 output tiles in 12 of AVX2's 16 registers (two for the right panel's row,
/// one for the broadcast left value), as BLIS's Haswell and Zen kernels hold them.
pub struct Avx2FmaKernel;

impl Kernel for Avx2FmaKernel {
    const PATH: HostGemmPath = HostGemmPath::Avx2Fma;
    type Element = u32;
    const MR: usize = 6;
    const NR: usize = 16;
    /// Depth per block: a right panel of `KC × NR` f32 (16 KiB) and a left one of `KC × MR` (6 KiB) in a 32 KiB
    /// L1 cache.
    const KC: usize = 256;
    /// A task's left block (`MC × KC`, 144 KiB) and right block (`KC × NC`, 256 KiB) in a 512 KiB L2 cache.
    const MC: usize = 144;
    const NC: usize = 256;

    unsafe fn micro_kernel(a: *const u32, b: *const u32, kc: usize, tile: *mut f32) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        unsafe {
            micro_kernel(a.cast(), b.cast(), kc, tile)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!(
            "the FMA path runs only where AVX2 and FMA were detected: {a:?} {b:?} {kc} {tile:?}"
        )
    }

    /// From the registers (no pass through a tile on the stack).
    unsafe fn update_whole(a: *const u32, b: *const u32, kc: usize, out: OutTile, update: Update) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        unsafe {
            update_whole(a.cast(), b.cast(), kc, out.ptr, out.ld, update)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("a path of x86-64 kernels: {a:?} {b:?} {kc} {out:?} {update:?}")
    }
}

/// The sums of one 6 × 16 tile over `kc` depths in 12 registers (row `r`'s columns 0–7 in `2r`, 8–15 in `2r + 1`):
/// `a` the panel's `kc × 6` values, `b` the panel's `kc × 16`.
///
/// # Safety
/// The CPU has AVX2 and FMA; `a` holds `kc · 6` values, `b` `kc · 16`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn sums(a: *const f32, b: *const f32, kc: usize) -> [std::arch::x86_64::__m256; 12] {
    use std::arch::x86_64::*;
    const MR: usize = Avx2FmaKernel::MR;
    const NR: usize = Avx2FmaKernel::NR;
    let mut acc = [_mm256_setzero_ps(); 2 * MR];
    for p in 0..kc {
        // SAFETY: in bounds by the function's contract.
        unsafe {
            let b0 = _mm256_loadu_ps(b.add(p * NR));
            let b1 = _mm256_loadu_ps(b.add(p * NR + 8));
            for r in 0..MR {
                let av = _mm256_broadcast_ss(&*a.add(p * MR + r));
                acc[2 * r] = _mm256_fmadd_ps(av, b0, acc[2 * r]);
                acc[2 * r + 1] = _mm256_fmadd_ps(av, b1, acc[2 * r + 1]);
            }
        }
    }
    acc
}

/// `tile = a · b` for one 6 × 16 tile over `kc` depths.
///
/// # Safety
/// As [`sums`]; `tile` holds 96 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn micro_kernel(a: *const f32, b: *const f32, kc: usize, tile: *mut f32) {
    use std::arch::x86_64::*;
    // SAFETY: the function's contract.
    let acc = unsafe { sums(a, b, kc) };
    for (i, v) in acc.into_iter().enumerate() {
        // SAFETY: `tile` holds 12 vectors of 8.
        unsafe { _mm256_storeu_ps(tile.add(8 * i), v) };
    }
}

/// The whole 6 × 16 output tile at `out` (row stride `ld`) updated with `a · b` as `update` says, from the
/// registers: the same operations as [`Update::apply`] on each value, so the same bits.
///
/// # Safety
/// As [`sums`]; `out` holds 6 rows of 16 values at stride `ld`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn update_whole(
    a: *const f32,
    b: *const f32,
    kc: usize,
    out: *mut f32,
    ld: usize,
    update: Update,
) {
    use std::arch::x86_64::*;
    // SAFETY: the function's contract.
    let acc = unsafe { sums(a, b, kc) };
    let alpha = _mm256_set1_ps(update.alpha);
    for (i, s) in acc.into_iter().enumerate() {
        // SAFETY: vector `i` is row `i / 2`, columns `8 · (i % 2)..+8`, inside the tile.
        unsafe {
            let dst = out.add(i / 2 * ld + 8 * (i % 2));
            let value = match (update.first, update.last) {
                (true, false) => s,
                (true, true) => _mm256_mul_ps(s, alpha),
                (false, false) => _mm256_add_ps(_mm256_loadu_ps(dst), s),
                (false, true) => _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(dst), s), alpha),
            };
            _mm256_storeu_ps(dst, value);
        }
    }
}
