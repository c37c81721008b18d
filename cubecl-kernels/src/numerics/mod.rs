//! The plain types under every kernel and the host reference: the FP8 formats, the blocks that share a scale, TE's
//! scaling-factor rule and delayed-scaling history, and the statistics records. Re-exported at the crate root.

mod format;
mod scale_block;
mod scaling;
mod stats;

pub use format::Fp8Format;
pub use scale_block::{BlockScaleRule, ScaleBlock};
pub use scaling::{AmaxComputeAlgo, DelayedScalingHistory, pow2_margin, scale_from_amax};
pub use stats::{Fp8Stats, TensorStats};
