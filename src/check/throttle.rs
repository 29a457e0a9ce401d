//! redis-cell's `CL.THROTTLE key max_burst count period [quantity]`, wire-independent:
//! each call carries its own limit, which is validated here, mapped onto ringlimit's
//! GCRA meter, planned as a [`CheckItem`] for the same router as every other check, and
//! its answer turned back into redis-cell's five integers. `docs/redis-clients.md` has
//! the mapping with worked numbers and every difference from redis-cell.
//!
//! # The mapping
//!
//! redis-cell's GCRA has an emission interval `T = period / count` and a delay
//! variation tolerance `tau = (max_burst + 1) × T`, and admits a quantity `n` when
//! `max(TAT, now) + n × T - now <= tau`. That is ringlimit's GCRA meter
//! ([`crate::algorithms::Gcra::meter`]) at `count` per `period` with a burst of
//! `max_burst + 1`, the same inequality, so the limit it reports (`max_burst + 1`), the
//! remaining quantity, the retry-after and the reset are the same numbers; redis-cell
//! rounds both durations up to whole seconds, and so does [`reply`].
//!
//! - `quantity` 0 peeks: nothing changes, the reply is never limited (redis-cell's);
//! - a quantity above `max_burst + 1` can never fit: limited, retry-after -1, nothing
//!   charged (redis-cell's);
//! - negative numbers, `count` 0 and `period` 0 are refused (redis-cell answers a
//!   negative quantity by moving the schedule back, which gives budget away).
//!
//! Every call's numbers are bounded like Gubernator's per-request limits (the same
//! [`MAX_LIMIT`], [`MAX_WINDOW`] and registry of at most
//! [`MAX_INLINE_RULES`](crate::cluster::MAX_INLINE_RULES) distinct sets of numbers per
//! node), and the owner validates forwarded numbers again
//! ([`inline_rule`](crate::check::gubernator::inline_rule), which builds every inline
//! rule).
//!
//! # Counters of their own
//!
//! Every `CL.THROTTLE` counter is the [`KeyId`](crate::shard::KeyId) of (rule
//! [`THROTTLE_RULE`], client key `len:key`, route part [`THROTTLE_ROUTE`]). No TOML rule
//! name can contain `~`, and Gubernator's rules are named `gubernator~…`, so a Redis
//! client can never read or charge a TOML, Envoy or Gubernator counter, whatever key it
//! sends. Answers come from the key's owner only ([`CheckItem::uncached`]): numbers
//! change per call, so "denied until T" is no fact another call could reuse.

use std::num::NonZeroU64;
use std::sync::Arc;

pub use super::inline::{THROTTLE_ROUTE, THROTTLE_RULE};
use crate::algorithms::{AlgorithmKind, NEVER};
use crate::check::domain::bounded_key;
use crate::check::inline::inline_item;
use crate::check::plan::bounded;
use crate::check::CheckError;
use crate::cluster::{CheckItem, DescriptorOutcome, InlineRule, InlineRules};
use crate::config::bounds::Text;
use crate::config::rules::{Rule, MAX_LIMIT, MAX_WINDOW};

/// Most `CL.THROTTLE` calls decided together (one pipelined read of one connection):
/// the bound a front end batches up to, the same as a Gubernator call's items.
pub const MAX_CALLS: usize = crate::config::bounds::MAX_GUBERNATOR_ITEMS;

/// One call as a front end hands it over, its numbers as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThrottleInput<'a> {
    /// The key limited: 1..=4096 bytes.
    pub key: &'a str,
    /// Units allowed at once beyond the first: 0..`MAX_LIMIT`.
    pub max_burst: i64,
    /// Units per `period`: 1..=`MAX_LIMIT`.
    pub count: i64,
    /// Seconds: 1..=7 days.
    pub period: i64,
    /// Units to take: 0 peeks, default 1.
    pub quantity: i64,
}

/// redis-cell's reply: five integers, in this order on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThrottleReply {
    /// 1 when the call was limited (nothing taken), else 0.
    pub limited: i64,
    /// `max_burst + 1`: what a fresh key takes at once.
    pub limit: i64,
    /// Units that would be admitted right now.
    pub remaining: i64,
    /// Whole seconds (rounded up) until the same call would be admitted; -1 when it
    /// was not limited or could never be.
    pub retry_after: i64,
    /// Whole seconds (rounded up) until the key is back to its full burst.
    pub reset_after: i64,
}

