//! Availability: every op completes within the client deadline, the rings agree soon
//! after the last heal, and keys a nemesis step did not touch keep answering.

use std::collections::{BTreeMap, BTreeSet};

use super::context::{Context, Outcome, Sample};
use super::views::ring_of;
use super::Report;

/// After the last heal, every ring must agree within this many ms.
pub const RING_AGREE_MS: u64 = 5000;

/// AVAIL-deadline: every op completed (ok / fail / info) within the deadline + 1 s.
pub fn deadline(ctx: &Context, report: &mut Report) {
    let deadline_ms = ctx.deadline_ms;
    for op in ctx.ops {
        if matches!(op.outcome, Outcome::Pending) {
            report.violate(
                "AVAIL-deadline",
                format!("op {} (invoked at {}) never completed", op.id, op.invoke),
            );
        } else if op.complete.saturating_sub(op.invoke) > deadline_ms + 1000 {
            report.violate(
                "AVAIL-deadline",
                format!(
                    "op {} took {} ms (deadline {deadline_ms})",
                    op.id,
                    op.complete - op.invoke
                ),
            );
        }
    }
}

/// AVAIL-rings: after the last heal, a sampling round where every node answers with the
/// same digest and a ring equal to the sampled node set, within `RING_AGREE_MS`. Sets
/// `report.ring_agree_ms`.
pub fn rings_agree(ctx: &Context, report: &mut Report) {
    let Some(heal) = ctx.faults().map(|e| e.end).max() else {
        return;
    };
    let mut rounds: BTreeMap<u64, Vec<&Sample>> = BTreeMap::new();
    for s in ctx.samples.iter().filter(|s| s.t >= heal) {
        rounds.entry(s.round).or_default().push(s);
    }
    let agreed = rounds.values().find(|round| {
        let nodes: BTreeSet<String> = round.iter().map(|s| s.node.clone()).collect();
        round
            .iter()
            .all(|s| s.ok && s.digest == round[0].digest && ring_of(&s.members) == nodes)
    });
    match agreed {
        Some(round) => {
            let t = round[0].t.saturating_sub(heal);
            report.ring_agree_ms = Some(t);
            if t > RING_AGREE_MS {
                report.violate(
                    "AVAIL-rings",
                    format!("rings agreed only {t} ms after the last heal (> {RING_AGREE_MS})"),
                );
            }
        }
        None => report.violate(
            "AVAIL-rings",
            "rings never agreed after the last heal".into(),
        ),
    }
}

/// How one nemesis step hurt the clients (a row of the summary).
pub struct Impact {
    /// "#n kind victim".
    pub event: String,
    /// Seconds (100 ms slots) in which some op failed, timed out or fell back, from the
    /// step's start to the next step.
    pub seconds: f64,
    /// Ops on untouched keys that failed or timed out (each one a violation).
    pub failed: usize,
    /// Ops on untouched keys answered by a fail-open fallback.
    pub degraded: usize,
}

/// AVAIL-unfaulted: during a nemesis step, ops sent to another node for a key whose
/// owner (on the rings agreed before the step and after it settled) is neither the
/// victim nor moved by the step all succeed. Returns every step's impact.
pub fn unfaulted(ctx: &Context, report: &mut Report) -> Vec<Impact> {
    let mut impacts = Vec::new();
    for (i, e) in ctx.events.iter().enumerate() {
        if e.skipped {
            continue;
        }
        let until = ctx.events.get(i + 1).map_or(e.settled + 2000, |n| n.start);
        let before = ctx.views.agreed_ring_at(ctx.samples, e.start, true);
        let after = ctx.views.agreed_ring_at(ctx.samples, e.settled, false);
        let mut slots = BTreeSet::new();
        let (mut failed, mut degraded) = (0, 0);
        for op in ctx
            .ops
            .iter()
            .filter(|o| o.invoke >= e.start && o.invoke <= until)
        {
            let hurt = match &op.outcome {
                Outcome::Ok(a) => a.fallback(),
                _ => true,
            };
            if hurt {
                slots.insert(op.complete.min(op.invoke + ctx.deadline_ms) / 100);
            }
            let (Some(b), Some(a)) = (before, after) else {
                continue;
            };
            let owner = b.owner(op.key.as_bytes());
            let untouched = op.node != e.victim
                && owner != Some(e.victim.as_str())
                && owner == a.owner(op.key.as_bytes());
            if untouched && op.invoke <= e.settled {
                match &op.outcome {
                    Outcome::Ok(a) if a.fallback() => degraded += 1,
                    Outcome::Ok(_) => {}
                    _ => {
                        failed += 1;
                        report.violate(
                            "AVAIL-unfaulted",
                            format!(
                                "nemesis #{} {} {}: op {} (key {} owned by {:?}, asked {}) failed or timed out",
                                e.n, e.kind, e.victim, op.id, op.key, owner, op.node
                            ),
                        );
                    }
                }
            }
        }
        impacts.push(Impact {
            event: format!("#{} {} {}", e.n, e.kind, e.victim),
            seconds: slots.len() as f64 / 10.0,
            failed,
            degraded,
        });
    }
    impacts
}
