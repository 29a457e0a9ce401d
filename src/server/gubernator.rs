//! The `pb.gubernator.V1` front end: `GetRateLimits` mapped onto
//! [`Checker::check_gubernator`] and its answers mapped back, and `HealthCheck`.
//! Nothing else: validation, the algorithm mapping, hits, behaviours and inline rules
//! are the check layer's (`check::gubernator`).
//!
//! Wire details that are this API's own:
//!
//! - an item that cannot be decided answers only `error` (its other fields zero), as
//!   Gubernator does; the call itself fails only when it is malformed as a whole (more
//!   than 1000 items) or the node is overloaded;
//! - `metadata["owner"]` is the id of the node that decided the item;
//! - served only with `serve --gubernator`: every request defines its own limit
//!   (docs/security.md).

use tonic::{Request, Response, Status};

use super::answer_budget::AnswerBudget;
use super::front::Front;
use crate::check::gubernator::{RateLimitInput, RateLimitStatus};
use crate::check::{CheckError, Checker};
use crate::membership::ClusterView;
use crate::proto::gubernator::{
    v1_server, GetRateLimitsReq, GetRateLimitsResp, HealthCheckReq, HealthCheckResp, RateLimitReq,
    RateLimitResp, Status as WireStatus,
};

/// Gubernator's V1 service on the public face of a node.
#[derive(Debug, Clone)]
pub struct GubernatorService {
    checker: Checker,
    front: Front,
}

impl GubernatorService {
    /// A service deciding through `checker`.
    pub fn new(checker: Checker) -> Self {
        Self {
            checker,
            front: Front::new("ringlimit_gubernator_duration_seconds"),
        }
    }

    /// Share `answers`, the node-wide budget of unsent bulk answers
    /// ([`super::answer_budget`]), with the node's other bulk front ends.
    pub fn with_answer_budget(mut self, answers: AnswerBudget) -> Self {
        self.front = self.front.with_answer_budget(answers);
        self
    }
}

/// The check input of one item, borrowed from it.
pub(super) fn input(r: &RateLimitReq) -> RateLimitInput<'_> {
    RateLimitInput {
        name: &r.name,
        unique_key: &r.unique_key,
        hits: r.hits,
        limit: r.limit,
        duration: r.duration,
        algorithm: r.algorithm,
        behavior: r.behavior,
        burst: r.burst,
        created_at: r.created_at,
    }
}

/// The wire answer of one item.
pub(super) fn response(answer: Result<RateLimitStatus, CheckError>) -> RateLimitResp {
    match answer {
        Ok(s) => RateLimitResp {
            status: if s.over_limit {
                WireStatus::OverLimit
            } else {
                WireStatus::UnderLimit
            } as i32,
            limit: s.limit,
            remaining: s.remaining,
            reset_time: s.reset_time_ms,
            error: String::new(),
            metadata: [("owner".to_string(), s.owner.to_string())].into(),
        },
        // The check layer names the item by its place in the batch.
        Err(CheckError::Unavailable { descriptor, .. }) => RateLimitResp {
            error: format!(
                "requests[{descriptor}]: the owner of this rate limit is unreachable; \
                 nothing was charged"
            ),
            ..Default::default()
        },
        Err(e) => RateLimitResp {
            error: e.to_string(),
            ..Default::default()
        },
    }
}

#[tonic::async_trait]
impl v1_server::V1 for GubernatorService {
    async fn get_rate_limits(
        &self,
        request: Request<GetRateLimitsReq>,
    ) -> Result<Response<GetRateLimitsResp>, Status> {
        let request = request.into_inner();
        let held = self.front.hold(request.requests.len())?;
        let timed = self.front.start();
        let inputs: Vec<RateLimitInput<'_>> = request.requests.iter().map(input).collect();
        let answers = self.checker.check_gubernator(&inputs).await?;
        let responses = answers.into_iter().map(response).collect();
        Ok(timed.answered_holding(GetRateLimitsResp { responses }, held))
    }

    async fn health_check(
        &self,
        _request: Request<HealthCheckReq>,
    ) -> Result<Response<HealthCheckResp>, Status> {
        Ok(Response::new(health(
            &self.checker.view(),
            self.checker.me(),
        )))
    }
}

/// Healthy while this node is a member of its own view and owns keys (not leaving);
/// `peer_count` is the members it sees, itself included.
pub(super) fn health(view: &ClusterView, me: &str) -> HealthCheckResp {
    let peer_count = i32::try_from(view.members.len()).unwrap_or(i32::MAX);
    let unhealthy = |message: String| HealthCheckResp {
        status: "unhealthy".into(),
        message,
        peer_count,
        advertise_address: String::new(),
    };
    match view.member(me) {
        None => unhealthy(format!("node {me} is not in its own cluster view yet")),
        Some(m) if m.leaving => unhealthy(format!(
            "node {me} is leaving the cluster (handing its keys over)"
        )),
        Some(_) => HealthCheckResp {
            status: "healthy".into(),
            message: String::new(),
            peer_count,
            advertise_address: String::new(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn healthy_while_a_member_that_owns_keys_else_unhealthy_with_why() {
        use crate::cluster::policy::testkit::member;
        let me = member("a", 1);
        let h = health(&ClusterView::single(me.clone()), "a");
        assert_eq!((h.status.as_str(), h.peer_count), ("healthy", 1));
        let h = health(&ClusterView::single(member("b", 2)), "a");
        assert_eq!(h.status, "unhealthy");
        assert!(
            h.message.contains("not in its own cluster view"),
            "{}",
            h.message
        );
        let leaving = crate::membership::Member {
            leaving: true,
            ..me
        };
        let h = health(&ClusterView::single(leaving), "a");
        assert_eq!(h.status, "unhealthy");
        assert!(h.message.contains("leaving"), "{}", h.message);
    }

    #[test]
    fn an_answer_names_its_owner_and_an_error_is_all_an_item_says() {
        let ok = response(Ok(RateLimitStatus {
            over_limit: true,
            limit: 10,
            remaining: 0,
            reset_time_ms: 1_700_000_060_000,
            owner: Arc::from("b"),
        }));
        assert_eq!(ok.status, WireStatus::OverLimit as i32);
        assert_eq!(ok.metadata["owner"], "b");
        assert!(ok.error.is_empty());
        let bad = response(Err(CheckError::invalid("unique_key", "cannot be empty")));
        assert_eq!(bad.error, "unique_key: cannot be empty");
        assert_eq!((bad.limit, bad.remaining, bad.reset_time), (0, 0, 0));
        assert!(bad.metadata.is_empty());
    }
}
