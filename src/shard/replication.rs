//! A shard's part in replication: which of its keys changed since their successor last
//! heard of them, the replicas it keeps for other owners ([`Replicas`]), and the
//! messages the cluster's replicator sends it ([`Shards::drain_replication`] and the
//! others below). The replicator (`cluster::replication`) decides where states go;
//! the shard only answers with states, in one step of its actor, so a snapshot is
//! never torn by a concurrent check.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tokio::sync::oneshot;

use super::replicas::Replicas;
use super::{
    Charge, Churn, Counter, Exported, KeyId, NewOwner, Recipient, ShardError, Shards, Store,
};
use crate::algorithms::{Decision, Millis};
use crate::config::rules::Rule;

/// Which ring placements a message is about (keys whose successor changed, keys this
/// node now owns, keys of an owner that restarted).
pub type Pick = Arc<dyn Fn(u64) -> bool + Send + Sync>;

/// The fewest changed keys a shard's map keeps room for after a drain shrinks it.
const DIRTY_FLOOR: usize = 1024;

/// A changed key's state for its successor, and since when it was owed.
#[derive(Debug, Clone)]
pub struct Changed {
    /// The key's state now.
    pub state: Exported,
    /// The shard's clock when the key first changed after its last replication.
    pub since: Millis,
}

/// Replication messages to a shard actor.
pub(super) enum Command {
    Track {
        on: bool,
        reply: oneshot::Sender<()>,
    },
    Drain {
        max: usize,
        reply: oneshot::Sender<Vec<Changed>>,
    },
    Resync {
        pick: Pick,
        /// When each placement's key first changed, if it is owed from before (a batch
        /// that was not delivered): its lag counts from there, not from now.
        owed: Option<Arc<HashMap<u64, Millis>>>,
        reply: oneshot::Sender<usize>,
    },
    Hold {
        items: Vec<(Exported, Arc<Rule>)>,
        reply: oneshot::Sender<usize>,
    },
    Select {
        pick: Pick,
        reply: oneshot::Sender<Vec<Exported>>,
    },
    DrainFailover {
        reply: oneshot::Sender<Vec<Exported>>,
    },
    Drop {
        pick: Pick,
        reply: oneshot::Sender<usize>,
    },
    Held {
        reply: oneshot::Sender<usize>,
    },
    HandAgain {
        gone: Gone,
        new_owner: NewOwner,
        reply: oneshot::Sender<Vec<(Arc<str>, Exported)>>,
    },
}

/// Which incarnations of members are gone (node id, generation): the keys handed to
/// them are handed again (`Side::hand_again`).
pub type Gone = Arc<dyn Fn(&str, u64) -> bool + Send + Sync>;

/// The shard actor's replication state.
pub(super) struct Side {
    replicas: Replicas,
    /// Keys changed since their last replication, with when they first changed; `None`
    /// when the node does not replicate, or has no successor to replicate to (nothing
    /// is tracked, nothing costs).
    dirty: Option<HashMap<KeyId, Millis, foldhash::fast::RandomState>>,
    /// This node replicates (`--replicate-interval-ms` above 0): changed keys are
    /// tracked while it has a successor ([`Side::track`]).
    replicate: bool,
    keys: usize,
    bytes: usize,
    /// Live keys started here from a replica (promoted) and not handed away since:
    /// handed back to the incarnation the replica came from, they are joined there,
    /// not added (see [`Store::install_joined`]).
    promoted_keys: HashSet<KeyId, foldhash::fast::RandomState>,
    held: metrics::Gauge,
    promoted: metrics::Counter,
    failover: metrics::Counter,
}

impl Side {
    /// The side of shard `index`, whose key cap and byte budget are `keys` and `bytes`.
    pub fn new(replicate: bool, keys: usize, bytes: usize, index: usize) -> Self {
        let shard = index.to_string();
        let mut replicas = Replicas::new(index as u64 + 0x5eed);
        // All the room while no key is live; the first checks shrink it.
        replicas.fit_beside(&Store::new(1, 0), keys, bytes, 0);
        Self {
            replicas,
            // A fast hash: this map is touched on every check of a replicating node.
            dirty: replicate.then(HashMap::default),
            replicate,
            keys,
            bytes,
            promoted_keys: HashSet::default(),
            held: metrics::gauge!("ringlimit_replicas", "shard" => shard),
            promoted: metrics::counter!("ringlimit_replica_promotions_total"),
            failover: metrics::counter!("ringlimit_failover_decisions_total"),
        }
    }

