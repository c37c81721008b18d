//! # burn-te-kernels
//!
//! The CubeCL kernels of burn-te and their host reference, without any Burn types:
//!
//! - the FP8 formats [`Fp8Format::E4M3`] and [`Fp8Format::E5M2`] with bit-exact encode/decode
//!   (round to nearest-even, saturating, NaN → NaN), as `#[cube]` functions ([`kernel::fp8`]) and in plain Rust
//!   ([`Fp8Format::encode`], [`Fp8Format::decode`]);
//! - kernels that quantize (optionally fusing the amax), dequantize, fake-quantize, take the amax, compute
//!   Transformer Engine's scales and update delayed-scaling histories ([`ops`]);
//! - one-pass statistics ([`ops::tensor_stats`], [`ops::fp8_tensor_stats`]) whose [`TensorStats`] /
//!   [`Fp8Stats`] records merge exactly across tensors and micro-batches;
//! - FP8 GEMM with f32 accumulation, batched, any shape, operands used as is or transposed, per-tensor or
//!   per-block scales ([`gemm::fp8_gemm`]); on cubek-matmul's tiled matmuls ([`gemm::cubek`]) and on decoded
//!   operands ([`gemm::decoded`]); on CUDA also cuBLASLt's FP8 matmul on the tensor cores (`gemm::cublaslt`,
//!   feature `cuda`); and block quantization for Float8BlockScaling and MXFP8 ([`block`]);
//! - the host path ([`host`]), bit-identical to the kernels, which the tests use as reference and burn-te uses on
//!   backends without a CubeCL device.
//!
//! FP8 codes are stored four per `u32` word because wgpu has no 8-bit storage type.
//!
//! # Burn coupling
//! None: the kernels and the host reference are plain Rust and CubeCL, usable without Burn.
//! - Burn-generic: none.
//! - Plain: `block`, `block_range`, `error`, `gemm` (with `cubek`, `cublaslt`, `decoded`, `transpose`), `host`,
//!   `kernel`, `numerics` (`format`, `scale_block`, `scaling`, `stats`), `nvfp4`, `ops`.
//!
//! # Layout
//! - `numerics/`: the plain types (formats, scale blocks, TE's scaling rule, statistics records), re-exported here;
//! - `kernel/`: the `#[cube]` kernels; `host/`: their plain-Rust reference and the CPU backends' implementation;
//! - `ops`, `block`, `block_range`, `nvfp4`: the launchers of the element-wise, block and statistics kernels;
//! - `gemm/`: the FP8 GEMM's launchers: the SIMT kernel and the operand types (`gemm`), cubek's tiled matmuls,
//!   decoded operands, cuBLASLt and the transposed codes it reads.

pub mod block;
pub mod block_range;
mod error;
pub mod gemm;
pub mod host;
pub mod kernel;
mod numerics;
pub mod nvfp4;
pub mod ops;

pub use error::KernelError;
pub use numerics::{
    AmaxComputeAlgo, BlockScaleRule, DelayedScalingHistory, Fp8Format, Fp8Stats, ScaleBlock,
    TensorStats, pow2_margin, scale_from_amax,
};

/// The CubeCL version these kernels are written for (re-exported so users launch them with the same one).
pub use cubecl;
