//! Moving key state when ring ownership changes and the old owner is alive.
//!
//! Push-based: every node watches its cluster view. When the ring changes, a node
//! copies the state of every key it holds that the new ring gives to another member
//! and pushes it to that member's `Peer/Install`. The receiver merges it with any state
//! it already built for the key during the gossip window, so counts from both sides
//! survive; a key this node promoted from the receiver's own replica goes back marked
//! `joined`, and the receiver joins it instead (see `ShardCore::export_back`). The old
//! owner keeps the handed-over state: a node still on the old ring may forward a late
//! check to it, and a forwarded check is never forwarded again, so the
//! old owner decides it on the same count (never on a fresh one) and pushes what it
//! admitted as a delta every 100 ms. This serves scale-out (a joiner takes ~1/N of the keys, the
//! old owners push them) and graceful leave (the leaver drops off every ring, including
//! its own, and pushes everything).
//!
//! A crashed node cannot push: its keys restart from empty on their new owners. Each
//! ring change logs how much of the hash space moved and from whom; keys restarted
//! because their owner died are counted in `ringlimit_ownership_resets_total` (see
//! `docs/ownership.md`).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::algorithms::{Implausible, Millis};
use crate::clock::Clock;
use crate::cluster::link::PeerPool;
use crate::cluster::Inherited;
use crate::config::rules::{Rule, RuleSet};
use crate::membership::{ClusterView, Member};
use crate::ring::{diff, RingDiff};
use crate::shard::{Exported, NewOwner, Recipient, Shards};

/// States per `Install` call: the sender pushes at most this many at once and the
/// receiver refuses a call with more, so one call cannot make a node hold (or validate)
/// an unbounded number of states. Equal to the public batch maximum.
pub use crate::config::bounds::MAX_INSTALL_STATES;

/// How far ahead of the receiver's clock a handed-over state's window or timestamps may
/// be, in ms (see "Clock skew at a handoff" in `docs/ownership.md`). Members' clocks are
/// expected within NTP's tens of milliseconds; 5 s leaves room for a badly synchronised
/// member while keeping a forged state from reaching more than 5 s into the future.
pub const MAX_CLOCK_SKEW_MS: u64 = 5_000;

/// Moves state off this node when its ring says the state belongs elsewhere.
#[derive(Clone)]
pub struct Handoff {
    me: Arc<str>,
    shards: Shards,
    peers: PeerPool,
    inherited: Arc<Inherited>,
    clock: Arc<dyn Clock>,
    pushed: metrics::Counter,
    lost: metrics::Counter,
    restarts: metrics::Counter,
    deltas: metrics::Counter,
}

impl Handoff {
    /// A handoff for node `me`.
    pub fn new(
        me: Arc<str>,
        shards: Shards,
        peers: PeerPool,
        inherited: Arc<Inherited>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Self {
            me,
            shards,
            peers,
            inherited,
            clock,
            pushed: metrics::counter!("ringlimit_handoff_pushed_total"),
            lost: metrics::counter!("ringlimit_handoff_failed_total"),
            restarts: metrics::counter!("ringlimit_member_restarts_total"),
            deltas: metrics::counter!("ringlimit_handoff_deltas_total"),
        }
    }

