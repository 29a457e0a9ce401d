//! S4, no false deny: a denial is legal only if what was admitted plus what is in doubt
//! could exceed the limit it was decided against.

use std::collections::BTreeMap;

use super::context::{Answer, Context, Decider, Op, Window};
use super::leases::Ledger;
use super::Report;

/// S4 over every fixed-window denial: a decided denial against L, a fail-open fallback
/// denial against its fallback limit, a deny-cache answer against an earlier real denial
/// (or op of unknown outcome) through the same entry node.
///
/// Budget leases: units an owner lent are charged on its counter at the grant, spent
/// or not, so its denial may come while admitted + in doubt < L (docs/leases.md:
/// under-admission bounded by the units outstanding). With the owners' ledger in the
/// history (`Leases::ledger`), a decided denial is bounded by the owner's own count:
/// the direct admissions (not the leased ones: their units are inside the grants) +
/// in doubt + what the denier had lent in the window before its denial's step and not
/// had back before it + what any other decider lent in the window (returned or not;
/// at least its leased admissions there). Without the ledger (histories from before
/// it), the units outstanding are bounded only by what was not admitted: a decided
/// denial of a counter that may have been lent by then (`Leases::lent_by`) is legal.
/// Either way `lent_denials` counts the denials only lent units explain (the summary
/// prints them).
pub fn no_false_deny(ctx: &Context, report: &mut Report) {
    for ((key, win), window) in &ctx.windows {
        let in_doubt: &[&Op] = ctx
            .doubt
            .get(&(key.clone(), *win))
            .map_or(&[], Vec::as_slice);
        for &(o, a) in &window.answers {
            if a.allowed {
                continue;
            }
            let why = if a.decides() {
                match &ctx.leases.ledger {
                    Some(ledger) => {
                        let lent = lent_units(ledger, window, key, *win, o, a);
                        decided(ctx.l, window, in_doubt, o, a, Some(lent))
                    }
                    None => decided(ctx.l, window, in_doubt, o, a, None)
                        .filter(|_| !ctx.leases.lent_by(key, &o.route, o.complete)),
                }
            } else if a.fallback() {
                fallback(window, in_doubt, o, a)
            } else {
                cached(window, in_doubt, *win, o)
            };
            if let Some(why) = why {
                report.violate("S4", format!("op {} key {key} window {win}: {why}", o.id));
            }
        }
    }
}

/// Decided denials that only units lent may explain (see `no_false_deny`).
pub fn lent_denials(ctx: &Context) -> usize {
    let mut n = 0;
    for ((key, win), window) in &ctx.windows {
        let in_doubt: &[&Op] = ctx
            .doubt
            .get(&(key.clone(), *win))
            .map_or(&[], Vec::as_slice);
        n += window
            .answers
            .iter()
            .filter(|(o, a)| {
                !a.allowed
                    && a.decides()
                    && match &ctx.leases.ledger {
                        Some(ledger) => {
                            let lent = lent_units(ledger, window, key, *win, o, a);
                            lent > 0
                                && decided(ctx.l, window, in_doubt, o, a, Some(0)).is_some()
                                && decided(ctx.l, window, in_doubt, o, a, Some(lent)).is_none()
                        }
                        None => {
                            ctx.leases.lent_by(key, &o.route, o.complete)
                                && decided(ctx.l, window, in_doubt, o, a, None).is_some()
                        }
                    }
            })
            .count();
    }
    n
}

/// Units lent in `o`'s window that may have been charged and not given back on the
/// counter `a`'s decider denied on, by the ledger (see `no_false_deny`).
fn lent_units(ledger: &Ledger, window: &Window, key: &str, win: u64, o: &Op, a: &Answer) -> u64 {
    let denier = a.decider_id();
    let joined = window
        .decided
        .iter()
        .chain(&window.failovers)
        .any(|(x, b)| !b.leased && x.invoke <= o.complete && b.decider_id() != denier);
    let (own, mut others) = ledger.outstanding(key, &o.route, win, &denier, a.sequence, joined);
    // A grant line lost with its node (killed between its charge and its write) still
    // shows in the leased admissions it paid for.
    let mut spent: BTreeMap<Decider, u64> = BTreeMap::new();
    for (x, b) in &window.decided {
        if b.leased && b.allowed && b.decider_id() != denier {
            *spent.entry(b.decider_id()).or_default() += x.cost;
        }
    }
    for (d, units) in spent {
        let e = others.entry(d).or_default();
        *e = (*e).max(units);
    }
    own + others.values().sum::<u64>()
}

