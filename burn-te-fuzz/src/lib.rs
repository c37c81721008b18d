//! # burn-te-fuzz
//!
//! A fuzz harness for burn-te-debug's YAML config parser and feature builders, on [proptest]: the inputs are
//! proptest strategies, so each is reproducible from a seed and shrinks to a minimal failing config.
//!
//! Every input goes through [`Config::parse`](burn_te_debug::config::Config::parse) — the YAML reader, the
//! section and selector parsers and every registered feature's builder, plus a custom feature through the public
//! `FeatureSpec` API ([`check::FuzzFeature`]) — and an accepted config is then asked what the debug path asks it
//! (the section of a few layers, each feature's logged stats and routing answers); a rejected one must give a
//! `ConfigError` ([`check::check`]). The inputs ([`input::inputs`]):
//!
//! - `mutated-seed` (40%): TE's test configs and the examples' configs ([`seeds`]) under 1–8 stacked
//!   [`mutate::Mutation`]s: bytes, lines, keys, values, splices of another config, indentation, truncation,
//!   repeated blocks, invalid UTF-8, vocabulary words.
//! - `grammar` (20%), `grammar-valid` (20%), `grammar-mutated` (18%): configs from TE's grammar
//!   ([`grammar::config`]) with deliberate mistakes, without, and without then mutated.
//! - `adversarial` (2%): billion laughs, wide anchors, deep flow and block nesting, many sections, huge struct and
//!   stats lists, large scalars, many keys ([`adversarial::Adversarial`]).
//!
//! The long run is the crate's binary (`cargo run -p burn-te-fuzz --release -- --cases 1000000`: a watchdog on
//! each input's time and, through a counting global allocator, its memory; statistics in a [`report::Report`]);
//! `cargo test` runs a bounded number of cases (the unit tests of this library).

pub mod adversarial;
pub mod check;
pub mod grammar;
pub mod input;
pub mod mutate;
pub mod report;
pub mod seeds;
pub mod vocab;

use proptest::test_runner::{Config as ProptestConfig, RngAlgorithm, TestRng, TestRunner};

/// The default seed of a run.
pub const DEFAULT_SEED: u64 = 24301;

/// The proptest configuration of one case of a run: no persistence file (the runner prints the seed and the case's
/// index instead, which replay it exactly), shrinking bounded to a minute.
pub fn case_config() -> ProptestConfig {
    ProptestConfig {
        cases: 1,
        failure_persistence: None,
        max_shrink_time: 60_000,
        max_shrink_iters: 4096,
        ..ProptestConfig::default()
    }
}

/// The test runner of case `index` of the run `seed`: its ChaCha generator is keyed by `(seed, index)` only, so a
/// case is the same whatever ran before it (`--start index --cases 1` replays it).
pub fn case_runner(seed: u64, index: u64) -> TestRunner {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&index.to_le_bytes());
    key[16..].copy_from_slice(b"burn-te-fuzz-v1\0");
    TestRunner::new_with_rng(
        case_config(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &key),
    )
}

#[cfg(test)]
mod tests;
