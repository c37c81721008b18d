//! LogNvfp4TensorStats: what NVFP4 quantization does to a tensor — underflows, error, the range of its block scales.
//!
//! ```yaml
//! nvfp4_stats:
//!   enabled: True
//!   layers:
//!     layer_types: [layernorm_linear]
//!   transformer_engine:
//!     LogNvfp4TensorStats:
//!       enabled: True
//!       tensors_struct:
//!         - tensor: activation
//!           stats: [underflows%, mse, scale_inv_min, scale_inv_max, scale_inv_std]
//!           freq: 1
//!         - tensor: gradient
//!           stats: [underflows%, mse]
//!           freq: 5
//! ```

use burn_te::gemm::nvfp4::Nvfp4Plan;
use burn_te::{Fp8Format, NVFP4BlockScaling, Recipe};

use super::Scheduled;
use super::log_tensor_stats::parse_stats;
use crate::config::{FeatureSpec, Need, SCHEDULE_KEYS};
use crate::error::{ConfigError, DebugError};
use crate::feature::{DebugTensor, Feature, Inspection};
use crate::routing::Routing;
use crate::stats::{Stat, StatRequest, StatsScaling};
use crate::tensor::TensorName;

/// The prefix of the logged names, as TE's (`<layer>_<tensor>_nvfp4_<stat>`).
const PREFIX: &str = "nvfp4_";

/// The stats, TE's two first.
const STATS: [Stat; 5] = [
    Stat::Underflows,
    Stat::Mse,
    Stat::ScaleInvMin,
    Stat::ScaleInvMax,
    Stat::ScaleInvStd,
];

/// Logs `nvfp4_<stat>` for stat ∈ `underflows%`, `mse` (TE's `LogNvfp4TensorStats`) and `scale_inv_min`,
/// `scale_inv_max`, `scale_inv_std` (the smallest, largest and std of the blocks' dequantization factors), of the chosen GEMM inputs
/// quantized as the GEMM's rowwise use quantizes them: the scope's `NVFP4BlockScaling` switches, or TE's defaults
/// under any other recipe (TE needs the NVFP4 recipe). Round to nearest: gradients are described without
/// stochastic rounding's noise. `underflows%` counts nonzero elements that dequantize to zero, including the
/// elements of blocks whose E4M3 scale underflowed (TE counts zero codes, whose codes there are ±6).
pub struct LogNvfp4TensorStats {
    entries: Scheduled<Vec<Stat>>,
}

impl LogNvfp4TensorStats {
    /// Builds the feature from its config entry.
    pub fn from_spec(spec: &FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> {
        let keys: Vec<&str> = SCHEDULE_KEYS.iter().copied().chain(["stats"]).collect();
        let known: Vec<String> = STATS.iter().map(|s| s.name().to_string()).collect();
        let entries = spec
            .items(Need::No, Need::Required, &TensorName::INPUTS, Some(&keys))?
            .into_iter()
            .map(|item| {
                let stats = parse_stats(&item, &known, |name| {
                    STATS.into_iter().find(|s| s.name() == name)
                })?;
                Ok((
                    item.tensor.expect("tensors are required"),
                    item.schedule()?,
                    stats.into_iter().map(|(_, stat)| stat).collect(),
                ))
            })
            .collect::<Result<_, ConfigError>>()?;
        Ok(Box::new(LogNvfp4TensorStats {
            entries: Scheduled(entries),
        }))
    }
}

impl Feature for LogNvfp4TensorStats {
    fn name(&self) -> &str {
        "LogNvfp4TensorStats"
    }

    fn logged_stats(&self) -> Vec<(TensorName, String)> {
        self.entries.logged_stats(PREFIX)
    }

    fn inspect_tensor_enabled(
        &self,
        _layer: &str,
        tensor: TensorName,
        iteration: u64,
    ) -> Option<Routing> {
        self.entries.routing(tensor, iteration)
    }

    fn inspect_tensor(
        &self,
        _layer: &str,
        tensor: TensorName,
        x: &dyn DebugTensor,
        iteration: u64,
        out: &mut Inspection,
    ) -> Result<(), DebugError> {
        let Some(role) = tensor.role() else {
            return Ok(()); // The config admits GEMM inputs only.
        };
        let recipe = match x.recipe() {
            Some(Recipe::Nvfp4(recipe)) => recipe,
            _ => NVFP4BlockScaling::default(),
        };
        let plan = Nvfp4Plan::nearest(&recipe, role, role.rowwise_k_along_cols(), false);
        for stats in self.entries.due(tensor, iteration) {
            out.request_stats(StatRequest {
                quantization: Some((Fp8Format::E4M3, StatsScaling::Nvfp4(plan))),
                prefix: PREFIX.to_string(),
                suffix: String::new(),
                stats: stats.clone(),
            });
        }
        Ok(())
    }
}
