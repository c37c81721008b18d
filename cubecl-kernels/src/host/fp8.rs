//! FP8 encode/decode in plain Rust: the reference the kernels are tested against (and the fallback of backends
//! without a CubeCL device). Same integer steps as `crate::kernel::fp8`.

use crate::Fp8Format;

impl Fp8Format {
    /// Encodes an f32 as an FP8 code: round to nearest-even, saturate to ±max (±inf included), NaN → NaN.
    pub fn encode(self, x: f32) -> u8 {
        let bits = x.to_bits();
        let sign = (bits >> 24) & 0x80;
        let abs = bits & 0x7fff_ffff;
        if abs > 0x7f80_0000 {
            return (sign | self.nan_code()) as u8;
        }
        let (m, bias) = (self.mantissa_bits(), self.exponent_bias());
        let exponent = abs >> 23;
        let rounded = if exponent >= 128 - bias {
            let shift = 23 - m;
            let biased = abs + ((1 << (shift - 1)) - 1) + ((abs >> shift) & 1);
            (biased >> shift) - ((127 - bias) << m)
        } else {
            let (mantissa, effective_exponent) = if exponent == 0 {
                (abs & 0x7f_ffff, 1)
            } else {
                ((abs & 0x7f_ffff) | 0x80_0000, exponent)
            };
            let shift = (151 - bias - m - effective_exponent).min(31);
            let quotient = mantissa >> shift;
            let remainder = mantissa & ((1 << shift) - 1);
            let half = 1 << (shift - 1);
            quotient + u32::from(remainder > half || (remainder == half && quotient & 1 == 1))
        };
        (sign | rounded.min(self.max_code())) as u8
    }

    /// Decodes an FP8 code to its exact f32 value.
    pub fn decode(self, code: u8) -> f32 {
        let sign = u32::from(code & 0x80) << 24;
        let magnitude = u32::from(code & 0x7f);
        let m = self.mantissa_bits();
        let exponent = magnitude >> m;
        let mantissa = magnitude & ((1 << m) - 1);
        let bits = if self.is_nan_code(magnitude) {
            0x7fc0_0000
        } else if self == Fp8Format::E5M2 && magnitude == 0x7c {
            0x7f80_0000
        } else if exponent == 0 {
            (mantissa as f32 * self.min_subnormal()).to_bits()
        } else {
            ((exponent + 127 - self.exponent_bias()) << 23) | (mantissa << (23 - m))
        };
        f32::from_bits(sign | bits)
    }
}
