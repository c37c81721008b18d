//! `TransformerLayer`: pre-norm self-attention and MLP blocks with residual connections (TE's
//! `te.TransformerLayer`, encoder layer). GEMM names, for a layer named `transformer_layer`:
//! `transformer_layer.self_attention.layernorm_qkv`, `transformer_layer.self_attention.proj`,
//! `transformer_layer.layernorm_mlp.fc1` and `transformer_layer.layernorm_mlp.fc2`.
//!
//! Dropout as in TE: `hidden_dropout` on each block's output before its residual add, `attention_dropout` on the
//! attention probabilities; both 0.1 by default, active on autodiff backends only (Burn's `Dropout`: off under
//! `model.valid()`), drawn from the backend's random generator (`B::seed` makes runs repeat).

use burn::module::Initializer;
use burn::nn::Dropout;
use burn::prelude::*;

use super::activation::Activation;
use super::attention::{AttnMaskType, QkvFormat};
use super::layernorm_mlp::{LayerNormMLP, LayerNormMLPConfig};
use super::multihead_attention::{MultiheadAttention, MultiheadAttentionConfig};
use super::names::LayerName;
use super::norm::Normalization;
use super::{dropout, or_panic};
use crate::backend::TeBackend;
use crate::error::TeError;
use crate::fused;

/// Config of [`TransformerLayer`], with TE's argument names and defaults.
#[derive(Config, Debug)]
pub struct TransformerLayerConfig {
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub ffn_hidden_size: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); `None`: one per query head.
    #[config(default = "None")]
    pub num_gqa_groups: Option<usize>,
    /// Channels per head; `None`: `hidden_size / num_attention_heads`.
    #[config(default = "None")]
    pub kv_channels: Option<usize>,
    /// Epsilon of both normalizations.
    #[config(default = 1e-5)]
    pub layernorm_epsilon: f64,
    /// LayerNorm or RMSNorm.
    #[config(default = "Normalization::LayerNorm")]
    pub normalization: Normalization,
    /// Both normalizations' γ are zero-centred.
    #[config(default = false)]
    pub zero_centered_gamma: bool,
    /// Dropout probability of each block's output before its residual add, while training (TE's default: 0.1).
    #[config(default = 0.1)]
    pub hidden_dropout: f64,
    /// Dropout probability of the attention probabilities while training (TE's default: 0.1).
    #[config(default = 0.1)]
    pub attention_dropout: f64,
    /// The MLP activation.
    #[config(default = "Activation::Gelu")]
    pub activation: Activation,
    /// The projections and FCs learn biases.
    #[config(default = true)]
    pub bias: bool,
    /// The self-attention mask.
    #[config(default = "AttnMaskType::Causal")]
    pub self_attn_mask_type: AttnMaskType,
    /// Layout of the input and output: `sbhd` is `[seq, batch, hidden]`, `bshd` is `[batch, seq, hidden]`.
    #[config(default = "QkvFormat::Sbhd")]
    pub attn_input_format: QkvFormat,
    /// The layer's name (see [`names`](super::names)).
    #[config(default = "None")]
    pub name: Option<String>,
    /// Weight initializer (TE's default: normal, std 0.023).
    #[config(default = "Initializer::Normal { mean: 0.0, std: 0.023 }")]
    pub initializer: Initializer,
    /// Split over the tensor-parallel group as TE's `set_parallel_mode`: QKV and FC1 column-parallel, the
    /// attention's projection and FC2 row-parallel, the heads split among the ranks (see
    /// [`parallel`](super::parallel)).
    #[config(default = false)]
    pub set_parallel_mode: bool,
    /// Ranks in the tensor-parallel group: consecutive ranks of the peer bound to this thread.
    #[config(default = 1)]
    pub tp_size: usize,
    /// Sequence parallelism: input and output are this rank's token shards (of the first dimension); the norms,
    /// dropouts and residual adds run on them.
    #[config(default = false)]
    pub sequence_parallel: bool,
}

/// A transformer (encoder) layer: `h = x + dropout(attn(x))`, `out = h + dropout(mlp(h))`, with the
/// normalizations fused into the first GEMM of each block.
#[derive(Module, Debug)]
pub struct TransformerLayer<B: Backend> {
    /// The self-attention block (input normalization, QKV, attention, projection).
    pub self_attention: MultiheadAttention<B>,
    /// The MLP block (normalization, FC1, activation, FC2).
    pub layernorm_mlp: LayerNormMLP<B>,
    /// Dropout of each block's output before its residual add (`hidden_dropout`).
    pub hidden_dropout: Dropout,
}

impl TransformerLayerConfig {
    /// A transformer layer on `device`; panics with [`try_init`](Self::try_init)'s error.
    pub fn init<B: Backend>(&self, device: &B::Device) -> TransformerLayer<B> {
        or_panic(self.try_init(device))
    }

