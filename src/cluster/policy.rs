//! Routing policy, as pure functions of (items, cluster view, deny cache, now).
//!
//! The router runs them around its async step: [`plan`] partitions a batch into
//! descriptors decided here, answered from the deny cache, and sent to their owner;
//! after the forwards, [`on_unreachable`] says what a descriptor whose owner did not
//! answer gets (fail-open on a stand-in rule with the limit divided by the ring size, or
//! a fail-closed denial); [`mark_refunds`] and [`refunds`] say which admissions to give
//! back, and where, when a sibling descriptor denied.
//!
//! Routing rule: the ring in this node's current view names the owner of a client key.
//! A descriptor that arrived from a peer ([`Origin::Peer`]) is decided here whatever the
//! ring says: at most one hop, never a loop, even while two nodes' rings disagree.

use crate::algorithms::{Decision, Millis};
use crate::cluster::deny_cache::{Denial, DenyCache};
use crate::cluster::{Answer, Charged, CheckItem, Decided, Decider, DescriptorOutcome, Remote};
use crate::config::rules::{FailMode, Rule};
use crate::membership::{ClusterView, Fence, Fenced, Member};
use crate::shard::Refund;

/// How long a denial is answered for a fail-closed rule whose owner is unreachable.
pub const CLOSED_RETRY_MS: u64 = 1_000;

/// Where a batch of descriptors came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// A client of this node: each descriptor goes to its owner.
    Client,
    /// A peer forwarded them: decided here, never forwarded again.
    Peer,
}

/// Where one descriptor is decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place<'v> {
    /// On this node's shards.
    Here,
    /// On its owner, one hop away (borrowed from the view: nothing is copied per
    /// descriptor).
    Owner(&'v Member),
}

/// Positions of a batch; inline for a unary check's few descriptors, so planning one
/// allocates nothing.
pub type Positions = smallvec::SmallVec<[usize; 4]>;

/// The routing plan of a batch: every descriptor is in exactly one of the three.
#[derive(Debug)]
pub struct Plan<'v> {
    /// Answers already known (deny-cache hits), by position.
    pub answers: smallvec::SmallVec<[Option<Answer>; 1]>,
    /// Positions decided on this node's shards.
    pub local: Positions,
    /// Positions sent to their owner, borrowed from the view the plan was made with.
    pub remote: smallvec::SmallVec<[(usize, &'v Member); 2]>,
    /// How many answers came from the deny cache.
    pub cached: usize,
}

/// The routing choices of a node, fixed at start.
#[derive(Debug, Clone, Copy, Default)]
pub struct Routing {
    /// NEGATIVE CONTROL ONLY: decide everything here, ignoring the ring.
    pub broken_decide_locally: bool,
}

/// Where the descriptor at ring position `placement` is decided.
pub fn place<'v>(
    view: &'v ClusterView,
    me: &str,
    placement: u64,
    origin: Origin,
    routing: Routing,
) -> Place<'v> {
    if origin == Origin::Peer || routing.broken_decide_locally {
        return Place::Here;
    }
    match view.owner_of_placement(placement) {
        Some(owner) if owner.node_id != me => Place::Owner(owner),
        // This node owns the key, or the ring is empty (every member leaving):
        // deciding here beats refusing.
        _ => Place::Here,
    }
}

/// This node's two clock readings for one decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Wall-clock Unix ms: what answers carry.
    pub wall: Millis,
    /// Monotonic ms ([`crate::clock::Clock::monotonic_ms`]): what the deny cache's waits
    /// are measured on, so a wall-clock step on this node cannot stretch a denial.
    pub mono: Millis,
}

impl Now {
    /// Both readings of `clock`.
    pub fn of(clock: &dyn crate::clock::Clock) -> Now {
        Now {
            wall: clock.now_ms(),
            mono: clock.monotonic_ms(),
        }
    }
}

