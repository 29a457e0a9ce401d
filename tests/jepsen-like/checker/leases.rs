//! Budget leases (docs/leases.md) as the checkers see them.
//!
//! An owner lends a hot counter's units to an entry node by charging them on its own
//! counter at once (a grant); the entry then answers checks from them itself, `leased`,
//! naming the owner as decider. The history has the leased answers but not the grants
//! nor the returns of unused units: on a counter that was lent, the owner's count moves
//! by amounts the history does not show. So the checkers need to know *which* counters
//! may have been lent, and from when.
//!
//! An entry asks for a lease only when its meter says the counter is hot there: at least
//! `threshold` checks of it in its current and previous second (`EntryLeases::spend`),
//! i.e. that many checks recorded within 2 s of its clock. A check is recorded between
//! its op's invoke and completion, so a counter may be lent from the first instant `t`
//! at which `threshold` ops of it through one node were invoked by `t` and not yet
//! complete before `t − span` (span: 2 s, plus the largest clock offset of the run, a
//! backward step keeps the meter's second from rolling, plus rounding). Counting ops the
//! node owned (which it decides without its meter) only makes it earlier: sound.

use std::collections::BTreeMap;

use super::context::{Decider, Op, Parsed};

/// Rounding and tick slack (the meter rolls on whole seconds; the entry ticks every 100 ms).
const SLACK_MS: u64 = 100;
/// The entry's meter spans its current and previous second.
const METER_MS: u64 = 2_000;

/// Which counters may have been lent, from when.
#[derive(Default)]
pub struct Leases {
    /// The run's nodes had budget leases on.
    pub on: bool,
    /// How long before its leased spend a unit may have been charged by the owner's
    /// grant (real time): the lease TTL (counted on the entry's clock, which a backward
    /// step stretches) + the largest clock offset + slack.
    pub lead_ms: u64,
    /// The largest clock offset of the run.
    pub offset_ms: u64,
    /// (key, route) → the earliest real time a lease of it may have been granted.
    from: BTreeMap<(String, String), u64>,
    /// Every grant and return, when the history has the nodes' ledger.
    pub ledger: Option<Ledger>,
}

/// One grant of the owners' ledger (a `lent` line).
#[derive(Clone, Debug)]
pub struct Lent {
    /// The owner that charged it.
    pub owner: Decider,
    pub key: String,
    pub route: String,
    /// The counter's identity hash (a return names it, not the key).
    pub counter: u64,
    pub serial: u64,
    pub units: u64,
    /// The window it was charged in (`None`: an algorithm without windows).
    pub window: Option<u64>,
    /// The owner's sequence number of the grant's step.
    pub sequence: u64,
}

/// A return's lease: (owner, counter, serial).
pub type LeaseId = (Decider, u64, u64);

/// The owners' ledger: every grant and every return that gave units back.
///
/// Complete for the decider that writes it, in its own order: a node writes a grant's
/// line in the shard step that charges it, before the shard takes its next message, to
/// its stderr (a file; a kill -9 loses nothing written), so every grant a decision of
/// that node came after is in the ledger, and the sequence numbers order them.
#[derive(Clone, Debug, Default)]
pub struct Ledger {
    /// (key, route, window) → the grants charged in that window.
    grants: BTreeMap<(String, String, u64), Vec<Lent>>,
    /// Lease → (units given back, the return's sequence number).
    returns: BTreeMap<LeaseId, (u64, u64)>,
}

impl Ledger {
    /// The ledger of `lent` grants and `returned` returns.
    pub fn record(&mut self, lent: Vec<Lent>, returned: Vec<(LeaseId, u64, u64)>) {
        for g in lent {
            if let Some(win) = g.window {
                self.grants
                    .entry((g.key.clone(), g.route.clone(), win))
                    .or_default()
                    .push(g);
            }
        }
        for (lease, units, sequence) in returned {
            self.returns.insert(lease, (units, sequence));
        }
    }

    /// Units of (`key`, `route`)'s counter that grants in window `win` had charged and
    /// returns had not given back when `denier` decided its step `sequence`: its own
    /// grants before that step, less what came back before it; and, per other decider
    /// (another node or generation), every unit it lent in the window, returned or not
    /// (its count may have reached `denier` by a handoff or a replica, at any time).
    /// `joined`: another decider had a copy of the count in the window (a replica it
    /// promoted, or a fail-over), which may come back and be joined with the denier's
    /// after a return: the join keeps the larger count, so the returned units count
    /// as still lent (an under-admission the handback join causes, docs/leases.md).
    pub fn outstanding(
        &self,
        key: &str,
        route: &str,
        win: u64,
        denier: &Decider,
        sequence: u64,
        joined: bool,
    ) -> (u64, BTreeMap<Decider, u64>) {
        let mut own = 0u64;
        let mut others: BTreeMap<Decider, u64> = BTreeMap::new();
        let grants = self
            .grants
            .get(&(key.to_string(), route.to_string(), win))
            .map_or(&[][..], Vec::as_slice);
        for g in grants {
            if &g.owner != denier {
                *others.entry(g.owner.clone()).or_default() += g.units;
            } else if g.sequence < sequence {
                let back = self
                    .returns
                    .get(&(g.owner.clone(), g.counter, g.serial))
                    .filter(|(_, at)| *at < sequence && !joined)
                    .map_or(0, |(units, _)| (*units).min(g.units));
                own += g.units - back;
            }
        }
        (own, others)
    }

