//! Planning what a peer forwards: the owner of a counter re-validates every item a
//! member sends (a forwarded check, a refund) with the same code as a client's check,
//! because a member's numbers are still input.
//!
//! An item comes in one of three shapes, each planned by the layer that plans it for a
//! client: matched against this node's rules from (key, route, tier) like a
//! `ringlimit.v1` descriptor ([`plan::plan_forwarded`]); under an Envoy rule named by
//! the sender ([`domain::named_rule`], `key` being the counter key it computed); or under
//! a rule its request carried inline ([`gubernator::inline_rule`], rebuilt from the
//! numbers). Field paths are the peer API's: `items[3].key`, `items[0].named.inline`.
//!
//! The input is plain borrowed data: the peer server adapter only converts its messages.

use std::num::NonZeroU64;
use std::sync::Arc;

use crate::algorithms::AlgorithmKind;
use crate::algorithms::Millis;
use crate::check::plan::{self, bounded, Leaf};
use crate::check::{domain, gubernator, CheckError, DescriptorInput};
use crate::cluster::{CheckItem, InlineRule, InlineRules, NamedRule};
use crate::config::bounds::{Text, MAX_COST, MAX_FORWARD_ITEMS};
use crate::config::rules::envoy::EnvoyConfig;
use crate::config::rules::RuleSet;
use crate::shard::{Refund, Target};

/// One forwarded (or refunded) item as the peer adapter hands it over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardedInput<'a> {
    /// The client key, or the counter key for a named or inline rule.
    pub key: &'a str,
    /// The route as the client sent it (unused under a named or inline rule).
    pub route: &'a str,
    /// The tier, if the client sent one.
    pub tier: Option<&'a str>,
    /// Units to charge (or to refund).
    pub cost: u64,
    /// The rule the sender decided the item under, when not matched by (key, route).
    pub named: Option<NamedInput<'a>>,
    /// Units to give back before deciding (0: none); inline rules only.
    pub give_back: u64,
    /// On a denial, take what is left; inline rules only.
    pub drain: bool,
    /// Report, change nothing; inline rules only.
    pub peek: bool,
    /// Decide on this node's replica of the key: its owner could not be reached.
    pub failover: bool,
    /// With `failover`: the owner may have charged it already (its forward timed out).
    pub in_doubt: bool,
}

/// A rule named by the sender: an Envoy rule (with the request's override), or the
/// numbers of a rule the request carried inline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamedInput<'a> {
    /// The configured rule's name.
    pub name: &'a str,
    /// The override's requests per unit; both it and the unit are 0 without one.
    pub override_limit: u32,
    /// The override's unit, in seconds.
    pub override_unit_seconds: u64,
    /// Set for a rule the request carried: nothing is looked up by `name`.
    pub inline: Option<InlineInput<'a>>,
}

/// The numbers of an inline rule as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InlineInput<'a> {
    /// `fixed_window` or `token_bucket`.
    pub algorithm: &'a str,
    /// Units per window (or refilled per window).
    pub limit: u64,
    /// The window, in ms.
    pub window_ms: u64,
    /// Token bucket capacity (0 for a fixed window).
    pub burst: u64,
}

impl InlineInput<'_> {
    /// The rule's numbers; `None` for an algorithm this node does not know. Whether
    /// they make a rule is [`gubernator::inline_rule`]'s question.
    pub fn numbers(&self) -> Option<InlineRule> {
        Some(InlineRule {
            kind: AlgorithmKind::parse(self.algorithm)?,
            limit: self.limit,
            window_ms: self.window_ms,
            burst: self.burst,
        })
    }
}

/// What the owner plans against: its rules, its Envoy configuration and its registry
/// of inline rules.
#[derive(Debug, Clone, Copy)]
pub struct OwnerRules<'a> {
    /// The TOML rules (matched by key, route, tier).
    pub rules: &'a RuleSet,
    /// The Envoy configuration (rules by name).
    pub envoy: &'a EnvoyConfig,
    /// Inline rules (bounded registry).
    pub known: &'a InlineRules,
}

/// Refuse a call whose list `field` holds more than `max` entries, before any of them
/// is looked at: one call must not make a node decide, refund or hold an unbounded
/// amount.
pub fn at_most(field: &str, given: usize, max: usize) -> Result<(), CheckError> {
    if given > max {
        return Err(CheckError::invalid(
            field,
            format!("{given} {field} in one call; at most {max} are allowed"),
        ));
    }
    Ok(())
}

