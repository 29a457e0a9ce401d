//! The history parsed once: `Parsed` holds the entries as records (ops by id, ring
//! samples, nemesis events, phases, exits, metric scrapes); `Context` borrows it and adds
//! the groupings the properties share (fixed-window ops per (key, window) and per
//! decider, in-doubt charges per window, every node's ring views).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::RangeInclusive;

use crate::history::{Entry, MemberView, RuleInfo};

use super::clocks::Clocks;
use super::leases::{Leases, Ledger, Lent};
use super::views::Views;

/// The facts of an `ok` answer.
#[derive(Clone, Debug)]
pub struct Answer {
    pub allowed: bool,
    pub limit: u64,
    pub remaining: u64,
    pub decider: String,
    pub generation: u64,
    pub window_id: Option<u64>,
    pub sequence: u64,
    pub degraded: bool,
    pub hops: u32,
    /// A fail-over decision: the key's successor decided it on its replica while the
    /// owner could not be reached (`Parsed::parse` tells it from a fallback).
    pub failover: bool,
    /// Decided by the entry node from a budget lease the decider (the owner) granted:
    /// an admission the owner charged when it granted the lease; sequence 0, 0 hops.
    pub leased: bool,
}

impl Answer {
    /// Fail-open fallback decision (a sequence number of the entry node's shard);
    /// deny-cache and fail-closed answers carry sequence 0.
    pub fn fallback(&self) -> bool {
        self.degraded && self.sequence > 0 && !self.failover
    }

    /// Decided on a counter of the key itself: by an owner's shard (not degraded) or by
    /// the successor's replica (fail-over), never on a stand-in or a cache.
    pub fn decides(&self) -> bool {
        !self.degraded || self.failover
    }

    /// The decider identity: node id and generation.
    pub fn decider_id(&self) -> Decider {
        (self.decider.clone(), self.generation)
    }

    /// The fail-open stand-in counter this fallback answer was decided on.
    pub fn stand_in(&self) -> StandIn {
        StandIn {
            node: self.decider.clone(),
            generation: self.generation,
            limit: self.limit,
        }
    }
}

/// The fail-open stand-in counters of an entry node (one generation) that share one
/// limit. Each ring size has a counter of its own (`<rule>~fallback/<nodes>`, finding
/// 7), and two ring sizes may share a limit (10 / 5 and ⌊10 / 4⌋ are both 2), while an
/// answer names only the base rule and the limit: `Context::stand_in_sizes` tells how
/// many counters may lie behind one.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct StandIn {
    pub node: String,
    pub generation: u64,
    pub limit: u64,
}

#[derive(Clone, Debug)]
pub enum Outcome {
    Ok(Answer),
    Fail,
    Info,
    /// Invoked, never completed in the history.
    Pending,
}

/// One operation: its invoke line and, once known, its completion.
#[derive(Clone, Debug)]
pub struct Op {
    pub id: u64,
    pub invoke: u64,
    /// `u64::MAX` while pending.
    pub complete: u64,
    pub key: String,
    pub route: String,
    pub cost: u64,
    /// The entry node the client asked.
    pub node: String,
    pub outcome: Outcome,
}

impl Op {
    pub fn ok(&self) -> Option<&Answer> {
        match &self.outcome {
            Outcome::Ok(a) => Some(a),
            _ => None,
        }
    }
    /// Outcome unknown: `info`, or never completed.
    pub fn is_info(&self) -> bool {
        matches!(self.outcome, Outcome::Info | Outcome::Pending)
    }
}

/// One ring sample of one node.
#[derive(Clone, Debug)]
pub struct Sample {
    pub t: u64,
    pub round: u64,
    pub node: String,
    /// The node answered `Status`.
    pub ok: bool,
    pub members: Vec<MemberView>,
    pub digest: u64,
}

/// One nemesis step, from its `start` / `end` (heal) / `settled` lines.
#[derive(Clone, Debug)]
pub struct NemesisEvent {
    pub n: u32,
    pub kind: String,
    pub victim: String,
    pub start: u64,
    pub end: u64,
    pub settled: u64,
    pub skipped: bool,
    /// A partition's start line is written once its rules are in; the cut began this
    /// long before (its detail says "… in X ms").
    pub cut_ms: u64,
}

