//! The attention's scaled, masked softmax over the keys, forward and backward, one block of rows per task:
//! `p = softmax(s · scale)` over the unmasked keys of each query row; masked keys get 0, and a row with every key
//! masked is all zeros (no uniform average over padding).

use super::{exp, par_rows};
use crate::host::pool::OutputValues;

/// Which keys a query row may not attend to.
#[derive(Clone, Copy, Debug)]
pub struct SoftmaxMask<'a> {
    /// Keys after the query's position are masked (key `j` for query `i` when `j > i`).
    pub causal: bool,
    /// `[batch, keys]`, `true` = padding (masked for every query of that batch).
    pub padding: Option<&'a [bool]>,
}

/// The layout of the scores: `[batch, heads, queries, keys]`, row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScoresShape {
    /// Batch size.
    pub batch: usize,
    /// Heads.
    pub heads: usize,
    /// Query positions.
    pub queries: usize,
    /// Key positions.
    pub keys: usize,
}

impl ScoresShape {
    /// Elements.
    pub fn len(&self) -> usize {
        self.batch * self.heads * self.queries * self.keys
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `(batch, query)` of a flat row index.
    fn row(&self, row: usize) -> (usize, usize) {
        (row / (self.heads * self.queries), row % self.queries)
    }
}

/// Whether key `key` is visible to query `query` of batch `batch`.
#[inline(always)]
pub(super) fn visible(
    mask: SoftmaxMask<'_>,
    keys: usize,
    batch: usize,
    query: usize,
    key: usize,
) -> bool {
    !(mask.causal && key > query) && mask.padding.is_none_or(|p| !p[batch * keys + key])
}

/// `softmax(scores · scale)` over the visible keys of each row.
pub fn softmax_forward(
    scores: &[f32],
    shape: ScoresShape,
    scale: f32,
    mask: SoftmaxMask<'_>,
) -> OutputValues {
    let keys = shape.keys;
    let mut probs = OutputValues::for_overwrite(scores.len());
    par_rows(scores, keys, &mut probs, keys, |first, s, p| {
        for (i, (s, p)) in s
            .chunks_exact(keys)
            .zip(p.chunks_exact_mut(keys))
            .enumerate()
        {
            let (batch, query) = shape.row(first + i);
            forward_row(s, p, scale, |key| visible(mask, keys, batch, query, key));
        }
    });
    probs
}

#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn forward_row(s: &[f32], p: &mut [f32], scale: f32, visible: impl Fn(usize) -> bool) {
    let mut any = false;
    for (key, (s, p)) in s.iter().zip(p.iter_mut()).enumerate() {
        if visible(key) {
            any = true;
            *p = s * scale;
        } else {
            *p = f32::NEG_INFINITY;
        }
    }
    if !any {
        p.fill(0.0);
        return;
    }
    let (max, nan) = max_and_nan(p);
    if nan {
        // A NaN among the visible scores makes the whole row NaN, as the composed softmax does.
        p.fill(f32::NAN);
        return;
    }
    exp_normalized(p, max);
}

/// The largest of a row's scores (−∞ for an empty row) and whether one is NaN. In 16 lanes, so that the loop
/// vectorizes: `f32::max` and a NaN flag in one running value were compiled one score at a time. Inlined into each
/// caller's CPU clone.
#[inline(always)]
pub(super) fn max_and_nan(scores: &[f32]) -> (f32, bool) {
    let (mut maxes, mut nans) = ([f32::NEG_INFINITY; 16], [false; 16]);
    let mut fold = |chunk: &[f32]| {
        for ((max, nan), &v) in maxes.iter_mut().zip(&mut nans).zip(chunk) {
            *max = if v > *max { v } else { *max };
            *nan |= v.is_nan();
        }
    };
    let mut chunks = scores.chunks_exact(16);
    chunks.by_ref().for_each(&mut fold);
    fold(chunks.remainder());
    let max = maxes.into_iter().fold(f32::NEG_INFINITY, f32::max);
    (max, nans.contains(&true))
}

/// A row of scaled scores (−∞ where masked, `max` their largest) becomes `e^(s − max) / Σ` in place; returns the
/// sum `Σ e^(s − max)`. Inlined into each caller's CPU clone.
#[inline(always)]
pub(super) fn exp_normalized(p: &mut [f32], max: f32) -> f32 {
    // Two simple loops, so that each vectorizes: the exponentials, then their sum with value `i` added to lane
    // `i mod 8` (one loop doing both, indexing `lanes[i % 8]`, was compiled one value at a time).
    for p in p.iter_mut() {
        // exp(−∞ − max) = 0 for masked keys (the clamp in `exp` gives 2⁻¹²⁶, hence the select).
        *p = if *p == f32::NEG_INFINITY {
            0.0
        } else {
            exp(*p - max)
        };
    }
    let mut lanes = [0.0f32; 8];
    let mut chunks = p.chunks_exact(8);
    for chunk in &mut chunks {
        for (lane, e) in lanes.iter_mut().zip(chunk) {
            *lane += e;
        }
    }
    for (lane, e) in lanes.iter_mut().zip(chunks.remainder()) {
        *lane += e;
    }
    let sum = lanes.iter().sum::<f32>();
    let inv = 1.0 / sum;
    for p in p.iter_mut() {
        *p *= inv;
    }
    sum
}

/// The gradient of [`softmax_forward`] with respect to the scores, from its output `probs` and the output
/// gradient `dp`: `ds = scale · p · (dp − Σ dp·p)` (0 where masked, since `p` is).
pub fn softmax_backward(dp: &[f32], probs: &[f32], keys: usize, scale: f32) -> Vec<f32> {
    let mut ds = vec![0.0f32; probs.len()];
    par_rows(probs, keys, &mut ds, keys, |first, p, ds| {
        let dp = &dp[first * keys..first * keys + p.len()];
        backward_rows(dp, p, ds, keys, scale)
    });
    ds
}

#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn backward_rows(dp: &[f32], p: &[f32], ds: &mut [f32], keys: usize, scale: f32) {
    for ((dp, p), ds) in dp
        .chunks_exact(keys)
        .zip(p.chunks_exact(keys))
        .zip(ds.chunks_exact_mut(keys))
    {
        let dot = super::dot(dp, p);
        for ((ds, dp), p) in ds.iter_mut().zip(dp).zip(p) {
            *ds = scale * p * (dp - dot);
        }
    }
}
