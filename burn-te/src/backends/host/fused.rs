//! The fused element-wise ops on the host path ([`burn_te_kernels::host::fused`]): the Burn glue that reads a CPU
//! backend's tensors, runs the kernel and wraps its output. Only f32 tensors take them; other dtypes answer
//! `None`, so the modules compose Burn ops and keep the dtype.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_te_kernels::Fp8Format;
use burn_te_kernels::host::fused::{activation, bias, dropout, norm, softmax};

use super::{HostDelayedState, HostFp8Data, HostValues, host_tensor};
use crate::error::TeError;
use crate::fused::{
    AttentionMask, CastInput, CastInputForward, CastInputSaved, DropoutMask, NormForward,
    NormGrads, NormOperands, NormSaved, NormSpec, Pointwise,
};
use crate::metrics::{count_launch, names};
use crate::primitive::Fp8Tensor;
use crate::primitive::rows_cols;

/// How a host backend reads its tensors (`flex_values`, `values::<NdArray>`).
pub(super) type Read<B> = fn(FloatTensor<B>) -> Result<(HostValues, Shape), TeError>;

/// Whether the tensor holds f32 (what the host kernels take).
pub(super) fn f32_only<B: Backend>(t: &FloatTensor<B>) -> bool {
    t.dtype() == DType::F32
}

/// Reads a tensor that the op's own forward produced or took (a backward's operands): a read failure here is a
/// backend failure mid-backward, which has no error path.
fn read_back<B: Backend>(read: Read<B>, t: FloatTensor<B>) -> (HostValues, Shape) {
    read(t).unwrap_or_else(|err| panic!("fused backward: {err}"))
}

/// [`TeBackend::te_norm_forward`](crate::TeBackend::te_norm_forward) on the host.
pub(super) fn norm_forward<B: Backend>(
    read: Read<B>,
    norm: NormOperands<FloatTensor<B>>,
) -> Result<NormForward<FloatTensor<B>>, TeError> {
    let device = B::float_device(&norm.x);
    let forward = run_norm::<B, _>(read, norm, norm::norm_forward)?;
    Ok(forward.map(|(y, shape, saved)| (host_tensor::<B>(y, shape, &device), saved)))
}

/// [`TeBackend::te_cast_input_forward`](crate::TeBackend::te_cast_input_forward) on the host: the op's output
/// encoded with the state's scale in the op's pass, its amax recorded into the state's history.
pub(super) fn cast_input_forward<B: Backend>(
    read: Read<B>,
    input: CastInput<FloatTensor<B>>,
    format: Fp8Format,
    state: &HostDelayedState,
) -> Result<CastInputForward<HostFp8<B>, FloatTensor<B>>, TeError> {
    let device = B::float_device(input.x());
    let mut history = super::lock(state);
    let (scale, scale_inv) = (history.scale, history.scale_inv);
    let quantization = (scale, format);
    let forward = match input {
        CastInput::Norm(norm) => run_norm::<B, _>(read, norm, |x, gamma, beta, spec| {
            let (codes, amax, stats) =
                norm::norm_forward_quantized(x, gamma, beta, spec, quantization);
            ((codes, amax), stats)
        })?
        .map(|(codes, shape, saved)| (codes, shape, CastInputSaved::Norm(saved))),
        CastInput::Activation { x, f, gated } => {
            let run = |x: &[f32], width| {
                activation::activation_forward_quantized(x, width, (f, gated), quantization)
            };
            run_activation::<B, _>(read, x, gated, run)?
                .map(|(codes, shape)| (codes, shape, CastInputSaved::Activation))
        }
    };
    Ok(forward.map(|((codes, amax), shape, saved)| {
        // A quantize kernel too: it wrote the codes the GEMM reads.
        count_launch(names::QUANTIZE_LAUNCHES);
        history.record(amax);
        let codes = super::fp8_tensor(codes, vec![scale_inv], None, shape, format, device);
        (codes, saved)
    }))
}

/// A host backend's FP8 tensor.
type HostFp8<B> = Fp8Tensor<HostFp8Data<<B as burn::tensor::backend::BackendTypes>::Device>>;

/// A norm kernel's output, the input's shape and the row statistics, or `None` (not f32).
type NormRun<Y, B> = Option<(Y, Shape, NormSaved<FloatTensor<B>>)>;

