//! What a counter snapshot costs at a million keys, and whether it stalls checks.
//!
//! Run: `cargo bench --bench snapshot` (release). One process: two shard actors on a
//! two-thread runtime (a node on two cores), a million fixed-window keys of an hourly
//! rule, then
//! - check latency (a shard round trip) at a steady open-loop rate with no snapshot,
//!   then at the same rate while snapshots are written back to back: p50, p99, p99.9
//!   and the worst, each timed from when the check was due;
//! - one snapshot alone: wall time, CPU time of the process, file size, the largest
//!   shard copy held at once, RSS before and after;
//! - the load of that file into fresh shards (a start).
//!
//! Figures go to stdout; bench/RESULTS.md holds the current ones.

use std::num::NonZeroU64;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use ringlimit::clock::SystemClock;
use ringlimit::config::rules::envoy::EnvoyConfig;
use ringlimit::config::rules::{Rule, RuleSet};
use ringlimit::membership::{ClusterView, Member};
use ringlimit::node::snapshot::{Loaded, Snapshots};
use ringlimit::shard::{Charge, KeyId, ShardConfig, Shards};

const KEYS: u64 = 1_000_000;
/// Checks per second of the latency phases: a node at a moderate load.
const RATE: u64 = 20_000;
const CALLERS: u64 = 20;
const PHASE: Duration = Duration::from_secs(6);

const RULES: &str = r#"
[[rule]]
name = "hourly"
route = "GET /q"
algorithm = "fixed_window"
limit = 1000000
window = "1h"
"#;

fn charge(rule: &Arc<Rule>, key: u64) -> Charge {
    Charge {
        id: KeyId::of(&rule.name, format!("client-{key}").as_bytes(), "GET /q"),
        rule: rule.clone(),
        cost: NonZeroU64::MIN,
        give_back: None,
        drain: false,
        peek: false,
        target: Default::default(),
    }
}

fn shards(
    tracker: &tokio_util::task::TaskTracker,
    cancel: &tokio_util::sync::CancellationToken,
) -> Shards {
    Shards::spawn(
        &ShardConfig {
            shards: 2,
            max_keys: 2_000_000,
            ..ShardConfig::default()
        },
        Arc::new(SystemClock),
        Arc::new(AtomicU64::new(0)),
        tracker,
        cancel.clone(),
    )
}

fn snapshots(dir: &std::path::Path, shards: &Shards, rules: &RuleSet) -> Snapshots {
    let member = Member {
        node_id: "bench".into(),
        generation: 1,
        grpc_addr: "127.0.0.1:1".parse().unwrap(),
        peer_addr: "127.0.0.1:2".parse().unwrap(),
        gossip_addr: "127.0.0.1:3".parse().unwrap(),
        leaving: false,
    };
    let (_tx, view) = tokio::sync::watch::channel(Arc::new(ClusterView::single(member)));
    // The sender may go: the snapshot reads the last view.
    std::mem::forget(_tx);
    Snapshots::new(
        dir.to_owned(),
        "ringlimit".into(),
        "bench".into(),
        shards.clone(),
        Arc::new(ArcSwap::from_pointee(rules.clone())),
        Arc::new(ArcSwap::from_pointee(EnvoyConfig::default())),
        view,
        Arc::new(SystemClock),
        Duration::from_secs(60),
        u64::MAX,
    )
}

/// Process CPU seconds (user + system), from `/proc/self/stat` (clock ticks of
/// 1/100 s, the kernel's USER_HZ).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name, which ends with the last ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    // utime and stime are the 14th and 15th fields; the state (3rd) is fields[0].
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

