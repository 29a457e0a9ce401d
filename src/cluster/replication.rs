//! Successor replicas: every key's state also lives on the key's successor, the member
//! that inherits the key when its owner dies (`Ring::successor_of_hash`).
//!
//! The [`Replicator`] runs on every node. Every `--replicate-interval-ms` it takes the
//! keys its shards changed since the last round (coalesced per key, their states as
//! the store keeps them) and sends each to its successor on the authenticated peer
//! link (`Peer/Replicate`), which keeps it beside its own keys
//! (`shard::replicas`). What a crash of the owner alone can lose is what the owner
//! admitted in its last interval (plus any batch whose send failed: counted).
//!
//! It also:
//! - re-sends the full state of every key whose successor changed when the ring
//!   changes (a join, a leave, a dead successor replaced), at most
//!   [`MAX_PER_ROUND`] keys per shard per round;
//! - pushes the admissions this node made on replicas for unreachable owners (the
//!   fail-over decisions) to those owners, merged there like a handoff's deltas;
//! - restores: a node that starts with seeds asks every member it sees for the
//!   replicas of its keys before it answers as owner ([`Restore`]).
//!
//! Promotion needs no step of its own: the first check of a key this node now owns
//! finds the replica and continues its count (`shard::replication`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};

use crate::algorithms::Millis;
use crate::clock::Clock;
use crate::cluster::handoff::{destinations, new_owners, Destinations, MAX_INSTALL_STATES};
use crate::cluster::link::PeerPool;
use crate::cluster::outbox::Outbox;
use crate::membership::{ClusterView, Member};
use crate::ring::Ring;
use crate::shard::replication::{Changed, Gone, Pick};
use crate::shard::{Exported, NewOwner, Recipient, Shards};

pub use super::replica_batches::ReplicaBatches;
pub use memory::{per_owner, Memory, RestoreAnswer, TakeBack, ViewWork};
pub use restore::{restore_from_peers, Restore, Restoring, Step, RESTORE_SETTLE};

mod memory;
mod restore;

/// Most changed keys one shard hands the replicator per round: a ring change marks
/// every key whose successor moved, and their full states go out over several rounds
/// rather than in one burst.
pub const MAX_PER_ROUND: usize = 8_192;

/// Replication metrics.
struct Metrics {
    batches: metrics::Counter,
    bytes: metrics::Counter,
    states: metrics::Counter,
    failed: metrics::Counter,
    lag: metrics::Histogram,
    resynced: metrics::Counter,
    failover_pushed: metrics::Counter,
    failover_lost: metrics::Counter,
    handoff_pushed: metrics::Counter,
    handoff_lost: metrics::Counter,
}

impl Metrics {
    fn new() -> Self {
        Self {
            batches: metrics::counter!("ringlimit_replication_batches_total"),
            bytes: metrics::counter!("ringlimit_replication_bytes_total"),
            states: metrics::counter!("ringlimit_replication_states_total"),
            failed: metrics::counter!("ringlimit_replication_failed_total"),
            lag: metrics::histogram!("ringlimit_replication_lag_seconds"),
            resynced: metrics::counter!("ringlimit_replication_resync_keys_total"),
            failover_pushed: metrics::counter!("ringlimit_failover_deltas_total", "result" => "delivered"),
            failover_lost: metrics::counter!("ringlimit_failover_deltas_total", "result" => "lost"),
            handoff_pushed: metrics::counter!("ringlimit_handoff_pushed_total"),
            handoff_lost: metrics::counter!("ringlimit_handoff_failed_total"),
        }
    }
}

/// Queue, from the keys that `changed` on this node (`me`), those it owns under `view`
/// for their successors (a replica of a key owned elsewhere is that owner's to send).
pub fn collect(view: &ClusterView, me: &str, changed: Vec<Changed>, outbox: &mut Outbox) {
    for c in changed {
        let p = c.state.id.placement;
        if view.ring.owner_of_hash(p) != Some(me) {
            continue;
        }
        if let Some(successor) = view.ring.successor_of_hash(p) {
            outbox.add(successor, c.state, c.since);
        }
    }
}

/// Where the admissions this node (`me`) made on replicas for unreachable owners go:
/// to each key's owner under `view`. A key this node owns now has none to go to (its
/// replica was, or will be, promoted here).
pub fn failover_destinations(view: &ClusterView, me: &str, owed: Vec<Exported>) -> Destinations {
    let to = owed.into_iter().filter_map(|state| {
        let owner = view
            .ring
            .owner_of_hash(state.id.placement)
            .filter(|o| *o != me)?;
        Some((Arc::from(owner), state))
    });
    destinations(view, to.collect())
}

/// Whether the key at ring position `p` must go to its successor in full after the ring
/// changed from `old` to `new`: `me` owns it under `new`, it has a successor, and either
/// that successor is new or the key is new to `me` (inherited or handed over).
pub fn needs_full_state(me: &str, old: &Ring, new: &Ring, p: u64) -> bool {
    new.owner_of_hash(p) == Some(me)
        && new.successor_of_hash(p).is_some()
        && (old.successor_of_hash(p) != new.successor_of_hash(p)
            || old.owner_of_hash(p) != Some(me))
}

