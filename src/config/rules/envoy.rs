//! envoyproxy/ratelimit's YAML configuration as a rule source: one document per domain,
//! nested descriptor lists, each `rate_limit` a ringlimit [`Rule`].
//!
//! Matching follows the reference server exactly (its README, "The configuration format"),
//! for a request descriptor of entries `(k1, v1) … (kn, vn)` in a domain:
//!
//! - walk the domain's descriptor list level by level, one entry per level;
//! - at each level an exact `key`/`value` node beats a wildcard one (`value` with `*`
//!   anywhere: the first matching wildcard in file order wins), which beats a value-less
//!   `key` node; no match at a level means no limit (no backtracking);
//! - a limit applies only at the node of the descriptor's last entry: a request deeper or
//!   shallower than the configured nesting gets no limit;
//! - the counter is (node, the request's values): a value-less key gives each runtime value
//!   its own counter; `share_threshold: true` on a wildcard node makes every value it
//!   matches share one counter;
//! - `replaces: [{name}]` drops, for one request, the limits of other descriptors whose
//!   `rate_limit.name` is listed: a question about the whole request, so the check layer
//!   answers it from each match's [`EnvoyLimit::replaces`].
//!
//! Each `rate_limit` may choose ringlimit's algorithm with an extra key `algorithm`; the
//! default is `fixed_window`, the reference server's own, so a migrated file decides exactly
//! as it did (same counts, same reset at the unit boundary) until a rule opts into
//! another. `requests_per_unit: 0` denies every request without counting (the reference's
//! "black list"). Windows are at most 7 days: `month` and `year` are refused.
//!
//! Pure: no I/O here except [`read_documents`] (and [`EnvoyConfig::load`] over it), which
//! reads a file or a directory of `*.yaml` / `*.yml` files through the same bounded reader
//! as the TOML rule file.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use super::envoy_doc::{DescriptorDoc, DomainDoc, RateLimitDoc, ReplaceDoc};
use super::{
    read_rules_file, AlgorithmSpec, CountPer, DocEnvoy, FailMode, LeakyMode, Rule, Selector,
};
use crate::algorithms::AlgorithmKind;

/// Longest domain, key or value accepted in a configuration, in bytes.
pub const MAX_ENVOY_TEXT: usize = crate::config::bounds::MAX_DOMAIN_BYTES;
/// Deepest nesting of descriptor lists accepted.
pub const MAX_ENVOY_DEPTH: usize = 8;

/// Why an Envoy configuration was refused: the file, and what is wrong in it (with the line
/// for YAML and unknown-key errors).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("envoy config {}: {message}", path.display())]
pub struct EnvoyConfigError {
    /// The file (or directory) the problem is in.
    pub path: PathBuf,
    /// What is wrong.
    pub message: String,
}

/// A time unit of `rate_limit.unit` (and of a request's limit override).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EnvoyUnit {
    /// One second.
    Second,
    /// One minute.
    Minute,
    /// One hour.
    Hour,
    /// One day.
    Day,
    /// Seven days: the longest window ringlimit keeps.
    Week,
}

impl EnvoyUnit {
    /// The window this unit is.
    pub fn window(self) -> Duration {
        Duration::from_secs(match self {
            EnvoyUnit::Second => 1,
            EnvoyUnit::Minute => 60,
            EnvoyUnit::Hour => 3600,
            EnvoyUnit::Day => 86_400,
            EnvoyUnit::Week => 7 * 86_400,
        })
    }

    fn parse(text: &str) -> Result<Self, String> {
        Ok(match text.to_ascii_lowercase().as_str() {
            "second" => EnvoyUnit::Second,
            "minute" => EnvoyUnit::Minute,
            "hour" => EnvoyUnit::Hour,
            "day" => EnvoyUnit::Day,
            "week" => EnvoyUnit::Week,
            "month" | "year" => {
                return Err(format!(
                "unit {text:?} is not supported: ringlimit windows are at most 7 days (use week)"
            ))
            }
            _ => {
                return Err(format!(
                    "{text:?} is not a unit (use second, minute, hour, day or week)"
                ))
            }
        })
    }
}

