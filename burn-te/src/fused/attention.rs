//! The fused attention core: what `DotProductAttention` calls, and its backward node on `Autodiff`.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::ops::{BoolTensor, FloatTensor};

use super::{AttentionMask, AttentionSpec};
use crate::backend::{AutodiffInner, TeBackend};
use crate::error::TeError;

/// What the fused core reads: q `[s, b, heads, d]` and k, v `[s, b, groups, d]` (`[b, s, ..]` unless
/// `spec.seq_first`), or one tensor `[.., heads + 2 · groups, d]` they are views of (see
/// [`TeBackend::te_attention_packed`]).
pub(crate) enum AttentionInputs<'a, B: Backend> {
    /// q, k and v.
    Separate([&'a Tensor<B, 4>; 3]),
    /// The packed tensor and `(heads, groups)`.
    Packed(&'a Tensor<B, 4>, (usize, usize)),
}

/// `softmax(q·kᵀ · scale + mask) · v` per head by the backend's fused op, to `[s, b, heads · d]` (or `[b, s, ..]`);
/// `None` where the backend has none (or [`with_composed_elementwise`](super::with_composed_elementwise) or
/// [`with_composed_attention_core`](super::with_composed_attention_core) asks for the composed ops).
pub(crate) fn try_fused<B: TeBackend>(
    inputs: AttentionInputs<'_, B>,
    spec: AttentionSpec,
    causal: bool,
    padding: Option<&Tensor<B, 2, Bool>>,
) -> Result<Option<Tensor<B, 3>>, TeError> {
    if !super::fused_attention_allowed() {
        return Ok(None);
    }
    let mask = AttentionMask {
        causal,
        padding: padding.map(|p| p.clone().into_primitive()),
    };
    let primitive = |t: &Tensor<B, 4>| t.clone().into_primitive().tensor();
    let out = match inputs {
        AttentionInputs::Separate([q, k, v]) => {
            B::te_attention(primitive(q), primitive(k), primitive(v), spec, mask)
        }
        AttentionInputs::Packed(qkv, parts) => {
            B::te_attention_packed(primitive(qkv), parts, spec, mask)
        }
    }?;
    Ok(out.map(|o| Tensor::from_primitive(TensorPrimitive::Float(o))))
}

/// The backward of the fused attention: recomputes the probabilities from the operands and the log-sum-exp.
#[derive(Debug)]
struct AttentionBackward {
    spec: AttentionSpec,
}

/// What the backward keeps: q, k, v, the log-sum-exp per query row and the mask.
type AttentionState<B> = (
    [FloatTensor<B>; 3],
    FloatTensor<B>,
    AttentionMask<BoolTensor<B>>,
);

impl<B: TeBackend> Backward<B, 3> for AttentionBackward {
    type State = AttentionState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let dout = grads.consume::<B>(&ops.node);
        let ([q, k, v], lse, mask) = ops.state;
        let grads_qkv = B::te_attention_backward(dout, q, k, v, lse, self.spec, mask);
        for (parent, grad) in ops.parents.into_iter().zip(grads_qkv) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// The backward of the fused attention on packed q, k, v: the packed tensor's gradient
/// ([`TeBackend::te_attention_packed_backward`]).
#[derive(Debug)]
struct PackedAttentionBackward {
    spec: AttentionSpec,
}

impl<B: TeBackend> Backward<B, 1> for PackedAttentionBackward {
    type State = AttentionState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let dout = grads.consume::<B>(&ops.node);
        let ([q, k, v], lse, mask) = ops.state;
        if let [Some(node)] = ops.parents {
            let grad = B::te_attention_packed_backward(dout, q, k, v, lse, self.spec, mask);
            grads.register::<B>(node.id, grad);
        }
    }
}

/// `te_attention_packed` on `Autodiff<B>`: `B`'s fused forward on views of the packed tensor, with
/// [`PackedAttentionBackward`] registered on it.
pub(crate) fn autodiff_attention_packed<B: TeBackend + AutodiffInner, C: CheckpointStrategy>(
    qkv: FloatTensor<Autodiff<B, C>>,
    (heads, groups): (usize, usize),
    spec: AttentionSpec,
    mask: AttentionMask<BoolTensor<Autodiff<B, C>>>,
) -> Result<Option<FloatTensor<Autodiff<B, C>>>, TeError> {
    let operands = crate::backend::split_packed::<B>(qkv.primitive.clone(), heads, groups);
    let [q, k, v] = operands.clone();
    let Some((out, lse)) = B::te_attention_forward(q, k, v, spec, mask.clone())? else {
        return Ok(None);
    };
    Ok(Some(
        match Backward::<B, 1>::prepare::<C>(PackedAttentionBackward { spec }, [qkv.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((operands, lse, mask), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        },
    ))
}

/// `te_attention` on `Autodiff<B>`: `B`'s fused forward, with [`AttentionBackward`] registered.
pub(crate) fn autodiff_attention<B: TeBackend + AutodiffInner, C: CheckpointStrategy>(
    q: FloatTensor<Autodiff<B, C>>,
    k: FloatTensor<Autodiff<B, C>>,
    v: FloatTensor<Autodiff<B, C>>,
    spec: AttentionSpec,
    mask: AttentionMask<BoolTensor<Autodiff<B, C>>>,
) -> Result<Option<FloatTensor<Autodiff<B, C>>>, TeError> {
    let operands = [
        q.primitive.clone(),
        k.primitive.clone(),
        v.primitive.clone(),
    ];
    let Some((out, lse)) = B::te_attention_forward(
        operands[0].clone(),
        operands[1].clone(),
        operands[2].clone(),
        spec,
        mask.clone(),
    )?
    else {
        return Ok(None);
    };
    let parents = [q.node.clone(), k.node.clone(), v.node.clone()];
    Ok(Some(
        match Backward::<B, 3>::prepare::<C>(AttentionBackward { spec }, parents)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((operands, lse, mask), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        },
    ))
}
