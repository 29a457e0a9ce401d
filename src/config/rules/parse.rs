//! The rule file: TOML text to validated [`Rule`]s.
//!
//! Deserialization is deliberately loose (numbers as `i64`, names as strings) and validation
//! strict, so a file with five mistakes gets five lines, each naming the rule and the field,
//! instead of the first serde error. The messages are the user interface of the rule file;
//! the tests pin them.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::num::NonZeroU64;
use std::path::Path;
use std::time::Duration;

use super::error::{quote, RuleIssue, RuleRef, RulesError, MAX_QUOTE_CHARS};
use super::{
    nonzero, AlgorithmSpec, CountPer, FailMode, LeakyMode, Partition, Rule, RuleSet, Selector,
    DEFAULT_RULE_NAME,
};
use crate::algorithms::{AlgorithmKind, UnknownAlgorithm};
use crate::config::route::RoutePattern;

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
pub const MAX_KEY_LEN: usize = crate::config::bounds::MAX_KEY_BYTES;

/// Longest rule name; names appear in every answer and metric label.
pub const MAX_NAME_LEN: usize = 64;

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

/// Longest tier a rule may name: a check's tier is refused beyond the same bound, so a
/// longer tier in a rule could never match.
pub const MAX_TIER_LEN: usize = crate::config::bounds::MAX_TIER_BYTES;

// ---------------------------------------------------------------------------------------------
// Raw file shape. Numbers are read as i64 and names as strings so that 0, negatives and
// unknown algorithm names become rule-naming issues (all of them), not one serde error.

// The raw shapes are the public rule document (`doc.rs`): the same loose fields serve
// the file, the API and what peers exchange.
use super::doc::{DocDefault as RawDefault, DocRule as RawRule, RulesDoc as RawFile};
use super::envoy::EnvoyConfig;

/// The limit-related fields, shared by `[default]` and `[[rule]]`.
struct RawSpec<'a> {
    algorithm: Option<&'a str>,
    limit: Option<i64>,
    window: Option<&'a str>,
    burst: Option<i64>,
    mode: Option<&'a str>,
    queue_depth: Option<i64>,
    on_unavailable: Option<&'a str>,
    partition: Option<&'a str>,
    per: Option<&'a str>,
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
            partition: self.partition.as_deref(),
            per: self.per.as_deref(),
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
            partition: self.partition.as_deref(),
            per: self.per.as_deref(),
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

/// The algorithm of a rule without an `algorithm` field: exact enough for most limits at a
/// fixed 24 bytes per key.
const DEFAULT_ALGORITHM: AlgorithmKind = AlgorithmKind::SlidingWindowCounter;

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

/// What [`build_spec`] makes of the fields shared by `[default]` and `[[rule]]`.
struct Built {
    spec: AlgorithmSpec,
    on_unavailable: FailMode,
    partition: Partition,
    per: CountPer,
    shadow: bool,
}

/// Validates the limit fields; `None` if any issue was recorded.
fn build_spec(issues: &mut Issues<'_>, raw: &RawSpec<'_>) -> Option<Built> {
    let before = issues.out.len();
    let algo = algorithm_field(issues, raw);
    let limit = limit_field(issues, raw, algo);
    let window = window_field(issues, raw);
    // `shadow` is not a leaky-bucket mode but the rule's: any algorithm may be shadowed.
    let shadow = raw.mode == Some("shadow");
    let shaper = mode_field(issues, raw, algo);
    let burst = burst_field(issues, raw, algo, shaper);
    let queue_depth = queue_depth_field(issues, raw, algo, shaper);
    let on_unavailable = on_unavailable_field(issues, raw);
    let partition =
        super::parse_partition(raw.partition, on_unavailable).unwrap_or_else(|message| {
            issues.field("partition", message);
            Partition::Split
        });
    let per = per_field(issues, raw);
    if issues.out.len() != before {
        return None;
    }
    let (algo, limit, window) = (algo?, nonzero(limit?), window?);
    let spec = algorithm_spec(algo, limit, window, burst, queue_depth, shaper);
    if let Err(error) = spec.limiter() {
        // The bounds above should make this unreachable; if the algorithms ever accept
        // less than the rule format allows, the file is refused with the reason.
        issues.rule(format!("numbers rejected by the algorithm: {error}"));
        return None;
    }
    Some(Built {
        spec,
        on_unavailable,
        partition,
        per,
        shadow,
    })
}

