//! The backend decorator forwarding of `burn_te::forward_backend!`, on the CPU: a decorator over NdArray that counts
#![allow(clippy::vec_init_then_push)]
//! float matmuls computes exactly what NdArray computes (float, int, bool, module, quantized and transaction ops,
//! and the gradients under `Autodiff`), and its matmuls go through the decorator.

use std::cell::Cell;
use std::marker::PhantomData;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::activation::relu;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::module::{conv2d, max_pool2d_with_indices};
use burn::tensor::ops::{ConvOptions, FloatTensor};
use burn::tensor::quantization::{QuantScheme, QuantStore};
use burn::tensor::{Bool, Int, Tensor, TensorData, Transaction};
use burn_te::Decorator;

thread_local! {
    /// Float matmuls run through `Counting` on this thread (tests run in parallel, one per thread).
    static MATMULS: Cell<usize> = const { Cell::new(0) };
}

/// A decorator that counts the float matmuls, then forwards them.
#[derive(Clone, Default, Debug)]
struct Counting<B>(PhantomData<B>);

impl<B: Backend> Decorator for Counting<B> {
    type Inner = B;

    fn name(device: &B::Device) -> String {
        format!("counting<{}>", B::name(device))
    }

    fn float_matmul(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
        MATMULS.with(|count| count.set(count.get() + 1));
        B::float_matmul(lhs, rhs)
    }
}

burn_te::forward_backend!(Counting);

fn matmuls() -> usize {
    MATMULS.with(Cell::get)
}

/// Deterministic float values in [-1, 1).
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let x = (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 1000;
            x as f32 / 500.0 - 1.0
        })
        .collect()
}

fn float<B: Backend, const D: usize>(
    shape: [usize; D],
    seed: u32,
    device: &B::Device,
) -> Tensor<B, D> {
    let n = shape.iter().product();
    Tensor::from_data(TensorData::new(values(n, seed), shape), device)
}

/// Runs float, int, bool, module, quantized and transaction ops on backend `B`; returns every result's data.
fn ops<B: Backend>() -> Vec<(&'static str, TensorData)> {
    let device = B::Device::default();
    let a = float::<B, 2>([4, 6], 1, &device);
    let b = float::<B, 2>([6, 5], 2, &device);
    let c = float::<B, 2>([4, 6], 3, &device);
    let mut out = Vec::new();

    // Float ops, default ones (transpose, clamp, mean_dim, powi_scalar, ...) included.
    out.push(("matmul", a.clone().matmul(b.clone()).into_data()));
    out.push(("add", (a.clone() + c.clone()).into_data()));
    out.push(("mul_exp", (a.clone() * c.clone().exp()).into_data()));
    out.push(("transpose", a.clone().transpose().into_data()));
    out.push(("clamp", a.clone().clamp(-0.5, 0.25).into_data()));
    out.push(("mean_dim", a.clone().mean_dim(1).into_data()));
    out.push(("powi", a.clone().powi_scalar(3).into_data()));
    out.push((
        "cat",
        Tensor::cat(vec![a.clone(), c.clone()], 0).into_data(),
    ));
    out.push(("sort", a.clone().sort(1).into_data()));

    // Int ops.
    let i = Tensor::<B, 1, Int>::arange(0..24, &device).reshape([4, 6]);
    out.push(("int_arange", i.clone().into_data()));
    out.push((
        "int_arith",
        (i.clone() * 3 + i.clone()).sum_dim(1).into_data(),
    ));
    out.push(("int_cumsum", i.clone().cumsum(1).into_data()));
    out.push(("argmax", a.clone().argmax(1).into_data()));
    out.push((
        "gather",
        a.clone().gather(1, a.clone().argsort(1)).into_data(),
    ));

    // Bool ops.
    let m = a.clone().greater(c.clone());
    out.push(("greater", m.clone().into_data()));
    out.push((
        "bool_not_and",
        m.clone()
            .bool_not()
            .bool_and(a.clone().lower_elem(0.0))
            .into_data(),
    ));
    out.push(("bool_int", m.clone().int().sum().into_data()));
    out.push(("mask_fill", a.clone().mask_fill(m.clone(), 7.0).into_data()));
    let t: Tensor<B, 2, Bool> =
        Tensor::from_data(TensorData::from([[true, false], [false, true]]), &device);
    out.push(("bool_any", t.any_dim(1).into_data()));

    // Module ops: conv2d, max_pool2d with indices (a backend-generic result, rebranded).
    let x = float::<B, 4>([2, 3, 6, 6], 4, &device);
    let w = float::<B, 4>([4, 3, 3, 3], 5, &device);
    let bias = float::<B, 1>([4], 6, &device);
    let options = ConvOptions::new([1, 1], [1, 1], [1, 1], 1);
    out.push((
        "conv2d",
        conv2d(x.clone(), w, Some(bias), options).into_data(),
    ));
    let (pooled, indices) = max_pool2d_with_indices(x, [2, 2], [2, 2], [0, 0], [1, 1], false);
    out.push(("max_pool2d", pooled.into_data()));
    out.push(("max_pool2d_indices", indices.into_data()));

    // Quantized ops (quantization parameters and `TensorPrimitive` results, rebranded).
    // NdArray quantizes with the native store only.
    let scheme = QuantScheme::default().with_store(QuantStore::Native);
    let q = a.clone().quantize_dynamic(&scheme);
    out.push(("quantized", q.clone().into_data()));
    out.push(("dequantized", q.clone().dequantize().into_data()));
    out.push(("q_add", (q.clone() + q).dequantize().into_data()));

    // A transaction (a backend-generic primitive, rebranded).
    let read = Transaction::default()
        .register(a)
        .register(i)
        .register(m)
        .execute();
    out.extend(read.into_iter().map(|data| ("transaction", data)));
    out
}

#[test]
fn decorator_forwards_every_op_with_the_inner_values() {
    let before = matmuls();
    let decorated = ops::<Counting<NdArray>>();
    assert_eq!(
        matmuls() - before,
        1,
        "the float matmul goes through Decorator::float_matmul"
    );
    let plain = ops::<NdArray>();
    assert_eq!(decorated.len(), plain.len());
    for ((op, got), (_, want)) in decorated.iter().zip(&plain) {
        assert_eq!(got, want, "{op}");
    }
    assert_eq!(matmuls() - before, 1, "plain NdArray does not count");
}

#[test]
fn decorator_name_goes_through_the_decorator() {
    let device = Default::default();
    assert_eq!(
        <Counting<NdArray> as Backend>::name(&device),
        format!("counting<{}>", <NdArray as Backend>::name(&device))
    );
}

/// x.matmul(w).relu().sum() on `AD`; returns (loss, dx, dw).
fn gradients<AD: AutodiffBackend>() -> [TensorData; 3] {
    let device = AD::Device::default();
    let x = float::<AD, 2>([3, 4], 7, &device).require_grad();
    let w = float::<AD, 2>([4, 2], 8, &device).require_grad();
    let loss = relu(x.clone().matmul(w.clone())).sum();
    let grads = loss.backward();
    [
        loss.into_data(),
        x.grad(&grads).expect("x has a gradient").into_data(),
        w.grad(&grads).expect("w has a gradient").into_data(),
    ]
}

#[test]
fn decorator_under_autodiff_gives_the_inner_gradients() {
    let before = matmuls();
    let decorated = gradients::<Autodiff<Counting<NdArray>>>();
    // The forward matmul and the two of its backward (dx = g wᵀ, dw = xᵀ g) go through the decorator.
    assert_eq!(matmuls() - before, 3);
    assert_eq!(decorated, gradients::<Autodiff<NdArray>>());
}
