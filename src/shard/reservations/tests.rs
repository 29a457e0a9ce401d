use super::*;
use crate::config::rules::RuleSet;
use crate::shard::KeyId;
use proptest::prelude::*;

const KEY: [u8; 32] = [7; 32];

/// The one `[[rule]]` of `toml` (the set also holds the built-in default).
fn rule(toml: &str) -> Arc<Rule> {
    let rules = RuleSet::from_toml_str(toml).unwrap();
    let rule = rules.rules().iter().find(|r| &*r.name != "default");
    rule.expect("one rule").clone()
}

/// 100 units per hour, a fixed window: no window boundary inside a test.
fn hourly() -> Arc<Rule> {
    rule("[[rule]]\nname = \"llm\"\nroute = \"/llm\"\nalgorithm = \"fixed_window\"\nlimit = 100\nwindow = \"1h\"\n")
}

fn charge(rule: &Arc<Rule>, client: &str, cost: u64) -> Charge {
    Charge {
        id: KeyId::of(&rule.name, client.as_bytes(), ""),
        rule: rule.clone(),
        cost: NonZeroU64::new(cost).unwrap(),
        give_back: None,
        drain: false,
        peek: false,
        target: Default::default(),
    }
}

struct Harness {
    shard: ReservationShard,
    store: Store,
    sequence: AtomicU64,
}

impl Harness {
    fn new() -> Self {
        Self::with_cap(MAX_RESERVATIONS_PER_SHARD)
    }

    fn with_cap(cap: usize) -> Self {
        Self {
            shard: ReservationShard {
                table: Reservations::new(cap, KEY),
                leases: Concurrency::new(cap, KEY),
                metrics: ReservationMetrics::new(0),
            },
            store: Store::new(1_000, 1),
            sequence: AtomicU64::new(0),
        }
    }

    fn reserve(&mut self, charge: &Charge, ttl_ms: u64, now: Millis) -> Result<Opened, Full> {
        let op = Op::Reserve {
            charge: charge.clone(),
            ttl_ms,
        };
        match self.shard.step(&mut self.store, op, now, &self.sequence).0 {
            Reply::Reserved(r) => r,
            other => panic!("{other:?}"),
        }
    }

    /// Reserve, expecting an admission: the ticket and the claim an id would carry.
    fn reserved(&mut self, charge: &Charge, ttl_ms: u64, now: Millis) -> (Ticket, Claim) {
        let opened = self.reserve(charge, ttl_ms, now).unwrap();
        assert!(opened.outcome.decision.allowed, "{opened:?}");
        let (ticket, expires_at) = opened.reservation.expect("admitted");
        (ticket, claim_of(charge, expires_at))
    }

    fn commit(
        &mut self,
        target: Target,
        claim: Claim,
        actual: u64,
        rule: Option<Arc<Rule>>,
        now: Millis,
    ) -> Result<Settled, CommitRefused> {
        let op = Op::Commit {
            target,
            claim,
            actual,
            rule,
        };
        match self.shard.step(&mut self.store, op, now, &self.sequence).0 {
            Reply::Committed(r) => r,
            other => panic!("{other:?}"),
        }
    }

    fn remaining(&mut self, charge: &Charge, now: Millis) -> u64 {
        self.store.peek(charge.counter(), now).remaining
    }
}

fn claim_of(charge: &Charge, expires_at: Millis) -> Claim {
    Claim {
        counter: charge.id,
        fingerprint: charge.rule.fingerprint,
        amount: charge.cost.get(),
        expires_at,
    }
}

#[test]
fn reservations_admit_until_the_budget_is_reserved_and_a_denial_opens_nothing() {
    let mut h = Harness::new();
    let c = charge(&hourly(), "cust", 10);
    for i in 0..10 {
        let (_, claim) = h.reserved(&c, 60_000, 1_000 + i);
        assert_eq!(claim.expires_at, 61_000 + i);
    }
    let denied = h.reserve(&c, 60_000, 2_000).unwrap();
    assert!(!denied.outcome.decision.allowed);
    assert_eq!(denied.reservation, None);
    assert_eq!(h.shard.table().len(), 10);
    assert_eq!(h.remaining(&c, 2_000), 0);
}

