//! Budget leases, the owner's side: slices of a hot counter's budget charged on the
//! owner at once and lent to an entry node, which decides checks of that counter from
//! them without a hop (`docs/leases.md`). Not the concurrency leases of `concurrency.rs`
//! (places in flight, `Acquire`/`Release`): a budget lease holds *units of a rate*.
//!
//! Exact because a lease is budget the owner has already charged: granting `n` units
//! is one check of cost `n` on the counter, in the shard's single-threaded step, so
//! every unit an entry spends was admitted by the owner first, and no lease adds a
//! decider. What comes back (a holder's unused units) is a refund of that admission,
//! never more than it charged, and once per lease. Pure: no clock, no I/O.
//! [`BudgetCore`] is both sides of one shard in one step (the shard actor and the
//! simulator drive it); the actor's glue is at the end of the file, the entry's side
//! in [`entry`].
//!
//! Sizing ([`size`]): a holder asks with its recent rate; it gets enough for one TTL at
//! that rate, but never more than half of its share of what remains (shares in
//! proportion to the rates of the counter's active holders), and nothing below a floor:
//! a counter near empty is decided by its owner again, where its last units are scarce.

pub mod entry;
pub mod gate;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::oneshot;

use crate::algorithms::{Decision, Millis};
use crate::config::rules::Rule;

use super::{Charge, Churn, KeyId, ShardCore, ShardError, Shards, Store};

/// How long after its end the owner still takes a lease's unused units back: a
/// return sent at the holder's expiry tick is a round trip late.
pub const RETURN_GRACE_MS: u64 = 2_000;

/// The default `--lease-threshold`: an entry node asks for a lease of a remote counter
/// it sees 100 times a second or more. Chosen by measurement (docs/leases.md,
/// *Choosing the threshold*): a whale through a non-owner then reaches its owner with
/// 0.3 % of its checks, and a counter that is never hot pays the shard round trip for
/// one check in 6 (the gate's sampling).
pub const DEFAULT_LEASE_THRESHOLD: u64 = 100;

/// No lease shorter than this: near a window's end the owner decides the checks.
pub const MIN_LEASE_MS: u64 = 50;

/// Most grants one shard keeps a record of; past it, no new lease (checks are
/// forwarded as without leases).
pub const MAX_GRANTS_PER_SHARD: usize = 16_384;

/// The owner's lease settings (`--lease-ttl-ms`, `--lease-floor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeasePolicy {
    /// How long a lease lasts at most (a window's end may end it sooner).
    pub ttl_ms: u64,
    /// Fewest units worth a lease: below it, no lease.
    pub floor: u64,
}

impl Default for LeasePolicy {
    fn default() -> Self {
        Self {
            ttl_ms: 1_000,
            floor: 2,
        }
    }
}

/// An entry node's request for a lease of one counter.
#[derive(Debug, Clone)]
pub struct GrantAsk {
    /// The counter, planned on the owner like a forwarded check (its cost unused).
    pub charge: Charge,
    /// The asking member's node id.
    pub holder: Arc<str>,
    /// Units per second the holder decided or forwarded for this counter lately.
    pub rate: u64,
    /// The counter's client key and the route it was checked with, for the ledger
    /// line ([`LEDGER`]).
    pub label: (Arc<str>, Arc<str>),
}

/// The tracing target of the owner's ledger: one `debug` line per lease granted and per
/// return that gave units back, each with the shard's sequence number of its step, so
/// an outside observer (the chaos suite's S4 checker) can tell, for any answer of this
/// node, how many units were lent and not returned before it. Off at the default log
/// level; `RUST_LOG=info,ringlimit::lease_ledger=debug` turns it on.
pub const LEDGER: &str = "ringlimit::lease_ledger";

/// A lease the owner granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granted {
    /// Names the lease within its shard (and, with the owner's generation, its node).
    pub serial: u64,
    /// Units charged for the holder.
    pub units: u64,
    /// How long the holder may spend them, from when it asked.
    pub ttl_ms: u64,
}