/// The replicas to drop when the view goes from `old` to `new` (`None`: none), for
/// keys a live old owner hands over itself (its handoff pushes the full state to the
/// new owner): a replica of such a key promoted or restored as well would count the
/// same admissions twice once the push is merged. Two cases:
/// - the old owner announced a leave;
/// - the key moved to a member that joined (or came back) in `new`, from another
///   member that is still here as the same incarnation (a
///   successor held a replica from a key's interim owner, and the key's owner came
///   back, got the interim owner's handoff and that replica too).
///
/// Keys whose old owner is gone keep their replicas: that is what they are for; and so
/// do keys this node owned under `old` (it hands its live count over; its replica of
/// a key it never promoted is still the dead owner's count).
pub fn handed_over_by_live_owner(me: &str, old: &ClusterView, new: &ClusterView) -> Option<Pick> {
    if old.ring.digest() == new.ring.digest() {
        return None;
    }
    let same = |id: &str| {
        let (before, after) = (old.member(id), new.member(id));
        before.is_some_and(|b| after.is_some_and(|a| a.generation == b.generation))
    };
    let stays: Vec<String> = old
        .members
        .iter()
        .filter(|m| m.node_id != me && same(&m.node_id))
        .map(|m| m.node_id.clone())
        .collect();
    let leavers: Vec<String> = new
        .members
        .iter()
        .filter(|m| m.leaving && old.member(&m.node_id).is_some_and(|o| !o.leaving))
        .map(|m| m.node_id.clone())
        .collect();
    let joiners: Vec<String> = new
        .members
        .iter()
        .filter(|m| !same(&m.node_id))
        .map(|m| m.node_id.clone())
        .collect();
    if stays.is_empty() || (leavers.is_empty() && joiners.is_empty()) {
        return None;
    }
    let (old_ring, new_ring) = (old.ring.clone(), new.ring.clone());
    Some(Arc::new(move |p| {
        let (Some(before), after) = (old_ring.owner_of_hash(p), new_ring.owner_of_hash(p)) else {
            return false;
        };
        let live = stays.iter().any(|s| s == before);
        live && (leavers.iter().any(|l| l == before)
            || after.is_some_and(|a| a != before && joiners.iter().any(|j| j == a)))
    }))
}

/// Whether a replica of the key at `placement` sent by `from` is kept: only if `from`
/// owns the key under this node's view. A sender whose view is behind (it has not seen
/// the key's new owner join yet) would leave a replica here that the new owner's restore
/// or this node's promotion counts beside the sender's own handoff of the same state
/// (see [`handed_over_by_live_owner`]). A replica refused while the views converge is sent again
/// when its key next changes (or in full, when the sender sees the ring change).
pub fn from_owner(view: &ClusterView, placement: u64, from: &str) -> bool {
    view.ring.owner_of_hash(placement) == Some(from)
}

/// The replicas `me` sends back to `owner` restoring: those of keys `view` gives
/// `owner` and whose successor is `me`. Only a key's successor holds its replica, and it
/// takes replicas only from the key's owner ([`from_owner`]): so these are the owner's
/// own (an earlier incarnation's, or kept here unpromoted while it was off the ring).
/// A replica held from another owner (one the key moved from when `owner` joined) is
/// not: its successor under `view` is that owner, which hands the key over itself.
pub fn restorable(me: &str, view: &ClusterView, owner: &str) -> Pick {
    let ring = view.ring.clone();
    let (me, owner): (Arc<str>, Arc<str>) = (Arc::from(me), Arc::from(owner));
    Arc::new(move |p| {
        ring.owner_of_hash(p) == Some(&*owner) && ring.successor_of_hash(p) == Some(&*me)
    })
}

/// The keys to hand `joiner` there and then when it asks this node to restore but
/// this node's view does not hold it yet (a new member, or one back after the cluster
/// dropped it): those the ring of `view` with `joiner` in it gives to `joiner`. Its
/// restore waits for them, so it does not answer as owner from empty until this node's
/// view catches up and the ring change hands them over (the simulator's seeds 2850 and
/// 3844: an owner back 1.4 s after a kill admitted a promoted key again from empty).
pub fn joining(view: &ClusterView, joiner: &str, generation: u64) -> NewOwner {
    let ring = ring_with(view, joiner);
    let joiner = Recipient::new(joiner, generation);
    Arc::new(move |p| (ring.owner_of_hash(p) == Some(&*joiner.id)).then(|| joiner.clone()))
}

/// The replicas to hand a joiner that asks to restore while `view` does not hold it:
/// those of keys `view` gives to `me` (their owner is gone, and no check has promoted
/// them into live keys yet) that the joiner owns once it is in. The handoff exports live
/// keys only, and the replicas would otherwise follow only when this node's view takes
/// the joiner in ([`unpromoted`]): after its restore let it answer as owner from empty.
pub fn joining_replicas(me: &str, view: &ClusterView, joiner: &str) -> Pick {
    let (me, now, with): (Arc<str>, _, _) =
        (Arc::from(me), view.ring.clone(), ring_with(view, joiner));
    let joiner: Arc<str> = Arc::from(joiner);
    Arc::new(move |p| now.owner_of_hash(p) == Some(&*me) && with.owner_of_hash(p) == Some(&*joiner))
}

