//! The host FP8 GEMM's autotune: per shape class, every path this CPU runs that takes the operands exactly is timed
//! on the GEMM itself, the paths in turn ([`timing_order`]: the likely winner last) for up to [`TIMED_ROUNDS`]
//! rounds (a path [`outpaced`] from the second round on, [`dropped_after`], is timed no further, and the rounds
//! stop when one path is left; a packed path [`outpaced_on_probe`] is timed only where no faster packed path takes
//! the operands), and the [`preferred`] path by their best runs (the first in instruction order within 10 % of the
//! fastest) is kept for that class for the rest of the process, as Burn keeps its matmul's choice (and as the
//! device GEMM's autotune does, [`crate::backends::cube`]). The timed runs are the call's own work: the GEMM's output is the
//! kept path's.
//!
//! One probe shape cannot stand for every GEMM: on a 2-core AMD EPYC Zen 3 the probe ([`super::probe()`], 256 × 1024 ×
//! 512) chose `f32`, which was 20 % slower than `avx2fma` on a TransformerLayer step's GEMMs at hidden 1024. GEMMs
//! below [`TUNED_MIN_PRODUCT`] multiply-adds (where timing is noise and the choice costs little) keep the probe's
//! choice, and so do GEMMs issued from rayon's workers (a grouped layer's small experts, run side by side) until
//! their class is tuned on another thread: a worker never times paths itself.
//!
//! The choices persist: [`super::tune_cache`] stores each on disk, and a later process on the same CPU takes it at
//! the class's first GEMM instead of timing the paths again.
//!
//! The key anchors the batch, M, K and N to powers of two (as Burn's matmul key does) and carries what decides
//! which paths can take the operands (element formats, block scales, transposition).

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use burn_te_kernels::ScaleBlock;
use burn_te_kernels::host::gemm::HostGemmPath;

use super::operand::HostOperand;
use super::probe::{preferred, probe};
use super::run::{host_fp8_gemm_asking, run_on};
use super::tune_cache::{HOST_GEMM_TUNINGS_CACHED, StoredChoice, cached_choice, store_choice};
use crate::metrics;
use crate::primitive::ElementFormat;

/// GEMMs with fewer multiply-adds (`batch · M · K · N`) take the probe's path untuned: 256³.
pub const TUNED_MIN_PRODUCT: usize = 1 << 24;

/// Rounds of timed runs, one run of each candidate per round (the first warms the caches and the pool's buffers).
pub const TIMED_ROUNDS: usize = 5;

/// After two rounds, no further round once the tuning has taken this long (a large GEMM's runs vary little).
const ROUNDS_BUDGET: Duration = Duration::from_millis(500);

/// From the second round on ([`RUNS_BEFORE_DROP`]), a candidate whose best run is more than this many times the
/// fastest one's is timed no further: to be kept it would have to come within
/// [`super::probe::PREFERENCE_MARGIN`] of the fastest, i.e. run over a quarter faster than its own best so far. Runs
/// slowed by cold caches and fresh buffers can still drop a path that would have run faster; on Zen 4 a class's
/// first runs were at most 1.64× its best, which keeps the path then kept within 1.64 / 1.5 <
/// [`super::probe::PREFERENCE_MARGIN`] of the dropped one: the margin the choice allows anyway.
pub const OUTPACED_FACTOR: f64 = 1.5;

/// Runs of every candidate before one can be dropped as [`outpaced`] ([`dropped_after`]).
pub const RUNS_BEFORE_DROP: usize = 2;

/// The metrics report's counter of shape classes tuned (`HostFp8GemmTunings`).
pub const HOST_GEMM_TUNINGS: &str = "HostFp8GemmTunings";

/// One tuned shape class: what was timed and what was kept.
#[derive(Clone, Debug, PartialEq)]
pub struct HostGemmTuning {
    /// `(batch, M, K, N)` of the GEMM that tuned it.
    pub dims: [usize; 4],
    /// The class: each of `dims` rounded up to a power of two.
    pub anchored: [usize; 4],
    /// Whether the GEMM reads each operand transposed (part of the class).
    pub transposed: (bool, bool),
    /// Each candidate's best run (paths that could not take the operands exactly are left out; a path
    /// [`outpaced`] after a round ran no more), fastest instruction first.
    pub times: Vec<(HostGemmPath, Duration)>,
    /// Packed paths not timed: [`outpaced_on_probe`], and a packed path that outpaced them took the operands.
    pub skipped: Vec<HostGemmPath>,
    /// The [`preferred`] path, kept for every GEMM of the class.
    pub chosen: HostGemmPath,
    /// Whether the choice came from the cache on disk ([`super::tune_cache`]), made by an earlier process.
    pub cached: bool,
}

