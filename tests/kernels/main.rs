//! Kernel tests: bit-exact FP8 conformance (ml_dtypes vectors), statistics against f64 references, scaling rules,
//! on the host path and on every CubeCL runtime compiled in (wgpu always; CUDA with `--features cuda`).

// Burn 0.21's `distributed` feature (burn-te's `ddp`) leaves `Autodiff<B>` an `AutodiffBackend` only where `B` is a
// `DistributedBackend`, which Burn's CPU backends are not: this suite's references (`Autodiff<Flex>`,
// `Autodiff<NdArray<f64>>`) do not exist with it on.
#[cfg(feature = "ddp")]
compile_error!(
    "the kernel suite does not build with `--features ddp`: Burn 0.21's `distributed` feature takes \
     `AutodiffBackend` from `Autodiff<Flex>` and `Autodiff<NdArray<f64>>`, the suite's references. Run it without \
     `ddp`, and the DDP tests with `cargo test --features ddp --test ddp`."
);

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
mod device_choice;
mod device_gemm;
mod diagnostics;
mod distributed;
mod dropout;
mod elementwise;
mod feature_effects;
mod fp8_attention;
mod fp8_state;
mod fused;
mod fused_adam;
mod gemm;
mod grouped_linear;
mod host_gemm;
mod host_gemm_cache;
mod layering;
mod microbatch;
mod modules;
mod norm_cast;
mod nvfp4;
mod nvfp4_recipe;
mod plain_linear;
mod plan;
mod quantization_error;
mod saved_operands;
mod scaling;
mod settings;
mod statistics;
mod te;
mod tensor_parallel;
