//! The burn-train bridge: each `step()`'s statistics as numeric burn-train metrics, so a `Learner`-based app shows
//! them in the dashboard (plotted over iterations) and in burn-train's metric logs.
//!
//! ```ignore
//! let stats = TrainStats::new();
//! DebugConfig::new().with_config_file(Some("debug.yaml".into())).init_with([stats.logger()])?;
//! let training = SupervisedTraining::new(dir, train_loader, valid_loader)
//!     .metric_train_numeric(LossMetric::new())
//!     .metrics(stats.metrics_for_layers(["blocks.0.self_attention.layernorm_qkv"])?);
//! // and in the model's `TrainStep::step`, after `backward()`: `burn_te_debug::step()?;`
//! ```
//!
//! Alignment: burn-train updates its metrics once per training iteration, after the iteration's `TrainStep`, on
//! its metrics thread. The k-th update after [`TrainStats::metrics`] shows the k-th `step()` after it, so the
//! stats line up with the loss when `step()` is called once per `TrainStep` (on the debug decorator's iteration
//! numbering, which [`PrecisionStat::iteration`] reports). A stat not logged at an iteration (a `freq` above 1, a
//! schedule) keeps its last value, as burn-train plots one point per iteration.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use burn_train::metric::{
    Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes, NumericEntry,
    SerializedEntry,
};
use burn_train::{LearningComponentsTypes, MetricRegistration, SupervisedTraining};

use crate::error::DebugError;
use crate::pipeline::log::StatLogger;
use crate::session::stat_names;
use crate::stats::StatValue;

/// How many steps the feed keeps for metrics that lag behind (burn-train's metrics thread is at most a few behind).
const HISTORY: usize = 4096;

/// The statistics of each step, kept for burn-train's metrics.
#[derive(Default)]
struct Feed {
    /// The number of steps received (the index of the step after `steps.back()`).
    received: usize,
    /// The last steps: (debug iteration, values by stat name).
    steps: VecDeque<(u64, BTreeMap<String, f64>)>,
}

impl Feed {
    /// The step with index `index`, if still kept.
    fn step(&self, index: usize) -> Option<&(u64, BTreeMap<String, f64>)> {
        let first = self.received - self.steps.len();
        index
            .checked_sub(first)
            .and_then(|offset| self.steps.get(offset))
    }
}

/// The bridge between the debug session and burn-train: a [`StatLogger`] that receives each step's stats, and the
/// metrics that show them. Cheap to clone (shared state).
#[derive(Clone, Default)]
pub struct TrainStats {
    feed: Arc<Mutex<Feed>>,
}

impl TrainStats {
    /// A bridge with no steps yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The stat logger to give the debug session ([`DebugOptions::logger`](crate::DebugOptions::logger) or
    /// [`DebugConfig::init_with`](crate::DebugConfig::init_with)).
    pub fn logger(&self) -> Box<dyn StatLogger> {
        Box::new(TrainStatsLogger {
            feed: self.feed.clone(),
        })
    }

    /// One numeric burn-train metric per stat name (`<layer>_<tensor>_<stat>`, as in the statistics log), for
    /// [`SupervisedTraining::metrics`].
    pub fn metrics<S: Into<String>>(&self, names: impl IntoIterator<Item = S>) -> PrecisionMetrics {
        let next = self.lock().received;
        PrecisionMetrics(
            names
                .into_iter()
                .map(|name| PrecisionStat {
                    name: Arc::new(name.into()),
                    feed: self.feed.clone(),
                    next,
                    last: None,
                })
                .collect(),
        )
    }

    /// The metrics of every stat the running session's config logs for these layers (see
    /// [`stat_names`]).
    pub fn metrics_for_layers<'a>(
        &self,
        layers: impl IntoIterator<Item = &'a str>,
    ) -> Result<PrecisionMetrics, DebugError> {
        Ok(self.metrics(stat_names(layers)?))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Feed> {
        self.feed.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

struct TrainStatsLogger {
    feed: Arc<Mutex<Feed>>,
}

impl StatLogger for TrainStatsLogger {
    fn log(&mut self, iteration: u64, values: &[StatValue]) {
        let mut feed = self.feed.lock().unwrap_or_else(PoisonError::into_inner);
        let values = values.iter().map(|v| (v.name.clone(), v.value)).collect();
        feed.steps.push_back((iteration, values));
        feed.received += 1;
        if feed.steps.len() > HISTORY {
            feed.steps.pop_front();
        }
    }
}

/// One debug stat as a numeric burn-train metric, named as in the statistics log.
#[derive(Clone)]
pub struct PrecisionStat {
    name: MetricName,
    feed: Arc<Mutex<Feed>>,
    /// The index of the step the next update shows.
    next: usize,
    /// The last value shown, with its debug iteration.
    last: Option<(u64, f64)>,
}

impl PrecisionStat {
    /// The debug iteration and value of the last update that found the stat logged.
    pub fn iteration(&self) -> Option<(u64, f64)> {
        self.last
    }

    fn current(&self) -> f64 {
        self.last.map_or(f64::NAN, |(_, value)| value)
    }
}

impl Metric for PrecisionStat {
    /// No model output: the values come from the debug session (every training output adapts to `()`).
    type Input = ();

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn description(&self) -> Option<String> {
        Some("burn-te-debug statistic".into())
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: self.name.ends_with('%').then(|| "%".to_string()),
            higher_is_better: false,
        }
        .into()
    }

    fn update(&mut self, _item: &(), _metadata: &MetricMetadata) -> SerializedEntry {
        let found = {
            let feed = self.feed.lock().unwrap_or_else(PoisonError::into_inner);
            feed.step(self.next).and_then(|(iteration, values)| {
                values.get(self.name.as_str()).map(|v| (*iteration, *v))
            })
        };
        self.next += 1;
        if found.is_some() {
            self.last = found;
        }
        let value = self.current();
        SerializedEntry::new(display(value), value.to_string())
    }

    fn clear(&mut self) {}
}

impl Numeric for PrecisionStat {
    fn value(&self) -> NumericEntry {
        NumericEntry::Value(self.current())
    }

    fn running_value(&self) -> NumericEntry {
        NumericEntry::Value(self.current())
    }
}

/// Four decimals, or four significant digits in scientific notation for small or large magnitudes (underflow
/// percentages and squared errors are often far below 1e-3).
fn display(value: f64) -> String {
    let magnitude = value.abs();
    if magnitude == 0.0 || (1e-3..1e5).contains(&magnitude) || !value.is_finite() {
        format!("{value:.4}")
    } else {
        format!("{value:.3e}")
    }
}

/// The precision-stat metrics of a run, registered in one call:
/// `SupervisedTraining::metrics(stats.metrics(names))` adds each as a numeric training metric.
#[derive(Clone)]
pub struct PrecisionMetrics(pub Vec<PrecisionStat>);

impl<LC: LearningComponentsTypes> MetricRegistration<LC> for PrecisionMetrics {
    fn register(self, builder: SupervisedTraining<LC>) -> SupervisedTraining<LC> {
        self.0.into_iter().fold(builder, |builder, metric| {
            builder.metric_train_numeric(metric)
        })
    }
}
