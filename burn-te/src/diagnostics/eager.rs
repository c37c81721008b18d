//! Eager debug mode (Neuron's `NEURON_USE_EAGER_DEBUG_MODE`): every op `Te<B>` sees is synced and its float output
//! checked as soon as it is issued, so a device error or the first NaN/Inf is reported at the op that produced it
//! — op name, layer and GEMM when it is a layer GEMM, iteration, shape — instead of at a later read.
//!
//! On: [`DiagnosticsConfig::eager`](super::DiagnosticsConfig) or `BURN_TE_EAGER_DEBUG_MODE=1`. The output check is
//! the one-pass statistics kernel (its NaN/±inf counts) and one read per op: slow, for debugging only. The first
//! non-finite output of each iteration is reported (later ones only counted, `NonFiniteOutputs`); with
//! [`OnNonFinite::Stop`](super::OnNonFinite) the op panics with the report (an op cannot return an error), after the
//! failing op's inputs and output were snapshotted when snapshots are on.

use burn::tensor::TensorMetadata;
use burn::tensor::ops::FloatTensor;

use super::nonfinite::{self, NonFiniteOrigin, OriginTensor};
use super::{flags, iteration, snapshot};
use crate::backend::TeBackend;
use crate::fp8_state::site::GemmSite;
use crate::metrics::{self, names};

/// Syncs `output`'s device and checks `output` for NaN/Inf; reports the first of the iteration.
pub(crate) fn check<B: TeBackend>(
    op: &'static str,
    site: Option<&GemmSite>,
    inputs: Vec<FloatTensor<B>>,
    output: &FloatTensor<B>,
) {
    let device = B::float_device(output);
    if let Err(err) = B::sync(&device) {
        device_error(op, site, &format!("{err:?}"));
        return;
    }
    let counts = B::fp8_stats_launch(output.clone(), None).and_then(B::fp8_stats_read);
    let stats = match counts {
        Ok(stats) => stats.tensor,
        Err(err) => {
            metrics::increment_counter("EagerChecksSkipped", 1);
            tracing::warn!(target: "burn_te::diagnostics", "eager mode: output of {op} not checked: {err}");
            return;
        }
    };
    let non_finite = stats.nan_count + stats.pos_inf_count + stats.neg_inf_count;
    if non_finite == 0 {
        return;
    }
    metrics::increment_counter(names::NON_FINITE_OUTPUTS, 1);
    let origin = NonFiniteOrigin {
        iteration: iteration(),
        op: op.to_string(),
        layer: site.map(|s| s.layer.to_string()),
        gemm: site.map(|s| s.gemm),
        tensor: site.map(|_| OriginTensor::Output),
        shape: output.shape().as_slice().to_vec(),
        nan_count: stats.nan_count,
        pos_inf_count: stats.pos_inf_count,
        neg_inf_count: stats.neg_inf_count,
        position: 0,
    };
    if !nonfinite::report(origin.clone()) {
        return;
    }
    let label = match site {
        Some(site) => format!("{site}"),
        None => op.to_string(),
    };
    if let Err(err) = snapshot::write_failure::<B>(&label, &origin, inputs, output) {
        tracing::error!(target: "burn_te::diagnostics", "eager mode: snapshot of {label} not written: {err}");
    }
    if flags().stop {
        panic!("eager debug mode: first non-finite value: {origin} (on_non_finite = Stop)");
    }
}

/// Reports a device error found by an eager sync.
pub(crate) fn device_error(op: &str, site: Option<&GemmSite>, error: &str) {
    metrics::increment_counter(names::DEVICE_ERRORS, 1);
    let at = site.map_or_else(|| op.to_string(), |s| format!("{s}"));
    tracing::error!(target: "burn_te::diagnostics", "eager mode: device error at {at} (iteration {}): {error}", iteration());
    if flags().stop {
        panic!(
            "eager debug mode: device error at {at} (iteration {}): {error}",
            iteration()
        );
    }
}
