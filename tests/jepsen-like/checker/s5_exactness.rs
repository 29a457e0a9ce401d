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
