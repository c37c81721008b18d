//! The long fuzz run of burn-te-debug's config parser: `cargo run -p burn-te-fuzz --release -- --cases 1000000`.
//!
//! Case `i` of seed `S` is proptest's strategy run on a generator keyed by `(S, i)` (`burn_te_fuzz::case_runner`),
//! so `--seed S --start I --cases 1` replays it and `--seed S --print I` writes its text to stdout. Each input runs
//! under `catch_unwind`; a panicking one is counted, saved under `target/burn-te-fuzz/` and shrunk by proptest (the
//! minimal input is saved beside it), and the run goes on. A watchdog stops the run on an input that takes longer
//! than `--time-limit-ms` (10 s) or holds more than `--memory-limit-mib` (1 GiB, measured by the counting global
//! allocator below), saving it. Exit status: 0 when no input panicked, 1 when one did, 2 on a hang or memory
//! overrun, 3 on a bad option.

use std::alloc::{GlobalAlloc, Layout, System};
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn_te_fuzz::check::{Outcome, check, register_features};
use burn_te_fuzz::input::{FuzzInput, inputs};
use burn_te_fuzz::report::{Finding, Report, Sample};
use burn_te_fuzz::seeds::{seed_configs, workspace_root};
use burn_te_fuzz::{DEFAULT_SEED, case_runner};
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{TestCaseError, TestError};

// ---------------------------------------------------------------------------------------------------------------
// Memory accounting

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static HARD_LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);

/// A global allocator that counts live bytes. Beyond [`HARD_LIMIT`] allocations fail, which aborts the process: a
/// last resort behind the watchdog's memory limit, so that a runaway input cannot take the machine down.
struct CountingAlloc;

impl CountingAlloc {
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

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

// ---------------------------------------------------------------------------------------------------------------
// Options

struct Options {
    cases: u64,
    seed: u64,
    start: u64,
    time_limit: Duration,
    memory_limit: usize,
    print: Option<u64>,
    shrink: bool,
    progress: Duration,
    save_dir: PathBuf,
}

const USAGE: &str = "options: --cases N (1000000), --seed S (24301), --start I (0), --print I, \
--time-limit-ms T (10000), --memory-limit-mib M (1024), --progress-s P (30), --no-shrink";

fn options() -> Result<Options, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut values = std::collections::BTreeMap::new();
    let mut shrink = true;
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        match flag {
            "--no-shrink" => shrink = false,
            "--cases" | "--seed" | "--start" | "--print" | "--time-limit-ms"
            | "--memory-limit-mib" | "--progress-s" => {
                let text = args.get(i + 1).ok_or(format!("{flag} needs a value"))?;
                let value: u64 = text.parse().map_err(|e| format!("{flag} {text}: {e}"))?;
                values.insert(flag, value);
                i += 1;
            }
            "--help" | "-h" => return Err(USAGE.into()),
            other => return Err(format!("unknown option {other} ({USAGE})")),
        }
        i += 1;
    }
    let value = |flag: &str, default: u64| values.get(flag).copied().unwrap_or(default);
    Ok(Options {
        cases: value("--cases", 1_000_000),
        seed: value("--seed", DEFAULT_SEED),
        start: value("--start", 0),
        time_limit: Duration::from_millis(value("--time-limit-ms", 10_000)),
        memory_limit: (value("--memory-limit-mib", 1024) as usize) << 20,
        print: values.get("--print").copied(),
        shrink,
        progress: Duration::from_secs(value("--progress-s", 30)),
        save_dir: workspace_root().join("target/burn-te-fuzz"),
    })
}

// ---------------------------------------------------------------------------------------------------------------
// The watch on the running input

/// What the watchdog sees of the running input.
struct Watch {
    epoch: Instant,
    /// Nanoseconds since `epoch` at which the running input started; 0 when none runs.
    started: AtomicU64,
    /// Live bytes when it started.
    baseline: AtomicUsize,
    /// The running input.
    current: Mutex<Option<(Sample, Arc<str>)>>,
}

impl Watch {
    fn begin(&self, sample: Sample, text: &str) {
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some((sample, Arc::from(text)));
        let base = LIVE.load(Ordering::Relaxed);
        self.baseline.store(base, Ordering::Relaxed);
        PEAK.store(base, Ordering::Relaxed);
        let now = self.epoch.elapsed().as_nanos().max(1) as u64;
        self.started.store(now, Ordering::Relaxed);
    }

    /// The input's time and memory peak above the baseline.
    fn end(&self) -> (Duration, usize) {
        let started = self.started.swap(0, Ordering::Relaxed);
        let took = self
            .epoch
            .elapsed()
            .saturating_sub(Duration::from_nanos(started));
        let peak = PEAK
            .load(Ordering::Relaxed)
            .saturating_sub(self.baseline.load(Ordering::Relaxed));
        (took, peak)
    }
}

