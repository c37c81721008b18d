//! NVFP4 GEMM operands: how [`NVFP4BlockScaling`] quantizes each operand of a layer's GEMMs, as TE does
//! (`recipe/__init__.py`'s `QParams`):
//!
//! | operand | blocks | RHT | rounding |
//! | --- | --- | --- | --- |
//! | activation | 1×16 along K | at wgrad | nearest |
//! | weight | 16×16 tiles (1×16 along K with `disable_2d_quantization`) | never | nearest |
//! | gradient | 1×16 along K | at wgrad | stochastic (nearest with `disable_stochastic_rounding`) |
//!
//! The quantizer lays 1×16 blocks along a tensor's last dimension, so an operand whose K runs along its rows is
//! quantized as its transpose (TE's columnwise copy) and the GEMM reads it transposed back. The random Hadamard
//! transform mixes 16 consecutive tokens of both wgrad operands; it cancels in their product. Where the token count
//! is no multiple of 16, both operands are padded with zero tokens to the next multiple (which adds nothing to the
//! product; TE refuses such shapes).

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};
use burn_te_kernels::Fp8Format;
use burn_te_kernels::nvfp4::{BLOCK, Nvfp4Rounding, Nvfp4Tile};

use crate::backend::{Fp8Primitive, Scaling, TeBackend};
use crate::error::TeError;
use crate::fp8_state::site::GemmSite;
use crate::gemm::TensorRole;
use crate::recipe::NVFP4BlockScaling;

/// How one GEMM operand is quantized to NVFP4.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nvfp4Plan {
    /// 1×16 blocks or 16×16 tiles.
    pub tile: Nvfp4Tile,
    /// Nearest-even or stochastic rounding.
    pub rounding: Nvfp4Rounding,
    /// Quantize the random Hadamard transform along K.
    pub rht: bool,
    /// Quantize the transpose (K runs along the operand's rows and the blocks are 1×16).
    pub transpose: bool,
}

impl Nvfp4Plan {
    /// The plan of `role`'s operand at `site`: `k_along_cols` says along which stored dimension the GEMM reduces,
    /// `wgrad` whether the operand is one of the weight-gradient GEMM's two (the RHT's).
    pub fn new(
        recipe: &NVFP4BlockScaling,
        site: &GemmSite,
        role: TensorRole,
        k_along_cols: bool,
        wgrad: bool,
    ) -> Self {
        let plan = Self::nearest(recipe, role, k_along_cols, wgrad);
        if role == TensorRole::Gradient && !recipe.disable_stochastic_rounding {
            Self {
                rounding: Nvfp4Rounding::Stochastic {
                    seed: seed(site, role),
                },
                ..plan
            }
        } else {
            plan
        }
    }

    /// [`new`](Self::new) with round to nearest for every role: the quantization the debug tools' NVFP4
    /// statistics describe (the expected error, without stochastic rounding's noise).
    pub fn nearest(
        recipe: &NVFP4BlockScaling,
        role: TensorRole,
        k_along_cols: bool,
        wgrad: bool,
    ) -> Self {
        let tile = if role == TensorRole::Weight && !recipe.disable_2d_quantization {
            Nvfp4Tile::Tile16x16
        } else {
            Nvfp4Tile::Row1x16
        };
        Self {
            tile,
            rounding: Nvfp4Rounding::Nearest,
            rht: wgrad && role != TensorRole::Weight && !recipe.disable_rht,
            transpose: !k_along_cols && tile == Nvfp4Tile::Row1x16,
        }
    }
}

/// The stochastic-rounding seed of a tensor: from its layer, GEMM, role and the iteration's draw (see
/// [`crate::seed_stochastic_rounding`]), so a seeded run is reproducible and every quantization draws other bits.
fn seed(site: &GemmSite, role: TensorRole) -> u32 {
    let hash = crate::hash::hash_of(&(&*site.layer, site.gemm, role, site.rounding));
    (hash ^ (hash >> 32)) as u32
}

/// Quantizes an operand `[.., rows, cols]` by `plan`. Returns the quantized tensor and whether it holds the
/// operand's transpose (see [`operand_layout`]).
pub fn quantize<B: TeBackend>(
    tensor: FloatTensor<B>,
    plan: Nvfp4Plan,
    amax_group: Option<&dyn crate::fp8_state::site::AmaxGroup>,
) -> Result<(Fp8Primitive<B>, bool), TeError> {
    let quantized = B::fp8_quantize(
        operand_layout::<B>(tensor, plan)?,
        Fp8Format::E4M3,
        Scaling::Nvfp4 {
            tile: plan.tile,
            rounding: plan.rounding,
            rht: plan.rht,
            amax_group,
        },
    )?;
    Ok((quantized, plan.transpose))
}

/// An operand `[.., rows, cols]` laid out as `plan` quantizes it: unchanged, or (with `plan.transpose`) its
/// transpose `[.., cols, rows]`, the rows first padded with zero rows to a multiple of 16 under the RHT. The GEMM
/// and the debug tools' statistics both quantize this tensor.
pub fn operand_layout<B: TeBackend>(
    tensor: FloatTensor<B>,
    plan: Nvfp4Plan,
) -> Result<FloatTensor<B>, TeError> {
    if !plan.transpose {
        return Ok(tensor);
    }
    let dims = tensor.shape().as_slice().to_vec();
    let n = dims.len();
    if n < 2 {
        return Err(TeError::InvalidShape {
            module: "nvfp4 operand".into(),
            reason: "expected a matrix to quantize along its rows".into(),
            shape: dims,
        });
    }
    let padded = if plan.rht {
        pad_rows::<B>(tensor, &dims)
    } else {
        tensor
    };
    Ok(B::float_swap_dims(padded, n - 2, n - 1))
}

/// `[.., rows, cols]` with zero rows appended up to a multiple of 16.
fn pad_rows<B: TeBackend>(tensor: FloatTensor<B>, dims: &[usize]) -> FloatTensor<B> {
    let n = dims.len();
    let rows = dims[n - 2];
    let padded = rows.next_multiple_of(BLOCK);
    if padded == rows {
        return tensor;
    }
    let mut zeros = dims.to_vec();
    zeros[n - 2] = padded - rows;
    let zeros = B::float_zeros(
        Shape::from(zeros),
        &B::float_device(&tensor),
        tensor.dtype().into(),
    );
    B::float_cat(vec![tensor, zeros], n - 2)
}

/// NVFP4's block scales are E4M3: the only `format` a [`Scaling::Nvfp4`] quantization takes.
pub(crate) fn check_scale_format(format: Fp8Format) -> Result<(), TeError> {
    if format != Fp8Format::E4M3 {
        return Err(TeError::InvalidRecipe(format!(
            "nvfp4: the block scales are E4M3, got {format:?}"
        )));
    }
    Ok(())
}
