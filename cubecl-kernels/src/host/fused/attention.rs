//! The attention core `softmax(q·kᵀ · scale + mask) · v` per head, forward and backward, on rayon's pool.
//!
//! q, k and v are read where they lie, at any strides: the `sbhd` heads of a packed QKV projection need no copy.
//! The output and the gradients are written in the layouts their consumers read (strides the caller gives). One
//! task per (batch, key/value group); inside, the queries go in blocks of [`ROWS`], and a causal block stops at
//! the last key its rows can see. The backward recomputes the probabilities from the forward's log-sum-exp per
//! row, as FlashAttention does: nothing of size queries × keys outlives a task.
//!
//! Masks as [`super::softmax`]: a masked key gets probability 0, a row with every key masked outputs zeros, and a
//! NaN among a row's visible scores makes the row NaN. With a [`DropoutMask`] the probabilities are dropped after
//! the softmax, each at the index of its element in `[batch, heads, queries, keys]`: the same mask as
//! [`super::dropout`] on the probabilities of the composed core, regenerated in the backward.

use crate::host::pool::OutputValues;
use rayon::prelude::*;

use super::dropout::DropoutMask;
use super::exp;
use super::head_gemm::{PackedRhs, Strided, head_gemm, packed_gemm};
use super::softmax::{RowMask, SoftmaxMask, exp_normalized, max_and_nan};

/// Query rows per block: the block's scores (`ROWS × keys`) stay in L2 between its GEMMs.
pub const ROWS: usize = 64;

/// A `[batch, heads, seq, head_dim]` view of f32 values in `data` at any strides, in bounds (checked by
/// [`View::new`]).
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    data: &'a [f32],
    offset: usize,
    strides: [usize; 4],
}

impl<'a> View<'a> {
    /// The view of `shape` at `offset` and `strides` (elements) into `data`, or `None` when an element would lie
    /// outside `data`.
    pub fn new(
        data: &'a [f32],
        offset: usize,
        strides: [usize; 4],
        shape: [usize; 4],
    ) -> Option<Self> {
        let last = shape.iter().zip(strides).try_fold(offset, |at, (&n, s)| {
            at.checked_add(n.checked_sub(1)?.checked_mul(s)?)
        });
        let fits = match last {
            Some(last) => last < data.len(),
            None => shape.contains(&0),
        };
        fits.then_some(Self {
            data,
            offset,
            strides,
        })
    }

    /// The first element of head `head` of batch `batch`.
    fn head(&self, batch: usize, head: usize) -> *const f32 {
        let at = self.offset + batch * self.strides[0] + head * self.strides[1];
        // SAFETY: in bounds for every index of the view's shape (checked in `new`); `wrapping_add` keeps an empty
        // view's pointer valid to form.
        self.data.as_ptr().wrapping_add(at)
    }
}

/// The attention's sizes: q is `[batch, heads, queries, head_dim]`, k and v `[batch, groups, keys, head_dim]`
/// (query head `h` reads group `h / (heads / groups)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    /// Batch size.
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub groups: usize,
    /// Query positions.
    pub queries: usize,
    /// Key positions.
    pub keys: usize,
    /// Values per head.
    pub head_dim: usize,
}

impl AttentionDims {
    /// q's (and the output's) shape.
    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.heads, self.queries, self.head_dim]
    }

    /// k's and v's shape.
    pub fn kv_shape(&self) -> [usize; 4] {
        [self.batch, self.groups, self.keys, self.head_dim]
    }

    /// The index of the probability of (`batch`, `head`, `query`, key 0) in `[batch, heads, queries, keys]`.
    fn probability_index(&self, batch: usize, head: usize, query: usize) -> usize {
        ((batch * self.heads + head) * self.queries + query) * self.keys
    }

    /// The keys a block of query rows `rows` can see: all, or under a causal mask up to its last row.
    fn keys_for(&self, rows: std::ops::Range<usize>, causal: bool) -> usize {
        if causal {
            rows.end.min(self.keys)
        } else {
            self.keys
        }
    }
}

