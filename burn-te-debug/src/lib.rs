//! # burn-te-debug
//!
//! Precision-debug tools for burn-te, after Transformer Engine's debug API (nvdlfw-inspect): a YAML config in
//! TE's format selects features per layer, the [`Debug<B>`](struct@Debug) backend decorator runs them on every GEMM, and
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
//!
//! # Layers
//! Plain types at the bottom (`error`, `tensor`, `routing`, `quantized`, [`stats`], [`dump`]), then the call API
//! that features implement (`feature`), the config (YAML → feature specs and schedules → sections, [`config`]),
//! the features built from their specs ([`features`], [`advisor`]), the debug path's stages (`pipeline`: route,
//! observe, run, reduce, log) and the stat loggers beside them ([`tensorboard`]), the session that threads each
//! GEMM through the stages (`options`, `session`) and the `Debug<B>` decorator that calls it (`debug`), and on top
//! `run_config` and `train`. No module imports one above it (`tests/kernels/layering.rs` checks every crate for
//! circles).
//!
//! # Burn coupling
//! Only the decorator and the tensors it hands the features use Burn's backend-generic API; the config, features,
//! statistics and session are plain Rust over the [`DebugTensor`](features::DebugTensor) trait:
//! - Burn-generic: `debug`, `pipeline::observe`.
//! - Plain: `advisor`, `config`, `dump`, `error`, `feature`, `features`, `options`, `pipeline`, `quantized`,
//!   `routing`, `run_config`, `session`, `stats`, `tensor`, `tensorboard`, `train`.

pub mod advisor;
pub mod config;
mod debug;
pub mod dump;
mod error;
mod feature;
pub mod features;
mod options;
mod pipeline;
mod quantized;
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
pub use options::DebugOptions;
pub use pipeline::log::{StatLogger, stat_message};
pub use pipeline::reduce::ReductionGroup;
pub use run_config::DebugConfig;
pub use session::{
    check_layers, end, initialize, initialize_training_step, iteration, log_message, paused,
    set_tensor_reduction_group, set_weight_reduction_group, stat_names, step,
};
pub use tensor::TensorName;
