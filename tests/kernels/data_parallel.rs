//! Data parallel across processes (`Peer::all_reduce_gradients`, the torchrun-style launcher): two processes with
//! half the batch each reach the parameters of one process with the whole batch; FP8 scales are equal on every
//! rank; every rank's logs are complete. Faults: a process killed mid-step stops the other with a clear error in
//! bounded time, its logs up to that step intact; a peer that never joins, and peers started with another world
//! size or recipe, are refused at start with errors that say so.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_te::distributed::launch::Launch;
use burn_te::distributed::{Peer, PeerConfig};
use burn_te::nn::{Linear, LinearConfig};
use burn_te::{DelayedScaling, RoleRecord, Te, TeError, fp8_autocast};
use burn_te_debug::{Debug, DebugOptions};

use crate::common::Rng;
use crate::debug::{SESSION, temp_dir};
use crate::distributed::{Reaper, child, spawn_peers, wait_until};

type S = Autodiff<Debug<Te<Flex>>>;

/// The global batch of every step, split along the tokens over the processes.
const TOKENS: usize = 16;
const D_IN: usize = 16;
const D_HIDDEN: usize = 32;
const D_OUT: usize = 8;
const STEPS: usize = 4;
const LR: f64 = 0.5;
const PROCESSES: usize = 2;

const CONFIG: &str = r#"stats:
  enabled: True
  layers:
    layer_name_regex_pattern: '^fc1$'
  transformer_engine:
    LogTensorStats:
      enabled: True
      stats: [min, max, mean, std, l1_norm]
      tensors: [activation]
"#;

/// A two-layer MLP of TE linears.
#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
}

