//! `GroupedLinear`: many linear layers of the same shape ("experts") applied to consecutive row blocks of one input,
//! for mixture-of-experts models (TE's `te.GroupedLinear(num_gemms, in_features, out_features)` with `m_splits`).
//!
//! Expert `i` is a GEMM layer of its own: its weight and bias, its FP8 state (delayed-scaling histories), and its
//! name `{name}.{i}` (a group named `moe.experts` has experts `moe.experts.0`, `moe.experts.1`, ...), which the
//! debug tools and recipe plans select. Each expert's GEMMs are quantized and computed as a [`Linear`](super::Linear)'s, so
//! the result equals running each expert's `Linear` alone, bit for bit. An expert given no rows runs no GEMM;
//! under DelayedScaling its histories record what TE's do for an empty split (an amax of 0 for its input and
//! gradient, its weight's own), so they roll every iteration and `reduce_amax` pairs the same tensors on every rank.
//!
//! The experts run as one grouped call: one autodiff node for the whole group (up to 32 experts; more run in chunks
//! of 32), whose forward and backward issue each GEMM kind once for all experts
//! ([`TeBackend::te_grouped_linear_fprop`] and its dgrad and wgrad). The input gradient is assembled from the
//! experts' rows, and a backend that runs its GEMMs itself issues the experts' FP8 GEMMs together
//! ([`TeBackend::fp8_gemm_grouped`]: on the host path one parallel region).

use std::sync::Arc;

use burn::module::{Initializer, Param};
use burn::prelude::*;

use burn::tensor::TensorPrimitive;

use super::linear::{fprop_site, gemm_params};
use super::names::LayerName;
use super::{check_features, config_error, or_panic};
use crate::backend::TeBackend;
use crate::decorators::autodiff::MAX_EXPERTS;
use crate::error::TeError;
use crate::fp8_state::Fp8Meta;
use crate::fp8_state::site::ExpertGemms;

/// Config of [`GroupedLinear`], with TE's argument names.
#[derive(Config, Debug)]
pub struct GroupedLinearConfig {
    /// Experts (TE's `num_gemms`).
    pub num_gemms: usize,
    /// Input features of every expert.
    pub in_features: usize,
    /// Output features of every expert.
    pub out_features: usize,
    /// Each expert learns an additive bias.
    #[config(default = true)]
    pub bias: bool,
    /// The group's name; expert `i` is `{name}.{i}` (see [`names`](super::names)).
    #[config(default = "None")]
    pub name: Option<String>,
    /// Weight initializer of every expert (TE's default: normal, std 0.023). Biases start at zero.
    #[config(default = "Initializer::Normal { mean: 0.0, std: 0.023 }")]
    pub initializer: Initializer,
}

/// `num_gemms` experts, each `y = x·Wᵢ + bᵢ` on its block of rows, every GEMM in FP8 inside an autocast scope.
#[derive(Module, Debug)]
pub struct GroupedLinear<B: Backend> {
    /// Expert `i`'s weight `[in_features, out_features]` (TE's `weight{i}`, transposed as in [`Linear`](super::Linear)).
    pub weights: Vec<Param<Tensor<B, 2>>>,
    /// Expert `i`'s bias `[out_features]` (empty without biases).
    pub biases: Vec<Param<Tensor<B, 1>>>,
    /// Expert `i`'s delayed-scaling state, saved with the record.
    pub fp8_meta: Vec<Fp8Meta<B>>,
    #[module(skip)]
    name: LayerName,
}

impl GroupedLinearConfig {
    /// The experts on `device`; panics with [`try_init`](Self::try_init)'s error.
    pub fn init<B: Backend>(&self, device: &B::Device) -> GroupedLinear<B> {
        or_panic(self.try_init(device))
    }

    /// The experts on `device`, or an error when there are none.
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<GroupedLinear<B>, TeError> {
        if self.num_gemms == 0 {
            return Err(config_error(
                "GroupedLinear",
                "num_gemms must be at least 1",
            ));
        }
        let (weights, biases): (Vec<_>, Vec<_>) = (0..self.num_gemms)
            .map(|_| {
                gemm_params(
                    &self.initializer,
                    self.in_features,
                    self.out_features,
                    self.bias,
                    device,
                )
            })
            .unzip();
        Ok(GroupedLinear {
            weights,
            biases: biases.into_iter().flatten().collect(),
            fp8_meta: (0..self.num_gemms).map(|_| Fp8Meta::new()).collect(),
            name: LayerName::root(self.name.as_deref(), "grouped_linear"),
        })
    }
}

