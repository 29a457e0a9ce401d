//! The per-shard counter store: pure, synchronous, time injected.
//!
//! One [`Store`] is owned by value by exactly one shard actor, so it needs no locks. It
//! maps a [`KeyId`] (a 128-bit identity of rule, client key and route part) to the algorithm
//! state of that key and bounds its own memory in two ways:
//!
//! - **Expiry.** Every algorithm reports when a key's state becomes indistinguishable
//!   from a fresh one (a token bucket that has refilled, a window that has aged out).
//!   Dropping it then loses nothing. [`Store::expire`] walks the keys incrementally from
//!   a cursor, a bounded number of entries per call, like Redis's active expiry, so a
//!   tick never pauses the shard for long however many keys it holds.
//! - **A key cap.** When a new key arrives at a full store, one key is evicted, the one
//!   whose loss changes the fewest future answers (see *Least-harm eviction* below).
//!   Eviction does lose counts (that client's budget restarts), which is why every
//!   eviction is counted and surfaced: the design reference calls eviction the one failure
//!   that shows no error signal.
//!
//! ## Least-harm eviction
//!
//! A client that floods unique keys must not be able to push an exhausted counter out
//! and get its budget back. So the store never evicts a *denied* key (one whose next
//! check of cost 1 would be denied) while any other key can go:
//!
//! - Each slot carries a `DENIED` bit, set when the last decision on the key left it
//!   exhausted (`remaining == 0`) and cleared when one leaves it with budget. Time only
//!   moves a state towards fresh, so the bit over-approximates "denied now": a key that
//!   is denied now has the bit. (A key that recovered since keeps it until its next
//!   check or its expiry: it is protected a little longer than needed, never less.)
//! - The dense slot vector is kept partitioned: denied slots first (`slots[..denied]`),
//!   the others after. Moving a key across the boundary is one swap, done only when its
//!   bit changes. Eviction samples only the non-denied part, so it is O(samples) and a
//!   sample can never hit a denied key while a non-denied one exists. Only when every
//!   key is denied does it sample the denied part, and that kind of eviction is counted
//!   apart ([`Churn::evicted_denied`]).
//! - Among the sampled candidates an expired one goes first (it is fresh already), then
//!   the one that had consumed the fewest units at its last decision (a 5-bit log2 of
//!   `limit - remaining` kept in the slot: one flood hit is 1, the minimum), then the one
//!   that is back to fresh soonest. A flood of single-hit keys therefore mostly evicts
//!   its own keys, and never an exhausted one.
//!
//! ## Byte budget
//!
//! The key cap bounds slots, not bytes: a sliding log keeps one 16-byte entry per
//! admitted unit, so 2,000 logs of a 2,000-per-window rule hold ~64 MB under a cap of a
//! million keys. Every state that lives on the side (every sliding log, the rare
//! oversized schedule) is therefore charged to a byte budget ([`Store::with_byte_budget`],
//! the node's `--max-state-bytes` split over its shards): its map entry plus the heap it
//! owns, at the buffer's capacity (what the allocator really holds). When a check or an
//! installed state takes the side over the budget, side keys are evicted in the same
//! least-harm order as at the key cap, with the same guarantee: the side keys are kept
//! partitioned by the `DENIED` bit too, and a denied one goes only when every side key
//! is denied (counted apart). Those evictions show in the same metric.
//!
//! ## Memory layout
//!
//! A rate limiter holds one small state for each of millions of keys, so the bytes per
//! key are the product (target and measurements: `bench/RESULTS.md`, "Memory per key").
//! Each key is one `Slot` in a dense vector: its [`KeyId`] (in place of the key's bytes,
//! which would be an allocation of their own), the state packed into two words
//! ([`KeyState::to_pair`]) and a word of metadata (an interned rule fingerprint, the
//! algorithm, flags), all as `u32`s so the slot has no padding. When a state becomes fresh
//! again is not stored: it follows from the state and the rule's limiter, which the
//! interned fingerprint names, and is computed where it is needed (the expiry walk, an
//! eviction sample). A table of `u32` positions (`positions.rs`) finds a slot. States that
//! do not fit two words (every sliding log; an oversized GCRA schedule or sliding count)
//! live whole in a side map, as do the rare handoff records. The slot vector doubles, but
//! its spare capacity is address space, not memory, until it is written.
//!
//! Identity by hash is a deliberate trade: two different (rule, client, route) triples
//! share a counter only if both their 64-bit ring placement and their 64-bit
//! discriminator collide, about 2^-64 per pair of keys of one client. If it ever
//! happened the two would share one budget: stricter than configured, never looser.

use super::identity::KeyId;
use super::Recipient;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::num::NonZeroU64;
use std::sync::Arc;

mod frozen;
mod positions;
mod replica;
mod slot;

pub use frozen::Frozen;

use positions::Positions;
use slot::{
    split, Slot, DENIED, FP_MASK, HARM_MASK, HARM_SHIFT, KIND_MASK, KIND_SHIFT, LOCAL, MOVED,
    OVERFLOW,
};

use crate::algorithms::{Decision, KeyState, Limiter, Millis};

/// How many entries an eviction samples. More samples evict closer to the true
/// least-harm entry at the price of more work per eviction.
const EVICTION_SAMPLES: usize = 8;

/// A per-process random seed for the position table: identities are deterministic
/// (they travel between nodes), so the table hashes them again with a secret seed to
/// keep attacker-chosen keys from piling into one probe sequence.
type TableHasher = foldhash::fast::RandomState;

/// Which counter an operation is about, and the rule numbers it runs under.
#[derive(Debug, Clone, Copy)]
pub struct Counter<'a> {
    /// The counter's identity (rule, client key, route part), computed when it was planned.
    pub id: KeyId,
    /// Fingerprint of the rule's numbers: state built under other numbers is discarded.
    pub fingerprint: u64,
    /// The rule's algorithm.
    pub limiter: &'a Limiter,
    /// The counter belongs to this node alone (a fail-open fallback): never handed over.
    pub local: bool,
}

/// One key's state on its way to another node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exported {
    // (`to` travels beside it: see `Store::export` and `Store::drain_deltas`.)
    /// The counter's identity.
    pub id: KeyId,
    /// Fingerprint of the rule numbers the state was built under.
    pub fingerprint: u64,
    /// The algorithm state.
    pub state: KeyState,
}

/// Where a decision left a key, for eviction: exhausted (denied for a cost of 1 at the
/// decision's instant) and the harm bucket of what it had consumed.
fn standing(decision: &Decision) -> (bool, u32) {
    let consumed = decision.limit.saturating_sub(decision.remaining);
    let harm = (u64::BITS - consumed.leading_zeros()).min(HARM_MASK);
    (decision.remaining == 0, harm)
}

/// [`standing`] of a state this store did not decide itself (installed or merged):
/// probe a copy with a check of cost 1.
fn probe_standing(limiter: &Limiter, state: &KeyState, now: Millis) -> (bool, u32) {
    let mut copy = state.clone();
    let probe = limiter.check(&mut copy, now, NonZeroU64::MIN);
    // An admitted probe took one unit the key still had.
    let before = probe.remaining + u64::from(probe.allowed);
    let consumed = probe.limit.saturating_sub(before);
    let harm = (u64::BITS - consumed.leading_zeros()).min(HARM_MASK);
    (!probe.allowed, harm)
}

/// A state kept beside its slot (it does not pack into two words).
#[derive(Debug)]
struct Side {
    state: KeyState,
    /// Position in `Store::side_ids`.
    at: u32,
    /// Mirrors the slot's `DENIED` bit, for the partition of `side_ids`.
    denied: bool,
}

/// What a side state costs the byte budget: its map entry, its id in `side_ids` and
/// the heap it owns (a sliding log's buffer).
fn side_cost(state: &KeyState) -> usize {
    std::mem::size_of::<(KeyId, Side)>() + std::mem::size_of::<KeyId>() + state.heap_bytes()
}

/// A key whose state was handed to a new owner but may still be decided here.
///
/// A node still on the old ring may forward a check to the old owner after the
/// handoff, and a forwarded check is never forwarded again. Deciding it on a fresh
/// counter would let this node admit the key's limit twice in one window under one
/// identity. So the old owner keeps the handed-over state and keeps counting on it, and
/// records what it admits after the handoff in `delta`, which is pushed to the new
/// owner and merged there: both sides see every admission.
#[derive(Debug, Clone)]
struct Moved {
    /// The new owner.
    to: Arc<str>,
    /// The new owner's incarnation (see [`Recipient`]).
    generation: u64,
    /// Fingerprint of the rule numbers, travelling with each delta.
    fingerprint: u64,
    /// Admissions made here since the handoff (or the last delta push).
    delta: KeyState,
    /// `delta` holds admissions not pushed yet.
    dirty: bool,
}

