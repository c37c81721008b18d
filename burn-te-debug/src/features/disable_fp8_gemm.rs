//! DisableFP8GEMM (new name DisableQuantizationGEMM): chosen GEMMs run in high precision.

use burn_te::Gemm;

use crate::config::{FeatureSpec, Need};
use crate::error::ConfigError;
use crate::feature::Feature;
use crate::routing::Routing;

/// Runs the GEMMs listed in `gemms` in high precision.
pub struct DisableFp8Gemm {
    name: String,
    gemms: Vec<Gemm>,
}

impl DisableFp8Gemm {
    /// Builds the feature from its config entry.
    pub fn from_spec(spec: &FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> {
        let gemms = spec
            .items(Need::Required, Need::No, &[], Some(&[]))?
            .into_iter()
            .filter_map(|item| item.gemm)
            .collect();
        Ok(Box::new(DisableFp8Gemm {
            name: spec.name.clone(),
            gemms,
        }))
    }
}

impl Feature for DisableFp8Gemm {
    fn name(&self) -> &str {
        &self.name
    }

    fn fp8_gemm_enabled(&self, _layer: &str, gemm: Gemm, iteration: u64) -> Option<Routing> {
        self.gemms
            .contains(&gemm)
            .then(|| Routing::always(false, iteration))
    }
}
