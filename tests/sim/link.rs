//! The peer link as the simulator models it: the sender's side of forwarding (queue,
//! batches, in-flight limit, deadlines, answers). Everything else a node does with a
//! peer (refunds, installs) is a single message, sent by `node.rs`.
//!
//! This is the one module that stands in for `src/cluster/forward.rs`, whose I/O-free
//! rebuild lands separately: it has a narrow interface ([`Link::forward`],
//! [`Link::on_answer`], [`Link::on_tick`], [`Link::next_deadline`]) that takes the
//! current time and returns what to send and which callers are answered, so the real
//! state machine can replace it without touching the rest of the simulator. It carries
//! the real wire types (`ForwardCall` / `ForwardAnswer` of the peer API), so message
//! sizes are the protocol's encoded sizes.
//!
//! Modelled after `PeerPool`'s defaults: a check's deadline is its enqueue time plus
//! the forward timeout; a batch takes every queued check (up to `max_batch`) once fewer
//! than `max_in_flight` batches are out; a batch carries its most urgent check's
//! deadline as the sender's wall clock reads it (the owner refuses it after that); a
//! batch still out at its deadline fails whole and frees its slot; an answer to a
//! batch that already failed is dropped.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use ringlimit::algorithms::{AlgorithmKind, Decision};
use ringlimit::cluster::link::rule_hash;
use ringlimit::cluster::policy::Now;
use ringlimit::cluster::{CheckItem, Decider, Remote};
use ringlimit::membership::Member;
use ringlimit::proto::peer::{ForwardAnswer, ForwardCall, ForwardItem, ForwardRequest};

/// Who waits for one forwarded item: opaque to the link (a node's pending check and
/// the item's position in it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waiter {
    pub check: u64,
    pub pos: usize,
}

/// The link's numbers (`ForwardConfig`'s defaults in the node).
#[derive(Clone, Copy, Debug)]
pub struct LinkConfig {
    pub timeout_ms: u64,
    pub max_in_flight: usize,
    pub max_batch: usize,
    pub queue: usize,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            timeout_ms: 250,
            max_in_flight: 1,
            max_batch: 1000,
            queue: 16_384,
        }
    }
}

/// What one step of the link asks of its node.
#[derive(Default, Debug)]
pub struct Effects {
    /// Calls to put on the wire: (owner, call).
    pub send: Vec<(Member, ForwardCall)>,
    /// Callers answered: the owner's answer, or why there is none.
    pub done: Vec<(Waiter, Result<Remote, String>)>,
}

impl Effects {
    fn merge(&mut self, other: Effects) {
        self.send.extend(other.send);
        self.done.extend(other.done);
    }
}

struct Queued {
    item: ForwardItem,
    rule: Arc<str>,
    deadline: u64,
    waiter: Waiter,
}

struct InFlight {
    deadline: u64,
    waiters: Vec<(Waiter, Arc<str>)>,
}

#[derive(Default)]
struct Peer {
    owner: Option<Member>,
    queue: VecDeque<Queued>,
    in_flight: BTreeMap<u64, InFlight>,
}

/// The sender's side of every peer link of one node.
pub struct Link {
    config: LinkConfig,
    peers: BTreeMap<String, Peer>,
    next_call: u64,
}

impl Link {
    pub fn new(config: LinkConfig) -> Link {
        Link {
            config,
            peers: BTreeMap::new(),
            next_call: 1,
        }
    }

    /// Queue `item` for `owner`; sends at once if a slot is free.
    pub fn forward(
        &mut self,
        now: Now,
        owner: &Member,
        item: &CheckItem,
        waiter: Waiter,
    ) -> Effects {
        let queue_cap = self.config.queue;
        let timeout = self.config.timeout_ms;
        let peer = self.peers.entry(owner.node_id.clone()).or_default();
        peer.owner = Some(owner.clone());
        if peer.queue.len() >= queue_cap {
            return Effects {
                send: Vec::new(),
                done: vec![(waiter, Err(format!("queue to {} is full", owner.node_id)))],
            };
        }
        let rule = item.rule.name.clone();
        peer.queue.push_back(Queued {
            item: ForwardItem {
                key: item.client().to_string(),
                route: item.route().to_string(),
                tier: item.tier.as_deref().map(str::to_string),
                cost: item.cost.get(),
                hops: 1,
                named: None,
                give_back: item.give_back.map_or(0, |g| g.get()),
                drain: item.drain,
                peek: item.peek,
                rule_hash: rule_hash(&rule),
            },
            rule,
            deadline: now.mono + timeout,
            waiter,
        });
        self.pump(&owner.node_id, now)
    }

