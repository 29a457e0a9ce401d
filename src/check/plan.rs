//! Validation and planning: a check's input becomes descriptors ready for a shard, each
//! with its matched rule and its counter identity, or a clear error naming the field.
//!
//! The identity is (rule, client key, route part): the route part is empty unless the
//! matched rule counts per route, and then it is the normalised route (method + path, the
//! query string and fragment stripped by `Route::parse`). A forwarded check is planned
//! again by its owner from the key and route as sent, so both sides compute the same one.
//!
//! Pure: no I/O and no wire types, so every bad-input rule is unit-tested here once for
//! every front end. The front end says how its fields are named ([`FieldNames`]); the
//! path string is only built for an error, so a valid request pays nothing for it.
//!
//! Nothing is charged for a request that fails validation: planning finishes for the
//! whole request (or the whole batch) before any shard is asked.

use std::num::NonZeroU64;

use crate::check::{CheckError, CheckInput, DescriptorInput};
use crate::cluster::CheckItem;
use crate::config::route::Route;
use crate::config::rules::RuleSet;

use crate::config::bounds::{self, Text};
/// The bounds a check's input is held to, defined once for every front end and the
/// peer face (`config::bounds`).
pub use crate::config::bounds::{
    MAX_BATCH, MAX_COST, MAX_DESCRIPTORS, MAX_KEY_BYTES, MAX_TIER_BYTES,
};

/// A field of one descriptor that validation can refuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leaf {
    /// The client key.
    Key,
    /// The route.
    Route,
    /// The tier.
    Tier,
    /// The cost.
    Cost,
}

impl Leaf {
    /// The field's name in `ringlimit.v1` and in the peer API.
    pub fn as_str(self) -> &'static str {
        match self {
            Leaf::Key => "key",
            Leaf::Route => "route",
            Leaf::Tier => "tier",
            Leaf::Cost => "cost",
        }
    }
}

/// Where in a request a value sits: which check of a batch (`None` for a single
/// check) and which of its descriptors (0 is the first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct At {
    /// Index of the check in a batch; `None` outside a batch.
    pub check: Option<usize>,
    /// Index of the descriptor within the check.
    pub descriptor: usize,
}

/// How a front end names its fields in error messages, so a caller reads a path into
/// the message it actually sent (`checks[3].descriptors[1].cost`), whatever the wire.
pub trait FieldNames: Sync {
    /// The path of `leaf` of the descriptor at `at`.
    fn field(&self, at: At, leaf: Leaf) -> String;

    /// The path of a check's descriptor list.
    fn descriptors(&self, check: Option<usize>) -> String;

    /// The path of a batch's check list.
    fn checks(&self) -> String {
        "checks".into()
    }

    /// Why `given` descriptors in one check are too many (`max` allowed), in the
    /// front end's own way of counting them.
    fn too_many_descriptors(&self, given: usize, max: usize) -> String {
        format!("{given} descriptors in one check; at most {max} are allowed")
    }
}

/// Validate one check and match every descriptor to its rule.
pub fn plan_check(
    input: &CheckInput<'_>,
    rules: &RuleSet,
    check: Option<usize>,
    names: &dyn FieldNames,
) -> Result<crate::cluster::Items, CheckError> {
    if input.descriptors.len() > MAX_DESCRIPTORS {
        return Err(CheckError::invalid(
            names.descriptors(check),
            names.too_many_descriptors(input.descriptors.len(), MAX_DESCRIPTORS),
        ));
    }
    if input.descriptors.is_empty() {
        return Err(CheckError::invalid(
            names.descriptors(check),
            "a check needs at least one descriptor",
        ));
    }
    input
        .descriptors
        .iter()
        .enumerate()
        .map(|(descriptor, d)| {
            let at = At { check, descriptor };
            plan_descriptor(d, rules, |leaf| names.field(at, leaf))
        })
        .collect()
}

