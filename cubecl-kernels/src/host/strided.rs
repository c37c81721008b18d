//! Strided views' elements copied out in row-major order, on rayon's pool: one view ([`contiguous`]), or several
//! joined along a dimension ([`concatenated`]); or read where they lie, for an FP8 operand's amax ([`amax`]) and
//! codes ([`quantized`]), without the copy. Rows whose elements are adjacent are copied whole, others (a
//! transposed view) are read a tile of rows at a time, so that rows adjacent in the source are read together. Large
//! outputs come from the buffer pool ([`super::pool`]), so each step's copies reuse pages already faulted in.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::pool::{HostOutput, OutputValues};
use super::{amax_bits, assume_init, encode_scaled, uninit};
use crate::Fp8Format;

/// Output elements per parallel task (at least one row).
const TASK: usize = 1 << 14;

/// Rows read together where a row's elements are not adjacent.
const TILE_ROWS: usize = 16;

/// A view of `values`: element `[i0, .., in]` at `offset + Σ i·stride`.
#[derive(Clone, Copy, Debug)]
pub struct StridedView<'a> {
    /// The storage the view reads.
    pub values: &'a [f32],
    /// Where element `[0, .., 0]` lies in `values`.
    pub offset: usize,
    /// The view's dimensions.
    pub shape: &'a [usize],
    /// One stride per dimension, in elements (0: broadcast).
    pub strides: &'a [usize],
}

impl StridedView<'_> {
    /// The number of elements, or `None` when shape and strides differ in rank, the count overflows or an element
    /// lies outside `values`.
    fn checked_len(&self) -> Option<usize> {
        if self.shape.len() != self.strides.len() {
            return None;
        }
        let len = self
            .shape
            .iter()
            .try_fold(1usize, |len, &dim| len.checked_mul(dim))?;
        if len == 0 {
            return Some(0);
        }
        let last = self
            .shape
            .iter()
            .zip(self.strides)
            .try_fold(self.offset, |at, (&dim, &stride)| {
                at.checked_add((dim - 1).checked_mul(stride)?)
            })?;
        (last < self.values.len()).then_some(len)
    }

    /// Where flat row `row` of dimensions `dims` (a suffix of the view's leading ones, row-major) starts, from
    /// `at`.
    fn row_start(&self, dims: std::ops::Range<usize>, mut row: usize, mut at: usize) -> usize {
        for (&dim, &stride) in self.shape[dims.clone()]
            .iter()
            .zip(&self.strides[dims])
            .rev()
        {
            at += (row % dim) * stride;
            row /= dim;
        }
        at
    }

    /// The view as runs of adjacent elements: `(run, lead)`, the elements of one run (the trailing dimensions that
    /// lie in storage order, merged; dimensions of one element skipped) and how many leading dimensions index the
    /// runs. A contiguous view is one run; a permuted `[b, h, s, d]` view has runs of `d`.
    fn runs(&self) -> (usize, usize) {
        let (mut run, mut lead) = (1, self.shape.len());
        while lead > 0 && (self.shape[lead - 1] == 1 || self.strides[lead - 1] == run) {
            run *= self.shape[lead - 1];
            lead -= 1;
        }
        (run, lead)
    }

    /// The pieces of output elements `range` (row-major) as `(storage start, output start, length)`, each within one
    /// run of [`runs`](Self::runs) `(run, lead)`.
    fn pieces(
        &self,
        (run, lead): (usize, usize),
        range: std::ops::Range<usize>,
    ) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let mut at = range.start;
        std::iter::from_fn(move || {
            if at >= range.end {
                return None;
            }
            let within = at % run;
            let len = (run - within).min(range.end - at);
            let start = self.row_start(0..lead, at / run, self.offset) + within;
            let piece = (start, at, len);
            at += len;
            Some(piece)
        })
    }
}

/// Runs of fewer elements than this are copied out first ([`contiguous`]) rather than read in place: a transposed
/// view's single elements.
pub const MIN_RUN: usize = 16;

/// The view's largest `|x|` as [`super::amax`] computes it, read in place on the pool; `None` when shape and strides
/// differ in rank, an element lies outside `values` or its runs of adjacent elements are shorter than [`MIN_RUN`].
pub fn amax(view: StridedView<'_>) -> Option<f32> {
    let len = view.checked_len()?;
    let runs = view.runs();
    if runs.0 < MIN_RUN.min(len) {
        return None;
    }
    let task = |t: usize| {
        view.pieces(runs, t * TASK..((t + 1) * TASK).min(len))
            .map(|(start, _, n)| amax_bits(&view.values[start..start + n]))
            .fold(0, u32::max)
    };
    let bits = match len.div_ceil(TASK) {
        0 | 1 => task(0),
        tasks => (0..tasks).into_par_iter().map(task).reduce(|| 0, u32::max),
    };
    Some(f32::from_bits(bits))
}

