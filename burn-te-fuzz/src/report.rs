//! The statistics of a run: accepted and rejected configs, errors by kind, per-generator counts and times, the
//! slowest input, the largest memory peak (when the runner measures it), the longest error message, panics.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::check::Outcome;
use crate::input::{FuzzInput, Source};

/// One input's identity, for the report.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    /// The case's index in the run.
    pub index: u64,
    /// Its generator.
    pub source: Option<Source>,
    /// Its length in bytes.
    pub len: usize,
    /// The measured quantity (nanoseconds, bytes or characters).
    pub value: u64,
}

impl Sample {
    fn source(&self) -> &'static str {
        self.source.map_or("-", Source::name)
    }
}

/// A panic (or, in the runner, a hang or memory overrun).
#[derive(Clone, Debug)]
pub struct Finding {
    /// The input.
    pub sample: Sample,
    /// What happened.
    pub message: String,
    /// Where the input (and its shrunk form) was saved.
    pub saved: Vec<PathBuf>,
}

/// What a run found.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// The run's seed (the runner's), for the replay line.
    pub seed: Option<u64>,
    /// Inputs run.
    pub inputs: u64,
    /// Accepted configs.
    pub ok: u64,
    /// Rejected configs by error kind (`Syntax/...` split by the YAML error's cause).
    pub errors: BTreeMap<String, u64>,
    /// Rejected configs whose error carries a line number.
    pub errors_with_line: u64,
    /// Inputs per generator.
    pub sources: BTreeMap<Source, u64>,
    /// Accepted configs per generator.
    pub source_ok: BTreeMap<Source, u64>,
    /// Time spent parsing and checking per generator.
    pub source_time: BTreeMap<Source, Duration>,
    /// The first error message of each kind (clipped to 160 characters) and its input's index.
    pub error_examples: BTreeMap<String, (u64, String)>,
    /// Inputs whose bytes were not UTF-8 (parsed after a lossy conversion).
    pub lossy_utf8: u64,
    /// Panics (at most 20 kept; `panic_count` counts all).
    pub panics: Vec<Finding>,
    /// Every panic.
    pub panic_count: u64,
    /// Cases the strategies failed to make (a bug of the harness, not of the parser; they are not run).
    pub generator_failures: u64,
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
    /// Time spent generating inputs (proptest's strategies).
    pub generation_time: Duration,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl Report {
    /// Counts one checked input: `elapsed` is the time of the check, `peak` its memory peak above the baseline
    /// when measured; `outcome` is `None` when the check panicked (the caller records the [`Finding`]).
    pub fn record(
        &mut self,
        index: u64,
        input: &FuzzInput,
        outcome: Option<&Outcome>,
        elapsed: Duration,
        peak: Option<usize>,
    ) {
        let sample = Sample {
            index,
            source: Some(input.source),
            len: input.text.len(),
            value: elapsed.as_nanos() as u64,
        };
        self.inputs += 1;
        *self.sources.entry(input.source).or_default() += 1;
        *self.source_time.entry(input.source).or_default() += elapsed;
        self.lossy_utf8 += u64::from(input.lossy);
        if sample.value > self.slowest.value {
            self.slowest = sample.clone();
        }
        if sample.len > self.largest_input.len {
            self.largest_input = sample.clone();
        }
        if let Some(peak) = peak {
            let m = Sample {
                value: peak as u64,
                ..sample.clone()
            };
            if self.peak_memory.as_ref().is_none_or(|p| m.value > p.value) {
                self.peak_memory = Some(m.clone());
            }
            if sample.len > 1024 {
                let ratio = peak as f64 / sample.len as f64;
                if self
                    .peak_memory_ratio
                    .as_ref()
                    .is_none_or(|(q, _)| ratio > *q)
                {
                    self.peak_memory_ratio = Some((ratio, m));
                }
            }
        }
        match outcome {
            Some(Outcome::Accepted { calls }) => {
                self.ok += 1;
                *self.source_ok.entry(input.source).or_default() += 1;
                self.calls += calls;
            }
            Some(Outcome::Rejected {
                kind,
                has_line,
                message_len,
                example,
            }) => {
                *self.errors.entry(kind.clone()).or_default() += 1;
                self.error_examples
                    .entry(kind.clone())
                    .or_insert_with(|| (index, example.clone()));
                self.errors_with_line += u64::from(*has_line);
                if *message_len as u64 > self.longest_error.value {
                    self.longest_error = Sample {
                        value: *message_len as u64,
                        ..sample
                    };
                }
            }
            None => self.panic_count += 1,
        }
    }

    /// Rejected configs.
    pub fn rejected(&self) -> u64 {
        self.errors.values().sum()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let errors = self.rejected();
        writeln!(
            f,
            "inputs: {}  accepted: {}  rejected: {}  panics: {}  ({:.1} s, {:.0} inputs/s)",
            self.inputs,
            self.ok,
            errors,
            self.panic_count,
            self.elapsed.as_secs_f64(),
            self.inputs as f64 / self.elapsed.as_secs_f64().max(1e-9),
        )?;
        if !self.generation_time.is_zero() {
            writeln!(
                f,
                "generating the inputs (proptest strategies): {:.1} s",
                self.generation_time.as_secs_f64()
            )?;
        }
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
        if self.generator_failures > 0 {
            writeln!(
                f,
                "GENERATOR FAILURES (cases not made): {}",
                self.generator_failures
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
            self.slowest.source(),
            self.slowest.len
        )?;
        match &self.peak_memory {
            Some(m) => writeln!(
                f,
                "largest memory peak of one input: {:.1} MiB (#{} {}, {} bytes)",
                m.value as f64 / (1u64 << 20) as f64,
                m.index,
                m.source(),
                m.len
            )?,
            None => writeln!(f, "memory: not measured (the runner binary measures it)")?,
        }
        if let Some((ratio, m)) = &self.peak_memory_ratio {
            writeln!(
                f,
                "largest memory peak per input byte (inputs > 1 KiB): {ratio:.0} (#{} {}, {} bytes)",
                m.index,
                m.source(),
                m.len
            )?;
        }
        writeln!(
            f,
            "largest input: {} bytes (#{} {}); longest error message: {} chars (#{} {})",
            self.largest_input.len,
            self.largest_input.index,
            self.largest_input.source(),
            self.longest_error.value,
            self.longest_error.index,
            self.longest_error.source()
        )?;
        writeln!(
            f,
            "routing/selector calls on accepted configs: {}",
            self.calls
        )?;
        for panic in &self.panics {
            let saved: Vec<String> = panic
                .saved
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            writeln!(
                f,
                "PANIC #{} ({}, {} bytes): {}{}",
                panic.sample.index,
                panic.sample.source(),
                panic.sample.len,
                panic.message,
                if saved.is_empty() {
                    String::new()
                } else {
                    format!(" [saved: {}]", saved.join(", "))
                }
            )?;
            if let Some(seed) = self.seed {
                writeln!(
                    f,
                    "  replay: cargo run -p burn-te-fuzz --release -- --seed {seed} --start {} --cases 1",
                    panic.sample.index
                )?;
            }
        }
        Ok(())
    }
}
