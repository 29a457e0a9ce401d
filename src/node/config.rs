//! How one node is started: addresses, identity, rules file, shard sizing.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::algorithms::AlgorithmKind;
use crate::cluster::link::ForwardConfig;
use crate::membership::MembershipConfig;
use crate::shard::ShardConfig;

/// Default gRPC address of `ringlimit serve`.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7420";
/// Default address of the ops HTTP port: `/metrics`, health, cluster status, the rules API.
pub const DEFAULT_HTTP_LISTEN: &str = "127.0.0.1:7421";
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
    /// Ops HTTP address (`/metrics`, `/healthz`, `/readyz`, `/v1/...`); `None` serves none.
    pub http_listen: Option<SocketAddr>,
    /// File mode: this rule file is the truth on every node (re-read when it changes) and
    /// the API is read-only. `None`: cluster mode, the cluster's versioned rule set.
    pub rules_path: Option<PathBuf>,
    /// Cluster mode: the rules of a node that has no stored copy (a first start), at
    /// version 1. `None`: the built-in default at version 0.
    pub rules_seed: Option<PathBuf>,
    /// Where the cluster rule set (`<dir>/rules.json`) and the counter snapshot
    /// (`<dir>/counters.snap`) are persisted; `None`: in memory only, a restart starts
    /// over from the seed and catches up from peers, and a key's count from what its
    /// successor holds.
    pub data_dir: Option<PathBuf>,
    /// How often the counters are written to `data_dir` (`--snapshot-interval-ms`,
    /// default 5 s: see docs/ownership.md); zero: never written, never loaded.
    pub snapshot_interval: Duration,
    /// Counters of windows shorter than this are not written
    /// (`--snapshot-min-window-ms`, default 60 s: see docs/ownership.md).
    pub snapshot_min_window: Duration,
    /// The token rules writes must present; `None` refuses every write.
    pub admin_token: Option<crate::server::ops::AdminToken>,
    /// How often the rule file is re-read to pick up changes.
    pub rules_poll: Duration,
    /// Largest rule document accepted, in bytes (`--max-rules-bytes`): the rule file, the
    /// seed, a rules API body, and (with room for their encoding) the stored copy and the
    /// copy pulled from a peer, so a document accepted by one path is accepted by all.
    pub max_rules_bytes: u64,
    /// envoyproxy/ratelimit YAML configuration (a file, or a directory of `*.yaml`) for
    /// Envoy RLS checks; re-read every `rules_poll`. `None`: every Envoy descriptor is
    /// unmatched (OK, no limit).
    pub envoy_path: Option<PathBuf>,
    /// An xDS control plane (`host:port` or `http://host:port`) that sends the Envoy
    /// domains as envoyproxy/ratelimit's `RateLimitConfig` resources (`--envoy-xds`),
    /// instead of `envoy_path`. The last accepted set is kept while it is away.
    pub envoy_xds: Option<String>,
    /// How the xDS client waits between attempts to reach its control plane.
    pub xds_backoff: crate::config::xds::Backoff,
    /// HTTP/2 keepalive of the xDS stream: a control plane that stops answering pings
    /// for this long twice over is taken as away.
    pub xds_keepalive: Duration,
    /// The algorithm of an Envoy `rate_limit` without an `algorithm` key.
    pub envoy_algorithm: AlgorithmKind,
    /// Envoy RLS answers carry `Retry-After` and IETF `RateLimit` headers to add.
    pub envoy_headers: bool,
    /// Serve Gubernator's V1 API on the public listener. Off by default: each of its
    /// requests carries its own limit, so any caller can choose one (docs/security.md).
    pub gubernator: bool,
    /// Shard actors and key cap.
    pub shards: ShardConfig,
    /// Thread-per-core workers (`node::workers`): each a thread with a current-thread
    /// runtime, its own public and peer listeners (`SO_REUSEPORT`) and a share of the
    /// shards. 1: everything runs on the runtime that starts the node.
    pub workers: usize,
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
    /// How often changed keys go to their successors' replicas (`--replicate-interval-ms`,
    /// default 50 ms: see docs/ownership.md); zero: no replicas, no fail-over to
    /// successors, no restore.
    pub replicate_interval: Duration,
    /// Longest a node that starts with seeds waits to restore its keys' replicas before
    /// it answers as owner anyway (`--restore-timeout-ms`).
    pub restore_timeout: Duration,
    /// `--cluster-size`: fenced rules (`partition = "fence"`) are decided only by a node
    /// that hears a majority of this many members; `None`: of the largest view it held
    /// (docs/ownership.md, "Fencing").
    pub cluster_size: Option<std::num::NonZeroUsize>,
    /// HTTP/2 and connection limits of the gRPC listener.
    pub grpc: GrpcLimits,
    /// The cluster key: peer calls and gossip datagrams are signed and checked with it.
    /// Required for a node whose peer or gossip listener is beyond loopback or that has
    /// seeds, unless `insecure_cluster`.
    pub cluster_key: Option<crate::keyring::Keyring>,
    /// Mutual TLS on the peer face: the peer listener asks every client for a
    /// certificate signed by the cluster CA, and this node's peer calls present its own.
    /// On top of the cluster key, which gossip needs in any case.
    pub peer_tls: Option<PeerTls>,
    /// TLS on the public face (every public service: ringlimit.v1, Envoy RLS,
    /// Gubernator, health, reflection), optionally demanding client certificates.
    /// `None`: plaintext HTTP/2.
    pub public_tls: Option<PublicTls>,
    /// Run a cluster without a key (logged as a warning on every start): any process
    /// that reaches the peer port can then speak for the cluster.
    pub insecure_cluster: bool,
    /// The RESP face for Redis clients (`--resp-listen`: redis-cell's `CL.THROTTLE`);
    /// `None`, the default, serves none. Each call carries its own limit, so serving it
    /// is this node's opt-in to caller-chosen limits (docs/redis-clients.md).
    pub resp: Option<RespConfig>,
    /// NEGATIVE CONTROL ONLY: decide every check on the receiving node, ignoring the
    /// ring. A deliberately broken cluster (each node enforces the full limit alone,
    /// the design reference's N × L failure) so the chaos checkers can be shown to fail.
    pub broken_decide_locally: bool,
    /// The HTTP check face (`--check-http-listen`): JSON checks and gateways'
    /// forward-auth subrequests on a listener of its own. `None` (the default): off.
    pub check_http: Option<CheckHttpConfig>,
}

