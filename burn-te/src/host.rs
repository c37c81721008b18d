//! [`TeBackend`] for the CPU backends (burn-flex, burn-ndarray) with the host path: the same numerics as the kernels
//! (bit-identical codes and scales), so machines without any Vulkan or CUDA device still train in FP8. The FP8 GEMM
//! dequantizes its operands and runs the backend's own f32 matmul (a real GEMM library: `gemm` on Flex,
//! `matrixmultiply` on NdArray). One implementation, instantiated per backend by `host_te_backend!`.

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
use burn_te_kernels::block::{host_block_quantize, host_block_tensor_stats};
use burn_te_kernels::block_range::host_max_block_dynamic_range;
use burn_te_kernels::{
    DelayedScalingHistory, Fp8Format, Fp8Stats, ScaleBlock, host, pow2_margin, scale_from_amax,
};

use crate::TeError;
use crate::backend::{Fp8HostData, Fp8Primitive, Fp8Tensor, Scaling, TeBackend, gemm_output_shape};
use crate::cube::rows_cols;

/// FP8 codes (one per byte) and `scale_inv` values on the host, on a CPU backend's device `D`.
#[derive(Clone, Debug)]
pub struct HostFp8Data<D> {
    /// The codes, row-major.
    pub codes: Arc<Vec<u8>>,
    /// One `scale_inv`, or one per block.
    pub scale_inv: Arc<Vec<f32>>,
    device: D,
}

/// A delayed-scaling state on the host.
pub type HostDelayedState = Arc<Mutex<DelayedScalingHistory>>;

fn values<B: Backend>(tensor: FloatTensor<B>) -> Result<(Vec<f32>, Shape), TeError> {
    let data = burn_te_kernels::cubecl::future::block_on(B::float_into_data(tensor))
        .map_err(|err| TeError::Read(format!("{err:?}")))?;
    let shape = data.shape.clone();
    let values = data
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|err| TeError::Read(format!("{err:?}")))?;
    Ok((values, shape))
}