/// What happened to the store's size during one operation, for metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Churn {
    /// Keys dropped because their state had become equivalent to fresh.
    pub expired: u64,
    /// Live keys that still had budget, dropped to respect the key cap: their counts
    /// were lost (the client regains at most what it had spent).
    pub evicted: u64,
    /// Exhausted (denied) keys dropped to respect the key cap, which happens only when
    /// every key of the store was denied: their clients are admitted again early.
    pub evicted_denied: u64,
    /// Replicas (other owners' keys kept for their successor role) dropped to make room
    /// for live keys, as they are meant to be: no count is lost while their owners live.
    pub evicted_replicas: u64,
}

impl Churn {
    /// This churn as it happened in a store of replicas: its evictions are replicas'.
    pub fn of_replicas(self) -> Self {
        Self {
            expired: self.expired,
            evicted_replicas: self.evicted + self.evicted_denied + self.evicted_replicas,
            ..Self::default()
        }
    }
}

impl std::ops::AddAssign for Churn {
    fn add_assign(&mut self, rhs: Self) {
        self.expired += rhs.expired;
        self.evicted += rhs.evicted;
        self.evicted_denied += rhs.evicted_denied;
        self.evicted_replicas += rhs.evicted_replicas;
    }
}

/// A shard's keys and their algorithm state.
#[derive(Debug)]
pub struct Store {
    /// Dense: stable positions for the expiry cursor and the eviction sample, and no
    /// per-bucket waste beyond the vector's growth slack. Partitioned: the first
    /// `denied` slots have `DENIED` set, the rest do not.
    slots: Vec<Slot>,
    /// How many slots (at the front) are denied.
    denied: usize,
    /// Positions in `slots`, found by the secret-seeded hash of a slot's id.
    index: Positions,
    hasher: TableHasher,
    /// States that do not pack into two words, each with its position in `side_ids`.
    overflow: HashMap<KeyId, Side, TableHasher>,
    /// The keys of `overflow`, dense for sampling, partitioned like `slots`: the first
    /// `side_denied` are denied (see *Byte budget*).
    side_ids: Vec<KeyId>,
    side_denied: usize,
    /// Bytes the side states hold ([`side_cost`] summed), against `max_side_bytes`.
    side_bytes: usize,
    max_side_bytes: usize,
    /// Keys handed to a new owner.
    moved: HashMap<KeyId, Moved, TableHasher>,
    /// Interned rule versions: a slot stores a 20-bit position here instead of the
    /// 64-bit fingerprint, and finds here the limiter its expiry is derived from.
    fingerprints: Vec<(u64, Limiter)>,
    fingerprint_slots: HashMap<u64, u32, TableHasher>,
    /// The last fingerprint interned: most checks in a row share a rule.
    last_fingerprint: Option<(u64, u32)>,
    cap: usize,
    cursor: usize,
    rng: u64,
}

impl Store {
    /// An empty store holding at most `cap` keys (at least 1, at most ~1.7 billion: see
    /// `positions::MAX_LEN`).
    /// `seed` drives eviction sampling, so tests are reproducible.
    pub fn new(cap: usize, seed: u64) -> Self {
        let cap = cap.clamp(1, positions::MAX_LEN);
        Self {
            slots: Vec::new(),
            denied: 0,
            index: Positions::default(),
            hasher: TableHasher::default(),
            overflow: HashMap::default(),
            side_ids: Vec::new(),
            side_denied: 0,
            side_bytes: 0,
            max_side_bytes: usize::MAX,
            moved: HashMap::default(),
            fingerprints: Vec::new(),
            fingerprint_slots: HashMap::default(),
            last_fingerprint: None,
            cap,
            cursor: 0,
            rng: seed | 1,
        }
    }

    /// Bound the bytes of the states kept beside the slots (sliding logs, oversized
    /// schedules) to `bytes`; over it, side states are evicted in least-harm order.
    pub fn with_byte_budget(mut self, bytes: usize) -> Self {
        self.max_side_bytes = bytes;
        self
    }

    /// Bytes held by side states (counted against the byte budget).
    pub fn side_bytes(&self) -> usize {
        self.side_bytes
    }

    /// Number of keys held.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when no key is held.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The key cap.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Decide one check of `counter` at `now`.
    ///
    /// State built under other rule numbers (another fingerprint) is discarded first.
    /// Returns the decision, any keys dropped to make room, and whether the key had no
    /// live state before (a fresh start: a new key, or one whose state had expired).
    pub fn check(
        &mut self,
        counter: Counter<'_>,
        now: Millis,
        cost: NonZeroU64,
    ) -> (Decision, Churn, bool) {
        self.check_owing(counter, now, cost, true)
    }

    /// [`Store::check`] of a fail-over whose forward to the key's owner timed out: the
    /// owner may have charged it, so if the key was handed away its admission is not
    /// owed to the new owner as a late delta (counted twice there otherwise: a key
    /// at 46 answered 49 for one admission).
    pub fn check_in_doubt(
        &mut self,
        counter: Counter<'_>,
        now: Millis,
        cost: NonZeroU64,
    ) -> (Decision, Churn, bool) {
        self.check_owing(counter, now, cost, false)
    }

    fn check_owing(
        &mut self,
        counter: Counter<'_>,
        now: Millis,
        cost: NonZeroU64,
        owed: bool,
    ) -> (Decision, Churn, bool) {
        let Counter {
            id,
            fingerprint,
            limiter,
            local,
        } = counter;
        let fp = self.intern(fingerprint, limiter);
        let hash = self.hasher.hash_one(id);
        if let Some(i) = self.find(hash, id) {
            if self.slots[i].fingerprint_slot() != fp {
                self.put_state(i, limiter.new_state());
                self.slots[i].meta = (self.slots[i].meta & !FP_MASK) | fp;
                if let Some(moved) = self.moved.get_mut(&id) {
                    // Deltas from here on count under the new numbers, as on the new owner.
                    moved.fingerprint = fingerprint;
                    moved.delta = limiter.new_state();
                    moved.dirty = false;
                }
            }
            let (decision, fresh) = self.update(i, |state| {
                let fresh = limiter.expires_at(state) <= now;
                (limiter.check(state, now, cost), fresh)
            });
            if owed && decision.allowed && self.slots[i].has(MOVED) {
                // A late check for a key handed away: remember it for the new owner.
                if let Some(moved) = self.moved.get_mut(&id) {
                    limiter.check(&mut moved.delta, now, cost);
                    moved.dirty = true;
                }
            }
            self.mark(i, standing(&decision));
            // A sliding log grows by an entry per admission: keep the byte budget.
            let churn = self.fit_bytes(now);
            return (decision, churn, fresh);
        }
        let mut state = limiter.new_state();
        let decision = limiter.check(&mut state, now, cost);
        let expires_at = limiter.expires_at(&state);
        if expires_at <= now {
            // The check left no trace (a denial on fresh state): nothing to remember.
            return (decision, Churn::default(), true);
        }
        let mut churn = self.make_room(now);
        let i = self.push(id, hash, fp);
        self.slots[i].set(LOCAL, local);
        self.put_state(i, state);
        self.mark(i, standing(&decision));
        churn += self.fit_bytes(now);
        (decision, churn, true)
    }

    /// Undo an admitted check made at `at` (another descriptor of the request denied).
    /// A key that is gone (expired, evicted, rule changed) has nothing left to refund.
    pub fn refund(&mut self, counter: Counter<'_>, at: Millis, cost: NonZeroU64) {
        self.adjust(counter, |limiter, state| limiter.refund(state, at, cost));
    }

    /// What a check of the counter at `now` would report, changing nothing: see
    /// [`Limiter::peek`]. A key with no state (or state under other numbers) reports
    /// as a fresh one.
    pub fn peek(&mut self, counter: Counter<'_>, now: Millis) -> Decision {
        let state = self
            .live_slot(&counter)
            .map(|i| self.load(i))
            .unwrap_or_else(|| counter.limiter.new_state());
        counter.limiter.peek(&state, now)
    }

    /// What an operator sees of a counter at `now` (`GET /v1/counters`): the numbers a
    /// check would report, changing nothing, or `None` when the key holds no live state
    /// under the counter's numbers (it is as fresh as a new key, so there is nothing to
    /// show or reset).
    pub fn inspect(&mut self, counter: Counter<'_>, now: Millis) -> Option<Decision> {
        let i = self.live_slot(&counter)?;
        if self.expired(i, now) {
            return None;
        }
        Some(counter.limiter.peek(&self.load(i), now))
    }

