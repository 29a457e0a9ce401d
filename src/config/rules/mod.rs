//! Rate-limit rules: the rule document, its validation, and the hot-path matcher.
//!
//! A rule says *how much* (algorithm, limit, window) for *whom* (a client key, a tier, a
//! route, or a combination). Every check is matched against the rule set to find the one
//! rule that governs it; the most specific rule wins. A node without rules uses the
//! built-in default ([`BUILTIN_LIMIT`] per [`BUILTIN_WINDOW`], sliding window counter), so
//! `ringlimit serve` works out of the box.
//!
//! The manual for operators (file format, every field and its bounds, which rule applies,
//! what one counter is, how errors read, the cluster rules API) is `docs/rules.md`; the
//! parser's tests pin its example file and its error excerpt, so the two cannot drift.
//!
//! # Layout
//!
//! This file is the model: a [`Rule`] and what it is made of, so that every other layer can
//! depend on it without pulling in TOML. `doc` is the loose document shape (TOML, JSON, the
//! API and peers all speak it); `parse` turns a document into validated rules and names
//! every problem by rule and field; `error` says what went wrong without echoing unbounded
//! input; `file` reads the rule file without blocking or reading without bound and tells a
//! watcher what each poll means; `index` answers "which rule governs this check" on the hot
//! path; `stored` and `versioned` keep the cluster's copy and its version stamps; `envoy`
//! reads envoyproxy/ratelimit domains, from the shape `envoy_doc` gives one domain whether
//! it came as YAML or over xDS. Only `envoy` is public (it re-exports `envoy_doc`); the
//! others' public items are re-exported here.

use std::fmt;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use super::route::RoutePattern;
use crate::algorithms::{
    AlgorithmError, AlgorithmKind, FixedWindow, Gcra, Limiter, SlidingCounter, SlidingLog,
    TokenBucket,
};

mod doc;
pub mod envoy;
mod envoy_doc;
mod error;
mod file;
mod index;
mod parse;
mod stored;
mod versioned;

pub use doc::{DocDefault, DocEnvoy, DocRule, RulesDoc, TierLimit};
pub use error::{RuleIssue, RuleRef, RulesError, SyntaxError, MAX_ISSUES_SHOWN, MAX_QUOTE_CHARS};
pub use file::{
    read_rules_file, read_rules_file_capped, stored_copy_cap, RuleFile, MAX_RULES_BYTES_FLAG,
    MAX_RULES_FILE_BYTES,
};
pub use index::RuleSet;
pub use parse::{
    parse_duration, DurationError, LOG_BYTES_PER_ENTRY, MAX_KEY_LEN, MAX_LIMIT, MAX_LOG_LIMIT,
    MAX_NAME_LEN, MAX_QUEUE_DEPTH, MAX_TIER_LEN, MAX_WINDOW, MIN_WINDOW,
};
pub use stored::{load_stored, load_stored_capped, store, StoreError, STORED_FILE};
pub use versioned::{best_source, Advert, EnvoyAdvert, RulesSource, Stamp};

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
    /// What a partition does to this rule's counters: two deciders (`split`), or only
    /// a side that sees a majority of the cluster decides (`fence`). Not part of the
    /// fingerprint: the counters mean the same either way.
    pub partition: Partition,
    /// What one counter is: one per client key, or one per client key and route.
    pub per: CountPer,
    /// [`rule_fingerprint`] of `spec` and `per`, precomputed so a reload can tell in O(1)
    /// whether a rule's counters are still meaningful.
    pub fingerprint: u64,
    /// The algorithm built from `spec`, ready for the shard: built once at load, so an
    /// invalid combination of numbers is a load error, never a hot-path surprise.
    pub limiter: Limiter,
    /// Shadow mode (`mode = "shadow"`, envoyproxy/ratelimit's `shadow_mode`): the rule is
    /// counted as usual, but a denial is reported (answer flag, the
    /// `ringlimit_shadow_denials_total{rule}` metric) and the check is allowed; a shadow
    /// denial never makes sibling descriptors refunded. Not part of the fingerprint:
    /// turning shadow mode off keeps the counters.
    pub shadow: bool,
    /// `concurrency = N`: at most N of a client's requests in flight at once, held as
    /// leases (`Acquire`/`Release`) on the key's owner, apart from the rate counters.
    /// Not part of the fingerprint: changing it keeps the leases held.
    pub concurrency: Option<u32>,
    /// Whether the owner may lend this rule's budget to entry nodes as budget leases
    /// (`lease = false` in the rule file says no; docs/leases.md). Not part of the
    /// fingerprint: leases already granted run out by their TTL.
    pub lease: bool,
    /// Whether the owner writes this rule's counters to its snapshot in `--data-dir`
    /// (`snapshot = false` in the rule file says no; docs/ownership.md). Not part of
    /// the fingerprint: the next snapshot follows a change.
    pub snapshot: bool,
}

