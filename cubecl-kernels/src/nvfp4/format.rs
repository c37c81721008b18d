//! The NVFP4 format in plain Rust: its constants, block tiles and rounding modes, and the element functions in
//! TE's order of f32 operations — the reference that the host path (`host::nvfp4`) uses and the device kernels
//! (`kernel::nvfp4`) match bit for bit.

use crate::Fp8Format;
use crate::ScaleBlock;
use crate::error::KernelError;

/// `448 · 6`: E4M3's largest value times E2M1's.
pub const GLOBAL_SCALE_NUMERATOR: f32 = 2688.0;
/// Bits of the f32 `1.0f / 6.0f` (0x3e2aaaab).
pub const ONE_SIXTH_BITS: u32 = 0x3e2a_aaab;
/// Bits of the f32 `1.0f / 2688.0f`.
pub const ONE_OVER_2688_BITS: u32 = 0x39c3_0c31;
/// TE's `factor_inv` of an NVFP4 GEMM's `alpha = amax_A · amax_B · factor_inv`: `1.0 / (6 · 6 · 448 · 448)` in
/// f64, then as f32.
pub const GEMM_ALPHA_FACTOR_INV: f32 = (1.0f64 / (6.0 * 6.0 * 448.0 * 448.0)) as f32;
/// Elements per block along a row.
pub const BLOCK: usize = 16;
/// E2M1's largest value.
pub const E2M1_MAX: f32 = 6.0;
/// TE's fixed sign vector of the random Hadamard transform as a mask (bit `i` set: row `i` negated).
pub const RHT_SIGN_MASK: u16 = 0xd7e8;

/// How a tensor is cut into blocks that share one E4M3 scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Nvfp4Tile {
    /// 16 consecutive values of a row (activations, gradients).
    Row1x16,
    /// 16×16 tiles (weights, unless `disable_2d_quantization`).
    Tile16x16,
}

impl Nvfp4Tile {
    /// The block shape.
    pub const fn block(self) -> ScaleBlock {
        match self {
            Nvfp4Tile::Row1x16 => ScaleBlock::new(1, BLOCK),
            Nvfp4Tile::Tile16x16 => ScaleBlock::new(BLOCK, BLOCK),
        }
    }
}

/// The E2M1 code (low 4 bits) of `x`: nearest-even, saturating to ±6 (±inf included), NaN → +6 (0x7), the sign
/// of zero kept (-0.0 → 0x8).
#[inline]
pub fn encode_e2m1(x: f32) -> u8 {
    let bits = x.to_bits();
    let abs = bits & 0x7fff_ffff;
    // The upper bound of each code's range, and whether the bound (a tie) rounds to it (its mantissa is even).
    const BOUNDS: [(u32, bool); 7] = [
        (0x3e80_0000, true),  // 0.25 → 0
        (0x3f40_0000, false), // 0.75 → 1.0
        (0x3fa0_0000, true),  // 1.25 → 1.0
        (0x3fe0_0000, false), // 1.75 → 2.0
        (0x4020_0000, true),  // 2.5 → 2.0
        (0x4060_0000, false), // 3.5 → 4.0
        (0x40a0_0000, true),  // 5.0 → 4.0
    ];
    // The code is how many bounds `abs` lies above (or on, where the tie rounds up): the bounds ascend, so this
    // is the first bound it rounds to, with no branch (loops over it vectorize); NaN and inf lie above all: 7.
    let code: u32 = BOUNDS
        .iter()
        .map(|&(bound, tie_down)| u32::from(abs > bound || (abs == bound && !tie_down)))
        .sum();
    let sign = if abs > 0x7f80_0000 {
        0
    } else {
        (bits >> 28) & 0x8
    };
    (sign | code) as u8
}

/// The exact value of an E2M1 code (low 4 bits).
pub fn decode_e2m1(code: u8) -> f32 {
    const VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let value = VALUES[usize::from(code & 0x7)];
    if code & 0x8 != 0 { -value } else { value }
}

/// `fminf(value, FLT_MAX)` for a non-negative value or NaN (C's `fminf` returns the non-NaN operand).
fn min_f32_max(value: f32) -> f32 {
    if value.to_bits() > f32::MAX.to_bits() {
        f32::MAX
    } else {
        value
    }
}

