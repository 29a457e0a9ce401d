//! Reservations: units charged now for work priced only after it is done (a language
//! model's tokens), settled later by a commit that says what the work really used.
//!
//! The table lives on the key's owner, in the shard actor that holds the key's counter,
//! and is driven with the actor's `now`: a reservation is opened in the same actor step
//! as the check that charges its amount, and a commit closes it in the same step as it
//! gives back or charges the difference, so no check of the key runs between the two
//! halves of either. Pure: no clock, no I/O. [`Reservations`] is plain data;
//! [`ReservationShard::step`] applies an [`Op`] to it and to the shard's [`Store`].
//!
//! What a commit of `actual` units does to a reservation of `amount`
//! (`docs/reservations.md` has the numbers):
//! - `actual < amount`: gives back `amount - actual` as a refund of the reservation's
//!   own admission, at its instant (a window that rolled past since keeps its count,
//!   as with any refund), except for the token bucket, whose level goes up now, capped
//!   at full. Never more than the reservation charged.
//! - `actual > amount`: charges the excess, never denied (the work is done): as much as
//!   the counter still holds. A counter never goes below empty (state past its limit is
//!   refused at a handoff, and the algorithms' arithmetic is built for `0..=limit`), so
//!   the part of the excess that finds it empty is reported as `uncharged`.
//! - a reservation whose TTL ended was committed at its amount: it is only forgotten.
//!
//! A reservation is named by a [`Ticket`]: a per-shard serial and a 64-bit tag, a keyed
//! hash (BLAKE3, a key drawn when the shard starts) of the serial and of what the
//! reservation charged. The tag makes ids unguessable, and lets a closed reservation be
//! told from one never made without remembering it: an id whose tag verifies and that is
//! not open was committed (before its TTL) or expired (after), and one whose tag does
//! not verify was never made here. Only open reservations take room, at most
//! [`MAX_RESERVATIONS_PER_SHARD`] per shard.

use std::collections::{BTreeSet, HashMap};
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::algorithms::{AlgorithmKind, Decision, Millis};
use crate::config::rules::Rule;

use super::concurrency::{Concurrency, LeaseRefused};
pub use super::tickets::{Claim, Full, Ticket};
use super::{Charge, Churn, Counter, Outcome, ShardError, Shards, Store};

/// Most open reservations (and records of commits applied for moved keys) one shard
/// holds. Past it a new reservation is refused, charging nothing: a flood of
/// reservations never committed must not grow a node's memory without bound.
pub const MAX_RESERVATIONS_PER_SHARD: usize = 65_536;

/// Which reservation a commit closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// One opened on this shard.
    Own(Ticket),
    /// One made on another node (or an earlier run of this one) for a key this node owns
    /// now, named by a hash of its whole id: its record died with that owner, so only
    /// the excess is charged here, once.
    Moved(u64),
}

/// A change to the reservation table, with the counter work it implies.
#[derive(Debug, Clone)]
pub enum Op {
    /// Check `charge` (its cost is the amount) and, if admitted, open a reservation
    /// that expires `ttl_ms` later.
    Reserve {
        /// The planned check.
        charge: Charge,
        /// Time until an uncommitted reservation is committed at its amount.
        ttl_ms: u64,
    },
    /// Grant a lease of `charge`'s counter (one request in flight) if fewer than its
    /// rule's `concurrency` are held; the lease ends `ttl_ms` later at the latest.
    Acquire {
        /// The planned acquire (its rule declares a concurrency limit).
        charge: Charge,
        /// Time until an unreleased lease is released.
        ttl_ms: u64,
    },
    /// End a lease.
    Release {
        /// Which lease ([`Target::Moved`]: one granted by another owner, lost with it).
        target: Target,
        /// What its id says it holds.
        claim: Claim,
        /// The counter's rule as this node has it now (for the numbers after).
        rule: Option<Arc<Rule>>,
    },
    /// Close a reservation with what the work used.
    Commit {
        /// Which reservation.
        target: Target,
        /// What its id says it charged.
        claim: Claim,
        /// Units the work used.
        actual: u64,
        /// The counter's rule as this node has it now: `None` when the rule is gone or
        /// its numbers changed (its counters restarted, so there is nothing left to
        /// give back or to charge the excess to).
        rule: Option<Arc<Rule>>,
    },
}