    /// React to every ring change until `cancel`.
    pub async fn watch(
        self,
        mut views: watch::Receiver<Arc<ClusterView>>,
        cancel: CancellationToken,
    ) {
        let first = views.borrow_and_update().clone();
        // A node's first rings inherit nothing from a dead member.
        self.inherited.accounted(first.ring.digest());
        let mut watcher = Watcher::new(self.me.clone(), first);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                changed = views.changed() => if changed.is_err() { return },
            }
            let step = watcher.next(views.borrow_and_update().clone());
            self.apply(step).await;
        }
    }

    /// Do what one view change asks: say which members restarted, log and account for
    /// a ring change, and push away what is no longer ours.
    async fn apply(&self, step: ViewStep) {
        for (node, from, to) in &step.restarts {
            self.restarts.increment(1);
            tracing::warn!(
                node = %node,
                from,
                to,
                "member restarted: the keys it owned restart from empty (see docs/ownership.md)"
            );
        }
        if let Some(view) = &step.hand_on {
            self.push_away(view).await;
        }
        let Some(ring) = step.ring else {
            return;
        };
        tracing::info!(
            members_before = ring.members_before,
            members_after = ring.view.ring.len(),
            digest = format_args!("{:016x}", ring.view.ring.digest()),
            moved = %percent(ring.moved),
            to_me = %percent(ring.share_to_me),
            from_me = %percent(ring.share_from_me),
            "ring changed"
        );
        if !ring.inherited_from_dead.is_empty() {
            tracing::warn!(
                dead = %ring.from_dead.join(","),
                share = %percent(ring.inherited_from_dead.moved_fraction()),
                "inherited keys of a dead node: their counts restart from empty here (see docs/ownership.md)"
            );
            self.inherited
                .record(ring.inherited_from_dead, self.clock.now_ms());
        }
        self.inherited.accounted(ring.view.ring.digest());
        if let Some(earlier) = ring.hand_over {
            self.hand_over(&ring.view, Some(earlier)).await;
        }
    }

    /// Hand every key `view` gives to another member to that member. Returns how many
    /// keys their new owners installed.
    pub async fn push_away(&self, view: &ClusterView) -> u64 {
        self.hand_over(view, None).await
    }

    /// [`Handoff::push_away`]; with `earlier` (each placement's owner before this
    /// node), the keys this node promoted go back to that owner to be joined.
    async fn hand_over(&self, view: &ClusterView, earlier: Option<NewOwner>) -> u64 {
        let new_owner = new_owners(view, self.me.clone());
        match self.shards.export(new_owner, earlier).await {
            Ok(exported) => {
                self.push(view, exported.merged, "handed state over").await
                    // Keys promoted here, back to the incarnation their replica came from.
                    + self.push(view, exported.joined, HANDED_BACK).await
            }
            Err(error) => {
                tracing::error!(%error, "handoff export failed");
                0
            }
        }
    }

    /// Push admissions made on handed-over keys (late checks from nodes on the old
    /// ring) to the keys' new owners, every `every`, until `cancel`.
    pub async fn flush_deltas(
        self,
        views: watch::Receiver<Arc<ClusterView>>,
        every: std::time::Duration,
        cancel: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let view = views.borrow().clone();
            self.flush_once(&view).await;
        }
    }

    /// One delta push (also the last step of a graceful leave).
    pub async fn flush_once(&self, view: &ClusterView) -> u64 {
        match self.shards.drain_deltas(reachable(view)).await {
            Ok(deltas) if !deltas.is_empty() => {
                self.deltas.increment(deltas.len() as u64);
                self.push(view, deltas, "pushed late admissions").await
            }
            Ok(_) => 0,
            Err(error) => {
                tracing::debug!(%error, "delta drain failed");
                0
            }
        }
    }

    /// Push states to their destinations, in chunks, counting what is lost.
    async fn push(
        &self,
        view: &ClusterView,
        items: Vec<(Arc<str>, Exported)>,
        what: &'static str,
    ) -> u64 {
        let routed = destinations(view, items);
        for (owner_id, keys) in routed.gone {
            tracing::error!(to = %owner_id, keys, "handoff target left the cluster: these counts are lost");
            self.lost.increment(keys as u64);
        }
        let mut installed = 0;
        for (owner, states) in routed.to {
            let owner_id = owner.node_id.clone();
            let total = states.len();
            let mut delivered = 0;
            for chunk in states.chunks(MAX_INSTALL_STATES) {
                let pushed = if what == HANDED_BACK {
                    self.peers.hand_back(&owner, chunk).await
                } else {
                    self.peers.install(&owner, chunk, what).await
                };
                match pushed {
                    Ok(n) => {
                        installed += n;
                        delivered += chunk.len();
                    }
                    Err(error) => {
                        tracing::error!(to = %owner_id, %error, keys = chunk.len(), "handoff push failed: these counts are lost");
                        self.lost.increment(chunk.len() as u64);
                    }
                }
            }
            self.pushed.increment(delivered as u64);
            tracing::info!(to = %owner_id, keys = total, delivered, "{what}");
        }
        installed
    }
}

