//! `LayerNormLinear`: a normalization followed by a linear layer (TE's `te.LayerNormLinear`). Its one GEMM is
//! named after the module itself (e.g. `transformer_layer.self_attention.layernorm_qkv`).

use burn::module::{Initializer, Param};
use burn::prelude::*;

use super::linear::{Before, GemmLayer, cast_te_gemm, gemm_params, split_bias, te_gemm};
use super::names::LayerName;
use super::norm::{Norm, Normalization, rename};
use super::parallel::{ParallelMode, TensorParallel};
use super::{ModuleOutput, or_panic};
use crate::backend::TeBackend;
use crate::error::TeError;
use crate::fp8_state::Fp8Meta;

/// Config of [`LayerNormLinear`].
#[derive(Config, Debug)]
pub struct LayerNormLinearConfig {
    /// Input features (the normalized size).
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
    /// The normalization's epsilon.
    #[config(default = 1e-5)]
    pub eps: f64,
    /// LayerNorm or RMSNorm.
    #[config(default = "Normalization::LayerNorm")]
    pub normalization: Normalization,
    /// The normalization's γ is zero-centred.
    #[config(default = false)]
    pub zero_centered_gamma: bool,
    /// Learn an additive bias.
    #[config(default = true)]
    pub bias: bool,
    /// Return the bias beside the output instead of adding it.
    #[config(default = false)]
    pub return_bias: bool,
    /// Also return the normalized input ([`LayerNormLinear::forward_all`]).
    #[config(default = false)]
    pub return_layernorm_output: bool,
    /// The layer's name (see [`names`](super::names)).
    #[config(default = "None")]
    pub name: Option<String>,
    /// Weight initializer (TE's default: normal, std 0.023).
    #[config(default = "Initializer::Normal { mean: 0.0, std: 0.023 }")]
    pub initializer: Initializer,
    /// Split the GEMM over a tensor-parallel group: `column` or `row`; `None`: whole (see
    /// [`parallel`](super::parallel)).
    #[config(default = "None")]
    pub parallel_mode: Option<ParallelMode>,
    /// Ranks in the tensor-parallel group: consecutive ranks of the peer bound to this thread.
    #[config(default = 1)]
    pub tp_size: usize,
    /// Sequence parallelism: the input is this rank's token shard, normalized there and gathered before a column
    /// GEMM.
    #[config(default = false)]
    pub sequence_parallel: bool,
}

/// Normalization, then a linear layer whose GEMMs run in FP8 inside an autocast scope.
#[derive(Module, Debug)]
pub struct LayerNormLinear<B: Backend> {
    /// The normalization.
    pub layer_norm: Norm<B>,
    /// `[in_features, out_features]`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[out_features]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    return_bias: bool,
    return_layernorm_output: bool,
    /// The delayed-scaling state of the layer's GEMMs (amax histories and scales), saved with the record.
    pub fp8_meta: Fp8Meta<B>,
    #[module(skip)]
    name: LayerName,
    /// The GEMM's tensor-parallel split (`None`: whole).
    #[module(skip)]
    parallel: Option<TensorParallel>,
}

impl LayerNormLinearConfig {
    /// A LayerNormLinear on `device`. Panics with [`try_init`](Self::try_init)'s error.
    pub fn init<B: Backend>(&self, device: &B::Device) -> LayerNormLinear<B> {
        or_panic(self.try_init(device))
    }

    /// A LayerNormLinear on `device`, or an error when its tensor-parallel split does not fit (see
    /// [`LinearConfig::try_init`](super::LinearConfig::try_init)).
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<LayerNormLinear<B>, TeError> {
        self.init_named(
            LayerName::root(self.name.as_deref(), "layernorm_linear"),
            device,
            vec![1],
        )
    }

