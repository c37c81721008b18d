//! Cube-wide reductions in shared memory, shared by the kernels that fuse an amax into another pass.

use cubecl::prelude::*;

/// Units per cube of the element-wise and reduction kernels.
pub const CUBE_SIZE: u32 = 256;

/// Bits of `|x|` of an f32 bit pattern. Ordered like the magnitudes as unsigned integers, and any NaN sorts above
/// +inf, so an integer max over these propagates NaN (Transformer Engine's `fmaxf` amax skips it instead: see
/// the book's Recipes page).
#[cube]
pub fn abs_bits(bits: u32) -> u32 {
    bits & 0x7fff_ffff
}

/// Max of `value` over the cube, then one atomic max into `target[0]` by unit 0. Every unit of the cube must call
/// it (it synchronises the cube).
#[cube]
pub fn cube_atomic_max(value: u32, target: &mut Array<Atomic<u32>>) {
    let mut shared = SharedMemory::<u32>::new(comptime!(CUBE_SIZE as usize));
    let unit = UNIT_POS as usize;
    shared[unit] = value;
    sync_cube();
    let mut stride = comptime!(CUBE_SIZE as usize / 2).runtime();
    while stride > 0 {
        if unit < stride {
            let other = shared[unit + stride];
            if other > shared[unit] {
                shared[unit] = other;
            }
        }
        sync_cube();
        stride /= 2;
    }
    if unit == 0 {
        target[0].fetch_max(shared[0]);
    }
}
