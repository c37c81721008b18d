//! The host FP8 GEMM on the CPU's bf16 dot-product units (AVX512-BF16's `vdpbf16ps`): bf16 × bf16 products
//! accumulated in f32, which is exactly TE's FP8 GEMM (FP8 operands, f32 accumulation), because every FP8 value is
//! a bf16 value.
//!
//! - Every E4M3 and E5M2 value is a bf16 value (3 and 2 mantissa bits, exponents well inside bf16's), and so is an
//!   E2M1 value times an E4M3 block scale (at most 5 significant bits) and an FP8 value times a power of two inside
//!   bf16's normal range. The callers fold such block scales into the elements and apply the rest (per-tensor
//!   scales, NVFP4's global scales) to the f32 output as one factor `alpha`.
//! - [`exact_bf16`] gives a value's bf16 bits, or `None` where it is not exactly a bf16 normal number (or zero,
//!   inf, NaN): `vdpbf16ps` flushes bf16 subnormals to zero, so those would not be exact. The callers check their
//!   scales with it before decoding.
//! - [`pack_lhs`] and [`pack_rhs`] lay the operands' bf16 values out as the micro-kernel reads them: pairs along
//!   the depth, in panels of the output tile's rows or columns.
//! - [`gemm`] multiplies them: 12 × 32 output tiles held in 24 registers, the depth in blocks that keep a panel of
//!   the right operand in the L1 cache, the output's tiles split across rayon's threads.
//!
//! The products of two bf16 values are exact in f32 and each is added to the f32 accumulator with rounding to
//! nearest, so the result differs from an exact sum by at most `γ_k · Σ|a·b|` with `γ_k = k·u / (1 − k·u)`,
//! `u = 2⁻²⁴` (the usual bound of a recursive f32 sum of `k` terms), plus one rounding of `alpha`'s product.
//! Output values below f32's normal range are flushed to zero by the instruction (as with the DAZ/FTZ modes).
//!
//! AMX-BF16 (`tdpbf16ps` on tiles) is not built yet: the CPUs this was developed and tested on (AMD) have none.

use rayon::prelude::*;

/// Which host FP8 GEMM runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostGemmPath {
    /// bf16 dot products on AVX512-BF16 (`vdpbf16ps`), f32 accumulation.
    Avx512Bf16,
    /// Operands decoded to f32, the `gemm` crate's f32 GEMM.
    F32,
}

impl HostGemmPath {
    /// The path's name, as in the metrics report and `BURN_TE_HOST_GEMM`.
    pub fn name(self) -> &'static str {
        match self {
            HostGemmPath::Avx512Bf16 => "avx512bf16",
            HostGemmPath::F32 => "f32",
        }
    }

    /// The path named `name` (`avx512bf16`, `f32`).
    pub fn from_name(name: &str) -> Option<Self> {
        [HostGemmPath::Avx512Bf16, HostGemmPath::F32]
            .into_iter()
            .find(|path| path.name() == name)
    }

    /// Whether this CPU runs the path (detected once per process).
    pub fn available(self) -> bool {
        match self {
            HostGemmPath::Avx512Bf16 => avx512_bf16(),
            HostGemmPath::F32 => true,
        }
    }
}

/// The fastest path this CPU runs.
pub fn best_path() -> HostGemmPath {
    if avx512_bf16() {
        HostGemmPath::Avx512Bf16
    } else {
        HostGemmPath::F32
    }
}