fn host_tensor<B: Backend>(values: Vec<f32>, shape: Shape, device: &B::Device) -> FloatTensor<B> {
    B::float_from_data(TensorData::new(values, shape.as_slice().to_vec()), device)
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

/// `TeBackend` for a CPU backend `$backend` on the host path; `$buffer_id` tells its tensors' buffers apart.
macro_rules! host_te_backend {
    ($backend:ty, $buffer_id:path) => {
        impl TeBackend for $backend {
            type Fp8Data = HostFp8Data<<$backend as BackendTypes>::Device>;
            type DelayedState = HostDelayedState;
            type PendingStats = Fp8Stats;

            fn fp8_quantize(
                tensor: FloatTensor<Self>,
                format: Fp8Format,
                scaling: Scaling<'_, HostDelayedState>,
            ) -> Result<Fp8Primitive<Self>, TeError> {
                let device = <$backend>::float_device(&tensor);
                let (x, shape) = values::<$backend>(tensor)?;
                let (codes, scale_inv, block) = match scaling {
                    Scaling::Current { margin } => {
                        let scale = current_scale(&x, format, margin)?;
                        (host::quantize(&x, scale, format), vec![1.0 / scale], None)
                    }
                    Scaling::Delayed { state, record } => {
                        let mut history = lock(state);
                        let (scale, scale_inv) = (history.scale, history.scale_inv);
                        let codes = host::quantize(&x, scale, format);
                        if record {
                            history.record(host::amax(&x));
                        }
                        (codes, vec![scale_inv], None)
                    }
                    Scaling::Block { block, rule } => {
                        let (rows, cols) = rows_cols(&shape);
                        let (codes, scale_inv) =
                            host_block_quantize(&x, rows, cols, block, rule, format)?;
                        (codes, scale_inv, Some(block))
                    }
                };
                Ok(Fp8Tensor {
                    data: HostFp8Data {
                        codes: Arc::new(codes),
                        scale_inv: Arc::new(scale_inv),
                        device,
                    },
                    shape,
                    format,
                    block,
                })
            }

            fn fp8_read(tensor: &Fp8Primitive<Self>) -> Result<Fp8HostData, TeError> {
                Ok(Fp8HostData {
                    codes: tensor.data.codes.to_vec(),
                    scale_inv: tensor.data.scale_inv.to_vec(),
                })
            }

            fn fp8_dequantize(tensor: Fp8Primitive<Self>) -> Result<FloatTensor<Self>, TeError> {
                let values = dequantized(&tensor);
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
                host_gemm::<$backend>(lhs, lhs_t, rhs, rhs_t)
            }

            fn fp8_amax(tensor: FloatTensor<Self>) -> Result<FloatTensor<Self>, TeError> {
                let device = <$backend>::float_device(&tensor);
                let (x, _) = values::<$backend>(tensor)?;
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
                let (x, shape) = values::<$backend>(tensor)?;
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
                let device = <$backend>::float_device(&tensor);
                let (x, shape) = values::<$backend>(tensor)?;
                let scale = current_scale(&x, format, margin)?;
                Ok(host_tensor::<$backend>(
                    host::fake_quant(&x, scale, format),
                    shape,
                    &device,
                ))
            }

            fn fp8_stats_launch(
                tensor: FloatTensor<Self>,
                quantization: Option<(Fp8Format, Scaling<'_, HostDelayedState>)>,
            ) -> Result<Fp8Stats, TeError> {
                let (x, shape) = values::<$backend>(tensor)?;
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
                        host_block_tensor_stats(&x, rows, cols, block, rule, format)?
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
                Ok(host::fp8_tensor_stats(
                    &values::<$backend>(tensor)?.0,
                    format,
                    scale,
                ))
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

host_te_backend!(NdArray, ndarray_buffer_id);
#[cfg(feature = "flex")]
host_te_backend!(Flex, flex_buffer_id);

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
    Some(hash_of(&(address, shape)))
}

/// The shared storage's address and the view (offset, shape, strides).
#[cfg(feature = "flex")]
fn flex_buffer_id(tensor: &FlexTensor) -> Option<u64> {
    let layout = tensor.layout();
    let address = std::sync::Arc::as_ptr(&tensor.data_arc()) as usize;
    Some(hash_of(&(
        address,
        layout.start_offset(),
        layout.shape().as_slice().to_vec(),
        layout.strides().to_vec(),
    )))
}

fn hash_of(value: &impl std::hash::Hash) -> u64 {
    use std::hash::Hasher;
    let mut hasher = std::hash::DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

/// The FP8 GEMM on the host: both operands dequantized (`decode(code) · scale_inv`, per tensor or per block), then
/// the backend's f32 matmul (batched; a batch of one broadcasts), transposed operands as strided views.
fn host_gemm<B: Backend>(
    lhs: Fp8Tensor<HostFp8Data<B::Device>>,
    lhs_t: bool,
    rhs: Fp8Tensor<HostFp8Data<B::Device>>,
    rhs_t: bool,
) -> Result<FloatTensor<B>, TeError> {
    let shape = gemm_output_shape(&lhs, lhs_t, &rhs, rhs_t)?;
    let device = lhs.data.device.clone();
    // Unbatched GEMMs (every linear's) as rank-2 matmuls: the backends' fastest path.
    let batched = lhs.matrix_dims().0 > 1 || rhs.matrix_dims().0 > 1;
    let operand = |x: &Fp8Tensor<HostFp8Data<B::Device>>, transposed: bool| {
        let (batch, rows, cols) = x.matrix_dims();
        let dims = if batched {
            vec![batch, rows, cols]
        } else {
            vec![rows, cols]
        };
        let matrix = host_tensor::<B>(dequantized(x), Shape::from(dims), &device);
        let last = if batched { 2 } else { 1 };
        if transposed {
            B::float_swap_dims(matrix, last - 1, last)
        } else {
            matrix
        }
    };
    let (a, b) = (operand(&lhs, lhs_t), operand(&rhs, rhs_t));
    if let Some(zeros) = crate::backend::zero_sized_gemm::<B>(&a, &b, shape.as_slice().to_vec()) {
        return Ok(zeros);
    }
    Ok(B::float_reshape(B::float_matmul(a, b), shape))
}

/// `decode(code) · scale_inv` of every element (per tensor or per block).
fn dequantized<D>(tensor: &Fp8Tensor<HostFp8Data<D>>) -> Vec<f32> {
    let data = &tensor.data;
    match tensor.block {
        None => host::dequantize(&data.codes, data.scale_inv[0], tensor.format),
        Some(block) => {
            let (_, cols) = rows_cols(&tensor.shape);
            data.codes
                .iter()
                .enumerate()
                .map(|(i, &code)| {
                    let slot = block.slot(i, cols);
                    tensor.format.decode(code) * data.scale_inv[slot]
                })
                .collect()
        }
    }
}
