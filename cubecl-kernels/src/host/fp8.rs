//! FP8 encode/decode in plain Rust: the reference the kernels are tested against (and the fallback of backends
//! without a CubeCL device). The same codes as the kernels' `kernel::fp8`.

use crate::Fp8Format;

impl Fp8Format {
    /// Encodes an f32 as an FP8 code: round to nearest-even, saturate to ±max (±inf included), NaN → NaN.
    ///
    /// Both roundings are computed and one is selected (no branches), so loops over it vectorize. In the normal
    /// range the f32 mantissa is rounded in integers (the kernels' steps); below it, one f32 addition rounds: `|x|`
    /// plus `2^(23 + e)`, where `2^e` is the format's smallest subnormal, is `|x|` rounded to a multiple of `2^e`
    /// (IEEE addition rounds to nearest-even), and the sum's low bits are the code. The same codes as shifting
    /// the mantissa (every f32 input compared once), with about a third fewer vector instructions per value.
    #[inline(always)]
    pub fn encode(self, x: f32) -> u8 {
        let (m, bias) = (self.mantissa_bits(), self.exponent_bias());
        let bits = x.to_bits();
        let sign = (bits >> 24) & 0x80;
        let abs = bits & 0x7fff_ffff;
        // In the format's normal range: the f32 mantissa rounded to `m` bits, the exponent rebiased.
        let shift = 23 - m;
        let normal = ((abs + ((1 << (shift - 1)) - 1) + ((abs >> shift) & 1)) >> shift)
            .wrapping_sub((127 - bias) << m);
        // Below it: the subnormal step's multiple nearest `|x|`, by the addition of 2^(23 + e_min) (e_min =
        // 1 − bias − m); the codes run 0 ..= 2^m, the last the smallest normal.
        let magic = f32::from_bits((127 + 23 + 1 - bias - m) << 23);
        let subnormal = (f32::from_bits(abs) + magic)
            .to_bits()
            .wrapping_sub(magic.to_bits());
        let rounded = if abs >= (128 - bias) << 23 {
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
