//! The FP8 formats: E4M3 and E5M2 as in the OCP FP8 spec and Transformer Engine.

use std::fmt;

/// An 8-bit floating-point format.
///
/// Both formats round to nearest-even and *saturate* on conversion (CUDA's `__NV_SATFINITE`): finite values beyond
/// the largest code and ±inf become ±max, NaN stays NaN.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits (bias 7), 3 mantissa bits; no infinities, NaN is `0x7F`/`0xFF`; max 448.
    E4M3,
    /// 5 exponent bits (bias 15), 2 mantissa bits; IEEE-like with ±inf and NaNs; max 57344.
    E5M2,
}

impl Fp8Format {
    /// Both formats, E4M3 first.
    pub const ALL: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

    /// Largest finite value: 448 for E4M3, 57344 for E5M2.
    pub const fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// Number of explicit mantissa bits.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 3,
            Fp8Format::E5M2 => 2,
        }
    }

    /// Exponent bias.
    pub const fn exponent_bias(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 7,
            Fp8Format::E5M2 => 15,
        }
    }

    /// Magnitude bits (sign cleared) of the largest finite code.
    pub const fn max_code(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 0x7E,
            Fp8Format::E5M2 => 0x7B,
        }
    }

    /// Magnitude bits of the NaN code this crate writes.
    pub const fn nan_code(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 0x7F,
            Fp8Format::E5M2 => 0x7E,
        }
    }

    /// Smallest positive (subnormal) value: 2^-9 for E4M3, 2^-16 for E5M2.
    pub fn min_subnormal(self) -> f32 {
        (2.0f32).powi(1 - self.exponent_bias() as i32 - self.mantissa_bits() as i32)
    }

    /// Smallest positive normal value: 2^-6 for E4M3, 2^-14 for E5M2.
    pub fn min_normal(self) -> f32 {
        (2.0f32).powi(1 - self.exponent_bias() as i32)
    }

    /// Whether the magnitude bits (sign cleared) of a code are a NaN.
    pub const fn is_nan_code(self, magnitude: u32) -> bool {
        match self {
            Fp8Format::E4M3 => magnitude == 0x7F,
            Fp8Format::E5M2 => magnitude > 0x7C,
        }
    }

    /// Lower-case name, as in file names and logs (`e4m3`, `e5m2`).
    pub const fn name(self) -> &'static str {
        match self {
            Fp8Format::E4M3 => "e4m3",
            Fp8Format::E5M2 => "e5m2",
        }
    }
}

impl fmt::Display for Fp8Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fp8Format::E4M3 => "E4M3",
            Fp8Format::E5M2 => "E5M2",
        })
    }
}

impl std::str::FromStr for Fp8Format {
    type Err = crate::KernelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "e4m3" | "fp8e4m3" | "float8_e4m3fn" => Ok(Fp8Format::E4M3),
            "e5m2" | "fp8e5m2" | "float8_e5m2" => Ok(Fp8Format::E5M2),
            _ => Err(crate::KernelError::UnknownFormat(s.to_string())),
        }
    }
}
