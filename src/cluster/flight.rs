//! A client check's flight, as a state machine with no I/O inside.
//!
//! Between the moment a node plans a client's batch and the moment it answers, each
//! descriptor goes through the same steps: planned (here, the deny cache, or its owner);
//! decided on this node's shards or by its owner; if the owner did not answer, sent to
//! the key's successor (which holds its replica) or given the rule's fallback (a
//! fail-closed denial, or a fail-open stand-in counter decided here). Then the check's
//! answers are combined and the admissions of a denied check are given back.
//!
//! [`Flight`] holds that sequence and every decision in it; its caller only performs
//! what a step asks for (shard calls, forwards) and feeds the results back. The node's
//! [`Router`](crate::cluster::router::Router) drives it with tokio, the shards and the
//! peer pool; the deterministic simulator (`tests/sim`) drives the very same flight with
//! simulated shards and a simulated network, so a bug in these steps is a bug the
//! simulator can see.
//!
//! ```text
//!  Flight::plan ──► local(): decide on shards ─► answer_here()
//!              └─► remote(): forward to owners ─► settle(results) ─► Rescue per failure
//!                    Rescue::ReplicaHere ─► decide on shards ─► replica_decided_here()
//!                    Rescue::Replica     ─► forward (failover) ─► replica_answered()
//!                    Rescue::Fallback / a replica that failed ─► fall_back()
//!                       Fallback::Open ─► decide the stand-in here ─► opened()
//!  land(): policy::combine (refunds marked) ─► policy::refunds
//! ```

use crate::cluster::deny_cache::DenyCache;
use crate::cluster::link::ForwardError;
use std::sync::Arc;

use crate::algorithms::Millis;
use crate::cluster::policy::{self, Fallback, Now, Origin, Positions, Routing};
use crate::cluster::{Answer, CheckItem, Checks, DecidedChecks, Decider, Remote};
use crate::membership::{ClusterView, Fence, Member};
use crate::shard::{Charge, Doubt, Outcome, Target};

/// What a node does with a descriptor whose owner could not be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailOver {
    /// Straight to the rule's fallback (the cluster keeps no replicas).
    #[default]
    Off,
    /// First to the key's ring successor, which decides on its replica (degraded).
    ToSuccessor,
}

/// Why a forwarded descriptor got no answer, as the fail-over step needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The owner refused the call: it is alive, so a second decider would not be
    /// bounded by its count; only the fallback remains.
    Refused,
    /// The call did not get through (refused connection, reset): nothing was charged.
    Unreachable,
    /// The call timed out: the owner may have charged it all the same.
    TimedOut,
}

impl Failure {
    /// The failure a forward error stands for.
    pub fn of(error: &ForwardError) -> Self {
        match (error.owner_unreachable(), error.may_have_charged()) {
            (true, true) => Failure::TimedOut,
            (true, false) => Failure::Unreachable,
            (false, _) => Failure::Refused,
        }
    }
}

/// The next step for a descriptor whose owner did not answer.
#[derive(Debug)]
pub enum Rescue {
    /// This node is the key's successor: decide `item` (marked as a fail-over) on its
    /// replica here, then [`Flight::replica_decided_here`].
    ReplicaHere(CheckItem),
    /// Forward `item` (marked as a fail-over) to the successor (its index in the
    /// flight's view: [`Flight::member`]), then [`Flight::replica_answered`].
    Replica(usize, CheckItem),
    /// No replica to try: [`Flight::fall_back`].
    Fallback,
}

/// What one flight did, for the node's metrics (and the simulator's statistics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Descriptors answered from the deny cache.
    pub cached: u64,
    /// Descriptors sent to their owner.
    pub forwarded: u64,
    /// Forwards that got no answer.
    pub forward_errors: u64,
    /// Descriptors decided on a replica at the key's successor.
    pub failed_over: u64,
    /// Fail-overs whose successor could not answer either.
    pub failover_failed: u64,
    /// Fail-closed denials.
    pub closed: u64,
    /// Fail-open stand-in decisions.
    pub open: u64,
    /// Fenced rules' checks denied because this node may not decide their key now
    /// (no majority lease, or another live owner): [`Flight::fence`], [`Flight::fenced`].
    pub fenced: u64,
}

