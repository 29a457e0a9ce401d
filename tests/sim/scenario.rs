//! One seeded run: boot, a fault-free phase, a chaos phase of nemesis steps, a second
//! fault-free phase, then every checker property on the history. The same shape and
//! faults as the process suite's short profile (`tests/jepsen-like/main.rs`), plus
//! network loss and delay, in simulated time.

use std::sync::Arc;

use ringlimit::config::rules::RuleSet;
use ringlimit::shard::budget::LeasePolicy;

use crate::checker;
use crate::history::Entry;
use crate::link::LinkConfig;
use crate::node::NodeConfig;
use crate::replicated;
use crate::rng::Rng;
use crate::workload::Workload;
use crate::world::{State, World, DEADLINE_MS};

pub use crate::rules::{rule_infos, RULES};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// kill -9, then restart with the same id (new generation, empty memory).
    KillRestart,
    /// SIGSTOP, then SIGCONT: the node wakes up believing what it believed.
    Pause,
    /// One node cut off from every other node, both directions.
    Partition,
    /// One node's wall clock stepped by ±1-3 s, then back.
    ClockOffset,
    /// Node-to-node datagrams lost (TCP segments retransmitted late).
    Loss,
    /// Node-to-node messages delayed by up to a few hundred ms.
    Delay,
    /// A new node joins.
    Add,
    /// kill -9 of a node and of the successor of one of its keys together, then both
    /// restart with their ids: the keys they shared lose their replicas too.
    KillPair,
}

