//! The precision advisor: which GEMMs to keep in high precision, from K steps of a model's own statistics.
//!
//! Train a few steps under the recipe with [`Advisor::config`] as the debug config (a logger collects what it
//! logs), then [`Advisor::advise`]: every layer × GEMM is ranked by how much low precision hurts it, and the worst
//! are kept in high precision within a FLOP budget, written as a debug config in Transformer Engine's YAML
//! ([`Advice::to_yaml`]: `DisableFP8GEMM` per layer, `DisableFP8Layer` where all three GEMMs are chosen), each
//! choice with its numbers in a comment. `examples/precision_advisor.rs` is the command.
//!
//! The evidence per GEMM, over the K steps:
//! - `sqnr`: the GEMM output's SQNR against its high-precision result (LogQuantizationError), the mean of its
//!   noise power `10^(−sqnr/10)` over the steps — what the recipe's scales, underflows, saturation and rounding do
//!   to this GEMM, measured where it lands;
//! - underflows% and overflows% of its two operands as this GEMM quantizes them (LogFp8TensorStats; the
//!   `_columnwise` stats where the GEMM reduces along the other dimension: the activation and gradient at wgrad,
//!   the weight at dgrad), the largest — values flushed to zero are information lost even where they carry
//!   little of the output's energy;
//! - amax growth: the largest step-to-step ratio of an input operand's `cur_amax` (LogTensorStats), relative to
//!   the median of the model's layers — a layer whose amax outpaces the others' (and its scales) precedes FP8
//!   divergence (Fishman et al., arXiv 2409.12517);
//! - kurtosis of the layer's activation (this module's `AdvisorProbe`, on the host): outlier features, which
//!   per-tensor scales serve badly and which precede instabilities (FOG, arXiv 2505.20524).
//!
//! The score is the noise power, weighted up by what it underrates and by the divergence signs:
//! `10^(−sqnr/10) · (1 + 4·(underflows% + overflows%)/100) · (1 + max(0, kurtosis − 3)/10) · max(1, amax growth)`,
//! the kurtosis term for the GEMMs that take the activation (fprop, wgrad). The noise power ranks what is hurt
//! now; the weights (heuristics, stated in every written config) rank higher what is likely to get worse.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use burn_te::Gemm;

use crate::error::DebugError;
use crate::features::advisor_probe::PROBE;
pub use crate::features::advisor_probe::kurtosis;
use crate::stats::StatValue;
use crate::tensor::TensorName;

mod plan;

pub use plan::{GemmChoice, PlanAdvice, PlanBound, PlanOptions, recipe_cost, recipe_width_class};

/// The options of an advice.
#[derive(Clone, Debug, PartialEq)]
pub struct AdvisorOptions {
    /// The largest fraction of the measured GEMM FLOPs kept in high precision (default 0.10).
    pub budget: f64,
    /// GEMMs whose SQNR is at least this (dB) are never chosen, whatever the budget (default 40: an error of 1 %
    /// in L2 or less).
    pub good_enough_db: f64,
    /// Write TE's newer feature names (`DisableQuantizationGEMM` / `DisableQuantizationLayer`) instead of
    /// `DisableFP8GEMM` / `DisableFP8Layer` (default false: both load here and in TE).
    pub new_names: bool,
}

impl Default for AdvisorOptions {
    fn default() -> Self {
        AdvisorOptions {
            budget: 0.10,
            good_enough_db: 40.0,
            new_names: false,
        }
    }
}

/// What the advisor knows of one layer's GEMM.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmEvidence {
    /// The layer.
    pub layer: String,
    /// The GEMM.
    pub gemm: Gemm,
    /// SQNR in dB of the mean noise power over the steps.
    pub sqnr_db: f64,
    /// The largest underflows% of the GEMM's operands over the steps.
    pub underflows: f64,
    /// The largest overflows% of the GEMM's operands.
    pub overflows: f64,
    /// The largest step-to-step `cur_amax` ratio of the GEMM's input operands (activation, gradient), relative to
    /// the median over the model's layers of the same tensor; 1 for a layer that grows as the model does.
    pub amax_growth: f64,
    /// The layer activation's largest kurtosis over the steps (3 for a normal distribution).
    pub kurtosis: f64,
    /// FLOPs of one call of the GEMM (`2·tokens·in·out`, the same for the three GEMMs of a layer).
    pub flops: f64,
    /// How much low precision hurts it (see the module docs).
    pub score: f64,
}