/// Validate a batch of checks: at most [`MAX_BATCH`], each planned as [`plan_check`]
/// would (named as check `i` of the batch). Any invalid check refuses the whole batch.
pub fn plan_batch(
    inputs: &[CheckInput<'_>],
    rules: &RuleSet,
    names: &dyn FieldNames,
) -> Result<Vec<crate::cluster::Items>, CheckError> {
    if inputs.len() > MAX_BATCH {
        return Err(CheckError::invalid(
            names.checks(),
            format!(
                "{} checks in one batch; at most {MAX_BATCH} are allowed",
                inputs.len()
            ),
        ));
    }
    inputs
        .iter()
        .enumerate()
        .map(|(i, input)| plan_check(input, rules, Some(i), names))
        .collect()
}

/// Validate and plan one descriptor forwarded by a peer. The sending node validated it
/// already, with the same rules; the owner re-matches it against its own rule set,
/// which is the same file everywhere except for a moment during a reload.
///
/// One difference from a client's check: a cost the owner's rule can never admit is
/// decided (denied) rather than refused, since the sender's rule admitted it and
/// refusing would fail every other check of the forwarded batch.
pub fn plan_forwarded(
    input: &DescriptorInput<'_>,
    rules: &RuleSet,
    name: impl Fn(Leaf) -> String,
) -> Result<CheckItem, CheckError> {
    validated(input, rules, &name)
}

/// A client's descriptor: validated, matched, and refused if its rule could never
/// admit its cost (it could only ever be denied).
fn plan_descriptor(
    input: &DescriptorInput<'_>,
    rules: &RuleSet,
    name: impl Fn(Leaf) -> String,
) -> Result<CheckItem, CheckError> {
    let item = validated(input, rules, &name)?;
    let max_cost = item.rule.limiter.max_cost();
    if item.cost.get() > max_cost {
        return Err(CheckError::invalid(
            name(Leaf::Cost),
            format!(
                "cost {} can never be admitted: rule \"{}\" admits at most {max_cost} at once",
                item.cost, item.rule.name
            ),
        ));
    }
    Ok(item)
}

/// The checks every descriptor passes, in the order their errors are reported (route,
/// tier, cost, key), then its rule.
fn validated(
    input: &DescriptorInput<'_>,
    rules: &RuleSet,
    name: &impl Fn(Leaf) -> String,
) -> Result<CheckItem, CheckError> {
    let route = parse_route(input.route, name)?;
    let tier = parse_tier(input.tier, name)?;
    let cost = parse_cost(input.cost, name)?;
    parse_key(input.key, name)?;
    let rule = rules.matching(input.key, tier, Some(&route));
    Ok(CheckItem::new(rule.clone(), input.key, route, tier, cost))
}

fn parse_key(key: &str, name: impl Fn(Leaf) -> String) -> Result<(), CheckError> {
    bounded(Text::Key, key, || name(Leaf::Key))
}

/// Check one bounded text of kind `kind`, naming the field (built only on a refusal).
pub fn bounded(kind: Text, value: &str, field: impl FnOnce() -> String) -> Result<(), CheckError> {
    bounds::text(kind, value).map_err(|e| CheckError::invalid(field(), e.to_string()))
}

fn parse_route<'a>(text: &'a str, name: impl Fn(Leaf) -> String) -> Result<Route<'a>, CheckError> {
    Route::parse(text).map_err(|e| CheckError::invalid(name(Leaf::Route), e.to_string()))
}

fn parse_tier(
    tier: Option<&str>,
    name: impl Fn(Leaf) -> String,
) -> Result<Option<&str>, CheckError> {
    match tier {
        None => Ok(None),
        Some("") => Err(CheckError::invalid(
            name(Leaf::Tier),
            "must not be empty when set",
        )),
        Some(t) => bounded(Text::Tier, t, || name(Leaf::Tier)).map(|()| Some(t)),
    }
}

