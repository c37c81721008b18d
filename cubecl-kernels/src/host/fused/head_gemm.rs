//! The attention core's small f32 GEMMs (one head's block of query rows against its keys, `ROWS × keys ×
//! head_dim` and the like), on one thread: the right operand packed into panels of [`NR`] columns
//! ([`PackedRhs`]), then a few rows at a time against each panel with the sums in registers. Each output element
//! is one f32 sum over the depth in order, whatever the block it falls in.
//!
//! A general GEMM library packs both operands on every call, which at these sizes (a few hundred thousand
//! multiply-adds) costs as much as the products; here the left operand is read where it lies, one broadcast per
//! row and depth, and a right operand that several GEMMs read (a head's keys and values, for each block of its
//! queries) is packed once: a GEMM reads a leading part of it (its first rows and columns).

use multiversion::target::target_cfg_f;

/// Columns per panel: two 512-bit registers of f32, four 256-bit ones.
pub const NR: usize = 32;

/// Rows per block on AVX-512: six rows of [`NR`] sums in 12 of its 32 registers, enough independent sums to keep
/// both FMA units busy through their latency (one row of 16 columns per register, six in all, left a quarter of
/// the rate to the latency and ran at about 27 % of the FMA peak). Eight rows (a divisor of the attention core's
/// 64-row blocks of queries) took 9 % more of the FP8 step's samples than six with the tail rows in blocks of 4,
/// 2 and 1 (Zen 5, 2026-12-06).
const MR_AVX512: usize = 6;

/// Rows per block elsewhere (AVX2, other CPUs): three rows of [`NR`] sums in 12 of AVX2's 16 registers.
const MR_NARROW: usize = 3;

