//! When a logging feature runs: TE's `freq`, `start_step`, `end_step` and `start_end_list`.

use crate::routing::{Routing, merge_routing};

/// A feature's schedule. It runs at iteration `i` iff `i % freq == 0` and `start <= i <= end` for one of its
/// ranges — both ends inclusive, as Transformer Engine does, and `freq` counts from 0, not from the start.
/// `end_step: -1` means no end, as TE documents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Run every `freq` iterations.
    pub freq: u64,
    /// Inclusive `(start, end)` ranges; `end = u64::MAX` for no end.
    pub ranges: Vec<(u64, u64)>,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule {
            freq: 1,
            ranges: vec![(0, u64::MAX)],
        }
    }
}

impl Schedule {
    /// Whether the feature runs at `iteration`.
    pub fn runs_at(&self, iteration: u64) -> bool {
        iteration.is_multiple_of(self.freq)
            && self
                .ranges
                .iter()
                .any(|&(s, e)| s <= iteration && iteration <= e)
    }

    /// The routing answer of several schedules at `iteration`: on if any runs, next at the earliest (`None` if
    /// there are none).
    pub fn routing<'a>(
        schedules: impl IntoIterator<Item = &'a Schedule>,
        iteration: u64,
    ) -> Option<Routing> {
        merge_routing(schedules.into_iter().map(|s| Routing {
            enabled: s.runs_at(iteration),
            next: s.next_after(iteration),
        }))
    }

    /// The first iteration after `iteration` at which the feature runs, if any.
    pub fn next_after(&self, iteration: u64) -> Option<u64> {
        self.ranges
            .iter()
            .filter_map(|&(s, e)| {
                let from = s.max(iteration.checked_add(1)?);
                let candidate = from.div_ceil(self.freq).checked_mul(self.freq)?;
                (candidate <= e).then_some(candidate)
            })
            .min()
    }
}
