//! The plain types of burn-te's FP8 ops, independent of any backend: a quantized tensor and its element format,
//! its host data, how a quantization chooses its scale, the GEMM's output shape, and what a linear's forward keeps
//! for its backward. Generic over the backend's buffers; [`TeBackend`](crate::TeBackend) names them for a backend.

use burn::tensor::Shape;
use burn_te_kernels::nvfp4::{Nvfp4Rounding, Nvfp4Tile, decode_e2m1};
use burn_te_kernels::{BlockScaleRule, Fp8Format, ScaleBlock};

use crate::error::TeError;

/// The format of a quantized tensor's elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementFormat {
    /// FP8 codes.
    Fp8(Fp8Format),
    /// NVFP4's E2M1 codes, scaled per block by an E4M3 scale and a global FP32 scale.
    E2m1,
}

impl ElementFormat {
    /// The value of a code (E2M1: its low four bits).
    pub fn decode(self, code: u8) -> f32 {
        match self {
            ElementFormat::Fp8(format) => format.decode(code),
            ElementFormat::E2m1 => decode_e2m1(code),
        }
    }

    /// Lower-case name, as in file names and logs: `e4m3`, `e5m2` or `e2m1`.
    pub fn name(self) -> &'static str {
        match self {
            ElementFormat::Fp8(format) => format.name(),
            ElementFormat::E2m1 => "e2m1",
        }
    }
}

impl From<Fp8Format> for ElementFormat {
    fn from(format: Fp8Format) -> Self {
        ElementFormat::Fp8(format)
    }
}

/// A quantized tensor (FP8, or NVFP4's E2M1): the backend's buffers (codes and `scale_inv`) and what they mean.
#[derive(Clone, Debug)]
pub struct Fp8Tensor<D> {
    /// The backend's buffers: the codes (row-major) and the `scale_inv` values (NVFP4: each block's dequantization
    /// factor `(e4m3(s) · amax) / 2688`).
    pub data: D,
    /// The tensor's shape.
    pub shape: Shape,
    /// The format of the codes.
    pub format: ElementFormat,
    /// `None`: one scale for the tensor; `Some(block)`: one scale per block of the tensor viewed as
    /// `[leading dims folded, last dim]`.
    pub block: Option<ScaleBlock>,
}

impl<D> Fp8Tensor<D> {
    /// The tensor as `(batch, rows, cols)`: the last two dimensions, everything before folded into the batch; a
    /// vector is one row.
    pub fn matrix_dims(&self) -> (usize, usize, usize) {
        let dims = self.shape.as_slice();
        match dims.len() {
            0 => (1, 1, 1),
            1 => (1, 1, dims[0]),
            n => (dims[..n - 2].iter().product(), dims[n - 2], dims[n - 1]),
        }
    }

    /// How many `scale_inv` values the tensor holds: one, or one per block of its grid (the tensor viewed as
    /// `[leading dims folded, last dim]`); an error naming `op` for an empty block.
    pub fn scale_count(&self, op: &str) -> Result<usize, TeError> {
        match self.block {
            None => Ok(1),
            Some(block) if block.rows == 0 || block.cols == 0 => Err(TeError::InvalidShape {
                module: op.into(),
                reason: format!("an empty {}x{} scale block", block.rows, block.cols),
                shape: self.shape.as_slice().to_vec(),
            }),
            Some(block) => {
                let (rows, cols) = rows_cols(&self.shape);
                let (grid_rows, grid_cols) = block.grid(rows, cols);
                Ok(grid_rows * grid_cols)
            }
        }
    }
}

/// A quantized tensor's buffers on the host, read by [`TeBackend::fp8_read`](crate::TeBackend::fp8_read).
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8HostData {
    /// The codes, one per element (E2M1: one nibble per byte), row-major.
    pub codes: Vec<u8>,
    /// `scale_inv`: one value, or one per block (row-major over the block grid); NVFP4: each block's
    /// dequantization factor.
    pub scale_inv: Vec<f32>,
    /// NVFP4's two-level scales (`None` for FP8).
    pub nvfp4: Option<Nvfp4Scales>,
}

/// The scales of an NVFP4 tensor as TE stores them.
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Scales {
    /// The E4M3 code of each block's decode scale, row-major over the block grid.
    pub block_scales: Vec<u8>,
    /// The global amax (TE stores it, not the global scale).
    pub global_amax: f32,
}

/// Reduces a sharded tensor's amax over the ranks that hold its shards (a tensor-parallel group).
pub trait AmaxGroup: core::fmt::Debug + Send + Sync {
    /// The element-wise maximum of `values` over the group (NaN where any rank's is NaN); a collective call.
    fn max(&self, what: &str, values: &[f32]) -> Result<Vec<f32>, TeError>;
}

