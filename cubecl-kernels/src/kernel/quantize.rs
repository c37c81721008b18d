//! Element-wise FP8 kernels: quantize (optionally fusing the amax), dequantize and fake-quant.
//!
//! FP8 codes are packed four per `u32` word, little-endian (element `4w + k` in bits `8k..8k+8` of word `w`),
//! because wgpu has no 8-bit storage type. Each unit handles one word, i.e. four consecutive elements; the last
//! word of a tensor whose length is not a multiple of four is padded with +0 codes.

use cubecl::prelude::*;

use crate::Fp8Format;
use crate::kernel::fp8::{decode_fp8, encode_fp8};
use crate::kernel::reduce::{abs_bits, cube_atomic_max};

/// `codes = encode(f32(x) * scale[0])`; with `with_amax`, also `amax[0] = max(amax[0], max |x|)` (as f32 bits).
#[cube(launch_unchecked)]
pub fn quantize_kernel<F: Float>(
    input: &Array<F>,
    scale: &Array<f32>,
    codes: &mut Array<u32>,
    amax: &mut Array<Atomic<u32>>,
    len: u32,
    #[comptime] format: Fp8Format,
    #[comptime] with_amax: bool,
) {
    let word = ABSOLUTE_POS;
    let len = len as usize;
    let scale = scale[0];
    let mut local_amax = 0u32;
    if word * 4 < len {
        let mut packed = 0u32;
        #[unroll]
        for k in 0..4u32 {
            let index = word * 4 + k as usize;
            if index < len {
                let x = f32::cast_from(input[index]);
                let code = encode_fp8(u32::reinterpret(x * scale), format);
                packed |= code << (k * 8);
                let magnitude = abs_bits(u32::reinterpret(x));
                if magnitude > local_amax {
                    local_amax = magnitude;
                }
            }
        }
        codes[word] = packed;
    }
    if comptime!(with_amax) {
        cube_atomic_max(local_amax, amax);
    }
}

/// `output = decode(code) * scale_inv[0]`.
#[cube(launch_unchecked)]
pub fn dequantize_kernel<F: Float>(
    codes: &Array<u32>,
    scale_inv: &Array<f32>,
    output: &mut Array<F>,
    len: u32,
    #[comptime] format: Fp8Format,
) {
    let word = ABSOLUTE_POS;
    let len = len as usize;
    if word * 4 < len {
        let packed = codes[word];
        let scale_inv = scale_inv[0];
        #[unroll]
        for k in 0..4u32 {
            let index = word * 4 + k as usize;
            if index < len {
                let code = (packed >> (k * 8)) & 0xff;
                output[index] = F::cast_from(decode_fp8(code, format) * scale_inv);
            }
        }
    }
}

/// Quantize then dequantize in one pass: `output = decode(encode(f32(x) * scale)) * (1 / scale)`.
#[cube(launch_unchecked)]
pub fn fake_quant_kernel<F: Float>(
    input: &Array<F>,
    scale: &Array<f32>,
    output: &mut Array<F>,
    len: u32,
    #[comptime] format: Fp8Format,
) {
    let index = ABSOLUTE_POS;
    if index < len as usize {
        let scale = scale[0];
        let scale_inv = 1.0f32 / scale;
        let x = f32::cast_from(input[index]);
        let code = encode_fp8(u32::reinterpret(x * scale), format);
        output[index] = F::cast_from(decode_fp8(code, format) * scale_inv);
    }
}
