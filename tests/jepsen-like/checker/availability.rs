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
                // A fail-over answer is degraded like a fallback: the owner was lost.
                Outcome::Ok(a) => a.fallback() || a.failover,
                _ => true,
            };
            if hurt {
                slots.insert(op.complete.min(op.invoke + ctx.deadline_ms) / 100);
            }
            let (Some(b), Some(a)) = (before, after) else {
                continue;
            };
            let owner = b.owner(op.key.as_bytes());
            // A kill-both step names its two victims "a+b".
            let victims: Vec<&str> = e.victim.split('+').collect();
            let untouched = !victims.contains(&op.node.as_str())
                && owner.is_none_or(|o| !victims.contains(&o))
                && owner == a.owner(op.key.as_bytes());
            if untouched && op.invoke <= e.settled {
                match &op.outcome {
                    Outcome::Ok(a) if a.fallback() || a.failover => degraded += 1,
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

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    const RING3: &str = "n1 n2 n3";
    const ALL: [(&str, &str); 3] = [("n1", RING3), ("n2", RING3), ("n3", RING3)];

    #[test]
    fn ops_completing_within_the_deadline_plus_a_second_pass() {
        let mut h = Hist::new();
        let id = h.invoke(T0, "n1", FW, "k", 1);
        h.fail(id, T0 + 3000);
        let id = h.invoke(T0, "n1", FW, "k", 1);
        h.info(id, T0 + 2000);
        h.fw(T0, "n1", "k", 1, "n1");
        assert_eq!(run(&h, deadline).count("AVAIL-deadline"), 0);
    }

    #[test]
    fn an_op_late_or_never_completed_fails() {
        let mut h = Hist::new();
        let id = h.invoke(T0, "n1", FW, "k", 1);
        h.info(id, T0 + 3001);
        h.invoke(T0, "n1", FW, "k", 1);
        let r = run(&h, deadline);
        assert_eq!(
            messages(&r, "AVAIL-deadline"),
            [
                "op 1 took 3001 ms (deadline 2000)".to_string(),
                format!("op 2 (invoked at {T0}) never completed")
            ]
        );
    }

    /// n3 killed at T0 and restarted at T0 + 1 s; rounds every 200 ms from T0 - 3 s,
    /// n3 silent while down, every ring agreeing from `agree` on.
    fn kill_restart(h: &mut Hist, agree: u64) {
        h.nemesis(1, "kill-restart", "n3", T0, T0 + 1000, T0 + 1500);
        h.rounds(T0 - 3000, T0, &ALL);
        h.rounds(T0, T0 + 1000, &[("n1", RING3), ("n2", RING3), ("n3", DOWN)]);
        h.rounds(
            T0 + 1000,
            agree,
            &[("n1", "n1 n2"), ("n2", "n1 n2"), ("n3", RING3)],
        );
        h.rounds(agree, agree + 3000, &ALL);
    }

    #[test]
    fn rings_agreeing_soon_after_the_last_heal_pass() {
        let mut h = Hist::new();
        kill_restart(&mut h, T0 + 1400);
        let r = run(&h, rings_agree);
        assert_eq!((r.count("AVAIL-rings"), r.ring_agree_ms), (0, Some(400)));
    }

    #[test]
    fn rings_agreeing_late_after_the_last_heal_fail() {
        let mut h = Hist::new();
        kill_restart(&mut h, T0 + 6200);
        let r = run(&h, rings_agree);
        assert_eq!((r.count("AVAIL-rings"), r.ring_agree_ms), (1, Some(5200)));
    }

    #[test]
    fn rings_that_leave_out_a_sampled_node_do_not_agree() {
        // Every node answers the same digest, but n3 is not on that ring.
        let mut h = Hist::new();
        h.nemesis(1, "kill-restart", "n3", T0, T0 + 1000, T0 + 1500);
        h.rounds(
            T0 + 1000,
            T0 + 4000,
            &[("n1", "n1 n2"), ("n2", "n1 n2"), ("n3", "n1 n2")],
        );
        let r = run(&h, rings_agree);
        assert_eq!(
            messages(&r, "AVAIL-rings"),
            ["rings never agreed after the last heal".to_string()]
        );
    }

    #[test]
    fn skipped_steps_are_not_heals_and_no_step_means_nothing_to_check() {
        let mut h = Hist::new();
        kill_restart(&mut h, T0 + 1400);
        h.skipped(2, "partition", "n1", T0 + 30_000);
        assert_eq!(run(&h, rings_agree).ring_agree_ms, Some(400));
        let mut h = Hist::new();
        h.rounds(T0, T0 + 1000, &ALL);
        let r = run(&h, rings_agree);
        assert_eq!((r.count("AVAIL-rings"), r.ring_agree_ms), (0, None));
    }

    #[test]
    fn an_untouched_key_answering_during_a_step_passes() {
        let mut h = Hist::new();
        kill_restart(&mut h, T0 + 1400);
        let key = key_owned_by(RING3, "n2", |_| true);
        h.fw(T0 + 500, "n1", &key, 1, "n2");
        let (impacts, r) = run_with(&h, unfaulted);
        assert_eq!(r.count("AVAIL-unfaulted"), 0);
        assert_eq!(impacts.len(), 1);
        assert_eq!(impacts[0].event, "#1 kill-restart n3");
        assert_eq!((impacts[0].seconds, impacts[0].failed), (0.0, 0));
    }

    #[test]
    fn an_untouched_key_failing_during_a_step_fails() {
        let mut h = Hist::new();
        kill_restart(&mut h, T0 + 1400);
        let key = key_owned_by(RING3, "n2", |_| true);
        let id = h.invoke(T0 + 500, "n1", FW, &key, 1);
        h.fail(id, T0 + 700);
        let id = h.invoke(T0 + 600, "n1", FW, &key, 1);
        h.ok(id, T0 + 2600, Ans::fallback("n1", 1, true, 2, 3));
        let (impacts, r) = run_with(&h, unfaulted);
        assert_eq!(r.count("AVAIL-unfaulted"), 1);
        // Slots of 100 ms: the failure at T0 + 700, the fallback at its deadline.
        let i = &impacts[0];
        assert_eq!((i.seconds, i.failed, i.degraded), (0.2, 1, 1));
    }

    #[test]
    fn keys_of_the_victim_or_asked_of_it_may_fail() {
        let mut h = Hist::new();
        kill_restart(&mut h, T0 + 1400);
        let victims = key_owned_by(RING3, "n3", |_| true);
        let id = h.invoke(T0 + 500, "n1", FW, &victims, 1);
        h.fail(id, T0 + 700);
        let other = key_owned_by(RING3, "n2", |_| true);
        let id = h.invoke(T0 + 500, "n3", FW, &other, 1);
        h.fail(id, T0 + 501);
        assert_eq!(run(&h, unfaulted).count("AVAIL-unfaulted"), 0);
    }
}
