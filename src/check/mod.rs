//! The check, independent of any wire: input → validate and plan → decide → verdict.
//!
//! Every front end (`ringlimit.v1`, Envoy's RLS, Gubernator's V1) is one mapping file
//! in `server` that turns its messages into a [`CheckInput`], calls the
//! [`Checker`], and turns the [`Verdict`] back into its messages. Validation, rule
//! matching, the refund of sibling descriptors and the combination of descriptor answers
//! into one verdict live here, once, so a new front end cannot get them subtly wrong.
//!
//! - [`plan`]: validation with field paths named by the front end ([`FieldNames`]),
//!   rule matching, and each counter's identity, computed once.
//! - [`verdict`]: the pure combination of descriptor answers into the overall verdict.
//! - [`forwarded`]: what a peer forwards (checks, refunds), re-planned by the owner with
//!   the same code.
//! - [`reserve`]: `Reserve` and `Commit` (units charged now for work priced after it
//!   is done), planned like a one-descriptor check and sent to the key's owner.
//! - [`throttle`]: redis-cell's `CL.THROTTLE` (a GCRA limit each call carries).
//! - [`Checker`]: plans a batch (refusing all of it, with nothing charged, if any part
//!   is invalid) and has the cluster decide it.
//!
//! The input is plain borrowed data. Envoy's domain checks ([`domain`]) and
//! Gubernator's rate limits ([`gubernator`]), whose rule a request carries inline, have
//! inputs of their own; both plan the same [`CheckItem`](crate::cluster::CheckItem)s,
//! which carry their rule, so neither needs a new path below planning.

pub mod domain;
pub mod forwarded;
pub mod gubernator;
pub mod inline;
pub mod plan;
pub mod reserve;
pub mod throttle;
pub mod verdict;

use std::sync::Arc;

use crate::cluster::Router;
use crate::config::{SharedEnvoy, SharedRules};
use crate::shard::ShardError;
pub use domain::{DomainInput, DomainStatus, DomainVerdict, EntriesInput, LimitOverride};
pub use plan::{At, FieldNames, Leaf};
pub use verdict::Verdict;

/// One descriptor to check, as a front end hands it over: wire-independent and
/// borrowed from the request, so mapping a request onto it copies nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescriptorInput<'a> {
    /// Who is limited: customer id, API key, IP (1..=256 bytes).
    pub key: &'a str,
    /// `METHOD /path` or `/path`.
    pub route: &'a str,
    /// Optional tier name (1..=64 bytes when set).
    pub tier: Option<&'a str>,
    /// Units to charge; `None` is 1. Zero and negatives are refused: zero would admit
    /// for ever and a negative would refund.
    pub cost: Option<i64>,
}

/// One check: allowed only if every descriptor allows it, and when one denies, the
/// descriptors that allowed are refunded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckInput<'a> {
    /// 1..=[`plan::MAX_DESCRIPTORS`] descriptors, in the order the front end reports them.
    /// Inline for the common single-descriptor check, so mapping one allocates nothing.
    pub descriptors: Descriptors<'a>,
}

/// The descriptors of one check.
pub type Descriptors<'a> = smallvec::SmallVec<[DescriptorInput<'a>; 1]>;

/// Why a check could not be decided.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CheckError {
    /// The request is malformed; nothing was charged. `field` is a path into the
    /// request as the front end names it (e.g. `descriptors[1].cost`, `checks[3].key`).
    #[error("{field}: {reason}")]
    InvalidArgument {
        /// Where in the request the problem is.
        field: String,
        /// What is wrong, in words a caller can act on.
        reason: String,
    },
    /// The deciding shard could not answer.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// A descriptor's owner could not be reached and its rule fails closed; said as
    /// such (gRPC `UNAVAILABLE`) by front ends whose callers have their own failure mode
    /// (Envoy's `failure_mode_deny`). Nothing stays charged: the others were refunded.
    #[error("descriptors[{descriptor}]: the owner of its counter is unreachable and rule \"{rule}\" fails closed")]
    Unavailable {
        /// Index of the descriptor in the request.
        descriptor: usize,
        /// Its rule.
        rule: String,
    },
    /// What the request names cannot be acted on (a reservation already committed,
    /// expired, or never made); nothing changed. gRPC `FAILED_PRECONDITION`.
    #[error("{field}: {reason}")]
    Refused {
        /// The field naming it.
        field: String,
        /// Why, in words a caller can act on.
        reason: String,
    },
    /// A bounded table on the deciding node is full (its open reservations); nothing
    /// was charged. gRPC `RESOURCE_EXHAUSTED`.
    #[error("{0}")]
    Exhausted(String),
    /// The node that must decide (a reservation's owner) could not be reached, and
    /// nothing else may decide in its place. gRPC `UNAVAILABLE`.
    #[error("{0}")]
    Unreachable(String),
}

