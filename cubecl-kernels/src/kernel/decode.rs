//! Packed codes decoded into a float type, one code word per unit: the operands of the FP8 GEMM's decoded path
//! (`burn_te_kernels::gemm::decoded`).

use cubecl::prelude::*;

use crate::Fp8Format;
use crate::kernel::code::{CodeFormat, decode};
use crate::kernel::code_view::{codes_per_word, word_values};

/// `output[w] = the codes of codes[w], as F` for each of the `words` words (lowest bits first), unscaled. `N` is
/// the codes per word; a partial last word's spare lanes decode its zero padding.
#[cube(launch_unchecked)]
pub fn decode_codes_kernel<F: Float, N: Size>(
    codes: &Array<u32>,
    output: &mut Array<Vector<F, N>>,
    words: u32,
    #[comptime] element: CodeFormat,
) {
    let word = ABSOLUTE_POS;
    if word < words as usize {
        output[word] = word_values::<F, N>(codes[word], element);
    }
}

/// As [`decode_codes_kernel()`], each value times its block's scale in f32 (one rounding, the SIMT kernel's staging;
/// none for a power of two) before the cast to `F`: code `i` of the row-major `[rows, cols]` view (a batch's
/// matrices stacked) takes the scale of its block `block_slot(i)`. `scales` holds, for FP8 codes, each block's f32
/// `scale_inv` (its bits), and for NVFP4's E2M1 codes each block's E4M3 scale code (four per word, block `4w + b`
/// in byte `b`): the block-scaled values of TE's NVFP4 GEMM, its global factor left for the product, exact in f16,
/// bf16 and f32 (an E2M1 value, two significant bits from 0.5 to 6, times an E4M3 value, four from 2⁻⁹ to 448, has
/// at most six significant bits and lies within 2⁻¹⁰ and 2688).
#[cube(launch_unchecked)]
pub fn decode_scaled_codes_kernel<F: Float, N: Size>(
    codes: &Array<u32>,
    scales: &Array<u32>,
    output: &mut Array<Vector<F, N>>,
    words: u32,
    blocks: BlockGrid,
    #[comptime] element: CodeFormat,
) {
    let word = ABSOLUTE_POS as u32;
    if word < words {
        let lanes = comptime!(codes_per_word(element) as u32);
        let bits = comptime!(32 / codes_per_word(element) as u32);
        let mask = comptime!((1u32 << bits) - 1);
        let packed = codes[word as usize];
        let mut out = Vector::<F, N>::empty();
        #[unroll]
        for lane in 0..lanes {
            let slot = block_slot(word * lanes + lane, blocks);
            let scale = if comptime!(element == CodeFormat::E2m1) {
                let scale_code = (scales[(slot / 4) as usize] >> (8 * (slot % 4))) & 0xff;
                decode(scale_code, comptime!(CodeFormat::Fp8(Fp8Format::E4M3)))
            } else {
                f32::reinterpret(scales[slot as usize])
            };
            let code = (packed >> (bits * lane)) & mask;
            out[lane as usize] = F::cast_from(decode(code, element) * scale);
        }
        output[word as usize] = out;
    }
}

/// Where the blocks of a row-major `[rows, cols]` view lie: its `len` codes, `cols` columns, `block_rows` ×
/// `block_cols` blocks, `grid_cols` blocks per block row.
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub struct BlockGrid {
    /// Codes in the view.
    pub len: u32,
    /// Columns of the view.
    pub cols: u32,
    /// Rows of a block.
    pub block_rows: u32,
    /// Columns of a block.
    pub block_cols: u32,
    /// Blocks along a row of the view.
    pub grid_cols: u32,
}

/// The block of code `at` (row-major over the block grid); a partial last word's spare lanes (`at ≥ len`) take the
/// last code's.
#[cube]
fn block_slot(at: u32, blocks: BlockGrid) -> u32 {
    let index = select(at < blocks.len, at, blocks.len - 1);
    (index / blocks.cols / blocks.block_rows) * blocks.grid_cols
        + (index % blocks.cols) / blocks.block_cols
}
