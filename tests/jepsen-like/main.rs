//! Jepsen-like chaos tests: real `ringlimit serve` processes on their own loopback
//! addresses, a seeded workload, a seeded nemesis schedule (kill -9 and restart, kill -9
//! and replace, SIGSTOP/SIGCONT, join, graceful leave, iptables partition), a JSON-lines
//! history, and checkers for S1–S6 and availability that read only that history.
//! See docs/chaos.md.
//!
//! - `cargo test --test jepsen-like` runs the SHORT profile (3 nodes) and the negative
//!   control (a `--broken-decide-locally` cluster the checkers must flag).
//! - `RINGLIMIT_CHAOS=long` runs the LONG profile (5 nodes, ≥ 10 minutes;
//!   `RINGLIMIT_CHAOS_MINUTES=60` for an hour).
//! - `RINGLIMIT_CHAOS_SEED=N` repeats a run; `RINGLIMIT_CHAOS_RECHECK=FILE` re-checks a
//!   history file offline.
//! - `RINGLIMIT_CHAOS_REPLICATE=MS` starts the nodes with `--replicate-interval-ms MS`
//!   (0: replication off, as before issue 23; unset: the nodes' default, 50 ms), so two
//!   runs with one seed compare replication on and off. S3-replicated is asserted only
//!   when the nodes replicate; `RINGLIMIT_CHAOS_ASSERT_REPLICATED=1` asserts it anyway
//!   (the negative control: a run without replication must fail it), `=0` never.
//! - `RINGLIMIT_CHAOS_LEASES=N` starts the nodes with `--lease-threshold N` (budget
//!   leases, docs/leases.md; unset: the nodes' default, `DEFAULT_LEASE_THRESHOLD`,
//!   which the short profile's keys do not reach, and 5 checks/s in the long profile,
//!   so that leases run under every nemesis; 0: off) and adds a whale key to the
//!   workload (N > 0); `short_profile_with_budget_leases` runs the short profile so (CI).
//! - `RINGLIMIT_CHAOS_FRAMES=1` starts the nodes with `--forward-frames` (forwarded
//!   batches on framed connections rather than the HTTP/2 stream).

mod checker;
mod harness;
mod history;
mod ledger;
mod nemesis;
mod rules;
mod workload;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use harness::{Guard, Harness};
use history::{now_ms, Entry, History};
use rules::{rule_infos, RULES};

/// Chaos runs share two cores: run them one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

struct Profile {
    name: &'static str,
    nodes: usize,
    /// Number of nemesis steps (short: every kind once).
    events: usize,
    /// Keep injecting until at least this long has passed (long profile).
    min_chaos: Duration,
    fault_free: Duration,
    clients: u32,
    broken: bool,
    faults: bool,
    /// `--lease-threshold` for the nodes (`None`: their default, off).
    leases: Option<u64>,
}

fn seed_from_env() -> u64 {
    match std::env::var("RINGLIMIT_CHAOS_SEED") {
        Ok(s) => s
            .trim()
            .parse()
            .expect("RINGLIMIT_CHAOS_SEED must be an integer"),
        Err(_) => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
            (t.as_nanos() as u64) ^ (u64::from(std::process::id()) << 32)
        }
    }
}

struct Outcome {
    report: checker::Report,
    seed: u64,
    schedule: Vec<String>,
    history: PathBuf,
    logs: Vec<PathBuf>,
}

impl Outcome {
    fn repro(&self) -> String {
        format!(
            "seed={} (repeat: RINGLIMIT_CHAOS_SEED={})\nschedule: {:?}\nhistory: {}\nnode logs: {:?}",
            self.seed,
            self.seed,
            self.schedule,
            self.history.display(),
            self.logs
        )
    }
}

