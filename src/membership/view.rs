//! The pure half of membership: chitchat's live nodes in, a [`ClusterView`] out.
//!
//! Nothing here does I/O or reads a clock, so every rule about which members
//! count (one address per node id, dedupe by node id, unusable nodes skipped, leaving
//! nodes kept out of the ring) is unit-tested without a network.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use tracing::{debug, warn};

use crate::ring::Ring;

/// Chitchat key under which every node publishes its public gRPC advertise address.
pub const KEY_GRPC_ADDR: &str = "grpc_addr";

/// Chitchat key under which every node publishes the address of its peer service (the
/// cluster face: forwarded checks, refunds, handoff), on a listener of its own.
pub const KEY_PEER_ADDR: &str = "peer_addr";

/// Chitchat key a node sets to `"true"` before it stops on purpose, so that
/// its peers take it out of their rings while it can still hand state over.
pub const KEY_LEAVING: &str = "leaving";

/// One live cluster member as the rest of the node sees it.
///
/// `(node_id, generation)` identifies one *incarnation*: a restarted node
/// keeps its id (and so its ring ranges) but comes back with a higher
/// generation, which is how stale gossip about the old process is told apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Stable node identity; the ring places keys by this id only.
    pub node_id: String,
    /// Start time of this incarnation in ns since the Unix epoch; strictly
    /// higher after every restart.
    pub generation: u64,
    /// Where gateways reach this node's public gRPC services.
    pub grpc_addr: SocketAddr,
    /// Where peers reach this node's peer service (forwarded checks, refunds,
    /// handoff): the cluster face, on its own listener.
    pub peer_addr: SocketAddr,
    /// Where this node gossips; what other nodes use as a seed.
    pub gossip_addr: SocketAddr,
    /// The node announced a graceful leave: still alive (it can answer and
    /// hand state over) but no longer owns any key.
    pub leaving: bool,
}

/// One entry of chitchat's live-node set, reduced to plain data so that
/// [`build_view`] can be tested without chitchat.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveNode {
    /// The node id part of the chitchat id.
    pub node_id: String,
    /// The generation part of the chitchat id.
    pub generation: u64,
    /// The gossip advertise address part of the chitchat id.
    pub gossip_addr: SocketAddr,
    /// The node's (non-deleted) chitchat key-values.
    pub kvs: BTreeMap<String, String>,
}

/// A consistent snapshot of the cluster: who is live and who owns which key.
///
/// Published as `watch::Receiver<Arc<ClusterView>>`; readers take the `Arc`
/// and use members and ring from the same snapshot, so an owner lookup never
/// mixes two membership states.
#[derive(Clone, Debug)]
pub struct ClusterView {
    /// Live members sorted by node id, one per node id (the highest
    /// generation seen), including this node and nodes that are leaving.
    pub members: Vec<Member>,
    /// Ring over the ids of the members that are not leaving, with
    /// [`Ring::DEFAULT_VNODES`] virtual nodes each.
    pub ring: Arc<Ring>,
}

impl PartialEq for ClusterView {
    /// The ring is a function of the members, so comparing members suffices;
    /// used to skip publishing a view that did not change.
    fn eq(&self, other: &Self) -> bool {
        self.members == other.members
    }
}

impl Eq for ClusterView {}

impl ClusterView {
    /// Builds a view from members that are already de-duplicated; sorts them
    /// and derives the ring.
    pub(crate) fn from_members(mut members: Vec<Member>) -> ClusterView {
        members.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        let ring = Ring::new(
            members
                .iter()
                .filter(|m| !m.leaving)
                .map(|m| m.node_id.as_str()),
            Ring::DEFAULT_VNODES,
        );
        ClusterView {
            members,
            ring: Arc::new(ring),
        }
    }

    /// A view of only this node: what a node serves with before gossip has
    /// told it anything, so it can answer from the first moment.
    pub fn single(self_member: Member) -> ClusterView {
        ClusterView::from_members(vec![self_member])
    }

    /// The live member with this id, if any (binary search: members are
    /// sorted by id).
    pub fn member(&self, node_id: &str) -> Option<&Member> {
        self.members
            .binary_search_by(|m| m.node_id.as_str().cmp(node_id))
            .ok()
            .map(|i| &self.members[i])
    }