/// Partition `items`: decided here, answered from `deny` (remote keys only: a local
/// key is decided by its own shard at the same cost), or sent to the owner.
pub fn plan<'v>(
    items: &[&CheckItem],
    view: &'v ClusterView,
    me: &str,
    deny: &DenyCache,
    now: Now,
    origin: Origin,
    routing: Routing,
) -> Plan<'v> {
    let mut plan = Plan {
        answers: smallvec::smallvec![None; items.len()],
        local: Positions::new(),
        remote: smallvec::SmallVec::new(),
        cached: 0,
    };
    for (i, item) in items.iter().enumerate() {
        match place(view, me, item.id.placement, origin, routing) {
            Place::Here => plan.local.push(i),
            Place::Owner(owner) => match cached(item, deny, now) {
                Some(answer) => {
                    plan.answers[i] = Some(answer);
                    plan.cached += 1;
                }
                None => plan.remote.push((i, owner)),
            },
        }
    }
    plan
}

/// A deny-cache answer for `item` at `now`, if one applies (never for an
/// [`uncached`](CheckItem::uncached) item).
pub fn cached(item: &CheckItem, deny: &DenyCache, now: Now) -> Option<Answer> {
    if item.uncached {
        return None;
    }
    let (decision, decider) =
        deny.get(&item.id, now.mono, item.cost.get(), item.rule.fingerprint)?;
    Some(Answer {
        decision,
        sequence: 0,
        at: now.wall,
        decider,
        degraded: true,
        hops: 0,
        rule: item.rule.name.clone(),
        algorithm: item.rule.limiter.kind(),
        charged: Charged::Nothing,
    })
}

/// The answer of this node's shard for `item`, charged on `charge`'s counter.
pub fn local_answer(
    item: &CheckItem,
    me: &Decider,
    decision: Decision,
    sequence: u64,
    at: Millis,
    charge: crate::shard::Charge,
) -> Answer {
    Answer {
        decision,
        sequence,
        at,
        decider: me.clone(),
        degraded: charge.target.is_replica(),
        hops: 0,
        rule: item.rule.name.clone(),
        algorithm: item.rule.limiter.kind(),
        charged: if decision.allowed {
            Charged::Here(charge)
        } else {
            Charged::Nothing
        },
    }
}

/// The answer an owner gave for `item`. An algorithm name this node does not know
/// is reported as the one its own rule names (the rule sets differ for a moment).
pub fn remote_answer(item: &CheckItem, remote: Remote, owner: &Member) -> Answer {
    // An owner's denial without a sequence number decided nothing: a fenced rule's key
    // the owner may not decide now ([`closed_denial`]). The caller sees it degraded.
    let undecided = !remote.decision.allowed && remote.sequence == 0;
    Answer {
        decision: remote.decision,
        sequence: remote.sequence,
        at: remote.at,
        decider: remote.decider,
        degraded: undecided,
        hops: 1,
        rule: remote.rule,
        algorithm: remote.algorithm.unwrap_or_else(|| item.rule.limiter.kind()),
        charged: if remote.decision.allowed {
            Charged::Owner(owner.clone())
        } else {
            Charged::Nothing
        },
    }
}

/// The denial to cache after an owner denied `item` at this node's monotonic `now`;
/// `None` when the wait is zero or unbounded (nothing useful to cache), or the denial
/// decided nothing.
pub fn denial(item: &CheckItem, answer: &Answer, now: Millis) -> Option<Denial> {
    let retry = answer.decision.retry_after_ms;
    // A degraded denial (an owner fenced off its key for now) says nothing about the
    // key's count: the next check asks again.
    if answer.decision.allowed || answer.degraded || retry == 0 || retry == u64::MAX {
        return None;
    }
    Some(Denial {
        // Measured from this node's clock when the check was sent: the owner decided
        // no earlier, so the wait can only be longer, never shorter.
        until: now.saturating_add(retry),
        cost: item.cost.get(),
        fingerprint: item.rule.fingerprint,
        decision: answer.decision,
        decider: answer.decider.clone(),
    })
}

/// What a descriptor whose owner did not answer gets.
#[derive(Debug)]
pub enum Fallback {
    /// A fail-closed rule: denied, for [`CLOSED_RETRY_MS`].
    Closed(Box<Answer>),
    /// A fail-open rule: decided here on [`fallback_rule`] for a ring of `nodes`.
    Open {
        /// Members on the ring (at least 1).
        nodes: u64,
    },
}

/// The fail-open stand-in for `rule` on a ring of `nodes`: the limit divided by the
/// node count, with counters of its own that never travel.
pub fn fallback_rule(rule: &Rule, nodes: u64) -> Rule {
    rule.fallback(nodes.max(1))
}

