//! `GroupedLinear`'s training step (forward and backward, Float8CurrentScaling, `Autodiff<Te<Flex>>`), its experts'
//! GEMMs issued together, against
//! - the same layer issuing them in turn (`with_experts_in_turn`: what grouping saves);
//! - the experts' own `Linear`s, each on its own input: the same GEMMs and per-expert weight work, without the
//!   group's split of the input and concatenation of the outputs (what the loop adds);
//! - one `Linear` over all the rows: the same GEMM FLOPs with one weight (a bound no MoE layer reaches: it
//!   quantizes, and produces the gradient of, `num_gemms` weights).
//!
//! 8 experts of 512 → 2048 (an MoE layer's fc1), 1024 and 256 tokens split evenly (128 and 32 rows each); and a
//! fine-grained MoE's 32 small experts of 256 → 512 on 512 tokens (16 rows each): GEMMs too small to split across
//! threads, which the group runs side by side.
//!
//! On wgpu (lavapipe on CPU-only machines), `Autodiff<Te<Wgpu>>`: the same layer step with its experts' GEMMs in
//! one grouped kernel launch per GEMM kind against the experts in turn (a launch per GEMM), and the bare GEMMs:
//! `fp8_gemm_grouped` against a loop of `fp8_gemm` over the same pre-quantized operands.

use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, Flex};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, TensorPrimitive};
use burn_te::backends::Wgpu;
use burn_te::linear::grouped::with_experts_in_turn;
use burn_te::nn::{GroupedLinearConfig, Linear, LinearConfig};
use burn_te::{Float8CurrentScaling, Fp8Format, Scaling, Te, TeBackend, fp8_autocast};
use criterion::{Criterion, criterion_group, criterion_main};

type B = Autodiff<Te<Flex>>;

/// `(experts, in, out, tokens)` per benchmark group.
const SHAPES: [(usize, usize, usize, usize); 3] = [
    (8, 512, 2048, 1024),
    (8, 512, 2048, 256),
    (32, 256, 512, 512),
];

fn grouped(c: &mut Criterion) {
    let device = Default::default();
    for (count, d_in, d_out, tokens) in SHAPES {
        let mut group = c.benchmark_group(format!(
            "grouped linear {count}x({d_in}->{d_out}), {tokens} tokens, fwd+bwd current scaling"
        ));
        group.sample_size(10);
        let x = Tensor::<B, 2>::random([tokens, d_in], Distribution::Normal(0.0, 1.0), &device);
        let splits = vec![tokens / count; count];
        let experts = GroupedLinearConfig::new(count, d_in, d_out).init::<B>(&device);
        let one = LinearConfig::new(d_in, d_out).init::<B>(&device);
        group.bench_function("one Linear over all rows", |bench| {
            bench.iter(|| {
                let x = x.clone().require_grad();
                let y = fp8_autocast(true, Float8CurrentScaling::default(), || {
                    one.forward(x.clone())
                })
                .unwrap();
                y.sum().backward()
            })
        });
        let alone: Vec<Linear<B>> = (0..count)
            .map(|_| LinearConfig::new(d_in, d_out).init::<B>(&device))
            .collect();
        let inputs: Vec<Tensor<B, 2>> = (0..count)
            .map(|i| x.clone().narrow(0, i * tokens / count, tokens / count))
            .collect();
        group.bench_function("each expert's Linear on its own input", |bench| {
            bench.iter(|| {
                let grads = fp8_autocast(true, Float8CurrentScaling::default(), || {
                    alone
                        .iter()
                        .zip(&inputs)
                        .map(|(linear, x)| linear.forward(x.clone().require_grad()).sum())
                        .reduce(|a, b| a + b)
                        .unwrap()
                })
                .unwrap();
                grads.backward()
            })
        });
        group.bench_function("GroupedLinear, experts in turn", |bench| {
            bench.iter(|| {
                with_experts_in_turn(|| {
                    let x = x.clone().require_grad();
                    let y = fp8_autocast(true, Float8CurrentScaling::default(), || {
                        experts.forward(x.clone(), &splits)
                    })
                    .unwrap();
                    y.sum().backward()
                })
            })
        });
        group.bench_function("GroupedLinear", |bench| {
            bench.iter(|| {
                let x = x.clone().require_grad();
                let y = fp8_autocast(true, Float8CurrentScaling::default(), || {
                    experts.forward(x.clone(), &splits)
                })
                .unwrap();
                y.sum().backward()
            })
        });
        group.finish();
    }
}

