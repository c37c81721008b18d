//! A launcher in torchrun's style for training on several processes: one command starts N local peer processes,
//! and `--rank/--world-size/--address` makes a process one peer of a group spread over machines.
//!
//! ```text
//! # N processes on this machine (copies of this program, with its other arguments):
//! my_training --nproc 2
//! # Two machines: rank 0 hosts the group's orchestrator at the address it is given.
//! host-a$ my_training --rank 0 --world-size 2 --address host-a:29500
//! host-b$ my_training --rank 1 --world-size 2 --address host-a:29500
//! ```
//!
//! A program asks [`LaunchArgs::launch`] (its clap command line flattens [`LaunchArgs`]) or [`Launch::from_args`]
//! what it is: the launcher ([`Launch::Local`], which it [runs](LocalLaunch::run)
//! and exits with), one peer ([`Launch::Peer`], whose [`PeerConfig`] it [joins](super::Peer::join)), or a single
//! process ([`Launch::Single`]). A process started by the launcher, or by a scheduler that sets torchrun's
//! variables, finds its rank in the environment ([`PeerConfig::from_env`]).
//!
//! Like torchrun, the launcher hosts the group's rendezvous (burn-collective's orchestrator) and watches its
//! children: when one fails, the others fail on their own at their next collective call, within the group's
//! timeout (each with a clear error and its logs written); whatever still runs after that is killed, and the
//! launcher reports every rank's end.

use std::net::{TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use super::{GlobalPeers, PeerConfig, start_orchestrator};
use crate::error::TeError;

/// What this process is in a distributed run (see the [module docs](self)).
#[derive(Debug)]
pub enum Launch {
    /// No launcher flag and no `RANK` in the environment: one process, no group.
    Single,
    /// `--nproc N`: start N local peers and wait for them.
    Local(LocalLaunch),
    /// One peer of a group: `--rank/--world-size/--address`, or a launcher's child (`RANK` in the environment).
    Peer(PeerConfig),
}

/// The launcher's flags, as torchrun spells them (`--nproc` is short for `--nproc-per-node`): a clap argument
/// group a program flattens into its own command line (`#[command(flatten)] launch: LaunchArgs`), so its `--help`
/// lists them. [`launch`](Self::launch) says what they make this process.
#[derive(clap::Args, Clone, Debug, PartialEq, Eq)]
#[command(next_help_heading = "Distributed (torchrun's flags)")]
pub struct LaunchArgs {
    /// Start N peer processes on this machine: copies of this program with its other arguments.
    #[arg(long, visible_alias = "nproc-per-node", value_name = "N")]
    pub nproc: Option<u64>,
    /// This process's rank in a group spread over machines (with --world-size and --address).
    #[arg(long, value_name = "R")]
    pub rank: Option<u64>,
    /// The number of processes of the group spread over machines.
    #[arg(long, value_name = "W")]
    pub world_size: Option<u64>,
    /// The group's rendezvous, hosted by rank 0.
    #[arg(long, value_name = "HOST:PORT")]
    pub address: Option<String>,
    /// This machine's address for the other peers [default: found from the route to --address].
    #[arg(long, value_name = "HOST")]
    pub node_address: Option<String>,
    /// Seconds a collective waits for the other peers before it fails.
    #[arg(long, value_name = "SECONDS", default_value_t = COLLECTIVE_TIMEOUT_S)]
    pub collective_timeout: u64,
}

/// The default of `--collective-timeout`, in seconds.
const COLLECTIVE_TIMEOUT_S: u64 = 60;

/// No launcher flag: a single process, with the default collective timeout.
impl Default for LaunchArgs {
    fn default() -> Self {
        Self {
            nproc: None,
            rank: None,
            world_size: None,
            address: None,
            node_address: None,
            collective_timeout: COLLECTIVE_TIMEOUT_S,
        }
    }
}

/// The launcher's flags, each with the names it is given by.
const FLAGS: [&str; 7] = [
    "--nproc",
    "--nproc-per-node",
    "--rank",
    "--world-size",
    "--address",
    "--node-address",
    "--collective-timeout",
];

impl Launch {
    /// What `args` (a program's arguments, without its name) make this process, and the arguments that are not
    /// the launcher's (see [`LaunchArgs`]; a program with a clap command line flattens that instead).
    pub fn from_args(args: &[String]) -> Result<(Launch, Vec<String>), TeError> {
        let (flags, rest) = LaunchArgs::split(args)?;
        Ok((flags.launch_with(rest.clone())?, rest))
    }
}

impl LaunchArgs {
    /// What these flags make this process. The peers a launcher starts run this program with its arguments less
    /// the launcher's flags.
    pub fn launch(&self) -> Result<Launch, TeError> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        self.launch_with(Self::split(&args)?.1)
    }

    /// The launcher's flags in `args`, and the other arguments.
    fn split(args: &[String]) -> Result<(LaunchArgs, Vec<String>), TeError> {
        let mut flags = LaunchArgs::default();
        let mut rest = Vec::new();
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            let (name, inline) = match arg.split_once('=') {
                Some((name, value)) => (name, Some(value.to_string())),
                None => (arg.as_str(), None),
            };
            if !FLAGS.contains(&name) {
                rest.push(arg.clone());
                continue;
            }
            let value = inline.or_else(|| args.next().cloned()).ok_or_else(|| {
                TeError::Collective(format!("launcher flag {name} needs a value"))
            })?;
            let number = || {
                value.trim().parse::<u64>().map_err(|_| {
                    TeError::Collective(format!("{name} {value:?} is not a non-negative integer"))
                })
            };
            match name {
                "--nproc" | "--nproc-per-node" => flags.nproc = Some(number()?),
                "--rank" => flags.rank = Some(number()?),
                "--world-size" => flags.world_size = Some(number()?),
                "--collective-timeout" => flags.collective_timeout = number()?,
                "--address" => flags.address = Some(value),
                _ => flags.node_address = Some(value),
            }
        }
        Ok((flags, rest))
    }

    /// What these flags make this process, a launcher's peers running this program with `rest`.
    fn launch_with(&self, rest: Vec<String>) -> Result<Launch, TeError> {
        let timeout = Duration::from_secs(self.collective_timeout);
        if let Some(nproc) = self.nproc {
            if let Some(other) = [
                ("--rank", self.rank.is_some()),
                ("--world-size", self.world_size.is_some()),
                ("--address", self.address.is_some()),
            ]
            .into_iter()
            .find_map(|(flag, given)| given.then_some(flag))
            {
                return Err(TeError::Collective(format!(
                    "--nproc starts the peers of this machine itself: it does not go with {other}"
                )));
            }
            if nproc == 0 {
                return Err(TeError::Collective("--nproc 0: no peer to start".into()));
            }
            let program = std::env::current_exe().map_err(|err| {
                TeError::Collective(format!("the launcher cannot find its own program: {err}"))
            })?;
            return Ok(Launch::Local(LocalLaunch {
                nproc: nproc as usize,
                program,
                args: rest,
                timeout,
            }));
        }
        match (self.rank, self.world_size, &self.address) {
            (Some(rank), Some(world_size), Some(address)) => Ok(Launch::Peer(machine_peer(
                rank as usize,
                world_size as usize,
                address,
                self.node_address.as_deref(),
                timeout,
            )?)),
            (None, None, None) if std::env::var_os("RANK").is_some() => {
                Ok(Launch::Peer(PeerConfig::from_env()?))
            }
            (None, None, None) => Ok(Launch::Single),
            _ => Err(TeError::Collective(
                "a peer on another machine needs --rank, --world-size and --address HOST:PORT together".into(),
            )),
        }
    }
}

