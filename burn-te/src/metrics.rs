//! Counters and metrics in the layout of torch-xla's `torch_xla.debug.metrics`.
//!
//! A *counter* is a number that only grows (ops issued by name, GEMMs by precision, kernel launches, transfers); a
//! *metric* keeps samples (step time, read-back time, transfer sizes, GEMM execute time) and reports their count,
//! sum, rates and percentiles. [`metrics_report`] prints both as torch-xla does:
//!
//! ```text
//! Metric: StepTime
//!   TotalSamples: 3
//!   Accumulator: 186ms062.970us
//!   ValueRate: 549ms937.108us / second
//!   Rate: 10.8372 / second
//!   Percentiles: 1%=…; 5%=…; 10%=…; 20%=…; 50%=…; 80%=…; 90%=…; 95%=…; 99%=…
//! Counter: burn::float_add
//!   Value: 7
//! ```
//!
//! Each thread records into its own registry (a data-parallel peer's thread can read its own counts with
//! [`thread_counter_value`]); the report sums all threads. Recording is a lock of an uncontended mutex and a
//! hash-map update, cheap enough to leave on (`benches/
//! debug_overhead.rs` measures it); `DiagnosticsConfig::counters` turns it off.
//!
//! This registry is the one interface between the FP8 ops and the diagnostics: the backends, GEMMs and fallbacks
//! record into it, and `diagnostics` reads it; neither imports the other.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a metric's values print.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricUnit {
    /// Nanoseconds, printed as torch-xla prints durations (`186ms062.970us`).
    Time,
    /// Bytes, printed in binary units (`4.00MB`).
    Bytes,
    /// Plain numbers (`9.00`).
    Number,
}

/// The samples of one metric, as [`metric_data`] returns them.
#[derive(Clone, Debug, PartialEq)]
pub struct MetricData {
    /// How the values print.
    pub unit: MetricUnit,
    /// Samples recorded since the last [`clear_all`] (all of them, including those no longer kept).
    pub total_samples: u64,
    /// The sum of all samples (nanoseconds for [`MetricUnit::Time`]).
    pub accumulator: f64,
    /// The most recent samples (at most [`KEPT_SAMPLES`]), oldest first: when each was recorded and its value.
    pub samples: Vec<(Instant, f64)>,
}

/// How many recent samples a metric keeps for its rates and percentiles (torch-xla keeps 1024).
pub const KEPT_SAMPLES: usize = 1024;

/// The percentiles the report prints.
pub const PERCENTILES: [f64; 9] = [1.0, 5.0, 10.0, 20.0, 50.0, 80.0, 90.0, 95.0, 99.0];

#[derive(Default)]
struct Registry {
    /// Ops as the decorator sees them, by their static name (no allocation on the hot path).
    ops: HashMap<&'static str, u64>,
    counters: HashMap<String, u64>,
    metrics: HashMap<String, MetricData>,
}

impl Registry {
    /// Adds `other`'s counts and samples into `self` (samples merged in time order, the newest kept).
    fn merge(&mut self, other: &Registry) {
        for (op, value) in &other.ops {
            *self.ops.entry(op).or_insert(0) += value;
        }
        for (name, value) in &other.counters {
            *self.counters.entry(name.clone()).or_insert(0) += value;
        }
        for (name, data) in &other.metrics {
            match self.metrics.get_mut(name) {
                None => {
                    self.metrics.insert(name.clone(), data.clone());
                }
                Some(metric) => {
                    metric.total_samples += data.total_samples;
                    metric.accumulator += data.accumulator;
                    metric.samples.extend(data.samples.iter().copied());
                    metric.samples.sort_by_key(|(at, _)| *at);
                    let excess = metric.samples.len().saturating_sub(KEPT_SAMPLES);
                    metric.samples.drain(..excess);
                }
            }
        }
    }

