//! The CubeCL kernels. Launch them through the launchers (`ops`, `block`, `nvfp4`, `gemm`), which check their arguments.

pub mod amax;
pub mod block;
pub mod block_range;
pub mod code;
pub mod code_view;
pub mod decode;
pub mod fp8;
pub mod gemm;
pub mod nvfp4;
pub mod quantize;
pub mod reduce;
pub mod scale;
pub mod stats;
pub mod transpose;