impl CheckError {
    /// Shorthand for an invalid-argument error.
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// `ringlimit_shadow_denials_total{rule}`: what a rule in shadow mode would have denied.
/// The label is bounded by the rule set (fail-open stand-ins count under their rule).
fn count_shadow_denials(verdict: &Verdict) {
    for d in verdict.descriptors.iter().filter(|d| d.shadow_denied()) {
        let rule = d.item.rule.base_name();
        metrics::counter!("ringlimit_shadow_denials_total", "rule" => rule.to_string())
            .increment(1);
    }
}

/// The verdict of one decided check, its shadow denials counted.
fn verdict(decided: crate::cluster::Decided) -> Verdict {
    let verdict = Verdict::combine(decided);
    if verdict.shadow_denied {
        count_shadow_denials(&verdict);
    }
    verdict
}

/// Decides checks for every front end: the seam under all of them.
#[derive(Debug, Clone)]
pub struct Checker {
    router: Arc<Router>,
    rules: SharedRules,
    envoy: SharedEnvoy,
    /// The Gubernator limits this node has planned (bounded: see
    /// [`gubernator::MAX_INLINE_RULES`]), shared by every clone.
    inline: Arc<gubernator::InlineRules>,
}

impl Checker {
    /// A checker matching against `rules` and deciding through `router`.
    pub fn new(router: Arc<Router>, rules: SharedRules) -> Self {
        Self {
            router,
            rules,
            envoy: SharedEnvoy::default(),
            inline: Arc::default(),
        }
    }

    /// This checker keeping the Gubernator limits it plans in `inline` (the node's one
    /// registry, shared with its peer service and peer pool so those counters can be
    /// handed over).
    pub fn with_inline(mut self, inline: Arc<gubernator::InlineRules>) -> Self {
        self.inline = inline;
        self
    }

    /// This checker matching domain checks against `envoy`.
    pub fn with_envoy(mut self, envoy: SharedEnvoy) -> Self {
        self.envoy = envoy;
        self
    }

    /// Decide one request by domain and descriptor entries (Envoy's rate limit
    /// service): see [`domain`]. Its counted descriptors are one check for the router,
    /// so the ones that allowed are refunded when another denies.
    pub async fn check_domain(&self, input: &DomainInput<'_>) -> Result<DomainVerdict, CheckError> {
        let plan = domain::plan_domain(input, &self.envoy.load())?;
        // Shadow limits that could never admit are never asked: counted here.
        for p in &plan.descriptors {
            if let domain::Planned::Refused(limit) = p {
                if limit.shadow {
                    metrics::counter!("ringlimit_shadow_denials_total", "rule" => limit.name.to_string())
                        .increment(1);
                }
            }
        }
        if plan.items.is_empty() {
            return Ok(domain::domain_verdict(plan, &[]));
        }
        let items = plan.items.iter().cloned().collect();
        let mut decided = self.router.decide(smallvec::smallvec![items]).await?;
        let verdict = Verdict::combine(decided.pop().expect("one answer per check"));
        // Shadow denials, counted here rather than by `verdict`: a quota-mode limit's
        // rule is shadowed for the cluster, and its denials are not shadow denials.
        for p in &plan.descriptors {
            if let domain::Planned::Counted { limit, item, .. } = p {
                let d = &verdict.descriptors[*item];
                if limit.shadow && d.shadow_denied() {
                    metrics::counter!("ringlimit_shadow_denials_total", "rule" => d.item.rule.base_name().to_string())
                        .increment(1);
                }
            }
        }
        if let Some(error) = self.unavailable(&verdict, |i| plan.request_index(i)) {
            return Err(error);
        }
        Ok(domain::domain_verdict(plan, &verdict.descriptors))
    }