static PANIC_LOCATION: Mutex<Option<String>> = Mutex::new(None);

fn take_panic_location() -> String {
    PANIC_LOCATION
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
        .unwrap_or_default()
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(non-string panic payload)".into())
}

fn save(dir: &Path, name: &str, text: &str) -> Option<PathBuf> {
    std::fs::create_dir_all(dir).ok()?;
    let path = dir.join(name);
    std::fs::write(&path, text).ok()?;
    Some(path)
}

// ---------------------------------------------------------------------------------------------------------------
// The run

fn main() {
    let options = match options() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("{message}");
            std::process::exit(3);
        }
    };
    register_features();
    let seeds: Arc<[_]> = Arc::from(seed_configs());

    if let Some(index) = options.print {
        let strategy = inputs(seeds);
        let mut runner = case_runner(options.seed, index);
        let input: FuzzInput = strategy
            .new_tree(&mut runner)
            .expect("the strategies never reject")
            .current();
        print!("{}", input.text);
        eprintln!(
            "(case #{index} of seed {}: {}, {} bytes{}; {})",
            options.seed,
            input.source,
            input.text.len(),
            if input.lossy { ", lossy UTF-8" } else { "" },
            input.recipe
        );
        return;
    }

    // Past 4× the watchdog's limit, allocations fail (the process aborts) before the machine runs out of memory.
    HARD_LIMIT.store(options.memory_limit.saturating_mul(4), Ordering::Relaxed);
    panic::set_hook(Box::new(|info| {
        let location = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        *PANIC_LOCATION.lock().unwrap_or_else(|p| p.into_inner()) = Some(location);
    }));
    eprintln!(
        "fuzzing the config parser: {} cases from #{}, seed {}, {:?} and {} MiB per input",
        options.cases,
        options.start,
        options.seed,
        options.time_limit,
        options.memory_limit >> 20
    );

    let report = Arc::new(Mutex::new(Report {
        seed: Some(options.seed),
        ..Report::default()
    }));
    let watch = Arc::new(Watch {
        epoch: Instant::now(),
        started: AtomicU64::new(0),
        baseline: AtomicUsize::new(0),
        current: Mutex::new(None),
    });
    let done = Arc::new(AtomicBool::new(false));
    let options = Arc::new(options);

    let worker = {
        let (report, watch, done, options) =
            (report.clone(), watch.clone(), done.clone(), options.clone());
        std::thread::Builder::new()
            .name("fuzz-config".into())
            .spawn(move || {
                // Proptest's boxed strategies stay on the thread that made them.
                let strategy = inputs(seeds);
                for index in options.start..options.start + options.cases {
                    run_case(index, &strategy, &options, &watch, &report);
                }
                done.store(true, Ordering::Release);
            })
            .expect("spawn the fuzz worker")
    };

    // The watchdog: time and memory of the running input, progress.
    let mut last_progress = Instant::now();
    while !done.load(Ordering::Acquire) && !worker.is_finished() {
        std::thread::sleep(Duration::from_millis(20));
        let since = watch.started.load(Ordering::Relaxed);
        let running = (since != 0).then(|| {
            watch
                .epoch
                .elapsed()
                .saturating_sub(Duration::from_nanos(since))
        });
        let over_time = running.is_some_and(|t| t > options.time_limit);
        let memory = LIVE
            .load(Ordering::Relaxed)
            .saturating_sub(watch.baseline.load(Ordering::Relaxed));
        let over_memory = since != 0 && memory > options.memory_limit;
        if over_time || over_memory {
            let what = if over_time {
                format!("HANG: one input ran longer than {:?}", options.time_limit)
            } else {
                format!(
                    "MEMORY: one input holds more than {} MiB",
                    options.memory_limit >> 20
                )
            };
            let current = watch.current.lock().unwrap_or_else(|p| p.into_inner());
            let (sample, saved) = match current.as_ref() {
                Some((sample, text)) => (
                    sample.clone(),
                    save(
                        &options.save_dir,
                        &format!("hang-or-memory-{}-{}.yaml", options.seed, sample.index),
                        text,
                    ),
                ),
                None => (Sample::default(), None),
            };
            let mut r = report.lock().unwrap_or_else(|p| p.into_inner()).clone();
            r.elapsed = watch.epoch.elapsed();
            eprintln!("{r}");
            eprintln!(
                "{what}: #{} ({} bytes){}; replay with --seed {} --start {} --cases 1",
                sample.index,
                sample.len,
                saved
                    .map(|p| format!(", saved to {}", p.display()))
                    .unwrap_or_default(),
                options.seed,
                sample.index
            );
            std::process::exit(2);
        }
        if last_progress.elapsed() >= options.progress {
            last_progress = Instant::now();
            let r = report.lock().unwrap_or_else(|p| p.into_inner());
            eprintln!(
                "[{:.0} s] {} cases, {} accepted, {} panics, slowest {:.1} ms",
                watch.epoch.elapsed().as_secs_f64(),
                r.inputs,
                r.ok,
                r.panic_count,
                r.slowest.value as f64 / 1e6
            );
        }
    }
    worker.join().expect("the fuzz worker catches every panic");
    let mut report = report.lock().unwrap_or_else(|p| p.into_inner()).clone();
    report.elapsed = watch.epoch.elapsed();
    println!("{report}");
    if report.panic_count > 0 {
        eprintln!("{} inputs panicked", report.panic_count);
        std::process::exit(1);
    }
}

