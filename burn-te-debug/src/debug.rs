//! `Debug<B>`: the backend decorator that runs the config's features on every GEMM.
//!
//! It intercepts the three GEMMs of every layer: the TE modules' `te_linear` (fprop) and, under `Autodiff`, its
//! dgrad and wgrad, each with its [`GemmSite`]; and plain Burn `linear`s, named `linear0`, `linear1`, ... by
//! weight in call order inside an autocast scope (as `Te<B>` names them, see [`burn_te::gemm::plain_linear`]). Plain `float_matmul` (e.g. attention's batched matmuls)
//! is not a layer GEMM and forwards unchanged. Every other op forwards to `B` through the forwarding written once
//! for `Te<B>`. Use as `Autodiff<Debug<Te<B>>>`.
//!
//! A layer with no active feature takes the plain path and is not asked again until the next iteration at which a
//! feature may be on. Otherwise the GEMM goes through the session's entry points (its plan, then the features on
//! each of its tensors), with its tensors as the pipeline's observe stage shows them to the features.

use core::marker::PhantomData;

use burn::tensor::ops::FloatTensor;
use burn_te::backend::TeBackend;
use burn_te::gemm::fp8::{self as fp8_gemm, CurrentScalingOverrides, SavedForBackward};
use burn_te::gemm::saved::{Saved, SavedOperand};
use burn_te::{
    Decorator, Gemm, GemmSite, Recipe, TensorRole, plain_linear_backward, plain_linear_forward,
};

use crate::feature::Modified;
use crate::pipeline::observe::{self, SiteTensor, values_for_features};
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
    let view = |tensor: FloatTensor<B>, role: Option<TensorRole>| {
        SiteTensor::<B>::new(tensor, site, role, recipe)
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
                match SiteTensor::<B>::from_feature(tensor_out) {
                    Some(tensor_out) => {
                        operands[slot] = Saved::HighPrecision(tensor_out);
                        modified[slot] = true;
                        high_precision = true;
                    }
                    None => burn_te::fallback::record(
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
        if plan.postquantize[slot]
            && let Some(view) = observe::postquantized::<B>(
                site,
                fp8,
                role,
                &operands[slot],
                overrides[slot],
                modified[slot],
            )
        {
            session::inspect_postquantize(site, TensorName::from(role), &view);
        }
    }
    let output = run(operands, fp8, overrides);
    let out_name = TensorName::output_of(site.gemm);
    if plan.inspect.contains(&out_name) {
        let output_view = view(output.clone(), None);
        session::inspect(site, out_name, &output_view);
    }
    if let Some((lhs, rhs)) = originals {
        let reference = B::te_reference_gemm(site, lhs.clone(), rhs.clone(), bias.cloned());
        let (output_view, reference) = (view(output.clone(), None), view(reference, None));
        session::inspect_gemm_error(site, &output_view, &reference);
        for name in &plan.candidates {
            inspect_candidate::<B>(site, recipe, name, [&lhs, &rhs], bias, &reference);
        }
    }
    output
}

/// Runs `site`'s GEMM under the candidate recipe `name` on the operands as they came and has the features
/// compare it with `reference`; a candidate that cannot run is a counted fallback, named in the main log.
fn inspect_candidate<B: TeBackend>(
    site: &GemmSite,
    recipe: Option<&Recipe>,
    name: &str,
    [lhs, rhs]: [&FloatTensor<B>; 2],
    bias: Option<&FloatTensor<B>>,
    reference: &SiteTensor<B>,
) {
    let base = recipe.cloned().unwrap_or_default();
    let candidate = burn_te::plan::recipe_named(name, None, &base)
        .map_err(|(_, reason)| burn_te::TeError::InvalidRecipe(reason))
        .and_then(|candidate| {
            let candidate = candidate.ok_or_else(|| {
                burn_te::TeError::InvalidRecipe("high_precision is no candidate".into())
            })?;
            let output = fp8_gemm::candidate_gemm::<B>(
                site.gemm,
                lhs.clone(),
                rhs.clone(),
                bias.cloned(),
                site,
                &candidate,
            )?;
            Ok((candidate, output))
        });
    match candidate {
        Ok((candidate, output)) => {
            let view = SiteTensor::<B>::new(output, site, None, Some(&candidate));
            session::inspect_gemm_candidate(site, name, &view, reference);
        }
        Err(err) => burn_te::fallback::record(
            "debug feature error",
            format!("{site}: candidate recipe {name} not measured: {err}"),
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
                    let [lhs, rhs] = operands
                        .map(|operand| burn_te::gemm::saved::values_or_panic::<B>(site, operand));
                    plain(None, [Saved::HighPrecision(lhs), Saved::HighPrecision(rhs)])
                })
            })
        }
        recipe => plain(recipe, operands),
    }
}

impl<B: TeBackend> TeBackend for Debug<B> {
    // Each expert's GEMM through this decorator's own layer GEMMs, so that every feature applies per expert.
    burn_te::te_linear_gemms!(grouped_in_turn);
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
                        let [x, w] = operands.map(|operand| {
                            burn_te::gemm::saved::values_or_panic::<B>(site, operand)
                        });
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
                        let [x, w] = operands.map(|operand| {
                            burn_te::gemm::saved::values_or_panic::<B>(site, operand)
                        });
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
                        let g = burn_te::gemm::saved::values_or_panic::<B>(site, g);
                        fp8_gemm::linear_dgrad::<B>(w, g, site, r, overrides)
                    },
                    |r, [g, w]| {
                        let g = burn_te::gemm::saved::values_or_panic::<B>(site, g);
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
                        let g = burn_te::gemm::saved::values_or_panic::<B>(site, g);
                        fp8_gemm::linear_wgrad::<B>(x, g, site, r, overrides)
                    },
                    |r, [x, g]| {
                        let g = burn_te::gemm::saved::values_or_panic::<B>(site, g);
                        B::te_linear_wgrad(x, g, site, r)
                    },
                )
            },
        )
    }
}