    /// Note that `counter`'s key changed at `now` (a check, a refund, an install).
    pub fn changed(&mut self, counter: &Counter<'_>, now: Millis) {
        if !counter.local {
            self.changed_id(counter.id, now);
        }
    }

    /// Track changed keys or not (a replicating node only). A node with no successor
    /// has nowhere to send them: it tracks none, and forgets what it tracked; once it
    /// has a successor again, the replicator resyncs every key it owns anyway
    /// (`cluster::replication::needs_full_state`), so nothing is owed from before.
    pub fn track(&mut self, on: bool) {
        match (on, self.replicate) {
            (true, true) => {
                self.dirty.get_or_insert_with(HashMap::default);
            }
            _ => self.dirty = None,
        }
    }

    /// [`Side::changed`] by identity.
    pub fn changed_id(&mut self, id: KeyId, now: Millis) {
        if let Some(dirty) = &mut self.dirty {
            dirty.entry(id).or_insert(now);
        }
    }

    /// Before a check of a key `live` does not hold as its own: if a replica of it is
    /// here, this node has become its owner (or a peer with a newer ring thinks so):
    /// promote the replica, so the count goes on from where the old owner left it.
    ///
    /// Not over a key this node handed away: a check of it is a forward from a node on
    /// the old view, decided on the handed-over count, which the new owner's replica
    /// may not include yet (it may have started the key from empty before the handoff
    /// reached it). Replacing the count with the replica would let this node admit past
    /// the limit in one window (the simulator's seeds 111 and 603).
    pub fn promote_on_check(&mut self, item: &Charge, live: &mut Store, now: Millis) -> Churn {
        if self.replicas.is_empty() || live.holds(item.id) || live.handed_away(item.id) {
            return Churn::default();
        }
        let Some(replica) = self.replicas.take(item.id) else {
            return Churn::default();
        };
        tracing::debug!(target: super::INSTALL_TRACE, placement = item.id.placement, disc = item.id.disc, state = ?replica.state, "promoting");
        if live.install(replica, &item.rule.limiter, now) {
            self.promoted.increment(1);
            self.promoted_keys.insert(item.id);
        }
        self.held.set(self.replicas.len() as f64);
        Churn::default()
    }

    /// Whether a check of a key `live` keeps only as handed away (a fail-over check,
    /// or a forward from a node on the old view) is decided on the key's replica: when
    /// one is held here, after joining the handed-away count into it.
    ///
    /// The handed-away record is this node's count at the handoff plus what it decided
    /// since; the replica is the new owner's count, which took that handoff in and went
    /// on, and it is what this node restores to that owner if it restarts. Deciding on
    /// the old record forgets the new owner's admissions and leaves this node's own
    /// out of what it restores (a successor that had handed a key back to its restarted
    /// owner answered that owner's next death on the old record, then restored the
    /// replica without those admissions: `core`'s
    /// `a_key_handed_away_is_decided_on_its_newer_replica_and_restored_with_it`). Every
    /// check of the key goes to the replica while it is held, so this node's admissions
    /// stay on one count; the replica's owed delta carries them to the owner.
    pub fn on_replica_if_handed_away(&mut self, item: &Charge, live: &Store, now: Millis) -> bool {
        if self.replicas.is_empty() {
            return false;
        }
        match live.handed_away_state(item.id) {
            Some(moved) if moved.fingerprint == item.rule.fingerprint => {
                self.replicas.join_held(moved, &item.rule.limiter, now)
            }
            _ => false,
        }
    }

