//! Diagnostics, after torch-xla's debugging toolbox: "where does the time go", "which op produced the NaN", "give
//! me the exact tensors of the failing step". All of it lives in the [`Te<B>`](crate::Te) decorator, which sees
//! every op the model issues, so it works on every inner backend (wgpu, CUDA, Burn's fused backends, the host path).
//!
//! - [`metrics_report`]: counters (every op by name as `burn::<op>`, GEMMs by precision, fallbacks by reason,
//!   kernel launches, device↔host transfers) and metrics (step time, read-back time, transfer sizes, GEMM execute
//!   time) in torch-xla's layout. On by default.
//! - [`add_step_closure`] / [`print_at_step`]: tensors read back together at [`step`], the step's one sync.
//! - Eager debug mode ([`DiagnosticsConfig::eager`] or `BURN_TE_EAGER_DEBUG_MODE=1`): every op is synced and its
//!   output checked as it is issued; the first device error or non-finite value is reported at the op that made it.
//! - First non-finite origin ([`DiagnosticsConfig::track_non_finite`]): at [`step`], the layer, GEMM and tensor that
//!   first held a NaN/Inf that step, in execution order, with no extra sync.
//! - Traces ([`start_trace`], [`trace`]): Chrome/Perfetto trace-event JSON of user spans, layer GEMMs and debug
//!   features.
//! - Snapshots ([`SnapshotConfig`]): the GEMM inputs and outputs of chosen steps, and of the step with the first
//!   non-finite value, as safetensors with a JSON manifest.
//!
//! ```no_run
//! use burn_te::diagnostics::{self, DiagnosticsConfig};
//! diagnostics::configure(DiagnosticsConfig::new().with_track_non_finite(true)).unwrap();
//! for _ in 0..3 {
//!     // forward, backward, optimizer step on Autodiff<Te<B>> ...
//!     diagnostics::step().unwrap(); // or burn_te_debug::step(), which calls it
//! }
//! println!("{}", diagnostics::metrics_report());
//! ```

mod closures;
mod eager;
mod nonfinite;
mod observe;
mod snapshot;
mod trace;

use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

use burn::config::Config;

use crate::settings::setting::{Setting, flag};

pub use crate::metrics::{
    KEPT_SAMPLES, MetricData, MetricUnit, PERCENTILES, clear_all, counter_names, counter_value,
    format_bytes, format_time, increment_counter, metric_data, metric_names, metrics_report, names,
    percentile, record_metric, record_time, short_metrics_report, thread_counter_value,
    thread_metric_data,
};
pub use closures::{add_step_closure, print_at_step};
pub use nonfinite::{NonFiniteOrigin, OriginTensor, clear_non_finite, first_non_finite};
pub use snapshot::{SnapshotChoice, SnapshotConfig, set_snapshot_filter, snapshot_dir};
pub use trace::{TraceGuard, label_layer, start_trace, trace, trace_layer};

#[doc(hidden)]
pub use observe::{
    count_transfer_from_device, count_transfer_to_device, gemm_span, observe_gemm,
    observes_each_gemm, op_finished, op_started, tensor_bytes,
};

/// What happens at the first non-finite value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum OnNonFinite {
    /// Report it (a `tracing` error, [`first_non_finite`], the metrics report) and go on.
    #[default]
    Continue,
    /// Stop training: in eager mode a panic at the op with the report (an op cannot return an error); otherwise
    /// [`step`] returns [`DiagnosticsError::NonFinite`] after logging and snapshotting the step.
    Stop,
}

