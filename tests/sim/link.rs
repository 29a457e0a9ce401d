//! The sender's side of every peer link of one node: the real state machines of
//! `ringlimit::cluster::link` ([`Batcher`] and [`Session`]) and its real wire
//! conversions (`wire::forward_item`, `forward_request`, `stream_answer`, `decider`,
//! `remote`), driven the way the tonic shell (`cluster/link/stream.rs` and `pool.rs`)
//! drives them, in the same order of calls. Only the shell is modelled here: the
//! bounded channel in front of each batcher, the streams' request bodies and drivers,
//! and each caller's own timeout (`PeerPool::forward`'s `timeout_at`).
//!
//! Time: the machines take `tokio::time::Instant`s, built as one origin (taken when the
//! link is made) plus the simulated milliseconds; no runtime is needed, and no instant
//! leaves this module (deadlines on the wire and timers are simulated milliseconds), so
//! a seed's history does not depend on when the process started.
//!
//! Streams: a batch the session routes with `open: true` opens stream `stream` (the
//! previous one keeps delivering what it carries); the owner answers on the stream the
//! call came on. A stream whose peer died (the world resets it, or a frame to a dead
//! process is refused) closes: `Session::close` fails its batches. A partition resets
//! nothing (TCP holds the segments, as in the world's network), so its batches fail at
//! their deadlines through `Session::expire`, as in the shell. Not modelled: unary calls
//! (`--forward-unary`, or an older peer without the stream), the end of a replaced
//! stream (one older than `stream_max_age` keeps delivering here until its peer dies,
//! where the owner would end it once it answered what it carries), and the pool's
//! replacement of a whole link (`reconnect_after`, or an owner's new generation or
//! address): one session per peer id lives as long as the node.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use ringlimit::cluster::link::batcher::{Batcher, Next, Queued};
use ringlimit::cluster::link::session::{Delivery, Failed, Route, Session};
use ringlimit::cluster::link::{wire, ForwardError};
use ringlimit::cluster::policy::Now;
use ringlimit::cluster::{CheckItem, Remote};
use ringlimit::membership::Member;
use ringlimit::proto::peer::{ForwardAnswer, ForwardCall, ForwardItem};
use tokio::time::Instant;

/// Who waits for one forwarded item: opaque to the link (a node's pending check and
/// the item's position in it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
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
    pub flush_delay_ms: u64,
    pub stream_max_age_ms: u64,
}

impl Default for LinkConfig {
    fn default() -> Self {
        let real = ringlimit::cluster::link::ForwardConfig::default();
        LinkConfig {
            timeout_ms: real.timeout.as_millis() as u64,
            max_in_flight: real.max_in_flight,
            max_batch: real.max_batch,
            queue: real.queue,
            flush_delay_ms: real.flush_delay.as_millis() as u64,
            stream_max_age_ms: real.stream_max_age.as_millis() as u64,
        }
    }
}

/// One call for the wire: to `owner`, on its stream `stream`.
#[derive(Debug)]
pub struct Frame {
    pub owner: Member,
    pub stream: u64,
    pub call: ForwardCall,
}

/// What one step of the link asks of its node.
#[derive(Default, Debug)]
pub struct Effects {
    /// Calls to put on the wire.
    pub send: Vec<Frame>,
    /// Callers answered: the owner's answer, or why there is none.
    pub done: Vec<(Waiter, Result<Remote, ForwardError>)>,
}

/// A check queued for a peer (the shell's `Pending`): `gave_up` is its caller's reply
/// channel being closed, which happens at its deadline.
struct Pending {
    item: ForwardItem,
    rule: Arc<str>,
    deadline: Instant,
    waiter: Waiter,
    gave_up: bool,
}

impl Queued for Pending {
    fn deadline(&self) -> Instant {
        self.deadline
    }
    fn gave_up(&self) -> bool {
        self.gave_up
    }
}

/// Callers still waiting, by deadline (ms), with the peer their check went to.
type Callers = BTreeMap<(u64, Waiter), Arc<str>>;

/// Per check of a batch: its caller, the rule this node matched, its deadline (ms).
type Reply = (Waiter, Arc<str>, u64);

/// One peer's link: the shell's channel, batcher task and `Streams`.
struct PeerLink {
    owner: Member,
    peer: Arc<str>,
    /// The bounded channel in front of the batcher (`ForwardConfig::queue`).
    channel: VecDeque<Pending>,
    batcher: Batcher<Pending>,
    session: Session<Reply>,
    /// Streams whose driver still reads answers.
    streams: BTreeSet<u64>,
    /// The batcher's timer: a flush delay, or the session's next deadline while it
    /// waits for a slot.
    timer: Option<u64>,
}

