//! Where the first non-finite value of a step appeared, without eager mode.
//!
//! With [`track_non_finite`](super::DiagnosticsConfig::track_non_finite), every layer GEMM launches the one-pass
//! count kernel on its two operands and its output (no sync: the counts stay on the device). [`step`]
//! (super::step) reads them all back in one read per device at the step's sync and reports, in execution order, the
//! first tensor with a NaN or an infinity: layer, GEMM (fprop/dgrad/wgrad), tensor (activation, weight, gradient,
//! output), iteration, shape and counts. A NaN made between two GEMMs (e.g. by a normalization) shows as the next
//! GEMM's input.
//!
//! A layer's three GEMMs share their operands: the weight of dgrad is fprop's, the activation of wgrad is the one
//! fprop saved, and both backward GEMMs take the same output gradient. Each such tensor is checked once, where it
//! first appears (6 checks per layer and step instead of 9; `NonFiniteChecksShared` counts the others), which
//! names the same first origin: a shared tensor's first appearance comes first in execution order.

use std::any::Any;
use std::cell::RefCell;
use std::fmt;

use burn::tensor::TensorMetadata;
use burn::tensor::ops::FloatTensor;

use crate::backend::TeBackend;
use crate::fp8_state::site::GemmSite;
use crate::gemm::{Gemm, TensorRole};
use crate::metrics::{self, names};

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

/// A check's `(NaN, +inf, -inf)` counts, or why they could not be read.
type Counts = Result<(u64, u64, u64), String>;

/// The launched checks of one backend type, read back together.
trait Batch {
    /// Reads every check back, in launch order.
    fn read(self: Box<Self>) -> Vec<Counts>;
    fn as_any(&mut self) -> &mut dyn Any;
}

struct Checks<B: TeBackend>(Vec<B::PendingStats>);

impl<B: TeBackend> Batch for Checks<B> {
    fn read(self: Box<Self>) -> Vec<Counts> {
        let len = self.0.len();
        match B::fp8_stats_read_many(self.0) {
            Ok(stats) => stats
                .into_iter()
                .map(|s| {
                    let t = s.tensor;
                    Ok((t.nan_count, t.pos_inf_count, t.neg_inf_count))
                })
                .collect(),
            Err(err) => vec![Err(err.to_string()); len],
        }
    }

    fn as_any(&mut self) -> &mut dyn Any {
        self
    }
}

/// A launched check of one tensor: where it is, and its place in `State::batches`.
struct Pending {
    layer: String,
    gemm: Gemm,
    tensor: OriginTensor,
    shape: Vec<usize>,
    generation: u64,
    batch: usize,
    index: usize,
}

#[derive(Default)]
struct State {
    pending: Vec<Pending>,
    /// The step's launched checks, one batch per backend type (one in practice).
    batches: Vec<Box<dyn Batch>>,
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
    if with_state(|state| checked_already(&state.pending, site, role, &shape)) {
        metrics::increment_counter(names::NON_FINITE_CHECKS_SHARED, 1);
        return;
    }
    metrics::increment_counter(names::NON_FINITE_CHECKS, 1);
    let pending = match B::fp8_non_finite_launch(tensor.clone()) {
        Ok(pending) => pending,
        Err(err) => {
            metrics::increment_counter("NonFiniteCheckErrors", 1);
            tracing::warn!("{site} {tensor_kind}: non-finite check not launched: {err}");
            return;
        }
    };
    with_state(|state| {
        if state.pending.len() >= MAX_PENDING {
            metrics::increment_counter("NonFiniteChecksDropped", 1);
            return;
        }
        let found = state
            .batches
            .iter_mut()
            .enumerate()
            .find_map(|(i, b)| b.as_any().downcast_mut::<Checks<B>>().map(|c| (i, c)));
        let (batch, index) = match found {
            Some((batch, checks)) => {
                checks.0.push(pending);
                (batch, checks.0.len() - 1)
            }
            None => {
                state.batches.push(Box::new(Checks::<B>(vec![pending])));
                (state.batches.len() - 1, 0)
            }
        };
        state.pending.push(Pending {
            layer: site.layer.to_string(),
            gemm: site.gemm,
            tensor: tensor_kind,
            shape,
            generation: site.generation,
            batch,
            index,
        });
    });
}

/// Whether `role`'s operand at `site` is a tensor an earlier GEMM of the same layer checked: the weight at dgrad
/// (fprop's, unchanged until the optimizer steps after the backward pass), the activation at wgrad (fprop saved
/// it, and every fprop checks its own), and the output gradient when the other backward GEMM of the same layer,
/// forward pass and shape has just checked it (the two run back to back on one gradient; where only one runs, it
/// checks it).
fn checked_already(
    pending: &[Pending],
    site: &GemmSite,
    role: Option<TensorRole>,
    shape: &[usize],
) -> bool {
    match (site.gemm, role) {
        (Gemm::Dgrad, Some(TensorRole::Weight)) | (Gemm::Wgrad, Some(TensorRole::Activation)) => {
            true
        }
        (Gemm::Dgrad | Gemm::Wgrad, Some(TensorRole::Gradient)) => {
            pending.iter().rev().take(2).any(|p| {
                p.gemm != site.gemm
                    && p.gemm != Gemm::Fprop
                    && p.tensor == OriginTensor::Input(TensorRole::Gradient)
                    && *p.layer == *site.layer
                    && p.generation == site.generation
                    && p.shape == shape
            })
        }
        _ => false,
    }
}

/// Reads the step's checks in execution order and reports the first non-finite tensor (a `tracing` error, the
/// `NonFiniteSteps` counter, [`first_non_finite`]). Returns it, or an origin eager mode found this step.
pub(crate) fn resolve(iteration: u64) -> Option<NonFiniteOrigin> {
    let (pending, batches) = with_state(|state| {
        (
            std::mem::take(&mut state.pending),
            std::mem::take(&mut state.batches),
        )
    });
    // One read per batch (and device): every count of the step at once.
    let counts: Vec<Vec<Counts>> = batches.into_iter().map(|b| b.read()).collect();
    let mut found = None;
    for (position, check) in pending.into_iter().enumerate() {
        if found.is_some() {
            break;
        }
        match counts[check.batch][check.index].clone() {
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
