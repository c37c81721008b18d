//! The debug session: `initialize`, `step`, `end`, and the routing the `Debug<B>` decorator asks for.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use burn_te::{Gemm, GemmSite};

use crate::config::Config;
use crate::dump::{TensorDump, dump_path, write_dump};
use crate::error::DebugError;
use crate::features::{DebugTensor, Feature, Inspection, Modified};
use crate::log::{LogFiles, stat_message};
use crate::reduction::Reduction;
use crate::routing::{self, GemmPlan};
use crate::stats::{Stat, StatBuffers, StatRequest, StatValue};
use crate::tensor::TensorName;

/// A receiver of each step's statistics besides the log file (burn-train, TensorBoard, a test).
pub trait StatLogger: Send {
    /// The values of the step that ends at `iteration`.
    fn log(&mut self, iteration: u64, values: &[StatValue]);
}

/// Options of [`initialize`], after nvdlfw-inspect's `initialize` arguments.
pub struct DebugOptions {
    config_file: Option<PathBuf>,
    log_dir: PathBuf,
    dump_dir: Option<PathBuf>,
    default_logging_enabled: bool,
    loggers: Vec<Box<dyn StatLogger>>,
    logger_ranks: Option<Vec<usize>>,
    init_training_step: u64,
}

impl DebugOptions {
    /// Options with `config_file`, logs in `.`, default logging on, training step 0.
    pub fn new(config_file: impl Into<PathBuf>) -> Self {
        DebugOptions {
            config_file: Some(config_file.into()),
            log_dir: PathBuf::from("."),
            dump_dir: None,
            default_logging_enabled: true,
            loggers: Vec::new(),
            logger_ranks: None,
            init_training_step: 0,
        }
    }

    /// Options without a config file: no features run (the logs and loggers still work).
    pub fn without_config() -> Self {
        DebugOptions {
            config_file: None,
            ..DebugOptions::new("")
        }
    }

    /// Where `nvdlfw_inspect_logs/` and `nvdlfw_inspect_statistics_logs/` go.
    pub fn log_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.log_dir = dir.into();
        self
    }

    /// Where DumpTensors writes its `tensor_dumps/` (default: the log directory).
    pub fn dump_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dump_dir = Some(dir.into());
        self
    }

    /// Whether the log files are written (default: yes).
    pub fn default_logging(mut self, enabled: bool) -> Self {
        self.default_logging_enabled = enabled;
        self
    }

    /// Adds a stat logger.
    pub fn logger(mut self, logger: impl StatLogger + 'static) -> Self {
        self.loggers.push(Box::new(logger));
        self
    }

    /// Adds a boxed stat logger.
    pub fn boxed_logger(mut self, logger: Box<dyn StatLogger>) -> Self {
        self.loggers.push(logger);
        self
    }

    /// The ranks whose stat loggers (TensorBoard, burn-train, ...) write (default: every rank's). TE's way — give
    /// the writer to the chosen ranks only — works too; this lets every peer run the same code. The log files are
    /// written on every rank.
    pub fn logger_ranks(mut self, ranks: impl IntoIterator<Item = usize>) -> Self {
        self.logger_ranks = Some(ranks.into_iter().collect());
        self
    }

    /// The first iteration's number (default 0).
    pub fn init_training_step(mut self, step: u64) -> Self {
        self.init_training_step = step;
        self
    }
}

struct LayerState {
    section: Option<usize>,
    /// Per GEMM (and whether it is the first use of the gradient): the first iteration at which routing must be
    /// asked again.
    skip_until: BTreeMap<(Gemm, bool), u64>,
    plan_lines: Vec<String>,
}

