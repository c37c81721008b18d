//! FP8 autocast: the scope inside which GEMMs run in FP8 with a recipe.
//!
//! # Threading rule
//! The scope is per thread: it covers the ops issued on the thread that entered it, and ends when the closure
//! returns or the guard drops. Threads spawned inside do not inherit it. Burn runs the backward pass on the thread
//! that calls `backward()`, so the rule for the backward GEMMs is below.
//!
//! # Backward GEMMs
//! - `te_linear` (the TE modules) records the recipe and the layer's FP8 state in the autograd graph: its dgrad
//!   and wgrad run with the forward's recipe, state and generation wherever `backward()` is called, as in TE.
//! - A plain Burn `Linear` on `Te<B>` cannot carry state through Burn's autograd: it is named by its weight and its
//!   backward GEMMs find their forward by buffer identity (see the `plain_linear` module); its state lives in the
//!   scope's [`Fp8LinearStates`](crate::Fp8LinearStates) (the one given to [`fp8_autocast_with`], else the
//!   thread's default).
//!
//! # Recipe plans
//! A scope takes a recipe, or a [`RecipePlan`](crate::plan::RecipePlan) over one ([`PlannedRecipe`]): then each
//! layer's GEMMs run the recipes the plan gives them (see [`crate::plan`]). The innermost scope wins as a whole: a
//! nested scope with a plain recipe runs that recipe everywhere inside it.
//!
//! # Generations
//! Each outermost scope is a new *generation* (an iteration, in TE's terms): delayed-scaling states roll their
//! amax history once per generation (see [`crate::fp8_state`]). NVFP4's stochastic rounding follows its own
//! count of iterations, which a seed restarts (see [`rounding`]).

mod rounding;
pub(crate) use rounding::rounding_draw;
pub use rounding::seed_stochastic_rounding;

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use std::sync::Arc;

use crate::error::TeError;
use crate::fp8_state::{LayerFp8State, PlainLinearStates};
use crate::plan::{LayerRecipes, PlannedRecipe};
use crate::recipe::{
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling,
    Recipe,
};

/// The last generation handed out (process-wide, so generations only grow).
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// What an autocast scope runs: one recipe, or a plan over one.
#[derive(Clone, Debug)]
pub enum ScopeRecipe {
    /// Every GEMM runs this recipe.
    Recipe(Recipe),
    /// Each layer's GEMMs run the plan's choice (see [`crate::plan`]).
    Planned(PlannedRecipe),
}

impl ScopeRecipe {
    /// The recipe of the GEMMs no plan rule selects.
    pub fn base(&self) -> &Recipe {
        match self {
            ScopeRecipe::Recipe(recipe) => recipe,
            ScopeRecipe::Planned(planned) => planned.base(),
        }
    }
}

impl From<PlannedRecipe> for ScopeRecipe {
    fn from(planned: PlannedRecipe) -> Self {
        ScopeRecipe::Planned(planned)
    }
}

macro_rules! scope_recipe_from {
    ($($ty:ty),*) => {$(
        impl From<$ty> for ScopeRecipe {
            fn from(recipe: $ty) -> Self {
                ScopeRecipe::Recipe(recipe.into())
            }
        }
    )*};
}
scope_recipe_from!(
    Recipe,
    DelayedScaling,
    Float8CurrentScaling,
    Float8BlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling
);

#[derive(Debug)]
struct Frame {
    id: u64,
    recipe: Option<ScopeRecipe>,
    linears: PlainLinearStates,
}

#[derive(Debug, Default)]
struct State {
    frames: Vec<Frame>,
    next_frame: u64,
    /// The generation of the latest outermost scope on this thread.
    generation: u64,
    /// The thread's plain-linear states for scopes given none.
    default_linears: PlainLinearStates,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

/// Ends an autocast scope when dropped (its own scope, even when guards drop out of order). Not `Send`: a scope
/// belongs to its thread.
#[derive(Debug)]
pub struct AutocastGuard {
    frame: u64,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl AutocastGuard {
    /// Ends the scope. With a plan, the first scope in which layers ran under it fails if a rule selected none of
    /// them (see [`PlannedRecipe::check_matched`]); dropping the guard ends it without that check.
    pub fn finish(self) -> Result<(), TeError> {
        let planned = STATE.with(|s| {
            s.borrow()
                .frames
                .iter()
                .find(|f| f.id == self.frame)
                .and_then(|f| match &f.recipe {
                    Some(ScopeRecipe::Planned(planned)) => Some(planned.clone()),
                    _ => None,
                })
        });
        drop(self);
        match planned {
            Some(planned) => Ok(planned.check_matched_once()?),
            None => Ok(()),
        }
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        STATE.with(|s| {
            let mut s = s.borrow_mut();
            if let Some(at) = s.frames.iter().rposition(|f| f.id == self.frame) {
                s.frames.remove(at);
            }
        });
    }
}

/// Pushes a scope's frame; the outermost one starts a new generation (an iteration) where `iteration`.
fn push_frame(
    recipe: Option<ScopeRecipe>,
    linears: Option<&PlainLinearStates>,
    iteration: bool,
) -> AutocastGuard {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if s.frames.is_empty() && iteration {
            s.generation = GENERATION.fetch_add(1, Ordering::Relaxed) + 1;
            rounding::next_iteration();
        }
        let linears = match (linears, s.frames.last()) {
            (Some(given), _) => given.clone(),
            (None, Some(outer)) => outer.linears.clone(),
            (None, None) => s.default_linears.clone(),
        };
        let id = s.next_frame;
        s.next_frame += 1;
        s.frames.push(Frame {
            id,
            recipe,
            linears,
        });
        AutocastGuard {
            frame: id,
            _not_send: std::marker::PhantomData,
        }
    })
}

