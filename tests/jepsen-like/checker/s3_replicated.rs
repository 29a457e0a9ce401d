//! S3-replicated, the crash bound with successor replicas (issue 23): when a key's owner
//! crashes alone (kill -9, its successor alive), the successor goes on from the replica
//! the owner last sent it, so the (key, window) admits above L at most what the dead
//! owner admitted after its last replication round reached the successor.
//!
//! How the history names the owner and the successor of a key at the crash: the ring
//! every sampled node agreed on in the last sampling round before the kill
//! (`Views::agreed_ring_at`), rebuilt with the product's own `Ring` (deterministic:
//! members and vnodes), `Ring::owner` and `Ring::successor_of_hash(Ring::key_hash(key))`
//! (the placement is the client key's hash, as the router's). The killed incarnations are
//! the `exit` lines ("kill -9", written when SIGKILL is sent); kills within
//! `SAME_STEP_MS` of each other are one step (the owner-and-successor nemesis).

use std::collections::{BTreeMap, BTreeSet};

use ringlimit::ring::Ring;

use super::context::{Answered, Context, Decider, Exit, Window};
use super::Report;

/// The `--replicate-interval-ms` operators are told to use (50 ms): the loss window a
/// forced check of a run without replication uses (the negative control).
pub const DEFAULT_INTERVAL_MS: u64 = 50;
/// Kills this close together are one nemesis step (both of a kill-both step are sent
/// within a millisecond; two steps are at least a settle time, ≥ 1 s, apart).
const SAME_STEP_MS: u64 = 500;
/// A kill this long after a window's end on the deciders' clocks cannot have caused a
/// change of decider inside it.
const AFTER_WINDOW_MS: u64 = 1000;

/// How long before its death an owner's admissions may be missing from its successor's
/// replica, for interval `r`: `2 r`.
///
/// The replicator drains the changed keys every `r` and sends each successor its
/// batch, one `Peer/Replicate` call in flight per successor (`cluster::outbox`: a
/// successor whose batch is still in flight gets the keys that wait for it at the
/// first tick after its batch returns; no other successor and no fail-over push holds
/// its batch back). At the death T, the last batch the successor holds was drained at
/// d; the next one was drained at d' ≤ d + r + (that batch's duration) and either was
/// in flight at T or had not been drained yet. So what is lost was decided in (d, T],
/// and T − d < r + (two batches' durations). A batch to a live successor is one call on
/// loopback: ~1–5 ms, far under r. Hence 2 r, which at the default 50 ms is
/// 100 ms. Each admission decided in (d, T] was acknowledged at or after its decision,
/// so counting the acknowledged admissions that completed at or after T − 2 r is an
/// upper bound of what the replica misses (an admission whose answer was lost with the
/// process is not acknowledged and not counted in the admitted total either). T is
/// when SIGKILL was sent, no later than the death. `needed_ms` in the report says how
/// much of this window the run actually needed: at most 21 ms over 246 checked (key,
/// window)s of a 10-minute long run (seed 20261202, 90 steps, load average 7–12) and
/// 0–3 ms in short runs, so 2 r is not what makes the property pass.
pub fn loss_window_ms(r: u64) -> u64 {
    2 * r
}

/// What the summary shows about S3-replicated.
#[derive(Default)]
pub struct Replicated {
    /// The nodes' interval (ms); 0 = replication off.
    pub interval_ms: u64,
    pub loss_ms: u64,
    /// Whether violations were reported (replication on, or forced).
    pub asserted: bool,
    /// (key, window)s it applied to: the owner crashed alone, and another decider (its
    /// successor, or the owner's restarted incarnation) decided in the window.
    pub checked: usize,
    /// Of those, admitted more than L, and the largest excess over L.
    pub above_l: usize,
    pub worst_excess: i64,
    /// The smallest bound − admitted, and where.
    pub tightest: Option<(i64, String)>,
    /// The largest loss window (ms) any checked (key, window) needed to pass.
    pub needed_ms: u64,
    /// (key, window)s whose owner crashed together with its successor: the old bound
    /// (L × D) applies.
    pub with_successor: usize,
    /// Above L among those, and the largest excess.
    pub with_successor_above_l: usize,
    pub with_successor_worst: i64,
    /// Not checked: another decider (a third node, or a restart after the ring dropped
    /// the owner) decided in the window too; L × D applies.
    pub mixed: usize,
}