    fn counter(&self, name: &str) -> Option<u64> {
        match name.strip_prefix(OP_PREFIX) {
            Some(op) if self.ops.contains_key(op) => self.ops.get(op).copied(),
            _ => self.counters.get(name).copied(),
        }
    }
}

type Shared = Arc<Mutex<Registry>>;

static ENABLED: AtomicBool = AtomicBool::new(true);
/// Every thread's registry (kept after the thread ends, so its counts stay in the report).
static THREADS: Mutex<Vec<Shared>> = Mutex::new(Vec::new());

thread_local! {
    /// This thread's registry: recording locks only it (uncontended), the report sums all.
    static LOCAL: Shared = {
        let registry = Shared::default();
        THREADS.lock().unwrap_or_else(|p| p.into_inner()).push(registry.clone());
        registry
    };
}

fn with_local<T>(f: impl FnOnce(&mut Registry) -> T) -> T {
    LOCAL.with(|r| f(&mut r.lock().unwrap_or_else(|p| p.into_inner())))
}

/// All threads' counts and samples, merged.
fn merged() -> Registry {
    let threads: Vec<Shared> = THREADS.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut all = Registry::default();
    for registry in threads {
        all.merge(&registry.lock().unwrap_or_else(|p| p.into_inner()));
    }
    all
}

/// Whether counters and metrics record (on by default).
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

pub(crate) fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// The prefix of the counters of ops as the decorator sees them (`burn::float_add`), the analogue of torch-xla's
/// `xla::addmm`.
pub const OP_PREFIX: &str = "burn::";

/// Counts one op issued through `Te<B>`.
#[inline]
pub(crate) fn count_op(op: &'static str) {
    if enabled() {
        with_local(|r| *r.ops.entry(op).or_insert(0) += 1);
    }
}

/// Adds `by` to the counter `name`.
pub fn increment_counter(name: &str, by: u64) {
    if !enabled() {
        return;
    }
    with_local(|r| match r.counters.get_mut(name) {
        Some(value) => *value += by,
        None => {
            r.counters.insert(name.to_string(), by);
        }
    });
}

/// Records one sample of the metric `name`.
pub fn record_metric(name: &str, unit: MetricUnit, value: f64) {
    if !enabled() {
        return;
    }
    let now = Instant::now();
    with_local(|r| {
        let metric = r
            .metrics
            .entry(name.to_string())
            .or_insert_with(|| MetricData {
                unit,
                total_samples: 0,
                accumulator: 0.0,
                samples: Vec::new(),
            });
        metric.total_samples += 1;
        metric.accumulator += value;
        if metric.samples.len() == KEPT_SAMPLES {
            metric.samples.remove(0);
        }
        metric.samples.push((now, value));
    });
}

/// Records a duration sample of the metric `name`.
pub fn record_time(name: &str, duration: Duration) {
    record_metric(name, MetricUnit::Time, duration.as_nanos() as f64);
}

/// The names of the counters with a value, sorted (ops as `burn::<op>`).
pub fn counter_names() -> Vec<String> {
    let all = merged();
    let mut names: Vec<String> = all
        .ops
        .keys()
        .map(|op| format!("{OP_PREFIX}{op}"))
        .chain(all.counters.keys().cloned())
        .collect();
    names.sort();
    names
}

/// The value of the counter `name` over all threads (`None` if it never counted).
pub fn counter_value(name: &str) -> Option<u64> {
    merged().counter(name)
}

/// The value of the counter `name` on this thread only (e.g. one data-parallel peer's thread).
pub fn thread_counter_value(name: &str) -> Option<u64> {
    with_local(|r| r.counter(name))
}

/// The names of the metrics with samples, sorted.
pub fn metric_names() -> Vec<String> {
    let mut names: Vec<String> = merged().metrics.keys().cloned().collect();
    names.sort();
    names
}

/// The samples of the metric `name` over all threads (`None` if it has none).
pub fn metric_data(name: &str) -> Option<MetricData> {
    merged().metrics.get(name).cloned()
}

