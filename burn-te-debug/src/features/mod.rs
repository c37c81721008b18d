//! Features: what a config section runs on its layers, each built from its config entry. The built-in features
//! have one file each and are registered under TE's names; the [`Feature`] trait they implement is TE's call API.

pub(crate) mod advisor_probe;
mod disable_fp8_gemm;
mod disable_fp8_layer;
mod dump_tensors;
mod fake_quant;
mod log_fp8_tensor_stats;
mod log_nvfp4_tensor_stats;
mod log_quantization_error;
pub(crate) mod log_recipe_candidates;
mod log_tensor_stats;
mod per_tensor_scaling;
mod registry;

use burn_te::Gemm;

pub use advisor_probe::AdvisorProbe;
pub use disable_fp8_gemm::DisableFp8Gemm;
pub use disable_fp8_layer::DisableFp8Layer;
pub use dump_tensors::DumpTensors;
pub use fake_quant::FakeQuant;
pub use log_fp8_tensor_stats::LogFp8TensorStats;
pub use log_nvfp4_tensor_stats::LogNvfp4TensorStats;
pub use log_quantization_error::LogQuantizationError;
pub use log_recipe_candidates::LogRecipeCandidates;
pub use log_tensor_stats::LogTensorStats;
pub use per_tensor_scaling::PerTensorScaling;
pub use registry::{FeatureFactory, register_feature};

// The call API and the types it uses, under this module's public paths.
pub use crate::config::Namespace;
pub use crate::feature::{DebugTensor, Feature, Inspection, Modified};
pub use crate::quantized::Quantized;
pub use crate::routing::{Routing, merge_routing};
pub use crate::stats::{PendingStats, PendingValue, StatsScaling};

use crate::config::Schedule;
use crate::error::DebugError;
use crate::stats::Stat;
use crate::tensor::TensorName;

/// A feature's per-tensor schedules and what it does at each (the shape of the logging and dump features'
/// config): the routing answer of a tensor and the entries due at an iteration.
pub struct Scheduled<T>(pub Vec<(TensorName, Schedule, T)>);

impl<T> Scheduled<T> {
    /// Whether `tensor` is due at `iteration`, and its next due iteration (`None`: no entry for it).
    pub fn routing(&self, tensor: TensorName, iteration: u64) -> Option<Routing> {
        let schedules = self.0.iter().filter(|e| e.0 == tensor);
        Schedule::routing(schedules.map(|(_, schedule, _)| schedule), iteration)
    }

    /// Every entry with its tensor, whatever the schedule.
    pub fn entries(&self) -> impl Iterator<Item = (TensorName, &T)> {
        self.0.iter().map(|(tensor, _, what)| (*tensor, what))
    }

    /// The entries of `tensor` due at `iteration`.
    pub fn due(&self, tensor: TensorName, iteration: u64) -> impl Iterator<Item = &T> {
        self.0
            .iter()
            .filter(move |(t, schedule, _)| *t == tensor && schedule.runs_at(iteration))
            .map(|(_, _, what)| what)
    }
}

impl Scheduled<Vec<Stat>> {
    /// `logged_stats` of a feature whose entries are stat lists: each stat of each tensor under `prefix`.
    pub fn logged_stats(&self, prefix: &str) -> Vec<(TensorName, String)> {
        self.entries()
            .flat_map(|(tensor, stats)| {
                stats
                    .iter()
                    .map(move |stat| (tensor, stat.logged_name(prefix, "")))
            })
            .collect()
    }
}

/// A modifying feature's per-(gemm, tensor) settings (the shape of PerTensorScaling's and FakeQuant's config).
pub struct PerGemmTensor<T>(pub Vec<(Gemm, TensorName, T)>);

impl<T> PerGemmTensor<T> {
    /// The setting of `tensor` as an input of `gemm`, if configured.
    pub fn get(&self, gemm: Gemm, tensor: TensorName) -> Option<&T> {
        self.0
            .iter()
            .find(|(g, t, _)| *g == gemm && *t == tensor)
            .map(|(_, _, setting)| setting)
    }

    /// `modify_tensor_enabled`'s answer: on at every iteration for a configured (gemm, tensor).
    pub fn modify_routing(
        &self,
        gemm: Gemm,
        tensor: TensorName,
        iteration: u64,
    ) -> Option<Routing> {
        self.get(gemm, tensor)
            .map(|_| Routing::always(true, iteration))
    }

    /// The setting `modify_tensor` was called for; an error naming the feature if it is not configured.
    pub fn setting(
        &self,
        feature: &str,
        layer: &str,
        gemm: Gemm,
        tensor: TensorName,
    ) -> Result<&T, DebugError> {
        self.get(gemm, tensor).ok_or_else(|| DebugError::Feature {
            layer: layer.into(),
            feature: feature.into(),
            tensor: format!("{tensor} (gemm {})", gemm.name()),
            reason: "not configured for this tensor".into(),
        })
    }
}
