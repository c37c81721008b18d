//! Tensor dumps: safetensors files under `<log_dir>/tensor_dumps/rank_<r>/iter_<it:06>/`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::Dtype;
use safetensors::tensor::TensorView;

use crate::error::DebugError;
use crate::quantized::Quantized;
use crate::tensor::TensorName;

/// One named tensor of a dump file.
#[derive(Clone, Debug, PartialEq)]
pub struct DumpEntry {
    /// The key in the file (`high_precision`, `quantized`, `scale_inv`).
    pub key: String,
    /// safetensors' dtype of `bytes`.
    pub dtype: Dtype,
    /// The shape.
    pub shape: Vec<usize>,
    /// Little-endian element bytes.
    pub bytes: Vec<u8>,
}

impl DumpEntry {
    /// The high-precision tensor, as f32.
    pub fn high_precision(shape: Vec<usize>, values: Vec<f32>) -> DumpEntry {
        DumpEntry {
            key: "high_precision".into(),
            dtype: Dtype::F32,
            shape,
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// An f32 vector under `key`.
    pub fn f32s(key: &str, values: &[f32]) -> DumpEntry {
        DumpEntry {
            key: key.into(),
            dtype: Dtype::F32,
            shape: vec![values.len()],
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// The codes and scales of a quantized tensor:
    /// - FP8: `quantized` (the raw bytes as `U8`, which every reader opens; the format is the file's `fp8_format`
    ///   metadata, e.g. numpy `codes.view(ml_dtypes.float8_e4m3fn)`, torch `codes.view(torch.float8_e4m3fn)`) and
    ///   `scale_inv` (`[n]` f32: one, or one per block, row-major over the block grid);
    /// - NVFP4: `quantized` packed as TE packs it (`[⌈n/2⌉]` bytes of the row-major codes, element `2k` in the low
    ///   nibble of byte `k`), `block_scales` (the E4M3 codes over the block grid, `U8`), `global_amax` (`[1]` f32)
    ///   and `scale_inv` (each block's dequantization factor `(e4m3(s) · amax) / 2688`, f32).
    pub fn quantized(quantized: Quantized) -> Vec<DumpEntry> {
        let f32_entry = |key: &str, shape: Vec<usize>, values: &[f32]| DumpEntry {
            key: key.into(),
            dtype: Dtype::F32,
            shape,
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        let scale_inv = f32_entry(
            "scale_inv",
            vec![quantized.scale_inv.len()],
            &quantized.scale_inv,
        );
        let Some(nvfp4) = quantized.nvfp4 else {
            return vec![
                DumpEntry {
                    key: "quantized".into(),
                    dtype: Dtype::U8,
                    shape: quantized.shape,
                    bytes: quantized.codes,
                },
                scale_inv,
            ];
        };
        let mut packed = vec![0u8; quantized.codes.len().div_ceil(2)];
        for (index, code) in quantized.codes.iter().enumerate() {
            packed[index / 2] |= (code & 0xf) << (4 * (index % 2));
        }
        let grid = match (quantized.block, quantized.shape.split_last()) {
            (Some(block), Some((&cols, leading))) => {
                let (grid_rows, grid_cols) = block.grid(leading.iter().product(), cols);
                vec![grid_rows, grid_cols]
            }
            _ => vec![nvfp4.block_scales.len()],
        };
        vec![
            DumpEntry {
                key: "quantized".into(),
                dtype: Dtype::U8,
                shape: vec![packed.len()],
                bytes: packed,
            },
            DumpEntry {
                key: "block_scales".into(),
                dtype: Dtype::U8,
                shape: grid,
                bytes: nvfp4.block_scales,
            },
            f32_entry("global_amax", vec![1], &[nvfp4.global_amax]),
            scale_inv,
        ]
    }
}

/// Per-block records of a tensor as quantized (`values` laid out as `quantized.shape`), over its block grid
/// (`[grid rows, grid cols]`, row-major; one block for a per-tensor scale), so a reader finds *which* blocks lose
/// values: `block_scale_inv` (f32: the block's `scale_inv`, NVFP4: its dequantization factor), `block_amax` (f32,
/// NaN skipped), `block_underflows` (u32: nonzero elements dequantized to zero) and `block_mse` (f64: mean squared
/// error over the block's finite elements). One pass over the values.
pub fn block_stats(values: &[f32], quantized: &Quantized) -> Vec<DumpEntry> {
    let (cols, rows) = match quantized.shape.split_last() {
        Some((&cols, leading)) => (cols, leading.iter().product::<usize>()),
        None => (1, 1),
    };
    let block = quantized
        .block
        .unwrap_or(burn_te::ScaleBlock::new(rows.max(1), cols.max(1)));
    let (grid_rows, grid_cols) = block.grid(rows, cols);
    let blocks = grid_rows * grid_cols;
    let mut amax = vec![0f32; blocks];
    let mut underflows = vec![0u32; blocks];
    let mut squared_error = vec![0f64; blocks];
    let mut finite = vec![0u32; blocks];
    for (index, (&x, &code)) in values.iter().zip(&quantized.codes).enumerate() {
        let slot = block.slot(index, cols.max(1));
        let scale_inv = quantized.scale_inv[slot.min(quantized.scale_inv.len() - 1)];
        let dequantized = quantized.format.decode(code) * scale_inv;
        amax[slot] = amax[slot].max(x.abs());
        if x != 0.0 && dequantized == 0.0 {
            underflows[slot] += 1;
        }
        if x.is_finite() {
            squared_error[slot] += (f64::from(x) - f64::from(dequantized)).powi(2);
            finite[slot] += 1;
        }
    }
    let scale_inv: Vec<f32> = (0..blocks)
        .map(|b| quantized.scale_inv[b.min(quantized.scale_inv.len() - 1)])
        .collect();
    let mse: Vec<f64> = squared_error
        .iter()
        .zip(&finite)
        .map(|(e, &n)| if n == 0 { f64::NAN } else { e / f64::from(n) })
        .collect();
    let grid = vec![grid_rows, grid_cols];
    let entry = |key: &str, dtype, bytes: Vec<u8>| DumpEntry {
        key: key.into(),
        dtype,
        shape: grid.clone(),
        bytes,
    };
    vec![
        entry(
            "block_scale_inv",
            Dtype::F32,
            scale_inv.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        entry(
            "block_amax",
            Dtype::F32,
            amax.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        entry(
            "block_underflows",
            Dtype::U32,
            underflows.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        entry(
            "block_mse",
            Dtype::F64,
            mse.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
    ]
}

/// What one `inspect_tensor` call dumps of a tensor, with string metadata stored in the file's header.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TensorDump {
    /// The tensors of the file.
    pub entries: Vec<DumpEntry>,
    /// Header metadata (the writer adds layer, tensor and iteration).
    pub metadata: HashMap<String, String>,
}

/// TE's file-name sanitizing: `/ \ : * ? " < > |`, space and `.` become `_`.
pub fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| match c {
            '/' | '\\' | ':' | '*' | '?' | '"' | '<' | '>' | '|' | ' ' | '.' => '_',
            c => c,
        })
        .collect()
}

/// The file of a dump: `<log_dir>/tensor_dumps/rank_<rank>/iter_<iteration:06>/<layer>_<tensor>[_microbatch_<k>]
/// .safetensors` (`k` counts the feeds of a step after the first).
pub fn dump_path(
    log_dir: &Path,
    rank: usize,
    iteration: u64,
    layer: &str,
    tensor: &str,
    feed: usize,
) -> PathBuf {
    let suffix = if feed == 0 {
        String::new()
    } else {
        format!("_microbatch_{feed}")
    };
    log_dir
        .join("tensor_dumps")
        .join(format!("rank_{rank}"))
        .join(format!("iter_{iteration:06}"))
        .join(format!(
            "{}_{}{suffix}.safetensors",
            sanitize(layer),
            sanitize(tensor)
        ))
}

/// Writes `dump` to `path` (creating its directories).
pub fn write_dump(path: &Path, dump: &TensorDump) -> Result<(), DebugError> {
    let io = |err: std::io::Error| DebugError::Write {
        path: path.to_path_buf(),
        source: err,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let views = dump
        .entries
        .iter()
        .map(|e| {
            TensorView::new(e.dtype, e.shape.clone(), &e.bytes).map(|view| (e.key.clone(), view))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| io(std::io::Error::other(err.to_string())))?;
    safetensors::serialize_to_file(views, Some(dump.metadata.clone()), path)
        .map_err(|err| io(std::io::Error::other(err.to_string())))
}

/// A session's dump files: where they go, and the files written this step per (layer, tensor).
pub(crate) struct Dumps {
    /// Where `tensor_dumps/` goes.
    dir: PathBuf,
    /// The rank in the paths.
    rank: usize,
    /// Dumps written this step per (layer, tensor): micro-batches after the first get their own file.
    feeds: BTreeMap<(Arc<str>, TensorName), usize>,
}

impl Dumps {
    pub(crate) fn new(dir: PathBuf, rank: usize) -> Dumps {
        Dumps {
            dir,
            rank,
            feeds: BTreeMap::new(),
        }
    }

    /// Starts a step: its first feed of each tensor writes the file without a micro-batch suffix.
    pub(crate) fn next_step(&mut self) {
        self.feeds.clear();
    }

    /// Writes one dump file (a weight only at its first feed of the step): the main log's line about it (`None`
    /// when skipped). A write error is in the line, not returned.
    pub(crate) fn write(
        &mut self,
        layer: &Arc<str>,
        tensor: TensorName,
        iteration: u64,
        mut dump: TensorDump,
    ) -> Option<String> {
        let feed = self.feeds.entry((layer.clone(), tensor)).or_insert(0);
        if tensor == TensorName::Weight && *feed > 0 {
            return None;
        }
        let path = dump_path(&self.dir, self.rank, iteration, layer, tensor.name(), *feed);
        *feed += 1;
        dump.metadata.insert("layer".into(), layer.to_string());
        dump.metadata.insert("tensor".into(), tensor.name().into());
        dump.metadata
            .insert("iteration".into(), iteration.to_string());
        let keys: Vec<&str> = dump.entries.iter().map(|e| e.key.as_str()).collect();
        Some(match write_dump(&path, &dump) {
            Ok(()) => format!(
                "{layer}: Feature=DumpTensors, API=inspect_tensor: Dumped {tensor} at iteration {iteration} (keys: {keys:?}) to {}",
                path.display()
            ),
            Err(err) => {
                tracing::error!("{layer}: {err}");
                format!("{layer}: DumpTensors: {err}")
            }
        })
    }
}
