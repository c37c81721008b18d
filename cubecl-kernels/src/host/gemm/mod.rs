//! The host FP8 GEMM's packed paths: FP8 operands decoded exactly into the element type of one CPU instruction,
//! packed into panels, and multiplied by that instruction's micro-kernel with f32 accumulation — TE's FP8 GEMM
//! (FP8 operands, f32 accumulation) on a CPU.
//!
//! - [`bf16`]: bf16 pairs on AVX512-BF16's dot-product units (`vdpbf16ps`). Every FP8 value is a bf16 value, so
//!   are E2M1 × E4M3 (NVFP4) and an FP8 value times a power of two inside bf16's normal range.
//! - [`fma512`]: f32 on AVX-512's fused multiply-add (`vfmadd231ps` on 512-bit registers), for CPUs whose f32 FMAs
//!   outrun their bf16 dot products (Intel Xeons without AMX).
//! - [`fma`]: f32 on AVX2's fused multiply-add (`vfmadd231ps`), for every x86-64 CPU since 2013. Every FP8 value
//!   is an f32 value; a folded block scale that is not a power of two is rounded once in f32.
//!
//! Per-tensor scales (DelayedScaling, Float8CurrentScaling, NVFP4's global scale) are applied to the f32 output as
//! one factor `alpha`; block scales are folded into the elements as they are packed ([`BlockCodes`]). The
//! products are exact in f32 and each is added to its f32 accumulator with one rounding, so the result differs
//! from the exact sum by at most `γ_k · Σ|a·b|` (`γ_k = k·u / (1 − k·u)`, `u = 2⁻²⁴`) plus one rounding of
//! `alpha`'s product.
//!
//! The pieces: [`pack_lhs`] / [`pack_rhs`] lay a stored matrix (any offset and strides; FP8 codes through a table,
//! or codes with a factor per block, [`BlockCodes`]) out as the micro-kernel reads it (`pack`); [`gemm`] splits
//! the output into tiles across rayon's threads, runs the micro-kernel over cache-sized depth blocks and finishes
//! each task's output with the [`Epilogue`] (output factor, bias) while it is in cache (`blocked`); packed
//! buffers of 4 MiB and more come from the host outputs' process-wide pool ([`crate::host::pool`]). Which path runs
//! is [`HostGemmPath`]'s business, measured by the caller (burn-te's host backend probes them at first use).
//!
//! - [`amx`]: bf16 pairs on AMX-BF16's tile units (`tdpbf16ps` on 16 × 16 tiles), where the kernel grants the
//!   process AMX's tile state (Intel Xeons since Sapphire Rapids): the bf16 path's exact products, 16 × 32 depth at
//!   a time.

pub mod amx;
pub mod bf16;
mod block_codes;
mod blocked;
pub mod fma;
pub mod fma512;
mod pack;
mod pack_blocks_vbmi;
pub mod pack_vbmi;
mod zmm_tile;

pub use block_codes::BlockCodes;
pub use blocked::{Epilogue, Rhs, fill_bias_rows, gemm};
pub use pack::{
    Elements, PackedElement, PackedLhs, PackedRhs, RhsInTasks, Source, pack_lhs, pack_rhs,
    rhs_in_tasks,
};

/// Which host FP8 GEMM runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostGemmPath {
    /// bf16 tile products on AMX-BF16 (`tdpbf16ps`), f32 accumulation ([`amx`]).
    AmxBf16,
    /// bf16 dot products on AVX512-BF16 (`vdpbf16ps`), f32 accumulation ([`bf16`]).
    Avx512Bf16,
    /// f32 fused multiply-adds on AVX-512F (`vfmadd231ps` on 512-bit registers) on exactly decoded operands
    /// ([`fma512`]).
    Avx512Fma,
    /// f32 fused multiply-adds on AVX2 + FMA (`vfmadd231ps`) on exactly decoded operands ([`fma`]).
    Avx2Fma,
    /// Operands decoded to f32 (scales multiplied in), the `gemm` crate's f32 GEMM: any CPU.
    F32,
}

impl HostGemmPath {
    /// Every path, fastest instruction first.
    pub const ALL: [HostGemmPath; 5] = [
        HostGemmPath::AmxBf16,
        HostGemmPath::Avx512Bf16,
        HostGemmPath::Avx512Fma,
        HostGemmPath::Avx2Fma,
        HostGemmPath::F32,
    ];

