//! Run the features: one tensor of a GEMM through the layer's features, without the session's lock. In: the
//! layer's features and the tensor; out: a modification ([`modify`]), or what the inspecting features produced
//! ([`Ran`]), which [`Ran::collect`] hands on under the lock: log lines and dumps to the log, statistics launched
//! into the step's buffers.

use burn_te::GemmSite;

use crate::error::DebugError;
use crate::feature::{DebugTensor, Feature, Inspection, Modified};
use crate::pipeline::log::Log;
use crate::pipeline::reduce::StatBuffers;
use crate::pipeline::route::LayerFeatures;
use crate::stats::StatRequest;
use crate::tensor::TensorName;

/// What inspecting features produced, for [`Ran::collect`].
#[derive(Default)]
pub(crate) struct Ran {
    inspection: Inspection,
    calls: Vec<String>,
    errors: Vec<String>,
}

/// Runs the features that inspect `tensor` in high precision (TE's `inspect_tensor`).
pub(crate) fn inspect_tensor(
    layer: &LayerFeatures,
    site: &GemmSite,
    tensor: TensorName,
    x: &dyn DebugTensor,
) -> Ran {
    let name = &*site.layer;
    inspect(
        layer,
        site,
        tensor,
        "inspect_tensor",
        |f, iteration, out| {
            f.inspect_tensor_enabled(name, tensor, iteration)
                .is_some_and(|r| r.enabled)
                .then(|| f.inspect_tensor(name, tensor, x, iteration, out))
        },
    )
}

/// Runs the features that inspect `tensor` as its GEMM quantized it (TE's `inspect_tensor_postquantize`).
pub(crate) fn inspect_postquantize(
    layer: &LayerFeatures,
    site: &GemmSite,
    tensor: TensorName,
    x: &dyn DebugTensor,
) -> Ran {
    let (name, gemm) = (&*site.layer, site.gemm);
    let api = format!("inspect_tensor_postquantize, gemm {}", gemm.name());
    inspect(layer, site, tensor, &api, |f, iteration, out| {
        f.inspect_tensor_postquantize_enabled(name, gemm, tensor, iteration)
            .is_some_and(|r| r.enabled)
            .then(|| f.inspect_tensor_postquantize(name, gemm, tensor, x, iteration, out))
    })
}

/// Runs the features that measure the error of `site`'s GEMM: `output` against `reference`.
pub(crate) fn inspect_gemm_error(
    layer: &LayerFeatures,
    site: &GemmSite,
    output: &dyn DebugTensor,
    reference: &dyn DebugTensor,
) -> Ran {
    let (name, gemm) = (&*site.layer, site.gemm);
    let tensor = TensorName::output_of(gemm);
    let api = format!("inspect_gemm_error, gemm {}", gemm.name());
    inspect(layer, site, tensor, &api, |f, iteration, out| {
        f.gemm_error_enabled(name, gemm, iteration)
            .is_some_and(|r| r.enabled)
            .then(|| f.inspect_gemm_error(name, gemm, output, reference, iteration, out))
    })
}

/// Runs the features that compare `site`'s GEMM under the candidate `recipe` (its result `output`).
pub(crate) fn inspect_gemm_candidate(
    layer: &LayerFeatures,
    site: &GemmSite,
    recipe: &str,
    output: &dyn DebugTensor,
    reference: &dyn DebugTensor,
) -> Ran {
    let (name, gemm) = (&*site.layer, site.gemm);
    let tensor = TensorName::output_of(gemm);
    let api = format!(
        "inspect_gemm_candidate, gemm {}, recipe {recipe}",
        gemm.name()
    );
    inspect(layer, site, tensor, &api, |f, iteration, out| {
        let on = f
            .gemm_error_enabled(name, gemm, iteration)
            .is_some_and(|r| r.enabled)
            && f.gemm_candidates(name, gemm, iteration)
                .iter()
                .any(|c| c == recipe);
        on.then(|| f.inspect_gemm_candidate(name, gemm, recipe, output, reference, iteration, out))
    })
}

