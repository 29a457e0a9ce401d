//! Turning a wire request into validated descriptors, and descriptors' outcomes back
//! into a wire response. Pure: no I/O, so every bad-input rule is unit-tested here.
//!
//! Nothing is charged for a request that fails validation: parsing and rule matching
//! finish for the whole request (or the whole batch) before any shard is asked.

use std::num::NonZeroU64;
use std::sync::Arc;

use crate::config::route::Route;
use crate::config::rules::RuleSet;
use crate::error::CheckError;
use crate::proto;
use crate::server::router::Answer;
use crate::shard::CheckItem;

/// Longest client key accepted, in bytes. Keys are stored per counter; a bound keeps
/// one caller from spending the node's memory on key bytes.
pub const MAX_KEY_BYTES: usize = 256;
/// Longest tier name accepted, in bytes.
pub const MAX_TIER_BYTES: usize = 64;
/// Descriptors per check, the request's own (key, route) included.
pub const MAX_DESCRIPTORS: usize = 8;
/// Checks per `CheckBatch` call.
pub const MAX_BATCH: usize = 1000;
/// Largest cost accepted at all (a rule may admit less: see `Limiter::max_cost`).
pub const MAX_COST: i64 = 1_000_000_000;

/// One validated descriptor with its matched rule: ready for a shard.
pub type Planned = CheckItem;

/// Validate one check and match every descriptor to its rule.
///
/// `at` prefixes field names (`""` for `Check`, `"checks[3]."` inside a batch).
pub fn plan_check(
    request: &proto::CheckRequest,
    rules: &RuleSet,
    at: &str,
) -> Result<Vec<Planned>, CheckError> {
    let total = 1 + request.descriptors.len();
    if total > MAX_DESCRIPTORS {
        return Err(CheckError::invalid(
            format!("{at}descriptors"),
            format!(
                "{} descriptors given; at most {} are allowed per check, the request's own key included",
                request.descriptors.len(),
                MAX_DESCRIPTORS - 1
            ),
        ));
    }
    let top = Field {
        at,
        descriptor: None,
    };
    let route = parse_route(&request.route, top, "route")?;
    let tier = parse_tier(request.tier.as_deref(), top, "tier")?;
    let cost = parse_cost(request.cost, top, "cost")?;
    let mut planned = Vec::with_capacity(total);
    planned.push(plan_one(
        rules,
        &request.key,
        &request.route,
        &route,
        tier,
        cost,
        top,
    )?);
    for (i, descriptor) in request.descriptors.iter().enumerate() {
        let field = Field {
            at,
            descriptor: Some(i),
        };
        let (route_text, route) = if descriptor.route.is_empty() {
            (request.route.as_str(), route)
        } else {
            (
                descriptor.route.as_str(),
                parse_route(&descriptor.route, field, "route")?,
            )
        };
        let tier = match descriptor.tier.as_deref() {
            Some(t) => parse_tier(Some(t), field, "tier")?,
            None => tier,
        };
        let cost = match descriptor.cost {
            Some(c) => parse_cost(Some(c), field, "cost")?,
            None => cost,
        };
        planned.push(plan_one(
            rules,
            &descriptor.key,
            route_text,
            &route,
            tier,
            cost,
            field,
        )?);
    }
    Ok(planned)
}

/// Where in a request a value sits; the path string is only built for an error, so a
/// valid request pays nothing for the field names.
#[derive(Clone, Copy)]
struct Field<'a> {
    /// `""` or `"checks[3]."`.
    at: &'a str,
    /// Index into `descriptors`, for the extra descriptors.
    descriptor: Option<usize>,
}

impl Field<'_> {
    fn name(self, leaf: &str) -> String {
        match self.descriptor {
            Some(i) => format!("{}descriptors[{i}].{leaf}", self.at),
            None => format!("{}{leaf}", self.at),
        }
    }
}

fn plan_one(
    rules: &RuleSet,
    key: &str,
    route_text: &str,
    route: &Route,
    tier: Option<&str>,
    cost: NonZeroU64,
    field: Field<'_>,
) -> Result<Planned, CheckError> {
    if key.is_empty() {
        return Err(CheckError::invalid(field.name("key"), "must not be empty"));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(CheckError::invalid(
            field.name("key"),
            format!("{} bytes is over the limit of {MAX_KEY_BYTES}", key.len()),
        ));
    }
    let rule = rules.matching(key, tier, Some(route));
    let max_cost = rule.limiter.max_cost();
    if cost.get() > max_cost {
        return Err(CheckError::invalid(
            field.name("cost"),
            format!(
                "cost {cost} can never be admitted: rule \"{}\" admits at most {max_cost} at once",
                rule.name
            ),
        ));
    }
    Ok(CheckItem {
        rule: rule.clone(),
        client: Arc::from(key),
        route: Arc::from(route_text),
        tier: tier.map(Arc::from),
        cost,
    })
}

