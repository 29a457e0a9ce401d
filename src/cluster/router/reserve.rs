//! Reservations through the router: a `Reserve` goes to its key's owner (one hop, like a
//! check) and a `Commit` to the current owner of the reservation's key, which applies it
//! to its own record or, if another node made the reservation, as a commit of a moved
//! key. What is decided is the shard's (`shard::reservations`); this file only finds the
//! owner, asks it, and names the answers. An unreachable owner is an error, never a
//! fail-open answer: a reservation lives on its owner, and nowhere else could make one.

use crate::cluster::policy;
use crate::cluster::reservation::{Committed, Reservation, ReservationError, ReservationId};
use crate::cluster::CheckItem;
use crate::config::rules::RuleSet;
use crate::shard::reservations::{Claim, Op, Reply, Target};

use super::Router;

impl Router {
    /// Reserve `item.cost` units of `item`'s counter for `ttl_ms`, on the key's owner.
    pub async fn reserve(
        &self,
        item: &CheckItem,
        ttl_ms: u64,
    ) -> Result<Reservation, ReservationError> {
        let view = self.view();
        let owner = view
            .owner_of_placement(item.id.placement)
            .ok_or(ReservationError::NoOwner)?;
        if owner.node_id == *self.me.node_id {
            return self.reserve_here(item, ttl_ms).await;
        }
        self.metrics.forwarded.increment(1);
        let (remote, id) = self.peers.reserve(owner, item, ttl_ms).await?;
        Ok(Reservation {
            answer: policy::remote_answer(item, remote, owner),
            id,
        })
    }

    /// Reserve on this node's shard, whoever owns the key (the peer face answers as the
    /// owner it was asked as; a forwarded reservation is never sent on).
    pub async fn reserve_here(
        &self,
        item: &CheckItem,
        ttl_ms: u64,
    ) -> Result<Reservation, ReservationError> {
        if !self.restore.is_done() {
            // Restarted, its counters not restored from their successors yet: not an
            // owner that may admit (the caller gets UNAVAILABLE and may retry).
            return Err(crate::shard::ShardError::Restoring.into());
        }
        let charge = item.charge();
        let op = Op::Reserve {
            charge: charge.clone(),
            ttl_ms,
        };
        let Reply::Reserved(opened) = self.shards.reservation(item.id.placement, op).await? else {
            unreachable!("a reserve op is answered as one");
        };
        let opened = opened.map_err(|full| ReservationError::Full(full.to_string()))?;
        let o = opened.outcome;
        let answer = policy::local_answer(item, &self.me, o.decision, o.sequence, o.at, charge);
        let id = opened.reservation.map(|(ticket, expires_at)| {
            let id = ReservationId {
                owner: self.me.node_id.to_string(),
                generation: self.me.generation,
                rule: item.rule.name.to_string(),
                ticket,
                claim: Claim {
                    counter: item.id,
                    fingerprint: item.rule.fingerprint,
                    amount: item.cost.get(),
                    expires_at,
                },
            };
            (id.encode(), expires_at)
        });
        Ok(Reservation { answer, id })
    }

    /// Commit reservation `id` with `actual` units, on the current owner of its key.
    pub async fn commit(
        &self,
        rules: &RuleSet,
        id: &ReservationId,
        actual: u64,
    ) -> Result<Committed, ReservationError> {
        // Units given back may end a denial this node cached.
        self.deny.forget(&id.claim.counter);
        let view = self.view();
        let owner = view
            .owner_of_placement(id.placement())
            .ok_or(ReservationError::NoOwner)?;
        if owner.node_id == *self.me.node_id {
            return self.commit_here(rules, id, actual).await;
        }
        self.metrics.forwarded.increment(1);
        self.peers.commit(owner, &id.encode(), actual).await
    }

    /// Commit on this node: on its own record when it made the reservation, else as a
    /// commit of a moved key. Never sent on.
    pub async fn commit_here(
        &self,
        rules: &RuleSet,
        id: &ReservationId,
        actual: u64,
    ) -> Result<Committed, ReservationError> {
        let target = if id.made_by(&self.me) {
            Target::Own(id.ticket)
        } else {
            Target::Moved(id.hash())
        };
        // The counter is touched only under the numbers it was charged under.
        let rule = rules
            .get(&id.rule)
            .filter(|r| r.fingerprint == id.claim.fingerprint)
            .cloned();
        let name = rule.as_ref().map_or(String::new(), |r| r.name.to_string());
        let op = Op::Commit {
            target,
            claim: id.claim,
            actual,
            rule,
        };
        let Reply::Committed(settled) = self.shards.reservation(id.placement(), op).await? else {
            unreachable!("a commit op is answered as one");
        };
        let settled = settled.map_err(|refused| ReservationError::Refused(refused.to_string()))?;
        Ok(Committed {
            settled,
            decider: self.me.clone(),
            rule: name,
        })
    }
}
