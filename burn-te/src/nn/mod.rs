//! Transformer Engine's modules for Burn (`transformer_engine.pytorch` → `burn_te::nn`).
//!
//! Every module is a `#[derive(Module)]` with a `#[derive(Config)]` config and `init(&device)`. Every GEMM goes
//! through [`TeBackend::te_linear`](crate::TeBackend::te_linear) with its [`GemmSite`](crate::GemmSite), so it runs
//! in FP8 inside an [`fp8_autocast`](crate::fp8_autocast) scope (its dgrad and wgrad too) and the debug tools see
//! it under the layer's name (see [`names`]). Normalizations, activations and the attention core run in high
//! precision, as in TE.
//!
//! Each module has `try_forward`, returning a [`TeError`] that names the module and the bad shape, and `forward`,
//! which panics with that message (Burn modules' convention). Configs with constraints have `try_init`.

mod activation;
mod attention;
mod grouped_linear;
mod layer_norm;
mod layernorm_linear;
mod layernorm_mlp;
mod linear;
mod multihead_attention;
pub mod names;
mod norm;
pub mod parallel;
mod rms_norm;
mod transformer_layer;

pub use activation::Activation;
pub use attention::{AttnMaskType, DotProductAttention, DotProductAttentionConfig, QkvFormat};
pub use grouped_linear::{GroupedLinear, GroupedLinearConfig};
pub use layer_norm::{LayerNorm, LayerNormConfig};
pub use layernorm_linear::{LayerNormLinear, LayerNormLinearConfig};
pub use layernorm_mlp::{LayerNormMLP, LayerNormMLPConfig};
pub use linear::{Linear, LinearConfig};
pub use multihead_attention::{MultiheadAttention, MultiheadAttentionConfig};
pub use names::{LayerName, infer_layer_names};
pub use norm::{Norm, Normalization};
pub use parallel::{ParallelMode, TensorParallel};
pub use rms_norm::{RmsNorm, RmsNormConfig};
pub use transformer_layer::{TransformerLayer, TransformerLayerConfig};

use burn::prelude::*;

use crate::error::TeError;

/// What a TE module's `forward_all` returns: the output, and what TE returns beside it on request.
#[derive(Debug, Clone)]
pub struct ModuleOutput<B: Backend, const D: usize> {
    /// The output (without the last bias when `return_bias` is set).
    pub output: Tensor<B, D>,
    /// With `return_bias`: the bias not added to `output`, for the caller to fuse.
    pub bias: Option<Tensor<B, 1>>,
    /// With `return_layernorm_output`: the normalized input.
    pub layernorm_output: Option<Tensor<B, D>>,
}

/// Panics with the error's message: `forward` of the modules, whose `try_forward` returns it.
pub(crate) fn or_panic<T>(result: Result<T, TeError>) -> T {
    result.unwrap_or_else(|err| panic!("{err}"))
}

/// Checks that the last dimension of `x` is `expected`.
pub(crate) fn check_features<B: Backend, const D: usize>(
    module: &str,
    what: &str,
    x: &Tensor<B, D>,
    expected: usize,
) -> Result<(), TeError> {
    let dims = x.dims();
    if D == 0 || dims[D - 1] != expected {
        return Err(TeError::InvalidShape {
            module: module.to_string(),
            reason: format!("expected {what} with last dimension {expected}"),
            shape: dims.to_vec(),
        });
    }
    Ok(())
}

/// Burn's `Dropout` with probability `prob` of config key `key`, or an error unless `0 ≤ prob < 1` (at 1 the
/// survivors' scale `1/(1 - prob)` is infinite).
pub(crate) fn dropout(module: &str, key: &str, prob: f64) -> Result<burn::nn::Dropout, TeError> {
    if !(0.0..1.0).contains(&prob) {
        return Err(config_error(
            module,
            format!("{key} must be in [0, 1), got {prob}"),
        ));
    }
    Ok(burn::nn::DropoutConfig::new(prob).init())
}

/// A normalization's epsilon, or an error unless it is finite and ≥ 0 (a negative or NaN one makes every output
/// NaN).
pub(crate) fn epsilon(module: &str, eps: f64) -> Result<f64, TeError> {
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(config_error(
            module,
            format!("eps must be finite and >= 0, got {eps}"),
        ));
    }
    Ok(eps)
}

/// A config error of `module`.
pub(crate) fn config_error(module: &str, reason: impl Into<String>) -> TeError {
    TeError::InvalidConfig {
        module: module.to_string(),
        reason: reason.into(),
    }
}
