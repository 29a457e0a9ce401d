//! Gubernator's rate limits (`pb.gubernator.V1/GetRateLimits`), wire-independent: each
//! item carries its own limit, which is validated here, mapped onto one of ringlimit's
//! algorithms, planned as a [`CheckItem`] for the same router as every other check, and
//! its answer turned back into Gubernator's numbers. `docs/gubernator.md` has the
//! mapping with worked examples and every difference from Gubernator.
//!
//! - `TOKEN_BUCKET` (Gubernator: `limit` hits per `duration`, the whole budget back when
//!   the duration is over) is ringlimit's fixed window: `limit` per window of `duration`.
//!   ringlimit's windows are aligned to multiples of the duration since the Unix epoch,
//!   Gubernator's start at a key's first hit.
//! - `LEAKY_BUCKET` (Gubernator: `burst` capacity, default `limit`, leaking `limit` per
//!   `duration`) is ringlimit's token bucket: capacity `burst`, refilled with `limit`
//!   tokens per `duration`, continuously (to the millisecond).
//!
//! What a caller says per item, decided here for any front end that speaks it:
//!
//! - `hits > 0` are charged; more than the counter can ever hold are OVER_LIMIT without
//!   charging (unless draining);
//! - `hits == 0` reports: a peek at the counter on its owner's shard, which changes
//!   nothing (Envoy's `hits_addend = 0` probes and gives the unit back; a peek reports
//!   the token bucket's reset exactly, which a probe would report one unit late);
//! - `hits < 0` gives that many back (never beyond a full counter), then reports;
//! - `RESET_REMAINING` gives everything back first (the token bucket then reports, as
//!   Gubernator's does; the leaky bucket then takes its hits);
//! - `DRAIN_OVER_LIMIT`: a denied item takes what the counter still holds;
//! - `DURATION_IS_GREGORIAN`: `duration` is a calendar unit: minute, hour or day (UTC),
//!   which are exactly ringlimit's aligned windows of 60 s, 1 h and 24 h;
//! - `GLOBAL`, `NO_BATCHING`, `MULTI_REGION` are accepted and change nothing: every
//!   answer comes from the key's owner, so it is already exact.
//!
//! The give-back, reset and drain happen on the owner's shard in the same step as the
//! check ([`Charge::give_back`](crate::shard::Charge::give_back)), and Gubernator items
//! are never answered from a deny cache ([`CheckItem::uncached`]): a reset must be seen
//! by the very next hit, from whichever node it comes.
//!
//! # Counters of their own
//!
//! Every Gubernator counter is the [`KeyId`](crate::shard::KeyId) of (rule
//! `gubernator~<algorithm>`, client key `len:name len:unique_key`, route part
//! `/gubernator`). No TOML rule name can contain `~`, and no Envoy counter has a route
//! part, so a Gubernator request can never read or charge a TOML or Envoy counter,
//! whatever names and keys it sends.

use std::num::NonZeroU64;
use std::sync::Arc;

use crate::algorithms::AlgorithmKind;
use crate::check::domain::bounded_key;
use crate::check::plan::bounded;
use crate::check::CheckError;
use crate::cluster::{CheckItem, DescriptorOutcome, InlineRule};
use crate::config::rules::{MAX_LIMIT, MAX_WINDOW};

pub use super::inline::{inline_item, inline_rule, GUBERNATOR_ROUTE};
pub use crate::cluster::{InlineRules, MAX_INLINE_RULES};
use crate::config::bounds::Text;
/// Most items in one `GetRateLimits` call (Gubernator's own bound).
pub use crate::config::bounds::MAX_GUBERNATOR_ITEMS as MAX_ITEMS;

