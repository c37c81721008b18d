//! Training on several peers: a [`Peer`] knows its rank and world size and exchanges small host values with the
//! other peers over [burn-collective](https://docs.rs/burn-collective) — its local server between threads of one
//! process (one peer per thread, each with its device or backend instance), its global orchestrator between
//! processes and machines.
//!
//! What uses it:
//! - data parallelism: the model's gradients averaged over every peer each step ([`Peer::all_reduce_gradients`],
//!   in [`gradients`]), so the replicas stay identical; the peers check at start that they run the same
//!   recipe and run ([`Peer::agree_on`]); [`launch`] starts the processes in torchrun's style;
//! - the delayed-scaling amax reduction (`reduce_amax`, TE's default): every peer quantizes with the same scale
//!   (see [`crate::fp8_state`]);
//! - the debug tools' statistics, reduced exactly across peers at `step()` (burn-te-debug);
//! - the rank in log, dump and snapshot paths ([`rank`]).
//!
//! A peer is *bound* to the threads that run its training ([`Peer::bind`]); the rank and the reductions then
//! apply to what those threads run. Without a bound peer, the rank is `RANK` (as torchrun sets it) or 0 and
//! nothing is reduced.
//!
//! Every collective call blocks until all peers made it, in the same order (they run the same program), and
//! fails with [`TeError::Collective`] — naming the peer, the operation and the time waited — when a peer does not
//! answer within [`PeerConfig::timeout`] (a peer that died, or one that took another path). After a failure the
//! peer refuses further collectives with the same error: its group is broken.
//!
//! burn-collective reduces by sum or mean only. The exchanges here are all-gathers built on its sum: each peer
//! writes its values, as 32-bit integers held exactly by `f64`, into its own slot of a zero tensor, so the sum
//! is each peer's values bit for bit, whatever order the reduction adds in. Maxima and the statistics' merges
//! are then computed on the host from the exact values. The exchanges run on burn-collective's server for
//! [`ExchangeBackend`] (`NdArray<f64>`), apart from the training's own backend and any collective calls the
//! application makes on it.
//!
//! Across processes the exchanges go through burn-collective's global orchestrator (burn-collective 0.21.0 is
//! vendored with a fix: its global level hung at a process's second operation; `vendor/README.md`).

use std::cell::RefCell;
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use burn::backend::NdArray;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use burn_collective::{CollectiveConfig, PeerId, ReduceOperation};

use crate::error::TeError;
use crate::settings::distributed as settings;

pub mod gradients;
pub mod launch;
pub mod tensor_parallel;

/// How a [`Peer`] joins its group.
#[derive(Clone, Debug)]
pub struct PeerConfig {
    /// This peer's rank, `0..world_size`.
    pub rank: usize,
    /// The number of peers.
    pub world_size: usize,
    /// How long a collective call waits for the other peers before it fails (default 60 s).
    pub timeout: Duration,
    /// The most gradient values one exchange of [`Peer::all_reduce_gradients`] carries (default 4 Mi, 32 MiB as
    /// `f64`; DDP's `bucket_cap_mb`).
    pub gradient_bucket: usize,
    /// Across processes: burn-collective's global settings; `None`: every peer is a thread of this process.
    pub global: Option<GlobalPeers>,
}

/// Peers in several processes (one or more peers each) through burn-collective's global orchestrator.
#[derive(Clone, Debug)]
pub struct GlobalPeers {
    /// The orchestrator's address, e.g. `ws://127.0.0.1:3000` (started by one process with
    /// [`start_orchestrator`]).
    pub orchestrator: String,
    /// This process's address for the other processes, e.g. `ws://127.0.0.1:3001`.
    pub node_address: String,
    /// The port of this process's data service (the port of `node_address`).
    pub data_service_port: u16,
    /// The number of processes.
    pub num_nodes: u32,
    /// The peers in this process.
    pub local_peers: usize,
}

impl PeerConfig {
    /// A peer `rank` of `world_size` threads of this process.
    pub fn local(rank: usize, world_size: usize) -> Self {
        PeerConfig {
            rank,
            world_size,
            timeout: Duration::from_secs(60),
            gradient_bucket: 1 << 22,
            global: None,
        }
    }

