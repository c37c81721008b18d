//! A byte-level GPT on real text: the corpus and its windows ([`data`]), the model ([`model`]) and its learning
//! rate ([`schedule`]), shared by `examples/char_gpt.rs` and the tests.
//!
//! Tokens are bytes (vocabulary 256), so any UTF-8 text trains without a tokenizer. The model is built from
//! burn-te's TE modules and runs its GEMMs under the recipe it carries (`None`: f32), so the same code trains in
//! f32 and under every FP8 recipe.
//!
//! The root package depends on Burn only through burn-te (Burn is a dev-dependency of the suite), so this module
//! names Burn through burn-te's re-export; the derive macros resolve `burn::...` through this import.

pub(crate) use burn_te::__private::burn;

pub mod data;
pub mod model;
pub mod schedule;

pub use data::{Corpus, CorpusError, LmBatch, LmBatcher, Split, Window, Windows};
pub use model::{CharGpt, CharGptConfig, LmOutput, cross_entropy};
pub use schedule::{LmSchedule, LmScheduler, warmup_cosine};

use burn_te::{
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling,
    Recipe,
};

/// The recipe names the examples take.
pub const RECIPE_NAMES: &str =
    "f32, delayed, current, block, mxfp8, nvfp4, nvfp4-plain, delayed-dpa, current-dpa";

/// The recipe of a name of [`RECIPE_NAMES`] with TE's defaults (`Ok(None)`: f32): `delayed` (DelayedScaling,
/// HYBRID), `current` (Float8CurrentScaling), `block` (Float8BlockScaling), `mxfp8`, `nvfp4` (TE's NVFP4 recipe:
/// RHT on wgrad, 16×16 weight blocks, stochastic rounding of gradients; TE's `NVTE_NVFP4_DISABLE_*` variables
/// apply), `nvfp4-plain` (NVFP4 without RHT, stochastic rounding or 2D weight blocks), and `delayed-dpa` and
/// `current-dpa` (the per-tensor recipes with TE's `fp8_dpa`: the attention's GEMMs in FP8 too). An unknown name is
/// an error naming the known ones.
pub fn recipe_named(name: &str) -> Result<Option<Recipe>, String> {
    Ok(Some(match name {
        "f32" => return Ok(None),
        "delayed" => DelayedScaling::default().into(),
        "current" => Float8CurrentScaling::default().into(),
        "block" => Float8BlockScaling::default().into(),
        "mxfp8" => MXFP8BlockScaling::default().into(),
        "nvfp4" => NVFP4BlockScaling::from_env().into(),
        "delayed-dpa" => DelayedScaling {
            fp8_dpa: true,
            ..Default::default()
        }
        .into(),
        "current-dpa" => Float8CurrentScaling {
            fp8_dpa: true,
            ..Default::default()
        }
        .into(),
        "nvfp4-plain" => NVFP4BlockScaling {
            disable_rht: true,
            disable_stochastic_rounding: true,
            disable_2d_quantization: true,
        }
        .into(),
        other => {
            return Err(format!(
                "unknown recipe {other:?} (expected one of {RECIPE_NAMES})"
            ));
        }
    }))
}

/// SplitMix64: the seeded generator of the batch order, the synthetic corpus and sampling. Written here so a seed
/// gives the same sequence on every platform and across dependency updates.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`; the modulo bias is negligible for the small `n` used here).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}
