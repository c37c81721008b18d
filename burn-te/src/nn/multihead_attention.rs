//! `MultiheadAttention`: QKV projection (optionally with the input LayerNorm fused in), dot-product attention and
//! the output projection (TE's `te.MultiheadAttention`). GEMM names: `{name}.layernorm_qkv` (or `{name}.qkv`
//! without the input norm) and `{name}.proj`.

use burn::module::Initializer;
use burn::prelude::*;

use super::attention::{AttnMaskType, DotProductAttention, DotProductAttentionConfig, QkvFormat};
use super::layernorm_linear::{LayerNormLinear, LayerNormLinearConfig};
use super::linear::{Linear, LinearConfig};
use super::names::LayerName;
use super::norm::Normalization;
use super::{check_features, config_error, or_panic};
use crate::backend::TeBackend;
use crate::error::TeError;

/// Config of [`MultiheadAttention`].
#[derive(Config, Debug)]
pub struct MultiheadAttentionConfig {
    /// Input and output features.
    pub hidden_size: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Channels per head; `None`: `hidden_size / num_attention_heads`.
    #[config(default = "None")]
    pub kv_channels: Option<usize>,
    /// Key/value heads (grouped-query attention); `None`: one per query head.
    #[config(default = "None")]
    pub num_gqa_groups: Option<usize>,
    /// The input normalization's epsilon.
    #[config(default = 1e-5)]
    pub layernorm_epsilon: f64,
    /// The attention mask.
    #[config(default = "AttnMaskType::Causal")]
    pub attn_mask_type: AttnMaskType,
    /// Dropout probability of the attention probabilities while training (TE's default: 0.1).
    #[config(default = 0.1)]
    pub attention_dropout: f64,
    /// Layout of the input and output: `sbhd` is `[seq, batch, hidden]`, `bshd` is `[batch, seq, hidden]`.
    #[config(default = "QkvFormat::Sbhd")]
    pub attn_input_format: QkvFormat,
    /// Normalize the input in the QKV projection (`layernorm_qkv`, a [`LayerNormLinear`]).
    #[config(default = false)]
    pub input_layernorm: bool,
    /// LayerNorm or RMSNorm for the input normalization.
    #[config(default = "Normalization::LayerNorm")]
    pub normalization: Normalization,
    /// The input normalization's γ is zero-centred.
    #[config(default = false)]
    pub zero_centered_gamma: bool,
    /// The projections learn biases.
    #[config(default = true)]
    pub bias: bool,
    /// The layer's name (see [`names`](super::names)).
    #[config(default = "None")]
    pub name: Option<String>,
    /// Weight initializer of the projections (TE's default: normal, std 0.023).
    #[config(default = "Initializer::Normal { mean: 0.0, std: 0.023 }")]
    pub initializer: Initializer,
}

/// Multi-head (or grouped-query) self-attention whose projections run in FP8 inside an autocast scope.
#[derive(Module, Debug)]
pub struct MultiheadAttention<B: Backend> {
    /// The QKV projection with the input normalization (`input_layernorm`).
    pub layernorm_qkv: Option<LayerNormLinear<B>>,
    /// The QKV projection without it.
    pub qkv: Option<Linear<B>>,
    /// The attention core.
    pub core_attention: DotProductAttention<B>,
    /// The output projection.
    pub proj: Linear<B>,
    hidden_size: usize,
    heads: usize,
    groups: usize,
    head_dim: usize,
    #[module(skip)]
    name: LayerName,
}

impl MultiheadAttentionConfig {
    /// Multi-head attention on `device`; panics with [`try_init`](Self::try_init)'s error.
    pub fn init<B: Backend>(&self, device: &B::Device) -> MultiheadAttention<B> {
        or_panic(self.try_init(device))
    }

    /// Multi-head attention on `device`, or an error when the heads do not divide the hidden size (without
    /// `kv_channels`) or the GQA groups do not divide the heads.
    pub fn try_init<B: Backend>(
        &self,
        device: &B::Device,
    ) -> Result<MultiheadAttention<B>, TeError> {
        self.try_init_named(
            LayerName::root(self.name.as_deref(), "multihead_attention"),
            device,
        )
    }

