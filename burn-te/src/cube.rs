//! [`TeBackend`] for Burn's CubeCL backends (wgpu, CUDA): the kernels of `burn-te-kernels` on the tensors' device
//! buffers. Scales and amax histories stay on the device, so no op waits for the host except the statistics.

use burn::tensor::{DType, Shape};
use burn_cubecl::element::{BoolElement, FloatElement, IntElement};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use burn_te_kernels::cubecl::prelude::*;
use burn_te_kernels::cubecl::server::Handle;
use burn_te_kernels::gemm::{GemmOperand, OperandCodes, fp8_gemm};
use burn_te_kernels::ops::{self, Fp8Buffer, ScaleBuffers};
use burn_te_kernels::{Fp8Format, Fp8Stats, KernelError, block};

use crate::TeError;
use crate::backend::{Fp8HostData, Fp8Primitive, Fp8Tensor, Scaling, TeBackend};

/// FP8 buffers on a CubeCL device.
#[derive(Clone)]
pub struct CubeFp8Data<R: CubeRuntime> {
    /// Codes, four per `u32` word, row-major.
    pub codes: Handle,
    /// `scale_inv`: one f32, or one per block.
    pub scale_inv: Handle,
    client: ComputeClient<R>,
    device: R::Device,
}

/// A delayed-scaling state on a CubeCL device: `[history_len]` amax history and the scale buffers.
#[derive(Clone)]
pub struct CubeDelayedState<R: CubeRuntime> {
    history: Handle,
    history_len: usize,
    scales: ScaleBuffers,
    client: ComputeClient<R>,
}

/// Statistics launched on a CubeCL device: the partial records, read at [`TeBackend::fp8_stats_read`].
pub struct CubePendingStats<R: CubeRuntime> {
    readback: ops::StatsReadback,
    client: ComputeClient<R>,
}

impl<R: CubeRuntime> core::fmt::Debug for CubeFp8Data<R> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CubeFp8Data")
            .field("codes", &self.codes)
            .field("scale_inv", &self.scale_inv)
            .field("device", &self.device)
            .finish()
    }
}

impl<R: CubeRuntime> core::fmt::Debug for CubeDelayedState<R> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CubeDelayedState")
            .field("history", &self.history)
            .field("history_len", &self.history_len)
            .field("scales", &self.scales)
            .finish()
    }
}

/// Runs `$body` with `$t` bound to the element type of a float dtype (f32, f16), or fails with the op's name.
macro_rules! with_float {
    ($dtype:expr, $op:literal, $t:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                $body
            }
            dtype => Err(TeError::UnsupportedDType { op: $op, dtype }),
        }
    };
}

fn float_output<R: CubeRuntime>(
    like: &CubeTensor<R>,
    handle: Handle,
    shape: Shape,
) -> CubeTensor<R> {
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        shape,
        handle,
        like.dtype,
    )
}

fn fp8_tensor<R: CubeRuntime>(
    like: &CubeTensor<R>,
    codes: Fp8Buffer,
    scale_inv: Handle,
    block: Option<block::ScaleBlock>,
) -> Fp8Tensor<CubeFp8Data<R>> {
    Fp8Tensor {
        data: CubeFp8Data {
            codes: codes.codes,
            scale_inv,
            client: like.client.clone(),
            device: like.device.clone(),
        },
        shape: like.meta.shape().clone(),
        format: codes.format,
        block,
    }
}

fn quantize<R: CubeRuntime, F: Float + CubeElement>(
    x: &CubeTensor<R>,
    format: Fp8Format,
    scaling: Scaling<'_, CubeDelayedState<R>>,
) -> Result<(Fp8Buffer, Handle, Option<block::ScaleBlock>), TeError> {
    let client = &x.client;
    let len = x.meta.shape().num_elements();
    match scaling {
        Scaling::Current { margin } => {
            let amax = ops::amax::<R, F>(client, &x.handle, len)?;
            let scales = ScaleBuffers::new(client, 1, 1.0);
            ops::compute_scale(client, &amax, &scales, format, margin)?;
            let codes = ops::quantize::<R, F>(client, &x.handle, len, &scales.scale, format, None)?;
            Ok((codes, scales.scale_inv, None))
        }
        Scaling::Delayed { state, record } => {
            // The scale in use; copied, as a later update changes the state's buffers in place.
            let scale_inv = copy_scalar(client, &state.scales.scale_inv)?;
            let codes = ops::quantize::<R, F>(
                client,
                &x.handle,
                len,
                &state.scales.scale,
                format,
                record.then_some(&state.history),
            )?;
            Ok((codes, scale_inv, None))
        }
        Scaling::Block { block, rule } => {
            let (rows, cols) = rows_cols(x.meta.shape());
            let quantized =
                block::block_quantize::<R, F>(client, &x.handle, rows, cols, block, rule, format)?;
            Ok((quantized.codes, quantized.scale_inv, Some(block)))
        }
    }
}

