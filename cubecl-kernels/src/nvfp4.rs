//! NVFP4 (Transformer Engine's `NVFP4BlockScaling` format), emulated on any device: 4-bit E2M1 values
//! (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives), an E4M3 decode scale per block of 16 values along a row (1×16) or
//! per 16×16 tile (weights), and an f32 global scale from the tensor's amax. The formulas, in TE's order of f32
//! operations (each step one IEEE f32 operation, round to nearest-even):
//!
//! - global: `S_enc = fminf(2688 / amax, FLT_MAX)` (1 when amax is 0 or `S_enc` is 0), `S_dec = 1 / S_enc`;
//! - block scale: `s = e4m3(fminf(block_amax · (S_enc · (1/6)), FLT_MAX))`, saturating to 448;
//! - block multiplier: `enc = fminf(1 / (float(s) · S_dec), FLT_MAX)`;
//! - element: `code = e2m1(x · enc)`, nearest-even, saturating to ±6, NaN → +6, the sign of zero kept;
//! - dequantize: `y = e2m1(code) · ((float(s) · amax) · (1/2688))`.
//!
//! Codes are packed two per byte, the first element in the low nibble (TE's layout); on a device, eight per `u32`
//! word (the same bytes, little-endian). Block scales are E4M3 codes, row-major over the block grid, four per word
//! on a device. This module has the plain-Rust element functions (the reference the kernels of
//! [`crate::kernel::nvfp4`] match bit for bit) and the device launchers; [`crate::host::nvfp4`] quantizes whole
//! tensors on the host.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::kernel::nvfp4 as kernel;
use crate::ops::{check_len, check_size, elementwise_grid};
use crate::{Fp8Format, KernelError, ScaleBlock};

/// `448 · 6`: E4M3's largest value times E2M1's.
pub const GLOBAL_SCALE_NUMERATOR: f32 = 2688.0;
/// Bits of the f32 `1.0f / 6.0f` (0x3e2aaaab).
pub const ONE_SIXTH_BITS: u32 = 0x3e2a_aaab;
/// Bits of the f32 `1.0f / 2688.0f`.
pub const ONE_OVER_2688_BITS: u32 = 0x39c3_0c31;
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
    let code = BOUNDS
        .iter()
        .position(|&(bound, tie_down)| abs < bound || (tie_down && abs == bound))
        .unwrap_or(7) as u32;
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

/// An NVFP4 tensor on a device: `[rows, cols]` row-major (leading dimensions folded into rows).
#[derive(Clone, Debug)]
pub struct Nvfp4Buffer {
    /// E2M1 codes, eight per `u32` word (element `8w + i` in nibble `i`).
    pub codes: Handle,
    /// E4M3 block scale codes, row-major over the block grid, four per word (block `4w + b` in byte `b`).
    pub scales: Handle,
    /// The global amax (one f32), from which `S_enc` and the dequantization follow.
    pub amax: Handle,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// The blocks.
    pub tile: Nvfp4Tile,
}

impl Nvfp4Buffer {
    /// Number of blocks (scale codes).
    pub fn blocks(&self) -> usize {
        let (grid_rows, grid_cols) = self.tile.block().grid(self.rows, self.cols);
        grid_rows * grid_cols
    }
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

fn geometry(rows: usize, cols: usize, tile: Nvfp4Tile) -> Result<[u32; 4], KernelError> {
    let len = rows * cols;
    check_len(len)?;
    let block = tile.block();
    Ok([
        rows as u32,
        cols as u32,
        block.rows as u32,
        block.cols as u32,
    ])
}

/// Quantizes a row-major `[rows, cols]` tensor of `F` (f32, f16, bf16) to NVFP4 with the global amax in `amax`
/// (one f32 on the device: the tensor's own amax from [`crate::ops::amax`], or one supplied from outside, e.g.
/// reduced across peers). Two launches: the block scales (one unit per four blocks), then the codes (one unit per
/// eight elements), so any shape works without two units writing one word.
pub fn nvfp4_quantize<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Handle,
    rows: usize,
    cols: usize,
    tile: Nvfp4Tile,
    amax: &Handle,
    rounding: Nvfp4Rounding,
) -> Result<Nvfp4Buffer, KernelError> {
    let [rows32, cols32, block_rows, block_cols] = geometry(rows, cols, tile)?;
    let len = rows * cols;
    check_size("nvfp4_quantize input", input, size_of::<F>(), len)?;
    check_size("nvfp4_quantize amax", amax, 4, 1)?;
    let scales = block_scales::<R, F>(client, input, rows, cols, tile, amax)?;
    let scale_words = scales_words(rows, cols, tile);
    let code_words = len.div_ceil(8);
    let codes = client.empty(code_words.max(1) * 4);
    if len > 0 {
        let (stochastic, seed) = match rounding {
            Nvfp4Rounding::Nearest => (false, 0),
            Nvfp4Rounding::Stochastic { seed } => (true, seed),
        };
        let code_words_grid = elementwise_grid(client, code_words);
        unsafe {
            kernel::nvfp4_quantize_kernel::launch_unchecked::<F, R>(
                client,
                code_words_grid.0,
                code_words_grid.1,
                ArrayArg::from_raw_parts(input.clone(), len),
                ArrayArg::from_raw_parts(amax.clone(), 1),
                ArrayArg::from_raw_parts(scales.clone(), scale_words),
                ArrayArg::from_raw_parts(codes.clone(), code_words),
                rows32,
                cols32,
                block_rows,
                block_cols,
                seed,
                stochastic,
            );
        }
    }
    Ok(Nvfp4Buffer {
        codes,
        scales,
        amax: amax.clone(),
        rows,
        cols,
        tile,
    })
}

