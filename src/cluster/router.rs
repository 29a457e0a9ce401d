//! The router: the async step around the routing policy.
//!
//! [`Router::decide`] runs [`policy::plan`], then the one step that needs I/O (this
//! node's shards and the forwards, concurrently), then the policy's answers for owners
//! that did not answer (fail-open descriptors go to the shards too), then refunds. Every
//! decision about *where* and *what* is a pure function in [`policy`]; this file only
//! sequences them and counts what happened.

use std::sync::{Arc, Mutex};

use dashmap::DashMap;
use futures_util::future::join_all;
use tokio::sync::watch;

use crate::algorithms::Millis;
use crate::clock::Clock;
use crate::cluster::deny_cache::DenyCache;
use crate::cluster::flight::{self, FailOver, Flight, Rescue, Tally};
use crate::cluster::link::CountersError;
use crate::cluster::link::PeerPool;
use crate::cluster::policy::{self, Origin, Routing};
use crate::cluster::replication::Restore;
use crate::cluster::{Answer, CheckItem, Checks, Decided, DecidedChecks, Decider};
use crate::config::rules::{Rule, RuleSet};
use crate::membership::{ClusterView, Fence};
use crate::ring::RingDiff;
use crate::shard::counters::{ClientCounters, ClientQuery};
use crate::shard::{Charge, Refund, ShardError, Shards};

mod budget;
mod reserve;

/// The owners' answers to one check's forwarded descriptors, in plan order: inline for
/// one (a unary check's usual case).
type Remotes =
    smallvec::SmallVec<[Result<crate::cluster::Remote, crate::cluster::link::ForwardError>; 1]>;

/// How long ranges inherited from a dead node are remembered for counting resets.
const INHERITED_MEMORY_MS: u64 = 10 * 60 * 1000;

/// Ranges of the hash space this node inherited from a node that died, and when:
/// keys there restart from empty, and each such restart is counted.
///
/// The router sees a new ring as soon as membership publishes it; the handoff watcher
/// records what it inherited a moment later. So it also says which ring it has
/// accounted for ([`Inherited::accounted`]): under a ring not yet accounted for, a key
/// that starts from empty counts as a restart (the safe side of that moment).
#[derive(Debug, Default)]
pub struct Inherited {
    moves: Mutex<Vec<(RingDiff, Millis)>>,
    /// Digest of the last ring whose inherited ranges are recorded.
    accounted: std::sync::atomic::AtomicU64,
}

impl Inherited {
    /// Nothing inherited yet, the node's first ring (digest `ring`) accounted for.
    pub fn new(ring: u64) -> Self {
        let inherited = Self::default();
        inherited.accounted(ring);
        inherited
    }

    /// Remember `diff` (moves from a dead node to this one) as of `now`.
    pub fn record(&self, diff: RingDiff, now: Millis) {
        let mut moves = self.moves.lock().expect("not poisoned");
        moves.retain(|(_, at)| now.saturating_sub(*at) < INHERITED_MEMORY_MS);
        moves.push((diff, now));
    }

    /// Everything the ring with digest `ring` gave this node from a dead one is recorded.
    pub fn accounted(&self, ring: u64) {
        self.accounted
            .store(ring, std::sync::atomic::Ordering::Release);
    }

    /// Whether the inherited ranges of the ring with digest `ring` are recorded.
    fn accounted_for(&self, ring: u64) -> bool {
        self.accounted.load(std::sync::atomic::Ordering::Acquire) == ring
    }

    /// Whether ring position `placement` was inherited from a dead node lately.
    fn contains(&self, placement: u64) -> bool {
        let moves = self.moves.lock().expect("not poisoned");
        moves
            .iter()
            .any(|(diff, _)| diff.moved_hash(placement).is_some())
    }
}