/// The limit a configured descriptor (or a request override) sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoyLimit {
    /// The ringlimit rule that counts it; `None` for `requests_per_unit: 0` (always denied,
    /// never counted).
    pub rule: Option<Arc<Rule>>,
    /// `requests_per_unit` as configured.
    pub requests_per_unit: u32,
    /// `unit` as configured.
    pub unit: EnvoyUnit,
    /// `rate_limit.name` if given, else the rule's name: reported as `current_limit.name`.
    pub name: Arc<str>,
    /// `rate_limit.name` as configured (the target of another limit's `replaces`).
    pub configured_name: Option<Arc<str>>,
    /// Names this limit replaces.
    pub replaces: Vec<Arc<str>>,
    /// `shadow_mode: true`: reported, never enforced (also when nothing is counted).
    pub shadow: bool,
    /// `quota_mode: true`: over its limit it is reported OVER_LIMIT, and the request is
    /// denied for it only when every quota-mode descriptor of the request is over
    /// (`check::domain::domain_verdict`). Its rule is shadowed, so the cluster neither
    /// denies the check for it nor refunds the others.
    pub quota: bool,
}

/// What a request descriptor matched.
#[derive(Debug, Clone)]
pub enum EnvoyMatch {
    /// No limit applies: answered OK with no `current_limit`.
    NoLimit,
    /// An `unlimited: true` descriptor: OK, never counted.
    Unlimited,
    /// A limit, and the counter key it is counted under (domain and the entries, with
    /// the configured pattern instead of the value where `share_threshold` shares one).
    Limited {
        /// The limit.
        limit: EnvoyLimit,
        /// The counter's key: length-prefixed, so no two different ones collide.
        counter: String,
    },
}

#[derive(Debug)]
enum Value {
    Any,
    Exact(String),
    Wildcard(String),
}

#[derive(Debug)]
enum NodeLimit {
    None,
    Unlimited,
    Limit(EnvoyLimit),
}

#[derive(Debug)]
struct Node {
    key: String,
    value: Value,
    limit: NodeLimit,
    share_threshold: bool,
    children: Vec<Node>,
}

/// Every domain of the configuration, and its rules by name (for forwarded checks).
#[derive(Debug, Default)]
pub struct EnvoyConfig {
    domains: HashMap<String, Vec<Node>>,
    rules: HashMap<Arc<str>, Arc<Rule>>,
    /// Per domain, the base of a limit override on a descriptor no configured limit
    /// matches (the reference applies an override whenever the domain exists): only its
    /// algorithm is used. Not in [`EnvoyConfig::rules`]: no state is ever kept under it.
    override_bases: HashMap<Arc<str>, Arc<Rule>>,
    /// [`EnvoyConfig::digest`].
    digest: u64,
}

/// The default algorithm of an `[envoy]` section without `algorithm`: the reference
/// server's own, as for `--envoy-algorithm`.
pub const DEFAULT_SECTION_ALGORITHM: AlgorithmKind = AlgorithmKind::FixedWindow;

/// Suffix of the name of a domain's override base ([`EnvoyConfig::override_base`]).
pub const OVERRIDE_BASE_SUFFIX: &str = "~override-base";

/// A ringlimit spec for `limit` per `window` with `kind`.
pub fn envoy_spec(kind: AlgorithmKind, limit: NonZeroU64, window: Duration) -> AlgorithmSpec {
    match kind {
        AlgorithmKind::TokenBucket => AlgorithmSpec::TokenBucket {
            capacity: limit,
            refill: limit,
            period: window,
        },
        AlgorithmKind::LeakyBucket => AlgorithmSpec::LeakyBucket {
            limit,
            period: window,
            mode: LeakyMode::Meter { burst: limit },
        },
        AlgorithmKind::FixedWindow => AlgorithmSpec::FixedWindow { limit, window },
        AlgorithmKind::SlidingWindowLog => AlgorithmSpec::SlidingWindowLog { limit, window },
        AlgorithmKind::SlidingWindowCounter => {
            AlgorithmSpec::SlidingWindowCounter { limit, window }
        }
    }
}