#[test]
fn a_commit_below_the_amount_gives_the_difference_back() {
    let mut h = Harness::new();
    let r = hourly();
    let c = charge(&r, "cust", 10);
    let (ticket, claim) = h.reserved(&c, 60_000, 1_000);
    assert_eq!(h.remaining(&c, 1_000), 90);
    let settled = h
        .commit(Target::Own(ticket), claim, 4, Some(r), 2_000)
        .unwrap();
    assert_eq!(
        (settled.returned, settled.charged, settled.uncharged),
        (6, 0, 0)
    );
    assert!(!settled.moved);
    assert_eq!(settled.after.unwrap().remaining, 96);
    assert_eq!(h.remaining(&c, 2_000), 96);
    assert!(h.shard.table().is_empty());
}

#[test]
fn a_commit_above_the_amount_charges_the_excess_and_is_never_denied() {
    let mut h = Harness::new();
    let r = hourly();
    let c = charge(&r, "cust", 10);
    let (ticket, claim) = h.reserved(&c, 60_000, 1_000);
    let settled = h
        .commit(Target::Own(ticket), claim, 25, Some(r.clone()), 1_500)
        .unwrap();
    assert_eq!(
        (settled.returned, settled.charged, settled.uncharged),
        (0, 15, 0)
    );
    assert_eq!(h.remaining(&c, 1_500), 75);
    // An excess beyond what is left empties the counter; the rest is reported.
    let (ticket, claim) = h.reserved(&c, 60_000, 2_000);
    let settled = h
        .commit(Target::Own(ticket), claim, 200, Some(r), 2_000)
        .unwrap();
    assert_eq!((settled.charged, settled.uncharged), (65, 125));
    assert_eq!(h.remaining(&c, 2_000), 0);
}

#[test]
fn a_second_commit_is_refused_and_changes_nothing() {
    let mut h = Harness::new();
    let r = hourly();
    let c = charge(&r, "cust", 10);
    let (ticket, claim) = h.reserved(&c, 60_000, 1_000);
    h.commit(Target::Own(ticket), claim, 0, Some(r.clone()), 1_000)
        .unwrap();
    assert_eq!(h.remaining(&c, 1_000), 100);
    for actual in [0, 10, 50] {
        assert_eq!(
            h.commit(Target::Own(ticket), claim, actual, Some(r.clone()), 1_001),
            Err(CommitRefused::AlreadyCommitted)
        );
    }
    assert_eq!(h.remaining(&c, 1_001), 100);
}

#[test]
fn a_reservation_past_its_ttl_stays_charged_at_its_amount_and_refuses_its_commit() {
    let mut h = Harness::new();
    let r = hourly();
    let c = charge(&r, "cust", 10);
    let (ticket, claim) = h.reserved(&c, 1_000, 5_000);
    // Not swept yet: the commit finds it due.
    assert_eq!(
        h.commit(Target::Own(ticket), claim, 0, Some(r.clone()), 6_000),
        Err(CommitRefused::Expired(6_000))
    );
    assert_eq!(h.remaining(&c, 6_000), 90, "committed at its amount");
    // Swept by the expiry tick: the same answer, from the id alone.
    let (ticket, claim) = h.reserved(&c, 1_000, 7_000);
    assert_eq!(h.shard.table().len(), 1);
    h.shard.expire(7_999);
    assert_eq!(h.shard.table().len(), 1, "not due before its TTL");
    h.shard.expire(8_000);
    assert!(h.shard.table().is_empty());
    assert_eq!(
        h.commit(Target::Own(ticket), claim, 0, Some(r), 8_500),
        Err(CommitRefused::Expired(8_000))
    );
    assert_eq!(h.remaining(&c, 8_500), 80);
}

