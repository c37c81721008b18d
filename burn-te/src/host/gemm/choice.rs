//! Which path a host FP8 GEMM takes: [`with_host_gemm_path`] on this thread, else `BURN_TE_HOST_GEMM`
//! (`auto`, `amxbf16`, `avx512bf16`, `avx512fma`, `avx2fma`, `f32`; read once), else the fastest path of this CPU as measured by [`probe`]
//! at the first GEMM. A path the CPU lacks, or a packed path that cannot take the operands exactly, runs on
//! `f32`, recorded as a fallback. Each GEMM counts under `HostFp8Gemm(<path>)` in the metrics report, and the
//! probe's times under `HostGemmProbe(<path>)`.

use std::cell::Cell;
use std::mem::MaybeUninit;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use burn_te_kernels::Fp8Format;
use burn_te_kernels::host::gemm::HostGemmPath;

use super::operand::HostOperand;
use super::run::run_on;
use crate::metrics;
use crate::primitive::ElementFormat;

/// The metrics report's counter prefix of host FP8 GEMMs by path (`HostFp8Gemm(avx2fma)`).
pub const HOST_FP8_GEMM: &str = "HostFp8Gemm";

/// The metrics report's time prefix of the probe's measurement per path (`HostGemmProbe(avx2fma)`).
pub const HOST_GEMM_PROBE: &str = "HostGemmProbe";

thread_local! {
    static FORCED: Cell<Option<HostGemmPath>> = const { Cell::new(None) };
}

/// Runs `f` with this thread's host FP8 GEMMs on `path` (a test of a path, a comparison of two); back to the
/// default when `f` returns or panics. A path this CPU lacks runs on f32, recorded as a fallback.
pub fn with_host_gemm_path<T>(path: HostGemmPath, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<HostGemmPath>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.with(|forced| forced.set(self.0));
        }
    }
    let _restore = Restore(FORCED.with(|forced| forced.replace(Some(path))));
    f()
}

/// `BURN_TE_HOST_GEMM`, read once: `None` for `auto` or unset; an unknown value is reported once and read as auto.
fn configured() -> Option<HostGemmPath> {
    static CONFIGURED: OnceLock<Option<HostGemmPath>> = OnceLock::new();
    *CONFIGURED.get_or_init(|| {
        let value = std::env::var("BURN_TE_HOST_GEMM").ok()?;
        match value.as_str() {
            "" | "auto" => None,
            name => HostGemmPath::from_name(name).or_else(|| {
                let names: Vec<_> = HostGemmPath::ALL.iter().map(|p| p.name()).collect();
                crate::fallback::record(
                    "BURN_TE_HOST_GEMM",
                    format!(
                        "BURN_TE_HOST_GEMM={name:?} is not a host GEMM path (auto, {}): using auto",
                        names.join(", ")
                    ),
                );
                None
            }),
        }
    })
}

/// The path this thread's host FP8 GEMMs are asked to take: forced, configured, or the probe's choice.
pub fn requested_host_gemm_path() -> HostGemmPath {
    FORCED
        .with(Cell::get)
        .or_else(configured)
        .unwrap_or_else(|| probe().chosen)
}

/// What the probe measured: each available path's best time on the probe GEMM, and the fastest.
#[derive(Clone, Debug)]
pub struct HostGemmProbe {
    /// `(path, best time)` of every path this CPU runs, fastest instruction first.
    pub times: Vec<(HostGemmPath, Duration)>,
    /// The fastest.
    pub chosen: HostGemmPath,
}

/// The probe GEMM: `M × K · K × N`, a layer's fprop of E4M3 codes with per-tensor scales.
pub const PROBE_SHAPE: (usize, usize, usize) = (256, 1024, 512);

/// Rounds of the probe GEMM, each running every path once (the best time per path counts; the first round warms
/// caches and buffers).
const PROBE_RUNS: usize = 5;

/// The probe, run once per process at the first host FP8 GEMM that is not forced (a few ms per path): each path
/// this CPU runs takes the same GEMM ([`PROBE_SHAPE`]) in `PROBE_RUNS` rounds of every path in turn on rayon's
/// pool, and the fastest best time wins. The paths' accumulation orders differ, so the choice also decides a run's
/// last bits: `BURN_TE_HOST_GEMM` pins it where runs must repeat bit for bit across machines or loads. Logged at
/// `info`, and its times recorded in the metrics report.
pub fn probe() -> &'static HostGemmProbe {
    static PROBE: OnceLock<HostGemmProbe> = OnceLock::new();
    PROBE.get_or_init(|| {
        let probe = measure(&HostGemmPath::available_paths());
        for (path, time) in &probe.times {
            metrics::record_time(&format!("{HOST_GEMM_PROBE}({path})"), *time);
        }
        tracing::info!(
            "host FP8 GEMM: {} chosen by the probe ({}×{}×{}: {})",
            probe.chosen,
            PROBE_SHAPE.0,
            PROBE_SHAPE.1,
            PROBE_SHAPE.2,
            probe
                .times
                .iter()
                .map(|(path, time)| format!("{path} {time:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        probe
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
    let chosen = times
        .iter()
        .min_by_key(|(_, time)| *time)
        .map_or(HostGemmPath::F32, |(path, _)| *path);
    HostGemmProbe { times, chosen }
}

/// `out[b] = lhs[b] · rhs[b] (+ bias)` (every value of `out` written; `bias` one value per column) on this thread's
/// path ([`requested_host_gemm_path`]), or on f32 where that path is missing or cannot take the operands exactly
/// (recorded as a fallback); counted under its path. Returns the path that ran.
pub(crate) fn host_fp8_gemm(
    lhs: &HostOperand<'_>,
    rhs: &HostOperand<'_>,
    dims: (usize, usize, usize),
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) -> HostGemmPath {
    let path = host_fp8_gemm_asking(requested_host_gemm_path(), lhs, rhs, dims, bias, out);
    count_path(path);
    path
}

/// Counts a host FP8 GEMM under its path (`HostFp8Gemm(<path>)`), on the thread that issued it.
pub(super) fn count_path(path: HostGemmPath) {
    metrics::increment_counter(&format!("{HOST_FP8_GEMM}({path})"), 1);
}

/// [`host_fp8_gemm`] asking for path `requested` (read on the thread that issued the GEMM: a GEMM run on a
/// worker thread takes the issuing thread's path), not counted (the issuing thread counts it).
pub(super) fn host_fp8_gemm_asking(
    requested: HostGemmPath,
    lhs: &HostOperand<'_>,
    rhs: &HostOperand<'_>,
    dims: (usize, usize, usize),
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) -> HostGemmPath {
    match run_on(requested, lhs, rhs, dims, bias, out) {
        Ok(()) => requested,
        Err(reason) => {
            let (m, n, k) = dims;
            let kind = if requested.available() {
                "host GEMM path not exact"
            } else {
                "host GEMM path unavailable"
            };
            crate::fallback::record(
                kind,
                format!("host FP8 GEMM {m}x{n}x{k}: ran on f32, not on {requested}: {reason}"),
            );
            run_on(HostGemmPath::F32, lhs, rhs, dims, bias, out)
                .expect("the f32 path runs everywhere");
            HostGemmPath::F32
        }
    }
}