/// The owner of each key on the ring of `view` with `joiner` (as incarnation
/// `generation`) in it, `None` where that is `me`.
pub fn owner_with(view: &ClusterView, joiner: &str, generation: u64, me: &str) -> NewOwner {
    let ring = ring_with(view, joiner);
    let me: Arc<str> = Arc::from(me);
    let generations: HashMap<String, u64> = view
        .members
        .iter()
        .map(|m| (m.node_id.clone(), m.generation))
        .chain(std::iter::once((joiner.to_string(), generation)))
        .collect();
    Arc::new(move |p| {
        let owner = ring.owner_of_hash(p).filter(|owner| *owner != &*me)?;
        Some(Recipient::new(owner, *generations.get(owner)?))
    })
}

/// The ring of `view` with `joiner` in it.
fn ring_with(view: &ClusterView, joiner: &str) -> Ring {
    Ring::new(
        view.members
            .iter()
            .filter(|m| !m.leaving && m.node_id != joiner)
            .map(|m| m.node_id.as_str())
            .chain(std::iter::once(joiner)),
        view.ring.vnodes(),
    )
}

/// Members of `new` absent from `old` whose generation is higher than the last one
/// `seen` (this node's memory of every member it ever saw): they restarted while the
/// cluster had dropped them, with empty memory.
pub fn reborn(old: &ClusterView, new: &ClusterView, seen: &HashMap<String, u64>) -> Vec<String> {
    new.members
        .iter()
        .filter(|m| old.member(&m.node_id).is_none())
        .filter(|m| seen.get(&m.node_id).is_some_and(|&g| g < m.generation))
        .map(|m| m.node_id.clone())
        .collect()
}

/// The replicas to hand over when the view goes from `old` to `new` (`None`: none):
/// those of keys `old` gave to `me` (their owner had gone) and `new` gives back to
/// that owner, `reborn` (see [`reborn`]). A check would have promoted such a replica
/// into a live key, which the handoff pushes to the owner; one never checked meanwhile
/// is still a replica (the handoff exports live keys only), and the restarted owner's
/// restore gets nothing from a member that saw it dropped: without this its count is
/// lost. An owner back under the same generation (it was
/// only cut off) still has its count: its replicas stay.
///
/// Only the key's successor under `new` hands its replica back, as only it restores
/// one ([`restorable`]): a view that takes in several members at once (a whole cluster
/// restarted) can leave another member than the successor holding a copy, such as the
/// owner's own replica of its new incarnation, sent because its first ring made that
/// member its successor; handed back beside the successor's, it was added to the count
/// twice (a key at 6 answered 12).
pub fn unpromoted(
    me: &str,
    old: &ClusterView,
    new: &ClusterView,
    reborn: Vec<String>,
) -> Option<Pick> {
    if reborn.is_empty() || old.ring.digest() == new.ring.digest() {
        return None;
    }
    let (me, old_ring, new_ring): (Arc<str>, _, _) =
        (Arc::from(me), old.ring.clone(), new.ring.clone());
    Some(Arc::new(move |p| {
        old_ring.owner_of_hash(p) == Some(&*me)
            && new_ring.successor_of_hash(p) == Some(&*me)
            && new_ring
                .owner_of_hash(p)
                .is_some_and(|owner| reborn.iter().any(|r| r == owner))
    }))
}

/// The `reborn` members (see [`reborn`]) whose incarnation in `new` did not restore
/// from this node's replicas (`served`: member → incarnation this node pushed its
/// replicas to). One that did holds them already: it restarted before this node's view
/// noticed, asked here while the view still held its earlier incarnation, and was
/// answered with the replicas; the cluster then dropped that earlier incarnation and
/// took the new one in, and handing the same replicas over again as unpromoted doubled
/// its counts (a key at 5 answered 10).
pub fn not_restored_here(
    new: &ClusterView,
    reborn: Vec<String>,
    served: &HashMap<String, u64>,
) -> Vec<String> {
    reborn
        .into_iter()
        .filter(|id| {
            new.member(id)
                .is_none_or(|m| served.get(id) != Some(&m.generation))
        })
        .collect()
}

/// Members of `old` that `new` no longer holds (dead, or dropped while cut off), each
/// with the generation after the last one seen: the keys this node handed to them are
/// taken back (by the replicator on each view change).
pub fn departed(old: &ClusterView, new: &ClusterView) -> Vec<(String, u64)> {
    old.members
        .iter()
        .filter(|m| new.member(&m.node_id).is_none())
        .map(|m| (m.node_id.clone(), m.generation.saturating_add(1)))
        .collect()
}

