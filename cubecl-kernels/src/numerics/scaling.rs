//! Transformer Engine's scaling-factor rule and delayed-scaling history update, on the host.

use crate::Fp8Format;

use crate::error::KernelError;

/// How delayed scaling turns the amax history into the amax used for the next scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum AmaxComputeAlgo {
    /// The largest amax in the window (TE's default `"max"`); NaN entries are skipped.
    #[default]
    Max,
    /// The newest amax only (`"most_recent"`).
    MostRecent,
}

/// `2^margin` in f32, checked: TE's margin is a small non-negative number of binades.
pub fn pow2_margin(margin: f32) -> Result<f32, KernelError> {
    let factor = 2.0f32.powf(margin);
    if !margin.is_finite() || margin < 0.0 || !factor.is_finite() {
        return Err(KernelError::InvalidArgument {
            what: "margin",
            reason: format!("{margin} (must be a finite number >= 0)"),
        });
    }
    Ok(factor)
}

/// TE's scale rule: `(fp8_max / 2^margin) / amax` in f32 when amax is finite and > 0, otherwise `previous` is
/// kept; a scale that overflows to inf becomes `f32::MAX`. The margin divides `fp8_max` first, as TE's fused update
/// (`delayed_scaling.cu`) does: the same bits as `(fp8_max / amax) / 2^margin` wherever that does not overflow.
pub fn scale_from_amax(amax: f32, previous: f32, format: Fp8Format, pow2_margin: f32) -> f32 {
    let bits = amax.to_bits();
    if bits == 0 || bits >= 0x7f80_0000 {
        return previous;
    }
    let scale = (format.max() / pow2_margin) / amax;
    if scale.is_infinite() { f32::MAX } else { scale }
}

/// The amax history and scale of one tensor under delayed scaling, updated on the host exactly as the
/// `delayed_scaling_update_kernel` does on a device.
#[derive(Clone, Debug, PartialEq)]
pub struct DelayedScalingHistory {
    /// Amax window; `history[0]` receives the amax of the current step.
    pub history: Vec<f32>,
    /// Current scale (initially 1).
    pub scale: f32,
    /// `1 / scale`.
    pub scale_inv: f32,
}

impl DelayedScalingHistory {
    /// A zeroed window of `len` steps and scale 1. Errors if `len` is 0.
    pub fn new(len: usize) -> Result<Self, KernelError> {
        if len == 0 {
            return Err(KernelError::InvalidArgument {
                what: "amax_history_len",
                reason: "must be at least 1".into(),
            });
        }
        Ok(Self {
            history: vec![0.0; len],
            scale: 1.0,
            scale_inv: 1.0,
        })
    }

    /// Records the amax of the current step (max with what is already in slot 0, as several quantizations of one
    /// tensor in a step do).
    pub fn record(&mut self, amax: f32) {
        let slot = &mut self.history[0];
        if amax.to_bits() & 0x7fff_ffff > slot.to_bits() {
            *slot = f32::from_bits(amax.to_bits() & 0x7fff_ffff);
        }
    }

    /// End of step: amax from the window, roll the window, zero slot 0, update scale and scale_inv. A step whose
    /// amax is 0 (the tensor was all zeros, or not quantized) changes nothing, as in TE's fused update: the
    /// window does not roll and the scale stays.
    pub fn update(&mut self, algo: AmaxComputeAlgo, format: Fp8Format, pow2_margin: f32) {
        let newest = self.history[0];
        if newest.to_bits() & 0x7fff_ffff == 0 {
            return;
        }
        let window_max = self
            .history
            .iter()
            .map(|a| a.to_bits())
            .filter(|&bits| bits <= 0x7f80_0000)
            .max()
            .map_or(0.0, f32::from_bits);
        self.history.rotate_left(1);
        self.history[0] = 0.0;
        let amax = match algo {
            AmaxComputeAlgo::Max => window_max,
            AmaxComputeAlgo::MostRecent => newest,
        };
        self.scale = scale_from_amax(amax, self.scale, format, pow2_margin);
        self.scale_inv = 1.0 / self.scale;
    }
}
