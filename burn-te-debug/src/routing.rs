//! Routing answers: whether a feature's call is on at an iteration, and when it may be next.

/// A routing answer: whether the call is on at this iteration, and the next iteration at which it may be
/// (`None`: never again). A layer whose answers are all off skips the debug path until the smallest `next`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routing {
    /// On at this iteration.
    pub enabled: bool,
    /// The next iteration at which it may be on.
    pub next: Option<u64>,
}

impl Routing {
    /// On now and at every later iteration.
    pub fn always(enabled: bool, iteration: u64) -> Routing {
        Routing {
            enabled,
            next: Some(iteration + 1),
        }
    }
}

/// Combines routing answers as TE does: any enabled, smallest next iteration; `None` if nobody answered.
pub fn merge_routing(answers: impl IntoIterator<Item = Routing>) -> Option<Routing> {
    answers.into_iter().fold(None, |acc, r| {
        Some(match acc {
            None => r,
            Some(a) => Routing {
                enabled: a.enabled || r.enabled,
                next: match (a.next, r.next) {
                    (Some(x), Some(y)) => Some(x.min(y)),
                    (x, y) => x.or(y),
                },
            },
        })
    })
}