/// Gubernator's `Behavior` flags (its enum values, OR-ed together).
pub mod behavior {
    /// Accepted: every answer is the owner's.
    pub const NO_BATCHING: i32 = 1;
    /// Accepted: every answer is the owner's, so it is already exact.
    pub const GLOBAL: i32 = 2;
    /// `duration` is a calendar unit.
    pub const DURATION_IS_GREGORIAN: i32 = 4;
    /// Give everything back before deciding.
    pub const RESET_REMAINING: i32 = 8;
    /// Accepted: one region.
    pub const MULTI_REGION: i32 = 16;
    /// A denied item takes what is left.
    pub const DRAIN_OVER_LIMIT: i32 = 32;
    /// Every flag ringlimit knows.
    pub const KNOWN: i32 = NO_BATCHING
        | GLOBAL
        | DURATION_IS_GREGORIAN
        | RESET_REMAINING
        | MULTI_REGION
        | DRAIN_OVER_LIMIT;
}

/// Gubernator's two algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GubernatorAlgorithm {
    /// `TOKEN_BUCKET` (0): ringlimit's fixed window.
    TokenBucket,
    /// `LEAKY_BUCKET` (1): ringlimit's token bucket.
    LeakyBucket,
}

impl GubernatorAlgorithm {
    /// The algorithm of a wire value; `None` for a value Gubernator does not define.
    pub fn of(wire: i32) -> Option<Self> {
        match wire {
            0 => Some(Self::TokenBucket),
            1 => Some(Self::LeakyBucket),
            _ => None,
        }
    }
}

/// One item as a front end hands it over (Gubernator's `RateLimitReq`), borrowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimitInput<'a> {
    /// The limit's name (Gubernator's namespace for keys): 1..=4096 bytes.
    pub name: &'a str,
    /// Who is limited: 1..=4096 bytes.
    pub unique_key: &'a str,
    /// Hits to charge; 0 reports, negative gives back.
    pub hits: i64,
    /// 1..=[`MAX_LIMIT`].
    pub limit: i64,
    /// ms (1..=7 days), or a calendar unit with `DURATION_IS_GREGORIAN`.
    pub duration: i64,
    /// The wire value of the algorithm (0 token bucket, 1 leaky bucket).
    pub algorithm: i32,
    /// [`behavior`] flags.
    pub behavior: i32,
    /// Leaky bucket capacity; 0 means `limit`.
    pub burst: i64,
    /// The caller's clock (Unix ms): accepted, not used (the owner's clock decides).
    pub created_at: Option<i64>,
}

/// One item's answer in Gubernator's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitStatus {
    /// `OVER_LIMIT` rather than `UNDER_LIMIT`.
    pub over_limit: bool,
    /// The item's limit, as sent.
    pub limit: i64,
    /// Hits left now.
    pub remaining: i64,
    /// When the full budget is back (Unix ms).
    pub reset_time_ms: i64,
    /// The node that decided (its id).
    pub owner: Arc<str>,
}

/// What becomes of one valid item.
#[derive(Debug, Clone)]
pub struct PlannedItem {
    /// The check the router decides (one per item: items are independent).
    pub item: CheckItem,
    /// Reported as OVER_LIMIT whatever the counter says (more hits than it can hold).
    pub over_anyway: bool,
    /// The limit as sent, echoed.
    pub limit: i64,
}

fn invalid(field: &str, reason: impl Into<String>) -> CheckError {
    CheckError::invalid(field, reason)
}

/// The window of a calendar unit (Gubernator's `GregorianMinutes` … `GregorianYears`),
/// for the units that are aligned windows of a fixed length in UTC.
fn gregorian(unit: i64) -> Result<u64, CheckError> {
    match unit {
        0 => Ok(60_000),
        1 => Ok(3_600_000),
        2 => Ok(86_400_000),
        3..=5 => Err(invalid(
            "duration",
            "with DURATION_IS_GREGORIAN, 0 (minute), 1 (hour) or 2 (day) are supported: \
             weeks, months and years are not windows of one fixed length aligned to the \
             Unix epoch, which is what ringlimit counts in",
        )),
        _ => Err(invalid(
            "duration",
            format!("{unit} is not a Gregorian unit (0 minute … 5 year)"),
        )),
    }
}

