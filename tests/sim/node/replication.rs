//! The simulated node's successor replicas (issue 23): the replicator's round, the
//! successor's side of `Peer/Replicate` and `Peer/Restore`, the fail-over of a check
//! whose owner cannot be reached, and a restarted node's restore.
//!
//! Real (called): the shard's [`ShardCore`](ringlimit::shard::ShardCore) does every
//! decision, hold, drain, resync, promotion and selection; the ring's
//! `successor_of_hash` places replicas; `link::calls` builds the requests (so their
//! sizes are the protocol's); `policy` answers. Modelled, step by step, as noted on
//! each function: the async shells `Replicator::round` / `successors_changed` /
//! `push_failover`, `Router::fail_over` / `decide_on_successor`,
//! `PeerService::send_replicas` and `restore_from_peers`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use ringlimit::clock::Clock;
use ringlimit::cluster::handoff::MAX_INSTALL_STATES;
use ringlimit::cluster::link::calls;
use ringlimit::cluster::replication::{self, MAX_PER_ROUND, RESTORE_SETTLE};
use ringlimit::membership::ClusterView;
use ringlimit::proto::peer::{InstallRequest, RestoreRequest, RestoreResponse};
use ringlimit::shard::replication::Pick;
use ringlimit::shard::{Exported, Recipient};

use super::{Msg, Node, Out, Timer};

/// Where a restarted node's restore stands (`restore_from_peers`' loop as states).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for a view with another member.
    Waiting,
    /// Asked the members in `waiting`; their answers are due.
    Asking,
    /// Every member asked answered and one knew an earlier incarnation: waiting for
    /// the membership to stay still for `RESTORE_SETTLE` (or change: ask the new ones).
    Settling { until: u64 },
}

/// A node's restore: until it is done, client checks wait and forwarded checks that
/// are not fail-overs are refused (their senders fail over to the successor).
pub struct Restore {
    pub done: bool,
    phase: Phase,
    asked: BTreeSet<String>,
    waiting: BTreeSet<String>,
    restarted: bool,
    deadline: u64,
    /// Client checks that arrived meanwhile: (client, op, key, route, cost).
    pub queued: Vec<(u32, u64, String, String, u64)>,
}

impl Restore {
    /// A node that replicates and has seeds restores (`Restore::new(!replicating ||
    /// seeds.is_empty())`), until `deadline` at the latest.
    pub fn new(needed: bool, deadline: u64) -> Restore {
        Restore {
            done: !needed,
            phase: Phase::Waiting,
            asked: BTreeSet::new(),
            waiting: BTreeSet::new(),
            restarted: false,
            deadline,
            queued: Vec::new(),
        }
    }
}

/// Counts of the replication, for the figures.
#[derive(Default, Debug, Clone)]
pub struct ReplicationStats {
    /// States sent to successors, and in how many batches.
    pub replicated: u64,
    pub batches: u64,
    /// Changed keys whose successor was not in the view.
    pub lost: u64,
    /// Checks this node sent to a key's successor (its owner unreachable), and of
    /// those the successor could not answer either (failed open or closed).
    pub failed_over: u64,
    pub failover_failed: u64,
    /// Fail-over admissions pushed to their owners.
    pub failover_pushed: u64,
    /// Replicas pushed to restarted owners (or joiners: `send_replicas` pushes to
    /// any member that asks), and installed (merged) by this node from such pushes.
    pub restored: u64,
    pub restore_installed: u64,
}

impl Node {
    pub(super) fn replicating(&self) -> bool {
        self.cfg.replicate_ms > 0
    }

