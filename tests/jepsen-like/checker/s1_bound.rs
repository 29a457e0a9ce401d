//! S1, the per-decider bound: one decider (node id + generation) never admits more than
//! its algorithm allows. Zero tolerance under every fault: it follows from the
//! single-threaded shard actor.

use std::collections::BTreeMap;

use crate::history::RuleInfo;

use super::context::{Context, Op};
use super::Report;

/// S1-fw: per decider, key and fixed window, admitted cost ≤ L. A decider is an
/// owner's shard (non-degraded answers) or a successor deciding fail-over checks; a
/// successor's fail-over and owner decisions count together, on one budget: they are
/// one counter (its replica, promoted into the live key by a merge that only adds, or
/// the live key it already held; `Window::deciders`).
///
/// Budget leases: an answer decided from a lease names the owner that granted it and
/// the window of the grant, and is not degraded, so it counts here among the owner's
/// admissions of that window. That is the exactness of leases, kept strict: the owner
/// charged every lent unit in that window before any entry spent it, so leased
/// admissions (from every holder) plus the owner's own ≤ L per window. A lease ends
/// with its window, so a leased answer is decided within the window it names: one
/// invoked after that window's end (on any clock the run's offsets allow) spent units
/// of a window that was over, in the next one, on top of its own L.
pub fn fixed_window(ctx: &Context, report: &mut Report) {
    let l = ctx.l;
    for ((key, win), window) in &ctx.windows {
        let end = (win + 1) * ctx.w + ctx.leases.offset_ms;
        for (o, a) in &window.decided {
            if a.leased && o.invoke > end {
                report.violate(
                    "S1-fw",
                    format!(
                        "op {} key {key}: leased in window {win}, which ended at {end} (± clock offsets) before the op began at {}",
                        o.id, o.invoke
                    ),
                );
            }
        }
        for (d, g) in &window.deciders {
            let admitted: Vec<&Op> = window
                .decided
                .iter()
                .chain(&window.failovers)
                .filter(|(_, a)| a.allowed && &a.decider == d && a.generation == *g)
                .map(|(o, _)| *o)
                .collect();
            let cost: u64 = admitted.iter().map(|o| o.cost).sum();
            if cost > l {
                let ids: Vec<u64> = admitted.iter().map(|o| o.id).collect();
                report.violate(
                    "S1-fw",
                    format!("key {key} window {win}: decider {d}@{g} admitted {cost} > L={l} (ops {ids:?})"),
                );
            }
        }
    }
}

/// S1-fallback: per fail-open fallback counter and fixed window, admitted ≤ its limit ≤ L.
///
/// Each ring size has its own stand-in counter (`<rule>~fallback/<nodes>`, finding 7),
/// and an answer names only the share (L / nodes), not the size. So the answers of one
/// entry node with one share may come from several counters: one per ring size with
/// that share the node was seen with around the window (`Context::stand_in_sizes`). The
/// bound is the share times that many counters (at least one).
pub fn fallback(ctx: &Context, report: &mut Report) {
    let l = ctx.l;
    for ((key, win), window) in &ctx.windows {
        for (s, admitted) in &window.fallbacks {
            let sizes = ctx.stand_in_sizes(*win, s);
            let budget = ctx.stand_in_budget(*win, s);
            if *admitted > budget || s.limit > l {
                report.violate(
                    "S1-fallback",
                    format!(
                        "key {key} window {win}: fallback of {}@{} admitted {admitted} with fallback limit {} over ring size(s) {sizes:?} (L={l})",
                        s.node, s.generation, s.limit
                    ),
                );
            }
        }
    }
}

