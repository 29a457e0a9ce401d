//! Checks by domain and descriptor entries (Envoy's rate limit service): validate, match
//! against the Envoy configuration, plan the counted descriptors as [`CheckItem`]s for the
//! same router as every other check, and turn their answers into one status each.
//!
//! What is specific to this kind of check, decided here once for any front end that
//! speaks it:
//!
//! - hits: the request's `hits_addend` (0 or unset means 1), overridden by a descriptor's
//!   own; a descriptor's 0 means "report, do not count": it is decided as a probe (a cost
//!   of 1, given back at once), and reports OVER_LIMIT once the budget is spent;
//! - a limit override (requests per unit, unit) decides under a rule of its own;
//! - `replaces` drops the named limits matched by other descriptors of the request;
//! - `unlimited` and unmatched descriptors are never counted;
//! - a descriptor that can never be admitted (`requests_per_unit: 0`, or more hits than its
//!   limit holds) denies the request without asking a shard, and the request's counted
//!   descriptors are then decided as probes, so a denied request charges nothing (the
//!   same promise as the refund of siblings);
//! - all descriptors must allow for the request to be OK; the ones that allowed are
//!   refunded when another denies (the router's refunds).
//!
//! Field paths in errors are the request's own (`domain`,
//! `descriptors[1].entries[0].value`, `descriptors[0].limit.unit`).

use std::num::NonZeroU64;
use std::sync::Arc;

use crate::check::plan::bounded;
use crate::check::CheckError;
use crate::cluster::{CheckItem, DescriptorOutcome, NamedRule};
use crate::config::route::Route;
use crate::config::rules::envoy::{
    envoy_rule, envoy_spec, override_rule_name, EnvoyConfig, EnvoyLimit, EnvoyMatch, EnvoyUnit,
};
use crate::config::rules::Rule;

use crate::config::bounds::Text;
/// The bounds of a domain request, defined with every other input bound.
pub use crate::config::bounds::{MAX_COUNTER_KEY, MAX_DESCRIPTORS, MAX_ENTRIES, MAX_ENTRY_BYTES};

/// A request's override of one descriptor's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitOverride {
    /// Requests per unit.
    pub requests_per_unit: u32,
    /// The unit; `None` when the wire value is not a unit ringlimit knows (refused).
    pub unit: Option<EnvoyUnit>,
}

/// One descriptor: ordered entries, and what the request says about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntriesInput<'a> {
    /// (key, value) pairs, in order: at least one, each key and value non-empty.
    pub entries: smallvec::SmallVec<[(&'a str, &'a str); 4]>,
    /// The descriptor's own hits (overrides the request's; 0: report, do not count).
    pub hits: Option<u64>,
    /// A replacement for the configured limit.
    pub limit: Option<LimitOverride>,
}

/// One request by domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainInput<'a> {
    /// Selects the configuration: non-empty.
    pub domain: &'a str,
    /// The request's hits per descriptor; 0 means 1.
    pub hits: u32,
    /// 1..=[`MAX_DESCRIPTORS`] descriptors.
    pub descriptors: Vec<EntriesInput<'a>>,
}

/// What became of one descriptor.
#[derive(Debug, Clone)]
pub enum Planned {
    /// No limit applies (unmatched, or replaced by another descriptor's limit).
    NoLimit,
    /// `unlimited: true`.
    Unlimited,
    /// Denied without a shard: `requests_per_unit: 0`, or more hits than the limit holds.
    Refused(EnvoyLimit),
    /// Decided by the router: `item` is the index into the planned items.
    Counted {
        /// The limit it is counted under.
        limit: EnvoyLimit,
        /// Index into [`DomainPlan::items`].
        item: usize,
        /// Decided as a probe: report, do not count.
        probe: bool,
    },
}

/// A planned domain request: what each descriptor became, and the items to decide.
#[derive(Debug)]
pub struct DomainPlan {
    /// One per request descriptor, in order.
    pub descriptors: Vec<Planned>,
    /// The counted descriptors, for the router (one check: siblings refunded together).
    pub items: Vec<CheckItem>,
}

impl DomainPlan {
    /// The request descriptor the planned item `item` stands for.
    pub fn request_index(&self, item: usize) -> usize {
        self.descriptors
            .iter()
            .position(|p| matches!(p, Planned::Counted { item: i, .. } if *i == item))
            .unwrap_or(item)
    }
}

