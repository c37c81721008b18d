//! LogTensorStats: high-precision statistics of a layer's tensors on a schedule.

use super::{DebugTensor, Feature, Inspection, Namespace, Routing};
use crate::config::{FeatureSpec, Need, SCHEDULE_KEYS, Schedule};
use crate::error::{ConfigError, ConfigErrorKind, DebugError};
use crate::stats::{Stat, StatRequest};
use crate::tensor::TensorName;

/// Logs min, max, mean, std, l1_norm, l2_norm, cur_amax, dynamic_range of the chosen tensors (TE's
/// `LogTensorStats`; also the base namespace's). Micro-batches of a step merge exactly; empty tensors are skipped.
pub struct LogTensorStats {
    name: String,
    entries: Vec<(TensorName, Schedule, Vec<Stat>)>,
}

/// Parses a `stats` list against `known`, naming an unknown stat.
pub(super) fn parse_stats(
    item: &crate::config::Item,
    known: &[String],
    parse: impl Fn(&str) -> Option<Stat>,
) -> Result<Vec<(String, Stat)>, ConfigError> {
    let value = item
        .get("stats")
        .ok_or_else(|| item.error(None, ConfigErrorKind::MissingKey("stats".into())))?;
    let names: Vec<String> = match value {
        serde_yaml_ng::Value::String(s) => vec![s.clone()],
        serde_yaml_ng::Value::Sequence(items) => items
            .iter()
            .map(|v| match v {
                serde_yaml_ng::Value::String(s) => s.clone(),
                other => serde_yaml_ng::to_string(other)
                    .unwrap_or_default()
                    .trim()
                    .to_string(),
            })
            .collect(),
        other => {
            return Err(item.error(
                Some("stats"),
                ConfigErrorKind::InvalidValue(format!("stats: expected a list, got {other:?}")),
            ));
        }
    };
    names
        .into_iter()
        .map(|name| {
            let stat = parse(&name).ok_or_else(|| {
                item.error(
                    Some("stats"),
                    ConfigErrorKind::UnknownStat {
                        stat: name.clone(),
                        known: known.join(", "),
                    },
                )
            })?;
            Ok((name, stat))
        })
        .collect()
}

impl LogTensorStats {
    /// Builds the feature from its config entry.
    pub fn from_spec(
        spec: &FeatureSpec,
        namespace: Namespace,
    ) -> Result<Box<dyn Feature>, ConfigError> {
        let keys: Vec<&str> = SCHEDULE_KEYS.iter().copied().chain(["stats"]).collect();
        let known: Vec<String> = Stat::TENSOR.iter().map(|s| s.name().to_string()).collect();
        let entries = spec
            .items(Need::No, Need::Required, &TensorName::ALL, Some(&keys))?
            .into_iter()
            .map(|item| {
                let stats = parse_stats(&item, &known, |name| {
                    Stat::TENSOR.into_iter().find(|s| s.name() == name)
                })?;
                let tensor = item.tensor.expect("tensors are required");
                Ok((
                    tensor,
                    item.schedule()?,
                    stats.into_iter().map(|(_, s)| s).collect(),
                ))
            })
            .collect::<Result<_, ConfigError>>()?;
        let name = match namespace {
            Namespace::TransformerEngine => "LogTensorStats".to_string(),
            Namespace::Base => "base.LogTensorStats".to_string(),
        };
        Ok(Box::new(LogTensorStats { name, entries }))
    }
}

impl Feature for LogTensorStats {
    fn name(&self) -> &str {
        &self.name
    }

    fn inspect_tensor_enabled(
        &self,
        _layer: &str,
        tensor: TensorName,
        iteration: u64,
    ) -> Option<Routing> {
        let schedules = self.entries.iter().filter(|e| e.0 == tensor);
        Schedule::routing(schedules.map(|(_, schedule, _)| schedule), iteration)
    }

    fn inspect_tensor(
        &self,
        _layer: &str,
        tensor: TensorName,
        _x: &dyn DebugTensor,
        iteration: u64,
        out: &mut Inspection,
    ) -> Result<(), DebugError> {
        for (_, _, stats) in self
            .entries
            .iter()
            .filter(|(t, schedule, _)| *t == tensor && schedule.runs_at(iteration))
        {
            out.request_stats(StatRequest {
                quantization: None,
                prefix: String::new(),
                stats: stats.clone(),
            });
        }
        Ok(())
    }
}