/// A rule for `spec`, named `name`; an error if the algorithm refuses the numbers.
pub fn envoy_rule(
    name: &str,
    spec: AlgorithmSpec,
    shadow: bool,
    on_unavailable: FailMode,
) -> Result<Rule, String> {
    spec.limiter().map_err(|e| e.to_string())?;
    Ok(Rule::new(
        name,
        Selector::default(),
        spec,
        on_unavailable,
        CountPer::Client,
    )
    .shadowed(shadow))
}

/// The name of the rule a request's limit override makes of `base`: a counter of its own
/// (overridden numbers never mix with the configured ones).
pub fn override_rule_name(base: &str, requests_per_unit: u32, unit: EnvoyUnit) -> String {
    format!(
        "{base}~override/{requests_per_unit}/{}s",
        unit.window().as_secs()
    )
}

fn push_part(out: &mut String, part: &str) {
    out.push_str(&part.len().to_string());
    out.push(':');
    out.push_str(part);
}

/// `*` anywhere in `pattern` matches any run of characters (none included).
fn glob(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if parts.len() == 1 {
        return pattern == text;
    }
    if !text.starts_with(first) || text.len() < first.len() + last.len() {
        return false;
    }
    let mut rest = &text[first.len()..text.len() - last.len()];
    if !text.ends_with(last) {
        return false;
    }
    for middle in &parts[1..parts.len() - 1] {
        match rest.find(middle) {
            Some(i) => rest = &rest[i + middle.len()..],
            None => return false,
        }
    }
    true
}

/// The `domain` a YAML text names, if it is YAML with a string `domain` at the top: how
/// messages and diffs name a domain before (or without) it is validated.
pub fn domain_of(text: &str) -> Option<String> {
    serde_norway::from_str::<serde_json::Value>(text)
        .ok()?
        .get("domain")?
        .as_str()
        .map(str::to_string)
}

/// An algorithm by name, or an error listing the names.
fn parse_algorithm(name: &str) -> Result<AlgorithmKind, String> {
    AlgorithmKind::parse(name).ok_or_else(|| {
        format!("{name:?} is not an algorithm (use token_bucket, leaky_bucket, fixed_window, sliding_window_log or sliding_window_counter)")
    })
}

/// Reads `path`: one file, or every `*.yaml` / `*.yml` file of a directory, in name
/// order, each through the same bounded reader as the TOML rule file (a FIFO or device
/// is refused, at most 1 MiB a file).
pub fn read_documents(path: &Path) -> Result<Vec<(PathBuf, String)>, EnvoyConfigError> {
    let err = |path: &Path, message: String| EnvoyConfigError {
        path: path.to_owned(),
        message,
    };
    let mut files = Vec::new();
    if path.is_dir() {
        let entries = std::fs::read_dir(path).map_err(|e| err(path, e.to_string()))?;
        for entry in entries {
            let p = entry.map_err(|e| err(path, e.to_string()))?.path();
            if matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")) {
                files.push(p);
            }
        }
        files.sort();
        if files.is_empty() {
            return Err(err(path, "no *.yaml or *.yml file in the directory".into()));
        }
    } else {
        files.push(path.to_owned());
    }
    let mut texts = Vec::new();
    for file in files {
        let bytes = read_rules_file(&file).map_err(|e| err(&file, e.to_string()))?;
        let text = String::from_utf8(bytes).map_err(|_| err(&file, "not UTF-8".into()))?;
        texts.push((file, text));
    }
    Ok(texts)
}

impl EnvoyConfig {
    /// Loads `path`: one YAML file, or every `*.yaml` / `*.yml` file of a directory (in name
    /// order). Each file is one domain; two files with one domain are refused.
    pub fn load(path: &Path, default: AlgorithmKind) -> Result<Self, EnvoyConfigError> {
        let texts = read_documents(path)?;
        let docs: Vec<(&Path, &str)> = texts
            .iter()
            .map(|(p, t)| (p.as_path(), t.as_str()))
            .collect();
        Self::from_documents(&docs, default)
    }

