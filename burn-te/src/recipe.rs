//! FP8 recipes with Transformer Engine's defaults and semantics.

use burn_te_kernels::{AmaxComputeAlgo, BlockScaleRule, Fp8Format, ScaleBlock};

use crate::error::TeError;
use crate::gemm::TensorRole;

/// TE's `Format`: which FP8 format each tensor role uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Format {
    /// E4M3 for activations and weights, E5M2 for gradients (TE's default).
    #[default]
    Hybrid,
    /// E4M3 everywhere.
    E4M3,
    /// E5M2 everywhere: rejected by every recipe, as in TE.
    E5M2,
}

impl Format {
    /// The FP8 format of a tensor role.
    pub fn for_role(self, role: TensorRole) -> Fp8Format {
        match (self, role) {
            (Format::Hybrid, TensorRole::Gradient) | (Format::E5M2, _) => Fp8Format::E5M2,
            _ => Fp8Format::E4M3,
        }
    }
}

/// Delayed scaling: each tensor's scale comes from an amax history of previous iterations.
#[derive(Clone, Debug, PartialEq)]
pub struct DelayedScaling {
    /// The scale is divided by `2^margin` (default 0).
    pub margin: f32,
    /// FP8 formats (default `Hybrid`).
    pub fp8_format: Format,
    /// Length of the amax history window (default 1024).
    pub amax_history_len: usize,
    /// How the window becomes one amax (default `Max`).
    pub amax_compute_algo: AmaxComputeAlgo,
    /// Reduce amaxes across data-parallel ranks (default true). burn-te runs delayed scaling in one process, where
    /// there is nothing to reduce; the flag is kept for TE compatibility (see the README).
    pub reduce_amax: bool,
    /// TE's `fp8_dpa`: the attention's two GEMMs (`q·kᵀ`, `p·v`) and their backward in FP8 too (default false).
    pub fp8_dpa: bool,
    /// TE's `fp8_mha`: FP8 attention with FP8 tensors between the projections and the attention. burn-te keeps
    /// no FP8 tensors between modules, so it runs as `fp8_dpa` (default false).
    pub fp8_mha: bool,
}

impl Default for DelayedScaling {
    fn default() -> Self {
        Self {
            margin: 0.0,
            fp8_format: Format::Hybrid,
            amax_history_len: 1024,
            amax_compute_algo: AmaxComputeAlgo::Max,
            reduce_amax: true,
            fp8_dpa: false,
            fp8_mha: false,
        }
    }
}

/// Current (per-tensor, just-in-time) scaling: each tensor's scale from its own amax.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Float8CurrentScaling {
    /// FP8 formats (default `Hybrid`).
    pub fp8_format: Format,
    /// TE's `fp8_dpa`: the attention's two GEMMs and their backward in FP8 too (default false).
    pub fp8_dpa: bool,
    /// TE's `fp8_mha`: runs as `fp8_dpa` (see [`DelayedScaling::fp8_mha`]; default false).
    pub fp8_mha: bool,
}

/// Block scaling (DeepSeek-v3 style): 1×128 tiles for activations and gradients, 128×128 blocks for weights,
/// power-of-two scales.
#[derive(Clone, Debug, PartialEq)]
pub struct Float8BlockScaling {
    /// FP8 formats (default `E4M3`).
    pub fp8_format: Format,
}

impl Default for Float8BlockScaling {
    fn default() -> Self {
        Self {
            fp8_format: Format::E4M3,
        }
    }
}

/// MXFP8: one E8M0 (power-of-two) scale per 32 consecutive values along the GEMM's reduction dimension. TE needs
/// Blackwell for it; here it is emulated on any device.
#[derive(Clone, Debug, PartialEq)]
pub struct MXFP8BlockScaling {
    /// FP8 formats (default `E4M3`).
    pub fp8_format: Format,
}

impl Default for MXFP8BlockScaling {
    fn default() -> Self {
        Self {
            fp8_format: Format::E4M3,
        }
    }
}

/// NVFP4: E2M1 values with one E4M3 scale per 16 values along the GEMM's reduction dimension and an FP32 global
/// scale per tensor (from its amax). Weights use 16×16 tiles, gradients stochastic rounding, and the two operands
/// of the weight-gradient GEMM a random Hadamard transform along the tokens (they cancel in the product). TE needs
/// Blackwell for it; here it is emulated on any device, bit-exact against TE's kernels.
///
/// TE reads the three switches from `NVTE_NVFP4_DISABLE_RHT`, `NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING` and
/// `NVTE_NVFP4_DISABLE_2D_QUANTIZATION`; [`NVFP4BlockScaling::from_env`] does the same.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct NVFP4BlockScaling {
    /// No random Hadamard transform on the weight-gradient GEMM's operands (default false).
    pub disable_rht: bool,
    /// Round gradients to nearest-even instead of stochastically (default false).
    pub disable_stochastic_rounding: bool,
    /// Quantize weights in 1×16 blocks along the reduction dimension instead of 16×16 tiles (default false).
    pub disable_2d_quantization: bool,
}

impl NVFP4BlockScaling {
    /// TE's defaults, with each switch set when its `NVTE_NVFP4_DISABLE_*` environment variable is `1` (as TE).
    pub fn from_env() -> Self {
        let set = |name: &str| std::env::var(name).is_ok_and(|value| value == "1");
        Self {
            disable_rht: set("NVTE_NVFP4_DISABLE_RHT"),
            disable_stochastic_rounding: set("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"),
            disable_2d_quantization: set("NVTE_NVFP4_DISABLE_2D_QUANTIZATION"),
        }
    }
}

