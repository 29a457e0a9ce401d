//! Which counters one client has, for an operator (`GET`/`DELETE /v1/counters`).
//!
//! The store keeps no client key bytes (a counter is a [`KeyId`]), so a client's
//! counters are found from the rules: every rule that can apply to the client key (its
//! own client rules, tier rules, route rules, the default) names one counter, whose
//! identity is computed as a check would compute it. All of them share the client key's
//! ring placement, so they sit on one shard of one node, the key's owner, and one actor
//! step reads (or resets) them all. Pure: the actor runs [`ClientQuery::counters`]'s
//! output against its store.

use std::sync::Arc;

use crate::algorithms::Decision;
use crate::config::bounds::{self, Text};
use crate::config::route::Route;
use crate::config::rules::{CountPer, Rule, RuleSet};
use crate::ring::Ring;
use crate::shard::KeyId;

/// An operator's question about one client: the key, and optionally the route and tier
/// its checks carry. Only built through [`ClientQuery::new`], so every instance is
/// within the bounds a check is held to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientQuery {
    key: String,
    route: Option<String>,
    tier: Option<String>,
}

impl ClientQuery {
    /// Validate a query with the bounds of a check (`config::bounds`): a key of
    /// 1..=`MAX_KEY_BYTES` bytes, a route a check would accept, a non-empty tier of at
    /// most `MAX_TIER_BYTES`. The error names the field, as a check's would.
    pub fn new(key: &str, route: Option<&str>, tier: Option<&str>) -> Result<Self, String> {
        bounds::text(Text::Key, key).map_err(|e| format!("key: {e}"))?;
        if let Some(route) = route {
            Route::parse(route).map_err(|e| format!("route: {e}"))?;
        }
        if let Some(tier) = tier {
            bounds::text(Text::Tier, tier).map_err(|e| format!("tier: {e}"))?;
        }
        Ok(Self {
            key: key.to_string(),
            route: route.map(str::to_string),
            tier: tier.map(str::to_string),
        })
    }

    /// The client key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The route, as given.
    pub fn route(&self) -> Option<&str> {
        self.route.as_deref()
    }

    /// The tier, as given.
    pub fn tier(&self) -> Option<&str> {
        self.tier.as_deref()
    }

    /// The ring placement every counter of this client shares: where its owner is.
    pub fn placement(&self) -> u64 {
        Ring::key_hash(self.key.as_bytes())
    }

    /// Every counter this client can have under `rules`: one per rule whose selector
    /// can apply to the key (the client's own rules; any tier's rules, or only `tier`'s
    /// when given; route rules whose pattern matches `route` when given). A rule that
    /// counts per route names a counter only with a route: its counters are per
    /// (client, route), and the store cannot list them without the route.
    pub fn counters(&self, rules: &RuleSet) -> Vec<ClientCounter> {
        let route = self
            .route
            .as_deref()
            .map(|r| Route::parse(r).expect("validated in ClientQuery::new"));
        rules
            .rules()
            .iter()
            .filter(|rule| {
                let s = &rule.selector;
                s.client.as_deref().is_none_or(|c| c == self.key)
                    && match (&s.tier, &self.tier) {
                        (Some(t), Some(asked)) => t == asked,
                        _ => true,
                    }
                    && match (&s.route, &route) {
                        (Some(pattern), Some(r)) => pattern.matches(r),
                        _ => true,
                    }
            })
            .filter_map(|rule| {
                let part = match (rule.per, &route) {
                    (CountPer::Client, _) => String::new(),
                    (CountPer::Route, Some(r)) => r.as_str().to_string(),
                    (CountPer::Route, None) => return None,
                };
                Some(ClientCounter {
                    id: KeyId::of(&rule.name, self.key.as_bytes(), &part),
                    rule: rule.clone(),
                    route: part,
                })
            })
            .collect()
    }
}

/// One counter of a client: its identity, the rule it counts under, and its route part
/// (empty unless the rule counts per route).
#[derive(Debug, Clone)]
pub struct ClientCounter {
    /// The counter's identity, as a check computes it.
    pub id: KeyId,
    /// The rule whose numbers and algorithm it runs under.
    pub rule: Arc<Rule>,
    /// The normalised route of a per-route counter, else empty.
    pub route: String,
}

