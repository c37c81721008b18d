//! The host FP8 GEMM of the CPU backends: which path runs ([`choice`]), the packed paths on one CPU instruction
//! each (`packed`: `avx512bf16`, `avx512fma`, `avx2fma`) and the portable `f32` path (`decoded`); several issued together
//! (`grouped`).

pub mod choice;
mod decoded;
mod grouped;
pub(crate) mod operand;
mod packed;
mod run;

pub use burn_te_kernels::host::gemm::HostGemmPath;
pub(crate) use choice::host_fp8_gemm;
pub use choice::{
    HOST_FP8_GEMM, HOST_GEMM_PROBE, HostGemmProbe, PROBE_SHAPE, measure, probe,
    requested_host_gemm_path, with_host_gemm_path,
};
pub(crate) use decoded::dequantize;
pub(crate) use grouped::{GroupedHostGemm, host_fp8_gemm_grouped};