/// A phase between its `start` and `end` lines.
#[derive(Clone, Debug)]
pub struct Phase {
    pub name: String,
    pub start: u64,
    pub end: u64,
    pub faults: bool,
}

/// A node process that exited (`how`: "kill -9", "sigterm", ...).
#[derive(Clone, Debug)]
pub struct Exit {
    pub t: u64,
    pub node: String,
    pub generation: u64,
    pub how: String,
}

/// A node process that started (its ready line was read at `t`).
#[derive(Clone, Debug)]
pub struct Spawn {
    pub t: u64,
    pub node: String,
    pub generation: u64,
}

/// The last metric scrape of one incarnation.
#[derive(Clone, Copy, Debug)]
pub struct Scrape {
    pub resets: u64,
    pub restarts: u64,
}

/// The history as records, in the order the properties read them.
pub struct Parsed {
    pub rules: Vec<RuleInfo>,
    pub deadline_ms: u64,
    /// By op id.
    pub ops: Vec<Op>,
    /// By (time, node).
    pub samples: Vec<Sample>,
    /// By step number.
    pub events: Vec<NemesisEvent>,
    /// In the order they ended.
    pub phases: Vec<Phase>,
    pub exits: Vec<Exit>,
    /// (node, generation) → its last scrape.
    pub metrics: HashMap<(String, u64), Scrape>,
    /// Every node's clock offsets (the clock-offset nemesis).
    pub clocks: Clocks,
    pub spawns: Vec<Spawn>,
    /// The nodes' `--replicate-interval-ms` (the `replication` line); `None` without one.
    pub replicate_interval_ms: Option<u64>,
    /// The nodes' `--lease-threshold` and lease TTL (the `leases` line); `None`: no
    /// budget leases in the run.
    pub leases: Option<(u64, u64)>,
    /// Every grant and return of the run, when the history has the nodes' lease ledger
    /// (the `leases` line says so); `None`: unknown.
    pub ledger: Option<Ledger>,
    /// The largest clock offset (either way) the clock-offset nemesis set, in ms.
    pub max_clock_offset_ms: u64,
}

/// Whether a degraded answer with a sequence number is a fail-over decision rather than
/// a fail-open fallback. Both come from a shard, so the wire tells them apart only by
/// the limit: a fallback decides on a stand-in counter with the entry node's share of
/// the rule (`max(limit / ring size, 1)`, the same share of a token bucket's capacity),
/// a fail-over on the key's replica with the rule's own numbers (`RuleInfo::burst`: the
/// limit the answer names, a token bucket's capacity). A share equals the whole only on
/// a ring of one member, and a node alone on its ring owns every key, so it never
/// fails open.
fn is_failover(a: &Answer, rule: Option<&RuleInfo>) -> bool {
    a.degraded && a.sequence > 0 && rule.is_some_and(|r| a.limit == r.burst && r.burst > 1)
}

