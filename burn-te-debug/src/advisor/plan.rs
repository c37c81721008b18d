//! The advisor's recipe plans: per GEMM, the narrowest candidate format whose error stays within a bound, and of
//! that width the most accurate recipe.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use burn_te::plan::{HIGH_PRECISION, LayerSelection, PlanRule, RecipePlan};
use burn_te::{Gemm, Recipe};

use super::{Advisor, AdvisorOptions, GemmEvidence, regex_escape, yaml_quoted};
use crate::stats::StatValue;
use crate::tensor::TensorName;

/// The recipes the advisor measures (LogRecipeCandidates'), cheapest first.
pub(crate) use crate::features::log_recipe_candidates::CANDIDATES;

/// A recipe's cost per GEMM FLOP: the bytes of one operand value, scales included (NVFP4: 4 bits and an E4M3 scale
/// per 16; FP8: 1 byte, plus an f32 per 128 for block scaling and an E8M0 per 32 for MXFP8; high precision: bf16),
/// since matrix units run at a rate inverse to the operand width. Equal costs keep `CANDIDATES`' order.
pub fn recipe_cost(recipe: &str) -> f64 {
    match recipe {
        "nvfp4" => 0.5 + 1.0 / 16.0,
        "fp8_current_scaling" | "fp8_delayed_scaling" => 1.0,
        "fp8_block_scaling" => 1.0 + 4.0 / 128.0,
        "mxfp8" => 1.0 + 1.0 / 32.0,
        _ => 2.0,
    }
}

/// A recipe's operand width, the cost class a plan chooses by: 0 for 4 bits (NVFP4), 1 for 8 bits (every FP8
/// recipe), 2 for high precision. Matrix units run each width at its own rate; within one width the recipes differ
/// only by their scales' bytes (under 4 %), which a GEMM's speed does not show, so the plan takes the most accurate.
pub fn recipe_width_class(recipe: &str) -> u8 {
    match recipe {
        "nvfp4" => 0,
        "fp8_current_scaling" | "fp8_delayed_scaling" | "fp8_block_scaling" | "mxfp8" => 1,
        _ => 2,
    }
}

/// How much error a plan allows a GEMM.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PlanBound {
    /// An effective SQNR at most this many dB below the GEMM's best candidate: each GEMM takes the narrowest recipe
    /// that is nearly as good as the best low-precision one, never high precision.
    WithinDbOfBest(f64),
    /// An effective SQNR of at least this many dB (the default, 10 dB): where no candidate reaches it, high
    /// precision (within the budget, worst GEMMs first), else the best candidate.
    AtLeastDb(f64),
}

/// The options of a plan.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanOptions {
    /// The recipe the plan goes over (the scope's recipe): GEMMs that keep it get no rule.
    pub base: Recipe,
    /// The error bound.
    pub bound: PlanBound,
    /// The largest fraction of the measured GEMM FLOPs kept in high precision (default 0.10).
    pub budget: f64,
    /// The largest fraction of the measured GEMM FLOPs that may leave the base recipe's width, high precision
    /// included (default 1: no limit). Over it, the GEMMs the base recipe serves worst leave it first; the others
    /// keep the base recipe. E.g. 0.2 keeps at least 80 % of the FLOPs in NVFP4 over an NVFP4 base. Without
    /// measured FLOPs there is nothing to share out, and no limit.
    pub wider_budget: f64,
}

impl PlanOptions {
    /// A plan over `base` with a bound of 10 dB effective SQNR (noise at a tenth of the signal's power; NVFP4
    /// gives about 14 dB on Gaussian-like operands and FP8 about 25, so a GEMM leaves NVFP4 where its operands
    /// serve NVFP4 markedly worse than usual) and a high-precision budget of 10 %.
    pub fn over(base: impl Into<Recipe>) -> Self {
        Self {
            base: base.into(),
            bound: PlanBound::AtLeastDb(10.0),
            budget: 0.10,
            wider_budget: 1.0,
        }
    }
}

/// One GEMM's evidence and choice.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmChoice {
    /// The layer.
    pub layer: String,
    /// The GEMM.
    pub gemm: Gemm,
    /// FLOPs of one call.
    pub flops: f64,
    /// Each measured candidate's SQNR (dB, the mean noise power over the steps) and effective SQNR (weighted by
    /// its underflows and the layer's kurtosis and amax growth, as the advisor's score), cheapest first.
    pub candidates: Vec<(String, f64, f64)>,
    /// The recipe chosen (`high_precision` included).
    pub chosen: String,
}

