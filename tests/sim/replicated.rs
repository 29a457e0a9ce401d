//! The successor replicas' properties (issue 23), checked on a simulated history.
//!
//! **S3-replicated.** In a (key, window) whose owner was killed alone (a `kill-restart`
//! step, no other step during the window, and no op answered in it that was in flight
//! during another step), everything acknowledged as
//! admitted (by the dead owner, its successor on the replica, the new owner, the
//! restarted owner, fail-open stand-ins) ≤ L + what the dead owner acknowledged within
//! one replication interval (+ `IN_FLIGHT_MS` for the messages then on the wire)
//! before it died. A `kill-pair` step (owner and successor together) may lose
//! everything: only the old bound (S3-bound) applies there.
//!
//! **Fail-over answers and the shared checker.** The history cannot tell a fail-over
//! answer (degraded, decided on the successor's replica) from a fail-open one (degraded,
//! on the entry node's stand-in counter), and the shared checkers of
//! `tests/jepsen-like` (whose rules S4 and S6 predate fail-over) judge it as a fail-open
//! one: a fail-over denial of a key its owner had filled looks like a stand-in denying
//! with nothing admitted (S4), and a fail-over admission decided by the successor like
//! a degraded admission not made by the entry node (S6). The world knows which ops were
//! answered by fail-over; this module takes the shared checker's S4 and S6 messages
//! about those ops back and judges them by the fail-over rules instead:
//! - S4-failover: a fail-over denial is legal only if everything acknowledged in the
//!   (key, window) before it completed (lent units counted as their owner charged them,
//!   from the owners' ledger), plus every charge in doubt (unanswered ops,
//!   and degraded ones, which their owner may have charged late), plus its cost, is
//!   more than L (the replica holds the owner's count, not a stand-in's).
//! - S6-failover: a fail-over answer took at most one hop.

use std::collections::{BTreeMap, BTreeSet};

use crate::checker::Report;
use crate::history::Entry;

/// Slack on the replication interval for what was on the wire at the owner's death:
/// a replication batch (1-3 ms) and the answers of the last admissions (1-5 ms).
pub const IN_FLIGHT_MS: u64 = 10;

/// How far before a window another step's settling keeps it out of S3-replicated ("the
/// owner crashed alone"): every step is followed by convergence and a settle of 1-2 s
/// before the next one starts, so a step that settled before the window is over.
const ALONE_MS: u64 = 0;

struct Op {
    invoke: u64,
    complete: u64,
    key: String,
    fw: bool,
    cost: u64,
    answer: Option<Ans>,
    doubt: bool,
}

#[derive(Clone)]
struct Ans {
    allowed: bool,
    decider: String,
    generation: u64,
    window: Option<u64>,
    degraded: bool,
    hops: u32,
    /// Decided from a budget lease (its unit was charged by the owner's grant).
    leased: bool,
}

/// Budget leases of the fixed-window rule, from the owners' ledger lines: (key,
/// window) → each grant's (when, units).
///
/// Returns are not subtracted: a return goes to the node that granted the lease, which
/// may have handed the key on since (docs/leases.md: those units are lost, an
/// under-admission), so the history cannot tell whether the count a fail-over read got
/// them back. Counting every grant in full keeps S4-failover from flagging a denial the
/// lost units explain; it is laxer by at most the units returned.
#[derive(Default)]
struct Lending {
    grants: BTreeMap<(String, u64), Vec<(u64, u64)>>,
}

impl Lending {
    /// Units of (`key`, `win`) that grants had charged by `t`.
    fn lent(&self, key: &str, win: u64, t: u64) -> u64 {
        self.grants.get(&(key.to_string(), win)).map_or(0, |g| {
            g.iter().filter(|(at, _)| *at <= t).map(|(_, u)| u).sum()
        })
    }
}

struct Step {
    kind: String,
    victim: String,
    start: u64,
    settled: u64,
}

/// What S3-replicated saw, for the summary line.
#[derive(Default, Debug, Clone, Copy)]
pub struct Figures {
    /// (key, window)s of an owner killed alone, with admissions by it.
    pub checked: usize,
    /// Of them, admitted above L, and the worst excess.
    pub over_l: usize,
    pub worst: i64,
    /// Admissions the bound allowed as lost (the owner's last interval), summed.
    pub lost: u64,
    /// Kills checked (owner alone) and pair kills skipped.
    pub kills: usize,
    pub pair_kills: usize,
    /// Shared-checker messages about fail-over ops taken back and re-judged.
    pub rejudged: usize,
}