    /// The owner `from` answered call `answer.call`.
    pub fn on_answer(&mut self, now: Now, from: &str, answer: ForwardAnswer) -> Effects {
        let mut fx = Effects::default();
        let Some(peer) = self.peers.get_mut(from) else {
            return fx;
        };
        // Already failed at its deadline: the caller has moved on.
        let Some(batch) = peer.in_flight.remove(&answer.call) else {
            return fx;
        };
        match answer.response {
            Some(response) if answer.code == 0 => {
                let decider = Decider {
                    node_id: Arc::from(response.node_id.as_str()),
                    generation: response.generation,
                };
                let mut outcomes = response.outcomes.into_iter();
                for (waiter, sent) in batch.waiters {
                    let result = match outcomes.next() {
                        Some(o) => Ok(Remote {
                            decision: Decision {
                                allowed: o.allowed,
                                limit: o.limit,
                                remaining: o.remaining,
                                retry_after_ms: o.retry_after_ms,
                                reset_at_ms: o.reset_at,
                                window_id: o.window_id,
                                delay_ms: o.delay_ms,
                            },
                            sequence: o.sequence,
                            at: o.at,
                            decider: decider.clone(),
                            rule: if o.same_rule || *sent == *o.rule {
                                sent
                            } else {
                                Arc::from(o.rule.as_str())
                            },
                            algorithm: match o.algorithm_index {
                                0 => AlgorithmKind::parse(&o.algorithm),
                                i => AlgorithmKind::ALL.get(i as usize - 1).copied(),
                            },
                        }),
                        None => Err("answer without an outcome".to_string()),
                    };
                    fx.done.push((waiter, result));
                }
            }
            _ => {
                let why = format!("owner {from} refused the batch: {}", answer.message);
                for (waiter, _) in batch.waiters {
                    fx.done.push((waiter, Err(why.clone())));
                }
            }
        }
        fx.merge(self.pump(from, now));
        fx
    }

    /// The connection to `peer` broke (the process died: its kernel reset the stream):
    /// every batch on it fails now.
    pub fn reset(&mut self, now: Now, peer_id: &str) -> Effects {
        let mut fx = Effects::default();
        let Some(peer) = self.peers.get_mut(peer_id) else {
            return fx;
        };
        for (_, batch) in std::mem::take(&mut peer.in_flight) {
            for (waiter, _) in batch.waiters {
                fx.done
                    .push((waiter, Err(format!("stream to {peer_id} reset"))));
            }
        }
        fx.merge(self.pump(peer_id, now));
        fx
    }

    /// Fail what is due at `now` (callers past their deadline, batches past theirs) and
    /// send what a freed slot allows.
    pub fn on_tick(&mut self, now: Now) -> Effects {
        let mut fx = Effects::default();
        let ids: Vec<String> = self.peers.keys().cloned().collect();
        for id in ids {
            let peer = self.peers.get_mut(&id).expect("listed");
            let due: Vec<u64> = peer
                .in_flight
                .iter()
                .filter(|(_, b)| b.deadline <= now.mono)
                .map(|(call, _)| *call)
                .collect();
            for call in due {
                let batch = peer.in_flight.remove(&call).expect("listed");
                for (waiter, _) in batch.waiters {
                    fx.done.push((
                        waiter,
                        Err(format!("owner {id} did not answer within the deadline")),
                    ));
                }
            }
            fx.merge(self.pump(&id, now));
        }
        fx
    }

    /// When [`Link::on_tick`] next has something to do.
    pub fn next_deadline(&self) -> Option<u64> {
        self.peers
            .values()
            .flat_map(|p| {
                p.queue
                    .iter()
                    .map(|q| q.deadline)
                    .chain(p.in_flight.values().map(|b| b.deadline))
            })
            .min()
    }

