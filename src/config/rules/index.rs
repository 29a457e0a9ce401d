//! Which rule governs a check: the precedence of the module doc, answered with a few hash
//! lookups.
//!
//! Rules are grouped by client key and by tier, and within a group by route (exact paths in
//! a map, prefixes sorted most specific first), so the cost of a check does not grow with the
//! number of client overrides. The tests check it against a brute-force ranking of every rule.

use std::collections::HashMap;
use std::sync::Arc;

use super::envoy::EnvoyConfig;
use super::{MatchLevel, Rule, RulesDoc};
use crate::config::route::{Route, RoutePattern};

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
    /// The document the rules were built from, kept so it can be served and copied.
    doc: Arc<RulesDoc>,
    /// [`RulesDoc::digest`] of `doc`, computed once.
    digest: u64,
    /// The `[envoy]` section, parsed (empty without one).
    envoy: Arc<EnvoyConfig>,
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
        Self::index(vec![Rule::builtin_default()], RulesDoc::builtin())
    }

    /// Builds the lookup index; `rules[0]` is the default rule.
    pub(super) fn index(rules: Vec<Rule>, doc: RulesDoc) -> Self {
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
            digest: doc.digest(),
            doc: Arc::new(doc),
            envoy: Arc::default(),
        }
    }

    /// These rules with `envoy`, their `[envoy]` section parsed.
    pub(super) fn with_envoy(mut self, envoy: EnvoyConfig) -> Self {
        self.envoy = Arc::new(envoy);
        self
    }

    /// The Envoy domains of the document's `[envoy]` section (none without one): what a
    /// node without `--envoy-config` serves Envoy's RLS from.
    pub fn envoy(&self) -> &Arc<EnvoyConfig> {
        &self.envoy
    }

    /// The document these rules were built from.
    pub fn doc(&self) -> &RulesDoc {
        &self.doc
    }

    /// The content digest of [`RuleSet::doc`]: equal on every node holding the same rules.
    pub fn digest(&self) -> u64 {
        self.digest
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
    use super::super::testing::{set, LEVELS};
    use super::super::{AlgorithmSpec, FailMode};
    use super::*;
    use proptest::prelude::*;
    use std::num::NonZeroU64;
    use std::time::Duration;

    fn name_of(rs: &RuleSet, client: &str, tier: Option<&str>, route: Option<&str>) -> String {
        let route = route.map(|r| Route::parse(r).unwrap());
        rs.matching(client, tier, route.as_ref()).name.to_string()
    }

    const CHARGE: Option<&str> = Some("POST /v1/charges");
    const OTHER: Option<&str> = Some("GET /v1/users");

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
        // An explicit [default] with the built-in numbers is the built-in default.
        assert_eq!(
            set("[default]\nlimit = 100\nwindow = \"60s\"\n").default_rule(),
            d
        );
        assert_eq!(RuleSet::default().default_rule(), d);
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
            // A file with no rules of its own is refused; the node then runs the builtin.
            let rs = if unique.is_empty() { RuleSet::builtin() } else { set(&render(&unique)) };
            for (client, tier, route) in queries {
                let route = route.map(|i| Route::parse(ROUTES[i]).unwrap());
                let fast = rs.matching(client, tier, route.as_ref());
                let slow = brute_force(&rs, client, tier, route.as_ref());
                prop_assert_eq!(&fast.name, &slow.name, "client {} tier {:?} route {:?}", client, tier, route);
            }
        }
    }
}
