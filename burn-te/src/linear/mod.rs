//! The layer GEMMs of a backend that runs them itself (CubeCL, the host path, Burn's fusion): fprop, dgrad and
//! wgrad in FP8 under a recipe ([`crate::gemm::fp8`]), in high precision without one, and in high precision again
//! when the FP8 GEMM fails (counted as a fallback). Decorators forward to their inner backend's instead. Both
//! backward GEMMs on one quantized gradient: [`backward`]. A grouped linear layer's experts: [`grouped`]. A norm or
//! activation and the fprop GEMM after it, the op writing the GEMM's FP8 input: [`cast_input`].

pub mod backward;
pub mod cast_input;
pub mod grouped;

use burn::tensor::ops::FloatTensor;

use crate::backend::{SavedOperand, TeBackend};
use crate::error::TeError;
use crate::fp8_state::site::GemmSite;
use crate::gemm::Gemm;
use crate::gemm::fp8::{
    linear_dgrad, linear_fprop, linear_wgrad, or_high_precision, or_high_precision_saving,
};
use crate::gemm::high_precision::high_precision_gemm;
use crate::gemm::saved::{or_panic, values};
use crate::primitive::SavedForBackward;
use crate::recipe::Recipe;

/// `TeBackend::te_linear_fprop`: `x · weight + bias`, keeping the operands asked for in `save` quantized for the
/// backward.
pub fn fprop<B: TeBackend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    site: &GemmSite,
    recipe: Option<&Recipe>,
    save: [bool; 2],
) -> (FloatTensor<B>, SavedForBackward<B::Fp8Data>) {
    let high_precision =
        |x, weight, bias| high_precision_gemm::<B>(Gemm::Fprop, site.batched, x, weight, bias);
    match recipe {
        None => {
            count_high_precision(site);
            (high_precision(x, weight, bias), [None, None])
        }
        Some(recipe) => {
            let fp8 = linear_fprop::<B>(
                x.clone(),
                weight.clone(),
                bias.clone(),
                site,
                recipe,
                [None, None],
                save,
            )
            .inspect(|_| count_recipe(site, recipe));
            or_high_precision_saving::<B>(site, fp8, || high_precision(x, weight, bias))
        }
    }
}

/// `TeBackend::te_linear_dgrad`: `grad · weightᵀ` on the weight the forward kept.
pub fn dgrad<B: TeBackend>(
    weight: SavedOperand<B>,
    grad: FloatTensor<B>,
    site: &GemmSite,
    recipe: Option<&Recipe>,
) -> FloatTensor<B> {
    backward_gemm::<B>(Gemm::Dgrad, weight, grad, site, recipe)
}

/// `TeBackend::te_linear_wgrad`: `xᵀ · grad` on the input the forward kept.
pub fn wgrad<B: TeBackend>(
    x: SavedOperand<B>,
    grad: FloatTensor<B>,
    site: &GemmSite,
    recipe: Option<&Recipe>,
) -> FloatTensor<B> {
    backward_gemm::<B>(Gemm::Wgrad, x, grad, site, recipe)
}

/// The backward GEMM `gemm` on the operand the forward kept (dgrad: the weight; wgrad: the input) and the gradient.
fn backward_gemm<B: TeBackend>(
    gemm: Gemm,
    kept: SavedOperand<B>,
    grad: FloatTensor<B>,
    site: &GemmSite,
    recipe: Option<&Recipe>,
) -> FloatTensor<B> {
    match recipe {
        None => {
            count_high_precision(site);
            backward_in_high_precision::<B>(gemm, kept, grad, site)
        }
        Some(recipe) => {
            let fp8 = match gemm {
                Gemm::Dgrad => linear_dgrad::<B>,
                _ => linear_wgrad::<B>,
            }(kept.clone(), grad.clone(), site, recipe, [None, None]);
            fp8_backward_or_high_precision::<B>(gemm, kept, grad, site, recipe, fp8)
        }
    }
}

