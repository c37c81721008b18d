//! Tensor dumps: safetensors files under `<log_dir>/tensor_dumps/rank_<r>/iter_<it:06>/`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::TensorView;

use crate::error::DebugError;
use crate::features::Quantized;

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

    /// The FP8 codes (`quantized`: the raw bytes as `U8`, which every reader opens; the format is the file's
    /// `fp8_format` metadata, e.g. numpy `codes.view(ml_dtypes.float8_e4m3fn)`, torch
    /// `codes.view(torch.float8_e4m3fn)`) and their `scale_inv` values (`[n]` f32: one, or one per block,
    /// row-major over the block grid).
    pub fn quantized(shape: Vec<usize>, quantized: Quantized) -> [DumpEntry; 2] {
        [
            DumpEntry {
                key: "quantized".into(),
                dtype: Dtype::U8,
                shape,
                bytes: quantized.codes,
            },
            DumpEntry {
                key: "scale_inv".into(),
                dtype: Dtype::F32,
                shape: vec![quantized.scale_inv.len()],
                bytes: quantized
                    .scale_inv
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            },
        ]
    }
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
