//! Block scaling: one scale per `block_rows × block_cols` block of a row-major `[rows, cols]` tensor
//! (Float8BlockScaling's 1×128 tiles and 128×128 blocks, MXFP8's 1×32 blocks, and their transposes).

use cubecl::prelude::*;

use crate::BlockScaleRule;
use crate::Fp8Format;
use crate::kernel::fp8::{decode_fp8, encode_fp8};
use crate::kernel::reduce::abs_bits;

/// `amax[block] = max |x|` over each block (f32 bits, atomically; NaN propagates) and, with `with_min`,
/// `amin[block] = min nonzero |x|` (`amin` must start at `u32::MAX`, which an all-zero block keeps). One unit per
/// `(row, block column)` segment of at most `block_cols` elements; `amax` must start at zero.
// The comptime branch stays apart from the runtime test: it is resolved when the kernel is expanded.
#[allow(clippy::collapsible_if)]
#[cube(launch_unchecked)]
pub fn block_amax_kernel<F: Float>(
    input: &Array<F>,
    amax: &mut Array<Atomic<u32>>,
    amin: &mut Array<Atomic<u32>>,
    rows: u32,
    cols: u32,
    block_rows: u32,
    block_cols: u32,
    #[comptime] with_min: bool,
) {
    let blocks_per_row = cols.div_ceil(block_cols);
    let segment = ABSOLUTE_POS as u32;
    let row = segment / blocks_per_row;
    let block_col = segment % blocks_per_row;
    if row < rows {
        let start = block_col * block_cols;
        let end = select(start + block_cols > cols, cols, start + block_cols);
        let mut local = 0u32;
        let mut local_min = 0xffff_ffffu32;
        for col in start..end {
            let magnitude = abs_bits(u32::reinterpret(f32::cast_from(
                input[(row * cols + col) as usize],
            )));
            if magnitude > local {
                local = magnitude;
            }
            if comptime!(with_min) {
                if magnitude != 0 && magnitude < local_min {
                    local_min = magnitude;
                }
            }
        }
        let block = ((row / block_rows) * blocks_per_row + block_col) as usize;
        amax[block].fetch_max(local);
        if comptime!(with_min) {
            amin[block].fetch_min(local_min);
        }
    }
}

/// Scale and scale_inv of each block from its amax (bits), by the recipe's rule:
/// - `Pow2` (Float8BlockScaling): `scale = fp8_max / amax` rounded down to a power of two (mantissa cleared);
///   amax 0, inf or NaN gives 1; a scale that overflows becomes the largest power of two, 2^127.
/// - `E8m0` (MXFP8): `scale_inv = 2^⌈log2(amax / fp8_max)⌉` (TE's `float_to_e8m0`, rounding up so no value
///   saturates), clamped to the E8M0 range 2^-127..2^127; amax 0, inf or NaN gives 1.
#[cube(launch_unchecked)]
pub fn block_scale_kernel(
    amax: &Array<u32>,
    scale: &mut Array<f32>,
    scale_inv: &mut Array<f32>,
    blocks: u32,
    #[comptime] rule: BlockScaleRule,
    #[comptime] format: Fp8Format,
) {
    let block = ABSOLUTE_POS;
    if block < blocks as usize {
        let bits = amax[block];
        let mut s = 1.0f32;
        let mut s_inv = 1.0f32;
        if bits != 0 && bits < 0x7f80_0000 {
            let amax = f32::reinterpret(bits);
            if comptime!(rule == BlockScaleRule::Pow2) {
                let scale_bits = u32::reinterpret(comptime!(format.max()) / amax);
                // Overflow to inf: clearing the mantissa of inf's bits is 2^128, so take 2^127.
                let pow2 = select(
                    scale_bits >= 0x7f80_0000,
                    0x7f00_0000u32,
                    scale_bits & 0xff80_0000u32,
                );
                s = f32::reinterpret(pow2);
                s_inv = 1.0 / s;
            } else {
                let ratio = u32::reinterpret(amax * comptime!(1.0 / format.max()));
                let mut exponent = ratio >> 23;
                let mantissa = ratio & 0x7f_ffff;
                if mantissa > 0 && exponent != 0xfe && !(exponent == 0 && mantissa <= 0x40_0000) {
                    exponent += 1;
                }
                // E8M0 spans 2^-127 (exponent 0) .. 2^127 (exponent 254).
                exponent = select(exponent > 254, 254u32, exponent);
                // Select the bits, then reinterpret: CUDA C++ cannot reinterpret a constant (an rvalue).
                s_inv = f32::reinterpret(select(exponent == 0, 0x40_0000u32, exponent << 23));
                s = f32::reinterpret(select(
                    exponent == 0,
                    0x7f00_0000u32,
                    (254 - exponent) << 23,
                ));
            }
        }
        scale[block] = s;
        scale_inv[block] = s_inv;
    }
}

/// `codes = encode(x · scale[block of x])`, four elements (one packed word) per unit.
#[cube(launch_unchecked)]
pub fn block_quantize_kernel<F: Float>(
    input: &Array<F>,
    scale: &Array<f32>,
    codes: &mut Array<u32>,
    rows: u32,
    cols: u32,
    block_rows: u32,
    block_cols: u32,
    #[comptime] format: Fp8Format,
) {
    let word = ABSOLUTE_POS as u32;
    let len = rows * cols;
    let blocks_per_row = cols.div_ceil(block_cols);
    if word * 4 < len {
        let mut packed = 0u32;
        #[unroll]
        for k in 0..4u32 {
            let index = word * 4 + k;
            if index < len {
                let row = index / cols;
                let col = index % cols;
                let block = (row / block_rows) * blocks_per_row + col / block_cols;
                let x = f32::cast_from(input[index as usize]);
                packed |=
                    encode_fp8(u32::reinterpret(x * scale[block as usize]), format) << (k * 8);
            }
        }
        codes[word as usize] = packed;
    }
}

/// `output = decode(code) · scale_inv[block of the element]`.
#[cube(launch_unchecked)]
pub fn block_dequantize_kernel<F: Float>(
    codes: &Array<u32>,
    scale_inv: &Array<f32>,
    output: &mut Array<F>,
    rows: u32,
    cols: u32,
    block_rows: u32,
    block_cols: u32,
    #[comptime] format: Fp8Format,
) {
    let index = ABSOLUTE_POS as u32;
    if index < rows * cols {
        let blocks_per_row = cols.div_ceil(block_cols);
        let row = index / cols;
        let col = index % cols;
        let block = (row / block_rows) * blocks_per_row + col / block_cols;
        let code = (codes[(index / 4) as usize] >> ((index % 4) * 8)) & 0xff;
        output[index as usize] = F::cast_from(decode_fp8(code, format) * scale_inv[block as usize]);
    }
}
