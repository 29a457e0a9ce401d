//! S4, no false deny: a denial is legal only if what was admitted plus what is in doubt
//! could exceed the limit it was decided against.

use super::context::{Answer, Context, Op, Window};
use super::Report;

/// S4 over every fixed-window denial: a decided denial against L, a fail-open fallback
/// denial against its fallback limit, a deny-cache answer against an earlier real denial
/// (or in-doubt op) through the same entry node.
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
            let why = if !a.degraded {
                decided(ctx.l, window, in_doubt, o, a)
            } else if a.fallback() {
                fallback(window, in_doubt, o, a)
            } else {
                cached(window, *win, o)
            };
            if let Some(why) = why {
                report.violate("S4", format!("op {} key {key} window {win}: {why}", o.id));
            }
        }
    }
}

/// A decider's denial: the admissions it may have seen plus every charge in doubt must
/// leave less than the cost.
fn decided(l: u64, window: &Window, in_doubt: &[&Op], o: &Op, a: &Answer) -> Option<String> {
    let admitted: u64 = window
        .decided
        .iter()
        .filter(|(x, b)| b.allowed && x.invoke <= o.complete)
        .map(|(x, _)| x.cost)
        .sum();
    let doubt: u64 = in_doubt
        .iter()
        .filter(|x| x.invoke <= o.complete && x.id != o.id)
        .map(|x| x.cost)
        .sum();
    (admitted + doubt + o.cost <= l).then(|| {
        format!(
            "denied cost {} by {}@{} although at most {admitted} admitted + {doubt} in doubt (L={l})",
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
/// this entry node, or an op of unknown outcome through it.
fn cached(window: &Window, win: u64, o: &Op) -> Option<String> {
    let justified = window.ops.iter().any(|x| {
        x.node == o.node
            && x.invoke <= o.complete
            && x.id != o.id
            && (x.is_info()
                || x.ok().is_some_and(|b| {
                    !b.allowed
                        && !b.degraded
                        && b.hops == 1
                        && b.window_id == Some(win)
                        && x.cost <= o.cost
                }))
    });
    (!justified).then(|| {
        format!(
            "cached denial (cost {}) without an earlier denial of cost ≤ it through {}",
            o.cost, o.node
        )
    })
}
