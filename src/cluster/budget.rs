//! Budget leases in the cluster wing (`docs/leases.md`): which checks an entry node may
//! decide from a lease it holds, the answer it gives then, a grant as the link decodes
//! it, and the task that returns ended leases' unused units to their owners. The
//! decisions themselves are the shards' (`shard::budget`); the router's part is
//! `router/budget.rs`.

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::algorithms::{Decision, Millis};
use crate::cluster::{Answer, Charged, CheckItem, Decider};
use crate::shard::budget::entry::{HeldLease, Returned, SpendAsk, Step};
use crate::shard::budget::gate::{Gated, LeaseGate};
use crate::shard::budget::GrantReply;

/// A lease (or its refusal) as the owner answered a request for one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseGrant {
    /// The owner that answered.
    pub owner: Decider,
    /// Names the lease on the owner's shard.
    pub serial: u64,
    /// Units charged for this node; 0: no lease.
    pub units: u64,
    /// How long they may be spent, from when they were asked for.
    pub ttl_ms: u64,
    /// The counter's numbers right after the charge.
    pub decision: Decision,
    /// The owner's sequence number for the grant.
    pub sequence: u64,
}

impl LeaseGrant {
    /// What owner `me` answers for its shard's `reply` (no lease: units 0).
    pub fn of(reply: GrantReply, me: Decider) -> Self {
        let lease = reply.lease.unwrap_or(crate::shard::budget::Granted {
            serial: 0,
            units: 0,
            ttl_ms: 0,
        });
        Self {
            owner: me,
            serial: lease.serial,
            units: lease.units,
            ttl_ms: lease.ttl_ms,
            decision: reply.decision,
            sequence: reply.sequence,
        }
    }

    /// The lease to hold for `item`, asked for at `sent` (this node's clock); `None`
    /// for a refusal.
    pub fn held(&self, item: &CheckItem, sent: Millis) -> Option<HeldLease> {
        (self.units > 0).then(|| HeldLease {
            owner: (self.owner.node_id.clone(), self.owner.generation),
            serial: self.serial,
            fingerprint: item.rule.fingerprint,
            granted: self.units,
            left: self.units,
            since: sent,
            until: sent.saturating_add(self.ttl_ms),
            numbers: self.decision,
        })
    }
}

/// Whether a check of `item` may be decided from a lease: a plain check of a counter,
/// one descriptor (`single`), nothing that raises or reads a budget on the owner (a
/// probe, a peek, a give-back, a drain), no fail-over, a rule that leases.
pub fn eligible(item: &CheckItem, single: bool) -> bool {
    single
        && !item.probe
        && !item.peek
        && !item.drain
        && !item.uncached
        && !item.target.is_replica()
        && item.give_back.is_none()
        && !item.rule.shadow
        && item.rule.lease
}

/// What an entry node asks its lease store about one check of `item`, a remote
/// counter, or `None` when the check goes on without it: not [`eligible`], or the
/// `gate` forwards it. `answered`: the deny cache answered it already, so only a lease
/// held here could change that (and it neither counts in the rate nor asks).
pub fn spend_ask(
    item: &CheckItem,
    single: bool,
    answered: bool,
    gate: &LeaseGate,
) -> Option<SpendAsk> {
    if !eligible(item, single) {
        return None;
    }
    let weight = match gate.route(item.id, answered) {
        Gated::Shard(weight) => weight,
        Gated::Forward => return None,
    };
    Some(SpendAsk {
        counter: item.id,
        fingerprint: item.rule.fingerprint,
        cost: item.cost.get(),
        held_only: answered,
        weight,
    })
}

/// What the lease store's `step` means for the check of `item` at `now`: its answer,
/// if a lease covered it, and the rate at which to ask the owner for a lease.
pub fn spent(item: &CheckItem, step: Step, now: Millis) -> (Option<Answer>, Option<u64>) {
    let answer = step.leased.map(|(decision, (node_id, generation))| {
        let owner = Decider {
            node_id,
            generation,
        };
        leased_answer(item, decision, owner, now)
    });
    (answer, step.ask)
}

