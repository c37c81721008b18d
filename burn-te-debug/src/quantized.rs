//! A tensor as its GEMM quantizes it, read to the host (what dumps write and features inspect).

use burn_te::{ElementFormat, Nvfp4Scales, ScaleBlock};

/// A tensor quantized as its GEMM quantizes it, on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct Quantized {
    /// The shape as quantized: the tensor's, or its transpose's where the recipe quantizes the transpose (NVFP4's
    /// 1×16 blocks of a weight, which this crate stores `[in, out]`, laid along `in` as TE lays them).
    pub shape: Vec<usize>,
    /// The element format.
    pub format: ElementFormat,
    /// The codes, one per element, row-major.
    pub codes: Vec<u8>,
    /// `scale_inv`: one, or one per block (row-major over the block grid); NVFP4: each block's dequantization
    /// factor.
    pub scale_inv: Vec<f32>,
    /// The scale block (None: one scale for the tensor).
    pub block: Option<ScaleBlock>,
    /// NVFP4's E4M3 block scales and global amax.
    pub nvfp4: Option<Nvfp4Scales>,
}
