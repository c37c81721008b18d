//! Profiling traces: `tracing` spans exported as Chrome/Perfetto trace-event JSON (by `tracing-chrome`, the
//! tracing ecosystem's exporter), which `chrome://tracing` and Perfetto's UI open.
//!
//! - User spans: [`trace("model_build", || ...)`](trace) (torch-xla's `xp.Trace`), or any `tracing` span.
//! - Automatic spans: every layer GEMM (`decoder.1.fc1.fprop`, with `layer` and `gemm` args) and every debug feature
//!   call of burn-te-debug. With [`device_time`](super::DiagnosticsConfig) (or eager mode) a GEMM span is synced at
//!   both ends, so its length is the GEMM's device time; otherwise it is the time to issue it.
//!
//! A span shows under the value of its `label` field when it has one, else under its name.

use std::path::{Path, PathBuf};

use tracing::Subscriber;
use tracing::span::{Attributes, Id};
use tracing_chrome::{ChromeLayer, ChromeLayerBuilder, EventOrSpan, FlushGuard};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

use super::DiagnosticsError;

/// Runs `f` inside a span named `label` (torch-xla's `with xp.Trace(label)`).
pub fn trace<T>(label: &str, f: impl FnOnce() -> T) -> T {
    tracing::info_span!("trace", label = %label).in_scope(f)
}

/// A span's `label` field, kept for the trace's event names.
struct Label(String);

/// Records each new span's `label` field.
struct LabelLayer;

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for LabelLayer {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        struct Visit(Option<String>);
        impl tracing::field::Visit for Visit {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                if field.name() == "label" {
                    self.0 = Some(value.to_string());
                }
            }
            fn record_debug(
                &mut self,
                field: &tracing::field::Field,
                value: &dyn core::fmt::Debug,
            ) {
                if field.name() == "label" {
                    self.0 = Some(format!("{value:?}"));
                }
            }
        }
        let mut visit = Visit(None);
        attrs.record(&mut visit);
        if let (Some(label), Some(span)) = (visit.0, ctx.span(id)) {
            span.extensions_mut().insert(Label(label));
        }
    }
}

/// The Chrome trace layer writing to `path`, for an application that builds its own `tracing` subscriber (add it
/// with [`label_layer`] beneath it); keep the guard alive until the trace should be flushed.
pub fn trace_layer<S>(path: impl AsRef<Path>) -> (ChromeLayer<S>, FlushGuard)
where
    S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
{
    ChromeLayerBuilder::new()
        .file(path.as_ref())
        .include_args(true)
        .name_fn(Box::new(|event_or_span| match event_or_span {
            EventOrSpan::Span(span) => span
                .extensions()
                .get::<Label>()
                .map_or_else(|| span.name().to_string(), |l| l.0.clone()),
            EventOrSpan::Event(event) => event.metadata().name().to_string(),
        }))
        .build()
}

/// The layer that gives spans their `label` as their trace name (put it under [`trace_layer`]).
pub fn label_layer<S: Subscriber + for<'a> LookupSpan<'a>>() -> impl Layer<S> {
    LabelLayer
}

/// tracing-core computes a span site's interest from the registering thread's own dispatcher alone while just one
/// dispatcher is registered: with a trace on one thread, a site another thread (no subscriber) hits first would
/// be disabled for the trace too, and its spans go missing at random. A second registered (no-op) dispatcher,
/// kept for the process, makes every interest come from all dispatchers.
fn keep_interests_per_dispatcher() {
    static SECOND: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
    SECOND.get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()));
}

/// A trace being recorded; dropping it (or [`finish`](Self::finish)) writes the file.
pub struct TraceGuard {
    // Field order is drop order: stop collecting on this thread, then flush the file.
    _default: tracing::subscriber::DefaultGuard,
    flush: FlushGuard,
    path: PathBuf,
}

impl TraceGuard {
    /// The trace file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops tracing and writes the file; returns its path.
    pub fn finish(self) -> PathBuf {
        let path = self.path.clone();
        drop(self);
        path
    }

    /// Writes what was traced so far (the file is completed when the guard drops).
    pub fn flush(&self) {
        self.flush.flush();
    }
}

/// Starts recording a trace of this thread's spans (the training loop's thread) to `path`. For a trace of
/// several threads, or next to an application's own subscriber, use [`trace_layer`] and [`label_layer`].
pub fn start_trace(path: impl AsRef<Path>) -> Result<TraceGuard, DiagnosticsError> {
    let path = path.as_ref().to_path_buf();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| DiagnosticsError::Io {
            path: dir.display().to_string(),
            message: e.to_string(),
        })?;
    }
    std::fs::File::create(&path).map_err(|e| DiagnosticsError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    let (chrome, flush) = trace_layer(&path);
    let subscriber = tracing_subscriber::registry()
        .with(label_layer())
        .with(chrome);
    keep_interests_per_dispatcher();
    let default = tracing::subscriber::set_default(subscriber);
    Ok(TraceGuard {
        _default: default,
        flush,
        path,
    })
}
