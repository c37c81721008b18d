//! The autotune of the device FP8 GEMM: per device and shape class, each candidate that can take the GEMM exactly
//! (the SIMT kernel, cubek-matmul's tiled routines with the codes decoded on load, and Burn's own matmul on codes
//! decoded ahead: [`super::gemm_decoded`]) runs once to compile and
//! warm up, then once per round for [`TIMED_RUNS`] rounds, the candidates in turn, synchronised; the candidate with
//! the fastest best run is kept for that key for the rest of the process, as Burn keeps its matmul's choice. GEMMs
//! below [`TUNED_MIN_PRODUCT`] multiply-adds are too small for the choice to matter and take the SIMT kernel
//! untuned.
//!
//! The key anchors M, K, N and the batch to powers of two (as Burn's matmul key does) and carries what decides
//! which candidates can run (whole code words per row, K a multiple of 16), so a kept choice runs every GEMM of its
//! key.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use burn_cubecl::CubeRuntime;
use burn_te_kernels::KernelError;
use burn_te_kernels::cubecl::future::block_on;
use burn_te_kernels::cubecl::prelude::*;
use burn_te_kernels::cubecl::server::Handle;
use burn_te_kernels::gemm::cubek::{CubekRoutine, cubek_refusal, fp8_gemm_cubek};
use burn_te_kernels::gemm::{GemmOperand, fp8_gemm, product_dims};
use burn_te_kernels::kernel::code::CodeFormat;

use super::gemm_decoded::{self, fp8_gemm_decoded};
use crate::error::TeError;
use crate::settings::setting::Setting;

/// GEMMs with fewer multiply-adds (`batch · M · K · N`) run on the SIMT kernel without tuning: 256³.
pub const TUNED_MIN_PRODUCT: usize = 1 << 24;

/// Rounds of timed runs, one run of each candidate per round, after each one's first (compiling) run.
pub const TIMED_RUNS: usize = 3;

/// The tiled routines the autotune tries, from `BURN_TE_TILED_ROUTINES` (read once):
/// - `tested` (the default): the unit routines and `simple_cmma`, whose exactness tests have passed on lavapipe and on
///   an H200's matrix units;
/// - `all`: every routine of [`CubekRoutine::ALL`], the plane routines Burn's own matmul tunes among on matrix units
///   too (multi-row, double-buffered, ordered; CMMA and MMA tiles). Their tests run wherever matrix units are, but
///   none has run on a GPU yet, so they stay opt-in until one has.
///
/// An unknown value is recorded as a fallback and read as `tested`.
pub fn tiled_candidates() -> &'static [CubekRoutine] {
    const TESTED: [CubekRoutine; 3] = [
        CubekRoutine::SimpleUnit,
        CubekRoutine::DoubleUnit,
        CubekRoutine::SIMPLE_CMMA,
    ];
    static CONFIGURED: std::sync::OnceLock<&'static [CubekRoutine]> = std::sync::OnceLock::new();
    CONFIGURED.get_or_init(|| {
        if TILED_ROUTINES.read() == Some(true) {
            &CubekRoutine::ALL
        } else {
            &TESTED
        }
    })
}

/// `BURN_TE_TILED_ROUTINES`: `tested` (`false`, the default) or `all` (`true`).
pub const TILED_ROUTINES: Setting<bool> = Setting {
    name: "BURN_TE_TILED_ROUTINES",
    takes: "tested, all",
    otherwise: "tested",
    parse: |value| match value {
        "" | "tested" => Some(false),
        "all" => Some(true),
        _ => None,
    },
};

/// What runs a device FP8 GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmKernel {
    /// burn-te's SIMT kernel.
    Simt,
    /// A cubek-matmul routine on codes decoded on load.
    Tiled(CubekRoutine),
    /// Burn's own matmul (its autotune's routine) on codes decoded ahead ([`super::gemm_decoded`]).
    Decoded,
}

impl core::fmt::Display for GemmKernel {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            GemmKernel::Simt => f.write_str("simt"),
            GemmKernel::Tiled(routine) => write!(f, "tiled/{}", routine.name()),
            GemmKernel::Decoded => f.write_str("decoded"),
        }
    }
}

/// What a kept choice is keyed by.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct TuneKey {
    runtime: String,
    device: String,
    output_bytes: usize,
    /// `(batch, M, K, N)`, each rounded up to a power of two.
    anchored: [usize; 4],
    transposed: (bool, bool),
    formats: (CodeFormat, CodeFormat),
    /// The tiled path's refusal per routine (`cubek_refusal`): what can run at all.
    refused: [bool; CubekRoutine::COUNT],
    /// The decoded path's refusal.
    decoded_refused: bool,
}