/// A shard's answer to an [`Op`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// To [`Op::Reserve`].
    Reserved(Result<Opened, Full>),
    /// To [`Op::Commit`].
    Committed(Result<Settled, CommitRefused>),
    /// To [`Op::Acquire`]: the outcome's decision says granted or not, `limit` being the
    /// concurrency limit and `remaining` the leases still grantable.
    Acquired(Result<Opened, Full>),
    /// To [`Op::Release`]: `returned` is 1 when a lease held here ended.
    Released(Result<Settled, LeaseRefused>),
}

/// A reservation's check, and the reservation if the check admitted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    /// The check of the amount, as any check's outcome.
    pub outcome: Outcome,
    /// Set when admitted (or denied only by a rule in shadow mode): the ticket, and
    /// when the reservation expires.
    pub reservation: Option<(Ticket, Millis)>,
}

/// What a commit did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// Units given back (`amount - actual`, at most what the reservation charged).
    pub returned: u64,
    /// Units of the excess (`actual - amount`) charged.
    pub charged: u64,
    /// Units of the excess that found the counter empty.
    pub uncharged: u64,
    /// Applied for a reservation made elsewhere ([`Target::Moved`]).
    pub moved: bool,
    /// The counter's numbers after the commit; `None` when its rule is gone.
    pub after: Option<Decision>,
    /// This node's sequence number for the commit.
    pub sequence: u64,
}

/// Why a commit changed nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CommitRefused {
    /// The id was never made by this owner (a forged or mistyped id, or one made before
    /// the owner restarted).
    #[error("no reservation with this id was made on its owner; nothing changed")]
    Unknown,
    /// The reservation was committed already.
    #[error("already committed: a reservation is committed once; nothing changed")]
    AlreadyCommitted,
    /// The reservation's TTL ended first: it was committed at its amount.
    #[error(
        "expired at {0} (Unix ms) before this commit, so it was committed at its amount; \
         nothing changed"
    )]
    Expired(Millis),
}

/// An open reservation.
#[derive(Debug, Clone, Copy)]
struct Entry {
    claim: Claim,
    /// Units the check took (0 when only a shadow rule's denial let it through).
    charged: u64,
    /// The check's instant: a give-back is a refund of the admission made then.
    at: Millis,
}

/// The reservations of one shard: open ones by serial, records of commits applied for
/// moved keys, and both by expiry.
#[derive(Debug)]
pub struct Reservations {
    open: HashMap<u64, Entry>,
    moved: HashMap<u64, Millis>,
    expiry: BTreeSet<(Millis, Slot)>,
    next_serial: u64,
    key: [u8; 32],
    cap: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Slot {
    Open(u64),
    Moved(u64),
}

impl Reservations {
    /// An empty table of at most `cap` entries, tagging ids with `key`.
    pub fn new(cap: usize, key: [u8; 32]) -> Self {
        Self {
            open: HashMap::new(),
            moved: HashMap::new(),
            expiry: BTreeSet::new(),
            next_serial: 1,
            key,
            cap: cap.max(1),
        }
    }

