//! Fencing under a real partition: three `ringlimit serve` processes, each on a
//! loopback address of its own, and iptables rules that cut the owner of a key off from
//! the other two (the chaos suite's partition, `process::Cut`).
//!
//! A fenced rule's key is admitted at most L in its window across both sides, and the
//! test prints what fencing costs: the share of the minority side's fenced checks it
//! denies (degraded), how long after the cut the majority side decides the key again.
//! A split rule's key, checked the same way in the same run, shows what fencing
//! prevents: both sides decide it (up to L each).
//!
//! Needs iptables (root): without it the test says so and checks nothing.

#[path = "common/process.rs"]
mod process;

#[path = "common/cluster.rs"]
mod cluster;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use cluster::{Cluster, Setup, CONVERGE_TIMEOUT};
use process::{iptables_available, Cut};
use ringlimit::proto::rate_limiter_client::RateLimiterClient;
use ringlimit::proto::{CheckRequest, CheckResponse};
use ringlimit::ring::Ring;
use tonic::transport::Channel;

const L: u64 = 20;
const RULES: &str = r#"
# Fail-closed: fenced in partitions by default.
[[rule]]
name = "exact"
route = "GET /exact"
algorithm = "fixed_window"
limit = 20
window = "1h"
on_unavailable = "closed"

# The same numbers, left to split.
[[rule]]
name = "split"
route = "GET /split"
algorithm = "fixed_window"
limit = 20
window = "1h"
on_unavailable = "closed"
partition = "split"
"#;
const IDS: [&str; 3] = ["node-a", "node-b", "node-c"];
const CHECK_DEADLINE: Duration = Duration::from_secs(3);
/// How long the owner stays cut off: well past detection (~1.1 s) and the takeover
/// silence (1.5 s), so the majority side decides the key for a while.
const CUT_FOR: Duration = Duration::from_secs(6);
/// The minority owner's lease outlives the cut by F (500 ms) + a tracker tick (50 ms);
/// no check is sent through it in this span, so what it admitted before the cut is all
/// its successor's replica must hold (the replica lag has its own row in the docs).
const QUIET_AFTER_CUT: Duration = Duration::from_millis(800);
/// Between checks, per side.
const PACE: Duration = Duration::from_millis(40);

/// Start the three nodes, each on a loopback address of its own.
async fn start() -> Cluster {
    // An address block of this test's own: its iptables rules name no other test's.
    let salt = std::process::id() as u8;
    let ips: Vec<IpAddr> = (1..=3)
        .map(|i| IpAddr::V4(Ipv4Addr::new(127, 201, salt, i)))
        .collect();
    let setup = Setup {
        rules: RULES,
        args: &["--deny-cache", "0", "--cluster-size", "3"],
        data_dirs: false,
        ips: &ips,
        prefix: "ringlimit-fencing-",
    };
    Cluster::start(&IDS, &setup).await
}

async fn check(
    client: &mut RateLimiterClient<Channel>,
    key: &str,
    route: &str,
) -> Option<CheckResponse> {
    let request = CheckRequest {
        key: key.to_string(),
        route: route.to_string(),
        cost: None,
        tier: None,
        descriptors: vec![],
    };
    match tokio::time::timeout(CHECK_DEADLINE, client.check(request)).await {
        Ok(Ok(answer)) => Some(answer.into_inner()),
        _ => None,
    }
}

/// What one side saw of one key during the cut.
#[derive(Debug, Default)]
struct Side {
    checks: u64,
    admitted: u64,
    denied_degraded: u64,
    errors: u64,
    /// Since the cut, when this side first admitted the key.
    first_admitted: Option<Duration>,
    /// Since the cut, when this side last admitted it.
    last_admitted: Option<Duration>,
}

impl Side {
    fn record(&mut self, answer: Option<CheckResponse>, since_cut: Duration) {
        self.checks += 1;
        match answer {
            None => self.errors += 1,
            Some(a) if a.allowed => {
                self.admitted += 1;
                self.first_admitted.get_or_insert(since_cut);
                self.last_admitted = Some(since_cut);
            }
            Some(a) if a.degraded => self.denied_degraded += 1,
            Some(_) => {}
        }
    }
}

