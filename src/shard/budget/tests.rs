//! Budget leases against reference models: whatever the interleaving of grants, spends
//! from leases, direct checks on the owner, returns (repeated ones too) and clock
//! steps, never more is admitted than the algorithm allows.

use std::num::NonZeroU64;
use std::sync::Arc;

use proptest::prelude::*;

use super::entry::{EntryLeases, HeldLease, Returned, SpendAsk};
use super::gate::Gated;
use super::*;
use crate::config::rules::{Rule, RuleSet};
use crate::shard::{Charge, KeyId, Store};

const T0: Millis = 1_800_000_000_000;

fn rule(body: &str) -> Arc<Rule> {
    let text = format!("[[rule]]\nname = \"r\"\nroute = \"GET /r\"\n{body}\n");
    let rules = RuleSet::from_toml_str(&text).unwrap();
    rules
        .rules()
        .iter()
        .find(|r| &*r.name == "r")
        .unwrap()
        .clone()
}

fn charge(rule: &Arc<Rule>) -> Charge {
    Charge {
        id: KeyId::of(&rule.name, b"whale", ""),
        rule: rule.clone(),
        cost: NonZeroU64::MIN,
        give_back: None,
        drain: false,
        peek: false,
        target: Default::default(),
    }
}

fn ask(rule: &Arc<Rule>, holder: &str, rate: u64) -> GrantAsk {
    GrantAsk {
        charge: charge(rule),
        holder: Arc::from(holder),
        rate,
        label: (Arc::from("whale"), Arc::from("GET /r")),
    }
}

/// One owner and its store, granting at `now`.
struct Owner {
    store: Store,
    leases: BudgetLeases,
    policy: LeasePolicy,
}

impl Owner {
    fn new() -> Self {
        Self {
            store: Store::new(100, 1),
            leases: BudgetLeases::default(),
            policy: LeasePolicy::default(),
        }
    }

    fn grant(&mut self, ask: &GrantAsk, now: Millis) -> GrantReply {
        self.leases
            .grant(&mut self.store, ask, &self.policy, now, || 1)
            .0
    }

    fn check(&mut self, rule: &Arc<Rule>, now: Millis, cost: u64) -> bool {
        let c = charge(rule);
        let cost = NonZeroU64::new(cost).unwrap();
        self.store.check(c.counter(), now, cost).0.allowed
    }

    fn remaining(&mut self, rule: &Arc<Rule>, now: Millis) -> u64 {
        self.store.peek(charge(rule).counter(), now).remaining
    }
}

fn held(reply: &GrantReply, owner: &str, fingerprint: u64, now: Millis) -> Option<HeldLease> {
    reply.lease.map(|g| HeldLease {
        owner: (Arc::from(owner), 1),
        serial: g.serial,
        fingerprint,
        granted: g.units,
        left: g.units,
        since: now,
        until: now + g.ttl_ms,
        numbers: reply.decision,
    })
}

#[test]
fn a_grant_is_charged_at_once_and_its_unused_units_come_back_once() {
    let r = rule("algorithm = \"fixed_window\"\nlimit = 1000\nwindow = \"60s\"");
    let mut owner = Owner::new();
    let reply = owner.grant(&ask(&r, "b", 400), T0);
    let lease = reply.lease.expect("a lease");
    assert_eq!(
        (lease.units, lease.ttl_ms),
        (400, 1_000),
        "what 1 s at its rate needs"
    );
    assert_eq!(reply.event, GrantEvent::Granted);
    assert_eq!(owner.remaining(&r, T0), 600, "charged on the owner at once");
    let id = charge(&r).id;
    let back = owner
        .leases
        .give_back(&mut owner.store, "b", lease.serial, id, 100);
    assert_eq!(back, 100);
    assert_eq!(owner.remaining(&r, T0 + 10), 700);
    let again = owner
        .leases
        .give_back(&mut owner.store, "b", lease.serial, id, 100);
    assert_eq!(again, 0, "a second return gives nothing back");
    assert_eq!(owner.remaining(&r, T0 + 20), 700);
}