/// S1-log: per decider (owner or fail-over successor) and key of the sliding window log, admissions whose
/// decisions surely lie within less than W on the decider's clock (`complete_j −
/// invoke_i < W` when the clock-offset nemesis left it alone) cost ≤ L. A sliding log
/// never leases (docs/leases.md): a leased answer on it is a violation.
pub fn sliding_log(ctx: &Context, report: &mut Report) {
    let Some(r) = ctx.sliding_log else { return };
    for op in ctx.ops.iter().filter(|o| o.route == r.route) {
        if op.ok().is_some_and(|a| a.leased) {
            report.violate(
                "S1-log",
                format!("op {} key {}: a leased sliding log answer", op.id, op.key),
            );
        }
    }
    for ((d, g, key), list) in admissions(ctx, r) {
        'from: for i in 0..list.len() {
            let mut sum = 0u64;
            for j in i..list.len() {
                sum += list[j].cost;
                let span =
                    ctx.clocks
                        .elapsed(&d, list[i].invoke, list[i].complete, list[j].complete);
                if span + 1 < r.window_ms && sum > r.limit {
                    report.violate(
                        "S1-log",
                        format!(
                            "{d}@{g} key {key}: ops {}..{} admitted {sum} > L={} within {span} ms < W={}",
                            list[i].id, list[j].id, r.limit, r.window_ms
                        ),
                    );
                    continue 'from;
                }
            }
        }
    }
}

/// S1-tb: per decider (owner or fail-over successor) and key of the token bucket, admitted cost over any
/// run of decisions ≤ burst + L × (elapsed upper bound, on the decider's clock) / W.
///
/// Leased admissions have no place in the owner's sequence; they are checked with the
/// owner's by time instead (`token_bucket_leased`).
pub fn token_bucket(ctx: &Context, report: &mut Report) {
    let Some(r) = ctx.token_bucket else { return };
    token_bucket_leased(ctx, r, report);
    for ((d, g, key), list) in admissions(ctx, r) {
        'from: for i in 0..list.len() {
            let mut sum = 0u64;
            for j in i..list.len() {
                sum += list[j].cost;
                let span =
                    ctx.clocks
                        .elapsed(&d, list[i].invoke, list[i].complete, list[j].complete);
                let refill = (r.limit * span).div_ceil(r.window_ms);
                if sum > r.burst + refill {
                    report.violate(
                        "S1-tb",
                        format!(
                            "{d}@{g} key {key}: ops {}..{} admitted {sum} > burst {} + refill {refill} over ≤ {span} ms",
                            list[i].id, list[j].id, r.burst
                        ),
                    );
                    continue 'from;
                }
            }
        }
    }
}

/// S1-tb with leases, per owner and key with leased admissions: the bucket gave every
/// lent unit when the owner granted it, at most a lease's life before its spend
/// (`Leases::charged_from`). So each admission was charged within a known real-time
/// span, [invoke, complete] for the owner's own, [charged_from, complete] for a leased
/// one, and the admissions charged surely within [a, b] cost ≤ burst + refill over
/// (b − a) on the owner's clock: taken over every a at a span's start and b at a
/// span's end (one violation per owner and key: the first start found). The burst moves by up to one lease life for a client (docs/leases.md);
/// what the owner's bucket gives does not.
fn token_bucket_leased(ctx: &Context, r: &RuleInfo, report: &mut Report) {
    type Spans = Vec<(u64, u64, u64, u64)>;
    let mut per: BTreeMap<(String, u64, String), (Spans, bool)> = BTreeMap::new();
    for op in ctx.ops.iter().filter(|o| o.route == r.route) {
        let Some(a) = op.ok().filter(|a| a.decides() && a.allowed) else {
            continue;
        };
        let from = if a.leased {
            ctx.leases.charged_from(op)
        } else {
            op.invoke
        };
        let e = per
            .entry((a.decider.clone(), a.generation, op.key.clone()))
            .or_default();
        e.0.push((from, op.complete, op.cost, op.id));
        e.1 |= a.leased;
    }
    'key: for ((d, g, key), (mut spans, _)) in per.into_iter().filter(|(_, (_, any))| *any) {
        spans.sort_by_key(|s| s.1);
        let mut starts: Vec<u64> = spans.iter().map(|s| s.0).collect();
        starts.sort_unstable();
        starts.dedup();
        for a in starts {
            let mut sum = 0;
            for &(from, to, cost, id) in spans.iter().filter(|s| s.0 >= a) {
                sum += cost;
                let span = ctx.clocks.elapsed(&d, a, a, to);
                let refill = (r.limit * span).div_ceil(r.window_ms);
                if sum > r.burst + refill {
                    report.violate(
                        "S1-tb",
                        format!(
                            "{d}@{g} key {key}: admissions charged within [{a}, {to}] (the last: op {id}, from {from}) cost {sum} > burst {} + refill {refill} over ≤ {span} ms, leased ones included",
                            r.burst
                        ),
                    );
                    continue 'key;
                }
            }
        }
    }
}