impl Parsed {
    pub fn parse(entries: &[Entry]) -> Parsed {
        let mut rules = Vec::new();
        let mut deadline_ms = 2000;
        let mut ops: BTreeMap<u64, Op> = BTreeMap::new();
        let mut samples = Vec::new();
        let mut events: BTreeMap<u32, NemesisEvent> = BTreeMap::new();
        let mut phases = Vec::new();
        let mut phase_open: HashMap<String, u64> = HashMap::new();
        let mut exits = Vec::new();
        let mut metrics = HashMap::new();
        let mut clocks = Clocks::default();
        let mut spawns = Vec::new();
        let mut replicate_interval_ms = None;
        let mut leases = None;
        let mut ledger: Option<Ledger> = None;
        let (mut lent, mut returned) = (Vec::new(), Vec::new());
        let mut max_clock_offset_ms = 0u64;
        for e in entries {
            match e {
                Entry::Meta {
                    rules: r,
                    deadline_ms: d,
                    ..
                } => {
                    rules = r.clone();
                    deadline_ms = *d;
                }
                Entry::Invoke {
                    id,
                    t,
                    key,
                    route,
                    cost,
                    node,
                    ..
                } => {
                    ops.insert(
                        *id,
                        Op {
                            id: *id,
                            invoke: *t,
                            complete: u64::MAX,
                            key: key.clone(),
                            route: route.clone(),
                            cost: *cost,
                            node: node.clone(),
                            outcome: Outcome::Pending,
                        },
                    );
                }
                Entry::Ok {
                    id,
                    t,
                    allowed,
                    limit,
                    remaining,
                    decider,
                    generation,
                    window_id,
                    sequence,
                    degraded,
                    hops,
                    leased,
                    ..
                } => {
                    if let Some(op) = ops.get_mut(id) {
                        op.complete = *t;
                        let mut answer = Answer {
                            allowed: *allowed,
                            limit: *limit,
                            remaining: *remaining,
                            decider: decider.clone(),
                            generation: *generation,
                            window_id: *window_id,
                            sequence: *sequence,
                            degraded: *degraded,
                            hops: *hops,
                            failover: false,
                            leased: *leased,
                        };
                        answer.failover =
                            is_failover(&answer, rules.iter().find(|r| r.route == op.route));
                        op.outcome = Outcome::Ok(answer);
                    }
                }
                Entry::Fail { id, t, .. } => {
                    if let Some(op) = ops.get_mut(id) {
                        op.complete = *t;
                        op.outcome = Outcome::Fail;
                    }
                }
                Entry::Info { id, t, .. } => {
                    if let Some(op) = ops.get_mut(id) {
                        op.complete = *t;
                        op.outcome = Outcome::Info;
                    }
                }
                Entry::Ring {
                    t,
                    round,
                    node,
                    ok,
                    members,
                    digest,
                    ..
                } => samples.push(Sample {
                    t: *t,
                    round: *round,
                    node: node.clone(),
                    ok: *ok,
                    members: members.clone(),
                    digest: *digest,
                }),
                Entry::Nemesis {
                    t,
                    n,
                    kind,
                    victim,
                    edge,
                    detail,
                } => {
                    let ev = events.entry(*n).or_insert(NemesisEvent {
                        n: *n,
                        kind: kind.clone(),
                        victim: victim.clone(),
                        start: *t,
                        end: *t,
                        settled: *t,
                        skipped: false,
                        cut_ms: 0,
                    });
                    match edge.as_str() {
                        "start" => {
                            ev.start = *t;
                            ev.cut_ms = detail
                                .rsplit_once(" in ")
                                .and_then(|(_, ms)| ms.strip_suffix(" ms"))
                                .and_then(|ms| ms.parse().ok())
                                .unwrap_or(0);
                        }
                        "end" => ev.end = *t,
                        "settled" => ev.settled = *t,
                        "skipped" => ev.skipped = true,
                        _ => {}
                    }
                }
                Entry::Clock { t, node, offset_ms } => {
                    max_clock_offset_ms = max_clock_offset_ms.max(offset_ms.unsigned_abs());
                    clocks.record(node, *t, *offset_ms)
                }
                Entry::Phase {
                    t,
                    name,
                    edge,
                    faults,
                } => {
                    if edge == "start" {
                        phase_open.insert(name.clone(), *t);
                    } else if let Some(start) = phase_open.remove(name) {
                        phases.push(Phase {
                            name: name.clone(),
                            start,
                            end: *t,
                            faults: *faults,
                        });
                    }
                }
                Entry::Exit {
                    t,
                    node,
                    generation,
                    how,
                } => exits.push(Exit {
                    t: *t,
                    node: node.clone(),
                    generation: *generation,
                    how: how.clone(),
                }),
                Entry::Metrics {
                    node,
                    generation,
                    resets,
                    restarts,
                    ..
                } => {
                    metrics.insert(
                        (node.clone(), *generation),
                        Scrape {
                            resets: *resets,
                            restarts: *restarts,
                        },
                    );
                }
                Entry::Spawn {
                    t,
                    node,
                    generation,
                    ..
                } => spawns.push(Spawn {
                    t: *t,
                    node: node.clone(),
                    generation: *generation,
                }),
                Entry::Replication { interval_ms, .. } => {
                    replicate_interval_ms = Some(*interval_ms);
                }
                Entry::Leases {
                    threshold,
                    ttl_ms,
                    ledger: with_ledger,
                    ..
                } => {
                    leases = Some((*threshold, *ttl_ms));
                    if *with_ledger {
                        ledger.get_or_insert_with(Ledger::default);
                    }
                }
                Entry::Lent {
                    node,
                    generation,
                    key,
                    route,
                    counter,
                    serial,
                    units,
                    window,
                    sequence,
                    ..
                } => lent.push(Lent {
                    owner: (node.clone(), *generation),
                    key: key.clone(),
                    route: route.clone(),
                    counter: *counter,
                    serial: *serial,
                    units: *units,
                    window: *window,
                    sequence: *sequence,
                }),
                Entry::Returned {
                    node,
                    generation,
                    counter,
                    serial,
                    units,
                    sequence,
                    ..
                } => {
                    let lease = ((node.clone(), *generation), *counter, *serial);
                    returned.push((lease, *units, *sequence));
                }
            }
        }
        samples.sort_by_key(|s: &Sample| (s.t, s.node.clone()));
        if let Some(ledger) = &mut ledger {
            ledger.record(lent, returned);
        }
        Parsed {
            rules,
            deadline_ms,
            ops: ops.into_values().collect(),
            samples,
            events: events.into_values().collect(),
            phases,
            exits,
            metrics,
            clocks,
            spawns,
            replicate_interval_ms,
            leases,
            ledger,
            max_clock_offset_ms,
        }
    }
}

