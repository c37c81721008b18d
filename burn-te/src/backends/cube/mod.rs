//! [`TeBackend`] for Burn's CubeCL backends (wgpu, CUDA): the kernels of `burn-te-kernels` on the tensors' device
//! buffers. Scales and amax histories stay on the device, so no op waits for the host except the statistics.

pub mod gemm_decoded;
pub mod gemm_path;
pub mod gemm_tune;

use burn::tensor::{DType, Shape};
use burn_cubecl::element::{BoolElement, FloatElement, IntElement};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use burn_te_kernels::cubecl::prelude::*;
use burn_te_kernels::cubecl::server::Handle;
use burn_te_kernels::gemm::{GemmOperand, OperandCodes};
use burn_te_kernels::nvfp4::{self, Nvfp4Buffer, RHT_SIGN_MASK};
use burn_te_kernels::ops::{self, Fp8Buffer, ScaleBuffers};
use burn_te_kernels::{Fp8Format, Fp8Stats, KernelError, block};

use crate::backend::{
    ElementFormat, Fp8HostData, Fp8Primitive, Fp8Tensor, Nvfp4Scales, Scaling, TeBackend,
};
use crate::error::TeError;
use crate::primitive::rows_cols;

/// FP8 (or NVFP4) buffers on a CubeCL device.
#[derive(Clone)]
pub struct CubeFp8Data<R: CubeRuntime> {
    /// Codes, four per `u32` word (E2M1: eight), row-major.
    pub codes: Handle,
    /// `scale_inv`: one f32, or one per block (NVFP4: each block's dequantization factor).
    pub scale_inv: Handle,
    /// NVFP4's E4M3 block scales and global amax.
    pub nvfp4: Option<Nvfp4Buffer>,
    /// The float type of the tensor it was quantized from: its dequantization, and the GEMMs it is the lhs of, are
    /// written in it (as Burn's matmul gives its lhs's type), so an f16 model's FP8 GEMMs give f16.
    pub dtype: DType,
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
    device: R::Device,
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

/// Runs `$body` with `$t` bound to the element type of a float dtype (f32, f16, bf16: the last on runtimes that
/// have it, CUDA), or fails with the op's name.
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
            DType::BF16 => {
                type $t = half::bf16;
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

/// What a quantization produced: the codes, the `scale_inv` buffer and the layout.
struct Quantized {
    codes: Handle,
    scale_inv: Handle,
    format: ElementFormat,
    block: Option<block::ScaleBlock>,
    nvfp4: Option<Nvfp4Buffer>,
}

impl Quantized {
    fn fp8(codes: Fp8Buffer, scale_inv: Handle, block: Option<block::ScaleBlock>) -> Self {
        Self {
            codes: codes.codes,
            scale_inv,
            format: ElementFormat::Fp8(codes.format),
            block,
            nvfp4: None,
        }
    }
}

fn fp8_tensor<R: CubeRuntime>(like: &CubeTensor<R>, q: Quantized) -> Fp8Tensor<CubeFp8Data<R>> {
    Fp8Tensor {
        data: CubeFp8Data {
            codes: q.codes,
            scale_inv: q.scale_inv,
            nvfp4: q.nvfp4,
            dtype: like.dtype,
            client: like.client.clone(),
            device: like.device.clone(),
        },
        shape: like.meta.shape().clone(),
        format: q.format,
        block: q.block,
    }
}

fn quantize<R: CubeRuntime, F: Float + CubeElement>(
    x: &CubeTensor<R>,
    format: Fp8Format,
    scaling: Scaling<'_, CubeDelayedState<R>>,
) -> Result<Quantized, TeError> {
    let client = &x.client;
    let len = x.meta.shape().num_elements();
    match scaling {
        Scaling::Current { margin } => {
            let amax = ops::amax::<R, F>(client, &x.handle, len)?;
            let scales = ScaleBuffers::new(client, 1, 1.0);
            ops::compute_scale(client, &amax, &scales, format, margin)?;
            let codes = ops::quantize::<R, F>(client, &x.handle, len, &scales.scale, format, None)?;
            Ok(Quantized::fp8(codes, scales.scale_inv, None))
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
            Ok(Quantized::fp8(codes, scale_inv, None))
        }
        Scaling::Block { block, rule } => {
            let (rows, cols) = rows_cols(x.meta.shape());
            let quantized =
                block::block_quantize::<R, F>(client, &x.handle, rows, cols, block, rule, format)?;
            Ok(Quantized::fp8(
                quantized.codes,
                quantized.scale_inv,
                Some(block),
            ))
        }
        Scaling::Nvfp4 {
            tile,
            rounding,
            rht,
            amax_group,
        } => {
            crate::gemm::nvfp4::check_scale_format(format)?;
            let (rows, cols) = rows_cols(x.meta.shape());
            let buffer = if rht {
                // The transform's output is f32 (bf16-rounded values); the global amax is the transformed one.
                let transformed = nvfp4::rht::<R, F>(client, &x.handle, rows, cols, RHT_SIGN_MASK)?;
                let amax = ops::amax::<R, f32>(client, &transformed, len)?;
                let amax = group_amax(client, amax, amax_group)?;
                nvfp4::nvfp4_quantize::<R, f32>(
                    client,
                    &transformed,
                    rows,
                    cols,
                    tile,
                    &amax,
                    rounding,
                )?
            } else {
                let amax = ops::amax::<R, F>(client, &x.handle, len)?;
                let amax = group_amax(client, amax, amax_group)?;
                nvfp4::nvfp4_quantize::<R, F>(client, &x.handle, rows, cols, tile, &amax, rounding)?
            };
            let factors = nvfp4::nvfp4_block_factors(client, &buffer)?;
            Ok(Quantized {
                codes: buffer.codes.clone(),
                scale_inv: factors,
                format: ElementFormat::E2m1,
                block: Some(tile.block()),
                nvfp4: Some(buffer),
            })
        }
    }
}

/// NVFP4's global amax (a one-element buffer) as is, or reduced over `group` (a shard's: read back, reduced, and
/// uploaded again).
fn group_amax<R: CubeRuntime>(
    client: &ComputeClient<R>,
    amax: Handle,
    group: Option<&dyn crate::fp8_state::site::AmaxGroup>,
) -> Result<Handle, TeError> {
    let Some(group) = group else {
        return Ok(amax);
    };
    let local = ops::read_scalar(client, &amax)?;
    let global = group.max("NVFP4 global amax", &[local])?[0];
    Ok(client.create_from_slice(f32::as_bytes(&[global])))
}

/// A quantized tensor as a GEMM operand (`fp8`: its codes as an FP8 buffer; `None` for E2M1).
fn gemm_operand<'a, R: CubeRuntime>(
    q: &'a Fp8Tensor<CubeFp8Data<R>>,
    fp8: Option<&'a Fp8Buffer>,
    transposed: bool,
) -> Result<GemmOperand<'a>, TeError> {
    let (batch, rows, cols) = q.matrix_dims();
    let codes = match (fp8, &q.data.nvfp4) {
        (Some(buffer), _) => OperandCodes::Fp8(buffer),
        (None, Some(buffer)) => OperandCodes::E2m1(buffer),
        (None, None) => {
            return Err(TeError::Read(
                "an E2M1 GEMM operand without its NVFP4 scales".into(),
            ));
        }
    };
    Ok(GemmOperand {
        codes,
        scale_inv: &q.data.scale_inv,
        batch,
        rows,
        cols,
        block: q.block,
        transposed,
    })
}

