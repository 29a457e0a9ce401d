//! The replicas a shard keeps for keys whose successor this node is.
//!
//! Every key's owner sends the key's state to the key's successor (the member that
//! inherits the key if the owner dies) every replication interval, coalesced per key:
//! the newest state replaces the last one, nothing is merged, because the owner's
//! state already includes everything it sent before. Replicas live in a [`Store`] of
//! their own beside the shard's live keys, inside the same key cap and byte budget:
//! their store is given only the room the live keys leave ([`Store::fit_within`]), so
//! a live key never makes way for a replica, and a replica is evicted (least harm
//! first, as live keys are) as soon as live keys need the room.
//!
//! A replica is used three ways:
//! - **Promotion**: when the ring gives the key to this node (its owner died), the
//!   replica is taken out and installed as the live key, merged with anything this
//!   node decided for it meanwhile ([`Replicas::take`]).
//! - **Fail-over**: while the owner is unreachable but still on the ring, entry nodes
//!   send the key's checks here, and they are decided on the replica
//!   ([`Replicas::check_failover`]). What such checks admit is also kept as a delta
//!   and pushed to the owner (merged there, like a handoff's late admissions), so an
//!   owner that was only partitioned learns of them when it can be reached again.
//! - **Restore**: an owner that restarted with empty memory asks for its replicas
//!   before it answers as owner ([`Replicas::select`]).

use std::collections::HashMap;
use std::num::NonZeroU64;

use crate::algorithms::{Decision, KeyState, Limiter, Millis};
use crate::shard::store::{Churn, Counter, Exported, Store};
use crate::shard::KeyId;

/// Most keys one shard owes fail-over admissions for at once (drained every replication
/// round): a bound on memory outside the key cap.
pub const MAX_OWED: usize = 65_536;

/// Admissions made here on a replica for an owner that could not be reached.
#[derive(Debug)]
struct Pending {
    fingerprint: u64,
    delta: KeyState,
}

/// A shard's replicas and the fail-over admissions not yet delivered to their owners.
#[derive(Debug)]
pub struct Replicas {
    store: Store,
    pending: HashMap<KeyId, Pending>,
    /// Keys this node decided fail-over checks on, until their state expires: their
    /// next replicas are joined with what is held ([`Replicas::hold`]).
    failed_over: HashMap<KeyId, Millis>,
}

impl Replicas {
    /// No replicas; `seed` drives the eviction sample.
    pub fn new(seed: u64) -> Self {
        let mut store = Store::new(1, seed);
        store.fit_within(0, 0, 0);
        Self {
            store,
            pending: HashMap::new(),
            failed_over: HashMap::new(),
        }
    }

    /// Replicas held.
    pub fn len(&self) -> usize {
        self.store.len()
    }

    /// True when no replica is held.
    pub fn is_empty(&self) -> bool {
        self.store.is_empty()
    }

    /// A copy of every replica held, for a snapshot on disk (see [`Store::freeze`]).
    pub fn freeze(&self) -> crate::shard::store::Frozen {
        self.store.freeze()
    }

    /// Bytes of side state the replicas hold.
    pub fn side_bytes(&self) -> usize {
        self.store.side_bytes()
    }

    /// Give the replicas the room `live` leaves of `keys` keys and `bytes` side bytes,
    /// evicting replicas that no longer fit.
    pub fn fit_beside(&mut self, live: &Store, keys: usize, bytes: usize, now: Millis) -> Churn {
        if self.store.len() + live.len() <= keys
            && self.store.side_bytes() + live.side_bytes() <= bytes
            && self.store.cap() == keys.saturating_sub(live.len())
        {
            return Churn::default();
        }
        self.store
            .fit_within(
                keys.saturating_sub(live.len()),
                bytes.saturating_sub(live.side_bytes()),
                now,
            )
            .of_replicas()
    }

    /// Keep `item` as the replica of its key, in place of the last one; fail-over
    /// admissions not yet delivered to the owner stay counted on top of it. Returns
    /// whether it is held (a full node holds no replica, and a state already
    /// equivalent to fresh needs none).
    ///
    /// A key this node decided fail-over checks on keeps the stricter of the two
    /// ([`Limiter::join`]): the owner may have built this state before it merged the
    /// admissions pushed to it (they are in flight), or it never gets the in-doubt ones
    /// (checks whose forward timed out, which it may have charged itself). Replacing
    /// would take them back and answer the next fail-over check with more than the last.
    pub fn hold(&mut self, mut item: Exported, limiter: &Limiter, now: Millis) -> (bool, Churn) {
        if self.store.cap() == 0 {
            return (false, Churn::default());
        }
        let id = item.id;
        if let Some(pending) = self.pending.get(&id) {
            limiter.merge(&mut item.state, pending.delta.clone());
        }
        if self.joins(id, now) {
            if let Some(held) = self.store.snapshot(id) {
                if held.fingerprint == item.fingerprint {
                    limiter.join(&mut item.state, held.state);
                }
            }
        }
        let (held, churn) = self.store.put(item, limiter, now);
        (held, churn.of_replicas())
    }

