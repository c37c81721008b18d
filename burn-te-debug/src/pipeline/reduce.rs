//! Reduce: the statistics of a step. In: statistics launched on the device during the step ([`StatBuffers`]); out,
//! at `step()`: the values to log ([`StepStats`]), each buffer's feeds read and merged across micro-batches, then
//! across peers.
//!
//! One buffer per (layer, tensor, source): micro-batches of a step merge exactly ([`Fp8Stats::merge`], Chan's
//! formula for the variance); a weight is taken from its first feed of the step only, as in TE.
//!
//! Across peers, as TE reduces them over its tensor reduction group — but exactly: every peer's merged buffers
//! are gathered (burn-te's [`Peer`](burn_te::distributed::Peer), over burn-collective) and merged in rank order
//! with the statistics' own merge (counts and sums added, min/max combined, the variance by Chan's formula), so a
//! reduced `std` is the std of the concatenated batch and `underflows%`, `overflows%` and `mse` come from summed
//! counts and sums. Every peer of a group merges the same records in the same order and logs the same values.
//!
//! Groups (TE's `set_tensor_reduction_group` and its tensor-parallel weight reduction):
//! - activations, gradients and outputs: all peers by default ("if the tensor reduction group is not specified,
//!   statistics are reduced across all nodes"); [`set_tensor_reduction_group`](crate::set_tensor_reduction_group)
//!   changes it;
//! - weights: this peer alone by default — TE reduces them within the tensor-parallel group, and data-parallel
//!   peers hold the same weight; [`set_weight_reduction_group`](crate::set_weight_reduction_group) reduces them
//!   over peers that each hold a shard.
//!
//! With more than one peer every peer exchanges its records at every `step()` (one all-gather), whatever its
//! groups, so the peers' calls always match.

use std::collections::BTreeMap;

use burn_te::{Fp8Stats, TensorStats};

use crate::error::DebugError;
use crate::feature::DebugTensor;
use crate::stats::{PendingStats, PendingValue, Stat, StatRequest, StatValue};
use crate::tensor::TensorName;

#[derive(Default)]
struct Buffer {
    stats: Vec<Stat>,
    pending: Vec<PendingStats>,
    /// Stats with their own kernel (max over feeds).
    values: Vec<(Stat, PendingValue)>,
    /// Per feed of a GEMM output: the statistics of its high-precision reference and of the difference.
    errors: Vec<(PendingStats, PendingStats)>,
}

/// The stat buffers of one step.
#[derive(Default)]
pub(crate) struct StatBuffers {
    /// Keyed by (layer, tensor, prefix, suffix).
    buffers: BTreeMap<(String, TensorName, String, String), Buffer>,
    scalars: Vec<(String, f64)>,
}

impl StatBuffers {
    /// Whether a weight's stats of this request's source were already taken this step.
    pub(crate) fn has(&self, layer: &str, tensor: TensorName, request: &StatRequest) -> bool {
        self.buffers
            .contains_key(&Self::key(layer, tensor, request))
    }

    fn key(
        layer: &str,
        tensor: TensorName,
        request: &StatRequest,
    ) -> (String, TensorName, String, String) {
        (
            layer.to_string(),
            tensor,
            request.prefix.clone(),
            request.suffix.clone(),
        )
    }

    fn buffer(&mut self, layer: &str, tensor: TensorName, request: &StatRequest) -> &mut Buffer {
        let buffer = self
            .buffers
            .entry(Self::key(layer, tensor, request))
            .or_default();
        for stat in &request.stats {
            if !buffer.stats.contains(stat) {
                buffer.stats.push(*stat);
            }
        }
        buffer
    }

    /// Launches one request's statistics of a tensor: the one-pass kernel, and the blockwise ranges' kernels.
    pub(crate) fn launch(
        &mut self,
        layer: &str,
        tensor: TensorName,
        request: &StatRequest,
        x: &dyn DebugTensor,
    ) -> Result<(), DebugError> {
        self.add(
            layer,
            tensor,
            request,
            x.launch_stats(request.quantization)?,
        );
        for &stat in &request.stats {
            if let Stat::MaxBlockwiseDynamicRange(range) = stat {
                for block in range.blocks() {
                    let pending = x.launch_max_block_dynamic_range(block)?;
                    self.add_value(layer, tensor, request, stat, pending);
                }
            }
        }
        Ok(())
    }

    /// Buffers one feed's statistics for `request`.
    fn add(
        &mut self,
        layer: &str,
        tensor: TensorName,
        request: &StatRequest,
        pending: PendingStats,
    ) {
        self.buffer(layer, tensor, request).pending.push(pending);
    }

    /// Buffers one feed's value of a stat with its own kernel (feeds combine by max).
    fn add_value(
        &mut self,
        layer: &str,
        tensor: TensorName,
        request: &StatRequest,
        stat: Stat,
        pending: PendingValue,
    ) {
        self.buffer(layer, tensor, request)
            .values
            .push((stat, pending));
    }

