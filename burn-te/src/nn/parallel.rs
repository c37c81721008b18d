//! Tensor parallelism in the TE modules, as TE's `parallel_mode`, `tp_size` and `sequence_parallel` arguments
//! give it (Megatron's layout):
//! - `column`: the weight `[in, out]` split along its outputs; the input is the whole tensor (copied in: its
//!   gradient is summed over the group in the backward), or under sequence parallelism the group's token shards
//!   all-gathered; the output is this rank's slice of the features.
//! - `row`: the weight split along its inputs; the input is this rank's slice of the features (a column-parallel
//!   layer's output); the partial outputs are summed over the group (all-reduce), or under sequence parallelism
//!   reduce-scattered into token shards; the bias, whole at every rank, is added after the sum.
//!
//! Token shards are chunks of the input's first dimension (TE's `[seq, batch, hidden]`; any split of the tokens
//! serves the token-wise norms and GEMMs). FP8: the operands a rank holds one shard of (a column layer's weight and
//! output gradient, a row layer's input and weight) are quantized with the whole tensor's scale — current scaling
//! reduces their amax over the group ([`GemmSite::sharded`](crate::GemmSite::sharded)), delayed scaling's amax
//! history is reduced over the bound peer's world (`reduce_amax`). Block recipes need no reduction where the shard
//! boundaries fall on block boundaries (a shard of `out / tp_size` columns, a multiple of 128, for the weight's
//! 128×128 blocks; `in / tp_size`, a multiple of the block along K, for a row layer's input); otherwise each rank's
//! blocks differ from the whole tensor's, still exact for its own shard.

use burn::module::Param;
use burn::prelude::*;
use serde::{Deserialize, Serialize};

use super::config_error;
use crate::TensorRole;
use crate::backend::TeBackend;
#[cfg(feature = "distributed")]
use crate::distributed::tensor_parallel::{TpCollective, TpExchange, TpGroup};
use crate::error::TeError;
#[cfg(feature = "distributed")]
use crate::fp8_state::site::{AmaxGroup, Sharding};

/// A GEMM layer's weight `[in, out]` and bias `[out]`.
pub(crate) type GemmParams<B> = (Param<Tensor<B, 2>>, Option<Param<Tensor<B, 1>>>);

/// How a GEMM layer is split over its tensor-parallel group (TE's `parallel_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ParallelMode {
    /// The weight split along its outputs (TE's `"column"`): QKV and fc1.
    Column,
    /// The weight split along its inputs (TE's `"row"`): the attention's projection and fc2.
    Row,
}

/// A layer's place in its tensor-parallel group: its mode, sequence parallelism, the group.
#[derive(Clone, Debug)]
pub struct TensorParallel {
    mode: ParallelMode,
    sequence_parallel: bool,
    size: usize,
    index: usize,
    /// Independent pieces along the split dimension, in proportion, each split on its own (`[1]`: one; a gated
    /// FC1's gate and value `[1, 1]`; QKV's queries, keys and values `[heads, groups, groups]`).
    pieces: Vec<usize>,
    #[cfg(feature = "distributed")]
    group: TpGroup,
    #[cfg(feature = "distributed")]
    sharding: Sharding,
}

/// [`TpGroup`]'s amax reduction for the GEMM sites of a sharded layer.
#[cfg(feature = "distributed")]
#[derive(Debug)]
struct GroupAmax(TpGroup);

#[cfg(feature = "distributed")]
impl AmaxGroup for GroupAmax {
    fn max(&self, what: &str, values: &[f32]) -> Result<Vec<f32>, TeError> {
        self.0.all_reduce_max(what, values)
    }
}

