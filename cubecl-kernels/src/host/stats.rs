//! The debug tools' statistics on the host (LogTensorStats, LogFp8TensorStats, the diagnostics' non-finite
//! check), in parallel chunks.
//!
//! Each chunk of [`CHUNK`] values is read twice while it is in cache: a vector pass for the counts, sums, l1 and
//! extremes of its finite values, then the sum of their squared deviations from the chunk's mean (two passes, so no
//! division per element as in Welford's update, and no cancellation as in a sum of squares). The chunks' records
//! are merged in order with [`TensorStats::merge`] (Chan's formula), so a tensor's statistics are the same whatever
//! the threads. FP8 statistics add the quantization's underflows, overflows and squared error, per element as
//! [`Fp8Stats::push`] computes them.

use rayon::prelude::*;

use crate::Fp8Format;
use crate::error::KernelError;
use crate::host::block::{TASK_ELEMENTS, fill_block_columns, stripe_scales};
use crate::{BlockScaleRule, ScaleBlock};
use crate::{Fp8Stats, TensorStats};

/// Values per chunk: 64 KiB of f32, in L2 between the chunk's passes.
const CHUNK: usize = 1 << 14;

/// Independent accumulators per vector pass (two 512-bit registers of f32 lanes, four of f64).
pub(super) const LANES: usize = 16;

/// The statistics of the tensor.
pub fn tensor_stats(input: &[f32]) -> TensorStats {
    merge_in_order(input, chunk_stats)
}

/// The statistics of the tensor and of its quantization with `scale` in `format`.
pub fn fp8_tensor_stats(input: &[f32], format: Fp8Format, scale: f32) -> Fp8Stats {
    let scale_inv = 1.0f32 / scale;
    let stats = merge_in_order(input, |chunk| {
        let mut stats = Fp8Stats {
            tensor: chunk_stats(chunk),
            ..Fp8Stats::EMPTY
        };
        stats.add_errors(quantization_errors(chunk, scale, scale_inv, format));
        stats
    });
    let scale_invs = (!input.is_empty()).then_some(scale_inv);
    Fp8Stats {
        scale_inv_min: scale_invs.map_or(f64::INFINITY, f64::from),
        scale_inv_max: scale_invs.map_or(f64::NEG_INFINITY, f64::from),
        ..stats
    }
    .with_scale_invs(scale_invs)
}

/// The statistics of a row-major `[rows, cols]` tensor and of its quantization in `block`s with `rule`'s scales
/// (those of [`crate::host::block::block_quantize`]): one task per stripe of a block's rows (grouped as the quantization
/// groups them), the tasks' records merged in order. An error where the block has a zero side or the input is not
/// `rows · cols` long.
pub fn block_fp8_tensor_stats(
    input: &[f32],
    rows: usize,
    cols: usize,
    block: ScaleBlock,
    rule: BlockScaleRule,
    format: Fp8Format,
) -> Result<Fp8Stats, KernelError> {
    let (_, grid_cols) = block.check_host("block_tensor_stats input", input, rows, cols)?;
    if input.is_empty() {
        return Ok(Fp8Stats::EMPTY);
    }
    let stripe = block.rows * cols;
    let task = stripe * (TASK_ELEMENTS / stripe).max(1);
    let tasks: Vec<(Fp8Stats, Vec<f32>)> = input
        .par_chunks(task)
        .map(|task| {
            let mut stats = Fp8Stats {
                tensor: task.chunks(CHUNK).fold(TensorStats::EMPTY, |all, chunk| {
                    all.merge(&chunk_stats(chunk))
                }),
                ..Fp8Stats::EMPTY
            };
            let mut amax = vec![0u32; grid_cols];
            let (mut scales, mut scale_inv) = (vec![0.0f32; grid_cols], vec![0.0f32; grid_cols]);
            // Each block's scales expanded to its columns.
            let (mut column_scales, mut column_scale_invs) =
                (vec![0.0f32; cols], vec![0.0f32; cols]);
            let mut task_scale_invs = Vec::with_capacity(task.len().div_ceil(stripe) * grid_cols);
            for stripe in task.chunks(stripe) {
                stripe_scales(
                    stripe,
                    cols,
                    block.cols,
                    (rule, format),
                    &mut amax,
                    &mut scales,
                    &mut scale_inv,
                );
                fill_block_columns(&mut column_scales, block.cols, &scales);
                fill_block_columns(&mut column_scale_invs, block.cols, &scale_inv);
                for row in stripe.chunks_exact(cols) {
                    stats.add_errors(quantization_errors_each(
                        row,
                        &column_scales,
                        &column_scale_invs,
                        format,
                    ));
                }
                for &inv in &scale_inv {
                    stats.scale_inv_min = stats.scale_inv_min.min(f64::from(inv));
                    stats.scale_inv_max = stats.scale_inv_max.max(f64::from(inv));
                }
                task_scale_invs.extend_from_slice(&scale_inv);
            }
            (stats, task_scale_invs)
        })
        .collect();
    let stats = tasks
        .iter()
        .fold(Fp8Stats::EMPTY, |all, (task, _)| all.merge(task));
    Ok(stats.with_scale_invs(tasks.into_iter().flat_map(|(_, scale_invs)| scale_invs)))
}

