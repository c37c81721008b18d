//! Route: a GEMM to its layer's features. In: the GEMM's site, the config and the iteration; out: the layer's
//! features ([`LayerFeatures`], run without the session's lock) and the GEMM's [`GemmPlan`] (what the decorator
//! does), combined from the features' routing calls (TE's `*_enabled`). The [`Router`] keeps each layer's section
//! and skips a GEMM with no active feature until the next iteration at which one may act.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn_te::{Gemm, GemmSite};

use crate::config::Config;
use crate::error::DebugError;
use crate::feature::Feature;
use crate::pipeline::log::Log;
use crate::routing::merge_routing;
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
    /// The recipes features compare the GEMM under (by plan name, each once).
    pub(crate) candidates: Vec<String>,
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
            candidates: Vec::new(),
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

    /// Whether the GEMM needs its high-precision operands: it runs in high precision, modifies an operand or
    /// measures its error.
    fn needs_original(&self) -> bool {
        !self.fp8 || self.modify.iter().any(Option::is_some) || self.error
    }
}

/// A GEMM's routing: its plan, with the next iteration at which it may change.
pub(crate) type Routed = Result<(GemmPlan, Option<u64>), DebugError>;

/// A layer's features as of now, taken from the session under its lock and run without it.
pub(crate) struct LayerFeatures {
    config: Option<Arc<Config>>,
    section: Option<usize>,
    pub(crate) iteration: u64,
}

impl LayerFeatures {
    pub(crate) fn features(&self) -> &[Box<dyn Feature>] {
        match (&self.config, self.section) {
            (Some(config), Some(section)) => &config.sections[section].features,
            _ => &[],
        }
    }
}

/// The routing of `site`'s GEMM by the layer's features, with the layer's plan lines at fprop.
pub(crate) fn plan(
    layer: &LayerFeatures,
    site: &GemmSite,
    fp8_scope: bool,
) -> (Routed, Option<Vec<String>>) {
    let features = layer.features();
    let lines =
        (site.gemm == Gemm::Fprop).then(|| plan_lines(features, site, fp8_scope, layer.iteration));
    (route(features, site, layer.iteration), lines)
}

