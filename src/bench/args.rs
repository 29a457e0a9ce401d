//! What `ringlimit bench` is asked to measure: its flags and the combinations it refuses.

/// How keys are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Distribution {
    /// Every key equally likely.
    Uniform,
    /// Zipf with exponent `--zipf-s`: a few hot keys, a long tail.
    Zipf,
}

/// Which gRPC client the load generator uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ClientKind {
    /// A minimal unary client on `h2`, one task per connection (see `bench::lean`).
    Lean,
    /// tonic's generated client over a `Channel` (a tower Buffer task per connection).
    Tonic,
    /// The `ringlimit-client` crate's ring-aware client: each check goes straight to its
    /// key's owner (0 hops). One client shared by every caller, as a gateway process
    /// holds one (`--coalesce`: with its `CheckBatch` coalescing). Each round also
    /// runs today's random-entry load (the lean client, one connection per caller to
    /// a random node) first, so the two figures come from one run.
    RingAware,
}

/// Which node a lean caller sends its checks to, on two or more nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Entry {
    /// Caller i to node i mod n with any key: about (n-1)/n of checks are forwarded.
    Random,
    /// Caller i to node i mod n with only the keys that node owns: none forwarded.
    Owner,
    /// Caller i to node i mod n with only the keys that node does not own: every
    /// check is forwarded once (the entry's and the owner's CPU are both counted).
    NonOwner,
    /// Each round runs `owner`, then `non-owner`: the forwarded check's server CPU
    /// against the local one's, in one run (issue 25's "forwarded ÷ local").
    Both,
}

/// Which API the load is sent through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Protocol {
    /// `ringlimit.v1.RateLimiter/Check` (or `CheckBatch`).
    Ringlimit,
    /// Envoy's `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`, one
    /// descriptor `(--descriptor-key, <key>)` in `--domain`: any RLS server will do.
    EnvoyRls,
    /// Both against the same nodes, alternating rounds, with the ratio of server CPU per
    /// check (local nodes only).
    Both,
    /// Gubernator's `pb.gubernator.V1/GetRateLimits`, one `RateLimitReq` (name `bench`,
    /// the client key as `unique_key`, `--limit` per 60 s, token bucket) per call: any
    /// Gubernator server will do.
    Gubernator,
    /// Envoy RLS, Gubernator and the native `Check` against the same nodes, alternating
    /// rounds, with each front end's ratio to the native path.
    All,
    /// tonic's own `grpc.health.v1.Health/Check` and the native `Check`, alternating on
    /// the same nodes: the floor any unary gRPC call pays on this server, beside what a
    /// check pays (with `--compare-redis`, Redis too).
    Health,
    /// The true floor (issue 25): a bare tonic server's health check (the same tonic,
    /// hyper and runtime settings, only health, no layers), the same server with each
    /// of the node's layers, and one local node's health check, native `Check` and
    /// Envoy RLS, alternating rounds, with their ratios to the bare server (and the
    /// same by h2load when it is installed).
    Floor,
}

impl Protocol {
    /// Whether rounds go through Envoy RLS.
    pub fn envoy(self) -> bool {
        matches!(self, Protocol::EnvoyRls | Protocol::Both | Protocol::All)
    }

    /// Whether rounds go through Gubernator V1.
    pub fn gubernator(self) -> bool {
        matches!(self, Protocol::Gubernator | Protocol::All)
    }

    /// Whether rounds go through the native `Check`.
    pub fn native(self) -> bool {
        matches!(
            self,
            Protocol::Ringlimit | Protocol::Both | Protocol::All | Protocol::Health
        )
    }
}