/// The ranked GEMMs and the ones chosen for high precision.
#[derive(Clone, Debug, PartialEq)]
pub struct Advice {
    /// Every measured GEMM, worst first.
    pub ranked: Vec<GemmEvidence>,
    /// Indices into `ranked` of the GEMMs kept in high precision.
    pub chosen: Vec<usize>,
    /// The fraction of the measured GEMM FLOPs they take.
    pub fraction: f64,
    /// The options it was made with.
    pub options: AdvisorOptions,
    /// Steps the evidence covers.
    pub steps: usize,
}

/// The advisor: the statistics it asks for, and the advice it makes of them.
pub struct Advisor;

impl Advisor {
    /// The debug config that collects the advisor's evidence on the layers matching `layers` (a regex), every
    /// `freq` steps.
    pub fn config(layers: &str, freq: u64) -> Result<String, DebugError> {
        let freq = freq.max(1);
        let layers = yaml_quoted(layers);
        let candidates = plan::CANDIDATES.join(", ");
        // Each candidate's underflows in both orientations (per-tensor current scaling has one).
        let what_if = plan::CANDIDATES
            .iter()
            .map(|recipe| match *recipe {
                "fp8_current_scaling" => format!("{recipe}_underflows%"),
                _ => format!("{recipe}_underflows%, {recipe}_underflows%_columnwise"),
            })
            .collect::<Vec<_>>()
            .join(", ");
        Ok(format!(
            "precision_advisor:
  enabled: True
  layers:
    layer_name_regex_pattern: {layers}
  transformer_engine:
    LogQuantizationError:
      enabled: True
      gemms: [fprop, dgrad, wgrad]
      stats: [sqnr]
      freq: {freq}
    LogFp8TensorStats:
      enabled: True
      tensors: [activation, weight, gradient]
      stats: [underflows%, overflows%, underflows%_columnwise, overflows%_columnwise, {what_if}]
      freq: {freq}
    LogTensorStats:
      enabled: True
      tensors: [activation, gradient]
      stats: [cur_amax]
      freq: {freq}
    LogRecipeCandidates:
      enabled: True
      gemms: [fprop, dgrad, wgrad]
      recipes: [{candidates}]
      stats: [sqnr]
      freq: {freq}
  {PROBE}:
    enabled: True
    freq: {freq}
"
        ))
    }

