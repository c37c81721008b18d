//! [`TeBackend`] for `Autodiff<B>`: the FP8 ops forward to `B` (quantized tensors carry no gradient), and
//! [`te_linear`](TeBackend::te_linear) registers its own backward node ([`linear`]), which runs the dgrad and wgrad
//! GEMMs through `B::te_linear_dgrad` / `B::te_linear_wgrad` with the forward's recipe and the layer's sites — so a
//! decorator below (the debug tools) sees all three GEMMs of every layer. A grouped linear layer's experts share
//! one node ([`grouped`]); a norm or activation and the GEMM that takes its FP8 output share one too ([`cast_linear`]).
//! The parts of a split tensor (q, k and v of a packed projection) join their gradients into one ([`split`]). A tensor-parallel exchange's backward is the adjoint exchange (`tensor_parallel`).

mod cast_linear;
mod grouped;
mod linear;
mod split;
#[cfg(feature = "distributed")]
mod tensor_parallel;

pub(crate) use grouped::MAX_EXPERTS;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn_te_kernels::{BlockScaleRule, Fp8Format, Fp8Stats, ScaleBlock};

use crate::backend::{
    AutodiffInner, Fp8HostData, Fp8Primitive, GroupedGemmOperands, Scaling, TeBackend,
};
use crate::error::TeError;
use crate::fp8_state::site::{ExpertGemms, GemmSite};
use crate::fused::{AttentionMask, AttentionSpec, CastInput, DropoutMask, NormSpec, Pointwise};
use crate::primitive::SavedForBackward;
use crate::recipe::Recipe;

impl<B: TeBackend + AutodiffInner, C: CheckpointStrategy> TeBackend for Autodiff<B, C> {
    type Fp8Data = B::Fp8Data;
    type DelayedState = B::DelayedState;
    type PendingStats = B::PendingStats;

    crate::te_linear_gemms!(dgrad wgrad grouped_in_turn);