fn choices() -> &'static Mutex<HashMap<TuneKey, GemmKernel>> {
    static CHOICES: std::sync::OnceLock<Mutex<HashMap<TuneKey, GemmKernel>>> =
        std::sync::OnceLock::new();
    CHOICES.get_or_init(Default::default)
}

/// Runs `kernel` on `a × b`.
pub(crate) fn run_kernel<R: CubeRuntime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    device: &R::Device,
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
    kernel: GemmKernel,
) -> Result<Handle, KernelError> {
    match kernel {
        GemmKernel::Simt => fp8_gemm::<R, F>(client, a, b),
        GemmKernel::Tiled(routine) => fp8_gemm_cubek::<R, F>(client, a, b, routine),
        GemmKernel::Decoded => fp8_gemm_decoded::<R, F>(client, device, a, b),
    }
}

/// The kernel autotune keeps for `a × b` on this device: measured at the first GEMM of its key, the SIMT kernel for
/// small GEMMs and for operands only it takes.
pub(crate) fn tuned_kernel<R: CubeRuntime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    device: &R::Device,
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
) -> Result<GemmKernel, TeError> {
    let (m, k, n, batch) = product_dims(a, b)?;
    let candidates: Vec<GemmKernel> = tiled_candidates()
        .iter()
        .copied()
        .filter(|&routine| cubek_refusal(a, b, routine).is_none())
        .filter(|&routine| routine.missing_units(client).is_none())
        .map(GemmKernel::Tiled)
        .chain(
            gemm_decoded::refusal(a, b)
                .is_none()
                .then_some(GemmKernel::Decoded),
        )
        .collect();
    if batch * m * k * n < TUNED_MIN_PRODUCT || candidates.is_empty() {
        return Ok(GemmKernel::Simt);
    }
    let key = TuneKey {
        runtime: R::name(client).to_string(),
        device: format!("{:?}", device),
        output_bytes: size_of::<F>(),
        anchored: [batch, m, k, n].map(usize::next_power_of_two),
        transposed: (a.transposed, b.transposed),
        formats: (a.element(), b.element()),
        refused: CubekRoutine::ALL.map(|routine| cubek_refusal(a, b, routine).is_some()),
        decoded_refused: gemm_decoded::refusal(a, b).is_some(),
    };
    if let Some(&kept) = choices()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&key)
    {
        return Ok(kept);
    }
    // Each candidate's first (compiling) run; a routine the device lacks (no matrix units, no tile size for the
    // shape) is no candidate here.
    let mut timings = Vec::new();
    for kernel in std::iter::once(GemmKernel::Simt).chain(candidates) {
        match timed_run::<R, F>(client, device, a, b, kernel) {
            Ok(_) => timings.push((kernel, Duration::MAX)),
            Err(KernelError::Library { reason, .. }) => {
                tracing::debug!("device FP8 GEMM autotune: {kernel} cannot run {key:?}: {reason}")
            }
            Err(error) => return Err(error.into()),
        }
    }
    // Then rounds of one run each, in turn, so that a busy moment of the machine slows every candidate alike; each
    // keeps its best.
    for _ in 0..TIMED_RUNS {
        for (kernel, best) in &mut timings {
            *best = (*best).min(timed_run::<R, F>(client, device, a, b, *kernel)?);
        }
    }
    let (chosen, _) = timings
        .iter()
        .min_by_key(|(_, time)| *time)
        .copied()
        .unwrap_or((GemmKernel::Simt, Duration::ZERO));
    let listed: Vec<String> = timings
        .iter()
        .map(|(kernel, time)| format!("{kernel} {:.3} ms", time.as_secs_f64() * 1e3))
        .collect();
    tracing::info!(
        "device FP8 GEMM autotune, batch {batch} x {m}x{k}x{n} (lhs_t {}, rhs_t {}): {chosen} ({})",
        a.transposed,
        b.transposed,
        listed.join(", ")
    );
    crate::metrics::increment_counter(crate::metrics::names::DEVICE_GEMM_TUNINGS, 1);
    choices()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(key, chosen);
    Ok(chosen)
}

/// One synchronised run of `kernel`, timed.
fn timed_run<R: CubeRuntime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    device: &R::Device,
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
    kernel: GemmKernel,
) -> Result<Duration, KernelError> {
    block_on(client.sync())?;
    let start = Instant::now();
    run_kernel::<R, F>(client, device, a, b, kernel)?;
    block_on(client.sync())?;
    Ok(start.elapsed())
}