/// A plan the advisor made: every GEMM's choice, and the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanAdvice {
    /// Every measured GEMM, by layer and GEMM.
    pub choices: Vec<GemmChoice>,
    /// The options it was made with.
    pub options: PlanOptions,
    /// Steps the evidence covers.
    pub steps: usize,
}

impl Advisor {
    /// Chooses, for every GEMM the statistics of [`Advisor::config`] cover, the narrowest candidate recipe within
    /// `options.bound` (see [`PlanBound`]). A candidate's effective SQNR is its measured SQNR with the advisor's
    /// weights: `−10·log10(10^(−sqnr/10) · (1 + 4·underflows%/100) · kurtosis weight · amax-growth weight)`, its
    /// underflows those of the GEMM's operands under that recipe (`<recipe>_underflows%`, in the orientation the
    /// GEMM quantizes them).
    pub fn plan(stats: &[(u64, StatValue)], options: PlanOptions) -> PlanAdvice {
        let evidence = Advisor::advise(
            stats,
            AdvisorOptions {
                budget: 0.0,
                ..AdvisorOptions::default()
            },
        );
        let mut sqnr: BTreeMap<(String, Gemm, String), Vec<f64>> = BTreeMap::new();
        let mut underflows: BTreeMap<(String, TensorName, String), f64> = BTreeMap::new();
        for (_, value) in stats {
            let Some(tensor) = value.tensor else { continue };
            for recipe in CANDIDATES {
                let Some(stat) = value
                    .stat
                    .strip_prefix(recipe)
                    .and_then(|s| s.strip_prefix('_'))
                else {
                    continue;
                };
                if stat == "sqnr" {
                    let gemm = match tensor {
                        TensorName::Output => Gemm::Fprop,
                        TensorName::Dgrad => Gemm::Dgrad,
                        TensorName::Wgrad => Gemm::Wgrad,
                        _ => continue,
                    };
                    sqnr.entry((value.layer.clone(), gemm, recipe.to_string()))
                        .or_default()
                        .push(value.value);
                } else if stat.starts_with("underflows%") {
                    let key = (value.layer.clone(), tensor, format!("{recipe}_{stat}"));
                    let entry = underflows.entry(key).or_insert(0.0);
                    *entry = entry.max(value.value);
                }
            }
        }
        let mut choices: Vec<GemmChoice> = evidence
            .ranked
            .iter()
            .filter_map(|e| {
                let candidates: Vec<(String, f64, f64)> = CANDIDATES
                    .iter()
                    .filter_map(|recipe| {
                        let values = sqnr.get(&(e.layer.clone(), e.gemm, recipe.to_string()))?;
                        let noise = super::mean_noise_power(values);
                        let flushed = operand_underflows(e, recipe, &underflows);
                        let weighted = noise * (1.0 + 4.0 * flushed / 100.0) * weights(e);
                        Some((
                            recipe.to_string(),
                            -10.0 * noise.log10(),
                            -10.0 * weighted.log10(),
                        ))
                    })
                    .collect();
                (!candidates.is_empty()).then(|| GemmChoice {
                    layer: e.layer.clone(),
                    gemm: e.gemm,
                    flops: e.flops,
                    candidates,
                    chosen: String::new(),
                })
            })
            .collect();
        choices.sort_by(|a, b| (&a.layer, a.gemm).cmp(&(&b.layer, b.gemm)));
        choose(&mut choices, &options);
        PlanAdvice {
            choices,
            options,
            steps: evidence.steps,
        }
    }
}

/// The layer's kurtosis and amax-growth weights of the advisor's score (the kurtosis at the GEMMs that take the
/// activation).
fn weights(e: &GemmEvidence) -> f64 {
    let outliers = if e.gemm == Gemm::Dgrad {
        1.0
    } else {
        1.0 + (e.kurtosis - 3.0).max(0.0) / 10.0
    };
    outliers * e.amax_growth.max(1.0)
}

/// The largest underflows% of the GEMM's operands under `recipe`, each in the orientation the GEMM quantizes it.
fn operand_underflows(
    e: &GemmEvidence,
    recipe: &str,
    underflows: &BTreeMap<(String, TensorName, String), f64>,
) -> f64 {
    let (lhs, rhs) = e.gemm.operands();
    [lhs, rhs]
        .into_iter()
        .map(TensorName::from)
        .filter_map(|t| {
            let columnwise = matches!(
                (e.gemm, t),
                (Gemm::Wgrad, _) | (Gemm::Dgrad, TensorName::Weight)
            );
            let rowwise = format!("{recipe}_underflows%");
            let name = if columnwise {
                format!("{rowwise}_columnwise")
            } else {
                rowwise.clone()
            };
            underflows
                .get(&(e.layer.clone(), t, name))
                .or_else(|| underflows.get(&(e.layer.clone(), t, rowwise)))
        })
        .fold(0.0, |a: f64, &b| a.max(b))
}

