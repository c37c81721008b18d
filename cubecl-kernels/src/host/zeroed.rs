//! Zeroed output buffers, filled on rayon's threads: a large `vec![0; n]` is zeroed (or page-faulted in) by the
//! calling thread alone while the other cores wait for the kernel that then overwrites it.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::gemm::advise_huge_pages;

/// Values per task (256 KiB of f32).
const CHUNK: usize = 1 << 16;

/// `len` zeros (`T::default()`, all-zero bits for the numbers this is used for), written in parallel when large
/// (huge pages asked for first: [`advise_huge_pages`]).
pub fn zeroed<T: Copy + Default + Send + Sync>(len: usize) -> Vec<T> {
    if len < 4 * CHUNK {
        return vec![T::default(); len];
    }
    let mut values = Vec::with_capacity(len);
    advise_huge_pages(&values.spare_capacity_mut()[..len]);
    values.spare_capacity_mut()[..len]
        .par_chunks_mut(CHUNK)
        .for_each(|chunk: &mut [MaybeUninit<T>]| chunk.fill(MaybeUninit::new(T::default())));
    // SAFETY: the first `len` values were just written.
    unsafe { values.set_len(len) };
    values
}
