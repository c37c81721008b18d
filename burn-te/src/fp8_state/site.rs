//! GEMM sites: which layer, which of its three GEMMs, which tensor roles — what the debug tools route on.

use std::fmt;
use std::sync::Arc;

use crate::fp8_state::LayerFp8State;
pub use crate::gemm::{Gemm, TensorRole};
use crate::plan::LayerRecipes;
pub use crate::primitive::AmaxGroup;
use crate::recipe::Recipe;

/// Where a GEMM runs: the layer's name, its module type, which of its GEMMs, and the layer's FP8 state with the
/// iteration (generation) the GEMM belongs to. Everything that quantizes a GEMM's operands (the GEMM itself, the
/// debug tools' statistics and dumps) takes the delayed-scaling state from here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GemmSite {
    /// The layer's name (e.g. `decoder.1.fc1`).
    pub layer: Arc<str>,
    /// The module type in TE's snake case (`linear`, `layernorm_linear`); `None` for plain Burn linears.
    pub kind: Option<&'static str>,
    /// Which GEMM.
    pub gemm: Gemm,
    /// The layer's delayed-scaling state (`None`: the GEMM cannot run with delayed scaling).
    pub fp8: Option<LayerFp8State>,
    /// The autocast generation of the forward pass this GEMM belongs to (see [`crate::fp8_state`]).
    pub generation: u64,
    /// The stochastic-rounding draw of the iteration the GEMM belongs to, taken where the site is made (in the
    /// forward pass): NVFP4's random bits are a hash of it with the layer, GEMM and role (see
    /// [`seed_stochastic_rounding`](crate::seed_stochastic_rounding)).
    pub rounding: u64,
    /// For a wgrad: whether the layer's dgrad ran just before it on the same output gradient. The debug tools
    /// inspect a layer's incoming gradient once per backward, at the first backward GEMM that uses it: the dgrad,
    /// or the wgrad when the layer's input needs no gradient (so also a frozen layer's, which runs no wgrad).
    pub follows_dgrad: bool,
    /// The recipes a plan chose for the layer's three GEMMs (`None`: no plan, each GEMM runs the recipe it is
    /// given). The backward GEMMs take theirs from here.
    pub recipes: Option<Arc<LayerRecipes>>,
    /// The "weight" operand carries the input's leading (batch) dimensions: an attention GEMM (`q·kᵀ`, `p·v`), per
    /// batch `x [.., M, K] · w [.., K, N]`, whose wgrad keeps the batches instead of summing over them.
    pub batched: bool,
    /// For a batched site: its "weight" is a transposed view (an attention's `kᵀ`, see
    /// [`TeBackend::fp8_transposed_view`](crate::TeBackend::fp8_transposed_view)). Its wgrad then writes the
    /// gradient's transpose row-major and returns it transposed, so the gradient reaches the untransposed tensor
    /// without a copy.
    pub weight_transposed: bool,
    /// The operands this rank holds one shard of (a tensor-parallel layer's), whose current-scaling amax is
    /// reduced over the ranks holding the others, so every rank quantizes with the whole tensor's scale.
    pub sharded: Option<Sharding>,
}

/// Which operands of a layer's GEMMs this rank holds a shard of, and the group holding the others.
#[derive(Clone, Debug)]
pub struct Sharding {
    /// The sharded roles: the weight and gradient of a column-parallel layer, the activation and weight of a
    /// row-parallel one.
    pub roles: Vec<TensorRole>,
    /// The ranks holding the other shards.
    pub group: Arc<dyn AmaxGroup>,
}

impl PartialEq for Sharding {
    fn eq(&self, other: &Self) -> bool {
        self.roles == other.roles && Arc::ptr_eq(&self.group, &other.group)
    }
}

impl Eq for Sharding {}

impl GemmSite {
    /// The site of `gemm` in `layer`, without FP8 state (give one with [`with_state`](Self::with_state)).
    pub fn new(layer: impl Into<Arc<str>>, gemm: Gemm) -> Self {
        Self {
            layer: layer.into(),
            kind: None,
            gemm,
            fp8: None,
            generation: 0,
            rounding: crate::fp8_state::autocast::rounding_draw(),
            follows_dgrad: false,
            recipes: None,
            batched: false,
            weight_transposed: false,
            sharded: None,
        }
    }

    /// The same site, its weight a transposed view or not (see [`weight_transposed`](Self::weight_transposed)).
    pub fn with_weight_transposed(self, weight_transposed: bool) -> Self {
        Self {
            weight_transposed,
            ..self
        }
    }

