//! PerTensorScaling: chosen GEMM inputs quantized with a per-tensor current scale; the GEMM stays in FP8.

use burn_te::Gemm;

use super::PerGemmTensor;
use crate::config::{FeatureSpec, Need};
use crate::error::{ConfigError, DebugError};
use crate::feature::{DebugTensor, Feature, Modified};
use crate::routing::Routing;
use crate::tensor::TensorName;

/// Replaces the recipe's scaling of the chosen (gemm, tensor) inputs with current scaling
/// (`fp8_max / amax / 2^margin`, margin default 0).
pub struct PerTensorScaling {
    entries: PerGemmTensor<f32>,
}

impl PerTensorScaling {
    /// Builds the feature from its config entry.
    pub fn from_spec(spec: &FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> {
        let entries = spec
            .items(
                Need::Required,
                Need::Required,
                &TensorName::INPUTS,
                Some(&["margin"]),
            )?
            .into_iter()
            .map(|item| {
                let margin = item.f64("margin")?.unwrap_or(0.0) as f32;
                Ok((
                    item.gemm.expect("required"),
                    item.tensor.expect("required"),
                    margin,
                ))
            })
            .collect::<Result<_, ConfigError>>()?;
        Ok(Box::new(PerTensorScaling {
            entries: PerGemmTensor(entries),
        }))
    }
}

impl Feature for PerTensorScaling {
    fn name(&self) -> &str {
        "PerTensorScaling"
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
        _x: &dyn DebugTensor,
        _iteration: u64,
    ) -> Result<Modified, DebugError> {
        let margin = *self.entries.setting(self.name(), layer, gemm, tensor)?;
        Ok(Modified::CurrentScaling { margin })
    }
}
