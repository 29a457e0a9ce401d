//! The pure core of one shard: its live keys ([`Store`]) and its side of replication
//! (changed-key tracking and the replicas it keeps, `replication::Side`), driven by
//! plain calls that take `now`. No channel, no clock, no task: the shard actor
//! (`Actor`) reads its clock once per drained batch and calls this; the
//! deterministic simulator (`tests/sim`) calls the same methods on simulated time, so
//! what it checks is the shard's decision logic itself, not a copy of it.

use std::num::NonZeroU64;
use std::sync::Arc;

use super::replication::{self, Changed, Pick};
use super::{
    counters, Charge, Churn, Counter, Exported, KeyId, Outcome, Outcomes, Recipient, Refund, Store,
    INSTALL_TRACE,
};
use crate::algorithms::{Decision, Millis};
use crate::config::rules::Rule;

/// Keys handed over, as [`ShardCore::export_back`] sorts them.
#[derive(Debug, Default)]
pub struct Exports {
    /// States the new owner adds to what it holds.
    pub merged: Vec<(Arc<str>, Exported)>,
    /// States started here from the new owner's own replica: it joins them.
    pub joined: Vec<(Arc<str>, Exported)>,
}

/// A shard's keys copied in one step ([`ShardCore::freeze`]).
#[derive(Debug, Default)]
pub struct FrozenShard {
    /// The keys this shard decides for.
    pub live: super::store::Frozen,
    /// The replicas it keeps for other owners.
    pub replicas: super::store::Frozen,
}

/// One shard's state: live keys and replicas, and how both change.
pub struct ShardCore {
    store: Store,
    /// This shard's replicas of other owners' keys, and its own changed keys.
    replicas: replication::Side,
    /// Keys loaded from this node's snapshot, until a peer hands over a state of them
    /// or the marks lapse ([`ShardCore::install_snapshot`]).
    from_snapshot: Option<SnapshotMarks>,
}

/// Keys loaded from a snapshot whose first handed-over state is joined, not added,
/// and when the marks lapse.
struct SnapshotMarks {
    keys: std::collections::HashSet<KeyId, foldhash::fast::RandomState>,
    until: Millis,
}

impl ShardCore {
    /// Shard `index` holding at most `keys` keys (live and replicas together) and
    /// `bytes` bytes of side state; `replicate`: remember which keys changed, for
    /// their successors.
    pub fn new(replicate: bool, keys: usize, bytes: usize, index: usize) -> Self {
        Self {
            store: Store::new(keys, index as u64 + 1).with_byte_budget(bytes),
            replicas: replication::Side::new(replicate, keys, bytes, index),
            from_snapshot: None,
        }
    }

    /// Install states loaded from this node's own snapshot at start: live keys `live`
    /// (into a store that holds none of them yet) and replicas `replicas`. Returns
    /// (installed, replicas held, what holding them evicted).
    ///
    /// A snapshot and what peers hold of the same key are two moments of one history:
    /// the key's successor kept a replica of the same count, newer by up to a snapshot
    /// interval, and a node that decided for it meanwhile started from that replica. So
    /// until `until` (the time a restarted cluster takes to converge) the first state
    /// a peer hands over for a loaded key is joined with it ([`Store::install_joined`],
    /// the stricter of the two), not added: adding would count the snapshot's
    /// admissions twice. States after that first one add as usual (a handoff's late
    /// deltas are new admissions).
    pub fn install_snapshot(
        &mut self,
        live: Vec<(Exported, Arc<Rule>)>,
        replicas: Vec<(Exported, Arc<Rule>)>,
        until: Millis,
        now: Millis,
    ) -> (usize, usize, Churn) {
        let ids: Vec<KeyId> = live.iter().map(|(item, _)| item.id).collect();
        let installed = self.install(live, false, false, now);
        let marks = self.from_snapshot.get_or_insert_with(|| SnapshotMarks {
            keys: Default::default(),
            until,
        });
        marks.until = marks.until.max(until);
        marks.keys.extend(ids);
        let (held, churn) = self.replicas.hold(&self.store, replicas, now);
        (installed, held, churn)
    }

    /// The live keys (for lengths, caps and gauges).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Copies of the live keys and of the replicas as of now, for a snapshot on disk
    /// (see [`Store::freeze`]).
    pub fn freeze(&self) -> FrozenShard {
        FrozenShard {
            live: self.store.freeze(),
            replicas: self.replicas.freeze(),
        }
    }

