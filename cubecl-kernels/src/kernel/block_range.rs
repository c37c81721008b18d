//! The largest per-block dynamic range of a row-major `[rows, cols]` tensor (the debug tools'
//! `max_blockwise_dynamic_range`): per block `log2(max |x|) − log2(min nonzero |x|)`, 0 for an all-zero block. The
//! per-block amax and min nonzero come from [`crate::kernel::block::block_amax_kernel()`].

use cubecl::prelude::*;

use crate::kernel::reduce::{abs_bits, cube_atomic_max};

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