    /// Parses one YAML document per domain (`path` only names them in errors).
    pub fn from_documents(
        docs: &[(&Path, &str)],
        default: AlgorithmKind,
    ) -> Result<Self, EnvoyConfigError> {
        let mut domains = Vec::with_capacity(docs.len());
        for (path, text) in docs {
            let doc: DomainDoc = serde_norway::from_str(text).map_err(|e| EnvoyConfigError {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
            domains.push((path.to_path_buf(), doc));
        }
        Self::from_domains(domains, default)
    }

    /// Checks and builds one [`DomainDoc`] per domain, however they were written (YAML,
    /// an xDS `RateLimitConfig`); each is named in errors by its `PathBuf`.
    pub fn from_domains(
        docs: Vec<(PathBuf, DomainDoc)>,
        default: AlgorithmKind,
    ) -> Result<Self, EnvoyConfigError> {
        let mut config = EnvoyConfig::default();
        // The digest covers what was parsed, not the bytes: per domain (in name order)
        // its canonical JSON, plus the default algorithm, which decides what a
        // `rate_limit` without `algorithm` means.
        let mut canonical: Vec<(String, String)> = Vec::with_capacity(docs.len());
        for (path, raw) in docs {
            let err = |message: String| EnvoyConfigError {
                path: path.clone(),
                message,
            };
            if raw.domain.is_empty() || raw.domain.len() > MAX_ENVOY_TEXT {
                return Err(err(format!(
                    "domain: must be 1..={MAX_ENVOY_TEXT} bytes (got {})",
                    raw.domain.len()
                )));
            }
            if config.domains.contains_key(&raw.domain) {
                return Err(err(format!("domain {:?} is defined twice", raw.domain)));
            }
            let mut builder = Builder {
                rules: &mut config.rules,
                default,
            };
            let nodes = builder
                .nodes(&raw.descriptors, &raw.domain, "descriptors", 1)
                .map_err(err)?;
            let base: Arc<str> = Arc::from(format!("{}{OVERRIDE_BASE_SUFFIX}", raw.domain));
            let spec = envoy_spec(default, NonZeroU64::MIN, Duration::from_secs(1));
            let rule = envoy_rule(&base, spec, false, FailMode::Open).map_err(err)?;
            config.override_bases.insert(base, Arc::new(rule));
            // Plain structs of strings, numbers and lists: always serializable.
            let json = serde_json::to_string(&raw).expect("a parsed domain serializes");
            canonical.push((raw.domain.clone(), json));
            config.domains.insert(raw.domain, nodes);
        }
        canonical.sort();
        let mut digest = xxhash_rust::xxh3::Xxh3::new();
        let mut part = |bytes: &[u8]| {
            digest.update(&(bytes.len() as u64).to_le_bytes());
            digest.update(bytes);
        };
        part(b"ringlimit.envoy.v1");
        part(default.as_str().as_bytes());
        for (_, json) in &canonical {
            part(json.as_bytes());
        }
        config.digest = digest.digest();
        Ok(config)
    }

    /// Names this configuration's content: xxh3-64 over each domain as parsed (in
    /// domain order, as canonical JSON) and the default algorithm. Comments, spacing,
    /// key order, file names and the order of files do not count, so two nodes
    /// enforcing the same domains have the same digest wherever their files live, and
    /// two nodes whose `--envoy-algorithm` differ do not. What a node gossips for drift.
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// The `[envoy]` section of a rule document: each domain is named in errors by its
    /// place (`envoy.domains[1]`) and, when the text gets that far, its `domain`.
    pub fn from_section(section: &DocEnvoy) -> Result<Self, EnvoyConfigError> {
        let algorithm = match section.algorithm.as_deref() {
            None => DEFAULT_SECTION_ALGORITHM,
            Some(a) => parse_algorithm(a).map_err(|message| EnvoyConfigError {
                path: PathBuf::from("envoy.algorithm"),
                message,
            })?,
        };
        let names: Vec<PathBuf> = section
            .domains
            .iter()
            .enumerate()
            .map(|(i, text)| {
                PathBuf::from(match domain_of(text) {
                    Some(d) => format!("envoy.domains[{i}] (domain {d:?})"),
                    None => format!("envoy.domains[{i}]"),
                })
            })
            .collect();
        let docs: Vec<(&Path, &str)> = names
            .iter()
            .zip(&section.domains)
            .map(|(p, t)| (p.as_path(), t.as_str()))
            .collect();
        Self::from_documents(&docs, algorithm)
    }

    /// Parses one domain's YAML text.
    pub fn from_yaml_str(text: &str, default: AlgorithmKind) -> Result<Self, EnvoyConfigError> {
        Self::from_documents(&[(Path::new("<text>"), text)], default)
    }

    /// The domains configured.
    pub fn domains(&self) -> impl Iterator<Item = &str> {
        self.domains.keys().map(String::as_str)
    }

    /// A rule by name: how the owner of a forwarded Envoy descriptor finds the rule its
    /// sender matched.
    pub fn rule(&self, name: &str) -> Option<&Arc<Rule>> {
        self.rules
            .get(name)
            .or_else(|| self.override_bases.get(name))
    }

    /// The base rule of a limit override on an unmatched descriptor of `domain` (`None`
    /// for an unknown domain): the node default algorithm, named `<domain>~override-base`.
    pub fn override_base(&self, domain: &str) -> Option<&Arc<Rule>> {
        self.override_bases
            .get(format!("{domain}{OVERRIDE_BASE_SUFFIX}").as_str())
    }

    /// The counter key of `entries` of `domain` with every value as sent (what a
    /// value-less or exact match counts under).
    pub fn counter_key(domain: &str, entries: &[(&str, &str)]) -> String {
        let mut counter = String::new();
        push_part(&mut counter, domain);
        for (key, value) in entries {
            push_part(&mut counter, key);
            push_part(&mut counter, value);
        }
        counter
    }

    /// Every configured rule (for handed-over state).
    pub fn rules(&self) -> impl Iterator<Item = &Arc<Rule>> {
        self.rules.values()
    }

    /// What the descriptor `entries` of `domain` matches (see the module docs).
    pub fn matching(&self, domain: &str, entries: &[(&str, &str)]) -> EnvoyMatch {
        let Some(mut level) = self.domains.get(domain).map(Vec::as_slice) else {
            return EnvoyMatch::NoLimit;
        };
        let mut counter = String::new();
        push_part(&mut counter, domain);
        for (i, (key, value)) in entries.iter().enumerate() {
            let node = level
                .iter()
                .find(|n| n.key == *key && matches!(&n.value, Value::Exact(v) if v == value))
                .or_else(|| {
                    level.iter().find(|n| {
                        n.key == *key && matches!(&n.value, Value::Wildcard(p) if glob(p, value))
                    })
                })
                .or_else(|| {
                    level
                        .iter()
                        .find(|n| n.key == *key && matches!(n.value, Value::Any))
                });
            let Some(node) = node else {
                return EnvoyMatch::NoLimit;
            };
            push_part(&mut counter, key);
            match &node.value {
                Value::Wildcard(p) if node.share_threshold => push_part(&mut counter, p),
                _ => push_part(&mut counter, value),
            }
            if i + 1 == entries.len() {
                return match &node.limit {
                    NodeLimit::None => EnvoyMatch::NoLimit,
                    NodeLimit::Unlimited => EnvoyMatch::Unlimited,
                    NodeLimit::Limit(limit) => EnvoyMatch::Limited {
                        limit: limit.clone(),
                        counter,
                    },
                };
            }
            if node.children.is_empty() {
                return EnvoyMatch::NoLimit;
            }
            level = &node.children;
        }
        EnvoyMatch::NoLimit
    }
}

struct Builder<'a> {
    rules: &'a mut HashMap<Arc<str>, Arc<Rule>>,
    default: AlgorithmKind,
}

impl Builder<'_> {
    fn nodes(
        &mut self,
        raw: &[DescriptorDoc],
        parent: &str,
        at: &str,
        depth: usize,
    ) -> Result<Vec<Node>, String> {
        if depth > MAX_ENVOY_DEPTH && !raw.is_empty() {
            return Err(format!("{at}: nested deeper than {MAX_ENVOY_DEPTH} levels"));
        }
        let mut seen = std::collections::HashSet::new();
        raw.iter()
            .enumerate()
            .map(|(i, d)| {
                let at = format!("{at}[{i}]");
                // As the reference server: one node per (key, value) and level.
                if !seen.insert((d.key.as_str(), d.value.as_deref())) {
                    return Err(format!(
                        "{at}: duplicate descriptor (key {:?}, value {:?}) at this level",
                        d.key,
                        d.value.as_deref().unwrap_or("")
                    ));
                }
                self.node(d, parent, &at, depth)
            })
            .collect()
    }

