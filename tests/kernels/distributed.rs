//! Distributed: peers as threads of this process (one on wgpu, one on the host path, Flex), each with its own
//! debug session, exchanging over burn-collective. Checked against host re-computations: the GEMMs of every peer
//! follow the delayed scales recomputed from the maximum amax over the peers (`reduce_amax`) or from its own;
//! the reduced statistics equal those of the concatenated batch in f64; the FP8 counts reduce as counts; the
//! per-rank log files hold what was logged; a peer that dies gives the others a clear error in bounded time.

use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::tensor::backend::AutodiffBackend;
use burn_te::backends::Wgpu;
use burn_te::distributed::{Peer, PeerConfig};
use burn_te::nn::LinearConfig;
use burn_te::{DelayedScaling, RoleRecord, Te, TeBackend, TensorRole, fp8_autocast};
use burn_te_debug::{Debug, DebugError, DebugOptions, ReductionGroup};

use crate::common::{Rng, assert_close, reference_stats};
use crate::debug::{Collect, SESSION, temp_dir};
use crate::fp8_state::{
    D_IN, D_OUT, TOKENS, amax, assert_gemm, assert_linear_gemms, delayed_scale, matmul, quantized,
    transpose,
};
use crate::te::{tensor, values};

/// Tests that exchange over this process's collective server run one at a time.
pub(crate) static GROUP: Mutex<()> = Mutex::new(());

const PEERS: usize = 2;
const ITERATIONS: usize = 4;
const ROLES: [TensorRole; 3] = [
    TensorRole::Activation,
    TensorRole::Weight,
    TensorRole::Gradient,
];

const CONFIG: &str = r#"stats:
  enabled: True
  layers:
    layer_name_regex_pattern: '^fc$'
  transformer_engine:
    LogTensorStats:
      enabled: True
      stats: [min, max, mean, std, l1_norm, l2_norm]
      tensors: [activation, gradient, weight]
    LogFp8TensorStats:
      enabled: True
      stats: [underflows%, overflows%, mse, scale_inv_min, scale_inv_max]
      tensors: [activation, gradient]
    LogQuantizationError:
      enabled: True
      gemms: [fprop, dgrad, wgrad]
      stats: [sqnr, max_abs_error]
    DumpTensors:
      enabled: True
      tensors_struct:
        - tensor: activation
          high_precision_tensor: True
"#;

/// Each peer's batches (different means, spreads and amaxes per peer: rank 1's are larger) and the weights all
/// peers share (data parallel), per iteration.
struct Data {
    x: Vec<Vec<Vec<f32>>>,
    g: Vec<Vec<Vec<f32>>>,
    w: Vec<Vec<f32>>,
}

impl Data {
    fn new() -> Self {
        let amplitude = [1.0, 4.0, 0.5, 2.0];
        let per_peer = |seed: u64, len: usize, mean: f64, std: f64| {
            (0..PEERS)
                .map(|r| {
                    (0..ITERATIONS)
                        .map(|n| {
                            let spread = std * amplitude[n] * (1.0 + r as f64);
                            Rng::new(seed + 100 * r as u64 + n as u64).normal(
                                len,
                                mean * r as f64,
                                spread,
                            )
                        })
                        .collect()
                })
                .collect()
        };
        Data {
            x: per_peer(1, TOKENS * D_IN, 1.5, 1.0),
            g: per_peer(2, TOKENS * D_OUT, 2e-5, 1e-5),
            w: (0..ITERATIONS)
                .map(|n| Rng::new(3 + n as u64).normal(D_IN * D_OUT, 0.0, 0.1 * amplitude[n]))
                .collect(),
        }
    }

    /// Peer `rank`'s `role` tensor at iteration `n`.
    fn of(&self, role: TensorRole, rank: usize, n: usize) -> &[f32] {
        match role {
            TensorRole::Activation => &self.x[rank][n],
            TensorRole::Weight => &self.w[n],
            TensorRole::Gradient => &self.g[rank][n],
        }
    }

    /// The scale peer `rank` quantizes `role` with at iteration `n`: from the maximum amax over the peers of
    /// each earlier iteration with `reduce_amax`, from its own without.
    fn scale(&self, role: TensorRole, rank: usize, n: usize, recipe: &DelayedScaling) -> f32 {
        let amaxes: Vec<f32> = (0..ITERATIONS)
            .map(|k| {
                if recipe.reduce_amax {
                    (0..PEERS).fold(0f32, |m, r| m.max(amax(self.of(role, r, k))))
                } else {
                    amax(self.of(role, rank, k))
                }
            })
            .collect();
        delayed_scale(&amaxes, role, n, recipe)
    }
}

