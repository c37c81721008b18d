//! Gradient accumulation: a weight quantized once per optimizer step, as Transformer Engine's
//! `is_first_microbatch`. The weights do not change between the micro-batches of one optimizer step, so their FP8
//! copies (and, with delayed scaling, their amax record) are made on the first micro-batch and reused by the
//! others:
//!
//! ```no_run
//! # use burn_te::{DelayedScaling, fp8_autocast, microbatch};
//! # let micro_batches: Vec<()> = vec![];
//! for (i, batch) in micro_batches.iter().enumerate() {
//!     let loss = microbatch(i == 0, || fp8_autocast(true, DelayedScaling::default(), || { /* forward */ }));
//!     // backward: gradients accumulate ...
//! }
//! // optimizer step, then the next step's first micro-batch quantizes the updated weights again
//! ```
//!
//! Inside `microbatch(true, ..)` every FP8 layer quantizes its weight (for fprop, and for dgrad where that layout
//! differs) and caches the copies in its FP8 state; inside `microbatch(false, ..)` it uses them and quantizes no
//! weight. Outside both, nothing is cached (TE's `is_first_microbatch=None`). A later micro-batch without a cached
//! weight (its layer did not run in a first micro-batch, another recipe, another shape) quantizes it and records
//! a fallback ([`crate::fallback`]). As in TE, the cached copy keeps the scale it was made with: under delayed
//! scaling a later micro-batch does not re-quantize with a scale updated in between. The cache lives as long as
//! the layer (1 byte per weight, 2 where dgrad needs its own layout) and is replaced by the next first
//! micro-batch.

use core::cell::Cell;

use burn::tensor::ops::FloatTensor;

use crate::backend::{Fp8Tensor, TeBackend};
use crate::fp8_state::site::GemmSite;
use crate::gemm::high_precision::dims;
use crate::primitive::SavedQuantized;
use crate::recipe::Recipe;

thread_local! {
    static MICROBATCH: Cell<Option<bool>> = const { Cell::new(None) };
}

/// Restores the previous micro-batch setting when dropped.
#[derive(Debug)]
pub struct MicrobatchGuard {
    previous: Option<bool>,
    _not_send: core::marker::PhantomData<*const ()>,
}

impl Drop for MicrobatchGuard {
    fn drop(&mut self) {
        MICROBATCH.with(|m| m.set(self.previous));
    }
}

/// Until the guard drops, this thread's FP8 layers run micro-batch `is_first` of an optimizer step (see the module
/// doc): the first quantizes and caches the weights, the others reuse them.
pub fn microbatch_guard(is_first: bool) -> MicrobatchGuard {
    let previous = MICROBATCH.with(|m| m.replace(Some(is_first)));
    MicrobatchGuard {
        previous,
        _not_send: core::marker::PhantomData,
    }
}

/// Runs `f` as micro-batch `is_first` of an optimizer step (see [`microbatch_guard`]).
pub fn microbatch<T>(is_first: bool, f: impl FnOnce() -> T) -> T {
    let _guard = microbatch_guard(is_first);
    f()
}

/// Whether this thread runs a micro-batch of gradient accumulation (first or later).
pub(crate) fn caching() -> bool {
    MICROBATCH.with(Cell::get).is_some()
}

/// A layer's FP8 weight of the first micro-batch.
#[derive(Clone)]
pub(crate) struct CachedWeight<D> {
    recipe: Recipe,
    shape: Vec<usize>,
    /// The fprop's quantization, and whether it holds the transpose.
    pub(crate) fprop: (Fp8Tensor<D>, bool),
    /// The dgrad's, where the first micro-batch kept one.
    pub(crate) dgrad: Option<SavedQuantized<D>>,
}

/// The cached weight for this fprop: `Some` inside a later micro-batch with a matching cache; a later micro-batch
/// without one records a fallback and gets `None` (the weight is quantized).
pub(crate) fn cached<B: TeBackend>(
    site: &GemmSite,
    recipe: &Recipe,
    weight: &FloatTensor<B>,
    overridden: bool,
) -> Option<CachedWeight<B::Fp8Data>> {
    if MICROBATCH.with(Cell::get) != Some(false) || overridden {
        return None;
    }
    let shape = dims::<B>(weight);
    let found = site
        .fp8
        .as_ref()
        .and_then(|meta| meta.cached_weight::<CachedWeight<B::Fp8Data>>())
        .filter(|c| c.recipe == *recipe && c.shape == shape);
    if found.is_none() {
        crate::fallback::record(
            "no cached FP8 weight",
            format!(
                "{site}: a later micro-batch found no FP8 weight cached by a first micro-batch (same recipe and \
                 shape); the weight is quantized again"
            ),
        );
    }
    found
}

/// Caches the fprop's (and dgrad's) quantization of the weight inside a first micro-batch (a site without FP8
/// state records a fallback: nothing to cache in).
pub(crate) fn cache<B: TeBackend>(
    site: &GemmSite,
    recipe: &Recipe,
    weight_shape: Vec<usize>,
    fprop: (&Fp8Tensor<B::Fp8Data>, bool),
    dgrad: Option<&SavedQuantized<B::Fp8Data>>,
    overridden: bool,
) {
    if MICROBATCH.with(Cell::get) != Some(true) || overridden {
        return;
    }
    let Some(meta) = site.fp8.as_ref() else {
        crate::fallback::record(
            "no cached FP8 weight",
            format!("{site}: no FP8 state to cache the first micro-batch's weight in"),
        );
        return;
    };
    meta.cache_weight(CachedWeight {
        recipe: recipe.clone(),
        shape: weight_shape,
        fprop: (fprop.0.clone(), fprop.1),
        dgrad: dgrad.cloned(),
    });
}
