//! One operand of a host FP8 GEMM as the CPU backends hold it: codes, format, scales and layout.

use burn_te_kernels::ScaleBlock;

use crate::primitive::{ElementFormat, Nvfp4Scales};

/// One operand of a host FP8 GEMM.
pub(crate) struct HostOperand<'a> {
    /// The codes, row-major, one per byte.
    pub codes: &'a [u8],
    /// Their format.
    pub format: ElementFormat,
    /// `None`: one scale; `Some`: one per block of the tensor viewed as `[leading dims folded, last dim]`.
    pub block: Option<ScaleBlock>,
    /// The `scale_inv` values (NVFP4: each block's dequantization factor).
    pub scale_inv: &'a [f32],
    /// NVFP4's E4M3 block scales and global amax.
    pub nvfp4: Option<&'a Nvfp4Scales>,
    /// `(batch, rows, cols)` of the stored matrices.
    pub dims: (usize, usize, usize),
    /// Whether the GEMM reads the stored matrix transposed.
    pub transposed: bool,
}

impl HostOperand<'_> {
    /// Batch `b`'s first element and the (row, column) strides of the matrix as the GEMM reads it.
    pub fn layout(&self, b: usize) -> (usize, (usize, usize)) {
        let (batch, rows, cols) = self.dims;
        let offset = if batch > 1 { b * rows * cols } else { 0 };
        let strides = if self.transposed {
            (1, cols)
        } else {
            (cols, 1)
        };
        (offset, strides)
    }
}