/// A one-element copy on the device.
fn copy_scalar<R: CubeRuntime>(
    client: &ComputeClient<R>,
    handle: &Handle,
) -> Result<Handle, TeError> {
    Ok(ops::copy_f32(client, handle, 1)?)
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

    crate::te_linear_gemms!(fprop dgrad wgrad backward grouped);
    type PendingStats = CubePendingStats<R>;

    fn fp8_quantize(
        tensor: CubeTensor<R>,
        format: Fp8Format,
        scaling: Scaling<'_, CubeDelayedState<R>>,
    ) -> Result<Fp8Primitive<Self>, TeError> {
        crate::metrics::count_launch(crate::metrics::names::QUANTIZE_LAUNCHES);
        let x = into_contiguous(tensor);
        let quantized =
            with_float!(x.dtype, "fp8_quantize", T => quantize::<R, T>(&x, format, scaling))?;
        Ok(fp8_tensor(&x, quantized))
    }

    fn fp8_read(tensor: &Fp8Primitive<Self>) -> Result<Fp8HostData, TeError> {
        let client = &tensor.data.client;
        let len = tensor.shape.num_elements();
        let scales = tensor.scale_count("fp8_read")?;
        let short = |what: &str, have: usize, need: usize| TeError::InvalidShape {
            module: "fp8_read".into(),
            reason: format!("the tensor holds {have} {what} for {need}"),
            shape: tensor.shape.as_slice().to_vec(),
        };
        let read = |handle: &Handle| -> Result<Vec<u8>, TeError> {
            crate::metrics::timed_read(handle.size() as usize, || {
                Ok(client
                    .read_one(handle.clone())
                    .map_err(KernelError::from)?
                    .to_vec())
            })
        };
        let mut codes = read(&tensor.data.codes)?;
        if tensor.format == ElementFormat::E2m1 {
            codes = codes
                .iter()
                .flat_map(|&byte| [byte & 0xf, byte >> 4])
                .collect();
        }
        if codes.len() < len {
            return Err(short("codes", codes.len(), len));
        }
        codes.truncate(len);
        let scale_inv = read(&tensor.data.scale_inv)?;
        let scale_inv = f32::from_bytes(&scale_inv);
        if scale_inv.len() < scales {
            return Err(short("scale_inv values", scale_inv.len(), scales));
        }
        let scale_inv = scale_inv[..scales].to_vec();
        let nvfp4 = match &tensor.data.nvfp4 {
            None => None,
            Some(buffer) => {
                let mut block_scales = read(&buffer.scales)?;
                if block_scales.len() < scales {
                    return Err(short("NVFP4 block scales", block_scales.len(), scales));
                }
                block_scales.truncate(scales);
                let amax = read(&buffer.amax)?;
                Some(Nvfp4Scales {
                    block_scales,
                    global_amax: f32::from_bytes(&amax)[0],
                })
            }
        };
        Ok(Fp8HostData {
            codes,
            scale_inv,
            nvfp4,
        })
    }

    fn fp8_dequantize(tensor: Fp8Primitive<Self>) -> Result<CubeTensor<R>, TeError> {
        let data = &tensor.data;
        let len = tensor.shape.num_elements();
        let client = &data.client;
        let (format, nvfp4) = match (tensor.format, &data.nvfp4) {
            (ElementFormat::Fp8(format), _) => (format, None),
            (ElementFormat::E2m1, Some(buffer)) if buffer.rows * buffer.cols != len => {
                return Err(TeError::InvalidShape {
                    module: "fp8_dequantize".into(),
                    reason: format!(
                        "the tensor holds {} × {} NVFP4 codes for {len} elements",
                        buffer.rows, buffer.cols
                    ),
                    shape: tensor.shape.as_slice().to_vec(),
                });
            }
            (ElementFormat::E2m1, Some(buffer)) => (Fp8Format::E4M3, Some(buffer)),
            (ElementFormat::E2m1, None) => {
                return Err(TeError::Read(
                    "an E2M1 tensor without its NVFP4 scales".into(),
                ));
            }
        };
        let buffer = Fp8Buffer {
            codes: data.codes.clone(),
            len,
            format,
        };
        let handle = with_float!(data.dtype, "fp8_dequantize", T => Ok(match (nvfp4, tensor.block) {
            (Some(nvfp4), _) => nvfp4::nvfp4_dequantize::<R, T>(client, nvfp4)?,
            (None, None) => ops::dequantize::<R, T>(client, &buffer, &data.scale_inv)?,
            (None, Some(block)) => {
                let (rows, cols) = rows_cols(&tensor.shape);
                block::block_dequantize::<R, T>(
                    client,
                    &buffer,
                    &data.scale_inv,
                    rows,
                    cols,
                    block,
                )?
            }
        }))?;
        Ok(CubeTensor::new_contiguous(
            client.clone(),
            data.device.clone(),
            tensor.shape,
            handle,
            data.dtype,
        ))
    }

    fn fp8_gemm(
        lhs: Fp8Primitive<Self>,
        lhs_t: bool,
        rhs: Fp8Primitive<Self>,
        rhs_t: bool,
    ) -> Result<CubeTensor<R>, TeError> {
        let mut out = Self::fp8_gemm_grouped(vec![(lhs, lhs_t, rhs, rhs_t)])?;
        Ok(out.pop().expect("one GEMM's output"))
    }

    fn fp8_gemm_grouped(
        gemms: Vec<crate::backend::GroupedGemmOperands<Self>>,
    ) -> Result<Vec<CubeTensor<R>>, TeError> {
        let Some((first, ..)) = gemms.first() else {
            return Ok(Vec::new());
        };
        let (client, device) = (first.data.client.clone(), first.data.device.clone());
        let dtype = first.data.dtype;
        if gemms.len() > 1
            && gemms.iter().any(|(lhs, _, rhs, _)| {
                lhs.data.device != device || rhs.data.device != device || lhs.data.dtype != dtype
            })
        {
            // Several devices or output types: each GEMM on its own.
            return gemms
                .into_iter()
                .map(|gemm| Self::fp8_gemm(gemm.0, gemm.1, gemm.2, gemm.3))
                .collect();
        }
        let shapes = gemms
            .iter()
            .map(|(lhs, lhs_t, rhs, rhs_t)| {
                crate::backend::gemm_output_shape(lhs, *lhs_t, rhs, *rhs_t)
            })
            .collect::<Result<Vec<_>, _>>()?;
        // FP8 codes as the kernels' buffers (E2M1 codes come with the tensor's NVFP4 buffer).
        let fp8_codes = |q: &Fp8Primitive<Self>| match q.format {
            ElementFormat::Fp8(format) => Some(Fp8Buffer {
                codes: q.data.codes.clone(),
                len: q.shape.num_elements(),
                format,
            }),
            ElementFormat::E2m1 => None,
        };
        let codes: Vec<_> = gemms
            .iter()
            .map(|(lhs, _, rhs, _)| (fp8_codes(lhs), fp8_codes(rhs)))
            .collect();
        let operands: Vec<_> = gemms
            .iter()
            .zip(&codes)
            .map(|((lhs, lhs_t, rhs, rhs_t), (lhs_fp8, rhs_fp8))| {
                Ok((
                    gemm_operand(lhs, lhs_fp8.as_ref(), *lhs_t)?,
                    gemm_operand(rhs, rhs_fp8.as_ref(), *rhs_t)?,
                ))
            })
            .collect::<Result<_, TeError>>()?;
        let handles = with_float!(dtype, "fp8_gemm", T => {
            gemm_path::device_fp8_gemm_grouped::<R, T>(&client, &device, &operands)
        })?;
        Ok(handles
            .into_iter()
            .zip(shapes)
            .map(|(handle, shape)| {
                CubeTensor::new_contiguous(client.clone(), device.clone(), shape, handle, dtype)
            })
            .collect())
    }

    fn fp8_amax(tensor: CubeTensor<R>) -> Result<CubeTensor<R>, TeError> {
        crate::metrics::count_launch(crate::metrics::names::AMAX_LAUNCHES);
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
        crate::metrics::count_launch(crate::metrics::names::QUANTIZE_LAUNCHES);
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
        crate::metrics::count_launch(crate::metrics::names::STATS_LAUNCHES);
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
                Some((format, Scaling::Nvfp4 { tile, rht, .. })) => {
                    crate::gemm::nvfp4::check_scale_format(format)?;
                    let (rows, cols) = rows_cols(x.meta.shape());
                    if rht {
                        let transformed = nvfp4::rht::<R, T>(client, &x.handle, rows, cols, RHT_SIGN_MASK)?;
                        let amax = ops::amax::<R, f32>(client, &transformed, len)?;
                        nvfp4::nvfp4_tensor_stats::<R, f32>(client, &transformed, rows, cols, tile, &amax)?
                    } else {
                        let amax = ops::amax::<R, T>(client, &x.handle, len)?;
                        nvfp4::nvfp4_tensor_stats::<R, T>(client, &x.handle, rows, cols, tile, &amax)?
                    }
                }
            })
        })?;
        Ok(CubePendingStats {
            readback,
            client: client.clone(),
            device: x.device.clone(),
        })
    }

    fn fp8_non_finite_launch(tensor: CubeTensor<R>) -> Result<CubePendingStats<R>, TeError> {
        let x = into_contiguous(tensor);
        let len = x.meta.shape().num_elements();
        let client = &x.client;
        let readback = with_float!(x.dtype, "fp8_non_finite", T => Ok(ops::non_finite_counts::<R, T>(client, &x.handle, len)?))?;
        Ok(CubePendingStats {
            readback,
            client: client.clone(),
            device: x.device.clone(),
        })
    }

    fn fp8_stats_read(pending: CubePendingStats<R>) -> Result<Fp8Stats, TeError> {
        crate::metrics::timed_read(pending.readback.bytes(), || {
            pending
                .readback
                .read_fp8(&pending.client)
                .map_err(read_error)
        })
    }

    fn fp8_stats_read_many(pending: Vec<CubePendingStats<R>>) -> Result<Vec<Fp8Stats>, TeError> {
        // One read per device, each of all that device's statistics; the results back in the launch order.
        let mut devices: Vec<(R::Device, Vec<usize>)> = Vec::new();
        for (index, p) in pending.iter().enumerate() {
            match devices.iter_mut().find(|(device, _)| *device == p.device) {
                Some((_, indices)) => indices.push(index),
                None => devices.push((p.device.clone(), vec![index])),
            }
        }
        let mut all = vec![Fp8Stats::EMPTY; pending.len()];
        for (_, indices) in devices {
            let readbacks: Vec<ops::StatsReadback> = indices
                .iter()
                .map(|&i| pending[i].readback.clone())
                .collect();
            let bytes = readbacks.iter().map(ops::StatsReadback::bytes).sum();
            let client = &pending[indices[0]].client;
            let stats = crate::metrics::timed_read(bytes, || {
                ops::StatsReadback::read_many(&readbacks, client).map_err(read_error)
            })?;
            for (i, s) in indices.into_iter().zip(stats) {
                all[i] = s;
            }
        }
        Ok(all)
    }

    fn fp8_quantization_stats(
        tensor: CubeTensor<R>,
        format: Fp8Format,
        scale: f32,
    ) -> Result<Fp8Stats, TeError> {
        crate::metrics::count_launch(crate::metrics::names::STATS_LAUNCHES);
        let x = into_contiguous(tensor);
        let len = x.meta.shape().num_elements();
        let scale = ops::scalar_buffer(&x.client, scale);
        let readback = with_float!(x.dtype, "fp8_quantization_stats", T => Ok(ops::fp8_tensor_stats::<R, T>(&x.client, &x.handle, len, format, &scale)?))?;
        crate::metrics::timed_read(readback.bytes(), || {
            readback.read_fp8(&x.client).map_err(read_error)
        })
    }

    fn fp8_delayed_state_read(state: &CubeDelayedState<R>) -> Result<(Vec<f32>, f32), TeError> {
        let client = &state.client;
        let history = crate::metrics::timed_read(state.history_len * 4, || {
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
