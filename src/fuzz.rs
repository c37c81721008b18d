//! A stable-Rust fuzz harness for burn-te-debug's YAML config parser and feature builders (run by
//! `examples/fuzz_config.rs`; a short run is part of the test suite).
//!
//! Every input goes through [`Config::parse`] — the YAML parser, the section and selector parsers and every
//! registered feature's builder — and an accepted config is then asked what the debug path asks it (the section of
//! a few layers, each feature's logged stats and routing answers). Inputs come from four generators, each input a
//! pure function of `(seed, index)` so any one can be replayed ([`input`]):
//!
//! - `mutated-seed` (40%): TE's test configs (`tests/data/te-configs`) and the examples' configs, with 1–8 stacked
//!   mutations: bit flips, YAML punctuation, token insertion, deletions, line duplication/deletion/swaps, splices
//!   of lines from another config, values and keys replaced by interesting ones, indentation changes, truncation,
//!   repeated blocks, raw bytes (invalid UTF-8 is replaced as a lossy read would).
//! - `grammar` (20%), `grammar-valid` (20%) and `grammar-mutated` (18%): random configs built from TE's grammar:
//!   known and random section, feature, key, stat, gemm and tensor names; selectors with odd regexes and number
//!   ranges; `gemms_struct` and `tensors_struct` lists; type confusion; numbers such as `.nan`, `-.inf`, `-0`,
//!   `1e400`, `2^64`, hex and tagged scalars; block and flow styles; anchors and aliases. `grammar` makes
//!   deliberate mistakes, `grammar-valid` none (most of its configs load and reach every feature builder), and
//!   `grammar-mutated` mutates valid ones.
//! - `adversarial` (2%): alias expansion ("billion laughs"), deep flow and block nesting, thousands of sections,
//!   long `gemms_struct` × `tensors_struct` products and stats lists, huge scalars and numbers, many keys, aliases
//!   of a large anchor.
//!
//! Each input runs under `catch_unwind`, timed; a watchdog thread stops the run when one input takes longer than
//! [`Options::time_limit`] or (with [`CountingAlloc`] installed as the global allocator) holds more than
//! [`Options::memory_limit`] bytes, saving the input. The randomness is a SplitMix64 generator written here:
//! the generators are grammar-specific anyway, and a local generator keeps every `(seed, index)` reproducible
//! across dependency updates without adding a crate to the workspace's shared build.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::fmt;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn_te::Gemm;
use burn_te_debug::config::{Config, FeatureSpec, Need, Schedule};
use burn_te_debug::features::{Feature, Namespace, Routing, register_feature};
use burn_te_debug::{ConfigError, TensorName};

// ---------------------------------------------------------------------------------------------------------------
// Memory accounting

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static COUNTING: AtomicBool = AtomicBool::new(false);
static HARD_LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);

/// A global allocator that counts live bytes (install it with `#[global_allocator]` in the fuzzing binary). Beyond
/// [`CountingAlloc::set_hard_limit`] allocations fail, which aborts the process: a last resort behind the
/// watchdog's memory limit, so that a runaway input cannot take the machine down.
pub struct CountingAlloc;

impl CountingAlloc {
    /// Allocations that would take the live total beyond `bytes` fail.
    pub fn set_hard_limit(bytes: usize) {
        HARD_LIMIT.store(bytes, Ordering::Relaxed);
    }

    fn add(size: usize) -> bool {
        let live = LIVE.fetch_add(size, Ordering::Relaxed) + size;
        if live > HARD_LIMIT.load(Ordering::Relaxed) {
            LIVE.fetch_sub(size, Ordering::Relaxed);
            return false;
        }
        PEAK.fetch_max(live, Ordering::Relaxed);
        true
    }

    /// Counts `layout`'s bytes and allocates them with `allocate`, or fails (null) beyond the hard limit.
    fn counted(layout: Layout, allocate: impl FnOnce() -> *mut u8) -> *mut u8 {
        COUNTING.store(true, Ordering::Relaxed);
        if !Self::add(layout.size()) {
            return std::ptr::null_mut();
        }
        let ptr = allocate();
        if ptr.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        ptr
    }
}

// SAFETY: every call forwards to the system allocator with the same layout; the counters do not affect it.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::counted(layout, || unsafe { System.alloc(layout) })
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::counted(layout, || unsafe { System.alloc_zeroed(layout) })
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = layout.size();
        if new_size > old && !Self::add(new_size - old) {
            return std::ptr::null_mut();
        }
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if new.is_null() {
            if new_size > old {
                LIVE.fetch_sub(new_size - old, Ordering::Relaxed);
            }
        } else if new_size < old {
            LIVE.fetch_sub(old - new_size, Ordering::Relaxed);
        }
        new
    }
}

/// Live bytes, when [`CountingAlloc`] is the global allocator.
fn live_bytes() -> Option<usize> {
    COUNTING
        .load(Ordering::Relaxed)
        .then(|| LIVE.load(Ordering::Relaxed))
}

// ---------------------------------------------------------------------------------------------------------------
// Options and report

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    /// How many inputs.
    pub inputs: u64,
    /// The run's seed; input `i` depends on `(seed, i)` only.
    pub seed: u64,
    /// The first input's index (to resume or replay a range).
    pub start: u64,
    /// An input running longer than this is a hang: the run stops.
    pub time_limit: Duration,
    /// Live bytes during one input beyond this stop the run (measured with [`CountingAlloc`] only).
    pub memory_limit: usize,
    /// Where inputs that panic, hang or exceed the memory limit are written.
    pub save_dir: Option<PathBuf>,
    /// Print a progress line this often.
    pub progress: Option<Duration>,
    /// Install a panic hook that records the panic's location and prints nothing (for the fuzzing binary; tests keep
    /// the default hook, which is process-global).
    pub quiet_panics: bool,
    /// Feature names to register with the fuzz feature's factory besides `FuzzFeature` (e.g. the custom features
    /// of TE's test configs). Ignored if already registered.
    pub extra_features: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            inputs: 10_000,
            seed: 0x5EED,
            start: 0,
            time_limit: Duration::from_secs(10),
            memory_limit: 1 << 30,
            save_dir: None,
            progress: None,
            quiet_panics: false,
            extra_features: Vec::new(),
        }
    }
}

/// One input's identity, for the report.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    /// The input's index.
    pub index: u64,
    /// Its generator.
    pub source: &'static str,
    /// Its length in bytes.
    pub len: usize,
    /// The measured quantity (nanoseconds, bytes or characters).
    pub value: u64,
}

/// A panic, hang or memory overrun.
#[derive(Clone, Debug)]
pub struct Finding {
    /// The input.
    pub sample: Sample,
    /// What happened.
    pub message: String,
    /// Where the input was saved.
    pub saved: Option<PathBuf>,
}

