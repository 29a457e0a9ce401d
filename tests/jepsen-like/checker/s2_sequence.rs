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
pub fn sequential(ctx: &Context, report: &mut Report) {
    window_ids(ctx, report);
    unique_sequences(ctx, report);
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
        if !(win * w <= op.complete && (win + 1) * w > op.invoke.saturating_sub(1)) {
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
        if (!a.degraded || a.fallback()) && a.sequence > 0 {
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
        if quiet(ctx, win) && !ctx.doubt.contains_key(&(key.to_string(), win)) {
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
