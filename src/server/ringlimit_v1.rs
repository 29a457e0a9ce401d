//! The `ringlimit.v1.RateLimiter` front end: `Check` and `CheckBatch` mapped onto the
//! [`Checker`], and its [`Verdict`] mapped back. Nothing else: validation, rule
//! matching, refunds and the overall verdict are the check layer's.
//!
//! Wire semantics that are this API's own: an extra descriptor with an empty route, no
//! tier or no cost inherits the request's; fields are named `key`, `descriptors[1].cost`,
//! `checks[3].route`; and the descriptor limit counts the extra descriptors.

use super::answer_budget::{over_budget, AnswerBudget};
use std::time::Instant;

use metrics::Histogram;
use tonic::{Request, Response, Status};

use crate::check::{
    At, CheckInput, Checker, DescriptorInput, Descriptors, FieldNames, Leaf, Verdict,
};
use crate::proto;

/// The public gRPC face of a node.
#[derive(Debug, Clone)]
pub struct RateLimitService {
    checker: Checker,
    latency: Histogram,
    answers: AnswerBudget,
}

impl RateLimitService {
    /// A service deciding through `checker`.
    pub fn new(checker: Checker) -> Self {
        Self {
            checker,
            latency: metrics::histogram!("ringlimit_check_duration_seconds"),
            answers: AnswerBudget::default(),
        }
    }

    /// Share `answers`, the node-wide budget of unsent bulk answers
    /// ([`super::answer_budget`]), with the node's other bulk front ends.
    pub fn with_answer_budget(mut self, answers: AnswerBudget) -> Self {
        self.answers = answers;
        self
    }
}

/// How `ringlimit.v1` names its fields: the request's own descriptor is the top level,
/// the others are `descriptors[i]`, and inside a batch everything is under `checks[i]`.
pub(super) struct V1Names;

impl FieldNames for V1Names {
    fn field(&self, at: At, leaf: Leaf) -> String {
        let prefix = at.check.map_or(String::new(), |i| format!("checks[{i}]."));
        match at.descriptor {
            0 => format!("{prefix}{}", leaf.as_str()),
            d => format!("{prefix}descriptors[{}].{}", d - 1, leaf.as_str()),
        }
    }

    fn descriptors(&self, check: Option<usize>) -> String {
        match check {
            Some(i) => format!("checks[{i}].descriptors"),
            None => "descriptors".into(),
        }
    }

    fn too_many_descriptors(&self, given: usize, max: usize) -> String {
        format!(
            "{} descriptors given; at most {} are allowed per check, the request's own key included",
            given - 1,
            max - 1
        )
    }
}

/// The check input of one request: its own descriptor first, then the extra ones with
/// what they inherit filled in.
pub(super) fn input(request: &proto::CheckRequest) -> CheckInput<'_> {
    let own = DescriptorInput {
        key: &request.key,
        route: &request.route,
        tier: request.tier.as_deref(),
        cost: request.cost,
    };
    let mut descriptors = Descriptors::with_capacity(1 + request.descriptors.len());
    descriptors.push(own);
    descriptors.extend(request.descriptors.iter().map(|d| DescriptorInput {
        key: &d.key,
        route: if d.route.is_empty() {
            own.route
        } else {
            &d.route
        },
        tier: d.tier.as_deref().or(own.tier),
        cost: d.cost.or(own.cost),
    }));
    CheckInput { descriptors }
}

/// Each descriptor's (key, route) exactly as the request sent them, in request order:
/// what a response echoes, moved out of the request rather than copied (the planned
/// descriptors hold the same text). Only an extra descriptor that inherits the
/// request's route takes a copy of it.
fn echoes(request: proto::CheckRequest) -> impl Iterator<Item = (String, String)> {
    let own_route = request.route;
    let inherit = request.descriptors.iter().any(|d| d.route.is_empty());
    let shared = inherit.then(|| own_route.clone());
    std::iter::once((request.key, own_route)).chain(request.descriptors.into_iter().map(move |d| {
        let route = if d.route.is_empty() {
            shared.clone().unwrap_or_default()
        } else {
            d.route
        };
        (d.key, route)
    }))
}

/// The wire answer for a verdict on `request`.
fn response(verdict: Verdict, request: proto::CheckRequest) -> proto::CheckResponse {
    let wire_decider = |d: &crate::cluster::Decider| proto::Decider {
        node_id: d.node_id.to_string(),
        generation: d.generation,
    };
    let reset_at = |ms: u64| ms.min(i64::MAX as u64) as i64;
    proto::CheckResponse {
        allowed: verdict.allowed,
        limit: verdict.limit,
        remaining: verdict.remaining,
        retry_after_ms: verdict.retry_after_ms,
        reset_at: reset_at(verdict.reset_at_ms),
        rule: verdict.rule.to_string(),
        decider: Some(wire_decider(&verdict.decider)),
        window_id: verdict.window_id,
        sequence: verdict.sequence,
        degraded: verdict.degraded,
        delay_ms: verdict.delay_ms,
        window_ms: verdict.window_ms,
        shadow_denied: verdict.shadow_denied,
        descriptors: verdict
            .descriptors
            .iter()
            .zip(echoes(request))
            .map(|(d, (key, route))| {
                debug_assert!(*d.item.client == *key && *d.item.route == *route);
                let (a, decision) = (&d.answer, &d.answer.decision);
                proto::DescriptorResult {
                    key,
                    route,
                    allowed: decision.allowed,
                    limit: decision.limit,
                    remaining: decision.remaining,
                    retry_after_ms: decision.retry_after_ms,
                    reset_at: reset_at(decision.reset_at_ms),
                    rule: a.rule.to_string(),
                    algorithm: a.algorithm.as_str().to_string(),
                    window_id: decision.window_id,
                    sequence: a.sequence,
                    decider: Some(wire_decider(&a.decider)),
                    degraded: a.degraded,
                    delay_ms: decision.delay_ms,
                    refunded: d.refunded,
                    hops: a.hops,
                    shadow_denied: d.shadow_denied(),
                }
            })
            .collect(),
    }
}