/// The shortest `--snapshot-interval-ms` (0 aside): a snapshot of a million keys takes
/// a sizeable fraction of a second of one core, and writing them back to back would
/// take that core for good.
pub const MIN_SNAPSHOT_INTERVAL: Duration = Duration::from_millis(100);

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            node_id: default_node_id(),
            listen: DEFAULT_LISTEN.parse().expect("valid default address"),
            http_listen: Some(DEFAULT_HTTP_LISTEN.parse().expect("valid default address")),
            rules_path: None,
            rules_seed: None,
            data_dir: None,
            snapshot_interval: crate::node::snapshot::DEFAULT_INTERVAL,
            snapshot_min_window: crate::node::snapshot::DEFAULT_MIN_WINDOW,
            admin_token: None,
            rules_poll: Duration::from_secs(1),
            max_rules_bytes: crate::config::rules::MAX_RULES_FILE_BYTES,
            envoy_path: None,
            envoy_xds: None,
            xds_backoff: crate::config::xds::Backoff::default(),
            xds_keepalive: Duration::from_secs(30),
            envoy_algorithm: AlgorithmKind::FixedWindow,
            envoy_headers: false,
            gubernator: false,
            shards: ShardConfig::default(),
            workers: 1,
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
            replicate_interval: Duration::from_millis(50),
            restore_timeout: Duration::from_secs(3),
            cluster_size: None,
            grpc: GrpcLimits::default(),
            broken_decide_locally: false,
            resp: None,
            cluster_key: None,
            peer_tls: None,
            public_tls: None,
            insecure_cluster: false,
            check_http: None,
        }
    }
}

