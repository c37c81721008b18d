//! A block-scaled operand as the packing reads it: FP8 (or E2M1) codes and one factor per block, each element made
//! `value(code) · factor` while its panel is packed, so no decoded copy of the whole operand is written and read
//! back (TE's block recipes: Float8BlockScaling's 1 × 128 and 128 × 128 blocks, MXFP8's 1 × 32, NVFP4's 1 × 16).

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

    /// `out[j]` = stored element `at + j`, consecutive elements of one row or of rows that follow each other: runs
    /// inside one block, each block's factor looked up once.
    #[inline]
    pub(super) fn decode_run<E: PackedElement>(&self, at: usize, out: &mut [E]) {
        let grid_cols = self.cols.div_ceil(self.block.cols);
        let mut done = 0;
        while done < out.len() {
            let i = at + done;
            let (row, col) = (i / self.cols, i % self.cols);
            let run = (self.block.cols - col % self.block.cols)
                .min(self.cols - col)
                .min(out.len() - done);
            let factor = self.factors[row / self.block.rows * grid_cols + col / self.block.cols];
            for (o, &code) in out[done..done + run]
                .iter_mut()
                .zip(&self.codes[i..i + run])
            {
                *o = E::of_value(self.values[usize::from(code)] * factor);
            }
            done += run;
        }
    }
}
