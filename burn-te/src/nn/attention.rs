//! `DotProductAttention`: `softmax(q·kᵀ · scale + mask) · v` per head, with grouped-query heads, causal and padding
//! masks, dropout on the attention probabilities and TE's `sbhd` / `bshd` layouts (TE's `te.DotProductAttention`).
//! It runs in high precision, also inside an autocast scope, as TE does by default. Under a recipe with TE's
//! `fp8_dpa` (or `fp8_mha`), its two GEMMs run in FP8 with their backward, as the layer GEMMs `{name}.bmm1`
//! (`q·kᵀ`: q the activation, k the weight, dS the gradient) and `{name}.bmm2` (`p·v`: p, v, dO), each with
//! per-tensor scales kept in its FP8 state (`bmm1_fp8_meta`, `bmm2_fp8_meta`, saved with the record); the softmax
//! stays in f32, as in TE. The debug tools and recipe plans see the two GEMMs under those names.

use burn::nn::Dropout;
use burn::prelude::*;
use burn::tensor::activation::softmax;
use burn::tensor::{TensorData, TensorPrimitive};

use super::linear::{fp8_attention_at, te_bmm};
use super::names::LayerName;
use super::{config_error, dropout, or_panic};
use crate::backend::TeBackend;
use crate::error::TeError;
use crate::fp8_state::Fp8Meta;
use crate::fp8_state::autocast::high_precision_guard;
use crate::fp8_state::site::Sharding;
use crate::fused::attention::AttentionInputs;
use crate::fused::{self, AttentionSpec};

/// The module type of the attention GEMMs' sites (TE's snake case).
const KIND: &str = "dot_product_attention";