/// What a run found.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Inputs run.
    pub inputs: u64,
    /// Accepted configs.
    pub ok: u64,
    /// Rejected configs by error kind (`Syntax/...` split by the YAML error's cause).
    pub errors: BTreeMap<String, u64>,
    /// Rejected configs whose error carries a line number.
    pub errors_with_line: u64,
    /// Inputs per generator.
    pub sources: BTreeMap<&'static str, u64>,
    /// Accepted configs per generator.
    pub source_ok: BTreeMap<&'static str, u64>,
    /// Time spent parsing and checking per generator.
    pub source_time: BTreeMap<&'static str, Duration>,
    /// The first error message of each kind (clipped to 160 characters) and its input's index.
    pub error_examples: BTreeMap<String, (u64, String)>,
    /// Inputs whose bytes were not UTF-8 (parsed after a lossy conversion, as a file read would reject them).
    pub lossy_utf8: u64,
    /// Panics (at most 20 kept; `panic_count` counts all).
    pub panics: Vec<Finding>,
    /// Every panic.
    pub panic_count: u64,
    /// Inputs the generators failed to make (a bug of this harness, not of the parser; they are not run).
    pub generator_panics: u64,
    /// The slowest input (nanoseconds).
    pub slowest: Sample,
    /// The input with the largest peak of live memory above the baseline (bytes), when measured.
    pub peak_memory: Option<Sample>,
    /// The largest peak of live memory per input byte, for inputs over 1 KiB, when measured.
    pub peak_memory_ratio: Option<(f64, Sample)>,
    /// The longest error message (characters).
    pub longest_error: Sample,
    /// The largest input (bytes).
    pub largest_input: Sample,
    /// Routing and selector calls made on accepted configs.
    pub calls: u64,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let errors: u64 = self.errors.values().sum();
        writeln!(
            f,
            "inputs: {}  ok: {}  errors: {}  panics: {}  ({:.1} s, {:.0} inputs/s)",
            self.inputs,
            self.ok,
            errors,
            self.panic_count,
            self.elapsed.as_secs_f64(),
            self.inputs as f64 / self.elapsed.as_secs_f64().max(1e-9)
        )?;
        let sources: Vec<String> = self
            .sources
            .iter()
            .map(|(s, n)| {
                let time = self.source_time.get(s).copied().unwrap_or_default();
                let ok = self.source_ok.get(s).copied().unwrap_or_default();
                format!("{s} {n} ({ok} ok, {:.1} s)", time.as_secs_f64())
            })
            .collect();
        writeln!(f, "generators: {}", sources.join(", "))?;
        writeln!(f, "not UTF-8 (lossy): {}", self.lossy_utf8)?;
        if self.generator_panics > 0 {
            writeln!(
                f,
                "GENERATOR PANICS (inputs not made): {}",
                self.generator_panics
            )?;
        }
        writeln!(
            f,
            "errors by kind ({} of {} with a line number):",
            self.errors_with_line, errors
        )?;
        for (kind, n) in &self.errors {
            writeln!(f, "  {kind:<34} {n:>8}")?;
            if let Some((index, message)) = self.error_examples.get(kind) {
                writeln!(f, "      e.g. #{index}: {message}")?;
            }
        }
        writeln!(
            f,
            "slowest input: {:.3} ms (#{} {}, {} bytes)",
            self.slowest.value as f64 / 1e6,
            self.slowest.index,
            self.slowest.source,
            self.slowest.len
        )?;
        match &self.peak_memory {
            Some(m) => writeln!(
                f,
                "largest memory peak of one input: {:.1} MiB (#{} {}, {} bytes)",
                m.value as f64 / (1u64 << 20) as f64,
                m.index,
                m.source,
                m.len
            )?,
            None => writeln!(
                f,
                "memory: not measured (CountingAlloc is not the global allocator)"
            )?,
        }
        if let Some((ratio, m)) = &self.peak_memory_ratio {
            writeln!(
                f,
                "largest memory peak per input byte (inputs > 1 KiB): {ratio:.0} (#{} {}, {} bytes)",
                m.index, m.source, m.len
            )?;
        }
        writeln!(
            f,
            "largest input: {} bytes (#{} {}); longest error message: {} chars (#{} {})",
            self.largest_input.len,
            self.largest_input.index,
            self.largest_input.source,
            self.longest_error.value,
            self.longest_error.index,
            self.longest_error.source
        )?;
        writeln!(
            f,
            "routing/selector calls on accepted configs: {}",
            self.calls
        )?;
        for panic in &self.panics {
            writeln!(
                f,
                "PANIC #{} ({}, {} bytes): {}{}",
                panic.sample.index,
                panic.sample.source,
                panic.sample.len,
                panic.message,
                panic
                    .saved
                    .as_ref()
                    .map(|p| format!(" [saved: {}]", p.display()))
                    .unwrap_or_default()
            )?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The run

/// The seed configs: TE's test configs and the examples' configs, as `(file name, text)`.
pub fn seeds() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut seeds = Vec::new();
    for dir in ["tests/data/te-configs", "examples"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
            .collect();
        paths.sort();
        for path in paths {
            if let Ok(text) = std::fs::read_to_string(&path) {
                seeds.push((
                    format!("{dir}/{}", path.file_name().unwrap().display()),
                    text,
                ));
            }
        }
    }
    assert!(
        !seeds.is_empty(),
        "no seed configs under {}",
        root.display()
    );
    seeds
}

/// A generated input.
pub struct Input {
    /// Its generator.
    pub source: &'static str,
    /// The text parsed.
    pub text: String,
    /// Whether the generated bytes were not UTF-8 (`text` is their lossy conversion).
    pub lossy: bool,
}

/// The input of `(seed, index)`.
pub fn input(seed: u64, index: u64, seeds: &[(String, String)]) -> Input {
    let mut rng = Rng::new(seed ^ index.wrapping_mul(0xA076_1D64_78BD_642F));
    rng.next_u64();
    let roll = rng.below(100);
    let (source, bytes) = match roll {
        0..40 => {
            let (_, text) = &seeds[rng.below(seeds.len())];
            let mut bytes = text.clone().into_bytes();
            for _ in 0..rng.range(1, 8) {
                mutate(&mut rng, &mut bytes, seeds);
            }
            ("mutated-seed", bytes)
        }
        40..60 => ("grammar", grammar_config(&mut rng).into_bytes()),
        60..80 => {
            rng.noise = 0.0;
            ("grammar-valid", grammar_config(&mut rng).into_bytes())
        }
        80..98 => {
            rng.noise = 0.0;
            let mut bytes = grammar_config(&mut rng).into_bytes();
            rng.noise = 1.0;
            for _ in 0..rng.range(1, 3) {
                mutate(&mut rng, &mut bytes, seeds);
            }
            ("grammar-mutated", bytes)
        }
        _ => ("adversarial", adversarial(&mut rng).into_bytes()),
    };
    match String::from_utf8(bytes) {
        Ok(text) => Input {
            source,
            text,
            lossy: false,
        },
        Err(err) => Input {
            source,
            text: String::from_utf8_lossy(err.as_bytes()).into_owned(),
            lossy: true,
        },
    }
}

struct Current {
    sample: Sample,
    text: Arc<str>,
}