#[tonic::async_trait]
impl proto::rate_limiter_server::RateLimiter for RateLimitService {
    async fn check(
        &self,
        request: Request<proto::CheckRequest>,
    ) -> Result<Response<proto::CheckResponse>, Status> {
        let started = Instant::now();
        let request = request.into_inner();
        let verdict = self.checker.check(&input(&request), &V1Names).await?;
        self.latency.record(started.elapsed().as_secs_f64());
        Ok(Response::new(response(verdict, request)))
    }

    async fn check_batch(
        &self,
        request: Request<proto::CheckBatchRequest>,
    ) -> Result<Response<proto::CheckBatchResponse>, Status> {
        let started = Instant::now();
        let batch = request.into_inner();
        // Before anything is decided: over budget, nothing is charged. One item per
        // answered check and per descriptor (each echoes its key and route).
        let items: usize = batch.checks.iter().map(|c| 1 + c.descriptors.len()).sum();
        let held = self
            .answers
            .try_hold(items)
            .ok_or_else(|| over_budget(items, &self.answers))?;
        let inputs: Vec<CheckInput<'_>> = batch.checks.iter().map(input).collect();
        let verdicts = self.checker.check_batch(&inputs, &V1Names).await?;
        drop(inputs);
        self.latency.record(started.elapsed().as_secs_f64());
        let mut answer = Response::new(proto::CheckBatchResponse {
            results: verdicts
                .into_iter()
                .zip(batch.checks)
                .map(|(verdict, request)| response(verdict, request))
                .collect(),
        });
        answer.extensions_mut().insert(held);
        Ok(answer)
    }

    async fn topology(
        &self,
        _request: Request<proto::TopologyRequest>,
    ) -> Result<Response<proto::TopologyResponse>, Status> {
        let view = self.checker.view();
        let members = view
            .members
            .iter()
            .filter(|m| !m.leaving)
            .map(|m| proto::TopologyMember {
                node_id: m.node_id.clone(),
                grpc_addr: m.grpc_addr.to_string(),
                generation: m.generation,
            })
            .collect();
        Ok(Response::new(proto::TopologyResponse {
            members,
            vnodes: view.ring.vnodes(),
            placement_version: crate::ring::PLACEMENT,
            ring_digest: view.ring.digest(),
            node_id: self.checker.me().to_string(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::plan::{plan_check, MAX_DESCRIPTORS};
    use crate::check::CheckError;
    use crate::config::rules::RuleSet;

    fn request(key: &str, route: &str) -> proto::CheckRequest {
        proto::CheckRequest {
            key: key.into(),
            route: route.into(),
            ..Default::default()
        }
    }

    /// The error `plan_check` gives for `r` (as check `batch` of a batch, if any).
    fn refused(r: &proto::CheckRequest, batch: Option<usize>) -> CheckError {
        plan_check(&input(r), &RuleSet::builtin(), batch, &V1Names).unwrap_err()
    }

    fn field(error: CheckError) -> String {
        match error {
            CheckError::InvalidArgument { field, .. } => field,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn the_top_level_fields_are_named_plainly_and_batches_prefix_the_index() {
        assert_eq!(field(refused(&request("", "/x"), None)), "key");
        assert_eq!(field(refused(&request("", "/x"), Some(3))), "checks[3].key");
        let mut r = request("a", "/x");
        r.cost = Some(0);
        assert_eq!(
            refused(&r, None).to_string(),
            "cost: must be a positive integer (got 0); a cost of 0 would admit for ever and a negative one would refund"
        );
    }

    #[test]
    fn extra_descriptors_inherit_route_tier_and_cost_and_name_their_own_fields() {
        let mut r = request("a", "GET /x");
        r.cost = Some(3);
        r.tier = Some("gold".into());
        r.descriptors = vec![proto::Descriptor {
            key: "ip:10.0.0.1".into(),
            ..Default::default()
        }];
        let planned = plan_check(&input(&r), &RuleSet::builtin(), None, &V1Names).unwrap();
        assert_eq!(&*planned[1].route, "GET /x");
        assert_eq!(planned[1].cost.get(), 3);
        assert_eq!(planned[1].tier.as_deref(), Some("gold"));
        r.descriptors[0].cost = Some(0);
        assert_eq!(field(refused(&r, None)), "descriptors[0].cost");
        r.descriptors[0].cost = None;
        r.descriptors[0].key = String::new();
        assert_eq!(field(refused(&r, Some(1))), "checks[1].descriptors[0].key");
    }

    #[test]
    fn too_many_descriptors_are_refused_counting_the_extra_ones() {
        let mut r = request("a", "/x");
        r.descriptors = (0..MAX_DESCRIPTORS)
            .map(|i| proto::Descriptor {
                key: format!("ip{i}"),
                ..Default::default()
            })
            .collect();
        assert_eq!(
            refused(&r, None).to_string(),
            "descriptors: 8 descriptors given; at most 7 are allowed per check, the request's own key included"
        );
        r.descriptors.pop();
        let planned = plan_check(&input(&r), &RuleSet::builtin(), None, &V1Names).unwrap();
        assert_eq!(planned.len(), MAX_DESCRIPTORS);
    }
}
