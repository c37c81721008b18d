//! `LayerNorm`: `(x - mean) / sqrt(var + eps) · γ + β` over the last dimension (TE's `te.LayerNorm`).

use burn::module::{Initializer, Param};
use burn::prelude::*;

use super::names::LayerName;
use super::parallel::TensorParallel;
use super::{check_features, epsilon, or_panic};
use crate::backend::TeBackend;
use crate::error::TeError;
use crate::fused::{self, NormKind, NormSpec};

/// Config of [`LayerNorm`].
#[derive(Config, Debug)]
pub struct LayerNormConfig {
    /// Size of the normalized (last) dimension.
    pub hidden_size: usize,
    /// Added to the variance.
    #[config(default = 1e-5)]
    pub eps: f64,
    /// Store γ centred on zero (initialized to 0, applied as `1 + γ`), which keeps weight decay from pulling the
    /// scale towards zero.
    #[config(default = false)]
    pub zero_centered_gamma: bool,
    /// The layer's name (see [`names`](super::names)).
    #[config(default = "None")]
    pub name: Option<String>,
}

/// Layer normalization over the last dimension, in high precision.
#[derive(Module, Debug)]
pub struct LayerNorm<B: Backend> {
    /// γ, `[hidden_size]`.
    pub weight: Param<Tensor<B, 1>>,
    /// β, `[hidden_size]`.
    pub bias: Param<Tensor<B, 1>>,
    eps: f64,
    zero_centered_gamma: bool,
    #[module(skip)]
    name: LayerName,
    /// Sequence parallelism: the input is this rank's token shard, and the parameters' gradients are summed over
    /// the tensor-parallel group.
    #[module(skip)]
    token_shards: Option<TensorParallel>,
}

impl LayerNormConfig {
    /// A layer norm on `device`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> LayerNorm<B> {
        or_panic(self.try_init(device))
    }

    /// A layer norm on `device`, or an error naming a negative or non-finite `eps`.
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<LayerNorm<B>, TeError> {
        self.init_named(LayerName::root(self.name.as_deref(), "layernorm"), device)
    }

    pub(crate) fn init_named<B: Backend>(
        &self,
        name: LayerName,
        device: &B::Device,
    ) -> Result<LayerNorm<B>, TeError> {
        let eps = epsilon(&name.to_string(), self.eps)?;
        Ok(LayerNorm {
            weight: gamma(self.hidden_size, self.zero_centered_gamma, device),
            bias: Initializer::Zeros.init([self.hidden_size], device),
            eps,
            zero_centered_gamma: self.zero_centered_gamma,
            name,
            token_shards: None,
        })
    }
}

/// γ's initial value: ones, or zeros when it is zero-centred.
pub(crate) fn gamma<B: Backend>(
    size: usize,
    zero_centered: bool,
    device: &B::Device,
) -> Param<Tensor<B, 1>> {
    let init = if zero_centered {
        Initializer::Zeros
    } else {
        Initializer::Ones
    };
    init.init([size], device)
}

/// γ as applied: `1 + γ` when zero-centred, broadcastable against `[.., hidden]`.
pub(crate) fn applied_gamma<B: Backend, const D: usize>(
    gamma: Tensor<B, 1>,
    zero_centered: bool,
) -> Tensor<B, D> {
    let gamma = if zero_centered { gamma + 1.0 } else { gamma };
    gamma.unsqueeze()
}

/// A norm's parameter as applied: through a copy into the tensor-parallel group on token shards.
pub(crate) fn token_shard_param<B: TeBackend>(
    token_shards: &Option<TensorParallel>,
    param: Tensor<B, 1>,
) -> Result<Tensor<B, 1>, TeError> {
    match token_shards {
        Some(parallel) => parallel.token_shard_param(param),
        None => Ok(param),
    }
}

/// A norm's γ, β (LayerNorm) and spec as the fused ops take them.
pub(crate) type FusedNormOperands<B> = (Tensor<B, 1>, Option<Tensor<B, 1>>, NormSpec);

impl<B: Backend> LayerNorm<B> {
    /// The same norm on token shards of the group of `parallel` when it is sequence-parallel.
    pub(crate) fn on_token_shards(self, parallel: Option<&TensorParallel>) -> Self {
        Self {
            token_shards: parallel.filter(|p| p.sequence_parallel()).cloned(),
            ..self
        }
    }
}

impl<B: TeBackend> LayerNorm<B> {
    /// Normalizes `x [.., hidden_size]`. Panics with [`try_forward`](Self::try_forward)'s error.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        or_panic(self.try_forward(x))
    }

    /// Normalizes `x [.., hidden_size]`, or an error naming the layer and the shape.
    pub fn try_forward<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, TeError> {
        check_features(&self.name(), "input", &x, self.weight.dims()[0])?;
        let (weight, bias, spec) = self.params()?;
        if let Some(y) = fused::norm::try_fused(&x, weight.clone(), Some(bias.clone()), spec)? {
            return Ok(y);
        }
        let (var, mean) = x.clone().var_mean_bias(D - 1);
        let normalized = (x - mean) / (var + self.eps).sqrt();
        Ok(normalized * applied_gamma::<B, D>(weight, self.zero_centered_gamma) + bias.unsqueeze())
    }

    /// γ and β as the fused op takes them, and its spec.
    pub(crate) fn fused_operands(&self) -> Result<FusedNormOperands<B>, TeError> {
        let (weight, bias, spec) = self.params()?;
        Ok((weight, Some(bias), spec))
    }

    /// γ and β as applied (on token shards, their gradients summed over the group), and the norm's spec.
    fn params(&self) -> Result<(Tensor<B, 1>, Tensor<B, 1>, NormSpec), TeError> {
        let spec = NormSpec {
            kind: NormKind::LayerNorm,
            eps: self.eps as f32,
            zero_centered_gamma: self.zero_centered_gamma,
        };
        let weight = token_shard_param(&self.token_shards, self.weight.val())?;
        let bias = token_shard_param(&self.token_shards, self.bias.val())?;
        Ok((weight, bias, spec))
    }

    /// The layer's name (see [`names`](super::names)).
    pub fn name(&self) -> String {
        self.name.resolve(&self.weight).to_string()
    }
}
