//! The simulated node's successor replicas: the replicator's round, the
//! successor's side of `Peer/Replicate` and `Peer/Restore`, the fail-over of a check
//! whose owner cannot be reached, and a restarted node's restore.
//!
//! Real (called): the shard's [`ShardCore`](ringlimit::shard::ShardCore) does every
//! decision, hold, drain, resync, retry, promotion and selection; the ring's
//! `successor_of_hash` places replicas; `link::calls` builds the requests (so their
//! sizes are the protocol's); `policy` answers. A round's routing is production's
//! (`replication::collect` into the replicator's [`Outbox`], one batch per successor in
//! flight, failed chunks retried; `replication::failover_destinations` for the
//! fail-over push), a view change's work is `replication::Memory::view_changed`, a
//! restore request's answer its `Memory::restore_answer`, and the restore's steps its
//! `replication::Restoring`: this file performs them on the simulated shards and
//! network. Still modelled, as noted on each function: the service side of
//! `Peer/Replicate` and `Peer/Restore` (`hold_replicas`, `send_replicas`,
//! `hand_over_to_joiner`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use ringlimit::clock::Clock;
use ringlimit::cluster::handoff::MAX_INSTALL_STATES;
use ringlimit::cluster::link::calls;
use ringlimit::cluster::outbox::{Batch, Outbox};
use ringlimit::cluster::replication::{
    self, RestoreAnswer, Restoring, Step, TakeBack, MAX_PER_ROUND,
};
use ringlimit::membership::ClusterView;
use ringlimit::proto::peer::{InstallRequest, RestoreRequest, RestoreResponse};
use ringlimit::shard::{Exported, Recipient};

use super::{Msg, Node, Out, Timer};

/// A node's restore: until it is done, client checks wait and forwarded checks that
/// are not fail-overs are refused (their senders fail over to the successor).
pub struct Restore {
    pub done: bool,
    /// Production's restore steps.
    machine: Restoring,
    /// The wake time of the last restore timer set.
    wake: Option<u64>,
    /// Client checks that arrived meanwhile: (client, op, key, route, cost).
    pub queued: Vec<(u32, u64, String, String, u64)>,
}

impl Restore {
    /// A node that replicates and has seeds restores (`Restore::new(!replicating ||
    /// seeds.is_empty())`), until `deadline` at the latest.
    pub fn new(needed: bool, deadline: u64) -> Restore {
        Restore {
            done: !needed,
            machine: Restoring::new(deadline),
            wake: None,
            queued: Vec::new(),
        }
    }
}

/// The replicator's sends in flight: production's [`Outbox`], and the chunks of each
/// successor's batch not answered yet.
#[derive(Default)]
pub struct Sending {
    outbox: Outbox,
    /// Chunk number → (successor, its keys' placements with when each first changed).
    flying: BTreeMap<u64, (Arc<str>, Owed)>,
    /// Chunks of each successor's batch still unanswered.
    chunks: BTreeMap<Arc<str>, usize>,
    /// Keys of chunks that failed, retried when their batch is over.
    failed: Owed,
}

/// Keys' placements, each with when the key first changed.
type Owed = Vec<(u64, ringlimit::algorithms::Millis)>;

/// Counts of the replication, for the figures.
#[derive(Default, Debug, Clone)]
pub struct ReplicationStats {
    /// States sent to successors, and in how many batches.
    pub replicated: u64,
    pub batches: u64,
    /// States whose chunk failed or whose successor was not in the view (sent again).
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

    /// `Replicator::run`'s tick: the changed keys this node owns into production's
    /// [`Outbox`] (`replication::collect`), a batch to each successor without one in
    /// flight (in chunks of `MAX_INSTALL_STATES`, one `Peer/Replicate` each), then the
    /// fail-over admissions made here to their owners (`push_failover`).
    pub(super) fn replicate_round(&mut self) -> Vec<Out> {
        let next = Out::Timer {
            at: self.clock.monotonic_ms() + self.cfg.replicate_ms,
            timer: Timer::Replicate,
        };
        // No round until the restore is over.
        if self.restoring() {
            return vec![next];
        }
        let mut changed = Vec::new();
        for shard in &mut self.shards {
            changed.extend(shard.core.drain_changed(MAX_PER_ROUND));
        }
        let view = self.view.clone();
        replication::collect(&view, &self.id, changed, &mut self.replicas.outbox);
        let mut out = Vec::new();
        for (successor, batch) in self.replicas.outbox.ready() {
            out.extend(self.send_batch(&view, successor, batch));
        }
        out.extend(self.push_failover(&view));
        out.push(next);
        out
    }

