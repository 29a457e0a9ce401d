//! Checkers. They read only the history (the JSON-lines file) and report, per
//! property, every violation found plus the numbers of the summary table.
//!
//! `context` parses the history once (ops by id, ring samples, nemesis steps, phases)
//! and groups it (fixed-window ops per (key, window) and per decider, charges in doubt
//! per window); `views` rebuilds every node's ring views from the samples; `leases` says
//! which counters may have been lent (budget leases) and from when. Each property
//! of docs/chaos.md is one function over that context:
//!
//! | property | function |
//! |---|---|
//! | S1-fw, S1-fallback, S1-log, S1-tb | `s1_bound::{fixed_window, fallback, sliding_log, token_bucket}` |
//! | S2 | `s2_sequence::sequential` |
//! | S3-bound, S3-owner | `s3_over_admission::{bound, owner}` |
//! | S3-replicated | `s3_replicated::replicated` |
//! | S4 | `s4_no_false_deny::no_false_deny` |
//! | S5 | `s5_exactness::exactness` |
//! | S6 | `s6_routing::routing` |
//! | FENCE | `fence::fenced` |
//! | AVAIL-deadline, AVAIL-rings, AVAIL-unfaulted | `availability::{deadline, rings_agree, unfaulted}` |
//! | OBS (a warning) | `observability::resets` |
//!
//! `summary` renders the table; `testkit` builds small histories for the unit tests.

mod availability;
mod clocks;
mod context;
mod fence;
mod leases;
mod observability;
mod s1_bound;
mod s2_sequence;
mod s3_over_admission;
mod s3_replicated;
mod s4_no_false_deny;
mod s5_exactness;
mod s6_routing;
mod summary;
#[cfg(test)]
mod testkit;
mod views;

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::history::Entry;

use context::{Context, Parsed};

/// Violations per property, warnings, and the summary table of one history.
#[derive(Default)]
pub struct Report {
    /// Property → violation messages.
    pub violations: BTreeMap<&'static str, Vec<String>>,
    pub warnings: Vec<String>,
    pub summary: String,
    pub ring_agree_ms: Option<u64>,
}

impl Report {
    fn violate(&mut self, property: &'static str, message: String) {
        self.violations.entry(property).or_default().push(message);
    }
    pub fn count(&self, property: &str) -> usize {
        self.violations.get(property).map_or(0, Vec::len)
    }
    pub fn total(&self) -> usize {
        self.violations.values().map(Vec::len).sum()
    }
    /// Up to `per` messages per property.
    pub fn details(&self, per: usize) -> String {
        let mut out = String::new();
        for (p, msgs) in &self.violations {
            let _ = writeln!(out, "  {p}: {} violation(s)", msgs.len());
            for m in msgs.iter().take(per) {
                let _ = writeln!(out, "    - {m}");
            }
        }
        for w in &self.warnings {
            let _ = writeln!(out, "  {w}");
        }
        out
    }
}

pub const PROPERTIES: [&str; 16] = [
    "S1-fw",
    "S1-fallback",
    "S1-log",
    "S1-tb",
    "S2",
    "S3-bound",
    "S3-owner",
    "S3-replicated",
    "S4",
    "S5",
    "S6",
    "FENCE",
    "AVAIL-deadline",
    "AVAIL-rings",
    "AVAIL-unfaulted",
    "OBS",
];

/// How to check a history.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// Assert S3-replicated: `None` = when the history's nodes replicated (a
    /// `replication` line with an interval > 0); `Some(true)` forces it on a run without
    /// replication (the negative control: it must fail), `Some(false)` turns it off.
    pub assert_replicated: Option<bool>,
}

/// Check every property of a history.
pub fn check(entries: &[Entry]) -> Report {
    check_with(entries, Options::default())
}

/// Check every property of a history, with `options`.
pub fn check_with(entries: &[Entry], options: Options) -> Report {
    let parsed = Parsed::parse(entries);
    let ctx = Context::new(&parsed);
    let mut report = Report::default();
    report.warnings.extend(ctx.views.warnings.iter().cloned());
    s1_bound::fixed_window(&ctx, &mut report);
    s1_bound::fallback(&ctx, &mut report);
    s1_bound::sliding_log(&ctx, &mut report);
    s1_bound::token_bucket(&ctx, &mut report);
    s2_sequence::sequential(&ctx, &mut report);
    let over = s3_over_admission::bound(&ctx, &mut report);
    s3_over_admission::owner(&ctx, &mut report);
    let replicating = ctx.replicate_interval_ms.is_some_and(|r| r > 0);
    let replicated = s3_replicated::replicated(
        &ctx,
        &mut report,
        options.assert_replicated.unwrap_or(replicating),
    );
    s4_no_false_deny::no_false_deny(&ctx, &mut report);
    let s5_windows = s5_exactness::exactness(&ctx, &mut report);
    s6_routing::routing(&ctx, &mut report);
    let fence = fence::fenced(&parsed, &mut report);
    availability::deadline(&ctx, &mut report);
    availability::rings_agree(&ctx, &mut report);
    let impacts = availability::unfaulted(&ctx, &mut report);
    let resets = observability::resets(&ctx, &mut report);
    let stats = summary::Stats {
        over,
        replicated,
        s5_windows,
        impacts,
        resets,
        fence,
    };
    report.summary = summary::render(&ctx, &stats, &report);
    report
}