/// Mutual TLS material of the peer face, PEM-encoded, read once at start.
///
/// Peers are dialled by the IP address gossip publishes, so the certificate a client
/// checks is not for a host name: every member's certificate carries the cluster's
/// peer name ([`PeerTls::DEFAULT_SERVER_NAME`] unless `--peer-tls-server-name`) as a
/// DNS subject alternative name, and is signed by the cluster CA. What it proves is
/// "a member of this cluster", the same claim the cluster key's proof makes.
#[derive(Clone)]
pub struct PeerTls {
    /// This node's certificate chain (leaf first).
    pub cert_pem: Vec<u8>,
    /// Its private key.
    pub key_pem: Vec<u8>,
    /// The CA that signs every member's certificate (server and client side).
    pub ca_pem: Vec<u8>,
    /// The name checked in a peer's certificate.
    pub server_name: String,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("PeerTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl PeerTls {
    /// The peer name member certificates carry by default.
    pub const DEFAULT_SERVER_NAME: &'static str = "ringlimit-peer";

    /// Read the three PEM files; an error names the file and what is wrong with it.
    pub fn from_files(
        cert: &std::path::Path,
        key: &std::path::Path,
        ca: &std::path::Path,
        server_name: &str,
    ) -> Result<Self, String> {
        if server_name.is_empty() {
            return Err("--peer-tls-server-name must not be empty".into());
        }
        Ok(Self {
            cert_pem: read_pem(cert, "--peer-tls-cert")?,
            key_pem: read_pem(key, "--peer-tls-key")?,
            ca_pem: read_pem(ca, "--peer-tls-ca")?,
            server_name: server_name.to_string(),
        })
    }
}

/// TLS material of the public face, PEM-encoded, read once at start: the node's
/// certificate for gateways, and, for mutual TLS, the CA whose certificates clients
/// must present.
///
/// Unlike the peer face's, a gateway dials the node by the name or address it was
/// given, so the certificate is an ordinary server certificate for those names; a
/// client certificate proves "signed by this CA", which is what envoyproxy/ratelimit
/// and Gubernator check too. Reloading needs a restart.
#[derive(Clone)]
pub struct PublicTls {
    /// This node's certificate chain (leaf first).
    pub cert_pem: Vec<u8>,
    /// Its private key.
    pub key_pem: Vec<u8>,
    /// With mutual TLS: the CA (or CAs) that signs the clients' certificates; every
    /// connection must then present one before a byte of HTTP/2. `None`: any client.
    pub client_ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for PublicTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("PublicTls")
            .field("client_certificates", &self.client_ca_pem.is_some())
            .finish_non_exhaustive()
    }
}

impl PublicTls {
    /// Read the PEM files of `--tls-cert`, `--tls-key` and `--tls-client-ca`; an error
    /// names the flag, the file and what is wrong with it.
    pub fn from_files(
        cert: &std::path::Path,
        key: &std::path::Path,
        client_ca: Option<&std::path::Path>,
    ) -> Result<Self, String> {
        Ok(Self {
            cert_pem: read_pem(cert, "--tls-cert")?,
            key_pem: read_pem(key, "--tls-key")?,
            client_ca_pem: client_ca
                .map(|ca| read_pem(ca, "--tls-client-ca"))
                .transpose()?,
        })
    }
}

/// A PEM file named by `flag`: readable and with at least one PEM block, or an error
/// naming both. Whether its blocks are the right kind is checked when the TLS
/// configuration is built ([`NodeConfig::validate`]).
fn read_pem(path: &std::path::Path, flag: &str) -> Result<Vec<u8>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{flag} {}: {e}", path.display()))?;
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(format!("{flag} {}: not a PEM file", path.display()));
    }
    Ok(bytes)
}