/// `1x1024x512x2048 (lhs_t false, rhs_t true): avx2fma (avx2fma 19.54 ms, f32 19.21 ms)`: the GEMM that tuned the
/// class, what it kept, and each candidate's best run.
impl std::fmt::Display for HostGemmTuning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [batch, m, k, n] = self.dims;
        let (lhs_t, rhs_t) = self.transposed;
        write!(
            f,
            "{batch}x{m}x{k}x{n} (lhs_t {lhs_t}, rhs_t {rhs_t}): {} (",
            self.chosen
        )?;
        for (i, (path, time)) in self.times.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{path} {:.2} ms", time.as_secs_f64() * 1e3)?;
        }
        for path in &self.skipped {
            write!(f, ", {path} outpaced on the probe")?;
        }
        f.write_str(if self.cached { ", cached)" } else { ")" })
    }
}

/// What a kept choice is keyed by.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct TuneKey {
    anchored: [usize; 4],
    transposed: (bool, bool),
    formats: (ElementFormat, ElementFormat),
    blocks: (Option<ScaleBlock>, Option<ScaleBlock>),
}

impl TuneKey {
    /// The key in the cache on disk.
    fn stored(&self) -> String {
        format!("{self:?}")
    }
}

fn tunings() -> &'static Mutex<HashMap<TuneKey, HostGemmTuning>> {
    static TUNINGS: OnceLock<Mutex<HashMap<TuneKey, HostGemmTuning>>> = OnceLock::new();
    TUNINGS.get_or_init(Default::default)
}

/// Every shape class tuned so far in this process, smallest first.
pub fn host_gemm_tunings() -> Vec<HostGemmTuning> {
    let mut all: Vec<HostGemmTuning> = tunings()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .values()
        .cloned()
        .collect();
    all.sort_by_key(|tuning| (tuning.anchored, tuning.transposed, tuning.dims));
    all
}

/// Where `run_tuned` sends a GEMM: the probe's path, its class's kept path, or a tuning of its class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TunedRoute {
    /// The probe's path: a GEMM under [`TUNED_MIN_PRODUCT`], or a rayon worker's GEMM of a class not yet tuned.
    Probe,
    /// The path its class keeps, on any thread.
    Kept(HostGemmPath),
    /// Time the paths on this GEMM and keep one for its class (never on a rayon worker: its siblings' GEMMs would
    /// run beside the timed ones).
    Tune,
}

/// The route of a GEMM of `product` multiply-adds whose class keeps `kept` (`None`: not tuned yet), issued on one
/// of rayon's workers or not.
pub fn tuned_route(product: usize, kept: Option<HostGemmPath>, on_worker: bool) -> TunedRoute {
    match kept {
        _ if product < TUNED_MIN_PRODUCT => TunedRoute::Probe,
        Some(path) => TunedRoute::Kept(path),
        None if on_worker => TunedRoute::Probe,
        None => TunedRoute::Tune,
    }
}

/// `out[b] = lhs[b] · rhs[b] (+ bias)` on the path kept for its shape class, tuning the class at its first GEMM;
/// the probe's path for GEMMs too small to tune, and for a class not yet tuned when a rayon worker issues it.
/// Returns the path that ran (f32 where the kept path cannot take these operands exactly, recorded as a fallback).
pub(super) fn run_tuned(
    lhs: &HostOperand<'_>,
    rhs: &HostOperand<'_>,
    dims: (usize, usize, usize),
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) -> HostGemmPath {
    let (m, n, k) = dims;
    let batch = lhs.dims.0.max(rhs.dims.0);
    let product = [batch, m, k, n]
        .into_iter()
        .fold(1usize, usize::saturating_mul);
    let paths = HostGemmPath::available_paths();
    if let [only] = paths[..] {
        // Nothing to choose from (a CPU without the packed paths' instructions).
        return host_fp8_gemm_asking(only, lhs, rhs, dims, bias, out);
    }
    let key = TuneKey {
        anchored: [batch, m, k, n].map(usize::next_power_of_two),
        transposed: (lhs.transposed, rhs.transposed),
        formats: (lhs.format, rhs.format),
        blocks: (lhs.block, rhs.block),
    };
    let kept_now = (product >= TUNED_MIN_PRODUCT).then(|| kept(&key)).flatten();
    let on_worker = rayon::current_thread_index().is_some();
    match tuned_route(product, kept_now, on_worker) {
        TunedRoute::Probe => {
            return host_fp8_gemm_asking(probe().chosen, lhs, rhs, dims, bias, out);
        }
        TunedRoute::Kept(path) => return host_fp8_gemm_asking(path, lhs, rhs, dims, bias, out),
        TunedRoute::Tune => {}
    }
    // One tuning at a time in the process (ranks on threads of one process share the pool): the others wait, then
    // take what it kept.
    static TUNING: Mutex<()> = Mutex::new(());
    let _tuning = TUNING.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(path) = kept(&key) {
        return host_fp8_gemm_asking(path, lhs, rhs, dims, bias, out);
    }
    let tuning = tune(
        paths,
        (lhs, rhs),
        dims,
        bias,
        out,
        [batch, m, k, n],
        key.anchored,
    );
    let chosen = tuning.chosen;
    store_choice(
        &key.stored(),
        StoredChoice::new(tuning.dims, &tuning.times, &tuning.skipped, chosen),
    );
    tunings()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(key, tuning);
    chosen
}

