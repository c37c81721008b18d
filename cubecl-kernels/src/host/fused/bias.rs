//! A linear layer's bias added to every row of its GEMM's output (`y = x + bias`, the fprop GEMM's bias epilogue),
//! in blocks of rows on rayon's pool: the same sums as a broadcast add, in a loop that vectorizes; and the bias's
//! gradient (the output gradient's column sums, TE's `dbias`), in blocks of columns.

use rayon::prelude::*;

use super::par_rows;
use crate::host::pool::OutputValues;

/// `x [rows, width] + bias [width]` (`width = bias.len()`; `x.len()` a multiple of it).
pub fn add_bias(x: &[f32], bias: &[f32]) -> OutputValues {
    let width = bias.len();
    assert!(
        width > 0 && x.len().is_multiple_of(width),
        "rows of the bias's {width} values"
    );
    let mut y = OutputValues::for_overwrite(x.len());
    par_rows(x, width, &mut y, width, |_, x, y| add_rows(x, y, bias));
    y
}

/// `values [rows, width] += bias [width]` in place (`width = bias.len()`; `values.len()` a multiple of it), in
/// blocks of rows on rayon's pool.
pub fn add_bias_in_place(values: &mut [f32], bias: &[f32]) {
    let width = bias.len();
    assert!(
        width > 0 && values.len().is_multiple_of(width),
        "rows of the bias's {width} values"
    );
    values
        .par_chunks_mut(super::block_rows(width) * width)
        .for_each(|rows| add_rows_in_place(rows, bias));
}

/// Columns per task of [`bias_grad`]: 128 sums, 8 AVX-512 or 16 AVX2 registers.
const GRAD_COLUMNS: usize = 128;

/// A linear layer's bias gradient, `Σ_rows dy [rows, width]` (`dy.len()` a multiple of `width > 0`): each column
/// summed over the rows in order, so the bits of a sequential loop whatever the number of threads; blocks of
/// `GRAD_COLUMNS` columns on rayon's pool (Flex sums the rows on one thread).
pub fn bias_grad(dy: &[f32], width: usize) -> Vec<f32> {
    assert!(
        width > 0 && dy.len().is_multiple_of(width),
        "rows of {width} values"
    );
    let mut sums = vec![0.0f32; width];
    if dy.len() < super::BLOCK_ELEMENTS {
        column_sums(dy, width, 0, &mut sums);
    } else {
        sums.par_chunks_mut(GRAD_COLUMNS)
            .enumerate()
            .for_each(|(block, sums)| column_sums(dy, width, block * GRAD_COLUMNS, sums));
    }
    sums
}

/// `sums[c] = Σ_rows dy[row, col0 + c]` over the rows in order, for `sums.len()` columns from `col0`.
#[multiversion::multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn column_sums(dy: &[f32], width: usize, col0: usize, sums: &mut [f32]) {
    let cols = sums.len();
    let rows = dy.chunks_exact(width).map(|row| &row[col0..][..cols]);
    if let Ok(sums) = <&mut [f32; GRAD_COLUMNS]>::try_from(&mut *sums) {
        // A whole block: its sums in an array of fixed length, which stays in registers.
        let mut acc = [0.0f32; GRAD_COLUMNS];
        for row in rows {
            for (a, v) in acc.iter_mut().zip(row) {
                *a += v;
            }
        }
        *sums = acc;
    } else {
        sums.fill(0.0);
        for row in rows {
            for (a, v) in sums.iter_mut().zip(row) {
                *a += v;
            }
        }
    }
}

#[multiversion::multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn add_rows_in_place(values: &mut [f32], bias: &[f32]) {
    for row in values.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

#[multiversion::multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn add_rows(x: &[f32], y: &mut [f32], bias: &[f32]) {
    for (y, x) in y
        .chunks_exact_mut(bias.len())
        .zip(x.chunks_exact(bias.len()))
    {
        for ((y, x), b) in y.iter_mut().zip(x).zip(bias) {
            *y = x + b;
        }
    }
}
