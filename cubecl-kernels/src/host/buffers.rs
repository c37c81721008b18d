//! Output buffers of the host kernels. A large `vec![0; n]` is zeroed (or page-faulted in) by the calling thread
//! alone while the other cores wait for the kernel that then writes it: [`zeroed`] fills on rayon's threads, and
//! [`uninit`] leaves a buffer that a kernel overwrites whole (the GEMM's output) unwritten.

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
    let mut values = uninit(len);
    values
        .par_chunks_mut(CHUNK)
        .for_each(|chunk| chunk.fill(MaybeUninit::new(T::default())));
    // SAFETY: every value was just written.
    unsafe { assume_init(values) }
}

/// `len` values not yet written (huge pages asked for where large), for a kernel that writes every one; then
/// [`assume_init`].
pub fn uninit<T>(len: usize) -> Vec<MaybeUninit<T>> {
    let mut values = Vec::with_capacity(len);
    advise_huge_pages(&values.spare_capacity_mut()[..len]);
    // SAFETY: `MaybeUninit` needs no initialization; the capacity holds `len`.
    unsafe { values.set_len(len) };
    values
}

/// The values of a buffer whose every value has been written.
///
/// # Safety
/// Every value of `values` is initialized.
pub unsafe fn assume_init<T>(values: Vec<MaybeUninit<T>>) -> Vec<T> {
    let mut values = std::mem::ManuallyDrop::new(values);
    // SAFETY: `MaybeUninit<T>` has `T`'s layout, the allocation is handed over whole, and the caller vouches that
    // every value is initialized.
    unsafe { Vec::from_raw_parts(values.as_mut_ptr().cast(), values.len(), values.capacity()) }
}