/// Whether late deltas for a new owner (id, generation) can go out under `view`: it
/// holds that incarnation or a later one. Keys handed to a member that restores before
/// this node's view holds it (a joiner, or one back from a graceful leave whose
/// earlier incarnation the view still holds, leaving) keep their deltas until it does:
/// pushed to the address of the incarnation the view holds, or to none, they were
/// lost (a restarted owner at 73 of a key's 77).
pub fn reachable(view: &ClusterView) -> crate::shard::Reachable {
    let view = view.clone();
    Arc::new(move |to: &str, generation: u64| {
        view.member(to).is_some_and(|m| m.generation >= generation)
    })
}

/// The owner under `view` of each key, as the incarnation `view` holds; `None` where
/// that is `me`.
pub fn new_owners(view: &ClusterView, me: Arc<str>) -> NewOwner {
    let view = view.clone();
    Arc::new(move |placement: u64| {
        let owner = view.ring.owner_of_hash(placement).filter(|o| *o != &*me)?;
        let member = view.member(owner)?;
        Some(Recipient::new(owner, member.generation))
    })
}

/// The handoff watcher's memory and step, pure: each view the node publishes goes
/// in, and what to do about it comes out ([`ViewStep`]). The async [`Handoff::watch`]
/// performs it; the simulator drives the same step.
#[derive(Debug)]
pub struct Watcher {
    me: Arc<str>,
    current: Arc<ClusterView>,
    /// The views before `current`, oldest first, at most [`HISTORY`].
    history: VecDeque<Arc<ClusterView>>,
}

/// What one new view asks of the handoff.
#[derive(Default)]
pub struct ViewStep {
    /// Members that came back with a higher generation before they were declared dead
    /// (node, generation before, generation now): they keep their ring ranges, so no
    /// ring change shows it, but they restarted empty, and every key they owned
    /// restarts from zero.
    pub restarts: Vec<(String, u64, u64)>,
    /// The ring changed.
    pub ring: Option<RingStep>,
    /// A member restarted and the ring stayed: hand every key this view gives another
    /// member on to it ([`Handoff::push_away`]). A member that answered a restore on a
    /// view without the restarted member (out of it while it was down) handed the
    /// restoring node keys the restarted member owns: held here, no ring change would
    /// ever move them, and the restarted member answered for them from empty.
    pub hand_on: Option<Arc<ClusterView>>,
}

/// A ring change, as the handoff sees it.
pub struct RingStep {
    /// The new view.
    pub view: Arc<ClusterView>,
    /// Ring members before.
    pub members_before: usize,
    /// Share of the hash space that moved.
    pub moved: f64,
    /// Shares that moved to and away from this node.
    pub share_to_me: f64,
    /// See `share_to_me`.
    pub share_from_me: f64,
    /// Members that left without saying so (dead, not leaving).
    pub from_dead: Vec<String>,
    /// The ranges this node inherited from them: their counts restart here.
    pub inherited_from_dead: RingDiff,
    /// Some of the hash space moved away from this node: hand its keys over, and those
    /// it promoted back to these earlier owners ([`earlier_owners`]).
    pub hand_over: Option<NewOwner>,
}

impl Watcher {
    /// The watcher of node `me`, whose first view is `first`.
    pub fn new(me: Arc<str>, first: Arc<ClusterView>) -> Self {
        Self {
            me,
            current: first,
            history: VecDeque::with_capacity(HISTORY + 1),
        }
    }

    /// The node published `next`.
    pub fn next(&mut self, next: Arc<ClusterView>) -> ViewStep {
        let current = std::mem::replace(&mut self.current, next.clone());
        let restarts = restarts(&current, &next);
        self.history.push_back(current.clone());
        if self.history.len() > HISTORY {
            self.history.pop_front();
        }
        let moved = next.ring.digest() != current.ring.digest();
        let hand_on = (!moved && !restarts.is_empty()).then(|| next.clone());
        let ring = moved.then(|| self.ring_step(&current, next));
        ViewStep {
            restarts,
            ring,
            hand_on,
        }
    }

