//! [`TeBackend::te_attention`](crate::TeBackend::te_attention) on the host: the Burn glue around
//! [`burn_te_kernels::host::fused::attention`]. q, k and v are read at their strides (a Flex view of a packed QKV
//! projection is not copied); the output and the gradients come back in the layouts the modules read next.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_te_kernels::host::fused::attention::{
    self as kernel, AttentionDims, BackwardInputs, View,
};
use burn_te_kernels::host::fused::softmax::SoftmaxMask;

use super::{HostValues, host_tensor};
use crate::error::TeError;
use crate::fused::{AttentionForward, AttentionMask, AttentionSpec};
use crate::metrics::{count_launch, names};

/// A tensor's f32 values with the offset and strides (elements) of its view into them.
pub(super) struct Strided {
    pub values: HostValues,
    pub offset: usize,
    pub strides: Vec<usize>,
    pub shape: Shape,
}

/// How a host backend reads a tensor at its strides.
pub(super) type ReadStrided<B> = fn(FloatTensor<B>) -> Result<Strided, TeError>;

/// Row-major strides of `shape`.
pub(super) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    strides
}

fn shape_error(reason: String, lhs: &Shape, rhs: &Shape) -> TeError {
    TeError::ShapeMismatch {
        op: "te_attention",
        reason,
        lhs: lhs.as_slice().to_vec(),
        rhs: rhs.as_slice().to_vec(),
    }
}

/// The sizes from q `[s, b, heads, d]` and k, v `[s, b, groups, d]` (`[b, s, ..]` unless `seq_first`): an error
/// naming the shapes when they do not fit together.
fn dims(q: &Shape, k: &Shape, v: &Shape, seq_first: bool) -> Result<AttentionDims, TeError> {
    let (&[q0, q1, heads, head_dim], &[k0, k1, groups, kd]) = (q.as_slice(), k.as_slice()) else {
        return Err(shape_error(
            "q, k and v must be rank 4 ([s, b, heads, d] or [b, s, heads, d])".into(),
            q,
            k,
        ));
    };
    let ((queries, batch), (keys, kb)) = if seq_first {
        ((q0, q1), (k0, k1))
    } else {
        ((q1, q0), (k1, k0))
    };
    if kb != batch || kd != head_dim || groups == 0 || heads % groups != 0 {
        return Err(shape_error(
            "k must have q's batch and head size and a number of heads that divides q's".into(),
            q,
            k,
        ));
    }
    if v != k {
        return Err(shape_error("v must have k's shape".into(), v, k));
    }
    Ok(AttentionDims {
        batch,
        heads,
        groups,
        queries,
        keys,
        head_dim,
    })
}

/// `[batch, heads, seq, d]` strides from a tensor's own order (`[s, b, h, d]` or `[b, s, h, d]`).
fn bhsd(strides: &[usize], seq_first: bool) -> [usize; 4] {
    if seq_first {
        [strides[1], strides[2], strides[0], strides[3]]
    } else {
        [strides[0], strides[2], strides[1], strides[3]]
    }
}

/// The kernel's view of a tensor read at its strides, or an error when the strides leave its values.
fn view(t: &Strided, seq_first: bool, shape: [usize; 4]) -> Result<View<'_>, TeError> {
    View::new(&t.values, t.offset, bhsd(&t.strides, seq_first), shape).ok_or_else(|| {
        TeError::Read(format!(
            "te_attention: a view of shape {:?} at strides {:?} from offset {} leaves its {} values",
            t.shape.as_slice(),
            t.strides,
            t.offset,
            t.values.len()
        ))
    })
}

/// The padding mask `[batch, keys]` as booleans, checked against the sizes.
fn padding<B: Backend>(
    padding: Option<BoolTensor<B>>,
    dims: &AttentionDims,
) -> Result<Option<Vec<bool>>, TeError> {
    let expected = [dims.batch, dims.keys];
    let reason = ("te_attention", "the padding mask must be [batch, keys]");
    super::fused::padding_mask::<B>(padding, reason, expected, &expected)
}

/// The forward on the host: the output `[s, b, heads · d]` (or `[b, s, ..]`) and the log-sum-exp `[b, heads, s]`.
pub(super) fn attention_forward<B: Backend>(
    read: ReadStrided<B>,
    [q, k, v]: [FloatTensor<B>; 3],
    spec: AttentionSpec,
    mask: AttentionMask<BoolTensor<B>>,
) -> Result<AttentionForward<FloatTensor<B>>, TeError> {
    if [&q, &k, &v].iter().any(|t| t.dtype() != DType::F32) {
        return Ok(None);
    }
    let device = B::float_device(&q);
    let (q, k, v) = (read(q)?, read(k)?, read(v)?);
    let dims = dims(&q.shape, &k.shape, &v.shape, spec.seq_first)?;
    let padding = padding::<B>(mask.padding, &dims)?;
    count_launch(names::FUSED_ATTENTION);
    let seq_first = spec.seq_first;
    let (qv, kv, vv) = (
        view(&q, seq_first, dims.q_shape())?,
        view(&k, seq_first, dims.kv_shape())?,
        view(&v, seq_first, dims.kv_shape())?,
    );
    let [s0, s1, heads, d] = q.shape.as_slice().try_into().expect("rank 4, checked");
    let out_shape = Shape::new([s0, s1, heads * d]);
    let out_strides = bhsd(&contiguous_strides(&[s0, s1, heads, d]), seq_first);
    let mask = SoftmaxMask {
        causal: mask.causal,
        padding: padding.as_deref(),
    };
    let (out, lse) = kernel::attention_forward(
        qv,
        kv,
        vv,
        dims,
        spec.scale,
        (mask, spec.dropout),
        out_strides,
        out_shape.num_elements(),
    );
    let lse_shape = Shape::new([dims.batch, dims.heads, dims.queries]);
    Ok(Some((
        host_tensor::<B>(out, out_shape, &device),
        host_tensor::<B>(lse, lse_shape, &device),
    )))
}