/// Check `key` on `route` through `via` every `PACE` until `until`, from `from` on.
async fn drive(
    mut client: RateLimiterClient<Channel>,
    key: String,
    route: &'static str,
    cut: Instant,
    from: Instant,
    until: Instant,
) -> Side {
    let mut side = Side::default();
    tokio::time::sleep_until(from.into()).await;
    while Instant::now() < until {
        let answer = check(&mut client, &key, route).await;
        side.record(answer, cut.elapsed());
        tokio::time::sleep(PACE).await;
    }
    side
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fenced_key_is_admitted_at_most_its_limit_across_both_sides_of_a_partition() {
    if !iptables_available() {
        eprintln!(
            "[fencing] iptables is not usable here (root and the binary are needed): SKIPPED"
        );
        return;
    }
    let cluster = start().await;
    // A key node-c owns, with node-a its successor (so node-a decides it once node-c
    // is gone and node-b forwards there).
    let ring = Ring::new(IDS, Ring::DEFAULT_VNODES);
    let key = (0..100_000)
        .map(|i| format!("victim-{i}"))
        .find(|k| ring.owner(k.as_bytes()) == Some("node-c"))
        .expect("a key of node-c");

    // Each node decides fenced keys once it has held a majority for the join hold
    // (0.5 s after it heard the others): wait for it on a key each node owns.
    for owner in IDS {
        let warm = (0..100_000)
            .map(|i| format!("warm-{i}"))
            .find(|k| ring.owner(k.as_bytes()) == Some(owner))
            .expect("a key");
        let mut client = cluster.client(owner).await;
        let started = Instant::now();
        loop {
            let a = check(&mut client, &warm, "GET /exact")
                .await
                .expect("an answer");
            if a.allowed {
                break;
            }
            assert!(a.degraded, "a fenced denial is degraded: {a:?}");
            assert!(
                started.elapsed() < CONVERGE_TIMEOUT,
                "{owner} never decided its fenced keys"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // Before the cut: 5 admitted through every node, then a quiet moment for the last
    // replication round (50 ms) to reach the successor.
    for (i, id) in ["node-a", "node-b", "node-c", "node-a", "node-b"]
        .iter()
        .enumerate()
    {
        for route in ["GET /exact", "GET /split"] {
            let a = check(&mut cluster.client(id).await, &key, route)
                .await
                .expect("an answer");
            assert!(a.allowed, "check {i} of {route} through {id}: {a:?}");
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    let majority: Vec<IpAddr> = ["node-a", "node-b"]
        .iter()
        .map(|id| cluster.ip(id))
        .collect();
    let mut cut =
        Cut::apart(cluster.ip("node-c"), &majority).unwrap_or_else(|e| panic!("iptables: {e}"));
    let at = Instant::now();
    let end = at + CUT_FOR;
    let mut sides = Vec::new();
    for route in ["GET /exact", "GET /split"] {
        // The minority: node-c, the owner. The majority: node-a and node-b.
        let c = tokio::spawn(drive(
            cluster.client("node-c").await,
            key.clone(),
            route,
            at,
            at + QUIET_AFTER_CUT,
            end,
        ));
        let a = tokio::spawn(drive(
            cluster.client("node-a").await,
            key.clone(),
            route,
            at,
            at,
            end,
        ));
        let b = tokio::spawn(drive(
            cluster.client("node-b").await,
            key.clone(),
            route,
            at,
            at,
            end,
        ));
        sides.push((route, c, a, b));
    }
    let mut results = Vec::new();
    for (route, c, a, b) in sides {
        results.push((
            route,
            c.await.expect("minority"),
            a.await.expect("a"),
            b.await.expect("b"),
        ));
    }
    cut.heal();
    drop(cut);

    for (route, c, a, b) in &results {
        eprintln!("[fencing] {route}: minority (node-c, the owner) {c:?}");
        eprintln!("[fencing] {route}: majority node-a {a:?}");
        eprintln!("[fencing] {route}: majority node-b {b:?}");
    }
    let (_, c, a, b) = &results[0];
    let total = 5 + c.admitted + a.admitted + b.admitted;
    let minority_cost = c.denied_degraded as f64 / c.checks.max(1) as f64;
    let takeover = [a.first_admitted, b.first_admitted]
        .into_iter()
        .flatten()
        .min();
    eprintln!(
        "[fencing] fenced: {total} admitted in the window (L = {L}); the minority denied {} of its {} fenced checks degraded ({:.0} %), admitted {}; the majority decided the key again {:?} after the cut",
        c.denied_degraded,
        c.checks,
        100.0 * minority_cost,
        c.admitted,
        takeover
    );
    let (_, sc, sa, sb) = &results[1];
    let split_total = 5 + sc.admitted + sa.admitted + sb.admitted;
    eprintln!(
        "[fencing] split: {split_total} admitted in the window (L = {L}, two deciders: up to {}); the minority admitted {} of its {} checks",
        2 * L,
        sc.admitted,
        sc.checks
    );

    assert!(total <= L, "the fenced key admitted {total} > L = {L}");
    assert_eq!(
        c.admitted, 0,
        "the cut-off owner admitted after its lease ran out"
    );
    assert_eq!(
        c.denied_degraded, c.checks,
        "every minority check is denied, degraded"
    );
    assert!(
        c.checks >= 50,
        "the minority side was checked ({} checks)",
        c.checks
    );
    assert_eq!(
        total, L,
        "the majority side decides the key up to L once it took it over"
    );
    assert!(
        split_total > L,
        "the split rule admits on both sides ({split_total}): it shows what fencing prevents"
    );
    assert!(split_total <= 2 * L);
}