/// The debug sessions and this process's collective server to this test alone; a fresh log dir `name` with the
/// config.
fn exclusive_group(name: &str) -> ([std::sync::MutexGuard<'static, ()>; 2], std::path::PathBuf) {
    let session = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let group = GROUP.lock().unwrap_or_else(|p| p.into_inner());
    burn_te::distributed::reset_local_group();
    let dir = temp_dir(name);
    std::fs::write(dir.join("config.yaml"), CONFIG).unwrap();
    ([session, group], dir)
}

/// What one peer saw: its logged statistics, its GEMMs' outputs `(y, dx, dw)` per iteration, its FP8 state.
struct PeerRun {
    /// `(iteration, name, value)`.
    logged: Vec<(u64, String, f64)>,
    outputs: Vec<[Vec<f32>; 3]>,
    record: Vec<RoleRecord>,
}

/// Peer `rank` trains the layer `fc` for [`ITERATIONS`] on `S` with a debug session logging into `dir`.
fn train_peer<S: AutodiffBackend + TeBackend>(
    config: PeerConfig,
    device: &S::Device,
    recipe: &DelayedScaling,
    tensor_group: ReductionGroup,
    dir: &Path,
    data: &Data,
) -> PeerRun {
    let rank = config.rank;
    let peer = Peer::join(config).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    assert_eq!((peer.rank(), peer.world_size()), (rank, PEERS));
    let bound = peer.bind();
    assert_eq!(burn_te::distributed::rank(), rank);
    let collect = Collect::default();
    burn_te_debug::initialize(
        DebugOptions::new(dir.join("config.yaml"))
            .log_dir(dir)
            .logger(collect.clone()),
    )
    .unwrap();
    burn_te_debug::set_tensor_reduction_group(tensor_group).unwrap();
    let mut fc = LinearConfig::new(D_IN, D_OUT)
        .with_bias(false)
        .with_name(Some("fc".into()))
        .init::<S>(device);
    let mut outputs = Vec::new();
    for n in 0..ITERATIONS {
        fc.weight = Param::from_tensor(tensor(data.w[n].clone(), [D_IN, D_OUT], device));
        let x = tensor::<S, 2>(data.x[rank][n].clone(), [TOKENS, D_IN], device).require_grad();
        let y = fp8_autocast(true, recipe.clone(), || fc.forward(x.clone())).unwrap();
        let g = tensor::<S, 2>(data.g[rank][n].clone(), [TOKENS, D_OUT], device);
        let grads = (y.clone() * g).sum().backward();
        let dw = values(fc.weight.val().grad(&grads).unwrap());
        outputs.push([values(y), values(x.grad(&grads).unwrap()), dw]);
        burn_te_debug::step().unwrap_or_else(|e| panic!("rank {rank} step {n}: {e}"));
    }
    burn_te_debug::end().unwrap();
    let record = fc.fp8_meta.state().to_record().unwrap();
    drop(bound);
    peer.leave().unwrap();
    let logged = collect
        .0
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (*n, v.name.clone(), v.value))
        .collect();
    PeerRun {
        logged,
        outputs,
        record,
    }
}

/// Two peers, rank 0 on `Autodiff<Debug<Te<Wgpu>>>` and rank 1 on `Autodiff<Debug<Te<Flex>>>`, each in a
/// thread; `groups[r]` is rank r's tensor reduction group.
fn train_two_peers(
    name: &str,
    recipe: &DelayedScaling,
    groups: [ReductionGroup; PEERS],
    data: &Data,
) -> (std::path::PathBuf, Vec<PeerRun>) {
    burn_te::distributed::reset_local_group();
    let dir = temp_dir(name);
    std::fs::write(dir.join("config.yaml"), CONFIG).unwrap();
    let wgpu = crate::te::device();
    let [g0, g1] = groups;
    // Rank 0's first step compiles its kernels on lavapipe while rank 1 waits in the statistics' reduction: over
    // 120 s on a 2-core Firecracker VM (2026-11-30), so the collective timeout leaves room for that.
    let local = |rank| PeerConfig::local(rank, PEERS).with_timeout(Duration::from_secs(600));
    let runs = std::thread::scope(|s| {
        let dir = &dir;
        let wgpu = &wgpu;
        let r0 = s.spawn(move || {
            train_peer::<Autodiff<Debug<Te<Wgpu>>>>(local(0), wgpu, recipe, g0, dir, data)
        });
        let r1 = s.spawn(move || {
            let flex = Default::default();
            train_peer::<Autodiff<Debug<Te<Flex>>>>(local(1), &flex, recipe, g1, dir, data)
        });
        [r0, r1].map(|h| h.join().unwrap_or_else(|_| panic!("a peer panicked")))
    });
    (dir, runs.into())
}

/// Every GEMM of every peer equals the f64 product of its operands quantized with the recomputed scales.
fn check_gemms(what: &str, data: &Data, recipe: &DelayedScaling, runs: &[PeerRun]) {
    for (rank, run) in runs.iter().enumerate() {
        for (n, [y, dx, dw]) in run.outputs.iter().enumerate() {
            let operands = ROLES.map(|role| {
                let scale = data.scale(role, rank, n, recipe);
                let format = recipe.fp8_format.for_role(role);
                quantized(data.of(role, rank, n), scale, format).1
            });
            assert_linear_gemms(
                &format!("{what} rank {rank} it {n}"),
                &operands,
                y,
                dx,
                Some(dw),
            );
        }
    }
}

/// The value `name` logged at iteration `n`.
fn logged(run: &PeerRun, name: &str, n: usize) -> f64 {
    run.logged
        .iter()
        .find(|(i, stat, _)| *i == n as u64 && stat == name)
        .map(|(_, _, value)| *value)
        .unwrap_or_else(|| panic!("{name} at {n} not logged"))
}

