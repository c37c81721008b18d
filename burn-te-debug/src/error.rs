//! Errors of burn-te-debug.

use std::fmt;
use std::path::PathBuf;

use burn_te::TeError;

/// Where in a config file something is: section, feature and key as far as known, and the line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConfigLocation {
    /// The config file (empty for a config given as a string).
    pub file: String,
    /// The section (top-level key).
    pub section: Option<String>,
    /// The feature, as `namespace.Feature` for namespaced features.
    pub feature: Option<String>,
    /// The key inside the section or feature.
    pub key: Option<String>,
    /// 1-based line, when known.
    pub line: Option<usize>,
}

impl fmt::Display for ConfigLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.file.is_empty() {
            write!(f, "config")?;
        } else {
            write!(f, "{}", self.file)?;
        }
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if let Some(section) = &self.section {
            write!(f, ", section \"{section}\"")?;
        }
        if let Some(feature) = &self.feature {
            write!(f, ", feature \"{feature}\"")?;
        }
        if let Some(key) = &self.key {
            write!(f, ", key \"{key}\"")?;
        }
        Ok(())
    }
}

/// What is wrong in a config file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigErrorKind {
    /// The file is not valid YAML.
    #[error("YAML syntax error: {0}")]
    Syntax(String),
    /// A feature nobody registered under that namespace.
    #[error("unknown feature \"{feature}\" in namespace \"{namespace}\" (registered: {known})")]
    UnknownFeature {
        /// The feature's name.
        feature: String,
        /// `transformer_engine` or `base`.
        namespace: String,
        /// The registered features of the namespace.
        known: String,
    },
    /// A stat the feature does not compute.
    #[error("unknown stat \"{stat}\" (supported: {known})")]
    UnknownStat {
        /// The stat.
        stat: String,
        /// The supported stats.
        known: String,
    },
    /// A GEMM name other than fprop, dgrad, wgrad.
    #[error("unknown gemm \"{0}\" (expected fprop, dgrad or wgrad)")]
    UnknownGemm(String),
    /// A tensor name the feature does not take.
    #[error("unknown tensor \"{tensor}\" (expected one of {known})")]
    UnknownTensor {
        /// The tensor name.
        tensor: String,
        /// The tensor names the feature takes.
        known: String,
    },
    /// A key the feature (or section, or selector) does not understand.
    #[error("Unexpected key in config: \"{0}\"")]
    UnexpectedKey(String),
    /// A required key is missing (e.g. `enabled`, `layers`, `gemms`).
    #[error("missing key \"{0}\"")]
    MissingKey(String),
    /// An enabled section without any layer selector.
    #[error(
        "no layer selector: give one of layer_name_regex_pattern, layer_types, layer_numbers, exact_layer_names"
    )]
    NoSelector,
    /// `layer_name_regex_pattern` does not compile.
    #[error("malformed regex: {0}")]
    Regex(String),
    /// Two enabled sections select the same layer.
    #[error(
        "multiple debug configs targeting the same layer \"{layer}\": sections \"{first}\" and \"{second}\""
    )]
    Overlap {
        /// The layer.
        layer: String,
        /// The first section.
        first: String,
        /// The second section.
        second: String,
    },
    /// No section is enabled.
    #[error("no enabled section")]
    NothingEnabled,
    /// A value of the wrong type or out of range.
    #[error("{0}")]
    InvalidValue(String),
}

/// A config error: what and where.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{location}: {kind}")]
pub struct ConfigError {
    /// Where (boxed: errors stay small, so `Result<_, ConfigError>` is cheap to return).
    pub location: Box<ConfigLocation>,
    /// What.
    pub kind: ConfigErrorKind,
}

/// Errors of burn-te-debug.
#[derive(Debug, thiserror::Error)]
pub enum DebugError {
    /// A bad config file.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The diagnostics' step failed (e.g. stopped at a non-finite value, or a snapshot not written).
    #[error(transparent)]
    Diagnostics(#[from] burn_te::diagnostics::DiagnosticsError),
    /// The config file could not be read.
    #[error("cannot read config file {path}: {source}")]
    ReadConfig {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The log directory cannot be created or written.
    #[error("log directory {path} is not writable: {source}")]
    LogDir {
        /// The directory or file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// `initialize` while a session is running.
    #[error("the debug API is already initialized; call end() first")]
    AlreadyInitialized,
    /// A debug API call from a feature's code that would change the session under it.
    #[error("{0}() cannot be called from a feature's code (while the debug session runs it)")]
    Reentrant(&'static str),
    /// A call that needs an initialized session.
    #[error("the debug API is not initialized; call initialize() first")]
    NotInitialized,
    /// A feature registered twice under one name.
    #[error("feature \"{0}\" is already registered")]
    DuplicateFeature(String),
    /// Two features modify the same tensor of one GEMM.
    #[error(
        "{layer}: features \"{first}\" and \"{second}\" both modify tensor {tensor} of gemm {gemm}; only one may"
    )]
    ConflictingModify {
        /// The layer.
        layer: String,
        /// The GEMM.
        gemm: String,
        /// The tensor.
        tensor: String,
        /// The first feature.
        first: String,
        /// The second feature.
        second: String,
    },
    /// A feature failed on a tensor.
    #[error("{layer}: feature {feature} on tensor {tensor}: {reason}")]
    Feature {
        /// The layer.
        layer: String,
        /// The feature.
        feature: String,
        /// The tensor.
        tensor: String,
        /// Why.
        reason: String,
    },
    /// An FP8 op failed.
    #[error(transparent)]
    Te(#[from] TeError),
    /// Statistics of the step could not be read back; the others were logged.
    #[error("{} statistics of iteration {iteration} could not be read back (the others were logged): {}", errors.len(), errors.join("; "))]
    StatsRead {
        /// The iteration.
        iteration: u64,
        /// One message per failed read (`layer_tensor: error`).
        errors: Vec<String>,
    },
    /// The step's statistics could not be reduced across peers: this peer logged its own, unreduced.
    #[error(
        "statistics of iteration {iteration} were not reduced across peers (this peer logged its own): {reason}"
    )]
    Reduction {
        /// The iteration.
        iteration: u64,
        /// Why.
        reason: String,
    },
    /// Writing a log or dump file failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A log file could not be written during a step (returned by that `step()`, once, whatever the number of
    /// lines; again at each later step at which a write fails, not once they succeed). Training is not affected:
    /// the stats still went to `tracing` and the stat loggers, and the lines already in the file stay.
    #[error(
        "cannot write {path}: {source}; {lines} log line(s) of iteration {iteration} not written (training goes \
         on; the file keeps what it had and is appended to again once it can be)"
    )]
    LogWrite {
        /// The log file.
        path: PathBuf,
        /// The iteration whose step reports it.
        iteration: u64,
        /// Lines not written since the previous step.
        lines: usize,
        /// The first write's error.
        source: std::io::Error,
    },
}
