//! The host FP8 GEMM of the CPU backends: which path runs ([`choice`]: forced, or the autotune's choice per shape
//! class, [`tune`], with the one-shape [`probe()`] for small GEMMs; both kept on disk by [`tune_cache`]), the packed paths on one CPU instruction each
//! (`packed`: `amxbf16`, `avx512bf16`, `avx512fma`, `avx2fma`) and the portable `f32` path (`decoded`), one GEMM
//! on a given path (`run`); several issued together (`grouped`).

pub mod choice;
mod decoded;
mod grouped;
pub(crate) mod operand;
mod packed;
pub mod probe;
mod run;
pub mod tune;
pub mod tune_cache;

pub use burn_te_kernels::host::gemm::HostGemmPath;
pub(crate) use choice::host_fp8_gemm;
pub use choice::{host_gemm_choices, requested_host_gemm_path, with_host_gemm_path};
pub(crate) use decoded::dequantize;
pub(crate) use grouped::{GroupedHostGemm, host_fp8_gemm_grouped};
pub use probe::{
    HOST_GEMM_PROBE, HOST_GEMM_PROBE_CACHED, HostGemmProbe, PREFERENCE_MARGIN, PROBE_SHAPE,
    measure, preferred, probe,
};
pub use run::HOST_FP8_GEMM;
pub use tune::{
    HOST_GEMM_TUNINGS, HostGemmTuning, OUTPACED_FACTOR, RUNS_BEFORE_DROP, TUNED_MIN_PRODUCT,
    TunedRoute, dropped_after, host_gemm_tunings, outpaced, outpaced_on_probe, timing_order,
    tuned_route,
};
pub use tune_cache::{HOST_GEMM_CACHE_ENV, HOST_GEMM_TUNINGS_CACHED, host_gemm_cache_file};
