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

/// Codes per side of the square tile one cube of [`transpose_tiles_kernel()`] transposes.
pub const TILE: u32 = 64;
/// Words per tile row (four codes per word).
const TILE_WORDS: u32 = TILE / 4;
/// Units per side of that kernel's cube (`TILE_WORDS × TILE_WORDS` units; each moves `TILE / TILE_WORDS` words).
pub const TILE_UNITS: u32 = TILE_WORDS;

/// The same transpose as [`transpose_codes_kernel()`] for `rows` and `cols` multiples of 4, a `TILE × TILE` tile of
/// codes per cube (`CUBE_POS_X` along the columns, `CUBE_POS_Y` along the rows, `CUBE_POS_Z` the matrix): whole
/// words are read row by row into shared memory, then each output word gathers its four codes from there. Reads and
/// writes are consecutive words across a cube's units, where the gather kernel reads a word per code.
#[cube(launch_unchecked)]
pub fn transpose_tiles_kernel(input: &Array<u32>, output: &mut Array<u32>, rows: u32, cols: u32) {
    // Tile rows padded by one word against shared-memory bank conflicts.
    let pitch = comptime!(TILE_WORDS + 1);
    let mut tile = SharedMemory::<u32>::new(comptime!((TILE * (TILE_WORDS + 1)) as usize));
    let row_words = cols / 4;
    let col_words = rows / 4;
    let matrix_words = row_words * rows;
    let base = CUBE_POS_Z * matrix_words;
    let row0 = CUBE_POS_Y * TILE;
    let col0 = CUBE_POS_X * TILE;
    let tx = UNIT_POS_X;
    let ty = UNIT_POS_Y;

    // Input rows row0 + ty + TILE_UNITS·i, word tx of each.
    #[unroll]
    for i in 0..comptime!(TILE / TILE_UNITS) {
        let r = ty + i * TILE_UNITS;
        let word = col0 / 4 + tx;
        if row0 + r < rows && word < row_words {
            tile[(r * pitch + tx) as usize] =
                input[(base + (row0 + r) * row_words + word) as usize];
        }
    }
    sync_cube();

    // Output rows col0 + ty + TILE_UNITS·i (input columns), word tx: input rows row0 + 4·tx .. + 3.
    #[unroll]
    for i in 0..comptime!(TILE / TILE_UNITS) {
        let c = ty + i * TILE_UNITS;
        let word = row0 / 4 + tx;
        if col0 + c < cols && word < col_words {
            let shift = (c % 4) * 8;
            let mut packed = 0u32;
            #[unroll]
            for j in 0..4u32 {
                let code = (tile[((tx * 4 + j) * pitch + c / 4) as usize] >> shift) & 0xff;
                packed |= code << (j * 8);
            }
            output[(base + (col0 + c) * col_words + word) as usize] = packed;
        }
    }
}
