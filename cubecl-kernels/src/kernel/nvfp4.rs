//! NVFP4 as `#[cube]` functions and kernels: E2M1 encode/decode on integer bits, TE's two-level scales (a global
//! f32 scale from the tensor's amax, an E4M3 scale per 16-element block or 16×16 tile), stochastic rounding, and
//! the random Hadamard transform. The host reference ([`crate::host::nvfp4`]) follows the same steps; the formulas
//! and their order of f32 operations are those of [`crate::nvfp4::format`].

use cubecl::prelude::*;

use crate::Fp8Format;
use crate::kernel::fp8::{decode_fp8, encode_fp8};

/// Bits of `f32::MAX`.
const F32_MAX_BITS: u32 = 0x7f7f_ffff;
/// Bits of +inf.
const INF_BITS: u32 = 0x7f80_0000;

/// The E2M1 code (low 4 bits) of the bits of an f32: round to nearest-even, ±inf and magnitudes above 6 saturate
/// to ±6, NaN becomes +6 (0x7), the sign of zero is kept. Compares magnitude bits only (exact on every runtime).
#[cube]
pub fn encode_e2m1(bits: u32) -> u32 {
    let abs = bits & 0x7fff_ffff;
    // Thresholds: 0.25 (tie → 0), 0.75 (tie → 1.0), 1.25 (tie → 1.0), 1.75 (tie → 2.0), 2.5 (tie → 2.0),
    // 3.5 (tie → 4.0), 5.0 (tie → 4.0).
    let mut code = 7u32;
    if abs <= 0x3e80_0000 {
        code = 0u32;
    } else if abs < 0x3f40_0000 {
        code = 1u32;
    } else if abs <= 0x3fa0_0000 {
        code = 2u32;
    } else if abs < 0x3fe0_0000 {
        code = 3u32;
    } else if abs <= 0x4020_0000 {
        code = 4u32;
    } else if abs < 0x4060_0000 {
        code = 5u32;
    } else if abs <= 0x40a0_0000 {
        code = 6u32;
    }
    let sign = select(abs > INF_BITS, 0u32, (bits >> 28) & 0x8);
    sign | code
}

/// The exact f32 value of an E2M1 code (low 4 bits): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.
#[cube]
pub fn decode_e2m1(code: u32) -> f32 {
    let magnitude = code & 0x7;
    let exponent = magnitude >> 1;
    let mantissa = magnitude & 1;
    // Normal: 2^(e-1) · (1 + m/2); subnormal (e = 0): m · 0.5.
    let normal_bits = ((exponent + 126) << 23) | (mantissa << 22);
    let bits = select(
        exponent == 0,
        select(mantissa == 1, 0x3f00_0000u32, 0u32),
        normal_bits,
    );
    f32::reinterpret(((code & 0x8) << 28) | bits)
}

/// `x` unchanged, through an integer XOR with a runtime zero that the shader compiler cannot see through: it keeps
/// TE's order of f32 operations, which compilers otherwise reassociate (lavapipe turns `(s · amax) · (1/2688)`
/// into `s · (amax · (1/2688))`, one ulp off). Kernels take `zero` as an argument, always 0.
#[cube]
pub fn ordered(x: f32, zero: u32) -> f32 {
    f32::reinterpret(u32::reinterpret(x) ^ zero)
}

/// `fminf(value, f32::MAX)` for a non-negative value (NaN gives `f32::MAX`, as C's `fminf` returns the non-NaN
/// operand).
#[cube]
fn min_f32_max(value: f32) -> f32 {
    let bits = u32::reinterpret(value);
    f32::reinterpret(select(bits > F32_MAX_BITS, F32_MAX_BITS, bits))
}

/// TE's global encode scale `S_enc = fminf(2688 / amax, FLT_MAX)`, 1 when amax is 0 or `S_enc` is 0.
#[cube]
pub fn global_encode_scale(amax: f32) -> f32 {
    let scale = min_f32_max(2688.0f32 / amax);
    let is_zero = (u32::reinterpret(amax) & 0x7fff_ffff) == 0 || u32::reinterpret(scale) == 0;
    select(is_zero, 1.0f32, scale)
}

/// The E4M3 code of a block's decode scale: `e4m3(fminf(block_amax · (S_enc · (1/6)), FLT_MAX))` (saturating).
#[cube]
pub fn block_scale_code(block_amax: f32, encode_scale: f32, zero: u32) -> u32 {
    let one_sixth = comptime!(f32::from_bits(0x3e2a_aaab));
    let scaled = min_f32_max(block_amax * ordered(encode_scale * one_sixth, zero));
    encode_fp8(u32::reinterpret(scaled), Fp8Format::E4M3)
}

/// A block's encode multiplier `fminf(1 / (float(s) · S_dec), FLT_MAX)` (`f32::MAX` for a zero scale).
#[cube]
pub fn block_encode_scale(scale_code: u32, decode_scale: f32) -> f32 {
    min_f32_max(1.0f32 / (decode_fp8(scale_code, Fp8Format::E4M3) * decode_scale))
}

