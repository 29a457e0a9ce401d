//! Fencing, the pure half: whether this node may decide the counters of a fenced rule
//! (`partition = "fence"`), from the heartbeats it has heard and when.
//!
//! A partition makes two deciders of a key: its owner on one side, its successor (fail-
//! over, then promotion) on the other. A fenced rule allows one, so a node decides a
//! fenced key only while both hold:
//!
//! 1. **It holds a majority lease**: it heard a heartbeat advance from a majority of the
//!    cluster (itself included) within the last [`FenceConfig::quorum_silence_ms`] (F),
//!    and has held that for [`FenceConfig::rejoin_hold_ms`] (H) since it last had none
//!    ([`FenceConfig::join_hold_ms`] after its start).
//!    The lease is an instant on this node's monotonic clock (the F-th newest heartbeat
//!    plus F), so a snapshot of it read late (a stalled process) only denies more.
//! 2. **It is the key's owner among the live**: the owner of the key on a ring over the
//!    members of its view, every node whose heartbeat advanced within
//!    [`FenceConfig::takeover_silence_ms`] (T), and itself. A dead owner leaves that
//!    ring only once it is out of the view *and* silent for T, so a successor takes its
//!    keys over (fail-over or promotion) no earlier than T after its last heartbeat.
//!    Adding nodes to a consistent-hash ring only takes ranges away, so the larger the
//!    set, the fewer keys a node decides: every doubt errs towards a denial.
//!
//! **Why the two cannot overlap.** Cut off at instant P, a minority owner O last heard
//! the majority at most at P, so it stops deciding by P + F (+ the tracker's tick, as
//! its readings of "heard" lag the datagram by at most one tick). A majority node last
//! heard O's heartbeat advance at P − G at the earliest (G: the longest gap between two
//! of O's heartbeats reaching it, about two gossip rounds), so it decides O's keys from
//! P − G + T on. T − G > F + tick keeps the two apart: with the defaults (F = 500 ms,
//! T = 1,500 ms, G ≤ 400 ms, tick 50 ms) by at least 550 ms. Both intervals are
//! measured on each node's own monotonic clock: only clock *rates* matter, never their
//! offsets. On heal, O decides again only after holding a majority for H = T, by when
//! the majority has heard O (O is back in their rings, so they deny its keys) and has
//! handed back what it decided on them.
//!
//! **Majority of what.** `--cluster-size N` when given (a StatefulSet's replicas: a
//! node restarted alone, with all its peers down, stays fenced). Otherwise the largest
//! view this node has held: a member that leaves or dies still counts until the smaller
//! view has been unchanged for [`FenceConfig::shrink_after_ms`] *while this node holds
//! a majority of the larger one*, and the smaller view is itself a majority of it. A
//! side cut off into a minority can never shrink its basis, so it never becomes a
//! majority of itself. A node started without seeds
//! founds a cluster of 1; one with seeds knows nothing until it sees another member, or
//! until its single-member view has been unchanged for the shrink delay.

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::sync::Arc;

use crate::ring::Ring;

/// The fencing timings and the cluster size majorities are counted of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FenceConfig {
    /// `--cluster-size`: majorities are of this many members; `None`: of the largest
    /// view held (see the module docs).
    pub cluster_size: Option<NonZeroUsize>,
    /// F: a node stops deciding fenced keys this long after it last heard a majority.
    pub quorum_silence_ms: u64,
    /// T: a member silent this long (and out of the view) no longer owns its keys.
    pub takeover_silence_ms: u64,
    /// H: after a time without a majority, how long one must be held again.
    pub rejoin_hold_ms: u64,
    /// How long a node that just started holds its first majority before deciding:
    /// long enough for every member to hear its heartbeats (its keys' state comes
    /// back through the restore, which client checks wait for anyway).
    pub join_hold_ms: u64,
    /// How long a smaller view must stand before majorities are counted of it.
    pub shrink_after_ms: u64,
    /// Whether the node joined through seeds (else it founds a cluster of one).
    pub seeded: bool,
}