/// An FP8 (or FP4) recipe: how tensors are scaled and in which formats.
#[derive(Clone, Debug, PartialEq)]
pub enum Recipe {
    /// [`DelayedScaling`].
    Delayed(DelayedScaling),
    /// [`Float8CurrentScaling`].
    Current(Float8CurrentScaling),
    /// [`Float8BlockScaling`].
    Block(Float8BlockScaling),
    /// [`MXFP8BlockScaling`].
    Mxfp8(MXFP8BlockScaling),
    /// [`NVFP4BlockScaling`].
    Nvfp4(NVFP4BlockScaling),
}

impl Default for Recipe {
    /// TE's default recipe: `DelayedScaling::default()`.
    fn default() -> Self {
        Recipe::Delayed(DelayedScaling::default())
    }
}

impl From<DelayedScaling> for Recipe {
    fn from(recipe: DelayedScaling) -> Self {
        Recipe::Delayed(recipe)
    }
}
impl From<Float8CurrentScaling> for Recipe {
    fn from(recipe: Float8CurrentScaling) -> Self {
        Recipe::Current(recipe)
    }
}
impl From<Float8BlockScaling> for Recipe {
    fn from(recipe: Float8BlockScaling) -> Self {
        Recipe::Block(recipe)
    }
}
impl From<MXFP8BlockScaling> for Recipe {
    fn from(recipe: MXFP8BlockScaling) -> Self {
        Recipe::Mxfp8(recipe)
    }
}
impl From<NVFP4BlockScaling> for Recipe {
    fn from(recipe: NVFP4BlockScaling) -> Self {
        Recipe::Nvfp4(recipe)
    }
}

/// Rows and columns of a Float8BlockScaling weight block.
pub const WEIGHT_BLOCK: usize = 128;
/// Elements per Float8BlockScaling activation/gradient tile.
pub const TILE: usize = 128;
/// Elements per MXFP8 scale.
pub const MX_BLOCK: usize = 32;

impl Recipe {
    /// Whether the attention's GEMMs run in FP8 under this recipe (TE's `fp8_dpa` or `fp8_mha`, per-tensor
    /// recipes only).
    pub fn fp8_attention(&self) -> bool {
        match self {
            Recipe::Delayed(r) => r.fp8_dpa || r.fp8_mha,
            Recipe::Current(r) => r.fp8_dpa || r.fp8_mha,
            _ => false,
        }
    }

    /// The recipe's FP8 formats (NVFP4: E4M3, its block scales' format, as TE's `fp8_format`).
    pub fn format(&self) -> Format {
        match self {
            Recipe::Delayed(r) => r.fp8_format,
            Recipe::Current(r) => r.fp8_format,
            Recipe::Block(r) => r.fp8_format,
            Recipe::Mxfp8(r) => r.fp8_format,
            Recipe::Nvfp4(_) => Format::E4M3,
        }
    }

    /// TE's name of the recipe, as the debug tools' stat prefixes use it.
    pub fn name(&self) -> &'static str {
        match self {
            Recipe::Delayed(_) => "fp8_delayed_scaling",
            Recipe::Current(_) => "fp8_current_scaling",
            Recipe::Block(_) => "fp8_block_scaling",
            Recipe::Mxfp8(_) => "mxfp8",
            Recipe::Nvfp4(_) => "nvfp4",
        }
    }

    /// Checks the recipe as TE does: pure E5M2 is rejected, the margin must be finite and ≥ 0 (and below 128, so
    /// that `2^margin` is a finite f32), the history non-empty.
    pub fn validate(&self) -> Result<(), TeError> {
        if self.format() == Format::E5M2 {
            return Err(TeError::InvalidRecipe(format!(
                "{}: fp8_format E5M2 is not supported (use Hybrid: E4M3 forward, E5M2 gradients; or E4M3)",
                self.name()
            )));
        }
        if let Recipe::Delayed(r) = self {
            // 2^margin divides the scale: a margin of 128 or more overflows f32 at the first scale update.
            if burn_te_kernels::pow2_margin(r.margin).is_err() {
                return Err(TeError::InvalidRecipe(format!(
                    "fp8_delayed_scaling: margin must be finite, >= 0 and below 128 (2^margin a finite f32), got {}",
                    r.margin
                )));
            }
            if r.amax_history_len == 0 {
                return Err(TeError::InvalidRecipe(
                    "fp8_delayed_scaling: amax_history_len must be at least 1".into(),
                ));
            }
        }
        Ok(())
    }

    /// The scale block of an FP8 operand stored as `[rows, cols]`, given along which stored dimension the GEMM
    /// reduces (`k_along_cols`); `None` for per-tensor recipes and NVFP4 (see the `nvfp4` module).
    pub fn block(
        &self,
        role: TensorRole,
        k_along_cols: bool,
    ) -> Option<(ScaleBlock, BlockScaleRule)> {
        let along_k = |len: usize| {
            if k_along_cols {
                ScaleBlock::new(1, len)
            } else {
                ScaleBlock::new(len, 1)
            }
        };
        match self {
            Recipe::Delayed(_) | Recipe::Current(_) | Recipe::Nvfp4(_) => None,
            Recipe::Block(_) if role == TensorRole::Weight => Some((
                ScaleBlock::new(WEIGHT_BLOCK, WEIGHT_BLOCK),
                BlockScaleRule::Pow2,
            )),
            Recipe::Block(_) => Some((along_k(TILE), BlockScaleRule::Pow2)),
            Recipe::Mxfp8(_) => Some((along_k(MX_BLOCK), BlockScaleRule::E8m0)),
        }
    }
}
