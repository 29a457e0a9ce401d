//! The summary table printed after every run (docs/chaos.md, "Reading the summary").

use std::fmt::Write as _;

use super::availability::Impact;
use super::context::{Context, Op, Outcome};
use super::observability::Resets;
use super::s3_over_admission::OverAdmission;
use super::s3_replicated::Replicated;
use super::{Report, PROPERTIES};

/// The numbers the properties computed on the way.
pub struct Stats {
    pub over: OverAdmission,
    pub replicated: Replicated,
    pub s5_windows: usize,
    pub impacts: Vec<Impact>,
    pub resets: Resets,
    pub fence: super::fence::FenceStats,
}

pub fn render(ctx: &Context, stats: &Stats, report: &Report) -> String {
    let ops = ctx.ops;
    let count = |f: &dyn Fn(&Op) -> bool| ops.iter().filter(|o| f(o)).count();
    let ok = count(&|o| o.ok().is_some());
    let fail = count(&|o| matches!(o.outcome, Outcome::Fail));
    let info = count(&|o| o.is_info());
    let admitted = count(&|o| o.ok().is_some_and(|a| a.allowed));
    let degraded = count(&|o| o.ok().is_some_and(|a| a.fallback()));
    let failovers = count(&|o| o.ok().is_some_and(|a| a.failover));
    let cached = count(&|o| {
        o.ok()
            .is_some_and(|a| a.degraded && !a.fallback() && !a.failover)
    });
    let max_deciders = ctx
        .windows
        .values()
        .map(|w| w.deciders.len())
        .max()
        .unwrap_or(0);
    let (over, resets) = (&stats.over, &stats.resets);
    let mut s = String::new();
    let _ = writeln!(s, "| metric | value |");
    let _ = writeln!(s, "|---|---|");
    let _ = writeln!(
        s,
        "| ops (ok / fail / info) | {} ({ok} / {fail} / {info}) |",
        ops.len()
    );
    let _ = writeln!(s, "| admitted ops (all routes) | {admitted} |");
    let _ = writeln!(
        s,
        "| fail-open fallback answers / fail-over answers / deny-cache answers | {degraded} / {failovers} / {cached} |"
    );
    let _ = writeln!(
        s,
        "| fixed window: admitted cost / (key, window)s | {} / {} |",
        over.admitted,
        ctx.windows.len()
    );
    let _ = writeln!(s, "| max deciders per (key, window) | {max_deciders} |");
    let _ = writeln!(
        s,
        "| over-admission vs bound | {} (key, window)s above L; worst: {} |",
        over.windows_over,
        if over.worst.0 > 0 {
            format!("+{} over L ({})", over.worst.0, over.worst.1)
        } else {
            "none".into()
        }
    );
    let causes: Vec<String> = over
        .by_cause
        .iter()
        .map(|(cause, (n, worst))| format!("{cause}: {n} (+{worst})"))
        .collect();
    let _ = writeln!(
        s,
        "| above L by the faults around the window: count (worst excess) | {} |",
        if causes.is_empty() {
            "none".into()
        } else {
            causes.join("; ")
        }
    );
    replicated_rows(&mut s, &stats.replicated);
    fence_rows(&mut s, &stats.fence);
    if ctx.leases.on {
        let leased = count(&|o| o.ok().is_some_and(|a| a.leased));
        let _ = writeln!(
            s,
            "| budget leases: leased answers / counters maybe lent / decided denials only lent units explain | {leased} / {} / {} |",
            ctx.leases.counters(),
            super::s4_no_false_deny::lent_denials(ctx)
        );
        let ledger = match &ctx.leases.ledger {
            Some(l) => format!("{} / {}", l.len().0, l.len().1),
            None => "not recorded (S4 lets a lent counter's denials through)".into(),
        };
        let _ = writeln!(
            s,
            "| budget leases: ledger grants / returns (S4 bounds denials by them) | {ledger} |"
        );
    }
    let _ = writeln!(
        s,
        "| S5 (key, window)s checked in fault-free phases | {} |",
        stats.s5_windows
    );
    let _ = writeln!(
        s,
        "| rings agree after the last heal | {} |",
        report
            .ring_agree_ms
            .map_or("n/a".into(), |t| format!("{:.1} s", t as f64 / 1000.0))
    );
    let _ = writeln!(
        s,
        "| keys reset after crashes (history) vs metrics | {} vs {} resets + {} restarts |",
        resets.keys(),
        resets.metric_resets,
        resets.metric_restarts
    );
    let _ = writeln!(s);
    if !stats.impacts.is_empty() {
        let _ = writeln!(s, "| nemesis event | seconds with failing or degraded ops | untouched-key ops failed | untouched-key ops degraded |");
        let _ = writeln!(s, "|---|---|---|---|");
        for i in &stats.impacts {
            let _ = writeln!(
                s,
                "| {} | {:.1} | {} | {} |",
                i.event, i.seconds, i.failed, i.degraded
            );
        }
        let _ = writeln!(s);
    }
    let _ = writeln!(s, "| property | violations |");
    let _ = writeln!(s, "|---|---|");
    for p in PROPERTIES {
        let _ = writeln!(s, "| {p} | {} |", report.count(p));
    }
    s
}

/// The FENCE rows: the fenced rule's (key, window)s and what excused those above L.
fn fence_rows(s: &mut String, f: &super::fence::FenceStats) {
    let Some(route) = &f.route else { return };
    let _ = writeln!(
        s,
        "| FENCE {route}: answers / denied undecided (fenced or fail-closed) | {} / {} |",
        f.answers, f.denied_undecided
    );
    let causes: Vec<String> = f
        .by_cause
        .iter()
        .map(|(cause, (n, worst))| format!("{cause}: {n} (+{worst})"))
        .collect();
    let _ = writeln!(
        s,
        "| FENCE {route}: (key, window)s admitted / above L / excused by cause (worst excess) | {} / {} / {} |",
        f.windows,
        f.above_l,
        if causes.is_empty() {
            "none".into()
        } else {
            causes.join("; ")
        }
    );
}

/// The S3-replicated rows: the crash bound with successor replicas.
fn replicated_rows(s: &mut String, r: &Replicated) {
    let excess = |n: i64| {
        if n > 0 {
            format!("+{n}")
        } else {
            "none".into()
        }
    };
    let _ = writeln!(
        s,
        "| S3-replicated: replication interval / loss window / asserted | {} / {} ms / {} |",
        if r.interval_ms == 0 {
            "off".to_string()
        } else {
            format!("{} ms", r.interval_ms)
        },
        r.loss_ms,
        if r.asserted { "yes" } else { "no" }
    );
    let _ = writeln!(
        s,
        "| S3-replicated: owner crashed alone: (key, window)s checked / above L / worst excess / largest loss window needed | {} / {} / {} / {} |",
        r.checked,
        r.above_l,
        excess(r.worst_excess),
        match r.needed_ms {
            u64::MAX => "more than any (a successor started from less than the replica)".to_string(),
            ms => format!("{ms} ms"),
        }
    );
    let _ = writeln!(
        s,
        "| S3-replicated: tightest margin (bound − admitted) | {} |",
        r.tightest
            .as_ref()
            .map_or("n/a".into(), |(m, at)| format!("{m} ({at})"))
    );
    let _ = writeln!(
        s,
        "| owner and successor crashed together: (key, window)s / above L / worst excess (bound L × D) | {} / {} / {} |",
        r.with_successor,
        r.with_successor_above_l,
        excess(r.with_successor_worst)
    );
    let _ = writeln!(
        s,
        "| crash windows with another decider too (bound L × D) | {} |",
        r.mixed
    );
}
