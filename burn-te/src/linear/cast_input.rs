//! A norm or activation and the fprop GEMM that takes its output, as one op: the op's output quantized by the op's
//! own pass under DelayedScaling ([`TeBackend::te_cast_input_forward`]), then the GEMM on those codes as
//! [`linear_fprop`](crate::gemm::fp8::linear_fprop) runs it (TE's `LayerNormLinear` with its LayerNorm writing FP8,
//! `LayerNormMLP`'s GELU writing FC2's FP8 input). The op's output is never written in high precision: the codes
//! are what the GEMM reads and what wgrad keeps.

use burn::tensor::Shape;
use burn::tensor::ops::FloatTensor;

use crate::backend::TeBackend;
use crate::error::TeError;
use crate::fp8_state::site::GemmSite;
use crate::fused::{CastInput, CastLinearForward, CastLinearFprop};
use crate::gemm::TensorRole;
use crate::gemm::fp8::{
    QuantizedOperand, fold_rows, fprop_quantization_serves_backward, prepare_fprop_quantized,
    with_delayed_state,
};
use crate::gemm::high_precision::dims;
use crate::metrics::{count_launch, names};
use crate::primitive::SavedQuantized;
use crate::recipe::Recipe;

/// [`TeBackend::te_cast_linear_fprop`] of a backend that runs its GEMMs: `None` under any recipe but
/// DelayedScaling, for a batched site, where the shapes do not chain (the ops apart then name the error) and where
/// the backend has no [`te_cast_input_forward`](TeBackend::te_cast_input_forward).
pub fn fprop<B: TeBackend>(
    input: CastInput<FloatTensor<B>>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    site: &GemmSite,
    recipe: &Recipe,
    save: [bool; 2],
) -> Result<CastLinearFprop<FloatTensor<B>, B::Fp8Data>, TeError> {
    let Recipe::Delayed(delayed) = recipe else {
        return Ok(None);
    };
    let (mut out_dims, w_dims) = (dims::<B>(input.x()), dims::<B>(&weight));
    let gated = matches!(input, CastInput::Activation { gated: true, .. });
    if let (true, Some(width)) = (gated, out_dims.last_mut()) {
        if !width.is_multiple_of(2) {
            return Ok(None);
        }
        *width /= 2;
    }
    if site.batched || w_dims.len() != 2 || out_dims.last() != w_dims.first() {
        return Ok(None);
    }
    // The op's input folded to rows as its output is: the same leading dimensions.
    let leading = out_dims[..out_dims.len() - 1].to_vec();
    let shape = Shape::new([leading.iter().product(), w_dims[0]]);
    let input = input.map_x(|x| fold_rows::<B>(x).0);
    let device = B::float_device(input.x());
    let role = TensorRole::Activation;
    let format = recipe.format().for_role(role);
    let counter = match input {
        CastInput::Norm(_) => names::FUSED_NORM_CAST,
        CastInput::Activation { .. } => names::FUSED_ACTIVATION_CAST,
    };
    // Marked recorded also when the backend answers `None`: the ops apart that follow record the same role.
    let quantized = with_delayed_state::<B, _>(site, delayed, role, &device, true, |state| {
        B::te_cast_input_forward(input, format, state)
    })?;
    let Some((codes, input_saved)) = quantized else {
        return Ok(None);
    };
    count_launch(counter);
    // One scale per tensor: the fprop's codes are wgrad's operand too (TE keeps the same FP8 input).
    debug_assert!(fprop_quantization_serves_backward(recipe, role));
    let saved_x = save[0].then(|| SavedQuantized {
        tensor: codes.clone(),
        transposed: false,
        shape,
    });
    let x = (QuantizedOperand::stored(codes), saved_x, leading);
    let (gemm, saved) = prepare_fprop_quantized::<B>(x, weight, bias, site, recipe, None, save[1])?;
    Ok(Some(CastLinearForward {
        output: gemm.run()?,
        input: input_saved,
        saved,
    }))
}