/// The owner's answer to a [`GrantAsk`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantReply {
    /// The lease, if one was granted.
    pub lease: Option<Granted>,
    /// The counter's numbers after the grant's charge (or as they are, without one).
    pub decision: Decision,
    /// This node's sequence number for a grant (0 without one).
    pub sequence: u64,
    /// The owner's clock.
    pub at: Millis,
    /// What this grant was, for the owner's metrics.
    pub event: GrantEvent,
}

/// How a request for a lease ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantEvent {
    /// A first lease of the counter for this holder.
    Granted,
    /// A lease for a holder that still held one of the counter.
    Renewed,
    /// No lease: the algorithm or rule does not lease, the window ends too soon, the
    /// remaining budget is under the floor, or the shard's table is full.
    Refused,
}

/// One lease the owner granted and has not had back.
#[derive(Debug, Clone)]
struct Grant {
    counter: KeyId,
    rule: Arc<Rule>,
    holder: Arc<str>,
    units: u64,
    rate: u64,
    at: Millis,
    until: Millis,
}

/// The units to lend a holder of rate `rate` (units/s) that wants `want`, when
/// `remaining` units are left and the counter's other active holders ask at `others`
/// units/s together: `want`, capped at half of the holder's share of `remaining`; 0
/// below `floor`. Halving keeps budget for the owner's own checks and the next grant,
/// and makes grants shrink geometrically as the budget runs out.
///
/// ```
/// use ringlimit::shard::budget::size;
/// assert_eq!(size(3_000, 500, 500, 500, 2), 500);
/// assert_eq!(size(1_000, 500, 500, 500, 2), 250, "half of a half share");
/// assert_eq!(size(7, 500, 500, 500, 2), 0, "under the floor");
/// ```
pub fn size(remaining: u64, want: u64, rate: u64, others: u64, floor: u64) -> u64 {
    let rate = u128::from(rate.max(1));
    let share = u128::from(remaining) * rate / (rate + u128::from(others));
    let units = u128::from(want).min(share / 2) as u64;
    if units < floor.max(1) {
        0
    } else {
        units
    }
}

/// The budget leases one shard granted, by serial.
#[derive(Debug, Default)]
pub struct BudgetLeases {
    grants: HashMap<u64, Grant>,
    next: u64,
}

impl BudgetLeases {
    /// Leases granted and not yet returned or forgotten.
    pub fn len(&self) -> usize {
        self.grants.len()
    }

    /// Whether none is open.
    pub fn is_empty(&self) -> bool {
        self.grants.is_empty()
    }