/// Words of the E4M3 block scale codes of a `[rows, cols]` tensor (four per word).
fn scales_words(rows: usize, cols: usize, tile: Nvfp4Tile) -> usize {
    let (grid_rows, grid_cols) = tile.block().grid(rows, cols);
    (grid_rows * grid_cols).div_ceil(4)
}

/// The E4M3 block scale codes of a `[rows, cols]` tensor under the global amax in `amax`, one unit per four blocks.
fn block_scales<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Handle,
    rows: usize,
    cols: usize,
    tile: Nvfp4Tile,
    amax: &Handle,
) -> Result<Handle, KernelError> {
    let [rows32, cols32, block_rows, block_cols] = geometry(rows, cols, tile)?;
    let len = rows * cols;
    let scale_words = scales_words(rows, cols, tile);
    let scales = client.empty(scale_words.max(1) * 4);
    if len > 0 {
        let grid = elementwise_grid(client, scale_words);
        unsafe {
            kernel::nvfp4_block_scale_kernel::launch_unchecked::<F, R>(
                client,
                grid.0,
                grid.1,
                ArrayArg::from_raw_parts(input.clone(), len),
                ArrayArg::from_raw_parts(amax.clone(), 1),
                ArrayArg::from_raw_parts(scales.clone(), scale_words),
                rows32,
                cols32,
                block_rows,
                block_cols,
                0,
            );
        }
    }
    Ok(scales)
}

/// One-pass statistics of a row-major `[rows, cols]` tensor with what quantizing it to NVFP4 (round to nearest,
/// global amax in `amax`) does to it: underflows (nonzero elements that dequantize to ±0: a ±0 code, or any code of
/// a block whose E4M3 scale underflowed to 0, which TE's code-based count misses), overflows (`|x|` above 6 times
/// the block's dequantization factor), the squared error, and the range of the blocks' dequantization factors (the
/// `scale_inv` of [`crate::Fp8Stats`]); read with [`crate::ops::StatsReadback::read_fp8`]. Four launches: block
/// scales, their encode multipliers, their dequantization factors, then the statistics in one read of the tensor.
pub fn nvfp4_tensor_stats<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Handle,
    rows: usize,
    cols: usize,
    tile: Nvfp4Tile,
    amax: &Handle,
) -> Result<crate::ops::StatsReadback, KernelError> {
    check_size(
        "nvfp4_tensor_stats input",
        input,
        size_of::<F>(),
        rows * cols,
    )?;
    check_size("nvfp4_tensor_stats amax", amax, 4, 1)?;
    let scales = block_scales::<R, F>(client, input, rows, cols, tile, amax)?;
    let (grid_rows, grid_cols) = tile.block().grid(rows, cols);
    let blocks = grid_rows * grid_cols;
    let factors = per_block(client, &scales, amax, blocks, PerBlock::Factors)?;
    let multipliers = per_block(client, &scales, amax, blocks, PerBlock::Multipliers)?;
    crate::ops::launch_stats::<R, F>(
        client,
        input,
        rows * cols,
        Some((
            crate::kernel::code::CodeFormat::E2m1,
            crate::ops::StatsScales::Blocks {
                scale: &multipliers,
                scale_inv: &factors,
                cols,
                block: tile.block(),
            },
        )),
    )
}

/// Dequantizes an NVFP4 tensor to `F`: `e2m1(code) · ((float(s) · amax) · (1/2688))`.
pub fn nvfp4_dequantize<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    tensor: &Nvfp4Buffer,
) -> Result<Handle, KernelError> {
    let [rows32, cols32, block_rows, block_cols] = geometry(tensor.rows, tensor.cols, tensor.tile)?;
    let len = tensor.rows * tensor.cols;
    check_size("nvfp4 codes", &tensor.codes, 4, len.div_ceil(8))?;
    check_size(
        "nvfp4 scales",
        &tensor.scales,
        4,
        tensor.blocks().div_ceil(4),
    )?;
    check_size("nvfp4 amax", &tensor.amax, 4, 1)?;
    let output = client.empty(len.max(1) * size_of::<F>());
    if len > 0 {
        let len_grid = elementwise_grid(client, len);
        unsafe {
            kernel::nvfp4_dequantize_kernel::launch_unchecked::<F, R>(
                client,
                len_grid.0,
                len_grid.1,
                ArrayArg::from_raw_parts(tensor.codes.clone(), len.div_ceil(8)),
                ArrayArg::from_raw_parts(tensor.scales.clone(), tensor.blocks().div_ceil(4)),
                ArrayArg::from_raw_parts(tensor.amax.clone(), 1),
                ArrayArg::from_raw_parts(output.clone(), len),
                rows32,
                cols32,
                block_rows,
                block_cols,
                0,
            );
        }
    }
    Ok(output)
}

