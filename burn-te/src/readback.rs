//! Reading a float tensor's values to the host (a blocking device read), for the few host decisions the FP8 ops
//! make on device values.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Shape, Tensor, TensorMetadata, TensorPrimitive};

use crate::error::TeError;

/// `tensor`'s values as `f32`, row-major; `what` names it in the error.
pub(crate) fn read_f32<B: Backend>(
    tensor: FloatTensor<B>,
    what: &str,
) -> Result<Vec<f32>, TeError> {
    let len = tensor.shape().num_elements();
    let flat = B::float_reshape(tensor, Shape::new([len]));
    let data = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(flat))
        .cast(FloatDType::F32)
        .try_into_data()
        .map_err(|err| TeError::Read(format!("{what}: {err:?}")))?;
    crate::metrics::count_read((len * size_of::<f32>()) as u64);
    data.to_vec::<f32>()
        .map_err(|err| TeError::Read(format!("{what}: {err:?}")))
}