impl Rule {
    /// The fail-open stand-in for this rule on a node deciding alone while the key's
    /// owner is unreachable: the limit divided by `nodes` (the live node count), and its
    /// own counters (name `<rule>~fallback/<nodes>`), so degraded decisions never mix
    /// with the real ones if this node later owns the key.
    ///
    /// The node count is part of the name, so each ring size has its own counter: while
    /// a partition makes the ring flap between sizes, a counter built under one share
    /// is kept, not restarted by the other share's fingerprint (the chaos checker's
    /// S1-fallback caught 5 admitted under a share of 3 when the two shared a name).
    pub fn fallback(&self, nodes: u64) -> Rule {
        Rule::new(
            &format!("{}{FALLBACK_SUFFIX}/{}", self.name, nodes.max(1)),
            self.selector.clone(),
            self.spec.divided(nodes),
            self.on_unavailable,
            self.per,
        )
        .shadowed(self.shadow)
    }

    /// True for a [`Rule::fallback`]: its counters belong to this node alone and are never
    /// handed to another (rule names cannot contain `~`, so no configured rule matches).
    pub fn is_node_local(&self) -> bool {
        self.name.contains(FALLBACK_SUFFIX)
    }

    /// The name metrics count this rule under: a fail-open stand-in counts under the rule
    /// it stands in for, so a label never grows with the ring sizes a node has seen.
    pub fn base_name(&self) -> &str {
        self.name
            .split_once(FALLBACK_SUFFIX)
            .map_or(&*self.name, |(base, _)| base)
    }

    /// The precedence level this rule matches at, derived from its selector alone; reported
    /// with decisions so operators can see why a rule applied.
    pub fn level(&self) -> MatchLevel {
        self.selector.level()
    }

    /// The default rule of a node without a rule file or without a `[default]` section.
    fn builtin_default() -> Rule {
        Rule::new(
            DEFAULT_RULE_NAME,
            Selector::default(),
            AlgorithmSpec::SlidingWindowCounter {
                limit: nonzero(BUILTIN_LIMIT),
                window: BUILTIN_WINDOW,
            },
            FailMode::Open,
            CountPer::Client,
        )
    }

    /// A rule that is in no rule set: numbers a request carried (Gubernator's inline
    /// limits), matching nothing by itself. An error if the algorithm refuses the numbers.
    pub fn unlisted(
        name: &str,
        spec: AlgorithmSpec,
        on_unavailable: FailMode,
        per: CountPer,
    ) -> Result<Self, AlgorithmError> {
        spec.limiter()?;
        // Caller-chosen limits (Gubernator's, `CL.THROTTLE`'s) fail closed for their
        // protocols' sake, not as abuse limits: they split in partitions (fenced, their
        // callers would be denied for the hold after every join).
        Ok(
            Rule::new(name, Selector::default(), spec, on_unavailable, per)
                .partitioned(Partition::Split),
        )
    }

    /// Only called with specs that [`parse::build_spec`] accepted, which already built the
    /// limiter once; the bounds it checks make the constructors infallible here.
    fn new(
        name: &str,
        selector: Selector,
        spec: AlgorithmSpec,
        on_unavailable: FailMode,
        per: CountPer,
    ) -> Self {
        let limiter = spec
            .limiter()
            .expect("build_spec only returns specs whose limiter builds");
        Rule {
            name: name.into(),
            selector,
            fingerprint: rule_fingerprint(&spec, per),
            limiter,
            spec,
            on_unavailable,
            partition: Partition::default_for(on_unavailable),
            per,
            shadow: false,
            concurrency: None,
            lease: true,
            snapshot: true,
        }
    }

    /// This rule fenced in partitions or not: see [`Rule::partition`].
    pub fn partitioned(mut self, partition: Partition) -> Self {
        self.partition = partition;
        self
    }

    /// Whether only a node that sees a majority of the cluster may decide this rule's
    /// counters ([`Partition::Fence`]).
    pub fn is_fenced(&self) -> bool {
        self.partition == Partition::Fence
    }

    /// This rule's counters in the node's snapshot or not: see [`Rule::snapshot`].
    pub fn snapshotting(mut self, snapshot: bool) -> Self {
        self.snapshot = snapshot;
        self
    }

    /// This rule lending its budget as leases or not: see [`Rule::lease`].
    pub fn leasing(mut self, lease: bool) -> Self {
        self.lease = lease;
        self
    }

    /// This rule with a concurrency limit (or none): see [`Rule::concurrency`].
    pub fn with_concurrency(mut self, concurrency: Option<u32>) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// This rule in shadow mode (or not): see [`Rule::shadow`].
    pub fn shadowed(mut self, shadow: bool) -> Self {
        self.shadow = shadow;
        self
    }
}