    pub(crate) fn try_init_named<B: Backend>(
        &self,
        name: LayerName,
        device: &B::Device,
    ) -> Result<MultiheadAttention<B>, TeError> {
        let heads = self.num_attention_heads;
        let head_dim = match self.kv_channels {
            Some(channels) => channels,
            None if heads > 0 && self.hidden_size.is_multiple_of(heads) => self.hidden_size / heads,
            None => {
                return Err(config_error(
                    "MultiheadAttention",
                    format!(
                        "num_attention_heads ({heads}) must divide hidden_size ({}) unless kv_channels is given",
                        self.hidden_size
                    ),
                ));
            }
        };
        let core_attention = DotProductAttentionConfig::new(heads, head_dim)
            .with_num_gqa_groups(self.num_gqa_groups)
            .with_attn_mask_type(self.attn_mask_type)
            .with_qkv_format(self.attn_input_format)
            .with_attention_dropout(self.attention_dropout)
            .try_init_named(name.child("core_attention", None))?;
        let groups = self.num_gqa_groups.unwrap_or(heads);
        let qkv_width = (heads + 2 * groups) * head_dim;
        let (layernorm_qkv, qkv) = if self.input_layernorm {
            let config = LayerNormLinearConfig::new(self.hidden_size, qkv_width)
                .with_eps(self.layernorm_epsilon)
                .with_normalization(self.normalization)
                .with_zero_centered_gamma(self.zero_centered_gamma)
                .with_bias(self.bias)
                .with_initializer(self.initializer.clone());
            (
                Some(config.init_named(name.child("layernorm_qkv", None), device)),
                None,
            )
        } else {
            let config = LinearConfig::new(self.hidden_size, qkv_width)
                .with_bias(self.bias)
                .with_initializer(self.initializer.clone());
            (
                None,
                Some(config.init_named(name.child("qkv", None), device)?),
            )
        };
        let proj = LinearConfig::new(heads * head_dim, self.hidden_size)
            .with_bias(self.bias)
            .with_initializer(self.initializer.clone())
            .init_named(name.child("proj", None), device)?;
        Ok(MultiheadAttention {
            layernorm_qkv,
            qkv,
            core_attention,
            proj,
            hidden_size: self.hidden_size,
            heads,
            groups,
            head_dim,
            name,
        })
    }
}

impl<B: TeBackend> MultiheadAttention<B> {
    /// Self-attention of `x` (`[seq, batch, hidden]` for `sbhd`, `[batch, seq, hidden]` for `bshd`), same shape
    /// out. `attention_mask` (`[batch, seq]`, `true` = padding) goes with the padding mask types. Panics with
    /// [`try_forward`](Self::try_forward)'s error.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        attention_mask: Option<Tensor<B, 2, Bool>>,
    ) -> Tensor<B, 3> {
        or_panic(self.try_forward(x, attention_mask))
    }

    /// [`forward`](Self::forward), or an error naming the layer and the bad shape or mask.
    pub fn try_forward(
        &self,
        x: Tensor<B, 3>,
        attention_mask: Option<Tensor<B, 2, Bool>>,
    ) -> Result<Tensor<B, 3>, TeError> {
        check_features(&self.name(), "hidden states", &x, self.hidden_size)?;
        let [d0, d1, _] = x.dims();
        let qkv = match (&self.layernorm_qkv, &self.qkv) {
            (Some(layer), _) => layer.try_forward(x)?,
            (None, Some(layer)) => layer.try_forward(x)?,
            (None, None) => unreachable!("init creates one QKV projection"),
        };
        // [q: heads · d | k: groups · d | v: groups · d] along the last dimension.
        let (q_width, kv_width) = (self.heads * self.head_dim, self.groups * self.head_dim);
        let q = qkv
            .clone()
            .narrow(2, 0, q_width)
            .reshape([d0, d1, self.heads, self.head_dim]);
        let k =
            qkv.clone()
                .narrow(2, q_width, kv_width)
                .reshape([d0, d1, self.groups, self.head_dim]);
        let v = qkv.narrow(2, q_width + kv_width, kv_width).reshape([
            d0,
            d1,
            self.groups,
            self.head_dim,
        ]);
        // The core under this module's resolved name (its FP8 GEMMs: `{name}.core_attention.bmm1`, `.bmm2`).
        let core = format!("{}.core_attention", self.name());
        let context = self
            .core_attention
            .forward_as(&core, q, k, v, attention_mask)?;
        self.proj.try_forward(context)
    }

    /// The module's name (its GEMMs are `{name}.layernorm_qkv` or `{name}.qkv`, and `{name}.proj`).
    pub fn name(&self) -> String {
        let proj = self.proj.name();
        proj.strip_suffix(".proj").unwrap_or(&proj).to_string()
    }

    /// The names of its GEMM layers in forward order (what a debug config selects): the QKV projection's, then
    /// the output projection's.
    pub fn gemm_layers(&self) -> Vec<String> {
        let qkv = match (&self.layernorm_qkv, &self.qkv) {
            (Some(fused), _) => Some(fused.name()),
            (None, Some(qkv)) => Some(qkv.name()),
            (None, None) => None,
        };
        qkv.into_iter().chain([self.proj.name()]).collect()
    }
}
