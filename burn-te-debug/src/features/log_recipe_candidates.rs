//! LogRecipeCandidates: what each candidate recipe would make of a GEMM, on the same tensors (the advisor's
//! evidence for a recipe plan).

use burn_te::Gemm;
use burn_te::plan::{HIGH_PRECISION, PLAN_RECIPES};

use super::Scheduled;
use super::log_quantization_error::error_stat_items;
use crate::config::FeatureSpec;
use crate::error::{ConfigError, ConfigErrorKind, DebugError};
use crate::feature::{DebugTensor, Feature, Inspection};
use crate::routing::Routing;
use crate::stats::{Stat, StatRequest};
use crate::tensor::TensorName;

/// Logs, for each chosen GEMM and candidate recipe, the error stats of the GEMM run under that recipe on the
/// operands as they came, against the same GEMM in high precision (ours; TE has no such feature): e.g.
/// `fc1_output_mxfp8_sqnr`, `fc1_wgrad_nvfp4_sqnr`. The candidate GEMM is the recipe's FP8 GEMM itself (its
/// quantization, blocks, Hadamard transform and rounding), run beside the one training uses, which it does not
/// change. A name of the running recipe's kind takes its settings (under `nvfp4` with RHT off, the `nvfp4`
/// candidate has RHT off too). `fp8_delayed_scaling` cannot be a candidate (its scale is the layer's history) and
/// `high_precision` needs none (its error is zero).
///
/// ```yaml
/// recipe_candidates:
///   enabled: True
///   layers:
///     layer_types: [fc1, fc2]
///   transformer_engine:
///     LogRecipeCandidates:
///       enabled: True
///       gemms: [fprop, dgrad, wgrad]
///       recipes: [fp8_current_scaling, fp8_block_scaling, mxfp8, nvfp4]
///       stats: [sqnr]
///       freq: 10
/// ```
pub struct LogRecipeCandidates {
    entries: Scheduled<(Vec<String>, Vec<Stat>)>,
}

/// The recipes a candidate may be, narrowest first (see the advisor's `recipe_width_class` and `recipe_cost`).
pub(crate) const CANDIDATES: [&str; 4] =
    ["nvfp4", "fp8_current_scaling", "fp8_block_scaling", "mxfp8"];

impl LogRecipeCandidates {
    /// Builds the feature from its config entry.
    pub fn from_spec(spec: &FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> {
        let entries = error_stat_items(spec, &["recipes"], recipes)?
            .into_iter()
            .map(|(tensor, schedule, (stats, recipes))| (tensor, schedule, (recipes, stats)))
            .collect();
        Ok(Box::new(LogRecipeCandidates {
            entries: Scheduled(entries),
        }))
    }
}

/// The item's `recipes`: known candidate names.
fn recipes(item: &crate::config::Item) -> Result<Vec<String>, ConfigError> {
    use serde_yaml_ng::Value;
    let invalid =
        |reason: String| item.error(Some("recipes"), ConfigErrorKind::InvalidValue(reason));
    let value = item
        .get("recipes")
        .ok_or_else(|| item.error(None, ConfigErrorKind::MissingKey("recipes".into())))?;
    let names: Vec<String> = match value {
        Value::Sequence(items) => items
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| invalid("recipes: expected a list of recipe names".into()))?,
        Value::String(name) => vec![name.clone()],
        other => return Err(invalid(format!("recipes: expected a list, got {other:?}"))),
    };
    for name in &names {
        if !CANDIDATES.contains(&name.as_str()) {
            let why = if name == "fp8_delayed_scaling" {
                "its scale comes from the layer's amax history".to_string()
            } else if name == HIGH_PRECISION {
                "its error is zero".to_string()
            } else {
                format!("not a recipe (recipes: {PLAN_RECIPES})")
            };
            return Err(invalid(format!(
                "recipes: \"{name}\" cannot be a candidate: {why} (candidates: {})",
                CANDIDATES.join(", ")
            )));
        }
    }
    Ok(names)
}

impl Feature for LogRecipeCandidates {
    fn name(&self) -> &str {
        "LogRecipeCandidates"
    }

    fn logged_stats(&self) -> Vec<(TensorName, String)> {
        self.entries
            .entries()
            .flat_map(|(tensor, (recipes, stats))| {
                recipes.iter().flat_map(move |recipe| {
                    stats
                        .iter()
                        .map(move |stat| (tensor, format!("{recipe}_{}", stat.name())))
                })
            })
            .collect()
    }

    fn gemm_error_enabled(&self, _layer: &str, gemm: Gemm, iteration: u64) -> Option<Routing> {
        self.entries.routing(TensorName::output_of(gemm), iteration)
    }

    fn gemm_candidates(&self, _layer: &str, gemm: Gemm, iteration: u64) -> Vec<String> {
        self.entries
            .due(TensorName::output_of(gemm), iteration)
            .flat_map(|(recipes, _)| recipes.iter().cloned())
            .collect()
    }

    fn inspect_gemm_candidate(
        &self,
        _layer: &str,
        gemm: Gemm,
        recipe: &str,
        _output: &dyn DebugTensor,
        _reference: &dyn DebugTensor,
        iteration: u64,
        out: &mut Inspection,
    ) -> Result<(), DebugError> {
        for (recipes, stats) in self.entries.due(TensorName::output_of(gemm), iteration) {
            if recipes.iter().any(|r| r == recipe) {
                out.request_error_stats(StatRequest {
                    quantization: None,
                    prefix: format!("{recipe}_"),
                    suffix: String::new(),
                    stats: stats.clone(),
                });
            }
        }
        Ok(())
    }
}
