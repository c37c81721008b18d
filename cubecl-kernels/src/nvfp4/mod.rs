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
//! on a device. [`format`](mod@format) has the plain-Rust element functions (the reference the kernels match bit for bit);
//! this module has the device launchers; [`crate::host::nvfp4`] quantizes whole tensors on the host.

use cubecl::prelude::*;
use cubecl::server::Handle;

pub mod format;

pub(crate) use format::check_rht_cols;
pub use format::{
    BLOCK, E2M1_MAX, GEMM_ALPHA_FACTOR_INV, GLOBAL_SCALE_NUMERATOR, Nvfp4Rounding, Nvfp4Tile,
    ONE_OVER_2688_BITS, ONE_SIXTH_BITS, RHT_SIGN_MASK, block_encode_scale, block_scale_code,
    decode_e2m1, dequantize_factor, encode_e2m1, global_decode_scale, global_encode_scale,
    random_bits, rht_matrix, round_to_bf16, stochastic_round_e2m1,
};

use crate::error::KernelError;
use crate::kernel::nvfp4 as kernel;
use crate::ops::{check_len, check_size, elementwise_grid};

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
/// scales of an NVFP4 operand of the FP8 GEMM (`gemm::fp8_gemm`), which then multiplies each decoded E2M1 code by its
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