    /// Buffers one feed's error statistics of a GEMM output: its reference's and the difference's (feeds merge
    /// exactly, as sums of squares and maxima).
    pub(crate) fn add_error(
        &mut self,
        layer: &str,
        tensor: TensorName,
        request: &StatRequest,
        reference: PendingStats,
        difference: PendingStats,
    ) {
        self.buffer(layer, tensor, request)
            .errors
            .push((reference, difference));
    }

    pub(crate) fn add_scalar(&mut self, name: String, value: f64) {
        self.scalars.push((name, value));
    }

    /// Ends the step: its statistics read, merged across micro-batches and reduced across peers by `reduction`.
    pub(crate) fn take(&mut self, reduction: &Reduction, iteration: u64) -> StepStats {
        let (partials, unread) = self.read();
        let (partials, reduction) = reduction.reduce(partials, iteration);
        StepStats {
            values: self.values(partials),
            unread,
            reduction,
        }
    }

    /// Reads every buffer and merges its feeds; read errors are returned beside what could be read.
    fn read(&mut self) -> (Vec<Partial>, Vec<String>) {
        let mut partials = Vec::new();
        let mut errors = Vec::new();
        for ((layer, tensor, prefix, suffix), buffer) in std::mem::take(&mut self.buffers) {
            let mut merged = Fp8Stats::EMPTY;
            for pending in buffer.pending {
                match pending.read() {
                    Ok(stats) => merged = merged.merge(&stats),
                    Err(err) => errors.push(format!("{layer}_{tensor}: {err}")),
                }
            }
            let mut partial = Partial {
                layer,
                tensor,
                prefix,
                suffix,
                stats: buffer.stats,
                merged,
                maxima: BTreeMap::new(),
                reference: TensorStats::EMPTY,
                difference: TensorStats::EMPTY,
            };
            for (reference, difference) in buffer.errors {
                match (reference.read(), difference.read()) {
                    (Ok(reference), Ok(difference)) => {
                        partial.reference = partial.reference.merge(&reference.tensor);
                        partial.difference = partial.difference.merge(&difference.tensor);
                    }
                    (Err(err), _) | (_, Err(err)) => {
                        errors.push(format!("{}_{}: {err}", partial.layer, partial.tensor))
                    }
                }
            }
            for (stat, pending) in buffer.values {
                match pending.read() {
                    Ok(value) => partial.max_in(stat, value),
                    Err(err) => errors.push(format!("{}_{}: {err}", partial.layer, partial.tensor)),
                }
            }
            partials.push(partial);
        }
        (partials, errors)
    }

    /// The values to log from merged buffers (in (layer, tensor, stat) order), then the custom scalars.
    fn values(&mut self, partials: Vec<Partial>) -> Vec<StatValue> {
        let mut values = Vec::new();
        for partial in partials {
            for &stat in &partial.stats {
                let value = match stat {
                    stat if stat.is_error() => {
                        stat.error_value(&partial.reference, &partial.difference)
                    }
                    // TE skips empty tensors.
                    _ if partial.merged.tensor.numel == 0 => None,
                    Stat::MaxBlockwiseDynamicRange(_) => partial.maxima.get(&stat).copied(),
                    stat => stat.value(&partial.merged),
                };
                if let Some(value) = value {
                    let stat = stat.logged_name(&partial.prefix, &partial.suffix);
                    values.push(StatValue {
                        name: format!("{}_{}_{stat}", partial.layer, partial.tensor),
                        layer: partial.layer.clone(),
                        tensor: Some(partial.tensor),
                        stat,
                        value,
                    });
                }
            }
        }
        for (name, value) in std::mem::take(&mut self.scalars) {
            values.push(StatValue {
                layer: String::new(),
                tensor: None,
                stat: name.clone(),
                name,
                value,
            });
        }
        values
    }
}

/// A step's statistics, as [`StatBuffers::take`] ends it.
pub(crate) struct StepStats {
    /// The values to log.
    pub(crate) values: Vec<StatValue>,
    /// The buffers that could not be read: `<layer>_<tensor>: <error>`.
    pub(crate) unread: Vec<String>,
    /// The reduction across peers, if it failed (the values are this peer's own).
    pub(crate) reduction: Option<DebugError>,
}

/// One buffer's statistics of a step, its feeds merged: what peers exchange and merge at `step()`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Partial {
    pub layer: String,
    pub tensor: TensorName,
    pub prefix: String,
    pub suffix: String,
    /// The stats to log.
    pub stats: Vec<Stat>,
    /// The feeds' statistics, merged exactly.
    pub merged: Fp8Stats,
    /// Stats with their own kernel: the maximum over feeds.
    pub maxima: BTreeMap<Stat, f64>,
    /// A GEMM output's high-precision reference, merged over feeds (the error stats).
    pub reference: TensorStats,
    /// The output minus its reference, merged over feeds.
    pub difference: TensorStats,
}

impl Partial {
    #[cfg(feature = "distributed")]
    /// The key the same buffer has on every peer.
    pub fn key(&self) -> (&str, TensorName, &str, &str) {
        (&self.layer, self.tensor, &self.prefix, &self.suffix)
    }