/// `ringlimit bench` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Target node(s) (host:port). None: start --nodes local node processes.
    #[arg(long = "addr")]
    pub targets: Vec<String>,
    /// Local nodes to start when no --addr is given (3 = a local cluster; checks go to
    /// random nodes, so about 2/3 are forwarded).
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// Start the nodes without a cluster key (`--insecure-cluster`): to measure what
    /// authenticating peer calls and gossip costs against the default.
    #[arg(long)]
    pub insecure_cluster: bool,
    /// One more flag for every node the benchmark starts (repeat it; a value with its
    /// flag as `--node-arg=--forward-unary`), to compare node settings in one run.
    #[arg(long = "node-arg", allow_hyphen_values = true)]
    pub node_args: Vec<String>,
    /// Concurrent callers.
    #[arg(long, default_value_t = 50)]
    pub concurrency: usize,
    /// Measured seconds per run.
    #[arg(long, default_value_t = 10)]
    pub duration: u64,
    /// Unmeasured seconds before each run.
    #[arg(long, default_value_t = 2)]
    pub warmup: u64,
    /// Distinct client keys.
    #[arg(long, default_value_t = 10_000)]
    pub keys: usize,
    /// Key distribution.
    #[arg(long, value_enum, default_value_t = Distribution::Uniform)]
    pub distribution: Distribution,
    /// Zipf exponent.
    #[arg(long, default_value_t = 1.0)]
    pub zipf_s: f64,
    /// Cost per check.
    #[arg(long, default_value_t = 1)]
    pub cost: i64,
    /// Checks per call: 1 = unary Check; N = CheckBatch of N (Redis: pipelined N deep).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Limit per 60 s of the benchmark rule (sliding window counter, both systems).
    #[arg(long, default_value_t = 1_000_000)]
    pub limit: u64,
    /// Also run the same load against Redis + the reference Lua script, alternating.
    #[arg(long)]
    pub compare_redis: bool,
    /// Alternating rounds (ringlimit, redis, ringlimit, redis, ...).
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Seed of the key sequence.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Open loop: calls per second in total, spread evenly over the callers (0: closed
    /// loop, each caller calls again as soon as answered). A call that cannot start on
    /// time because the caller's previous call was slow is timed from when it should
    /// have started, so queueing shows in the latency (no coordinated omission).
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// Instead of load: bytes per key at --keys keys for --algorithm (RSS delta), and
    /// Redis used_memory per client with --compare-redis.
    #[arg(long)]
    pub memory: bool,
    /// gRPC client of the load generator. Either way one HTTP/2 connection per
    /// concurrent caller with one call in flight, as the Redis side has one connection
    /// per caller; `lean` costs the shared CPU less than `tonic`.
    #[arg(long, value_enum, default_value_t = ClientKind::Lean)]
    pub client: ClientKind,
    /// With `--client ring-aware`: coalesce concurrent checks per node into
    /// `CheckBatch` calls (the crate's default `Coalesce`).
    #[arg(long)]
    pub coalesce: bool,
    /// With `--coalesce`: most `CheckBatch` calls out to one node at a time (0: the
    /// crate's default), to measure what the setting costs and saves.
    #[arg(long, default_value_t = 0)]
    pub coalesce_in_flight: usize,
    /// On 2 or more nodes: send each check to its key's owner, to a node that does not
    /// own it, or both in alternating runs (keys are placed with the ring the nodes
    /// publish; uniform keys, the lean client).
    #[arg(long, value_enum, default_value_t = Entry::Random)]
    pub entry: Entry,
    /// Algorithm for --memory.
    #[arg(long, default_value = "sliding_window_counter")]
    pub algorithm: String,
    /// API the load goes through. Local nodes get the same limit both ways (an Envoy
    /// config whose one descriptor has the benchmark rule's algorithm and numbers).
    #[arg(long, value_enum, default_value_t = Protocol::Ringlimit)]
    pub protocol: Protocol,
    /// RLS domain of `--protocol envoy-rls`.
    #[arg(long, default_value = "bench")]
    pub domain: String,
    /// RLS descriptor key of `--protocol envoy-rls` (the value is the client key).
    #[arg(long, default_value = "client_id")]
    pub descriptor_key: String,
    /// Owner kill: `kill -9` the last local node this many seconds into the first
    /// measured run. The load goes to the other nodes only (as a gateway's would), so
    /// what is measured is the answer for keys the dead node owned: fail-open until the
    /// ring drops it. Later rounds run on the survivors.
    #[arg(long)]
    pub kill_node_after: Option<u64>,
}

impl BenchArgs {
    /// Refuses flag combinations the bench cannot run, before anything starts.
    pub fn validate(&self) -> anyhow::Result<()> {
        let args = self;
        anyhow::ensure!(args.concurrency >= 1, "--concurrency must be at least 1");
        anyhow::ensure!(
            args.rate.is_finite() && args.rate >= 0.0,
            "--rate must be a non-negative number of calls per second (got {})",
            args.rate
        );
        anyhow::ensure!((1..=1000).contains(&args.batch), "--batch must be 1..=1000");
        anyhow::ensure!(args.keys >= 1, "--keys must be at least 1");
        anyhow::ensure!(
            args.protocol == Protocol::Ringlimit
                || (args.batch == 1 && args.client == ClientKind::Lean),
            "--protocol envoy-rls / gubernator / both / all: one descriptor per call (--batch 1) over the lean client"
        );
        anyhow::ensure!(
            args.client != ClientKind::RingAware
                || (args.protocol == Protocol::Ringlimit && args.batch == 1),
            "--client ring-aware sends one check per call (--batch 1) through ringlimit.v1"
        );
        anyhow::ensure!(
            !args.coalesce || args.client == ClientKind::RingAware,
            "--coalesce is an option of --client ring-aware"
        );
        anyhow::ensure!(
            args.coalesce_in_flight == 0 || args.coalesce,
            "--coalesce-in-flight is an option of --coalesce"
        );
        anyhow::ensure!(
            args.entry == Entry::Random
                || (args.client == ClientKind::Lean
                    && args.protocol == Protocol::Ringlimit
                    && args.distribution == Distribution::Uniform
                    && !args.compare_redis
                    && args.kill_node_after.is_none()
                    && (args.nodes >= 2 || args.targets.len() >= 2)),
            "--entry owner / non-owner / both: 2 or more nodes, the native Check over the lean client, uniform keys, no --compare-redis or --kill-node-after"
        );
        anyhow::ensure!(
            !args.compare_redis || matches!(args.protocol, Protocol::Ringlimit | Protocol::Health),
            "--compare-redis compares the native path; use --protocol ringlimit (or health)"
        );
        anyhow::ensure!(
            args.protocol != Protocol::Floor
                || (args.targets.is_empty() && args.nodes == 1 && args.kill_node_after.is_none()),
            "--protocol floor starts its own node and floor servers: one local node (no --addr, --nodes 1)"
        );
        Ok(())
    }
}
