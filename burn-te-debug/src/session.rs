//! The debug session: its state and lock, `initialize`, `step` and `end`, and the entry points through which the
//! `Debug<B>` decorator threads one GEMM through the [`pipeline`](crate::pipeline) stages. Features run without
//! the lock: an entry point takes what a stage needs under it, runs the features, and hands their output back
//! under it.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use burn_te::{Gemm, GemmSite};

use crate::config::Config;
use crate::dump::Dumps;
use crate::error::DebugError;
use crate::feature::{DebugTensor, Modified};
use crate::options::DebugOptions;
use crate::pipeline::log::{Log, LogFiles};
use crate::pipeline::reduce::{Reduction, ReductionGroup, StatBuffers};
use crate::pipeline::route::{self, GemmPlan, LayerFeatures, Router};
use crate::pipeline::run::{self, Ran};
use crate::tensor::TensorName;

/// A debug session: the stages' state between GEMMs and steps.
pub(crate) struct Session {
    iteration: u64,
    /// Each layer's section and routing.
    router: Router,
    /// The statistics launched this step.
    buffers: StatBuffers,
    /// Across peers: with whom the statistics are merged at `step()`.
    reduction: Reduction,
    /// The log files, stat loggers and dumps.
    log: Log,
}

/// The sessions of this process: one, or one per peer when peers are threads of it. Each has its own lock, so a
/// peer waiting for the others in `step()` does not hold up another peer's threads.
type Sessions = BTreeMap<SessionKey, Arc<Mutex<Session>>>;

/// A session's owner: the rank of the peer bound to the threads that use it ([`burn_te::distributed`]), or the
/// process (no peer bound).
type SessionKey = Option<usize>;

static ACTIVE: AtomicUsize = AtomicUsize::new(0);
static SESSIONS: Mutex<Sessions> = Mutex::new(BTreeMap::new());

fn lock() -> MutexGuard<'static, Sessions> {
    SESSIONS.lock().unwrap_or_else(|p| p.into_inner())
}

/// This thread's session: its bound peer's, else the process's.
fn key() -> SessionKey {
    #[cfg(feature = "distributed")]
    return burn_te::distributed::current().map(|peer| peer.rank());
    #[cfg(not(feature = "distributed"))]
    None
}

type Depth = std::thread::LocalKey<std::cell::Cell<u32>>;

