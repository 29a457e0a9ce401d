//! Rate-limit rules: the TOML rule file, its validation, and the hot-path matcher.
//!
//! A rule says *how much* (algorithm, limit, window) for *whom* (a client key, a tier, a
//! route, or a combination). Every check is matched against the rule set to find the one rule
//! that governs it; the most specific rule wins. A node without a rule file uses the built-in
//! default, a sliding window counter of 100 requests per 60 s, so `ringlimit serve` works out
//! of the box.
//!
//! # File format
//!
//! ```toml
//! # Optional. Applies to every check no rule below matches. Without this section the
//! # built-in default applies: sliding_window_counter, 100 per 60s.
//! [default]
//! algorithm = "sliding_window_counter"
//! limit = 100
//! window = "60s"
//!
//! [[rule]]
//! name = "free-charges"           # required, unique, 1..=64 chars of [A-Za-z0-9_.-]
//! tier = "free"                   # optional
//! route = "POST /v1/charges"      # optional route pattern
//! algorithm = "token_bucket"      # default sliding_window_counter
//! limit = 10                      # required
//! window = "1m"                   # required
//! burst = 20                      # token bucket capacity (default = limit)
//! on_unavailable = "closed"       # optional: "open" (default) or "closed"
//!
//! [[rule]]
//! name = "vip-customer"
//! client = "cust_42"              # an exact client key
//! limit = 1000
//! window = "60s"
//!
//! [[rule]]
//! name = "search-shaped"
//! route = "GET /v1/search*"       # no client or tier: the default for this route
//! algorithm = "leaky_bucket"
//! mode = "shaper"
//! queue_depth = 5
//! limit = 20
//! window = "1s"
//! ```
//!
//! ## Fields
//!
//! | field            | where         | meaning |
//! |------------------|---------------|---------|
//! | `name`           | rule          | Required, unique, 1..=64 characters of `A-Z a-z 0-9 _ . -`. `default` is reserved for the `[default]` section. Reported with every decision. |
//! | `client`         | rule          | An exact client key (1..=256 bytes). Applies whatever the caller's tier, so it cannot be combined with `tier`. |
//! | `tier`           | rule          | A tier name (1..=256 bytes) sent by the caller with the check. |
//! | `route`          | rule          | A route pattern: `METHOD /path`, `/path` (any method), `* /path` (any method), a trailing `*` for a prefix (`/v1/*`), or `*` for any route. |
//! | `algorithm`      | both          | `token_bucket`, `leaky_bucket`, `fixed_window`, `sliding_window_log` or `sliding_window_counter` (default). |
//! | `limit`          | both          | Required. Units admitted per window, 1..=1,000,000,000. Token bucket: tokens refilled per window. Leaky bucket: drain rate per window. Sliding window log: at most 100,000 (it stores 16 bytes per admitted request, per key). |
//! | `window`         | both          | Required. An integer and a unit: `500ms`, `10s`, `1m`, `1h`, `1d`; between 1 ms and 7 days. |
//! | `burst`          | both          | Token bucket: capacity (default = `limit`). Leaky bucket meter: requests that may arrive at once (default 1). 1..=1,000,000,000. Not allowed with other algorithms. |
//! | `mode`           | both          | Leaky bucket only: `meter` (default; rejects early arrivals) or `shaper` (admits them with a delay). |
//! | `queue_depth`    | both          | Leaky bucket shaper only: how many requests may wait for their delay, 0..=1,000,000 (default 0). |
//! | `on_unavailable` | both          | What a node does when the key's owner is unreachable: `open` (default; decide locally, flagged as degraded) or `closed` (deny). |
//!
//! A `[[rule]]` must name at least one of `client`, `tier`, `route`; a rule matching
//! everything belongs in `[default]`. Two rules may not have the same (`client`, `tier`,
//! `route`) selector. Unknown fields are errors, so a typo never silently becomes a default.
//!
//! ## Which rule applies
//!
//! For a check with client key `c`, optional tier `t` and optional route `r`, the first level
//! that has a matching rule wins:
//!
//! 1. a rule with `client = c` and a `route` pattern matching `r`,
//! 2. a rule with `client = c` and no `route`,
//! 3. a rule with `tier = t` and a `route` pattern matching `r`,
//! 4. a rule with `tier = t` and no `route`,
//! 5. a rule with only a `route` pattern matching `r` (the default for that route),
//! 6. the `[default]` rule.
//!
//! Within one level the most specific pattern wins: an exact path beats a prefix, a longer
//! prefix beats a shorter one, and then a named method beats any method. A check without a
//! route only matches rules without a `route`.
//!
//! ## Errors
//!
//! TOML syntax and type errors are reported with their line and column. All other problems
//! are collected and reported together, one per line, each naming the rule and the field:
//!
//! ```text
//! rule "free-charges": field "limit": must be an integer >= 1 (got 0)
//! rule "x": field "window": "10q" is not a duration (use 500ms, 10s, 1m, 1h, 1d)
//! ```

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::fmt;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use super::route::{Route, RoutePattern};
use crate::algorithms::{
    AlgorithmError, FixedWindow, Gcra, Limiter, SlidingCounter, SlidingLog, TokenBucket,
};

/// Largest `limit`/`burst`: beyond a billion per window the numbers stop being a rate limit
/// and start risking overflow in the algorithms' arithmetic.
pub const MAX_LIMIT: u64 = 1_000_000_000;

/// Largest `limit` for the sliding window log, which keeps one timestamp per admitted request
/// per key; 100,000 × 16 bytes is already 1.6 MB for a single key.
pub const MAX_LOG_LIMIT: u64 = 100_000;

/// Bytes the sliding window log keeps per admitted request, quoted in the error message.
pub const LOG_BYTES_PER_ENTRY: u64 = 16;

/// Largest `queue_depth` for a leaky-bucket shaper; deeper queues only hide overload.
pub const MAX_QUEUE_DEPTH: u64 = 1_000_000;

/// Shortest window: the clocks are millisecond-granular, so a shorter window cannot be told
/// apart from zero.
pub const MIN_WINDOW: Duration = Duration::from_millis(1);

/// Longest window: state must expire within a bounded time for memory to stay bounded.
pub const MAX_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);

/// Longest client key or tier name a rule may name; matches the bound on keys in checks.
pub const MAX_KEY_LEN: usize = 256;

/// Longest rule name; names appear in every answer and metric label.
pub const MAX_NAME_LEN: usize = 64;

/// Name of the rule built from `[default]` (or the built-in default); reserved for it.
pub const DEFAULT_RULE_NAME: &str = "default";

/// The limit of the built-in default rule, from the design reference.
pub const BUILTIN_LIMIT: u64 = 100;

/// The window of the built-in default rule, from the design reference.
pub const BUILTIN_WINDOW: Duration = Duration::from_secs(60);

/// Name suffix of the fail-open stand-ins built by [`Rule::fallback`].
pub const FALLBACK_SUFFIX: &str = "~fallback";

/// One validated rule. Only the loader builds the rules a [`RuleSet`] holds, so every rule
/// inside a rule set has passed validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// The rule's unique name, reported with each decision; `Arc` so answers can carry it
    /// without copying the string.
    pub name: Arc<str>,
    /// Which checks the rule applies to.
    pub selector: Selector,
    /// The algorithm and its numbers; the main crate turns this into a limiter.
    pub spec: AlgorithmSpec,
    /// What to do when the key's owner cannot be reached.
    pub on_unavailable: FailMode,
    /// [`AlgorithmSpec::fingerprint`] of `spec`, precomputed so a reload can tell in O(1)
    /// whether a rule's counters are still meaningful.
    pub fingerprint: u64,
    /// The algorithm built from `spec`, ready for the shard: built once at load, so an
    /// invalid combination of numbers is a load error, never a hot-path surprise.
    pub limiter: Limiter,
}

impl Rule {
    /// The fail-open stand-in for this rule on a node deciding alone while the key's
    /// owner is unreachable: the limit divided by `nodes` (the live node count), and its
    /// own counters (name `<rule>~fallback`), so degraded decisions never mix with the
    /// real ones if this node later owns the key.
    pub fn fallback(&self, nodes: u64) -> Rule {
        Rule::new(
            &format!("{}{FALLBACK_SUFFIX}", self.name),
            self.selector.clone(),
            self.spec.divided(nodes),
            self.on_unavailable,
        )
    }

    /// True for a [`Rule::fallback`]: its counters belong to this node alone and are never
    /// handed to another (rule names cannot contain `~`, so no configured rule matches).
    pub fn is_node_local(&self) -> bool {
        self.name.ends_with(FALLBACK_SUFFIX)
    }

    /// The precedence level this rule matches at, derived from its selector alone; reported
    /// with decisions so operators can see why a rule applied.
    pub fn level(&self) -> MatchLevel {
        self.selector.level()
    }

    /// Only called with specs that [`build_spec`] accepted, which already built the
    /// limiter once; the bounds it checks make the constructors infallible here.
    fn new(name: &str, selector: Selector, spec: AlgorithmSpec, on_unavailable: FailMode) -> Self {
        let limiter = spec
            .limiter()
            .expect("build_spec only returns specs whose limiter builds");
        Rule {
            name: name.into(),
            selector,
            fingerprint: spec.fingerprint(),
            limiter,
            spec,
            on_unavailable,
        }
    }
}

/// Which checks a rule applies to. For rules in a [`RuleSet`], `client` and `tier` are never
/// both set and at least one field is set, except for the default rule where none is.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Selector {
    /// An exact client key.
    pub client: Option<String>,
    /// A tier name.
    pub tier: Option<String>,
    /// A route pattern.
    pub route: Option<RoutePattern>,
}

