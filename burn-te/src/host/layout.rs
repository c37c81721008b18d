//! [`TeBackend::te_reshape`](crate::TeBackend::te_reshape) and
//! [`TeBackend::te_slice_assign`](crate::TeBackend::te_slice_assign) on Flex: a strided view that has to be copied
//! (a permuted attention context reshaped for its projection, a permuted gradient written into a packed one) is
//! copied by [`burn_te_kernels::host::strided`] on every core, where Flex's own copy walks it one element at a
//! time on one thread.

use burn::backend::flex::FlexTensor;
use burn::backend::flex::ops::slice::slice_assign;
use burn::tensor::{DType, Shape, Slice, TensorData};
use burn_te_kernels::host::strided::{StridedView, contiguous};

use crate::metrics::{count_launch, names};

/// An f32 view's values in row-major order, copied on the pool; `None` for another dtype or a negative stride (a
/// flipped view), which Flex copies itself.
pub(super) fn strided_values(tensor: &FlexTensor) -> Option<Vec<f32>> {
    if tensor.dtype() != DType::F32 {
        return None;
    }
    let layout = tensor.layout();
    let strides: Vec<usize> = layout
        .strides()
        .iter()
        .map(|&s| usize::try_from(s).ok())
        .collect::<Option<_>>()?;
    let values = contiguous(StridedView {
        values: tensor.storage::<f32>(),
        offset: layout.start_offset(),
        shape: layout.shape().as_slice(),
        strides: &strides,
    })?;
    count_launch(names::HOST_LAYOUT_COPIES);
    Some(values)
}

/// A row-major copy of a strided f32 view, or `None` where there is nothing to copy (a contiguous tensor, a
/// broadcast of one element, which Flex's ops read without a copy) or Flex copies it itself.
fn copied(tensor: &FlexTensor) -> Option<FlexTensor> {
    let layout = tensor.layout();
    if tensor.is_contiguous() || layout.strides().iter().all(|&s| s == 0) {
        return None;
    }
    let shape = layout.shape().as_slice().to_vec();
    let values = strided_values(tensor)?;
    Some(FlexTensor::from_data(TensorData::new(values, shape)))
}

/// Flex's reshape, with the copy of a view that cannot be reshaped in place made on every core (Flex reshapes
/// contiguous views itself, which [`copied`] leaves to it).
pub(super) fn flex_reshape(tensor: FlexTensor, shape: Shape) -> FlexTensor {
    match copied(&tensor) {
        Some(copy) => copy.reshape(shape),
        None => tensor.reshape(shape),
    }
}

/// Flex's slice assign, with a strided `value` made contiguous on every core first.
pub(super) fn flex_slice_assign(
    tensor: FlexTensor,
    slices: &[Slice],
    value: FlexTensor,
) -> FlexTensor {
    let value = copied(&value).unwrap_or(value);
    slice_assign(tensor, slices, value)
}
