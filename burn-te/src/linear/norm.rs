//! A norm and the fprop GEMM that takes its output, as one op: the norm's output quantized by the norm's own pass
//! under DelayedScaling ([`TeBackend::te_norm_fp8_forward`]), then the GEMM on those codes as
//! [`linear_fprop`](crate::fp8_gemm::linear_fprop) runs it (TE's `LayerNormLinear` with its LayerNorm writing
//! FP8). The normalized input is never written in high precision: the codes are what the GEMM reads and what
//! wgrad keeps.

use burn::tensor::Shape;
use burn::tensor::ops::FloatTensor;

use crate::backend::TeBackend;
use crate::error::TeError;
use crate::fp8_gemm::{
    QuantizedOperand, dims, fold_rows, fprop_quantization_serves_backward, prepare_fprop_quantized,
    with_delayed_state,
};
use crate::fused::{NormLinearForward, NormLinearFprop, NormOperands};
use crate::gemm::TensorRole;
use crate::metrics::{count_launch, names};
use crate::primitive::SavedQuantized;
use crate::recipe::Recipe;
use crate::site::GemmSite;

/// [`TeBackend::te_norm_linear_fprop`] of a backend that runs its GEMMs: `None` under any recipe but
/// DelayedScaling, for a batched site, where the shapes do not chain (the separate ops then name the error) and
/// where the backend has no [`te_norm_fp8_forward`](TeBackend::te_norm_fp8_forward).
pub fn fprop<B: TeBackend>(
    norm: NormOperands<FloatTensor<B>>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    site: &GemmSite,
    recipe: &Recipe,
    save: [bool; 2],
) -> Result<NormLinearFprop<FloatTensor<B>, B::Fp8Data>, TeError> {
    let Recipe::Delayed(delayed) = recipe else {
        return Ok(None);
    };
    let (x_dims, w_dims) = (dims::<B>(&norm.x), dims::<B>(&weight));
    if site.batched || w_dims.len() != 2 || x_dims.last() != w_dims.first() {
        return Ok(None);
    }
    let (x, leading) = fold_rows::<B>(norm.x);
    let rows = Shape::from(dims::<B>(&x));
    let device = B::float_device(&x);
    let role = TensorRole::Activation;
    let format = recipe.format().for_role(role);
    let norm = NormOperands { x, ..norm };
    // Marked recorded also when the backend answers `None`: the separate ops that follow record the same role.
    let quantized = with_delayed_state::<B, _>(site, delayed, role, &device, true, |state| {
        B::te_norm_fp8_forward(norm, format, state)
    })?;
    let Some((codes, stats)) = quantized else {
        return Ok(None);
    };
    count_launch(names::FUSED_NORM_CAST);
    // One scale per tensor: the fprop's codes are wgrad's operand too (TE keeps the same FP8 input).
    debug_assert!(fprop_quantization_serves_backward(recipe, role));
    let saved_x = save[0].then(|| SavedQuantized {
        tensor: codes.clone(),
        transposed: false,
        shape: rows,
    });
    let x = (QuantizedOperand::stored(codes), saved_x, leading);
    let (gemm, saved) = prepare_fprop_quantized::<B>(x, weight, bias, site, recipe, None, save[1])?;
    Ok(Some(NormLinearForward {
        output: gemm.run()?,
        norm: stats,
        saved,
    }))
}