    /// Entries held: open reservations and records of moved commits.
    pub fn len(&self) -> usize {
        self.open.len() + self.moved.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether one more entry fits.
    pub fn has_room(&self) -> bool {
        self.len() < self.cap
    }

    fn tag(&self, serial: u64, claim: &Claim) -> u64 {
        let mut mac = blake3::Hasher::new_keyed(&self.key);
        for word in [
            serial,
            claim.counter.placement,
            claim.counter.disc,
            claim.fingerprint,
            claim.amount,
            claim.expires_at,
        ] {
            mac.update(&word.to_le_bytes());
        }
        let bytes: [u8; 8] = mac.finalize().as_bytes()[..8].try_into().expect("8 bytes");
        u64::from_le_bytes(bytes)
    }

    /// Open a reservation of `claim` whose check took `charged` units at `at`.
    pub fn open(&mut self, claim: Claim, charged: u64, at: Millis) -> Result<Ticket, Full> {
        if !self.has_room() {
            return Err(Full(self.len()));
        }
        let serial = self.next_serial;
        self.next_serial += 1;
        self.open.insert(serial, Entry { claim, charged, at });
        self.expiry.insert((claim.expires_at, Slot::Open(serial)));
        Ok(Ticket {
            serial,
            tag: self.tag(serial, &claim),
        })
    }

    /// Close the reservation `ticket` names, if it is open and `claim` is what it
    /// charged, at `now`: its entry, or why nothing changes.
    fn close(
        &mut self,
        ticket: Ticket,
        claim: &Claim,
        now: Millis,
    ) -> Result<Entry, CommitRefused> {
        if ticket.serial == 0
            || ticket.serial >= self.next_serial
            || self.tag(ticket.serial, claim) != ticket.tag
        {
            return Err(CommitRefused::Unknown);
        }
        // A genuine id: open, committed, or past its TTL.
        let Some(entry) = self.open.get(&ticket.serial).copied() else {
            return Err(if now >= claim.expires_at {
                CommitRefused::Expired(claim.expires_at)
            } else {
                CommitRefused::AlreadyCommitted
            });
        };
        if now >= entry.claim.expires_at {
            // Due, not swept yet: it was committed at its amount.
            self.forget(ticket.serial);
            return Err(CommitRefused::Expired(entry.claim.expires_at));
        }
        self.forget(ticket.serial);
        Ok(entry)
    }

    fn forget(&mut self, serial: u64) {
        if let Some(entry) = self.open.remove(&serial) {
            self.expiry
                .remove(&(entry.claim.expires_at, Slot::Open(serial)));
        }
    }

    /// Record a commit applied here for a reservation made elsewhere (`hash` of its id),
    /// so a second commit of it charges nothing; kept until the id's expiry.
    fn close_moved(&mut self, hash: u64, claim: &Claim, now: Millis) -> Result<(), CommitRefused> {
        if now >= claim.expires_at {
            return Err(CommitRefused::Expired(claim.expires_at));
        }
        if self.moved.contains_key(&hash) {
            return Err(CommitRefused::AlreadyCommitted);
        }
        if self.has_room() {
            self.moved.insert(hash, claim.expires_at);
            self.expiry.insert((claim.expires_at, Slot::Moved(hash)));
        }
        // A full table still applies the commit (it is never refused: the work is done);
        // only a second commit of the same id would charge its excess again.
        Ok(())
    }

    /// Forget what is due at `now`: open reservations whose TTL ended (committed at
    /// their amount: their units stay charged) and moved-commit records past their
    /// id's expiry. Returns how many open reservations expired.
    pub fn expire(&mut self, now: Millis) -> u64 {
        let mut expired = 0;
        while let Some(&(at, slot)) = self.expiry.first() {
            if at > now {
                break;
            }
            self.expiry.pop_first();
            match slot {
                Slot::Open(serial) => {
                    expired += u64::from(self.open.remove(&serial).is_some());
                }
                Slot::Moved(hash) => {
                    self.moved.remove(&hash);
                }
            }
        }
        expired
    }
}

/// Metrics of a shard's reservations, resolved once.
struct ReservationMetrics {
    held: metrics::Gauge,
    reserved: metrics::Counter,
    denied: metrics::Counter,
    full: metrics::Counter,
    committed: metrics::Counter,
    committed_moved: metrics::Counter,
    refused: metrics::Counter,
    expired: metrics::Counter,
    leases_held: metrics::Gauge,
    /// [granted, denied].
    leases: [metrics::Counter; 2],
    leases_full: metrics::Counter,
    leases_expired: metrics::Counter,
}

impl ReservationMetrics {
    fn new(shard: usize) -> Self {
        let shard = shard.to_string();
        let reserve = |outcome: &'static str| metrics::counter!("ringlimit_reservations_total", "outcome" => outcome);
        let commit =
            |result: &'static str| metrics::counter!("ringlimit_commits_total", "result" => result);
        Self {
            held: metrics::gauge!("ringlimit_reservations_open", "shard" => shard.clone()),
            leases_held: metrics::gauge!("ringlimit_leases_held", "shard" => shard),
            leases: ["granted", "denied"]
                .map(|outcome| metrics::counter!("ringlimit_leases_total", "outcome" => outcome)),
            leases_full: metrics::counter!("ringlimit_leases_total", "outcome" => "full"),
            leases_expired: metrics::counter!("ringlimit_leases_expired_total"),
            reserved: reserve("reserved"),
            denied: reserve("denied"),
            full: reserve("full"),
            committed: commit("committed"),
            committed_moved: commit("moved"),
            refused: commit("refused"),
            expired: metrics::counter!("ringlimit_reservations_expired_total"),
        }
    }
}

/// A shard's reservations and leases, and their metrics: what the shard actor owns.
pub struct ReservationShard {
    table: Reservations,
    leases: Concurrency,
    metrics: ReservationMetrics,
}

impl ReservationShard {
    /// The reservations and leases of shard `index`, tagging ids with `key`.
    pub fn new(index: usize, key: [u8; 32]) -> Self {
        Self {
            table: Reservations::new(MAX_RESERVATIONS_PER_SHARD, key),
            leases: Concurrency::new(MAX_RESERVATIONS_PER_SHARD, key),
            metrics: ReservationMetrics::new(index),
        }
    }