    /// Decide a check on the key's replica (see [`Replicas::check_failover`]): a
    /// fail-over check, or one of a key handed away whose replica is here.
    pub fn decide_failover(&mut self, item: &Charge, now: Millis) -> (Decision, Churn, bool) {
        if item.target.is_replica() {
            self.failover.increment(1);
        }
        // A give-back (Gubernator's negative hits) is not applied to a replica: the
        // owner, when it comes back, holds the count it would have applied to.
        if item.peek {
            return (
                self.replicas.peek(item.counter(), now),
                Churn::default(),
                false,
            );
        }
        let owed = item.target != super::Target::Replica(super::Doubt::InDoubt);
        let (decision, churn) = self
            .replicas
            .check_failover(item.counter(), now, item.cost, owed);
        (decision, churn, false)
    }

    /// Whether `id` was started here from a replica and not handed away since; it
    /// is not any more after this (the caller hands it away).
    pub fn hand_away_promoted(&mut self, id: KeyId) -> bool {
        !self.promoted_keys.is_empty() && self.promoted_keys.remove(&id)
    }

    /// Whether `id` was started here from a replica and nothing was handed over for it
    /// since: the caller joins the state handed over now (its leaving owner's, see
    /// [`super::ShardCore::install`]); the next ones add.
    pub fn join_promoted(&mut self, id: KeyId) -> bool {
        !self.promoted_keys.is_empty() && self.promoted_keys.remove(&id)
    }

    /// Forget the promoted keys `live` no longer holds as its own (expired, evicted).
    pub fn forget_promoted(&mut self, live: &Store) {
        if !self.promoted_keys.is_empty() {
            self.promoted_keys.retain(|id| live.holds(*id));
        }
    }

    /// Keep the replicas within the room the live keys leave.
    pub fn fit(&mut self, live: &Store, now: Millis) -> Churn {
        if self.replicas.is_empty() && self.dirty.is_none() {
            return Churn::default();
        }
        self.replicas.fit_beside(live, self.keys, self.bytes, now)
    }

    /// Drop expired replicas.
    pub fn expire(&mut self, now: Millis, budget: usize) -> u64 {
        let expired = self.replicas.expire(now, budget);
        if expired > 0 {
            self.held.set(self.replicas.len() as f64);
        }
        expired
    }

    /// Answer one replication message.
    pub fn handle(&mut self, command: Command, live: &mut Store, now: Millis) -> Churn {
        let mut churn = Churn::default();
        match command {
            Command::Track { on, reply } => {
                self.track(on);
                let _ = reply.send(());
            }
            Command::Drain { max, reply } => {
                let _ = reply.send(self.drain(live, max));
            }
            Command::Resync { pick, owed, reply } => {
                let since = |p: u64| {
                    owed.as_ref()
                        .and_then(|o| o.get(&p).copied())
                        .unwrap_or(now)
                };
                let _ = reply.send(self.resync(live, &pick, &since));
            }
            Command::Hold { items, reply } => {
                let (held, c) = self.hold(live, items, now);
                churn += c;
                let _ = reply.send(held);
            }
            Command::Select { pick, reply } => {
                let _ = reply.send(self.select(&pick));
            }
            Command::Drop { pick, reply } => {
                let _ = reply.send(self.drop_picked(&pick));
            }
            Command::DrainFailover { reply } => {
                let _ = reply.send(self.drain_failover());
            }
            Command::Held { reply } => {
                let _ = reply.send(self.replicas.len());
            }
            Command::HandAgain {
                gone,
                new_owner,
                reply,
            } => {
                let _ = reply.send(self.hand_again(live, &*gone, |p| new_owner(p), now));
            }
        }
        churn
    }

    /// The keys `live` handed to a member whose incarnation is `gone` (it restarted
    /// empty after the cluster dropped it: the count it took over went with it), handed
    /// again: joined first with a replica of the key held here (that member's newer
    /// count, as far as it replicated it), then handed to `new_owner`'s choice, or kept
    /// as this node's own (marked changed for its successor) where that gives `None`.
    /// Without this such a key's count stays here as handed away, its admissions go as
    /// deltas to a member that is gone, and the member back answers from empty (`core`'s
    /// `a_key_handed_to_a_member_that_died_is_handed_again_with_its_replica`).
    pub fn hand_again(
        &mut self,
        live: &mut Store,
        gone: &dyn Fn(&str, u64) -> bool,
        new_owner: impl FnMut(u64) -> Option<Recipient>,
        now: Millis,
    ) -> Vec<(Arc<str>, Exported)> {
        let ids = live.handed_to(gone);
        if ids.is_empty() {
            return Vec::new();
        }
        for &id in &ids {
            if let Some(replica) = self.replicas.take(id) {
                live.join_handed_away(replica, now);
            }
        }
        self.held.set(self.replicas.len() as f64);
        let out = live.hand_again(&ids, now, new_owner);
        for &id in &ids {
            if live.holds(id) {
                self.changed_id(id, now);
            }
        }
        out
    }