/// Admissions on `rule`'s route per (decider, generation, key), in sequence order:
/// non-degraded ones and a successor's fail-over ones (one counter: `Window::deciders`),
/// not leased ones (no sequence of their own).
fn admissions<'a>(
    ctx: &Context<'a>,
    rule: &RuleInfo,
) -> BTreeMap<(String, u64, String), Vec<&'a Op>> {
    let mut per: BTreeMap<(String, u64, String), Vec<&Op>> = BTreeMap::new();
    for op in ctx.ops.iter().filter(|o| o.route == rule.route) {
        if let Some(a) = op.ok().filter(|a| a.decides() && a.allowed && !a.leased) {
            per.entry((a.decider.clone(), a.generation, op.key.clone()))
                .or_default()
                .push(op);
        }
    }
    for list in per.values_mut() {
        list.sort_by_key(|o| o.ok().map(|a| a.sequence));
    }
    per
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;
    use crate::history::Entry;

    #[test]
    fn one_decider_admitting_exactly_the_limit_passes() {
        let mut h = Hist::new();
        h.fw_many(L + 2, T0, "n1", "k", "n1");
        assert_eq!(run(&h, fixed_window).count("S1-fw"), 0);
    }

    #[test]
    fn one_decider_admitting_more_than_the_limit_in_a_window_fails() {
        let mut h = Hist::new();
        let ids: Vec<u64> = (0..=L)
            .map(|i| {
                let seq = h.seq("n1", 1);
                let rem = L.saturating_sub(i + 1);
                h.check(
                    T0 + 10 * i,
                    "n1",
                    FW,
                    "k",
                    1,
                    Ans::decided("n1", seq, true, rem),
                )
            })
            .collect();
        let r = run(&h, fixed_window);
        assert_eq!(messages(&r, "S1-fw").len(), 1);
        assert!(messages(&r, "S1-fw")[0].contains(&format!("{ids:?}")));
    }

    #[test]
    fn a_restarted_node_is_a_new_decider_with_its_own_limit() {
        // kill-restart: the same id with a new generation starts from an empty counter.
        let mut h = Hist::new();
        h.fw_many(L, T0, "n1", "k", "n1");
        h.restart("n1", 2);
        h.fw_many(L, T0 + 1000, "n1", "k", "n1");
        assert_eq!(run(&h, fixed_window).count("S1-fw"), 0);
    }

    #[test]
    fn the_same_limit_in_the_next_window_passes() {
        let mut h = Hist::new();
        h.fw_many(L, T0 + 1800, "n1", "k", "n1");
        h.fw_many(L, T0 + W, "n1", "k", "n1");
        assert_eq!(run(&h, fixed_window).count("S1-fw"), 0);
    }

    #[test]
    fn fallback_admissions_do_not_count_against_a_decider() {
        let mut h = Hist::new();
        h.fw_many(L, T0, "n1", "k", "n1");
        let seq = h.seq("n2", 1);
        h.check(
            T0 + 500,
            "n2",
            FW,
            "k",
            1,
            Ans::fallback("n2", seq, true, 2, 3),
        );
        assert_eq!(run(&h, fixed_window).count("S1-fw"), 0);
    }

    #[test]
    fn a_fallback_counter_within_its_limit_passes() {
        let mut h = Hist::new();
        for i in 0..4 {
            let seq = h.seq("n2", 1);
            let a = Ans::fallback("n2", seq, i < 3, 2u64.saturating_sub(i), 3);
            h.check(T0 + 10 * i, "n2", FW, "k", 1, a);
        }
        assert_eq!(run(&h, fallback).count("S1-fallback"), 0);
    }

    #[test]
    fn a_fallback_counter_over_its_limit_fails() {
        let mut h = Hist::new();
        for i in 0..4 {
            let seq = h.seq("n2", 1);
            h.check(
                T0 + 10 * i,
                "n2",
                FW,
                "k",
                1,
                Ans::fallback("n2", seq, true, 0, 3),
            );
        }
        assert_eq!(run(&h, fallback).count("S1-fallback"), 1);
    }

    #[test]
    fn two_ring_sizes_with_the_same_share_are_two_fallback_counters() {
        // L = 10: 5 and 4 nodes both give a share of 2. The entry node's ring went from
        // 5 members to 4 inside the window (sampled), so 3 admissions are 2 + 1 on two
        // stand-in counters; with one ring size seen they would be over.
        let five = [("n2", "n1 n2 n3 n4 n5")];
        let four = [("n2", "n1 n2 n3 n4")];
        let history = |flap: bool| {
            let mut h = Hist::new();
            h.round(T0, &five);
            if flap {
                h.round(T0 + 600, &four);
            }
            for i in 0..3 {
                let seq = h.seq("n2", 1);
                h.check(
                    T0 + 100 + 300 * i,
                    "n2",
                    FW,
                    "k",
                    1,
                    Ans::fallback("n2", seq, true, 1, 2),
                );
            }
            h
        };
        assert_eq!(run(&history(true), fallback).count("S1-fallback"), 0);
        assert_eq!(run(&history(false), fallback).count("S1-fallback"), 1);
    }

    #[test]
    fn a_fallback_limit_above_the_rule_limit_fails() {
        let mut h = Hist::new();
        let seq = h.seq("n2", 1);
        h.check(
            T0,
            "n2",
            FW,
            "k",
            1,
            Ans::fallback("n2", seq, true, L, L + 1),
        );
        assert_eq!(run(&h, fallback).count("S1-fallback"), 1);
    }

    /// Eight admissions of the sliding log (L = 8) at `t`, 10 ms apart, by `d`.
    fn log_burst(h: &mut Hist, t: u64, d: &str, n: u64) {
        for i in 0..n {
            let seq = h.seq(d, 1);
            h.check(t + 10 * i, d, LOG, "k", 1, Ans::decided(d, seq, true, 0));
        }
    }

    #[test]
    fn a_sliding_log_admitting_its_limit_per_window_passes() {
        let mut h = Hist::new();
        log_burst(&mut h, T0, "n1", 8);
        log_burst(&mut h, T0 + W, "n1", 8);
        assert_eq!(run(&h, sliding_log).count("S1-log"), 0);
    }

    #[test]
    fn a_sliding_log_admitting_more_than_its_limit_within_a_window_fails() {
        let mut h = Hist::new();
        log_burst(&mut h, T0, "n1", 9);
        assert!(run(&h, sliding_log).count("S1-log") > 0);
    }

    #[test]
    fn sliding_log_admissions_not_surely_within_a_window_pass() {
        // The first op invoked at T0 but answered late: its decision may lie up to
        // complete_j − invoke_i = W − 1 ms before the ninth, so it is not counted.
        let mut h = Hist::new();
        let first = h.invoke(T0, "n1", LOG, "k", 1);
        let seq = h.seq("n1", 1);
        h.ok(first, T0 + 1900, Ans::decided("n1", seq, true, 7));
        for i in 0..8u64 {
            let seq = h.seq("n1", 1);
            let t = T0 + 1990 + i;
            let id = h.invoke(t, "n1", LOG, "k", 1);
            h.ok(
                id,
                if i == 7 { T0 + W - 1 } else { t },
                Ans::decided("n1", seq, true, 0),
            );
        }
        assert_eq!(run(&h, sliding_log).count("S1-log"), 0);
        // One millisecond less and all nine surely lie within W.
        let mut h = Hist::new();
        let first = h.invoke(T0, "n1", LOG, "k", 1);
        let seq = h.seq("n1", 1);
        h.ok(first, T0 + 1900, Ans::decided("n1", seq, true, 7));
        for i in 0..8u64 {
            let seq = h.seq("n1", 1);
            let t = T0 + 1990 + i;
            let id = h.invoke(t, "n1", LOG, "k", 1);
            h.ok(
                id,
                if i == 7 { T0 + W - 2 } else { t },
                Ans::decided("n1", seq, true, 0),
            );
        }
        assert_eq!(run(&h, sliding_log).count("S1-log"), 1);
    }

    #[test]
    fn a_sliding_log_across_a_forward_clock_step_is_measured_on_the_deciders_clock() {
        // n1's clock jumps 3 s ahead between two bursts 1 s apart in real time: on its
        // clock they are 4 s apart, so 16 admissions are within the limit; without the
        // clock line the same history is a violation.
        let history = |with_step: bool| {
            let mut h = Hist::new();
            log_burst(&mut h, T0, "n1", 8);
            if with_step {
                h.push(Entry::Clock {
                    t: T0 + 200,
                    node: "n1".into(),
                    offset_ms: 3_000,
                });
            }
            log_burst(&mut h, T0 + 1_000, "n1", 8);
            h
        };
        assert_eq!(run(&history(true), sliding_log).count("S1-log"), 0);
        assert!(run(&history(false), sliding_log).count("S1-log") > 0);
    }

    #[test]
    fn a_backward_clock_step_gives_a_sliding_log_no_extra_time() {
        let mut h = Hist::new();
        h.push(Entry::Clock {
            t: T0 - 5_000,
            node: "n1".into(),
            offset_ms: -3_000,
        });
        log_burst(&mut h, T0, "n1", 9);
        assert!(run(&h, sliding_log).count("S1-log") > 0);
    }

    #[test]
    fn a_token_bucket_spending_its_burst_then_the_refill_passes() {
        // Burst 5, refill 10 per 2 s: 5 at once, 5 more a second later.
        let mut h = Hist::new();
        for (t, n) in [(T0, 5), (T0 + 1000, 5)] {
            for i in 0..n {
                let seq = h.seq("n1", 1);
                h.check(t + i, "n1", TB, "k", 1, Ans::decided("n1", seq, true, 0));
            }
        }
        assert_eq!(run(&h, token_bucket).count("S1-tb"), 0);
    }

    #[test]
    fn a_token_bucket_admitting_more_than_burst_plus_refill_fails() {
        let mut h = Hist::new();
        for _ in 0..7 {
            let seq = h.seq("n1", 1);
            h.check(T0, "n1", TB, "k", 1, Ans::decided("n1", seq, true, 0));
        }
        assert!(run(&h, token_bucket).count("S1-tb") > 0);
    }

    #[test]
    fn two_deciders_each_within_the_token_bucket_pass() {
        // An ownership move: each decider has its own bucket.
        let mut h = Hist::new();
        for d in ["n1", "n2"] {
            for _ in 0..5 {
                let seq = h.seq(d, 1);
                h.check(T0, d, TB, "k", 1, Ans::decided(d, seq, true, 0));
            }
        }
        assert_eq!(run(&h, token_bucket).count("S1-tb"), 0);
    }

    #[test]
    fn a_successors_fail_over_and_owner_decisions_share_one_limit() {
        // n2 decides 6 on its replica, then, promoted, 4 as owner: one counter, L.
        let history = |as_owner: u64| {
            let mut h = Hist::new();
            for i in 0..6 {
                let seq = h.seq("n2", 1);
                h.check(
                    T0 + i,
                    "n1",
                    FW,
                    "k",
                    1,
                    Ans::failover("n2", seq, true, 9 - i),
                );
            }
            for i in 0..as_owner {
                let seq = h.seq("n2", 1);
                let a = Ans::decided("n2", seq, true, 3u64.saturating_sub(i));
                h.check(T0 + 500 + i, "n1", FW, "k", 1, a);
            }
            h
        };
        assert_eq!(run(&history(4), fixed_window).count("S1-fw"), 0);
        assert_eq!(run(&history(5), fixed_window).count("S1-fw"), 1);
    }

    #[test]
    fn fail_over_answers_are_not_fallback_counters() {
        // The rule's own limit marks a fail-over: S1-fallback ignores it, S1-fw counts it.
        let mut h = Hist::new();
        for i in 0..=L {
            let seq = h.seq("n2", 1);
            h.check(T0 + i, "n1", FW, "k", 1, Ans::failover("n2", seq, true, 0));
        }
        let r = run(&h, |ctx, r| {
            fallback(ctx, r);
            fixed_window(ctx, r);
        });
        assert_eq!((r.count("S1-fallback"), r.count("S1-fw")), (0, 1));
    }
}