    /// Takes `value` into the maximum of `stat`, NaN propagating (a NaN block anywhere is worth seeing).
    fn max_in(&mut self, stat: Stat, value: f64) {
        let max = self.maxima.entry(stat).or_insert(value);
        if value.is_nan() || *max < value {
            *max = value;
        }
    }

    #[cfg(feature = "distributed")]
    /// This buffer merged with the same buffer of another peer (or micro-batch): statistics by [`Fp8Stats::merge`],
    /// maxima by max, the stats to log united.
    pub fn merge(&mut self, other: &Partial) {
        self.merged = self.merged.merge(&other.merged);
        self.reference = self.reference.merge(&other.reference);
        self.difference = self.difference.merge(&other.difference);
        for (&stat, &value) in &other.maxima {
            self.max_in(stat, value);
        }
        for stat in &other.stats {
            if !self.stats.contains(stat) {
                self.stats.push(*stat);
            }
        }
    }
}

/// The peers whose statistics a peer merges with its own.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum ReductionGroup {
    /// Every peer.
    #[default]
    All,
    /// These ranks (this peer is always included).
    Ranks(Vec<usize>),
    /// This peer alone (TE's `None`: unreduced statistics).
    Alone,
}

#[cfg(feature = "distributed")]
impl ReductionGroup {
    fn contains(&self, rank: usize, own: usize) -> bool {
        rank == own
            || match self {
                ReductionGroup::All => true,
                ReductionGroup::Ranks(ranks) => ranks.contains(&rank),
                ReductionGroup::Alone => false,
            }
    }
}

/// A session's reduction settings.
pub(crate) struct Reduction {
    #[cfg(feature = "distributed")]
    peer: Option<burn_te::distributed::Peer>,
    tensors: ReductionGroup,
    weights: ReductionGroup,
}

impl Reduction {
    /// Sets the group of the activation, gradient and output statistics.
    pub(crate) fn set_tensor_group(&mut self, group: ReductionGroup) {
        self.tensors = group;
    }

    /// Sets the group of the weight statistics.
    pub(crate) fn set_weight_group(&mut self, group: ReductionGroup) {
        self.weights = group;
    }

    /// The settings of a session started on this thread: its bound peer, TE's default groups.
    pub(crate) fn for_this_thread() -> Self {
        Reduction {
            #[cfg(feature = "distributed")]
            peer: burn_te::distributed::current().filter(|peer| peer.world_size() > 1),
            tensors: ReductionGroup::All,
            weights: ReductionGroup::Alone,
        }
    }

    #[cfg(feature = "distributed")]
    fn group(&self, tensor: TensorName) -> &ReductionGroup {
        match tensor {
            TensorName::Weight => &self.weights,
            _ => &self.tensors,
        }
    }

    /// The step's merged buffers reduced over the groups; on failure, this peer's own with the error.
    #[cfg_attr(not(feature = "distributed"), allow(unused_variables))]
    fn reduce(&self, partials: Vec<Partial>, iteration: u64) -> (Vec<Partial>, Option<DebugError>) {
        #[cfg(feature = "distributed")]
        if let Some(peer) = &self.peer {
            return match self.exchange(peer, &partials) {
                Ok(reduced) => (reduced, None),
                Err(reason) => (partials, Some(DebugError::Reduction { iteration, reason })),
            };
        }
        (partials, None)
    }

    #[cfg(feature = "distributed")]
    fn exchange(
        &self,
        peer: &burn_te::distributed::Peer,
        partials: &[Partial],
    ) -> Result<Vec<Partial>, String> {
        let bytes = rmp_serde::to_vec(partials).map_err(|err| err.to_string())?;
        let gathered = peer
            .all_gather_bytes(&bytes)
            .map_err(|err| err.to_string())?;
        let mut all = Vec::with_capacity(gathered.len());
        for (rank, bytes) in gathered.iter().enumerate() {
            let theirs: Vec<Partial> = rmp_serde::from_slice(bytes)
                .map_err(|err| format!("the statistics of peer {rank} do not decode: {err}"))?;
            all.push(theirs);
        }
        Ok(self.merge(peer.rank(), all))
    }

    #[cfg(feature = "distributed")]
    /// Merges the records of every rank (`by_rank[r]`) that this peer's groups hold, in rank order.
    fn merge(&self, own: usize, by_rank: Vec<Vec<Partial>>) -> Vec<Partial> {
        let mut merged: BTreeMap<(String, TensorName, String, String), Partial> = BTreeMap::new();
        for (rank, partials) in by_rank.into_iter().enumerate() {
            for partial in partials {
                if !self.group(partial.tensor).contains(rank, own) {
                    continue;
                }
                let (layer, tensor, prefix, suffix) = partial.key();
                let key = (
                    layer.to_string(),
                    tensor,
                    prefix.to_string(),
                    suffix.to_string(),
                );
                match merged.get_mut(&key) {
                    Some(into) => into.merge(&partial),
                    None => {
                        merged.insert(key, partial);
                    }
                }
            }
        }
        merged.into_values().collect()
    }
}
