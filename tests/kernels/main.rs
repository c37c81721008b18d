//! Kernel tests: bit-exact FP8 conformance (ml_dtypes vectors), statistics against f64 references, scaling rules,
//! on the host path and on every CubeCL runtime compiled in (wgpu always; CUDA with `--features cuda`).

mod advisor;
mod bad_tensors;
mod burn_data;
mod char_lm;
mod cli;
mod common;
mod conformance;
mod dashboard;
mod data_parallel;
mod debug;
mod decorator;
mod diagnostics;
mod distributed;
mod dropout;
mod elementwise;
mod feature_effects;
mod fp8_attention;
mod fp8_state;
mod fused;
mod gemm;
mod grouped_linear;
mod host_gemm;
mod layering;
mod microbatch;
mod modules;
mod nvfp4;
mod nvfp4_recipe;
mod plain_linear;
mod plan;
mod quantization_error;
mod saved_operands;
mod scaling;
mod statistics;
mod te;
mod tensor_parallel;