/// Check the properties above on `history`, whose fail-over answers are `failover_ops`,
/// adding violations to `report`.
pub fn check(
    history: &[Entry],
    failover_ops: &BTreeSet<u64>,
    interval_ms: u64,
    report: &mut Report,
) -> Figures {
    let mut figures = Figures::default();
    let (mut l, mut w, mut fw_route) = (10, 2000, String::from("GET /fw"));
    let mut ops: BTreeMap<u64, Op> = BTreeMap::new();
    let mut steps: BTreeMap<u32, Step> = BTreeMap::new();
    let mut kills: Vec<(u64, String, u64)> = Vec::new();
    let mut lending = Lending::default();
    for e in history {
        match e {
            Entry::Meta { rules, .. } => {
                if let Some(r) = rules.iter().find(|r| r.algorithm == "fixed_window") {
                    (l, w, fw_route) = (r.limit, r.window_ms, r.route.clone());
                }
            }
            Entry::Invoke {
                id,
                t,
                key,
                route,
                cost,
                ..
            } => {
                ops.insert(
                    *id,
                    Op {
                        invoke: *t,
                        complete: u64::MAX,
                        key: key.clone(),
                        fw: *route == fw_route,
                        cost: *cost,
                        answer: None,
                        doubt: true,
                    },
                );
            }
            Entry::Ok {
                id,
                t,
                allowed,
                decider,
                generation,
                window_id,
                degraded,
                hops,
                leased,
                ..
            } => {
                if let Some(op) = ops.get_mut(id) {
                    op.complete = *t;
                    op.doubt = false;
                    op.answer = Some(Ans {
                        allowed: *allowed,
                        decider: decider.clone(),
                        generation: *generation,
                        window: *window_id,
                        degraded: *degraded,
                        hops: *hops,
                        leased: *leased,
                    });
                }
            }
            Entry::Lent {
                t,
                key,
                route,
                units,
                window: Some(win),
                ..
            } if *route == fw_route => lending
                .grants
                .entry((key.clone(), *win))
                .or_default()
                .push((*t, *units)),
            Entry::Fail { id, t, .. } => {
                if let Some(op) = ops.get_mut(id) {
                    op.complete = *t;
                    op.doubt = false;
                }
            }
            Entry::Info { id, t, .. } => {
                if let Some(op) = ops.get_mut(id) {
                    op.complete = *t;
                }
            }
            Entry::Exit {
                t,
                node,
                generation,
                how,
            } if how == "kill -9" => kills.push((*t, node.clone(), *generation)),
            Entry::Nemesis {
                t,
                n,
                kind,
                victim,
                edge,
                ..
            } => {
                let step = steps.entry(*n).or_insert(Step {
                    kind: kind.clone(),
                    victim: victim.clone(),
                    start: *t,
                    settled: *t,
                });
                match edge.as_str() {
                    "start" => step.start = *t,
                    "settled" => step.settled = *t,
                    _ => {}
                }
            }
            _ => {}
        }
    }
    // (key, window) → the fixed-window ops answered there, and those in doubt.
    let mut windows: BTreeMap<(&str, u64), Vec<&Op>> = BTreeMap::new();
    for op in ops.values().filter(|o| o.fw) {
        if let Some(win) = op.answer.as_ref().and_then(|a| a.window) {
            windows.entry((&op.key, win)).or_default().push(op);
        }
    }
    let judged = Judged {
        ops: &ops,
        failover_ops,
        windows: &windows,
        lending: &lending,
    };
    rejudge(&judged, l, w, report, &mut figures);
    pair_availability(&steps, &kills, report, &mut figures);

    for (t_d, node, generation) in &kills {
        let Some((n, step)) = steps.iter().find(|(_, s)| s.start == *t_d) else {
            continue;
        };
        if step.kind != "kill-restart" || step.victim != *node {
            figures.pair_kills += usize::from(step.kind == "kill-pair" && step.victim == *node);
            continue;
        }
        let win = t_d / w;
        let (lo, hi) = ((win * w).saturating_sub(ALONE_MS), (win + 1) * w + ALONE_MS);
        if steps
            .iter()
            .any(|(m, s)| m != n && s.start <= hi && s.settled + ALONE_MS >= lo)
        {
            continue;
        }
        figures.kills += 1;
        for ((key, kwin), answered) in &windows {
            if *kwin != win {
                continue;
            }
            let by_dead = |o: &&&Op| {
                o.answer.as_ref().is_some_and(|a| {
                    a.allowed && !a.degraded && a.decider == *node && a.generation == *generation
                })
            };
            if !answered.iter().any(|o| by_dead(&o)) {
                continue;
            }
            // An op in flight during another step (a forward lost to a `loss` step and
            // decided on the replica once it timed out, say) is that step's: its
            // window is not the owner's crash alone.
            let during_other = answered.iter().any(|o| {
                steps
                    .iter()
                    .any(|(m, s)| m != n && o.invoke <= s.settled && o.complete >= s.start)
            });
            if during_other {
                continue;
            }
            figures.checked += 1;
            let total: u64 = answered
                .iter()
                .filter(|o| o.answer.as_ref().is_some_and(|a| a.allowed))
                .map(|o| o.cost)
                .sum();
            let since = t_d.saturating_sub(interval_ms + IN_FLIGHT_MS);
            let lost: u64 = answered
                .iter()
                .filter(|o| by_dead(o) && o.complete >= since)
                .map(|o| o.cost)
                .sum();
            figures.lost += lost;
            let excess = total as i64 - l as i64;
            if excess > 0 {
                figures.over_l += 1;
                figures.worst = figures.worst.max(excess);
            }
            if total > l + lost {
                report.violations.entry("S3-replicated").or_default().push(format!(
                    "key {key} window {win}: owner {node}@{generation} killed alone at {t_d}; \
                     admitted {total} > L={l} + {lost} it acknowledged in its last {interval_ms} ms \
                     (+{IN_FLIGHT_MS} ms in flight)"
                ));
            }
        }
    }
    figures
}