    /// Join `state` (a count of the same key kept here, as handed away) into the
    /// key's replica, if one is held under the same numbers; returns whether one is.
    pub fn join_held(&mut self, state: Exported, limiter: &Limiter, now: Millis) -> bool {
        let Some(mut held) = self.store.snapshot(state.id) else {
            return false;
        };
        if held.fingerprint != state.fingerprint {
            return false;
        }
        limiter.join(&mut held.state, state.state);
        self.store.put(held, limiter, now).0
    }

    /// Whether the next replica of `id` is joined with the one held (a fail-over check
    /// was decided on it, and that state has not expired).
    fn joins(&mut self, id: KeyId, now: Millis) -> bool {
        match self.failed_over.get(&id) {
            Some(&until) if until > now => true,
            Some(_) => {
                self.failed_over.remove(&id);
                false
            }
            None => false,
        }
    }

    /// Decide a check on the key's replica, for an owner that could not be reached: a
    /// key with no replica starts from a fresh state, as its new owner would. What is
    /// admitted is also kept as a delta for the owner ([`Replicas::drain_failover`]),
    /// if `owed`: a check whose forward timed out may have been charged by the owner
    /// already, so it counts on the replica only (the owner's next state replaces it).
    /// Without room for replicas, every admission is owed: nothing else could keep it.
    pub fn check_failover(
        &mut self,
        counter: Counter<'_>,
        now: Millis,
        cost: NonZeroU64,
        owed: bool,
    ) -> (Decision, Churn) {
        if self.store.cap() == 0 {
            return (
                self.check_without_room(counter, now, cost),
                Churn::default(),
            );
        }
        let (decision, churn, _) = self.store.check(counter, now, cost);
        let churn = churn.of_replicas();
        if decision.allowed {
            if owed {
                if let Some(pending) = self.owed(counter) {
                    counter.limiter.check(&mut pending.delta, now, cost);
                }
            }
            if self.failed_over.len() < MAX_OWED || self.failed_over.contains_key(&counter.id) {
                if let Some(held) = self.store.snapshot(counter.id) {
                    let until = counter.limiter.expires_at(&held.state);
                    self.failed_over.insert(counter.id, until);
                }
            }
        }
        (decision, churn)
    }

    /// A fail-over check with no room for replicas beside the live keys: decided on
    /// what this node admitted for the key since its owner last heard of it (the delta
    /// it owes the owner), so the key's fail-over admissions stay bounded by its limit
    /// per window; denied when even that table is full (the strict side).
    fn check_without_room(
        &mut self,
        counter: Counter<'_>,
        now: Millis,
        cost: NonZeroU64,
    ) -> Decision {
        match self.owed(counter) {
            Some(pending) => counter.limiter.check(&mut pending.delta, now, cost),
            None => {
                let mut full = counter.limiter.new_state();
                let mut decision = counter.limiter.check(&mut full, now, cost);
                decision.allowed = false;
                decision.remaining = 0;
                decision
            }
        }
    }

    /// The delta this node owes the owner of `counter`'s key (`None` when the table of
    /// such deltas is full: at most [`MAX_OWED`] keys per shard).
    fn owed(&mut self, counter: Counter<'_>) -> Option<&mut Pending> {
        if !self.pending.contains_key(&counter.id) && self.pending.len() >= MAX_OWED {
            return None;
        }
        let pending = self.pending.entry(counter.id).or_insert_with(|| Pending {
            fingerprint: counter.fingerprint,
            delta: counter.limiter.new_state(),
        });
        if pending.fingerprint != counter.fingerprint {
            pending.fingerprint = counter.fingerprint;
            pending.delta = counter.limiter.new_state();
        }
        Some(pending)
    }

    /// The numbers a fail-over check of the key would see, changing nothing.
    pub fn peek(&mut self, counter: Counter<'_>, now: Millis) -> Decision {
        self.store.peek(counter, now)
    }