impl<B: TeBackend> GroupedLinear<B> {
    /// `x [Σ m_splits, in_features]`: rows `m_splits[0]` go to expert 0, the next `m_splits[1]` to expert 1, ...;
    /// returns `[Σ m_splits, out_features]` in the same row order. Panics with [`try_forward`](Self::try_forward)'s
    /// error.
    pub fn forward(&self, x: Tensor<B, 2>, m_splits: &[usize]) -> Tensor<B, 2> {
        or_panic(self.try_forward(x, m_splits))
    }

    /// [`forward`](Self::forward), or an error naming the group when `m_splits` does not have one entry per expert
    /// or does not sum to the rows of `x`, or `x`'s features are not `in_features`.
    pub fn try_forward(
        &self,
        x: Tensor<B, 2>,
        m_splits: &[usize],
    ) -> Result<Tensor<B, 2>, TeError> {
        let name = self.name();
        let in_features = self.weights[0].dims()[0];
        check_features(&name, "input", &x, in_features)?;
        let rows = x.dims()[0];
        if m_splits.len() != self.weights.len() || m_splits.iter().sum::<usize>() != rows {
            return Err(TeError::InvalidShape {
                module: name,
                reason: format!(
                    "m_splits {m_splits:?} must give one row count per expert ({}) summing to the input's rows",
                    self.weights.len()
                ),
                shape: x.dims().to_vec(),
            });
        }
        let mut outputs = Vec::new();
        let mut start = 0;
        let experts: Vec<usize> = (0..m_splits.len()).collect();
        for chunk in experts.chunks(MAX_EXPERTS) {
            // A chunk without rows runs too: its experts' FP8 states record what TE's do for an empty split.
            let chunk_rows: usize = chunk.iter().map(|&i| m_splits[i]).sum();
            let x = match chunk_rows == rows {
                true => x.clone(),
                false => x.clone().slice(burn::tensor::s![start..start + chunk_rows]),
            };
            outputs.push(self.run_experts(x, chunk, m_splits)?);
            start += chunk_rows;
        }
        Ok(match outputs.len() {
            1 => outputs.pop().expect("one output"),
            _ => Tensor::cat(outputs, 0),
        })
    }

    /// Experts `chunk` (at most [`MAX_EXPERTS`], together given `x`'s rows) as one grouped GEMM.
    fn run_experts(
        &self,
        x: Tensor<B, 2>,
        chunk: &[usize],
        m_splits: &[usize],
    ) -> Result<Tensor<B, 2>, TeError> {
        let experts = ExpertGemms {
            m_splits: chunk.iter().map(|&i| m_splits[i]).collect(),
            experts: chunk
                .iter()
                .map(|&i| {
                    // An expert without rows runs no GEMM, but its FP8 state records what TE's does for an
                    // empty split (`crate::linear::grouped`), so every rank's `reduce_amax` calls match.
                    let layer = self.expert_name(i).resolve(&self.weights[i]);
                    fprop_site(layer, "grouped_linear", &self.fp8_meta[i])
                })
                .collect::<Result<_, TeError>>()?,
        };
        let weights = chunk
            .iter()
            .map(|&i| self.weights[i].val().into_primitive().tensor())
            .collect();
        let biases = chunk
            .iter()
            .map(|&i| {
                self.biases
                    .get(i)
                    .map(|b| b.val().into_primitive().tensor())
            })
            .collect();
        let out = B::te_grouped_linear(x.into_primitive().tensor(), weights, biases, &experts);
        Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
    }

    /// The group's name (its experts are `{name}.{i}`).
    pub fn name(&self) -> String {
        self.group_name().to_string()
    }

    /// The experts' layer names in order (what a debug config or a recipe plan selects).
    pub fn gemm_layers(&self) -> Vec<String> {
        (0..self.weights.len())
            .map(|i| format!("{}.{i}", self.group_name()))
            .collect()
    }

    /// The group's name: explicit, or inferred from where its weights sit (`….weights.i` in the model), or generic.
    fn group_name(&self) -> Arc<str> {
        let resolved = self.name.resolve(&self.weights[0]);
        match resolved.strip_suffix(".weights") {
            Some(group) => group.into(),
            None => resolved,
        }
    }

    /// Expert `i`'s name, `{group}.{i}`, as an explicit name (it keys the expert's FP8 state and debug routing).
    fn expert_name(&self, i: usize) -> LayerName {
        LayerName::fixed(&format!("{}.{i}", self.group_name()))
    }
}
