//! The `ringlimit.v1.RateLimiter` front end: `Check` and `CheckBatch` mapped onto the
//! [`Checker`], and its [`Verdict`](crate::check::Verdict) mapped back. Nothing else: validation, rule
//! matching, refunds and the overall verdict are the check layer's.
//!
//! Wire semantics that are this API's own: an extra descriptor with an empty route, no
//! tier or no cost inherits the request's; fields are named `key`, `descriptors[1].cost`,
//! `checks[3].route`; and the descriptor limit counts the extra descriptors.
//!
//! Requests are decoded as [`V1Request`] / [`V1BatchRequest`] and answers written from
//! [`CheckAnswer`] / [`BatchAnswer`]: the hand-written wire codec of this API lives
//! beside this file, in [`super::ringlimit_v1_wire`].

use super::answer_budget::AnswerBudget;
use super::front::Front;
use tonic::{Request, Status};

/// The wire types of this API's requests and answers, with their codec.
pub use super::ringlimit_v1_wire::{
    BatchAnswer, CheckAnswer, ReserveAnswer, Text, V1BatchRequest, V1Descriptor, V1Request,
};
use crate::check::reserve::{AcquireInput, CommitInput, ReserveInput};
use crate::check::{At, CheckInput, Checker, DescriptorInput, Descriptors, FieldNames, Leaf};
use crate::proto;
use crate::proto::v1_server::rate_limiter_server::RateLimiter;

/// The public gRPC face of a node.
#[derive(Debug, Clone)]
pub struct RateLimitService {
    checker: Checker,
    front: Front,
}

impl RateLimitService {
    /// A service deciding through `checker`.
    pub fn new(checker: Checker) -> Self {
        Self {
            checker,
            front: Front::new("ringlimit_check_duration_seconds"),
        }
    }

    /// Share `answers`, the node-wide budget of unsent bulk answers
    /// ([`super::answer_budget`]), with the node's other bulk front ends.
    pub fn with_answer_budget(mut self, answers: AnswerBudget) -> Self {
        self.front = self.front.with_answer_budget(answers);
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
pub(super) fn input(request: &V1Request) -> CheckInput<'_> {
    let own = DescriptorInput {
        key: request.key.as_str(),
        route: request.route.as_str(),
        tier: request.tier.as_ref().map(Text::as_str),
        cost: request.cost,
    };
    let mut descriptors = Descriptors::with_capacity(1 + request.descriptors.len());
    descriptors.push(own);
    descriptors.extend(request.descriptors.iter().map(|d| DescriptorInput {
        key: d.key.as_str(),
        route: if d.route.is_empty() {
            own.route
        } else {
            d.route.as_str()
        },
        tier: d.tier.as_ref().map(Text::as_str).or(own.tier),
        cost: d.cost.or(own.cost),
    }));
    CheckInput { descriptors }
}

#[tonic::async_trait]
impl RateLimiter for RateLimitService {
    async fn check(
        &self,
        request: Request<V1Request>,
    ) -> Result<tonic::Response<CheckAnswer>, Status> {
        let timed = self.front.start();
        let request = request.into_inner();
        let verdict = self.checker.check(&input(&request), &V1Names).await?;
        Ok(timed.answered(CheckAnswer { verdict }))
    }

    async fn check_batch(
        &self,
        request: Request<V1BatchRequest>,
    ) -> Result<tonic::Response<BatchAnswer>, Status> {
        let batch = request.into_inner();
        // One answer item per check and per descriptor (each echoes its key and route).
        let items: usize = batch.checks.iter().map(|c| 1 + c.descriptors.len()).sum();
        let held = self.front.hold(items)?;
        let timed = self.front.start();
        let inputs: Vec<CheckInput<'_>> = batch.checks.iter().map(input).collect();
        let verdicts = self.checker.check_batch(&inputs, &V1Names).await?;
        Ok(timed.answered_holding(BatchAnswer { verdicts }, held))
    }

    async fn topology(
        &self,
        _request: Request<proto::TopologyRequest>,
    ) -> Result<tonic::Response<proto::TopologyResponse>, Status> {
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
        Ok(tonic::Response::new(proto::TopologyResponse {
            members,
            vnodes: view.ring.vnodes(),
            placement_version: crate::ring::PLACEMENT,
            ring_digest: view.ring.digest(),
            node_id: self.checker.me().to_string(),
        }))
    }

