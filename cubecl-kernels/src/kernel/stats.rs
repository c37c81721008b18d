//! One-pass statistics: a single read of a tensor yields everything LogTensorStats needs, and with an FP8 format
//! and scale also the underflow/overflow counts and the squared quantization error of LogFp8TensorStats.
//!
//! Each unit walks the tensor with a grid stride and keeps a running record: counts, extremes and sums updated
//! without branches on the data, and the mean and M2 of the finite elements (relative to the tensor's first element,
//! so that a large common offset does not eat the f32 precision of the mean) from runs of `STATS_RUN` elements,
//! each summed around its own first element and folded in with Chan's parallel formula — no division per element.
//! The cube merges its units' records in shared memory (Chan's formula again) and writes one partial record of
//! [`STATS_SLOTS`] words per cube. The host merges the partials in f64 (`crate::StatsReadback`).
//!
//! The FP8 counts take one scale for the tensor, or (`blocked`) one scale per block of the tensor viewed as
//! row-major `[rows, cols]`, with the block layout of `crate::ScaleBlock`.

use cubecl::prelude::*;

use crate::kernel::code::{CodeFormat, decode, encode};
use crate::kernel::reduce::CUBE_SIZE;

/// Words per partial record.
pub const STATS_SLOTS: usize = 17;

/// Word offsets in a partial record. Counts are u32, the others f32 bits.
pub mod slot {
    /// Number of finite elements.
    pub const FINITE_COUNT: usize = 0;
    /// Mean of the finite elements.
    pub const MEAN: usize = 1;
    /// Sum of squared deviations from the mean of the finite elements.
    pub const M2: usize = 2;
    /// Sum of |x| over the finite elements.
    pub const L1: usize = 3;
    /// Smallest finite element (f32::MAX if none).
    pub const MIN: usize = 4;
    /// Largest finite element (-f32::MAX if none).
    pub const MAX: usize = 5;
    /// Bits of the smallest nonzero finite |x| (+inf bits if none).
    pub const MIN_NONZERO_ABS: usize = 6;
    /// Number of elements that are not ±0 (NaN and ±inf included).
    pub const NONZERO: usize = 7;
    /// Number of NaN elements.
    pub const NAN: usize = 8;
    /// Number of +inf elements.
    pub const POS_INF: usize = 9;
    /// Number of -inf elements.
    pub const NEG_INF: usize = 10;
    /// FP8: elements that are nonzero but quantize to ±0.
    pub const UNDERFLOW: usize = 11;
    /// FP8: elements with |x| > fp8_max * scale_inv.
    pub const OVERFLOW: usize = 12;
    /// FP8: sum over finite elements of (x - dequantize(quantize(x)))^2.
    pub const SQUARED_ERROR: usize = 13;
    /// The shift `K` subtracted before the moments: `MEAN` is the mean of `x - K`.
    pub const SHIFT: usize = 14;
    /// FP8: bits of the smallest `scale_inv` applied to an element (+inf bits if none).
    pub const SCALE_INV_MIN: usize = 15;
    /// FP8: bits of the largest `scale_inv` applied to an element (0 if none).
    pub const SCALE_INV_MAX: usize = 16;
}

const INF_BITS: u32 = 0x7f80_0000;

/// Elements per unit between two folds of the running moments.
const STATS_RUN: u32 = 32;

/// `x` if finite, else 0: a shift for the moments.
#[cube]
fn finite_or_zero(x: f32) -> f32 {
    select((u32::reinterpret(x) & 0x7fff_ffff) < INF_BITS, x, 0.0f32)
}