    /// Mark every live key whose placement `pick` accepts as changed (their successor
    /// changed, or their last batch was not delivered), owed since `since(placement)`
    /// or earlier. Returns how many.
    pub fn resync(&mut self, live: &Store, pick: &Pick, since: &dyn Fn(u64) -> Millis) -> usize {
        match &mut self.dirty {
            Some(dirty) => {
                let ids = live.select(|p| pick(p));
                let n = ids.len();
                for e in ids {
                    let t = since(e.id.placement);
                    dirty
                        .entry(e.id)
                        .and_modify(|owed| *owed = (*owed).min(t))
                        .or_insert(t);
                }
                n
            }
            None => 0,
        }
    }

    /// Keep replicas sent by their owners, in the room `live` leaves. Returns how many
    /// are held.
    pub fn hold(
        &mut self,
        live: &Store,
        items: Vec<(Exported, Arc<Rule>)>,
        now: Millis,
    ) -> (usize, Churn) {
        let mut churn = self.replicas.fit_beside(live, self.keys, self.bytes, now);
        let mut held = 0;
        for (item, rule) in items {
            tracing::debug!(target: super::INSTALL_TRACE, placement = item.id.placement, disc = item.id.disc, state = ?item.state, "replica");
            let (kept, c) = self.replicas.hold(item, &rule.limiter, now);
            held += usize::from(kept);
            churn += c;
        }
        self.held.set(self.replicas.len() as f64);
        (held, churn)
    }

    /// Copies of the replicas whose placement `pick` accepts (an owner restoring).
    pub fn select(&mut self, pick: &Pick) -> Vec<Exported> {
        self.replicas.select(|p| pick(p))
    }

    /// Drop the replicas whose placement `pick` accepts; returns how many.
    pub fn drop_picked(&mut self, pick: &Pick) -> usize {
        let ids: Vec<KeyId> = self
            .replicas
            .select(|p| pick(p))
            .into_iter()
            .map(|e| e.id)
            .collect();
        for id in &ids {
            self.replicas.take(*id);
        }
        self.held.set(self.replicas.len() as f64);
        ids.len()
    }

    /// Fail-over admissions since the last call, owed to the keys' owners.
    pub fn drain_failover(&mut self) -> Vec<Exported> {
        self.replicas.drain_failover()
    }

    /// A copy of every replica held, for a snapshot on disk.
    pub fn freeze(&self) -> crate::shard::store::Frozen {
        self.replicas.freeze()
    }

    /// Replicas held.
    pub fn len(&self) -> usize {
        self.replicas.len()
    }

    /// Up to `max` changed keys' states (the rest stay owed for the next call).
    /// Afterwards the changed-key map keeps room for about twice what this call
    /// drained (see [`DIRTY_FLOOR`]).
    pub fn drain(&mut self, live: &Store, max: usize) -> Vec<Changed> {
        let Some(dirty) = &mut self.dirty else {
            return Vec::new();
        };
        let ids: Vec<(KeyId, Millis)> = if dirty.len() <= max {
            dirty.drain().collect()
        } else {
            let ids: Vec<_> = dirty.iter().take(max).map(|(&id, &at)| (id, at)).collect();
            for (id, _) in &ids {
                dirty.remove(id);
            }
            ids
        };
        // A burst (a node filling with new keys faster than rounds drain them, a resync
        // of every key) leaves the map sized for far more keys than later rounds see,
        // and draining keeps that capacity: once a round needs less than a quarter of
        // it, give it back, keeping room for twice that round. In a steady state the
        // map stays within that and is not touched.
        let wanted = 2 * (dirty.len() + ids.len()).max(DIRTY_FLOOR);
        if dirty.capacity() > 2 * wanted {
            dirty.shrink_to(wanted);
        }
        ids.into_iter()
            .filter_map(|(id, since)| {
                Some(Changed {
                    state: live.snapshot(id)?,
                    since,
                })
            })
            .collect()
    }
}