impl TensorParallel {
    /// The tensor parallelism of `module` as its config says: `None` without a `parallel_mode`; with one, the
    /// group of `tp_size` ranks of the peer bound to this thread. An error when `tp_size` > 1 and no peer is bound,
    /// `tp_size` does not divide the world, or burn-te was built without its `distributed` feature.
    pub fn new(
        module: &str,
        mode: Option<ParallelMode>,
        tp_size: usize,
        sequence_parallel: bool,
    ) -> Result<Option<Self>, TeError> {
        let Some(mode) = mode else {
            if sequence_parallel {
                return Err(config_error(
                    module,
                    "sequence_parallel needs a parallel_mode (column or row)",
                ));
            }
            return Ok(None);
        };
        if tp_size == 0 {
            return Err(config_error(module, "tp_size must be at least 1"));
        }
        #[cfg(feature = "distributed")]
        {
            let group = TpGroup::current(tp_size)
                .map_err(|err| config_error(module, format!("tp_size {tp_size}: {err}")))?;
            let roles = match mode {
                ParallelMode::Column => vec![TensorRole::Weight, TensorRole::Gradient],
                ParallelMode::Row => vec![TensorRole::Activation, TensorRole::Weight],
            };
            Ok(Some(Self {
                mode,
                sequence_parallel,
                size: group.size(),
                index: group.index(),
                pieces: vec![1],
                sharding: Sharding {
                    roles,
                    group: std::sync::Arc::new(GroupAmax(group.clone())),
                },
                group,
            }))
        }
        #[cfg(not(feature = "distributed"))]
        {
            if tp_size > 1 {
                return Err(config_error(
                    module,
                    format!("tp_size {tp_size} needs burn-te's `distributed` feature"),
                ));
            }
            Ok(Some(Self {
                mode,
                sequence_parallel,
                size: 1,
                index: 0,
                pieces: vec![1],
            }))
        }
    }

    /// The same split, of a layer whose split dimension holds independent parts in the proportions `pieces`, each
    /// split on its own (a gated FC1's gate and value; QKV's queries, keys and values).
    pub(crate) fn in_pieces(self, pieces: Vec<usize>) -> Self {
        Self { pieces, ..self }
    }

    /// The widths of the pieces of a split dimension of `whole`.
    fn widths(&self, whole: usize) -> Vec<usize> {
        let total: usize = self.pieces.iter().sum();
        self.pieces.iter().map(|p| whole / total * p).collect()
    }

    /// Whether the layer's input or output is token shards.
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    /// The split.
    pub fn mode(&self) -> ParallelMode {
        self.mode
    }

    /// The group's size.
    pub fn size(&self) -> usize {
        self.size
    }

    /// This rank's index in the group: which shard it holds.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The dimension of the weight `[in, out]` the group splits.
    fn weight_dim(&self) -> usize {
        match self.mode {
            ParallelMode::Column => 1,
            ParallelMode::Row => 0,
        }
    }

    /// Checks that the group divides `features` (the split dimension of `module`'s weight, named by `key`).
    pub(crate) fn check_divides(
        &self,
        module: &str,
        key: &str,
        features: usize,
    ) -> Result<(), TeError> {
        let total: usize = self.pieces.iter().sum();
        let fits = features.is_multiple_of(total)
            && self
                .widths(features)
                .iter()
                .all(|w| w.is_multiple_of(self.size));
        if !fits {
            let pieces = match self.pieces.len() {
                1 => String::new(),
                _ => format!(" in each of its parts (proportions {:?})", self.pieces),
            };
            return Err(config_error(
                module,
                format!(
                    "{key} = {features} is not divisible by tp_size {}{pieces} ({:?}-parallel)",
                    self.size, self.mode
                ),
            ));
        }
        Ok(())
    }