/// A pointer that tasks writing disjoint elements share.
#[derive(Clone, Copy, Debug)]
struct Shared(*mut f32);
// SAFETY: every task writes only the elements of its own (batch, head) or (batch, group).
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// `dst (m × n) = [dst +] beta · lhs (m × k) · rhs (k × n)`, one thread, every operand at (row, column) strides
/// ([`head_gemm`], its right operand packed into this thread's scratch).
///
/// # Safety
/// Every element of the three matrices lies in its allocation; `dst` overlaps neither operand.
#[allow(clippy::too_many_arguments)]
unsafe fn matmul(
    dims: (usize, usize, usize),
    dst: (*mut f32, usize, usize),
    accumulate: bool,
    lhs: (*const f32, usize, usize),
    rhs: (*const f32, usize, usize),
    beta: f32,
) {
    thread_local! {
        static PANELS: std::cell::RefCell<PackedRhs> = std::cell::RefCell::new(PackedRhs::default());
    }
    PANELS.with_borrow_mut(|panels| {
        // SAFETY: the caller's contract.
        unsafe {
            head_gemm(
                dims,
                dst,
                accumulate,
                strided(lhs),
                strided(rhs),
                beta,
                panels,
            )
        }
    })
}

/// [`matmul`] against the leading `k × n` part of a right operand packed by [`packed`] (a head's keys or values,
/// which every block of its queries reads).
///
/// # Safety
/// Every element of `lhs` and `dst` lies in its allocation; `dst` does not overlap `lhs`.
unsafe fn packed_matmul(
    dims: (usize, usize, usize),
    dst: (*mut f32, usize, usize),
    accumulate: bool,
    lhs: (*const f32, usize, usize),
    rhs: &PackedRhs,
    beta: f32,
) {
    // SAFETY: the caller's contract.
    unsafe { packed_gemm(dims, dst, accumulate, strided(lhs), rhs, beta) }
}

/// A `depth × cols` right operand at (row, column) strides, packed for [`packed_matmul`].
///
/// # Safety
/// Every element of the matrix lies in its allocation.
unsafe fn packed(shape: (usize, usize), rhs: (*const f32, usize, usize)) -> PackedRhs {
    let mut packed = PackedRhs::default();
    // SAFETY: the caller's contract.
    unsafe { packed.pack(shape, strided(rhs)) };
    packed
}

fn strided((ptr, row_stride, col_stride): (*const f32, usize, usize)) -> Strided {
    Strided {
        ptr,
        row_stride,
        col_stride,
    }
}

/// The forward: the output (written at `out_strides` for `[batch, heads, queries, head_dim]` into a buffer of
/// `out_len` values) and the log-sum-exp of each query row's visible scaled scores (`[batch, heads, queries]`;
/// −∞ for a row with every key masked), the probabilities dropped by `dropout` before they weigh v.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(
    q: View<'_>,
    k: View<'_>,
    v: View<'_>,
    dims: AttentionDims,
    scale: f32,
    (mask, dropout): (SoftmaxMask<'_>, Option<DropoutMask>),
    out_strides: [usize; 4],
    out_len: usize,
) -> (OutputValues, Vec<f32>) {
    let d = dims.head_dim;
    let mut out = OutputValues::zeroed(out_len);
    let mut lse = vec![0.0f32; dims.batch * dims.heads * dims.queries];
    let out_ptr = Shared(out.as_mut_ptr());
    let per_group = dims.heads / dims.groups.max(1);
    lse.par_chunks_mut(dims.queries.max(1))
        .enumerate()
        .for_each(|(task, lse)| {
            let (b, h) = (task / dims.heads, task % dims.heads);
            let g = h / per_group;
            let (qh, kh, vh) = (q.head(b, h), k.head(b, g), v.head(b, g));
            let oh = out_ptr.at(b * out_strides[0] + h * out_strides[1]);
            let mut scores = vec![0.0f32; ROWS * dims.keys];
            let mut dropped = dropout.map(|mask| mask.stream());
            // kᵀ and v packed once for every block of queries (as many keys as the last block sees).
            let seen = dims.keys_for(0..dims.queries, mask.causal);
            // SAFETY: the views are in bounds for their shapes.
            let (k_t, v_rows) = unsafe {
                (
                    packed((d, seen), (kh, k.strides[3], k.strides[2])),
                    packed((seen, d), (vh, v.strides[2], v.strides[3])),
                )
            };
            for r0 in (0..dims.queries).step_by(ROWS) {
                let rows = ROWS.min(dims.queries - r0);
                let keys = dims.keys_for(r0..r0 + rows, mask.causal);
                if keys == 0 {
                    // No keys: zeros (the output's initial values), nothing visible.
                    lse[r0..r0 + rows].fill(f32::NEG_INFINITY);
                    continue;
                }
                // SAFETY: the views are in bounds for their shapes; `scores` holds rows × keys; the output rows
                // of (b, h) lie in `out` (the caller's strides) and only this task writes them.
                unsafe {
                    packed_matmul(
                        (rows, keys, d),
                        (scores.as_mut_ptr(), keys, 1),
                        false,
                        (
                            qh.wrapping_add(r0 * q.strides[2]),
                            q.strides[2],
                            q.strides[3],
                        ),
                        &k_t,
                        scale,
                    );
                }
                for (r, p) in scores[..rows * keys].chunks_exact_mut(keys).enumerate() {
                    let query = r0 + r;
                    lse[query] = probabilities(p, mask.row(dims.keys, b, query, p.len()));
                    if let Some(stream) = &mut dropped {
                        stream.apply(p, dims.probability_index(b, h, query));
                    }
                }
                // SAFETY: as above.
                unsafe {
                    packed_matmul(
                        (rows, d, keys),
                        (
                            oh.wrapping_add(r0 * out_strides[2]),
                            out_strides[2],
                            out_strides[3],
                        ),
                        false,
                        (scores.as_ptr(), keys, 1),
                        &v_rows,
                        1.0,
                    );
                }
            }
        });
    (out, lse)
}

