//! `Linear`: `y = x·W + b` with its three GEMMs in FP8 inside an autocast scope (TE's `te.Linear`).

use burn::module::{Initializer, Param};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;

use super::activation::Activation;
use super::names::LayerName;
use super::norm::{Norm, rename};
use super::parallel::{ParallelMode, TensorParallel};
use super::{ModuleOutput, check_features, or_panic};
use crate::backend::TeBackend;
use crate::error::TeError;
use crate::fp8_state::Fp8Meta;
use crate::fp8_state::autocast::{ScopeRecipe, active_scope_recipe, layer_recipes};
use crate::fp8_state::site::{GemmSite, Sharding};
use crate::fused;
use crate::fused::cast_linear::InputOp;
use crate::gemm::Gemm;
use crate::recipe::Recipe;

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
    /// Split the layer over a tensor-parallel group: `column` (outputs) or `row` (inputs); `None`: whole
    /// (see [`parallel`](super::parallel)).
    #[config(default = "None")]
    pub parallel_mode: Option<ParallelMode>,
    /// Ranks in the tensor-parallel group: consecutive ranks of the peer bound to this thread.
    #[config(default = 1)]
    pub tp_size: usize,
    /// Sequence parallelism: a column layer's input arrives as token shards (gathered before the GEMM), a row
    /// layer's output leaves as token shards (reduce-scattered).
    #[config(default = false)]
    pub sequence_parallel: bool,
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
    /// The layer's tensor-parallel split (`None`: whole).
    #[module(skip)]
    parallel: Option<TensorParallel>,
}

impl LinearConfig {
    /// A linear layer on `device`. Panics with [`try_init`](Self::try_init)'s error.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Linear<B> {
        or_panic(self.try_init(device))
    }

    /// A linear layer on `device`; split over the tensor-parallel group, this rank's shard of the whole layer's
    /// parameters (drawn whole, then split: the same seed gives the same whole layer whatever `tp_size`). An error
    /// when the split does not divide the features or no peer is bound for `tp_size` > 1.
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<Linear<B>, TeError> {
        self.init_named(LayerName::root(self.name.as_deref(), "linear"), device)
    }

    pub(crate) fn init_named<B: Backend>(
        &self,
        name: LayerName,
        device: &B::Device,
    ) -> Result<Linear<B>, TeError> {
        self.init_in_pieces(name, vec![1], device)
    }

    /// [`init_named`](Self::init_named) of a layer whose outputs (column) or inputs (row) are independent parts in
    /// the proportions `pieces`, each split over the group on its own (a gated FC1: gate and value).
    pub(crate) fn init_in_pieces<B: Backend>(
        &self,
        name: LayerName,
        pieces: Vec<usize>,
        device: &B::Device,
    ) -> Result<Linear<B>, TeError> {
        let (weight, bias) = gemm_params(
            &self.initializer,
            self.in_features,
            self.out_features,
            self.bias,
            device,
        );
        self.shard_in_pieces(
            Linear {
                weight,
                bias,
                return_bias: self.return_bias,
                fp8_meta: Fp8Meta::new(),
                name,
                parallel: None,
            },
            pieces,
        )
    }

    /// This rank's shard of `whole`, a layer of this config without tensor parallelism (its parameters as this
    /// config's `tp_size` = 1 gives them): the scatter of a whole model onto the group, without communication.
    /// [`Linear::gather`] is the inverse.
    pub fn shard<B: Backend>(&self, whole: Linear<B>) -> Result<Linear<B>, TeError> {
        self.shard_in_pieces(whole, vec![1])
    }

    pub(crate) fn shard_in_pieces<B: Backend>(
        &self,
        whole: Linear<B>,
        pieces: Vec<usize>,
    ) -> Result<Linear<B>, TeError> {
        let (parallel, (weight, bias)) = TensorParallel::split_gemm(
            "Linear",
            (self.parallel_mode, self.tp_size, self.sequence_parallel),
            pieces,
            (whole.weight, whole.bias),
        )?;
        Ok(Linear {
            weight,
            bias,
            parallel,
            ..whole
        })
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
            parallel: None,
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

/// A TE GEMM layer as its module holds it: the weight, the bias added in the GEMM, the layer's name, FP8 state,
/// kind (`linear`, `layernorm_linear`) and tensor-parallel split.
pub(crate) struct GemmLayer<'a, B: Backend> {
    pub weight: &'a Param<Tensor<B, 2>>,
    pub bias: Option<Tensor<B, 1>>,
    pub name: &'a LayerName,
    pub fp8_meta: &'a Fp8Meta<B>,
    pub kind: &'static str,
    pub parallel: Option<&'a TensorParallel>,
}