    fn ring_step(&self, old: &ClusterView, new: Arc<ClusterView>) -> RingStep {
        let moves = diff(&old.ring, &new.ring);
        let me = &*self.me;
        let from_dead: Vec<String> = old
            .members
            .iter()
            .filter(|m| new.member(&m.node_id).is_none() && !m.leaving)
            .map(|m| m.node_id.clone())
            .collect();
        let inherited_from_dead = RingDiff {
            moves: moves
                .moves
                .iter()
                .filter(|m| m.to == me && from_dead.contains(&m.from))
                .cloned()
                .collect(),
        };
        let share = |to_me: bool| -> f64 {
            moves
                .moves
                .iter()
                .filter(|m| if to_me { m.to == me } else { m.from == me })
                .map(|m| m.fraction())
                .sum()
        };
        let (share_to_me, share_from_me) = (share(true), share(false));
        let hand_over = (share_from_me > 0.0)
            .then(|| earlier_owners(self.history.iter().cloned().collect(), self.me.clone()));
        RingStep {
            members_before: old.ring.len(),
            moved: moves.moved_fraction(),
            share_to_me,
            share_from_me,
            from_dead,
            inherited_from_dead,
            hand_over,
            view: new,
        }
    }
}

/// Members of `new` that `old` lists under a lower generation.
fn restarts(old: &ClusterView, new: &ClusterView) -> Vec<(String, u64, u64)> {
    if old.members.is_empty() {
        return Vec::new();
    }
    new.members
        .iter()
        .filter_map(|member| {
            let before = old.member(&member.node_id)?;
            (member.generation > before.generation)
                .then(|| (member.node_id.clone(), before.generation, member.generation))
        })
        .collect()
}

/// States to push, by destination.
#[derive(Debug, Default)]
pub struct Destinations {
    /// Each destination `view` lists, with its states in key order.
    pub to: Vec<(Member, Vec<Exported>)>,
    /// Destinations `view` no longer lists, with how many states they lose.
    pub gone: Vec<(Arc<str>, usize)>,
}

/// Group `items` (destination, state) by destination member of `view`, in id order
/// (one order for a run, whatever order the stores iterated in).
pub fn destinations(view: &ClusterView, items: Vec<(Arc<str>, Exported)>) -> Destinations {
    let mut by_owner: BTreeMap<Arc<str>, Vec<Exported>> = BTreeMap::new();
    for (to, item) in items {
        by_owner.entry(to).or_default().push(item);
    }
    let mut routed = Destinations::default();
    for (owner, mut states) in by_owner {
        match view.member(&owner) {
            Some(member) => {
                states.sort_by_key(|s| (s.id.placement, s.id.disc));
                routed.to.push((member.clone(), states));
            }
            None => routed.gone.push((owner, states.len())),
        }
    }
    routed
}

/// What [`Handoff::push`] says of keys handed back to be joined (see
/// `ShardCore::export_back`).
const HANDED_BACK: &str = "handed promoted keys back";

/// Views the handoff remembers to find, for a key this node promoted, the incarnation
/// that owned it before ([`earlier_owners`]).
const HISTORY: usize = 16;

/// For each key placement: the incarnation that owned it in the newest of `views`
/// (oldest first) whose ring gives it to another member than `me`; `None` where `me`
/// owned it in all. For a key `me` promoted, that is the owner whose replica it
/// promoted, as `me` saw it then.
pub fn earlier_owners(views: Vec<Arc<ClusterView>>, me: Arc<str>) -> NewOwner {
    Arc::new(move |placement: u64| {
        let view = views
            .iter()
            .rev()
            .find(|v| v.ring.owner_of_hash(placement).is_some_and(|o| o != &*me))?;
        let owner = view.ring.owner_of_hash(placement)?;
        Some(Recipient::new(owner, view.member(owner)?.generation))
    })
}