/// The secret of [`NodeConfig::for_test`]'s cluster key. Public, so it protects
/// nothing: for tests only.
pub const TEST_CLUSTER_SECRET: &str = "ringlimit-test-cluster-secret-not-for-production";

impl NodeConfig {
    /// Loopback, port 0 for every listener, two shards, fast rule polling.
    pub fn for_test() -> Self {
        Self {
            node_id: "test-node".into(),
            listen: "127.0.0.1:0".parse().expect("valid address"),
            http_listen: Some("127.0.0.1:0".parse().expect("valid address")),
            rules_path: None,
            rules_poll: Duration::from_millis(50),
            max_rules_bytes: crate::config::rules::MAX_RULES_FILE_BYTES,
            envoy_path: None,
            envoy_xds: None,
            xds_backoff: crate::config::xds::Backoff {
                initial: Duration::from_millis(20),
                max: Duration::from_millis(200),
            },
            xds_keepalive: Duration::from_secs(2),
            envoy_algorithm: AlgorithmKind::FixedWindow,
            envoy_headers: false,
            gubernator: false,
            shards: ShardConfig {
                shards: 2,
                ..ShardConfig::default()
            },
            gossip_listen: "127.0.0.1:0".parse().expect("valid address"),
            peer_listen: "127.0.0.1:0".parse().expect("valid address"),
            peer_tls: None,
            cluster_key: Some(
                crate::keyring::Keyring::from_text(TEST_CLUSTER_SECRET).expect("a valid secret"),
            ),
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
            cluster_size: self.cluster_size,
            ..MembershipConfig::new(&self.node_id, grpc_advertise)
        }
    }