/// Whether the features need `site`'s high-precision operands at its GEMM of this iteration; a routing error
/// counts as yes.
pub(crate) fn needs_original(layer: &LayerFeatures, site: &GemmSite) -> bool {
    match route(layer.features(), site, layer.iteration) {
        Ok((plan, _)) => plan.needs_original(),
        Err(_) => true,
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
fn route(features: &[Box<dyn Feature>], site: &GemmSite, iteration: u64) -> Routed {
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
    let mut candidates: Vec<String> = Vec::new();
    for feature in features {
        if feature
            .gemm_error_enabled(layer, gemm, iteration)
            .is_some_and(|r| r.enabled)
        {
            for name in feature.gemm_candidates(layer, gemm, iteration) {
                if !candidates.contains(&name) {
                    candidates.push(name);
                }
            }
        }
    }
    let plan = GemmPlan {
        fp8: fp8.is_none_or(|r| r.enabled),
        modify,
        postquantize,
        inspect,
        error: error.is_some_and(|r| r.enabled),
        candidates,
    };
    let next = merge_routing(answers).and_then(|r| r.next);
    Ok((plan, next))
}

/// The layer's per-tensor plan lines (TE's "Tensor: activation, gemm fprop - FP8 quantization"), asked at fprop.
fn plan_lines(
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

/// A layer's routing state.
struct LayerRoute {
    section: Option<usize>,
    /// Per GEMM (and whether it is the first use of the gradient): the first iteration at which routing must be
    /// asked again.
    skip_until: BTreeMap<(Gemm, bool), u64>,
    plan_lines: Vec<String>,
}

/// The config's routing of a session's layers: each layer's section (looked up at its first GEMM), when its GEMMs
/// are asked again, and its plan lines as last logged.
pub(crate) struct Router {
    config: Option<Arc<Config>>,
    layers: BTreeMap<Arc<str>, LayerRoute>,
    /// The first config error found while routing this step's GEMMs (TE raises it at the forward; the GEMM cannot
    /// fail here, so it runs without the features and `step()` returns the error).
    failed: Option<DebugError>,
}

impl Router {
    pub(crate) fn new(config: Option<Arc<Config>>) -> Router {
        Router {
            config,
            layers: BTreeMap::new(),
            failed: None,
        }
    }

    /// The first routing error since the last call, for the `step()` that ends the iteration.
    pub(crate) fn take_failure(&mut self) -> Option<DebugError> {
        self.failed.take()
    }

    /// The config (`None`: a session without one).
    pub(crate) fn config(&self) -> Option<&Arc<Config>> {
        self.config.as_ref()
    }

    fn layer(&mut self, site: &GemmSite, log: &mut Log) -> &mut LayerRoute {
        if !self.layers.contains_key(&site.layer) {
            let section = match &self.config {
                None => None,
                Some(config) => match config.section_for(&site.layer, site.kind) {
                    Ok(found) => found.map(|s| {
                        config
                            .sections
                            .iter()
                            .position(|x| x.name == s.name)
                            .unwrap_or(0)
                    }),
                    Err(err) => {
                        let message = format!(
                            "{err}; the layer runs without debug features, and step() returns this error"
                        );
                        tracing::error!("{message}");
                        let _ = log.main(&message);
                        self.failed.get_or_insert(err.into());
                        None
                    }
                },
            };
            self.layers.insert(
                site.layer.clone(),
                LayerRoute {
                    section,
                    skip_until: BTreeMap::new(),
                    plan_lines: Vec::new(),
                },
            );
        }
        self.layers.get_mut(&site.layer).expect("inserted above")
    }

    /// The layer's features at `iteration`, for use without the lock.
    pub(crate) fn layer_features(
        &mut self,
        site: &GemmSite,
        iteration: u64,
        log: &mut Log,
    ) -> LayerFeatures {
        let section = self.layer(site, log).section;
        LayerFeatures {
            config: self.config.clone(),
            section,
            iteration,
        }
    }

    /// Whether the GEMM takes the plain path until a later iteration (its features said so).
    pub(crate) fn skipping(&mut self, site: &GemmSite, iteration: u64, log: &mut Log) -> bool {
        self.layer(site, log)
            .skip_until
            .get(&(site.gemm, site.first_use_of_gradient()))
            .is_some_and(|&until| iteration < until)
    }

    /// Logs the plan lines when they change, and keeps the plan if any feature acts (else skips the GEMM until the
    /// next iteration at which one may).
    pub(crate) fn settle(
        &mut self,
        site: &GemmSite,
        routed: Routed,
        lines: Option<Vec<String>>,
        log: &mut Log,
    ) -> Option<GemmPlan> {
        if let Some(lines) = lines
            && self.layer(site, log).plan_lines != lines
        {
            for line in &lines {
                let _ = log.main(line);
            }
            self.layer(site, log).plan_lines = lines;
        }
        let (plan, next) = match routed {
            Ok(routed) => routed,
            Err(err) => {
                let message =
                    format!("{err}; the GEMM runs unmodified, and step() returns this error");
                tracing::error!("{message}");
                let _ = log.main(&message);
                self.failed.get_or_insert(err);
                return None;
            }
        };
        if plan.active() {
            Some(plan)
        } else {
            let until = next.unwrap_or(u64::MAX);
            self.layer(site, log)
                .skip_until
                .insert((site.gemm, site.first_use_of_gradient()), until);
            None
        }
    }

    /// Asks every GEMM again at its next call (the iteration was set).
    pub(crate) fn restart(&mut self) {
        for layer in self.layers.values_mut() {
            layer.skip_until.clear();
        }
    }
}