async fn run(profile: Profile, seed: u64) -> Outcome {
    let run_id = format!("{}-{seed}-{}", profile.name, now_ms());
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("jepsen-like")
        .join(&run_id);
    let history_path = dir.join("history.jsonl");
    let history = Arc::new(History::create(history_path.clone()));
    let mut rng = workload::Rng::new(seed);
    let ip_prefix = [127, 77 + (rng.range(0, 100) as u8), rng.range(1, 250) as u8];
    let steps = if profile.faults {
        // The long profile stops once it has run `events` steps AND `min_chaos` has
        // passed, so draw enough steps that the time bound, not the list, ends it.
        let steps = if profile.min_chaos.is_zero() {
            profile.events
        } else {
            profile.events * 4
        };
        nemesis::schedule(seed, profile.name == "long", profile.nodes, steps)
    } else {
        Vec::new()
    };
    let schedule: Vec<String> = steps.iter().map(|s| s.describe()).collect();
    eprintln!(
        "================ jepsen-like profile={} seed={seed} ================",
        profile.name
    );
    eprintln!("[chaos] repeat with RINGLIMIT_CHAOS_SEED={seed}");
    eprintln!("[chaos] schedule: {schedule:?}");
    eprintln!("[chaos] history: {}", history_path.display());
    history.record(&Entry::Meta {
        t: now_ms(),
        seed,
        profile: profile.name.into(),
        broken: profile.broken,
        deadline_ms: 2000,
        schedule: schedule.clone(),
        rules: rule_infos(),
    });
    let replicate = replicate_from_env();
    history.record(&Entry::Replication {
        t: now_ms(),
        interval_ms: replicate.unwrap_or(DEFAULT_REPLICATE_MS),
    });
    eprintln!(
        "[chaos] replication: {}",
        match replicate {
            Some(0) => "off (--replicate-interval-ms 0)".to_string(),
            Some(ms) => format!("--replicate-interval-ms {ms}"),
            None => format!("the nodes' default ({DEFAULT_REPLICATE_MS} ms)"),
        }
    );
    let mut extra: Vec<String> = lease_args(&history, profile.leases);
    if profile.broken {
        extra.push("--broken-decide-locally".into());
    }
    if let Some(ms) = replicate {
        extra.extend(["--replicate-interval-ms".into(), ms.to_string()]);
    }
    if frames_from_env() {
        eprintln!("[chaos] forwards on framed connections (--forward-frames)");
        extra.push("--forward-frames".into());
    }
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let h = Harness::new(
        dir.clone(),
        RULES,
        &extra,
        ip_prefix,
        history.clone(),
        profile.faults,
    );
    let guard = Guard(h.clone());
    if profile.faults && !h.iptables_ok {
        eprintln!("[chaos] iptables is not usable here: the partition nemesis will be SKIPPED");
    }
    if profile.faults && h.faketime.is_none() {
        eprintln!(
            "[chaos] libfaketime is not installed (Debian's faketime; .ci/deps installs it): \
             the clock-offset nemesis will be SKIPPED"
        );
    }
    let started = Instant::now();
    for _ in 0..profile.nodes {
        let (id, ip) = h.new_identity();
        h.start_node(&id, ip)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let took = h
        .wait_converged(Duration::from_secs(20))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "[chaos] {} nodes converged ({took:?} after the last start)",
        profile.nodes
    );
    h.wait_ready(Duration::from_secs(20))
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let stop_sampler = CancellationToken::new();
    let sampler = harness::spawn_sampler(h.clone(), stop_sampler.clone());
    let stop_clients = CancellationToken::new();
    let cfg = Arc::new(workload::WorkloadConfig {
        clients: profile.clients,
        hot_keys: 4,
        zipf_keys: 200,
        deadline: Duration::from_secs(2),
        window_ms: 2000,
        // With leases on, a quarter of the ops go to one whale key: hot at every entry
        // node, so that its owner lends it all the time.
        whale: if profile.leases.is_some_and(|n| n > 0) {
            0.25
        } else {
            0.0
        },
        routes: vec![
            ("GET /fw".into(), 60),
            ("GET /log".into(), 25),
            ("GET /tb".into(), 15),
            ("GET /fence".into(), 10),
        ],
    });
    let clients = workload::spawn(h.clone(), cfg, seed, stop_clients.clone());
    let phase = |name: &str, edge: &str, faults: bool| {
        eprintln!("[chaos] phase {name} {edge}");
        history.record(&Entry::Phase {
            t: now_ms(),
            name: name.into(),
            edge: edge.into(),
            faults,
        });
    };

    phase("fault-free-1", "start", false);
    tokio::time::sleep(profile.fault_free).await;
    phase("fault-free-1", "end", false);

    if profile.faults {
        phase("chaos", "start", true);
        let chaos_start = Instant::now();
        let mut error = None;
        for (i, step) in steps.iter().enumerate() {
            if let Err(e) = nemesis::run_step(&h, i as u32 + 1, step).await {
                error = Some(e);
                break;
            }
            if profile.name == "long"
                && i + 1 >= profile.events
                && chaos_start.elapsed() >= profile.min_chaos
            {
                break;
            }
        }
        phase("chaos", "end", true);
        if let Some(e) = error {
            stop_clients.cancel();
            history.flush();
            panic!(
                "nemesis step failed: {e}\nseed={seed}\nschedule: {schedule:?}\nhistory: {}",
                history_path.display()
            );
        }
        let agreed = h.wait_converged(Duration::from_secs(10)).await;
        eprintln!("[chaos] after the last heal: {agreed:?}");
        // A node restarted by the last steps may still be restoring its keys' replicas
        // (it refuses forwarded checks until then): the fault-free phase starts once
        // every node is ready, as traffic would behind a readiness probe.
        let ready = h.wait_ready(Duration::from_secs(10)).await;
        eprintln!("[chaos] every node ready: {ready:?}");
        tokio::time::sleep(Duration::from_millis(1000)).await;
        phase("fault-free-2", "start", false);
        tokio::time::sleep(profile.fault_free).await;
        phase("fault-free-2", "end", false);
    }

    stop_clients.cancel();
    for c in clients {
        let _ = c.await;
    }
    for (id, _) in h.running() {
        let _ = h.scrape(&id).await;
    }
    stop_sampler.cancel();
    let _ = sampler.await;
    for entry in h.ledger() {
        history.record(&entry);
    }
    history.flush();
    let logs = h.logs();
    drop(guard);
    eprintln!(
        "[chaos] run took {:?}; checking {}",
        started.elapsed(),
        history_path.display()
    );

    let entries = history::load(&history_path);
    let report = checker::check_with(&entries, check_options());
    eprintln!(
        "\n==== summary: profile={} seed={seed} history={} ====",
        profile.name,
        history_path.display()
    );
    eprintln!("{}", report.summary);
    eprintln!("{}", report.details(5));
    Outcome {
        report,
        seed,
        schedule,
        history: history_path,
        logs,
    }
}

