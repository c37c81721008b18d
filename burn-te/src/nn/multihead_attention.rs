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
use super::parallel::ParallelMode;
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
    /// Split over the tensor-parallel group as TE's `set_parallel_mode`: the QKV projection column-parallel (each
    /// rank its share of the query heads and of the GQA groups), the output projection row-parallel (see
    /// [`parallel`](super::parallel)).
    #[config(default = false)]
    pub set_parallel_mode: bool,
    /// Ranks in the tensor-parallel group: consecutive ranks of the peer bound to this thread.
    #[config(default = 1)]
    pub tp_size: usize,
    /// Sequence parallelism: input and output are this rank's token shards (of the first dimension).
    #[config(default = false)]
    pub sequence_parallel: bool,
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
    /// Query heads on this rank (all of them without tensor parallelism).
    heads: usize,
    /// GQA groups on this rank.
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
        let groups = self.num_gqa_groups.unwrap_or(heads);
        let tp = if self.set_parallel_mode {
            self.tp_size
        } else {
            1
        };
        heads_per_rank(heads, groups, tp)?;
        let core_attention = DotProductAttentionConfig::new(heads / tp, head_dim)
            .with_num_gqa_groups(self.num_gqa_groups.map(|g| g / tp))
            .with_attn_mask_type(self.attn_mask_type)
            .with_qkv_format(self.attn_input_format)
            .with_attention_dropout(self.attention_dropout)
            .try_init_named(name.child("core_attention", None))?;
        let (layernorm_qkv, qkv, proj) = self.projections();
        // The QKV outputs are [q: heads · d | k: groups · d | v: groups · d]: each part split over the group.
        let pieces = vec![heads, groups, groups];
        let (layernorm_qkv, qkv) = if self.input_layernorm {
            let layer =
                layernorm_qkv.init_named(name.child("layernorm_qkv", None), device, pieces)?;
            (Some(layer), None)
        } else {
            let layer = qkv.init_in_pieces(name.child("qkv", None), pieces, device)?;
            (None, Some(layer))
        };
        let proj = proj.init_named(name.child("proj", None), device)?;
        let (heads, groups) = (heads / tp, groups / tp);
        let core_attention =
            core_attention.with_heads(heads, groups, proj.parallel().and_then(|p| p.all_sharded()));
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

/// Each rank's query heads and GQA groups over a tensor-parallel group of `tp`, or an error unless `tp` divides
/// both (each rank holds whole heads).
fn heads_per_rank(heads: usize, groups: usize, tp: usize) -> Result<(usize, usize), TeError> {
    if tp == 0 || !heads.is_multiple_of(tp) || !groups.is_multiple_of(tp) {
        return Err(config_error(
            "MultiheadAttention",
            format!(
                "tp_size {tp} must divide num_attention_heads ({heads}) and the GQA groups ({groups}): each rank \
                 holds whole heads"
            ),
        ));
    }
    Ok((heads / tp, groups / tp))
}

impl MultiheadAttentionConfig {
    /// The QKV projection's configs (with and without the input norm) and the output projection's, split over the
    /// group with `set_parallel_mode`.
    fn projections(&self) -> (LayerNormLinearConfig, LinearConfig, LinearConfig) {
        let heads = self.num_attention_heads;
        let head_dim = self.kv_channels.unwrap_or(self.hidden_size / heads.max(1));
        let groups = self.num_gqa_groups.unwrap_or(heads);
        let qkv_width = (heads + 2 * groups) * head_dim;
        let mode = |mode| self.set_parallel_mode.then_some(mode);
        let layernorm_qkv = LayerNormLinearConfig::new(self.hidden_size, qkv_width)
            .with_eps(self.layernorm_epsilon)
            .with_normalization(self.normalization)
            .with_zero_centered_gamma(self.zero_centered_gamma)
            .with_bias(self.bias)
            .with_initializer(self.initializer.clone())
            .with_parallel_mode(mode(ParallelMode::Column))
            .with_tp_size(self.tp_size)
            .with_sequence_parallel(self.sequence_parallel);
        let qkv = LinearConfig::new(self.hidden_size, qkv_width)
            .with_bias(self.bias)
            .with_initializer(self.initializer.clone())
            .with_parallel_mode(mode(ParallelMode::Column))
            .with_tp_size(self.tp_size)
            .with_sequence_parallel(self.sequence_parallel);
        let proj = LinearConfig::new(heads * head_dim, self.hidden_size)
            .with_bias(self.bias)
            .with_initializer(self.initializer.clone())
            .with_parallel_mode(mode(ParallelMode::Row))
            .with_tp_size(self.tp_size)
            .with_sequence_parallel(self.sequence_parallel);
        (layernorm_qkv, qkv, proj)
    }