    /// The layer named `name`, its outputs (column) or inputs (row) independent parts in the proportions `pieces`,
    /// each split over the group on its own (QKV's queries, keys and values).
    pub(crate) fn init_named<B: Backend>(
        &self,
        name: LayerName,
        device: &B::Device,
        pieces: Vec<usize>,
    ) -> Result<LayerNormLinear<B>, TeError> {
        let (weight, bias) = gemm_params(
            &self.initializer,
            self.in_features,
            self.out_features,
            self.bias,
            device,
        );
        let whole = LayerNormLinear {
            layer_norm: self.normalization.init(
                self.in_features,
                self.eps,
                self.zero_centered_gamma,
                name.child("layer_norm", None),
                device,
            )?,
            weight,
            bias,
            return_bias: self.return_bias,
            return_layernorm_output: self.return_layernorm_output,
            fp8_meta: Fp8Meta::new(),
            name,
            parallel: None,
        };
        self.shard_in_pieces(whole, pieces)
    }

    /// This rank's shard of `whole`, a layer of this config without tensor parallelism (see
    /// [`LinearConfig::shard`](super::LinearConfig::shard)). [`LayerNormLinear::gather`] is the inverse.
    pub fn shard<B: Backend>(
        &self,
        whole: LayerNormLinear<B>,
    ) -> Result<LayerNormLinear<B>, TeError> {
        self.shard_in_pieces(whole, vec![1])
    }

    pub(crate) fn shard_in_pieces<B: Backend>(
        &self,
        whole: LayerNormLinear<B>,
        pieces: Vec<usize>,
    ) -> Result<LayerNormLinear<B>, TeError> {
        let (parallel, (weight, bias)) = TensorParallel::split_gemm(
            "LayerNormLinear",
            (self.parallel_mode, self.tp_size, self.sequence_parallel),
            pieces,
            (whole.weight, whole.bias),
        )?;
        Ok(LayerNormLinear {
            layer_norm: whole.layer_norm.on_token_shards(parallel.as_ref()),
            weight,
            bias,
            parallel,
            ..whole
        })
    }
}

impl<B: Backend> LayerNormLinear<B> {
    /// The GEMM's tensor-parallel split (`None`: whole).
    pub fn parallel(&self) -> Option<&TensorParallel> {
        self.parallel.as_ref()
    }

    /// The whole layer from every rank's shard (a collective call; see [`Linear::gather`](super::Linear::gather)).
    pub fn gather(&self) -> Result<LayerNormLinear<B>, TeError> {
        let Some(parallel) = &self.parallel else {
            return Ok(self.clone());
        };
        let (weight, bias) = parallel.gather_gemm(&(self.weight.clone(), self.bias.clone()))?;
        Ok(LayerNormLinear {
            layer_norm: self.layer_norm.clone().on_token_shards(None),
            weight,
            bias,
            parallel: None,
            ..self.clone()
        })
    }
}

impl<B: TeBackend> LayerNormLinear<B> {
    /// `norm(x)·W (+ b)` for `x [.., in_features]`. Panics with [`try_forward`](Self::try_forward)'s error.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        or_panic(self.try_forward(x))
    }

    /// [`forward`](Self::forward), or an error naming the layer and the bad shape.
    pub fn try_forward<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, TeError> {
        Ok(self.forward_all(x)?.output)
    }

    /// The output, the bias with `return_bias`, and the normalized input with `return_layernorm_output`.
    pub fn forward_all<const D: usize>(
        &self,
        x: Tensor<B, D>,
    ) -> Result<ModuleOutput<B, D>, TeError> {
        let (added, returned) = split_bias(&self.bias, self.return_bias);
        let layer = GemmLayer {
            weight: &self.weight,
            bias: added,
            name: &self.name,
            fp8_meta: &self.fp8_meta,
            kind: "layernorm_linear",
            parallel: self.parallel.as_ref(),
        };
        let module = self.name();
        if !self.return_layernorm_output {
            let output = cast_te_gemm(Before::Norm(&self.layer_norm, &module), x, layer)?;
            return Ok(ModuleOutput {
                output,
                bias: returned,
                layernorm_output: None,
            });
        }
        let normalized = self
            .layer_norm
            .try_forward(x)
            .map_err(|err| rename(err, &module))?;
        Ok(ModuleOutput {
            output: te_gemm(normalized.clone(), layer)?,
            bias: returned,
            layernorm_output: Some(normalized),
        })
    }

    /// The layer's name (see [`names`](super::names)).
    pub fn name(&self) -> String {
        self.name.resolve(&self.weight).to_string()
    }
}
