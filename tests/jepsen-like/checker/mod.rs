//! Checkers. They read only the history (the JSON-lines file) and report, per
//! property, every violation found plus the numbers of the summary table.
//!
//! `context` parses the history once (ops by id, ring samples, nemesis steps, phases)
//! and groups it (fixed-window ops per (key, window) and per decider, charges in doubt
//! per window); `views` rebuilds every node's ring views from the samples. Each property
//! of docs/chaos.md is one function over that context:
//!
//! | property | function |
//! |---|---|
//! | S1-fw, S1-fallback, S1-log, S1-tb | `s1_bound::{fixed_window, fallback, sliding_log, token_bucket}` |
//! | S2 | `s2_sequence::sequential` |
//! | S3-bound, S3-owner | `s3_over_admission::{bound, owner}` |
//! | S4 | `s4_no_false_deny::no_false_deny` |
//! | S5 | `s5_exactness::exactness` |
//! | S6 | `s6_routing::routing` |
//! | AVAIL-deadline, AVAIL-rings, AVAIL-unfaulted | `availability::{deadline, rings_agree, unfaulted}` |
//! | OBS (a warning) | `observability::resets` |
//!
//! `summary` renders the table; `testkit` builds small histories for the unit tests.

mod availability;
mod context;
mod observability;
mod s1_bound;
mod s2_sequence;
mod s3_over_admission;
mod s4_no_false_deny;
mod s5_exactness;
mod s6_routing;
mod summary;
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

pub const PROPERTIES: [&str; 14] = [
    "S1-fw",
    "S1-fallback",
    "S1-log",
    "S1-tb",
    "S2",
    "S3-bound",
    "S3-owner",
    "S4",
    "S5",
    "S6",
    "AVAIL-deadline",
    "AVAIL-rings",
    "AVAIL-unfaulted",
    "OBS",
];

/// Check every property of a history.
pub fn check(entries: &[Entry]) -> Report {
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
    s4_no_false_deny::no_false_deny(&ctx, &mut report);
    let s5_windows = s5_exactness::exactness(&ctx, &mut report);
    s6_routing::routing(&ctx, &mut report);
    availability::deadline(&ctx, &mut report);
    availability::rings_agree(&ctx, &mut report);
    let impacts = availability::unfaulted(&ctx, &mut report);
    let resets = observability::resets(&ctx, &mut report);
    let stats = summary::Stats {
        over,
        s5_windows,
        impacts,
        resets,
    };
    report.summary = summary::render(&ctx, &stats, &report);
    report
}
