//! `te_norm_linear`'s backward node on `Autodiff<B>`: the layer's dgrad and wgrad as `te_linear`'s node runs them
//! (wgrad on the codes the norm's pass wrote), then the norm's backward on dgrad's output.

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::FloatTensor;

use super::linear::{Kept, save_flags};
use crate::backend::{AutodiffInner, TeBackend};
use crate::error::TeError;
use crate::fused::{NormOperands, NormSaved, NormSpec};
use crate::gemm::Gemm;
use crate::recipe::Recipe;
use crate::site::GemmSite;

/// The backward of `te_norm_linear`. Parents: x, γ, the weight, then β and the bias where the layer has them.
#[derive(Debug)]
struct NormLinearBackward {
    site: GemmSite,
    recipe: Recipe,
    spec: NormSpec,
    beta: bool,
    bias: bool,
}

/// What the node keeps: x's and γ's checkpoints and the norm's row statistics (where a norm parameter or x
/// takes a gradient), the normalized input's codes (for wgrad), the weight (for dgrad).
type NormLinearState<B> = (
    Option<(NodeId, NodeId, NormSaved<FloatTensor<B>>)>,
    Option<Kept<<B as TeBackend>::Fp8Data>>,
    Option<Kept<<B as TeBackend>::Fp8Data>>,
);

impl<B: TeBackend, const N: usize> Backward<B, N> for NormLinearBackward {
    type State = NormLinearState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (norm_state, normalized, weight) = ops.state;
        let mut parents = ops.parents.into_iter();
        let (node_x, node_gamma, node_weight) = (
            parents.next().flatten(),
            parents.next().flatten(),
            parents.next().flatten(),
        );
        let node_beta = if self.beta {
            parents.next().flatten()
        } else {
            None
        };
        let node_bias = if self.bias {
            parents.next().flatten()
        } else {
            None
        };
        let weight = weight.map(|weight| weight.retrieve::<B>(checkpointer));
        let normalized = normalized.map(|x| x.retrieve::<B>(checkpointer));
        let sites = [
            self.site.with_gemm(Gemm::Dgrad),
            self.site
                .with_gemm(Gemm::Wgrad)
                .following_dgrad(weight.is_some()),
        ];
        let recipe = |gemm| self.site.recipe_of(gemm, Some(&self.recipe));
        let [dnormalized, dweight] = B::te_linear_backward(
            weight,
            normalized,
            grad.clone(),
            [&sites[0], &sites[1]],
            [recipe(Gemm::Dgrad), recipe(Gemm::Wgrad)],
        );
        if let (Some((x, gamma, saved)), Some(dy)) = (norm_state, dnormalized) {
            let x = checkpointer.retrieve_node_output::<FloatTensor<B>>(x);
            let gamma = checkpointer.retrieve_node_output::<FloatTensor<B>>(gamma);
            let norm = B::te_norm_backward(dy, x, gamma, saved, self.spec);
            for (node, grad) in [
                (node_x, Some(norm.x)),
                (node_gamma, Some(norm.gamma)),
                (node_beta, norm.beta),
            ] {
                if let (Some(node), Some(grad)) = (node, grad) {
                    grads.register::<B>(node.id, grad);
                }
            }
        }
        if let (Some(node), Some(dweight)) = (node_weight, dweight) {
            grads.register::<B>(node.id, dweight);
        }
        if let Some(node) = node_bias {
            grads.register::<B>(node.id, B::linear_bias_backward(grad));
        }
    }
}

/// `Autodiff<B>`'s `te_norm_linear`: `B`'s forward, keeping what the backward needs, and [`NormLinearBackward`].
/// `None` (nothing run) where wgrad would need the normalized input in high precision (a plan gives wgrad another
/// recipe, or the originals are kept): the module then runs the norm and the GEMM apart.
pub(super) fn te_norm_linear<B: TeBackend + AutodiffInner, C: CheckpointStrategy>(
    norm: NormOperands<FloatTensor<Autodiff<B, C>>>,
    weight: FloatTensor<Autodiff<B, C>>,
    bias: Option<FloatTensor<Autodiff<B, C>>>,
    site: &GemmSite,
    recipe: &Recipe,
) -> Result<Option<FloatTensor<Autodiff<B, C>>>, TeError> {
    let norm_tracked = norm.x.is_tracked()
        || norm.gamma.is_tracked()
        || norm.beta.as_ref().is_some_and(|beta| beta.is_tracked());
    let weight_tracked = weight.is_tracked();
    let save = save_flags(site, Some(recipe), norm_tracked, weight_tracked);
    if weight_tracked && !save[0] {
        return Ok(None);
    }
    let inner = NormOperands {
        x: norm.x.primitive.clone(),
        gamma: norm.gamma.primitive.clone(),
        beta: norm.beta.as_ref().map(|beta| beta.primitive.clone()),
        spec: norm.spec,
    };
    let bias_inner = bias.as_ref().map(|bias| bias.primitive.clone());
    let forward = B::te_norm_linear_fprop(
        inner,
        weight.primitive.clone(),
        bias_inner,
        site,
        recipe,
        save,
    )?;
    let Some(forward) = forward else {
        return Ok(None);
    };
    let step = NormLinearBackward {
        site: site.clone(),
        recipe: recipe.clone(),
        spec: norm.spec,
        beta: norm.beta.is_some(),
        bias: bias.is_some(),
    };
    let [saved_x, saved_weight] = forward.saved;
    let (x, gamma) = (&norm.x, &norm.gamma);
    macro_rules! track {
        ($n:literal, $nodes:expr) => {
            match Backward::<B, $n>::prepare::<C>(step, $nodes)
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(mut prep) => {
                    let norm_state = norm_tracked
                        .then(|| (prep.checkpoint(x), prep.checkpoint(gamma), forward.norm));
                    // wgrad's operand: the codes the norm's pass wrote (asked for above).
                    let normalized = weight_tracked.then(|| {
                        Kept::new(saved_x, true, true, || {
                            unreachable!("te_norm_linear_fprop keeps the codes it is asked to keep")
                        })
                    });
                    let weight_state = norm_tracked
                        .then(|| Kept::new(saved_weight, true, false, || prep.checkpoint(&weight)));
                    prep.finish((norm_state, normalized, weight_state), forward.output)
                }
                OpsKind::UnTracked(prep) => prep.finish(forward.output),
            }
        };
    }
    let (xn, gn, wn) = (x.node.clone(), gamma.node.clone(), weight.node.clone());
    Ok(Some(match (&norm.beta, &bias) {
        (Some(beta), Some(bias)) => {
            track!(5, [xn, gn, wn, beta.node.clone(), bias.node.clone()])
        }
        (Some(beta), None) => track!(4, [xn, gn, wn, beta.node.clone()]),
        (None, Some(bias)) => track!(4, [xn, gn, wn, bias.node.clone()]),
        (None, None) => track!(3, [xn, gn, wn]),
    }))
}
