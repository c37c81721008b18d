//! The fused LayerNorm/RMSNorm: what the modules call, and its backward node on `Autodiff`.

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::ops::FloatTensor;

use super::{NormSaved, NormSpec};
use crate::backend::{AutodiffInner, TeBackend};
use crate::error::TeError;

/// `x [.., width]` normalized with γ (and β) by the backend's fused op, or `None` where it has none (or
/// [`with_composed_elementwise`](super::with_composed_elementwise) asks for the composed ops).
pub(crate) fn try_fused<B: TeBackend, const D: usize>(
    x: &Tensor<B, D>,
    gamma: Tensor<B, 1>,
    beta: Option<Tensor<B, 1>>,
    spec: NormSpec,
) -> Result<Option<Tensor<B, D>>, TeError> {
    if !super::fused_allowed() {
        return Ok(None);
    }
    let y = B::te_norm(
        x.clone().into_primitive().tensor(),
        gamma.into_primitive().tensor(),
        beta.map(|b| b.into_primitive().tensor()),
        spec,
    )?;
    Ok(y.map(|y| Tensor::from_primitive(TensorPrimitive::Float(y))))
}

/// The backward of the fused norm: `dx`, `dγ`, `dβ` from the input and γ it checkpointed and its row statistics.
#[derive(Debug)]
struct NormBackward {
    spec: NormSpec,
}

impl<B: TeBackend, const N: usize> Backward<B, N> for NormBackward {
    /// The input's and γ's checkpoints, the row statistics.
    type State = (NodeId, NodeId, NormSaved<FloatTensor<B>>);

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let dy = grads.consume::<B>(&ops.node);
        let (x, gamma, saved) = ops.state;
        let x = checkpointer.retrieve_node_output::<FloatTensor<B>>(x);
        let gamma = checkpointer.retrieve_node_output::<FloatTensor<B>>(gamma);
        let grad = B::te_norm_backward(dy, x, gamma, saved, self.spec);
        let mut parents = ops.parents.into_iter();
        if let Some(node) = parents.next().flatten() {
            grads.register::<B>(node.id, grad.x);
        }
        if let Some(node) = parents.next().flatten() {
            grads.register::<B>(node.id, grad.gamma);
        }
        if let (Some(node), Some(beta)) = (parents.next().flatten(), grad.beta) {
            grads.register::<B>(node.id, beta);
        }
    }
}

/// `te_norm` on `Autodiff<B>`: `B`'s fused forward, with [`NormBackward`] registered.
pub(crate) fn autodiff_norm<B: TeBackend + AutodiffInner, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    gamma: FloatTensor<Autodiff<B, C>>,
    beta: Option<FloatTensor<Autodiff<B, C>>>,
    spec: NormSpec,
) -> Result<Option<FloatTensor<Autodiff<B, C>>>, TeError> {
    let forward = B::te_norm_forward(
        x.primitive.clone(),
        gamma.primitive.clone(),
        beta.as_ref().map(|b| b.primitive.clone()),
        spec,
    )?;
    let Some((y, saved)) = forward else {
        return Ok(None);
    };
    let step = NormBackward { spec };
    macro_rules! track {
        ($prep:expr) => {
            match $prep.compute_bound().stateful() {
                OpsKind::Tracked(mut prep) => {
                    let state = (prep.checkpoint(&x), prep.checkpoint(&gamma), saved);
                    prep.finish(state, y)
                }
                OpsKind::UnTracked(prep) => prep.finish(y),
            }
        };
    }
    Ok(Some(match beta {
        Some(beta) => track!(Backward::<B, 3>::prepare::<C>(
            step,
            [x.node.clone(), gamma.node.clone(), beta.node.clone()]
        )),
        None => track!(Backward::<B, 2>::prepare::<C>(
            step,
            [x.node.clone(), gamma.node.clone()]
        )),
    }))
}