/// Handed-over states sorted by what the receiver does with them.
#[derive(Debug, Default)]
pub struct Vetted {
    /// States to install, each with the local rule it belongs to.
    pub items: Vec<(Exported, Arc<Rule>)>,
    /// States of rules this node does not have (the rule sets differ for a moment):
    /// skipped, not suspicious.
    pub unknown_rule: u64,
    /// States refused as implausible, per reason ([`Implausible::index`]).
    pub refused: [u64; Implausible::ALL.len()],
}

impl Vetted {
    /// How many states were refused as implausible.
    pub fn refused_total(&self) -> u64 {
        self.refused.iter().sum()
    }
}

/// Pair handed-over states with the local rule each belongs to, and keep only those the
/// rule could have produced by `now` (the receiver's clock) plus [`MAX_CLOCK_SKEW_MS`]
/// (see [`Limiter::validate_imported`](crate::algorithms::Limiter::validate_imported)).
///
/// Any local rule with the same numbers decides identically: the counter's identity
/// (which includes the rule name) travels in the id, so the receiver needs the rule only
/// for its arithmetic. States no local rule has the numbers of are dropped and counted in
/// `unknown_rule`; implausible ones (a window from the far future, a count beyond the
/// limit) are refused and counted per reason, never merged. Fallback counters never
/// travel.
pub fn with_rules(states: Vec<Exported>, rules: &RuleSet, now: Millis) -> Vetted {
    with_rule_list(states, rules.rules().iter(), now)
}

/// [`with_rules`] over any rules: the rule set's and the Envoy configuration's.
pub fn with_rule_list<'a>(
    states: Vec<Exported>,
    rules: impl Iterator<Item = &'a Arc<Rule>>,
    now: Millis,
) -> Vetted {
    let by_fingerprint: HashMap<u64, &Arc<Rule>> =
        rules.map(|rule| (rule.fingerprint, rule)).collect();
    let mut vetted = Vetted::default();
    for state in states {
        let Some(rule) = by_fingerprint.get(&state.fingerprint) else {
            vetted.unknown_rule += 1;
            continue;
        };
        match rule
            .limiter
            .validate_imported(&state.state, now, MAX_CLOCK_SKEW_MS)
        {
            Ok(()) => vetted.items.push((state, Arc::clone(rule))),
            Err(reason) => vetted.refused[reason.index()] += 1,
        }
    }
    vetted
}

