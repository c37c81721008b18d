//! Recipe plans: a recipe per layer and GEMM, as Transformer Engine mixes recipes with nested `fp8_autocast`
//! scopes and `CustomRecipe`, written down in a file.
//!
//! A [`RecipePlan`] is a list of rules. Each rule selects layers (TE's `layers` keys, as the debug configs select
//! them), optionally some of their GEMMs (`gemms: [fprop, dgrad, wgrad]`) or the GEMMs that take a tensor role
//! (`tensors: [activation, weight, gradient]`; both given: the GEMMs in both), and names a recipe:
//!
//! ```yaml
//! rules:
//!   - name: head_in_high_precision
//!     layers:
//!       exact_layer_names: [head]
//!     recipe: high_precision
//!   - name: first_block_gradients
//!     layers:
//!       layer_name_regex_pattern: '^blocks\.0\.'
//!     tensors: [gradient]
//!     recipe: mxfp8
//! ```
//!
//! - **Recipes** by TE's names: `high_precision`, `fp8_delayed_scaling`, `fp8_current_scaling`,
//!   `fp8_block_scaling`, `mxfp8`, `nvfp4`. A name of the scope's recipe kind takes the scope's settings (a plan
//!   over `nvfp4-plain` runs `nvfp4` without RHT), another TE's defaults; `options` sets them
//!   (`margin`, `fp8_format`, `amax_history_len`, `amax_compute_algo`, `disable_rht`,
//!   `disable_stochastic_rounding`, `disable_2d_quantization`, each for the recipes TE has it in).
//! - **Precedence**: where several rules select a GEMM, the last one wins; unselected GEMMs run the scope's recipe.
//! - **Applying**: `fp8_autocast(true, plan.over(recipe)?, || model.forward(x))` (see [`PlannedRecipe`]). The
//!   backward GEMMs run the recipes the plan gave their layer in the forward.
//! - **FP8 state**: a layer's delayed-scaling histories belong to the recipe it runs. They are recorded by the
//!   fprop (activation, weight) and the dgrad (gradient), so a delayed dgrad needs a delayed fprop and a delayed
//!   wgrad both (an error otherwise), and all of a layer's delayed GEMMs share one `DelayedScaling`. A role whose
//!   recording GEMM runs another FP8 recipe is reset, as TE creates a new recipe state when a module's recipe
//!   changes; a high-precision step leaves it as it is.
//! - **Files**: [`RecipePlan::load`] reads YAML or JSON (by the extension), [`RecipePlan::save`] writes either;
//!   plans are also Burn [`Config`](burn::config::Config)s. Errors name the file, the rule, the key and the line.

mod resolve;
pub mod selector;

use std::path::Path;

use burn_te_kernels::AmaxComputeAlgo;
use serde::{Deserialize, Serialize};

use crate::gemm::{Gemm, TensorRole};
use crate::recipe::{
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling,
    NVFP4BlockScaling, Recipe,
};

pub use crate::error::{PlanError, PlanLocation};
pub use resolve::{LayerRecipes, PlannedRecipe};
pub use selector::{LayerSelection, LayerSelector, SelectorError, layer_number};

/// The recipe names a plan takes.
pub const PLAN_RECIPES: &str = "high_precision, fp8_delayed_scaling, fp8_current_scaling, fp8_block_scaling, \
                                mxfp8, nvfp4";

/// The plan name of "no recipe": the GEMM runs in high precision.
pub const HIGH_PRECISION: &str = "high_precision";

/// A recipe per layer and GEMM: rules applied over an autocast scope's recipe (see the [module docs](self)).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecipePlan {
    /// The rules, in order: where several select a GEMM, the last wins.
    #[serde(default)]
    pub rules: Vec<PlanRule>,
}