/// Runs the fuzzer. Panics are counted and the run goes on; a hang or memory overrun ends the process (exit status
/// 2) after printing the report so far and the input.
pub fn run(options: &Options) -> Report {
    register_fuzz_features(&options.extra_features);
    let seeds = seeds();
    let report = Arc::new(Mutex::new(Report::default()));
    let current: Arc<Mutex<Option<Current>>> = Arc::new(Mutex::new(None));
    // Nanoseconds since `epoch` at which the running input started; 0 when none runs.
    let epoch = Instant::now();
    let started = Arc::new(AtomicU64::new(0));
    let baseline = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));

    let previous_hook = options.quiet_panics.then(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(|info| {
            let location = info
                .location()
                .map(|l| format!(" at {}:{}", l.file(), l.line()))
                .unwrap_or_default();
            *PANIC_LOCATION.lock().unwrap_or_else(|p| p.into_inner()) = Some(location);
        }));
        previous
    });

    let worker = {
        let (report, current, started, baseline, done) = (
            report.clone(),
            current.clone(),
            started.clone(),
            baseline.clone(),
            done.clone(),
        );
        let options = options.clone();
        std::thread::Builder::new()
            .name("fuzz-config".into())
            .spawn(move || {
                for index in options.start..options.start + options.inputs {
                    // A generator bug must not end the run: count it and go on.
                    let generated = match panic::catch_unwind(|| input(options.seed, index, &seeds))
                    {
                        Ok(generated) => generated,
                        Err(payload) => {
                            let mut r = report.lock().unwrap();
                            r.generator_panics += 1;
                            let location = PANIC_LOCATION
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .take()
                                .unwrap_or_default();
                            if r.generator_panics == 1 {
                                eprintln!(
                                    "generator panic at input #{index}: {}{location}",
                                    panic_message(&*payload)
                                );
                            }
                            continue;
                        }
                    };
                    let text: Arc<str> = Arc::from(generated.text);
                    let mut sample = Sample {
                        index,
                        source: generated.source,
                        len: text.len(),
                        value: 0,
                    };
                    *current.lock().unwrap() = Some(Current {
                        sample: sample.clone(),
                        text: text.clone(),
                    });
                    let base = live_bytes().unwrap_or(0);
                    baseline.store(base, Ordering::Relaxed);
                    PEAK.store(base, Ordering::Relaxed);
                    let t0 = Instant::now();
                    started.store((t0 - epoch).as_nanos().max(1) as u64, Ordering::Relaxed);
                    let outcome = panic::catch_unwind(AssertUnwindSafe(|| check(&text)));
                    let elapsed = t0.elapsed();
                    started.store(0, Ordering::Relaxed);
                    let peak =
                        live_bytes().map(|_| PEAK.load(Ordering::Relaxed).saturating_sub(base));
                    sample.value = elapsed.as_nanos() as u64;

                    let mut r = report.lock().unwrap();
                    r.inputs += 1;
                    *r.sources.entry(generated.source).or_default() += 1;
                    *r.source_time.entry(generated.source).or_default() += elapsed;
                    r.lossy_utf8 += u64::from(generated.lossy);
                    if sample.value > r.slowest.value {
                        r.slowest = sample.clone();
                    }
                    if sample.len > r.largest_input.len {
                        r.largest_input = sample.clone();
                    }
                    if let Some(peak) = peak {
                        let m = Sample {
                            value: peak as u64,
                            ..sample.clone()
                        };
                        if r.peak_memory.as_ref().is_none_or(|p| m.value > p.value) {
                            r.peak_memory = Some(m.clone());
                        }
                        if sample.len > 1024 {
                            let ratio = peak as f64 / sample.len as f64;
                            if r.peak_memory_ratio.as_ref().is_none_or(|(q, _)| ratio > *q) {
                                r.peak_memory_ratio = Some((ratio, m));
                            }
                        }
                    }
                    match outcome {
                        Ok(Checked::Accepted { calls }) => {
                            r.ok += 1;
                            *r.source_ok.entry(generated.source).or_default() += 1;
                            r.calls += calls;
                        }
                        Ok(Checked::Rejected {
                            kind,
                            has_line,
                            message_len,
                            example,
                        }) => {
                            *r.errors.entry(kind.clone()).or_default() += 1;
                            r.error_examples.entry(kind).or_insert((index, example));
                            r.errors_with_line += u64::from(has_line);
                            if message_len as u64 > r.longest_error.value {
                                r.longest_error = Sample {
                                    value: message_len as u64,
                                    ..sample.clone()
                                };
                            }
                        }
                        Err(payload) => {
                            r.panic_count += 1;
                            if r.panics.len() < 20 {
                                let message = panic_message(&*payload);
                                let location = PANIC_LOCATION
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .take()
                                    .unwrap_or_default();
                                let saved = save(&options.save_dir, "panic", index, &text);
                                r.panics.push(Finding {
                                    sample: sample.clone(),
                                    message: format!("{message}{location}"),
                                    saved,
                                });
                            }
                        }
                    }
                }
                done.store(true, Ordering::Release);
            })
            .expect("spawn the fuzz worker")
    };

    // The watchdog: time and memory of the running input, progress.
    let mut last_progress = Instant::now();
    while !done.load(Ordering::Acquire) && !worker.is_finished() {
        std::thread::sleep(Duration::from_millis(20));
        let since = started.load(Ordering::Relaxed);
        let running =
            (since != 0).then(|| epoch.elapsed().saturating_sub(Duration::from_nanos(since)));
        let over_time = running.is_some_and(|t| t > options.time_limit);
        let memory = live_bytes().map(|live| live.saturating_sub(baseline.load(Ordering::Relaxed)));
        let over_memory = since != 0 && memory.is_some_and(|m| m > options.memory_limit);
        if over_time || over_memory {
            let what = if over_time {
                format!("HANG: one input ran longer than {:?}", options.time_limit)
            } else {
                format!(
                    "MEMORY: one input holds more than {} MiB",
                    options.memory_limit >> 20
                )
            };
            let snapshot = current.lock().unwrap_or_else(|p| p.into_inner());
            let (sample, saved) = match snapshot.as_ref() {
                Some(c) => (
                    c.sample.clone(),
                    save(&options.save_dir, "hang-or-memory", c.sample.index, &c.text),
                ),
                None => (Sample::default(), None),
            };
            let mut r = report.lock().unwrap_or_else(|p| p.into_inner()).clone();
            r.elapsed = epoch.elapsed();
            eprintln!("{r}");
            eprintln!(
                "{what}: #{} ({}, {} bytes){}; replay with --seed {} --start {} --inputs 1",
                sample.index,
                sample.source,
                sample.len,
                saved
                    .map(|p| format!(", saved to {}", p.display()))
                    .unwrap_or_default(),
                options.seed,
                sample.index
            );
            std::process::exit(2);
        }
        if let Some(every) = options.progress
            && last_progress.elapsed() >= every
        {
            last_progress = Instant::now();
            let r = report.lock().unwrap_or_else(|p| p.into_inner());
            eprintln!(
                "[{:.0} s] {} inputs, {} ok, {} panics, slowest {:.1} ms",
                epoch.elapsed().as_secs_f64(),
                r.inputs,
                r.ok,
                r.panic_count,
                r.slowest.value as f64 / 1e6
            );
        }
    }
    worker.join().expect("the fuzz worker catches every panic");
    if let Some(previous) = previous_hook {
        panic::set_hook(previous);
    }
    let mut report = report.lock().unwrap().clone();
    report.elapsed = epoch.elapsed();
    report
}

static PANIC_LOCATION: Mutex<Option<String>> = Mutex::new(None);

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(non-string panic payload)".into())
}

fn save(dir: &Option<PathBuf>, what: &str, index: u64, text: &str) -> Option<PathBuf> {
    let dir = dir.as_ref()?;
    std::fs::create_dir_all(dir).ok()?;
    let path = dir.join(format!("{what}-{index}.yaml"));
    std::fs::write(&path, text).ok()?;
    Some(path)
}

// ---------------------------------------------------------------------------------------------------------------
// One input

enum Checked {
    Accepted {
        calls: u64,
    },
    Rejected {
        kind: String,
        has_line: bool,
        message_len: usize,
        example: String,
    },
}

/// Parses one input and, if accepted, asks the config what the debug path asks it.
fn check(text: &str) -> Checked {
    match Config::parse(text, "fuzz.yaml") {
        Ok(config) => Checked::Accepted {
            calls: exercise(&config),
        },
        Err(err) => {
            let message = err.to_string();
            Checked::Rejected {
                kind: error_kind(&err),
                has_line: err.location.line.is_some(),
                message_len: message.chars().count(),
                example: clip(&message, 160),
            }
        }
    }
}

fn clip(text: &str, max: usize) -> String {
    let one_line = text.replace('\n', "\\n");
    match one_line.char_indices().nth(max) {
        Some((cut, _)) => format!("{}...", &one_line[..cut]),
        None => one_line,
    }
}

/// The error's kind: the `ConfigErrorKind` variant, with YAML syntax errors split by cause.
fn error_kind(err: &ConfigError) -> String {
    let debug = format!("{:?}", err.kind);
    let variant: String = debug
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    if variant != "Syntax" {
        return variant;
    }
    let message = err.kind.to_string();
    let cause = [
        ("repetition limit exceeded", "alias dereference limit"),
        ("aliases expand the document", "alias expansion budget"),
        ("levels deep", "flow nesting pre-scan"),
        ("recursion limit exceeded", "nesting limit"),
        ("duplicate entry", "duplicate key"),
        ("more than one document", "several documents"),
        ("unknown anchor", "undefined alias"),
        ("invalid type", "invalid type"),
        ("failed to parse YAML number", "number"),
        ("empty YAML tag", "empty tag"),
        ("control characters are not allowed", "control character"),
        ("found character that cannot start any token", "bad token"),
        ("mapping values are not allowed", "mapping value here"),
        ("did not find expected", "missing expected token"),
        ("found undefined tag handle", "undefined tag handle"),
        ("while scanning", "scanner"),
        ("while parsing", "parser"),
    ]
    .into_iter()
    .find(|(needle, _)| message.contains(needle))
    .map_or("other", |(_, cause)| cause);
    format!("Syntax/{cause}")
}

const LAYERS: [&str; 6] = [
    "decoder.1.self_attention.layernorm_qkv",
    "decoder.12.layernorm_mlp.fc1",
    "fc2",
    "model.layers.3.attn.proj",
    "",
    "block7x8_linear",
];
const ITERATIONS: [u64; 5] = [0, 1, 4, 1000, 1 << 40];
const GEMMS: [Gemm; 3] = [Gemm::Fprop, Gemm::Dgrad, Gemm::Wgrad];

