//! FP8 encode/decode in plain Rust: the reference the kernels are tested against (and the fallback of backends
//! without a CubeCL device). Same integer steps as the kernels' `kernel::fp8`.

use crate::format::Fp8Format;

impl Fp8Format {
    /// Encodes an f32 as an FP8 code: round to nearest-even, saturate to ±max (±inf included), NaN → NaN.
    ///
    /// Both roundings are computed and one is selected (no branches), so loops over it vectorize.
    #[inline(always)]
    pub fn encode(self, x: f32) -> u8 {
        let (m, bias) = (self.mantissa_bits(), self.exponent_bias());
        let bits = x.to_bits();
        let sign = (bits >> 24) & 0x80;
        let abs = bits & 0x7fff_ffff;
        let exponent = abs >> 23;
        // In the format's normal range: the f32 mantissa rounded to `m` bits, the exponent rebiased.
        let shift = 23 - m;
        let normal = ((abs + ((1 << (shift - 1)) - 1) + ((abs >> shift) & 1)) >> shift)
            .wrapping_sub((127 - bias) << m);
        // Below it: the format's subnormals, the full mantissa shifted right by the exponent difference.
        let mantissa = (abs & 0x7f_ffff) | if exponent == 0 { 0 } else { 0x80_0000 };
        let sub_shift = (151 - bias - m)
            .saturating_sub(exponent.max(1))
            .clamp(1, 31);
        let quotient = mantissa >> sub_shift;
        let remainder = mantissa & ((1 << sub_shift) - 1);
        let half = 1 << (sub_shift - 1);
        let round_up = (remainder > half) | ((remainder == half) & (quotient & 1 == 1));
        let subnormal = quotient + u32::from(round_up);
        let rounded = if exponent >= 128 - bias {
            normal
        } else {
            subnormal
        };
        let magnitude = if abs > 0x7f80_0000 {
            self.nan_code()
        } else {
            rounded.min(self.max_code())
        };
        (sign | magnitude) as u8
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