#[test]
fn a_return_gives_back_no_more_than_was_lent_and_only_to_its_holder() {
    let r = rule("algorithm = \"fixed_window\"\nlimit = 100\nwindow = \"60s\"");
    let mut owner = Owner::new();
    let lease = owner.grant(&ask(&r, "b", 1_000), T0).lease.unwrap();
    assert_eq!(lease.units, 50, "alone, half of what is left");
    let id = charge(&r).id;
    assert_eq!(
        owner
            .leases
            .give_back(&mut owner.store, "c", lease.serial, id, 50),
        0
    );
    assert_eq!(
        owner
            .leases
            .give_back(&mut owner.store, "b", lease.serial, id, 999),
        50
    );
    assert_eq!(owner.remaining(&r, T0), 100);
}

#[test]
fn grants_share_the_remaining_budget_by_rate_and_stop_at_the_floor() {
    let r = rule("algorithm = \"fixed_window\"\nlimit = 1000\nwindow = \"60s\"");
    let mut owner = Owner::new();
    let first = owner.grant(&ask(&r, "b", 3_000), T0).lease.unwrap();
    assert_eq!(first.units, 500, "alone: half of everything");
    // "c" asks at a third of b's rate: its share of the 500 left is a quarter.
    let second = owner.grant(&ask(&r, "c", 1_000), T0).lease.unwrap();
    assert_eq!(second.units, 62);
    let renewed = owner.grant(&ask(&r, "b", 3_000), T0);
    assert_eq!(renewed.event, GrantEvent::Renewed);
    let mut now = T0;
    while owner.grant(&ask(&r, "b", 3_000), now).lease.is_some() {
        now += 1;
    }
    let left = owner.remaining(&r, now);
    assert!(
        left < 8,
        "no lease under the floor: {left} left for the owner to decide"
    );
    assert!(
        owner.check(&r, now, left.max(1)),
        "the last units are the owner's to decide"
    );
}

#[test]
fn a_holder_that_renewed_counts_once_in_the_others_share() {
    let r = rule("algorithm = \"fixed_window\"\nlimit = 100000\nwindow = \"60s\"");
    let mut owner = Owner::new();
    for _ in 0..5 {
        owner.grant(&ask(&r, "b", 1_000), T0);
    }
    let left = owner.remaining(&r, T0);
    let c = owner.grant(&ask(&r, "c", 1_000_000), T0).lease.unwrap();
    // b's five leases are one holder at 1,000/s: c's share is 1000/1001 of what is left.
    assert_eq!(c.units, size(left, 1_000_000, 1_000_000, 1_000, 2));
    assert!(c.units > left / 2 - left / 1_000, "{} of {left}", c.units);
}

#[test]
fn no_lease_for_a_sliding_log_a_shaper_a_shadow_rule_a_rule_that_says_no_or_a_window_about_to_end()
{
    let log = rule("algorithm = \"sliding_window_log\"\nlimit = 100\nwindow = \"60s\"");
    let shaper = rule(
        "algorithm = \"leaky_bucket\"\nmode = \"shaper\"\nlimit = 100\nwindow = \"60s\"\nqueue_depth = 10",
    );
    let shadow =
        rule("algorithm = \"fixed_window\"\nlimit = 100\nwindow = \"60s\"\nmode = \"shadow\"");
    let opted_out =
        rule("algorithm = \"fixed_window\"\nlimit = 100\nwindow = \"60s\"\nlease = false");
    let fw = rule("algorithm = \"fixed_window\"\nlimit = 100\nwindow = \"60s\"");
    assert!(fw.lease && !opted_out.lease);
    let mut owner = Owner::new();
    for r in [&log, &shaper, &shadow, &opted_out] {
        let reply = owner.grant(&ask(r, "b", 1_000), T0);
        assert_eq!(
            (reply.lease, reply.event),
            (None, GrantEvent::Refused),
            "{}",
            r.name
        );
    }
    let end = (T0 / 60_000 + 1) * 60_000;
    let late = owner.grant(&ask(&fw, "b", 1_000), end - MIN_LEASE_MS + 1);
    assert!(late.lease.is_none(), "the window ends too soon");
    let near = owner.grant(&ask(&fw, "b", 1_000), end - 300).lease.unwrap();
    assert_eq!(near.ttl_ms, 300, "a lease ends with its window");
    assert_eq!(owner.remaining(&log, T0), 100, "a refusal charges nothing");
}