/// Whether `answer` is a fail-closed denial made by `me` because the key's owner could
/// not be reached (and not a denial of the owner's, nor one from the deny cache, which
/// always names the owner that denied). A front end that must tell "unreachable" apart
/// (Envoy's `failure_mode_deny` wants `UNAVAILABLE`) asks this.
pub fn is_fail_closed(answer: &Answer, me: &Decider) -> bool {
    answer.degraded
        && !answer.decision.allowed
        && answer.sequence == 0
        && matches!(answer.charged, Charged::Nothing)
        && answer.decider == *me
}

/// The fallback for `item` when its owner is unreachable, on a ring of `nodes`. A
/// fenced rule never fails open: a share decided here would be a decider of its own.
pub fn on_unreachable(item: &CheckItem, me: &Decider, nodes: usize, now: Millis) -> Fallback {
    match item.rule.on_unavailable {
        _ if item.rule.is_fenced() => Fallback::Closed(Box::new(closed_denial(item, me, now))),
        FailMode::Closed => Fallback::Closed(Box::new(closed_denial(item, me, now))),
        FailMode::Open => Fallback::Open {
            nodes: nodes.max(1) as u64,
        },
    }
}

/// A denial made by `me` without deciding (nothing charged, degraded, retry after
/// [`CLOSED_RETRY_MS`]): a fail-closed rule whose owner is unreachable, or a fenced
/// rule's key this node may not decide now. [`is_fail_closed`] tells it apart.
pub fn closed_denial(item: &CheckItem, me: &Decider, now: Millis) -> Answer {
    Answer {
        decision: Decision {
            allowed: false,
            limit: item.rule.limiter.max_cost(),
            remaining: 0,
            retry_after_ms: CLOSED_RETRY_MS,
            reset_at_ms: now + CLOSED_RETRY_MS,
            window_id: None,
            delay_ms: 0,
        },
        sequence: 0,
        at: now,
        decider: me.clone(),
        degraded: true,
        hops: 0,
        rule: item.rule.name.clone(),
        algorithm: item.rule.limiter.kind(),
        charged: Charged::Nothing,
    }
}

/// Whether this node may decide `item` now (`now.mono` against `fence`): `Err` with
/// why not for a fenced rule's key this node does not hold a majority lease for, or
/// whose owner among the live is another member (docs/ownership.md, "Fencing").
/// Rules that split in partitions are always decided.
pub fn fence_check(item: &CheckItem, fence: &Fence, now: Now) -> Result<(), Fenced> {
    if !item.rule.is_fenced() || item.rule.is_node_local() {
        return Ok(());
    }
    fence.check(item.id.placement, now.mono)
}

/// A batch decided here, split by the fence: the positions of `local` this node may
/// decide at `now`, and a fenced denial (degraded, nothing charged) for each of the
/// rest, by position in `items`. Fenced denials never reach the shards.
pub fn fence_split(
    items: &[&CheckItem],
    local: &[usize],
    me: &Decider,
    fence: &Fence,
    now: Now,
) -> (Positions, Vec<(usize, Answer)>) {
    let mut decide = Positions::new();
    let mut denied = Vec::new();
    for &i in local {
        match fence_check(items[i], fence, now) {
            Ok(()) => decide.push(i),
            Err(_) => denied.push((i, closed_denial(items[i], me, now.wall))),
        }
    }
    (decide, denied)
}

/// What [`recheck_fenced`] took back.
#[derive(Debug, Default)]
pub struct Retracted {
    /// The charges to give back on this node's shards.
    pub refunds: Vec<Refund>,
    /// How many admissions became fenced denials.
    pub denied: usize,
}