/// One client batch in flight: its checks, the view it was planned on, the answers so
/// far, and what it did. It owns all of them, so a caller that is not one async
/// function (the simulator's event loop) can keep it between steps.
#[derive(Debug)]
pub struct Flight {
    checks: Checks,
    view: Arc<ClusterView>,
    answers: smallvec::SmallVec<[Option<Answer>; 1]>,
    /// Plan positions decided on this node's shards.
    local: Positions,
    /// Plan positions sent to their owner, with the owner's index in `view.members`.
    remote: smallvec::SmallVec<[(usize, usize); 2]>,
    now: Now,
    failover: FailOver,
    tally: Tally,
}

impl Flight {
    /// Plan `checks` as a client's batch on this node (`me`) at `now`.
    pub fn plan(
        checks: Checks,
        view: Arc<ClusterView>,
        me: &str,
        deny: &DenyCache,
        now: Now,
        routing: Routing,
        failover: FailOver,
    ) -> Self {
        let (answers, local, remote, cached) = {
            let flat: smallvec::SmallVec<[&CheckItem; 4]> = checks.iter().flatten().collect();
            let plan = policy::plan(&flat, &view, me, deny, now, Origin::Client, routing);
            let remote = plan
                .remote
                .iter()
                .map(|&(i, owner)| (i, member_index(&view, owner)))
                .collect();
            (plan.answers, plan.local, remote, plan.cached)
        };
        Self {
            checks,
            view,
            answers,
            local,
            remote,
            now,
            failover,
            tally: Tally {
                cached: cached as u64,
                ..Tally::default()
            },
        }
    }

    /// The descriptor at plan position `i` (the checks' descriptors, flattened).
    pub fn item(&self, i: usize) -> &CheckItem {
        let mut at = i;
        for check in &self.checks {
            match check.get(at) {
                Some(item) => return item,
                None => at -= check.len(),
            }
        }
        panic!("plan position {i} is past the batch")
    }

    /// When the flight was planned.
    pub fn now(&self) -> Now {
        self.now
    }

    /// The view the flight was planned on.
    pub fn view(&self) -> &Arc<ClusterView> {
        &self.view
    }

    /// Deny, without deciding, every descriptor planned here whose rule is fenced and
    /// whose key this node may not decide at `now` ([`policy::fence_check`]): they
    /// leave [`Flight::local`]. Returns how many. A node that models no fencing (the
    /// simulator's, for now) does not call it, and decides them all.
    pub fn fence(&mut self, me: &Decider, fence: &Fence, now: Now) -> usize {
        let mut denied = 0;
        let mut kept = Positions::new();
        for &i in &self.local {
            let item = self.item(i);
            match policy::fence_check(item, fence, now) {
                Ok(()) => kept.push(i),
                Err(why) => {
                    tracing::debug!(key = %item.client(), rule = %item.rule.name, %why, "fenced");
                    self.answers[i] = Some(policy::closed_denial(item, me, now.wall));
                    denied += 1;
                }
            }
        }
        self.local = kept;
        self.tally.fenced += denied as u64;
        denied
    }

    /// Descriptor `i` is denied, not decided: its rule is fenced and this node may not
    /// decide its key now (a [`Rescue::ReplicaHere`] checked against the fence when it
    /// ran, or an answer that came back after the lease ran out and was given back).
    pub fn fenced(&mut self, i: usize, me: &Decider, now: Millis) {
        let answer = policy::closed_denial(self.item(i), me, now);
        self.tally.fenced += 1;
        self.answers[i] = Some(answer);
    }