    /// The member that owns `key` on this view's ring; `None` only when every
    /// member is leaving (or there are none).
    pub fn owner(&self, key: &[u8]) -> Option<&Member> {
        self.member(self.ring.owner(key)?)
    }

    /// The member that owns the key at ring position `placement` (its
    /// [`Ring::key_hash`], computed once when the check was planned).
    pub fn owner_of_placement(&self, placement: u64) -> Option<&Member> {
        self.member(self.ring.owner_of_hash(placement)?)
    }
}

/// Turns chitchat's live nodes into a [`ClusterView`], with no earlier view: see
/// [`build_view_after`].
pub fn build_view(live: impl IntoIterator<Item = LiveNode>) -> ClusterView {
    build_view_after(None, live)
}

/// Turns chitchat's live nodes into a [`ClusterView`], given the view published before
/// (`None` for the first one).
///
/// Rules, in order:
/// 1. **One gossip address per node id.** Each node id has a *home*: the gossip address
///    of its member in `previous`, if an incarnation at that address is still live;
///    otherwise the address of its lowest live generation (ties broken by address).
///    A live incarnation of the id at any other address is refused and logged at warn:
///    a second process claiming an existing node's id does not get that node's
///    ring share, whatever generation it claims. A node that moved (a
///    rescheduled pod on a new address) is refused while its old incarnation is still
///    live and adopted as soon as the failure detector drops the old one (about 1 s),
///    because the home is only ever an address that is live now. A node's own id is
///    always home at its own address in its own view (it is in every view it
///    publishes). Limit: an observer with no earlier member for the id (a node that
///    just started) sees both at once and takes the lower generation, so a
///    lower-generation impostor can win there; the cluster key, which an impostor
///    must hold to gossip at all ([`super::auth`]), is the defence against that.
/// 2. A node without a parsable `grpc_addr` or `peer_addr` key-value is skipped (debug
///    log): nobody could forward to it. Skipping happens *before* picking a
///    generation, so while a restarted node's key-values are still in flight, its
///    previous, still-usable incarnation keeps the node id on the ring instead of the
///    id blinking out.
/// 3. Among the usable incarnations at home, the highest generation wins: a restart
///    (same address, higher generation) replaces the old incarnation at once, while
///    the old one still counts as live until the failure detector gives up on it.
/// 4. `leaving = "true"` keeps the member in `members` but off the ring.
///
/// The result does not depend on the input order.
pub fn build_view_after(
    previous: Option<&ClusterView>,
    live: impl IntoIterator<Item = LiveNode>,
) -> ClusterView {
    let mut by_id: BTreeMap<String, Vec<LiveNode>> = BTreeMap::new();
    for node in live {
        by_id.entry(node.node_id.clone()).or_default().push(node);
    }
    let mut members = Vec::with_capacity(by_id.len());
    for (node_id, mut incarnations) in by_id {
        incarnations.sort_by_key(|n| (n.generation, n.gossip_addr));
        let held = previous
            .and_then(|view| view.member(&node_id))
            .map(|m| m.gossip_addr)
            .filter(|addr| incarnations.iter().any(|n| n.gossip_addr == *addr));
        let home = held.unwrap_or(incarnations[0].gossip_addr);
        let mut chosen: Option<Member> = None;
        for node in incarnations {
            if node.gossip_addr != home {
                warn!(
                    %node_id,
                    generation = node.generation,
                    gossip_addr = %node.gossip_addr,
                    kept_gossip_addr = %home,
                    "refusing a second live incarnation of a node id from another gossip address"
                );
                continue;
            }
            // Ascending generations: the last usable one is the newest.
            if let Some(member) = to_member(node) {
                if let Some(old) = &chosen {
                    debug!(
                        %node_id,
                        old_generation = old.generation,
                        new_generation = member.generation,
                        "newer generation of node supersedes older one"
                    );
                }
                chosen = Some(member);
            }
        }
        members.extend(chosen);
    }
    ClusterView::from_members(members)
}

/// Reads one live node's key-values; `None` if it is unusable.
fn to_member(node: LiveNode) -> Option<Member> {
    let grpc_addr = address(&node, KEY_GRPC_ADDR)?;
    let peer_addr = address(&node, KEY_PEER_ADDR)?;
    let leaving = node.kvs.get(KEY_LEAVING).is_some_and(|v| v == "true");
    Some(Member {
        node_id: node.node_id,
        generation: node.generation,
        grpc_addr,
        peer_addr,
        gossip_addr: node.gossip_addr,
        leaving,
    })
}

