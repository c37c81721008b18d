//! A norm or activation and the GEMM that takes its output, fused where the GEMM runs in FP8 under DelayedScaling:
//! what `LayerNormLinear` and `LayerNormMLP` call ([`TeBackend::te_cast_linear`]).

use burn::prelude::*;
use burn::tensor::TensorPrimitive;

use super::{CastInput, NormOperands, NormSpec, Pointwise};
use crate::backend::TeBackend;
use crate::error::TeError;
use crate::fp8_state::site::GemmSite;
use crate::recipe::Recipe;

/// The op before a GEMM, on a module's tensors: a norm's γ, β and spec, or an activation.
pub(crate) enum InputOp<B: Backend> {
    /// A LayerNorm/RMSNorm.
    Norm(Tensor<B, 1>, Option<Tensor<B, 1>>, NormSpec),
    /// An MLP activation (gated or not).
    Activation(Pointwise, bool),
}

/// `op(x) · weight (+ bias)` at the fprop `site` as one op, or `None` where there is none: no recipe, the composed
/// or unfused ops asked for, or the backend (or the recipe, or a decorator that looks at the GEMM's input) has no
/// fused path. The caller then runs the op and the GEMM apart.
pub(crate) fn try_fused<B: TeBackend, const D: usize>(
    x: &Tensor<B, D>,
    op: InputOp<B>,
    (weight, bias): (Tensor<B, 2>, Option<Tensor<B, 1>>),
    site: &GemmSite,
    recipe: Option<&Recipe>,
) -> Result<Option<Tensor<B, D>>, TeError> {
    let Some(recipe) = recipe else {
        return Ok(None);
    };
    if !super::fused_allowed() || !super::input_cast_fusion_allowed() {
        return Ok(None);
    }
    let x = x.clone().into_primitive().tensor();
    let input = match op {
        InputOp::Norm(gamma, beta, spec) => CastInput::Norm(NormOperands {
            x,
            gamma: gamma.into_primitive().tensor(),
            beta: beta.map(|beta| beta.into_primitive().tensor()),
            spec,
        }),
        InputOp::Activation(f, gated) => CastInput::Activation { x, f, gated },
    };
    let weight = weight.into_primitive().tensor();
    let bias = bias.map(|bias| bias.into_primitive().tensor());
    let y = B::te_cast_linear(input, weight, bias, site, recipe)?;
    Ok(y.map(|y| Tensor::from_primitive(TensorPrimitive::Float(y))))
}