/// Node-level counters of the routing layer.
struct RouterMetrics {
    forwarded: metrics::Counter,
    degraded_open: metrics::Counter,
    degraded_closed: metrics::Counter,
    deny_cache_hits: metrics::Counter,
    forward_errors: metrics::Counter,
    resets: metrics::Counter,
    not_owner: metrics::Counter,
    failed_over: metrics::Counter,
    fenced: metrics::Counter,
}

impl RouterMetrics {
    fn new() -> Self {
        Self {
            forwarded: metrics::counter!("ringlimit_forwarded_total"),
            degraded_open: metrics::counter!("ringlimit_degraded_total", "reason" => "fail_open"),
            degraded_closed: metrics::counter!("ringlimit_degraded_total", "reason" => "fail_closed"),
            deny_cache_hits: metrics::counter!("ringlimit_deny_cache_hits_total"),
            forward_errors: metrics::counter!("ringlimit_forward_errors_total"),
            resets: metrics::counter!("ringlimit_ownership_resets_total"),
            not_owner: metrics::counter!("ringlimit_forwarded_not_owner_total"),
            failed_over: metrics::counter!("ringlimit_degraded_total", "reason" => "fail_over"),
            fenced: metrics::counter!("ringlimit_degraded_total", "reason" => "fenced"),
        }
    }
}

/// Decides descriptors wherever their owner is.
pub struct Router {
    me: Decider,
    shards: Shards,
    view: watch::Receiver<Arc<ClusterView>>,
    peers: PeerPool,
    deny: DenyCache,
    fallbacks: DashMap<(Arc<str>, u64, u64), Arc<Rule>>,
    clock: Arc<dyn Clock>,
    inherited: Arc<Inherited>,
    metrics: RouterMetrics,
    routing: Routing,
    /// Whether a check whose owner cannot be reached goes to the key's successor
    /// (which holds its replica) before failing open: on when the cluster replicates.
    failover: FailOver,
    restore: Arc<Restore>,
    /// Decide checks of hot remote counters from budget leases (`router/budget.rs`).
    budget_leases: bool,
    /// Whether this node may decide fenced rules' keys (membership's quorum tracker),
    /// read on `fence_clock`'s monotonic clock, the one the lease was measured on.
    fence: watch::Receiver<Arc<Fence>>,
    fence_clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router").field("me", &self.me).finish()
    }
}

