//! Quantize and observe: a GEMM's tensors as the features see them. In: the decorator's operands and output; out:
//! [`SiteTensor`]s, the [`DebugTensor`] over a backend's tensor (statistics launched on its device, fake
//! quantization, the host copy), including an operand quantized as its GEMM quantizes it ([`postquantized`]).

use core::any::Any;

use burn::tensor::TensorMetadata;
use burn::tensor::ops::FloatTensor;
use burn_te::backend::TeBackend;
use burn_te::gemm::fp8 as fp8_gemm;
use burn_te::gemm::saved::{Saved, SavedOperand};
use burn_te::{BlockScaleRule, Fp8Format, GemmSite, Recipe, ScaleBlock, Scaling, TensorRole};

use crate::error::DebugError;
use crate::feature::DebugTensor;
use crate::quantized::Quantized;
use crate::stats::{PendingStats, PendingValue, StatsScaling};
use crate::tensor::TensorName;

/// A GEMM operand or output as the features see it.
pub(crate) struct SiteTensor<B: TeBackend> {
    tensor: FloatTensor<B>,
    site: GemmSite,
    role: Option<TensorRole>,
    recipe: Option<Recipe>,
}

impl<B: TeBackend> SiteTensor<B> {
    /// `tensor` at `site`'s GEMM: an operand (its `role`) or the output, under `recipe` (None outside FP8).
    pub(crate) fn new(
        tensor: FloatTensor<B>,
        site: &GemmSite,
        role: Option<TensorRole>,
        recipe: Option<&Recipe>,
    ) -> SiteTensor<B> {
        SiteTensor {
            tensor,
            site: site.clone(),
            role,
            recipe: recipe.cloned(),
        }
    }

    /// The backend's tensor a feature returned (`None`: a tensor of another backend).
    pub(crate) fn from_feature(tensor: Box<dyn DebugTensor>) -> Option<FloatTensor<B>> {
        tensor
            .into_any()
            .downcast::<SiteTensor<B>>()
            .ok()
            .map(|tensor| tensor.tensor)
    }

    fn with(&self, tensor: FloatTensor<B>) -> SiteTensor<B> {
        SiteTensor {
            tensor,
            site: self.site.clone(),
            role: self.role,
            recipe: self.recipe.clone(),
        }
    }
}

impl<B: TeBackend> SiteTensor<B> {
    /// The layer's delayed-scaling state for this tensor, as the GEMM uses it at this iteration; `None` without a
    /// DelayedScaling scope or a role.
    fn layer_delayed_state(&self) -> Result<Option<B::DelayedState>, DebugError> {
        let (Some(Recipe::Delayed(recipe)), Some(role)) = (&self.recipe, self.role) else {
            return Ok(None);
        };
        let device = B::float_device(&self.tensor);
        Ok(Some(fp8_gemm::delayed_state::<B>(
            &self.site, recipe, role, &device,
        )?))
    }
}

impl<B: TeBackend> DebugTensor for SiteTensor<B> {
    fn shape(&self) -> Vec<usize> {
        self.tensor.shape().as_slice().to_vec()
    }

    fn launch_stats(
        &self,
        quantization: Option<(Fp8Format, StatsScaling)>,
    ) -> Result<PendingStats, DebugError> {
        let pending = match quantization {
            None => B::fp8_stats_launch(self.tensor.clone(), None)?,
            Some((format, StatsScaling::Current { margin })) => B::fp8_stats_launch(
                self.tensor.clone(),
                Some((format, Scaling::Current { margin })),
            )?,
            Some((format, StatsScaling::Delayed)) => {
                let Some(state) = self.layer_delayed_state()? else {
                    return Err(burn_te::TeError::InvalidRecipe(
                        "delayed-scaling stats need a DelayedScaling scope".into(),
                    )
                    .into());
                };
                let scaling = Scaling::Delayed {
                    state: &state,
                    record: false,
                };
                B::fp8_stats_launch(self.tensor.clone(), Some((format, scaling)))?
            }
            Some((format, StatsScaling::Block { block, rule })) => B::fp8_stats_launch(
                self.tensor.clone(),
                Some((format, Scaling::Block { block, rule })),
            )?,
            Some((_, StatsScaling::Nvfp4(plan))) => {
                // The operand as the GEMM quantizes it (transposed for blocks along the rows, padded for the RHT).
                let (folded, _) = fp8_gemm::fold_rows::<B>(self.tensor.clone());
                let tensor = burn_te::gemm::nvfp4::operand_layout::<B>(folded, plan)?;
                let scaling = Scaling::Nvfp4 {
                    tile: plan.tile,
                    rounding: plan.rounding,
                    rht: plan.rht,
                    amax_group: None,
                };
                B::fp8_stats_launch(tensor, Some((Fp8Format::E4M3, scaling)))?
            }
        };
        Ok(PendingStats(Box::new(move || {
            Ok(B::fp8_stats_read(pending)?)
        })))
    }

