//! [`TeBackend::te_adam_step`](crate::TeBackend::te_adam_step) on the host path: the Burn glue around
//! [`burn_te_kernels::host::optim`]. f32 parameters only; other dtypes answer `None` (the optimizer runs Burn's
//! `Adam`, which keeps the dtype). Gradient clipping by norm runs here too: its squares on every core (where the
//! gradient is a contiguous Flex buffer), then Burn's own ops for the rest of the coefficient, which the step
//! applies to the gradient as it reads it (Burn's clipping is three passes over the gradient on the calling thread,
//! the last a product).

use burn::prelude::ToElement;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Shape, Tensor, TensorMetadata, TensorPrimitive};
use burn_te_kernels::host::optim::{AdamOutput, AdamStep, adam_step, squares};

use super::fused::Read;
use super::host_tensor;
use crate::error::TeError;

/// One fused Adam step of a host backend's parameter, its gradient first clipped to norm `clip_norm` where given.
pub(super) fn te_adam_step<B: Backend>(
    read: Read<B>,
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    moments: Option<[FloatTensor<B>; 2]>,
    step: AdamStep,
    clip_norm: Option<f32>,
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
    // For the clipping's squares where the gradient is not read in place (see `clip_coefficient`).
    let clipped = clip_norm.map(|max_norm| (max_norm, grad.clone()));
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
    let step = match clipped {
        Some((max_norm, grad)) => {
            // The squares on every core where the gradient is a contiguous buffer (the order in which the backend
            // sums it); else the backend's own `square`, whose layout its sum follows.
            let squared = if g.in_place() {
                host_tensor::<B>(squares(&g), Shape::new([g.len()]), &device)
            } else {
                B::float_powi_scalar(grad, 2.into())
            };
            step.with_grad_scale(clip_coefficient::<B>(squared, max_norm))
        }
        None => step,
    };
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

/// The coefficient by which Burn's `GradientClipping::Norm(max_norm)` multiplies a gradient whose squares are
/// `squared` (in the backend's order): `min(1, max_norm / (‖g‖ + f32's smallest normal))`, by the backend's own ops
/// in Burn's order (the sum, the square root, the add, the reciprocal, the product and the clamp), so Burn's bits.
fn clip_coefficient<B: Backend>(squared: FloatTensor<B>, max_norm: f32) -> f32 {
    let norm = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_sqrt(B::float_sum(
        squared,
    ))));
    let coefficient = max_norm / norm.add_scalar(FloatDType::F32.finfo().min_positive);
    coefficient.clamp_max(1.0).into_scalar().to_f32()
}
