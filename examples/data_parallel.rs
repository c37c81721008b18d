//! Data-parallel training across processes, launched as torchrun launches PyTorch's DDP: the getting-started model
//! (a TransformerLayer, hidden 512, FFN 512, 8 heads) trained by N processes, each with its shard of every batch.
//!
//! What each process does:
//! - finds what it is with `burn_te::distributed::launch::Launch` — `--nproc N` makes it the launcher of N local
//!   peers (copies of this program), `--rank/--world-size/--address` one peer of a group over machines;
//! - joins the group (`Peer::join`), refuses to train when the peers disagree on the recipe or the run
//!   (`Peer::agree_on`), and binds the peer to its thread: its debug logs are per rank, its delayed-scaling amaxes
//!   are reduced across the processes (`reduce_amax`), its statistics are those of the whole batch;
//! - averages its gradients with every other process every step (`Peer::all_reduce_gradients`, over
//!   burn-collective's orchestrator), so the replicas stay identical — checked at the end: the peers agree on a
//!   hash of their parameters.
//!
//! The global batch of each step is the same whatever the number of processes (rank r takes rows r·b..(r+1)·b), so
//! `--nproc 1` trains the same model on the whole batch in one process: compare the losses.
//!
//! Run: `cargo run --release --example data_parallel -- --nproc 2` (`--help` lists the flags).
//! Two machines: `--rank 0 --world-size 2 --address host-a:29500` on host-a, `--rank 1 ...` on host-b.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_te::distributed::launch::{Launch, LaunchArgs};
use burn_te::distributed::{Peer, PeerConfig};
use burn_te::nn::TransformerLayerConfig;
use burn_te::{DelayedScaling, Te, TeBackend, fp8_autocast};
use burn_te_debug::{Debug, DebugOptions};
use burn_te_suite::cli::at_least_one;
use burn_te_suite::device::ExampleDevice;
use clap::Parser;

type Error = Box<dyn std::error::Error + Send + Sync>;

const HIDDEN_SIZE: usize = 512;
const NUM_ATTENTION_HEADS: usize = 8;
/// The global batch of every step: `[sequence, batch, hidden]`, split along the batch over the processes.
const GLOBAL_SHAPE: [usize; 3] = [10, 32, HIDDEN_SIZE];
const LOG_DIR: &str = "./log/data_parallel";

fn main() {
    burn_te_suite::exit_on_error(try_main().map_err(|e| -> Box<dyn std::error::Error> { e }));
}

/// Data-parallel training across processes, launched as torchrun launches PyTorch's DDP: the getting-started
/// TransformerLayer trained by N processes, each with its shard of every batch (the same global batch whatever N, so
/// `--nproc 1` gives the losses to compare with).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Training iterations.
    #[arg(long, default_value_t = 5, value_parser = at_least_one)]
    iterations: usize,
    #[command(flatten)]
    launch: LaunchArgs,
}

fn try_main() -> Result<(), Error> {
    // Warnings and errors only (burn-collective's server would otherwise log every transfer at INFO).
    burn_te_suite::show_warnings();
    let args = Args::parse();
    let iterations = args.iterations;
    let config = match args.launch.launch()? {
        Launch::Local(launcher) => {
            println!(
                "launching {} processes: {} {}",
                launcher.nproc,
                launcher.program.display(),
                launcher.args.join(" ")
            );
            let _ = std::fs::remove_dir_all(LOG_DIR);
            let exits = launcher.run()?;
            for exit in &exits {
                println!("{exit}");
            }
            return match exits.iter().all(|e| e.success()) {
                true => Ok(()),
                false => Err("a rank failed (its error is printed above)".into()),
            };
        }
        Launch::Peer(config) => config,
        Launch::Single => PeerConfig::local(0, 1),
    };
    let rank = config.rank;
    run(config, iterations).map_err(|err| format!("rank {rank}: {err}").into())
}

fn run(config: PeerConfig, iterations: usize) -> Result<(), Error> {
    let rank = config.rank;
    let choice = burn_te_suite::device::choose()?;
    match &choice.device {
        #[cfg(feature = "cuda")]
        ExampleDevice::Cuda(device) => {
            println!("rank {rank}: {choice}, Autodiff<Debug<Te<Cuda>>>");
            train::<Autodiff<Debug<Te<burn::backend::Cuda>>>>(config, iterations, device)
        }
        #[cfg(feature = "wgpu")]
        ExampleDevice::Wgpu(device) => {
            println!("rank {rank}: {choice}, Autodiff<Debug<Te<Wgpu>>>");
            train::<Autodiff<Debug<Te<burn::backend::Wgpu>>>>(config, iterations, device)
        }
        ExampleDevice::Host => {
            println!("rank {rank}: {choice}, Autodiff<Debug<Te<Flex>>>");
            train::<Autodiff<Debug<Te<Flex>>>>(config, iterations, &Default::default())
        }
    }
}

