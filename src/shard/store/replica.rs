//! What replication asks of a store: a copy of one key's state for its successor, a
//! replica put in place of the last one, a replica taken out when its key is promoted,
//! and the room a replica store may use beside the live keys (see
//! [`Replicas`](crate::shard::replicas::Replicas)).

use super::{probe_standing, Churn, Exported, Store, LOCAL, MOVED};
use crate::algorithms::{Limiter, Millis};
use crate::shard::identity::KeyId;
use crate::shard::Recipient;
use std::hash::BuildHasher;
use std::sync::Arc;

impl Store {
    /// A copy of `id`'s state for its replica: `None` when the key is not held, was
    /// handed to another owner (that owner replicates it now), or is node-local.
    pub fn snapshot(&self, id: KeyId) -> Option<Exported> {
        let i = self.find(self.hasher.hash_one(id), id)?;
        let slot = self.slots[i];
        if slot.has(MOVED) || slot.has(LOCAL) {
            return None;
        }
        Some(Exported {
            id,
            fingerprint: self.fingerprints[slot.fingerprint_slot() as usize].0,
            state: self.load(i),
        })
    }

    /// The keys handed away to a member `to` accepts.
    pub fn handed_to(&self, mut to: impl FnMut(&str, u64) -> bool) -> Vec<KeyId> {
        let mut ids: Vec<KeyId> = self
            .moved
            .iter()
            .filter(|(_, moved)| to(&moved.to, moved.generation))
            .map(|(&id, _)| id)
            .collect();
        // The moved-key table iterates in hash order: sort for one order everywhere.
        ids.sort_unstable_by_key(|id| (id.placement, id.disc));
        ids
    }

    /// Join `item` (a replica of a key this store keeps as handed away, of the same
    /// rule version) into the handed-away count: both are lower bounds of one history,
    /// so the join (per component, the stricter) counts nothing twice. Returns whether
    /// it was joined.
    pub fn join_handed_away(&mut self, item: Exported, now: Millis) -> bool {
        let Some(i) = self.find(self.hasher.hash_one(item.id), item.id) else {
            return false;
        };
        let slot = self.slots[i];
        let (fingerprint, limiter) = &self.fingerprints[slot.fingerprint_slot() as usize];
        if !slot.has(MOVED) || *fingerprint != item.fingerprint || !limiter.accepts(&item.state) {
            return false;
        }
        let limiter = limiter.clone();
        let standing = self.update(i, |state| {
            limiter.join(state, item.state);
            probe_standing(&limiter, state, now)
        });
        self.mark(i, standing);
        self.fit_bytes(now);
        true
    }

    /// Take back the keys `ids` this store handed away to an incarnation that is gone
    /// (it restarted empty after the cluster dropped it): each is live here again, its
    /// unsent delta dropped (this count holds it), and handed over afresh to
    /// `new_owner`'s choice, or kept as this node's own where that gives `None`. Returns
    /// the states to push, with their destinations.
    pub fn hand_again(
        &mut self,
        ids: &[KeyId],
        now: Millis,
        mut new_owner: impl FnMut(u64) -> Option<Recipient>,
    ) -> Vec<(Arc<str>, Exported)> {
        let mut out = Vec::new();
        for &id in ids {
            let Some(i) = self.find(self.hasher.hash_one(id), id) else {
                continue;
            };
            if !self.slots[i].has(MOVED) {
                continue;
            }
            self.slots[i].set(MOVED, false);
            self.moved.remove(&id);
            if self.expired(i, now) {
                self.remove_at(i);
                continue;
            }
            if let Some(to) = new_owner(id.placement) {
                out.push(self.hand_over_at(i, to));
            }
        }
        out
    }