    /// The same site, of a layer sharded as `sharded` says (`None`: not sharded).
    pub fn with_sharding(self, sharded: Option<Sharding>) -> Self {
        Self { sharded, ..self }
    }

    /// The group to reduce `role`'s amax over, where this rank holds a shard of it.
    pub fn amax_group(&self, role: TensorRole) -> Option<&dyn AmaxGroup> {
        self.sharded
            .as_ref()
            .filter(|s| s.roles.contains(&role))
            .map(|s| s.group.as_ref())
    }

    /// The same site, of a batched GEMM (see [`batched`](Self::batched)).
    pub fn batched(self) -> Self {
        Self {
            batched: true,
            ..self
        }
    }

    /// The same site, with the recipes a plan chose for the layer's GEMMs (`None`: no plan).
    pub fn with_recipes(self, recipes: Option<Arc<LayerRecipes>>) -> Self {
        Self { recipes, ..self }
    }

    /// The recipe `gemm` of this layer runs: the plan's choice where one chose, else `scope` (the recipe the
    /// layer's forward ran with).
    pub fn recipe_of<'a>(&'a self, gemm: Gemm, scope: Option<&'a Recipe>) -> Option<&'a Recipe> {
        match &self.recipes {
            Some(recipes) => recipes.recipe(gemm),
            None => scope,
        }
    }

    /// The same site with the layer's FP8 state, for a GEMM of the current autocast generation.
    pub fn with_state(self, fp8: &LayerFp8State) -> Self {
        self.with_state_at(fp8, crate::fp8_state::autocast::generation())
    }

    /// The same site with the layer's FP8 state, for a GEMM of `generation`.
    pub fn with_state_at(self, fp8: &LayerFp8State, generation: u64) -> Self {
        Self {
            fp8: Some(fp8.clone()),
            generation,
            ..self
        }
    }

    /// The same site, of a module of type `kind`.
    pub fn of_kind(self, kind: &'static str) -> Self {
        Self {
            kind: Some(kind),
            ..self
        }
    }

    /// The same layer's site of another GEMM.
    pub fn with_gemm(&self, gemm: Gemm) -> Self {
        Self {
            gemm,
            follows_dgrad: false,
            ..self.clone()
        }
    }

    /// The same site, marked as a wgrad that runs after the layer's dgrad on the same gradient (or not).
    pub fn following_dgrad(self, follows_dgrad: bool) -> Self {
        Self {
            follows_dgrad,
            ..self
        }
    }

    /// Whether the layer's incoming gradient is first used at this GEMM of its backward (see
    /// [`follows_dgrad`](Self::follows_dgrad)).
    pub fn first_use_of_gradient(&self) -> bool {
        match self.gemm {
            Gemm::Fprop => false,
            Gemm::Dgrad => true,
            Gemm::Wgrad => !self.follows_dgrad,
        }
    }
}

impl fmt::Display for GemmSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.layer, self.gemm.name())
    }
}

/// The experts of one grouped GEMM (TE's `GroupedLinear` with `m_splits`): expert `i` takes rows
/// [`rows(i)`](Self::rows) of the input, at its own site with its own recipe.
#[derive(Clone, Debug)]
pub struct ExpertGemms {
    /// Rows of the input per expert, in order (TE's `m_splits`).
    pub m_splits: Vec<usize>,
    /// Expert `i`'s site and the recipe its GEMM runs (`None`: high precision).
    pub experts: Vec<(GemmSite, Option<Recipe>)>,
}

impl ExpertGemms {
    /// Expert `i`'s rows of the input (and of the output).
    pub fn rows(&self, i: usize) -> std::ops::Range<usize> {
        let start: usize = self.m_splits[..i].iter().sum();
        start..start + self.m_splits[i]
    }

    /// The experts' sites of another GEMM, each with the recipe that GEMM runs (its plan's choice, else the
    /// forward's recipe); `follows_dgrad` as [`GemmSite::following_dgrad`].
    pub fn with_gemm(&self, gemm: Gemm, follows_dgrad: bool) -> Self {
        Self {
            m_splits: self.m_splits.clone(),
            experts: self
                .experts
                .iter()
                .map(|(site, recipe)| {
                    let recipe = site.recipe_of(gemm, recipe.as_ref()).cloned();
                    (site.with_gemm(gemm).following_dgrad(follows_dgrad), recipe)
                })
                .collect(),
        }
    }
}
