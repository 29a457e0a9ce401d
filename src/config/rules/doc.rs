//! The rule document: the rule file's shape as plain data, before validation.
//!
//! A rule set is cluster state (docs/rules.md, "Rules are cluster state"): the API edits it,
//! peers copy it, nodes persist it. What travels and what is stored is this document, not the
//! indexed [`RuleSet`](super::RuleSet) built from it, so every node validates what it
//! receives with the same code that validates a file, and the messages a bad edit gets are
//! the messages `ringlimit rules check` prints.
//!
//! Fields stay loose (numbers as `i64`, names as strings), so a document with five mistakes
//! gets five field-naming lines from validation instead of the first serde error.
//!
//! The [digest](RulesDoc::digest) names a document's content: xxh3-64 over its canonical
//! JSON (fields in declaration order, rules in document order, absent fields left out), so
//! two files that differ only in comments, spacing or key order have the same digest, and
//! every node and build agree on it.

use serde::{Deserialize, Serialize};

use super::error::SyntaxError;
use super::{RulesError, BUILTIN_LIMIT, BUILTIN_WINDOW};

/// A rule document: an optional `[default]` section and the `[[rule]]`s, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesDoc {
    /// The `[default]` section; without it the built-in default applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<DocDefault>,
    /// The `[[rule]]`s, in document order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rule: Vec<DocRule>,
    /// The `[envoy]` section: envoyproxy/ratelimit domains for the Envoy RLS service.
    /// Last, and left out when absent, so every document written before it existed
    /// keeps its digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envoy: Option<DocEnvoy>,
}

/// The `[envoy]` section: envoyproxy/ratelimit's YAML configuration as part of the rule
/// set, one YAML text per domain.
///
/// The domains are kept as the YAML text an operator wrote, not as a structure of our
/// own: the same parser as `--envoy-config` validates them (so errors are the same, with
/// the same lines), `ringlimit rules get` gives back what was put, comments included,
/// and a diff of two versions is a diff of YAML an Envoy user reads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DocEnvoy {
    /// The algorithm of a `rate_limit` without an `algorithm` key; default
    /// `fixed_window`. Part of the document rather than a node flag, so every node
    /// enforcing the section decides alike (`--envoy-algorithm` applies to
    /// `--envoy-config` files only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<String>,
    /// One YAML document (one `domain`) each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub domains: Vec<String>,
}

/// The `[default]` section as written.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)] // the fields are the rule file's, documented in docs/rules.md
pub struct DocDefault {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_unavailable: Option<String>,
    /// `"fence"` or `"split"`; unset: fence when `on_unavailable = "closed"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per: Option<String>,
}

/// One `[[rule]]` as written.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)] // the fields are the rule file's, documented in docs/rules.md
pub struct DocRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_unavailable: Option<String>,
    /// `"fence"` or `"split"`; unset: fence when `on_unavailable = "closed"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per: Option<String>,
    /// At most this many of a client's requests in flight at once (`Acquire`/`Release`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<i64>,
    /// `false`: the owner never lends this rule's budget to entry nodes (budget leases,
    /// docs/leases.md); unset: it may, when a node's `--lease-threshold` is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<bool>,
    /// `false`: this rule's counters are left out of the node's snapshot in
    /// `--data-dir` (a restart starts them from what peers hold); unset: they are
    /// written when the rule's window is at least `--snapshot-min-window-ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<bool>,
}

/// The body of `PUT /v1/limits/{tier}`: one tier rule in the design reference's shape
/// (`route_pattern`, `window_s`), every other rule field accepted by its rule-file name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)] // the fields are the rule file's, documented in docs/rules.md
pub struct TierLimit {
    /// The rule's name; default: derived from the tier and the route pattern.
    #[serde(default)]
    pub name: Option<String>,
    /// The rule file's `route`; absent or null: the tier's rule without a route.
    #[serde(default)]
    pub route_pattern: Option<String>,
    #[serde(default)]
    pub algorithm: Option<String>,
    #[serde(default)]
    pub limit: Option<i64>,
    /// The window in whole seconds (the design reference's field).
    #[serde(default)]
    pub window_s: Option<i64>,
    /// The window in the rule file's syntax (`500ms`, `1m`), instead of `window_s`.
    #[serde(default)]
    pub window: Option<String>,
    #[serde(default)]
    pub burst: Option<i64>,
    #[serde(default)]
    pub mode: Option<String>,
    #[serde(default)]
    pub queue_depth: Option<i64>,
    #[serde(default)]
    pub on_unavailable: Option<String>,
    #[serde(default)]
    pub partition: Option<String>,
    #[serde(default)]
    pub per: Option<String>,
}

