//! A linear layer's two backward GEMMs on one output gradient, quantized once for both. TE quantizes
//! `grad_output` once for dgrad and wgrad (both layouts in one cast-transpose). Under a per-tensor recipe
//! (DelayedScaling, Float8CurrentScaling) both layouts hold the same codes with one scale, and the GEMMs read either
//! layout of one copy, so the gradient is quantized once and its amax recorded once. Under a block recipe
//! (Float8BlockScaling, MXFP8) its blocks run along each GEMM's reduction, so both layouts are made in one pass
//! ([`TeBackend::fp8_quantize_block_pair`]). The results are the bits of quantizing it for each GEMM: the same
//! tensor, rule and scales.
//!
//! Each GEMM quantizes the gradient itself ([`linear_backward_in_turn`]) under NVFP4 (it transforms wgrad's
//! operands), where a plan gives the two GEMMs different recipes, for an attention GEMM, and where the diagnostics
//! or the debug tools look at each GEMM by itself.

use burn::tensor::TensorMetadata;
use burn::tensor::ops::FloatTensor;

use crate::backend::{SavedOperand, TeBackend, linear_backward_in_turn};
use crate::diagnostics::gemm_span;
use crate::fp8_state::site::GemmSite;
use crate::gemm::Gemm;
use crate::gemm::fp8::{
    PreparedGemm, check_dgrad, check_wgrad, prepare_dgrad_quantized, prepare_wgrad_quantized,
    quantize_gradient_for_both,
};
use crate::recipe::Recipe;

use super::fp8_backward_or_high_precision;

/// `TeBackend::te_linear_backward` of a backend that runs its GEMMs: `[dgrad, wgrad]` (dgrad where `weight` is
/// given, wgrad where `x` is) on one quantization of `grad` where both run under a [`shared_recipe`], each GEMM
/// under its trace span; else [`linear_backward_in_turn`].
pub fn backward<B: TeBackend>(
    weight: Option<SavedOperand<B>>,
    x: Option<SavedOperand<B>>,
    grad: FloatTensor<B>,
    sites: [&GemmSite; 2],
    recipes: [Option<&Recipe>; 2],
) -> [Option<FloatTensor<B>>; 2] {
    if let (Some(weight), Some(x), Some(recipe)) = (&weight, &x, shared_recipe(sites, recipes))
        && let Some(both) = quantized_once::<B>(weight, x, &grad, sites, recipe)
    {
        return both;
    }
    linear_backward_in_turn::<B>(weight, x, grad, sites, recipes)
}

/// The recipe under which dgrad and wgrad at `sites` take one quantization of the gradient: the same recipe for
/// both, per tensor or in blocks (not NVFP4), at a layer (not an attention) GEMM.
pub fn shared_recipe<'a>(
    sites: [&GemmSite; 2],
    recipes: [Option<&'a Recipe>; 2],
) -> Option<&'a Recipe> {
    match recipes {
        [Some(dgrad), Some(wgrad)]
            if dgrad == wgrad
                && !matches!(dgrad, Recipe::Nvfp4(_))
                && !sites[0].batched
                && !sites[1].batched =>
        {
            Some(dgrad)
        }
        _ => None,
    }
}

/// Both GEMMs on one quantization of the gradient; `None` where its shapes do not fit or it cannot be quantized
/// (each GEMM then quantizes it itself, and records the error where the user looks).
fn quantized_once<B: TeBackend>(
    weight: &SavedOperand<B>,
    x: &SavedOperand<B>,
    grad: &FloatTensor<B>,
    sites: [&GemmSite; 2],
    recipe: &Recipe,
) -> Option<[Option<FloatTensor<B>>; 2]> {
    let g_dims = grad.shape().as_slice().to_vec();
    check_dgrad::<B>(weight, &g_dims).ok()?;
    check_wgrad::<B>(x, &g_dims).ok()?;
    let [dgrad_site, wgrad_site] = sites;
    // The gradient is quantized inside dgrad's span, as dgrad quantizes it when each GEMM runs by itself.
    let dgrad_span = gemm_span(dgrad_site);
    let entered = dgrad_span.enter();
    let [for_dgrad, for_wgrad] =
        quantize_gradient_for_both::<B>(grad.clone(), recipe, dgrad_site).ok()?;
    let fp8 = prepare_dgrad_quantized::<B>(weight.clone(), for_dgrad, dgrad_site, recipe, None)
        .and_then(PreparedGemm::run);
    let (kept, g) = (weight.clone(), grad.clone());
    let dgrad = fp8_backward_or_high_precision::<B>(Gemm::Dgrad, kept, g, dgrad_site, recipe, fp8);
    drop(entered);
    let wgrad = gemm_span(wgrad_site).in_scope(|| {
        let fp8 = prepare_wgrad_quantized::<B>(x.clone(), for_wgrad, wgrad_site, recipe, None)
            .and_then(PreparedGemm::run);
        let (kept, g) = (x.clone(), grad.clone());
        fp8_backward_or_high_precision::<B>(Gemm::Wgrad, kept, g, wgrad_site, recipe, fp8)
    });
    Some([Some(dgrad), Some(wgrad)])
}