/// The calls the debug path makes on a config: the section of each layer, each feature's logged stats and routing
/// answers. Returns how many calls it made.
fn exercise(config: &Config) -> u64 {
    let mut calls = 0;
    for layer in LAYERS {
        for kind in [None, Some("linear"), Some("layernorm_linear")] {
            let _ = config.section_for(layer, kind);
            calls += 1;
        }
    }
    for section in config.sections.iter().take(64) {
        for layer in LAYERS {
            section.selector.matches(layer, Some("linear"));
            calls += 1;
        }
        for feature in section.features.iter().take(64) {
            let _ = feature.name();
            let _ = feature.logged_stats();
            calls += 2;
            for iteration in ITERATIONS {
                for tensor in TensorName::ALL {
                    let _ = feature.inspect_tensor_enabled(LAYERS[0], tensor, iteration);
                    calls += 1;
                }
                for gemm in GEMMS {
                    let _ = feature.fp8_gemm_enabled(LAYERS[0], gemm, iteration);
                    calls += 1;
                    for tensor in TensorName::INPUTS {
                        let _ = feature.modify_tensor_enabled(LAYERS[0], gemm, tensor, iteration);
                        calls += 1;
                    }
                }
            }
        }
    }
    calls
}

/// A custom feature that reads its entry through the public `FeatureSpec` API with every key allowed: GEMMs and
/// tensors optional, typed reads of a few keys, a schedule per item.
struct FuzzFeature {
    name: String,
    entries: Vec<(Option<Gemm>, Option<TensorName>, Schedule)>,
}

impl FuzzFeature {
    fn from_spec(spec: &FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> {
        let items = spec.items(Need::Optional, Need::Optional, &TensorName::ALL, None)?;
        let mut entries = Vec::new();
        for item in &items {
            item.f64("threshold")?;
            item.u64("count")?;
            item.bool("inspect_only_once")?;
            item.str("label")?;
            entries.push((item.gemm, item.tensor, item.schedule()?));
        }
        Ok(Box::new(FuzzFeature {
            name: spec.name.clone(),
            entries,
        }))
    }
}

impl Feature for FuzzFeature {
    fn name(&self) -> &str {
        &self.name
    }

    fn fp8_gemm_enabled(&self, _layer: &str, gemm: Gemm, iteration: u64) -> Option<Routing> {
        let schedules = self
            .entries
            .iter()
            .filter(|e| e.0 == Some(gemm))
            .map(|e| &e.2);
        Schedule::routing(schedules, iteration)
    }