/// A decider's denial (an owner's, or a successor's on its replica): the admissions it
/// may have seen plus every charge in doubt must leave less than the cost. Fail-over
/// admissions count among them: they are on the successor's replica, which holds the
/// owner's replicated count, and they reach the owner's count too (promotion, or the
/// delta the successor pushes to an owner that comes back). `lent`: with the ledger,
/// the units lent and not given back (`lent_units`), which replace the leased
/// admissions; `None`: no ledger, leased admissions count as admitted.
fn decided(
    l: u64,
    window: &Window,
    in_doubt: &[&Op],
    o: &Op,
    a: &Answer,
    lent: Option<u64>,
) -> Option<String> {
    let admitted: u64 = window
        .decided
        .iter()
        .chain(&window.failovers)
        .filter(|(x, b)| b.allowed && x.invoke <= o.complete && !(lent.is_some() && b.leased))
        .map(|(x, _)| x.cost)
        .sum();
    let lent = lent.unwrap_or(0);
    let doubt: u64 = in_doubt
        .iter()
        .filter(|x| x.invoke <= o.complete && x.id != o.id)
        .map(|x| x.cost)
        .sum();
    (admitted + doubt + lent + o.cost <= l).then(|| {
        format!(
            "denied cost {} by {}@{} although at most {admitted} admitted + {doubt} in doubt + {lent} lent (L={l})",
            o.cost, a.decider, a.generation
        )
    })
}

/// A fail-open fallback denial: the same fallback counter's admissions plus the entry
/// node's ops of unknown outcome, against the fallback limit.
fn fallback(window: &Window, in_doubt: &[&Op], o: &Op, a: &Answer) -> Option<String> {
    let admitted: u64 = window
        .answers
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
    let doubt: u64 = in_doubt
        .iter()
        .filter(|x| x.is_info() && x.node == o.node && x.invoke <= o.complete)
        .map(|x| x.cost)
        .sum();
    (admitted + doubt + o.cost <= a.limit).then(|| {
        format!(
            "fallback denied cost {} with {admitted} admitted + {doubt} in doubt of fallback limit {}",
            o.cost, a.limit
        )
    })
}

