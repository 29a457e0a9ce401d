//! The `ringlimit` binary: clap → config → `node::run(config, shutdown)`.

mod bench;
mod cli;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use ringlimit::config::rules::RuleSet;
use ringlimit::node::config::{
    GrpcLimits, NodeConfig, DEFAULT_GOSSIP_LISTEN, DEFAULT_HTTP_LISTEN, DEFAULT_LISTEN,
    DEFAULT_PEER_LISTEN,
};
use ringlimit::proto::rate_limiter_client::RateLimiterClient;
use ringlimit::proto::{CheckRequest, CheckResponse};

// The global allocator stays glibc's. mimalloc was tried (issue 5): about 10 % more
// checks/s on one node, but a node's resident memory after filling 1,000,000 keys then
// varied from 55 to 78 bytes per key between identical runs (freed memory kept by the
// allocator), against a steady 54 with glibc; the memory target is the one we can meet.

/// A self-contained clustered rate limiter.
#[derive(Parser)]
#[command(name = "ringlimit", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a node (defaults: gRPC on 127.0.0.1:7420, ops HTTP on 127.0.0.1:7421, gossip
    /// on 127.0.0.1:7422, peer service on 127.0.0.1:7423; built-in rule: sliding window
    /// counter, 100 per 60 s).
    Serve(Box<ServeArgs>),
    /// Ask a node whether one request may proceed. Exits 0 when allowed, 1 when denied,
    /// 2 when refused (bad input) or the node is unreachable.
    Check(CheckArgs),
    /// Which member owns a client key (asks a node's ops port; charges nothing).
    Owner {
        /// The client key.
        #[arg(long)]
        key: String,
        /// The node's ops HTTP address.
        #[arg(long, default_value = DEFAULT_HTTP_LISTEN)]
        addr: String,
    },
    /// Rule tools: validate a file; read, replace or compare a cluster's rules.
    Rules {
        #[command(subcommand)]
        command: RulesCommand,
    },
    /// Cluster tools.
    Cluster {
        #[command(subcommand)]
        command: ClusterCommand,
    },
    /// Start N nodes on loopback, one `serve` process each, to try a cluster (Ctrl-C
    /// stops them, each leaving gracefully).
    DevCluster(DevClusterArgs),
    /// Load generator: checks/s and latency percentiles, optionally side by side with
    /// Redis + the design reference's Lua script (--compare-redis).
    Bench(bench::BenchArgs),
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// Members, generations, ring shares and ring digest as one node sees them.
    Status {
        /// The node's peer service address (host:port or http://host:port): the
        /// cluster face, not the public gRPC port.
        #[arg(long, default_value = DEFAULT_PEER_LISTEN)]
        addr: String,
        /// Print JSON (64-bit numbers as strings).
        #[arg(long)]
        json: bool,
        /// The cluster's secret file: the peer service answers only signed calls.
        #[arg(long, env = "RINGLIMIT_CLUSTER_SECRET_FILE")]
        cluster_secret_file: Option<PathBuf>,
        /// A certificate of the cluster CA, when the peer face uses mutual TLS.
        #[command(flatten)]
        tls: PeerTlsArgs,
    },
}

/// Mutual TLS on the peer face (docs/security.md): all three files, or none.
#[derive(clap::Args, Clone)]
struct PeerTlsArgs {
    /// Certificate (PEM) presented on the peer face and on peer calls, signed by
    /// --peer-tls-ca and carrying --peer-tls-server-name as a DNS name.
    #[arg(long, env = "RINGLIMIT_PEER_TLS_CERT", requires_all = ["peer_tls_key", "peer_tls_ca"])]
    peer_tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --peer-tls-cert.
    #[arg(long, env = "RINGLIMIT_PEER_TLS_KEY", requires_all = ["peer_tls_cert", "peer_tls_ca"])]
    peer_tls_key: Option<PathBuf>,
    /// The cluster CA (PEM): peers must present a certificate it signed.
    #[arg(long, env = "RINGLIMIT_PEER_TLS_CA", requires_all = ["peer_tls_cert", "peer_tls_key"])]
    peer_tls_ca: Option<PathBuf>,
    /// The name every member's certificate carries (peers are dialled by IP address).
    #[arg(long, default_value = ringlimit::node::config::PeerTls::DEFAULT_SERVER_NAME)]
    peer_tls_server_name: String,
}

