//! `ringlimit serve`: flags → [`NodeConfig`] → `node::run`, with one ready line on stdout.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use ringlimit::node::config::{
    GrpcLimits, NodeConfig, DEFAULT_GOSSIP_LISTEN, DEFAULT_HTTP_LISTEN, DEFAULT_LISTEN,
    DEFAULT_PEER_LISTEN,
};

use super::peer_tls::PeerTlsArgs;
use super::{init_logging, parse_algorithm, runtime_with, wait_for_signal, LogFormat};

/// The flags of `ringlimit serve`: every field of [`NodeConfig`] a deployment sets.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// gRPC address to listen on.
    #[arg(long, default_value = DEFAULT_LISTEN, env = "RINGLIMIT_LISTEN")]
    listen: SocketAddr,
    /// Address of the ops HTTP port: /metrics, /healthz, /readyz, /v1/cluster,
    /// /v1/owner, /v1/limits, /v1/rules [default: 127.0.0.1:7421]. --metrics-listen and
    /// RINGLIMIT_METRICS_LISTEN are the old names and still work.
    #[arg(long, alias = "metrics-listen", env = "RINGLIMIT_HTTP_LISTEN")]
    http_listen: Option<SocketAddr>,
    /// Do not serve the ops HTTP port (--no-metrics is the old name).
    #[arg(long, alias = "no-metrics")]
    no_http: bool,
    /// File mode: this rule file (TOML) is the truth on every node, re-read when it
    /// changes; the rules API is read-only and nodes whose files differ are reported.
    /// Without it: cluster mode, rules changed through the API.
    #[arg(long, env = "RINGLIMIT_RULES", conflicts_with = "rules_seed")]
    rules: Option<PathBuf>,
    /// envoyproxy/ratelimit YAML configuration for Envoy RLS checks: one file, or a
    /// directory of *.yaml / *.yml files (one domain each); re-read when it changes.
    #[arg(long, env = "RINGLIMIT_ENVOY_CONFIG")]
    envoy_config: Option<PathBuf>,
    /// An xDS control plane (host:port or http://host:port) to take the Envoy domains
    /// from instead: envoyproxy/ratelimit's RateLimitConfig resources, state of the
    /// world, as Envoy Gateway serves them (docs/envoy.md). The last accepted set is kept
    /// while the control plane is away.
    #[arg(
        long,
        env = "RINGLIMIT_ENVOY_XDS",
        value_name = "ADDR",
        conflicts_with = "envoy_config"
    )]
    envoy_xds: Option<String>,
    /// Algorithm of an Envoy rate_limit without an `algorithm` key (default fixed_window,
    /// the reference server's, so a migrated file decides as before).
    #[arg(long, default_value = "fixed_window", value_parser = parse_algorithm)]
    envoy_algorithm: ringlimit::algorithms::AlgorithmKind,
    /// Envoy RLS answers ask Envoy to add Retry-After and the IETF RateLimit and
    /// RateLimit-Policy headers (docs/envoy.md).
    #[arg(long)]
    envoy_headers: bool,
    /// Also serve Gubernator's V1 API (pb.gubernator.V1: GetRateLimits, HealthCheck) on
    /// the public listener. Each request carries its own limit, so any caller that can
    /// reach the port chooses its own: only for trusted callers (docs/security.md,
    /// docs/gubernator.md).
    #[arg(long)]
    gubernator: bool,
    /// Cluster mode: the rules of an empty cluster (used when --data-dir holds no copy).
    #[arg(long, env = "RINGLIMIT_RULES_SEED")]
    rules_seed: Option<PathBuf>,
    /// Where the cluster rule set (rules.json) and the counter snapshot
    /// (counters.snap) are persisted, each written atomically; a restarted node starts
    /// from them. Without it the rules live in memory only and a restart takes its
    /// keys' counts from their successors.
    #[arg(long, env = "RINGLIMIT_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// With --data-dir: how often the counters are written there, in ms (at least 100):
    /// a crash of the whole cluster loses at most what was admitted in the last interval
    /// (docs/ownership.md). 0: never written, never loaded.
    #[arg(long, default_value_t = 5_000)]
    snapshot_interval_ms: u64,
    /// Counters of windows shorter than this (a token bucket: its time to refill) are
    /// not written to the snapshot, in ms: by the time a crashed node is back they
    /// have ended.
    #[arg(long, default_value_t = 60_000)]
    snapshot_min_window_ms: u64,
    /// File holding the admin token the rules API's writes must present
    /// (Authorization: Bearer); without it every write is refused.
    #[arg(long, env = "RINGLIMIT_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<PathBuf>,
    /// This node's id in answers and on the ring (default: the machine's hostname).
    #[arg(long, env = "RINGLIMIT_NODE_ID")]
    node_id: Option<String>,
    /// Number of shard actors (default: number of cores).
    #[arg(long)]
    shards: Option<usize>,
    /// Threads that run the node (default: the cores this process may use). Each is a
    /// worker with a current-thread runtime of its own, its own public and peer
    /// listeners on the same ports (SO_REUSEPORT) and a share of the shards
    /// (thread-per-core): a connection never leaves its thread, a check whose shard
    /// is on another thread crosses once. `--threads 1` runs every task on one thread.
    #[arg(long, env = "RINGLIMIT_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    threads: Option<u16>,
    /// Run the --threads on one work-stealing runtime (tokio's multi-thread scheduler)
    /// instead of thread-per-core: for comparison (bench/compare.sh).
    #[arg(long)]
    work_stealing: bool,
    /// Most keys this node holds; beyond it the least-harm keys are evicted, never an
    /// exhausted one while another can go (and every eviction is counted).
    #[arg(long, default_value_t = 1_000_000)]
    max_keys: usize,
    /// Most bytes of per-key state kept beside the key table (sliding logs grow 16 bytes
    /// per admitted unit); beyond it, least-harm eviction as for --max-keys. Bytes, or
    /// with a KiB/MiB/GiB suffix. Default: 256 bytes × --max-keys.
    #[arg(long, value_parser = parse_bytes)]
    max_state_bytes: Option<usize>,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// gRPC address peers use to reach this node (default: the --listen address).
    #[arg(long, env = "RINGLIMIT_ADVERTISE")]
    advertise: Option<SocketAddr>,
    /// UDP gossip address.
    #[arg(long, default_value = DEFAULT_GOSSIP_LISTEN, env = "RINGLIMIT_GOSSIP_LISTEN")]
    gossip_listen: SocketAddr,
    /// Gossip address peers use (default: the --gossip-listen address).
    #[arg(long, env = "RINGLIMIT_GOSSIP_ADVERTISE")]
    gossip_advertise: Option<SocketAddr>,
    /// Peer service address (the cluster face: forwarded checks, refunds, handoff);
    /// put it on a private network. The public --listen port does not serve it.
    #[arg(long, default_value = DEFAULT_PEER_LISTEN, env = "RINGLIMIT_PEER_LISTEN")]
    peer_listen: SocketAddr,
    /// Peer address other nodes use (default: the --peer-listen address, or with a
    /// wildcard listener the --advertise IP with the peer port).
    #[arg(long, env = "RINGLIMIT_PEER_ADVERTISE")]
    peer_advertise: Option<SocketAddr>,
    /// Gossip address (host:port) of a node to join through; repeat for several.
    #[arg(long = "seed", env = "RINGLIMIT_SEEDS", value_delimiter = ',')]
    seeds: Vec<String>,
    /// Cluster id: nodes only gossip within the same id.
    #[arg(long, default_value = ringlimit::membership::DEFAULT_CLUSTER_ID)]
    cluster_id: String,
    /// Deadline of a forwarded check, in ms; past it the node fails open (or closed).
    #[arg(long, default_value_t = 250)]
    forward_timeout_ms: u64,
    /// Denials ("denied until T") a node remembers to answer repeat checks without a hop
    /// (0: none; every check of a denied client goes to its owner).
    #[arg(long, default_value_t = 100_000)]
    deny_cache: usize,
    /// How often each key's changes go to its successor's replica, in ms (a crashed
    /// owner's keys lose at most what it admitted in the last interval: see
    /// docs/ownership.md). 0: off, a crashed owner's keys restart from empty.
    #[arg(long, default_value_t = 50)]
    replicate_interval_ms: u64,
    /// Longest a restarted node waits for its keys' replicas before it answers as owner.
    #[arg(long, default_value_t = 3000)]
    restore_timeout_ms: u64,
    /// How many members the cluster has (a StatefulSet's replicas): a node decides the
    /// keys of fenced rules (`partition = "fence"`) only while it hears a majority of
    /// them. Unset: a majority of the largest view it held (docs/ownership.md).
    #[arg(long)]
    cluster_size: Option<std::num::NonZeroUsize>,
    /// Budget leases of hot counters (docs/leases.md): checks per second of one
    /// counter, through this node, at which it asks the counter's owner for a lease and
    /// decides its checks locally from it. 0: never (leases off).
    #[arg(long, env = "RINGLIMIT_LEASE_THRESHOLD", default_value_t = ringlimit::shard::budget::DEFAULT_LEASE_THRESHOLD)]
    lease_threshold: u64,
    /// Longest a budget lease lasts, in ms (a window's end may end it sooner).
    #[arg(long, env = "RINGLIMIT_LEASE_TTL_MS", default_value_t = 1_000)]
    lease_ttl_ms: u64,
    /// Fewest units worth a budget lease; below it the owner decides every check.
    #[arg(long, env = "RINGLIMIT_LEASE_FLOOR", default_value_t = 2)]
    lease_floor: u64,
    /// How long a forward batch waits for more checks, in µs (0: send what is queued).
    #[arg(long, default_value_t = 0)]
    forward_flush_us: u64,
    /// Most checks in one forwarded batch.
    #[arg(long, default_value_t = 1000)]
    forward_max_batch: usize,
    /// Most forward calls in flight to one peer (0: no limit); checks queue meanwhile
    /// and leave together as one batch when a call returns.
    #[arg(long, default_value_t = 1)]
    forward_max_in_flight: usize,
    /// Send forwarded batches as one unary `Peer/Forward` call each instead of on one
    /// long-lived stream per peer (what a node does anyway for a peer of an older build):
    /// to compare the two.
    #[arg(long)]
    forward_unary: bool,
    /// Carry the forward stream as length-prefixed frames on a connection of its own
    /// instead of an HTTP/2 `Peer/ForwardStream` (3–12 % less CPU per forwarded check;
    /// not with peer TLS). Off by default: the long chaos profile finds entries
    /// answering from denials they should not have cached with it, and none without.
    #[arg(long)]
    forward_frames: bool,
    /// Largest rule document accepted, in bytes (or KiB/MiB/GiB): the rule file, the
    /// seed, a `PUT /v1/rules` body and the copies nodes exchange. The default fits
    /// 100,000 per-client rules (about 7.4 MB).
    #[arg(long, env = "RINGLIMIT_MAX_RULES_BYTES", value_parser = parse_bytes, default_value_t = ringlimit::config::rules::MAX_RULES_FILE_BYTES as usize)]
    max_rules_bytes: usize,
    /// Most open gRPC connections; one more is closed at once (and counted).
    #[arg(long, default_value_t = GrpcLimits::default().max_connections)]
    max_connections: usize,
    /// Most HTTP/2 streams open on one connection; more are refused (REFUSED_STREAM).
    #[arg(long, default_value_t = GrpcLimits::default().max_concurrent_streams)]
    max_concurrent_streams: u32,
    /// HTTP/2 flow-control window of one stream, in bytes (or KiB/MiB): request bytes a
    /// client may send before the node reads them. Measured (bench/h2-settings.sh,
    /// bench/RESULTS.md): 1 MiB saved no CPU per check anywhere; HTTP/2's initial 64 KiB
    /// cost the 3-node cluster a few percent (unary and batch unchanged).
    #[arg(long, value_parser = parse_window, default_value_t = GrpcLimits::default().initial_stream_window)]
    h2_stream_window: u32,
    /// HTTP/2 flow-control window of one connection, across its streams: the bound on
    /// unread request bytes per connection.
    #[arg(long, value_parser = parse_window, default_value_t = GrpcLimits::default().initial_connection_window)]
    h2_connection_window: u32,
    /// Items of CheckBatch / GetRateLimits answers decided but not yet read by their
    /// clients, node-wide; a bulk call beyond it gets RESOURCE_EXHAUSTED before anything
    /// is decided (about 400 bytes per item: the default bounds ~100 MB).
    #[arg(long, default_value_t = GrpcLimits::default().max_unsent_answer_items)]
    max_unsent_answer_items: u32,
    /// Server-side deadline of one gRPC call, in ms (a shorter grpc-timeout wins).
    #[arg(long, default_value_t = GrpcLimits::default().request_timeout.as_millis() as u64)]
    request_timeout_ms: u64,
    /// On stop (SIGTERM, Ctrl-C): how long, in ms, the gRPC servers wait for open
    /// connections to finish their calls before the node stops without them.
    #[arg(long, default_value_t = GrpcLimits::default().shutdown_grace.as_millis() as u64)]
    shutdown_grace_ms: u64,
    /// The cluster key: a file of secrets, one per line (the first signs, all verify;
    /// see docs/security.md). Required when the peer or gossip listener is beyond
    /// loopback, or to join (--seed).
    #[arg(long, env = "RINGLIMIT_CLUSTER_SECRET_FILE")]
    cluster_secret_file: Option<PathBuf>,
    #[command(flatten)]
    peer_tls: PeerTlsArgs,
    /// Run a cluster without a key: anyone who reaches the peer port can then speak for
    /// the cluster. Logged as a warning on every start.
    #[arg(long)]
    insecure_cluster: bool,
    /// NEGATIVE CONTROL for the chaos tests: decide every check locally, ignoring the
    /// ring (a deliberately broken cluster). Never use in production.
    #[arg(long, hide = true)]
    broken_decide_locally: bool,
    #[command(flatten)]
    public_tls: PublicTlsArgs,
    #[command(flatten)]
    check_http: super::check_http::CheckHttpArgs,
    #[command(flatten)]
    resp: super::resp::RespArgs,
}