    /// The path's name, as in the metrics report and `BURN_TE_HOST_GEMM`.
    pub fn name(self) -> &'static str {
        match self {
            HostGemmPath::AmxBf16 => "amxbf16",
            HostGemmPath::Avx512Bf16 => "avx512bf16",
            HostGemmPath::Avx512Fma => "avx512fma",
            HostGemmPath::Avx2Fma => "avx2fma",
            HostGemmPath::F32 => "f32",
        }
    }

    /// The instruction that does the path's multiply-adds, as a report names it (`vdpbf16ps zmm`).
    pub fn instruction(self) -> &'static str {
        match self {
            HostGemmPath::AmxBf16 => "tdpbf16ps tmm",
            HostGemmPath::Avx512Bf16 => "vdpbf16ps zmm",
            HostGemmPath::Avx512Fma => "vfmadd231ps zmm",
            HostGemmPath::Avx2Fma => "vfmadd231ps ymm",
            HostGemmPath::F32 => "the gemm crate's f32 kernels",
        }
    }

    /// The path named `name` (`amxbf16`, `avx512bf16`, `avx512fma`, `avx2fma`, `f32`).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|path| path.name() == name)
    }

    /// Whether this CPU runs the path (its instructions detected once per process).
    pub fn available(self) -> bool {
        match self {
            HostGemmPath::AmxBf16 => amx::granted(),
            HostGemmPath::Avx512Bf16 => detected::avx512_bf16(),
            HostGemmPath::Avx512Fma => detected::avx512f(),
            HostGemmPath::Avx2Fma => detected::avx2_fma(),
            HostGemmPath::F32 => true,
        }
    }

    /// The paths this CPU runs, fastest instruction first.
    pub fn available_paths() -> Vec<HostGemmPath> {
        Self::ALL
            .into_iter()
            .filter(|path| path.available())
            .collect()
    }
}

impl std::fmt::Display for HostGemmPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The instruction sets, detected once per process.
mod detected {
    use std::sync::OnceLock;

    pub fn avx512_bf16() -> bool {
        static DETECTED: OnceLock<bool> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(not(target_arch = "x86_64"))]
            false
        })
    }

    pub fn avx512f() -> bool {
        static DETECTED: OnceLock<bool> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                std::arch::is_x86_feature_detected!("avx512f")
            }
            #[cfg(not(target_arch = "x86_64"))]
            false
        })
    }

    pub fn avx2_fma() -> bool {
        static DETECTED: OnceLock<bool> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(not(target_arch = "x86_64"))]
            false
        })
    }
}

/// What a packed host GEMM cannot do with its arguments.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostGemmError {
    /// The strides of an operand reach beyond its stored elements (`last` is `None` where the index overflows).
    #[error(
        "{what}: an operand of {lanes} × {depth} reads element {} of {stored} stored",
        last.map_or_else(|| "beyond usize::MAX".to_string(), |last| last.to_string())
    )]
    OutOfBounds {
        /// The path packing it.
        what: HostGemmPath,
        /// Its rows (left operand) or columns (right operand).
        lanes: usize,
        /// Its depth.
        depth: usize,
        /// The last element its strides reach.
        last: Option<usize>,
        /// How many are stored.
        stored: usize,
    },
    /// The packed layout would not fit in memory's address range.
    #[error("{what}: packing {lanes} × {depth} overflows usize")]
    TooLarge {
        /// The path packing it.
        what: HostGemmPath,
        /// Rows or columns.
        lanes: usize,
        /// Depth.
        depth: usize,
    },
    /// A block-scaled operand's codes do not fill whole rows, or its factors are not one per block.
    #[error(
        "{what}: {codes} codes of {cols} columns in blocks of {} × {} need one factor per block, not {factors}",
        block.0,
        block.1
    )]
    BlockFactors {
        /// The path packing it.
        what: HostGemmPath,
        /// Stored codes.
        codes: usize,
        /// Columns of the stored matrix.
        cols: usize,
        /// The block's rows and columns.
        block: (usize, usize),
        /// Factors given.
        factors: usize,
    },
    /// The two operands' depths differ.
    #[error("{what}: the left operand's depth {lhs} differs from the right's {rhs}")]
    DepthMismatch {
        /// The path.
        what: HostGemmPath,
        /// The left operand's depth.
        lhs: usize,
        /// The right operand's depth.
        rhs: usize,
    },
    /// The output slice does not hold `m × n` values.
    #[error("{what}: the output holds {len} values, not {m} × {n}")]
    OutputLength {
        /// The path.
        what: HostGemmPath,
        /// Its length.
        len: usize,
        /// Rows.
        m: usize,
        /// Columns.
        n: usize,
    },
    /// The bias does not hold one value per output column.
    #[error("{what}: the bias holds {len} values, not one per output column ({n})")]
    BiasLength {
        /// The path.
        what: HostGemmPath,
        /// Its length.
        len: usize,
        /// Output columns.
        n: usize,
    },
    /// This CPU lacks the path's instructions ([`HostGemmPath::available`] tells beforehand).
    #[error("{0}: this CPU lacks the instructions of the path")]
    Unavailable(HostGemmPath),
}