    /// The leases.
    pub fn leases(&self) -> &Concurrency {
        &self.leases
    }

    /// The table.
    pub fn table(&self) -> &Reservations {
        &self.table
    }

    /// Apply `op` to the table and to `store` at `now`; decisions are numbered from
    /// `sequence`. Returns the answer and what the store dropped to make room.
    pub fn step(
        &mut self,
        store: &mut Store,
        op: Op,
        now: Millis,
        sequence: &AtomicU64,
    ) -> (Reply, Churn) {
        let (reply, churn) = match op {
            Op::Reserve { charge, ttl_ms } => {
                let (opened, churn) = self.reserve(store, &charge, ttl_ms, now, sequence);
                (Reply::Reserved(opened), churn)
            }
            Op::Commit {
                target,
                claim,
                actual,
                rule,
            } => {
                let (settled, churn) = self.commit(
                    store,
                    target,
                    &claim,
                    actual,
                    rule.as_deref(),
                    now,
                    sequence,
                );
                (Reply::Committed(settled), churn)
            }
            Op::Acquire { charge, ttl_ms } => {
                let acquired = self.acquire(&charge, ttl_ms, now, sequence);
                (Reply::Acquired(acquired), Churn::default())
            }
            Op::Release {
                target,
                claim,
                rule,
            } => (
                Reply::Released(self.release(target, &claim, rule.as_deref(), now, sequence)),
                Churn::default(),
            ),
        };
        self.metrics.held.set(self.table.len() as f64);
        self.metrics.leases_held.set(self.leases.len() as f64);
        (reply, churn)
    }

    fn acquire(
        &mut self,
        charge: &Charge,
        ttl_ms: u64,
        now: Millis,
        sequence: &AtomicU64,
    ) -> Result<Opened, Full> {
        // Planning refuses a rule without a concurrency limit; none here grants nothing.
        let limit = charge.rule.concurrency.unwrap_or(0);
        let expired = self.leases.acquire(charge.id, limit, ttl_ms, now);
        self.count_expired_leases();
        let acquired = expired.inspect_err(|_| self.metrics.leases_full.increment(1))?;
        let granted = acquired.lease.is_some();
        self.metrics.leases[usize::from(!granted)].increment(1);
        let decision = Decision {
            allowed: granted,
            limit: u64::from(limit),
            remaining: u64::from(limit.saturating_sub(acquired.in_flight)),
            retry_after_ms: 0,
            reset_at_ms: acquired.lease.map_or(now, |(_, expires_at)| expires_at),
            window_id: None,
            delay_ms: 0,
        };
        Ok(Opened {
            outcome: Outcome {
                decision,
                sequence: sequence.fetch_add(1, Ordering::Relaxed) + 1,
                at: now,
                fresh: false,
            },
            reservation: acquired.lease,
        })
    }

    fn release(
        &mut self,
        target: Target,
        claim: &Claim,
        rule: Option<&Rule>,
        now: Millis,
        sequence: &AtomicU64,
    ) -> Result<Settled, LeaseRefused> {
        // A lease granted by another owner (or an earlier run) was lost with it: this
        // node never counted it, so there is nothing to end.
        let returned = match target {
            Target::Own(ticket) => {
                let released = self.leases.release(ticket, claim, now);
                self.count_expired_leases();
                released?;
                1
            }
            Target::Moved(_) => 0,
        };
        let in_flight = self.leases.in_flight(&claim.counter);
        let after = rule.and_then(|r| r.concurrency).map(|limit| Decision {
            allowed: in_flight < limit,
            limit: u64::from(limit),
            remaining: u64::from(limit.saturating_sub(in_flight)),
            retry_after_ms: 0,
            reset_at_ms: now,
            window_id: None,
            delay_ms: 0,
        });
        Ok(Settled {
            returned,
            charged: 0,
            uncharged: 0,
            moved: matches!(target, Target::Moved(_)),
            after,
            sequence: sequence.fetch_add(1, Ordering::Relaxed) + 1,
        })
    }

