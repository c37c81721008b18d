//! The fused scaled, masked softmax of the attention: what `DotProductAttention` calls, and its backward node on
//! `Autodiff`.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::ops::FloatTensor;

use super::AttentionMask;
use crate::backend::{AutodiffInner, TeBackend};
use crate::error::TeError;

/// `softmax(scores · scale)` over the keys of `scores [batch, heads, queries, keys]` with `mask`'s keys at 0 (a
/// fully masked row all 0) by the backend's fused op, or `None` where it has none (or
/// [`with_composed_elementwise`](super::with_composed_elementwise) asks for the composed ops).
pub(crate) fn try_fused<B: TeBackend>(
    scores: &Tensor<B, 4>,
    scale: f32,
    causal: bool,
    padding: Option<&Tensor<B, 2, Bool>>,
) -> Result<Option<Tensor<B, 4>>, TeError> {
    if !super::fused_allowed() {
        return Ok(None);
    }
    let mask = AttentionMask {
        causal,
        padding: padding.map(|p| p.clone().into_primitive()),
    };
    let probs = B::te_softmax(scores.clone().into_primitive().tensor(), scale, mask)?;
    Ok(probs.map(|p| Tensor::from_primitive(TensorPrimitive::Float(p))))
}

/// The backward of the fused softmax, from its output.
#[derive(Debug)]
struct SoftmaxBackward {
    scale: f32,
}

impl<B: TeBackend> Backward<B, 1> for SoftmaxBackward {
    /// The probabilities.
    type State = FloatTensor<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let dp = grads.consume::<B>(&ops.node);
        if let [Some(node)] = ops.parents {
            grads.register::<B>(node.id, B::te_softmax_backward(dp, ops.state, self.scale));
        }
    }
}

/// `te_softmax` on `Autodiff<B>`: `B`'s fused forward, with [`SoftmaxBackward`] registered.
pub(crate) fn autodiff_softmax<B: TeBackend + AutodiffInner, C: CheckpointStrategy>(
    scores: FloatTensor<Autodiff<B, C>>,
    scale: f32,
    mask: AttentionMask<burn::tensor::ops::BoolTensor<Autodiff<B, C>>>,
) -> Result<Option<FloatTensor<Autodiff<B, C>>>, TeError> {
    let Some(probs) = B::te_softmax_forward(scores.primitive.clone(), scale, mask)? else {
        return Ok(None);
    };
    Ok(Some(
        match Backward::<B, 1>::prepare::<C>(SoftmaxBackward { scale }, [scores.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(probs.clone(), probs),
            OpsKind::UnTracked(prep) => prep.finish(probs),
        },
    ))
}
