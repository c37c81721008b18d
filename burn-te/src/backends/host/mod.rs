//! [`TeBackend`] for the CPU backends (burn-flex, burn-ndarray) with the host path: the same numerics as the kernels
//! (bit-identical codes and scales), so machines without any Vulkan or CUDA device still train in FP8. The FP8 GEMM
//! ([`gemm`]) runs on the CPU's fastest exact instruction as measured at the first GEMM (bf16 dot products, f32
//! FMAs, or the `gemm` crate on decoded operands). One implementation, instantiated per backend by
//! `host_te_backend!`.

mod attention;
mod fused;
pub mod gemm;
#[cfg(feature = "flex")]
mod layout;
pub(crate) mod memory;
mod optim;
mod quantize;

pub use memory::{HOST_MALLOC_ENV, HOST_MALLOC_THRESHOLDS};

use std::sync::{Arc, Mutex};

#[cfg(feature = "flex")]
use burn::backend::Flex;
use burn::backend::NdArray;
#[cfg(feature = "flex")]
use burn::backend::flex::FlexTensor;
use burn::backend::ndarray::NdArrayTensor;
use burn::tensor::backend::{Backend, BackendTypes};
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{Shape, TensorData};
use burn_te_kernels::block_range::host_max_block_dynamic_range;
use burn_te_kernels::host::pool::{HostOutput, OutputValues};
use burn_te_kernels::{
    BlockScaleRule, DelayedScalingHistory, Fp8Format, Fp8Stats, ScaleBlock, host, pow2_margin,
    scale_from_amax,
};

use crate::backend::{
    ElementFormat, Fp8HostData, Fp8Primitive, Fp8Tensor, Nvfp4Scales, Scaling, TeBackend,
    gemm_output_shape,
};
use gemm::operand::HostOperand;

use crate::error::TeError;
use crate::primitive::rows_cols;

/// FP8 (or E2M1) codes, one per byte, and `scale_inv` values on the host, on a CPU backend's device `D`.
#[derive(Clone, Debug)]
pub struct HostFp8Data<D> {
    /// The codes, row-major.
    pub codes: Arc<Vec<u8>>,
    /// One `scale_inv`, or one per block (NVFP4: each block's dequantization factor).
    pub scale_inv: Arc<Vec<f32>>,
    /// NVFP4's E4M3 block scales and global amax.
    pub nvfp4: Option<Arc<Nvfp4Scales>>,
    device: D,
}

/// A delayed-scaling state on the host.
pub type HostDelayedState = Arc<Mutex<DelayedScalingHistory>>;

/// A tensor's f32 values on the host: a Flex tensor's own buffer when it holds contiguous f32 (no copy), else a
/// copy read through the backend.
enum HostValues {
    Copied(OutputValues),
    #[cfg(feature = "flex")]
    Flex(FlexTensor),
    /// The elements `start..end` of a Flex tensor's storage, in storage order (a permuted view's values).
    #[cfg(feature = "flex")]
    FlexStorage(FlexTensor, std::ops::Range<usize>),
}

impl std::ops::Deref for HostValues {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            HostValues::Copied(values) => values,
            #[cfg(feature = "flex")]
            HostValues::Flex(tensor) => tensor.as_slice::<f32>().unwrap_or_default(),
            #[cfg(feature = "flex")]
            HostValues::FlexStorage(tensor, range) => &tensor.storage::<f32>()[range.clone()],
        }
    }
}

impl HostValues {
    /// Whether these are a tensor's own contiguous buffer, read in place: the order in which the backend's own
    /// passes over the tensor read its values too.
    fn in_place(&self) -> bool {
        #[cfg(feature = "flex")]
        if let HostValues::Flex(_) = self {
            return true;
        }
        false
    }
}

/// The values and shape of any backend's tensor, copied out through `into_data`.
fn values<B: Backend>(tensor: FloatTensor<B>) -> Result<(HostValues, Shape), TeError> {
    let data = burn_te_kernels::cubecl::future::block_on(B::float_into_data(tensor))
        .map_err(|err| TeError::Read(format!("{err:?}")))?;
    let shape = data.shape.clone();
    let values = data
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|err| TeError::Read(format!("{err:?}")))?;
    Ok((HostValues::Copied(values.into()), shape))
}

/// A Flex tensor's values in place when it is f32 (made contiguous first if it is a strided view).
#[cfg(feature = "flex")]
fn flex_values(tensor: FlexTensor) -> Result<(HostValues, Shape), TeError> {
    if tensor.dtype() != burn::tensor::DType::F32 {
        return values::<Flex>(tensor);
    }
    if tensor.as_slice::<f32>().is_some() {
        let shape = tensor.layout().shape().clone();
        return Ok((HostValues::Flex(tensor), shape));
    }
    // A strided view (a permuted or transposed operand): copied out on the pool, a row or a tile of rows at a time
    // (Flex's own copy walks it one element at a time on one thread).
    let shape = tensor.layout().shape().clone();
    Ok(match layout::strided_values(&tensor) {
        Some(values) => (HostValues::Copied(values), shape),
        // A flipped view (negative strides).
        None => (HostValues::Flex(tensor.to_contiguous()), shape),
    })
}

