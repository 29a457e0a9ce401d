//! S5, no-fault exactness: with no faults, one decider per (key, window) and admissions
//! exactly those of the model.

use std::collections::BTreeSet;

use super::context::{Answered, Context, Decider, Op};
use super::Report;

/// S5: in every fault-free phase, each (key, window) lying inside the phase has no op
/// of unknown outcome, one decider, no degraded admission, and replays exactly
/// (allowed and remaining as the fixed window model says). Returns how many (key,
/// window)s it checked.
///
/// An op belongs to the phase by its time (invoked between the phase's start and end),
/// not by the window id it names: a decider whose clock was stepped back when the chaos
/// phase began names windows of the phase before for ops that came after it (seed 1592
/// of the simulator). Such ops are judged by the chaos phase's properties; the ops of
/// the phase are still held to the model, replayed on top of what ops from outside it
/// charged to the same counter before them. A window that an op of unknown outcome from
/// outside the phase may have been charged in is not fault-free: it is not checked.
///
/// Budget leases: a counter that may have been lent in the window (`Leases::lent_in`)
/// is still held to no unknown outcome, one decider (a leased answer names the owner:
/// leases add no decider) and no degraded admission, but not to the replay: its count
/// moved by grants and returns the history does not show (S1-fw still holds its
/// admissions, leased ones included, to L).
pub fn exactness(ctx: &Context, report: &mut Report) -> usize {
    let (l, w) = (ctx.l, ctx.w);
    let mut checked = 0usize;
    for phase in ctx.phases.iter().filter(|p| !p.faults) {
        let name = &phase.name;
        let inside = |o: &Op| phase.start <= o.invoke && o.invoke <= phase.end;
        for ((key, win), window) in &ctx.windows {
            if win * w < phase.start || (win + 1) * w > phase.end {
                continue;
            }
            if !window.ops.iter().any(|o| inside(o))
                || window.ops.iter().any(|o| o.is_info() && !inside(o))
            {
                continue;
            }
            checked += 1;
            if let Some(o) = window.ops.iter().find(|o| o.is_info()) {
                report.violate(
                    "S5",
                    format!("phase {name}: key {key} window {win}: op {} has an unknown outcome in a fault-free phase", o.id),
                );
                continue;
            }
            let decided: Vec<Answered> = window
                .decided
                .iter()
                .copied()
                .filter(|(o, _)| inside(o))
                .collect();
            let deciders: BTreeSet<Decider> = decided.iter().map(|(_, a)| a.decider_id()).collect();
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
            if let Some(o) = window
                .ops
                .iter()
                .find(|o| inside(o) && o.ok().is_some_and(|a| a.degraded && a.allowed))
            {
                report.violate(
                    "S5",
                    format!("phase {name}: key {key} window {win}: op {} admitted degraded with no fault", o.id),
                );
            }
            let Some(decider) = deciders.first() else {
                continue;
            };
            let route = window.ops.first().map_or("", |o| o.route.as_str());
            if ctx.leases.lent_in(key, route, *win, w) {
                continue;
            }
            // The decider's counter for this window, in sequence order, with what ops
            // from outside the phase charged to it.
            let mut counter: Vec<Answered> = window
                .decided
                .iter()
                .copied()
                .filter(|(_, a)| a.decider_id() == *decider)
                .collect();
            counter.sort_by_key(|(_, a)| a.sequence);
            let demand: u64 = decided.iter().map(|(o, _)| o.cost).sum();
            let mut used = 0;
            for (o, a) in &counter {
                if !inside(o) {
                    if a.allowed {
                        used += o.cost;
                    }
                    continue;
                }
                let expect = used + o.cost <= l;
                if expect {
                    used += o.cost;
                }
                if a.allowed != expect || l.checked_sub(used) != Some(a.remaining) {
                    report.violate(
                        "S5",
                        format!(
                            "phase {name}: op {} key {key} window {win}: allowed={} remaining={}, exact model: allowed={expect} remaining={} (demand {demand})",
                            o.id, a.allowed, a.remaining, l.saturating_sub(used)
                        ),
                    );
                    break;
                }
            }
        }
    }
    checked
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;
    use crate::history::Entry;

    /// A fault-free phase covering windows T0 / W and the next one.
    fn fault_free() -> Hist {
        let mut h = Hist::new();
        h.phase("fault-free-1", T0 - 100, T0 + 2 * W + 100, false);
        h
    }

    fn s5(h: &Hist) -> (usize, Vec<String>) {
        let (checked, r) = run_with(h, exactness);
        (checked, messages(&r, "S5").to_vec())
    }

    #[test]
    fn one_decider_answering_exactly_passes() {
        let mut h = fault_free();
        h.fw_many(L + 2, T0, "n1", "a", "n2");
        h.fw(T0 + 300, "n2", "a", 2, "n2");
        h.fw_many(3, T0 + W, "n3", "a", "n2");
        h.fw_many(4, T0, "n1", "b", "n1");
        assert_eq!(s5(&h), (3, Vec::new()));
    }

    #[test]
    fn two_deciders_in_a_window_with_no_fault_fail() {
        // The negative control: every node decides locally.
        let mut h = fault_free();
        h.fw_many(3, T0, "n1", "a", "n1");
        h.fw_many(3, T0 + 100, "n2", "a", "n2");
        let (_, msgs) = s5(&h);
        assert_eq!(msgs.len(), 1);
        assert!(msgs[0].contains("2 deciders"), "{msgs:?}");
    }

    #[test]
    fn an_op_of_unknown_outcome_with_no_fault_fails() {
        let mut h = fault_free();
        h.fw_many(3, T0, "n1", "a", "n1");
        let id = h.invoke(T0 + 100, "n1", FW, "a", 1);
        h.info(id, T0 + 2100);
        assert!(s5(&h).1[0].contains("unknown outcome"));
    }

    #[test]
    fn a_degraded_admission_with_no_fault_fails() {
        let mut h = fault_free();
        h.fw_many(3, T0, "n1", "a", "n1");
        h.check(
            T0 + 100,
            "n2",
            FW,
            "a",
            1,
            Ans::fallback("n2", 1, true, 2, 3),
        );
        assert!(s5(&h).1[0].contains("admitted degraded"));
    }

    #[test]
    fn an_answer_off_the_model_with_no_fault_fails() {
        let mut h = fault_free();
        h.fw_many(3, T0, "n1", "a", "n1");
        h.check(T0 + 100, "n1", FW, "a", 1, Ans::decided("n1", 4, true, 7));
        let (_, msgs) = s5(&h);
        assert_eq!(msgs.len(), 1);
        assert!(msgs[0].contains("exact model: allowed=true remaining=6 (demand 4)"));
    }

    #[test]
    fn windows_not_inside_a_fault_free_phase_are_not_checked() {
        let mut h = fault_free();
        // Window T0 / W + 2 ends after the phase; the chaos phase has faults.
        h.phase("chaos", T0 + 2 * W + 100, T0 + 10 * W, true);
        h.fw_many(3, T0 + 2 * W, "n1", "a", "n1");
        h.fw_many(3, T0 + 2 * W + 200, "n2", "a", "n2");
        h.fw_many(3, T0 + 4 * W, "n1", "a", "n1");
        h.fw_many(3, T0 + 4 * W, "n2", "a", "n2");
        assert_eq!(s5(&h), (0, Vec::new()));
    }

    /// Seed 1592 of the simulator: fault-free-1 ends at T0 + 2W + 100 and the chaos
    /// phase steps n2's clock 2 s back. n1 decides 3 checks in window T0 / W + 1, then
    /// n2, by its stepped clock, admits one check invoked at `t` in that same window: a
    /// fail-open answer and one decided as a second owner.
    fn stepped_back(t: u64) -> Hist {
        let mut h = fault_free();
        h.phase("chaos", T0 + 2 * W + 100, T0 + 10 * W, true);
        h.push(Entry::Clock {
            t: T0 + 2 * W + 100,
            node: "n2".into(),
            offset_ms: -2000,
        });
        h.fw_many(3, T0 + W, "n1", "a", "n1");
        let win = T0 / W + 1;
        h.check(
            t,
            "n2",
            FW,
            "a",
            1,
            Ans::fallback("n2", 1, true, 2, 3).window(win),
        );
        h.check(
            t + 10,
            "n2",
            FW,
            "a",
            1,
            Ans::decided("n2", 2, true, 9).window(win),
        );
        h
    }

    #[test]
    fn ops_after_the_phase_naming_one_of_its_windows_are_not_in_the_phase() {
        assert_eq!(s5(&stepped_back(T0 + 2 * W + 500)), (1, Vec::new()));
    }

    #[test]
    fn the_same_ops_inside_the_phase_fail() {
        let (checked, msgs) = s5(&stepped_back(T0 + W + 500));
        assert_eq!(checked, 1);
        assert_eq!(msgs.len(), 1, "{msgs:?}");
        assert!(msgs[0].contains("2 deciders"), "{msgs:?}");
    }

    /// fault-free-2 starts at T0 + 2W - 100; just before, in the chaos phase, n1's
    /// clock 1 s ahead charged a check of cost 3 in window T0 / W + 2. Then, inside the
    /// phase, n1 answers a check of cost 1 in that window with `remaining`.
    fn charged_before_the_phase(remaining: u64) -> Hist {
        let mut h = Hist::new();
        h.phase("chaos", T0, T0 + 2 * W - 100, true);
        h.phase("fault-free-2", T0 + 2 * W - 100, T0 + 4 * W, false);
        h.push(Entry::Clock {
            t: T0 + W,
            node: "n1".into(),
            offset_ms: 1000,
        });
        let win = T0 / W + 2;
        h.check(
            T0 + 2 * W - 300,
            "n1",
            FW,
            "a",
            3,
            Ans::decided("n1", 1, true, 7).window(win),
        );
        h.check(
            T0 + 2 * W + 100,
            "n1",
            FW,
            "a",
            1,
            Ans::decided("n1", 2, true, remaining),
        );
        h
    }

    #[test]
    fn the_phase_replays_on_top_of_charges_from_before_it() {
        assert_eq!(s5(&charged_before_the_phase(6)), (1, Vec::new()));
        let (_, msgs) = s5(&charged_before_the_phase(9));
        assert_eq!(msgs.len(), 1, "{msgs:?}");
        assert!(
            msgs[0].contains("remaining=9, exact model: allowed=true remaining=6"),
            "{msgs:?}"
        );
    }
}
