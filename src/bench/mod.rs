//! `ringlimit bench`: a gRPC load generator, and the same load against the reference
//! design (Redis + the design reference's Lua script) on the same machine.
//!
//! Tooling, not product: part of the binary, not the library, it reaches a node only
//! over the wire (and, in its tests, starts one through the library's public API), and
//! it may use `anyhow`. Latency is measured per call (a unary
//! check, or one `CheckBatch` / one pipelined round of EVALSHA) into an HDR histogram
//! in microseconds; throughput counts checks, not calls.

mod lean;
mod redis;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use hdrhistogram::Histogram;

use ringlimit::proto::envoy::extensions::common::ratelimit::v3::{
    rate_limit_descriptor::Entry, RateLimitDescriptor,
};
use ringlimit::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use ringlimit::proto::gubernator::{
    GetRateLimitsReq, GetRateLimitsResp, RateLimitReq, Status as GubernatorStatus,
};
use ringlimit::proto::peer::peer_client::PeerClient;
use ringlimit::proto::peer::StatusRequest;
use ringlimit::proto::rate_limiter_client::RateLimiterClient;
use ringlimit::proto::{CheckBatchRequest, CheckBatchResponse, CheckRequest, CheckResponse};

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
}

impl Protocol {
    fn envoy(self) -> bool {
        matches!(self, Protocol::EnvoyRls | Protocol::Both | Protocol::All)
    }

    fn gubernator(self) -> bool {
        matches!(self, Protocol::Gubernator | Protocol::All)
    }

