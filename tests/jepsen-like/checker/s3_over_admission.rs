//! S3, bounded over-admission: each ownership change of a key during a window can admit
//! up to L more in that window, and every decider must have owned the key in some node's
//! ring view around that time.

use std::collections::BTreeMap;

use super::context::Context;
use super::views::VIEW_SLACK_MS;
use super::Report;

/// What the summary shows about fixed-window admissions.
pub struct OverAdmission {
    /// Admitted cost (decided and fallback) over every (key, window).
    pub admitted: u64,
    /// (key, window)s that admitted more than L.
    pub windows_over: usize,
    /// The largest excess over L and where; `i64::MIN` without any window.
    pub worst: (i64, String),
    /// (key, window)s above L by the nemesis kinds around them ("kill-both+partition";
    /// "none"): how many, and the largest excess. Replication narrows the crash rows
    /// only; a partition's two deciders (merged on heal) are the same with it or not.
    pub by_cause: BTreeMap<String, (usize, i64)>,
}

/// The kinds of the nemesis steps active around window `win` (from 3 s before it,
/// detection and gossip, to its end; a step counts until 2 s after it settled), joined
/// with '+'; "none" without any.
fn causes(ctx: &Context, win: u64) -> String {
    let (lo, hi) = ((win * ctx.w).saturating_sub(3000), (win + 1) * ctx.w);
    let kinds: std::collections::BTreeSet<&str> = ctx
        .faults()
        .filter(|e| e.start <= hi && e.settled + 2000 >= lo)
        .map(|e| e.kind.as_str())
        .collect();
    if kinds.is_empty() {
        "none".into()
    } else {
        kinds.into_iter().collect::<Vec<_>>().join("+")
    }
}

/// S3-bound: per (key, window), admitted ≤ L × D + Σ fallback limits, D = distinct
/// deciders (owners, and successors deciding fail-over checks: `Window::deciders`; a
/// successor that decides fail-over checks and then, promoted, as owner is one
/// decider, one counter), and each fail-open stand-in counter (one per entry node
/// generation and ring size, so one limit may count several times:
/// `Context::stand_in_budget`) adding its own limit.
pub fn bound(ctx: &Context, report: &mut Report) -> OverAdmission {
    let l = ctx.l;
    let mut out = OverAdmission {
        admitted: 0,
        windows_over: 0,
        worst: (i64::MIN, String::new()),
        by_cause: BTreeMap::new(),
    };
    for ((key, win), window) in &ctx.windows {
        let d = window.deciders.len();
        let total: u64 = window
            .answers
            .iter()
            .filter(|(_, a)| a.allowed && (a.decides() || a.fallback()))
            .map(|(o, _)| o.cost)
            .sum();
        out.admitted += total;
        // Each stand-in counter is a budget of its own, like a decider's L.
        let fallback_limits: u64 = window
            .fallbacks
            .keys()
            .map(|s| ctx.stand_in_budget(*win, s))
            .sum();
        let bound = l * d as u64 + fallback_limits;
        if total > bound {
            report.violate(
                "S3-bound",
                format!(
                    "key {key} window {win}: admitted {total} > bound {bound} (L={l} × D={d} + fallbacks {:?})",
                    window.fallbacks
                ),
            );
        }
        let excess = total as i64 - l as i64;
        if excess > 0 {
            out.windows_over += 1;
            let cause = out.by_cause.entry(causes(ctx, *win)).or_insert((0, 0));
            cause.0 += 1;
            cause.1 = cause.1.max(excess);
        }
        if excess > out.worst.0 {
            out.worst = (
                excess,
                format!("key {key} window {win}: {total} admitted, bound {bound}, D={d}"),
            );
        }
    }
    out
}