/// Answers decided here on a fenced rule's key whose lease ran out (or whose owner
/// came back) while the shard decided them, read against the fence at `now`, after
/// the decision: a stall between the check and the decision must not make this node a
/// second decider. Each such admission becomes a fenced denial, and what it charged
/// here is to be given back.
pub fn recheck_fenced<'a>(
    items: impl IntoIterator<Item = &'a CheckItem>,
    answers: &mut [Answer],
    me: &Decider,
    fence: &Fence,
    now: Now,
) -> Retracted {
    let mut out = Retracted::default();
    for (item, answer) in items.into_iter().zip(answers.iter_mut()) {
        if !answer.decision.allowed || fence_check(item, fence, now).is_ok() {
            continue;
        }
        if let Charged::Here(charge) = &answer.charged {
            out.refunds.push(Refund {
                charge: charge.clone(),
                at: answer.at,
            });
        }
        tracing::debug!(key = %item.client(), rule = %item.rule.name, "fence lost while deciding: given back");
        *answer = closed_denial(item, me, now.wall);
        out.denied += 1;
    }
    out
}

/// Mark the descriptors of one check to give back: admitted while another denied.
/// Only what was charged somewhere is given back (not cached or fail-closed answers).
/// A shadow rule's denial denies nothing, so it refunds nothing. A probe is always
/// given back.
pub fn mark_refunds(descriptors: &mut [DescriptorOutcome]) {
    let any_denied = descriptors.iter().any(|d| !d.enforced_allowed());
    for d in descriptors {
        // A probe (report, do not count) gives its unit back whatever the others say.
        // A lease's unit is not given back: only one-descriptor, non-probe checks are
        // decided from leases, so none of them is ever refunded.
        d.refunded = (any_denied || d.item.probe)
            && d.answer.decision.allowed
            && !matches!(d.answer.charged, Charged::Nothing | Charged::Lease);
    }
}

/// Admissions to give back, grouped by where they were charged.
#[derive(Debug, Default)]
pub struct Refunds {
    /// On this node's shards.
    pub here: Vec<Refund>,
    /// On owners one hop away, one list per owner: (descriptor, owner's `at`).
    pub remote: Vec<(Member, Vec<(CheckItem, Millis)>)>,
}

/// Every refund the flags in `decided` ask for.
pub fn refunds(decided: &[Decided]) -> Refunds {
    let mut out = Refunds::default();
    for check in decided {
        for DescriptorOutcome {
            item,
            answer,
            refunded,
        } in &check.descriptors
        {
            if !refunded {
                continue;
            }
            match &answer.charged {
                Charged::Nothing | Charged::Lease => {}
                Charged::Here(charge) => out.here.push(Refund {
                    charge: charge.clone(),
                    at: answer.at,
                }),
                Charged::Owner(owner) => {
                    let refund = (item.clone(), answer.at);
                    match out
                        .remote
                        .iter_mut()
                        .find(|(m, _)| m.node_id == owner.node_id)
                    {
                        Some((_, items)) => items.push(refund),
                        None => out.remote.push((owner.clone(), vec![refund])),
                    }
                }
            }
        }
    }
    out
}

/// Split the flat answers of a batch back into its checks, with refund flags.
pub fn combine(
    checks: super::Checks,
    answers: impl IntoIterator<Item = Answer>,
) -> super::DecidedChecks {
    let mut answers = answers.into_iter();
    checks
        .into_iter()
        .map(|items| {
            let mut descriptors: super::DescriptorOutcomes = items
                .into_iter()
                .map(|item| DescriptorOutcome {
                    item,
                    answer: answers.next().expect("one answer per descriptor"),
                    refunded: false,
                })
                .collect();
            mark_refunds(&mut descriptors);
            Decided { descriptors }
        })
        .collect()
}

/// How many of `items` this node's ring gives to another member (a peer with another
/// view forwarded them here; they are decided here anyway).
pub fn strays(items: &[CheckItem], view: &ClusterView, me: &str) -> usize {
    items
        .iter()
        .filter(|i| {
            view.owner_of_placement(i.id.placement)
                .is_some_and(|o| o.node_id != me)
        })
        .count()
}

/// A forwarded batch that arrives after its deadline (`0`: none) is refused: the
/// sender gave up and answered from its fallback, so charging it now (after a pause or
/// a healed partition) would only deny later requests for admissions nobody made.
pub fn arrived_too_late(deadline_ms: Millis, now: Millis) -> bool {
    deadline_ms != 0 && now > deadline_ms
}

/// Shared by the tests of the cluster wing.
#[cfg(test)]
pub(crate) mod testkit {
    use super::*;
    use crate::config::rules::RuleSet;
    use std::net::SocketAddr;
    use std::num::NonZeroU64;
    use std::sync::Arc;

