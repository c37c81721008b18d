//! Features: what a config section runs on its layers. The [`Feature`] trait is TE's call API; the built-in
//! features have one file each and are registered under TE's names.

mod disable_fp8_gemm;
mod disable_fp8_layer;
mod dump_tensors;
mod fake_quant;
mod log_fp8_tensor_stats;
mod log_nvfp4_tensor_stats;
mod log_quantization_error;
mod log_tensor_stats;
mod per_tensor_scaling;
mod registry;

use std::any::Any;

use burn_te::{
    BlockScaleRule, ElementFormat, Fp8Format, Fp8Stats, Gemm, Nvfp4Scales, Recipe, ScaleBlock,
    TensorRole,
};

pub use disable_fp8_gemm::DisableFp8Gemm;
pub use disable_fp8_layer::DisableFp8Layer;
pub use dump_tensors::DumpTensors;
pub use fake_quant::FakeQuant;
pub use log_fp8_tensor_stats::LogFp8TensorStats;
pub use log_nvfp4_tensor_stats::LogNvfp4TensorStats;
pub use log_quantization_error::LogQuantizationError;
pub use log_tensor_stats::LogTensorStats;
pub use per_tensor_scaling::PerTensorScaling;
pub(crate) use registry::build_feature;
pub use registry::{FeatureFactory, Namespace, register_feature};

use crate::config::Schedule;
use crate::dump::TensorDump;
use crate::error::DebugError;
use crate::stats::StatRequest;
use crate::tensor::TensorName;

/// A routing answer: whether the call is on at this iteration, and the next iteration at which it may be
/// (`None`: never again). A layer whose answers are all off skips the debug path until the smallest `next`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routing {
    /// On at this iteration.
    pub enabled: bool,
    /// The next iteration at which it may be on.
    pub next: Option<u64>,
}

impl Routing {
    /// On now and at every later iteration.
    pub fn always(enabled: bool, iteration: u64) -> Routing {
        Routing {
            enabled,
            next: Some(iteration + 1),
        }
    }
}

/// How a modified tensor enters its GEMM.
pub enum Modified {
    /// A high-precision tensor (e.g. fake-quantized); the GEMM runs in high precision.
    HighPrecision(Box<dyn DebugTensor>),
    /// Quantize the tensor with a per-tensor current scale (`fp8_max / amax / 2^margin`); the GEMM stays in FP8.
    CurrentScaling {
        /// TE's margin.
        margin: f32,
    },
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
    Nvfp4(burn_te::nvfp4::Nvfp4Plan),
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

/// A tensor quantized as its GEMM quantizes it, on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct Quantized {
    /// The shape as quantized: the tensor's, or its transpose's where the recipe quantizes the transpose (NVFP4's
    /// 1×16 blocks of a weight, which this crate stores `[in, out]`, laid along `in` as TE lays them).
    pub shape: Vec<usize>,
    /// The element format.
    pub format: ElementFormat,
    /// The codes, one per element, row-major.
    pub codes: Vec<u8>,
    /// `scale_inv`: one, or one per block (row-major over the block grid); NVFP4: each block's dequantization
    /// factor.
    pub scale_inv: Vec<f32>,
    /// The scale block (None: one scale for the tensor).
    pub block: Option<ScaleBlock>,
    /// NVFP4's E4M3 block scales and global amax.
    pub nvfp4: Option<Nvfp4Scales>,
}

