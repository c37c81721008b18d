//! Output buffers of the host kernels. A large `vec![0; n]` is zeroed (or page-faulted in) by the calling thread
//! alone while the other cores wait for the kernel that then writes it: [`zeroed`] fills on rayon's threads, and
//! [`uninit`] leaves a buffer that a kernel overwrites whole (the GEMM's output) unwritten.

use std::mem::MaybeUninit;

use rayon::prelude::*;

/// Values per task (256 KiB of f32).
const CHUNK: usize = 1 << 16;

/// `len` zeros (`T::default()`, all-zero bits for the numbers this is used for), written in parallel when large
/// (huge pages asked for first: `advise_huge_pages`).
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

/// Asks the OS to back `buffer`'s pages with huge pages (Linux's `madvise(MADV_HUGEPAGE)`) when it spans at least
/// 4 MiB, so that a large fresh buffer faults in 2 MiB at a time instead of 4 KiB (the largest shape of
/// `benches/host_gemm.rs` spent ~60 ms of 264 in page faults). Call it on a fresh `vec![0; n]` before anything
/// writes it: the allocator maps large zeroed buffers untouched. A hint: where the OS declines (transparent huge
/// pages off) or the pages are already in, nothing changes.
pub fn advise_huge_pages<T>(buffer: &[T]) {
    let bytes = std::mem::size_of_val(buffer);
    #[cfg(target_os = "linux")]
    if bytes >= 4 << 20 {
        const PAGE: usize = 4096;
        let first = buffer.as_ptr() as usize;
        let (start, end) = (first.next_multiple_of(PAGE), (first + bytes) / PAGE * PAGE);
        if end > start {
            // SAFETY: whole pages inside the buffer's allocation; the advice changes how they are backed, never
            // their contents.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
}