/// What becomes of one valid call.
#[derive(Debug, Clone)]
pub struct PlannedThrottle {
    /// The check the router decides.
    pub item: CheckItem,
    /// Limited whatever the counter says (a quantity above the burst); peeked only.
    pub over_anyway: bool,
    /// `max_burst + 1`, echoed.
    pub limit: i64,
}

fn invalid(field: &str, reason: impl Into<String>) -> CheckError {
    CheckError::invalid(field, reason)
}

/// The numbers of a call's rule, each validated and named by its argument.
fn numbers(input: &ThrottleInput<'_>) -> Result<InlineRule, CheckError> {
    let max = MAX_LIMIT as i64;
    if !(0..max).contains(&input.max_burst) {
        return Err(invalid("max_burst", format!("must be 0..={}", max - 1)));
    }
    if !(1..=max).contains(&input.count) {
        return Err(invalid("count", format!("must be 1..={max}")));
    }
    let max_period = MAX_WINDOW.as_secs() as i64;
    if !(1..=max_period).contains(&input.period) {
        return Err(invalid(
            "period",
            format!("must be 1..={max_period} seconds"),
        ));
    }
    if input.quantity < 0 {
        return Err(invalid(
            "quantity",
            "must be 0 (peek) or more: a negative quantity would give budget away",
        ));
    }
    Ok(InlineRule {
        kind: AlgorithmKind::LeakyBucket,
        limit: input.count as u64,
        window_ms: input.period as u64 * 1000,
        burst: input.max_burst as u64 + 1,
    })
}

/// Validate one call and plan it. An invalid call is its own error (the others of a
/// pipeline are still decided) and charges nothing.
pub fn plan_throttle(
    input: &ThrottleInput<'_>,
    known: &InlineRules,
) -> Result<PlannedThrottle, CheckError> {
    bounded(Text::Entry, input.key, || "key".into())?;
    let inline = numbers(input)?;
    let rule = known
        .rule(&inline, crate::check::gubernator::inline_rule)
        .map_err(|reason| invalid("max_burst", reason))?;
    let over_anyway = input.quantity as u64 > inline.burst;
    let peek = input.quantity == 0 || over_anyway;
    let cost = if peek { 1 } else { input.quantity as u64 };
    let key = bounded_key(format!("{}:{}", input.key.len(), input.key));
    let mut item = throttle_item(
        rule,
        &key,
        NonZeroU64::new(cost).expect("at least 1"),
        inline,
    );
    item.peek = peek;
    Ok(PlannedThrottle {
        item,
        over_anyway,
        limit: inline.burst as i64,
    })
}

/// The item of a `CL.THROTTLE` counter (`key` is the counter key), built as the owner
/// rebuilds a forwarded one ([`inline_item`]).
fn throttle_item(rule: Arc<Rule>, key: &str, cost: NonZeroU64, inline: InlineRule) -> CheckItem {
    inline_item(rule, key, cost, inline)
}

/// Whole seconds of `ms`, rounded up (redis-cell rounds any partial second up).
fn ceil_secs(ms: u64) -> i64 {
    i64::try_from(ms.div_ceil(1000)).unwrap_or(i64::MAX)
}

