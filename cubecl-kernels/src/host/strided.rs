//! A strided view's elements copied out in row-major order, on rayon's pool: rows whose elements are adjacent are
//! copied whole, others (a transposed view) are read a tile of rows at a time, so that rows adjacent in the source
//! are read together.

use std::mem::MaybeUninit;

use rayon::prelude::*;

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

/// The view's elements in row-major order, or `None` when shape and strides differ in rank or an element lies
/// outside `values`.
pub fn contiguous(view: StridedView<'_>) -> Option<Vec<f32>> {
    let StridedView {
        values,
        offset,
        shape,
        strides,
    } = view;
    if shape.len() != strides.len() {
        return None;
    }
    let len = shape
        .iter()
        .try_fold(1usize, |len, &dim| len.checked_mul(dim))?;
    if len == 0 {
        return Some(Vec::new());
    }
    let last = shape
        .iter()
        .zip(strides)
        .try_fold(offset, |at, (&dim, &stride)| {
            at.checked_add((dim - 1).checked_mul(stride)?)
        })?;
    if last >= values.len() {
        return None;
    }
    // Rows are the last dimension (a scalar is one row of one element).
    let (cols, col_stride) = match (shape.last(), strides.last()) {
        (Some(&cols), Some(&stride)) => (cols, stride),
        _ => (1, 1),
    };
    let outer = &shape[..shape.len().saturating_sub(1)];
    let outer_strides = &strides[..strides.len().saturating_sub(1)];
    // The first element of flat row `row` (its index over the leading dimensions, row-major).
    let row_start = |mut row: usize| {
        let mut at = offset;
        for (&dim, &stride) in outer.iter().zip(outer_strides).rev() {
            at += (row % dim) * stride;
            row /= dim;
        }
        at
    };
    let mut out = crate::host::uninit::<f32>(len);
    let rows_per_task = (TASK / cols).max(1);
    let copy = |(task, dst): (usize, &mut [MaybeUninit<f32>])| {
        let first = task * rows_per_task;
        if col_stride == 1 {
            for (r, dst) in dst.chunks_exact_mut(cols).enumerate() {
                let start = row_start(first + r);
                for (d, &v) in dst.iter_mut().zip(&values[start..start + cols]) {
                    d.write(v);
                }
            }
            return;
        }
        for (t, tile) in dst.chunks_mut(TILE_ROWS * cols).enumerate() {
            let rows = tile.len() / cols;
            let mut starts = [0usize; TILE_ROWS];
            for (r, start) in starts[..rows].iter_mut().enumerate() {
                *start = row_start(first + t * TILE_ROWS + r);
            }
            for c in 0..cols {
                for (r, &start) in starts[..rows].iter().enumerate() {
                    tile[r * cols + c].write(values[start + c * col_stride]);
                }
            }
        }
    };
    let chunk = rows_per_task * cols;
    if len <= chunk {
        copy((0, &mut out));
    } else {
        out.par_chunks_mut(chunk).enumerate().for_each(copy);
    }
    // SAFETY: every task wrote each element of its chunk (whole rows: chunks are whole rows, tiles whole rows).
    Some(unsafe { crate::host::assume_init(out) })
}
