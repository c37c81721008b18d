//! glibc's `malloc` thresholds for a training process. glibc serves a block of at least its mmap threshold with a
//! fresh mapping, and hands an arena's free top back to the OS once it exceeds the trim threshold. Both move with
//! what the process happened to free (the mmap threshold rises to the largest mapped block freed, up to 32 MiB; the
//! trim threshold to twice that). A training step allocates and frees the same buffers every step, and under these
//! moving thresholds many of them come back as fresh pages that Linux zeroes while the first stores fault them in:
//! a char-GPT step at hidden 512 took 1.57 million page faults in 30 f32 steps and 0.13–0.18 million in 30 FP8
//! steps. [`keep_freed_memory`] fixes the thresholds, so blocks below 32 MiB come from the heap and up to 256 MiB of
//! free memory stay at each arena's top: 0.14 and 0.075 million (with 64 MiB, 0.89 million f32: that step frees
//! more than 64 MiB at once). Blocks of 32 MiB and more are the host pool's
//! ([`super::pool`]).

/// Blocks below this many bytes come from the heap ([`keep_freed_memory`]): glibc's largest mmap threshold.
pub const MMAP_THRESHOLD: usize = 32 << 20;

/// Free bytes at an arena's top beyond this go back to the OS ([`keep_freed_memory`]).
pub const TRIM_THRESHOLD: usize = 256 << 20;

/// The variable through which a user sets glibc's own tunables ([`keep_freed_memory`] leaves those alone).
pub const GLIBC_TUNABLES: &str = "GLIBC_TUNABLES";

/// What [`keep_freed_memory`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MallocThresholds {
    /// Both thresholds set ([`MMAP_THRESHOLD`], [`TRIM_THRESHOLD`]).
    Set,
    /// `GLIBC_TUNABLES` names a malloc threshold: the user's values are kept.
    SetByUser,
    /// glibc refused a value (`mallopt` returned 0); its own thresholds stay.
    Refused,
    /// Not glibc on Linux (another C library): nothing to set.
    Unsupported,
}

impl std::fmt::Display for MallocThresholds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Set => "set",
            Self::SetByUser => "set by GLIBC_TUNABLES",
            Self::Refused => "refused by glibc",
            Self::Unsupported => "not glibc",
        })
    }
}

/// Fixes glibc's mmap threshold at [`MMAP_THRESHOLD`] and its trim threshold at [`TRIM_THRESHOLD`] for the whole
/// process (`mallopt`), unless `GLIBC_TUNABLES` sets either: freed step buffers then stay mapped for the next step.
/// What stays held: up to [`TRIM_THRESHOLD`] bytes of free memory at the top of each malloc arena (one per thread
/// that allocates, at most eight per core). A process whose global allocator is not the C library's is unaffected.
pub fn keep_freed_memory() -> MallocThresholds {
    let user = std::env::var(GLIBC_TUNABLES).unwrap_or_default();
    if user.contains("glibc.malloc.mmap_threshold") || user.contains("glibc.malloc.trim_threshold")
    {
        return MallocThresholds::SetByUser;
    }
    set_thresholds()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds() -> MallocThresholds {
    let set = |param, bytes: usize| {
        // SAFETY: `mallopt` only changes the allocator's parameters; both values fit in an `int`.
        unsafe { libc::mallopt(param, bytes as libc::c_int) == 1 }
    };
    // The trim threshold first: setting the mmap threshold alone would leave trimming at glibc's 128 KiB.
    match set(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) && set(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    {
        true => MallocThresholds::Set,
        false => MallocThresholds::Refused,
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds() -> MallocThresholds {
    MallocThresholds::Unsupported
}