/// redis-cell's reply for a planned call from the router's outcome. Durations are
/// measured on the deciding node's clock (the decision's `at`), so an entry node's own
/// clock never shifts them.
pub fn reply(planned: &PlannedThrottle, outcome: &DescriptorOutcome) -> ThrottleReply {
    let d = &outcome.answer.decision;
    let limited = planned.over_anyway || (!planned.item.peek && !d.allowed);
    let retry_after = if limited && !planned.over_anyway && d.retry_after_ms != NEVER {
        ceil_secs(d.retry_after_ms)
    } else {
        -1
    };
    ThrottleReply {
        limited: i64::from(limited),
        limit: planned.limit,
        remaining: i64::try_from(d.remaining).unwrap_or(i64::MAX),
        retry_after,
        reset_after: ceil_secs(d.reset_at_ms.saturating_sub(outcome.answer.at)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::rules::{AlgorithmSpec, LeakyMode};
    use std::time::Duration;

    fn call(max_burst: i64, count: i64, period: i64, quantity: i64) -> ThrottleInput<'static> {
        ThrottleInput {
            key: "user123",
            max_burst,
            count,
            period,
            quantity,
        }
    }

    fn plan(input: &ThrottleInput<'_>) -> Result<PlannedThrottle, CheckError> {
        plan_throttle(input, &InlineRules::default())
    }

    fn field(r: Result<PlannedThrottle, CheckError>) -> String {
        match r {
            Err(CheckError::InvalidArgument { field, .. }) => field,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn bad_calls_are_refused_naming_the_argument() {
        let ok = call(15, 30, 60, 1);
        assert!(plan(&ok).is_ok());
        assert_eq!(field(plan(&ThrottleInput { key: "", ..ok })), "key");
        let long = "k".repeat(4097);
        assert_eq!(field(plan(&ThrottleInput { key: &long, ..ok })), "key");
        for max_burst in [-1, MAX_LIMIT as i64, i64::MAX] {
            assert_eq!(field(plan(&ThrottleInput { max_burst, ..ok })), "max_burst");
        }
        for count in [0, -1, MAX_LIMIT as i64 + 1] {
            assert_eq!(field(plan(&ThrottleInput { count, ..ok })), "count");
        }
        for period in [0, -1, 7 * 24 * 3600 + 1, i64::MAX] {
            assert_eq!(field(plan(&ThrottleInput { period, ..ok })), "period");
        }
        assert_eq!(
            field(plan(&ThrottleInput { quantity: -1, ..ok })),
            "quantity"
        );
    }

    #[test]
    fn a_call_is_a_gcra_meter_with_a_burst_of_max_burst_plus_one() {
        let p = plan(&call(15, 30, 60, 1)).unwrap();
        assert_eq!(
            p.item.rule.spec,
            AlgorithmSpec::LeakyBucket {
                limit: NonZeroU64::new(30).unwrap(),
                period: Duration::from_secs(60),
                mode: LeakyMode::Meter {
                    burst: NonZeroU64::new(16).unwrap()
                },
            }
        );
        assert_eq!((p.limit, p.item.cost.get(), p.item.peek), (16, 1, false));
        assert!(p.item.uncached);
        let p = plan(&call(15, 30, 60, 0)).unwrap();
        assert!(p.item.peek && !p.over_anyway, "quantity 0 peeks");
        let p = plan(&call(4, 1, 1, 6)).unwrap();
        assert!(
            p.item.peek && p.over_anyway,
            "more than the burst: peeked, limited"
        );
        let p = plan(&call(4, 1, 1, 5)).unwrap();
        assert_eq!((p.item.peek, p.item.cost.get()), (false, 5));
    }

    #[test]
    fn counters_are_apart_from_gubernators_and_the_owner_rebuilds_the_same_rule() {
        let p = plan(&call(15, 30, 60, 1)).unwrap();
        assert!(p.item.rule.name.contains('~'));
        let g = crate::check::gubernator::plan_item(
            &crate::check::gubernator::RateLimitInput {
                name: "x",
                unique_key: "user123",
                hits: 1,
                limit: 30,
                duration: 60_000,
                algorithm: 1,
                behavior: 0,
                burst: 16,
                created_at: None,
            },
            &InlineRules::default(),
        )
        .unwrap();
        assert_ne!(g.item.id, p.item.id);
        let inline = p.item.named.as_ref().unwrap().inline.unwrap();
        let owner = crate::check::gubernator::inline_rule(&inline).unwrap();
        assert_eq!(owner, p.item.rule);
        let again = throttle_item(owner, p.item.client(), p.item.cost, inline);
        assert_eq!(again.id, p.item.id, "same counter on the owner");
        // (a:b) and (a, b) keys never meet: the key is length-prefixed.
        let q = plan(&ThrottleInput {
            key: "1:x",
            ..call(15, 30, 60, 1)
        })
        .unwrap();
        assert_ne!(q.item.id, p.item.id);
    }

    /// redis-cell's own test table (`it_rate_limits`: limit 5, one per second), played
    /// through the plan, the limiter and [`reply`] on a manual clock. Its durations are
    /// whole seconds here, as redis-cell's command replies them.
    #[test]
    fn redis_cells_worked_example_gives_its_numbers() {
        let known = InlineRules::default();
        let start = 1_700_000_000_000u64;
        let mut state = None;
        // (ms after start, quantity, limited, remaining, retry_after s, reset_after s)
        let cases = [
            (0, 6, 1, 5, -1, 0),
            (0, 1, 0, 4, -1, 1),
            (0, 1, 0, 3, -1, 2),
            (0, 1, 0, 2, -1, 3),
            (0, 1, 0, 1, -1, 4),
            (0, 1, 0, 0, -1, 5),
            (0, 1, 1, 0, 1, 5),
            (3000, 1, 0, 2, -1, 3),
            (3100, 1, 0, 1, -1, 4),
            (4000, 1, 0, 1, -1, 4),
            (8000, 1, 0, 4, -1, 1),
            (9500, 1, 0, 4, -1, 1),
            (9500, 0, 0, 4, -1, 1),
            (9500, 2, 0, 2, -1, 3),
            (9500, 5, 1, 2, 3, 3),
        ];
        for (i, (at, quantity, limited, remaining, retry, reset)) in cases.into_iter().enumerate() {
            let p = plan_throttle(&call(4, 1, 1, quantity), &known).unwrap();
            let limiter = &p.item.rule.limiter;
            let s = state.get_or_insert_with(|| limiter.new_state());
            let now = start + at;
            let d = if p.item.peek {
                limiter.peek(s, now)
            } else {
                limiter.check(s, now, p.item.cost)
            };
            let r = reply(&p, &outcome(&p, d, now));
            assert_eq!(
                (
                    r.limited,
                    r.limit,
                    r.remaining,
                    r.retry_after,
                    r.reset_after
                ),
                (limited, 5, remaining, retry, reset),
                "case {i}"
            );
        }
    }

    /// The owner's outcome of a planned call: `decision`, decided at `at`.
    fn outcome(
        p: &PlannedThrottle,
        decision: crate::algorithms::Decision,
        at: u64,
    ) -> DescriptorOutcome {
        use crate::cluster::{Answer, Charged, Decider};
        DescriptorOutcome {
            item: p.item.clone(),
            answer: Answer {
                decision,
                sequence: 1,
                at,
                decider: Decider {
                    node_id: Arc::from("a"),
                    generation: 1,
                },
                degraded: false,
                hops: 0,
                rule: p.item.rule.name.clone(),
                algorithm: AlgorithmKind::LeakyBucket,
                charged: Charged::Nothing,
            },
            refunded: false,
        }
    }

    proptest::proptest! {
        /// Any numbers a caller can send: never a panic or an overflow; a planned call's
        /// rule is within the bounds and its cost within what the counter can hold.
        #[test]
        fn any_call_is_planned_within_bounds_or_refused(
            max_burst in proptest::prop_oneof![proptest::prelude::any::<i64>(), -2i64..2_000_000_000],
            count in proptest::prop_oneof![proptest::prelude::any::<i64>(), -2i64..2_000_000_000],
            period in proptest::prop_oneof![proptest::prelude::any::<i64>(), -2i64..700_000],
            quantity in proptest::prop_oneof![proptest::prelude::any::<i64>(), -2i64..2_000_000_000],
        ) {
            let input = ThrottleInput { key: "k", max_burst, count, period, quantity };
            if let Ok(p) = plan(&input) {
                let rule = &p.item.rule;
                proptest::prop_assert!(rule.spec.limit().get() <= MAX_LIMIT);
                proptest::prop_assert!(rule.spec.window() <= MAX_WINDOW);
                proptest::prop_assert!(p.item.cost.get() <= rule.limiter.max_cost());
                proptest::prop_assert_eq!(p.limit, max_burst + 1);
                proptest::prop_assert!(p.item.uncached);
            }
        }
    }
}
