//! The deny cache: "denied until T" answered on the receiving node, with no hop.
//!
//! It works because of an asymmetry (design reference, "The deny cache"): "allowed"
//! stops being true the instant the next request arrives, so it is never cached, but
//! "denied until T" stays true until T. No algorithm changes state on a denial, other
//! requests can only push T later, so answering a cached denial never admits anything
//! the owner would have denied. The worst case is a refund on the owner making room a
//! little before T: the cache then keeps denying until T, in the safe direction.
//!
//! A denial for cost c also holds for any cost ≥ c until T, but says nothing about a
//! smaller cost, so a smaller request goes to the owner.
//!
//! Bounded: at most `cap` entries. A full cache first drops expired entries; if it is
//! still full, the new denial is simply not cached (the owner is asked as usual).

use dashmap::DashMap;

use crate::algorithms::{Decision, Millis};
use crate::cluster::Decider;
use crate::shard::KeyId;

/// A cached denial and the owner's answer it repeats.
#[derive(Debug, Clone)]
pub struct Denial {
    /// Denied until this instant of the node's monotonic clock: `now + retry_after`
    /// when the owner answered. Monotonic, so a wall-clock step back on this node
    /// cannot make the cache deny past the owner's reset (a chaos run with a clock
    /// step found that: docs/chaos.md, finding 8).
    pub until: Millis,
    /// The smallest cost this denial covers.
    pub cost: u64,
    /// The fingerprint of the rule numbers it was decided under.
    pub fingerprint: u64,
    /// The owner's decision (its `retry_after_ms` is recomputed on each hit).
    pub decision: Decision,
    /// Who decided.
    pub decider: Decider,
}

impl Denial {
    /// The cached answer at `now`, if it still applies to a request of `cost` under a
    /// rule with `fingerprint`.
    pub fn answer(&self, now: Millis, cost: u64, fingerprint: u64) -> Option<Decision> {
        if now >= self.until || cost < self.cost || fingerprint != self.fingerprint {
            return None;
        }
        Some(Decision {
            retry_after_ms: self.until - now,
            remaining: 0,
            ..self.decision
        })
    }
}

/// Node-wide cache of denials, keyed by counter identity (the [`KeyId`] of rule,
/// client and route part, computed once when the check was planned): a denial covers
/// every route that spends the same budget.
#[derive(Debug)]
pub struct DenyCache {
    map: DashMap<KeyId, Denial>,
    cap: usize,
}

impl DenyCache {
    /// A cache of at most `cap` denials.
    pub fn new(cap: usize) -> Self {
        Self {
            map: DashMap::new(),
            cap,
        }
    }

    /// The cached answer for `key` at `now`, if any.
    pub fn get(
        &self,
        key: &KeyId,
        now: Millis,
        cost: u64,
        fingerprint: u64,
    ) -> Option<(Decision, Decider)> {
        let entry = self.map.get(key)?;
        let answer = entry.answer(now, cost, fingerprint);
        match answer {
            Some(decision) => Some((decision, entry.decider.clone())),
            None => {
                let expired = now >= entry.until;
                drop(entry);
                if expired {
                    self.map.remove(key);
                }
                None
            }
        }
    }

    /// Remember a denial. Only denials with a finite wait are cached.
    pub fn insert(&self, key: KeyId, denial: Denial, now: Millis) {
        if denial.decision.allowed || denial.until <= now || denial.until == u64::MAX {
            return;
        }
        if self.map.len() >= self.cap && !self.map.contains_key(&key) {
            self.map.retain(|_, d| d.until > now);
            if self.map.len() >= self.cap {
                return;
            }
        }
        self.map.insert(key, denial);
    }

    /// Drop the cached denial of `key`, if any: its counter was reset by an operator,
    /// so "denied until T" is no longer a fact.
    pub fn forget(&self, key: &KeyId) {
        self.map.remove(key);
    }

    /// Number of cached denials.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn k(name: &[u8]) -> KeyId {
        KeyId::of("r", name, "/x")
    }

    fn denial(until: Millis, cost: u64) -> Denial {
        Denial {
            until,
            cost,
            fingerprint: 7,
            decision: Decision {
                allowed: false,
                limit: 100,
                remaining: 0,
                retry_after_ms: 5_000,
                reset_at_ms: 60_000,
                window_id: Some(0),
                delay_ms: 0,
            },
            decider: Decider {
                node_id: Arc::from("owner"),
                generation: 1,
            },
        }
    }

    #[test]
    fn a_cached_denial_answers_until_its_time_with_the_remaining_wait() {
        let cache = DenyCache::new(10);
        cache.insert(k(b"k"), denial(10_000, 1), 5_000);
        let (d, decider) = cache.get(&k(b"k"), 6_000, 1, 7).unwrap();
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, 4_000);
        assert_eq!(&*decider.node_id, "owner");
        assert!(
            cache.get(&k(b"k"), 10_000, 1, 7).is_none(),
            "at T the owner is asked again"
        );
        assert!(cache.is_empty(), "an expired entry is dropped on lookup");
    }

    #[test]
    fn a_denial_covers_larger_costs_but_not_smaller_ones() {
        let cache = DenyCache::new(10);
        cache.insert(k(b"k"), denial(10_000, 5), 0);
        assert!(cache.get(&k(b"k"), 1, 5, 7).is_some());
        assert!(cache.get(&k(b"k"), 1, 9, 7).is_some());
        assert!(cache.get(&k(b"k"), 1, 4, 7).is_none());
    }

    #[test]
    fn a_forgotten_denial_is_asked_of_the_owner_again_and_others_stay() {
        let cache = DenyCache::new(10);
        cache.insert(k(b"reset"), denial(10_000, 1), 0);
        cache.insert(k(b"other"), denial(10_000, 1), 0);
        cache.forget(&k(b"reset"));
        assert!(cache.get(&k(b"reset"), 1, 1, 7).is_none());
        assert!(cache.get(&k(b"other"), 1, 1, 7).is_some());
    }

    #[test]
    fn a_changed_rule_is_not_answered_from_the_cache() {
        let cache = DenyCache::new(10);
        cache.insert(k(b"k"), denial(10_000, 1), 0);
        assert!(cache.get(&k(b"k"), 1, 1, 8).is_none());
    }

    #[test]
    fn allowed_answers_are_never_cached() {
        let cache = DenyCache::new(10);
        let mut d = denial(10_000, 1);
        d.decision.allowed = true;
        cache.insert(k(b"k"), d, 0);
        assert!(cache.is_empty());
    }

    #[test]
    fn the_cache_stays_within_its_cap() {
        let cache = DenyCache::new(3);
        for i in 0..10u8 {
            cache.insert(k(&[i]), denial(10_000, 1), 0);
        }
        assert_eq!(cache.len(), 3);
        // Expired entries make room.
        cache.insert(k(b"new"), denial(30_000, 1), 20_000);
        assert!(cache.get(&k(b"new"), 20_001, 1, 7).is_some());
    }
}