    pub const RULES: &str = r#"
[default]
limit = 100
window = "1m"

[[rule]]
name = "closed"
route = "GET /closed"
algorithm = "sliding_window_log"
limit = 5
window = "1h"
on_unavailable = "closed"
"#;

    pub fn rules() -> RuleSet {
        RuleSet::from_toml_str(RULES).unwrap()
    }

    pub fn member(id: &str, port: u16) -> Member {
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        Member {
            node_id: id.into(),
            generation: 1,
            grpc_addr: addr,
            peer_addr: addr,
            gossip_addr: addr,
            leaving: false,
        }
    }

    pub fn view(ids: &[&str]) -> ClusterView {
        ClusterView::from_members(
            ids.iter()
                .enumerate()
                .map(|(i, id)| member(id, 7000 + i as u16))
                .collect(),
        )
    }

    pub fn decider(id: &str) -> Decider {
        Decider {
            node_id: Arc::from(id),
            generation: 1,
        }
    }

    /// An item for `client` on `route` under the rule `rules` matches.
    pub fn item(client: &str, route: &str, cost: u64) -> CheckItem {
        let rules = rules();
        let parsed = crate::config::route::Route::parse(route).unwrap();
        let rule = rules.matching(client, None, Some(&parsed)).clone();
        CheckItem::new(rule, client, parsed, None, NonZeroU64::new(cost).unwrap())
    }

    /// A client key the ring of `view` gives to `owner`.
    pub fn key_of(view: &ClusterView, owner: &str) -> String {
        (0..)
            .map(|i| format!("k{i}"))
            .find(|k| view.owner(k.as_bytes()).is_some_and(|m| m.node_id == owner))
            .unwrap()
    }

    pub fn decision(allowed: bool, retry: u64) -> Decision {
        Decision {
            allowed,
            limit: 100,
            remaining: if allowed { 10 } else { 0 },
            retry_after_ms: retry,
            reset_at_ms: 60_000,
            window_id: Some(0),
            delay_ms: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testkit::*;
    use super::*;
    use std::sync::Arc;

    fn flags(decided: &Decided) -> Vec<bool> {
        decided.descriptors.iter().map(|d| d.refunded).collect()
    }

    fn plan_of<'v>(
        items: &[CheckItem],
        view: &'v ClusterView,
        deny: &DenyCache,
        origin: Origin,
    ) -> Plan<'v> {
        let refs: Vec<&CheckItem> = items.iter().collect();
        plan(
            &refs,
            view,
            "a",
            deny,
            same(1_000),
            origin,
            Routing::default(),
        )
    }

    /// Both readings at `ms` (as a `ManualClock` gives).
    fn same(ms: Millis) -> Now {
        Now { wall: ms, mono: ms }
    }

    #[test]
    fn an_own_key_is_decided_here_and_another_owners_key_goes_to_it() {
        let view = view(&["a", "b", "c"]);
        let mine = item(&key_of(&view, "a"), "/x", 1);
        let theirs = item(&key_of(&view, "c"), "/x", 1);
        let plan = plan_of(&[mine, theirs], &view, &DenyCache::new(10), Origin::Client);
        assert_eq!(&plan.local[..], [0]);
        assert_eq!(plan.remote.len(), 1);
        assert_eq!(
            (plan.remote[0].0, plan.remote[0].1.node_id.as_str()),
            (1, "c")
        );
        assert_eq!(plan.cached, 0);
    }

    #[test]
    fn forwarded_items_are_never_forwarded_again_whatever_the_ring_says() {
        let view = view(&["a", "b", "c"]);
        let items = [
            item(&key_of(&view, "b"), "/x", 1),
            item(&key_of(&view, "c"), "/x", 1),
        ];
        let plan = plan_of(&items, &view, &DenyCache::new(10), Origin::Peer);
        assert_eq!(&plan.local[..], [0, 1]);
        assert!(plan.remote.is_empty());
        assert_eq!(strays(&items, &view, "a"), 2, "counted as decided off-ring");
    }

