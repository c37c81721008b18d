//! A linear layer's two backward GEMMs on one output gradient, quantized once where one quantization serves both.
//! TE quantizes `grad_output` once for dgrad and wgrad (both layouts in one cast-transpose). Under a per-tensor
//! recipe (DelayedScaling, Float8CurrentScaling) both layouts hold the same codes with one scale, and the GEMMs
//! read either layout of one copy, so the gradient is quantized once and its amax recorded once. The results are
//! the bits of quantizing it for each GEMM: the same tensor, rule and scale.
//!
//! Each GEMM quantizes the gradient itself ([`linear_backward_in_turn`]) under the other recipes (their blocks run along each
//! GEMM's reduction; NVFP4 transforms wgrad's operands), where a plan gives the two GEMMs different recipes, for an
//! attention GEMM, and where the diagnostics or the debug tools look at each GEMM by itself.

use burn::tensor::TensorMetadata;
use burn::tensor::ops::FloatTensor;

use crate::backend::{SavedOperand, TeBackend, linear_backward_in_turn};
use crate::diagnostics::gemm_span;
use crate::fp8_gemm::{
    PreparedGemm, check_dgrad, check_wgrad, prepare_dgrad_quantized, prepare_wgrad_quantized,
    quantize_gradient,
};
use crate::gemm::Gemm;
use crate::recipe::Recipe;
use crate::site::GemmSite;

/// `TeBackend::te_linear_backward` of a backend that runs its GEMMs: `[dgrad, wgrad]` (dgrad where `weight` is
/// given, wgrad where `x` is) on one quantization of `grad` where [`shares_gradient`], each GEMM under its trace
/// span; else [`linear_backward_in_turn`].
pub fn backward<B: TeBackend>(
    weight: Option<SavedOperand<B>>,
    x: Option<SavedOperand<B>>,
    grad: FloatTensor<B>,
    sites: [&GemmSite; 2],
    recipes: [Option<&Recipe>; 2],
) -> [Option<FloatTensor<B>>; 2] {
    if let (Some(weight), Some(x), true) = (&weight, &x, shares_gradient(sites, recipes)) {
        let recipe = recipes[0].expect("a shared recipe");
        if let Some(both) = quantized_once::<B>(weight, x, &grad, sites, recipe) {
            return both;
        }
    }
    linear_backward_in_turn::<B>(weight, x, grad, sites, recipes)
}

/// Whether dgrad and wgrad at `sites` take one quantization of the gradient: the same per-tensor recipe, a layer
/// (not an attention) GEMM.
pub fn shares_gradient(sites: [&GemmSite; 2], recipes: [Option<&Recipe>; 2]) -> bool {
    match recipes {
        [Some(dgrad), Some(wgrad)] => {
            dgrad == wgrad
                && matches!(dgrad, Recipe::Delayed(_) | Recipe::Current(_))
                && !sites[0].batched
                && !sites[1].batched
        }
        _ => false,
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
    let quantized = gemm_span(dgrad_site)
        .in_scope(|| quantize_gradient::<B>(grad.clone(), recipe, dgrad_site, Gemm::Dgrad, None))
        .ok()?;
    let dgrad = gemm_span(dgrad_site).in_scope(|| {
        let fp8 = prepare_dgrad_quantized::<B>(
            weight.clone(),
            quantized.clone(),
            dgrad_site,
            recipe,
            None,
        )
        .and_then(PreparedGemm::run);
        let (weight, grad) = (weight.clone(), grad.clone());
        super::fp8_backward_or_high_precision::<B>(
            Gemm::Dgrad,
            weight,
            grad,
            dgrad_site,
            recipe,
            fp8,
        )
    });
    let wgrad = gemm_span(wgrad_site).in_scope(|| {
        let fp8 = prepare_wgrad_quantized::<B>(x.clone(), quantized, wgrad_site, recipe, None)
            .and_then(PreparedGemm::run);
        let (x, grad) = (x.clone(), grad.clone());
        super::fp8_backward_or_high_precision::<B>(Gemm::Wgrad, x, grad, wgrad_site, recipe, fp8)
    });
    Some([Some(dgrad), Some(wgrad)])
}