    /// `Replicator::send`: `batch` to `successor` in chunks; a successor the view no
    /// longer lists fails them all at once.
    fn send_batch(&mut self, view: &ClusterView, successor: Arc<str>, batch: Batch) -> Vec<Out> {
        if view.member(&successor).is_none() {
            self.repl.lost += batch.len() as u64;
            self.replicas.outbox.done(&successor);
            let owed = batch.iter().map(|(s, since)| (s.id.placement, *since));
            self.retry(owed.collect());
            return Vec::new();
        }
        let mut out = Vec::new();
        for chunk in batch.chunks(MAX_INSTALL_STATES) {
            let (states, since): (Vec<Exported>, Vec<_>) = chunk.iter().cloned().unzip();
            self.repl.replicated += states.len() as u64;
            self.repl.batches += 1;
            let number = self.repl.batches;
            let owed = states.iter().map(|s| s.id.placement).zip(since).collect();
            self.replicas
                .flying
                .insert(number, (successor.clone(), owed));
            *self.replicas.chunks.entry(successor.clone()).or_default() += 1;
            out.push(Out::Send {
                to: successor.to_string(),
                msg: Msg::Replicate {
                    batch: number,
                    request: calls::replicate_request(
                        &self.id,
                        &states,
                        &self.inline,
                        (self.generation, number),
                    ),
                },
            });
        }
        out
    }

    /// A successor's answer to chunk `batch` (or the call's failure): once every chunk
    /// of its batch is over, the successor may get the next one, and the keys of
    /// chunks that failed go again (`Replicator::retry`).
    pub(super) fn on_replicated(&mut self, batch: u64, ok: bool) {
        let Some((successor, owed)) = self.replicas.flying.remove(&batch) else {
            return;
        };
        if !ok {
            self.repl.lost += owed.len() as u64;
            self.replicas.failed.extend(owed);
        }
        let left = self.replicas.chunks.entry(successor.clone()).or_default();
        *left -= 1;
        if *left == 0 {
            self.replicas.chunks.remove(&successor);
            self.replicas.outbox.done(&successor);
            let failed = std::mem::take(&mut self.replicas.failed);
            self.retry(failed);
        }
    }

    /// `Replicator::retry`: mark the keys at the placements of `owed` changed again
    /// (each owed since its first change), so the next round sends them.
    pub(super) fn retry(&mut self, owed: Owed) {
        let mut groups: Vec<HashMap<u64, ringlimit::algorithms::Millis>> =
            vec![HashMap::new(); self.shards.len()];
        for (placement, since) in owed {
            let t = groups[Self::shard_of(placement)]
                .entry(placement)
                .or_insert(since);
            *t = (*t).min(since);
        }
        for (shard, owed) in self.shards.iter_mut().zip(groups) {
            if !owed.is_empty() {
                let now = shard.clock.now_ms();
                shard.core.retry(Arc::new(owed), now);
            }
        }
    }

    /// `Replicator::push_failover`: each owner's admissions by `Peer/Install`
    /// (`replication::failover_destinations`).
    fn push_failover(&mut self, view: &ClusterView) -> Vec<Out> {
        let mut owed = Vec::new();
        for shard in &mut self.shards {
            owed.extend(shard.core.drain_failover());
        }
        if owed.is_empty() {
            return Vec::new();
        }
        let routed = replication::failover_destinations(view, &self.id, owed);
        let mut out = Vec::new();
        for (owner, states) in routed.to {
            self.repl.failover_pushed += states.len() as u64;
            for chunk in states.chunks(MAX_INSTALL_STATES) {
                out.push(Out::Send {
                    to: owner.node_id.clone(),
                    msg: Msg::Install(calls::install_request(&self.id, chunk, &self.inline)),
                });
            }
        }
        out
    }

