//! [`DebugConfig`]: debugging of a training run as a Burn config, saved and loaded as JSON beside the run's other
//! configs, that turns the debug API on.

use burn::config::Config;

use crate::error::DebugError;
use crate::options::DebugOptions;
use crate::pipeline::log::StatLogger;
use crate::session::initialize;
use crate::tensorboard::{TagStyle, TensorBoardLogger};

/// The debug settings of a run.
///
/// ```no_run
/// use burn::config::Config;
/// use burn_te_debug::DebugConfig;
/// let config = DebugConfig::new()
///     .with_config_file(Some("debug.yaml".into()))
///     .with_log_dir("./log".into())
///     .with_tensorboard(true);
/// config.save("debug.json").unwrap();
/// let config = DebugConfig::load("debug.json").unwrap();
/// config.init().unwrap(); // debugging is on; call burn_te_debug::step() every iteration
/// ```
#[derive(Config, Debug)]
pub struct DebugConfig {
    /// The feature config in Transformer Engine's YAML format; `None` runs no features (the logs and loggers
    /// still work).
    #[config(default = "None")]
    pub config_file: Option<String>,
    /// Where the log files (`nvdlfw_inspect_logs/`, `nvdlfw_inspect_statistics_logs/`) and, by default, the
    /// TensorBoard files and tensor dumps go.
    #[config(default = "\"./log\".to_string()")]
    pub log_dir: String,
    /// Whether the log files are written (nvdlfw-inspect's `default_logging_enabled`).
    #[config(default = true)]
    pub log_files: bool,
    /// Whether the statistics also go to TensorBoard event files.
    #[config(default = false)]
    pub tensorboard: bool,
    /// The TensorBoard directory (default: `<log_dir>/tensorboard`).
    #[config(default = "None")]
    pub tensorboard_dir: Option<String>,
    /// How the TensorBoard scalars are tagged.
    #[config(default = "TagStyle::Hierarchical")]
    pub tensorboard_tags: TagStyle,
    /// Where DumpTensors writes `tensor_dumps/` (default: the log directory).
    #[config(default = "None")]
    pub dump_dir: Option<String>,
    /// The iteration number of the first step (e.g. the step a run resumes from).
    #[config(default = 0)]
    pub init_training_step: u64,
    /// With several peers: the ranks whose TensorBoard and other stat loggers write (TE gives its writer to chosen
    /// ranks); `None`: every rank. The log files are written on every rank.
    #[config(default = "None")]
    pub logger_ranks: Option<Vec<usize>>,
}

impl DebugConfig {
    /// The [`DebugOptions`] these settings give, with the TensorBoard logger if enabled; add other loggers (e.g. the
    /// burn-train bridge) before [`initialize`].
    pub fn options(&self) -> Result<DebugOptions, DebugError> {
        let mut options = match &self.config_file {
            Some(file) => DebugOptions::new(file),
            None => DebugOptions::without_config(),
        }
        .log_dir(&self.log_dir)
        .default_logging(self.log_files)
        .init_training_step(self.init_training_step);
        if let Some(dir) = &self.dump_dir {
            options = options.dump_dir(dir);
        }
        let rank = burn_te::diagnostics::rank();
        let logs_here = self
            .logger_ranks
            .as_ref()
            .is_none_or(|ranks| ranks.contains(&rank));
        if let Some(ranks) = &self.logger_ranks {
            options = options.logger_ranks(ranks.iter().copied());
        }
        if self.tensorboard && logs_here {
            let dir = match &self.tensorboard_dir {
                Some(dir) => dir.into(),
                None => std::path::Path::new(&self.log_dir).join("tensorboard"),
            };
            options = options.logger(TensorBoardLogger::new(dir)?.tag_style(self.tensorboard_tags));
        }
        Ok(options)
    }

    /// Turns debugging on: [`initialize`] with these settings.
    pub fn init(&self) -> Result<(), DebugError> {
        initialize(self.options()?)
    }

    /// Turns debugging on with extra stat loggers (e.g. `train::TrainStats::logger`, feature `train`).
    pub fn init_with(
        &self,
        loggers: impl IntoIterator<Item = Box<dyn StatLogger>>,
    ) -> Result<(), DebugError> {
        let mut options = self.options()?;
        for logger in loggers {
            options = options.boxed_logger(logger);
        }
        initialize(options)
    }
}