/// The counter key of (name, unique_key): length-prefixed, so no two pairs collide, and
/// bounded like every counter key.
fn counter_key(name: &str, unique_key: &str) -> String {
    bounded_key(format!(
        "{}:{name}{}:{unique_key}",
        name.len(),
        unique_key.len()
    ))
}

/// Validate one item and plan it. An invalid item is its own error (the others are
/// still decided), and charges nothing.
pub fn plan_item(
    input: &RateLimitInput<'_>,
    known: &InlineRules,
) -> Result<PlannedItem, CheckError> {
    bounded(Text::Entry, input.name, || "name".into())?;
    bounded(Text::Entry, input.unique_key, || "unique_key".into())?;
    let (algorithm, inline) = validated_rule(input)?;
    let rule = known
        .rule(&inline, inline_rule)
        .map_err(|reason| invalid("limit", reason))?;
    let charge = charge(input, algorithm, rule.limiter.max_cost());
    let mut item = inline_item(
        rule,
        &counter_key(input.name, input.unique_key),
        charge.cost,
        inline,
    );
    item.peek = charge.probe;
    item.give_back = charge.give_back;
    item.drain = charge.drain;
    Ok(PlannedItem {
        item,
        over_anyway: charge.over_anyway,
        limit: input.limit,
    })
}

/// The item's algorithm and the numbers of its inline rule, each validated.
fn validated_rule(
    input: &RateLimitInput<'_>,
) -> Result<(GubernatorAlgorithm, InlineRule), CheckError> {
    let algorithm = GubernatorAlgorithm::of(input.algorithm).ok_or_else(|| {
        invalid(
            "algorithm",
            format!(
                "{} is not an algorithm (0 TOKEN_BUCKET, 1 LEAKY_BUCKET)",
                input.algorithm
            ),
        )
    })?;
    if input.behavior & !behavior::KNOWN != 0 {
        return Err(invalid(
            "behavior",
            format!("{:#x} has flags Gubernator does not define", input.behavior),
        ));
    }
    if input.limit < 1 || input.limit as u64 > MAX_LIMIT {
        return Err(invalid("limit", format!("must be 1..={MAX_LIMIT}")));
    }
    let limit = input.limit as u64;
    let window_ms = if input.behavior & behavior::DURATION_IS_GREGORIAN != 0 {
        gregorian(input.duration)?
    } else if input.duration < 1 || input.duration as u128 > MAX_WINDOW.as_millis() {
        return Err(invalid(
            "duration",
            format!("must be 1..={} ms", MAX_WINDOW.as_millis()),
        ));
    } else {
        input.duration as u64
    };
    if input.created_at.is_some_and(|t| t < 0) {
        return Err(invalid("created_at", "must not be negative"));
    }
    let inline = match algorithm {
        GubernatorAlgorithm::TokenBucket => InlineRule {
            kind: AlgorithmKind::FixedWindow,
            limit,
            window_ms,
            burst: 0,
        },
        GubernatorAlgorithm::LeakyBucket => {
            if input.burst < 0 || input.burst as u64 > MAX_LIMIT {
                return Err(invalid("burst", format!("must be 0..={MAX_LIMIT}")));
            }
            InlineRule {
                kind: AlgorithmKind::TokenBucket,
                limit,
                window_ms,
                burst: if input.burst == 0 {
                    limit
                } else {
                    input.burst as u64
                },
            }
        }
    };
    Ok((algorithm, inline))
}

/// What an item does to its counter, from its hits and behaviours.
struct Charge {
    cost: NonZeroU64,
    /// Report, change nothing (after any give-back).
    probe: bool,
    /// OVER_LIMIT whatever the counter says.
    over_anyway: bool,
    give_back: Option<NonZeroU64>,
    drain: bool,
}