/// `x [.., in] · weight [in, out] (+ bias)` through [`TeBackend::te_linear`] at the fprop site of the layer: FP8
/// with the autocast scope's recipe (or its plan's choice for the layer) and the layer's `fp8_meta`, high
/// precision outside one. The forwarding code of every TE GEMM module.
///
/// Split over a tensor-parallel group (`parallel`; `None`: whole): the input exchanged in, the GEMM on this rank's
/// shard with the sharded operands marked at its sites, the output exchanged out, then the bias (a row layer adds
/// the whole bias after the sum).
pub(crate) fn te_gemm<B: TeBackend, const D: usize>(
    x: Tensor<B, D>,
    layer: GemmLayer<'_, B>,
) -> Result<Tensor<B, D>, TeError> {
    let GemmLayer {
        weight,
        bias,
        name,
        fp8_meta,
        kind,
        parallel,
    } = layer;
    let [in_features, _] = weight.dims();
    let layer = name.resolve(weight);
    check_features(&layer, "input", &x, in_features)?;
    let (site, recipe) = fprop_site(layer, kind, fp8_meta)?;
    let Some(parallel) = parallel else {
        return Ok(run_gemm(x, weight.val(), bias, &site, recipe.as_ref()));
    };
    let site = site.with_sharding(parallel.sharding());
    let x = parallel.input(x)?;
    match parallel.mode() {
        ParallelMode::Column => Ok(run_gemm(x, weight.val(), bias, &site, recipe.as_ref())),
        ParallelMode::Row => {
            let y = parallel.output(run_gemm(x, weight.val(), None, &site, recipe.as_ref()))?;
            Ok(match bias {
                Some(bias) => y + parallel.token_shard_param(bias)?.unsqueeze(),
                None => y,
            })
        }
    }
}

/// The op whose output a GEMM layer takes, in a fused module: its norm (with the module's name, under which the
/// norm's shape errors are reported) or its MLP activation.
pub(crate) enum Before<'a, B: Backend> {
    Norm(&'a Norm<B>, &'a str),
    Activation(Activation),
}

impl<B: TeBackend> Before<'_, B> {
    /// The op alone.
    fn apply<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, TeError> {
        match self {
            Before::Norm(norm, module) => norm.try_forward(x).map_err(|err| rename(err, module)),
            Before::Activation(activation) => activation.apply(x),
        }
    }

    /// The op's output width for an input of `width`, `None` where it has none (a gated activation of an odd one).
    fn output_width(&self, width: usize) -> Option<usize> {
        match self {
            Before::Activation(activation) if activation.is_gated() => {
                width.is_multiple_of(2).then_some(width / 2)
            }
            _ => Some(width),
        }
    }

    /// The op as the fused one takes it.
    fn fused(&self) -> Result<InputOp<B>, TeError> {
        Ok(match self {
            Before::Norm(norm, _) => {
                let (gamma, beta, spec) = norm.fused_operands()?;
                InputOp::Norm(gamma, beta, spec)
            }
            Before::Activation(activation) => {
                InputOp::Activation(activation.kernel(), activation.is_gated())
            }
        })
    }
}

/// [`te_gemm`] on `op(x)`. A whole layer (no tensor parallelism) whose GEMM runs in FP8 takes both as one op where
/// the backend can write the op's output in FP8 ([`fused::cast_linear`]: DelayedScaling on the host path).
pub(crate) fn cast_te_gemm<B: TeBackend, const D: usize>(
    before: Before<'_, B>,
    x: Tensor<B, D>,
    layer: GemmLayer<'_, B>,
) -> Result<Tensor<B, D>, TeError> {
    let [in_features, _] = layer.weight.dims();
    let chains = before.output_width(x.dims()[D - 1]) == Some(in_features);
    if layer.parallel.is_some() || !chains {
        return te_gemm(before.apply(x)?, layer);
    }
    let (site, recipe) = fprop_site(layer.name.resolve(layer.weight), layer.kind, layer.fp8_meta)?;
    let gemm = (layer.weight.val(), layer.bias.clone());
    match fused::cast_linear::try_fused(&x, before.fused()?, gemm, &site, recipe.as_ref())? {
        Some(y) => Ok(y),
        None => Ok(run_gemm(
            before.apply(x)?,
            layer.weight.val(),
            layer.bias,
            &site,
            recipe.as_ref(),
        )),
    }
}

