//! `Debug<B>`: the backend decorator that runs the config's features on every GEMM.
//!
//! It intercepts the three GEMMs of every layer: the TE modules' `te_linear` (fprop) and, under `Autodiff`, its
//! dgrad and wgrad, each with its [`GemmSite`]; and plain Burn `linear`s, named `linear0`, `linear1`, ... by
//! weight in call order inside an autocast scope (as `Te<B>` names them, see [`burn_te::plain_linear`]). Plain `float_matmul` (e.g. attention's batched matmuls)
//! is not a layer GEMM and forwards unchanged. Every other op forwards to `B` through the forwarding written once
//! for `Te<B>`. Use as `Autodiff<Debug<Te<B>>>`.
//!
//! A layer with no active feature takes the plain path and is not asked again until the next iteration at which a
//! feature may be on.

use core::any::Any;
use core::marker::PhantomData;

use burn::tensor::TensorMetadata;
use burn::tensor::ops::FloatTensor;
use burn_te::backend::TeBackend;
use burn_te::fp8_gemm::{self, CurrentScalingOverrides, SavedForBackward};
use burn_te::saved::{Saved, SavedOperand};
use burn_te::{
    BlockScaleRule, Decorator, Fp8Format, Gemm, GemmSite, Recipe, ScaleBlock, Scaling, TensorRole,
    plain_linear_backward, plain_linear_forward,
};

use crate::error::DebugError;
use crate::features::{DebugTensor, Modified, PendingStats, PendingValue, Quantized, StatsScaling};
use crate::session;
use crate::tensor::TensorName;

/// The debug backend decorator. Use as `Autodiff<Debug<Te<Wgpu>>>`.
#[derive(Clone, Copy, Default, Debug)]
pub struct Debug<B>(PhantomData<B>);

impl<B: TeBackend> Decorator for Debug<B> {
    type Inner = B;

    fn name(device: &B::Device) -> String {
        format!("debug<{}>", B::name(device))
    }

    fn linear(
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        bias: Option<FloatTensor<B>>,
    ) -> FloatTensor<B> {
        let (recipe, site) = plain_linear_forward::<B>(&x, &weight);
        <Self as TeBackend>::te_linear(x, weight, bias, &site, recipe.as_ref())
    }

    fn linear_x_backward(weight: FloatTensor<B>, output_grad: FloatTensor<B>) -> FloatTensor<B> {
        let (recipe, site) = plain_linear_backward::<B>(Gemm::Dgrad, &weight, &output_grad);
        let weight = Saved::HighPrecision(weight);
        <Self as TeBackend>::te_linear_dgrad(weight, output_grad, &site, recipe.as_ref())
    }

    fn linear_weight_backward(x: FloatTensor<B>, output_grad: FloatTensor<B>) -> FloatTensor<B> {
        let (recipe, site) = plain_linear_backward::<B>(Gemm::Wgrad, &x, &output_grad);
        <Self as TeBackend>::te_linear_wgrad(
            Saved::HighPrecision(x),
            output_grad,
            &site,
            recipe.as_ref(),
        )
    }
}

burn_te::forward_backend!(Debug);
#[cfg(feature = "ddp")]
burn_te::forward_distributed_backend!(Debug);

/// A GEMM operand or output as the features see it.
struct SiteTensor<B: TeBackend> {
    tensor: FloatTensor<B>,
    site: GemmSite,
    role: Option<TensorRole>,
    recipe: Option<Recipe>,
}