/// A deny-cache (or fail-closed) answer: needs an earlier denial of no more cost seen by
/// this entry node, or an op of unknown outcome through it that may have been charged in
/// this window: while it was in flight, or later (`Context::doubt`: a paused entry node
/// may forward it on waking, after its client gave up, and cache the owner's denial).
fn cached(window: &Window, in_doubt: &[&Op], win: u64, o: &Op) -> Option<String> {
    let earlier = |x: &&&Op| x.node == o.node && x.invoke <= o.complete && x.id != o.id;
    let denied = window.ops.iter().filter(earlier).any(|x| {
        x.is_info()
            || x.ok().is_some_and(|b| {
                !b.allowed
                    && !b.degraded
                    && b.hops == 1
                    && b.window_id == Some(win)
                    && x.cost <= o.cost
            })
    });
    let late = in_doubt.iter().filter(earlier).any(|x| x.is_info());
    (!denied && !late).then(|| {
        format!(
            "cached denial (cost {}) without an earlier denial of cost ≤ it through {}",
            o.cost, o.node
        )
    })
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;
    use crate::history::Entry;

    fn s4(h: &Hist) -> Vec<String> {
        messages(&run(h, no_false_deny), "S4").to_vec()
    }

    /// `n` admissions of cost 1 by n1 for key k from `t`, 10 ms apart.
    fn admitted(h: &mut Hist, t: u64, n: u64) {
        for i in 0..n {
            let seq = h.seq("n1", 1);
            h.check(
                t + 10 * i,
                "n1",
                FW,
                "k",
                1,
                Ans::decided("n1", seq, true, L - 1 - i),
            );
        }
    }

    fn deny(h: &mut Hist, t: u64, cost: u64) -> u64 {
        let seq = h.seq("n1", 1);
        h.check(t, "n1", FW, "k", cost, Ans::decided("n1", seq, false, 0))
    }

    #[test]
    fn a_denial_after_the_limit_was_admitted_passes() {
        let mut h = Hist::new();
        h.fw_many(L + 2, T0, "n2", "k", "n1");
        assert_eq!(s4(&h), Vec::<String>::new());
    }

    #[test]
    fn a_denial_with_room_left_fails() {
        let mut h = Hist::new();
        admitted(&mut h, T0, 8);
        let id = deny(&mut h, T0 + 500, 2);
        let msgs = s4(&h);
        assert_eq!(msgs.len(), 1);
        assert!(msgs[0].starts_with(&format!("op {id} ")), "{msgs:?}");
    }

    #[test]
    fn a_denial_justified_by_an_op_of_unknown_outcome_passes() {
        let mut h = Hist::new();
        let lost = h.invoke(T0, "n3", FW, "k", 2);
        h.info(lost, T0 + 2000);
        admitted(&mut h, T0 + 100, 8);
        deny(&mut h, T0 + 500, 1);
        assert_eq!(s4(&h), Vec::<String>::new());
    }

    /// A fail-open fallback answer of cost 2 through n2 while n1 (the owner) is paused
    /// at T0 + 100 … T0 + 3100; then, three windows later, n1 admits 8 and denies 1.
    fn stalled_forward(h: &mut Hist, pause: bool) {
        if pause {
            h.nemesis(1, "pause", "n1", T0 + 100, T0 + 3100, T0 + 3600);
        }
        let id = h.invoke(T0 + 200, "n2", FW, "k", 2);
        h.ok(id, T0 + 2200, Ans::fallback("n2", 1, true, 1, 3));
        admitted(h, T0 + 3 * W, 8);
        deny(h, T0 + 3 * W + 500, 1);
    }

    #[test]
    fn a_stalled_forward_charged_by_the_owner_windows_later_passes() {
        // Finding 2: the owner applied forwards stalled by the pause when it resumed,
        // in a window of its own clock well after the fallback answer; the charge stays
        // in doubt until the fault's length plus 3 s after it settled.
        let mut h = Hist::new();
        stalled_forward(&mut h, true);
        assert_eq!(s4(&h), Vec::<String>::new());
    }

    #[test]
    fn without_a_fault_a_fallback_answer_is_in_doubt_only_until_its_deadline() {
        let mut h = Hist::new();
        stalled_forward(&mut h, false);
        assert_eq!(s4(&h).len(), 1);
    }

    #[test]
    fn a_fallback_denial_at_its_limit_passes() {
        let mut h = Hist::new();
        for i in 0..3 {
            h.check(
                T0 + i,
                "n2",
                FW,
                "k",
                1,
                Ans::fallback("n2", i + 1, true, 2 - i, 3),
            );
        }
        h.check(
            T0 + 10,
            "n2",
            FW,
            "k",
            1,
            Ans::fallback("n2", 4, false, 0, 3),
        );
        assert_eq!(s4(&h), Vec::<String>::new());
    }

    #[test]
    fn a_fallback_denial_with_room_left_fails() {
        let mut h = Hist::new();
        h.check(T0, "n2", FW, "k", 1, Ans::fallback("n2", 1, true, 2, 3));
        h.check(
            T0 + 10,
            "n2",
            FW,
            "k",
            1,
            Ans::fallback("n2", 2, false, 0, 3),
        );
        assert!(s4(&h)[0].contains("fallback denied cost 1 with 1 admitted + 0 in doubt"));
    }

    #[test]
    fn a_fallback_denial_counts_the_entry_nodes_ops_of_unknown_outcome() {
        let mut h = Hist::new();
        let lost = h.invoke(T0, "n2", FW, "k", 2);
        h.info(lost, T0 + 2000);
        h.check(
            T0 + 10,
            "n2",
            FW,
            "k",
            1,
            Ans::fallback("n2", 1, false, 0, 2),
        );
        assert_eq!(s4(&h), Vec::<String>::new());
        // Through another entry node it is no excuse.
        let mut h = Hist::new();
        let lost = h.invoke(T0, "n3", FW, "k", 2);
        h.info(lost, T0 + 2000);
        h.check(
            T0 + 10,
            "n2",
            FW,
            "k",
            1,
            Ans::fallback("n2", 1, false, 0, 2),
        );
        assert_eq!(s4(&h).len(), 1);
    }

    /// n2 admits L through n1, then denies a forwarded check of `cost` through `via`.
    fn real_denial(h: &mut Hist, via: &str, cost: u64) {
        h.fw_many(L, T0, "n1", "k", "n2");
        h.fw(T0 + 200, via, "k", cost, "n2");
    }

    #[test]
    fn a_cached_denial_after_a_real_one_through_the_same_entry_node_passes() {
        let mut h = Hist::new();
        real_denial(&mut h, "n1", 1);
        h.check(T0 + 300, "n1", FW, "k", 1, Ans::cached("n1"));
        h.check(T0 + 310, "n1", FW, "k", 2, Ans::cached("n1"));
        assert_eq!(s4(&h), Vec::<String>::new());
    }

    #[test]
    fn a_cached_denial_without_a_real_one_fails() {
        let mut h = Hist::new();
        h.fw_many(3, T0, "n1", "k", "n2");
        h.check(T0 + 300, "n1", FW, "k", 1, Ans::cached("n1"));
        assert!(s4(&h)[0].contains("cached denial (cost 1)"));
    }

    #[test]
    fn a_cached_denial_after_a_real_one_through_another_entry_node_fails() {
        let mut h = Hist::new();
        real_denial(&mut h, "n3", 1);
        h.check(T0 + 300, "n1", FW, "k", 1, Ans::cached("n1"));
        assert_eq!(s4(&h).len(), 1);
    }

    #[test]
    fn a_cached_denial_of_less_cost_than_the_real_one_fails() {
        let mut h = Hist::new();
        h.fw_many(8, T0, "n1", "k", "n2");
        h.fw(T0 + 200, "n1", "k", 3, "n2");
        h.check(T0 + 300, "n1", FW, "k", 1, Ans::cached("n1"));
        assert_eq!(s4(&h).len(), 1);
    }

    #[test]
    fn a_cached_denial_after_an_op_of_unknown_outcome_through_the_entry_node_passes() {
        let mut h = Hist::new();
        let lost = h.invoke(T0, "n1", FW, "k", 1);
        h.info(lost, T0 + 2000);
        h.check(T0 + 300, "n1", FW, "k", 1, Ans::cached("n1"));
        assert_eq!(s4(&h), Vec::<String>::new());
    }

    /// Seed 1007 of the simulator. Entry node n1 is paused from T0 + 100 to T0 + 5100
    /// (if `pause`); a check of cost 2 through `via`, invoked at T0 + 200, times out at
    /// its client (`info`). The owner n2 admits L in window T0 / W + 2; on waking, n1
    /// forwards the timed-out check, caches n2's denial, and answers a check at
    /// T0 + 5300 from that cache. Returns the cached answer's op id.
    fn woken_entry_node(h: &mut Hist, pause: bool, via: &str) -> u64 {
        if pause {
            h.nemesis(1, "pause", "n1", T0 + 100, T0 + 5100, T0 + 5600);
        }
        let lost = h.invoke(T0 + 200, via, FW, "k", 2);
        h.info(lost, T0 + 2200);
        h.fw_many(L, T0 + 2 * W, "n3", "k", "n2");
        h.check(
            T0 + 5300,
            "n1",
            FW,
            "k",
            1,
            Ans::cached("n1").window(T0 / W + 2),
        )
    }

    #[test]
    fn a_cached_denial_from_a_check_handled_after_its_client_gave_up_passes() {
        let mut h = Hist::new();
        woken_entry_node(&mut h, true, "n1");
        assert_eq!(s4(&h), Vec::<String>::new());
    }

    #[test]
    fn a_check_whose_client_gave_up_justifies_cached_denials_only_while_in_doubt() {
        // No fault: the check cannot have been charged windows after its deadline.
        let mut h = Hist::new();
        let id = woken_entry_node(&mut h, false, "n1");
        let msgs = s4(&h);
        assert_eq!(msgs.len(), 1, "{msgs:?}");
        assert!(msgs[0].starts_with(&format!("op {id} ")), "{msgs:?}");
        // Through another entry node it filled no cache of n1's.
        let mut h = Hist::new();
        woken_entry_node(&mut h, true, "n3");
        assert_eq!(s4(&h).len(), 1);
    }

    /// A run with leases on and the owners' ledger: n1 (generation 1) admits `direct`
    /// of k itself, then grants `units` to n2 (lease 1, in T0's window), and n2 spends
    /// `spent` of them. Returns the grant's sequence number.
    fn ledgered(h: &mut Hist, direct: u64, units: u64, spent: u64) -> u64 {
        h.push(Entry::Leases {
            t: T0 - 5000,
            threshold: 2,
            ttl_ms: 1000,
            ledger: true,
        });
        admitted(h, T0, direct);
        let sequence = h.seq("n1", 1);
        h.push(lent_line("n1", 1, units, 1, sequence));
        for i in 0..spent {
            h.check(T0 + 300 + i, "n2", FW, "k", 1, Ans::leased("n1", 0));
        }
        sequence
    }

    fn lent_line(owner: &str, generation: u64, units: u64, serial: u64, sequence: u64) -> Entry {
        Entry::Lent {
            t: T0,
            node: owner.into(),
            generation,
            key: "k".into(),
            route: FW.into(),
            counter: 99,
            holder: "n2".into(),
            serial,
            units,
            window: Some(T0 / W),
            sequence,
        }
    }

    fn returned_line(units: u64, serial: u64, sequence: u64) -> Entry {
        Entry::Returned {
            t: T0,
            node: "n1".into(),
            generation: 1,
            counter: 99,
            serial,
            units,
            sequence,
        }
    }

    #[test]
    fn with_the_ledger_a_denial_is_bounded_by_the_units_lent_and_not_returned() {
        // 3 admitted + 7 lent (2 of them spent): the 11th unit is denied, rightly.
        let mut h = Hist::new();
        ledgered(&mut h, 3, 7, 2);
        deny(&mut h, T0 + 500, 1);
        assert_eq!(s4(&h), Vec::<String>::new());
        // Only 5 lent: 3 + 5 + 1 ≤ L, whatever was spent of them.
        let mut h = Hist::new();
        ledgered(&mut h, 3, 5, 5);
        let id = deny(&mut h, T0 + 500, 1);
        let msgs = s4(&h);
        assert_eq!(msgs.len(), 1, "{msgs:?}");
        assert!(
            msgs[0].starts_with(&format!("op {id} "))
                && msgs[0].contains("3 admitted + 0 in doubt + 5 lent"),
            "{msgs:?}"
        );
    }

    #[test]
    fn with_the_ledger_units_returned_before_the_denial_no_longer_explain_it() {
        let mut h = Hist::new();
        ledgered(&mut h, 3, 7, 2);
        let back = h.seq("n1", 1);
        h.push(returned_line(5, 1, back));
        deny(&mut h, T0 + 500, 1);
        assert_eq!(s4(&h).len(), 1, "3 + (7 - 5) + 1 ≤ L");
        // A return after the denial's step still left them out at the denial.
        let mut h = Hist::new();
        ledgered(&mut h, 3, 7, 2);
        let deny_seq = h.seq("n1", 1);
        h.check(
            T0 + 500,
            "n1",
            FW,
            "k",
            1,
            Ans::decided("n1", deny_seq, false, 0),
        );
        h.push(returned_line(5, 1, deny_seq + 1));
        assert_eq!(s4(&h), Vec::<String>::new());
    }

    #[test]
    fn with_the_ledger_a_grant_after_the_denial_does_not_explain_it() {
        let mut h = Hist::new();
        h.push(Entry::Leases {
            t: T0 - 5000,
            threshold: 2,
            ttl_ms: 1000,
            ledger: true,
        });
        admitted(&mut h, T0, 3);
        deny(&mut h, T0 + 500, 1);
        let later = h.seq("n1", 1);
        h.push(lent_line("n1", 1, 7, 1, later));
        h.check(T0 + 600, "n2", FW, "k", 1, Ans::leased("n1", 0));
        assert_eq!(s4(&h).len(), 1);
        // Without the ledger, a lent counter's denial is let through.
        let mut h = Hist::new();
        h.push(Entry::Leases {
            t: T0 - 5000,
            threshold: 2,
            ttl_ms: 1000,
            ledger: false,
        });
        h.fw_many(2, T0, "n2", "k", "n1");
        deny(&mut h, T0 + 500, 1);
        assert_eq!(s4(&h), Vec::<String>::new());
    }

    #[test]
    fn with_the_ledger_another_deciders_grants_count_whole_and_a_lost_line_by_its_spends() {
        // n1@1 lent 7 and returned 5 of them; n1@2 (restarted, its count moved by a
        // handoff, say) admits 3 and denies: the other generation's 7 count whole.
        let mut h = Hist::new();
        ledgered(&mut h, 0, 7, 0);
        let back = h.seq("n1", 1);
        h.push(returned_line(5, 1, back));
        for i in 0..3 {
            let seq = h.seq("n1", 2);
            let a = Ans::decided("n1", seq, true, 2 - i).generation(2);
            h.check(T0 + 400 + i, "n1", FW, "k", 1, a);
        }
        let seq = h.seq("n1", 2);
        let a = Ans::decided("n1", seq, false, 0).generation(2);
        h.check(T0 + 500, "n1", FW, "k", 1, a);
        assert_eq!(s4(&h), Vec::<String>::new(), "3 + 7 + 1 > L");
        // Had it been n1@1's own denial, the 5 returned before it would not count.
        let mut h = Hist::new();
        ledgered(&mut h, 3, 7, 0);
        let back = h.seq("n1", 1);
        h.push(returned_line(5, 1, back));
        deny(&mut h, T0 + 500, 1);
        assert_eq!(s4(&h).len(), 1, "3 + 2 + 1 ≤ L");
        // n3's grant line is missing (killed as it charged), but 8 leased answers name it.
        let mut h = Hist::new();
        ledgered(&mut h, 0, 0, 0);
        for i in 0..8 {
            h.check(T0 + 300 + i, "n2", FW, "k", 1, Ans::leased("n3", 0));
        }
        admitted(&mut h, T0 + 400, 1);
        deny(&mut h, T0 + 500, 2);
        assert_eq!(s4(&h), Vec::<String>::new(), "1 + 8 + 2 > L");
    }

    #[test]
    fn a_fail_over_denial_counts_the_owners_admissions_on_the_replica() {
        // n1 admitted 8 and died; n2 admits 2 on its replica and denies the next.
        let mut h = Hist::new();
        admitted(&mut h, T0, 8);
        for i in 0..2 {
            h.check(
                T0 + 500 + i,
                "n3",
                FW,
                "k",
                1,
                Ans::failover("n2", i + 1, true, 1 - i),
            );
        }
        h.check(T0 + 600, "n3", FW, "k", 1, Ans::failover("n2", 3, false, 0));
        assert_eq!(s4(&h), Vec::<String>::new());
        // With room left on the replica it is a false deny.
        let mut h = Hist::new();
        admitted(&mut h, T0, 5);
        h.check(T0 + 600, "n3", FW, "k", 1, Ans::failover("n2", 1, false, 0));
        assert_eq!(s4(&h).len(), 1);
    }
}