    #[test]
    fn an_empty_ring_or_the_negative_control_decides_here() {
        let mut leaving = view(&["a", "b"]);
        leaving = ClusterView::from_members(
            leaving
                .members
                .iter()
                .cloned()
                .map(|mut m| {
                    m.leaving = true;
                    m
                })
                .collect(),
        );
        assert_eq!(
            place(&leaving, "a", 42, Origin::Client, Routing::default()),
            Place::Here
        );
        let view = view(&["a", "b"]);
        let theirs = item(&key_of(&view, "b"), "/x", 1);
        let broken = Routing {
            broken_decide_locally: true,
        };
        assert_eq!(
            place(&view, "a", theirs.id.placement, Origin::Client, broken),
            Place::Here
        );
    }

    #[test]
    fn a_cached_denial_answers_a_remote_key_degraded_without_a_hop_until_it_expires() {
        let view = view(&["a", "b"]);
        let theirs = item(&key_of(&view, "b"), "/x", 1);
        let deny = DenyCache::new(10);
        let owner_answer = remote_answer(
            &theirs,
            Remote {
                decision: decision(false, 5_000),
                sequence: 9,
                at: 1_000,
                decider: decider("b"),
                rule: Arc::from("default"),
                algorithm: None,
            },
            &view.members[1],
        );
        deny.insert(
            theirs.id,
            denial(&theirs, &owner_answer, 1_000).unwrap(),
            1_000,
        );

        let plan = plan_of(std::slice::from_ref(&theirs), &view, &deny, Origin::Client);
        assert_eq!(plan.cached, 1);
        let cached = plan.answers[0].as_ref().unwrap();
        assert!(cached.degraded && !cached.decision.allowed);
        assert_eq!(cached.decision.retry_after_ms, 5_000);
        assert_eq!(&*cached.decider.node_id, "b", "names the owner that denied");
        assert!(matches!(cached.charged, Charged::Nothing));

        // Past T, or for a smaller cost, the owner is asked.
        let refs = [&theirs];
        let later = super::plan(
            &refs,
            &view,
            "a",
            &deny,
            same(6_000),
            Origin::Client,
            Routing::default(),
        );
        assert_eq!(later.remote.len(), 1);
    }

    #[test]
    fn a_cached_denial_lasts_its_wait_on_the_monotonic_clock_whatever_the_wall_clock_does() {
        let view = view(&["a", "b"]);
        let key = key_of(&view, "b");
        let it = item(&key, "/x", 1);
        let answer = Answer {
            decision: decision(false, 500),
            ..local_answer(
                &it,
                &decider("b"),
                decision(false, 500),
                1,
                1_000,
                it.charge(),
            )
        };
        let deny = DenyCache::new(10);
        deny.insert(it.id, denial(&it, &answer, 1_000).unwrap(), 1_000);
        // The wall clock stepped back 3 s; 600 ms really passed: the owner's wait is
        // over, so the owner is asked again.
        let stepped = Now {
            wall: 10_000 - 3_000 + 600,
            mono: 1_600,
        };
        assert!(cached(&it, &deny, stepped).is_none());
        // And a step forward does not cut the wait short.
        deny.insert(it.id, denial(&it, &answer, 2_000).unwrap(), 2_000);
        let ahead = Now {
            wall: 2_000 + 3_000,
            mono: 2_100,
        };
        let again = cached(&it, &deny, ahead).expect("still denied");
        assert_eq!(again.decision.retry_after_ms, 400);
        assert_eq!(again.at, 5_000, "answers carry the wall clock");
    }

    #[test]
    fn a_denial_for_a_larger_cost_does_not_answer_a_smaller_one() {
        let view = view(&["a", "b"]);
        let key = key_of(&view, "b");
        let big = item(&key, "/x", 5);
        let answer = Answer {
            decision: decision(false, 5_000),
            ..local_answer(
                &big,
                &decider("b"),
                decision(false, 5_000),
                1,
                1_000,
                big.charge(),
            )
        };
        let deny = DenyCache::new(10);
        deny.insert(big.id, denial(&big, &answer, 1_000).unwrap(), 1_000);
        assert!(cached(&item(&key, "/x", 9), &deny, same(1_001)).is_some());
        assert!(cached(&item(&key, "/x", 1), &deny, same(1_001)).is_none());
    }