/// The status of one descriptor, wire-independent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainStatus {
    /// Under the limit (or no limit, or only a shadow rule would deny).
    pub ok: bool,
    /// The limit that applied; `None` when none did.
    pub limit: Option<EnvoyLimit>,
    /// Units left (for a probe: not counting the probe itself).
    pub remaining: u64,
    /// Until the full limit is back, in ms (0 without a limit).
    pub reset_after_ms: u64,
    /// On a denial, how long to wait before the same hits can be admitted, in ms.
    pub retry_after_ms: u64,
    /// A rule in shadow mode would have denied.
    pub shadow_denied: bool,
    /// `unlimited: true`.
    pub unlimited: bool,
    /// Answered without the key's owner (fail-open, deny cache).
    pub degraded: bool,
}

/// The answer to a domain request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainVerdict {
    /// Every descriptor is OK.
    pub ok: bool,
    /// One per request descriptor, in order.
    pub statuses: Vec<DomainStatus>,
}

/// Bounded counter keys: a long one is replaced by its 128-bit hash (marked so it can
/// never equal a key that was not hashed). Every counter key a request builds (Envoy's
/// entries, Gubernator's name and unique key) passes here, so a peer never forwards
/// one longer than [`MAX_COUNTER_KEY`].
pub fn bounded_key(counter: String) -> String {
    if counter.len() <= MAX_COUNTER_KEY {
        return counter;
    }
    format!("#{:032x}", xxhash_rust::xxh3::xxh3_128(counter.as_bytes()))
}

/// The item for a counter key under `rule` (the client key of a planned item is the
/// counter key; Envoy descriptors have no route).
pub fn entries_item(
    rule: Arc<Rule>,
    counter: &str,
    cost: NonZeroU64,
    named: NamedRule,
) -> CheckItem {
    let route = Route::parse("/").expect("\"/\" is a route");
    CheckItem::new(rule, counter, route, None, cost).named(named)
}

/// The rule `named` designates in `config`: the configured one, or its override. An
/// inline rule is not in any configuration: see `check::gubernator::inline_rule`.
pub fn named_rule(config: &EnvoyConfig, named: &NamedRule) -> Option<Arc<Rule>> {
    if named.inline.is_some() {
        return None;
    }
    let base = config.rule(&named.name)?;
    match named.override_limit {
        None => Some(base.clone()),
        Some((requests, unit_seconds)) => {
            let unit = [
                EnvoyUnit::Second,
                EnvoyUnit::Minute,
                EnvoyUnit::Hour,
                EnvoyUnit::Day,
                EnvoyUnit::Week,
            ]
            .into_iter()
            .find(|u| u.window().as_secs() == unit_seconds)?;
            override_rule(base, requests, unit)
        }
    }
}

fn override_rule(base: &Rule, requests: u32, unit: EnvoyUnit) -> Option<Arc<Rule>> {
    let limit = NonZeroU64::new(u64::from(requests))?;
    let spec = envoy_spec(base.spec.kind(), limit, unit.window());
    let name = override_rule_name(&base.name, requests, unit);
    envoy_rule(&name, spec, base.shadow, base.on_unavailable)
        .ok()
        .map(|rule| Arc::new(rule.partitioned(base.partition)))
}

/// Validate a domain request and plan it. Nothing is charged for an invalid one.
pub fn plan_domain(
    input: &DomainInput<'_>,
    config: &EnvoyConfig,
) -> Result<DomainPlan, CheckError> {
    validate(input)?;
    let request_hits = if input.hits == 0 {
        1
    } else {
        u64::from(input.hits)
    };
    let matched: Vec<(EnvoyMatch, u64)> = input
        .descriptors
        .iter()
        .map(|d| {
            let hits = d.hits.unwrap_or(request_hits);
            (config.matching(input.domain, &d.entries), hits)
        })
        .collect();
    let replaced = replaced_limits(&matched);
    let mut plan = DomainPlan {
        descriptors: Vec::with_capacity(matched.len()),
        items: Vec::new(),
    };
    let mut refused_any = false;
    let (mut in_quota_mode, mut quota_refused) = (0, 0);
    for ((m, hits), d) in matched.into_iter().zip(&input.descriptors) {
        let planned = match counted_limit(input.domain, m, d, config, &replaced) {
            Ok((limit, counter)) => plan_counted(limit, counter, hits, d, &mut plan.items),
            Err(planned) => planned,
        };
        let quota = |l: &EnvoyLimit| l.quota && !l.shadow;
        match &planned {
            Planned::Counted { limit, .. } if quota(limit) => in_quota_mode += 1,
            Planned::Refused(limit) if quota(limit) => {
                in_quota_mode += 1;
                quota_refused += 1;
            }
            // A shadow limit that could never admit denies nothing: the others still
            // count.
            Planned::Refused(limit) if !limit.shadow => refused_any = true,
            _ => {}
        }
        plan.descriptors.push(planned);
    }
    // Quota mode: one that can never admit denies the request only when all do.
    refused_any |= in_quota_mode > 0 && quota_refused == in_quota_mode;
    mark_probes(&mut plan, refused_any);
    Ok(plan)
}

