//! The per-shard counter store: pure, synchronous, time injected.
//!
//! One [`Store`] is owned by value by exactly one shard actor, so it needs no locks. It
//! maps a [`StateKey`] (rule, client key, route) to the algorithm state of that key and
//! bounds its own memory in two ways:
//!
//! - **Expiry.** Every algorithm reports when a key's state becomes indistinguishable
//!   from a fresh one (a token bucket that has refilled, a window that has aged out).
//!   Dropping it then loses nothing. [`Store::expire`] walks the map incrementally from a
//!   cursor, a bounded number of entries per call, like Redis's active expiry, so a tick
//!   never pauses the shard for long however many keys it holds.
//! - **A key cap.** When a new key arrives at a full store, a few random entries are
//!   sampled and the one whose state expires soonest is evicted: it is the one closest to
//!   being forgotten anyway. Eviction does lose counts (that client's budget restarts),
//!   which is why every eviction is counted and surfaced: the design reference calls
//!   eviction the one failure that shows no error signal.

use std::num::NonZeroU64;
use std::sync::Arc;

use indexmap::IndexMap;

use crate::algorithms::{Decision, KeyState, Limiter, Millis};

/// How many entries an eviction samples. More samples evict closer to the true
/// soonest-expiring entry at the price of more work per eviction.
const EVICTION_SAMPLES: usize = 8;

/// The identity of one counter: (rule, client key, route), each part length-prefixed so
/// that no two different triples encode to the same bytes (`("ab","c")` vs `("a","bc")`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StateKey(Box<[u8]>);

impl StateKey {
    /// Encode into `buf` (cleared first) so the hot path can reuse one allocation.
    pub fn encode_into(buf: &mut Vec<u8>, rule: &str, client: &[u8], route: &str) {
        buf.clear();
        for part in [rule.as_bytes(), client, route.as_bytes()] {
            // Parts are validated to be far below 4 GiB long; u32 keeps the prefix small.
            buf.extend_from_slice(&(part.len() as u32).to_le_bytes());
            buf.extend_from_slice(part);
        }
    }

    /// Build an owned key.
    pub fn new(rule: &str, client: &[u8], route: &str) -> Self {
        let mut buf = Vec::new();
        Self::encode_into(&mut buf, rule, client, route);
        Self(buf.into_boxed_slice())
    }

    /// A key received from another node; `None` unless it is a valid encoding.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        Self::decode(bytes)?;
        Some(Self(bytes.into()))
    }

    /// The encoded bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Decode back into (rule, client, route); `None` if the bytes are not a valid encoding.
    pub fn decode(bytes: &[u8]) -> Option<(&str, &[u8], &str)> {
        let mut rest = bytes;
        let mut parts: [&[u8]; 3] = [&[]; 3];
        for part in &mut parts {
            let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
            *part = rest.get(4..4 + len)?;
            rest = &rest[4 + len..];
        }
        if !rest.is_empty() {
            return None;
        }
        Some((
            std::str::from_utf8(parts[0]).ok()?,
            parts[1],
            std::str::from_utf8(parts[2]).ok()?,
        ))
    }
}

impl std::borrow::Borrow<[u8]> for StateKey {
    fn borrow(&self) -> &[u8] {
        &self.0
    }
}

/// Which counter an operation is about, and the rule numbers it runs under.
#[derive(Debug, Clone, Copy)]
pub struct Counter<'a> {
    /// Rule name (part of the counter's identity).
    pub rule: &'a str,
    /// Fingerprint of the rule's numbers: state built under other numbers is discarded.
    pub fingerprint: u64,
    /// The rule's algorithm.
    pub limiter: &'a Limiter,
    /// Client key.
    pub client: &'a [u8],
    /// Route as sent.
    pub route: &'a str,
}

/// One key's state on its way to another node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exported {
    // (`to` travels beside it: see `Store::export` and `Store::drain_deltas`.)
    /// The counter's identity.
    pub key: StateKey,
    /// Fingerprint of the rule numbers the state was built under.
    pub fingerprint: u64,
    /// The algorithm state.
    pub state: KeyState,
}

