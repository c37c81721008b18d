//! FP8 encode and decode as `#[cube]` functions on integer bits.
//!
//! Working on the f32 bit pattern keeps the conversion exact on every runtime: no float rounding mode, no
//! flush-to-zero and no NaN handling of the shader compiler can change a code. The host reference
//! ([`Fp8Format::encode`](crate::Fp8Format::encode) and `decode`) follows the same steps in plain Rust.

use cubecl::prelude::*;

use crate::Fp8Format;

/// Encodes the bits of an f32 as an FP8 code in the low 8 bits: round to nearest-even, saturate to ±max (±inf
/// included), NaN → NaN.
#[cube]
pub fn encode_fp8(bits: u32, #[comptime] format: Fp8Format) -> u32 {
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7fff_ffff;
    let mut magnitude = comptime!(format.nan_code()).runtime();
    if abs <= 0x7f80_0000 {
        let exponent = abs >> 23;
        let rounded = if exponent >= comptime!(128 - format.exponent_bias()) {
            round_normal(abs, format)
        } else {
            round_subnormal(abs, exponent, format)
        };
        magnitude = clamp_code(rounded, comptime!(format.max_code()));
    }
    sign | magnitude
}

/// Code of a value that is normal in FP8: drop the low mantissa bits with round-to-nearest-even; a carry moves
/// into the exponent by itself.
#[cube]
fn round_normal(abs: u32, #[comptime] format: Fp8Format) -> u32 {
    let shift = comptime!(23 - format.mantissa_bits());
    let biased =
        abs + comptime!((1u32 << (22 - format.mantissa_bits())) - 1) + ((abs >> shift) & 1);
    (biased >> shift) - comptime!((127 - format.exponent_bias()) << format.mantissa_bits())
}

/// Code of a value that is subnormal (or zero) in FP8: `mantissa * 2^(exponent - offset)`, rounded to
/// nearest-even.
#[cube]
fn round_subnormal(abs: u32, exponent: u32, #[comptime] format: Fp8Format) -> u32 {
    let is_f32_subnormal = exponent == 0;
    let implicit_bit = select(is_f32_subnormal, 0u32, 0x80_0000u32);
    let effective_exponent = select(is_f32_subnormal, 1u32, exponent);
    let mantissa = (abs & 0x7f_ffff) | implicit_bit;
    let shift =
        comptime!(151 - format.exponent_bias() - format.mantissa_bits()) - effective_exponent;
    round_shift_right_even(mantissa, select(shift > 31, 31u32, shift))
}

/// Saturates a rounded magnitude to the largest finite code.
#[cube]
fn clamp_code(rounded: u32, #[comptime] max_code: u32) -> u32 {
    select(rounded > max_code, max_code, rounded)
}

/// `value >> shift` rounded to nearest, ties to even (`1 <= shift <= 31`).
#[cube]
fn round_shift_right_even(value: u32, shift: u32) -> u32 {
    let quotient = value >> shift;
    let remainder = value & ((1u32 << shift) - 1);
    let half = 1u32 << (shift - 1);
    let mut result = quotient;
    if remainder > half || (remainder == half && (quotient & 1) == 1) {
        result = quotient + 1;
    }
    result
}

/// Decodes an FP8 code (low 8 bits) to its exact f32 value.
#[cube]
pub fn decode_fp8(code: u32, #[comptime] format: Fp8Format) -> f32 {
    let sign = (code & 0x80) << 24;
    let magnitude = code & 0x7f;
    let exponent = magnitude >> comptime!(format.mantissa_bits());
    let mantissa = magnitude & comptime!((1u32 << format.mantissa_bits()) - 1);
    let normal_bits = ((exponent + comptime!(127 - format.exponent_bias())) << 23)
        | (mantissa << comptime!(23 - format.mantissa_bits()));
    // Subnormal: mantissa * 2^(1 - bias - m), exact in f32.
    let subnormal_bits =
        u32::reinterpret(f32::cast_from(mantissa) * comptime!(format.min_subnormal()));
    // Selects, not branches: a kernel decoding many codes (a GEMM's staging) stays one basic block.
    let mut bits = select(exponent == 0, subnormal_bits, normal_bits);
    if comptime!(format == Fp8Format::E5M2) {
        bits = select(magnitude == 0x7c, 0x7f80_0000u32, bits);
    }
    bits = select(is_nan_magnitude(magnitude, format), 0x7fc0_0000u32, bits);
    f32::reinterpret(sign | bits)
}

/// Whether the magnitude bits (sign cleared) of a code are a NaN.
#[cube]
pub fn is_nan_magnitude(magnitude: u32, #[comptime] format: Fp8Format) -> bool {
    if comptime!(format == Fp8Format::E4M3) {
        magnitude == 0x7f
    } else {
        magnitude > 0x7c
    }
}