/// One rule of a [`RecipePlan`]: which layers and GEMMs, which recipe.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanRule {
    /// The rule's name (unique in the plan): errors and the metrics report name it.
    pub name: String,
    /// The layers it selects.
    pub layers: LayerSelection,
    /// Only these GEMMs of the layers (default: all three).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemms: Option<Vec<Gemm>>,
    /// Only the GEMMs that take one of these tensors (default: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensors: Option<Vec<TensorRole>>,
    /// The recipe's name (see [`PLAN_RECIPES`]).
    pub recipe: String,
    /// Settings of the recipe, where not the scope's or TE's defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub options: Option<RecipeOptions>,
}

/// The settings a rule may give its recipe, by TE's names; each applies to the recipes TE has it in.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecipeOptions {
    /// `fp8_delayed_scaling`: the margin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub margin: Option<f32>,
    /// The FP8 recipes: `HYBRID` or `E4M3`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_format: Option<String>,
    /// `fp8_delayed_scaling`: the amax history's length.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amax_history_len: Option<usize>,
    /// `fp8_delayed_scaling`: `max` or `most_recent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amax_compute_algo: Option<String>,
    /// `fp8_delayed_scaling`, `fp8_current_scaling`: the attention's GEMMs in FP8 too (TE's `fp8_dpa`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_dpa: Option<bool>,
    /// `fp8_delayed_scaling`, `fp8_current_scaling`: TE's `fp8_mha` (runs as `fp8_dpa`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_mha: Option<bool>,
    /// `nvfp4`: no random Hadamard transform on the wgrad's operands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disable_rht: Option<bool>,
    /// `nvfp4`: round gradients to nearest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disable_stochastic_rounding: Option<bool>,
    /// `nvfp4`: 1×16 weight blocks instead of 16×16 tiles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disable_2d_quantization: Option<bool>,
}

impl burn::config::Config for RecipePlan {}

/// The text a plan was read from, to locate errors found after parsing.
#[derive(Clone, Debug, Default)]
pub(crate) struct PlanSource {
    file: Option<String>,
    text: Option<String>,
}

impl PlanSource {
    /// An error at `rule`'s `key` (both optional), located in the text where it can be.
    pub(crate) fn error(&self, rule: Option<&str>, key: Option<&str>, reason: String) -> PlanError {
        let line = self
            .text
            .as_deref()
            .and_then(|text| rule.and_then(|rule| find_rule_line(text, rule, key)));
        PlanError {
            location: PlanLocation {
                file: self.file.clone(),
                line,
                rule: rule.map(str::to_string),
                key: key.map(str::to_string),
            },
            reason,
        }
    }
}

/// The line of `rule`'s `name` entry (YAML `name: x` or JSON `"name": "x"`), or of `key` inside the rule when
/// found before the next rule.
fn find_rule_line(text: &str, rule: &str, key: Option<&str>) -> Option<usize> {
    let names_rule = |line: &str| {
        let line = line.trim_start().trim_start_matches("- ").trim_start();
        let rest = line
            .strip_prefix("name:")
            .or_else(|| line.strip_prefix("\"name\":"))?;
        let value = rest.trim().trim_end_matches(',').trim();
        Some(value.trim_matches(|c| c == '"' || c == '\'').to_string())
    };
    let lines: Vec<&str> = text.lines().collect();
    let start = lines
        .iter()
        .position(|line| names_rule(line).as_deref() == Some(rule))?;
    let Some(key) = key else {
        return Some(start + 1);
    };
    // The rule's block: up to the next `name:` line. Its `key:` line may come before `name:` in YAML, so look
    // back to the sequence item's dash as well.
    let first = (0..=start)
        .rev()
        .find(|&i| lines[i].trim_start().starts_with("- ") || lines[i].trim_start() == "{")
        .unwrap_or(start);
    let end = (start + 1..lines.len())
        .find(|&i| names_rule(lines[i]).is_some())
        .unwrap_or(lines.len());
    let is_key = |line: &str| {
        let line = line.trim_start().trim_start_matches("- ").trim_start();
        line.starts_with(&format!("{key}:")) || line.starts_with(&format!("\"{key}\":"))
    };
    (first..end)
        .find(|&i| is_key(lines[i]))
        .map(|i| i + 1)
        .or(Some(start + 1))
}

