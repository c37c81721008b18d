//! The probe: one GEMM shape timed on every path this CPU runs, once per process at the first host FP8 GEMM that
//! is not forced. Its choice is the path of GEMMs too small for the autotune to tune per shape class, and the path
//! that `requested_host_gemm_path` names.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use burn_te_kernels::Fp8Format;
use burn_te_kernels::host::gemm::HostGemmPath;

use super::operand::HostOperand;
use super::run::run_on;
use super::tune_cache::{StoredChoice, cached_choice, store_choice};
use crate::metrics;
use crate::primitive::ElementFormat;

/// The metrics report's time prefix of the probe's measurement per path (`HostGemmProbe(avx2fma)`).
pub const HOST_GEMM_PROBE: &str = "HostGemmProbe";

/// The metrics report's time prefix of the probe's times taken from the cache on disk, as an earlier process
/// measured them (`HostGemmProbeCached(avx2fma)`).
pub const HOST_GEMM_PROBE_CACHED: &str = "HostGemmProbeCached";

/// What the probe measured: each available path's best time on the probe GEMM, and the path chosen ([`preferred`]).
#[derive(Clone, Debug)]
pub struct HostGemmProbe {
    /// `(path, best time)` of every path this CPU runs, fastest instruction first.
    pub times: Vec<(HostGemmPath, Duration)>,
    /// The first path within [`PREFERENCE_MARGIN`] of the fastest ([`preferred`]).
    pub chosen: HostGemmPath,
    /// Whether the probe came from the cache on disk ([`super::tune_cache`]), measured by an earlier process.
    pub cached: bool,
}

/// The probe GEMM: `M × K · K × N`, a layer's fprop of E4M3 codes with per-tensor scales.
pub const PROBE_SHAPE: (usize, usize, usize) = (256, 1024, 512);

/// Rounds of the probe GEMM, each running every path once (the best time per path counts; the first round warms
/// caches and buffers).
const PROBE_RUNS: usize = 5;

/// The probe, run once per process at the first host FP8 GEMM that is not forced (a few ms per path; taken from
/// the cache on disk, [`super::tune_cache`], where an earlier process on this CPU stored it): each path
/// this CPU runs takes the same GEMM ([`PROBE_SHAPE`]) in `PROBE_RUNS` rounds of every path in turn on rayon's
/// pool, and the [`preferred`] path by their best times wins. The paths' accumulation orders differ, so the choice
/// also decides a run's last bits: `BURN_TE_HOST_GEMM` pins it where runs must repeat bit for bit across machines
/// or loads. Logged at `info`, and its times recorded in the metrics report (`HostGemmProbe(<path>)`, or
/// `HostGemmProbeCached(<path>)` where they come from the cache).
pub fn probe() -> &'static HostGemmProbe {
    static PROBE: OnceLock<HostGemmProbe> = OnceLock::new();
    PROBE.get_or_init(|| {
        let (m, k, n) = PROBE_SHAPE;
        let key = format!("probe {m}x{k}x{n}");
        if let Some(choice) = cached_choice(&key) {
            record_times(HOST_GEMM_PROBE_CACHED, &choice.times);
            tracing::info!(
                "host FP8 GEMM: {} chosen by the probe (cached: {})",
                choice.chosen,
                listed(&choice.times)
            );
            return HostGemmProbe {
                times: choice.times,
                chosen: choice.chosen,
                cached: true,
            };
        }
        let probe = on_own_pool(|| measure(&HostGemmPath::available_paths()));
        record_times(HOST_GEMM_PROBE, &probe.times);
        tracing::info!(
            "host FP8 GEMM: {} chosen by the probe ({m}×{k}×{n}: {})",
            probe.chosen,
            listed(&probe.times)
        );
        store_choice(
            &key,
            StoredChoice::new([1, m, k, n], &probe.times, &[], probe.chosen),
        );
        probe
    })
}

/// Each path's time in the metrics report as `<prefix>(<path>)`.
fn record_times(prefix: &str, times: &[(HostGemmPath, Duration)]) {
    for (path, time) in times {
        metrics::record_time(&format!("{prefix}({path})"), *time);
    }
}

