//! The debug session: `initialize`, `step`, `end`, and the routing the `Debug<B>` decorator asks for.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use burn_te::{Gemm, GemmSite};

use crate::config::{Config, Section};
use crate::dump::{TensorDump, dump_path, write_dump};
use crate::error::{ConfigError, DebugError};
use crate::features::{DebugTensor, Inspection, Modified, Routing, merge_routing};
use crate::log::{LogFiles, stat_message};
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

    /// The first iteration's number (default 0).
    pub fn init_training_step(mut self, step: u64) -> Self {
        self.init_training_step = step;
        self
    }
}

/// What the decorator does for one GEMM call.
pub(crate) struct GemmPlan {
    pub(crate) fp8: bool,
    /// Per operand: the index of the feature that modifies it.
    pub(crate) modify: [Option<usize>; 2],
    /// The tensors inspected at this GEMM (inputs first).
    pub(crate) inspect: Vec<TensorName>,
}

struct LayerState {
    section: Option<usize>,
    /// Per GEMM: the first iteration at which routing must be asked again.
    skip_until: BTreeMap<Gemm, u64>,
    plan_lines: Vec<String>,
}

pub(crate) struct Session {
    config: Option<Config>,
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

static ACTIVE: AtomicBool = AtomicBool::new(false);
static SESSION: Mutex<Option<Session>> = Mutex::new(None);

fn lock() -> MutexGuard<'static, Option<Session>> {
    SESSION.lock().unwrap_or_else(|p| p.into_inner())
}

/// While this thread runs code on the session (a feature's code included): the iteration, and the messages that
/// code logged, written to the main log when it returns. So a feature that calls [`iteration`] or [`log_message`]
/// gets an answer instead of a deadlock on the session's lock.
struct Held {
    iteration: u64,
    messages: Vec<String>,
}

thread_local! {
    static HELD: std::cell::RefCell<Option<Held>> = const { std::cell::RefCell::new(None) };
}

fn held() -> bool {
    HELD.with(|h| h.borrow().is_some())
}