/// `algorithm`: a known name, or the default when absent.
fn algorithm_field(issues: &mut Issues<'_>, raw: &RawSpec<'_>) -> Option<AlgorithmKind> {
    match raw.algorithm.map(str::parse::<AlgorithmKind>) {
        None => Some(DEFAULT_ALGORITHM),
        Some(Ok(kind)) => Some(kind),
        Some(Err(unknown)) => {
            // The error quotes the name; bound it like every other echoed value.
            let name = match unknown.name.char_indices().nth(MAX_QUOTE_CHARS) {
                Some((end, _)) => format!("{}…", &unknown.name[..end]),
                None => unknown.name,
            };
            issues.field("algorithm", UnknownAlgorithm { name }.to_string());
            None
        }
    }
}

/// `limit`: required, 1..=[`MAX_LIMIT`], and at most [`MAX_LOG_LIMIT`] for a sliding log.
fn limit_field(
    issues: &mut Issues<'_>,
    raw: &RawSpec<'_>,
    algo: Option<AlgorithmKind>,
) -> Option<u64> {
    let limit = match raw.limit {
        None => {
            issues.field("limit", "required (units per window, e.g. limit = 100)");
            None
        }
        Some(v) => bounded(issues, "limit", v, 1, MAX_LIMIT),
    };
    if let (Some(log @ AlgorithmKind::SlidingWindowLog), Some(l)) = (algo, limit) {
        if l > MAX_LOG_LIMIT {
            let counter = AlgorithmKind::SlidingWindowCounter;
            issues.field(
                "limit",
                format!(
                    "{log} keeps {LOG_BYTES_PER_ENTRY} bytes per admitted request per key, so \
                     limit {l} would need {} bytes per key; at most {MAX_LOG_LIMIT} (use \
                     {counter} for large limits)",
                    l * LOG_BYTES_PER_ENTRY
                ),
            );
        }
    }
    limit
}

/// `window`: required, a duration between [`MIN_WINDOW`] and [`MAX_WINDOW`].
fn window_field(issues: &mut Issues<'_>, raw: &RawSpec<'_>) -> Option<Duration> {
    match raw.window {
        None => {
            issues.field("window", "required (e.g. window = \"60s\")");
            None
        }
        Some(text) => match parse_duration(text) {
            Err(e) => {
                issues.field("window", format!("{} {e}", quote(text)));
                None
            }
            Ok(d) if !(MIN_WINDOW..=MAX_WINDOW).contains(&d) => {
                issues.field(
                    "window",
                    format!("must be between 1ms and 7d (got {})", quote(text)),
                );
                None
            }
            Ok(d) => Some(d),
        },
    }
}

/// `mode`: whether a leaky bucket shapes (`shaper`) rather than meters; `shadow` is any
/// rule's, and other modes only a leaky bucket's.
fn mode_field(issues: &mut Issues<'_>, raw: &RawSpec<'_>, algo: Option<AlgorithmKind>) -> bool {
    let shadow = raw.mode == Some("shadow");
    let mode = match raw.mode {
        None | Some("shadow") => None,
        Some("meter") => Some(false),
        Some("shaper") => Some(true),
        Some(other) => {
            issues.field(
                "mode",
                format!(
                    "{} is not a mode (use \"meter\" or \"shaper\" for a leaky bucket, \
                     \"shadow\" for any rule)",
                    quote(other)
                ),
            );
            None
        }
    };
    let shaper = mode == Some(true);
    if raw.mode.is_some() && !shadow {
        if let Some(a) = algo.filter(|a| *a != AlgorithmKind::LeakyBucket) {
            issues.field("mode", format!("not used by algorithm {a}"));
        }
    }
    shaper
}

/// `burst`: 1..=[`MAX_LIMIT`], only for a token bucket or a metering leaky bucket.
fn burst_field(
    issues: &mut Issues<'_>,
    raw: &RawSpec<'_>,
    algo: Option<AlgorithmKind>,
    shaper: bool,
) -> Option<u64> {
    let burst = raw
        .burst
        .and_then(|v| bounded(issues, "burst", v, 1, MAX_LIMIT));
    if raw.burst.is_some() {
        match algo {
            Some(a @ AlgorithmKind::LeakyBucket) if shaper => issues.field(
                "burst",
                format!("not used by {a} in shaper mode (use queue_depth)"),
            ),
            Some(
                a @ (AlgorithmKind::FixedWindow
                | AlgorithmKind::SlidingWindowLog
                | AlgorithmKind::SlidingWindowCounter),
            ) => issues.field("burst", format!("not used by algorithm {a}")),
            _ => {}
        }
    }
    burst
}

