//! Fallbacks to high precision: a GEMM that was to run in FP8 and could not (an unsupported dtype, a shape the
//! kernel does not take, a layer without FP8 state, a debug feature's error) runs in high precision — never
//! silently. Every fallback is counted by reason ([`fallback_counts`]), logged as a `tracing` warning, and queued
//! for the debug tools' main log ([`take_fallback_messages`]).

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::error::TeError;

/// Counts by reason, and the messages not yet taken.
#[derive(Default)]
struct Fallbacks {
    counts: BTreeMap<String, u64>,
    messages: Vec<String>,
}

/// Messages kept for the main log between two takes (the oldest are dropped beyond this; the counts stay exact).
const MAX_MESSAGES: usize = 1024;

static FALLBACKS: Mutex<Fallbacks> = Mutex::new(Fallbacks {
    counts: BTreeMap::new(),
    messages: Vec::new(),
});

fn lock() -> std::sync::MutexGuard<'static, Fallbacks> {
    FALLBACKS.lock().unwrap_or_else(|p| p.into_inner())
}

/// The short reason of a fallback, the counter's name.
fn reason(err: &TeError) -> String {
    match err {
        TeError::UnsupportedDType { dtype, .. } => format!("unsupported dtype {dtype:?}"),
        TeError::ShapeMismatch { .. } | TeError::InvalidShape { .. } => "shape".into(),
        TeError::InvalidConfig { .. } | TeError::InvalidRecipe(_) | TeError::Plan(_) => {
            "recipe or state".into()
        }
        TeError::Read(_) => "read".into(),
        TeError::Kernel(_) => "kernel".into(),
        TeError::Collective(_) => "collective".into(),
    }
}

/// Records that `what` (a GEMM site or op) ran in high precision instead of FP8 because of `err`.
pub fn record_fallback(what: impl core::fmt::Display, err: &TeError) {
    let reason = reason(err);
    crate::metrics::increment_counter(
        &format!("{}({reason})", crate::metrics::names::GEMM_FALLBACK),
        1,
    );
    record(
        reason,
        format!("{what}: FP8 GEMM not possible, ran in high precision: {err}"),
    );
}

/// Records a fallback with a reason of the caller's (e.g. a debug feature's error).
pub fn record(reason: impl Into<String>, message: String) {
    tracing::warn!("{message}");
    let mut fallbacks = lock();
    *fallbacks.counts.entry(reason.into()).or_insert(0) += 1;
    if fallbacks.messages.len() == MAX_MESSAGES {
        fallbacks.messages.remove(0);
    }
    fallbacks.messages.push(message);
}

/// How many GEMMs fell back to high precision since the process started, by reason.
pub fn fallback_counts() -> BTreeMap<String, u64> {
    lock().counts.clone()
}

/// The fallback messages since the last take (the debug tools write them to their main log at each step).
pub fn take_fallback_messages() -> Vec<String> {
    std::mem::take(&mut lock().messages)
}