/// The tensor's NaN, +inf and -inf counts (and its element count) as statistics whose other fields are those of no
/// finite element: the cheap check of the diagnostics' non-finite tracking.
pub fn non_finite_counts(input: &[f32]) -> TensorStats {
    merge_in_order(input, |chunk| {
        let [nan, pos_inf, neg_inf] = non_finite_chunk(chunk);
        let numel = chunk.len() as u64;
        TensorStats {
            numel,
            finite_count: numel - nan - pos_inf - neg_inf,
            nonzero_count: nan + pos_inf + neg_inf,
            nan_count: nan,
            pos_inf_count: pos_inf,
            neg_inf_count: neg_inf,
            ..TensorStats::EMPTY
        }
    })
}

/// A chunk's record: merged with others in the chunks' order.
trait Record: Copy + Send {
    /// The record of no elements.
    const EMPTY: Self;
    /// The record of both groups of elements.
    fn merge(&self, other: &Self) -> Self;
}

impl Record for TensorStats {
    const EMPTY: Self = TensorStats::EMPTY;
    fn merge(&self, other: &Self) -> Self {
        TensorStats::merge(self, other)
    }
}

impl Record for Fp8Stats {
    const EMPTY: Self = Fp8Stats::EMPTY;
    fn merge(&self, other: &Self) -> Self {
        Fp8Stats::merge(self, other)
    }
}

/// `record` of each [`CHUNK`] of `input` (on rayon's pool when there are several), merged first to last.
fn merge_in_order<R: Record>(input: &[f32], record: impl Fn(&[f32]) -> R + Sync) -> R {
    if input.len() <= CHUNK {
        return record(input);
    }
    let records: Vec<R> = input.par_chunks(CHUNK).map(&record).collect();
    records.iter().fold(R::EMPTY, |all, chunk| all.merge(chunk))
}

/// What the first pass over a chunk finds among its finite values (and its nonzero count over all values).
struct FiniteSums {
    count: u64,
    nonzero: u64,
    sum: f64,
    l1: f64,
    min: f32,
    max: f32,
    min_nonzero_abs: f32,
}

/// The statistics of one chunk: the first pass, the squared deviations from its mean, and the non-finite counts
/// where the first pass saw any.
fn chunk_stats(chunk: &[f32]) -> TensorStats {
    let sums = finite_sums(chunk);
    let numel = chunk.len() as u64;
    let mean = if sums.count == 0 {
        0.0
    } else {
        sums.sum / sums.count as f64
    };
    let [nan, pos_inf, neg_inf] = if sums.count == numel {
        [0; 3]
    } else {
        non_finite_chunk(chunk)
    };
    TensorStats {
        numel,
        finite_count: sums.count,
        finite_mean: mean,
        finite_m2: squared_deviations(chunk, mean),
        finite_l1: sums.l1,
        // ±∞ where the chunk has no finite value, as the passes start them.
        finite_min: f64::from(sums.min),
        finite_max: f64::from(sums.max),
        min_nonzero_abs: f64::from(sums.min_nonzero_abs),
        nonzero_count: sums.nonzero,
        nan_count: nan,
        pos_inf_count: pos_inf,
        neg_inf_count: neg_inf,
    }
}