/// A tensor of a GEMM as features see it, whatever the backend: statistics and FP8 ops run on its device.
pub trait DebugTensor: Send {
    /// The tensor's shape.
    fn shape(&self) -> Vec<usize>;
    /// One-pass statistics launched on the device; with `quantization`, also the FP8 counts of quantizing it.
    fn launch_stats(
        &self,
        quantization: Option<(Fp8Format, StatsScaling)>,
    ) -> Result<PendingStats, DebugError>;
    /// The statistics of `reference` and of `self − reference` (same shape and backend), launched on the device:
    /// what the error stats of a GEMM output are computed from.
    fn launch_error_stats(
        &self,
        reference: &dyn DebugTensor,
    ) -> Result<(PendingStats, PendingStats), DebugError>;
    /// The largest per-block dynamic range over blocks of `block` (see
    /// [`TeBackend::fp8_max_block_dynamic_range`](burn_te::TeBackend::fp8_max_block_dynamic_range)), launched on the
    /// device.
    fn launch_max_block_dynamic_range(&self, block: ScaleBlock)
    -> Result<PendingValue, DebugError>;
    /// Quantize-dequantize with a per-tensor current scale.
    fn fake_quant(
        &self,
        format: Fp8Format,
        margin: f32,
    ) -> Result<Box<dyn DebugTensor>, DebugError>;
    /// Quantize-dequantize with one scale per `block` from the block's amax by `rule` (e.g. MXFP8's 1×32 E8M0).
    fn fake_quant_blocks(
        &self,
        format: Fp8Format,
        block: ScaleBlock,
        rule: BlockScaleRule,
    ) -> Result<Box<dyn DebugTensor>, DebugError>;
    /// Quantize-dequantize to NVFP4 by `plan` (its blocks, transposition and rounding; the values come back in the
    /// tensor's own layout).
    fn fake_quant_nvfp4(
        &self,
        plan: burn_te::nvfp4::Nvfp4Plan,
    ) -> Result<Box<dyn DebugTensor>, DebugError>;
    /// The layer's delayed-scaling `(amax history in TE's layout, scale)` for this tensor as its GEMM uses them this
    /// iteration (reads the device); `None` without a DelayedScaling scope or a role.
    fn delayed_state(&self) -> Result<Option<(Vec<f32>, f32)>, DebugError>;
    /// The values, row-major (reads the device: a sync point).
    fn to_vec(&self) -> Result<Vec<f32>, DebugError>;
    /// The tensor quantized with its GEMM's recipe, format and blocks (a delayed-scaling scale is used, not
    /// updated), read to the host (a sync point); `None` for a GEMM output or outside an FP8 scope.
    fn quantized(&self) -> Result<Option<Quantized>, DebugError>;
    /// The GEMM's recipe (None outside an FP8 scope).
    fn recipe(&self) -> Option<Recipe>;
    /// The tensor's GEMM-input role (None for a GEMM output).
    fn role(&self) -> Option<TensorRole>;
    /// For downcasting to the backend's tensor.
    fn as_any(&self) -> &dyn Any;
    /// For downcasting to the backend's tensor, by value.
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

/// What `inspect_tensor` records: statistics (launched once per tensor for all features, read and logged at the
/// next `step()`) and host values.
#[derive(Default)]
pub struct Inspection {
    pub(crate) requests: Vec<StatRequest>,
    pub(crate) error_requests: Vec<StatRequest>,
    pub(crate) scalars: Vec<(String, f64)>,
    pub(crate) dumps: Vec<TensorDump>,
    pub(crate) messages: Vec<String>,
}

impl Inspection {
    /// Logs `value` as `name` at this iteration (TE's `MetricLogger.log_scalar`).
    pub fn log_scalar(&mut self, name: impl Into<String>, value: f64) {
        self.scalars.push((name.into(), value));
    }

    /// Writes a dump file of the inspected tensor (see [`DumpTensors`] for the layout).
    pub fn dump(&mut self, dump: TensorDump) {
        self.dumps.push(dump);
    }

    /// Writes `message` to the main log, prefixed with the layer, after the feature returns (a feature may also
    /// call [`crate::log_message`]: features never run under the session's lock).
    pub fn log_message(&mut self, message: impl Into<String>) {
        self.messages.push(message.into());
    }

    /// Asks for statistics of the inspected tensor, logged as `<layer>_<tensor>_<prefix><stat>` at `step()`.
    pub fn request_stats(&mut self, request: StatRequest) {
        self.requests.push(request);
    }

    /// Asks for error stats ([`Stat::ERROR`](crate::stats::Stat::ERROR)) of an inspected GEMM output against its
    /// high-precision reference, logged as `<layer>_<output tensor>_<prefix><stat>` at `step()`.
    pub fn request_error_stats(&mut self, request: StatRequest) {
        self.error_requests.push(request);
    }
}

/// A debug feature: TE's call API. Every method has TE's default; a feature implements what it does.
///
/// Routing calls return `None` when the feature has nothing to say about the call (its config does not cover
/// it); several answers combine as TE does: enabled if any is, next iteration the smallest.
pub trait Feature: Send + Sync {
    /// The feature's name in logs.
    fn name(&self) -> &str;

    /// The stats this feature logs on the layers of its section, as `(tensor, stat name with prefix and suffix)`
    /// (default: none); dashboards register them before training (see [`crate::stat_names`]).
    fn logged_stats(&self) -> Vec<(TensorName, String)> {
        Vec::new()
    }