/// TLS on the public face (docs/security.md, "TLS on the public face"): every service
/// callers reach (ringlimit.v1, Envoy RLS, Gubernator, health, reflection, and the HTTP
/// check and RESP faces when served) then speaks TLS only, with one certificate.
/// Certificates are read once at start: replacing them needs a restart.
#[derive(clap::Args)]
struct PublicTlsArgs {
    /// Certificate chain (PEM, leaf first) the public faces present to their callers:
    /// the gRPC listener, and the HTTP check and RESP listeners when served.
    #[arg(long, env = "RINGLIMIT_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "RINGLIMIT_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Mutual TLS: the CA (PEM; several CAs may be concatenated) whose certificates
    /// clients must present; a connection without one is refused during the handshake.
    #[arg(long, env = "RINGLIMIT_TLS_CLIENT_CA", requires_all = ["tls_cert", "tls_key"])]
    tls_client_ca: Option<PathBuf>,
}

impl PublicTlsArgs {
    /// The loaded files, or `None` when no TLS flag was given.
    fn load(&self) -> anyhow::Result<Option<ringlimit::node::config::PublicTls>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        ringlimit::node::config::PublicTls::from_files(cert, key, self.tls_client_ca.as_deref())
            .map(Some)
            .map_err(anyhow::Error::msg)
    }
}