/// Any backend's tensor copied out (row-major) for a reader of strided values.
fn strided_copy<B: Backend>(tensor: FloatTensor<B>) -> Result<attention::Strided, TeError> {
    let (values, shape) = values::<B>(tensor)?;
    Ok(attention::Strided {
        values,
        offset: 0,
        strides: attention::contiguous_strides(shape.as_slice()),
        shape,
    })
}

/// No transposed views: a backend whose tensors are read through a row-major copy ([`strided_copy`]).
fn never_transposed<T>(_: &T) -> bool {
    false
}

/// A Flex tensor's f32 values where they lie, with its view's offset and strides (no copy of a permuted or
/// narrowed view); a copy where a stride is negative (a flipped view).
#[cfg(feature = "flex")]
fn flex_strided(tensor: FlexTensor) -> Result<attention::Strided, TeError> {
    let layout = tensor.layout();
    if tensor.dtype() != burn::tensor::DType::F32 || layout.strides().iter().any(|&s| s < 0) {
        let (values, shape) = flex_values(tensor)?;
        let strides = attention::contiguous_strides(shape.as_slice());
        return Ok(attention::Strided {
            values,
            offset: 0,
            strides,
            shape,
        });
    }
    let (shape, offset) = (layout.shape().clone(), layout.start_offset());
    let strides = layout.strides().iter().map(|&s| s as usize).collect();
    let len = tensor.storage::<f32>().len();
    Ok(attention::Strided {
        values: HostValues::FlexStorage(tensor, 0..len),
        offset,
        strides,
        shape,
    })
}

/// A Flex tensor's values in any order, for what does not depend on it (counts, amax): a permuted view (e.g. a
/// transposed operand) whose elements fill a dense range of its storage is read in storage order, without the copy
/// that [`flex_values`] makes.
#[cfg(feature = "flex")]
fn flex_unordered_values(tensor: FlexTensor) -> Result<(HostValues, Shape), TeError> {
    let layout = tensor.layout();
    let range = (tensor.dtype() == burn::tensor::DType::F32)
        .then(|| dense_permutation(layout))
        .flatten()
        .filter(|range| range.end <= tensor.storage::<f32>().len());
    match range {
        Some(range) => {
            let shape = layout.shape().clone();
            Ok((HostValues::FlexStorage(tensor, range), shape))
        }
        None => flex_values(tensor),
    }
}

/// The storage range a view covers when its elements are a permutation of that range: positive strides that,
/// sorted, are the running products of the sizes.
#[cfg(feature = "flex")]
fn dense_permutation(layout: &burn::backend::flex::Layout) -> Option<std::ops::Range<usize>> {
    let shape = layout.shape();
    let mut dims: Vec<(isize, usize)> = (0..shape.num_dims())
        .filter(|&d| shape[d] > 1)
        .map(|d| (layout.strides()[d], shape[d]))
        .collect();
    dims.sort_unstable();
    let mut expected = 1usize;
    for (stride, size) in dims {
        if stride != expected as isize {
            return None;
        }
        expected *= size;
    }
    let start = layout.start_offset();
    Some(start..start + layout.num_elements())
}

/// The metrics report's counter prefix of host outputs from the output pool: `HostOutputPool(reused)` for freed
/// memory reused, `HostOutputPool(fresh)` for a block allocated (see `burn_te_kernels::host::pool`).
pub const HOST_OUTPUT_POOL: &str = "HostOutputPool";

/// A host kernel's f32 output as a tensor of the device's float type, as Burn makes its own new tensors: a model
/// whose device type is bf16 or f16 (`set_default_float_dtype`) gets bf16 or f16 outputs, not f32 ones beside its
/// other tensors.
fn host_tensor<B: Backend>(
    values: impl Into<OutputValues>,
    shape: Shape,
    device: &B::Device,
) -> FloatTensor<B> {
    use burn::tensor::DType;
    memory::configure();
    // A pooled buffer returns to the pool when the tensor drops.
    let values = values.into();
    if let Some(reused) = values.pooled() {
        let kind = if reused { "reused" } else { "fresh" };
        crate::metrics::increment_counter(&format!("{HOST_OUTPUT_POOL}({kind})"), 1);
    }
    let bytes = values.into_bytes();
    let data = TensorData::from_bytes(bytes, shape.as_slice().to_vec(), DType::F32);
    let dtype: DType = burn::tensor::get_device_settings::<B>(device)
        .float_dtype
        .into();
    let data = match dtype {
        DType::F32 => data,
        dtype => data.convert_dtype(dtype),
    };
    B::float_from_data(data, device)
}

