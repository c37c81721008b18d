//! Per-tensor quantization (current and delayed scaling) of a host tensor read at its strides: a permuted attention
//! operand (`q`, `v`, `dO` as `[b, h, s, d]` views of `[b, s, h, d]` storage) is encoded where it lies, run by run
//! ([`burn_te_kernels::host::strided::quantized`]), without first copying it into a row-major buffer. Views whose
//! runs of adjacent elements are too short (a transposed view) are copied first, counted as `HostLayoutCopies`.

use burn_te_kernels::host::pool::OutputValues;
use burn_te_kernels::host::strided::{self, StridedView};
use burn_te_kernels::{Fp8Format, pow2_margin, scale_from_amax};

use super::attention::{Strided, contiguous_strides};
use super::{HostDelayedState, lock};
use crate::error::TeError;
use crate::metrics::{count_launch, names};

/// Current scaling: the codes and `scale_inv` of `x` at TE's current scale, `fp8_max / amax / 2^margin`.
pub(super) fn current(
    x: &Strided,
    format: Fp8Format,
    margin: f32,
) -> Result<(Vec<u8>, f32), TeError> {
    let margin = pow2_margin(margin)?;
    read(x, |view| {
        let amax = strided::amax(view)?;
        let scale = scale_from_amax(amax, 1.0, format, margin);
        let (codes, _) = strided::quantized(view, scale, format, false)?;
        Some((codes, 1.0 / scale))
    })
}

/// Delayed scaling: the codes and `scale_inv` of `x` at the state's scale, recording `x`'s amax into its history
/// with `record`.
pub(super) fn delayed(
    x: &Strided,
    format: Fp8Format,
    state: &HostDelayedState,
    record: bool,
) -> Result<(Vec<u8>, f32), TeError> {
    let mut history = lock(state);
    let (codes, amax) = read(x, |view| {
        strided::quantized(view, history.scale, format, record)
    })?;
    if record {
        history.record(amax);
    }
    Ok((codes, history.scale_inv))
}

/// `quantize` on `x`'s view where it can be read in place, else on a row-major copy of it; an error where the view
/// reaches outside its values.
fn read<T>(x: &Strided, quantize: impl Fn(StridedView<'_>) -> Option<T>) -> Result<T, TeError> {
    let shape = x.shape.as_slice();
    let view = StridedView {
        values: &x.values,
        offset: x.offset,
        shape,
        strides: &x.strides,
    };
    if let Some(done) = quantize(view) {
        return Ok(done);
    }
    let outside = || {
        TeError::Read(format!(
            "a view of shape {shape:?} with strides {:?} at offset {} reads outside its {} values",
            x.strides,
            x.offset,
            x.values.len()
        ))
    };
    let copy: OutputValues = strided::contiguous(view).ok_or_else(outside)?;
    count_launch(names::HOST_LAYOUT_COPIES);
    let strides = contiguous_strides(shape);
    let view = StridedView {
        values: &copy,
        offset: 0,
        shape,
        strides: &strides,
    };
    quantize(view).ok_or_else(outside)
}