/// A forwarded batch as checks ready for the owner's shards: at most
/// [`MAX_FORWARD_ITEMS`] items, each validated like a client's. Any invalid item
/// refuses the whole batch, and nothing is decided.
pub fn plan_batch<'a>(
    items: impl ExactSizeIterator<Item = ForwardedInput<'a>>,
    owner: OwnerRules<'_>,
) -> Result<Vec<CheckItem>, CheckError> {
    at_most("items", items.len(), MAX_FORWARD_ITEMS)?;
    items
        .enumerate()
        .map(|(i, input)| {
            let mut planned = plan_item(&input, owner, i)?;
            // A give-back or a drain changes a counter beyond a check: only for a rule
            // a request carried, whose caller chose its numbers anyway. A peek changes
            // nothing, so it is accepted under any rule: this build's owners take it, so
            // that the next build's entry nodes can send Envoy's `hits_addend = 0` as a
            // peek (exact) instead of a probe given back (issue 22; entries of this build
            // still send probes for named rules).
            if (input.give_back != 0 || input.drain) && !planned.uncached {
                return Err(CheckError::invalid(
                    format!("items[{i}].give_back"),
                    "a give-back or a drain is for an inline rule only",
                ));
            }
            planned.give_back = NonZeroU64::new(input.give_back);
            planned.drain = input.drain;
            planned.peek = input.peek;
            planned.target = Target::from_flags(input.failover, input.in_doubt);
            Ok(planned)
        })
        .collect()
}

/// A refund call as refunds for the shards (each item with the time of its admission),
/// with the same bounds as [`plan_batch`].
pub fn plan_refunds<'a>(
    items: impl ExactSizeIterator<Item = (ForwardedInput<'a>, Millis)>,
    owner: OwnerRules<'_>,
) -> Result<Vec<Refund>, CheckError> {
    at_most("items", items.len(), MAX_FORWARD_ITEMS)?;
    items
        .enumerate()
        .map(|(i, (input, at))| {
            Ok(Refund {
                charge: plan_item(&input, owner, i)?.charge(),
                at,
            })
        })
        .collect()
}

/// Plan one item, named `items[index]` in errors.
fn plan_item(
    input: &ForwardedInput<'_>,
    owner: OwnerRules<'_>,
    index: usize,
) -> Result<CheckItem, CheckError> {
    let Some(named) = &input.named else {
        let descriptor = DescriptorInput {
            key: input.key,
            route: input.route,
            tier: input.tier,
            // A cost beyond i64 is beyond any limit too: refused the same way.
            cost: Some(i64::try_from(input.cost).unwrap_or(i64::MAX)),
        };
        return plan::plan_forwarded(&descriptor, owner.rules, |leaf: Leaf| {
            format!("items[{index}].{}", leaf.as_str())
        });
    };
    match &named.inline {
        Some(inline) => plan_inline(input, inline, owner.known, index),
        None => plan_named(input, named, owner.envoy, index),
    }
}

/// An item under an Envoy rule the sender named (with the request's override): the
/// rule is this node's own, and `key` is the counter key the sender computed.
fn plan_named(
    input: &ForwardedInput<'_>,
    wire: &NamedInput<'_>,
    envoy: &EnvoyConfig,
    index: usize,
) -> Result<CheckItem, CheckError> {
    let named = NamedRule {
        name: Arc::from(wire.name),
        override_limit: (wire.override_limit != 0 || wire.override_unit_seconds != 0)
            .then_some((wire.override_limit, wire.override_unit_seconds)),
        inline: None,
    };
    let rule = domain::named_rule(envoy, &named).ok_or_else(|| {
        CheckError::invalid(
            format!("items[{index}].named.name"),
            format!("no Envoy rule {:?} (with this override) here", wire.name),
        )
    })?;
    counter_key(input.key, index)?;
    let cost = NonZeroU64::new(input.cost.min(MAX_COST as u64))
        .ok_or_else(|| CheckError::invalid(format!("items[{index}].cost"), "must be >= 1"))?;
    Ok(domain::entries_item(rule, input.key, cost, named))
}