/// A decider: node id and generation.
pub type Decider = (String, u64);
/// An op with its answer.
pub type Answered<'a> = (&'a Op, &'a Answer);
/// One decider's answers per key.
pub type PerKey<'a> = BTreeMap<&'a str, Vec<Answered<'a>>>;

/// The fixed-window ops that may belong to one (key, window).
pub struct Window<'a> {
    /// Answers naming this window, and ops of unknown outcome whose time span covers it.
    pub ops: Vec<&'a Op>,
    /// The answers among them (every one names this window).
    pub answers: Vec<Answered<'a>>,
    /// The non-degraded answers: decided by an owner's shard.
    pub decided: Vec<Answered<'a>>,
    /// The fail-over answers: decided by the key's successor on its replica.
    pub failovers: Vec<Answered<'a>>,
    /// Distinct deciders (node id, generation) of non-degraded and fail-over answers:
    /// D of S3. A successor deciding fail-over checks is one decider more, as an owner
    /// is: it decides on one counter of its own, its replica, which it promotes into
    /// its live key (merged) when the ring gives it the key, and a fail-over check of
    /// a key it already holds live goes on that live count. So its fail-over and owner
    /// decisions together share one budget of L.
    pub deciders: BTreeSet<Decider>,
    /// Cost admitted per fail-open stand-in counter.
    pub fallbacks: BTreeMap<StandIn, u64>,
}

/// What every property reads: the parsed history plus its shared groupings.
pub struct Context<'a> {
    pub deadline_ms: u64,
    pub ops: &'a [Op],
    pub samples: &'a [Sample],
    pub events: &'a [NemesisEvent],
    pub phases: &'a [Phase],
    pub exits: &'a [Exit],
    pub spawns: &'a [Spawn],
    /// The nodes' `--replicate-interval-ms`; `None`: the history does not say (off).
    pub replicate_interval_ms: Option<u64>,
    pub metrics: &'a HashMap<(String, u64), Scrape>,
    pub clocks: &'a Clocks,
    /// The fixed window rule's limit L and window W (ms).
    pub l: u64,
    pub w: u64,
    pub sliding_log: Option<&'a RuleInfo>,
    pub token_bucket: Option<&'a RuleInfo>,
    /// Every node's ring views, rebuilt from the samples.
    pub views: Views,
    /// Ops on the fixed window route, by id.
    pub fw_ops: Vec<&'a Op>,
    /// Budget leases: which counters may have been lent from when (off: none).
    pub leases: Leases,
    /// (key, window) → the fixed-window ops that may belong there.
    pub windows: BTreeMap<(String, u64), Window<'a>>,
    /// (key, window) → fixed-window charges in doubt there (see `late_charge`).
    pub doubt: BTreeMap<(String, u64), Vec<&'a Op>>,
    /// Decider (owner or fail-over successor) → key → its fixed-window answers in
    /// sequence order (not the leased ones: they have no sequence number).
    pub by_decider: BTreeMap<Decider, PerKey<'a>>,
}

