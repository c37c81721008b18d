//! Distributed: the getting-started model (a TransformerLayer, hidden 512, FFN 512, 8 heads) trained by two peers
//! — threads of this process, each with its own shard of the data — with the debug config of getting_started.
//!
//! What each peer does, and where it comes from:
//! - joins the group as a `burn_te::distributed::Peer` (its rank and world size) and binds it to its thread: its
//!   debug logs are `nvdlfw_inspect_globalrank-<rank>.log`, its delayed-scaling amaxes are reduced (max) across
//!   the peers before every scale update (`reduce_amax`, TE's default), and the statistics it logs at `step()`
//!   are those of both peers' batches together (TE's reduction, done exactly);
//! - averages its gradients with the other's through Burn's own collective API
//!   (`GradientsParams::all_reduce` over burn-collective), so the replicas stay identical.
//!
//! It prints each peer's losses and step times, then the reduced statistics as both peers logged them (the same
//! values), and the per-rank log files. `--help` lists the flags (`--peers`, `--iterations`, `--no-reduce-amax`).
//!
//! Run: `cargo run --example distributed` (add `--release` for speed)

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::collective::{CollectiveConfig, PeerId, ReduceOperation};
use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::backend::AutodiffBackend;
use burn_te::distributed::{Peer, PeerConfig};
use burn_te::nn::{TransformerLayer, TransformerLayerConfig};
use burn_te::{DelayedScaling, Te, TeBackend, fp8_autocast};
use burn_te_debug::{Debug, DebugOptions};
use burn_te_suite::cli::at_least_one;
use burn_te_suite::device::ExampleDevice;
use clap::Parser;

type Error = Box<dyn std::error::Error + Send + Sync>;

const HIDDEN_SIZE: usize = 512;
const NUM_ATTENTION_HEADS: usize = 8;
/// Each peer's `[sequence, batch, hidden]`: half of getting_started's batch of 32.
const INPUT_SHAPE: [usize; 3] = [10, 16, HIDDEN_SIZE];
const LOG_DIR: &str = "./log/distributed";

/// No dropout: the peers' losses are compared, and each peer would draw its own masks.
fn layer_config() -> TransformerLayerConfig {
    TransformerLayerConfig::new(HIDDEN_SIZE, HIDDEN_SIZE, NUM_ATTENTION_HEADS)
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0)
        .with_name(Some("transformer_layer".into()))
}

/// What one peer measured.
struct PeerReport {
    losses: Vec<f32>,
    /// Per iteration: the whole step, the gradient all-reduce, the debug `step()` (its statistics exchange).
    times: Vec<[Duration; 3]>,
}

/// Peer `rank` of `args.peers`: trains its replica `layer` on its shard for `args.iterations`.
fn train_peer<B: AutodiffBackend + TeBackend>(
    rank: usize,
    args: &Args,
    device: &B::Device,
    mut layer: TransformerLayer<B>,
    [input, target]: [TensorData; 2],
    config_file: &Path,
) -> Result<PeerReport, Error> {
    let peers = args.peers;
    let peer = Peer::join(PeerConfig::local(rank, peers))?;
    let _bound = peer.bind();
    burn_te_debug::initialize(DebugOptions::new(config_file).log_dir(LOG_DIR))?;
    // Burn's own collective for the gradients (on the training backend's tensors).
    let id = PeerId::from(rank);
    burn::collective::register::<B::InnerBackend>(
        id,
        device.clone(),
        CollectiveConfig::default().with_num_devices(peers),
    )
    .map_err(|e| format!("rank {rank}: burn-collective: {e:?}"))?;

    let input = Tensor::<B, 3>::from_data(input, device);
    let target = Tensor::<B, 3>::from_data(target, device);
    let mut optimizer = AdamConfig::new().init();
    let recipe = DelayedScaling {
        reduce_amax: !args.no_reduce_amax,
        ..DelayedScaling::default()
    };
    let mut report = PeerReport {
        losses: Vec::new(),
        times: Vec::new(),
    };
    for _ in 0..args.iterations {
        let started = Instant::now();
        let output = fp8_autocast(true, recipe.clone(), || {
            layer.try_forward(input.clone(), None)
        })??;
        let loss = (output - target.clone()).square().mean();
        let grads = GradientsParams::from_grads(loss.backward(), &layer);
        let reducing = Instant::now();
        let grads = grads
            .all_reduce::<B::InnerBackend>(id, ReduceOperation::Mean)
            .map_err(|e| format!("rank {rank}: gradient all-reduce: {e:?}"))?;
        let reduced = reducing.elapsed();
        layer = optimizer.step(1e-4, layer, grads);
        report.losses.push(loss.into_scalar().elem::<f32>());
        let stepping = Instant::now();
        burn_te_debug::step()?;
        report
            .times
            .push([started.elapsed(), reduced, stepping.elapsed()]);
    }
    burn_te_debug::end()?;
    burn::collective::finish_collective::<B::InnerBackend>(id)
        .map_err(|e| format!("rank {rank}: burn-collective: {e:?}"))?;
    drop(_bound);
    peer.leave()?;
    Ok(report)
}