impl RecipePlan {
    /// An empty plan: every GEMM runs the scope's recipe.
    pub fn new() -> Self {
        Self::default()
    }

    /// The plan with `rule` appended (it wins over the rules before it).
    pub fn rule(mut self, rule: PlanRule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Reads a plan file: JSON for a `.json` file, YAML otherwise. Checks it as [`validate`](Self::validate) does.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, PlanError> {
        let path = path.as_ref();
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|err| PlanError {
            location: PlanLocation {
                file: Some(file.clone()),
                ..PlanLocation::default()
            },
            reason: format!("cannot read: {err}"),
        })?;
        let json = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"));
        Self::parse(&text, json, Some(file))
    }

    /// A plan from YAML text.
    pub fn from_yaml(text: &str) -> Result<Self, PlanError> {
        Self::parse(text, false, None)
    }

    /// A plan from JSON text.
    pub fn from_json(text: &str) -> Result<Self, PlanError> {
        Self::parse(text, true, None)
    }

    fn parse(text: &str, json: bool, file: Option<String>) -> Result<Self, PlanError> {
        let syntax = |line: Option<usize>, reason: String| PlanError {
            location: PlanLocation {
                file: file.clone(),
                line,
                ..PlanLocation::default()
            },
            reason,
        };
        let plan: RecipePlan = if json {
            serde_json::from_str(text).map_err(|err| syntax(Some(err.line()), err.to_string()))?
        } else {
            serde_yaml_ng::from_str(text)
                .map_err(|err| syntax(err.location().map(|l| l.line()), err.to_string()))?
        };
        let source = PlanSource {
            file,
            text: Some(text.to_string()),
        };
        plan.check(&source)?;
        Ok(plan)
    }

    /// Checks the plan without a model: unique rule names, selectors that compile, known recipes, options that
    /// apply to their recipe, and rules that select at least one GEMM.
    pub fn validate(&self) -> Result<(), PlanError> {
        self.check(&PlanSource::default())
    }

    fn check(&self, source: &PlanSource) -> Result<(), PlanError> {
        let mut names = std::collections::BTreeSet::new();
        for rule in &self.rules {
            if !names.insert(rule.name.as_str()) {
                return Err(source.error(
                    Some(&rule.name),
                    Some("name"),
                    "two rules have this name (names must be unique)".into(),
                ));
            }
            rule.compile(&Recipe::default(), source)?;
        }
        Ok(())
    }

    /// This plan over `base`, the recipe of the GEMMs no rule selects: what [`fp8_autocast`](crate::fp8_autocast)
    /// takes. Fails as [`validate`](Self::validate) does.
    pub fn over(&self, base: impl Into<Recipe>) -> Result<PlannedRecipe, PlanError> {
        PlannedRecipe::new(self.clone(), base.into(), PlanSource::default())
    }

    /// [`over`](Self::over) for a plan read from `path` (errors found while it runs name the file and line).
    pub fn load_over(
        path: impl AsRef<Path>,
        base: impl Into<Recipe>,
    ) -> Result<PlannedRecipe, PlanError> {
        let path = path.as_ref();
        let plan = Self::load(path)?;
        let source = PlanSource {
            file: Some(path.display().to_string()),
            text: std::fs::read_to_string(path).ok(),
        };
        PlannedRecipe::new(plan, base.into(), source)
    }

    /// The plan as YAML.
    pub fn to_yaml(&self) -> String {
        serde_yaml_ng::to_string(self).unwrap_or_else(|err| format!("# not serializable: {err}\n"))
    }