    /// Check the settings once at start, so a bad value fails loudly before serving.
    pub fn validate(&self) -> Result<(), String> {
        if self.node_id.is_empty() || self.node_id.len() > 64 {
            return Err(format!("node id {:?} must be 1..=64 bytes", self.node_id));
        }
        if !self.node_id.bytes().all(|b| b.is_ascii_graphic()) {
            // The id travels in peer-call proofs (an HTTP header, space-separated).
            return Err(format!(
                "node id {:?} must be visible ASCII without spaces",
                self.node_id
            ));
        }
        if self.shards.shards == 0 || self.shards.shards > 1024 {
            return Err(format!(
                "shards must be 1..=1024 (got {})",
                self.shards.shards
            ));
        }
        if self.workers == 0 || self.workers > 1024 {
            return Err(format!("workers must be 1..=1024 (got {})", self.workers));
        }
        if self.shards.max_keys == 0 {
            return Err("max keys must be at least 1".into());
        }
        if !self.snapshot_interval.is_zero() && self.snapshot_interval < MIN_SNAPSHOT_INTERVAL {
            return Err(format!(
                "snapshot interval must be 0 (off) or at least {} ms (got {} ms)",
                MIN_SNAPSHOT_INTERVAL.as_millis(),
                self.snapshot_interval.as_millis()
            ));
        }
        if self.shards.inbox == 0 {
            return Err("shard inbox must hold at least 1 command".into());
        }
        if self.cluster_key.is_none() && !self.insecure_cluster {
            // The cluster face (peer service, gossip) is what the key protects; the
            // public port may face gateways on any address without it.
            let exposed = [self.peer_listen, self.gossip_listen]
                .into_iter()
                .find(|a| !a.ip().is_loopback());
            if let Some(addr) = exposed {
                return Err(format!(
                    "listening on {addr} without a cluster key: pass --cluster-secret-file (or --insecure-cluster to run without one)"
                ));
            }
            if !self.seeds.is_empty() {
                return Err("joining a cluster (--seed) without a cluster key: pass --cluster-secret-file (or --insecure-cluster to run without one)".into());
            }
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
        if let Some(resp) = &self.resp {
            resp.limits.validate()?;
        }
        if self.rules_path.is_some() && self.rules_seed.is_some() {
            return Err("give --rules FILE (the file is the truth on every node) or --rules-seed FILE (seeds the cluster rule set), not both".into());
        }
        if self.max_rules_bytes < MIN_RULES_BYTES || self.max_rules_bytes > MAX_RULES_BYTES {
            return Err(format!(
                "max rules bytes must be {MIN_RULES_BYTES}..={MAX_RULES_BYTES} (got {})",
                self.max_rules_bytes
            ));
        }
        if let Some(addr) = &self.envoy_xds {
            if self.envoy_path.is_some() {
                return Err("give --envoy-config PATH (YAML files) or --envoy-xds ADDR (a control plane), not both: one source of Envoy domains".into());
            }
            super::xds::endpoint(addr, self.xds_keepalive).map_err(|e| e.to_string())?;
            if self.xds_backoff.initial.is_zero() || self.xds_backoff.max < self.xds_backoff.initial
            {
                return Err(
                    "xDS backoff: the first wait must be positive and at most the longest".into(),
                );
            }
        }
        if self.rules_poll.is_zero() {
            return Err("rules poll interval must be positive".into());
        }
        if let Some(check_http) = &self.check_http {
            check_http.validate()?;
        }
        self.grpc.validate()
    }
}

/// Largest gRPC request message a node decodes, in bytes (4 MiB, tonic's default made
/// explicit). The largest legitimate messages are a `CheckBatch` of 1,000 checks with
/// full-size keys and descriptors (~2.5 MB) and a handoff chunk of 1,000 key states.
/// A larger one is answered `RESOURCE_EXHAUSTED` before its body is read.
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;

/// Smallest `--max-rules-bytes`: below it not even a handful of rules fits.
pub const MIN_RULES_BYTES: u64 = 4 << 10;

/// Largest `--max-rules-bytes` (256 MiB): the node holds a few copies of the document
/// (text, parsed rules, the peer message), so the cap must stay a bound on memory.
pub const MAX_RULES_BYTES: u64 = 256 << 20;

/// Largest peer message for a node whose rule documents are capped at `max_rules_bytes`:
/// [`MAX_MESSAGE_BYTES`], or room for a rules document as JSON (a forwarded write, a
/// pulled copy) when that is larger: JSON of a document accepted under the cap is at most
/// [`stored_copy_cap`](crate::config::rules::stored_copy_cap) of it.
pub fn peer_message_cap(max_rules_bytes: u64) -> usize {
    let rules = crate::config::rules::stored_copy_cap(max_rules_bytes);
    MAX_MESSAGE_BYTES.max(usize::try_from(rules).unwrap_or(usize::MAX))
}

/// What one client can make the gRPC listener hold. Each bound answers one way a single
/// client can exhaust a node: thousands of streams on one connection, never finished
/// requests, dead or silent peers, an fd-limit spin. The defaults and their
/// reasons are in docs/sizing.md, "What one client can make a node hold".
#[derive(Debug, Clone)]
pub struct GrpcLimits {
    /// Open connections at most; one more is closed at once after accept and counted
    /// (`ringlimit_connections_refused_total`).
    pub max_connections: usize,
    /// HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: streams one connection may have open; a
    /// stream beyond it is refused (`REFUSED_STREAM`).
    pub max_concurrent_streams: u32,
    /// Deadline of one call on the server (the client's `grpc-timeout` applies if
    /// shorter): a stream that never finishes its request is cancelled and freed.
    pub request_timeout: Duration,
    /// A connection must send the HTTP/2 preface within this time, or it is closed.
    pub handshake_timeout: Duration,
    /// HTTP/2 PING sent after this much silence from the peer.
    pub keepalive_interval: Duration,
    /// A PING not answered within this time closes the connection (a dead peer).
    pub keepalive_timeout: Duration,
    /// A connection is asked to go away (GOAWAY, clients reconnect) after this age, and
    /// closed `max_connection_age_grace` later: the bound on a live but idle connection.
    pub max_connection_age: Duration,
    /// Time calls in flight get to finish after the GOAWAY of `max_connection_age`.
    pub max_connection_age_grace: Duration,
    /// When the node stops: how long its gRPC servers wait for open connections to
    /// finish their calls before they stop waiting. Without it one client that holds a
    /// stream open (an answer it never reads) would hold the node's stop until that
    /// connection's `max_connection_age` + grace.
    pub shutdown_grace: Duration,
    /// HTTP/2 SETTINGS_MAX_FRAME_SIZE we accept.
    pub max_frame_size: u32,
    /// HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE: request headers, decoded, at most.
    pub max_header_list_size: u32,
    /// Initial HTTP/2 flow-control window of one stream: request bytes a client may send
    /// ahead of the server reading them, per stream.
    pub initial_stream_window: u32,
    /// Initial HTTP/2 flow-control window of a connection: the same across all streams
    /// of one connection (the bound on unread request bytes per connection).
    pub initial_connection_window: u32,
    /// Items of bulk answers (`CheckBatch`, Gubernator `GetRateLimits`) decided but not
    /// yet taken by their connections, node-wide; a bulk call beyond it is refused
    /// before anything is decided (`crate::server::answer_budget`).
    pub max_unsent_answer_items: u32,
}

impl Default for GrpcLimits {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            max_concurrent_streams: 256,
            request_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(20),
            keepalive_timeout: Duration::from_secs(10),
            max_connection_age: Duration::from_secs(30 * 60),
            max_connection_age_grace: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(10),
            max_frame_size: 16 * 1024,
            max_header_list_size: 16 * 1024,
            initial_stream_window: 256 * 1024,
            initial_connection_window: 1024 * 1024,
            max_unsent_answer_items: crate::server::answer_budget::DEFAULT_MAX_UNSENT_ANSWER_ITEMS,
        }
    }
}