/// The fingerprint a rule's counters are kept under: its algorithm and numbers
/// ([`AlgorithmSpec::fingerprint`]) and what one counter is ([`CountPer`]), hashed with
/// xxh3 over an explicit encoding so every node and build agree.
///
/// `per` is part of it because switching it changes what a count means (one budget for
/// all routes, or one per route): like a changed number, it restarts the rule's counters,
/// and a handed-over state counted the other way finds no rule to be installed under.
pub fn rule_fingerprint(spec: &AlgorithmSpec, per: CountPer) -> u64 {
    let mut buf = [0u8; 26];
    buf[..17].copy_from_slice(b"ringlimit.rule.v2");
    buf[17..25].copy_from_slice(&spec.fingerprint().to_le_bytes());
    buf[25] = match per {
        CountPer::Client => 0,
        CountPer::Route => 1,
    };
    xxhash_rust::xxh3::xxh3_64(&buf)
}

/// What one counter of a rule is: whose budget a check spends.
///
/// The client key always places and separates counters; this says whether the route
/// separates them too. The default closes the "fresh budget per path" bypass: a client
/// cannot get more than the limit by varying the path or appending `?nonce=N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CountPer {
    /// One budget per (rule, client key), shared by every route the rule matches.
    #[default]
    Client,
    /// One budget per (rule, client key, normalised route): method + path, no query string
    /// or fragment.
    Route,
}

impl CountPer {
    /// The route part of a counter's identity for a check on `normalised` (the route's
    /// [`Route::as_str`](crate::config::route::Route::as_str)): empty unless the rule counts
    /// per route. Length-prefixed in the identity, so empty never collides with a route.
    pub fn route_part(self, normalised: &str) -> &str {
        match self {
            CountPer::Client => "",
            CountPer::Route => normalised,
        }
    }

    /// The value as written in the rule file.
    pub fn as_str(self) -> &'static str {
        match self {
            CountPer::Client => "client",
            CountPer::Route => "route",
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

    /// Which algorithm these numbers are for; the same kind as the limiter they build.
    pub fn kind(&self) -> AlgorithmKind {
        match self {
            AlgorithmSpec::TokenBucket { .. } => AlgorithmKind::TokenBucket,
            AlgorithmSpec::LeakyBucket { .. } => AlgorithmKind::LeakyBucket,
            AlgorithmSpec::FixedWindow { .. } => AlgorithmKind::FixedWindow,
            AlgorithmSpec::SlidingWindowLog { .. } => AlgorithmKind::SlidingWindowLog,
            AlgorithmSpec::SlidingWindowCounter { .. } => AlgorithmKind::SlidingWindowCounter,
        }
    }

    /// The name as written in the rule file, for messages and metric labels.
    pub fn algorithm_name(&self) -> &'static str {
        self.kind().as_str()
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
    /// does not change it. A rule's own fingerprint ([`rule_fingerprint`]) adds its `per`.
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

/// What a network partition does to a rule's counters (`partition` in the rule file).
///
/// Fail-closed rules fence by default: they are the limits that must not be exceeded
/// (abuse prevention), so they trade availability in the minority for exactness.
/// Fail-open rules split by default: a quota that admits up to L per side for the
/// length of a partition beats one that stops serving (docs/ownership.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Partition {
    /// Every side decides: a key's owner for the entry nodes that reach it, its
    /// successor for the others. A (key, window) admits at most L per decider.
    Split,
    /// Only a node that sees a majority of the cluster, and is the key's only live
    /// owner, decides; any other denies, degraded. A (key, window) admits at most L
    /// (the exceptions are in docs/ownership.md).
    Fence,
}

impl Partition {
    /// The default for a rule with this fail mode: closed fences, open splits.
    pub fn default_for(on_unavailable: FailMode) -> Partition {
        match on_unavailable {
            FailMode::Closed => Partition::Fence,
            FailMode::Open => Partition::Split,
        }
    }

    /// The rule file's word for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Partition::Split => "split",
            Partition::Fence => "fence",
        }
    }
}

/// Parses a rule's `partition` field against its fail mode: `None` (the default for
/// `on_unavailable`), `"split"` or `"fence"`. The error says what is wrong, in the
/// rule file's terms, for every format that carries the field.
pub fn parse_partition(field: Option<&str>, on_unavailable: FailMode) -> Result<Partition, String> {
    let partition = match field {
        None => return Ok(Partition::default_for(on_unavailable)),
        Some("split") => Partition::Split,
        Some("fence") => Partition::Fence,
        Some(other) => {
            return Err(format!(
                "{other:?} is not a partition mode (use \"fence\": only a side that sees a \
                 majority of the cluster decides, or \"split\": every side decides)"
            ))
        }
    };
    if partition == Partition::Fence && on_unavailable == FailMode::Open {
        return Err(
            "\"fence\" needs on_unavailable = \"closed\": a fenced rule never decides \
                    on a fail-open share, so its unreachable owner means a denial"
                .into(),
        );
    }
    Ok(partition)
}