#[test]
fn forged_or_altered_ids_are_unknown_and_change_nothing() {
    let mut h = Harness::new();
    let r = hourly();
    let c = charge(&r, "cust", 10);
    let (ticket, claim) = h.reserved(&c, 60_000, 1_000);
    let other = charge(&r, "victim", 10);
    let forged = [
        (
            Ticket {
                tag: ticket.tag ^ 1,
                ..ticket
            },
            claim,
        ),
        (
            Ticket {
                serial: 0,
                ..ticket
            },
            claim,
        ),
        (
            Ticket {
                serial: 99,
                ..ticket
            },
            claim,
        ),
        (
            ticket,
            Claim {
                amount: 1_000,
                ..claim
            },
        ),
        (
            ticket,
            Claim {
                expires_at: u64::MAX,
                ..claim
            },
        ),
        (
            ticket,
            Claim {
                counter: other.id,
                ..claim
            },
        ),
    ];
    for (t, cl) in forged {
        assert_eq!(
            h.commit(Target::Own(t), cl, 0, Some(r.clone()), 2_000),
            Err(CommitRefused::Unknown),
            "{t:?} {cl:?}"
        );
    }
    assert_eq!(h.remaining(&c, 2_000), 90);
    assert_eq!(
        h.shard.table().len(),
        1,
        "the real reservation is still open"
    );
    h.commit(Target::Own(ticket), claim, 10, Some(r), 2_000)
        .unwrap();
}

#[test]
fn a_full_table_refuses_a_reservation_and_charges_nothing() {
    let mut h = Harness::with_cap(2);
    let r = hourly();
    let c = charge(&r, "cust", 10);
    let (ticket, claim) = h.reserved(&c, 60_000, 1_000);
    h.reserved(&c, 60_000, 1_000);
    assert_eq!(h.reserve(&c, 60_000, 1_000), Err(Full(2)));
    assert_eq!(
        h.remaining(&c, 1_000),
        80,
        "the refused one charged nothing"
    );
    h.commit(Target::Own(ticket), claim, 10, Some(r), 1_000)
        .unwrap();
    assert!(h.reserve(&c, 60_000, 1_000).is_ok(), "a commit made room");
}

#[test]
fn a_moved_commit_gives_nothing_back_charges_the_excess_once() {
    let mut h = Harness::new();
    let r = hourly();
    let c = charge(&r, "cust", 10);
    let claim = claim_of(&c, 60_000);
    let under = h
        .commit(Target::Moved(42), claim, 3, Some(r.clone()), 1_000)
        .unwrap();
    assert!(under.moved);
    assert_eq!((under.returned, under.charged), (0, 0));
    assert_eq!(h.remaining(&c, 1_000), 100);
    let claim = Claim { amount: 5, ..claim };
    let over = h
        .commit(Target::Moved(43), claim, 12, Some(r.clone()), 1_000)
        .unwrap();
    assert_eq!(over.charged, 7);
    assert_eq!(
        h.commit(Target::Moved(43), claim, 12, Some(r.clone()), 1_000),
        Err(CommitRefused::AlreadyCommitted)
    );
    assert_eq!(
        h.commit(Target::Moved(44), claim, 12, Some(r), 60_000),
        Err(CommitRefused::Expired(60_000))
    );
    assert_eq!(h.remaining(&c, 1_000), 93);
    h.shard.expire(60_000);
    assert!(h.shard.table().is_empty(), "records go at the id's expiry");
}

#[test]
fn a_commit_under_a_changed_rule_closes_the_reservation_and_touches_no_counter() {
    let mut h = Harness::new();
    let r = hourly();
    let c = charge(&r, "cust", 10);
    let (ticket, claim) = h.reserved(&c, 60_000, 1_000);
    let renumbered =
        rule("[[rule]]\nname = \"llm\"\nroute = \"/llm\"\nalgorithm = \"fixed_window\"\nlimit = 50\nwindow = \"1h\"\n");
    let settled = h
        .commit(Target::Own(ticket), claim, 40, Some(renumbered), 1_000)
        .unwrap();
    assert_eq!(
        (settled.returned, settled.charged, settled.after),
        (0, 0, None)
    );
    assert_eq!(settled.uncharged, 30);
    assert_eq!(h.remaining(&c, 1_000), 90, "the old counter is untouched");
    let (ticket, claim) = h.reserved(&c, 60_000, 1_000);
    assert!(h.commit(Target::Own(ticket), claim, 0, None, 1_000).is_ok());
}