/// Each GEMM's candidate of the narrowest width within the bound, the best of that width; under
/// [`PlanBound::AtLeastDb`], high precision where none reaches it and the budget allows (worst first), else its best
/// candidate. Then [`PlanOptions::wider_budget`].
fn choose(choices: &mut [GemmChoice], options: &PlanOptions) {
    let total: f64 = choices.iter().map(|c| c.flops).sum();
    let best = |c: &GemmChoice| {
        c.candidates
            .iter()
            .max_by(|a, b| a.2.total_cmp(&b.2))
            .map(|(name, _, db)| (name.clone(), *db))
            .expect("a choice has candidates")
    };
    let mut short: Vec<usize> = Vec::new();
    for (index, choice) in choices.iter_mut().enumerate() {
        let (best_name, best_db) = best(choice);
        let floor = match options.bound {
            PlanBound::WithinDbOfBest(db) => best_db - db,
            PlanBound::AtLeastDb(db) => db,
        };
        let mut passing: Vec<&(String, f64, f64)> =
            choice.candidates.iter().filter(|c| c.2 >= floor).collect();
        // The narrowest width within the bound; of that width, the best effective SQNR; on a tie the fewer bytes,
        // then the candidates' order.
        passing.sort_by(|a, b| {
            recipe_width_class(&a.0)
                .cmp(&recipe_width_class(&b.0))
                .then(b.2.total_cmp(&a.2))
                .then(recipe_cost(&a.0).total_cmp(&recipe_cost(&b.0)))
        });
        choice.chosen = match passing.first() {
            Some(chosen) => chosen.0.clone(),
            None => {
                short.push(index);
                best_name
            }
        };
    }
    // GEMMs no candidate serves: high precision, worst first, within the budget.
    short.sort_by(|&a, &b| best(&choices[a]).1.total_cmp(&best(&choices[b]).1));
    let mut used = 0.0;
    for index in short {
        let flops = choices[index].flops;
        if total > 0.0 && (used + flops) / total <= options.budget + 1e-12 {
            used += flops;
            choices[index].chosen = HIGH_PRECISION.to_string();
        }
    }
    keep_within_wider_budget(choices, options, total);
}

/// Keeps the GEMMs that leave the base recipe's width within [`PlanOptions::wider_budget`]: those the base serves
/// worst (lowest effective SQNR under it) first, a GEMM over the budget left in the base recipe.
fn keep_within_wider_budget(choices: &mut [GemmChoice], options: &PlanOptions, total: f64) {
    // No limit, or no FLOPs measured to share out (the budget is a share of them).
    if options.wider_budget >= 1.0 || total <= 0.0 {
        return;
    }
    let base = options.base.name();
    let base_width = recipe_width_class(base);
    let under_base = |c: &GemmChoice| {
        c.candidates
            .iter()
            .find(|(name, ..)| name == base)
            .map(|(.., db)| *db)
            .unwrap_or(f64::NEG_INFINITY)
    };
    let mut wider: Vec<usize> = (0..choices.len())
        .filter(|&i| recipe_width_class(&choices[i].chosen) > base_width)
        .collect();
    wider.sort_by(|&a, &b| under_base(&choices[a]).total_cmp(&under_base(&choices[b])));
    let mut used = 0.0;
    for index in wider {
        let flops = choices[index].flops;
        if (used + flops) / total <= options.wider_budget + 1e-12 {
            used += flops;
        } else {
            choices[index].chosen = base.to_string();
        }
    }
}

impl PlanAdvice {
    /// The fraction of the measured GEMM FLOPs each recipe got.
    pub fn fractions(&self) -> BTreeMap<String, f64> {
        let total: f64 = self.choices.iter().map(|c| c.flops).sum();
        let mut fractions = BTreeMap::new();
        for choice in &self.choices {
            *fractions.entry(choice.chosen.clone()).or_insert(0.0) += choice.flops / total.max(1.0);
        }
        fractions
    }

    /// The plan: one rule per layer and recipe other than the base's, for the GEMMs that got it.
    pub fn plan(&self) -> RecipePlan {
        let mut plan = RecipePlan::new();
        for (layer, recipe, gemms) in self.rules() {
            plan = plan.rule(
                PlanRule::new(
                    format!("{layer}:{recipe}"),
                    LayerSelection::regex(format!("^{}$", regex_escape(&layer))),
                    recipe,
                )
                .gemms(gemms),
            );
        }
        plan
    }