/// The answer to `item` decided at `now` from a lease `owner` charged: allowed, with
/// the numbers the entry's lease store gave. No sequence of its own (0): the decision
/// that counted it was the owner's grant.
pub fn leased_answer(item: &CheckItem, decision: Decision, owner: Decider, now: Millis) -> Answer {
    Answer {
        decision,
        sequence: 0,
        at: now,
        decider: owner,
        degraded: false,
        hops: 0,
        rule: item.rule.name.clone(),
        algorithm: item.rule.limiter.kind(),
        charged: Charged::Lease,
    }
}

/// Return ended leases' unused units to their owners until `cancel`: each owner
/// found in the current view under the generation that granted the lease (another
/// generation has no record of it, and a gone owner has no counter to give back to:
/// those units are lost, an under-admission only). Never retried: a return whose
/// answer was lost may have been applied, and the owner takes one back only once
/// anyway.
pub async fn return_leases(
    router: Arc<super::Router>,
    mut returns: mpsc::Receiver<Vec<Returned>>,
    cancel: CancellationToken,
) {
    let lost = metrics::counter!("ringlimit_budget_lease_units_lost_total");
    loop {
        let batch = tokio::select! {
            _ = cancel.cancelled() => break,
            batch = returns.recv() => match batch {
                Some(batch) => batch,
                None => break,
            },
        };
        let view = router.view();
        for returned in batch {
            let owner = view
                .member(&returned.owner.0)
                .filter(|m| m.generation == returned.owner.1);
            let Some(owner) = owner else {
                lost.increment(returned.unused);
                continue;
            };
            if let Err(error) = router.peers().return_lease(owner, &returned).await {
                tracing::debug!(%error, "lease return not delivered; its units stay charged");
                lost.increment(returned.unused);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::policy::{self, testkit};
    use crate::cluster::{DescriptorOutcome, Items};

    #[test]
    fn only_a_plain_one_descriptor_check_is_decided_from_a_lease() {
        let item = testkit::item("whale", "GET /x", 1);
        assert!(eligible(&item, true));
        assert!(
            !eligible(&item, false),
            "a sibling could ask for its unit back"
        );
        assert!(!eligible(&item.clone().probing(true), true));
        let mut peek = item.clone();
        peek.peek = true;
        assert!(!eligible(&peek, true));
        let mut failover = item.clone();
        failover.target = crate::shard::Target::Replica(crate::shard::Doubt::Owed);
        assert!(!eligible(&failover, true));
        let mut give_back = item;
        give_back.give_back = std::num::NonZeroU64::new(3);
        assert!(!eligible(&give_back, true));
    }

    #[test]
    fn a_leased_answer_names_the_owner_and_is_never_refunded() {
        let item = testkit::item("whale", "GET /x", 1);
        let owner = testkit::decider("a");
        let answer = leased_answer(&item, testkit::decision(true, 0), owner.clone(), 5);
        assert_eq!(
            (&answer.decider, answer.hops, answer.sequence),
            (&owner, 0, 0)
        );
        let denied = testkit::item("other", "GET /x", 1);
        let mut outcomes = [
            DescriptorOutcome {
                item: item.clone(),
                answer: answer.clone(),
                refunded: false,
            },
            DescriptorOutcome {
                item: denied.clone(),
                answer: policy::local_answer(
                    &denied,
                    &testkit::decider("b"),
                    testkit::decision(false, 10),
                    1,
                    5,
                    denied.charge(),
                ),
                refunded: false,
            },
        ];
        policy::mark_refunds(&mut outcomes);
        assert!(outcomes[0].leased() && !outcomes[0].refunded);
        let checks: crate::cluster::Checks = smallvec::smallvec![Items::from_elem(item, 1)];
        let decided = policy::combine(checks, [answer]);
        assert!(policy::refunds(&decided).here.is_empty());
    }
}