    /// This rank's shard of `whole`, a MultiheadAttention of this config without tensor parallelism: its share of
    /// the heads and GQA groups (see [`LinearConfig::shard`]). [`MultiheadAttention::gather`] is the inverse.
    pub fn shard<B: Backend>(
        &self,
        whole: MultiheadAttention<B>,
    ) -> Result<MultiheadAttention<B>, TeError> {
        let (layernorm_qkv, qkv, proj) = self.projections();
        let pieces = vec![whole.heads, whole.groups, whole.groups];
        let layernorm_qkv = whole
            .layernorm_qkv
            .map(|l| layernorm_qkv.shard_in_pieces(l, pieces.clone()))
            .transpose()?;
        let qkv = whole
            .qkv
            .map(|l| qkv.shard_in_pieces(l, pieces))
            .transpose()?;
        let proj = proj.shard(whole.proj)?;
        let tp = proj.parallel().map_or(1, |p| p.size());
        let (heads, groups) = heads_per_rank(whole.heads, whole.groups, tp)?;
        Ok(MultiheadAttention {
            core_attention: whole.core_attention.with_heads(
                heads,
                groups,
                proj.parallel().and_then(|p| p.all_sharded()),
            ),
            layernorm_qkv,
            qkv,
            proj,
            heads,
            groups,
            ..whole
        })
    }
}

impl<B: Backend> MultiheadAttention<B> {
    /// The whole module from every rank's shard (a collective call over the tensor-parallel group; see
    /// [`Linear::gather`]). [`MultiheadAttentionConfig::shard`] is the inverse.
    pub fn gather(&self) -> Result<MultiheadAttention<B>, TeError> {
        let tp = self.proj.parallel().map_or(1, |p| p.size());
        Ok(MultiheadAttention {
            layernorm_qkv: self
                .layernorm_qkv
                .as_ref()
                .map(|l| l.gather())
                .transpose()?,
            qkv: self.qkv.as_ref().map(|l| l.gather()).transpose()?,
            proj: self.proj.gather()?,
            core_attention: self
                .core_attention
                .with_heads(self.heads * tp, self.groups * tp, None),
            heads: self.heads * tp,
            groups: self.groups * tp,
            ..self.clone()
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
        let qkv = match (&self.layernorm_qkv, &self.qkv) {
            (Some(layer), _) => layer.try_forward(x)?,
            (None, Some(layer)) => layer.try_forward(x)?,
            (None, None) => unreachable!("init creates one QKV projection"),
        };
        // Under sequence parallelism the QKV projection gathered the tokens: the attention sees all of them.
        let [d0, d1, _] = qkv.dims();
        // [q: heads · d | k: groups · d | v: groups · d] along the last dimension, split into heads (q, k and v are
        // then views of the projection's output; narrowing first made the reshape copy it). The core takes the
        // packed tensor whole, so a fused core's backward writes one gradient for it.
        let qkv = qkv.reshape([d0, d1, self.heads + 2 * self.groups, self.head_dim]);
        // The core under this module's resolved name (its FP8 GEMMs: `{name}.core_attention.bmm1`, `.bmm2`).
        let core = format!("{}.core_attention", self.name());
        let context = self
            .core_attention
            .forward_packed_as(&core, qkv, attention_mask)?;
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
