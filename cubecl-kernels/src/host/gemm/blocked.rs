//! The blocked GEMM around a micro-kernel: the output split into `MC × NC` tasks across rayon's threads, each over
//! the depth in blocks of `KC` units; inside a block, one right panel (`KC × NR`, in L1) against every left panel
//! of the task's rows (`MC × KC`, in L2), or, where [`Kernel::ROW_PANELS_OUTER`], one left panel against every
//! right panel of the task's columns. The epilogue ([`Epilogue`]: the output factor, the bias) runs on each task's
//! output while it is in cache.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::pack::RhsInTasks;
use super::{HostGemmError, Kernel, OutTile, PackedLhs, PackedRhs, Update};

/// The largest micro-kernel tile (`MR · NR`) of any path.
const MAX_TILE: usize = 32 * 32;

/// What the GEMM does to its sums before it leaves a task's output: `alpha · sum (+ bias[column])`, a product and
/// an add with one rounding each (the bits of scaling the output and then adding the bias in another pass).
#[derive(Clone, Copy, Debug)]
pub struct Epilogue<'a> {
    /// The output factor (per-tensor scales).
    pub alpha: f32,
    /// One value per output column (a linear layer's bias), or `None`.
    pub bias: Option<&'a [f32]>,
}

/// The right operand as the tasks read it: packed whole beforehand ([`super::pack_rhs`]), or packed by each task
/// block by block into a buffer of its thread ([`super::rhs_in_tasks`]). The same units either way, so the same bits.
pub enum Rhs<'r, 'a, K: Kernel> {
    /// Packed whole.
    Packed(&'r PackedRhs<K>),
    /// Packed in the tasks.
    InTasks(&'r RhsInTasks<'a, K>),
}

impl<K: Kernel> Clone for Rhs<'_, '_, K> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K: Kernel> Copy for Rhs<'_, '_, K> {}

impl<'r, K: Kernel> From<&'r PackedRhs<K>> for Rhs<'r, '_, K> {
    fn from(rhs: &'r PackedRhs<K>) -> Self {
        Rhs::Packed(rhs)
    }
}

impl<'r, 'a, K: Kernel> From<&'r RhsInTasks<'a, K>> for Rhs<'r, 'a, K> {
    fn from(rhs: &'r RhsInTasks<'a, K>) -> Self {
        Rhs::InTasks(rhs)
    }
}

impl<K: Kernel> Rhs<'_, '_, K> {
    fn depth(self) -> usize {
        match self {
            Rhs::Packed(rhs) => rhs.depth,
            Rhs::InTasks(rhs) => rhs.depth,
        }
    }

    fn cols(self) -> usize {
        match self {
            Rhs::Packed(rhs) => rhs.cols,
            Rhs::InTasks(rhs) => rhs.cols,
        }
    }

