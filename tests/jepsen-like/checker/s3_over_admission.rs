//! S3, bounded over-admission: each ownership change of a key during a window can admit
//! up to L more in that window, and every decider must have owned the key in some node's
//! ring view around that time.

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
}

/// S3-bound: per (key, window), admitted ≤ L × D + Σ fallback limits, D = distinct
/// non-degraded deciders.
pub fn bound(ctx: &Context, report: &mut Report) -> OverAdmission {
    let l = ctx.l;
    let mut out = OverAdmission {
        admitted: 0,
        windows_over: 0,
        worst: (i64::MIN, String::new()),
    };
    for ((key, win), window) in &ctx.windows {
        let d = window.deciders.len();
        let total: u64 = window
            .answers
            .iter()
            .filter(|(_, a)| a.allowed && (!a.degraded || a.fallback()))
            .map(|(o, _)| o.cost)
            .sum();
        out.admitted += total;
        let fallback_limits: u64 = window.fallbacks.keys().map(|(_, _, lim)| *lim).sum();
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
/// sampled ring (or a view between two samples) within ±`VIEW_SLACK_MS` of the op.
pub fn owner(ctx: &Context, report: &mut Report) {
    for op in ctx.ops {
        let Some(a) = op.ok().filter(|a| !a.degraded) else {
            continue;
        };
        if !ctx
            .views
            .owned_by(&op.key, &a.decider, op.invoke, op.complete)
        {
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