#[test]
fn a_token_bucket_gets_unused_units_back_now_never_past_full() {
    let mut h = Harness::new();
    // 10 tokens, 10 per 10 s.
    let r = rule(
        "[[rule]]\nname = \"tb\"\nroute = \"/llm\"\nalgorithm = \"token_bucket\"\nlimit = 10\nburst = 10\nwindow = \"10s\"\n",
    );
    let c = charge(&r, "cust", 8);
    let (ticket, claim) = h.reserved(&c, 60_000, 0);
    assert!(
        h.store
            .check(c.counter(), 1_000, NonZeroU64::new(2).unwrap())
            .0
            .allowed
    );
    assert_eq!(h.remaining(&c, 1_000), 1);
    // 6 unused of 8 come back at once, though the clock moved on since the reservation.
    h.commit(Target::Own(ticket), claim, 2, Some(r.clone()), 1_000)
        .unwrap();
    assert_eq!(h.remaining(&c, 1_000), 7);
    let (ticket, claim) = h.reserved(&c, 60_000, 20_000);
    h.commit(Target::Own(ticket), claim, 0, Some(r), 30_000)
        .unwrap();
    assert_eq!(h.remaining(&c, 30_000), 10, "full, not more");
}

#[test]
fn a_shadow_rule_lets_a_denied_reservation_through_charging_and_returning_nothing() {
    let mut h = Harness::new();
    let r = rule(
        "[[rule]]\nname = \"dark\"\nroute = \"/llm\"\nmode = \"shadow\"\nalgorithm = \"fixed_window\"\nlimit = 10\nwindow = \"1h\"\n",
    );
    let c = charge(&r, "cust", 10);
    h.reserved(&c, 60_000, 0);
    let opened = h.reserve(&c, 60_000, 0).unwrap();
    assert!(!opened.outcome.decision.allowed);
    let (ticket, expires_at) = opened.reservation.expect("shadow: let through");
    let settled = h
        .commit(Target::Own(ticket), claim_of(&c, expires_at), 0, Some(r), 1)
        .unwrap();
    assert_eq!(settled.returned, 0, "it charged nothing");
    assert_eq!(h.remaining(&c, 1), 0);
}

#[derive(Debug, Clone)]
enum Step {
    Reserve { amount: u64, ttl: u64 },
    Commit { which: usize, actual: u64 },
    Advance(u64),
    Sweep,
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        prop_oneof![
            3 => (1u64..40, 1u64..5_000).prop_map(|(amount, ttl)| Step::Reserve { amount, ttl }),
            3 => (0usize..64, 0u64..80).prop_map(|(which, actual)| Step::Commit { which, actual }),
            1 => (0u64..3_000).prop_map(Step::Advance),
            1 => Just(Step::Sweep),
        ],
        1..80,
    )
}