fn avx512_bf16() -> bool {
    static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
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

/// Rows of the micro-kernel's output tile.
const MR: usize = 12;
/// Columns of the micro-kernel's output tile (two vectors of 16 f32).
const NR: usize = 32;
/// Depth pairs per block: a right panel of `KC × NR` pairs (24 KiB) and a left one of `KC × MR` (9 KiB) fit a
/// 48 KiB L1 cache together (the best of the sizes tried on this machine's Zen cores).
const KC: usize = 192;
/// Rows of the output per task.
const MC: usize = 144;
/// Columns of the output per task.
const NC: usize = 256;
// A task's rows and columns are whole panels of the packed operands.
const _: () = assert!(MC.is_multiple_of(MR) && NC.is_multiple_of(NR));

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

/// Buffers of packed operands kept per thread (at most [`KEPT`] values each), so each GEMM does not fault in fresh
/// pages: a packed operand takes one and gives it back when dropped.
mod scratch {
    use std::cell::RefCell;

    /// The largest buffer kept (values).
    pub const KEPT: usize = 1 << 24;

    thread_local! {
        static FREE: RefCell<Vec<Vec<u32>>> = const { RefCell::new(Vec::new()) };
    }

    /// A zeroed buffer of `len` values.
    pub fn take(len: usize) -> Vec<u32> {
        let mut buffer = FREE
            .with(|free| {
                let mut free = free.borrow_mut();
                let best = (0..free.len()).max_by_key(|&i| free[i].capacity().min(len))?;
                Some(free.swap_remove(best))
            })
            .unwrap_or_default();
        buffer.clear();
        buffer.resize(len, 0);
        buffer
    }

    /// Keeps `buffer` for a later [`take`] on this thread (four at most, none beyond [`KEPT`] values).
    pub fn give(buffer: Vec<u32>) {
        if buffer.capacity() <= KEPT {
            let _ = FREE.try_with(|free| {
                let mut free = free.borrow_mut();
                if free.len() < 4 {
                    free.push(buffer);
                }
            });
        }
    }
}

/// The left operand (`m × k`), as bf16 pairs along the depth in panels of [`MR`] rows: panel `i`'s pair `p` of
/// row `r` at `(i · pairs + p) · MR + r`, the pair's low half the even depth.
pub struct PackedLhs {
    rows: usize,
    depth: usize,
    pairs: usize,
    data: Vec<u32>,
}

/// The right operand (`k × n`), as bf16 pairs along the depth in panels of [`NR`] columns: panel `j`'s pair `p`
/// of column `c` at `(j · pairs + p) · NR + c`.
pub struct PackedRhs {
    cols: usize,
    depth: usize,
    pairs: usize,
    data: Vec<u32>,
}

impl Drop for PackedLhs {
    fn drop(&mut self) {
        scratch::give(std::mem::take(&mut self.data));
    }
}

impl Drop for PackedRhs {
    fn drop(&mut self) {
        scratch::give(std::mem::take(&mut self.data));
    }
}

/// The bf16 pair of depths `2p` (low half) and `2p + 1` of row or column `i`; the depth beyond `depth` is zero.
#[inline(always)]
fn pair(value: &impl Fn(usize, usize) -> u16, i: usize, p: usize, depth: usize) -> u32 {
    let lo = u32::from(value(i, 2 * p));
    let hi = if 2 * p + 1 < depth {
        u32::from(value(i, 2 * p + 1))
    } else {
        0
    };
    lo | hi << 16
}

/// Packs the `rows × depth` left operand whose element `(r, d)` has the bf16 bits `value(r, d)`.
pub fn pack_lhs(
    rows: usize,
    depth: usize,
    value: impl Fn(usize, usize) -> u16 + Sync,
) -> PackedLhs {
    let pairs = depth.div_ceil(2);
    let mut data = scratch::take(rows.div_ceil(MR) * pairs * MR);
    data.par_chunks_mut((pairs * MR).max(1))
        .enumerate()
        .for_each(|(i, panel)| {
            let panel_rows = MR.min(rows - i * MR);
            for (p, slot) in panel.chunks_exact_mut(MR).enumerate() {
                for (r, out) in slot[..panel_rows].iter_mut().enumerate() {
                    *out = pair(&value, i * MR + r, p, depth);
                }
            }
        });
    PackedLhs {
        rows,
        depth,
        pairs,
        data,
    }
}

/// Packs the `depth × cols` right operand whose element `(d, c)` has the bf16 bits `value(d, c)`.
pub fn pack_rhs(
    depth: usize,
    cols: usize,
    value: impl Fn(usize, usize) -> u16 + Sync,
) -> PackedRhs {
    let pairs = depth.div_ceil(2);
    let mut data = scratch::take(cols.div_ceil(NR) * pairs * NR);
    let transposed = |c: usize, d: usize| value(d, c);
    data.par_chunks_mut((pairs * NR).max(1))
        .enumerate()
        .for_each(|(j, panel)| {
            let panel_cols = NR.min(cols - j * NR);
            for (p, slot) in panel.chunks_exact_mut(NR).enumerate() {
                for (c, out) in slot[..panel_cols].iter_mut().enumerate() {
                    *out = pair(&transposed, j * NR + c, p, depth);
                }
            }
        });
    PackedRhs {
        cols,
        depth,
        pairs,
        data,
    }
}

/// The output's rows, columns and depth of `lhs · rhs`; an error when the depths differ.
fn dims(lhs: &PackedLhs, rhs: &PackedRhs) -> Result<(usize, usize, usize), String> {
    if lhs.depth != rhs.depth {
        return Err(format!(
            "bf16 GEMM: the left operand's depth {} differs from the right's {}",
            lhs.depth, rhs.depth
        ));
    }
    Ok((lhs.rows, rhs.cols, lhs.depth))
}

/// A pointer to the output shared by tasks that write disjoint tiles of it.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: each task writes only its own tile (disjoint rows × columns) of the output.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The pointer (a method, so that closures capture the `Send` wrapper, not its field).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `out = alpha · lhs · rhs` (`out` row-major `m × n`, overwritten) on AVX512-BF16. An error when the CPU has no
/// AVX512-BF16 ([`HostGemmPath::available`] tells), the depths differ or `out` does not hold `m × n` values.
pub fn gemm(lhs: &PackedLhs, rhs: &PackedRhs, alpha: f32, out: &mut [f32]) -> Result<(), String> {
    let (m, n, _) = dims(lhs, rhs)?;
    if out.len() != m * n {
        return Err(format!(
            "bf16 GEMM: the output holds {} values, not {m} × {n}",
            out.len()
        ));
    }
    if !avx512_bf16() {
        return Err("bf16 GEMM: this CPU has no AVX512-BF16".into());
    }
    out.fill(0.0);
    if m == 0 || n == 0 {
        return Ok(());
    }
    let tasks: Vec<(usize, usize)> = (0..m.div_ceil(MC))
        .flat_map(|i| (0..n.div_ceil(NC)).map(move |j| (i * MC, j * NC)))
        .collect();
    let base = Out(out.as_mut_ptr());
    let run = |&(row0, col0): &(usize, usize)| {
        // SAFETY: AVX512-BF16 is present (checked above); the task's tile lies inside `out` and no other task
        // writes it.
        unsafe { task(lhs, rhs, alpha, base.get(), n, row0, col0) };
    };
    if m * n * lhs.depth < 64 * 64 * 64 {
        tasks.iter().for_each(run);
    } else {
        tasks.par_iter().for_each(run);
    }
    Ok(())
}

/// The output tile `[row0, row0 + MC) × [col0, col0 + NC)` (clipped to the output), over the whole depth.
///
/// # Safety
/// The CPU has AVX512-BF16; `out` is the row-major `m × n` output with `n` columns, and no other thread writes
/// this tile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn task(
    lhs: &PackedLhs,
    rhs: &PackedRhs,
    alpha: f32,
    out: *mut f32,
    n: usize,
    row0: usize,
    col0: usize,
) {
    let m = lhs.rows;
    let rows = MC.min(m - row0);
    let cols = NC.min(n - col0);
    let mut tile = [0f32; MR * NR];
    for p0 in (0..lhs.pairs).step_by(KC) {
        let kc = KC.min(lhs.pairs - p0);
        for c0 in (0..cols).step_by(NR) {
            let panel = (col0 + c0) / NR;
            let b = &rhs.data[(panel * rhs.pairs + p0) * NR..][..kc * NR];
            for r0 in (0..rows).step_by(MR) {
                let panel = (row0 + r0) / MR;
                let a = &lhs.data[(panel * lhs.pairs + p0) * MR..][..kc * MR];
                // SAFETY: `a` holds `kc` pairs of MR rows, `b` `kc` pairs of NR columns.
                unsafe { micro_kernel(a.as_ptr(), b.as_ptr(), kc, &mut tile) };
                let (tile_rows, tile_cols) = (MR.min(rows - r0), NR.min(cols - c0));
                for r in 0..tile_rows {
                    // SAFETY: row `row0 + r0 + r` < m and columns `col0 + c0 ..+ tile_cols` < n.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(
                            out.add((row0 + r0 + r) * n + col0 + c0),
                            tile_cols,
                        )
                    };
                    for (d, s) in dst.iter_mut().zip(&tile[r * NR..r * NR + tile_cols]) {
                        *d += s;
                    }
                }
            }
        }
    }
    if alpha != 1.0 {
        for r in 0..rows {
            // SAFETY: as above.
            let dst =
                unsafe { std::slice::from_raw_parts_mut(out.add((row0 + r) * n + col0), cols) };
            dst.iter_mut().for_each(|d| *d *= alpha);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn task(
    _lhs: &PackedLhs,
    _rhs: &PackedRhs,
    _alpha: f32,
    _out: *mut f32,
    _n: usize,
    _row0: usize,
    _col0: usize,
) {
    unreachable!("the bf16 GEMM runs only where AVX512-BF16 was detected")
}

/// `tile = a · b` for one MR × NR tile over `kc` depth pairs: `a` the panel's `kc × MR` pairs, `b` the panel's
/// `kc × NR` pairs.
///
/// # Safety
/// The CPU has AVX512-BF16; `a` holds `kc · MR` pairs and `b` `kc · NR`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn micro_kernel(a: *const u32, b: *const u32, kc: usize, tile: &mut [f32; MR * NR]) {
    use std::arch::x86_64::*;
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
    for (r, row) in tile.chunks_exact_mut(NR).enumerate() {
        // SAFETY: `row` holds NR = 32 f32.
        unsafe {
            _mm512_storeu_ps(row.as_mut_ptr(), acc[2 * r]);
            _mm512_storeu_ps(row.as_mut_ptr().add(16), acc[2 * r + 1]);
        }
    }
}
