//! Budget leases, the entry's side: the leases this node holds for counters other
//! nodes own, on the shard actor of each counter's key (single-threaded, like the
//! owner's decisions), and the rate at which it sees each remote counter's checks.
//!
//! A check of a remote counter asks [`EntryLeases::spend`] first: if a held lease
//! covers its cost, it is decided here from the lease (no hop) and the units leave the
//! lease; otherwise it is forwarded as before. Either way the step says whether to ask
//! the owner for a lease: when the counter is hot here (at least `threshold` checks per
//! second) and holds none, or before the held ones run out (under half of the newest
//! grant left, or a fifth of its time). At most one request per counter is in flight,
//! and after a refusal none for [`QUIET_MS`].
//!
//! A lease ends at its TTL by this node's clock, counted from when the request was
//! sent (so it ends no later than on the owner); its unused units are then
//! [`Returned`] to the owner, once.

use std::collections::HashMap;
use std::sync::Arc;

use smallvec::SmallVec;

use super::gate::LeaseGate;

use crate::algorithms::{Decision, Millis};
use crate::shard::KeyId;

/// After the owner granted no lease of a counter, how long before this node asks again.
pub const QUIET_MS: u64 = 250;

/// Most remote counters one shard follows the rate of. Past it, new counters are
/// forwarded without leases until idle ones are forgotten: a flood of unique keys
/// must not grow this table.
pub const MAX_TRACKED_PER_SHARD: usize = 4_096;

/// A request for a lease not answered within this long is taken as lost.
const ASK_TIMEOUT_MS: u64 = 2_000;

/// How long a counter with no lease and no checks is remembered.
const IDLE_MS: u64 = 2_000;

/// A check of a remote counter, as the entry's lease store sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpendAsk {
    /// The counter.
    pub counter: KeyId,
    /// Its rule's fingerprint (a lease charged under other numbers is not spent).
    pub fingerprint: u64,
    /// Units the check costs.
    pub cost: u64,
    /// Spend from a held lease if one covers it, and nothing else: neither counted in
    /// the rate nor a reason to ask (a check the deny cache answered: a lease that
    /// arrived after the denial is still budget to spend).
    pub held_only: bool,
    /// How many checks this one stands for in the counter's rate: 1, or `k` for a
    /// check the [`LeaseGate`] sampled one in `k`.
    pub weight: u64,
}

/// A lease this node holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldLease {
    /// The owner that granted it (node id, generation).
    pub owner: (std::sync::Arc<str>, u64),
    /// Its serial on the owner's shard.
    pub serial: u64,
    /// The fingerprint of the rule it was charged under.
    pub fingerprint: u64,
    /// Units granted.
    pub granted: u64,
    /// Units not spent yet.
    pub left: u64,
    /// When it was asked for (this node's clock).
    pub since: Millis,
    /// When it ends (this node's clock): `since` + the TTL the owner gave.
    pub until: Millis,
    /// The owner's numbers right after charging it.
    pub numbers: Decision,
}

/// The unused units of a lease that ended, for its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Returned {
    /// The owner that granted it (node id, generation).
    pub owner: (std::sync::Arc<str>, u64),
    /// Its serial on the owner's shard.
    pub serial: u64,
    /// Its counter.
    pub counter: KeyId,
    /// Units not spent.
    pub unused: u64,
}

/// What the entry does with one check of a remote counter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Decided from a lease: the answer's numbers and the owner that charged it.
    /// `None`: forward it.
    pub leased: Option<(Decision, (std::sync::Arc<str>, u64))>,
    /// Ask the owner for a lease, at this rate (units per second).
    pub ask: Option<u64>,
}

/// Checks and units seen per second, as a sliding estimate over two 1 s buckets.
#[derive(Debug, Clone, Copy, Default)]
struct Meter {
    second: u64,
    prev: (u64, u64),
    curr: (u64, u64),
}

impl Meter {
    fn roll(&mut self, now: Millis) {
        let second = now / 1_000;
        if second > self.second {
            self.prev = if second == self.second + 1 {
                self.curr
            } else {
                (0, 0)
            };
            self.curr = (0, 0);
            self.second = second;
        }
    }

    fn record(&mut self, now: Millis, cost: u64, weight: u64) {
        self.roll(now);
        self.curr.0 = self.curr.0.saturating_add(weight);
        self.curr.1 = self.curr.1.saturating_add(cost.saturating_mul(weight));
    }

    /// (checks, units) per second at `now`.
    fn rate(&self, now: Millis) -> (u64, u64) {
        let weight = 1_000u64.saturating_sub(now % 1_000);
        let est = |p: u64, c: u64| (u128::from(p) * u128::from(weight) / 1_000) as u64 + c;
        (est(self.prev.0, self.curr.0), est(self.prev.1, self.curr.1))
    }
}

#[derive(Debug, Default)]
struct Followed {
    leases: SmallVec<[HeldLease; 2]>,
    meter: Meter,
    /// When the request in flight was sent, if one is.
    asking: Option<Millis>,
    quiet_until: Millis,
    last_seen: Millis,
}

impl Followed {
    /// Move ended leases (and those under other numbers) to `returns`.
    fn end(
        &mut self,
        counter: KeyId,
        fingerprint: Option<u64>,
        now: Millis,
        returns: &mut Vec<Returned>,
        gate: &LeaseGate,
    ) {
        self.leases.retain(|l| {
            let keep = l.until > now && fingerprint.is_none_or(|f| f == l.fingerprint);
            if !keep {
                gate.release(counter);
            }
            if !keep && l.left > 0 {
                returns.push(Returned {
                    owner: l.owner.clone(),
                    serial: l.serial,
                    counter,
                    unused: l.left,
                });
            }
            keep
        });
    }