    /// Grant `ask` a lease at `now`, charging its units on `store` in this step.
    /// `sequence` numbers the grant as a decision of this node.
    pub fn grant(
        &mut self,
        store: &mut Store,
        ask: &GrantAsk,
        policy: &LeasePolicy,
        now: Millis,
        sequence: impl FnOnce() -> u64,
    ) -> (GrantReply, Churn) {
        let counter = ask.charge.counter();
        let rule = &ask.charge.rule;
        let peek = store.peek(counter, now);
        let refused = |decision| GrantReply {
            lease: None,
            decision,
            sequence: 0,
            at: now,
            event: GrantEvent::Refused,
        };
        let until = rule.limiter.lease_until(peek.window_id, now, policy.ttl_ms);
        let leasable = rule.lease
            && !rule.shadow
            && !counter.local
            && self.grants.len() < MAX_GRANTS_PER_SHARD;
        let Some(until) = until.filter(|&u| leasable && u >= now.saturating_add(MIN_LEASE_MS))
        else {
            return (refused(peek), Churn::default());
        };
        // Each other active holder's newest rate (a holder renewing holds two leases).
        let mut holders: smallvec::SmallVec<[(Arc<str>, u64, u64); 4]> = smallvec::SmallVec::new();
        for (&serial, g) in &self.grants {
            if g.counter != counter.id || g.until <= now {
                continue;
            }
            match holders.iter_mut().find(|(h, _, _)| *h == g.holder) {
                Some(newest) if newest.1 < serial => *newest = (g.holder.clone(), serial, g.rate),
                Some(_) => {}
                None => holders.push((g.holder.clone(), serial, g.rate)),
            }
        }
        let renewed = holders.iter().any(|(h, _, _)| *h == ask.holder);
        let others = holders
            .iter()
            .filter(|(h, _, _)| *h != ask.holder)
            .fold(0u64, |sum, (_, _, rate)| sum.saturating_add(*rate));
        let want = ask
            .rate
            .saturating_mul(until - now)
            .div_ceil(1_000)
            .max(policy.floor);
        let Some(units) =
            NonZeroU64::new(size(peek.remaining, want, ask.rate, others, policy.floor))
        else {
            return (refused(peek), Churn::default());
        };
        let (decision, churn, _) = store.check(counter, now, units);
        if !decision.allowed {
            // Not expected (`units` fit what the peek said): lend nothing.
            return (refused(decision), churn);
        }
        self.next += 1;
        let serial = self.next;
        self.grants.insert(
            serial,
            Grant {
                counter: counter.id,
                rule: rule.clone(),
                holder: ask.holder.clone(),
                units: units.get(),
                rate: ask.rate,
                at: now,
                until,
            },
        );
        let reply = GrantReply {
            lease: Some(Granted {
                serial,
                units: units.get(),
                ttl_ms: until - now,
            }),
            decision,
            sequence: sequence(),
            at: now,
            event: if renewed {
                GrantEvent::Renewed
            } else {
                GrantEvent::Granted
            },
        };
        (reply, churn)
    }

    /// Take back up to `unused` units of lease `serial` of counter `counter`, granted to
    /// `holder`; returns the units given back to the counter (0 for a lease this shard
    /// has no record of: already returned, forgotten after its grace, or another
    /// holder's). The record goes, so a second return gives nothing back.
    pub fn give_back(
        &mut self,
        store: &mut Store,
        holder: &str,
        serial: u64,
        counter: KeyId,
        unused: u64,
    ) -> u64 {
        let ours = self
            .grants
            .get(&serial)
            .is_some_and(|g| &*g.holder == holder && g.counter == counter);
        if !ours {
            return 0;
        }
        let grant = self.grants.remove(&serial).expect("found above");
        let units = unused.min(grant.units);
        if let Some(n) = NonZeroU64::new(units) {
            let counter = super::Counter {
                id: grant.counter,
                fingerprint: grant.rule.fingerprint,
                limiter: &grant.rule.limiter,
                local: false,
            };
            // A refund of the grant's own admission, at its instant: never more than it
            // charged, and nothing once its window has gone (fixed window).
            store.refund(counter, grant.at, n);
        }
        units
    }

    /// Forget leases whose holder did not return them within [`RETURN_GRACE_MS`] of
    /// their end (the holder died or is cut off: its unused units stay charged).
    /// Returns how many.
    pub fn expire(&mut self, now: Millis) -> u64 {
        let before = self.grants.len();
        self.grants
            .retain(|_, g| g.until.saturating_add(RETURN_GRACE_MS) > now);
        (before - self.grants.len()) as u64
    }

    /// The counter a lease charged, for replication's promote and changed hooks.
    fn charged(&self, serial: u64) -> Option<Charge> {
        self.grants.get(&serial).map(|g| Charge {
            id: g.counter,
            rule: g.rule.clone(),
            cost: NonZeroU64::MIN,
            give_back: None,
            drain: false,
            peek: false,
            target: Default::default(),
        })
    }
}

// ---- the actor's side ------------------------------------------------------------------