/// The scaled scores `s` of one query row become its probabilities in place (0 where not visible); returns the
/// row's log-sum-exp (−∞ when nothing is visible, NaN when a visible score is).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn probabilities<'a>(s: &mut [f32], row: RowMask<'a>) -> f32 {
    let (visible, hidden) = s.split_at_mut(row.limit);
    row.hide_padded(visible, f32::NEG_INFINITY);
    let (max, nan) = max_and_nan(visible);
    if max == f32::NEG_INFINITY || nan {
        let fill = if nan { f32::NAN } else { 0.0 };
        s.fill(fill);
        return if nan { f32::NAN } else { f32::NEG_INFINITY };
    }
    let sum = exp_normalized(visible, max);
    hidden.fill(0.0);
    max + sum.ln()
}

/// What the backward reads: the output gradient `dout`, the forward's q, k, v and log-sum-exp per query row, its
/// sizes, scale and mask.
#[derive(Clone, Copy, Debug)]
pub struct BackwardInputs<'a> {
    /// The output's gradient, `[batch, heads, queries, head_dim]`.
    pub dout: View<'a>,
    /// The forward's queries.
    pub q: View<'a>,
    /// The forward's keys.
    pub k: View<'a>,
    /// The forward's values.
    pub v: View<'a>,
    /// The forward's log-sum-exp, row-major `[batch, heads, queries]`.
    pub lse: &'a [f32],
    /// The sizes.
    pub dims: AttentionDims,
    /// The scores' factor.
    pub scale: f32,
    /// The forward's mask.
    pub mask: SoftmaxMask<'a>,
    /// The forward's dropout.
    pub dropout: Option<DropoutMask>,
}

/// The gradients of q, k and v (each written at its `*_strides` into a buffer of q's or k's length).
pub fn attention_backward(
    inputs: BackwardInputs<'_>,
    q_strides: [usize; 4],
    kv_strides: [usize; 4],
) -> [OutputValues; 3] {
    let dims = inputs.dims;
    let q_len = dims.q_shape().iter().product();
    let kv_len = dims.kv_shape().iter().product();
    let mut dq = OutputValues::zeroed(q_len);
    let mut dk = OutputValues::zeroed(kv_len);
    let mut dv = OutputValues::zeroed(kv_len);
    let at = |buffer: &mut OutputValues, strides, shape| {
        let (ptr, len) = (Shared(buffer.as_mut_ptr()), buffer.len());
        assert!(
            last_offset(0, strides, shape) < len,
            "the gradient's strides {strides:?} leave its buffer of {len}"
        );
        (ptr, strides)
    };
    let targets = [
        at(&mut dq, q_strides, dims.q_shape()),
        at(&mut dk, kv_strides, dims.kv_shape()),
        at(&mut dv, kv_strides, dims.kv_shape()),
    ];
    // SAFETY: each gradient's elements lie in its own buffer (checked above).
    unsafe { backward_into(inputs, targets) };
    [dq, dk, dv]
}

