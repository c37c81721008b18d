//! `te_cast_linear`'s backward node on `Autodiff<B>`: the layer's dgrad and wgrad as `te_linear`'s node runs them
//! (wgrad on the codes the norm's or activation's pass wrote), then that op's backward on dgrad's output.

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::FloatTensor;

use super::linear::{Kept, backward_gemms, save_flags};
use crate::backend::{AutodiffInner, TeBackend};
use crate::error::TeError;
use crate::fp8_state::site::GemmSite;
use crate::fused::{CastInput, CastInputSaved, NormOperands};
use crate::recipe::Recipe;

/// The op before the GEMM as its backward runs it: which op, and whether the norm has β.
#[derive(Clone, Copy, Debug)]
enum InputOp {
    Norm(crate::fused::NormSpec, bool),
    Activation(crate::fused::Pointwise, bool),
}

/// The backward of `te_cast_linear`. Parents: the op's (x; a norm's γ and β where it has one), then the weight
/// and the bias where the layer has one.
#[derive(Debug)]
struct CastLinearBackward {
    site: GemmSite,
    recipe: Recipe,
    op: InputOp,
    bias: bool,
}

/// What the op's backward keeps: x's checkpoint, a norm's γ's, and what its forward returned for it.
type InputState<B> = (NodeId, Option<NodeId>, CastInputSaved<FloatTensor<B>>);

/// What the node keeps: the op's state (where x or a norm parameter takes a gradient), the op's output as codes
/// (for wgrad), the weight (for dgrad).
type CastLinearState<B> = (
    Option<InputState<B>>,
    Option<Kept<<B as TeBackend>::Fp8Data>>,
    Option<Kept<<B as TeBackend>::Fp8Data>>,
);

impl<B: TeBackend, const N: usize> Backward<B, N> for CastLinearBackward {
    type State = CastLinearState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (input_state, kept_input, weight) = ops.state;
        let mut parents = ops.parents.into_iter();
        let mut next = |present: bool| {
            if present {
                parents.next().flatten()
            } else {
                None
            }
        };
        let node_x = next(true);
        let (node_gamma, node_beta) = match self.op {
            InputOp::Norm(_, beta) => (next(true), next(beta)),
            InputOp::Activation(..) => (None, None),
        };
        let (node_weight, node_bias) = (next(true), next(self.bias));
        let weight = weight.map(|weight| weight.retrieve::<B>(checkpointer));
        let kept_input = kept_input.map(|x| x.retrieve::<B>(checkpointer));
        let nodes = [node_weight, node_bias].map(|node| node.map(|node| node.id));
        let site = (&self.site, Some(&self.recipe));
        let doutput = backward_gemms::<B>(site, [weight, kept_input], grad, nodes, grads);
        if let (Some((x, gamma, saved)), Some(dy)) = (input_state, doutput) {
            let x = checkpointer.retrieve_node_output::<FloatTensor<B>>(x);
            let input_grads = match (self.op, saved, gamma) {
                (InputOp::Norm(spec, _), CastInputSaved::Norm(saved), Some(gamma)) => {
                    let gamma = checkpointer.retrieve_node_output::<FloatTensor<B>>(gamma);
                    let norm = B::te_norm_backward(dy, x, gamma, saved, spec);
                    [
                        (node_x, Some(norm.x)),
                        (node_gamma, Some(norm.gamma)),
                        (node_beta, norm.beta),
                    ]
                }
                (InputOp::Activation(f, gated), _, _) => {
                    let dx = B::te_activation_backward(dy, x, f, gated);
                    [(node_x, Some(dx)), (None, None), (None, None)]
                }
                (InputOp::Norm(..), ..) => {
                    unreachable!("a norm's forward keeps its statistics and γ")
                }
            };
            for (node, grad) in input_grads {
                if let (Some(node), Some(grad)) = (node, grad) {
                    grads.register::<B>(node.id, grad);
                }
            }
        }
    }
}

