//! The host FP8 GEMM's choices on disk, beside CubeCL's autotune cache: the probe's and each tuned shape class's,
//! so that a later process on the same CPU takes them instead of timing the paths again. A run then starts at
//! full speed, and two runs on one machine make the same choices: the paths' accumulation orders differ, so the
//! same choices are what makes them repeat bit for bit.
//!
//! Where: `BURN_TE_HOST_GEMM_CACHE` names a directory, or `off` for none; unset, CubeCL's autotune cache root
//! (`target/` of the Cargo project the process runs in, else the user's cache directory; `cubecl.toml`'s
//! `[autotune] cache` moves it), under `autotune/burn-te-<version>/host/<CPU>/<threads>-<paths>/`. The CPU is its
//! vendor, family, model, stepping and name; the threads are rayon's global pool's; the paths are those this process runs
//! (AMX needs the kernel's grant). Delete the directory to time the paths again.
//!
//! The file is CubeCL's cache format (`cubecl_common::cache`: one JSON entry per line, a file lock between
//! processes). An entry that does not parse is skipped; one that names a path this process cannot run is not
//! taken, recorded as a fallback, and its class is tuned again.

use std::path::PathBuf;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use burn_te_kernels::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
use cubecl_common::cache::{Cache, CacheOption};
use serde::{Deserialize, Serialize};

use burn_te_kernels::host::gemm::HostGemmPath;

use crate::settings::setting::{Setting, any_text};

/// The environment variable that moves the cache (a directory) or turns it off (`off`).
pub const HOST_GEMM_CACHE_ENV: &str = "BURN_TE_HOST_GEMM_CACHE";

/// `BURN_TE_HOST_GEMM_CACHE`: `off`, or the cache's directory (empty: CubeCL's autotune cache directory).
pub const HOST_GEMM_CACHE: Setting<String> = Setting {
    name: HOST_GEMM_CACHE_ENV,
    takes: "off, or a directory",
    otherwise: "CubeCL's autotune cache directory",
    parse: any_text,
};

/// The metrics report's counter of shape classes whose choice came from the cache (`HostFp8GemmTuningsCached`).
pub const HOST_GEMM_TUNINGS_CACHED: &str = "HostFp8GemmTuningsCached";

/// Bumped when what a stored choice means changes (new paths, a new timing rule, a path's speed on a shape class), so
/// old files are not read. 2: the packed paths run a batch's matrices side by side.
const FORMAT: u32 = 2;

/// One choice as stored: the GEMM that made it, each candidate's best run, the paths not timed, the path kept.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct StoredChoice {
    /// `(batch, M, K, N)` of the GEMM that made the choice.
    pub dims: [usize; 4],
    /// `(path name, best run in ns)`, as timed.
    pub times: Vec<(String, u64)>,
    /// Paths not timed (outpaced on the probe).
    pub skipped: Vec<String>,
    /// The path kept.
    pub chosen: String,
}

/// A stored choice read back: the paths it names, or `None` when one of them is not a path this process runs.
pub(super) struct ReadChoice {
    pub dims: [usize; 4],
    pub times: Vec<(HostGemmPath, Duration)>,
    pub skipped: Vec<HostGemmPath>,
    pub chosen: HostGemmPath,
}

impl StoredChoice {
    /// What to store of a choice.
    pub fn new(
        dims: [usize; 4],
        times: &[(HostGemmPath, Duration)],
        skipped: &[HostGemmPath],
        chosen: HostGemmPath,
    ) -> Self {
        Self {
            dims,
            times: times
                .iter()
                .map(|(path, time)| {
                    (
                        path.name().to_owned(),
                        u64::try_from(time.as_nanos()).unwrap_or(u64::MAX),
                    )
                })
                .collect(),
            skipped: skipped.iter().map(|path| path.name().to_owned()).collect(),
            chosen: chosen.name().to_owned(),
        }
    }

    /// The choice with its paths, or the name of the first one this process cannot run.
    fn read(&self) -> Result<ReadChoice, String> {
        let path = |name: &str| {
            HostGemmPath::from_name(name)
                .filter(|path| path.available())
                .ok_or_else(|| name.to_owned())
        };
        Ok(ReadChoice {
            dims: self.dims,
            times: self
                .times
                .iter()
                .map(|(name, ns)| Ok((path(name)?, Duration::from_nanos(*ns))))
                .collect::<Result<_, String>>()?,
            skipped: self
                .skipped
                .iter()
                .map(|name| path(name))
                .collect::<Result<_, _>>()?,
            chosen: path(&self.chosen)?,
        })
    }
}

/// The process's cache file, opened at first use; `None` when turned off.
struct TuneCache {
    cache: Mutex<Cache<String, StoredChoice>>,
    file: PathBuf,
}

