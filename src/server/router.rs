//! Where each descriptor is decided: on this node's shards, on its owner one hop
//! away, from the deny cache, or (owner unreachable) by the fail-open fallback.
//!
//! Routing rule: the ring in this node's current cluster view names the owner of the
//! client key. A check that arrived from a peer (`Peer/Forward`) is decided here
//! whatever the ring says: at most one hop, never a loop, even while two nodes'
//! rings disagree.

use std::sync::{Arc, Mutex};

use dashmap::DashMap;
use futures_util::future::join_all;
use tokio::sync::watch;

use crate::algorithms::{AlgorithmKind, Decision, Millis};
use crate::clock::Clock;
use crate::config::rules::{FailMode, Rule};
use crate::deny_cache::{Denial, DenyCache};
use crate::membership::{ClusterView, Member};
use crate::proto::peer::{ForwardItem, RefundItem as WireRefund};
use crate::ring::{Ring, RingDiff};
use crate::server::forward::PeerPool;
use crate::server::Decider;
use crate::shard::{CheckItem, RefundItem, ShardError, Shards, StateKey};

/// How long a denial is answered for a fail-closed rule whose owner is unreachable.
const CLOSED_RETRY_MS: u64 = 1_000;
/// How long ranges inherited from a dead node are remembered for counting resets.
const INHERITED_MEMORY_MS: u64 = 10 * 60 * 1000;

/// One descriptor's answer, wherever it was decided.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The verdict and numbers.
    pub decision: Decision,
    /// The decider's sequence number (0 for answers that no decider made just now).
    pub sequence: u64,
    /// The decider's clock at the decision (quoted by a refund).
    pub at: Millis,
    /// Who decided.
    pub decider: Decider,
    /// Not decided by the key's owner: fail-open fallback, fail-closed, or deny cache.
    pub degraded: bool,
    /// Forward hops (0: decided here).
    pub hops: u32,
    /// Rule name as the decider reported it.
    pub rule: Arc<str>,
    /// Algorithm name as the decider reported it.
    pub algorithm: &'static str,
    /// Where a refund of this answer must go.
    pub charged: Charged,
}

/// Where an admitted answer was charged, i.e. where to send its refund.
#[derive(Debug, Clone)]
pub enum Charged {
    /// Nothing was charged (denied, cached, fail-closed).
    Nothing,
    /// This node's shards, under this rule (the real one or its fallback).
    Here(Arc<Rule>),
    /// The owner, one hop away.
    Owner(Member),
}

/// One check's descriptors with their answers after refunds.
#[derive(Debug)]
pub struct Decided {
    /// The descriptors as planned.
    pub items: Vec<CheckItem>,
    /// One answer per descriptor.
    pub answers: Vec<Answer>,
    /// Per descriptor: admitted, then given back because another descriptor denied.
    pub refunded: Vec<bool>,
}

/// Ranges of the hash space this node inherited from a node that died, and when:
/// keys there restart from empty, and each such restart is counted.
#[derive(Debug, Default)]
pub struct Inherited {
    moves: Mutex<Vec<(RingDiff, Millis)>>,
}

impl Inherited {
    /// Remember `diff` (moves from a dead node to this one) as of `now`.
    pub fn record(&self, diff: RingDiff, now: Millis) {
        let mut moves = self.moves.lock().expect("not poisoned");
        moves.retain(|(_, at)| now.saturating_sub(*at) < INHERITED_MEMORY_MS);
        moves.push((diff, now));
    }

    fn contains(&self, client: &[u8]) -> bool {
        let moves = self.moves.lock().expect("not poisoned");
        if moves.is_empty() {
            return false;
        }
        let hash = Ring::key_hash(client);
        moves
            .iter()
            .any(|(diff, _)| diff.moved_hash(hash).is_some())
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
    broken_decide_locally: bool,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router").field("me", &self.me).finish()
    }
}

