//! Statistics: the stats features ask for ([`StatRequest`]), their values ready to log ([`StatValue`]), and the
//! statistics launched on the device and read at `step()` ([`PendingStats`], [`PendingValue`]).

use burn_te::{BlockScaleRule, Fp8Format, Fp8Stats, ScaleBlock, TensorStats};

use crate::error::DebugError;
use crate::tensor::TensorName;

/// A stat of LogTensorStats or LogFp8TensorStats.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub enum Stat {
    /// Smallest element.
    Min,
    /// Largest element.
    Max,
    /// Mean.
    Mean,
    /// Unbiased standard deviation.
    Std,
    /// Σ|x|.
    L1Norm,
    /// √Σx².
    L2Norm,
    /// max |x|.
    CurAmax,
    /// log2(max nonzero |x|) − log2(min nonzero |x|).
    DynamicRange,
    /// NaN elements (beyond TE: the counts the statistics kernel computes anyway).
    NanCount,
    /// ±inf elements (beyond TE).
    InfCount,
    /// % of nonzero elements quantized to ±0.
    Underflows,
    /// % of elements beyond the format's range at the scale used.
    Overflows,
    /// Smallest `scale_inv` used.
    ScaleInvMin,
    /// Largest `scale_inv` used.
    ScaleInvMax,
    /// Standard deviation of the `scale_inv` values over the blocks (beyond TE, TE#2801; NaN for one per-tensor
    /// scale, as `torch.std` of one value).
    ScaleInvStd,
    /// Mean squared quantization error.
    Mse,
    /// The largest dynamic range of one block of the tensor (what a block-scaled recipe must hold).
    MaxBlockwiseDynamicRange(BlockwiseRange),
    /// A GEMM output's signal-to-quantization-noise ratio in dB against its high-precision reference `r`:
    /// `10·log10(Σr² / Σ(y−r)²)` (torchao's `compute_error`).
    Sqnr,
    /// `‖y−r‖₂ / ‖r‖₂` of a GEMM output `y` against its reference `r`.
    RelL2Error,
    /// `max |y−r|` of a GEMM output against its reference.
    MaxAbsError,
}

/// The blocks of `max_blockwise_dynamic_range`, over the tensor viewed as `[leading dims folded, last dim]`.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct BlockwiseRange {
    /// Elements per block side (TE's default 32).
    pub block_size: usize,
    /// 1: `1 × block_size` blocks along the last dimension; 2: `block_size × block_size` tiles.
    pub dims: u8,
    /// Also take the blocks of the transposed tensor (`block_size × 1` for dims 1) and log the larger maximum.
    pub max_over_orientations: bool,
}

impl BlockwiseRange {
    /// The block shapes to scan (one per orientation). Blocks at the edges may be partial (TE requires the
    /// element count to divide evenly; any shape works here).
    pub fn blocks(self) -> Vec<ScaleBlock> {
        let b = self.block_size;
        let rowwise = if self.dims == 2 {
            ScaleBlock::new(b, b)
        } else {
            ScaleBlock::new(1, b)
        };
        let columnwise = ScaleBlock::new(rowwise.cols, rowwise.rows);
        if self.max_over_orientations && columnwise != rowwise {
            vec![rowwise, columnwise]
        } else {
            vec![rowwise]
        }
    }
}

impl Stat {
    /// The high-precision stats (LogTensorStats).
    pub const TENSOR: [Stat; 10] = [
        Stat::Min,
        Stat::Max,
        Stat::Mean,
        Stat::Std,
        Stat::L1Norm,
        Stat::L2Norm,
        Stat::CurAmax,
        Stat::DynamicRange,
        Stat::NanCount,
        Stat::InfCount,
    ];
    /// The error stats of a GEMM output against its high-precision reference (LogQuantizationError).
    pub const ERROR: [Stat; 3] = [Stat::Sqnr, Stat::RelL2Error, Stat::MaxAbsError];
    /// The quantization stats (LogFp8TensorStats).
    pub const FP8: [Stat; 6] = [
        Stat::Underflows,
        Stat::Overflows,
        Stat::ScaleInvMin,
        Stat::ScaleInvMax,
        Stat::ScaleInvStd,
        Stat::Mse,
    ];