    /// Grants and returns in the ledger.
    pub fn len(&self) -> (usize, usize) {
        (self.grants.values().map(Vec::len).sum(), self.returns.len())
    }
}

impl Leases {
    pub fn new(p: &Parsed) -> Leases {
        let Some((threshold, ttl_ms)) = p.leases.filter(|(threshold, _)| *threshold > 0) else {
            return Leases::default();
        };
        let ledger = p.ledger.clone();
        let offset_ms = p.max_clock_offset_ms;
        let span = METER_MS + offset_ms + SLACK_MS;
        let mut through: BTreeMap<(&str, &str, &str), Vec<&Op>> = BTreeMap::new();
        for op in &p.ops {
            through
                .entry((op.node.as_str(), op.key.as_str(), op.route.as_str()))
                .or_default()
                .push(op);
        }
        let mut from: BTreeMap<(String, String), u64> = BTreeMap::new();
        for ((_, key, route), mut ops) in through {
            ops.sort_by_key(|o| o.invoke);
            let Some(t) = first_hot(&ops, threshold, span) else {
                continue;
            };
            let e = from
                .entry((key.to_string(), route.to_string()))
                .or_insert(t);
            *e = (*e).min(t);
        }
        Leases {
            on: true,
            lead_ms: ttl_ms + offset_ms + SLACK_MS,
            offset_ms,
            from,
            ledger,
        }
    }

    /// Whether a lease of (`key`, `route`) may have been granted by real time `t`.
    pub fn lent_by(&self, key: &str, route: &str, t: u64) -> bool {
        self.since(key, route).is_some_and(|from| from <= t)
    }

    /// Whether a lease of (`key`, `route`) may have been charged in window `win` (of
    /// length `w`, on the granting owner's clock).
    pub fn lent_in(&self, key: &str, route: &str, win: u64, w: u64) -> bool {
        self.since(key, route)
            .is_some_and(|from| from.saturating_sub(self.offset_ms) / w <= win)
    }

    fn since(&self, key: &str, route: &str) -> Option<u64> {
        self.from
            .get(&(key.to_string(), route.to_string()))
            .copied()
    }

    /// The earliest real time the owner may have charged the units of `op`'s leased
    /// admission (its grant came after the entry asked, at most a lease's life before).
    pub fn charged_from(&self, op: &Op) -> u64 {
        op.invoke.saturating_sub(self.lead_ms)
    }

    /// Counters that may have been lent.
    pub fn counters(&self) -> usize {
        self.from.len()
    }
}

/// The first invoke time by which `threshold` of `ops` (one node's, by invoke time) were
/// invoked and none of them had completed more than `span` before.
fn first_hot(ops: &[&Op], threshold: u64, span: u64) -> Option<u64> {
    let need = usize::try_from(threshold).unwrap_or(usize::MAX);
    (0..ops.len()).find_map(|j| {
        let t = ops[j].invoke;
        let live = ops[..=j]
            .iter()
            .filter(|o| o.complete.saturating_add(span) >= t)
            .count();
        (live >= need).then_some(t)
    })
}

#[cfg(test)]
mod tests {
    use super::super::context::Parsed;
    use super::super::testkit::*;
    use crate::history::Entry;

    fn leases_line(h: &mut Hist, threshold: u64) {
        h.push(Entry::Leases {
            t: T0 - 5000,
            threshold,
            ttl_ms: 1000,
            ledger: false,
        });
    }

    #[test]
    fn a_counter_is_lent_from_the_check_that_makes_it_hot_at_one_node() {
        let mut h = Hist::new();
        leases_line(&mut h, 3);
        // Two checks through n2, then two through n3: hot nowhere.
        h.fw_many(2, T0, "n2", "k", "n1");
        h.fw_many(2, T0, "n3", "k", "n1");
        // A third through n2 2,050 ms after the first: within the meter's span + slack.
        h.fw(T0 + 2050, "n2", "k", 1, "n1");
        // Through n3, 3 s later: the first two are too old.
        h.fw(T0 + 3000, "n3", "k", 1, "n1");
        h.fw_many(2, T0, "n2", "cold", "n1");
        let p = Parsed::parse(h.entries());
        let l = super::Leases::new(&p);
        assert!(l.on);
        assert!(!l.lent_by("k", FW, T0 + 2049));
        assert!(l.lent_by("k", FW, T0 + 2050));
        assert!(!l.lent_in("k", FW, (T0 + 2050) / W - 1, W));
        assert!(l.lent_in("k", FW, (T0 + 2050) / W, W));
        assert!(!l.lent_by("cold", FW, u64::MAX));
        assert_eq!(l.counters(), 1);
    }

