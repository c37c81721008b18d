//! The shape of the blocks that share one scale ([`ScaleBlock`]) and how a block's scale follows from its amax
//! ([`BlockScaleRule`]): plain types of Float8BlockScaling, MXFP8 and NVFP4, below their kernels and launchers.

use crate::Fp8Format;
use crate::error::KernelError;

/// The shape of the blocks that share one scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScaleBlock {
    /// Rows per block.
    pub rows: usize,
    /// Columns per block.
    pub cols: usize,
}

impl ScaleBlock {
    /// A block of `rows × cols` elements.
    pub const fn new(rows: usize, cols: usize) -> Self {
        Self { rows, cols }
    }

    /// Number of blocks of a `[rows, cols]` tensor: `(block rows, block columns)`.
    pub fn grid(&self, rows: usize, cols: usize) -> (usize, usize) {
        (rows.div_ceil(self.rows), cols.div_ceil(self.cols))
    }

    /// The block (row-major over the block grid of one matrix, or over stacked matrices whose rows are a
    /// multiple of the block rows) holding element `index` of a row-major tensor with `cols` columns.
    pub fn slot(&self, index: usize, cols: usize) -> usize {
        (index / cols / self.rows) * cols.div_ceil(self.cols) + (index % cols) / self.cols
    }

    /// Checks the block and that a host `[rows, cols]` tensor has `rows * cols` values; returns the block grid.
    pub(crate) fn check_host(
        &self,
        what: &'static str,
        input: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<(usize, usize), KernelError> {
        self.check()?;
        if input.len() != rows * cols {
            return Err(KernelError::LengthMismatch {
                what,
                expected: rows * cols,
                actual: input.len(),
            });
        }
        Ok(self.grid(rows, cols))
    }

    pub(crate) fn check(&self) -> Result<(), KernelError> {
        if self.rows == 0 || self.cols == 0 {
            return Err(KernelError::InvalidArgument {
                what: "scale block",
                reason: format!("{}x{} has a zero side", self.rows, self.cols),
            });
        }
        Ok(())
    }
}

/// How a block's scale follows from its amax.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockScaleRule {
    /// Float8BlockScaling: `fp8_max / amax` rounded down to a power of two.
    Pow2,
    /// MXFP8: an E8M0 `scale_inv = 2^⌈log2(amax / fp8_max)⌉`.
    E8m0,
}

impl BlockScaleRule {
    /// `(scale, scale_inv)` of a block with this amax (amax 0, inf or NaN gives `(1, 1)`). The same steps as the
    /// kernel, on the host.
    pub fn scales(self, amax: f32, format: Fp8Format) -> (f32, f32) {
        let bits = amax.to_bits() & 0x7fff_ffff;
        if bits == 0 || bits >= 0x7f80_0000 {
            return (1.0, 1.0);
        }
        let amax = f32::from_bits(bits);
        match self {
            Self::Pow2 => {
                let scale_bits = (format.max() / amax).to_bits();
                let pow2 = if scale_bits >= 0x7f80_0000 {
                    0x7f00_0000
                } else {
                    scale_bits & 0xff80_0000
                };
                let scale = f32::from_bits(pow2);
                (scale, 1.0 / scale)
            }
            Self::E8m0 => {
                let ratio = (amax * (1.0 / format.max())).to_bits();
                let mut exponent = ratio >> 23;
                let mantissa = ratio & 0x7f_ffff;
                if mantissa > 0 && exponent != 0xfe && !(exponent == 0 && mantissa <= 0x40_0000) {
                    exponent += 1;
                }
                let exponent = exponent.min(254);
                if exponent == 0 {
                    (f32::from_bits(0x7f00_0000), f32::from_bits(0x40_0000))
                } else {
                    (
                        f32::from_bits((254 - exponent) << 23),
                        f32::from_bits(exponent << 23),
                    )
                }
            }
        }
    }
}
