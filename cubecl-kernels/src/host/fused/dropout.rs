//! Dropout, `x ⊙ mask / (1 − p)`, in one pass on rayon's pool, its mask drawn from a counter-based stream so that
//! any element's draw can be made again at its index: the backward and the fused attention core's dropout
//! regenerate the mask instead of storing it (as TE's and FlashAttention's Philox dropout do).
//!
//! Element `i` of the tensor (row-major) is kept when word `i` of the ChaCha8 stream of
//! `ChaCha8Rng::seed_from_u64(seed)` (the `chacha20` crate, the generator family of Burn's own RNG) is below
//! `round((1 − p) · 2³²)`. On AVX-512 the words are made 16 blocks at a time (`super::keystream`), the same
//! bits.

use chacha20::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

use super::{keystream, par_rows};
use crate::host::pool::OutputValues;

/// A dropout's mask: its drop probability and the seed of its stream.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutMask {
    /// The probability of dropping an element, in `[0, 1)`.
    pub prob: f64,
    /// The seed of the ChaCha8 stream the draws are read from.
    pub seed: u64,
}

impl DropoutMask {
    /// An element is kept when its 32-bit draw is below this.
    pub fn keep_below(&self) -> u64 {
        ((1.0 - self.prob) * 4_294_967_296.0).round() as u64
    }

    /// The survivors' factor `1/(1 − p)` (Burn's `Dropout`'s, computed in f64).
    pub fn scale(&self) -> f32 {
        (1.0 / (1.0 - self.prob)) as f32
    }

    /// The stream of draws, to apply the mask to the parts of a tensor at their indices: made 16 blocks at a time
    /// on AVX-512, else [`rng_stream`](Self::rng_stream).
    pub fn stream(&self) -> MaskStream {
        if !keystream::available() {
            return self.rng_stream();
        }
        let key = keystream::Key::new(ChaCha8Rng::seed_from_u64(self.seed).get_seed());
        self.stream_of(Words::Avx512(key))
    }

    /// The same draws from the `chacha20` crate's RNG (what CPUs without AVX-512 use).
    pub fn rng_stream(&self) -> MaskStream {
        self.stream_of(Words::Rng(Box::new(ChaCha8Rng::seed_from_u64(self.seed))))
    }

    fn stream_of(&self, words: Words) -> MaskStream {
        MaskStream {
            words,
            keep_below: self.keep_below(),
            scale: self.scale(),
        }
    }
}

/// A [`DropoutMask`]'s draws, positioned per part.
#[derive(Debug)]
pub struct MaskStream {
    words: Words,
    keep_below: u64,
    scale: f32,
}

/// Where a [`MaskStream`]'s words come from: 16 blocks at a time on AVX-512 ([`keystream`]), else the crate's RNG.
#[derive(Debug)]
enum Words {
    Avx512(keystream::Key),
    /// Boxed: the generator and its 4-block buffer are 320 bytes.
    Rng(Box<ChaCha8Rng>),
}

/// Draws per [`MaskStream::apply`] chunk: the stream's words made or copied out 1 KiB at a time, then applied in a
/// loop that vectorizes (one `next_u32` call per element cost as much as the ChaCha8 blocks themselves).
const CHUNK: usize = keystream::BLOCKS * keystream::BLOCK_WORDS;

impl MaskStream {
    /// Multiplies `values`, the tensor's elements from index `first` on, by their factors: `1/(1 − p)` where kept,
    /// 0 where dropped (a NaN or ∞ dropped stays NaN, as `x · 0` in Burn's `Dropout`).
    pub fn apply(&mut self, values: &mut [f32], first: usize) {
        let mut draws = [0u32; CHUNK];
        match &mut self.words {
            #[cfg(target_arch = "x86_64")]
            Words::Avx512(key) => {
                // Chunks of 16 blocks from the block that holds word `first`, the first one entered at its word.
                let words = keystream::BLOCK_WORDS;
                let (mut block, mut skip) = ((first / words) as u64, first % words);
                let mut rest = values;
                while !rest.is_empty() {
                    // SAFETY: the variant exists only where the CPU has AVX-512F (`keystream::available`).
                    unsafe { keystream::blocks(key, block, &mut draws) };
                    let take = rest.len().min(CHUNK - skip);
                    let (now, later) = rest.split_at_mut(take);
                    scale_kept(now, &draws[skip..skip + take], self.keep_below, self.scale);
                    (rest, skip, block) = (later, 0, block + keystream::BLOCKS as u64);
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Words::Avx512(_) => unreachable!("made only where AVX-512F was detected"),
            Words::Rng(rng) => {
                rng.set_word_pos(first as u128);
                let mut bytes = [0u8; 4 * CHUNK];
                for values in values.chunks_mut(CHUNK) {
                    let (bytes, draws) =
                        (&mut bytes[..4 * values.len()], &mut draws[..values.len()]);
                    // The stream's next words, little-endian (as `next_u32` reads them).
                    rng.fill_bytes(bytes);
                    for (draw, word) in draws.iter_mut().zip(bytes.chunks_exact(4)) {
                        *draw = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
                    }
                    scale_kept(values, draws, self.keep_below, self.scale);
                }
            }
        }
    }
}

/// `values[i] *= scale` where `draws[i]` is below `keep_below`, else `*= 0`.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw", "x86_64+avx2+fma"))]
fn scale_kept(values: &mut [f32], draws: &[u32], keep_below: u64, scale: f32) {
    let Ok(below) = u32::try_from(keep_below) else {
        // Every 32-bit draw is below 2³² (p = 0 keeps all).
        values.iter_mut().for_each(|v| *v *= scale);
        return;
    };
    for (v, &draw) in values.iter_mut().zip(draws) {
        *v *= if draw < below { scale } else { 0.0 };
    }
}

/// `x ⊙ mask / (1 − p)` (the forward, and for the output's gradient the backward).
pub fn dropout(x: &[f32], mask: DropoutMask) -> OutputValues {
    let mut y = OutputValues::for_overwrite(x.len());
    par_rows(x, 1, &mut y, 1, |first, x, y| {
        y.copy_from_slice(x);
        mask.stream().apply(y, first);
    });
    y
}