    /// `Replicator::round`: every changed key this node owns to its successor (in
    /// chunks of `MAX_INSTALL_STATES`, one `Peer/Replicate` each), then the fail-over
    /// admissions made here to their owners (`push_failover`, by `Peer/Install`).
    pub(super) fn replicate_round(&mut self) -> Vec<Out> {
        // `Replicator::run`: no round until the restore is over.
        if self.restoring() {
            return vec![Out::Timer {
                at: self.clock.monotonic_ms() + self.cfg.replicate_ms,
                timer: Timer::Replicate,
            }];
        }
        let mut changed = Vec::new();
        for shard in &mut self.shards {
            changed.extend(shard.core.drain_changed(MAX_PER_ROUND));
        }
        let view = self.view.clone();
        let mut to: BTreeMap<String, Vec<Exported>> = BTreeMap::new();
        for c in changed {
            let p = c.state.id.placement;
            if view.ring.owner_of_hash(p) != Some(&*self.id) {
                continue;
            }
            if let Some(successor) = view.ring.successor_of_hash(p) {
                to.entry(successor.to_string()).or_default().push(c.state);
            }
        }
        let mut out = Vec::new();
        for (successor, mut states) in to {
            // The shard's changed-key table iterates in hash order: sort for one history.
            states.sort_by_key(|s| (s.id.placement, s.id.disc));
            if view.member(&successor).is_none() {
                self.repl.lost += states.len() as u64;
                continue;
            }
            for chunk in states.chunks(MAX_INSTALL_STATES) {
                self.repl.replicated += chunk.len() as u64;
                self.repl.batches += 1;
                let stamp = (self.generation, self.repl.batches);
                out.push(Out::Send {
                    to: successor.clone(),
                    msg: Msg::Replicate(calls::replicate_request(
                        &self.id,
                        chunk,
                        &self.inline,
                        stamp,
                    )),
                });
            }
        }
        out.extend(self.push_failover(&view));
        out.push(Out::Timer {
            at: self.clock.monotonic_ms() + self.cfg.replicate_ms,
            timer: Timer::Replicate,
        });
        out
    }

    /// `Replicator::push_failover`.
    fn push_failover(&mut self, view: &ClusterView) -> Vec<Out> {
        let mut owed = Vec::new();
        for shard in &mut self.shards {
            owed.extend(shard.core.drain_failover());
        }
        let mut to: BTreeMap<String, Vec<Exported>> = BTreeMap::new();
        for state in owed {
            match view.ring.owner_of_hash(state.id.placement) {
                Some(owner) if owner != &*self.id => {
                    to.entry(owner.to_string()).or_default().push(state)
                }
                _ => {}
            }
        }
        let mut out = Vec::new();
        for (owner, mut states) in to {
            states.sort_by_key(|s| (s.id.placement, s.id.disc));
            if view.member(&owner).is_none() {
                continue;
            }
            self.repl.failover_pushed += states.len() as u64;
            for chunk in states.chunks(MAX_INSTALL_STATES) {
                out.push(Out::Send {
                    to: owner.clone(),
                    msg: Msg::Install(calls::install_request(&self.id, chunk, &self.inline)),
                });
            }
        }
        out
    }

    /// `Replicator::run`'s step for a new view: `drop_handed_over`, then
    /// `successors_changed` (mark every key this node owns under `new` whose successor
    /// or owner differs from `old`'s).
    pub(super) fn successors_changed(&mut self, old: &ClusterView, new: &ClusterView) -> Vec<Out> {
        if !self.replicating() {
            return Vec::new();
        }
        self.successors_restarted(old, new);
        let reborn = replication::reborn(old, new, &self.seen);
        let again: Vec<String> = reborn
            .iter()
            .filter(|id| {
                new.member(id)
                    .is_some_and(|m| self.claim_hand_again(id, m.generation))
            })
            .cloned()
            .collect();
        for m in &new.members {
            self.seen.insert(m.node_id.clone(), m.generation);
        }
        // `Replicator::take_back_from_departed`.
        let mut out = Vec::new();
        let departed = replication::departed(old, new);
        if !departed.is_empty() {
            let new_owner = ringlimit::cluster::handoff::new_owners(new, self.id.clone());
            let states = self.take_back(&departed, |p| new_owner(p));
            out.extend(self.push(new, states));
        }
        if old.ring.digest() == new.ring.digest() {
            return out;
        }
        if let Some(pick) = replication::handed_over_by_live_owner(&self.id, old, new) {
            for shard in &mut self.shards {
                shard.core.drop_replicas(&pick);
            }
        }
        // `Replicator::hand_again_to_reborn`.
        if !again.is_empty() {
            let again: Vec<(String, u64)> = again
                .into_iter()
                .filter_map(|id| new.member(&id).map(|m| (id, m.generation)))
                .collect();
            let new_owner = ringlimit::cluster::handoff::new_owners(new, self.id.clone());
            let states = self.take_back(&again, |p| new_owner(p));
            out.extend(self.push(new, states));
        }
        let reborn = replication::not_restored_here(new, reborn, &self.restores_served);
        out.extend(self.hand_over_unpromoted(old, new, reborn));

        let (me, old_ring, new_ring) = (self.id.clone(), old.ring.clone(), new.ring.clone());
        let pick: Pick =
            Arc::new(move |p| replication::needs_full_state(&me, &old_ring, &new_ring, p));
        for shard in &mut self.shards {
            let now = shard.clock.now_ms();
            shard.core.resync(&pick, now);
        }
        out
    }

