//! Adam's step over one parameter in one pass (Transformer Engine's `FusedAdam`): the gradient, the two moments
//! and the parameter read once, the new parameter and moments written once, in blocks on rayon's pool. Burn's
//! `Adam` composes the same step of a dozen tensor ops, each a pass over memory on one thread (on Flex).
//!
//! The arithmetic is Burn's, operation for operation in f32 (no fused multiply-adds), so the results are the
//! bits Burn's `Adam` gives:
//!
//! ```text
//! g  = c · g                                 (Burn's clipping by norm, where set: c is AdamStep::grad_scale)
//! g  = g + penalty · x                       (Burn's WeightDecay, where set)
//! m  = β₁ · m + (1 − β₁) · g                 (first step: (1 − β₁) · g)
//! v  = β₂ · v + (1 − β₂) · g²                (first step: (1 − β₂) · g²)
//! x  = x − lr · (m · c) / (√v + ε · √(1 − β₂ᵗ)),   c = √(1 − β₂ᵗ) / (1 − β₁ᵗ)
//! ```

use rayon::prelude::*;

use crate::host::pool::OutputValues;

/// Elements per task: smaller parameters run on the calling thread.
const BLOCK: usize = 1 << 15;

/// The scalars of one Adam step at step `time` (1 for the first), computed as Burn's `Adam` computes them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    /// β₁, the first moment's decay.
    pub beta_1: f32,
    /// β₂, the second moment's decay.
    pub beta_2: f32,
    /// `√(1 − β₂ᵗ) / (1 − β₁ᵗ)`: both bias corrections in one factor of the first moment.
    pub correction: f32,
    /// `ε · √(1 − β₂ᵗ)`, added to `√v`.
    pub epsilon: f32,
    /// The learning rate.
    pub lr: f32,
    /// The L2 penalty added to the gradient (`g + penalty · x`), where set.
    pub penalty: Option<f32>,
    /// The factor the gradient is multiplied by before anything else: gradient clipping by norm's coefficient, 1
    /// where there is none (`g · 1` is `g`, bit for bit).
    pub grad_scale: f32,
}

impl AdamStep {
    /// The step's scalars from the hyper-parameters, the learning rate and the step number `time` (≥ 1).
    pub fn new(
        beta_1: f32,
        beta_2: f32,
        epsilon: f32,
        lr: f64,
        penalty: Option<f32>,
        time: usize,
    ) -> Self {
        let time = i32::try_from(time).unwrap_or(i32::MAX);
        let bias_correction2_sqrt = (1.0 - beta_2.powi(time)).sqrt();
        Self {
            beta_1,
            beta_2,
            correction: bias_correction2_sqrt / (1.0 - beta_1.powi(time)),
            epsilon: epsilon * bias_correction2_sqrt,
            lr: lr as f32,
            penalty,
            grad_scale: 1.0,
        }
    }

    /// The same step on the gradient times `scale` (gradient clipping's coefficient).
    pub fn with_grad_scale(self, scale: f32) -> Self {
        Self {
            grad_scale: scale,
            ..self
        }
    }
}

/// `values[i]²`, in blocks on rayon's pool: the pass of Burn's gradient clipping by norm before its sum
/// (`x · x`, the bits of Burn's `square` on Flex and NdArray).
pub fn squares(values: &[f32]) -> OutputValues {
    let mut out = OutputValues::for_overwrite(values.len());
    let square = |(out, values): (&mut [f32], &[f32])| {
        out.iter_mut().zip(values).for_each(|(o, v)| *o = v * v)
    };
    if values.len() <= BLOCK {
        square((&mut out, values));
    } else {
        out.par_chunks_mut(BLOCK)
            .zip(values.par_chunks(BLOCK))
            .for_each(square);
    }
    out
}

/// A parameter and its two moments after a step.
pub struct AdamOutput {
    /// The new parameter.
    pub param: OutputValues,
    /// The new first moment.
    pub moment_1: OutputValues,
    /// The new second moment.
    pub moment_2: OutputValues,
}

/// One Adam step of `param` with gradient `grad` from the moments `moments` (`None` on the first step: both zero).
/// The slices have one length (the callers check it).
pub fn adam_step(
    param: &[f32],
    grad: &[f32],
    moments: Option<(&[f32], &[f32])>,
    step: AdamStep,
) -> AdamOutput {
    let len = param.len();
    assert_eq!(grad.len(), len, "a gradient per parameter value");
    if let Some((m, v)) = moments {
        assert!(
            m.len() == len && v.len() == len,
            "two moments per parameter value"
        );
    }
    let mut out = AdamOutput {
        param: OutputValues::for_overwrite(len),
        moment_1: OutputValues::for_overwrite(len),
        moment_2: OutputValues::for_overwrite(len),
    };
    let run = |block: usize, x_out: &mut [f32], m_out: &mut [f32], v_out: &mut [f32]| {
        let range = block * BLOCK..block * BLOCK + x_out.len();
        let previous = moments.map(|(m, v)| (&m[range.clone()], &v[range.clone()]));
        block_step(
            &param[range.clone()],
            &grad[range],
            previous,
            step,
            [x_out, m_out, v_out],
        );
    };
    let AdamOutput {
        param: x,
        moment_1: m,
        moment_2: v,
    } = &mut out;
    if len <= BLOCK {
        run(0, x, m, v);
    } else {
        x.par_chunks_mut(BLOCK)
            .zip(m.par_chunks_mut(BLOCK))
            .zip(v.par_chunks_mut(BLOCK))
            .enumerate()
            .for_each(|(block, ((x, m), v))| run(block, x, m, v));
    }
    out
}

/// [`adam_step`] on one block, written into `[param, moment_1, moment_2]`.
#[multiversion::multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn block_step(
    x: &[f32],
    g: &[f32],
    moments: Option<(&[f32], &[f32])>,
    s: AdamStep,
    [x_out, m_out, v_out]: [&mut [f32]; 3],
) {
    let n = x_out.len();
    let (x, g, m_out, v_out) = (&x[..n], &g[..n], &mut m_out[..n], &mut v_out[..n]);
    let (one_minus_beta_1, one_minus_beta_2) = (1.0 - s.beta_1, 1.0 - s.beta_2);
    let scale = s.grad_scale;
    // One loop per case (first step or not, penalty or not), so that no branch is left in a loop and each
    // vectorizes. `$grad(i)` is the gradient, `$moments(i, g)` the new moments.
    macro_rules! steps {
        ($grad:expr, $moments:expr) => {
            for i in 0..n {
                let g: f32 = $grad(i);
                let (m, v): (f32, f32) = $moments(i, g);
                m_out[i] = m;
                v_out[i] = v;
                x_out[i] = x[i] - (m * s.correction) / (v.sqrt() + s.epsilon) * s.lr;
            }
        };
    }
    let first = |_: usize, g: f32| (g * one_minus_beta_1, g * g * one_minus_beta_2);
    match (moments, s.penalty) {
        (Some((m0, v0)), penalty) => {
            let (m0, v0) = (&m0[..n], &v0[..n]);
            let next = |i: usize, g: f32| {
                (
                    m0[i] * s.beta_1 + g * one_minus_beta_1,
                    v0[i] * s.beta_2 + g * g * one_minus_beta_2,
                )
            };
            match penalty {
                Some(p) => steps!(|i: usize| x[i] * p + g[i] * scale, next),
                None => steps!(|i: usize| g[i] * scale, next),
            }
        }
        (None, Some(p)) => steps!(|i: usize| x[i] * p + g[i] * scale, first),
        (None, None) => steps!(|i: usize| g[i] * scale, first),
    }
}
