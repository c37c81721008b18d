//! The f32 path on AVX-512's fused multiply-add (`vfmadd231ps` on 512-bit registers): FP8 values decoded exactly to
//! f32, as on [`super::fma`], twice the lanes per instruction. The choice of CPUs with AVX-512F whose bf16 dot
//! products run no faster than their f32 FMAs (Intel Xeons without AMX: two 512-bit FMA units, one `vdpbf16ps`
//! unit); where AVX-512 runs on 256-bit halves (AMD Zen 4) it matches [`super::fma`] and the probe decides.

#[cfg(target_arch = "x86_64")]
use super::zmm_tile;
use super::{HostGemmPath, Kernel, OutTile, Update};

/// The AVX-512 FMA path's micro-kernel: 12 × 32 output tiles in 24 of AVX-512's 32 registers (two for the right
/// panel's row, one for the broadcast left value), the shape of the `avx512bf16` kernel.
pub struct Avx512FmaKernel;

impl Kernel for Avx512FmaKernel {
    const PATH: HostGemmPath = HostGemmPath::Avx512Fma;
    type Element = u32;
    const MR: usize = 12;
    const NR: usize = 32;
    /// Depth per block: a right panel of `KC × NR` f32 (32 KiB) and a left one of `KC × MR` (12 KiB) in L1 (the
    /// best of 128, 192, 256 and 384 on the Zen 4 it was measured on). The same blocks as [`super::fma`]'s, so
    /// the two FMA paths give the same bits.
    const KC: usize = 256;
    /// A task's left block (`MC × KC`, 516 KiB) and right block (`KC × NC`, 256 KiB) in L2: 516 rows, so that
    /// a right block packed in a task ([`Kernel::RHS_IN_TASKS`]) serves a layer's 1 024 tokens in two tasks.
    const MC: usize = 516;
    const NC: usize = 256;
    /// Each task packs its right block into its thread's buffer: the whole operand packed ahead (f32, four bytes
    /// a value) went to memory and back. On a 2-core Xeon of family 6 model 167 (2026-12-05, old and new binaries
    /// alternating, 3 rounds): the bench's GEMMs 1.0–1.19× as fast (1024³ +8–14 %, fc1 h4096 +15–19 %); 1 032 rows
    /// per task instead of 516 ran the same.
    const RHS_IN_TASKS: bool = true;
    /// Each left panel (12 KiB) stays in L1 against the task's right panels streaming from L2. On the same Xeon
    /// (no AMX, old and new binaries alternating, 3 rounds): the bench's GEMMs 0.90–1.15× as fast (all but 1024³
    /// 0.98–1.15×), the hidden-1024 FP8 step 0.92–0.99×; a stand-alone copy of the loop 1.06–1.08× at
    /// 1032 × 1024 × 4096.
    const ROW_PANELS_OUTER: bool = true;

    unsafe fn micro_kernel(a: *const u32, b: *const u32, kc: usize, tile: *mut f32) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        unsafe {
            micro_kernel(a.cast(), b.cast(), kc, tile)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!(
            "the AVX-512 FMA path runs only where AVX-512F was detected: {a:?} {b:?} {kc} {tile:?}"
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

/// `tile` = the sums of one 12 × 32 tile over `kc` depths (a partial tile at an edge), with AVX-512F enabled so
/// the store inlines.
///
/// # Safety
/// As [`sums`]; `tile` holds 384 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn micro_kernel(a: *const f32, b: *const f32, kc: usize, tile: *mut f32) {
    // SAFETY: the function's contract.
    unsafe { zmm_tile::store(&sums(a, b, kc), tile) }
}

/// The sums of one 12 × 32 tile over `kc` depths: `a` the panel's `kc × 12` values, `b` the panel's `kc × 32`.
/// Each accumulator adds its products in depth order, one rounding each (as [`super::fma`]'s).
///
/// # Safety
/// The CPU has AVX-512F; `a` holds `kc · 12` values, `b` `kc · 32`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn sums(a: *const f32, b: *const f32, kc: usize) -> zmm_tile::Sums {
    use std::arch::x86_64::*;
    const MR: usize = Avx512FmaKernel::MR;
    const NR: usize = Avx512FmaKernel::NR;
    let mut acc = [_mm512_setzero_ps(); 2 * MR];
    for p in 0..kc {
        // SAFETY: in bounds by the function's contract.
        unsafe {
            let b0 = _mm512_loadu_ps(b.add(p * NR));
            let b1 = _mm512_loadu_ps(b.add(p * NR + 16));
            for r in 0..MR {
                let av = _mm512_set1_ps(*a.add(p * MR + r));
                acc[2 * r] = _mm512_fmadd_ps(av, b0, acc[2 * r]);
                acc[2 * r + 1] = _mm512_fmadd_ps(av, b1, acc[2 * r + 1]);
            }
        }
    }
    acc
}

/// The whole 12 × 32 output tile at `out` (row stride `ld`) updated with `a · b` as `update` says, from the
/// registers.
///
/// # Safety
/// As [`sums`]; `out` holds 12 rows of 32 values at stride `ld`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn update_whole(
    a: *const f32,
    b: *const f32,
    kc: usize,
    out: *mut f32,
    ld: usize,
    update: Update,
) {
    // SAFETY: the function's contract.
    unsafe { zmm_tile::update(&sums(a, b, kc), out, ld, update) }
}
