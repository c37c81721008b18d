//! LayerNorm and RMSNorm over the last dimension, forward and backward, one block of rows per task.
//!
//! - LayerNorm: `y = (x − μ) · r · γ + β`, `r = 1/√(σ² + ε)` (σ² the biased variance);
//! - RMSNorm: `y = x · r · γ`, `r = 1/√(mean(x²) + ε)`;
//!
//! with `γ` applied as `1 + γ` when it is zero-centred. The forward returns μ (LayerNorm) and `r` per row for the
//! backward, which returns `dx`, `dγ` and `dβ`.

use std::mem::MaybeUninit;

use super::{add_in_order, dot, par_rows, sum_of};
use crate::Fp8Format;
use crate::host::pool::OutputValues;
use crate::host::{amax_bits, assume_init, encode_scaled, uninit};

/// Which normalization, with its ε and γ's storage.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormSpec {
    /// LayerNorm (mean subtracted, β added) or RMSNorm.
    pub kind: NormKind,
    /// Added to the variance (mean square).
    pub eps: f32,
    /// γ is stored centred on zero and applied as `1 + γ`.
    pub zero_centered_gamma: bool,
}

/// LayerNorm or RMSNorm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// `(x − μ) / √(σ² + ε) · γ + β`.
    LayerNorm,
    /// `x / √(mean(x²) + ε) · γ`.
    RmsNorm,
}

/// What the forward keeps per row for the backward.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NormStats {
    /// μ per row (empty for RMSNorm).
    pub mean: Vec<f32>,
    /// `1/√(σ² + ε)` (RMSNorm: `1/√(mean(x²) + ε)`) per row.
    pub rstd: Vec<f32>,
}

/// γ as applied.
fn applied_gamma(gamma: &[f32], spec: NormSpec) -> Vec<f32> {
    let shift = if spec.zero_centered_gamma { 1.0 } else { 0.0 };
    gamma.iter().map(|g| g + shift).collect()
}

/// The forward of `x` viewed as rows of `gamma.len()` values (`beta`: LayerNorm's β, `None` for RMSNorm or no
/// bias): `y` and the per-row statistics.
pub fn norm_forward(
    x: &[f32],
    gamma: &[f32],
    beta: Option<&[f32]>,
    spec: NormSpec,
) -> (OutputValues, NormStats) {
    let width = gamma.len();
    let gamma = applied_gamma(gamma, spec);
    let mut y = OutputValues::for_overwrite(x.len());
    let blocks = par_rows(x, width, &mut y, width, |_, x, y| {
        forward_rows(x, y, &gamma, beta, spec)
    });
    let mut stats = NormStats::default();
    for (mean, rstd) in blocks {
        stats.mean.extend(mean);
        stats.rstd.extend(rstd);
    }
    (y, stats)
}

#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn forward_rows(
    x: &[f32],
    y: &mut [f32],
    gamma: &[f32],
    beta: Option<&[f32]>,
    spec: NormSpec,
) -> (Vec<f32>, Vec<f32>) {
    let width = gamma.len();
    let rows = x.len() / width;
    let (mut means, mut rstds) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
    for (x, y) in x.chunks_exact(width).zip(y.chunks_exact_mut(width)) {
        let (mean, rstd) = forward_row(x, y, gamma, beta, spec);
        means.extend(mean);
        rstds.push(rstd);
    }
    (means, rstds)
}

/// One row's output `y` and its statistics `(μ (LayerNorm), r)`.
#[inline(always)]
fn forward_row(
    x: &[f32],
    y: &mut [f32],
    gamma: &[f32],
    beta: Option<&[f32]>,
    spec: NormSpec,
) -> (Option<f32>, f32) {
    let n = gamma.len() as f32;
    match spec.kind {
        NormKind::LayerNorm => {
            let mean = sum_of(x, |v| v) / n;
            let var = sum_of(x, |v| (v - mean) * (v - mean)) / n;
            let rstd = 1.0 / (var + spec.eps).sqrt();
            match beta {
                Some(beta) => {
                    for (((y, x), g), b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
                        *y = (x - mean) * rstd * g + b;
                    }
                }
                None => {
                    for ((y, x), g) in y.iter_mut().zip(x).zip(gamma) {
                        *y = (x - mean) * rstd * g;
                    }
                }
            }
            (Some(mean), rstd)
        }
        NormKind::RmsNorm => {
            let rstd = 1.0 / (dot(x, x) / n + spec.eps).sqrt();
            for ((y, x), g) in y.iter_mut().zip(x).zip(gamma) {
                *y = x * rstd * g;
            }
            (None, rstd)
        }
    }
}

