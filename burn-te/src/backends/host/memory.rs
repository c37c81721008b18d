//! The host path's memory settings, applied once per process at its first output: the output pool's bound
//! (`BURN_TE_HOST_POOL_MIB`) and glibc's malloc thresholds (`BURN_TE_HOST_MALLOC`), so that a step's freed buffers
//! are reused by the next step instead of coming back as fresh pages.

use burn_te_kernels::host::malloc::{MallocThresholds, keep_freed_memory};
use burn_te_kernels::host::pool;

use crate::settings::setting::Setting;

/// The metrics report's counter of what the host path did to glibc's malloc thresholds:
/// `HostMallocThresholds(set)`, `(set by GLIBC_TUNABLES)`, `(left to glibc)`, `(refused by glibc)` or `(not glibc)`.
pub const HOST_MALLOC_THRESHOLDS: &str = "HostMallocThresholds";

/// The variable that chooses glibc's thresholds: `keep` (the default: fixed, freed step buffers stay mapped) or
/// `glibc` (glibc's own, moving with what the process frees).
pub const HOST_MALLOC_ENV: &str = "BURN_TE_HOST_MALLOC";

/// Applies the settings, once per process.
pub(super) fn configure() {
    static CONFIGURED: std::sync::Once = std::sync::Once::new();
    CONFIGURED.call_once(|| {
        configure_pool();
        configure_malloc();
    });
}

/// `BURN_TE_HOST_POOL_MIB`: the output pool's bound in MiB (0: no pool), a number of bytes that fits in memory.
pub const HOST_POOL_MIB: Setting<usize> = Setting {
    name: "BURN_TE_HOST_POOL_MIB",
    takes: "a whole number of MiB that fits in memory",
    otherwise: "the default, 1024 MiB",
    parse: |value| {
        value
            .parse::<usize>()
            .ok()
            .filter(|mib| mib.checked_mul(1 << 20).is_some())
    },
};

/// `BURN_TE_HOST_MALLOC`: `keep` (`Some(true)`, the default) or `glibc` (`Some(false)`).
pub const HOST_MALLOC: Setting<bool> = Setting {
    name: HOST_MALLOC_ENV,
    takes: "keep, glibc",
    otherwise: "keep",
    parse: |value| match value {
        "keep" => Some(true),
        "glibc" => Some(false),
        _ => None,
    },
};

/// The output pool's bound from `BURN_TE_HOST_POOL_MIB`. An unreadable value is recorded as a fallback and the
/// default (1 GiB) kept.
fn configure_pool() {
    if let Some(mib) = HOST_POOL_MIB.read() {
        pool::set_held_limit(mib << 20);
    }
}

/// glibc's thresholds as `BURN_TE_HOST_MALLOC` asks ([`keep_freed_memory`] unless `glibc`), counted in the
/// metrics report and logged. An unknown value is recorded as a fallback and the default taken.
fn configure_malloc() {
    let keep = HOST_MALLOC.read().unwrap_or(true);
    let thresholds = keep.then(keep_freed_memory);
    if thresholds == Some(MallocThresholds::Refused) {
        crate::fallback::record(
            HOST_MALLOC_ENV,
            "glibc refused the malloc thresholds: freed host buffers may come back as fresh pages"
                .into(),
        );
    }
    let outcome = thresholds.map_or_else(|| "left to glibc".to_string(), |t| t.to_string());
    tracing::info!("host path: glibc's malloc thresholds {outcome}");
    crate::metrics::increment_counter(&format!("{HOST_MALLOC_THRESHOLDS}({outcome})"), 1);
}
