//! [`TeBackend::te_reshape`](crate::TeBackend::te_reshape),
//! [`TeBackend::te_slice_assign`](crate::TeBackend::te_slice_assign) and
//! [`TeBackend::te_cat`](crate::TeBackend::te_cat) on Flex: a strided view that has to be copied (a permuted
//! attention context reshaped for its projection, permuted gradients joined into a packed one) is copied by
//! [`burn_te_kernels::host::strided`] on every core, where Flex's own copy walks it one element at a time on one
//! thread.

use burn::backend::flex::FlexTensor;
use burn::backend::flex::ops::slice::slice_assign;
use burn::tensor::{DType, Shape, Slice};
use burn_te_kernels::host::pool::OutputValues;
use burn_te_kernels::host::strided::{StridedView, concatenated, contiguous};

use crate::metrics::{count_launch, names};

/// An f32 view's values in row-major order, copied on the pool; `None` for another dtype or a negative stride (a
/// flipped view), which Flex copies itself.
pub(super) fn strided_values(tensor: &FlexTensor) -> Option<OutputValues> {
    let strides = f32_strides(tensor)?;
    let values = contiguous(view(tensor, &strides))?;
    count_launch(names::HOST_LAYOUT_COPIES);
    Some(values)
}

/// Whether an f32 tensor is a transposed view: its last dimension strided and the one before it adjacent in memory
/// (both longer than one element), so that its transpose is read in place a run of columns at a time.
pub(super) fn transposed_view(tensor: &FlexTensor) -> bool {
    let layout = tensor.layout();
    let (shape, strides) = (layout.shape(), layout.strides());
    let n = shape.num_dims();
    tensor.dtype() == DType::F32
        && n >= 2
        && shape[n - 1] > 1
        && shape[n - 2] > 1
        && strides[n - 2] == 1
        && strides[n - 1] != 1
}

/// An f32 tensor's strides in elements; `None` for another dtype or a negative stride.
fn f32_strides(tensor: &FlexTensor) -> Option<Vec<usize>> {
    if tensor.dtype() != DType::F32 {
        return None;
    }
    tensor
        .layout()
        .strides()
        .iter()
        .map(|&s| usize::try_from(s).ok())
        .collect()
}

/// The kernel's view of an f32 tensor with `strides` ([`f32_strides`]).
fn view<'a>(tensor: &'a FlexTensor, strides: &'a [usize]) -> StridedView<'a> {
    let layout = tensor.layout();
    StridedView {
        values: tensor.storage::<f32>(),
        offset: layout.start_offset(),
        shape: layout.shape().as_slice(),
        strides,
    }
}

/// A row-major copy of a strided f32 view, or `None` where there is nothing to copy (a contiguous tensor, a
/// broadcast of one element, which Flex's ops read without a copy) or Flex copies it itself.
fn copied(tensor: &FlexTensor) -> Option<FlexTensor> {
    let layout = tensor.layout();
    if tensor.is_contiguous() || layout.strides().iter().all(|&s| s == 0) {
        return None;
    }
    let values = strided_values(tensor)?;
    Some(flex_tensor(values, layout.shape().clone()))
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

/// Flex's cat, with f32 tensors joined on every core (counted as one layout copy) unless the dimension is the
/// last, a tensor is flipped or they are contiguous and joined along the first dimension (one `memcpy` each in
/// Flex), which Flex does itself.
pub(super) fn flex_cat(tensors: Vec<FlexTensor>, dim: usize) -> FlexTensor {
    let flex = |tensors| burn::backend::flex::ops::cat::cat(tensors, dim);
    if tensors.len() < 2 || (dim == 0 && tensors.iter().all(FlexTensor::is_contiguous)) {
        return flex(tensors);
    }
    let Some(strides) = tensors.iter().map(f32_strides).collect::<Option<Vec<_>>>() else {
        return flex(tensors);
    };
    let views: Vec<StridedView<'_>> = tensors
        .iter()
        .zip(&strides)
        .map(|(t, s)| view(t, s))
        .collect();
    let Some(values) = concatenated(&views, dim) else {
        return flex(tensors);
    };
    count_launch(names::HOST_LAYOUT_COPIES);
    let mut shape = tensors[0].layout().shape().clone();
    shape[dim] = tensors.iter().map(|t| t.layout().shape()[dim]).sum();
    flex_tensor(values, shape)
}

/// A Flex tensor of `values` (a pooled buffer returns to the pool when it drops).
fn flex_tensor(values: OutputValues, shape: Shape) -> FlexTensor {
    super::host_tensor::<burn::backend::Flex>(values, shape, &Default::default())
}
