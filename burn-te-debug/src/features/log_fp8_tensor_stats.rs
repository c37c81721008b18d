//! LogFp8TensorStats: what quantizing a tensor to FP8 does to it — underflows, overflows, scales, error.

use burn_te::{Fp8Format, TensorRole};

use super::log_tensor_stats::parse_stats;
use super::{DebugTensor, Feature, Inspection, Routing, Scheduled, StatsScaling};
use crate::config::{FeatureSpec, Need, SCHEDULE_KEYS};
use crate::error::{ConfigError, DebugError};
use crate::stats::{Stat, StatRequest};
use crate::tensor::TensorName;

/// A stat's recipe: the GEMM's own quantization, or a what-if one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum WhatIf {
    /// The quantization the GEMM uses (no prefix).
    Actual,
    /// `fp8_delayed_scaling_`: the layer's delayed-scaling scale.
    Delayed,
    /// `fp8_current_scaling_`: a per-tensor current scale.
    Current,
}

impl WhatIf {
    const ALL: [WhatIf; 3] = [WhatIf::Actual, WhatIf::Delayed, WhatIf::Current];

    fn prefix(self) -> &'static str {
        match self {
            WhatIf::Actual => "",
            WhatIf::Delayed => "fp8_delayed_scaling_",
            WhatIf::Current => "fp8_current_scaling_",
        }
    }
}

/// Logs `[<recipe>_]<stat>` for stat ∈ underflows%, overflows%, scale_inv_min, scale_inv_max, mse, of the chosen
/// GEMM inputs (TE's `LogFp8TensorStats`). Without a prefix the stat describes the GEMM's own quantization; with
/// `fp8_current_scaling_` or `fp8_delayed_scaling_` it describes that per-tensor recipe (what-if). The block
/// recipes' prefixes (`mxfp8_`, `fp8_block_scaling_`) are rejected at config time: their per-block statistics are not
/// implemented yet.
pub struct LogFp8TensorStats {
    entries: Scheduled<Vec<(WhatIf, Stat)>>,
}

impl LogFp8TensorStats {
    /// Builds the feature from its config entry.
    pub fn from_spec(spec: &FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> {
        let keys: Vec<&str> = SCHEDULE_KEYS.iter().copied().chain(["stats"]).collect();
        let known: Vec<String> = WhatIf::ALL
            .iter()
            .flat_map(|w| {
                Stat::FP8
                    .iter()
                    .map(move |s| format!("{}{}", w.prefix(), s.name()))
            })
            .collect();
        let parse = |name: &str| {
            WhatIf::ALL.into_iter().find_map(|w| {
                let rest = name.strip_prefix(w.prefix())?;
                Stat::FP8
                    .into_iter()
                    .find(|s| s.name() == rest)
                    .map(|s| (w, s))
            })
        };
        let entries = spec
            .items(Need::No, Need::Required, &TensorName::INPUTS, Some(&keys))?
            .into_iter()
            .map(|item| {
                let stats = parse_stats(&item, &known, |name| parse(name).map(|(_, s)| s))?;
                let stats = stats
                    .into_iter()
                    .map(|(name, _)| parse(&name).expect("parsed above"))
                    .collect();
                Ok((
                    item.tensor.expect("tensors are required"),
                    item.schedule()?,
                    stats,
                ))
            })
            .collect::<Result<_, ConfigError>>()?;
        Ok(Box::new(LogFp8TensorStats {
            entries: Scheduled(entries),
        }))
    }
}

/// The format TE's default HYBRID recipe gives a tensor.
fn hybrid_format(tensor: TensorName) -> Fp8Format {
    match tensor {
        TensorName::Gradient => burn_te::Format::Hybrid.for_role(TensorRole::Gradient),
        _ => Fp8Format::E4M3,
    }
}

impl Feature for LogFp8TensorStats {
    fn name(&self) -> &str {
        "LogFp8TensorStats"
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
        layer: &str,
        tensor: TensorName,
        x: &dyn DebugTensor,
        iteration: u64,
        out: &mut Inspection,
    ) -> Result<(), DebugError> {
        let recipe = x.recipe();
        let format = match (&recipe, tensor.role()) {
            (Some(recipe), Some(role)) => recipe.format().for_role(role),
            _ => hybrid_format(tensor),
        };
        let delayed = matches!(recipe, Some(burn_te::Recipe::Delayed(_)));
        let block = matches!(
            recipe,
            Some(burn_te::Recipe::Block(_) | burn_te::Recipe::Mxfp8(_))
        );
        for stats in self.entries.due(tensor, iteration) {
            for what_if in WhatIf::ALL {
                let chosen: Vec<Stat> = stats
                    .iter()
                    .filter(|(w, _)| *w == what_if)
                    .map(|(_, s)| *s)
                    .collect();
                if chosen.is_empty() {
                    continue;
                }
                let scaling = match what_if {
                    WhatIf::Actual if block => {
                        tracing::warn!(
                            "{layer}: LogFp8TensorStats: per-block statistics of the {} recipe are not implemented; \
                             use fp8_current_scaling_ or fp8_delayed_scaling_ what-if stats",
                            recipe.as_ref().map_or("", |r| r.name())
                        );
                        continue;
                    }
                    WhatIf::Actual if recipe.is_none() => {
                        tracing::warn!(
                            "{layer}: LogFp8TensorStats: {tensor} is not quantized (no FP8 scope); use a recipe \
                             prefix (e.g. fp8_current_scaling_) for what-if stats"
                        );
                        continue;
                    }
                    WhatIf::Actual | WhatIf::Delayed if delayed => StatsScaling::Delayed,
                    WhatIf::Delayed => {
                        tracing::warn!(
                            "{layer}: LogFp8TensorStats: fp8_delayed_scaling_ stats need a DelayedScaling recipe"
                        );
                        continue;
                    }
                    WhatIf::Actual | WhatIf::Current => StatsScaling::Current { margin: 0.0 },
                };
                out.request_stats(StatRequest {
                    quantization: Some((format, scaling)),
                    prefix: what_if.prefix().to_string(),
                    stats: chosen,
                });
            }
        }
        Ok(())
    }
}