    /// A run with leases at threshold 2: `n` leased admissions of key k through n2
    /// (lent by n1) from `t`, after `direct` of n1's own decisions of k through n2.
    fn lent(direct: u64, n: u64, leases: bool) -> Hist {
        let mut h = Hist::new();
        if leases {
            leases_line(&mut h, 2);
        }
        for i in 0..direct {
            let seq = h.seq("n1", 1);
            let a = Ans::decided("n1", seq, true, L - 1 - i - 2);
            h.check(T0 + 10 * i, "n2", FW, "k", 1, a);
        }
        for i in 0..n {
            let rem = L.saturating_sub(direct + i + 1);
            h.check(T0 + 500 + 10 * i, "n2", FW, "k", 1, Ans::leased("n1", rem));
        }
        h
    }

    #[test]
    fn leased_admissions_count_as_the_owners_under_one_limit() {
        use super::super::s1_bound::fixed_window;
        assert_eq!(run(&lent(6, 4, true), fixed_window).count("S1-fw"), 0);
        let r = run(&lent(6, 5, true), fixed_window);
        assert_eq!(messages(&r, "S1-fw").len(), 1, "{:?}", r.violations);
        assert!(messages(&r, "S1-fw")[0].contains("decider n1@1 admitted 11 > L=10"));
    }

    #[test]
    fn a_lent_counters_unseen_grant_passes_s2_only_with_leases_on() {
        // n1's remaining drops by 2 more than its own admissions: a grant of 2.
        use super::super::s2_sequence::sequential;
        assert_eq!(run(&lent(3, 2, true), sequential).count("S2"), 0);
        assert!(run(&lent(3, 0, false), sequential).count("S2") > 0);
        // A leased answer in a run without leases is a violation by itself.
        let r = run(&lent(0, 1, false), sequential);
        assert!(messages(&r, "S2")
            .iter()
            .any(|m| m.contains("leased answer") && m.contains("leases on: false")));
    }

    #[test]
    fn an_owners_denial_with_units_lent_passes_s4_only_on_a_lent_counter() {
        use super::super::s4_no_false_deny::no_false_deny;
        let history = |leases: bool| {
            let mut h = lent(2, 2, leases);
            let seq = h.seq("n1", 1);
            h.check(
                T0 + 900,
                "n2",
                FW,
                "k",
                1,
                Ans::decided("n1", seq, false, 0),
            );
            h
        };
        assert_eq!(run(&history(true), no_false_deny).count("S4"), 0);
        assert_eq!(run(&history(false), no_false_deny).count("S4"), 1);
    }

    #[test]
    fn a_leased_answer_names_another_node_with_no_hop() {
        use super::super::s6_routing::routing;
        assert_eq!(run(&lent(0, 3, true), routing).count("S6"), 0);
        let mut h = lent(0, 0, true);
        h.check(T0, "n1", FW, "k", 1, Ans::leased("n1", 5));
        h.check(T0, "n2", FW, "k", 1, Ans::leased("n1", 5).hops(1));
        assert_eq!(run(&h, routing).count("S6"), 2);
    }

    #[test]
    fn leased_token_bucket_admissions_count_from_their_earliest_charge() {
        // Burst 5, refill 10 per 2 s. n1 gives 5 at once; 3 leased spends 200 ms later
        // may have been charged up to a lease's life (+ slack) earlier: 1.5 s of refill
        // covers them. The same 3 spent before any refill could come: too many.
        use super::super::s1_bound::token_bucket;
        let history = |gap: u64| {
            let mut h = Hist::new();
            leases_line(&mut h, 2);
            for i in 0..5 {
                let seq = h.seq("n1", 1);
                h.check(T0 + i, "n2", TB, "k", 1, Ans::decided("n1", seq, true, 0));
            }
            for i in 0..3 {
                h.check(T0 + gap + i, "n2", TB, "k", 1, Ans::leased("n1", 0));
            }
            h
        };
        assert_eq!(run(&history(200), token_bucket).count("S1-tb"), 0);
        // Spent at once with the owner's burst, a lease's life (1.5 s) of refill is 8:
        // 5 + 3 = 8 ≤ 5 + 8 passes; 5 + 14 leased does not.
        let mut h = history(0);
        for i in 0..11 {
            h.check(T0 + 10 + i, "n2", TB, "k", 1, Ans::leased("n1", 0));
        }
        assert_eq!(run(&h, token_bucket).count("S1-tb"), 1);
    }

    #[test]
    fn without_the_leases_line_nothing_is_lent() {
        let mut h = Hist::new();
        h.fw_many(20, T0, "n2", "k", "n1");
        let l = super::Leases::new(&Parsed::parse(h.entries()));
        assert!(!l.on && !l.lent_by("k", FW, u64::MAX));
    }
}