/// TE's current scale of a tensor: `fp8_max / amax / 2^margin` (1 when amax is 0, inf or NaN).
fn current_scale(values: &[f32], format: Fp8Format, margin: f32) -> Result<f32, TeError> {
    Ok(scale_from_amax(
        host::amax(values),
        1.0,
        format,
        pow2_margin(margin)?,
    ))
}

fn lock(state: &HostDelayedState) -> std::sync::MutexGuard<'_, DelayedScalingHistory> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `TeBackend` for a CPU backend `$backend` on the host path; `$values` reads its tensors (`$unordered_values` where
/// the order does not matter, `$strided` at their strides), `$transposed_view` tells a transposed view,
/// `$buffer_id` tells their buffers apart, `$reshape`, `$slice_assign` and `$cat` are its layout ops.
macro_rules! host_te_backend {
    (
        $backend:ty,
        $values:path,
        $unordered_values:path,
        $strided:path,
        $transposed_view:path,
        $buffer_id:path,
        $reshape:expr,
        $slice_assign:expr,
        $cat:expr
    ) => {
        impl TeBackend for $backend {
            type Fp8Data = HostFp8Data<<$backend as BackendTypes>::Device>;
            type DelayedState = HostDelayedState;
            type PendingStats = Fp8Stats;

            $crate::te_linear_gemms!(fprop dgrad wgrad backward grouped cast);

            fn fp8_quantize(
                tensor: FloatTensor<Self>,
                format: Fp8Format,
                scaling: Scaling<'_, HostDelayedState>,
            ) -> Result<Fp8Primitive<Self>, TeError> {
                crate::metrics::count_launch(crate::metrics::names::QUANTIZE_LAUNCHES);
                let device = <$backend>::float_device(&tensor);
                // Per-tensor scales read the tensor at its strides (a permuted operand is not copied first).
                let per_tensor = |x: attention::Strided, (codes, scale_inv)| {
                    Ok(fp8_tensor(codes, vec![scale_inv], None, x.shape, format, device.clone()))
                };
                match scaling {
                    Scaling::Current { margin } => {
                        let x = $strided(tensor)?;
                        let quantized = quantize::current(&x, format, margin)?;
                        per_tensor(x, quantized)
                    }
                    Scaling::Delayed { state, record } => {
                        let x = $strided(tensor)?;
                        let quantized = quantize::delayed(&x, format, state, record)?;
                        per_tensor(x, quantized)
                    }
                    Scaling::Nvfp4 {
                        tile,
                        rounding,
                        rht,
                        amax_group,
                    } => {
                        let (x, shape) = $values(tensor)?;
                        let plan = (tile, rounding, rht);
                        nvfp4_quantize(&x, shape, format, plan, amax_group, device)
                    }
                    Scaling::Block { block, rule } => {
                        let (x, shape) = $values(tensor)?;
                        let (rows, cols) = rows_cols(&shape);
                        let (codes, scale_inv) =
                            host::block::block_quantize(&x, rows, cols, block, rule, format)?;
                        Ok(fp8_tensor(codes, scale_inv, Some(block), shape, format, device))
                    }
                }
            }

            fn fp8_transposed_view(tensor: &FloatTensor<Self>) -> bool {
                $transposed_view(tensor)
            }

            fn fp8_quantize_block_pair(
                tensor: FloatTensor<Self>,
                format: Fp8Format,
                layouts: [(ScaleBlock, BlockScaleRule); 2],
            ) -> Result<[Fp8Primitive<Self>; 2], TeError> {
                crate::metrics::count_launch(crate::metrics::names::QUANTIZE_LAUNCHES);
                let device = <$backend>::float_device(&tensor);
                let (x, shape) = $values(tensor)?;
                let (rows, cols) = rows_cols(&shape);
                let pair = host::block::block_quantize_pair(&x, rows, cols, layouts, format)?;
                let mut layouts = layouts.into_iter();
                Ok(pair.map(|(codes, scale_inv)| {
                    let (block, _) = layouts.next().expect("one layout per result");
                    let (shape, device) = (shape.clone(), device.clone());
                    fp8_tensor(codes, scale_inv, Some(block), shape, format, device)
                }))
            }

            fn te_norm_forward(
                x: FloatTensor<Self>,
                gamma: FloatTensor<Self>,
                beta: Option<FloatTensor<Self>>,
                spec: crate::fused::NormSpec,
            ) -> Result<crate::fused::NormForward<FloatTensor<Self>>, TeError> {
                let norm = crate::fused::NormOperands { x, gamma, beta, spec };
                fused::norm_forward::<$backend>($values, norm)
            }

            fn te_cast_input_forward(
                input: crate::fused::CastInput<FloatTensor<Self>>,
                format: Fp8Format,
                state: &HostDelayedState,
            ) -> Result<crate::fused::CastInputForward<Fp8Primitive<Self>, FloatTensor<Self>>, TeError> {
                fused::cast_input_forward::<$backend>($values, input, format, state)
            }

            fn te_norm_backward(
                dy: FloatTensor<Self>,
                x: FloatTensor<Self>,
                gamma: FloatTensor<Self>,
                saved: crate::fused::NormSaved<FloatTensor<Self>>,
                spec: crate::fused::NormSpec,
            ) -> crate::fused::NormGrads<FloatTensor<Self>> {
                fused::norm_backward::<$backend>($values, dy, x, gamma, saved, spec)
            }

            fn te_activation_forward(
                x: FloatTensor<Self>,
                f: crate::fused::Pointwise,
                gated: bool,
            ) -> Result<Option<FloatTensor<Self>>, TeError> {
                fused::activation_forward::<$backend>($values, x, f, gated)
            }

            fn te_activation_backward(
                dy: FloatTensor<Self>,
                x: FloatTensor<Self>,
                f: crate::fused::Pointwise,
                gated: bool,
            ) -> FloatTensor<Self> {
                fused::activation_backward::<$backend>($values, dy, x, f, gated)
            }

            fn te_add_bias(out: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
                fused::add_bias::<$backend>($values, out, bias)
            }

            fn te_bias_grad(output_grad: FloatTensor<Self>) -> FloatTensor<Self> {
                fused::bias_grad::<$backend>($values, output_grad)
            }

            fn te_reshape(tensor: FloatTensor<Self>, shape: Shape) -> FloatTensor<Self> {
                $reshape(tensor, shape)
            }

            fn te_slice_assign(
                tensor: FloatTensor<Self>,
                slices: &[burn::tensor::Slice],
                value: FloatTensor<Self>,
            ) -> FloatTensor<Self> {
                $slice_assign(tensor, slices, value)
            }

            fn te_cat(tensors: Vec<FloatTensor<Self>>, dim: usize) -> FloatTensor<Self> {
                $cat(tensors, dim)
            }

            fn te_adam_step(
                param: FloatTensor<Self>,
                grad: FloatTensor<Self>,
                moments: Option<[FloatTensor<Self>; 2]>,
                step: burn_te_kernels::host::optim::AdamStep,
                clip_norm: Option<f32>,
            ) -> Result<Option<[FloatTensor<Self>; 3]>, TeError> {
                optim::te_adam_step::<$backend>($values, param, grad, moments, step, clip_norm)
            }

            fn te_softmax_forward(
                scores: FloatTensor<Self>,
                scale: f32,
                mask: crate::fused::AttentionMask<burn::tensor::ops::BoolTensor<Self>>,
            ) -> Result<Option<FloatTensor<Self>>, TeError> {
                fused::softmax_forward::<$backend>($values, scores, scale, mask)
            }

            fn te_softmax_backward(
                dp: FloatTensor<Self>,
                probs: FloatTensor<Self>,
                scale: f32,
            ) -> FloatTensor<Self> {
                fused::softmax_backward::<$backend>($values, dp, probs, scale)
            }

            fn te_dropout_seed(device: &Self::Device) -> Option<u64> {
                Some(fused::dropout_seed::<$backend>(device))
            }

            fn te_dropout_forward(
                x: FloatTensor<Self>,
                mask: crate::fused::DropoutMask,
            ) -> Result<Option<FloatTensor<Self>>, TeError> {
                fused::dropout_forward::<$backend>($values, x, mask)
            }

            fn te_dropout_backward(
                dy: FloatTensor<Self>,
                mask: crate::fused::DropoutMask,
            ) -> FloatTensor<Self> {
                fused::dropout_backward::<$backend>($values, dy, mask)
            }

            fn te_attention_forward(
                q: FloatTensor<Self>,
                k: FloatTensor<Self>,
                v: FloatTensor<Self>,
                spec: crate::fused::AttentionSpec,
                mask: crate::fused::AttentionMask<burn::tensor::ops::BoolTensor<Self>>,
            ) -> Result<crate::fused::AttentionForward<FloatTensor<Self>>, TeError> {
                attention::attention_forward::<$backend>($strided, [q, k, v], spec, mask)
            }

            fn te_attention_backward(
                dout: FloatTensor<Self>,
                q: FloatTensor<Self>,
                k: FloatTensor<Self>,
                v: FloatTensor<Self>,
                lse: FloatTensor<Self>,
                spec: crate::fused::AttentionSpec,
                mask: crate::fused::AttentionMask<burn::tensor::ops::BoolTensor<Self>>,
            ) -> [FloatTensor<Self>; 3] {
                attention::attention_backward::<$backend>($strided, dout, [q, k, v], lse, spec, mask)
            }

            fn te_attention_packed_backward(
                dout: FloatTensor<Self>,
                q: FloatTensor<Self>,
                k: FloatTensor<Self>,
                v: FloatTensor<Self>,
                lse: FloatTensor<Self>,
                spec: crate::fused::AttentionSpec,
                mask: crate::fused::AttentionMask<burn::tensor::ops::BoolTensor<Self>>,
            ) -> FloatTensor<Self> {
                attention::attention_packed_backward::<$backend>(
                    $strided,
                    dout,
                    [q, k, v],
                    lse,
                    spec,
                    mask,
                )
            }

            fn fp8_read(tensor: &Fp8Primitive<Self>) -> Result<Fp8HostData, TeError> {
                Ok(Fp8HostData {
                    codes: tensor.data.codes.to_vec(),
                    scale_inv: tensor.data.scale_inv.to_vec(),
                    nvfp4: tensor.data.nvfp4.as_deref().cloned(),
                })
            }

            fn fp8_dequantize(tensor: Fp8Primitive<Self>) -> Result<FloatTensor<Self>, TeError> {
                check_operand(&tensor, "fp8_dequantize")?;
                let values = gemm::dequantize(&host_operand(&tensor, false));
                Ok(host_tensor::<$backend>(
                    values,
                    tensor.shape,
                    &tensor.data.device,
                ))
            }

            fn fp8_gemm(
                lhs: Fp8Primitive<Self>,
                lhs_t: bool,
                rhs: Fp8Primitive<Self>,
                rhs_t: bool,
            ) -> Result<FloatTensor<Self>, TeError> {
                crate::metrics::count_launch(crate::metrics::names::FP8_GEMM_LAUNCHES);
                host_gemm::<$backend>(lhs, lhs_t, rhs, rhs_t, None)
            }

            fn fp8_gemm_bias(
                lhs: Fp8Primitive<Self>,
                lhs_t: bool,
                rhs: Fp8Primitive<Self>,
                rhs_t: bool,
                bias: FloatTensor<Self>,
            ) -> Result<FloatTensor<Self>, TeError> {
                if !fused::f32_only::<$backend>(&bias) {
                    return crate::backend::gemm_then_bias::<Self>(lhs, lhs_t, rhs, rhs_t, bias);
                }
                crate::metrics::count_launch(crate::metrics::names::FP8_GEMM_LAUNCHES);
                let (bias, _) = $values(bias)?;
                host_gemm::<$backend>(lhs, lhs_t, rhs, rhs_t, Some(&bias))
            }

            // A GEMM that splits across the threads by itself (the host GEMM's split threshold).
            const GROUPED_GEMM_ALONE_FROM: Option<usize> = Some(192 * 192 * 192);

            fn fp8_gemm_grouped(
                gemms: Vec<crate::backend::GroupedGemmOperands<Self>>,
            ) -> Result<Vec<FloatTensor<Self>>, TeError> {
                // One parallel region for the group: counted as one launch.
                crate::metrics::count_launch(crate::metrics::names::FP8_GEMM_LAUNCHES);
                host_gemm_grouped::<$backend>(gemms)
            }

            fn fp8_amax(tensor: FloatTensor<Self>) -> Result<FloatTensor<Self>, TeError> {
                crate::metrics::count_launch(crate::metrics::names::AMAX_LAUNCHES);
                let device = <$backend>::float_device(&tensor);
                let (x, _) = $unordered_values(tensor)?;
                Ok(host_tensor::<$backend>(
                    vec![host::amax(&x)],
                    Shape::new([1]),
                    &device,
                ))
            }

            fn fp8_max_block_dynamic_range(
                tensor: FloatTensor<Self>,
                block: ScaleBlock,
            ) -> Result<FloatTensor<Self>, TeError> {
                let device = <$backend>::float_device(&tensor);
                let (x, shape) = $values(tensor)?;
                let (rows, cols) = rows_cols(&shape);
                let range = host_max_block_dynamic_range(&x, rows, cols, block)?;
                Ok(host_tensor::<$backend>(
                    vec![range as f32],
                    Shape::new([1]),
                    &device,
                ))
            }

            fn fp8_fake_quant(
                tensor: FloatTensor<Self>,
                format: Fp8Format,
                margin: f32,
            ) -> Result<FloatTensor<Self>, TeError> {
                crate::metrics::count_launch(crate::metrics::names::QUANTIZE_LAUNCHES);
                let device = <$backend>::float_device(&tensor);
                let (x, shape) = $values(tensor)?;
                let scale = current_scale(&x, format, margin)?;
                Ok(host_tensor::<$backend>(
                    host::fake_quant(&x, scale, format),
                    shape,
                    &device,
                ))
            }

            fn fp8_non_finite_launch(tensor: FloatTensor<Self>) -> Result<Fp8Stats, TeError> {
                let (x, _) = $unordered_values(tensor)?;
                Ok(Fp8Stats {
                    tensor: host::non_finite_counts(&x),
                    ..Fp8Stats::EMPTY
                })
            }

            fn fp8_stats_launch(
                tensor: FloatTensor<Self>,
                quantization: Option<(Fp8Format, Scaling<'_, HostDelayedState>)>,
            ) -> Result<Fp8Stats, TeError> {
                crate::metrics::count_launch(crate::metrics::names::STATS_LAUNCHES);
                let (x, shape) = $values(tensor)?;
                Ok(match quantization {
                    None => Fp8Stats {
                        tensor: host::tensor_stats(&x),
                        ..Fp8Stats::EMPTY
                    },
                    Some((format, Scaling::Current { margin })) => {
                        host::fp8_tensor_stats(&x, format, current_scale(&x, format, margin)?)
                    }
                    Some((format, Scaling::Delayed { state, .. })) => {
                        host::fp8_tensor_stats(&x, format, lock(state).scale)
                    }
                    Some((format, Scaling::Block { block, rule })) => {
                        let (rows, cols) = rows_cols(&shape);
                        host::block_fp8_tensor_stats(&x, rows, cols, block, rule, format)?
                    }
                    Some((format, Scaling::Nvfp4 { tile, rht, .. })) => {
                        crate::gemm::nvfp4::check_scale_format(format)?;
                        let (rows, cols) = rows_cols(&shape);
                        let transformed;
                        let input = if rht {
                            transformed = burn_te_kernels::host::nvfp4::rht(
                                &x,
                                cols,
                                burn_te_kernels::nvfp4::RHT_SIGN_MASK,
                            )?;
                            &transformed[..]
                        } else {
                            &x[..]
                        };
                        burn_te_kernels::host::nvfp4::tensor_stats(input, rows, cols, tile, None)?
                    }
                })
            }

            fn fp8_stats_read(pending: Fp8Stats) -> Result<Fp8Stats, TeError> {
                Ok(pending)
            }

            fn fp8_quantization_stats(
                tensor: FloatTensor<Self>,
                format: Fp8Format,
                scale: f32,
            ) -> Result<Fp8Stats, TeError> {
                crate::metrics::count_launch(crate::metrics::names::STATS_LAUNCHES);
                Ok(host::fp8_tensor_stats(&$values(tensor)?.0, format, scale))
            }

            fn fp8_delayed_state_read(
                state: &HostDelayedState,
            ) -> Result<(Vec<f32>, f32), TeError> {
                let history = lock(state);
                Ok((history.history.clone(), history.scale))
            }

            fn fp8_delayed_state_load(
                _device: &<$backend as BackendTypes>::Device,
                history: &[f32],
                scale: f32,
            ) -> Result<HostDelayedState, TeError> {
                let mut state = DelayedScalingHistory::new(history.len())?;
                state.history.copy_from_slice(history);
                state.scale = scale;
                state.scale_inv = 1.0 / scale;
                Ok(Arc::new(Mutex::new(state)))
            }

            fn fp8_delayed_state_len(state: &HostDelayedState) -> usize {
                lock(state).history.len()
            }

            fn buffer_id(tensor: &FloatTensor<Self>) -> Option<u64> {
                $buffer_id(tensor)
            }

            fn fp8_delayed_state_update(
                state: &HostDelayedState,
                algo: burn_te_kernels::AmaxComputeAlgo,
                format: Fp8Format,
                margin: f32,
            ) -> Result<(), TeError> {
                lock(state).update(algo, format, pow2_margin(margin)?);
                Ok(())
            }
        }
    };
}

host_te_backend!(
    NdArray,
    values::<NdArray>,
    values::<NdArray>,
    strided_copy::<NdArray>,
    never_transposed,
    ndarray_buffer_id,
    <NdArray as FloatTensorOps<NdArray>>::float_reshape,
    <NdArray as FloatTensorOps<NdArray>>::float_slice_assign,
    <NdArray as FloatTensorOps<NdArray>>::float_cat
);
#[cfg(feature = "flex")]
host_te_backend!(
    Flex,
    flex_values,
    flex_unordered_values,
    flex_strided,
    layout::transposed_view,
    flex_buffer_id,
    layout::flex_reshape,
    layout::flex_slice_assign,
    layout::flex_cat
);

/// The address of the first element and the shape: shared by clones (copy-on-write arrays), distinct for live
/// tensors.
fn ndarray_buffer_id(tensor: &NdArrayTensor) -> Option<u64> {
    let (address, shape) = match tensor {
        NdArrayTensor::F32(storage) => (
            storage.view().as_ptr() as usize,
            storage.view().shape().to_vec(),
        ),
        NdArrayTensor::F64(storage) => (
            storage.view().as_ptr() as usize,
            storage.view().shape().to_vec(),
        ),
        _ => return None,
    };
    Some(crate::hash::hash_of(&(address, shape)))
}

/// The shared storage's address and the view (offset, shape, strides).
#[cfg(feature = "flex")]
fn flex_buffer_id(tensor: &FlexTensor) -> Option<u64> {
    let layout = tensor.layout();
    let address = std::sync::Arc::as_ptr(&tensor.data_arc()) as usize;
    Some(crate::hash::hash_of(&(
        address,
        layout.start_offset(),
        layout.shape().as_slice().to_vec(),
        layout.strides().to_vec(),
    )))
}

/// NVFP4 on the host ([`burn_te_kernels::host::nvfp4`], bit-identical to the kernels): the codes one per byte, each
/// block's dequantization factor as its `scale_inv`.
fn nvfp4_quantize<D>(
    x: &[f32],
    shape: Shape,
    format: Fp8Format,
    (tile, rounding, rht): (
        burn_te_kernels::nvfp4::Nvfp4Tile,
        burn_te_kernels::nvfp4::Nvfp4Rounding,
        bool,
    ),
    amax_group: Option<&dyn crate::fp8_state::site::AmaxGroup>,
    device: D,
) -> Result<Fp8Tensor<HostFp8Data<D>>, TeError> {
    use burn_te_kernels::host::nvfp4;
    crate::gemm::nvfp4::check_scale_format(format)?;
    let (rows, cols) = rows_cols(&shape);
    let transformed;
    let input = if rht {
        transformed = nvfp4::rht(x, cols, burn_te_kernels::nvfp4::RHT_SIGN_MASK)?;
        &transformed[..]
    } else {
        x
    };
    // The global amax of a shard: the maximum over the ranks holding the others.
    let amax = match amax_group {
        Some(group) => Some(group.max("NVFP4 global amax", &[host::amax(input)])?[0]),
        None => None,
    };
    let quantized = nvfp4::quantize_codes(input, rows, cols, tile, amax, rounding)?;
    let factors = quantized
        .scales
        .iter()
        .map(|&code| burn_te_kernels::nvfp4::dequantize_factor(code, quantized.amax))
        .collect();
    Ok(Fp8Tensor {
        data: HostFp8Data {
            codes: Arc::new(quantized.codes),
            scale_inv: Arc::new(factors),
            nvfp4: Some(Arc::new(Nvfp4Scales {
                block_scales: quantized.scales,
                global_amax: quantized.amax,
            })),
            device,
        },
        shape,
        format: ElementFormat::E2m1,
        block: Some(tile.block()),
    })
}

/// A host FP8 tensor of `codes` and their `scale_inv` (one, or one per `block`).
fn fp8_tensor<D>(
    codes: Vec<u8>,
    scale_inv: Vec<f32>,
    block: Option<ScaleBlock>,
    shape: Shape,
    format: Fp8Format,
    device: D,
) -> Fp8Tensor<HostFp8Data<D>> {
    Fp8Tensor {
        data: HostFp8Data {
            codes: Arc::new(codes),
            scale_inv: Arc::new(scale_inv),
            nvfp4: None,
            device,
        },
        shape,
        format: format.into(),
        block,
    }
}

/// The FP8 GEMM on the host ([`gemm::host_fp8_gemm`]: the probe's or the requested path), with `bias` (one value
/// per output column) added in its epilogue; a batch of one broadcast against the other operand's batch.
fn host_gemm<B: Backend>(
    lhs: Fp8Tensor<HostFp8Data<B::Device>>,
    lhs_t: bool,
    rhs: Fp8Tensor<HostFp8Data<B::Device>>,
    rhs_t: bool,
    bias: Option<&[f32]>,
) -> Result<FloatTensor<B>, TeError> {
    let (shape, dims, mut out) = gemm_output(&lhs, lhs_t, &rhs, rhs_t)?;
    if let Some(bias) = bias
        && bias.len() != dims.1
    {
        return Err(TeError::InvalidShape {
            module: "fp8_gemm_bias".into(),
            reason: format!(
                "expected a bias of one value per output column ({})",
                dims.1
            ),
            shape: vec![bias.len()],
        });
    }
    let (a, b) = (host_operand(&lhs, lhs_t), host_operand(&rhs, rhs_t));
    gemm::host_fp8_gemm(&a, &b, dims, bias, &mut out);
    // SAFETY: `host_fp8_gemm` writes every value (each path does; a packed path that fails is followed by the f32
    // path over the whole output).
    let out = unsafe { out.assume_init() };
    Ok(host_tensor::<B>(out, shape, &lhs.data.device))
}

/// [`host_gemm`] of several GEMMs issued together ([`gemm::host_fp8_gemm_grouped`]).
fn host_gemm_grouped<B: Backend>(
    gemms: Vec<HostGemmOperands<B::Device>>,
) -> Result<Vec<FloatTensor<B>>, TeError> {
    let mut shapes = Vec::with_capacity(gemms.len());
    let mut grouped = Vec::with_capacity(gemms.len());
    for (lhs, lhs_t, rhs, rhs_t) in &gemms {
        let (shape, dims, out) = gemm_output(lhs, *lhs_t, rhs, *rhs_t)?;
        shapes.push(shape);
        grouped.push(gemm::GroupedHostGemm {
            lhs: host_operand(lhs, *lhs_t),
            rhs: host_operand(rhs, *rhs_t),
            dims,
            out,
        });
    }
    gemm::host_fp8_gemm_grouped(&mut grouped);
    Ok(grouped
        .into_iter()
        .zip(shapes)
        .zip(&gemms)
        .map(|((gemm, shape), (lhs, ..))| {
            // SAFETY: as in `host_gemm`: every GEMM's output is written whole.
            let out = unsafe { gemm.out.assume_init() };
            host_tensor::<B>(out, shape, &lhs.data.device)
        })
        .collect())
}

/// One GEMM of [`host_gemm_grouped`]: `(lhs, lhs_t, rhs, rhs_t)`.
type HostGemmOperands<D> = (
    Fp8Tensor<HostFp8Data<D>>,
    bool,
    Fp8Tensor<HostFp8Data<D>>,
    bool,
);

/// A GEMM's output shape, `(m, n, k)` and output buffer (not yet written: every GEMM path writes all of it).
type GemmOutput = (Shape, (usize, usize, usize), HostOutput);

/// The [`GemmOutput`] of `lhs · rhs` (each used transposed where asked).
fn gemm_output<D>(
    lhs: &Fp8Tensor<HostFp8Data<D>>,
    lhs_t: bool,
    rhs: &Fp8Tensor<HostFp8Data<D>>,
    rhs_t: bool,
) -> Result<GemmOutput, TeError> {
    check_operand(lhs, "fp8_gemm lhs")?;
    check_operand(rhs, "fp8_gemm rhs")?;
    let shape = gemm_output_shape(lhs, lhs_t, rhs, rhs_t)?;
    let (_, lr, lc) = lhs.matrix_dims();
    let (_, rr, rc) = rhs.matrix_dims();
    let (m, k) = if lhs_t { (lc, lr) } else { (lr, lc) };
    let n = if rhs_t { rr } else { rc };
    let len = element_count(shape.as_slice()).ok_or_else(|| TeError::ShapeMismatch {
        op: "fp8_gemm",
        reason: format!(
            "the output {:?} has more elements than memory can address",
            shape.as_slice()
        ),
        lhs: lhs.shape.as_slice().to_vec(),
        rhs: rhs.shape.as_slice().to_vec(),
    })?;
    memory::configure();
    let out = HostOutput::uninit(len);
    Ok((shape, (m, n, k), out))
}

/// The number of elements of a tensor of `dims`, `None` where it overflows.
fn element_count(dims: &[usize]) -> Option<usize> {
    dims.iter()
        .try_fold(1usize, |count, &d| count.checked_mul(d))
}

/// An error unless the host FP8 tensor's buffers fit its shape and scales: one code per element, one `scale_inv`
/// (per tensor) or one per block of its grid (and as many NVFP4 block scales). The GEMM paths read the buffers
/// through the shape, so a tensor whose public fields were changed apart is refused here.
fn check_operand<D>(t: &Fp8Tensor<HostFp8Data<D>>, what: &'static str) -> Result<(), TeError> {
    let dims = t.shape.as_slice();
    let error = |reason: String| TeError::InvalidShape {
        module: what.into(),
        reason,
        shape: dims.to_vec(),
    };
    let elements =
        element_count(dims).ok_or_else(|| error("more elements than memory can address".into()))?;
    let codes = t.data.codes.len();
    if codes != elements {
        return Err(error(format!(
            "the tensor holds {codes} codes for {elements} elements"
        )));
    }
    let scales = t.data.scale_inv.len();
    let expected = t.scale_count(what)?;
    if scales != expected {
        return Err(error(format!(
            "the tensor holds {scales} scale_inv values for {expected} (its scale blocks: {:?})",
            t.block
        )));
    }
    if let Some(nvfp4) = &t.data.nvfp4
        && nvfp4.block_scales.len() != expected
    {
        return Err(error(format!(
            "the tensor holds {} NVFP4 block scales for {expected} blocks",
            nvfp4.block_scales.len()
        )));
    }
    Ok(())
}

/// A host FP8 tensor as [`gemm`] reads it.
fn host_operand<D>(t: &Fp8Tensor<HostFp8Data<D>>, transposed: bool) -> HostOperand<'_> {
    HostOperand {
        codes: &t.data.codes,
        format: t.format,
        block: t.block,
        scale_inv: &t.data.scale_inv,
        nvfp4: t.data.nvfp4.as_deref(),
        dims: t.matrix_dims(),
        transposed,
    }
}
