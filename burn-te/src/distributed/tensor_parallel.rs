//! Tensor parallelism's groups and collectives: a [`TpGroup`] is `size` consecutive ranks of the world (Megatron's
//! layout: ranks `g·size .. (g+1)·size` form tensor-parallel group `g`; the ranks with the same index in their
//! groups form the data-parallel groups), and a [`TpCollective`] is one of the exchanges Megatron's tensor- and
//! sequence-parallel layers place around their GEMMs, each with the exchange its backward makes.
//!
//! burn-collective offers only an all-reduce over every peer of the world, by sum or mean. The group exchanges are
//! built on it: an all-gather writes every rank's values, bit for bit, into its own slot of a zero tensor, which
//! the world sums, and each rank keeps its group's slots; an all-reduce writes each rank's values as `f64` into its
//! group's slot, and the world's sum adds every group apart, exactly. Every rank of a group gets the same bits, and
//! one exchange serves every group of the world at once (each group's ranks reach the same exchange at the same
//! point of the same program). The cost is a world-sized message per call and
//! a host round trip, measured per call in the metrics report (`TpExchangeTime`, `TpExchangedBytes`).

use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorData, TensorMetadata};

use super::Peer;
use crate::error::TeError;
use crate::metrics::{increment_counter, names, record_time};
use crate::readback::read_f32;

/// The ranks of one tensor-parallel group, as seen from one of them: its peer (the world), the group's size and
/// this rank's index in it. A group of one (`size` 1) exchanges nothing and needs no peer.
#[derive(Clone, Debug)]
pub struct TpGroup {
    peer: Option<Peer>,
    size: usize,
    index: usize,
}

impl TpGroup {
    /// The group of one: tensor parallelism off.
    pub fn single() -> Self {
        Self {
            peer: None,
            size: 1,
            index: 0,
        }
    }

    /// `peer`'s tensor-parallel group of `size` consecutive ranks. An error when `size` does not divide the world.
    pub fn new(peer: &Peer, size: usize) -> Result<Self, TeError> {
        let world = peer.world_size();
        if size == 0 || !world.is_multiple_of(size) {
            return Err(TeError::Collective(format!(
                "a tensor-parallel size of {size} does not divide the world of {world} peers"
            )));
        }
        Ok(Self {
            peer: (size > 1).then(|| peer.clone()),
            size,
            index: peer.rank() % size,
        })
    }

    /// The group of `size` of the peer bound to this thread ([`Peer::bind`]); an error when `size` > 1 and no peer
    /// is bound.
    pub fn current(size: usize) -> Result<Self, TeError> {
        if size <= 1 {
            return Ok(Self::single());
        }
        let peer = super::current().ok_or_else(|| {
            TeError::Collective(format!(
                "a tensor-parallel size of {size} needs a peer bound to this thread (Peer::join, then Peer::bind) \
                 before the layers are built"
            ))
        })?;
        Self::new(&peer, size)
    }

    /// The number of ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// This rank's index in the group, `0..size`: which shard it holds.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The world ranks of the group, in index order (for the debug tools' `ReductionGroup::Ranks`, to reduce their
    /// statistics over the tensor-parallel group).
    pub fn ranks(&self) -> Vec<usize> {
        let first = self.peer.as_ref().map_or(0, |p| p.rank() - self.index);
        (first..first + self.size).collect()
    }

    /// The world ranks of this rank's data-parallel group: those holding the same shard (the same index in their
    /// tensor-parallel groups).
    pub fn data_parallel_ranks(&self) -> Vec<usize> {
        let world = self.peer.as_ref().map_or(1, Peer::world_size);
        (self.index..world).step_by(self.size).collect()
    }

    /// Every rank's `values` (the same number at every rank of the world), by index in the group.
    pub fn gather(&self, what: &str, values: &[f32]) -> Result<Vec<Vec<f32>>, TeError> {
        let Some(peer) = &self.peer else {
            return Ok(vec![values.to_vec()]);
        };
        let bits: Vec<u32> = values.iter().map(|v| v.to_bits()).collect();
        let world = peer.gather_words(what, &bits)?;
        let first = peer.rank() - self.index;
        Ok(world[first..first + self.size]
            .iter()
            .map(|words| words.iter().map(|&w| f32::from_bits(w)).collect())
            .collect())
    }