/// The request's bounds: domain, descriptor count, entries, the unit of an override.
fn validate(input: &DomainInput<'_>) -> Result<(), CheckError> {
    bounded(Text::Domain, input.domain, || "domain".into())?;
    if input.descriptors.is_empty() {
        return Err(CheckError::invalid(
            "descriptors",
            "at least one descriptor is required",
        ));
    }
    if input.descriptors.len() > MAX_DESCRIPTORS {
        return Err(CheckError::invalid(
            "descriptors",
            format!(
                "{} descriptors given; at most {MAX_DESCRIPTORS} are allowed per request",
                input.descriptors.len()
            ),
        ));
    }
    for (i, d) in input.descriptors.iter().enumerate() {
        if d.entries.is_empty() {
            return Err(CheckError::invalid(
                format!("descriptors[{i}].entries"),
                "at least one entry is required",
            ));
        }
        if d.entries.len() > MAX_ENTRIES {
            return Err(CheckError::invalid(
                format!("descriptors[{i}].entries"),
                format!(
                    "{} entries given; at most {MAX_ENTRIES} are allowed",
                    d.entries.len()
                ),
            ));
        }
        for (j, (key, value)) in d.entries.iter().enumerate() {
            bounded(Text::Entry, key, || {
                format!("descriptors[{i}].entries[{j}].key")
            })?;
            bounded(Text::Entry, value, || {
                format!("descriptors[{i}].entries[{j}].value")
            })?;
        }
        if d.limit.is_some_and(|o| o.unit.is_none()) {
            return Err(CheckError::invalid(
                format!("descriptors[{i}].limit.unit"),
                "must be SECOND, MINUTE, HOUR or DAY (UNKNOWN, MONTH and YEAR are not \
                 supported: ringlimit windows are at most 7 days)",
            ));
        }
    }
    Ok(())
}

/// `replaces`: the limits named by another matched limit's `replaces`, to be dropped.
fn replaced_limits(matched: &[(EnvoyMatch, u64)]) -> Vec<Arc<str>> {
    matched
        .iter()
        .filter_map(|(m, _)| match m {
            EnvoyMatch::Limited { limit, .. } => Some(limit.replaces.iter().cloned()),
            _ => None,
        })
        .flatten()
        .collect()
}

/// The limit a matched descriptor is counted under, and its counter key; `Err` is what
/// the descriptor becomes when no limit counts it.
fn counted_limit(
    domain: &str,
    m: EnvoyMatch,
    d: &EntriesInput<'_>,
    config: &EnvoyConfig,
    replaced: &[Arc<str>],
) -> Result<(EnvoyLimit, String), Planned> {
    let (limit, counter) = match (m, d.limit) {
        // As the reference: an override limits a descriptor of a known domain even
        // when no configured limit matches it.
        (EnvoyMatch::NoLimit, Some(o)) => {
            let base = config.override_base(domain).ok_or(Planned::NoLimit)?;
            let limit = EnvoyLimit {
                rule: Some(base.clone()),
                requests_per_unit: o.requests_per_unit,
                unit: o.unit.expect("validated"),
                name: Arc::from(format!("{domain}.override")),
                configured_name: None,
                replaces: Vec::new(),
                shadow: false,
                quota: false,
            };
            (limit, EnvoyConfig::counter_key(domain, &d.entries))
        }
        (EnvoyMatch::NoLimit, None) => return Err(Planned::NoLimit),
        (EnvoyMatch::Unlimited, _) => return Err(Planned::Unlimited),
        (EnvoyMatch::Limited { limit, counter }, _) => (limit, counter),
    };
    if limit
        .configured_name
        .as_ref()
        .is_some_and(|n| replaced.contains(n))
    {
        return Err(Planned::NoLimit);
    }
    Ok((limit, counter))
}

