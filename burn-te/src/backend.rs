//! The [`TeBackend`] extension trait: FP8 quantization, GEMM and statistics on a backend's tensors.

use burn::tensor::Shape;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn_te_kernels::nvfp4::{Nvfp4Rounding, Nvfp4Tile, decode_e2m1};
use burn_te_kernels::{
    AmaxComputeAlgo, BlockScaleRule, Fp8Format, Fp8Stats, ScaleBlock, TensorStats,
};

use crate::fp8_gemm::{SavedForBackward, fold_rows};
use crate::saved::SavedOperand;
use crate::site::{Gemm, GemmSite};
use crate::{Recipe, TeError};

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
}

/// A quantized tensor's buffers on the host, read by [`TeBackend::fp8_read`].
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

/// The FP8 quantized primitive of a [`TeBackend`].
pub type Fp8Primitive<B> = Fp8Tensor<<B as TeBackend>::Fp8Data>;

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
    /// [`TeBackend::fp8_delayed_state_update`] rolls the history and recomputes the scale.
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
    },
}

/// FP8 operations a backend provides to burn-te: Burn's extension-trait pattern.
///
/// Implemented with the CubeCL kernels for `CubeBackend` (wgpu, CUDA), with the bit-identical host path for
/// `NdArray`, and by forwarding for [`crate::Te`] and `Autodiff` (which adds the FP8 GEMM's backward).
pub trait TeBackend: Backend {
    /// The backend's FP8 buffers (codes and `scale_inv`).
    type Fp8Data: Clone + core::fmt::Debug + Send + Sync + 'static;
    /// A delayed-scaling state on the device: amax history and scale of one tensor.
    type DelayedState: Clone + core::fmt::Debug + Send + Sync + 'static;

    /// Quantizes a float tensor to `format` with the given scaling.
    fn fp8_quantize(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        scaling: Scaling<'_, Self::DelayedState>,
    ) -> Result<Fp8Primitive<Self>, TeError>;

    /// Reads a quantized tensor to the host (a sync point): its codes, row-major, and its `scale_inv` values (one,
    /// or one per block, row-major over the block grid).
    fn fp8_read(tensor: &Fp8Primitive<Self>) -> Result<Fp8HostData, TeError>;

    /// `decode(code) * scale_inv` as a float tensor of the quantized shape.
    fn fp8_dequantize(tensor: Fp8Primitive<Self>) -> Result<FloatTensor<Self>, TeError>;

    /// FP8 GEMM with f32 accumulation: `lhs` used as `[.., M, K]` (transposed with `lhs_t`), `rhs` as
    /// `[.., K, N]` (transposed with `rhs_t`); leading dimensions are batches (equal, or 1 to broadcast).
    /// Returns `[.., M, N]` in the backend's float type.
    fn fp8_gemm(
        lhs: Fp8Primitive<Self>,
        lhs_t: bool,
        rhs: Fp8Primitive<Self>,
        rhs_t: bool,
    ) -> Result<FloatTensor<Self>, TeError>;

    /// max |x| as a one-element tensor (NaN propagates; 0 for an empty tensor).
    fn fp8_amax(tensor: FloatTensor<Self>) -> Result<FloatTensor<Self>, TeError>;

    /// The largest `log2(max |x|) − log2(min nonzero |x|)` over the blocks of the tensor viewed as
    /// `[leading dims folded, last dim]` (an all-zero block counts 0; NaN propagates), as a one-element f32 tensor
    /// computed on the device: the debug tools' `max_blockwise_dynamic_range`.
    fn fp8_max_block_dynamic_range(
        tensor: FloatTensor<Self>,
        block: ScaleBlock,
    ) -> Result<FloatTensor<Self>, TeError>;

    /// Quantize-dequantize with a per-tensor current scale (`fp8_max / amax / 2^margin`).
    fn fp8_fake_quant(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        margin: f32,
    ) -> Result<FloatTensor<Self>, TeError>;

    /// Statistics launched on the device and not read back yet (see [`fp8_stats_launch`](Self::fp8_stats_launch)).
    type PendingStats: Send + 'static;

    /// Statistics of the tensor (one pass on the device, then one read).
    fn fp8_stats(tensor: FloatTensor<Self>) -> Result<TensorStats, TeError> {
        Ok(Self::fp8_stats_read(Self::fp8_stats_launch(tensor, None)?)?.tensor)
    }

