//! Budget leases, the entry's gate: which checks of remote counters go to the shard's
//! lease store at all, decided on the caller's task without a channel round trip.
//!
//! A check can be decided from a lease only where one is held, and a counter becomes
//! worth a lease only once it is hot. Sending every check of every remote counter to its
//! shard to find that out costs a channel round trip per check, also on traffic that is
//! never hot (`docs/leases.md`, *What it costs*). So the gate sends to the shard:
//!
//! - every check of a counter the shards of this node hold a lease of (a per-node table
//!   of counts, one slot per hash of the counter: a collision only sends a check to the
//!   shard for nothing);
//! - one check in `k` of any other counter, chosen at random, weighted `k` in the
//!   shard's meter, so the meter still estimates the counter's rate without bias, with
//!   `k = threshold / SAMPLES_AT_THRESHOLD` (at least 1: a low threshold meters every
//!   check, as before).
//!
//! Nothing here decides a check: a check the gate does not send is forwarded, as it
//! would be without a lease. A stale slot (a lease held a moment before it is counted)
//! costs at most a forwarded check whose unit could have come from the lease.

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::shard::KeyId;

/// At the threshold rate, about this many of a counter's checks a second reach its
/// shard's meter: enough for the two-bucket estimate to tell a hot counter within a
/// second or so, few enough that traffic far below the threshold rarely pays a hop.
pub const SAMPLES_AT_THRESHOLD: u64 = 16;

/// Slots of the held-lease table (a power of two). A node holds leases of a few hot
/// counters; 8,192 slots keep collisions rare at a few hundred.
const SLOTS: usize = 8_192;

/// Which remote checks go to the shard's lease store: see the module's doc.
#[derive(Debug)]
pub struct LeaseGate {
    /// 1 in `sample` checks of a counter with no lease held here goes to the shard.
    sample: u64,
    /// Per slot, how many leases the shards hold of counters hashing to it.
    held: Box<[AtomicU32]>,
}

/// Where the gate sends one check of a remote counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gated {
    /// To the shard, weighted this many checks in its meter (1: a lease may be held).
    Shard(u64),
    /// Straight on to the owner (no lease held here, not sampled).
    Forward,
}

impl LeaseGate {
    /// A gate for a node that asks for leases at `threshold` checks per second. With
    /// leases off (0) the router does not consult it: every remote check is forwarded.
    pub fn new(threshold: u64) -> Self {
        Self {
            sample: (threshold / SAMPLES_AT_THRESHOLD).max(1),
            held: (0..SLOTS).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// One in how many checks of a counter with no lease held here is metered.
    pub fn sample(&self) -> u64 {
        self.sample
    }

    /// Where one check of `counter` goes. `held_only`: a check already answered (by the
    /// deny cache) that only a held lease could change.
    pub fn route(&self, counter: KeyId, held_only: bool) -> Gated {
        if self.held[slot(counter)].load(Ordering::Relaxed) > 0 {
            Gated::Shard(1)
        } else if held_only || !sampled(self.sample) {
            Gated::Forward
        } else {
            Gated::Shard(self.sample)
        }
    }

    /// A shard of this node now holds one more lease of `counter`.
    pub(super) fn hold(&self, counter: KeyId) {
        self.held[slot(counter)].fetch_add(1, Ordering::Relaxed);
    }

    /// A shard of this node no longer holds one lease of `counter` (it ended).
    pub(super) fn release(&self, counter: KeyId) {
        let _ = self.held[slot(counter)]
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    /// Leases counted in `counter`'s slot (tests: the table matches the stores).
    #[cfg(test)]
    pub(super) fn count(&self, counter: KeyId) -> u32 {
        self.held[slot(counter)].load(Ordering::Relaxed)
    }
}

fn slot(counter: KeyId) -> usize {
    // `disc` is already an xxh3 of the counter's identity.
    (counter.disc as usize) & (SLOTS - 1)
}

/// True one time in `k`, at random (a per-thread xorshift: no lock, no shared line).
fn sampled(k: u64) -> bool {
    if k <= 1 {
        return true;
    }
    thread_local! {
        static STATE: Cell<u64> = Cell::new({
            use std::hash::{BuildHasher, RandomState};
            RandomState::new().hash_one(std::thread::current().id()) | 1
        });
    }
    STATE.with(|state| {
        let mut x = state.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        state.set(x);
        x % k == 0
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counter(disc: u64) -> KeyId {
        KeyId { placement: 7, disc }
    }

    #[test]
    fn a_low_threshold_meters_every_check_and_a_cached_answer_goes_on_without_a_lease() {
        let gate = LeaseGate::new(3);
        assert_eq!(gate.sample(), 1);
        for disc in 0..100 {
            assert_eq!(gate.route(counter(disc), false), Gated::Shard(1));
            assert_eq!(gate.route(counter(disc), true), Gated::Forward);
        }
    }

    #[test]
    fn a_high_threshold_samples_one_in_k_weighted_k() {
        let gate = LeaseGate::new(160);
        assert_eq!(gate.sample(), 10);
        let sent: Vec<Gated> = (0..20_000)
            .map(|i| gate.route(counter(i), false))
            .filter(|g| *g != Gated::Forward)
            .collect();
        assert!(sent.iter().all(|g| *g == Gated::Shard(10)));
        // 2,000 expected; a xorshift is far closer than this.
        assert!((1_500..2_500).contains(&sent.len()), "{}", sent.len());
    }

    #[test]
    fn a_held_lease_sends_every_check_of_its_counter_until_released() {
        let gate = LeaseGate::new(1_000_000);
        let hot = counter(42);
        gate.hold(hot);
        gate.hold(hot);
        assert_eq!(gate.route(hot, false), Gated::Shard(1));
        assert_eq!(gate.route(hot, true), Gated::Shard(1));
        gate.release(hot);
        assert_eq!(gate.route(hot, true), Gated::Shard(1));
        gate.release(hot);
        assert_eq!(gate.route(hot, true), Gated::Forward);
        // Never below zero.
        gate.release(hot);
        assert_eq!(gate.count(hot), 0);
    }
}
