//! Checkers. They read only the history (the JSON-lines file) and report, per
//! property, every violation found plus the numbers of the summary table.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

/// One ring sample: (time ms, round, node id, answered, members, digest).
type Sample = (u64, u64, String, bool, Vec<MemberView>, u64);

use ringlimit::ring::Ring;

use crate::history::{Entry, MemberView, RuleInfo};

/// How far (ms) around an op a ring view still counts for the ownership clause of S3:
/// the failure detection window (~1.3 s) plus gossip and sampling slack.
pub const VIEW_SLACK_MS: u64 = 3000;
/// After the last heal, every ring must agree within this many ms.
pub const RING_AGREE_MS: u64 = 5000;

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
}

impl Answer {
    /// Fail-open fallback decision (a sequence number of the entry node's shard);
    /// deny-cache and fail-closed answers carry sequence 0.
    pub fn fallback(&self) -> bool {
        self.degraded && self.sequence > 0
    }
}

#[derive(Clone, Debug)]
pub enum Outcome {
    Ok(Answer),
    Fail,
    Info,
    Pending,
}

#[derive(Clone, Debug)]
pub struct Op {
    pub id: u64,
    pub invoke: u64,
    pub complete: u64,
    pub key: String,
    pub route: String,
    pub cost: u64,
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
    pub fn is_info(&self) -> bool {
        matches!(self.outcome, Outcome::Info | Outcome::Pending)
    }
}

#[derive(Default)]
pub struct Report {
    /// Property → violation messages.
    pub violations: BTreeMap<&'static str, Vec<String>>,
    pub warnings: Vec<String>,
    pub summary: String,
    pub ring_agree_ms: Option<u64>,
}

impl Report {
    fn violate(&mut self, property: &'static str, message: String) {
        self.violations.entry(property).or_default().push(message);
    }
    pub fn count(&self, property: &str) -> usize {
        self.violations.get(property).map_or(0, Vec::len)
    }
    pub fn total(&self) -> usize {
        self.violations.values().map(Vec::len).sum()
    }
    /// Up to `per` messages per property.
    pub fn details(&self, per: usize) -> String {
        let mut out = String::new();
        for (p, msgs) in &self.violations {
            let _ = writeln!(out, "  {p}: {} violation(s)", msgs.len());
            for m in msgs.iter().take(per) {
                let _ = writeln!(out, "    - {m}");
            }
        }
        for w in &self.warnings {
            let _ = writeln!(out, "  {w}");
        }
        out
    }
}

pub const PROPERTIES: [&str; 14] = [
    "S1-fw",
    "S1-fallback",
    "S1-log",
    "S1-tb",
    "S2",
    "S3-bound",
    "S3-owner",
    "S4",
    "S5",
    "S6",
    "AVAIL-deadline",
    "AVAIL-rings",
    "AVAIL-unfaulted",
    "OBS",
];

struct NemesisEvent {
    n: u32,
    kind: String,
    victim: String,
    start: u64,
    end: u64,
    settled: u64,
    skipped: bool,
}

/// A run of identical ring samples of one node, valid over [lo, hi].
/// Longest gap between two ring samples of one node (the sampler runs every ~200 ms).
const SAMPLE_GAP_MS: u64 = 400;

struct ViewRun {
    node: String,
    lo: u64,
    hi: u64,
    digest: u64,
    members: BTreeSet<String>,
}

fn ring_of(members: &[MemberView]) -> BTreeSet<String> {
    members
        .iter()
        .filter(|m| !m.leaving)
        .map(|m| m.id.clone())
        .collect()
}