/// Reads a norm's operands (`None` for other dtypes than f32), checks that γ and β are `[width]`, runs `kernel`,
/// and wraps its row statistics as the backward takes them: the kernel's output, the input's shape, the statistics.
fn run_norm<B: Backend, Y>(
    read: Read<B>,
    norm: NormOperands<FloatTensor<B>>,
    kernel: impl FnOnce(&[f32], &[f32], Option<&[f32]>, NormSpec) -> (Y, norm::NormStats),
) -> Result<NormRun<Y, B>, TeError> {
    if !f32_only::<B>(&norm.x) {
        return Ok(None);
    }
    count_launch(names::FUSED_NORM);
    let device = B::float_device(&norm.x);
    let (x, shape) = read(norm.x)?;
    let (gamma, gamma_shape) = read(norm.gamma)?;
    let beta = norm.beta.map(read).transpose()?;
    let width = rows_cols(&shape).1;
    let params = [Some(&gamma_shape), beta.as_ref().map(|(_, s)| s)];
    if let Some(bad) = params
        .into_iter()
        .flatten()
        .find(|s| s.as_slice() != [width])
    {
        return Err(TeError::ShapeMismatch {
            op: "te_norm",
            reason: format!("γ and β must be [{width}], the input's last dimension"),
            lhs: shape.as_slice().to_vec(),
            rhs: bad.as_slice().to_vec(),
        });
    }
    let (y, stats) = kernel(&x, &gamma, beta.as_ref().map(|(b, _)| &b[..]), norm.spec);
    let rows = Shape::new([stats.rstd.len()]);
    let saved = NormSaved {
        mean: (!stats.mean.is_empty()).then(|| host_tensor::<B>(stats.mean, rows.clone(), &device)),
        rstd: host_tensor::<B>(stats.rstd, rows, &device),
    };
    Ok(Some((y, shape, saved)))
}

/// [`TeBackend::te_norm_backward`](crate::TeBackend::te_norm_backward) on the host.
pub(super) fn norm_backward<B: Backend>(
    read: Read<B>,
    dy: FloatTensor<B>,
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    saved: NormSaved<FloatTensor<B>>,
    spec: NormSpec,
) -> NormGrads<FloatTensor<B>> {
    count_launch(names::FUSED_NORM_BACKWARD);
    let device = B::float_device(&x);
    let (dy, _) = read_back::<B>(read, dy);
    let (x, shape) = read_back::<B>(read, x);
    let (gamma, gamma_shape) = read_back::<B>(read, gamma);
    let stats = norm::NormStats {
        mean: saved
            .mean
            .map(|m| read_back::<B>(read, m).0.to_vec())
            .unwrap_or_default(),
        rstd: read_back::<B>(read, saved.rstd).0.to_vec(),
    };
    let (dx, dgamma, dbeta) = norm::norm_backward(&dy, &x, &gamma, &stats, spec);
    NormGrads {
        x: host_tensor::<B>(dx, shape, &device),
        gamma: host_tensor::<B>(dgamma, gamma_shape.clone(), &device),
        beta: (!dbeta.is_empty()).then(|| host_tensor::<B>(dbeta, gamma_shape, &device)),
    }
}

/// [`TeBackend::te_add_bias`](crate::TeBackend::te_add_bias) on the host: `out [.., n] + bias [n]` row by row on
/// every core; anything else (other dtypes, a bias that is not the last dimension) as Burn's broadcast add.
pub(super) fn add_bias<B: Backend>(
    read: Read<B>,
    out: FloatTensor<B>,
    bias: FloatTensor<B>,
) -> FloatTensor<B> {
    let width = bias.shape().num_elements();
    let rows_of_bias = out.shape().as_slice().last() == Some(&width) && width > 0;
    if !(rows_of_bias && f32_only::<B>(&out) && f32_only::<B>(&bias)) {
        return crate::backend::add_bias_broadcast::<B>(out, bias);
    }
    count_launch(names::FUSED_BIAS);
    let device = B::float_device(&out);
    let (x, shape) = read(out).unwrap_or_else(|err| panic!("te_add_bias: {err}"));
    let (b, _) = read(bias).unwrap_or_else(|err| panic!("te_add_bias: {err}"));
    host_tensor::<B>(bias::add_bias(&x, &b), shape, &device)
}

