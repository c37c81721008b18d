//! A plan over a scope's recipe: each layer's recipe per GEMM, chosen once per layer and checked against the
//! rules of FP8 state.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use super::{PlanError, PlanSource, RecipePlan, selector::LayerSelector};
use crate::gemm::Gemm;
use crate::recipe::Recipe;

/// A compiled rule: its selector, the GEMMs it selects (in [`Gemm::ALL`] order) and its recipe.
#[derive(Clone, Debug)]
pub(super) struct Rule {
    pub(super) name: String,
    pub(super) selector: LayerSelector,
    pub(super) gemms: [bool; 3],
    pub(super) recipe: Option<Recipe>,
}

/// The recipes of one layer's three GEMMs under a plan (`None`: high precision), and the rules that chose them.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerRecipes {
    recipes: [Option<Recipe>; 3],
    rules: [Option<Arc<str>>; 3],
}

/// Recipes are compared by value; a valid recipe has no NaN setting.
impl Eq for LayerRecipes {}

impl LayerRecipes {
    /// The recipe `gemm` runs (`None`: high precision).
    pub fn recipe(&self, gemm: Gemm) -> Option<&Recipe> {
        self.recipes[gemm.index()].as_ref()
    }

    /// The rule that chose `gemm`'s recipe (`None`: no rule, the scope's recipe).
    pub fn rule(&self, gemm: Gemm) -> Option<&str> {
        self.rules[gemm.index()].as_deref()
    }

    /// The three recipes, in [`Gemm::ALL`] order.
    pub fn all(&self) -> [Option<&Recipe>; 3] {
        Gemm::ALL.map(|gemm| self.recipe(gemm))
    }
}

/// What a plan has seen in use: each layer's recipes, the layers seen and the rules that selected one.
#[derive(Debug, Default)]
struct Usage {
    layers: HashMap<(String, Option<String>), Result<Arc<LayerRecipes>, PlanError>>,
    matched: Vec<bool>,
    checked: bool,
}

#[derive(Debug)]
struct Planned {
    plan: RecipePlan,
    base: Recipe,
    rules: Vec<Rule>,
    source: PlanSource,
    usage: Mutex<Usage>,
}

/// A [`RecipePlan`] over the recipe of the GEMMs no rule selects: what an autocast scope takes
/// (`fp8_autocast(true, plan.over(recipe)?, ..)`). Clones share what the plan has seen (the layers it chose for,
/// the rules that matched).
#[derive(Clone, Debug)]
pub struct PlannedRecipe {
    inner: Arc<Planned>,
}

impl PlannedRecipe {
    pub(super) fn new(
        plan: RecipePlan,
        base: Recipe,
        source: PlanSource,
    ) -> Result<Self, PlanError> {
        base.validate()
            .map_err(|err| source.error(None, None, format!("the scope's recipe: {err}")))?;
        plan.check(&source)?;
        let rules = plan
            .rules
            .iter()
            .map(|rule| rule.compile(&base, &source))
            .collect::<Result<Vec<_>, _>>()?;
        let usage = Usage {
            matched: vec![false; rules.len()],
            ..Usage::default()
        };
        Ok(Self {
            inner: Arc::new(Planned {
                plan,
                base,
                rules,
                source,
                usage: Mutex::new(usage),
            }),
        })
    }

    /// The recipe of the GEMMs no rule selects.
    pub fn base(&self) -> &Recipe {
        &self.inner.base
    }

    /// The plan.
    pub fn plan(&self) -> &RecipePlan {
        &self.inner.plan
    }

    fn usage(&self) -> std::sync::MutexGuard<'_, Usage> {
        self.inner
            .usage
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The recipes of `layer`'s GEMMs (`kind`: its module type, as `layer_types` match it), or why the plan cannot
    /// run them: a layer whose delayed-scaling GEMMs do not share one `DelayedScaling`, or whose delayed dgrad or
    /// wgrad would quantize with a history its fprop does not record.
    pub fn layer(&self, layer: &str, kind: Option<&str>) -> Result<Arc<LayerRecipes>, PlanError> {
        let key = (layer.to_string(), kind.map(str::to_string));
        let mut usage = self.usage();
        if let Some(known) = usage.layers.get(&key) {
            return known.clone();
        }
        let mut recipes: [Option<Recipe>; 3] = Gemm::ALL.map(|_| Some(self.inner.base.clone()));
        let mut rules: [Option<Arc<str>>; 3] = Default::default();
        for (index, rule) in self.inner.rules.iter().enumerate() {
            if !rule.selector.matches(layer, kind) {
                continue;
            }
            usage.matched[index] = true;
            for gemm in Gemm::ALL {
                if rule.gemms[gemm.index()] {
                    recipes[gemm.index()] = rule.recipe.clone();
                    rules[gemm.index()] = Some(rule.name.as_str().into());
                }
            }
        }
        let chosen = LayerRecipes { recipes, rules };
        let result = self
            .check_state_rules(layer, &chosen)
            .map(|()| Arc::new(chosen));
        usage.layers.insert(key, result.clone());
        result
    }