/// A fraction as a log-friendly percentage: one decimal, never `-0.0%` (a sum of
/// shares that cancel can come out as negative zero).
fn percent(fraction: f64) -> String {
    let p = fraction * 100.0;
    format!("{:.1}%", if p <= 0.0 { 0.0 } else { p })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::policy::testkit;
    use crate::shard::KeyId;

    const NOW: Millis = 1_700_000_000_000;

    #[test]
    fn the_earlier_owner_is_the_newest_other_owner_with_its_generation_then() {
        use crate::cluster::policy::testkit::view;
        let full = Arc::new(view(&["a", "b", "c"]));
        let mut a2 = full.members.clone();
        a2.iter_mut().find(|m| m.node_id == "a").unwrap().generation = 2;
        let restarted = Arc::new(ClusterView::from_members(a2));
        let dropped = Arc::new(view(&["b", "c"]));
        // A key a owned that b took over when b's view dropped a.
        let p = (0..20_000u64)
            .map(|i| crate::ring::Ring::key_hash(format!("k{i}").as_bytes()))
            .find(|&p| {
                full.ring.owner_of_hash(p) == Some("a")
                    && dropped.ring.owner_of_hash(p) == Some("b")
            })
            .expect("a key of a's that goes to b");
        let earlier = earlier_owners(vec![full.clone(), dropped.clone()], Arc::from("b"));
        assert_eq!(earlier(p), Some(Recipient::new("a", 1)));
        let earlier = earlier_owners(vec![full, restarted, dropped.clone()], Arc::from("b"));
        assert_eq!(earlier(p), Some(Recipient::new("a", 2)), "as last seen");
        let earlier = earlier_owners(vec![dropped], Arc::from("b"));
        assert_eq!(earlier(p), None, "b owned it in every view kept");
    }

    #[test]
    fn the_watcher_hands_over_only_when_the_ring_moves_keys_away_from_this_node() {
        use crate::cluster::policy::testkit::view;
        let two = Arc::new(view(&["a", "b"]));
        let three = Arc::new(view(&["a", "b", "c"]));
        // A joiner takes ranges from both: each hands over.
        for me in ["a", "b"] {
            let mut w = Watcher::new(Arc::from(me), two.clone());
            let step = w.next(three.clone());
            let ring = step.ring.expect("the ring changed");
            assert!(ring.share_from_me > 0.0 && ring.hand_over.is_some(), "{me}");
            assert!(ring.from_dead.is_empty() && ring.inherited_from_dead.is_empty());
        }
        // A node that was alone owned everything: joining, it hands the others theirs.
        let mut c = Watcher::new(Arc::from("c"), Arc::new(view(&["c"])));
        let ring = c.next(three.clone()).ring.expect("the ring changed");
        assert!(ring.hand_over.is_some() && ring.share_from_me > 0.5);
        // The same ring again: nothing to do.
        let mut a = Watcher::new(Arc::from("a"), three.clone());
        let step = a.next(Arc::new(view(&["a", "b", "c"])));
        assert!(step.ring.is_none() && step.restarts.is_empty());
    }

    #[test]
    fn the_watcher_names_dead_members_and_restarts_but_not_leavers() {
        use crate::cluster::policy::testkit::view;
        let three = Arc::new(view(&["a", "b", "c"]));
        // c dies: a inherits some of its ranges, which restart from empty there.
        let mut a = Watcher::new(Arc::from("a"), three.clone());
        let ring = a.next(Arc::new(view(&["a", "b"]))).ring.expect("changed");
        assert_eq!(ring.from_dead, vec!["c".to_string()]);
        assert!(ring.share_to_me > 0.0 && !ring.inherited_from_dead.is_empty());
        assert!(ring.hand_over.is_none(), "nothing moved away from a");
        // c leaves: not dead, nothing inherited from the dead.
        let mut leaving = three.members.clone();
        leaving
            .iter_mut()
            .find(|m| m.node_id == "c")
            .unwrap()
            .leaving = true;
        let mut a = Watcher::new(Arc::from("a"), Arc::new(ClusterView::from_members(leaving)));
        let step = a.next(Arc::new(view(&["a", "b"])));
        assert!(step
            .ring
            .is_none_or(|r| r.from_dead.is_empty() && r.inherited_from_dead.is_empty()));
        // b back under a new generation before it was dropped: a restart, same ring.
        let mut b2 = three.members.clone();
        b2.iter_mut().find(|m| m.node_id == "b").unwrap().generation = 7;
        let mut a = Watcher::new(Arc::from("a"), three.clone());
        let step = a.next(Arc::new(ClusterView::from_members(b2)));
        assert_eq!(step.restarts, vec![("b".to_string(), 1, 7)]);
        assert!(step.ring.is_none());
        assert!(
            step.hand_on.is_some(),
            "keys of b's handed here on a view without b go on to it"
        );
        let step = a.next(Arc::new(view(&["a", "b", "c"])));
        assert!(
            step.hand_on.is_none(),
            "the ring moved: the ring step hands over"
        );
    }

    #[test]
    fn the_watcher_remembers_sixteen_views_for_the_earlier_owners() {
        use crate::cluster::policy::testkit::view;
        let full = Arc::new(view(&["a", "b", "c"]));
        let without_a = Arc::new(view(&["b", "c"]));
        let p = (0..20_000u64)
            .map(|i| crate::ring::Ring::key_hash(format!("k{i}").as_bytes()))
            .find(|&p| {
                full.ring.owner_of_hash(p) == Some("a")
                    && without_a.ring.owner_of_hash(p) == Some("b")
            })
            .expect("a key of a's that goes to b");
        // b saw a, then a long run of views without it, then a back: the key goes back
        // to a, and whether b remembers a as its earlier owner depends on how far back.
        let run = |between: usize| {
            let mut w = Watcher::new(Arc::from("b"), full.clone());
            w.next(without_a.clone());
            for i in 0..between {
                // Views that differ (a generation bump of c) but keep the ring.
                let mut m = without_a.members.clone();
                m.iter_mut().find(|m| m.node_id == "c").unwrap().generation = 2 + i as u64;
                w.next(Arc::new(ClusterView::from_members(m)));
            }
            let ring = w.next(full.clone()).ring.expect("a is back");
            ring.hand_over.expect("b gives a's range back")(p)
        };
        assert_eq!(run(3), Some(Recipient::new("a", 1)));
        assert_eq!(run(HISTORY + 1), None, "a is out of the watcher's memory");
    }

    #[test]
    fn pushes_go_to_members_in_id_order_and_those_gone_are_counted() {
        use crate::cluster::policy::testkit::view;
        let v = view(&["a", "b"]);
        let rules = testkit::rules();
        let default = rules.default_rule().clone();
        let state = |k: &str| Exported {
            id: KeyId::of("default", k.as_bytes(), "/x"),
            fingerprint: default.fingerprint,
            state: default.limiter.new_state(),
        };
        let items = vec![
            (Arc::from("b"), state("k1")),
            (Arc::from("gone"), state("k2")),
            (Arc::from("a"), state("k3")),
            (Arc::from("b"), state("k4")),
        ];
        let routed = destinations(&v, items);
        let to: Vec<(&str, usize)> = routed
            .to
            .iter()
            .map(|(m, s)| (m.node_id.as_str(), s.len()))
            .collect();
        assert_eq!(to, vec![("a", 1), ("b", 2)]);
        assert_eq!(routed.gone, vec![(Arc::from("gone"), 1)]);
        let b = &routed.to[1].1;
        assert!(b[0].id.placement <= b[1].id.placement, "key order");
    }

    #[test]
    fn handed_over_states_find_their_rule_by_fingerprint_or_are_dropped() {
        let rules = testkit::rules();
        let default = rules.default_rule().clone();
        let state = |fingerprint| Exported {
            id: KeyId::of("default", b"k", "/x"),
            fingerprint,
            state: default.limiter.new_state(),
        };
        let vetted = with_rules(vec![state(default.fingerprint), state(12345)], &rules, NOW);
        assert_eq!(vetted.items.len(), 1);
        assert_eq!(vetted.items[0].1.name, default.name);
        assert_eq!(vetted.unknown_rule, 1);
        assert_eq!(vetted.refused_total(), 0);
    }

    #[test]
    fn implausible_states_are_refused_and_counted_by_reason() {
        let rules = testkit::rules();
        let default = rules.default_rule().clone();
        let made_now = {
            let mut s = default.limiter.new_state();
            default
                .limiter
                .check(&mut s, NOW, std::num::NonZeroU64::MIN);
            s
        };
        let from_later = {
            let mut s = default.limiter.new_state();
            default
                .limiter
                .check(&mut s, NOW + 3_600_000, std::num::NonZeroU64::MIN);
            s
        };
        let other_algorithm = match default.limiter.kind() {
            crate::algorithms::AlgorithmKind::TokenBucket => {
                crate::algorithms::KeyState::FixedWindow(Default::default())
            }
            _ => crate::algorithms::KeyState::TokenBucket(Default::default()),
        };
        let exported = |state| Exported {
            id: KeyId::of("default", b"k", "/x"),
            fingerprint: default.fingerprint,
            state,
        };
        let vetted = with_rules(
            vec![
                exported(made_now.clone()),
                exported(from_later),
                exported(other_algorithm),
            ],
            &rules,
            NOW,
        );
        assert_eq!(vetted.items.len(), 1, "only the state made by now installs");
        assert_eq!(vetted.items[0].0.state, made_now);
        assert_eq!(vetted.refused[Implausible::Future.index()], 1);
        assert_eq!(vetted.refused[Implausible::Algorithm.index()], 1);
        // A sender whose clock is ahead within the allowance still hands over.
        let mut ahead = default.limiter.new_state();
        default.limiter.check(
            &mut ahead,
            NOW + MAX_CLOCK_SKEW_MS,
            std::num::NonZeroU64::MIN,
        );
        assert_eq!(
            with_rules(vec![exported(ahead)], &rules, NOW).items.len(),
            1
        );
    }
}
