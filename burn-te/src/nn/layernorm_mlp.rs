//! `LayerNormMLP`: normalization, FC1, activation, FC2 (TE's `te.LayerNormMLP`). Its GEMMs are named
//! `{name}.fc1` and `{name}.fc2`, as in TE.

use burn::module::Initializer;
use burn::prelude::*;

use super::activation::Activation;
use super::linear::{Before, Linear, LinearConfig};
use super::names::LayerName;
use super::norm::{Norm, Normalization, rename};
use super::parallel::ParallelMode;
use super::{ModuleOutput, or_panic};
use crate::backend::TeBackend;
use crate::error::TeError;

/// Config of [`LayerNormMLP`].
#[derive(Config, Debug)]
pub struct LayerNormMLPConfig {
    /// Input and output features.
    pub hidden_size: usize,
    /// Width of the hidden layer (after the activation; FC1 is twice as wide for gated activations).
    pub ffn_hidden_size: usize,
    /// The normalization's epsilon.
    #[config(default = 1e-5)]
    pub eps: f64,
    /// LayerNorm or RMSNorm.
    #[config(default = "Normalization::LayerNorm")]
    pub normalization: Normalization,
    /// The normalization's γ is zero-centred.
    #[config(default = false)]
    pub zero_centered_gamma: bool,
    /// The activation between FC1 and FC2.
    #[config(default = "Activation::Gelu")]
    pub activation: Activation,
    /// FC1 and FC2 learn biases.
    #[config(default = true)]
    pub bias: bool,
    /// Return FC2's bias beside the output instead of adding it.
    #[config(default = false)]
    pub return_bias: bool,
    /// Also return the normalized input ([`LayerNormMLP::forward_all`]).
    #[config(default = false)]
    pub return_layernorm_output: bool,
    /// The layer's name (see [`names`](super::names)).
    #[config(default = "None")]
    pub name: Option<String>,
    /// Weight initializer of FC1 and FC2 (TE's default: normal, std 0.023).
    #[config(default = "Initializer::Normal { mean: 0.0, std: 0.023 }")]
    pub initializer: Initializer,
    /// Split over the tensor-parallel group as TE's `set_parallel_mode`: FC1 column-parallel, FC2 row-parallel
    /// (see [`parallel`](super::parallel)).
    #[config(default = false)]
    pub set_parallel_mode: bool,
    /// Ranks in the tensor-parallel group: consecutive ranks of the peer bound to this thread.
    #[config(default = 1)]
    pub tp_size: usize,
    /// Sequence parallelism: input and output are this rank's token shards; the normalization runs on them.
    #[config(default = false)]
    pub sequence_parallel: bool,
}

/// Normalization and a two-layer MLP whose six GEMMs (fprop, dgrad, wgrad of FC1 and FC2) run in FP8 inside
/// an autocast scope.
#[derive(Module, Debug)]
pub struct LayerNormMLP<B: Backend> {
    /// The normalization.
    pub layer_norm: Norm<B>,
    /// `hidden → ffn` (`→ 2·ffn` for gated activations).
    pub fc1: Linear<B>,
    /// `ffn → hidden`.
    pub fc2: Linear<B>,
    activation: Activation,
    return_layernorm_output: bool,
    #[module(skip)]
    name: LayerName,
}

impl LayerNormMLPConfig {
    /// A LayerNormMLP on `device`. Panics with [`try_init`](Self::try_init)'s error.
    pub fn init<B: Backend>(&self, device: &B::Device) -> LayerNormMLP<B> {
        or_panic(self.try_init(device))
    }

    /// A LayerNormMLP on `device`, or an error when its tensor-parallel split does not fit (see
    /// [`LinearConfig::try_init`]).
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<LayerNormMLP<B>, TeError> {
        self.init_named(
            LayerName::root(self.name.as_deref(), "layernorm_mlp"),
            device,
        )
    }

    pub(crate) fn init_named<B: Backend>(
        &self,
        name: LayerName,
        device: &B::Device,
    ) -> Result<LayerNormMLP<B>, TeError> {
        let (fc1, fc2, pieces) = self.linear_configs();
        let fc1 = fc1.init_in_pieces(name.child("fc1", None), pieces, device)?;
        let fc2 = fc2.init_named(name.child("fc2", None), device)?;
        let layer_norm = self
            .normalization
            .init(
                self.hidden_size,
                self.eps,
                self.zero_centered_gamma,
                name.child("layer_norm", None),
                device,
            )?
            .on_token_shards(fc1.parallel());
        Ok(LayerNormMLP {
            layer_norm,
            fc1,
            fc2,
            activation: self.activation,
            return_layernorm_output: self.return_layernorm_output,
            name,
        })
    }

