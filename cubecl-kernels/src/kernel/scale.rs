//! Scaling-factor kernels: Transformer Engine's scale rule and the delayed-scaling amax-history update.

use cubecl::prelude::*;

use crate::AmaxComputeAlgo;

/// Bits of +inf in f32.
const INF_BITS: u32 = 0x7f80_0000;

/// TE's scale rule on one tensor: `(fp8_max / 2^margin) / amax` when amax is finite and > 0, else the previous
/// scale; a scale that overflows to inf becomes `f32::MAX`. Classifies amax on its bits, so a flush-to-zero
/// runtime decides the same way as the host.
#[cube]
pub fn scale_from_amax(amax: f32, previous: f32, fp8_max: f32, pow2_margin: f32) -> f32 {
    let amax_bits = u32::reinterpret(amax);
    let mut scale = previous;
    if amax_bits > 0 && amax_bits < INF_BITS {
        scale = (fp8_max / pow2_margin) / amax;
        if (u32::reinterpret(scale) & 0x7fff_ffff) == INF_BITS {
            scale = comptime!(f32::MAX).runtime();
        }
    }
    scale
}

/// One unit per tensor `t`: `scale[t] = scale_from_amax(amax[t], scale[t])`, `scale_inv[t] = 1 / scale[t]`.
#[cube(launch_unchecked)]
pub fn compute_scale_kernel(
    amax: &Array<f32>,
    scale: &mut Array<f32>,
    scale_inv: &mut Array<f32>,
    num_tensors: u32,
    fp8_max: f32,
    pow2_margin: f32,
) {
    let t = ABSOLUTE_POS;
    if t < num_tensors as usize {
        let new_scale = scale_from_amax(amax[t], scale[t], fp8_max, pow2_margin);
        scale[t] = new_scale;
        scale_inv[t] = 1.0f32 / new_scale;
    }
}

/// Delayed scaling, one unit per tensor `t`. `history` is `[history_len, num_tensors]` (row 0 holds the amax of
/// the step that just ran). Takes the amax of the window (`Max`: largest non-NaN entry; `MostRecent`: row 0),
/// rolls the window by one (row `i` ← row `i + 1`, the last row ← old row 0) and zeroes row 0 for the next step,
/// then updates `scale[t]` and `scale_inv[t]` with [`scale_from_amax()`]. Where row 0 holds 0, nothing changes
/// (TE's fused update rolls only a nonzero amax and keeps the scale).
#[cube(launch_unchecked)]
pub fn delayed_scaling_update_kernel(
    history: &mut Array<f32>,
    scale: &mut Array<f32>,
    scale_inv: &mut Array<f32>,
    num_tensors: u32,
    history_len: u32,
    fp8_max: f32,
    pow2_margin: f32,
    #[comptime] algo: AmaxComputeAlgo,
) {
    let t = ABSOLUTE_POS;
    let n = num_tensors as usize;
    if t < n {
        let len = history_len as usize;
        let newest = history[t];
        let mut window_max_bits = 0u32;
        if (u32::reinterpret(newest) & 0x7fff_ffff) != 0 {
            for i in 0..len {
                let mut value = newest;
                if i + 1 < len {
                    value = history[(i + 1) * n + t];
                }
                let bits = u32::reinterpret(value);
                // Skips NaN (and negative) entries, like CUDA's fmaxf in TE's kernel.
                if bits <= INF_BITS && bits > window_max_bits {
                    window_max_bits = bits;
                }
                if i > 0 {
                    history[i * n + t] = value;
                }
            }
            history[t] = 0.0f32;
        }
        let mut amax = f32::reinterpret(window_max_bits);
        if comptime!(algo == AmaxComputeAlgo::MostRecent) {
            amax = newest;
        }
        let new_scale = scale_from_amax(amax, scale[t], fp8_max, pow2_margin);
        scale[t] = new_scale;
        scale_inv[t] = 1.0f32 / new_scale;
    }
}

/// `output[i] = input[i]` for `i < len`.
#[cube(launch_unchecked)]
pub fn copy_kernel(input: &Array<f32>, output: &mut Array<f32>, len: u32) {
    if ABSOLUTE_POS < len as usize {
        output[ABSOLUTE_POS] = input[ABSOLUTE_POS];
    }
}