impl Router {
    /// A router for the node `me`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        me: Decider,
        shards: Shards,
        view: watch::Receiver<Arc<ClusterView>>,
        peers: PeerPool,
        deny: DenyCache,
        clock: Arc<dyn Clock>,
        inherited: Arc<Inherited>,
    ) -> Self {
        Self {
            shards,
            view,
            peers,
            deny,
            fallbacks: DashMap::new(),
            clock,
            inherited,
            metrics: RouterMetrics::new(),
            routing: Routing::default(),
            failover: FailOver::Off,
            restore: Arc::new(Restore::new(true)),
            budget_leases: false,
            fence: watch::channel(Arc::new(Fence::open(&me.node_id))).1,
            fence_clock: Arc::new(crate::clock::SystemClock),
            me,
        }
    }

    /// This router fencing fenced rules by membership's `fence`, whose leases are
    /// instants of `clock`'s monotonic reading. Without it every key is decided.
    pub fn with_fence(mut self, fence: watch::Receiver<Arc<Fence>>, clock: Arc<dyn Clock>) -> Self {
        self.fence = fence;
        self.fence_clock = clock;
        self
    }

    /// The latest fence, and `now` with the fence clock's monotonic reading.
    fn fence_now(&self, now: policy::Now) -> (Arc<Fence>, policy::Now) {
        let fence = self.fence.borrow().clone();
        let now = policy::Now {
            wall: now.wall,
            mono: self.fence_clock.monotonic_ms(),
        };
        (fence, now)
    }

    /// Answers decided here on a fenced rule's key whose lease ran out (or whose owner
    /// came back) while the shard decided them: a stall between the check and the
    /// decision must not make this node a second decider. Each such admission becomes
    /// a denial, and its charge is returned (given back on the shard).
    fn recheck_fenced<'a>(
        &self,
        items: impl IntoIterator<Item = &'a CheckItem>,
        answers: &mut [Answer],
    ) -> Vec<Refund> {
        let (fence, now) = self.fence_now(policy::Now::of(&*self.clock));
        let late = policy::recheck_fenced(items, answers, &self.me, &fence, now);
        self.metrics.fenced.increment(late.denied as u64);
        late.refunds
    }

    /// This router sending checks whose owner is unreachable to the key's successor
    /// (`failover`), and answering as owner only once `restore` is done.
    pub fn with_replication(mut self, failover: bool, restore: Arc<Restore>) -> Self {
        self.failover = if failover {
            FailOver::ToSuccessor
        } else {
            FailOver::Off
        };
        self.restore = restore;
        self
    }

    /// Whether this node answers as owner: not while it restores its keys' replicas
    /// after a start with seeds (`/readyz` says so).
    pub fn restored(&self) -> bool {
        self.restore.is_done()
    }

    /// The peer pool (replication sends on it).
    pub fn peers(&self) -> &PeerPool {
        &self.peers
    }

    /// NEGATIVE CONTROL ONLY: decide every check here, ignoring the ring, so the chaos
    /// checkers can be shown to catch a cluster that over-admits.
    pub fn break_decide_locally(mut self) -> Self {
        tracing::warn!(
            "BROKEN MODE: every check is decided locally; limits are not enforced cluster-wide"
        );
        self.routing.broken_decide_locally = true;
        self
    }

    /// This node's clock (Unix ms).
    pub fn now_ms(&self) -> Millis {
        self.clock.now_ms()
    }

    /// This node's identity.
    pub fn me(&self) -> &Decider {
        &self.me
    }

    /// The node's shards.
    pub fn shards(&self) -> &Shards {
        &self.shards
    }

    /// The current cluster view.
    pub fn view(&self) -> Arc<ClusterView> {
        self.view.borrow().clone()
    }

    /// One client's counters, read (or, with `reset`, dropped) on the key's owner:
    /// here when this node owns the key, else asked of the owner over the peer face
    /// (which re-finds them under its own rules). Charges nothing. `by` names who asked,
    /// for the owner's audit line. A reset also forgets this node's cached denials of
    /// the counters, so its next check of the key goes to the owner.
    pub async fn counters(
        &self,
        rules: &RuleSet,
        query: &ClientQuery,
        reset: bool,
        by: &str,
    ) -> Result<ClientCounters, CountersError> {
        let view = self.view();
        let owner = view
            .owner_of_placement(query.placement())
            .ok_or(CountersError::NoOwner)?;
        if reset {
            for counter in query.counters(rules) {
                self.deny.forget(&counter.id);
            }
        }
        if owner.node_id == *self.me.node_id {
            return Ok(self.counters_here(rules, query, reset).await?);
        }
        self.peers.counters(owner, query, reset, by).await
    }

    /// One client's counters on this node's shard, whoever owns the key (the peer face
    /// answers for the owner it was asked as; a forwarded question is never sent on).
    pub async fn counters_here(
        &self,
        rules: &RuleSet,
        query: &ClientQuery,
        reset: bool,
    ) -> Result<ClientCounters, ShardError> {
        let counters = self
            .shards
            .counters(query.placement(), query.counters(rules), reset)
            .await?;
        Ok(ClientCounters {
            owner: self.me.node_id.to_string(),
            generation: self.me.generation,
            counters,
        })
    }

    /// Decide checks that a client sent to this node: each descriptor on its owner,
    /// then refund the admitted descriptors of every check that another one denied.
    pub async fn decide(&self, checks: Checks) -> Result<DecidedChecks, ShardError> {
        // Two steps, so the refund's future does not sit beside the planning's locals
        // in this future (a front end boxes it once per check).
        let decided = self.decide_unrefunded(checks).await?;
        self.refund(&decided).await?;
        Ok(decided)
    }

    /// [`Router::decide`] up to its refunds: the check's [`Flight`], driven with this
    /// node's shards and peer pool.
    async fn decide_unrefunded(&self, checks: Checks) -> Result<DecidedChecks, ShardError> {
        if !self.restore.is_done() {
            // Restarted: this node answers as owner once its keys are restored.
            self.restore.wait().await;
        }
        let view = self.view();
        let now = policy::Now::of(&*self.clock);
        let mut flight = Flight::plan(
            checks,
            view.clone(),
            &self.me.node_id,
            &self.deny,
            now,
            self.routing,
            self.failover,
        );
        // Only a batch with a fenced rule's descriptor pays for reading the fence.
        let fenced = flight.local().any(|item| item.rule.is_fenced());
        if fenced {
            let (fence, fence_now) = self.fence_now(now);
            flight.fence(&self.me, &fence, fence_now);
        }
        self.spend_leases(&mut flight).await?;

        // The one step with I/O: this node's shards and the owners, concurrently.
        let (local_answers, remote_results) = if flight.remote_len() == 1 {
            // The common remote case, one descriptor: `join_all` would box and collect.
            let (i, owner) = flight.remote().next().expect("one remote descriptor");
            let (local, remote) = tokio::join!(
                self.decide_here(flight.local(), &view),
                self.peers.forward(owner, flight.item(i))
            );
            (local, Remotes::from_buf([remote]))
        } else {
            let remote_calls = flight
                .remote()
                .map(|(i, owner)| self.peers.forward(owner, flight.item(i)));
            let (local, remote) = tokio::join!(
                self.decide_here(flight.local(), &view),
                join_all(remote_calls)
            );
            (local, Remotes::from_vec(remote))
        };
        // Collected (inline for a unary check) so the answers stop borrowing the flight.
        let mut local_answers: smallvec::SmallVec<[Answer; 2]> = local_answers?.collect();
        if fenced {
            let late = self.recheck_fenced(flight.local(), &mut local_answers);
            if !late.is_empty() {
                self.shards.refund(late).await?;
            }
        }
        flight.answer_here(local_answers);
        let rescues = flight.settle(&self.me.node_id, remote_results, &self.deny);
        if !rescues.is_empty() {
            // Only when an owner did not answer: boxed, so every check's future does not
            // carry room for the fail-over's.
            Box::pin(self.rescue(&mut flight, rescues)).await?;
        }
        self.count(flight.tally());
        Ok(flight.land())
    }

    /// Add what a flight did to the node's metrics.
    fn count(&self, tally: Tally) {
        let m = &self.metrics;
        m.deny_cache_hits.increment(tally.cached);
        m.forwarded.increment(tally.forwarded);
        m.forward_errors.increment(tally.forward_errors);
        m.failed_over.increment(tally.failed_over);
        m.degraded_closed.increment(tally.closed);
        m.degraded_open.increment(tally.open);
        m.fenced.increment(tally.fenced);
    }

    /// Perform each descriptor's [`Rescue`]: its replica at the key's successor (here
    /// or one hop away), then, where that gave no answer, its fallback (a fail-open
    /// stand-in decided on this node's shards).
    async fn rescue(
        &self,
        flight: &mut Flight,
        rescues: Vec<(usize, Rescue)>,
    ) -> Result<(), ShardError> {
        let mut open: Vec<(usize, Charge)> = Vec::new();
        for (i, rescue) in rescues {
            let answered = match rescue {
                Rescue::ReplicaHere(failover) => {
                    // Checked now, not when the flight was planned: the forward to the
                    // owner took its time.
                    let (fence, now) = self.fence_now(policy::Now::of(&*self.clock));
                    if policy::fence_check(&failover, &fence, now).is_err() {
                        flight.fenced(i, &self.me, now.wall);
                        continue;
                    }
                    let charge = failover.charge();
                    let outcome = self
                        .shards
                        .check(smallvec::smallvec![charge.clone()])
                        .await?;
                    let mut answer = [policy::local_answer(
                        &failover,
                        &self.me,
                        outcome[0].decision,
                        outcome[0].sequence,
                        outcome[0].at,
                        charge.clone(),
                    )];
                    let late = self.recheck_fenced([&failover], &mut answer);
                    if !late.is_empty() {
                        self.shards.refund(late).await?;
                        flight.fenced(i, &self.me, answer[0].at);
                        continue;
                    }
                    flight.replica_decided_here(i, &self.me, charge, outcome[0]);
                    true
                }
                Rescue::Replica(successor, failover) => {
                    let result = self
                        .peers
                        .forward(flight.member(successor), &failover)
                        .await;
                    flight.replica_answered(i, successor, result)
                }
                Rescue::Fallback => false,
            };
            if answered {
                continue;
            }
            if let Some(nodes) = flight.fall_back(i, &self.me) {
                let item = flight.item(i);
                open.push((i, item.under(self.fallback_rule(item, nodes))));
            }
        }
        if open.is_empty() {
            return Ok(());
        }
        let (positions, charges): (Vec<usize>, crate::shard::Charges) = open.into_iter().unzip();
        let outcomes = self.shards.check(charges.clone()).await?;
        for ((i, charge), outcome) in positions.into_iter().zip(charges).zip(outcomes) {
            flight.opened(i, &self.me, charge, outcome);
        }
        Ok(())
    }

    /// Decide descriptors a peer forwarded here: on this node's shards, whatever this
    /// node's ring says (forwarding again could loop). Each answer, in `items` order,
    /// goes through `wire` straight into the result: the peer service builds its wire
    /// answers without a vector of [`Answer`]s between.
    pub async fn decide_forwarded<T>(
        &self,
        items: &[CheckItem],
        mut wire: impl FnMut(Answer) -> T,
    ) -> Result<Vec<T>, ShardError> {
        if flight::owner_refuses(
            self.restore.is_done(),
            items.iter().map(|i| i.target.is_replica()),
        ) {
            // Not an owner yet: the sender fails over to the successor.
            return Err(ShardError::Restoring);
        }
        let view = self.view();
        let strays = policy::strays(items, &view, &self.me.node_id);
        if strays > 0 {
            // The sender's ring and ours disagree (a membership change in flight).
            self.metrics.not_owner.increment(strays as u64);
        }
        // The same policy as a client's batch, from the peer's side: everything is
        // decided here (never forwarded again), nothing is answered from the cache.
        let refs: smallvec::SmallVec<[&CheckItem; 4]> = items.iter().collect();
        let plan = policy::plan(
            &refs,
            &view,
            &self.me.node_id,
            &self.deny,
            policy::Now::of(&*self.clock),
            Origin::Peer,
            self.routing,
        );
        debug_assert!(plan.remote.is_empty() && plan.cached == 0);
        if !refs.iter().any(|item| item.rule.is_fenced()) {
            let answers = self
                .decide_here(plan.local.iter().map(|&i| refs[i]), &view)
                .await?
                .map(wire)
                .collect();
            return Ok(answers);
        }
        // Fenced rules' keys this node may not decide now (as owner, or as successor on
        // a replica) are denied here, degraded, and never reach the shards.
        let (fence, now) = self.fence_now(policy::Now::of(&*self.clock));
        let (decide, denied) = policy::fence_split(&refs, &plan.local, &self.me, &fence, now);
        if denied.is_empty() {
            let mut answers: Vec<Answer> = self
                .decide_here(plan.local.iter().map(|&i| refs[i]), &view)
                .await?
                .collect();
            let late = self.recheck_fenced(plan.local.iter().map(|&i| refs[i]), &mut answers);
            if !late.is_empty() {
                self.shards.refund(late).await?;
            }
            return Ok(answers.into_iter().map(wire).collect());
        }
        self.metrics.fenced.increment(denied.len() as u64);
        let mut answers: Vec<Option<Answer>> = vec![None; refs.len()];
        for (i, denial) in denied {
            answers[i] = Some(denial);
        }
        let mut decided: Vec<Answer> = self
            .decide_here(decide.iter().map(|&i| refs[i]), &view)
            .await?
            .collect();
        let late = self.recheck_fenced(decide.iter().map(|&i| refs[i]), &mut decided);
        if !late.is_empty() {
            self.shards.refund(late).await?;
        }
        for (&i, answer) in decide.iter().zip(decided) {
            answers[i] = Some(answer);
        }
        Ok(plan
            .local
            .iter()
            .map(|&i| wire(answers[i].take().expect("every forwarded item is answered")))
            .collect())
    }

    /// Decide on this node's shards, each item on its own counter. The answers come
    /// back as an iterator, so a client's check places them in its plan without a
    /// vector of its own.
    async fn decide_here<'a, 'r, I>(
        &'r self,
        items: I,
        view: &'r ClusterView,
    ) -> Result<impl Iterator<Item = Answer> + use<'a, 'r, I>, ShardError>
    where
        I: ExactSizeIterator<Item = &'a CheckItem> + Clone,
    {
        let outcomes = if items.len() == 0 {
            crate::shard::Outcomes::new()
        } else {
            self.shards
                .check(items.clone().map(|item| item.charge()).collect())
                .await?
        };
        Ok(items.zip(outcomes).map(move |(item, outcome)| {
            if outcome.fresh && self.restarts_here(view, item.id.placement) {
                self.metrics.resets.increment(1);
            }
            policy::local_answer(
                item,
                &self.me,
                outcome.decision,
                outcome.sequence,
                outcome.at,
                item.charge(),
            )
        }))
    }

    /// Give back what was admitted for checks that another descriptor denied.
    async fn refund(&self, decided: &[Decided]) -> Result<(), ShardError> {
        let refunds = policy::refunds(decided);
        if !refunds.here.is_empty() {
            self.shards.refund(refunds.here).await?;
        }
        for (owner, items) in refunds.remote {
            let peers = self.peers.clone();
            // The caller's answer does not wait for a remote refund.
            tokio::spawn(async move {
                if let Err(error) = peers.refund(&owner, &items).await {
                    tracing::debug!(%error, "refund not delivered; the owner keeps the charge");
                }
            });
        }
        Ok(())
    }

    /// Whether a key that starts from empty here is (probably) a count that restarts:
    /// its range was inherited from a node that died, or this node's own ring still
    /// names another owner (a peer with a newer view forwarded it here, so this node
    /// is an extra decider for the key), or this ring's inherited ranges are not
    /// recorded yet. Over-counting a genuinely new key in those moments is the safe
    /// side: a silent reset is the failure to avoid.
    fn restarts_here(&self, view: &ClusterView, placement: u64) -> bool {
        let stray = view
            .owner_of_placement(placement)
            .is_some_and(|owner| owner.node_id != *self.me.node_id);
        stray
            || !self.inherited.accounted_for(view.ring.digest())
            || self.inherited.contains(placement)
    }

    /// The fail-open stand-in for `item`'s rule, built once per (rule, ring size).
    fn fallback_rule(&self, item: &CheckItem, nodes: u64) -> Arc<Rule> {
        self.fallbacks
            .entry((item.rule.name.clone(), item.rule.fingerprint, nodes))
            .or_insert_with(|| Arc::new(policy::fallback_rule(&item.rule, nodes)))
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::Inherited;

    /// The window `tests/cluster_process.rs` fell into once: the router saw the ring
    /// without the dead node before the handoff watcher recorded what it inherited.
    #[test]
    fn a_newer_ring_is_unaccounted_until_the_handoff_watcher_records_it() {
        let inherited = Inherited::new(1);
        assert!(
            inherited.accounted_for(1),
            "the first ring inherits nothing"
        );
        assert!(!inherited.accounted_for(2), "published, not yet recorded");
        inherited.accounted(2);
        assert!(inherited.accounted_for(2));
        assert!(!inherited.accounted_for(1));
    }
}
