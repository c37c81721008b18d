//! The settings of a process of a distributed run (`burn_te::distributed::PeerConfig::from_env`), defined here so
//! that the environment check knows them in builds without the `distributed` feature.

use super::setting::{Setting, any_text, whole_number};

/// The global orchestrator's address (`ws://host:port`).
pub const ORCHESTRATOR: Setting<String> = Setting {
    name: "BURN_TE_ORCHESTRATOR",
    takes: "the orchestrator's address, ws://host:port",
    otherwise: "nothing",
    parse: any_text,
};

/// This process's data-service port.
pub const NODE_PORT: Setting<u16> = Setting {
    name: "BURN_TE_NODE_PORT",
    takes: "a port, 0 to 65535",
    otherwise: "nothing",
    parse: |value| value.parse().ok(),
};

/// This process's address for the other processes (default `ws://127.0.0.1:<port>`).
pub const NODE_ADDRESS: Setting<String> = Setting {
    name: "BURN_TE_NODE_ADDRESS",
    takes: "this process's address, ws://host:port",
    otherwise: "ws://127.0.0.1:<port>",
    parse: any_text,
};

/// How long a collective waits for its peers, in seconds.
pub const COLLECTIVE_TIMEOUT_S: Setting<u64> = Setting {
    name: "BURN_TE_COLLECTIVE_TIMEOUT_S",
    takes: "a whole number of seconds",
    otherwise: "60 s",
    parse: whole_number,
};

/// The gradients' all-reduce bucket, in bytes (at least 1).
pub const GRADIENT_BUCKET: Setting<u64> = Setting {
    name: "BURN_TE_GRADIENT_BUCKET",
    takes: "a whole number of bytes",
    otherwise: "4 MiB",
    parse: whole_number,
};