/// Members of `new` that were in `old` as an earlier incarnation (the same id, a lower
/// generation): they restarted before the cluster dropped them.
pub fn restarted_in_place(old: &ClusterView, new: &ClusterView) -> Vec<Member> {
    new.members
        .iter()
        .filter(|m| {
            old.member(&m.node_id)
                .is_some_and(|before| m.generation > before.generation)
        })
        .cloned()
        .collect()
}

/// A send of the replicator's that ended (see [`Replicator::run`]).
enum Flight {
    /// A batch to `successor`; the placements of the states it did not deliver, with
    /// when each first changed.
    Replicated {
        successor: Arc<str>,
        failed: Vec<(u64, Millis)>,
    },
    /// A push of fail-over admissions to their owners.
    FailoverPushed,
    /// A push of handed-over states (a [`Push`]).
    Handed,
}

/// States handed over on a view change, to push to `to`. The view change takes them
/// out of the shards there and then; the push runs beside the replication rounds
/// rather than inside the view change, so a slow or unreachable new owner (the install
/// deadline is 5 s) holds back no replica of this node's: otherwise an owner killed a
/// second after its admissions may have sent its successor none of them.
struct Push {
    to: Member,
    states: Vec<Exported>,
    why: &'static str,
}

/// Sends changed keys to their successors, every interval.
pub struct Replicator {
    me: Arc<str>,
    shards: Shards,
    peers: PeerPool,
    clock: Arc<dyn Clock>,
    metrics: Metrics,
    /// What this node remembers of the members it has seen (see [`Memory`]).
    memory: std::sync::Mutex<Memory>,
    /// The number of the last replication batch sent (see [`ReplicaBatches`]).
    batches: std::sync::atomic::AtomicU64,
    /// The latest batch held from each sender.
    held_batches: ReplicaBatches,
}

impl Replicator {
    /// Whether `node` at `generation` restarted in place as far as this node saw (see
    /// [`Memory::restarted_in_place`]).
    pub fn restarted_in_place(&self, node: &str, generation: u64) -> bool {
        self.memory().restarted_in_place(node, generation)
    }

    /// Remember `members` (node id, generation) as seen, as of a snapshot this node
    /// wrote before it stopped (see [`Memory::remember_members`]).
    pub fn remember_members(&self, members: &[(String, u64)]) {
        let now = self.clock.now_ms();
        self.memory().remember_members(&self.me, members, now);
    }

    /// How to answer `node` at `generation` asking to restore, under `view` (see
    /// [`Memory::restore_answer`]).
    pub fn restore_answer(&self, view: &ClusterView, node: &str, generation: u64) -> RestoreAnswer {
        self.memory().restore_answer(view, node, generation)
    }

