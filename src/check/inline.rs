//! Rules a request carries itself (Gubernator's numbers, `CL.THROTTLE`'s) and the
//! items of their counters: one place builds both, for the front end that plans a call
//! and for the owner that rebuilds the rule from a forwarded item's numbers (which it
//! validates again: a peer is not trusted to have checked them).

use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use crate::algorithms::AlgorithmKind;
use crate::cluster::{CheckItem, InlineRule, NamedRule};
use crate::config::route::Route;
use crate::config::rules::{
    AlgorithmSpec, CountPer, FailMode, LeakyMode, Rule, MAX_LIMIT, MAX_WINDOW,
};

/// The route part of every Gubernator counter (see `check::gubernator`).
pub const GUBERNATOR_ROUTE: &str = "/gubernator";
/// The rule name of every `CL.THROTTLE` counter: see the module docs.
pub const THROTTLE_RULE: &str = "redis~cl.throttle";
/// The route part of every `CL.THROTTLE` counter.
pub const THROTTLE_ROUTE: &str = "/cl.throttle";

/// Validate an inline rule's numbers and build its rule: what the sender does when it
/// plans an item, and what the owner does again with the numbers a peer forwarded
/// (bounded like any input: a peer is not trusted to have checked them). A leaky
/// bucket (GCRA) is `CL.THROTTLE`'s ([`throttle_rule`]).
pub fn inline_rule(inline: &InlineRule) -> Result<Arc<Rule>, String> {
    if inline.kind == AlgorithmKind::LeakyBucket {
        return throttle_rule(inline);
    }
    let limit = NonZeroU64::new(inline.limit)
        .filter(|l| l.get() <= MAX_LIMIT)
        .ok_or_else(|| format!("limit must be 1..={MAX_LIMIT}"))?;
    let window = Duration::from_millis(inline.window_ms);
    if inline.window_ms == 0 || window > MAX_WINDOW {
        return Err(format!(
            "duration must be 1..={} ms",
            MAX_WINDOW.as_millis()
        ));
    }
    let (spec, name) = match inline.kind {
        AlgorithmKind::FixedWindow if inline.burst == 0 => (
            AlgorithmSpec::FixedWindow { limit, window },
            "gubernator~token_bucket",
        ),
        AlgorithmKind::TokenBucket => {
            let capacity = NonZeroU64::new(inline.burst)
                .filter(|b| b.get() <= MAX_LIMIT)
                .ok_or_else(|| format!("burst must be 1..={MAX_LIMIT}"))?;
            (
                AlgorithmSpec::TokenBucket {
                    capacity,
                    refill: limit,
                    period: window,
                },
                "gubernator~leaky_bucket",
            )
        }
        other => {
            return Err(format!(
                "an inline rule is a fixed_window (burst 0), a token_bucket or a \
                 leaky_bucket, not {} with burst {}",
                other.as_str(),
                inline.burst
            ))
        }
    };
    // Fail closed: an unreachable owner is an error for the item, as in Gubernator,
    // rather than a guess under a share of a limit the caller chose.
    Rule::unlisted(name, spec, FailMode::Closed, CountPer::Route)
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

/// The rule of `CL.THROTTLE` numbers: a GCRA meter at `limit` per `window_ms` with a
/// burst of `burst`. Called through [`inline_rule`] for a forwarded or handed-over counter, so it validates as for any input.
pub fn throttle_rule(inline: &InlineRule) -> Result<Arc<Rule>, String> {
    let limit = NonZeroU64::new(inline.limit)
        .filter(|l| l.get() <= MAX_LIMIT)
        .ok_or_else(|| format!("count must be 1..={MAX_LIMIT}"))?;
    let burst = NonZeroU64::new(inline.burst)
        .filter(|b| b.get() <= MAX_LIMIT)
        .ok_or_else(|| format!("max_burst + 1 must be 1..={MAX_LIMIT}"))?;
    let period = Duration::from_millis(inline.window_ms);
    if inline.window_ms == 0 || period > MAX_WINDOW {
        return Err(format!("period must be 1..={} s", MAX_WINDOW.as_secs()));
    }
    let spec = AlgorithmSpec::LeakyBucket {
        limit,
        period,
        mode: LeakyMode::Meter { burst },
    };
    // Fail closed: an unreachable owner is an error for the call (redis-cell has no
    // fallback either), rather than a guess under a share of a limit the caller chose.
    Rule::unlisted(THROTTLE_RULE, spec, FailMode::Closed, CountPer::Route)
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

/// The item for a counter under an inline rule (Gubernator's, or `CL.THROTTLE`'s GCRA,
/// whose route part is [`THROTTLE_ROUTE`]): what the
/// sender plans and what the owner rebuilds from a forwarded item (`key` is the counter
/// key).
pub fn inline_item(rule: Arc<Rule>, key: &str, cost: NonZeroU64, inline: InlineRule) -> CheckItem {
    let route = if inline.kind == AlgorithmKind::LeakyBucket {
        THROTTLE_ROUTE
    } else {
        GUBERNATOR_ROUTE
    };
    let route = Route::parse(route).expect("a route");
    let named = NamedRule {
        name: rule.name.clone(),
        override_limit: None,
        inline: Some(inline),
    };
    let mut item = CheckItem::new(rule, key, route, None, cost).named(named);
    item.uncached = true;
    item
}
