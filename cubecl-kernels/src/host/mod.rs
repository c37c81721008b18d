//! The host path: every kernel of this crate in plain Rust, bit-identical to the kernels. It is the reference of the
//! tests and the implementation used by backends without a CubeCL device (burn-ndarray).

pub mod block;
mod buffers;
mod fp8;
pub mod fused;
pub mod gemm;
pub mod malloc;
pub mod nvfp4;
pub mod optim;
pub mod pool;
mod stats;
pub mod strided;

pub use buffers::{assume_init, uninit, zeroed};
pub use stats::{block_fp8_tensor_stats, fp8_tensor_stats, non_finite_counts, tensor_stats};

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::Fp8Format;

/// Elements per parallel chunk: smaller tensors run on the calling thread.
const CHUNK: usize = 1 << 15;

/// Runs `kernel` over matching chunks of `input` and `output` on rayon's pool (on the calling thread when the
/// tensor is small), combining the chunks' results with `combine`.
fn chunked<I: Sync, O: Send, R: Send + Default>(
    input: &[I],
    output: &mut [O],
    kernel: impl Fn(&[I], &mut [O]) -> R + Sync,
    combine: impl Fn(R, R) -> R + Sync + Send,
) -> R {
    if input.len() <= CHUNK {
        return kernel(input, output);
    }
    input
        .par_chunks(CHUNK)
        .zip(output.par_chunks_mut(CHUNK))
        .map(|(i, o)| kernel(i, o))
        .reduce(R::default, combine)
}

/// `code = encode(f32(x) * scale)` for every element.
pub fn quantize(input: &[f32], scale: f32, format: Fp8Format) -> Vec<u8> {
    let mut codes = uninit(input.len());
    chunked(
        input,
        &mut codes,
        |x, c| {
            encode_scaled(x, scale, format, c);
        },
        |(), ()| (),
    );
    // SAFETY: the chunks cover the input, and `encode_scaled` wrote a code for each of their elements.
    unsafe { assume_init(codes) }
}

/// [`quantize`] and [`amax`] of the input in one pass (delayed scaling records the amax it quantizes).
pub fn quantize_with_amax(input: &[f32], scale: f32, format: Fp8Format) -> (Vec<u8>, f32) {
    let mut codes = uninit(input.len());
    let bits = chunked(
        input,
        &mut codes,
        |x, c| {
            encode_scaled(x, scale, format, c);
            amax_bits(x)
        },
        u32::max,
    );
    // SAFETY: as in `quantize`, every code was written.
    (unsafe { assume_init(codes) }, f32::from_bits(bits))
}

/// Writes `codes[i] = encode(input[i] · scale)` for every element (`codes` as long as `input`, unwritten before).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
pub(crate) fn encode_scaled(
    input: &[f32],
    scale: f32,
    format: Fp8Format,
    codes: &mut [MaybeUninit<u8>],
) {
    assert_eq!(codes.len(), input.len(), "one code per input element");
    // One loop per format, so the format's constants fold into it.
    match format {
        Fp8Format::E4M3 => {
            for (c, &x) in codes.iter_mut().zip(input) {
                c.write(Fp8Format::E4M3.encode(x * scale));
            }
        }
        Fp8Format::E5M2 => {
            for (c, &x) in codes.iter_mut().zip(input) {
                c.write(Fp8Format::E5M2.encode(x * scale));
            }
        }
    }
}

/// `x = decode(code) * scale_inv` for every code (through a table of the 256 products: the same values).
pub fn dequantize(codes: &[u8], scale_inv: f32, format: Fp8Format) -> Vec<f32> {
    let mut values = zeroed(codes.len());
    dequantize_into(codes, scale_inv, format, &mut values);
    values
}

/// [`dequantize`] into `values` (`values.len() == codes.len()`).
pub fn dequantize_into(codes: &[u8], scale_inv: f32, format: Fp8Format, values: &mut [f32]) {
    let table: [f32; 256] = core::array::from_fn(|c| format.decode(c as u8) * scale_inv);
    chunked(
        codes,
        values,
        |c, v| {
            for (v, &c) in v.iter_mut().zip(c) {
                *v = table[usize::from(c)];
            }
        },
        |(), ()| (),
    );
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
    let bits = if input.len() <= CHUNK {
        amax_bits(input)
    } else {
        input
            .par_chunks(CHUNK)
            .map(amax_bits)
            .reduce(|| 0, u32::max)
    };
    f32::from_bits(bits)
}

/// The largest `|x|` as bits (NaN's bits are above infinity's, so a NaN wins).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
pub(crate) fn amax_bits(input: &[f32]) -> u32 {
    input
        .iter()
        .fold(0, |max, x| max.max(x.to_bits() & 0x7fff_ffff))
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
