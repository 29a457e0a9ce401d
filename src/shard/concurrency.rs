//! Concurrency leases: "at most N of this client's requests in flight" (Stripe's
//! concurrent requests limiter), exact on the key's owner. Not the budget leases of
//! `budget.rs`, which lend units of a rate to an entry node: a concurrency lease is a
//! place in flight, held by a caller's request.
//!
//! A lease is one request in flight. The table counts the leases held per counter and
//! grants one only while fewer than the rule's `concurrency` are held; a lease ends when
//! it is released or when its TTL ends, whichever is first, and a lease whose TTL ended
//! is released before any later acquire of the shard is decided, so a lease never
//! outlives its TTL in the count. Like reservations, the table lives in the shard actor
//! that holds the key (one step per acquire or release) and is pure: time comes in as
//! `now`. Leases are named by a [`Ticket`] whose tag is a keyed hash of the serial, the
//! counter and the expiry, so a lease id cannot be guessed, and one that is not held any
//! more is told released (before its expiry) from expired (after) without remembering it.
//!
//! Leases are not handed over and not replicated: an owner that crashes, restarts or
//! hands its keys away takes its leases with it, and the key's new owner starts with
//! none in flight (`docs/reservations.md`, "Concurrency limits").

use std::collections::{BTreeSet, HashMap};

use crate::algorithms::Millis;

use super::tickets::{Claim, Full, Ticket};
use super::KeyId;

/// Why a release changed nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LeaseRefused {
    /// The id was never made by this owner (forged or mistyped).
    #[error("no lease with this id was granted on its owner; nothing changed")]
    Unknown,
    /// The lease was released already.
    #[error("already released: a lease is released once; nothing changed")]
    AlreadyReleased,
    /// The lease's TTL ended first: it was released then.
    #[error(
        "expired at {0} (Unix ms) before this release, so it was released then; nothing changed"
    )]
    Expired(Millis),
}

/// An acquire's verdict: granted (with the lease) or not, and the leases held after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Acquired {
    /// The lease and when it ends, if granted.
    pub lease: Option<(Ticket, Millis)>,
    /// Leases of the counter held after this acquire.
    pub in_flight: u32,
}

/// The leases of one shard.
#[derive(Debug)]
pub struct Concurrency {
    held: HashMap<u64, Claim>,
    in_flight: HashMap<KeyId, u32>,
    expiry: BTreeSet<(Millis, u64)>,
    next_serial: u64,
    key: [u8; 32],
    cap: usize,
    /// Leases ended by their TTL since [`Concurrency::take_expired`] last asked.
    expired: u64,
}

impl Concurrency {
    /// No lease held; at most `cap` at once; ids tagged with `key`.
    pub fn new(cap: usize, key: [u8; 32]) -> Self {
        Self {
            held: HashMap::new(),
            in_flight: HashMap::new(),
            expiry: BTreeSet::new(),
            next_serial: 1,
            key,
            cap: cap.max(1),
            expired: 0,
        }
    }

    /// How many leases ended by their TTL since the last call (for a metric).
    pub fn take_expired(&mut self) -> u64 {
        std::mem::take(&mut self.expired)
    }

    /// Leases held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// True when none is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Leases of `counter` held.
    pub fn in_flight(&self, counter: &KeyId) -> u32 {
        self.in_flight.get(counter).copied().unwrap_or(0)
    }

    fn tag(&self, serial: u64, claim: &Claim) -> u64 {
        let mut mac = blake3::Hasher::new_keyed(&self.key);
        mac.update(b"lease");
        for word in [
            serial,
            claim.counter.placement,
            claim.counter.disc,
            claim.expires_at,
        ] {
            mac.update(&word.to_le_bytes());
        }
        let bytes: [u8; 8] = mac.finalize().as_bytes()[..8].try_into().expect("8 bytes");
        u64::from_le_bytes(bytes)
    }