    fn fp8_quantize(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        scaling: Scaling<'_, Self::DelayedState>,
    ) -> Result<Fp8Primitive<Self>, TeError> {
        B::fp8_quantize(Self::inner(tensor), format, scaling)
    }
    fn fp8_quantize_block_pair(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        layouts: [(ScaleBlock, BlockScaleRule); 2],
    ) -> Result<[Fp8Primitive<Self>; 2], TeError> {
        B::fp8_quantize_block_pair(Self::inner(tensor), format, layouts)
    }
    fn fp8_transposed_view(tensor: &FloatTensor<Self>) -> bool {
        B::fp8_transposed_view(&tensor.primitive)
    }
    fn fp8_read(tensor: &Fp8Primitive<Self>) -> Result<Fp8HostData, TeError> {
        B::fp8_read(tensor)
    }
    fn fp8_dequantize(tensor: Fp8Primitive<Self>) -> Result<FloatTensor<Self>, TeError> {
        Ok(Self::from_inner(B::fp8_dequantize(tensor)?))
    }
    fn fp8_gemm(
        lhs: Fp8Primitive<Self>,
        lhs_t: bool,
        rhs: Fp8Primitive<Self>,
        rhs_t: bool,
    ) -> Result<FloatTensor<Self>, TeError> {
        Ok(Self::from_inner(B::fp8_gemm(lhs, lhs_t, rhs, rhs_t)?))
    }
    const GROUPED_GEMM_ALONE_FROM: Option<usize> = B::GROUPED_GEMM_ALONE_FROM;
    fn fp8_gemm_grouped(
        gemms: Vec<GroupedGemmOperands<Self>>,
    ) -> Result<Vec<FloatTensor<Self>>, TeError> {
        Ok(B::fp8_gemm_grouped(gemms)?
            .into_iter()
            .map(Self::from_inner)
            .collect())
    }
    fn fp8_amax(tensor: FloatTensor<Self>) -> Result<FloatTensor<Self>, TeError> {
        Ok(Self::from_inner(B::fp8_amax(Self::inner(tensor))?))
    }
    fn fp8_max_block_dynamic_range(
        tensor: FloatTensor<Self>,
        block: ScaleBlock,
    ) -> Result<FloatTensor<Self>, TeError> {
        Ok(Self::from_inner(B::fp8_max_block_dynamic_range(
            Self::inner(tensor),
            block,
        )?))
    }
    fn fp8_fake_quant(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        margin: f32,
    ) -> Result<FloatTensor<Self>, TeError> {
        Ok(Self::from_inner(B::fp8_fake_quant(
            Self::inner(tensor),
            format,
            margin,
        )?))
    }
    fn fp8_stats_launch(
        tensor: FloatTensor<Self>,
        quantization: Option<(Fp8Format, Scaling<'_, Self::DelayedState>)>,
    ) -> Result<Self::PendingStats, TeError> {
        B::fp8_stats_launch(Self::inner(tensor), quantization)
    }
    fn fp8_non_finite_launch(tensor: FloatTensor<Self>) -> Result<Self::PendingStats, TeError> {
        B::fp8_non_finite_launch(Self::inner(tensor))
    }
    fn fp8_stats_read(pending: Self::PendingStats) -> Result<Fp8Stats, TeError> {
        B::fp8_stats_read(pending)
    }
    fn fp8_stats_read_many(pending: Vec<Self::PendingStats>) -> Result<Vec<Fp8Stats>, TeError> {
        B::fp8_stats_read_many(pending)
    }
    fn fp8_quantization_stats(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        scale: f32,
    ) -> Result<Fp8Stats, TeError> {
        B::fp8_quantization_stats(Self::inner(tensor), format, scale)
    }
    fn fp8_delayed_state_read(state: &Self::DelayedState) -> Result<(Vec<f32>, f32), TeError> {
        B::fp8_delayed_state_read(state)
    }
    fn fp8_delayed_state_load(
        device: &Self::Device,
        history: &[f32],
        scale: f32,
    ) -> Result<Self::DelayedState, TeError> {
        B::fp8_delayed_state_load(device, history, scale)
    }
    fn fp8_delayed_state_len(state: &Self::DelayedState) -> usize {
        B::fp8_delayed_state_len(state)
    }
    fn buffer_id(tensor: &FloatTensor<Self>) -> Option<u64> {
        B::buffer_id(&tensor.primitive)
    }
    fn fp8_delayed_state_update(
        state: &Self::DelayedState,
        algo: burn_te_kernels::AmaxComputeAlgo,
        format: Fp8Format,
        margin: f32,
    ) -> Result<(), TeError> {
        B::fp8_delayed_state_update(state, algo, format, margin)
    }

    fn te_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        spec: NormSpec,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        crate::fused::norm::autodiff_norm::<B, C>(x, gamma, beta, spec)
    }
    fn te_cast_linear(
        input: CastInput<FloatTensor<Self>>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        site: &GemmSite,
        recipe: &Recipe,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        cast_linear::te_cast_linear::<B, C>(input, weight, bias, site, recipe)
    }
    fn te_activation(
        x: FloatTensor<Self>,
        f: Pointwise,
        gated: bool,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        crate::fused::activation::autodiff_activation::<B, C>(x, f, gated)
    }
    fn te_softmax(
        scores: FloatTensor<Self>,
        scale: f32,
        mask: AttentionMask<BoolTensor<Self>>,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        crate::fused::softmax::autodiff_softmax::<B, C>(scores, scale, mask)
    }
    fn te_dropout_seed(device: &Self::Device) -> Option<u64> {
        B::te_dropout_seed(device)
    }
    fn te_dropout(
        x: FloatTensor<Self>,
        mask: DropoutMask,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        crate::fused::dropout::autodiff_dropout::<B, C>(x, mask)
    }
    fn te_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        spec: AttentionSpec,
        mask: AttentionMask<BoolTensor<Self>>,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        crate::fused::attention::autodiff_attention::<B, C>(q, k, v, spec, mask)
    }
    fn te_attention_packed(
        qkv: FloatTensor<Self>,
        parts: (usize, usize),
        spec: AttentionSpec,
        mask: AttentionMask<BoolTensor<Self>>,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        crate::fused::attention::autodiff_attention_packed::<B, C>(qkv, parts, spec, mask)
    }
    fn te_split(tensor: FloatTensor<Self>, dim: usize, sizes: &[usize]) -> Vec<FloatTensor<Self>> {
        split::autodiff_split::<B, C>(tensor, dim, sizes)
    }

    /// The forward alone (an autodiff backend keeps its operands in its own graph, see `te_linear`).
    fn te_linear_fprop(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        site: &GemmSite,
        recipe: Option<&Recipe>,
        _save: [bool; 2],
    ) -> (FloatTensor<Self>, SavedForBackward<Self::Fp8Data>) {
        (Self::te_linear(x, weight, bias, site, recipe), [None, None])
    }

    fn te_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        site: &GemmSite,
        recipe: Option<&Recipe>,
    ) -> FloatTensor<Self> {
        linear::te_linear::<B, C>(x, weight, bias, site, recipe)
    }

    fn te_grouped_linear(
        x: FloatTensor<Self>,
        weights: Vec<FloatTensor<Self>>,
        biases: Vec<Option<FloatTensor<Self>>>,
        experts: &ExpertGemms,
    ) -> FloatTensor<Self> {
        grouped::te_grouped_linear::<B, C>(x, weights, biases, experts)
    }

    #[cfg(feature = "distributed")]
    fn te_tp_collective(
        tensor: FloatTensor<Self>,
        collective: crate::distributed::tensor_parallel::TpCollective,
        group: &crate::distributed::tensor_parallel::TpGroup,
    ) -> Result<FloatTensor<Self>, TeError> {
        tensor_parallel::te_tp_collective::<B, C>(tensor, collective, group)
    }
}