    /// Decide one message's charges, in order, at `now`. `decided` is told of each
    /// decision and returns its sequence number (the actor counts it in its metrics
    /// and takes the next number of the node-wide counter).
    pub fn check(
        &mut self,
        items: &[Charge],
        now: Millis,
        mut decided: impl FnMut(&Charge, &Decision) -> u64,
    ) -> (Outcomes, Churn) {
        let mut churn = Churn::default();
        let outcomes = items
            .iter()
            .map(|item| {
                let (decision, c, fresh) = self.decide(item, now);
                churn += c;
                Outcome {
                    decision,
                    sequence: decided(item, &decision),
                    at: now,
                    fresh,
                }
            })
            .collect();
        churn += self.replicas.fit(&self.store, now);
        (outcomes, churn)
    }

    /// Decide one charge: a fail-over check of a key this node does not hold live on
    /// its replica; anything else on the live key, after promoting a replica of it if
    /// one is here (this node has become its owner).
    fn decide(&mut self, item: &Charge, now: Millis) -> (Decision, Churn, bool) {
        // A fail-over check of a key this node holds live (its replica was promoted:
        // this node owns it now) continues the live count; so does one of a key it
        // handed away (to an owner that restarted and is restoring, say): the
        // handed-over count goes on, and what it admits goes to the new owner as a late
        // delta, as for a forward from a node on the old ring. With a replica of that
        // key here (the new owner's newer count), the replica decides, joined first with
        // the handed-away count (`on_replica_if_handed_away`).
        if (item.target.is_replica() && !self.store.contains(item.id))
            || self
                .replicas
                .on_replica_if_handed_away(item, &self.store, now)
        {
            return self.replicas.decide_failover(item, now);
        }
        let mut churn = self.replicas.promote_on_check(item, &mut self.store, now);
        let (decision, c, fresh) = self.decide_live(item, now);
        churn += c;
        // A denial that left no state (a fresh key) changes nothing to replicate: marking
        // it would let random denied keys grow the changed-key map beyond the store.
        if decision.allowed || self.store.holds(item.id) {
            self.replicas.changed(&item.counter(), now);
        }
        (decision, churn, fresh)
    }

    /// Decide one charge on its live key: any give-back first, then the check (or a
    /// peek), then a drain of what a denial left.
    fn decide_live(&mut self, item: &Charge, now: Millis) -> (Decision, Churn, bool) {
        if let Some(units) = item.give_back {
            self.store.give_back(item.counter(), now, units);
        }
        let (mut decision, mut churn, fresh) = if item.peek {
            (
                self.store.peek(item.counter(), now),
                Churn::default(),
                false,
            )
        } else if item.target == super::Target::Replica(super::Doubt::InDoubt) {
            self.store.check_in_doubt(item.counter(), now, item.cost)
        } else {
            self.store.check(item.counter(), now, item.cost)
        };
        if item.drain && !decision.allowed && decision.remaining > 0 {
            let units = NonZeroU64::new(decision.remaining).expect("> 0");
            let (drained, c, _) = self.store.check(item.counter(), now, units);
            churn += c;
            if drained.allowed {
                decision = Decision {
                    allowed: false,
                    ..drained
                };
            }
        }
        (decision, churn, fresh)
    }

    /// Run `step` on the live keys as a check of `charge` runs (its replica promoted
    /// first, the key marked changed for its successor after), for the shard's steps
    /// that are not plain checks (reservations and leases).
    pub fn step_live<R>(
        &mut self,
        charge: Option<&Charge>,
        now: Millis,
        step: impl FnOnce(&mut Store) -> R,
    ) -> (R, Churn) {
        let mut churn = Churn::default();
        if let Some(charge) = charge {
            churn += self.replicas.promote_on_check(charge, &mut self.store, now);
        }
        let r = step(&mut self.store);
        if let Some(charge) = charge {
            self.replicas.changed(&charge.counter(), now);
            churn += self.replicas.fit(&self.store, now);
        }
        (r, churn)
    }

    /// Give back an admitted charge (at the time it was admitted).
    pub fn refund(&mut self, refund: &Refund, now: Millis) {
        let counter = refund.charge.counter();
        self.store.refund(counter, refund.at, refund.charge.cost);
        self.replicas.changed(&counter, now);
    }