pub fn check(entries: &[Entry]) -> Report {
    let mut report = Report::default();
    let mut rules: Vec<RuleInfo> = Vec::new();
    let mut deadline_ms = 2000;
    let mut ops: BTreeMap<u64, Op> = BTreeMap::new();
    let mut samples: Vec<(u64, u64, String, bool, Vec<MemberView>, u64)> = Vec::new();
    let mut events: BTreeMap<u32, NemesisEvent> = BTreeMap::new();
    let mut phases: Vec<(String, u64, u64, bool)> = Vec::new();
    let mut phase_open: HashMap<String, u64> = HashMap::new();
    let mut exits: Vec<(u64, String, u64, String)> = Vec::new();
    let mut metrics: HashMap<(String, u64), (u64, u64, u64)> = HashMap::new();
    let mut last_t = 0;
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
                last_t = last_t.max(*t);
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
                ..
            } => {
                last_t = last_t.max(*t);
                if let Some(op) = ops.get_mut(id) {
                    op.complete = *t;
                    op.outcome = Outcome::Ok(Answer {
                        allowed: *allowed,
                        limit: *limit,
                        remaining: *remaining,
                        decider: decider.clone(),
                        generation: *generation,
                        window_id: *window_id,
                        sequence: *sequence,
                        degraded: *degraded,
                        hops: *hops,
                    });
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
            } => {
                samples.push((*t, *round, node.clone(), *ok, members.clone(), *digest));
            }
            Entry::Nemesis {
                t,
                n,
                kind,
                victim,
                edge,
                ..
            } => {
                let ev = events.entry(*n).or_insert(NemesisEvent {
                    n: *n,
                    kind: kind.clone(),
                    victim: victim.clone(),
                    start: *t,
                    end: *t,
                    settled: *t,
                    skipped: false,
                });
                match edge.as_str() {
                    "start" => ev.start = *t,
                    "end" => ev.end = *t,
                    "settled" => ev.settled = *t,
                    "skipped" => ev.skipped = true,
                    _ => {}
                }
            }
            Entry::Phase {
                t,
                name,
                edge,
                faults,
            } => {
                if edge == "start" {
                    phase_open.insert(name.clone(), *t);
                } else if let Some(s) = phase_open.remove(name) {
                    phases.push((name.clone(), s, *t, *faults));
                }
            }
            Entry::Exit {
                t,
                node,
                generation,
                how,
            } => exits.push((*t, node.clone(), *generation, how.clone())),
            Entry::Metrics {
                node,
                generation,
                resets,
                restarts,
                fail_open,
                ..
            } => {
                metrics.insert(
                    (node.clone(), *generation),
                    (*resets, *restarts, *fail_open),
                );
            }
            Entry::Spawn { .. } => {}
        }
    }
    let ops: Vec<Op> = ops.into_values().collect();
    let rule = |alg: &str| rules.iter().find(|r| r.algorithm == alg).cloned();
    let fw = rule("fixed_window").expect("a fixed_window rule in the meta line");
    let (l, w) = (fw.limit, fw.window_ms);
    let events: Vec<NemesisEvent> = events.into_values().collect();

    // ---------- ring views ----------
    samples.sort_by_key(|s| (s.0, s.2.clone()));
    let mut by_node: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, s) in samples.iter().enumerate() {
        by_node.entry(s.2.clone()).or_default().push(i);
    }
    let mut runs: Vec<ViewRun> = Vec::new();
    for (node, idx) in &by_node {
        let mut prev_t: Option<u64> = None;
        let mut current: Option<ViewRun> = None;
        for &i in idx {
            let (t, _, _, ok, members, digest) = &samples[i];
            if *ok {
                match &mut current {
                    Some(run) if run.digest == *digest => run.hi = *t,
                    _ => {
                        if let Some(mut run) = current.take() {
                            run.hi = *t;
                            runs.push(run);
                        }
                        current = Some(ViewRun {
                            node: node.clone(),
                            lo: prev_t.unwrap_or(t.saturating_sub(200)),
                            hi: *t,
                            digest: *digest,
                            members: ring_of(members),
                        });
                    }
                }
            } else if let Some(run) = &mut current {
                // Not answering (paused, dead): it still believes what it last said.
                run.hi = *t;
            }
            prev_t = Some(*t);
        }
        if let Some(mut run) = current.take() {
            run.hi = u64::MAX / 2;
            runs.push(run);
        }
    }
    let mut rings: HashMap<u64, Ring> = HashMap::new();
    for run in &runs {
        rings
            .entry(run.digest)
            .or_insert_with(|| Ring::new(run.members.iter().cloned(), Ring::DEFAULT_VNODES));
        let r = &rings[&run.digest];
        if r.digest() != run.digest {
            report.warnings.push(format!(
                "WARNING (harness): ring rebuilt from {}'s sampled members {:?} has digest {:016x}, node reported {:016x}",
                run.node,
                run.members,
                r.digest(),
                run.digest
            ));
        }
    }
    // Between two samples a node may pass through views nobody sampled: gossip reveals
    // members one at a time (a healed partition, a restart). Every member set between
    // the two sampled ones (common ⊆ S ⊆ union) is a view the node may have routed by.
    let mut transitions: Vec<(u64, u64, Ring)> = Vec::new();
    for pair in runs.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if a.node != b.node {
            continue;
        }
        let common: BTreeSet<String> = a.members.intersection(&b.members).cloned().collect();
        let changed: Vec<String> = a
            .members
            .symmetric_difference(&b.members)
            .cloned()
            .collect();
        if changed.is_empty() || changed.len() > 6 {
            continue;
        }
        for mask in 1..(1u32 << changed.len()) - 1 {
            let mut members = common.clone();
            for (i, m) in changed.iter().enumerate() {
                if mask & (1 << i) != 0 {
                    members.insert(m.clone());
                }
            }
            transitions.push((
                a.hi.min(b.lo),
                b.lo.max(a.hi) + SAMPLE_GAP_MS,
                Ring::new(members, Ring::DEFAULT_VNODES),
            ));
        }
    }
    let owner_ok = |key: &str, decider: &str, lo: u64, hi: u64| -> bool {
        let overlaps = |from: u64, to: u64| {
            from.saturating_sub(VIEW_SLACK_MS) <= hi && lo <= to.saturating_add(VIEW_SLACK_MS)
        };
        runs.iter().any(|run| {
            overlaps(run.lo, run.hi) && rings[&run.digest].owner(key.as_bytes()) == Some(decider)
        }) || transitions.iter().any(|(from, to, ring)| {
            overlaps(*from, *to) && ring.owner(key.as_bytes()) == Some(decider)
        })
    };

    // ---------- S6 routing + S3 ownership clause, all routes ----------
    for op in &ops {
        let Some(a) = op.ok() else { continue };
        if a.hops > 1 {
            report.violate("S6", format!("op {} answered after {} hops", op.id, a.hops));
        }
        if !a.degraded {
            if a.hops == 0 && a.decider != op.node {
                report.violate(
                    "S6",
                    format!(
                        "op {}: 0 hops but decided by {} (asked {})",
                        op.id, a.decider, op.node
                    ),
                );
            }
            if a.hops == 1 && a.decider == op.node {
                report.violate(
                    "S6",
                    format!(
                        "op {}: 1 hop but decided by the node asked ({})",
                        op.id, op.node
                    ),
                );
            }
            if !owner_ok(&op.key, &a.decider, op.invoke, op.complete) {
                report.violate(
                    "S3-owner",
                    format!(
                        "op {} key {} route {}: decider {}@{} was never the key's owner in any node's ring view within ±{} ms of [{}, {}]",
                        op.id, op.key, op.route, a.decider, a.generation, VIEW_SLACK_MS, op.invoke, op.complete
                    ),
                );
            }
        } else if a.allowed && !(a.fallback() && a.decider == op.node) {
            report.violate(
                "S6",
                format!(
                    "op {}: a degraded admission that is not the entry node's fail-open fallback",
                    op.id
                ),
            );
        }
    }

    // ---------- availability: deadline ----------
    for op in &ops {
        if matches!(op.outcome, Outcome::Pending) {
            report.violate(
                "AVAIL-deadline",
                format!("op {} (invoked at {}) never completed", op.id, op.invoke),
            );
        } else if op.complete.saturating_sub(op.invoke) > deadline_ms + 1000 {
            report.violate(
                "AVAIL-deadline",
                format!(
                    "op {} took {} ms (deadline {deadline_ms})",
                    op.id,
                    op.complete - op.invoke
                ),
            );
        }
    }

    // ---------- fixed window: S1, S1-fallback, S2, S3-bound, S4 ----------
    let fw_ops: Vec<&Op> = ops.iter().filter(|o| o.route == fw.route).collect();
    let cand = |op: &Op| -> std::ops::RangeInclusive<u64> {
        (op.invoke / w)..=(op.complete.min(op.invoke + 10 * deadline_ms) / w)
    };
    // (key, window) → ops that may belong there.
    let mut kw: BTreeMap<(String, u64), Vec<&Op>> = BTreeMap::new();
    for op in &fw_ops {
        match &op.outcome {
            Outcome::Ok(a) => {
                let Some(win) = a.window_id else {
                    report.violate(
                        "S2",
                        format!("op {}: fixed window answer without window id", op.id),
                    );
                    continue;
                };
                if !(win * w <= op.complete && (win + 1) * w > op.invoke.saturating_sub(1)) {
                    report.violate(
                        "S2",
                        format!(
                            "op {}: window id {win} outside the op's time span [{}, {}]",
                            op.id, op.invoke, op.complete
                        ),
                    );
                }
                kw.entry((op.key.clone(), win)).or_default().push(op);
            }
            Outcome::Info | Outcome::Pending => {
                for win in cand(op) {
                    kw.entry((op.key.clone(), win)).or_default().push(op);
                }
            }
            Outcome::Fail => {}
        }
    }
    // In-doubt charges: an `info` op, or a fail-open fallback answer (its forward timed
    // out at the entry node, but the owner may still apply it later: a paused owner on
    // resume, a partitioned one when TCP retransmits after the heal). The owner charges
    // it in the window of *its* clock when it applies it, so the candidate windows
    // reach past the fault that stalled it.
    let late = |op: &Op| -> u64 {
        let mut t = op.complete.min(op.invoke + 10 * deadline_ms) + 1000;
        for e in events.iter().filter(|e| !e.skipped) {
            if e.start.saturating_sub(1000) <= op.complete && op.invoke <= e.settled {
                t = t.max(e.settled + (e.end - e.start) + 3000);
            }
        }
        t
    };
    let mut doubt: BTreeMap<(String, u64), Vec<&Op>> = BTreeMap::new();
    for op in &fw_ops {
        if op.is_info() || op.ok().is_some_and(|a| a.fallback()) {
            for win in (op.invoke / w)..=(late(op) / w) {
                doubt.entry((op.key.clone(), win)).or_default().push(op);
            }
        }
    }
    let mut max_deciders = 0usize;
    let mut worst_excess: (i64, String) = (i64::MIN, String::new());
    let mut over_windows = 0usize;
    let mut admitted_fw = 0u64;
    for ((key, win), list) in &kw {
        let oks: Vec<(&Op, &Answer)> = list
            .iter()
            .filter_map(|o| o.ok().map(|a| (*o, a)))
            .filter(|(_, a)| a.window_id == Some(*win))
            .collect();
        let nd: Vec<(&Op, &Answer)> = oks.iter().copied().filter(|(_, a)| !a.degraded).collect();
        let deciders: BTreeSet<(String, u64)> = nd
            .iter()
            .map(|(_, a)| (a.decider.clone(), a.generation))
            .collect();
        max_deciders = max_deciders.max(deciders.len());
        // S1 per decider.
        for d in &deciders {
            let admitted: u64 = nd
                .iter()
                .filter(|(_, a)| a.allowed && (&a.decider, a.generation) == (&d.0, d.1))
                .map(|(o, _)| o.cost)
                .sum();
            if admitted > l {
                let ids: Vec<u64> = nd
                    .iter()
                    .filter(|(_, a)| a.allowed && a.decider == d.0 && a.generation == d.1)
                    .map(|(o, _)| o.id)
                    .collect();
                report.violate("S1-fw", format!("key {key} window {win}: decider {}@{} admitted {admitted} > L={l} (ops {ids:?})", d.0, d.1));
            }
        }
        // S1 for fail-open fallback counters.
        let mut fallbacks: BTreeMap<(String, u64, u64), u64> = BTreeMap::new();
        for (o, a) in oks.iter().filter(|(_, a)| a.fallback()) {
            let e = fallbacks
                .entry((a.decider.clone(), a.generation, a.limit))
                .or_insert(0);
            if a.allowed {
                *e += o.cost;
            }
        }
        for ((d, g, lim), admitted) in &fallbacks {
            if admitted > lim || *lim > l {
                report.violate("S1-fallback", format!("key {key} window {win}: fallback of {d}@{g} admitted {admitted} with fallback limit {lim} (L={l})"));
            }
        }
        // S3 bound.
        let total: u64 = oks
            .iter()
            .filter(|(_, a)| a.allowed && (!a.degraded || a.fallback()))
            .map(|(o, _)| o.cost)
            .sum();
        admitted_fw += total;
        let bound =
            l * deciders.len() as u64 + fallbacks.keys().map(|(_, _, lim)| *lim).sum::<u64>();
        if total > bound {
            report.violate(
                "S3-bound",
                format!("key {key} window {win}: admitted {total} > bound {bound} (L={l} × D={} + fallbacks {:?})", deciders.len(), fallbacks),
            );
        }
        let excess = total as i64 - l as i64;
        if excess > 0 {
            over_windows += 1;
        }
        if excess > worst_excess.0 {
            worst_excess = (
                excess,
                format!(
                    "key {key} window {win}: {total} admitted, bound {bound}, D={}",
                    deciders.len()
                ),
            );
        }
        // S4: no false deny.
        let infos: Vec<&Op> = doubt.get(&(key.clone(), *win)).cloned().unwrap_or_default();
        for (o, a) in &oks {
            if a.allowed {
                continue;
            }
            if !a.degraded {
                let admitted: u64 = nd
                    .iter()
                    .filter(|(x, b)| b.allowed && x.invoke <= o.complete)
                    .map(|(x, _)| x.cost)
                    .sum();
                let doubt: u64 = infos
                    .iter()
                    .filter(|x| x.invoke <= o.complete && x.id != o.id)
                    .map(|x| x.cost)
                    .sum();
                if admitted + doubt + o.cost <= l {
                    report.violate(
                        "S4",
                        format!("op {} key {key} window {win}: denied cost {} by {}@{} although at most {admitted} admitted + {doubt} in doubt (L={l})", o.id, o.cost, a.decider, a.generation),
                    );
                }
            } else if a.fallback() {
                let admitted: u64 = oks
                    .iter()
                    .filter(|(x, b)| {
                        b.allowed
                            && b.fallback()
                            && b.decider == a.decider
                            && b.generation == a.generation
                            && b.limit == a.limit
                            && x.invoke <= o.complete
                    })
                    .map(|(x, _)| x.cost)
                    .sum();
                let doubt: u64 = infos
                    .iter()
                    .filter(|x| x.is_info() && x.node == o.node && x.invoke <= o.complete)
                    .map(|x| x.cost)
                    .sum();
                if admitted + doubt + o.cost <= a.limit {
                    report.violate("S4", format!("op {} key {key} window {win}: fallback denied cost {} with {admitted} admitted + {doubt} in doubt of fallback limit {}", o.id, o.cost, a.limit));
                }
            } else {
                // Deny cache (or fail-closed): needs an earlier denial seen by this entry node.
                let justified = list.iter().any(|x| {
                    x.node == o.node
                        && x.invoke <= o.complete
                        && x.id != o.id
                        && (x.is_info()
                            || x.ok().is_some_and(|b| {
                                !b.allowed
                                    && !b.degraded
                                    && b.hops == 1
                                    && b.window_id == Some(*win)
                                    && x.cost <= o.cost
                            }))
                });
                if !justified {
                    report.violate("S4", format!("op {} key {key} window {win}: cached denial (cost {}) without an earlier denial of cost ≤ it through {}", o.id, o.cost, o.node));
                }
            }
        }
    }

    // S2: per decider, by sequence.
    let quiet = |win: u64| -> bool {
        let (lo, hi) = ((win * w).saturating_sub(5000), (win + 1) * w + 1000);
        !events
            .iter()
            .any(|e| e.start <= hi && e.settled + 2000 >= lo)
    };
    let mut by_decider: BTreeMap<(String, u64), Vec<(&Op, &Answer)>> = BTreeMap::new();
    let mut seqs: HashMap<(String, u64), HashMap<u64, u64>> = HashMap::new();
    for op in &ops {
        let Some(a) = op.ok() else { continue };
        if (!a.degraded || a.fallback()) && a.sequence > 0 {
            if let Some(other) = seqs
                .entry((a.decider.clone(), a.generation))
                .or_default()
                .insert(a.sequence, op.id)
            {
                report.violate(
                    "S2",
                    format!(
                        "ops {other} and {}: decider {}@{} used sequence {} twice",
                        op.id, a.decider, a.generation, a.sequence
                    ),
                );
            }
        }
    }
    for op in &fw_ops {
        if let Some(a) = op.ok() {
            if !a.degraded {
                by_decider
                    .entry((a.decider.clone(), a.generation))
                    .or_default()
                    .push((op, a));
            }
        }
    }
    let info_windows: BTreeSet<(String, u64)> = doubt.keys().cloned().collect();
    for ((d, g), list) in by_decider.iter_mut() {
        list.sort_by_key(|(_, a)| a.sequence);
        let mut per_key: BTreeMap<&str, Vec<(&Op, &Answer)>> = BTreeMap::new();
        for (o, a) in list.iter() {
            per_key.entry(o.key.as_str()).or_default().push((o, a));
        }
        for (key, answers) in per_key {
            let mut prev: Option<(&Op, &Answer)> = None;
            let mut used = 0u64;
            for (o, a) in answers {
                let win = a.window_id.unwrap_or(0);
                if a.remaining > l
                    || (a.allowed && a.remaining + o.cost > l)
                    || (!a.allowed && a.remaining >= o.cost)
                {
                    report.violate(
                        "S2",
                        format!(
                            "op {}: {}@{} answered allowed={} remaining={} for cost {} (L={l})",
                            o.id, d, g, a.allowed, a.remaining, o.cost
                        ),
                    );
                }
                let same_window = prev.is_some_and(|(_, p)| p.window_id == a.window_id);
                if let Some((po, p)) = prev {
                    if p.window_id > a.window_id {
                        report.violate(
                            "S2",
                            format!(
                                "ops {} → {}: {}@{} key {key}: window id went back {:?} → {:?}",
                                po.id, o.id, d, g, p.window_id, a.window_id
                            ),
                        );
                    }
                    if same_window {
                        let spent = if a.allowed { o.cost } else { 0 };
                        if a.remaining + spent > p.remaining {
                            report.violate("S2", format!("ops {} → {}: {}@{} key {key} window {win}: remaining {} → {} with {} spent", po.id, o.id, d, g, p.remaining, a.remaining, spent));
                        }
                    }
                }
                if !same_window {
                    used = 0;
                }
                // Exact replay where nothing can have interfered.
                if quiet(win) && !info_windows.contains(&(key.to_string(), win)) {
                    let expect_allowed = used + o.cost <= l;
                    if expect_allowed {
                        used += o.cost;
                    }
                    if a.allowed != expect_allowed || a.remaining != l - used {
                        report.violate(
                            "S2",
                            format!("op {}: {}@{} key {key} window {win}: answered allowed={} remaining={}, the model says allowed={expect_allowed} remaining={}", o.id, d, g, a.allowed, a.remaining, l - used),
                        );
                        used = l - a.remaining.min(l);
                    }
                } else if a.allowed {
                    used += o.cost;
                }
                prev = Some((o, a));
            }
        }
    }

    // ---------- sliding log and token bucket: per decider over time ----------
    for (alg, rinfo) in [
        ("sliding_window_log", rule("sliding_window_log")),
        ("token_bucket", rule("token_bucket")),
    ] {
        let Some(r) = rinfo else { continue };
        let mut per: BTreeMap<(String, u64, String), Vec<&Op>> = BTreeMap::new();
        for op in ops.iter().filter(|o| o.route == r.route) {
            if let Some(a) = op.ok() {
                if !a.degraded && a.allowed {
                    per.entry((a.decider.clone(), a.generation, op.key.clone()))
                        .or_default()
                        .push(op);
                }
            }
        }
        for ((d, g, key), mut list) in per {
            list.sort_by_key(|o| o.ok().map(|a| a.sequence));
            let n = list.len();
            for i in 0..n {
                let mut sum = 0u64;
                for j in i..n {
                    sum += list[j].cost;
                    let span = list[j].complete.saturating_sub(list[i].invoke);
                    if alg == "sliding_window_log" {
                        if span + 1 < r.window_ms && sum > r.limit {
                            report.violate("S1-log", format!("{d}@{g} key {key}: ops {}..{} admitted {sum} > L={} within {span} ms < W={}", list[i].id, list[j].id, r.limit, r.window_ms));
                            break;
                        }
                    } else {
                        let refill = (r.limit * span).div_ceil(r.window_ms);
                        if sum > r.burst + refill {
                            report.violate("S1-tb", format!("{d}@{g} key {key}: ops {}..{} admitted {sum} > burst {} + refill {refill} over ≤ {span} ms", list[i].id, list[j].id, r.burst));
                            break;
                        }
                    }
                }
            }
        }
    }

    // ---------- S5: exactness in fault-free phases ----------
    let mut s5_windows = 0usize;
    for (name, ps, pe, faults) in &phases {
        if *faults {
            continue;
        }
        for ((key, win), list) in &kw {
            if win * w < *ps || (win + 1) * w > *pe {
                continue;
            }
            s5_windows += 1;
            if let Some(o) = list.iter().find(|o| o.is_info()) {
                report.violate("S5", format!("phase {name}: key {key} window {win}: op {} has an unknown outcome in a fault-free phase", o.id));
                continue;
            }
            let mut nd: Vec<(&Op, &Answer)> = list
                .iter()
                .filter_map(|o| o.ok().map(|a| (*o, a)))
                .filter(|(_, a)| !a.degraded && a.window_id == Some(*win))
                .collect();
            let deciders: BTreeSet<(String, u64)> = nd
                .iter()
                .map(|(_, a)| (a.decider.clone(), a.generation))
                .collect();
            if deciders.len() > 1 {
                report.violate(
                    "S5",
                    format!(
                        "phase {name}: key {key} window {win}: {} deciders {:?} with no fault",
                        deciders.len(),
                        deciders
                    ),
                );
                continue;
            }
            if let Some(o) = list
                .iter()
                .find(|o| o.ok().is_some_and(|a| a.degraded && a.allowed))
            {
                report.violate("S5", format!("phase {name}: key {key} window {win}: op {} admitted degraded with no fault", o.id));
            }
            nd.sort_by_key(|(_, a)| a.sequence);
            let mut used = 0;
            let demand: u64 = nd.iter().map(|(o, _)| o.cost).sum();
            for (o, a) in &nd {
                let expect = used + o.cost <= l;
                if expect {
                    used += o.cost;
                }
                if a.allowed != expect || a.remaining != l - used {
                    report.violate("S5", format!("phase {name}: op {} key {key} window {win}: allowed={} remaining={}, exact model: allowed={expect} remaining={} (demand {demand})", o.id, a.allowed, a.remaining, l - used));
                    break;
                }
            }
        }
    }

    // ---------- availability: rings agree after the last heal ----------
    let last_heal = events.iter().filter(|e| !e.skipped).map(|e| e.end).max();
    if let Some(heal) = last_heal {
        let mut rounds: BTreeMap<u64, Vec<&Sample>> = BTreeMap::new();
        for s in samples.iter().filter(|s| s.0 >= heal) {
            rounds.entry(s.1).or_default().push(s);
        }
        let agreed = rounds.values().find(|round| {
            let nodes: BTreeSet<String> = round.iter().map(|s| s.2.clone()).collect();
            round
                .iter()
                .all(|s| s.3 && s.5 == round[0].5 && ring_of(&s.4) == nodes)
        });
        match agreed {
            Some(round) => {
                let t = round[0].0.saturating_sub(heal);
                report.ring_agree_ms = Some(t);
                if t > RING_AGREE_MS {
                    report.violate(
                        "AVAIL-rings",
                        format!("rings agreed only {t} ms after the last heal (> {RING_AGREE_MS})"),
                    );
                }
            }
            None => report.violate(
                "AVAIL-rings",
                "rings never agreed after the last heal".into(),
            ),
        }
    }

    // ---------- availability of keys the nemesis did not touch ----------
    let agreed_ring_at = |t: u64, before: bool| -> Option<&Ring> {
        let mut rounds: BTreeMap<u64, Vec<&Sample>> = BTreeMap::new();
        for s in samples.iter().filter(|s| {
            if before {
                s.0 < t && s.0 + 10_000 > t
            } else {
                s.0 > t && s.0 < t + 10_000
            }
        }) {
            rounds.entry(s.1).or_default().push(s);
        }
        let pick = |round: &Vec<&Sample>| round.iter().all(|s| s.3 && s.5 == round[0].5);
        let found = if before {
            rounds.values().rev().find(|r| pick(r))
        } else {
            rounds.values().find(|r| pick(r))
        };
        found.and_then(|r| rings.get(&r[0].5))
    };
    let mut unavailable: Vec<(String, f64, usize, usize)> = Vec::new();
    for (i, e) in events.iter().enumerate() {
        if e.skipped {
            continue;
        }
        let until = events.get(i + 1).map_or(e.settled + 2000, |n| n.start);
        let before = agreed_ring_at(e.start, true);
        let after = agreed_ring_at(e.settled, false);
        let mut slots = BTreeSet::new();
        let (mut bad, mut degraded) = (0, 0);
        for op in ops
            .iter()
            .filter(|o| o.invoke >= e.start && o.invoke <= until)
        {
            let hurt = match &op.outcome {
                Outcome::Ok(a) => a.fallback(),
                _ => true,
            };
            if hurt {
                slots.insert(op.complete.min(op.invoke + deadline_ms) / 100);
            }
            if let (Some(b), Some(a)) = (before, after) {
                let owner = b.owner(op.key.as_bytes());
                let untouched = op.node != e.victim
                    && owner != Some(e.victim.as_str())
                    && owner == a.owner(op.key.as_bytes());
                if untouched && op.invoke <= e.settled {
                    match &op.outcome {
                        Outcome::Ok(a) if a.fallback() => degraded += 1,
                        Outcome::Ok(_) => {}
                        _ => {
                            bad += 1;
                            report.violate("AVAIL-unfaulted", format!("nemesis #{} {} {}: op {} (key {} owned by {:?}, asked {}) failed or timed out", e.n, e.kind, e.victim, op.id, op.key, owner, op.node));
                        }
                    }
                }
            }
        }
        unavailable.push((
            format!("#{} {} {}", e.n, e.kind, e.victim),
            slots.len() as f64 / 10.0,
            bad,
            degraded,
        ));
    }

    // ---------- observability ----------
    let mut extra_same_id = 0u64;
    let mut extra_other = 0u64;
    for (t, node, gen, how) in exits.iter().filter(|x| x.3 == "kill -9") {
        let _ = how;
        let lost: BTreeSet<(&str, &str)> = ops
            .iter()
            .filter(|o| o.complete <= *t && o.complete + 4000 > *t)
            .filter(|o| {
                o.ok()
                    .is_some_and(|a| !a.degraded && a.decider == *node && a.generation == *gen)
            })
            .map(|o| (o.key.as_str(), o.route.as_str()))
            .collect();
        for (key, route) in lost {
            let next = ops
                .iter()
                .filter(|o| {
                    o.key == key && o.route == route && o.invoke >= *t && o.invoke < t + 8000
                })
                .filter_map(|o| o.ok())
                .find(|a| !a.degraded);
            if let Some(a) = next {
                if a.decider == *node && a.generation != *gen {
                    extra_same_id += 1;
                } else if a.decider != *node {
                    extra_other += 1;
                }
            }
        }
    }
    let (resets, restarts): (u64, u64) = metrics
        .values()
        .fold((0, 0), |acc, m| (acc.0 + m.0, acc.1 + m.1));
    if resets + restarts < extra_same_id + extra_other {
        report.warnings.push(format!(
            "WARNING (OBS, product gap, not failed): the nodes' metrics count {resets} ownership resets + {restarts} member restarts = {}, but the history shows {} keys restarted from empty after a crash ({extra_other} on a new owner id, {extra_same_id} on the same id with a new generation). ringlimit_member_restarts_total counts restarts, not the keys they reset, and counters of killed incarnations are only known up to their last scrape.",
            resets + restarts,
            extra_same_id + extra_other
        ));
    }

    // ---------- summary ----------
    let count = |f: &dyn Fn(&Op) -> bool| ops.iter().filter(|o| f(o)).count();
    let ok = count(&|o| o.ok().is_some());
    let fail = count(&|o| matches!(o.outcome, Outcome::Fail));
    let info = count(&|o| o.is_info());
    let admitted = count(&|o| o.ok().is_some_and(|a| a.allowed));
    let degraded = count(&|o| o.ok().is_some_and(|a| a.fallback()));
    let cached = count(&|o| o.ok().is_some_and(|a| a.degraded && !a.fallback()));
    let mut s = String::new();
    let _ = writeln!(s, "| metric | value |");
    let _ = writeln!(s, "|---|---|");
    let _ = writeln!(
        s,
        "| ops (ok / fail / info) | {} ({ok} / {fail} / {info}) |",
        ops.len()
    );
    let _ = writeln!(s, "| admitted ops (all routes) | {admitted} |");
    let _ = writeln!(
        s,
        "| fail-open fallback answers / deny-cache answers | {degraded} / {cached} |"
    );
    let _ = writeln!(
        s,
        "| fixed window: admitted cost / (key, window)s | {admitted_fw} / {} |",
        kw.len()
    );
    let _ = writeln!(s, "| max deciders per (key, window) | {max_deciders} |");
    let _ = writeln!(
        s,
        "| over-admission vs bound | {over_windows} (key, window)s above L; worst: {} |",
        if worst_excess.0 > 0 {
            format!("+{} over L ({})", worst_excess.0, worst_excess.1)
        } else {
            "none".into()
        }
    );
    let _ = writeln!(
        s,
        "| S5 (key, window)s checked in fault-free phases | {s5_windows} |"
    );
    let _ = writeln!(
        s,
        "| rings agree after the last heal | {} |",
        report
            .ring_agree_ms
            .map_or("n/a".into(), |t| format!("{:.1} s", t as f64 / 1000.0))
    );
    let _ = writeln!(
        s,
        "| keys reset after crashes (history) vs metrics | {} vs {} resets + {} restarts |",
        extra_same_id + extra_other,
        resets,
        restarts
    );
    let _ = writeln!(s);
    if !unavailable.is_empty() {
        let _ = writeln!(s, "| nemesis event | seconds with failing or degraded ops | untouched-key ops failed | untouched-key ops degraded |");
        let _ = writeln!(s, "|---|---|---|---|");
        for (name, secs, bad, deg) in &unavailable {
            let _ = writeln!(s, "| {name} | {secs:.1} | {bad} | {deg} |");
        }
        let _ = writeln!(s);
    }
    let _ = writeln!(s, "| property | violations |");
    let _ = writeln!(s, "|---|---|");
    for p in PROPERTIES {
        let _ = writeln!(s, "| {p} | {} |", report.count(p));
    }
    report.summary = s;
    report
}
