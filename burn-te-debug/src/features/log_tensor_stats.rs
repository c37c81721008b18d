//! LogTensorStats: high-precision statistics of a layer's tensors on a schedule.

use super::Scheduled;
use crate::config::{FeatureSpec, Namespace, Need, SCHEDULE_KEYS};
use crate::error::{ConfigError, ConfigErrorKind, DebugError};
use crate::feature::{DebugTensor, Feature, Inspection};
use crate::routing::Routing;
use crate::stats::{BlockwiseRange, Stat, StatRequest};
use crate::tensor::TensorName;

/// Logs min, max, mean, std, l1_norm, l2_norm, cur_amax, dynamic_range, max_blockwise_dynamic_range (TE's) and
/// nan_count, inf_count (ours) of the
/// chosen tensors (TE's
/// `LogTensorStats`; also the base namespace's). Micro-batches of a step merge exactly; empty tensors are skipped.
pub struct LogTensorStats {
    name: String,
    entries: Scheduled<Vec<Stat>>,
}

/// Parses a `stats` list against `known`, naming an unknown stat. An entry is a name, or for
/// `max_blockwise_dynamic_range` a one-key map of its parameters (`block_size`, `dims`).
pub(super) fn parse_stats(
    item: &crate::config::Item,
    known: &[String],
    parse: impl Fn(&str) -> Option<Stat>,
) -> Result<Vec<(String, Stat)>, ConfigError> {
    use serde_yaml_ng::Value;
    let value = item
        .get("stats")
        .ok_or_else(|| item.error(None, ConfigErrorKind::MissingKey("stats".into())))?;
    let entries: Vec<Value> = match value {
        Value::Sequence(items) => items.clone(),
        Value::String(_) => vec![value.clone()],
        other => {
            return Err(item.error(
                Some("stats"),
                ConfigErrorKind::InvalidValue(format!("stats: expected a list, got {other:?}")),
            ));
        }
    };
    let unknown = |name: String| {
        item.error(
            Some("stats"),
            ConfigErrorKind::UnknownStat {
                stat: name,
                known: known.join(", "),
            },
        )
    };
    entries
        .iter()
        .map(|entry| match entry {
            Value::String(name) => {
                let stat = parse(name).ok_or_else(|| unknown(name.clone()))?;
                Ok((name.clone(), stat))
            }
            Value::Mapping(map) if map.len() == 1 => {
                let (key, params) = map.iter().next().expect("one entry");
                let name = key.as_str().unwrap_or_default();
                match parse(name) {
                    Some(Stat::MaxBlockwiseDynamicRange(_)) => {
                        let stat = Stat::MaxBlockwiseDynamicRange(blockwise_range(item, params)?);
                        Ok((stat.label(), stat))
                    }
                    _ => Err(unknown(format!("{key:?} with parameters"))),
                }
            }
            other => Err(unknown(
                serde_yaml_ng::to_string(other)
                    .unwrap_or_default()
                    .trim()
                    .to_string(),
            )),
        })
        .collect()
}

/// The parameters of `max_blockwise_dynamic_range`: `block_size` (default 32), `dims` (1 or 2, default 1). Whether
/// it takes the maximum over both orientations follows from the tensor, as in TE ([`over_orientations`]).
fn blockwise_range(
    item: &crate::config::Item,
    params: &serde_yaml_ng::Value,
) -> Result<BlockwiseRange, ConfigError> {
    let invalid =
        |message: String| item.error(Some("stats"), ConfigErrorKind::InvalidValue(message));
    let mut range = BlockwiseRange {
        block_size: 32,
        dims: 1,
        max_over_orientations: false,
    };
    let Some(map) = params.as_mapping() else {
        return Err(invalid(format!(
            "max_blockwise_dynamic_range: expected a map of block_size and dims, got {params:?}"
        )));
    };
    for (key, value) in map {
        match key.as_str().unwrap_or_default() {
            "block_size" => match value.as_u64() {
                Some(b) if b > 0 => range.block_size = b as usize,
                _ => {
                    return Err(invalid(format!(
                        "block_size must be a positive integer, got {value:?}"
                    )));
                }
            },
            "dims" => match value.as_u64() {
                Some(d @ (1 | 2)) => range.dims = d as u8,
                _ => return Err(invalid(format!("dims must be 1 or 2, got {value:?}"))),
            },
            "max_over_orientations" => {
                return Err(invalid(
                    "max_over_orientations is not a key: as in TE, the activation's and the weight's maximum is \
                     over both orientations, the other tensors' over the rowwise blocks"
                        .into(),
                ));
            }
            other => {
                return Err(item.error(
                    Some("stats"),
                    ConfigErrorKind::UnexpectedKey(other.to_string()),
                ));
            }
        }
    }
    Ok(range)
}

