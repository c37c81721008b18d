//! Linear GEMMs in high precision on Burn's own ops (`linear` and its backward on rows folded to rank 2), with
//! zero-sized operands answered here: what a GEMM runs without a recipe, on a fallback, and as the reference the
//! debug tools measure a low-precision GEMM against.

use burn::tensor::Shape;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use crate::gemm::Gemm;

/// The zeros a GEMM with a zero-sized dimension gives (`out` elements; `None` when neither operand is empty):
/// answered here because Burn's ndarray matmul divides by zero on an empty operand. An empty batch gives an empty
/// output, and a weight gradient over no tokens is a zero matrix.
pub(crate) fn zero_sized_gemm<B: Backend>(
    lhs: &FloatTensor<B>,
    rhs: &FloatTensor<B>,
    out: Vec<usize>,
) -> Option<FloatTensor<B>> {
    use burn::tensor::TensorMetadata;
    if lhs.shape().num_elements() > 0 && rhs.shape().num_elements() > 0 {
        return None;
    }
    let dtype = lhs.dtype().into();
    Some(B::float_zeros(
        Shape::from(out),
        &B::float_device(lhs),
        dtype,
    ))
}

/// The last dimension of a tensor (0 for a scalar).
fn last_dim<B: Backend>(tensor: &FloatTensor<B>) -> usize {
    use burn::tensor::TensorMetadata;
    tensor.shape().as_slice().last().copied().unwrap_or(0)
}

/// `x · weight + bias` in high precision (the inner backend's `linear` on rows folded to rank 2: Flex's rank-3
/// `linear` with its backward takes 13× the time, `benches/host_path.rs`; zero-sized operands answered here).
fn high_precision_linear<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    use burn::tensor::TensorMetadata;
    let mut out = x.shape().as_slice().to_vec();
    if let Some(last) = out.last_mut() {
        *last = last_dim::<B>(&weight);
    }
    match zero_sized_gemm::<B>(&x, &weight, out.clone()) {
        // No reduction (in_features 0) but tokens: the output is the bias.
        Some(zeros) => match bias {
            Some(bias) if out.iter().product::<usize>() > 0 => {
                let mut shape = vec![1; out.len()];
                if let Some(last) = shape.last_mut() {
                    *last = last_dim::<B>(&bias);
                }
                B::float_add(zeros, B::float_reshape(bias, Shape::from(shape)))
            }
            _ => zeros,
        },
        None => B::float_reshape(
            B::linear(fold_rows::<B>(x).0, weight, bias),
            Shape::from(out),
        ),
    }
}

/// `grad · weightᵀ` in high precision (zero-sized operands answered here).
fn high_precision_dgrad<B: Backend>(
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    use burn::tensor::TensorMetadata;
    let mut out = grad.shape().as_slice().to_vec();
    if let Some(last) = out.last_mut() {
        *last = weight.shape().as_slice().first().copied().unwrap_or(0);
    }
    zero_sized_gemm::<B>(&grad, &weight, out.clone()).unwrap_or_else(|| {
        B::float_reshape(
            B::linear_x_backward(weight, fold_rows::<B>(grad).0),
            Shape::from(out),
        )
    })
}

/// `xᵀ · grad` summed over the leading dimensions, in high precision (zero-sized operands answered here).
fn high_precision_wgrad<B: Backend>(x: FloatTensor<B>, grad: FloatTensor<B>) -> FloatTensor<B> {
    let out = vec![last_dim::<B>(&x), last_dim::<B>(&grad)];
    zero_sized_gemm::<B>(&x, &grad, out)
        .unwrap_or_else(|| B::linear_weight_backward(fold_rows::<B>(x).0, fold_rows::<B>(grad).0))
}

/// A layer GEMM in high precision on its operands in [`Gemm::operands`](crate::Gemm::operands)' order (fprop:
/// `x`, `weight`, plus `bias`; dgrad: `grad`, `weight`; wgrad: `x`, `grad`). `batched`: the GEMM of an attention
/// site (see [`GemmSite::batched`](crate::GemmSite::batched)), per batch and without a bias: fprop `x · w`, dgrad
/// `grad · wᵀ`, wgrad `xᵀ · grad`.
pub(crate) fn high_precision_gemm<B: Backend>(
    gemm: Gemm,
    batched: bool,
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let transpose = |t: FloatTensor<B>| {
        let rank = dims::<B>(&t).len();
        B::float_swap_dims(t, rank - 2, rank - 1)
    };
    match (gemm, batched) {
        (Gemm::Fprop, false) => high_precision_linear::<B>(lhs, rhs, bias),
        (Gemm::Dgrad, false) => high_precision_dgrad::<B>(rhs, lhs),
        (Gemm::Wgrad, false) => high_precision_wgrad::<B>(lhs, rhs),
        (Gemm::Fprop, true) => B::float_matmul(lhs, rhs),
        (Gemm::Dgrad, true) => B::float_matmul(lhs, transpose(rhs)),
        (Gemm::Wgrad, true) => B::float_matmul(transpose(lhs), rhs),
    }
}

/// `[.., d]` folded to `[rows, d]` (a scalar to `[1, 1]`), with the leading dimensions to unfold the result.
pub fn fold_rows<B: Backend>(tensor: FloatTensor<B>) -> (FloatTensor<B>, Vec<usize>) {
    let shape = dims::<B>(&tensor);
    let (last, leading) = shape
        .split_last()
        .map(|(l, r)| (*l, r.to_vec()))
        .unwrap_or((1, vec![]));
    let rows = leading.iter().product();
    (
        B::float_reshape(tensor, Shape::from(vec![rows, last])),
        leading,
    )
}

/// A float tensor's dimensions.
pub(crate) fn dims<B: Backend>(tensor: &FloatTensor<B>) -> Vec<usize> {
    use burn::tensor::TensorMetadata;
    tensor.shape().as_slice().to_vec()
}
