//! A feature as the debug path calls it (TE's call API): the [`Feature`] trait, the [`DebugTensor`]s it is called
//! with, what it records ([`Inspection`]) and what a modification returns ([`Modified`]).

use std::any::Any;

use burn_te::{BlockScaleRule, Fp8Format, Gemm, Recipe, ScaleBlock, TensorRole};

use crate::dump::TensorDump;
use crate::error::DebugError;
use crate::quantized::Quantized;
use crate::routing::Routing;
use crate::stats::{PendingStats, PendingValue, StatRequest, StatsScaling};
use crate::tensor::TensorName;

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
        plan: burn_te::gemm::nvfp4::Nvfp4Plan,
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

    /// Writes a dump file of the inspected tensor (see the `DumpTensors` feature for the layout).
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

    /// The recipes (by their plan names, e.g. `mxfp8`) this feature compares `gemm` under, where
    /// [`gemm_error_enabled`](Self::gemm_error_enabled) is on (ours; default: none): the decorator runs the GEMM
    /// under each on its operands as they came (a name of the GEMM's own recipe kind takes that recipe's settings)
    /// and calls [`inspect_gemm_candidate`](Self::inspect_gemm_candidate) with the result.
    fn gemm_candidates(&self, _layer: &str, _gemm: Gemm, _iteration: u64) -> Vec<String> {
        Vec::new()
    }

    /// Inspects `output`, `gemm` run under the candidate `recipe`, against `reference` (as
    /// [`inspect_gemm_error`](Self::inspect_gemm_error) does the GEMM's own output).
    #[allow(clippy::too_many_arguments)]
    fn inspect_gemm_candidate(
        &self,
        _layer: &str,
        _gemm: Gemm,
        _recipe: &str,
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
