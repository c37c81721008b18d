//! DumpTensors: a layer's tensors written to safetensors files on a schedule.

use super::Scheduled;
use crate::config::{FeatureSpec, Need, SCHEDULE_KEYS};
use crate::dump::{DumpEntry, TensorDump};
use crate::error::{ConfigError, DebugError};
use crate::feature::{DebugTensor, Feature, Inspection};
use crate::routing::Routing;
use crate::tensor::TensorName;

/// What to dump of a tensor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct What {
    high_precision: bool,
    quantized: bool,
    block_stats: bool,
    amax_history: bool,
}

/// Writes the chosen tensors to `<log_dir>/tensor_dumps/rank_<r>/iter_<it:06>/<layer>_<tensor>.safetensors`
/// (TE's `DumpTensors`; layer names sanitized as TE does). Keys: `high_precision_tensor` (the tensor, f32) and
/// `quantized_tensor` (its FP8 codes as bytes plus `scale_inv`, quantized as its GEMM quantizes it; metadata
/// `fp8_format`, `recipe`, `scale_block`; NVFP4: packed codes, `block_scales`, `global_amax`). Beyond TE:
/// `block_stats` (per-block records of the quantization: `block_scale_inv`, `block_amax`, `block_underflows`,
/// `block_mse` over the block grid, see [`crate::dump::block_stats`]) and `amax_history` (the layer's
/// delayed-scaling `amax_history` (TE's layout: slot 0 this iteration's amax, slot `len − k` the amax of `k`
/// iterations ago) and `scale` for this tensor, as the GEMM uses them this
/// iteration). Files open with numpy (`safetensors.numpy`), torch (`safetensors.torch`) or any safetensors reader.
/// Dumping reads the tensor back from the device: a sync point at each dump.
///
/// ```yaml
/// dump_blocks:
///   enabled: True
///   layers:
///     layer_name_regex_pattern: '.*fc1'
///   transformer_engine:
///     DumpTensors:
///       enabled: True
///       tensors_struct:
///         - tensor: activation
///           quantized_tensor: True
///           block_stats: True
///           freq: 100
///         - tensor: gradient
///           amax_history: True
///           start_step: 0
///           end_step: 10
/// ```
pub struct DumpTensors {
    entries: Scheduled<What>,
}

impl DumpTensors {
    /// Builds the feature from its config entry.
    pub fn from_spec(spec: &FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> {
        let keys: Vec<&str> = SCHEDULE_KEYS
            .iter()
            .copied()
            .chain([
                "high_precision_tensor",
                "quantized_tensor",
                "block_stats",
                "amax_history",
            ])
            .collect();
        let entries = spec
            .items(Need::No, Need::Required, &TensorName::ALL, Some(&keys))?
            .into_iter()
            .map(|item| {
                let what = What {
                    high_precision: item.bool("high_precision_tensor")?.unwrap_or(false),
                    quantized: item.bool("quantized_tensor")?.unwrap_or(false),
                    block_stats: item.bool("block_stats")?.unwrap_or(false),
                    amax_history: item.bool("amax_history")?.unwrap_or(false),
                };
                Ok((
                    item.tensor.expect("tensors are required"),
                    item.schedule()?,
                    what,
                ))
            })
            .collect::<Result<_, ConfigError>>()?;
        Ok(Box::new(DumpTensors {
            entries: Scheduled(entries),
        }))
    }
}

impl Feature for DumpTensors {
    fn name(&self) -> &str {
        "DumpTensors"
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
        x: &dyn DebugTensor,
        iteration: u64,
        out: &mut Inspection,
    ) -> Result<(), DebugError> {
        let what = self
            .entries
            .due(tensor, iteration)
            .fold(What::default(), |acc, w| What {
                high_precision: acc.high_precision || w.high_precision,
                quantized: acc.quantized || w.quantized,
                block_stats: acc.block_stats || w.block_stats,
                amax_history: acc.amax_history || w.amax_history,
            });
        if what == What::default() {
            out.log_message(format!(
                "Feature={}: Neither high_precision_tensor nor quantized_tensor is enabled. Nothing to dump.",
                self.name()
            ));
            return Ok(());
        }
        let mut dump = TensorDump::default();
        let values = if what.high_precision || what.block_stats {
            Some(x.to_vec()?)
        } else {
            None
        };
        if let (true, Some(values)) = (what.high_precision, &values) {
            dump.entries
                .push(DumpEntry::high_precision(x.shape(), values.clone()));
        }
        if what.amax_history {
            match x.delayed_state()? {
                Some((history, scale)) => {
                    dump.entries.push(DumpEntry::f32s("amax_history", &history));
                    dump.entries.push(DumpEntry::f32s("scale", &[scale]));
                }
                None => out.log_message(format!(
                    "Feature={}: amax_history is True but {tensor} has no delayed-scaling state here (another \
                     recipe, a GEMM output, or no FP8 scope). Skipping.",
                    self.name()
                )),
            }
        }
        if what.quantized || what.block_stats {
            match x.quantized()? {
                Some(quantized) => {
                    let meta = &mut dump.metadata;
                    meta.insert("fp8_format".into(), quantized.format.name().into());
                    meta.insert("shape".into(), format!("{:?}", quantized.shape));
                    if quantized.shape != x.shape() {
                        meta.insert("layout".into(), "transposed".into());
                    }
                    if let Some(recipe) = x.recipe() {
                        meta.insert("recipe".into(), recipe.name().into());
                    }
                    let block = quantized
                        .block
                        .map_or("tensor".into(), |b| format!("{}x{}", b.rows, b.cols));
                    meta.insert("scale_block".into(), block);
                    if let (true, Some(values)) = (what.block_stats, &values) {
                        let values = if quantized.shape != x.shape() && quantized.shape.len() == 2 {
                            // Quantized as its transpose (NVFP4's 1×16 weight blocks): the values likewise.
                            let (q_rows, q_cols) = (quantized.shape[0], quantized.shape[1]);
                            (0..q_rows * q_cols)
                                .map(|i| values[(i % q_cols) * q_rows + i / q_cols])
                                .collect()
                        } else {
                            values.clone()
                        };
                        dump.entries
                            .extend(crate::dump::block_stats(&values, &quantized));
                    }
                    if what.quantized {
                        dump.entries.extend(DumpEntry::quantized(quantized));
                    }
                }
                None => out.log_message(format!(
                    "Feature={}: quantized_tensor or block_stats is True but {tensor} is not quantized here (a \
                     GEMM output, or no FP8 scope). Skipping.",
                    self.name()
                )),
            }
        }
        if !dump.entries.is_empty() {
            out.dump(dump);
        }
        Ok(())
    }
}