impl RulesDoc {
    /// The document of the built-in rule set: an explicit `[default]` section with the
    /// built-in numbers, so a node without rules still has a document with a digest that
    /// every node computes alike.
    pub fn builtin() -> Self {
        RulesDoc {
            default: Some(DocDefault {
                algorithm: Some("sliding_window_counter".into()),
                limit: Some(BUILTIN_LIMIT as i64),
                window: Some(format!("{}s", BUILTIN_WINDOW.as_secs())),
                ..DocDefault::default()
            }),
            rule: Vec::new(),
            envoy: None,
        }
    }

    /// Reads the TOML rule-file format. Syntax and shape errors carry line and column;
    /// nothing is validated beyond the shape (that is [`RuleSet::from_doc`](super::RuleSet::from_doc)).
    pub fn from_toml_str(text: &str) -> Result<Self, RulesError> {
        toml::from_str(text).map_err(|e| RulesError::Toml {
            path: None,
            error: SyntaxError::new(text, &e),
        })
    }

    /// Reads the JSON equivalent of the rule file (`{"default": {...}, "rule": [{...}]}`).
    pub fn from_json_str(text: &str) -> Result<Self, RulesError> {
        serde_json::from_str(text).map_err(|e| RulesError::Json {
            line: e.line(),
            column: e.column(),
            message: super::error::bounded_message(&e.to_string()),
        })
    }

    /// The document in the rule-file format, canonical: what `GET /v1/rules` answers.
    pub fn to_toml(&self) -> String {
        // Only strings, integers, a table and an array of tables: always serializable.
        toml::to_string(self).expect("a rule document serializes to TOML")
    }

    /// The canonical JSON of the document: what peers exchange and the digest covers.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a rule document serializes to JSON")
    }

    /// The content digest (module doc): equal documents, equal digests, on every node.
    pub fn digest(&self) -> u64 {
        let mut buf = b"ringlimit.rules.v1\n".to_vec();
        buf.extend_from_slice(self.to_json().as_bytes());
        xxhash_rust::xxh3::xxh3_64(&buf)
    }

    /// The rules of `tier`: those with `tier = tier` (client rules never carry a tier).
    pub fn tier_rules(&self, tier: &str) -> Vec<&DocRule> {
        self.rule
            .iter()
            .filter(|r| r.tier.as_deref() == Some(tier))
            .collect()
    }

    /// Creates or replaces the rule for (`tier`, its route pattern); returns the name of the
    /// rule written. A replaced rule keeps its name unless the edit names one, so its counters
    /// are kept when its numbers do not change. Validation is the caller's next step: this only
    /// edits the document.
    pub fn put_tier_limit(&mut self, tier: &str, limit: TierLimit) -> Result<String, RulesError> {
        let window = match (limit.window_s, limit.window) {
            (Some(_), Some(_)) => {
                return Err(field_issue(
                    tier,
                    "window_s",
                    "give either \"window_s\" or \"window\", not both",
                ))
            }
            (Some(s), None) if s < 1 => {
                return Err(field_issue(
                    tier,
                    "window_s",
                    &format!("must be an integer >= 1 (got {s})"),
                ))
            }
            (Some(s), None) => Some(format!("{s}s")),
            (None, window) => window,
        };
        let existing = self.rule.iter().position(|r| {
            r.client.is_none() && r.tier.as_deref() == Some(tier) && r.route == limit.route_pattern
        });
        let name = limit
            .name
            .or_else(|| existing.and_then(|i| self.rule[i].name.clone()))
            .unwrap_or_else(|| derived_name(tier, limit.route_pattern.as_deref()));
        let rule = DocRule {
            name: Some(name.clone()),
            client: None,
            tier: Some(tier.to_string()),
            route: limit.route_pattern,
            algorithm: limit.algorithm,
            limit: limit.limit,
            window,
            burst: limit.burst,
            mode: limit.mode,
            queue_depth: limit.queue_depth,
            on_unavailable: limit.on_unavailable,
            partition: limit.partition,
            per: limit.per,
            concurrency: None,
            lease: None,
            snapshot: None,
        };
        match existing {
            Some(i) => self.rule[i] = rule,
            None => self.rule.push(rule),
        }
        Ok(name)
    }

    /// Removes the rule for (`tier`, `route`); false when there is none.
    pub fn delete_tier_limit(&mut self, tier: &str, route: Option<&str>) -> bool {
        let before = self.rule.len();
        self.rule.retain(|r| {
            !(r.client.is_none() && r.tier.as_deref() == Some(tier) && r.route.as_deref() == route)
        });
        self.rule.len() != before
    }
}