/// Folds a run (`n` finite elements, sums of `y = x - run_shift` and `y²`; `offset = run_shift - shift`) into a
/// running `(count, mean, m2)` of `x - shift` (Chan's parallel formula).
#[cube]
fn fold_run(
    count: &mut u32,
    mean: &mut f32,
    m2: &mut f32,
    n: u32,
    sum: f32,
    sum_sq: f32,
    offset: f32,
) {
    if n > 0 {
        let n_b = f32::cast_from(n);
        let run_mean = sum / n_b;
        let run_m2 = sum_sq - sum * run_mean;
        let run_m2 = select(run_m2 > 0.0f32, run_m2, 0.0f32);
        let mean_b = offset + run_mean;
        if *count == 0 {
            *mean = mean_b;
            *m2 = run_m2;
        } else {
            let n_a = f32::cast_from(*count);
            let total = n_a + n_b;
            let delta = mean_b - *mean;
            *mean += delta * (n_b / total);
            *m2 += run_m2 + delta * delta * (n_a * n_b / total);
        }
        *count += n;
    }
}

/// Writes one partial record per cube into `partials` (`CUBE_COUNT * STATS_SLOTS` words). With `with_fp8`, codes
/// are `encode(x * scale)` in `format` and the FP8 slots are filled; otherwise they are zero. The scale is
/// `scale[0]` (and `scale_inv = 1 / scale[0]`), or with `blocked` the element's block's `scale[b]` and
/// `scale_inv[b]`: `b` is the block of the element in the tensor viewed as `[len / cols, cols]` with
/// `block_rows × block_cols` blocks, `grid_cols` per block row (`crate::ScaleBlock::slot`).
#[cube(launch_unchecked)]
pub fn stats_kernel<F: Float>(
    input: &Array<F>,
    scale: &Array<f32>,
    scale_inv: &Array<f32>,
    partials: &mut Array<u32>,
    len: u32,
    fp8_max: f32,
    cols: u32,
    block_rows: u32,
    block_cols: u32,
    grid_cols: u32,
    #[comptime] with_fp8: bool,
    #[comptime] blocked: bool,
    #[comptime] element: CodeFormat,
) {
    let len = len as usize;
    let stride = CUBE_COUNT * comptime!(CUBE_SIZE as usize);
    let tensor_scale = scale[0];
    let tensor_scale_inv = 1.0f32 / tensor_scale;
    let shift = finite_or_zero(f32::cast_from(input[0]));

    let mut count = 0u32;
    let mut mean = 0.0f32;
    let mut m2 = 0.0f32;
    let mut l1 = 0.0f32;
    let mut min = comptime!(f32::MAX).runtime();
    let mut max = comptime!(-f32::MAX).runtime();
    let mut min_nonzero_abs = INF_BITS.runtime();
    let mut nonzero = 0u32;
    let mut nan = 0u32;
    let mut pos_inf = 0u32;
    let mut neg_inf = 0u32;
    let mut underflow = 0u32;
    let mut overflow = 0u32;
    let mut squared_error = 0.0f32;
    let mut scale_inv_min = INF_BITS.runtime();
    let mut scale_inv_max = 0u32.runtime();
    // The moments go by runs of STATS_RUN elements per unit: sums of `x - run_shift` and its square (the run's
    // first element as its shift, so the run's own spread is what is summed), folded into the unit's
    // (count, mean, m2) with Chan's formula after each run: no division per element, and no branch on the data.
    // The run is a loop of its own, so the fold is not a per-element branch either (a CPU device evaluates a
    // branch's body under a mask for every element).
    let mut index = ABSOLUTE_POS;
    while index < len {
        let run_shift = finite_or_zero(f32::cast_from(input[index]));
        let mut run_count = 0u32;
        let mut run_sum = 0.0f32;
        let mut run_sum_sq = 0.0f32;
        let mut run = 0u32;
        while run < STATS_RUN && index < len {
            let x = f32::cast_from(input[index]);
            let bits = u32::reinterpret(x);
            let abs = bits & 0x7fff_ffff;
            let finite = abs < INF_BITS;
            nonzero += u32::cast_from(abs != 0);
            nan += u32::cast_from(abs > INF_BITS);
            pos_inf += u32::cast_from(bits == INF_BITS);
            neg_inf += u32::cast_from(bits == (INF_BITS | 0x8000_0000));
            let y = select(finite, x - run_shift, 0.0f32);
            run_count += u32::cast_from(finite);
            run_sum += y;
            run_sum_sq += y * y;
            l1 += select(finite, f32::reinterpret(abs), 0.0f32);
            let low = select(finite, x, comptime!(f32::MAX));
            min = select(low < min, low, min);
            let high = select(finite, x, comptime!(-f32::MAX));
            max = select(high > max, high, max);
            // Nonzero and finite: `abs - 1` (wrapping) below `INF_BITS - 1`.
            let nonzero_abs = select(abs - 1 < INF_BITS - 1, abs, INF_BITS);
            min_nonzero_abs = select(nonzero_abs < min_nonzero_abs, nonzero_abs, min_nonzero_abs);
            if comptime!(with_fp8) {
                let mut element_scale = tensor_scale;
                let mut inv = tensor_scale_inv;
                if comptime!(blocked) {
                    let row = index as u32 / cols;
                    let col = index as u32 % cols;
                    let block = ((row / block_rows) * grid_cols + col / block_cols) as usize;
                    element_scale = scale[block];
                    inv = scale_inv[block];
                }
                // Scales are positive: their bits order as they do.
                let inv_bits = u32::reinterpret(inv);
                if inv_bits < scale_inv_min {
                    scale_inv_min = inv_bits;
                }
                if inv_bits > scale_inv_max {
                    scale_inv_max = inv_bits;
                }
                let overflow_threshold = fp8_max * inv;
                let code = encode(u32::reinterpret(x * element_scale), element);
                // Nonzero and dequantized to ±0: a ±0 code, or a block whose scale is 0 (NVFP4: an E4M3 block scale
                // that underflowed, where every code is ±6 yet dequantizes to ±0).
                if abs != 0 && ((code & comptime!(element.magnitude_mask())) == 0 || inv == 0.0f32)
                {
                    underflow += 1;
                }
                if abs <= INF_BITS {
                    if f32::reinterpret(abs) > overflow_threshold {
                        overflow += 1;
                    }
                    if abs < INF_BITS {
                        let error = x - decode(code, element) * inv;
                        squared_error += error * error;
                    }
                }
            }
            index += stride;
            run += 1;
        }
        fold_run(
            &mut count,
            &mut mean,
            &mut m2,
            run_count,
            run_sum,
            run_sum_sq,
            run_shift - shift,
        );
    }

    // Merge the units' records in shared memory.
    let unit = UNIT_POS as usize;
    let size = comptime!(CUBE_SIZE as usize);
    let mut s_count = SharedMemory::<u32>::new(size);
    let mut s_mean = SharedMemory::<f32>::new(size);
    let mut s_m2 = SharedMemory::<f32>::new(size);
    let mut s_l1 = SharedMemory::<f32>::new(size);
    let mut s_min = SharedMemory::<f32>::new(size);
    let mut s_max = SharedMemory::<f32>::new(size);
    let mut s_min_nonzero = SharedMemory::<u32>::new(size);
    let mut s_nonzero = SharedMemory::<u32>::new(size);
    let mut s_nan = SharedMemory::<u32>::new(size);
    let mut s_pos_inf = SharedMemory::<u32>::new(size);
    let mut s_neg_inf = SharedMemory::<u32>::new(size);
    s_count[unit] = count;
    s_mean[unit] = mean;
    s_m2[unit] = m2;
    s_l1[unit] = l1;
    s_min[unit] = min;
    s_max[unit] = max;
    s_min_nonzero[unit] = min_nonzero_abs;
    s_nonzero[unit] = nonzero;
    s_nan[unit] = nan;
    s_pos_inf[unit] = pos_inf;
    s_neg_inf[unit] = neg_inf;
    let mut s_underflow = SharedMemory::<u32>::new(size);
    let mut s_overflow = SharedMemory::<u32>::new(size);
    let mut s_squared_error = SharedMemory::<f32>::new(size);
    let mut s_scale_inv_min = SharedMemory::<u32>::new(size);
    let mut s_scale_inv_max = SharedMemory::<u32>::new(size);
    if comptime!(with_fp8) {
        s_underflow[unit] = underflow;
        s_overflow[unit] = overflow;
        s_squared_error[unit] = squared_error;
        s_scale_inv_min[unit] = scale_inv_min;
        s_scale_inv_max[unit] = scale_inv_max;
    }
    sync_cube();

    let mut half = comptime!(CUBE_SIZE as usize / 2).runtime();
    while half > 0 {
        if unit < half {
            let other = unit + half;
            let count_b = s_count[other];
            if count_b > 0 {
                let count_a = s_count[unit];
                if count_a == 0 {
                    s_mean[unit] = s_mean[other];
                    s_m2[unit] = s_m2[other];
                } else {
                    let n_a = f32::cast_from(count_a);
                    let n_b = f32::cast_from(count_b);
                    let n = n_a + n_b;
                    let delta = s_mean[other] - s_mean[unit];
                    s_mean[unit] = s_mean[unit] + delta * (n_b / n);
                    s_m2[unit] = s_m2[unit] + s_m2[other] + delta * delta * (n_a * n_b / n);
                }
                s_count[unit] = count_a + count_b;
                s_l1[unit] = s_l1[unit] + s_l1[other];
                if s_min[other] < s_min[unit] {
                    s_min[unit] = s_min[other];
                }
                if s_max[other] > s_max[unit] {
                    s_max[unit] = s_max[other];
                }
                if s_min_nonzero[other] < s_min_nonzero[unit] {
                    s_min_nonzero[unit] = s_min_nonzero[other];
                }
            }
            s_nonzero[unit] = s_nonzero[unit] + s_nonzero[other];
            s_nan[unit] = s_nan[unit] + s_nan[other];
            s_pos_inf[unit] = s_pos_inf[unit] + s_pos_inf[other];
            s_neg_inf[unit] = s_neg_inf[unit] + s_neg_inf[other];
            if comptime!(with_fp8) {
                s_underflow[unit] = s_underflow[unit] + s_underflow[other];
                s_overflow[unit] = s_overflow[unit] + s_overflow[other];
                s_squared_error[unit] = s_squared_error[unit] + s_squared_error[other];
                if s_scale_inv_min[other] < s_scale_inv_min[unit] {
                    s_scale_inv_min[unit] = s_scale_inv_min[other];
                }
                if s_scale_inv_max[other] > s_scale_inv_max[unit] {
                    s_scale_inv_max[unit] = s_scale_inv_max[other];
                }
            }
        }
        sync_cube();
        half /= 2;
    }

    if unit == 0 {
        let base = CUBE_POS * STATS_SLOTS;
        partials[base + slot::FINITE_COUNT] = s_count[0];
        partials[base + slot::MEAN] = u32::reinterpret(s_mean[0]);
        partials[base + slot::M2] = u32::reinterpret(s_m2[0]);
        partials[base + slot::L1] = u32::reinterpret(s_l1[0]);
        partials[base + slot::MIN] = u32::reinterpret(s_min[0]);
        partials[base + slot::MAX] = u32::reinterpret(s_max[0]);
        partials[base + slot::MIN_NONZERO_ABS] = s_min_nonzero[0];
        partials[base + slot::NONZERO] = s_nonzero[0];
        partials[base + slot::NAN] = s_nan[0];
        partials[base + slot::POS_INF] = s_pos_inf[0];
        partials[base + slot::NEG_INF] = s_neg_inf[0];
        let mut underflow_total = 0u32;
        let mut overflow_total = 0u32;
        let mut squared_error_total = 0.0f32;
        let mut scale_inv_min_total = INF_BITS.runtime();
        let mut scale_inv_max_total = 0u32.runtime();
        if comptime!(with_fp8) {
            underflow_total = s_underflow[0];
            overflow_total = s_overflow[0];
            squared_error_total = s_squared_error[0];
            scale_inv_min_total = s_scale_inv_min[0];
            scale_inv_max_total = s_scale_inv_max[0];
        }
        partials[base + slot::UNDERFLOW] = underflow_total;
        partials[base + slot::OVERFLOW] = overflow_total;
        partials[base + slot::SQUARED_ERROR] = u32::reinterpret(squared_error_total);
        partials[base + slot::SHIFT] = u32::reinterpret(shift);
        partials[base + slot::SCALE_INV_MIN] = scale_inv_min_total;
        partials[base + slot::SCALE_INV_MAX] = scale_inv_max_total;
    }
}