    fn node(
        &mut self,
        raw: &DescriptorDoc,
        parent: &str,
        at: &str,
        depth: usize,
    ) -> Result<Node, String> {
        let text = |field: &str, v: &str| {
            if v.is_empty() || v.len() > MAX_ENVOY_TEXT {
                Err(format!(
                    "{at}.{field}: must be 1..={MAX_ENVOY_TEXT} bytes (got {})",
                    v.len()
                ))
            } else {
                Ok(())
            }
        };
        text("key", &raw.key)?;
        let value = match &raw.value {
            None => Value::Any,
            Some(v) => {
                text("value", v)?;
                if v.contains('*') {
                    Value::Wildcard(v.clone())
                } else {
                    Value::Exact(v.clone())
                }
            }
        };
        if raw.share_threshold && !matches!(value, Value::Wildcard(_)) {
            return Err(format!(
                "{at}.share_threshold: only a value with a `*` wildcard can share one counter"
            ));
        }
        // The stats-style path the reference server logs: domain.key_value.key…
        let path = match &raw.value {
            Some(v) => format!("{parent}.{}_{v}", raw.key),
            None => format!("{parent}.{}", raw.key),
        };
        let limit = match &raw.rate_limit {
            None => {
                if raw.shadow_mode {
                    return Err(format!("{at}.shadow_mode: needs a rate_limit to shadow"));
                }
                if raw.quota_mode {
                    return Err(format!("{at}.quota_mode: needs a rate_limit"));
                }
                NodeLimit::None
            }
            Some(rl) => self.limit(
                rl,
                &path,
                &format!("{at}.rate_limit"),
                raw.shadow_mode,
                raw.quota_mode,
            )?,
        };
        let children = self.nodes(
            &raw.descriptors,
            &path,
            &format!("{at}.descriptors"),
            depth + 1,
        )?;
        Ok(Node {
            key: raw.key.clone(),
            value,
            limit,
            share_threshold: raw.share_threshold,
            children,
        })
    }

