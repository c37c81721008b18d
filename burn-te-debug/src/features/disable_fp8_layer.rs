//! DisableFP8Layer (new name DisableQuantizationLayer): every GEMM of the layer in high precision.

use burn_te::Gemm;

use crate::config::{FeatureSpec, Need};
use crate::error::ConfigError;
use crate::feature::Feature;
use crate::routing::Routing;

/// Runs all three GEMMs of the selected layers in high precision.
pub struct DisableFp8Layer {
    name: String,
}

impl DisableFp8Layer {
    /// Builds the feature from its config entry (it takes no keys but `enabled`).
    pub fn from_spec(spec: &FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> {
        spec.items(Need::No, Need::No, &[], Some(&[]))?;
        Ok(Box::new(DisableFp8Layer {
            name: spec.name.clone(),
        }))
    }
}

impl Feature for DisableFp8Layer {
    fn name(&self) -> &str {
        &self.name
    }

    fn fp8_gemm_enabled(&self, _layer: &str, _gemm: Gemm, iteration: u64) -> Option<Routing> {
        Some(Routing::always(false, iteration))
    }
}