    fn launch_error_stats(
        &self,
        reference: &dyn DebugTensor,
    ) -> Result<(PendingStats, PendingStats), DebugError> {
        let mismatch = |reason: String| DebugError::Feature {
            layer: self.site.layer.to_string(),
            feature: "error stats".into(),
            tensor: TensorName::output_of(self.site.gemm).to_string(),
            reason,
        };
        let Some(reference) = reference.as_any().downcast_ref::<SiteTensor<B>>() else {
            return Err(mismatch(
                "the reference is a tensor of another backend".into(),
            ));
        };
        let (shape, reference_shape) = (self.shape(), reference.shape());
        if shape != reference_shape {
            return Err(mismatch(format!(
                "an output of shape {shape:?} cannot be compared with a reference of shape {reference_shape:?}"
            )));
        }
        let difference = B::float_sub(self.tensor.clone(), reference.tensor.clone());
        let launch = |tensor| -> Result<PendingStats, DebugError> {
            let pending = B::fp8_stats_launch(tensor, None)?;
            Ok(PendingStats(Box::new(move || {
                Ok(B::fp8_stats_read(pending)?)
            })))
        };
        Ok((launch(reference.tensor.clone())?, launch(difference)?))
    }

    fn fake_quant(
        &self,
        format: Fp8Format,
        margin: f32,
    ) -> Result<Box<dyn DebugTensor>, DebugError> {
        let tensor = B::fp8_fake_quant(self.tensor.clone(), format, margin)?;
        Ok(Box::new(self.with(tensor)))
    }

    fn fake_quant_blocks(
        &self,
        format: Fp8Format,
        block: ScaleBlock,
        rule: BlockScaleRule,
    ) -> Result<Box<dyn DebugTensor>, DebugError> {
        let quantized =
            B::fp8_quantize(self.tensor.clone(), format, Scaling::Block { block, rule })?;
        Ok(Box::new(self.with(B::fp8_dequantize(quantized)?)))
    }

    fn fake_quant_nvfp4(
        &self,
        plan: burn_te::gemm::nvfp4::Nvfp4Plan,
    ) -> Result<Box<dyn DebugTensor>, DebugError> {
        let shape = self.tensor.shape();
        let (folded, _) = fp8_gemm::fold_rows::<B>(self.tensor.clone());
        let (tensor, transposed) = burn_te::gemm::nvfp4::quantize::<B>(folded, plan, None)?;
        let values = fp8_gemm::QuantizedOperand::<B> { tensor, transposed }.dequantize(shape)?;
        Ok(Box::new(self.with(values)))
    }

    fn launch_max_block_dynamic_range(
        &self,
        block: ScaleBlock,
    ) -> Result<PendingValue, DebugError> {
        let range = B::fp8_max_block_dynamic_range(self.tensor.clone(), block)?;
        Ok(PendingValue(Box::new(move || {
            let values = read_floats::<B>(range)?;
            Ok(values.first().map_or(0.0, |v| f64::from(*v)))
        })))
    }

    fn delayed_state(&self) -> Result<Option<(Vec<f32>, f32)>, DebugError> {
        match self.layer_delayed_state()? {
            Some(state) => Ok(Some(B::fp8_delayed_state_read(&state)?)),
            None => Ok(None),
        }
    }