fn nonzero(v: u64) -> NonZeroU64 {
    // Callers pass values already checked to be >= 1; 1 is a safe fallback regardless.
    NonZeroU64::new(v).unwrap_or(NonZeroU64::MIN)
}

/// Helpers shared by the tests of this module and its submodules.
#[cfg(test)]
mod testing {
    use super::RuleSet;

    pub(super) fn set(text: &str) -> RuleSet {
        RuleSet::from_toml_str(text).unwrap_or_else(|e| panic!("{e}"))
    }

    pub(super) const LEVELS: &str = r#"
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
}

#[cfg(test)]
mod tests {
    use super::testing::set;
    use super::*;

    #[test]
    fn spec_kind_is_the_kind_of_its_limiter_and_names_it() {
        let rs = set(r#"
            [default]
            limit = 1
            window = "1s"
            [[rule]]
            name = "tb"
            tier = "a"
            algorithm = "token_bucket"
            limit = 1
            window = "1s"
            [[rule]]
            name = "lb"
            tier = "b"
            algorithm = "leaky_bucket"
            limit = 1
            window = "1s"
            [[rule]]
            name = "fw"
            tier = "c"
            algorithm = "fixed_window"
            limit = 1
            window = "1s"
            [[rule]]
            name = "log"
            tier = "d"
            algorithm = "sliding_window_log"
            limit = 1
            window = "1s"
            "#);
        let kinds: Vec<AlgorithmKind> = rs.rules().iter().map(|r| r.spec.kind()).collect();
        let mut all = AlgorithmKind::ALL.to_vec();
        all.rotate_right(1);
        assert_eq!(kinds, all);
        for rule in rs.rules() {
            assert_eq!(rule.spec.kind(), rule.limiter.kind());
            assert_eq!(rule.spec.algorithm_name(), rule.spec.kind().as_str());
        }
    }

    #[test]
    fn fallback_divides_the_limit_by_the_node_count_but_never_below_one() {
        let rules = RuleSet::builtin();
        let fallback = rules.default_rule().fallback(3);
        assert_eq!(&*fallback.name, "default~fallback/3");
        assert_eq!(fallback.spec.limit().get(), 33);
        assert_eq!(fallback.spec.window(), rules.default_rule().spec.window());
        assert_eq!(rules.default_rule().fallback(1000).spec.limit().get(), 1);
        assert_ne!(fallback.fingerprint, rules.default_rule().fingerprint);
    }

    #[test]
    fn a_fallback_counts_under_the_name_of_the_rule_it_stands_in_for() {
        let rules = RuleSet::builtin();
        let rule = rules.default_rule();
        assert_eq!(rule.base_name(), "default");
        assert_eq!(rule.fallback(3).base_name(), "default");
        assert_eq!(rule.fallback(1000).base_name(), "default");
        assert!(rule.fallback(3).is_node_local() && !rule.is_node_local());
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
        assert_eq!(r.fingerprint, rule_fingerprint(&r.spec, r.per));
    }

    #[test]
    fn fingerprint_changes_when_per_changes() {
        // Counting per route or per client are different counts: switching restarts them.
        let base = set(FP_A);
        let per_route =
            set(&FP_A.replacen("tier = \"free\"", "tier = \"free\"\nper = \"route\"", 1));
        let explicit =
            set(&FP_A.replacen("tier = \"free\"", "tier = \"free\"\nper = \"client\"", 1));
        let fp = |rs: &RuleSet| rs.get("a").unwrap().fingerprint;
        assert_ne!(fp(&base), fp(&per_route));
        assert_eq!(fp(&base), fp(&explicit), "client is the default");
        assert_eq!(
            base.get("a").unwrap().spec,
            per_route.get("a").unwrap().spec,
            "same numbers: only per differs"
        );
        // The fail-open stand-in counts the same way as its rule.
        let rule = per_route.get("a").unwrap();
        assert_eq!(rule.fallback(3).per, CountPer::Route);
        assert_ne!(
            rule.fallback(3).fingerprint,
            base.get("a").unwrap().fallback(3).fingerprint
        );
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
        let rule = RuleSet::builtin().default_rule().clone();
        assert_eq!(rule.spec.fingerprint(), 3_508_162_426_882_450_458);
        assert_eq!(rule.fingerprint, 13_225_777_028_764_748_139);
    }
}
