//! [`TeBackend`] for `Autodiff<B>`: the FP8 ops forward to `B` (quantized tensors carry no gradient), and
//! [`te_linear`](TeBackend::te_linear) registers its own backward node, which runs the dgrad and wgrad GEMMs through
//! `B::te_linear_dgrad` / `B::te_linear_wgrad` with the forward's recipe and the layer's sites — so a decorator
//! below (the debug tools) sees all three GEMMs of every layer.

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn_te_kernels::{Fp8Format, Fp8Stats, ScaleBlock};

use crate::backend::{AutodiffInner, Fp8HostData, Fp8Primitive, Scaling, TeBackend};
use crate::error::TeError;
use crate::fused::{AttentionMask, NormSpec, Pointwise};
use crate::gemm::Gemm;
use crate::metrics::{increment_counter, names};
use crate::primitive::SavedForBackward;
use crate::recipe::Recipe;
use crate::saved::{Saved, SavedOperand, SavedQuantized};
use crate::site::GemmSite;

/// The backward of `te_linear`: dgrad and wgrad with the forward's recipe on the operands it kept, bias gradient
/// in high precision.
#[derive(Debug)]
struct TeLinearBackward {
    site: GemmSite,
    recipe: Option<Recipe>,
}

/// An operand kept for the backward: the high-precision tensor through the checkpointer (so checkpointing
/// strategies apply to it), or the forward's quantization of it (see [`crate::saved`]).
#[derive(Clone, Debug)]
enum Kept<D> {
    Checkpointed(NodeId),
    Quantized(SavedQuantized<D>),
}

impl<D> Kept<D> {
    fn retrieve<B: TeBackend<Fp8Data = D>>(
        self,
        checkpointer: &mut Checkpointer,
    ) -> SavedOperand<B> {
        match self {
            Kept::Checkpointed(id) => {
                Saved::HighPrecision(checkpointer.retrieve_node_output::<FloatTensor<B>>(id))
            }
            Kept::Quantized(quantized) => Saved::Quantized(quantized),
        }
    }
}

impl<B: TeBackend, const N: usize> Backward<B, N> for TeLinearBackward {
    /// x (needed for wgrad) and weight (needed for dgrad).
    type State = (Option<Kept<B::Fp8Data>>, Option<Kept<B::Fp8Data>>);

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (x_state, weight_state) = ops.state;
        let recipe = |gemm| self.site.recipe_of(gemm, self.recipe.as_ref());
        let mut parents = ops.parents.into_iter();
        let (node_x, node_weight, node_bias) = (
            parents.next().flatten(),
            parents.next().flatten(),
            parents.next().flatten(),
        );
        // The gradient reaches the debug tools at the layer's first backward GEMM (see `GemmSite::follows_dgrad`).
        let dgrad_ran = node_x.is_some() && weight_state.is_some();
        if let (Some(node), Some(weight)) = (node_x, weight_state) {
            let weight = weight.retrieve::<B>(checkpointer);
            let site = self.site.with_gemm(Gemm::Dgrad);
            grads.register::<B>(
                node.id,
                B::te_linear_dgrad(weight, grad.clone(), &site, recipe(Gemm::Dgrad)),
            );
        }
        if let (Some(node), Some(x)) = (node_weight, x_state) {
            let x = x.retrieve::<B>(checkpointer);
            let site = self.site.with_gemm(Gemm::Wgrad).following_dgrad(dgrad_ran);
            grads.register::<B>(
                node.id,
                B::te_linear_wgrad(x, grad.clone(), &site, recipe(Gemm::Wgrad)),
            );
        }
        if let Some(node) = node_bias {
            grads.register::<B>(node.id, B::linear_bias_backward(grad));
        }
    }
}

impl<B: TeBackend + AutodiffInner, C: CheckpointStrategy> TeBackend for Autodiff<B, C> {
    type Fp8Data = B::Fp8Data;
    type DelayedState = B::DelayedState;
    type PendingStats = B::PendingStats;

    crate::te_linear_gemms!(dgrad wgrad);

    fn fp8_quantize(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        scaling: Scaling<'_, Self::DelayedState>,
    ) -> Result<Fp8Primitive<Self>, TeError> {
        B::fp8_quantize(Self::inner(tensor), format, scaling)
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
        let step = TeLinearBackward {
            site: site.clone(),
            recipe: recipe.cloned(),
        };
        let (x_tracked, weight_tracked) = (x.is_tracked(), weight.is_tracked());
        // x is only needed for the weight gradient, and the weight only for x's; x is kept quantized unless the
        // user keeps the originals.
        // An operand is kept quantized only for a backward GEMM that runs the forward's recipe (a plan may give it
        // another).
        let quantize = |gemm| {
            recipe.is_some()
                && site.recipe_of(gemm, recipe) == recipe
                && !crate::saved::saving_original_operands()
        };
        // The weight is a parameter, in memory anyway: the backward takes it (and quantizes it for dgrad), but for
        // the FP8 copy a micro-batch of gradient accumulation caches anyway (see `crate::microbatch`).
        // A batched site's "weight" is an activation (attention's k or v): kept quantized as x is.
        let save = [
            weight_tracked && quantize(Gemm::Wgrad),
            x_tracked && quantize(Gemm::Dgrad) && (site.batched || crate::microbatch::caching()),
        ];
        macro_rules! run {
            ($prep:expr, $bias:expr) => {
                match $prep.compute_bound().stateful() {
                    OpsKind::Tracked(mut prep) => {
                        let (output, [saved_x, saved_weight]) = B::te_linear_fprop(
                            x.primitive.clone(),
                            weight.primitive.clone(),
                            $bias,
                            site,
                            recipe,
                            save,
                        );
                        let mut keep =
                            |tracked: bool, saved: Option<SavedQuantized<_>>, tensor, input| {
                                tracked.then(|| match saved {
                                    Some(quantized) => {
                                        increment_counter(
                                            names::KEPT_FP8_BYTES,
                                            quantized.bytes() as u64,
                                        );
                                        Kept::Quantized(quantized)
                                    }
                                    None => {
                                        if recipe.is_some() && input {
                                            increment_counter(names::KEPT_HIGH_PRECISION, 1);
                                        }
                                        Kept::Checkpointed(prep.checkpoint(tensor))
                                    }
                                })
                            };
                        let x_state = keep(weight_tracked, saved_x, &x, true);
                        let weight_state = keep(x_tracked, saved_weight, &weight, false);
                        prep.finish((x_state, weight_state), output)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(B::te_linear(
                        x.primitive,
                        weight.primitive,
                        $bias,
                        site,
                        recipe,
                    )),
                }
            };
        }
        match bias {
            Some(bias) => run!(
                Backward::<B, 3>::prepare::<C>(
                    step,
                    [x.node.clone(), weight.node.clone(), bias.node.clone()]
                ),
                Some(bias.primitive)
            ),
            None => run!(
                Backward::<B, 2>::prepare::<C>(step, [x.node.clone(), weight.node.clone()]),
                None
            ),
        }
    }
}