/// A descriptor under a limit: refused if the limit could never admit its hits, else
/// its item is added to `items` (under the request's override, if any).
fn plan_counted(
    limit: EnvoyLimit,
    counter: String,
    hits: u64,
    d: &EntriesInput<'_>,
    items: &mut Vec<CheckItem>,
) -> Planned {
    let (limit, named) = overridden(limit, d.limit);
    let Some(rule) = limit.rule.clone() else {
        return Planned::Refused(limit);
    };
    let probe = hits == 0;
    let cost = NonZeroU64::new(hits.max(1)).expect("at least 1");
    if cost.get() > rule.limiter.max_cost() {
        return Planned::Refused(limit);
    }
    items.push(entries_item(rule, &bounded_key(counter), cost, named));
    Planned::Counted {
        limit,
        item: items.len() - 1,
        probe,
    }
}

/// `limit` under the request's override, if any, and the name the owner rebuilds its
/// rule from.
fn overridden(mut limit: EnvoyLimit, o: Option<LimitOverride>) -> (EnvoyLimit, NamedRule) {
    let mut named = NamedRule {
        name: limit
            .rule
            .as_ref()
            .map_or_else(|| limit.name.clone(), |rule| rule.name.clone()),
        override_limit: None,
        inline: None,
    };
    if let Some(LimitOverride {
        requests_per_unit,
        unit: Some(unit),
    }) = o
    {
        limit.requests_per_unit = requests_per_unit;
        limit.unit = unit;
        limit.rule = limit
            .rule
            .take()
            .and_then(|base| override_rule(&base, requests_per_unit, unit));
        named.override_limit = Some((requests_per_unit, unit.window().as_secs()));
    }
    (limit, named)
}

/// A request that is denied already charges nothing: its counted descriptors only
/// report (decided at a cost of 1, given back, to report their numbers). Otherwise only
/// the descriptors that asked to (0 hits) are probes.
fn mark_probes(plan: &mut DomainPlan, refused_any: bool) {
    if refused_any {
        for p in &mut plan.descriptors {
            if let Planned::Counted { probe, .. } = p {
                *probe = true;
            }
        }
        for item in &mut plan.items {
            item.cost = NonZeroU64::MIN;
            item.probe = true;
        }
        return;
    }
    for p in &plan.descriptors {
        if let Planned::Counted {
            item, probe: true, ..
        } = p
        {
            plan.items[*item].probe = true;
        }
    }
}

/// The statuses of a planned request from the router's answers to its items.
pub fn domain_verdict(plan: DomainPlan, outcomes: &[DescriptorOutcome]) -> DomainVerdict {
    let statuses: Vec<DomainStatus> = plan
        .descriptors
        .into_iter()
        .map(|p| match p {
            Planned::NoLimit => DomainStatus {
                ok: true,
                limit: None,
                remaining: 0,
                reset_after_ms: 0,
                retry_after_ms: 0,
                shadow_denied: false,
                unlimited: false,
                degraded: false,
            },
            Planned::Unlimited => DomainStatus {
                ok: true,
                limit: None,
                remaining: u64::from(u32::MAX),
                reset_after_ms: 0,
                retry_after_ms: 0,
                shadow_denied: false,
                unlimited: true,
                degraded: false,
            },
            Planned::Refused(limit) => {
                let window = limit.unit.window().as_millis() as u64;
                // A shadow limit refuses nothing either.
                let shadow = limit.shadow;
                DomainStatus {
                    ok: shadow,
                    limit: Some(limit),
                    remaining: 0,
                    reset_after_ms: window,
                    retry_after_ms: window,
                    shadow_denied: shadow,
                    unlimited: false,
                    degraded: false,
                }
            }
            Planned::Counted { limit, item, probe } => {
                let o = &outcomes[item];
                let d = &o.answer.decision;
                // A quota-mode limit's rule is shadowed for the cluster; here it is
                // over when its decision is (unless it is a shadow limit as well).
                let quota = limit.quota && !limit.shadow;
                let (ok, shadow_denied) = if quota {
                    (d.allowed, false)
                } else {
                    (o.enforced_allowed(), o.shadow_denied())
                };
                // A probe's own unit was given back: it is still there.
                let remaining = if probe && d.allowed {
                    d.remaining.saturating_add(1).min(d.limit)
                } else {
                    d.remaining
                };
                DomainStatus {
                    ok,
                    limit: Some(limit),
                    remaining,
                    reset_after_ms: d.reset_at_ms.saturating_sub(o.answer.at),
                    retry_after_ms: if d.allowed { 0 } else { d.retry_after_ms },
                    shadow_denied,
                    unlimited: false,
                    degraded: o.answer.degraded,
                }
            }
        })
        .collect();
    DomainVerdict {
        ok: overall_ok(&statuses),
        statuses,
    }
}

