//! `RMSNorm`: `x / sqrt(mean(x²) + eps) · γ` over the last dimension (TE's `te.RMSNorm`).

use burn::module::Param;
use burn::prelude::*;

use super::layer_norm::{FusedNormOperands, applied_gamma, gamma, token_shard_param};
use super::names::LayerName;
use super::parallel::TensorParallel;
use super::{check_features, epsilon, or_panic};
use crate::backend::TeBackend;
use crate::error::TeError;
use crate::fused::{self, NormKind, NormSpec};

/// Config of [`RmsNorm`].
#[derive(Config, Debug)]
pub struct RmsNormConfig {
    /// Size of the normalized (last) dimension.
    pub hidden_size: usize,
    /// Added to the mean square.
    #[config(default = 1e-5)]
    pub eps: f64,
    /// Store γ centred on zero (initialized to 0, applied as `1 + γ`).
    #[config(default = false)]
    pub zero_centered_gamma: bool,
    /// The layer's name (see [`names`](super::names)).
    #[config(default = "None")]
    pub name: Option<String>,
}

/// Root-mean-square normalization over the last dimension, in high precision.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// γ, `[hidden_size]`.
    pub weight: Param<Tensor<B, 1>>,
    eps: f64,
    zero_centered_gamma: bool,
    #[module(skip)]
    name: LayerName,
    /// Sequence parallelism: the input is this rank's token shard, and the parameters' gradients are summed over
    /// the tensor-parallel group.
    #[module(skip)]
    token_shards: Option<TensorParallel>,
}

impl RmsNormConfig {
    /// An RMS norm on `device`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> RmsNorm<B> {
        or_panic(self.try_init(device))
    }

    /// An RMS norm on `device`, or an error naming a negative or non-finite `eps`.
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<RmsNorm<B>, TeError> {
        self.init_named(LayerName::root(self.name.as_deref(), "rmsnorm"), device)
    }

    pub(crate) fn init_named<B: Backend>(
        &self,
        name: LayerName,
        device: &B::Device,
    ) -> Result<RmsNorm<B>, TeError> {
        let eps = epsilon(&name.to_string(), self.eps)?;
        Ok(RmsNorm {
            weight: gamma(self.hidden_size, self.zero_centered_gamma, device),
            eps,
            zero_centered_gamma: self.zero_centered_gamma,
            name,
            token_shards: None,
        })
    }
}

impl<B: Backend> RmsNorm<B> {
    /// The same norm on token shards of the group of `parallel` when it is sequence-parallel.
    pub(crate) fn on_token_shards(self, parallel: Option<&TensorParallel>) -> Self {
        Self {
            token_shards: parallel.filter(|p| p.sequence_parallel()).cloned(),
            ..self
        }
    }
}

impl<B: TeBackend> RmsNorm<B> {
    /// Normalizes `x [.., hidden_size]`. Panics with [`try_forward`](Self::try_forward)'s error.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        or_panic(self.try_forward(x))
    }

    /// Normalizes `x [.., hidden_size]`, or an error naming the layer and the shape.
    pub fn try_forward<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, TeError> {
        check_features(&self.name(), "input", &x, self.weight.dims()[0])?;
        let (weight, _, spec) = self.fused_operands()?;
        if let Some(y) = fused::norm::try_fused(&x, weight.clone(), None, spec)? {
            return Ok(y);
        }
        let mean_square = x.clone().square().mean_dim(D - 1);
        Ok(x / (mean_square + self.eps).sqrt()
            * applied_gamma::<B, D>(weight, self.zero_centered_gamma))
    }

    /// γ as the fused op takes it (on token shards, its gradient summed over the group), no β, and its spec.
    pub(crate) fn fused_operands(&self) -> Result<FusedNormOperands<B>, TeError> {
        let spec = NormSpec {
            kind: NormKind::RmsNorm,
            eps: self.eps as f32,
            zero_centered_gamma: self.zero_centered_gamma,
        };
        Ok((
            token_shard_param(&self.token_shards, self.weight.val())?,
            None,
            spec,
        ))
    }

    /// The layer's name (see [`names`](super::names)).
    pub fn name(&self) -> String {
        self.name.resolve(&self.weight).to_string()
    }
}