    /// Whether `gemm` of `layer` runs in FP8 (TE's default: yes).
    fn fp8_gemm_enabled(&self, _layer: &str, _gemm: Gemm, _iteration: u64) -> Option<Routing> {
        None
    }

    /// Whether this feature modifies `tensor` as an input of `gemm` (default: no).
    fn modify_tensor_enabled(
        &self,
        _layer: &str,
        _gemm: Gemm,
        _tensor: TensorName,
        _iteration: u64,
    ) -> Option<Routing> {
        None
    }

    /// Modifies `tensor` as an input of `gemm`; called when `modify_tensor_enabled` said so.
    fn modify_tensor(
        &self,
        layer: &str,
        gemm: Gemm,
        tensor: TensorName,
        _x: &dyn DebugTensor,
        _iteration: u64,
    ) -> Result<Modified, DebugError> {
        Err(DebugError::Feature {
            layer: layer.into(),
            feature: self.name().into(),
            tensor: format!("{tensor} (gemm {})", gemm.name()),
            reason: "modify_tensor_enabled is on but modify_tensor is not implemented".into(),
        })
    }

    /// Whether this feature inspects `tensor` in high precision (default: no).
    fn inspect_tensor_enabled(
        &self,
        _layer: &str,
        _tensor: TensorName,
        _iteration: u64,
    ) -> Option<Routing> {
        None
    }

    /// Inspects `tensor` in high precision.
    fn inspect_tensor(
        &self,
        _layer: &str,
        _tensor: TensorName,
        _x: &dyn DebugTensor,
        _iteration: u64,
        _out: &mut Inspection,
    ) -> Result<(), DebugError> {
        Ok(())
    }

    /// Whether this feature measures the error of `gemm`'s output (default: no). When on, the decorator also runs
    /// the GEMM in high precision on its operands as they came, before any quantization or `modify_tensor`, and
    /// calls [`inspect_gemm_error`](Self::inspect_gemm_error) (ours; TE has no such call).
    fn gemm_error_enabled(&self, _layer: &str, _gemm: Gemm, _iteration: u64) -> Option<Routing> {
        None
    }

    /// Inspects `gemm`'s output `output` (as the GEMM computed it: FP8, or high precision where a feature disabled
    /// FP8) against `reference`, the high-precision GEMM of the operands before quantization (e.g. with
    /// [`Inspection::request_error_stats`]).
    fn inspect_gemm_error(
        &self,
        _layer: &str,
        _gemm: Gemm,
        _output: &dyn DebugTensor,
        _reference: &dyn DebugTensor,
        _iteration: u64,
        _out: &mut Inspection,
    ) -> Result<(), DebugError> {
        Ok(())
    }

    /// Whether this feature inspects `tensor` after quantization for `gemm` (TE's older per-GEMM call; default: no).
    /// Asked at every GEMM that takes the tensor as an input.
    fn inspect_tensor_postquantize_enabled(
        &self,
        _layer: &str,
        _gemm: Gemm,
        _tensor: TensorName,
        _iteration: u64,
    ) -> Option<Routing> {
        None
    }

    /// Inspects `tensor` as `gemm` quantized it: `x` holds the dequantized values the FP8 GEMM multiplies (its
    /// recipe, scale, blocks and any `modify_tensor` current-scaling override), or the tensor a `modify_tensor`
    /// returned. Not called when the GEMM takes the tensor in high precision unmodified (as in TE).
    fn inspect_tensor_postquantize(
        &self,
        _layer: &str,
        _gemm: Gemm,
        _tensor: TensorName,
        _x: &dyn DebugTensor,
        _iteration: u64,
        _out: &mut Inspection,
    ) -> Result<(), DebugError> {
        Ok(())
    }
}

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

impl Scheduled<Vec<crate::stats::Stat>> {
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

/// Combines routing answers as TE does: any enabled, smallest next iteration; `None` if nobody answered.
pub fn merge_routing(answers: impl IntoIterator<Item = Routing>) -> Option<Routing> {
    answers.into_iter().fold(None, |acc, r| {
        Some(match acc {
            None => r,
            Some(a) => Routing {
                enabled: a.enabled || r.enabled,
                next: match (a.next, r.next) {
                    (Some(x), Some(y)) => Some(x.min(y)),
                    (x, y) => x.or(y),
                },
            },
        })
    })
}
