//! The host path on Burn `TensorData`: statistics, quantize and fake-quant without a backend.

use burn::tensor::{DType, TensorData};

use burn_te_kernels::{Fp8Format, TensorStats};

use crate::error::TeError;

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
