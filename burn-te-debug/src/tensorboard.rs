//! TensorBoard event files: a [`StatLogger`] that writes each step's statistics as TensorBoard scalars.
//!
//! The file is TensorFlow's record format (`u64` length, masked CRC-32C of the length, the bytes, masked CRC-32C of
//! the bytes), each record one `Event` protocol buffer: first `file_version: "brain.Event:2"`, then one event per
//! stat and step with a `Summary` of one `simple_value`. The few protobuf fields are encoded here directly (no
//! code generation); TensorBoard reads them as its scalars.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::DebugError;
use crate::pipeline::log::StatLogger;
use crate::stats::StatValue;

/// How a stat is tagged in TensorBoard.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum TagStyle {
    /// `<layer>/<tensor>/<stat>`: TensorBoard groups the scalars by layer.
    #[default]
    Hierarchical,
    /// TE's stat name, `<layer>_<tensor>_<stat>`, as in the statistics log.
    TeName,
}

impl TagStyle {
    /// The tag of a value (a custom scalar without a tensor keeps its name).
    pub fn tag(self, value: &StatValue) -> String {
        match (self, value.tensor) {
            (TagStyle::Hierarchical, Some(tensor)) => {
                format!("{}/{}/{}", value.layer, tensor.name(), value.stat)
            }
            _ => value.name.clone(),
        }
    }
}

/// A [`StatLogger`] writing TensorBoard event files: one scalar per stat, at the step's iteration.
///
/// ```no_run
/// use burn_te_debug::{DebugOptions, tensorboard::TensorBoardLogger};
/// let tensorboard = TensorBoardLogger::new("./log/tensorboard").unwrap();
/// burn_te_debug::initialize(DebugOptions::new("config.yaml").logger(tensorboard)).unwrap();
/// // then: tensorboard --logdir ./log/tensorboard
/// ```
pub struct TensorBoardLogger {
    writer: BufWriter<File>,
    path: PathBuf,
    style: TagStyle,
    failed: bool,
}

impl TensorBoardLogger {
    /// Creates `dir` if needed and a new event file in it (`events.out.tfevents.<time>.<host>.<pid>.<n>`).
    pub fn new(dir: impl AsRef<Path>) -> Result<Self, DebugError> {
        static FILES: AtomicU32 = AtomicU32::new(0);
        let dir = dir.as_ref();
        let io_error = |path: &Path| {
            let path = path.to_path_buf();
            move |source| DebugError::LogDir { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io_error(dir))?;
        let host = std::env::var("HOSTNAME")
            .ok()
            .filter(|h| !h.is_empty() && !h.contains(['/', '\\']))
            .unwrap_or_else(|| "localhost".into());
        let name = format!(
            "events.out.tfevents.{}.{host}.{}.{}",
            wall_time() as u64,
            std::process::id(),
            FILES.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let file = File::create(&path).map_err(io_error(&path))?;
        let mut logger = TensorBoardLogger {
            writer: BufWriter::new(file),
            path,
            style: TagStyle::default(),
            failed: false,
        };
        let header = event(wall_time(), 0, EventBody::FileVersion("brain.Event:2"));
        logger
            .write_record(&header)
            .and_then(|()| logger.writer.flush())
            .map_err(io_error(&logger.path))?;
        Ok(logger)
    }

    /// Tags the scalars with `style` (default: `<layer>/<tensor>/<stat>`).
    pub fn tag_style(mut self, style: TagStyle) -> Self {
        self.style = style;
        self
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let length = (data.len() as u64).to_le_bytes();
        self.writer.write_all(&length)?;
        self.writer.write_all(&masked_crc(&length).to_le_bytes())?;
        self.writer.write_all(data)?;
        self.writer.write_all(&masked_crc(data).to_le_bytes())
    }
}

impl StatLogger for TensorBoardLogger {
    fn log(&mut self, iteration: u64, values: &[StatValue]) {
        if self.failed {
            return;
        }
        let time = wall_time();
        let step = i64::try_from(iteration).unwrap_or(i64::MAX);
        let result = values
            .iter()
            .try_for_each(|value| {
                let tag = self.style.tag(value);
                let record = event(time, step, EventBody::Scalar(&tag, value.value as f32));
                self.write_record(&record)
            })
            .and_then(|()| self.writer.flush());
        if let Err(err) = result {
            // Reported once; the statistics log and the other loggers go on.
            tracing::error!("TensorBoard event file {}: {err}", self.path.display());
            self.failed = true;
        }
    }
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// What an event carries.
enum EventBody<'a> {
    /// The first event of a file.
    FileVersion(&'a str),
    /// One scalar: tag and value.
    Scalar(&'a str, f32),
}

/// An `Event` message: `wall_time` (1, double), `step` (2, int64), then `file_version` (3, string) or `summary`
/// (5, a `Summary` with one `Value { tag (1), simple_value (2, float) }`).
fn event(wall_time: f64, step: i64, body: EventBody<'_>) -> Vec<u8> {
    let mut out = Vec::new();
    out.push(field_key(1, WIRE_FIXED64));
    out.extend_from_slice(&wall_time.to_le_bytes());
    out.push(field_key(2, WIRE_VARINT));
    varint(&mut out, step as u64);
    match body {
        EventBody::FileVersion(version) => bytes_field(&mut out, 3, version.as_bytes()),
        EventBody::Scalar(tag, value) => {
            let mut summary_value = Vec::new();
            bytes_field(&mut summary_value, 1, tag.as_bytes());
            summary_value.push(field_key(2, WIRE_FIXED32));
            summary_value.extend_from_slice(&value.to_le_bytes());
            let mut summary = Vec::new();
            bytes_field(&mut summary, 1, &summary_value);
            bytes_field(&mut out, 5, &summary);
        }
    }
    out
}

const WIRE_VARINT: u8 = 0;
const WIRE_FIXED64: u8 = 1;
const WIRE_BYTES: u8 = 2;
const WIRE_FIXED32: u8 = 5;

fn field_key(field: u8, wire: u8) -> u8 {
    (field << 3) | wire
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn bytes_field(out: &mut Vec<u8>, field: u8, bytes: &[u8]) {
    out.push(field_key(field, WIRE_BYTES));
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// TFRecord's masked CRC-32C.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}