/// One peer: trains its replica on its shard of every global batch for `iterations`.
fn train<B: AutodiffBackend + TeBackend>(
    config: PeerConfig,
    iterations: usize,
    device: &B::Device,
) -> Result<(), Error> {
    let peer = Peer::join(config)?;
    let (rank, world) = (peer.rank(), peer.world_size());
    let recipe = DelayedScaling::default();
    if !GLOBAL_SHAPE[1].is_multiple_of(world) {
        return Err(format!(
            "the global batch {} does not split over {world} processes",
            GLOBAL_SHAPE[1]
        )
        .into());
    }
    // Refused at start when the peers run different recipes or runs.
    peer.agree_on("recipe", &format!("{recipe:?}"))?;
    peer.agree_on(
        "run",
        &format!("iterations {iterations}, global batch {GLOBAL_SHAPE:?}"),
    )?;
    let bound = peer.bind();
    let config_file: PathBuf = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/getting_started_config.yaml"
    )
    .into();
    burn_te_debug::initialize(DebugOptions::new(&config_file).log_dir(LOG_DIR))?;

    // The same initial parameters at every rank (the same seed).
    B::seed(device, 0);
    // No dropout: `--nproc 1` must give the same losses, and each rank would draw its own masks.
    let mut layer = TransformerLayerConfig::new(HIDDEN_SIZE, HIDDEN_SIZE, NUM_ATTENTION_HEADS)
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0)
        .with_name(Some("transformer_layer".into()))
        .try_init::<B>(device)?;
    let mut optimizer = SgdConfig::new().init();
    let local = GLOBAL_SHAPE[1] / world;
    for iteration in 0..iterations {
        let started = Instant::now();
        let [input, target] =
            global_batch::<B>(iteration, device).map(|t| t.narrow(1, rank * local, local));
        let output = fp8_autocast(true, recipe.clone(), || layer.try_forward(input, None))??;
        let loss = (output - target).square().mean();
        let grads = GradientsParams::from_grads(loss.backward(), &layer);
        let reducing = Instant::now();
        let grads = peer.all_reduce_gradients(&layer, grads)?;
        let reduced = reducing.elapsed();
        layer = optimizer.step(1e-2, layer, grads);
        burn_te_debug::step()?;
        // The global loss: the mean of the ranks' (equal shards).
        let loss = loss.into_scalar().elem::<f32>();
        let global = peer.all_reduce_mean(&[f64::from(loss)])?[0];
        println!(
            "rank {rank} iteration {iteration}: loss {loss:.6} (all ranks {global:.6}), step {:.0} ms, gradient all-reduce {:.0} ms",
            started.elapsed().as_secs_f64() * 1e3,
            reduced.as_secs_f64() * 1e3
        );
    }
    burn_te_debug::end()?;
    // The replicas are identical: every rank has the same parameter bits.
    let hash = parameter_hash(&layer);
    peer.agree_on("the parameters after training", &format!("{hash:016x}"))?;
    println!("rank {rank}: parameters identical on all {world} ranks (hash {hash:016x})");
    let log = Path::new(LOG_DIR).join(format!(
        "nvdlfw_inspect_statistics_logs/nvdlfw_inspect_globalrank-{rank}.log"
    ));
    if let Ok(text) = std::fs::read_to_string(&log) {
        println!(
            "rank {rank}: {} ({} lines)",
            log.display(),
            text.lines().count()
        );
    }
    drop(bound);
    peer.leave()?;
    Ok(())
}

/// The global batch of `iteration` (input and target), the same at every rank.
fn global_batch<B: Backend>(iteration: usize, device: &B::Device) -> [Tensor<B, 3>; 2] {
    let mut state =
        0x9E37_79B9_7F4A_7C15u64 ^ (iteration as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut normal = || {
        let n = GLOBAL_SHAPE.iter().product::<usize>();
        let values: Vec<f32> = (0..n)
            .map(|_| {
                // splitmix64 → two uniforms → Box-Muller.
                let mut next = || {
                    state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                    let mut z = state;
                    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                    ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
                };
                let (u1, u2) = (next().max(1e-300), next());
                ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
            })
            .collect();
        Tensor::from_data(TensorData::new(values, GLOBAL_SHAPE), device)
    };
    [normal(), normal()]
}

/// FNV-1a over every parameter's bits, in the module's order.
fn parameter_hash<B: Backend, M: Module<B>>(module: &M) -> u64 {
    struct Hash(u64);
    impl<B: Backend> ModuleVisitor<B> for Hash {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            for value in param.val().into_data().convert::<f32>().iter::<f32>() {
                for byte in value.to_bits().to_le_bytes() {
                    self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01B3);
                }
            }
        }
    }
    let mut hash = Hash(0xCBF2_9CE4_8422_2325);
    module.visit(&mut hash);
    hash.0
}