/// F: half a failure-detection time (about 8 heartbeat intervals of 110–140 ms).
pub const DEFAULT_QUORUM_SILENCE_MS: u64 = 500;
/// T: longer than F plus the longest heartbeat gap and a tick (the module docs).
pub const DEFAULT_TAKEOVER_SILENCE_MS: u64 = 1_500;
/// A few heartbeat intervals: every member hears a starting node before it decides.
pub const DEFAULT_JOIN_HOLD_MS: u64 = 500;
/// How long a smaller view must stand before majorities shrink to it.
pub const DEFAULT_SHRINK_AFTER_MS: u64 = 5_000;
/// How often the membership driver reads heartbeats into the tracker.
pub const FENCE_TICK_MS: u64 = 50;

impl FenceConfig {
    /// The defaults, majorities of `cluster_size` when given.
    pub fn new(cluster_size: Option<NonZeroUsize>, seeded: bool) -> Self {
        Self {
            cluster_size,
            quorum_silence_ms: DEFAULT_QUORUM_SILENCE_MS,
            takeover_silence_ms: DEFAULT_TAKEOVER_SILENCE_MS,
            rejoin_hold_ms: DEFAULT_TAKEOVER_SILENCE_MS,
            join_hold_ms: DEFAULT_JOIN_HOLD_MS,
            shrink_after_ms: DEFAULT_SHRINK_AFTER_MS,
            seeded,
        }
    }
}

/// One incarnation's heartbeat as last read, and when it last advanced.
#[derive(Debug, Clone, Copy)]
struct Seen {
    heartbeat: u64,
    /// `None` until it advances once: gossip carries the last heartbeat of dead nodes
    /// too, so a first sighting proves nothing.
    advanced: Option<u64>,
}

/// The tracker: fed every heartbeat reading and view size with this node's monotonic
/// time, it says whether this node may decide fenced keys ([`Quorum::fence`]).
#[derive(Debug, Clone)]
pub struct Quorum {
    config: FenceConfig,
    me: String,
    seen: BTreeMap<(String, u64), Seen>,
    /// The size majorities are counted of; `None` until known.
    basis: Option<usize>,
    view: usize,
    view_since: u64,
    /// Since when a majority has been held without a break.
    majority_since: Option<u64>,
    /// Whether a majority was ever held (the hold after a break is longer than the
    /// first one).
    broke: bool,
    /// Members seen announcing a leave (each lowers the basis once).
    leaving: std::collections::BTreeSet<String>,
    /// When [`Quorum::tick`] last ran: a gap of F or more means this process stood
    /// still (a pause, a stall), and its majority is counted as broken.
    last_tick: Option<u64>,
    /// The owners' ring of the last fence, and the members it was built of: built
    /// again only when they change (every tick reads it).
    owners: Option<(Vec<String>, Arc<Ring>)>,
}

impl Quorum {
    /// A tracker for node `me`, started at `now`.
    pub fn new(config: FenceConfig, me: &str, now: u64) -> Self {
        let basis = match config.cluster_size {
            Some(n) => Some(n.get()),
            None if !config.seeded => Some(1),
            None => None,
        };
        Self {
            config,
            me: me.to_string(),
            seen: BTreeMap::new(),
            basis,
            view: 1,
            view_since: now,
            majority_since: None,
            broke: false,
            leaving: std::collections::BTreeSet::new(),
            last_tick: None,
            owners: None,
        }
    }

    /// Every incarnation's heartbeat as read now (this node's own is skipped): the ones
    /// absent from `readings` are forgotten.
    pub fn heartbeats<'a>(
        &mut self,
        readings: impl IntoIterator<Item = (&'a str, u64, u64)>,
        now: u64,
    ) {
        let mut seen = BTreeMap::new();
        for (node_id, generation, heartbeat) in readings {
            if node_id == self.me {
                continue;
            }
            let key = (node_id.to_string(), generation);
            let entry = match self.seen.get(&key) {
                None => Seen {
                    heartbeat,
                    advanced: None,
                },
                Some(old) if heartbeat > old.heartbeat => Seen {
                    heartbeat,
                    advanced: Some(now),
                },
                Some(old) => *old,
            };
            seen.insert(key, entry);
        }
        self.seen = seen;
    }