/// Whether `x` is finite, from its exponent bits alone (a vector compare).
#[inline(always)]
pub(super) fn is_finite(x: f32) -> bool {
    x.to_bits() & 0x7f80_0000 != 0x7f80_0000
}

/// The smaller of two values that are never NaN (one vector instruction, unlike `f32::min`).
#[inline(always)]
fn smaller(a: f32, b: f32) -> f32 {
    if b < a { b } else { a }
}

/// The larger of two values that are never NaN.
#[inline(always)]
fn larger(a: f32, b: f32) -> f32 {
    if b > a { b } else { a }
}

/// The first pass over a chunk, [`LANES`] values at a time.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn finite_sums(chunk: &[f32]) -> FiniteSums {
    let mut sum = [0.0f64; LANES];
    let mut l1 = [0.0f64; LANES];
    let mut min = [f32::INFINITY; LANES];
    let mut max = [f32::NEG_INFINITY; LANES];
    let mut min_nonzero_abs = [f32::INFINITY; LANES];
    let mut count = [0u32; LANES];
    let mut nonzero = [0u32; LANES];
    let mut add = |l: usize, x: f32| {
        let finite = is_finite(x);
        let value = if finite { x } else { 0.0 };
        sum[l] += f64::from(value);
        l1[l] += f64::from(value.abs());
        min[l] = smaller(min[l], if finite { x } else { f32::INFINITY });
        max[l] = larger(max[l], if finite { x } else { f32::NEG_INFINITY });
        let nonzero_abs = if finite && x != 0.0 {
            x.abs()
        } else {
            f32::INFINITY
        };
        min_nonzero_abs[l] = smaller(min_nonzero_abs[l], nonzero_abs);
        count[l] += u32::from(finite);
        // NaN counts as nonzero, as in `torch.count_nonzero`.
        nonzero[l] += u32::from(x != 0.0);
    };
    let (body, tail) = chunk.as_chunks::<LANES>();
    for values in body {
        for (l, &x) in values.iter().enumerate() {
            add(l, x);
        }
    }
    for (l, &x) in tail.iter().enumerate() {
        add(l, x);
    }
    FiniteSums {
        count: count.iter().map(|&c| u64::from(c)).sum(),
        nonzero: nonzero.iter().map(|&c| u64::from(c)).sum(),
        sum: sum.iter().sum(),
        l1: l1.iter().sum(),
        min: min.into_iter().fold(f32::INFINITY, smaller),
        max: max.into_iter().fold(f32::NEG_INFINITY, larger),
        min_nonzero_abs: min_nonzero_abs.into_iter().fold(f32::INFINITY, smaller),
    }
}

/// Σ (x − mean)² over the chunk's finite values, in f64.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn squared_deviations(chunk: &[f32], mean: f64) -> f64 {
    let mut m2 = [0.0f64; LANES];
    let mut add = |l: usize, x: f32| {
        let deviation = if is_finite(x) {
            f64::from(x) - mean
        } else {
            0.0
        };
        m2[l] += deviation * deviation;
    };
    let (body, tail) = chunk.as_chunks::<LANES>();
    for values in body {
        for (l, &x) in values.iter().enumerate() {
            add(l, x);
        }
    }
    for (l, &x) in tail.iter().enumerate() {
        add(l, x);
    }
    m2.iter().sum()
}

/// NaN, +inf, -inf counts of a chunk, by the bits (no branch per element).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn non_finite_chunk(input: &[f32]) -> [u64; 3] {
    let (mut nan, mut pos, mut neg) = (0u32, 0u32, 0u32);
    for x in input {
        let bits = x.to_bits();
        let magnitude = bits & 0x7fff_ffff;
        nan += u32::from(magnitude > 0x7f80_0000);
        let inf = u32::from(magnitude == 0x7f80_0000);
        neg += inf & (bits >> 31);
        pos += inf & !(bits >> 31);
    }
    [u64::from(nan), u64::from(pos), u64::from(neg)]
}