/// `Autodiff<B>`'s `te_cast_linear`: `B`'s forward, keeping what the backward needs, and [`CastLinearBackward`].
/// `None` (nothing run) where wgrad would need the op's output in high precision (a plan gives wgrad another
/// recipe, or the originals are kept): the module then runs the op and the GEMM apart.
pub(super) fn te_cast_linear<B: TeBackend + AutodiffInner, C: CheckpointStrategy>(
    input: CastInput<FloatTensor<Autodiff<B, C>>>,
    weight: FloatTensor<Autodiff<B, C>>,
    bias: Option<FloatTensor<Autodiff<B, C>>>,
    site: &GemmSite,
    recipe: &Recipe,
) -> Result<Option<FloatTensor<Autodiff<B, C>>>, TeError> {
    // The op's differentiable operands in parent order (x; γ, β) and which op it is.
    let (operands, op): (Vec<&FloatTensor<Autodiff<B, C>>>, InputOp) = match &input {
        CastInput::Norm(norm) => {
            let beta = norm.beta.as_ref();
            let operands = [Some(&norm.x), Some(&norm.gamma), beta]
                .into_iter()
                .flatten();
            (operands.collect(), InputOp::Norm(norm.spec, beta.is_some()))
        }
        CastInput::Activation { x, f, gated } => (vec![x], InputOp::Activation(*f, *gated)),
    };
    let input_tracked = operands.iter().any(|t| t.is_tracked());
    let weight_tracked = weight.is_tracked();
    let save = save_flags(site, Some(recipe), input_tracked, weight_tracked);
    if weight_tracked && !save[0] {
        return Ok(None);
    }
    let inner = match &input {
        CastInput::Norm(norm) => CastInput::Norm(NormOperands {
            x: norm.x.primitive.clone(),
            gamma: norm.gamma.primitive.clone(),
            beta: norm.beta.as_ref().map(|beta| beta.primitive.clone()),
            spec: norm.spec,
        }),
        CastInput::Activation { x, f, gated } => CastInput::Activation {
            x: x.primitive.clone(),
            f: *f,
            gated: *gated,
        },
    };
    let bias_inner = bias.as_ref().map(|bias| bias.primitive.clone());
    let forward = B::te_cast_linear_fprop(
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
    let step = CastLinearBackward {
        site: site.clone(),
        recipe: recipe.clone(),
        op,
        bias: bias.is_some(),
    };
    let [saved_x, saved_weight] = forward.saved;
    let mut nodes: Vec<_> = operands.iter().map(|t| t.node.clone()).collect();
    nodes.push(weight.node.clone());
    nodes.extend(bias.as_ref().map(|bias| bias.node.clone()));
    let (x, gamma) = (
        operands[0],
        matches!(op, InputOp::Norm(..)).then(|| operands[1]),
    );
    macro_rules! track {
        ($n:literal) => {{
            let nodes: [_; $n] = nodes
                .try_into()
                .unwrap_or_else(|_| unreachable!("2 to 5 parents, counted below"));
            match Backward::<B, $n>::prepare::<C>(step, nodes)
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(mut prep) => {
                    let input_state = input_tracked.then(|| {
                        let gamma = gamma.map(|gamma| prep.checkpoint(gamma));
                        (prep.checkpoint(x), gamma, forward.input)
                    });
                    // wgrad's operand: the codes the op's pass wrote (asked for above).
                    let kept_input = weight_tracked.then(|| {
                        Kept::new(saved_x, true, true, || {
                            unreachable!("te_cast_linear_fprop keeps the codes it is asked to keep")
                        })
                    });
                    let weight_state = input_tracked
                        .then(|| Kept::new(saved_weight, true, false, || prep.checkpoint(&weight)));
                    prep.finish((input_state, kept_input, weight_state), forward.output)
                }
                OpsKind::UnTracked(prep) => prep.finish(forward.output),
            }
        }};
    }
    Ok(Some(match nodes.len() {
        2 => track!(2),
        3 => track!(3),
        4 => track!(4),
        _ => track!(5),
    }))
}
