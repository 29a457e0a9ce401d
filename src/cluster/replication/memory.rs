//! What the replicator remembers of the members it has seen, and the work each view
//! change asks of it, with no I/O inside: the node's async [`Replicator`] and the
//! deterministic simulator perform the same [`ViewWork`] on their shards, so the
//! decisions of a view change (what to drop, take back, hand over and resync) are
//! made by one piece of code.
//!
//! [`Replicator`]: super::Replicator

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::{
    departed, handed_over_by_live_owner, needs_full_state, not_restored_here, reborn,
    restarted_in_place, unpromoted,
};
use crate::algorithms::Millis;
use crate::config::rules::MAX_WINDOW;
use crate::membership::{ClusterView, Member};
use crate::shard::replication::Pick;
use crate::shard::Exported;

/// The members a node remembers, by id: each map says something about one
/// incarnation of a member, and all are forgotten together ([`Memory::view_changed`]).
#[derive(Debug, Default)]
pub struct Memory {
    /// Members seen to restart in place (a higher generation while on the ring), and
    /// their new generation: see [`Memory::restarted_in_place`].
    restarted: HashMap<String, u64>,
    /// The last generation this node saw of every member, gone or not (see [`reborn`]).
    seen: HashMap<String, u64>,
    /// The incarnation of every member whose earlier incarnation's keys were handed
    /// again (see [`Memory::claim_hand_again`]).
    handed_again: HashMap<String, u64>,
    /// The incarnation of every member this node handed its replicas to: when it
    /// restored (see [`Memory::claim_restore`]), or as unpromoted when the view took it
    /// in. Each incarnation gets them once.
    restores_served: HashMap<String, u64>,
    /// When this node last saw each member of `seen` in its view.
    last_seen: HashMap<String, Millis>,
}

/// Keys handed to members since gone or back under a new incarnation, to take back
/// (`Shards::hand_again`) and push to their owners under the new view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakeBack {
    /// Each member (id, generation now): keys handed to its earlier incarnations.
    pub back: Vec<(String, u64)>,
    /// For the logs and the metrics.
    pub why: &'static str,
}

/// What a view change asks of the replicator, in the order it is to be done.
pub struct ViewWork {
    /// Replicas of keys whose live owner hands them over itself: drop them here.
    pub drop_replicas: Option<Pick>,
    /// Keys to take back and push to their owners under the new view.
    pub take_back: Vec<TakeBack>,
    /// Replicas to copy and push to their owner under the new view: it is back after
    /// the cluster dropped it, and they were never promoted here (see [`unpromoted`]).
    pub unpromoted: Option<Pick>,
    /// Keys this node owns to send in full to their successors: (which, why).
    pub resync: Vec<(Pick, &'static str)>,
    /// Members forgotten (absent longer than the longest window): whatever else is
    /// kept per member (the replication batches held from them) goes too.
    pub forgotten: Vec<String>,
}

impl Memory {
    /// Remember `view` (the first one this node has).
    pub fn first_view(&mut self, view: &ClusterView, now: Millis) {
        self.remember(view, now);
    }