    /// Launches the one-pass statistics of `tensor` without waiting for the device; with `quantization`, they also
    /// count what quantizing with that scaling gives: underflows, overflows, squared error and the range of the
    /// `scale_inv` applied (NVFP4: the blocks' dequantization factors, with round to nearest; under the RHT, the
    /// statistics are those of the transformed tensor, whose squared error equals the operand's, the transform
    /// being orthogonal) (a delayed state's scale is used, not updated; block scalings take one scale per block
    /// of the tensor viewed as `[leading dims folded, last dim]`, as [`fp8_quantize`](Self::fp8_quantize) does).
    /// [`fp8_stats_read`](Self::fp8_stats_read) reads them later, so a debug step syncs once, not once per tensor.
    fn fp8_stats_launch(
        tensor: FloatTensor<Self>,
        quantization: Option<(Fp8Format, Scaling<'_, Self::DelayedState>)>,
    ) -> Result<Self::PendingStats, TeError>;

    /// Reads launched statistics back (waits for the device).
    fn fp8_stats_read(pending: Self::PendingStats) -> Result<Fp8Stats, TeError>;

    /// Reads many launched statistics back together, in order: one wait for the device on the CubeCL backends
    /// (the diagnostics' step-end read of every non-finite check), where reading each would wait once each.
    fn fp8_stats_read_many(pending: Vec<Self::PendingStats>) -> Result<Vec<Fp8Stats>, TeError> {
        pending.into_iter().map(Self::fp8_stats_read).collect()
    }

    /// Launches a count of the tensor's NaN, +inf and -inf elements (the diagnostics' non-finite tracking), read
    /// with [`fp8_stats_read`](Self::fp8_stats_read): only `numel` and the NaN/inf counts of its `tensor` stats are
    /// meaningful. The full statistics by default; the CubeCL backends and the host path count only.
    fn fp8_non_finite_launch(tensor: FloatTensor<Self>) -> Result<Self::PendingStats, TeError> {
        Self::fp8_stats_launch(tensor, None)
    }

    /// Statistics plus the FP8 underflow/overflow counts and squared error of quantizing with `scale`.
    fn fp8_quantization_stats(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        scale: f32,
    ) -> Result<Fp8Stats, TeError>;

    /// A new delayed-scaling state: history of `history_len` zeros, scale 1.
    fn fp8_delayed_state(
        device: &Self::Device,
        history_len: usize,
    ) -> Result<Self::DelayedState, TeError> {
        Self::fp8_delayed_state_load(device, &vec![0.0; history_len], 1.0)
    }

    /// Reads a delayed-scaling state back: `(amax history, scale)`, the history in TE's layout: slot 0 this iteration's amax, slot `len − k` the amax of `k` iterations ago.
    fn fp8_delayed_state_read(state: &Self::DelayedState) -> Result<(Vec<f32>, f32), TeError>;

    /// A delayed-scaling state holding `history` (in the layout of [`fp8_delayed_state_read`](Self::fp8_delayed_state_read), at least one entry) and `scale` (a saved state).
    fn fp8_delayed_state_load(
        device: &Self::Device,
        history: &[f32],
        scale: f32,
    ) -> Result<Self::DelayedState, TeError>;

    /// The history length of a delayed-scaling state.
    fn fp8_delayed_state_len(state: &Self::DelayedState) -> usize;

    /// End of an iteration for one tensor (TE's amax-and-scale update): the amax from the window (`algo`), roll
    /// the window (the newest slot becomes zero), `scale = fp8_max(format) / amax / 2^margin` (amax 0, inf or NaN
    /// keeps the scale). On the device; nothing is read back.
    fn fp8_delayed_state_update(
        state: &Self::DelayedState,
        algo: AmaxComputeAlgo,
        format: Fp8Format,
        margin: f32,
    ) -> Result<(), TeError>;

    /// An identity of the tensor's device buffer: equal for clones of one tensor, different for tensors alive at
    /// the same time; `None` where the backend cannot tell. The backward GEMMs of plain Burn linears find their
    /// forward by it (see [`crate::autocast`]).
    fn buffer_id(_tensor: &FloatTensor<Self>) -> Option<u64> {
        None
    }

    /// The layer GEMM `gemm` in high precision on its operands in [`Gemm::operands`]' order (fprop: `x`, `weight`,
    /// plus `bias`; dgrad: `grad`, `weight`; wgrad: `x`, `grad`), neither counted nor observed: the reference the
    /// debug tools measure a low-precision GEMM's error against. Decorators forward it to their inner backend.
    fn te_reference_gemm(
        gemm: Gemm,
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        match gemm {
            Gemm::Fprop => high_precision_linear::<Self>(lhs, rhs, bias),
            Gemm::Dgrad => high_precision_dgrad::<Self>(rhs, lhs),
            Gemm::Wgrad => high_precision_wgrad::<Self>(lhs, rhs),
        }
    }

    /// A linear layer's forward GEMM at `site`: `x [.., in] · weight [in, out] + bias` in FP8 with `recipe`, or in
    /// high precision with `None`. On autodiff backends its backward runs [`te_linear_dgrad`](Self::te_linear_dgrad)
    /// and [`te_linear_wgrad`](Self::te_linear_wgrad) with the same recipe, on the operands
    /// [`te_linear_fprop`](Self::te_linear_fprop) kept.
    fn te_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        site: &GemmSite,
        recipe: Option<&Recipe>,
    ) -> FloatTensor<Self> {
        Self::te_linear_fprop(x, weight, bias, site, recipe, [false, false]).0
    }