/// Counts the finite, NaN, +inf and -inf elements in one read, writing a statistics record per cube
/// (`CUBE_COUNT * STATS_SLOTS` words) with only those counts filled: the diagnostics' non-finite tracking, far
/// cheaper than [`stats_kernel()`] (no moments, extremes or quantization per element). The input is read as
/// vectors of `N` elements (`vectors` of them).
#[cube(launch_unchecked)]
pub fn non_finite_kernel<F: Float, N: Size>(
    input: &Array<Vector<F, N>>,
    partials: &mut Array<u32>,
    vectors: u32,
) {
    let len = vectors as usize;
    let stride = CUBE_COUNT * comptime!(CUBE_SIZE as usize);
    let mut finite = 0u32;
    let mut nan = 0u32;
    let mut pos_inf = 0u32;
    let mut neg_inf = 0u32;
    let mut index = ABSOLUTE_POS;
    while index < len {
        let v = input[index];
        #[unroll]
        for lane in 0..N::value() {
            let bits = u32::reinterpret(f32::cast_from(v[lane]));
            let abs = bits & 0x7fff_ffff;
            finite += u32::cast_from(abs < INF_BITS);
            nan += u32::cast_from(abs > INF_BITS);
            pos_inf += u32::cast_from(bits == INF_BITS);
            neg_inf += u32::cast_from(bits == (INF_BITS | 0x8000_0000));
        }
        index += stride;
    }
    let unit = UNIT_POS as usize;
    let size = comptime!(CUBE_SIZE as usize);
    let mut s_finite = SharedMemory::<u32>::new(size);
    let mut s_nan = SharedMemory::<u32>::new(size);
    let mut s_pos_inf = SharedMemory::<u32>::new(size);
    let mut s_neg_inf = SharedMemory::<u32>::new(size);
    s_finite[unit] = finite;
    s_nan[unit] = nan;
    s_pos_inf[unit] = pos_inf;
    s_neg_inf[unit] = neg_inf;
    sync_cube();
    let mut half = comptime!(CUBE_SIZE as usize / 2).runtime();
    while half > 0 {
        if unit < half {
            let other = unit + half;
            s_finite[unit] = s_finite[unit] + s_finite[other];
            s_nan[unit] = s_nan[unit] + s_nan[other];
            s_pos_inf[unit] = s_pos_inf[unit] + s_pos_inf[other];
            s_neg_inf[unit] = s_neg_inf[unit] + s_neg_inf[other];
        }
        sync_cube();
        half /= 2;
    }
    if unit == 0 {
        let base = CUBE_POS * STATS_SLOTS;
        for s in 0..STATS_SLOTS {
            partials[base + s] = 0u32;
        }
        partials[base + slot::FINITE_COUNT] = s_finite[0];
        partials[base + slot::NAN] = s_nan[0];
        partials[base + slot::POS_INF] = s_pos_inf[0];
        partials[base + slot::NEG_INF] = s_neg_inf[0];
        // The identities of the extremes, so a merged record stays well-formed.
        partials[base + slot::MIN] = 0x7f7f_ffffu32;
        partials[base + slot::MAX] = 0xff7f_ffffu32;
        partials[base + slot::MIN_NONZERO_ABS] = INF_BITS;
        partials[base + slot::SCALE_INV_MIN] = INF_BITS;
    }
}