/// AVAIL-unfaulted knows one victim per step: for a `kill-pair` step, take back its
/// messages about the second node killed (ops asked of it, keys it owned), which are
/// as faulted as the first.
fn pair_availability(
    steps: &BTreeMap<u32, Step>,
    kills: &[(u64, String, u64)],
    report: &mut Report,
    figures: &mut Figures,
) {
    let Some(messages) = report.violations.get_mut("AVAIL-unfaulted") else {
        return;
    };
    for (n, step) in steps.iter().filter(|(_, s)| s.kind == "kill-pair") {
        let prefix = format!("nemesis #{n} kill-pair {}:", step.victim);
        for (_, partner, _) in kills
            .iter()
            .filter(|(t, node, _)| *t == step.start && *node != step.victim)
        {
            let (asked, owned) = (
                format!("asked {partner})"),
                format!("owned by Some(\"{partner}\")"),
            );
            let before = messages.len();
            messages.retain(|m| {
                !(m.starts_with(&prefix) && (m.contains(&asked) || m.contains(&owned)))
            });
            figures.rejudged += before - messages.len();
        }
    }
    if messages.is_empty() {
        report.violations.remove("AVAIL-unfaulted");
    }
}

/// What [`rejudge`] reads of the history.
struct Judged<'a> {
    ops: &'a BTreeMap<u64, Op>,
    failover_ops: &'a BTreeSet<u64>,
    windows: &'a BTreeMap<(&'a str, u64), Vec<&'a Op>>,
    lending: &'a Lending,
}

