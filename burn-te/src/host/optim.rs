//! [`TeBackend::te_adam_step`](crate::TeBackend::te_adam_step) on the host path: the Burn glue around
//! [`burn_te_kernels::host::optim`]. f32 parameters only; other dtypes answer `None` (the optimizer runs Burn's
//! `Adam`, which keeps the dtype).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorMetadata};
use burn_te_kernels::host::optim::{AdamOutput, AdamStep, adam_step};

use super::fused::Read;
use super::host_tensor;
use crate::error::TeError;

/// One fused Adam step of a host backend's parameter.
pub(super) fn te_adam_step<B: Backend>(
    read: Read<B>,
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    moments: Option<[FloatTensor<B>; 2]>,
    step: AdamStep,
) -> Result<Option<[FloatTensor<B>; 3]>, TeError> {
    let all_f32 = [Some(&param), Some(&grad)]
        .into_iter()
        .chain(moments.iter().flatten().map(Some))
        .flatten()
        .all(|t| t.dtype() == DType::F32);
    if !all_f32 {
        return Ok(None);
    }
    let device = B::float_device(&param);
    let (x, shape) = read(param)?;
    let (g, grad_shape) = read(grad)?;
    let moments = moments
        .map(|[m, v]| Ok::<_, TeError>([read(m)?, read(v)?]))
        .transpose()?;
    let shapes = std::iter::once(&grad_shape).chain(moments.iter().flatten().map(|(_, s)| s));
    if let Some(bad) = shapes.into_iter().find(|s| **s != shape) {
        return Err(TeError::ShapeMismatch {
            op: "te_adam",
            reason: "the gradient and both moments must have the parameter's shape".into(),
            lhs: shape.as_slice().to_vec(),
            rhs: bad.as_slice().to_vec(),
        });
    }
    let AdamOutput {
        param,
        moment_1,
        moment_2,
    } = adam_step(
        &x,
        &g,
        moments.as_ref().map(|[(m, _), (v, _)]| (&m[..], &v[..])),
        step,
    );
    Ok(Some([param, moment_1, moment_2].map(|values| {
        host_tensor::<B>(values, shape.clone(), &device)
    })))
}