    /// Waits until every rank of the world reaches this point, where the peers are threads of this process (a
    /// collective call; nothing across processes).
    ///
    /// Why: after a backward, Burn's autodiff cleans its graphs up by locking every graph of the process in turn,
    /// other threads' too, and a rank in a backward holds its graph's lock while it waits for a tensor-parallel
    /// exchange. A rank still cleaning up after its last backward would wait for a faster rank that already
    /// entered its next backward and waits in an exchange for it: a deadlock. A collective whose forward
    /// exchanges nothing but whose backward does (`Copy`, `Split`) passes this barrier in the forward, so no rank
    /// enters that backward before every rank finished the previous one.
    pub fn sync_threads(&self) -> Result<(), TeError> {
        match &self.peer {
            Some(peer) if peer.threads() => peer.all_reduce_max(&[0.0]).map(|_| ()),
            _ => Ok(()),
        }
    }

    /// The element-wise maximum over the group (NaN where any rank's is NaN): the amax of a tensor sharded over it.
    pub fn all_reduce_max(&self, what: &str, values: &[f32]) -> Result<Vec<f32>, TeError> {
        Ok(super::elementwise_max(values, self.gather(what, values)?))
    }

    /// The element-wise sum over the group, in `f64`, rounded once to `f32` (for two ranks, the correctly rounded
    /// sum; for more, exact unless the ranks' values lie more than 2²⁹ apart in magnitude, so every rank gets the
    /// same bits whatever order burn-collective adds in). Each rank writes its values into its group's slot of a
    /// message of one slot per group, and the world's sum adds each group's apart.
    pub fn all_reduce_sum(&self, what: &str, values: &[f32]) -> Result<Vec<f32>, TeError> {
        let Some(peer) = &self.peer else {
            return Ok(values.to_vec());
        };
        let n = values.len();
        let (group, groups) = (peer.rank() / self.size, peer.world_size() / self.size);
        let mut message = vec![0.0f64; n * groups];
        for (slot, &v) in message[group * n..(group + 1) * n].iter_mut().zip(values) {
            *slot = f64::from(v);
        }
        let sum = peer.sum(what, message)?;
        Ok(sum[group * n..(group + 1) * n]
            .iter()
            .map(|&s| s as f32)
            .collect())
    }
}

/// One exchange of a tensor-parallel layer, with its adjoint in the backward (Megatron's mappings):
///
/// | collective | forward | backward |
/// | --- | --- | --- |
/// | `Copy` (into a column-parallel GEMM) | identity | all-reduce |
/// | `Reduce` (out of a row-parallel GEMM) | all-reduce | identity |
/// | `Gather(dim)` (sequence shards into a column-parallel GEMM) | all-gather along `dim` | reduce-scatter |
/// | `ReduceScatter(dim)` (out of a row-parallel GEMM into sequence shards) | reduce-scatter along `dim` | all-gather |
/// | `Split(dim)` (a replicated tensor into sequence shards) | this rank's chunk along `dim` | all-gather |
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpCollective {
    /// Identity forward, all-reduce backward.
    Copy,
    /// All-reduce forward, identity backward.
    Reduce,
    /// All-gather along the dimension forward, reduce-scatter backward.
    Gather(usize),
    /// Reduce-scatter along the dimension forward, all-gather backward.
    ReduceScatter(usize),
    /// This rank's chunk along the dimension forward, all-gather backward.
    Split(usize),
}

/// What one direction of a [`TpCollective`] does to a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpExchange {
    /// Nothing.
    Identity,
    /// Sum over the group.
    AllReduce,
    /// The group's chunks concatenated along the dimension, in index order.
    AllGather(usize),
    /// Sum over the group, then this rank's chunk along the dimension.
    ReduceScatter(usize),
    /// This rank's chunk along the dimension.
    Split(usize),
}

impl TpCollective {
    /// What the forward does.
    pub fn forward(self) -> TpExchange {
        match self {
            TpCollective::Copy => TpExchange::Identity,
            TpCollective::Reduce => TpExchange::AllReduce,
            TpCollective::Gather(dim) => TpExchange::AllGather(dim),
            TpCollective::ReduceScatter(dim) => TpExchange::ReduceScatter(dim),
            TpCollective::Split(dim) => TpExchange::Split(dim),
        }
    }