impl GrpcLimits {
    /// Refuse values that would switch a limit off or break HTTP/2.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_connections == 0 {
            return Err("max connections must be at least 1".into());
        }
        if self.max_concurrent_streams == 0 {
            return Err("max concurrent streams must be at least 1".into());
        }
        let one_call = crate::server::answer_budget::MAX_ITEMS_PER_CALL;
        if (self.max_unsent_answer_items as usize) < one_call {
            return Err(format!(
                "max unsent answer items must be at least one full batch ({one_call})"
            ));
        }
        for (name, d) in [
            ("request timeout", self.request_timeout),
            ("handshake timeout", self.handshake_timeout),
            ("keepalive interval", self.keepalive_interval),
            ("keepalive timeout", self.keepalive_timeout),
            ("max connection age", self.max_connection_age),
        ] {
            if d.is_zero() {
                return Err(format!("{name} must be positive"));
            }
        }
        // RFC 9113 6.5.2: SETTINGS_MAX_FRAME_SIZE is 2^14..=2^24-1.
        if !(16_384..=16_777_215).contains(&self.max_frame_size) {
            return Err(format!(
                "max frame size must be 16384..=16777215 (got {})",
                self.max_frame_size
            ));
        }
        // RFC 9113 6.9.2: a window above 2^31-1 is a flow-control error.
        if self.initial_stream_window == 0
            || self.initial_connection_window == 0
            || self.initial_stream_window > i32::MAX as u32
            || self.initial_connection_window > i32::MAX as u32
        {
            return Err("flow-control windows must be 1..=2147483647".into());
        }
        if self.max_header_list_size < 1024 {
            return Err("max header list size must be at least 1024".into());
        }
        Ok(())
    }
}