    #[test]
    fn allowed_zero_or_unbounded_waits_are_not_cached() {
        let it = item("k", "/x", 1);
        for (allowed, retry) in [(true, 0), (false, 0), (false, u64::MAX)] {
            let a = local_answer(
                &it,
                &decider("b"),
                decision(allowed, retry),
                1,
                0,
                it.charge(),
            );
            assert!(denial(&it, &a, 0).is_none(), "{allowed} {retry}");
        }
    }

    #[test]
    fn an_unreachable_owner_fails_open_on_a_share_of_the_limit_or_closed_per_rule() {
        let open = item("k", "/x", 1);
        match on_unreachable(&open, &decider("a"), 3, 1_000) {
            Fallback::Open { nodes } => {
                assert_eq!(nodes, 3);
                let rule = fallback_rule(&open.rule, nodes);
                assert_eq!(rule.limiter.max_cost(), 33, "100 divided by 3 nodes");
                assert!(rule.is_node_local(), "its counters never travel");
                let charge = open.under(Arc::new(rule));
                assert_ne!(charge.id, open.id, "a counter of its own");
                assert_eq!(charge.id.placement, open.id.placement);
            }
            other => panic!("expected fail-open, got {other:?}"),
        }
        let closed = item("k", "GET /closed", 1);
        match on_unreachable(&closed, &decider("a"), 3, 1_000) {
            Fallback::Closed(answer) => {
                assert!(!answer.decision.allowed && answer.degraded);
                assert_eq!(answer.decision.retry_after_ms, CLOSED_RETRY_MS);
                assert_eq!(answer.decision.reset_at_ms, 1_000 + CLOSED_RETRY_MS);
                assert!(matches!(answer.charged, Charged::Nothing));
            }
            other => panic!("expected fail-closed, got {other:?}"),
        }
    }

    #[test]
    fn when_one_descriptor_denies_the_charged_ones_are_refunded_where_they_were_charged() {
        let view = view(&["a", "b"]);
        let here = item("h", "/x", 1);
        let there = item("t", "/x", 2);
        let denied = item("d", "/x", 1);
        let cachedd = item("c", "/x", 1);
        let answers = vec![
            local_answer(
                &here,
                &decider("a"),
                decision(true, 0),
                1,
                10,
                here.charge(),
            ),
            Answer {
                charged: Charged::Owner(view.members[1].clone()),
                hops: 1,
                ..local_answer(
                    &there,
                    &decider("b"),
                    decision(true, 0),
                    2,
                    20,
                    there.charge(),
                )
            },
            local_answer(
                &denied,
                &decider("a"),
                decision(false, 100),
                3,
                10,
                denied.charge(),
            ),
            Answer {
                charged: Charged::Nothing,
                degraded: true,
                ..local_answer(
                    &cachedd,
                    &decider("b"),
                    decision(true, 0),
                    0,
                    10,
                    cachedd.charge(),
                )
            },
        ];
        let decided = combine(
            smallvec::smallvec![smallvec::smallvec![here.clone(), there, denied, cachedd]],
            answers,
        );
        assert_eq!(flags(&decided[0]), vec![true, true, false, false]);
        let refunds = refunds(&decided);
        assert_eq!(refunds.here.len(), 1);
        assert_eq!(refunds.here[0].charge.id, here.id);
        assert_eq!(refunds.here[0].at, 10, "quotes the decider's clock");
        assert_eq!(refunds.remote.len(), 1);
        assert_eq!(refunds.remote[0].0.node_id, "b");
        assert_eq!(refunds.remote[0].1[0].1, 20);
    }

    #[test]
    fn nothing_is_refunded_when_every_descriptor_allowed_and_checks_stay_apart() {
        let a = item("a", "/x", 1);
        let b = item("b", "/x", 1);
        let allow =
            |i: &CheckItem| local_answer(i, &decider("a"), decision(true, 0), 1, 0, i.charge());
        let deny =
            |i: &CheckItem| local_answer(i, &decider("a"), decision(false, 9), 1, 0, i.charge());
        // Two checks in one batch: the second's denial does not refund the first.
        let decided = combine(
            smallvec::smallvec![
                smallvec::smallvec![a.clone()],
                smallvec::smallvec![b.clone(), a.clone()]
            ],
            vec![allow(&a), deny(&b), allow(&a)],
        );
        assert_eq!(flags(&decided[0]), vec![false]);
        assert_eq!(flags(&decided[1]), vec![false, true]);
        assert_eq!(refunds(&decided).here.len(), 1);
    }

