//! Dropout as a fused op whose mask is regenerated from a seed, never stored: what the TE modules'
//! `hidden_dropout` and `attention_dropout` call, and its backward node on `Autodiff`. The seed is drawn from the
//! backend's RNG at each call, so `B::seed` repeats a run. On a backend without the op (the CubeCL backends) the
//! modules keep Burn's `Dropout`.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::nn::Dropout;
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::ops::FloatTensor;

use super::DropoutMask;
use crate::backend::{AutodiffInner, TeBackend};
use crate::error::TeError;

/// The mask of a training step's dropout at `prob`: its seed drawn from the backend's RNG, or `None` where dropout
/// is off (`prob` 0, or no autodiff: Burn's `Dropout` is the identity there), the backend has no fused dropout,
/// [`with_composed_elementwise`](super::with_composed_elementwise) asks for the composed ops, or `prob` is outside
/// `[0, 1)` (a `Dropout` built by hand: Burn's own gives what it gives there).
pub(crate) fn mask<B: TeBackend>(prob: f64, device: &B::Device) -> Option<DropoutMask> {
    let dropping = prob > 0.0 && prob < 1.0;
    if !(dropping && B::ad_enabled(device) && super::fused_allowed()) {
        return None;
    }
    B::te_dropout_seed(device).map(|seed| DropoutMask { prob, seed })
}

/// `dropout` applied to `x`: by the backend's fused op where it has one (with a fresh [`mask`]), else by Burn's
/// `Dropout`.
pub(crate) fn forward<B: TeBackend, const D: usize>(
    dropout: &Dropout,
    x: Tensor<B, D>,
) -> Result<Tensor<B, D>, TeError> {
    let mask = mask::<B>(dropout.prob, &x.device());
    forward_masked(dropout, x, mask)
}

/// `dropout` applied to `x`: by the backend's fused op with `mask` (from [`mask`]) where there is one and it takes
/// `x`'s dtype, else by Burn's `Dropout`.
pub(crate) fn forward_masked<B: TeBackend, const D: usize>(
    dropout: &Dropout,
    x: Tensor<B, D>,
    mask: Option<DropoutMask>,
) -> Result<Tensor<B, D>, TeError> {
    if let Some(mask) = mask
        && let Some(y) = B::te_dropout(x.clone().into_primitive().tensor(), mask)?
    {
        return Ok(Tensor::from_primitive(TensorPrimitive::Float(y)));
    }
    Ok(dropout.forward(x))
}

/// The backward of the fused dropout: the same mask and factor on the output's gradient.
#[derive(Debug)]
struct DropoutBackward {
    mask: DropoutMask,
}

impl<B: TeBackend> Backward<B, 1> for DropoutBackward {
    type State = ();

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let dy = grads.consume::<B>(&ops.node);
        if let [Some(node)] = ops.parents {
            grads.register::<B>(node.id, B::te_dropout_backward(dy, self.mask));
        }
    }
}

/// `te_dropout` on `Autodiff<B>`: `B`'s fused forward, with [`DropoutBackward`] registered.
pub(crate) fn autodiff_dropout<B: TeBackend + AutodiffInner, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    mask: DropoutMask,
) -> Result<Option<FloatTensor<Autodiff<B, C>>>, TeError> {
    let Some(y) = B::te_dropout_forward(x.primitive.clone(), mask)? else {
        return Ok(None);
    };
    Ok(Some(
        Backward::<B, 1>::prepare::<C>(DropoutBackward { mask }, [x.node.clone()])
            .compute_bound()
            .stateless(y),
    ))
}