fn rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Checks at `RATE` for `phase` from `CALLERS` tasks (open loop: a caller that falls
/// behind does not slow the rate down), each timed from its call to its answer.
async fn latencies(shards: &Shards, rule: &Arc<Rule>, phase: Duration) -> Vec<Duration> {
    let mut tasks = Vec::new();
    for caller in 0..CALLERS {
        let (shards, rule) = (shards.clone(), rule.clone());
        tasks.push(tokio::spawn(async move {
            let every = Duration::from_secs_f64(CALLERS as f64 / RATE as f64);
            let start = tokio::time::Instant::now();
            let mut out = Vec::new();
            let mut n: u64 = 0;
            while start.elapsed() < phase {
                tokio::time::sleep_until(start + every * n as u32).await;
                let key = (n * CALLERS + caller).wrapping_mul(0x9e37_79b9) % KEYS;
                let called = Instant::now();
                shards
                    .check(smallvec::smallvec![charge(&rule, key)])
                    .await
                    .expect("check");
                out.push(called.elapsed());
                n += 1;
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort();
    all
}

fn summary(name: &str, l: &[Duration]) {
    let q = |p: f64| l[((l.len() as f64 * p) as usize).min(l.len() - 1)];
    println!(
        "{name:<28} checks {:>7}  p50 {:>8.1?}  p99 {:>8.1?}  p99.9 {:>8.1?}  max {:>8.1?}",
        l.len(),
        q(0.5),
        q(0.99),
        q(0.999),
        l[l.len() - 1]
    );
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let rules = RuleSet::from_toml_str(RULES).unwrap();
    let rule = rules
        .rules()
        .iter()
        .find(|r| &*r.name == "hourly")
        .unwrap()
        .clone();
    runtime.block_on(async {
        let (tracker, cancel) = (
            tokio_util::task::TaskTracker::new(),
            tokio_util::sync::CancellationToken::new(),
        );
        let shards = shards(&tracker, &cancel);
        let started = Instant::now();
        let mut fill = Vec::new();
        for part in 0..4u64 {
            let (shards, rule) = (shards.clone(), rule.clone());
            fill.push(tokio::spawn(async move {
                let mut key = part;
                while key < KEYS {
                    let batch: ringlimit::shard::Charges =
                        (0..64).map(|i| key + 4 * i).filter(|k| *k < KEYS).map(|k| charge(&rule, k)).collect();
                    key += 4 * 64;
                    shards.check(batch).await.expect("fill");
                }
            }));
        }
        for f in fill {
            f.await.unwrap();
        }
        let keys = shards.keys().await.unwrap();
        println!("filled {keys} keys in {:.1?}; RSS {:.0} MB", started.elapsed(), rss_mb());

        let snaps = snapshots(dir.path(), &shards, &rules);
        // One snapshot alone.
        let (rss_before, cpu_before, wall) = (rss_mb(), cpu_seconds(), Instant::now());
        let written = snaps.write().await.expect("snapshot");
        let (wall, cpu) = (wall.elapsed(), cpu_seconds() - cpu_before);
        println!(
            "one snapshot: {} keys, {:.1} MB file ({:.1} bytes a key), {wall:.1?} wall, \
             {cpu:.2} s CPU, largest shard copy {:.1} MB, RSS {rss_before:.0} → {:.0} MB",
            written.live,
            written.bytes as f64 / 1e6,
            written.bytes as f64 / written.live.max(1) as f64,
            written.copy_bytes as f64 / 1e6,
            rss_mb()
        );

        // How long a shard is held by its copy: what a check can wait behind.
        let mut holds = Vec::new();
        for _ in 0..5 {
            for shard in 0..shards.len() {
                let t = Instant::now();
                let frozen = shards.freeze(shard).await.expect("freeze");
                holds.push(t.elapsed());
                drop(frozen);
            }
        }
        holds.sort();
        println!(
            "a shard's copy ({} keys a shard): median {:.1?}, worst {:.1?} (round trip included)",
            KEYS / shards.len() as u64,
            holds[holds.len() / 2],
            holds[holds.len() - 1]
        );

        summary("no snapshot", &latencies(&shards, &rule, PHASE).await);
        let every = tokio::spawn(snaps.clone().run(
            ringlimit::node::snapshot::DEFAULT_INTERVAL,
            cancel.child_token(),
        ));
        let default = latencies(&shards, &rule, Duration::from_secs(11)).await;
        every.abort();
        summary("default interval (5 s)", &default);
        let writer = {
            let snaps = snaps.clone();
            tokio::spawn(async move {
                let mut n = 0;
                let started = Instant::now();
                while started.elapsed() < PHASE {
                    snaps.write().await.expect("snapshot");
                    n += 1;
                }
                (n, started.elapsed())
            })
        };
        let during = latencies(&shards, &rule, PHASE).await;
        let (n, took) = writer.await.unwrap();
        summary("snapshots back to back", &during);
        println!(
            "  ({n} snapshots in {took:.1?}: one every {:.0?}, so every check above ran during one)",
            took / n.max(1)
        );

        // A start: the file into fresh shards.
        let fresh = self::shards(&tracker, &cancel);
        let load = Instant::now();
        let loaded = self::snapshots(dir.path(), &fresh, &rules).load().await;
        let Loaded::Installed { live, .. } = loaded else {
            panic!("not loaded: {loaded:?}");
        };
        println!("load at start: {live} keys in {:.1?}", load.elapsed());
        cancel.cancel();
    });
}
