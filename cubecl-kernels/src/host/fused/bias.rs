//! A linear layer's bias added to every row of its GEMM's output (`y = x + bias`, the fprop GEMM's bias epilogue),
//! in blocks of rows on rayon's pool: the same sums as a broadcast add, in a loop that vectorizes.

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
