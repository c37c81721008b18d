//! Statistics reduced across peers at `step()`, as TE reduces them over its tensor reduction group — but exactly:
//! every peer's merged buffers are gathered (burn-te's [`Peer`](burn_te::distributed::Peer), over
//! burn-collective) and merged in rank order with the statistics' own merge (counts and sums added, min/max
//! combined, the variance by Chan's formula), so a reduced `std` is the std of the concatenated batch and
//! `underflows%`, `overflows%` and `mse` come from summed counts and sums. Every peer of a group merges the same
//! records in the same order and logs the same values.
//!
//! Groups (TE's `set_tensor_reduction_group` and its tensor-parallel weight reduction):
//! - activations, gradients and outputs: all peers by default ("if the tensor reduction group is not specified,
//!   statistics are reduced across all nodes"); [`set_tensor_reduction_group`] changes it;
//! - weights: this peer alone by default — TE reduces them within the tensor-parallel group, and data-parallel
//!   peers hold the same weight; [`set_weight_reduction_group`] reduces them over peers that each hold a shard.
//!
//! With more than one peer every peer exchanges its records at every `step()` (one all-gather), whatever its
//! groups, so the peers' calls always match.

#[cfg(feature = "distributed")]
use std::collections::BTreeMap;

use crate::error::DebugError;
use crate::session::with_session;
use crate::stats::Partial;
#[cfg(feature = "distributed")]
use crate::tensor::TensorName;

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
    pub(crate) fn reduce(
        &self,
        partials: Vec<Partial>,
        iteration: u64,
    ) -> (Vec<Partial>, Option<DebugError>) {
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

/// Sets the peers whose activation, gradient and output statistics this thread's session merges with its own at
/// `step()` (TE's `debug_api.set_tensor_reduction_group`; default: every peer). Without a session: an error.
pub fn set_tensor_reduction_group(group: ReductionGroup) -> Result<(), DebugError> {
    with_session(|s| s.reduction_mut().tensors = group).ok_or(DebugError::NotInitialized)
}

/// Sets the peers whose weight statistics this thread's session merges with its own (TE reduces a weight within
/// its tensor-parallel group; default: this peer alone, as data-parallel peers hold the same weight). Without a
/// session: an error.
pub fn set_weight_reduction_group(group: ReductionGroup) -> Result<(), DebugError> {
    with_session(|s| s.reduction_mut().weights = group).ok_or(DebugError::NotInitialized)
}
