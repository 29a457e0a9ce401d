//! The public gRPC service `ringlimit.v1.RateLimiter`, and the wire-independent
//! [`Checker`] it maps onto.
//!
//! Flow of one `Check`: validate and match rules for every descriptor
//! ([`request::plan_check`]; a bad request is refused here with nothing charged) →
//! [`Checker::decide`] sends all descriptors to their shards at once → if any denied,
//! the ones that allowed are refunded → [`request::respond`] builds the answer.
//!
//! The refund closes the complaint against envoyproxy/ratelimit (#1060) that a denied
//! request still eats the quota of its other descriptors. What remains is a short race:
//! between the admit and the refund (one shard round trip) another request for the
//! same key may be judged against the not-yet-refunded count and denied. That errs in
//! the safe direction (a spurious deny, never an over-admission) and is documented in
//! `docs/algorithms.md`.

pub mod request;

use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use metrics::Histogram;
use tonic::{Request, Response, Status};

use crate::config::rules::RuleSet;
use crate::error::CheckError;
use crate::proto;
use crate::shard::{CheckItem, Outcome, RefundItem, ShardError, Shards};
pub use request::Decider;

/// The rules every check is matched against; swapped whole on reload.
pub type SharedRules = Arc<ArcSwap<RuleSet>>;

/// One check's descriptors with their outcomes after refunds.
#[derive(Debug)]
pub struct Decided {
    /// The descriptors as planned.
    pub items: Vec<CheckItem>,
    /// The shard's outcome per descriptor.
    pub outcomes: Vec<Outcome>,
    /// Per descriptor: admitted, then given back because another descriptor denied.
    pub refunded: Vec<bool>,
}

impl Decided {
    /// Allowed only if every descriptor allowed.
    pub fn allowed(&self) -> bool {
        self.outcomes.iter().all(|o| o.decision.allowed)
    }
}

/// Decides planned checks on this node's shards: the core every wire API maps onto.
#[derive(Clone, Debug)]
pub struct Checker {
    shards: Shards,
}

impl Checker {
    /// A checker over `shards`.
    pub fn new(shards: Shards) -> Self {
        Self { shards }
    }

    /// Decide many independent checks: one shard message per shard for all of them.
    pub async fn decide(&self, checks: Vec<Vec<CheckItem>>) -> Result<Vec<Decided>, ShardError> {
        let flat: Vec<CheckItem> = checks.iter().flatten().cloned().collect();
        let mut outcomes = self.shards.check(flat).await?.into_iter();
        let mut decided = Vec::with_capacity(checks.len());
        let mut refunds = Vec::new();
        for items in checks {
            let outcomes: Vec<Outcome> = outcomes.by_ref().take(items.len()).collect();
            let any_denied = outcomes.iter().any(|o| !o.decision.allowed);
            let refunded: Vec<bool> = outcomes
                .iter()
                .map(|o| any_denied && o.decision.allowed)
                .collect();
            for ((item, outcome), &give_back) in items.iter().zip(&outcomes).zip(&refunded) {
                if give_back {
                    refunds.push(RefundItem {
                        item: item.clone(),
                        at: outcome.at,
                    });
                }
            }
            decided.push(Decided {
                items,
                outcomes,
                refunded,
            });
        }
        if !refunds.is_empty() {
            self.shards.refund(refunds).await?;
        }
        Ok(decided)
    }
}

/// The gRPC face of a node.
#[derive(Clone)]
pub struct RateLimitService {
    checker: Checker,
    rules: SharedRules,
    decider: Decider,
    latency: Histogram,
}

impl RateLimitService {
    /// A service deciding on `checker` with the rules in `rules`.
    pub fn new(checker: Checker, rules: SharedRules, decider: Decider) -> Self {
        Self {
            checker,
            rules,
            decider,
            latency: metrics::histogram!("ringlimit_check_duration_seconds"),
        }
    }

    /// Validate, decide and answer a batch of checks (a unary `Check` is a batch of one).
    async fn run(
        &self,
        checks: &[proto::CheckRequest],
        batch: bool,
    ) -> Result<Vec<proto::CheckResponse>, CheckError> {
        let rules = self.rules.load();
        let planned = checks
            .iter()
            .enumerate()
            .map(|(i, check)| {
                let at = if batch {
                    format!("checks[{i}].")
                } else {
                    String::new()
                };
                request::plan_check(check, &rules, &at)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let decided = self.checker.decide(planned).await?;
        Ok(decided
            .iter()
            .map(|d| request::respond(&d.items, &d.outcomes, &d.refunded, &self.decider))
            .collect())
    }
}

#[tonic::async_trait]
impl proto::rate_limiter_server::RateLimiter for RateLimitService {
    async fn check(
        &self,
        request: Request<proto::CheckRequest>,
    ) -> Result<Response<proto::CheckResponse>, Status> {
        let started = Instant::now();
        let check = request.into_inner();
        let mut answers = self.run(std::slice::from_ref(&check), false).await?;
        self.latency.record(started.elapsed().as_secs_f64());
        Ok(Response::new(answers.pop().expect("one answer per check")))
    }

    async fn check_batch(
        &self,
        request: Request<proto::CheckBatchRequest>,
    ) -> Result<Response<proto::CheckBatchResponse>, Status> {
        let started = Instant::now();
        let batch = request.into_inner();
        if batch.checks.len() > request::MAX_BATCH {
            return Err(CheckError::invalid(
                "checks",
                format!(
                    "{} checks in one batch; at most {} are allowed",
                    batch.checks.len(),
                    request::MAX_BATCH
                ),
            )
            .into());
        }
        let results = self.run(&batch.checks, true).await?;
        self.latency.record(started.elapsed().as_secs_f64());
        Ok(Response::new(proto::CheckBatchResponse { results }))
    }
}