    /// This rank's shard of `whole`, a LayerNormMLP of this config without tensor parallelism: FC1's and FC2's
    /// shards (see [`LinearConfig::shard`]), the normalization whole. [`LayerNormMLP::gather`] is the inverse.
    pub fn shard<B: Backend>(&self, whole: LayerNormMLP<B>) -> Result<LayerNormMLP<B>, TeError> {
        let (fc1, fc2, pieces) = self.linear_configs();
        let fc1 = fc1.shard_in_pieces(whole.fc1, pieces)?;
        let fc2 = fc2.shard(whole.fc2)?;
        Ok(LayerNormMLP {
            layer_norm: whole.layer_norm.on_token_shards(fc1.parallel()),
            fc1,
            fc2,
            ..whole
        })
    }

    /// FC1's and FC2's configs, and FC1's pieces: a gated FC1's outputs are the gate's and the value's, each split
    /// over the group on its own.
    fn linear_configs(&self) -> (LinearConfig, LinearConfig, Vec<usize>) {
        let gated = self.activation.is_gated();
        let linear = |d_in, d_out, return_bias, mode| {
            LinearConfig::new(d_in, d_out)
                .with_bias(self.bias)
                .with_return_bias(return_bias)
                .with_initializer(self.initializer.clone())
                .with_parallel_mode(self.set_parallel_mode.then_some(mode))
                .with_tp_size(self.tp_size)
                .with_sequence_parallel(self.sequence_parallel)
        };
        let fc1 = linear(
            self.hidden_size,
            self.ffn_hidden_size * if gated { 2 } else { 1 },
            false,
            ParallelMode::Column,
        );
        // FC2 returns its bias instead of adding it with `return_bias`.
        let fc2 = linear(
            self.ffn_hidden_size,
            self.hidden_size,
            self.return_bias,
            ParallelMode::Row,
        );
        let pieces = if gated { vec![1, 1] } else { vec![1] };
        (fc1, fc2, pieces)
    }
}

impl<B: Backend> LayerNormMLP<B> {
    /// The whole module from every rank's shard (a collective call over the tensor-parallel group; see
    /// [`Linear::gather`]). [`LayerNormMLPConfig::shard`] is the inverse.
    pub fn gather(&self) -> Result<LayerNormMLP<B>, TeError> {
        Ok(LayerNormMLP {
            layer_norm: self.layer_norm.clone().on_token_shards(None),
            fc1: self.fc1.gather()?,
            fc2: self.fc2.gather()?,
            ..self.clone()
        })
    }
}

impl<B: TeBackend> LayerNormMLP<B> {
    /// `fc2(act(fc1(norm(x))))` for `x [.., hidden_size]`. Panics with [`try_forward`](Self::try_forward)'s error.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        or_panic(self.try_forward(x))
    }

    /// [`forward`](Self::forward), or an error naming the layer and the bad shape.
    pub fn try_forward<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, TeError> {
        Ok(self.forward_all(x)?.output)
    }

    /// The output, FC2's bias with `return_bias`, and the normalized input with `return_layernorm_output`.
    pub fn forward_all<const D: usize>(
        &self,
        x: Tensor<B, D>,
    ) -> Result<ModuleOutput<B, D>, TeError> {
        let module = self.name();
        let (hidden, normalized) = if self.return_layernorm_output {
            let normalized = self
                .layer_norm
                .try_forward(x)
                .map_err(|err| rename(err, &module))?;
            (self.fc1.try_forward(normalized.clone())?, Some(normalized))
        } else {
            let fc1 = self
                .fc1
                .forward_after(Before::Norm(&self.layer_norm, &module), x)?;
            (fc1.output, None)
        };
        let output = self
            .fc2
            .forward_after(Before::Activation(self.activation), hidden)?;
        Ok(ModuleOutput {
            layernorm_output: normalized,
            ..output
        })
    }

    /// The module's name; its GEMMs are [`fc1`](Self::fc1)'s and [`fc2`](Self::fc2)'s (`{name}.fc1`, `{name}.fc2`).
    pub fn name(&self) -> String {
        let fc1 = self.fc1.name();
        fc1.strip_suffix(".fc1").unwrap_or(&fc1).to_string()
    }

    /// The names of its GEMM layers in forward order: `fc1`'s, then `fc2`'s.
    pub fn gemm_layers(&self) -> Vec<String> {
        vec![self.fc1.name(), self.fc2.name()]
    }
}