impl Selector {
    /// The precedence level of a rule with this selector.
    pub fn level(&self) -> MatchLevel {
        match (&self.client, &self.tier, &self.route) {
            (Some(_), _, Some(_)) => MatchLevel::ClientRoute,
            (Some(_), _, None) => MatchLevel::Client,
            (None, Some(_), Some(_)) => MatchLevel::TierRoute,
            (None, Some(_), None) => MatchLevel::Tier,
            (None, None, Some(_)) => MatchLevel::Route,
            (None, None, None) => MatchLevel::Default,
        }
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn opt(f: &mut fmt::Formatter<'_>, v: Option<&dyn fmt::Display>) -> fmt::Result {
            match v {
                Some(v) => write!(f, "\"{v}\""),
                None => f.write_str("none"),
            }
        }
        f.write_str("client ")?;
        opt(f, self.client.as_ref().map(|c| c as &dyn fmt::Display))?;
        f.write_str(", tier ")?;
        opt(f, self.tier.as_ref().map(|t| t as &dyn fmt::Display))?;
        f.write_str(", route ")?;
        opt(f, self.route.as_ref().map(|r| r as &dyn fmt::Display))
    }
}

/// The precedence levels, most specific first; `Ord` follows that order, so a smaller level
/// wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MatchLevel {
    /// Client key and route pattern.
    ClientRoute,
    /// Client key only.
    Client,
    /// Tier and route pattern.
    TierRoute,
    /// Tier only.
    Tier,
    /// Route pattern only: the default for that route.
    Route,
    /// The global default.
    Default,
}

/// An algorithm with validated numbers. Zero limits and windows cannot be represented, so the
/// algorithms never divide by zero or admit nothing by accident.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AlgorithmSpec {
    /// Bucket of `capacity` tokens refilled with `refill` tokens every `period`: the only
    /// algorithm with separate knobs for burst and sustained rate.
    TokenBucket {
        /// Bucket size: the largest burst.
        capacity: NonZeroU64,
        /// Tokens added per period.
        refill: NonZeroU64,
        /// The refill period.
        period: Duration,
    },
    /// GCRA at `limit` per `period`, as a meter or a shaper.
    LeakyBucket {
        /// Requests per period.
        limit: NonZeroU64,
        /// The period.
        period: Duration,
        /// Meter (reject early arrivals) or shaper (delay them).
        mode: LeakyMode,
    },
    /// At most `limit` per aligned window; cheap but allows 2× at window edges.
    FixedWindow {
        /// Requests per window.
        limit: NonZeroU64,
        /// The window.
        window: Duration,
    },
    /// Exact: one timestamp per admitted request; memory grows with the limit.
    SlidingWindowLog {
        /// Requests per trailing window.
        limit: NonZeroU64,
        /// The window.
        window: Duration,
    },
    /// Two counters and a weighted estimate: the default.
    SlidingWindowCounter {
        /// Requests per trailing window (estimated).
        limit: NonZeroU64,
        /// The window.
        window: Duration,
    },
}

/// The two uses of the leaky bucket (GCRA).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeakyMode {
    /// Reject requests arriving earlier than the rate allows, beyond `burst` at once.
    Meter {
        /// How many requests may arrive back to back.
        burst: NonZeroU64,
    },
    /// Admit early requests with a delay the caller must wait, while at most `queue_depth`
    /// are waiting.
    Shaper {
        /// How many requests may be waiting.
        queue_depth: u64,
    },
}

impl AlgorithmSpec {
    /// These numbers divided among `nodes` nodes that each decide alone: the per-node
    /// fallback used when a key's owner is unreachable (fail-open). Every count is
    /// divided and rounded down, but never below 1: the fallback must still admit.
    pub fn divided(&self, nodes: u64) -> AlgorithmSpec {
        let nodes = nodes.max(1);
        let div = |n: NonZeroU64| NonZeroU64::new(n.get() / nodes).unwrap_or(NonZeroU64::MIN);
        match *self {
            AlgorithmSpec::TokenBucket {
                capacity,
                refill,
                period,
            } => AlgorithmSpec::TokenBucket {
                capacity: div(capacity),
                refill: div(refill),
                period,
            },
            AlgorithmSpec::LeakyBucket {
                limit,
                period,
                mode,
            } => AlgorithmSpec::LeakyBucket {
                limit: div(limit),
                period,
                mode: match mode {
                    LeakyMode::Meter { burst } => LeakyMode::Meter { burst: div(burst) },
                    shaper => shaper,
                },
            },
            AlgorithmSpec::FixedWindow { limit, window } => AlgorithmSpec::FixedWindow {
                limit: div(limit),
                window,
            },
            AlgorithmSpec::SlidingWindowLog { limit, window } => AlgorithmSpec::SlidingWindowLog {
                limit: div(limit),
                window,
            },
            AlgorithmSpec::SlidingWindowCounter { limit, window } => {
                AlgorithmSpec::SlidingWindowCounter {
                    limit: div(limit),
                    window,
                }
            }
        }
    }

    /// Build the algorithm these numbers describe.
    pub fn limiter(&self) -> Result<Limiter, AlgorithmError> {
        Ok(match *self {
            AlgorithmSpec::TokenBucket {
                capacity,
                refill,
                period,
            } => Limiter::TokenBucket(TokenBucket::new(capacity, refill, period)?),
            AlgorithmSpec::LeakyBucket {
                limit,
                period,
                mode: LeakyMode::Meter { burst },
            } => Limiter::LeakyBucket(Gcra::meter(limit, period, burst)?),
            AlgorithmSpec::LeakyBucket {
                limit,
                period,
                mode: LeakyMode::Shaper { queue_depth },
            } => Limiter::LeakyBucket(Gcra::shaper(limit, period, queue_depth)?),
            AlgorithmSpec::FixedWindow { limit, window } => {
                Limiter::FixedWindow(FixedWindow::new(limit, window)?)
            }
            AlgorithmSpec::SlidingWindowLog { limit, window } => {
                Limiter::SlidingWindowLog(SlidingLog::new(limit, window)?)
            }
            AlgorithmSpec::SlidingWindowCounter { limit, window } => {
                Limiter::SlidingWindowCounter(SlidingCounter::new(limit, window)?)
            }
        })
    }

    /// The name as written in the rule file, for messages and metric labels.
    pub fn algorithm_name(&self) -> &'static str {
        match self {
            AlgorithmSpec::TokenBucket { .. } => "token_bucket",
            AlgorithmSpec::LeakyBucket { .. } => "leaky_bucket",
            AlgorithmSpec::FixedWindow { .. } => "fixed_window",
            AlgorithmSpec::SlidingWindowLog { .. } => "sliding_window_log",
            AlgorithmSpec::SlidingWindowCounter { .. } => "sliding_window_counter",
        }
    }

    /// The number a caller sees as its `limit` (the `limit` field of the rule file).
    pub fn limit(&self) -> NonZeroU64 {
        match *self {
            AlgorithmSpec::TokenBucket { refill, .. } => refill,
            AlgorithmSpec::LeakyBucket { limit, .. }
            | AlgorithmSpec::FixedWindow { limit, .. }
            | AlgorithmSpec::SlidingWindowLog { limit, .. }
            | AlgorithmSpec::SlidingWindowCounter { limit, .. } => limit,
        }
    }

    /// The window (or period) the limit applies to.
    pub fn window(&self) -> Duration {
        match *self {
            AlgorithmSpec::TokenBucket { period, .. }
            | AlgorithmSpec::LeakyBucket { period, .. } => period,
            AlgorithmSpec::FixedWindow { window, .. }
            | AlgorithmSpec::SlidingWindowLog { window, .. }
            | AlgorithmSpec::SlidingWindowCounter { window, .. } => window,
        }
    }

    /// A stable hash of the algorithm and all its numbers.
    ///
    /// A reload keeps the counters of rules whose fingerprint is unchanged and resets the
    /// others. It is xxh3 over an explicit little-endian encoding (never `std::hash`, whose
    /// output may change between Rust versions), so every node and every build agree. It
    /// covers only the spec: renaming a rule, moving it or changing its selector or fail mode
    /// does not change it.
    pub fn fingerprint(&self) -> u64 {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(b"ringlimit.spec.v1");
        let mut put = |tag: u8, nums: &[u64], period: Duration| {
            buf.push(tag);
            for n in nums {
                buf.extend_from_slice(&n.to_le_bytes());
            }
            buf.extend_from_slice(&period.as_nanos().to_le_bytes());
        };
        match *self {
            AlgorithmSpec::TokenBucket {
                capacity,
                refill,
                period,
            } => put(1, &[capacity.get(), refill.get()], period),
            AlgorithmSpec::LeakyBucket {
                limit,
                period,
                mode: LeakyMode::Meter { burst },
            } => put(2, &[limit.get(), 0, burst.get()], period),
            AlgorithmSpec::LeakyBucket {
                limit,
                period,
                mode: LeakyMode::Shaper { queue_depth },
            } => put(2, &[limit.get(), 1, queue_depth], period),
            AlgorithmSpec::FixedWindow { limit, window } => put(3, &[limit.get()], window),
            AlgorithmSpec::SlidingWindowLog { limit, window } => put(4, &[limit.get()], window),
            AlgorithmSpec::SlidingWindowCounter { limit, window } => put(5, &[limit.get()], window),
        }
        xxhash_rust::xxh3::xxh3_64(&buf)
    }
}

/// What a node does for a key whose owner it cannot reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum FailMode {
    /// Decide locally with a per-node share of the limit and flag the answer as degraded:
    /// availability over exactness, the design reference's choice.
    #[default]
    Open,
    /// Deny: for limits whose whole point is that they are never exceeded.
    Closed,
}