/// Runs `f` one level deeper in `depth` (this thread's nesting counter), back when `f` returns or panics.
fn nested<T>(depth: &'static Depth, f: impl FnOnce() -> T) -> T {
    struct Leave(&'static Depth);
    impl Drop for Leave {
        fn drop(&mut self) {
            self.0.with(|n| n.set(n.get() - 1));
        }
    }
    depth.with(|n| n.set(n.get() + 1));
    let _leave = Leave(depth);
    f()
}

thread_local! {
    /// Nesting depth of feature code running on this thread (see [`in_features`]).
    static IN_FEATURES: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Runs features' code (routing, inspection, modification): never under the session's lock, so a feature may call
/// [`iteration`], [`log_message`] or any read of the session, from this thread or another. Only the calls that
/// would change the session under the running GEMM (`step`, `end`, `initialize`, `initialize_training_step`) are
/// refused with [`DebugError::Reentrant`].
fn in_features<T>(f: impl FnOnce() -> T) -> T {
    nested(&IN_FEATURES, f)
}

/// The sessions' lock for an entry point that changes the session; an error when called from a feature's code.
fn lock_entry(entry: &'static str) -> Result<MutexGuard<'static, Sessions>, DebugError> {
    if IN_FEATURES.with(|n| n.get() > 0) {
        return Err(DebugError::Reentrant(entry));
    }
    Ok(lock())
}

/// This thread's session, for an entry point that changes it.
fn session_entry(entry: &'static str) -> Result<Option<Arc<Mutex<Session>>>, DebugError> {
    Ok(lock_entry(entry)?.get(&key()).cloned())
}

fn lock_session(session: &Mutex<Session>) -> MutexGuard<'_, Session> {
    session.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether a session runs (a cheap check for the decorator's plain path).
pub(crate) fn active() -> bool {
    ACTIVE.load(Ordering::Acquire) > 0 && PAUSED.with(|p| p.get() == 0)
}

thread_local! {
    /// Nesting depth of [`paused`] on this thread.
    static PAUSED: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Runs `f` with the debug features off on this thread: its GEMMs take the plain path and feed no stats, dumps or
/// features (e.g. a validation pass, whose activations would otherwise join the next training step's
/// statistics as a micro-batch). Nestable; the features are back on when `f` returns or panics.
pub fn paused<T>(f: impl FnOnce() -> T) -> T {
    nested(&PAUSED, f)
}

/// Runs `f` on this thread's session under the lock, if one runs. `f` is the session's own code, never a
/// feature's.
fn with_session<T>(f: impl FnOnce(&mut Session) -> T) -> Option<T> {
    let session = lock().get(&key()).cloned()?;
    let mut session = lock_session(&session);
    Some(f(&mut session))
}

/// Starts the debug session: reads the config (a missing file warns and runs with no features), creates the log
/// files (an unwritable log dir is an error). A second `initialize` before [`end`] is an error.
///
/// Called on a thread bound to a `burn_te::distributed::Peer` (feature `distributed`), it starts that peer's session: its logs are
/// rank `r`'s, its dumps go under `rank_<r>/`, its statistics are reduced across the peers at `step()` (see
/// [`crate::set_tensor_reduction_group`]), and the debug calls of the threads bound to the peer use it. Each
/// peer initializes its own (TE: "on every rank").
pub fn initialize(options: DebugOptions) -> Result<(), DebugError> {
    let mut guard = lock_entry("initialize")?;
    let key = key();
    if guard.contains_key(&key) {
        return Err(DebugError::AlreadyInitialized);
    }
    let rank = burn_te::diagnostics::rank();
    let files = if options.default_logging_enabled {
        Some(LogFiles::create(&options.log_dir, rank)?)
    } else {
        None
    };
    let mut messages = Vec::new();
    if files.is_some() {
        messages.push(format!(
            "Default logging to file enabled at {}",
            options.log_dir.display()
        ));
    }
    let config = match &options.config_file {
        Some(path) if Path::new(path).exists() => {
            messages.push(format!("Reading config from {}.", path.display()));
            let config = Config::from_file(path)?;
            let names: Vec<String> = config
                .section_names
                .iter()
                .map(|n| format!("'{n}'"))
                .collect();
            messages.push(format!(
                "Loaded configs for dict_keys([{}]).",
                names.join(", ")
            ));
            Some(Arc::new(config))
        }
        Some(path) => {
            let warning = format!(
                "Config file {} not found: running with no debug features.",
                path.display()
            );
            tracing::warn!("{warning}");
            messages.push(warning);
            None
        }
        None => None,
    };
    let loggers = match &options.logger_ranks {
        Some(ranks) if !ranks.contains(&rank) => Vec::new(),
        _ => options.loggers,
    };
    let dumps = Dumps::new(options.dump_dir.unwrap_or(options.log_dir), rank);
    let mut log = Log::new(files, loggers, dumps);
    for message in &messages {
        log.main(message)?;
    }
    let session = Session {
        iteration: options.init_training_step,
        router: Router::new(config),
        buffers: StatBuffers::default(),
        reduction: Reduction::for_this_thread(),
        log,
    };
    guard.insert(key, Arc::new(Mutex::new(session)));
    ACTIVE.fetch_add(1, Ordering::AcqRel);
    Ok(())
}

/// Ends the iteration: reads the step's statistics from the device (one sync), writes them to the statistics log
/// and the stat loggers, and advances the iteration. Without a session it does nothing, so a training loop written
/// once runs with and without the debug tools.
pub fn step() -> Result<(), DebugError> {
    let Some(session) = session_entry("step")? else {
        return Ok(());
    };
    let mut session = lock_session(&session);
    let result = session.flush();
    let iteration = session.iteration;
    session.iteration += 1;
    drop(session);
    burn_te::diagnostics::set_iteration(iteration);
    // The diagnostics' step (closures, non-finite origin, snapshots) at the same sync.
    let diagnostics = burn_te::diagnostics::step();
    result?;
    diagnostics.map_err(DebugError::from)
}

/// Ends the session: logs what the current step has buffered, closes the files, forgets the config. `initialize`
/// may be called again afterwards. Without a session it does nothing.
pub fn end() -> Result<(), DebugError> {
    let Some(session) = lock_entry("end")?.remove(&key()) else {
        return Ok(());
    };
    ACTIVE.fetch_sub(1, Ordering::AcqRel);
    lock_session(&session).flush()
}

/// Sets the current iteration (e.g. when resuming from a checkpoint). Without a session it does nothing.
pub fn initialize_training_step(iteration: u64) -> Result<(), DebugError> {
    let Some(session) = session_entry("initialize_training_step")? else {
        return Ok(());
    };
    let mut session = lock_session(&session);
    session.iteration = iteration;
    session.router.restart();
    Ok(())
}

/// The current iteration, if a session runs.
pub fn iteration() -> Option<u64> {
    with_session(|s| s.iteration)
}

/// Writes `message` to the main log (prefixed with `layer: ` when given) and to `tracing`; without a session, to
/// `tracing` only.
pub fn log_message(message: &str, layer: Option<&str>) -> Result<(), DebugError> {
    let message = match layer {
        Some(layer) => format!("{layer}: {message}"),
        None => message.to_string(),
    };
    match with_session(|s| s.log.main(&message)) {
        Some(result) => result,
        None => {
            tracing::info!(target: "burn_te_debug", "{message}");
            Ok(())
        }
    }
}

/// The session's config, taken under the lock for use without it (`None`: a session without a config).
fn session_config() -> Result<Option<Arc<Config>>, DebugError> {
    with_session(|s| s.router.config().cloned()).ok_or(DebugError::NotInitialized)
}

/// Checks the config against a model's layer names before training: a layer selected by two sections is an
/// error (TE: "multiple debug configs targeting the same layer").
pub fn check_layers<'a>(layers: impl IntoIterator<Item = &'a str>) -> Result<(), DebugError> {
    if let Some(config) = session_config()? {
        for layer in layers {
            config.section_for(layer, None)?;
        }
    }
    Ok(())
}

/// The stat names (`<layer>_<tensor>_<stat>`, as logged) the config's features log for these layers, in the order
/// given: what a dashboard registers before training (see the `train` module). Schedules are not considered: a
/// name may be logged at some iterations only.
pub fn stat_names<'a>(
    layers: impl IntoIterator<Item = &'a str>,
) -> Result<Vec<String>, DebugError> {
    let mut names = Vec::new();
    let Some(config) = session_config()? else {
        return Ok(names);
    };
    for layer in layers {
        if let Some(section) = config.section_for(layer, None)? {
            for feature in &section.features {
                for (tensor, stat) in in_features(|| feature.logged_stats()) {
                    let name = format!("{layer}_{tensor}_{stat}");
                    if !names.contains(&name) {
                        names.push(name);
                    }
                }
            }
        }
    }
    Ok(names)
}

/// Sets the peers whose activation, gradient and output statistics this thread's session merges with its own at
/// `step()` (TE's `debug_api.set_tensor_reduction_group`; default: every peer). Without a session: an error.
pub fn set_tensor_reduction_group(group: ReductionGroup) -> Result<(), DebugError> {
    with_session(|s| s.reduction.set_tensor_group(group)).ok_or(DebugError::NotInitialized)
}

/// Sets the peers whose weight statistics this thread's session merges with its own (TE reduces a weight within
/// its tensor-parallel group; default: this peer alone, as data-parallel peers hold the same weight). Without a
/// session: an error.
pub fn set_weight_reduction_group(group: ReductionGroup) -> Result<(), DebugError> {
    with_session(|s| s.reduction.set_weight_group(group)).ok_or(DebugError::NotInitialized)
}

impl Session {
    /// The layer's features as of now, for use without the lock.
    fn layer_features(&mut self, site: &GemmSite) -> LayerFeatures {
        self.router
            .layer_features(site, self.iteration, &mut self.log)
    }

    fn flush(&mut self) -> Result<(), DebugError> {
        // GEMMs that fell back to high precision this step (burn-te counts them; the user reads them here).
        for message in burn_te::fallback::take_fallback_messages() {
            let _ = self.log.main(&message);
        }
        let stats = self.buffers.take(&self.reduction, self.iteration);
        let logged = self.log.step(self.iteration, stats);
        match self.router.take_failure() {
            Some(err) => {
                if let Err(log_err) = logged {
                    tracing::error!(target: "burn_te_debug", "{log_err}");
                }
                Err(err)
            }
            None => logged,
        }
    }
}

/// Whether the features need `site`'s high-precision operands at its backward GEMM `gemm` of this iteration (they
/// run it in high precision, modify an operand or measure its error): the forward then keeps them for the backward
/// instead of their FP8 copies (see `burn_te::gemm::saved`). A routing error keeps them too (the backward reports it).
pub(crate) fn backward_needs_original(site: &GemmSite, gemm: Gemm) -> bool {
    if !active() {
        return false;
    }
    let Some(layer) = with_session(|s| s.layer_features(site)) else {
        return false;
    };
    in_features(|| route::needs_original(&layer, &site.with_gemm(gemm)))
}

/// The plan of a GEMM call, or `None` for the plain path (no active feature until a later iteration).
pub(crate) fn plan(site: &GemmSite, fp8_scope: bool) -> Option<GemmPlan> {
    let layer = with_session(|s| {
        (!s.router.skipping(site, s.iteration, &mut s.log)).then(|| s.layer_features(site))
    })
    .flatten()?;
    let (routed, lines) = in_features(|| route::plan(&layer, site, fp8_scope));
    with_session(|s| s.router.settle(site, routed, lines, &mut s.log)).flatten()
}

/// Runs inspecting features on `tensor` of `site`'s GEMM: the layer's features are taken under the lock, `run`
/// runs them without it, and what they produced is collected under it; `tensors`: the tensor, with its
/// high-precision reference for a GEMM output whose error is measured.
fn inspection(
    site: &GemmSite,
    tensor: TensorName,
    tensors: (&dyn DebugTensor, Option<&dyn DebugTensor>),
    run: impl FnOnce(&LayerFeatures) -> Ran,
) {
    let Some(layer) = with_session(|s| s.layer_features(site)) else {
        return;
    };
    let ran = in_features(|| run(&layer));
    with_session(|s| {
        ran.collect(
            site,
            tensor,
            tensors,
            s.iteration,
            &mut s.buffers,
            &mut s.log,
        )
    });
}

/// Runs the features that measure the error of `site`'s GEMM: `output` against `reference`.
pub(crate) fn inspect_gemm_error(
    site: &GemmSite,
    output: &dyn DebugTensor,
    reference: &dyn DebugTensor,
) {
    let tensor = TensorName::output_of(site.gemm);
    inspection(site, tensor, (output, Some(reference)), |layer| {
        run::inspect_gemm_error(layer, site, output, reference)
    });
}

/// Runs the features that compare the GEMM under the candidate `recipe` (its result `output`) with `reference`.
pub(crate) fn inspect_gemm_candidate(
    site: &GemmSite,
    recipe: &str,
    output: &dyn DebugTensor,
    reference: &dyn DebugTensor,
) {
    let tensor = TensorName::output_of(site.gemm);
    inspection(site, tensor, (output, Some(reference)), |layer| {
        run::inspect_gemm_candidate(layer, site, recipe, output, reference)
    });
}

/// Runs the features that inspect `tensor` in high precision (TE's `inspect_tensor`).
pub(crate) fn inspect(site: &GemmSite, tensor: TensorName, x: &dyn DebugTensor) {
    inspection(site, tensor, (x, None), |layer| {
        run::inspect_tensor(layer, site, tensor, x)
    });
}

/// Runs the features that inspect `tensor` as its GEMM quantized it (TE's `inspect_tensor_postquantize`).
pub(crate) fn inspect_postquantize(site: &GemmSite, tensor: TensorName, x: &dyn DebugTensor) {
    inspection(site, tensor, (x, None), |layer| {
        run::inspect_postquantize(layer, site, tensor, x)
    });
}

/// Runs the feature at `index` of the layer's section on an input (TE's `modify_tensor`).
pub(crate) fn modify(
    site: &GemmSite,
    index: usize,
    tensor: TensorName,
    x: &dyn DebugTensor,
) -> Result<Modified, DebugError> {
    let layer = with_session(|s| s.layer_features(site)).ok_or(DebugError::NotInitialized)?;
    let feature = layer
        .features()
        .get(index)
        .ok_or(DebugError::NotInitialized)?;
    let (result, call) =
        in_features(|| run::modify(feature.as_ref(), site, tensor, x, layer.iteration));
    with_session(|s| s.log.once(call));
    result
}