/// The backward on the host: the gradients of q, k and v, each contiguous in its input's shape.
pub(super) fn attention_backward<B: Backend>(
    read: ReadStrided<B>,
    dout: FloatTensor<B>,
    qkv: [FloatTensor<B>; 3],
    lse: FloatTensor<B>,
    spec: AttentionSpec,
    mask: AttentionMask<BoolTensor<B>>,
) -> [FloatTensor<B>; 3] {
    let device = B::float_device(&qkv[0]);
    with_backward_operands::<B, _>(
        read,
        dout,
        qkv,
        lse,
        spec,
        mask,
        |inputs, q_shape, k_shape| {
            let seq_first = spec.seq_first;
            let [dq, dk, dv] = kernel::attention_backward(
                inputs,
                bhsd(&contiguous_strides(&q_shape), seq_first),
                bhsd(&contiguous_strides(&k_shape), seq_first),
            );
            [
                host_tensor::<B>(dq, Shape::from(q_shape), &device),
                host_tensor::<B>(dk, Shape::from(k_shape.clone()), &device),
                host_tensor::<B>(dv, Shape::from(k_shape), &device),
            ]
        },
    )
}

/// The backward on the host for q, k and v that were views of one packed tensor: that tensor's gradient
/// `[s, b, heads + 2 · groups, d]` (`[b, s, ..]` unless `seq_first`), each part written in its head slots.
pub(super) fn attention_packed_backward<B: Backend>(
    read: ReadStrided<B>,
    dout: FloatTensor<B>,
    qkv: [FloatTensor<B>; 3],
    lse: FloatTensor<B>,
    spec: AttentionSpec,
    mask: AttentionMask<BoolTensor<B>>,
) -> FloatTensor<B> {
    let device = B::float_device(&qkv[0]);
    with_backward_operands::<B, _>(read, dout, qkv, lse, spec, mask, |inputs, q_shape, _| {
        let dims = inputs.dims;
        let packed = kernel::attention_backward_packed(inputs, spec.seq_first);
        let slots = dims.heads + 2 * dims.groups;
        let shape = [q_shape[0], q_shape[1], slots, dims.head_dim];
        host_tensor::<B>(packed, Shape::from(shape), &device)
    })
}

/// `kernel` given what the backward reads (at the operands' strides), q's shape and k's.
fn with_backward_operands<B: Backend, R>(
    read: ReadStrided<B>,
    dout: FloatTensor<B>,
    [q, k, v]: [FloatTensor<B>; 3],
    lse: FloatTensor<B>,
    spec: AttentionSpec,
    mask: AttentionMask<BoolTensor<B>>,
    kernel: impl FnOnce(BackwardInputs<'_>, Vec<usize>, Vec<usize>) -> R,
) -> R {
    // The operands are the forward's own, read again: a failure here is a backend failure mid-backward, which
    // has no error path.
    let fail = |err: TeError| -> ! { panic!("fused attention backward: {err}") };
    count_launch(names::FUSED_ATTENTION_BACKWARD);
    let seq_first = spec.seq_first;
    let read = |t| read(t).unwrap_or_else(|err| fail(err));
    let (q, k, v, lse, dout) = (read(q), read(k), read(v), read(lse), read(dout));
    let dims = dims(&q.shape, &k.shape, &v.shape, seq_first).unwrap_or_else(|err| fail(err));
    let lse_shape = [dims.batch, dims.heads, dims.queries];
    if lse.offset != 0 || lse.strides != contiguous_strides(&lse_shape) {
        fail(TeError::Read(format!(
            "the log-sum-exp must be a row-major [{}, {}, {}] tensor, got strides {:?} from offset {}",
            dims.batch, dims.heads, dims.queries, lse.strides, lse.offset
        )));
    }
    let padding = padding::<B>(mask.padding, &dims).unwrap_or_else(|err| fail(err));
    let view = |t, shape| view(t, seq_first, shape).unwrap_or_else(|err| fail(err));
    let q_shape = q.shape.as_slice().to_vec();
    let k_shape = k.shape.as_slice().to_vec();
    // dout arrives as the output's `[s, b, heads · d]`: its strides split into heads.
    let do_strides = {
        let s = &dout.strides;
        vec![s[0], s[1], dims.head_dim * s[2], s[2]]
    };
    let dout = Strided {
        strides: do_strides,
        shape: Shape::from(q_shape.clone()),
        ..dout
    };
    let inputs = BackwardInputs {
        dout: view(&dout, dims.q_shape()),
        q: view(&q, dims.q_shape()),
        k: view(&k, dims.kv_shape()),
        v: view(&v, dims.kv_shape()),
        lse: &lse.values,
        dims,
        scale: spec.scale,
        mask: SoftmaxMask {
            causal: mask.causal,
            padding: padding.as_deref(),
        },
        dropout: spec.dropout,
    };
    kernel(inputs, q_shape, k_shape)
}