/// One key's state plus what the store needs to manage it.
#[derive(Debug, Clone)]
struct Entry {
    state: KeyState,
    /// When the state becomes equivalent to a fresh one (safe to drop).
    expires_at: Millis,
    /// Fingerprint of the rule numbers the state was built under: a rule whose numbers
    /// changed on reload starts its keys afresh instead of misreading old state.
    fingerprint: u64,
    /// Set once the state was handed to a new owner (boxed: rare, keeps entries small).
    moved: Option<Box<Moved>>,
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
    /// Live keys dropped to respect the key cap (their counts were lost).
    pub evicted: u64,
}

impl std::ops::AddAssign for Churn {
    fn add_assign(&mut self, rhs: Self) {
        self.expired += rhs.expired;
        self.evicted += rhs.evicted;
    }
}

/// A shard's keys and their algorithm state.
#[derive(Debug)]
pub struct Store {
    // IndexMap: O(1) lookup plus stable positions, which the expiry cursor and the
    // random eviction sample both need. foldhash with a per-process random seed: about
    // 3x faster than SipHash on short keys, and the random seed still keeps
    // attacker-chosen keys from forcing collisions.
    map: IndexMap<StateKey, Entry, foldhash::fast::RandomState>,
    cap: usize,
    cursor: usize,
    rng: u64,
    scratch: Vec<u8>,
}

impl Store {
    /// An empty store holding at most `cap` keys (at least 1). `seed` drives eviction
    /// sampling, so tests are reproducible.
    pub fn new(cap: usize, seed: u64) -> Self {
        Self {
            map: IndexMap::with_hasher(foldhash::fast::RandomState::default()),
            cap: cap.max(1),
            cursor: 0,
            rng: seed | 1,
            scratch: Vec::with_capacity(128),
        }
    }