    /// Decide Gubernator rate limits (`GetRateLimits`): see [`gubernator`]. Each item is
    /// a check of its own (one denying refunds nothing of another), and each invalid or
    /// undecidable item is an error of its own: the others are still decided. At most
    /// [`gubernator::MAX_ITEMS`] items, else the whole call is refused.
    pub async fn check_gubernator(
        &self,
        inputs: &[gubernator::RateLimitInput<'_>],
    ) -> Result<Vec<Result<gubernator::RateLimitStatus, CheckError>>, CheckError> {
        if inputs.len() > gubernator::MAX_ITEMS {
            return Err(CheckError::invalid(
                "requests",
                format!(
                    "{} items in one call; at most {} are allowed",
                    inputs.len(),
                    gubernator::MAX_ITEMS
                ),
            ));
        }
        let planned = inputs
            .iter()
            .map(|input| gubernator::plan_item(input, &self.inline))
            .collect();
        self.decide_each(planned, |p| &p.item, gubernator::status)
            .await
    }

    /// Decide independent one-descriptor checks (Gubernator items, `CL.THROTTLE`
    /// calls) in one batch: each planning error stays that item's error, the valid
    /// items are decided together, and each answer becomes `answer(planned, outcome)`
    /// (or that item's error when its owner could not be reached).
    async fn decide_each<P, R>(
        &self,
        planned: Vec<Result<P, CheckError>>,
        item: impl Fn(&P) -> &crate::cluster::CheckItem,
        answer: impl Fn(&P, &crate::cluster::DescriptorOutcome) -> R,
    ) -> Result<Vec<Result<R, CheckError>>, CheckError> {
        let checks: crate::cluster::Checks = planned
            .iter()
            .filter_map(|p| {
                p.as_ref()
                    .ok()
                    .map(|p| smallvec::smallvec![item(p).clone()])
            })
            .collect();
        let mut verdicts = if checks.is_empty() {
            Vec::new()
        } else {
            self.decide(checks).await?
        }
        .into_iter();
        Ok(planned
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                let p = p?;
                let verdict = verdicts.next().expect("one verdict per valid item");
                if let Some(error) = self.unavailable(&verdict, |_| i) {
                    return Err(error);
                }
                Ok(answer(&p, &verdict.descriptors[0]))
            })
            .collect())
    }

    /// Decide `CL.THROTTLE` calls (redis-cell's): see [`throttle`]. Each call is a check
    /// of its own, as a Gubernator item is, and each invalid or undecidable call is an
    /// error of its own: the others are still decided. At most [`throttle::MAX_CALLS`]
    /// calls, else the whole batch is refused.
    pub async fn check_throttle(
        &self,
        inputs: &[throttle::ThrottleInput<'_>],
    ) -> Result<Vec<Result<throttle::ThrottleReply, CheckError>>, CheckError> {
        forwarded::at_most("calls", inputs.len(), throttle::MAX_CALLS)?;
        let planned = inputs
            .iter()
            .map(|input| throttle::plan_throttle(input, &self.inline))
            .collect();
        self.decide_each(planned, |p| &p.item, throttle::reply)
            .await
    }

    /// The refusal of a check one of whose descriptors' owner could not be reached
    /// under a rule that fails closed (said as `UNAVAILABLE` by the front ends whose
    /// callers have a failure mode of their own); `index` maps the verdict's descriptor
    /// to its place in the request.
    fn unavailable(
        &self,
        verdict: &Verdict,
        index: impl FnOnce(usize) -> usize,
    ) -> Option<CheckError> {
        let me = self.router.me();
        let i = verdict
            .descriptors
            .iter()
            .position(|d| crate::cluster::policy::is_fail_closed(&d.answer, me))?;
        Some(CheckError::Unavailable {
            descriptor: index(i),
            rule: verdict.descriptors[i].item.rule.name.to_string(),
        })
    }

    /// The cluster as this node sees it (members, ring), for the read-only topology
    /// answer a ring-aware client places keys with.
    pub fn view(&self) -> Arc<crate::membership::ClusterView> {
        self.router.view()
    }

    /// This node's id.
    pub fn me(&self) -> &str {
        &self.router.me().node_id
    }

    /// Decide one check.
    pub async fn check(
        &self,
        input: &CheckInput<'_>,
        names: &dyn FieldNames,
    ) -> Result<Verdict, CheckError> {
        let rules = self.rules.load();
        let planned = plan::plan_check(input, &rules, None, names)?;
        let mut decided = self.router.decide(smallvec::smallvec![planned]).await?;
        Ok(verdict(decided.pop().expect("one answer per check")))
    }

    /// Decide a batch of independent checks, each exactly as [`Checker::check`] would.
    /// If any check is invalid the whole batch is refused and nothing is charged.
    pub async fn check_batch(
        &self,
        inputs: &[CheckInput<'_>],
        names: &dyn FieldNames,
    ) -> Result<Vec<Verdict>, CheckError> {
        let planned = plan::plan_batch(inputs, &self.rules.load(), names)?;
        self.decide(planned.into()).await
    }

    async fn decide(&self, planned: crate::cluster::Checks) -> Result<Vec<Verdict>, CheckError> {
        let decided = self.router.decide(planned).await?;
        Ok(decided.into_iter().map(verdict).collect())
    }
}
