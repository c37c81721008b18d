//! The hooks `Te<B>` calls: every op (counted, checked in eager mode), every layer GEMM (span, execute time,
//! non-finite tracking, snapshots) and every transfer (count, bytes, read-back time).

use core::future::Future;
use std::cell::Cell;
use std::time::Instant;

use burn::tensor::TensorMetadata;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use super::{eager, flags, nonfinite, read_env, snapshot};
use crate::backend::TeBackend;
use crate::fp8_state::site::GemmSite;
use crate::gemm::saved::{Saved, SavedOperand};
use crate::metrics::{self, count_read, count_transfer, names};
use crate::recipe::Recipe;

thread_local! {
    /// Set by a layer GEMM that checked its own output (with its site), so that the op that issued it (Burn's
    /// `linear`) does not check it again; cleared when the next op starts.
    static GEMM_CHECKED: Cell<bool> = const { Cell::new(false) };
}

/// `Te<B>`'s [`Decorator::op_started`](crate::Decorator::op_started): counts the op; in eager mode, keeps its float
/// inputs for a snapshot of the op if its output is not finite.
#[inline]
pub fn op_started<B: Backend>(
    op: &'static str,
    inputs: &[&FloatTensor<B>],
) -> Option<Vec<FloatTensor<B>>> {
    metrics::count_op(op);
    read_env();
    if !flags().eager {
        return None;
    }
    GEMM_CHECKED.with(|c| c.set(false));
    Some(inputs.iter().map(|t| (*t).clone()).collect())
}

/// `Te<B>`'s [`Decorator::op_finished`](crate::Decorator::op_finished): in eager mode, syncs and checks the output.
#[inline]
pub fn op_finished<B: TeBackend>(
    op: &'static str,
    inputs: Option<Vec<FloatTensor<B>>>,
    output: &FloatTensor<B>,
) {
    if !flags().eager || GEMM_CHECKED.with(|c| c.replace(false)) {
        return;
    }
    eager::check::<B>(op, None, inputs.unwrap_or_default(), output);
}

/// Whether [`observe_gemm`] looks at each layer GEMM beyond its trace span (device time, eager checks, non-finite
/// tracking, snapshots): a grouped linear layer then runs its experts' GEMMs one at a time, each observed.
pub fn observes_each_gemm() -> bool {
    let flags = flags();
    flags.eager || flags.device_time || flags.track_non_finite || flags.snapshots
}

/// The trace span of the layer GEMM at `site` (`decoder.1.fc1.fprop`, with `layer` and `gemm` fields).
pub fn gemm_span(site: &GemmSite) -> tracing::Span {
    tracing::info_span!("gemm", label = %site, layer = %site.layer, gemm = %site.gemm.name())
}

/// Runs one layer GEMM at `site` (`run` issues it) under a `gemm` trace span: with `device_time` or in eager mode,
/// synced before and after to record `GemmExecuteTime`; with non-finite tracking, its operands and output get a
/// statistics pass read at [`step`](super::step); in eager mode its output is checked; held for a snapshot when
/// snapshots want it. An operand the forward kept quantized is seen as the values the GEMM multiplies
/// (dequantized only when one of these wants it).
pub fn observe_gemm<B: TeBackend>(
    site: &GemmSite,
    recipe: Option<&Recipe>,
    operands: [SavedOperand<B>; 2],
    run: impl FnOnce([SavedOperand<B>; 2]) -> FloatTensor<B>,
) -> FloatTensor<B> {
    read_env();
    let span = gemm_span(site);
    let _entered = span.enter();
    let eager = flags().eager;
    let timed = eager || flags().device_time;
    let track = flags().track_non_finite;
    let snapshots = flags().snapshots;
    let (lhs_role, rhs_role) = site.gemm.operands();
    // The operands' values, only when something looks at them (a clone keeps a buffer from being reused).
    let values = (track || eager || snapshots).then(|| {
        operands.clone().map(|operand| {
            crate::gemm::saved::values::<B>(operand).map_err(|err| {
                crate::fallback::record(
                    "diagnostics skipped",
                    format!("{site}: a kept operand could not be read for the diagnostics: {err}"),
                )
            })
        })
    });
    if let (true, Some([lhs, rhs])) = (track, &values) {
        if let Ok(lhs) = lhs {
            nonfinite::launch::<B>(site, Some(lhs_role), lhs);
        }
        if let Ok(rhs) = rhs {
            nonfinite::launch::<B>(site, Some(rhs_role), rhs);
        }
    }
    let device = timed.then(|| device_of::<B>(&operands)).flatten();
    let start = device.as_ref().map(|device| {
        let _ = B::sync(device);
        Instant::now()
    });
    let output = run(operands);
    if let (Some(device), Some(start)) = (device, start) {
        let synced = B::sync(&device);
        metrics::record_time(names::GEMM_EXECUTE_TIME, start.elapsed());
        if let Err(err) = synced {
            eager::device_error(&format!("{site}"), Some(site), &format!("{err:?}"));
        }
    }
    if track {
        nonfinite::launch::<B>(site, None, &output);
    }
    if let Some([Ok(lhs), Ok(rhs)]) = values.filter(|_| eager || snapshots) {
        if snapshots {
            let held = [(lhs_role, &lhs), (rhs_role, &rhs)];
            snapshot::hold::<B>(site, held, &output, recipe);
        }
        if eager {
            eager::check::<B>("te_linear", Some(site), vec![lhs, rhs], &output);
            GEMM_CHECKED.with(|c| c.set(true));
        }
    }
    output
}

/// The device of the GEMM's high-precision operand (fprop has two, dgrad and wgrad the gradient).
fn device_of<B: TeBackend>(operands: &[SavedOperand<B>; 2]) -> Option<B::Device> {
    operands.iter().find_map(|operand| match operand {
        Saved::HighPrecision(tensor) => Some(B::float_device(tensor)),
        Saved::Quantized(_) => None,
    })
}

/// The bytes a tensor holds.
pub fn tensor_bytes(tensor: &impl TensorMetadata) -> u64 {
    (tensor.shape().num_elements() * tensor.dtype().size()) as u64
}

/// Counts a device→host read of `bytes` and times it (from its first poll to its data).
pub fn count_transfer_from_device<F: Future + Send>(
    bytes: u64,
    read: F,
) -> impl Future<Output = F::Output> + Send {
    let on = metrics::enabled();
    if on {
        count_read(bytes);
    }
    async move {
        let start = Instant::now();
        let data = read.await;
        if on {
            metrics::record_time(names::READ_BACK_TIME, start.elapsed());
        }
        data
    }
}

/// Counts a host→device write of `bytes`.
pub fn count_transfer_to_device(bytes: u64) {
    if metrics::enabled() {
        count_transfer(
            [names::HOST_TO_DEVICE_WRITES, names::HOST_TO_DEVICE_BYTES],
            names::TRANSFER_TO_DEVICE_SIZE,
            bytes,
        );
    }
}
