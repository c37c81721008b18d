//! # burn-te
//!
//! FP8 training for [Burn](https://burn.dev), after NVIDIA Transformer Engine.
//!
//! - [`Te<B>`](Te): a backend decorator. Inside an [`fp8_autocast`] scope, Burn's `linear` (so every plain
//!   `burn::nn::Linear`), its dgrad and wgrad, and `matmul` run in FP8 with the scope's [`Recipe`]; every other op
//!   forwards to `B`. Train with `Autodiff<Te<B>>`.
//! - [`TeBackend`]: the FP8 ops on a backend's tensors (quantize, dequantize, FP8 GEMM, amax, fake-quant,
//!   statistics, delayed-scaling states) — CubeCL kernels on wgpu/CUDA, the bit-identical host path on NdArray —
//!   and the TE modules' fused element-wise ops (`fused`: norm, activation, softmax; fused kernels on the host path).
//! - Recipes with TE's defaults: [`DelayedScaling`], [`Float8CurrentScaling`], [`Float8BlockScaling`],
//!   [`MXFP8BlockScaling`].
//! - [`GemmSite`]s name every GEMM (layer, fprop/dgrad/wgrad) for the debug tools.
//!
//! ```no_run
//! use burn::backend::{Autodiff, NdArray};
//! use burn_te::{DelayedScaling, Te, fp8_autocast};
//! type B = Autodiff<Te<NdArray>>;
//! # fn forward(x: burn::tensor::Tensor<B, 2>) -> burn::tensor::Tensor<B, 2> { x }
//! # let x = burn::tensor::Tensor::<B, 2>::zeros([2, 2], &Default::default());
//! let y = fp8_autocast(true, DelayedScaling::default(), || forward(x)).unwrap();
//! ```
//!
//! # Layers
//! Plain types at the bottom (`error`, `hash`, `recipe`, `primitive`, `metrics`, and the GEMM vocabulary in `gemm`),
//! then the FP8 state (`fp8_state`, with its sites and autocast scope in `fp8_state::site` and `fp8_state::autocast`),
//! the [`TeBackend`] trait (`backend`, with the fused element-wise ops' types in `fused`), the GEMM path built on it
//! (`gemm::fp8`, `gemm::nvfp4`, `gemm::saved`, `gemm::microbatch`, `gemm::high_precision`, `gemm::plain_linear`, and
//! `linear`), the backends that implement it (`backends`: `cube`, `host` with its FP8 GEMM in `host::gemm`, `fusion`)
//! and, on top, the decorators (`decorators`: `te`, the forwarding, `autodiff`, whose fused ops' backward nodes are
//! in `fused::*`, and `ddp`), the diagnostics that observe them through the `metrics` registry and the modules
//! (`nn`). No module imports one above it (`tests/kernels/layering.rs` checks every crate for circles).
//!
//! # Burn coupling
//! Burn 0.22 removed the backend type parameter from `Tensor`, so a decorator backend cannot plug in there; what a
//! port to another Burn runtime would replace is the code on Burn's backend-generic API (`Backend`, `Tensor<B, D>`,
//! `B::` ops, `Module`), named here and checked by `tests/kernels/layering.rs`:
//! - Burn-generic: `backend`, `backends`, `decorators`, `diagnostics::closures`, `diagnostics::eager`,
//!   `diagnostics::nonfinite`, `diagnostics::observe`, `diagnostics::snapshot`, `distributed`, `fp8_state`,
//!   `fused::activation`, `fused::attention`, `fused::cast_linear`, `fused::dropout`, `fused::norm`,
//!   `fused::softmax`, `gemm::fp8`, `gemm::high_precision`, `gemm::microbatch`, `gemm::nvfp4`, `gemm::plain_linear`,
//!   `gemm::saved`, `linear`, `nn`, `optim`, `readback`.
//! - Plain: `backends::host::gemm`, `data`, `diagnostics`, `diagnostics::trace`, `distributed::launch`, `error`,
//!   `fallback`, `fp8_state::autocast`, `fp8_state::site`, `fused`, `gemm`, `hash`, `metrics`, `plan`, `primitive`,
//!   `recipe`, `settings`.

pub mod backend;
pub mod backends;
pub mod data;
pub mod decorators;
pub mod diagnostics;
#[cfg(feature = "distributed")]
pub mod distributed;
mod error;
pub mod fallback;
pub mod fp8_state;
pub mod fused;
pub mod gemm;
mod hash;
pub mod linear;
mod metrics;
pub mod nn;
pub mod optim;
pub mod plan;
mod primitive;
mod readback;
pub mod recipe;
pub mod settings;

pub use backend::{
    ElementFormat, Fp8HostData, Fp8Primitive, Fp8Tensor, Nvfp4Scales, Scaling, TeBackend,
};
pub use burn_te_kernels::nvfp4::{Nvfp4Rounding, Nvfp4Tile};
pub use burn_te_kernels::{
    AmaxComputeAlgo, BlockScaleRule, DelayedScalingHistory, Fp8Format, Fp8Stats, KernelError,
    ScaleBlock, TensorStats, pow2_margin, scale_from_amax,
};
pub use data::{fake_quant, quantize, tensor_stats};
pub use decorators::Decorator;
pub use decorators::te::Te;
pub use error::TeError;
pub use fallback::fallback_counts;
pub use fp8_state::autocast::{
    AutocastGuard, ScopeRecipe, active_plan, active_recipe, fp8_autocast, fp8_autocast_guard,
    fp8_autocast_guard_with, fp8_autocast_with, generation, is_fp8_enabled,
    seed_stochastic_rounding,
};
pub use fp8_state::site::GemmSite;
pub use fp8_state::{
    DelayedStateView, Fp8LinearStates, Fp8Meta, LayerFp8State, PlainLinearStates, RoleRecord,
};
pub use gemm::microbatch::{microbatch, microbatch_guard};
pub use gemm::plain_linear::{plain_linear_backward, plain_linear_forward};
pub use gemm::saved::{Saved, SavedOperand, SavedQuantized, save_original_operands};
pub use gemm::{Gemm, TensorRole};
pub use plan::{PlanError, PlanRule, PlannedRecipe, RecipePlan};
pub use recipe::{
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling,
    NVFP4BlockScaling, Recipe,
};

#[doc(hidden)]
pub mod __private {
    pub use burn;
    pub use burn::tensor::ops::{BoolTensor, FloatTensor};
}
