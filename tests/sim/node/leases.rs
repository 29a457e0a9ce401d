//! The simulated node's budget leases (docs/leases.md), both sides.
//!
//! Real (called): which checks may spend a lease and what the lease store's step means
//! for them (`cluster::budget::spend_ask`, `spent`), the lease store of each shard and
//! the owner's grants and returns (`shard::budget::BudgetCore`, which charges a grant
//! on the shard's real core as the shard actor does), the requests and answers on the
//! wire (`cluster::link::budget`, `server::peer::lease_response`), and the owner's
//! planning of the counter (`forwarded::plan_batch`). This file moves them: the
//! request to the owner and its answer back to the asking shard, the returns of ended
//! leases, and each grant and return into the history's ledger, as the nodes' logs
//! feed the process suite's.

use std::sync::Arc;

use ringlimit::check::forwarded;
use ringlimit::cluster::budget::{self as entry_side, LeaseGrant};
use ringlimit::cluster::flight::Flight;
use ringlimit::cluster::link::budget as wire;
use ringlimit::proto::peer::{PeerLeaseRequest, PeerLeaseResponse, PeerReturnLeaseRequest};
use ringlimit::server::peer::{forwarded_input, lease_response};
use ringlimit::shard::budget::entry::Returned;
use ringlimit::shard::budget::GrantAsk;
use ringlimit::shard::KeyId;

use crate::history::Entry;

use super::{Msg, Node, Out};

impl Node {
    /// `Router::spend_leases`: each of the flight's lease candidates that a lease held
    /// here covers is answered here; where the shard says so, the owner is asked for a
    /// lease (its answer reaches the shard later; the check never waits for it).
    pub(super) fn spend_leases(&mut self, flight: &mut Flight) -> Vec<Out> {
        let mut out = Vec::new();
        if self.cfg.lease_threshold == 0 {
            return out;
        }
        let now = flight.now();
        for candidate in flight.lease_candidates() {
            let item = flight.item(candidate.position);
            let owner = flight.candidate_owner(&candidate);
            let Some(spend) =
                entry_side::spend_ask(item, candidate.single, owner.is_none(), &self.gate)
            else {
                continue;
            };
            let shard = &mut self.shards[Self::shard_of(spend.counter.placement)];
            let mut returns = Vec::new();
            let step = shard
                .budget
                .entry
                .spend(&spend, shard.clock.now_ms(), &mut returns);
            out.extend(self.send_returns(returns));
            let (answer, ask) = entry_side::spent(item, step, now.wall);
            if let (Some(rate), Some(owner)) = (ask, owner) {
                let request = wire::lease_request(&self.id, item, rate);
                self.next_ask += 1;
                self.lease_asks
                    .insert(self.next_ask, (item.clone(), now.wall));
                out.push(Out::Send {
                    to: owner.node_id.clone(),
                    msg: Msg::Lease {
                        ask: self.next_ask,
                        request: Box::new(request),
                    },
                });
            }
            if let Some(answer) = answer {
                flight.leased(candidate.position, answer);
            }
        }
        out
    }

    /// `PeerService::lease_here` + `Router::lease_here`: grant (or refuse) a member a
    /// lease of a counter on this node's shard.
    pub(super) fn on_lease(&mut self, from: &str, ask: u64, r: PeerLeaseRequest) -> Vec<Out> {
        let answer = self.grant(r).map(Box::new);
        vec![Out::Send {
            to: from.to_string(),
            msg: Msg::Leased { ask, answer },
        }]
    }