impl PeerTlsArgs {
    fn load(&self) -> anyhow::Result<Option<ringlimit::node::config::PeerTls>> {
        let (Some(cert), Some(key), Some(ca)) =
            (&self.peer_tls_cert, &self.peer_tls_key, &self.peer_tls_ca)
        else {
            return Ok(None);
        };
        ringlimit::node::config::PeerTls::from_files(cert, key, ca, &self.peer_tls_server_name)
            .map(Some)
            .map_err(anyhow::Error::msg)
    }
}

#[derive(clap::Args)]
struct DevClusterArgs {
    /// Number of nodes.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// First port: node i listens on base+4i (gRPC), base+4i+1 (ops HTTP), base+4i+2
    /// (gossip), base+4i+3 (peer service). 0: every listener on a free port.
    #[arg(long, default_value_t = 7420)]
    base_port: u16,
    /// Rule file for every node (file mode: the API is read-only).
    #[arg(long, conflicts_with = "rules_seed")]
    rules: Option<PathBuf>,
    /// Cluster mode: seed the cluster rule set with this file.
    #[arg(long)]
    rules_seed: Option<PathBuf>,
    /// Admin token file for the rules API of every node (without it, writes are refused).
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(clap::Args)]
struct ServeArgs {
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
    /// Where the cluster rule set is persisted (rules.json, written atomically); a
    /// restarted node starts from it. Without it the rules live in memory only.
    #[arg(long, env = "RINGLIMIT_DATA_DIR")]
    data_dir: Option<PathBuf>,
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
    /// Threads that run the node (the async runtime's workers; default: the cores this
    /// process may use). A sidecar given one core does best with `--threads 1`: no
    /// wake-ups and task steals between threads on a core they share (bench/RESULTS.md).
    #[arg(long, env = "RINGLIMIT_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    threads: Option<u16>,
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
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(clap::Args)]
struct CheckArgs {
    /// Node to ask (host:port or http://host:port).
    #[arg(long, default_value = DEFAULT_LISTEN)]
    addr: String,
    /// Client key (who is limited).
    #[arg(long)]
    key: String,
    /// Route, e.g. "POST /v1/charges".
    #[arg(long)]
    route: String,
    /// Units to consume (the node refuses 0 and negatives).
    #[arg(long, allow_negative_numbers = true)]
    cost: Option<i64>,
    /// Tier for rule matching.
    #[arg(long)]
    tier: Option<String>,
    /// Print one JSON object instead of a line.
    #[arg(long)]
    json: bool,
    /// Also print the HTTP headers a gateway should send.
    #[arg(long)]
    headers: bool,
    /// Another client key checked in the same request (same route, tier and cost), to
    /// try composed limits (per-customer AND per-IP); repeat for several. The request is
    /// allowed only if every descriptor is.
    #[arg(long = "descriptor")]
    descriptors: Vec<String>,
    /// Charge nothing: fetch the cluster's rules and the key's owner from the ops port
    /// (--ops-addr) and print which rule would apply, with its numbers, and who decides.
    #[arg(long)]
    dry_run: bool,
    /// The ops HTTP address --dry-run asks.
    #[arg(long, default_value = DEFAULT_HTTP_LISTEN)]
    ops_addr: String,
}

