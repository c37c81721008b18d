//! The TE modules' element-wise work on the host, fused and multi-threaded: each op reads its input once per
//! pass, works a block of rows at a time on rayon's pool, and its loops are compiled for AVX2+FMA and AVX-512
//! (`multiversion`), chosen at run time.
//!
//! - [`norm`]: LayerNorm and RMSNorm, forward and backward (TE's `layernorm_fwd/bwd`, `rmsnorm_fwd/bwd`);
//! - [`activation`]: the MLP activations (GELU, their gated variants, …), forward and backward (TE's `gelu`,
//!   `dgelu`, …);
//! - [`softmax`]: the attention's scaled, masked softmax, forward and backward (TE's
//!   `scaled_(upper_triang_)masked_softmax`);
//! - [`bias`]: a linear layer's bias added to its GEMM's output rows, and its gradient (the column sums);
//! - [`attention`]: the whole attention core (q·kᵀ, the masked softmax, its dropout, ·v) per head at any strides,
//!   forward and backward (TE's fused attention);
//! - [`dropout`]: dropout with a mask regenerated from its seed at each element's index (forward and backward
//!   alike).
//!
//! Row reductions (means, softmax sums) accumulate in f32 over eight interleaved partial sums; column reductions
//! (γ's and β's gradients) sum fixed blocks of rows and then the blocks in order, and the bias's gradient sums each
//! column's rows in order (a block of columns per task), so every result is the same run after run, whatever the
//! number of threads.

pub mod activation;
pub mod attention;
pub mod bias;
pub mod dropout;
pub mod head_gemm;
mod keystream;
pub mod norm;
pub mod softmax;

use rayon::prelude::*;

/// Elements a task works on at least: smaller tensors run on the calling thread.
const BLOCK_ELEMENTS: usize = 1 << 14;

/// Rows per task for rows of `width` elements.
fn block_rows(width: usize) -> usize {
    (BLOCK_ELEMENTS / width.max(1)).max(1)
}

/// Runs `kernel(first_row, input rows, output rows)` over blocks of rows of `input` (`in_width` per row) and
/// `output` (`out_width` per row) on rayon's pool. Returns the kernels' results in row order.
fn par_rows<O: Send, R: Send>(
    input: &[f32],
    in_width: usize,
    output: &mut [O],
    out_width: usize,
    kernel: impl Fn(usize, &[f32], &mut [O]) -> R + Sync,
) -> Vec<R> {
    let rows = block_rows(in_width.max(out_width));
    if in_width == 0 || out_width == 0 {
        return Vec::new();
    }
    input
        .par_chunks(rows * in_width)
        .zip(output.par_chunks_mut(rows * out_width))
        .enumerate()
        .map(|(block, (x, y))| kernel(block * rows, x, y))
        .collect()
}

/// Σ f(v) over `values`, in eight interleaved f32 partial sums (which vectorizes).
#[inline(always)]
fn sum_of(values: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = values.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for l in 0..8 {
            lanes[l] += f(chunk[l]);
        }
    }
    for (l, v) in rest.iter().enumerate() {
        lanes[l] += f(*v);
    }
    lanes.iter().sum()
}

/// Σ a·b over two slices of equal length, vectorized over eight lanes.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (a, b) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += a[l] * b[l];
        }
    }
    for (l, (a, b)) in ra.iter().zip(rb).enumerate() {
        lanes[l] += a * b;
    }
    lanes.iter().sum()
}

/// Adds the `partials` (each `width` long, in order) into one vector: the column sums of blocked rows.
fn add_in_order(partials: impl Iterator<Item = Vec<f32>>, width: usize) -> Vec<f32> {
    let mut total = vec![0.0f32; width];
    for partial in partials {
        for (t, p) in total.iter_mut().zip(&partial) {
            *t += p;
        }
    }
    total
}

/// `e^x` in f32 without a libm call, so that loops over it vectorize: Cephes' `expf` (range reduction by `ln 2`
/// in two parts, a degree-6 polynomial; within 2 ulp of the exact value over the normal range). Inputs below
/// −87.34 give e^−87.34 ≈ 2⁻¹²⁶ (not 0) and above 88 give e⁸⁸ (not ∞); NaN stays NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.336_54, 88.0);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 5e-1;
    let p = p * r * r + r + 1.0;
    // 2ⁿ from n's bits: n (an integer in [−126, 127]) added to 1.5 · 2²³ lands in the mantissa's low bits. Not
    // `n as i32`: its saturating conversion was compiled lane by lane (a compare and insert per value), which
    // made GELU and softmax loops several times slower than their arithmetic.
    let n_bits = (n + MANTISSA_SHIFT)
        .to_bits()
        .wrapping_sub(MANTISSA_SHIFT.to_bits());
    p * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

/// 1.5 · 2²³: an f32 whose unit in the last place is 1, so that adding a small integer sets the mantissa's low
/// bits to it.
const MANTISSA_SHIFT: f32 = 12_582_912.0;

/// `1 / (1 + e^-x)` with [`exp`].
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}