/// The statistics a peer logged equal the f64 re-computation over the batches of the peers in `ranks`: the
/// tensor statistics of their concatenation, the FP8 counts summed over each peer's quantization with its own
/// scale.
fn check_stats(what: &str, data: &Data, recipe: &DelayedScaling, run: &PeerRun, ranks: &[usize]) {
    for n in 0..ITERATIONS {
        for role in [TensorRole::Activation, TensorRole::Gradient] {
            let name = role.name();
            let all: Vec<f32> = ranks
                .iter()
                .flat_map(|&r| data.of(role, r, n).iter().copied())
                .collect();
            let reference = reference_stats(&all);
            for (stat, expected) in [
                ("min", reference.min),
                ("max", reference.max),
                ("mean", reference.mean),
                ("std", reference.std),
                ("l1_norm", reference.l1),
                ("l2_norm", reference.l2),
            ] {
                let value = logged(run, &format!("fc_{name}_{stat}"), n);
                let floor = 1e-6 * reference.l1 / all.len() as f64;
                assert_close(
                    &format!("{what} it {n} {name} {stat}"),
                    value,
                    expected,
                    2e-5,
                    floor,
                );
            }
            // FP8: every peer quantized its batch with its own scale; counts and squared errors add up.
            let format = recipe.fp8_format.for_role(role);
            let (mut underflows, mut overflows, mut squared_error) = (0usize, 0usize, 0f64);
            let (mut scale_inv_min, mut scale_inv_max) = (f64::INFINITY, 0f64);
            for &r in ranks {
                let scale = data.scale(role, r, n, recipe);
                let scale_inv = 1.0 / scale;
                let values = data.of(role, r, n);
                let (codes, _) = quantized(values, scale, format);
                for (&v, &c) in values.iter().zip(&codes) {
                    underflows += usize::from(v != 0.0 && c & 0x7f == 0);
                    overflows += usize::from(v.abs() > format.max() * scale_inv);
                    let error = v - format.decode(c) * scale_inv;
                    squared_error += f64::from(error * error);
                }
                scale_inv_min = scale_inv_min.min(f64::from(scale_inv));
                scale_inv_max = scale_inv_max.max(f64::from(scale_inv));
            }
            let numel = all.len() as f64;
            for (stat, expected, rel) in [
                ("underflows%", 100.0 * underflows as f64 / numel, 1e-12),
                ("overflows%", 100.0 * overflows as f64 / numel, 1e-12),
                ("mse", squared_error / numel, 1e-5),
                ("scale_inv_min", scale_inv_min, 0.0),
                ("scale_inv_max", scale_inv_max, 0.0),
            ] {
                let value = logged(run, &format!("fc_{name}_{stat}"), n);
                assert_close(
                    &format!("{what} it {n} {name} {stat}"),
                    value,
                    expected,
                    rel,
                    0.0,
                );
            }
        }
        // Weights: each peer's own (data-parallel peers hold the same one).
        let weight = reference_stats(&data.w[n]);
        for (stat, expected) in [
            ("min", weight.min),
            ("max", weight.max),
            ("std", weight.std),
        ] {
            let value = logged(run, &format!("fc_weight_{stat}"), n);
            assert_close(
                &format!("{what} it {n} weight {stat}"),
                value,
                expected,
                2e-5,
                0.0,
            );
        }
    }
}

/// The error stats a peer logged (LogQuantizationError) equal the f64 re-computation over the GEMMs of the peers
/// in `ranks`: Σr² and Σ(y−r)² summed, max|y−r| the largest, with `y` each peer's output and `r` the f64 GEMM of
/// its high-precision operands.
fn check_error_stats(what: &str, data: &Data, runs: &[PeerRun], run: &PeerRun, ranks: &[usize]) {
    let gemm = |a: &[f32], a_t: bool, b: &[f32], b_t: bool, (m, k, n): (usize, usize, usize)| {
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|p| {
                        let x = if a_t { a[p * m + i] } else { a[i * k + p] };
                        let y = if b_t { b[j * k + p] } else { b[p * n + j] };
                        f64::from(x) * f64::from(y)
                    })
                    .sum();
            }
        }
        out
    };
    for n in 0..ITERATIONS {
        for (slot, tensor) in ["output", "dgrad", "wgrad"].into_iter().enumerate() {
            let (mut signal, mut noise, mut max_abs) = (0f64, 0f64, 0f64);
            for &r in ranks {
                let (x, g, w) = (&data.x[r][n], &data.g[r][n], &data.w[n]);
                let reference = match slot {
                    0 => gemm(x, false, w, false, (TOKENS, D_IN, D_OUT)),
                    1 => gemm(g, false, w, true, (TOKENS, D_OUT, D_IN)),
                    _ => gemm(x, true, g, false, (D_IN, TOKENS, D_OUT)),
                };
                for (&y, &r) in runs[r].outputs[n][slot].iter().zip(&reference) {
                    let e = f64::from(y) - r;
                    signal += r * r;
                    noise += e * e;
                    max_abs = max_abs.max(e.abs());
                }
            }
            let sqnr = 10.0 * (signal / noise).log10();
            let logged_sqnr = logged(run, &format!("fc_{tensor}_sqnr"), n);
            assert!(
                (logged_sqnr - sqnr).abs() <= 1e-3,
                "{what} it {n} {tensor} sqnr: logged {logged_sqnr} vs f64 {sqnr}"
            );
            let name = format!("{what} it {n} {tensor} max_abs_error");
            let value = logged(run, &format!("fc_{tensor}_max_abs_error"), n);
            assert_close(&name, value, max_abs, 1e-4, 1e-7 * signal.sqrt());
        }
    }
}

/// The per-rank statistics log holds each collected value's line.
fn check_log_file(what: &str, dir: &Path, rank: usize, run: &PeerRun) {
    let path = dir.join(format!(
        "nvdlfw_inspect_statistics_logs/nvdlfw_inspect_globalrank-{rank}.log"
    ));
    let log = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    for (n, name, value) in &run.logged {
        let line = burn_te_debug::stat_message(name, *n, *value);
        assert!(
            log.contains(&line),
            "{what}: {} lacks {line:?}",
            path.display()
        );
    }
    assert_eq!(
        log.lines().count(),
        run.logged.len(),
        "{what}: {}",
        path.display()
    );
}