    /// The work of a view change from `old` to `new` at `now`, this node being `me`;
    /// what it learns of the members is remembered.
    ///
    /// The keys handed to members that left are taken back first, then those handed
    /// to earlier incarnations of members back after the cluster dropped them (each
    /// incarnation once: [`Memory::claim_hand_again`]), then the replicas of keys the
    /// ring gives back to such a member that did not restore from here. Resyncs come
    /// last, once the shards track changes for the new ring.
    pub fn view_changed(
        &mut self,
        me: &str,
        old: &ClusterView,
        new: &ClusterView,
        now: Millis,
    ) -> ViewWork {
        let drop_replicas = handed_over_by_live_owner(me, old, new);
        let mut take_back = Vec::new();
        let gone = departed(old, new);
        if !gone.is_empty() {
            take_back.push(TakeBack {
                back: gone,
                why: "taken back, its owner left",
            });
        }
        let back = reborn(old, new, &self.seen);
        let again: Vec<(String, u64)> = back
            .iter()
            .filter_map(|id| new.member(id).map(|m| (id.clone(), m.generation)))
            .filter(|(id, generation)| self.claim_hand_again(id, *generation))
            .collect();
        if !again.is_empty() {
            take_back.push(TakeBack {
                back: again,
                why: "hand again",
            });
        }
        let back = not_restored_here(new, back, &self.restores_served);
        let unpromoted = unpromoted(me, old, new, back.clone());
        if unpromoted.is_some() {
            // Handed now: a restore of the same incarnation that this node's view did
            // not hold when it asked must not hand them again.
            for id in &back {
                if let Some(m) = new.member(id) {
                    self.restores_served.insert(id.clone(), m.generation);
                }
            }
        }
        let forgotten = self.remember(new, now);
        let mut resync = Vec::new();
        if new.ring.digest() != old.ring.digest() {
            let (me, old_ring, new_ring): (Arc<str>, _, _) =
                (Arc::from(me), old.ring.clone(), new.ring.clone());
            let pick: Pick = Arc::new(move |p| needs_full_state(&me, &old_ring, &new_ring, p));
            resync.push((pick, "successors changed"));
        }
        let restarted = restarted_in_place(old, new);
        if !restarted.is_empty() {
            resync.push((
                self.successors_restarted(me, new, restarted),
                "a successor restarted",
            ));
        }
        ViewWork {
            drop_replicas,
            take_back,
            unpromoted,
            resync,
            forgotten,
        }
    }

    /// Members that restarted in place: remembered (see
    /// [`Memory::restarted_in_place`]), and every key this node owns whose successor
    /// one of them is gets its full state again (their replicas died with them).
    fn successors_restarted(
        &mut self,
        me: &str,
        new: &ClusterView,
        restarted: Vec<Member>,
    ) -> Pick {
        for m in &restarted {
            self.restarted.insert(m.node_id.clone(), m.generation);
        }
        let ids: Vec<String> = restarted.into_iter().map(|m| m.node_id).collect();
        let (me, ring): (Arc<str>, _) = (Arc::from(me), new.ring.clone());
        Arc::new(move |p| {
            ring.owner_of_hash(p) == Some(&*me)
                && ring
                    .successor_of_hash(p)
                    .is_some_and(|s| ids.iter().any(|r| r == s))
        })
    }

    /// Remember the generation of every member of `view`, and forget members gone for
    /// longer than the longest window ([`MAX_WINDOW`]): whatever this node handed them
    /// or holds of theirs has expired by then, so there is nothing left to hand again
    /// or restore, and the maps of a long-lived node whose peers come and go under new
    /// ids (a Deployment's pods) do not grow without end. Returns the forgotten.
    fn remember(&mut self, view: &ClusterView, now: Millis) -> Vec<String> {
        for m in &view.members {
            self.last_seen.insert(m.node_id.clone(), now);
            self.seen.insert(m.node_id.clone(), m.generation);
        }
        let gone = MAX_WINDOW.as_millis() as Millis;
        let mut forgotten: Vec<String> = self
            .last_seen
            .iter()
            .filter(|(_, &t)| now.saturating_sub(t) > gone)
            .map(|(id, _)| id.clone())
            .collect();
        forgotten.sort();
        for id in &forgotten {
            self.last_seen.remove(id);
            self.seen.remove(id);
            self.restarted.remove(id);
            self.handed_again.remove(id);
            self.restores_served.remove(id);
        }
        forgotten
    }

    /// Remember `members` (node id, generation) as seen at `now`, as of a snapshot this
    /// node (`me`) wrote before it stopped: after a crash of the whole cluster, a member
    /// back under a new generation is then known as restarted (see [`reborn`]) and gets
    /// the replicas of its keys kept here, though this node never saw it this time.
    pub fn remember_members(&mut self, me: &str, members: &[(String, u64)], now: Millis) {
        for (id, generation) in members.iter().filter(|(id, _)| id != me) {
            self.last_seen.entry(id.clone()).or_insert(now);
            let g = self.seen.entry(id.clone()).or_insert(*generation);
            *g = (*g).max(*generation);
        }
    }