pub(crate) struct Session {
    config: Option<Arc<Config>>,
    /// The rank in the file names: the bound peer's, else `RANK`, else 0.
    rank: usize,
    /// Across peers: with whom the statistics are merged at `step()`.
    reduction: Reduction,
    iteration: u64,
    /// Where `tensor_dumps/` goes.
    dump_dir: PathBuf,
    /// Dumps written this step per (layer, tensor): micro-batches after the first get their own file.
    dump_feeds: BTreeMap<(Arc<str>, TensorName), usize>,
    logs: Option<LogFiles>,
    loggers: Vec<Box<dyn StatLogger>>,
    buffers: StatBuffers,
    layers: BTreeMap<Arc<str>, LayerState>,
    logged_calls: BTreeSet<String>,
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
pub(crate) fn with_session<T>(f: impl FnOnce(&mut Session) -> T) -> Option<T> {
    let session = lock().get(&key()).cloned()?;
    let mut session = lock_session(&session);
    Some(f(&mut session))
}

/// Starts the debug session: reads the config (a missing file warns and runs with no features), creates the log
/// files (an unwritable log dir is an error). A second `initialize` before [`end`] is an error.
///
/// Called on a thread bound to a [`burn_te::distributed::Peer`], it starts that peer's session: its logs are
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
    let mut logs = if options.default_logging_enabled {
        Some(LogFiles::create(&options.log_dir, rank)?)
    } else {
        None
    };
    let mut messages = Vec::new();
    if logs.is_some() {
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
    for message in &messages {
        tracing::info!(target: "burn_te_debug", "{message}");
        if let Some(logs) = logs.as_mut() {
            logs.main(message)?;
        }
    }
    let session = Session {
        config,
        rank,
        reduction: Reduction::for_this_thread(),
        iteration: options.init_training_step,
        dump_dir: options.dump_dir.unwrap_or(options.log_dir),
        dump_feeds: BTreeMap::new(),
        logs,
        loggers: match &options.logger_ranks {
            Some(ranks) if !ranks.contains(&rank) => Vec::new(),
            _ => options.loggers,
        },
        buffers: StatBuffers::default(),
        layers: BTreeMap::new(),
        logged_calls: BTreeSet::new(),
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
    for layer in session.layers.values_mut() {
        layer.skip_until.clear();
    }
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
    match with_session(|s| s.main_log(&message)) {
        Some(result) => result,
        None => {
            tracing::info!(target: "burn_te_debug", "{message}");
            Ok(())
        }
    }
}

/// The session's config, taken under the lock for use without it (`None`: a session without a config).
fn session_config() -> Result<Option<Arc<Config>>, DebugError> {
    with_session(|s| s.config.clone()).ok_or(DebugError::NotInitialized)
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
/// given: what a dashboard registers before training (see [`crate::train`]). Schedules are not considered: a name
/// may be logged at some iterations only.
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

impl Session {
    fn main_log(&mut self, message: &str) -> Result<(), DebugError> {
        tracing::info!(target: "burn_te_debug", "{message}");
        match self.logs.as_mut() {
            Some(logs) => logs.main(message),
            None => Ok(()),
        }
    }

    fn log_once(&mut self, message: String) {
        if self.logged_calls.insert(message.clone()) {
            let _ = self.main_log(&message);
        }
    }

    fn flush(&mut self) -> Result<(), DebugError> {
        self.dump_feeds.clear();
        // GEMMs that fell back to high precision this step (burn-te counts them; the user reads them here).
        for message in burn_te::fallback::take_fallback_messages() {
            let _ = self.main_log(&message);
        }
        let (partials, errors) = self.buffers.read();
        let (partials, reduction) = self.reduction.reduce(partials, self.iteration);
        if let Some(err) = &reduction {
            tracing::error!(target: "burn_te_debug", "{err}");
            let _ = self.main_log(&err.to_string());
        }
        let values = self.buffers.values(partials);
        for error in &errors {
            tracing::error!("{error}");
            let _ = self.main_log(&format!("statistics not read back: {error}"));
        }
        let mut result = match reduction {
            Some(err) => Err(err),
            None if errors.is_empty() => Ok(()),
            None => Err(DebugError::StatsRead {
                iteration: self.iteration,
                errors,
            }),
        };
        if let Some(logs) = self.logs.as_mut() {
            let lines: Vec<String> = values
                .iter()
                .map(|value| stat_message(&value.name, self.iteration, value.value))
                .collect();
            // A failure is counted in `logs` and reported once below.
            let _ = logs.stats(&lines);
            if let Some(err) = logs.take_failure(self.iteration) {
                tracing::error!(target: "burn_te_debug", "{err}");
                let _ = logs.main(&err.to_string());
                if result.is_ok() {
                    result = Err(err);
                }
            }
        }
        for logger in &mut self.loggers {
            logger.log(self.iteration, &values);
        }
        result
    }

    pub(crate) fn reduction_mut(&mut self) -> &mut Reduction {
        &mut self.reduction
    }

    fn layer_state(&mut self, site: &GemmSite) -> &mut LayerState {
        if !self.layers.contains_key(&site.layer) {
            let section = match &self.config {
                None => None,
                Some(config) => match config.section_for(&site.layer, site.kind) {
                    Ok(found) => found.map(|s| {
                        config
                            .sections
                            .iter()
                            .position(|x| x.name == s.name)
                            .unwrap_or(0)
                    }),
                    Err(err) => {
                        let message = format!("{err}; the layer runs without debug features");
                        tracing::error!("{message}");
                        let _ = self.main_log(&message);
                        None
                    }
                },
            };
            self.layers.insert(
                site.layer.clone(),
                LayerState {
                    section,
                    skip_until: BTreeMap::new(),
                    plan_lines: Vec::new(),
                },
            );
        }
        self.layers.get_mut(&site.layer).expect("inserted above")
    }

    /// The layer's features as of now, for use without the lock.
    fn layer_features(&mut self, site: &GemmSite) -> LayerFeatures {
        let section = self.layer_state(site).section;
        LayerFeatures {
            config: self.config.clone(),
            section,
            iteration: self.iteration,
        }
    }

    /// Whether the GEMM takes the plain path until a later iteration (its features said so).
    fn skipping(&mut self, site: &GemmSite) -> bool {
        let iteration = self.iteration;
        self.layer_state(site)
            .skip_until
            .get(&(site.gemm, site.first_use_of_gradient()))
            .is_some_and(|&until| iteration < until)
    }

    /// Logs the plan lines when they change, and keeps the plan if any feature acts (else skips the GEMM until the
    /// next iteration at which one may).
    fn settle_plan(
        &mut self,
        site: &GemmSite,
        routed: Result<(GemmPlan, Option<u64>), DebugError>,
        lines: Option<Vec<String>>,
    ) -> Option<GemmPlan> {
        if let Some(lines) = lines
            && self.layer_state(site).plan_lines != lines
        {
            for line in &lines {
                let _ = self.main_log(line);
            }
            self.layer_state(site).plan_lines = lines;
        }
        let (plan, next) = match routed {
            Ok(routed) => routed,
            Err(err) => {
                let message = format!("{err}; the GEMM runs unmodified");
                tracing::error!("{message}");
                let _ = self.main_log(&message);
                return None;
            }
        };
        if plan.active() {
            Some(plan)
        } else {
            let until = next.unwrap_or(u64::MAX);
            self.layer_state(site)
                .skip_until
                .insert((site.gemm, site.first_use_of_gradient()), until);
            None
        }
    }

    /// Takes what the inspecting features of `tensor` produced: logs their calls and errors, writes their
    /// messages and dumps, launches their statistics (buffered until `step()`).
    fn collect(
        &mut self,
        site: &GemmSite,
        tensor: TensorName,
        x: &dyn DebugTensor,
        reference: Option<&dyn DebugTensor>,
        ran: Ran,
    ) {
        let layer = site.layer.clone();
        let Ran {
            mut inspection,
            calls,
            errors,
        } = ran;
        for call in calls {
            self.log_once(call);
        }
        for error in errors {
            tracing::error!("{error}");
            let _ = self.main_log(&error);
        }
        for message in std::mem::take(&mut inspection.messages) {
            let _ = self.main_log(&format!("{layer}: {message}"));
        }
        for dump in std::mem::take(&mut inspection.dumps) {
            self.write_dump(&layer, tensor, dump);
        }
        // One launch per stat-name prefix and suffix (a quantized launch also gives the high-precision stats, so an
        // unprefixed LogTensorStats and LogFp8TensorStats share one); a weight only at its first feed of the step.
        let mut merged: Vec<StatRequest> = Vec::new();
        for request in inspection.requests {
            match merged
                .iter_mut()
                .find(|r| r.prefix == request.prefix && r.suffix == request.suffix)
            {
                Some(existing) => {
                    if existing.quantization.is_none() {
                        existing.quantization = request.quantization;
                    }
                    for stat in request.stats {
                        if !existing.stats.contains(&stat) {
                            existing.stats.push(stat);
                        }
                    }
                }
                None => merged.push(request),
            }
        }
        for request in merged {
            if tensor == TensorName::Weight && self.buffers.has(&layer, tensor, &request) {
                continue;
            }
            if let Err(err) = self.launch(&layer, tensor, &request, x) {
                let message = format!("{layer}: statistics of {tensor} not possible: {err}");
                tracing::warn!("{message}");
                let _ = self.main_log(&message);
            }
        }
        for request in std::mem::take(&mut inspection.error_requests) {
            let launched = match reference {
                Some(reference) => x.launch_error_stats(reference),
                None => Err(DebugError::Feature {
                    layer: layer.to_string(),
                    feature: "error stats".into(),
                    tensor: tensor.to_string(),
                    reason: "requested outside inspect_gemm_error (no reference)".into(),
                }),
            };
            match launched {
                Ok((reference, difference)) => self
                    .buffers
                    .add_error(&layer, tensor, &request, reference, difference),
                Err(err) => {
                    let message =
                        format!("{layer}: error statistics of {tensor} not possible: {err}");
                    tracing::warn!("{message}");
                    let _ = self.main_log(&message);
                }
            }
        }
        for (name, value) in inspection.scalars {
            self.buffers.add_scalar(name, value);
        }
    }

    /// Writes one dump file (a weight only at its first feed of the step); errors are logged, not fatal.
    fn write_dump(&mut self, layer: &Arc<str>, tensor: TensorName, mut dump: TensorDump) {
        let feed = self.dump_feeds.entry((layer.clone(), tensor)).or_insert(0);
        if tensor == TensorName::Weight && *feed > 0 {
            return;
        }
        let path = dump_path(
            &self.dump_dir,
            self.rank,
            self.iteration,
            layer,
            tensor.name(),
            *feed,
        );
        *feed += 1;
        dump.metadata.insert("layer".into(), layer.to_string());
        dump.metadata.insert("tensor".into(), tensor.name().into());
        dump.metadata
            .insert("iteration".into(), self.iteration.to_string());
        let keys: Vec<&str> = dump.entries.iter().map(|e| e.key.as_str()).collect();
        let message = match write_dump(&path, &dump) {
            Ok(()) => format!(
                "{layer}: Feature=DumpTensors, API=inspect_tensor: Dumped {tensor} at iteration {} (keys: {keys:?}) to {}",
                self.iteration,
                path.display()
            ),
            Err(err) => {
                tracing::error!("{layer}: {err}");
                format!("{layer}: DumpTensors: {err}")
            }
        };
        let _ = self.main_log(&message);
    }

    /// Launches one request's statistics of a tensor: the one-pass kernel, and the blockwise ranges' kernels.
    fn launch(
        &mut self,
        layer: &str,
        tensor: TensorName,
        request: &StatRequest,
        x: &dyn DebugTensor,
    ) -> Result<(), DebugError> {
        self.buffers.add(
            layer,
            tensor,
            request,
            x.launch_stats(request.quantization)?,
        );
        for &stat in &request.stats {
            if let Stat::MaxBlockwiseDynamicRange(range) = stat {
                for block in range.blocks() {
                    let pending = x.launch_max_block_dynamic_range(block)?;
                    self.buffers
                        .add_value(layer, tensor, request, stat, pending);
                }
            }
        }
        Ok(())
    }
}

/// A layer's features, taken from the session under its lock and run without it.
pub(crate) struct LayerFeatures {
    config: Option<Arc<Config>>,
    section: Option<usize>,
    iteration: u64,
}

impl LayerFeatures {
    fn features(&self) -> &[Box<dyn Feature>] {
        match (&self.config, self.section) {
            (Some(config), Some(section)) => &config.sections[section].features,
            _ => &[],
        }
    }
}

/// What inspecting features produced, for [`Session::collect`].
#[derive(Default)]
struct Ran {
    inspection: Inspection,
    calls: Vec<String>,
    errors: Vec<String>,
}

/// Whether the features need `site`'s high-precision operands at its backward GEMM `gemm` of this iteration (they
/// run it in high precision, modify an operand or measure its error): the forward then keeps them for the backward instead of their
/// FP8 copies (see `burn_te::saved`). A routing error keeps them too (the backward reports it).
pub(crate) fn backward_needs_original(site: &GemmSite, gemm: Gemm) -> bool {
    if !active() {
        return false;
    }
    let Some(layer) = with_session(|s| s.layer_features(site)) else {
        return false;
    };
    let site = site.with_gemm(gemm);
    match in_features(|| routing::route(layer.features(), &site, layer.iteration)) {
        Ok((plan, _)) => !plan.fp8 || plan.modify.iter().any(Option::is_some) || plan.error,
        Err(_) => true,
    }
}

/// The plan of a GEMM call, or `None` for the plain path (no active feature until a later iteration).
pub(crate) fn plan(site: &GemmSite, fp8_scope: bool) -> Option<GemmPlan> {
    let layer = with_session(|s| (!s.skipping(site)).then(|| s.layer_features(site))).flatten()?;
    let features = layer.features();
    let (routed, lines) = in_features(|| {
        let lines = (site.gemm == Gemm::Fprop)
            .then(|| routing::plan_lines(features, site, fp8_scope, layer.iteration));
        (routing::route(features, site, layer.iteration), lines)
    });
    with_session(|s| s.settle_plan(site, routed, lines)).flatten()
}

/// Runs the features that inspect `tensor` through `call` (`None`: the feature is not on for it), named `api` in
/// the main log, then collects what they produced; `x` is the tensor, with its high-precision reference for a
/// GEMM output whose error is measured.
fn run_inspection(
    site: &GemmSite,
    tensor: TensorName,
    (x, reference): (&dyn DebugTensor, Option<&dyn DebugTensor>),
    api: &str,
    call: impl Fn(&dyn Feature, u64, &mut Inspection) -> Option<Result<(), DebugError>>,
) {
    let Some(layer) = with_session(|s| s.layer_features(site)) else {
        return;
    };
    let mut ran = Ran::default();
    in_features(|| {
        for feature in layer.features() {
            let span = tracing::info_span!(
                "debug_feature",
                label = %format_args!("{}:{}", feature.name(), api),
                layer = %site.layer,
                tensor = %tensor
            );
            let _entered = span.enter();
            if let Some(result) = call(feature.as_ref(), layer.iteration, &mut ran.inspection) {
                ran.calls.push(format!(
                    "{}: Feature={}, API={api}: {tensor}",
                    site.layer,
                    feature.name()
                ));
                if let Err(err) = result {
                    ran.errors.push(err.to_string());
                }
            }
        }
    });
    with_session(|s| s.collect(site, tensor, x, reference, ran));
}

/// Runs the features that measure the error of `site`'s GEMM: `output` against `reference`.
pub(crate) fn inspect_gemm_error(
    site: &GemmSite,
    output: &dyn DebugTensor,
    reference: &dyn DebugTensor,
) {
    let (layer, gemm) = (&*site.layer, site.gemm);
    let tensor = TensorName::output_of(gemm);
    let api = format!("inspect_gemm_error, gemm {}", gemm.name());
    run_inspection(
        site,
        tensor,
        (output, Some(reference)),
        &api,
        |f, iteration, out| {
            f.gemm_error_enabled(layer, gemm, iteration)
                .is_some_and(|r| r.enabled)
                .then(|| f.inspect_gemm_error(layer, gemm, output, reference, iteration, out))
        },
    );
}

/// Runs the features that inspect `tensor` in high precision (TE's `inspect_tensor`).
pub(crate) fn inspect(site: &GemmSite, tensor: TensorName, x: &dyn DebugTensor) {
    let layer = &*site.layer;
    run_inspection(
        site,
        tensor,
        (x, None),
        "inspect_tensor",
        |f, iteration, out| {
            f.inspect_tensor_enabled(layer, tensor, iteration)
                .is_some_and(|r| r.enabled)
                .then(|| f.inspect_tensor(layer, tensor, x, iteration, out))
        },
    );
}

/// Runs the features that inspect `tensor` as its GEMM quantized it (TE's `inspect_tensor_postquantize`).
pub(crate) fn inspect_postquantize(site: &GemmSite, tensor: TensorName, x: &dyn DebugTensor) {
    let (layer, gemm) = (&*site.layer, site.gemm);
    let api = format!("inspect_tensor_postquantize, gemm {}", gemm.name());
    run_inspection(site, tensor, (x, None), &api, |f, iteration, out| {
        f.inspect_tensor_postquantize_enabled(layer, gemm, tensor, iteration)
            .is_some_and(|r| r.enabled)
            .then(|| f.inspect_tensor_postquantize(layer, gemm, tensor, x, iteration, out))
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
    let span = tracing::info_span!(
        "debug_feature",
        label = %format_args!("{}:modify_tensor", feature.name()),
        layer = %site.layer,
        tensor = %tensor
    );
    let result = span.in_scope(|| {
        in_features(|| feature.modify_tensor(&site.layer, site.gemm, tensor, x, layer.iteration))
    });
    let call = format!(
        "{}: Feature={}, API=modify_tensor: {tensor}, gemm {}",
        site.layer,
        feature.name(),
        site.gemm.name()
    );
    with_session(|s| s.log_once(call));
    result
}