    /// A transformer layer on `device`, or an error naming the inconsistent sizes or a dropout probability outside
    /// `[0, 1)`.
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<TransformerLayer<B>, TeError> {
        let name = LayerName::root(self.name.as_deref(), "transformer_layer");
        let (attention, mlp) = self.blocks();
        Ok(TransformerLayer {
            self_attention: attention.try_init_named(name.child("self_attention", None), device)?,
            layernorm_mlp: mlp.init_named(name.child("layernorm_mlp", None), device)?,
            hidden_dropout: dropout(&name.to_string(), "hidden_dropout", self.hidden_dropout)?,
        })
    }

    /// This rank's shard of `whole`, a TransformerLayer of this config without tensor parallelism (see
    /// [`MultiheadAttentionConfig::shard`] and [`LayerNormMLPConfig::shard`]). [`TransformerLayer::gather`] is the
    /// inverse.
    pub fn shard<B: Backend>(
        &self,
        whole: TransformerLayer<B>,
    ) -> Result<TransformerLayer<B>, TeError> {
        let (attention, mlp) = self.blocks();
        Ok(TransformerLayer {
            self_attention: attention.shard(whole.self_attention)?,
            layernorm_mlp: mlp.shard(whole.layernorm_mlp)?,
            hidden_dropout: whole.hidden_dropout,
        })
    }

    /// The attention and MLP blocks' configs.
    fn blocks(&self) -> (MultiheadAttentionConfig, LayerNormMLPConfig) {
        let attention = MultiheadAttentionConfig::new(self.hidden_size, self.num_attention_heads)
            .with_kv_channels(self.kv_channels)
            .with_num_gqa_groups(self.num_gqa_groups)
            .with_layernorm_epsilon(self.layernorm_epsilon)
            .with_attn_mask_type(self.self_attn_mask_type)
            .with_attn_input_format(self.attn_input_format)
            .with_attention_dropout(self.attention_dropout)
            .with_input_layernorm(true)
            .with_normalization(self.normalization)
            .with_zero_centered_gamma(self.zero_centered_gamma)
            .with_bias(self.bias)
            .with_initializer(self.initializer.clone())
            .with_set_parallel_mode(self.set_parallel_mode)
            .with_tp_size(self.tp_size)
            .with_sequence_parallel(self.sequence_parallel);
        let mlp = LayerNormMLPConfig::new(self.hidden_size, self.ffn_hidden_size)
            .with_eps(self.layernorm_epsilon)
            .with_normalization(self.normalization)
            .with_zero_centered_gamma(self.zero_centered_gamma)
            .with_activation(self.activation)
            .with_bias(self.bias)
            .with_initializer(self.initializer.clone())
            .with_set_parallel_mode(self.set_parallel_mode)
            .with_tp_size(self.tp_size)
            .with_sequence_parallel(self.sequence_parallel);
        (attention, mlp)
    }
}

impl<B: Backend> TransformerLayer<B> {
    /// The whole layer from every rank's shard (a collective call over the tensor-parallel group).
    /// [`TransformerLayerConfig::shard`] is the inverse.
    pub fn gather(&self) -> Result<TransformerLayer<B>, TeError> {
        Ok(TransformerLayer {
            self_attention: self.self_attention.gather()?,
            layernorm_mlp: self.layernorm_mlp.gather()?,
            hidden_dropout: self.hidden_dropout.clone(),
        })
    }
}

impl<B: TeBackend> TransformerLayer<B> {
    /// The layer applied to `x` (`[seq, batch, hidden]` for `sbhd`, `[batch, seq, hidden]` for `bshd`).
    /// `attention_mask` (`[batch, seq]`, `true` = padding) goes with the padding mask types. Panics with
    /// [`try_forward`](Self::try_forward)'s error.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        attention_mask: Option<Tensor<B, 2, Bool>>,
    ) -> Tensor<B, 3> {
        or_panic(self.try_forward(x, attention_mask))
    }

    /// [`forward`](Self::forward), or an error naming the sublayer and the bad shape or mask.
    pub fn try_forward(
        &self,
        x: Tensor<B, 3>,
        attention_mask: Option<Tensor<B, 2, Bool>>,
    ) -> Result<Tensor<B, 3>, TeError> {
        let attention = self.self_attention.try_forward(x.clone(), attention_mask)?;
        let hidden = x + fused::dropout::forward(&self.hidden_dropout, attention)?;
        let mlp = self.layernorm_mlp.try_forward(hidden.clone())?;
        Ok(hidden + fused::dropout::forward(&self.hidden_dropout, mlp)?)
    }

    /// The layer's name (its GEMMs are named below it).
    pub fn name(&self) -> String {
        let attention = self.self_attention.name();
        attention
            .strip_suffix(".self_attention")
            .unwrap_or(&attention)
            .to_string()
    }

    /// The names of its GEMM layers in forward order (what a debug config selects from): the attention's QKV and
    /// output projections, then the MLP's `fc1` and `fc2`.
    pub fn gemm_layers(&self) -> Vec<String> {
        let mut names = self.self_attention.gemm_layers();
        names.extend(self.layernorm_mlp.gemm_layers());
        names
    }
}
