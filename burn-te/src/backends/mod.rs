//! The backends that implement [`TeBackend`](crate::TeBackend), one layer above the GEMM path and below the
//! decorators:
//! - [`cube`]: Burn's CubeCL backends (wgpu, CUDA), the kernels of `burn-te-kernels` on the tensors' device buffers;
//!   the FP8 GEMM on the path [`cube::gemm_path`] chooses (cuBLASLt on CUDA, cubek's tiled or decoded GEMM, the
//!   SIMT kernel);
//! - [`host`]: the CPU backends (burn-flex, burn-ndarray), the same numerics as the kernels; the FP8 GEMM on the
//!   CPU's fastest exact instruction ([`host::gemm`]);
//! - `fusion` (feature `fusion`): Burn's fusion backends (`Fusion<B>`), each FP8 op run eagerly on the inner
//!   backend.
//!
//! `Wgpu` and `Cuda` here are CubeCL's backends without Burn's fusion (`Te` implements `TeBackend` on
//! `CubeBackend` directly). With the `fusion` feature (default), Burn's own `burn::backend::Wgpu` / `Cuda`
//! (`Fusion<CubeBackend<..>>`) work as `Te`'s inner backend too, keeping Burn's fused kernels for every op but the
//! FP8 ones.

pub mod cube;
#[cfg(feature = "fusion")]
mod fusion;
pub mod host;

/// Burn's wgpu backend without fusion: `CubeBackend<WgpuRuntime, f32, i32, u32>`.
#[cfg(feature = "wgpu")]
pub type Wgpu = burn_cubecl::CubeBackend<burn_te_kernels::cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
/// Burn's CUDA backend without fusion: `CubeBackend<CudaRuntime, f32, i32, u8>`.
#[cfg(feature = "cuda")]
pub type Cuda = burn_cubecl::CubeBackend<burn_te_kernels::cubecl::cuda::CudaRuntime, f32, i32, u8>;
