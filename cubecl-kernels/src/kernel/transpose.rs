//! The transpose of packed byte codes (FP8, four per `u32` word): each unit writes one output word.

use cubecl::prelude::*;

/// `output = transpose(input)` for each of `batch` row-major `rows × cols` matrices of byte codes, four per word
/// (`len = batch · rows · cols` codes; the last word's unused bytes are 0). An exact permutation of the codes.
#[cube(launch_unchecked)]
pub fn transpose_codes_kernel(
    input: &Array<u32>,
    output: &mut Array<u32>,
    rows: u32,
    cols: u32,
    len: u32,
) {
    let word = ABSOLUTE_POS as u32;
    if word * 4 < len {
        let matrix = rows * cols;
        let mut packed = 0u32;
        #[unroll]
        for j in 0..4u32 {
            let o = word * 4 + j;
            if o < len {
                // Output element `o` is (batch b, row c of the transpose, column r) = input (b, r, c).
                let b = o / matrix;
                let rem = o - b * matrix;
                let c = rem / rows;
                let r = rem - c * rows;
                let i = b * matrix + r * cols + c;
                let code = (input[(i / 4) as usize] >> ((i % 4) * 8)) & 0xff;
                packed |= code << (j * 8);
            }
        }
        output[word as usize] = packed;
    }
}