    /// What the backward does to the gradient: the forward's adjoint.
    pub fn backward(self) -> TpExchange {
        match self {
            TpCollective::Copy => TpExchange::AllReduce,
            TpCollective::Reduce => TpExchange::Identity,
            TpCollective::Gather(dim) => TpExchange::ReduceScatter(dim),
            TpCollective::ReduceScatter(dim) | TpCollective::Split(dim) => {
                TpExchange::AllGather(dim)
            }
        }
    }
}

impl TpExchange {
    /// Applies the exchange to `tensor` over `group` (a collective call at every rank of the world, except for
    /// `Identity` and `Split`). The values go through the host as `f32`; the result has the input's dtype.
    pub fn apply<B: Backend>(
        self,
        tensor: FloatTensor<B>,
        group: &TpGroup,
    ) -> Result<FloatTensor<B>, TeError> {
        if self == TpExchange::Identity || group.size() == 1 {
            return Ok(tensor);
        }
        let shape = tensor.shape();
        let dims = shape.as_slice().to_vec();
        let chunked = |dim: usize, whole: usize| -> Result<usize, TeError> {
            if dim >= dims.len() || !whole.is_multiple_of(group.size()) {
                return Err(TeError::ShapeMismatch {
                    op: "tensor-parallel exchange",
                    reason: format!(
                        "{self:?} over {} ranks needs dimension {dim} divisible by {}",
                        group.size(),
                        group.size()
                    ),
                    lhs: dims.clone(),
                    rhs: Vec::new(),
                });
            }
            Ok(whole / group.size())
        };
        let dtype = tensor.dtype();
        let device = B::float_device(&tensor);
        let started = Instant::now();
        let values = read_f32::<B>(tensor, "a tensor-parallel exchange's tensor")?;
        let what = "tensor-parallel exchange";
        let (values, out_dims) = match self {
            TpExchange::Identity => unreachable!("returned above"),
            TpExchange::AllReduce => (group.all_reduce_sum(what, &values)?, dims.clone()),
            TpExchange::Split(dim) => {
                let chunk = chunked(dim, dims[dim])?;
                let mut out_dims = dims.clone();
                out_dims[dim] = chunk;
                (
                    chunk_of(&values, &dims, dim, group.index(), chunk),
                    out_dims,
                )
            }
            TpExchange::ReduceScatter(dim) => {
                let chunk = chunked(dim, dims[dim])?;
                let sum = group.all_reduce_sum(what, &values)?;
                let mut out_dims = dims.clone();
                out_dims[dim] = chunk;
                (chunk_of(&sum, &dims, dim, group.index(), chunk), out_dims)
            }
            TpExchange::AllGather(dim) => {
                chunked(dim, dims[dim] * group.size())?;
                let shards = group.gather(what, &values)?;
                let mut out_dims = dims.clone();
                out_dims[dim] *= group.size();
                (concat(&shards, &dims, dim), out_dims)
            }
        };
        increment_counter(
            names::TP_EXCHANGED_BYTES,
            (values.len() * size_of::<f32>()) as u64,
        );
        let out = B::float_from_data(TensorData::new(values, out_dims), &device);
        let out = if dtype == DType::F32 {
            out
        } else {
            B::float_cast(out, dtype.into())
        };
        record_time(names::TP_EXCHANGE_TIME, started.elapsed());
        Ok(out)
    }
}

/// The `index`-th chunk of `chunk` along `dim` of row-major `values` of `dims`.
fn chunk_of(values: &[f32], dims: &[usize], dim: usize, index: usize, chunk: usize) -> Vec<f32> {
    let outer: usize = dims[..dim].iter().product();
    let inner: usize = dims[dim + 1..].iter().product();
    let (whole, part) = (dims[dim] * inner, chunk * inner);
    (0..outer)
        .flat_map(|o| &values[o * whole + index * part..][..part])
        .copied()
        .collect()
}

/// The shards (each of `dims`) concatenated along `dim`, in order.
fn concat(shards: &[Vec<f32>], dims: &[usize], dim: usize) -> Vec<f32> {
    let outer: usize = dims[..dim].iter().product();
    let part: usize = dims[dim..].iter().product();
    (0..outer)
        .flat_map(|o| shards.iter().flat_map(move |s| &s[o * part..][..part]))
        .copied()
        .collect()
}