    /// An operator's reset (`DELETE /v1/counters`): the key's entry is dropped, whatever
    /// numbers it was built under, so its next check starts from the state of a new key
    /// (a full bucket, an empty window, no log). Returns what [`Store::inspect`] saw just
    /// before. A key handed to another node loses its handoff record too: this node no
    /// longer speaks for it.
    pub fn reset(&mut self, counter: Counter<'_>, now: Millis) -> Option<Decision> {
        let before = self.inspect(counter, now);
        if let Some(i) = self.find(self.hasher.hash_one(counter.id), counter.id) {
            self.remove_at(i);
        }
        before
    }

    /// Give `cost` units back to a counter now (a caller's negative hits, or a reset
    /// with `NonZeroU64::MAX`), unlike [`Store::refund`], which undoes one admission
    /// made at a known instant. A key with no state, or state under other numbers, is
    /// already as full as it can be: there is nothing to give back.
    pub fn give_back(&mut self, counter: Counter<'_>, now: Millis, cost: NonZeroU64) {
        self.adjust(counter, |limiter, state| {
            limiter.give_back(state, now, cost)
        });
    }

    /// The position of `counter`'s key if it holds state under the counter's numbers.
    fn live_slot(&mut self, counter: &Counter<'_>) -> Option<usize> {
        let fp = self.intern(counter.fingerprint, counter.limiter);
        self.find(self.hasher.hash_one(counter.id), counter.id)
            .filter(|&i| self.slots[i].fingerprint_slot() == fp)
    }

    /// Apply `change` (a refund or a give-back: state only moves towards fresh) to the
    /// key's state and, for a key handed away, to the delta the new owner will merge.
    fn adjust(&mut self, counter: Counter<'_>, change: impl Fn(&Limiter, &mut KeyState)) {
        let Some(i) = self.live_slot(&counter) else {
            return;
        };
        let limiter = counter.limiter;
        self.update(i, |state| change(limiter, state));
        if let Some(moved) = self.moved.get_mut(&counter.id) {
            change(limiter, &mut moved.delta);
        }
    }

    /// Drop expired entries, examining at most `budget` entries from where the last call
    /// stopped. Returns how many were dropped.
    pub fn expire(&mut self, now: Millis, budget: usize) -> u64 {
        let mut dropped = 0;
        for _ in 0..budget.min(self.slots.len()) {
            if self.cursor >= self.slots.len() {
                self.cursor = 0;
            }
            if self.expired(self.cursor, now) {
                // swap_remove moves the last entry into the cursor slot: examine it next.
                self.remove_at(self.cursor);
                dropped += 1;
            } else {
                self.cursor += 1;
            }
        }
        dropped
    }