    /// Ranks every GEMM the statistics cover and chooses the worst for high precision within the budget.
    pub fn advise(stats: &[(u64, StatValue)], options: AdvisorOptions) -> Advice {
        let mut sqnr: BTreeMap<(String, Gemm), Vec<f64>> = BTreeMap::new();
        let mut fp8: BTreeMap<(String, TensorName, String), f64> = BTreeMap::new();
        let mut amax: BTreeMap<(String, TensorName), BTreeMap<u64, f64>> = BTreeMap::new();
        let mut kurtosis: BTreeMap<String, f64> = BTreeMap::new();
        let mut elements: BTreeMap<String, f64> = BTreeMap::new();
        let mut outputs: BTreeMap<String, f64> = BTreeMap::new();
        let mut steps = std::collections::BTreeSet::new();
        for (iteration, value) in stats {
            let Some(tensor) = value.tensor else {
                // The probe's scalars (the largest over micro-batches and steps).
                for (suffix, into) in [
                    ("_activation_kurtosis", &mut kurtosis),
                    ("_activation_elements", &mut elements),
                    ("_weight_out", &mut outputs),
                ] {
                    if let Some(layer) = value.name.strip_suffix(suffix) {
                        let entry = into.entry(layer.to_string()).or_insert(f64::NEG_INFINITY);
                        *entry = entry.max(value.value);
                    }
                }
                continue;
            };
            let layer = value.layer.clone();
            match value.stat.as_str() {
                "sqnr" => {
                    let gemm = match tensor {
                        TensorName::Output => Gemm::Fprop,
                        TensorName::Dgrad => Gemm::Dgrad,
                        TensorName::Wgrad => Gemm::Wgrad,
                        _ => continue,
                    };
                    steps.insert(*iteration);
                    sqnr.entry((layer, gemm)).or_default().push(value.value);
                }
                stat if stat.starts_with("underflows%") || stat.starts_with("overflows%") => {
                    let entry = fp8.entry((layer, tensor, stat.to_string())).or_insert(0.0);
                    *entry = entry.max(value.value);
                }
                "cur_amax" => {
                    amax.entry((layer, tensor))
                        .or_default()
                        .insert(*iteration, value.value);
                }
                _ => {}
            }
        }
        // The largest step-to-step amax ratio of each (layer, tensor), then relative to the median over the
        // layers of that tensor: what the whole model does (gradients growing from initialization, a learning
        // rate warmup) cancels, a layer outpacing the others stands out.
        let raw_growth: BTreeMap<(String, TensorName), f64> = amax
            .iter()
            .map(|(key, series)| {
                let values: Vec<f64> = series.values().copied().collect();
                let growth = values
                    .windows(2)
                    .filter(|w| w[0] > 0.0 && w[1].is_finite())
                    .map(|w| w[1] / w[0])
                    .fold(1.0, f64::max);
                (key.clone(), growth)
            })
            .collect();
        let median = |tensor: TensorName| {
            let mut values: Vec<f64> = raw_growth
                .iter()
                .filter(|((_, t), _)| *t == tensor)
                .map(|(_, g)| *g)
                .collect();
            values.sort_by(f64::total_cmp);
            values.get(values.len() / 2).copied().unwrap_or(1.0)
        };
        let medians: BTreeMap<TensorName, f64> = [TensorName::Activation, TensorName::Gradient]
            .into_iter()
            .map(|t| (t, median(t)))
            .collect();
        let growth = |layer: &str, tensor: TensorName| {
            raw_growth
                .get(&(layer.to_string(), tensor))
                .map_or(1.0, |g| g / medians.get(&tensor).copied().unwrap_or(1.0))
        };
        let mut ranked: Vec<GemmEvidence> = sqnr
            .into_iter()
            .map(|((layer, gemm), values)| {
                let noise = mean_noise_power(&values);
                let (lhs, rhs) = gemm.operands();
                let operands = [TensorName::from(lhs), TensorName::from(rhs)];
                // The operand's stat in the orientation this GEMM quantizes it (the rowwise one where the
                // columnwise is not logged).
                let worst = |stat: &str| {
                    operands
                        .iter()
                        .filter_map(|&t| {
                            let columnwise = matches!(
                                (gemm, t),
                                (Gemm::Wgrad, _) | (Gemm::Dgrad, TensorName::Weight)
                            );
                            let name = if columnwise {
                                format!("{stat}_columnwise")
                            } else {
                                stat.to_string()
                            };
                            fp8.get(&(layer.clone(), t, name))
                                .or_else(|| fp8.get(&(layer.clone(), t, stat.to_string())))
                        })
                        .fold(0.0, |a: f64, &b| a.max(b))
                };
                let amax_growth = operands
                    .iter()
                    .filter(|t| **t != TensorName::Weight)
                    .map(|t| growth(&layer, *t))
                    .fold(1.0, f64::max);
                let layer_kurtosis = kurtosis.get(&layer).copied().unwrap_or(3.0);
                let (underflows, overflows) = (worst("underflows%"), worst("overflows%"));
                let outliers = if gemm == Gemm::Dgrad {
                    1.0
                } else {
                    1.0 + (layer_kurtosis - 3.0).max(0.0) / 10.0
                };
                let score = noise
                    * (1.0 + 4.0 * (underflows + overflows) / 100.0)
                    * outliers
                    * amax_growth.max(1.0);
                GemmEvidence {
                    sqnr_db: -10.0 * noise.log10(),
                    underflows,
                    overflows,
                    amax_growth,
                    kurtosis: layer_kurtosis,
                    flops: 2.0
                        * elements.get(&layer).copied().unwrap_or(0.0)
                        * outputs.get(&layer).copied().unwrap_or(0.0),
                    score,
                    layer,
                    gemm,
                }
            })
            .collect();
        ranked.sort_by(|a, b| {
            b.score
                .total_cmp(&a.score)
                .then_with(|| (&a.layer, a.gemm).cmp(&(&b.layer, b.gemm)))
        });
        let total: f64 = ranked.iter().map(|e| e.flops).sum();
        let mut used = 0.0;
        let mut chosen = Vec::new();
        for (index, evidence) in ranked.iter().enumerate() {
            if evidence.sqnr_db >= options.good_enough_db {
                continue;
            }
            if total > 0.0 && (used + evidence.flops) / total <= options.budget + 1e-12 {
                used += evidence.flops;
                chosen.push(index);
            }
        }
        Advice {
            ranked,
            chosen,
            fraction: if total > 0.0 { used / total } else { 0.0 },
            options,
            steps: steps.len(),
        }
    }
}