    /// The FP8-state rules of the module docs, for one layer's choice.
    fn check_state_rules(&self, layer: &str, chosen: &LayerRecipes) -> Result<(), PlanError> {
        let delayed = |gemm: Gemm| match chosen.recipe(gemm) {
            Some(Recipe::Delayed(r)) => Some(r),
            _ => None,
        };
        let runs = |gemm: Gemm| {
            let recipe = chosen.recipe(gemm).map_or("high_precision", Recipe::name);
            match chosen.rule(gemm) {
                Some(rule) => format!("{} runs {recipe} (rule \"{rule}\")", gemm.name()),
                None => format!("{} runs {recipe} (the scope's recipe)", gemm.name()),
            }
        };
        // The rule to blame: the GEMM's own, else the fprop's (which moved it off the scope's recipe).
        let error = |gemm: Gemm, reason: String| {
            self.inner.source.error(
                chosen.rule(gemm).or_else(|| chosen.rule(Gemm::Fprop)),
                Some("recipe"),
                format!("layer \"{layer}\": {reason}"),
            )
        };
        for gemm in [Gemm::Dgrad, Gemm::Wgrad] {
            if delayed(gemm).is_some() && delayed(Gemm::Fprop).is_none() {
                let role = if gemm == Gemm::Dgrad {
                    "weight"
                } else {
                    "activation"
                };
                return Err(error(
                    gemm,
                    format!(
                        "{} but {}: the {role}'s amax history is recorded by the fprop, so a delayed {} needs a \
                         delayed fprop",
                        runs(gemm),
                        runs(Gemm::Fprop),
                        gemm.name()
                    ),
                ));
            }
        }
        let first = Gemm::ALL
            .into_iter()
            .find_map(|g| delayed(g).map(|r| (g, r)));
        if let Some((first_gemm, first)) = first {
            for gemm in Gemm::ALL {
                if delayed(gemm).is_some_and(|r| r != first) {
                    return Err(error(
                        gemm,
                        format!(
                            "{} with other settings than the {} ({}): a layer's delayed-scaling GEMMs share its amax \
                             histories, so they take one DelayedScaling",
                            runs(gemm),
                            first_gemm.name(),
                            runs(first_gemm)
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The rules that have selected no layer so far.
    pub fn unmatched(&self) -> Vec<String> {
        let usage = self.usage();
        self.inner
            .rules
            .iter()
            .zip(&usage.matched)
            .filter(|(_, matched)| !**matched)
            .map(|(rule, _)| rule.name.clone())
            .collect()
    }

    /// An error naming the first rule that selected no layer, with the layers the plan has seen; `Ok` when every
    /// rule selected one, or when no layer ran under the plan yet.
    pub fn check_matched(&self) -> Result<(), PlanError> {
        let (seen, unmatched) = {
            let usage = self.usage();
            let seen: BTreeSet<&str> = usage
                .layers
                .keys()
                .map(|(layer, _)| layer.as_str())
                .collect();
            let seen: Vec<String> = seen.into_iter().map(str::to_string).collect();
            (seen, usage.matched.iter().position(|m| !m))
        };
        match unmatched {
            Some(index) if !seen.is_empty() => {
                let rule = &self.inner.rules[index].name;
                let mut listed = seen.iter().take(12).cloned().collect::<Vec<_>>().join(", ");
                if seen.len() > 12 {
                    listed.push_str(&format!(", … ({} layers)", seen.len()));
                }
                Err(self.inner.source.error(
                    Some(rule),
                    Some("layers"),
                    format!("selects no layer of the model (its layers: {listed})"),
                ))
            }
            _ => Ok(()),
        }
    }

    /// [`check_matched`](Self::check_matched) the first time a layer has run under the plan (later calls: `Ok`).
    pub(crate) fn check_matched_once(&self) -> Result<(), PlanError> {
        {
            let mut usage = self.usage();
            if usage.checked || usage.layers.is_empty() {
                return Ok(());
            }
            usage.checked = true;
        }
        self.check_matched()
    }
}