proptest! {
    /// Against a model: one fixed window of 100 per hour (no boundary in a run), a count,
    /// and each reservation's amount, expiry and state. Every reply and the counter's
    /// remaining units match the model after every step.
    #[test]
    fn reservations_follow_the_reference_model(steps in steps()) {
        let mut h = Harness::with_cap(8);
        let r = hourly();
        let limit = 100u64;
        let mut used = 0u64;
        let mut now = 1_000u64;
        // (ticket, claim, state): 0 open, 1 committed.
        let mut made: Vec<(Ticket, Claim, u8)> = Vec::new();
        for step in steps {
            match step {
                Step::Reserve { amount, ttl } => {
                    let c = charge(&r, "cust", amount);
                    let open = made
                        .iter()
                        .filter(|(_, cl, s)| *s == 0 && now < cl.expires_at)
                        .count();
                    // Due reservations not swept yet still hold their slot.
                    let held = h.shard.table().len();
                    prop_assert!(held >= open);
                    let got = h.reserve(&c, ttl, now);
                    if held >= 8 {
                        prop_assert_eq!(got, Err(Full(held)));
                        continue;
                    }
                    let opened = got.unwrap();
                    let admit = used + amount <= limit;
                    prop_assert_eq!(opened.outcome.decision.allowed, admit);
                    if admit {
                        used += amount;
                        let (ticket, expires_at) = opened.reservation.unwrap();
                        made.push((ticket, claim_of(&c, expires_at), 0));
                    } else {
                        prop_assert!(opened.reservation.is_none());
                    }
                }
                Step::Commit { which, actual } => {
                    if made.is_empty() {
                        continue;
                    }
                    let i = which % made.len();
                    let (ticket, claim, state) = made[i];
                    let got = h.commit(Target::Own(ticket), claim, actual, Some(r.clone()), now);
                    if now >= claim.expires_at {
                        prop_assert_eq!(got, Err(CommitRefused::Expired(claim.expires_at)));
                    } else if state == 1 {
                        prop_assert_eq!(got, Err(CommitRefused::AlreadyCommitted));
                    } else {
                        let settled = got.unwrap();
                        let back = claim.amount.saturating_sub(actual);
                        let excess = actual.saturating_sub(claim.amount);
                        let charged = excess.min(limit - (used - back));
                        prop_assert_eq!(settled.returned, back);
                        prop_assert_eq!(settled.charged, charged);
                        prop_assert_eq!(settled.uncharged, excess - charged);
                        used = used - back + charged;
                        made[i].2 = 1;
                    }
                }
                Step::Advance(ms) => now += ms,
                Step::Sweep => h.shard.expire(now),
            }
            let c = charge(&r, "cust", 1);
            prop_assert_eq!(h.remaining(&c, now), limit - used);
        }
    }
}

#[test]
fn leases_are_granted_up_to_the_rules_concurrency_and_released_through_the_step() {
    let mut h = Harness::new();
    let r = rule(
        "[[rule]]\nname = \"jobs\"\nroute = \"/llm\"\nlimit = 100\nwindow = \"1h\"\nconcurrency = 2\n",
    );
    assert_eq!(r.concurrency, Some(2));
    let c = charge(&r, "cust", 1);
    let acquire = |h: &mut Harness, now| {
        let op = Op::Acquire {
            charge: c.clone(),
            ttl_ms: 1_000,
        };
        match h.shard.step(&mut h.store, op, now, &h.sequence).0 {
            Reply::Acquired(Ok(opened)) => opened,
            other => panic!("{other:?}"),
        }
    };
    let first = acquire(&mut h, 0);
    assert_eq!(
        (
            first.outcome.decision.allowed,
            first.outcome.decision.remaining
        ),
        (true, 1)
    );
    assert!(acquire(&mut h, 0).outcome.decision.allowed);
    let denied = acquire(&mut h, 0);
    assert_eq!(
        (
            denied.outcome.decision.allowed,
            denied.outcome.decision.limit,
            denied.reservation
        ),
        (false, 2, None)
    );
    assert_eq!(h.remaining(&c, 0), 100, "leases charge no rate counter");
    let (ticket, expires_at) = first.reservation.unwrap();
    let claim = Claim {
        counter: c.id,
        fingerprint: 0,
        amount: 1,
        expires_at,
    };
    let release = |h: &mut Harness, target| {
        let op = Op::Release {
            target,
            claim,
            rule: Some(r.clone()),
        };
        match h.shard.step(&mut h.store, op, 10, &h.sequence).0 {
            Reply::Released(result) => result,
            other => panic!("{other:?}"),
        }
    };
    let released = release(&mut h, Target::Own(ticket)).unwrap();
    assert_eq!(
        (released.returned, released.after.unwrap().remaining),
        (1, 1)
    );
    assert_eq!(
        release(&mut h, Target::Own(ticket)),
        Err(LeaseRefused::AlreadyReleased)
    );
    // A lease granted by a gone owner was never counted here: nothing to end.
    let moved = release(&mut h, Target::Moved(9)).unwrap();
    assert_eq!((moved.returned, moved.moved), (0, true));
    assert!(acquire(&mut h, 10).outcome.decision.allowed);
    assert_eq!(h.shard.leases().in_flight(&c.id), 2);
    h.shard.expire(1_000);
    assert_eq!(
        h.shard.leases().in_flight(&c.id),
        1,
        "the TTL released the second"
    );
}