    /// The peer of this process in a group of `world_size` processes, one peer each, from torchrun-style
    /// variables: `RANK`, `WORLD_SIZE`, and burn-te's `BURN_TE_ORCHESTRATOR` (the orchestrator's address),
    /// `BURN_TE_NODE_PORT` (this process's data-service port; its address is `ws://127.0.0.1:<port>` unless
    /// `BURN_TE_NODE_ADDRESS` says otherwise), `BURN_TE_COLLECTIVE_TIMEOUT_S` and `BURN_TE_GRADIENT_BUCKET`
    /// (optional).
    pub fn from_env() -> Result<Self, TeError> {
        let var = |name: &str| {
            std::env::var(name)
                .map_err(|_| TeError::Collective(format!("environment variable {name} is not set")))
        };
        let parse = |name: &str, value: String| {
            value.trim().parse::<u64>().map_err(|_| {
                TeError::Collective(format!("{name}={value:?} is not a non-negative integer"))
            })
        };
        let rank = parse("RANK", var("RANK")?)? as usize;
        let world_size = parse("WORLD_SIZE", var("WORLD_SIZE")?)? as usize;
        let setting =
            |bad: crate::settings::setting::BadValue| TeError::Collective(bad.to_string());
        let mut config = PeerConfig::local(rank, world_size);
        if let Some(bucket) = settings::GRADIENT_BUCKET.try_read().map_err(setting)? {
            config.gradient_bucket = bucket.max(1) as usize;
        }
        if let Some(timeout) = settings::COLLECTIVE_TIMEOUT_S.try_read().map_err(setting)? {
            config.timeout = Duration::from_secs(timeout);
        }
        if world_size > 1 {
            let missing =
                |name: &str| TeError::Collective(format!("environment variable {name} is not set"));
            let port = settings::NODE_PORT
                .try_read()
                .map_err(setting)?
                .ok_or_else(|| missing(settings::NODE_PORT.name))?;
            config.global = Some(GlobalPeers {
                orchestrator: settings::ORCHESTRATOR
                    .try_read()
                    .map_err(setting)?
                    .ok_or_else(|| missing(settings::ORCHESTRATOR.name))?,
                node_address: settings::NODE_ADDRESS
                    .try_read()
                    .map_err(setting)?
                    .unwrap_or_else(|| format!("ws://127.0.0.1:{port}")),
                data_service_port: port,
                num_nodes: world_size as u32,
                local_peers: 1,
            });
        }
        Ok(config)
    }

    /// The same with another collective timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// Starts burn-collective's global orchestrator on `port` of this machine, in a background thread of this
/// process, for [`GlobalPeers::orchestrator`] `ws://<this host>:<port>`. It serves until the process ends.
pub fn start_orchestrator(port: u16) {
    std::thread::Builder::new()
        .name("burn-te-orchestrator".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .worker_threads(1)
                .build()
            {
                Ok(runtime) => runtime,
                Err(err) => {
                    tracing::error!("collective orchestrator: no async runtime: {err}");
                    return;
                }
            };
            runtime.block_on(burn_collective::start_global_orchestrator(port));
        })
        .map(drop)
        .unwrap_or_else(|err| tracing::error!("collective orchestrator: no thread: {err}"));
}

/// The backend of the peers' exchanges (host values, exact in `f64`).
pub type ExchangeBackend = NdArray<f64>;

/// The exchanges of one peer over burn-collective.
struct Exchange {
    id: PeerId,
}

impl Exchange {
    /// The element-wise sum of every peer's `values` (all the same length).
    fn sum(&self, values: Vec<f64>) -> Result<Vec<f64>, String> {
        type B = ExchangeBackend;
        let len = values.len();
        // The dtype named: Burn keeps a default float dtype per device, shared with `NdArray<f32>` on the same CPU
        // device, which would turn these into f32.
        let device = Default::default();
        let tensor = Tensor::<B, 1>::from_data(
            TensorData::new(values, [len]),
            (&device, burn::tensor::DType::F64),
        );
        let sum = burn_collective::all_reduce::<B>(
            self.id,
            tensor.into_primitive().tensor(),
            ReduceOperation::Sum,
        )
        .map_err(describe)?;
        let data = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(sum))
            .try_into_data()
            .map_err(|err| format!("reading the reduced values back: {err:?}"))?;
        data.to_vec::<f64>().map_err(|err| format!("{err:?}"))
    }

    /// Leaves the group.
    fn finish(&self) -> Result<(), String> {
        burn_collective::finish_collective::<ExchangeBackend>(self.id).map_err(describe)
    }
}

