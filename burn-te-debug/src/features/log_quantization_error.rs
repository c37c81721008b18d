//! LogQuantizationError: how far each chosen GEMM's low-precision output is from its high-precision result.

use burn_te::Gemm;

use super::Scheduled;
use super::log_tensor_stats::parse_stats;
use crate::config::{FeatureSpec, Need, SCHEDULE_KEYS};
use crate::error::{ConfigError, DebugError};
use crate::feature::{DebugTensor, Feature, Inspection};
use crate::routing::Routing;
use crate::stats::{Stat, StatRequest};
use crate::tensor::TensorName;

/// Logs `sqnr` (dB), `rel_l2_error` and `max_abs_error` of the chosen GEMMs' outputs against the same GEMM run in
/// high precision on the operands before quantization (ours; TE has no such feature): the error a layer's FP8
/// (or NVFP4) GEMM makes, whatever its cause — scales, underflow, saturation, block layout, rounding. Logged
/// under the GEMM's output tensor, e.g. `fc1_output_sqnr` (fprop), `fc1_dgrad_sqnr`, `fc1_wgrad_sqnr`.
/// SQNR is torchao's `compute_error`, `10·log10(Σr² / Σ(y−r)²)`; micro-batches and peers merge the sums, so the
/// logged value is the step's. Each measurement runs one extra high-precision GEMM. A GEMM that a feature runs in
/// high precision (DisableFP8GEMM) logs its error too (FakeQuant's, or +inf when nothing changed it).
///
/// ```yaml
/// quantization_error:
///   enabled: True
///   layers:
///     layer_types: [qkv, proj, fc1, fc2]
///   transformer_engine:
///     LogQuantizationError:
///       enabled: True
///       gemms: [fprop, dgrad, wgrad]
///       stats: [sqnr, rel_l2_error, max_abs_error]
///       freq: 10
/// ```
pub struct LogQuantizationError {
    entries: Scheduled<Vec<Stat>>,
}

impl LogQuantizationError {
    /// Builds the feature from its config entry.
    pub fn from_spec(spec: &FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> {
        let entries = error_stat_items(spec, &[], |_| Ok(()))?
            .into_iter()
            .map(|(tensor, schedule, (stats, ()))| (tensor, schedule, stats))
            .collect();
        Ok(Box::new(LogQuantizationError {
            entries: Scheduled(entries),
        }))
    }
}

/// One item of [`error_stat_items`]: the GEMM's output tensor, its schedule, and its stats with the extra value.
pub(super) type ErrorStatItem<T> = (TensorName, crate::config::Schedule, (Vec<Stat>, T));

/// The items of a feature that logs error stats of GEMM outputs (`gemms` required, `stats` from
/// [`Stat::ERROR`], the schedule keys and `extra_keys`): per item, the GEMM's output tensor, its schedule, and its
/// stats with what `extra` reads from the item.
pub(super) fn error_stat_items<T>(
    spec: &FeatureSpec,
    extra_keys: &[&'static str],
    extra: impl Fn(&crate::config::Item) -> Result<T, ConfigError>,
) -> Result<Vec<ErrorStatItem<T>>, ConfigError> {
    let keys: Vec<&str> = SCHEDULE_KEYS
        .iter()
        .copied()
        .chain(["stats"])
        .chain(extra_keys.iter().copied())
        .collect();
    let known: Vec<String> = Stat::ERROR.iter().map(|s| s.name().to_string()).collect();
    spec.items(Need::Required, Need::No, &[], Some(&keys))?
        .into_iter()
        .map(|item| {
            let stats = parse_stats(&item, &known, |name| {
                Stat::ERROR.into_iter().find(|s| s.name() == name)
            })?;
            let gemm = item.gemm.expect("gemms are required");
            Ok((
                TensorName::output_of(gemm),
                item.schedule()?,
                (stats.into_iter().map(|(_, s)| s).collect(), extra(&item)?),
            ))
        })
        .collect()
}

impl Feature for LogQuantizationError {
    fn name(&self) -> &str {
        "LogQuantizationError"
    }

    fn logged_stats(&self) -> Vec<(TensorName, String)> {
        self.entries.logged_stats("")
    }

    fn gemm_error_enabled(&self, _layer: &str, gemm: Gemm, iteration: u64) -> Option<Routing> {
        self.entries.routing(TensorName::output_of(gemm), iteration)
    }

    fn inspect_gemm_error(
        &self,
        _layer: &str,
        gemm: Gemm,
        _output: &dyn DebugTensor,
        _reference: &dyn DebugTensor,
        iteration: u64,
        out: &mut Inspection,
    ) -> Result<(), DebugError> {
        for stats in self.entries.due(TensorName::output_of(gemm), iteration) {
            out.request_error_stats(StatRequest {
                quantization: None,
                prefix: String::new(),
                suffix: String::new(),
                stats: stats.clone(),
            });
        }
        Ok(())
    }
}
