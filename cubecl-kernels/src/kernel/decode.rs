//! Packed codes decoded into a float type, one code word per unit: the operands of the FP8 GEMM's decoded path
//! (`burn_te_kernels::decoded`).

use cubecl::prelude::*;

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

/// As [`decode_codes_kernel`], each value times its block's scale in f32 (one rounding, the SIMT kernel's staging;
/// none for a power of two) before the cast to `F`: code `i` of the row-major `[rows, cols]` view (a batch's
/// matrices stacked) takes `scales[(i / cols / block_rows) · grid_cols + (i % cols) / block_cols]`. A partial last
/// word's spare lanes (`i ≥ len`) read the last code's scale.
#[cube(launch_unchecked)]
pub fn decode_scaled_codes_kernel<F: Float, N: Size>(
    codes: &Array<u32>,
    scales: &Array<f32>,
    output: &mut Array<Vector<F, N>>,
    words: u32,
    len: u32,
    cols: u32,
    block_rows: u32,
    block_cols: u32,
    grid_cols: u32,
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
            let at = word * lanes + lane;
            let index = select(at < len, at, len - 1);
            let slot = (index / cols / block_rows) * grid_cols + (index % cols) / block_cols;
            let code = (packed >> (bits * lane)) & mask;
            out[lane as usize] = F::cast_from(decode(code, element) * scales[slot as usize]);
        }
        output[word as usize] = out;
    }
}