/// How a quantization chooses its scale.
#[derive(Debug)]
pub enum Scaling<'a, S> {
    /// Current scaling: `scale = fp8_max / amax(x) / 2^margin` from the tensor itself.
    Current {
        /// TE's margin (the scale is divided by `2^margin`).
        margin: f32,
    },
    /// Delayed scaling: quantize with the state's scale (from the amax history before this iteration); with
    /// `record`, also record this tensor's amax into the history's newest slot (the max of what is there).
    /// [`TeBackend::fp8_delayed_state_update`](crate::TeBackend::fp8_delayed_state_update) rolls the history and recomputes the scale.
    Delayed {
        /// The per-(layer, tensor) history and scale.
        state: &'a S,
        /// Record this tensor's amax (false: only use the scale).
        record: bool,
    },
    /// One scale per block of the tensor viewed as `[leading dims folded, last dim]`, from the block's amax.
    Block {
        /// The block shape.
        block: ScaleBlock,
        /// Power-of-two (Float8BlockScaling) or E8M0 (MXFP8) scales.
        rule: BlockScaleRule,
    },
    /// NVFP4: E2M1 codes, one E4M3 scale per block and a global scale from the tensor's amax (after the RHT);
    /// the `format` of the quantization must be E4M3 (the block scales' format). The blocks lie on the tensor
    /// viewed as `[leading dims folded, last dim]`.
    Nvfp4 {
        /// 1×16 blocks or 16×16 tiles.
        tile: Nvfp4Tile,
        /// Nearest-even or stochastic rounding.
        rounding: Nvfp4Rounding,
        /// Quantize the random Hadamard transform of the tensor (16-element chunks of its last dimension, which
        /// must be a multiple of 16) instead of the tensor.
        rht: bool,
        /// The ranks holding the other shards of this tensor (tensor parallelism): the global amax is the maximum
        /// over them, so every shard is quantized as the whole tensor would be. `None`: this tensor's own.
        amax_group: Option<&'a dyn AmaxGroup>,
    },
}

/// `(rows, cols)` of a tensor viewed as `[leading dims folded, last dim]`.
pub(crate) fn rows_cols(shape: &Shape) -> (usize, usize) {
    match shape.as_slice().split_last() {
        None => (1, 1),
        Some((last, leading)) => (leading.iter().product(), *last),
    }
}

/// The output shape of [`TeBackend::fp8_gemm`](crate::TeBackend::fp8_gemm): the batch dimensions of the batched operand, then `[M, N]`.
pub fn gemm_output_shape<D>(
    lhs: &Fp8Tensor<D>,
    lhs_t: bool,
    rhs: &Fp8Tensor<D>,
    rhs_t: bool,
) -> Result<Shape, TeError> {
    let (lb, lr, lc) = lhs.matrix_dims();
    let (rb, rr, rc) = rhs.matrix_dims();
    let (m, k) = if lhs_t { (lc, lr) } else { (lr, lc) };
    let (k_rhs, n) = if rhs_t { (rc, rr) } else { (rr, rc) };
    let error = |reason: String| TeError::ShapeMismatch {
        op: "fp8_gemm",
        reason,
        lhs: lhs.shape.as_slice().to_vec(),
        rhs: rhs.shape.as_slice().to_vec(),
    };
    if k != k_rhs {
        return Err(error(format!("inner dimensions differ: {k} vs {k_rhs}")));
    }
    if lb != rb && lb != 1 && rb != 1 {
        return Err(error(format!("batches differ: {lb} vs {rb}")));
    }
    // The batch of one is the one broadcast: an empty batch against a batch of one stays empty.
    let batched = if lb == rb || rb == 1 {
        &lhs.shape
    } else {
        &rhs.shape
    };
    let leading = batched.as_slice().len().saturating_sub(2);
    let mut dims = batched.as_slice()[..leading].to_vec();
    dims.extend([m, n]);
    Ok(Shape::from(dims))
}

/// A forward operand as a linear's backward GEMM gets it.
#[derive(Clone, Debug)]
pub enum Saved<F, D> {
    /// The high-precision tensor, quantized (or not) by the backward GEMM itself.
    HighPrecision(F),
    /// Quantized by the forward for the backward GEMM.
    Quantized(SavedQuantized<D>),
}

/// An operand quantized by the forward in the layout its backward GEMM consumes.
#[derive(Clone, Debug)]
pub struct SavedQuantized<D> {
    /// The quantized tensor (of the operand, or of its transpose).
    pub tensor: Fp8Tensor<D>,
    /// `tensor` holds the operand's transpose (NVFP4's columnwise copy), which the GEMM reads transposed back.
    pub transposed: bool,
    /// The operand's shape as the GEMM takes it (an input folded to `[tokens, in]`).
    pub shape: Shape,
}

impl<D> SavedQuantized<D> {
    /// The bytes it holds on a device: one per FP8 code (half per E2M1 code) and four per scale.
    pub fn bytes(&self) -> usize {
        let numel = self.tensor.shape.num_elements();
        let codes = match self.tensor.format {
            ElementFormat::Fp8(_) => numel,
            ElementFormat::E2m1 => numel.div_ceil(2),
        };
        let scales = match self.tensor.block {
            None => 1,
            Some(block) => {
                let (batch, rows, cols) = self.tensor.matrix_dims();
                (batch * rows).div_ceil(block.rows) * cols.div_ceil(block.cols)
            }
        };
        codes + 4 * scales
    }
}

impl<F, D> Saved<F, D> {
    /// Whether the forward quantized it.
    pub fn is_quantized(&self) -> bool {
        matches!(self, Saved::Quantized(_))
    }
}

/// What [`te_linear_fprop`](crate::TeBackend::te_linear_fprop) keeps for the backward: `[input for wgrad,
/// weight for dgrad]`, each quantized as the backward GEMM consumes it, or `None` (not asked for).
pub type SavedForBackward<D> = [Option<SavedQuantized<D>>; 2];