#[test]
fn an_entry_spends_its_lease_asks_again_before_it_runs_out_and_returns_the_rest() {
    let r = rule("algorithm = \"fixed_window\"\nlimit = 1000\nwindow = \"60s\"");
    let mut owner = Owner::new();
    let mut entry = EntryLeases::new(5);
    let spend = SpendAsk {
        counter: charge(&r).id,
        fingerprint: r.fingerprint,
        cost: 1,
        held_only: false,
        weight: 1,
    };
    let mut returns = Vec::new();
    let mut asked = None;
    for i in 0..5 {
        let step = entry.spend(&spend, T0 + i, &mut returns);
        assert!(step.leased.is_none());
        asked = asked.or(step.ask);
    }
    let rate = asked.expect("hot after 5 checks in a second");
    let reply = owner.grant(&ask(&r, "b", rate), T0 + 5);
    entry.hold(
        spend.counter,
        held(&reply, "a", r.fingerprint, T0 + 5),
        T0 + 5,
    );
    let units = reply.lease.unwrap().units;
    let gate = entry.gate().clone();
    assert_eq!(
        gate.route(spend.counter, true),
        Gated::Shard(1),
        "every check of a counter with a lease held goes to its shard"
    );
    let step = entry.spend(&spend, T0 + 6, &mut returns);
    let (decision, by) = step.leased.expect("decided from the lease");
    assert_eq!(&*by.0, "a");
    assert!(decision.allowed);
    assert!(
        decision.remaining <= owner.remaining(&r, T0 + 6),
        "never more than the owner's"
    );
    let mut spent = 1;
    let mut renew = step.ask;
    while renew.is_none() {
        let step = entry.spend(&spend, T0 + 7, &mut returns);
        assert!(step.leased.is_some());
        spent += 1;
        renew = step.ask;
    }
    assert_eq!(
        spent,
        units - units.div_ceil(2) + 1,
        "asks when under half is left"
    );
    entry.expire(T0 + 5 + 1_000, &mut returns);
    assert_eq!(
        gate.route(spend.counter, true),
        Gated::Forward,
        "the gate forgets an ended lease"
    );
    assert_eq!(
        returns,
        vec![Returned {
            owner: (Arc::from("a"), 1),
            serial: reply.lease.unwrap().serial,
            counter: spend.counter,
            unused: units - spent,
        }]
    );
}

#[test]
fn a_sampled_check_counts_as_many_as_it_stands_for() {
    let mut entry = EntryLeases::new(100);
    let spend = SpendAsk {
        counter: KeyId::of("r", b"k", ""),
        fingerprint: 7,
        cost: 1,
        held_only: false,
        weight: 6,
    };
    let mut returns = Vec::new();
    for i in 0..16 {
        let step = entry.spend(&spend, T0 + i, &mut returns);
        assert!(step.ask.is_none(), "96 checks a second: not hot yet");
    }
    let step = entry.spend(&spend, T0 + 16, &mut returns);
    assert_eq!(step.ask, Some(102), "17 samples of 6: 102 checks a second");
}

#[test]
fn an_entry_that_was_refused_stays_quiet_for_a_while() {
    let mut entry = EntryLeases::new(1);
    let spend = SpendAsk {
        counter: KeyId::of("r", b"k", ""),
        fingerprint: 7,
        cost: 1,
        held_only: false,
        weight: 1,
    };
    let mut returns = Vec::new();
    assert!(entry.spend(&spend, T0, &mut returns).ask.is_some());
    assert!(
        entry.spend(&spend, T0 + 1, &mut returns).ask.is_none(),
        "one in flight"
    );
    entry.hold(spend.counter, None, T0 + 2);
    assert!(
        entry.spend(&spend, T0 + 3, &mut returns).ask.is_none(),
        "quiet"
    );
    assert!(entry
        .spend(&spend, T0 + 2 + entry::QUIET_MS, &mut returns)
        .ask
        .is_some());
}

#[test]
fn leases_off_never_asks_and_never_follows_a_counter() {
    let mut entry = EntryLeases::new(0);
    let spend = SpendAsk {
        counter: KeyId::of("r", b"k", ""),
        fingerprint: 7,
        cost: 1,
        held_only: false,
        weight: 1,
    };
    for i in 0..1_000 {
        let step = entry.spend(&spend, T0 + i, &mut Vec::new());
        assert_eq!((step.leased, step.ask), (None, None));
    }
    assert!(entry.is_empty());
}