impl<'a> Context<'a> {
    pub fn new(p: &'a Parsed) -> Context<'a> {
        let rule = |alg: &str| p.rules.iter().find(|r| r.algorithm == alg);
        let fw = rule("fixed_window").expect("a fixed_window rule in the meta line");
        let (l, w) = (fw.limit, fw.window_ms);
        let fw_ops: Vec<&Op> = p.ops.iter().filter(|o| o.route == fw.route).collect();

        let mut ops_by_window: BTreeMap<(String, u64), Vec<&Op>> = BTreeMap::new();
        for op in &fw_ops {
            let wins = match &op.outcome {
                // An answer without a window id belongs nowhere (S2 reports it).
                Outcome::Ok(a) => match a.window_id {
                    Some(win) => win..=win,
                    None => continue,
                },
                Outcome::Info | Outcome::Pending => {
                    candidate_windows(op, w, p.deadline_ms, &p.clocks)
                }
                Outcome::Fail => continue,
            };
            for win in wins {
                ops_by_window
                    .entry((op.key.clone(), win))
                    .or_default()
                    .push(op);
            }
        }
        let windows = ops_by_window
            .into_iter()
            .map(|((key, win), ops)| {
                let window = Window::new(ops, win);
                ((key, win), window)
            })
            .collect();

        let mut doubt: BTreeMap<(String, u64), Vec<&Op>> = BTreeMap::new();
        for op in &fw_ops {
            // A fail-over answer is in doubt like a fallback: the forward to the owner
            // timed out but may still be applied there, and what the successor admits
            // is pushed to the owner as a delta and merged into its count.
            if op.is_info() || op.ok().is_some_and(|a| a.fallback() || a.failover) {
                let late = late_charge(op, &p.events, p.deadline_ms);
                let (first, last) = (p.clocks.earliest(op.invoke, late), p.clocks.latest(late));
                for win in (first / w)..=(last / w) {
                    doubt.entry((op.key.clone(), win)).or_default().push(op);
                }
            }
        }

        // A successor's fail-over answers join its own sequence: they are decided on its
        // replica, which becomes (or already is) the live key it decides as owner.
        // Leased answers are not in it: they carry no sequence number of their own (the
        // decision that counted their units was the owner's grant, not in the history).
        let mut by_decider: BTreeMap<Decider, PerKey> = BTreeMap::new();
        for op in &fw_ops {
            if let Some(a) = op.ok().filter(|a| a.decides() && !a.leased) {
                by_decider
                    .entry(a.decider_id())
                    .or_default()
                    .entry(op.key.as_str())
                    .or_default()
                    .push((op, a));
            }
        }
        for answers in by_decider.values_mut().flat_map(|keys| keys.values_mut()) {
            // Stable: answers that share a sequence number stay in op id order.
            answers.sort_by_key(|(_, a)| a.sequence);
        }

        Context {
            deadline_ms: p.deadline_ms,
            ops: &p.ops,
            samples: &p.samples,
            events: &p.events,
            phases: &p.phases,
            exits: &p.exits,
            spawns: &p.spawns,
            replicate_interval_ms: p.replicate_interval_ms,
            leases: Leases::new(p),
            metrics: &p.metrics,
            clocks: &p.clocks,
            l,
            w,
            sliding_log: rule("sliding_window_log"),
            token_bucket: rule("token_bucket"),
            views: Views::build(&p.samples),
            fw_ops,
            windows,
            doubt,
            by_decider,
        }
    }

    /// Nemesis steps that really ran.
    pub fn faults(&self) -> impl Iterator<Item = &'a NemesisEvent> {
        self.events.iter().filter(|e| !e.skipped)
    }

