//! Budget leases through the router (`docs/leases.md`).
//!
//! As an entry: before a check of a remote key is forwarded, the shard of its key is
//! asked whether a lease held here covers it ([`Router::spend_leases`]); if so it is
//! answered here without a hop, and otherwise forwarded as before. When the shard says
//! the counter is hot (or its lease runs low), a request for a lease goes to the owner
//! in the background and its answer is handed to the same shard: the caller never
//! waits for a lease. As an owner: grant (charge) and take back, on the counter's shard
//! ([`Router::lease_here`], [`Router::return_lease_here`]).

use std::sync::Arc;

use crate::cluster::budget::{self, LeaseGrant};
use crate::cluster::flight::Flight;
use crate::cluster::CheckItem;
use crate::membership::Member;
use crate::shard::budget::GrantAsk;
use crate::shard::{KeyId, ShardError};

use super::Router;

impl Router {
    /// This router deciding checks of hot remote counters from budget leases it asks
    /// their owners for (the shards ask only when their threshold is above 0).
    pub fn with_budget_leases(mut self, on: bool) -> Self {
        self.budget_leases = on;
        self
    }

    /// Answer what leases held here cover among `plan`'s remote descriptors, taking
    /// them out of `plan.remote`, and among its deny-cache answers (a lease granted
    /// after the denial is budget to spend); ask owners for leases where the shards
    /// say so.
    pub(super) async fn spend_leases(&self, flight: &mut Flight) -> Result<(), ShardError> {
        if !self.budget_leases {
            return Ok(());
        }
        let now = flight.now();
        for candidate in flight.lease_candidates() {
            let item = flight.item(candidate.position);
            // `None`: a check the deny cache answered (spend only, no rate, no request).
            let owner = flight.candidate_owner(&candidate);
            let gate = self.shards.lease_gate();
            let Some(spend) = budget::spend_ask(item, candidate.single, owner.is_none(), gate)
            else {
                // Forwarded without a round trip to the shard, or the cached answer
                // stands.
                continue;
            };
            let step = match self.shards.spend(spend).await {
                Ok(step) => step,
                // A busy shard: decided as without leases.
                Err(ShardError::Overloaded(_)) => continue,
                Err(e) => return Err(e),
            };
            let (answer, ask) = budget::spent(item, step, now.wall);
            if let (Some(rate), Some(owner)) = (ask, owner) {
                self.ask_lease(owner, item, rate, now.wall);
            }
            if let Some(answer) = answer {
                flight.leased(candidate.position, answer);
            }
        }
        Ok(())
    }

    /// Ask `owner` for a lease of `item`'s counter in the background; its answer (or
    /// none, if it fails) goes to the counter's shard.
    fn ask_lease(
        &self,
        owner: &Member,
        item: &CheckItem,
        rate: u64,
        sent: crate::algorithms::Millis,
    ) {
        let (peers, shards, owner, item) = (
            self.peers.clone(),
            self.shards.clone(),
            owner.clone(),
            item.clone(),
        );
        tokio::spawn(async move {
            let lease = match peers.lease(&owner, &item, rate).await {
                Ok(grant) => grant.held(&item, sent),
                Err(error) => {
                    tracing::debug!(%error, key = %item.client(), "no lease: its owner did not answer");
                    None
                }
            };
            // Only a stopping node fails this: the lease's units are then lost.
            let _ = shards.hold(item.id, lease).await;
        });
    }

    /// Grant (or refuse) `holder` a lease of `item`'s counter on this node's shard,
    /// whoever owns the key (the peer face answers as the owner it was asked as; a
    /// lease request is never sent on).
    pub async fn lease_here(
        &self,
        item: &CheckItem,
        holder: Arc<str>,
        rate: u64,
    ) -> Result<LeaseGrant, ShardError> {
        if !self.restore.is_done() {
            return Err(ShardError::Restoring);
        }
        let reply = self
            .shards
            .grant(GrantAsk {
                charge: item.charge(),
                holder,
                rate,
                label: (Arc::from(item.client()), Arc::from(item.route())),
            })
            .await?;
        Ok(LeaseGrant::of(reply, self.me.clone()))
    }

    /// Take back `unused` units of lease `serial` of `counter`, which this node granted
    /// to `holder` in generation `generation`; answers the units given back (0 for a
    /// lease of another generation of this node, or one it has no record of).
    pub async fn return_lease_here(
        &self,
        holder: Arc<str>,
        generation: u64,
        serial: u64,
        counter: KeyId,
        unused: u64,
    ) -> Result<u64, ShardError> {
        if generation != self.me.generation {
            return Ok(0);
        }
        self.shards
            .return_lease(holder, serial, counter, unused)
            .await
    }
}