/// Enters an autocast scope until the guard drops: with `enabled`, GEMMs run in FP8 with `recipe`; with
/// `!enabled`, they run in high precision (also inside an enabled outer scope). Scopes nest; the innermost wins.
/// Fails on a recipe TE rejects (e.g. pure E5M2).
pub fn fp8_autocast_guard(
    enabled: bool,
    recipe: impl Into<ScopeRecipe>,
) -> Result<AutocastGuard, TeError> {
    enter(None, enabled, recipe.into())
}

/// [`fp8_autocast_guard`] whose plain Burn linears keep their delayed-scaling states in `linears`: one per model,
/// usually `&model.fp8` of a field `fp8: Fp8LinearStates<B>` (saved with the model's record).
pub fn fp8_autocast_guard_with(
    linears: &PlainLinearStates,
    enabled: bool,
    recipe: impl Into<ScopeRecipe>,
) -> Result<AutocastGuard, TeError> {
    enter(Some(linears), enabled, recipe.into())
}

/// Validates the recipe (also of a disabled scope) and enters the scope.
fn enter(
    linears: Option<&PlainLinearStates>,
    enabled: bool,
    recipe: ScopeRecipe,
) -> Result<AutocastGuard, TeError> {
    recipe.base().validate()?;
    Ok(push_frame(enabled.then_some(recipe), linears, true))
}

/// A high-precision scope until the guard drops (the attention core of the TE modules runs in one). Not an
/// iteration: outside any scope (an evaluation pass, say) it starts no generation and draws no stochastic-rounding
/// bits, so the training iterations around it quantize as they would without it.
pub(crate) fn high_precision_guard() -> AutocastGuard {
    push_frame(None, None, false)
}

/// Runs `f` inside an autocast scope (see [`fp8_autocast_guard`]) and returns its result. With a plan, the first
/// scope in which layers ran under it fails if a rule selected none of them (see
/// [`PlannedRecipe::check_matched`]).
pub fn fp8_autocast<T>(
    enabled: bool,
    recipe: impl Into<ScopeRecipe>,
    f: impl FnOnce() -> T,
) -> Result<T, TeError> {
    let guard = fp8_autocast_guard(enabled, recipe)?;
    let out = f();
    guard.finish()?;
    Ok(out)
}

/// [`fp8_autocast`] whose plain Burn linears keep their delayed-scaling states in `linears` (see
/// [`fp8_autocast_guard_with`]).
pub fn fp8_autocast_with<T>(
    linears: &PlainLinearStates,
    enabled: bool,
    recipe: impl Into<ScopeRecipe>,
    f: impl FnOnce() -> T,
) -> Result<T, TeError> {
    let guard = fp8_autocast_guard_with(linears, enabled, recipe)?;
    let out = f();
    guard.finish()?;
    Ok(out)
}

/// The generation of the current (or, outside any scope, the latest) outermost scope of this thread.
pub fn generation() -> u64 {
    STATE.with(|s| s.borrow().generation)
}

/// The recipe of the innermost scope of this thread, if it enables FP8 (with a plan: the recipe of the GEMMs no
/// rule selects).
pub fn active_recipe() -> Option<Recipe> {
    active_scope_recipe().map(|scope| scope.base().clone())
}

/// The plan of the innermost scope of this thread, if it enables FP8 with one.
pub fn active_plan() -> Option<PlannedRecipe> {
    match active_scope_recipe()? {
        ScopeRecipe::Planned(planned) => Some(planned),
        ScopeRecipe::Recipe(_) => None,
    }
}

/// The recipes of `layer`'s GEMMs in `scope`: the fprop's (`None`: high precision), and all three where a plan
/// chose them. In an FP8 scope, the layer's delayed `state` follows them (see
/// [`LayerFp8State::follow_recipes`]). Fails where the plan cannot run the layer.
pub(crate) fn layer_recipes(
    scope: Option<&ScopeRecipe>,
    layer: &str,
    kind: Option<&str>,
    state: &LayerFp8State,
) -> Result<(Option<Recipe>, Option<Arc<LayerRecipes>>), TeError> {
    let (recipe, planned) = match scope {
        None => return Ok((None, None)),
        Some(ScopeRecipe::Recipe(recipe)) => (Some(recipe.clone()), None),
        Some(ScopeRecipe::Planned(planned)) => {
            let recipes = planned.layer(layer, kind)?;
            (
                recipes.recipe(crate::gemm::Gemm::Fprop).cloned(),
                Some(recipes),
            )
        }
    };
    state.follow_recipes(match &planned {
        Some(recipes) => recipes.all(),
        None => [recipe.as_ref(); 3],
    });
    Ok((recipe, planned))
}

/// The innermost scope's recipe or plan, if it enables FP8.
pub(crate) fn active_scope_recipe() -> Option<ScopeRecipe> {
    STATE.with(|s| s.borrow().frames.last().and_then(|f| f.recipe.clone()))
}

/// Whether this thread is inside an FP8-enabled scope.
pub fn is_fp8_enabled() -> bool {
    STATE.with(|s| s.borrow().frames.last().is_some_and(|f| f.recipe.is_some()))
}

/// The innermost scope of this thread, for plain linears: its recipe (if FP8), its plain-linear states and the
/// generation. `None` outside any scope.
pub(crate) fn current_scope() -> Option<(Option<ScopeRecipe>, PlainLinearStates, u64)> {
    STATE.with(|s| {
        let s = s.borrow();
        s.frames
            .last()
            .map(|f| (f.recipe.clone(), f.linears.clone(), s.generation))
    })
}
