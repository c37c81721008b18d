//! FakeQuant: chosen GEMM inputs quantized and dequantized, and the GEMM run in high precision.

use burn_te::{Fp8Format, Gemm};

use super::{DebugTensor, Feature, Modified, Routing};
use crate::config::{FeatureSpec, Need};
use crate::error::{ConfigError, ConfigErrorKind, DebugError};
use crate::tensor::TensorName;

/// Quantize-dequantizes the chosen (gemm, tensor) inputs to `quant_format` (`FP8E4M3` or `FP8E5M2`) with a
/// per-tensor current scale and `margin` (default 0), and runs those GEMMs in high precision.
pub struct FakeQuant {
    entries: Vec<(Gemm, TensorName, Fp8Format, f32)>,
}

impl FakeQuant {
    /// Builds the feature from its config entry.
    pub fn from_spec(spec: &FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> {
        let entries = spec
            .items(
                Need::Required,
                Need::Required,
                &TensorName::INPUTS,
                Some(&["quant_format", "margin"]),
            )?
            .into_iter()
            .map(|item| {
                let format = match item.str("quant_format")? {
                    Some("FP8E4M3") => Fp8Format::E4M3,
                    Some("FP8E5M2") => Fp8Format::E5M2,
                    Some(other) => {
                        return Err(item.error(
                            Some("quant_format"),
                            ConfigErrorKind::InvalidValue(format!(
                                "quant_format \"{other}\" is not supported (FP8E4M3 or FP8E5M2)"
                            )),
                        ));
                    }
                    None => {
                        return Err(
                            item.error(None, ConfigErrorKind::MissingKey("quant_format".into()))
                        );
                    }
                };
                let margin = item.f64("margin")?.unwrap_or(0.0) as f32;
                Ok((
                    item.gemm.expect("required"),
                    item.tensor.expect("required"),
                    format,
                    margin,
                ))
            })
            .collect::<Result<_, ConfigError>>()?;
        Ok(Box::new(FakeQuant { entries }))
    }

    fn entry(&self, gemm: Gemm, tensor: TensorName) -> Option<(Fp8Format, f32)> {
        self.entries
            .iter()
            .find(|e| e.0 == gemm && e.1 == tensor)
            .map(|e| (e.2, e.3))
    }
}

impl Feature for FakeQuant {
    fn name(&self) -> &str {
        "FakeQuant"
    }

    fn fp8_gemm_enabled(&self, _layer: &str, gemm: Gemm, iteration: u64) -> Option<Routing> {
        self.entries
            .iter()
            .any(|e| e.0 == gemm)
            .then(|| Routing::always(false, iteration))
    }

    fn modify_tensor_enabled(
        &self,
        _layer: &str,
        gemm: Gemm,
        tensor: TensorName,
        iteration: u64,
    ) -> Option<Routing> {
        self.entry(gemm, tensor)
            .map(|_| Routing::always(true, iteration))
    }

    fn modify_tensor(
        &self,
        _layer: &str,
        gemm: Gemm,
        tensor: TensorName,
        x: &dyn DebugTensor,
        _iteration: u64,
    ) -> Result<Modified, DebugError> {
        let (format, margin) = self.entry(gemm, tensor).unwrap_or((Fp8Format::E4M3, 0.0));
        Ok(Modified::HighPrecision(x.fake_quant(format, margin)?))
    }
}