    /// Writes the plan: JSON for a `.json` file, YAML otherwise.
    pub fn save(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        let path = path.as_ref();
        let json = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"));
        let text = if json {
            serde_json::to_string_pretty(self).map_err(std::io::Error::other)?
        } else {
            self.to_yaml()
        };
        std::fs::write(path, text)
    }
}

impl PlanRule {
    /// A rule giving `recipe` (a name of [`PLAN_RECIPES`]) to all GEMMs of `layers`.
    pub fn new(name: impl Into<String>, layers: LayerSelection, recipe: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            layers,
            gemms: None,
            tensors: None,
            recipe: recipe.into(),
            options: None,
        }
    }

    /// Only these GEMMs.
    pub fn gemms(mut self, gemms: impl IntoIterator<Item = Gemm>) -> Self {
        self.gemms = Some(gemms.into_iter().collect());
        self
    }

    /// Only the GEMMs that take these tensors.
    pub fn tensors(mut self, tensors: impl IntoIterator<Item = TensorRole>) -> Self {
        self.tensors = Some(tensors.into_iter().collect());
        self
    }

    /// With these recipe settings.
    pub fn options(mut self, options: RecipeOptions) -> Self {
        self.options = Some(options);
        self
    }

    /// Which of the three GEMMs (in [`Gemm::ALL`] order) the rule selects.
    fn selected_gemms(&self) -> [bool; 3] {
        Gemm::ALL.map(|gemm| {
            self.gemms.as_ref().is_none_or(|g| g.contains(&gemm))
                && self
                    .tensors
                    .as_ref()
                    .is_none_or(|t| t.iter().any(|&role| gemm.takes(role)))
        })
    }

    /// The rule's selector, GEMMs and recipe over the scope's recipe `base`.
    fn compile(&self, base: &Recipe, source: &PlanSource) -> Result<resolve::Rule, PlanError> {
        let error = |key: &str, reason: String| source.error(Some(&self.name), Some(key), reason);
        let selector = LayerSelector::new(&self.layers)
            .map_err(|err| error(err.key().unwrap_or("layers"), err.to_string()))?;
        let gemms = self.selected_gemms();
        if !gemms.contains(&true) {
            return Err(error(
                if self.tensors.is_some() {
                    "tensors"
                } else {
                    "gemms"
                },
                "selects no GEMM (a rule with both `gemms` and `tensors` takes the GEMMs in both)"
                    .into(),
            ));
        }
        let recipe = recipe_named(&self.recipe, self.options.as_ref(), base)
            .map_err(|(key, reason)| error(key, reason))?;
        Ok(resolve::Rule {
            name: self.name.clone(),
            selector,
            gemms,
            recipe,
        })
    }
}