    /// `Replicator::claim_hand_again`.
    fn claim_hand_again(&mut self, node: &str, generation: u64) -> bool {
        self.seen.get(node).is_some_and(|&g| g < generation)
            && self.handed_again.insert(node.to_string(), generation) != Some(generation)
    }

    /// `Replicator::take_back`: the keys handed to incarnations of `back` (id,
    /// generation now) earlier than the one now, handed again.
    fn take_back(
        &mut self,
        back: &[(String, u64)],
        mut new_owner: impl FnMut(u64) -> Option<Recipient>,
    ) -> Vec<(Arc<str>, Exported)> {
        let gone =
            |id: &str, generation: u64| back.iter().any(|(b, now)| b == id && generation < *now);
        let mut out = Vec::new();
        for shard in &mut self.shards {
            let now = shard.clock.now_ms();
            out.extend(shard.core.hand_again(now, &gone, &mut new_owner));
        }
        out
    }

    /// `Replicator::hand_over_unpromoted` (and `remember`).
    fn hand_over_unpromoted(
        &mut self,
        old: &ClusterView,
        new: &ClusterView,
        reborn: Vec<String>,
    ) -> Vec<Out> {
        let Some(pick) = replication::unpromoted(&self.id, old, new, reborn) else {
            return Vec::new();
        };
        let mut to: BTreeMap<String, Vec<Exported>> = BTreeMap::new();
        for shard in &mut self.shards {
            for state in shard.core.select_replicas(&pick) {
                if let Some(owner) = new.ring.owner_of_hash(state.id.placement) {
                    to.entry(owner.to_string()).or_default().push(state);
                }
            }
        }
        let mut out = Vec::new();
        for (owner, mut states) in to {
            states.sort_by_key(|s| (s.id.placement, s.id.disc));
            if new.member(&owner).is_none() {
                continue;
            }
            for chunk in states.chunks(MAX_INSTALL_STATES) {
                out.push(Out::Send {
                    to: owner.clone(),
                    msg: Msg::Install(calls::install_request(&self.id, chunk, &self.inline)),
                });
            }
        }
        out
    }

    /// `Replicator::successors_restarted`: remember members that restarted in place,
    /// and send every key this node owns whose successor one of them is in full.
    fn successors_restarted(&mut self, old: &ClusterView, new: &ClusterView) {
        let restarted = replication::restarted_in_place(old, new);
        if restarted.is_empty() {
            return;
        }
        for m in &restarted {
            self.restarted.insert(m.node_id.clone(), m.generation);
        }
        let ids: Vec<String> = restarted.into_iter().map(|m| m.node_id).collect();
        let (me, ring) = (self.id.clone(), new.ring.clone());
        let pick: Pick = Arc::new(move |p| {
            ring.owner_of_hash(p) == Some(&*me)
                && ring
                    .successor_of_hash(p)
                    .is_some_and(|s| ids.iter().any(|r| r == s))
        });
        for shard in &mut self.shards {
            let now = shard.clock.now_ms();
            shard.core.resync(&pick, now);
        }
    }