/// The charge of an item whose counter holds at most `capacity`.
fn charge(input: &RateLimitInput<'_>, algorithm: GubernatorAlgorithm, capacity: u64) -> Charge {
    let has = |flag: i32| input.behavior & flag != 0;
    let reset = has(behavior::RESET_REMAINING);
    let drain = has(behavior::DRAIN_OVER_LIMIT);
    // Gubernator's token bucket answers a reset with the full budget, ignoring hits.
    let hits = if reset && algorithm == GubernatorAlgorithm::TokenBucket {
        0
    } else {
        input.hits
    };
    let mut give_back = reset.then_some(NonZeroU64::MAX);
    let (cost, probe, over_anyway) = if hits > 0 && hits.unsigned_abs() > capacity {
        // More than the counter can ever hold: OVER_LIMIT, nothing charged, unless
        // draining (then take everything there is).
        if drain {
            (capacity, false, true)
        } else {
            (1, true, true)
        }
    } else if hits > 0 {
        (hits as u64, false, false)
    } else {
        if hits < 0 {
            give_back = give_back.or(NonZeroU64::new(hits.unsigned_abs()));
        }
        (1, true, false)
    };
    Charge {
        cost: NonZeroU64::new(cost).expect("at least 1"),
        probe,
        over_anyway,
        give_back,
        drain: drain && !probe,
    }
}