/// The sender's side of every peer link of one node.
pub struct Link {
    config: LinkConfig,
    origin: std::time::Instant,
    peers: BTreeMap<String, PeerLink>,
    /// Callers still waiting, by deadline (each caller's `timeout_at`).
    callers: Callers,
}

impl Link {
    pub fn new(config: LinkConfig) -> Link {
        Link {
            config,
            origin: std::time::Instant::now(),
            peers: BTreeMap::new(),
            callers: BTreeMap::new(),
        }
    }

    /// Simulated monotonic milliseconds as the machines' instant.
    fn instant(&self, ms: u64) -> Instant {
        Instant::from_std(self.origin) + Duration::from_millis(ms)
    }

    /// `PeerPool::forward`: queue `item` for `owner` (a full queue fails it at once),
    /// then run the batcher.
    pub fn forward(
        &mut self,
        now: Now,
        owner: &Member,
        item: &CheckItem,
        waiter: Waiter,
    ) -> Effects {
        let deadline_ms = now.mono + self.config.timeout_ms;
        let deadline = self.instant(deadline_ms);
        let config = self.config;
        let peer = self
            .peers
            .entry(owner.node_id.clone())
            .or_insert_with(|| PeerLink {
                owner: owner.clone(),
                peer: Arc::from(owner.node_id.as_str()),
                channel: VecDeque::new(),
                batcher: Batcher::new(
                    config.max_batch,
                    config.max_in_flight,
                    Duration::from_millis(config.flush_delay_ms),
                ),
                session: Session::new(
                    Arc::from(owner.node_id.as_str()),
                    Duration::from_millis(config.stream_max_age_ms),
                    false,
                ),
                streams: BTreeSet::new(),
                timer: None,
            });
        peer.owner = owner.clone();
        if peer.channel.len() >= config.queue.max(1) {
            let error = ForwardError::Overloaded(owner.node_id.clone());
            return Effects {
                send: Vec::new(),
                done: vec![(waiter, Err(error))],
            };
        }
        peer.channel.push_back(Pending {
            item: wire::forward_item(item),
            rule: item.rule.name.clone(),
            deadline,
            waiter,
            gave_up: false,
        });
        self.callers
            .insert((deadline_ms, waiter), peer.peer.clone());
        let mut fx = Effects::default();
        self.pump(&owner.node_id, now, &mut fx);
        fx
    }

    /// An answer (or the end) of stream `stream` from `from` arrived.
    pub fn on_answer(
        &mut self,
        now: Now,
        from: &str,
        stream: u64,
        answer: Result<ForwardAnswer, String>,
    ) -> Effects {
        let mut fx = Effects::default();
        let Some(peer) = self.peers.get_mut(from) else {
            return fx;
        };
        // The stream's driver ended: nobody reads what still comes on it.
        if !peer.streams.contains(&stream) {
            return fx;
        }
        match answer {
            Ok(answer) => {
                let (call, result) = wire::stream_answer(answer, &peer.peer);
                if let Some(delivery) = peer.session.answer(call, result) {
                    let peer_id = peer.peer.clone();
                    deliver(delivery, &peer_id, &mut self.callers, &mut fx);
                }
            }
            Err(why) => {
                peer.streams.remove(&stream);
                let failed = peer.session.close(stream, &why);
                fail(failed, &mut self.callers, &mut fx);
            }
        }
        self.pump(from, now, &mut fx);
        fx
    }

    /// The process of `peer_id` died: every stream to it breaks.
    pub fn reset(&mut self, now: Now, peer_id: &str) -> Effects {
        let mut fx = Effects::default();
        let Some(peer) = self.peers.get_mut(peer_id) else {
            return fx;
        };
        for stream in std::mem::take(&mut peer.streams) {
            let failed = peer.session.close(stream, "connection reset");
            fail(failed, &mut self.callers, &mut fx);
        }
        self.pump(peer_id, now, &mut fx);
        fx
    }

    /// Timers due at `now`: callers whose deadline passed give up (their checks fall
    /// back), then each batcher runs (a due slot expires, a flush delay ends).
    pub fn on_tick(&mut self, now: Now) -> Effects {
        let mut fx = Effects::default();
        while let Some(entry) = self.callers.first_entry() {
            if entry.key().0 > now.mono {
                break;
            }
            let ((_, waiter), owner) = entry.remove_entry();
            let error = ForwardError::Timeout(owner.to_string());
            fx.done.push((waiter, Err(error)));
        }
        let ids: Vec<String> = self.peers.keys().cloned().collect();
        for id in ids {
            self.pump(&id, now, &mut fx);
        }
        fx
    }