/// The session's lock for a public entry point; an error (not a deadlock) when called from a feature's code.
fn lock_entry(entry: &'static str) -> Result<MutexGuard<'static, Option<Session>>, DebugError> {
    if held() {
        return Err(DebugError::Reentrant(entry));
    }
    Ok(lock())
}

/// Whether a session runs (a cheap check for the decorator's plain path).
pub(crate) fn active() -> bool {
    ACTIVE.load(Ordering::Acquire) && PAUSED.with(|p| p.get() == 0)
}

thread_local! {
    /// Nesting depth of [`paused`] on this thread.
    static PAUSED: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Runs `f` with the debug features off on this thread: its GEMMs take the plain path and feed no stats, dumps or
/// features (e.g. a validation pass, whose activations would otherwise join the next training step's
/// statistics as a micro-batch). Nestable; the features are back on when `f` returns or panics.
pub fn paused<T>(f: impl FnOnce() -> T) -> T {
    struct Resume;
    impl Drop for Resume {
        fn drop(&mut self) {
            PAUSED.with(|p| p.set(p.get() - 1));
        }
    }
    PAUSED.with(|p| p.set(p.get() + 1));
    let _resume = Resume;
    f()
}

/// Runs `f` on the session, if one runs.
/// A call from code already running on the session (a feature calling back into the debug API) gets `None`.
pub(crate) fn with_session<T>(f: impl FnOnce(&mut Session) -> T) -> Option<T> {
    if held() {
        return None;
    }
    let mut guard = lock();
    let session = guard.as_mut()?;
    struct Release;
    impl Drop for Release {
        fn drop(&mut self) {
            HELD.with(|h| h.borrow_mut().take());
        }
    }
    HELD.with(|h| {
        *h.borrow_mut() = Some(Held {
            iteration: session.iteration,
            messages: Vec::new(),
        })
    });
    let release = Release;
    let result = f(session);
    let messages = HELD.with(|h| {
        h.borrow_mut()
            .as_mut()
            .map(|h| std::mem::take(&mut h.messages))
    });
    drop(release);
    for message in messages.unwrap_or_default() {
        let _ = session.main_log(&message);
    }
    Some(result)
}

/// Starts the debug session: reads the config (a missing file warns and runs with no features), creates the log
/// files (an unwritable log dir is an error). A second `initialize` before [`end`] is an error.
pub fn initialize(options: DebugOptions) -> Result<(), DebugError> {
    let mut guard = lock_entry("initialize")?;
    if guard.is_some() {
        return Err(DebugError::AlreadyInitialized);
    }
    let mut logs = if options.default_logging_enabled {
        Some(LogFiles::create(&options.log_dir)?)
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
            Some(config)
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
    *guard = Some(Session {
        config,
        iteration: options.init_training_step,
        dump_dir: options.dump_dir.unwrap_or(options.log_dir),
        dump_feeds: BTreeMap::new(),
        logs,
        loggers: options.loggers,
        buffers: StatBuffers::default(),
        layers: BTreeMap::new(),
        logged_calls: BTreeSet::new(),
    });
    ACTIVE.store(true, Ordering::Release);
    Ok(())
}

/// Ends the iteration: reads the step's statistics from the device (one sync), writes them to the statistics log
/// and the stat loggers, and advances the iteration.
pub fn step() -> Result<(), DebugError> {
    let mut guard = lock_entry("step")?;
    let session = guard.as_mut().ok_or(DebugError::NotInitialized)?;
    let result = session.flush();
    session.iteration += 1;
    result
}

/// Ends the session: logs what the current step has buffered, closes the files, forgets the config. `initialize`
/// may be called again afterwards.
pub fn end() -> Result<(), DebugError> {
    let mut guard = lock_entry("end")?;
    let mut session = guard.take().ok_or(DebugError::NotInitialized)?;
    ACTIVE.store(false, Ordering::Release);
    session.flush()
}

/// Sets the current iteration (e.g. when resuming from a checkpoint).
pub fn initialize_training_step(iteration: u64) -> Result<(), DebugError> {
    let mut guard = lock_entry("initialize_training_step")?;
    let session = guard.as_mut().ok_or(DebugError::NotInitialized)?;
    session.iteration = iteration;
    for layer in session.layers.values_mut() {
        layer.skip_until.clear();
    }
    Ok(())
}

/// The current iteration, if a session runs.
pub fn iteration() -> Option<u64> {
    if let Some(iteration) = HELD.with(|h| h.borrow().as_ref().map(|h| h.iteration)) {
        return Some(iteration);
    }
    with_session(|s| s.iteration)
}

/// Writes `message` to the main log (prefixed with `layer: ` when given) and to `tracing`.
pub fn log_message(message: &str, layer: Option<&str>) -> Result<(), DebugError> {
    let message = match layer {
        Some(layer) => format!("{layer}: {message}"),
        None => message.to_string(),
    };
    // From a feature's code: written when the feature returns.
    let queued = HELD.with(|h| match h.borrow_mut().as_mut() {
        Some(held) => {
            held.messages.push(message.clone());
            true
        }
        None => false,
    });
    if queued {
        return Ok(());
    }
    with_session(|s| s.main_log(&message)).ok_or(DebugError::NotInitialized)?
}

/// Checks the config against a model's layer names before training: a layer selected by two sections is an
/// error (TE: "multiple debug configs targeting the same layer").
pub fn check_layers<'a>(layers: impl IntoIterator<Item = &'a str>) -> Result<(), DebugError> {
    with_session(|s| -> Result<(), ConfigError> {
        if let Some(config) = &s.config {
            for layer in layers {
                config.section_for(layer, None)?;
            }
        }
        Ok(())
    })
    .ok_or(DebugError::NotInitialized)?
    .map_err(DebugError::from)
}

/// The stat names (`<layer>_<tensor>_<stat>`, as logged) the config's features log for these layers, in the order
/// given: what a dashboard registers before training (see [`crate::train`]). Schedules are not considered: a name
/// may be logged at some iterations only.
pub fn stat_names<'a>(
    layers: impl IntoIterator<Item = &'a str>,
) -> Result<Vec<String>, DebugError> {
    with_session(|s| -> Result<Vec<String>, ConfigError> {
        let mut names = Vec::new();
        let Some(config) = &s.config else {
            return Ok(names);
        };
        for layer in layers {
            if let Some(section) = config.section_for(layer, None)? {
                for feature in &section.features {
                    for (tensor, stat) in feature.logged_stats() {
                        let name = format!("{layer}_{tensor}_{stat}");
                        if !names.contains(&name) {
                            names.push(name);
                        }
                    }
                }
            }
        }
        Ok(names)
    })
    .ok_or(DebugError::NotInitialized)?
    .map_err(DebugError::from)
}

/// The tensors inspected at a GEMM: each input at its first GEMM (activation and weight at fprop; the gradient at
/// wgrad, which every trainable layer runs), and the GEMM's output.
fn inspected_at(gemm: Gemm) -> &'static [TensorName] {
    match gemm {
        Gemm::Fprop => &[
            TensorName::Activation,
            TensorName::Weight,
            TensorName::Output,
        ],
        Gemm::Dgrad => &[TensorName::Dgrad],
        Gemm::Wgrad => &[TensorName::Gradient, TensorName::Wgrad],
    }
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
        let (values, errors) = self.buffers.flush();
        for error in &errors {
            tracing::error!("{error}");
            let _ = self.main_log(&format!("statistics not read back: {error}"));
        }
        let mut result = if errors.is_empty() {
            Ok(())
        } else {
            Err(DebugError::StatsRead {
                iteration: self.iteration,
                errors,
            })
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

    fn section(&mut self, site: &GemmSite) -> Option<(usize, &Section)> {
        let config = self.config.as_ref()?;
        let state = self.layers.get(&site.layer)?;
        state.section.map(|i| (i, &config.sections[i]))
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

    /// The routing of one GEMM: whether it runs in FP8, which inputs are modified and which tensors inspected.
    fn route(&mut self, site: &GemmSite) -> Result<(GemmPlan, Option<u64>), DebugError> {
        let iteration = self.iteration;
        let (layer, gemm) = (&*site.layer, site.gemm);
        let Some((_, section)) = self.section(site) else {
            let plan = GemmPlan {
                fp8: true,
                modify: [None, None],
                inspect: Vec::new(),
            };
            return Ok((plan, None));
        };
        let mut answers = Vec::new();
        let fp8 = merge_routing(
            section
                .features
                .iter()
                .filter_map(|f| f.fp8_gemm_enabled(layer, gemm, iteration)),
        );
        answers.extend(fp8);
        let (lhs, rhs) = gemm.operands();
        let mut modify = [None, None];
        for (slot, role) in [lhs, rhs].into_iter().enumerate() {
            let tensor = TensorName::from(role);
            for (index, feature) in section.features.iter().enumerate() {
                if let Some(routing) = feature.modify_tensor_enabled(layer, gemm, tensor, iteration)
                {
                    answers.push(routing);
                    if routing.enabled {
                        if let Some(first) = modify[slot] {
                            let first: usize = first;
                            return Err(DebugError::ConflictingModify {
                                layer: layer.into(),
                                gemm: gemm.name().into(),
                                tensor: tensor.name().into(),
                                first: section.features[first].name().into(),
                                second: feature.name().into(),
                            });
                        }
                        modify[slot] = Some(index);
                    }
                }
            }
        }
        let mut inspect = Vec::new();
        for &tensor in inspected_at(gemm) {
            let routing = merge_routing(
                section
                    .features
                    .iter()
                    .filter_map(|f| f.inspect_tensor_enabled(layer, tensor, iteration)),
            );
            if let Some(routing) = routing {
                answers.push(routing);
                if routing.enabled {
                    inspect.push(tensor);
                }
            }
        }
        let plan = GemmPlan {
            fp8: fp8.is_none_or(|r| r.enabled),
            modify,
            inspect,
        };
        let next = merge_routing(answers).and_then(|r| r.next);
        Ok((plan, next))
    }

    /// The plan of a GEMM call, or `None` for the plain path (no active feature until a later iteration).
    pub(crate) fn plan(&mut self, site: &GemmSite, fp8_scope: bool) -> Option<GemmPlan> {
        let iteration = self.iteration;
        let state = self.layer_state(site);
        if state
            .skip_until
            .get(&site.gemm)
            .is_some_and(|&until| iteration < until)
        {
            return None;
        }
        if site.gemm == Gemm::Fprop {
            self.log_plan(site, fp8_scope);
        }
        let (plan, next) = match self.route(site) {
            Ok(routed) => routed,
            Err(err) => {
                let message = format!("{err}; the GEMM runs unmodified");
                tracing::error!("{message}");
                let _ = self.main_log(&message);
                return None;
            }
        };
        let active =
            !plan.fp8 || plan.modify.iter().any(Option::is_some) || !plan.inspect.is_empty();
        if active {
            Some(plan)
        } else {
            let until = next.unwrap_or(u64::MAX);
            self.layer_state(site).skip_until.insert(site.gemm, until);
            None
        }
    }

    /// Logs the layer's per-tensor plan (FP8, high precision or modified) when it changes.
    fn log_plan(&mut self, site: &GemmSite, fp8_scope: bool) {
        let mut lines = Vec::new();
        for (tensor, gemms) in [
            (TensorName::Activation, [Gemm::Fprop, Gemm::Wgrad]),
            (TensorName::Weight, [Gemm::Fprop, Gemm::Dgrad]),
            (TensorName::Gradient, [Gemm::Dgrad, Gemm::Wgrad]),
        ] {
            for gemm in gemms {
                let routed = self.route(&site.with_gemm(gemm)).ok();
                let slot = usize::from(Some(gemm.operands().1) == tensor.role());
                let how = match routed {
                    Some((plan, _)) if plan.modify[slot].is_some() => "modify_tensor()",
                    Some((plan, _)) if plan.fp8 && fp8_scope => "FP8 quantization",
                    None if fp8_scope => "FP8 quantization",
                    _ => "High precision",
                };
                lines.push(format!(
                    "{}: Tensor: {tensor}, gemm {} - {how}",
                    site.layer,
                    gemm.name()
                ));
            }
        }
        if self.layer_state(site).plan_lines != lines {
            for line in &lines {
                let _ = self.main_log(line);
            }
            self.layer_state(site).plan_lines = lines;
        }
    }

    /// Runs the inspecting features of `tensor` and buffers their statistics.
    pub(crate) fn inspect(&mut self, site: &GemmSite, tensor: TensorName, x: &dyn DebugTensor) {
        let iteration = self.iteration;
        let layer = site.layer.clone();
        let Some((_, section)) = self.section(site) else {
            return;
        };
        let mut inspection = Inspection::default();
        let mut calls = Vec::new();
        let mut errors = Vec::new();
        for feature in &section.features {
            if feature
                .inspect_tensor_enabled(&layer, tensor, iteration)
                .is_some_and(|r: Routing| r.enabled)
            {
                calls.push(format!(
                    "{layer}: Feature={}, API=inspect_tensor: {tensor}",
                    feature.name()
                ));
                if let Err(err) =
                    feature.inspect_tensor(&layer, tensor, x, iteration, &mut inspection)
                {
                    errors.push(err.to_string());
                }
            }
        }
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
            0,
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

    /// Runs the feature at `index` of the layer's section on an input.
    pub(crate) fn modify(
        &mut self,
        site: &GemmSite,
        index: usize,
        tensor: TensorName,
        x: &dyn DebugTensor,
    ) -> Result<Modified, DebugError> {
        let iteration = self.iteration;
        let Some((_, section)) = self.section(site) else {
            return Err(DebugError::NotInitialized);
        };
        let feature = &section.features[index];
        let call = format!(
            "{}: Feature={}, API=modify_tensor: {tensor}, gemm {}",
            site.layer,
            feature.name(),
            site.gemm.name()
        );
        let result = feature.modify_tensor(&site.layer, site.gemm, tensor, x, iteration);
        self.log_once(call);
        result
    }
}
