//! The amax kernel: max |x| over a tensor.

use cubecl::prelude::*;

use crate::kernel::reduce::{CUBE_SIZE, abs_bits, cube_atomic_max};

/// `amax[0] = max(amax[0], max |x|)` as f32 bits. Units walk the tensor with a grid stride, so a few cubes cover
/// any length and the cube-wide reduction (barriers) runs once per cube, not once per few elements.
#[cube(launch_unchecked)]
pub fn amax_kernel<F: Float>(input: &Array<F>, amax: &mut Array<Atomic<u32>>, len: u32) {
    let len = len as usize;
    let stride = CUBE_COUNT * comptime!(CUBE_SIZE as usize);
    let mut local_amax = 0u32;
    let mut index = ABSOLUTE_POS;
    while index < len {
        let magnitude = abs_bits(u32::reinterpret(f32::cast_from(input[index])));
        if magnitude > local_amax {
            local_amax = magnitude;
        }
        index += stride;
    }
    cube_atomic_max(local_amax, amax);
}
