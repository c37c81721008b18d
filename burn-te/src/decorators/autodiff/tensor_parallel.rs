//! `te_tp_collective`'s node on `Autodiff<B>`: the exchange forward, its adjoint on the gradient backward
//! (see [`TpCollective`]).

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::tensor::ops::FloatTensor;

use crate::backend::{AutodiffInner, TeBackend};
use crate::distributed::tensor_parallel::{TpCollective, TpExchange, TpGroup};
use crate::error::TeError;

#[derive(Debug)]
struct TpCollectiveBackward {
    collective: TpCollective,
    group: TpGroup,
}

impl<B: TeBackend> Backward<B, 1> for TpCollectiveBackward {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [parent] = ops.parents;
        if let Some(node) = parent {
            // A backward cannot return an error: a failed exchange (a peer died) ends the step here, with its
            // reason; the other ranks get theirs within the group's timeout.
            let grad = self
                .collective
                .backward()
                .apply::<B>(grad, &self.group)
                .unwrap_or_else(|err| panic!("the backward of {:?}: {err}", self.collective));
            grads.register::<B>(node.id, grad);
        }
    }
}

/// `Autodiff<B>`'s `te_tp_collective`: the forward exchange on `B`, and [`TpCollectiveBackward`]. Compute-bound,
/// so no checkpointing strategy recomputes it (a recomputation would be another collective call). A collective
/// whose only exchange is in the backward first passes [`TpGroup::sync_threads`].
pub(super) fn te_tp_collective<B: TeBackend + AutodiffInner, C: CheckpointStrategy>(
    tensor: FloatTensor<Autodiff<B, C>>,
    collective: TpCollective,
    group: &TpGroup,
) -> Result<FloatTensor<Autodiff<B, C>>, TeError> {
    let forward = collective.forward();
    if matches!(forward, TpExchange::Identity | TpExchange::Split(_)) {
        group.sync_threads()?;
    }
    let output = forward.apply::<B>(tensor.primitive.clone(), group)?;
    let step = TpCollectiveBackward {
        collective,
        group: group.clone(),
    };
    Ok(Backward::<B, 1>::prepare::<C>(step, [tensor.node.clone()])
        .compute_bound()
        .stateless(output))
}