    /// Whether to ask for the next lease now that `left` units are held in all.
    fn running_out(&self, now: Millis) -> bool {
        let Some(newest) = self.leases.iter().max_by_key(|l| l.until) else {
            return true;
        };
        let left: u64 = self.leases.iter().map(|l| l.left).sum();
        let span = newest.until.saturating_sub(newest.since);
        left < newest.granted.div_ceil(2) || newest.until.saturating_sub(now) < span / 5
    }
}

/// The leases one shard holds, and the rates of the remote counters it sees.
#[derive(Debug)]
pub struct EntryLeases {
    counters: HashMap<KeyId, Followed>,
    /// Checks per second of one counter that make this node ask for a lease; 0: never.
    threshold: u64,
    /// The node's table of counters with a lease held, kept in step with `counters`.
    gate: Arc<LeaseGate>,
}

impl EntryLeases {
    /// A store that asks for leases of counters seen `threshold` times a second (0: off),
    /// with a gate of its own.
    pub fn new(threshold: u64) -> Self {
        Self::with_gate(threshold, Arc::new(LeaseGate::new(threshold)))
    }

    /// A store that counts the leases it holds in `gate`, the node's (shared by every
    /// shard and read by the router).
    pub fn with_gate(threshold: u64, gate: Arc<LeaseGate>) -> Self {
        Self {
            counters: HashMap::new(),
            threshold,
            gate,
        }
    }

    /// The gate this store keeps counts in (tests: the table matches).
    #[cfg(test)]
    pub(super) fn gate(&self) -> &Arc<LeaseGate> {
        &self.gate
    }

    /// Counters followed.
    pub fn len(&self) -> usize {
        self.counters.len()
    }

    /// Whether none is followed.
    pub fn is_empty(&self) -> bool {
        self.counters.is_empty()
    }

    /// Leases held of `counter` (tests: the gate's table matches).
    #[cfg(test)]
    pub(super) fn leases_of(&self, counter: KeyId) -> usize {
        self.counters.get(&counter).map_or(0, |f| f.leases.len())
    }

    /// Units held in leases of `counter`.
    pub fn held(&self, counter: KeyId) -> u64 {
        self.counters
            .get(&counter)
            .map_or(0, |f| f.leases.iter().map(|l| l.left).sum())
    }

    /// One check of a remote counter at `now`: decided from a lease, or forwarded;
    /// leases found ended go to `returns`.
    pub fn spend(&mut self, ask: &SpendAsk, now: Millis, returns: &mut Vec<Returned>) -> Step {
        let forward = Step {
            leased: None,
            ask: None,
        };
        if self.threshold == 0 {
            return forward;
        }
        let full = self.counters.len() >= MAX_TRACKED_PER_SHARD;
        if !self.counters.contains_key(&ask.counter) && (full || ask.held_only) {
            return forward;
        }
        let f = self.counters.entry(ask.counter).or_default();
        f.end(ask.counter, Some(ask.fingerprint), now, returns, &self.gate);
        if !ask.held_only {
            f.last_seen = now;
            f.meter.record(now, ask.cost, ask.weight.max(1));
        }
        let (checks, units) = f.meter.rate(now);
        // The lease that ends first, of those that cover the cost.
        let first = (0..f.leases.len())
            .filter(|&i| f.leases[i].left >= ask.cost)
            .min_by_key(|&i| f.leases[i].until);
        let leased = first.map(|i| {
            f.leases[i].left -= ask.cost;
            let (numbers, owner) = (f.leases[i].numbers, f.leases[i].owner.clone());
            let left: u64 = f.leases.iter().map(|l| l.left).sum();
            let decision = Decision {
                allowed: true,
                retry_after_ms: 0,
                delay_ms: 0,
                // Never more than the owner had when it charged the lease, nor than
                // this node still holds.
                remaining: left.min(numbers.remaining),
                ..numbers
            };
            (decision, owner)
        });
        let wanted = if ask.held_only {
            false
        } else if leased.is_some() {
            f.running_out(now)
        } else {
            checks >= self.threshold
        };
        let in_flight = f
            .asking
            .is_some_and(|at| now.saturating_sub(at) < ASK_TIMEOUT_MS);
        let ask_now = wanted && !in_flight && now >= f.quiet_until;
        if ask_now {
            f.asking = Some(now);
        }
        Step {
            leased,
            ask: ask_now.then_some(units.max(1)),
        }
    }

    /// The owner's answer to this node's request for a lease of `counter`.
    pub fn hold(&mut self, counter: KeyId, lease: Option<HeldLease>, now: Millis) {
        let Some(f) = self.counters.get_mut(&counter) else {
            // Forgotten meanwhile (the table was swept): a lease still counts.
            if let Some(lease) = lease {
                self.gate.hold(counter);
                self.counters.insert(
                    counter,
                    Followed {
                        leases: smallvec::smallvec![lease],
                        last_seen: now,
                        ..Followed::default()
                    },
                );
            }
            return;
        };
        f.asking = None;
        match lease {
            Some(lease) => {
                self.gate.hold(counter);
                f.leases.push(lease);
            }
            None => f.quiet_until = now.saturating_add(QUIET_MS),
        }
    }

    /// The expiry tick: return ended leases, forget idle counters.
    pub fn expire(&mut self, now: Millis, returns: &mut Vec<Returned>) {
        let gate = &self.gate;
        self.counters.retain(|&counter, f| {
            f.end(counter, None, now, returns, gate);
            let asking = f
                .asking
                .is_some_and(|at| now.saturating_sub(at) < ASK_TIMEOUT_MS);
            !f.leases.is_empty() || asking || f.last_seen.saturating_add(IDLE_MS) > now
        });
    }
}