    /// Every key with its state, for inspecting it.
    pub fn iter(&self) -> impl Iterator<Item = (KeyId, KeyState)> + '_ {
        (0..self.slots.len()).map(|i| (self.slots[i].id(), self.load(i)))
    }

    /// Hand over every live entry whose ring placement `new_owner` gives to another
    /// node: returns a copy of each state with its new owner, and keeps the entry,
    /// marked moved, so late checks forwarded here by nodes on the old ring continue its
    /// count (see [`Store::drain_deltas`]). Entries already handed over are not shipped
    /// again; expired ones are dropped; node-local (fallback) counters stay.
    pub fn export(
        &mut self,
        now: Millis,
        mut new_owner: impl FnMut(u64) -> Option<Recipient>,
    ) -> Vec<(Arc<str>, Exported)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.slots.len() {
            let slot = self.slots[i];
            if slot.has(LOCAL) {
                i += 1;
                continue;
            }
            let id = slot.id();
            let Some(to) = new_owner(id.placement) else {
                i += 1;
                continue;
            };
            if self.expired(i, now) {
                self.remove_at(i);
                continue;
            }
            if !slot.has(MOVED) {
                out.push(self.hand_over_at(i, to));
            }
            i += 1;
        }
        self.cursor = 0;
        out
    }

    /// Mark the live entry at `i` handed over to `to` and return a copy of its state.
    fn hand_over_at(&mut self, i: usize, to: Recipient) -> (Arc<str>, Exported) {
        let slot = self.slots[i];
        let (id, state) = (slot.id(), self.load(i));
        let fingerprint = self.fingerprints[slot.fingerprint_slot() as usize].0;
        self.moved.insert(
            id,
            Moved {
                to: to.id.clone(),
                generation: to.generation,
                fingerprint,
                delta: KeyState::empty_like(&state),
                dirty: false,
            },
        );
        self.slots[i].set(MOVED, true);
        (
            to.id,
            Exported {
                id,
                fingerprint,
                state,
            },
        )
    }

    /// Admissions made on handed-over keys since the last call, per new owner: to be
    /// pushed and merged there. Only those whose new owner (id, generation) is
    /// `reachable`: the others stay for a later call (a member handed its keys while
    /// it restores, before this node's view holds it).
    pub fn drain_deltas(
        &mut self,
        reachable: impl Fn(&str, u64) -> bool,
    ) -> Vec<(Arc<str>, Exported)> {
        let mut out = Vec::new();
        for (&id, moved) in self
            .moved
            .iter_mut()
            .filter(|(_, m)| m.dirty && reachable(&m.to, m.generation))
        {
            let fresh = KeyState::empty_like(&moved.delta);
            let delta = std::mem::replace(&mut moved.delta, fresh);
            moved.dirty = false;
            out.push((
                moved.to.clone(),
                Exported {
                    id,
                    fingerprint: moved.fingerprint,
                    state: delta,
                },
            ));
        }
        out
    }

    /// Install state handed over by a previous owner. If this store already holds the
    /// key (it decided for it during the gossip window), the two states are merged so
    /// the admissions recorded on both nodes count. Returns whether anything was taken.
    pub fn install(&mut self, item: Exported, limiter: &Limiter, now: Millis) -> bool {
        self.install_as(item, limiter, now, false)
    }

    /// [`Store::install`] of a state its sender started from this node's own replica
    /// of the key (it promoted the replica while its view did not hold this node, and
    /// hands the key back now that it does): the state already includes what this
    /// node had admitted when it sent the replica, so a held key is joined with it
    /// (the stricter of the two), never added to. Adding counted this node's own
    /// admissions twice (a count of 3 became 7 on a handback of 4, and the owner
    /// denied at 7 of 10).
    pub fn install_joined(&mut self, item: Exported, limiter: &Limiter, now: Millis) -> bool {
        self.install_as(item, limiter, now, true)
    }

    fn install_as(&mut self, item: Exported, limiter: &Limiter, now: Millis, join: bool) -> bool {
        if !limiter.accepts(&item.state) {
            return false;
        }
        let fp = self.intern(item.fingerprint, limiter);
        let hash = self.hasher.hash_one(item.id);
        if let Some(i) = self.find(hash, item.id) {
            if self.slots[i].fingerprint_slot() != fp {
                return false;
            }
            let standing = if join || self.slots[i].has(MOVED) {
                // The key comes back after this node handed it away. The sender's state
                // includes everything this node pushed if it took the handoff in first,
                // so adding the two would count that twice; but when the two nodes
                // handed the key to each other at once (a ring that flapped on a heal),
                // the sender's state does not include ours, and replacing ours with it
                // would forget what this node admitted (a count went from 10 back to
                // 5, which the chaos suite's S1-fw flagged). The join keeps the
                // stricter of the two, which is the sender's in the first case. A state
                // built on this node's replica (`install_joined`) is joined likewise.
                self.slots[i].set(MOVED, false);
                self.moved.remove(&item.id);
                self.update(i, |state| {
                    limiter.join(state, item.state);
                    probe_standing(limiter, state, now)
                })
            } else {
                self.update(i, |state| {
                    limiter.merge(state, item.state);
                    probe_standing(limiter, state, now)
                })
            };
            self.mark(i, standing);
            self.fit_bytes(now);
            return true;
        }
        let expires_at = limiter.expires_at(&item.state);
        if expires_at <= now {
            return false;
        }
        let standing = probe_standing(limiter, &item.state, now);
        self.make_room(now);
        let i = self.push(item.id, hash, fp);
        self.put_state(i, item.state);
        self.mark(i, standing);
        self.fit_bytes(now);
        true
    }

    /// The position of `id`, whose table hash is `hash`.
    fn find(&self, hash: u64, id: KeyId) -> Option<usize> {
        self.index
            .find(hash, |i| self.slots[i as usize].id() == id)
            .map(|i| i as usize)
    }

    /// Append a slot (state to be put by the caller) and index it.
    fn push(&mut self, id: KeyId, hash: u64, fp: u32) -> usize {
        let i = self.slots.len();
        self.slots.push(Slot::new(id, fp));
        let Self {
            index,
            slots,
            hasher,
            ..
        } = self;
        index.insert(hash, i as u32, |j| hasher.hash_one(slots[j as usize].id()));
        i
    }

    /// Record where the last decision left the key at `i`: its harm bucket, and its
    /// `DENIED` bit, moving it across the partition if the bit changes. Returns the
    /// key's position afterwards.
    fn mark(&mut self, i: usize, (denied, harm): (bool, u32)) -> usize {
        let slot = &mut self.slots[i];
        slot.meta = (slot.meta & !(HARM_MASK << HARM_SHIFT)) | (harm << HARM_SHIFT);
        if slot.has(DENIED) == denied {
            return i;
        }
        slot.set(DENIED, denied);
        if slot.has(OVERFLOW) {
            let id = slot.id();
            self.side_set_denied(id, denied);
        }
        let to = if denied {
            // First non-denied slot: becomes the last denied one.
            self.denied += 1;
            self.denied - 1
        } else {
            // Last denied slot: becomes the first non-denied one.
            self.denied -= 1;
            self.denied
        };
        self.swap_slots(i, to);
        to
    }

    /// Exchange the slots at `a` and `b`, and their positions in the table.
    fn swap_slots(&mut self, a: usize, b: usize) {
        if a == b {
            return;
        }
        // Both buckets are located before either is rewritten: positions stay unique.
        let bucket = |store: &Self, i: usize| {
            let hash = store.hasher.hash_one(store.slots[i].id());
            store.index.bucket_of(hash, i as u32)
        };
        let (bucket_a, bucket_b) = (bucket(self, a), bucket(self, b));
        if let (Some(bucket_a), Some(bucket_b)) = (bucket_a, bucket_b) {
            self.index.set_pos(bucket_a, b as u32);
            self.index.set_pos(bucket_b, a as u32);
        }
        self.slots.swap(a, b);
    }

    /// Remove the slot at `i`; the last slot takes its position (a denied slot is first
    /// swapped to the end of the denied part, so the partition holds).
    fn remove_at(&mut self, mut i: usize) {
        if i < self.denied {
            self.denied -= 1;
            self.swap_slots(i, self.denied);
            i = self.denied;
        }
        let slot = self.slots[i];
        let Self {
            index,
            slots,
            hasher,
            ..
        } = self;
        index.remove(hasher.hash_one(slot.id()), i as u32, |j| {
            hasher.hash_one(slots[j as usize].id())
        });
        let last = self.slots.len() - 1;
        if i != last {
            let moving = self.slots[last].id();
            if let Some(bucket) = self
                .index
                .bucket_of(self.hasher.hash_one(moving), last as u32)
            {
                self.index.set_pos(bucket, i as u32);
            }
        }
        self.slots.swap_remove(i);
        if slot.has(OVERFLOW) {
            self.side_remove(slot.id());
        }
        if slot.has(MOVED) {
            self.moved.remove(&slot.id());
        }
    }

    /// A copy of the state at `i`.
    fn load(&self, i: usize) -> KeyState {
        let slot = &self.slots[i];
        if slot.has(OVERFLOW) {
            if let Some(side) = self.overflow.get(&slot.id()) {
                return side.state.clone();
            }
        }
        KeyState::from_pair(slot.kind(), slot.words())
            .expect("only packable kinds are stored packed")
    }

    /// Run `f` on the state at `i` and store the result back (packed if it fits).
    fn update<R>(&mut self, i: usize, f: impl FnOnce(&mut KeyState) -> R) -> R {
        let slot = self.slots[i];
        if slot.has(OVERFLOW) {
            if let Some(side) = self.overflow.get_mut(&slot.id()) {
                // Stays on the side even if it would fit again: rare, and simpler.
                let before = side_cost(&side.state);
                let result = f(&mut side.state);
                self.side_bytes = self.side_bytes - before + side_cost(&side.state);
                return result;
            }
        }
        let mut state = KeyState::from_pair(slot.kind(), slot.words())
            .expect("only packable kinds are stored packed");
        let result = f(&mut state);
        // The usual case: the same kind, still packable. Only the words change.
        if let (Some(pair), true) = (state.to_pair(), state.kind() == slot.kind()) {
            self.slots[i].words = split(pair);
            return result;
        }
        self.put_state(i, state);
        result
    }

    /// Store `state` at `i`: packed into the slot, or on the side.
    fn put_state(&mut self, i: usize, state: KeyState) {
        let slot = &mut self.slots[i];
        slot.meta = (slot.meta & !(KIND_MASK << KIND_SHIFT))
            | ((state.kind().index() as u32) << KIND_SHIFT);
        match state.to_pair() {
            Some(pair) => {
                slot.words = split(pair);
                if slot.has(OVERFLOW) {
                    slot.set(OVERFLOW, false);
                    let id = slot.id();
                    self.side_remove(id);
                }
            }
            None => {
                slot.words = [0; 4];
                slot.set(OVERFLOW, true);
                let (id, denied) = (slot.id(), slot.has(DENIED));
                self.side_insert(id, state, denied);
            }
        }
    }

    /// The slot number of `fingerprint`, interning it with its limiter on first sight.
    /// A fingerprint hashes the rule's numbers, so it names one limiter.
    fn intern(&mut self, fingerprint: u64, limiter: &Limiter) -> u32 {
        if let Some((fp, slot)) = self.last_fingerprint {
            if fp == fingerprint {
                return slot;
            }
        }
        let slot = match self.fingerprint_slots.get(&fingerprint) {
            Some(&slot) => slot,
            None => {
                if self.fingerprints.len() > FP_MASK as usize {
                    // A million distinct rule versions in one process: start over rather
                    // than confuse two of them (every key restarts its count, once).
                    tracing::warn!("fingerprint table full: dropping every key of this shard");
                    self.clear();
                }
                let slot = self.fingerprints.len() as u32;
                self.fingerprints.push((fingerprint, limiter.clone()));
                self.fingerprint_slots.insert(fingerprint, slot);
                slot
            }
        };
        debug_assert_eq!(
            &self.fingerprints[slot as usize].1, limiter,
            "one fingerprint, one limiter"
        );
        self.last_fingerprint = Some((fingerprint, slot));
        slot
    }

    /// When the state at `i` becomes equivalent to a fresh one (safe to drop): derived
    /// from the state and its rule's limiter rather than kept in the slot, which saves
    /// 4 of its 40 bytes at the price of a few nanoseconds per entry the expiry walk
    /// and an eviction sample examine.
    fn expires_at(&self, i: usize) -> Millis {
        let slot = &self.slots[i];
        let limiter = &self.fingerprints[slot.fingerprint_slot() as usize].1;
        if slot.has(OVERFLOW) {
            if let Some(side) = self.overflow.get(&slot.id()) {
                return limiter.expires_at(&side.state);
            }
        }
        KeyState::from_pair(slot.kind(), slot.words()).map_or(0, |state| limiter.expires_at(&state))
    }

    fn expired(&self, i: usize, now: Millis) -> bool {
        self.expires_at(i) <= now
    }

    /// Eviction order among candidates of one part: lowest first. Expired entries cost
    /// nothing; then fewest units consumed; then soonest back to fresh.
    fn eviction_rank(&self, i: usize, now: Millis) -> (bool, u32, Millis) {
        let expires_at = self.expires_at(i);
        let expired = expires_at <= now;
        let harm = if expired { 0 } else { self.slots[i].harm() };
        (!expired, harm, expires_at)
    }

    fn clear(&mut self) {
        self.slots.clear();
        self.denied = 0;
        self.index.clear();
        self.overflow.clear();
        self.side_ids.clear();
        self.side_denied = 0;
        self.side_bytes = 0;
        self.moved.clear();
        self.fingerprints.clear();
        self.fingerprint_slots.clear();
        self.last_fingerprint = None;
        self.cursor = 0;
    }

    /// Free one slot if the store is full: sample the non-denied part (the denied one
    /// only if every key is denied) and drop the least-harm candidate (see the module
    /// docs). O([`EVICTION_SAMPLES`]) whatever the store holds.
    fn make_room(&mut self, now: Millis) -> Churn {
        if self.slots.len() < self.cap || self.slots.is_empty() {
            return Churn::default();
        }
        let (from, to) = if self.denied < self.slots.len() {
            (self.denied, self.slots.len())
        } else {
            (0, self.denied)
        };
        let span = (to - from) as u64;
        let mut victim: Option<(usize, (bool, u32, Millis))> = None;
        for _ in 0..EVICTION_SAMPLES {
            let index = from + (self.next_random() % span) as usize;
            let rank = self.eviction_rank(index, now);
            if victim.is_none_or(|(_, best)| rank < best) {
                victim = Some((index, rank));
            }
        }
        let Some((victim, _)) = victim else {
            return Churn::default();
        };
        self.evict_at(victim, now)
    }

    /// Drop the key at `i` to make room, and say what kind of loss it was.
    fn evict_at(&mut self, i: usize, now: Millis) -> Churn {
        let (slot, expired) = (self.slots[i], self.expired(i, now));
        self.remove_at(i);
        if expired {
            Churn {
                expired: 1,
                ..Churn::default()
            }
        } else if slot.has(DENIED) {
            Churn {
                evicted_denied: 1,
                ..Churn::default()
            }
        } else {
            Churn {
                evicted: 1,
                ..Churn::default()
            }
        }
    }

    /// Evict side states while their bytes exceed the budget (see [`Store::evict_side`]).
    /// Runs after every check, so the usual case (within budget) is one comparison.
    #[inline]
    fn fit_bytes(&mut self, now: Millis) -> Churn {
        if self.side_bytes <= self.max_side_bytes {
            return Churn::default();
        }
        self.evict_side(now)
    }

    /// Evict side states while their bytes exceed the budget, in the key cap's order
    /// (see *Byte budget*): sample the non-denied side keys (the denied ones only when
    /// every side key is denied) and drop the least-harm candidate.
    #[inline(never)]
    fn evict_side(&mut self, now: Millis) -> Churn {
        let mut churn = Churn::default();
        while self.side_bytes > self.max_side_bytes && !self.side_ids.is_empty() {
            let (from, to) = if self.side_denied < self.side_ids.len() {
                (self.side_denied, self.side_ids.len())
            } else {
                (0, self.side_denied)
            };
            let span = (to - from) as u64;
            let mut victim: Option<(usize, (bool, u32, Millis))> = None;
            for _ in 0..EVICTION_SAMPLES {
                let pick = from + (self.next_random() % span) as usize;
                let id = self.side_ids[pick];
                let Some(i) = self.find(self.hasher.hash_one(id), id) else {
                    continue;
                };
                let rank = self.eviction_rank(i, now);
                if victim.is_none_or(|(_, best)| rank < best) {
                    victim = Some((i, rank));
                }
            }
            let Some((i, _)) = victim else { break };
            churn += self.evict_at(i, now);
        }
        churn
    }

    /// Put `state` on the side for `id` (replacing what it had there).
    fn side_insert(&mut self, id: KeyId, state: KeyState, denied: bool) {
        let cost = side_cost(&state);
        if let Some(side) = self.overflow.get_mut(&id) {
            self.side_bytes = self.side_bytes - side_cost(&side.state) + cost;
            side.state = state;
            return;
        }
        self.side_bytes += cost;
        let at = self.side_ids.len() as u32;
        self.side_ids.push(id);
        self.overflow.insert(
            id,
            Side {
                state,
                at,
                denied: false,
            },
        );
        self.side_set_denied(id, denied);
    }

    /// Drop the side state of `id`, keeping `side_ids` dense and partitioned.
    fn side_remove(&mut self, id: KeyId) {
        self.side_set_denied(id, false);
        let Some(side) = self.overflow.remove(&id) else {
            return;
        };
        self.side_bytes -= side_cost(&side.state);
        let at = side.at as usize;
        self.side_ids.swap_remove(at);
        if let Some(&moving) = self.side_ids.get(at) {
            if let Some(other) = self.overflow.get_mut(&moving) {
                other.at = at as u32;
            }
        }
    }

    /// Move the side key `id` across the denied boundary of `side_ids` if its flag
    /// changes (one swap, as for slots).
    fn side_set_denied(&mut self, id: KeyId, denied: bool) {
        let Some(side) = self.overflow.get(&id) else {
            return;
        };
        if side.denied == denied {
            return;
        }
        let at = side.at as usize;
        let to = if denied {
            self.side_denied += 1;
            self.side_denied - 1
        } else {
            self.side_denied -= 1;
            self.side_denied
        };
        let other = self.side_ids[to];
        self.side_ids.swap(at, to);
        if let Some(o) = self.overflow.get_mut(&other) {
            o.at = at as u32;
        }
        if let Some(side) = self.overflow.get_mut(&id) {
            side.at = to as u32;
            side.denied = denied;
        }
    }

    /// xorshift64: cheap, deterministic per seed; eviction needs spread, not secrecy.
    fn next_random(&mut self) -> u64 {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }
}

