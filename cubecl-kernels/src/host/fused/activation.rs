//! The MLP activations with TE's definitions, forward and backward, one block of rows per task. A gated variant
//! takes rows of `2n` (the activated half first, the gate's value half second) and returns `act(a) · v`.

use super::{par_rows, sigmoid};
use crate::Fp8Format;
use crate::host::pool::OutputValues;
use crate::host::{amax_bits, assume_init, encode_scaled, uninit};

/// The pointwise function of an activation (its gated variant uses the same one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pointwise {
    /// GELU, tanh approximation: `x · σ(2u)`, `u = √(2/π)(x + 0.044715 x³)` (TE's `0.5 x (1 + tanh u)`).
    Gelu,
    /// Quick GELU: `x · σ(1.702 x)`.
    QuickGelu,
    /// `max(x, 0)`.
    Relu,
    /// `max(x, 0)²`.
    SquaredRelu,
    /// `x · σ(x)`.
    Silu,
}

/// √(8/π): `2u = √(8/π)(x + 0.044715 x³)`.
const GELU_2U: f32 = 1.595_769;
const GELU_CUBIC: f32 = 0.044_715;

impl Pointwise {
    /// `(f(x), f'(x))`.
    #[inline(always)]
    fn value_and_slope(self, x: f32) -> (f32, f32) {
        match self {
            Pointwise::Gelu => {
                let s = sigmoid(GELU_2U * (x + GELU_CUBIC * x * x * x));
                let d2u = GELU_2U * (1.0 + 3.0 * GELU_CUBIC * x * x);
                (x * s, s + x * s * (1.0 - s) * d2u)
            }
            Pointwise::QuickGelu => {
                let s = sigmoid(1.702 * x);
                (x * s, s + 1.702 * x * s * (1.0 - s))
            }
            Pointwise::Relu => {
                if x > 0.0 {
                    (x, 1.0)
                } else {
                    (0.0, 0.0)
                }
            }
            Pointwise::SquaredRelu => {
                let r = if x > 0.0 { x } else { 0.0 };
                (r * r, 2.0 * r)
            }
            Pointwise::Silu => {
                let s = sigmoid(x);
                (x * s, s + x * s * (1.0 - s))
            }
        }
    }

    /// `f(x)`.
    #[inline(always)]
    fn value(self, x: f32) -> f32 {
        match self {
            Pointwise::Gelu => x * sigmoid(GELU_2U * (x + GELU_CUBIC * x * x * x)),
            Pointwise::QuickGelu => x * sigmoid(1.702 * x),
            Pointwise::Relu => {
                if x > 0.0 {
                    x
                } else {
                    0.0
                }
            }
            Pointwise::SquaredRelu => {
                let r = if x > 0.0 { x } else { 0.0 };
                r * r
            }
            Pointwise::Silu => x * sigmoid(x),
        }
    }
}

/// `act(x)` for `x` viewed as rows of `width`; gated: rows of `width = 2n` give rows of `n`.
pub fn activation_forward(x: &[f32], width: usize, f: Pointwise, gated: bool) -> OutputValues {
    let out_width = if gated { width / 2 } else { width };
    let mut y = OutputValues::for_overwrite(x.len() / width.max(1) * out_width);
    par_rows(x, width, &mut y, out_width, |_, x, y| {
        forward_rows(x, y, width, f, gated)
    });
    y
}

/// [`activation_forward`] with its output quantized in the same pass, as TE's activation kernels write the FP8
/// input of the GEMM that follows: `codes = encode(y · scale)` in `format` (delayed scaling's scale) and the amax
/// of `y`. Each row is computed into a buffer that stays in cache and encoded from there, so `y` never reaches
/// memory; the codes and amax are [`quantize_with_amax`](crate::host::quantize_with_amax)'s of
/// [`activation_forward`]'s output, bit for bit.
pub fn activation_forward_quantized(
    x: &[f32],
    width: usize,
    (f, gated): (Pointwise, bool),
    (scale, format): (f32, Fp8Format),
) -> (Vec<u8>, f32) {
    let out_width = if gated { width / 2 } else { width };
    let mut codes = uninit(x.len() / width.max(1) * out_width);
    let blocks = par_rows(x, width, &mut codes, out_width, |_, x, codes| {
        let mut y = vec![0.0f32; out_width];
        let mut amax = 0;
        for (x, codes) in x.chunks_exact(width).zip(codes.chunks_exact_mut(out_width)) {
            forward_rows(x, &mut y, width, f, gated);
            encode_scaled(&y, scale, format, codes);
            amax = amax.max(amax_bits(&y));
        }
        amax
    });
    let amax = blocks.into_iter().max().unwrap_or(0);
    // SAFETY: the blocks cover every row, and each row's codes are encoded whole.
    (unsafe { assume_init(codes) }, f32::from_bits(amax))
}

#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn forward_rows(x: &[f32], y: &mut [f32], width: usize, f: Pointwise, gated: bool) {
    if !gated {
        // One loop per function (a match per block, not per element), so that each loop vectorizes. A `for`
        // loop, not `for_each`: `for_each`'s fold was left out of line, compiled without this clone's features,
        // and called libm's `floorf` per element.
        let mut map = |f: Pointwise| {
            for (y, x) in y.iter_mut().zip(x) {
                *y = f.value(*x);
            }
        };
        match f {
            Pointwise::Gelu => map(Pointwise::Gelu),
            Pointwise::QuickGelu => map(Pointwise::QuickGelu),
            Pointwise::Relu => map(Pointwise::Relu),
            Pointwise::SquaredRelu => map(Pointwise::SquaredRelu),
            Pointwise::Silu => map(Pointwise::Silu),
        }
        return;
    }
    let n = width / 2;
    for (x, y) in x.chunks_exact(width).zip(y.chunks_exact_mut(n)) {
        let (a, v) = x.split_at(n);
        for ((y, a), v) in y.iter_mut().zip(a).zip(v) {
            *y = f.value(*a) * v;
        }
    }
}

/// The gradient of [`activation_forward`] with respect to `x` for the output gradient `dy`.
pub fn activation_backward(
    dy: &[f32],
    x: &[f32],
    width: usize,
    f: Pointwise,
    gated: bool,
) -> OutputValues {
    let out_width = if gated { width / 2 } else { width };
    let mut dx = OutputValues::for_overwrite(x.len());
    par_rows(x, width, &mut dx, width, |first, x, dx| {
        let rows = x.len() / width;
        let dy = &dy[first * out_width..(first + rows) * out_width];
        backward_rows(dy, x, dx, width, f, gated)
    });
    dx
}

#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn backward_rows(dy: &[f32], x: &[f32], dx: &mut [f32], width: usize, f: Pointwise, gated: bool) {
    if !gated {
        for ((dx, x), dy) in dx.iter_mut().zip(x).zip(dy) {
            *dx = dy * f.value_and_slope(*x).1;
        }
        return;
    }
    let n = width / 2;
    let rows = x.chunks_exact(width).zip(dx.chunks_exact_mut(width));
    for ((x, dx), dy) in rows.zip(dy.chunks_exact(n)) {
        let (a, v) = x.split_at(n);
        let (da, dv) = dx.split_at_mut(n);
        for ((((da, dv), a), v), dy) in da.iter_mut().zip(dv).zip(a).zip(v).zip(dy) {
            let (value, slope) = f.value_and_slope(*a);
            *da = dy * v * slope;
            *dv = dy * value;
        }
    }
}