    /// Fail-over admissions since the last call, to push to their owners (each key's
    /// owner is found by the caller, on its ring).
    pub fn drain_failover(&mut self) -> Vec<Exported> {
        self.pending
            .drain()
            .map(|(id, pending)| Exported {
                id,
                fingerprint: pending.fingerprint,
                state: pending.delta,
            })
            .collect()
    }

    /// Take the replica of `id` out, for promotion. Its fail-over admissions are in
    /// its state already: they are no longer owed to anyone.
    pub fn take(&mut self, id: KeyId) -> Option<Exported> {
        self.pending.remove(&id);
        self.failed_over.remove(&id);
        self.store.take(id)
    }

    /// Copies of the replicas whose placement `pick` accepts (for an owner restoring).
    /// Their fail-over admissions are in those states: they are no longer owed as
    /// deltas too (the owner would merge them twice).
    pub fn select(&mut self, pick: impl FnMut(u64) -> bool) -> Vec<Exported> {
        let selected = self.store.select(pick);
        for state in &selected {
            self.pending.remove(&state.id);
            self.failed_over.remove(&state.id);
        }
        selected
    }

    /// Drop expired replicas, examining at most `budget`.
    pub fn expire(&mut self, now: Millis, budget: usize) -> u64 {
        if !self.failed_over.is_empty() {
            self.failed_over.retain(|_, until| *until > now);
        }
        if self.store.is_empty() {
            return 0;
        }
        self.store.expire(now, budget)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::FixedWindow;
    use std::time::Duration;

    const NOW: Millis = 1_700_000_000_000;

    fn limiter() -> Limiter {
        Limiter::FixedWindow(
            FixedWindow::new(NonZeroU64::new(10).unwrap(), Duration::from_secs(60)).unwrap(),
        )
    }

    fn counter<'a>(limiter: &'a Limiter, key: &[u8]) -> Counter<'a> {
        Counter {
            id: KeyId::of("r", key, ""),
            fingerprint: 7,
            limiter,
            local: false,
        }
    }

    /// An owner's store after `n` admissions of `key`, and that key's snapshot.
    fn owner_state(limiter: &Limiter, key: &[u8], n: u64) -> Exported {
        let mut owner = Store::new(100, 1);
        for _ in 0..n {
            owner.check(counter(limiter, key), NOW, NonZeroU64::MIN);
        }
        owner.snapshot(counter(limiter, key).id).unwrap()
    }

    fn remaining(replicas: &mut Replicas, limiter: &Limiter, key: &[u8]) -> u64 {
        replicas.peek(counter(limiter, key), NOW).remaining
    }

    #[test]
    fn the_newest_replica_replaces_the_last_one() {
        let limiter = limiter();
        let live = Store::new(100, 2);
        let mut replicas = Replicas::new(3);
        replicas.fit_beside(&live, 100, 1 << 20, NOW);
        assert!(
            replicas
                .hold(owner_state(&limiter, b"k", 4), &limiter, NOW)
                .0
        );
        assert!(
            replicas
                .hold(owner_state(&limiter, b"k", 6), &limiter, NOW)
                .0
        );
        assert_eq!(
            remaining(&mut replicas, &limiter, b"k"),
            4,
            "6 used, not 10"
        );
    }

    #[test]
    fn fail_over_admissions_count_on_the_replica_until_the_owner_has_them() {
        let limiter = limiter();
        let live = Store::new(100, 2);
        let mut replicas = Replicas::new(3);
        replicas.fit_beside(&live, 100, 1 << 20, NOW);
        replicas.hold(owner_state(&limiter, b"k", 8), &limiter, NOW);
        let c = counter(&limiter, b"k");
        assert!(
            replicas
                .check_failover(c, NOW, NonZeroU64::MIN, true)
                .0
                .allowed
        );
        assert!(
            replicas
                .check_failover(c, NOW, NonZeroU64::MIN, true)
                .0
                .allowed
        );
        assert!(
            !replicas
                .check_failover(c, NOW, NonZeroU64::MIN, true)
                .0
                .allowed
        );
        // The owner's next replica (it has not had the delta yet) keeps both on top.
        replicas.hold(owner_state(&limiter, b"k", 8), &limiter, NOW);
        assert_eq!(remaining(&mut replicas, &limiter, b"k"), 0);
        let owed = replicas.drain_failover();
        assert_eq!(owed.len(), 1);
        let mut owner = limiter.new_state();
        limiter.merge(&mut owner, owed[0].state.clone());
        assert_eq!(
            limiter.peek(&owner, NOW).remaining,
            8,
            "the delta is the 2 admitted"
        );
        assert!(replicas.drain_failover().is_empty());
    }

    #[test]
    fn a_replica_built_before_the_owner_had_the_fail_over_admissions_takes_none_back() {
        let limiter = limiter();
        let live = Store::new(100, 2);
        let mut replicas = Replicas::new(3);
        replicas.fit_beside(&live, 100, 1 << 20, NOW);
        replicas.hold(owner_state(&limiter, b"k", 5), &limiter, NOW);
        let c = counter(&limiter, b"k");
        // One owed admission (pushed, in flight) and one in doubt (never pushed).
        assert!(
            replicas
                .check_failover(c, NOW, NonZeroU64::MIN, true)
                .0
                .allowed
        );
        assert!(
            replicas
                .check_failover(c, NOW, NonZeroU64::MIN, false)
                .0
                .allowed
        );
        assert_eq!(replicas.drain_failover().len(), 1, "only the owed one");
        assert_eq!(remaining(&mut replicas, &limiter, b"k"), 3);
        // The owner's state from before it merged the push: nothing is taken back.
        replicas.hold(owner_state(&limiter, b"k", 5), &limiter, NOW);
        assert_eq!(remaining(&mut replicas, &limiter, b"k"), 3);
        // The owner admitted one more and merged the push (and had charged the timed-out
        // check itself): 5 + 1 + 1 + 1 = 8 used, nothing counted twice.
        replicas.hold(owner_state(&limiter, b"k", 8), &limiter, NOW);
        assert_eq!(remaining(&mut replicas, &limiter, b"k"), 2);
    }

    #[test]
    fn replicas_use_only_the_room_live_keys_leave_and_go_first() {
        let limiter = limiter();
        let mut live = Store::new(4, 2);
        let mut replicas = Replicas::new(3);
        replicas.fit_beside(&live, 4, 1 << 20, NOW);
        for key in [b"a", b"b", b"c", b"d", b"e"] {
            replicas.hold(owner_state(&limiter, key, 1), &limiter, NOW);
        }
        assert_eq!(replicas.len(), 4, "at the key cap");
        live.check(counter(&limiter, b"x"), NOW, NonZeroU64::MIN);
        live.check(counter(&limiter, b"y"), NOW, NonZeroU64::MIN);
        let churn = replicas.fit_beside(&live, 4, 1 << 20, NOW);
        assert_eq!(replicas.len() + live.len(), 4, "replicas made way");
        assert_eq!(
            (churn.evicted_replicas, churn.evicted, churn.evicted_denied),
            (2, 0, 0),
            "counted as replicas' evictions, not as lost live counts"
        );
        for key in [b"p", b"q", b"r"] {
            live.check(counter(&limiter, key), NOW, NonZeroU64::MIN);
            replicas.fit_beside(&live, 4, 1 << 20, NOW);
        }
        assert_eq!(live.len(), 4, "no live key was evicted for a replica");
        assert_eq!(replicas.len(), 0);
        assert!(
            !replicas
                .hold(owner_state(&limiter, b"z", 1), &limiter, NOW)
                .0
        );
    }

    #[test]
    fn a_fail_over_admission_without_room_still_reaches_the_owner() {
        let limiter = limiter();
        let mut replicas = Replicas::new(3);
        // Room 0: a node full of live keys (or one whose shard has not sized it yet).
        let (decision, _) =
            replicas.check_failover(counter(&limiter, b"k"), NOW, NonZeroU64::MIN, true);
        assert!(decision.allowed);
        assert!(replicas.is_empty(), "nothing held without room");
        assert_eq!(
            replicas.drain_failover().len(),
            1,
            "but the admission is owed to the owner"
        );
    }

    #[test]
    fn promotion_takes_the_replica_and_its_fail_over_debt_with_it() {
        let limiter = limiter();
        let live = Store::new(100, 2);
        let mut replicas = Replicas::new(3);
        replicas.fit_beside(&live, 100, 1 << 20, NOW);
        replicas.hold(owner_state(&limiter, b"k", 5), &limiter, NOW);
        replicas.check_failover(counter(&limiter, b"k"), NOW, NonZeroU64::MIN, true);
        let id = counter(&limiter, b"k").id;
        let taken = replicas.take(id).unwrap();
        assert_eq!(limiter.peek(&taken.state, NOW).remaining, 4);
        assert!(
            replicas.drain_failover().is_empty(),
            "nothing owed any more"
        );
        assert!(replicas.is_empty());
    }
}