/// `ringlimit serve`: runs a node until Ctrl-C or SIGTERM, then leaves gracefully.
pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    init_logging(args.log_format);
    let threads = args.threads.map(usize::from).unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let work_stealing = args.work_stealing;
    let mut config = node_config(args)?;
    // Thread-per-core: this thread is worker 0 on a current-thread runtime and the node
    // starts the others; work-stealing: one multi-thread runtime with that many workers.
    let runtime = if work_stealing {
        runtime_with(Some(threads))?
    } else {
        config.workers = threads;
        runtime_with(Some(1))?
    };
    runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        let signal = shutdown.clone();
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!("shutdown signal received");
            signal.cancel();
        });
        ringlimit::node::run(config, shutdown, print_ready).await
    })?;
    Ok(ExitCode::SUCCESS)
}

/// One machine-readable line on stdout: scripts and tests that start nodes on port 0
/// learn the bound addresses from it.
fn print_ready(node: &ringlimit::node::RunningNode) {
    println!(
        "ringlimit ready node_id={} generation={} grpc={} gossip={} metrics={} peer={} http={} check_http={} resp={}",
        node.decider.node_id,
        node.decider.generation,
        node.grpc_addr,
        node.gossip_addr,
        node.http_addr.map_or("-".to_string(), |a| a.to_string()),
        node.peer_addr,
        node.http_addr.map_or("-".to_string(), |a| a.to_string()),
        node.check_http_addr.map_or("-".to_string(), |a| a.to_string()),
        node.resp_addr.map_or("-".to_string(), |a| a.to_string()),
    );
}