/// The dequantization factor of a block: `(float(s) · amax) · (1/2688)`, in that order.
#[cube]
pub fn dequantize_factor(scale_code: u32, amax: f32, zero: u32) -> f32 {
    let one_over = comptime!(f32::from_bits(0x39c3_0c31));
    ordered(decode_fp8(scale_code, Fp8Format::E4M3) * amax, zero) * one_over
}

/// TE's stochastic rounding of a scaled value `v` to E2M1 with 8 random bits `r` (ptx.cuh's software rule):
/// `t = |v| + (r/256)·step(|v|)`, `q = min(⌊t / step(t)⌋ · step(t), 6)`, the sign of `v`; NaN gives +6.
#[cube]
pub fn stochastic_round_e2m1(bits: u32, random: u32) -> u32 {
    let abs = bits & 0x7fff_ffff;
    let mut code = 7u32;
    if abs <= INF_BITS {
        let a = f32::reinterpret(abs);
        // (r/256)·step is exact (a multiple of 2^-9), so `+` rounds once, as fmaf does.
        let t = a + f32::cast_from(random & 0xff)
            * (sr_step(a) * comptime!(f32::from_bits(0x3b80_0000)));
        let step_t = sr_step(t);
        let q = (t / step_t).floor() * step_t;
        code = encode_e2m1(u32::reinterpret(q)) | ((bits >> 28) & 0x8);
    }
    code
}

/// The spacing of E2M1 values at magnitude `a`: 2 from 4 up, 1 from 2 up, 0.5 below.
#[cube]
fn sr_step(a: f32) -> f32 {
    select(a >= 4.0f32, 2.0f32, select(a >= 2.0f32, 1.0f32, 0.5f32))
}

/// 8 random bits for element `index` under `seed`: a counter-based hash (reproducible, no state).
#[cube]
pub fn random_bits(seed: u32, index: u32) -> u32 {
    let mut x = (index * 0x9e37_79b9u32) ^ seed;
    x ^= x >> 16;
    x *= 0x7feb_352du32;
    x ^= x >> 15;
    x *= 0x846c_a68bu32;
    x ^= x >> 16;
    x >> 24
}

/// The block (row-major over the block grid of a tensor with `cols` columns) holding element `(row, col)`.
#[cube]
fn block_of(row: u32, col: u32, cols: u32, block_rows: u32, block_cols: u32) -> u32 {
    (row / block_rows) * cols.div_ceil(block_cols) + col / block_cols
}

/// Block scales: one unit per 4 consecutive blocks (row-major over the block grid), writing one word of 4 E4M3
/// codes (block `4w + b` in byte `b`). A block's amax skips NaN (CUDA's `fmaxf`); partial blocks take the amax of
/// the elements they hold.
#[cube(launch_unchecked)]
pub fn nvfp4_block_scale_kernel<F: Float>(
    input: &Array<F>,
    amax: &Array<f32>,
    scales: &mut Array<u32>,
    rows: u32,
    cols: u32,
    block_rows: u32,
    block_cols: u32,
    zero: u32,
) {
    let grid_cols = cols.div_ceil(block_cols);
    let blocks = rows.div_ceil(block_rows) * grid_cols;
    let word = ABSOLUTE_POS as u32;
    if word < blocks.div_ceil(4) {
        let encode_scale = global_encode_scale(amax[0]);
        let mut packed = 0u32;
        for b in 0..4u32 {
            let block = word * 4 + b;
            if block < blocks {
                let row0 = (block / grid_cols) * block_rows;
                let col0 = (block % grid_cols) * block_cols;
                let row_end = select(row0 + block_rows > rows, rows, row0 + block_rows);
                let col_end = select(col0 + block_cols > cols, cols, col0 + block_cols);
                let mut block_amax = 0u32;
                for row in row0..row_end {
                    for col in col0..col_end {
                        let magnitude =
                            u32::reinterpret(f32::cast_from(input[(row * cols + col) as usize]))
                                & 0x7fff_ffff;
                        if magnitude <= INF_BITS && magnitude > block_amax {
                            block_amax = magnitude;
                        }
                    }
                }
                let code = block_scale_code(f32::reinterpret(block_amax), encode_scale, zero);
                packed |= code << (8 * b);
            }
        }
        scales[word as usize] = packed;
    }
}

/// The E4M3 scale code of block `block` from the packed scales.
#[cube]
fn scale_code(scales: &Array<u32>, block: u32) -> u32 {
    (scales[(block / 4) as usize] >> (8 * (block % 4))) & 0xff
}