#[derive(Subcommand)]
enum RulesCommand {
    /// Validate a rule file; prints every problem, naming rule and field.
    Check {
        /// The file.
        file: PathBuf,
    },
    /// Print a cluster's rules (TOML, or JSON with --json) with their version.
    Get {
        /// A node's ops HTTP address.
        #[arg(long, default_value = DEFAULT_HTTP_LISTEN)]
        addr: String,
        /// Print the JSON form.
        #[arg(long)]
        json: bool,
    },
    /// Replace a cluster's rules with a file (TOML, or JSON if it ends in .json).
    Put {
        /// The rule file (TOML, or JSON by its `.json` name): the whole document.
        #[arg(required_unless_present = "envoy")]
        file: Option<PathBuf>,
        /// envoyproxy/ratelimit YAML (a file, or a directory of `*.yaml` / `*.yml`, one
        /// domain each) for the `[envoy]` section: alone, it replaces only that section;
        /// with FILE, it replaces FILE's.
        #[arg(long)]
        envoy: Option<PathBuf>,
        /// The section's default algorithm (of a `rate_limit` without `algorithm`);
        /// default fixed_window.
        #[arg(long, value_parser = parse_algorithm, requires = "envoy")]
        envoy_algorithm: Option<ringlimit::algorithms::AlgorithmKind>,
        /// Let FILE (without an `[envoy]` section) remove the cluster's Envoy domains;
        /// without this flag such a put is refused and nothing is sent.
        #[arg(long, conflicts_with = "envoy", requires = "file")]
        drop_envoy: bool,
        /// A node's ops HTTP address.
        #[arg(long, default_value = DEFAULT_HTTP_LISTEN)]
        addr: String,
        /// The admin token file.
        #[arg(long, env = "RINGLIMIT_ADMIN_TOKEN_FILE")]
        admin_token_file: Option<PathBuf>,
        /// Only if the cluster's version is still this one (412 otherwise).
        #[arg(long)]
        if_match: Option<u64>,
    },
    /// Compare a file with a cluster's rules, rule by rule; exits 1 when they differ.
    Diff {
        /// The file.
        file: PathBuf,
        /// A node's ops HTTP address.
        #[arg(long, default_value = DEFAULT_HTTP_LISTEN)]
        addr: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve(*args),
        Command::Check(args) => runtime().and_then(|rt| rt.block_on(check(args))),
        Command::Rules {
            command: RulesCommand::Check { file },
        } => rules_check(&file),
        Command::Rules {
            command: RulesCommand::Get { addr, json },
        } => runtime().and_then(|rt| rt.block_on(cli::rules_get(&addr, json))),
        Command::Rules {
            command:
                RulesCommand::Put {
                    file,
                    envoy,
                    envoy_algorithm,
                    drop_envoy,
                    addr,
                    admin_token_file,
                    if_match,
                },
        } => runtime().and_then(|rt| {
            rt.block_on(cli::rules_put(
                file.as_deref(),
                envoy.as_deref().map(|p| (p, envoy_algorithm)),
                drop_envoy,
                &addr,
                admin_token_file.as_deref(),
                if_match,
            ))
        }),
        Command::Rules {
            command: RulesCommand::Diff { file, addr },
        } => runtime().and_then(|rt| rt.block_on(cli::rules_diff(&file, &addr))),
        Command::Owner { key, addr } => {
            runtime().and_then(|rt| rt.block_on(cli::owner(&key, &addr)))
        }
        Command::Cluster {
            command:
                ClusterCommand::Status {
                    addr,
                    json,
                    cluster_secret_file,
                    tls,
                },
        } => runtime()
            .and_then(|rt| rt.block_on(cluster_status(addr, json, cluster_secret_file, tls))),
        Command::DevCluster(args) => dev_cluster(args),
        Command::Bench(args) => runtime()
            .and_then(|rt| rt.block_on(bench::run(args)))
            .map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(2)
        }
    }
}

fn parse_algorithm(text: &str) -> Result<ringlimit::algorithms::AlgorithmKind, String> {
    ringlimit::algorithms::AlgorithmKind::parse(text).ok_or_else(|| {
        format!("{text:?} is not an algorithm (token_bucket, leaky_bucket, fixed_window, sliding_window_log, sliding_window_counter)")
    })
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    runtime_with(None)
}

