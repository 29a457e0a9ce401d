//! The whole cluster in a deterministic simulator (issue 22, point 5; docs/chaos.md,
//! "The simulator").
//!
//! N nodes run the real pure pieces of a ringlimit node (shard stores, algorithms,
//! planning, routing policy, deny cache, view and ring, handoff vetting and merging) in
//! one thread, on simulated time and a simulated network, under the faults of the
//! chaos suite: message loss and delay, partitions, kill, restart with the same id,
//! pause, clock offset, join. Each run writes a history of the process suite's `Entry`
//! shape, and every checker property of `tests/jepsen-like` runs on it.
//!
//! - `cargo test --test sim` runs 100 seeds (`RINGLIMIT_SIM_SEEDS=N`: N seeds;
//!   `RINGLIMIT_SIM_SEED=S`: replay seed S; `RINGLIMIT_SIM_BROKEN=1`: the nodes decide
//!   every check locally, which the checkers must flag), asserts that a seed replays to
//!   the same digest, that the broken mode is caught within 20 seeds, and measures a
//!   50-node cluster (`-- --nocapture` prints the figures).
//! - Each seed prints `sim seed=S ops=N digest=HEX violations=V`; a failing seed prints
//!   the command that replays it and writes its history beside the target directory,
//!   where `RINGLIMIT_CHAOS_RECHECK` re-checks it (`cargo test --test jepsen-like recheck`).

#[allow(dead_code)]
#[path = "../jepsen-like/checker/mod.rs"]
mod checker;
#[allow(dead_code)]
#[path = "../jepsen-like/history.rs"]
mod history;
mod link;
mod node;
mod rng;
mod scale;
mod scenario;
mod workload;
mod world;

use std::io::Write;
use std::path::PathBuf;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name} must be a whole number, not {v:?}"))
    })
}

/// Where a failing seed's history goes.
fn history_path(seed: u64, broken: bool) -> PathBuf {
    let name = if broken { "broken" } else { "seed" };
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("sim")
        .join(format!("{name}-{seed}.jsonl"))
}

fn write_history(outcome: &scenario::Outcome, broken: bool) -> PathBuf {
    let path = history_path(outcome.seed, broken);
    std::fs::create_dir_all(path.parent().expect("a directory")).expect("create the directory");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path).expect("create"));
    for e in &outcome.history {
        writeln!(file, "{}", serde_json::to_string(e).expect("serializes")).expect("write");
    }
    path
}

fn line(o: &scenario::Outcome) -> String {
    format!(
        "sim seed={} ops={} digest={:016x} violations={}",
        o.seed,
        o.ops,
        o.digest,
        o.violations()
    )
}

/// Every seed of this run (or the one to replay) must pass every property.
#[test]
fn seeds() {
    let broken = std::env::var("RINGLIMIT_SIM_BROKEN").is_ok_and(|v| v == "1");
    let seeds: Vec<u64> = match env_u64("RINGLIMIT_SIM_SEED") {
        Some(seed) => vec![seed],
        None => (1..=env_u64("RINGLIMIT_SIM_SEEDS").unwrap_or(100)).collect(),
    };
    let started = std::time::Instant::now();
    let mut failed = Vec::new();
    for &seed in &seeds {
        let o = scenario::run(seed, broken);
        println!("{}", line(&o));
        if o.violations() > 0 {
            let path = write_history(&o, broken);
            let replay = format!(
                "{}RINGLIMIT_SIM_SEED={seed} cargo test --test sim seeds -- --nocapture",
                if broken {
                    "RINGLIMIT_SIM_BROKEN=1 "
                } else {
                    ""
                }
            );
            eprintln!(
                "sim seed={seed} FAILED: {} violation(s)\n{}{}\nschedule: {:?}\nhistory: {}\nreplay: {replay}\n{}",
                o.violations(),
                o.report.details(5),
                o.errors.join("\n"),
                o.schedule,
                path.display(),
                o.report.summary
            );
            failed.push((seed, replay));
        }
    }
    println!(
        "sim: {} seed(s) in {:.1} s, {} failed",
        seeds.len(),
        started.elapsed().as_secs_f64(),
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "{} of {} seed(s) found violations; replay with:\n{}",
        failed.len(),
        seeds.len(),
        failed
            .iter()
            .map(|(_, r)| r.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// One seed decides everything: two runs give byte-identical histories.
#[test]
fn a_seed_replays_to_the_same_digest() {
    let seed = env_u64("RINGLIMIT_SIM_SEED").unwrap_or(4242);
    let (a, b) = (scenario::run(seed, false), scenario::run(seed, false));
    assert_eq!(a.history.len(), b.history.len());
    assert_eq!(
        (a.ops, a.digest),
        (b.ops, b.digest),
        "seed {seed} ran twice to different histories"
    );
    assert!(a.ops > 500, "a run makes a real workload ({} ops)", a.ops);
    assert_ne!(a.digest, scenario::run(seed + 1, false).digest);
}

/// The negative control: nodes that decide every check locally (the process suite's
/// `--broken-decide-locally`) must be caught within 20 seeds, by the properties that
/// catch them there (S5 and S3-owner).
#[test]
fn deciding_locally_is_caught_within_20_seeds() {
    let caught = (1..=20).find_map(|seed| {
        let o = scenario::run(seed, true);
        println!("broken {}", line(&o));
        (o.report.count("S5") > 0 && o.report.count("S3-owner") > 0).then_some(seed)
    });
    assert!(
        caught.is_some(),
        "20 seeds of a cluster deciding locally passed S5 and S3-owner"
    );
}