/// The peer `rank` of `world_size` processes whose orchestrator is at `address` (hosted by rank 0).
fn machine_peer(
    rank: usize,
    world_size: usize,
    address: &str,
    node_address: Option<&str>,
    timeout: Duration,
) -> Result<PeerConfig, TeError> {
    if world_size == 0 || rank >= world_size {
        return Err(TeError::Collective(format!(
            "--rank {rank} is not in a world of {world_size} processes"
        )));
    }
    let (host, port) = address
        .rsplit_once(':')
        .and_then(|(host, port)| Some((host, port.parse::<u16>().ok()?)))
        .ok_or_else(|| TeError::Collective(format!("--address {address:?} is not HOST:PORT")))?;
    if rank == 0 {
        start_orchestrator(port);
        wait_listening(("127.0.0.1", port), Duration::from_secs(10))?;
        HOSTS_ORCHESTRATOR.store(true, std::sync::atomic::Ordering::Release);
    }
    let node_host = match node_address {
        Some(host) => host.to_string(),
        None => route_to(address)?,
    };
    let data_port = free_port()?;
    let mut config = PeerConfig::local(rank, world_size).with_timeout(timeout);
    if world_size > 1 {
        config.global = Some(GlobalPeers {
            orchestrator: format!("ws://{host}:{port}"),
            node_address: format!("ws://{node_host}:{data_port}"),
            data_service_port: data_port,
            num_nodes: world_size as u32,
            local_peers: 1,
        });
    }
    Ok(config)
}

/// Whether this process hosts its group's orchestrator as one of the peers (rank 0 of `--rank/--address`).
static HOSTS_ORCHESTRATOR: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Whether this process is a peer that hosts its group's orchestrator (see [`super::Peer::leave`]).
pub(crate) fn hosts_orchestrator() -> bool {
    HOSTS_ORCHESTRATOR.load(std::sync::atomic::Ordering::Acquire)
}

/// This machine's address on the route to `address` (the interface the other peers reach it by).
fn route_to(address: &str) -> Result<String, TeError> {
    let target = address
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| TeError::Collective(format!("--address {address:?} does not resolve")))?;
    let socket = UdpSocket::bind(if target.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    })
    .and_then(|s| s.connect(target).map(|_| s))
    .and_then(|s| s.local_addr())
    .map_err(|err| {
        TeError::Collective(format!(
            "no route to {address} to find this machine's address ({err}): give --node-address"
        ))
    })?;
    Ok(socket.ip().to_string())
}

