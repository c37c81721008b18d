//! Where the first non-finite value of a step appeared, without eager mode.
//!
//! With [`track_non_finite`](super::DiagnosticsConfig::track_non_finite), every layer GEMM launches the one-pass
//! statistics kernel on its two operands and its output (no sync: the counts stay on the device). [`step`]
//! (super::step) reads them at the step's sync, in execution order, and reports the first tensor with a NaN or an
//! infinity: layer, GEMM (fprop/dgrad/wgrad), tensor (activation, weight, gradient, output), iteration, shape and
//! counts. A NaN made between two GEMMs (e.g. by a normalization) shows as the next GEMM's input.

use std::cell::RefCell;
use std::fmt;

use burn::tensor::TensorMetadata;
use burn::tensor::ops::FloatTensor;

use super::{metrics, names};
use crate::backend::TeBackend;
use crate::site::{Gemm, GemmSite, TensorRole};

/// Which tensor of a GEMM held the value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OriginTensor {
    /// An operand, by its role.
    Input(TensorRole),
    /// The GEMM's output.
    Output,
}

impl fmt::Display for OriginTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OriginTensor::Input(role) => f.write_str(role.name()),
            OriginTensor::Output => f.write_str("output"),
        }
    }
}

/// The first non-finite value found: where, when, and how many.
#[derive(Clone, Debug, PartialEq)]
pub struct NonFiniteOrigin {
    /// The iteration (the diagnostics' [`iteration`](super::iteration())).
    pub iteration: u64,
    /// The op that produced it: `te_linear` for a layer GEMM, else the op's name (eager mode).
    pub op: String,
    /// The layer, when inside one.
    pub layer: Option<String>,
    /// The layer's GEMM, when inside one.
    pub gemm: Option<Gemm>,
    /// The GEMM tensor (for a layer GEMM).
    pub tensor: Option<OriginTensor>,
    /// The tensor's shape.
    pub shape: Vec<usize>,
    /// NaN elements.
    pub nan_count: u64,
    /// +inf elements.
    pub pos_inf_count: u64,
    /// -inf elements.
    pub neg_inf_count: u64,
    /// How many tensors were checked before it this step (its position in execution order).
    pub position: usize,
}

impl fmt::Display for NonFiniteOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "iteration {}: ", self.iteration)?;
        match (&self.layer, self.gemm, self.tensor) {
            (Some(layer), Some(gemm), Some(tensor)) => {
                write!(f, "layer {layer}, {} GEMM, its {tensor}", gemm.name())?
            }
            _ => write!(f, "op {}, its output", self.op)?,
        }
        write!(
            f,
            " {:?} held {} NaN, {} +inf, {} -inf (the first non-finite tensor this step, after {} finite ones)",
            self.shape, self.nan_count, self.pos_inf_count, self.neg_inf_count, self.position
        )
    }
}

/// Reads a launched check back: `(NaN, +inf, -inf)` counts, or why it could not be read.
type ReadCounts = Box<dyn FnOnce() -> Result<(u64, u64, u64), String>>;

/// A launched check of one tensor.
struct Pending {
    layer: String,
    gemm: Gemm,
    tensor: OriginTensor,
    shape: Vec<usize>,
    read: ReadCounts,
}

#[derive(Default)]
struct State {
    pending: Vec<Pending>,
    /// The first origin of the run (eager or tracked).
    first: Option<NonFiniteOrigin>,
    /// The latest origin reported.
    last: Option<NonFiniteOrigin>,
    /// The iteration whose origin has been reported (one report per step).
    reported: Option<u64>,
}

thread_local! {
    /// This thread's checks and reports (the step belongs to the thread that issues its ops).
    static STATE: RefCell<State> = RefCell::new(State::default());
}

fn with_state<T>(f: impl FnOnce(&mut State) -> T) -> T {
    STATE.with(|s| f(&mut s.borrow_mut()))
}

