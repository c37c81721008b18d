//! Buffers of packed operands kept per thread, so that each GEMM does not fault in fresh pages: a packed operand
//! takes one and gives it back when dropped.
//!
//! What stays held: on each thread that packs operands, at most [`KEPT_BUFFERS`] buffers of at most [`KEPT_BYTES`]
//! together, until the thread ends or calls [`release`]. A buffer that would take the total beyond that is freed,
//! the smallest first. The thread that calls a GEMM packs its operands (rayon's workers fill them); a group of
//! small GEMMs issued together runs one GEMM per worker, so there each worker packs and keeps its own.

use std::cell::RefCell;

/// The most bytes one thread keeps (64 MiB: the packed operands of a hidden-1024 layer's largest GEMM in f32).
pub const KEPT_BYTES: usize = 64 << 20;

/// The most buffers one thread keeps (the two operands of a GEMM, and those of the next).
pub const KEPT_BUFFERS: usize = 4;

thread_local! {
    static FREE: RefCell<Vec<Vec<u32>>> = const { RefCell::new(Vec::new()) };
}

fn bytes(buffer: &Vec<u32>) -> usize {
    buffer.capacity() * size_of::<u32>()
}

/// A buffer of `len` values, not cleared: the packing writes every value. A kept one where one is large
/// enough, else a fresh one (in huge pages where the OS grants them: [`advise_huge_pages`]).
pub(super) fn take(len: usize) -> Vec<u32> {
    let kept = FREE.with(|free| {
        let mut free = free.borrow_mut();
        // The smallest that fits, so the large ones stay for large operands.
        let fits = (0..free.len())
            .filter(|&i| free[i].capacity() >= len)
            .min_by_key(|&i| free[i].capacity())?;
        Some(free.swap_remove(fits))
    });
    let mut buffer = kept.unwrap_or_else(|| {
        let fresh = vec![0; len];
        advise_huge_pages(&fresh);
        fresh
    });
    buffer.truncate(len);
    buffer.resize(len, 0);
    buffer
}

/// Keeps `buffer` for a later [`take`] on this thread, within [`KEPT_BUFFERS`] and [`KEPT_BYTES`]: the smallest
/// buffers are freed first (the given one too, if it is the smallest).
pub(super) fn give(buffer: Vec<u32>) {
    if bytes(&buffer) > KEPT_BYTES || buffer.capacity() == 0 {
        return;
    }
    let _ = FREE.try_with(|free| {
        let mut free = free.borrow_mut();
        free.push(buffer);
        while free.len() > KEPT_BUFFERS || free.iter().map(bytes).sum::<usize>() > KEPT_BYTES {
            let smallest = (0..free.len())
                .min_by_key(|&i| free[i].capacity())
                .expect("not empty");
            free.swap_remove(smallest);
        }
    });
}

/// The bytes this thread keeps for later GEMMs.
pub fn held_bytes() -> usize {
    FREE.try_with(|free| free.borrow().iter().map(bytes).sum())
        .unwrap_or(0)
}

/// Frees every buffer this thread keeps (a long-lived thread done with GEMMs; the next GEMM allocates again).
pub fn release() {
    let _ = FREE.try_with(|free| free.borrow_mut().clear());
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
