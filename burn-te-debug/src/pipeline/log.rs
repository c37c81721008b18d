//! Log: what the debug path writes. In: log lines, dumps and each step's statistics; out: nvdlfw-inspect's log
//! files (the main log and the statistics log, one per rank), the dump files and the [`StatLogger`]s.

use std::collections::BTreeSet;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::dump::{Dumps, TensorDump};
use crate::error::DebugError;
use crate::pipeline::reduce::StepStats;
use crate::stats::StatValue;
use crate::tensor::TensorName;

/// A receiver of each step's statistics besides the log file (burn-train, TensorBoard, a test).
pub trait StatLogger: Send {
    /// The values of the step that ends at `iteration`.
    fn log(&mut self, iteration: u64, values: &[StatValue]);
}

/// A session's outputs: its log files (none without default logging), stat loggers and dumps.
pub(crate) struct Log {
    files: Option<LogFiles>,
    loggers: Vec<Box<dyn StatLogger>>,
    dumps: Dumps,
    /// The feature calls logged so far (each is logged once).
    logged_calls: BTreeSet<String>,
}

impl Log {
    pub(crate) fn new(
        files: Option<LogFiles>,
        loggers: Vec<Box<dyn StatLogger>>,
        dumps: Dumps,
    ) -> Log {
        Log {
            files,
            loggers,
            dumps,
            logged_calls: BTreeSet::new(),
        }
    }

    /// A line of the main log, also to `tracing`.
    pub(crate) fn main(&mut self, message: &str) -> Result<(), DebugError> {
        tracing::info!(target: "burn_te_debug", "{message}");
        match self.files.as_mut() {
            Some(files) => files.main(message),
            None => Ok(()),
        }
    }

    /// A line of the main log the first time it comes.
    pub(crate) fn once(&mut self, message: String) {
        if self.logged_calls.insert(message.clone()) {
            let _ = self.main(&message);
        }
    }

    /// Writes a dump file of `layer`'s `tensor` and logs it; errors are logged, not fatal.
    pub(crate) fn dump(
        &mut self,
        layer: &Arc<str>,
        tensor: TensorName,
        iteration: u64,
        dump: TensorDump,
    ) {
        if let Some(message) = self.dumps.write(layer, tensor, iteration, dump) {
            let _ = self.main(&message);
        }
    }

    /// Ends the step at `iteration`: logs what went wrong, writes the statistics to the statistics log and the
    /// stat loggers. The error: a failed reduction, else unread statistics, else a failed log write.
    pub(crate) fn step(&mut self, iteration: u64, stats: StepStats) -> Result<(), DebugError> {
        self.dumps.next_step();
        let StepStats {
            values,
            unread,
            reduction,
        } = stats;
        if let Some(err) = &reduction {
            tracing::error!(target: "burn_te_debug", "{err}");
            let _ = self.main(&err.to_string());
        }
        for error in &unread {
            tracing::error!("{error}");
            let _ = self.main(&format!("statistics not read back: {error}"));
        }
        let mut result = match reduction {
            Some(err) => Err(err),
            None if unread.is_empty() => Ok(()),
            None => Err(DebugError::StatsRead {
                iteration,
                errors: unread,
            }),
        };
        if let Some(files) = self.files.as_mut() {
            let lines: Vec<String> = values
                .iter()
                .map(|value| stat_message(&value.name, iteration, value.value))
                .collect();
            // A failure is counted in `files` and reported once below.
            let _ = files.stats(&lines);
            if let Some(err) = files.take_failure(iteration) {
                tracing::error!(target: "burn_te_debug", "{err}");
                let _ = files.main(&err.to_string());
                if result.is_ok() {
                    result = Err(err);
                }
            }
        }
        for logger in &mut self.loggers {
            logger.log(iteration, &values);
        }
        result
    }
}

/// The two log files of a session.
///
/// A file is opened for appending at each write (the main log's line, a step's statistics) and closed again, so a
/// directory that is removed, replaced or made unwritable mid-run is noticed (a kept-open file would go on writing
/// into a file nobody can see), and the lines already in the file are never touched after `initialize` created
/// it. A failed write does not stop anything: it is counted, and the next `step()` reports it once
/// ([`LogFiles::take_failure`]).
pub(crate) struct LogFiles {
    main: LogFile,
    stats: LogFile,
}

/// One log file: its path, and the writes that failed since the last step.
struct LogFile {
    path: PathBuf,
    /// Lines not written since the last [`LogFiles::take_failure`], with the first error.
    failed: Option<(usize, std::io::Error)>,
}

fn create(dir: &Path, rank: usize) -> Result<LogFile, DebugError> {
    std::fs::create_dir_all(dir).map_err(|source| DebugError::LogDir {
        path: dir.to_path_buf(),
        source,
    })?;
    let path = dir.join(format!("nvdlfw_inspect_globalrank-{rank}.log"));
    OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(&path)
        .map_err(|source| DebugError::LogDir {
            path: path.clone(),
            source,
        })?;
    Ok(LogFile { path, failed: None })
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

impl LogFile {
    /// Appends `messages` as log lines in one write; a failure is counted for the next step's report and returned.
    fn append<S: AsRef<str>>(&mut self, messages: &[S]) -> Result<(), DebugError> {
        if messages.is_empty() {
            return Ok(());
        }
        let stamp = timestamp();
        let text: String = messages
            .iter()
            .map(|m| format!("{stamp} - INFO - {}\n", m.as_ref()))
            .collect();
        // Append only: never create the directory again, never truncate (a file removed by log rotation is
        // created anew in its directory).
        let written = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .and_then(|mut file| file.write_all(text.as_bytes()));
        written.map_err(|source| {
            let copy = std::io::Error::new(source.kind(), source.to_string());
            match &mut self.failed {
                Some((lines, _)) => *lines += messages.len(),
                None => self.failed = Some((messages.len(), source)),
            }
            DebugError::Write {
                path: self.path.clone(),
                source: copy,
            }
        })
    }
}

impl LogFiles {
    /// Creates `<log_dir>/nvdlfw_inspect_logs/` and `<log_dir>/nvdlfw_inspect_statistics_logs/` with `rank`'s
    /// (empty) files.
    pub(crate) fn create(log_dir: &Path, rank: usize) -> Result<LogFiles, DebugError> {
        Ok(LogFiles {
            main: create(&log_dir.join("nvdlfw_inspect_logs"), rank)?,
            stats: create(&log_dir.join("nvdlfw_inspect_statistics_logs"), rank)?,
        })
    }

    /// A line of the main log.
    pub(crate) fn main(&mut self, message: &str) -> Result<(), DebugError> {
        self.main.append(&[message])
    }

    /// A step's lines of the statistics log, in one write.
    pub(crate) fn stats(&mut self, messages: &[String]) -> Result<(), DebugError> {
        self.stats.append(messages)
    }

    /// The writes that failed since the last call, as one error for the step that ends at `iteration`: the
    /// statistics log's if it failed, else the main log's (the other's failure goes to `tracing`).
    pub(crate) fn take_failure(&mut self, iteration: u64) -> Option<DebugError> {
        let mut failures = [&mut self.stats, &mut self.main]
            .into_iter()
            .filter_map(|file| {
                let (lines, source) = file.failed.take()?;
                Some(DebugError::LogWrite {
                    path: file.path.clone(),
                    iteration,
                    lines,
                    source,
                })
            });
        let first = failures.next();
        for other in failures {
            tracing::error!(target: "burn_te_debug", "{other}");
        }
        first
    }
}