/// Validate and plan one descriptor forwarded by a peer (`items[i]`). The sending node
/// validated it already; the owner re-matches the rule with its own rule set, which is
/// the same file everywhere except for a moment during a reload.
pub fn plan_forwarded(
    item: &crate::proto::peer::ForwardItem,
    rules: &RuleSet,
    index: usize,
) -> Result<Planned, CheckError> {
    let field = |name: &str| format!("items[{index}].{name}");
    let route = Route::parse(&item.route)
        .map_err(|e| CheckError::invalid(field("route"), e.to_string()))?;
    let tier = item.tier.as_deref();
    let cost = NonZeroU64::new(item.cost)
        .filter(|c| c.get() <= MAX_COST as u64)
        .ok_or_else(|| CheckError::invalid(field("cost"), "must be 1..=1000000000"))?;
    let rule = rules.matching(&item.key, tier, Some(&route));
    if item.key.is_empty() || item.key.len() > MAX_KEY_BYTES {
        return Err(CheckError::invalid(field("key"), "must be 1..=256 bytes"));
    }
    // A cost the owner's rule can never admit is decided (denied) rather than refused:
    // the sender's rule admitted it, so the rule sets differ for a moment.
    Ok(CheckItem {
        rule: rule.clone(),
        client: Arc::from(item.key.as_str()),
        route: Arc::from(item.route.as_str()),
        tier: tier.map(Arc::from),
        cost,
    })
}

fn parse_route<'a>(text: &'a str, field: Field<'_>, leaf: &str) -> Result<Route<'a>, CheckError> {
    Route::parse(text).map_err(|e| CheckError::invalid(field.name(leaf), e.to_string()))
}

fn parse_tier<'a>(
    tier: Option<&'a str>,
    field: Field<'_>,
    leaf: &str,
) -> Result<Option<&'a str>, CheckError> {
    match tier {
        None => Ok(None),
        Some("") => Err(CheckError::invalid(
            field.name(leaf),
            "must not be empty when set",
        )),
        Some(t) if t.len() > MAX_TIER_BYTES => Err(CheckError::invalid(
            field.name(leaf),
            format!("{} bytes is over the limit of {MAX_TIER_BYTES}", t.len()),
        )),
        Some(t) => Ok(Some(t)),
    }
}

fn parse_cost(cost: Option<i64>, field: Field<'_>, leaf: &str) -> Result<NonZeroU64, CheckError> {
    match cost {
        None => Ok(NonZeroU64::MIN),
        Some(c) if c < 1 => Err(CheckError::invalid(
            field.name(leaf),
            format!("must be a positive integer (got {c}); a cost of 0 would admit for ever and a negative one would refund"),
        )),
        Some(c) if c > MAX_COST => Err(CheckError::invalid(
            field.name(leaf),
            format!("{c} is over the limit of {MAX_COST}"),
        )),
        Some(c) => Ok(NonZeroU64::new(c as u64).expect("checked positive")),
    }
}