fn parse_cost(cost: Option<i64>, name: impl Fn(Leaf) -> String) -> Result<NonZeroU64, CheckError> {
    match cost {
        None => Ok(NonZeroU64::MIN),
        Some(c) if c < 1 => Err(CheckError::invalid(
            name(Leaf::Cost),
            format!("must be a positive integer (got {c}); a cost of 0 would admit for ever and a negative one would refund"),
        )),
        Some(c) if c > MAX_COST => Err(CheckError::invalid(
            name(Leaf::Cost),
            format!("{c} is over the limit of {MAX_COST}"),
        )),
        Some(c) => Ok(NonZeroU64::new(c as u64).expect("checked positive")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::{CheckInput, DescriptorInput};
    use crate::shard::KeyId;
    use std::sync::Arc;

    /// Names as a plain list front end would: `[i].leaf`.
    struct Plain;

    impl FieldNames for Plain {
        fn field(&self, at: At, leaf: Leaf) -> String {
            let prefix = at.check.map_or(String::new(), |i| format!("checks[{i}]."));
            format!("{prefix}[{}].{}", at.descriptor, leaf.as_str())
        }
        fn descriptors(&self, check: Option<usize>) -> String {
            check.map_or("descriptors".into(), |i| format!("checks[{i}].descriptors"))
        }
    }

    fn one<'a>(key: &'a str, route: &'a str) -> CheckInput<'a> {
        CheckInput {
            descriptors: smallvec::smallvec![DescriptorInput {
                key,
                route,
                tier: None,
                cost: None,
            }],
        }
    }

    fn invalid_field(result: Result<crate::cluster::Items, CheckError>) -> String {
        match result {
            Err(CheckError::InvalidArgument { field, .. }) => field,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    fn plan(input: &CheckInput<'_>) -> Result<crate::cluster::Items, CheckError> {
        plan_check(input, &RuleSet::builtin(), None, &Plain)
    }

    #[test]
    fn a_plain_check_plans_one_item_with_cost_one_on_the_default_rule() {
        let planned = plan(&one("cust_42", "POST /v1/charges")).unwrap();
        assert_eq!(planned.len(), 1);
        assert_eq!(planned[0].cost.get(), 1);
        assert_eq!(&*planned[0].rule.name, "default");
        assert_eq!(planned[0].client(), "cust_42");
    }

    const SCOPES: &str = r#"
        [[rule]]
        name = "v1"
        route = "/v1/*"
        limit = 2
        window = "1m"
        [[rule]]
        name = "vip"
        client = "vip"
        limit = 1000
        window = "1m"
        [[rule]]
        name = "each"
        route = "/each/*"
        per = "route"
        limit = 2
        window = "1m"
    "#;

    fn id_of(rules: &RuleSet, key: &str, route: &str) -> KeyId {
        plan_check(&one(key, route), rules, None, &Plain).unwrap()[0].id
    }

    #[test]
    fn the_identity_is_computed_once_at_planning_from_rule_and_client_with_no_route() {
        let planned = plan(&one("cust_42", "POST /v1/charges")).unwrap();
        assert_eq!(planned[0].id, KeyId::of("default", b"cust_42", ""));
        assert_eq!(planned[0].route(), "POST /v1/charges", "the route as sent");
        assert_eq!(
            planned[0].id.placement,
            crate::ring::Ring::key_hash(b"cust_42"),
            "the placement is the ring hash of the client key"
        );
    }

    #[test]
    fn by_default_every_route_a_rule_matches_shares_one_counter() {
        let rules = RuleSet::from_toml_str(SCOPES).unwrap();
        let a = id_of(&rules, "c", "GET /v1/a");
        assert_eq!(a, KeyId::of("v1", b"c", ""));
        for route in [
            "GET /v1/b",
            "GET /v1/a?x=1",
            "POST /v1/a",
            "GET /v1/c/1",
            "/v1/a#f",
        ] {
            assert_eq!(id_of(&rules, "c", route), a, "{route}");
        }
        assert_ne!(id_of(&rules, "d", "GET /v1/a"), a, "another client");
        // A client rule without a route: one budget across all routes.
        let vip = id_of(&rules, "vip", "GET /anything");
        assert_eq!(vip, KeyId::of("vip", b"vip", ""));
        assert_eq!(id_of(&rules, "vip", "POST /v1/a?nonce=7"), vip);
        // The default rule too.
        assert_eq!(id_of(&rules, "c", "/x?n=1"), id_of(&rules, "c", "/y"));
    }

    #[test]
    fn a_per_route_rule_counts_each_normalised_route_separately() {
        let rules = RuleSet::from_toml_str(SCOPES).unwrap();
        let a = id_of(&rules, "c", "GET /each/a");
        assert_eq!(a, KeyId::of("each", b"c", "GET /each/a"));
        assert_eq!(id_of(&rules, "c", "GET /each/a?x=1"), a, "query stripped");
        assert_eq!(
            id_of(&rules, "c", "GET /each/a#top"),
            a,
            "fragment stripped"
        );
        assert_ne!(id_of(&rules, "c", "GET /each/b"), a);
        assert_ne!(id_of(&rules, "c", "POST /each/a"), a, "the method counts");
        let planned = plan_check(&one("c", "GET /each/a?x=1"), &rules, None, &Plain).unwrap();
        assert_eq!(planned[0].normalised_route(), "GET /each/a");
        assert_eq!(planned[0].route(), "GET /each/a?x=1");
    }

    #[test]
    fn a_query_string_matches_rules_by_the_path_alone() {
        let rules = RuleSet::from_toml_str(
            "[[rule]]\nname = \"exact\"\nroute = \"GET /v1/a\"\nlimit = 1\nwindow = \"1s\"\n",
        )
        .unwrap();
        let planned = plan_check(&one("c", "GET /v1/a?x=1"), &rules, None, &Plain).unwrap();
        assert_eq!(&*planned[0].rule.name, "exact");
        assert_eq!(
            id_of(&rules, "c", "GET /v1/a?x=1"),
            id_of(&rules, "c", "GET /v1/a")
        );
    }

    #[test]
    fn a_forwarded_check_gets_the_identity_its_sender_planned() {
        let rules = RuleSet::from_toml_str(SCOPES).unwrap();
        for (key, route) in [
            ("c", "GET /v1/a?x=1"),
            ("c", "GET /each/a?x=1"),
            ("vip", "/z"),
        ] {
            let sent = plan_check(&one(key, route), &rules, None, &Plain).unwrap();
            // The owner plans what the sender forwards: key and route as sent.
            let input = DescriptorInput {
                key: sent[0].client(),
                route: sent[0].route(),
                tier: None,
                cost: None,
            };
            let owner = plan_forwarded(&input, &rules, |l| l.as_str().into()).unwrap();
            assert_eq!(owner.id, sent[0].id, "{key} {route}");
        }
    }

    #[test]
    fn the_fail_open_stand_in_counts_like_its_rule() {
        let rules = RuleSet::from_toml_str(SCOPES).unwrap();
        let shared = &plan_check(&one("c", "GET /v1/a?x=1"), &rules, None, &Plain).unwrap()[0];
        let stand_in = shared.under(Arc::new(shared.rule.fallback(3)));
        assert_eq!(stand_in.id, KeyId::of("v1~fallback/3", b"c", ""));
        let each = &plan_check(&one("c", "GET /each/a?x=1"), &rules, None, &Plain).unwrap()[0];
        let stand_in = each.under(Arc::new(each.rule.fallback(3)));
        assert_eq!(
            stand_in.id,
            KeyId::of("each~fallback/3", b"c", "GET /each/a")
        );
    }

    #[test]
    fn an_empty_or_oversized_key_is_refused_naming_the_field() {
        assert_eq!(invalid_field(plan(&one("", "/x"))), "[0].key");
        let key = "k".repeat(MAX_KEY_BYTES + 1);
        assert_eq!(invalid_field(plan(&one(&key, "/x"))), "[0].key");
        let key = "k".repeat(MAX_KEY_BYTES);
        assert!(plan(&one(&key, "/x")).is_ok());
    }

    #[test]
    fn zero_negative_and_absurd_costs_are_refused() {
        for cost in [0, -1, i64::MIN, MAX_COST + 1] {
            let mut input = one("a", "/x");
            input.descriptors[0].cost = Some(cost);
            assert_eq!(invalid_field(plan(&input)), "[0].cost", "cost {cost}");
        }
    }

    #[test]
    fn a_cost_the_rule_can_never_admit_is_refused_but_decided_when_forwarded() {
        let mut input = one("a", "/x");
        input.descriptors[0].cost = Some(101);
        let err = plan(&input).unwrap_err().to_string();
        assert!(err.contains("can never be admitted"), "{err}");
        let forwarded = plan_forwarded(&input.descriptors[0], &RuleSet::builtin(), |leaf| {
            leaf.as_str().to_string()
        });
        assert!(forwarded.is_ok(), "the owner denies it instead");
        input.descriptors[0].cost = Some(100);
        assert!(plan(&input).is_ok());
    }

    #[test]
    fn bad_route_syntax_and_bad_tiers_are_refused() {
        for route in ["", "charges", "get /x", "POST  /x"] {
            assert_eq!(
                invalid_field(plan(&one("a", route))),
                "[0].route",
                "{route:?}"
            );
        }
        let long = "t".repeat(MAX_TIER_BYTES + 1);
        for tier in ["", long.as_str()] {
            let mut input = one("a", "/x");
            input.descriptors[0].tier = Some(tier);
            assert_eq!(invalid_field(plan(&input)), "[0].tier");
        }
    }

    #[test]
    fn descriptor_counts_outside_one_to_max_are_refused() {
        let mut input = one("a", "/x");
        input.descriptors = smallvec::smallvec![input.descriptors[0]; MAX_DESCRIPTORS + 1];
        assert_eq!(invalid_field(plan(&input)), "descriptors");
        input.descriptors.pop();
        assert_eq!(plan(&input).unwrap().len(), MAX_DESCRIPTORS);
        input.descriptors.clear();
        assert_eq!(invalid_field(plan(&input)), "descriptors");
    }

    #[test]
    fn a_later_descriptor_names_its_own_field_and_batch_index() {
        let mut input = one("a", "/x");
        input.descriptors.push(DescriptorInput {
            key: "",
            ..input.descriptors[0]
        });
        let err = plan_check(&input, &RuleSet::builtin(), Some(3), &Plain);
        assert_eq!(invalid_field(err), "checks[3].[1].key");
    }
}
