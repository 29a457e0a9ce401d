//! FENCE: a fenced rule's (key, window) is never admitted above L (docs/ownership.md,
//! "Fencing"), except what the documented causes can lose, each bounded by the
//! admissions it can lose in that (key, window), never wholesale:
//!
//! - **partition** of node V: V may have decided the key, as its owner, until its
//!   majority lease ran out (the cut + F + one tracker tick), and its successor's replica
//!   misses what V admitted after its last replication batch got through (the cut − 2 r,
//!   `s3_replicated::loss_window_ms`). Excused: V's admissions in the window that
//!   completed in [cut − 2 r, cut end + F + tick + answer slack].
//! - **kill-restart, kill-replace, pause** of V: V's admissions in the window that
//!   completed in [kill − 2 r, kill + answer slack] (the replica lag of a crash; a
//!   paused process decides nothing until it holds a majority again).
//! - **kill-both**: the key's owner and its successor die together and the replica dies
//!   with them: up to L more (L × 2), where either victim decided in the window before
//!   the kill.
//!
//! Every other excess is a violation. Admissions are the acknowledged ones (an op of
//! unknown outcome may have been charged too, which only makes the check weaker, never
//! wrong).

use std::collections::BTreeMap;

use super::context::{Answer, Op, Parsed};
use super::s3_replicated::{loss_window_ms, DEFAULT_INTERVAL_MS};
use super::Report;

/// F + one tracker tick: how long after a partition's cut is complete its victim may
/// still hold a majority lease (`membership::quorum`'s defaults: 500 ms + 50 ms).
pub const LEASE_AFTER_CUT_MS: u64 = 550;
/// From a decision to the client's completion line (a loaded 2-core box).
pub const ANSWER_SLACK_MS: u64 = 250;
/// Kills this close together are one nemesis step (as in S3-replicated).
const SAME_STEP_MS: u64 = 500;

/// What the summary shows about FENCE.
#[derive(Default)]
pub struct FenceStats {
    /// The fenced rule's route, if the run has one.
    pub route: Option<String>,
    /// Answers on the fenced route, and those denied without a decision (fenced, or
    /// fail-closed: sequence 0, degraded).
    pub answers: usize,
    pub denied_undecided: usize,
    /// (key, window)s with an admission, above L, and excused (all within their cause's
    /// bound); by cause: (key, window)s and the largest excess.
    pub windows: usize,
    pub above_l: usize,
    pub by_cause: BTreeMap<&'static str, (usize, u64)>,
}

/// A fault that may excuse admissions above L, with the admissions it may lose.
struct Excuse {
    cause: &'static str,
    describe: String,
    /// Who decided what it may lose, and the completion times that count.
    victims: Vec<String>,
    from: u64,
    to: u64,
    /// `Some(n)`: excuses up to n whenever a victim decided in [from, to]; `None`: the
    /// victims' admissions in [from, to].
    flat: Option<u64>,
}

/// FENCE over the run's fenced rule (`RuleInfo::fenced`); nothing when it has none.
pub fn fenced(p: &Parsed, report: &mut Report) -> FenceStats {
    let Some(rule) = p.rules.iter().find(|r| r.fenced) else {
        return FenceStats::default();
    };
    let mut stats = FenceStats {
        route: Some(rule.route.clone()),
        ..FenceStats::default()
    };
    let loss = loss_window_ms(match p.replicate_interval_ms {
        Some(r) if r > 0 => r,
        _ => DEFAULT_INTERVAL_MS,
    });
    let excuses = excuses(p, loss, rule.limit);
    let mut windows: BTreeMap<(&str, u64), Vec<(&Op, &Answer)>> = BTreeMap::new();
    for op in p.ops.iter().filter(|o| o.route == rule.route) {
        let Some(a) = op.ok() else { continue };
        stats.answers += 1;
        if !a.allowed && a.degraded && a.sequence == 0 {
            stats.denied_undecided += 1;
        }
        if let (true, Some(win)) = (a.allowed, a.window_id) {
            windows.entry((&op.key, win)).or_default().push((op, a));
        }
    }
    stats.windows = windows.len();
    for ((key, win), admitted) in &windows {
        let total: u64 = admitted.iter().map(|(o, _)| o.cost).sum();
        if total <= rule.limit {
            continue;
        }
        stats.above_l += 1;
        let excess = total - rule.limit;
        let mut excused = 0u64;
        let mut causes: Vec<&Excuse> = Vec::new();
        for e in &excuses {
            let lost: u64 = admitted
                .iter()
                .filter(|(o, a)| {
                    e.victims.contains(&a.decider) && e.from <= o.complete && o.complete <= e.to
                })
                .map(|(o, _)| o.cost)
                .sum();
            let lost = match e.flat {
                Some(n) if lost > 0 => n,
                Some(_) => 0,
                None => lost,
            };
            if lost > 0 {
                excused += lost;
                causes.push(e);
            }
        }
        if excess > excused {
            report.violate(
                "FENCE",
                format!(
                    "key {key} window {win}: {total} admitted on the fenced route {} (L = {}), +{excess}; the faults around it excuse {excused} ({})",
                    rule.route,
                    rule.limit,
                    if causes.is_empty() {
                        "none".to_string()
                    } else {
                        causes.iter().map(|e| e.describe.as_str()).collect::<Vec<_>>().join(", ")
                    }
                ),
            );
            continue;
        }
        let cause = causes.first().map_or("none", |e| e.cause);
        let entry = stats.by_cause.entry(cause).or_default();
        entry.0 += 1;
        entry.1 = entry.1.max(excess);
    }
    stats
}