/// The samples of the metric `name` recorded on this thread.
pub fn thread_metric_data(name: &str) -> Option<MetricData> {
    with_local(|r| r.metrics.get(name).cloned())
}

/// Forgets every counter and metric, of every thread.
pub fn clear_all() {
    let threads: Vec<Shared> = THREADS.lock().unwrap_or_else(|p| p.into_inner()).clone();
    for registry in threads {
        *registry.lock().unwrap_or_else(|p| p.into_inner()) = Registry::default();
    }
}

/// The value at percentile `p` (0–100) of `sorted` by the nearest-rank rule: the smallest value with at least
/// `p`% of the samples at or below it (`None` for no samples).
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// A duration in nanoseconds as torch-xla prints it: the units from the largest nonzero one down, each but the
/// first zero-padded (`09s969ms486.408us`, `186ms062.970us`, `108.403us`).
pub fn format_time(nanos: f64) -> String {
    let total = nanos.max(0.0).round() as u128;
    const UNITS: [(&str, u128, usize); 5] = [
        ("d", 86_400_000_000_000, 2),
        ("h", 3_600_000_000_000, 2),
        ("m", 60_000_000_000, 2),
        ("s", 1_000_000_000, 2),
        ("ms", 1_000_000, 3),
    ];
    let mut out = String::new();
    let mut rest = total;
    for (suffix, scale, width) in UNITS {
        let value = rest / scale;
        if value > 0 || !out.is_empty() {
            let _ = write!(out, "{value:0width$}{suffix}");
            rest %= scale;
        }
    }
    let _ = write!(out, "{:03}.{:03}us", rest / 1000, rest % 1000);
    out
}

/// Bytes in binary units with two decimals (`512.00B`, `4.00MB`), as torch-xla prints sizes.
pub fn format_bytes(bytes: f64) -> String {
    const UNITS: [&str; 6] = ["B", "KB", "MB", "GB", "TB", "PB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2}{}", UNITS[unit])
}

/// A value in a metric's unit.
fn format_value(unit: MetricUnit, value: f64) -> String {
    match unit {
        MetricUnit::Time => format_time(value),
        MetricUnit::Bytes => format_bytes(value),
        MetricUnit::Number => format!("{value:.2}"),
    }
}