/// Each block's dequantization factor `(float(s) · amax) · (1/2688)` (f32, row-major over the block grid): the
/// scales of an NVFP4 operand of [`crate::gemm::fp8_gemm`], which then multiplies each decoded E2M1 code by its
/// block's factor as it stages it — the values of [`nvfp4_dequantize`] exactly.
pub fn nvfp4_block_factors<R: Runtime>(
    client: &ComputeClient<R>,
    tensor: &Nvfp4Buffer,
) -> Result<Handle, KernelError> {
    let blocks = tensor.blocks();
    check_size("nvfp4 scales", &tensor.scales, 4, blocks.div_ceil(4))?;
    check_size("nvfp4 amax", &tensor.amax, 4, 1)?;
    per_block(
        client,
        &tensor.scales,
        &tensor.amax,
        blocks,
        PerBlock::Factors,
    )
}

/// A value of each block, from its E4M3 scale code and the global amax.
#[derive(Clone, Copy)]
enum PerBlock {
    /// The dequantization factor `(float(s) · amax) · (1/2688)`.
    Factors,
    /// The encode multiplier `min(1 / (float(s) · S_dec), FLT_MAX)`.
    Multipliers,
}

/// One f32 per block (`blocks` scale codes, four per word, and the global amax; sizes checked by the caller).
fn per_block<R: Runtime>(
    client: &ComputeClient<R>,
    scales: &Handle,
    amax: &Handle,
    blocks: usize,
    which: PerBlock,
) -> Result<Handle, KernelError> {
    let blocks32 = check_len(blocks)?;
    let values = client.empty(blocks.max(1) * 4);
    if blocks > 0 {
        let (cubes, dim) = elementwise_grid(client, blocks);
        // SAFETY: `scales` holds `blocks` codes four per word and `amax` one f32 (checked by the callers); `values`
        // was just allocated with `blocks` f32.
        unsafe {
            let scales = ArrayArg::from_raw_parts(scales.clone(), blocks.div_ceil(4));
            let amax = ArrayArg::from_raw_parts(amax.clone(), 1);
            let out = ArrayArg::from_raw_parts(values.clone(), blocks);
            match which {
                PerBlock::Factors => kernel::nvfp4_block_factors_kernel::launch_unchecked::<R>(
                    client, cubes, dim, scales, amax, out, blocks32, 0,
                ),
                PerBlock::Multipliers => {
                    kernel::nvfp4_block_multipliers_kernel::launch_unchecked::<R>(
                        client, cubes, dim, scales, amax, out, blocks32,
                    )
                }
            }
        }
    }
    Ok(values)
}

impl Nvfp4Buffer {
    /// This tensor as a GEMM operand (`factors` from [`nvfp4_block_factors`]), used as is or transposed. Its
    /// blocks must lie along the GEMM's K: 1×16 blocks of an operand whose K runs along its columns, or 16×16 tiles.
    pub fn gemm_operand<'a>(
        &'a self,
        factors: &'a Handle,
        transposed: bool,
    ) -> crate::gemm::GemmOperand<'a> {
        crate::gemm::GemmOperand {
            codes: crate::gemm::OperandCodes::E2m1 {
                codes: &self.codes,
                len: self.rows * self.cols,
            },
            scale_inv: factors,
            batch: 1,
            rows: self.rows,
            cols: self.cols,
            block: Some(self.tile.block()),
            transposed,
        }
    }
}

/// The random Hadamard transform of a tensor whose last dimension (`cols`) is a multiple of 16: every 16-element
/// chunk of a row times `M = diag(s) · H16 · 1/4`, rounded to bf16 (returned as f32).
pub fn rht<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Handle,
    rows: usize,
    cols: usize,
    sign_mask: u16,
) -> Result<Handle, KernelError> {
    check_rht_cols(cols)?;
    let len = rows * cols;
    let len32 = check_len(len)?;
    check_size("rht input", input, size_of::<F>(), len)?;
    let output = client.empty(len.max(1) * 4);
    if len > 0 {
        let len_grid = elementwise_grid(client, len);
        unsafe {
            kernel::rht_kernel::launch_unchecked::<F, R>(
                client,
                len_grid.0,
                len_grid.1,
                ArrayArg::from_raw_parts(input.clone(), len),
                ArrayArg::from_raw_parts(output.clone(), len),
                len32,
                u32::from(sign_mask),
            );
        }
    }
    Ok(output)
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