impl Kind {
    const ALL: [Kind; 8] = [
        Kind::KillRestart,
        Kind::Pause,
        Kind::Partition,
        Kind::ClockOffset,
        Kind::Loss,
        Kind::Delay,
        Kind::Add,
        Kind::KillPair,
    ];
    fn name(self) -> &'static str {
        match self {
            Kind::KillRestart => "kill-restart",
            Kind::Pause => "pause",
            Kind::Partition => "partition",
            Kind::ClockOffset => "clock-offset",
            Kind::Loss => "loss",
            Kind::Delay => "delay",
            Kind::Add => "add",
            Kind::KillPair => "kill-pair",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Step {
    kind: Kind,
    victim_pick: u64,
    hold_ms: u64,
    settle_ms: u64,
    offset_s: i64,
    loss: f64,
    delay: (u64, u64),
}

impl Step {
    fn describe(&self) -> String {
        let extra = match self.kind {
            Kind::ClockOffset => format!(" offset={:+}s", self.offset_s),
            Kind::Loss => format!(" loss={:.2}", self.loss),
            Kind::Delay => format!(" delay={}..{}ms", self.delay.0, self.delay.1),
            _ => String::new(),
        };
        format!(
            "{}(victim#{} hold={}ms settle={}ms{extra})",
            self.kind.name(),
            self.victim_pick % 97,
            self.hold_ms,
            self.settle_ms
        )
    }
}

/// The run's shape, drawn from its seed.
pub struct Profile {
    pub nodes: usize,
    pub clients: u32,
    pub fault_free_ms: u64,
    pub steps: Vec<Step>,
}

impl Profile {
    pub fn of(seed: u64, broken: bool) -> Profile {
        let mut rng = Rng::new(seed ^ 0x5349_4D55_4C41_5445);
        let nodes = rng.range(3, 5) as usize;
        let mut steps = Vec::new();
        let mut live = nodes;
        let count = rng.range(2, 3) as usize;
        // The negative control runs without faults, like the process suite's.
        while !broken && steps.len() < count {
            let kind = Kind::ALL[rng.index(Kind::ALL.len())];
            if kind == Kind::Add {
                if live >= 6 {
                    continue;
                }
                live += 1;
            }
            let hold_ms = match kind {
                Kind::KillRestart | Kind::KillPair => rng.range(300, 3000),
                Kind::Pause => rng.range(1500, 3500),
                Kind::Partition => rng.range(2500, 4000),
                Kind::ClockOffset | Kind::Loss | Kind::Delay => rng.range(2000, 4000),
                Kind::Add => 0,
            };
            let magnitude = rng.range(1, 3) as i64;
            let offset_s = if rng.chance(0.5) {
                magnitude
            } else {
                -magnitude
            };
            let lo = rng.range(5, 150);
            steps.push(Step {
                kind,
                victim_pick: rng.next_u64(),
                hold_ms,
                settle_ms: rng.range(1000, 2000),
                offset_s,
                loss: 0.05 + rng.f64() * 0.35,
                delay: (lo, lo + rng.range(10, 300)),
            });
        }
        Profile {
            nodes,
            clients: 6,
            // Long enough to hold a whole 2 s window wherever the phase starts.
            fault_free_ms: if broken { 8000 } else { 4200 },
            steps,
        }
    }
}

impl Profile {
    /// `count` partitions of one node each (victims drawn from `seed`), just long enough
    /// for both sides to drop each other from their views: the cut-off node promotes
    /// the replicas it holds of keys whose owners stay up, and hands them back at the
    /// heal, often inside the window the replica was taken in.
    pub fn partitions(seed: u64, count: usize) -> Profile {
        let mut rng = Rng::new(seed ^ 0x5041_5254);
        let steps = (0..count)
            .map(|_| Step {
                kind: Kind::Partition,
                victim_pick: rng.next_u64(),
                hold_ms: rng.range(1100, 1800),
                settle_ms: rng.range(1000, 2000),
                offset_s: 0,
                loss: 0.0,
                delay: (0, 0),
            })
            .collect();
        Profile {
            nodes: 3,
            clients: 6,
            fault_free_ms: 4200,
            steps,
        }
    }
}

/// What one seed produced.
pub struct Outcome {
    pub seed: u64,
    pub ops: usize,
    pub digest: u64,
    pub report: checker::Report,
    pub schedule: Vec<String>,
    pub history: Vec<Entry>,
    /// S3-replicated's figures.
    pub replicated: replicated::Figures,
    /// Keys handed back, to be joined, by the nodes up at the end (see
    /// `ShardCore::export_back`).
    pub handed_back: u64,
    /// The run itself failed (the cluster never converged where the process suite's
    /// harness would have given up).
    pub errors: Vec<String>,
    /// Wall time spent simulating and checking (for the summary line only).
    pub took: (std::time::Duration, std::time::Duration),
}

impl Outcome {
    pub fn violations(&self) -> usize {
        self.report.total() + self.errors.len()
    }
}

pub fn node_config(broken: bool, seeds: Vec<String>) -> NodeConfig {
    NodeConfig {
        gossip_ms: 200,
        fd_timeout_ms: 1000,
        delta_ms: 100,
        link: LinkConfig::default(),
        broken,
        stall_hold: true,
        seeds,
        replicate_ms: REPLICATE_MS,
        restore_timeout_ms: 3000,
        lease_threshold: lease_threshold(),
        lease_policy: LeasePolicy::default(),
    }
}

/// `--lease-threshold` of the simulated nodes: the process suite's chaos threshold (3
/// checks/s, which the whale key crosses at every entry node and the hot keys now and
/// then), so budget leases run under every fault; `RINGLIMIT_SIM_LEASES=N` sets it
/// (0: off).
pub fn lease_threshold() -> u64 {
    std::env::var("RINGLIMIT_SIM_LEASES")
        .ok()
        .map(|v| {
            v.trim()
                .parse()
                .unwrap_or_else(|_| panic!("RINGLIMIT_SIM_LEASES must be a whole number"))
        })
        .unwrap_or(LEASE_THRESHOLD)
}

/// The default of [`lease_threshold`].
pub const LEASE_THRESHOLD: u64 = 3;

/// The replication interval the simulated nodes run with: the node's default
/// (`--replicate-interval-ms 50`); `RINGLIMIT_SIM_REPLICATE_MS=0` runs without replicas.
pub const REPLICATE_MS: u64 = 50;

/// The interval S3-replicated's loss window is computed with when it is asserted on a
/// run without replication (the negative control): the one operators are told to use.
pub const PROPERTY_REPLICATE_MS: u64 = 50;

fn nemesis(w: &mut World, n: u32, kind: Kind, victim: &str, edge: &str, detail: String) {
    w.log(Entry::Nemesis {
        t: w.now,
        n,
        kind: kind.name().into(),
        victim: victim.into(),
        edge: edge.into(),
        detail,
    });
}

fn phase(w: &mut World, name: &str, edge: &str, faults: bool) {
    w.log(Entry::Phase {
        t: w.now,
        name: name.into(),
        edge: edge.into(),
        faults,
    });
}

/// One nemesis step: inject, hold, heal, wait for convergence, settle.
fn run_step(w: &mut World, n: u32, step: &Step, next_id: &mut usize, errors: &mut Vec<String>) {
    let candidates: Vec<String> = w
        .slots
        .iter()
        .filter(|(_, s)| s.state == State::Up)
        .map(|(id, _)| id.clone())
        .collect();
    let victim = candidates[(step.victim_pick % candidates.len() as u64) as usize].clone();
    let kind = step.kind;
    match kind {
        Kind::KillRestart => {
            let g = w.kill(&victim);
            nemesis(
                w,
                n,
                kind,
                &victim,
                "start",
                format!("killed generation {g}"),
            );
            w.run_for(step.hold_ms);
            w.start_serving(&victim);
            let g = w.node(&victim).map_or(0, |x| x.generation);
            nemesis(
                w,
                n,
                kind,
                &victim,
                "end",
                format!("restarted as generation {g}"),
            );
        }
        Kind::KillPair => kill_pair(w, n, step, &victim),
        Kind::Pause => {
            w.pause(&victim);
            nemesis(w, n, kind, &victim, "start", "SIGSTOP".into());
            w.run_for(step.hold_ms);
            w.resume(&victim);
            nemesis(w, n, kind, &victim, "end", "SIGCONT".into());
        }
        Kind::Partition => {
            w.partition(std::slice::from_ref(&victim));
            nemesis(w, n, kind, &victim, "start", "cut off".into());
            w.run_for(step.hold_ms);
            w.heal();
            nemesis(w, n, kind, &victim, "end", "healed".into());
        }
        Kind::ClockOffset => {
            w.set_offset(&victim, step.offset_s * 1000);
            nemesis(
                w,
                n,
                kind,
                &victim,
                "start",
                format!("wall clock {:+}s", step.offset_s),
            );
            w.run_for(step.hold_ms);
            w.set_offset(&victim, 0);
            nemesis(w, n, kind, &victim, "end", "wall clock +0s".into());
        }
        Kind::Loss => {
            w.net.loss = step.loss;
            nemesis(w, n, kind, "net", "start", format!("loss {:.2}", step.loss));
            w.run_for(step.hold_ms);
            w.net.loss = 0.0;
            nemesis(w, n, kind, "net", "end", "loss 0".into());
        }
        Kind::Delay => {
            w.net.extra = Some(step.delay);
            let d = format!("delay {}..{} ms", step.delay.0, step.delay.1);
            nemesis(w, n, kind, "net", "start", d);
            w.run_for(step.hold_ms);
            w.net.extra = None;
            nemesis(w, n, kind, "net", "end", "delay 0".into());
        }
        Kind::Add => {
            *next_id += 1;
            let id = format!("n{next_id}");
            nemesis(w, n, kind, &id, "start", format!("starting {id}"));
            w.start_serving(&id);
            nemesis(w, n, kind, &id, "end", "joined".into());
        }
    }
    let victim = match kind {
        Kind::Loss | Kind::Delay => "net".to_string(),
        Kind::Add => format!("n{next_id}"),
        _ => victim,
    };
    let converged = w.run_while_not(15_000, World::converged);
    nemesis(
        w,
        n,
        kind,
        &victim,
        "settled",
        format!("converged: {converged:?}"),
    );
    if converged.is_none() {
        errors.push(format!(
            "nemesis #{n}: the cluster did not converge within 15 s"
        ));
    }
    let mut settle = step.settle_ms;
    if kind == Kind::ClockOffset {
        settle = settle.max(step.offset_s.unsigned_abs() * 1000 + 2000);
    }
    w.run_for(settle);
}

/// The `kill-pair` step: `victim` and the successor (on its ring) of the first of the
/// workload's keys it owns, killed together, restarted after the hold.
fn kill_pair(w: &mut World, n: u32, step: &Step, victim: &str) {
    let partner = w.node(victim).and_then(|node| {
        let ring = &node.view.ring;
        let keys = (0..4)
            .map(|i| format!("hot-{i}"))
            .chain((0..200).map(|i| format!("z-{i}")));
        keys.into_iter().find_map(|key| {
            let h = ringlimit::ring::Ring::key_hash(key.as_bytes());
            (ring.owner_of_hash(h) == Some(victim))
                .then(|| ring.successor_of_hash(h).map(String::from))
                .flatten()
        })
    });
    let partner = partner.filter(|p| w.slots.get(p).is_some_and(|s| s.state == State::Up));
    let g = w.kill(victim);
    let detail = match &partner {
        Some(p) => format!("killed generation {g} and its successor {p}@{}", w.kill(p)),
        None => format!("killed generation {g} (no successor up)"),
    };
    nemesis(w, n, Kind::KillPair, victim, "start", detail);
    w.run_for(step.hold_ms);
    w.start_serving(victim);
    if let Some(p) = &partner {
        w.start_serving(p);
    }
    nemesis(w, n, Kind::KillPair, victim, "end", "restarted both".into());
}

/// Run one seed and check its history.
pub fn run(seed: u64, broken: bool) -> Outcome {
    // S3-replicated is asserted whenever the run replicates (the default does).
    run_with(seed, broken, REPLICATE_MS, REPLICATE_MS > 0)
}

/// [`run`] with the replication interval `replicate_ms` (0: no replicas, the
/// negative control of S3-replicated).
/// S3-replicated is asserted when `assert_replicated` (it is what replication promises:
/// on a run without it, only as a negative control).
pub fn run_with(seed: u64, broken: bool, replicate_ms: u64, assert_replicated: bool) -> Outcome {
    run_profile(
        seed,
        Profile::of(seed, broken),
        broken,
        replicate_ms,
        assert_replicated,
    )
}

/// [`run_with`] on a given profile.
pub fn run_profile(
    seed: u64,
    profile: Profile,
    broken: bool,
    replicate_ms: u64,
    assert_replicated: bool,
) -> Outcome {
    let started = std::time::Instant::now();
    let rules = Arc::new(RuleSet::from_toml_str(RULES).expect("the rules parse"));
    let ids: Vec<String> = (1..=profile.nodes).map(|i| format!("n{i}")).collect();
    let seeds = ids.iter().take(3).cloned().collect();
    let mut cfg = node_config(broken, seeds);
    cfg.replicate_ms = replicate_ms;
    let leases = (cfg.lease_threshold, cfg.lease_policy.ttl_ms);
    let mut w = World::new(seed, rules, cfg);
    let schedule: Vec<String> = profile.steps.iter().map(Step::describe).collect();
    let mut errors = Vec::new();
    w.log(Entry::Meta {
        t: w.now,
        seed,
        profile: if broken { "sim-broken" } else { "sim" }.into(),
        broken,
        deadline_ms: DEADLINE_MS,
        schedule: schedule.clone(),
        rules: rule_infos(),
    });
    if leases.0 > 0 {
        w.log(Entry::Leases {
            t: w.now,
            threshold: leases.0,
            ttl_ms: leases.1,
            ledger: true,
        });
    }
    for id in &ids {
        w.start(id);
        let gap = w.rng.range(0, 300);
        w.run_for(gap);
    }
    if w.run_while_not(20_000, World::converged).is_none() {
        errors.push("the cluster did not converge within 20 s of the last start".into());
    }
    for id in &ids {
        w.serve(id);
    }
    w.start_sampler();
    let whale = if leases.0 > 0 { 0.25 } else { 0.0 };
    w.start_clients(
        profile.clients,
        Workload {
            whale,
            ..Workload::standard()
        },
    );
    phase(&mut w, "fault-free-1", "start", false);
    w.run_for(profile.fault_free_ms);
    phase(&mut w, "fault-free-1", "end", false);
    if !profile.steps.is_empty() {
        phase(&mut w, "chaos", "start", true);
        let mut next_id = profile.nodes;
        for (i, step) in profile.steps.iter().enumerate() {
            run_step(&mut w, i as u32 + 1, step, &mut next_id, &mut errors);
        }
        phase(&mut w, "chaos", "end", true);
        w.run_while_not(10_000, World::converged);
        w.run_for(1000);
        phase(&mut w, "fault-free-2", "start", false);
        w.run_for(profile.fault_free_ms);
        phase(&mut w, "fault-free-2", "end", false);
    }
    w.stop_clients();
    w.run_while_not(DEADLINE_MS + 1000, World::clients_idle);
    w.stop_sampler();
    let handed_back = w
        .slots
        .values()
        .filter_map(|s| s.node.as_ref())
        .map(|n| n.stats.handed_back)
        .sum();
    let history = std::mem::take(&mut w.history);
    let digest = digest(&history);
    let ops = history
        .iter()
        .filter(|e| matches!(e, Entry::Invoke { .. }))
        .count();
    let simulated = started.elapsed();
    let mut report = checker::check(&history);
    // The property is what replication promises: its interval is the node default's
    // even when the run replicates nothing (the negative control).
    let interval = if replicate_ms > 0 {
        replicate_ms
    } else {
        PROPERTY_REPLICATE_MS
    };
    // Its re-judging of the shared checkers (a kill-pair's second victim, fail-over ops)
    // applies to every run; its own property only when asserted.
    let replicated = replicated::check(&history, &w.failover_ops, interval, &mut report);
    if !assert_replicated {
        report.violations.remove("S3-replicated");
    }
    Outcome {
        replicated,
        handed_back,
        took: (simulated, started.elapsed() - simulated),
        seed,
        ops,
        digest,
        report,
        schedule,
        history,
        errors,
    }
}

/// xxh3 of the history as JSON lines: equal digests, equal histories.
pub fn digest(history: &[Entry]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3Default::new();
    for e in history {
        h.update(serde_json::to_string(e).expect("serializes").as_bytes());
        h.update(b"\n");
    }
    h.digest()
}