/// An attention GEMM, `a [.., M, K] · b [.., K, N]` per batch, in FP8 through [`TeBackend::te_linear`] at the
/// batched fprop site `layer` (see [`GemmSite::batched`]), `fp8_meta` keeping its operands' scales (`a` as the
/// activation, `b` as the weight, and the gradient); `None` where the scope (or its plan, for this site) gives no
/// recipe with TE's `fp8_dpa`/`fp8_mha`: the attention then stays in high precision, as TE's does, and its FP8
/// state is left as it is.
pub(crate) fn te_bmm<B: TeBackend, const D: usize>(
    a: Tensor<B, D>,
    b: Tensor<B, D>,
    layer: &str,
    fp8_meta: &Fp8Meta<B>,
    kind: &'static str,
    sharded: Option<Sharding>,
) -> Result<Option<Tensor<B, D>>, TeError> {
    if !fp8_attention_at(layer, kind)? {
        return Ok(None);
    }
    let (site, recipe) = fprop_site(layer.into(), kind, fp8_meta)?;
    let transposed = B::fp8_transposed_view(&b.clone().into_primitive().tensor());
    let site = site
        .batched()
        .with_sharding(sharded)
        .with_weight_transposed(transposed);
    Ok(recipe
        .filter(Recipe::fp8_attention)
        .map(|recipe| run_gemm(a, b, None, &site, Some(&recipe))))
}

/// Whether the attention GEMM `site` (of module type `kind`) runs in FP8 here: the scope's recipe asks for FP8
/// attention, or its plan gives the site's forward a recipe that does.
pub(crate) fn fp8_attention_at(site: &str, kind: &str) -> Result<bool, TeError> {
    Ok(match active_scope_recipe() {
        None => false,
        Some(ScopeRecipe::Recipe(recipe)) => recipe.fp8_attention(),
        Some(ScopeRecipe::Planned(planned)) => planned
            .layer(site, Some(kind))?
            .recipe(Gemm::Fprop)
            .is_some_and(Recipe::fp8_attention),
    })
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
            output: te_gemm(x, self.gemm_layer(added))?,
            bias: returned,
            layernorm_output: None,
        })
    }

    /// `op(x)·W (+ b)` ([`cast_te_gemm`]): a `LayerNormMLP`'s FC1 after its norm, its FC2 after its activation.
    /// The bias returned apart with `return_bias`.
    pub(crate) fn forward_after<const D: usize>(
        &self,
        before: Before<'_, B>,
        x: Tensor<B, D>,
    ) -> Result<ModuleOutput<B, D>, TeError> {
        let (added, returned) = split_bias(&self.bias, self.return_bias);
        Ok(ModuleOutput {
            output: cast_te_gemm(before, x, self.gemm_layer(added))?,
            bias: returned,
            layernorm_output: None,
        })
    }

    /// The layer as [`te_gemm`] runs it, with `bias` added in the GEMM.
    fn gemm_layer(&self, bias: Option<Tensor<B, 1>>) -> GemmLayer<'_, B> {
        GemmLayer {
            weight: &self.weight,
            bias,
            name: &self.name,
            fp8_meta: &self.fp8_meta,
            kind: "linear",
            parallel: self.parallel.as_ref(),
        }
    }

    /// The layer's name (see [`names`](super::names)).
    pub fn name(&self) -> String {
        self.name.resolve(&self.weight).to_string()
    }
}

impl<B: Backend> Linear<B> {
    /// The layer's tensor-parallel split (`None`: whole).
    pub fn parallel(&self) -> Option<&TensorParallel> {
        self.parallel.as_ref()
    }

    /// The whole layer from every rank's shard (a collective call over the tensor-parallel group; a whole layer is
    /// returned as is): the parameters as one rank holds them at `tp_size` = 1, the FP8 state this rank's.
    /// [`LinearConfig::shard`] is the inverse.
    pub fn gather(&self) -> Result<Linear<B>, TeError> {
        let Some(parallel) = &self.parallel else {
            return Ok(self.clone());
        };
        let (weight, bias) = parallel.gather_gemm(&(self.weight.clone(), self.bias.clone()))?;
        Ok(Linear {
            weight,
            bias,
            parallel: None,
            ..self.clone()
        })
    }
}