/// A matrix of f32 at (row, column) strides from `ptr`.
#[derive(Clone, Copy, Debug)]
pub struct Strided {
    pub ptr: *const f32,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl Strided {
    /// The element at (`row`, `col`).
    ///
    /// # Safety
    /// The element lies in the matrix's allocation.
    #[inline(always)]
    unsafe fn at(self, row: usize, col: usize) -> f32 {
        // SAFETY: the caller's contract.
        unsafe { *self.ptr.add(row * self.row_stride + col * self.col_stride) }
    }
}

/// A `depth × cols` right operand packed for [`packed_gemm`]: `cols.div_ceil(NR)` panels of `depth × NR` values
/// (the last one's missing columns zero). A GEMM may read any leading `k × n` part of it.
#[derive(Debug, Default)]
pub struct PackedRhs {
    values: Vec<f32>,
    depth: usize,
    cols: usize,
}

impl PackedRhs {
    /// Packs `rhs` (`depth × cols`) into this buffer, whose allocation is reused.
    ///
    /// # Safety
    /// Every element of the `depth × cols` matrix lies in its allocation.
    pub unsafe fn pack(&mut self, (depth, cols): (usize, usize), rhs: Strided) {
        let panel = depth * NR;
        self.values.clear();
        self.values.resize(cols.div_ceil(NR) * panel, 0.0);
        (self.depth, self.cols) = (depth, cols);
        if panel == 0 {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        let avx512 = std::arch::is_x86_feature_detected!("avx512f");
        for (j, panel) in self.values.chunks_exact_mut(panel).enumerate() {
            let width = NR.min(cols - j * NR);
            if rhs.row_stride == 1 {
                // The depth is contiguous (a transposed operand: a head's keys as kᵀ).
                #[cfg(target_arch = "x86_64")]
                if avx512 {
                    // SAFETY: AVX-512F (checked above); the columns' depths lie in the operand.
                    unsafe {
                        down_panel(
                            panel,
                            rhs.ptr.add(j * NR * rhs.col_stride),
                            rhs.col_stride,
                            width,
                        )
                    };
                    continue;
                }
                // Elsewhere each column's run of depths read in order and written down the panel, rather than one
                // element of each run per slot.
                for c in 0..width {
                    // SAFETY: column j·NR + c's `depth` elements, one apart, are inside the operand.
                    let run = unsafe {
                        std::slice::from_raw_parts(
                            rhs.ptr.add((j * NR + c) * rhs.col_stride),
                            depth,
                        )
                    };
                    for (row, &value) in panel.chunks_exact_mut(NR).zip(run) {
                        row[c] = value;
                    }
                }
                continue;
            }
            for (p, row) in panel.chunks_exact_mut(NR).enumerate() {
                if rhs.col_stride == 1 {
                    // SAFETY: depth p's columns j·NR .. + width, one apart, are inside the operand.
                    let run = unsafe {
                        std::slice::from_raw_parts(rhs.ptr.add(p * rhs.row_stride + j * NR), width)
                    };
                    row[..width].copy_from_slice(run);
                    continue;
                }
                for (c, slot) in row[..width].iter_mut().enumerate() {
                    // SAFETY: (p, j·NR + c) is inside the depth × cols operand.
                    *slot = unsafe { rhs.at(p, j * NR + c) };
                }
            }
        }
    }
}

/// `width ≤ NR` columns whose depths are contiguous (column `c`'s depth `p` at `first + c · col_stride + p`)
/// written down `panel` (`depth × NR` values, depth `p` of column `c` at `panel[p · NR + c]`, the columns past
/// `width` left as they are), 16 columns × 16 depths at a time transposed in registers. The element-wise copy
/// it replaces on AVX-512 wrote one value per instruction: 1.2 % of the FP8 step's samples on Zen 5, against
/// 0.8 % now.
///
/// # Safety
/// AVX-512F; every column's `depth` values lie in the operand.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn down_panel(panel: &mut [f32], first: *const f32, col_stride: usize, width: usize) {
    use crate::host::gemm::pack_vbmi::{lanes, transpose16};
    use std::arch::x86_64::*;
    let depth = panel.len() / NR;
    for c0 in (0..width).step_by(16) {
        let stored = (width - c0).min(16);
        for p0 in (0..depth).step_by(16) {
            let count = (depth - p0).min(16);
            let depths = lanes(count);
            let rows: [__m512i; 16] = std::array::from_fn(|c| {
                if c < stored {
                    // SAFETY: depths p0 ..+count of column c0 + c < width lie in the operand; the masked-out
                    // lanes are not read.
                    unsafe {
                        _mm512_maskz_loadu_epi32(
                            depths,
                            first.add((c0 + c) * col_stride + p0).cast(),
                        )
                    }
                } else {
                    _mm512_setzero_si512()
                }
            });
            let columns = transpose16(rows);
            for (q, column) in columns.iter().enumerate().take(count) {
                // SAFETY: depth p0 + q < depth, columns c0 ..+stored (≤ width ≤ NR) of its panel row.
                unsafe {
                    let at = panel.as_mut_ptr().add((p0 + q) * NR + c0);
                    _mm512_mask_storeu_epi32(at.cast(), lanes(stored), *column);
                }
            }
        }
    }
}

/// `dst (m × n) = [dst +] beta · lhs (m × k) · rhs (k × n)`, `dst` at (`dst.1`, `dst.2`) strides; `panels` is
/// scratch for the packed right operand (kept by the caller across calls).
///
/// # Safety
/// Every element of the three matrices lies in its allocation; `dst` overlaps neither operand.
#[allow(clippy::too_many_arguments)]
pub unsafe fn head_gemm(
    (m, n, k): (usize, usize, usize),
    dst: (*mut f32, usize, usize),
    accumulate: bool,
    lhs: Strided,
    rhs: Strided,
    beta: f32,
    panels: &mut PackedRhs,
) {
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: the caller's contract.
    unsafe {
        panels.pack((k, n), rhs);
        packed_gemm((m, n, k), dst, accumulate, lhs, panels, beta);
    }
}

/// [`head_gemm`] against the leading `k × n` part of a packed right operand.
///
/// # Panics
/// Where `k` or `n` exceeds the packed operand's depth or columns.
///
/// # Safety
/// Every element of `lhs` (`m × k`) and `dst` (`m × n`) lies in its allocation; `dst` does not overlap `lhs`.
pub unsafe fn packed_gemm(
    (m, n, k): (usize, usize, usize),
    dst: (*mut f32, usize, usize),
    accumulate: bool,
    lhs: Strided,
    rhs: &PackedRhs,
    beta: f32,
) {
    assert!(
        k <= rhs.depth && n <= rhs.cols,
        "a {k} × {n} GEMM operand read from a packed {} × {}",
        rhs.depth,
        rhs.cols
    );
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: the caller's contract; the panels hold depth × NR ≥ k × NR values each, n.div_ceil(NR) of them.
    unsafe {
        blocks(
            (m, n, k),
            dst,
            accumulate,
            lhs,
            &rhs.values,
            rhs.depth * NR,
            beta,
        )
    }
}

/// Every block of rows (six on AVX-512, three elsewhere) against the first `n.div_ceil(NR)` panels (`panel_len`
/// values apart), each read to depth `k`.
///
/// # Safety
/// As [`head_gemm`]; `panels` holds `n.div_ceil(NR)` panels of `panel_len ≥ k × NR` values.
#[allow(clippy::too_many_arguments)]
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
unsafe fn blocks(
    (m, n, k): (usize, usize, usize),
    dst: (*mut f32, usize, usize),
    accumulate: bool,
    lhs: Strided,
    panels: &[f32],
    panel_len: usize,
    beta: f32,
) {
    // A fused multiply-add where the clone has one; elsewhere (x86-64 without FMA) a product and an add, as
    // `f32::mul_add` would be a call to libm's software `fmaf` per element.
    let fused = cfg!(not(target_arch = "x86_64")) || target_cfg_f!(target_feature = "fma");
    let wide = target_cfg_f!(target_feature = "avx512f");
    let width = n.div_ceil(NR);
    for (j, panel) in panels
        .chunks_exact(panel_len.max(1))
        .take(width)
        .enumerate()
    {
        let panel = &panel[..k * NR];
        let cols = (j * NR, NR.min(n - j * NR));
        if wide {
            // SAFETY: the function's contract.
            unsafe { panel_rows::<MR_AVX512>((m, cols), dst, accumulate, lhs, panel, beta, fused) }
        } else {
            // SAFETY: the function's contract.
            unsafe { panel_rows::<MR_NARROW>((m, cols), dst, accumulate, lhs, panel, beta, fused) }
        }
    }
}

/// Every block of `MR` rows of the `m`-row output against one panel (`k × NR` values), written to the panel's
/// columns `cols` (first, count) of `dst`; the last `m mod MR` rows in blocks of 4, 2 and 1 (those below `MR`).
///
/// # Safety
/// As [`blocks`]; the panel's columns lie in the output.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn panel_rows<const MR: usize>(
    (m, cols): (usize, (usize, usize)),
    dst: (*mut f32, usize, usize),
    accumulate: bool,
    lhs: Strided,
    panel: &[f32],
    beta: f32,
    fused: bool,
) {
    let full = m - m % MR;
    let write = Write {
        dst,
        cols,
        accumulate,
        beta,
    };
    for r0 in (0..full).step_by(MR) {
        // SAFETY: rows r0..r0 + MR of both matrices exist (the caller's contract).
        unsafe { write.rows::<MR>(r0, row_block::<MR>(lhs, r0, panel, fused)) };
    }
    let mut r0 = full;
    for size in [4, 2, 1] {
        if size < MR && m - r0 >= size {
            // SAFETY: rows r0..r0 + size of both matrices exist (the caller's contract).
            unsafe {
                match size {
                    4 => write.rows::<4>(r0, row_block::<4>(lhs, r0, panel, fused)),
                    2 => write.rows::<2>(r0, row_block::<2>(lhs, r0, panel, fused)),
                    _ => write.rows::<1>(r0, row_block::<1>(lhs, r0, panel, fused)),
                }
            }
            r0 += size;
        }
    }
}