    /// The view now has `members` members (leaving ones included).
    /// The view now has `members` members off the ring's leaving ones, and these
    /// `leaving` ones. A member seen announcing its leave is a planned departure: the
    /// basis drops by one at once (a crash is not, and waits for the shrink rule).
    pub fn view<'a>(
        &mut self,
        members: usize,
        leaving: impl IntoIterator<Item = &'a str>,
        now: u64,
    ) {
        for id in leaving {
            if self.leaving.insert(id.to_string()) && self.config.cluster_size.is_none() {
                if let Some(b) = self.basis.as_mut() {
                    *b = b.saturating_sub(1).max(members).max(1);
                }
            }
        }
        if members != self.view {
            self.view = members;
            self.view_since = now;
        }
    }

    /// The last instant each other node's heartbeat advanced, by node id.
    fn heard(&self) -> BTreeMap<&str, u64> {
        let mut heard: BTreeMap<&str, u64> = BTreeMap::new();
        for ((id, _), seen) in &self.seen {
            if let Some(at) = seen.advanced {
                let e = heard.entry(id.as_str()).or_insert(at);
                *e = (*e).max(at);
            }
        }
        heard
    }

    /// Until when (monotonic ms, exclusive) a majority of `basis` stays heard: the
    /// newest heartbeat of the (majority − 1)-th most recently heard other node, plus F.
    fn majority_until(&self, basis: usize) -> Option<u64> {
        let needed_others = basis / 2;
        if needed_others == 0 {
            return Some(u64::MAX);
        }
        let mut times: Vec<u64> = self.heard().into_values().collect();
        times.sort_unstable_by(|a, b| b.cmp(a));
        times
            .get(needed_others - 1)
            .map(|at| at.saturating_add(self.config.quorum_silence_ms))
    }

    /// Advance the basis and the majority's start to `now`: call after the readings of
    /// one tick.
    ///
    /// A tick F or more after the previous one breaks the majority whatever the
    /// readings say: the process stood still (SIGSTOP, a stall), others may have taken
    /// its keys over meanwhile, and heartbeats read on waking up all look fresh. So it
    /// holds a majority for the rejoin hold again before it decides, as after a cut.
    pub fn tick(&mut self, now: u64) {
        let stood_still = self
            .last_tick
            .is_some_and(|last| now.saturating_sub(last) >= self.config.quorum_silence_ms);
        self.last_tick = Some(now);
        if stood_still && self.majority_since.take().is_some() {
            self.broke = true;
        }
        if self.config.cluster_size.is_none() {
            let stood = now.saturating_sub(self.view_since) >= self.config.shrink_after_ms;
            self.basis = match self.basis {
                // Seeded and alone so far: another member, or a view that stood.
                None if self.view >= 2 || stood => Some(self.view),
                None => None,
                Some(b) if self.view > b => Some(self.view),
                // The smaller view must itself be a majority of the larger: heartbeats
                // run ahead of the view, so a cut-off node hears the majority again at
                // the heal while its view still holds itself alone, and counted of
                // that view it was a majority of one.
                Some(b)
                    if self.view < b
                        && self.view * 2 > b
                        && stood
                        && self.majority_until(b).is_some_and(|until| now < until) =>
                {
                    Some(self.view)
                }
                kept => kept,
            };
        }
        let held = self
            .basis
            .and_then(|b| self.majority_until(b))
            .is_some_and(|until| now < until);
        self.majority_since = match (held, self.majority_since) {
            (true, Some(since)) => Some(since),
            (true, None) => Some(now),
            (false, Some(_)) => {
                self.broke = true;
                None
            }
            (false, None) => None,
        };
    }

    /// One tick of the membership driver after this tick's heartbeat readings: the view
    /// it published ([`Quorum::view`]), the basis and the majority's start
    /// ([`Quorum::tick`]), and the fence as of `now` ([`Quorum::fence`]).
    pub fn observe(&mut self, view: &crate::membership::ClusterView, now: u64) -> Fence {
        self.view(
            view.ring.len(),
            view.members
                .iter()
                .filter(|m| m.leaving)
                .map(|m| m.node_id.as_str()),
            now,
        );
        self.tick(now);
        self.fence(view.members.iter().map(|m| m.node_id.as_str()), now)
    }

    /// What this node may decide, as of `now`, for a view of `members` (node ids).
    pub fn fence<'a>(&mut self, members: impl IntoIterator<Item = &'a str>, now: u64) -> Fence {
        let lease = match (self.basis, self.majority_since) {
            (Some(basis), Some(since)) => self.majority_until(basis).map(|until| {
                // A cluster of one has nobody to wait for after a break.
                let hold = match (basis, self.broke) {
                    (0..=1, _) => 0,
                    (_, false) => self.config.join_hold_ms,
                    (_, true) => self.config.rejoin_hold_ms,
                };
                let from = since.saturating_add(hold);
                (from, until)
            }),
            _ => None,
        };
        let mut owners: Vec<&str> = members.into_iter().collect();
        owners.push(&self.me);
        for (id, at) in self.heard() {
            if now.saturating_sub(at) < self.config.takeover_silence_ms {
                owners.push(id);
            }
        }
        owners.sort_unstable();
        owners.dedup();
        let ring = match &self.owners {
            Some((ids, ring)) if ids.iter().map(String::as_str).eq(owners.iter().copied()) => {
                ring.clone()
            }
            _ => {
                let ring = Arc::new(Ring::new(owners.iter().copied(), Ring::DEFAULT_VNODES));
                let ids = owners.iter().map(|id| id.to_string()).collect();
                self.owners = Some((ids, ring.clone()));
                ring
            }
        };
        Fence {
            lease,
            owners: Some(ring),
            me: self.me.clone(),
            basis: self.basis,
        }
    }
}