/// The ops HTTP address: the flag (or RINGLIMIT_HTTP_LISTEN), else the old variable
/// RINGLIMIT_METRICS_LISTEN, else the default.
fn http_listen(flag: Option<SocketAddr>) -> anyhow::Result<SocketAddr> {
    Ok(match flag {
        Some(addr) => addr,
        None => match std::env::var("RINGLIMIT_METRICS_LISTEN") {
            Ok(text) => text
                .parse()
                .with_context(|| format!("RINGLIMIT_METRICS_LISTEN={text:?} is not an address"))?,
            Err(_) => DEFAULT_HTTP_LISTEN
                .parse()
                .expect("a valid default address"),
        },
    })
}

/// The node configuration the flags describe (files named by flags are read here).
fn node_config(args: ServeArgs) -> anyhow::Result<NodeConfig> {
    let http_listen = http_listen(args.http_listen)?;
    let mut config = NodeConfig {
        listen: args.listen,
        http_listen: (!args.no_http).then_some(http_listen),
        rules_path: args.rules,
        envoy_path: args.envoy_config,
        envoy_xds: args.envoy_xds,
        envoy_algorithm: args.envoy_algorithm,
        envoy_headers: args.envoy_headers,
        rules_seed: args.rules_seed,
        data_dir: args.data_dir,
        gubernator: args.gubernator,
        ..NodeConfig::default()
    };
    config.admin_token = args
        .admin_token_file
        .as_deref()
        .map(ringlimit::server::ops::AdminToken::from_file)
        .transpose()
        .map_err(|e| anyhow::anyhow!(e))?;
    if let Some(id) = args.node_id {
        config.node_id = id;
    }
    if let Some(shards) = args.shards {
        config.shards.shards = shards;
    }
    config.shards.max_keys = args.max_keys;
    config.shards.lease_threshold = args.lease_threshold;
    config.shards.lease_policy = ringlimit::shard::budget::LeasePolicy {
        ttl_ms: args.lease_ttl_ms.clamp(1, 60_000),
        floor: args.lease_floor.max(1),
    };
    config.shards.max_state_bytes = args.max_state_bytes;
    config.advertise = args.advertise;
    config.gossip_listen = args.gossip_listen;
    config.gossip_advertise = args.gossip_advertise;
    config.peer_listen = args.peer_listen;
    config.peer_advertise = args.peer_advertise;
    config.seeds = args.seeds;
    config.cluster_id = args.cluster_id;
    config.forward.timeout = std::time::Duration::from_millis(args.forward_timeout_ms);
    config.replicate_interval = std::time::Duration::from_millis(args.replicate_interval_ms);
    config.deny_cache = args.deny_cache;
    config.restore_timeout = std::time::Duration::from_millis(args.restore_timeout_ms);
    config.cluster_size = args.cluster_size;
    config.snapshot_interval = std::time::Duration::from_millis(args.snapshot_interval_ms);
    config.snapshot_min_window = std::time::Duration::from_millis(args.snapshot_min_window_ms);
    config.forward.flush_delay = std::time::Duration::from_micros(args.forward_flush_us);
    config.forward.max_batch = args.forward_max_batch;
    config.forward.max_in_flight = args.forward_max_in_flight;
    config.forward.stream = !args.forward_unary;
    config.forward.frames = args.forward_frames;
    config.max_rules_bytes = args.max_rules_bytes as u64;
    config.grpc.max_connections = args.max_connections;
    config.grpc.max_concurrent_streams = args.max_concurrent_streams;
    config.grpc.max_unsent_answer_items = args.max_unsent_answer_items;
    config.grpc.initial_stream_window = args.h2_stream_window;
    config.grpc.initial_connection_window = args.h2_connection_window;
    config.grpc.request_timeout = std::time::Duration::from_millis(args.request_timeout_ms);
    config.grpc.shutdown_grace = std::time::Duration::from_millis(args.shutdown_grace_ms);
    config.broken_decide_locally = args.broken_decide_locally;
    config.insecure_cluster = args.insecure_cluster;
    config.cluster_key = args
        .cluster_secret_file
        .as_deref()
        .map(ringlimit::keyring::Keyring::from_file)
        .transpose()?;
    config.peer_tls = args.peer_tls.load()?;
    config.public_tls = args.public_tls.load()?;
    config.check_http = args.check_http.load()?;
    config.resp = args.resp.config()?;
    Ok(config)
}