    /// A copy of `id`'s state if the store keeps it only as handed away (the count its
    /// late checks go on with), to join into a replica of it held here.
    pub fn handed_away_state(&self, id: KeyId) -> Option<Exported> {
        let i = self.find(self.hasher.hash_one(id), id)?;
        let slot = self.slots[i];
        slot.has(MOVED).then(|| Exported {
            id,
            fingerprint: self.fingerprints[slot.fingerprint_slot() as usize].0,
            state: self.load(i),
        })
    }

    /// Whether the store holds `id` as its own key: held and not handed away. A key
    /// held only as handed away (or not at all) takes a promoted replica's state.
    pub fn holds(&self, id: KeyId) -> bool {
        self.find(self.hasher.hash_one(id), id)
            .is_some_and(|i| !self.slots[i].has(MOVED))
    }

    /// Whether the store keeps `id` only as handed away to a new owner (its count
    /// still decides the forwards of nodes on the old view, and its late admissions go
    /// to the new owner as deltas).
    pub fn handed_away(&self, id: KeyId) -> bool {
        self.find(self.hasher.hash_one(id), id)
            .is_some_and(|i| self.slots[i].has(MOVED))
    }

    /// Whether the store has an entry for `id`, its own or handed away.
    pub fn contains(&self, id: KeyId) -> bool {
        self.find(self.hasher.hash_one(id), id).is_some()
    }

    /// Remove `id` and return its state.
    pub fn take(&mut self, id: KeyId) -> Option<Exported> {
        let i = self.find(self.hasher.hash_one(id), id)?;
        let slot = self.slots[i];
        let taken = Exported {
            id,
            fingerprint: self.fingerprints[slot.fingerprint_slot() as usize].0,
            state: self.load(i),
        };
        self.remove_at(i);
        Some(taken)
    }

    /// Put `item` in place of whatever the store holds for its key (a replica: the
    /// owner's newest state supersedes the last one it sent; nothing is merged). A
    /// state already equivalent to fresh removes the key. Returns whether it is held.
    pub fn put(&mut self, item: Exported, limiter: &Limiter, now: Millis) -> (bool, Churn) {
        if !limiter.accepts(&item.state) {
            return (false, Churn::default());
        }
        let fp = self.intern(item.fingerprint, limiter);
        let hash = self.hasher.hash_one(item.id);
        let found = self.find(hash, item.id);
        if limiter.expires_at(&item.state) <= now {
            if let Some(i) = found {
                self.remove_at(i);
            }
            return (false, Churn::default());
        }
        let standing = probe_standing(limiter, &item.state, now);
        let mut churn = Churn::default();
        let i = match found {
            Some(i) => {
                self.slots[i].meta = (self.slots[i].meta & !super::FP_MASK) | fp;
                i
            }
            None => {
                churn += self.make_room(now);
                self.push(item.id, hash, fp)
            }
        };
        self.put_state(i, item.state);
        self.mark(i, standing);
        churn += self.fit_bytes(now);
        (true, churn)
    }

    /// Copies of every entry whose ring placement `pick` accepts.
    pub fn select(&self, mut pick: impl FnMut(u64) -> bool) -> Vec<Exported> {
        (0..self.slots.len())
            .filter(|&i| !self.slots[i].has(LOCAL) && pick(self.slots[i].id().placement))
            .map(|i| Exported {
                id: self.slots[i].id(),
                fingerprint: self.fingerprints[self.slots[i].fingerprint_slot() as usize].0,
                state: self.load(i),
            })
            .collect()
    }

    /// Set the key cap and the side byte budget to what is left beside another store,
    /// evicting (least harm first) what no longer fits. A cap of 0 holds nothing.
    pub fn fit_within(&mut self, keys: usize, bytes: usize, now: Millis) -> Churn {
        self.cap = keys;
        self.max_side_bytes = bytes;
        let mut churn = Churn::default();
        while self.slots.len() > keys {
            let before = self.slots.len();
            churn += self.make_room(now);
            if self.slots.len() == before {
                break;
            }
        }
        churn += self.fit_bytes(now);
        churn
    }
}
