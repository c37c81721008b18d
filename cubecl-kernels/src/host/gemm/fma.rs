//! The f32 path on AVX2's fused multiply-add (`vfmadd231ps`): FP8 values decoded exactly to f32, f32 products
//! accumulated in f32 with one rounding per step. The choice of CPUs without AVX512-BF16 (and of those whose
//! bf16 dot products run no faster than their f32 FMAs).

use super::{HostGemmPath, Kernel};

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
}

/// `tile = a · b` for one 6 × 16 tile over `kc` depths: `a` the panel's `kc × 6` values, `b` the panel's
/// `kc × 16`.
///
/// # Safety
/// The CPU has AVX2 and FMA; `a` holds `kc · 6` values, `b` `kc · 16` and `tile` 96.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn micro_kernel(a: *const f32, b: *const f32, kc: usize, tile: *mut f32) {
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
    for r in 0..MR {
        // SAFETY: `tile` holds MR · NR values.
        unsafe {
            _mm256_storeu_ps(tile.add(r * NR), acc[2 * r]);
            _mm256_storeu_ps(tile.add(r * NR + 8), acc[2 * r + 1]);
        }
    }
}
