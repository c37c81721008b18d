//! Large host buffers kept for reuse. A training step allocates its large outputs (GEMMs, fused norms,
//! activations, softmax and attention) and its GEMMs' packed operands anew each step, and glibc's `malloc` returns
//! blocks of 32 MiB and more to the OS when they are freed: each step's buffers are then fresh pages that Linux
//! zeroes while the first stores fault them in (13 % of a hidden-2048 FP8 step on Zen 4). A freed buffer from here goes back to a process-wide pool
//! instead, and the next buffer of the same size reuses it, pages and all.
//!
//! What stays held: freed buffers of [`POOLED_FROM`] bytes or more, up to [`held_limit`] bytes in all (1 GiB unless
//! [`set_held_limit`] says otherwise; burn-te reads `BURN_TE_HOST_POOL_MIB`), the least recently freed released
//! first.
//! [`HostBuffer::into_bytes`] hands a buffer to a Burn tensor (cubecl's [`Bytes`]) that returns it on drop.

use std::alloc::{Layout, alloc, dealloc};
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use cubecl::bytes::{AllocationController, AllocationProperty, Bytes};
use rayon::prelude::*;

use super::buffers::advise_huge_pages;

/// Buffers of this many bytes or more are pooled (smaller ones are plain `Vec`s). Not only blocks of 32 MiB go
/// back to the OS: glibc's thresholds for mapping and trimming move with what a process happened to free, and a
/// step whose largest buffers are 2 MiB (a char-GPT at hidden 512) can find them all fresh pages each time. When
/// FP8 attention stopped copying its permuted operands, such a step went from 0.1 to 0.96 million page faults per 12
/// steps; pooled from 1 MiB, 0.12 million.
pub const POOLED_FROM: usize = 1 << 20;

/// Pooled blocks are aligned (and sized) to whole huge pages.
const ALIGN: usize = 2 << 20;

/// The most bytes of freed buffers the pool holds (1 GiB unless [`set_held_limit`] says otherwise).
static LIMIT: AtomicUsize = AtomicUsize::new(1 << 30);

/// The most bytes of freed buffers the pool holds.
pub fn held_limit() -> usize {
    LIMIT.load(Ordering::Relaxed)
}

/// Sets [`held_limit`] (0 turns the pool off: every buffer is a plain allocation); freed blocks beyond it are
/// released at the next return.
pub fn set_held_limit(bytes: usize) {
    LIMIT.store(bytes, Ordering::Relaxed);
}

/// A value a pooled block holds: a plain 4-byte number (f32, or the packed GEMM operands' f32 bits and bf16 pairs),
/// every bit pattern a value.
pub trait PoolWord: Copy + Send + Sync + 'static {
    /// All bits zero.
    const ZERO: Self;
    /// What [`set_overwrite_check`] fills with: NaN as an f32 and as each of two bf16 halves.
    const CHECK: Self;
}

impl PoolWord for f32 {
    const ZERO: Self = 0.0;
    const CHECK: Self = f32::from_bits(0x7fc0_7fc0);
}

impl PoolWord for u32 {
    const ZERO: Self = 0;
    const CHECK: Self = 0x7fc0_7fc0;
}

/// Whether [`HostBuffer::for_overwrite`] fills with NaN (on in debug builds).
static CHECK_OVERWRITES: AtomicBool = AtomicBool::new(cfg!(debug_assertions));

/// Makes [`HostBuffer::for_overwrite`] fill every value with NaN (`true`; the default in debug builds), so that a
/// kernel that misses a value shows NaN, or keep a reused block's old values (`false`; the default in release
/// builds).
pub fn set_overwrite_check(on: bool) {
    CHECK_OVERWRITES.store(on, Ordering::Relaxed);
}

/// One block of memory: `bytes` long, [`ALIGN`]ed, its first `written` bytes initialized (by an output that held
/// them: values stay initialized when the block is freed and reused).
struct Block {
    ptr: NonNull<u8>,
    bytes: usize,
    written: usize,
}

// SAFETY: a block is plain memory owned by whoever holds the `Block`; reads and writes go through `&`/`&mut`.
unsafe impl Send for Block {}
unsafe impl Sync for Block {}

impl Block {
    fn layout(bytes: usize) -> Layout {
        Layout::from_size_align(bytes, ALIGN).expect("a pooled block's size fits a layout")
    }

    /// A fresh block, huge pages asked for.
    fn allocate(bytes: usize) -> Self {
        let layout = Self::layout(bytes);
        // SAFETY: the layout's size is nonzero (at least POOLED_FROM).
        let ptr = NonNull::new(unsafe { alloc(layout) })
            .unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        // SAFETY: `bytes` bytes were just allocated at `ptr`; the advice does not touch their contents.
        advise_huge_pages(unsafe {
            std::slice::from_raw_parts(ptr.as_ptr().cast::<MaybeUninit<u8>>(), bytes)
        });
        Self {
            ptr,
            bytes,
            written: 0,
        }
    }