/// The diagnostics settings, as a Burn config (save it beside the run's other configs).
#[derive(Config, Debug)]
pub struct DiagnosticsConfig {
    /// Count ops, GEMMs, launches and transfers, and record the metrics.
    #[config(default = true)]
    pub counters: bool,
    /// Eager debug mode: sync after every op and check its output (also on with `BURN_TE_EAGER_DEBUG_MODE=1`).
    #[config(default = false)]
    pub eager: bool,
    /// Track which GEMM tensor first held a NaN/Inf each step, reported at [`step`] (one statistics pass per GEMM
    /// operand and output, read at the step's sync).
    #[config(default = false)]
    pub track_non_finite: bool,
    /// What to do at the first non-finite value.
    #[config(default = "OnNonFinite::Continue")]
    pub on_non_finite: OnNonFinite,
    /// Sync before and after each layer GEMM to record its execute time (`GemmExecuteTime`) and give its trace span
    /// the device time (always on in eager mode).
    #[config(default = false)]
    pub device_time: bool,
    /// GEMM snapshots (`None`: none).
    #[config(default = "None")]
    pub snapshot: Option<SnapshotConfig>,
}

/// Diagnostics errors.
#[derive(Debug, thiserror::Error)]
pub enum DiagnosticsError {
    /// A non-finite value appeared and [`OnNonFinite::Stop`] was chosen.
    #[error("training stopped at the first non-finite value: {0}")]
    NonFinite(NonFiniteOrigin),
    /// A file could not be written.
    #[error("{path}: {message}")]
    Io {
        /// The file or directory.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// A tensor could not be read back.
    #[error("reading a tensor back: {0}")]
    Read(String),
}

/// The effective settings, read on the hot path without a lock.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Flags {
    pub eager: bool,
    pub track_non_finite: bool,
    pub device_time: bool,
    pub stop: bool,
    pub snapshots: bool,
}

impl Flags {
    fn of(config: &DiagnosticsConfig) -> Self {
        let snapshot = config.snapshot.as_ref();
        Flags {
            eager: config.eager || eager_from_env(),
            track_non_finite: config.track_non_finite || snapshot.is_some_and(|s| s.on_non_finite),
            device_time: config.device_time,
            stop: config.on_non_finite == OnNonFinite::Stop,
            snapshots: snapshot.is_some_and(|s| s.ranks.is_empty() || s.ranks.contains(&rank())),
        }
    }

    fn pack(self) -> u8 {
        [
            self.eager,
            self.track_non_finite,
            self.device_time,
            self.stop,
            self.snapshots,
        ]
        .iter()
        .enumerate()
        .fold(0, |bits, (k, on)| bits | (u8::from(*on) << k))
    }

    fn unpack(bits: u8) -> Self {
        let on = |k: u8| bits & (1 << k) != 0;
        Flags {
            eager: on(0),
            track_non_finite: on(1),
            device_time: on(2),
            stop: on(3),
            snapshots: on(4),
        }
    }
}

/// The process's settings, packed.
static GLOBAL_FLAGS: AtomicU8 = AtomicU8::new(0);