/// The gradients of q, k and v as one contiguous tensor `[seq, batch, heads + 2 · groups, head_dim]` (`[batch,
/// seq, ..]` unless `seq_first`): the gradient of the packed QKV projection whose views q, k and v were, each part
/// written in its head slots (q's first, then k's and v's), with no concatenation afterwards. Self-attention only
/// (as many keys as queries).
pub fn attention_backward_packed(inputs: BackwardInputs<'_>, seq_first: bool) -> OutputValues {
    let dims = inputs.dims;
    assert_eq!(
        dims.queries, dims.keys,
        "a packed QKV gradient is self-attention's: as many keys as queries"
    );
    let (d, slots) = (dims.head_dim, dims.heads + 2 * dims.groups);
    let row = slots * d;
    // [batch, head, seq, head_dim] strides of one head slot in the packed layout.
    let strides = if seq_first {
        [row, d, dims.batch * row, 1]
    } else {
        [dims.queries * row, d, row, 1]
    };
    let mut packed = OutputValues::zeroed(dims.batch * dims.queries * row);
    let base = Shared(packed.as_mut_ptr());
    let targets =
        [0, dims.heads, dims.heads + dims.groups].map(|slot| (Shared(base.at(slot * d)), strides));
    // SAFETY: the three parts lie in disjoint head slots of the buffer's `[.., slots, head_dim]` rows.
    unsafe { backward_into(inputs, targets) };
    packed
}

/// The offset of the last element of a `shape` tensor at `strides` from `offset`.
fn last_offset(offset: usize, strides: [usize; 4], shape: [usize; 4]) -> usize {
    shape
        .iter()
        .zip(strides)
        .fold(offset, |last, (&n, s)| last + n.saturating_sub(1) * s)
}