/// The nodes' `--replicate-interval-ms` when the run does not set it.
const DEFAULT_REPLICATE_MS: u64 = 50;

/// `RINGLIMIT_CHAOS_REPLICATE`: the interval to start the nodes with (`None`: their
/// default).
fn replicate_from_env() -> Option<u64> {
    std::env::var("RINGLIMIT_CHAOS_REPLICATE").ok().map(|s| {
        s.trim()
            .parse()
            .expect("RINGLIMIT_CHAOS_REPLICATE must be a whole number of ms (0: off)")
    })
}

/// The nodes' budget-lease arguments (`--lease-threshold` from the profile, or the
/// nodes' default, passed explicitly so a `RINGLIMIT_LEASE_THRESHOLD` in the
/// environment cannot change a run behind the history's back), and with leases on the
/// history's `leases` line.
fn lease_args(history: &History, leases: Option<u64>) -> Vec<String> {
    let threshold = leases.unwrap_or(ringlimit::shard::budget::DEFAULT_LEASE_THRESHOLD);
    eprintln!(
        "[chaos] budget leases: --lease-threshold {threshold}{} (TTL {LEASE_TTL_MS} ms)",
        if leases.is_none() {
            " (the nodes' default)"
        } else {
            ""
        }
    );
    if threshold == 0 {
        return vec!["--lease-threshold".into(), "0".into()];
    }
    history.record(&Entry::Leases {
        t: now_ms(),
        threshold,
        ttl_ms: LEASE_TTL_MS,
        ledger: true,
    });
    vec![
        "--lease-threshold".into(),
        threshold.to_string(),
        "--lease-ttl-ms".into(),
        LEASE_TTL_MS.to_string(),
    ]
}

/// The nodes' `--lease-ttl-ms` when leases are on (their default).
const LEASE_TTL_MS: u64 = 1000;

/// `RINGLIMIT_CHAOS_LEASES`: the `--lease-threshold` (checks/s of one counter at one
/// entry node) to start the nodes with (`None`: their default,
/// `DEFAULT_LEASE_THRESHOLD`; 0: off).
fn leases_from_env() -> Option<u64> {
    std::env::var("RINGLIMIT_CHAOS_LEASES").ok().map(|s| {
        s.trim()
            .parse()
            .expect("RINGLIMIT_CHAOS_LEASES must be a whole number of checks/s (0: off)")
    })
}

/// `RINGLIMIT_CHAOS_FRAMES=1`: start the nodes with `--forward-frames` (forwarded batches
/// on framed connections instead of the HTTP/2 stream), so one seed compares the two.
fn frames_from_env() -> bool {
    std::env::var("RINGLIMIT_CHAOS_FRAMES")
        .ok()
        .is_some_and(|s| matches!(s.trim(), "1" | "true" | "yes"))
}

/// `RINGLIMIT_CHAOS_ASSERT_REPLICATED=1|0`: force S3-replicated on or off.
fn check_options() -> checker::Options {
    let assert_replicated = std::env::var("RINGLIMIT_CHAOS_ASSERT_REPLICATED")
        .ok()
        .map(|s| matches!(s.trim(), "1" | "true" | "yes"));
    checker::Options { assert_replicated }
}