    fn memory(&self) -> std::sync::MutexGuard<'_, Memory> {
        self.memory.lock().expect("memory lock")
    }

    /// The replicator of node `me`.
    pub fn new(me: Arc<str>, shards: Shards, peers: PeerPool, clock: Arc<dyn Clock>) -> Self {
        Self {
            me,
            shards,
            peers,
            clock,
            metrics: Metrics::new(),
            memory: std::sync::Mutex::new(Memory::default()),
            batches: std::sync::atomic::AtomicU64::new(0),
            held_batches: ReplicaBatches::default(),
        }
    }

    /// Whether a replication batch from `from` is held here (see [`ReplicaBatches`]).
    pub fn admit_batch(&self, from: &str, generation: u64, number: u64) -> bool {
        self.held_batches.admit(from, generation, number)
    }

    /// Replicate every `every` and follow ring changes, until `cancel`.
    ///
    /// No round runs while `restore` is not over: a restarted node's keys are not its
    /// own count until their replicas are back, and a state sent to a successor
    /// replaces the replica there, which may be the only full count of the key (a
    /// restoring owner's first round sent a key's count of 1 over its successor's
    /// replica of 10, and the successor's next fail-over check admitted from 1). Changed keys stay marked and go in the first round after.
    ///
    /// Each successor has at most one batch in flight, and no send holds back the
    /// loop: a round collects the changed keys into the [`Outbox`] and starts a batch
    /// for every successor without one, and the fail-over push runs beside them (see
    /// `cluster::outbox` for why).
    pub async fn run(
        &self,
        mut views: watch::Receiver<Arc<ClusterView>>,
        every: Duration,
        restore: Arc<Restore>,
        cancel: CancellationToken,
    ) {
        let mut current = views.borrow_and_update().clone();
        self.memory().first_view(&current, self.clock.now_ms());
        let mut tracking = None;
        self.track(&current, &mut tracking).await;
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Sends in flight: a batch per successor, the fail-over push (see `outbox`).
        let mut outbox = Outbox::default();
        let mut flights: FuturesUnordered<BoxFuture<'_, Flight>> = FuturesUnordered::new();
        let mut pushing_failover = false;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                changed = views.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let next = views.borrow_and_update().clone();
                    let work = self.memory().view_changed(&self.me, &current, &next, self.clock.now_ms());
                    for push in self.view_changed(work, &next, &mut tracking).await {
                        flights.push(Box::pin(async move {
                            self.push_handed(&push.to, &push.states, push.why).await;
                            Flight::Handed
                        }));
                    }
                    self.retry(outbox.take_waiting()).await;
                    current = next;
                }
                Some(flight) = flights.next(), if !flights.is_empty() => match flight {
                    Flight::Replicated { successor, failed } => {
                        outbox.done(&successor);
                        self.retry(failed).await;
                    }
                    Flight::FailoverPushed => pushing_failover = false,
                    Flight::Handed => {}
                },
                _ = tick.tick() => {
                    if restore.is_done() {
                        self.collect(&current, &mut outbox).await;
                        for (successor, states) in outbox.ready() {
                            flights.push(Box::pin(self.send(current.clone(), successor, states)));
                        }
                        if !pushing_failover {
                            pushing_failover = true;
                            let view = current.clone();
                            flights.push(Box::pin(async move {
                                self.push_failover(&view).await;
                                Flight::FailoverPushed
                            }));
                        }
                    }
                }
            }
        }
    }

    /// Have the shards track changed keys only while a key of this node can have a
    /// successor (a ring of two or more): a lone node has nowhere to send them, and
    /// tracking them costs it a map entry per changed key and a snapshot per key and
    /// round. Once it has a successor again, the resync that follows a ring change
    /// marks every key it owns (`needs_full_state`). `tracking` is what the shards were
    /// last told.
    async fn track(&self, view: &ClusterView, tracking: &mut Option<bool>) {
        let on = view.ring.len() > 1;
        if *tracking == Some(on) {
            return;
        }
        match self.shards.track_changes(on).await {
            Ok(()) => *tracking = Some(on),
            Err(error) => tracing::debug!(%error, "switching change tracking failed"),
        }
    }

    /// Perform a view change's work (see [`Memory::view_changed`]) on the shards for
    /// the view `new`: returns the pushes of handed-over states, which run beside the
    /// replication rounds (see [`Push`]).
    async fn view_changed(
        &self,
        work: ViewWork,
        new: &ClusterView,
        tracking: &mut Option<bool>,
    ) -> Vec<Push> {
        if !work.forgotten.is_empty() {
            self.held_batches
                .retain(|id| !work.forgotten.iter().any(|f| f == id));
        }
        if let Some(pick) = work.drop_replicas {
            match self.shards.drop_replicas(pick).await {
                Ok(0) => {}
                Ok(dropped) => tracing::info!(
                    dropped,
                    "keys moved away from live owners: their replicas dropped (the handoff brings their states)"
                ),
                Err(error) => tracing::debug!(%error, "dropping handed-over replicas failed"),
            }
        }
        let mut pushes = Vec::new();
        for TakeBack { back, why } in work.take_back {
            let states = self
                .take_back(back, new_owners(new, self.me.clone()), why)
                .await;
            pushes.extend(self.pushes(new, states, why));
        }
        if let Some(pick) = work.unpromoted {
            match self.shards.select_replicas(pick).await {
                Ok(states) => {
                    let owned = states.into_iter().filter_map(|state| {
                        let owner = new.ring.owner_of_hash(state.id.placement)?;
                        Some((Arc::from(owner), state))
                    });
                    let owned: Vec<_> = owned.collect();
                    if !owned.is_empty() {
                        tracing::info!(
                            keys = owned.len(),
                            "unpromoted replicas to hand back to a restarted owner"
                        );
                    }
                    pushes.extend(self.pushes(new, owned, "unpromoted"));
                }
                Err(error) => tracing::debug!(%error, "copying unpromoted replicas failed"),
            }
        }
        // Before the resyncs: they mark keys in what the shards track.
        self.track(new, tracking).await;
        for (pick, why) in work.resync {
            match self.shards.resync(pick).await {
                Ok(marked) if marked > 0 => {
                    self.metrics.resynced.increment(marked as u64);
                    tracing::info!(keys = marked, why, "full states to send");
                }
                Ok(_) => {}
                Err(error) => tracing::debug!(%error, "resync failed"),
            }
        }
        pushes
    }

    /// `states` grouped into a push per owner, members of `view` (the states of an
    /// owner it does not hold are counted lost).
    fn pushes(
        &self,
        view: &ClusterView,
        states: Vec<(Arc<str>, Exported)>,
        why: &'static str,
    ) -> Vec<Push> {
        let (found, lost) = per_owner(view, states);
        self.metrics.handoff_lost.increment(lost.len() as u64);
        found
            .into_iter()
            .map(|(to, states)| Push { to, states, why })
            .collect()
    }

    /// The keys handed to incarnations of `back` members (id, generation now) earlier
    /// than the one now, taken back (see [`Shards::hand_again`]).
    async fn take_back(
        &self,
        back: Vec<(String, u64)>,
        new_owner: NewOwner,
        why: &'static str,
    ) -> Vec<(Arc<str>, Exported)> {
        let count = back.len();
        let gone: Gone = Arc::new(move |id, generation| {
            back.iter().any(|(b, now)| b == id && generation < *now)
        });
        match self.shards.hand_again(gone, new_owner).await {
            Ok(states) => {
                if !states.is_empty() {
                    tracing::info!(
                        members = count,
                        keys = states.len(),
                        why,
                        "keys handed to members since gone or restarted: taken back"
                    );
                }
                states
            }
            Err(error) => {
                tracing::debug!(%error, "handing keys again failed");
                Vec::new()
            }
        }
    }

    /// Push handed-over states to `to`, counting what is lost: returns (sent, installed).
    async fn push_handed(&self, to: &Member, states: &[Exported], why: &'static str) -> (u64, u64) {
        let (mut sent, mut installed) = (0, 0);
        for chunk in states.chunks(MAX_INSTALL_STATES) {
            match self.peers.install(to, chunk, why).await {
                Ok(n) => {
                    sent += chunk.len() as u64;
                    installed += n;
                }
                Err(error) => {
                    self.metrics.handoff_lost.increment(chunk.len() as u64);
                    tracing::error!(to = %to.node_id, %error, keys = chunk.len(), "handoff push failed: these counts are lost");
                }
            }
        }
        self.metrics.handoff_pushed.increment(sent);
        (sent, installed)
    }

    /// Take the keys changed since the last call into `outbox`, each for its successor
    /// under `view` (keys this node does not own under it are left out: their owner
    /// replicates them).
    async fn collect(&self, view: &ClusterView, outbox: &mut Outbox) {
        match self.shards.drain_replication(MAX_PER_ROUND).await {
            Ok(changed) => collect(view, &self.me, changed, outbox),
            Err(error) => tracing::debug!(%error, "replication drain failed"),
        }
    }

    /// Send `states` (each with when its key first changed) to `successor`, a member of
    /// `view`. The lag recorded is from that change to the successor's answer.
    async fn send(
        &self,
        view: Arc<ClusterView>,
        successor: Arc<str>,
        states: Vec<(Exported, Millis)>,
    ) -> Flight {
        let mut failed = Vec::new();
        let Some(member) = view.member(&successor) else {
            self.metrics.failed.increment(states.len() as u64);
            failed.extend(states.iter().map(|(s, since)| (s.id.placement, *since)));
            return Flight::Replicated { successor, failed };
        };
        let generation = view.member(&self.me).map_or(0, |m| m.generation);
        for chunk in states.chunks(MAX_INSTALL_STATES) {
            let (states, since): (Vec<Exported>, Vec<Millis>) = chunk.iter().cloned().unzip();
            let number = 1 + self
                .batches
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            match self
                .peers
                .replicate(member, &states, (generation, number))
                .await
            {
                Ok((_, bytes)) => {
                    self.metrics.batches.increment(1);
                    self.metrics.bytes.increment(bytes as u64);
                    self.metrics.states.increment(states.len() as u64);
                    let now = self.clock.now_ms();
                    for since in since {
                        self.metrics
                            .lag
                            .record(now.saturating_sub(since) as f64 / 1000.0);
                    }
                }
                Err(error) => {
                    self.metrics.failed.increment(states.len() as u64);
                    failed.extend(states.iter().map(|s| s.id.placement).zip(since));
                    tracing::debug!(to = %successor, %error, keys = states.len(), "replication batch not delivered");
                }
            }
        }
        Flight::Replicated { successor, failed }
    }

    /// Mark the keys at the placements of `owed` changed again, so the next round
    /// sends them: a replica whose batch failed is not left stale until its key next
    /// changes. Each stays owed since its first change, so the lag recorded when it
    /// does arrive is the whole time its successor lacked it. (A successor that stays
    /// unreachable is dropped from the ring, and its keys' new successor gets their full
    /// state then.)
    async fn retry(&self, owed: Vec<(u64, Millis)>) {
        if owed.is_empty() {
            return;
        }
        if let Err(error) = self.shards.retry(owed).await {
            tracing::debug!(%error, "marking undelivered replicas for the next round failed");
        }
    }

    /// Push what this node admitted on replicas for unreachable owners to those owners
    /// (merged there). A push that fails is lost and counted: the owner, if it is alive
    /// and can be reached again, under-counts those admissions.
    async fn push_failover(&self, view: &ClusterView) {
        let owed = match self.shards.drain_failover().await {
            Ok(owed) if !owed.is_empty() => owed,
            _ => return,
        };
        let routed = failover_destinations(view, &self.me, owed);
        for (_, lost) in &routed.gone {
            self.metrics.failover_lost.increment(*lost as u64);
        }
        // Every owner at once: these owners were unreachable a moment ago, and each
        // one still down costs a timeout.
        let pushes = routed.to.iter().map(|(member, states)| async move {
            for chunk in states.chunks(MAX_INSTALL_STATES) {
                match self.peers.install(member, chunk, "failover").await {
                    Ok(_) => self.metrics.failover_pushed.increment(chunk.len() as u64),
                    Err(_) => self.metrics.failover_lost.increment(chunk.len() as u64),
                }
            }
        });
        futures_util::future::join_all(pushes).await;
    }

    /// Hand `joiner`, asking to restore while `view` does not hold it, the live keys
    /// it owns once it is in (see [`joining`]): exported as a ring change exports them
    /// (kept here, marked moved, so checks from nodes on the old view go on counting on
    /// them and their admissions follow as deltas), pushed before this node answers.
    /// Returns (sent, installed).
    ///
    /// A joiner this node saw before under an earlier incarnation (back after the
    /// cluster dropped it) first gets again the keys handed to that incarnation (see
    /// `shard::replication::Side::hand_again`) that are its own with it in; not one
    /// `rejoining` after a graceful leave, which handed its keys on itself
    /// ([`RestoreAnswer::Rejoiner`]).
    pub async fn hand_over_to_joiner(
        &self,
        view: &ClusterView,
        joiner: &Member,
        rejoining: bool,
    ) -> (u64, u64) {
        let mut states: Vec<Exported> = Vec::new();
        if !rejoining
            && self
                .memory()
                .claim_hand_again(&joiner.node_id, joiner.generation)
        {
            let owners = owner_with(view, &joiner.node_id, joiner.generation, &self.me);
            let back = vec![(joiner.node_id.clone(), joiner.generation)];
            let again = self.take_back(back, owners, "hand again").await;
            let mut others: HashMap<Arc<str>, Vec<Exported>> = HashMap::new();
            for (owner, state) in again {
                if *owner == *joiner.node_id {
                    states.push(state);
                } else {
                    others.entry(owner).or_default().push(state);
                }
            }
            for (owner, states) in others {
                match view.member(&owner) {
                    Some(member) => drop(
                        self.push_handed(member, &states, "hand again, joiner asked")
                            .await,
                    ),
                    None => self.metrics.handoff_lost.increment(states.len() as u64),
                }
            }
        }
        if let Ok(exported) = self
            .shards
            .export(joining(view, &joiner.node_id, joiner.generation), None)
            .await
        {
            // A restoring joiner is a new incarnation: nothing here was started from
            // its replicas, every state adds.
            states.extend(exported.merged.into_iter().map(|(_, state)| state));
        }
        // Its replicas are its count once pushed: claimed first, so the view change
        // that takes it in meanwhile does not hand them over again as unpromoted, nor
        // this restore those the view change handed (see [`Memory::claim_restore`]).
        let claimed = self
            .memory()
            .claim_restore(&joiner.node_id, joiner.generation);
        let mut unpromoted = 0;
        if claimed {
            let pick = joining_replicas(&self.me, view, &joiner.node_id);
            let replicas = self.shards.select_replicas(pick).await.unwrap_or_default();
            unpromoted = replicas.len() as u64;
            states.extend(replicas);
        }
        let (sent, installed) = if states.is_empty() {
            (0, 0)
        } else {
            self.push_handed(joiner, &states, "to joiner").await
        };
        if claimed && (unpromoted == 0 || sent < states.len() as u64) {
            self.memory()
                .release_restore(&joiner.node_id, joiner.generation);
        }
        (sent, installed)
    }

    /// Push `to` every replica held here of a key `view` gives it (it restarted and
    /// restores): returns (sent, installed). This node remembers that incarnation as
    /// restored from here (from before the push until one of them fails to get in):
    /// its replicas are its count now, and handing them to it again when the cluster
    /// drops its earlier incarnation and takes it back would count them twice (see
    /// [`not_restored_here`]).
    pub async fn send_replicas(&self, view: &ClusterView, member: &Member) -> (u64, u64) {
        // Remembered before the push, so a view change while it is on its way sees it
        // (see [`Memory::claim_restore`]); given back if they do not all get in.
        let claimed = self
            .memory()
            .claim_restore(&member.node_id, member.generation);
        let pick = restorable(&self.me, view, &member.node_id);
        let Ok(states) = self.shards.select_replicas(pick).await else {
            if claimed {
                self.memory()
                    .release_restore(&member.node_id, member.generation);
            }
            return (0, 0);
        };
        let (mut sent, mut installed) = (0, 0);
        for chunk in states.chunks(MAX_INSTALL_STATES) {
            if let Ok(n) = self.peers.install(member, chunk, "restore").await {
                sent += chunk.len() as u64;
                installed += n;
            }
        }
        if claimed && sent < states.len() as u64 {
            self.memory()
                .release_restore(&member.node_id, member.generation);
        }
        (sent, installed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(members: &[&str]) -> Ring {
        Ring::new(members.iter().copied(), Ring::DEFAULT_VNODES)
    }

    /// Positions owned by `owner` in `ring`, from a fixed sample.
    fn owned_by<'a>(ring: &'a Ring, owner: &'a str) -> impl Iterator<Item = u64> + 'a {
        (0..20_000u64)
            .map(|i| Ring::key_hash(format!("k{i}").as_bytes()))
            .filter(move |&p| ring.owner_of_hash(p) == Some(owner))
    }

    #[test]
    fn a_joiner_is_handed_the_replicas_of_keys_it_takes_from_this_node_only() {
        use crate::cluster::policy::testkit::view;
        let view = view(&["a", "b"]);
        let with = ring(&["a", "b", "c"]);
        let pick = joining_replicas("a", &view, "c");
        let mut picked = 0;
        for p in (0..2_000u64).map(|i| Ring::key_hash(format!("k{i}").as_bytes())) {
            let expected =
                view.ring.owner_of_hash(p) == Some("a") && with.owner_of_hash(p) == Some("c");
            assert_eq!(pick(p), expected, "placement {p}");
            picked += usize::from(expected);
        }
        assert!(picked > 0, "c takes some of a's keys");
    }

    #[test]
    fn a_member_back_with_this_nodes_replicas_is_not_handed_them_again() {
        use crate::cluster::policy::testkit::{member, view};
        // b restarted as generation 2 and restored from a, whose view still held b@1;
        // then a's view dropped b@1 (a owned b's keys, their replicas unpromoted) and
        // took b@2 in.
        let dropped = view(&["a", "c"]);
        let mut b2 = member("b", 7100);
        b2.generation = 2;
        let mut members = dropped.members.clone();
        members.push(b2);
        let back = ClusterView::from_members(members);
        let seen = HashMap::from([("b".to_string(), 1)]);
        let reborn_b = reborn(&dropped, &back, &seen);
        assert_eq!(reborn_b, vec!["b".to_string()]);

        let restored_b2 = HashMap::from([("b".to_string(), 2)]);
        let left = not_restored_here(&back, reborn_b.clone(), &restored_b2);
        assert!(left.is_empty(), "b@2 has the replicas: none go again");
        assert!(unpromoted("a", &dropped, &back, left).is_none());

        // Restored here as an earlier incarnation, or never: b@2 gets them.
        let restored_b1 = HashMap::from([("b".to_string(), 1)]);
        for served in [restored_b1, HashMap::new()] {
            let left = not_restored_here(&back, reborn_b.clone(), &served);
            assert_eq!(left, vec!["b".to_string()]);
            let pick = unpromoted("a", &dropped, &back, left).expect("b's keys go back");
            let p = owned_by(&back.ring, "b")
                .find(|&p| dropped.ring.owner_of_hash(p) == Some("a"))
                .expect("a key a held for b");
            assert!(pick(p));
        }
    }

    #[test]
    fn a_restoring_joiner_gets_exactly_the_keys_it_owns_once_in() {
        use crate::cluster::policy::testkit::view;
        let (now, with) = (view(&["a", "b", "c"]), ring(&["a", "b", "c", "d"]));
        let (to_d, owners) = (joining(&now, "d", 2), owner_with(&now, "d", 2, "a"));
        let (mut mine, mut others) = (0, 0);
        for i in 0..20_000u64 {
            let p = Ring::key_hash(format!("k{i}").as_bytes());
            let owner = with.owner_of_hash(p).unwrap();
            assert_eq!(
                to_d(p),
                (owner == "d").then(|| Recipient::new("d", 2)),
                "the joiner, as the incarnation that asked"
            );
            match owners(p) {
                None => {
                    assert_eq!(owner, "a");
                    mine += 1;
                }
                Some(o) => {
                    assert_eq!(&*o.id, owner);
                    assert_eq!(o.generation, if owner == "d" { 2 } else { 1 });
                    others += 1;
                }
            }
        }
        assert!(mine > 0 && others > 0);
        // A joiner already in the view (or an earlier incarnation of it): the same ring.
        let again = joining(&view(&["a", "b", "c", "d"]), "d", 2);
        for p in owned_by(&with, "d").take(100) {
            assert_eq!(again(p), Some(Recipient::new("d", 2)));
        }
    }

    #[test]
    fn a_join_resends_exactly_the_keys_whose_successor_moved() {
        let (old, new) = (ring(&["a", "b", "c"]), ring(&["a", "b", "c", "d"]));
        let (mut moved, mut kept) = (0, 0);
        for p in owned_by(&new, "a") {
            let resend = needs_full_state("a", &old, &new, p);
            assert_eq!(
                resend,
                old.successor_of_hash(p) != new.successor_of_hash(p),
                "a owned it before and after: only a new successor needs it"
            );
            if resend {
                moved += 1;
                assert_eq!(
                    new.successor_of_hash(p),
                    Some("d"),
                    "only the joiner is new"
                );
            } else {
                kept += 1;
            }
        }
        assert!(moved > 0 && kept > moved, "moved {moved}, kept {kept}");
    }

    #[test]
    fn keys_inherited_from_a_dead_owner_go_to_their_new_successor_in_full() {
        let (old, new) = (ring(&["a", "b", "c"]), ring(&["a", "b"]));
        for p in owned_by(&new, "a") {
            let inherited = old.owner_of_hash(p) == Some("c");
            if inherited {
                assert!(needs_full_state("a", &old, &new, p));
            }
        }
        // Keys a does not own are never its to send.
        for p in owned_by(&new, "b") {
            assert!(!needs_full_state("a", &old, &new, p));
        }
        // Alone on the ring, nothing has a successor.
        let alone = ring(&["a"]);
        assert!(owned_by(&alone, "a").all(|p| !needs_full_state("a", &new, &alone, p)));
    }
}