    /// `PeerService::hold_replicas`: vet like an install, keep as replicas.
    pub(super) fn on_replicate(&mut self, request: InstallRequest) {
        let from = request.from_node.clone();
        // `Replicator::admit_batch`: a batch older than one held is refused.
        if !self
            .held_batches
            .admit(&from, request.sender_generation, request.batch)
        {
            return;
        }
        let vetted = self.vet(request);
        let view = self.view.clone();
        for (item, rule) in vetted {
            if !replication::from_owner(&view, item.id.placement, &from) {
                continue;
            }
            let shard = &mut self.shards[Self::shard_of(item.id.placement)];
            let now = shard.clock.now_ms();
            shard.core.hold(vec![(item, rule)], now);
        }
    }

    /// `PeerService::send_replicas`: push `from` its own replicas held here
    /// (`replication::restorable`), and say whether this node knew an earlier
    /// incarnation.
    pub(super) fn on_restore(&mut self, from: &str, request: RestoreRequest) -> Vec<Out> {
        let answer = |installs, response| {
            vec![Out::Send {
                to: from.to_string(),
                msg: Msg::Restored(Ok((installs, response))),
            }]
        };
        if !self.replicating() {
            return answer(Vec::new(), RestoreResponse::default());
        }
        let view = self.view.clone();
        let Some(to) = view.member(&request.from_node) else {
            // `Replicator::hand_over_to_joiner`: a requester this view does not hold
            // yet gets its keys handed over before the answer (first again those
            // handed to an earlier incarnation of it).
            let mut states: Vec<Exported> = Vec::new();
            let mut out = Vec::new();
            if self.claim_hand_again(&request.from_node, request.generation) {
                let owners = replication::owner_with(
                    &view,
                    &request.from_node,
                    request.generation,
                    &self.id,
                );
                let back = [(request.from_node.clone(), request.generation)];
                let again = self.take_back(&back, |p| owners(p));
                let (mine, others): (Vec<_>, Vec<_>) = again
                    .into_iter()
                    .partition(|(owner, _)| **owner == *request.from_node);
                states.extend(mine.into_iter().map(|(_, s)| s));
                out.extend(self.push(&view, others));
            }
            let new_owner = replication::joining(&view, &request.from_node, request.generation);
            for shard in &mut self.shards {
                let now = shard.clock.now_ms();
                states.extend(
                    shard
                        .core
                        .export(now, |p| new_owner(p))
                        .into_iter()
                        .map(|(_, s)| s),
                );
            }
            let pick = replication::joining_replicas(&self.id, &view, &request.from_node);
            let mut unpromoted = 0;
            for shard in &mut self.shards {
                let replicas = shard.core.select_replicas(&pick);
                unpromoted += replicas.len();
                states.extend(replicas);
            }
            if unpromoted > 0 {
                // The answer carries the installs: they are in if it arrives.
                self.restores_served
                    .insert(request.from_node.clone(), request.generation);
            }
            states.sort_by_key(|s| (s.id.placement, s.id.disc));
            self.stats.handed_over += states.len() as u64;
            let n = states.len() as u64;
            let installs = states
                .chunks(MAX_INSTALL_STATES)
                .map(|chunk| calls::install_request(&self.id, chunk, &self.inline))
                .collect();
            out.extend(answer(
                installs,
                RestoreResponse {
                    sent: n,
                    installed: n,
                    earlier: false,
                },
            ));
            return out;
        };
        let earlier = to.generation < request.generation
            || self.restarted.get(&request.from_node) == Some(&request.generation);
        if !earlier {
            // As the real service: a new member, or one back after the cluster dropped
            // it, gets its keys by handoff, not replicas (both would be merged).
            return answer(Vec::new(), RestoreResponse::default());
        }
        let pick = replication::restorable(&self.id, &view, &request.from_node);
        let mut states: Vec<Exported> = Vec::new();
        for shard in &mut self.shards {
            states.extend(shard.core.select_replicas(&pick));
        }
        states.sort_by_key(|s| (s.id.placement, s.id.disc));
        self.repl.restored += states.len() as u64;
        // `Replicator::send_replicas` remembers the incarnation once its installs are
        // in; here the answer carries them, so they are in if it arrives.
        self.restores_served
            .insert(request.from_node.clone(), request.generation);
        let installs = states
            .chunks(MAX_INSTALL_STATES)
            .map(|chunk| calls::install_request(&self.id, chunk, &self.inline))
            .collect();
        let n = states.len() as u64;
        answer(
            installs,
            RestoreResponse {
                sent: n,
                installed: n,
                earlier,
            },
        )
    }