    /// [`te_linear`](Self::te_linear) that also keeps, for the backward, the input (`save[0]`, for wgrad) and the
    /// weight (`save[1]`, for dgrad) quantized as the backward GEMMs consume them; `None` where it keeps nothing
    /// (not asked, no recipe, a high-precision fallback): the backward then takes the high-precision tensor. See
    /// [`crate::saved`]. Decorators implement this one; autodiff backends implement `te_linear`.
    fn te_linear_fprop(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        site: &GemmSite,
        recipe: Option<&Recipe>,
        save: [bool; 2],
    ) -> (FloatTensor<Self>, SavedForBackward<Self::Fp8Data>) {
        match recipe {
            None => {
                count_high_precision();
                (high_precision_linear::<Self>(x, weight, bias), [None, None])
            }
            Some(recipe) => {
                let fp8 = crate::fp8_gemm::linear_fprop::<Self>(
                    x.clone(),
                    weight.clone(),
                    bias.clone(),
                    site,
                    recipe,
                    [None, None],
                    save,
                );
                crate::fp8_gemm::or_high_precision_saving::<Self>(site, fp8, || {
                    high_precision_linear::<Self>(x, weight, bias)
                })
            }
        }
    }

    /// A linear layer's input-gradient GEMM (dgrad): `grad · weightᵀ`, on the weight its forward kept.
    fn te_linear_dgrad(
        weight: SavedOperand<Self>,
        grad: FloatTensor<Self>,
        site: &GemmSite,
        recipe: Option<&Recipe>,
    ) -> FloatTensor<Self> {
        let high_precision = |weight: SavedOperand<Self>, grad| {
            crate::saved::values::<Self>(weight).map(|w| high_precision_dgrad::<Self>(w, grad))
        };
        match recipe {
            None => {
                count_high_precision();
                crate::saved::or_panic::<Self>(site, high_precision(weight, grad))
            }
            Some(recipe) => {
                let fp8 = crate::fp8_gemm::linear_dgrad::<Self>(
                    weight.clone(),
                    grad.clone(),
                    site,
                    recipe,
                    [None, None],
                );
                crate::fp8_gemm::or_high_precision::<Self>(site, fp8, || {
                    crate::saved::or_panic::<Self>(site, high_precision(weight, grad))
                })
            }
        }
    }

    /// A linear layer's weight-gradient GEMM (wgrad): `xᵀ · grad`, on the input its forward kept.
    fn te_linear_wgrad(
        x: SavedOperand<Self>,
        grad: FloatTensor<Self>,
        site: &GemmSite,
        recipe: Option<&Recipe>,
    ) -> FloatTensor<Self> {
        let high_precision = |x: SavedOperand<Self>, grad| {
            crate::saved::values::<Self>(x).map(|x| high_precision_wgrad::<Self>(x, grad))
        };
        match recipe {
            None => {
                count_high_precision();
                crate::saved::or_panic::<Self>(site, high_precision(x, grad))
            }
            Some(recipe) => {
                let fp8 = crate::fp8_gemm::linear_wgrad::<Self>(
                    x.clone(),
                    grad.clone(),
                    site,
                    recipe,
                    [None, None],
                );
                crate::fp8_gemm::or_high_precision::<Self>(site, fp8, || {
                    crate::saved::or_panic::<Self>(site, high_precision(x, grad))
                })
            }
        }
    }
}

/// Counts a layer GEMM run in high precision by choice (no recipe).
fn count_high_precision() {
    crate::diagnostics::increment_counter(crate::diagnostics::names::GEMM_HIGH_PRECISION, 1);
}

