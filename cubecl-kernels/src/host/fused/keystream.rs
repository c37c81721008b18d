//! The ChaCha8 keystream of dropout's masks, 16 blocks at a time on AVX-512: one block per 32-bit lane, the
//! quarter-rounds on whole registers with AVX-512's rotates, the blocks transposed into stream order at the end.
//! The words of the `chacha20` crate's `ChaCha8Rng` for the same key, bit for bit (its RNG runs 4 blocks at a time
//! on AVX2: about 3.6 % of an FP8 TransformerLayer step with dropout on Zen 5). Elsewhere the crate's RNG serves.

/// Blocks per call: one per lane of a 512-bit register.
pub(super) const BLOCKS: usize = 16;

/// Words per block.
pub(super) const BLOCK_WORDS: usize = 16;

/// The state of `ChaCha8Rng::from_seed(key)` apart from its block counter: the constants, the key's words (little
/// endian) and the stream (0).
#[derive(Clone, Copy, Debug)]
pub(super) struct Key([u32; 16]);

impl Key {
    /// The state of a generator seeded with `key`.
    pub(super) fn new(key: [u8; 32]) -> Self {
        let mut state = [0u32; 16];
        state[..4].copy_from_slice(&[0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574]);
        for (word, bytes) in state[4..12].iter_mut().zip(key.chunks_exact(4)) {
            *word = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        }
        Self(state)
    }
}

/// Whether this CPU runs [`blocks`] (AVX-512F).
pub(super) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Blocks `first ..+16` of `key`'s stream, in order: word `w` of block `first + b` at `out[16 b + w]`.
///
/// # Safety
/// The CPU has AVX-512F ([`available`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn blocks(key: &Key, first: u64, out: &mut [u32; BLOCKS * BLOCK_WORDS]) {
    use std::arch::x86_64::*;
    // Block `first + b`'s 64-bit counter, low and high words, in lane `b`.
    let counter = |b: usize| first.wrapping_add(b as u64);
    let low: [u32; BLOCKS] = std::array::from_fn(|b| counter(b) as u32);
    let high: [u32; BLOCKS] = std::array::from_fn(|b| (counter(b) >> 32) as u32);
    // SAFETY: 16 words read from each 16-word array.
    let (low, high) = unsafe {
        (
            _mm512_loadu_si512(low.as_ptr().cast()),
            _mm512_loadu_si512(high.as_ptr().cast()),
        )
    };
    let start: [__m512i; 16] = std::array::from_fn(|i| match i {
        12 => low,
        13 => high,
        _ => _mm512_set1_epi32(key.0[i] as i32),
    });
    let mut x = start;
    macro_rules! quarter {
        ($a:literal, $b:literal, $c:literal, $d:literal) => {
            x[$a] = _mm512_add_epi32(x[$a], x[$b]);
            x[$d] = _mm512_rol_epi32::<16>(_mm512_xor_si512(x[$d], x[$a]));
            x[$c] = _mm512_add_epi32(x[$c], x[$d]);
            x[$b] = _mm512_rol_epi32::<12>(_mm512_xor_si512(x[$b], x[$c]));
            x[$a] = _mm512_add_epi32(x[$a], x[$b]);
            x[$d] = _mm512_rol_epi32::<8>(_mm512_xor_si512(x[$d], x[$a]));
            x[$c] = _mm512_add_epi32(x[$c], x[$d]);
            x[$b] = _mm512_rol_epi32::<7>(_mm512_xor_si512(x[$b], x[$c]));
        };
    }
    // ChaCha8: four double rounds (columns, then diagonals).
    for _ in 0..4 {
        quarter!(0, 4, 8, 12);
        quarter!(1, 5, 9, 13);
        quarter!(2, 6, 10, 14);
        quarter!(3, 7, 11, 15);
        quarter!(0, 5, 10, 15);
        quarter!(1, 6, 11, 12);
        quarter!(2, 7, 8, 13);
        quarter!(3, 4, 9, 14);
    }
    let words: [__m512i; 16] = std::array::from_fn(|i| _mm512_add_epi32(x[i], start[i]));
    // Row `i` holds word `i` of every block; column `b` is block `b`.
    for (b, block) in crate::host::gemm::pack_vbmi::transpose16(words)
        .iter()
        .enumerate()
    {
        // SAFETY: block `b`'s 16 words lie inside `out`.
        unsafe { _mm512_storeu_si512(out.as_mut_ptr().add(b * BLOCK_WORDS).cast(), *block) };
    }
}