    /// The GEMMs that leave the base recipe, grouped by layer and recipe.
    fn rules(&self) -> Vec<(String, String, Vec<Gemm>)> {
        let mut rules: BTreeMap<(String, String), Vec<Gemm>> = BTreeMap::new();
        for choice in &self.choices {
            if choice.chosen != self.options.base.name() {
                rules
                    .entry((choice.layer.clone(), choice.chosen.clone()))
                    .or_default()
                    .push(choice.gemm);
            }
        }
        rules
            .into_iter()
            .map(|((layer, recipe), gemms)| (layer, recipe, gemms))
            .collect()
    }

    /// The plan as a recipe-plan file: the same rules as [`plan`](Self::plan), each with the numbers that chose it
    /// in a comment, and a header with the bound, the cost order and the FLOP shares.
    pub fn to_yaml(&self) -> String {
        let mut yaml = String::new();
        let bound = match self.options.bound {
            PlanBound::WithinDbOfBest(db) => format!("within {db} dB of the GEMM's best candidate"),
            PlanBound::AtLeastDb(db) => format!("at least {db} dB"),
        };
        let _ = writeln!(
            yaml,
            "# Written by burn-te's precision advisor from {} measured steps: per GEMM, the narrowest format whose\n\
             # effective SQNR is {bound}, the most accurate of that width (high precision within {:.1} % of the\n\
             # GEMM FLOPs where none is){}.",
            self.steps,
            self.options.budget * 100.0,
            if self.options.wider_budget < 1.0 {
                format!(
                    ";\n# at most {:.1} % of the FLOPs leave {}'s width, the GEMMs it serves worst first",
                    self.options.wider_budget * 100.0,
                    self.options.base.name()
                )
            } else {
                String::new()
            }
        );
        let bytes: Vec<String> = CANDIDATES
            .iter()
            .chain(&[HIGH_PRECISION])
            .map(|recipe| format!("{recipe} {}", recipe_cost(recipe)))
            .collect();
        let _ = writeln!(
            yaml,
            "# Widths: nvfp4 (4 bits) < fp8_current_scaling = fp8_block_scaling = mxfp8 (8 bits) < high_precision (bf16).\n\
             # Bytes per operand value, scales included: {}.\n\
             # effective SQNR = -10*log10(10^(-sqnr/10) * (1 + 4*underflows%/100) * (1 + max(0, kurtosis - 3)/10 at\n\
             #   fprop and wgrad) * max(1, amax growth)), each candidate measured on the same tensors.\n\
             # Runs over {}: RecipePlan::load_over(<this file>, <that recipe>); unlisted GEMMs keep it.",
            bytes.join(", "),
            self.options.base.name()
        );
        let shares: Vec<String> = self
            .fractions()
            .iter()
            .map(|(recipe, share)| format!("{recipe} {:.1} %", share * 100.0))
            .collect();
        let _ = writeln!(yaml, "# GEMM FLOPs: {}.", shares.join(", "));
        let _ = writeln!(yaml, "# Every GEMM (effective SQNR per candidate, dB):");
        for c in &self.choices {
            let measured: Vec<String> = c
                .candidates
                .iter()
                .map(|(name, _, db)| format!("{name} {db:.2}"))
                .collect();
            let _ = writeln!(
                yaml,
                "#   {:<36} {:<5} {}  -> {}",
                c.layer,
                c.gemm.name(),
                measured.join(", "),
                c.chosen
            );
        }
        let rules = self.rules();
        if rules.is_empty() {
            let _ = writeln!(yaml, "# Every GEMM keeps {}.", self.options.base.name());
            let _ = writeln!(yaml, "rules: []");
            return yaml;
        }
        let _ = writeln!(yaml, "rules:");
        for (layer, recipe, gemms) in rules {
            let names: Vec<&str> = gemms.iter().map(|g| g.name()).collect();
            let _ = writeln!(
                yaml,
                "  - name: {}",
                yaml_quoted(&format!("{layer}:{recipe}"))
            );
            let _ = writeln!(yaml, "    layers:");
            let _ = writeln!(
                yaml,
                "      layer_name_regex_pattern: {}",
                yaml_quoted(&format!("^{}$", regex_escape(&layer)))
            );
            let _ = writeln!(yaml, "    gemms: [{}]", names.join(", "));
            let _ = writeln!(yaml, "    recipe: {recipe}");
        }
        yaml
    }
}