    /// `Replicator::run`'s step for a new view: the work production's
    /// [`Memory::view_changed`](replication::Memory::view_changed) asks for, performed
    /// on the simulated shards as `Replicator::view_changed` performs it.
    pub(super) fn successors_changed(&mut self, old: &ClusterView, new: &ClusterView) -> Vec<Out> {
        if !self.replicating() {
            return Vec::new();
        }
        let now = self.clock.now_ms();
        let work = self.memory.view_changed(&self.id, old, new, now);
        // States waiting for a successor go where the new view says.
        let waiting = self.replicas.outbox.take_waiting();
        self.retry(waiting);
        if !work.forgotten.is_empty() {
            self.held_batches
                .retain(|id| !work.forgotten.iter().any(|f| f == id));
        }
        if let Some(pick) = &work.drop_replicas {
            for shard in &mut self.shards {
                shard.core.drop_replicas(pick);
            }
        }
        let mut out = Vec::new();
        for TakeBack { back, .. } in work.take_back {
            let new_owner = ringlimit::cluster::handoff::new_owners(new, self.id.clone());
            let states = self.take_back(&back, |p| new_owner(p));
            out.extend(self.push(new, states));
        }
        if let Some(pick) = &work.unpromoted {
            let mut owned = Vec::new();
            for shard in &mut self.shards {
                for state in shard.core.select_replicas(pick) {
                    if let Some(owner) = new.ring.owner_of_hash(state.id.placement) {
                        owned.push((Arc::from(owner), state));
                    }
                }
            }
            out.extend(self.push(new, owned));
        }
        for (pick, _) in &work.resync {
            for shard in &mut self.shards {
                let now = shard.clock.now_ms();
                shard.core.resync(pick, now);
            }
        }
        out
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

    /// `PeerService::hold_replicas`: vet like an install, keep as replicas.
    pub(super) fn on_replicate(&mut self, request: InstallRequest) {
        let from = request.from_node.clone();
        // `Replicator::admit_batch`: a batch older than one held is refused (and
        // answered: the sender's call succeeded).
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
        let answer_with = |installs, response| {
            vec![Out::Send {
                to: from.to_string(),
                msg: Msg::Restored(Ok((installs, response))),
            }]
        };
        if !self.replicating() {
            return answer_with(Vec::new(), RestoreResponse::default());
        }
        let view = self.view.clone();
        let serve = self
            .memory
            .restore_answer(&view, &request.from_node, request.generation);
        if matches!(serve, RestoreAnswer::Joiner | RestoreAnswer::Rejoiner) {
            // `Replicator::hand_over_to_joiner`: a requester this view does not hold
            // yet (or holds as its earlier incarnation, leaving) gets its keys handed
            // over before the answer (a joiner first again those handed to an earlier
            // incarnation of it).
            let mut states: Vec<Exported> = Vec::new();
            let mut out = Vec::new();
            if serve == RestoreAnswer::Joiner
                && self
                    .memory
                    .claim_hand_again(&request.from_node, request.generation)
            {
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
            // Claimed as the node claims them (the answer carries the installs: they
            // are in if it arrives, so only an empty pick gives the claim back).
            if self
                .memory
                .claim_restore(&request.from_node, request.generation)
            {
                let pick = replication::joining_replicas(&self.id, &view, &request.from_node);
                let mut unpromoted = 0;
                for shard in &mut self.shards {
                    let replicas = shard.core.select_replicas(&pick);
                    unpromoted += replicas.len();
                    states.extend(replicas);
                }
                if unpromoted == 0 {
                    self.memory
                        .release_restore(&request.from_node, request.generation);
                }
            }
            states.sort_by_key(|s| (s.id.placement, s.id.disc));
            self.stats.handed_over += states.len() as u64;
            let n = states.len() as u64;
            let installs = states
                .chunks(MAX_INSTALL_STATES)
                .map(|chunk| calls::install_request(&self.id, chunk, &self.inline))
                .collect();
            out.extend(answer_with(
                installs,
                RestoreResponse {
                    sent: n,
                    installed: n,
                    earlier: serve == RestoreAnswer::Rejoiner,
                },
            ));
            return out;
        };
        if serve == RestoreAnswer::Nothing {
            // As the real service: a new member, or one back after the cluster dropped
            // it, gets its keys by handoff, not replicas (both would be merged).
            return answer_with(Vec::new(), RestoreResponse::default());
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
        self.memory
            .served_restore(&request.from_node, request.generation);
        let installs = states
            .chunks(MAX_INSTALL_STATES)
            .map(|chunk| calls::install_request(&self.id, chunk, &self.inline))
            .collect();
        let n = states.len() as u64;
        answer_with(
            installs,
            RestoreResponse {
                sent: n,
                installed: n,
                earlier: true,
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
        let earlier = match answer {
            Ok((installs, response)) => {
                for install in installs {
                    self.repl.restore_installed += self.install(install);
                }
                Some(response.earlier)
            }
            Err(_) => None,
        };
        if self.restore.done {
            return Vec::new();
        }
        let now = self.clock.monotonic_ms();
        let step = self.restore.machine.answered(from, earlier, now);
        self.restore_perform(step)
    }

    /// One step of the restore: on every new view (`view_changed`) and on its timer.
    pub(super) fn restore_step(&mut self, view_changed: bool) -> Vec<Out> {
        if self.restore.done {
            return Vec::new();
        }
        let now = self.clock.monotonic_ms();
        let step = if view_changed {
            let view = self.view.clone();
            self.restore.machine.view(&self.id, &view, now)
        } else {
            self.restore.machine.timer(now)
        };
        self.restore_perform(step)
    }

    /// What `restore_from_peers` does with a step: ask, set the timer, or finish.
    fn restore_perform(&mut self, step: Step) -> Vec<Out> {
        let mut out = Vec::new();
        let wake = match step {
            Step::Done { .. } => return self.finish_restore(),
            Step::Wait { wake } => wake,
            Step::Ask { me, members, wake } => {
                for m in members {
                    out.push(Out::Send {
                        to: m.node_id,
                        msg: Msg::Restore(calls::restore_request(&me)),
                    });
                }
                wake
            }
        };
        if self.restore.wake != Some(wake) {
            self.restore.wake = Some(wake);
            out.push(Out::Timer {
                at: wake,
                timer: Timer::Restore,
            });
        }
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