/// S3-owner: every non-degraded decider, on every route, owned the key on some node's
/// sampled ring (or a view between two samples) within ±`VIEW_SLACK_MS` of the op; every
/// fail-over decider was the key's successor there (the entry node sends a fail-over
/// check to the successor on its ring) or its owner (a successor whose ring already
/// gave it the key, or that decides it on the live key it promoted).
pub fn owner(ctx: &Context, report: &mut Report) {
    for op in ctx.ops {
        let Some(a) = op.ok().filter(|a| a.decides()) else {
            continue;
        };
        if a.failover {
            let views = &ctx.views;
            if !views.succeeded_by(&op.key, &a.decider, op.invoke, op.complete)
                && !views.owned_by(&op.key, &a.decider, op.invoke, op.complete)
            {
                report.violate(
                    "S3-owner",
                    format!(
                        "op {} key {} route {}: fail-over decider {}@{} was never the key's successor or owner in any node's ring view within ±{} ms of [{}, {}]",
                        op.id, op.key, op.route, a.decider, a.generation, VIEW_SLACK_MS, op.invoke, op.complete
                    ),
                );
            }
            continue;
        }
        // A leased answer names the owner that granted the lease, up to a lease's life
        // before the op.
        let from = if a.leased {
            ctx.leases.charged_from(op)
        } else {
            op.invoke
        };
        if !ctx.views.owned_by(&op.key, &a.decider, from, op.complete) {
            report.violate(
                "S3-owner",
                format!(
                    "op {} key {} route {}: decider {}@{} was never the key's owner in any node's ring view within ±{} ms of [{}, {}]",
                    op.id, op.key, op.route, a.decider, a.generation, VIEW_SLACK_MS, op.invoke, op.complete
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;
    use ringlimit::ring::Ring;

    const RING3: &str = "n1 n2 n3";

    fn owner_violations(h: &Hist) -> Vec<String> {
        messages(&run(h, owner), "S3-owner").to_vec()
    }

    /// Every node sampled with `members` from `from` until `to`.
    fn stable(h: &mut Hist, from: u64, to: u64, members: &str) {
        let views: Vec<(&str, &str)> = members.split(' ').map(|n| (n, members)).collect();
        h.rounds(from, to, &views);
    }

    #[test]
    fn two_deciders_admitting_the_limit_each_pass_the_bound() {
        // One ownership change in the window: up to 2L.
        let mut h = Hist::new();
        h.fw_many(L, T0, "n1", "k", "n1");
        h.fw_many(L, T0 + 500, "n1", "k", "n2");
        h.nemesis(1, "partition", "n1", T0 - 1000, T0 + 400, T0 + 600);
        let (over, r) = run_with(&h, bound);
        assert_eq!(r.count("S3-bound"), 0);
        assert_eq!(
            (over.admitted, over.windows_over, over.worst.0),
            (2 * L, 1, L as i64)
        );
        assert_eq!(over.by_cause["partition"], (1, L as i64));
    }

    #[test]
    fn one_decider_admitting_more_than_the_limit_fails_the_bound() {
        let mut h = Hist::new();
        for i in 0..=L {
            h.check(T0 + i, "n1", FW, "k", 1, Ans::decided("n1", i + 1, true, 0));
        }
        assert_eq!(run(&h, bound).count("S3-bound"), 1);
    }

    #[test]
    fn fallback_limits_widen_the_bound() {
        let mut h = Hist::new();
        h.fw_many(L, T0, "n1", "k", "n1");
        for i in 0..3 {
            h.check(
                T0 + 500 + i,
                "n2",
                FW,
                "k",
                1,
                Ans::fallback("n2", i + 1, true, 0, 3),
            );
        }
        assert_eq!(run(&h, bound).count("S3-bound"), 0);
        // The same three admissions under a fallback limit of 2 exceed L + 2.
        let mut h = Hist::new();
        h.fw_many(L, T0, "n1", "k", "n1");
        for i in 0..3 {
            h.check(
                T0 + 500 + i,
                "n2",
                FW,
                "k",
                1,
                Ans::fallback("n2", i + 1, true, 0, 2),
            );
        }
        assert_eq!(run(&h, bound).count("S3-bound"), 1);
    }

    /// L decided by n1, then four fail-open admissions of cost 1 on n2's stand-ins of
    /// limit 2, n2 sampled with the rings `views` around the window.
    fn stand_ins(views: &[&str]) -> Hist {
        let mut h = Hist::new();
        for (i, members) in views.iter().enumerate() {
            h.round(T0 - 1000 + 600 * i as u64, &[("n2", members)]);
        }
        h.fw_many(L, T0, "n1", "k", "n1");
        for i in 0..4 {
            let a = Ans::fallback("n2", i + 1, true, 0, 2);
            h.check(T0 + 500 + i, "n2", FW, "k", 1, a);
        }
        h
    }

    #[test]
    fn two_stand_ins_with_one_limit_are_two_budgets() {
        // Seed 3605 of the simulator: a partitioned node's ring went 5 → 4 → 1 members;
        // its stand-ins for 5 and for 4 nodes both have limit 2 (10 / 5, ⌊10 / 4⌋) and
        // are two counters, so up to L + 2 + 2.
        let r = run(&stand_ins(&["n1 n2 n3 n4 n5", "n2 n3 n4 n5", "n2"]), bound);
        assert_eq!(r.count("S3-bound"), 0, "{}", r.details(5));
    }

    #[test]
    fn one_stand_in_admitting_past_its_limit_fails_the_bound() {
        // Sampled with 5 members and then alone (a share of 10): one counter of limit
        // 2, so L + 4 > L + 2.
        let r = run(&stand_ins(&["n1 n2 n3 n4 n5", "n2"]), bound);
        let msgs = messages(&r, "S3-bound");
        assert_eq!(msgs.len(), 1, "{msgs:?}");
        assert!(msgs[0].contains("admitted 14 > bound 12"), "{msgs:?}");
    }

    #[test]
    fn the_owner_on_every_ring_deciding_passes() {
        let mut h = Hist::new();
        stable(&mut h, T0 - 2000, T0 + 2000, RING3);
        let key = key_owned_by(RING3, "n2", |_| true);
        h.fw(T0, "n1", &key, 1, "n2");
        h.fw(T0 + 10, "n2", &key, 1, "n2");
        assert_eq!(owner_violations(&h), Vec::<String>::new());
    }

    #[test]
    fn a_node_deciding_a_key_it_never_owned_fails() {
        // The negative control: every node decides every key itself.
        let mut h = Hist::new();
        stable(&mut h, T0 - 2000, T0 + 2000, RING3);
        let key = key_owned_by(RING3, "n2", |_| true);
        h.fw(T0, "n1", &key, 1, "n1");
        assert_eq!(owner_violations(&h).len(), 1);
    }

    #[test]
    fn degraded_answers_are_not_ownership_claims() {
        let mut h = Hist::new();
        stable(&mut h, T0 - 2000, T0 + 2000, RING3);
        let key = key_owned_by(RING3, "n2", |_| true);
        h.check(T0, "n1", FW, &key, 1, Ans::fallback("n1", 1, true, 2, 3));
        h.check(T0 + 10, "n1", FW, &key, 1, Ans::cached("n1"));
        assert_eq!(owner_violations(&h), Vec::<String>::new());
    }

    /// Finding 4: right after its partition healed, n33's sampled views went from
    /// `[n33]` straight to the 4-node ring within one sampling gap, while gossip revealed
    /// the others one at a time; in the unsampled view `[n28, n33]` n28 owned keys that
    /// n33 forwarded to it. Returns the key.
    fn healed_partition(h: &mut Hist) -> String {
        let full = "n28 n29 n30 n33";
        let key = key_owned_by("n28 n33", "n28", |k| owner_on(full, k) != "n28");
        let others = [("n28", full), ("n29", full), ("n30", full)];
        let mut before = others.to_vec();
        before.push(("n33", "n33"));
        h.rounds(T0 - 2000, T0 + 200, &before);
        let mut after = others.to_vec();
        after.push(("n33", full));
        h.rounds(T0 + 200, T0 + 2000, &after);
        key
    }

    #[test]
    fn a_view_between_two_samples_of_a_healed_partition_passes() {
        let mut h = Hist::new();
        let key = healed_partition(&mut h);
        h.fw(T0 + 100, "n33", &key, 1, "n28");
        assert_eq!(owner_violations(&h), Vec::<String>::new());
    }

    #[test]
    fn a_view_between_two_samples_counts_only_around_the_gap() {
        let mut h = Hist::new();
        let key = healed_partition(&mut h);
        h.fw(T0 + 10_000, "n33", &key, 1, "n28");
        assert_eq!(owner_violations(&h).len(), 1);
    }

    #[test]
    fn a_member_of_neither_sampled_view_fails() {
        let mut h = Hist::new();
        healed_partition(&mut h);
        let key = key_owned_by("n31 n33", "n31", |_| true);
        h.fw(T0 + 100, "n33", &key, 1, "n31");
        assert_eq!(owner_violations(&h).len(), 1);
    }

    #[test]
    fn members_joining_one_at_a_time_between_two_samples_pass() {
        // Scale-out by two nodes: n1's view grows from 3 to 5 members between two
        // samples; in the unsampled 4-member view n4 owned the key.
        let mut h = Hist::new();
        let five = "n1 n2 n3 n4 n5";
        let key = key_owned_by("n1 n2 n3 n4", "n4", |k| owner_on(five, k) != "n4");
        h.rounds(T0 - 2000, T0 + 200, &[("n1", RING3)]);
        h.rounds(T0 + 200, T0 + 2000, &[("n1", five)]);
        h.fw(T0 + 150, "n1", &key, 1, "n4");
        assert_eq!(owner_violations(&h), Vec::<String>::new());
    }

    /// n1 paused from T0 to T0 + 6 s: it does not answer, the others drop it from their
    /// ring at T0 + 1.4 s and see it again only at T0 + 9.4 s.
    fn paused(h: &mut Hist) {
        stable(h, T0 - 2000, T0, RING3);
        h.rounds(T0, T0 + 1400, &[("n1", DOWN), ("n2", RING3), ("n3", RING3)]);
        h.rounds(
            T0 + 1400,
            T0 + 6000,
            &[("n1", DOWN), ("n2", "n2 n3"), ("n3", "n2 n3")],
        );
        h.rounds(
            T0 + 6000,
            T0 + 9400,
            &[("n1", RING3), ("n2", "n2 n3"), ("n3", "n2 n3")],
        );
        stable(h, T0 + 9400, T0 + 12_000, RING3);
    }

    #[test]
    fn a_paused_owner_deciding_by_its_stale_view_passes() {
        let mut h = Hist::new();
        paused(&mut h);
        let key = key_owned_by(RING3, "n1", |_| true);
        h.fw(T0 + 6050, "n1", &key, 1, "n1");
        assert_eq!(owner_violations(&h), Vec::<String>::new());
    }

    #[test]
    fn a_node_waking_from_a_pause_deciding_a_key_it_never_owned_fails() {
        // Finding 5 (fixed in the product): on waking, the failure detector declared
        // every peer dead for one gossip round; in that unsampled view `[n1]` n1 decided
        // a key its rings before and after the pause gave to another node.
        let mut h = Hist::new();
        paused(&mut h);
        let key = key_owned_by(RING3, "n2", |_| true);
        h.fw(T0 + 6032, "n1", &key, 1, "n1");
        assert_eq!(owner_violations(&h).len(), 1);
    }

    #[test]
    fn the_old_owner_deciding_within_the_slack_after_a_move_passes() {
        // A join moves the key from n1 to n4 at T0 on every node's ring.
        let four = "n1 n2 n3 n4";
        let key = key_owned_by(RING3, "n1", |k| owner_on(four, k) == "n4");
        let decide_at = |t: u64| {
            let mut h = Hist::new();
            stable(&mut h, T0 - 2000, T0, RING3);
            stable(&mut h, T0, T0 + 8000, four);
            h.fw(t, "n2", &key, 1, "n1");
            owner_violations(&h).len()
        };
        assert_eq!(decide_at(T0 + 2500), 0);
        assert_eq!(decide_at(T0 + 3500), 1);
    }

    #[test]
    fn a_promoted_successor_is_one_decider_not_a_decider_and_a_stand_in() {
        // n1 admits L, dies; n2 admits 10 on fail-over, then 1 as promoted owner: one
        // counter of n2's past L, so above L × D = 20. (Before fail-over answers were
        // told apart they counted as a stand-in of limit L: bound 30.)
        let mut h = Hist::new();
        h.fw_many(L, T0, "n3", "k", "n1");
        for i in 0..L {
            let seq = h.seq("n2", 1);
            h.check(
                T0 + 500 + i,
                "n3",
                FW,
                "k",
                1,
                Ans::failover("n2", seq, true, 0),
            );
        }
        let seq = h.seq("n2", 1);
        h.check(T0 + 900, "n3", FW, "k", 1, Ans::decided("n2", seq, true, 0));
        let msgs = messages(&run(&h, bound), "S3-bound").to_vec();
        assert_eq!(msgs.len(), 1, "{msgs:?}");
        assert!(msgs[0].contains("admitted 21 > bound 20"), "{msgs:?}");
    }

    #[test]
    fn a_fail_over_decider_must_be_the_keys_successor() {
        let mut h = Hist::new();
        stable(&mut h, T0 - 2000, T0 + 2000, RING3);
        let key = key_owned_by(RING3, "n2", |_| true);
        let h2 = Ring::key_hash(key.as_bytes());
        let succ = ring(RING3).successor_of_hash(h2).unwrap().to_string();
        let other = ["n1", "n3"].into_iter().find(|n| *n != succ).unwrap();
        h.check(T0, "n2", FW, &key, 1, Ans::failover(&succ, 1, true, 5));
        assert_eq!(owner_violations(&h), Vec::<String>::new());
        h.check(T0 + 10, "n2", FW, &key, 1, Ans::failover(other, 1, true, 5));
        let msgs = owner_violations(&h);
        assert_eq!(msgs.len(), 1, "{msgs:?}");
        assert!(msgs[0].contains("fail-over decider"), "{msgs:?}");
    }

    #[test]
    fn the_ring_places_a_key_by_the_hash_the_successor_is_found_with() {
        // The checker finds a key's successor by `Ring::key_hash`: the same placement
        // as `Ring::owner`, which the rest of the checker uses.
        let r = ring("n1 n2 n3 n4 n5");
        for i in 0..200 {
            let k = format!("hot-{i}");
            assert_eq!(
                r.owner(k.as_bytes()),
                r.owner_of_hash(Ring::key_hash(k.as_bytes()))
            );
        }
    }
}
