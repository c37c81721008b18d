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

    /// A buffer of `len` values, not cleared: the packing writes every value. A kept one where one is large
    /// enough, else a fresh one (in huge pages where the OS grants them: [`super::advise_huge_pages`]).
    pub fn take(len: usize) -> Vec<u32> {
        let kept = FREE.with(|free| {
            let mut free = free.borrow_mut();
            // The smallest that fits, so the large ones stay for large operands.
            let fits = (0..free.len())
                .filter(|&i| free[i].capacity() >= len)
                .min_by_key(|&i| free[i].capacity())?;
            Some(free.swap_remove(fits))
        });
        let mut buffer = kept.unwrap_or_else(|| {
            let fresh = vec![0; len];
            super::advise_huge_pages(&fresh);
            fresh
        });
        buffer.truncate(len);
        buffer.resize(len, 0);
        buffer
    }

    /// Keeps `buffer` for a later [`take`] on this thread (none beyond [`KEPT`] values; four at most, a larger one
    /// replacing the smallest).
    pub fn give(buffer: Vec<u32>) {
        if buffer.capacity() > KEPT {
            return;
        }
        let _ = FREE.try_with(|free| {
            let mut free = free.borrow_mut();
            if free.len() < 4 {
                free.push(buffer);
            } else if let Some(smallest) = (0..free.len()).min_by_key(|&i| free[i].capacity())
                && free[smallest].capacity() < buffer.capacity()
            {
                free[smallest] = buffer;
            }
        });
    }
}