/// `queue_depth`: 0..=[`MAX_QUEUE_DEPTH`], only for a shaping leaky bucket.
fn queue_depth_field(
    issues: &mut Issues<'_>,
    raw: &RawSpec<'_>,
    algo: Option<AlgorithmKind>,
    shaper: bool,
) -> Option<u64> {
    let queue_depth = raw
        .queue_depth
        .and_then(|v| bounded(issues, "queue_depth", v, 0, MAX_QUEUE_DEPTH));
    if raw.queue_depth.is_some() {
        match algo {
            Some(a @ AlgorithmKind::LeakyBucket) if !shaper => issues.field(
                "queue_depth",
                format!("not used by {a} in meter mode (set mode = \"shaper\")"),
            ),
            Some(
                a @ (AlgorithmKind::TokenBucket
                | AlgorithmKind::FixedWindow
                | AlgorithmKind::SlidingWindowLog
                | AlgorithmKind::SlidingWindowCounter),
            ) => issues.field("queue_depth", format!("not used by algorithm {a}")),
            _ => {}
        }
    }
    queue_depth
}

/// `on_unavailable`: `open` (the default) or `closed`.
fn on_unavailable_field(issues: &mut Issues<'_>, raw: &RawSpec<'_>) -> FailMode {
    match raw.on_unavailable {
        None | Some("open") => FailMode::Open,
        Some("closed") => FailMode::Closed,
        Some(other) => {
            issues.field(
                "on_unavailable",
                format!(
                    "{} is not a fail mode (use \"open\" or \"closed\")",
                    quote(other)
                ),
            );
            FailMode::Open
        }
    }
}

/// `per`: `client` (the default) or `route`.
fn per_field(issues: &mut Issues<'_>, raw: &RawSpec<'_>) -> CountPer {
    match raw.per {
        None | Some("client") => CountPer::Client,
        Some("route") => CountPer::Route,
        Some(other) => {
            issues.field(
                "per",
                format!(
                    "{other:?} is not a counter scope (use \"client\": one budget per client \
                     key, or \"route\": one per client key and route)"
                ),
            );
            CountPer::Client
        }
    }
}