    fn to_vec(&self) -> Result<Vec<f32>, DebugError> {
        read_floats::<B>(self.tensor.clone())
    }

    fn quantized(&self) -> Result<Option<Quantized>, DebugError> {
        let (Some(recipe), Some(role)) = (&self.recipe, self.role) else {
            return Ok(None);
        };
        // TE dumps the rowwise quantization.
        let k_along_cols = role.rowwise_k_along_cols();
        let quantized = fp8_gemm::quantize_operand::<B>(
            self.tensor.clone(),
            recipe,
            &self.site,
            role,
            k_along_cols,
            false,
            None,
        )?;
        let quantized = quantized.tensor;
        let host = B::fp8_read(&quantized)?;
        Ok(Some(Quantized {
            shape: quantized.shape.as_slice().to_vec(),
            format: quantized.format,
            codes: host.codes,
            scale_inv: host.scale_inv,
            block: quantized.block,
            nvfp4: host.nvfp4,
        }))
    }

    fn recipe(&self) -> Option<Recipe> {
        self.recipe.clone()
    }

    fn role(&self) -> Option<TensorRole> {
        self.role
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// Reads a float tensor's values to the host (a sync point).
fn read_floats<B: TeBackend>(tensor: FloatTensor<B>) -> Result<Vec<f32>, DebugError> {
    let data = burn_te_kernels::cubecl::future::block_on(B::float_into_data(tensor))
        .map_err(|err| burn_te::TeError::Read(format!("{err:?}")))?;
    data.convert::<f32>()
        .into_vec::<f32>()
        .map_err(|err| burn_te::TeError::Read(format!("{err:?}")).into())
}

/// The high-precision tensor of an operand a feature needs it for (inspecting or modifying it): a kept FP8 operand
/// is dequantized (the forward keeps the original when a feature will modify it).
pub(crate) fn values_for_features<B: TeBackend>(
    site: &GemmSite,
    operand: &SavedOperand<B>,
) -> Option<FloatTensor<B>> {
    match burn_te::gemm::saved::values::<B>(operand.clone()) {
        Ok(values) => Some(values),
        Err(err) => {
            burn_te::fallback::record(
                "debug feature error",
                format!("{site}: a kept operand could not be read for the features: {err}"),
            );
            None
        }
    }
}

/// An operand as TE's `inspect_tensor_postquantize` sees it: as the GEMM quantizes it (dequantized: the values the
/// FP8 GEMM multiplies; for an operand the forward kept quantized, those values), or as `modify_tensor` returned it
/// (`modified`). `None` for an operand the GEMM takes in high precision unmodified (TE: "if none of the fp8 cast or
/// modify_tensor is invoked"), and for one that could not be quantized (recorded as a fallback).
pub(crate) fn postquantized<B: TeBackend>(
    site: &GemmSite,
    fp8: Option<&Recipe>,
    role: TensorRole,
    operand: &SavedOperand<B>,
    current_margin: Option<f32>,
    modified: bool,
) -> Option<SiteTensor<B>> {
    let quantized = match (fp8, operand) {
        (_, Saved::HighPrecision(operand)) if modified => Ok(operand.clone()),
        (None, _) => return None,
        (Some(_), Saved::Quantized(_)) => burn_te::gemm::saved::values::<B>(operand.clone()),
        (Some(recipe), Saved::HighPrecision(operand)) => {
            let shape = operand.shape();
            fp8_gemm::quantize_operand::<B>(
                operand.clone(),
                recipe,
                site,
                role,
                fp8_gemm::k_along_cols(site.gemm, role),
                false,
                current_margin,
            )
            .and_then(|quantized| quantized.dequantize(shape))
        }
    };
    match quantized {
        Ok(values) => Some(SiteTensor::new(values, site, Some(role), fp8)),
        Err(err) => {
            let tensor = TensorName::from(role);
            burn_te::fallback::record(
                "debug feature error",
                format!("{site}: {tensor} not quantized for inspect_tensor_postquantize: {err}"),
            );
            None
        }
    }
}