/// The zeros a GEMM with a zero-sized dimension gives (`out` elements; `None` when neither operand is empty):
/// answered here because Burn's ndarray matmul divides by zero on an empty operand. An empty batch gives an empty
/// output, and a weight gradient over no tokens is a zero matrix.
pub(crate) fn zero_sized_gemm<B: Backend>(
    lhs: &FloatTensor<B>,
    rhs: &FloatTensor<B>,
    out: Vec<usize>,
) -> Option<FloatTensor<B>> {
    use burn::tensor::TensorMetadata;
    if lhs.shape().num_elements() > 0 && rhs.shape().num_elements() > 0 {
        return None;
    }
    let dtype = lhs.dtype().into();
    Some(B::float_zeros(
        Shape::from(out),
        &B::float_device(lhs),
        dtype,
    ))
}

/// The last dimension of a tensor (0 for a scalar).
fn last_dim<B: Backend>(tensor: &FloatTensor<B>) -> usize {
    use burn::tensor::TensorMetadata;
    tensor.shape().as_slice().last().copied().unwrap_or(0)
}

/// `x · weight + bias` in high precision (the inner backend's `linear` on rows folded to rank 2: Flex's rank-3
/// `linear` with its backward takes 13× the time, `benches/host_path.rs`; zero-sized operands answered here).
pub(crate) fn high_precision_linear<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    use burn::tensor::TensorMetadata;
    let mut out = x.shape().as_slice().to_vec();
    if let Some(last) = out.last_mut() {
        *last = last_dim::<B>(&weight);
    }
    match zero_sized_gemm::<B>(&x, &weight, out.clone()) {
        // No reduction (in_features 0) but tokens: the output is the bias.
        Some(zeros) => match bias {
            Some(bias) if out.iter().product::<usize>() > 0 => {
                let mut shape = vec![1; out.len()];
                if let Some(last) = shape.last_mut() {
                    *last = last_dim::<B>(&bias);
                }
                B::float_add(zeros, B::float_reshape(bias, Shape::from(shape)))
            }
            _ => zeros,
        },
        None => B::float_reshape(
            B::linear(fold_rows::<B>(x).0, weight, bias),
            Shape::from(out),
        ),
    }
}

/// `grad · weightᵀ` in high precision (zero-sized operands answered here).
pub(crate) fn high_precision_dgrad<B: Backend>(
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    use burn::tensor::TensorMetadata;
    let mut out = grad.shape().as_slice().to_vec();
    if let Some(last) = out.last_mut() {
        *last = weight.shape().as_slice().first().copied().unwrap_or(0);
    }
    zero_sized_gemm::<B>(&grad, &weight, out.clone()).unwrap_or_else(|| {
        B::float_reshape(
            B::linear_x_backward(weight, fold_rows::<B>(grad).0),
            Shape::from(out),
        )
    })
}

/// `xᵀ · grad` summed over the leading dimensions, in high precision (zero-sized operands answered here).
pub(crate) fn high_precision_wgrad<B: Backend>(
    x: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let out = vec![last_dim::<B>(&x), last_dim::<B>(&grad)];
    zero_sized_gemm::<B>(&x, &grad, out)
        .unwrap_or_else(|| B::linear_weight_backward(fold_rows::<B>(x).0, fold_rows::<B>(grad).0))
}

/// The output shape of [`TeBackend::fp8_gemm`]: the batch dimensions of the batched operand, then `[M, N]`.
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
    let batched = if lb >= rb { &lhs.shape } else { &rhs.shape };
    let leading = batched.as_slice().len().saturating_sub(2);
    let mut dims = batched.as_slice()[..leading].to_vec();
    dims.extend([m, n]);
    Ok(Shape::from(dims))
}