    /// The ring sizes whose stand-in counters `s`'s answers in window `win` may come
    /// from, each a counter with `s.limit` of its own: every size with that share (L /
    /// nodes) the node was sampled with from 3 s before the window to 3 s after. Count
    /// at least one counter.
    pub fn stand_in_sizes(&self, win: u64, s: &StandIn) -> BTreeSet<u64> {
        let (from, to) = (
            (win * self.w).saturating_sub(3_000),
            (win + 1) * self.w + 3_000,
        );
        self.samples
            .iter()
            .filter(|x| x.ok && x.node == s.node && x.t >= from && x.t <= to)
            .map(|x| x.members.iter().filter(|m| !m.leaving).count() as u64)
            .filter(|&n| n > 0 && (self.l / n).max(1) == s.limit)
            .collect()
    }

    /// The most `s`'s answers in window `win` may admit: its limit once per stand-in
    /// counter behind them (`stand_in_sizes`, at least one).
    pub fn stand_in_budget(&self, win: u64, s: &StandIn) -> u64 {
        s.limit * self.stand_in_sizes(win, s).len().max(1) as u64
    }
}

impl<'a> Window<'a> {
    fn new(ops: Vec<&'a Op>, win: u64) -> Window<'a> {
        let answers: Vec<(&Op, &Answer)> = ops
            .iter()
            .filter_map(|o| o.ok().map(|a| (*o, a)))
            .filter(|(_, a)| a.window_id == Some(win))
            .collect();
        let decided: Vec<(&Op, &Answer)> = answers
            .iter()
            .copied()
            .filter(|(_, a)| !a.degraded)
            .collect();
        let failovers: Vec<(&Op, &Answer)> = answers
            .iter()
            .copied()
            .filter(|(_, a)| a.failover)
            .collect();
        let deciders = decided
            .iter()
            .chain(&failovers)
            .map(|(_, a)| a.decider_id())
            .collect();
        let mut fallbacks: BTreeMap<StandIn, u64> = BTreeMap::new();
        for (o, a) in answers.iter().filter(|(_, a)| a.fallback()) {
            let admitted = fallbacks.entry(a.stand_in()).or_insert(0);
            if a.allowed {
                *admitted += o.cost;
            }
        }
        Window {
            ops,
            answers,
            decided,
            failovers,
            deciders,
            fallbacks,
        }
    }
}

/// The windows an op of unknown outcome may have been charged in: from its invoke until
/// it completed (at most 10 deadlines later).
/// The windows an op without an answer may have been charged in: on the decider's
/// clock, which the clock-offset nemesis may have set ahead or behind.
fn candidate_windows(op: &Op, w: u64, deadline_ms: u64, clocks: &Clocks) -> RangeInclusive<u64> {
    let last = op.complete.min(op.invoke + 10 * deadline_ms);
    (clocks.earliest(op.invoke, last) / w)..=(clocks.latest(last) / w)
}

/// Until when a charge in doubt may still land. In doubt: an `info` op, or a fail-open
/// fallback answer (its forward timed out at the entry node, but the owner may still
/// apply it later: a paused owner on resume, a partitioned one when TCP retransmits
/// after the heal). The owner charges it in the window of *its* clock when it applies
/// it, so the candidate windows reach past the fault that stalled it.
fn late_charge(op: &Op, events: &[NemesisEvent], deadline_ms: u64) -> u64 {
    let mut t = op.complete.min(op.invoke + 10 * deadline_ms) + 1000;
    for e in events.iter().filter(|e| !e.skipped) {
        if e.start.saturating_sub(1000) <= op.complete && op.invoke <= e.settled {
            t = t.max(e.settled + (e.end - e.start) + 3000);
        }
    }
    t
}