    #[test]
    fn a_fenced_rules_key_is_denied_without_a_majority_and_other_rules_are_not_fenced() {
        let fenced = item("k", "GET /closed", 1);
        let open = item("k", "/x", 1);
        assert!(
            fenced.rule.is_fenced(),
            "fail-closed rules fence by default"
        );
        assert!(!open.rule.is_fenced());
        let closed = Fence::closed("a");
        assert_eq!(
            fence_check(&fenced, &closed, same(1_000)),
            Err(Fenced::NoMajority)
        );
        assert_eq!(fence_check(&open, &closed, same(1_000)), Ok(()));
        assert_eq!(fence_check(&fenced, &Fence::open("a"), same(1_000)), Ok(()));
        let denial = closed_denial(&fenced, &decider("a"), 1_000);
        assert!(!denial.decision.allowed && denial.degraded);
        assert!(is_fail_closed(&denial, &decider("a")));
    }

    #[test]
    fn an_admission_on_a_fenced_key_the_fence_no_longer_allows_is_denied_and_given_back() {
        let fenced = item("k", "GET /closed", 1);
        let open = item("k", "/x", 1);
        let me = decider("a");
        let answers = || {
            [&fenced, &open, &fenced]
                .map(|it| local_answer(it, &me, decision(true, 0), 7, 1_000, it.charge()))
        };
        let mut kept = answers();
        let held = recheck_fenced(
            [&fenced, &open, &fenced],
            &mut kept,
            &me,
            &Fence::open("a"),
            same(1_000),
        );
        assert_eq!(
            (held.denied, held.refunds.len()),
            (0, 0),
            "the fence still allows"
        );
        assert!(kept.iter().all(|a| a.decision.allowed));
        let mut lost = answers();
        lost[2] = local_answer(&fenced, &me, decision(false, 5), 8, 1_000, fenced.charge());
        let late = recheck_fenced(
            [&fenced, &open, &fenced],
            &mut lost,
            &me,
            &Fence::closed("a"),
            same(1_000),
        );
        assert_eq!(
            late.denied, 1,
            "only the fenced admission; a denial stays as it is"
        );
        assert_eq!(late.refunds.len(), 1);
        assert_eq!(late.refunds[0].charge.id, fenced.id);
        assert!(is_fail_closed(&lost[0], &me), "answered as a fenced denial");
        assert!(
            lost[1].decision.allowed,
            "the unfenced rule's admission stands"
        );
        assert_eq!(lost[2].sequence, 8, "a denial is left alone");
    }

    #[test]
    fn a_batch_splits_on_the_fence_into_decided_and_denied_positions() {
        let fenced = item("k", "GET /closed", 1);
        let open = item("k", "/x", 1);
        let me = decider("a");
        let items = [&open, &fenced, &open];
        let (decide, denied) =
            fence_split(&items, &[0, 1, 2], &me, &Fence::closed("a"), same(1_000));
        assert_eq!(decide.as_slice(), [0, 2]);
        assert_eq!(denied.len(), 1);
        assert_eq!(denied[0].0, 1);
        assert!(is_fail_closed(&denied[0].1, &me));
        let (decide, denied) = fence_split(&items, &[1, 2], &me, &Fence::open("a"), same(1_000));
        assert_eq!((decide.as_slice(), denied.len()), ([1, 2].as_slice(), 0));
    }

    #[test]
    fn a_fenced_rule_never_fails_open_even_if_its_rule_says_open() {
        let mut it = item("k", "/x", 1);
        let rule = (*it.rule)
            .clone()
            .partitioned(crate::config::rules::Partition::Fence);
        it.rule = Arc::new(rule);
        assert!(matches!(
            on_unreachable(&it, &decider("a"), 3, 1_000),
            Fallback::Closed(_)
        ));
    }

    #[test]
    fn a_batch_after_its_deadline_is_refused() {
        assert!(!arrived_too_late(0, u64::MAX), "no deadline");
        assert!(!arrived_too_late(1_000, 1_000));
        assert!(arrived_too_late(1_000, 1_001));
    }
}