    /// When [`Link::on_tick`] next has something to do.
    pub fn next_deadline(&self) -> Option<u64> {
        let callers = self.callers.keys().next().map(|(at, _)| *at);
        self.peers
            .values()
            .filter_map(|p| p.timer)
            .chain(callers)
            .min()
    }

    /// The batcher task's loop (`stream::batcher`) for one peer at `now`, until it
    /// would wait: take from the channel, ask the batcher, send what it cuts.
    fn pump(&mut self, peer_id: &str, now: Now, fx: &mut Effects) {
        let t = self.instant(now.mono);
        let origin = self.origin;
        let Some(peer) = self.peers.get_mut(peer_id) else {
            return;
        };
        peer.timer = None;
        loop {
            while peer.batcher.room() > 0 {
                let Some(p) = peer.channel.pop_front() else {
                    break;
                };
                peer.batcher.queue().push(p);
            }
            // A caller's reply channel closes at its deadline.
            for p in peer.batcher.queue().iter_mut() {
                p.gave_up |= p.deadline <= t;
            }
            match peer.batcher.next(t, peer.session.in_flight()) {
                Next::Idle => break,
                Next::WaitSlot => match peer.session.next_deadline() {
                    // The shell's `sleep_until(next_deadline)` has fired.
                    Some(due) if due <= t => {
                        let failed = peer.session.expire(t);
                        fail(failed, &mut self.callers, fx);
                    }
                    due => {
                        peer.timer = due.map(|d| ms_of(origin, d));
                        break;
                    }
                },
                Next::FlushAt(at) => {
                    peer.timer = Some(ms_of(origin, at));
                    break;
                }
                Next::Send => {
                    // `send_batch` then `Streams::send`.
                    let Some((deadline, batch)) = peer.batcher.take() else {
                        continue;
                    };
                    let mut items = Vec::with_capacity(batch.len());
                    let mut replies = Vec::with_capacity(batch.len());
                    for p in batch {
                        let at = ms_of(origin, p.deadline);
                        items.push(p.item);
                        replies.push((p.waiter, p.rule, at));
                    }
                    // The deadline on the sender's wall clock, the owner's reference.
                    let left = deadline.saturating_duration_since(t).as_millis() as u64;
                    let request = wire::forward_request(items, now.wall + left);
                    let failed = peer.session.expire(t);
                    fail(failed, &mut self.callers, fx);
                    match peer.session.send(t, replies, deadline) {
                        Route::Stream { stream, call, open } => {
                            if open {
                                peer.streams.insert(stream);
                            }
                            fx.send.push(Frame {
                                owner: peer.owner.clone(),
                                stream,
                                call: ForwardCall {
                                    call,
                                    request: Some(request),
                                },
                            });
                        }
                        Route::Unary { .. } => unreachable!("the simulated link streams"),
                    }
                }
            }
        }
    }
}

fn ms_of(origin: std::time::Instant, at: Instant) -> u64 {
    at.duration_since(Instant::from_std(origin)).as_millis() as u64
}

/// Hand a batch's answer (or its failure) to its callers still waiting (`deliver`).
fn deliver(
    delivery: Delivery<Reply, ringlimit::proto::peer::ForwardResponse>,
    peer: &Arc<str>,
    callers: &mut Callers,
    fx: &mut Effects,
) {
    match delivery {
        Delivery::Answer { replies, answer } => {
            let decider = wire::decider(&answer, peer);
            for (outcome, (waiter, rule, at)) in answer.outcomes.into_iter().zip(replies) {
                if callers.remove(&(at, waiter)).is_some() {
                    fx.done
                        .push((waiter, Ok(wire::remote(outcome, &decider, rule))));
                }
            }
        }
        Delivery::Fail { replies, error } => fail_batch(replies, &error, callers, fx),
    }
}

/// Fail every batch of `failed` with its error (`fail`).
fn fail(failed: Option<Failed<Reply>>, callers: &mut Callers, fx: &mut Effects) {
    if let Some(Failed { error, batches }) = failed {
        for replies in batches {
            fail_batch(replies, &error, callers, fx);
        }
    }
}

