//! `LayerNormMLP`: normalization, FC1, activation, FC2 (TE's `te.LayerNormMLP`). Its GEMMs are named
//! `{name}.fc1` and `{name}.fc2`, as in TE.

use burn::module::Initializer;
use burn::prelude::*;

use super::activation::Activation;
use super::layernorm_linear::rename;
use super::linear::{Linear, LinearConfig};
use super::names::LayerName;
use super::norm::{Norm, Normalization};
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
    /// A LayerNormMLP on `device`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> LayerNormMLP<B> {
        self.init_named(
            LayerName::root(self.name.as_deref(), "layernorm_mlp"),
            device,
        )
    }

    pub(crate) fn init_named<B: Backend>(
        &self,
        name: LayerName,
        device: &B::Device,
    ) -> LayerNormMLP<B> {
        let fc1_width = self.ffn_hidden_size * if self.activation.is_gated() { 2 } else { 1 };
        let linear = |d_in, d_out, field, return_bias| {
            LinearConfig::new(d_in, d_out)
                .with_bias(self.bias)
                .with_return_bias(return_bias)
                .with_initializer(self.initializer.clone())
                .init_named(name.child(field, None), device)
        };
        LayerNormMLP {
            layer_norm: self.normalization.init(
                self.hidden_size,
                self.eps,
                self.zero_centered_gamma,
                name.child("layer_norm", None),
                device,
            ),
            fc1: linear(self.hidden_size, fc1_width, "fc1", false),
            // FC2 returns its bias instead of adding it with `return_bias`.
            fc2: linear(
                self.ffn_hidden_size,
                self.hidden_size,
                "fc2",
                self.return_bias,
            ),
            activation: self.activation,
            return_layernorm_output: self.return_layernorm_output,
            name,
        }
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
        let normalized = self
            .layer_norm
            .try_forward(x)
            .map_err(|err| rename(err, &self.name()))?;
        let hidden = self.fc1.try_forward(normalized.clone())?;
        let hidden = self.activation.apply(hidden)?;
        let output = self.fc2.forward_all(hidden)?;
        Ok(ModuleOutput {
            layernorm_output: self.return_layernorm_output.then_some(normalized),
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
