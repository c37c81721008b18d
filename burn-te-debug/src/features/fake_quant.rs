//! FakeQuant: chosen GEMM inputs quantized and dequantized, and the GEMM run in high precision.

use burn_te::recipe::MX_BLOCK;
use burn_te::{BlockScaleRule, Fp8Format, Gemm, ScaleBlock};

use super::{DebugTensor, Feature, Modified, PerGemmTensor, Routing};
use crate::config::{FeatureSpec, Need};
use crate::error::{ConfigError, ConfigErrorKind, DebugError};
use crate::tensor::TensorName;

/// Quantize-dequantizes the chosen (gemm, tensor) inputs to `quant_format` and runs those GEMMs in high precision:
/// `FP8E4M3` / `FP8E5M2` with a per-tensor current scale and `margin` (default 0); `MXFP8E4M3` / `MXFP8E5M2` with
/// one E8M0 scale per 32 values along the GEMM's reduction dimension, as the MXFP8 recipe quantizes (margin does not
/// apply).
pub struct FakeQuant {
    entries: PerGemmTensor<(QuantFormat, f32)>,
}

/// A FakeQuant format: FP8 with a per-tensor scale, or MXFP8 (32-value blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct QuantFormat {
    format: Fp8Format,
    mx: bool,
}

/// Whether `tensor`, as an input of `gemm`, is reduced along its stored columns (Burn's weight is `[in, out]`).
fn k_along_cols(gemm: Gemm, tensor: TensorName) -> bool {
    match gemm {
        Gemm::Fprop => tensor != TensorName::Weight,
        Gemm::Dgrad => true,
        Gemm::Wgrad => false,
    }
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
                let quant = |format, mx| QuantFormat { format, mx };
                let format = match item.str("quant_format")? {
                    Some("FP8E4M3") => quant(Fp8Format::E4M3, false),
                    Some("FP8E5M2") => quant(Fp8Format::E5M2, false),
                    Some("MXFP8E4M3") => quant(Fp8Format::E4M3, true),
                    Some("MXFP8E5M2") => quant(Fp8Format::E5M2, true),
                    Some(other) => {
                        return Err(item.error(
                            Some("quant_format"),
                            ConfigErrorKind::InvalidValue(format!(
                                "quant_format \"{other}\" is not supported (FP8E4M3, FP8E5M2, MXFP8E4M3 or \
                                 MXFP8E5M2)"
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
                    (format, margin),
                ))
            })
            .collect::<Result<_, ConfigError>>()?;
        Ok(Box::new(FakeQuant {
            entries: PerGemmTensor(entries),
        }))
    }
}

impl Feature for FakeQuant {
    fn name(&self) -> &str {
        "FakeQuant"
    }

    fn fp8_gemm_enabled(&self, _layer: &str, gemm: Gemm, iteration: u64) -> Option<Routing> {
        self.entries
            .0
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
        self.entries.modify_routing(gemm, tensor, iteration)
    }

    fn modify_tensor(
        &self,
        layer: &str,
        gemm: Gemm,
        tensor: TensorName,
        x: &dyn DebugTensor,
        _iteration: u64,
    ) -> Result<Modified, DebugError> {
        let &(quant, margin) = self.entries.setting(self.name(), layer, gemm, tensor)?;
        let modified = if quant.mx {
            let block = if k_along_cols(gemm, tensor) {
                ScaleBlock::new(1, MX_BLOCK)
            } else {
                ScaleBlock::new(MX_BLOCK, 1)
            };
            x.fake_quant_blocks(quant.format, block, BlockScaleRule::E8m0)?
        } else {
            x.fake_quant(quant.format, margin)?
        };
        Ok(Modified::HighPrecision(modified))
    }
}