    // ---- the restore (`restore_from_peers`) ------------------------------------------

    /// Whether this node answers as owner yet.
    pub(super) fn restoring(&self) -> bool {
        !self.restore.done
    }

    /// A peer's answer to this node's restore request (its replicas, installed first:
    /// the real peer pushes them before it answers).
    pub(super) fn on_restored(
        &mut self,
        from: &str,
        answer: Result<(Vec<InstallRequest>, RestoreResponse), String>,
    ) -> Vec<Out> {
        let ok = match answer {
            Ok((installs, response)) => {
                for install in installs {
                    self.repl.restore_installed += self.install(install);
                }
                self.restore.restarted |= response.earlier;
                true
            }
            Err(_) => false,
        };
        if self.restore.phase != Phase::Asking || !self.restore.waiting.remove(from) {
            return Vec::new();
        }
        let _ = ok;
        if !self.restore.waiting.is_empty() {
            return Vec::new();
        }
        if !self.restore.restarted {
            return self.finish_restore();
        }
        self.settle_restore()
    }

    fn settle_restore(&mut self) -> Vec<Out> {
        let until = self.clock.monotonic_ms() + RESTORE_SETTLE.as_millis() as u64;
        self.restore.phase = Phase::Settling { until };
        vec![Out::Timer {
            at: until,
            timer: Timer::Restore,
        }]
    }

    /// One step of the restore: at start, on every new view, and on its timer.
    pub(super) fn restore_step(&mut self, view_changed: bool) -> Vec<Out> {
        if self.restore.done {
            return Vec::new();
        }
        let now = self.clock.monotonic_ms();
        if now >= self.restore.deadline {
            return self.finish_restore();
        }
        match self.restore.phase {
            Phase::Asking => return Vec::new(),
            Phase::Settling { until } if !view_changed => {
                return if now >= until {
                    self.finish_restore()
                } else {
                    Vec::new()
                };
            }
            _ => {}
        }
        let view = self.view.clone();
        if view.members.len() <= 1 || view.member(&self.id).is_none() {
            return Vec::new();
        }
        let me = view.member(&self.id).expect("present").clone();
        let new: Vec<String> = view
            .members
            .iter()
            .map(|m| m.node_id.clone())
            .filter(|id| **id != *self.id && !self.restore.asked.contains(id))
            .collect();
        if new.is_empty() {
            // Only after a change of view while settling: wait again.
            return self.settle_restore();
        }
        let mut out = Vec::new();
        for id in new {
            self.restore.asked.insert(id.clone());
            self.restore.waiting.insert(id.clone());
            out.push(Out::Send {
                to: id,
                msg: Msg::Restore(calls::restore_request(&me)),
            });
        }
        self.restore.phase = Phase::Asking;
        out
    }

    /// The restore is over: answer as owner, and take the client checks that waited.
    fn finish_restore(&mut self) -> Vec<Out> {
        self.restore.done = true;
        let mut out = Vec::new();
        for (client, op, key, route, cost) in std::mem::take(&mut self.restore.queued) {
            out.extend(self.on_client_check(client, op, &key, &route, cost));
        }
        out
    }
}