/// A budget-lease message of a shard's inbox.
#[derive(Debug)]
pub enum Command {
    /// Owner: grant a lease (or not).
    Grant {
        /// The request (boxed, like `Hold`'s lease: see [`Command`]'s size test).
        ask: Box<GrantAsk>,
        /// Where the answer goes.
        reply: oneshot::Sender<GrantReply>,
    },
    /// Owner: a holder's unused units of a lease.
    Return {
        /// The holder that returns them.
        holder: Arc<str>,
        /// Which lease.
        serial: u64,
        /// Its counter.
        counter: KeyId,
        /// Units it did not spend.
        unused: u64,
        /// How many were given back to the counter.
        reply: Option<oneshot::Sender<u64>>,
    },
    /// Entry: decide a check of a remote key from a held lease if one covers it.
    Spend {
        /// The check's counter, its rule's fingerprint and its cost.
        spend: entry::SpendAsk,
        /// The step's answer.
        reply: oneshot::Sender<entry::Step>,
    },
    /// Entry: the owner's answer to this node's request for a lease.
    Hold {
        /// The counter asked for.
        counter: KeyId,
        /// The lease, or `None` (refused, or the request failed). Boxed: inline it
        /// made every inbox message 152 bytes instead of 96, and a check's future
        /// carries one (its refund's send) whether or not leases are on.
        lease: Option<Box<entry::HeldLease>>,
    },
}

/// One shard's budget leases, both sides, as a pure step: the owner's grants and the
/// entry's held leases, and how each message changes them and the shard's counters.
/// The shard actor drives it (with metrics, the ledger and replies around it), and so
/// does the simulator, so both run one implementation of every lease decision.
#[derive(Debug)]
pub struct BudgetCore {
    /// What this shard lent as the counters' owner.
    pub owner: BudgetLeases,
    /// What this shard holds as an entry node, and the rates it sees.
    pub entry: entry::EntryLeases,
    /// How this node grants.
    pub policy: LeasePolicy,
}

impl BudgetCore {
    /// An empty core that asks for leases of counters seen `threshold` times a second
    /// (0: never), counting held leases in `gate`, and grants by `policy`.
    pub fn new(threshold: u64, gate: Arc<gate::LeaseGate>, policy: LeasePolicy) -> Self {
        Self {
            owner: BudgetLeases::default(),
            entry: entry::EntryLeases::with_gate(threshold, gate),
            policy,
        }
    }

    /// Owner: grant `ask` a lease at `now`, charging its units as a check of the
    /// counter runs on `core` (replica promoted first, the change replicated after).
    pub fn grant(
        &mut self,
        core: &mut ShardCore,
        ask: &GrantAsk,
        now: Millis,
        sequence: impl FnOnce() -> u64,
    ) -> (GrantReply, Churn) {
        let (owner, policy) = (&mut self.owner, &self.policy);
        let ((reply, c), mut churn) = core.step_live(Some(&ask.charge), now, |store| {
            owner.grant(store, ask, policy, now, sequence)
        });
        churn += c;
        (reply, churn)
    }

    /// Owner: take back `unused` units of lease `serial` of `counter` from `holder`;
    /// the units given back to the counter.
    pub fn give_back(
        &mut self,
        core: &mut ShardCore,
        holder: &str,
        serial: u64,
        counter: KeyId,
        unused: u64,
        now: Millis,
    ) -> (u64, Churn) {
        let charged = self.owner.charged(serial);
        let owner = &mut self.owner;
        core.step_live(charged.as_ref(), now, |store| {
            owner.give_back(store, holder, serial, counter, unused)
        })
    }

    /// The expiry tick: forget grants past their grace (how many), and put the unused
    /// units of held leases that ended in `returns`.
    pub fn expire(&mut self, now: Millis, returns: &mut Vec<entry::Returned>) -> u64 {
        let forgotten = self.owner.expire(now);
        self.entry.expire(now, returns);
        forgotten
    }
}

