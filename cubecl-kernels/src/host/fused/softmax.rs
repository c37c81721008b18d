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

impl<'a> SoftmaxMask<'a> {
    /// The mask of query `query` of batch `batch` over the first `len` of its `keys` keys.
    #[inline(always)]
    pub(super) fn row(self, keys: usize, batch: usize, query: usize, len: usize) -> RowMask<'a> {
        let limit = if self.causal {
            (query + 1).min(len)
        } else {
            len
        };
        let padding = self.padding.map(|p| &p[batch * keys..batch * keys + limit]);
        RowMask { limit, padding }
    }
}

/// The keys one query row sees: those before `limit` (every key, or up to the query's position under a causal
/// mask), less the padded ones. The rows' loops run over that prefix in straight lines (they vectorize), the keys
/// after it are set once.
#[derive(Clone, Copy, Debug)]
pub(super) struct RowMask<'a> {
    /// The keys before it may be visible, the others are not.
    pub limit: usize,
    /// Which of the keys before `limit` are padding.
    padding: Option<&'a [bool]>,
}

impl RowMask<'_> {
    /// Whether the row sees any key.
    #[inline(always)]
    fn any(&self) -> bool {
        self.limit > 0 && self.padding.is_none_or(|p| p.contains(&false))
    }

    /// The padded keys' values among `prefix` (the row's first `limit`) set to `value`.
    #[inline(always)]
    pub(super) fn hide_padded(&self, prefix: &mut [f32], value: f32) {
        if let Some(padding) = self.padding {
            for (x, &padded) in prefix.iter_mut().zip(padding) {
                *x = if padded { value } else { *x };
            }
        }
    }
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
            forward_row(s, p, scale, mask.row(keys, batch, query, keys));
        }
    });
    probs
}

#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn forward_row<'a>(s: &[f32], p: &mut [f32], scale: f32, row: RowMask<'a>) {
    if !row.any() {
        p.fill(0.0);
        return;
    }
    let (visible, hidden) = p.split_at_mut(row.limit);
    for (p, s) in visible.iter_mut().zip(s) {
        *p = s * scale;
    }
    row.hide_padded(visible, f32::NEG_INFINITY);
    let (max, nan) = max_and_nan(visible);
    if nan {
        // A NaN among the visible scores makes the whole row NaN, as the composed softmax does.
        p.fill(f32::NAN);
        return;
    }
    exp_normalized(visible, max);
    hidden.fill(0.0);
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