/// `avx2fma 1.2ms, f32 1.3ms`.
fn listed(times: &[(HostGemmPath, Duration)]) -> String {
    times
        .iter()
        .map(|(path, time)| format!("{path} {time:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `f` on a rayon pool of its own (as many threads as the global pool), from a thread of its own. The global
/// pool's workers may be waiting for the probe (a grouped layer's experts issue their GEMMs from them), so the
/// probe must not need them; and a worker that starts the probe must not run other jobs of its pool while it waits
/// (`ThreadPool::install` from a worker does), or one of them waits for the probe it is measuring. Both deadlocked.
fn on_own_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(rayon::current_num_threads())
        .thread_name(|i| format!("burn-te-probe-{i}"))
        .build();
    let run = move || match pool {
        Ok(pool) => pool.install(f),
        Err(err) => {
            crate::fallback::record(
                "host GEMM probe on the global pool",
                format!(
                    "host FP8 GEMM: no thread pool for the probe ({err}): it runs on rayon's global pool"
                ),
            );
            f()
        }
    };
    std::thread::scope(|scope| {
        let probe = std::thread::Builder::new()
            .name("burn-te-probe".into())
            .spawn_scoped(scope, run)
            .expect("a thread for the host GEMM probe");
        probe
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Times the probe GEMM on each of `paths` (f32 always among the candidates).
pub fn measure(paths: &[HostGemmPath]) -> HostGemmProbe {
    let (m, k, n) = PROBE_SHAPE;
    // Deterministic codes of ordinary magnitudes (no NaN: bit 7 set only with a small magnitude).
    let codes = |len: usize, seed: usize| -> Vec<u8> {
        (0..len)
            .map(|i| ((i * 2_654_435_761 + seed) >> 7) as u8 & 0xbf)
            .collect()
    };
    let (a, b) = (codes(m * k, 1), codes(k * n, 2));
    let operand = |codes, dims| HostOperand {
        codes,
        format: ElementFormat::Fp8(Fp8Format::E4M3),
        block: None,
        scale_inv: &[0.25],
        nvfp4: None,
        dims,
        transposed: false,
    };
    let (lhs, rhs) = (operand(&a, (1, m, k)), operand(&b, (1, k, n)));
    let mut out = burn_te_kernels::host::uninit(m * n);
    let mut candidates: Vec<HostGemmPath> = paths
        .iter()
        .chain(&[HostGemmPath::F32])
        .copied()
        .filter(|path| path.available())
        .collect();
    candidates.sort_by_key(|path| HostGemmPath::ALL.iter().position(|p| p == path));
    candidates.dedup();
    // Rounds of every path in turn, so that a burst of other work on the machine slows all paths alike instead of
    // the one being timed (a wrong choice changes which accumulation order a run gets, not only its speed).
    let mut best: Vec<Option<Duration>> = vec![Some(Duration::MAX); candidates.len()];
    for _ in 0..PROBE_RUNS {
        for (path, best) in candidates.iter().zip(&mut best) {
            let start = Instant::now();
            *best = match run_on(*path, &lhs, &rhs, (m, n, k), None, &mut out) {
                Ok(()) => best.map(|b| b.min(start.elapsed())),
                Err(_) => None,
            };
        }
    }
    let times: Vec<(HostGemmPath, Duration)> = candidates
        .into_iter()
        .zip(best)
        .filter_map(|(path, best)| Some((path, best?)))
        .collect();
    let chosen = preferred(&times);
    HostGemmProbe {
        times,
        chosen,
        cached: false,
    }
}

/// A path must run this much faster than every path before it in [`HostGemmPath::ALL`]'s order (fastest
/// instruction first, the decoded `f32` path last) to be chosen over them: 10 %.
pub const PREFERENCE_MARGIN: f64 = 1.10;

/// The path chosen from measured best times (in [`HostGemmPath::ALL`]'s order): the first whose time is within
/// [`PREFERENCE_MARGIN`] of the fastest; `f32` where none was timed.
///
/// Ties go to the instruction: a timed GEMM runs with its operands in cache, while in a training step the `f32`
/// path's operands, decoded whole to f32 before the `gemm` crate packs them again, cost memory traffic the timing
/// does not see. On a 2-core Zen 3 the fastest best time chose `f32` for a third of a TransformerLayer's GEMM
/// classes by 0.1-5 %, and the step ran 5 % slower than with `avx2fma` everywhere; differences the choice exists
/// for are far larger (`f32` 9x faster on a 64 x 8192 x 64 GEMM, a single task for the packed path).
pub fn preferred(times: &[(HostGemmPath, Duration)]) -> HostGemmPath {
    let Some(fastest) = times.iter().map(|(_, time)| *time).min() else {
        return HostGemmPath::F32;
    };
    times
        .iter()
        .find(|(_, time)| time.as_secs_f64() <= fastest.as_secs_f64() * PREFERENCE_MARGIN)
        .map_or(HostGemmPath::F32, |(path, _)| *path)
}