#[test]
fn the_entry_follows_a_bounded_number_of_counters() {
    let mut entry = EntryLeases::new(1);
    for i in 0..(entry::MAX_TRACKED_PER_SHARD as u64 + 100) {
        let spend = SpendAsk {
            counter: KeyId::of("r", &i.to_le_bytes(), ""),
            fingerprint: 7,
            cost: 1,
            held_only: false,
            weight: 1,
        };
        entry.spend(&spend, T0, &mut Vec::new());
    }
    assert_eq!(entry.len(), entry::MAX_TRACKED_PER_SHARD);
    entry.expire(T0 + 60_000, &mut Vec::new());
    assert!(entry.is_empty(), "idle counters are forgotten");
}

// ---- the reference model ----------------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    /// Time passes.
    Step(u64),
    /// A check on the owner.
    Direct(u64),
    /// A check at entry `i` (decided from its lease or not at all here).
    Spend(usize, u64),
    /// Entry `i` asks for a lease at this rate.
    Ask(usize, u64),
    /// The expiry tick: ended leases go back, and each return is sent twice.
    Tick,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1..700u64).prop_map(Op::Step),
        (1..4u64).prop_map(Op::Direct),
        (0..3usize, 1..4u64).prop_map(|(i, c)| Op::Spend(i, c)),
        (0..3usize, 1..5_000u64).prop_map(|(i, r)| Op::Ask(i, r)),
        Just(Op::Tick),
    ]
}

/// Runs `ops` and returns every admission as (time, cost).
fn run(r: &Arc<Rule>, ops: &[Op], start: Millis) -> Vec<(Millis, u64)> {
    let mut owner = Owner::new();
    let mut entries: Vec<EntryLeases> = (0..3).map(|_| EntryLeases::new(1)).collect();
    let holders = ["e0", "e1", "e2"];
    let id = charge(r).id;
    let mut admitted = Vec::new();
    let mut now = start;
    for op in ops {
        let mut returns: Vec<(usize, Returned)> = Vec::new();
        match *op {
            Op::Step(ms) => now += ms,
            Op::Direct(cost) => {
                if owner.check(r, now, cost) {
                    admitted.push((now, cost));
                }
            }
            Op::Spend(i, cost) => {
                let spend = SpendAsk {
                    counter: id,
                    fingerprint: r.fingerprint,
                    cost,
                    held_only: false,
                    weight: 1,
                };
                let mut back = Vec::new();
                if entries[i].spend(&spend, now, &mut back).leased.is_some() {
                    admitted.push((now, cost));
                }
                returns.extend(back.into_iter().map(|b| (i, b)));
            }
            Op::Ask(i, rate) => {
                let reply = owner.grant(&ask(r, holders[i], rate), now);
                entries[i].hold(id, held(&reply, "owner", r.fingerprint, now), now);
            }
            Op::Tick => {
                for (i, entry) in entries.iter_mut().enumerate() {
                    let mut back = Vec::new();
                    entry.expire(now, &mut back);
                    returns.extend(back.into_iter().map(|b| (i, b)));
                }
                owner.leases.expire(now);
            }
        }
        for (i, back) in returns {
            for _ in 0..2 {
                owner.leases.give_back(
                    &mut owner.store,
                    holders[i],
                    back.serial,
                    back.counter,
                    back.unused,
                );
            }
        }
    }
    admitted
}

fn per_window_at_most(
    admitted: &[(Millis, u64)],
    window_ms: u64,
    limit: u64,
) -> Result<(), TestCaseError> {
    let mut by_window = std::collections::BTreeMap::new();
    for &(at, cost) in admitted {
        *by_window.entry(at / window_ms).or_insert(0u64) += cost;
    }
    for (w, total) in by_window {
        prop_assert!(total <= limit, "window {w}: {total} admitted > {limit}");
    }
    Ok(())
}