/// Combine per-descriptor answers into one response.
///
/// `refunded[i]` marks allowed descriptors given back because another denied. The
/// overall numbers are the most restrictive descriptor's: the denying one with the
/// longest wait when denied, else the one with the least remaining.
pub fn respond(planned: &[Planned], answers: &[Answer], refunded: &[bool]) -> proto::CheckResponse {
    let allowed = answers.iter().all(|a| a.decision.allowed);
    let chosen = if allowed {
        (0..answers.len()).min_by_key(|&i| answers[i].decision.remaining)
    } else {
        (0..answers.len())
            .filter(|&i| !answers[i].decision.allowed)
            .max_by_key(|&i| answers[i].decision.retry_after_ms)
    }
    .unwrap_or(0);
    let descriptors: Vec<proto::DescriptorResult> = planned
        .iter()
        .zip(answers)
        .zip(refunded)
        .map(|((item, answer), &refunded)| {
            let d = &answer.decision;
            proto::DescriptorResult {
                key: item.client.to_string(),
                route: item.route.to_string(),
                allowed: d.allowed,
                limit: d.limit,
                remaining: d.remaining,
                retry_after_ms: d.retry_after_ms,
                reset_at: d.reset_at_ms.min(i64::MAX as u64) as i64,
                rule: answer.rule.to_string(),
                algorithm: answer.algorithm.to_string(),
                window_id: d.window_id,
                sequence: answer.sequence,
                decider: Some(proto::Decider {
                    node_id: answer.decider.node_id.to_string(),
                    generation: answer.decider.generation,
                }),
                degraded: answer.degraded,
                delay_ms: d.delay_ms,
                refunded,
                hops: answer.hops,
            }
        })
        .collect();
    let top = &descriptors[chosen];
    proto::CheckResponse {
        allowed,
        limit: top.limit,
        remaining: if allowed { top.remaining } else { 0 },
        retry_after_ms: top.retry_after_ms,
        reset_at: top.reset_at,
        rule: top.rule.clone(),
        decider: top.decider.clone(),
        window_id: top.window_id,
        sequence: top.sequence,
        degraded: descriptors.iter().any(|d| d.degraded),
        delay_ms: if allowed {
            descriptors.iter().map(|d| d.delay_ms).max().unwrap_or(0)
        } else {
            0
        },
        descriptors,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(key: &str, route: &str) -> proto::CheckRequest {
        proto::CheckRequest {
            key: key.into(),
            route: route.into(),
            ..Default::default()
        }
    }

    fn invalid_field(result: Result<Vec<Planned>, CheckError>) -> String {
        match result {
            Err(CheckError::InvalidArgument { field, .. }) => field,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn a_plain_request_plans_one_item_with_cost_one_on_the_default_rule() {
        let rules = RuleSet::builtin();
        let planned = plan_check(&request("cust_42", "POST /v1/charges"), &rules, "").unwrap();
        assert_eq!(planned.len(), 1);
        assert_eq!(planned[0].cost.get(), 1);
        assert_eq!(&*planned[0].rule.name, "default");
        assert_eq!(&*planned[0].client, "cust_42");
    }

    #[test]
    fn an_empty_key_is_refused_naming_the_field() {
        let rules = RuleSet::builtin();
        assert_eq!(
            invalid_field(plan_check(&request("", "/x"), &rules, "")),
            "key"
        );
    }

    #[test]
    fn an_oversized_key_is_refused() {
        let rules = RuleSet::builtin();
        let key = "k".repeat(MAX_KEY_BYTES + 1);
        assert_eq!(
            invalid_field(plan_check(&request(&key, "/x"), &rules, "")),
            "key"
        );
        let key = "k".repeat(MAX_KEY_BYTES);
        assert!(plan_check(&request(&key, "/x"), &rules, "").is_ok());
    }

    #[test]
    fn zero_negative_and_absurd_costs_are_refused() {
        let rules = RuleSet::builtin();
        for cost in [0, -1, i64::MIN, MAX_COST + 1] {
            let mut r = request("a", "/x");
            r.cost = Some(cost);
            assert_eq!(
                invalid_field(plan_check(&r, &rules, "")),
                "cost",
                "cost {cost}"
            );
        }
    }

    #[test]
    fn a_cost_the_rule_can_never_admit_is_refused() {
        let rules = RuleSet::builtin();
        let mut r = request("a", "/x");
        r.cost = Some(101);
        let err = plan_check(&r, &rules, "").unwrap_err().to_string();
        assert!(err.contains("can never be admitted"), "{err}");
        r.cost = Some(100);
        assert!(plan_check(&r, &rules, "").is_ok());
    }

    #[test]
    fn bad_route_syntax_is_refused() {
        let rules = RuleSet::builtin();
        for route in ["", "charges", "get /x", "POST  /x"] {
            assert_eq!(
                invalid_field(plan_check(&request("a", route), &rules, "")),
                "route",
                "{route:?}"
            );
        }
    }

    #[test]
    fn an_empty_tier_is_refused() {
        let rules = RuleSet::builtin();
        let mut r = request("a", "/x");
        r.tier = Some(String::new());
        assert_eq!(invalid_field(plan_check(&r, &rules, "")), "tier");
        r.tier = Some("t".repeat(MAX_TIER_BYTES + 1));
        assert_eq!(invalid_field(plan_check(&r, &rules, "")), "tier");
    }

    #[test]
    fn too_many_descriptors_are_refused() {
        let rules = RuleSet::builtin();
        let mut r = request("a", "/x");
        r.descriptors = (0..MAX_DESCRIPTORS)
            .map(|i| proto::Descriptor {
                key: format!("ip{i}"),
                ..Default::default()
            })
            .collect();
        assert_eq!(invalid_field(plan_check(&r, &rules, "")), "descriptors");
        r.descriptors.pop();
        assert_eq!(plan_check(&r, &rules, "").unwrap().len(), MAX_DESCRIPTORS);
    }

    #[test]
    fn extra_descriptors_inherit_route_tier_and_cost_and_name_their_own_fields() {
        let rules = RuleSet::builtin();
        let mut r = request("a", "GET /x");
        r.cost = Some(3);
        r.descriptors = vec![proto::Descriptor {
            key: "ip:10.0.0.1".into(),
            ..Default::default()
        }];
        let planned = plan_check(&r, &rules, "").unwrap();
        assert_eq!(&*planned[1].route, "GET /x");
        assert_eq!(planned[1].cost.get(), 3);
        r.descriptors[0].cost = Some(0);
        assert_eq!(
            invalid_field(plan_check(&r, &rules, "")),
            "descriptors[0].cost"
        );
        r.descriptors[0].cost = None;
        r.descriptors[0].key = String::new();
        assert_eq!(
            invalid_field(plan_check(&r, &rules, "")),
            "descriptors[0].key"
        );
    }

    #[test]
    fn batch_fields_carry_the_check_index() {
        let rules = RuleSet::builtin();
        assert_eq!(
            invalid_field(plan_check(&request("", "/x"), &rules, "checks[3].")),
            "checks[3].key"
        );
    }
}