/// An HTTP/2 flow-control window: a byte count of 1..=2^31-1 (RFC 9113 6.9.2).
fn parse_window(text: &str) -> Result<u32, String> {
    let bytes = parse_bytes(text)?;
    u32::try_from(bytes)
        .ok()
        .filter(|&w| w >= 1 && w <= i32::MAX as u32)
        .ok_or_else(|| format!("{text:?}: a window is 1 to 2147483647 bytes"))
}

/// A byte count: digits, optionally followed by `KiB`, `MiB` or `GiB`.
fn parse_bytes(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, ""),
    };
    let scale: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => {
            return Err(format!(
                "unknown unit {other:?} (use bytes, KiB, MiB or GiB)"
            ))
        }
    };
    let n: usize = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a byte count (e.g. 268435456 or 256MiB)"))?;
    n.checked_mul(scale)
        .ok_or_else(|| format!("{text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::{parse_bytes, parse_window};

    #[test]
    fn byte_counts_take_binary_suffixes_and_refuse_nonsense() {
        assert_eq!(parse_bytes("268435456"), Ok(268_435_456));
        assert_eq!(parse_bytes("256MiB"), Ok(256 << 20));
        assert_eq!(parse_bytes("1 GiB"), Ok(1 << 30));
        assert!(parse_bytes("12MB").unwrap_err().contains("unknown unit"));
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("99999999999999999999GiB").is_err());
    }

    #[test]
    fn http2_windows_stay_within_what_http2_allows() {
        assert_eq!(parse_window("64KiB"), Ok(65_536));
        assert_eq!(parse_window("2147483647"), Ok(i32::MAX as u32));
        assert!(parse_window("0").is_err());
        assert!(parse_window("2GiB")
            .unwrap_err()
            .contains("1 to 2147483647"));
        assert!(parse_window("8GiB").is_err());
    }
}
