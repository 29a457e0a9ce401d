//! Reservations through the router: a `Reserve` goes to its key's owner (one hop, like a
//! check) and a `Commit` to the current owner of the reservation's key, which applies it
//! to its own record or, if another node made the reservation, as a commit of a moved
//! key. What is decided is the shard's (`shard::reservations`); this file only finds the
//! owner, asks it, and names the answers. An unreachable owner is an error, never a
//! fail-open answer: a reservation lives on its owner, and nowhere else could make one.

use crate::cluster::policy;
use crate::cluster::reservation::{Committed, Hold, Reservation, ReservationError, ReservationId};
use crate::cluster::CheckItem;
use crate::config::rules::RuleSet;
use crate::shard::reservations::{Claim, Op, Reply, Target};

use super::Router;

impl Router {
    /// Reserve `item.cost` units of `item`'s counter for `ttl_ms` (or, for a
    /// [`Hold::Lease`], acquire a lease of it), on the key's owner.
    pub async fn reserve(
        &self,
        item: &CheckItem,
        ttl_ms: u64,
        hold: Hold,
    ) -> Result<Reservation, ReservationError> {
        let view = self.view();
        let owner = view
            .owner_of_placement(item.id.placement)
            .ok_or(ReservationError::NoOwner)?;
        if owner.node_id == *self.me.node_id {
            return self.reserve_here(item, ttl_ms, hold).await;
        }
        self.metrics.forwarded.increment(1);
        let (remote, id) = self.peers.reserve(owner, item, ttl_ms, hold).await?;
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
        hold: Hold,
    ) -> Result<Reservation, ReservationError> {
        if !self.restore.is_done() {
            // Restarted, its counters not restored from their successors yet: not an
            // owner that may admit (the caller gets UNAVAILABLE and may retry).
            return Err(crate::shard::ShardError::Restoring.into());
        }
        let charge = item.charge();
        let op = match hold {
            Hold::Reservation => Op::Reserve {
                charge: charge.clone(),
                ttl_ms,
            },
            Hold::Lease => Op::Acquire {
                charge: charge.clone(),
                ttl_ms,
            },
        };
        let (Reply::Reserved(opened) | Reply::Acquired(opened)) =
            self.shards.reservation(item.id.placement, op).await?
        else {
            unreachable!("a reserve or acquire op is answered as one");
        };
        let opened = opened.map_err(|full| ReservationError::Full(full.to_string()))?;
        let o = opened.outcome;
        let answer = policy::local_answer(item, &self.me, o.decision, o.sequence, o.at, charge);
        let id = opened.reservation.map(|(ticket, expires_at)| {
            let id = ReservationId {
                hold,
                owner: self.me.node_id.to_string(),
                generation: self.me.generation,
                rule: item.rule.name.to_string(),
                ticket,
                claim: match hold {
                    Hold::Reservation => Claim {
                        counter: item.id,
                        fingerprint: item.rule.fingerprint,
                        amount: item.cost.get(),
                        expires_at,
                    },
                    // What a lease's tag covers: the counter and the expiry.
                    Hold::Lease => Claim {
                        counter: item.id,
                        fingerprint: 0,
                        amount: 1,
                        expires_at,
                    },
                },
            };
            (id.encode(), expires_at)
        });
        Ok(Reservation { answer, id })
    }

    /// Commit reservation `id` with `actual` units (or release lease `id`), on the
    /// current owner of its key.
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
            .filter(|r| id.hold == Hold::Lease || r.fingerprint == id.claim.fingerprint)
            .cloned();
        let name = rule.as_ref().map_or(String::new(), |r| r.name.to_string());
        let op = match id.hold {
            Hold::Reservation => Op::Commit {
                target,
                claim: id.claim,
                actual,
                rule,
            },
            Hold::Lease => Op::Release {
                target,
                claim: id.claim,
                rule,
            },
        };
        let settled = match self.shards.reservation(id.placement(), op).await? {
            Reply::Committed(settled) => settled.map_err(|r| r.to_string()),
            Reply::Released(settled) => settled.map_err(|r| r.to_string()),
            _ => unreachable!("a commit or release op is answered as one"),
        };
        let settled = settled.map_err(ReservationError::Refused)?;
        Ok(Committed {
            settled,
            decider: self.me.clone(),
            rule: name,
        })
    }
}