    /// TE's name, e.g. `l1_norm`, `underflows%`.
    pub fn name(self) -> &'static str {
        match self {
            Stat::Min => "min",
            Stat::Max => "max",
            Stat::Mean => "mean",
            Stat::Std => "std",
            Stat::L1Norm => "l1_norm",
            Stat::L2Norm => "l2_norm",
            Stat::CurAmax => "cur_amax",
            Stat::DynamicRange => "dynamic_range",
            Stat::Underflows => "underflows%",
            Stat::Overflows => "overflows%",
            Stat::ScaleInvMin => "scale_inv_min",
            Stat::ScaleInvMax => "scale_inv_max",
            Stat::ScaleInvStd => "scale_inv_std",
            Stat::Mse => "mse",
            Stat::MaxBlockwiseDynamicRange(_) => "max_blockwise_dynamic_range",
            Stat::NanCount => "nan_count",
            Stat::InfCount => "inf_count",
            Stat::Sqnr => "sqnr",
            Stat::RelL2Error => "rel_l2_error",
            Stat::MaxAbsError => "max_abs_error",
        }
    }

    /// The name the stat is logged under: TE's name, with the block parameters for
    /// `max_blockwise_dynamic_range_block_size_<B>_dims_<D>[_max_over_orientations]`.
    pub fn label(self) -> String {
        match self {
            Stat::MaxBlockwiseDynamicRange(range) => format!(
                "max_blockwise_dynamic_range_block_size_{}_dims_{}{}",
                range.block_size,
                range.dims,
                if range.max_over_orientations {
                    "_max_over_orientations"
                } else {
                    ""
                }
            ),
            stat => stat.name().to_string(),
        }
    }

    /// The name it is logged under with a source's prefix and suffix (e.g. `mxfp8_underflows%_columnwise`); the
    /// statistics log and [`crate::stat_names`] both take it from here.
    pub fn logged_name(self, prefix: &str, suffix: &str) -> String {
        format!("{prefix}{}{suffix}", self.label())
    }

    /// The stat's value from merged statistics (None: empty or undefined), by the README's NaN rule (each stat's
    /// formula in IEEE arithmetic, as PyTorch evaluates it: a NaN element makes `mse` NaN, an infinite one inf).
    pub fn value(self, stats: &Fp8Stats) -> Option<f64> {
        let t = &stats.tensor;
        match self {
            Stat::Min => t.min(),
            Stat::Max => t.max(),
            Stat::Mean => t.mean(),
            Stat::Std => t.std(),
            Stat::L1Norm => t.l1_norm(),
            Stat::L2Norm => t.l2_norm(),
            Stat::CurAmax => t.amax(),
            Stat::DynamicRange => t.dynamic_range(),
            Stat::NanCount => Some(t.nan_count as f64),
            Stat::InfCount => Some((t.pos_inf_count + t.neg_inf_count) as f64),
            Stat::Underflows => stats.underflows_percent(),
            Stat::Overflows => stats.overflows_percent(),
            // Over every block's (or the tensor's) scale_inv by the NaN rule: NVFP4's dequantization factors carry
            // the global amax, so a NaN or infinity in the tensor reaches them.
            Stat::ScaleInvMin => stats.scale_inv_stats.min(),
            Stat::ScaleInvMax => stats.scale_inv_stats.max(),
            Stat::ScaleInvStd => stats.scale_inv_stats.std(),
            Stat::Mse => stats.mse(),
            // Computed by its own kernel (see `StatBuffers::add_value`); the error stats from two tensors' (see
            // `Stat::error_value`).
            Stat::MaxBlockwiseDynamicRange(_)
            | Stat::Sqnr
            | Stat::RelL2Error
            | Stat::MaxAbsError => None,
        }
    }

    /// Whether the stat compares a GEMM output with its reference ([`Stat::ERROR`]).
    pub fn is_error(self) -> bool {
        Stat::ERROR.contains(&self)
    }

    /// An error stat's value from the merged statistics of the reference `r` and of the difference `y − r` (None:
    /// not an error stat, or no elements). A NaN or infinity in either propagates by IEEE arithmetic; a zero
    /// difference gives an SQNR of +inf and a relative error of 0, also where the reference is all zeros (a
    /// zero-initialised weight's fprop: nothing was lost, where `0/0` would log NaN).
    pub fn error_value(self, reference: &TensorStats, difference: &TensorStats) -> Option<f64> {
        if reference.numel == 0 {
            return None;
        }
        let signal = reference.sum_of_squares()?;
        let noise = difference.sum_of_squares()?;
        match self {
            Stat::Sqnr if noise == 0.0 => Some(f64::INFINITY),
            Stat::Sqnr => Some(10.0 * (signal / noise).log10()),
            Stat::RelL2Error if noise == 0.0 => Some(0.0),
            Stat::RelL2Error => Some((noise / signal).sqrt()),
            Stat::MaxAbsError => difference.amax(),
            _ => None,
        }
    }
}