/// The FP8 ops of a [`TeBackend`] decorator whose primitives are its inner backend's: every op but the `te_linear`
/// GEMMs forwards to `$inner`. Used inside `impl TeBackend for Decorator<B>` by `Te<B>` and the debug tools.
#[doc(hidden)]
#[macro_export]
macro_rules! forward_fp8_ops {
    ($inner:ident) => {
        type Fp8Data = $inner::Fp8Data;
        type DelayedState = $inner::DelayedState;
        type PendingStats = $inner::PendingStats;

        fn fp8_quantize(
            tensor: $crate::__private::FloatTensor<Self>,
            format: $crate::Fp8Format,
            scaling: $crate::Scaling<'_, Self::DelayedState>,
        ) -> Result<$crate::Fp8Primitive<Self>, $crate::TeError> {
            $inner::fp8_quantize(tensor, format, scaling)
        }
        fn fp8_read(
            tensor: &$crate::Fp8Primitive<Self>,
        ) -> Result<$crate::Fp8HostData, $crate::TeError> {
            $inner::fp8_read(tensor)
        }
        fn fp8_dequantize(
            tensor: $crate::Fp8Primitive<Self>,
        ) -> Result<$crate::__private::FloatTensor<Self>, $crate::TeError> {
            $inner::fp8_dequantize(tensor)
        }
        fn fp8_gemm(
            lhs: $crate::Fp8Primitive<Self>,
            lhs_t: bool,
            rhs: $crate::Fp8Primitive<Self>,
            rhs_t: bool,
        ) -> Result<$crate::__private::FloatTensor<Self>, $crate::TeError> {
            $inner::fp8_gemm(lhs, lhs_t, rhs, rhs_t)
        }
        fn fp8_amax(
            tensor: $crate::__private::FloatTensor<Self>,
        ) -> Result<$crate::__private::FloatTensor<Self>, $crate::TeError> {
            $inner::fp8_amax(tensor)
        }
        fn fp8_max_block_dynamic_range(
            tensor: $crate::__private::FloatTensor<Self>,
            block: $crate::ScaleBlock,
        ) -> Result<$crate::__private::FloatTensor<Self>, $crate::TeError> {
            $inner::fp8_max_block_dynamic_range(tensor, block)
        }
        fn fp8_fake_quant(
            tensor: $crate::__private::FloatTensor<Self>,
            format: $crate::Fp8Format,
            margin: f32,
        ) -> Result<$crate::__private::FloatTensor<Self>, $crate::TeError> {
            $inner::fp8_fake_quant(tensor, format, margin)
        }
        fn fp8_stats_launch(
            tensor: $crate::__private::FloatTensor<Self>,
            quantization: Option<($crate::Fp8Format, $crate::Scaling<'_, Self::DelayedState>)>,
        ) -> Result<Self::PendingStats, $crate::TeError> {
            $inner::fp8_stats_launch(tensor, quantization)
        }
        fn fp8_non_finite_launch(
            tensor: $crate::__private::FloatTensor<Self>,
        ) -> Result<Self::PendingStats, $crate::TeError> {
            $inner::fp8_non_finite_launch(tensor)
        }
        fn fp8_stats_read(
            pending: Self::PendingStats,
        ) -> Result<$crate::Fp8Stats, $crate::TeError> {
            $inner::fp8_stats_read(pending)
        }
        fn fp8_stats_read_many(
            pending: Vec<Self::PendingStats>,
        ) -> Result<Vec<$crate::Fp8Stats>, $crate::TeError> {
            $inner::fp8_stats_read_many(pending)
        }
        fn fp8_quantization_stats(
            tensor: $crate::__private::FloatTensor<Self>,
            format: $crate::Fp8Format,
            scale: f32,
        ) -> Result<$crate::Fp8Stats, $crate::TeError> {
            $inner::fp8_quantization_stats(tensor, format, scale)
        }
        fn fp8_delayed_state_read(
            state: &Self::DelayedState,
        ) -> Result<(Vec<f32>, f32), $crate::TeError> {
            $inner::fp8_delayed_state_read(state)
        }
        fn fp8_delayed_state_load(
            device: &Self::Device,
            history: &[f32],
            scale: f32,
        ) -> Result<Self::DelayedState, $crate::TeError> {
            $inner::fp8_delayed_state_load(device, history, scale)
        }
        fn fp8_delayed_state_len(state: &Self::DelayedState) -> usize {
            $inner::fp8_delayed_state_len(state)
        }
        fn buffer_id(tensor: &$crate::__private::FloatTensor<Self>) -> Option<u64> {
            $inner::buffer_id(tensor)
        }
        fn te_reference_gemm(
            gemm: $crate::Gemm,
            lhs: $crate::__private::FloatTensor<Self>,
            rhs: $crate::__private::FloatTensor<Self>,
            bias: Option<$crate::__private::FloatTensor<Self>>,
        ) -> $crate::__private::FloatTensor<Self> {
            $inner::te_reference_gemm(gemm, lhs, rhs, bias)
        }
        fn fp8_delayed_state_update(
            state: &Self::DelayedState,
            algo: $crate::AmaxComputeAlgo,
            format: $crate::Fp8Format,
            margin: f32,
        ) -> Result<(), $crate::TeError> {
            $inner::fp8_delayed_state_update(state, algo, format, margin)
        }
    };
}