/// A one-line validation error for the tier rule being edited.
fn field_issue(tier: &str, field: &'static str, message: &str) -> RulesError {
    RulesError::Invalid(vec![super::RuleIssue {
        rule: super::RuleRef::Named(format!("tier {tier}")),
        field: Some(field),
        message: message.to_string(),
    }])
}

/// A rule name for a tier rule written without one: the tier and the route pattern with
/// every character a name may not hold turned into `-` (`free` + `POST /v1/charges` →
/// `free-POST-v1-charges`). Validation still checks it (a tier of 70 characters makes a
/// name too long, and the message says so).
fn derived_name(tier: &str, route: Option<&str>) -> String {
    let raw = match route {
        Some(route) => format!("{tier}-{route}"),
        None => tier.to_string(),
    };
    let mut name = String::with_capacity(raw.len());
    for c in raw.chars() {
        let c = match c {
            'A'..='Z' | 'a'..='z' | '0'..='9' | '_' | '.' => c,
            '*' => '_',
            _ => '-',
        };
        if !(c == '-' && name.ends_with('-')) {
            name.push(c);
        }
    }
    let name = name.trim_matches('-');
    if name.is_empty() {
        "tier".to_string()
    } else {
        name.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::rules::RuleSet;

    const FILE: &str = r#"
        # a comment
        [default]
        limit = 5
        window = "1m"

        [[rule]]
        name = "free-charges"
        tier = "free"
        route = "POST /v1/charges"
        limit = 10
        window = "1m"
    "#;

    #[test]
    fn toml_and_json_round_trip_to_the_same_digest() {
        let doc = RulesDoc::from_toml_str(FILE).unwrap();
        let again = RulesDoc::from_toml_str(&doc.to_toml()).unwrap();
        assert_eq!(doc, again);
        let json = RulesDoc::from_json_str(&doc.to_json()).unwrap();
        assert_eq!(doc.digest(), json.digest());
        // Comments and layout do not count; a number does.
        let reformatted = FILE
            .replace("# a comment", "")
            .replace("limit = 10", "limit =   10");
        assert_eq!(
            RulesDoc::from_toml_str(&reformatted).unwrap().digest(),
            doc.digest()
        );
        let changed = FILE.replace("limit = 10", "limit = 11");
        assert_ne!(
            RulesDoc::from_toml_str(&changed).unwrap().digest(),
            doc.digest()
        );
    }

    #[test]
    fn the_builtin_document_builds_the_builtin_rule_set() {
        let rules = RuleSet::from_doc(RulesDoc::builtin()).unwrap();
        assert_eq!(
            rules.default_rule().spec,
            RuleSet::builtin().default_rule().spec
        );
        assert_eq!(RuleSet::builtin().digest(), RulesDoc::builtin().digest());
    }

    #[test]
    fn a_tier_limit_is_created_then_replaced_keeping_its_name() {
        let mut doc = RulesDoc::from_toml_str(FILE).unwrap();
        let put = |limit: i64| TierLimit {
            route_pattern: Some("POST /v1/charges".into()),
            algorithm: Some("sliding_window_counter".into()),
            limit: Some(limit),
            window_s: Some(60),
            ..TierLimit::default()
        };
        assert_eq!(
            doc.put_tier_limit("free", put(100)).unwrap(),
            "free-charges"
        );
        assert_eq!(doc.rule.len(), 1);
        assert_eq!(doc.rule[0].limit, Some(100));
        assert_eq!(doc.rule[0].window.as_deref(), Some("60s"));
        assert_eq!(
            doc.put_tier_limit("pro", put(1000)).unwrap(),
            "pro-POST-v1-charges"
        );
        let rules = RuleSet::from_doc(doc.clone()).unwrap();
        assert_eq!(
            rules.get("pro-POST-v1-charges").unwrap().spec.limit().get(),
            1000
        );
        assert!(doc.delete_tier_limit("pro", Some("POST /v1/charges")));
        assert!(!doc.delete_tier_limit("pro", Some("POST /v1/charges")));
        assert_eq!(doc.tier_rules("free").len(), 1);
    }

    #[test]
    fn a_bad_window_s_names_the_field() {
        let mut doc = RulesDoc::default();
        let e = doc
            .put_tier_limit(
                "free",
                TierLimit {
                    limit: Some(1),
                    window_s: Some(0),
                    ..TierLimit::default()
                },
            )
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "rule \"tier free\": field \"window_s\": must be an integer >= 1 (got 0)"
        );
        assert!(doc.rule.is_empty(), "nothing changed");
    }

    fn text() -> impl proptest::strategy::Strategy<Value = Option<String>> {
        proptest::option::of(".{0,12}")
    }

    fn rule() -> impl proptest::strategy::Strategy<Value = DocRule> {
        use proptest::prelude::*;
        (
            (text(), text(), text(), text(), text(), any::<Option<i64>>()),
            (
                text(),
                any::<Option<i64>>(),
                text(),
                any::<Option<i64>>(),
                text(),
                text(),
            ),
        )
            .prop_map(
                |(
                    (name, client, tier, route, algorithm, limit),
                    (window, burst, mode, queue_depth, on_unavailable, per),
                )| DocRule {
                    // Any text, drawn from the name so the strategy tuples stay within
                    // proptest's arity.
                    partition: name.as_ref().map(|n| format!("{n}\n\"fence")),
                    name,
                    client,
                    tier,
                    route,
                    algorithm,
                    limit,
                    window,
                    burst,
                    mode,
                    queue_depth,
                    on_unavailable,
                    per,
                    concurrency: None,
                    lease: None,
                    snapshot: None,
                },
            )
    }

    proptest::proptest! {
        /// Whatever a document holds (quotes, newlines, control characters, any number),
        /// the TOML and JSON that `GET /v1/rules` and peers send read back as the same
        /// document with the same digest: no edit is ever changed by being passed on.
        #[test]
        fn any_document_survives_toml_and_json(
            rules in proptest::collection::vec(rule(), 0..4),
            limit in proptest::option::of(proptest::prelude::any::<i64>()),
            envoy in proptest::option::of((text(), proptest::collection::vec("(.|\n){0,40}", 0..3))),
        ) {
            let doc = RulesDoc {
                default: limit.map(|l| DocDefault { limit: Some(l), ..DocDefault::default() }),
                rule: rules,
                envoy: envoy.map(|(algorithm, domains)| DocEnvoy { algorithm, domains }),
            };
            let toml_back = RulesDoc::from_toml_str(&doc.to_toml()).unwrap();
            proptest::prop_assert_eq!(&toml_back, &doc);
            let json_back = RulesDoc::from_json_str(&doc.to_json()).unwrap();
            proptest::prop_assert_eq!(json_back.digest(), doc.digest());
        }
    }

    #[test]
    fn an_envoy_section_is_validated_by_the_envoy_parser_and_kept_as_written() {
        const YAML: &str = "# edge limits\ndomain: gw\ndescriptors:\n  - key: ip\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";
        let toml = format!(
            "{FILE}\n[envoy]\nalgorithm = \"sliding_window_counter\"\ndomains = ['''\n{YAML}''']\n"
        );
        let doc = RulesDoc::from_toml_str(&toml).unwrap();
        assert_eq!(doc.envoy.as_ref().unwrap().domains, [YAML]);
        let rules = RuleSet::from_doc(doc.clone()).unwrap();
        assert_eq!(rules.envoy().domains().collect::<Vec<_>>(), ["gw"]);
        assert_eq!(
            rules.envoy().rule("gw.ip").unwrap().spec.kind(),
            crate::algorithms::AlgorithmKind::SlidingWindowCounter,
            "the section's algorithm, not a node flag"
        );
        // Comments in the YAML are content: `rules get` gives them back.
        assert!(doc.to_toml().contains("# edge limits"), "{}", doc.to_toml());
        assert_eq!(RulesDoc::from_toml_str(&doc.to_toml()).unwrap(), doc);
        // Without the section the digest is the one documents always had.
        let without = RulesDoc::from_toml_str(FILE).unwrap();
        assert_ne!(doc.digest(), without.digest());
        assert!(!without.to_json().contains("envoy"));

        let broken = toml.replace("requests_per_unit: 5", "requests_per_unit: 5, burst: 2");
        let e = RuleSet::from_doc(RulesDoc::from_toml_str(&broken).unwrap())
            .unwrap_err()
            .to_string();
        for part in [
            "envoy config envoy.domains[0] (domain \"gw\"): ",
            "unknown field `burst`",
            "line 5",
        ] {
            assert!(e.contains(part), "{part:?} not in {e}");
        }
        let e = RuleSet::from_doc(
            RulesDoc::from_toml_str(&toml.replace("sliding_window_counter", "magic")).unwrap(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("envoy config envoy.algorithm: \"magic\" is not an algorithm"),
            "{e}"
        );
    }

    #[test]
    fn json_errors_carry_line_and_column() {
        let e = RulesDoc::from_json_str("{\"rule\": [{\"limt\": 1}]}").unwrap_err();
        let text = e.to_string();
        assert!(text.starts_with("JSON error at line 1, column "), "{text}");
        assert!(text.contains("unknown field `limt`"), "{text}");
    }
}