/// Peers that reduced everything over both ranks (`reduce_amax`, groups `All`): their GEMMs, statistics and log
/// files against the re-computation, their FP8 states bit-identical.
fn check_reduced_runs(
    what: &str,
    dir: &Path,
    data: &Data,
    recipe: &DelayedScaling,
    runs: &[PeerRun],
) {
    check_gemms(what, data, recipe, runs);
    for (rank, run) in runs.iter().enumerate() {
        check_stats(&format!("{what}, rank {rank}"), data, recipe, run, &[0, 1]);
        check_error_stats(&format!("{what}, rank {rank}"), data, runs, run, &[0, 1]);
        check_log_file(what, dir, rank, run);
    }
    for role in ROLES {
        assert_eq!(
            state_of(&runs[0], role),
            state_of(&runs[1], role),
            "{what}: {}",
            role.name()
        );
    }
}

/// The scale and the history behind it (slots 1.., the rolled ones) of `role` in a peer's FP8 state.
fn state_of(run: &PeerRun, role: TensorRole) -> (u32, Vec<u32>) {
    let (_, history, scale, _) = run
        .record
        .iter()
        .find(|(name, ..)| name == role.name())
        .unwrap_or_else(|| panic!("no {} state", role.name()));
    (
        scale.to_bits(),
        history[1..].iter().map(|h| h.to_bits()).collect(),
    )
}