/// The crash of one key's owner.
struct Crash<'a> {
    exit: &'a Exit,
    successor: String,
    /// The successor crashed in the same step.
    successor_died: bool,
}

/// S3-replicated. `assert`: report violations (the caller decides: replication on, or
/// forced for the negative control); the figures are computed either way.
pub fn replicated(ctx: &Context, report: &mut Report, assert: bool) -> Replicated {
    let interval = ctx.replicate_interval_ms.unwrap_or(0);
    let loss_ms = loss_window_ms(if interval > 0 {
        interval
    } else {
        DEFAULT_INTERVAL_MS
    });
    let mut out = Replicated {
        interval_ms: interval,
        loss_ms,
        asserted: assert,
        worst_excess: i64::MIN,
        with_successor_worst: i64::MIN,
        ..Replicated::default()
    };
    let kills: BTreeMap<Decider, &Exit> = ctx
        .exits
        .iter()
        .filter(|x| x.how == "kill -9")
        .map(|x| ((x.node.clone(), x.generation), x))
        .collect();
    for ((key, win), window) in &ctx.windows {
        let Some(crash) = crash_of(ctx, &kills, key, *win, window) else {
            continue;
        };
        let total = admitted(window);
        let excess = total as i64 - ctx.l as i64;
        if crash.successor_died {
            out.with_successor += 1;
            if excess > 0 {
                out.with_successor_above_l += 1;
            }
            out.with_successor_worst = out.with_successor_worst.max(excess);
            continue;
        }
        let Some(restarted) = allowed_deciders(ctx, &crash, window) else {
            out.mixed += 1;
            continue;
        };
        out.checked += 1;
        if excess > 0 {
            out.above_l += 1;
        }
        out.worst_excess = out.worst_excess.max(excess);
        let parts = Parts::of(ctx, &crash, window, restarted, loss_ms);
        let bound = ctx.l + parts.lost + parts.fallback + parts.after_restore;
        let margin = bound as i64 - total as i64;
        let here = format!(
            "key {key} window {win}: admitted {total}, bound {bound} = L {} + lost {} (dead owner {}@{}'s admissions acknowledged from {} ms before its kill at {}) + fail-open {} + successor's fail-over after the restart {}",
            ctx.l,
            parts.lost,
            crash.exit.node,
            crash.exit.generation,
            loss_ms,
            crash.exit.t,
            parts.fallback,
            parts.after_restore
        );
        if out.tightest.as_ref().is_none_or(|(m, _)| margin < *m) {
            out.tightest = Some((margin, here.clone()));
        }
        out.needed_ms = out
            .needed_ms
            .max(needed_ms(ctx, &crash, window, &parts, total));
        if margin < 0 && assert {
            report.violate("S3-replicated", here);
        }
    }
    out
}

/// Admitted cost in the window, as S3-bound counts it: decisions on the key's own
/// counters and fail-open fallbacks.
fn admitted(window: &Window) -> u64 {
    window
        .answers
        .iter()
        .filter(|(_, a)| a.allowed && (a.decides() || a.fallback()))
        .map(|(o, _)| o.cost)
        .sum()
}