/// An item under a rule its request carried (Gubernator): the rule is rebuilt from the
/// numbers, bounded like any input, and never looked up in this node's rules.
fn plan_inline(
    input: &ForwardedInput<'_>,
    wire: &InlineInput<'_>,
    known: &InlineRules,
    index: usize,
) -> Result<CheckItem, CheckError> {
    let inline = wire.numbers().ok_or_else(|| {
        CheckError::invalid(
            format!("items[{index}].named.inline.algorithm"),
            format!("{:?} is not an algorithm", wire.algorithm),
        )
    })?;
    let rule = known
        .forwarded(&inline, gubernator::inline_rule)
        .map_err(|reason| CheckError::invalid(format!("items[{index}].named.inline"), reason))?;
    counter_key(input.key, index)?;
    let cost = NonZeroU64::new(input.cost)
        .filter(|c| c.get() <= rule.limiter.max_cost())
        .ok_or_else(|| {
            CheckError::invalid(
                format!("items[{index}].cost"),
                format!("must be 1..={}", rule.limiter.max_cost()),
            )
        })?;
    Ok(gubernator::inline_item(rule, input.key, cost, inline))
}

/// A counter key the sender computed: bounded like every counter key.
fn counter_key(key: &str, index: usize) -> Result<(), CheckError> {
    bounded(Text::CounterKey, key, || format!("items[{index}].key"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(key: &str) -> ForwardedInput<'_> {
        ForwardedInput {
            key,
            route: "GET /t",
            tier: None,
            cost: 1,
            named: None,
            give_back: 0,
            drain: false,
            peek: false,
            failover: false,
            in_doubt: false,
        }
    }

    fn refusal(items: &[ForwardedInput<'_>], envoy: &EnvoyConfig) -> String {
        let owner = OwnerRules {
            rules: &RuleSet::builtin(),
            envoy,
            known: &InlineRules::default(),
        };
        plan_batch(items.iter().copied(), owner)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn a_refused_item_is_named_by_its_index_then_the_bound_it_breaks() {
        let envoy = EnvoyConfig::from_yaml_str(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 5}\n",
            AlgorithmKind::FixedWindow,
        )
        .unwrap();
        let long_tier = "t".repeat(65);
        let mut tiered = plain("k");
        tiered.tier = Some(&long_tier);
        assert_eq!(
            refusal(&[plain("a"), plain("b"), tiered], &envoy),
            "items[2].tier: 65 bytes is over the limit of 64"
        );
        let named = NamedInput {
            name: "d.k",
            override_limit: 0,
            override_unit_seconds: 0,
            inline: None,
        };
        let long_key = "k".repeat(crate::config::bounds::MAX_COUNTER_KEY + 1);
        let mut item = plain(&long_key);
        item.named = Some(named);
        assert_eq!(
            refusal(&[plain("a"), item], &envoy),
            "items[1].key: 1025 bytes is over the limit of 1024"
        );
        let inline = NamedInput {
            inline: Some(InlineInput {
                algorithm: "fixed_window",
                limit: 10,
                window_ms: 1000,
                burst: 0,
            }),
            ..named
        };
        let mut item = plain("");
        item.named = Some(inline);
        assert_eq!(refusal(&[item], &envoy), "items[0].key: must not be empty");
        let mut drain = plain("a");
        drain.drain = true;
        assert_eq!(
            refusal(&[drain], &envoy),
            "items[0].give_back: a give-back or a drain is for an inline rule only"
        );
        let over = vec![plain("a"); MAX_FORWARD_ITEMS + 1];
        assert_eq!(
            refusal(&over, &envoy),
            "items: 1001 items in one call; at most 1000 are allowed"
        );
    }

    #[test]
    fn a_peek_is_accepted_under_any_rule_and_planned_as_one() {
        let envoy = EnvoyConfig::default();
        let owner = OwnerRules {
            rules: &RuleSet::builtin(),
            envoy: &envoy,
            known: &InlineRules::default(),
        };
        let mut peek = plain("a");
        peek.peek = true;
        let planned = plan_batch([peek].into_iter(), owner).unwrap();
        assert!(
            planned[0].peek,
            "a TOML rule's forwarded peek is a peek on the owner"
        );
        assert!(!planned[0].uncached);
    }
}