/// The algorithm's parameters from fields already validated.
fn algorithm_spec(
    algo: AlgorithmKind,
    limit: NonZeroU64,
    window: Duration,
    burst: Option<u64>,
    queue_depth: Option<u64>,
    shaper: bool,
) -> AlgorithmSpec {
    match algo {
        AlgorithmKind::TokenBucket => AlgorithmSpec::TokenBucket {
            capacity: burst.map_or(limit, nonzero),
            refill: limit,
            period: window,
        },
        AlgorithmKind::LeakyBucket => AlgorithmSpec::LeakyBucket {
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
        AlgorithmKind::FixedWindow => AlgorithmSpec::FixedWindow { limit, window },
        AlgorithmKind::SlidingWindowLog => AlgorithmSpec::SlidingWindowLog { limit, window },
        AlgorithmKind::SlidingWindowCounter => {
            AlgorithmSpec::SlidingWindowCounter { limit, window }
        }
    }
}

fn valid_name(name: &str) -> bool {
    (1..=MAX_NAME_LEN).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// Validates a `client` or `tier` value against the longest one a check may carry
/// (`max`): a rule naming a longer one could never match a request.
fn key_field(
    issues: &mut Issues<'_>,
    field: &'static str,
    value: &Option<String>,
    max: usize,
) -> bool {
    match value {
        Some(v) if v.is_empty() => issues.field(field, "must not be empty"),
        Some(v) if v.len() > max => issues.field(
            field,
            format!(
                "is {} bytes long; at most {max} allowed (a check's {field} is refused beyond \
                 {max} bytes, so this rule could never match)",
                v.len()
            ),
        ),
        _ => return true,
    }
    false
}

impl RuleSet {
    /// Parses and validates a rule file's text (format in the module doc).
    ///
    /// Reports every validation problem at once, so fixing a file takes one round trip.
    ///
    /// Text that defines neither a `[default]` section nor a `[[rule]]` (empty, only
    /// comments) is refused with [`RulesError::NoRules`]: it is what an empty or truncated
    /// write looks like, and accepting it would replace every rule with the built-in default.
    pub fn from_toml_str(text: &str) -> Result<Self, RulesError> {
        Self::from_doc(RawFile::from_toml_str(text)?)
    }

    /// Validates a rule document (from a file, an API body or a peer); the rule set keeps
    /// it, so its [digest](RuleSet::digest) and text can be served back.
    ///
    /// A document with neither a `[default]` section nor a `[[rule]]` is refused with
    /// [`RulesError::NoRules`], as for a file.
    pub fn from_doc(doc: RawFile) -> Result<Self, RulesError> {
        if doc.default.is_none() && doc.rule.is_empty() {
            return Err(RulesError::NoRules { path: None });
        }
        Self::validate(doc)
    }

    /// Parses the bytes of the rule file at `path` (read with
    /// [`read_rules_file`](super::read_rules_file)); errors name the file.
    pub fn from_file_bytes(path: &Path, bytes: &[u8]) -> Result<Self, RulesError> {
        let text = std::str::from_utf8(bytes).map_err(|e| RulesError::NotUtf8 {
            path: Some(path.to_owned()),
            offset: e.valid_up_to(),
        })?;
        Self::from_toml_str(text).map_err(|e| e.in_file(path))
    }

    /// Reads and parses a rule file; errors name the file. Only a regular file of at most
    /// [`MAX_RULES_FILE_BYTES`](super::MAX_RULES_FILE_BYTES) is read, without ever blocking
    /// (see [`read_rules_file`](super::read_rules_file)).
    pub fn load(path: &Path) -> Result<Self, RulesError> {
        let bytes = super::read_rules_file(path)?;
        Self::from_file_bytes(path, &bytes)
    }

    fn validate(raw: RawFile) -> Result<Self, RulesError> {
        let mut out = Vec::new();

        let default = default_rule(&raw, &mut out);

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
            check_name(&mut issues, r.name.as_deref(), name, position, &mut names);

            let mut selector_ok = key_field(&mut issues, "client", &r.client, MAX_KEY_LEN)
                & key_field(&mut issues, "tier", &r.tier, MAX_TIER_LEN);
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
                first_with_selector(&mut issues, &selector, &mut selectors);
            }

            let built = build_spec(&mut issues, &r.spec());
            let concurrency = r.concurrency.map(|v| {
                bounded(
                    &mut issues,
                    "concurrency",
                    v,
                    1,
                    crate::config::bounds::MAX_CONCURRENCY,
                )
            });
            if let (Some(name), Some(b), true) = (name, built, selector_ok) {
                rules.push(
                    Rule::new(name, selector, b.spec, b.on_unavailable, b.per)
                        .partitioned(b.partition)
                        .shadowed(b.shadow)
                        .with_concurrency(concurrency.flatten().map(|n| n as u32))
                        .leasing(r.lease.unwrap_or(true))
                        .snapshotting(r.snapshot.unwrap_or(true)),
                );
            }
        }

        drop(names);
        drop(selectors);
        match default {
            Some(default) if out.is_empty() => {
                let envoy = match &raw.envoy {
                    None => EnvoyConfig::default(),
                    Some(section) => {
                        EnvoyConfig::from_section(section).map_err(RulesError::Envoy)?
                    }
                };
                rules.insert(0, default);
                Ok(Self::index(rules, raw).with_envoy(envoy))
            }
            _ => Err(RulesError::Invalid(out)),
        }
    }
}

/// The `[default]` section's rule, or the built-in default without one; `None` (issues
/// recorded in `out`) when the section is invalid.
fn default_rule(raw: &RawFile, out: &mut Vec<RuleIssue>) -> Option<Rule> {
    let Some(d) = &raw.default else {
        return Some(Rule::builtin_default());
    };
    let mut issues = Issues {
        rule: RuleRef::Default,
        out,
    };
    build_spec(&mut issues, &d.spec()).map(|b| {
        Rule::new(
            DEFAULT_RULE_NAME,
            Selector::default(),
            b.spec,
            b.on_unavailable,
            b.per,
        )
        .partitioned(b.partition)
        .shadowed(b.shadow)
    })
}