    fn free(self) {
        // SAFETY: allocated by `allocate` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.bytes)) };
    }
}

/// The freed blocks, least recently freed first.
static FREE: Mutex<VecDeque<Block>> = Mutex::new(VecDeque::new());

static REUSED: AtomicU64 = AtomicU64::new(0);
static ALLOCATED: AtomicU64 = AtomicU64::new(0);

/// What the pool did so far in this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStats {
    /// Buffers served from a freed block.
    pub reused: u64,
    /// Buffers allocated fresh.
    pub allocated: u64,
    /// Bytes of freed blocks held now.
    pub held_bytes: usize,
}

/// The pool's counts (see [`PoolStats`]).
pub fn pool_stats() -> PoolStats {
    PoolStats {
        reused: REUSED.load(Ordering::Relaxed),
        allocated: ALLOCATED.load(Ordering::Relaxed),
        held_bytes: lock().iter().map(|b| b.bytes).sum(),
    }
}

fn lock() -> std::sync::MutexGuard<'static, VecDeque<Block>> {
    FREE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A block of `bytes` (rounded up to whole huge pages): the most recently freed one of that size (`true`), else a new
/// one.
fn take(bytes: usize) -> (Block, bool) {
    let bytes = bytes.next_multiple_of(ALIGN);
    let reused = {
        let mut free = lock();
        free.iter()
            .rposition(|b| b.bytes == bytes)
            .and_then(|at| free.remove(at))
    };
    match reused {
        Some(block) => {
            REUSED.fetch_add(1, Ordering::Relaxed);
            (block, true)
        }
        None => {
            ALLOCATED.fetch_add(1, Ordering::Relaxed);
            (Block::allocate(bytes), false)
        }
    }
}

/// Returns a block to the pool, releasing the least recently freed blocks beyond [`held_limit`].
fn give(block: Block) {
    let limit = held_limit();
    let released: Vec<Block> = {
        let mut free = lock();
        free.push_back(block);
        let mut held: usize = free.iter().map(|b| b.bytes).sum();
        let mut released = Vec::new();
        while held > limit {
            let Some(oldest) = free.pop_front() else {
                break;
            };
            held -= oldest.bytes;
            released.push(oldest);
        }
        released
    };
    released.into_iter().for_each(Block::free);
}

/// A host kernel's output buffer: a `Vec` when small, a pooled block when large. [`HostOutput`] is one not yet
/// written, [`OutputValues`] one written whole.
pub enum HostBuffer<T> {
    /// Below [`POOLED_FROM`] bytes (or the pool off).
    Small(Vec<T>),
    /// A pooled block holding `len` values.
    Pooled {
        /// The memory.
        block: PooledBlock,
        /// Values of `T` in it.
        len: usize,
        /// The values' type.
        values: PhantomData<T>,
    },
}

/// `f32` values not yet written, for a kernel that writes every one; then [`HostBuffer::assume_init`].
pub type HostOutput = HostBuffer<MaybeUninit<f32>>;

/// `f32` values written whole, ready for a tensor ([`HostBuffer::into_bytes`]).
pub type OutputValues = HostBuffer<f32>;

/// A pooled block, returned to the pool when dropped.
pub struct PooledBlock {
    block: Option<Block>,
    reused: bool,
}

impl Drop for PooledBlock {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            give(block);
        }
    }
}

impl PooledBlock {
    /// Whether the block was freed memory reused (`false`: allocated for this buffer).
    pub fn reused(&self) -> bool {
        self.reused
    }

    fn block(&self) -> &Block {
        self.block
            .as_ref()
            .expect("a pooled block is held until dropped")
    }

    /// Records that the first `bytes` bytes are initialized.
    fn mark_written(&mut self, bytes: usize) {
        let block = self
            .block
            .as_mut()
            .expect("a pooled block is held until dropped");
        block.written = block.written.max(bytes);
    }
}

/// A pooled block for `len` values of `T`, where the pool takes them.
fn pooled_block<T>(len: usize) -> Option<PooledBlock> {
    // Beyond what a layout can hold, the plain allocation refuses the size.
    let bytes = len
        .checked_mul(size_of::<T>())
        .filter(|&bytes| bytes <= isize::MAX as usize - ALIGN)?;
    (bytes >= POOLED_FROM && held_limit() > 0).then(|| {
        let (block, reused) = take(bytes);
        PooledBlock {
            block: Some(block),
            reused,
        }
    })
}

impl<T: PoolWord> HostBuffer<MaybeUninit<T>> {
    /// `len` values not yet written, for a kernel that writes every one.
    pub fn uninit(len: usize) -> Self {
        match pooled_block::<T>(len) {
            Some(block) => Self::Pooled {
                block,
                len,
                values: PhantomData,
            },
            None => Self::Small(super::uninit(len)),
        }
    }