/// Generates case `index`, checks it under the watch, records it; shrinks and saves it if it panics.
fn run_case<S: Strategy<Value = FuzzInput>>(
    index: u64,
    strategy: &S,
    options: &Options,
    watch: &Watch,
    report: &Mutex<Report>,
) {
    let t0 = Instant::now();
    let mut runner = case_runner(options.seed, index);
    // A generator bug must not end the run: count it and go on.
    let tree = match panic::catch_unwind(AssertUnwindSafe(|| strategy.new_tree(&mut runner))) {
        Ok(Ok(tree)) => tree,
        Ok(Err(reason)) => {
            eprintln!("generator failure at case #{index}: {reason}");
            report.lock().unwrap().generator_failures += 1;
            return;
        }
        Err(payload) => {
            eprintln!(
                "generator panic at case #{index}: {}{}",
                panic_message(&*payload),
                take_panic_location()
            );
            report.lock().unwrap().generator_failures += 1;
            return;
        }
    };
    let input = tree.current();
    let generation = t0.elapsed();

    let sample = Sample {
        index,
        source: Some(input.source),
        len: input.text.len(),
        value: 0,
    };
    watch.begin(sample.clone(), &input.text);
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| check(&input.text)));
    let (took, peak) = watch.end();

    let finding = match &outcome {
        Ok(_) => None,
        Err(payload) => {
            let message = format!("{}{}", panic_message(&**payload), take_panic_location());
            Some(panicked(
                index, &input, message, tree, runner, options, watch,
            ))
        }
    };
    let mut r = report.lock().unwrap();
    r.generation_time += generation;
    r.record(index, &input, outcome.as_ref().ok(), took, Some(peak));
    if let Some(finding) = finding
        && r.panics.len() < 20
    {
        r.panics.push(finding);
    }
}

/// Saves a panicking input and, unless `--no-shrink`, the minimal input proptest shrinks it to.
fn panicked<T: ValueTree<Value = FuzzInput>>(
    index: u64,
    input: &FuzzInput,
    message: String,
    tree: T,
    mut runner: proptest::test_runner::TestRunner,
    options: &Options,
    watch: &Watch,
) -> Finding {
    let sample = Sample {
        index,
        source: Some(input.source),
        len: input.text.len(),
        value: 0,
    };
    eprintln!(
        "PANIC at case #{index} ({}, {} bytes): {message}; replay with --seed {} --start {index} --cases 1",
        input.source,
        input.text.len(),
        options.seed
    );
    let mut saved: Vec<PathBuf> = save(
        &options.save_dir,
        &format!("panic-{}-{index}.yaml", options.seed),
        &input.text,
    )
    .into_iter()
    .collect();
    let mut message = message;
    if options.shrink {
        let result = runner.run_one(tree, |candidate: FuzzInput| {
            watch.begin(sample.clone(), &candidate.text);
            let outcome = panic::catch_unwind(AssertUnwindSafe(|| check(&candidate.text)));
            watch.end();
            match outcome {
                Ok(Outcome::Accepted { .. } | Outcome::Rejected { .. }) => Ok(()),
                Err(payload) => Err(TestCaseError::fail(format!(
                    "{}{}",
                    panic_message(&*payload),
                    take_panic_location()
                ))),
            }
        });
        if let Err(TestError::Fail(reason, minimal)) = result {
            eprintln!(
                "  shrunk to {} bytes ({}): {reason}",
                minimal.text.len(),
                minimal.recipe
            );
            message += &format!(
                "; shrunk to {} bytes: {}",
                minimal.text.len(),
                burn_te_fuzz::input::clip(&minimal.text.replace('\n', "\\n"), 300)
            );
            saved.extend(save(
                &options.save_dir,
                &format!("panic-{}-{index}-min.yaml", options.seed),
                &minimal.text,
            ));
        }
    }
    Finding {
        sample,
        message,
        saved,
    }
}
