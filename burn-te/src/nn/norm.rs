//! The normalization of the fused TE modules: LayerNorm or RMSNorm.

use burn::prelude::*;

use super::layer_norm::{FusedNormOperands, LayerNorm, LayerNormConfig};
use super::names::LayerName;
use super::parallel::TensorParallel;
use super::rms_norm::{RmsNorm, RmsNormConfig};
use crate::backend::TeBackend;
use crate::error::TeError;

/// Which normalization a fused module applies (TE's `normalization="LayerNorm" | "RMSNorm"`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Normalization {
    /// [`LayerNorm`].
    LayerNorm,
    /// [`RmsNorm`].
    RMSNorm,
}

/// A LayerNorm or an RMSNorm.
#[derive(Module, Debug)]
pub enum Norm<B: Backend> {
    /// Layer normalization.
    LayerNorm(LayerNorm<B>),
    /// RMS normalization.
    RmsNorm(RmsNorm<B>),
}

impl Normalization {
    pub(crate) fn init<B: Backend>(
        self,
        hidden_size: usize,
        eps: f64,
        zero_centered_gamma: bool,
        name: LayerName,
        device: &B::Device,
    ) -> Result<Norm<B>, TeError> {
        Ok(match self {
            Normalization::LayerNorm => Norm::LayerNorm(
                LayerNormConfig::new(hidden_size)
                    .with_eps(eps)
                    .with_zero_centered_gamma(zero_centered_gamma)
                    .init_named(name, device)?,
            ),
            Normalization::RMSNorm => Norm::RmsNorm(
                RmsNormConfig::new(hidden_size)
                    .with_eps(eps)
                    .with_zero_centered_gamma(zero_centered_gamma)
                    .init_named(name, device)?,
            ),
        })
    }
}

impl<B: Backend> Norm<B> {
    /// The same norm on token shards of the group of `parallel` when it is sequence-parallel (its parameters'
    /// gradients summed over the group).
    pub(crate) fn on_token_shards(self, parallel: Option<&TensorParallel>) -> Self {
        match self {
            Norm::LayerNorm(norm) => Norm::LayerNorm(norm.on_token_shards(parallel)),
            Norm::RmsNorm(norm) => Norm::RmsNorm(norm.on_token_shards(parallel)),
        }
    }
}

impl<B: TeBackend> Norm<B> {
    /// γ, β and the spec as the fused ops take them.
    pub(crate) fn fused_operands(&self) -> Result<FusedNormOperands<B>, TeError> {
        match self {
            Norm::LayerNorm(norm) => norm.fused_operands(),
            Norm::RmsNorm(norm) => norm.fused_operands(),
        }
    }

    /// Normalizes `x [.., hidden]`, or an error naming the layer and the shape.
    pub fn try_forward<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, TeError> {
        match self {
            Norm::LayerNorm(norm) => norm.try_forward(x),
            Norm::RmsNorm(norm) => norm.try_forward(x),
        }
    }
}

/// Reports a sublayer's shape error under the fused module's name.
pub(crate) fn rename(err: TeError, module: &str) -> TeError {
    match err {
        TeError::InvalidShape { reason, shape, .. } => TeError::InvalidShape {
            module: module.to_string(),
            reason,
            shape,
        },
        other => other,
    }
}
