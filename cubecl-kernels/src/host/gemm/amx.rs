//! The AMX path: FP8 values as bf16 pairs on AMX-BF16's tile units (`tdpbf16ps`: a 16 × 16 f32 tile plus a
//! 16 × 32 bf16 tile times a 32 × 16 one), bf16 × bf16 products accumulated in f32 — the [`super::bf16`] path's
//! exact products and element tables, at many times the rate of the vector units.
//!
//! The tile state is the kernel's to grant: [`granted`] asks Linux once per process for it
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`, Linux 5.16 on), after CPUID has shown AMX-TILE and AMX-BF16.
//! Like `vdpbf16ps`, `tdpbf16ps` reads bf16 subnormals as zero and flushes f32 results below the normal range to
//! zero, so the callers' [`super::bf16::exact_bf16`] check of folded scales holds here too.
//!
//! The micro-kernel holds a 32 × 32 output tile in four tile registers (`tmm0`–`tmm3`) and steps the depth 16
//! pairs at a time: two left tiles (`tmm4`, `tmm5`: 16 rows × 16 pairs, a panel's group row by row,
//! [`Kernel::LHS_ROW_GROUPS`]) and two right tiles (`tmm6`, `tmm7`: 16 pairs × 16 columns, the right panel as the
//! other paths pack it) make four tile products; the left panel stays in L1 while the right ones stream from L2 (each
//! task packs its right block there itself, [`Kernel::RHS_IN_TASKS`]), and
//! the tiles' sums wait between depth blocks in a buffer of the task's ([`Kernel::SUMS_IN_TASK_BUFFER`]). Rust has
//! no stable AMX intrinsics, so the instructions are inline assembly (`ldtilecfg`, `tilezero`, `tileloadd`,
//! `tileloaddt1`, `tdpbf16ps`, `tilestored`, `tilerelease`).
//! The tile registers are no compiler's: each task of the blocked GEMM configures them on its thread and releases them
//! at its end ([`Kernel::in_task`]; configuring them per micro-kernel call cost a fifth of the GEMM).

use super::{HostGemmPath, Kernel, OutTile, Update};

/// The AMX path's micro-kernel: 32 × 32 output tiles in four 16 × 16 tile registers.
pub struct AmxBf16Kernel;

impl Kernel for AmxBf16Kernel {
    const PATH: HostGemmPath = HostGemmPath::AmxBf16;
    type Element = u16;
    const MR: usize = 32;
    const NR: usize = 32;
    /// Depth pairs per block: a left panel of `KC × MR` pairs (32 KiB) stays in L1 while every right panel of the
    /// task (`ROW_PANELS_OUTER`) streams by from L2, loaded with the `T1` hint (read once) so as not to evict it.
    /// The tiles' partial sums go to the task's buffer between blocks (`SUMS_IN_TASK_BUFFER`). On a 2-core Xeon of
    /// family 6 model 167 (2026-12-05), a stand-alone copy of the blocked loop: 128, 192, 256, 384 and 512 pairs
    /// per block, 256, 512 and 1024 rows per task, 256 and 512 columns, with and without software prefetch
    /// (which slowed it), with the sums kept apart or in the output; this was the fastest, 1.2–1.35× the blocking
    /// it replaced (512 pairs, 256 × 256, prefetch, sums in the output).
    const KC: usize = 256;
    /// A task's left block (`MC × KC` pairs, 512 KiB) and right block (`KC × NC`, 256 KiB) in a 2 MiB L2.
    const MC: usize = 512;
    const NC: usize = 256;
    const GROUP: usize = 16;
    const LHS_ROW_GROUPS: bool = true;
    const ROW_PANELS_OUTER: bool = true;
    const SUMS_IN_TASK_BUFFER: bool = true;
    const RHS_IN_TASKS: bool = true;

    /// The tiles configured for the task, released after it (also where it unwinds).
    unsafe fn in_task(task: impl FnOnce()) {
        #[cfg(target_arch = "x86_64")]
        {
            struct Release;
            impl Drop for Release {
                fn drop(&mut self) {
                    // SAFETY: `tilerelease` only returns this thread's tile state to its initial state.
                    unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
                }
            }
            // SAFETY: a valid configuration (palette 1, 16 rows of 64 bytes); AMX is granted (the caller's
            // contract: the CPU has the path).
            unsafe {
                std::arch::asm!(
                    "ldtilecfg [{config}]",
                    config = in(reg) CONFIG.0.as_ptr(),
                    options(nostack, readonly),
                )
            };
            let _release = Release;
            task();
        }
        #[cfg(not(target_arch = "x86_64"))]
        task()
    }

    unsafe fn micro_kernel(a: *const u32, b: *const u32, kc: usize, tile: *mut f32) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract; `tile` is 32 rows of 32 values.
        unsafe {
            sums(a, b, kc, tile, Self::NR, false)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("the AMX path runs only where AMX was granted: {a:?} {b:?} {kc} {tile:?}")
    }

    /// In the tile registers: the first depth block starts from zero, a later one from the task's partial sums
    /// (loaded into the accumulator tiles), so each output value is one running f32 sum over the whole depth
    /// (`alpha` is 1 here: the task applies it, `SUMS_IN_TASK_BUFFER`).
    unsafe fn update_whole(a: *const u32, b: *const u32, kc: usize, out: OutTile, update: Update) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract: `out` is a whole 32 × 32 tile at stride `out.ld`, initialized after the
        // first block.
        unsafe {
            debug_assert_eq!(update.alpha, 1.0, "the task applies alpha");
            sums(a, b, kc, out.ptr, out.ld, !update.first);
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("a path of x86-64 kernels: {a:?} {b:?} {kc} {out:?} {update:?}")
    }
}

/// Whether this process may run the AMX path: the CPU has AMX-TILE and AMX-BF16 and the kernel granted the tile
/// state (asked once per process).
pub fn granted() -> bool {
    static GRANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *GRANTED.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            let max_leaf = std::arch::x86_64::__cpuid(0).eax;
            if max_leaf < 7 {
                return false;
            }
            let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
            let (amx_bf16, amx_tile) = (edx >> 22 & 1 == 1, edx >> 24 & 1 == 1);
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: `arch_prctl(ARCH_REQ_XCOMP_PERM, feature)` takes two integers and changes only this
            // process's permission to use the feature's state.
            amx_bf16
                && amx_tile
                && unsafe {
                    libc::syscall(
                        libc::SYS_arch_prctl,
                        ARCH_REQ_XCOMP_PERM,
                        XFEATURE_XTILEDATA,
                    )
                } == 0
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

/// The tile configuration: palette 1, all eight tiles 16 rows of 64 bytes.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

#[cfg(target_arch = "x86_64")]
static CONFIG: TileConfig = {
    let mut bytes = [0u8; 64];
    bytes[0] = 1;
    let mut t = 0;
    while t < 8 {
        bytes[16 + 2 * t] = 64;
        bytes[48 + t] = 16;
        t += 1;
    }
    TileConfig(bytes)
};

/// The 32 × 32 tile at `out` (row stride `ld` values) set to (`accumulate`: increased by) the sums over `kc`
/// depth pairs (a multiple of 16) of `a`, the left panel's `kc / 16` groups of 32 rows × 16 pairs, times `b`, the
/// right panel's `kc × 32` pairs.
///
/// # Safety
/// AMX was [`granted`] and the tiles configured ([`Kernel::in_task`]); `a` and `b` hold `kc · 32` pairs each;
/// `out` holds 32 rows of 32 values at stride `ld`, initialized where `accumulate`.
#[cfg(target_arch = "x86_64")]
unsafe fn sums(
    a: *const u32,
    b: *const u32,
    kc: usize,
    out: *mut f32,
    ld: usize,
    accumulate: bool,
) {
    use std::arch::asm;
    debug_assert!(kc.is_multiple_of(16));
    // The four accumulator tiles' first values: columns 0–15 and 16–31 of rows 0–15 and 16–31.
    let quarters = [
        out,
        out.wrapping_add(16),
        out.wrapping_add(16 * ld),
        out.wrapping_add(16 * ld + 16),
    ];
    // SAFETY: the tiles are configured (the caller's contract) and belong to no compiled code; the quarters lie in
    // `out`'s 32 × 32 tile and the groups in `a` and `b` (the caller's contract).
    unsafe {
        if accumulate {
            asm!(
                "tileloadd tmm0, [{q0} + {stride}*1]",
                "tileloadd tmm1, [{q1} + {stride}*1]",
                "tileloadd tmm2, [{q2} + {stride}*1]",
                "tileloadd tmm3, [{q3} + {stride}*1]",
                q0 = in(reg) quarters[0],
                q1 = in(reg) quarters[1],
                q2 = in(reg) quarters[2],
                q3 = in(reg) quarters[3],
                stride = in(reg) 4 * ld,
                options(nostack, readonly),
            );
        } else {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem),
            );
        }
        for g in 0..kc / 16 {
            // Group `g`: left rows 0–15 and 16–31 (64 bytes apart), right pairs g·16.. of columns 0–15 and 16–31
            // (128 bytes apart).
            let left = a.add(g * 16 * 32);
            let right = b.add(g * 16 * 32);
            // The right tiles load with the `T1` hint (read once; the left panel, which every right panel of the
            // block reads again, stays in L1). Measured on Emerald Rapids, one switch at a time in one process:
            // the hint took 5–8 % off the bench's GEMMs of hidden 1024 and up. Software prefetches of the next
            // group (4–12 % faster there with 512 pairs per block) slowed the 256-pair blocks by a fifth on a Xeon
            // of model 167.
            asm!(
                "tileloadd tmm4, [{left} + {row}*1]",
                "tileloaddt1 tmm6, [{right} + {pairs}*1]",
                "tileloadd tmm5, [{left_low} + {row}*1]",
                "tileloaddt1 tmm7, [{right_high} + {pairs}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                left = in(reg) left,
                left_low = in(reg) left.add(16 * 16),
                right = in(reg) right,
                right_high = in(reg) right.add(16),
                row = in(reg) 64usize,
                pairs = in(reg) 128usize,
                options(nostack, readonly),
            );
        }
        asm!(
            "tilestored [{q0} + {stride}*1], tmm0",
            "tilestored [{q1} + {stride}*1], tmm1",
            "tilestored [{q2} + {stride}*1], tmm2",
            "tilestored [{q3} + {stride}*1], tmm3",
            q0 = in(reg) quarters[0],
            q1 = in(reg) quarters[1],
            q2 = in(reg) quarters[2],
            q3 = in(reg) quarters[3],
            stride = in(reg) 4 * ld,
            options(nostack),
        );
    }
}