    /// Number of keys held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when no key is held.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
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
        let Counter {
            rule,
            fingerprint,
            limiter,
            client,
            route,
        } = counter;
        StateKey::encode_into(&mut self.scratch, rule, client, route);
        if let Some(entry) = self.map.get_mut(self.scratch.as_slice()) {
            if entry.fingerprint != fingerprint {
                entry.state = limiter.new_state();
                entry.fingerprint = fingerprint;
            }
            let fresh = entry.expires_at <= now;
            let decision = limiter.check(&mut entry.state, now, cost);
            entry.expires_at = limiter.expires_at(&entry.state);
            if let (Some(moved), true) = (entry.moved.as_mut(), decision.allowed) {
                // A late check for a key handed away: remember it for the new owner.
                limiter.check(&mut moved.delta, now, cost);
                moved.dirty = true;
            }
            return (decision, Churn::default(), fresh);
        }
        let mut state = limiter.new_state();
        let decision = limiter.check(&mut state, now, cost);
        let expires_at = limiter.expires_at(&state);
        if expires_at <= now {
            // The check left no trace (a denial on fresh state): nothing to remember.
            return (decision, Churn::default(), true);
        }
        let churn = self.make_room(now);
        let key = StateKey(self.scratch.as_slice().into());
        self.map.insert(
            key,
            Entry {
                state,
                expires_at,
                fingerprint,
                moved: None,
            },
        );
        (decision, churn, true)
    }

    /// Undo an admitted check made at `at` (another descriptor of the request denied).
    /// A key that is gone (expired, evicted, rule changed) has nothing left to refund.
    pub fn refund(&mut self, counter: Counter<'_>, at: Millis, cost: NonZeroU64) {
        let Counter {
            rule,
            fingerprint,
            limiter,
            client,
            route,
        } = counter;
        StateKey::encode_into(&mut self.scratch, rule, client, route);
        if let Some(entry) = self.map.get_mut(self.scratch.as_slice()) {
            if entry.fingerprint == fingerprint {
                limiter.refund(&mut entry.state, at, cost);
                entry.expires_at = limiter.expires_at(&entry.state);
                if let Some(moved) = entry.moved.as_mut() {
                    limiter.refund(&mut moved.delta, at, cost);
                }
            }
        }
    }

    /// Drop expired entries, examining at most `budget` entries from where the last call
    /// stopped. Returns how many were dropped.
    pub fn expire(&mut self, now: Millis, budget: usize) -> u64 {
        let mut dropped = 0;
        for _ in 0..budget.min(self.map.len()) {
            if self.cursor >= self.map.len() {
                self.cursor = 0;
            }
            let expired = self
                .map
                .get_index(self.cursor)
                .is_some_and(|(_, e)| e.expires_at <= now);
            if expired {
                // swap_remove moves the last entry into the cursor slot: examine it next.
                self.map.swap_remove_index(self.cursor);
                dropped += 1;
            } else {
                self.cursor += 1;
            }
        }
        dropped
    }

    /// Every key with its state, for inspecting it.
    pub fn iter(&self) -> impl Iterator<Item = (&StateKey, &KeyState)> {
        self.map.iter().map(|(k, e)| (k, &e.state))
    }

    /// Hand over every live entry whose client key `new_owner` gives to another node:
    /// returns a copy of each state with its new owner, and keeps the entry, marked
    /// moved, so late checks forwarded here by nodes on the old ring continue its count
    /// (see [`Store::drain_deltas`]). Entries already handed over are not shipped again;
    /// expired ones are dropped.
    pub fn export(
        &mut self,
        now: Millis,
        mut new_owner: impl FnMut(&[u8]) -> Option<Arc<str>>,
    ) -> Vec<(Arc<str>, Exported)> {
        let mut out = Vec::new();
        self.map.retain(|key, entry| {
            let Some((_, client, _)) = StateKey::decode(key.as_bytes()) else {
                return true;
            };
            let Some(to) = new_owner(client) else {
                return true;
            };
            if entry.expires_at <= now {
                return false;
            }
            if entry.moved.is_none() {
                out.push((
                    to.clone(),
                    Exported {
                        key: key.clone(),
                        fingerprint: entry.fingerprint,
                        state: entry.state.clone(),
                    },
                ));
                entry.moved = Some(Box::new(Moved {
                    to,
                    delta: KeyState::empty_like(&entry.state),
                    dirty: false,
                }));
            }
            true
        });
        self.cursor = 0;
        out
    }

    /// Admissions made on handed-over keys since the last call, per new owner: to be
    /// pushed and merged there.
    pub fn drain_deltas(&mut self) -> Vec<(Arc<str>, Exported)> {
        let mut out = Vec::new();
        for (key, entry) in self.map.iter_mut() {
            let Some(moved) = entry.moved.as_mut().filter(|m| m.dirty) else {
                continue;
            };
            let delta = std::mem::replace(&mut moved.delta, KeyState::empty_like(&entry.state));
            moved.dirty = false;
            out.push((
                moved.to.clone(),
                Exported {
                    key: key.clone(),
                    fingerprint: entry.fingerprint,
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
        if !limiter.accepts(&item.state) {
            return false;
        }
        if let Some(entry) = self.map.get_mut(item.key.as_bytes()) {
            if entry.fingerprint != item.fingerprint {
                return false;
            }
            if entry.moved.take().is_some() {
                // The key comes back after this node handed it away: the sender's state
                // already includes everything this node pushed, so it replaces ours.
                entry.state = item.state;
            } else {
                limiter.merge(&mut entry.state, item.state);
            }
            entry.expires_at = limiter.expires_at(&entry.state);
            return true;
        }
        let expires_at = limiter.expires_at(&item.state);
        if expires_at <= now {
            return false;
        }
        self.make_room(now);
        self.map.insert(
            item.key,
            Entry {
                state: item.state,
                expires_at,
                fingerprint: item.fingerprint,
                moved: None,
            },
        );
        true
    }

    /// Free one slot if the store is full: prefer an expired entry among the sample,
    /// else evict the sampled entry that expires soonest.
    fn make_room(&mut self, now: Millis) -> Churn {
        if self.map.len() < self.cap {
            return Churn::default();
        }
        let mut victim = None;
        for _ in 0..EVICTION_SAMPLES {
            let index = (self.next_random() % self.map.len() as u64) as usize;
            let expires_at = self.map[index].expires_at;
            if victim.is_none_or(|(_, best)| expires_at < best) {
                victim = Some((index, expires_at));
            }
        }
        let Some((index, expires_at)) = victim else {
            return Churn::default();
        };
        self.map.swap_remove_index(index);
        if expires_at <= now {
            Churn {
                expired: 1,
                evicted: 0,
            }
        } else {
            Churn {
                expired: 0,
                evicted: 1,
            }
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
mod tests {
    use super::*;
    use std::time::Duration;

    use crate::algorithms::{FixedWindow, SlidingCounter, TokenBucket};

    fn c<'a>(
        rule: &'a str,
        fingerprint: u64,
        limiter: &'a Limiter,
        client: &'a [u8],
        route: &'a str,
    ) -> Counter<'a> {
        Counter {
            rule,
            fingerprint,
            limiter,
            client,
            route,
        }
    }

    fn nz(n: u64) -> NonZeroU64 {
        NonZeroU64::new(n).unwrap()
    }

    fn fixed(limit: u64, window_ms: u64) -> Limiter {
        Limiter::FixedWindow(FixedWindow::new(nz(limit), Duration::from_millis(window_ms)).unwrap())
    }

    #[test]
    fn state_keys_with_shifted_boundaries_do_not_collide() {
        assert_ne!(
            StateKey::new("r", b"ab", "c"),
            StateKey::new("r", b"a", "bc")
        );
        assert_ne!(
            StateKey::new("ra", b"b", "c"),
            StateKey::new("r", b"ab", "c")
        );
        assert_ne!(StateKey::new("", b"", "x"), StateKey::new("", b"x", ""));
    }

    #[test]
    fn state_key_decodes_what_it_encoded() {
        let key = StateKey::new("rule-1", &[0xff, 0, 7], "POST /v1/charges");
        let (rule, client, route) = StateKey::decode(key.as_bytes()).unwrap();
        assert_eq!(rule, "rule-1");
        assert_eq!(client, &[0xff, 0, 7]);
        assert_eq!(route, "POST /v1/charges");
        assert!(StateKey::decode(&key.as_bytes()[..5]).is_none());
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
        store.check(c("long", 1, &long, b"a", "/x"), 500, nz(1));
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
        store.check(c("soon", 1, &soon, b"b", "/x"), 0, nz(1));
        store.check(c("late", 1, &late, b"c", "/x"), 10, nz(1));
        let kept: Vec<_> = store
            .iter()
            .map(|(k, _)| StateKey::decode(k.as_bytes()).unwrap().1.to_vec())
            .collect();
        assert!(kept.contains(&b"a".to_vec()) && kept.contains(&b"c".to_vec()));
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
                evicted: 0
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
    fn exported_state_installs_elsewhere_and_continues_the_count() {
        let mut old = Store::new(10, 1);
        let mut new = Store::new(10, 2);
        let limiter = fixed(3, 60_000);
        for _ in 0..3 {
            old.check(c("r", 1, &limiter, b"moving", "/x"), 10, nz(1));
        }
        old.check(c("r", 1, &limiter, b"staying", "/x"), 10, nz(1));
        let exported = old.export(20, |client| (client == b"moving").then(|| Arc::from("new")));
        assert_eq!(exported.len(), 1);
        assert_eq!(&*exported[0].0, "new");
        assert!(
            old.export(25, |client| (client == b"moving").then(|| Arc::from("new")))
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
        let exported = old.export(30, |_| Some(Arc::from("new")));
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
        let exported = old.export(20, |_| Some(Arc::from("new")));
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
        let deltas = old.drain_deltas();
        assert_eq!(deltas.len(), 1);
        assert!(old.drain_deltas().is_empty(), "a delta is pushed once");
        assert!(new.install(deltas[0].1.clone(), &limiter, 25));
        assert!(
            !new.check(c("r", 1, &limiter, b"k", "/x"), 26, nz(1))
                .0
                .allowed,
            "the new owner saw 3 + 2 admissions"
        );
    }

    #[test]
    fn install_refuses_state_the_rule_could_not_have_made() {
        let mut store = Store::new(10, 1);
        let limiter = fixed(3, 60_000);
        let bogus = Exported {
            key: StateKey::new("r", b"a", "/x"),
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