impl<B: Backend + burn_te::TeBackend> Mlp<B> {
    /// The same parameters at every rank (drawn from a fixed seed).
    fn new(device: &B::Device) -> Self {
        let mut rng = Rng::new(7);
        let mut linear = |name: &str, d_in: usize, d_out: usize| {
            let mut fc = LinearConfig::new(d_in, d_out)
                .with_name(Some(name.into()))
                .init::<B>(device);
            let std = 1.0 / (d_in as f64).sqrt();
            fc.weight = Param::from_tensor(crate::te::tensor(
                rng.normal(d_in * d_out, 0.0, std),
                [d_in, d_out],
                device,
            ));
            fc.bias = Some(Param::from_tensor(crate::te::tensor(
                rng.normal(d_out, 0.0, 0.1),
                [d_out],
                device,
            )));
            fc
        };
        Mlp {
            fc1: linear("fc1", D_IN, D_HIDDEN),
            fc2: linear("fc2", D_HIDDEN, D_OUT),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.fc2
            .forward(burn::tensor::activation::relu(self.fc1.forward(x)))
    }
}

/// Step `n`'s global batch: input `[TOKENS, D_IN]` and target `[TOKENS, D_OUT]`.
fn batch(n: usize) -> (Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(50 + n as u64);
    (
        rng.normal(TOKENS * D_IN, 0.5, 1.5),
        rng.normal(TOKENS * D_OUT, 0.0, 1.0),
    )
}

/// What one run ends with: the losses, the parameters (module order), each layer's FP8 state.
#[derive(Debug, PartialEq)]
struct Run {
    losses: Vec<f32>,
    params: Vec<Vec<f32>>,
    fp8: Vec<Vec<RoleRecord>>,
}

/// Trains the MLP for [`STEPS`] SGD steps on this rank's share of every global batch (all of it without a peer),
/// delayed scaling with `reduce_amax`, the gradients averaged over the peers. `abort_at`: the step in which this
/// process dies, after its forward pass.
fn train(peer: Option<&Peer>, abort_at: Option<usize>) -> Result<Run, TeError> {
    let device = Default::default();
    let (rank, world) = peer.map_or((0, 1), |p| (p.rank(), p.world_size()));
    let local = TOKENS / world;
    let mut model = Mlp::<S>::new(&device);
    let mut optimizer = SgdConfig::new().init();
    let mut losses = Vec::new();
    for n in 0..STEPS {
        let (x, t) = batch(n);
        let rows = |v: Vec<f32>, width: usize| {
            v[rank * local * width..(rank + 1) * local * width].to_vec()
        };
        let x = crate::te::tensor::<S, 2>(rows(x, D_IN), [local, D_IN], &device);
        let t = crate::te::tensor::<S, 2>(rows(t, D_OUT), [local, D_OUT], &device);
        let y = fp8_autocast(true, DelayedScaling::default(), || model.forward(x))?;
        let loss = (y - t).square().mean();
        if abort_at == Some(n) {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
            let dir = PathBuf::from(std::env::var("BURN_TE_TEST_DIR").unwrap());
            std::fs::write(dir.join("aborted_at_ms"), now.as_millis().to_string()).unwrap();
            std::process::abort();
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = match peer {
            Some(peer) => peer.all_reduce_gradients(&model, grads)?,
            None => grads,
        };
        model = optimizer.step(LR, model, grads);
        burn_te_debug::step().map_err(|e| TeError::Collective(e.to_string()))?;
        losses.push(crate::te::values(loss)[0]);
    }
    let params = [model.fc1.weight.val(), model.fc2.weight.val()]
        .into_iter()
        .map(crate::te::values)
        .chain(
            [&model.fc1.bias, &model.fc2.bias]
                .into_iter()
                .map(|b| crate::te::values(b.as_ref().unwrap().val())),
        )
        .collect();
    let fp8 = [&model.fc1, &model.fc2]
        .into_iter()
        .map(|fc| fc.fp8_meta.state().to_record())
        .collect::<Result<_, _>>()?;
    Ok(Run {
        losses,
        params,
        fp8,
    })
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

fn floats(bits: Vec<u32>) -> Vec<f32> {
    bits.into_iter().map(f32::from_bits).collect()
}

/// A peer process of the launcher: its rank from the environment the launcher set; trains and writes its run as
/// JSON to `peer_<rank>.json`, or `error: ...` to `peer_<rank>.txt` (and exits with 1).
#[test]
#[ignore = "a child process of the data-parallel tests"]
fn ddp_peer_process() {
    let Ok(dir) = std::env::var("BURN_TE_TEST_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    // A launcher's child (its rank in the environment), or a peer started with `--rank/--world-size/--address`.
    let args: Vec<String> = std::env::var("BURN_TE_TEST_ARGS")
        .map(|a| a.split_whitespace().map(String::from).collect())
        .unwrap_or_default();
    let Ok((Launch::Peer(config), _)) = Launch::from_args(&args) else {
        panic!("not started as a peer: {:?}", Launch::from_args(&args));
    };
    let rank = config.rank;
    let abort_at = std::env::var("BURN_TE_TEST_ABORT").ok().and_then(|v| {
        let (r, n) = v.split_once(':')?;
        (r.parse::<usize>().ok()? == rank).then(|| n.parse().ok())?
    });
    let result = (|| -> Result<Run, Box<dyn std::error::Error>> {
        let peer = Peer::join(config)?;
        peer.agree_on("recipe", &format!("{:?}", DelayedScaling::default()))?;
        let bound = peer.bind();
        burn_te_debug::initialize(DebugOptions::new(dir.join("config.yaml")).log_dir(&dir))?;
        let run = train(Some(&peer), abort_at)?;
        burn_te_debug::end()?;
        drop(bound);
        peer.leave()?;
        Ok(run)
    })();
    match result {
        Ok(run) => {
            let json = serde_json::json!({
                "losses": bits(&run.losses),
                "params": run.params.iter().map(|p| bits(p)).collect::<Vec<_>>(),
                "fp8": run.fp8.iter().map(|layer| layer.iter()
                    .map(|(role, h, scale, pending)| (role, bits(h), scale.to_bits(), pending))
                    .collect::<Vec<_>>()).collect::<Vec<_>>(),
            });
            std::fs::write(dir.join(format!("peer_{rank}.json")), json.to_string()).unwrap();
        }
        Err(err) => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
            std::fs::write(
                dir.join(format!("peer_{rank}.txt")),
                format!("{}\nerror: {err}", now.as_millis()),
            )
            .unwrap();
            std::process::exit(1);
        }
    }
}

/// The launcher, as a child process (it hosts burn-collective's orchestrator, whose server code sets up
/// process-wide logging): `--nproc` peers of [`ddp_peer_process`], started by `Launch::from_args`; writes how each
/// rank ended to `launch.txt`.
#[test]
#[ignore = "a child process of the data-parallel tests"]
fn launcher_process() {
    let (Ok(dir), Ok(timeout)) = (
        std::env::var("BURN_TE_TEST_DIR"),
        std::env::var("BURN_TE_TEST_TIMEOUT_S"),
    ) else {
        return;
    };
    let args: Vec<String> = [
        "--nproc",
        &PROCESSES.to_string(),
        "--collective-timeout",
        &timeout,
        "--exact",
        "data_parallel::ddp_peer_process",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]
    .map(String::from)
    .into();
    let (Launch::Local(launch), rest) = Launch::from_args(&args).unwrap() else {
        panic!("--nproc did not make a launcher");
    };
    assert_eq!(rest, args[4..]);
    let exits = launch.run().unwrap();
    let report: Vec<String> = exits
        .iter()
        .map(|e| {
            format!(
                "{} {}",
                e.rank,
                e.status
                    .and_then(|s| s.code())
                    .map_or("none".into(), |c| c.to_string())
            )
        })
        .collect();
    std::fs::write(Path::new(&dir).join("launch.txt"), report.join("\n")).unwrap();
}

/// Runs the launcher for [`PROCESSES`] peers in `dir` with `envs`; how each rank ended (`None`: no exit code: a
/// signal or killed) and how long the launcher took.
fn launch(dir: &Path, envs: &[(&str, String)], limit: Duration) -> (Vec<Option<i32>>, Duration) {
    std::fs::write(dir.join("config.yaml"), CONFIG).unwrap();
    let mut all = vec![("BURN_TE_TEST_DIR", dir.display().to_string())];
    all.extend(envs.iter().cloned());
    let started = Instant::now();
    let mut launcher = Reaper(vec![child("data_parallel::launcher_process", &all)]);
    let status = wait_until(&mut launcher.0[0], started + limit);
    let took = started.elapsed();
    assert!(
        status.is_some_and(|s| s.success()),
        "the launcher: {status:?} after {took:?}"
    );
    let report = std::fs::read_to_string(dir.join("launch.txt")).unwrap();
    let exits = report
        .lines()
        .map(|l| l.split_once(' ').unwrap().1.parse().ok())
        .collect();
    (exits, took)
}

/// The run peer `rank` wrote.
fn peer_run(dir: &Path, rank: usize) -> Run {
    let path = dir.join(format!("peer_{rank}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; its error: {:?}",
            path.display(),
            std::fs::read_to_string(dir.join(format!("peer_{rank}.txt")))
        )
    });
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let losses: Vec<u32> = serde_json::from_value(json["losses"].clone()).unwrap();
    let params: Vec<Vec<u32>> = serde_json::from_value(json["params"].clone()).unwrap();
    // (role, amax history bits, scale bits, pending) per layer.
    type Fp8Bits = Vec<Vec<(String, Vec<u32>, u32, bool)>>;
    let fp8: Fp8Bits = serde_json::from_value(json["fp8"].clone()).unwrap();
    Run {
        losses: floats(losses),
        params: params.into_iter().map(floats).collect(),
        fp8: fp8
            .into_iter()
            .map(|layer| {
                layer
                    .into_iter()
                    .map(|(role, h, scale, pending)| {
                        (role, floats(h), f32::from_bits(scale), pending)
                    })
                    .collect()
            })
            .collect(),
    }
}

/// `(iteration, name, value)` of every line of rank `rank`'s statistics log.
fn stats_log(dir: &Path, rank: usize) -> Vec<(u64, String, f64)> {
    let path = dir.join(format!(
        "nvdlfw_inspect_statistics_logs/nvdlfw_inspect_globalrank-{rank}.log"
    ));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .map(|line| {
            let message = line.split(" - INFO - ").nth(1).unwrap_or(line);
            let mut words = message.split_whitespace();
            let name = words.next().unwrap().to_string();
            let field = |key: &str| {
                message
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix(key))
                    .unwrap_or_else(|| panic!("no {key} in {line}"))
                    .to_string()
            };
            (
                field("iteration=").parse().unwrap(),
                name,
                field("value=").parse().unwrap(),
            )
        })
        .collect()
}

/// 2 processes × 8 tokens reach, after 4 SGD steps, the parameters of 1 process × 16 tokens.
///
/// Tolerance, from the reduction order: with `reduce_amax`, each rank quantizes its half of the activations and
/// weights with the scale of the whole batch, and its loss gradient (the mean over 8 tokens, exactly twice the
/// whole batch's) with exactly half its scale: the FP8 codes are the same as in the single process. What differs
/// is where the sums over tokens round: the single process's wgrad and bias gradient add 16 products in one f32
/// accumulation; the two ranks add 8 each in f32, then the exchange adds the two exactly in f64 and halves. That
/// moves a gradient by a few f32 ulps of its terms' magnitude (≤ 16 · 2⁻²⁴ ≈ 1e-6 relative); four steps at a
/// learning rate of 0.5 keep the parameters within 1e-5 of each other (relative to max(1, |p|)), unless a
/// difference flips an FP8 code, which the assertion would show.
#[test]
fn data_parallel_processes_match_one_process_with_the_whole_batch() {
    let dir = temp_dir("data-parallel");
    // Launched with gradient buckets of 100 values (9 exchanges per step); the peers started by flags below use the
    // default (one), and must train the same bits.
    let (exits, took) = launch(
        &dir,
        &[
            ("BURN_TE_TEST_TIMEOUT_S", "60".into()),
            ("BURN_TE_GRADIENT_BUCKET", "100".into()),
        ],
        Duration::from_secs(180),
    );
    assert_eq!(exits, vec![Some(0); PROCESSES], "the ranks' exits");
    eprintln!("2 processes × {STEPS} steps through the launcher: {took:?}");
    let runs: Vec<Run> = (0..PROCESSES).map(|r| peer_run(&dir, r)).collect();
    // The replicas are identical, FP8 state (scales, amax histories) included: bit for bit.
    assert_eq!(runs[0].params, runs[1].params, "the ranks' parameters");
    // FP8 state: the same scales and amax histories at every rank, bit for bit, but for the last step's amax, which
    // waits (pending) in each rank's history for the reduction at the next scale update (as in TE).
    for (layer, (r0, r1)) in runs[0].fp8.iter().zip(&runs[1].fp8).enumerate() {
        for ((role, h0, s0, p0), (_, h1, s1, p1)) in r0.iter().zip(r1) {
            assert_eq!(
                (s0.to_bits(), p0),
                (s1.to_bits(), p1),
                "layer {layer} {role}: scale, pending"
            );
            let from = usize::from(*p0);
            assert!(
                h0[from..]
                    .iter()
                    .zip(&h1[from..])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "layer {layer} {role}: the reduced amax histories differ"
            );
        }
    }
    let single = {
        let _session = SESSION.lock().unwrap_or_else(|p| p.into_inner());
        train(None, None).unwrap()
    };
    let mut worst = 0f64;
    for (p, (two, one)) in runs[0].params.iter().zip(&single.params).enumerate() {
        for (i, (&a, &b)) in two.iter().zip(one).enumerate() {
            let error = (f64::from(a) - f64::from(b)).abs() / f64::from(b.abs()).max(1.0);
            worst = worst.max(error);
            assert!(
                error <= 1e-5,
                "parameter {p}[{i}]: 2 processes {a} vs 1 process {b}"
            );
        }
    }
    // The loss of each rank's half: their mean is the single process's loss.
    for n in 0..STEPS {
        let mean = (f64::from(runs[0].losses[n]) + f64::from(runs[1].losses[n])) / 2.0;
        let one = f64::from(single.losses[n]);
        assert!(
            (mean - one).abs() <= 1e-5 * one.max(1.0),
            "loss {n}: {mean} vs {one}"
        );
    }
    // The FP8 scales: activation and weight as the single process's; the gradient's exactly half.
    for (layer, (two, one)) in runs[0].fp8.iter().zip(&single.fp8).enumerate() {
        for ((role, _, scale, _), (_, _, one_scale, _)) in two.iter().zip(one) {
            let expected = if role == "gradient" {
                one_scale / 2.0
            } else {
                *one_scale
            };
            assert!(
                (scale - expected).abs() <= 1e-5 * expected.abs(),
                "layer {layer} {role} scale: {scale} vs {expected}"
            );
        }
    }
    eprintln!(
        "largest parameter difference, 2 processes vs 1: {worst:.2e} (relative to max(1, |p|))"
    );

    // The same two peers started as on two machines (`--rank/--world-size/--address`, rank 0 hosting the
    // orchestrator), with one gradient bucket, train the same bits.
    let machines = temp_dir("data-parallel-machines");
    std::fs::write(machines.join("config.yaml"), CONFIG).unwrap();
    let address = format!("127.0.0.1:{}", crate::distributed::free_port());
    let mut peers = Reaper(
        (0..PROCESSES)
            .map(|rank| {
                let args = format!("--rank {rank} --world-size {PROCESSES} --address {address}");
                child(
                    "data_parallel::ddp_peer_process",
                    &[
                        ("BURN_TE_TEST_DIR", machines.display().to_string()),
                        ("BURN_TE_TEST_ARGS", args),
                    ],
                )
            })
            .collect(),
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    for (rank, peer) in peers.0.iter_mut().enumerate() {
        let status = wait_until(peer, deadline);
        assert!(
            status.is_some_and(|s| s.success()),
            "peer {rank} by flags: {status:?}"
        );
    }
    for (rank, run) in runs.iter().enumerate() {
        assert!(
            peer_run(&machines, rank) == *run,
            "rank {rank} by flags differs from launched"
        );
    }

    // Every rank's statistics log is complete: each step's statistics of fc1's activation, reduced over the ranks
    // to the whole batch's (f64 re-computation), in both logs alike.
    let logs: Vec<_> = (0..PROCESSES).map(|r| stats_log(&dir, r)).collect();
    assert_eq!(logs[0], logs[1], "the ranks' statistics logs");
    for n in 0..STEPS {
        let x: Vec<f64> = batch(n).0.iter().map(|&v| f64::from(v)).collect();
        let count = x.len() as f64;
        let mean = x.iter().sum::<f64>() / count;
        let std = (x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (count - 1.0)).sqrt();
        for (stat, expected) in [
            ("min", x.iter().copied().fold(f64::INFINITY, f64::min)),
            ("max", x.iter().copied().fold(f64::NEG_INFINITY, f64::max)),
            ("mean", mean),
            ("std", std),
            ("l1_norm", x.iter().map(|v| v.abs()).sum()),
        ] {
            let name = format!("fc1_activation_{stat}");
            let logged: Vec<f64> = logs[0]
                .iter()
                .filter(|(it, nm, _)| *it == n as u64 && *nm == name)
                .map(|(_, _, v)| *v)
                .collect();
            assert_eq!(logged.len(), 1, "{name} at {n}: {:?}", logs[0]);
            // The log prints 4 decimals (TE's format).
            assert!(
                (logged[0] - expected).abs() <= 0.5e-4 + 1e-6 * expected.abs(),
                "{name} at {n}: {} vs f64 {expected}",
                logged[0]
            );
        }
    }
}

/// Rank 1 dies in the middle of step 2 (after its forward pass): rank 0 stops with a clear error within the
/// collective timeout, the launcher ends, and rank 0's statistics log holds steps 0 and 1 complete.
#[test]
fn a_process_killed_mid_step_stops_the_others_with_a_clear_error() {
    let dir = temp_dir("data-parallel-killed");
    let timeout_s = 3;
    let (exits, took) = launch(
        &dir,
        &[
            ("BURN_TE_TEST_TIMEOUT_S", timeout_s.to_string()),
            ("BURN_TE_TEST_ABORT", "1:2".into()),
        ],
        Duration::from_secs(120),
    );
    assert_eq!(
        exits,
        vec![Some(1), None],
        "rank 0 fails, rank 1 died of a signal"
    );
    let report = std::fs::read_to_string(dir.join("peer_0.txt")).unwrap();
    let (failed_ms, error) = report.split_once('\n').unwrap();
    let aborted_ms: u128 = std::fs::read_to_string(dir.join("aborted_at_ms"))
        .unwrap()
        .parse()
        .unwrap();
    let waited = Duration::from_millis((failed_ms.parse::<u128>().unwrap() - aborted_ms) as u64);
    eprintln!("rank 0, {waited:?} after rank 1 died ({took:?} in all): {error}");
    assert!(
        error.starts_with("error:") && error.contains("peer 0") && error.contains("died"),
        "rank 0: {error}"
    );
    assert!(
        waited <= Duration::from_secs(timeout_s + 3),
        "rank 0 failed after {waited:?}"
    );
    let log = stats_log(&dir, 0);
    for n in 0..2 {
        let names = log.iter().filter(|(it, _, _)| *it == n).count();
        assert_eq!(names, 5, "step {n}'s statistics in rank 0's log: {log:?}");
    }
    assert!(log.iter().all(|(it, _, _)| *it < 2), "{log:?}");
}

/// A peer of the start-up tests: joins, agrees on the recipe `BURN_TE_TEST_RECIPE`, leaves; writes `ok` or the
/// error.
#[test]
#[ignore = "a child process of the data-parallel tests"]
fn agreeing_peer_process() {
    let Ok(out) = std::env::var("BURN_TE_TEST_PEER_OUT") else {
        return;
    };
    let result = (|| -> Result<(), TeError> {
        let peer = Peer::join(PeerConfig::from_env()?)?;
        peer.agree_on("recipe", &std::env::var("BURN_TE_TEST_RECIPE").unwrap())?;
        peer.leave()
    })();
    let text = match result {
        Ok(()) => "ok".to_string(),
        Err(err) => format!("error: {err}"),
    };
    std::fs::write(out, text).unwrap();
}

/// Starts the peers of [`agreeing_peer_process`] (`env(rank)`: its environment on top, `None`: not started) and
/// waits for what each wrote (`None`: nothing within the limit).
fn start_up(
    name: &str,
    timeout_s: u64,
    env: impl Fn(usize) -> Option<Vec<(&'static str, String)>>,
) -> Vec<Option<String>> {
    let dir = temp_dir(name);
    let out = |rank: usize| dir.join(format!("peer_{rank}.txt"));
    let started = (0..PROCESSES).map(|r| env(r).is_some()).collect::<Vec<_>>();
    let mut children = spawn_peers(
        "data_parallel::agreeing_peer_process",
        timeout_s,
        &dir,
        out,
        env,
    );
    let deadline = Instant::now() + Duration::from_secs(timeout_s + 30);
    for child in children.0.iter_mut().skip(1) {
        wait_until(child, deadline);
    }
    (0..PROCESSES)
        .map(|r| {
            started[r]
                .then(|| std::fs::read_to_string(out(r)).ok())
                .flatten()
        })
        .collect()
}

#[test]
fn peers_that_never_join_or_disagree_are_refused_at_start() {
    let recipe = |r: &str| vec![("BURN_TE_TEST_RECIPE", r.to_string())];
    // Agreeing peers start.
    let ok = start_up("dp-agree", 30, |_| Some(recipe("delayed")));
    assert_eq!(ok, vec![Some("ok".into()), Some("ok".into())]);
    // Another recipe at rank 1: both are refused, with every rank's value named.
    let recipes = start_up("dp-recipe", 30, |r| {
        Some(recipe(if r == 0 { "delayed" } else { "current" }))
    });
    for (rank, text) in recipes.iter().enumerate() {
        let text = text.as_deref().unwrap_or("nothing written");
        assert!(
            text.contains("do not agree on recipe")
                && text.contains("rank 0: delayed")
                && text.contains("rank 1: current"),
            "rank {rank}: {text}"
        );
    }
    // Rank 1 never starts: rank 0's join times out with an error that says so.
    let started = Instant::now();
    let alone = start_up("dp-alone", 2, |r| (r == 0).then(|| recipe("delayed")));
    let text = alone[0].as_deref().unwrap_or("nothing written");
    assert!(
        text.contains("join") && text.contains("no answer from every peer within 2.0 s"),
        "rank 0 alone: {text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    // Rank 1 started with a world of 3: the one that joins second is refused at once for the world size, the other
    // times out.
    let sizes = start_up("dp-world", 3, |r| {
        let mut env = recipe("delayed");
        if r == 1 {
            env.push(("WORLD_SIZE", "3".into()));
        }
        Some(env)
    });
    let texts: Vec<&str> = sizes
        .iter()
        .map(|t| t.as_deref().unwrap_or("nothing written"))
        .collect();
    assert!(
        texts.iter().any(|t| t.contains("different world sizes"))
            && texts.iter().all(|t| t.starts_with("error:")),
        "{texts:?}"
    );
    eprintln!("world sizes 2 and 3: {texts:?}");
}