    /// The values, once written.
    ///
    /// # Safety
    /// Every value has been written.
    pub unsafe fn assume_init(self) -> HostBuffer<T> {
        match self {
            // SAFETY: the caller vouches that every value is written.
            Self::Small(values) => HostBuffer::Small(unsafe { super::assume_init(values) }),
            Self::Pooled { mut block, len, .. } => {
                block.mark_written(len * size_of::<T>());
                HostBuffer::Pooled {
                    block,
                    len,
                    values: PhantomData,
                }
            }
        }
    }
}

impl OutputValues {
    /// `len` zeros, written on rayon's threads where large (see [`super::zeroed`]).
    pub fn zeroed(len: usize) -> Self {
        let Some(block) = pooled_block::<f32>(len) else {
            return Self::Small(super::zeroed(len));
        };
        let mut out = HostOutput::Pooled {
            block,
            len,
            values: PhantomData,
        };
        out.par_chunks_mut(1 << 16)
            .for_each(|chunk| chunk.fill(MaybeUninit::new(0.0)));
        // SAFETY: every value was just written.
        unsafe { out.assume_init() }
    }

    /// The values as cubecl's [`Bytes`] (what a Burn `TensorData` holds); a pooled block returns to the pool when
    /// the bytes drop.
    pub fn into_bytes(self) -> Bytes {
        match self {
            Self::Small(values) => Bytes::from_elems(values),
            Self::Pooled { block, len, .. } => {
                // SAFETY: the controller's memory is the block, of which the first `len` f32s are written.
                unsafe { Bytes::from_controller(Box::new(block), len * size_of::<f32>()) }
            }
        }
    }
}

impl<T: PoolWord> HostBuffer<T> {
    /// `len` values for a kernel that overwrites every one: a reused pooled block keeps its old values (only what
    /// no output has written yet is zeroed), so no pass zero-fills what the kernel writes next. With
    /// [`set_overwrite_check`] (debug builds) every value is NaN instead, so that a test of a kernel that misses a
    /// value fails.
    pub fn for_overwrite(len: usize) -> Self {
        let check = CHECK_OVERWRITES.load(Ordering::Relaxed);
        let fill = if check { T::CHECK } else { T::ZERO };
        let Some(block) = pooled_block::<T>(len) else {
            return Self::Small(vec![fill; len]);
        };
        let from = if check {
            0
        } else {
            (block.block().written / size_of::<T>()).min(len)
        };
        let mut out = HostBuffer::<MaybeUninit<T>>::Pooled {
            block,
            len,
            values: PhantomData,
        };
        out[from..]
            .par_chunks_mut(1 << 16)
            .for_each(|chunk| chunk.fill(MaybeUninit::new(fill)));
        // SAFETY: the values before `from` were written by an earlier output of this block (memory once written
        // stays initialized), the rest just now.
        unsafe { out.assume_init() }
    }
}

impl<T> HostBuffer<T> {
    /// `Some(reused)` for a pooled buffer (see [`PooledBlock::reused`]), `None` for a plain one.
    pub fn pooled(&self) -> Option<bool> {
        match self {
            Self::Small(_) => None,
            Self::Pooled { block, .. } => Some(block.reused()),
        }
    }
}

impl From<Vec<f32>> for OutputValues {
    fn from(values: Vec<f32>) -> Self {
        Self::Small(values)
    }
}

impl<T> Deref for HostBuffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            Self::Small(values) => values,
            // SAFETY: the block holds `len` values of `T` (a `PoolWord` or its `MaybeUninit`, aligned: ALIGN), owned
            // by `self`; a block of `PoolWord`s is written whole (`assume_init`, `zeroed`, `for_overwrite`).
            Self::Pooled { block, len, .. } => unsafe {
                std::slice::from_raw_parts(block.block().ptr.as_ptr().cast(), *len)
            },
        }
    }
}

impl<T> DerefMut for HostBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Self::Small(values) => values,
            // SAFETY: as in `deref`, borrowed mutably through `self`.
            Self::Pooled { block, len, .. } => unsafe {
                std::slice::from_raw_parts_mut(block.block().ptr.as_ptr().cast(), *len)
            },
        }
    }
}

impl AllocationController for PooledBlock {
    /// The alignment a copy of these bytes is made with (`Bytes::clone` allocates with it): the most that
    /// CubeCL's byte buffers take (`align_of::<u128>()`, their `MAX_ALIGN`), which the block's `ALIGN` includes.
    fn alloc_align(&self) -> usize {
        const { assert!(ALIGN.is_multiple_of(align_of::<u128>())) };
        align_of::<u128>()
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Other
    }

    unsafe fn memory_mut(&mut self) -> &mut [MaybeUninit<u8>] {
        let block = self.block();
        // SAFETY: the block's memory, owned by `self`; the caller writes only initialized values.
        unsafe { std::slice::from_raw_parts_mut(block.ptr.as_ptr().cast(), block.bytes) }
    }

    fn memory(&self) -> &[MaybeUninit<u8>] {
        let block = self.block();
        // SAFETY: the block's memory, owned by `self`.
        unsafe { std::slice::from_raw_parts(block.ptr.as_ptr().cast(), block.bytes) }
    }
}
