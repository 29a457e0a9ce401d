//! The gRPC services of a node and the routing beneath them.
//!
//! - [`RateLimitService`]: the public `ringlimit.v1.RateLimiter` (`Check`, `CheckBatch`).
//! - [`peer::PeerService`]: the node-to-node `ringlimit.peer.v1.Peer` (forwarded checks,
//!   refunds, state handoff, status).
//! - [`router::Router`]: decides each descriptor on its owner: here, one hop away, from
//!   the deny cache, or by the fail-open fallback.
//! - [`forward`]: one batched HTTP/2 channel per peer.
//! - [`handoff`]: moves key state when ring ownership changes while the old owner lives.
//!
//! Flow of one `Check`: validate and match rules for every descriptor
//! ([`request::plan_check`]; a bad request is refused here with nothing charged) →
//! [`router::Router::decide`] → if any descriptor denied, the ones that allowed are
//! refunded where they were charged → [`request::respond`] builds the answer.
//!
//! The refund closes the complaint against envoyproxy/ratelimit (#1060) that a denied
//! request still eats the quota of its other descriptors. What remains is a short race:
//! between the admit and the refund another request for the same key may be judged
//! against the not-yet-refunded count and denied. That errs in the safe direction (a
//! spurious deny, never an over-admission); see `docs/algorithms.md`.

pub mod forward;
pub mod handoff;
pub mod peer;
pub mod request;
pub mod router;

use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use metrics::Histogram;
use tonic::{Request, Response, Status};

use crate::config::rules::RuleSet;
use crate::error::CheckError;
use crate::proto;
use router::Router;

/// The rules every check is matched against; swapped whole on reload.
pub type SharedRules = Arc<ArcSwap<RuleSet>>;

/// Who decided: stamped on every answer so a checker can audit the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decider {
    /// Stable node id.
    pub node_id: Arc<str>,
    /// Start time in ns: changes on every restart.
    pub generation: u64,
}

/// The public gRPC face of a node.
#[derive(Clone)]
pub struct RateLimitService {
    router: Arc<Router>,
    rules: SharedRules,
    latency: Histogram,
}

impl RateLimitService {
    /// A service deciding through `router` with the rules in `rules`.
    pub fn new(router: Arc<Router>, rules: SharedRules) -> Self {
        Self {
            router,
            rules,
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
        let decided = self.router.decide(planned).await?;
        Ok(decided
            .iter()
            .map(|d| request::respond(&d.items, &d.answers, &d.refunded))
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