/// Why this node may not decide a fenced key now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fenced {
    /// It has not heard a majority lately (or not for long enough since it last had
    /// none, or it does not know the cluster's size yet).
    NoMajority,
    /// Another member owns the key and was heard lately (or is still in the view).
    OwnerAlive(String),
}

impl Fenced {
    /// The label metrics and logs use.
    pub fn reason(&self) -> &'static str {
        match self {
            Fenced::NoMajority => "no_majority",
            Fenced::OwnerAlive(_) => "owner_alive",
        }
    }
}

impl std::fmt::Display for Fenced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fenced::NoMajority => f.write_str("this node does not see a majority of the cluster"),
            Fenced::OwnerAlive(owner) => write!(f, "the key's owner {owner} was heard lately"),
        }
    }
}

/// A snapshot of [`Quorum`]: published by membership every tick, read by each check
/// of a fenced rule.
#[derive(Debug, Clone)]
pub struct Fence {
    /// `[from, until)` on this node's monotonic clock: when it holds a majority lease.
    lease: Option<(u64, u64)>,
    /// The ring over the view's members, the members heard within T and this node;
    /// `None`: no owner check (an unfenced snapshot).
    owners: Option<Arc<Ring>>,
    me: String,
    /// The size majorities are counted of, when known (for status pages and logs).
    pub basis: Option<usize>,
}

impl Fence {
    /// A snapshot that lets every key be decided: for a node before membership
    /// publishes one, and tests and simulations that do not model fencing.
    pub fn open(me: &str) -> Fence {
        Fence {
            lease: Some((0, u64::MAX)),
            owners: None,
            me: me.to_string(),
            basis: None,
        }
    }

    /// A snapshot that lets nothing fenced be decided: a node whose membership has not
    /// measured anything yet.
    pub fn closed(me: &str) -> Fence {
        Fence {
            lease: None,
            owners: None,
            me: me.to_string(),
            basis: None,
        }
    }

    /// Whether this node may decide the fenced key at ring position `placement` at
    /// monotonic `now`.
    pub fn check(&self, placement: u64, now: u64) -> Result<(), Fenced> {
        match self.lease {
            Some((from, until)) if from <= now && now < until => {}
            _ => return Err(Fenced::NoMajority),
        }
        match self
            .owners
            .as_ref()
            .and_then(|r| r.owner_of_hash(placement))
        {
            Some(owner) if owner != self.me => Err(Fenced::OwnerAlive(owner.to_string())),
            _ => Ok(()),
        }
    }