/// Parses a rule-file duration: an unsigned integer followed by `ms`, `s`, `m`, `h` or `d`.
///
/// Deliberately tiny (no fractions, no compound `1h30m`) so a value reads the same to every
/// operator. Exposed so node configuration can use the same syntax.
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let ms_per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(DurationError::Syntax),
    };
    if digits.is_empty() {
        return Err(DurationError::Syntax);
    }
    // Digits only, so the only parse failure left is a number too large for u64.
    let n: u64 = digits.parse().map_err(|_| DurationError::Overflow)?;
    let ms = n.checked_mul(ms_per_unit).ok_or(DurationError::Overflow)?;
    Ok(Duration::from_millis(ms))
}

/// Why a duration string was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Not `<integer><unit>`.
    #[error("is not a duration (use 500ms, 10s, 1m, 1h, 1d)")]
    Syntax,
    /// Well-formed but too large to represent in milliseconds.
    #[error("is too large to be a duration")]
    Overflow,
}

/// Everything that can go wrong loading a rule set.
#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    /// The file could not be read.
    #[error("reading rules file {}: {source}", path.display())]
    Io {
        /// The file that was being read.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The text is not TOML or does not have the rule-file shape (unknown field, wrong
    /// type); the message carries line and column.
    #[error("{}{source}", path.as_ref().map(|p| format!("rules file {}: ", p.display())).unwrap_or_default())]
    Toml {
        /// The file, when loaded from one.
        path: Option<PathBuf>,
        /// The parser's error, with position.
        source: toml::de::Error,
    },
    /// Well-formed TOML with invalid rules; every problem found, in file order.
    #[error("{}", join_lines(.0))]
    Invalid(Vec<RuleIssue>),
}

fn join_lines(issues: &[RuleIssue]) -> String {
    issues
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

/// One validation problem: which rule, which field, what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleIssue {
    /// The rule it concerns.
    pub rule: RuleRef,
    /// The field, when the problem is about one field.
    pub field: Option<&'static str>,
    /// What is wrong and, where possible, how to fix it.
    pub message: String,
}

impl fmt::Display for RuleIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.rule)?;
        if let Some(field) = self.field {
            write!(f, "field \"{field}\": ")?;
        }
        f.write_str(&self.message)
    }
}

/// How an issue names its rule: by name when it has a usable one, else by position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleRef {
    /// The `[default]` section.
    Default,
    /// A `[[rule]]` with a valid name.
    Named(String),
    /// A `[[rule]]` without a usable name; 1-based position in the file.
    Index(usize),
}

impl fmt::Display for RuleRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuleRef::Default => f.write_str("[default]"),
            RuleRef::Named(n) => write!(f, "rule \"{n}\""),
            RuleRef::Index(i) => write!(f, "rule #{i} (unnamed)"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Raw file shape. Numbers are read as i64 and names as strings so that 0, negatives and
// unknown algorithm names become rule-naming issues (all of them), not one serde error.

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    default: Option<RawDefault>,
    #[serde(default)]
    rule: Vec<RawRule>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDefault {
    algorithm: Option<String>,
    limit: Option<i64>,
    window: Option<String>,
    burst: Option<i64>,
    mode: Option<String>,
    queue_depth: Option<i64>,
    on_unavailable: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: Option<String>,
    client: Option<String>,
    tier: Option<String>,
    route: Option<String>,
    algorithm: Option<String>,
    limit: Option<i64>,
    window: Option<String>,
    burst: Option<i64>,
    mode: Option<String>,
    queue_depth: Option<i64>,
    on_unavailable: Option<String>,
}

/// The limit-related fields, shared by `[default]` and `[[rule]]`.
struct RawSpec<'a> {
    algorithm: Option<&'a str>,
    limit: Option<i64>,
    window: Option<&'a str>,
    burst: Option<i64>,
    mode: Option<&'a str>,
    queue_depth: Option<i64>,
    on_unavailable: Option<&'a str>,
}

impl RawDefault {
    fn spec(&self) -> RawSpec<'_> {
        RawSpec {
            algorithm: self.algorithm.as_deref(),
            limit: self.limit,
            window: self.window.as_deref(),
            burst: self.burst,
            mode: self.mode.as_deref(),
            queue_depth: self.queue_depth,
            on_unavailable: self.on_unavailable.as_deref(),
        }
    }
}

impl RawRule {
    fn spec(&self) -> RawSpec<'_> {
        RawSpec {
            algorithm: self.algorithm.as_deref(),
            limit: self.limit,
            window: self.window.as_deref(),
            burst: self.burst,
            mode: self.mode.as_deref(),
            queue_depth: self.queue_depth,
            on_unavailable: self.on_unavailable.as_deref(),
        }
    }
}

/// Collects issues for one rule so each check is one line.
struct Issues<'a> {
    rule: RuleRef,
    out: &'a mut Vec<RuleIssue>,
}

impl Issues<'_> {
    fn field(&mut self, field: &'static str, message: impl Into<String>) {
        self.out.push(RuleIssue {
            rule: self.rule.clone(),
            field: Some(field),
            message: message.into(),
        });
    }

    fn rule(&mut self, message: impl Into<String>) {
        self.out.push(RuleIssue {
            rule: self.rule.clone(),
            field: None,
            message: message.into(),
        });
    }
}

const ALGORITHMS: &str =
    "token_bucket, leaky_bucket, fixed_window, sliding_window_log, sliding_window_counter";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Algo {
    Token,
    Leaky,
    Fixed,
    Log,
    Counter,
}

impl Algo {
    fn name(self) -> &'static str {
        match self {
            Algo::Token => "token_bucket",
            Algo::Leaky => "leaky_bucket",
            Algo::Fixed => "fixed_window",
            Algo::Log => "sliding_window_log",
            Algo::Counter => "sliding_window_counter",
        }
    }
}

/// Checks an integer against `min..=max`, reporting in the file's terms.
fn bounded(
    issues: &mut Issues<'_>,
    field: &'static str,
    v: i64,
    min: u64,
    max: u64,
) -> Option<u64> {
    match u64::try_from(v) {
        Ok(v) if v >= min && v <= max => Some(v),
        Ok(v) if v > max => {
            issues.field(field, format!("must be at most {max} (got {v})"));
            None
        }
        _ => {
            issues.field(field, format!("must be an integer >= {min} (got {v})"));
            None
        }
    }
}

fn nonzero(v: u64) -> NonZeroU64 {
    // Callers pass values already checked to be >= 1; 1 is a safe fallback regardless.
    NonZeroU64::new(v).unwrap_or(NonZeroU64::MIN)
}

/// Validates the limit fields; `None` if any issue was recorded.
fn build_spec(issues: &mut Issues<'_>, raw: &RawSpec<'_>) -> Option<(AlgorithmSpec, FailMode)> {
    let before = issues.out.len();

    let algo = match raw.algorithm.unwrap_or("sliding_window_counter") {
        "token_bucket" => Some(Algo::Token),
        "leaky_bucket" => Some(Algo::Leaky),
        "fixed_window" => Some(Algo::Fixed),
        "sliding_window_log" => Some(Algo::Log),
        "sliding_window_counter" => Some(Algo::Counter),
        other => {
            issues.field(
                "algorithm",
                format!("{other:?} is not an algorithm (use one of {ALGORITHMS})"),
            );
            None
        }
    };

    let limit = match raw.limit {
        None => {
            issues.field("limit", "required (units per window, e.g. limit = 100)");
            None
        }
        Some(v) => bounded(issues, "limit", v, 1, MAX_LIMIT),
    };
    if let (Some(Algo::Log), Some(l)) = (algo, limit) {
        if l > MAX_LOG_LIMIT {
            issues.field(
                "limit",
                format!(
                    "sliding_window_log keeps {LOG_BYTES_PER_ENTRY} bytes per admitted request \
                     per key, so limit {l} would need {} bytes per key; at most {MAX_LOG_LIMIT} \
                     (use sliding_window_counter for large limits)",
                    l * LOG_BYTES_PER_ENTRY
                ),
            );
        }
    }

    let window = match raw.window {
        None => {
            issues.field("window", "required (e.g. window = \"60s\")");
            None
        }
        Some(text) => match parse_duration(text) {
            Err(e) => {
                issues.field("window", format!("{text:?} {e}"));
                None
            }
            Ok(d) if !(MIN_WINDOW..=MAX_WINDOW).contains(&d) => {
                issues.field(
                    "window",
                    format!("must be between 1ms and 7d (got {text:?})"),
                );
                None
            }
            Ok(d) => Some(d),
        },
    };

    let mode = match raw.mode {
        None => None,
        Some("meter") => Some(false),
        Some("shaper") => Some(true),
        Some(other) => {
            issues.field(
                "mode",
                format!("{other:?} is not a mode (use \"meter\" or \"shaper\")"),
            );
            None
        }
    };
    let shaper = mode == Some(true);
    if raw.mode.is_some() {
        if let Some(a) = algo.filter(|a| *a != Algo::Leaky) {
            issues.field("mode", format!("not used by algorithm {}", a.name()));
        }
    }

    let burst = raw
        .burst
        .and_then(|v| bounded(issues, "burst", v, 1, MAX_LIMIT));
    if raw.burst.is_some() {
        match algo {
            Some(Algo::Leaky) if shaper => issues.field(
                "burst",
                "not used by leaky_bucket in shaper mode (use queue_depth)",
            ),
            Some(a @ (Algo::Fixed | Algo::Log | Algo::Counter)) => {
                issues.field("burst", format!("not used by algorithm {}", a.name()))
            }
            _ => {}
        }
    }

    let queue_depth = raw
        .queue_depth
        .and_then(|v| bounded(issues, "queue_depth", v, 0, MAX_QUEUE_DEPTH));
    if raw.queue_depth.is_some() {
        match algo {
            Some(Algo::Leaky) if !shaper => issues.field(
                "queue_depth",
                "not used by leaky_bucket in meter mode (set mode = \"shaper\")",
            ),
            Some(a @ (Algo::Token | Algo::Fixed | Algo::Log | Algo::Counter)) => {
                issues.field("queue_depth", format!("not used by algorithm {}", a.name()))
            }
            _ => {}
        }
    }

    let on_unavailable = match raw.on_unavailable {
        None | Some("open") => FailMode::Open,
        Some("closed") => FailMode::Closed,
        Some(other) => {
            issues.field(
                "on_unavailable",
                format!("{other:?} is not a fail mode (use \"open\" or \"closed\")"),
            );
            FailMode::Open
        }
    };

    if issues.out.len() != before {
        return None;
    }
    let (algo, limit, window) = (algo?, nonzero(limit?), window?);
    let spec = match algo {
        Algo::Token => AlgorithmSpec::TokenBucket {
            capacity: burst.map_or(limit, nonzero),
            refill: limit,
            period: window,
        },
        Algo::Leaky => AlgorithmSpec::LeakyBucket {
            limit,
            period: window,
            mode: if shaper {
                LeakyMode::Shaper {
                    queue_depth: queue_depth.unwrap_or(0),
                }
            } else {
                LeakyMode::Meter {
                    burst: burst.map_or(NonZeroU64::MIN, nonzero),
                }
            },
        },
        Algo::Fixed => AlgorithmSpec::FixedWindow { limit, window },
        Algo::Log => AlgorithmSpec::SlidingWindowLog { limit, window },
        Algo::Counter => AlgorithmSpec::SlidingWindowCounter { limit, window },
    };
    if let Err(error) = spec.limiter() {
        // The bounds above should make this unreachable; if the algorithms ever accept
        // less than the rule format allows, the file is refused with the reason.
        issues.rule(format!("numbers rejected by the algorithm: {error}"));
        return None;
    }
    Some((spec, on_unavailable))
}