/// A rule's `name`: present, well formed (`valid` is the name if it is), not the
/// reserved one and not used by an earlier rule (`names`: name → position).
fn check_name<'a>(
    issues: &mut Issues<'_>,
    given: Option<&str>,
    valid: Option<&'a str>,
    position: usize,
    names: &mut HashMap<&'a str, usize>,
) {
    match (given, valid) {
        (None, _) => issues.field("name", "required (1..=64 characters of A-Z a-z 0-9 _ . -)"),
        (Some(n), None) => issues.field(
            "name",
            format!(
                "{} must be 1..=64 characters of A-Z a-z 0-9 _ . -",
                quote(n)
            ),
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
}

/// A rule's selector, already valid: no earlier rule may have the same one
/// (`selectors`: selector → the rule that has it), or one of them would never match.
fn first_with_selector(
    issues: &mut Issues<'_>,
    selector: &Selector,
    selectors: &mut HashMap<Selector, String>,
) {
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

#[cfg(test)]
mod tests {
    use super::super::testing::{set, LEVELS};
    use super::super::{MatchLevel, MAX_ISSUES_SHOWN};
    use super::*;
    use proptest::prelude::*;

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
    fn the_rules_doc_example_parses() {
        let doc = include_str!("../../../docs/rules.md");
        let start = doc.find("```toml\n").unwrap() + "```toml\n".len();
        let text = &doc[start..start + doc[start..].find("```\n").unwrap()];
        let rs = set(text);
        assert_eq!(rs.len(), 6);
        assert_eq!(rs.get("jobs").unwrap().concurrency, Some(20));
        assert_eq!(rs.get("free-charges").unwrap().concurrency, None);
        assert_eq!(rs.get("search-per-path").unwrap().per, CountPer::Route);
        assert_eq!(rs.get("vip-customer").unwrap().per, CountPer::Client);
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
    fn guide_counter_examples_parse_and_scope_as_described() {
        let readme = include_str!("../../../docs/concepts.md");
        let at = readme
            .find("**What one counter is.**")
            .expect("docs/concepts.md section");
        let start = at + readme[at..].find("```toml\n").unwrap() + "```toml\n".len();
        let end = start + readme[start..].find("```\n").unwrap();
        let rs = set(&readme[start..end]);
        assert_eq!(rs.get("api").unwrap().per, CountPer::Client);
        assert_eq!(rs.get("search").unwrap().per, CountPer::Route);
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
    fn messages_naming_algorithms_are_spelled_as_before() {
        let lines = [
            (
                "algorithm = \"tokenbucket\"\nlimit = 1\nwindow = \"1s\"",
                "rule \"x\": field \"algorithm\": \"tokenbucket\" is not an algorithm (use one of \
                 token_bucket, leaky_bucket, fixed_window, sliding_window_log, \
                 sliding_window_counter)",
            ),
            (
                "algorithm = \"sliding_window_log\"\nlimit = 200000\nwindow = \"1s\"",
                "rule \"x\": field \"limit\": sliding_window_log keeps 16 bytes per admitted \
                 request per key, so limit 200000 would need 3200000 bytes per key; at most \
                 100000 (use sliding_window_counter for large limits)",
            ),
            (
                "algorithm = \"leaky_bucket\"\nmode = \"shaper\"\nlimit = 1\nwindow = \"1s\"\nburst = 3",
                "rule \"x\": field \"burst\": not used by leaky_bucket in shaper mode (use \
                 queue_depth)",
            ),
            (
                "algorithm = \"leaky_bucket\"\nlimit = 1\nwindow = \"1s\"\nqueue_depth = 3",
                "rule \"x\": field \"queue_depth\": not used by leaky_bucket in meter mode (set \
                 mode = \"shaper\")",
            ),
            (
                "algorithm = \"sliding_window_log\"\nlimit = 1\nwindow = \"1s\"\nqueue_depth = 3",
                "rule \"x\": field \"queue_depth\": not used by algorithm sliding_window_log",
            ),
            (
                "algorithm = \"fixed_window\"\nmode = \"meter\"\nlimit = 1\nwindow = \"1s\"",
                "rule \"x\": field \"mode\": not used by algorithm fixed_window",
            ),
        ];
        for (fields, expected) in lines {
            assert_eq!(one_rule(fields), expected, "{fields}");
        }
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
    fn fail_closed_rules_fence_by_default_and_either_may_say_otherwise() {
        let partition = |fields: &str| {
            let rs = set(&format!(
                "[[rule]]\nname = \"x\"\ntier = \"free\"\nlimit = 1\nwindow = \"1s\"\n{fields}\n"
            ));
            rs.rules()
                .iter()
                .find(|r| &*r.name == "x")
                .unwrap()
                .partition
        };
        assert_eq!(partition(""), Partition::Split);
        assert_eq!(partition("on_unavailable = \"closed\""), Partition::Fence);
        assert_eq!(
            partition("on_unavailable = \"closed\"\npartition = \"split\""),
            Partition::Split
        );
        assert_eq!(
            partition("on_unavailable = \"closed\"\npartition = \"fence\""),
            Partition::Fence
        );
        let d = set("[default]\nlimit = 7\nwindow = \"10s\"\non_unavailable = \"closed\"\n");
        assert!(d.default_rule().is_fenced(), "the default section too");
    }

    #[test]
    fn a_bad_partition_or_a_fenced_rule_that_fails_open_is_rejected_with_why() {
        let e = one_rule("limit = 1\nwindow = \"1s\"\npartition = \"maybe\"");
        assert!(
            e.contains(
                "rule \"x\": field \"partition\": \"maybe\" is not a partition mode (use \"fence\""
            ),
            "{e}"
        );
        let e = one_rule("limit = 1\nwindow = \"1s\"\npartition = \"fence\"");
        assert!(
            e.contains("field \"partition\": \"fence\" needs on_unavailable = \"closed\""),
            "{e}"
        );
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
    fn per_defaults_to_client_and_accepts_route() {
        let rs = set(r#"
            [default]
            per = "route"
            limit = 1
            window = "1s"
            [[rule]]
            name = "plain"
            route = "/v1/*"
            limit = 2
            window = "1s"
            [[rule]]
            name = "explicit"
            tier = "t"
            per = "client"
            limit = 2
            window = "1s"
            [[rule]]
            name = "each"
            client = "c"
            per = "route"
            limit = 2
            window = "1s"
        "#);
        assert_eq!(rs.default_rule().per, CountPer::Route);
        assert_eq!(rs.get("plain").unwrap().per, CountPer::Client);
        assert_eq!(rs.get("explicit").unwrap().per, CountPer::Client);
        assert_eq!(rs.get("each").unwrap().per, CountPer::Route);
        assert_eq!(RuleSet::builtin().default_rule().per, CountPer::Client);
    }

    #[test]
    fn bad_per_names_rule_and_field() {
        let e = one_rule("limit = 1\nwindow = \"1s\"\nper = \"path\"");
        assert!(
            e.contains(
                "rule \"x\": field \"per\": \"path\" is not a counter scope (use \"client\""
            ),
            "{e}"
        );
        assert!(e.contains("\"route\": one per client key and route"), "{e}");
        let e = invalid("[default]\nlimit = 1\nwindow = \"1s\"\nper = \"Route\"\n");
        assert!(e.contains("[default]: field \"per\": \"Route\""), "{e}");
        // Not a string at all: a TOML type error with its position.
        let e = RuleSet::from_toml_str(
            "[[rule]]\nname = \"x\"\ntier = \"t\"\nlimit = 1\nwindow = \"1s\"\nper = 1\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("line 6"), "{e}");
    }

    #[test]
    fn a_route_pattern_with_a_query_string_is_refused() {
        let e = invalid(
            "[[rule]]\nname = \"q\"\nroute = \"GET /v1/a?x=1\"\nlimit = 1\nwindow = \"1s\"\n",
        );
        assert!(
            e.contains("rule \"q\": field \"route\": route pattern \"GET /v1/a?x=1\""),
            "{e}"
        );
        assert!(e.contains("could never match"), "{e}");
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
    fn an_empty_or_comment_only_file_defines_no_rules() {
        // Bypass closed: an empty or truncated write replaced every rule with the built-in
        // default ("ok, 1 rules").
        for text in ["", "\n\n", "# all rules removed\n", "  \t\n# x\n"] {
            let e = RuleSet::from_toml_str(text).unwrap_err();
            assert!(
                matches!(e, RulesError::NoRules { path: None }),
                "{text:?}: {e}"
            );
            assert_eq!(
                e.to_string(),
                "defines no rules (empty or truncated?); to use only a default limit, write a \
                 [default] section"
            );
        }
    }

    #[test]
    fn an_explicit_default_section_alone_is_accepted() {
        let rs = set("[default]\nlimit = 5\nwindow = \"1s\"\n");
        assert_eq!(rs.len(), 1);
        assert_eq!(rs.default_rule().limiter.max_cost(), 5);
        // A truncated default section is still an error, not a silent default.
        let e = invalid("[default]\n");
        assert!(e.contains("[default]: field \"limit\": required"), "{e}");
    }

    #[test]
    fn a_tier_longer_than_a_check_may_carry_is_refused() {
        // Such a rule could never match: checks with a tier over 64 bytes are refused.
        let e = invalid(&format!(
            "[[rule]]\nname=\"a\"\ntier=\"{}\"\nlimit=1\nwindow=\"1s\"\n",
            "t".repeat(MAX_TIER_LEN + 1)
        ));
        assert_eq!(
            e,
            "rule \"a\": field \"tier\": is 65 bytes long; at most 64 allowed (a check's tier \
             is refused beyond 64 bytes, so this rule could never match)"
        );
        set(&format!(
            "[[rule]]\nname=\"a\"\ntier=\"{}\"\nlimit=1\nwindow=\"1s\"\n",
            "t".repeat(MAX_TIER_LEN)
        ));
        let e = invalid(&format!(
            "[[rule]]\nname=\"a\"\nclient=\"{}\"\nlimit=1\nwindow=\"1s\"\n",
            "c".repeat(MAX_KEY_LEN + 1)
        ));
        assert!(
            e.contains("field \"client\": is 257 bytes long; at most 256"),
            "{e}"
        );
    }

    #[test]
    fn rule_bounds_match_the_request_bounds() {
        // The loader may not accept a tier or client key a check cannot carry.
        assert_eq!(MAX_TIER_LEN, crate::config::bounds::MAX_TIER_BYTES);
        assert_eq!(MAX_KEY_LEN, crate::config::bounds::MAX_KEY_BYTES);
    }

    #[test]
    fn a_route_pattern_longer_than_any_route_is_refused() {
        use crate::config::route::{Route, MAX_PATH_LEN};
        let long = format!("/{}", "p".repeat(MAX_PATH_LEN));
        let e = invalid(&format!(
            "[[rule]]\nname=\"a\"\nroute=\"{long}*\"\nlimit=1\nwindow=\"1s\"\n"
        ));
        assert!(e.contains("field \"route\": route pattern"), "{e}");
        assert!(
            e.contains("path is 258 bytes long; at most 256 allowed"),
            "{e}"
        );
        // The longest accepted patterns still match some accepted route.
        let exact = format!("/{}", "p".repeat(MAX_PATH_LEN - 1));
        let prefix = format!("/{}*", "p".repeat(MAX_PATH_LEN - 2));
        let rs = set(&format!(
            "[[rule]]\nname=\"e\"\nroute=\"{exact}\"\nlimit=1\nwindow=\"1s\"\n\
             [[rule]]\nname=\"p\"\nroute=\"{prefix}\"\nlimit=1\nwindow=\"1s\"\n"
        ));
        let route = Route::parse(&exact).unwrap();
        for name in ["e", "p"] {
            let rule = rs.get(name).unwrap();
            assert!(
                rule.selector.route.as_ref().unwrap().matches(&route),
                "{name}"
            );
        }
    }

    /// Longest message any single error about a huge line may produce.
    const BOUND: usize = 1_000;

    #[test]
    fn a_toml_error_on_a_huge_line_quotes_a_bounded_excerpt() {
        // Bypass closed: a 50 MB one-line file was logged whole (twice) per error.
        let line = format!("name = \"{}", "x".repeat(200_000));
        let e = RuleSet::from_toml_str(&format!("[[rule]]\n{line}\n")).unwrap_err();
        let s = e.to_string();
        assert!(s.len() < BOUND, "{} bytes", s.len());
        assert!(s.starts_with("TOML error at line 2, column"), "{s}");
        assert!(s.contains('…'), "{s}");
        assert!(
            std::error::Error::source(&e).is_none(),
            "no chain to print twice"
        );

        let e = RuleSet::from_toml_str(&format!("x{} = = 1\n", "k".repeat(200_000)))
            .unwrap_err()
            .to_string();
        assert!(e.len() < BOUND, "{} bytes", e.len());
        assert!(
            e.starts_with("TOML error at line 1, column 200005: "),
            "{e}"
        );
        // The excerpt keeps the error in view, with the caret under the second `=`.
        let mut lines = e.lines().skip(1);
        let (shown, caret) = (lines.next().unwrap(), lines.next().unwrap());
        assert!(
            shown.starts_with("  | …kkk") && shown.ends_with("k = = 1"),
            "{e}"
        );
        let second_eq = shown.chars().count() - 3;
        assert_eq!(caret.chars().position(|c| c == '^'), Some(second_eq), "{e}");
    }

    #[test]
    fn the_toml_excerpt_of_a_short_line_is_the_line() {
        let e = RuleSet::from_toml_str("[[rule]]\nname = \"a\"\nlimit = = 3\n")
            .unwrap_err()
            .to_string();
        let mut lines = e.lines();
        assert!(
            lines
                .next()
                .unwrap()
                .starts_with("TOML error at line 3, column 9: "),
            "{e}"
        );
        assert_eq!(lines.next(), Some("  | limit = = 3"));
        assert_eq!(lines.next(), Some("  |         ^"));
    }

    #[test]
    fn the_syntax_error_in_the_rules_doc_is_what_the_loader_says() {
        let e = RuleSet::from_file_bytes(
            Path::new("rules.toml"),
            b"[[rule]]\nname = \"a\"\nlimit = = 3\n",
        )
        .unwrap_err()
        .to_string();
        let doc = include_str!("../../../docs/rules.md");
        let shown: String = e.lines().map(|l| format!("{l}\n")).collect();
        assert!(doc.contains(&shown), "docs/rules.md shows:\n{shown}");
    }

    #[test]
    fn serde_messages_echoing_keys_or_values_are_bounded() {
        let key = "k".repeat(100_000);
        let e = RuleSet::from_toml_str(&format!("[[rule]]\n{key} = 1\n"))
            .unwrap_err()
            .to_string();
        assert!(e.len() < BOUND, "{} bytes: {}", e.len(), &e[..200]);
        assert!(e.contains("unknown field"), "{e}");
        let value = "v".repeat(100_000);
        let e = RuleSet::from_toml_str(&format!("[[rule]]\nlimit = \"{value}\"\n"))
            .unwrap_err()
            .to_string();
        assert!(e.len() < BOUND, "{} bytes", e.len());
        // Control characters from the file never reach a log raw.
        let e = RuleSet::from_toml_str("[[rule]]\n\"a\\u001b[31mb\" = 1\n")
            .unwrap_err()
            .to_string();
        assert!(!e.contains('\u{1b}'), "{e:?}");
    }

    #[test]
    fn field_errors_quote_a_bounded_excerpt_of_the_value() {
        let huge = "z".repeat(100_000);
        let cut = format!("\"{}\"…", "z".repeat(MAX_QUOTE_CHARS));
        for fields in [
            format!("limit = 1\nwindow = \"{huge}\""),
            format!("limit = 1\nwindow = \"1s\"\non_unavailable = \"{huge}\""),
            format!("algorithm = \"leaky_bucket\"\nlimit = 1\nwindow = \"1s\"\nmode = \"{huge}\""),
        ] {
            let e = one_rule(&fields);
            assert!(e.len() < BOUND, "{} bytes", e.len());
            assert!(e.contains(&cut), "{e}");
        }
        let e = one_rule(&format!(
            "algorithm = \"{huge}\"\nlimit = 1\nwindow = \"1s\""
        ));
        assert!(e.len() < BOUND, "{} bytes", e.len());
        assert!(
            e.contains(&format!("\"{}…\" is not an algorithm", "z".repeat(120))),
            "{e}"
        );
        let e = invalid(&format!(
            "[[rule]]\nname = \"{huge} \"\ntier = \"t\"\nlimit = 1\nwindow = \"1s\"\n"
        ));
        assert!(e.len() < BOUND, "{} bytes", e.len());
        assert!(e.contains(&cut), "{e}");
    }

    #[test]
    fn a_file_with_thousands_of_problems_lists_the_first_fifty() {
        let text: String = (0..2_000)
            .map(|i| {
                format!("[[rule]]\nname = \"r{i}\"\ntier = \"t{i}\"\nlimit = 0\nwindow = \"1s\"\n")
            })
            .collect();
        let e = invalid(&text);
        let lines: Vec<&str> = e.lines().collect();
        assert_eq!(lines.len(), MAX_ISSUES_SHOWN + 1);
        assert_eq!(lines[MAX_ISSUES_SHOWN], "... and 1950 more problems");
    }

    #[test]
    fn from_file_bytes_names_the_file_and_refuses_non_utf8() {
        let path = Path::new("/etc/ringlimit/rules.toml");
        let e = RuleSet::from_file_bytes(path, b"").unwrap_err().to_string();
        assert!(
            e.starts_with("rules file /etc/ringlimit/rules.toml: defines no rules"),
            "{e}"
        );
        let e = RuleSet::from_file_bytes(path, b"[x\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("rules file /etc/ringlimit/rules.toml: TOML error at line 1"),
            "{e}"
        );
        let e = RuleSet::from_file_bytes(path, &[b'#', b' ', 0xc3]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "rules file /etc/ringlimit/rules.toml: is not UTF-8 text (invalid byte at offset 2)"
        );
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
    }
}