    /// Install handed-over states (merged with what is held, or joined with it when
    /// `joined`: states started from this node's own replicas, see
    /// [`ShardCore::export_back`]); returns how many.
    ///
    /// `from_holder`: the sender held these keys as its own until now (it leaves, or
    /// this node's view still gives them to it). A key this node promoted from a replica
    /// meanwhile (a check forwarded here by a node whose view had moved it, before the
    /// holder's handoff came and before this node dropped the holder's replicas) holds
    /// the holder's count up to its last replica: the first state of it from the holder
    /// is joined, not added, which counted it twice (a key at 65 of 100 denied from there
    /// on).
    pub fn install(
        &mut self,
        items: Vec<(Exported, Arc<Rule>)>,
        joined: bool,
        from_holder: bool,
        now: Millis,
    ) -> usize {
        let mut installed = 0;
        // A state from an owner whose clock ran ahead needs no help here: every
        // algorithm state clamps time to the newest instant it has acted on.
        for (item, rule) in items {
            let id = item.id;
            let joined = joined
                || self.loaded_from_snapshot(id, now)
                || (from_holder && self.replicas.join_promoted(id));
            let trace = tracing::enabled!(target: INSTALL_TRACE, tracing::Level::DEBUG);
            let before = trace.then(|| self.store.snapshot(id).map(|e| e.state));
            let incoming = trace.then(|| item.state.clone());
            let taken = if joined {
                self.store.install_joined(item, &rule.limiter, now)
            } else {
                self.store.install(item, &rule.limiter, now)
            };
            if taken {
                installed += 1;
                self.replicas.changed_id(id, now);
            }
            if trace {
                tracing::debug!(
                    target: INSTALL_TRACE,
                    placement = id.placement,
                    disc = id.disc,
                    taken,
                    joined,
                    ?before,
                    ?incoming,
                    after = ?self.store.snapshot(id).map(|e| e.state),
                    "installed"
                );
            }
        }
        installed
    }

    /// Hand over every key `new_owner` gives to another node (see [`Store::export`]).
    pub fn export(
        &mut self,
        now: Millis,
        new_owner: impl Fn(u64) -> Option<Recipient>,
    ) -> Vec<(Arc<str>, Exported)> {
        self.split_export(now, &new_owner, &|_| None, false).merged
    }

    /// [`ShardCore::export`], setting apart the keys handed back to the incarnation
    /// their replica came from: those this node promoted (its view had dropped their
    /// owner, or a peer's had) and whose new owner is `earlier`'s for their placement,
    /// the incarnation that owned them before this node did. Their states include
    /// that owner's own admissions up to its last replica, so it joins them
    /// ([`Store::install_joined`]); the others it adds to what it holds.
    ///
    /// Keys loaded from this node's snapshot that no peer has handed over since go
    /// to be joined too: such a state is an earlier moment of the count the new owner
    /// holds (a snapshot written before the key moved away, loaded after a restart),
    /// and adding it would count that moment twice
    /// (`rolling_restart_with_snapshots_admits_each_key_exactly_its_limit`).
    pub fn export_back(
        &mut self,
        now: Millis,
        new_owner: &dyn Fn(u64) -> Option<Recipient>,
        earlier: &dyn Fn(u64) -> Option<Recipient>,
    ) -> Exports {
        self.split_export(now, new_owner, earlier, true)
    }

    fn split_export(
        &mut self,
        now: Millis,
        new_owner: &dyn Fn(u64) -> Option<Recipient>,
        earlier: &dyn Fn(u64) -> Option<Recipient>,
        loaded_joins: bool,
    ) -> Exports {
        let mut merged = self.store.export(now, new_owner);
        let mut joined = Vec::new();
        let side = &mut self.replicas;
        let marks = &mut self.from_snapshot;
        merged.retain(|(to, state)| {
            let p = state.id.placement;
            let promoted = side.hand_away_promoted(state.id)
                && earlier(p).is_some_and(|e| new_owner(p).is_some_and(|n| n == e));
            let loaded = loaded_joins
                && marks
                    .as_mut()
                    .is_some_and(|m| now < m.until && m.keys.remove(&state.id));
            let back = promoted || loaded;
            if back {
                joined.push((to.clone(), state.clone()));
            }
            !back
        });
        Exports { merged, joined }
    }

    /// Hand again the keys handed to members whose incarnation is `gone` (see
    /// `shard::replication::Side::hand_again`).
    pub fn hand_again(
        &mut self,
        now: Millis,
        gone: &dyn Fn(&str, u64) -> bool,
        new_owner: impl FnMut(u64) -> Option<Recipient>,
    ) -> Vec<(Arc<str>, Exported)> {
        self.replicas
            .hand_again(&mut self.store, gone, new_owner, now)
    }

    /// Admissions made on handed-over keys since the last call, per destination, for
    /// the destinations `reachable` (see [`Store::drain_deltas`]).
    pub fn drain_deltas(
        &mut self,
        reachable: impl Fn(&str, u64) -> bool,
    ) -> Vec<(Arc<str>, Exported)> {
        self.store.drain_deltas(reachable)
    }

    /// Read (or, with `reset`, read then drop) one client's counters.
    pub fn counters(
        &mut self,
        items: Vec<counters::ClientCounter>,
        reset: bool,
        now: Millis,
    ) -> Vec<counters::CounterReading> {
        items
            .into_iter()
            .filter_map(|item| {
                let counter = Counter {
                    id: item.id,
                    fingerprint: item.rule.fingerprint,
                    limiter: &item.rule.limiter,
                    local: false,
                };
                let decision = if reset {
                    self.store.reset(counter, now)
                } else {
                    self.store.inspect(counter, now)
                }?;
                Some(counters::CounterReading::of(&item, &decision))
            })
            .collect()
    }