/// Where a panel's sums go: columns `cols` (first, count) of `dst` (pointer, row stride, column stride), as
/// `beta · sum`, or added to what is there where `accumulate`.
#[derive(Clone, Copy)]
struct Write {
    dst: (*mut f32, usize, usize),
    cols: (usize, usize),
    accumulate: bool,
    beta: f32,
}

impl Write {
    /// Rows `r0..r0 + R` of the output from `sums`.
    ///
    /// # Safety
    /// The rows' `cols` lie in the output.
    #[inline(always)]
    unsafe fn rows<const R: usize>(self, r0: usize, sums: [[f32; NR]; R]) {
        let (out, row_stride, col_stride) = self.dst;
        let (c0, cols) = self.cols;
        let beta = self.beta;
        for (r, sum) in sums.iter().enumerate() {
            let row = out.wrapping_add((r0 + r) * row_stride + c0 * col_stride);
            if col_stride == 1 {
                // SAFETY: (r0 + r, c0 .. c0 + cols) is inside the output, a contiguous run here. (A run of a
                // length known only here: LLVM writes a run of the constant `NR` one element at a time.)
                let row = unsafe { std::slice::from_raw_parts_mut(row, cols) };
                if self.accumulate {
                    row.iter_mut().zip(sum).for_each(|(d, &s)| *d += beta * s);
                } else {
                    row.iter_mut().zip(sum).for_each(|(d, &s)| *d = beta * s);
                }
                continue;
            }
            for (c, &s) in sum[..cols].iter().enumerate() {
                // SAFETY: (r0 + r, c0 + c) is inside the output.
                unsafe {
                    let d = row.add(c * col_stride);
                    *d = if self.accumulate {
                        *d + beta * s
                    } else {
                        beta * s
                    };
                }
            }
        }
    }
}

/// The sums of `R` rows from `r0` against one panel (`k × NR` values), each in depth order: each product added with
/// one rounding where `fused` (a constant in each clone, inlined), two otherwise.
///
/// # Safety
/// Rows `r0..r0 + R` of the left operand lie in its allocation, `k` (the panel's depth) columns each.
#[inline(always)]
unsafe fn row_block<const R: usize>(
    lhs: Strided,
    r0: usize,
    panel: &[f32],
    fused: bool,
) -> [[f32; NR]; R] {
    let mut sums = [[0.0f32; NR]; R];
    for (p, b) in panel.chunks_exact(NR).enumerate() {
        let b: &[f32; NR] = b.try_into().expect("a panel row holds NR values");
        for (r, sum) in sums.iter_mut().enumerate() {
            // SAFETY: the caller's contract.
            let a = unsafe { lhs.at(r0 + r, p) };
            for l in 0..NR {
                sum[l] = if fused {
                    a.mul_add(b[l], sum[l])
                } else {
                    sum[l] + a * b[l]
                };
            }
        }
    }
    sums
}