/// The HTTP check face's listener and bounds (`server::http_check`). Never the ops
/// port: the ops face carries the admin token and the rules API, and gateways reach
/// this one.
#[derive(Debug, Clone)]
pub struct CheckHttpConfig {
    /// Where it listens.
    pub listen: SocketAddr,
    /// How forward-auth subrequests name the client key (a header or the client
    /// address behind trusted proxies).
    pub forward_auth: crate::server::forward_auth::ForwardAuthConfig,
    /// Connections open at once; at the cap a new one closes the one that has waited
    /// longest for a request head (never one being served).
    pub max_connections: usize,
    /// Time a connection has to send a complete request head, from opening or from its
    /// previous answer (this also closes idle keep-alive connections).
    pub header_timeout: Duration,
    /// Longest life of one connection.
    pub max_connection_age: Duration,
    /// Bytes of one request head (request line and headers) at most.
    pub max_head_bytes: usize,
    /// Bytes of one request body at most (`POST /v1/check`).
    pub max_body_bytes: usize,
    /// Time a body has to arrive once its head has.
    pub body_timeout: Duration,
}

impl CheckHttpConfig {
    /// The face on `listen` with the default bounds, keying forward-auth by the TCP
    /// peer (no trusted proxies).
    pub fn on(listen: SocketAddr) -> Self {
        CheckHttpConfig {
            listen,
            forward_auth: Default::default(),
            max_connections: 1024,
            header_timeout: Duration::from_secs(10),
            max_connection_age: Duration::from_secs(3600),
            max_head_bytes: MAX_HEAD_BYTES,
            max_body_bytes: crate::server::http_check::DEFAULT_MAX_BODY_BYTES,
            body_timeout: crate::server::http_check::DEFAULT_BODY_TIMEOUT,
        }
    }

    /// Refuse bounds that would switch a bound off.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_connections == 0 {
            return Err("check HTTP face: max connections must be at least 1".into());
        }
        if self.max_head_bytes < 1024 || self.max_body_bytes < 1024 {
            return Err("check HTTP face: head and body limits must be at least 1024 bytes".into());
        }
        for (name, d) in [
            ("header timeout", self.header_timeout),
            ("max connection age", self.max_connection_age),
            ("body timeout", self.body_timeout),
        ] {
            if d.is_zero() {
                return Err(format!("check HTTP face: {name} must be positive"));
            }
        }
        Ok(())
    }
}

/// `ringlimit-<hostname or pid>`: unique enough for a single node; clusters set ids.
fn default_node_id() -> String {
    machine_hostname().unwrap_or_else(|| format!("ringlimit-{}", std::process::id()))
}

/// The machine's hostname, read from the kernel (`/proc/sys/kernel/hostname`, then
/// `/etc/hostname`), not from `$HOSTNAME`, which shells set but do not export: a node
/// started from a script then got `ringlimit-<pid>`, a new member on every restart. In a
/// Kubernetes StatefulSet the hostname is the pod name, stable across restarts.
pub fn machine_hostname() -> Option<String> {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok())
        .map(|text| text.trim().to_string())
        .find(|h| valid_hostname_id(h))
}

/// A hostname usable as a node id: 1..=64 bytes of visible ASCII (node ids travel in
/// peer-call proofs).
fn valid_hostname_id(h: &str) -> bool {
    !h.is_empty() && h.len() <= 64 && h.bytes().all(|b| b.is_ascii_graphic())
}

/// Largest request head (request line and headers) a bounded HTTP connection reads
/// (the ops listener, the HTTP check face): past it the connection is closed before
/// the head is parsed.
pub const MAX_HEAD_BYTES: usize = 16 << 10;

/// The RESP face's settings (`serve --resp-listen` and its companions).
#[derive(Debug, Clone)]
pub struct RespConfig {
    /// Address to listen on (port 0 picks a free port).
    pub listen: std::net::SocketAddr,
    /// The password `AUTH` must present; `None`: every connection is served at once.
    pub token: Option<crate::server::resp::RespToken>,
    /// Per-connection and per-listener bounds.
    pub limits: crate::server::resp::RespLimits,
}