/// What the owner's shard holds of one counter: its numbers as a check would see them
/// (before the reset, for a reset).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CounterReading {
    /// The rule's name.
    pub rule: String,
    /// The rule's algorithm, as written in rule files.
    pub algorithm: String,
    /// The normalised route of a per-route counter, else empty.
    pub route: String,
    /// Units a fresh counter admits at once (the rule's limit, a bucket's capacity).
    pub limit: u64,
    /// Units still admissible now.
    pub remaining: u64,
    /// When the counter is back to full (Unix ms, the owner's clock).
    pub reset_at_ms: u64,
}

impl CounterReading {
    /// The reading of `counter` whose state a check would see as `decision`.
    pub fn of(counter: &ClientCounter, decision: &Decision) -> Self {
        Self {
            rule: counter.rule.name.to_string(),
            algorithm: counter.rule.spec.algorithm_name().to_string(),
            route: counter.route.clone(),
            limit: decision.limit,
            remaining: decision.remaining,
            reset_at_ms: decision.reset_at_ms,
        }
    }

    /// Units the client has used of the counter's budget right now.
    pub fn used(&self) -> u64 {
        self.limit.saturating_sub(self.remaining)
    }
}

/// A client's counters as its owner answered them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCounters {
    /// The node that holds them (the key's owner in its own ring view).
    pub owner: String,
    /// That node's generation.
    pub generation: u64,
    /// The counters holding state (a counter without state is as fresh as a new key).
    pub counters: Vec<CounterReading>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: &str = r#"
[default]
algorithm = "fixed_window"
limit = 100
window = "60s"

[[rule]]
name = "acme"
client = "acme"
limit = 10
window = "60s"

[[rule]]
name = "other-client"
client = "globex"
limit = 10
window = "60s"

[[rule]]
name = "gold"
tier = "gold"
limit = 50
window = "60s"

[[rule]]
name = "silver"
tier = "silver"
limit = 20
window = "60s"

[[rule]]
name = "uploads"
route = "POST /upload"
per = "route"
limit = 5
window = "60s"
"#;

    fn names(query: &ClientQuery, rules: &RuleSet) -> Vec<String> {
        query
            .counters(rules)
            .iter()
            .map(|c| c.rule.name.to_string())
            .collect()
    }

    #[test]
    fn a_client_has_the_counters_of_every_rule_that_can_apply_to_it() {
        let rules = RuleSet::from_toml_str(RULES).unwrap();
        let q = ClientQuery::new("acme", None, None).unwrap();
        let mut all = names(&q, &rules);
        all.sort();
        assert_eq!(all, ["acme", "default", "gold", "silver"]);
        let gold = ClientQuery::new("acme", None, Some("gold")).unwrap();
        assert!(!names(&gold, &rules).contains(&"silver".to_string()));
        let routed = ClientQuery::new("acme", Some("POST /upload?x=1"), None).unwrap();
        let uploads = routed
            .counters(&rules)
            .into_iter()
            .find(|c| &*c.rule.name == "uploads")
            .expect("a per-route counter appears with its route");
        assert_eq!(uploads.route, "POST /upload");
        assert_eq!(uploads.id, KeyId::of("uploads", b"acme", "POST /upload"));
    }

    #[test]
    fn counter_identities_are_the_ones_a_check_computes() {
        let rules = RuleSet::from_toml_str(RULES).unwrap();
        let q = ClientQuery::new("acme", Some("GET /x"), Some("gold")).unwrap();
        let route = Route::parse("GET /x").unwrap();
        let matched = rules.matching("acme", Some("gold"), Some(&route));
        let id = KeyId::of(
            &matched.name,
            b"acme",
            matched.per.route_part(route.as_str()),
        );
        assert!(q.counters(&rules).iter().any(|c| c.id == id));
        assert!(q
            .counters(&rules)
            .iter()
            .all(|c| c.id.placement == q.placement()));
    }

    #[test]
    fn bad_input_is_refused_naming_the_field() {
        assert!(ClientQuery::new("", None, None)
            .unwrap_err()
            .starts_with("key: "));
        let long = "k".repeat(bounds::MAX_KEY_BYTES + 1);
        assert!(ClientQuery::new(&long, None, None)
            .unwrap_err()
            .starts_with("key: "));
        assert!(ClientQuery::new("a", Some("no slash"), None)
            .unwrap_err()
            .starts_with("route: "));
        assert!(ClientQuery::new("a", None, Some(""))
            .unwrap_err()
            .starts_with("tier: "));
        assert!(ClientQuery::new(&"k".repeat(bounds::MAX_KEY_BYTES), None, None).is_ok());
    }
}