/// An FP8 backward GEMM's result, counted by its recipe, or on an error the fallback in high precision (recorded).
fn fp8_backward_or_high_precision<B: TeBackend>(
    gemm: Gemm,
    kept: SavedOperand<B>,
    grad: FloatTensor<B>,
    site: &GemmSite,
    recipe: &Recipe,
    fp8: Result<FloatTensor<B>, TeError>,
) -> FloatTensor<B> {
    let fp8 = fp8.inspect(|_| count_recipe(site, recipe));
    or_high_precision::<B>(site, fp8, || {
        backward_in_high_precision::<B>(gemm, kept, grad, site)
    })
}

/// The backward GEMM `gemm` in high precision on the kept operand's values.
fn backward_in_high_precision<B: TeBackend>(
    gemm: Gemm,
    kept: SavedOperand<B>,
    grad: FloatTensor<B>,
    site: &GemmSite,
) -> FloatTensor<B> {
    let product =
        values::<B>(kept).map(|kept| high_precision_backward::<B>(gemm, site.batched, kept, grad));
    or_panic::<B>(site, product)
}

/// A backward GEMM in high precision on the kept operand's values and the gradient (dgrad: `grad · keptᵀ`;
/// wgrad: `keptᵀ · grad`).
fn high_precision_backward<B: TeBackend>(
    gemm: Gemm,
    batched: bool,
    kept: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    match gemm {
        Gemm::Dgrad => high_precision_gemm::<B>(gemm, batched, grad, kept, None),
        _ => high_precision_gemm::<B>(gemm, batched, kept, grad, None),
    }
}

/// Counts a layer GEMM run in high precision by choice (no recipe).
fn count_high_precision(site: &GemmSite) {
    crate::metrics::increment_counter(crate::metrics::names::GEMM_HIGH_PRECISION, 1);
    count_planned(site, crate::plan::HIGH_PRECISION);
}

/// Counts a layer GEMM run in FP8 by its recipe (`GemmRecipe(nvfp4)`), and under a plan by its site too.
fn count_recipe(site: &GemmSite, recipe: &Recipe) {
    use crate::metrics::{increment_counter, names};
    increment_counter(&format!("{}({})", names::GEMM_RECIPE, recipe.name()), 1);
    count_planned(site, recipe.name());
}

/// Under a plan, counts which recipe ran where: `GemmRecipe(layers.0.fc1.fprop=nvfp4)`.
fn count_planned(site: &GemmSite, recipe: &str) {
    use crate::metrics::{increment_counter, names};
    if site.recipes.is_some() {
        increment_counter(&format!("{}({site}={recipe})", names::GEMM_RECIPE), 1);
    }
}