fn opened() -> Option<&'static TuneCache> {
    static OPENED: OnceLock<Option<TuneCache>> = OnceLock::new();
    OPENED
        .get_or_init(|| {
            let root = match HOST_GEMM_CACHE.read() {
                Some(value) if value == "off" => return None,
                Some(value) if !value.is_empty() => PathBuf::from(value),
                _ => CubeClRuntimeConfig::get().autotune.cache.root(),
            };
            let paths: Vec<&str> = HostGemmPath::available_paths()
                .iter()
                .map(|path| path.name())
                .collect();
            let partial = format!(
                "host/{}/{}-threads-{}/fp8-gemm-v{FORMAT}",
                cpu_identity(),
                global_pool_threads(),
                paths.join("+")
            );
            let version = format!("burn-te-{}", env!("CARGO_PKG_VERSION"));
            // Where `Cache` puts it: `root/name/version/partial.json.log` (every segment already a plain name).
            let file = root
                .join("autotune")
                .join(&version)
                .join(format!("{partial}.json.log"));
            let options = CacheOption::default()
                .root(root)
                .name("autotune")
                .version(version);
            let cache = Cache::new(&partial, options);
            tracing::info!(
                "host FP8 GEMM choices cached in {} ({} entries; {HOST_GEMM_CACHE_ENV}=off turns the cache off)",
                file.display(),
                cache.len()
            );
            Some(TuneCache {
                cache: Mutex::new(cache),
                file,
            })
        })
        .as_ref()
}

/// The cache file's path, or `None` when `BURN_TE_HOST_GEMM_CACHE=off`.
pub fn host_gemm_cache_file() -> Option<PathBuf> {
    opened().map(|cache| cache.file.clone())
}

/// The choice stored under `key`, if any and if this process runs its paths (otherwise recorded as a fallback:
/// the caller times the paths again).
pub(super) fn cached_choice(key: &str) -> Option<ReadChoice> {
    let opened = opened()?;
    let stored = opened
        .cache
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&key.to_owned())
        .cloned()?;
    match stored.read() {
        Ok(choice) => Some(choice),
        Err(name) => {
            crate::fallback::record(
                "host GEMM tuning cache",
                format!(
                    "host FP8 GEMM: the cached choice for {key} in {} names `{name}`, which this process cannot \
                     run: timing the paths again",
                    opened.file.display()
                ),
            );
            None
        }
    }
}

/// Stores a choice under `key` (a choice another process stored first stays; nothing when the cache is off).
pub(super) fn store_choice(key: &str, choice: StoredChoice) {
    let Some(opened) = opened() else {
        return;
    };
    let result = opened
        .cache
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(key.to_owned(), choice);
    if result.is_err() {
        tracing::debug!(
            "host FP8 GEMM: {key} was stored in {} by another process first; that choice stays there",
            opened.file.display()
        );
    }
}

/// The threads of rayon's global pool (asked from a thread outside every pool: the caller may be inside another).
fn global_pool_threads() -> usize {
    std::thread::scope(|scope| {
        scope
            .spawn(rayon::current_num_threads)
            .join()
            .unwrap_or_else(|_| rayon::current_num_threads())
    })
}

/// This CPU as a path segment: vendor, family, model, stepping and name from CPUID (x86-64), else the
/// architecture. Lower-case letters, digits and `-`.
fn cpu_identity() -> String {
    #[cfg(target_arch = "x86_64")]
    let raw = {
        use std::arch::x86_64::__cpuid;
        let word = |value: u32| value.to_le_bytes();
        let vendor_leaf = __cpuid(0);
        let vendor: Vec<u8> = [vendor_leaf.ebx, vendor_leaf.edx, vendor_leaf.ecx]
            .into_iter()
            .flat_map(word)
            .collect();
        let signature = __cpuid(1).eax;
        let (base_family, base_model) = ((signature >> 8) & 0xf, (signature >> 4) & 0xf);
        let family = base_family
            + if base_family == 0xf {
                (signature >> 20) & 0xff
            } else {
                0
            };
        let model = base_model
            + if base_family == 0x6 || base_family == 0xf {
                ((signature >> 16) & 0xf) << 4
            } else {
                0
            };
        let name: Vec<u8> = if __cpuid(0x8000_0000).eax >= 0x8000_0004 {
            (0x8000_0002..=0x8000_0004)
                .map(__cpuid)
                .flat_map(|r| [r.eax, r.ebx, r.ecx, r.edx].into_iter().flat_map(word))
                .collect()
        } else {
            Vec::new()
        };
        format!(
            "{}-family{family}-model{model}-stepping{}-{}",
            String::from_utf8_lossy(&vendor),
            signature & 0xf,
            String::from_utf8_lossy(&name)
        )
    };
    #[cfg(not(target_arch = "x86_64"))]
    let raw = std::env::consts::ARCH.to_owned();
    let mut segment = String::with_capacity(raw.len());
    for c in raw.trim_matches(char::from(0)).trim().chars() {
        match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9') => segment.push(c),
            _ if !segment.ends_with('-') => segment.push('-'),
            _ => {}
        }
    }
    segment.trim_matches('-').to_owned()
}
