//! S5, no-fault exactness: with no faults, one decider per (key, window) and admissions
//! exactly those of the model.

use super::context::{Answered, Context};
use super::Report;

/// S5: in every fault-free phase, each (key, window) lying inside the phase has no op
/// of unknown outcome, one decider, no degraded admission, and replays exactly
/// (allowed and remaining as the fixed window model says). Returns how many (key,
/// window)s it checked.
pub fn exactness(ctx: &Context, report: &mut Report) -> usize {
    let (l, w) = (ctx.l, ctx.w);
    let mut checked = 0usize;
    for phase in ctx.phases.iter().filter(|p| !p.faults) {
        let name = &phase.name;
        for ((key, win), window) in &ctx.windows {
            if win * w < phase.start || (win + 1) * w > phase.end {
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
            let deciders = &window.deciders;
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
                .find(|o| o.ok().is_some_and(|a| a.degraded && a.allowed))
            {
                report.violate(
                    "S5",
                    format!("phase {name}: key {key} window {win}: op {} admitted degraded with no fault", o.id),
                );
            }
            let mut decided: Vec<Answered> = window.decided.clone();
            decided.sort_by_key(|(_, a)| a.sequence);
            let demand: u64 = decided.iter().map(|(o, _)| o.cost).sum();
            let mut used = 0;
            for (o, a) in &decided {
                let expect = used + o.cost <= l;
                if expect {
                    used += o.cost;
                }
                if a.allowed != expect || a.remaining != l - used {
                    report.violate(
                        "S5",
                        format!(
                            "phase {name}: op {} key {key} window {win}: allowed={} remaining={}, exact model: allowed={expect} remaining={} (demand {demand})",
                            o.id, a.allowed, a.remaining, l - used
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
}