/// The `TeBackend` methods `te_linear_fprop`, `te_linear_dgrad` and `te_linear_wgrad` (those named) of a backend
/// that runs its layer GEMMs itself, by the functions of [`linear`](crate::linear): inside `impl TeBackend for ..`,
/// `burn_te::te_linear_gemms!(fprop dgrad wgrad backward grouped);`. `backward` gives `te_linear_backward`, which
/// quantizes the gradient once for both backward GEMMs where it can ([`backward`](crate::linear::backward)).
/// `grouped` gives the grouped linear layer's four (`te_grouped_linear_*`) with the experts' GEMMs issued together
/// and each expert's gradient quantized once for both backward GEMMs where it can ([`grouped`]); `grouped_in_turn`
/// runs each expert's layer GEMM in turn through the backend's own `te_linear_*` (for a decorator that looks at
/// each). `cast` gives `te_cast_linear_fprop`, a norm or activation and the fprop GEMM after it as one op
/// ([`cast_input`]).
#[macro_export]
macro_rules! te_linear_gemms {
    ($($gemm:ident)*) => { $($crate::te_linear_gemms!(@$gemm);)* };
    (@fprop) => {
        fn te_linear_fprop(
            x: $crate::__private::FloatTensor<Self>,
            weight: $crate::__private::FloatTensor<Self>,
            bias: Option<$crate::__private::FloatTensor<Self>>,
            site: &$crate::GemmSite,
            recipe: Option<&$crate::Recipe>,
            save: [bool; 2],
        ) -> ($crate::__private::FloatTensor<Self>, $crate::gemm::fp8::SavedForBackward<Self::Fp8Data>) {
            $crate::linear::fprop::<Self>(x, weight, bias, site, recipe, save)
        }
    };
    (@cast) => {
        fn te_cast_linear_fprop(
            input: $crate::fused::CastInput<$crate::__private::FloatTensor<Self>>,
            weight: $crate::__private::FloatTensor<Self>,
            bias: Option<$crate::__private::FloatTensor<Self>>,
            site: &$crate::GemmSite,
            recipe: &$crate::Recipe,
            save: [bool; 2],
        ) -> Result<
            $crate::fused::CastLinearFprop<$crate::__private::FloatTensor<Self>, Self::Fp8Data>,
            $crate::TeError,
        > {
            $crate::linear::cast_input::fprop::<Self>(input, weight, bias, site, recipe, save)
        }
    };
    (@dgrad) => {
        fn te_linear_dgrad(
            weight: $crate::SavedOperand<Self>,
            grad: $crate::__private::FloatTensor<Self>,
            site: &$crate::GemmSite,
            recipe: Option<&$crate::Recipe>,
        ) -> $crate::__private::FloatTensor<Self> {
            $crate::linear::dgrad::<Self>(weight, grad, site, recipe)
        }
    };
    (@grouped) => {
        $crate::te_linear_gemms!(@grouped_by grouped);
        fn te_grouped_linear_backward(
            weights: Option<Vec<Option<$crate::SavedOperand<Self>>>>,
            xs: Vec<Option<$crate::SavedOperand<Self>>>,
            grad: $crate::__private::FloatTensor<Self>,
            experts: [&$crate::fp8_state::site::ExpertGemms; 2],
        ) -> $crate::backend::GroupedGradients<Self> {
            $crate::linear::grouped::backward::<Self>(weights, xs, grad, experts)
        }
    };
    (@grouped_in_turn) => { $crate::te_linear_gemms!(@grouped_by grouped::in_turn); };
    (@grouped_by $($functions:ident)::+) => {
        fn te_grouped_linear_fprop(
            x: $crate::__private::FloatTensor<Self>,
            weights: Vec<$crate::__private::FloatTensor<Self>>,
            biases: Vec<Option<$crate::__private::FloatTensor<Self>>>,
            experts: &$crate::fp8_state::site::ExpertGemms,
            save: &[[bool; 2]],
        ) -> ($crate::__private::FloatTensor<Self>, Vec<$crate::gemm::fp8::SavedForBackward<Self::Fp8Data>>) {
            $crate::linear::$($functions)::+::fprop::<Self>(x, weights, biases, experts, save)
        }
        fn te_grouped_linear_dgrad(
            weights: Vec<Option<$crate::SavedOperand<Self>>>,
            grad: $crate::__private::FloatTensor<Self>,
            experts: &$crate::fp8_state::site::ExpertGemms,
        ) -> $crate::__private::FloatTensor<Self> {
            $crate::linear::$($functions)::+::dgrad::<Self>(weights, grad, experts)
        }
        fn te_grouped_linear_wgrad(
            xs: Vec<Option<$crate::SavedOperand<Self>>>,
            grad: $crate::__private::FloatTensor<Self>,
            experts: &$crate::fp8_state::site::ExpertGemms,
        ) -> Vec<Option<$crate::__private::FloatTensor<Self>>> {
            $crate::linear::$($functions)::+::wgrad::<Self>(xs, grad, experts)
        }
    };
    (@backward) => {
        fn te_linear_backward(
            weight: Option<$crate::SavedOperand<Self>>,
            x: Option<$crate::SavedOperand<Self>>,
            grad: $crate::__private::FloatTensor<Self>,
            sites: [&$crate::GemmSite; 2],
            recipes: [Option<&$crate::Recipe>; 2],
        ) -> [Option<$crate::__private::FloatTensor<Self>>; 2] {
            $crate::linear::backward::backward::<Self>(weight, x, grad, sites, recipes)
        }
    };
    (@wgrad) => {
        fn te_linear_wgrad(
            x: $crate::SavedOperand<Self>,
            grad: $crate::__private::FloatTensor<Self>,
            site: &$crate::GemmSite,
            recipe: Option<&$crate::Recipe>,
        ) -> $crate::__private::FloatTensor<Self> {
            $crate::linear::wgrad::<Self>(x, grad, site, recipe)
        }
    };
}
