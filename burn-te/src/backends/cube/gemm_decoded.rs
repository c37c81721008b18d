//! The decoded path of the device FP8 GEMM: both operands' codes decoded (`burn_te_kernels::gemm::decoded`), multiplied
//! by Burn's own matmul with its autotune into f32, as a Burn user's f16 or bf16 matmul runs, then the per-tensor
//! scales applied once to the f32 product. The values are decoded into f16 where no operand has FP8 block scales
//! (every FP8 value is an f16 value, and so is every NVFP4 E2M1 code times its block's E4M3 scale) and into bf16
//! where one has, each value times its block's scale (burn-te's FP8 block scales are powers of two,
//! Float8BlockScaling's and MXFP8's E8M0 alike, and bf16 has f32's exponent range: exact while a value's lowest bit
//! stays within bf16's reach, 2⁻¹³³, i.e. for every block whose `scale_inv` is at least 2⁻¹¹⁷, an amax above about
//! 10⁻³³); f32 where the device lacks the type (the SIMT kernel's staging, exactly). The product accumulates in
//! f32. NVFP4's global factors go to the product as TE's `alpha` (`amax_a · amax_b · (1 / (6 · 6 · 448 · 448))`), the
//! split TE's cuBLASLt GEMM makes, where the SIMT kernel and the tiled path multiply each code by its block's full
//! dequantization factor: the two differ by the rounding of those factors, within f32's accumulation bound.
//!
//! It runs at Burn's f16 (or f32) matmul rate plus one pass over each operand, on whatever routine Burn picks for
//! the shape and device (TMA and specialised loaders included, which the tiled path's decoding loaders cannot
//! use), at the cost of the operands' f16 copies while the product runs.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::matmul::{MatmulStrategy, matmul};
use burn_cubecl::tensor::CubeTensor;
use burn_te_kernels::KernelError;
use burn_te_kernels::cubecl::ir::{ElemType, FloatKind, StorageType};
use burn_te_kernels::cubecl::prelude::*;
use burn_te_kernels::cubecl::server::Handle;
use burn_te_kernels::gemm::cubek::scale_output;
use burn_te_kernels::gemm::decoded::{decode_operand, decoded_refusal};
use burn_te_kernels::gemm::{GemmOperand, OperandCodes, product_dims};

/// Why the decoded path cannot take `a × b` exactly, or `None` where it can.
pub fn refusal(a: &GemmOperand<'_>, b: &GemmOperand<'_>) -> Option<String> {
    decoded_refusal(a)
        .map(|reason| format!("lhs: {reason}"))
        .or_else(|| decoded_refusal(b).map(|reason| format!("rhs: {reason}")))
}

/// The float type `a` and `b` are decoded into on `client`'s device: f16 (per-tensor scales, NVFP4) or bf16 (FP8
/// block scales) where the device has it, else f32.
pub fn stage_dtype<R: Runtime>(
    client: &ComputeClient<R>,
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
) -> DType {
    let fp8_blocks = |operand: &GemmOperand<'_>| {
        operand.block.is_some() && matches!(operand.codes, OperandCodes::Fp8(_))
    };
    let (kind, dtype) = if fp8_blocks(a) || fp8_blocks(b) {
        (FloatKind::BF16, DType::BF16)
    } else {
        (FloatKind::F16, DType::F16)
    };
    if client
        .properties()
        .supports_type(StorageType::Scalar(ElemType::Float(kind)))
    {
        dtype
    } else {
        DType::F32
    }
}

/// `out[b] = dequant(A[b]) × dequant(B[b])` as `F`, contiguous `[batch, M, N]`, on Burn's matmul over the decoded
/// codes. Operands this path cannot take ([`refusal`]) give [`KernelError::InvalidArgument`] naming why.
pub fn fp8_gemm_decoded<R: CubeRuntime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    device: &R::Device,
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
) -> Result<Handle, KernelError> {
    let (m, k, n, batch) = product_dims(a, b)?;
    if let Some(reason) = refusal(a, b) {
        return Err(KernelError::InvalidArgument {
            what: "decoded FP8 GEMM operands",
            reason,
        });
    }
    if batch * m * n == 0 || k == 0 {
        // No product to run: the SIMT launcher's empty and all-zero results.
        return burn_te_kernels::gemm::fp8_gemm::<R, F>(client, a, b);
    }
    let dtype = stage_dtype(client, a, b);
    let lhs = decoded_tensor(client, device, a, dtype)?;
    let rhs = decoded_tensor(client, device, b, dtype)?;
    let product =
        matmul(lhs, rhs, None, MatmulStrategy::default(), DType::F32).map_err(|error| {
            KernelError::Library {
                library: "Burn's matmul",
                reason: format!("{error:?}"),
            }
        })?;
    debug_assert!(
        product.is_contiguous(),
        "Burn's matmul writes a fresh contiguous output"
    );
    scale_output::<R, F>(client, &product.handle, a, b, batch * m * n, true)
}

/// The operand's codes decoded into a `[batch, rows, cols]` tensor of `dtype`, seen transposed where the product
/// uses it so (a view: Burn's matmul reads it through its strides).
fn decoded_tensor<R: CubeRuntime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    operand: &GemmOperand<'_>,
    dtype: DType,
) -> Result<CubeTensor<R>, KernelError> {
    let handle = match dtype {
        DType::F16 => decode_operand::<R, half::f16>(client, operand)?,
        DType::BF16 => decode_operand::<R, half::bf16>(client, operand)?,
        _ => decode_operand::<R, f32>(client, operand)?,
    };
    let shape = Shape::new([operand.batch, operand.rows, operand.cols]);
    let tensor = CubeTensor::new_contiguous(client.clone(), device.clone(), shape, handle, dtype);
    Ok(if operand.transposed {
        burn_cubecl::ops::permute(tensor, &[0, 2, 1])
    } else {
        tensor
    })
}