/// burn-collective's error, with what it means for the group where that is not plain.
fn describe(err: burn_collective::CollectiveError) -> String {
    use burn_collective::CollectiveError as E;
    match err {
        E::LocalServerMissing => {
            "burn-collective's server stopped (a peer process died or its connection broke)".into()
        }
        E::AllReduceShapeMismatch | E::AllReduceOperationMismatch => {
            format!("the peers' calls do not match (burn-collective: {err:?})")
        }
        E::RegisterParamsMismatch => format!(
            "the peers of this process were started with different world sizes (burn-collective: {err:?})"
        ),
        E::Global(ref global) if format!("{global:?}").contains("RegisterParamsMismatch") => {
            format!(
                "the processes were started with different world sizes: the first to join set another \
                 (burn-collective: {err:?})"
            )
        }
        E::Global(ref global) if format!("{global:?}").contains("DoubleRegister") => format!(
            "another process joined with this process's node address: each needs its own data-service port \
             (burn-collective: {err:?})"
        ),
        other => format!("burn-collective: {other:?}"),
    }
}

struct PeerState {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    gradient_bucket: usize,
    /// Every peer is a thread of this process (no global orchestrator).
    threads: bool,
    exchange: Arc<Exchange>,
    /// The first collective failure: the group is broken from then on.
    broken: Mutex<Option<String>>,
}

/// One peer of a distributed run: its rank and world size, and the exchanges with the other peers. Clones are the
/// same peer. Create one per training thread (or process) with [`Peer::join`], [`bind`](Peer::bind) it to the
/// threads that train, and [`leave`](Peer::leave) at the end.
#[derive(Clone)]
pub struct Peer {
    state: Arc<PeerState>,
}

impl core::fmt::Debug for Peer {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Peer")
            .field("rank", &self.state.rank)
            .field("world_size", &self.state.world_size)
            .finish()
    }
}

impl Peer {
    /// Joins the group as `config.rank`. Blocks until every peer joined, or fails after the timeout.
    pub fn join(config: PeerConfig) -> Result<Peer, TeError> {
        if config.world_size == 0 || config.rank >= config.world_size {
            return Err(TeError::Collective(format!(
                "rank {} is not in a world of {} peers",
                config.rank, config.world_size
            )));
        }
        let mut collective = CollectiveConfig::default().with_num_devices(
            config
                .global
                .as_ref()
                .map_or(config.world_size, |g| g.local_peers),
        );
        if let Some(global) = &config.global {
            let address = |url: &str| -> Result<_, TeError> {
                url.parse().map_err(|err| {
                    TeError::Collective(format!("collective address {url:?}: {err:?}"))
                })
            };
            collective = collective
                .with_num_nodes(global.num_nodes)
                .with_global_address(address(&global.orchestrator)?)
                .with_node_address(address(&global.node_address)?)
                .with_data_service_port(global.data_service_port);
        }
        let id = PeerId::from(config.rank);
        let state = PeerState {
            rank: config.rank,
            world_size: config.world_size,
            timeout: config.timeout,
            gradient_bucket: config.gradient_bucket,
            threads: config.global.is_none(),
            exchange: Arc::new(Exchange { id }),
            broken: Mutex::new(None),
        };
        let peer = Peer {
            state: Arc::new(state),
        };
        peer.blocking("join", move || {
            burn_collective::register::<ExchangeBackend>(id, Default::default(), collective)
                .map_err(describe)
        })?;
        tracing::info!(
            target: "burn_te",
            "peer {} of {} joined the group",
            config.rank,
            config.world_size
        );
        Ok(peer)
    }

    /// This peer's rank.
    pub fn rank(&self) -> usize {
        self.state.rank
    }

    /// The number of peers.
    pub fn world_size(&self) -> usize {
        self.state.world_size
    }

    /// Whether every peer is a thread of this process.
    pub(crate) fn threads(&self) -> bool {
        self.state.threads
    }