/// Runs `args.peers` peers as threads on `device` (the same device for all: one GPU, lavapipe, or the CPU).
fn train<B: AutodiffBackend + TeBackend>(
    args: &Args,
    device: &B::Device,
    config_file: &Path,
) -> Result<Vec<PeerReport>, Error> {
    let peers = args.peers;
    // One initialization; each replica loads its record: the same parameters (and parameter ids, which Burn's
    // gradient all-reduce orders by), each with its own FP8 state (a clone would share it across peers).
    B::seed(device, 0);
    let layer = layer_config().try_init::<B>(device)?;
    let replicas: Vec<_> = (0..peers)
        .map(|_| layer.clone().load_record(layer.clone().into_record()))
        .collect();
    // Each peer's shard of the data.
    let shards: Vec<[TensorData; 2]> = (0..peers)
        .map(|_| {
            let normal = || {
                Tensor::<B, 3>::random(INPUT_SHAPE, Distribution::Normal(0.0, 1.0), device)
                    .into_data()
            };
            [normal(), normal()]
        })
        .collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = replicas
            .into_iter()
            .zip(shards)
            .enumerate()
            .map(|(rank, (layer, shard))| {
                s.spawn(move || train_peer::<B>(rank, args, device, layer, shard, config_file))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| Error::from("a peer panicked"))?)
            .collect()
    })
}

/// The getting-started TransformerLayer trained by peers (threads of this process), each with its shard of the
/// data, under getting_started's debug config: each peer's losses and step times, the statistics both logged (reduced
/// over the peers) and the per-rank log files.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Peers (1 for a baseline).
    #[arg(long, default_value_t = 2, value_parser = at_least_one)]
    peers: usize,
    /// Training iterations.
    #[arg(long, default_value_t = 5, value_parser = at_least_one)]
    iterations: usize,
    /// Keep each peer's own delayed scales (no amax reduction across the peers).
    #[arg(long)]
    no_reduce_amax: bool,
}

fn main() {
    burn_te_suite::show_warnings();
    burn_te_suite::exit_on_error(try_main().map_err(|e| -> Box<dyn std::error::Error> { e }));
}

fn try_main() -> Result<(), Error> {
    let args = Args::parse();
    let config_file: PathBuf = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/getting_started_config.yaml"
    )
    .into();
    let _ = std::fs::remove_dir_all(LOG_DIR);
    let reports = run(&args, &config_file)?;

    for (rank, report) in reports.iter().enumerate() {
        let losses: Vec<String> = report.losses.iter().map(|l| format!("{l:.6}")).collect();
        println!("rank {rank}: losses [{}]", losses.join(", "));
        // The first iteration compiles kernels: the times are of the others.
        let later = &report.times[report.times.len().min(1)..];
        if !later.is_empty() {
            let mean = |k: usize| {
                later.iter().map(|t| t[k].as_secs_f64()).sum::<f64>() / later.len() as f64 * 1e3
            };
            println!(
                "rank {rank}: step {:.1} ms (gradient all-reduce {:.1} ms, debug step() {:.1} ms), mean of iterations 1..",
                mean(0),
                mean(1),
                mean(2)
            );
        }
    }
    let peers = args.peers;
    println!("\nthe statistics every peer logged (reduced over the {peers} peers' batches):");
    for rank in 0..peers {
        let path = Path::new(LOG_DIR).join(format!(
            "nvdlfw_inspect_statistics_logs/nvdlfw_inspect_globalrank-{rank}.log"
        ));
        let log = std::fs::read_to_string(&path)?;
        println!("{} ({} lines)", path.display(), log.lines().count());
        for line in log.lines().filter(|l| l.contains("iteration=000002")) {
            println!("  {line}");
        }
    }
    Ok(())
}

fn run(args: &Args, config_file: &Path) -> Result<Vec<PeerReport>, Error> {
    let peers = args.peers;
    let choice = burn_te_suite::device::choose()?;
    match &choice.device {
        #[cfg(feature = "cuda")]
        ExampleDevice::Cuda(device) => {
            println!("{peers} peers on {choice}, Autodiff<Debug<Te<Cuda>>>");
            train::<Autodiff<Debug<Te<burn::backend::Cuda>>>>(args, device, config_file)
        }
        #[cfg(feature = "wgpu")]
        ExampleDevice::Wgpu(device) => {
            println!("{peers} peers on {choice}, Autodiff<Debug<Te<Wgpu>>>");
            train::<Autodiff<Debug<Te<burn::backend::Wgpu>>>>(args, device, config_file)
        }
        ExampleDevice::Host => {
            println!("{peers} peers on {choice}, Autodiff<Debug<Te<Flex>>>");
            train::<Autodiff<Debug<Te<Flex>>>>(args, &Default::default(), config_file)
        }
    }
}
