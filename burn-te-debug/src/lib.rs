//! # burn-te-debug
//!
//! Precision-debug tools for burn-te, after Transformer Engine's debug API (nvdlfw-inspect): a YAML config in
//! TE's format selects features per layer, the [`Debug<B>`](Debug) backend decorator runs them on every GEMM, and
//! statistics go to log files.
//!
//! ```no_run
//! use burn::backend::Autodiff;
//! use burn_te::{Te, backends::Wgpu};
//! use burn_te_debug::{Debug, DebugOptions};
//! type B = Autodiff<Debug<Te<Wgpu>>>;
//! burn_te_debug::initialize(DebugOptions::new("config.yaml").log_dir("./log")).unwrap();
//! for _ in 0..5 {
//!     // forward and backward pass ...
//!     burn_te_debug::step().unwrap();
//! }
//! burn_te_debug::end().unwrap();
//! ```

pub mod advisor;
pub mod config;
mod debug;
pub mod dump;
mod error;
pub mod features;
mod log;
mod reduction;
mod routing;
mod run_config;
mod session;
pub mod stats;
mod tensor;
pub mod tensorboard;
#[cfg(feature = "train")]
pub mod train;

pub use burn_te_kernels::{Fp8Stats, TensorStats};
pub use debug::Debug;
pub use error::{ConfigError, ConfigErrorKind, ConfigLocation, DebugError};
pub use log::stat_message;
pub use reduction::{ReductionGroup, set_tensor_reduction_group, set_weight_reduction_group};
pub use run_config::DebugConfig;
pub use session::{
    DebugOptions, StatLogger, check_layers, end, initialize, initialize_training_step, iteration,
    log_message, paused, stat_names, step,
};
pub use tensor::TensorName;