/// One forward and backward of `experts` on `x` (Float8CurrentScaling), waited for.
fn layer_step<A: AutodiffBackend + TeBackend>(
    experts: &burn_te::nn::GroupedLinear<A>,
    x: &Tensor<A, 2>,
    splits: &[usize],
) {
    let x = x.clone().require_grad();
    let y = fp8_autocast(true, Float8CurrentScaling::default(), || {
        experts.forward(x.clone(), splits)
    })
    .unwrap();
    let grads = y.sum().backward();
    let dx = x.grad(&grads).expect("input gradient");
    A::sync(&dx.device()).expect("sync");
}

fn grouped_on_wgpu(c: &mut Criterion) {
    type W = Autodiff<Te<Wgpu>>;
    let device = WgpuDevice::default();
    for (count, d_in, d_out, tokens) in [(32, 256, 512, 512), (8, 512, 2048, 256)] {
        let mut group = c.benchmark_group(format!(
            "wgpu grouped linear {count}x({d_in}->{d_out}), {tokens} tokens, fwd+bwd current scaling"
        ));
        group.sample_size(10);
        let x = Tensor::<W, 2>::random([tokens, d_in], Distribution::Normal(0.0, 1.0), &device);
        let splits = vec![tokens / count; count];
        let experts = GroupedLinearConfig::new(count, d_in, d_out).init::<W>(&device);
        group.bench_function("GroupedLinear, experts in turn", |bench| {
            bench.iter(|| with_experts_in_turn(|| layer_step(&experts, &x, &splits)))
        });
        group.bench_function("GroupedLinear", |bench| {
            bench.iter(|| layer_step(&experts, &x, &splits))
        });
        group.finish();

        // The fprop GEMMs alone, pre-quantized: what one launch saves over `count`.
        let mut group = c.benchmark_group(format!(
            "wgpu fprop GEMMs {count}x({}x{d_in}x{d_out})",
            tokens / count
        ));
        group.sample_size(10);
        let quantize = |rows, cols| {
            let t =
                Tensor::<Wgpu, 2>::random([rows, cols], Distribution::Normal(0.0, 1.0), &device);
            Wgpu::fp8_quantize(
                t.into_primitive().tensor(),
                Fp8Format::E4M3,
                Scaling::Current { margin: 0.0 },
            )
            .expect("quantize")
        };
        let gemms: Vec<_> = (0..count)
            .map(|_| {
                (
                    quantize(tokens / count, d_in),
                    false,
                    quantize(d_in, d_out),
                    false,
                )
            })
            .collect();
        let sync = |out: Vec<burn::tensor::ops::FloatTensor<Wgpu>>| {
            let last = Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(
                out.into_iter().last().expect("a GEMM"),
            ));
            <Wgpu as burn::tensor::backend::Backend>::sync(&last.device()).expect("sync");
        };
        group.bench_function("fp8_gemm in a loop", |bench| {
            bench.iter(|| {
                sync(
                    gemms
                        .iter()
                        .map(|g| Wgpu::fp8_gemm(g.0.clone(), g.1, g.2.clone(), g.3).expect("gemm"))
                        .collect(),
                )
            })
        });
        group.bench_function("fp8_gemm_grouped", |bench| {
            bench.iter(|| sync(Wgpu::fp8_gemm_grouped(gemms.clone()).expect("grouped gemm")))
        });
        group.finish();
    }
}

criterion_group!(benches, grouped, grouped_on_wgpu);
criterion_main!(benches);
