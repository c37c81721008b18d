//! The host path: every kernel of this crate in plain Rust, bit-identical to the kernels. It is the reference of the
//! tests and the implementation used by backends without a CubeCL device (burn-ndarray).

mod fp8;

use crate::{Fp8Format, Fp8Stats, TensorStats};

/// `code = encode(f32(x) * scale)` for every element.
pub fn quantize(input: &[f32], scale: f32, format: Fp8Format) -> Vec<u8> {
    input.iter().map(|&x| format.encode(x * scale)).collect()
}

/// `x = decode(code) * scale_inv` for every code (through a table of the 256 products: the same values).
pub fn dequantize(codes: &[u8], scale_inv: f32, format: Fp8Format) -> Vec<f32> {
    let table: [f32; 256] = core::array::from_fn(|c| format.decode(c as u8) * scale_inv);
    codes.iter().map(|&c| table[usize::from(c)]).collect()
}

/// Quantize then dequantize with `scale_inv = 1 / scale`.
pub fn fake_quant(input: &[f32], scale: f32, format: Fp8Format) -> Vec<f32> {
    let scale_inv = 1.0f32 / scale;
    input
        .iter()
        .map(|&x| format.decode(format.encode(x * scale)) * scale_inv)
        .collect()
}

/// max |x| over the tensor (0 for an empty one); NaN if any element is NaN, as in Transformer Engine.
pub fn amax(input: &[f32]) -> f32 {
    let bits = input
        .iter()
        .map(|x| x.to_bits() & 0x7fff_ffff)
        .max()
        .unwrap_or(0);
    f32::from_bits(bits)
}

/// Statistics of the tensor in one pass.
pub fn tensor_stats(input: &[f32]) -> TensorStats {
    let mut stats = TensorStats::EMPTY;
    for &x in input {
        stats.push(x as f64);
    }
    stats
}

/// Statistics of the tensor and of its quantization with `scale` in `format`, in one pass.
pub fn fp8_tensor_stats(input: &[f32], format: Fp8Format, scale: f32) -> Fp8Stats {
    let scale_inv = 1.0f32 / scale;
    let mut stats = Fp8Stats::EMPTY;
    for &x in input {
        stats.push(x, format.encode(x * scale), format, scale_inv);
    }
    stats
}

/// Packs FP8 codes four per little-endian `u32` word, as the kernels store them (the tail is padded with +0).
pub fn pack_codes(codes: &[u8]) -> Vec<u32> {
    codes
        .chunks(4)
        .map(|chunk| {
            chunk
                .iter()
                .enumerate()
                .fold(0u32, |word, (k, &c)| word | (u32::from(c) << (8 * k)))
        })
        .collect()
}

/// Unpacks `len` FP8 codes from words packed as by [`pack_codes`].
pub fn unpack_codes(words: &[u32], len: usize) -> Vec<u8> {
    words
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .take(len)
        .collect()
}
