//! [`DebugOptions`]: the arguments of [`initialize`](crate::initialize), after nvdlfw-inspect's.

use std::path::PathBuf;

use crate::pipeline::log::StatLogger;

/// Options of [`initialize`](crate::initialize), after nvdlfw-inspect's `initialize` arguments.
pub struct DebugOptions {
    pub(crate) config_file: Option<PathBuf>,
    pub(crate) log_dir: PathBuf,
    pub(crate) dump_dir: Option<PathBuf>,
    pub(crate) default_logging_enabled: bool,
    pub(crate) loggers: Vec<Box<dyn StatLogger>>,
    pub(crate) logger_ranks: Option<Vec<usize>>,
    pub(crate) init_training_step: u64,
}

impl DebugOptions {
    /// Options with `config_file`, logs in `.`, default logging on, training step 0.
    pub fn new(config_file: impl Into<PathBuf>) -> Self {
        DebugOptions {
            config_file: Some(config_file.into()),
            log_dir: PathBuf::from("."),
            dump_dir: None,
            default_logging_enabled: true,
            loggers: Vec::new(),
            logger_ranks: None,
            init_training_step: 0,
        }
    }

    /// Options without a config file: no features run (the logs and loggers still work).
    pub fn without_config() -> Self {
        DebugOptions {
            config_file: None,
            ..DebugOptions::new("")
        }
    }

    /// Where `nvdlfw_inspect_logs/` and `nvdlfw_inspect_statistics_logs/` go.
    pub fn log_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.log_dir = dir.into();
        self
    }

    /// Where DumpTensors writes its `tensor_dumps/` (default: the log directory).
    pub fn dump_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dump_dir = Some(dir.into());
        self
    }

    /// Whether the log files are written (default: yes).
    pub fn default_logging(mut self, enabled: bool) -> Self {
        self.default_logging_enabled = enabled;
        self
    }

    /// Adds a stat logger.
    pub fn logger(mut self, logger: impl StatLogger + 'static) -> Self {
        self.loggers.push(Box::new(logger));
        self
    }

    /// Adds a boxed stat logger.
    pub fn boxed_logger(mut self, logger: Box<dyn StatLogger>) -> Self {
        self.loggers.push(logger);
        self
    }

    /// The ranks whose stat loggers (TensorBoard, burn-train, ...) write (default: every rank's). TE's way — give
    /// the writer to the chosen ranks only — works too; this lets every peer run the same code. The log files are
    /// written on every rank.
    pub fn logger_ranks(mut self, ranks: impl IntoIterator<Item = usize>) -> Self {
        self.logger_ranks = Some(ranks.into_iter().collect());
        self
    }

    /// The first iteration's number (default 0).
    pub fn init_training_step(mut self, step: u64) -> Self {
        self.init_training_step = step;
        self
    }
}