    /// Whether this node holds a majority lease at `now`.
    pub fn holds_majority(&self, now: u64) -> bool {
        self.lease
            .is_some_and(|(from, until)| from <= now && now < until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(size: Option<usize>) -> FenceConfig {
        FenceConfig::new(size.and_then(NonZeroUsize::new), true)
    }

    /// A tracker on "a" that has heard `others` advance at `at` (after a first sighting
    /// at `at - 100`), with a view of all of them, ticked at `at`.
    fn heard_all(size: Option<usize>, others: &[&str], at: u64) -> Quorum {
        let mut q = Quorum::new(config(size), "a", 0);
        q.heartbeats(others.iter().map(|o| (*o, 1, 1)), at - 100);
        q.heartbeats(others.iter().map(|o| (*o, 1, 2)), at);
        q.view(others.len() + 1, [], at);
        q.tick(at);
        q
    }

    fn members<'a>(ids: &'a [&'a str]) -> impl Iterator<Item = &'a str> + 'a {
        ids.iter().copied()
    }

    /// A placement that `owner` holds on a ring of `ids`.
    fn key_of(ids: &[&str], owner: &str) -> u64 {
        let ring = Ring::new(ids.iter().copied(), Ring::DEFAULT_VNODES);
        (0u64..)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .find(|h| ring.owner_of_hash(*h) == Some(owner))
            .unwrap()
    }

    #[test]
    fn a_first_sighting_is_not_hearing_and_an_advance_is() {
        let mut q = Quorum::new(config(Some(3)), "a", 0);
        q.heartbeats([("b", 1, 7), ("c", 1, 7)], 1_000);
        q.tick(1_000);
        let fence = q.fence(members(&["a", "b", "c"]), 1_000);
        assert_eq!(fence.check(0, 1_000), Err(Fenced::NoMajority));
        q.heartbeats([("b", 1, 8), ("c", 1, 7)], 1_100);
        q.tick(1_100);
        assert_eq!(q.majority_since, Some(1_100), "b advanced: a majority of 3");
    }

    #[test]
    fn the_lease_lasts_quorum_silence_after_the_majoritys_last_heartbeat_and_starts_after_the_hold()
    {
        let mut q = heard_all(Some(3), &["b", "c"], 1_000);
        let fence = q.fence(members(&["a", "b", "c"]), 1_000);
        // Held since 1,000: decided from 1,000 + the join hold, until 1,000 + F.
        assert!(!fence.holds_majority(1_000), "the join hold comes first");
        let mut q = {
            let mut q = q;
            for t in (1_100..=2_600).step_by(100) {
                q.heartbeats([("b", 1, t), ("c", 1, t)], t);
                q.tick(t);
            }
            q
        };
        let fence = q.fence(members(&["a", "b", "c"]), 2_600);
        assert!(fence.holds_majority(2_600));
        assert!(fence.holds_majority(2_600 + DEFAULT_QUORUM_SILENCE_MS - 1));
        assert!(!fence.holds_majority(2_600 + DEFAULT_QUORUM_SILENCE_MS));
    }

    #[test]
    fn one_other_of_three_is_a_majority_and_none_is_not() {
        let mut q = Quorum::new(config(Some(3)), "a", 0);
        for t in (100..=2_000).step_by(100) {
            q.heartbeats([("b", 1, t), ("c", 1, 0)], t);
            q.tick(t);
        }
        assert!(q
            .fence(members(&["a", "b", "c"]), 2_000)
            .holds_majority(2_000));
        // b goes silent too: a is alone, its lease ends F after b's last heartbeat.
        for t in (2_100..=3_000).step_by(100) {
            q.heartbeats([("b", 1, 2_000), ("c", 1, 0)], t);
            q.tick(t);
        }
        let fence = q.fence(members(&["a"]), 3_000);
        assert_eq!(fence.check(0, 3_000), Err(Fenced::NoMajority));
    }

    #[test]
    fn five_members_need_two_others() {
        let mut q = Quorum::new(config(Some(5)), "a", 0);
        for t in (100..=2_000).step_by(100) {
            q.heartbeats([("b", 1, t), ("c", 1, 0), ("d", 1, 0), ("e", 1, 0)], t);
            q.tick(t);
        }
        assert!(!q.fence(members(&["a"]), 2_000).holds_majority(2_000));
        for t in (2_100..=4_000).step_by(100) {
            q.heartbeats([("b", 1, t), ("c", 1, t), ("d", 1, 0), ("e", 1, 0)], t);
            q.tick(t);
        }
        assert!(q.fence(members(&["a"]), 4_000).holds_majority(4_000));
    }

    #[test]
    fn a_minority_never_shrinks_its_basis_and_a_majority_does_after_the_view_stood() {
        let ids = ["a", "b", "c"];
        // The minority: a alone for a long time.
        let mut q = heard_all(None, &["b", "c"], 1_000);
        assert_eq!(q.basis, Some(3));
        q.view(1, [], 1_100);
        for t in (1_100..=20_000).step_by(100) {
            q.heartbeats([("b", 1, 2), ("c", 1, 2)], t);
            q.tick(t);
        }
        assert_eq!(q.basis, Some(3), "never a majority of itself");
        assert!(!q.fence(members(&["a"]), 20_000).holds_majority(20_000));

        // The majority: c is gone, a still hears b.
        let mut q = heard_all(None, &["b", "c"], 1_000);
        q.view(2, [], 1_100);
        for t in (1_100..=7_000).step_by(100) {
            q.heartbeats([("b", 1, t), ("c", 1, 2)], t);
            q.tick(t);
        }
        assert_eq!(q.basis, Some(2), "shrunk once the view of two stood 5 s");
        let fence = q.fence(members(&ids[..2]), 7_000);
        assert!(fence.holds_majority(7_000));
    }

    #[test]
    fn a_graceful_leave_lowers_the_basis_at_once_and_a_crash_does_not() {
        let mut q = heard_all(None, &["b", "c", "d"], 1_000);
        assert_eq!(q.basis, Some(4));
        q.view(3, ["d"], 1_100);
        q.tick(1_100);
        assert_eq!(q.basis, Some(3), "d announced its leave");
        q.view(3, ["d"], 1_200);
        assert_eq!(q.basis, Some(3), "each leaver counts once");
        // Then c crashes: a and b are a majority of 3 without it.
        q.view(2, [], 1_300);
        for t in (1_300..=2_000).step_by(100) {
            q.heartbeats([("b", 1, t), ("c", 1, 2), ("d", 1, 2)], t);
            q.tick(t);
        }
        assert_eq!(q.basis, Some(3), "a crash waits for the shrink rule");
        assert!(q.fence(members(&["a", "b"]), 2_000).holds_majority(2_000));
    }

    #[test]
    fn a_configured_size_never_changes_and_a_view_above_it_does_not_grow_it() {
        let mut q = heard_all(Some(3), &["b", "c", "d", "e"], 1_000);
        q.tick(10_000);
        assert_eq!(q.basis, Some(3));
    }

    #[test]
    fn a_seeded_node_waits_for_another_member_and_a_founder_decides_alone() {
        let mut seeded = Quorum::new(config(None), "a", 0);
        seeded.tick(100);
        assert!(!seeded.fence(members(&["a"]), 100).holds_majority(100));
        seeded.tick(DEFAULT_SHRINK_AFTER_MS);
        assert_eq!(seeded.basis, Some(1), "alone, and the view stood");

        let mut founder = Quorum::new(FenceConfig::new(None, false), "a", 0);
        founder.tick(0);
        let fence = founder.fence(members(&["a"]), 0);
        assert_eq!(
            fence.check(42, 0),
            Ok(()),
            "a cluster of one decides at once"
        );
    }

    #[test]
    fn a_successor_takes_a_key_over_only_once_its_owner_is_out_of_the_view_and_silent() {
        let ids = ["a", "b", "c"];
        let bs_key = key_of(&ids, "b");
        let mut q = Quorum::new(config(Some(3)), "a", 0);
        for t in (100..=2_000).step_by(100) {
            q.heartbeats([("b", 1, t), ("c", 1, t)], t);
            q.tick(t);
        }
        // b is silent from 2,000 on; still in the view until 3,100.
        let mut last = None;
        for t in (2_100..=4_000).step_by(100) {
            q.heartbeats([("b", 1, 2_000), ("c", 1, t)], t);
            q.tick(t);
            let view: &[&str] = if t < 3_100 { &ids } else { &["a", "c"] };
            let fence = q.fence(members(view), t);
            let verdict = fence.check(bs_key, t);
            if t < 2_000 + DEFAULT_TAKEOVER_SILENCE_MS {
                assert_eq!(verdict, Err(Fenced::OwnerAlive("b".into())), "at {t}");
            }
            last = Some(verdict);
        }
        // Out of the view and silent for T: whoever owns it on {a, c} decides.
        let owner = Ring::new(["a", "c"], Ring::DEFAULT_VNODES)
            .owner_of_hash(bs_key)
            .unwrap()
            .to_string();
        let expected = if owner == "a" {
            Ok(())
        } else {
            Err(Fenced::OwnerAlive(owner))
        };
        assert_eq!(last.unwrap(), expected);
    }

    #[test]
    fn a_silent_member_still_in_the_view_keeps_its_keys() {
        let ids = ["a", "b", "c"];
        let bs_key = key_of(&ids, "b");
        let mut q = Quorum::new(config(Some(3)), "a", 0);
        for t in (100..=2_000).step_by(100) {
            q.heartbeats([("b", 1, 0), ("c", 1, t)], t);
            q.tick(t);
        }
        let fence = q.fence(members(&ids), 2_000);
        assert!(fence.holds_majority(2_000));
        assert_eq!(
            fence.check(bs_key, 2_000),
            Err(Fenced::OwnerAlive("b".into()))
        );
    }

    #[test]
    fn after_a_break_the_majority_must_be_held_for_the_hold_again() {
        let mut q = Quorum::new(config(Some(3)), "a", 0);
        for t in (100..=2_000).step_by(100) {
            q.heartbeats([("b", 1, t), ("c", 1, t)], t);
            q.tick(t);
        }
        // Cut off 2,000..4,000, then healed.
        for t in (2_100..=4_000).step_by(100) {
            q.heartbeats([("b", 1, 2_000), ("c", 1, 2_000)], t);
            q.tick(t);
        }
        for t in (4_100..=7_000).step_by(100) {
            q.heartbeats([("b", 1, t), ("c", 1, t)], t);
            q.tick(t);
            let fence = q.fence(members(&["a", "b", "c"]), t);
            assert_eq!(
                fence.holds_majority(t),
                t >= 4_100 + DEFAULT_TAKEOVER_SILENCE_MS,
                "at {t}"
            );
        }
    }

    #[test]
    fn a_process_that_stood_still_holds_the_majority_for_the_hold_again_before_it_decides() {
        let mut q = Quorum::new(config(Some(3)), "a", 0);
        for t in (100..=2_000).step_by(100) {
            q.heartbeats([("b", 1, t), ("c", 1, t)], t);
            q.tick(t);
        }
        assert!(q
            .fence(members(&["a", "b", "c"]), 2_000)
            .holds_majority(2_000));
        // Frozen 2,000..5,000: nothing ran; on waking up every heartbeat has advanced.
        for t in (5_000..=7_000).step_by(100) {
            q.heartbeats([("b", 1, t), ("c", 1, t)], t);
            q.tick(t);
            let fence = q.fence(members(&["a", "b", "c"]), t);
            assert_eq!(
                fence.holds_majority(t),
                t >= 5_000 + DEFAULT_TAKEOVER_SILENCE_MS,
                "at {t}"
            );
        }
    }

    #[test]
    fn a_node_cut_off_alone_does_not_shrink_to_itself_when_it_hears_the_others_at_the_heal() {
        let others = ["b", "c", "d", "e", "f"];
        let mut q = Quorum::new(config(None), "a", 0);
        for t in (100..=2_000).step_by(100) {
            q.heartbeats(others.iter().map(|o| (*o, 1, t)), t);
            q.view(6, [], t);
            q.tick(t);
        }
        assert_eq!(q.basis, Some(6));
        // Cut off at 2,000: its view drops everyone and stands alone for 6 s.
        for t in (2_100..=8_000).step_by(100) {
            q.heartbeats(others.iter().map(|o| (*o, 1, 2_000)), t);
            q.view(1, [], t);
            q.tick(t);
        }
        // Healed: the heartbeats come back before the view does.
        q.heartbeats(others.iter().map(|o| (*o, 1, 8_100)), 8_100);
        q.tick(8_100);
        assert_eq!(q.basis, Some(6), "a view of one is no majority of six");
        assert!(!q.fence(members(&["a"]), 8_100).holds_majority(8_100));
    }

    #[test]
    fn a_restarted_member_counts_once_by_its_id() {
        let mut q = Quorum::new(config(Some(5)), "a", 0);
        for t in (100..=3_000).step_by(100) {
            q.heartbeats([("b", 1, t), ("b", 2, t)], t);
            q.tick(t);
        }
        assert!(!q.fence(members(&["a", "b"]), 3_000).holds_majority(3_000));
    }

    #[test]
    fn an_open_fence_allows_everything_and_a_closed_one_nothing() {
        assert_eq!(Fence::open("a").check(7, 7), Ok(()));
        assert_eq!(Fence::closed("a").check(7, 7), Err(Fenced::NoMajority));
    }
}
