//! The element codes of a quantized tensor: FP8 (E4M3, E5M2) or NVFP4's E2M1, as a comptime choice of the kernels
//! that read them (the GEMM's staging, the statistics).

use cubecl::prelude::*;

use crate::Fp8Format;
use crate::kernel::fp8::{decode_fp8, encode_fp8};
use crate::kernel::nvfp4::{decode_e2m1, encode_e2m1};

/// The element codes of a quantized tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CodeFormat {
    /// FP8 codes, four per `u32` word.
    Fp8(Fp8Format),
    /// NVFP4's E2M1 codes, eight per word (the scales are the blocks' dequantization factors).
    E2m1,
}

impl CodeFormat {
    /// The FP8 format (E4M3 for E2M1, where it is not used).
    pub const fn fp8(self) -> Fp8Format {
        match self {
            CodeFormat::Fp8(format) => format,
            CodeFormat::E2m1 => Fp8Format::E4M3,
        }
    }

    /// The largest finite value.
    pub fn max(self) -> f32 {
        match self {
            CodeFormat::Fp8(format) => format.max(),
            CodeFormat::E2m1 => crate::nvfp4::format::E2M1_MAX,
        }
    }

    /// The mask of a code's magnitude bits (a code is ±0 when they are 0).
    pub const fn magnitude_mask(self) -> u32 {
        match self {
            CodeFormat::Fp8(_) => 0x7f,
            CodeFormat::E2m1 => 0x7,
        }
    }
}

/// The value of a code.
#[cube]
pub fn decode(code: u32, #[comptime] element: CodeFormat) -> f32 {
    if comptime!(element == CodeFormat::E2m1) {
        decode_e2m1(code)
    } else {
        decode_fp8(code, comptime!(element.fp8()))
    }
}

/// The code of f32 bits: round to nearest-even, saturating (E2M1) or as the FP8 format does.
#[cube]
pub fn encode(bits: u32, #[comptime] element: CodeFormat) -> u32 {
    if comptime!(element == CodeFormat::E2m1) {
        encode_e2m1(bits)
    } else {
        encode_fp8(bits, comptime!(element.fp8()))
    }
}