/// The path kept for `key`'s class: tuned earlier in this process, or taken from the cache on disk at the class's
/// first GEMM (counted under [`HOST_GEMM_TUNINGS_CACHED`]).
fn kept(key: &TuneKey) -> Option<HostGemmPath> {
    let mut tunings = tunings().lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(tuning) = tunings.get(key) {
        return Some(tuning.chosen);
    }
    let choice = cached_choice(&key.stored())?;
    metrics::increment_counter(HOST_GEMM_TUNINGS_CACHED, 1);
    let [batch, m, k, n] = choice.dims;
    tracing::info!(
        "host FP8 GEMM autotune, batch {batch} x {m}x{k}x{n} (lhs_t {}, rhs_t {}): {} (cached)",
        key.transposed.0,
        key.transposed.1,
        choice.chosen
    );
    tunings.insert(
        key.clone(),
        HostGemmTuning {
            dims: choice.dims,
            anchored: key.anchored,
            transposed: key.transposed,
            times: choice.times,
            skipped: choice.skipped,
            chosen: choice.chosen,
            cached: true,
        },
    );
    Some(choice.chosen)
}

/// Whether a candidate whose best run took `best` is out of the running: more than [`OUTPACED_FACTOR`] times the
/// `fastest` candidate's best run.
pub fn outpaced(best: Duration, fastest: Duration) -> bool {
    best.as_secs_f64() > fastest.as_secs_f64() * OUTPACED_FACTOR
}

/// Whether the autotune stops timing a candidate after `runs` runs each: once every candidate has run
/// [`RUNS_BEFORE_DROP`] times, if it is [`outpaced`]. One run decides nothing: a run that another process or a
/// page-faulting first use slowed tenfold (seen while the test suite ran beside it: `avx512bf16` at 239 ms against
/// its 3–10 ms) would otherwise drop the fastest path, and the choice would be cached on disk.
pub fn dropped_after(runs: usize, best: Duration, fastest: Duration) -> bool {
    runs >= RUNS_BEFORE_DROP && outpaced(best, fastest)
}

/// The packed paths (every path but `f32`) that the probe's `times` show [`outpaced`] by the fastest packed path.
/// The packed paths share their packing and blocking and differ in the instruction that multiplies, so the probe's
/// ratio between two of them holds for every shape the autotune sees (on Zen 4: `vdpbf16ps` at twice the FMA rate);
/// `f32`, another library's GEMM that wins on some shapes, is timed on each class whatever the probe saw.
pub fn outpaced_on_probe(times: &[(HostGemmPath, Duration)]) -> Vec<HostGemmPath> {
    let packed = || times.iter().filter(|(path, _)| *path != HostGemmPath::F32);
    let Some(fastest) = packed().map(|&(_, time)| time).min() else {
        return vec![];
    };
    packed()
        .filter(|&&(_, time)| outpaced(time, fastest))
        .map(|&(path, _)| path)
        .collect()
}

