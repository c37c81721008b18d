//! What several benches measure alike.

use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_te::nn::TransformerLayer;
use burn_te::{DelayedScaling, TeBackend, fp8_autocast};

/// One training step of `layer`: the forward (in an FP8 scope with DelayedScaling when `fp8`), an MSE loss against
/// `target`, the backward.
pub fn train_step<B: AutodiffBackend + TeBackend>(
    layer: &TransformerLayer<B>,
    x: &Tensor<B, 3>,
    target: &Tensor<B, 3>,
    fp8: bool,
) {
    let y = fp8_autocast(fp8, DelayedScaling::default(), || {
        layer.forward(x.clone(), None)
    })
    .expect("valid recipe");
    drop((y - target.clone()).square().mean().backward());
}