/// Whether either of the attention `layer`'s GEMMs (`{layer}.bmm1`, `{layer}.bmm2`) runs in FP8 here; otherwise the
/// core runs in high precision, fused where the backend can.
fn fp8_attention_in(layer: &str) -> Result<bool, TeError> {
    for site in ["bmm1", "bmm2"] {
        if fp8_attention_at(&format!("{layer}.{site}"), KIND)? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Which positions a query may not attend to (TE's `attn_mask_type`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum AttnMaskType {
    /// Every query attends to every key.
    NoMask,
    /// Query `i` attends to keys `j ≤ i` (top-left aligned).
    Causal,
    /// Keys marked in the `attention_mask` (`[batch, keys]`, `true` = padding) are masked.
    Padding,
    /// Causal and padding.
    PaddingCausal,
}

impl AttnMaskType {
    fn causal(self) -> bool {
        matches!(self, AttnMaskType::Causal | AttnMaskType::PaddingCausal)
    }

    fn padding(self) -> bool {
        matches!(self, AttnMaskType::Padding | AttnMaskType::PaddingCausal)
    }
}

/// Tensor layout of queries, keys and values (TE's `qkv_format` / `attn_input_format`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum QkvFormat {
    /// `[sequence, batch, heads, head_dim]` (TE's default).
    Sbhd,
    /// `[batch, sequence, heads, head_dim]`.
    Bshd,
}

/// Config of [`DotProductAttention`].
#[derive(Config, Debug)]
pub struct DotProductAttentionConfig {
    /// Query heads.
    pub num_attention_heads: usize,
    /// Channels per head (`head_dim`).
    pub kv_channels: usize,
    /// Key/value heads (grouped-query attention); `None`: one per query head. Must divide the query heads.
    #[config(default = "None")]
    pub num_gqa_groups: Option<usize>,
    /// The mask.
    #[config(default = "AttnMaskType::Causal")]
    pub attn_mask_type: AttnMaskType,
    /// The layout of `q`, `k`, `v` and the output.
    #[config(default = "QkvFormat::Sbhd")]
    pub qkv_format: QkvFormat,
    /// Softmax scale; `None`: `1/√kv_channels`.
    #[config(default = "None")]
    pub softmax_scale: Option<f64>,
    /// Dropout probability of the attention probabilities while training (TE's default for this module: 0).
    #[config(default = 0.0)]
    pub attention_dropout: f64,
    /// The layer's name (see [`names`](super::names)).
    #[config(default = "None")]
    pub name: Option<String>,
}

/// Scaled dot-product attention (no parameters).
#[derive(Module, Debug)]
pub struct DotProductAttention<B: Backend> {
    /// Dropout of the attention probabilities (active on autodiff backends only, as Burn's `Dropout`).
    pub attention_dropout: Dropout,
    /// The FP8 state of `q·kᵀ` under `fp8_dpa` (delayed-scaling histories of q, k and dS).
    pub bmm1_fp8_meta: Fp8Meta<B>,
    /// The FP8 state of `p·v` under `fp8_dpa` (delayed-scaling histories of p, v and dO).
    pub bmm2_fp8_meta: Fp8Meta<B>,
    heads: usize,
    groups: usize,
    head_dim: usize,
    scale: f64,
    #[module(skip)]
    mask_type: AttnMaskType,
    #[module(skip)]
    format: QkvFormat,
    #[module(skip)]
    name: LayerName,
    /// Under tensor parallelism (this rank's share of the heads): the group over which `fp8_dpa`'s per-tensor
    /// amaxes are reduced, every operand of the attention GEMMs being sharded by heads.
    #[module(skip)]
    sharded: Option<Sharding>,
}

impl<B: Backend> DotProductAttention<B> {
    /// The same attention over `heads` query heads in `groups` GQA groups (a rank's share under tensor
    /// parallelism, `sharded` its group; or all of them, `None`).
    pub(crate) fn with_heads(
        &self,
        heads: usize,
        groups: usize,
        sharded: Option<Sharding>,
    ) -> Self {
        Self {
            heads,
            groups,
            sharded,
            ..self.clone()
        }
    }
}

impl DotProductAttentionConfig {
    /// Attention as configured; panics with [`try_init`](Self::try_init)'s error.
    pub fn init<B: Backend>(&self) -> DotProductAttention<B> {
        or_panic(self.try_init())
    }

    /// Attention as configured, or an error when the GQA groups do not divide the heads, a size is zero or the
    /// dropout probability is outside `[0, 1)`.
    pub fn try_init<B: Backend>(&self) -> Result<DotProductAttention<B>, TeError> {
        self.try_init_named(LayerName::root(
            self.name.as_deref(),
            "dot_product_attention",
        ))
    }

    pub(crate) fn try_init_named<B: Backend>(
        &self,
        name: LayerName,
    ) -> Result<DotProductAttention<B>, TeError> {
        let module = "DotProductAttention";
        let groups = self.num_gqa_groups.unwrap_or(self.num_attention_heads);
        if self.num_attention_heads == 0 || self.kv_channels == 0 || groups == 0 {
            return Err(config_error(
                module,
                format!(
                    "num_attention_heads ({}), kv_channels ({}) and num_gqa_groups ({groups}) must be positive",
                    self.num_attention_heads, self.kv_channels
                ),
            ));
        }
        if !self.num_attention_heads.is_multiple_of(groups) {
            return Err(config_error(
                module,
                format!(
                    "num_gqa_groups ({groups}) must divide num_attention_heads ({})",
                    self.num_attention_heads
                ),
            ));
        }
        if let Some(scale) = self.softmax_scale
            && !scale.is_finite()
        {
            return Err(config_error(
                module,
                format!("softmax_scale must be finite, got {scale}"),
            ));
        }
        Ok(DotProductAttention {
            attention_dropout: dropout(module, "attention_dropout", self.attention_dropout)?,
            heads: self.num_attention_heads,
            groups,
            head_dim: self.kv_channels,
            scale: self
                .softmax_scale
                .unwrap_or(1.0 / (self.kv_channels as f64).sqrt()),
            mask_type: self.attn_mask_type,
            format: self.qkv_format,
            name,
            bmm1_fp8_meta: Fp8Meta::new(),
            bmm2_fp8_meta: Fp8Meta::new(),
            sharded: None,
        })
    }
}

impl<B: TeBackend> DotProductAttention<B> {
    /// Attention of `q` (`heads` heads) over `k`, `v` (`num_gqa_groups` heads) in the configured layout, e.g.
    /// `[s, b, h, d]` for `sbhd`; returns `[s, b, h·d]` (`[b, s, h·d]` for `bshd`). `attention_mask` (`[b, s_kv]`,
    /// `true` = padding) is required by the padding mask types and rejected by the others. Panics with
    /// [`try_forward`](Self::try_forward)'s error.
    pub fn forward(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        attention_mask: Option<Tensor<B, 2, Bool>>,
    ) -> Tensor<B, 3> {
        or_panic(self.try_forward(q, k, v, attention_mask))
    }

    /// [`forward`](Self::forward), or an error naming the module and the bad shape or mask.
    pub fn try_forward(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        attention_mask: Option<Tensor<B, 2, Bool>>,
    ) -> Result<Tensor<B, 3>, TeError> {
        self.forward_as(&self.name.to_string(), q, k, v, attention_mask)
    }

    /// The module's name (its FP8 GEMMs are `{name}.bmm1` and `{name}.bmm2`).
    pub fn name(&self) -> String {
        self.name.to_string()
    }

    /// [`try_forward`](Self::try_forward) under the layer name `name` (a parent's resolved name for its core).
    pub(crate) fn forward_as(
        &self,
        name: &str,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        attention_mask: Option<Tensor<B, 2, Bool>>,
    ) -> Result<Tensor<B, 3>, TeError> {
        self.core(name, [q, k, v], None, attention_mask)
    }

    /// [`forward_as`](Self::forward_as) on q, k and v packed in one tensor `[.., heads + 2 · groups, d]` (q's
    /// heads, then k's and v's groups along dimension 2; `[s, b, ..]` or `[b, s, ..]` as the module's format):
    /// the fused core then takes the packed tensor, so its backward writes one gradient for it.
    pub(crate) fn forward_packed_as(
        &self,
        name: &str,
        qkv: Tensor<B, 4>,
        attention_mask: Option<Tensor<B, 2, Bool>>,
    ) -> Result<Tensor<B, 3>, TeError> {
        let (heads, groups) = (self.heads, self.groups);
        let invalid = |reason: String| TeError::InvalidShape {
            module: name.to_string(),
            reason,
            shape: qkv.dims().to_vec(),
        };
        if qkv.dims()[2] != heads + 2 * groups {
            return Err(invalid(format!(
                "packed q, k, v need {heads} + 2 · {groups} heads along dimension 2"
            )));
        }
        // Views whose gradients join into the packed tensor's once (on Autodiff; see `te_split`).
        let parts = B::te_split(
            qkv.clone().into_primitive().tensor(),
            2,
            &[heads, groups, groups],
        )
        .into_iter()
        .map(|part| Tensor::from_primitive(TensorPrimitive::Float(part)))
        .collect::<Vec<_>>();
        let count = parts.len();
        let parts = <[Tensor<B, 4>; 3]>::try_from(parts)
            .map_err(|_| invalid(format!("the backend's te_split gave {count} parts, not 3")))?;
        self.core(name, parts, Some(qkv), attention_mask)
    }

    /// The core on q, k, v (views of `packed` where given).
    fn core(
        &self,
        name: &str,
        [q, k, v]: [Tensor<B, 4>; 3],
        packed: Option<Tensor<B, 4>>,
        attention_mask: Option<Tensor<B, 2, Bool>>,
    ) -> Result<Tensor<B, 3>, TeError> {
        let operands = [q.clone(), k.clone(), v.clone()];
        let (q, k, v) = (self.to_bhsd(q), self.to_bhsd(k), self.to_bhsd(v));
        let [batch, _, queries, _] = q.dims();
        let keys = k.dims()[2];
        self.check("q", &q, self.heads, batch, queries)?;
        self.check("k", &k, self.groups, batch, keys)?;
        self.check("v", &v, self.groups, batch, keys)?;
        let padding = self.padding(attention_mask, batch, keys)?;
        // The whole core as one fused op where the backend has one, unless its GEMMs may run in FP8 or it has no
        // fused dropout for the probabilities. The fused core and the composed one drop the same probabilities.
        let dropping = self.attention_dropout.prob > 0.0 && B::ad_enabled(&q.device());
        let dropout_mask = fused::dropout::mask::<B>(self.attention_dropout.prob, &q.device());
        if (!dropping || dropout_mask.is_some()) && !fp8_attention_in(name)? {
            let spec = AttentionSpec {
                seq_first: matches!(self.format, QkvFormat::Sbhd),
                scale: self.scale as f32,
                dropout: dropout_mask,
            };
            let [q, k, v] = operands.each_ref();
            let causal = self.mask_type.causal();
            let inputs = match &packed {
                Some(qkv) => AttentionInputs::Packed(qkv, (self.heads, self.groups)),
                None => AttentionInputs::Separate([q, k, v]),
            };
            if let Some(out) = fused::attention::try_fused(inputs, spec, causal, padding.as_ref())?
            {
                return Ok(out);
            }
        }

        // Grouped-query heads: consecutive query heads share one key/value head. With one head per group there is
        // nothing to repeat (a reshape of the expanded view would copy k and v for nothing).
        let per_group = self.heads / self.groups;
        let repeat = |t: Tensor<B, 4>| match per_group {
            1 => t,
            _ => t
                .unsqueeze_dim::<5>(2)
                .expand([batch, self.groups, per_group, keys, self.head_dim])
                .reshape([batch, self.heads, keys, self.head_dim]),
        };
        let (k, v) = (repeat(k), repeat(v));

        let device = q.device();
        let bmm = |a: Tensor<B, 4>, b: Tensor<B, 4>, site: &str, meta| match te_bmm(
            a.clone(),
            b.clone(),
            &format!("{name}.{site}"),
            meta,
            KIND,
            self.sharded.clone(),
        )? {
            Some(fp8) => Ok::<_, TeError>(fp8),
            None => {
                let _high_precision = high_precision_guard();
                Ok(a.matmul(b))
            }
        };
        let scores = bmm(q, k.swap_dims(2, 3), "bmm1", &self.bmm1_fp8_meta)?;
        // The softmax and its masks in high precision, as in TE.
        let high_precision = high_precision_guard();
        let causal = self.mask_type.causal();
        let fused =
            fused::softmax::try_fused(&scores, self.scale as f32, causal, padding.as_ref())?;
        let probs = match fused {
            Some(probs) => probs,
            None => {
                let scores = scores * self.scale;
                match Self::mask(padding, causal, batch, queries, keys, &device) {
                    None => softmax(scores, 3),
                    Some(mask) => {
                        // Repeated into its own buffer once: a broadcast mask is copied out again by every
                        // mask_fill (two here and two in their backward) on backends that need contiguous
                        // operands.
                        let mask = mask.repeat_dim(1, self.heads);
                        // Masked scores get a large negative value; zeroing them after the softmax also makes
                        // fully masked rows output zeros instead of a uniform average.
                        softmax(scores.mask_fill(mask.clone(), -1.0e30), 3).mask_fill(mask, 0.0)
                    }
                }
            }
        };
        let probs = fused::dropout::forward_masked(&self.attention_dropout, probs, dropout_mask)?;
        drop(high_precision);
        let context = bmm(probs, v, "bmm2", &self.bmm2_fp8_meta)?; // [b, h, s, d]
        let width = self.heads * self.head_dim;
        Ok(match self.format {
            QkvFormat::Sbhd => context
                .permute([2, 0, 1, 3])
                .reshape([queries, batch, width]),
            QkvFormat::Bshd => context.swap_dims(1, 2).reshape([batch, queries, width]),
        })
    }

    /// `[b, h, s, d]` from the configured layout.
    fn to_bhsd(&self, t: Tensor<B, 4>) -> Tensor<B, 4> {
        match self.format {
            QkvFormat::Sbhd => t.permute([1, 2, 0, 3]),
            QkvFormat::Bshd => t.swap_dims(1, 2),
        }
    }

    fn check(
        &self,
        what: &str,
        t: &Tensor<B, 4>,
        heads: usize,
        batch: usize,
        seq: usize,
    ) -> Result<(), TeError> {
        let [b, h, s, d] = t.dims();
        if (b, h, s, d) == (batch, heads, seq, self.head_dim) {
            return Ok(());
        }
        let layout = match self.format {
            QkvFormat::Sbhd => [s, b, h, d],
            QkvFormat::Bshd => [b, s, h, d],
        };
        Err(TeError::InvalidShape {
            module: self.name.to_string(),
            reason: format!(
                "expected {what} in {:?} layout with {heads} heads of {} channels and the batch of q ({batch})",
                self.format, self.head_dim
            ),
            shape: layout.to_vec(),
        })
    }

    /// The padding mask `[b, s_kv]` (`true` = padding) the mask type asks for, or an error naming a missing,
    /// unexpected or misshapen one.
    fn padding(
        &self,
        attention_mask: Option<Tensor<B, 2, Bool>>,
        batch: usize,
        keys: usize,
    ) -> Result<Option<Tensor<B, 2, Bool>>, TeError> {
        Ok(match (self.mask_type.padding(), attention_mask) {
            (true, Some(mask)) => {
                if mask.dims() != [batch, keys] {
                    return Err(TeError::InvalidShape {
                        module: self.name.to_string(),
                        reason: format!("expected attention_mask [batch {batch}, keys {keys}]"),
                        shape: mask.dims().to_vec(),
                    });
                }
                Some(mask)
            }
            (true, None) => {
                return Err(config_error(
                    &self.name.to_string(),
                    format!(
                        "attn_mask_type {:?} needs an attention_mask [batch, keys]",
                        self.mask_type
                    ),
                ));
            }
            (false, Some(_)) => {
                return Err(config_error(
                    &self.name.to_string(),
                    format!(
                        "an attention_mask was given but attn_mask_type is {:?}; use Padding or PaddingCausal",
                        self.mask_type
                    ),
                ));
            }
            (false, None) => None,
        })
    }

    /// The combined mask `[b, 1, s_q, s_kv]` (`true` = masked) of the composed softmax, or `None` with nothing to
    /// mask.
    fn mask(
        padding: Option<Tensor<B, 2, Bool>>,
        causal: bool,
        batch: usize,
        queries: usize,
        keys: usize,
        device: &B::Device,
    ) -> Option<Tensor<B, 4, Bool>> {
        let padding = padding.map(|mask| mask.reshape([batch, 1, 1, keys]));
        let causal = causal.then(|| {
            let upper: Vec<bool> = (0..queries * keys).map(|i| i % keys > i / keys).collect();
            Tensor::<B, 2, Bool>::from_data(TensorData::new(upper, [queries, keys]), device)
                .reshape([1, 1, queries, keys])
        });
        match (padding, causal) {
            (Some(p), Some(c)) => Some(
                p.expand([batch, 1, queries, keys])
                    .bool_or(c.expand([batch, 1, queries, keys])),
            ),
            (Some(p), None) => Some(p.expand([batch, 1, queries, keys])),
            (None, Some(c)) => Some(c.expand([batch, 1, queries, keys])),
            (None, None) => None,
        }
    }
}