/// Gubernator's answer for a planned item from the router's outcome.
pub fn status(planned: &PlannedItem, outcome: &DescriptorOutcome) -> RateLimitStatus {
    let d = &outcome.answer.decision;
    RateLimitStatus {
        over_limit: planned.over_anyway || !d.allowed,
        limit: planned.limit,
        remaining: i64::try_from(d.remaining).unwrap_or(i64::MAX),
        reset_time_ms: i64::try_from(d.reset_at_ms).unwrap_or(i64::MAX),
        owner: outcome.answer.decider.node_id.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::rules::AlgorithmSpec;
    use std::time::Duration;

    fn item(algorithm: i32, hits: i64, limit: i64, duration: i64) -> RateLimitInput<'static> {
        RateLimitInput {
            name: "requests_per_sec",
            unique_key: "account:12345",
            hits,
            limit,
            duration,
            algorithm,
            behavior: 0,
            burst: 0,
            created_at: None,
        }
    }

    fn plan(input: &RateLimitInput<'_>) -> Result<PlannedItem, CheckError> {
        plan_item(input, &InlineRules::default())
    }

    #[test]
    fn a_node_builds_each_inline_rule_once_and_refuses_new_ones_beyond_the_cap() {
        let known = InlineRules::default();
        let a = plan_item(&item(0, 1, 10, 1000), &known).unwrap();
        let b = plan_item(&item(0, 1, 10, 1000), &known).unwrap();
        assert!(Arc::ptr_eq(&a.item.rule, &b.item.rule));
        for limit in 1..MAX_INLINE_RULES as i64 {
            plan_item(&item(1, 1, limit, 1000), &known).unwrap();
        }
        assert_eq!(known.planned(), MAX_INLINE_RULES);
        let err = plan_item(&item(1, 1, MAX_INLINE_RULES as i64, 1000), &known).unwrap_err();
        assert!(
            err.to_string().contains("distinct Gubernator limits"),
            "{err}"
        );
        // Known numbers are still served, and invalid ones still say why.
        assert!(plan_item(&item(0, 1, 10, 1000), &known).is_ok());
        assert_eq!(field(plan_item(&item(0, 1, 0, 1000), &known)), "limit");
    }

    fn field(r: Result<PlannedItem, CheckError>) -> String {
        match r {
            Err(CheckError::InvalidArgument { field, .. }) => field,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn bad_items_are_refused_naming_the_field() {
        let ok = item(0, 1, 10, 1000);
        assert!(plan(&ok).is_ok());
        assert_eq!(field(plan(&RateLimitInput { name: "", ..ok })), "name");
        assert_eq!(
            field(plan(&RateLimitInput {
                unique_key: "",
                ..ok
            })),
            "unique_key"
        );
        for limit in [0, -1, MAX_LIMIT as i64 + 1] {
            assert_eq!(field(plan(&RateLimitInput { limit, ..ok })), "limit");
        }
        for duration in [0, -5, 7 * 24 * 3600 * 1000 + 1] {
            assert_eq!(field(plan(&RateLimitInput { duration, ..ok })), "duration");
        }
        assert_eq!(
            field(plan(&RateLimitInput { algorithm: 2, ..ok })),
            "algorithm"
        );
        assert_eq!(
            field(plan(&RateLimitInput { behavior: 64, ..ok })),
            "behavior"
        );
        let leaky = item(1, 1, 10, 1000);
        assert_eq!(field(plan(&RateLimitInput { burst: -1, ..leaky })), "burst");
        let greg = RateLimitInput {
            behavior: behavior::DURATION_IS_GREGORIAN,
            ..ok
        };
        for unit in [3, 4, 5, 6, -1] {
            assert_eq!(
                field(plan(&RateLimitInput {
                    duration: unit,
                    ..greg
                })),
                "duration",
                "unit {unit}"
            );
        }
        assert_eq!(
            field(plan(&RateLimitInput {
                created_at: Some(-1),
                ..ok
            })),
            "created_at"
        );
    }

    #[test]
    fn algorithms_map_onto_a_fixed_window_and_a_token_bucket() {
        let p = plan(&item(0, 2, 10, 60_000)).unwrap();
        assert_eq!(
            p.item.rule.spec,
            AlgorithmSpec::FixedWindow {
                limit: NonZeroU64::new(10).unwrap(),
                window: Duration::from_secs(60)
            }
        );
        assert_eq!(p.item.cost.get(), 2);
        let p = plan(&RateLimitInput {
            burst: 20,
            ..item(1, 1, 10, 1_000)
        })
        .unwrap();
        assert_eq!(
            p.item.rule.spec,
            AlgorithmSpec::TokenBucket {
                capacity: NonZeroU64::new(20).unwrap(),
                refill: NonZeroU64::new(10).unwrap(),
                period: Duration::from_secs(1)
            }
        );
        let p = plan(&item(1, 1, 10, 1_000)).unwrap();
        assert_eq!(p.item.rule.limiter.max_cost(), 10, "burst 0 means limit");
        let p = plan(&RateLimitInput {
            behavior: behavior::DURATION_IS_GREGORIAN,
            ..item(0, 1, 10, 1)
        })
        .unwrap();
        assert_eq!(p.item.rule.spec.window(), Duration::from_secs(3600));
    }

    #[test]
    fn hits_zero_reports_negative_gives_back_and_too_many_are_over_without_charge() {
        let p = plan(&item(0, 0, 10, 1000)).unwrap();
        assert!(p.item.peek && p.item.give_back.is_none() && !p.over_anyway);
        let p = plan(&item(0, -3, 10, 1000)).unwrap();
        assert!(p.item.peek);
        assert_eq!(p.item.give_back, NonZeroU64::new(3));
        let p = plan(&item(0, 11, 10, 1000)).unwrap();
        assert!(p.item.peek && p.over_anyway);
        let p = plan(&RateLimitInput {
            behavior: behavior::DRAIN_OVER_LIMIT,
            ..item(0, 11, 10, 1000)
        })
        .unwrap();
        assert!(!p.item.peek && p.over_anyway && p.item.drain);
        assert_eq!(p.item.cost.get(), 10, "takes everything there is");
    }

    #[test]
    fn a_reset_gives_everything_back_and_the_token_bucket_then_only_reports() {
        let reset = behavior::RESET_REMAINING;
        let p = plan(&RateLimitInput {
            behavior: reset,
            ..item(0, 4, 10, 1000)
        })
        .unwrap();
        assert_eq!(p.item.give_back, Some(NonZeroU64::MAX));
        assert!(
            p.item.peek,
            "Gubernator's token bucket ignores hits on a reset"
        );
        let p = plan(&RateLimitInput {
            behavior: reset,
            ..item(1, 4, 10, 1000)
        })
        .unwrap();
        assert_eq!(p.item.give_back, Some(NonZeroU64::MAX));
        assert_eq!((p.item.peek, p.item.cost.get()), (false, 4));
    }

    #[test]
    fn counters_live_in_their_own_namespace_and_the_owner_rebuilds_the_same_rule() {
        let p = plan(&item(1, 1, 10, 1000)).unwrap();
        assert!(p.item.rule.name.contains('~'), "no TOML rule name has a ~");
        assert_eq!(p.item.normalised_route(), GUBERNATOR_ROUTE);
        assert!(p.item.uncached);
        let named = p.item.named.as_ref().unwrap();
        let owner = inline_rule(named.inline.as_ref().unwrap()).unwrap();
        assert_eq!(owner, p.item.rule);
        let again = inline_item(owner, p.item.client(), p.item.cost, named.inline.unwrap());
        assert_eq!(again.id, p.item.id, "same counter on the owner");
        // (a, bc) and (ab, c) are different counters.
        assert_ne!(counter_key("a", "bc"), counter_key("ab", "c"));
    }

    #[test]
    fn the_owner_refuses_inline_numbers_out_of_bounds() {
        let ok = InlineRule {
            kind: AlgorithmKind::TokenBucket,
            limit: 10,
            window_ms: 1000,
            burst: 10,
        };
        assert!(inline_rule(&ok).is_ok());
        for bad in [
            InlineRule { limit: 0, ..ok },
            InlineRule {
                limit: MAX_LIMIT + 1,
                ..ok
            },
            InlineRule { window_ms: 0, ..ok },
            InlineRule {
                window_ms: u64::MAX,
                ..ok
            },
            InlineRule { burst: 0, ..ok },
            InlineRule {
                burst: u64::MAX,
                ..ok
            },
            InlineRule {
                kind: AlgorithmKind::SlidingWindowLog,
                ..ok
            },
            InlineRule {
                kind: AlgorithmKind::FixedWindow,
                ..ok
            },
        ] {
            assert!(inline_rule(&bad).is_err(), "{bad:?}");
        }
    }

    proptest::proptest! {
        /// Any numbers a caller can send: never a panic or an overflow; a planned item's
        /// rule is within the bounds and its cost within what the counter can hold.
        #[test]
        fn any_item_is_planned_within_bounds_or_refused(
            hits in proptest::prelude::any::<i64>(),
            limit in proptest::prop_oneof![proptest::prelude::any::<i64>(), -2i64..2_000_000_000],
            duration in proptest::prop_oneof![proptest::prelude::any::<i64>(), -2i64..700_000_000],
            algorithm in -2i32..4,
            behavior in proptest::prelude::any::<i32>(),
            burst in proptest::prop_oneof![proptest::prelude::any::<i64>(), -2i64..2_000_000_000],
            created_at in proptest::option::of(proptest::prelude::any::<i64>()),
        ) {
            let input = RateLimitInput {
                name: "n",
                unique_key: "k",
                hits,
                limit,
                duration,
                algorithm,
                behavior,
                burst,
                created_at,
            };
            if let Ok(p) = plan(&input) {
                let rule = &p.item.rule;
                proptest::prop_assert!(rule.spec.limit().get() <= MAX_LIMIT);
                proptest::prop_assert!(rule.spec.window() <= MAX_WINDOW);
                proptest::prop_assert!(p.item.cost.get() <= rule.limiter.max_cost());
                proptest::prop_assert_eq!(p.limit, limit);
                proptest::prop_assert!(p.item.uncached);
                let inline = p.item.named.as_ref().unwrap().inline.unwrap();
                proptest::prop_assert_eq!(&inline_rule(&inline).unwrap(), rule);
            }
        }
    }
}
