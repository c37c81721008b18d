//! `Linear`: `y = x·W + b` with its three GEMMs in FP8 inside an autocast scope (TE's `te.Linear`).

use burn::module::{Initializer, Param};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;

use super::names::LayerName;
use super::{ModuleOutput, check_features, or_panic};
use crate::autocast::{ScopeRecipe, active_scope_recipe, layer_recipes};
use crate::backend::TeBackend;
use crate::error::TeError;
use crate::fp8_state::Fp8Meta;
use crate::gemm::Gemm;
use crate::recipe::Recipe;
use crate::site::GemmSite;

/// Config of [`Linear`].
#[derive(Config, Debug)]
pub struct LinearConfig {
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
    /// Learn an additive bias.
    #[config(default = true)]
    pub bias: bool,
    /// Return the bias beside the output instead of adding it ([`Linear::forward_all`]), for the caller to fuse.
    #[config(default = false)]
    pub return_bias: bool,
    /// The layer's name (see [`names`](super::names)).
    #[config(default = "None")]
    pub name: Option<String>,
    /// Weight initializer; TE's default is a normal distribution with std 0.023. Biases start at zero.
    #[config(default = "Initializer::Normal { mean: 0.0, std: 0.023 }")]
    pub initializer: Initializer,
}

/// A linear layer whose GEMMs (fprop, dgrad, wgrad) run in FP8 inside an autocast scope.
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// `[in_features, out_features]` (Burn's layout: `y = x·W`).
    pub weight: Param<Tensor<B, 2>>,
    /// `[out_features]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    return_bias: bool,
    /// The delayed-scaling state of the layer's GEMMs (amax histories and scales), saved with the record.
    pub fp8_meta: Fp8Meta<B>,
    #[module(skip)]
    name: LayerName,
}

impl LinearConfig {
    /// A linear layer on `device`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Linear<B> {
        self.init_named(LayerName::root(self.name.as_deref(), "linear"), device)
    }

    pub(crate) fn init_named<B: Backend>(&self, name: LayerName, device: &B::Device) -> Linear<B> {
        let (weight, bias) = gemm_params(
            &self.initializer,
            self.in_features,
            self.out_features,
            self.bias,
            device,
        );
        Linear {
            weight,
            bias,
            return_bias: self.return_bias,
            fp8_meta: Fp8Meta::new(),
            name,
        }
    }
}

/// A Burn linear layer as a TE one, with the same parameters (both keep the weight as `[in, out]`; the parameter
/// ids, and so an optimizer's state, carry over): a model built from `burn::nn::Linear` moves to TE's layer, whose
/// FP8 backward keeps the forward's FP8 input where Burn's linear node keeps the f32 one. Not named, no bias
/// returned apart, a fresh delayed-scaling state.
impl<B: Backend> From<burn::nn::Linear<B>> for Linear<B> {
    fn from(linear: burn::nn::Linear<B>) -> Self {
        Linear {
            weight: linear.weight,
            bias: linear.bias,
            return_bias: false,
            fp8_meta: Fp8Meta::new(),
            name: LayerName::root(None, "linear"),
        }
    }
}

/// A GEMM layer's parameters: weight `[in, out]` from `initializer`, zero bias `[out]` if `bias`.
pub(crate) fn gemm_params<B: Backend>(
    initializer: &Initializer,
    in_features: usize,
    out_features: usize,
    bias: bool,
    device: &B::Device,
) -> (Param<Tensor<B, 2>>, Option<Param<Tensor<B, 1>>>) {
    let weight = initializer.init_with(
        [in_features, out_features],
        Some(in_features),
        Some(out_features),
        device,
    );
    let bias = bias.then(|| Initializer::Zeros.init([out_features], device));
    (weight, bias)
}

/// `x [.., in] · weight [in, out] (+ bias)` through [`TeBackend::te_linear`] at the fprop site of `name`: FP8 with
/// the autocast scope's recipe (or its plan's choice for the layer) and the layer's `fp8_meta`, high precision
/// outside one. The forwarding code of every TE GEMM module.
pub(crate) fn te_gemm<B: TeBackend, const D: usize>(
    x: Tensor<B, D>,
    weight: &Param<Tensor<B, 2>>,
    bias: Option<Tensor<B, 1>>,
    name: &LayerName,
    fp8_meta: &Fp8Meta<B>,
    kind: &'static str,
) -> Result<Tensor<B, D>, TeError> {
    let [in_features, _] = weight.dims();
    let layer = name.resolve(weight);
    check_features(&layer, "input", &x, in_features)?;
    let (site, recipe) = fprop_site(layer, kind, fp8_meta)?;
    Ok(run_gemm(x, weight.val(), bias, &site, recipe.as_ref()))
}