    /// Members this node remembers.
    pub fn remembered(&self) -> usize {
        self.seen.len()
    }

    /// Whether `node` at `generation` restarted in place as far as this node saw (its
    /// view went from an earlier incarnation straight to this one): its keys' replicas
    /// here are its own earlier incarnation's, to be restored. The view alone may
    /// already show only the new incarnation when its restore request arrives (gossip
    /// got here first).
    pub fn restarted_in_place(&self, node: &str, generation: u64) -> bool {
        self.restarted.get(node) == Some(&generation)
    }

    /// Whether the keys handed to `node` are still to be handed again for its
    /// incarnation `generation` (it is back after the cluster dropped it); claims them
    /// (the restore and the view change may both see it: one hands them).
    pub fn claim_hand_again(&mut self, node: &str, generation: u64) -> bool {
        let reborn = self.seen.get(node).is_some_and(|&g| g < generation);
        reborn && self.handed_again.insert(node.to_string(), generation) != Some(generation)
    }

    /// This node pushed `node` at `generation` its replicas (it restored from here):
    /// they are its count now, and the view change that takes it in must not hand
    /// them over again as unpromoted (see [`not_restored_here`]).
    pub fn served_restore(&mut self, node: &str, generation: u64) {
        self.restores_served.insert(node.to_string(), generation);
    }

    /// Whether this node is still to hand `node` at `generation` its replicas; claims
    /// them before they are pushed, so the view change that takes it in while the push
    /// is on its way does not hand them too (see [`not_restored_here`]; both were
    /// installed, a key at 6 answered 12). A push that does not get them all in gives
    /// the claim back ([`Memory::release_restore`]).
    pub fn claim_restore(&mut self, node: &str, generation: u64) -> bool {
        self.restores_served.insert(node.to_string(), generation) != Some(generation)
    }

    /// Give back a claim of [`Memory::claim_restore`]: the replicas did not all get
    /// in, so a view change that takes `node` in later hands them as unpromoted.
    pub fn release_restore(&mut self, node: &str, generation: u64) {
        if self.restores_served.get(node) == Some(&generation) {
            self.restores_served.remove(node);
        }
    }
}

/// How a node answers a member's restore request (`Peer/Restore`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoreAnswer {
    /// An earlier incarnation of the member, which this node counts on, restarted:
    /// push it the replicas held here of its keys ([`super::restorable`]).
    Replicas,
    /// A member this node's view does not hold yet: hand it the keys it owns once in,
    /// before answering, or it would answer as owner from empty while they are on
    /// their way ([`super::joining`]).
    Joiner,
    /// A member whose earlier incarnation left gracefully and is still in this node's
    /// view, leaving (a rolling restart that came back before the view dropped it): the
    /// ring holds neither, so its keys are live here, handed over by that leave. As for
    /// a joiner, they are handed to it before answering; otherwise it answered as owner
    /// from its snapshot until this node's view took it in and handed them (a key at
    /// 48 answered 27, then was joined back to 48: one admission above the limit). What
    /// was handed to the leaver is not handed again: it handed its keys on itself. The
    /// answer says it knew an earlier incarnation, so the member also asks those it
    /// sees later (its first view may hold only its seed).
    Rejoiner,
    /// A new member, or one back after the cluster dropped it: its keys come back by
    /// the ring's handoff; replicas pushed too would be merged on top and counted twice.
    Nothing,
}

impl Memory {
    /// How to answer `node` at `generation` asking to restore, under `view`.
    pub fn restore_answer(&self, view: &ClusterView, node: &str, generation: u64) -> RestoreAnswer {
        match view.member(node) {
            None => RestoreAnswer::Joiner,
            Some(m) if m.leaving && m.generation < generation => RestoreAnswer::Rejoiner,
            Some(m) if m.generation < generation || self.restarted_in_place(node, generation) => {
                RestoreAnswer::Replicas
            }
            Some(_) => RestoreAnswer::Nothing,
        }
    }
}