fn valid_name(name: &str) -> bool {
    (1..=MAX_NAME_LEN).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// Validates a `client` or `tier` value.
fn key_field(issues: &mut Issues<'_>, field: &'static str, value: &Option<String>) -> bool {
    match value {
        Some(v) if v.is_empty() => issues.field(field, "must not be empty"),
        Some(v) if v.len() > MAX_KEY_LEN => issues.field(
            field,
            format!("is {} bytes long; at most {MAX_KEY_LEN} allowed", v.len()),
        ),
        _ => return true,
    }
    false
}

// ---------------------------------------------------------------------------------------------
// The rule set and its index.

/// Rules of one level (one client, one tier, or the route-only rules), indexed by route.
#[derive(Debug, Clone, Default)]
struct RouteTable {
    /// The rule of this group without a route (levels 2 and 4). At most one, since
    /// selectors are unique.
    unrouted: Option<u32>,
    /// Exact-path patterns by path; method-specific patterns first.
    exact: HashMap<Box<str>, Vec<u32>>,
    /// Prefix patterns, most specific first.
    prefix: Vec<u32>,
}

impl RouteTable {
    fn insert(&mut self, idx: u32, rule: &Rule) {
        match &rule.selector.route {
            None => self.unrouted = Some(idx),
            Some(p) => match p.exact_path() {
                Some(path) => self.exact.entry(path.into()).or_default().push(idx),
                None => self.prefix.push(idx),
            },
        }
    }

    /// Orders candidates most specific first; stable, so file order breaks (impossible) ties.
    fn finish(&mut self, rules: &[Arc<Rule>]) {
        let key = |i: &u32| {
            std::cmp::Reverse(
                rules[*i as usize]
                    .selector
                    .route
                    .as_ref()
                    .map(RoutePattern::specificity),
            )
        };
        self.prefix.sort_by_key(key);
        for list in self.exact.values_mut() {
            list.sort_by_key(key);
        }
    }

    /// The most specific rule of this group whose pattern matches `route`.
    fn routed(&self, rules: &[Arc<Rule>], route: &Route<'_>) -> Option<u32> {
        let hit = |i: &&u32| {
            rules[**i as usize]
                .selector
                .route
                .as_ref()
                .is_some_and(|p| p.matches(route))
        };
        if let Some(list) = self.exact.get(route.path()) {
            if let Some(i) = list.iter().find(hit) {
                return Some(*i);
            }
        }
        self.prefix.iter().find(hit).copied()
    }
}

/// A validated, indexed set of rules: what every check is matched against.
///
/// Immutable once built; a reload builds a new one and swaps it in, so checks never see a
/// half-applied file. Cloning is cheap relative to a reload (rules are shared `Arc`s).
#[derive(Debug, Clone)]
pub struct RuleSet {
    /// The default rule first, then the file's rules in file order.
    rules: Vec<Arc<Rule>>,
    by_client: HashMap<Box<str>, RouteTable>,
    by_tier: HashMap<Box<str>, RouteTable>,
    route_only: RouteTable,
}

impl Default for RuleSet {
    /// The built-in rule set, so a node without a rule file still limits sanely.
    fn default() -> Self {
        RuleSet::builtin()
    }
}

impl RuleSet {
    /// The rule set used when no file is given: one default rule, a sliding window counter of
    /// 100 per 60 s (the design reference's default, which most callers never notice).
    pub fn builtin() -> Self {
        Self::index(vec![Self::builtin_default()])
    }

    fn builtin_default() -> Rule {
        Rule::new(
            DEFAULT_RULE_NAME,
            Selector::default(),
            AlgorithmSpec::SlidingWindowCounter {
                limit: nonzero(BUILTIN_LIMIT),
                window: BUILTIN_WINDOW,
            },
            FailMode::Open,
        )
    }

    /// Parses and validates a rule file's text (format in the module doc).
    ///
    /// Reports every validation problem at once, so fixing a file takes one round trip.
    pub fn from_toml_str(text: &str) -> Result<Self, RulesError> {
        let raw: RawFile =
            toml::from_str(text).map_err(|source| RulesError::Toml { path: None, source })?;
        Self::validate(raw)
    }

    /// Reads and parses a rule file; errors name the file.
    pub fn load(path: &Path) -> Result<Self, RulesError> {
        let text = std::fs::read_to_string(path).map_err(|source| RulesError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml_str(&text).map_err(|e| match e {
            RulesError::Toml { path: None, source } => RulesError::Toml {
                path: Some(path.to_owned()),
                source,
            },
            other => other,
        })
    }

    fn validate(raw: RawFile) -> Result<Self, RulesError> {
        let mut out = Vec::new();

        let default = match &raw.default {
            None => Some(Self::builtin_default()),
            Some(d) => {
                let mut issues = Issues {
                    rule: RuleRef::Default,
                    out: &mut out,
                };
                build_spec(&mut issues, &d.spec()).map(|(spec, fail)| {
                    Rule::new(DEFAULT_RULE_NAME, Selector::default(), spec, fail)
                })
            }
        };

        let mut rules = Vec::with_capacity(raw.rule.len() + 1);
        let mut names: HashMap<&str, usize> = HashMap::new();
        let mut selectors: HashMap<Selector, String> = HashMap::new();

        for (i, r) in raw.rule.iter().enumerate() {
            let position = i + 1;
            let name = r.name.as_deref().filter(|n| valid_name(n));
            let mut issues = Issues {
                rule: name.map_or(RuleRef::Index(position), |n| RuleRef::Named(n.into())),
                out: &mut out,
            };
            match (&r.name, name) {
                (None, _) => {
                    issues.field("name", "required (1..=64 characters of A-Z a-z 0-9 _ . -)")
                }
                (Some(n), None) => issues.field(
                    "name",
                    format!("{n:?} must be 1..=64 characters of A-Z a-z 0-9 _ . -"),
                ),
                (Some(_), Some(n)) if n == DEFAULT_RULE_NAME => {
                    issues.field("name", "\"default\" is reserved for the [default] section")
                }
                (Some(_), Some(n)) => match names.entry(n) {
                    Entry::Occupied(first) => issues.field(
                        "name",
                        format!("duplicate name (first used by rule #{})", first.get()),
                    ),
                    Entry::Vacant(v) => {
                        v.insert(position);
                    }
                },
            }

            let mut selector_ok = key_field(&mut issues, "client", &r.client)
                & key_field(&mut issues, "tier", &r.tier);
            if r.client.is_some() && r.tier.is_some() {
                issues.field(
                    "tier",
                    "cannot be combined with \"client\" (a client rule applies whatever the \
                     tier; remove one of them)",
                );
                selector_ok = false;
            }
            let route = match r.route.as_deref().map(RoutePattern::parse) {
                None => None,
                Some(Ok(p)) => Some(p),
                Some(Err(e)) => {
                    issues.field("route", e.to_string());
                    selector_ok = false;
                    None
                }
            };
            if r.client.is_none() && r.tier.is_none() && r.route.is_none() {
                issues.rule(
                    "needs at least one of \"client\", \"tier\", \"route\" (a rule matching \
                     every check would shadow the default: put it in [default] instead)",
                );
                selector_ok = false;
            }
            let selector = Selector {
                client: r.client.clone(),
                tier: r.tier.clone(),
                route,
            };
            if selector_ok {
                let this = issues.rule.to_string();
                match selectors.entry(selector.clone()) {
                    Entry::Occupied(first) => issues.rule(format!(
                        "has the same selector ({selector}) as {}; one of them would never match",
                        first.get()
                    )),
                    Entry::Vacant(v) => {
                        v.insert(this);
                    }
                }
            }

            let spec = build_spec(&mut issues, &r.spec());
            if let (Some(name), Some((spec, fail)), true) = (name, spec, selector_ok) {
                rules.push(Rule::new(name, selector, spec, fail));
            }
        }

        match default {
            Some(default) if out.is_empty() => {
                rules.insert(0, default);
                Ok(Self::index(rules))
            }
            _ => Err(RulesError::Invalid(out)),
        }
    }

    /// Builds the lookup index; `rules[0]` is the default rule.
    fn index(rules: Vec<Rule>) -> Self {
        let rules: Vec<Arc<Rule>> = rules.into_iter().map(Arc::new).collect();
        let mut by_client: HashMap<Box<str>, RouteTable> = HashMap::new();
        let mut by_tier: HashMap<Box<str>, RouteTable> = HashMap::new();
        let mut route_only = RouteTable::default();
        for (i, rule) in rules.iter().enumerate().skip(1) {
            // Rule files are far below u32::MAX entries; the index keeps tables compact.
            let idx = u32::try_from(i).expect("fewer than 2^32 rules");
            let s = &rule.selector;
            let table = match (&s.client, &s.tier) {
                (Some(c), _) => by_client.entry(c.as_str().into()).or_default(),
                (None, Some(t)) => by_tier.entry(t.as_str().into()).or_default(),
                (None, None) => &mut route_only,
            };
            table.insert(idx, rule);
        }
        for table in by_client.values_mut().chain(by_tier.values_mut()) {
            table.finish(&rules);
        }
        route_only.finish(&rules);
        RuleSet {
            rules,
            by_client,
            by_tier,
            route_only,
        }
    }

    /// All rules: the default rule first, then the file's rules in file order. A reload
    /// diffs two of these by name and fingerprint.
    pub fn rules(&self) -> &[Arc<Rule>] {
        &self.rules
    }

    /// The rule that applies when nothing more specific does.
    pub fn default_rule(&self) -> &Arc<Rule> {
        &self.rules[0]
    }

    /// Number of rules including the default rule, so it is never zero.
    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// Always false: a rule set always holds its default rule. Present for API symmetry
    /// with `len`.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Finds a rule by name, e.g. to explain a decision or diff a reload.
    pub fn get(&self, name: &str) -> Option<&Arc<Rule>> {
        self.rules.iter().find(|r| &*r.name == name)
    }

    /// The rule governing a check: most specific wins (see the module doc).
    ///
    /// Hot path: at most three hash lookups plus a scan of the matching group's prefix
    /// patterns; the number of client overrides does not matter. Always returns a rule.
    pub fn matching(
        &self,
        client: &str,
        tier: Option<&str>,
        route: Option<&Route<'_>>,
    ) -> &Arc<Rule> {
        let i = self.lookup(client, tier, route);
        &self.rules[i as usize]
    }

    /// Like [`RuleSet::matching`], also returning the level that matched, for answers and
    /// metrics that explain why a rule applied.
    pub fn matching_with_level(
        &self,
        client: &str,
        tier: Option<&str>,
        route: Option<&Route<'_>>,
    ) -> (&Arc<Rule>, MatchLevel) {
        let rule = self.matching(client, tier, route);
        (rule, rule.level())
    }

    fn lookup(&self, client: &str, tier: Option<&str>, route: Option<&Route<'_>>) -> u32 {
        let groups = [
            self.by_client.get(client),
            tier.and_then(|t| self.by_tier.get(t)),
        ];
        for table in groups.into_iter().flatten() {
            if let Some(i) = route.and_then(|r| table.routed(&self.rules, r)) {
                return i;
            }
            if let Some(i) = table.unrouted {
                return i;
            }
        }
        route
            .and_then(|r| self.route_only.routed(&self.rules, r))
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn set(text: &str) -> RuleSet {
        RuleSet::from_toml_str(text).unwrap_or_else(|e| panic!("{e}"))
    }

    fn invalid(text: &str) -> String {
        match RuleSet::from_toml_str(text) {
            Err(RulesError::Invalid(issues)) => {
                assert!(!issues.is_empty());
                RulesError::Invalid(issues).to_string()
            }
            Err(e) => panic!("expected validation issues, got: {e}"),
            Ok(_) => panic!("expected validation issues, got a rule set"),
        }
    }

    fn one_rule(fields: &str) -> String {
        invalid(&format!(
            "[[rule]]\nname = \"x\"\ntier = \"free\"\n{fields}\n"
        ))
    }

    fn name_of(rs: &RuleSet, client: &str, tier: Option<&str>, route: Option<&str>) -> String {
        let route = route.map(|r| Route::parse(r).unwrap());
        rs.matching(client, tier, route.as_ref()).name.to_string()
    }

    const LEVELS: &str = r#"
        [[rule]]
        name = "client-route"
        client = "c1"
        route = "POST /v1/charges"
        limit = 1
        window = "1s"

        [[rule]]
        name = "client"
        client = "c1"
        limit = 2
        window = "1s"

        [[rule]]
        name = "tier-route"
        tier = "free"
        route = "POST /v1/charges"
        limit = 3
        window = "1s"

        [[rule]]
        name = "tier"
        tier = "free"
        limit = 4
        window = "1s"

        [[rule]]
        name = "route"
        route = "POST /v1/charges"
        limit = 5
        window = "1s"
    "#;

    const CHARGE: Option<&str> = Some("POST /v1/charges");
    const OTHER: Option<&str> = Some("GET /v1/users");

    #[test]
    fn fallback_divides_the_limit_by_the_node_count_but_never_below_one() {
        let rules = RuleSet::builtin();
        let fallback = rules.default_rule().fallback(3);
        assert_eq!(&*fallback.name, "default~fallback");
        assert_eq!(fallback.spec.limit().get(), 33);
        assert_eq!(fallback.spec.window(), rules.default_rule().spec.window());
        assert_eq!(rules.default_rule().fallback(1000).spec.limit().get(), 1);
        assert_ne!(fallback.fingerprint, rules.default_rule().fingerprint);
    }

    #[test]
    fn client_route_beats_client() {
        let rs = set(LEVELS);
        assert_eq!(name_of(&rs, "c1", Some("free"), CHARGE), "client-route");
        let (_, level) =
            rs.matching_with_level("c1", None, Some(&Route::parse("POST /v1/charges").unwrap()));
        assert_eq!(level, MatchLevel::ClientRoute);
    }

    #[test]
    fn client_beats_tier_route() {
        let rs = set(LEVELS);
        assert_eq!(name_of(&rs, "c1", Some("free"), OTHER), "client");
        // Even for the route the tier has a rule for, once the client's route rule is gone.
        let without = LEVELS.replacen(
            "name = \"client-route\"\n        client = \"c1\"",
            "name = \"client-route\"\n        client = \"c9\"",
            1,
        );
        assert_eq!(
            name_of(&set(&without), "c1", Some("free"), CHARGE),
            "client"
        );
    }

    #[test]
    fn tier_route_beats_tier() {
        let rs = set(LEVELS);
        assert_eq!(name_of(&rs, "c2", Some("free"), CHARGE), "tier-route");
    }

    #[test]
    fn tier_beats_route_only() {
        let rs = set(LEVELS);
        let text = LEVELS.replace(
            "name = \"tier-route\"\n        tier = \"free\"",
            "name = \"tier-route\"\n        tier = \"pro\"",
        );
        assert_eq!(name_of(&set(&text), "c2", Some("free"), CHARGE), "tier");
        assert_eq!(name_of(&rs, "c2", Some("free"), OTHER), "tier");
    }

    #[test]
    fn route_only_beats_default() {
        let rs = set(LEVELS);
        assert_eq!(name_of(&rs, "c2", Some("gold"), CHARGE), "route");
        assert_eq!(name_of(&rs, "c2", None, CHARGE), "route");
        assert_eq!(name_of(&rs, "c2", None, OTHER), "default");
        assert_eq!(
            rs.matching_with_level("c2", None, None).1,
            MatchLevel::Default
        );
    }

    #[test]
    fn check_without_route_only_matches_rules_without_route() {
        let rs = set(LEVELS);
        assert_eq!(name_of(&rs, "c1", Some("free"), None), "client");
        assert_eq!(name_of(&rs, "c2", Some("free"), None), "tier");
        assert_eq!(name_of(&rs, "c2", None, None), "default");
    }

    #[test]
    fn unmatched_client_route_falls_through_to_the_client_rule_not_the_default() {
        let rs = set(r#"
            [[rule]]
            name = "only-route"
            client = "c1"
            route = "/a"
            limit = 1
            window = "1s"
            "#);
        assert_eq!(name_of(&rs, "c1", None, Some("/b")), "default");
        assert_eq!(name_of(&rs, "c1", None, Some("/a")), "only-route");
    }

    #[test]
    fn most_specific_pattern_wins_within_a_level() {
        let rs = set(r#"
            [[rule]]
            name = "any"
            tier = "free"
            route = "*"
            limit = 1
            window = "1s"
            [[rule]]
            name = "v1"
            tier = "free"
            route = "/v1/*"
            limit = 1
            window = "1s"
            [[rule]]
            name = "post-v1"
            tier = "free"
            route = "POST /v1/*"
            limit = 1
            window = "1s"
            [[rule]]
            name = "charges"
            tier = "free"
            route = "/v1/charges"
            limit = 1
            window = "1s"
            [[rule]]
            name = "post-charges"
            tier = "free"
            route = "POST /v1/charges"
            limit = 1
            window = "1s"
            [[rule]]
            name = "charges-prefix"
            tier = "free"
            route = "/v1/charges/*"
            limit = 1
            window = "1s"
            "#);
        let t = Some("free");
        assert_eq!(
            name_of(&rs, "c", t, Some("POST /v1/charges")),
            "post-charges"
        );
        assert_eq!(name_of(&rs, "c", t, Some("GET /v1/charges")), "charges");
        assert_eq!(name_of(&rs, "c", t, Some("/v1/charges")), "charges");
        assert_eq!(
            name_of(&rs, "c", t, Some("POST /v1/charges/7")),
            "charges-prefix"
        );
        assert_eq!(name_of(&rs, "c", t, Some("POST /v1/users")), "post-v1");
        assert_eq!(name_of(&rs, "c", t, Some("GET /v1/users")), "v1");
        assert_eq!(name_of(&rs, "c", t, Some("GET /v2")), "any");
    }

    #[test]
    fn builtin_default_is_sliding_counter_100_per_60s() {
        let rs = RuleSet::builtin();
        assert_eq!(rs.len(), 1);
        let d = rs.default_rule();
        assert_eq!(&*d.name, "default");
        assert_eq!(
            d.spec,
            AlgorithmSpec::SlidingWindowCounter {
                limit: NonZeroU64::new(100).unwrap(),
                window: Duration::from_secs(60)
            }
        );
        assert_eq!(d.on_unavailable, FailMode::Open);
        assert_eq!(d.level(), MatchLevel::Default);
        assert_eq!(set("").default_rule(), d);
        assert_eq!(RuleSet::default().default_rule(), d);
    }

    #[test]
    fn default_section_replaces_builtin_default() {
        let rs = set("[default]\nalgorithm = \"fixed_window\"\nlimit = 7\nwindow = \"10s\"\non_unavailable = \"closed\"\n");
        let d = rs.default_rule();
        assert_eq!(
            d.spec,
            AlgorithmSpec::FixedWindow {
                limit: NonZeroU64::new(7).unwrap(),
                window: Duration::from_secs(10)
            }
        );
        assert_eq!(d.on_unavailable, FailMode::Closed);
    }

    #[test]
    fn module_doc_example_parses() {
        let doc = include_str!("rules.rs");
        let start = doc.find("//! ```toml\n").unwrap() + "//! ```toml\n".len();
        let end = start + doc[start..].find("//! ```\n").unwrap();
        let text: String = doc[start..end]
            .lines()
            .map(|l| {
                l.strip_prefix("//!")
                    .unwrap()
                    .strip_prefix(' ')
                    .unwrap_or("")
            })
            .collect::<Vec<_>>()
            .join("\n");
        let rs = set(&text);
        assert_eq!(rs.len(), 4);
        let free = rs.get("free-charges").unwrap();
        assert_eq!(
            free.spec,
            AlgorithmSpec::TokenBucket {
                capacity: NonZeroU64::new(20).unwrap(),
                refill: NonZeroU64::new(10).unwrap(),
                period: Duration::from_secs(60)
            }
        );
        assert_eq!(free.on_unavailable, FailMode::Closed);
        assert_eq!(free.level(), MatchLevel::TierRoute);
        let shaped = rs.get("search-shaped").unwrap();
        assert_eq!(
            shaped.spec,
            AlgorithmSpec::LeakyBucket {
                limit: NonZeroU64::new(20).unwrap(),
                period: Duration::from_secs(1),
                mode: LeakyMode::Shaper { queue_depth: 5 }
            }
        );
        assert_eq!(rs.get("vip-customer").unwrap().level(), MatchLevel::Client);
    }

    #[test]
    fn algorithm_defaults_fill_in() {
        let rs = set(r#"
            [[rule]]
            name = "tb"
            tier = "a"
            algorithm = "token_bucket"
            limit = 10
            window = "1m"
            [[rule]]
            name = "lb"
            tier = "b"
            algorithm = "leaky_bucket"
            limit = 10
            window = "1m"
            [[rule]]
            name = "lb-meter-burst"
            tier = "c"
            algorithm = "leaky_bucket"
            mode = "meter"
            burst = 4
            limit = 10
            window = "1m"
            "#);
        let spec = |n: &str| rs.get(n).unwrap().spec;
        let ten = NonZeroU64::new(10).unwrap();
        let minute = Duration::from_secs(60);
        assert_eq!(
            spec("tb"),
            AlgorithmSpec::TokenBucket {
                capacity: ten,
                refill: ten,
                period: minute
            }
        );
        assert_eq!(
            spec("lb"),
            AlgorithmSpec::LeakyBucket {
                limit: ten,
                period: minute,
                mode: LeakyMode::Meter {
                    burst: NonZeroU64::MIN
                }
            }
        );
        assert_eq!(
            spec("lb-meter-burst"),
            AlgorithmSpec::LeakyBucket {
                limit: ten,
                period: minute,
                mode: LeakyMode::Meter {
                    burst: NonZeroU64::new(4).unwrap()
                }
            }
        );
    }

    #[test]
    fn zero_limit_names_rule_and_field() {
        let e = invalid(
            "[[rule]]\nname = \"free-charges\"\ntier = \"free\"\nlimit = 0\nwindow = \"1s\"\n",
        );
        assert_eq!(
            e,
            "rule \"free-charges\": field \"limit\": must be an integer >= 1 (got 0)"
        );
        assert!(
            one_rule("limit = -5\nwindow = \"1s\"").contains("must be an integer >= 1 (got -5)")
        );
    }

    #[test]
    fn limit_above_a_billion_is_rejected() {
        let e = one_rule("limit = 1000000001\nwindow = \"1s\"");
        assert!(
            e.contains("rule \"x\": field \"limit\": must be at most 1000000000 (got 1000000001)"),
            "{e}"
        );
    }

    #[test]
    fn missing_limit_and_window_are_required() {
        let e = one_rule("");
        assert!(e.contains("rule \"x\": field \"limit\": required"), "{e}");
        assert!(e.contains("rule \"x\": field \"window\": required"), "{e}");
    }

    #[test]
    fn bad_window_syntax_names_rule_and_field() {
        let e = one_rule("limit = 1\nwindow = \"10q\"");
        assert_eq!(
            e,
            "rule \"x\": field \"window\": \"10q\" is not a duration (use 500ms, 10s, 1m, 1h, 1d)"
        );
    }

    #[test]
    fn window_out_of_bounds_is_rejected() {
        assert!(one_rule("limit = 1\nwindow = \"0s\"")
            .contains("field \"window\": must be between 1ms and 7d (got \"0s\")"));
        assert!(one_rule("limit = 1\nwindow = \"8d\"")
            .contains("field \"window\": must be between 1ms and 7d"));
        assert!(one_rule("limit = 1\nwindow = \"99999999999999d\"")
            .contains("field \"window\": \"99999999999999d\" is too large"));
        assert!(set("[[rule]]\nname=\"x\"\ntier=\"t\"\nlimit=1\nwindow=\"7d\"").len() == 2);
        assert!(set("[[rule]]\nname=\"x\"\ntier=\"t\"\nlimit=1\nwindow=\"1ms\"").len() == 2);
    }

    #[test]
    fn sliding_log_limit_above_100k_explains_memory() {
        let e = one_rule("algorithm = \"sliding_window_log\"\nlimit = 200000\nwindow = \"1s\"");
        assert!(e.contains("rule \"x\": field \"limit\": sliding_window_log keeps 16 bytes per admitted request"), "{e}");
        assert!(e.contains("3200000 bytes per key"), "{e}");
        assert!(e.contains("at most 100000"), "{e}");
        set("[[rule]]\nname=\"x\"\ntier=\"t\"\nalgorithm=\"sliding_window_log\"\nlimit=100000\nwindow=\"1s\"");
    }

    #[test]
    fn unknown_algorithm_lists_the_choices() {
        let e = one_rule("algorithm = \"tokenbucket\"\nlimit = 1\nwindow = \"1s\"");
        assert!(e.contains("rule \"x\": field \"algorithm\": \"tokenbucket\" is not an algorithm (use one of token_bucket"), "{e}");
    }

    #[test]
    fn burst_only_for_token_and_leaky_meter() {
        let e = one_rule("algorithm = \"fixed_window\"\nlimit = 1\nwindow = \"1s\"\nburst = 3");
        assert_eq!(
            e,
            "rule \"x\": field \"burst\": not used by algorithm fixed_window"
        );
        let e = one_rule("limit = 1\nwindow = \"1s\"\nburst = 3");
        assert!(
            e.contains("field \"burst\": not used by algorithm sliding_window_counter"),
            "{e}"
        );
        let e = one_rule("algorithm = \"leaky_bucket\"\nmode = \"shaper\"\nlimit = 1\nwindow = \"1s\"\nburst = 3");
        assert!(
            e.contains("field \"burst\": not used by leaky_bucket in shaper mode"),
            "{e}"
        );
    }

    #[test]
    fn burst_bounds() {
        let e = one_rule("algorithm = \"token_bucket\"\nlimit = 1\nwindow = \"1s\"\nburst = 0");
        assert!(
            e.contains("rule \"x\": field \"burst\": must be an integer >= 1 (got 0)"),
            "{e}"
        );
        let e = one_rule(
            "algorithm = \"token_bucket\"\nlimit = 1\nwindow = \"1s\"\nburst = 1000000001",
        );
        assert!(
            e.contains("field \"burst\": must be at most 1000000000"),
            "{e}"
        );
    }

    #[test]
    fn queue_depth_only_for_leaky_shaper() {
        let e =
            one_rule("algorithm = \"leaky_bucket\"\nlimit = 1\nwindow = \"1s\"\nqueue_depth = 3");
        assert!(
            e.contains("rule \"x\": field \"queue_depth\": not used by leaky_bucket in meter mode"),
            "{e}"
        );
        let e =
            one_rule("algorithm = \"token_bucket\"\nlimit = 1\nwindow = \"1s\"\nqueue_depth = 3");
        assert!(
            e.contains("field \"queue_depth\": not used by algorithm token_bucket"),
            "{e}"
        );
    }

    #[test]
    fn queue_depth_bounds() {
        let base = "algorithm = \"leaky_bucket\"\nmode = \"shaper\"\nlimit = 1\nwindow = \"1s\"\n";
        let e = one_rule(&format!("{base}queue_depth = -1"));
        assert!(
            e.contains("field \"queue_depth\": must be an integer >= 0 (got -1)"),
            "{e}"
        );
        let e = one_rule(&format!("{base}queue_depth = 1000001"));
        assert!(
            e.contains("field \"queue_depth\": must be at most 1000000"),
            "{e}"
        );
        set(&format!(
            "[[rule]]\nname=\"x\"\ntier=\"t\"\n{base}queue_depth = 0"
        ));
    }

    #[test]
    fn mode_only_for_leaky_bucket() {
        let e =
            one_rule("algorithm = \"token_bucket\"\nmode = \"shaper\"\nlimit = 1\nwindow = \"1s\"");
        assert!(
            e.contains("rule \"x\": field \"mode\": not used by algorithm token_bucket"),
            "{e}"
        );
        let e =
            one_rule("algorithm = \"leaky_bucket\"\nmode = \"queue\"\nlimit = 1\nwindow = \"1s\"");
        assert!(e.contains("field \"mode\": \"queue\" is not a mode"), "{e}");
    }

    #[test]
    fn bad_on_unavailable_is_rejected() {
        let e = one_rule("limit = 1\nwindow = \"1s\"\non_unavailable = \"maybe\"");
        assert!(
            e.contains("rule \"x\": field \"on_unavailable\": \"maybe\" is not a fail mode"),
            "{e}"
        );
    }

    #[test]
    fn duplicate_names_are_rejected() {
        let e = invalid("[[rule]]\nname=\"a\"\ntier=\"t\"\nlimit=1\nwindow=\"1s\"\n[[rule]]\nname=\"a\"\ntier=\"u\"\nlimit=1\nwindow=\"1s\"\n");
        assert_eq!(
            e,
            "rule \"a\": field \"name\": duplicate name (first used by rule #1)"
        );
    }

    #[test]
    fn bad_or_missing_or_reserved_names_are_rejected() {
        let e = invalid("[[rule]]\ntier=\"t\"\nlimit=1\nwindow=\"1s\"\n");
        assert!(
            e.contains("rule #1 (unnamed): field \"name\": required"),
            "{e}"
        );
        let e = invalid("[[rule]]\nname=\"has space\"\ntier=\"t\"\nlimit=1\nwindow=\"1s\"\n");
        assert!(
            e.contains("rule #1 (unnamed): field \"name\": \"has space\" must be 1..=64"),
            "{e}"
        );
        let long = "n".repeat(65);
        let e = invalid(&format!(
            "[[rule]]\nname=\"{long}\"\ntier=\"t\"\nlimit=1\nwindow=\"1s\"\n"
        ));
        assert!(e.contains("field \"name\""), "{e}");
        let e = invalid("[[rule]]\nname=\"default\"\ntier=\"t\"\nlimit=1\nwindow=\"1s\"\n");
        assert!(
            e.contains("rule \"default\": field \"name\": \"default\" is reserved"),
            "{e}"
        );
    }

    #[test]
    fn identical_selectors_are_rejected() {
        let e = invalid("[[rule]]\nname=\"a\"\ntier=\"t\"\nroute=\"/x/*\"\nlimit=1\nwindow=\"1s\"\n[[rule]]\nname=\"b\"\ntier=\"t\"\nroute=\"* /x/*\"\nlimit=2\nwindow=\"1s\"\n");
        assert!(e.contains("rule \"b\": has the same selector (client none, tier \"t\", route \"/x/*\") as rule \"a\""), "{e}");
        // Same route, different tier: fine.
        set("[[rule]]\nname=\"a\"\ntier=\"t\"\nroute=\"/x\"\nlimit=1\nwindow=\"1s\"\n[[rule]]\nname=\"b\"\ntier=\"u\"\nroute=\"/x\"\nlimit=1\nwindow=\"1s\"\n");
    }

    #[test]
    fn client_and_tier_together_are_rejected() {
        let e = invalid("[[rule]]\nname=\"a\"\nclient=\"c\"\ntier=\"t\"\nlimit=1\nwindow=\"1s\"\n");
        assert!(
            e.contains("rule \"a\": field \"tier\": cannot be combined with \"client\""),
            "{e}"
        );
    }

    #[test]
    fn rule_without_selector_points_to_default_section() {
        let e = invalid("[[rule]]\nname=\"a\"\nlimit=1\nwindow=\"1s\"\n");
        assert!(
            e.contains("rule \"a\": needs at least one of \"client\", \"tier\", \"route\""),
            "{e}"
        );
        assert!(e.contains("[default]"), "{e}");
    }

    #[test]
    fn empty_or_oversized_client_and_tier_are_rejected() {
        let e = invalid("[[rule]]\nname=\"a\"\nclient=\"\"\nlimit=1\nwindow=\"1s\"\n");
        assert!(
            e.contains("rule \"a\": field \"client\": must not be empty"),
            "{e}"
        );
        let e = invalid(&format!(
            "[[rule]]\nname=\"a\"\ntier=\"{}\"\nlimit=1\nwindow=\"1s\"\n",
            "t".repeat(257)
        ));
        assert!(
            e.contains("rule \"a\": field \"tier\": is 257 bytes long"),
            "{e}"
        );
    }

    #[test]
    fn bad_route_pattern_names_rule_and_field() {
        let e = invalid("[[rule]]\nname=\"a\"\nroute=\"get /x\"\nlimit=1\nwindow=\"1s\"\n");
        assert_eq!(
            e,
            "rule \"a\": field \"route\": route pattern \"get /x\": method must be uppercase letters A-Z"
        );
    }

    #[test]
    fn default_section_errors_name_the_section() {
        let e = invalid("[default]\nlimit = 0\nwindow = \"1s\"\n");
        assert_eq!(
            e,
            "[default]: field \"limit\": must be an integer >= 1 (got 0)"
        );
    }

    #[test]
    fn all_errors_are_reported_together() {
        let text = r#"
            [default]
            limit = 0
            window = "60s"

            [[rule]]
            name = "a"
            tier = "free"
            limit = 0
            window = "10q"
            burst = 5

            [[rule]]
            name = "b"
            limit = 10
            window = "1s"

            [[rule]]
            name = "a"
            client = "c"
            limit = 1
            window = "1s"
        "#;
        let Err(RulesError::Invalid(issues)) = RuleSet::from_toml_str(text) else {
            panic!("expected issues");
        };
        let lines: Vec<String> = issues.iter().map(ToString::to_string).collect();
        assert_eq!(lines.len(), 6, "{lines:#?}");
        assert!(lines[0].starts_with("[default]: field \"limit\""));
        assert!(lines[1].starts_with("rule \"a\": field \"limit\""));
        assert!(lines[2].starts_with("rule \"a\": field \"window\""));
        assert!(lines[3].starts_with("rule \"a\": field \"burst\""));
        assert!(lines[4].starts_with("rule \"b\": needs at least one"));
        assert!(lines[5].starts_with("rule \"a\": field \"name\": duplicate"));
        let shown = RulesError::Invalid(issues).to_string();
        assert_eq!(shown.lines().count(), 6);
    }

    #[test]
    fn unknown_fields_are_errors_with_position() {
        let e =
            RuleSet::from_toml_str("[[rule]]\nname = \"a\"\ntier = \"t\"\nlimt = 1\n").unwrap_err();
        let s = e.to_string();
        assert!(matches!(e, RulesError::Toml { .. }));
        assert!(s.contains("line 4"), "{s}");
        assert!(s.contains("limt"), "{s}");
        assert!(RuleSet::from_toml_str("[defaults]\nlimit = 1\n").is_err());
        assert!(
            RuleSet::from_toml_str("[default]\nname = \"x\"\nlimit = 1\nwindow=\"1s\"\n").is_err()
        );
    }

    #[test]
    fn toml_syntax_errors_carry_line_and_column() {
        let s = RuleSet::from_toml_str("[[rule]]\nname = \"a\"\nlimit = = 3\n")
            .unwrap_err()
            .to_string();
        assert!(s.contains("line 3, column"), "{s}");
        let s = RuleSet::from_toml_str("[[rule]]\nname = \"a\"\nlimit = \"ten\"\n")
            .unwrap_err()
            .to_string();
        assert!(s.contains("line 3"), "{s}");
    }

    #[test]
    fn load_names_the_file_on_io_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing.toml");
        let e = RuleSet::load(&path).unwrap_err();
        assert!(matches!(e, RulesError::Io { .. }));
        assert!(e.to_string().contains("missing.toml"), "{e}");
    }

    #[test]
    fn load_reads_a_file_and_names_it_on_syntax_error() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("rules.toml");
        std::fs::write(&good, LEVELS).unwrap();
        assert_eq!(RuleSet::load(&good).unwrap().len(), 6);
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "[[rule]\n").unwrap();
        let e = RuleSet::load(&bad).unwrap_err().to_string();
        assert!(e.contains("bad.toml") && e.contains("line 1"), "{e}");
    }

    #[test]
    fn durations_parse_integer_and_unit() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("60s"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1d"), Ok(Duration::from_secs(86400)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
    }

    #[test]
    fn durations_reject_other_syntax() {
        for bad in [
            "", "s", "10", "10q", "1.5s", "-1s", "+1s", " 1s", "1s ", "1 s", "1h30m", "1S", "1sec",
            "１s",
        ] {
            assert_eq!(parse_duration(bad), Err(DurationError::Syntax), "{bad:?}");
        }
    }

    #[test]
    fn durations_report_overflow() {
        assert_eq!(
            parse_duration("99999999999999d"),
            Err(DurationError::Overflow)
        );
        assert_eq!(
            parse_duration("99999999999999999999999ms"),
            Err(DurationError::Overflow)
        );
        assert_eq!(
            parse_duration("18446744073709551615ms"),
            Ok(Duration::from_millis(u64::MAX))
        );
    }

    const FP_A: &str = r#"
        [[rule]]
        name = "a"
        tier = "free"
        algorithm = "token_bucket"
        limit = 10
        burst = 20
        window = "1m"
        [[rule]]
        name = "b"
        client = "c"
        algorithm = "leaky_bucket"
        mode = "shaper"
        queue_depth = 3
        limit = 5
        window = "1s"
    "#;
    const FP_B: &str = r#"
        [[rule]]
        name = "b"
        client = "c"
        algorithm = "leaky_bucket"
        mode = "shaper"
        queue_depth = 3
        limit = 5
        window = "1s"
        [[rule]]
        name = "a"
        tier = "free"
        algorithm = "token_bucket"
        limit = 10
        burst = 20
        window = "60s"
    "#;

    #[test]
    fn fingerprint_is_stable_across_rule_order() {
        let (a, b) = (set(FP_A), set(FP_B));
        for name in ["a", "b", "default"] {
            assert_eq!(
                a.get(name).unwrap().fingerprint,
                b.get(name).unwrap().fingerprint
            );
        }
        let r = a.get("a").unwrap();
        assert_eq!(r.fingerprint, r.spec.fingerprint());
    }

    #[test]
    fn fingerprint_changes_when_a_number_changes() {
        let base = set(FP_A);
        let fp = |rs: &RuleSet, n: &str| rs.get(n).unwrap().fingerprint;
        for (from, to, rule) in [
            ("limit = 10", "limit = 11", "a"),
            ("burst = 20", "burst = 21", "a"),
            ("window = \"1m\"", "window = \"61s\"", "a"),
            ("queue_depth = 3", "queue_depth = 4", "b"),
            (
                "mode = \"shaper\"\n        queue_depth = 3",
                "mode = \"meter\"",
                "b",
            ),
        ] {
            let changed = set(&FP_A.replacen(from, to, 1));
            assert_ne!(fp(&base, rule), fp(&changed, rule), "{from} -> {to}");
        }
        // Same numbers under another algorithm must not collide either.
        let fixed = AlgorithmSpec::FixedWindow {
            limit: NonZeroU64::MIN,
            window: Duration::from_secs(1),
        };
        let counter = AlgorithmSpec::SlidingWindowCounter {
            limit: NonZeroU64::MIN,
            window: Duration::from_secs(1),
        };
        assert_ne!(fixed.fingerprint(), counter.fingerprint());
    }

    #[test]
    fn fingerprint_ignores_selector_and_fail_mode() {
        let moved = FP_A.replacen(
            "tier = \"free\"",
            "tier = \"pro\"\non_unavailable = \"closed\"",
            1,
        );
        assert_eq!(
            set(FP_A).get("a").unwrap().fingerprint,
            set(&moved).get("a").unwrap().fingerprint
        );
    }

    #[test]
    fn fingerprint_is_pinned_across_builds() {
        // Nodes of different versions must agree; changing the encoding resets all counters.
        let spec = RuleSet::builtin().default_rule().spec;
        assert_eq!(spec.fingerprint(), 3_508_162_426_882_450_458);
    }

    #[test]
    fn thousands_of_client_overrides_match_by_index() {
        let mut text = String::new();
        for i in 0..3000 {
            text.push_str(&format!(
                "[[rule]]\nname=\"c{i}\"\nclient=\"cust_{i}\"\nlimit={}\nwindow=\"1s\"\n",
                i + 1
            ));
        }
        let rs = set(&text);
        assert_eq!(rs.len(), 3001);
        assert_eq!(name_of(&rs, "cust_2999", None, Some("/x")), "c2999");
        assert_eq!(name_of(&rs, "cust_3000", None, Some("/x")), "default");
    }

    // ----- property tests -----

    const CLIENTS: [&str; 3] = ["c1", "c2", "c3"];
    const TIERS: [&str; 2] = ["free", "pro"];
    const PATTERNS: [&str; 11] = [
        "*",
        "GET /*",
        "/v1/*",
        "POST /v1/*",
        "/v1/charges",
        "POST /v1/charges",
        "GET /v1/charges",
        "/v1/charges*",
        "/v1/charges/*",
        "/v2/x",
        "DELETE /v1/*",
    ];
    const ROUTES: [&str; 8] = [
        "GET /v1/charges",
        "POST /v1/charges",
        "/v1/charges",
        "/v1/users",
        "/v2/x",
        "DELETE /v1/charges/1",
        "/",
        "POST /v1/chargesX",
    ];

    /// (client index or none, tier index or none, pattern index or none)
    type Sel = (Option<usize>, Option<usize>, Option<usize>);

    fn selector_strategy() -> impl Strategy<Value = Sel> {
        (
            prop::option::of(0..CLIENTS.len()),
            prop::option::of(0..TIERS.len()),
            prop::option::of(0..PATTERNS.len()),
        )
            .prop_map(|(c, t, r)| (c, if c.is_some() { None } else { t }, r))
            .prop_filter("needs a selector", |(c, t, r)| {
                c.is_some() || t.is_some() || r.is_some()
            })
    }

    fn render(sels: &[Sel]) -> String {
        let mut text = String::new();
        for (i, (c, t, r)) in sels.iter().enumerate() {
            text.push_str(&format!(
                "[[rule]]\nname = \"r{i}\"\nlimit = {}\nwindow = \"1s\"\n",
                i + 1
            ));
            if let Some(c) = c {
                text.push_str(&format!("client = \"{}\"\n", CLIENTS[*c]));
            }
            if let Some(t) = t {
                text.push_str(&format!("tier = \"{}\"\n", TIERS[*t]));
            }
            if let Some(r) = r {
                text.push_str(&format!("route = \"{}\"\n", PATTERNS[*r]));
            }
        }
        text
    }

    /// The precedence written as plainly as possible: rank every rule, take the best.
    fn brute_force<'a>(
        rs: &'a RuleSet,
        client: &str,
        tier: Option<&str>,
        route: Option<&Route<'_>>,
    ) -> &'a Arc<Rule> {
        let applies = |rule: &&Arc<Rule>| {
            let s = &rule.selector;
            s.client.as_deref().is_none_or(|c| c == client)
                && (s.tier.is_none() || s.tier.as_deref() == tier)
                && s.route
                    .as_ref()
                    .is_none_or(|p| route.is_some_and(|r| p.matches(r)))
        };
        // Lowest level first, then the most specific pattern, then file order.
        rs.rules()
            .iter()
            .filter(applies)
            .enumerate()
            .min_by_key(|(i, rule)| {
                let spec = rule.selector.route.as_ref().map(RoutePattern::specificity);
                (rule.level(), std::cmp::Reverse(spec), *i)
            })
            .expect("the default always matches")
            .1
    }

    proptest! {
        #[test]
        fn from_toml_str_never_panics_on_arbitrary_text(s in any::<String>()) {
            let _ = RuleSet::from_toml_str(&s);
        }

        #[test]
        fn from_toml_str_never_panics_on_rule_shaped_text(
            lines in prop::collection::vec((
                prop::sample::select(vec![
                    "[[rule]]", "[default]", "name = ", "client = ", "tier = ", "route = ",
                    "algorithm = ", "limit = ", "window = ", "burst = ", "mode = ",
                    "queue_depth = ", "on_unavailable = ",
                ]),
                prop::sample::select(vec![
                    "", "\"a\"", "\"b\"", "0", "-1", "1", "9223372036854775807", "-9223372036854775808",
                    "\"token_bucket\"", "\"leaky_bucket\"", "\"sliding_window_log\"", "\"fixed_window\"",
                    "\"shaper\"", "\"meter\"", "\"1s\"", "\"0ms\"", "\"99999999999999d\"", "\"*\"",
                    "\"POST /v1/*\"", "\"get /\"", "1.5", "true", "[]", "\"closed\"",
                ]),
            ), 0..24)
        ) {
            let text: String = lines.iter().map(|(k, v)| {
                if k.starts_with('[') { format!("{k}\n") } else { format!("{k}{v}\n") }
            }).collect();
            let _ = RuleSet::from_toml_str(&text);
        }

        #[test]
        fn matching_equals_brute_force_precedence(
            sels in prop::collection::vec(selector_strategy(), 0..24),
            queries in prop::collection::vec((
                prop::sample::select(vec!["c1", "c2", "c3", "c4"]),
                prop::option::of(prop::sample::select(vec!["free", "pro", "gold"])),
                prop::option::of(0..ROUTES.len()),
            ), 1..32),
        ) {
            let mut seen = std::collections::HashSet::new();
            let unique: Vec<Sel> = sels
                .into_iter()
                .filter(|(c, t, r)| {
                    // "*" and "/*" are one selector; keep the generator's duplicates out.
                    seen.insert((*c, *t, r.map(|i| RoutePattern::parse(PATTERNS[i]).unwrap())))
                })
                .collect();
            let rs = set(&render(&unique));
            for (client, tier, route) in queries {
                let route = route.map(|i| Route::parse(ROUTES[i]).unwrap());
                let fast = rs.matching(client, tier, route.as_ref());
                let slow = brute_force(&rs, client, tier, route.as_ref());
                prop_assert_eq!(&fast.name, &slow.name, "client {} tier {:?} route {:?}", client, tier, route);
            }
        }
    }
}