/// An attention GEMM, `a [.., M, K] · b [.., K, N]` per batch, in FP8 through [`TeBackend::te_linear`] at the
/// batched fprop site `layer` (see [`GemmSite::batched`]), `fp8_meta` keeping its operands' scales (`a` as the
/// activation, `b` as the weight, and the gradient); `None` where the scope (or its plan, for this site) gives no
/// recipe with TE's `fp8_dpa`/`fp8_mha`: the attention then stays in high precision, as TE's does.
pub(crate) fn te_bmm<B: TeBackend, const D: usize>(
    a: Tensor<B, D>,
    b: Tensor<B, D>,
    layer: &str,
    fp8_meta: &Fp8Meta<B>,
    kind: &'static str,
) -> Result<Option<Tensor<B, D>>, TeError> {
    match active_scope_recipe() {
        None => return Ok(None),
        Some(ScopeRecipe::Recipe(recipe)) if !recipe.fp8_attention() => return Ok(None),
        Some(_) => {}
    }
    let (site, recipe) = fprop_site(layer.into(), kind, fp8_meta)?;
    Ok(recipe
        .filter(Recipe::fp8_attention)
        .map(|recipe| run_gemm(a, b, None, &site.batched(), Some(&recipe))))
}

/// The fprop site of `layer` with its state and the recipes the scope (or its plan) gives it.
pub(super) fn fprop_site<B: TeBackend>(
    layer: std::sync::Arc<str>,
    kind: &'static str,
    fp8_meta: &Fp8Meta<B>,
) -> Result<(GemmSite, Option<Recipe>), TeError> {
    let scope = active_scope_recipe();
    let (recipe, planned) = layer_recipes(scope.as_ref(), &layer, Some(kind), fp8_meta)?;
    let site = GemmSite::new(layer, Gemm::Fprop)
        .of_kind(kind)
        .with_state(fp8_meta)
        .with_recipes(planned);
    Ok((site, recipe))
}

fn run_gemm<B: TeBackend, const D: usize, const W: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, W>,
    bias: Option<Tensor<B, 1>>,
    site: &GemmSite,
    recipe: Option<&Recipe>,
) -> Tensor<B, D> {
    let out = B::te_linear(
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        bias.map(|b| b.into_primitive().tensor()),
        site,
        recipe,
    );
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// Splits a layer's bias into (added in the GEMM, returned beside the output) by `return_bias`.
pub(crate) fn split_bias<B: Backend>(
    bias: &Option<Param<Tensor<B, 1>>>,
    return_bias: bool,
) -> (Option<Tensor<B, 1>>, Option<Tensor<B, 1>>) {
    let bias = bias.as_ref().map(Param::val);
    if return_bias {
        (None, bias)
    } else {
        (bias, None)
    }
}

impl<B: TeBackend> Linear<B> {
    /// `y = x·W (+ b)` for `x [.., in_features]`; with `return_bias` the bias is left out (see
    /// [`forward_all`](Self::forward_all)). Panics with [`try_forward`](Self::try_forward)'s error.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        or_panic(self.try_forward(x))
    }

    /// [`forward`](Self::forward), or an error naming the layer and the shape when `x`'s last dimension is not
    /// `in_features`.
    pub fn try_forward<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, TeError> {
        Ok(self.forward_all(x)?.output)
    }

    /// The output, and with `return_bias` the bias not added to it.
    pub fn forward_all<const D: usize>(
        &self,
        x: Tensor<B, D>,
    ) -> Result<ModuleOutput<B, D>, TeError> {
        let (added, returned) = split_bias(&self.bias, self.return_bias);
        Ok(ModuleOutput {
            output: te_gemm(x, &self.weight, added, &self.name, &self.fp8_meta, "linear")?,
            bias: returned,
            layernorm_output: None,
        })
    }

    /// The layer's name (see [`names`](super::names)).
    pub fn name(&self) -> String {
        self.name.resolve(&self.weight).to_string()
    }
}