    /// Drop queued checks whose caller gave up, then send batches while slots are free.
    fn pump(&mut self, peer_id: &str, now: Now) -> Effects {
        let mut fx = Effects::default();
        let config = self.config;
        let Some(peer) = self.peers.get_mut(peer_id) else {
            return fx;
        };
        let mut kept = VecDeque::with_capacity(peer.queue.len());
        for q in peer.queue.drain(..) {
            if q.deadline <= now.mono {
                fx.done.push((
                    q.waiter,
                    Err(format!(
                        "owner {peer_id} did not answer within the deadline"
                    )),
                ));
            } else {
                kept.push_back(q);
            }
        }
        peer.queue = kept;
        while !peer.queue.is_empty()
            && (config.max_in_flight == 0 || peer.in_flight.len() < config.max_in_flight)
        {
            let n = peer.queue.len().min(config.max_batch);
            let batch: Vec<Queued> = peer.queue.drain(..n).collect();
            let deadline = batch.iter().map(|q| q.deadline).min().expect("not empty");
            let call = self.next_call;
            self.next_call += 1;
            let mut items = Vec::with_capacity(batch.len());
            let mut waiters = Vec::with_capacity(batch.len());
            for q in batch {
                items.push(q.item);
                waiters.push((q.waiter, q.rule));
            }
            peer.in_flight.insert(call, InFlight { deadline, waiters });
            let request = ForwardRequest {
                from_node: String::new(),
                items,
                deadline_ms: now.wall + (deadline - now.mono),
                compact: true,
            };
            let owner = peer.owner.clone().expect("set on forward");
            fx.send.push((
                owner,
                ForwardCall {
                    call,
                    request: Some(request),
                },
            ));
        }
        fx
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringlimit::check::plan::plan_forwarded;
    use ringlimit::check::DescriptorInput;
    use ringlimit::config::rules::RuleSet;
    use ringlimit::proto::peer::{ForwardOutcome, ForwardResponse};

    fn item(key: &str) -> CheckItem {
        let rules = RuleSet::from_toml_str(crate::scenario::RULES).unwrap();
        let input = DescriptorInput {
            key,
            route: "GET /fw",
            tier: None,
            cost: Some(1),
        };
        plan_forwarded(&input, &rules, |l| l.as_str().to_string()).unwrap()
    }

    fn owner() -> Member {
        let a = crate::node::Addrs::of_index(2);
        Member {
            node_id: "n2".into(),
            generation: 7,
            grpc_addr: a.grpc,
            peer_addr: a.peer,
            gossip_addr: a.gossip,
            leaving: false,
        }
    }

    fn at(ms: u64) -> Now {
        Now {
            wall: 1_000_000 + ms,
            mono: ms,
        }
    }

    fn waiter(check: u64) -> Waiter {
        Waiter { check, pos: 0 }
    }

    fn allowed(call: u64, n: usize) -> ForwardAnswer {
        let outcome = ForwardOutcome {
            allowed: true,
            limit: 10,
            remaining: 9,
            sequence: 1,
            same_rule: true,
            algorithm_index: 1,
            ..Default::default()
        };
        ForwardAnswer {
            call,
            response: Some(ForwardResponse {
                node_id: "n2".into(),
                generation: 7,
                outcomes: vec![outcome; n],
            }),
            code: 0,
            message: String::new(),
        }
    }

    #[test]
    fn one_batch_in_flight_and_the_queue_leaves_together_when_it_returns() {
        let mut link = Link::new(LinkConfig::default());
        let first = link.forward(at(0), &owner(), &item("a"), waiter(1));
        assert_eq!(first.send.len(), 1, "an idle link sends at once");
        let call = first.send[0].1.call;
        let deadline = first.send[0].1.request.as_ref().unwrap().deadline_ms;
        assert_eq!(
            deadline,
            1_000_000 + 250,
            "the deadline on the sender's wall clock"
        );
        assert!(link
            .forward(at(1), &owner(), &item("b"), waiter(2))
            .send
            .is_empty());
        assert!(link
            .forward(at(2), &owner(), &item("c"), waiter(3))
            .send
            .is_empty());
        let fx = link.on_answer(at(5), "n2", allowed(call, 1));
        assert_eq!(fx.done.len(), 1);
        let remote = fx.done[0].1.as_ref().unwrap();
        assert_eq!((remote.decider.generation, &*remote.rule), (7, "fw"));
        assert_eq!(fx.send.len(), 1, "the queued two leave as one batch");
        assert_eq!(fx.send[0].1.request.as_ref().unwrap().items.len(), 2);
    }

    #[test]
    fn a_batch_fails_whole_at_its_deadline_and_a_late_answer_is_dropped() {
        let mut link = Link::new(LinkConfig::default());
        let call = link.forward(at(0), &owner(), &item("a"), waiter(1)).send[0]
            .1
            .call;
        link.forward(at(100), &owner(), &item("b"), waiter(2));
        assert_eq!(link.next_deadline(), Some(250));
        assert!(link.on_tick(at(249)).done.is_empty());
        let fx = link.on_tick(at(250));
        assert_eq!(fx.done.len(), 1);
        assert!(fx.done[0].1.is_err());
        assert_eq!(fx.send.len(), 1, "the freed slot sends the queued check");
        assert!(link
            .on_answer(at(260), "n2", allowed(call, 1))
            .done
            .is_empty());
    }

    #[test]
    fn a_reset_stream_fails_what_it_carried_and_a_refusal_fails_every_item() {
        let mut link = Link::new(LinkConfig::default());
        link.forward(at(0), &owner(), &item("a"), waiter(1));
        let fx = link.reset(at(1), "n2");
        assert_eq!(fx.done.len(), 1);
        assert!(fx.done[0].1.is_err());
        let call = link.forward(at(2), &owner(), &item("b"), waiter(2)).send[0]
            .1
            .call;
        let refused = ForwardAnswer {
            call,
            response: None,
            code: 4,
            message: "forwarded batch arrived after its deadline".into(),
        };
        let fx = link.on_answer(at(3), "n2", refused);
        assert!(fx.done[0]
            .1
            .as_ref()
            .unwrap_err()
            .contains("after its deadline"));
    }
}