/// Asks the OS to back `buffer`'s pages with huge pages (Linux's `madvise(MADV_HUGEPAGE)`) when it spans at least
/// 4 MiB, so that a large fresh buffer faults in 2 MiB at a time instead of 4 KiB (the largest shape of
/// `benches/host_gemm.rs` spent ~60 ms of 264 in page faults). Call it on a fresh `vec![0; n]` before anything
/// writes it: the allocator maps large zeroed buffers untouched. A hint: where the OS declines (transparent huge
/// pages off) or the pages are already in, nothing changes.
pub fn advise_huge_pages<T>(buffer: &[T]) {
    let bytes = std::mem::size_of_val(buffer);
    #[cfg(target_os = "linux")]
    if bytes >= 4 << 20 {
        const PAGE: usize = 4096;
        let first = buffer.as_ptr() as usize;
        let (start, end) = (first.next_multiple_of(PAGE), (first + bytes) / PAGE * PAGE);
        if end > start {
            // SAFETY: whole pages inside the buffer's allocation; the advice changes how they are backed, never
            // their contents.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
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

/// A stored matrix as the GEMM reads it: element `(i, j)` is stored at `offset + i · strides.0 + j · strides.1`
/// of `elements` (a transposed or batched matrix is a choice of offset and strides).
#[derive(Clone, Copy)]
pub struct Source<'a> {
    /// The stored elements.
    pub elements: Elements<'a>,
    /// Where element `(0, 0)` is.
    pub offset: usize,
    /// The steps between consecutive rows and columns.
    pub strides: (usize, usize),
}

/// Stored elements and their bf16 bits.
#[derive(Clone, Copy)]
pub enum Elements<'a> {
    /// One code per byte, and each code's bf16 bits.
    Codes(&'a [u8], &'a [u16; 256]),
    /// bf16 bits.
    Bits(&'a [u16]),
}

impl Elements<'_> {
    fn len(&self) -> usize {
        match self {
            Elements::Codes(codes, _) => codes.len(),
            Elements::Bits(bits) => bits.len(),
        }
    }
}

/// Packs the `rows × depth` left operand read from `source`.
pub fn pack_lhs(rows: usize, depth: usize, source: &Source<'_>) -> Result<PackedLhs, String> {
    let (row_stride, depth_stride) = source.strides;
    let data = pack(MR, rows, depth, source, row_stride, depth_stride)?;
    Ok(PackedLhs {
        rows,
        depth,
        pairs: depth.div_ceil(2),
        data,
    })
}

/// Packs the `depth × cols` right operand read from `source`.
pub fn pack_rhs(depth: usize, cols: usize, source: &Source<'_>) -> Result<PackedRhs, String> {
    let (depth_stride, col_stride) = source.strides;
    let data = pack(NR, cols, depth, source, col_stride, depth_stride)?;
    Ok(PackedRhs {
        cols,
        depth,
        pairs: depth.div_ceil(2),
        data,
    })
}

/// `lanes` rows (or columns) of `depth` elements each, as bf16 pairs along the depth in panels of `width` lanes
/// (lane `first + l` of panel `first / width` at `(panel · pairs + p) · width + l`); lanes past the end and the
/// depth past an odd end are zero. Lane `l`'s depth `d` is stored at `offset + l · lane_stride + d · depth_stride`.
fn pack(
    width: usize,
    lanes: usize,
    depth: usize,
    source: &Source<'_>,
    lane_stride: usize,
    depth_stride: usize,
) -> Result<Vec<u32>, String> {
    let pairs = depth.div_ceil(2);
    if lanes > 0 && depth > 0 {
        let last = source.offset + (lanes - 1) * lane_stride + (depth - 1) * depth_stride;
        if last >= source.elements.len() {
            return Err(format!(
                "bf16 GEMM: an operand of {lanes} × {depth} reads element {last} of {} stored",
                source.elements.len()
            ));
        }
    }
    let mut data = scratch::take(lanes.div_ceil(width) * pairs * width);
    data.par_chunks_mut((pairs * width).max(1))
        .enumerate()
        .for_each(|(i, panel)| {
            let lines = Lines {
                width,
                count: width.min(lanes - i * width),
                depth,
                base: source.offset + i * width * lane_stride,
                lane_stride,
                depth_stride,
            };
            match source.elements {
                Elements::Codes(codes, table) => lines.pack(panel, codes, |c| table[c as usize]),
                Elements::Bits(bits) => lines.pack(panel, bits, |b| b),
            }
        });
    Ok(data)
}

/// One panel's lanes in the stored elements.
struct Lines {
    width: usize,
    count: usize,
    depth: usize,
    base: usize,
    lane_stride: usize,
    depth_stride: usize,
}

impl Lines {
    /// Writes every pair of `panel`, reading the elements from `data` through `bits`.
    #[inline(always)]
    fn pack<E: Copy>(&self, panel: &mut [u32], data: &[E], bits: impl Fn(E) -> u16) {
        let Lines {
            width,
            count,
            depth,
            base,
            lane_stride,
            depth_stride,
        } = *self;
        let pairs = depth.div_ceil(2);
        let one = |lo: E| u32::from(bits(lo));
        let two = |lo: E, hi: E| one(lo) | u32::from(bits(hi)) << 16;
        if depth_stride == 1 {
            // Each lane's depth is contiguous (a row-major left operand, a transposed right one).
            for l in 0..count {
                let line = &data[base + l * lane_stride..][..depth];
                let mut twos = line.chunks_exact(2);
                for (p, t) in (&mut twos).enumerate() {
                    panel[p * width + l] = two(t[0], t[1]);
                }
                if let [last] = twos.remainder() {
                    panel[(pairs - 1) * width + l] = one(*last);
                }
            }
        } else if lane_stride == 1 {
            // The lanes are contiguous at each depth (a row-major right operand, a transposed left one).
            for p in 0..pairs {
                let slot = &mut panel[p * width..][..count];
                let lo = &data[base + 2 * p * depth_stride..][..count];
                if 2 * p + 1 < depth {
                    let hi = &data[base + (2 * p + 1) * depth_stride..][..count];
                    for ((o, &a), &b) in slot.iter_mut().zip(lo).zip(hi) {
                        *o = two(a, b);
                    }
                } else {
                    for (o, &a) in slot.iter_mut().zip(lo) {
                        *o = one(a);
                    }
                }
            }
        } else {
            for l in 0..count {
                for p in 0..pairs {
                    let at = base + l * lane_stride + 2 * p * depth_stride;
                    panel[p * width + l] = if 2 * p + 1 < depth {
                        two(data[at], data[at + depth_stride])
                    } else {
                        one(data[at])
                    };
                }
            }
        }
        if count < width {
            for slot in panel.chunks_exact_mut(width) {
                slot[count..].fill(0);
            }
        }
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
    if m == 0 || n == 0 || lhs.pairs == 0 {
        out.fill(0.0);
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
        let last = p0 + kc == lhs.pairs;
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
                    let sums = &tile[r * NR..r * NR + tile_cols];
                    // The first depth block writes the output, later ones add to it, and the last applies
                    // `alpha` to the whole sum.
                    match (p0 == 0, last) {
                        (true, false) => dst.copy_from_slice(sums),
                        (true, true) => dst.iter_mut().zip(sums).for_each(|(d, s)| *d = s * alpha),
                        (false, false) => dst.iter_mut().zip(sums).for_each(|(d, s)| *d += s),
                        (false, true) => dst
                            .iter_mut()
                            .zip(sums)
                            .for_each(|(d, s)| *d = (*d + s) * alpha),
                    }
                }
            }
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
