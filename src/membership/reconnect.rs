//! Reconnecting to peers we lost without a goodbye (finding 9 of `docs/chaos.md`).
//!
//! Chitchat picks whom to gossip with at random: three live nodes per round, and
//! sometimes one random dead node or seed. A node cut off by a partition has no live
//! peer, so after the heal it only finds its way back when its random picks, among
//! every identity it ever heard of, land on a live one, and the others pick it only
//! as "a random dead node" among all of theirs. Late in a churned cluster (a long
//! chaos run, a StatefulSet rolled many times) that is a random walk over hundreds
//! of dead identities, and its seeds may be long gone.
//!
//! So every node remembers, by gossip address, the members that dropped out of its
//! view without announcing a leave, and for [`RECONNECT_FOR`] after the loss gossips
//! to each of them directly every [`RECONNECT_EVERY`]; a node whose view holds only
//! itself does so every tick, and forgets none of them while it stays alone. Both sides of a healed partition then exchange
//! heartbeats at least once a second, well inside the failure detector's 2 s longest
//! counted gap, and see each other again within a second or two whatever the number
//! of dead identities. The same path makes a crashed member's restart at the same
//! address (rare: a restart gets a new port unless it is pinned) immediate.
//!
//! Cost: one SYN (this node's digest, ~50 bytes per known identity) per lost peer per
//! second, at most [`MAX_LOST`] peers, for ten minutes after each loss. A graceful
//! leave is not remembered: that node said it is going.
//!
//! The bookkeeping is pure ([`Lost`]); the membership driver feeds it views and the
//! clock and sends the gossip.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::time::Instant;

use super::ClusterView;

/// How long after a loss we keep knocking on a lost member's address.
pub const RECONNECT_FOR: Duration = Duration::from_secs(600);
/// How often each lost member is gossiped to while this node still has other peers.
pub const RECONNECT_EVERY: Duration = Duration::from_secs(1);
/// The most lost members remembered; the oldest losses are forgotten first.
pub const MAX_LOST: usize = 32;

/// Members lost without a leave, by gossip address, with when they were lost.
#[derive(Debug, Default)]
pub struct Lost {
    since: BTreeMap<SocketAddr, Instant>,
    last_round: Option<Instant>,
}

impl Lost {
    /// Notes the change from `old` to `new` at `now`: members of `old` missing from
    /// `new` that were not leaving are lost; members of `new` are found again.
    pub fn note_views(&mut self, old: &ClusterView, new: &ClusterView, now: Instant) {
        for member in &old.members {
            let still_here = new
                .members
                .iter()
                .any(|m| m.gossip_addr == member.gossip_addr);
            if !still_here && !member.leaving {
                self.since.insert(member.gossip_addr, now);
            }
        }
        for member in &new.members {
            self.since.remove(&member.gossip_addr);
        }
        while self.since.len() > MAX_LOST {
            let oldest = self
                .since
                .iter()
                .min_by_key(|(addr, at)| (**at, **addr))
                .map(|(addr, _)| *addr)
                .expect("non-empty");
            self.since.remove(&oldest);
        }
    }

    /// The addresses to gossip to on a driver tick at `now`: every lost member lost
    /// less than [`RECONNECT_FOR`] ago, on every tick while this node is `alone` in
    /// its view, else at most once per [`RECONNECT_EVERY`]. Forgets older losses, but
    /// never while alone: a partition longer than ten minutes must heal the same way.
    pub fn due(&mut self, now: Instant, alone: bool) -> Vec<SocketAddr> {
        self.since
            .retain(|_, at| alone || now.saturating_duration_since(*at) < RECONNECT_FOR);
        if self.since.is_empty() {
            return Vec::new();
        }
        let waited = self
            .last_round
            .is_none_or(|last| now.saturating_duration_since(last) >= RECONNECT_EVERY);
        if !alone && !waited {
            return Vec::new();
        }
        self.last_round = Some(now);
        self.since.keys().copied().collect()
    }

    /// How many lost members are remembered.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.since.len()
    }

    /// Whether no lost member is remembered.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.since.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::Member;

    fn member(n: u8, leaving: bool) -> Member {
        let addr = |port: u16| SocketAddr::from(([127, 0, 0, n], port));
        Member {
            node_id: format!("n{n}"),
            generation: 1,
            grpc_addr: addr(1),
            peer_addr: addr(2),
            gossip_addr: addr(3),
            leaving,
        }
    }

    fn view(members: &[Member]) -> ClusterView {
        ClusterView::from_members(members.to_vec())
    }

    fn gossip(n: u8) -> SocketAddr {
        member(n, false).gossip_addr
    }

    #[test]
    fn a_member_that_vanished_is_knocked_on_once_a_second_then_forgotten() {
        let t0 = Instant::now();
        let mut lost = Lost::default();
        let (a, b, c) = (member(1, false), member(2, false), member(3, false));
        lost.note_views(
            &view(&[a.clone(), b.clone(), c.clone()]),
            &view(&[a.clone(), b.clone()]),
            t0,
        );
        assert_eq!(lost.due(t0, false), vec![gossip(3)]);
        // Not again within the second while we have other peers...
        assert!(lost.due(t0 + Duration::from_millis(200), false).is_empty());
        assert_eq!(lost.due(t0 + RECONNECT_EVERY, false), vec![gossip(3)]);
        // ...but on every tick while we are alone.
        let t1 = t0 + RECONNECT_EVERY + Duration::from_millis(200);
        assert_eq!(lost.due(t1, true), vec![gossip(3)]);
        // Kept past RECONNECT_FOR while alone (a long partition), forgotten after it
        // once this node has peers again.
        assert_eq!(lost.due(t0 + RECONNECT_FOR * 2, true), vec![gossip(3)]);
        assert!(lost.due(t0 + RECONNECT_FOR * 3, false).is_empty());
        assert!(lost.is_empty());
    }

    #[test]
    fn a_member_found_again_or_leaving_is_not_knocked_on() {
        let t0 = Instant::now();
        let mut lost = Lost::default();
        let (a, b, leaver) = (member(1, false), member(2, false), member(3, true));
        lost.note_views(
            &view(&[a.clone(), b.clone(), leaver]),
            &view(std::slice::from_ref(&a)),
            t0,
        );
        assert_eq!(
            lost.due(t0, true),
            vec![gossip(2)],
            "the leaver said goodbye"
        );
        lost.note_views(&view(std::slice::from_ref(&a)), &view(&[a, b]), t0);
        assert!(lost.due(t0 + RECONNECT_EVERY, true).is_empty());
    }

    #[test]
    fn at_most_max_lost_members_are_remembered_oldest_forgotten_first() {
        let t0 = Instant::now();
        let mut lost = Lost::default();
        let me = member(200, false);
        for n in 0..(MAX_LOST as u8 + 5) {
            let at = t0 + Duration::from_millis(u64::from(n));
            lost.note_views(
                &view(&[me.clone(), member(n, false)]),
                &view(std::slice::from_ref(&me)),
                at,
            );
        }
        assert_eq!(lost.len(), MAX_LOST);
        let due = lost.due(t0 + Duration::from_secs(1), true);
        assert!(!due.contains(&gossip(0)) && !due.contains(&gossip(4)));
        assert!(due.contains(&gossip(5)) && due.contains(&gossip(MAX_LOST as u8 + 4)));
    }
}