#[cfg(test)]
impl Store {
    /// The invariants eviction relies on: the table finds every slot at its position,
    /// and the denied slots are exactly the first `denied`.
    fn assert_consistent(&self) {
        assert_eq!(self.index.len(), self.slots.len());
        self.index
            .assert_consistent(|j| self.hasher.hash_one(self.slots[j as usize].id()));
        assert!(self.denied <= self.slots.len());
        for (i, slot) in self.slots.iter().enumerate() {
            assert_eq!(
                self.find(self.hasher.hash_one(slot.id()), slot.id()),
                Some(i)
            );
            assert_eq!(slot.has(DENIED), i < self.denied, "partition at {i}");
            if slot.has(OVERFLOW) {
                let side = &self.overflow[&slot.id()];
                assert_eq!(self.side_ids[side.at as usize], slot.id());
                assert_eq!(side.denied, slot.has(DENIED));
                assert_eq!((side.at as usize) < self.side_denied, side.denied);
            }
        }
        assert_eq!(self.side_ids.len(), self.overflow.len());
        let bytes: usize = self.overflow.values().map(|s| side_cost(&s.state)).sum();
        assert_eq!(self.side_bytes, bytes);
    }

    fn is_flagged_denied(&self, id: KeyId) -> bool {
        self.find(self.hasher.hash_one(id), id)
            .is_some_and(|i| self.slots[i].has(DENIED))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::Ring;
    use std::time::Duration;

    use crate::algorithms::{FixedWindow, Gcra, SlidingCounter, SlidingLog, TokenBucket};
    use proptest::prelude::*;

    fn c<'a>(
        rule: &'a str,
        fingerprint: u64,
        limiter: &'a Limiter,
        client: &'a [u8],
        route: &'a str,
    ) -> Counter<'a> {
        Counter {
            id: KeyId::of(rule, client, route),
            fingerprint,
            limiter,
            local: false,
        }
    }

    fn nz(n: u64) -> NonZeroU64 {
        NonZeroU64::new(n).unwrap()
    }

    fn fixed(limit: u64, window_ms: u64) -> Limiter {
        Limiter::FixedWindow(FixedWindow::new(nz(limit), Duration::from_millis(window_ms)).unwrap())
    }

    /// Every algorithm, with numbers that keep some states packed and push others
    /// to the side map (the log always; the counter past `u32` counts).
    fn model_limiters() -> Vec<(&'static str, Limiter)> {
        let w = Duration::from_secs(10);
        vec![
            (
                "tb",
                Limiter::TokenBucket(TokenBucket::new(nz(3), nz(3), w).unwrap()),
            ),
            (
                "gcra",
                Limiter::LeakyBucket(Gcra::meter(nz(3), w, nz(2)).unwrap()),
            ),
            ("fw", fixed(3, 10_000)),
            (
                "log",
                Limiter::SlidingWindowLog(SlidingLog::new(nz(3), w).unwrap()),
            ),
            (
                "swc",
                Limiter::SlidingWindowCounter(SlidingCounter::new(nz(3), w).unwrap()),
            ),
            (
                "swc-big",
                Limiter::SlidingWindowCounter(SlidingCounter::new(nz(u64::MAX / 4), w).unwrap()),
            ),
        ]
    }

    proptest! {
        /// The packed store decides exactly like one `KeyState` per key in a plain map,
        /// through inserts, swap-removing expiry, side-map states and refunds.
        #[test]
        fn store_decides_like_a_map_of_states(
            ops in proptest::collection::vec(
                (0usize..6, 0u8..5, 0u64..3_000, 1u64..3, any::<bool>(), 0u8..4),
                1..200,
            ),
        ) {
            let limiters = model_limiters();
            let mut store = Store::new(10_000, 1);
            let mut model: HashMap<(usize, u8), KeyState> = HashMap::new();
            let mut now = 1_767_225_600_000u64;
            for (rule, client, step, cost, refund, expire) in ops {
                now += step;
                let (name, limiter) = &limiters[rule];
                let cost = if *name == "swc-big" { nz(cost << 31) } else { nz(cost) };
                let key = [client];
                let counter = c(name, rule as u64, limiter, &key, "/m");
                let (got, _, _) = store.check(counter, now, cost);
                let state = model.entry((rule, client)).or_insert_with(|| limiter.new_state());
                let want = limiter.check(state, now, cost);
                prop_assert_eq!(got, want);
                if refund && got.allowed {
                    store.refund(counter, now, cost);
                    limiter.refund(state, now, cost);
                }
                if expire == 0 {
                    // A pass that drops nothing has examined every entry.
                    while store.expire(now, 1_000) > 0 {}
                    for (id, _) in store.iter() {
                        prop_assert!(model.keys().any(|&(r, k)| KeyId::of(limiters[r].0, &[k], "/m") == id));
                    }
                    prop_assert!((0..store.len()).all(|i| !store.expired(i, now)));
                }
            }
            prop_assert_eq!(store.index.len(), store.slots.len());
            let overflowed = store.slots.iter().filter(|slot| slot.has(OVERFLOW)).count();
            prop_assert_eq!(overflowed, store.overflow.len());
            store.assert_consistent();
        }

        /// With a byte budget, every operation leaves the side bytes within it and the
        /// bookkeeping (dense, partitioned side ids, byte sum) consistent.
        #[test]
        fn a_byte_budget_holds_through_any_sequence(
            budget in 0usize..4_000,
            ops in proptest::collection::vec((0usize..6, 0u8..8, 0u64..3_000, 1u64..3, any::<bool>()), 1..200),
        ) {
            let limiters = model_limiters();
            let mut store = Store::new(10_000, 1).with_byte_budget(budget);
            let mut now = 1_767_225_600_000u64;
            for (rule, client, step, cost, refund) in ops {
                now += step;
                let (name, limiter) = &limiters[rule];
                let cost = if *name == "swc-big" { nz(cost << 31) } else { nz(cost) };
                let key = [client];
                let counter = c(name, rule as u64, limiter, &key, "/m");
                let (got, _, _) = store.check(counter, now, cost);
                if refund && got.allowed {
                    store.refund(counter, now, cost);
                }
                store.expire(now, 3);
                prop_assert!(store.side_bytes() <= budget);
                store.assert_consistent();
            }
        }

        /// At the cap, a key that is denied now is evicted only when every key of the
        /// store was flagged denied; and the flag never misses a key that is denied now
        /// (a check of cost 1 on a copy of its state would be denied).
        #[test]
        fn eviction_never_removes_a_denied_key_while_another_could_go(
            cap in 2usize..12,
            ops in proptest::collection::vec(
                (0usize..6, 0u8..40, 0u64..2_500, 1u64..4, any::<bool>()),
                1..300,
            ),
        ) {
            let limiters = model_limiters();
            let mut store = Store::new(cap, 5);
            let mut rule_of: HashMap<KeyId, usize> = HashMap::new();
            let mut now = 1_767_225_600_000u64;
            let denied_now = |store: &Store, id: KeyId, rule: usize, now: Millis| {
                let (_, state) = store.iter().find(|(k, _)| *k == id).unwrap();
                let mut copy = state.clone();
                !limiters[rule].1.check(&mut copy, now, nz(1)).allowed
            };
            for (rule, client, step, cost, refund) in ops {
                now += step;
                let (name, limiter) = &limiters[rule];
                let cost = if *name == "swc-big" { nz(cost << 31) } else { nz(cost) };
                let key = [client];
                let counter = c(name, rule as u64, limiter, &key, "/m");
                rule_of.insert(counter.id, rule);
                let before: Vec<(KeyId, bool, bool)> = store
                    .iter()
                    .map(|(id, _)| {
                        let denied = denied_now(&store, id, rule_of[&id], now);
                        (id, denied, store.is_flagged_denied(id))
                    })
                    .collect();
                let (decision, churn, _) = store.check(counter, now, cost);
                if refund && decision.allowed {
                    store.refund(counter, now, cost);
                }
                store.assert_consistent();
                let after: Vec<KeyId> = store.iter().map(|(id, _)| id).collect();
                let all_flagged = before.iter().all(|&(_, _, flagged)| flagged);
                for &(id, denied, _) in &before {
                    if denied && !after.contains(&id) {
                        prop_assert!(all_flagged, "evicted a denied key while others could go");
                        prop_assert_eq!(churn.evicted_denied, 1);
                    }
                }
                if !all_flagged {
                    prop_assert_eq!(churn.evicted_denied, 0);
                }
                for (id, _) in store.iter() {
                    if denied_now(&store, id, rule_of[&id], now) {
                        prop_assert!(store.is_flagged_denied(id), "a denied key without its flag");
                    }
                }
            }
        }
    }

    #[test]
    fn a_flood_of_fresh_keys_never_evicts_an_exhausted_one() {
        let mut store = Store::new(100, 9);
        let limiter = fixed(3, 60_000);
        let exhausted: Vec<[u8; 1]> = (0..5u8).map(|i| [i]).collect();
        let now = 1_767_225_600_000;
        for key in &exhausted {
            for _ in 0..3 {
                store.check(c("r", 1, &limiter, key, "/x"), now, nz(1));
            }
        }
        // Some legitimate keys half-way to their limit fill the rest of the store.
        for i in 0..95u32 {
            for _ in 0..2 {
                store.check(c("r", 1, &limiter, &i.to_be_bytes(), "/legit"), now, nz(1));
            }
        }
        assert_eq!(store.len(), 100);
        let mut churn = Churn::default();
        for i in 0..10_000u32 {
            churn += store
                .check(
                    c("r", 1, &limiter, &i.to_le_bytes(), "/flood"),
                    now + 1,
                    nz(1),
                )
                .1;
        }
        assert_eq!(churn.evicted, 10_000, "one live eviction per flooded key");
        assert_eq!(churn.evicted_denied, 0);
        store.assert_consistent();
        for key in &exhausted {
            let (decision, _, _) = store.check(c("r", 1, &limiter, key, "/x"), now + 2, nz(1));
            assert!(
                !decision.allowed,
                "an exhausted key is still denied after the flood"
            );
        }
    }

    #[test]
    fn a_flood_of_sliding_logs_stays_in_the_byte_budget_and_never_frees_an_exhausted_log() {
        // The attack: sliding logs grow ~16 bytes per admitted unit, so a key
        // cap alone does not bound memory. An exhausted log holds ~16 kB here; the flood
        // of single-hit logs must evict its own keys, not it.
        let budget = 64 * 1024;
        let mut store = Store::new(1_000_000, 7).with_byte_budget(budget);
        let big =
            Limiter::SlidingWindowLog(SlidingLog::new(nz(1_000), Duration::from_secs(60)).unwrap());
        let victim = c("log", 1, &big, b"victim", "/x");
        for _ in 0..1_000 {
            assert!(store.check(victim, 0, nz(1)).0.allowed);
        }
        assert!(!store.check(victim, 1, nz(1)).0.allowed, "exhausted");
        let mut churn = Churn::default();
        for i in 0..20_000u32 {
            let (_, c, _) = store.check(c("log", 1, &big, &i.to_le_bytes(), "/flood"), 2, nz(1));
            churn += c;
            assert!(
                store.side_bytes() <= budget,
                "over budget after {i} flood keys"
            );
        }
        assert!(
            churn.evicted > 10_000,
            "the flood evicted its own keys: {churn:?}"
        );
        assert_eq!(churn.evicted_denied, 0);
        assert!(
            !store.check(victim, 3, nz(1)).0.allowed,
            "still exhausted after the flood"
        );
        store.assert_consistent();
    }

    #[test]
    fn over_the_byte_budget_a_denied_log_goes_only_when_every_side_key_is_denied() {
        let full = |log: &Limiter, n: u64| {
            let mut s = log.new_state();
            for _ in 0..n {
                log.check(&mut s, 0, nz(1));
            }
            side_cost(&s)
        };
        let w = Duration::from_secs(60);
        // Limit 4: two exhausted logs, then a third key over the budget. The third is
        // the only one with budget left, so it is the one that goes, every time.
        let log = Limiter::SlidingWindowLog(SlidingLog::new(nz(4), w).unwrap());
        let budget = 2 * full(&log, 4) + full(&log, 4) / 2;
        let mut store = Store::new(100, 3).with_byte_budget(budget);
        for key in [b"a", b"b"] {
            for _ in 0..4 {
                store.check(c("log", 1, &log, key, "/x"), 0, nz(1));
            }
        }
        let (_, churn, _) = store.check(c("log", 1, &log, b"c", "/x"), 0, nz(1));
        assert_eq!((churn.evicted, churn.evicted_denied), (1, 0), "{churn:?}");
        for key in [b"a", b"b"] {
            assert!(
                !store
                    .check(c("log", 1, &log, key, "/x"), 1, nz(1))
                    .0
                    .allowed
            );
        }
        store.assert_consistent();
        // Limit 1: every log is exhausted by its first check, so one denied log must go,
        // counted apart.
        let log = Limiter::SlidingWindowLog(SlidingLog::new(nz(1), w).unwrap());
        let budget = 2 * full(&log, 1) + full(&log, 1) / 2;
        let mut store = Store::new(100, 3).with_byte_budget(budget);
        let mut churn = Churn::default();
        for key in [b"a", b"b", b"c"] {
            churn += store.check(c("log", 1, &log, key, "/x"), 0, nz(1)).1;
        }
        assert_eq!((churn.evicted, churn.evicted_denied), (0, 1), "{churn:?}");
        assert!(store.side_bytes() <= budget);
        store.assert_consistent();
    }

    #[test]
    fn eviction_takes_a_denied_key_only_when_every_key_is_denied_and_counts_it_apart() {
        let mut store = Store::new(3, 1);
        let limiter = fixed(1, 60_000);
        for key in [b"a", b"b", b"c"] {
            store.check(c("r", 1, &limiter, key, "/x"), 0, nz(1));
        }
        assert_eq!(store.denied, 3, "a limit of 1 is exhausted by one check");
        let (_, churn, _) = store.check(c("r", 1, &limiter, b"d", "/x"), 1, nz(1));
        assert_eq!(
            churn,
            Churn {
                expired: 0,
                evicted: 0,
                evicted_denied: 1,
                evicted_replicas: 0,
            }
        );
        store.assert_consistent();
    }

    #[test]
    fn eviction_prefers_the_key_that_consumed_the_least() {
        let mut store = Store::new(2, 3);
        let limiter = fixed(100, 60_000);
        for _ in 0..40 {
            store.check(c("r", 1, &limiter, b"busy", "/x"), 0, nz(1));
        }
        store.check(c("r", 1, &limiter, b"once", "/x"), 0, nz(1));
        store.check(c("r", 1, &limiter, b"new", "/x"), 10, nz(1));
        let kept: Vec<KeyId> = store.iter().map(|(id, _)| id).collect();
        assert!(
            kept.contains(&KeyId::of("r", b"busy", "/x")),
            "40 of 100 spent: kept"
        );
        assert!(!kept.contains(&KeyId::of("r", b"once", "/x")));
    }

    #[test]
    fn a_key_leaves_the_denied_part_when_admitted_again() {
        let mut store = Store::new(10, 1);
        let limiter = fixed(2, 1_000);
        for _ in 0..3 {
            store.check(c("r", 1, &limiter, b"a", "/x"), 0, nz(1));
        }
        store.check(c("r", 1, &limiter, b"b", "/x"), 0, nz(1));
        assert!(store.is_flagged_denied(KeyId::of("r", b"a", "/x")));
        assert_eq!(store.denied, 1);
        store.check(c("r", 1, &limiter, b"a", "/x"), 1_000, nz(1));
        assert!(!store.is_flagged_denied(KeyId::of("r", b"a", "/x")));
        assert_eq!(store.denied, 0);
        store.assert_consistent();
    }

    #[test]
    fn a_key_costs_one_36_byte_slot_plus_at_most_6_bytes_of_table() {
        let mut store = Store::new(50_000, 1);
        let limiter = fixed(5, 60_000);
        for i in 0..50_000u32 {
            store.check(c("r", 1, &limiter, &i.to_le_bytes(), "/x"), 0, nz(1));
        }
        assert_eq!(std::mem::size_of::<Slot>(), 36);
        assert!(store.overflow.is_empty() && store.moved.is_empty());
        // The table's buckets are all written (a well-spread hash touches every page);
        // the slot vector's spare capacity is reserved address space until used.
        let table = store.index.heap_bytes() as f64 / 50_000.0;
        assert!(table <= 6.25, "{table} table bytes per key");
        let reserved = store.slots.capacity() * 36 + store.index.heap_bytes();
        assert!(
            reserved / 50_000 < 64,
            "{} bytes per key",
            reserved / 50_000
        );
    }

    #[test]
    fn counts_accumulate_per_key_and_stay_separate_across_keys() {
        let mut store = Store::new(100, 1);
        let limiter = fixed(2, 60_000);
        let check = |s: &mut Store, client: &[u8]| {
            s.check(c("r", 1, &limiter, client, "/x"), 1_000, nz(1))
                .0
                .allowed
        };
        assert!(check(&mut store, b"a"));
        assert!(check(&mut store, b"a"));
        assert!(
            !check(&mut store, b"a"),
            "third check for a is over the limit of 2"
        );
        assert!(check(&mut store, b"b"), "b has its own counter");
        assert_eq!(store.len(), 2);
    }

    #[test]
    fn changed_rule_numbers_restart_the_key_but_unchanged_keep_it() {
        let mut store = Store::new(100, 1);
        let limiter = fixed(1, 60_000);
        assert!(
            store
                .check(c("r", 1, &limiter, b"a", "/x"), 0, nz(1))
                .0
                .allowed
        );
        assert!(
            !store
                .check(c("r", 1, &limiter, b"a", "/x"), 1, nz(1))
                .0
                .allowed
        );
        assert!(
            store
                .check(c("r", 2, &limiter, b"a", "/x"), 2, nz(1))
                .0
                .allowed,
            "a new fingerprint means new numbers: state starts over"
        );
    }

    #[test]
    fn expiry_drops_only_entries_whose_state_is_back_to_fresh() {
        let mut store = Store::new(100, 1);
        let short = fixed(5, 1_000);
        let long = fixed(5, 60_000);
        store.check(c("short", 1, &short, b"a", "/x"), 500, nz(1));
        store.check(c("long", 2, &long, b"a", "/x"), 500, nz(1));
        assert_eq!(store.expire(999, 10), 0, "window [0,1000) still open");
        assert_eq!(store.expire(1_000, 10), 1, "the 1 s window closed at 1000");
        assert_eq!(store.len(), 1);
        assert_eq!(store.expire(60_000, 10), 1);
        assert!(store.is_empty());
    }

    #[test]
    fn expiry_walks_a_bounded_number_of_entries_per_call() {
        let mut store = Store::new(10_000, 1);
        let limiter = fixed(5, 1_000);
        for i in 0..1_000u32 {
            store.check(c("r", 1, &limiter, &i.to_le_bytes(), "/x"), 0, nz(1));
        }
        assert_eq!(store.expire(5_000, 100), 100);
        assert_eq!(store.len(), 900);
        let mut calls = 1;
        while store.expire(5_000, 100) > 0 {
            calls += 1;
        }
        assert_eq!(calls, 10, "1000 entries at 100 per call");
        assert!(store.is_empty());
    }

    #[test]
    fn a_denial_on_fresh_state_stores_nothing() {
        let mut store = Store::new(10, 1);
        let limiter = fixed(1, 1_000);
        let (decision, _, _) = store.check(c("r", 1, &limiter, b"a", "/x"), 0, nz(2));
        assert!(!decision.allowed);
        assert!(store.is_empty());
    }

    #[test]
    fn a_full_store_evicts_and_counts_every_eviction() {
        let mut store = Store::new(50, 7);
        let limiter = fixed(5, 60_000);
        let mut churn = Churn::default();
        for i in 0..200u32 {
            churn += store
                .check(c("r", 1, &limiter, &i.to_le_bytes(), "/x"), 0, nz(1))
                .1;
            assert!(store.len() <= 50, "cap holds after every insert");
        }
        assert_eq!(
            churn.evicted, 150,
            "every key past the cap evicted one live key"
        );
        assert_eq!(churn.expired, 0);
    }

    #[test]
    fn eviction_prefers_the_entry_that_expires_soonest() {
        let mut store = Store::new(2, 3);
        let soon = fixed(5, 1_000);
        let late = fixed(5, 3_600_000);
        store.check(c("late", 1, &late, b"a", "/x"), 0, nz(1));
        store.check(c("soon", 2, &soon, b"b", "/x"), 0, nz(1));
        store.check(c("late", 1, &late, b"c", "/x"), 10, nz(1));
        let kept: Vec<KeyId> = store.iter().map(|(id, _)| id).collect();
        assert!(kept.contains(&KeyId::of("late", b"a", "/x")));
        assert!(kept.contains(&KeyId::of("late", b"c", "/x")));
    }

    #[test]
    fn a_full_store_reclaims_expired_entries_before_evicting_live_ones() {
        let mut store = Store::new(1, 3);
        let limiter = fixed(5, 1_000);
        store.check(c("r", 1, &limiter, b"a", "/x"), 0, nz(1));
        let (_, churn, _) = store.check(c("r", 1, &limiter, b"b", "/x"), 5_000, nz(1));
        assert_eq!(
            churn,
            Churn {
                expired: 1,
                evicted: 0,
                evicted_denied: 0,
                evicted_replicas: 0,
            }
        );
    }

    #[test]
    fn refund_gives_back_an_admitted_check() {
        let mut store = Store::new(10, 1);
        let limiter = Limiter::SlidingWindowCounter(
            SlidingCounter::new(nz(1), Duration::from_secs(60)).unwrap(),
        );
        assert!(
            store
                .check(c("r", 1, &limiter, b"a", "/x"), 100, nz(1))
                .0
                .allowed
        );
        store.refund(c("r", 1, &limiter, b"a", "/x"), 100, nz(1));
        assert!(
            store
                .check(c("r", 1, &limiter, b"a", "/x"), 101, nz(1))
                .0
                .allowed
        );
    }

    #[test]
    fn inspect_changes_nothing_and_reset_makes_every_algorithm_a_fresh_key() {
        for (name, limiter) in model_limiters() {
            let mut store = Store::new(10, 1);
            let counter = c("r", 1, &limiter, b"a", "");
            assert_eq!(store.inspect(counter, 1_000), None, "{name}: no state yet");
            for _ in 0..3 {
                store.check(counter, 1_000, nz(1));
            }
            let seen = store.inspect(counter, 1_000).expect("state held");
            assert_eq!(
                store.inspect(counter, 1_000),
                Some(seen),
                "{name}: inspecting twice reports the same"
            );
            let mut twin = Store::new(10, 1);
            for _ in 0..3 {
                twin.check(counter, 1_000, nz(1));
            }
            assert_eq!(
                store.check(counter, 1_000, nz(1)),
                twin.check(counter, 1_000, nz(1)),
                "{name}: an inspection charged nothing"
            );
            let before = store.reset(counter, 1_000).expect("state held");
            assert!(before.remaining < before.limit, "{name}: {before:?}");
            assert_eq!(store.inspect(counter, 1_000), None, "{name}: gone");
            assert!(store.is_empty());
            let mut fresh = Store::new(10, 1);
            assert_eq!(
                store.check(counter, 1_000, nz(1)),
                fresh.check(counter, 1_000, nz(1)),
                "{name}: after a reset a check sees a new key"
            );
            store.assert_consistent();
        }
    }

    #[test]
    fn exported_state_installs_elsewhere_and_continues_the_count() {
        let mut old = Store::new(10, 1);
        let mut new = Store::new(10, 2);
        let limiter = fixed(3, 60_000);
        for _ in 0..3 {
            old.check(c("r", 1, &limiter, b"moving", "/x"), 10, nz(1));
        }
        old.check(c("r", 1, &limiter, b"staying", "/x"), 10, nz(1));
        let exported = old.export(20, |at| {
            (at == Ring::key_hash(b"moving")).then(|| Recipient::new("new", 1))
        });
        assert_eq!(exported.len(), 1);
        assert_eq!(&*exported[0].0, "new");
        assert!(
            old.export(25, |at| (at == Ring::key_hash(b"moving"))
                .then(|| Recipient::new("new", 1)))
                .is_empty(),
            "a handed-over key is not shipped twice"
        );
        assert!(new.install(exported[0].1.clone(), &limiter, 30));
        let (decision, _, _) = new.check(c("r", 1, &limiter, b"moving", "/x"), 40, nz(1));
        assert!(
            !decision.allowed,
            "the new owner continues the exhausted count"
        );
    }

    #[test]
    fn a_key_handed_back_keeps_the_stricter_of_both_counts() {
        let limiter = fixed(20, 60_000);
        let remaining = |store: &mut Store| {
            store
                .inspect(c("r", 1, &limiter, b"k", "/x"), 100)
                .map(|d| d.remaining)
        };
        // a admits 10 and hands the key to b, which took it in and admitted 2 more:
        // b's state comes back with everything (12), not 10 + 12.
        let (mut a, mut b) = (Store::new(10, 1), Store::new(10, 2));
        for _ in 0..10 {
            a.check(c("r", 1, &limiter, b"k", "/x"), 10, nz(1));
        }
        let handed = a.export(20, |_| Some(Recipient::new("b", 1)));
        assert!(b.install(handed[0].1.clone(), &limiter, 30));
        for _ in 0..2 {
            b.check(c("r", 1, &limiter, b"k", "/x"), 40, nz(1));
        }
        let back = b.export(50, |_| Some(Recipient::new("a", 1)));
        assert!(a.install(back[0].1.clone(), &limiter, 60));
        assert_eq!(remaining(&mut a), Some(8));

        // The two handed the key to each other at once (a ring that flapped): b's state
        // (5 of its own) never saw a's 10. a keeps its 10, not b's 5.
        let (mut a, mut b) = (Store::new(10, 1), Store::new(10, 2));
        for _ in 0..10 {
            a.check(c("r", 1, &limiter, b"k", "/x"), 10, nz(1));
        }
        for _ in 0..5 {
            b.check(c("r", 1, &limiter, b"k", "/x"), 10, nz(1));
        }
        let _to_b = a.export(20, |_| Some(Recipient::new("b", 1)));
        let to_a = b.export(20, |_| Some(Recipient::new("a", 1)));
        assert!(a.install(to_a[0].1.clone(), &limiter, 30));
        assert_eq!(remaining(&mut a), Some(10));
    }

    #[test]
    fn installing_over_local_state_merges_both_nodes_admissions() {
        let mut old = Store::new(10, 1);
        let mut new = Store::new(10, 2);
        let limiter = fixed(5, 60_000);
        for _ in 0..3 {
            old.check(c("r", 1, &limiter, b"k", "/x"), 10, nz(1));
        }
        // The new owner already admitted 2 for the key during the gossip window.
        for _ in 0..2 {
            new.check(c("r", 1, &limiter, b"k", "/x"), 20, nz(1));
        }
        let exported = old.export(30, |_| Some(Recipient::new("new", 1)));
        assert!(new.install(exported[0].1.clone(), &limiter, 40));
        let (decision, _, _) = new.check(c("r", 1, &limiter, b"k", "/x"), 50, nz(1));
        assert!(
            !decision.allowed,
            "3 + 2 = 5 admitted across both nodes: the limit"
        );
    }

    #[test]
    fn late_checks_on_a_handed_over_key_continue_its_count_and_travel_as_deltas() {
        let mut old = Store::new(10, 1);
        let mut new = Store::new(10, 2);
        let limiter = fixed(5, 60_000);
        for _ in 0..3 {
            old.check(c("r", 1, &limiter, b"k", "/x"), 10, nz(1));
        }
        let exported = old.export(20, |_| Some(Recipient::new("new", 1)));
        assert!(new.install(exported[0].1.clone(), &limiter, 21));
        // A node on the old ring forwards two more checks to the old owner.
        assert!(
            old.check(c("r", 1, &limiter, b"k", "/x"), 22, nz(1))
                .0
                .allowed
        );
        assert!(
            old.check(c("r", 1, &limiter, b"k", "/x"), 23, nz(1))
                .0
                .allowed
        );
        assert!(
            !old.check(c("r", 1, &limiter, b"k", "/x"), 24, nz(1))
                .0
                .allowed,
            "the old owner keeps counting on the handed-over state: 5 is the limit"
        );
        assert!(
            old.drain_deltas(|_, _| false).is_empty(),
            "kept while its new owner is not reachable"
        );
        let deltas = old.drain_deltas(|_, _| true);
        assert_eq!(deltas.len(), 1);
        assert!(
            old.drain_deltas(|_, _| true).is_empty(),
            "a delta is pushed once"
        );
        assert!(new.install(deltas[0].1.clone(), &limiter, 25));
        assert!(
            !new.check(c("r", 1, &limiter, b"k", "/x"), 26, nz(1))
                .0
                .allowed,
            "the new owner saw 3 + 2 admissions"
        );
    }

    #[test]
    fn a_fail_over_in_doubt_on_a_handed_over_key_owes_the_new_owner_nothing() {
        let mut old = Store::new(10, 1);
        let limiter = fixed(5, 60_000);
        old.check(c("r", 1, &limiter, b"k", "/x"), 10, nz(1));
        old.export(20, |_| Some(Recipient::new("new", 1)));
        // The forward to the new owner timed out: it may have charged the check.
        assert!(
            old.check_in_doubt(c("r", 1, &limiter, b"k", "/x"), 22, nz(1))
                .0
                .allowed
        );
        assert!(old.drain_deltas(|_, _| true).is_empty(), "nothing owed");
        old.check(c("r", 1, &limiter, b"k", "/x"), 23, nz(1));
        assert_eq!(old.drain_deltas(|_, _| true).len(), 1, "a plain one is");
    }

    #[test]
    fn install_refuses_state_the_rule_could_not_have_made() {
        let mut store = Store::new(10, 1);
        let limiter = fixed(3, 60_000);
        let bogus = Exported {
            id: KeyId::of("r", b"a", "/x"),
            fingerprint: 1,
            state: KeyState::from_words(crate::algorithms::AlgorithmKind::FixedWindow, &[0, 9])
                .unwrap(),
        };
        assert!(!store.install(bogus, &limiter, 10));
        assert!(store.is_empty());
    }

    #[test]
    fn token_bucket_keys_expire_once_refilled() {
        let mut store = Store::new(10, 1);
        let limiter = Limiter::TokenBucket(
            TokenBucket::new(nz(10), nz(10), Duration::from_secs(10)).unwrap(),
        );
        store.check(c("r", 1, &limiter, b"a", "/x"), 0, nz(10));
        assert_eq!(store.expire(9_999, 10), 0);
        assert_eq!(
            store.expire(10_000, 10),
            1,
            "refilled completely after 10 s"
        );
    }
}