fn fail_batch(replies: Vec<Reply>, error: &ForwardError, callers: &mut Callers, fx: &mut Effects) {
    for (waiter, _, at) in replies {
        if callers.remove(&(at, waiter)).is_some() {
            fx.done.push((waiter, Err(error.clone())));
        }
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

    fn allowed(call: u64, n: usize) -> Result<ForwardAnswer, String> {
        let outcome = ForwardOutcome {
            allowed: true,
            limit: 10,
            remaining: 9,
            sequence: 1,
            same_rule: true,
            algorithm_index: 1,
            ..Default::default()
        };
        Ok(ForwardAnswer {
            call,
            response: Some(ForwardResponse {
                node_id: "n2".into(),
                generation: 7,
                outcomes: vec![outcome; n],
            }),
            code: 0,
            message: String::new(),
        })
    }

    #[test]
    fn one_batch_in_flight_and_the_queue_leaves_together_when_it_returns() {
        let mut link = Link::new(LinkConfig::default());
        let first = link.forward(at(0), &owner(), &item("a"), waiter(1));
        assert_eq!(first.send.len(), 1, "an idle link sends at once");
        let Frame { stream, call, .. } = &first.send[0];
        let (stream, call, deadline) = (
            *stream,
            call.call,
            call.request.as_ref().unwrap().deadline_ms,
        );
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
        let fx = link.on_answer(at(5), "n2", stream, allowed(call, 1));
        assert_eq!(fx.done.len(), 1);
        let remote = fx.done[0].1.as_ref().unwrap();
        assert_eq!((remote.decider.generation, &*remote.rule), (7, "fw"));
        assert_eq!(fx.send.len(), 1, "the queued two leave as one batch");
        assert_eq!(fx.send[0].stream, stream, "on the same stream");
        assert_eq!(fx.send[0].call.request.as_ref().unwrap().items.len(), 2);
    }

    #[test]
    fn a_batch_fails_whole_at_its_deadline_and_a_late_answer_is_dropped() {
        let mut link = Link::new(LinkConfig::default());
        let sent = link.forward(at(0), &owner(), &item("a"), waiter(1));
        let (stream, call) = (sent.send[0].stream, sent.send[0].call.call);
        link.forward(at(100), &owner(), &item("b"), waiter(2));
        assert_eq!(link.next_deadline(), Some(250));
        assert!(link.on_tick(at(249)).done.is_empty());
        let fx = link.on_tick(at(250));
        assert_eq!(fx.done.len(), 1, "the first caller, once");
        assert!(fx.done[0].1.is_err());
        assert_eq!(fx.send.len(), 1, "the freed slot sends the queued check");
        assert!(link
            .on_answer(at(260), "n2", stream, allowed(call, 1))
            .done
            .is_empty());
        assert_eq!(
            link.next_deadline(),
            Some(350),
            "the second caller's deadline"
        );
    }

    #[test]
    fn a_reset_stream_fails_what_it_carried_and_a_refusal_fails_every_item() {
        let mut link = Link::new(LinkConfig::default());
        let first = link.forward(at(0), &owner(), &item("a"), waiter(1));
        let fx = link.reset(at(1), "n2");
        assert_eq!(fx.done.len(), 1);
        assert!(fx.done[0]
            .1
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("connection reset"));
        let sent = link.forward(at(2), &owner(), &item("b"), waiter(2));
        assert_ne!(sent.send[0].stream, first.send[0].stream, "a new stream");
        let refused = ForwardAnswer {
            call: sent.send[0].call.call,
            response: None,
            code: 4,
            message: "forwarded batch arrived after its deadline".into(),
        };
        let fx = link.on_answer(at(3), "n2", sent.send[0].stream, Ok(refused));
        assert!(fx.done[0]
            .1
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("after its deadline"));
    }

    #[test]
    fn a_refused_connection_closes_the_stream_and_nothing_more_is_read_on_it() {
        let mut link = Link::new(LinkConfig::default());
        let sent = link.forward(at(0), &owner(), &item("a"), waiter(1));
        let (stream, call) = (sent.send[0].stream, sent.send[0].call.call);
        let fx = link.on_answer(at(1), "n2", stream, Err("connection refused".into()));
        assert!(fx.done[0]
            .1
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("connection refused"));
        assert!(link
            .on_answer(at(2), "n2", stream, allowed(call, 1))
            .done
            .is_empty());
        assert_eq!(link.next_deadline(), None, "nothing waits");
    }

    #[test]
    fn a_caller_that_gave_up_is_left_out_of_the_next_batch() {
        let mut link = Link::new(LinkConfig::default());
        link.forward(at(0), &owner(), &item("a"), waiter(1));
        link.forward(at(0), &owner(), &item("b"), waiter(2));
        // Both callers give up at 250; the first batch's slot frees at its deadline.
        let fx = link.on_tick(at(250));
        assert_eq!(fx.done.len(), 2);
        assert!(fx.send.is_empty(), "the queued check's caller is gone");
        assert_eq!(link.next_deadline(), None);
    }
}