    async fn reserve(
        &self,
        request: Request<proto::ReserveRequest>,
    ) -> Result<tonic::Response<ReserveAnswer>, Status> {
        let r = request.into_inner();
        let input = ReserveInput {
            key: &r.key,
            route: &r.route,
            tier: r.tier.as_deref(),
            amount: r.amount,
            ttl_ms: r.ttl_ms,
        };
        let reserved = self.checker.reserve(&input).await?;
        Ok(tonic::Response::new(ReserveAnswer { reserved }))
    }

    async fn commit(
        &self,
        request: Request<proto::CommitRequest>,
    ) -> Result<tonic::Response<proto::CommitResponse>, Status> {
        let r = request.into_inner();
        let input = CommitInput {
            reservation_id: &r.reservation_id,
            actual: r.actual,
        };
        let committed = self.checker.commit(&input).await?;
        let s = &committed.settled;
        let (limit, remaining) = crate::check::reserve::after(s);
        Ok(tonic::Response::new(proto::CommitResponse {
            returned: s.returned,
            charged: s.charged,
            uncharged: s.uncharged,
            moved: s.moved,
            decider: Some(proto::Decider {
                node_id: committed.decider.node_id.to_string(),
                generation: committed.decider.generation,
            }),
            limit,
            remaining,
            rule: committed.rule,
        }))
    }

    async fn acquire(
        &self,
        request: Request<proto::AcquireRequest>,
    ) -> Result<tonic::Response<ReserveAnswer>, Status> {
        let r = request.into_inner();
        let input = AcquireInput {
            key: &r.key,
            route: &r.route,
            tier: r.tier.as_deref(),
            ttl_ms: r.ttl_ms,
        };
        let reserved = self.checker.acquire(&input).await?;
        Ok(tonic::Response::new(ReserveAnswer { reserved }))
    }

    async fn release(
        &self,
        request: Request<proto::ReleaseRequest>,
    ) -> Result<tonic::Response<proto::ReleaseResponse>, Status> {
        let released = self.checker.release(&request.into_inner().lease_id).await?;
        let s = &released.settled;
        let (limit, remaining) = crate::check::reserve::after(s);
        Ok(tonic::Response::new(proto::ReleaseResponse {
            released: s.returned > 0,
            moved: s.moved,
            decider: Some(proto::Decider {
                node_id: released.decider.node_id.to_string(),
                generation: released.decider.generation,
            }),
            limit,
            remaining,
            rule: released.rule,
        }))
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::check::plan::{plan_check, MAX_DESCRIPTORS};
    use crate::check::CheckError;
    use crate::config::rules::RuleSet;

    fn request(key: &str, route: &str) -> V1Request {
        V1Request {
            key: key.into(),
            route: route.into(),
            ..Default::default()
        }
    }

    /// The error `plan_check` gives for `r` (as check `batch` of a batch, if any).
    fn refused(r: &V1Request, batch: Option<usize>) -> CheckError {
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
        r.descriptors = vec![V1Descriptor {
            key: "ip:10.0.0.1".into(),
            ..Default::default()
        }];
        let planned = plan_check(&input(&r), &RuleSet::builtin(), None, &V1Names).unwrap();
        assert_eq!(planned[1].route(), "GET /x");
        assert_eq!(planned[1].cost.get(), 3);
        assert_eq!(planned[1].tier.as_deref(), Some("gold"));
        r.descriptors[0].cost = Some(0);
        assert_eq!(field(refused(&r, None)), "descriptors[0].cost");
        r.descriptors[0].cost = None;
        r.descriptors[0].key = Text::default();
        assert_eq!(field(refused(&r, Some(1))), "checks[1].descriptors[0].key");
    }

    #[test]
    fn too_many_descriptors_are_refused_counting_the_extra_ones() {
        let mut r = request("a", "/x");
        r.descriptors = (0..MAX_DESCRIPTORS)
            .map(|i| V1Descriptor {
                key: Text::from(format!("ip{i}").as_str()),
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