#[test]
fn two_peers_reduce_amax_and_statistics_exactly() {
    let _session = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let _group = GROUP.lock().unwrap_or_else(|p| p.into_inner());
    let data = Data::new();

    // reduce_amax (TE's default) and the default groups: every peer quantizes with the same scales and logs the
    // statistics of the concatenated batch.
    let recipe = DelayedScaling::default();
    assert!(recipe.reduce_amax);
    let groups = [ReductionGroup::All, ReductionGroup::All];
    let (dir, runs) = train_two_peers("distributed-reduced", &recipe, groups, &data);
    check_reduced_runs("reduced", &dir, &data, &recipe, &runs);
    // The reduced values are the same bits on both peers (the weight's are each peer's own, from its backend).
    let bits = |run: &PeerRun| -> Vec<(String, u64)> {
        let mut v: Vec<_> = run
            .logged
            .iter()
            .filter(|(_, name, _)| !name.contains("weight"))
            .map(|(n, name, value)| (format!("{n} {name}"), value.to_bits()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(bits(&runs[0]).len(), ITERATIONS * (2 * 11 + 3 * 2));
    assert_eq!(
        bits(&runs[0]),
        bits(&runs[1]),
        "the peers log the same values"
    );
    // The reduction mattered: rank 0's own amaxes would have given other scales.
    let own = DelayedScaling {
        reduce_amax: false,
        ..recipe.clone()
    };
    assert!(
        (1..ITERATIONS).all(|n| data.scale(TensorRole::Activation, 0, n, &recipe)
            != data.scale(TensorRole::Activation, 0, n, &own)),
        "the test data must give the peers different amaxes"
    );

    // reduce_amax off: each peer its own scales; rank 0 reduces the statistics over both ranks, rank 1 keeps its own.
    let groups = [ReductionGroup::Ranks(vec![0, 1]), ReductionGroup::Alone];
    let (dir, runs) = train_two_peers("distributed-own", &own, groups, &data);
    check_gemms("own amax", &data, &own, &runs);
    check_stats("own amax, rank 0", &data, &own, &runs[0], &[0, 1]);
    check_stats("own amax, rank 1", &data, &own, &runs[1], &[1]);
    check_error_stats("own amax, rank 0", &data, &runs, &runs[0], &[0, 1]);
    check_error_stats("own amax, rank 1", &data, &runs, &runs[1], &[1]);
    for (rank, run) in runs.iter().enumerate() {
        check_log_file("own amax", &dir, rank, run);
    }
    for role in [TensorRole::Activation, TensorRole::Gradient] {
        assert_ne!(
            state_of(&runs[0], role),
            state_of(&runs[1], role),
            "{}",
            role.name()
        );
    }
    assert_eq!(
        state_of(&runs[0], TensorRole::Weight),
        state_of(&runs[1], TensorRole::Weight)
    );
}

/// Rows per expert, per iteration and rank, of [`moe_experts_without_rows_take_part_in_reduce_amax`]: expert 0
/// has none on rank 0 at iteration 1, on both ranks at iteration 2 (where rank 1 has no rows at all), expert 1
/// none on rank 0 at iteration 3.
const MOE_SPLITS: [[[usize; 2]; PEERS]; ITERATIONS] = [
    [[16, 8], [8, 16]],
    [[0, 24], [12, 4]],
    [[0, 24], [0, 0]],
    [[24, 0], [8, 16]],
];

/// Mixture of experts, data parallel: each rank's `GroupedLinear` gets its tokens routed differently, and under
/// DelayedScaling with `reduce_amax` an expert without rows on a rank still takes part in its amax reductions, as
/// TE's empty split records an amax of 0 for its input and gradient and its weight's own. Without that, the ranks'
/// reductions pair different tensors and then wait for each other (each peer's timeout turns the hang into an
/// error). Every expert GEMM of every rank at every iteration equals the f64 product of its operands quantized
/// with the scales recomputed from the maximum over the ranks of each iteration's amaxes (0 for no rows).
#[test]
fn moe_experts_without_rows_take_part_in_reduce_amax() {
    type S = burn::backend::Autodiff<Te<Flex>>;
    let _group = GROUP.lock().unwrap_or_else(|p| p.into_inner());
    burn_te::distributed::reset_local_group();
    // A window of two iterations: each scale follows the last two amaxes, so an amax of 0 and the weight's amax of
    // an iteration without rows both change the next scales.
    let recipe = DelayedScaling {
        amax_history_len: 2,
        ..DelayedScaling::default()
    };
    assert!(recipe.reduce_amax);
    let rows = |rank: usize, n: usize| -> usize { MOE_SPLITS[n][rank].iter().sum() };
    let amplitude = [1.0, 4.0, 0.5, 2.0];
    let normal = |seed: u64, len: usize, std: f64| Rng::new(seed).normal(len, 0.0, std);
    // Each rank's rows at each iteration, `cols` wide, with spread `std(rank, iteration)`.
    let per_rank =
        |seed: u64, cols: usize, std: &dyn Fn(usize, usize) -> f64| -> Vec<Vec<Vec<f32>>> {
            let seed = |r: usize, n: usize| seed + 10 * r as u64 + n as u64;
            (0..PEERS)
                .map(|r| {
                    (0..ITERATIONS)
                        .map(|n| normal(seed(r, n), rows(r, n) * cols, std(r, n)))
                        .collect()
                })
                .collect()
        };
    let x = per_rank(10, D_IN, &|r, n| amplitude[n] * (1.0 + r as f64));
    let g = per_rank(50, D_OUT, &|_, n| 1e-3 * amplitude[3 - n]);
    let w: Vec<[Vec<f32>; 2]> = (0..ITERATIONS)
        .map(|n| {
            [0, 1].map(|e| {
                normal(
                    90 + 2 * n as u64 + e,
                    D_IN * D_OUT,
                    0.1 * amplitude[n] * (1.0 + e as f64),
                )
            })
        })
        .collect();

    // Each rank's (y, dx, dw per expert) per iteration.
    type Outputs = Vec<(Vec<f32>, Vec<f32>, Vec<Option<Vec<f32>>>)>;
    let train = |rank: usize| -> Outputs {
        let config = PeerConfig::local(rank, PEERS).with_timeout(Duration::from_secs(20));
        let peer = Peer::join(config).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        let bound = peer.bind();
        let device = Default::default();
        let mut group = burn_te::nn::GroupedLinearConfig::new(2, D_IN, D_OUT)
            .with_bias(false)
            .with_name(Some("moe.experts".into()))
            .init::<S>(&device);
        let mut outputs = Vec::new();
        for n in 0..ITERATIONS {
            for (e, weight) in group.weights.iter_mut().enumerate() {
                *weight = Param::from_tensor(tensor(w[n][e].clone(), [D_IN, D_OUT], &device));
            }
            let m = rows(rank, n);
            let xt = tensor::<S, 2>(x[rank][n].clone(), [m, D_IN], &device).require_grad();
            let splits = MOE_SPLITS[n][rank];
            let y = fp8_autocast(true, recipe.clone(), || {
                group.try_forward(xt.clone(), &splits)
            })
            .unwrap()
            .unwrap_or_else(|e| panic!("rank {rank} iteration {n}: {e}"));
            let gt = tensor::<S, 2>(g[rank][n].clone(), [m, D_OUT], &device);
            let grads = (y.clone() * gt).sum().backward();
            let dw = group
                .weights
                .iter()
                .map(|p| p.val().grad(&grads).map(values))
                .collect();
            // A rank without rows runs no dgrad: its input (of no rows) gets no gradient.
            let dx = xt.grad(&grads).map(values).unwrap_or_default();
            outputs.push((values(y), dx, dw));
        }
        let counts = burn_te::fallback::fallback_counts();
        assert!(
            !counts.contains_key("expert state not updated"),
            "rank {rank}: {counts:?}"
        );
        drop(bound);
        peer.leave().unwrap();
        outputs
    };
    let runs: Vec<Outputs> = std::thread::scope(|s| {
        let handles = [0, 1].map(|rank| s.spawn(move || train(rank)));
        handles
            .map(|h| h.join().unwrap_or_else(|_| panic!("a peer panicked")))
            .into()
    });

    // Expert e's rows of rank r's `data` (`cols` wide) at iteration n.
    let expert_rows = |data: &[f32], r: usize, n: usize, e: usize, cols: usize| -> Vec<f32> {
        let start: usize = MOE_SPLITS[n][r][..e].iter().sum();
        data[start * cols..(start + MOE_SPLITS[n][r][e]) * cols].to_vec()
    };
    for e in 0..2 {
        let reduced = |of: &dyn Fn(usize, usize) -> Vec<f32>| -> Vec<f32> {
            (0..ITERATIONS)
                .map(|n| (0..PEERS).fold(0f32, |a, r| a.max(amax(&of(r, n)))))
                .collect()
        };
        let x_of = |r: usize, n: usize| expert_rows(&x[r][n], r, n, e, D_IN);
        let g_of = |r: usize, n: usize| expert_rows(&g[r][n], r, n, e, D_OUT);
        let amaxes = [
            reduced(&x_of),
            (0..ITERATIONS).map(|n| amax(&w[n][e])).collect(),
            reduced(&g_of),
        ];
        for (rank, run) in runs.iter().enumerate() {
            for (n, (y, dx, dw)) in run.iter().enumerate() {
                let m = MOE_SPLITS[n][rank][e];
                let what = format!("rank {rank} iteration {n} expert {e}");
                assert_eq!(dw[e].is_some(), m > 0, "{what}: a weight gradient iff rows");
                if m == 0 {
                    continue;
                }
                let [qx, qw, qg] = [(x_of(rank, n), 0), (w[n][e].clone(), 1), (g_of(rank, n), 2)]
                    .map(|(values, i)| {
                        let role = ROLES[i];
                        let scale = delayed_scale(&amaxes[i], role, n, &recipe);
                        quantized(&values, scale, recipe.fp8_format.for_role(role)).1
                    });
                let rows_of = |t: &[f32], cols: usize| expert_rows(t, rank, n, e, cols);
                assert_gemm(
                    &format!("{what} fprop"),
                    &rows_of(y, D_OUT),
                    &matmul(&qx, &qw, m, D_IN, D_OUT),
                );
                let wt = transpose(&qw, D_IN, D_OUT);
                assert_gemm(
                    &format!("{what} dgrad"),
                    &rows_of(dx, D_IN),
                    &matmul(&qg, &wt, m, D_OUT, D_IN),
                );
                let xt = transpose(&qx, m, D_IN);
                let dw = dw[e].as_ref().unwrap();
                assert_gemm(
                    &format!("{what} wgrad"),
                    dw,
                    &matmul(&xt, &qg, D_IN, m, D_OUT),
                );
            }
        }
    }
}

#[test]
fn a_peer_that_dies_fails_the_others_within_the_timeout() {
    let (_guards, dir) = exclusive_group("distributed-dead-peer");
    let timeout = Duration::from_secs(2);
    let survivor = std::thread::scope(|s| {
        // Rank 1 joins, takes part in one exchange and dies (its thread ends without leaving).
        s.spawn(|| {
            let peer = Peer::join(PeerConfig::local(1, PEERS).with_timeout(timeout)).unwrap();
            peer.all_reduce_max(&[2.0, -1.0]).unwrap();
        });
        s.spawn(|| {
            let peer = Peer::join(PeerConfig::local(0, PEERS).with_timeout(timeout)).unwrap();
            assert_eq!(peer.all_reduce_max(&[1.0, 3.0]).unwrap(), vec![2.0, 3.0]);
            peer
        })
        .join()
        .unwrap()
    });

    // The survivor's debug session: it logs its statistics, the reduction at step() fails in bounded time.
    let _bound = survivor.bind();
    let collect = Collect::default();
    burn_te_debug::initialize(
        DebugOptions::new(dir.join("config.yaml"))
            .log_dir(&dir)
            .logger(collect.clone()),
    )
    .unwrap();
    // The host path: no shader compiled on first use inside the measured step (on lavapipe under gVisor, a first
    // step's kernels took a minute to compile).
    let device = Default::default();
    type S = Autodiff<Debug<Te<Flex>>>;
    let fc = LinearConfig::new(D_IN, D_OUT)
        .with_name(Some("fc".into()))
        .init::<S>(&device);
    let x = Rng::new(9).normal(TOKENS * D_IN, 0.0, 1.0);
    let y = fp8_autocast(true, DelayedScaling::default(), || {
        fc.forward(tensor::<S, 2>(x.clone(), [TOKENS, D_IN], &device))
    })
    .unwrap();
    y.sum().backward();
    let started = Instant::now();
    let err = burn_te_debug::step().expect_err("the dead peer cannot answer");
    let waited = started.elapsed();
    assert!(
        waited < timeout + Duration::from_secs(3),
        "waited {waited:?}"
    );
    match &err {
        DebugError::Reduction { iteration, reason } => {
            assert_eq!(*iteration, 0);
            assert!(
                reason.contains("peer 0 of 2") && reason.contains("no answer"),
                "{reason}"
            );
        }
        other => panic!("expected a reduction error, got {other}"),
    }
    // Nothing lost: this peer's own statistics are logged (its batch alone).
    let own = reference_stats(&x);
    let value = collect
        .0
        .lock()
        .unwrap()
        .iter()
        .find(|(_, v)| v.name == "fc_activation_std")
        .map(|(_, v)| v.value)
        .expect("the peer's own statistics are logged");
    assert_close("own std", value, own.std, 2e-5, 0.0);
    let main =
        std::fs::read_to_string(dir.join("nvdlfw_inspect_logs/nvdlfw_inspect_globalrank-0.log"))
            .unwrap();
    assert!(main.contains("no answer"), "{main}");
    // The group is broken: further collectives are refused at once.
    let started = Instant::now();
    let err = survivor.all_reduce_max(&[1.0]).unwrap_err().to_string();
    assert!(started.elapsed() < Duration::from_millis(500));
    assert!(
        err.contains("refused") && err.contains("failed earlier"),
        "{err}"
    );
    // end() still ends the session; its last exchange is refused too.
    let err = burn_te_debug::end().unwrap_err().to_string();
    assert!(err.contains("refused"), "{err}");
    assert_eq!(burn_te_debug::iteration(), None);
    burn_te::distributed::reset_local_group();
}

/// A free TCP port of the loopback interface.
pub(crate) fn free_port() -> u16 {
    free_ports(1)[0]
}

/// `n` distinct free TCP ports of the loopback interface (held until all are chosen: a port released at once may be
/// handed out again).
pub(crate) fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a free loopback port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("its address").port())
        .collect()
}

/// A child process running the ignored test `test` of this binary with `envs`.
pub(crate) fn child(test: &str, envs: &[(&str, String)]) -> std::process::Child {
    let exe = std::env::current_exe().expect("the test binary");
    // The child (and the processes it starts) multiply on this process's host GEMM path: each process's probe
    // times the paths anew, and on a loaded machine two probes can choose differently (every path is exact within
    // its bound, but the paths do not give the same bits, and the tests compare processes with 1e-6).
    let host_gemm = burn_te::backends::host::gemm::requested_host_gemm_path().name();
    std::process::Command::new(exe)
        .env("BURN_TE_HOST_GEMM", host_gemm)
        .args([
            "--exact",
            test,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {test}: {e}"))
}

/// Waits for `child` at most until `deadline` (then kills it); its exit status, or None when killed.
pub(crate) fn wait_until(
    child: &mut std::process::Child,
    deadline: Instant,
) -> Option<std::process::ExitStatus> {
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An orchestrator process and [`PEERS`] processes running the ignored test `peer_test`, each told its rank, the
/// orchestrator, its own port, the collective timeout, `dir` and its output file `out(rank)`; the orchestrator is
/// child 0, rank r child r + 1.
fn spawn_group(
    peer_test: &str,
    timeout_s: u64,
    dir: &Path,
    out: impl Fn(usize) -> std::path::PathBuf,
) -> Reaper {
    spawn_peers(peer_test, timeout_s, dir, out, |_| Some(Vec::new()))
}

/// [`spawn_group`] with each rank's own environment on top (`env(rank)`; `None`: that rank is not started).
pub(crate) fn spawn_peers(
    peer_test: &str,
    timeout_s: u64,
    dir: &Path,
    out: impl Fn(usize) -> std::path::PathBuf,
    env: impl Fn(usize) -> Option<Vec<(&'static str, String)>>,
) -> Reaper {
    let ports = free_ports(1 + PEERS);
    let orchestrator = ports[0];
    let mut children = Reaper(vec![child(
        "distributed::orchestrator_process",
        &[("BURN_TE_TEST_ORCHESTRATOR_PORT", orchestrator.to_string())],
    )]);
    for rank in 0..PEERS {
        let Some(extra) = env(rank) else { continue };
        let mut envs = vec![
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", PEERS.to_string()),
            (
                "BURN_TE_ORCHESTRATOR",
                format!("ws://127.0.0.1:{orchestrator}"),
            ),
            ("BURN_TE_NODE_PORT", ports[1 + rank].to_string()),
            ("BURN_TE_COLLECTIVE_TIMEOUT_S", timeout_s.to_string()),
            ("BURN_TE_TEST_DIR", dir.display().to_string()),
            ("BURN_TE_TEST_PEER_OUT", out(rank).display().to_string()),
        ];
        envs.extend(extra);
        children.0.push(child(peer_test, &envs));
    }
    children
}

/// Kills the child processes when dropped (a failed assertion leaves no process behind).
pub(crate) struct Reaper(pub(crate) Vec<std::process::Child>);
impl Drop for Reaper {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The orchestrator of [`peers_in_processes_over_loopback`], as a child process (burn-collective's server code
/// sets up process-wide logging, kept out of this test process).
#[test]
#[ignore = "a child process of peers_in_processes_over_loopback"]
fn orchestrator_process() {
    let Ok(port) = std::env::var("BURN_TE_TEST_ORCHESTRATOR_PORT") else {
        return;
    };
    burn_te::distributed::start_orchestrator(port.parse().unwrap());
    std::thread::sleep(Duration::from_secs(300));
}

/// A peer of [`peers_in_processes_over_loopback`], as a child process: its rank and group from the environment
/// (`PeerConfig::from_env`), training on Flex; writes what it saw as JSON.
#[test]
#[ignore = "a child process of peers_in_processes_over_loopback"]
fn peer_process() {
    let Ok(out) = std::env::var("BURN_TE_TEST_PEER_OUT") else {
        return;
    };
    let dir = std::path::PathBuf::from(std::env::var("BURN_TE_TEST_DIR").unwrap());
    let run = train_peer::<Autodiff<Debug<Te<Flex>>>>(
        PeerConfig::from_env().unwrap(),
        &Default::default(),
        &DelayedScaling::default(),
        ReductionGroup::All,
        &dir,
        &Data::new(),
    );
    // Bits, so the values cross the JSON text exactly.
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let json = serde_json::json!({
        "logged": run.logged.iter().map(|(n, name, v)| (n, name, v.to_bits())).collect::<Vec<_>>(),
        "outputs": run.outputs.iter().map(|o| o.each_ref().map(|v| bits(v))).collect::<Vec<_>>(),
        "record": run.record.iter().map(|(role, h, scale, pending)| (role, bits(h), scale.to_bits(), pending))
            .collect::<Vec<_>>(),
    });
    std::fs::write(out, json.to_string()).unwrap();
}

#[test]
fn peers_in_processes_over_loopback() {
    let dir = temp_dir("distributed-processes");
    std::fs::write(dir.join("config.yaml"), CONFIG).unwrap();
    let out = |rank: usize| dir.join(format!("peer_{rank}.json"));
    let mut children = spawn_group("distributed::peer_process", 30, &dir, out);
    let deadline = Instant::now() + Duration::from_secs(120);
    for rank in 0..PEERS {
        let status = wait_until(&mut children.0[1 + rank], deadline);
        let main_log = dir.join(format!(
            "nvdlfw_inspect_logs/nvdlfw_inspect_globalrank-{rank}.log"
        ));
        assert!(
            status.is_some_and(|s| s.success()),
            "peer process {rank}: {status:?}; its main log: {:?}",
            std::fs::read_to_string(main_log)
        );
    }
    let data = Data::new();
    let recipe = DelayedScaling::default();
    let runs: Vec<PeerRun> = (0..PEERS)
        .map(|rank| {
            let text = std::fs::read_to_string(out(rank)).unwrap();
            let json: serde_json::Value = serde_json::from_str(&text).unwrap();
            let floats = |v: Vec<u32>| v.into_iter().map(f32::from_bits).collect::<Vec<_>>();
            let logged: Vec<(u64, String, u64)> =
                serde_json::from_value(json["logged"].clone()).unwrap();
            let outputs: Vec<[Vec<u32>; 3]> =
                serde_json::from_value(json["outputs"].clone()).unwrap();
            let record: Vec<(String, Vec<u32>, u32, bool)> =
                serde_json::from_value(json["record"].clone()).unwrap();
            PeerRun {
                logged: logged
                    .into_iter()
                    .map(|(n, name, v)| (n, name, f64::from_bits(v)))
                    .collect(),
                outputs: outputs.into_iter().map(|o| o.map(floats)).collect(),
                record: record
                    .into_iter()
                    .map(|(role, h, scale, pending)| {
                        (role, floats(h), f32::from_bits(scale), pending)
                    })
                    .collect(),
            }
        })
        .collect();
    check_reduced_runs("processes", &dir, &data, &recipe, &runs);
}

/// A peer of [`a_killed_peer_process_fails_the_others_within_the_timeout`]: exchanges maxima every 20 ms,
/// writing how many succeeded, until one fails; then writes the error.
#[test]
#[ignore = "a child process of a_killed_peer_process_fails_the_others_within_the_timeout"]
fn exchanging_peer_process() {
    let Ok(out) = std::env::var("BURN_TE_TEST_PEER_OUT") else {
        return;
    };
    let peer = Peer::join(PeerConfig::from_env().unwrap()).unwrap();
    for done in 1..=3000 {
        if let Err(err) = peer.all_reduce_max(&[done as f32]) {
            std::fs::write(&out, format!("error after {done}: {err}")).unwrap();
            return;
        }
        std::fs::write(&out, done.to_string()).unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_killed_peer_process_fails_the_others_within_the_timeout() {
    let dir = temp_dir("distributed-killed");
    let timeout_s = 3;
    let out = |rank: usize| dir.join(format!("peer_{rank}.txt"));
    let mut children = spawn_group("distributed::exchanging_peer_process", timeout_s, &dir, out);
    // Both exchange a few times, then rank 1 is killed.
    let progress = |rank: usize| {
        std::fs::read_to_string(out(rank))
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
    };
    let started = Instant::now();
    while !(0..PEERS).all(|r| progress(r).is_some_and(|n| n >= 5)) {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the peers never exchanged"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    children.0[2].kill().unwrap();
    let killed = Instant::now();
    let status = wait_until(
        &mut children.0[1],
        killed + Duration::from_secs(timeout_s + 10),
    );
    let waited = killed.elapsed();
    assert!(status.is_some(), "rank 0 hung after its peer was killed");
    let report = std::fs::read_to_string(out(0)).unwrap();
    assert!(
        report.starts_with("error after") && report.contains("peer 0 of 2"),
        "rank 0: {report}"
    );
    assert!(
        waited <= Duration::from_secs(timeout_s + 3),
        "rank 0 failed after {waited:?}: {report}"
    );
    eprintln!("rank 0, {waited:?} after its peer was killed: {report}");
}

#[test]
fn stat_loggers_write_from_the_chosen_ranks_logs_and_dumps_from_every_rank() {
    let (_guards, dir) = exclusive_group("distributed-logger-ranks");
    type S = Autodiff<Debug<Te<Flex>>>;
    let collected = std::thread::scope(|s| {
        let handles: Vec<_> = (0..PEERS)
            .map(|rank| {
                let dir = &dir;
                s.spawn(move || {
                    let peer = Peer::join(PeerConfig::local(rank, PEERS)).unwrap();
                    let _bound = peer.bind();
                    // As TE gives a TensorBoard writer to chosen ranks: the stat loggers only on rank 0.
                    let collect = Collect::default();
                    burn_te_debug::initialize(
                        DebugOptions::new(dir.join("config.yaml"))
                            .log_dir(dir)
                            .logger(collect.clone())
                            .logger_ranks([0]),
                    )
                    .unwrap();
                    let device = Default::default();
                    let fc = LinearConfig::new(D_IN, D_OUT)
                        .with_name(Some("fc".into()))
                        .init::<S>(&device);
                    let x = Rng::new(rank as u64).normal(TOKENS * D_IN, 0.0, 1.0);
                    let y = fp8_autocast(true, DelayedScaling::default(), || {
                        fc.forward(tensor::<S, 2>(x, [TOKENS, D_IN], &device))
                    })
                    .unwrap();
                    y.sum().backward();
                    burn_te_debug::step().unwrap();
                    burn_te_debug::end().unwrap();
                    drop(_bound);
                    peer.leave().unwrap();
                    collect.0.lock().unwrap().len()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(collected[0] > 0, "rank 0's logger got the statistics");
    assert_eq!(collected[1], 0, "rank 1 has no stat logger");
    for rank in 0..PEERS {
        let log = dir.join(format!(
            "nvdlfw_inspect_statistics_logs/nvdlfw_inspect_globalrank-{rank}.log"
        ));
        let lines = std::fs::read_to_string(&log).unwrap().lines().count();
        assert_eq!(lines, collected[0], "{}", log.display());
        // Each rank's dump under rank_<r>/ holds its own activation.
        let dump = dir.join(format!(
            "tensor_dumps/rank_{rank}/iter_000000/fc_activation.safetensors"
        ));
        let (tensors, _) = crate::debug::read_safetensors(&dump);
        let x = Rng::new(rank as u64).normal(TOKENS * D_IN, 0.0, 1.0);
        let dumped = crate::debug::f32s(&tensors["high_precision"].2);
        assert_eq!(
            dumped.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{}",
            dump.display()
        );
    }
}