/// The excuses of every nemesis step of the run.
fn excuses(p: &Parsed, loss: u64, limit: u64) -> Vec<Excuse> {
    let mut out = Vec::new();
    for ev in p.events.iter().filter(|e| !e.skipped) {
        let describe = format!("#{} {} {}", ev.n, ev.kind, ev.victim);
        match ev.kind.as_str() {
            "partition" => {
                let cut = ev.start.saturating_sub(ev.cut_ms);
                out.push(Excuse {
                    cause: "partition (replica lag until the fence)",
                    describe,
                    victims: vec![ev.victim.clone()],
                    from: cut.saturating_sub(loss),
                    to: ev.start + LEASE_AFTER_CUT_MS + ANSWER_SLACK_MS,
                    flat: None,
                });
            }
            "kill-restart" | "kill-replace" | "pause" => out.push(Excuse {
                cause: "crash or pause (replica lag)",
                describe,
                victims: vec![ev.victim.clone()],
                from: ev.start.saturating_sub(loss),
                to: ev.start + ANSWER_SLACK_MS,
                flat: None,
            }),
            // The process suite's kill-both, the simulator's kill-pair.
            "kill-both" | "kill-pair" => {
                let victims: Vec<String> = p
                    .exits
                    .iter()
                    .filter(|x| {
                        x.how == "kill -9"
                            && ev.start.saturating_sub(SAME_STEP_MS) <= x.t
                            && x.t <= ev.start + SAME_STEP_MS
                    })
                    .map(|x| x.node.clone())
                    .collect();
                out.push(Excuse {
                    cause: "owner and successor crashed (L × 2)",
                    describe,
                    victims,
                    from: ev.start.saturating_sub(60_000),
                    to: ev.start + ANSWER_SLACK_MS,
                    flat: Some(limit),
                });
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// A history whose fenced route admitted `n` for key k on `decider` at `t`.
    fn admit(h: &mut Hist, n: u64, t: u64, decider: &str) {
        for i in 0..n {
            h.fenced_op(t + i, "n1", "k", decider, true);
        }
    }

    fn check(h: &Hist) -> (Report, FenceStats) {
        let parsed = Parsed::parse(h.entries());
        let mut report = Report::default();
        let stats = fenced(&parsed, &mut report);
        (report, stats)
    }

    #[test]
    fn l_admissions_pass_and_one_more_without_a_fault_is_a_violation() {
        let mut h = Hist::new();
        admit(&mut h, FENCED_L, T0, "n1");
        let (r, s) = check(&h);
        assert_eq!((r.count("FENCE"), s.windows, s.above_l), (0, 1, 0));
        admit(&mut h, 1, T0 + 500, "n2");
        let (r, _) = check(&h);
        assert_eq!(r.count("FENCE"), 1, "{}", r.details(3));
    }

    #[test]
    fn a_partitions_victim_is_excused_what_it_admitted_until_its_fence_and_no_more() {
        // All in window T0 / W.
        let start = T0 + 400;
        let mut h = Hist::new();
        h.nemesis_with(
            1,
            "partition",
            "n1",
            start,
            start + 3000,
            start + 4000,
            "8 iptables DROP rules in 40 ms",
        );
        // n1 owned k: 7 before the cut, 2 in the replica's lag and its lease.
        admit(&mut h, 7, T0, "n1");
        admit(&mut h, 2, start + 10, "n1");
        // The successor n2 took over from the replica (7): 3 more reach L + 2.
        admit(&mut h, 3, start + 1_200, "n2");
        let (r, s) = check(&h);
        assert_eq!(r.count("FENCE"), 0, "{}", r.details(3));
        assert_eq!(s.by_cause.len(), 1);
        // A victim still deciding after its lease ran out is not excused.
        admit(&mut h, 1, start + 1_500, "n1");
        let (r, _) = check(&h);
        assert_eq!(r.count("FENCE"), 1, "{}", r.details(3));
    }

    #[test]
    fn kill_both_excuses_up_to_l_more_only_where_a_victim_decided() {
        let start = T0 + 900;
        let mut h = Hist::new();
        h.nemesis(1, "kill-both", "n1", start, start + 1000, start + 2000);
        h.exit(start, "n1", 1, "kill -9");
        h.exit(start + 1, "n2", 1, "kill -9");
        admit(&mut h, FENCED_L, T0, "n1");
        admit(&mut h, FENCED_L, start + 1_500, "n3");
        let (r, _) = check(&h);
        assert_eq!(r.count("FENCE"), 0, "{}", r.details(3));
        admit(&mut h, 1, start + 1_600, "n3");
        let (r, _) = check(&h);
        assert_eq!(r.count("FENCE"), 1, "{}", r.details(3));
    }
}