/// The crash this window is about: a decider of the window was killed (no later than
/// `AFTER_WINDOW_MS` after the window) while it owned the key on the agreed ring, and
/// some other decider decided in the window too (else there is nothing to bound: one
/// decider admits at most L, S1).
fn crash_of<'a>(
    ctx: &Context,
    kills: &BTreeMap<Decider, &'a Exit>,
    key: &str,
    win: u64,
    window: &Window,
) -> Option<Crash<'a>> {
    if window.deciders.len() < 2 {
        return None;
    }
    window.deciders.iter().find_map(|d| {
        let exit = *kills.get(d)?;
        if exit.t > (win + 1) * ctx.w + AFTER_WINDOW_MS {
            return None;
        }
        let ring = ctx.views.agreed_ring_at(ctx.samples, exit.t, true)?;
        if ring.owner(key.as_bytes()) != Some(exit.node.as_str()) {
            return None;
        }
        let successor = ring
            .successor_of_hash(Ring::key_hash(key.as_bytes()))?
            .to_string();
        let successor_died = ctx.exits.iter().any(|x| {
            x.how == "kill -9" && x.node == successor && x.t.abs_diff(exit.t) <= SAME_STEP_MS
        });
        Some(Crash {
            exit,
            successor,
            successor_died,
        })
    })
}

/// Whether every decider of the window is one the crash of the owner alone explains:
/// the dead owner, one generation of the successor, and the owner's next incarnation
/// if it came back before any node's sampled ring dropped it (it then restored the
/// key from the successor's replica before answering as owner); and whether the others
/// decided only after the kill (a successor answering before it was a second decider
/// for another reason: seed 4242, a healed partition's forward in the same window).
/// `None`: some other decider; else `Some(the restarted incarnation, if it decided)`.
fn allowed_deciders(ctx: &Context, crash: &Crash, window: &Window) -> Option<Option<Decider>> {
    let dead = (crash.exit.node.clone(), crash.exit.generation);
    let before_the_kill = window
        .decided
        .iter()
        .chain(&window.failovers)
        .any(|(o, a)| a.decider_id() != dead && o.complete < crash.exit.t);
    if before_the_kill {
        return None;
    }
    let others: Vec<&Decider> = window.deciders.iter().filter(|d| **d != dead).collect();
    let successor_gens: BTreeSet<u64> = others
        .iter()
        .filter(|d| d.0 == crash.successor)
        .map(|d| d.1)
        .collect();
    let restarted: Vec<&Decider> = others
        .iter()
        .copied()
        .filter(|d| d.0 == crash.exit.node && d.1 != crash.exit.generation)
        .collect();
    if successor_gens.len() > 1
        || restarted.len() > 1
        || others
            .iter()
            .any(|d| d.0 != crash.successor && d.0 != crash.exit.node)
    {
        return None;
    }
    let Some(back) = restarted.first() else {
        return Some(None);
    };
    // Its first answer in this window: had any node's ring dropped the owner by then?
    let first = window
        .answers
        .iter()
        .filter(|(_, a)| a.decider_id() == **back)
        .map(|(o, _)| o.invoke)
        .min()?;
    let dropped = ctx.samples.iter().any(|s| {
        s.ok && s.t >= crash.exit.t
            && s.t <= first
            && s.node != crash.exit.node
            && !s
                .members
                .iter()
                .any(|m| m.id == crash.exit.node && !m.leaving)
    });
    (!dropped).then(|| Some((*back).clone()))
}

/// The terms of the bound above L.
struct Parts {
    /// The dead owner's acknowledged admissions completed at or after kill − loss.
    lost: u64,
    /// Fail-open admissions: the entry node reached neither the owner nor the successor
    /// within the forward deadline, the contract's fail-open allowance.
    fallback: u64,
    /// The successor's fail-over admissions that the restarted owner may not have had:
    /// completed at or after its start − loss (it asked for the replicas once started;
    /// later fail-over admissions reach it as a delta, merged, a round later or, if the
    /// push fails, never).
    after_restore: u64,
}

impl Parts {
    fn of(
        ctx: &Context,
        crash: &Crash,
        window: &Window,
        restarted: Option<Decider>,
        loss_ms: u64,
    ) -> Parts {
        let sum = |f: &dyn Fn(&Answered) -> bool| -> u64 {
            window
                .answers
                .iter()
                .filter(|x| x.1.allowed && f(x))
                .map(|(o, _)| o.cost)
                .sum()
        };
        let lost = sum(&|(o, a)| {
            !a.degraded
                && a.decider == crash.exit.node
                && a.generation == crash.exit.generation
                && o.complete + loss_ms >= crash.exit.t
        });
        let fallback = sum(&|(_, a)| a.fallback());
        let after_restore = match restarted {
            None => 0,
            Some((node, generation)) => {
                let start = ctx
                    .spawns
                    .iter()
                    .find(|s| s.node == node && s.generation == generation)
                    .map_or(crash.exit.t, |s| s.t);
                sum(&|(o, a)| {
                    a.failover && a.decider == crash.successor && o.complete + loss_ms >= start
                })
            }
        };
        Parts {
            lost,
            fallback,
            after_restore,
        }
    }
}

