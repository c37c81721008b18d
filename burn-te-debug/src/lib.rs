//! # burn-te-debug
//!
//! Precision-debug tools for burn-te, after Transformer Engine's debug API (nvdlfw-inspect): a YAML config in
//! TE's format selects features per layer, a `Debug<B>` backend decorator runs them on every GEMM, and statistics
//! go to log files, burn-train and TensorBoard.
//!
//! This crate is at its start: the statistics it will log are the mergeable records of [`burn_te_kernels`],
//! re-exported here; the config, features and decorator come next.

pub use burn_te_kernels::{Fp8Stats, TensorStats};
