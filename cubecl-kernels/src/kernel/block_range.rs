//! The largest per-block dynamic range of a row-major `[rows, cols]` tensor (the debug tools'
//! `max_blockwise_dynamic_range`): per block `log2(max |x|) − log2(min nonzero |x|)`, 0 for an all-zero block.

use cubecl::prelude::*;

use super::reduce::{abs_bits, cube_atomic_max};

/// `amin[block] = min nonzero |x|` over each block (f32 bits, atomically). One unit per `(row, block column)`
/// segment of at most `block_cols` elements; `amin` must start at `u32::MAX` (a block without a nonzero element
/// keeps it).
#[cube(launch_unchecked)]
pub fn block_amin_nonzero_kernel<F: Float>(
    input: &Array<F>,
    amin: &mut Array<Atomic<u32>>,
    rows: u32,
    cols: u32,
    block_rows: u32,
    block_cols: u32,
) {
    let blocks_per_row = cols.div_ceil(block_cols);
    let segment = ABSOLUTE_POS as u32;
    let row = segment / blocks_per_row;
    let block_col = segment % blocks_per_row;
    if row < rows {
        let start = block_col * block_cols;
        let end = select(start + block_cols > cols, cols, start + block_cols);
        let mut local = 0xffff_ffffu32;
        for col in start..end {
            let magnitude = abs_bits(u32::reinterpret(f32::cast_from(
                input[(row * cols + col) as usize],
            )));
            if magnitude != 0 && magnitude < local {
                local = magnitude;
            }
        }
        amin[((row / block_rows) * blocks_per_row + block_col) as usize].fetch_min(local);
    }
}

/// `output[0] = max over blocks of log2(amax) − log2(amin)` (f32 bits, atomically; `output` must start at 0). A
/// block whose amax is 0 counts 0; a NaN in a block makes the result NaN (its bits sort above every number).
#[cube(launch_unchecked)]
pub fn block_range_max_kernel(
    amax: &Array<u32>,
    amin: &Array<u32>,
    output: &mut Array<Atomic<u32>>,
    blocks: u32,
) {
    let block = ABSOLUTE_POS as u32;
    let mut range = 0u32;
    if block < blocks {
        let top = amax[block as usize];
        if top != 0 {
            let high = f32::reinterpret(top);
            let low = f32::reinterpret(amin[block as usize]);
            let bits =
                u32::reinterpret((high.ln() - low.ln()) * comptime!(core::f32::consts::LOG2_E));
            // A quiet NaN from inf − inf keeps its sign bit off so it still sorts above every number.
            range = abs_bits(bits);
        }
    }
    cube_atomic_max(range, output);
}