/// [`super::quantize`] of the view's elements in row-major order, read in place on the pool, and with `with_amax`
/// their amax in the same pass ([`super::quantize_with_amax`]; else 0): the same codes as the quantization of a
/// [`contiguous`] copy. `None` as for [`amax`].
pub fn quantized(
    view: StridedView<'_>,
    scale: f32,
    format: Fp8Format,
    with_amax: bool,
) -> Option<(Vec<u8>, f32)> {
    let len = view.checked_len()?;
    let runs = view.runs();
    if runs.0 < MIN_RUN.min(len) {
        return None;
    }
    let mut codes = uninit(len);
    let task = |(t, out): (usize, &mut [MaybeUninit<u8>])| {
        let first = t * TASK;
        let mut bits = 0;
        for (start, at, n) in view.pieces(runs, first..first + out.len()) {
            let x = &view.values[start..start + n];
            encode_scaled(x, scale, format, &mut out[at - first..at - first + n]);
            if with_amax {
                bits = bits.max(amax_bits(x));
            }
        }
        bits
    };
    let bits = if len <= TASK {
        task((0, &mut codes))
    } else {
        codes
            .par_chunks_mut(TASK)
            .enumerate()
            .map(task)
            .reduce(|| 0, u32::max)
    };
    // SAFETY: the tasks' pieces cover every output element, and `encode_scaled` wrote a code for each.
    Some((unsafe { assume_init(codes) }, f32::from_bits(bits)))
}

/// Where one output row is read: its storage, first element and the distance between its elements.
type RowSource<'a> = (&'a [f32], usize, usize);

/// Fills `out` (whole rows of `cols`) on the pool, row `r` read from `source(r)`.
fn copy_rows<'a>(
    out: &mut [MaybeUninit<f32>],
    cols: usize,
    source: impl Fn(usize) -> RowSource<'a> + Sync,
) {
    let rows_per_task = (TASK / cols).max(1);
    let copy = |(task, dst): (usize, &mut [MaybeUninit<f32>])| {
        let first = task * rows_per_task;
        for (t, tile) in dst.chunks_mut(TILE_ROWS * cols).enumerate() {
            let rows = tile.len() / cols;
            let mut sources = [(&[][..], 0, 0); TILE_ROWS];
            for (r, at) in sources[..rows].iter_mut().enumerate() {
                *at = source(first + t * TILE_ROWS + r);
            }
            if sources[..rows].iter().all(|&(_, _, stride)| stride == 1) {
                for (dst, &(values, start, _)) in tile.chunks_exact_mut(cols).zip(&sources) {
                    for (d, &v) in dst.iter_mut().zip(&values[start..start + cols]) {
                        d.write(v);
                    }
                }
                continue;
            }
            for c in 0..cols {
                for (r, &(values, start, stride)) in sources[..rows].iter().enumerate() {
                    tile[r * cols + c].write(values[start + c * stride]);
                }
            }
        }
    };
    let chunk = rows_per_task * cols;
    if out.len() <= chunk {
        copy((0, out));
    } else {
        out.par_chunks_mut(chunk).enumerate().for_each(copy);
    }
}

/// The view's elements in row-major order, or `None` when shape and strides differ in rank or an element lies
/// outside `values`.
pub fn contiguous(view: StridedView<'_>) -> Option<OutputValues> {
    let len = view.checked_len()?;
    if len == 0 {
        return Some(Vec::new().into());
    }
    // Rows are the last dimension (a scalar is one row of one element).
    let (cols, col_stride) = match (view.shape.last(), view.strides.last()) {
        (Some(&cols), Some(&stride)) => (cols, stride),
        _ => (1, 1),
    };
    let leading = 0..view.shape.len().saturating_sub(1);
    let mut out = HostOutput::uninit(len);
    copy_rows(&mut out, cols, |row| {
        let start = view.row_start(leading.clone(), row, view.offset);
        (view.values, start, col_stride)
    });
    // SAFETY: `copy_rows` wrote every element (whole rows).
    Some(unsafe { out.assume_init() })
}

/// The views joined along dimension `dim` (Burn's `cat`), in row-major order: `None` when they differ in rank or
/// in a dimension other than `dim`, an element lies outside its storage, there are none, or `dim` is the last
/// dimension (rows of different lengths; Flex's own copy joins those).
pub fn concatenated(parts: &[StridedView<'_>], dim: usize) -> Option<OutputValues> {
    let first = parts.first()?;
    let rank = first.shape.len();
    if dim + 1 >= rank {
        return None;
    }
    let mut len = 0usize;
    for part in parts {
        let same = part.shape.len() == rank
            && (0..rank).all(|d| d == dim || part.shape[d] == first.shape[d]);
        if !same {
            return None;
        }
        len = len.checked_add(part.checked_len()?)?;
    }
    if len == 0 {
        return Some(Vec::new().into());
    }
    let cols = first.shape[rank - 1];
    // Each block (one index of the dimensions before `dim`) holds every part's rows in turn: part i's
    // `shape[dim..rank - 1]`, starting at `starts[i]` of the block's rows.
    let part_rows: Vec<usize> = parts
        .iter()
        .map(|p| p.shape[dim..rank - 1].iter().product())
        .collect();
    let starts: Vec<usize> = part_rows
        .iter()
        .scan(0, |at, &rows| {
            let start = *at;
            *at += rows;
            Some(start)
        })
        .collect();
    let block_rows: usize = part_rows.iter().sum();
    let mut out = HostOutput::uninit(len);
    copy_rows(&mut out, cols, |row| {
        let (block, within) = (row / block_rows, row % block_rows);
        let i = starts.partition_point(|&start| start <= within) - 1;
        let part = &parts[i];
        let at = part.row_start(0..dim, block, part.offset);
        let start = part.row_start(dim..rank - 1, within - starts[i], at);
        (part.values, start, part.strides[rank - 1])
    });
    // SAFETY: `copy_rows` wrote every element (whole rows).
    Some(unsafe { out.assume_init() })
}
