//! LogFp8TensorStats: what quantizing a tensor to FP8 does to it — underflows, overflows, scales, error.

use std::collections::BTreeSet;

use burn_te::{Fp8Format, Recipe, TensorRole};

use super::Scheduled;
use super::log_tensor_stats::parse_stats;
use crate::config::{FeatureSpec, Need, SCHEDULE_KEYS};
use crate::error::{ConfigError, DebugError};
use crate::feature::{DebugTensor, Feature, Inspection};
use crate::routing::Routing;
use crate::stats::{Stat, StatRequest, StatsScaling};
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
    /// `mxfp8_`: MXFP8BlockScaling's E8M0 scale per 32 values along the GEMM's reduction dimension.
    Mxfp8,
    /// `fp8_block_scaling_`: Float8BlockScaling's power-of-two scales (1×128 tiles, 128×128 weight blocks).
    BlockScaling,
    /// `nvfp4_`: NVFP4BlockScaling's E2M1 values with an E4M3 scale per 16 (TE's LogFp8TensorStats rejects it).
    Nvfp4,
}

impl WhatIf {
    const ALL: [WhatIf; 6] = [
        WhatIf::Actual,
        WhatIf::Delayed,
        WhatIf::Current,
        WhatIf::Mxfp8,
        WhatIf::BlockScaling,
        WhatIf::Nvfp4,
    ];

    fn prefix(self) -> &'static str {
        match self {
            WhatIf::Actual => "",
            WhatIf::Delayed => "fp8_delayed_scaling_",
            WhatIf::Current => "fp8_current_scaling_",
            WhatIf::Mxfp8 => "mxfp8_",
            WhatIf::BlockScaling => "fp8_block_scaling_",
            WhatIf::Nvfp4 => "nvfp4_",
        }
    }

    /// Whether the stat may take the `_columnwise` suffix (per-tensor scales have one orientation only; the GEMM's
    /// own recipe is known at run time).
    fn has_orientations(self) -> bool {
        matches!(
            self,
            WhatIf::Actual | WhatIf::Mxfp8 | WhatIf::BlockScaling | WhatIf::Nvfp4
        )
    }

    /// Whether `overflows%` may take this prefix: TE's is for delayed scaling only, where a scale from past amaxes
    /// can leave a value above the format's range; current, block and MXFP8 scales come from the values' own
    /// amax and cannot. Ours also for NVFP4, whose E4M3 block scale can round below the block's amax / 6.
    fn has_overflows(self) -> bool {
        matches!(self, WhatIf::Actual | WhatIf::Delayed | WhatIf::Nvfp4)
    }

    /// The recipe whose blocks a block what-if takes.
    fn block_recipe(self) -> Option<Recipe> {
        match self {
            WhatIf::Mxfp8 => Some(Recipe::Mxfp8(Default::default())),
            WhatIf::BlockScaling => Some(Recipe::Block(Default::default())),
            WhatIf::Nvfp4 => Some(Recipe::Nvfp4(Default::default())),
            _ => None,
        }
    }
}

/// `_columnwise`: the stat of the tensor's other orientation (its blocks transposed).
const COLUMNWISE: &str = "_columnwise";

/// The name suffix of a stat's orientation.
fn orientation_suffix(columnwise: bool) -> &'static str {
    if columnwise { COLUMNWISE } else { "" }
}

/// Warns that a configured stat does not apply to a GEMM (its recipe has no such stat), once per tensor and reason
/// in the process, naming the first layer: a config that asks every recipe's stats (the advisor's) would otherwise
/// repeat it for every layer at every step.
fn warn_skip(layer: &str, tensor: TensorName, why: &str) {
    static SAID: std::sync::Mutex<BTreeSet<String>> = std::sync::Mutex::new(BTreeSet::new());
    let key = format!("{tensor}: {why}");
    let first = SAID
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key.clone());
    if first {
        tracing::warn!("LogFp8TensorStats: {key} (not logged; first at {layer}, said once)");
    }
}

/// One configured stat: its recipe, the stat, and whether it is the columnwise one.
type Fp8StatName = (WhatIf, Stat, bool);

fn parse_name(name: &str) -> Option<Fp8StatName> {
    let (name, columnwise) = match name.strip_suffix(COLUMNWISE) {
        Some(rest) => (rest, true),
        None => (name, false),
    };
    // The longest matching prefix: "" matches everything.
    WhatIf::ALL.into_iter().rev().find_map(|what_if| {
        let rest = name.strip_prefix(what_if.prefix())?;
        let stat = Stat::FP8.into_iter().find(|s| s.name() == rest)?;
        let allowed = (!columnwise || what_if.has_orientations())
            && (stat != Stat::Overflows || what_if.has_overflows());
        allowed.then_some((what_if, stat, columnwise))
    })
}

