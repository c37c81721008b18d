//! The blocked GEMM around a micro-kernel: the output split into `MC × NC` tasks across rayon's threads, each over
//! the depth in blocks of `KC` units; inside a block, one right panel (`KC × NR`, in L1) against every left panel
//! of the task's rows (`MC × KC`, in L2), or, where [`Kernel::ROW_PANELS_OUTER`], one left panel against every
//! right panel of the task's columns. The epilogue ([`Epilogue`]: the output factor, the bias) runs on each task's
//! output while it is in cache.

use std::mem::MaybeUninit;

use rayon::prelude::*;

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

/// `out = alpha · lhs · rhs (+ bias)` (`out` row-major `m × n`, every value written, none read) on `K`'s path, the
/// bias added per task while its output is in cache. An error when the CPU lacks the path
/// ([`super::HostGemmPath::available`] tells), the depths differ, `out` does not hold `m × n` values or the bias
/// not `n`.
pub fn gemm<K: Kernel>(
    lhs: &PackedLhs<K>,
    rhs: &PackedRhs<K>,
    epilogue: Epilogue<'_>,
    out: &mut [MaybeUninit<f32>],
) -> Result<(), HostGemmError> {
    const { assert!(K::MR * K::NR <= MAX_TILE) };
    const { assert!(K::MC.is_multiple_of(K::MR) && K::NC.is_multiple_of(K::NR)) };
    if lhs.depth != rhs.depth {
        return Err(HostGemmError::DepthMismatch {
            what: K::PATH,
            lhs: lhs.depth,
            rhs: rhs.depth,
        });
    }
    let (m, n) = (lhs.rows, rhs.cols);
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
        // writes it.
        unsafe { K::in_task(|| task(lhs, rhs, epilogue, base.get(), n, row0, col0)) };
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

/// The output tile `[row0, row0 + MC) × [col0, col0 + NC)` (clipped to the output), over the whole depth.
///
/// # Safety
/// The CPU has `K`'s path, and this runs inside [`Kernel::in_task`]; `out` is the row-major `m × n` output with
/// `n` columns, and no other thread writes this tile.
unsafe fn task<K: Kernel>(
    lhs: &PackedLhs<K>,
    rhs: &PackedRhs<K>,
    epilogue: Epilogue<'_>,
    out: *mut f32,
    n: usize,
    row0: usize,
    col0: usize,
) {
    let (mr, nr) = (K::MR, K::NR);
    let rows = K::MC.min(lhs.rows - row0);
    let cols = K::NC.min(n - col0);
    let alpha = epilogue.alpha;
    let tile_alpha = if K::ALPHA_AFTER_TASK { 1.0 } else { alpha };
    // What the tiles leave to the task, on its rows `from..to` once their last depth block is written: `alpha`
    // where the kernel leaves it to the task, and the bias.
    let row_alpha = if K::ALPHA_AFTER_TASK { alpha } else { 1.0 };
    let bias = epilogue.bias.map(|bias| &bias[col0..col0 + cols]);
    let scale_rows = |from: usize, to: usize| {
        if row_alpha != 1.0 || bias.is_some() {
            for r in from..to {
                // SAFETY: the task's row `row0 + r`, columns `col0 .. col0 + cols`, lies in `out` and no other
                // thread writes it (the caller's contract); every depth block wrote it.
                let row =
                    unsafe { std::slice::from_raw_parts_mut(out.add((row0 + r) * n + col0), cols) };
                finish_row(row, row_alpha, bias);
            }
        }
    };
    for p0 in (0..lhs.units).step_by(K::KC) {
        let kc = K::KC.min(lhs.units - p0);
        let update = Update {
            first: p0 == 0,
            last: p0 + kc == lhs.units,
            alpha: tile_alpha,
        };
        // The tile at rows `row0 + r0`, columns `col0 + c0` over this depth block.
        let tile = |r0: usize, c0: usize| {
            let b = &rhs.data[((col0 + c0) / nr * rhs.units + p0) * nr..][..kc * nr];
            let a = &lhs.data[((row0 + r0) / mr * lhs.units + p0) * mr..][..kc * mr];
            // SAFETY: `a` holds `kc` units of MR rows, `b` `kc` units of NR columns; the tile's rows
            // `row0 + r0 ..` < m and columns `col0 + c0 ..` < n lie in `out` at stride `n`; the CPU has the
            // path and this runs inside `K::in_task` (the caller's contract).
            unsafe {
                let tile = OutTile {
                    ptr: out.add((row0 + r0) * n + col0 + c0),
                    ld: n,
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
        if K::ROW_PANELS_OUTER {
            for r0 in (0..rows).step_by(mr) {
                (0..cols).step_by(nr).for_each(|c0| tile(r0, c0));
                // In the last block, the row panel before this one is scaled while it is still in cache; this
                // one's newest tile stores would stall the loads (scaling the whole task after it read it back
                // from L2: 6 % of an AMX GEMM).
                if update.last && r0 >= mr {
                    scale_rows(r0 - mr, r0);
                }
            }
            if update.last {
                scale_rows(rows.saturating_sub(1) / mr * mr, rows);
            }
        } else {
            for c0 in (0..cols).step_by(nr) {
                (0..rows).step_by(mr).for_each(|r0| tile(r0, c0));
            }
            if update.last {
                scale_rows(0, rows);
            }
        }
    }
}

/// `values` multiplied by `alpha` (skipped at 1), then `bias` added, one rounding each (AVX-512 and AVX2 clones
/// where the CPU has them).
#[multiversion::multiversion(targets("x86_64+avx512f", "x86_64+avx2"))]
fn finish_row(values: &mut [f32], alpha: f32, bias: Option<&[f32]>) {
    if alpha != 1.0 {
        values.iter_mut().for_each(|v| *v *= alpha);
    }
    if let Some(bias) = bias {
        values.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
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
