//! The host FP8 GEMM on the CPU's bf16 dot-product units (AVX512-BF16's `vdpbf16ps`): bf16 × bf16 products
//! accumulated in f32, which is exactly TE's FP8 GEMM (FP8 operands, f32 accumulation), because every FP8 value is
//! a bf16 value.
//!
//! - Every E4M3 and E5M2 value is a bf16 value (3 and 2 mantissa bits, exponents well inside bf16's), and so is an
//!   E2M1 value times an E4M3 block scale (at most 5 significant bits) and an FP8 value times a power of two inside
//!   bf16's normal range. The callers fold such block scales into the elements and apply the rest (per-tensor
//!   scales, NVFP4's global scales) to the f32 output as one factor `alpha`.
//! - [`pack_lhs`] and [`pack_rhs`] turn the operands' values into bf16 pairs along the depth, laid out as the
//!   micro-kernel reads them, and refuse a value that is not exactly a bf16 normal number (or zero, inf, NaN):
//!   `vdpbf16ps` flushes bf16 subnormals to zero, so those would not be exact.
//! - [`gemm`] multiplies them: 12 × 32 output tiles held in 24 registers, the depth in blocks that keep a panel of
//!   the right operand in the L1 cache, the output's tiles split across rayon's threads.
//!
//! The products of two bf16 values are exact in f32 and each is added to the f32 accumulator with rounding to
//! nearest, so the result differs from an exact sum by at most `γ_k · Σ|a·b|` with `γ_k = k·u / (1 − k·u)`,
//! `u = 2⁻²⁴` (the usual bound of a recursive f32 sum of `k` terms), plus one rounding of `alpha`'s product.
//! Output values below f32's normal range are flushed to zero by the instruction (as with the DAZ/FTZ modes).
//!
//! AMX-BF16 (`tdpbf16ps` on tiles) is not built yet: this machine's CPUs have none to test it on.

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
/// Depth pairs per block: a right panel of `KC × NR` pairs (24 KiB) stays in the L1 cache.
const KC: usize = 192;
/// Rows of the output per task.
const MC: usize = 96;
/// Columns of the output per task.
const NC: usize = 256;

/// Why an operand cannot go to the bf16 path.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NotBf16 {
    /// The first value that is not exactly a bf16 normal number (or zero, inf, NaN).
    pub value: f32,
}

impl std::fmt::Display for NotBf16 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:e} is not exactly a bf16 normal number (a block scale outside bf16's range?)",
            self.value
        )
    }
}

/// The bf16 bits of `x` when `x` is exactly a bf16 zero, normal number or infinity; a NaN gives bf16's quiet NaN.
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

/// The left operand (`m × k`), as bf16 pairs along the depth: row `r`'s pair `p` holds columns `2p` (low half)
/// and `2p + 1`, rows padded to a multiple of the tile's.
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

fn pair(lo: f32, hi: f32) -> Result<u32, NotBf16> {
    let lo_bits = exact_bf16(lo).ok_or(NotBf16 { value: lo })?;
    let hi_bits = exact_bf16(hi).ok_or(NotBf16 { value: hi })?;
    Ok(u32::from(lo_bits) | u32::from(hi_bits) << 16)
}

/// Packs the `rows × depth` left operand whose element `(r, d)` is `value(r, d)`.
pub fn pack_lhs(
    rows: usize,
    depth: usize,
    value: impl Fn(usize, usize) -> f32 + Sync,
) -> Result<PackedLhs, NotBf16> {
    let pairs = depth.div_ceil(2);
    let padded = rows.div_ceil(MR) * MR;
    let mut data = vec![0u32; padded * pairs];
    let at = |r: usize, d: usize| if d < depth { value(r, d) } else { 0.0 };
    data.par_chunks_mut(pairs.max(1))
        .take(rows)
        .enumerate()
        .try_for_each(|(r, row)| {
            for (p, slot) in row.iter_mut().enumerate() {
                *slot = pair(at(r, 2 * p), at(r, 2 * p + 1))?;
            }
            Ok(())
        })?;
    Ok(PackedLhs {
        rows,
        depth,
        pairs,
        data,
    })
}

/// Packs the `depth × cols` right operand whose element `(d, c)` is `value(d, c)`.
pub fn pack_rhs(
    depth: usize,
    cols: usize,
    value: impl Fn(usize, usize) -> f32 + Sync,
) -> Result<PackedRhs, NotBf16> {
    let pairs = depth.div_ceil(2);
    let panels = cols.div_ceil(NR);
    let mut data = vec![0u32; panels * pairs * NR];
    let at = |d: usize, c: usize| {
        if d < depth && c < cols {
            value(d, c)
        } else {
            0.0
        }
    };
    data.par_chunks_mut((pairs * NR).max(1))
        .enumerate()
        .try_for_each(|(j, panel)| {
            for p in 0..pairs {
                for c in 0..NR {
                    let col = j * NR + c;
                    panel[p * NR + c] = pair(at(2 * p, col), at(2 * p + 1, col))?;
                }
            }
            Ok(())
        })?;
    Ok(PackedRhs {
        cols,
        depth,
        pairs,
        data,
    })
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

/// `out = alpha · lhs · rhs` (`out` row-major `m × n`, overwritten) on AVX512-BF16. Panics when the CPU has no
/// AVX512-BF16 ([`HostGemmPath::available`] tells) or when `out` does not hold `m × n` values.
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
        let base = base;
        // SAFETY: AVX512-BF16 is present (checked above); the task's tile lies inside `out` and no other task
        // writes it.
        unsafe { task(lhs, rhs, alpha, base.0, n, row0, col0) };
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
                let a = &lhs.data[(row0 + r0) * lhs.pairs + p0..];
                // SAFETY: the left operand holds MR rows from `row0 + r0` (its rows are padded to MR), each with
                // `kc` pairs from `p0`; `b` holds `kc` pairs of NR columns.
                unsafe { micro_kernel(a.as_ptr(), lhs.pairs, b.as_ptr(), kc, &mut tile) };
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

/// `tile = a · b` for one MR × NR tile over `kc` depth pairs: `a` the first of MR rows `lda` pairs apart, `b` the
/// panel's `kc × NR` pairs.
///
/// # Safety
/// The CPU has AVX512-BF16; `a` holds MR rows of `kc` pairs at stride `lda`; `b` holds `kc · NR` pairs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn micro_kernel(
    a: *const u32,
    lda: usize,
    b: *const u32,
    kc: usize,
    tile: &mut [f32; MR * NR],
) {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 2 * MR];
    for p in 0..kc {
        // SAFETY: in bounds by the function's contract; bf16 pairs are 32-bit lanes of the same bits.
        unsafe {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16).cast()));
            for r in 0..MR {
                let pair = *a.add(r * lda + p) as i32;
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