/// [`TeBackend::te_bias_grad`](crate::TeBackend::te_bias_grad) on the host: the column sums of `output_grad
/// [.., n]` in blocks of columns on every core; other dtypes and rank-1 or empty gradients as Burn's
/// `linear_bias_backward`.
pub(super) fn bias_grad<B: Backend>(read: Read<B>, output_grad: FloatTensor<B>) -> FloatTensor<B> {
    let shape = output_grad.shape();
    let width = shape.as_slice().last().copied().unwrap_or(0);
    if !(f32_only::<B>(&output_grad) && shape.num_dims() >= 2 && width > 0) {
        return B::linear_bias_backward(output_grad);
    }
    count_launch(names::FUSED_BIAS_GRAD);
    let device = B::float_device(&output_grad);
    let (dy, _) = read_back::<B>(read, output_grad);
    host_tensor::<B>(bias::bias_grad(&dy, width), Shape::new([width]), &device)
}

/// [`TeBackend::te_activation_forward`](crate::TeBackend::te_activation_forward) on the host.
pub(super) fn activation_forward<B: Backend>(
    read: Read<B>,
    x: FloatTensor<B>,
    f: Pointwise,
    gated: bool,
) -> Result<Option<FloatTensor<B>>, TeError> {
    let device = B::float_device(&x);
    let run = |x: &[f32], width| activation::activation_forward(x, width, f, gated);
    let forward = run_activation::<B, _>(read, x, gated, run)?;
    Ok(forward.map(|(y, shape)| host_tensor::<B>(y, shape, &device)))
}

/// Reads an activation's input (`None` for other dtypes than f32), checks that a gated one has an even width,
/// runs `kernel` on the values and the width: its output and the output's shape.
fn run_activation<B: Backend, Y>(
    read: Read<B>,
    x: FloatTensor<B>,
    gated: bool,
    kernel: impl FnOnce(&[f32], usize) -> Y,
) -> Result<Option<(Y, Shape)>, TeError> {
    if !f32_only::<B>(&x) {
        return Ok(None);
    }
    count_launch(names::FUSED_ACTIVATION);
    let (x, shape) = read(x)?;
    let width = rows_cols(&shape).1;
    if gated && !width.is_multiple_of(2) {
        return Err(TeError::ShapeMismatch {
            op: "te_activation",
            reason: "a gated activation needs an even last dimension (value and gate halves)"
                .into(),
            lhs: shape.as_slice().to_vec(),
            rhs: vec![],
        });
    }
    let y = kernel(&x, width);
    let mut dims = shape.as_slice().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = if gated { width / 2 } else { width };
    }
    Ok(Some((y, Shape::from(dims))))
}

/// [`TeBackend::te_activation_backward`](crate::TeBackend::te_activation_backward) on the host.
pub(super) fn activation_backward<B: Backend>(
    read: Read<B>,
    dy: FloatTensor<B>,
    x: FloatTensor<B>,
    f: Pointwise,
    gated: bool,
) -> FloatTensor<B> {
    count_launch(names::FUSED_ACTIVATION_BACKWARD);
    let device = B::float_device(&x);
    let (dy, _) = read_back::<B>(read, dy);
    let (x, shape) = read_back::<B>(read, x);
    let dx = activation::activation_backward(&dy, &x, rows_cols(&shape).1, f, gated);
    host_tensor::<B>(dx, shape, &device)
}

/// [`TeBackend::te_softmax_forward`](crate::TeBackend::te_softmax_forward) on the host.
pub(super) fn softmax_forward<B: Backend>(
    read: Read<B>,
    scores: FloatTensor<B>,
    scale: f32,
    mask: AttentionMask<BoolTensor<B>>,
) -> Result<Option<FloatTensor<B>>, TeError> {
    if !f32_only::<B>(&scores) {
        return Ok(None);
    }
    count_launch(names::FUSED_SOFTMAX);
    let device = B::float_device(&scores);
    let (s, shape) = read(scores)?;
    let &[batch, heads, queries, keys] = shape.as_slice() else {
        return Err(TeError::ShapeMismatch {
            op: "te_softmax",
            reason: "expected scores [batch, heads, queries, keys]".into(),
            lhs: shape.as_slice().to_vec(),
            rhs: vec![],
        });
    };
    let padding = padding_mask::<B>(
        mask.padding,
        (
            "te_softmax",
            "the padding mask must be [batch, keys] of the scores",
        ),
        [batch, keys],
        shape.as_slice(),
    )?;
    let dims = softmax::ScoresShape {
        batch,
        heads,
        queries,
        keys,
    };
    let mask = softmax::SoftmaxMask {
        causal: mask.causal,
        padding: padding.as_deref(),
    };
    let probs = softmax::softmax_forward(&s, dims, scale, mask);
    Ok(Some(host_tensor::<B>(probs, shape, &device)))
}