    /// The split `module`'s config asks for (its parallel mode, `tp_size`, `sequence_parallel`) of a GEMM whose
    /// split dimension holds independent parts in the proportions `pieces`, and this rank's shards of the whole
    /// GEMM's `params`; without a parallel mode, no split and the params as they are. An error when the split does
    /// not fit the features (or [`new`](Self::new)'s).
    pub(crate) fn split_gemm<B: Backend>(
        module: &str,
        (mode, tp_size, sequence_parallel): (Option<ParallelMode>, usize, bool),
        pieces: Vec<usize>,
        params: GemmParams<B>,
    ) -> Result<(Option<Self>, GemmParams<B>), TeError> {
        let Some(parallel) = Self::new(module, mode, tp_size, sequence_parallel)? else {
            return Ok((None, params));
        };
        let parallel = parallel.in_pieces(pieces);
        let [in_features, out_features] = params.0.dims();
        match parallel.mode {
            ParallelMode::Column => parallel.check_divides(module, "out_features", out_features)?,
            ParallelMode::Row => parallel.check_divides(module, "in_features", in_features)?,
        }
        let params = parallel.shard_params(params);
        Ok((Some(parallel), params))
    }

    /// The whole GEMM's parameters from every rank's shards of them (a collective call).
    pub(crate) fn gather_gemm<B: Backend>(
        &self,
        (weight, bias): &GemmParams<B>,
    ) -> Result<GemmParams<B>, TeError> {
        let weight = self.gather_param(weight.val().detach(), true)?;
        let bias = match bias {
            Some(bias) => Some(Param::from_tensor(
                self.gather_param(bias.val().detach(), false)?,
            )),
            None => None,
        };
        Ok((Param::from_tensor(weight), bias))
    }

    /// This rank's shards of a whole layer's weight `[in, out]` and bias `[out]` (a row layer keeps the whole bias).
    fn shard_params<B: Backend>(&self, (weight, bias): GemmParams<B>) -> GemmParams<B> {
        let dim = self.weight_dim();
        let weight = self.shard(weight, dim);
        let bias = match self.mode {
            ParallelMode::Column => bias.map(|b| self.shard(b, 0)),
            ParallelMode::Row => bias,
        };
        (weight, bias)
    }