    fn native(self) -> bool {
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

/// The outcome of one measured run.
pub struct RunResult {
    /// "ringlimit" or "redis".
    pub system: &'static str,
    /// Checks decided.
    pub checks: u64,
    /// Allowed checks.
    pub allowed: u64,
    /// Failed calls.
    pub errors: u64,
    /// Measured time.
    pub elapsed: Duration,
    /// Per-call latency, µs.
    pub latency: Histogram<u64>,
    /// CPU seconds (user + system) the local node processes spent in the measured time.
    pub server_cpu_s: Option<f64>,
}

impl RunResult {
    /// Checks per second.
    pub fn rate(&self) -> f64 {
        self.checks as f64 / self.elapsed.as_secs_f64()
    }

    /// Latency quantile in ms.
    pub fn ms(&self, q: f64) -> f64 {
        self.latency.value_at_quantile(q) as f64 / 1000.0
    }

    /// Server CPU per check, µs (local nodes only).
    pub fn cpu_us_per_check(&self) -> Option<f64> {
        self.server_cpu_s
            .filter(|_| self.checks > 0)
            .map(|s| s * 1e6 / self.checks as f64)
    }

    fn print(&self) {
        if let Some(us) = self.cpu_us_per_check() {
            println!("{:<10} server CPU {us:.1} µs/check", self.system);
        }
        println!(
            "{:<10} checks/s {:>10.0}  p50 {:>7.3} ms  p90 {:>7.3} ms  p99 {:>7.3} ms  p99.9 {:>7.3} ms  allowed {:>9}  denied {:>9}  errors {}",
            self.system,
            self.rate(),
            self.ms(0.50),
            self.ms(0.90),
            self.ms(0.99),
            self.ms(0.999),
            self.allowed,
            self.checks - self.allowed,
            self.errors
        );
    }
}

/// Run `ringlimit bench`.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
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
        !args.compare_redis || matches!(args.protocol, Protocol::Ringlimit | Protocol::Health),
        "--compare-redis compares the native path; use --protocol ringlimit (or health)"
    );
    if args.memory {
        return memory(&args).await;
    }
    let rules_dir = tempfile_dir()?;
    let (mut nodes, targets) = if args.targets.is_empty() {
        let insecure: &[&str] = if args.insecure_cluster {
            &["--insecure-cluster"]
        } else {
            &[]
        };
        // The same limit through Envoy RLS: one descriptor per client key.
        let envoy = rules_dir.join("envoy.yaml");
        std::fs::write(
            &envoy,
            format!(
                "domain: {}\ndescriptors:\n  - key: {}\n    rate_limit: {{unit: minute, requests_per_unit: {}, algorithm: sliding_window_counter}}\n",
                args.domain, args.descriptor_key, args.limit
            ),
        )?;
        let envoy = envoy.to_string_lossy().into_owned();
        let mut extra: Vec<&str> = insecure.to_vec();
        extra.extend(["--envoy-config", envoy.as_str()]);
        if args.protocol.gubernator() {
            extra.push("--gubernator");
        }
        extra.extend(args.node_args.iter().map(String::as_str));
        let nodes = start_nodes(
            args.nodes,
            &rules_dir,
            &rule_toml("sliding_window_counter", args.limit),
            &extra,
        )?;
        let mut targets: Vec<String> = nodes.iter().map(|n| n.grpc.clone()).collect();
        if args.kill_node_after.is_some() {
            anyhow::ensure!(
                nodes.len() >= 2,
                "--kill-node-after needs --nodes 2 or more"
            );
            targets.pop();
        }
        (nodes, targets)
    } else {
        (Vec::new(), args.targets.clone())
    };
    let redis = if args.compare_redis {
        let server = redis::start().await?;
        let sha = redis::load_script(&server.addr).await?;
        Some((server, sha))
    } else {
        None
    };
    println!(
        "bench: concurrency {}{} batch {} keys {} ({:?}) cost {} duration {} s, targets {:?}{}",
        args.concurrency,
        if args.rate > 0.0 {
            format!(" rate {} calls/s (open loop)", args.rate)
        } else {
            String::new()
        },
        args.batch,
        args.keys,
        args.distribution,
        args.cost,
        args.duration,
        targets,
        if redis.is_some() {
            format!(", vs {}", redis::version())
        } else {
            String::new()
        }
    );
    let keys = Keys::new(&args);
    let mut pids: Vec<u32> = nodes.iter().map(|n| n.child.id()).collect();
    if nodes.is_empty() {
        // Servers at --addr: their CPU is measured when they listen on this machine.
        pids = targets
            .iter()
            .filter_map(|t| t.rsplit_once(':')?.1.parse::<u16>().ok())
            .filter_map(pid_listening_on)
            .collect();
        if pids.len() != targets.len() {
            println!(
                "bench: server CPU per check not measured: {} of {} targets' processes found on this machine",
                pids.len(),
                targets.len()
            );
            pids.clear();
        }
    }
    let mut kill = match args.kill_node_after {
        Some(after) => {
            anyhow::ensure!(
                !nodes.is_empty(),
                "--kill-node-after needs local nodes (no --addr)"
            );
            let victim = pids.pop().expect("at least two nodes");
            Some((victim, Duration::from_secs(after)))
        }
        None => None,
    };
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    let mut envoy = Vec::new();
    let mut gubernator = Vec::new();
    let mut health = Vec::new();
    let mut aware = Vec::new();
    // The random-entry baseline of a ring-aware run: today's lean client.
    let random_entry = BenchArgs {
        client: ClientKind::Lean,
        ..args.clone()
    };
    for round in 0..args.rounds.max(1) {
        if args.client == ClientKind::RingAware {
            println!(
                "round {}: random entry (lean client, random node)",
                round + 1
            );
            let result = drive(
                &random_entry,
                &keys,
                Target::Ringlimit(&targets),
                &pids,
                kill.take(),
            )
            .await?;
            result.print();
            ours.push(result);
            println!(
                "round {}: ring-aware (ringlimit-client{})",
                round + 1,
                if args.coalesce { ", coalescing" } else { "" }
            );
            let result = drive(&args, &keys, Target::RingAware(&targets), &pids, None).await?;
            result.print();
            aware.push(result);
            continue;
        }
        if args.protocol.envoy() {
            println!("round {}: ringlimit via envoy-rls", round + 1);
            let result = drive(&args, &keys, Target::Envoy(&targets), &pids, kill.take()).await?;
            result.print();
            envoy.push(result);
        }
        if args.protocol.gubernator() {
            println!("round {}: ringlimit via gubernator", round + 1);
            let result = drive(
                &args,
                &keys,
                Target::Gubernator(&targets),
                &pids,
                kill.take(),
            )
            .await?;
            result.print();
            gubernator.push(result);
        }
        if args.protocol == Protocol::Health {
            println!("round {}: tonic health check", round + 1);
            let result = drive(&args, &keys, Target::Health(&targets), &pids, None).await?;
            result.print();
            health.push(result);
        }
        if !args.protocol.native() {
            continue;
        }
        println!("round {}: ringlimit", round + 1);
        let result = drive(
            &args,
            &keys,
            Target::Ringlimit(&targets),
            &pids,
            kill.take(),
        )
        .await?;
        result.print();
        ours.push(result);
        if let Some((server, sha)) = &redis {
            println!("round {}: redis", round + 1);
            let redis_pid = [server.pid()];
            let result = drive(
                &args,
                &keys,
                Target::Redis(&server.addr, sha),
                &redis_pid,
                None,
            )
            .await?;
            result.print();
            theirs.push(result);
        }
    }
    print_front_ratio("envoy-rls", &envoy, &ours);
    print_front_ratio("gubernator", &gubernator, &ours);
    print_front_ratio("health", &health, &ours);
    if !aware.is_empty() && !ours.is_empty() {
        let rate = |v: &[RunResult]| median(v.iter().map(RunResult::rate).collect());
        let p99 = |v: &[RunResult]| median(v.iter().map(|r| r.ms(0.99)).collect());
        let (ra, rr) = (rate(&aware), rate(&ours));
        println!(
            "median ring-aware checks/s {ra:.0} p99 {:.3} ms; random-entry checks/s {rr:.0} p99 {:.3} ms; ratio ring-aware/random-entry {:.2}",
            p99(&aware),
            p99(&ours),
            ra / rr
        );
        if let (Some(a), Some(r)) = (median_cpu(&aware), median_cpu(&ours)) {
            println!(
                "median server CPU per check: ring-aware {a:.1} µs, random-entry {r:.1} µs, ratio {:.2}",
                a / r
            );
        }
    }
    if !theirs.is_empty() {
        let rate_ours = median(ours.iter().map(RunResult::rate).collect());
        let rate_theirs = median(theirs.iter().map(RunResult::rate).collect());
        let p99_ours = median(ours.iter().map(|r| r.ms(0.99)).collect());
        let p99_theirs = median(theirs.iter().map(|r| r.ms(0.99)).collect());
        println!("median ringlimit checks/s {rate_ours:.0} p99 {p99_ours:.3} ms; redis checks/s {rate_theirs:.0} p99 {p99_theirs:.3} ms");
        println!(
            "ratio ringlimit/redis checks_per_s: {:.2}",
            rate_ours / rate_theirs
        );
        println!("ratio ringlimit/redis p99: {:.2}", p99_ours / p99_theirs);
        if let (Some(o), Some(t)) = (median_cpu(&ours), median_cpu(&theirs)) {
            println!("median server CPU per check: ringlimit {o:.1} µs, redis {t:.1} µs");
            println!("ratio ringlimit/redis cpu_per_check: {:.2}", o / t);
            if let Some(h) = median_cpu(&health) {
                println!("ratio health/redis cpu_per_call: {:.2}", h / t);
            }
        }
    }
    for node in &mut nodes {
        node.stop();
    }
    Ok(())
}

