//! The log files of nvdlfw-inspect: the main log and the statistics log, one per rank.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::DebugError;

/// The two log files of a session.
pub(crate) struct LogFiles {
    main: (PathBuf, File),
    stats: (PathBuf, File),
}

fn open(dir: &Path, rank: usize) -> Result<(PathBuf, File), DebugError> {
    std::fs::create_dir_all(dir).map_err(|source| DebugError::LogDir {
        path: dir.to_path_buf(),
        source,
    })?;
    let path = dir.join(format!("nvdlfw_inspect_globalrank-{rank}.log"));
    let file = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(&path)
        .map_err(|source| DebugError::LogDir {
            path: path.clone(),
            source,
        })?;
    Ok((path, file))
}

/// `YYYY-MM-DD HH:MM:SS,mmm` in UTC, as Python's logging writes `asctime`.
fn timestamp() -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let (secs, millis) = (now.as_secs(), now.subsec_millis());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02},{millis:03}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// A statistics log message: `<name>  iteration=<it:06>  value=<v:.4f>`, padded as nvdlfw-inspect pads it.
pub fn stat_message(name: &str, iteration: u64, value: f64) -> String {
    format!(
        "{name:<78}{:<34}value={value:.4}",
        format!("iteration={iteration:06}")
    )
}

impl LogFiles {
    /// Creates `<log_dir>/nvdlfw_inspect_logs/` and `<log_dir>/nvdlfw_inspect_statistics_logs/` with rank 0's files.
    pub(crate) fn create(log_dir: &Path) -> Result<LogFiles, DebugError> {
        Ok(LogFiles {
            main: open(&log_dir.join("nvdlfw_inspect_logs"), 0)?,
            stats: open(&log_dir.join("nvdlfw_inspect_statistics_logs"), 0)?,
        })
    }

    fn write(file: &mut (PathBuf, File), message: &str) -> Result<(), DebugError> {
        writeln!(file.1, "{} - INFO - {message}", timestamp()).map_err(|source| DebugError::Write {
            path: file.0.clone(),
            source,
        })
    }

    /// A line of the main log.
    pub(crate) fn main(&mut self, message: &str) -> Result<(), DebugError> {
        Self::write(&mut self.main, message)
    }

    /// A line of the statistics log.
    pub(crate) fn stat(&mut self, message: &str) -> Result<(), DebugError> {
        Self::write(&mut self.stats, message)
    }

    /// Flushes both files.
    pub(crate) fn flush(&mut self) {
        let _ = self.main.1.flush();
        let _ = self.stats.1.flush();
    }
}
