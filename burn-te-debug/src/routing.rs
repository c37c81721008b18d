//! Routing: what the features of a layer's section do at one GEMM (TE's `*_enabled` calls), combined into a
//! [`GemmPlan`]. Pure functions of the features and the iteration: the session calls them without its lock.

use burn_te::{Gemm, GemmSite};

use crate::error::DebugError;
use crate::features::{Feature, merge_routing};
use crate::tensor::TensorName;

/// What the decorator does for one GEMM call.
pub(crate) struct GemmPlan {
    pub(crate) fp8: bool,
    /// Per operand: the index of the feature that modifies it.
    pub(crate) modify: [Option<usize>; 2],
    /// Per operand: whether a feature inspects it as quantized for this GEMM.
    pub(crate) postquantize: [bool; 2],
    /// The tensors inspected at this GEMM (inputs first).
    pub(crate) inspect: Vec<TensorName>,
    /// Whether a feature measures the GEMM's error against its high-precision result.
    pub(crate) error: bool,
}

impl GemmPlan {
    /// A GEMM that no feature touches.
    pub(crate) fn untouched() -> GemmPlan {
        GemmPlan {
            fp8: true,
            modify: [None, None],
            postquantize: [false, false],
            inspect: Vec::new(),
            error: false,
        }
    }

    /// Whether any feature acts at this GEMM (otherwise it takes the plain path).
    pub(crate) fn active(&self) -> bool {
        !self.fp8
            || self.modify.iter().any(Option::is_some)
            || self.postquantize.iter().any(|&p| p)
            || !self.inspect.is_empty()
            || self.error
    }
}

/// The tensors inspected at a GEMM: the activation and weight at fprop; the layer's incoming gradient once per
/// backward, at the first backward GEMM that uses it (the dgrad, or the wgrad of a layer whose input needs no
/// gradient: see [`GemmSite::follows_dgrad`]), so frozen layers' gradients are seen too; and the GEMM's output.
pub(crate) fn inspected_at(site: &GemmSite) -> &'static [TensorName] {
    match site.gemm {
        Gemm::Fprop => &[
            TensorName::Activation,
            TensorName::Weight,
            TensorName::Output,
        ],
        Gemm::Dgrad => &[TensorName::Gradient, TensorName::Dgrad],
        Gemm::Wgrad if site.first_use_of_gradient() => &[TensorName::Gradient, TensorName::Wgrad],
        Gemm::Wgrad => &[TensorName::Wgrad],
    }
}

/// The routing of one GEMM by `features`: whether it runs in FP8, which inputs are modified, which are inspected
/// after quantization and which tensors are inspected; with the next iteration at which an answer may change.
pub(crate) fn route(
    features: &[Box<dyn Feature>],
    site: &GemmSite,
    iteration: u64,
) -> Result<(GemmPlan, Option<u64>), DebugError> {
    let (layer, gemm) = (&*site.layer, site.gemm);
    if features.is_empty() {
        return Ok((GemmPlan::untouched(), None));
    }
    let mut answers = Vec::new();
    let fp8 = merge_routing(
        features
            .iter()
            .filter_map(|f| f.fp8_gemm_enabled(layer, gemm, iteration)),
    );
    answers.extend(fp8);
    let (lhs, rhs) = gemm.operands();
    let mut modify = [None, None];
    let mut postquantize = [false, false];
    for (slot, role) in [lhs, rhs].into_iter().enumerate() {
        let tensor = TensorName::from(role);
        for (index, feature) in features.iter().enumerate() {
            if let Some(routing) = feature.modify_tensor_enabled(layer, gemm, tensor, iteration) {
                answers.push(routing);
                if routing.enabled {
                    if let Some(first) = modify[slot] {
                        let first: usize = first;
                        return Err(DebugError::ConflictingModify {
                            layer: layer.into(),
                            gemm: gemm.name().into(),
                            tensor: tensor.name().into(),
                            first: features[first].name().into(),
                            second: feature.name().into(),
                        });
                    }
                    modify[slot] = Some(index);
                }
            }
        }
        let routing =
            merge_routing(features.iter().filter_map(|f| {
                f.inspect_tensor_postquantize_enabled(layer, gemm, tensor, iteration)
            }));
        if let Some(routing) = routing {
            answers.push(routing);
            postquantize[slot] = routing.enabled;
        }
    }
    let mut inspect = Vec::new();
    for &tensor in inspected_at(site) {
        let routing = merge_routing(
            features
                .iter()
                .filter_map(|f| f.inspect_tensor_enabled(layer, tensor, iteration)),
        );
        if let Some(routing) = routing {
            answers.push(routing);
            if routing.enabled {
                inspect.push(tensor);
            }
        }
    }
    let error = merge_routing(
        features
            .iter()
            .filter_map(|f| f.gemm_error_enabled(layer, gemm, iteration)),
    );
    answers.extend(error);
    let plan = GemmPlan {
        fp8: fp8.is_none_or(|r| r.enabled),
        modify,
        postquantize,
        inspect,
        error: error.is_some_and(|r| r.enabled),
    };
    let next = merge_routing(answers).and_then(|r| r.next);
    Ok((plan, next))
}

/// The layer's per-tensor plan lines (TE's "Tensor: activation, gemm fprop - FP8 quantization"), asked at fprop.
pub(crate) fn plan_lines(
    features: &[Box<dyn Feature>],
    site: &GemmSite,
    fp8_scope: bool,
    iteration: u64,
) -> Vec<String> {
    let mut lines = Vec::new();
    for (tensor, gemms) in [
        (TensorName::Activation, [Gemm::Fprop, Gemm::Wgrad]),
        (TensorName::Weight, [Gemm::Fprop, Gemm::Dgrad]),
        (TensorName::Gradient, [Gemm::Dgrad, Gemm::Wgrad]),
    ] {
        for gemm in gemms {
            let routed = route(features, &site.with_gemm(gemm), iteration).ok();
            let slot = usize::from(Some(gemm.operands().1) == tensor.role());
            let how = match routed {
                Some((plan, _)) if plan.modify[slot].is_some() => "modify_tensor()",
                Some((plan, _)) if plan.fp8 && fp8_scope => "FP8 quantization",
                None if fp8_scope => "FP8 quantization",
                _ => "High precision",
            };
            lines.push(format!(
                "{}: Tensor: {tensor}, gemm {} - {how}",
                site.layer,
                gemm.name()
            ));
        }
    }
    lines
}