/// The async runtime, with `threads` workers (default: tokio's, the usable cores).
fn runtime_with(threads: Option<usize>) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = threads {
        builder.worker_threads(threads);
    }
    builder
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    init_logging(args.log_format);
    // The flag (or RINGLIMIT_HTTP_LISTEN), else the old variable, else the default.
    let http_listen = match args.http_listen {
        Some(addr) => addr,
        None => match std::env::var("RINGLIMIT_METRICS_LISTEN") {
            Ok(text) => text
                .parse()
                .with_context(|| format!("RINGLIMIT_METRICS_LISTEN={text:?} is not an address"))?,
            Err(_) => DEFAULT_HTTP_LISTEN
                .parse()
                .expect("a valid default address"),
        },
    };
    let mut config = NodeConfig {
        listen: args.listen,
        http_listen: (!args.no_http).then_some(http_listen),
        rules_path: args.rules,
        envoy_path: args.envoy_config,
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
    config.shards.max_state_bytes = args.max_state_bytes;
    config.advertise = args.advertise;
    config.gossip_listen = args.gossip_listen;
    config.gossip_advertise = args.gossip_advertise;
    config.peer_listen = args.peer_listen;
    config.peer_advertise = args.peer_advertise;
    config.seeds = args.seeds;
    config.cluster_id = args.cluster_id;
    config.forward.timeout = std::time::Duration::from_millis(args.forward_timeout_ms);
    config.forward.flush_delay = std::time::Duration::from_micros(args.forward_flush_us);
    config.forward.max_batch = args.forward_max_batch;
    config.forward.max_in_flight = args.forward_max_in_flight;
    config.forward.stream = !args.forward_unary;
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
    runtime_with(args.threads.map(usize::from))?.block_on(async move {
        let shutdown = CancellationToken::new();
        let signal = shutdown.clone();
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!("shutdown signal received");
            signal.cancel();
        });
        ringlimit::node::run(config, shutdown, |node| {
            // One machine-readable line on stdout: scripts and tests that start nodes
            // on port 0 learn the bound addresses from it.
            println!(
                "ringlimit ready node_id={} generation={} grpc={} gossip={} metrics={} peer={} http={}",
                node.decider.node_id,
                node.decider.generation,
                node.grpc_addr,
                node.gossip_addr,
                node.http_addr.map_or("-".to_string(), |a| a.to_string()),
                node.peer_addr,
                node.http_addr.map_or("-".to_string(), |a| a.to_string()),
            );
        })
        .await
    })?;
    Ok(ExitCode::SUCCESS)
}

/// `ringlimit dev-cluster`: N `ringlimit serve` processes on loopback, so each node has
/// its own metrics registry, logs (every line says `node{id=…}`) and failure domain, as in
/// production. Ctrl-C (or SIGTERM) makes every node leave gracefully.
fn dev_cluster(args: DevClusterArgs) -> anyhow::Result<ExitCode> {
    init_logging(args.log_format);
    anyhow::ensure!((1..=20).contains(&args.nodes), "--nodes must be 1..=20");
    // One key for the nodes of this cluster, written where `cluster status` can read it
    // (mode 0600) and known to nothing else.
    let secret = ringlimit::keyring::generate_secret();
    let secret_path = std::env::temp_dir().join(format!(
        "ringlimit-dev-cluster-{}.secret",
        std::process::id()
    ));
    write_private(&secret_path, &secret)?;
    // Removed however dev-cluster ends (a node that fails to start included).
    let _secret_file = RemoveOnDrop(secret_path.clone());
    let exe = std::env::current_exe().context("finding this binary")?;
    let log_format = match args.log_format {
        LogFormat::Text => "text",
        LogFormat::Json => "json",
    };
    let mut nodes = DevNodes(Vec::new());
    let mut seed: Option<String> = None;
    // The first node's gRPC and peer addresses, for the hints printed below.
    let mut first: Option<(String, String)> = None;
    for i in 0..args.nodes {
        let port = |offset: usize| -> anyhow::Result<String> {
            if args.base_port == 0 {
                // Every listener on a free port (scripts and tests read the table).
                return Ok("127.0.0.1:0".to_string());
            }
            let port = usize::from(args.base_port) + 4 * i + offset;
            let port = u16::try_from(port).context("--base-port too high")?;
            Ok(SocketAddr::from(([127, 0, 0, 1], port)).to_string())
        };
        let id = format!("node-{}", i + 1);
        let mut command = std::process::Command::new(&exe);
        command
            .args(["serve", "--node-id", &id])
            .args(["--listen", &port(0)?, "--http-listen", &port(1)?])
            .args(["--gossip-listen", &port(2)?, "--peer-listen", &port(3)?])
            .args(["--log-format", log_format])
            .arg("--cluster-secret-file")
            .arg(&secret_path)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit());
        if let Some(rules) = &args.rules {
            command.arg("--rules").arg(rules);
        }
        if let Some(seed_file) = &args.rules_seed {
            command.arg("--rules-seed").arg(seed_file);
        }
        if let Some(token) = &args.admin_token_file {
            command.arg("--admin-token-file").arg(token);
        }
        if let Some(seed) = &seed {
            command.args(["--seed", seed]);
        }
        let mut child = command.spawn().with_context(|| format!("starting {id}"))?;
        let stdout = child.stdout.take().context("node stdout")?;
        nodes.0.push(child);
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
        let ready = lines
            .next()
            .with_context(|| format!("{id} exited before it was ready (its log is above)"))??;
        // serve prints nothing else on stdout; drain it anyway so a node never blocks.
        std::thread::spawn(move || lines.for_each(drop));
        let field = |name: &str| -> anyhow::Result<String> {
            ready
                .split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{name}=")))
                .map(str::to_string)
                .with_context(|| format!("no {name}= in the ready line {ready:?}"))
        };
        seed.get_or_insert(field("gossip")?);
        if first.is_none() {
            first = Some((field("grpc")?, field("peer")?));
        }
        println!(
            "{id}  grpc={}  ops=http://{}/  gossip={}  peer={}  pid={}",
            field("grpc")?,
            field("http")?,
            field("gossip")?,
            field("peer")?,
            nodes.0.last().map_or(0, std::process::Child::id),
        );
    }
    let (grpc, peer) = first.unwrap_or_default();
    println!(
        "{} nodes running. Try: ringlimit check --addr {grpc} --key cust_42 --route \"GET /v1/users\"   (Ctrl-C stops them)",
        args.nodes,
    );
    println!(
        "cluster key: {}   (ringlimit cluster status --addr {peer} --cluster-secret-file {})",
        secret_path.display(),
        secret_path.display()
    );
    runtime()?.block_on(wait_for_signal());
    println!("stopping: each node leaves gracefully");
    nodes.leave();
    Ok(ExitCode::SUCCESS)
}

