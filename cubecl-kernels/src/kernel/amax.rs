//! The amax kernel: max |x| over a tensor.

use cubecl::prelude::*;

use super::reduce::{abs_bits, cube_atomic_max};

/// `amax[0] = max(amax[0], max |x|)` as f32 bits; four elements per unit.
#[cube(launch_unchecked)]
pub fn amax_kernel<F: Float>(input: &Array<F>, amax: &mut Array<Atomic<u32>>, len: u32) {
    let first = ABSOLUTE_POS * 4;
    let len = len as usize;
    let mut local_amax = 0u32;
    #[unroll]
    for k in 0..4u32 {
        let index = first + k as usize;
        if index < len {
            let magnitude = abs_bits(u32::reinterpret(f32::cast_from(input[index])));
            if magnitude > local_amax {
                local_amax = magnitude;
            }
        }
    }
    cube_atomic_max(local_amax, amax);
}