    fn count_expired_leases(&mut self) {
        let ended = self.leases.take_expired();
        if ended > 0 {
            self.metrics.leases_expired.increment(ended);
        }
    }

    /// Sweep due reservations and leases (the actor's expiry tick).
    pub fn expire(&mut self, now: Millis) {
        let expired = self.table.expire(now);
        if expired > 0 {
            self.metrics.expired.increment(expired);
        }
        self.leases.expire(now);
        self.count_expired_leases();
        self.metrics.held.set(self.table.len() as f64);
        self.metrics.leases_held.set(self.leases.len() as f64);
    }

    fn reserve(
        &mut self,
        store: &mut Store,
        charge: &Charge,
        ttl_ms: u64,
        now: Millis,
        sequence: &AtomicU64,
    ) -> (Result<Opened, Full>, Churn) {
        // Room first: a refusal must charge nothing.
        if !self.table.has_room() {
            self.metrics.full.increment(1);
            return (Err(Full(self.table.len())), Churn::default());
        }
        let (decision, churn, fresh) = store.check(charge.counter(), now, charge.cost);
        let outcome = Outcome {
            decision,
            sequence: sequence.fetch_add(1, Ordering::Relaxed) + 1,
            at: now,
            fresh,
        };
        // A shadow rule's denial lets the request through (and charged nothing).
        let reservation = (decision.allowed || charge.rule.shadow).then(|| {
            let claim = Claim {
                counter: charge.id,
                fingerprint: charge.rule.fingerprint,
                amount: charge.cost.get(),
                expires_at: now.saturating_add(ttl_ms),
            };
            let charged = if decision.allowed { claim.amount } else { 0 };
            let ticket = self.table.open(claim, charged, now).expect("room checked");
            (ticket, claim.expires_at)
        });
        if reservation.is_some() {
            self.metrics.reserved.increment(1);
        } else {
            self.metrics.denied.increment(1);
        }
        (
            Ok(Opened {
                outcome,
                reservation,
            }),
            churn,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn commit(
        &mut self,
        store: &mut Store,
        target: Target,
        claim: &Claim,
        actual: u64,
        rule: Option<&Rule>,
        now: Millis,
        sequence: &AtomicU64,
    ) -> (Result<Settled, CommitRefused>, Churn) {
        let closed = match target {
            Target::Own(ticket) => self.table.close(ticket, claim, now).map(Some),
            Target::Moved(hash) => self.table.close_moved(hash, claim, now).map(|()| None),
        };
        let entry = match closed {
            Ok(entry) => entry,
            Err(refused) => {
                self.metrics.refused.increment(1);
                return (Err(refused), Churn::default());
            }
        };
        // Own: give back up to what the check took. Moved: the reserved units may or may
        // not be in this node's count (handed over, or lost with a dead owner), so
        // nothing is given back; the excess is charged either way.
        let (give_back, at) = match entry {
            Some(e) => (claim.amount.saturating_sub(actual).min(e.charged), e.at),
            None => (0, now),
        };
        let excess = actual.saturating_sub(claim.amount);
        let mut settled = Settled {
            returned: 0,
            charged: 0,
            uncharged: excess,
            moved: entry.is_none(),
            after: None,
            sequence: sequence.fetch_add(1, Ordering::Relaxed) + 1,
        };
        let mut churn = Churn::default();
        // The counter is touched only under the numbers it was charged under.
        if let Some(rule) = rule.filter(|r| r.fingerprint == claim.fingerprint) {
            let counter = Counter {
                id: claim.counter,
                fingerprint: rule.fingerprint,
                limiter: &rule.limiter,
                local: false,
            };
            if let Some(units) = NonZeroU64::new(give_back) {
                give_back_units(store, counter, units, at, now);
                settled.returned = give_back;
            }
            if let Some(units) = NonZeroU64::new(excess) {
                let (charged, c) = charge_excess(store, counter, units, now);
                churn += c;
                settled.charged = charged;
                settled.uncharged = excess - charged;
            }
            settled.after = Some(store.peek(counter, now));
        }
        if settled.moved {
            self.metrics.committed_moved.increment(1);
        } else {
            self.metrics.committed.increment(1);
        }
        (Ok(settled), churn)
    }
}

/// Give back `units` of an admission made at `at`: a refund of that admission, except
/// for the token bucket, whose refund is exact only until the clock moves on, while
/// raising its level now (capped at full) never leaves it fuller than if the units had
/// not been charged.
fn give_back_units(
    store: &mut Store,
    counter: Counter<'_>,
    units: NonZeroU64,
    at: Millis,
    now: Millis,
) {
    if counter.limiter.kind() == AlgorithmKind::TokenBucket {
        store.give_back(counter, now, units);
    } else {
        store.refund(counter, at, units);
    }
}

/// Charge `units` never denied: all of them if the counter admits them, else what it
/// still holds. Returns the units charged.
fn charge_excess(
    store: &mut Store,
    counter: Counter<'_>,
    units: NonZeroU64,
    now: Millis,
) -> (u64, Churn) {
    let (decision, mut churn, _) = store.check(counter, now, units);
    if decision.allowed {
        return (units.get(), churn);
    }
    let Some(rest) = NonZeroU64::new(decision.remaining) else {
        return (0, churn);
    };
    let (drained, c, _) = store.check(counter, now, rest);
    churn += c;
    (if drained.allowed { rest.get() } else { 0 }, churn)
}

/// A key for the tags of one shard's ids: drawn from the process's randomness (std's
/// randomly keyed hasher) and the time, once per shard at start.
pub fn random_key() -> [u8; 32] {
    use std::hash::{BuildHasher, Hasher};
    let mut seed = Vec::with_capacity(8 * 8);
    for _ in 0..8 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        seed.extend_from_slice(&h.finish().to_le_bytes());
    }
    *blake3::hash(&seed).as_bytes()
}

impl Shards {
    /// Apply a reservation or lease op on the shard of ring position `placement`. A
    /// reservation or an acquire is refused [`ShardError::Overloaded`] by a full inbox,
    /// like a check; a commit or a release waits for room, since it must not be lost.
    pub async fn reservation(&self, placement: u64, op: Op) -> Result<Reply, ShardError> {
        let shard = self.shard_of_placement(placement);
        let reserve = matches!(op, Op::Reserve { .. } | Op::Acquire { .. });
        let (reply, rx) = tokio::sync::oneshot::channel();
        let command = super::Command::Reservation { op, reply };
        if reserve {
            self.inboxes[shard].try_send(command).map_err(|e| match e {
                tokio::sync::mpsc::error::TrySendError::Full(_) => ShardError::Overloaded(shard),
                tokio::sync::mpsc::error::TrySendError::Closed(_) => ShardError::Stopped(shard),
            })?;
        } else {
            self.inboxes[shard]
                .send(command)
                .await
                .map_err(|_| ShardError::Stopped(shard))?;
        }
        rx.await.map_err(|_| ShardError::Stopped(shard))
    }
}

impl super::Actor {
    /// One reservation op in the actor's step at `now`, counted like a check. Like a
    /// check, it first promotes the counter's replica if this node holds one (it may
    /// have become the key's owner since), and marks the counter changed for
    /// replication afterwards.
    pub(super) fn reservation(&mut self, op: Op, now: Millis) -> Reply {
        let touched = touched(&op);
        let (reservations, sequence) = (&mut self.reservations, &self.sequence);
        let ((reply, c), mut churn) = self.core.step_live(touched.as_ref(), now, |store| {
            reservations.step(store, op, now, sequence)
        });
        churn += c;
        if let (Some(charge), Reply::Reserved(Ok(opened))) = (&touched, &reply) {
            let denied = !opened.outcome.decision.allowed;
            self.metrics.checks.of(&charge.rule)[usize::from(denied)].increment(1);
        }
        self.record_churn(churn);
        reply
    }
}

/// The counter an op charges or gives back to, as a charge of it (for replication's
/// promote and changed hooks); `None` for ops that leave every counter alone.
fn touched(op: &Op) -> Option<Charge> {
    match op {
        Op::Reserve { charge, .. } => Some(charge.clone()),
        Op::Commit {
            claim,
            rule: Some(rule),
            ..
        } if rule.fingerprint == claim.fingerprint => Some(Charge {
            id: claim.counter,
            rule: rule.clone(),
            cost: NonZeroU64::MIN,
            give_back: None,
            drain: false,
            peek: false,
            target: Default::default(),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