/// The order in which a round times the candidates (indices into `times`): those not yet run first, slowest first
/// by the probe's times (a path the probe did not time before them), then the others slowest first by their best
/// run on the class. The likely winner runs last, so its output is the one left and the kept path needs no run
/// after the rounds.
pub fn timing_order(
    times: &[(HostGemmPath, Duration)],
    probed: &[(HostGemmPath, Duration)],
) -> Vec<usize> {
    let expected = |&(path, best): &(HostGemmPath, Duration)| {
        if best != Duration::MAX {
            (true, best)
        } else {
            let probed = probed.iter().find(|(p, _)| *p == path);
            (false, probed.map_or(Duration::MAX, |&(_, time)| time))
        }
    };
    let mut order: Vec<usize> = (0..times.len()).collect();
    order.sort_by_key(|&i| {
        let (ran, time) = expected(&times[i]);
        (ran, std::cmp::Reverse(time))
    });
    order
}

/// Times every candidate of `paths` on the GEMM and leaves the [`preferred`] one's output in `out`. Packed paths
/// [`outpaced_on_probe`] wait: they are timed only where no other packed path takes the operands exactly (a block
/// scale bf16 does not hold), so that on Zen 4 a class's first GEMM runs on the FMA paths not at all.
fn tune(
    paths: Vec<HostGemmPath>,
    (lhs, rhs): (&HostOperand<'_>, &HostOperand<'_>),
    dims: (usize, usize, usize),
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
    bmkn: [usize; 4],
    anchored: [usize; 4],
) -> HostGemmTuning {
    let mut times: Vec<(HostGemmPath, Duration)> = paths
        .into_iter()
        .map(|path| (path, Duration::MAX))
        .collect();
    // Whether each candidate is still timed; the paths the probe saw outpaced wait.
    let waiting = outpaced_on_probe(&probe().times);
    let mut racing: Vec<bool> = times
        .iter()
        .map(|(path, _)| !waiting.contains(path))
        .collect();
    let started = Instant::now();
    let mut last = None;
    for round in 0..TIMED_ROUNDS {
        let left = racing.iter().filter(|&&on| on).count();
        if left <= 1 || (round >= 2 && started.elapsed() > ROUNDS_BUDGET) {
            break;
        }
        for i in timing_order(&times, &probe().times) {
            let ((path, best), on) = (&mut times[i], &mut racing[i]);
            if !*on {
                continue;
            }
            let start = Instant::now();
            if run_on(*path, lhs, rhs, dims, bias, out).is_ok() {
                *best = (*best).min(start.elapsed());
                last = Some(*path);
            } else {
                // A path that cannot take the operands exactly (a block scale bf16 does not hold) fails in the
                // first round, without a fallback recorded: it is no candidate, and no time is kept for it.
                *on = false;
            }
        }
        let fastest = times.iter().map(|&(_, best)| best).min();
        for ((_, best), on) in times.iter().zip(&mut racing) {
            *on &= !fastest.is_some_and(|fastest| dropped_after(round + 1, *best, fastest));
        }
        // No packed path took the operands: the waiting ones are timed from the next round.
        let packed_ran = times
            .iter()
            .any(|&(path, best)| path != HostGemmPath::F32 && best != Duration::MAX);
        if round == 0 && !packed_ran {
            for ((path, _), on) in times.iter().zip(&mut racing) {
                *on |= waiting.contains(path);
            }
        }
    }
    let skipped: Vec<HostGemmPath> = times
        .iter()
        .filter(|&&(path, best)| best == Duration::MAX && waiting.contains(&path))
        .map(|&(path, _)| path)
        .collect();
    times.retain(|&(_, best)| best != Duration::MAX);
    // `f32` takes any operands, so a candidate always remains.
    let chosen = preferred(&times);
    if last != Some(chosen) {
        host_fp8_gemm_asking(chosen, lhs, rhs, dims, bias, out);
    }
    let listed: Vec<String> = times
        .iter()
        .map(|(path, time)| format!("{path} {:.3} ms", time.as_secs_f64() * 1e3))
        .chain(
            skipped
                .iter()
                .map(|path| format!("{path} outpaced on the probe")),
        )
        .collect();
    let [batch, m, k, n] = bmkn;
    tracing::info!(
        "host FP8 GEMM autotune, batch {batch} x {m}x{k}x{n} (lhs_t {}, rhs_t {}): {chosen} ({})",
        lhs.transposed,
        rhs.transposed,
        listed.join(", ")
    );
    metrics::increment_counter(HOST_GEMM_TUNINGS, 1);
    HostGemmTuning {
        dims: bmkn,
        anchored,
        transposed: (lhs.transposed, rhs.transposed),
        times,
        skipped,
        chosen,
        cached: false,
    }
}