impl RespConfig {
    /// A face on `listen` with the default bounds and no token.
    pub fn on(listen: std::net::SocketAddr) -> Self {
        Self {
            listen,
            token: None,
            limits: crate::server::resp::RespLimits::default(),
        }
    }

    /// This face with the token in the first line of `path`.
    pub fn with_token_file(mut self, path: &std::path::Path) -> Result<Self, String> {
        self.token = Some(crate::server::resp::RespToken::from_file(path)?);
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_node_id_is_the_kernel_hostname_when_it_is_usable() {
        let kernel = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| valid_hostname_id(h));
        match kernel {
            Some(h) => assert_eq!(default_node_id(), h),
            None => assert!(default_node_id().starts_with("ringlimit-")),
        }
        assert!(!valid_hostname_id(""));
        assert!(!valid_hostname_id("has space"));
        assert!(!valid_hostname_id(&"h".repeat(65)));
    }

    #[test]
    fn default_grpc_limits_are_valid_and_switching_one_off_is_refused() {
        assert!(NodeConfig::default().validate().is_ok());
        assert!(NodeConfig::for_test().validate().is_ok());
        let off: [fn(&mut GrpcLimits); 7] = [
            |l| l.max_connections = 0,
            |l| l.max_concurrent_streams = 0,
            |l| l.max_unsent_answer_items = 999,
            |l| l.request_timeout = Duration::ZERO,
            |l| l.keepalive_timeout = Duration::ZERO,
            |l| l.max_frame_size = 1024,
            |l| l.initial_connection_window = u32::MAX,
        ];
        for switch_off in off {
            let mut config = NodeConfig::for_test();
            switch_off(&mut config.grpc);
            assert!(config.validate().is_err(), "{:?}", config.grpc);
        }
    }

    #[test]
    fn public_tls_never_prints_its_key() {
        let tls = PublicTls {
            cert_pem: b"certificate".to_vec(),
            key_pem: b"SECRET-KEY-MATERIAL".to_vec(),
            client_ca_pem: Some(b"ca".to_vec()),
        };
        let shown = format!("{tls:?}");
        assert!(!shown.contains("SECRET"), "{shown}");
        assert!(shown.contains("client_certificates: true"), "{shown}");
    }

    #[test]
    fn a_node_id_that_cannot_travel_in_a_peer_call_proof_is_refused() {
        for id in ["node a", "nöde", "tab\tid"] {
            let config = NodeConfig {
                node_id: id.into(),
                ..NodeConfig::for_test()
            };
            let error = config.validate().unwrap_err();
            assert!(error.contains("visible ASCII"), "{id:?}: {error}");
        }
    }

    #[test]
    fn a_rules_cap_that_fits_no_rules_or_no_memory_is_refused() {
        for bytes in [0, MIN_RULES_BYTES - 1, MAX_RULES_BYTES + 1] {
            let config = NodeConfig {
                max_rules_bytes: bytes,
                ..NodeConfig::for_test()
            };
            let error = config.validate().unwrap_err();
            assert!(error.contains("max rules bytes"), "{bytes}: {error}");
        }
        for bytes in [MIN_RULES_BYTES, MAX_RULES_BYTES] {
            let config = NodeConfig {
                max_rules_bytes: bytes,
                ..NodeConfig::for_test()
            };
            assert!(config.validate().is_ok(), "{bytes}");
        }
    }

    #[test]
    fn the_peer_face_carries_any_rules_document_the_cap_admits() {
        assert_eq!(peer_message_cap(MIN_RULES_BYTES), MAX_MESSAGE_BYTES);
        let cap = crate::config::rules::MAX_RULES_FILE_BYTES;
        assert!(peer_message_cap(cap) as u64 >= crate::config::rules::stored_copy_cap(cap));
        assert!(peer_message_cap(cap) > MAX_MESSAGE_BYTES);
    }
}
