//! # burn-te
//!
//! FP8 training for [Burn](https://burn.dev), after NVIDIA Transformer Engine: the FP8 formats, scaling recipes,
//! FP8 autocast, the `TeBackend` extension trait and the `Te<B>` backend decorator.
//!
//! This crate is at its start: it re-exports the FP8 formats, scaling rule and statistics of
//! [`burn_te_kernels`], and converts Burn [`TensorData`] with the bit-exact host path. The backend decorator,
//! recipes and modules come next.

use burn::tensor::{DType, TensorData};

pub use burn_te_kernels::{
    AmaxComputeAlgo, DelayedScalingHistory, Fp8Format, Fp8Stats, KernelError, TensorStats,
    pow2_margin, scale_from_amax,
};

/// Errors of burn-te.
#[derive(Debug, thiserror::Error)]
pub enum TeError {
    /// A tensor of a dtype the operation does not take.
    #[error("{op}: expected a float tensor (f32, f16 or bf16), got {dtype:?}")]
    UnsupportedDType {
        /// The operation.
        op: &'static str,
        /// The dtype it got.
        dtype: DType,
    },
    /// A kernel or host-path error.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// The values of a float tensor as f32 (f16 and bf16 widen exactly).
fn float_values(op: &'static str, data: &TensorData) -> Result<Vec<f32>, TeError> {
    match data.dtype {
        DType::F32 | DType::F16 | DType::BF16 => Ok(data.iter::<f32>().collect()),
        dtype => Err(TeError::UnsupportedDType { op, dtype }),
    }
}

/// Statistics of a tensor's values (host path): min, max, mean, std, norms, amax, dynamic range.
pub fn tensor_stats(data: &TensorData) -> Result<TensorStats, TeError> {
    Ok(burn_te_kernels::host::tensor_stats(&float_values(
        "tensor_stats",
        data,
    )?))
}

/// Quantizes a tensor's values to FP8 codes with `scale` (host path), one byte per element.
pub fn quantize(data: &TensorData, scale: f32, format: Fp8Format) -> Result<Vec<u8>, TeError> {
    Ok(burn_te_kernels::host::quantize(
        &float_values("quantize", data)?,
        scale,
        format,
    ))
}

/// Quantize-dequantize a tensor's values with `scale` (host path), keeping its shape.
pub fn fake_quant(data: &TensorData, scale: f32, format: Fp8Format) -> Result<TensorData, TeError> {
    let values =
        burn_te_kernels::host::fake_quant(&float_values("fake_quant", data)?, scale, format);
    Ok(TensorData::new(values, data.shape.clone()))
}
