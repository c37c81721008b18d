//! A block-scaled operand as the packing reads it: FP8 (or E2M1) codes and one factor per block, each element made
//! `value(code) · factor` while its panel is packed, so no decoded copy of the whole operand is written and read
//! back (TE's block recipes: Float8BlockScaling's 1 × 128 and 128 × 128 blocks, MXFP8's 1 × 32, NVFP4's 1 × 16).
//! The same decode writes the whole operand as f32 where that is what is wanted ([`BlockCodes::decode_f32`]: the
//! `f32` path, which hands decoded operands to the `gemm` crate, and the host dequantization).

use rayon::prelude::*;

use super::{HostGemmError, HostGemmPath, PackedElement};
use crate::ScaleBlock;

/// A row-major matrix of `cols` columns stored as codes, cut into `block`s, each with a factor: stored element `i`
/// is `E::of_value(values[codes[i]] · factors[b])`, `b` the block of row `i / cols`, column `i % cols` (blocks
/// row-major over the grid; the last row or column of blocks may be partial). The product is one f32 rounding,
/// as a decode that folds the block scale in gives.
#[derive(Clone, Copy)]
pub struct BlockCodes<'a> {
    /// The codes, one per byte.
    pub codes: &'a [u8],
    /// Each code's value.
    pub values: &'a [f32; 256],
    /// Columns of the stored matrix (a batch's matrices folded into its rows).
    pub cols: usize,
    /// The block every factor covers.
    pub block: ScaleBlock,
    /// One factor per block.
    pub factors: &'a [f32],
}

impl BlockCodes<'_> {
    /// An error unless the codes fill whole rows and there is one factor per block.
    pub(super) fn check(&self, path: HostGemmPath) -> Result<(), HostGemmError> {
        let ScaleBlock { rows, cols } = self.block;
        let grid =
            (self.cols > 0 && rows > 0 && cols > 0 && self.codes.len().is_multiple_of(self.cols))
                .then(|| (self.codes.len() / self.cols).div_ceil(rows) * self.cols.div_ceil(cols));
        if grid != Some(self.factors.len()) {
            return Err(HostGemmError::BlockFactors {
                what: path,
                codes: self.codes.len(),
                cols: self.cols,
                block: (rows, cols),
                factors: self.factors.len(),
            });
        }
        Ok(())
    }

    /// Every stored element as f32, `values[code] · factor` (what the `f32` path multiplies, and the host
    /// dequantization), into `out`, one per code: bands of the blocks' rows on rayon's pool. The grid must fit
    /// (`check`, or the caller's own check of the tensor's scales).
    pub fn decode_f32(&self, out: &mut [f32]) {
        let band = self.block.rows * self.cols;
        if band == 0 {
            return;
        }
        out.par_chunks_mut(band)
            .enumerate()
            .for_each(|(i, out)| self.decode(i * band, out, |value| value));
    }

    /// `out[j]` = stored element `at + j` as the packed element `E`, consecutive elements of one row or of rows
    /// that follow each other.
    #[inline]
    pub(super) fn decode_run<E: PackedElement>(&self, at: usize, out: &mut [E]) {
        self.decode(at, out, E::of_value);
    }

    /// `out[j]` = `element(value · factor)` of stored element `at + j`: one division per stored row, then block by
    /// block, each block's factor read once.
    #[inline]
    fn decode<T>(&self, at: usize, out: &mut [T], element: impl Fn(f32) -> T) {
        let (block_cols, grid_cols) = (self.block.cols, self.cols.div_ceil(self.block.cols));
        let fill = |out: &mut [T], codes: &[u8], factor: f32| {
            for (o, &code) in out.iter_mut().zip(codes) {
                *o = element(self.values[usize::from(code)] * factor);
            }
        };
        let mut done = 0;
        while done < out.len() {
            let i = at + done;
            let (row, col) = (i / self.cols, i % self.cols);
            let len = (self.cols - col).min(out.len() - done);
            let factors = &self.factors[row / self.block.rows * grid_cols..][..grid_cols];
            let (out, codes) = (&mut out[done..done + len], &self.codes[i..i + len]);
            // The first block from `col` (maybe partial), then whole blocks (the last maybe cut by the run).
            let head = (block_cols - col % block_cols).min(len);
            let first = col / block_cols;
            fill(&mut out[..head], &codes[..head], factors[first]);
            let blocks = out[head..]
                .chunks_mut(block_cols)
                .zip(codes[head..].chunks(block_cols));
            for ((out, codes), &factor) in blocks.zip(&factors[first + 1..]) {
                fill(out, codes, factor);
            }
            done += len;
        }
    }
}