enum Target<'a> {
    Ringlimit(&'a [String]),
    /// One ring-aware client (seeded with every target) shared by the callers.
    RingAware(&'a [String]),
    Envoy(&'a [String]),
    Gubernator(&'a [String]),
    /// tonic's health check on the nodes (no check at all).
    Health(&'a [String]),
    Redis(&'a str, &'a str),
}

/// Drive one system for warmup + duration with the configured load.
async fn drive(
    args: &BenchArgs,
    keys: &Keys,
    target: Target<'_>,
    pids: &[u32],
    kill: Option<(u32, Duration)>,
) -> anyhow::Result<RunResult> {
    let checks = Arc::new(AtomicU64::new(0));
    let allowed = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let ring_aware = match &target {
        Target::RingAware(targets) => {
            let mut config = ringlimit_client::ClientConfig::new(targets.iter().cloned());
            // A bench measures the cluster: a check that misses a short gateway deadline
            // must be a slow answer, not a local fail-open one.
            config.deadline = Duration::from_secs(5);
            config.coalesce = args.coalesce.then(ringlimit_client::Coalesce::default);
            let client = ringlimit_client::Client::connect(config).await?;
            anyhow::ensure!(
                client.members().len() == targets.len(),
                "the ring-aware client learned {:?}, expected {} members",
                client.members(),
                targets.len()
            );
            Some(client)
        }
        _ => None,
    };
    let forwarded = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for worker in 0..args.concurrency {
        let ctx = Worker {
            keys: keys.clone(),
            rng: args.seed ^ (worker as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            pacing: (args.rate > 0.0).then(|| {
                let interval = Duration::from_secs_f64(args.concurrency as f64 / args.rate);
                // Callers start staggered across one interval, not all at once.
                let offset = interval.mul_f64(worker as f64 / args.concurrency as f64);
                Pacing {
                    interval,
                    next: Instant::now() + offset,
                }
            }),
            batch: args.batch,
            client: args.client,
            cost: args.cost,
            limit: args.limit,
            envoy: matches!(target, Target::Envoy(_))
                .then(|| (args.domain.clone(), args.descriptor_key.clone())),
            gubernator: matches!(target, Target::Gubernator(_)),
            health: matches!(target, Target::Health(_)),
            checks: checks.clone(),
            allowed: allowed.clone(),
            errors: errors.clone(),
            measuring: measuring.clone(),
            stop: stop.clone(),
        };
        workers.push(match &target {
            Target::Ringlimit(targets)
            | Target::Envoy(targets)
            | Target::Gubernator(targets)
            | Target::Health(targets) => {
                let addr = format!("http://{}", targets[worker % targets.len()]);
                tokio::spawn(ctx.ringlimit(addr))
            }
            Target::RingAware(_) => tokio::spawn(
                ctx.ring_aware(ring_aware.clone().expect("built above"), forwarded.clone()),
            ),
            Target::Redis(addr, sha) => tokio::spawn(ctx.redis(addr.to_string(), sha.to_string())),
        });
    }
    tokio::time::sleep(Duration::from_secs(args.warmup)).await;
    checks.store(0, Ordering::SeqCst);
    allowed.store(0, Ordering::SeqCst);
    errors.store(0, Ordering::SeqCst);
    measuring.store(true, Ordering::SeqCst);
    let cpu_before = cpu_seconds(pids);
    let started = Instant::now();
    if let Some((pid, after)) = kill {
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let killed = Command::new("kill").args(["-9", &pid.to_string()]).status();
            eprintln!(
                "  killed node pid {pid} at {} s: {killed:?}",
                after.as_secs()
            );
        });
    }
    for second in 1..=args.duration {
        tokio::time::sleep_until((started + Duration::from_secs(second)).into()).await;
        eprintln!(
            "  {second:>3} s  {:>10.0} checks/s so far, errors {}",
            checks.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64(),
            errors.load(Ordering::Relaxed)
        );
    }
    measuring.store(false, Ordering::SeqCst);
    let cpu_after = cpu_seconds(pids);
    let elapsed = started.elapsed();
    let total = checks.load(Ordering::SeqCst);
    stop.store(true, Ordering::SeqCst);
    let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    for worker in workers {
        latency.add(worker.await??)?;
    }
    if let Some(client) = &ring_aware {
        let stats = client.coalesce_stats();
        println!(
            "ring-aware: {} answers came after a forward (stale view){}",
            forwarded.load(Ordering::SeqCst),
            if args.coalesce {
                format!(
                    "; coalescing: {} checks in {} calls",
                    stats.checks, stats.calls
                )
            } else {
                String::new()
            }
        );
    }
    Ok(RunResult {
        system: match target {
            Target::Ringlimit(_) => "ringlimit",
            Target::RingAware(_) => "ring-aware",
            Target::Envoy(_) => "envoy-rls",
            Target::Gubernator(_) => "gubernator",
            Target::Health(_) => "health",
            Target::Redis(..) => "redis",
        },
        server_cpu_s: match (cpu_before, cpu_after) {
            (Some(b), Some(a)) if !pids.is_empty() => Some(a - b),
            _ => None,
        },
        checks: total,
        allowed: allowed.load(Ordering::SeqCst),
        errors: errors.load(Ordering::SeqCst),
        elapsed,
        latency,
    })
}

/// The median of `values` (upper median of an even count).
/// The median of `values` (not empty): for an even count the mean of the middle two, so
/// two rounds report their mean rather than the better or the worse of them.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    let mid = values.len() / 2;
    if values.len().is_multiple_of(2) {
        (values[mid - 1] + values[mid]) / 2.0
    } else {
        values[mid]
    }
}

/// The median server CPU per check of `runs` that measured it.
fn median_cpu(runs: &[RunResult]) -> Option<f64> {
    let c: Vec<f64> = runs
        .iter()
        .filter_map(RunResult::cpu_us_per_check)
        .collect();
    (!c.is_empty()).then(|| median(c))
}

/// Median checks/s and server CPU per check of a front end (`front`, e.g. Envoy RLS)
/// against the native `Check` rounds of the same run.
fn print_front_ratio(name: &str, front: &[RunResult], native: &[RunResult]) {
    if front.is_empty() || native.is_empty() {
        return;
    }
    let rate_front = median(front.iter().map(RunResult::rate).collect());
    let rate_native = median(native.iter().map(RunResult::rate).collect());
    println!(
        "median {name} checks/s {rate_front:.0}, native Check checks/s {rate_native:.0}, ratio {:.2}",
        rate_front / rate_native
    );
    if let (Some(f), Some(n)) = (median_cpu(front), median_cpu(native)) {
        println!(
            "median server CPU per check: {name} {f:.1} µs, native {n:.1} µs, ratio {name}/native {:.2}",
            f / n
        );
    }
}

/// An open-loop caller's schedule.
struct Pacing {
    interval: Duration,
    next: Instant,
}

struct Worker {
    keys: Keys,
    rng: u64,
    pacing: Option<Pacing>,
    batch: usize,
    client: ClientKind,
    cost: i64,
    limit: u64,
    /// Send `ShouldRateLimit` in (domain, descriptor key) instead of `Check`.
    envoy: Option<(String, String)>,
    /// Send `GetRateLimits` instead of `Check`.
    gubernator: bool,
    /// Send tonic's `Health/Check` instead of `Check` (a call that decides nothing).
    health: bool,
    checks: Arc<AtomicU64>,
    allowed: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    measuring: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Worker {
    /// Wait for this caller's next call; returns the instant its latency counts from.
    async fn pace(&mut self) -> Instant {
        let Some(pacing) = self.pacing.as_mut() else {
            return Instant::now();
        };
        let scheduled = pacing.next;
        pacing.next += pacing.interval;
        if Instant::now() < scheduled {
            tokio::time::sleep_until(scheduled.into()).await;
            // On time: timed from the actual send, so the timer's own slack (up to a
            // millisecond) is not charged to the system under test.
            Instant::now()
        } else {
            // Late because the previous call was slow: the wait is the system's.
            scheduled
        }
    }

    fn record(&self, latency: &mut Histogram<u64>, started: Instant, checks: u64, allowed: u64) {
        if self.measuring.load(Ordering::Relaxed) {
            let _ = latency.record(started.elapsed().as_micros().max(1) as u64);
            self.checks.fetch_add(checks, Ordering::Relaxed);
            self.allowed.fetch_add(allowed, Ordering::Relaxed);
        }
    }

    /// Checks through the shared ring-aware client until told to stop. Answers decided
    /// without a node (fail-open, fail-closed) count as errors: the bench measures the
    /// cluster.
    async fn ring_aware(
        mut self,
        client: ringlimit_client::Client,
        forwarded: Arc<AtomicU64>,
    ) -> anyhow::Result<Histogram<u64>> {
        let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
        while !self.stop.load(Ordering::Relaxed) {
            let started = self.pace().await;
            let key = self.keys.next(&mut self.rng);
            let check = ringlimit_client::Check::new(key, "GET /bench")
                .cost(u64::try_from(self.cost).unwrap_or(1));
            match client.check(&check).await {
                Ok(a) if !a.source.degraded() => {
                    if a.source == ringlimit_client::Source::Forwarded
                        && self.measuring.load(Ordering::Relaxed)
                    {
                        forwarded.fetch_add(1, Ordering::Relaxed);
                    }
                    self.record(&mut latency, started, 1, u64::from(a.allowed()));
                }
                _ => {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Ok(latency)
    }

    async fn ringlimit(mut self, addr: String) -> anyhow::Result<Histogram<u64>> {
        match self.client {
            ClientKind::Tonic => self.ringlimit_tonic(addr).await,
            ClientKind::RingAware => unreachable!("ring-aware callers share one client"),
            ClientKind::Lean => {
                let target = addr.trim_start_matches("http://").to_string();
                let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
                while !self.stop.load(Ordering::Relaxed) {
                    let (client, connection) = lean::LeanClient::connect(&target).await?;
                    // The connection is polled in this worker's task, not a task of its own.
                    let closed = tokio::select! {
                        result = connection => Some(result),
                        () = self.ringlimit_lean(client, &mut latency) => None,
                    };
                    if let Some(result) = closed {
                        // The node closed or broke the connection: count it, reconnect.
                        tracing::debug!(?result, %target, "bench connection ended");
                        self.errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                Ok(latency)
            }
        }
    }

    /// Calls on `client` until told to stop; failed calls are counted.
    async fn ringlimit_lean(&mut self, mut client: lean::LeanClient, latency: &mut Histogram<u64>) {
        const CHECK: &str = "/ringlimit.v1.RateLimiter/Check";
        const CHECK_BATCH: &str = "/ringlimit.v1.RateLimiter/CheckBatch";
        const RLS: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
        const GUBERNATOR: &str = "/pb.gubernator.V1/GetRateLimits";
        const HEALTH: &str = "/grpc.health.v1.Health/Check";
        while !self.stop.load(Ordering::Relaxed) {
            let started = self.pace().await;
            if self.health {
                let request = tonic_health::pb::HealthCheckRequest::default();
                match client
                    .unary::<_, tonic_health::pb::HealthCheckResponse>(HEALTH, &request)
                    .await
                {
                    // A serving node "allows"; any other status counts as a denial.
                    Ok(a) => {
                        let serving =
                            tonic_health::pb::health_check_response::ServingStatus::Serving;
                        self.record(latency, started, 1, u64::from(a.status == serving as i32));
                    }
                    Err(_) => {
                        self.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else if self.gubernator {
                let request = self.gubernator_request();
                match client
                    .unary::<_, GetRateLimitsResp>(GUBERNATOR, &request)
                    .await
                {
                    Ok(a) if a.responses.len() == 1 && a.responses[0].error.is_empty() => {
                        let under = a.responses[0].status == GubernatorStatus::UnderLimit as i32;
                        self.record(latency, started, 1, u64::from(under));
                    }
                    _ => {
                        self.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else if let Some(request) = self.envoy_request() {
                match client.unary::<_, RateLimitResponse>(RLS, &request).await {
                    Ok(a) => self.record(latency, started, 1, u64::from(a.overall_code == 1)),
                    Err(_) => {
                        self.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else if self.batch == 1 {
                let key = self.keys.next(&mut self.rng);
                let request = self.request(key);
                match client.unary::<_, CheckResponse>(CHECK, &request).await {
                    Ok(a) => self.record(latency, started, 1, u64::from(a.allowed)),
                    Err(_) => {
                        self.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else {
                let request = self.batch_request();
                match client
                    .unary::<_, CheckBatchResponse>(CHECK_BATCH, &request)
                    .await
                {
                    Ok(a) => self.record_batch(latency, started, &a.results),
                    Err(_) => {
                        self.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    }

    async fn ringlimit_tonic(mut self, addr: String) -> anyhow::Result<Histogram<u64>> {
        let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
        let mut client = RateLimiterClient::connect(addr.clone())
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        while !self.stop.load(Ordering::Relaxed) {
            let started = self.pace().await;
            if self.batch == 1 {
                let key = self.keys.next(&mut self.rng);
                match client.check(self.request(key)).await {
                    Ok(a) => {
                        self.record(&mut latency, started, 1, u64::from(a.into_inner().allowed))
                    }
                    Err(_) => {
                        self.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else {
                match client.check_batch(self.batch_request()).await {
                    Ok(a) => self.record_batch(&mut latency, started, &a.into_inner().results),
                    Err(_) => {
                        self.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        Ok(latency)
    }

    /// A `CheckBatch` of `--batch` checks on the next keys.
    fn batch_request(&mut self) -> CheckBatchRequest {
        let checks = (0..self.batch)
            .map(|_| {
                let key = self.keys.next(&mut self.rng);
                self.request(key)
            })
            .collect();
        CheckBatchRequest { checks }
    }

    fn record_batch(
        &self,
        latency: &mut Histogram<u64>,
        started: Instant,
        results: &[CheckResponse],
    ) {
        let allowed = results.iter().filter(|r| r.allowed).count() as u64;
        self.record(latency, started, results.len() as u64, allowed);
    }

    /// The next key as one RLS descriptor, when the load goes through Envoy's API.
    fn envoy_request(&mut self) -> Option<RateLimitRequest> {
        let (domain, descriptor_key) = self.envoy.clone()?;
        let key = self.keys.next(&mut self.rng).to_string();
        Some(RateLimitRequest {
            domain,
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: descriptor_key,
                    value: key,
                }],
                ..Default::default()
            }],
            hits_addend: u32::try_from(self.cost).unwrap_or(1),
        })
    }

    /// The next key as one Gubernator request: `--limit` per minute, token bucket
    /// (Gubernator's default algorithm), `--cost` hits.
    fn gubernator_request(&mut self) -> GetRateLimitsReq {
        let key = self.keys.next(&mut self.rng).to_string();
        GetRateLimitsReq {
            requests: vec![RateLimitReq {
                name: "bench".into(),
                unique_key: key,
                hits: self.cost,
                limit: i64::try_from(self.limit).unwrap_or(i64::MAX),
                duration: 60_000,
                ..Default::default()
            }],
        }
    }

    fn request(&self, key: &str) -> CheckRequest {
        CheckRequest {
            key: key.to_string(),
            route: "GET /bench".into(),
            cost: Some(self.cost),
            tier: None,
            descriptors: Vec::new(),
        }
    }

    async fn redis(mut self, addr: String, sha: String) -> anyhow::Result<Histogram<u64>> {
        let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
        let mut conn = redis::Conn::connect(&addr).await?;
        while !self.stop.load(Ordering::Relaxed) {
            let started = self.pace().await;
            let now_ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
            for _ in 0..self.batch {
                let key = self.keys.next(&mut self.rng);
                redis::push_check(
                    &mut conn,
                    &sha,
                    key,
                    "GET /bench",
                    self.limit,
                    60_000,
                    now_ms,
                );
            }
            conn.flush().await?;
            let mut allowed = 0;
            let mut failed = false;
            for _ in 0..self.batch {
                match redis::admitted(&conn.read().await?) {
                    Ok(a) => allowed += u64::from(a),
                    Err(_) => failed = true,
                }
            }
            if failed {
                self.errors.fetch_add(1, Ordering::Relaxed);
            } else {
                self.record(&mut latency, started, self.batch as u64, allowed);
            }
        }
        Ok(latency)
    }
}

/// The key space and its sampler.
#[derive(Clone)]
struct Keys {
    names: Arc<Vec<String>>,
    /// Cumulative Zipf weights; empty for uniform.
    cdf: Arc<Vec<f64>>,
}

impl Keys {
    fn new(args: &BenchArgs) -> Self {
        let names = (0..args.keys).map(|i| format!("client_{i}")).collect();
        let cdf = match args.distribution {
            Distribution::Uniform => Vec::new(),
            Distribution::Zipf => {
                let mut total = 0.0;
                let mut cdf: Vec<f64> = (1..=args.keys)
                    .map(|rank| {
                        total += 1.0 / (rank as f64).powf(args.zipf_s);
                        total
                    })
                    .collect();
                for c in &mut cdf {
                    *c /= total;
                }
                cdf
            }
        };
        Self {
            names: Arc::new(names),
            cdf: Arc::new(cdf),
        }
    }

    fn next(&self, rng: &mut u64) -> &str {
        let r = splitmix(rng);
        let index = if self.cdf.is_empty() {
            (r % self.names.len() as u64) as usize
        } else {
            let u = (r >> 11) as f64 / (1u64 << 53) as f64;
            self.cdf
                .partition_point(|&c| c < u)
                .min(self.names.len() - 1)
        };
        &self.names[index]
    }
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn rule_toml(algorithm: &str, limit: u64) -> String {
    let extra = if algorithm == "leaky_bucket" {
        format!("burst = {limit}\n")
    } else {
        String::new()
    };
    format!("[default]\nalgorithm = \"{algorithm}\"\nlimit = {limit}\nwindow = \"60s\"\n{extra}")
}

fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("ringlimit-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// A node process started by the bench.
struct LocalNode {
    child: Child,
    grpc: String,
    /// The peer service (the cluster face), where `Peer/Status` is answered.
    peer: String,
}

impl LocalNode {
    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where [`start_nodes`] keeps the cluster key of the nodes it starts.
fn secret_path(dir: &std::path::Path) -> std::path::PathBuf {
    dir.join("cluster.secret")
}

impl Drop for LocalNode {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Start `count` node processes of this binary on port 0, clustered under a fresh
/// cluster key (in `dir`), with `rules`; `extra` are more `serve` flags.
fn start_nodes(
    count: usize,
    dir: &std::path::Path,
    rules: &str,
    extra: &[&str],
) -> anyhow::Result<Vec<LocalNode>> {
    let path = dir.join("rules.toml");
    std::fs::write(&path, rules)?;
    let secret = secret_path(dir);
    std::fs::write(&secret, ringlimit::keyring::generate_secret())?;
    let exe = std::env::current_exe()?;
    let mut nodes: Vec<LocalNode> = Vec::new();
    let mut seed: Option<String> = None;
    for i in 0..count.max(1) {
        let mut command = Command::new(&exe);
        command
            .args(["serve", "--node-id", &format!("bench-{}", i + 1)])
            .args([
                "--listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
                "--gossip-listen",
                "127.0.0.1:0",
                "--peer-listen",
                "127.0.0.1:0",
            ])
            .arg("--rules")
            .arg(&path)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(seed) = &seed {
            command.args(["--seed", seed]);
        }
        if !extra.contains(&"--insecure-cluster") {
            command.arg("--cluster-secret-file").arg(&secret);
        }
        let mut child = command.spawn().context("starting a ringlimit node")?;
        let stdout = child.stdout.take().context("node stdout")?;
        let line = std::io::BufRead::lines(std::io::BufReader::new(stdout))
            .next()
            .context("node exited before it was ready")??;
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{name}=")))
                .map(str::to_string)
                .with_context(|| format!("no {name}= in ready line {line:?}"))
        };
        let grpc = field("grpc")?;
        let peer = field("peer")?;
        seed.get_or_insert(field("gossip")?);
        nodes.push(LocalNode { child, grpc, peer });
    }
    if count > 1 {
        // Let gossip converge so checks are routed on the full ring.
        std::thread::sleep(Duration::from_secs(3));
    }
    Ok(nodes)
}

/// The process listening on TCP `port` on this machine (Linux `/proc`: the socket's
/// inode in `/proc/net/tcp{,6}`, then the process holding it), if it can be found.
fn pid_listening_on(port: u16) -> Option<u32> {
    let inode = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .find_map(|table| {
            let text = std::fs::read_to_string(table).ok()?;
            text.lines().skip(1).find_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let local_port = fields.get(1)?.rsplit_once(':')?.1;
                let listening = fields.get(3)? == &"0A";
                (listening && u16::from_str_radix(local_port, 16).ok()? == port)
                    .then(|| fields.get(9).map(|i| i.to_string()))
                    .flatten()
            })
        })?;
    let wanted = format!("socket:[{inode}]");
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let fds = std::fs::read_dir(entry.path().join("fd")).ok()?;
            fds.flatten()
                .any(|fd| {
                    std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == wanted)
                })
                .then_some(pid)
        })
}

/// User + system CPU seconds of the processes `pids` (Linux `/proc`); `None` elsewhere.
fn cpu_seconds(pids: &[u32]) -> Option<f64> {
    let ticks_per_s = Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok()?.trim().parse::<f64>().ok())
        .unwrap_or(100.0);
    let mut total = 0.0;
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the parenthesised command name: utime and stime are 14 and 15.
        let rest = stat.rsplit_once(')')?.1;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let utime: f64 = fields.get(11)?.parse().ok()?;
        let stime: f64 = fields.get(12)?.parse().ok()?;
        total += (utime + stime) / ticks_per_s;
    }
    Some(total)
}

fn rss_bytes(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .context("no VmRSS")?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kb * 1024)
}

/// Bytes per key: fill a fresh node with --keys keys of --algorithm, RSS after minus
/// before, divided by keys (and Redis used_memory per client with --compare-redis).
async fn memory(args: &BenchArgs) -> anyhow::Result<()> {
    let dir = tempfile_dir()?;
    // Each key gets one check. A limit of 100 per day keeps that check's trace alive
    // until it is measured for every algorithm (a token bucket refills one token in
    // 864 s); with a huge limit or a short window the state would equal a fresh one
    // within milliseconds and the store would rightly drop it, measuring nothing.
    let limit = 100;
    let rules = rule_toml(&args.algorithm, limit).replace("\"60s\"", "\"1d\"");
    // A key cap above --keys: the shards' shares of the keys are not exactly even, and
    // an eviction would make the figure look better than it is.
    let cap = (args.keys + args.keys / 10).max(1_000).to_string();
    let mut nodes = start_nodes(1, &dir, &rules, &["--max-keys", &cap])?;
    let node = &mut nodes[0];
    let pid = node.child.id();
    let mut client = RateLimiterClient::connect(format!("http://{}", node.grpc)).await?;
    // One check first, so connection buffers and lazily built structures are counted
    // in the baseline, not per key.
    client
        .check(CheckRequest {
            key: "warm".into(),
            route: "GET /m".into(),
            ..Default::default()
        })
        .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = rss_bytes(pid)?;
    let started = Instant::now();
    for chunk in 0..args.keys.div_ceil(1000) {
        let checks = (chunk * 1000..((chunk + 1) * 1000).min(args.keys))
            .map(|i| CheckRequest {
                key: format!("client_{i}"),
                route: "GET /m".into(),
                ..Default::default()
            })
            .collect();
        client.check_batch(CheckBatchRequest { checks }).await?;
    }
    // Settle before measuring, with a trickle of checks on several tasks as a live node
    // would see: allocators may hand freed memory (outgrown copies of the tables,
    // request buffers) back to the OS only later, on further activity, and a figure
    // taken before that would count memory the node no longer uses.
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let calls = (0..4).map(|_| {
            let mut client = client.clone();
            async move {
                client
                    .check(CheckRequest {
                        key: "warm".into(),
                        route: "GET /m".into(),
                        ..Default::default()
                    })
                    .await
            }
        });
        for answer in futures_util::future::join_all(calls).await {
            answer?;
        }
    }
    let after = rss_bytes(pid)?;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", node.peer))?
        .connect()
        .await?;
    let keyring = ringlimit::keyring::Keyring::from_file(&secret_path(&dir))?;
    let held = PeerClient::new(ringlimit::cluster::forward::Signed::new(
        channel,
        Some(keyring),
        "ringlimit-bench".into(),
    ))
    .status(StatusRequest {})
    .await?
    .into_inner()
    .keys;
    // The warm-up key is held too.
    anyhow::ensure!(
        held > args.keys as u64,
        "the node holds {held} keys, not all {} filled: the figure would be wrong",
        args.keys
    );
    println!(
        "ringlimit {:<24} keys {:>9}  RSS {:>7.1} MiB -> {:>7.1} MiB  bytes/key {:>6.1}  (filled in {:.1} s)",
        args.algorithm,
        args.keys,
        before as f64 / 1048576.0,
        after as f64 / 1048576.0,
        after.saturating_sub(before) as f64 / args.keys as f64,
        started.elapsed().as_secs_f64()
    );
    node.stop();
    if args.compare_redis {
        let server = redis::start().await?;
        let sha = redis::load_script(&server.addr).await?;
        let before = redis::used_memory(&server.addr).await?;
        let mut conn = redis::Conn::connect(&server.addr).await?;
        let now_ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
        for chunk in 0..args.keys.div_ceil(1000) {
            let range = chunk * 1000..((chunk + 1) * 1000).min(args.keys);
            let n = range.len();
            for i in range {
                redis::push_check(
                    &mut conn,
                    &sha,
                    &format!("client_{i}"),
                    "GET /m",
                    1_000_000,
                    60_000,
                    now_ms,
                );
            }
            conn.flush().await?;
            for _ in 0..n {
                if let Err(e) = redis::admitted(&conn.read().await?) {
                    bail!("redis script failed: {e}");
                }
            }
        }
        let after = redis::used_memory(&server.addr).await?;
        println!(
            "redis     sliding_window_counter   keys {:>9}  used_memory {:>7.1} MiB -> {:>7.1} MiB  bytes/key {:>6.1}  ({})",
            args.keys,
            before as f64 / 1048576.0,
            after as f64 / 1048576.0,
            after.saturating_sub(before) as f64 / args.keys as f64,
            redis::version()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(vec![3.0]), 3.0);
        assert_eq!(median(vec![5.0, 1.0, 3.0]), 3.0);
        assert_eq!(median(vec![40_803.0, 39_953.0]), 40_378.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