impl Shards {
    async fn replication<T>(
        &self,
        shard: usize,
        command: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, ShardError> {
        let (reply, rx) = oneshot::channel();
        self.inboxes[shard]
            .send(super::Command::Replication(command(reply)))
            .await
            .map_err(|_| ShardError::Stopped(shard))?;
        rx.await.map_err(|_| ShardError::Stopped(shard))
    }

    /// Track changed keys on every shard, or stop and forget them (a node with no
    /// successor tracks none: `Side::track`).
    pub async fn track_changes(&self, on: bool) -> Result<(), ShardError> {
        for shard in 0..self.len() {
            self.replication(shard, |reply| Command::Track { on, reply })
                .await?;
        }
        Ok(())
    }

    /// Keys changed since their last replication, up to `max` per shard, with their
    /// states now: what the replicator sends to their successors.
    pub async fn drain_replication(&self, max: usize) -> Result<Vec<Changed>, ShardError> {
        let mut out = Vec::new();
        for shard in 0..self.len() {
            out.extend(
                self.replication(shard, |reply| Command::Drain { max, reply })
                    .await?,
            );
        }
        Ok(out)
    }

    /// Mark every live key whose placement `pick` accepts as changed (their successor
    /// changed: it gets their full state at the next drains). Returns how many.
    pub async fn resync(&self, pick: Pick) -> Result<usize, ShardError> {
        let mut marked = 0;
        for shard in 0..self.len() {
            let pick = pick.clone();
            marked += self
                .replication(shard, |reply| Command::Resync {
                    pick,
                    owed: None,
                    reply,
                })
                .await?;
        }
        Ok(marked)
    }

    /// Mark the live keys at the placements of `owed` as changed, each owed since the
    /// time beside it (or earlier): states whose batch was not delivered go again, and
    /// the replication lag recorded when they arrive counts from their first change,
    /// so a successor that cannot be reached shows as lag. Returns how many.
    pub async fn retry(&self, owed: Vec<(u64, Millis)>) -> Result<usize, ShardError> {
        let mut groups: Vec<HashMap<u64, Millis>> = vec![HashMap::new(); self.len()];
        for (placement, since) in owed {
            let group = &mut groups[self.shard_of_placement(placement)];
            let t = group.entry(placement).or_insert(since);
            *t = (*t).min(since);
        }
        let mut marked = 0;
        for (shard, owed) in groups.into_iter().enumerate() {
            if owed.is_empty() {
                continue;
            }
            let owed = Arc::new(owed);
            let placements = owed.clone();
            let pick: Pick = Arc::new(move |p| placements.contains_key(&p));
            marked += self
                .replication(shard, |reply| Command::Resync {
                    pick,
                    owed: Some(owed),
                    reply,
                })
                .await?;
        }
        Ok(marked)
    }

    /// Keep replicas sent by their owners, each with the local rule it belongs to.
    /// Returns how many are held.
    pub async fn hold_replicas(
        &self,
        items: Vec<(Exported, Arc<Rule>)>,
    ) -> Result<usize, ShardError> {
        let mut groups: Vec<Vec<(Exported, Arc<Rule>)>> = vec![Vec::new(); self.len()];
        for item in items {
            groups[self.shard_of_placement(item.0.id.placement)].push(item);
        }
        let mut held = 0;
        for (shard, items) in groups.into_iter().enumerate() {
            if !items.is_empty() {
                held += self
                    .replication(shard, |reply| Command::Hold { items, reply })
                    .await?;
            }
        }
        Ok(held)
    }

    /// Copies of the replicas whose placement `pick` accepts (an owner restoring: the
    /// replicas stay, for the fail-over checks decided here until it answers as owner).
    pub async fn select_replicas(&self, pick: Pick) -> Result<Vec<Exported>, ShardError> {
        let mut out = Vec::new();
        for shard in 0..self.len() {
            let pick = pick.clone();
            out.extend(
                self.replication(shard, |reply| Command::Select { pick, reply })
                    .await?,
            );
        }
        Ok(out)
    }

    /// Drop the replicas whose placement `pick` accepts (their key's live owner hands
    /// it over itself). Returns how many.
    pub async fn drop_replicas(&self, pick: Pick) -> Result<usize, ShardError> {
        let mut dropped = 0;
        for shard in 0..self.len() {
            let pick = pick.clone();
            dropped += self
                .replication(shard, |reply| Command::Drop { pick, reply })
                .await?;
        }
        Ok(dropped)
    }

    /// Hand again, from every shard, the keys handed to members whose incarnation is
    /// `gone` (see `Side::hand_again`): the states to push, with their destinations.
    pub async fn hand_again(
        &self,
        gone: Gone,
        new_owner: NewOwner,
    ) -> Result<Vec<(Arc<str>, Exported)>, ShardError> {
        let mut out = Vec::new();
        for shard in 0..self.len() {
            let (gone, new_owner) = (gone.clone(), new_owner.clone());
            out.extend(
                self.replication(shard, |reply| Command::HandAgain {
                    gone,
                    new_owner,
                    reply,
                })
                .await?,
            );
        }
        Ok(out)
    }

    /// Replicas held by every shard together.
    pub async fn replicas_held(&self) -> Result<usize, ShardError> {
        let mut held = 0;
        for shard in 0..self.len() {
            held += self
                .replication(shard, |reply| Command::Held { reply })
                .await?;
        }
        Ok(held)
    }

    /// Fail-over admissions since the last call, owed to the keys' owners.
    pub async fn drain_failover(&self) -> Result<Vec<Exported>, ShardError> {
        let mut out = Vec::new();
        for shard in 0..self.len() {
            out.extend(
                self.replication(shard, |reply| Command::DrainFailover { reply })
                    .await?,
            );
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_changed_keys_gives_its_map_back_once_drained() {
        let mut side = Side::new(true, 1_000_000, usize::MAX, 0);
        let live = Store::new(1, 0);
        let burst = 100_000u64;
        for i in 0..burst {
            side.changed_id(
                KeyId {
                    placement: i,
                    disc: i,
                },
                1,
            );
        }
        let capacity = |side: &Side| side.dirty.as_ref().map_or(0, HashMap::capacity);
        assert!(capacity(&side) >= burst as usize);
        // The store holds none of them, so nothing is sent; the map is emptied but
        // keeps room for a round like this one, then the next, quiet, round gives it up.
        assert!(side.drain(&live, usize::MAX).is_empty());
        assert!(capacity(&side) >= burst as usize);
        side.drain(&live, usize::MAX);
        assert!(
            capacity(&side) <= 4 * DIRTY_FLOOR,
            "kept room for {} keys after a drain of a burst",
            capacity(&side)
        );
        // A steady round is not shrunk under its own size.
        for i in 0..3_000u64 {
            side.changed_id(
                KeyId {
                    placement: i,
                    disc: i,
                },
                2,
            );
        }
        let before = capacity(&side);
        side.drain(&live, usize::MAX);
        assert_eq!(capacity(&side), before, "a round's own size is kept");
    }

    #[test]
    fn a_node_without_a_successor_tracks_no_change_and_one_that_does_not_replicate_never() {
        let id = KeyId {
            placement: 7,
            disc: 7,
        };
        let mut side = Side::new(true, 100, usize::MAX, 0);
        side.changed_id(id, 1);
        side.track(false);
        assert!(side.dirty.is_none(), "what was tracked is forgotten");
        side.changed_id(id, 2);
        assert!(side.dirty.is_none());
        side.track(true);
        side.changed_id(id, 3);
        assert_eq!(side.dirty.as_ref().map(HashMap::len), Some(1));

        let mut off = Side::new(false, 100, usize::MAX, 0);
        off.track(true);
        off.changed_id(id, 1);
        assert!(off.dirty.is_none(), "replication off: nothing to track");
    }
}