/// A rate with six significant digits, as C++ streams print doubles (`108.372`, `0.665369`).
fn format_rate(value: f64) -> String {
    if value == 0.0 || !value.is_finite() {
        return format!("{value}");
    }
    let digits = 6 - 1 - value.abs().log10().floor() as i32;
    let text = format!("{:.*}", digits.max(0) as usize, value);
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

/// One metric's block of the report.
fn metric_block(out: &mut String, name: &str, data: &MetricData) {
    let _ = writeln!(out, "Metric: {name}");
    let _ = writeln!(out, "  TotalSamples: {}", data.total_samples);
    let _ = writeln!(
        out,
        "  Accumulator: {}",
        format_value(data.unit, data.accumulator)
    );
    if let (Some(first), Some(last)) = (data.samples.first(), data.samples.last()) {
        let window = last.0.duration_since(first.0).as_secs_f64();
        if data.samples.len() > 1 && window > 0.0 {
            let sum: f64 = data.samples.iter().map(|(_, v)| v).sum();
            let _ = writeln!(
                out,
                "  ValueRate: {} / second",
                format_value(data.unit, sum / window)
            );
            let _ = writeln!(
                out,
                "  Rate: {} / second",
                format_rate(data.samples.len() as f64 / window)
            );
        }
    }
    let mut sorted: Vec<f64> = data.samples.iter().map(|(_, v)| *v).collect();
    sorted.sort_by(f64::total_cmp);
    let percentiles: Vec<String> = PERCENTILES
        .iter()
        .filter_map(|&p| {
            percentile(&sorted, p).map(|v| format!("{p}%={}", format_value(data.unit, v)))
        })
        .collect();
    if !percentiles.is_empty() {
        let _ = writeln!(out, "  Percentiles: {}", percentiles.join("; "));
    }
}

fn counter_block(out: &mut String, name: &str, value: u64) {
    let _ = writeln!(out, "Counter: {name}\n  Value: {value}");
}

/// The metrics named `keep` (all of them for `None`) and the counters whose name passes `keep_counter`, as text.
fn report(keep: Option<&[&str]>, keep_counter: impl Fn(&str) -> bool) -> String {
    let r = merged();
    let (metrics, counters) = {
        let mut metrics: Vec<(String, MetricData)> = r
            .metrics
            .iter()
            .filter(|(name, _)| keep.is_none_or(|keep| keep.contains(&name.as_str())))
            .map(|(n, d)| (n.clone(), d.clone()))
            .collect();
        metrics.sort_by(|a, b| a.0.cmp(&b.0));
        let mut counters: Vec<(String, u64)> = r
            .ops
            .iter()
            .map(|(op, v)| (format!("{OP_PREFIX}{op}"), *v))
            .chain(r.counters.iter().map(|(n, v)| (n.clone(), *v)))
            .filter(|(name, _)| keep_counter(name))
            .collect();
        counters.sort();
        (metrics, counters)
    };
    let mut out = String::new();
    for (name, data) in &metrics {
        metric_block(&mut out, name, data);
    }
    for (name, value) in counters {
        counter_block(&mut out, &name, value);
    }
    out
}

/// Every metric and counter in torch-xla's layout: `Metric:` blocks (sorted by name), then `Counter:` blocks.
pub fn metrics_report() -> String {
    report(None, |_| true)
}

/// The metrics and counters that answer "is the step healthy": step, read-back and GEMM times, GEMMs by precision
/// and by the path they ran on (`DeviceFp8Gemm(cublaslt)`, `HostFp8Gemm(avx2fma)`), fallbacks, non-finite values and
/// transfers (torch-xla's `short_metrics_report`).
pub fn short_metrics_report() -> String {
    report(
        Some(&[
            names::STEP_TIME,
            names::READ_BACK_TIME,
            names::GEMM_EXECUTE_TIME,
        ]),
        |name| {
            name.starts_with("Gemm")
                || name.starts_with("DeviceFp8Gemm")
                || name.starts_with("HostFp8Gemm")
                || name.starts_with("NonFinite")
                || name.starts_with("DeviceToHost")
                || name.starts_with("HostToDevice")
        },
    )
}

/// Counts one kernel launch (or host pass) of the FP8 ops.
#[inline]
pub(crate) fn count_launch(name: &str) {
    increment_counter(name, 1);
}

/// The names of the counters and metrics this crate records (the ops are `burn::<op>`).
pub mod names {
    /// Metric: the time between two `diagnostics::step`s.
    pub const STEP_TIME: &str = "StepTime";
    /// Metric: the time of each device→host read (`into_data`), from its first poll to its data.
    pub const READ_BACK_TIME: &str = "ReadBackTime";
    /// Metric: the bytes of each device→host read.
    pub const TRANSFER_FROM_DEVICE_SIZE: &str = "TransferFromDeviceSize";
    /// Metric: the bytes of each host→device write.
    pub const TRANSFER_TO_DEVICE_SIZE: &str = "TransferToDeviceSize";
    /// Metric: a layer GEMM's execute time, synced before and after (eager mode or `device_time`).
    pub const GEMM_EXECUTE_TIME: &str = "GemmExecuteTime";
    /// Metric: the time `diagnostics::step` spends reading the step's closures and non-finite counts.
    pub const STEP_SYNC_TIME: &str = "StepSyncTime";
    /// Counter: device→host reads.
    pub const DEVICE_TO_HOST_READS: &str = "DeviceToHostReads";
    /// Counter: bytes read device→host.
    pub const DEVICE_TO_HOST_BYTES: &str = "DeviceToHostBytes";
    /// Counter: host→device writes.
    pub const HOST_TO_DEVICE_WRITES: &str = "HostToDeviceWrites";
    /// Counter: bytes written host→device.
    pub const HOST_TO_DEVICE_BYTES: &str = "HostToDeviceBytes";
    /// Counter: GEMMs that ran in FP8.
    pub const GEMM_FP8: &str = "GemmFp8";
    /// Counter prefix: layer GEMMs that ran in FP8, by recipe (`GemmRecipe(nvfp4)`); under a recipe plan also by
    /// site, high precision included (`GemmRecipe(layers.0.fc1.fprop=mxfp8)`).
    pub const GEMM_RECIPE: &str = "GemmRecipe";
    /// Counter: GEMMs that ran in high precision by choice (no recipe, or a debug feature).
    pub const GEMM_HIGH_PRECISION: &str = "GemmHighPrecision";
    /// Counter prefix: GEMMs that were to run in FP8 and fell back to high precision, by reason
    /// (`GemmFallback(shape)`).
    pub const GEMM_FALLBACK: &str = "GemmFallback";
    /// Counter: FP8 quantize kernel launches (host path: quantize passes; a norm or activation that writes its
    /// output in FP8 counts as one).
    pub const QUANTIZE_LAUNCHES: &str = "QuantizeLaunches";
    /// Bytes of the operands FP8 layers kept quantized for their backward (see `saved`).
    pub const KEPT_FP8_BYTES: &str = "KeptForBackwardFp8Bytes";
    /// Inputs an FP8 layer kept in high precision for its backward (a debug feature or `save_original_operands`
    /// asked, or the forward fell back to high precision).
    pub const KEPT_HIGH_PRECISION: &str = "KeptForBackwardHighPrecision";
    /// Counter: fused LayerNorm/RMSNorm forwards (`fused::norm`; the host path).
    pub const FUSED_NORM: &str = "FusedNorm";
    /// Counter: norms whose output the GEMM that follows took in FP8 straight from the norm's pass
    /// (`TeBackend::te_cast_linear`: a `LayerNormLinear`/`LayerNormMLP` under DelayedScaling on the host path).
    pub const FUSED_NORM_CAST: &str = "FusedNormCast";
    /// Counter: MLP activations whose output FC2 took in FP8 straight from the activation's pass
    /// (`TeBackend::te_cast_linear`: a `LayerNormMLP` under DelayedScaling on the host path).
    pub const FUSED_ACTIVATION_CAST: &str = "FusedActivationCast";
    /// Counter: fused LayerNorm/RMSNorm backwards.
    pub const FUSED_NORM_BACKWARD: &str = "FusedNormBackward";
    /// Counter: fused MLP activation forwards (`fused::activation`; the host path).
    pub const FUSED_ACTIVATION: &str = "FusedActivation";
    /// Counter: fused MLP activation backwards.
    pub const FUSED_ACTIVATION_BACKWARD: &str = "FusedActivationBackward";
    /// Counter: fused attention softmax forwards (`fused::softmax`; the host path).
    pub const FUSED_SOFTMAX: &str = "FusedSoftmax";
    /// Counter: fused attention softmax backwards.
    pub const FUSED_SOFTMAX_BACKWARD: &str = "FusedSoftmaxBackward";
    /// Counter: fused dropout forwards (`fused::dropout`, the mask drawn from a seed; the host path).
    pub const FUSED_DROPOUT: &str = "FusedDropout";
    /// Counter: fused dropout backwards.
    pub const FUSED_DROPOUT_BACKWARD: &str = "FusedDropoutBackward";
    /// Counter: fprop biases added row by row on every core (`TeBackend::te_add_bias` on a host backend).
    pub const FUSED_BIAS: &str = "FusedBias";
    /// Counter: bias gradients summed in blocks of columns on every core (`TeBackend::te_bias_grad` on a host
    /// backend).
    pub const FUSED_BIAS_GRAD: &str = "FusedBiasGrad";
    /// Counter: strided views copied row-major on every core for a reshape or a slice assign (`TeBackend::te_reshape`,
    /// `te_slice_assign`) or for a host kernel that reads contiguous values (Flex on the host path).
    pub const HOST_LAYOUT_COPIES: &str = "HostLayoutCopies";
    /// Counter: Adam steps of one parameter fused into one pass (`optim::FusedAdam` on a host backend).
    pub const FUSED_ADAM: &str = "FusedAdam";
    /// Counter: `optim::FusedAdam` steps that ran Burn's composed `Adam` (no fused kernel on the backend).
    pub const COMPOSED_ADAM: &str = "ComposedAdam";
    /// Counter: fused attention cores (`fused::attention`; the host path).
    pub const FUSED_ATTENTION: &str = "FusedAttention";
    /// Counter: fused attention core backwards.
    pub const FUSED_ATTENTION_BACKWARD: &str = "FusedAttentionBackward";
    /// Counter: FP8 GEMM kernel launches.
    pub const FP8_GEMM_LAUNCHES: &str = "Fp8GemmLaunches";
    /// Counter: shape classes the device FP8 GEMM's autotune measured (`cube::gemm_tune`).
    pub const DEVICE_GEMM_TUNINGS: &str = "DeviceFp8GemmTunings";
    /// Counter: amax kernel launches.
    pub const AMAX_LAUNCHES: &str = "AmaxLaunches";
    /// Counter: statistics kernel launches.
    pub const STATS_LAUNCHES: &str = "StatsLaunches";
    /// Counter: ops whose output held a NaN or an infinity (eager mode).
    pub const NON_FINITE_OUTPUTS: &str = "NonFiniteOutputs";
    /// Counter: tensors checked for NaN/inf by the origin tracking (one count launch each).
    pub const NON_FINITE_CHECKS: &str = "NonFiniteChecks";
    /// Counter: GEMM operands the origin tracking did not check again because an earlier GEMM of the same layer
    /// checked the same tensor this step (the weight at dgrad, the activation at wgrad, the output gradient at the
    /// second backward GEMM).
    pub const NON_FINITE_CHECKS_SHARED: &str = "NonFiniteChecksShared";
    /// Counter: steps with a non-finite value found by the origin tracking.
    pub const NON_FINITE_STEPS: &str = "NonFiniteSteps";
    /// Counter: device errors reported by eager mode's syncs.
    pub const DEVICE_ERRORS: &str = "DeviceErrors";
    /// Metric: the time of one tensor-parallel exchange of activations or gradients (device read, exchange, write).
    pub const TP_EXCHANGE_TIME: &str = "TpExchangeTime";
    /// Counter: the bytes tensor-parallel exchanges returned to this rank.
    pub const TP_EXCHANGED_BYTES: &str = "TpExchangedBytes";
}

/// Counts and times a blocking device→host read of `bytes` by the FP8 ops (codes, statistics, amax histories).
pub(crate) fn timed_read<T>(bytes: usize, read: impl FnOnce() -> T) -> T {
    if !enabled() {
        return read();
    }
    count_read(bytes as u64);
    let start = Instant::now();
    let data = read();
    record_time(names::READ_BACK_TIME, start.elapsed());
    data
}

pub(crate) fn count_read(bytes: u64) {
    count_transfer(
        [names::DEVICE_TO_HOST_READS, names::DEVICE_TO_HOST_BYTES],
        names::TRANSFER_FROM_DEVICE_SIZE,
        bytes,
    );
}

/// One transfer: its count and bytes counters, and a sample of its size metric.
pub(crate) fn count_transfer([count, total]: [&str; 2], size: &str, bytes: u64) {
    increment_counter(count, 1);
    increment_counter(total, bytes);
    record_metric(size, MetricUnit::Bytes, bytes as f64);
}