    /// The GEMM's input from the layer's input: copied into a column layer (or its token shards gathered under
    /// sequence parallelism); a row layer's is its shard already.
    pub(crate) fn input<B: TeBackend, const D: usize>(
        &self,
        x: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, TeError> {
        match (self.mode, self.sequence_parallel) {
            (ParallelMode::Row, _) => Ok(x),
            #[cfg(feature = "distributed")]
            (ParallelMode::Column, false) => self.exchange(x, TpCollective::Copy),
            #[cfg(feature = "distributed")]
            (ParallelMode::Column, true) => self.exchange(x, TpCollective::Gather(0)),
            #[cfg(not(feature = "distributed"))]
            (ParallelMode::Column, _) => Ok(x),
        }
    }

    /// The layer's output from the GEMM's: a row layer's partial sums summed over the group (or reduce-scattered
    /// into token shards under sequence parallelism); a column layer's is its slice of the features.
    pub(crate) fn output<B: TeBackend, const D: usize>(
        &self,
        y: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, TeError> {
        match (self.mode, self.sequence_parallel) {
            (ParallelMode::Column, _) => Ok(y),
            #[cfg(feature = "distributed")]
            (ParallelMode::Row, false) => self.exchange(y, TpCollective::Reduce),
            #[cfg(feature = "distributed")]
            (ParallelMode::Row, true) => self.exchange(y, TpCollective::ReduceScatter(0)),
            #[cfg(not(feature = "distributed"))]
            (ParallelMode::Row, _) => Ok(y),
        }
    }

    /// A whole parameter as a layer applies it to its token shards (sequence parallelism: the norms' γ and β, a
    /// row layer's bias): each rank's gradient of it covers only its tokens, so it goes in through a copy into the
    /// group, whose backward sums the gradient over the ranks. Without sequence parallelism, as is.
    pub(crate) fn token_shard_param<B: TeBackend, const D: usize>(
        &self,
        param: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, TeError> {
        #[cfg(feature = "distributed")]
        if self.sequence_parallel {
            return self.exchange(param, TpCollective::Copy);
        }
        Ok(param)
    }

    /// The group's amax reduction for GEMMs all of whose operands are sharded (the attention's, split by heads).
    pub(crate) fn all_sharded(&self) -> Option<crate::fp8_state::site::Sharding> {
        self.sharding().map(|s| crate::fp8_state::site::Sharding {
            roles: vec![
                TensorRole::Activation,
                TensorRole::Weight,
                TensorRole::Gradient,
            ],
            ..s
        })
    }

    /// The sharded operands of the layer's GEMMs and their group, for its GEMM sites.
    pub(crate) fn sharding(&self) -> Option<crate::fp8_state::site::Sharding> {
        #[cfg(feature = "distributed")]
        return (self.size > 1).then(|| self.sharding.clone());
        #[cfg(not(feature = "distributed"))]
        None
    }

    /// The whole parameter from every rank's shard of it (a collective call): `weight` split along the weight's
    /// split dimension, or a bias (split along its only dimension by a column layer; a row layer's is whole).
    fn gather_param<B: Backend, const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        weight: bool,
    ) -> Result<Tensor<B, D>, TeError> {
        let dim = match (weight, self.mode) {
            (true, _) => self.weight_dim(),
            (false, ParallelMode::Column) => 0,
            (false, ParallelMode::Row) => return Ok(tensor),
        };
        #[cfg(feature = "distributed")]
        {
            let gathered = TpExchange::AllGather(dim)
                .apply::<B>(tensor.into_primitive().tensor(), &self.group)?;
            Ok(self.unshard(
                Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(gathered)),
                dim,
            ))
        }
        #[cfg(not(feature = "distributed"))]
        {
            let _ = dim;
            Ok(tensor)
        }
    }

    #[cfg(feature = "distributed")]
    fn exchange<B: TeBackend, const D: usize>(
        &self,
        x: Tensor<B, D>,
        collective: TpCollective,
    ) -> Result<Tensor<B, D>, TeError> {
        let out = B::te_tp_collective(x.into_primitive().tensor(), collective, &self.group)?;
        Ok(Tensor::from_primitive(
            burn::tensor::TensorPrimitive::Float(out),
        ))
    }
}

impl TensorParallel {
    /// This rank's part of `param` along `dim`: its chunk of each piece.
    fn shard<B: Backend, const D: usize>(
        &self,
        param: Param<Tensor<B, D>>,
        dim: usize,
    ) -> Param<Tensor<B, D>> {
        if self.size == 1 {
            return param;
        }
        let whole = param.val().detach().set_require_grad(false);
        let mut offset = 0;
        let mut parts = Vec::new();
        for width in self.widths(whole.dims()[dim]) {
            let chunk = width / self.size;
            parts.push(
                whole
                    .clone()
                    .narrow(dim, offset + self.index * chunk, chunk),
            );
            offset += width;
        }
        Param::from_tensor(Tensor::cat(parts, dim))
    }

    /// The inverse of [`shard`](Self::shard) on the ranks' parts concatenated in rank order: each piece's chunks
    /// back together.
    #[cfg(feature = "distributed")]
    fn unshard<B: Backend, const D: usize>(
        &self,
        gathered: Tensor<B, D>,
        dim: usize,
    ) -> Tensor<B, D> {
        if self.pieces.len() == 1 {
            return gathered;
        }
        let chunks: Vec<usize> = self
            .widths(gathered.dims()[dim])
            .iter()
            .map(|w| w / self.size)
            .collect();
        let block: usize = chunks.iter().sum();
        let mut ordered = Vec::new();
        for (p, &chunk) in chunks.iter().enumerate() {
            let within: usize = chunks[..p].iter().sum();
            for r in 0..self.size {
                ordered.push(gathered.clone().narrow(dim, r * block + within, chunk));
            }
        }
        Tensor::cat(ordered, dim)
    }
}
