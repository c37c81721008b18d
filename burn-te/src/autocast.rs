//! FP8 autocast: the scope inside which GEMMs run in FP8 with a recipe.
//!
//! # Threading rule
//! The scope is per thread: it covers the ops issued on the thread that entered it, and ends when the closure
//! returns or the guard drops. Threads spawned inside do not inherit it. Burn runs the backward pass on the thread
//! that calls `backward()`, so the rule for the backward GEMMs is below.
//!
//! # Backward GEMMs
//! - `te_linear` (the TE modules) records the recipe in the autograd graph: its dgrad and wgrad run with the
//!   forward's recipe wherever `backward()` is called, as in TE.
//! - A plain Burn `Linear` on `Te<B>` cannot carry state through Burn's autograd, so its dgrad and wgrad follow the
//!   most recent plain linear forward of the thread: FP8 with that forward's recipe if it ran inside a scope, high
//!   precision otherwise. Their delayed-scaling histories are keyed by the layers' order (see [`crate::te`]).

use std::cell::RefCell;

use crate::TeError;
use crate::recipe::Recipe;

#[derive(Debug)]
struct Frame {
    recipe: Option<Recipe>,
}

#[derive(Debug, Default)]
struct State {
    frames: Vec<Frame>,
    /// Plain linears run in FP8 since the outermost scope was entered (names `linear0`, `linear1`, ...).
    forward_linears: usize,
    /// Recipe of the latest plain linear forward (None: it ran in high precision).
    backward_recipe: Option<Recipe>,
    /// Plain linear backward GEMM pairs seen since the latest forward.
    backward_linears: usize,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

/// Ends an autocast scope when dropped. Not `Send`: a scope belongs to its thread.
#[derive(Debug)]
pub struct AutocastGuard {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        STATE.with(|s| {
            s.borrow_mut().frames.pop();
        });
    }
}

/// Enters an autocast scope until the guard drops: with `enabled`, GEMMs run in FP8 with `recipe`; with
/// `!enabled`, they run in high precision (also inside an enabled outer scope). Scopes nest; the innermost wins.
/// Fails on a recipe TE rejects (e.g. pure E5M2).
pub fn fp8_autocast_guard(
    enabled: bool,
    recipe: impl Into<Recipe>,
) -> Result<AutocastGuard, TeError> {
    let recipe = recipe.into();
    recipe.validate()?;
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if s.frames.is_empty() {
            s.forward_linears = 0;
        }
        s.frames.push(Frame {
            recipe: enabled.then_some(recipe),
        });
    });
    Ok(AutocastGuard {
        _not_send: std::marker::PhantomData,
    })
}

/// A high-precision scope until the guard drops (the attention core of the TE modules runs in one).
pub(crate) fn high_precision_guard() -> AutocastGuard {
    STATE.with(|s| s.borrow_mut().frames.push(Frame { recipe: None }));
    AutocastGuard {
        _not_send: std::marker::PhantomData,
    }
}

/// Runs `f` inside an autocast scope (see [`fp8_autocast_guard`]) and returns its result.
pub fn fp8_autocast<T>(
    enabled: bool,
    recipe: impl Into<Recipe>,
    f: impl FnOnce() -> T,
) -> Result<T, TeError> {
    let _guard = fp8_autocast_guard(enabled, recipe)?;
    Ok(f())
}

/// The recipe of the innermost scope of this thread, if it enables FP8.
pub fn active_recipe() -> Option<Recipe> {
    STATE.with(|s| s.borrow().frames.last().and_then(|f| f.recipe.clone()))
}

/// Whether this thread is inside an FP8-enabled scope.
pub fn is_fp8_enabled() -> bool {
    STATE.with(|s| s.borrow().frames.last().is_some_and(|f| f.recipe.is_some()))
}

/// Bookkeeping of a plain Burn linear's forward, for backend decorators: its recipe (if FP8) and its name by order
/// in the scope (`linear0`, `linear1`, ...).
pub fn plain_linear_forward() -> (Option<Recipe>, String) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let recipe = s.frames.last().and_then(|f| f.recipe.clone());
        let index = s.forward_linears;
        if recipe.is_some() {
            s.forward_linears += 1;
        }
        s.backward_recipe = recipe.clone();
        s.backward_linears = 0;
        (recipe, format!("linear{index}"))
    })
}

/// Bookkeeping of a plain linear backward GEMM: the recipe of the latest forward and the layer's name, counting
/// layers backwards (`wgrad` closes a layer; a `dgrad` belongs to the layer whose `wgrad` follows).
pub fn plain_linear_backward(closes_layer: bool) -> (Option<Recipe>, String) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let index = s.forward_linears.saturating_sub(1 + s.backward_linears);
        if closes_layer {
            s.backward_linears += 1;
        }
        (s.backward_recipe.clone(), format!("linear{index}"))
    })
}