/// Codes: one unit per 8 elements (one `u32` word, element `8w + i` in nibble `i`): `code = e2m1(x · enc)` with
/// each element's block multiplier, or its stochastic rounding with 8 bits from `random_bits(seed, index)`.
#[cube(launch_unchecked)]
pub fn nvfp4_quantize_kernel<F: Float>(
    input: &Array<F>,
    amax: &Array<f32>,
    scales: &Array<u32>,
    codes: &mut Array<u32>,
    rows: u32,
    cols: u32,
    block_rows: u32,
    block_cols: u32,
    seed: u32,
    #[comptime] stochastic: bool,
) {
    let len = rows * cols;
    let word = ABSOLUTE_POS as u32;
    if word < len.div_ceil(8) {
        let decode_scale = 1.0f32 / global_encode_scale(amax[0]);
        let mut packed = 0u32;
        for i in 0..8u32 {
            let index = word * 8 + i;
            if index < len {
                let row = index / cols;
                let col = index % cols;
                let block = block_of(row, col, cols, block_rows, block_cols);
                let enc = block_encode_scale(scale_code(scales, block), decode_scale);
                let scaled = u32::reinterpret(f32::cast_from(input[index as usize]) * enc);
                let code = if comptime!(stochastic) {
                    stochastic_round_e2m1(scaled, random_bits(seed, index))
                } else {
                    encode_e2m1(scaled)
                };
                packed |= code << (4 * i);
            }
        }
        codes[word as usize] = packed;
    }
}

/// Dequantization, one unit per element: `y = e2m1(code) · ((float(s) · amax) · (1/2688))`.
#[cube(launch_unchecked)]
pub fn nvfp4_dequantize_kernel<F: Float>(
    codes: &Array<u32>,
    scales: &Array<u32>,
    amax: &Array<f32>,
    output: &mut Array<F>,
    rows: u32,
    cols: u32,
    block_rows: u32,
    block_cols: u32,
    zero: u32,
) {
    let index = ABSOLUTE_POS as u32;
    if index < rows * cols {
        let row = index / cols;
        let col = index % cols;
        let block = block_of(row, col, cols, block_rows, block_cols);
        let code = (codes[(index / 8) as usize] >> (4 * (index % 8))) & 0xf;
        let value = decode_e2m1(code)
            * ordered(
                dequantize_factor(scale_code(scales, block), amax[0], zero),
                zero,
            );
        output[index as usize] = F::cast_from(value);
    }
}

/// Each block's dequantization factor `(float(s) · amax) · (1/2688)`, one unit per block: what the GEMM multiplies
/// a decoded E2M1 code by as it stages it.
#[cube(launch_unchecked)]
pub fn nvfp4_block_factors_kernel(
    scales: &Array<u32>,
    amax: &Array<f32>,
    factors: &mut Array<f32>,
    blocks: u32,
    zero: u32,
) {
    let block = ABSOLUTE_POS as u32;
    if block < blocks {
        factors[block as usize] = dequantize_factor(scale_code(scales, block), amax[0], zero);
    }
}

/// Each block's encode multiplier `min(1 / (float(s) · S_dec), FLT_MAX)`, one unit per block: what quantization
/// multiplies the block's elements by before the E2M1 cast (as [`nvfp4_quantize_kernel()`] computes it).
#[cube(launch_unchecked)]
pub fn nvfp4_block_multipliers_kernel(
    scales: &Array<u32>,
    amax: &Array<f32>,
    multipliers: &mut Array<f32>,
    blocks: u32,
) {
    let block = ABSOLUTE_POS as u32;
    if block < blocks {
        let decode_scale = 1.0f32 / global_encode_scale(amax[0]);
        multipliers[block as usize] = block_encode_scale(scale_code(scales, block), decode_scale);
    }
}

/// Rounds f32 bits to the nearest bf16 (ties to even), kept as f32; NaN stays NaN.
#[cube]
pub fn round_to_bf16(bits: u32) -> f32 {
    let rounded = (bits + 0x7fffu32 + ((bits >> 16) & 1)) & 0xffff_0000u32;
    let is_nan = (bits & 0x7fff_ffff) > INF_BITS;
    f32::reinterpret(select(is_nan, bits | 0x0040_0000, rounded))
}

/// The random Hadamard transform: every 16-element chunk `x` of the last dimension becomes `x · M` with
/// `M = diag(s) · H16 · 1/4` (`s` from the sign mask: bit `r` set → row `r` negated), summed over `r = 0..16` in
/// order, then rounded to bf16 as TE does. One unit per output element.
#[cube(launch_unchecked)]
pub fn rht_kernel<F: Float>(input: &Array<F>, output: &mut Array<f32>, len: u32, sign_mask: u32) {
    let index = ABSOLUTE_POS as u32;
    if index < len {
        let chunk = index - index % 16;
        let c = index % 16;
        let mut sum = 0.0f32;
        for r in 0..16u32 {
            let negative = (((sign_mask >> r) ^ (r & c).count_ones()) & 1) == 1;
            let x = f32::cast_from(input[(chunk + r) as usize]) * 0.25f32;
            sum += select(negative, -x, x);
        }
        output[index as usize] = round_to_bf16(u32::reinterpret(sum));
    }
}
