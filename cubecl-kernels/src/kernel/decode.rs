//! Packed codes decoded into a float type, one code word per unit: the operands of the FP8 GEMM's decoded path
//! ([`crate::decoded`]).

use cubecl::prelude::*;

use crate::kernel::code::CodeFormat;
use crate::kernel::code_view::word_values;

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
