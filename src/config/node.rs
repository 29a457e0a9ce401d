//! How one node is started: addresses, identity, rules file, shard sizing.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::shard::ShardConfig;

/// Default gRPC address of `ringlimit serve`.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7420";
/// Default address of the Prometheus `/metrics` side port.
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:7421";

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