/// A file removed when this goes out of scope.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The node processes of `dev-cluster`; killed if dev-cluster fails before they leave.
struct DevNodes(Vec<std::process::Child>);

impl DevNodes {
    /// SIGTERM every node (a graceful leave; a Ctrl-C in the terminal already reached
    /// them too), then wait up to 15 s for each before killing it.
    fn leave(&mut self) {
        for child in self.0.iter().rev() {
            // No libc call (unsafe is forbidden): the kill(1) tool sends the signal.
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
        }
        for mut child in self.0.drain(..).rev() {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
            while matches!(child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            if matches!(child.try_wait(), Ok(None)) {
                eprintln!("node pid {} did not leave within 15 s: killed", child.id());
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

impl Drop for DevNodes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Write `text` to a new file only its owner can read.
fn write_private(path: &std::path::Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    writeln!(file, "{text}")?;
    Ok(())
}

async fn cluster_status(
    addr: String,
    json: bool,
    secret: Option<PathBuf>,
    tls: PeerTlsArgs,
) -> anyhow::Result<ExitCode> {
    let tls = tls.load()?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let addr = if addr.contains("://") {
        addr
    } else {
        format!("{scheme}://{addr}")
    };
    let keyring = secret
        .as_deref()
        .map(ringlimit::keyring::Keyring::from_file)
        .transpose()?;
    let mut endpoint = tonic::transport::Endpoint::from_shared(addr.clone())?;
    if let Some(tls) = &tls {
        endpoint = endpoint.tls_config(ringlimit::node::grpc::client_tls(tls))?;
    }
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
    let mut client = ringlimit::proto::peer::peer_client::PeerClient::new(
        ringlimit::cluster::forward::Signed::new(channel, keyring, "ringlimit-cli".into()),
    );
    let status = client
        .status(ringlimit::proto::peer::StatusRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("{}: {}", addr, s.message()))?
        .into_inner();
    if json {
        let members: Vec<_> = status
            .members
            .iter()
            .map(|m| {
                serde_json::json!({
                    "node_id": m.node_id, "generation": m.generation.to_string(), "grpc_addr": m.grpc_addr,
                    "peer_addr": m.peer_addr, "gossip_addr": m.gossip_addr, "leaving": m.leaving, "ring_share": m.ring_share,
                    "rules": m.rules, "rules_drift": m.rules_drift,
                    "envoy_config": m.envoy, "envoy_drift": m.envoy_drift,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "node_id": status.node_id, "generation": status.generation.to_string(),
                "ring_digest": format!("{:016x}", status.ring_digest), "keys": status.keys,
                "rules": status.rules,
                "rules_drift": status.members.iter().any(|m| m.rules_drift),
                "envoy_config": status.envoy,
                "envoy_drift": status.members.iter().any(|m| m.envoy_drift),
                "members": members,
            })
        );
    } else {
        println!(
            "asked {} ({}@{}): ring digest {:016x}, {} keys held, rules {}, envoy {}",
            addr,
            status.node_id,
            status.generation,
            status.ring_digest,
            status.keys,
            status.rules,
            if status.envoy.is_empty() {
                "-"
            } else {
                &status.envoy
            }
        );
        println!(
            "{:<20} {:>20} {:<22} {:<22} {:<22} {:>7} {:<30} {:<25} {:<5} state",
            "node", "generation", "grpc", "peer", "gossip", "share", "rules", "envoy", "drift"
        );
        for m in &status.members {
            println!(
                "{:<20} {:>20} {:<22} {:<22} {:<22} {:>6.1}% {:<30} {:<25} {:<5} {}",
                m.node_id,
                m.generation,
                m.grpc_addr,
                m.peer_addr,
                m.gossip_addr,
                m.ring_share * 100.0,
                if m.rules.is_empty() { "-" } else { &m.rules },
                if m.envoy.is_empty() { "?" } else { &m.envoy },
                if m.rules_drift || m.envoy_drift {
                    "DRIFT"
                } else {
                    "-"
                },
                if m.leaving { "leaving" } else { "live" }
            );
        }
        type Member = ringlimit::proto::peer::MemberStatus;
        let drifting = |drifts: fn(&Member) -> bool| -> Vec<&str> {
            status
                .members
                .iter()
                .filter(|m| drifts(m))
                .map(|m| m.node_id.as_str())
                .collect()
        };
        let summaries = [
            (drifting(|m| m.rules_drift), "rules drift: {nodes} {verb} different rules than {me} (different --rules files, or file and cluster sources mixed)"),
            (drifting(|m| m.envoy_drift), "envoy config drift: {nodes} {verb} different Envoy domains than {me} (different --envoy-config files or --envoy-algorithm, or --envoy-config on some nodes only)"),
        ];
        for (nodes, line) in summaries {
            if !nodes.is_empty() {
                let verb = if nodes.len() == 1 {
                    "enforces"
                } else {
                    "enforce"
                };
                println!(
                    "{}",
                    line.replace("{nodes}", &nodes.join(", "))
                        .replace("{verb}", verb)
                        .replace("{me}", &status.node_id)
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Logs go to stderr: stdout carries only the machine-readable ready line (serve)
    // and command output, so scripts can read it.
    // No ANSI colour codes unless stderr is a terminal: a log file or a collector
    // (journald, docker logs) should get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn check(args: CheckArgs) -> anyhow::Result<ExitCode> {
    if args.dry_run {
        let keys: Vec<&str> = std::iter::once(args.key.as_str())
            .chain(args.descriptors.iter().map(String::as_str))
            .collect();
        return cli::dry_run(&args.ops_addr, &keys, &args.route, args.tier.as_deref()).await;
    }
    let addr = if args.addr.contains("://") {
        args.addr.clone()
    } else {
        format!("http://{}", args.addr)
    };
    let mut client = RateLimiterClient::connect(addr.clone())
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
    let request = CheckRequest {
        key: args.key,
        route: args.route,
        cost: args.cost,
        tier: args.tier,
        descriptors: args
            .descriptors
            .iter()
            .map(|key| ringlimit::proto::Descriptor {
                key: key.clone(),
                ..Default::default()
            })
            .collect(),
    };
    let answer = match client.check(request).await {
        Ok(answer) => answer.into_inner(),
        Err(status) => {
            eprintln!("refused ({:?}): {}", status.code(), status.message());
            return Ok(ExitCode::from(2));
        }
    };
    let now_ms = ringlimit::clock::Clock::now_ms(&ringlimit::clock::SystemClock);
    let code = if answer.allowed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&answer_json(&answer, now_ms, args.headers))?
        );
    } else {
        println!("{}", answer_line(&answer));
        if args.headers {
            for (name, value) in
                ringlimit::client::headers(&quota(&answer), answer.window_ms, now_ms)
            {
                println!("  {name}: {value}");
            }
        }
    }
    Ok(code)
}

/// The numbers of a wire answer that the 429 contract is rendered from.
fn quota(a: &CheckResponse) -> ringlimit::client::Quota {
    ringlimit::client::Quota {
        allowed: a.allowed,
        limit: a.limit,
        remaining: a.remaining,
        retry_after_ms: a.retry_after_ms,
        reset_at_ms: u64::try_from(a.reset_at).unwrap_or(0),
    }
}

fn answer_line(a: &CheckResponse) -> String {
    let decider = a
        .decider
        .as_ref()
        .map(|d| format!("{}@{}", d.node_id, d.generation))
        .unwrap_or_default();
    let verdict = if a.allowed { "allowed" } else { "denied " };
    let mut line = format!(
        "{verdict} limit={} remaining={} retry_after_ms={} reset_at={} rule={} decider={decider} seq={}",
        a.limit, a.remaining, a.retry_after_ms, a.reset_at, a.rule, a.sequence
    );
    if !a.allowed {
        line.push_str(&format!(
            " (Retry-After: {} s)",
            ringlimit::client::ceil_secs(a.retry_after_ms)
        ));
    }
    if a.delay_ms > 0 {
        line.push_str(&format!(" delay_ms={}", a.delay_ms));
    }
    line
}

fn answer_json(a: &CheckResponse, now_ms: u64, with_headers: bool) -> serde_json::Value {
    let descriptors: Vec<_> = a
        .descriptors
        .iter()
        .map(|d| {
            serde_json::json!({
                "key": d.key, "route": d.route, "allowed": d.allowed, "limit": d.limit,
                "remaining": d.remaining, "retry_after_ms": d.retry_after_ms,
                "reset_at": d.reset_at, "rule": d.rule, "algorithm": d.algorithm,
                "window_id": d.window_id.map(|w| w.to_string()), "sequence": d.sequence.to_string(), "refunded": d.refunded,
                "delay_ms": d.delay_ms,
            })
        })
        .collect();
    let mut value = serde_json::json!({
        "allowed": a.allowed,
        "limit": a.limit,
        "remaining": a.remaining,
        "retry_after_ms": a.retry_after_ms,
        "retry_after_s": ringlimit::client::ceil_secs(a.retry_after_ms),
        "reset_at": a.reset_at,
        "rule": a.rule,
        // 64-bit ids as strings: jq and JavaScript read JSON numbers as doubles, which
        // lose precision above 2^53 (a generation is ~1.8e18).
        "decider": a.decider.as_ref().map(|d| serde_json::json!({"node_id": d.node_id, "generation": d.generation.to_string()})),
        "window_id": a.window_id.map(|w| w.to_string()),
        "sequence": a.sequence.to_string(),
        "degraded": a.degraded,
        "delay_ms": a.delay_ms,
        "descriptors": descriptors,
    });
    if with_headers {
        let headers: serde_json::Map<_, _> =
            ringlimit::client::headers(&quota(a), a.window_ms, now_ms)
                .into_iter()
                .map(|(k, v)| (k.to_string(), serde_json::Value::String(v)))
                .collect();
        value["headers"] = serde_json::Value::Object(headers);
    }
    value
}

fn rules_check(file: &std::path::Path) -> anyhow::Result<ExitCode> {
    match RuleSet::load(file) {
        Ok(rules) => {
            match rules.envoy().domains().count() {
                0 => println!("{}: ok, {} rules", file.display(), rules.len()),
                domains => println!(
                    "{}: ok, {} rules, {domains} envoy domains",
                    file.display(),
                    rules.len()
                ),
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(error) => {
            eprintln!("{}: invalid\n{error}", file.display());
            Ok(ExitCode::from(1))
        }
    }
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