/// How long the long profile injects faults: `RINGLIMIT_CHAOS_MINUTES` (default 10).
fn chaos_minutes() -> u64 {
    match std::env::var("RINGLIMIT_CHAOS_MINUTES") {
        Ok(s) => s
            .trim()
            .parse()
            .expect("RINGLIMIT_CHAOS_MINUTES must be a whole number of minutes"),
        Err(_) => 10,
    }
}

/// The long profile's `--lease-threshold` (checks/s of one counter at one entry node)
/// unless `RINGLIMIT_CHAOS_LEASES` says otherwise (0: leases off).
const LONG_LEASE_THRESHOLD: u64 = 5;

fn chaos_profile() -> Profile {
    if std::env::var("RINGLIMIT_CHAOS").as_deref() == Ok("long") {
        let minutes = chaos_minutes();
        Profile {
            name: "long",
            nodes: 5,
            // About one step per 15 s: the time bound, not the list, ends the run.
            events: (minutes as usize * 4).max(40),
            min_chaos: Duration::from_secs(minutes * 60),
            fault_free: Duration::from_secs(10),
            clients: 16,
            broken: false,
            faults: true,
            // Budget leases under every nemesis: a threshold the whale key and the hot
            // keys cross at this profile's load (the nodes' default, 100 checks/s, is
            // more than 16 clients send one key on this machine).
            leases: Some(leases_from_env().unwrap_or(LONG_LEASE_THRESHOLD)),
        }
    } else {
        Profile {
            name: "short",
            nodes: 3,
            events: 6,
            min_chaos: Duration::ZERO,
            fault_free: Duration::from_secs(8),
            clients: 12,
            broken: false,
            faults: true,
            leases: leases_from_env(),
        }
    }
}

// Each test has its own runtime; the lock only keeps two clusters from loading the
// 2-core machine at once, so holding it across awaits cannot deadlock.
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let seed = seed_from_env();
    let out = run(chaos_profile(), seed).await;
    assert!(
        out.report.total() == 0,
        "chaos run found {} violation(s):\n{}\n{}\n{}",
        out.report.total(),
        out.report.details(10),
        out.report.summary,
        out.repro()
    );
}

/// The short profile with budget leases on (issue 24: the chaos suite passes with
/// leases on): `RINGLIMIT_CHAOS_LEASES` or 3 checks/s, at which the whale key is lent
/// at every entry node (and now and then a hot key).
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn short_profile_with_budget_leases() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let seed = seed_from_env();
    let profile = Profile {
        name: "short-leases",
        nodes: 3,
        events: 6,
        min_chaos: Duration::ZERO,
        fault_free: Duration::from_secs(8),
        clients: 12,
        broken: false,
        faults: true,
        leases: Some(leases_from_env().filter(|n| *n > 0).unwrap_or(3)),
    };
    let out = run(profile, seed).await;
    let leased = out
        .report
        .summary
        .lines()
        .find(|l| l.contains("budget leases"));
    eprintln!("[leases] {}", leased.unwrap_or("no lease row"));
    assert!(
        out.report.total() == 0,
        "chaos run with leases found {} violation(s):\n{}\n{}\n{}",
        out.report.total(),
        out.report.details(10),
        out.report.summary,
        out.repro()
    );
}

/// A cluster where every node decides every key itself: the checkers must flag it.
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_broken_cluster_is_flagged() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let seed = seed_from_env();
    let profile = Profile {
        name: "negative-control",
        nodes: 3,
        events: 0,
        min_chaos: Duration::ZERO,
        fault_free: Duration::from_secs(12),
        clients: 12,
        broken: true,
        faults: false,
        leases: None,
    };
    let out = run(profile, seed).await;
    let s5 = out.report.count("S5");
    let owner = out.report.count("S3-owner");
    eprintln!(
        "[negative control] S5 violations: {s5}, S3-owner violations: {owner} (both must be > 0)"
    );
    assert!(
        s5 > 0 && owner > 0,
        "the checkers did not flag a --broken-decide-locally cluster (S5: {s5}, S3-owner: {owner})\n{}",
        out.repro()
    );
}

/// Re-check a history file offline: `RINGLIMIT_CHAOS_RECHECK=path cargo test --test
/// jepsen-like recheck -- --nocapture`. Does nothing without the variable.
#[test]
fn recheck_history_file() {
    let Ok(path) = std::env::var("RINGLIMIT_CHAOS_RECHECK") else {
        return;
    };
    let entries = history::load(std::path::Path::new(&path));
    let report = checker::check_with(&entries, check_options());
    eprintln!("{}\n{}", report.summary, report.details(20));
    assert_eq!(report.total(), 0, "violations in {path}");
}
