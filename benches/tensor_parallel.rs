//! The cost of tensor parallelism's exchanges, built on burn-collective's all-reduce (see
//! `burn_te::distributed::tensor_parallel`): an all-reduce of a row-parallel layer's output, `[tokens, hidden]`
//! f32 on Flex, between two peers that are threads of this process (each exchange: a device read, every rank's
//! values in its slot of a world-sized `f64` message summed by burn-collective, the group's sum on the host, a
//! device write), against the device read and write alone on the same tensor (what any host-side exchange pays).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use burn::backend::Flex;
use burn::prelude::*;
use burn::tensor::{Distribution, TensorPrimitive};
use burn_te::distributed::tensor_parallel::{TpExchange, TpGroup};
use burn_te::distributed::{Peer, PeerConfig};
use criterion::{Criterion, criterion_group, criterion_main};

type B = Flex;

/// `[tokens, hidden]` per benchmark: a small layer's, and a TransformerLayer's at hidden 1024 over 1024 tokens.
const SHAPES: [(usize, usize); 3] = [(64, 256), (256, 1024), (1024, 1024)];

fn all_reduce(tensor: &Tensor<B, 2>, group: &TpGroup) -> Tensor<B, 2> {
    let out = TpExchange::AllReduce
        .apply::<B>(tensor.clone().into_primitive().tensor(), group)
        .unwrap();
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

fn exchanges(c: &mut Criterion) {
    let device = Default::default();
    // Rank 1 runs in a thread, as many all-reduces as rank 0 asks for.
    let (ask, asked) = mpsc::channel::<Option<(usize, usize, u64)>>();
    let partner = std::thread::spawn(move || {
        let peer = Peer::join(PeerConfig::local(1, 2)).unwrap();
        let _bound = peer.bind();
        let group = TpGroup::current(2).unwrap();
        while let Ok(Some((tokens, hidden, iters))) = asked.recv() {
            let x = Tensor::<B, 2>::random(
                [tokens, hidden],
                Distribution::Default,
                &Default::default(),
            );
            for _ in 0..iters {
                all_reduce(&x, &group);
            }
        }
        drop(_bound);
        peer.leave().unwrap();
    });
    let peer = Peer::join(PeerConfig::local(0, 2)).unwrap();
    let bound = peer.bind();
    let group = TpGroup::current(2).unwrap();
    for (tokens, hidden) in SHAPES {
        let mut bench = c.benchmark_group(format!(
            "tensor-parallel all-reduce [{tokens}, {hidden}] f32, 2 thread peers"
        ));
        bench
            .sample_size(10)
            .measurement_time(Duration::from_secs(3));
        let x = Tensor::<B, 2>::random([tokens, hidden], Distribution::Default, &device);
        bench.bench_function("device read and write alone", |b| {
            b.iter(|| Tensor::<B, 2>::from_data(x.clone().into_data(), &device))
        });
        bench.bench_function("all-reduce over the group", |b| {
            b.iter_custom(|iters| {
                ask.send(Some((tokens, hidden, iters))).unwrap();
                let start = Instant::now();
                for _ in 0..iters {
                    all_reduce(&x, &group);
                }
                start.elapsed()
            })
        });
        bench.finish();
    }
    ask.send(None).unwrap();
    drop(bound);
    peer.leave().unwrap();
    partner.join().unwrap();
}

criterion_group!(benches, exchanges);
criterion_main!(benches);