    /// Whether `id` was loaded from the snapshot and no peer has handed over a state
    /// of it since (the mark is taken: see [`ShardCore::install_snapshot`]).
    fn loaded_from_snapshot(&mut self, id: KeyId, now: Millis) -> bool {
        match &mut self.from_snapshot {
            Some(marks) if now < marks.until => marks.keys.remove(&id),
            _ => false,
        }
    }

    /// The expiry tick: drop expired live keys and replicas, examining a sixteenth of
    /// the keys (at least 1024), and the snapshot's marks once they lapse. Returns how
    /// many keys expired.
    pub fn expire(&mut self, now: Millis) -> u64 {
        if self.from_snapshot.as_ref().is_some_and(|m| now >= m.until) {
            self.from_snapshot = None;
        }
        // A full pass every ~16 ticks, while one tick stays a sub-millisecond pause.
        let budget = (self.store.len() / 16).max(1024);
        let expired = self.store.expire(now, budget) + self.replicas.expire(now, budget);
        self.replicas.forget_promoted(&self.store);
        expired
    }

    // ---- replication (the replicator's and the peer service's side) ------------------

    /// Answer one replication message of the actor's inbox.
    pub(super) fn replication(&mut self, command: replication::Command, now: Millis) -> Churn {
        self.replicas.handle(command, &mut self.store, now)
    }

    /// Up to `max` changed keys' states for their successors (the rest stay owed).
    pub fn drain_changed(&mut self, max: usize) -> Vec<Changed> {
        self.replicas.drain(&self.store, max)
    }

    /// Mark every live key whose placement `pick` accepts as changed; returns how many.
    pub fn resync(&mut self, pick: &Pick, now: Millis) -> usize {
        self.replicas.resync(&self.store, pick, &|_| now)
    }

    /// Mark the live keys at the placements of `owed` changed again, each owed since
    /// the time beside it: their replication batch was not delivered, so they go in
    /// the next round, and the lag recorded then counts from their first change.
    /// Returns how many.
    pub fn retry(
        &mut self,
        owed: Arc<std::collections::HashMap<u64, Millis>>,
        now: Millis,
    ) -> usize {
        let placements = owed.clone();
        let pick: Pick = Arc::new(move |p| placements.contains_key(&p));
        self.replicas.resync(&self.store, &pick, &|p| {
            owed.get(&p).copied().unwrap_or(now)
        })
    }

    /// Keep replicas sent by their owners; returns how many are held.
    pub fn hold(&mut self, items: Vec<(Exported, Arc<Rule>)>, now: Millis) -> (usize, Churn) {
        self.replicas.hold(&self.store, items, now)
    }

    /// Copies of the replicas whose placement `pick` accepts (an owner restoring).
    pub fn select_replicas(&mut self, pick: &Pick) -> Vec<Exported> {
        self.replicas.select(pick)
    }

    /// Drop the replicas whose placement `pick` accepts; returns how many.
    pub fn drop_replicas(&mut self, pick: &Pick) -> usize {
        self.replicas.drop_picked(pick)
    }

    /// Fail-over admissions since the last call, owed to the keys' owners.
    pub fn drain_failover(&mut self) -> Vec<Exported> {
        self.replicas.drain_failover()
    }

    /// Replicas held.
    pub fn replicas(&self) -> usize {
        self.replicas.len()
    }

