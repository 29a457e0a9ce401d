//! S2, per-decider sequential validity: one decider's answers, sorted by sequence
//! number, are answers the algorithm could have given in that order.

use std::collections::HashMap;

use super::context::{Answered, Context, Outcome};
use super::Report;

/// S2: fixed-window answers carry a window id inside the op's time span; sequence
/// numbers are unique per decider; per decider and key, by sequence: the window id
/// never goes back, `remaining` ≤ L and consistent with the verdict, never goes up inside
/// a window and drops by at least each admitted cost; and where no fault and no in-doubt
/// op touches the window, an exact replay of the fixed window model.
///
/// Budget leases: a leased answer carries no sequence number of its own (sequence 0:
/// the decision that counted its units was the owner's grant, which the history does
/// not have), so it is not replayed in the owner's sequence; it is still held to the
/// structural checks (an admission, `remaining` ≤ L − its cost, a window id within
/// the op's span stretched back by a lease's life: `leased`). And on a counter that
/// may have been lent in a window (`Leases::lent_in`), the owner's `remaining` moves
/// by grants (down) and returns of unused units (up) the history does not show: there
/// only the per-answer checks and the window order apply, not the monotone remaining
/// nor the exact replay. Counters never hot at any entry node keep every check.
pub fn sequential(ctx: &Context, report: &mut Report) {
    window_ids(ctx, report);
    unique_sequences(ctx, report);
    leased(ctx, report);
    for ((d, g), keys) in &ctx.by_decider {
        for (key, answers) in keys {
            replay(ctx, d, *g, key, answers, report);
        }
    }
}

fn window_ids(ctx: &Context, report: &mut Report) {
    let w = ctx.w;
    for op in &ctx.fw_ops {
        let Outcome::Ok(a) = &op.outcome else {
            continue;
        };
        let Some(win) = a.window_id else {
            report.violate(
                "S2",
                format!("op {}: fixed window answer without window id", op.id),
            );
            continue;
        };
        // On the decider's clock, which the clock-offset nemesis may have moved; a state
        // handed over from a node whose clock was ahead keeps its window, so any node's
        // offset bounds it. A leased answer names the window of the grant, which may
        // come a lease's life before the op.
        let invoke = if a.leased {
            ctx.leases.charged_from(op)
        } else {
            op.invoke
        };
        let (first, last) = (
            ctx.clocks.earliest(invoke, op.complete),
            ctx.clocks.latest(op.complete),
        );
        if !(win * w <= last && (win + 1) * w > first.saturating_sub(1)) {
            report.violate(
                "S2",
                format!(
                    "op {}: window id {win} outside the op's time span [{}, {}]",
                    op.id, op.invoke, op.complete
                ),
            );
        }
    }
}