/// One shard's budget leases and the actor's glue around them: metrics and where
/// returns go.
pub(super) struct BudgetShard {
    pub(super) core: BudgetCore,
    /// Where expired leases' unused units go to be returned to their owners.
    pub(super) returns: Option<tokio::sync::mpsc::Sender<Vec<entry::Returned>>>,
    metrics: BudgetMetrics,
}

struct BudgetMetrics {
    granted: metrics::Counter,
    renewed: metrics::Counter,
    refused: metrics::Counter,
    returned: metrics::Counter,
    expired: metrics::Counter,
    from_lease: metrics::Counter,
    units_returned: metrics::Counter,
}

impl BudgetShard {
    pub(super) fn new(config: &super::ShardConfig, gate: Arc<gate::LeaseGate>) -> Self {
        let event =
            |e: &'static str| metrics::counter!("ringlimit_budget_leases_total", "event" => e);
        Self {
            core: BudgetCore::new(config.lease_threshold, gate, config.lease_policy),
            returns: config.lease_returns.clone(),
            metrics: BudgetMetrics {
                granted: event("granted"),
                renewed: event("renewed"),
                refused: event("refused"),
                returned: event("returned"),
                expired: event("expired"),
                from_lease: metrics::counter!("ringlimit_checks_from_lease_total"),
                units_returned: metrics::counter!("ringlimit_budget_lease_units_returned_total"),
            },
        }
    }
}

impl super::Actor {
    /// One budget-lease message in the actor's step at `now`.
    pub(super) fn budget(&mut self, command: Command, now: Millis) {
        match command {
            Command::Grant { ask, reply } => {
                let sequence = &self.sequence;
                let (answer, churn) = self.budget.core.grant(&mut self.core, &ask, now, || {
                    sequence.fetch_add(1, Ordering::Relaxed) + 1
                });
                if let Some(lease) = answer.lease {
                    tracing::debug!(
                        target: LEDGER,
                        event = "grant",
                        key = ?ask.label.0,
                        route = ?ask.label.1,
                        rule = ?ask.charge.rule.name,
                        counter = ask.charge.id.disc,
                        holder = ?ask.holder,
                        serial = lease.serial,
                        units = lease.units,
                        window = answer.decision.window_id,
                        sequence = answer.sequence,
                        "lease ledger"
                    );
                }
                match answer.event {
                    GrantEvent::Granted => self.budget.metrics.granted.increment(1),
                    GrantEvent::Renewed => self.budget.metrics.renewed.increment(1),
                    GrantEvent::Refused => self.budget.metrics.refused.increment(1),
                }
                self.record_churn(churn);
                let _ = reply.send(answer);
            }
            Command::Return {
                holder,
                serial,
                counter,
                unused,
                reply,
            } => {
                let (units, churn) = self.budget.core.give_back(
                    &mut self.core,
                    &holder,
                    serial,
                    counter,
                    unused,
                    now,
                );
                if units > 0 {
                    // Ordered among this node's decisions like one (the grant's window
                    // is on its grant's line).
                    let sequence = self.sequence.fetch_add(1, Ordering::Relaxed) + 1;
                    tracing::debug!(
                        target: LEDGER,
                        event = "return",
                        counter = counter.disc,
                        holder = ?holder,
                        serial,
                        units,
                        sequence,
                        "lease ledger"
                    );
                }
                self.budget.metrics.returned.increment(1);
                self.budget.metrics.units_returned.increment(units);
                self.record_churn(churn);
                if let Some(reply) = reply {
                    let _ = reply.send(units);
                }
            }
            Command::Spend { spend, reply } => {
                let mut returns = Vec::new();
                let step = self.budget.core.entry.spend(&spend, now, &mut returns);
                if step.leased.is_some() {
                    self.budget.metrics.from_lease.increment(1);
                }
                self.budget.send_returns(returns);
                let _ = reply.send(step);
            }
            Command::Hold { counter, lease } => {
                self.budget
                    .core
                    .entry
                    .hold(counter, lease.map(|lease| *lease), now)
            }
        }
    }