thread_local! {
    /// This thread's settings when [`configure_thread`] set them.
    static THREAD_FLAGS: Cell<Option<Flags>> = const { Cell::new(None) };
    /// This thread's iteration.
    static ITERATION: Cell<u64> = const { Cell::new(0) };
    /// When this thread's last step ended.
    static LAST_STEP: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// The settings in effect on this thread.
#[inline]
pub(crate) fn flags() -> Flags {
    read_env();
    THREAD_FLAGS
        .with(Cell::get)
        .unwrap_or_else(|| Flags::unpack(GLOBAL_FLAGS.load(Ordering::Relaxed)))
}

static ENV_READ: std::sync::Once = std::sync::Once::new();

/// The environment variable that turns eager debug mode on (`1`, `true`), like Neuron's
/// `NEURON_USE_EAGER_DEBUG_MODE`.
pub const EAGER_ENV: &str = "BURN_TE_EAGER_DEBUG_MODE";

/// `BURN_TE_EAGER_DEBUG_MODE`: a flag (`1`/`true` on, `0`/`false` off).
pub const EAGER: Setting<bool> = Setting {
    name: EAGER_ENV,
    takes: "1, true, 0, false",
    otherwise: "off",
    parse: flag,
};

/// Whether `BURN_TE_EAGER_DEBUG_MODE` switches eager mode on (read once).
fn eager_from_env() -> bool {
    static EAGER_ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *EAGER_ON.get_or_init(|| EAGER.read().unwrap_or(false))
}

/// Reads the environment once (eager mode can be switched on without code changes).
#[inline]
pub(crate) fn read_env() {
    ENV_READ.call_once(|| {
        if eager_from_env() {
            GLOBAL_FLAGS.fetch_or(1, Ordering::Relaxed);
        }
    });
}

/// Applies `config` to the process: counters, eager mode (the environment variable still switches it on), non-finite
/// tracking, device time, snapshots. What the current step has pending is kept.
pub fn configure(config: DiagnosticsConfig) -> Result<(), DiagnosticsError> {
    read_env();
    crate::metrics::set_enabled(config.counters);
    GLOBAL_FLAGS.store(Flags::of(&config).pack(), Ordering::Relaxed);
    snapshot::configure(config.snapshot)
}

/// Applies `config` to this thread only (e.g. eager mode on one data-parallel peer's thread), over the process's
/// settings; the counters switch and the snapshot settings stay process-wide. [`clear_thread_config`] undoes it.
pub fn configure_thread(config: DiagnosticsConfig) -> Result<(), DiagnosticsError> {
    read_env();
    THREAD_FLAGS.with(|f| f.set(Some(Flags::of(&config))));
    match config.snapshot {
        Some(snapshot) => snapshot::configure(Some(snapshot)),
        None => Ok(()),
    }
}

/// Makes this thread follow the process's settings again.
pub fn clear_thread_config() {
    THREAD_FLAGS.with(|f| f.set(None));
}

/// Whether eager debug mode is on.
pub fn eager_mode() -> bool {
    flags().eager
}

/// This thread's iteration (the number of [`step`]s it made, or what [`set_iteration`] set).
pub fn iteration() -> u64 {
    ITERATION.with(Cell::get)
}

/// Sets this thread's iteration (e.g. when resuming, or to follow the debug tools' iteration).
pub fn set_iteration(iteration: u64) {
    ITERATION.with(|i| i.set(iteration));
}

/// This thread's rank: its bound peer's (`burn_te::distributed`), else the `RANK` environment variable (as torchrun
/// sets it), else 0.
pub fn rank() -> usize {
    #[cfg(feature = "distributed")]
    return crate::distributed::rank();
    #[cfg(not(feature = "distributed"))]
    std::env::var("RANK")
        .ok()
        .and_then(|r| r.trim().parse().ok())
        .unwrap_or(0)
}

/// Ends this thread's iteration (the step state — closures, checks, held snapshots — belongs to the thread that
/// issued the step's ops and calls `step`): records the step time, reads the step's closures and non-finite counts back together (the
/// step's one sync), reports where the first non-finite value appeared, writes the step's snapshots, and advances
/// the iteration. With [`OnNonFinite::Stop`], a non-finite value returns [`DiagnosticsError::NonFinite`] — after
/// everything above is done.
pub fn step() -> Result<(), DiagnosticsError> {
    let now = Instant::now();
    if let Some(previous) = LAST_STEP.with(|last| last.replace(Some(now))) {
        record_time(names::STEP_TIME, now.duration_since(previous));
    }
    let iteration = iteration();
    let closures = closures::run_pending();
    let origin = nonfinite::resolve(iteration);
    record_time(names::STEP_SYNC_TIME, now.elapsed());
    let snapshots = snapshot::finish_step(iteration, origin.as_ref());
    set_iteration(iteration + 1);
    closures?;
    snapshots?;
    match origin {
        Some(origin) if flags().stop => Err(DiagnosticsError::NonFinite(origin)),
        _ => Ok(()),
    }
}