/// Every route: a decider's shard (or an entry node's fallback) numbers its decisions.
fn unique_sequences(ctx: &Context, report: &mut Report) {
    let mut seqs: HashMap<(String, u64), HashMap<u64, u64>> = HashMap::new();
    for op in ctx.ops {
        let Some(a) = op.ok() else { continue };
        // Fail-over answers too: the successor's shard numbers them with its own.
        if (a.decides() || a.fallback()) && a.sequence > 0 {
            if let Some(other) = seqs
                .entry(a.decider_id())
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
}

/// A leased answer is an admission the owner charged on its counter: allowed, and
/// `remaining` (never more than the owner's after the grant) leaves room for its cost
/// under L. Leases only with leases on, and only for fixed windows, token buckets
/// (and GCRA, sliding counters), never a sliding log.
fn leased(ctx: &Context, report: &mut Report) {
    for op in ctx.ops {
        let Some(a) = op.ok().filter(|a| a.leased) else {
            continue;
        };
        let log = ctx.sliding_log.is_some_and(|r| r.route == op.route);
        if !ctx.leases.on || log || !a.allowed || a.degraded || a.remaining + op.cost > a.limit {
            report.violate(
                "S2",
                format!(
                    "op {} route {}: leased answer allowed={} degraded={} remaining={} for cost {} (leases on: {})",
                    op.id, op.route, a.allowed, a.degraded, a.remaining, op.cost, ctx.leases.on
                ),
            );
        }
    }
}

/// No fault near the window (5 s before it to 1 s after, against each step's start to
/// 2 s after it settled): nothing can have interfered with one decider's count.
fn quiet(ctx: &Context, win: u64) -> bool {
    let w = ctx.w;
    let (lo, hi) = ((win * w).saturating_sub(5000), (win + 1) * w + 1000);
    !ctx.events
        .iter()
        .any(|e| e.start <= hi && e.settled + 2000 >= lo)
}

/// One decider's answers for one key, in sequence order.
fn replay(ctx: &Context, d: &str, g: u64, key: &str, answers: &[Answered], report: &mut Report) {
    let l = ctx.l;
    let mut prev: Option<Answered> = None;
    let mut used = 0u64;
    for &(o, a) in answers {
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
        // Grants and returns the history does not show move this count (`sequential`).
        let lent = ctx.leases.lent_in(key, &o.route, win, ctx.w);
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
            if same_window && !lent {
                let spent = if a.allowed { o.cost } else { 0 };
                if a.remaining + spent > p.remaining {
                    report.violate(
                        "S2",
                        format!(
                            "ops {} → {}: {}@{} key {key} window {win}: remaining {} → {} with {} spent",
                            po.id, o.id, d, g, p.remaining, a.remaining, spent
                        ),
                    );
                }
            }
        }
        if !same_window {
            used = 0;
        }
        // Exact replay where nothing can have interfered.
        if lent {
            // Nothing to replay: the count includes lent units.
        } else if quiet(ctx, win) && !ctx.doubt.contains_key(&(key.to_string(), win)) {
            let expect_allowed = used + o.cost <= l;
            if expect_allowed {
                used += o.cost;
            }
            if a.allowed != expect_allowed || a.remaining != l - used {
                report.violate(
                    "S2",
                    format!(
                        "op {}: {}@{} key {key} window {win}: answered allowed={} remaining={}, the model says allowed={expect_allowed} remaining={}",
                        o.id, d, g, a.allowed, a.remaining, l - used
                    ),
                );
                used = l - a.remaining.min(l);
            }
        } else if a.allowed {
            used += o.cost;
        }
        prev = Some((o, a));
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    fn s2(h: &Hist) -> Vec<String> {
        messages(&run(h, sequential), "S2").to_vec()
    }

    #[test]
    fn answers_replaying_the_model_pass() {
        let mut h = Hist::new();
        h.fw_many(L + 3, T0, "n1", "k", "n1");
        h.fw(T0 + 500, "n2", "k", 3, "n1");
        h.fw_many(4, T0 + W, "n2", "k", "n1");
        h.fw_many(5, T0, "n1", "other", "n1");
        assert_eq!(s2(&h), Vec::<String>::new());
    }

    #[test]
    fn a_fixed_window_answer_without_window_id_fails() {
        let mut h = Hist::new();
        h.check(
            T0,
            "n1",
            FW,
            "k",
            1,
            Ans::decided("n1", 1, true, 9).no_window(),
        );
        assert!(s2(&h)[0].contains("without window id"));
    }

    #[test]
    fn a_window_id_outside_the_ops_time_span_fails() {
        let mut h = Hist::new();
        h.check(
            T0,
            "n1",
            FW,
            "k",
            1,
            Ans::decided("n1", 1, true, 9).window(T0 / W + 2),
        );
        assert!(s2(&h)
            .iter()
            .any(|m| m.contains("outside the op's time span")));
    }

    #[test]
    fn a_sequence_number_used_twice_fails() {
        let mut h = Hist::new();
        h.check(T0, "n1", FW, "k", 1, Ans::decided("n1", 1, true, 9));
        h.check(T0 + 10, "n1", LOG, "k", 1, Ans::decided("n1", 1, true, 7));
        assert!(s2(&h).iter().any(|m| m.contains("used sequence 1 twice")));
    }

    #[test]
    fn the_same_sequence_number_in_two_generations_passes() {
        let mut h = Hist::new();
        h.check(T0, "n1", FW, "k", 1, Ans::decided("n1", 1, true, 9));
        h.check(
            T0 + 10,
            "n1",
            FW,
            "k",
            1,
            Ans::decided("n1", 1, true, 9).generation(2),
        );
        assert_eq!(s2(&h), Vec::<String>::new());
    }

    #[test]
    fn a_window_id_going_back_fails() {
        let mut h = Hist::new();
        let win = T0 / W;
        let id = h.invoke(T0 + 1990, "n1", FW, "k", 1);
        h.ok(
            id,
            T0 + W + 10,
            Ans::decided("n1", 1, true, 9).window(win + 1),
        );
        let id = h.invoke(T0 + 1995, "n1", FW, "k", 1);
        h.ok(id, T0 + W + 20, Ans::decided("n1", 2, true, 9).window(win));
        assert!(s2(&h).iter().any(|m| m.contains("window id went back")));
    }

    #[test]
    fn a_denial_with_enough_remaining_fails() {
        let mut h = Hist::new();
        h.check(T0, "n1", FW, "k", 2, Ans::decided("n1", 1, false, 2));
        assert!(s2(&h)[0].contains("answered allowed=false remaining=2 for cost 2"));
    }

    /// n1's answers for key k in window T0: `remaining` after each cost-1 check.
    fn answers(h: &mut Hist, allowed_remaining: &[(bool, u64)]) {
        for (i, (allowed, rem)) in allowed_remaining.iter().enumerate() {
            let seq = h.seq("n1", 1);
            let t = T0 + 100 + 10 * i as u64;
            h.check(t, "n1", FW, "k", 1, Ans::decided("n1", seq, *allowed, *rem));
        }
    }

    #[test]
    fn remaining_going_up_inside_a_window_fails_even_near_a_fault() {
        // Finding 1 (fixed in the product): after a handoff the old owner decided late
        // forwarded checks on a fresh counter under the same identity: remaining 5 → 9.
        let mut h = Hist::new();
        h.nemesis(1, "add", "n4", T0 - 1000, T0 - 1000, T0 - 500);
        answers(&mut h, &[(true, 6), (true, 5), (true, 9)]);
        assert!(s2(&h)
            .iter()
            .any(|m| m.contains("remaining 5 → 9 with 1 spent")));
    }

    #[test]
    fn a_count_merged_from_a_handoff_near_a_fault_passes() {
        // The new owner merges the old owner's count: remaining drops by more than its
        // own admissions. Near a fault only the structural checks apply.
        let mut h = Hist::new();
        h.nemesis(1, "leave", "n2", T0 - 1000, T0 - 1000, T0 - 500);
        answers(&mut h, &[(true, 9), (true, 4), (true, 3)]);
        assert_eq!(s2(&h), Vec::<String>::new());
    }

    #[test]
    fn a_count_merged_from_an_in_doubt_op_passes() {
        // An op of unknown outcome may have been charged in the window.
        let mut h = Hist::new();
        let id = h.invoke(T0 + 50, "n2", FW, "k", 5);
        h.info(id, T0 + 50 + 2000);
        answers(&mut h, &[(true, 9), (true, 3)]);
        assert_eq!(s2(&h), Vec::<String>::new());
    }

    #[test]
    fn a_count_jump_in_a_quiet_window_fails_the_exact_replay() {
        let mut h = Hist::new();
        answers(&mut h, &[(true, 9), (true, 4), (true, 3)]);
        let msgs = s2(&h);
        assert_eq!(msgs.len(), 1, "{msgs:?}");
        assert!(msgs[0].contains("the model says allowed=true remaining=8"));
    }

    #[test]
    fn a_denial_the_model_would_admit_in_a_quiet_window_fails() {
        let mut h = Hist::new();
        answers(&mut h, &[(true, 9), (false, 0)]);
        assert!(s2(&h)[0].contains("the model says allowed=true remaining=8"));
    }

    #[test]
    fn a_quiet_window_is_five_seconds_clear_of_any_fault() {
        // A step that settled 2 s + 5 s before the window leaves it quiet.
        let mut h = Hist::new();
        h.nemesis(1, "pause", "n2", T0 - 9000, T0 - 8000, T0 - 7001);
        answers(&mut h, &[(true, 9), (true, 4)]);
        assert_eq!(s2(&h).len(), 1);
        let mut h = Hist::new();
        h.nemesis(1, "pause", "n2", T0 - 9000, T0 - 8000, T0 - 7000);
        answers(&mut h, &[(true, 9), (true, 4)]);
        assert_eq!(s2(&h), Vec::<String>::new());
    }
}