    /// What to decide on this node's shards, in the order [`Flight::answer_here`]
    /// takes the answers.
    pub fn local(&self) -> impl ExactSizeIterator<Item = &CheckItem> + Clone + '_ {
        self.local.iter().map(|&i| self.item(i))
    }

    /// What to forward, each with its owner, in the order [`Flight::settle`] takes
    /// the results.
    pub fn remote(&self) -> impl ExactSizeIterator<Item = (usize, &Member)> + '_ {
        self.remote
            .iter()
            .map(|&(i, owner)| (i, &self.view.members[owner]))
    }

    /// How many descriptors go to their owner.
    pub fn remote_len(&self) -> usize {
        self.remote.len()
    }

    /// The descriptors a budget lease held here may answer instead: each one sent to
    /// its owner, and each answered from the deny cache (a lease granted after the
    /// denial is budget to spend), with whether it is its check's only descriptor (a
    /// lease's unit is never given back, so only those are leasable).
    pub fn lease_candidates(&self) -> smallvec::SmallVec<[LeaseCandidate; 2]> {
        let single = |i: usize| {
            let mut at = i;
            for check in &self.checks {
                if at < check.len() {
                    return check.len() == 1;
                }
                at -= check.len();
            }
            false
        };
        let remote = self.remote.iter().map(|&(i, owner)| LeaseCandidate {
            position: i,
            owner: Some(owner),
            single: single(i),
        });
        let cached = (0..self.answers.len())
            .filter(|&i| self.answers[i].is_some())
            .map(|i| LeaseCandidate {
                position: i,
                owner: None,
                single: single(i),
            });
        remote.chain(cached).collect()
    }

    /// The owner of a [`LeaseCandidate`] (`None` for a deny-cache answer).
    pub fn candidate_owner(&self, candidate: &LeaseCandidate) -> Option<&Member> {
        candidate.owner.map(|owner| &self.view.members[owner])
    }

    /// A budget lease held here answered descriptor `i`: it is not forwarded.
    pub fn leased(&mut self, i: usize, answer: Answer) {
        self.answers[i] = Some(answer);
        self.remote.retain(|(position, _)| *position != i);
    }

    /// This node's shards' answers to [`Flight::local`], in its order.
    pub fn answer_here(&mut self, answers: impl IntoIterator<Item = Answer>) {
        for (&i, answer) in self.local.iter().zip(answers) {
            self.answers[i] = Some(answer);
        }
    }

    /// The owners' answers to [`Flight::remote`], in its order. A denial is cached in
    /// `deny` (not a shadow rule's: its checks are allowed and must each reach the
    /// owner; not an uncached item's). Returns each descriptor whose owner did not
    /// answer with its next step.
    pub fn settle(
        &mut self,
        me: &str,
        results: impl IntoIterator<Item = Result<Remote, ForwardError>>,
        deny: &DenyCache,
    ) -> Vec<(usize, Rescue)> {
        let mut rescues = Vec::new();
        self.tally.forwarded += self.remote.len() as u64;
        for (k, result) in (0..self.remote.len()).zip(results) {
            let (i, owner) = self.remote[k];
            let owner = &self.view.members[owner];
            let item = self.item(i);
            match result {
                Ok(remote) => {
                    let answer = policy::remote_answer(item, remote, owner);
                    if let Some(denial) = policy::denial(item, &answer, self.now.mono)
                        .filter(|_| !item.rule.shadow && !item.uncached)
                    {
                        deny.insert(item.id, denial, self.now.mono);
                    }
                    self.answers[i] = Some(answer);
                }
                Err(error) => {
                    tracing::debug!(%error, key = %item.client(), "owner unreachable; falling back");
                    self.tally.forward_errors += 1;
                    rescues.push((i, self.rescue(me, i, Failure::of(&error))));
                }
            }
        }
        rescues
    }

    /// Where descriptor `i`, whose owner failed with `failure`, goes next: its
    /// successor's replica when the cluster replicates and the owner may be down (an
    /// owner that refused is alive), else its fallback.
    fn rescue(&self, me: &str, i: usize, failure: Failure) -> Rescue {
        if self.failover == FailOver::Off || failure == Failure::Refused {
            return Rescue::Fallback;
        }
        let item = self.item(i);
        let Some(successor) = self.view.ring.successor_of_hash(item.id.placement) else {
            return Rescue::Fallback;
        };
        let mut failover = item.clone();
        failover.target = Target::Replica(match failure {
            // The owner may have counted it: nothing is owed to it.
            Failure::TimedOut => Doubt::InDoubt,
            Failure::Unreachable | Failure::Refused => Doubt::Owed,
        });
        if successor == me {
            return Rescue::ReplicaHere(failover);
        }
        match self.view.member(successor) {
            Some(member) => Rescue::Replica(member_index(&self.view, member), failover),
            None => Rescue::Fallback,
        }
    }

    /// This node's shard decided descriptor `i` on its replica (a
    /// [`Rescue::ReplicaHere`] with `charge`).
    pub fn replica_decided_here(&mut self, i: usize, me: &Decider, charge: Charge, o: Outcome) {
        let item = self.item(i);
        let mut answer = policy::local_answer(item, me, o.decision, o.sequence, o.at, charge);
        answer.degraded = true;
        self.tally.failed_over += 1;
        self.answers[i] = Some(answer);
    }

    /// The successor's answer to a [`Rescue::Replica`]: `true` when descriptor `i` is
    /// answered, `false` when it needs [`Flight::fall_back`].
    pub fn replica_answered(
        &mut self,
        i: usize,
        successor: usize,
        result: Result<Remote, ForwardError>,
    ) -> bool {
        let item = self.item(i);
        match result {
            Ok(remote) => {
                let successor = &self.view.members[successor];
                let mut answer = policy::remote_answer(item, remote, successor);
                answer.degraded = true;
                self.tally.failed_over += 1;
                self.answers[i] = Some(answer);
                true
            }
            Err(error) => {
                tracing::debug!(%error, key = %item.client(), "successor unreachable too");
                self.tally.failover_failed += 1;
                false
            }
        }
    }

    /// Descriptor `i` gets its rule's fallback: a fail-closed denial is answered now;
    /// a fail-open one returns the ring size its stand-in rule divides the limit by
    /// (the caller decides `item.under(stand-in)` here, then [`Flight::opened`]).
    pub fn fall_back(&mut self, i: usize, me: &Decider) -> Option<u64> {
        let item = self.item(i);
        match policy::on_unreachable(item, me, self.view.ring.len(), self.now.wall) {
            Fallback::Closed(answer) => {
                self.tally.closed += 1;
                self.answers[i] = Some(*answer);
                None
            }
            Fallback::Open { nodes } => {
                self.tally.open += 1;
                Some(nodes)
            }
        }
    }

    /// This node's shard decided descriptor `i`'s fail-open stand-in (`charge`).
    pub fn opened(&mut self, i: usize, me: &Decider, charge: Charge, o: Outcome) {
        let item = self.item(i);
        let mut answer = policy::local_answer(item, me, o.decision, o.sequence, o.at, charge);
        answer.degraded = true;
        self.answers[i] = Some(answer);
    }

    /// What the flight did so far.
    pub fn tally(&self) -> Tally {
        self.tally
    }

    /// The member at `index` in the flight's view (a [`Rescue::Replica`]'s successor).
    pub fn member(&self, index: usize) -> &Member {
        &self.view.members[index]
    }

    /// The checks and their answers, once every descriptor has one: combined, with
    /// the refunds a denied check asks for marked ([`policy::combine`]).
    pub fn land(self) -> DecidedChecks {
        let answers = self
            .answers
            .into_iter()
            .map(|a| a.expect("every descriptor of a landed flight is answered"));
        policy::combine(self.checks, answers)
    }
}