    fn inspect_tensor_enabled(
        &self,
        _layer: &str,
        tensor: TensorName,
        iteration: u64,
    ) -> Option<Routing> {
        let schedules = self
            .entries
            .iter()
            .filter(|e| e.1.is_none_or(|t| t == tensor))
            .map(|e| &e.2);
        Schedule::routing(schedules, iteration)
    }
}

fn register_fuzz_features(extra: &[String]) {
    let names = [
        (Namespace::TransformerEngine, "FuzzFeature"),
        (Namespace::Base, "FuzzFeature"),
    ]
    .into_iter()
    .map(|(ns, name)| (ns, name.to_string()))
    .chain(
        extra
            .iter()
            .map(|name| (Namespace::TransformerEngine, name.clone())),
    );
    for (namespace, name) in names {
        // Already registered (an earlier run in this process, or the application's own feature): keep it.
        let _ = register_feature(namespace, &name, FuzzFeature::from_spec);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Randomness

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast and good enough for test-input generation. `noise` scales the
/// probability of the grammar generator's deliberate mistakes (0: a valid config).
pub struct Rng {
    state: u64,
    noise: f64,
}

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng {
            state: seed,
            noise: 1.0,
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// A deliberate mistake of probability `p` (never in a valid config).
    fn odd(&mut self, p: f64) -> bool {
        self.chance(p * self.noise)
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    /// Log-uniform in `1..=max`: small sizes often, large ones sometimes.
    fn size(&mut self, max: usize) -> usize {
        let bits = (usize::BITS - max.max(1).leading_zeros()) as usize;
        let top = (1usize << self.below(bits)).min(max);
        self.range(top.div_ceil(2).max(1), top)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Vocabulary

const FEATURES: [&str; 12] = [
    "LogTensorStats",
    "LogFp8TensorStats",
    "DisableFP8GEMM",
    "DisableQuantizationGEMM",
    "DisableFP8Layer",
    "DisableQuantizationLayer",
    "PerTensorScaling",
    "FakeQuant",
    "DumpTensors",
    "FuzzFeature",
    "TestDummyFeature",
    "PercentageGreaterThanThreshold",
];

const FEATURE_KEYS: [&str; 17] = [
    "enabled",
    "gemms",
    "gemms_struct",
    "tensors",
    "tensors_struct",
    "stats",
    "freq",
    "start_step",
    "end_step",
    "start_end_list",
    "margin",
    "quant_format",
    "high_precision_tensor",
    "quantized_tensor",
    "threshold",
    "inspect_only_once",
    "label",
];

const OTHER_KEYS: [&str; 16] = [
    "layers",
    "transformer_engine",
    "layer_name_regex_pattern",
    "layer_types",
    "layer_numbers",
    "exact_layer_names",
    "gemm",
    "tensor",
    "<<",
    "",
    "~",
    "null",
    "1",
    "true",
    "ключ",
    "Enabled",
];

const GEMM_NAMES: [&str; 6] = ["fprop", "dgrad", "wgrad", "Fprop", "", "wgrad2"];
/// Tensor names: the three GEMM inputs, the three outputs, then invalid ones.
const TENSOR_NAMES: [&str; 9] = [
    "activation",
    "weight",
    "gradient",
    "output",
    "wgrad",
    "dgrad",
    "Activation",
    "",
    "activations",
];

const STATS: [&str; 14] = [
    "min",
    "max",
    "mean",
    "std",
    "l1_norm",
    "l2_norm",
    "cur_amax",
    "dynamic_range",
    "max_blockwise_dynamic_range",
    "underflows%",
    "overflows%",
    "scale_inv_min",
    "scale_inv_max",
    "mse",
];
const STAT_PREFIXES: [&str; 6] = [
    "",
    "fp8_delayed_scaling_",
    "fp8_current_scaling_",
    "mxfp8_",
    "fp8_block_scaling_",
    "nvfp4_",
];

const QUANT_FORMATS: [&str; 6] = [
    "FP8E4M3",
    "FP8E5M2",
    "MXFP8E4M3",
    "MXFP8E5M2",
    "FP4",
    "fp8e4m3",
];

/// Scalars written as-is: numbers at and beyond every limit, YAML 1.1/1.2 spellings, tags, nulls.
const SCALARS: [&str; 44] = [
    "0",
    "1",
    "-1",
    "-0",
    "2",
    "5",
    "100",
    "1.5",
    "-0.0",
    "1e400",
    "-1e400",
    "1e-400",
    ".nan",
    "nan",
    "NaN",
    ".inf",
    "-.inf",
    "+.inf",
    "18446744073709551615",
    "18446744073709551616",
    "9223372036854775807",
    "-9223372036854775808",
    "-9223372036854775809",
    "4294967296",
    "0x10",
    "0o17",
    "0b101",
    "1_000",
    "~",
    "null",
    "true",
    "false",
    "True",
    "yes",
    "no",
    "on",
    "'1'",
    "\"true\"",
    "\"\"",
    "2001-12-14",
    "!!str 5",
    "!!int x",
    "!!binary aGVsbG8=",
    "!custom 1",
];

/// Regexes: five valid ones, then malformed ones, then two that compile past the regex crate's size limit.
const REGEXES: [&str; 16] = [
    ".*",
    ".*fc1",
    "fc[12]",
    "^decoder\\.\\d+\\..*$",
    "(?i)LAYERNORM",
    "(",
    "a{2,1}",
    "[z-a]",
    "\\",
    "(?P<n>x)(?P<n>y)",
    "(a|b)*c",
    "\\p{Greek}+",
    "",
    "[[:alpha:]]",
    "x{1000}{1000}",
    "\\w{500}",
];

const LAYER_TYPES: [&str; 9] = [
    "fc1",
    "fc2",
    "qkv",
    "layernorm_linear",
    "linear",
    "all",
    "",
    "proj",
    "layernorm_qkv",
];

/// `layer_numbers` entries: six valid ones, then odd ones.
const NUMBER_SPECS: [&str; 16] = [
    "0",
    "1",
    "5",
    "\"1-3\"",
    "all",
    "\"0-18446744073709551615\"",
    "\"3-1\"",
    "a-b",
    "\"-\"",
    "1-",
    "18446744073709551615",
    "99999999999999999999",
    "-1",
    "1.5",
    "\"1--2\"",
    "\" 2 - 4 \"",
];

const SECTION_NAMES: [&str; 8] = [
    "section",
    "example_section",
    "test",
    "deummy_feature_everywhere",
    "",
    "123",
    "null",
    "true",
];

const LAYER_NAMES: [&str; 5] = [
    "decoder.1.self_attention.layernorm_qkv",
    "fc1",
    "fc2",
    "",
    "model.layers.3.attn.proj",
];

// ---------------------------------------------------------------------------------------------------------------
// Mutations

/// YAML punctuation and structure characters.
const PUNCTUATION: &[u8] = b":-[]{},&*!|>'\"#%@`?\n\t \\";

const TOKENS: [&str; 24] = [
    ": ",
    "- ",
    "[",
    "]",
    "{",
    "}",
    "&a ",
    "*a",
    "!!str ",
    "? ",
    "|\n",
    ">-\n",
    "'",
    "\"",
    "# ",
    "\n",
    "\t",
    "  ",
    "---\n",
    "...\n",
    "<<: *a\n",
    "%YAML 1.2\n---\n",
    "\u{FEFF}",
    "\r\n",
];

fn lines(bytes: &[u8]) -> Vec<Vec<u8>> {
    bytes.split(|&b| b == b'\n').map(<[u8]>::to_vec).collect()
}

fn join(lines: &[Vec<u8>]) -> Vec<u8> {
    lines.join(&b'\n')
}

const MAX_MUTATED: usize = 512 * 1024;

fn mutate(rng: &mut Rng, bytes: &mut Vec<u8>, seeds: &[(String, String)]) {
    if bytes.is_empty() {
        bytes.extend_from_slice(rng.pick(&TOKENS).as_bytes());
        return;
    }
    let at = rng.below(bytes.len() + 1);
    match rng.below(15) {
        0 => {
            let i = rng.below(bytes.len());
            bytes[i] ^= 1 << rng.below(8);
        }
        1 => {
            let i = rng.below(bytes.len());
            bytes[i] = PUNCTUATION[rng.below(PUNCTUATION.len())];
        }
        2 => {
            let token = rng.pick(&TOKENS);
            bytes.splice(at..at, token.bytes());
        }
        3 => {
            let len = rng.size(64).min(bytes.len() - at.min(bytes.len()));
            bytes.drain(at..at + len);
        }
        4..=7 => {
            let mut ls = lines(bytes);
            let i = rng.below(ls.len());
            match rng.below(4) {
                0 => {
                    let line = ls[i].clone();
                    ls.insert(i, line);
                }
                1 if ls.len() > 1 => {
                    ls.remove(i);
                }
                2 => {
                    let j = rng.below(ls.len());
                    ls.swap(i, j);
                }
                _ => {
                    // Splice lines of another config.
                    let (_, other) = &seeds[rng.below(seeds.len())];
                    let other = lines(other.as_bytes());
                    let from = rng.below(other.len());
                    let n = rng.size(8).min(other.len() - from);
                    let remove = rng.below(4).min(ls.len() - i);
                    ls.splice(i..i + remove, other[from..from + n].iter().cloned());
                }
            }
            *bytes = join(&ls);
        }
        8 | 9 => {
            // Replace a value (after `: `) or a key (before `:`) on a line.
            let mut ls = lines(bytes);
            let i = rng.below(ls.len());
            let line = &ls[i];
            if let Some(colon) = line.iter().position(|&b| b == b':') {
                let new = if rng.chance(0.5) {
                    let mut new = line[..=colon].to_vec();
                    new.push(b' ');
                    new.extend_from_slice(random_scalar(rng).as_bytes());
                    new
                } else {
                    let indent = line.iter().take_while(|&&b| b == b' ' || b == b'-').count();
                    let mut new = line[..indent.min(colon)].to_vec();
                    new.extend_from_slice(random_key(rng).as_bytes());
                    new.extend_from_slice(&line[colon..]);
                    new
                };
                ls[i] = new;
                *bytes = join(&ls);
            }
        }
        10 => {
            // Indent or dedent a line.
            let mut ls = lines(bytes);
            let i = rng.below(ls.len());
            let n = rng.range(1, 4);
            if rng.chance(0.5) {
                ls[i].splice(0..0, std::iter::repeat_n(b' ', n));
            } else {
                let spaces = ls[i].iter().take_while(|&&b| b == b' ').count();
                ls[i].drain(..n.min(spaces));
            }
            *bytes = join(&ls);
        }
        11 => bytes.truncate(at),
        12 => {
            // Repeat a block of lines.
            let ls = lines(bytes);
            let i = rng.below(ls.len());
            let n = rng.size(8).min(ls.len() - i);
            let times = rng.size(300);
            let mut out = ls[..i + n].to_vec();
            for _ in 0..times {
                out.extend(ls[i..i + n].iter().cloned());
            }
            out.extend(ls[i + n..].iter().cloned());
            *bytes = join(&out);
        }
        13 => {
            let n = rng.range(1, 8);
            let random: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            bytes.splice(at..at, random);
        }
        _ => {
            // Replace an identifier-like word with a vocabulary word.
            let word = match rng.below(6) {
                0 => rng.pick(&FEATURES),
                1 => rng.pick(&FEATURE_KEYS),
                2 => rng.pick(&STATS),
                3 => rng.pick(&TENSOR_NAMES),
                4 => rng.pick(&GEMM_NAMES),
                _ => rng.pick(&SCALARS),
            };
            let start = (0..at.min(bytes.len()))
                .rev()
                .find(|&i| !bytes[i].is_ascii_alphanumeric() && bytes[i] != b'_')
                .map_or(0, |i| i + 1);
            let end = (at..bytes.len())
                .find(|&i| !bytes[i].is_ascii_alphanumeric() && bytes[i] != b'_')
                .unwrap_or(bytes.len());
            bytes.splice(start..end.max(start), word.bytes());
        }
    }
    bytes.truncate(MAX_MUTATED);
}

fn random_scalar(rng: &mut Rng) -> String {
    match rng.below(10) {
        0 => "9".repeat(rng.size(400)),
        1 => format!("{}", rng.next_u64() as i64),
        2 => format!("{:e}", f64::from_bits(rng.next_u64())),
        3 => format!("[{}, {}]", rng.pick(&SCALARS), rng.pick(&SCALARS)),
        4 => rng.pick(&TENSOR_NAMES).to_string(),
        5 => rng.pick(&STATS).to_string(),
        _ => rng.pick(&SCALARS).to_string(),
    }
}

fn random_key(rng: &mut Rng) -> String {
    match rng.below(4) {
        0 => rng.pick(&FEATURES).to_string(),
        1 => rng.pick(&OTHER_KEYS).to_string(),
        _ => rng.pick(&FEATURE_KEYS).to_string(),
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Grammar-aware configs

/// A YAML node to emit. `Raw` is written as-is (numbers, tags, quoted strings, deliberate junk).
enum Node {
    Raw(String),
    Seq(Vec<Node>),
    Map(Vec<(String, Node)>),
}

fn raw(s: impl Into<String>) -> Node {
    Node::Raw(s.into())
}

/// A string as a YAML scalar: plain when that reads back as the same string, else single-quoted.
fn text(s: &str) -> Node {
    let plain = !s.is_empty()
        && s.chars().all(|c| c.is_alphanumeric() || "._/%".contains(c))
        && s.chars()
            .next()
            .is_some_and(|c| c.is_alphabetic() || c == '_')
        && !["true", "false", "null", "yes", "no", "on", "off", "y", "n"]
            .contains(&s.to_ascii_lowercase().as_str());
    if plain {
        raw(s)
    } else {
        raw(format!("'{}'", s.replace('\'', "''")))
    }
}

/// One or a list of `item()`s.
fn one_or_many(rng: &mut Rng, max: usize, mut item: impl FnMut(&mut Rng) -> Node) -> Node {
    if rng.chance(0.2) {
        item(rng)
    } else {
        Node::Seq((0..rng.below(max + 1)).map(|_| item(rng)).collect())
    }
}

/// A random value of any type (type confusion).
fn junk(rng: &mut Rng, depth: usize) -> Node {
    match rng.below(if depth > 3 { 2 } else { 5 }) {
        0 => raw(random_scalar(rng)),
        1 => text(rng.pick(&LAYER_NAMES)),
        2 => Node::Seq((0..rng.below(4)).map(|_| junk(rng, depth + 1)).collect()),
        3 => Node::Map(
            (0..rng.below(4))
                .map(|_| (random_key(rng), junk(rng, depth + 1)))
                .collect(),
        ),
        _ => Node::Seq(Vec::new()),
    }
}

/// `node`, or (rarely) a value of another type.
fn maybe_junk(rng: &mut Rng, node: impl FnOnce(&mut Rng) -> Node) -> Node {
    if rng.odd(0.015) {
        junk(rng, 0)
    } else {
        node(rng)
    }
}

/// One of `names`, whose first `valid` entries are valid: the others are picked 8% of the time.
fn name<'a>(rng: &mut Rng, names: &[&'a str], valid: usize) -> &'a str {
    if rng.odd(0.08) && valid < names.len() {
        names[rng.range(valid, names.len() - 1)]
    } else {
        names[rng.below(valid)]
    }
}

fn bool_like(rng: &mut Rng) -> Node {
    if !rng.odd(0.04) {
        raw(rng.pick(&["true", "True", "false"]))
    } else {
        raw(rng.pick(&SCALARS))
    }
}

fn number(rng: &mut Rng) -> Node {
    if rng.odd(0.1) {
        if rng.chance(0.5) {
            raw(rng.pick(&SCALARS))
        } else {
            raw(random_scalar(rng))
        }
    } else {
        raw(format!("{}", rng.pick(&[0u64, 1, 2, 3, 5, 10, 100, 1000])))
    }
}

/// A stat name for `feature` (its own stats mostly), or a `max_blockwise_dynamic_range` map.
fn stat(rng: &mut Rng, feature: &str) -> Node {
    let fp8 = match feature {
        "LogFp8TensorStats" => rng.chance(0.95),
        "LogTensorStats" => rng.chance(0.05),
        _ => rng.chance(0.5),
    };
    match rng.below(40) {
        0..=3 if !fp8 => {
            // max_blockwise_dynamic_range with parameters.
            let mut params = Vec::new();
            for key in ["block_size", "dims", "max_over_orientations", "bogus"] {
                let include = if key == "bogus" {
                    rng.odd(0.05)
                } else {
                    rng.chance(0.5)
                };
                if include {
                    let value = match key {
                        "block_size" => raw(name(
                            rng,
                            &["1", "32", "128", "0", "-4", "18446744073709551615", "1e9"],
                            3,
                        )),
                        "dims" => raw(name(rng, &["1", "2", "3", "0"], 2)),
                        "max_over_orientations" => bool_like(rng),
                        _ => junk(rng, 2),
                    };
                    params.push((key.to_string(), value));
                }
            }
            let stat = name(rng, &["max_blockwise_dynamic_range", "min", "mxfp8_mse"], 1);
            let params = if !rng.odd(0.03) {
                Node::Map(params)
            } else {
                junk(rng, 2)
            };
            Node::Map(vec![(stat.to_string(), params)])
        }
        4 if rng.odd(1.0) => junk(rng, 2),
        _ if fp8 => {
            let suffix = if rng.chance(0.2) { "_columnwise" } else { "" };
            let prefix = name(rng, &STAT_PREFIXES, 5);
            text(&format!("{prefix}{}{suffix}", name(rng, &STATS[9..], 5)))
        }
        _ => text(name(rng, &STATS, 9)),
    }
}

/// The keys `feature` understands (FuzzFeature and the custom names take any key).
fn keys_of(feature: &str) -> &'static [&'static str] {
    match feature {
        "LogTensorStats" | "LogFp8TensorStats" => &[
            "tensors",
            "tensors_struct",
            "stats",
            "freq",
            "start_step",
            "end_step",
            "start_end_list",
        ],
        "DumpTensors" => &[
            "tensors",
            "tensors_struct",
            "high_precision_tensor",
            "quantized_tensor",
            "freq",
            "start_step",
            "end_step",
            "start_end_list",
        ],
        "DisableFP8GEMM" | "DisableQuantizationGEMM" => &["gemms", "gemms_struct"],
        "DisableFP8Layer" | "DisableQuantizationLayer" => &[],
        "PerTensorScaling" => &[
            "gemms",
            "gemms_struct",
            "tensors",
            "tensors_struct",
            "margin",
        ],
        "FakeQuant" => &[
            "gemms",
            "gemms_struct",
            "tensors",
            "tensors_struct",
            "quant_format",
            "margin",
        ],
        _ => &FEATURE_KEYS,
    }
}

/// Keys of `feature`'s entry (`depth` 0) or of one of its struct items.
fn feature_keys(rng: &mut Rng, feature: &str, depth: usize, entries: &mut Vec<(String, Node)>) {
    let known = keys_of(feature);
    for _ in 0..rng.below(6) {
        let key = if rng.odd(0.03) {
            random_key(rng).to_string()
        } else if known.is_empty() {
            if !rng.odd(1.0) {
                continue;
            }
            rng.pick(&FEATURE_KEYS).to_string()
        } else if rng.odd(0.04) {
            rng.pick(&FEATURE_KEYS).to_string()
        } else {
            rng.pick(known).to_string()
        };
        // Mostly distinct keys (a duplicate key is a YAML error that stops the parse early), and the list and
        // struct forms rarely together.
        let twin = match key.as_str() {
            "gemms" => "gemms_struct",
            "gemms_struct" => "gemms",
            "tensors" => "tensors_struct",
            "tensors_struct" => "tensors",
            _ => "",
        };
        if entries.iter().any(|(k, _)| *k == key || *k == twin) && !rng.odd(0.03) {
            continue;
        }
        let tensor_count =
            if feature.contains("Fp8") || feature == "PerTensorScaling" || feature == "FakeQuant" {
                3
            } else {
                6
            };
        let tensor = |r: &mut Rng| text(name(r, &TENSOR_NAMES, tensor_count));
        let value = match key.as_str() {
            "enabled" | "high_precision_tensor" | "quantized_tensor" | "inspect_only_once" => {
                bool_like(rng)
            }
            "gemms" => one_or_many(rng, 3, |r| text(name(r, &GEMM_NAMES, 3))),
            "tensors" => one_or_many(rng, 3, tensor),
            "gemms_struct" if depth < 2 => {
                let names = distinct(rng, &GEMM_NAMES, 3);
                Node::Seq(
                    names
                        .into_iter()
                        .map(|g| struct_item(rng, feature, "gemm", g, depth + 1))
                        .collect(),
                )
            }
            "tensors_struct" if depth < 2 => {
                let names = distinct(rng, &TENSOR_NAMES, tensor_count);
                Node::Seq(
                    names
                        .into_iter()
                        .map(|t| struct_item(rng, feature, "tensor", t, depth + 1))
                        .collect(),
                )
            }
            "stats" => one_or_many(rng, 5, |r| stat(r, feature)),
            "freq" | "start_step" | "end_step" | "margin" | "threshold" => number(rng),
            "start_end_list" => Node::Seq(
                (0..rng.range(1, 3))
                    .map(|_| {
                        if !rng.odd(0.05) {
                            Node::Seq(vec![number(rng), number(rng)])
                        } else {
                            junk(rng, 2)
                        }
                    })
                    .collect(),
            ),
            "quant_format" => text(name(rng, &QUANT_FORMATS, 4)),
            "label" => text(rng.pick(&LAYER_NAMES)),
            _ => junk(rng, 1),
        };
        let value = maybe_junk(rng, |_| value);
        entries.push((key, value));
    }
}

/// 1–3 names of `names` (the first `valid` are valid): distinct, unless by a deliberate mistake.
fn distinct<'a>(rng: &mut Rng, names: &[&'a str], valid: usize) -> Vec<&'a str> {
    let mut out = Vec::new();
    for _ in 0..rng.range(1, 3) {
        let n = name(rng, names, valid);
        if !out.contains(&n) || rng.odd(0.05) {
            out.push(n);
        }
    }
    out
}

fn struct_item(rng: &mut Rng, feature: &str, field: &str, value: &str, depth: usize) -> Node {
    if rng.odd(0.02) {
        return junk(rng, 2);
    }
    let mut entries = Vec::new();
    if !rng.odd(0.03) {
        entries.push((field.to_string(), text(value)));
    }
    feature_keys(rng, feature, depth, &mut entries);
    Node::Map(entries)
}

fn feature(rng: &mut Rng) -> (String, Node) {
    let feature = if rng.odd(0.03) {
        random_key(rng).to_string()
    } else {
        rng.pick(&FEATURES).to_string()
    };
    let mut entries = Vec::new();
    if !rng.odd(0.03) {
        entries.push(("enabled".to_string(), bool_like(rng)));
    }
    // The keys the feature requires (a deliberate mistake leaves one out).
    let required: &[&str] = match feature.as_str() {
        "LogTensorStats" | "LogFp8TensorStats" => &["tensors", "stats"],
        "DumpTensors" => &["tensors"],
        "DisableFP8GEMM" | "DisableQuantizationGEMM" => &["gemms"],
        "PerTensorScaling" => &["gemms", "tensors"],
        "FakeQuant" => &["gemms", "tensors", "quant_format"],
        _ => &[],
    };
    let tensor_count =
        if feature.contains("Fp8") || feature == "PerTensorScaling" || feature == "FakeQuant" {
            3
        } else {
            6
        };
    for &key in required {
        if rng.odd(0.05) {
            continue;
        }
        let value = match key {
            "tensors" => Node::Seq(
                distinct(rng, &TENSOR_NAMES, tensor_count)
                    .into_iter()
                    .map(text)
                    .collect(),
            ),
            "gemms" => Node::Seq(
                distinct(rng, &GEMM_NAMES, 3)
                    .into_iter()
                    .map(text)
                    .collect(),
            ),
            "stats" => Node::Seq((0..rng.range(1, 4)).map(|_| stat(rng, &feature)).collect()),
            _ => text(name(rng, &QUANT_FORMATS, 4)),
        };
        entries.push((key.to_string(), value));
    }
    feature_keys(rng, &feature, 0, &mut entries);
    (feature, maybe_junk(rng, |_| Node::Map(entries)))
}

fn layers(rng: &mut Rng) -> Node {
    let mut entries: Vec<(String, Node)> = Vec::new();
    for _ in 0..rng.range(1, 2) {
        let kinds = if rng.odd(1.0) { 30 } else { 29 };
        let (key, value) = match rng.below(kinds) {
            0..=7 => {
                // The last two patterns compile past the regex crate's size limit, slowly: rarely.
                let regex = if rng.odd(0.005) {
                    REGEXES[rng.range(REGEXES.len() - 2, REGEXES.len() - 1)]
                } else {
                    name(rng, &REGEXES[..REGEXES.len() - 2], 5)
                };
                ("layer_name_regex_pattern", text(regex))
            }
            8..=15 => (
                "layer_types",
                one_or_many(rng, 3, |r| text(name(r, &LAYER_TYPES, 6))),
            ),
            16..=22 => (
                "layer_numbers",
                one_or_many(rng, 3, |r| raw(name(r, &NUMBER_SPECS, 6))),
            ),
            23..=28 => (
                "exact_layer_names",
                one_or_many(rng, 3, |r| text(r.pick(&LAYER_NAMES))),
            ),
            _ => ("bogus_selector", junk(rng, 2)),
        };
        if entries.iter().any(|(k, _)| k == key) && !rng.odd(0.03) {
            continue;
        }
        entries.push((key.to_string(), maybe_junk(rng, |_| value)));
    }
    Node::Map(entries)
}

fn section(rng: &mut Rng) -> Node {
    let mut entries = Vec::new();
    if !rng.odd(0.03) {
        entries.push(("enabled".to_string(), bool_like(rng)));
    }
    if !rng.odd(0.03) {
        entries.push(("layers".to_string(), layers(rng)));
    }
    if rng.chance(0.9) {
        let mut features: Vec<(String, Node)> = Vec::new();
        for _ in 0..rng.range(1, 3) {
            let (name, body) = feature(rng);
            if !features.iter().any(|(n, _)| *n == name) || rng.odd(0.03) {
                features.push((name, body));
            }
        }
        entries.push((
            "transformer_engine".to_string(),
            maybe_junk(rng, |_| Node::Map(features)),
        ));
    }
    if rng.chance(0.2) {
        // A base-namespace feature.
        let (_, body) = feature(rng);
        let name = name(
            rng,
            &["LogTensorStats", "FuzzFeature", "LogFp8TensorStats"],
            2,
        );
        entries.push((name.to_string(), body));
    }
    if entries.len() > 1 && rng.chance(0.3) {
        let i = rng.below(entries.len());
        let j = rng.below(entries.len());
        entries.swap(i, j);
    }
    Node::Map(entries)
}

/// A random config in TE's grammar, as YAML text.
fn grammar_config(rng: &mut Rng) -> String {
    let root = if rng.odd(0.02) {
        junk(rng, 0)
    } else {
        Node::Map(
            (0..rng.range(1, 4))
                .map(|i| {
                    let name = if !rng.odd(0.2) {
                        format!("{}{i}", rng.pick(&SECTION_NAMES))
                    } else {
                        rng.pick(&SECTION_NAMES).to_string()
                    };
                    (name, maybe_junk(rng, section))
                })
                .collect(),
        )
    };
    let mut emitter = Emitter {
        rng,
        out: String::new(),
        anchors: 0,
        flow_all: false,
    };
    emitter.flow_all = emitter.rng.chance(0.15);
    match emitter.rng.below(20) {
        0 => emitter.out.push_str("---\n"),
        1 => emitter.out.push_str("# a comment\n%YAML 1.2\n---\n"),
        2 => emitter.out.push_str("%TAG ! tag:example.com,2000:\n---\n"),
        _ => {}
    }
    emitter.document(&root);
    match emitter.rng.below(30) {
        0 => emitter.out.push_str("...\n"),
        1 if emitter.rng.odd(1.0) => emitter.out.push_str("---\nsecond: document\n"),
        _ => {}
    }
    emitter.out
}

struct Emitter<'a> {
    rng: &'a mut Rng,
    out: String,
    /// Anchors defined so far (`a0`, `a1`, ...).
    anchors: usize,
    /// Emit the whole document in flow style.
    flow_all: bool,
}