    fn grant(&mut self, r: PeerLeaseRequest) -> Result<PeerLeaseResponse, String> {
        if self.view.member(&r.from_node).is_none() {
            return Err(format!("{:?} is not a member: no lease", r.from_node));
        }
        let item = r.item.as_ref().ok_or("a lease request names its counter")?;
        let planned =
            forwarded::plan_batch(std::iter::once(forwarded_input(item)), self.owner_rules())
                .map_err(|e| e.to_string())?;
        let item = planned.into_iter().next().expect("one item planned");
        if self.restoring() {
            return Err("restoring".into());
        }
        let ask = GrantAsk {
            charge: item.charge(),
            holder: Arc::from(r.from_node.as_str()),
            rate: r.rate,
            label: (Arc::from(item.client()), Arc::from(item.route())),
        };
        let shard = &mut self.shards[Self::shard_of(item.id.placement)];
        let now = shard.clock.now_ms();
        let sequence = &mut self.sequence;
        let (reply, _) = shard.budget.grant(&mut shard.core, &ask, now, || {
            *sequence += 1;
            *sequence
        });
        if let Some(lease) = reply.lease {
            self.ledger.push(Entry::Lent {
                t: 0,
                node: self.id.to_string(),
                generation: self.generation,
                key: item.client().to_string(),
                route: item.route().to_string(),
                counter: item.id.disc,
                holder: r.from_node.clone(),
                serial: lease.serial,
                units: lease.units,
                window: reply.decision.window_id,
                sequence: reply.sequence,
            });
        }
        let grant = LeaseGrant::of(reply, self.me.clone());
        Ok(lease_response(&item, &grant))
    }

    /// The owner's answer to this node's request `ask`: the lease (or none) goes to the
    /// counter's shard (`Router::ask_lease`'s task).
    pub(super) fn on_leased(&mut self, ask: u64, answer: Result<Box<PeerLeaseResponse>, String>) {
        let Some((item, sent)) = self.lease_asks.remove(&ask) else {
            return;
        };
        let lease = answer
            .ok()
            .and_then(|r| wire::lease_answer(*r, &item).ok())
            .and_then(|grant| grant.held(&item, sent));
        let shard = &mut self.shards[Self::shard_of(item.id.placement)];
        let now = shard.clock.now_ms();
        shard.budget.entry.hold(item.id, lease, now);
    }

    /// `PeerService::return_lease_here` + `Router::return_lease_here`.
    pub(super) fn on_return(&mut self, r: PeerReturnLeaseRequest) {
        if r.generation != self.generation {
            return;
        }
        let counter = KeyId {
            placement: r.placement,
            disc: r.counter,
        };
        let shard = &mut self.shards[Self::shard_of(counter.placement)];
        let now = shard.clock.now_ms();
        let (units, _) = shard.budget.give_back(
            &mut shard.core,
            &r.from_node,
            r.serial,
            counter,
            r.unused,
            now,
        );
        if units > 0 {
            self.sequence += 1;
            self.ledger.push(Entry::Returned {
                t: 0,
                node: self.id.to_string(),
                generation: self.generation,
                counter: counter.disc,
                serial: r.serial,
                units,
                sequence: self.sequence,
            });
        }
    }

    /// The shards' expiry tick, budget part: grants past their grace forgotten, ended
    /// leases returned.
    pub(super) fn expire_leases(&mut self) -> Vec<Out> {
        let mut returns = Vec::new();
        for shard in &mut self.shards {
            let now = shard.clock.now_ms();
            shard.budget.expire(now, &mut returns);
        }
        self.send_returns(returns)
    }

    /// `budget::return_leases`: each return to its owner if the view still has the
    /// generation that granted it (else its units are lost: an under-admission).
    fn send_returns(&self, mut returns: Vec<Returned>) -> Vec<Out> {
        // The stores end leases in their tables' (hash) order: sort for one history.
        returns.sort_by(|a, b| {
            (&a.owner, a.counter.placement, a.counter.disc, a.serial).cmp(&(
                &b.owner,
                b.counter.placement,
                b.counter.disc,
                b.serial,
            ))
        });
        returns
            .into_iter()
            .filter(|r| {
                self.view
                    .member(&r.owner.0)
                    .is_some_and(|m| m.generation == r.owner.1)
            })
            .map(|r| Out::Send {
                to: r.owner.0.to_string(),
                msg: Msg::ReturnLease(wire::return_request(&self.id, &r)),
            })
            .collect()
    }

    /// The ledger lines written since the last call (the world adds them to the
    /// history).
    pub fn take_ledger(&mut self) -> Vec<Entry> {
        std::mem::take(&mut self.ledger)
    }
}