/// Admitted from the start until each admission ≤ what the bucket can give in that
/// time: `capacity + refill × elapsed / period` (rounded down).
fn cumulative_at_most(
    admitted: &[(Millis, u64)],
    start: Millis,
    capacity: u64,
    refill: u64,
    period_ms: u64,
) -> Result<(), TestCaseError> {
    let mut total = 0u64;
    for &(at, cost) in admitted {
        total += cost;
        let bound = capacity + refill * (at - start) / period_ms;
        prop_assert!(total <= bound, "{total} admitted by {at} > {bound}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn fixed_window_with_leases_never_admits_more_than_the_limit_per_window(
        ops in proptest::collection::vec(op(), 1..300),
        offset in 0..3_000u64,
    ) {
        let r = rule("algorithm = \"fixed_window\"\nlimit = 40\nwindow = \"3s\"");
        per_window_at_most(&run(&r, &ops, T0 + offset), 3_000, 40)?;
    }

    #[test]
    fn sliding_counter_with_leases_never_admits_more_than_the_limit_per_window(
        ops in proptest::collection::vec(op(), 1..300),
        offset in 0..3_000u64,
    ) {
        let r = rule("algorithm = \"sliding_window_counter\"\nlimit = 40\nwindow = \"3s\"");
        per_window_at_most(&run(&r, &ops, T0 + offset), 3_000, 40)?;
    }

    #[test]
    fn token_bucket_with_leases_never_admits_more_than_it_refills(
        ops in proptest::collection::vec(op(), 1..300),
    ) {
        let r = rule("algorithm = \"token_bucket\"\nlimit = 10\nwindow = \"1s\"\nburst = 30");
        cumulative_at_most(&run(&r, &ops, T0), T0, 30, 10, 1_000)?;
    }

    #[test]
    fn gcra_meter_with_leases_never_admits_more_than_its_schedule(
        ops in proptest::collection::vec(op(), 1..300),
    ) {
        let r = rule("algorithm = \"leaky_bucket\"\nlimit = 10\nwindow = \"1s\"\nburst = 20");
        cumulative_at_most(&run(&r, &ops, T0), T0, 20, 10, 1_000)?;
    }
}

/// One step of an entry's lease store, for the gate's bookkeeping.
#[derive(Debug, Clone)]
enum EntryOp {
    /// A check of counter `c` (under rule fingerprint `f`), `dt` ms later.
    Spend { c: u64, f: u64, dt: u64 },
    /// The owner's answer for counter `c`: a lease of `units` (0: refused) for `ttl` ms.
    Hold { c: u64, units: u64, ttl: u64 },
    /// The expiry tick, `dt` ms later.
    Expire { dt: u64 },
}

fn entry_op() -> impl Strategy<Value = EntryOp> {
    prop_oneof![
        (0..3u64, 0..2u64, 0..200u64).prop_map(|(c, f, dt)| EntryOp::Spend { c, f, dt }),
        (0..3u64, 0..4u64, 1..1_500u64).prop_map(|(c, units, ttl)| EntryOp::Hold { c, units, ttl }),
        (0..400u64).prop_map(|dt| EntryOp::Expire { dt }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The gate's table counts exactly the leases the store holds, whatever the order of
    /// spends, grants, rule changes and expiry: a count left behind would send every
    /// check of a counter to its shard for nothing, one missing would forward checks a
    /// held lease could decide.
    #[test]
    fn the_gate_counts_exactly_the_leases_held(ops in proptest::collection::vec(entry_op(), 1..200)) {
        let mut entry = EntryLeases::new(1);
        let gate = entry.gate().clone();
        // Distinct slots: the counters' hashes are 0, 1 and 2.
        let counter = |c: u64| KeyId { placement: c, disc: c };
        let mut now = T0;
        let mut serial = 0;
        let mut returns = Vec::new();
        for op in ops {
            match op {
                EntryOp::Spend { c, f, dt } => {
                    now += dt;
                    let spend = SpendAsk { counter: counter(c), fingerprint: f, cost: 1, held_only: false, weight: 1 };
                    entry.spend(&spend, now, &mut returns);
                }
                EntryOp::Hold { c, units, ttl } => {
                    serial += 1;
                    let lease = (units > 0).then(|| HeldLease {
                        owner: (Arc::from("a"), 1),
                        serial,
                        fingerprint: 0,
                        granted: units,
                        left: units,
                        since: now,
                        until: now + ttl,
                        numbers: Decision {
                            allowed: true,
                            limit: 10,
                            remaining: 5,
                            retry_after_ms: 0,
                            reset_at_ms: 0,
                            window_id: None,
                            delay_ms: 0,
                        },
                    });
                    entry.hold(counter(c), lease, now);
                }
                EntryOp::Expire { dt } => {
                    now += dt;
                    entry.expire(now, &mut returns);
                }
            }
            for c in 0..3 {
                prop_assert_eq!(u64::from(gate.count(counter(c))), entry.leases_of(counter(c)) as u64);
            }
        }
    }
}