/// [`norm_forward`] with its output quantized in the same pass, as TE's LayerNorm kernel writes the FP8 input of
/// the GEMM that follows: `codes = encode(y · scale)` in `format` (delayed scaling's scale, known before the pass),
/// the amax of `y`, and the statistics. Each row is normalized into a buffer that stays in L1 and encoded from
/// there, so `y` never reaches memory; the codes and amax are [`quantize_with_amax`](crate::host::quantize_with_amax)'s
/// of [`norm_forward`]'s output, bit for bit.
pub fn norm_forward_quantized(
    x: &[f32],
    gamma: &[f32],
    beta: Option<&[f32]>,
    spec: NormSpec,
    (scale, format): (f32, Fp8Format),
) -> (Vec<u8>, f32, NormStats) {
    let width = gamma.len();
    let gamma = applied_gamma(gamma, spec);
    let mut codes = uninit(x.len());
    let blocks = par_rows(x, width, &mut codes, width, |_, x, codes| {
        quantized_rows(x, codes, &gamma, beta, spec, (scale, format))
    });
    let mut stats = NormStats::default();
    let mut amax = 0;
    for (mean, rstd, bits) in blocks {
        stats.mean.extend(mean);
        stats.rstd.extend(rstd);
        amax = amax.max(bits);
    }
    // SAFETY: the blocks cover every row, and `quantized_rows` encodes each of its rows whole.
    (unsafe { assume_init(codes) }, f32::from_bits(amax), stats)
}

/// One block's rows of [`norm_forward_quantized`]: its means, `r`s and the bits of its amax.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn quantized_rows(
    x: &[f32],
    codes: &mut [MaybeUninit<u8>],
    gamma: &[f32],
    beta: Option<&[f32]>,
    spec: NormSpec,
    (scale, format): (f32, Fp8Format),
) -> (Vec<f32>, Vec<f32>, u32) {
    let width = gamma.len();
    let rows = x.len() / width;
    let (mut means, mut rstds) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
    let (mut y, mut amax) = (vec![0.0f32; width], 0);
    for (x, codes) in x.chunks_exact(width).zip(codes.chunks_exact_mut(width)) {
        let (mean, rstd) = forward_row(x, &mut y, gamma, beta, spec);
        encode_scaled(&y, scale, format, codes);
        amax = amax.max(amax_bits(&y));
        means.extend(mean);
        rstds.push(rstd);
    }
    (means, rstds, amax)
}

/// Gradients of [`norm_forward`] for the output gradient `dy`: `(dx, dγ, dβ)` (`dβ` for LayerNorm; a zero-centred
/// γ gets the gradient of `1 + γ`, which is the same).
pub fn norm_backward(
    dy: &[f32],
    x: &[f32],
    gamma: &[f32],
    stats: &NormStats,
    spec: NormSpec,
) -> (OutputValues, Vec<f32>, Vec<f32>) {
    let width = gamma.len();
    let gamma = applied_gamma(gamma, spec);
    let mut dx = OutputValues::for_overwrite(x.len());
    let blocks = par_rows(x, width, &mut dx, width, |first, x, dx| {
        let rows = x.len() / width;
        let dy = &dy[first * width..(first + rows) * width];
        let mean = match spec.kind {
            NormKind::LayerNorm => Some(&stats.mean[first..first + rows]),
            NormKind::RmsNorm => None,
        };
        backward_rows(dy, x, dx, &gamma, mean, &stats.rstd[first..first + rows])
    });
    let (dgamma, dbeta): (Vec<_>, Vec<_>) = blocks.into_iter().unzip();
    let dgamma = add_in_order(dgamma.into_iter(), width);
    let dbeta = match spec.kind {
        NormKind::LayerNorm => add_in_order(dbeta.into_iter(), width),
        NormKind::RmsNorm => Vec::new(),
    };
    (dx, dgamma, dbeta)
}

/// One block's `dx` and its partial `dγ`, `dβ`: with `x̂ = (x − μ)·r` and `g = dy·γ`,
/// `dx = r·(g − mean(g) − x̂·mean(g·x̂))` (RMSNorm: no `mean(g)` term), `dγ += dy·x̂`, `dβ += dy`.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn backward_rows(
    dy: &[f32],
    x: &[f32],
    dx: &mut [f32],
    gamma: &[f32],
    mean: Option<&[f32]>,
    rstd: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let width = gamma.len();
    let n = width as f32;
    let (mut dgamma, mut dbeta) = (vec![0.0f32; width], vec![0.0f32; width]);
    let mut xhat = vec![0.0f32; width];
    let mut g = vec![0.0f32; width];
    let rows = dy.chunks_exact(width).zip(x.chunks_exact(width));
    for (row, ((dy, x), dx)) in rows.zip(dx.chunks_exact_mut(width)).enumerate() {
        let (mu, r) = (mean.map_or(0.0, |m| m[row]), rstd[row]);
        for ((h, gv), ((x, dy), gamma)) in
            xhat.iter_mut().zip(&mut g).zip(x.iter().zip(dy).zip(gamma))
        {
            *h = (x - mu) * r;
            *gv = dy * gamma;
        }
        let mean_g = if mean.is_some() {
            sum_of(&g, |v| v) / n
        } else {
            0.0
        };
        let mean_gx = dot(&g, &xhat) / n;
        for ((dx, gv), h) in dx.iter_mut().zip(&g).zip(&xhat) {
            *dx = r * (gv - mean_g - h * mean_gx);
        }
        for ((dg, dy), h) in dgamma.iter_mut().zip(dy).zip(&xhat) {
            *dg += dy * h;
        }
        if mean.is_some() {
            // β exists for LayerNorm only.
            for (db, dy) in dbeta.iter_mut().zip(dy) {
                *db += dy;
            }
        }
    }
    (dgamma, dbeta)
}