    fn limit(
        &mut self,
        raw: &RateLimitDoc,
        path: &str,
        at: &str,
        shadow: bool,
        quota: bool,
    ) -> Result<NodeLimit, String> {
        if raw.unlimited {
            if raw.unit.is_some() || raw.requests_per_unit.is_some() || raw.algorithm.is_some() {
                return Err(format!(
                    "{at}: unlimited: true takes no unit, requests_per_unit or algorithm"
                ));
            }
            return Ok(NodeLimit::Unlimited);
        }
        let unit = raw
            .unit
            .as_deref()
            .ok_or_else(|| format!("{at}.unit: required"))?;
        let unit = EnvoyUnit::parse(unit).map_err(|e| format!("{at}.unit: {e}"))?;
        let requests = raw
            .requests_per_unit
            .ok_or_else(|| format!("{at}.requests_per_unit: required"))?;
        let requests = u32::try_from(requests)
            .map_err(|_| format!("{at}.requests_per_unit: {requests} is over {}", u32::MAX))?;
        let kind = match raw.algorithm.as_deref() {
            None => self.default,
            Some(a) => parse_algorithm(a).map_err(|e| format!("{at}.algorithm: {e}"))?,
        };
        let on_unavailable = match raw.on_unavailable.as_deref() {
            None | Some("open") => FailMode::Open,
            Some("closed") => FailMode::Closed,
            Some(other) => {
                return Err(format!(
                    "{at}.on_unavailable: {other:?} is not a fail mode (use open: decide on this node, degraded; or closed: answer UNAVAILABLE)"
                ))
            }
        };
        let partition = super::parse_partition(raw.partition.as_deref(), on_unavailable)
            .map_err(|e| format!("{at}.partition: {e}"))?;
        if u64::from(requests) > super::MAX_LIMIT {
            return Err(format!(
                "{at}.requests_per_unit: {requests} is over the limit of {}",
                super::MAX_LIMIT
            ));
        }
        let name: Arc<str> = Arc::from(path);
        let rule = match NonZeroU64::new(u64::from(requests)) {
            None => None,
            Some(n) => {
                let rule = envoy_rule(
                    path,
                    envoy_spec(kind, n, unit.window()),
                    // The cluster's view of a quota-mode limit: its denial alone denies
                    // nothing and refunds nothing (the domain verdict decides).
                    shadow || quota,
                    on_unavailable,
                )
                .map_err(|e| format!("{at}: {e}"))?
                .partitioned(partition);
                let rule = Arc::new(rule);
                self.rules.insert(name.clone(), rule.clone());
                Some(rule)
            }
        };
        let configured_name = match &raw.name {
            Some(n) if n.is_empty() => return Err(format!("{at}.name: must not be empty")),
            Some(n) => Some(Arc::from(n.as_str())),
            None => None,
        };
        let mut replaces = Vec::new();
        for (i, r) in raw.replaces.iter().enumerate() {
            if r.name.is_empty() {
                return Err(format!("{at}.replaces[{i}].name: must not be empty"));
            }
            replaces.push(Arc::from(r.name.as_str()));
        }
        Ok(NodeLimit::Limit(EnvoyLimit {
            rule,
            requests_per_unit: requests,
            unit,
            name: configured_name.clone().unwrap_or(name),
            configured_name,
            replaces,
            shadow,
            quota,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(yaml: &str) -> EnvoyConfig {
        EnvoyConfig::from_yaml_str(yaml, AlgorithmKind::FixedWindow).unwrap()
    }

    fn limit_of(c: &EnvoyConfig, domain: &str, entries: &[(&str, &str)]) -> Option<(u32, String)> {
        match c.matching(domain, entries) {
            EnvoyMatch::Limited { limit, counter } => Some((limit.requests_per_unit, counter)),
            _ => None,
        }
    }

    #[test]
    fn wildcards_match_anywhere_and_only_whole_values() {
        assert!(glob("value*", "value_1"));
        assert!(glob("value*", "value"));
        assert!(glob("*.example.com", "a.example.com"));
        assert!(glob("a*b*c", "axxbyyc"));
        assert!(!glob("a*b*c", "axxbyy"));
        assert!(!glob("value*", "valu"));
        assert!(!glob("ab*ba", "aba"), "prefix and suffix may not overlap");
    }

    #[test]
    fn an_exact_value_beats_a_wildcard_which_beats_a_value_less_key() {
        let c = config(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: k\n    value: a*\n    rate_limit: {unit: second, requests_per_unit: 2}\n  - key: k\n    value: ab*\n    rate_limit: {unit: second, requests_per_unit: 3}\n  - key: k\n    value: abc\n    rate_limit: {unit: second, requests_per_unit: 4}\n",
        );
        assert_eq!(limit_of(&c, "d", &[("k", "abc")]).unwrap().0, 4);
        assert_eq!(
            limit_of(&c, "d", &[("k", "abd")]).unwrap().0,
            2,
            "first wildcard in file order"
        );
        assert_eq!(limit_of(&c, "d", &[("k", "zz")]).unwrap().0, 1);
        assert!(limit_of(&c, "other", &[("k", "zz")]).is_none());
    }

    #[test]
    fn a_value_less_key_counts_each_value_and_share_threshold_shares_one() {
        let c = config(
            "domain: d\ndescriptors:\n  - key: ip\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: path\n    value: /api/*\n    share_threshold: true\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: user\n    value: u*\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        );
        let a = limit_of(&c, "d", &[("ip", "1.1.1.1")]).unwrap().1;
        let b = limit_of(&c, "d", &[("ip", "2.2.2.2")]).unwrap().1;
        assert_ne!(a, b);
        let a = limit_of(&c, "d", &[("path", "/api/a")]).unwrap().1;
        let b = limit_of(&c, "d", &[("path", "/api/b")]).unwrap().1;
        assert_eq!(a, b, "shared");
        let a = limit_of(&c, "d", &[("user", "u1")]).unwrap().1;
        let b = limit_of(&c, "d", &[("user", "u2")]).unwrap().1;
        assert_ne!(a, b, "a wildcard without share_threshold counts each value");
    }

    #[test]
    fn no_backtracking_when_the_exact_branch_has_no_match_below() {
        let c = config(
            "domain: d\ndescriptors:\n  - key: a\n    value: x\n    descriptors:\n      - key: b\n        value: only\n        rate_limit: {unit: second, requests_per_unit: 1}\n  - key: a\n    descriptors:\n      - key: b\n        rate_limit: {unit: second, requests_per_unit: 2}\n",
        );
        assert!(limit_of(&c, "d", &[("a", "x"), ("b", "other")]).is_none());
        assert_eq!(
            limit_of(&c, "d", &[("a", "y"), ("b", "other")]).unwrap().0,
            2
        );
    }

    #[test]
    fn unknown_keys_bad_units_and_numbers_are_refused_naming_them() {
        let e = EnvoyConfig::from_yaml_str(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limt:\n      unit: second\n",
            AlgorithmKind::FixedWindow,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("unknown field `rate_limt`") && e.contains("line 4"),
            "{e}"
        );
        for (yaml, want) in [
            ("  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n", "descriptors[0].rate_limit.unit"),
            ("  - key: k\n    rate_limit: {unit: month, requests_per_unit: 1}\n", "at most 7 days"),
            ("  - key: k\n    rate_limit: {unit: second}\n", "requests_per_unit: required"),
            ("  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: magic}\n", "algorithm"),
            ("  - key: \"\"\n", "descriptors[0].key"),
            ("  - key: k\n    value: v\n    share_threshold: true\n", "share_threshold"),
            ("  - key: k\n  - key: j\n  - key: k\n", "descriptors[2]: duplicate descriptor"),
        ] {
            let e = EnvoyConfig::from_yaml_str(&format!("domain: d\ndescriptors:\n{yaml}"), AlgorithmKind::FixedWindow)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{yaml}: {e}");
        }
    }

    #[test]
    fn the_digest_names_the_parsed_domains_not_their_bytes_or_files() {
        const A: &str = "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 2}\n";
        const B: &str = "domain: b\ndescriptors:\n  - key: j\n";
        let digest = |docs: &[(&str, &str)], algorithm| {
            let docs: Vec<(&Path, &str)> = docs.iter().map(|(p, t)| (Path::new(*p), *t)).collect();
            EnvoyConfig::from_documents(&docs, algorithm)
                .unwrap()
                .digest()
        };
        let fw = AlgorithmKind::FixedWindow;
        let base = digest(&[("/etc/a.yaml", A), ("/etc/b.yaml", B)], fw);
        // Other file names, another file order, comments, spacing and key order: the same.
        let reworded = "# the same limit\ndescriptors:\n- rate_limit:\n    requests_per_unit: 2\n    unit: second\n  key: k\ndomain: a\n";
        assert_eq!(
            digest(&[("/srv/y.yml", B), ("/srv/x.yml", reworded)], fw),
            base
        );
        // A number, a domain or the default algorithm: different.
        assert_ne!(digest(&[("a", &A.replace('2', "3")), ("b", B)], fw), base);
        assert_ne!(digest(&[("a", A)], fw), base);
        assert_ne!(
            digest(&[("a", A), ("b", B)], AlgorithmKind::SlidingWindowCounter),
            base
        );
    }

    #[test]
    fn each_limit_is_a_rule_found_by_name_with_its_algorithm() {
        let c = config(
            "domain: d\ndescriptors:\n  - key: k\n    value: v\n    rate_limit: {unit: minute, requests_per_unit: 7, algorithm: sliding_window_counter}\n  - key: j\n    rate_limit: {unit: second, requests_per_unit: 3}\n",
        );
        let r = c.rule("d.k_v").unwrap();
        assert_eq!(
            r.spec,
            AlgorithmSpec::SlidingWindowCounter {
                limit: NonZeroU64::new(7).unwrap(),
                window: Duration::from_secs(60)
            }
        );
        assert_eq!(
            c.rule("d.j").unwrap().spec.kind(),
            AlgorithmKind::FixedWindow,
            "the node default"
        );
    }
}
