//! Fuzzes burn-te-debug's YAML config parser and feature builders on stable Rust (see `burn_te_suite::fuzz` for the
//! generators and checks): one million inputs by default, each under `catch_unwind` with a time and memory watch.
//!
//! Run: `cargo run --example fuzz_config` (or `-- --inputs 100000 --seed 7`; `-- --print 1234` writes input #1234
//! to stdout; `-- --start 1234 --inputs 1` replays it). Panicking, hanging or memory-hungry inputs are saved under
//! `target/fuzz_config/`. Exit status: 0 when no input panicked, 1 when one did, 2 on a hang or memory overrun.

use std::time::Duration;

use burn_te_suite::fuzz::{self, CountingAlloc, Options};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn main() {
    burn_te_suite::exit_on_error(try_main());
}

fn try_main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| -> Result<Option<u64>, Box<dyn std::error::Error>> {
        match args.iter().position(|a| a == flag) {
            Some(i) => {
                let text = args.get(i + 1).ok_or(format!("{flag} needs a value"))?;
                Ok(Some(
                    text.parse().map_err(|e| format!("{flag} {text}: {e}"))?,
                ))
            }
            None => Ok(None),
        }
    };
    if let Some(unknown) = args.iter().find(|a| {
        a.starts_with("--")
            && ![
                "--inputs",
                "--seed",
                "--start",
                "--time-limit-ms",
                "--memory-limit-mib",
                "--print",
            ]
            .contains(&a.as_str())
    }) {
        return Err(format!(
            "unknown option {unknown} (options: --inputs N, --seed S, --start I, --time-limit-ms T, \
             --memory-limit-mib M, --print I)"
        )
        .into());
    }
    let seed = value("--seed")?.unwrap_or(Options::default().seed);
    if let Some(index) = value("--print")? {
        let input = fuzz::input(seed, index, &fuzz::seeds());
        print!("{}", input.text);
        eprintln!(
            "(input #{index} of seed {seed}: {}, {} bytes{})",
            input.source,
            input.text.len(),
            if input.lossy { ", lossy UTF-8" } else { "" }
        );
        return Ok(());
    }
    let memory_limit = (value("--memory-limit-mib")?.unwrap_or(1024) as usize) << 20;
    // Past the watchdog's limit, allocations fail (the process aborts) before the machine runs out of memory.
    CountingAlloc::set_hard_limit(memory_limit.saturating_mul(4));
    let options = Options {
        inputs: value("--inputs")?.unwrap_or(1_000_000),
        seed,
        start: value("--start")?.unwrap_or(0),
        time_limit: Duration::from_millis(value("--time-limit-ms")?.unwrap_or(10_000)),
        memory_limit,
        save_dir: Some(concat!(env!("CARGO_MANIFEST_DIR"), "/target/fuzz_config").into()),
        progress: Some(Duration::from_secs(30)),
        quiet_panics: true,
        extra_features: vec![
            "TestDummyFeature".into(),
            "PercentageGreaterThanThreshold".into(),
        ],
    };
    eprintln!(
        "fuzzing the config parser: {} inputs from #{}, seed {}, {:?} and {} MiB per input",
        options.inputs,
        options.start,
        options.seed,
        options.time_limit,
        options.memory_limit >> 20
    );
    let report = fuzz::run(&options);
    println!("{report}");
    if report.panic_count > 0 {
        return Err(format!("{} inputs panicked", report.panic_count).into());
    }
    Ok(())
}