/// envoyproxy/ratelimit's overall code with quota mode: OVER_LIMIT when a descriptor
/// that is not in quota mode is over, or when every quota-mode descriptor is; a
/// quota-mode descriptor over its limit while another still has room is reported
/// OVER_LIMIT on its own status only.
///
/// The cluster never saw a quota-mode denial as one (its rule is shadowed), so when the
/// request is denied because every quota-mode descriptor is over, the other descriptors
/// stay charged for it, as envoyproxy/ratelimit charges them; a denial by a descriptor
/// not in quota mode refunds the others as always.
fn overall_ok(statuses: &[DomainStatus]) -> bool {
    let in_quota_mode = |s: &DomainStatus| s.limit.as_ref().is_some_and(|l| l.quota && !l.shadow);
    let enforced_over = statuses.iter().any(|s| !s.ok && !in_quota_mode(s));
    let mut quota = statuses.iter().filter(|s| in_quota_mode(s)).peekable();
    let all_quota_over = quota.peek().is_some() && quota.all(|s| !s.ok);
    !(enforced_over || all_quota_over)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::AlgorithmKind;

    const CONFIG: &str = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 5, name: five}\n  - key: z\n    rate_limit: {unit: second, requests_per_unit: 0}\n  - key: u\n    rate_limit: {unlimited: true}\n  - key: r\n    rate_limit:\n      unit: second\n      requests_per_unit: 9\n      replaces: [{name: five}]\n";

    fn config() -> EnvoyConfig {
        EnvoyConfig::from_yaml_str(CONFIG, AlgorithmKind::FixedWindow).unwrap()
    }

    fn one<'a>(entries: &[(&'a str, &'a str)]) -> EntriesInput<'a> {
        EntriesInput {
            entries: entries.iter().copied().collect(),
            hits: None,
            limit: None,
        }
    }

    fn request<'a>(descriptors: Vec<EntriesInput<'a>>) -> DomainInput<'a> {
        DomainInput {
            domain: "d",
            hits: 0,
            descriptors,
        }
    }

    fn field(r: Result<DomainPlan, CheckError>) -> String {
        match r {
            Err(CheckError::InvalidArgument { field, .. }) => field,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn bad_requests_are_refused_naming_the_field() {
        let c = config();
        let mut r = request(vec![one(&[("k", "a")])]);
        r.domain = "";
        assert_eq!(field(plan_domain(&r, &c)), "domain");
        assert_eq!(field(plan_domain(&request(vec![]), &c)), "descriptors");
        assert_eq!(
            field(plan_domain(&request(vec![one(&[])]), &c)),
            "descriptors[0].entries"
        );
        let r = request(vec![one(&[("k", "a")]), one(&[("k", "a"), ("", "b")])]);
        assert_eq!(field(plan_domain(&r, &c)), "descriptors[1].entries[1].key");
        let r = request(vec![one(&[("k", "")])]);
        assert_eq!(
            field(plan_domain(&r, &c)),
            "descriptors[0].entries[0].value"
        );
        let mut d = one(&[("k", "a")]);
        d.limit = Some(LimitOverride {
            requests_per_unit: 1,
            unit: None,
        });
        assert_eq!(
            field(plan_domain(&request(vec![d]), &c)),
            "descriptors[0].limit.unit"
        );
    }

    #[test]
    fn hits_default_to_one_a_descriptor_overrides_and_zero_probes() {
        let c = config();
        let mut r = request(vec![one(&[("k", "a")]), one(&[("k", "b")])]);
        r.hits = 3;
        r.descriptors[1].hits = Some(0);
        let p = plan_domain(&r, &c).unwrap();
        assert_eq!(p.items[0].cost.get(), 3);
        assert!(!p.items[0].probe);
        assert!(p.items[1].probe && p.items[1].cost.get() == 1);
        r.hits = 0;
        r.descriptors[1].hits = None;
        let p = plan_domain(&r, &c).unwrap();
        assert!(p.items.iter().all(|i| i.cost.get() == 1 && !i.probe));
    }

    #[test]
    fn a_refused_descriptor_makes_the_others_probes_and_replaced_limits_vanish() {
        let c = config();
        let p = plan_domain(&request(vec![one(&[("k", "a")]), one(&[("z", "x")])]), &c).unwrap();
        assert!(matches!(p.descriptors[1], Planned::Refused(_)));
        assert!(
            p.items[0].probe,
            "nothing is charged for a request denied at planning"
        );
        let p = plan_domain(&request(vec![one(&[("k", "a")]), one(&[("r", "x")])]), &c).unwrap();
        assert!(matches!(p.descriptors[0], Planned::NoLimit), "replaced");
        assert_eq!(p.items.len(), 1);
        let p = plan_domain(
            &request(vec![one(&[("u", "x")]), one(&[("nope", "x")])]),
            &c,
        )
        .unwrap();
        assert!(matches!(p.descriptors[0], Planned::Unlimited));
        assert!(matches!(p.descriptors[1], Planned::NoLimit));
        assert!(p.items.is_empty());
    }

    #[test]
    fn an_override_decides_under_its_own_rule_which_the_owner_rebuilds() {
        let c = config();
        let mut d = one(&[("k", "a")]);
        d.limit = Some(LimitOverride {
            requests_per_unit: 42,
            unit: Some(EnvoyUnit::Minute),
        });
        let p = plan_domain(&request(vec![d]), &c).unwrap();
        let item = &p.items[0];
        assert_eq!(item.rule.spec.limit().get(), 42);
        assert_ne!(item.rule.name, c.rule("d.k").unwrap().name);
        let owner = named_rule(&c, item.named.as_ref().unwrap()).unwrap();
        assert_eq!(owner, item.rule, "the owner builds the same rule");
    }

    #[test]
    fn more_hits_than_the_limit_holds_are_denied_without_counting() {
        let c = config();
        let mut d = one(&[("k", "a")]);
        d.hits = Some(6);
        let p = plan_domain(&request(vec![d]), &c).unwrap();
        assert!(matches!(p.descriptors[0], Planned::Refused(_)));
        let v = domain_verdict(p, &[]);
        assert!(!v.ok);
    }

    #[test]
    fn a_shadow_limit_that_cannot_admit_denies_nothing_and_the_others_still_count() {
        let c = EnvoyConfig::from_yaml_str(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 5}\n  - key: s\n    shadow_mode: true\n    rate_limit: {unit: second, requests_per_unit: 0}\n",
            AlgorithmKind::FixedWindow,
        )
        .unwrap();
        let p = plan_domain(&request(vec![one(&[("k", "a")]), one(&[("s", "x")])]), &c).unwrap();
        assert!(!p.items[0].probe, "still counted");
        let p = plan_domain(&request(vec![one(&[("s", "x")])]), &c).unwrap();
        let v = domain_verdict(p, &[]);
        assert!(v.ok && v.statuses[0].shadow_denied);
    }

    /// envoyproxy/ratelimit's quota mode: a quota-mode descriptor over its limit says so
    /// in its own status; the request is OVER_LIMIT only when every quota-mode
    /// descriptor is over, or when a descriptor not in quota mode is.
    #[test]
    fn quota_mode_denies_only_when_every_quota_descriptor_is_over() {
        let c = EnvoyConfig::from_yaml_str(
            "domain: d\ndescriptors:\n  - key: a\n    quota_mode: true\n    rate_limit: {unit: second, requests_per_unit: 5}\n  - key: b\n    quota_mode: true\n    rate_limit: {unit: second, requests_per_unit: 5}\n  - key: n\n    rate_limit: {unit: second, requests_per_unit: 5}\n",
            AlgorithmKind::FixedWindow,
        )
        .unwrap();
        let input = request(vec![
            one(&[("a", "x")]),
            one(&[("b", "x")]),
            one(&[("n", "x")]),
        ]);
        let plan = || plan_domain(&input, &c).unwrap();
        let p = plan();
        assert!(
            p.items[0].rule.shadow && p.items[1].rule.shadow && !p.items[2].rule.shadow,
            "the cluster never denies for quota mode"
        );
        let outcome = |allowed: [bool; 3]| -> Vec<DescriptorOutcome> {
            let p = plan();
            p.items
                .iter()
                .zip(allowed)
                .map(|(item, allowed)| DescriptorOutcome {
                    item: item.clone(),
                    answer: crate::cluster::Answer {
                        decision: crate::algorithms::Decision {
                            allowed,
                            limit: 5,
                            remaining: if allowed { 2 } else { 0 },
                            retry_after_ms: if allowed { 0 } else { 700 },
                            reset_at_ms: 1_000,
                            window_id: Some(0),
                            delay_ms: 0,
                        },
                        sequence: 1,
                        at: 300,
                        decider: crate::cluster::Decider {
                            node_id: Arc::from("n"),
                            generation: 1,
                        },
                        degraded: false,
                        hops: 0,
                        rule: item.rule.name.clone(),
                        algorithm: AlgorithmKind::FixedWindow,
                        charged: crate::cluster::Charged::Nothing,
                    },
                    refunded: false,
                })
                .collect()
        };
        let one_over = domain_verdict(plan(), &outcome([false, true, true]));
        assert!(one_over.ok, "another quota descriptor still has room");
        assert!(!one_over.statuses[0].ok && !one_over.statuses[0].shadow_denied);
        assert!(one_over.statuses[1].ok && one_over.statuses[2].ok);
        let all_over = domain_verdict(plan(), &outcome([false, false, true]));
        assert!(!all_over.ok, "every quota-mode descriptor is over");
        let enforced = domain_verdict(plan(), &outcome([true, true, false]));
        assert!(!enforced.ok, "a descriptor not in quota mode is over");
        // One that can never admit (requests_per_unit 0) denies only with the others.
        let zero = EnvoyConfig::from_yaml_str(
            "domain: d\ndescriptors:\n  - key: a\n    quota_mode: true\n    rate_limit: {unit: second, requests_per_unit: 0}\n  - key: b\n    quota_mode: true\n    rate_limit: {unit: second, requests_per_unit: 5}\n",
            AlgorithmKind::FixedWindow,
        )
        .unwrap();
        let p = plan_domain(
            &request(vec![one(&[("a", "x")]), one(&[("b", "x")])]),
            &zero,
        )
        .unwrap();
        assert!(!p.items[0].probe, "b still counts");
        let p = plan_domain(&request(vec![one(&[("a", "x")])]), &zero).unwrap();
        assert!(
            !domain_verdict(p, &[]).ok,
            "the only quota descriptor is over"
        );
        assert!(EnvoyConfig::from_yaml_str(
            "domain: d\ndescriptors:\n  - key: a\n    quota_mode: true\n",
            AlgorithmKind::FixedWindow
        )
        .unwrap_err()
        .to_string()
        .contains("quota_mode: needs a rate_limit"));
    }

    #[test]
    fn an_override_limits_an_unmatched_descriptor_of_a_known_domain_only() {
        let c = config();
        let mut d = one(&[("nothing", "configured")]);
        d.limit = Some(LimitOverride {
            requests_per_unit: 3,
            unit: Some(EnvoyUnit::Hour),
        });
        let p = plan_domain(&request(vec![d.clone()]), &c).unwrap();
        let item = &p.items[0];
        assert_eq!(item.rule.spec.limit().get(), 3);
        assert_eq!(
            item.rule.spec.window(),
            std::time::Duration::from_secs(3600)
        );
        assert_eq!(
            item.rule.spec.kind(),
            AlgorithmKind::FixedWindow,
            "the node default"
        );
        let owner = named_rule(&c, item.named.as_ref().unwrap()).unwrap();
        assert_eq!(owner, item.rule, "the owner builds the same rule");
        let mut r = request(vec![d]);
        r.domain = "unknown";
        let p = plan_domain(&r, &c).unwrap();
        assert!(matches!(p.descriptors[0], Planned::NoLimit));
    }
}
