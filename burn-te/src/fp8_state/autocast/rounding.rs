//! The stochastic-rounding stream: where NVFP4's stochastic rounding takes its random bits.
//!
//! TE draws them from torch's generator, so `torch.manual_seed` makes a run reproducible. Here each thread keeps a
//! seed and a count of its iterations (outermost autocast scopes) since the seed was set; a GEMM's bits are a hash
//! of that pair with its layer, GEMM and tensor role. [`seed_stochastic_rounding`] sets the seed, and `Backend::seed`
//! on a `Te` or `Debug` backend calls it: a run that seeds its backend draws the same bits whatever ran before it in
//! the process. A thread starts from the seed last set in the process (0 before any), so threads spawned after
//! seeding (data-parallel ranks) follow it too, each counting its own iterations.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// The seed last set by [`seed_stochastic_rounding`], for threads that start after it.
static SEED: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's `(seed, iterations since it was set)`.
    static STREAM: Cell<(u64, u64)> = Cell::new((SEED.load(Ordering::Relaxed), 0));
}

/// Seeds the stochastic rounding of this thread and of threads started after this call: the next iteration
/// (outermost autocast scope) on this thread draws the bits of iteration 1 of `seed`.
pub fn seed_stochastic_rounding(seed: u64) {
    SEED.store(seed, Ordering::Relaxed);
    STREAM.with(|s| s.set((seed, 0)));
}

/// Counts a new iteration on this thread (an outermost scope begins).
pub(super) fn next_iteration() {
    STREAM.with(|s| {
        let (seed, iterations) = s.get();
        s.set((seed, iterations + 1));
    });
}

/// The current iteration's draw on this thread: a hash of the seed and the iteration, taken by each GEMM site
/// (see [`GemmSite::rounding`](crate::GemmSite::rounding)).
pub(crate) fn rounding_draw() -> u64 {
    crate::hash::hash_of(&STREAM.with(Cell::get))
}