    /// `run` with the panels of columns `col0 ..+cols` over the depth block of units `p0 ..+kc`: a slice and where
    /// in it each panel's block starts (the first panel's, then one panel's step): the packed operand's own, or this
    /// thread's block buffer, packed here.
    fn with_block(
        self,
        (col0, cols): (usize, usize),
        (p0, kc): (usize, usize),
        run: impl FnOnce(&[u32], usize, usize),
    ) {
        let nr = K::NR;
        match self {
            Rhs::Packed(rhs) => run(
                &rhs.data,
                ((col0 / nr) * rhs.units + p0) * nr,
                rhs.units * nr,
            ),
            Rhs::InTasks(rhs) => RHS_BLOCK.with_borrow_mut(|buffer| {
                let len = cols.div_ceil(nr) * kc * nr;
                // 16 units of slack to start at a cache line (AMX loads a tile row of 64 bytes; across two lines it
                // costs several times one within a line).
                if buffer.len() < len + 16 {
                    buffer.resize(len + 16, 0);
                }
                let start = buffer.as_ptr().align_offset(64);
                let block = &mut buffer[start..start + len];
                rhs.pack_block((col0, cols), (p0, kc), block, &mut Vec::new());
                run(block, 0, kc * nr)
            }),
        }
    }
}

thread_local! {
    /// This thread's right-operand block ([`Rhs::InTasks`]): `KC × NC` units of the largest such kernel that ran on
    /// the thread (256 KiB for AMX), held for the thread's life.
    static RHS_BLOCK: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `out = alpha · lhs · rhs (+ bias)` (`out` row-major `m × n`, every value written, none read) on `K`'s path, the
/// bias added per task while its output is in cache. An error when the CPU lacks the path
/// ([`super::HostGemmPath::available`] tells), the depths differ, `out` does not hold `m × n` values or the bias
/// not `n`.
pub fn gemm<'r, 'a: 'r, K: Kernel>(
    lhs: &PackedLhs<K>,
    rhs: impl Into<Rhs<'r, 'a, K>>,
    epilogue: Epilogue<'_>,
    out: &mut [MaybeUninit<f32>],
) -> Result<(), HostGemmError> {
    let rhs = rhs.into();
    const { assert!(K::MR * K::NR <= MAX_TILE) };
    const { assert!(K::MC.is_multiple_of(K::MR) && K::NC.is_multiple_of(K::NR)) };
    if lhs.depth != rhs.depth() {
        return Err(HostGemmError::DepthMismatch {
            what: K::PATH,
            lhs: lhs.depth,
            rhs: rhs.depth(),
        });
    }
    let (m, n) = (lhs.rows, rhs.cols());
    if m.checked_mul(n) != Some(out.len()) {
        return Err(HostGemmError::OutputLength {
            what: K::PATH,
            len: out.len(),
            m,
            n,
        });
    }
    if let Some(bias) = epilogue.bias
        && bias.len() != n
    {
        return Err(HostGemmError::BiasLength {
            what: K::PATH,
            len: bias.len(),
            n,
        });
    }
    if !K::PATH.available() {
        return Err(HostGemmError::Unavailable(K::PATH));
    }
    if m == 0 || n == 0 || lhs.units == 0 {
        fill_bias_rows(out, n, epilogue.bias);
        return Ok(());
    }
    let tasks: Vec<(usize, usize)> = (0..m.div_ceil(K::MC))
        .flat_map(|i| (0..n.div_ceil(K::NC)).map(move |j| (i * K::MC, j * K::NC)))
        .collect();
    let base = Out(out.as_mut_ptr().cast());
    let run = |&(row0, col0): &(usize, usize)| {
        // SAFETY: the CPU has the path (checked above); the task's tile lies inside `out` and no other task
        // writes it; its sums are the output's tile or this thread's buffer (`with_task_sums`).
        unsafe {
            K::in_task(|| {
                with_task_sums::<K>(base.get(), n, row0, col0, |sums| {
                    task(lhs, rhs, epilogue, base.get(), n, row0, col0, sums)
                })
            })
        };
    };
    if m.saturating_mul(n).saturating_mul(lhs.depth) < 64 * 64 * 64 {
        tasks.iter().for_each(run);
    } else {
        tasks.par_iter().for_each(run);
    }
    Ok(())
}

/// A pointer to the output shared by tasks that write disjoint tiles of it.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: each task writes only its own tile (disjoint rows × columns) of the output.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The pointer (a method, so that closures capture the `Send` wrapper, not its field).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// How many values longer than a task's columns the rows of its sums buffer are
/// ([`Kernel::SUMS_IN_TASK_BUFFER`]): 64 bytes, so that rows a power of two of bytes long do not fall into one L1 set.
const TASK_SUMS_PAD: usize = 16;

thread_local! {
    /// This thread's task sums buffer ([`Kernel::SUMS_IN_TASK_BUFFER`]): `MC × (NC + TASK_SUMS_PAD)` values of the
    /// largest such kernel that ran on the thread, plus the slack that aligns them (0.5 MiB for AMX), held for the
    /// thread's life.
    static TASK_SUMS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Where a task's tiles keep their sums: the output itself (`ld` = `n`), or the thread's task buffer.
#[derive(Clone, Copy)]
struct Sums {
    /// The task's first value.
    ptr: *mut f32,
    /// Its row stride.
    ld: usize,
}

/// `run` with the place where the task at `(row0, col0)` of the `n`-column output `out` keeps its tiles' sums: the
/// thread's task buffer where the kernel keeps them apart ([`Kernel::SUMS_IN_TASK_BUFFER`]), else the output's own
/// tile.
fn with_task_sums<K: Kernel>(
    out: *mut f32,
    n: usize,
    row0: usize,
    col0: usize,
    run: impl FnOnce(Sums),
) {
    if K::SUMS_IN_TASK_BUFFER {
        TASK_SUMS.with_borrow_mut(|buffer| {
            let ld = K::NC + TASK_SUMS_PAD;
            let len = K::MC * ld + 16;
            if buffer.len() < len {
                buffer.resize(len, 0.0);
            }
            let ptr = buffer.as_mut_ptr();
            // The buffer holds `MC · ld` values past its first 64-byte boundary (16 values of slack), this thread's
            // alone while `run` runs.
            run(Sums {
                ptr: ptr.wrapping_add(ptr.align_offset(64)),
                ld,
            })
        })
    } else {
        run(Sums {
            ptr: out.wrapping_add(row0 * n + col0),
            ld: n,
        })
    }
}

/// The output tile `[row0, row0 + MC) × [col0, col0 + NC)` (clipped to the output), over the whole depth, its
/// tiles' sums kept at `sums` ([`with_task_sums`]): the output itself, or a buffer finished into the output with
/// `alpha` and the bias after the last depth block.
///
/// # Safety
/// The CPU has `K`'s path, and this runs inside [`Kernel::in_task`]; `out` is the row-major `m × n` output with
/// `n` columns, and no other thread writes this tile; `sums` holds the task's `MC` rows of `NC` values at stride
/// `sums.ld`, no other thread's, and is the output's own tile where the kernel does not keep its sums apart.
#[allow(clippy::too_many_arguments)]
unsafe fn task<K: Kernel>(
    lhs: &PackedLhs<K>,
    rhs: Rhs<'_, '_, K>,
    epilogue: Epilogue<'_>,
    out: *mut f32,
    n: usize,
    row0: usize,
    col0: usize,
    sums: Sums,
) {
    let (mr, nr) = (K::MR, K::NR);
    let rows = K::MC.min(lhs.rows - row0);
    let cols = K::NC.min(n - col0);
    let alpha = epilogue.alpha;
    let apart = K::SUMS_IN_TASK_BUFFER;
    let tile_alpha = if apart { 1.0 } else { alpha };
    let bias = epilogue.bias.map(|bias| &bias[col0..col0 + cols]);
    // The tile at rows `r0`, columns `c0` of the task once its last depth block is written: its sums, times
    // `alpha`, plus the bias, into the output.
    let finish_tile = |(r0, c0): (usize, usize)| {
        let (tile_rows, tile_cols) = (mr.min(rows - r0), nr.min(cols - c0));
        // SAFETY: the tile's sums lie in `sums` and its output values in `out` (rows `row0 + r0 ..`, columns
        // `col0 + c0 ..`), neither written by another thread (the caller's contract); every depth block wrote the
        // sums.
        unsafe {
            finish_tile_into(
                sums.ptr.add(r0 * sums.ld + c0),
                sums.ld,
                out.add((row0 + r0) * n + col0 + c0),
                n,
                (tile_rows, tile_cols),
                alpha,
                bias.map(|bias| &bias[c0..c0 + tile_cols]),
            )
        }
    };
    for p0 in (0..lhs.units).step_by(K::KC) {
        let kc = K::KC.min(lhs.units - p0);
        let update = Update {
            first: p0 == 0,
            last: p0 + kc == lhs.units,
            alpha: tile_alpha,
        };
        rhs.with_block((col0, cols), (p0, kc), |panels, first, step| {
            // The tile at rows `row0 + r0`, columns `col0 + c0` over this depth block.
            let tile = |r0: usize, c0: usize| {
                let b = &panels[first + c0 / nr * step..][..kc * nr];
                let a = &lhs.data[((row0 + r0) / mr * lhs.units + p0) * mr..][..kc * mr];
                // SAFETY: `a` holds `kc` units of MR rows, `b` `kc` units of NR columns; the tile's rows `r0 ..` <
                // `rows` and columns `c0 ..` < `cols` lie in `sums` at stride `sums.ld`; the CPU has the path and this
                // runs inside `K::in_task` (the caller's contract).
                unsafe {
                    let tile = OutTile {
                        ptr: sums.ptr.add(r0 * sums.ld + c0),
                        ld: sums.ld,
                        rows: mr.min(rows - r0),
                        cols: nr.min(cols - c0),
                    };
                    if (tile.rows, tile.cols) == (mr, nr) {
                        K::update_whole(a.as_ptr(), b.as_ptr(), kc, tile, update);
                    } else {
                        through_tile::<K>(a.as_ptr(), b.as_ptr(), kc, tile, update);
                    }
                }
            };
            // In the last block, where the sums are apart, each tile is finished one tile behind: its sums are still
            // in L1, and the newest tile's stores have not yet reached it (AMX's tile stores are not forwarded to the
            // vector loads; finishing a whole row panel after the next one read its sums back from L2: 7 % of an AMX
            // GEMM).
            let mut pending = None;
            let mut visit = |r0: usize, c0: usize| {
                tile(r0, c0);
                if apart
                    && update.last
                    && let Some(behind) = pending.replace((r0, c0))
                {
                    finish_tile(behind);
                }
            };
            if K::ROW_PANELS_OUTER {
                for r0 in (0..rows).step_by(mr) {
                    (0..cols).step_by(nr).for_each(|c0| visit(r0, c0));
                }
            } else {
                for c0 in (0..cols).step_by(nr) {
                    (0..rows).step_by(mr).for_each(|r0| visit(r0, c0));
                }
            }
            if let Some(last) = pending {
                finish_tile(last);
            }
        });
    }
    // Tiles updated in place took `alpha` in the last block; the bias follows while the task's output is in cache.
    if let (false, Some(bias)) = (apart, bias) {
        for r in 0..rows {
            // SAFETY: output row `row0 + r`, columns `col0 .. col0 + cols`, lies in `out` and no other thread
            // writes it (the caller's contract); every depth block wrote it.
            add_bias(
                unsafe { std::slice::from_raw_parts_mut(out.add((row0 + r) * n + col0), cols) },
                bias,
            );
        }
    }
}

/// `bias` added to `values` (AVX-512 and AVX2 clones where the CPU has them).
#[multiversion::multiversion(targets("x86_64+avx512f", "x86_64+avx2"))]
fn add_bias(values: &mut [f32], bias: &[f32]) {
    values.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
}

/// The `rows × cols` output values at `out` (row stride `out_ld`) = the sums at `sums` (row stride `sums_ld`) ·
/// `alpha` + `bias` (one value per column), value by value, one rounding each (the tiles' own `alpha` and a bias
/// pass after them give the same bits). AVX-512 and AVX2 clones where the CPU has them.
///
/// # Safety
/// `sums` holds `rows` initialized rows of `cols` values at stride `sums_ld`, `out` `rows` writable rows of `cols`
/// at stride `out_ld`, disjoint from them; `bias` (where given) holds `cols` values.
#[multiversion::multiversion(targets("x86_64+avx512f", "x86_64+avx2"))]
unsafe fn finish_tile_into(
    sums: *const f32,
    sums_ld: usize,
    out: *mut f32,
    out_ld: usize,
    (rows, cols): (usize, usize),
    alpha: f32,
    bias: Option<&[f32]>,
) {
    for r in 0..rows {
        // SAFETY: row `r` of each lies in it (the function's contract).
        let (from, to) = unsafe {
            (
                std::slice::from_raw_parts(sums.add(r * sums_ld), cols),
                std::slice::from_raw_parts_mut(
                    out.add(r * out_ld).cast::<MaybeUninit<f32>>(),
                    cols,
                ),
            )
        };
        match bias {
            Some(bias) => to
                .iter_mut()
                .zip(from)
                .zip(bias)
                .for_each(|((t, s), b)| *t = MaybeUninit::new(*s * alpha + b)),
            None => to
                .iter_mut()
                .zip(from)
                .for_each(|(t, s)| *t = MaybeUninit::new(*s * alpha)),
        }
    }
}

/// The output of a GEMM with no depth (or no rows or columns): each row of `n` values the bias, or zeros.
pub fn fill_bias_rows(out: &mut [MaybeUninit<f32>], n: usize, bias: Option<&[f32]>) {
    match bias {
        Some(bias) if n > 0 => out.chunks_mut(n).for_each(|row| {
            row.iter_mut()
                .zip(bias)
                .for_each(|(v, &b)| *v = MaybeUninit::new(b));
        }),
        _ => out.fill(MaybeUninit::new(0.0)),
    }
}

/// A tile of the output updated through a tile on the stack: the micro-kernel's sums, then each output value updated.
///
/// # Safety
/// As [`Kernel::update_whole`], for any tile of at most `MR × NR`.
pub(super) unsafe fn through_tile<K: Kernel>(
    a: *const u32,
    b: *const u32,
    kc: usize,
    out: OutTile,
    update: Update,
) {
    let mut tile = [0f32; MAX_TILE];
    // SAFETY: the caller's contract; `tile` holds MR · NR ≤ MAX_TILE values.
    unsafe { K::micro_kernel(a, b, kc, tile.as_mut_ptr()) };
    for r in 0..out.rows {
        let sums = &tile[r * K::NR..r * K::NR + out.cols];
        for (c, &s) in sums.iter().enumerate() {
            // SAFETY: the tile's value (r, c) lies at `out.ptr + r · out.ld + c` (the caller's contract); the
            // first depth block writes it without reading it (it may not be initialized yet).
            unsafe {
                let d = out.ptr.add(r * out.ld + c);
                let old = if update.first { 0.0 } else { d.read() };
                d.write(update.apply(old, s));
            }
        }
    }
}