/// What quantizing some values costs: their underflows, overflows and squared error (as [`Fp8Stats`] counts them).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct QuantizationErrors {
    pub underflow: u64,
    pub overflow: u64,
    pub squared_error: f64,
}

impl QuantizationErrors {
    /// The errors of both groups of values.
    pub(super) fn add(self, other: Self) -> Self {
        QuantizationErrors {
            underflow: self.underflow + other.underflow,
            overflow: self.overflow + other.overflow,
            squared_error: self.squared_error + other.squared_error,
        }
    }
}

impl Fp8Stats {
    /// Adds the errors of quantizing this record's values.
    pub(super) fn add_errors(&mut self, errors: QuantizationErrors) {
        self.underflow_count += errors.underflow;
        self.overflow_count += errors.overflow;
        self.squared_error_sum += errors.squared_error;
    }
}

/// The errors of quantizing `chunk` with one `scale` (`scale_inv` its inverse) in `format`.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn quantization_errors(
    chunk: &[f32],
    scale: f32,
    scale_inv: f32,
    format: Fp8Format,
) -> QuantizationErrors {
    // One loop per format, so the format's constants fold into it (as in the quantize loops).
    let scale_at = |_| (scale, scale_inv);
    match format {
        Fp8Format::E4M3 => errors_in::<true>(chunk, scale_at),
        Fp8Format::E5M2 => errors_in::<false>(chunk, scale_at),
    }
}

/// The errors of quantizing `row` with a scale per value (`scales[j]`, `scale_invs[j]`): blocks along the row
/// expanded to its columns.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn quantization_errors_each(
    row: &[f32],
    scales: &[f32],
    scale_invs: &[f32],
    format: Fp8Format,
) -> QuantizationErrors {
    assert!(scales.len() == row.len() && scale_invs.len() == row.len());
    let scale_at = |j: usize| (scales[j], scale_invs[j]);
    match format {
        Fp8Format::E4M3 => errors_in::<true>(row, scale_at),
        Fp8Format::E5M2 => errors_in::<false>(row, scale_at),
    }
}

/// The errors of `values` in E4M3 (`E4M3`) or E5M2, per element as [`Fp8Stats::push`]: an underflow is a nonzero
/// value whose code is ±0, an overflow a value (not NaN) above `max · scale_inv`, and the squared error is
/// `(x − decode(code) · scale_inv)²` in f32, summed in f64 over the finite values. `scale_at(j)` is value `j`'s
/// `(scale, scale_inv)`.
#[inline(always)]
fn errors_in<const E4M3: bool>(
    values: &[f32],
    scale_at: impl Fn(usize) -> (f32, f32),
) -> QuantizationErrors {
    let format = if E4M3 {
        Fp8Format::E4M3
    } else {
        Fp8Format::E5M2
    };
    let decoded: [f32; 256] = core::array::from_fn(|code| format.decode(code as u8));
    let mut underflow = [0u32; LANES];
    let mut overflow = [0u32; LANES];
    let mut squared_error = [0.0f64; LANES];
    let mut add = |l: usize, x: f32, (scale, scale_inv): (f32, f32)| {
        let code = format.encode(x * scale);
        underflow[l] += u32::from(x != 0.0 && code & 0x7f == 0);
        overflow[l] += u32::from(!x.is_nan() && x.abs() > format.max() * scale_inv);
        let error = x - decoded[usize::from(code)] * scale_inv;
        squared_error[l] += if is_finite(x) {
            f64::from(error * error)
        } else {
            0.0
        };
    };
    let (body, tail) = values.as_chunks::<LANES>();
    for (i, values) in body.iter().enumerate() {
        for (l, &x) in values.iter().enumerate() {
            add(l, x, scale_at(i * LANES + l));
        }
    }
    for (l, &x) in tail.iter().enumerate() {
        add(l, x, scale_at(body.len() * LANES + l));
    }
    QuantizationErrors {
        underflow: underflow.iter().map(|&c| u64::from(c)).sum(),
        overflow: overflow.iter().map(|&c| u64::from(c)).sum(),
        squared_error: squared_error.iter().sum(),
    }
}