/// Whether `max_blockwise_dynamic_range` of `tensor` is the maximum over both orientations of its blocks: TE's rule
/// for the tensors a GEMM may read either way round (the activation and the weight), logged with the suffix
/// `_max_over_orientations`.
fn over_orientations(stat: Stat, tensor: TensorName) -> Stat {
    match stat {
        Stat::MaxBlockwiseDynamicRange(range) => Stat::MaxBlockwiseDynamicRange(BlockwiseRange {
            max_over_orientations: matches!(tensor, TensorName::Activation | TensorName::Weight),
            ..range
        }),
        other => other,
    }
}

impl LogTensorStats {
    /// Builds the feature from its config entry.
    pub fn from_spec(
        spec: &FeatureSpec,
        namespace: Namespace,
    ) -> Result<Box<dyn Feature>, ConfigError> {
        let keys: Vec<&str> = SCHEDULE_KEYS.iter().copied().chain(["stats"]).collect();
        let blockwise = Stat::MaxBlockwiseDynamicRange(BlockwiseRange {
            block_size: 32,
            dims: 1,
            max_over_orientations: false,
        });
        let all: Vec<Stat> = Stat::TENSOR.into_iter().chain([blockwise]).collect();
        let known: Vec<String> = all.iter().map(|s| s.name().to_string()).collect();
        let entries = spec
            .items(Need::No, Need::Required, &TensorName::ALL, Some(&keys))?
            .into_iter()
            .map(|item| {
                let stats = parse_stats(&item, &known, |name| {
                    all.iter().copied().find(|s| s.name() == name)
                })?;
                let tensor = item.tensor.expect("tensors are required");
                Ok((
                    tensor,
                    item.schedule()?,
                    stats
                        .into_iter()
                        .map(|(_, s)| over_orientations(s, tensor))
                        .collect(),
                ))
            })
            .collect::<Result<_, ConfigError>>()?;
        let name = match namespace {
            Namespace::TransformerEngine => "LogTensorStats".to_string(),
            Namespace::Base => "base.LogTensorStats".to_string(),
        };
        Ok(Box::new(LogTensorStats {
            name,
            entries: Scheduled(entries),
        }))
    }
}

impl Feature for LogTensorStats {
    fn name(&self) -> &str {
        &self.name
    }

    fn logged_stats(&self) -> Vec<(TensorName, String)> {
        self.entries.logged_stats("")
    }

    fn inspect_tensor_enabled(
        &self,
        _layer: &str,
        tensor: TensorName,
        iteration: u64,
    ) -> Option<Routing> {
        self.entries.routing(tensor, iteration)
    }

    fn inspect_tensor(
        &self,
        _layer: &str,
        tensor: TensorName,
        _x: &dyn DebugTensor,
        iteration: u64,
        out: &mut Inspection,
    ) -> Result<(), DebugError> {
        for stats in self.entries.due(tensor, iteration) {
            out.request_stats(StatRequest {
                quantization: None,
                prefix: String::new(),
                suffix: String::new(),
                stats: stats.clone(),
            });
        }
        Ok(())
    }
}