/// The recipe a plan names (`None`: `high_precision`) with `options`, over the scope's recipe `base`: a name of
/// `base`'s kind takes `base`'s settings, another TE's defaults. Fails with the key to blame (`recipe` or
/// `options`) and why.
pub fn recipe_named(
    name: &str,
    options: Option<&RecipeOptions>,
    base: &Recipe,
) -> Result<Option<Recipe>, (&'static str, String)> {
    let options = options.cloned().unwrap_or_default();
    let kind_default = |wanted: &str| -> Option<Recipe> {
        Some(match wanted {
            "fp8_delayed_scaling" => DelayedScaling::default().into(),
            "fp8_current_scaling" => Float8CurrentScaling::default().into(),
            "fp8_block_scaling" => Float8BlockScaling::default().into(),
            "mxfp8" => MXFP8BlockScaling::default().into(),
            "nvfp4" => NVFP4BlockScaling::from_env().into(),
            _ => return None,
        })
    };
    if name == HIGH_PRECISION {
        return match options == RecipeOptions::default() {
            true => Ok(None),
            false => Err(("options", "high_precision takes no options".into())),
        };
    }
    let mut recipe = if base.name() == name {
        base.clone()
    } else {
        kind_default(name).ok_or_else(|| {
            (
                "recipe",
                format!("unknown recipe \"{name}\" (expected one of {PLAN_RECIPES})"),
            )
        })?
    };
    let not_for = |key: &'static str, applies: &str| {
        Err((
            "options",
            format!("{key} applies to {applies}, not to {name}"),
        ))
    };
    if let Some(text) = &options.fp8_format {
        let format = match text.to_ascii_uppercase().as_str() {
            "HYBRID" => Format::Hybrid,
            "E4M3" => Format::E4M3,
            "E5M2" => Format::E5M2,
            _ => {
                return Err((
                    "options",
                    format!("fp8_format \"{text}\" is not HYBRID, E4M3 or E5M2"),
                ));
            }
        };
        match &mut recipe {
            Recipe::Delayed(r) => r.fp8_format = format,
            Recipe::Current(r) => r.fp8_format = format,
            Recipe::Block(r) => r.fp8_format = format,
            Recipe::Mxfp8(r) => r.fp8_format = format,
            Recipe::Nvfp4(_) => return not_for("fp8_format", "the FP8 recipes"),
        }
    }
    let delayed_keys = [
        ("margin", options.margin.is_some()),
        ("amax_history_len", options.amax_history_len.is_some()),
        ("amax_compute_algo", options.amax_compute_algo.is_some()),
    ];
    match &mut recipe {
        Recipe::Delayed(r) => {
            if let Some(margin) = options.margin {
                r.margin = margin;
            }
            if let Some(len) = options.amax_history_len {
                r.amax_history_len = len;
            }
            if let Some(algo) = &options.amax_compute_algo {
                r.amax_compute_algo = match algo.as_str() {
                    "max" => AmaxComputeAlgo::Max,
                    "most_recent" => AmaxComputeAlgo::MostRecent,
                    _ => {
                        return Err((
                            "options",
                            format!("amax_compute_algo \"{algo}\" is not max or most_recent"),
                        ));
                    }
                };
            }
        }
        _ => {
            if let Some((key, _)) = delayed_keys.iter().find(|(_, set)| *set) {
                return not_for(key, "fp8_delayed_scaling");
            }
        }
    }
    let attention = (options.fp8_dpa, options.fp8_mha);
    match &mut recipe {
        Recipe::Delayed(r) => {
            r.fp8_dpa = attention.0.unwrap_or(r.fp8_dpa);
            r.fp8_mha = attention.1.unwrap_or(r.fp8_mha);
        }
        Recipe::Current(r) => {
            r.fp8_dpa = attention.0.unwrap_or(r.fp8_dpa);
            r.fp8_mha = attention.1.unwrap_or(r.fp8_mha);
        }
        _ => {
            let per_tensor = "fp8_delayed_scaling and fp8_current_scaling";
            if attention.0.is_some() {
                return not_for("fp8_dpa", per_tensor);
            }
            if attention.1.is_some() {
                return not_for("fp8_mha", per_tensor);
            }
        }
    }
    let nvfp4_keys = [
        ("disable_rht", options.disable_rht),
        (
            "disable_stochastic_rounding",
            options.disable_stochastic_rounding,
        ),
        ("disable_2d_quantization", options.disable_2d_quantization),
    ];
    match &mut recipe {
        Recipe::Nvfp4(r) => {
            r.disable_rht = options.disable_rht.unwrap_or(r.disable_rht);
            r.disable_stochastic_rounding = options
                .disable_stochastic_rounding
                .unwrap_or(r.disable_stochastic_rounding);
            r.disable_2d_quantization = options
                .disable_2d_quantization
                .unwrap_or(r.disable_2d_quantization);
        }
        _ => {
            if let Some((key, _)) = nvfp4_keys.iter().find(|(_, set)| set.is_some()) {
                return not_for(key, "nvfp4");
            }
        }
    }
    recipe
        .validate()
        .map_err(|err| ("options", err.to_string()))?;
    Ok(Some(recipe))
}