    /// Runs `op` (a blocking collective call) on a helper thread and waits for it at most the timeout.
    fn blocking<T: Send + 'static>(
        &self,
        what: &str,
        op: impl FnOnce() -> Result<T, String> + Send + 'static,
    ) -> Result<T, TeError> {
        let mut broken = self.state.broken.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reason) = broken.as_ref() {
            return Err(TeError::Collective(format!(
                "peer {}: {what} refused, the group failed earlier: {reason}",
                self.state.rank
            )));
        }
        let (sender, receiver) = mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name(format!("burn-te-collective-{}", self.state.rank))
            .spawn(move || {
                let _ = sender.send(op());
            });
        let started = Instant::now();
        let result = match spawned {
            Err(err) => Err(format!("no thread for the collective call: {err}")),
            Ok(_) => match receiver.recv_timeout(self.state.timeout) {
                Ok(result) => result,
                Err(mpsc::RecvTimeoutError::Timeout) => Err(format!(
                    "no answer from every peer within {:.1} s (a peer died, did not start, was started with \
                     another world size, or did not reach the same call)",
                    started.elapsed().as_secs_f64()
                )),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    Err("the collective call panicked".to_string())
                }
            },
        };
        result.map_err(|reason| {
            let reason = format!("{what}: {reason}");
            *broken = Some(reason.clone());
            tracing::error!(target: "burn_te", "peer {}: {reason}", self.state.rank);
            TeError::Collective(format!(
                "peer {} of {}: {reason}",
                self.state.rank, self.state.world_size
            ))
        })
    }

    /// Every peer's `bytes`, by rank (a collective call: every peer must make it).
    pub fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, TeError> {
        if self.state.world_size == 1 {
            return Ok(vec![bytes.to_vec()]);
        }
        // The lengths first, then the bytes four per word in slots as long as the longest.
        let lengths = self.gather_words("all-gather (lengths)", &[bytes.len() as u32])?;
        let slot = lengths
            .iter()
            .map(|l| l[0] as usize)
            .max()
            .unwrap_or(0)
            .div_ceil(4);
        let mut words: Vec<u32> = bytes
            .chunks(4)
            .map(|chunk| {
                let mut word = [0u8; 4];
                word[..chunk.len()].copy_from_slice(chunk);
                u32::from_le_bytes(word)
            })
            .collect();
        words.resize(slot, 0);
        let gathered = self.gather_words("all-gather", &words)?;
        Ok(gathered
            .into_iter()
            .zip(lengths)
            .map(|(words, len)| {
                let mut bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                bytes.truncate(len[0] as usize);
                bytes
            })
            .collect())
    }

    /// The element-wise sum of every peer's `values` (the same number at every peer), in `f64` (a collective
    /// call named `what` in errors).
    fn sum(&self, what: &str, mut values: Vec<f64>) -> Result<Vec<f64>, TeError> {
        let expected = values.len();
        // burn-collective's ring all-reduce across processes splits the tensor in one slice per process: it needs
        // at least that many values.
        values.resize(expected.max(self.state.world_size), 0.0);
        let padded = values.len();
        let exchange = self.state.exchange.clone();
        let mut sum = self.blocking(what, move || exchange.sum(values))?;
        if sum.len() != padded {
            return Err(TeError::Collective(format!(
                "{what}: {} values back, expected {padded}",
                sum.len()
            )));
        }
        sum.truncate(expected);
        Ok(sum)
    }

    /// Every peer's `words` (the same number at every peer), by rank: each peer's in its slot of a zero tensor,
    /// summed.
    fn gather_words(&self, what: &str, words: &[u32]) -> Result<Vec<Vec<u32>>, TeError> {
        let (world, rank, n) = (self.state.world_size, self.state.rank, words.len());
        if world == 1 {
            return Ok(vec![words.to_vec()]);
        }
        let mut values = vec![0.0f64; world * n];
        for (slot, &word) in values[rank * n..(rank + 1) * n].iter_mut().zip(words) {
            *slot = f64::from(word);
        }
        let sum = self.sum(what, values)?;
        if n == 0 {
            return Ok(vec![Vec::new(); world]);
        }
        sum.chunks(n)
            .map(|chunk| {
                chunk
                    .iter()
                    .map(|&v| {
                        // Each slot holds one peer's integer: anything else means the peers' calls differ.
                        if v.fract() == 0.0 && (0.0..=f64::from(u32::MAX)).contains(&v) {
                            Ok(v as u32)
                        } else {
                            Err(TeError::Collective(format!(
                                "{what}: the peers' calls do not match (a slot held {v})"
                            )))
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// The element-wise maximum of every peer's `values` (the same number at every peer; NaN where any peer's is
    /// NaN), from the exact values (a collective call).
    pub fn all_reduce_max(&self, values: &[f32]) -> Result<Vec<f32>, TeError> {
        let bits: Vec<u32> = values.iter().map(|v| v.to_bits()).collect();
        let gathered = self.gather_words("max", &bits)?;
        Ok(elementwise_max(
            values,
            gathered
                .into_iter()
                .map(|words| words.into_iter().map(f32::from_bits).collect()),
        ))
    }

    /// The element-wise mean of every peer's `values` (the same number at every peer; e.g. the step's loss), the
    /// same bits at every peer (a collective call).
    pub fn all_reduce_mean(&self, values: &[f64]) -> Result<Vec<f64>, TeError> {
        if self.state.world_size == 1 {
            return Ok(values.to_vec());
        }
        let world = self.state.world_size as f64;
        let sum = self.sum("mean", values.to_vec())?;
        Ok(sum.into_iter().map(|s| s / world).collect())
    }

    /// Checks that every peer runs with the same `value` of `what` (the recipe, the model's or the run's
    /// configuration), a collective call at the start of a run: when they differ, every peer gets an error that
    /// names each rank's value, instead of training replicas that drift apart or a reduction that hangs.
    pub fn agree_on(&self, what: &str, value: &str) -> Result<(), TeError> {
        let all = self.all_gather_bytes(value.as_bytes())?;
        if all.iter().all(|v| *v == all[0]) {
            return Ok(());
        }
        let listed: Vec<String> = all
            .iter()
            .enumerate()
            .map(|(rank, v)| format!("rank {rank}: {}", String::from_utf8_lossy(v)))
            .collect();
        Err(TeError::Collective(format!(
            "peer {} of {}: the peers do not agree on {what} ({}); start every peer with the same",
            self.state.rank,
            self.state.world_size,
            listed.join("; ")
        )))
    }

    /// Makes this thread run as this peer until the guard drops: its rank names the logs, dumps and snapshots,
    /// and its amax and statistics reductions go to this peer's group.
    pub fn bind(&self) -> PeerGuard {
        let previous = CURRENT.with(|c| c.replace(Some(self.clone())));
        PeerGuard { previous }
    }

    /// Leaves the group (a collective call): every peer first reaches the leave (a barrier); the process that hosts
    /// the group's orchestrator (rank 0 started with `--address`, see [`launch`]) then waits a grace period after
    /// its own leave: the orchestrator ends with the process, and a peer still leaving would
    /// otherwise wait for it until its timeout.
    pub fn leave(self) -> Result<(), TeError> {
        let hosting = launch::hosts_orchestrator() && self.state.world_size > 1;
        // Every peer reaches the leave before any leaves.
        self.all_reduce_max(&[0.0])?;
        let exchange = self.state.exchange.clone();
        self.blocking("leave", move || exchange.finish())?;
        if hosting {
            std::thread::sleep(LEAVE_GRACE);
        }
        Ok(())
    }
}

/// The element-wise maximum of `values` and every one of `others` (NaN where any is NaN): the combine of the
/// max all-reduces ([`Peer::all_reduce_max`], a tensor-parallel group's).
fn elementwise_max(values: &[f32], others: impl IntoIterator<Item = Vec<f32>>) -> Vec<f32> {
    let mut max = values.to_vec();
    for other in others {
        for (m, v) in max.iter_mut().zip(other) {
            if v.is_nan() || *m < v {
                *m = v;
            }
        }
    }
    max
}

/// How long the orchestrator's host waits after leaving, for the other peers' leaves (see [`Peer::leave`]).
const LEAVE_GRACE: Duration = Duration::from_secs(3);

/// Forgets every peer of this process's exchange server and fails the calls still waiting (after a group that
/// failed, before a new one joins).
pub fn reset_local_group() {
    burn_collective::reset_collective::<ExchangeBackend>();
}

thread_local! {
    static CURRENT: RefCell<Option<Peer>> = const { RefCell::new(None) };
}

/// Restores the thread's previous peer when dropped (see [`Peer::bind`]).
pub struct PeerGuard {
    previous: Option<Peer>,
}

impl Drop for PeerGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

/// The peer bound to this thread, if any.
pub fn current() -> Option<Peer> {
    CURRENT.with(|c| c.borrow().clone())
}

/// This thread's rank: its bound peer's, else the `RANK` environment variable (as torchrun sets it), else 0.
pub fn rank() -> usize {
    current().map_or_else(env_rank, |peer| peer.rank())
}

fn env_rank() -> usize {
    std::env::var("RANK")
        .ok()
        .and_then(|r| r.trim().parse().ok())
        .unwrap_or(0)
}