/// Runs the features that inspect `tensor` through `call` (`None`: the feature is not on for it), named `api` in
/// the main log.
fn inspect(
    layer: &LayerFeatures,
    site: &GemmSite,
    tensor: TensorName,
    api: &str,
    call: impl Fn(&dyn Feature, u64, &mut Inspection) -> Option<Result<(), DebugError>>,
) -> Ran {
    let mut ran = Ran::default();
    for feature in layer.features() {
        let span = tracing::info_span!(
            "debug_feature",
            label = %format_args!("{}:{}", feature.name(), api),
            layer = %site.layer,
            tensor = %tensor
        );
        let _entered = span.enter();
        if let Some(result) = call(feature.as_ref(), layer.iteration, &mut ran.inspection) {
            ran.calls.push(format!(
                "{}: Feature={}, API={api}: {tensor}",
                site.layer,
                feature.name()
            ));
            if let Err(err) = result {
                ran.errors.push(err.to_string());
            }
        }
    }
    ran
}

/// Runs `feature` on an input of `site`'s GEMM (TE's `modify_tensor`): its result, and the call's line for the
/// main log.
pub(crate) fn modify(
    feature: &dyn Feature,
    site: &GemmSite,
    tensor: TensorName,
    x: &dyn DebugTensor,
    iteration: u64,
) -> (Result<Modified, DebugError>, String) {
    let span = tracing::info_span!(
        "debug_feature",
        label = %format_args!("{}:modify_tensor", feature.name()),
        layer = %site.layer,
        tensor = %tensor
    );
    let result =
        span.in_scope(|| feature.modify_tensor(&site.layer, site.gemm, tensor, x, iteration));
    let call = format!(
        "{}: Feature={}, API=modify_tensor: {tensor}, gemm {}",
        site.layer,
        feature.name(),
        site.gemm.name()
    );
    (result, call)
}

impl Ran {
    /// Hands on what the features of `tensor` produced: their calls, errors and messages to the main log, their
    /// dumps to files, their statistics launched into `buffers` (read at `step()`); `x` is the tensor, with its
    /// high-precision reference for a GEMM output whose error is measured.
    pub(crate) fn collect(
        self,
        site: &GemmSite,
        tensor: TensorName,
        (x, reference): (&dyn DebugTensor, Option<&dyn DebugTensor>),
        iteration: u64,
        buffers: &mut StatBuffers,
        log: &mut Log,
    ) {
        let layer = site.layer.clone();
        let Ran {
            mut inspection,
            calls,
            errors,
        } = self;
        for call in calls {
            log.once(call);
        }
        for error in errors {
            tracing::error!("{error}");
            let _ = log.main(&error);
        }
        for message in std::mem::take(&mut inspection.messages) {
            let _ = log.main(&format!("{layer}: {message}"));
        }
        for dump in std::mem::take(&mut inspection.dumps) {
            log.dump(&layer, tensor, iteration, dump);
        }
        for request in merge_requests(inspection.requests) {
            if tensor == TensorName::Weight && buffers.has(&layer, tensor, &request) {
                continue;
            }
            if let Err(err) = buffers.launch(&layer, tensor, &request, x) {
                let message = format!("{layer}: statistics of {tensor} not possible: {err}");
                tracing::warn!("{message}");
                let _ = log.main(&message);
            }
        }
        for request in std::mem::take(&mut inspection.error_requests) {
            let launched = match reference {
                Some(reference) => x.launch_error_stats(reference),
                None => Err(DebugError::Feature {
                    layer: layer.to_string(),
                    feature: "error stats".into(),
                    tensor: tensor.to_string(),
                    reason: "requested outside inspect_gemm_error (no reference)".into(),
                }),
            };
            match launched {
                Ok((reference, difference)) => {
                    buffers.add_error(&layer, tensor, &request, reference, difference)
                }
                Err(err) => {
                    let message =
                        format!("{layer}: error statistics of {tensor} not possible: {err}");
                    tracing::warn!("{message}");
                    let _ = log.main(&message);
                }
            }
        }
        for (name, value) in inspection.scalars {
            buffers.add_scalar(name, value);
        }
    }
}

/// One launch per stat-name prefix and suffix: a quantized launch also gives the high-precision stats, so an
/// unprefixed LogTensorStats and LogFp8TensorStats share one.
fn merge_requests(requests: Vec<StatRequest>) -> Vec<StatRequest> {
    let mut merged: Vec<StatRequest> = Vec::new();
    for request in requests {
        match merged
            .iter_mut()
            .find(|r| r.prefix == request.prefix && r.suffix == request.suffix)
        {
            Some(existing) => {
                if existing.quantization.is_none() {
                    existing.quantization = request.quantization;
                }
                for stat in request.stats {
                    if !existing.stats.contains(&stat) {
                        existing.stats.push(stat);
                    }
                }
            }
            None => merged.push(request),
        }
    }
    merged
}
