//! `GroupedLinear`'s training step (forward and backward, Float8CurrentScaling, `Autodiff<Te<Flex>>`) against
//! - the experts' own `Linear`s, each on its own input: the same GEMMs and per-expert weight work, without the
//!   group's split of the input and concatenation of the outputs (what the loop adds);
//! - one `Linear` over all the rows: the same GEMM FLOPs with one weight (a bound no MoE layer reaches: it
//!   quantizes, and produces the gradient of, `num_gemms` weights).
//!
//! 8 experts of 512 → 2048 (an MoE layer's fc1), 1024 and 256 tokens split evenly (128 and 32 rows each).

use burn::backend::{Autodiff, Flex};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_te::nn::{GroupedLinearConfig, Linear, LinearConfig};
use burn_te::{Float8CurrentScaling, Te, fp8_autocast};
use criterion::{Criterion, criterion_group, criterion_main};

type B = Autodiff<Te<Flex>>;

const EXPERTS: usize = 8;
const IN: usize = 512;
const OUT: usize = 2048;

fn grouped(c: &mut Criterion) {
    let device = Default::default();
    for tokens in [1024, 256] {
        let mut group = c.benchmark_group(format!(
            "grouped linear {EXPERTS}x({IN}->{OUT}), {tokens} tokens, fwd+bwd current scaling"
        ));
        group.sample_size(10);
        let x = Tensor::<B, 2>::random([tokens, IN], Distribution::Normal(0.0, 1.0), &device);
        let splits = vec![tokens / EXPERTS; EXPERTS];
        let experts = GroupedLinearConfig::new(EXPERTS, IN, OUT).init::<B>(&device);
        let one = LinearConfig::new(IN, OUT).init::<B>(&device);
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
        let alone: Vec<Linear<B>> = (0..EXPERTS)
            .map(|_| LinearConfig::new(IN, OUT).init::<B>(&device))
            .collect();
        let inputs: Vec<Tensor<B, 2>> = (0..EXPERTS)
            .map(|i| x.clone().narrow(0, i * tokens / EXPERTS, tokens / EXPERTS))
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

criterion_group!(benches, grouped);
criterion_main!(benches);