/// An attention's padding mask `[batch, keys]` as booleans, or an error from `op` saying `reason` when it has
/// another shape (`against`: the shape it is checked against, for the message).
pub(super) fn padding_mask<B: Backend>(
    padding: Option<BoolTensor<B>>,
    (op, reason): (&'static str, &str),
    [batch, keys]: [usize; 2],
    against: &[usize],
) -> Result<Option<Vec<bool>>, TeError> {
    let Some(padding) = padding else {
        return Ok(None);
    };
    let data = burn_te_kernels::cubecl::future::block_on(B::bool_into_data(padding))
        .map_err(|err| TeError::Read(format!("{err:?}")))?;
    if data.shape.as_slice() != [batch, keys] {
        return Err(TeError::ShapeMismatch {
            op,
            reason: reason.into(),
            lhs: data.shape.as_slice().to_vec(),
            rhs: against.to_vec(),
        });
    }
    data.convert::<bool>()
        .into_vec::<bool>()
        .map(Some)
        .map_err(|err| TeError::Read(format!("{err:?}")))
}

/// [`TeBackend::te_softmax_backward`](crate::TeBackend::te_softmax_backward) on the host.
pub(super) fn softmax_backward<B: Backend>(
    read: Read<B>,
    dp: FloatTensor<B>,
    probs: FloatTensor<B>,
    scale: f32,
) -> FloatTensor<B> {
    count_launch(names::FUSED_SOFTMAX_BACKWARD);
    let device = B::float_device(&probs);
    let (dp, _) = read_back::<B>(read, dp);
    let (p, shape) = read_back::<B>(read, probs);
    let ds = softmax::softmax_backward(&dp, &p, rows_cols(&shape).1, scale);
    host_tensor::<B>(ds, shape, &device)
}

/// [`TeBackend::te_dropout_seed`](crate::TeBackend::te_dropout_seed) on the host: 64 bits from the backend's RNG,
/// four draws of 16 bits (`Uniform(0, 65536)`), the first the lowest. One draw of `Distribution::Default` is not
/// enough: burn-ndarray draws it from 0..255, and Flex's integers are 32 bits wide.
pub(super) fn dropout_seed<B: Backend>(device: &B::Device) -> u64 {
    let draws = burn::tensor::Tensor::<B, 1, burn::tensor::Int>::random(
        [4],
        burn::tensor::Distribution::Uniform(0.0, 65536.0),
        device,
    )
    .into_data();
    draws
        .iter::<i64>()
        .enumerate()
        .fold(0u64, |seed, (i, draw)| {
            seed | ((draw as u64 & 0xffff) << (16 * i))
        })
}

/// [`TeBackend::te_dropout_forward`](crate::TeBackend::te_dropout_forward) on the host.
pub(super) fn dropout_forward<B: Backend>(
    read: Read<B>,
    x: FloatTensor<B>,
    mask: DropoutMask,
) -> Result<Option<FloatTensor<B>>, TeError> {
    if !f32_only::<B>(&x) {
        return Ok(None);
    }
    count_launch(names::FUSED_DROPOUT);
    let device = B::float_device(&x);
    let (x, shape) = read(x)?;
    Ok(Some(host_tensor::<B>(
        dropout::dropout(&x, mask),
        shape,
        &device,
    )))
}

/// [`TeBackend::te_dropout_backward`](crate::TeBackend::te_dropout_backward) on the host.
pub(super) fn dropout_backward<B: Backend>(
    read: Read<B>,
    dy: FloatTensor<B>,
    mask: DropoutMask,
) -> FloatTensor<B> {
    count_launch(names::FUSED_DROPOUT_BACKWARD);
    let device = B::float_device(&dy);
    let (dy, shape) = read_back::<B>(read, dy);
    host_tensor::<B>(dropout::dropout(&dy, mask), shape, &device)
}