/// A free TCP port of this machine.
fn free_port() -> Result<u16, TeError> {
    Ok(free_ports(1)?[0])
}

/// `n` distinct free TCP ports of this machine (all held until all are chosen: a port released at once may be
/// handed out again).
fn free_ports(n: usize) -> Result<Vec<u16>, TeError> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind("0.0.0.0:0"))
        .collect::<Result<Vec<_>, _>>();
    listeners
        .and_then(|ls| {
            ls.iter()
                .map(|l| l.local_addr().map(|a| a.port()))
                .collect()
        })
        .map_err(|err| TeError::Collective(format!("no free port for the collective: {err}")))
}

/// Waits until something listens at `address` (the orchestrator just started), at most `limit`.
fn wait_listening(address: (&str, u16), limit: Duration) -> Result<(), TeError> {
    let started = Instant::now();
    while TcpStream::connect(address).is_err() {
        if started.elapsed() > limit {
            return Err(TeError::Collective(format!(
                "the orchestrator did not listen on port {} within {limit:?}",
                address.1
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// `nproc` peer processes on this machine: `program` with `args`, each told its rank in torchrun's variables.
#[derive(Clone, Debug)]
pub struct LocalLaunch {
    /// How many peers.
    pub nproc: usize,
    /// The peers' program (by default this one).
    pub program: PathBuf,
    /// The peers' arguments (by default this program's, without the launcher's flags).
    pub args: Vec<String>,
    /// The group's collective timeout; after a peer failed, the others get this long (and 5 s) to end.
    pub timeout: Duration,
}

/// How one peer process ended.
#[derive(Clone, Debug)]
pub struct RankExit {
    /// The peer's rank.
    pub rank: usize,
    /// Its exit status; `None` when the launcher killed it (it still ran after the grace period).
    pub status: Option<ExitStatus>,
}

impl RankExit {
    /// Whether the peer ended successfully.
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }
}

impl std::fmt::Display for RankExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.status {
            Some(status) => write!(f, "rank {}: {status}", self.rank),
            None => write!(
                f,
                "rank {}: killed by the launcher (still running after a peer failed)",
                self.rank
            ),
        }
    }
}

/// Kills the children still running when dropped (the launcher itself failed or was interrupted).
struct Children(Vec<Option<Child>>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in self.0.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl LocalLaunch {
    /// Hosts the group's orchestrator, starts the peers (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
    /// `LOCAL_WORLD_SIZE`, and burn-te's `BURN_TE_ORCHESTRATOR`, `BURN_TE_NODE_PORT`,
    /// `BURN_TE_COLLECTIVE_TIMEOUT_S`) and waits for all of them; how each ended, by rank.
    pub fn run(&self) -> Result<Vec<RankExit>, TeError> {
        // The orchestrator's port, then each peer's data-service port.
        let ports = free_ports(1 + self.nproc)?;
        let orchestrator = ports[0];
        if self.nproc > 1 {
            start_orchestrator(orchestrator);
            wait_listening(("127.0.0.1", orchestrator), Duration::from_secs(10))?;
        }
        let mut children = Children(Vec::new());
        for rank in 0..self.nproc {
            let child = Command::new(&self.program)
                .args(&self.args)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", self.nproc.to_string())
                .env("LOCAL_WORLD_SIZE", self.nproc.to_string())
                .env(
                    "BURN_TE_ORCHESTRATOR",
                    format!("ws://127.0.0.1:{orchestrator}"),
                )
                .env("BURN_TE_NODE_PORT", ports[1 + rank].to_string())
                .env(
                    "BURN_TE_COLLECTIVE_TIMEOUT_S",
                    self.timeout.as_secs().to_string(),
                )
                .spawn()
                .map_err(|err| {
                    TeError::Collective(format!(
                        "starting rank {rank} ({}): {err}",
                        self.program.display()
                    ))
                })?;
            children.0.push(Some(child));
        }
        let mut exits: Vec<Option<RankExit>> = vec![None; self.nproc];
        let mut failed_at: Option<Instant> = None;
        let grace = self.timeout + Duration::from_secs(5);
        while exits.iter().any(Option::is_none) {
            for (rank, slot) in children.0.iter_mut().enumerate() {
                let Some(child) = slot else { continue };
                let status = child.try_wait().map_err(|err| {
                    TeError::Collective(format!("waiting for rank {rank}: {err}"))
                })?;
                if let Some(status) = status {
                    if !status.success() {
                        tracing::error!(target: "burn_te", "launcher: rank {rank} failed ({status})");
                        failed_at.get_or_insert_with(Instant::now);
                    }
                    exits[rank] = Some(RankExit {
                        rank,
                        status: Some(status),
                    });
                    *slot = None;
                }
            }
            if failed_at.is_some_and(|t| t.elapsed() > grace) {
                for (rank, slot) in children.0.iter_mut().enumerate() {
                    if let Some(mut child) = slot.take() {
                        let _ = child.kill();
                        let _ = child.wait();
                        exits[rank] = Some(RankExit { rank, status: None });
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(exits.into_iter().flatten().collect())
    }
}