/// Logs `[<recipe>_]<stat>[_columnwise]` for stat ∈ underflows%, overflows%, scale_inv_min, scale_inv_max, mse, of
/// the chosen GEMM inputs (TE's `LogFp8TensorStats`).
///
/// Without a prefix the stat describes the GEMM's own quantization. With a recipe prefix it describes quantizing
/// the high-precision tensor with that recipe (what-if): `fp8_current_scaling_` (per-tensor current scale),
/// `fp8_delayed_scaling_` (the layer's delayed-scaling scale; needs a DelayedScaling scope), `mxfp8_` (E8M0 scale
/// per 32 values), `fp8_block_scaling_` (power-of-two scales per 1×128 tile, 128×128 for weights: the blocks
/// Float8BlockScaling gives the tensor; TE's what-if takes 128×128 for every tensor) and `nvfp4_` (NVFP4 with TE's
/// default blocks and RHT, round to nearest; `scale_inv_min`/`max` range over the blocks' dequantization factors;
/// TE rejects this prefix). The format is the one the
/// scope's recipe gives the tensor (HYBRID's when there is no scope).
///
/// Block scales run along the GEMM's reduction dimension, which differs between a tensor's two GEMMs: the stat
/// describes the tensor's rowwise use as TE names it (activation at fprop, weight at fprop, gradient at dgrad),
/// and `_columnwise` the other (activation and gradient at wgrad, weight at dgrad). `scale_inv_min`/`max` range
/// over the blocks.
pub struct LogFp8TensorStats {
    entries: Scheduled<Vec<Fp8StatName>>,
}

impl LogFp8TensorStats {
    /// Builds the feature from its config entry.
    pub fn from_spec(spec: &FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> {
        let keys: Vec<&str> = SCHEDULE_KEYS.iter().copied().chain(["stats"]).collect();
        // Every prefix × stat × orientation that `parse_name` takes (its rules decide, here and when parsing).
        let known: Vec<String> = WhatIf::ALL
            .iter()
            .flat_map(|w| {
                Stat::FP8.iter().flat_map(move |s| {
                    ["", COLUMNWISE].map(|suffix| format!("{}{}{suffix}", w.prefix(), s.name()))
                })
            })
            .filter(|name| parse_name(name).is_some())
            .collect();
        let entries = spec
            .items(Need::No, Need::Required, &TensorName::INPUTS, Some(&keys))?
            .into_iter()
            .map(|item| {
                let stats = parse_stats(&item, &known, |name| parse_name(name).map(|(_, s, _)| s))?;
                let stats = stats
                    .into_iter()
                    .map(|(name, _)| parse_name(&name).expect("parsed above"))
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

    fn logged_stats(&self) -> Vec<(TensorName, String)> {
        self.entries
            .entries()
            .flat_map(|(tensor, stats)| {
                stats.iter().map(move |&(what_if, stat, columnwise)| {
                    let suffix = orientation_suffix(columnwise);
                    (tensor, stat.logged_name(what_if.prefix(), suffix))
                })
            })
            .collect()
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
        let Some(role) = tensor.role() else {
            return Ok(()); // The config admits GEMM inputs only.
        };
        let format = match &recipe {
            Some(recipe) => recipe.format().for_role(role),
            None => hybrid_format(tensor),
        };
        let delayed = matches!(recipe, Some(Recipe::Delayed(_)));
        for stats in self.entries.due(tensor, iteration) {
            for &(what_if, stat, columnwise) in stats {
                let block_recipe = match what_if {
                    WhatIf::Actual => recipe.clone(),
                    other => other.block_recipe(),
                };
                let k_along_cols = role.rowwise_k_along_cols() != columnwise;
                let skip = |why: &str| warn_skip(layer, tensor, why);
                if let Some(Recipe::Nvfp4(nvfp4)) = &block_recipe {
                    // The columnwise use of an activation or gradient is the wgrad's, under the RHT.
                    let plan = burn_te::gemm::nvfp4::Nvfp4Plan::nearest(
                        nvfp4,
                        role,
                        k_along_cols,
                        columnwise,
                    );
                    out.request_stats(StatRequest {
                        quantization: Some((Fp8Format::E4M3, StatsScaling::Nvfp4(plan))),
                        prefix: what_if.prefix().to_string(),
                        suffix: orientation_suffix(columnwise).to_string(),
                        stats: vec![stat],
                    });
                    continue;
                }
                if stat == Stat::Overflows && what_if == WhatIf::Actual && !delayed {
                    skip(
                        "overflows% is TE's for fp8_delayed_scaling only (a scale taken from the tensor's own amax \
                         cannot overflow); this GEMM's recipe is not",
                    );
                    continue;
                }
                let block = block_recipe.and_then(|r| r.block(role, k_along_cols));
                let scaling = match (what_if, block) {
                    (_, Some((block, rule))) => StatsScaling::Block { block, rule },
                    (WhatIf::Actual, None) if recipe.is_none() => {
                        skip(
                            "not quantized (no FP8 scope); use a recipe prefix (e.g. fp8_current_scaling_) for \
                             what-if stats",
                        );
                        continue;
                    }
                    (_, None) if columnwise => {
                        skip(&format!(
                            "{}{COLUMNWISE} needs a block recipe (per-tensor scales have one orientation)",
                            stat.name()
                        ));
                        continue;
                    }
                    (WhatIf::Actual | WhatIf::Delayed, None) if delayed => StatsScaling::Delayed,
                    (WhatIf::Delayed, None) => {
                        skip("fp8_delayed_scaling_ stats need a DelayedScaling recipe");
                        continue;
                    }
                    _ => StatsScaling::Current { margin: 0.0 },
                };
                // The session merges the requests of one prefix and suffix into one launch.
                out.request_stats(StatRequest {
                    quantization: Some((format, scaling)),
                    prefix: what_if.prefix().to_string(),
                    suffix: orientation_suffix(columnwise).to_string(),
                    stats: vec![stat],
                });
            }
        }
        Ok(())
    }
}