#[cfg(test)]
mod tests {
    use super::testkit::*;
    use super::*;

    const RING3: &str = "n1 n2 n3";
    const NODES: [&str; 3] = ["n1", "n2", "n3"];

    /// Rings stable over n1..n3 from T0 - 3 s to T0 + 20 s except while `down` is.
    fn rings(h: &mut Hist, down: Option<(&str, u64, u64)>) {
        let all: Vec<(&str, &str)> = NODES.iter().map(|n| (*n, RING3)).collect();
        let Some((victim, from, to)) = down else {
            h.rounds(T0 - 3000, T0 + 20_000, &all);
            return;
        };
        h.rounds(T0 - 3000, from, &all);
        let during: Vec<(&str, &str)> = NODES
            .iter()
            .map(|n| (*n, if *n == victim { DOWN } else { RING3 }))
            .collect();
        h.rounds(from, to, &during);
        h.rounds(to, T0 + 20_000, &all);
    }

    #[test]
    fn a_clean_small_run_passes_every_property() {
        let mut h = Hist::new();
        rings(&mut h, Some(("n3", T0 + 6000, T0 + 7000)));
        h.phase("fault-free-1", T0 - 100, T0 + 2 * W + 100, false);
        h.phase("chaos", T0 + 2 * W + 100, T0 + 12_000, true);
        h.nemesis(1, "kill-restart", "n3", T0 + 6000, T0 + 7000, T0 + 7500);
        h.exit(T0 + 6000, "n3", 1, "kill -9");
        h.restart("n3", 2);
        for (i, key) in ["a", "b", "c", "d"].into_iter().enumerate() {
            let d = owner_on(RING3, key);
            let via = NODES[i % 3];
            h.fw_many(L + 1, T0 + 100 * i as u64, via, key, &d);
            h.fw_many(3, T0 + W + 100, via, key, &d);
        }
        let key = key_owned_by(RING3, "n2", |_| true);
        h.fw_many(5, T0 + 6100, "n1", &key, "n2");
        let r = check(h.entries());
        assert_eq!(r.total(), 0, "{}", r.details(5));
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        for p in PROPERTIES {
            assert!(
                r.summary.contains(&format!("| {p} | 0 |")),
                "{p}:\n{}",
                r.summary
            );
        }
        for row in [
            "| ops (ok / fail / info) | 61 (61 / 0 / 0) |",
            "| max deciders per (key, window) | 1 |",
            "| S5 (key, window)s checked in fault-free phases | 8 |",
            "| rings agree after the last heal | 0.0 s |",
            "| #1 kill-restart n3 | 0.0 | 0 | 0 |",
        ] {
            assert!(r.summary.contains(row), "{row}:\n{}", r.summary);
        }
    }

    #[test]
    fn a_cluster_deciding_every_key_locally_is_flagged_by_s5_and_s3_owner_only() {
        // The negative control (`--broken-decide-locally`): each node names itself, so
        // D = 3 and 3L stays within the S3 bound; S5 and S3-owner must catch it.
        let mut h = Hist::new();
        rings(&mut h, None);
        h.phase("fault-free-1", T0 - 100, T0 + 2 * W + 100, false);
        for key in ["a", "b", "c"] {
            for (i, node) in NODES.into_iter().enumerate() {
                h.fw_many(L + 1, T0 + 100 * i as u64, node, key, node);
            }
        }
        let r = check(h.entries());
        assert_eq!(r.count("S5"), 3, "{}", r.details(5));
        assert_eq!(
            r.count("S3-owner"),
            2 * 3 * (L as usize + 1),
            "{}",
            r.details(5)
        );
        assert_eq!(r.count("S3-bound"), 0);
        assert_eq!(r.total(), r.count("S5") + r.count("S3-owner"));
        assert!(r.summary.contains("| max deciders per (key, window) | 3 |"));
    }

    #[test]
    fn details_list_violations_per_property_then_warnings() {
        let mut r = Report::default();
        r.violate("S4", "first".into());
        r.violate("S4", "second".into());
        r.violate("S1-fw", "other".into());
        r.warnings.push("WARNING x".into());
        assert_eq!((r.total(), r.count("S4"), r.count("S5")), (3, 2, 0));
        assert_eq!(
            r.details(1),
            "  S1-fw: 1 violation(s)\n    - other\n  S4: 2 violation(s)\n    - first\n  WARNING x\n"
        );
    }
}