/// The shortest loss window (ms before the kill) for which this (key, window) passes:
/// 0 if it passes with no lost admission counted.
fn needed_ms(ctx: &Context, crash: &Crash, window: &Window, parts: &Parts, total: u64) -> u64 {
    let base = ctx.l + parts.fallback + parts.after_restore;
    let mut need = total.saturating_sub(base);
    if need == 0 {
        return 0;
    }
    // The dead owner's admissions, latest first.
    let mut mine: Vec<(u64, u64)> = window
        .decided
        .iter()
        .filter(|(_, a)| {
            a.allowed && a.decider == crash.exit.node && a.generation == crash.exit.generation
        })
        .map(|(o, _)| (o.complete, o.cost))
        .collect();
    mine.sort_unstable_by(|a, b| b.cmp(a));
    for (complete, cost) in mine {
        need = need.saturating_sub(cost);
        if need == 0 {
            return crash.exit.t.saturating_sub(complete);
        }
    }
    u64::MAX
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    const RING3: &str = "n1 n2 n3";
    const ALL: [(&str, &str); 3] = [("n1", RING3), ("n2", RING3), ("n3", RING3)];

    /// A key n3 owns on the 3-node ring, and its successor there.
    fn key_of_n3() -> (String, String) {
        let key = key_owned_by(RING3, "n3", |_| true);
        let succ = ring(RING3)
            .successor_of_hash(Ring::key_hash(key.as_bytes()))
            .unwrap()
            .to_string();
        (key, succ)
    }

    /// n3 owns `key`; replication every 50 ms; n3 admits `before` early in the window
    /// and `late` just before its kill at T0 + 1000; then the successor admits `after`
    /// on fail-over. Returns (history, key, successor).
    fn crash(before: u64, late: u64, after: u64, replicate: u64) -> (Hist, String, String) {
        let (key, succ) = key_of_n3();
        let mut h = Hist::new();
        h.push(crate::history::Entry::Replication {
            t: T0 - 5000,
            interval_ms: replicate,
        });
        h.rounds(T0 - 3000, T0 + 1000, &ALL);
        let entry = if succ == "n1" { "n2" } else { "n1" };
        h.fw_many(before, T0, entry, &key, "n3");
        h.fw_many(late, T0 + 1000 - 10 * late - LATENCY, entry, &key, "n3");
        h.exit(T0 + 1000, "n3", 1, "kill -9");
        let used = before + late;
        for i in 0..after {
            let seq = h.seq(&succ, 1);
            let remaining = L.saturating_sub(used + i + 1);
            h.check(
                T0 + 1200 + 10 * i,
                entry,
                FW,
                &key,
                1,
                Ans::failover(&succ, seq, true, remaining),
            );
        }
        (h, key, succ)
    }

    fn check(h: &Hist, assert: bool) -> (Replicated, Report) {
        run_with(h, |ctx, r| replicated(ctx, r, assert))
    }

    #[test]
    fn a_successor_going_on_from_the_replica_passes_exactly_at_l() {
        // 6 replicated, nothing late: the successor admits the 4 left.
        let (h, _, _) = crash(6, 0, 4, 50);
        let (out, r) = check(&h, true);
        assert_eq!(r.total(), 0, "{}", r.details(5));
        assert_eq!((out.checked, out.above_l, out.worst_excess), (1, 0, 0));
        assert_eq!(out.tightest.unwrap().0, 0);
    }

    #[test]
    fn admissions_of_the_last_interval_may_be_admitted_again() {
        // 3 acknowledged within 100 ms of the kill were not on the replica: L + 3.
        let (h, _, _) = crash(5, 3, 5, 50);
        let (out, r) = check(&h, true);
        assert_eq!(r.total(), 0, "{}", r.details(5));
        assert_eq!((out.above_l, out.worst_excess), (1, 3));
        assert!(out.needed_ms <= 35, "{}", out.needed_ms);
    }

    #[test]
    fn a_successor_starting_from_empty_fails() {
        // Replication off, asserted anyway (the negative control): the successor admits
        // L again after 8 admissions replicated long before the kill.
        let (h, _, _) = crash(8, 0, 10, 0);
        let (out, r) = check(&h, true);
        let msgs = messages(&r, "S3-replicated");
        assert_eq!(msgs.len(), 1, "{msgs:?}");
        assert!(msgs[0].contains("admitted 18, bound 10"), "{msgs:?}");
        assert_eq!(out.worst_excess, 8);
        // Not asserted: the same figures, no violation.
        let (out, r) = check(&h, false);
        assert_eq!((r.total(), out.above_l, out.asserted), (0, 1, false));
    }

    #[test]
    fn owner_and_successor_crashing_together_are_held_to_the_old_bound_only() {
        let (mut h, key, succ) = crash(8, 0, 0, 50);
        h.exit(T0 + 1001, &succ, 1, "kill -9");
        let third = ["n1", "n2"].into_iter().find(|n| *n != succ).unwrap();
        h.fw_many(L, T0 + 1500, third, &key, third);
        let (out, r) = check(&h, true);
        assert_eq!(r.total(), 0);
        assert_eq!(
            (out.checked, out.with_successor, out.with_successor_worst),
            (0, 1, 8)
        );
    }

    #[test]
    fn a_third_decider_in_the_window_is_not_checked() {
        let (mut h, key, succ) = crash(8, 0, 0, 50);
        let third = ["n1", "n2"].into_iter().find(|n| *n != succ).unwrap();
        h.fw_many(L, T0 + 1500, third, &key, third);
        let (out, r) = check(&h, true);
        assert_eq!((r.total(), out.checked, out.mixed), (0, 0, 1));
    }

    #[test]
    fn the_owner_restarted_before_detection_is_checked_with_the_successors_late_admissions() {
        // n3 back as generation 2 at T0 + 1500 (no ring dropped it), restored with the
        // replica (6 + the successor's 2): it admits the 2 left; the successor's later
        // fail-over admission may be missing from what n3 restored.
        let (mut h, key, succ) = crash(6, 0, 2, 50);
        h.push(crate::history::Entry::Spawn {
            t: T0 + 1500,
            node: "n3".into(),
            generation: 2,
            ip: String::new(),
            grpc: String::new(),
            pid: 0,
        });
        h.restart("n3", 2);
        let entry = if succ == "n1" { "n2" } else { "n1" };
        let seq = h.seq(&succ, 1);
        h.check(
            T0 + 1550,
            entry,
            FW,
            &key,
            1,
            Ans::failover(&succ, seq, true, 1),
        );
        for i in 0..2 {
            let seq = h.seq("n3", 2);
            let a = Ans::decided("n3", seq, true, 1 - i).generation(2);
            h.check(T0 + 1600 + 10 * i, entry, FW, &key, 1, a);
        }
        let (out, r) = check(&h, true);
        assert_eq!(r.total(), 0, "{}", r.details(5));
        assert_eq!((out.checked, out.worst_excess), (1, 1));
    }

    #[test]
    fn a_successor_deciding_before_the_kill_is_another_change_not_checked() {
        // Seed 4242 (short profile): right after a partition healed, a forward reached
        // the successor, which decided the key as a second owner in the window in which
        // the owner was then killed: L × D applies, not the crash bound.
        let (mut h, key, succ) = crash(8, 0, 0, 50);
        h.fw_many(5, T0 + 500, "n3", &key, &succ);
        let (out, r) = check(&h, true);
        assert_eq!((r.total(), out.checked, out.mixed), (0, 0, 1));
    }
}
