//! What several benches measure alike.
//!
//! Each bench includes it as `mod common;` and uses part of it, hence `dead_code` is allowed.
#![allow(dead_code)]

use burn::backend::Flex;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_te::nn::TransformerLayer;
use burn_te::{DelayedScaling, Fp8Format, Fp8Primitive, Scaling, TeBackend, fp8_autocast};

/// A `[rows, cols]` Flex matrix of values in [-2, 2), deterministic: `seed` shifts the pattern.
pub fn input(rows: usize, cols: usize, seed: usize) -> Tensor<Flex, 2> {
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| (((i + seed) * 7919 % 1000) as f32 - 500.0) / 250.0)
        .collect();
    Tensor::from_data(TensorData::new(values, [rows, cols]), &Default::default())
}

/// `t` quantized to E4M3 with a current scale.
pub fn quantize(t: &Tensor<Flex, 2>) -> Fp8Primitive<Flex> {
    Flex::fp8_quantize(
        t.clone().into_primitive().tensor(),
        Fp8Format::E4M3,
        Scaling::Current { margin: 0.0 },
    )
    .expect("quantize")
}

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