/// `states`, each with its owner, grouped per owner that `view` holds, each group in
/// key order (one order whatever the shards' maps did); the states of owners it does
/// not hold come back apart, lost.
pub fn per_owner(
    view: &ClusterView,
    states: impl IntoIterator<Item = (Arc<str>, Exported)>,
) -> (Vec<(Member, Vec<Exported>)>, Vec<Exported>) {
    let mut to: BTreeMap<Arc<str>, Vec<Exported>> = BTreeMap::new();
    for (owner, state) in states {
        to.entry(owner).or_default().push(state);
    }
    let (mut found, mut lost) = (Vec::new(), Vec::new());
    for (owner, mut states) in to {
        match view.member(&owner) {
            Some(member) => {
                states.sort_by_key(|s| (s.id.placement, s.id.disc));
                found.push((member.clone(), states));
            }
            None => lost.extend(states),
        }
    }
    (found, lost)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::policy::testkit::member;

    /// A view of members (id, generation).
    fn view_of(members: &[(&str, u64)]) -> ClusterView {
        ClusterView::from_members(
            members
                .iter()
                .enumerate()
                .map(|(i, (id, generation))| {
                    let mut m = member(id, 7000 + i as u16);
                    m.generation = *generation;
                    m
                })
                .collect(),
        )
    }

    #[test]
    fn a_member_back_under_a_new_incarnation_is_handed_again_once() {
        let mut memory = Memory::default();
        let with_b1 = view_of(&[("a", 1), ("b", 1), ("c", 1)]);
        let without_b = view_of(&[("a", 1), ("c", 1)]);
        let with_b2 = view_of(&[("a", 1), ("b", 2), ("c", 1)]);
        memory.first_view(&with_b1, 0);
        let left = memory.view_changed("a", &with_b1, &without_b, 10);
        assert_eq!(
            left.take_back,
            vec![TakeBack {
                back: vec![("b".into(), 2)],
                why: "taken back, its owner left"
            }]
        );
        let back = memory.view_changed("a", &without_b, &with_b2, 20);
        assert_eq!(back.take_back.len(), 1);
        assert_eq!(back.take_back[0].back, vec![("b".to_string(), 2)]);
        assert_eq!(back.take_back[0].why, "hand again");
        assert!(back.unpromoted.is_some(), "b did not restore from here");
        assert!(
            !memory.claim_hand_again("b", 2),
            "claimed by the view change already"
        );
    }

    #[test]
    fn a_member_that_restored_here_gets_no_unpromoted_replicas() {
        let mut memory = Memory::default();
        let with_b1 = view_of(&[("a", 1), ("b", 1), ("c", 1)]);
        let without_b = view_of(&[("a", 1), ("c", 1)]);
        let with_b2 = view_of(&[("a", 1), ("b", 2), ("c", 1)]);
        memory.first_view(&with_b1, 0);
        memory.view_changed("a", &with_b1, &without_b, 10);
        memory.served_restore("b", 2);
        let back = memory.view_changed("a", &without_b, &with_b2, 20);
        assert!(back.unpromoted.is_none());
    }

    #[test]
    fn a_member_back_from_a_graceful_leave_the_view_still_holds_is_handed_its_keys() {
        let memory = Memory::default();
        let mut leaving = view_of(&[("a", 1), ("b", 1), ("c", 1)]);
        leaving.members[1].leaving = true;
        let leaving = ClusterView::from_members(leaving.members);
        assert!(!leaving.ring.contains("b"), "a leaver owns nothing");
        assert_eq!(
            memory.restore_answer(&leaving, "b", 2),
            RestoreAnswer::Rejoiner
        );
        let crashed = view_of(&[("a", 1), ("b", 1), ("c", 1)]);
        assert_eq!(
            memory.restore_answer(&crashed, "b", 2),
            RestoreAnswer::Replicas
        );
        let gone = view_of(&[("a", 1), ("c", 1)]);
        assert_eq!(memory.restore_answer(&gone, "b", 2), RestoreAnswer::Joiner);
        let back = view_of(&[("a", 1), ("b", 2), ("c", 1)]);
        assert_eq!(memory.restore_answer(&back, "b", 2), RestoreAnswer::Nothing);
    }

    /// A restarted member asks while this node's view does not hold it yet, and the
    /// view change that takes it in comes while the replicas are on their way (a
    /// loaded machine): one of the two hands them, whichever claims them first.
    #[test]
    fn a_restore_and_the_view_change_that_takes_its_member_in_hand_the_replicas_once() {
        let with_b1 = view_of(&[("a", 1), ("b", 1), ("c", 1)]);
        let without_b = view_of(&[("a", 1), ("c", 1)]);
        let with_b2 = view_of(&[("a", 1), ("b", 2), ("c", 1)]);
        let dropped = || {
            let mut memory = Memory::default();
            memory.first_view(&with_b1, 0);
            memory.view_changed("a", &with_b1, &without_b, 10);
            memory
        };

        // The restore claims first, its push in flight: the view change hands nothing.
        let mut memory = dropped();
        assert!(memory.claim_restore("b", 2));
        let back = memory.view_changed("a", &without_b, &with_b2, 20);
        assert!(back.unpromoted.is_none(), "the restore's push hands them");

        // The push failed and gave the claim back before the view change: it hands them.
        let mut memory = dropped();
        assert!(memory.claim_restore("b", 2));
        memory.release_restore("b", 2);
        let back = memory.view_changed("a", &without_b, &with_b2, 20);
        assert!(back.unpromoted.is_some());

        // The view change first: a restore of the same incarnation claims nothing.
        let mut memory = dropped();
        let back = memory.view_changed("a", &without_b, &with_b2, 20);
        assert!(back.unpromoted.is_some());
        assert!(!memory.claim_restore("b", 2), "handed by the view change");
        assert!(
            memory.claim_restore("b", 3),
            "a later incarnation is another"
        );
    }

    #[test]
    fn a_restart_in_place_is_remembered_and_resyncs_its_keys() {
        let mut memory = Memory::default();
        let before = view_of(&[("a", 1), ("b", 1)]);
        let after = view_of(&[("a", 1), ("b", 2)]);
        memory.first_view(&before, 0);
        let work = memory.view_changed("a", &before, &after, 10);
        assert!(memory.restarted_in_place("b", 2));
        assert!(!memory.restarted_in_place("b", 1));
        assert_eq!(
            work.resync.len(),
            1,
            "the ring is the same: only the restart"
        );
        assert_eq!(work.resync[0].1, "a successor restarted");
        assert!(work.take_back.is_empty() && work.drop_replicas.is_none());
    }

    #[test]
    fn members_gone_longer_than_the_longest_window_are_forgotten() {
        let mut memory = Memory::default();
        let both = view_of(&[("a", 1), ("b", 1)]);
        let alone = view_of(&[("a", 1)]);
        memory.first_view(&both, 0);
        memory.served_restore("b", 1);
        let work = memory.view_changed("a", &both, &alone, 1);
        assert!(work.forgotten.is_empty());
        assert_eq!(memory.remembered(), 2);
        let later = MAX_WINDOW.as_millis() as Millis + 2;
        let work = memory.view_changed("a", &alone, &alone, later);
        assert_eq!(work.forgotten, vec!["b".to_string()]);
        assert_eq!(memory.remembered(), 1);
        assert!(memory.restores_served.is_empty());
    }

    #[test]
    fn states_go_to_their_owners_in_key_order_and_the_rest_is_lost() {
        let view = view_of(&[("a", 1), ("b", 1)]);
        let state = |p: u64| Exported {
            id: crate::shard::KeyId {
                placement: p,
                disc: 0,
            },
            fingerprint: 0,
            state: crate::algorithms::KeyState::FixedWindow(Default::default()),
        };
        let (found, lost) = per_owner(
            &view,
            [
                (Arc::from("b"), state(9)),
                (Arc::from("gone"), state(1)),
                (Arc::from("b"), state(3)),
            ],
        );
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].0.node_id, "b");
        let order: Vec<u64> = found[0].1.iter().map(|s| s.id.placement).collect();
        assert_eq!(order, vec![3, 9]);
        assert_eq!(lost.len(), 1);
    }
}