impl Emitter<'_> {
    fn document(&mut self, root: &Node) {
        match root {
            Node::Map(entries) if !self.flow_all && !entries.is_empty() => {
                self.map_entries(entries, 0)
            }
            _ => {
                let flow = self.flow(root);
                self.out.push_str(&flow);
                self.out.push('\n');
            }
        }
    }

    /// An alias to an earlier anchor, sometimes.
    fn alias(&mut self) -> Option<String> {
        if self.anchors > 0 && self.rng.odd(0.02) {
            return Some(format!("*a{}", self.rng.below(self.anchors)));
        }
        if self.rng.odd(0.0005) {
            return Some("*undefined".into());
        }
        None
    }

    /// A new anchor, sometimes.
    fn anchor(&mut self) -> Option<String> {
        self.rng.chance(0.04).then(|| {
            self.anchors += 1;
            format!("&a{}", self.anchors - 1)
        })
    }

    fn key(&mut self, key: &str) -> String {
        if self.rng.odd(0.01) {
            // A non-string key.
            return self
                .rng
                .pick(&["[a, b]", "{x: 1}", "1", "~", "true", "? complex"])
                .to_string();
        }
        match text(key) {
            Node::Raw(s) => s,
            _ => unreachable!(),
        }
    }

    fn flow(&mut self, node: &Node) -> String {
        if let Some(alias) = self.alias() {
            return alias;
        }
        let anchor = self.anchor().map(|a| a + " ").unwrap_or_default();
        let body = match node {
            Node::Raw(s) => s.clone(),
            Node::Seq(items) => {
                let items: Vec<String> = items.iter().map(|i| self.flow(i)).collect();
                format!("[{}]", items.join(", "))
            }
            Node::Map(entries) => {
                let entries: Vec<String> = entries
                    .iter()
                    .map(|(k, v)| {
                        let k = self.key(k);
                        let v = self.flow(v);
                        format!("{k}: {v}")
                    })
                    .collect();
                format!("{{{}}}", entries.join(", "))
            }
        };
        anchor + &body
    }

    fn pad(&mut self, indent: usize) {
        self.out.extend(std::iter::repeat_n(' ', indent));
    }

    fn map_entries(&mut self, entries: &[(String, Node)], indent: usize) {
        for (key, value) in entries {
            self.pad(indent);
            let key = self.key(key);
            self.out.push_str(&key);
            self.out.push(':');
            self.after_key(value, indent);
        }
    }

    /// A value after `key:`; its block content is indented past `indent`.
    fn after_key(&mut self, node: &Node, indent: usize) {
        let inline = self.flow_all
            || match node {
                Node::Raw(_) => true,
                Node::Seq(items) => items.is_empty() || self.rng.chance(0.4),
                Node::Map(entries) => entries.is_empty() || self.rng.chance(0.1),
            };
        if inline {
            let flow = self.flow(node);
            self.out.push(' ');
            self.out.push_str(&flow);
            self.out.push('\n');
            return;
        }
        if let Some(alias) = self.alias() {
            self.out.push(' ');
            self.out.push_str(&alias);
            self.out.push('\n');
            return;
        }
        if let Some(anchor) = self.anchor() {
            self.out.push(' ');
            self.out.push_str(&anchor);
        }
        self.out.push('\n');
        match node {
            Node::Seq(items) => self.seq_items(items, indent + 2),
            Node::Map(entries) => self.map_entries(entries, indent + 2),
            Node::Raw(_) => unreachable!(),
        }
    }

    fn seq_items(&mut self, items: &[Node], indent: usize) {
        for item in items {
            self.pad(indent);
            self.out.push_str("- ");
            match item {
                Node::Map(entries) if !entries.is_empty() && self.rng.chance(0.8) => {
                    // `- key: value` with the rest of the mapping under it.
                    let (first, rest) = entries.split_first().unwrap();
                    let key = self.key(&first.0);
                    self.out.push_str(&key);
                    self.out.push(':');
                    self.after_key(&first.1, indent + 2);
                    self.map_entries(rest, indent + 2);
                }
                _ => {
                    let flow = self.flow(item);
                    self.out.push_str(&flow);
                    self.out.push('\n');
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Adversarial inputs

fn adversarial(rng: &mut Rng) -> String {
    let head = "s:\n  enabled: true\n  layers:\n    layer_name_regex_pattern: .*\n";
    match rng.below(12) {
        0 | 1 => {
            // Billion laughs: L levels of F-fold aliases, used where the config parser reads it.
            let levels = rng.range(2, 12);
            let fanout = rng.range(2, 12);
            let maps = rng.chance(0.3);
            let mut out = String::from("a0: &a0 [lol, lol]\n");
            for level in 1..=levels {
                let refs: Vec<String> = (0..fanout)
                    .map(|i| {
                        if maps {
                            format!("k{i}: *a{}", level - 1)
                        } else {
                            format!("*a{}", level - 1)
                        }
                    })
                    .collect();
                let (open, close) = if maps { ("{", "}") } else { ("[", "]") };
                out += &format!("a{level}: &a{level} {open}{}{close}\n", refs.join(", "));
            }
            let top = format!("*a{levels}");
            out += &match rng.below(4) {
                0 => format!(
                    "{head}  transformer_engine:\n    LogTensorStats:\n      enabled: true\n      tensors: [activation]\n      stats: {top}\n"
                ),
                1 => format!("s2:\n  enabled: true\n  layers:\n    layer_types: {top}\n"),
                2 => format!(
                    "{head}  transformer_engine:\n    FuzzFeature: {{enabled: true, tensors_struct: {top}}}\n"
                ),
                _ => format!("s3: {top}\n"),
            };
            out
        }
        2 => {
            // Deep flow nesting.
            let depth = rng.size(200_000);
            let (open, close) = rng.pick(&[("[", "]"), ("{a: ", "}"), ("[{x: ", "}]")]);
            let closed = rng.chance(0.7);
            let mut out = format!(
                "{head}  transformer_engine:\n    FuzzFeature:\n      enabled: true\n      label: "
            );
            out += &open.repeat(depth);
            if closed {
                out += &close.repeat(depth);
            }
            out.push('\n');
            out
        }
        3 => {
            // Deep block nesting.
            let depth = rng.size(1500);
            let mut out = String::new();
            for i in 0..depth {
                out.extend(std::iter::repeat_n(' ', i));
                out += if rng.chance(0.5) { "- " } else { "k: " };
                out.push('\n');
            }
            out
        }
        4 => {
            // Many sections.
            let n = rng.size(5000);
            let mut out = String::new();
            for i in 0..n {
                let selector = match rng.below(3) {
                    0 => format!("layer_name_regex_pattern: 'l{i}\\..*'"),
                    1 => format!("layer_numbers: [{i}]"),
                    _ => format!("exact_layer_names: [l{i}]"),
                };
                out += &format!(
                    "s{i}:\n  enabled: true\n  layers: {{{selector}}}\n  transformer_engine:\n    DisableFP8Layer: {{enabled: true}}\n    LogTensorStats: {{enabled: true, tensors: [activation], stats: [min, max]}}\n"
                );
            }
            out
        }
        5 | 6 => {
            // Long gemms_struct × tensors_struct products and stats lists, written out or as aliases.
            let n = rng.size(3000);
            let m = rng.size(3000);
            let k = rng.size(3000);
            let aliased = rng.chance(0.5);
            let feature = rng.pick(&[
                "FakeQuant",
                "PerTensorScaling",
                "FuzzFeature",
                "LogTensorStats",
                "LogFp8TensorStats",
                "DumpTensors",
            ]);
            let list = |n: usize, item: &str, alias: &str| {
                if aliased && n > 1 {
                    let rest = vec![format!("*{alias}"); n - 1].join(", ");
                    format!("[&{alias} {item}, {rest}]")
                } else {
                    format!("[{}]", vec![item; n].join(", "))
                }
            };
            let gemms = list(n, "{gemm: fprop}", "g");
            let tensors = list(m, "{tensor: activation}", "t");
            let stats = list(k, "min", "st");
            let mut out =
                format!("{head}  transformer_engine:\n    {feature}:\n      enabled: true\n");
            if rng.chance(0.7) {
                out += &format!("      gemms_struct: {gemms}\n");
            } else {
                out += &format!("      gemms: {}\n", list(n, "fprop", "g"));
            }
            if rng.chance(0.7) {
                out += &format!("      tensors_struct: {tensors}\n");
            } else {
                out += &format!("      tensors: {}\n", list(m, "activation", "t"));
            }
            if rng.chance(0.5) {
                out += &format!("      stats: {stats}\n");
            }
            if feature == "FakeQuant" {
                out += "      quant_format: FP8E4M3\n";
            }
            out
        }
        7 => {
            // A huge scalar: key, value, regex or number.
            let n = rng.size(1 << 20);
            match rng.below(4) {
                0 => format!("{}: 1\n", "k".repeat(n)),
                1 => format!(
                    "{head}  transformer_engine:\n    FuzzFeature:\n      enabled: true\n      label: {}\n",
                    "x".repeat(n)
                ),
                2 => format!(
                    "s:\n  enabled: true\n  layers:\n    layer_name_regex_pattern: '{}'\n  transformer_engine:\n    DisableFP8Layer: {{enabled: true}}\n",
                    "(a|".repeat(n / 4 + 1)
                ),
                _ => format!(
                    "{head}  transformer_engine:\n    FuzzFeature:\n      enabled: true\n      freq: {}\n",
                    "9".repeat(n)
                ),
            }
        }
        8 => {
            // Many keys in one mapping (some duplicated).
            let n = rng.size(100_000);
            let dup = rng.chance(0.3);
            let mut out =
                format!("{head}  transformer_engine:\n    FuzzFeature:\n      enabled: true\n");
            for i in 0..n {
                let i = if dup && i == n - 1 { 0 } else { i };
                out += &format!("      key{i}: {i}\n");
            }
            out
        }
        9 => {
            // Many aliases of one large anchor.
            let size = rng.size(5000);
            let refs = rng.size(5000);
            let big = vec!["x"; size].join(", ");
            let aliases = vec!["*big"; refs].join(", ");
            format!(
                "big: &big [{big}]\n{head}  transformer_engine:\n    FuzzFeature:\n      enabled: true\n      label: [{aliases}]\n"
            )
        }
        10 => {
            // Many stats, each a blockwise map.
            let n = rng.size(20_000);
            let stats: Vec<String> = (0..n)
                .map(|i| {
                    format!(
                        "{{max_blockwise_dynamic_range: {{block_size: {}, dims: {}}}}}",
                        i + 1,
                        1 + i % 2
                    )
                })
                .collect();
            format!(
                "{head}  transformer_engine:\n    LogTensorStats:\n      enabled: true\n      tensors: [activation, weight, gradient, output, wgrad, dgrad]\n      stats: [{}]\n",
                stats.join(", ")
            )
        }
        _ => {
            // Many start_end_list ranges and a big cross of struct items with schedules.
            let n = rng.size(50_000);
            let ranges: Vec<String> = (0..n).map(|i| format!("[{i}, {}]", i * 2)).collect();
            format!(
                "{head}  transformer_engine:\n    LogFp8TensorStats:\n      enabled: true\n      tensors: [activation, weight, gradient]\n      stats: [mse, underflows%]\n      start_end_list: [{}]\n",
                ranges.join(", ")
            )
        }
    }
}
