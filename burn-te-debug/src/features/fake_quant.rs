//! FakeQuant: chosen GEMM inputs quantized and dequantized, and the GEMM run in high precision.

use burn_te::gemm::nvfp4::Nvfp4Plan;
use burn_te::recipe::MX_BLOCK;
use burn_te::{BlockScaleRule, Fp8Format, Gemm, NVFP4BlockScaling, ScaleBlock};

use super::PerGemmTensor;
use crate::config::{FeatureSpec, Need};
use crate::error::{ConfigError, ConfigErrorKind, DebugError};
use crate::feature::{DebugTensor, Feature, Modified};
use crate::routing::Routing;
use crate::tensor::TensorName;

/// Quantize-dequantizes the chosen (gemm, tensor) inputs to `quant_format` and runs those GEMMs in high precision:
/// `FP8E4M3` / `FP8E5M2` with a per-tensor current scale and `margin` (default 0); `MXFP8E4M3` / `MXFP8E5M2` with
/// one E8M0 scale per 32 values along the GEMM's reduction dimension, as the MXFP8 recipe quantizes (margin does not
/// apply); `NVFP4` as NVFP4BlockScaling quantizes (TE's defaults: E2M1 with an E4M3 scale per 16 values along K,
/// 16×16 tiles for weights; round to nearest and no RHT, which only cancels when both operands of a GEMM take it).
/// TE's FakeQuant has no NVFP4.
///
/// ```yaml
/// fake_quant_nvfp4:
///   enabled: True
///   layers:
///     layer_name_regex_pattern: 'fc1'
///   transformer_engine:
///     FakeQuant:
///       enabled: True
///       gemms_struct:
///         - gemm: fprop
///           tensors_struct:
///             - tensor: activation
///               quant_format: NVFP4
/// ```
pub struct FakeQuant {
    entries: PerGemmTensor<(QuantFormat, f32)>,
}

/// A FakeQuant format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QuantFormat {
    /// FP8 with a per-tensor current scale.
    Fp8(Fp8Format),
    /// MXFP8: an E8M0 scale per 32 values along K.
    Mxfp8(Fp8Format),
    /// NVFP4 with TE's default blocks.
    Nvfp4,
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
                let format = match item.str("quant_format")? {
                    Some("FP8E4M3") => QuantFormat::Fp8(Fp8Format::E4M3),
                    Some("FP8E5M2") => QuantFormat::Fp8(Fp8Format::E5M2),
                    Some("MXFP8E4M3") => QuantFormat::Mxfp8(Fp8Format::E4M3),
                    Some("MXFP8E5M2") => QuantFormat::Mxfp8(Fp8Format::E5M2),
                    Some("NVFP4") => QuantFormat::Nvfp4,
                    Some(other) => {
                        return Err(item.error(
                            Some("quant_format"),
                            ConfigErrorKind::InvalidValue(format!(
                                "quant_format \"{other}\" is not supported (FP8E4M3, FP8E5M2, MXFP8E4M3, \
                                 MXFP8E5M2 or NVFP4)"
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
        let modified = match quant {
            QuantFormat::Mxfp8(format) => {
                let block = if k_along_cols(gemm, tensor) {
                    ScaleBlock::new(1, MX_BLOCK)
                } else {
                    ScaleBlock::new(MX_BLOCK, 1)
                };
                x.fake_quant_blocks(format, block, BlockScaleRule::E8m0)?
            }
            QuantFormat::Fp8(format) => x.fake_quant(format, margin)?,
            QuantFormat::Nvfp4 => {
                let role = tensor.role().expect("FakeQuant takes GEMM inputs");
                let plan = Nvfp4Plan::nearest(
                    &NVFP4BlockScaling::default(),
                    role,
                    k_along_cols(gemm, tensor),
                    false,
                );
                x.fake_quant_nvfp4(plan)?
            }
        };
        Ok(Modified::HighPrecision(modified))
    }
}