/// What statistics of a tensor a feature asks for.
#[derive(Clone, Debug, PartialEq)]
pub struct StatRequest {
    /// Quantization to count (None: high-precision stats only).
    pub quantization: Option<(Fp8Format, StatsScaling)>,
    /// Prefix of the logged stat names (e.g. `fp8_current_scaling_`; empty for none).
    pub prefix: String,
    /// Suffix of the logged stat names (`_columnwise` for the other orientation's blocks; empty for none).
    pub suffix: String,
    /// The stats to log.
    pub stats: Vec<Stat>,
}

/// One stat value ready to log.
#[derive(Clone, Debug, PartialEq)]
pub struct StatValue {
    /// TE's stat name: `<layer>_<tensor>_<prefix><stat>`.
    pub name: String,
    /// The layer.
    pub layer: String,
    /// The tensor (None for a custom scalar).
    pub tensor: Option<TensorName>,
    /// The stat, with its prefix.
    pub stat: String,
    /// The value.
    pub value: f64,
}

/// The scaling of a quantization-statistics request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StatsScaling {
    /// Current scaling with `margin`.
    Current {
        /// TE's margin.
        margin: f32,
    },
    /// The layer's delayed-scaling history for this tensor (its scale before this step's update).
    Delayed,
    /// One scale per block of the tensor viewed as `[leading dims folded, last dim]`, from the block's amax.
    Block {
        /// The block shape.
        block: ScaleBlock,
        /// Power-of-two (Float8BlockScaling) or E8M0 (MXFP8) scales.
        rule: BlockScaleRule,
    },
    /// NVFP4 as the plan quantizes the tensor (round to nearest).
    Nvfp4(burn_te::gemm::nvfp4::Nvfp4Plan),
}

/// Statistics launched on the device, read at `step()`.
pub struct PendingStats(pub(crate) Box<dyn FnOnce() -> Result<Fp8Stats, DebugError> + Send>);

impl PendingStats {
    /// Reads the statistics back (waits for the device).
    pub fn read(self) -> Result<Fp8Stats, DebugError> {
        (self.0)()
    }
}

/// One value launched on the device, read at `step()`.
pub struct PendingValue(pub(crate) Box<dyn FnOnce() -> Result<f64, DebugError> + Send>);

impl PendingValue {
    /// Reads the value back (waits for the device).
    pub fn read(self) -> Result<f64, DebugError> {
        (self.0)()
    }
}