/// The global encode scale `S_enc` of a tensor with this amax.
pub fn global_encode_scale(amax: f32) -> f32 {
    let scale = min_f32_max(GLOBAL_SCALE_NUMERATOR / amax);
    if amax.to_bits() & 0x7fff_ffff == 0 || scale.to_bits() == 0 {
        1.0
    } else {
        scale
    }
}

/// The global decode scale `S_dec = 1 / S_enc`.
pub fn global_decode_scale(amax: f32) -> f32 {
    1.0 / global_encode_scale(amax)
}

/// The E4M3 code of a block's decode scale, from the block's amax and `S_enc`.
pub fn block_scale_code(block_amax: f32, encode_scale: f32) -> u8 {
    let scaled = min_f32_max(block_amax * (encode_scale * f32::from_bits(ONE_SIXTH_BITS)));
    Fp8Format::E4M3.encode(scaled)
}

/// A block's encode multiplier from its scale code and `S_dec` (`f32::MAX` for a zero scale).
pub fn block_encode_scale(scale_code: u8, decode_scale: f32) -> f32 {
    min_f32_max(1.0 / (Fp8Format::E4M3.decode(scale_code) * decode_scale))
}

/// A block's dequantization factor `(float(s) · amax) · (1/2688)`.
pub fn dequantize_factor(scale_code: u8, amax: f32) -> f32 {
    (Fp8Format::E4M3.decode(scale_code) * amax) * f32::from_bits(ONE_OVER_2688_BITS)
}

/// TE's stochastic rounding of a scaled value to E2M1 with 8 random bits (`random`): one of the two E2M1
/// neighbours of `v`, up with probability `⌊256·f⌋/256` where `f` is `v`'s fraction of the way up; ±6 beyond,
/// NaN → +6.
pub fn stochastic_round_e2m1(v: f32, random: u8) -> u8 {
    let bits = v.to_bits();
    let abs = bits & 0x7fff_ffff;
    if abs > 0x7f80_0000 {
        return 0x7;
    }
    let a = f32::from_bits(abs);
    let step = |a: f32| {
        if a >= 4.0 {
            2.0f32
        } else if a >= 2.0 {
            1.0
        } else {
            0.5
        }
    };
    // (r/256)·step is exact, so one rounding, as TE's fmaf.
    let t = a + f32::from(random) * (step(a) * (1.0 / 256.0));
    let q = (t / step(t)).floor() * step(t);
    encode_e2m1(q) | ((bits >> 28) & 0x8) as u8
}

/// 8 random bits for element `index` under `seed`: a counter-based hash, the same on the host and the device.
pub fn random_bits(seed: u32, index: u32) -> u8 {
    let mut x = index.wrapping_mul(0x9e37_79b9) ^ seed;
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    (x >> 24) as u8
}

/// `x` rounded to the nearest bf16 (ties to even), as an f32; NaN stays NaN.
#[inline]
pub fn round_to_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return f32::from_bits(bits | 0x0040_0000);
    }
    f32::from_bits(bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000)
}

/// The RHT matrix `M = diag(s) · H16 · 1/4` for a sign mask (bit `r` set: row `r` negated; 0: no signs).
pub fn rht_matrix(sign_mask: u16) -> [[f32; 16]; 16] {
    let mut m = [[0.0; 16]; 16];
    for (r, row) in m.iter_mut().enumerate() {
        for (c, value) in row.iter_mut().enumerate() {
            let negative = ((u32::from(sign_mask) >> r) ^ (r & c).count_ones()) & 1 == 1;
            *value = if negative { -0.25 } else { 0.25 };
        }
    }
    m
}

/// How to round the elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Nvfp4Rounding {
    /// Round to nearest-even.
    Nearest,
    /// TE's stochastic rounding with the random bits of [`random_bits`] under this seed.
    Stochastic {
        /// The seed: the same seed gives the same codes.
        seed: u32,
    },
}

/// The RHT works on 16-element chunks of the last dimension.
pub(crate) fn check_rht_cols(cols: usize) -> Result<(), KernelError> {
    if !cols.is_multiple_of(BLOCK) {
        return Err(KernelError::InvalidArgument {
            what: "random Hadamard transform",
            reason: format!("the last dimension ({cols}) is not a multiple of 16"),
        });
    }
    Ok(())
}
