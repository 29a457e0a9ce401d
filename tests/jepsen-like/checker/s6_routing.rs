//! S6, routing: a check is decided by the node asked or forwarded once, never more.

use super::context::Context;
use super::Report;

/// S6: hops ≤ 1; 0 hops ⇔ the node asked decided; a degraded admission only from the
/// entry node's own fail-open fallback.
pub fn routing(ctx: &Context, report: &mut Report) {
    for op in ctx.ops {
        let Some(a) = op.ok() else { continue };
        if a.hops > 1 {
            report.violate("S6", format!("op {} answered after {} hops", op.id, a.hops));
        }
        if !a.degraded {
            if a.hops == 0 && a.decider != op.node {
                report.violate(
                    "S6",
                    format!(
                        "op {}: 0 hops but decided by {} (asked {})",
                        op.id, a.decider, op.node
                    ),
                );
            }
            if a.hops == 1 && a.decider == op.node {
                report.violate(
                    "S6",
                    format!(
                        "op {}: 1 hop but decided by the node asked ({})",
                        op.id, op.node
                    ),
                );
            }
        } else if a.allowed && !(a.fallback() && a.decider == op.node) {
            report.violate(
                "S6",
                format!(
                    "op {}: a degraded admission that is not the entry node's fail-open fallback",
                    op.id
                ),
            );
        }
    }
}