    /// Whether this shard holds `id` as a live key of its own.
    pub fn holds(&self, id: KeyId) -> bool {
        self.store.holds(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::rules::RuleSet;

    const NOW: Millis = 1_800_000_000_000;

    fn charge(rule: &Arc<Rule>, key: &[u8]) -> Charge {
        Charge {
            id: KeyId::of(&rule.name, key, ""),
            rule: rule.clone(),
            cost: NonZeroU64::MIN,
            give_back: None,
            drain: false,
            peek: false,
            target: Default::default(),
        }
    }

    /// A fixed window rule `r` of 3 per minute.
    fn rule_r() -> Arc<Rule> {
        let rules = RuleSet::from_toml_str(
            "[[rule]]\nname = \"r\"\nroute = \"GET /r\"\nalgorithm = \"fixed_window\"\nlimit = 3\nwindow = \"60s\"\n",
        )
        .unwrap();
        rules
            .rules()
            .iter()
            .find(|r| &*r.name == "r")
            .unwrap()
            .clone()
    }

    fn allowed(core: &mut ShardCore, item: &Charge) -> bool {
        let (outcomes, _) = core.check(std::slice::from_ref(item), NOW, |_, _| 0);
        outcomes[0].decision.allowed
    }

    #[test]
    fn a_state_whose_batch_failed_stays_owed_since_its_first_change() {
        // The replication lag counts from a key's first change to its successor's
        // answer: a batch that was not delivered, sent again later, must not restart
        // that clock, or a successor that cannot be reached never shows as lag.
        let rule = rule_r();
        let item = charge(&rule, b"k");
        let mut core = ShardCore::new(true, 100, 1 << 20, 0);
        assert!(allowed(&mut core, &item));
        let sent = core.drain_changed(10).remove(0);
        assert_eq!(sent.since, NOW);
        let all: Pick = Arc::new(|_| true);
        // The successor changed meanwhile: the key is owed from now on...
        assert_eq!(core.resync(&all, NOW + 300), 1);
        // ...and the failed batch comes back: owed since its first change.
        let failed = |_: u64| NOW;
        assert_eq!(core.replicas.resync(&core.store, &all, &failed), 1);
        assert_eq!(
            core.resync(&all, NOW + 600),
            1,
            "a later mark moves nothing"
        );
        let again = core.drain_changed(10).remove(0);
        assert_eq!(again.since, NOW);
        assert!(core.drain_changed(10).is_empty());
    }

    /// `owner` admits once on `item` and replicates it to a new successor, which
    /// promotes the replica on a check of its own (its view dropped the owner) and
    /// admits once more. Returns the successor.
    fn promoted_after_one(owner: &mut ShardCore, rule: &Arc<Rule>, item: &Charge) -> ShardCore {
        assert!(allowed(owner, item));
        let replica = owner.drain_changed(10).remove(0).state;
        let mut successor = ShardCore::new(true, 100, 1 << 20, 1);
        assert_eq!(successor.hold(vec![(replica, rule.clone())], NOW).0, 1);
        assert!(allowed(&mut successor, item), "promoted: 2 of 3");
        successor
    }

    #[test]
    fn a_promoted_key_handed_back_to_its_live_owner_is_joined_not_added() {
        // A successor whose view dropped the owner for a moment promoted its replica,
        // admitted on it, then handed the key back; added to the owner's own count,
        // which the replica already held, it made the owner deny below the limit.
        let rule = rule_r();
        let item = charge(&rule, b"k");
        let mut owner = ShardCore::new(true, 100, 1 << 20, 0);
        let mut successor = promoted_after_one(&mut owner, &rule, &item);
        let back = Recipient::new("owner", 7);
        let exports = successor.export_back(NOW, &|_| Some(back.clone()), &|_| Some(back.clone()));
        assert!(exports.merged.is_empty());
        assert_eq!(exports.joined.len(), 1);
        let state = exports.joined[0].1.clone();
        assert_eq!(
            owner.install(vec![(state.clone(), rule.clone())], true, false, NOW),
            1
        );
        assert!(
            allowed(&mut owner, &item),
            "1 here + 1 there: the third of 3"
        );
        assert!(!allowed(&mut owner, &item));

        // Added, the owner's own admission counts twice: it denies at 2 of 3.
        let mut adding = ShardCore::new(true, 100, 1 << 20, 2);
        assert!(allowed(&mut adding, &item));
        assert_eq!(
            adding.install(vec![(state, rule.clone())], false, false, NOW),
            1
        );
        assert!(!allowed(&mut adding, &item));
    }

    #[test]
    fn a_leavers_handoff_is_joined_with_its_replica_promoted_before_it_came() {
        // The owner leaves: the successor's view drops it, a check promotes the
        // replica before the successor drops the leaver's replicas, then the leaver's
        // handoff (the same count, 1) arrives.
        let rule = rule_r();
        let item = charge(&rule, b"k");
        let mut owner = ShardCore::new(true, 100, 1 << 20, 0);
        let mut successor = promoted_after_one(&mut owner, &rule, &item);
        let handoff = owner.export(NOW, |_| Some(Recipient::new("successor", 1)));
        let state = handoff[0].1.clone();
        let mut adding =
            promoted_after_one(&mut ShardCore::new(true, 100, 1 << 20, 2), &rule, &item);
        assert_eq!(
            successor.install(vec![(state.clone(), rule.clone())], false, true, NOW),
            1
        );
        assert!(
            allowed(&mut successor, &item),
            "1 there + 1 here: the third of 3"
        );
        assert!(!allowed(&mut successor, &item));
        // The next state from it (a late delta) adds.
        assert!(!successor.replicas.join_promoted(item.id), "consumed");

        // From a member not leaving, added: the leaver's admission counts twice.
        assert_eq!(
            adding.install(vec![(state, rule.clone())], false, false, NOW),
            1
        );
        assert!(!allowed(&mut adding, &item), "denied at 2 + 1 of 3");
    }

    #[test]
    fn a_promoted_key_goes_in_full_to_a_restarted_owner_and_others_are_added() {
        let rule = rule_r();
        let item = charge(&rule, b"k");
        let mut owner = ShardCore::new(true, 100, 1 << 20, 0);
        let mut successor = promoted_after_one(&mut owner, &rule, &item);
        // A key the successor started itself (no replica) is the new owner's to add.
        let own = charge(&rule, b"own");
        assert!(allowed(&mut successor, &own));
        // The owner restarted (generation 8): its memory holds nothing of generation
        // 7's count, so the promoted key's whole state is added too.
        let (was, now) = (Recipient::new("owner", 7), Recipient::new("owner", 8));
        let exports = successor.export_back(NOW, &|_| Some(now.clone()), &|_| Some(was.clone()));
        assert_eq!(exports.merged.len(), 2);
        assert!(exports.joined.is_empty());
        // Handed away, the key is no longer promoted here: coming back and going again
        // it is this node's count.
        let again = successor.export_back(NOW, &|_| Some(was.clone()), &|_| Some(was.clone()));
        assert!(
            again.merged.is_empty() && again.joined.is_empty(),
            "already handed"
        );
    }

    #[test]
    fn a_key_handed_away_keeps_its_count_when_its_replica_arrives() {
        // This node handed a full key to a joiner, which started it
        // from empty before the handoff reached it and replicated that state back here
        // (this node is its successor); a forward from a node on the old view must
        // still be decided on the handed-over count, not on the replica.
        let rule = rule_r();
        let item = charge(&rule, b"k");
        let mut core = ShardCore::new(true, 100, 1 << 20, 0);
        for _ in 0..3 {
            assert!(allowed(&mut core, &item));
        }
        assert!(!allowed(&mut core, &item));
        let handed = core.export(NOW, |_| Some(Recipient::new("new-owner", 1)));
        assert_eq!(handed.len(), 1);
        let mut joiner = ShardCore::new(true, 100, 1 << 20, 1);
        assert!(allowed(&mut joiner, &item));
        let replica = joiner.drain_changed(10).remove(0).state;
        assert_eq!(core.hold(vec![(replica, rule.clone())], NOW).0, 1);
        assert!(!allowed(&mut core, &item), "3 of 3 used here already");
        assert_eq!(core.replicas(), 1, "the replica stays a replica");
    }

    #[test]
    fn a_key_handed_away_is_decided_on_its_newer_replica_and_restored_with_it() {
        // This node handed a key (1 of 3 used) to its owner, which
        // took it in, admitted 1 more and replicated that here (this node is its
        // successor). When that owner dies, fail-over checks here must see 2 used, not
        // the handed-over 1, and what they admit must be in the replica the owner gets
        // back when it restarts and restores.
        let rule = rule_r();
        let item = charge(&rule, b"k");
        let mut core = ShardCore::new(true, 100, 1 << 20, 0);
        assert!(allowed(&mut core, &item));
        let handed = core.export(NOW, |_| Some(Recipient::new("owner", 1)));
        let mut owner = ShardCore::new(true, 100, 1 << 20, 1);
        let state = handed.into_iter().next().unwrap().1;
        assert_eq!(
            owner.install(vec![(state, rule.clone())], false, false, NOW),
            1
        );
        assert!(allowed(&mut owner, &item));
        let replica = owner.drain_changed(10).remove(0).state;
        assert_eq!(core.hold(vec![(replica, rule.clone())], NOW).0, 1);

        let failover = Charge {
            target: crate::shard::Target::Replica(crate::shard::Doubt::Owed),
            ..item.clone()
        };
        assert!(allowed(&mut core, &failover), "the third of 3");
        assert!(
            !allowed(&mut core, &failover),
            "2 used by the replica + 1 here"
        );
        assert!(
            !allowed(&mut core, &item),
            "a late forward sees the same count"
        );

        let all: Pick = Arc::new(|_| true);
        let restored = core.select_replicas(&all);
        assert_eq!(restored.len(), 1);
        let left = rule.limiter.peek(&restored[0].state, NOW).remaining;
        assert_eq!(left, 0, "the restore carries the fail-over admission");
    }

    #[test]
    fn a_key_handed_to_a_member_that_died_is_handed_again_with_its_replica() {
        // This node handed a key (1 of 3 used) to its owner, which
        // admitted 1 more, replicated that here and died. The cluster dropped it, this
        // node owned the key again and decided on the handed-away count, whose
        // admissions went as deltas to the dead owner. When the owner comes back under
        // a new incarnation, the key goes to it again with every admission counted once
        // (the join of the handed-away count and the replica), not from empty.
        let rule = rule_r();
        let item = charge(&rule, b"k");
        let mut core = ShardCore::new(true, 100, 1 << 20, 0);
        assert!(allowed(&mut core, &item));
        let handed = core.export(NOW, |_| Some(Recipient::new("owner", 1)));
        let mut owner = ShardCore::new(true, 100, 1 << 20, 1);
        let state = handed.into_iter().next().unwrap().1;
        assert_eq!(
            owner.install(vec![(state, rule.clone())], false, false, NOW),
            1
        );
        assert!(allowed(&mut owner, &item));
        let replica = owner.drain_changed(10).remove(0).state;
        assert_eq!(core.hold(vec![(replica, rule.clone())], NOW).0, 1);

        let gone = |id: &str, generation: u64| id == "owner" && generation < 2;
        let again = core.hand_again(NOW, &gone, |_| Some(Recipient::new("owner", 2)));
        assert_eq!(again.len(), 1);
        assert_eq!(&*again[0].0, "owner");
        let left = rule.limiter.peek(&again[0].1.state, NOW).remaining;
        assert_eq!(
            left, 1,
            "2 of 3 used: the replica joined, nothing counted twice"
        );
        assert_eq!(core.replicas(), 0, "the replica went with the key");
        // The entry is handed to the new incarnation now, under the same id: the
        // replicator hands again once per incarnation (`claim_hand_again`).

        // Handed again to nobody (this node owns the key now): live here.
        let mut core = ShardCore::new(true, 100, 1 << 20, 0);
        assert!(allowed(&mut core, &item));
        assert_eq!(core.drain_changed(10).len(), 1);
        core.export(NOW, |_| Some(Recipient::new("owner", 1)));
        assert!(!core.holds(item.id));
        assert!(core.hand_again(NOW, &gone, |_| None).is_empty());
        assert!(core.holds(item.id));
        assert_eq!(
            core.drain_changed(10).len(),
            1,
            "its successor must hear of it"
        );
        assert!(allowed(&mut core, &item));
        assert!(allowed(&mut core, &item));
        assert!(!allowed(&mut core, &item), "the count went on: 3 of 3");
    }

    #[test]
    fn a_key_handed_to_the_new_incarnation_already_is_not_handed_to_it_again() {
        // A member back under a new
        // incarnation after the cluster dropped it. On that view change the handoff
        // watcher handed it a key (ring change) before the replicator took back the
        // keys handed to its earlier incarnation; by id alone, that key was taken back
        // too and handed a second time, and the member's count of it doubled.
        let rule = rule_r();
        let (a, b) = (charge(&rule, b"a"), charge(&rule, b"b"));
        let mut core = ShardCore::new(true, 100, 1 << 20, 0);
        assert!(allowed(&mut core, &a));
        core.export(NOW, |p| {
            (p == a.id.placement).then(|| Recipient::new("owner", 1))
        });
        assert!(allowed(&mut core, &b));
        let handed = core.export(NOW, |_| Some(Recipient::new("owner", 2)));
        assert_eq!(handed.len(), 1, "b, to the new incarnation");

        let gone = |id: &str, generation: u64| id == "owner" && generation < 2;
        let again = core.hand_again(NOW, &gone, |_| Some(Recipient::new("owner", 2)));
        let ids: Vec<KeyId> = again.iter().map(|(_, e)| e.id).collect();
        assert_eq!(ids, vec![a.id], "only the key the earlier incarnation took");
        assert!(
            core.hand_again(NOW, &gone, |_| Some(Recipient::new("owner", 2)))
                .is_empty(),
            "and once"
        );
    }

    #[test]
    fn a_replica_is_promoted_by_the_first_check_of_a_key_not_held() {
        let rule = rule_r();
        let item = charge(&rule, b"k");
        let mut owner = ShardCore::new(true, 100, 1 << 20, 0);
        for _ in 0..2 {
            assert!(allowed(&mut owner, &item));
        }
        let replica = owner.drain_changed(10).remove(0).state;
        let mut successor = ShardCore::new(true, 100, 1 << 20, 1);
        successor.hold(vec![(replica, rule.clone())], NOW);
        assert!(allowed(&mut successor, &item), "the third of 3");
        assert!(!allowed(&mut successor, &item));
        assert_eq!(successor.replicas(), 0);
        assert!(successor.holds(item.id));
    }

    /// A limit-10 fixed window (one hour) and a state of it that admitted `count` now.
    fn hourly() -> Arc<Rule> {
        let rules = RuleSet::from_toml_str(
            "[[rule]]\nname = \"h\"\nroute = \"GET /h\"\nalgorithm = \"fixed_window\"\nlimit = 10\nwindow = \"1h\"\n",
        )
        .unwrap();
        rules
            .rules()
            .iter()
            .find(|r| &*r.name == "h")
            .unwrap()
            .clone()
    }

    fn counted(rule: &Arc<Rule>, key: &[u8], count: u64) -> (Exported, Arc<Rule>) {
        let mut state = rule.limiter.new_state();
        for _ in 0..count {
            rule.limiter.check(&mut state, NOW, NonZeroU64::MIN);
        }
        let id = KeyId::of(&rule.name, key, "");
        (
            Exported {
                id,
                fingerprint: rule.fingerprint,
                state,
            },
            rule.clone(),
        )
    }

    /// What a check of `key` would leave: the units left after it (peeked, not taken).
    fn remaining(core: &mut ShardCore, rule: &Arc<Rule>, key: &[u8]) -> u64 {
        let item = Charge {
            peek: true,
            ..charge(rule, key)
        };
        let (outcomes, _) = core.check(std::slice::from_ref(&item), NOW, |_, _| 0);
        outcomes[0].decision.remaining
    }

    #[test]
    fn a_loaded_key_is_joined_with_the_first_state_a_peer_hands_over_then_added_to() {
        let rule = hourly();
        let mut core = ShardCore::new(true, 100, 1 << 20, 0);
        let until = NOW + 60_000;
        let (live, held, _) =
            core.install_snapshot(vec![counted(&rule, b"k", 5)], vec![], until, NOW);
        assert_eq!((live, held), (1, 0));
        assert_eq!(remaining(&mut core, &rule, b"k"), 5);
        // The successor's replica: the same history, newer (7 admitted in all).
        assert_eq!(
            core.install(vec![counted(&rule, b"k", 7)], false, false, NOW),
            1
        );
        assert_eq!(remaining(&mut core, &rule, b"k"), 3, "7, not 5 + 7");
        // A later delta is new admissions: added.
        assert_eq!(
            core.install(vec![counted(&rule, b"k", 2)], false, false, NOW),
            1
        );
        assert_eq!(remaining(&mut core, &rule, b"k"), 1);
    }

    #[test]
    fn the_snapshot_marks_lapse() {
        let rule = hourly();
        let mut core = ShardCore::new(true, 100, 1 << 20, 0);
        core.install_snapshot(vec![counted(&rule, b"k", 5)], vec![], NOW + 1, NOW);
        core.expire(NOW + 1);
        assert_eq!(
            core.install(vec![counted(&rule, b"k", 2)], false, false, NOW + 1),
            1
        );
        assert_eq!(
            remaining(&mut core, &rule, b"k"),
            3,
            "added once the marks lapsed"
        );
    }

    #[test]
    fn a_loaded_key_handed_away_goes_to_be_joined_and_a_decided_one_to_be_added() {
        let rule = hourly();
        let mut core = ShardCore::new(true, 100, 1 << 20, 0);
        core.install_snapshot(
            vec![counted(&rule, b"loaded", 5)],
            vec![],
            NOW + 60_000,
            NOW,
        );
        assert!(allowed(&mut core, &charge(&rule, b"decided")));
        let elsewhere = |_: u64| Some(Recipient::new("b", 1));
        let exports = core.export_back(NOW, &elsewhere, &|_| None);
        let ids = |v: &[(Arc<str>, Exported)]| v.iter().map(|(_, e)| e.id).collect::<Vec<_>>();
        assert_eq!(ids(&exports.joined), vec![KeyId::of("h", b"loaded", "")]);
        assert_eq!(ids(&exports.merged), vec![KeyId::of("h", b"decided", "")]);
    }

    #[test]
    fn a_freeze_copies_the_keys_decided_here_and_the_replicas() {
        let rule = hourly();
        let mut core = ShardCore::new(true, 100, 1 << 20, 0);
        let replica = counted(&rule, b"replica", 4);
        core.install_snapshot(
            vec![counted(&rule, b"a", 2), counted(&rule, b"b", 3)],
            vec![replica.clone()],
            NOW + 60_000,
            NOW,
        );
        let frozen = core.freeze();
        let mut live: Vec<Exported> = frozen.live.states().collect();
        live.sort_by_key(|e| e.state.to_words()[1]);
        assert_eq!(
            live,
            vec![counted(&rule, b"a", 2).0, counted(&rule, b"b", 3).0]
        );
        assert_eq!(
            frozen.replicas.states().collect::<Vec<_>>(),
            vec![replica.0]
        );
        // A key handed away is the new owner's to write.
        let to_b =
            |p: u64| (p == KeyId::of("h", b"a", "").placement).then(|| Recipient::new("b", 1));
        core.export(NOW, to_b);
        let ids: Vec<KeyId> = core.freeze().live.states().map(|e| e.id).collect();
        assert_eq!(ids, vec![KeyId::of("h", b"b", "")]);
    }
}