/// Take back the shared checker's S4 and S6 messages about fail-over ops, and judge
/// those ops by the fail-over rules (module docs).
fn rejudge(judged: &Judged, l: u64, w: u64, report: &mut Report, figures: &mut Figures) {
    let Judged {
        ops,
        failover_ops,
        windows,
        lending,
    } = *judged;
    let about_failover = |m: &String| {
        m.strip_prefix("op ")
            .and_then(|r| r.split([' ', ':']).next())
            .and_then(|id| id.parse::<u64>().ok())
            .is_some_and(|id| failover_ops.contains(&id))
    };
    for property in ["S4", "S6"] {
        if let Some(messages) = report.violations.get_mut(property) {
            let before = messages.len();
            messages.retain(|m| !about_failover(m));
            figures.rejudged += before - messages.len();
            if messages.is_empty() {
                report.violations.remove(property);
            }
        }
    }
    for id in failover_ops {
        let Some(op) = ops.get(id) else { continue };
        let Some(a) = &op.answer else { continue };
        if a.hops > 1 {
            report
                .violations
                .entry("S6-failover")
                .or_default()
                .push(format!("op {id}: a fail-over answer took {} hops", a.hops));
        }
        let (true, false, Some(win)) = (op.fw, a.allowed, a.window) else {
            continue;
        };
        // What the owner's count held: admissions it or a replica decided, and the
        // units its grants lent (leased answers spend those).
        let decided: u64 = windows.get(&(op.key.as_str(), win)).map_or(0, |answered| {
            answered
                .iter()
                .filter(|o| o.invoke <= op.complete)
                .filter(|o| o.answer.as_ref().is_some_and(|b| b.allowed && !b.leased))
                .map(|o| o.cost)
                .sum()
        });
        let admitted = decided + lending.lent(&op.key, win, op.complete);
        // In doubt: ops on the key without an answer, and ops answered degraded (a
        // forward that timed out may still have been charged by the owner, late),
        // whose span (± the largest clock offset, 3 s) may reach the window.
        let doubt: u64 = ops
            .values()
            .filter(|o| o.fw && o.key == op.key && o.invoke <= op.complete)
            .filter(|o| o.doubt || o.answer.as_ref().is_some_and(|b| b.degraded))
            .filter(|o| {
                let last = o.complete.min(o.invoke + 20_000) + 3000;
                o.invoke.saturating_sub(3000) / w <= win && win <= last / w
            })
            .map(|o| o.cost)
            .sum();
        if admitted + doubt + op.cost <= l {
            report
                .violations
                .entry("S4-failover")
                .or_default()
                .push(format!(
                "op {id} key {} window {win}: fail-over denied cost {} by {}@{} although at most \
                 {admitted} admitted + {doubt} in doubt (L={l})",
                op.key, op.cost, a.decider, a.generation
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: u64 = 1_800_000_000_000;
    const G1: u64 = 1;

    /// n1 admits 10 of L = 10 on key k in the window starting at T, the last `late` of
    /// them in its last 20 ms; it is killed alone at T + 1000, and n2 then admits
    /// `after` more (fail-over, then as owner).
    fn history(late: u64, after: u64) -> Vec<Entry> {
        let mut h = vec![Entry::Meta {
            t: T,
            seed: 1,
            profile: "test".into(),
            broken: false,
            deadline_ms: 2000,
            schedule: Vec::new(),
            rules: crate::rules::rule_infos(),
        }];
        let mut id = 0;
        let mut op = |h: &mut Vec<Entry>, t: u64, decider: &str, degraded: bool| {
            id += 1;
            h.push(Entry::Invoke {
                id,
                client: 0,
                t,
                key: "k".into(),
                route: "GET /fw".into(),
                cost: 1,
                node: "n3".into(),
                addr: String::new(),
            });
            h.push(Entry::Ok {
                id,
                t: t + 2,
                allowed: true,
                limit: 10,
                remaining: 0,
                decider: decider.into(),
                generation: G1,
                window_id: Some(T / 2000),
                sequence: id,
                degraded,
                hops: 1,
                rule: "fw".into(),
                retry_after_ms: 0,
                leased: false,
            });
        };
        for i in 0..10 {
            let t = if i < 10 - late { T + 100 + i } else { T + 985 };
            op(&mut h, t, "n1", false);
        }
        h.push(Entry::Exit {
            t: T + 1000,
            node: "n1".into(),
            generation: G1,
            how: "kill -9".into(),
        });
        for (edge, t) in [
            ("start", T + 1000),
            ("end", T + 1300),
            ("settled", T + 1900),
        ] {
            h.push(Entry::Nemesis {
                t,
                n: 1,
                kind: "kill-restart".into(),
                victim: "n1".into(),
                edge: edge.into(),
                detail: String::new(),
            });
        }
        for i in 0..after {
            op(&mut h, T + 1100 + 10 * i, "n2", i % 2 == 0);
        }
        h
    }

    fn violations(h: &[Entry]) -> usize {
        let mut report = Report::default();
        check(h, &BTreeSet::new(), 50, &mut report);
        report.count("S3-replicated")
    }

    #[test]
    fn admissions_up_to_the_dead_owners_last_interval_pass() {
        assert_eq!(violations(&history(3, 3)), 0);
        assert_eq!(violations(&history(0, 0)), 0);
    }

    #[test]
    fn a_new_owner_starting_from_empty_fails() {
        // What a crash cost before replication: the new owner admits L again.
        assert_eq!(violations(&history(0, 10)), 1);
        assert_eq!(violations(&history(3, 4)), 1);
    }
}
