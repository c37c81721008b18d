//! The fused MLP activation: what the modules call, and its backward node on `Autodiff`.

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::ops::FloatTensor;

use super::Pointwise;
use crate::backend::{AutodiffInner, TeBackend};
use crate::error::TeError;

/// `f(x)` (gated: `f(a) · v` of `x = [a, v]` along the last dimension) by the backend's fused op, or `None` where
/// it has none (or [`with_composed_elementwise`](super::with_composed_elementwise) asks for the composed ops).
pub(crate) fn try_fused<B: TeBackend, const D: usize>(
    x: &Tensor<B, D>,
    f: Pointwise,
    gated: bool,
) -> Result<Option<Tensor<B, D>>, TeError> {
    if !super::fused_allowed() {
        return Ok(None);
    }
    let y = B::te_activation(x.clone().into_primitive().tensor(), f, gated)?;
    Ok(y.map(|y| Tensor::from_primitive(TensorPrimitive::Float(y))))
}

/// The backward of the fused activation, from the input it checkpointed.
#[derive(Debug)]
struct ActivationBackward {
    f: Pointwise,
    gated: bool,
}

impl<B: TeBackend> Backward<B, 1> for ActivationBackward {
    /// The input's checkpoint.
    type State = NodeId;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let dy = grads.consume::<B>(&ops.node);
        let x = checkpointer.retrieve_node_output::<FloatTensor<B>>(ops.state);
        if let [Some(node)] = ops.parents {
            grads.register::<B>(
                node.id,
                B::te_activation_backward(dy, x, self.f, self.gated),
            );
        }
    }
}

/// `te_activation` on `Autodiff<B>`: `B`'s fused forward, with [`ActivationBackward`] registered.
pub(crate) fn autodiff_activation<B: TeBackend + AutodiffInner, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    f: Pointwise,
    gated: bool,
) -> Result<Option<FloatTensor<Autodiff<B, C>>>, TeError> {
    let Some(y) = B::te_activation_forward(x.primitive.clone(), f, gated)? else {
        return Ok(None);
    };
    let step = ActivationBackward { f, gated };
    Ok(Some(
        match Backward::<B, 1>::prepare::<C>(step, [x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = prep.checkpoint(&x);
                prep.finish(state, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(y),
        },
    ))
}