/// A one-element copy on the device.
fn copy_scalar<R: CubeRuntime>(
    client: &ComputeClient<R>,
    handle: &Handle,
) -> Result<Handle, TeError> {
    Ok(ops::copy_f32(client, handle, 1)?)
}

/// `(rows, cols)` of a tensor viewed as `[leading dims folded, last dim]`.
pub(crate) fn rows_cols(shape: &Shape) -> (usize, usize) {
    match shape.as_slice().split_last() {
        None => (1, 1),
        Some((last, leading)) => (leading.iter().product(), *last),
    }
}

/// The identity of a CubeCL buffer slice: the managed memory's id (a process-wide counter that CubeCL never
/// reuses) and the slice's offsets. CubeCL 0.10 shows the id only through `Debug`
/// (`ManagedMemoryId { value: N }`); the tests check that clones share it and distinct tensors do not.
fn buffer_id(handle: &Handle) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let memory = format!("{:?}", handle.memory);
    let digits = memory.split("value: ").nth(1)?;
    let end = digits
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(digits.len());
    let id: u64 = digits[..end].parse().ok()?;
    let mut hasher = std::hash::DefaultHasher::new();
    (id, handle.offset_start, handle.offset_end).hash(&mut hasher);
    Some(hasher.finish())
}

fn read_error(err: KernelError) -> TeError {
    TeError::Kernel(err)
}