    /// A lease of `counter` for `ttl_ms`, if fewer than `limit` are held at `now` (leases
    /// whose TTL ended are released first). A full table refuses, granting nothing.
    pub fn acquire(
        &mut self,
        counter: KeyId,
        limit: u32,
        ttl_ms: u64,
        now: Millis,
    ) -> Result<Acquired, Full> {
        self.expire(now);
        let in_flight = self.in_flight(&counter);
        if in_flight >= limit {
            return Ok(Acquired {
                lease: None,
                in_flight,
            });
        }
        if self.held.len() >= self.cap {
            return Err(Full(self.held.len()));
        }
        let claim = Claim {
            counter,
            fingerprint: 0,
            amount: 1,
            expires_at: now.saturating_add(ttl_ms),
        };
        let serial = self.next_serial;
        self.next_serial += 1;
        self.held.insert(serial, claim);
        self.expiry.insert((claim.expires_at, serial));
        *self.in_flight.entry(counter).or_default() += 1;
        Ok(Acquired {
            lease: Some((
                Ticket {
                    serial,
                    tag: self.tag(serial, &claim),
                },
                claim.expires_at,
            )),
            in_flight: in_flight + 1,
        })
    }

    /// Release the lease `ticket` names at `now`: the leases of its counter held after.
    pub fn release(
        &mut self,
        ticket: Ticket,
        claim: &Claim,
        now: Millis,
    ) -> Result<u32, LeaseRefused> {
        let lease = Claim {
            fingerprint: 0,
            amount: 1,
            ..*claim
        };
        if ticket.serial == 0
            || ticket.serial >= self.next_serial
            || self.tag(ticket.serial, &lease) != ticket.tag
        {
            return Err(LeaseRefused::Unknown);
        }
        if now >= lease.expires_at {
            self.expire(now);
            return Err(LeaseRefused::Expired(lease.expires_at));
        }
        if self.held.contains_key(&ticket.serial) {
            self.end(ticket.serial);
            return Ok(self.in_flight(&lease.counter));
        }
        Err(LeaseRefused::AlreadyReleased)
    }

    /// Release every lease whose TTL ended at `now`; returns how many.
    pub fn expire(&mut self, now: Millis) -> u64 {
        let mut ended = 0;
        while let Some(&(at, serial)) = self.expiry.first() {
            if at > now {
                break;
            }
            self.end(serial);
            ended += 1;
        }
        self.expired += ended;
        ended
    }