/// Checks launched and not read back beyond which new ones are dropped (a loop that never calls `step`).
const MAX_PENDING: usize = 1 << 16;

/// Launches the statistics pass of one GEMM tensor (`role`: an operand; `None`: the output).
pub(crate) fn launch<B: TeBackend>(
    site: &GemmSite,
    role: Option<TensorRole>,
    tensor: &FloatTensor<B>,
) {
    let tensor_kind = role.map_or(OriginTensor::Output, OriginTensor::Input);
    let shape = tensor.shape().as_slice().to_vec();
    let pending = match B::fp8_non_finite_launch(tensor.clone()) {
        Ok(pending) => pending,
        Err(err) => {
            metrics::increment_counter("NonFiniteCheckErrors", 1);
            tracing::warn!("{site} {tensor_kind}: non-finite check not launched: {err}");
            return;
        }
    };
    let read = Box::new(move || {
        B::fp8_stats_read(pending)
            .map(|s| {
                (
                    s.tensor.nan_count,
                    s.tensor.pos_inf_count,
                    s.tensor.neg_inf_count,
                )
            })
            .map_err(|e| e.to_string())
    });
    with_state(|state| {
        if state.pending.len() >= MAX_PENDING {
            metrics::increment_counter("NonFiniteChecksDropped", 1);
            return;
        }
        state.pending.push(Pending {
            layer: site.layer.to_string(),
            gemm: site.gemm,
            tensor: tensor_kind,
            shape,
            read,
        });
    });
}

/// Reads the step's checks in execution order and reports the first non-finite tensor (a `tracing` error, the
/// `NonFiniteSteps` counter, [`first_non_finite`]). Returns it, or an origin eager mode found this step.
pub(crate) fn resolve(iteration: u64) -> Option<NonFiniteOrigin> {
    let pending = with_state(|state| std::mem::take(&mut state.pending));
    let mut found = None;
    for (position, check) in pending.into_iter().enumerate() {
        if found.is_some() {
            continue; // the rest need no read: dropping them drops their buffers
        }
        match (check.read)() {
            Ok((nan, pos_inf, neg_inf)) if nan + pos_inf + neg_inf > 0 => {
                found = Some(NonFiniteOrigin {
                    iteration,
                    op: "te_linear".into(),
                    layer: Some(check.layer),
                    gemm: Some(check.gemm),
                    tensor: Some(check.tensor),
                    shape: check.shape,
                    nan_count: nan,
                    pos_inf_count: pos_inf,
                    neg_inf_count: neg_inf,
                    position,
                })
            }
            Ok(_) => {}
            Err(err) => {
                metrics::increment_counter("NonFiniteCheckErrors", 1);
                tracing::warn!("non-finite check of {} not read: {err}", check.layer);
            }
        }
    }
    match found {
        Some(origin) => {
            report(origin.clone());
            Some(origin)
        }
        None => with_state(|state| {
            state
                .last
                .clone()
                .filter(|last| last.iteration == iteration)
        }),
    }
}

/// Reports an origin once per iteration: logs it, counts the step, keeps the run's first. Returns whether it was
/// the first report of its iteration.
pub(crate) fn report(origin: NonFiniteOrigin) -> bool {
    let new = with_state(|state| {
        if state.reported == Some(origin.iteration) {
            return false;
        }
        state.reported = Some(origin.iteration);
        if state.first.is_none() {
            state.first = Some(origin.clone());
        }
        state.last = Some(origin.clone());
        true
    });
    if new {
        metrics::increment_counter(names::NON_FINITE_STEPS, 1);
        tracing::error!(target: "burn_te::diagnostics", "first non-finite value: {origin}");
    }
    new
}

/// The first non-finite value this thread found (since [`clear_non_finite`]), by eager mode or the step tracking.
pub fn first_non_finite() -> Option<NonFiniteOrigin> {
    with_state(|state| state.first.clone())
}

/// Forgets this thread's reported origin and pending checks.
pub fn clear_non_finite() {
    with_state(|state| *state = State::default());
}