impl<B: TeBackend> SiteTensor<B> {
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
                let tensor = burn_te::nvfp4::operand_layout::<B>(folded, plan)?;
                let scaling = Scaling::Nvfp4 {
                    tile: plan.tile,
                    rounding: plan.rounding,
                    rht: plan.rht,
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
        plan: burn_te::nvfp4::Nvfp4Plan,
    ) -> Result<Box<dyn DebugTensor>, DebugError> {
        let shape = self.tensor.shape();
        let (folded, _) = fp8_gemm::fold_rows::<B>(self.tensor.clone());
        let (tensor, transposed) = burn_te::nvfp4::quantize::<B>(folded, plan)?;
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
/// is dequantized (the forward keeps the original when a feature will modify it, see
/// [`session::backward_needs_original`]).
fn values_for_features<B: TeBackend>(
    site: &GemmSite,
    operand: &SavedOperand<B>,
) -> Option<FloatTensor<B>> {
    match burn_te::saved::values::<B>(operand.clone()) {
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

/// One GEMM through the debug features: inspect the inputs, modify them, inspect them as the GEMM quantizes them,
/// run the GEMM in FP8 or high precision (`run(operands, recipe, overrides)`), inspect the output, and measure
/// its error against the high-precision GEMM of the operands as they came (with `bias` at fprop). An operand the
/// forward kept quantized is inspected as the values the GEMM multiplies.
fn debug_gemm<B: TeBackend>(
    site: &GemmSite,
    recipe: Option<&Recipe>,
    bias: Option<&FloatTensor<B>>,
    operands: [SavedOperand<B>; 2],
    run: impl FnOnce([SavedOperand<B>; 2], Option<&Recipe>, CurrentScalingOverrides) -> FloatTensor<B>,
) -> FloatTensor<B> {
    if !session::active() {
        return run(operands, recipe, [None, None]);
    }
    let Some(plan) = session::plan(site, recipe.is_some()) else {
        return run(operands, recipe, [None, None]);
    };
    let (lhs, rhs) = site.gemm.operands();
    let view = |tensor: FloatTensor<B>, role: Option<TensorRole>| SiteTensor::<B> {
        tensor,
        site: site.clone(),
        role,
        recipe: recipe.cloned(),
    };
    // The reference's operands, before any quantization or modification (a kept FP8 operand, e.g. a micro-batch's
    // cached weight, counts as its values).
    let originals = if plan.error {
        let [lhs, rhs] = &operands;
        values_for_features::<B>(site, lhs).zip(values_for_features::<B>(site, rhs))
    } else {
        None
    };
    let mut operands = operands;
    let mut overrides = [None, None];
    let mut modified = [false, false];
    let mut high_precision = !plan.fp8 || recipe.is_none();
    for (slot, role) in [lhs, rhs].into_iter().enumerate() {
        let tensor = TensorName::from(role);
        let (inspected, feature) = (plan.inspect.contains(&tensor), plan.modify[slot]);
        if !inspected && feature.is_none() {
            continue;
        }
        let Some(values) = values_for_features::<B>(site, &operands[slot]) else {
            continue;
        };
        let input = view(values, Some(role));
        if inspected {
            session::inspect(site, tensor, &input);
        }
        let Some(feature) = feature else {
            continue;
        };
        match session::modify(site, feature, tensor, &input) {
            Ok(Modified::CurrentScaling { margin }) => overrides[slot] = Some(margin),
            Ok(Modified::HighPrecision(tensor_out)) => {
                match tensor_out.into_any().downcast::<SiteTensor<B>>() {
                    Ok(tensor_out) => {
                        operands[slot] = Saved::HighPrecision(tensor_out.tensor);
                        modified[slot] = true;
                        high_precision = true;
                    }
                    Err(_) => burn_te::fallback::record(
                        "debug feature error",
                        format!(
                            "{site}: modify_tensor returned a tensor of another backend; the {tensor} is used unmodified"
                        ),
                    ),
                }
            }
            Err(err) => burn_te::fallback::record(
                "debug feature error",
                format!(
                    "{site}: modify_tensor of {tensor} failed, the {tensor} is used unmodified: {err}"
                ),
            ),
        }
    }
    let fp8 = if high_precision { None } else { recipe };
    if high_precision {
        // The GEMM runs in high precision: an operand kept quantized runs as the values it holds.
        for operand in &mut operands {
            if operand.is_quantized()
                && let Some(values) = values_for_features::<B>(site, operand)
            {
                *operand = Saved::HighPrecision(values);
            }
        }
    }
    for (slot, role) in [lhs, rhs].into_iter().enumerate() {
        if plan.postquantize[slot] {
            postquantize::<B>(
                site,
                fp8,
                role,
                &operands[slot],
                overrides[slot],
                modified[slot],
            );
        }
    }
    let output = run(operands, fp8, overrides);
    let out_name = TensorName::output_of(site.gemm);
    if plan.inspect.contains(&out_name) {
        let output_view = view(output.clone(), None);
        session::inspect(site, out_name, &output_view);
    }
    if let Some((lhs, rhs)) = originals {
        let reference = B::te_reference_gemm(site.gemm, lhs, rhs, bias.cloned());
        let (output_view, reference) = (view(output.clone(), None), view(reference, None));
        session::inspect_gemm_error(site, &output_view, &reference);
    }
    output
}

/// TE's `inspect_tensor_postquantize`: the features see the operand as the GEMM quantizes it (dequantized: the
/// values the FP8 GEMM multiplies; for an operand the forward kept quantized, those values), or as modified by
/// `modify_tensor`; not called for an operand the GEMM takes in high precision unmodified (TE: "if none of the fp8
/// cast or modify_tensor is invoked").
fn postquantize<B: TeBackend>(
    site: &GemmSite,
    fp8: Option<&Recipe>,
    role: TensorRole,
    operand: &SavedOperand<B>,
    current_margin: Option<f32>,
    modified: bool,
) {
    let tensor = TensorName::from(role);
    let quantized = match (fp8, operand) {
        (_, Saved::HighPrecision(operand)) if modified => Ok(operand.clone()),
        (None, _) => return,
        (Some(_), Saved::Quantized(_)) => burn_te::saved::values::<B>(operand.clone()),
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
        Ok(values) => {
            let view = SiteTensor::<B> {
                tensor: values,
                site: site.clone(),
                role: Some(role),
                recipe: fp8.cloned(),
            };
            session::inspect_postquantize(site, tensor, &view);
        }
        Err(err) => burn_te::fallback::record(
            "debug feature error",
            format!("{site}: {tensor} not quantized for inspect_tensor_postquantize: {err}"),
        ),
    }
}

/// Runs an FP8 GEMM with per-operand current-scaling overrides (observed by the diagnostics as `Te<B>` observes
/// its GEMMs), or the inner backend's own op without any.
fn with_overrides<B: TeBackend>(
    site: &GemmSite,
    recipe: Option<&Recipe>,
    overrides: CurrentScalingOverrides,
    operands: [SavedOperand<B>; 2],
    fp8: impl FnOnce(&Recipe, [SavedOperand<B>; 2]) -> Result<FloatTensor<B>, burn_te::TeError>,
    plain: impl FnOnce(Option<&Recipe>, [SavedOperand<B>; 2]) -> FloatTensor<B>,
) -> FloatTensor<B> {
    match recipe {
        Some(recipe) if overrides.iter().any(Option::is_some) => {
            burn_te::diagnostics::observe_gemm::<B>(site, Some(recipe), operands, |operands| {
                let result = fp8(recipe, operands.clone());
                fp8_gemm::or_high_precision::<B>(site, result, || {
                    let [lhs, rhs] =
                        operands.map(|operand| burn_te::saved::values_or_panic::<B>(site, operand));
                    plain(None, [Saved::HighPrecision(lhs), Saved::HighPrecision(rhs)])
                })
            })
        }
        recipe => plain(recipe, operands),
    }
}

impl<B: TeBackend> TeBackend for Debug<B> {
    burn_te::forward_fp8_ops!(B);

    fn te_linear_fprop(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        site: &GemmSite,
        recipe: Option<&Recipe>,
        save: [bool; 2],
    ) -> (FloatTensor<Self>, SavedForBackward<Self::Fp8Data>) {
        // The operands a feature will need in high precision at the backward are not kept quantized.
        let save = [
            save[0] && !session::backward_needs_original(site, Gemm::Wgrad),
            save[1] && !session::backward_needs_original(site, Gemm::Dgrad),
        ];
        let saved = core::cell::RefCell::new([None, None]);
        let operands = [Saved::HighPrecision(x), Saved::HighPrecision(weight)];
        let output = debug_gemm::<B>(
            site,
            recipe,
            bias.as_ref(),
            operands,
            |operands, recipe, overrides| {
                with_overrides::<B>(
                    site,
                    recipe,
                    overrides,
                    operands,
                    |r, operands| {
                        let [x, w] = operands
                            .map(|operand| burn_te::saved::values_or_panic::<B>(site, operand));
                        let fprop = fp8_gemm::linear_fprop::<B>(
                            x,
                            w,
                            bias.clone(),
                            site,
                            r,
                            overrides,
                            save,
                        );
                        fprop.map(|(output, kept)| {
                            *saved.borrow_mut() = kept;
                            output
                        })
                    },
                    |r, operands| {
                        let [x, w] = operands
                            .map(|operand| burn_te::saved::values_or_panic::<B>(site, operand));
                        let (output, kept) = B::te_linear_fprop(x, w, bias.clone(), site, r, save);
                        *saved.borrow_mut() = kept;
                        output
                    },
                )
            },
        );
        (output, saved.into_inner())
    }

    fn te_linear_dgrad(
        weight: SavedOperand<Self>,
        grad: FloatTensor<Self>,
        site: &GemmSite,
        recipe: Option<&Recipe>,
    ) -> FloatTensor<Self> {
        let operands = [Saved::HighPrecision(grad), weight];
        debug_gemm::<B>(
            site,
            recipe,
            None,
            operands,
            |operands, recipe, overrides| {
                with_overrides::<B>(
                    site,
                    recipe,
                    overrides,
                    operands,
                    |r, [g, w]| {
                        let g = burn_te::saved::values_or_panic::<B>(site, g);
                        fp8_gemm::linear_dgrad::<B>(w, g, site, r, overrides)
                    },
                    |r, [g, w]| {
                        let g = burn_te::saved::values_or_panic::<B>(site, g);
                        B::te_linear_dgrad(w, g, site, r)
                    },
                )
            },
        )
    }

    fn te_linear_wgrad(
        x: SavedOperand<Self>,
        grad: FloatTensor<Self>,
        site: &GemmSite,
        recipe: Option<&Recipe>,
    ) -> FloatTensor<Self> {
        let operands = [x, Saved::HighPrecision(grad)];
        debug_gemm::<B>(
            site,
            recipe,
            None,
            operands,
            |operands, recipe, overrides| {
                with_overrides::<B>(
                    site,
                    recipe,
                    overrides,
                    operands,
                    |r, [x, g]| {
                        let g = burn_te::saved::values_or_panic::<B>(site, g);
                        fp8_gemm::linear_wgrad::<B>(x, g, site, r, overrides)
                    },
                    |r, [x, g]| {
                        let g = burn_te::saved::values_or_panic::<B>(site, g);
                        B::te_linear_wgrad(x, g, site, r)
                    },
                )
            },
        )
    }
}