enum Route {
    Here,
    Owner(Member),
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
            me,
            shards,
            view,
            peers,
            deny,
            fallbacks: DashMap::new(),
            clock,
            inherited,
            metrics: RouterMetrics::new(),
            broken_decide_locally: false,
        }
    }

    /// NEGATIVE CONTROL ONLY: decide every check here, ignoring the ring, so the chaos
    /// checkers can be shown to catch a cluster that over-admits.
    pub fn break_decide_locally(mut self) -> Self {
        tracing::warn!(
            "BROKEN MODE: every check is decided locally; limits are not enforced cluster-wide"
        );
        self.broken_decide_locally = true;
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

    /// Decide checks that a client sent to this node: each descriptor on its owner.
    pub async fn decide(&self, checks: Vec<Vec<CheckItem>>) -> Result<Vec<Decided>, ShardError> {
        let view = self.view();
        let flat: Vec<&CheckItem> = checks.iter().flatten().collect();
        let mut answers: Vec<Option<Answer>> = vec![None; flat.len()];
        let now = self.clock.now_ms();

        let mut local = Vec::new();
        let mut remote = Vec::new();
        for (i, item) in flat.iter().enumerate() {
            match self.route(&view, item.client.as_bytes()) {
                Route::Here => local.push(i),
                Route::Owner(owner) => {
                    if let Some(answer) = self.cached(item, now) {
                        answers[i] = Some(answer);
                    } else {
                        remote.push((i, owner));
                    }
                }
            }
        }

        let local_items: Vec<CheckItem> = local.iter().map(|&i| flat[i].clone()).collect();
        let remote_calls = remote.iter().map(|(i, owner)| {
            let item = flat[*i];
            self.peers.forward(owner, forward_item(item))
        });
        let (local_outcomes, remote_results) = tokio::join!(
            async {
                if local_items.is_empty() {
                    Ok(Vec::new())
                } else {
                    self.decide_here(local_items).await
                }
            },
            join_all(remote_calls)
        );
        for (&i, answer) in local.iter().zip(local_outcomes?) {
            answers[i] = Some(answer);
        }
        self.metrics.forwarded.increment(remote.len() as u64);
        let mut fallback = Vec::new();
        for ((i, owner), result) in remote.iter().zip(remote_results) {
            let item = flat[*i];
            match result {
                Ok(forwarded) => {
                    let answer = remote_answer(forwarded, owner);
                    if !answer.decision.allowed {
                        self.remember_denial(item, &answer, now);
                    }
                    answers[*i] = Some(answer);
                }
                Err(error) => {
                    self.metrics.forward_errors.increment(1);
                    tracing::debug!(%error, key = %item.client, "owner unreachable; falling back");
                    fallback.push(*i);
                }
            }
        }
        if !fallback.is_empty() {
            let nodes = view.ring.len().max(1) as u64;
            let mut open_items = Vec::new();
            let mut open_rules = Vec::new();
            for &i in &fallback {
                let item = flat[i];
                match item.rule.on_unavailable {
                    FailMode::Closed => {
                        self.metrics.degraded_closed.increment(1);
                        answers[i] = Some(self.closed_answer(item, now));
                    }
                    FailMode::Open => {
                        self.metrics.degraded_open.increment(1);
                        let rule = self.fallback_rule(&item.rule, nodes);
                        open_rules.push(i);
                        open_items.push(CheckItem {
                            rule,
                            ..item.clone()
                        });
                    }
                }
            }
            if !open_items.is_empty() {
                let decided = self.decide_here(open_items).await?;
                for (i, mut answer) in open_rules.into_iter().zip(decided) {
                    answer.degraded = true;
                    // Report the rule the caller's check matched, not its stand-in.
                    answer.rule = flat[i].rule.name.clone();
                    answers[i] = Some(answer);
                }
            }
        }

        let mut answers = answers
            .into_iter()
            .map(|a| a.expect("every descriptor answered"));
        let mut decided = Vec::with_capacity(checks.len());
        for items in checks {
            let answers: Vec<Answer> = answers.by_ref().take(items.len()).collect();
            let any_denied = answers.iter().any(|a| !a.decision.allowed);
            let refunded = answers
                .iter()
                .map(|a| any_denied && a.decision.allowed && !matches!(a.charged, Charged::Nothing))
                .collect();
            decided.push(Decided {
                items,
                answers,
                refunded,
            });
        }
        self.refund(&decided).await?;
        Ok(decided)
    }

    /// Decide on this node's shards (checks forwarded here, and locally owned keys).
    pub async fn decide_here(&self, items: Vec<CheckItem>) -> Result<Vec<Answer>, ShardError> {
        let outcomes = self.shards.check(items.clone()).await?;
        let view = self.view();
        Ok(items
            .into_iter()
            .zip(outcomes)
            .map(|(item, outcome)| {
                if outcome.fresh && self.restarts_here(&view, item.client.as_bytes()) {
                    self.metrics.resets.increment(1);
                }
                Answer {
                    decision: outcome.decision,
                    sequence: outcome.sequence,
                    at: outcome.at,
                    decider: self.me.clone(),
                    degraded: false,
                    hops: 0,
                    rule: item.rule.name.clone(),
                    algorithm: item.rule.limiter.kind().as_str(),
                    charged: if outcome.decision.allowed {
                        Charged::Here(item.rule.clone())
                    } else {
                        Charged::Nothing
                    },
                }
            })
            .collect())
    }

    /// Give back what was admitted for checks that another descriptor denied.
    async fn refund(&self, decided: &[Decided]) -> Result<(), ShardError> {
        let mut here = Vec::new();
        let mut remote: Vec<(Member, Vec<WireRefund>)> = Vec::new();
        for check in decided {
            for ((item, answer), &give_back) in
                check.items.iter().zip(&check.answers).zip(&check.refunded)
            {
                if !give_back {
                    continue;
                }
                match &answer.charged {
                    Charged::Nothing => {}
                    Charged::Here(rule) => here.push(RefundItem {
                        item: CheckItem {
                            rule: rule.clone(),
                            ..item.clone()
                        },
                        at: answer.at,
                    }),
                    Charged::Owner(owner) => {
                        let refund = WireRefund {
                            key: item.client.to_string(),
                            route: item.route.to_string(),
                            tier: item.tier.as_deref().map(str::to_string),
                            cost: item.cost.get(),
                            at: answer.at,
                        };
                        match remote.iter_mut().find(|(m, _)| m.node_id == owner.node_id) {
                            Some((_, items)) => items.push(refund),
                            None => remote.push((owner.clone(), vec![refund])),
                        }
                    }
                }
            }
        }
        if !here.is_empty() {
            self.shards.refund(here).await?;
        }
        for (owner, items) in remote {
            let peers = self.peers.clone();
            // The caller's answer does not wait for a remote refund.
            tokio::spawn(async move {
                if let Err(error) = peers.refund(&owner, items).await {
                    tracing::debug!(%error, "refund not delivered; the owner keeps the charge");
                }
            });
        }
        Ok(())
    }

    /// Whether a key that starts from empty here is (probably) a count that restarts:
    /// its range was inherited from a node that died, or this node's own ring still
    /// names another owner (a peer with a newer view forwarded it here, so this node
    /// is an extra decider for the key). Over-counting a genuinely new key in those
    /// moments is the safe side: a silent reset is the failure to avoid.
    fn restarts_here(&self, view: &ClusterView, client: &[u8]) -> bool {
        let stray = view
            .owner(client)
            .is_some_and(|owner| owner.node_id != *self.me.node_id);
        stray || self.inherited.contains(client)
    }

    fn route(&self, view: &ClusterView, client: &[u8]) -> Route {
        if self.broken_decide_locally {
            return Route::Here;
        }
        match view.owner(client) {
            Some(owner) if owner.node_id != *self.me.node_id => Route::Owner(owner.clone()),
            // This node owns the key, or the ring is empty (every member leaving):
            // deciding here beats refusing.
            _ => Route::Here,
        }
    }

    fn cached(&self, item: &CheckItem, now: Millis) -> Option<Answer> {
        let key = StateKey::new(&item.rule.name, item.client.as_bytes(), &item.route);
        let (decision, decider) =
            self.deny
                .get(key.as_bytes(), now, item.cost.get(), item.rule.fingerprint)?;
        self.metrics.deny_cache_hits.increment(1);
        Some(Answer {
            decision,
            sequence: 0,
            at: now,
            decider,
            degraded: true,
            hops: 0,
            rule: item.rule.name.clone(),
            algorithm: item.rule.limiter.kind().as_str(),
            charged: Charged::Nothing,
        })
    }

    fn remember_denial(&self, item: &CheckItem, answer: &Answer, now: Millis) {
        let retry = answer.decision.retry_after_ms;
        if retry == 0 || retry == u64::MAX {
            return;
        }
        let key = StateKey::new(&item.rule.name, item.client.as_bytes(), &item.route);
        self.deny.insert(
            key.as_bytes(),
            Denial {
                // Measured from this node's clock when the check was sent: the owner
                // decided no earlier, so the wait can only be longer, never shorter.
                until: now.saturating_add(retry),
                cost: item.cost.get(),
                fingerprint: item.rule.fingerprint,
                decision: answer.decision,
                decider: answer.decider.clone(),
            },
            now,
        );
    }

    fn closed_answer(&self, item: &CheckItem, now: Millis) -> Answer {
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
            decider: self.me.clone(),
            degraded: true,
            hops: 0,
            rule: item.rule.name.clone(),
            algorithm: item.rule.limiter.kind().as_str(),
            charged: Charged::Nothing,
        }
    }

    fn fallback_rule(&self, rule: &Arc<Rule>, nodes: u64) -> Arc<Rule> {
        self.fallbacks
            .entry((rule.name.clone(), rule.fingerprint, nodes))
            .or_insert_with(|| Arc::new(rule.fallback(nodes)))
            .clone()
    }
}

fn forward_item(item: &CheckItem) -> ForwardItem {
    ForwardItem {
        key: item.client.to_string(),
        route: item.route.to_string(),
        tier: item.tier.as_deref().map(str::to_string),
        cost: item.cost.get(),
        hops: 1,
    }
}

fn remote_answer(forwarded: crate::server::forward::Forwarded, owner: &Member) -> Answer {
    let o = forwarded.outcome;
    Answer {
        decision: Decision {
            allowed: o.allowed,
            limit: o.limit,
            remaining: o.remaining,
            retry_after_ms: o.retry_after_ms,
            reset_at_ms: o.reset_at,
            window_id: o.window_id,
            delay_ms: o.delay_ms,
        },
        sequence: o.sequence,
        at: o.at,
        decider: forwarded.decider,
        degraded: false,
        hops: 1,
        rule: Arc::from(o.rule.as_str()),
        algorithm: AlgorithmKind::parse(&o.algorithm).map_or("unknown", |k| k.as_str()),
        charged: if o.allowed {
            Charged::Owner(owner.clone())
        } else {
            Charged::Nothing
        },
    }
}