/// One path's micro-kernel and its blocking: the packed element, the output tile it holds in registers
/// (`MR × NR`), and the depth (`KC` packed units), rows (`MC`) and columns (`NC`) of one task's cache blocks.
pub trait Kernel: Sized + Send + Sync + 'static {
    /// The path it is.
    const PATH: HostGemmPath;
    /// The element a packed unit holds: bf16 bits in pairs along the depth, or f32 bits.
    type Element: PackedElement;
    /// Rows of the micro-kernel's tile.
    const MR: usize;
    /// Columns of the micro-kernel's tile.
    const NR: usize;
    /// Packed units of depth per block (the right panel `KC × NR` stays in L1 while left panels stream by).
    const KC: usize;
    /// Rows per task (a multiple of `MR`).
    const MC: usize;
    /// Columns per task (a multiple of `NR`).
    const NC: usize;
    /// Packed units per depth group: both operands' depths are padded with zero units to a multiple of it (and
    /// `KC` is one). 1 where the micro-kernel steps one unit at a time.
    const GROUP: usize = 1;
    /// Whether a left panel stores each group of `GROUP` units row by row (`[group][MR][GROUP]`, the layout AMX
    /// loads a tile's rows from) instead of unit by unit (`[unit][MR]`).
    const LHS_ROW_GROUPS: bool = false;
    /// Whether a depth block runs each left panel against every right panel of the task (the left panel reused
    /// from L1) rather than each right panel against every left one (the default).
    const ROW_PANELS_OUTER: bool = false;
    /// Whether a task keeps its tiles' sums in a buffer of its own thread (rows 16 values
    /// longer than the task's, each tile 64-byte aligned) over every depth block, and writes each output value
    /// once, times `alpha` plus the bias, in the last block (each tile as soon as the next one is computed; the
    /// tiles updated with `alpha = 1`), rather than updating the output in place. A layer's output rows are a power of two of bytes apart, which puts the 32 rows of an AMX tile in
    /// one L1 set; and AMX's tile stores are not forwarded to the vector loads that would scale them in place.
    const SUMS_IN_TASK_BUFFER: bool = false;
    /// Whether the callers pack the right operand inside the GEMM's tasks, block by block ([`rhs_in_tasks`]),
    /// rather than whole beforehand ([`pack_rhs`]): where the micro-kernel outruns the memory that a whole packed
    /// operand goes through (AMX; `avx512fma`'s f32 panels, four bytes a value).
    const RHS_IN_TASKS: bool = false;

    /// Runs one task of the blocked GEMM (every micro-kernel call of an `MC × NC` output block) on this thread:
    /// where a kernel's registers need a set-up, it is done here once per task rather than per call (AMX's tile
    /// configuration). By default just `task()`.
    ///
    /// # Safety
    /// The CPU has the path's instructions.
    unsafe fn in_task(task: impl FnOnce()) {
        task()
    }

    /// `tile[r · NR + c] = Σ_p a[p · MR + r] · b[p · NR + c]` over `kc` packed units.
    ///
    /// # Safety
    /// The CPU has the path's instructions, and this runs inside [`Kernel::in_task`]; `a` holds `kc · MR` units,
    /// `b` `kc · NR`, `tile` `MR · NR` values.
    unsafe fn micro_kernel(a: *const u32, b: *const u32, kc: usize, tile: *mut f32);

    /// The whole `MR × NR` output tile `out` updated with `a · b` over `kc` units as `update` says (partial tiles
    /// at the edges go through [`Kernel::micro_kernel`] and a tile on the stack). By default the same way; a kernel
    /// may write the tile from its registers instead (the bf16 and FMA paths: the same operations in the same
    /// order, the same bits; AMX adds a later block's products to the output's partial sums in its tile registers,
    /// one rounding per addition either way).
    ///
    /// # Safety
    /// As [`Kernel::micro_kernel`]; `out` is `MR × NR` and points at its rows.
    unsafe fn update_whole(a: *const u32, b: *const u32, kc: usize, out: OutTile, update: Update) {
        // SAFETY: the caller's contract.
        unsafe { blocked::through_tile::<Self>(a, b, kc, out, update) }
    }
}

/// A tile of the output: `rows × cols` values from `ptr`, consecutive rows `ld` values apart.
#[derive(Clone, Copy, Debug)]
pub struct OutTile {
    /// The tile's first value.
    pub ptr: *mut f32,
    /// The output's row stride.
    pub ld: usize,
    /// Rows in the tile.
    pub rows: usize,
    /// Columns in the tile.
    pub cols: usize,
}

/// How a depth block's sums meet the output: the first block writes it (without reading it: the output may not be
/// initialized before), later ones add to it, and the last multiplies the whole sum by `alpha` (the per-tensor
/// scales).
#[derive(Clone, Copy, Debug)]
pub struct Update {
    /// The first depth block.
    pub first: bool,
    /// The last depth block.
    pub last: bool,
    /// The output factor.
    pub alpha: f32,
}

impl Update {
    /// The new output value from the old one `d` and the block's sum `s`.
    #[inline(always)]
    pub fn apply(self, d: f32, s: f32) -> f32 {
        match (self.first, self.last) {
            (true, false) => s,
            (true, true) => s * self.alpha,
            (false, false) => d + s,
            (false, true) => (d + s) * self.alpha,
        }
    }
}
