//! A 12 × 32 output tile held in 24 AVX-512 registers (row `r`'s columns 0–15 in register `2r`, 16–31 in
//! `2r + 1`), as the `avx512bf16` and `avx512fma` micro-kernels leave their sums: written to a tile on the stack, or
//! straight into the output as [`Update`] says.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::Update;

/// The tile's sums, one register per half row.
pub(super) type Sums = [__m512; 24];

/// `tile[r · 32 + c]` = the sums.
///
/// # Safety
/// Called from a function with AVX-512F enabled (into which it is inlined); `tile` holds 384 values.
#[inline(always)]
pub(super) unsafe fn store(acc: &Sums, tile: *mut f32) {
    for (i, v) in acc.iter().enumerate() {
        // SAFETY: `tile` holds 24 vectors of 16.
        unsafe { _mm512_storeu_ps(tile.add(16 * i), *v) };
    }
}

/// The whole tile at `out` (row stride `ld`) updated with the sums as `update` says: the same operations as
/// [`Update::apply`] on each value, so the same bits.
///
/// # Safety
/// Called from a function with AVX-512F enabled (into which it is inlined); `out` holds 12 rows of 32 values at stride `ld`.
#[inline(always)]
pub(super) unsafe fn update(acc: &Sums, out: *mut f32, ld: usize, update: Update) {
    // SAFETY: AVX-512F is enabled where this is inlined (the function's contract).
    let alpha = unsafe { _mm512_set1_ps(update.alpha) };
    for (i, &s) in acc.iter().enumerate() {
        // SAFETY: vector `i` is row `i / 2`, columns `16 · (i % 2)..+16`, inside the tile.
        unsafe {
            let dst = out.add(i / 2 * ld + 16 * (i % 2));
            let value = match (update.first, update.last) {
                (true, false) => s,
                (true, true) => _mm512_mul_ps(s, alpha),
                (false, false) => _mm512_add_ps(_mm512_loadu_ps(dst), s),
                (false, true) => _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(dst), s), alpha),
            };
            _mm512_storeu_ps(dst, value);
        }
    }
}
