//! How one node is started: addresses, identity, rules file, shard sizing.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::cluster::forward::ForwardConfig;
use crate::membership::MembershipConfig;
use crate::shard::ShardConfig;

/// Default gRPC address of `ringlimit serve`.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7420";
/// Default address of the Prometheus `/metrics` side port.
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:7421";
/// Default UDP gossip address.
pub const DEFAULT_GOSSIP_LISTEN: &str = "127.0.0.1:7422";
/// Default address of the peer service (the cluster face: forwarded checks, refunds,
/// handoff), a listener of its own so it can sit on a private network.
pub const DEFAULT_PEER_LISTEN: &str = "127.0.0.1:7423";

/// Everything a node needs to start. `Default` is what `ringlimit serve` runs with no
/// flags; `for_test()` binds port 0 everywhere so tests run in parallel.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Stable identity of this node in answers (and, later, on the ring).
    pub node_id: String,
    /// gRPC address (port 0 picks a free port).
    pub listen: SocketAddr,
    /// `/metrics` address; `None` serves no metrics port.
    pub metrics_listen: Option<SocketAddr>,
    /// Rule file; `None` runs the built-in default (sliding window counter, 100 per 60 s).
    pub rules_path: Option<PathBuf>,
    /// How often the rule file is re-read to pick up changes.
    pub rules_poll: Duration,
    /// Shard actors and key cap.
    pub shards: ShardConfig,
    /// gRPC address other nodes use to reach this one; default: the bound `listen`
    /// address (must then not be a wildcard such as 0.0.0.0).
    pub advertise: Option<SocketAddr>,
    /// UDP gossip address (port 0 picks a free port).
    pub gossip_listen: SocketAddr,
    /// Peer service address (port 0 picks a free port). Serves only `Peer`; the
    /// public listener does not serve it.
    pub peer_listen: SocketAddr,
    /// Peer address other nodes use; default: the bound peer address, or, when that
    /// is a wildcard, the advertised gRPC IP with the bound peer port.
    pub peer_advertise: Option<SocketAddr>,
    /// Gossip address other nodes use; default: the bound gossip address.
    pub gossip_advertise: Option<SocketAddr>,
    /// Gossip addresses (`host:port`) of nodes to join through; none: a cluster of one
    /// that others may join.
    pub seeds: Vec<String>,
    /// Nodes only gossip within one cluster id.
    pub cluster_id: String,
    /// Forwarding to owners: deadline, batching.
    pub forward: ForwardConfig,
    /// Denials the deny cache holds at most.
    pub deny_cache: usize,
    /// On graceful leave: how long to keep serving after announcing, so every ring drops
    /// this node before its state is pushed away.
    pub leave_settle: Duration,
    /// NEGATIVE CONTROL ONLY: decide every check on the receiving node, ignoring the
    /// ring. A deliberately broken cluster (each node enforces the full limit alone,
    /// the design reference's N × L failure) so the chaos checkers can be shown to fail.
    pub broken_decide_locally: bool,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            node_id: default_node_id(),
            listen: DEFAULT_LISTEN.parse().expect("valid default address"),
            metrics_listen: Some(
                DEFAULT_METRICS_LISTEN
                    .parse()
                    .expect("valid default address"),
            ),
            rules_path: None,
            rules_poll: Duration::from_secs(1),
            shards: ShardConfig::default(),
            advertise: None,
            gossip_listen: DEFAULT_GOSSIP_LISTEN
                .parse()
                .expect("valid default address"),
            peer_listen: DEFAULT_PEER_LISTEN.parse().expect("valid default address"),
            peer_advertise: None,
            gossip_advertise: None,
            seeds: Vec::new(),
            cluster_id: crate::membership::DEFAULT_CLUSTER_ID.to_string(),
            forward: ForwardConfig::default(),
            deny_cache: 100_000,
            leave_settle: Duration::from_millis(600),
            broken_decide_locally: false,
        }
    }
}

impl NodeConfig {
    /// Loopback, port 0 for every listener, two shards, fast rule polling.
    pub fn for_test() -> Self {
        Self {
            node_id: "test-node".into(),
            listen: "127.0.0.1:0".parse().expect("valid address"),
            metrics_listen: Some("127.0.0.1:0".parse().expect("valid address")),
            rules_path: None,
            rules_poll: Duration::from_millis(50),
            shards: ShardConfig {
                shards: 2,
                ..ShardConfig::default()
            },
            gossip_listen: "127.0.0.1:0".parse().expect("valid address"),
            peer_listen: "127.0.0.1:0".parse().expect("valid address"),
            ..Self::default()
        }
    }

    /// The membership settings this node config implies, once the gRPC and peer
    /// addresses are bound.
    pub fn membership(
        &self,
        generation: u64,
        grpc_advertise: SocketAddr,
        peer_advertise: SocketAddr,
    ) -> MembershipConfig {
        MembershipConfig {
            peer_advertise,
            generation,
            cluster_id: self.cluster_id.clone(),
            gossip_listen: self.gossip_listen,
            gossip_advertise: self.gossip_advertise,
            seeds: self.seeds.clone(),
            ..MembershipConfig::new(&self.node_id, grpc_advertise)
        }
    }

    /// Check the settings once at start, so a bad value fails loudly before serving.
    pub fn validate(&self) -> Result<(), String> {
        if self.node_id.is_empty() || self.node_id.len() > 64 {
            return Err(format!("node id {:?} must be 1..=64 bytes", self.node_id));
        }
        if self.shards.shards == 0 || self.shards.shards > 1024 {
            return Err(format!(
                "shards must be 1..=1024 (got {})",
                self.shards.shards
            ));
        }
        if self.shards.max_keys == 0 {
            return Err("max keys must be at least 1".into());
        }
        if self.shards.inbox == 0 {
            return Err("shard inbox must hold at least 1 command".into());
        }
        if self.forward.max_batch == 0 || self.forward.max_batch > crate::check::plan::MAX_BATCH {
            // A peer refuses a larger Forward call, and every check in it would fail open.
            return Err(format!(
                "forward max batch must be 1..={} (got {}): peers refuse larger batches",
                crate::check::plan::MAX_BATCH,
                self.forward.max_batch
            ));
        }
        if self.forward.timeout.is_zero() {
            return Err("forward timeout must be positive".into());
        }
        if self.rules_poll.is_zero() {
            return Err("rules poll interval must be positive".into());
        }
        Ok(())
    }
}

/// `ringlimit-<hostname or pid>`: unique enough for a single node; clusters set ids.
fn default_node_id() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty() && h.len() <= 48)
        .map(|h| format!("ringlimit-{h}"))
        .unwrap_or_else(|| format!("ringlimit-{}", std::process::id()))
}