    /// The expiry tick's part: forget grants past their grace; return the unused
    /// units of held leases that ended.
    pub(super) fn expire_budget(&mut self, now: Millis) {
        let mut returns = Vec::new();
        let forgotten = self.budget.core.expire(now, &mut returns);
        self.budget.metrics.expired.increment(forgotten);
        self.budget.send_returns(returns);
    }
}

impl BudgetShard {
    /// Hand returns to the node's returner; a full queue loses them (the units stay
    /// charged on the owner: an under-admission, never an over-admission).
    fn send_returns(&self, returns: Vec<entry::Returned>) {
        if returns.is_empty() {
            return;
        }
        if let Some(tx) = &self.returns {
            let _ = tx.try_send(returns);
        }
    }
}

impl Shards {
    /// Ask the owner's shard for a lease of `ask`'s counter.
    pub async fn grant(&self, ask: GrantAsk) -> Result<GrantReply, ShardError> {
        let shard = self.shard_of_placement(ask.charge.id.placement);
        let (reply, rx) = oneshot::channel();
        let ask = Box::new(ask);
        self.try_budget(shard, Command::Grant { ask, reply })?;
        rx.await.map_err(|_| ShardError::Stopped(shard))
    }

    /// Give back `unused` units of lease `serial` of `counter` held by `holder`;
    /// answers how many went back to the counter. Waits for room: a return is not lost
    /// to a momentarily full inbox.
    pub async fn return_lease(
        &self,
        holder: Arc<str>,
        serial: u64,
        counter: KeyId,
        unused: u64,
    ) -> Result<u64, ShardError> {
        let shard = self.shard_of_placement(counter.placement);
        let (reply, rx) = oneshot::channel();
        let command = Command::Return {
            holder,
            serial,
            counter,
            unused,
            reply: Some(reply),
        };
        self.inboxes[shard]
            .send(super::Command::Budget(command))
            .await
            .map_err(|_| ShardError::Stopped(shard))?;
        rx.await.map_err(|_| ShardError::Stopped(shard))
    }

    /// Entry: which checks of remote counters go to [`Shards::spend`] (the rest are
    /// forwarded without a round trip to a shard).
    pub fn lease_gate(&self) -> &gate::LeaseGate {
        &self.gate
    }

    /// Entry: decide a check of a remote counter from a lease held here, if one covers
    /// it; says whether to ask the owner for a lease.
    pub async fn spend(&self, spend: entry::SpendAsk) -> Result<entry::Step, ShardError> {
        let shard = self.shard_of_placement(spend.counter.placement);
        let (reply, rx) = oneshot::channel();
        self.try_budget(shard, Command::Spend { spend, reply })?;
        rx.await.map_err(|_| ShardError::Stopped(shard))
    }

    /// Entry: keep the lease the owner granted (or note that it granted none). Waits
    /// for room: a lease dropped here would be units lost.
    pub async fn hold(
        &self,
        counter: KeyId,
        lease: Option<entry::HeldLease>,
    ) -> Result<(), ShardError> {
        let shard = self.shard_of_placement(counter.placement);
        self.inboxes[shard]
            .send(super::Command::Budget(Command::Hold {
                counter,
                lease: lease.map(Box::new),
            }))
            .await
            .map_err(|_| ShardError::Stopped(shard))
    }

    fn try_budget(&self, shard: usize, command: Command) -> Result<(), ShardError> {
        self.inboxes[shard]
            .try_send(super::Command::Budget(command))
            .map_err(|e| match e {
                tokio::sync::mpsc::error::TrySendError::Full(_) => ShardError::Overloaded(shard),
                tokio::sync::mpsc::error::TrySendError::Closed(_) => ShardError::Stopped(shard),
            })
    }
}