/// The socket address a live node publishes under `key`; `None` (logged) if it is
/// missing or unparsable, which makes the node unusable.
fn address(node: &LiveNode, key: &str) -> Option<SocketAddr> {
    match node.kvs.get(key).map(|s| s.parse::<SocketAddr>()) {
        Some(Ok(addr)) => Some(addr),
        Some(Err(error)) => {
            debug!(
                node_id = %node.node_id,
                generation = node.generation,
                value = %node.kvs[key],
                %error,
                "skipping live node: unparsable {key}"
            );
            None
        }
        None => {
            debug!(
                node_id = %node.node_id,
                generation = node.generation,
                "skipping live node: no {key} key-value (yet)"
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn live(id: &str, generation: u64, grpc: &str, leaving: Option<&str>) -> LiveNode {
        let mut kvs = BTreeMap::new();
        kvs.insert(KEY_GRPC_ADDR.to_string(), grpc.to_string());
        kvs.insert(KEY_PEER_ADDR.to_string(), "127.0.0.1:1".to_string());
        if let Some(v) = leaving {
            kvs.insert(KEY_LEAVING.to_string(), v.to_string());
        }
        LiveNode {
            node_id: id.to_string(),
            generation,
            gossip_addr: home(id),
            kvs,
        }
    }

    /// Where `id` gossips unless a test moves it: the same for every generation, so
    /// a higher generation is a restart.
    fn home(id: &str) -> SocketAddr {
        addr(7000 + id.bytes().map(u16::from).sum::<u16>() % 1000)
    }

    /// `live(..)` gossiping from port `gossip` instead.
    fn live_from(id: &str, generation: u64, grpc: &str, gossip: u16) -> LiveNode {
        LiveNode {
            gossip_addr: addr(gossip),
            ..live(id, generation, grpc, None)
        }
    }

    /// The one member of `view` with id `id`, as (generation, gossip port).
    fn incarnation(view: &ClusterView, id: &str) -> (u64, u16) {
        let m = view.member(id).unwrap();
        (m.generation, m.gossip_addr.port())
    }

    fn ids(view: &ClusterView) -> Vec<&str> {
        view.members.iter().map(|m| m.node_id.as_str()).collect()
    }

    #[test]
    fn members_are_sorted_by_id_and_ring_covers_them() {
        let view = build_view([
            live("node-c", 1, "127.0.0.1:9003", None),
            live("node-a", 1, "127.0.0.1:9001", None),
            live("node-b", 1, "127.0.0.1:9002", None),
        ]);
        assert_eq!(ids(&view), ["node-a", "node-b", "node-c"]);
        assert_eq!(view.ring.members(), ["node-a", "node-b", "node-c"]);
        assert_eq!(view.member("node-b").unwrap().grpc_addr, addr(9002));
        assert!(view.member("node-z").is_none());
    }

    #[test]
    fn input_order_does_not_matter() {
        let nodes = vec![
            live("n3", 5, "127.0.0.1:9003", None),
            live("n1", 1, "127.0.0.1:9001", None),
            live("n1", 2, "127.0.0.1:9011", None),
            live("n2", 1, "127.0.0.1:9002", Some("true")),
        ];
        let forward = build_view(nodes.clone());
        let backward = build_view(nodes.into_iter().rev());
        assert_eq!(forward, backward);
        assert_eq!(forward.ring.digest(), backward.ring.digest());
    }

    #[test]
    fn dedupe_keeps_highest_generation_whatever_the_order() {
        for order in [[1u64, 3, 2], [3, 2, 1], [2, 1, 3]] {
            let view = build_view(
                order
                    .iter()
                    .map(|&g| live("node-a", g, &format!("127.0.0.1:{}", 9000 + g), None)),
            );
            assert_eq!(view.members.len(), 1);
            let a = view.member("node-a").unwrap();
            assert_eq!(a.generation, 3);
            assert_eq!(a.grpc_addr, addr(9003));
            assert_eq!(a.gossip_addr, home("node-a"));
            assert_eq!(view.ring.members(), ["node-a"]);
        }
    }

    #[test]
    fn newest_generation_without_usable_addr_does_not_evict_older_one() {
        let mut restarted = live("node-a", 9, "", None);
        restarted.kvs.clear();
        let view = build_view([live("node-a", 1, "127.0.0.1:9001", None), restarted]);
        assert_eq!(view.member("node-a").unwrap().generation, 1);
        assert_eq!(view.ring.members(), ["node-a"]);
    }

    #[test]
    fn leaving_member_is_listed_but_owns_nothing() {
        let view = build_view([
            live("node-a", 1, "127.0.0.1:9001", None),
            live("node-b", 1, "127.0.0.1:9002", Some("true")),
            live("node-c", 1, "127.0.0.1:9003", Some("false")),
        ]);
        assert_eq!(ids(&view), ["node-a", "node-b", "node-c"]);
        assert!(view.member("node-b").unwrap().leaving);
        assert!(!view.member("node-c").unwrap().leaving);
        assert_eq!(view.ring.members(), ["node-a", "node-c"]);
        for i in 0..1_000 {
            let key = format!("cust_{i}");
            assert_ne!(view.owner(key.as_bytes()).unwrap().node_id, "node-b");
        }
    }

    #[test]
    fn leaving_flag_of_newest_generation_wins() {
        let view = build_view([
            live("node-a", 1, "127.0.0.1:9001", Some("true")),
            live("node-a", 2, "127.0.0.1:9001", None),
        ]);
        assert!(!view.member("node-a").unwrap().leaving);
        assert_eq!(view.ring.members(), ["node-a"]);
    }

    #[test]
    fn nodes_without_parsable_grpc_addr_are_skipped() {
        let mut missing = live("node-m", 1, "", None);
        missing.kvs.remove(KEY_GRPC_ADDR);
        let view = build_view([
            live("node-a", 1, "127.0.0.1:9001", None),
            live("node-b", 1, "not an address", None),
            live("node-c", 1, "127.0.0.1", None),
            missing,
        ]);
        assert_eq!(ids(&view), ["node-a"]);
        assert_eq!(view.ring.members(), ["node-a"]);
    }

    #[test]
    fn owner_is_the_rings_owner() {
        let view = build_view([
            live("node-a", 1, "127.0.0.1:9001", None),
            live("node-b", 1, "127.0.0.1:9002", None),
            live("node-c", 1, "[::1]:9003", None),
        ]);
        for i in 0..200 {
            let key = format!("cust_{i}");
            let owner = view.owner(key.as_bytes()).unwrap();
            assert_eq!(
                Some(owner.node_id.as_str()),
                view.ring.owner(key.as_bytes())
            );
        }
    }

    #[test]
    fn empty_and_all_leaving_views_have_no_owner() {
        let empty = build_view(Vec::new());
        assert!(empty.members.is_empty());
        assert!(empty.owner(b"k").is_none());

        let all_leaving = build_view([live("node-a", 1, "127.0.0.1:9001", Some("true"))]);
        assert_eq!(all_leaving.members.len(), 1);
        assert!(all_leaving.ring.is_empty());
        assert!(all_leaving.owner(b"k").is_none());
    }

    #[test]
    fn single_view_owns_everything_itself() {
        let me = Member {
            node_id: "node-a".into(),
            generation: 42,
            grpc_addr: addr(9001),
            peer_addr: addr(9101),
            gossip_addr: addr(7001),
            leaving: false,
        };
        let view = ClusterView::single(me.clone());
        assert_eq!(view.members, std::slice::from_ref(&me));
        assert_eq!(view.owner(b"anything"), Some(&me));
    }

    #[test]
    fn equal_member_sets_give_equal_ring_digests() {
        let a = build_view([
            live("x", 1, "127.0.0.1:1", None),
            live("y", 1, "127.0.0.1:2", None),
        ]);
        let b = build_view([
            live("y", 7, "127.0.0.1:20", None),
            live("x", 3, "127.0.0.1:10", None),
        ]);
        // Different incarnations, same ids: same placement.
        assert_ne!(a, b);
        assert_eq!(a.ring.digest(), b.ring.digest());
    }

    /// Bypass closed: a second process with an existing node's id and a higher
    /// generation, gossiping from another address, took over that node's ring share.
    #[test]
    fn a_second_live_incarnation_from_another_address_is_refused() {
        let real = live("node-a", 1, "127.0.0.1:9001", None);
        let impostor = live_from("node-a", 9, "127.0.0.1:6666", 6666);
        for nodes in [
            vec![real.clone(), impostor.clone()],
            vec![impostor.clone(), real.clone()],
        ] {
            let first = build_view(nodes.clone());
            assert_eq!(first.members.len(), 1);
            assert_eq!(incarnation(&first, "node-a"), (1, home("node-a").port()));
            assert_eq!(first.member("node-a").unwrap().grpc_addr, addr(9001));
            // And still once the real one is in the view before.
            let later = build_view_after(Some(&first), nodes);
            assert_eq!(later, first);
        }
    }

    /// The incumbent is the member already in the view, so a lower generation (which
    /// an impostor can pick freely) does not win either; nor can an impostor take a
    /// node's own id in that node's view, which always lists itself.
    #[test]
    fn an_impostor_with_a_lower_generation_does_not_displace_the_incumbent() {
        let real = live("node-a", 5, "127.0.0.1:9001", None);
        let before = build_view([real.clone(), live("node-b", 1, "127.0.0.1:9002", None)]);
        let impostor = live_from("node-a", 0, "127.0.0.1:6666", 6666);
        let view = build_view_after(
            Some(&before),
            [
                impostor.clone(),
                real.clone(),
                live("node-b", 1, "127.0.0.1:9002", None),
            ],
        );
        assert_eq!(view, before);
        // Without history the lower generation is taken to be the first one: the
        // documented limit, covered by the cluster key.
        assert_eq!(
            incarnation(&build_view([impostor, real]), "node-a"),
            (0, 6666)
        );
    }

    #[test]
    fn a_restart_at_the_same_address_is_adopted_even_while_an_impostor_is_live() {
        let old = live("node-a", 1, "127.0.0.1:9001", None);
        let before = build_view([old.clone()]);
        let impostor = live_from("node-a", 7, "127.0.0.1:6666", 6666);
        let restarted = live("node-a", 2, "127.0.0.1:9011", None);
        let view = build_view_after(Some(&before), [old, impostor.clone(), restarted.clone()]);
        assert_eq!(incarnation(&view, "node-a"), (2, home("node-a").port()));
        assert_eq!(view.member("node-a").unwrap().grpc_addr, addr(9011));
        // The old incarnation dies: the restarted one stays, the impostor stays out.
        let after = build_view_after(Some(&view), [impostor, restarted]);
        assert_eq!(after, view);
    }

    /// A rescheduled pod comes back on a new address: refused while its old
    /// incarnation is live, adopted once the failure detector drops the old one.
    #[test]
    fn a_moved_node_is_adopted_once_its_old_incarnation_is_no_longer_live() {
        let old = live("node-a", 1, "127.0.0.1:9001", None);
        let moved = live_from("node-a", 2, "127.0.0.1:9021", 7777);
        let before = build_view([old.clone()]);
        let both = build_view_after(Some(&before), [old, moved.clone()]);
        assert_eq!(incarnation(&both, "node-a"), (1, home("node-a").port()));
        let after = build_view_after(Some(&both), [moved.clone()]);
        assert_eq!(incarnation(&after, "node-a"), (2, 7777));
        assert_eq!(after.member("node-a").unwrap().grpc_addr, addr(9021));
        // From then on the new address is home: the old one could not come back
        // beside it (a restart of it would be a new incarnation at a foreign address).
        let old_again = live("node-a", 3, "127.0.0.1:9001", None);
        let later = build_view_after(Some(&after), [old_again, moved]);
        assert_eq!(incarnation(&later, "node-a"), (2, 7777));
    }

    /// The home only counts if an incarnation is live there; an unusable one (its
    /// key-values still in flight) holds the id without putting anyone on the ring.
    #[test]
    fn an_unusable_incarnation_at_home_still_keeps_an_impostor_out() {
        let mut real = live("node-a", 1, "", None);
        real.kvs.clear();
        let impostor = live_from("node-a", 9, "127.0.0.1:6666", 6666);
        let view = build_view([real, impostor]);
        assert!(view.member("node-a").is_none());
        assert!(view.ring.is_empty());
    }
}