impl Advice {
    /// The advice as a debug config in Transformer Engine's YAML: one section per layer with chosen GEMMs, each
    /// choice and the ranking in comments. Loads with [`crate::config::Config::parse`] and in TE.
    pub fn to_yaml(&self) -> String {
        let (gemm_feature, layer_feature) = if self.options.new_names {
            ("DisableQuantizationGEMM", "DisableQuantizationLayer")
        } else {
            ("DisableFP8GEMM", "DisableFP8Layer")
        };
        let mut yaml = String::new();
        let _ = writeln!(
            yaml,
            "# Written by burn-te's precision advisor from {} measured steps: the GEMMs low precision hurts most, kept",
            self.steps
        );
        let _ = writeln!(
            yaml,
            "# in high precision within a budget of {:.1} % of the GEMM FLOPs (used: {:.1} %).",
            self.options.budget * 100.0,
            self.fraction * 100.0
        );
        let _ = writeln!(
            yaml,
            "# score = 10^(-sqnr/10) * (1 + 4*(underflows% + overflows%)/100) * (1 + max(0, kurtosis - 3)/10 at fprop and\n\
             #   wgrad) * max(1, amax growth): the noise the recipe adds, weighted by the values it flushes or clips and by\n\
             #   the signs of divergence (outlier features, amax growth). Ranking, worst first:"
        );
        for (rank, e) in self.ranked.iter().enumerate() {
            let _ = writeln!(
                yaml,
                "#   {:>2}. {:<40} {:<5} sqnr {:>6.2} dB  underflows {:>6.2} %  overflows {:>5.2} %  amax growth {:>5.2}x  kurtosis {:>7.2}  flops {:>6.3}%{}",
                rank + 1,
                e.layer,
                e.gemm.name(),
                e.sqnr_db,
                e.underflows,
                e.overflows,
                e.amax_growth,
                e.kurtosis,
                100.0 * e.flops / self.ranked.iter().map(|e| e.flops).sum::<f64>().max(1.0),
                if self.chosen.contains(&rank) {
                    "  <- high precision"
                } else {
                    ""
                }
            );
        }
        let mut by_layer: BTreeMap<&str, Vec<&GemmEvidence>> = BTreeMap::new();
        for &index in &self.chosen {
            let e = &self.ranked[index];
            by_layer.entry(&e.layer).or_default().push(e);
        }
        if by_layer.is_empty() {
            let _ = writeln!(
                yaml,
                "# Nothing chosen: every GEMM is good enough (SQNR >= {} dB) or over the budget.",
                self.options.good_enough_db
            );
        }
        for (index, (layer, chosen)) in by_layer.iter().enumerate() {
            let _ = writeln!(yaml);
            for e in chosen {
                let _ = writeln!(
                    yaml,
                    "# {layer} {}: SQNR {:.2} dB, underflows {:.2} %, overflows {:.2} %, amax growth {:.2}x, kurtosis {:.2}",
                    e.gemm.name(),
                    e.sqnr_db,
                    e.underflows,
                    e.overflows,
                    e.amax_growth,
                    e.kurtosis
                );
            }
            let _ = writeln!(yaml, "advisor_high_precision_{index}:");
            let _ = writeln!(yaml, "  enabled: True");
            let _ = writeln!(yaml, "  layers:");
            let _ = writeln!(
                yaml,
                "    layer_name_regex_pattern: {}",
                yaml_quoted(&format!("^{}$", regex_escape(layer)))
            );
            let _ = writeln!(yaml, "  transformer_engine:");
            if chosen.len() == 3 {
                let _ = writeln!(yaml, "    {layer_feature}:");
                let _ = writeln!(yaml, "      enabled: True");
            } else {
                let mut gemms: Vec<Gemm> = chosen.iter().map(|e| e.gemm).collect();
                gemms.sort();
                let names: Vec<&str> = gemms.iter().map(|g| g.name()).collect();
                let _ = writeln!(yaml, "    {gemm_feature}:");
                let _ = writeln!(yaml, "      enabled: True");
                let _ = writeln!(yaml, "      gemms: [{}]", names.join(", "));
            }
        }
        yaml
    }
}

/// The mean noise power `10^(−sqnr/10)` of SQNR samples (dB): a +inf SQNR (no error) contributes none; a NaN one
/// (NaN or infinite values in the GEMM's tensors) counts as infinite noise, so that GEMM ranks worst rather than
/// at an arbitrary end.
pub(crate) fn mean_noise_power(values: &[f64]) -> f64 {
    let power = |db: f64| {
        if db.is_nan() {
            f64::INFINITY
        } else {
            10f64.powf(-db / 10.0)
        }
    };
    values.iter().map(|&db| power(db)).sum::<f64>() / values.len().max(1) as f64
}

/// `text` as a single-quoted YAML scalar (a `'` inside is doubled, as YAML escapes it).
pub(crate) fn yaml_quoted(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// `text` with the regex metacharacters escaped (layer names carry dots).
fn regex_escape(text: &str) -> String {
    fancy_regex::escape(text).into_owned()
}