impl<R, F, I, BT> TeBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    type Fp8Data = CubeFp8Data<R>;
    type DelayedState = CubeDelayedState<R>;
    type PendingStats = CubePendingStats<R>;

    fn fp8_quantize(
        tensor: CubeTensor<R>,
        format: Fp8Format,
        scaling: Scaling<'_, CubeDelayedState<R>>,
    ) -> Result<Fp8Primitive<Self>, TeError> {
        crate::diagnostics::count_launch(crate::diagnostics::names::QUANTIZE_LAUNCHES);
        let x = into_contiguous(tensor);
        let (codes, scale_inv, block) =
            with_float!(x.dtype, "fp8_quantize", T => quantize::<R, T>(&x, format, scaling))?;
        Ok(fp8_tensor(&x, codes, scale_inv, block))
    }

    fn fp8_read(tensor: &Fp8Primitive<Self>) -> Result<Fp8HostData, TeError> {
        let client = &tensor.data.client;
        let len = tensor.shape.num_elements();
        let scales = match tensor.block {
            None => 1,
            Some(block) => {
                let (rows, cols) = rows_cols(&tensor.shape);
                let (grid_rows, grid_cols) = block.grid(rows, cols);
                grid_rows * grid_cols
            }
        };
        let read = |handle: &Handle| -> Result<Vec<u8>, TeError> {
            crate::diagnostics::timed_read(handle.size() as usize, || {
                Ok(client
                    .read_one(handle.clone())
                    .map_err(KernelError::from)?
                    .to_vec())
            })
        };
        let mut codes = read(&tensor.data.codes)?;
        codes.truncate(len);
        let scale_inv = read(&tensor.data.scale_inv)?;
        let scale_inv = f32::from_bytes(&scale_inv)[..scales].to_vec();
        Ok(Fp8HostData { codes, scale_inv })
    }

    fn fp8_dequantize(tensor: Fp8Primitive<Self>) -> Result<CubeTensor<R>, TeError> {
        let data = &tensor.data;
        let len = tensor.shape.num_elements();
        let buffer = Fp8Buffer {
            codes: data.codes.clone(),
            len,
            format: tensor.format,
        };
        let client = &data.client;
        let handle = match tensor.block {
            None => ops::dequantize::<R, F>(client, &buffer, &data.scale_inv)?,
            Some(block) => {
                let (rows, cols) = rows_cols(&tensor.shape);
                block::block_dequantize::<R, F>(
                    client,
                    &buffer,
                    &data.scale_inv,
                    rows,
                    cols,
                    block,
                )?
            }
        };
        Ok(CubeTensor::new_contiguous(
            client.clone(),
            data.device.clone(),
            tensor.shape,
            handle,
            F::dtype(),
        ))
    }

    fn fp8_gemm(
        lhs: Fp8Primitive<Self>,
        lhs_t: bool,
        rhs: Fp8Primitive<Self>,
        rhs_t: bool,
    ) -> Result<CubeTensor<R>, TeError> {
        crate::diagnostics::count_launch(crate::diagnostics::names::FP8_GEMM_LAUNCHES);
        let shape = crate::backend::gemm_output_shape(&lhs, lhs_t, &rhs, rhs_t)?;
        let operand = |q: &Fp8Primitive<Self>, transposed: bool| {
            let (batch, rows, cols) = q.matrix_dims();
            (
                Fp8Buffer {
                    codes: q.data.codes.clone(),
                    len: q.shape.num_elements(),
                    format: q.format,
                },
                batch,
                rows,
                cols,
                transposed,
            )
        };
        let (a_codes, a_batch, a_rows, a_cols, _) = operand(&lhs, lhs_t);
        let (b_codes, b_batch, b_rows, b_cols, _) = operand(&rhs, rhs_t);
        let a = GemmOperand {
            codes: OperandCodes::Fp8(&a_codes),
            scale_inv: &lhs.data.scale_inv,
            batch: a_batch,
            rows: a_rows,
            cols: a_cols,
            block: lhs.block,
            transposed: lhs_t,
        };
        let b = GemmOperand {
            codes: OperandCodes::Fp8(&b_codes),
            scale_inv: &rhs.data.scale_inv,
            batch: b_batch,
            rows: b_rows,
            cols: b_cols,
            block: rhs.block,
            transposed: rhs_t,
        };
        let client = &lhs.data.client;
        let handle = fp8_gemm::<R, F>(client, &a, &b)?;
        Ok(CubeTensor::new_contiguous(
            client.clone(),
            lhs.data.device.clone(),
            shape,
            handle,
            F::dtype(),
        ))
    }

    fn fp8_amax(tensor: CubeTensor<R>) -> Result<CubeTensor<R>, TeError> {
        crate::diagnostics::count_launch(crate::diagnostics::names::AMAX_LAUNCHES);
        let x = into_contiguous(tensor);
        let len = x.meta.shape().num_elements();
        let handle = with_float!(x.dtype, "fp8_amax", T => Ok(ops::amax::<R, T>(&x.client, &x.handle, len)?))?;
        let out = float_output(&x, handle, Shape::new([1]));
        Ok(CubeTensor {
            dtype: DType::F32,
            ..out
        })
    }

    fn fp8_max_block_dynamic_range(
        tensor: CubeTensor<R>,
        block: block::ScaleBlock,
    ) -> Result<CubeTensor<R>, TeError> {
        let x = into_contiguous(tensor);
        let (rows, cols) = rows_cols(x.meta.shape());
        let handle = with_float!(x.dtype, "fp8_max_block_dynamic_range", T => Ok(
            burn_te_kernels::block_range::max_block_dynamic_range::<R, T>(&x.client, &x.handle, rows, cols, block)?
        ))?;
        let out = float_output(&x, handle, Shape::new([1]));
        Ok(CubeTensor {
            dtype: DType::F32,
            ..out
        })
    }

    fn fp8_fake_quant(
        tensor: CubeTensor<R>,
        format: Fp8Format,
        margin: f32,
    ) -> Result<CubeTensor<R>, TeError> {
        crate::diagnostics::count_launch(crate::diagnostics::names::QUANTIZE_LAUNCHES);
        let x = into_contiguous(tensor);
        let len = x.meta.shape().num_elements();
        let client = &x.client;
        let handle = with_float!(x.dtype, "fp8_fake_quant", T => {
            let amax = ops::amax::<R, T>(client, &x.handle, len)?;
            let scales = ScaleBuffers::new(client, 1, 1.0);
            ops::compute_scale(client, &amax, &scales, format, margin)?;
            Ok(ops::fake_quant::<R, T>(client, &x.handle, len, &scales.scale, format)?)
        })?;
        Ok(float_output(&x, handle, x.meta.shape().clone()))
    }

    fn fp8_stats_launch(
        tensor: CubeTensor<R>,
        quantization: Option<(Fp8Format, Scaling<'_, CubeDelayedState<R>>)>,
    ) -> Result<CubePendingStats<R>, TeError> {
        crate::diagnostics::count_launch(crate::diagnostics::names::STATS_LAUNCHES);
        let x = into_contiguous(tensor);
        let len = x.meta.shape().num_elements();
        let client = &x.client;
        let readback = with_float!(x.dtype, "fp8_stats", T => {
            Ok(match quantization {
                None => ops::tensor_stats::<R, T>(client, &x.handle, len)?,
                Some((format, Scaling::Current { margin })) => {
                    let amax = ops::amax::<R, T>(client, &x.handle, len)?;
                    let scales = ScaleBuffers::new(client, 1, 1.0);
                    ops::compute_scale(client, &amax, &scales, format, margin)?;
                    ops::fp8_tensor_stats::<R, T>(client, &x.handle, len, format, &scales.scale)?
                }
                // The kernel reads the state's scale in stream order, before any later update of it.
                Some((format, Scaling::Delayed { state, .. })) => {
                    ops::fp8_tensor_stats::<R, T>(client, &x.handle, len, format, &state.scales.scale)?
                }
                Some((format, Scaling::Block { block, rule })) => {
                    let (rows, cols) = rows_cols(x.meta.shape());
                    block::block_tensor_stats::<R, T>(client, &x.handle, rows, cols, block, rule, format)?
                }
            })
        })?;
        Ok(CubePendingStats {
            readback,
            client: client.clone(),
        })
    }

    fn fp8_stats_read(pending: CubePendingStats<R>) -> Result<Fp8Stats, TeError> {
        crate::diagnostics::timed_read(pending.readback.bytes(), || {
            pending
                .readback
                .read_fp8(&pending.client)
                .map_err(read_error)
        })
    }

    fn fp8_quantization_stats(
        tensor: CubeTensor<R>,
        format: Fp8Format,
        scale: f32,
    ) -> Result<Fp8Stats, TeError> {
        crate::diagnostics::count_launch(crate::diagnostics::names::STATS_LAUNCHES);
        let x = into_contiguous(tensor);
        let len = x.meta.shape().num_elements();
        let scale = ops::scalar_buffer(&x.client, scale);
        let readback = with_float!(x.dtype, "fp8_quantization_stats", T => Ok(ops::fp8_tensor_stats::<R, T>(&x.client, &x.handle, len, format, &scale)?))?;
        crate::diagnostics::timed_read(readback.bytes(), || {
            readback.read_fp8(&x.client).map_err(read_error)
        })
    }

    fn fp8_delayed_state_read(state: &CubeDelayedState<R>) -> Result<(Vec<f32>, f32), TeError> {
        let client = &state.client;
        let history = crate::diagnostics::timed_read(state.history_len * 4, || {
            client.read_one(state.history.clone())
        })
        .map_err(KernelError::from)?;
        let history = f32::from_bytes(&history)[..state.history_len].to_vec();
        let scale = ops::read_scalar(client, &state.scales.scale)?;
        Ok((history, scale))
    }

    fn fp8_delayed_state_load(
        device: &R::Device,
        history: &[f32],
        scale: f32,
    ) -> Result<CubeDelayedState<R>, TeError> {
        if history.is_empty() {
            return Err(TeError::InvalidRecipe(
                "amax_history_len must be at least 1".into(),
            ));
        }
        let client = R::client(device);
        Ok(CubeDelayedState {
            history: client.create_from_slice(f32::as_bytes(history)),
            history_len: history.len(),
            scales: ScaleBuffers::new(&client, 1, scale),
            client,
        })
    }

    fn fp8_delayed_state_len(state: &CubeDelayedState<R>) -> usize {
        state.history_len
    }

    fn buffer_id(tensor: &CubeTensor<R>) -> Option<u64> {
        buffer_id(&tensor.handle)
    }

    fn fp8_delayed_state_update(
        state: &CubeDelayedState<R>,
        algo: burn_te_kernels::AmaxComputeAlgo,
        format: Fp8Format,
        margin: f32,
    ) -> Result<(), TeError> {
        Ok(ops::delayed_scaling_update(
            &state.client,
            &state.history,
            state.history_len,
            &state.scales,
            algo,
            format,
            margin,
        )?)
    }
}