    fn end(&mut self, serial: u64) {
        let Some(claim) = self.held.remove(&serial) else {
            return;
        };
        self.expiry.remove(&(claim.expires_at, serial));
        if let Some(n) = self.in_flight.get_mut(&claim.counter) {
            *n -= 1;
            if *n == 0 {
                self.in_flight.remove(&claim.counter);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn counter(client: &str) -> KeyId {
        KeyId::of("jobs", client.as_bytes(), "")
    }

    fn claim_of(counter: KeyId, expires_at: Millis) -> Claim {
        Claim {
            counter,
            fingerprint: 0,
            amount: 1,
            expires_at,
        }
    }

    #[test]
    fn at_most_the_limit_is_held_and_a_release_frees_one() {
        let mut leases = Concurrency::new(100, [1; 32]);
        let c = counter("a");
        let mut held = Vec::new();
        for i in 1..=3 {
            let got = leases.acquire(c, 3, 1_000, 0).unwrap();
            assert_eq!(got.in_flight, i);
            held.push(got.lease.unwrap());
        }
        let denied = leases.acquire(c, 3, 1_000, 0).unwrap();
        assert_eq!((denied.lease, denied.in_flight), (None, 3));
        assert_eq!(
            leases.acquire(counter("b"), 3, 1_000, 0).unwrap().in_flight,
            1,
            "per counter"
        );
        let (ticket, expires_at) = held[0];
        assert_eq!(leases.release(ticket, &claim_of(c, expires_at), 10), Ok(2));
        assert_eq!(
            leases.release(ticket, &claim_of(c, expires_at), 10),
            Err(LeaseRefused::AlreadyReleased)
        );
        assert!(leases.acquire(c, 3, 1_000, 10).unwrap().lease.is_some());
    }

    #[test]
    fn a_lease_ends_at_its_ttl_even_without_a_sweep() {
        let mut leases = Concurrency::new(100, [1; 32]);
        let c = counter("a");
        let (ticket, expires_at) = leases.acquire(c, 1, 1_000, 0).unwrap().lease.unwrap();
        assert!(leases.acquire(c, 1, 1_000, 999).unwrap().lease.is_none());
        assert!(
            leases.acquire(c, 1, 1_000, 1_000).unwrap().lease.is_some(),
            "released at its TTL"
        );
        assert_eq!(
            leases.release(ticket, &claim_of(c, expires_at), 1_500),
            Err(LeaseRefused::Expired(1_000))
        );
        assert_eq!(leases.in_flight(&c), 1, "the late release freed nothing");
    }

    #[test]
    fn forged_lease_ids_are_unknown_and_change_nothing() {
        let mut leases = Concurrency::new(100, [1; 32]);
        let c = counter("a");
        let (ticket, expires_at) = leases.acquire(c, 5, 1_000, 0).unwrap().lease.unwrap();
        let forged = [
            (
                Ticket {
                    tag: ticket.tag ^ 4,
                    ..ticket
                },
                claim_of(c, expires_at),
            ),
            (
                Ticket {
                    serial: 2,
                    ..ticket
                },
                claim_of(c, expires_at),
            ),
            (ticket, claim_of(counter("b"), expires_at)),
            (ticket, claim_of(c, expires_at + 1)),
        ];
        for (t, cl) in forged {
            assert_eq!(leases.release(t, &cl, 5), Err(LeaseRefused::Unknown));
        }
        assert_eq!(leases.in_flight(&c), 1);
    }

    #[test]
    fn a_full_table_refuses_and_grants_nothing() {
        let mut leases = Concurrency::new(2, [1; 32]);
        leases.acquire(counter("a"), 9, 1_000, 0).unwrap();
        leases.acquire(counter("b"), 9, 1_000, 0).unwrap();
        assert_eq!(leases.acquire(counter("c"), 9, 1_000, 0), Err(Full(2)));
        assert_eq!(leases.in_flight(&counter("c")), 0);
        assert!(
            leases.acquire(counter("c"), 9, 1_000, 1_000).is_ok(),
            "expired ones made room"
        );
    }

    #[derive(Debug, Clone)]
    enum Step {
        Acquire { ttl: u64 },
        Release(usize),
        Advance(u64),
        Sweep,
    }

    proptest! {
        /// Against a model: a list of (expiry, released) leases of one counter. After
        /// every step the table holds exactly the model's live leases, never more than
        /// the limit, and every answer is the model's.
        #[test]
        fn leases_follow_the_reference_model(
            limit in 1u32..5,
            steps in prop::collection::vec(prop_oneof![
                3 => (1u64..2_000).prop_map(|ttl| Step::Acquire { ttl }),
                2 => (0usize..32).prop_map(Step::Release),
                2 => (0u64..700).prop_map(Step::Advance),
                1 => Just(Step::Sweep),
            ], 1..80),
        ) {
            let mut leases = Concurrency::new(1_000, [3; 32]);
            let c = counter("a");
            let mut now = 0;
            let mut model: Vec<(Ticket, Millis, bool)> = Vec::new();
            for step in steps {
                let live = |m: &[(Ticket, Millis, bool)], now| {
                    m.iter().filter(|(_, e, released)| !released && *e > now).count() as u32
                };
                match step {
                    Step::Acquire { ttl } => {
                        let got = leases.acquire(c, limit, ttl, now).unwrap();
                        let before = live(&model, now);
                        prop_assert_eq!(got.lease.is_some(), before < limit);
                        if let Some((ticket, expires_at)) = got.lease {
                            prop_assert_eq!(expires_at, now + ttl);
                            model.push((ticket, expires_at, false));
                        }
                    }
                    Step::Release(i) if !model.is_empty() => {
                        let i = i % model.len();
                        let (ticket, expires_at, released) = model[i];
                        let got = leases.release(ticket, &claim_of(c, expires_at), now);
                        if now >= expires_at {
                            prop_assert_eq!(got, Err(LeaseRefused::Expired(expires_at)));
                        } else if released {
                            prop_assert_eq!(got, Err(LeaseRefused::AlreadyReleased));
                        } else {
                            model[i].2 = true;
                            prop_assert_eq!(got, Ok(live(&model, now)));
                        }
                    }
                    Step::Release(_) => {}
                    Step::Advance(ms) => now += ms,
                    Step::Sweep => {
                        leases.expire(now);
                    }
                }
                leases.expire(now);
                prop_assert_eq!(leases.in_flight(&c), live(&model, now));
                prop_assert!(leases.in_flight(&c) <= limit);
            }
        }
    }
}
