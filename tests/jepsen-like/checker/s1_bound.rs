//! S1, the per-decider bound: one decider (node id + generation) never admits more than
//! its algorithm allows. Zero tolerance under every fault: it follows from the
//! single-threaded shard actor.

use std::collections::BTreeMap;

use crate::history::RuleInfo;

use super::context::{Context, Op};
use super::Report;

/// S1-fw: per non-degraded decider, key and fixed window, admitted cost ≤ L.
pub fn fixed_window(ctx: &Context, report: &mut Report) {
    let l = ctx.l;
    for ((key, win), window) in &ctx.windows {
        for (d, g) in &window.deciders {
            let admitted: Vec<&Op> = window
                .decided
                .iter()
                .filter(|(_, a)| a.allowed && &a.decider == d && a.generation == *g)
                .map(|(o, _)| *o)
                .collect();
            let cost: u64 = admitted.iter().map(|o| o.cost).sum();
            if cost > l {
                let ids: Vec<u64> = admitted.iter().map(|o| o.id).collect();
                report.violate(
                    "S1-fw",
                    format!("key {key} window {win}: decider {d}@{g} admitted {cost} > L={l} (ops {ids:?})"),
                );
            }
        }
    }
}

/// S1-fallback: per fail-open fallback counter (entry node, fallback limit) and fixed
/// window, admitted ≤ its limit ≤ L.
pub fn fallback(ctx: &Context, report: &mut Report) {
    let l = ctx.l;
    for ((key, win), window) in &ctx.windows {
        for ((d, g, lim), admitted) in &window.fallbacks {
            if admitted > lim || *lim > l {
                report.violate(
                    "S1-fallback",
                    format!("key {key} window {win}: fallback of {d}@{g} admitted {admitted} with fallback limit {lim} (L={l})"),
                );
            }
        }
    }
}

/// S1-log: per non-degraded decider and key of the sliding window log, admissions whose
/// decisions surely lie within less than W (`complete_j − invoke_i < W`) cost ≤ L.
pub fn sliding_log(ctx: &Context, report: &mut Report) {
    let Some(r) = ctx.sliding_log else { return };
    for ((d, g, key), list) in admissions(ctx, r) {
        'from: for i in 0..list.len() {
            let mut sum = 0u64;
            for j in i..list.len() {
                sum += list[j].cost;
                let span = list[j].complete.saturating_sub(list[i].invoke);
                if span + 1 < r.window_ms && sum > r.limit {
                    report.violate(
                        "S1-log",
                        format!(
                            "{d}@{g} key {key}: ops {}..{} admitted {sum} > L={} within {span} ms < W={}",
                            list[i].id, list[j].id, r.limit, r.window_ms
                        ),
                    );
                    continue 'from;
                }
            }
        }
    }
}

/// S1-tb: per non-degraded decider and key of the token bucket, admitted cost over any
/// run of decisions ≤ burst + L × (elapsed upper bound) / W.
pub fn token_bucket(ctx: &Context, report: &mut Report) {
    let Some(r) = ctx.token_bucket else { return };
    for ((d, g, key), list) in admissions(ctx, r) {
        'from: for i in 0..list.len() {
            let mut sum = 0u64;
            for j in i..list.len() {
                sum += list[j].cost;
                let span = list[j].complete.saturating_sub(list[i].invoke);
                let refill = (r.limit * span).div_ceil(r.window_ms);
                if sum > r.burst + refill {
                    report.violate(
                        "S1-tb",
                        format!(
                            "{d}@{g} key {key}: ops {}..{} admitted {sum} > burst {} + refill {refill} over ≤ {span} ms",
                            list[i].id, list[j].id, r.burst
                        ),
                    );
                    continue 'from;
                }
            }
        }
    }
}

/// Non-degraded admissions on `rule`'s route per (decider, generation, key), in
/// sequence order.
fn admissions<'a>(
    ctx: &Context<'a>,
    rule: &RuleInfo,
) -> BTreeMap<(String, u64, String), Vec<&'a Op>> {
    let mut per: BTreeMap<(String, u64, String), Vec<&Op>> = BTreeMap::new();
    for op in ctx.ops.iter().filter(|o| o.route == rule.route) {
        if let Some(a) = op.ok().filter(|a| !a.degraded && a.allowed) {
            per.entry((a.decider.clone(), a.generation, op.key.clone()))
                .or_default()
                .push(op);
        }
    }
    for list in per.values_mut() {
        list.sort_by_key(|o| o.ok().map(|a| a.sequence));
    }
    per
}