/// A descriptor a budget lease may answer ([`Flight::lease_candidates`]).
#[derive(Debug, Clone, Copy)]
pub struct LeaseCandidate {
    /// Its plan position.
    pub position: usize,
    /// Its owner's index in the view, if it was to be forwarded (else the deny cache
    /// answered it).
    owner: Option<usize>,
    /// Whether it is its check's only descriptor.
    pub single: bool,
}

/// The index of `member` (borrowed from `view`) in `view.members`.
fn member_index(view: &ClusterView, member: &Member) -> usize {
    view.members
        .binary_search_by(|m| m.node_id.as_str().cmp(&member.node_id))
        .expect("a member of the view")
}

/// Whether this node refuses forwarded `items` as owner: while it restores its keys
/// after a restart it is not an owner yet (the sender fails over to the successor),
/// though it still decides fail-overs on the replicas it holds.
pub fn owner_refuses(restored: bool, items: impl IntoIterator<Item = bool>) -> bool {
    !restored && items.into_iter().any(|failover| !failover)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::link::ForwardError;
    use crate::cluster::policy::testkit::{decider, item, key_of, view};

    fn checks_for(key: &str) -> Checks {
        smallvec::smallvec![smallvec::smallvec![item(key, "GET /", 1)]]
    }

    /// `key`'s check as a client's batch on node "a" of `view`.
    fn planned(view: &Arc<ClusterView>, key: &str, deny: &DenyCache, failover: FailOver) -> Flight {
        let now = Now {
            wall: 1_000,
            mono: 1_000,
        };
        Flight::plan(
            checks_for(key),
            view.clone(),
            "a",
            deny,
            now,
            Routing::default(),
            failover,
        )
    }

    fn timeout() -> ForwardError {
        ForwardError::Timeout("b".into())
    }

    #[test]
    fn a_timed_out_owner_sends_the_check_to_the_successor_marked_in_doubt() {
        let view = Arc::new(view(&["a", "b", "c"]));
        let key = key_of(&view, "b");
        let deny = DenyCache::new(16);
        let mut flight = planned(&view, &key, &deny, FailOver::ToSuccessor);
        assert_eq!(flight.remote_len(), 1);
        let rescues = flight.settle("a", [Err(timeout())], &deny);
        assert_eq!(rescues.len(), 1);
        let successor = view
            .ring
            .successor_of_hash(flight.item(0).id.placement)
            .expect("a successor")
            .to_string();
        match &rescues[0].1 {
            Rescue::Replica(member, item) => {
                assert_eq!(flight.member(*member).node_id, successor);
                assert_eq!(item.target, Target::Replica(Doubt::InDoubt));
            }
            Rescue::ReplicaHere(item) => {
                assert_eq!(successor, "a");
                assert_eq!(item.target, Target::Replica(Doubt::InDoubt));
            }
            Rescue::Fallback => panic!("a replicated cluster fails over"),
        }
        assert_eq!(flight.tally().forward_errors, 1);
    }

    #[test]
    fn without_replicas_or_from_a_refusing_owner_there_is_only_the_fallback() {
        let view = Arc::new(view(&["a", "b", "c"]));
        let key = key_of(&view, "b");
        let deny = DenyCache::new(16);
        let mut off = planned(&view, &key, &deny, FailOver::Off);
        let rescues = off.settle("a", [Err(timeout())], &deny);
        assert!(matches!(rescues[0].1, Rescue::Fallback));
        let mut on = planned(&view, &key, &deny, FailOver::ToSuccessor);
        let refused = ForwardError::Refused("b".into(), "no".into());
        assert_eq!(Failure::of(&refused), Failure::Refused);
        let rescues = on.settle("a", [Err(refused)], &deny);
        assert!(matches!(rescues[0].1, Rescue::Fallback));
    }

    #[test]
    fn an_unreachable_owner_is_not_in_doubt_and_a_failed_replica_falls_back_open() {
        let view = Arc::new(view(&["a", "b", "c"]));
        let key = key_of(&view, "b");
        let deny = DenyCache::new(16);
        let mut flight = planned(&view, &key, &deny, FailOver::ToSuccessor);
        let unreachable = ForwardError::Unreachable("b".into(), "reset".into());
        let rescues = flight.settle("a", [Err(unreachable)], &deny);
        let (i, rescue) = &rescues[0];
        match rescue {
            Rescue::Replica(successor, item) => {
                assert_eq!(item.target, Target::Replica(Doubt::Owed));
                let answered = flight.replica_answered(*i, *successor, Err(timeout()));
                assert!(!answered);
                assert_eq!(flight.tally().failover_failed, 1);
            }
            Rescue::ReplicaHere(item) => assert_eq!(item.target, Target::Replica(Doubt::Owed)),
            Rescue::Fallback => panic!("a replicated cluster fails over"),
        }
        // The test rules fail open: the stand-in divides the limit by the ring size.
        assert_eq!(flight.fall_back(*i, &decider("a")), Some(3));
        assert_eq!(flight.tally().open, 1);
    }

    #[test]
    fn a_fenced_key_this_node_may_not_decide_is_denied_and_never_reaches_its_shards() {
        let view = Arc::new(view(&["a", "b", "c"]));
        let key = key_of(&view, "a");
        let deny = DenyCache::new(16);
        let checks: Checks = smallvec::smallvec![smallvec::smallvec![
            item(&key, "GET /closed", 1),
            item(&key, "GET /", 1)
        ]];
        let now = Now {
            wall: 1_000,
            mono: 1_000,
        };
        let mut flight = Flight::plan(
            checks,
            view.clone(),
            "a",
            &deny,
            now,
            Routing::default(),
            FailOver::ToSuccessor,
        );
        assert_eq!(flight.local().count(), 2);
        assert_eq!(flight.fence(&decider("a"), &Fence::open("a"), now), 0);
        assert_eq!(flight.fence(&decider("a"), &Fence::closed("a"), now), 1);
        let left: Vec<&str> = flight.local().map(|i| &*i.rule.name).collect();
        assert_eq!(left, ["default"], "only the unfenced rule is decided");
        assert_eq!(flight.tally().fenced, 1);
        let it = flight.item(1).clone();
        flight.answer_here([policy::local_answer(
            &it,
            &decider("a"),
            crate::algorithms::Decision {
                allowed: true,
                limit: 100,
                remaining: 99,
                retry_after_ms: 0,
                reset_at_ms: 0,
                window_id: None,
                delay_ms: 0,
            },
            1,
            1_000,
            it.charge(),
        )]);
        let decided = flight.land();
        let fenced = &decided[0].descriptors[0];
        assert!(!fenced.answer.decision.allowed && fenced.answer.degraded);
        assert!(
            decided[0].descriptors[1].refunded,
            "the sibling's admission is given back"
        );
    }

    #[test]
    fn a_restoring_owner_refuses_owners_checks_but_decides_fail_overs() {
        assert!(owner_refuses(false, [false]));
        assert!(owner_refuses(false, [true, false]));
        assert!(!owner_refuses(false, [true]));
        assert!(!owner_refuses(true, [false]));
    }
}