/// The backward's work: `dq`, `dk` and `dv` (zeroed) written at their first elements and `[batch, head, seq,
/// head_dim]` strides.
///
/// # Safety
/// Each gradient's elements lie in memory that nothing else reads or writes while this runs, apart from the others'.
unsafe fn backward_into(
    BackwardInputs {
        dout,
        q,
        k,
        v,
        lse,
        dims,
        scale,
        mask,
        dropout,
    }: BackwardInputs<'_>,
    [
        (dq_ptr, q_strides),
        (dk_ptr, kv_strides),
        (dv_ptr, dv_strides),
    ]: [(Shared, [usize; 4]); 3],
) {
    let d = dims.head_dim;
    let per_group = dims.heads / dims.groups.max(1);
    (0..dims.batch * dims.groups)
        .into_par_iter()
        .for_each(|task| {
            let (b, g) = (task / dims.groups, task % dims.groups);
            let (kh, vh) = (k.head(b, g), v.head(b, g));
            let at =
                |p: Shared, strides: [usize; 4], h: usize| p.at(b * strides[0] + h * strides[1]);
            let (dkh, dvh) = (at(dk_ptr, kv_strides, g), at(dv_ptr, dv_strides, g));
            let mut p = vec![0.0f32; ROWS * dims.keys];
            let mut dp = vec![0.0f32; ROWS * dims.keys];
            // With dropout: the dropped probabilities (P keeps the softmax's, which dS takes).
            let mut dropped = dropout.map(|mask| (mask.stream(), vec![0.0f32; ROWS * dims.keys]));
            // kᵀ, vᵀ and k packed once for every head of the group and block of queries.
            let seen = dims.keys_for(0..dims.queries, mask.causal);
            // SAFETY: the views are in bounds for their shapes.
            let (k_t, v_t, k_rows) = unsafe {
                (
                    packed((d, seen), (kh, k.strides[3], k.strides[2])),
                    packed((d, seen), (vh, v.strides[3], v.strides[2])),
                    packed((seen, d), (kh, k.strides[2], k.strides[3])),
                )
            };
            for h in g * per_group..(g + 1) * per_group {
                let (qh, doh) = (q.head(b, h), dout.head(b, h));
                let dqh = at(dq_ptr, q_strides, h);
                let lse = &lse[(b * dims.heads + h) * dims.queries..][..dims.queries];
                for r0 in (0..dims.queries).step_by(ROWS) {
                    let rows = ROWS.min(dims.queries - r0);
                    let keys = dims.keys_for(r0..r0 + rows, mask.causal);
                    if keys == 0 {
                        continue;
                    }
                    let q_rows = (
                        qh.wrapping_add(r0 * q.strides[2]),
                        q.strides[2],
                        q.strides[3],
                    );
                    let do_rows = (
                        doh.wrapping_add(r0 * dout.strides[2]),
                        dout.strides[2],
                        dout.strides[3],
                    );
                    let (p, dp) = (&mut p[..rows * keys], &mut dp[..rows * keys]);
                    // SAFETY: the views are in bounds for their shapes; `p` and `dp` hold rows × keys; the
                    // gradients' rows of (b, h) and (b, g) lie in their buffers and only this task writes them.
                    unsafe {
                        // The probabilities again, from the scores and the row's log-sum-exp.
                        packed_matmul(
                            (rows, keys, d),
                            (p.as_mut_ptr(), keys, 1),
                            false,
                            q_rows,
                            &k_t,
                            scale,
                        );
                        for (r, p) in p.chunks_exact_mut(keys).enumerate() {
                            let query = r0 + r;
                            recompute(p, lse[query], mask.row(dims.keys, b, query, p.len()));
                        }
                        let weights = match &mut dropped {
                            Some((stream, pd)) => {
                                let pd = &mut pd[..rows * keys];
                                pd.copy_from_slice(p);
                                for (r, row) in pd.chunks_exact_mut(keys).enumerate() {
                                    stream.apply(row, dims.probability_index(b, h, r0 + r));
                                }
                                &*pd
                            }
                            None => &*p,
                        };
                        // dV += P̃ᵀ · dO (P̃ the dropped probabilities)
                        let dv_rows = (dvh, dv_strides[2], dv_strides[3]);
                        matmul(
                            (keys, d, rows),
                            dv_rows,
                            true,
                            (weights.as_ptr(), 1, keys),
                            do_rows,
                            1.0,
                        );
                        // dP = dO · Vᵀ
                        packed_matmul(
                            (rows, keys, d),
                            (dp.as_mut_ptr(), keys, 1),
                            false,
                            do_rows,
                            &v_t,
                            1.0,
                        );
                    }
                    // dP through the dropout: the same mask and factor.
                    if let Some((stream, _)) = &mut dropped {
                        for (r, row) in dp.chunks_exact_mut(keys).enumerate() {
                            stream.apply(row, dims.probability_index(b, h, r0 + r));
                        }
                    }
                    // dS = scale · P ∘ (dP − Σ P ∘ dP), in dp.
                    score_gradients(p, dp, keys, scale);
                    // SAFETY: as above.
                    unsafe {
                        // dQ = dS · K
                        let dq_rows = (
                            dqh.wrapping_add(r0 * q_strides[2]),
                            q_strides[2],
                            q_strides[3],
                        );
                        packed_matmul(
                            (rows, d, keys),
                            dq_rows,
                            false,
                            (dp.as_ptr(), keys, 1),
                            &k_rows,
                            1.0,
                        );
                        // dK += dSᵀ · Q
                        let dk_rows = (dkh, kv_strides[2], kv_strides[3]);
                        matmul(
                            (keys, d, rows),
                            dk_rows,
                            true,
                            (dp.as_ptr(), 1, keys),
                            q_rows,
                            1.0,
                        );
                    }
                }
            }
        });
}

/// One row's probabilities from its scaled scores `p` and log-sum-exp, in place (0 where not visible).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn recompute<'a>(p: &mut [f32], lse: f32, row: RowMask<'a>) {
    if lse == f32::NEG_INFINITY {
        p.fill(0.0);
        return;
    }
    let (visible, hidden) = p.split_at_mut(row.limit);
    for p in visible.iter_mut() {
        *p = exp(*p - lse);
    }
    row.hide_padded(visible, 0.0);
    hidden.fill(0.0);
}

/// `dp ← scale · p ∘ (dp − Σ p ∘ dp)` per row of `keys`.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn score_gradients(p: &[f32], dp: &mut [f32], keys: usize, scale: f32) {
    for (p, dp) in p.chunks_exact(keys).zip(dp.chunks_exact_mut(keys)) {
        let dot = super::dot(p, dp);
        for (dp, p) in dp.iter_mut().zip(p) {
            *dp = scale * p * (*dp - dot);
        }
    }
}
