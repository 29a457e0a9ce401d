//! Which limit applies to which check: [`rules`] (loaded from a TOML rule file) and
//! [`route`], the route syntax rules and requests share; [`xds`], the subscription that
//! receives Envoy domains from an xDS control plane, as a state machine. How a node starts lives with
//! the composition root (`node::config`), so nothing here imports a subsystem.

pub mod bounds;
pub mod route;
pub mod rules;
pub mod xds;

use std::sync::Arc;

use arc_swap::ArcSwap;

pub use route::{Route, RouteError, RouteErrorKind, RoutePattern, Specificity};
pub use rules::{
    parse_duration, AlgorithmSpec, DurationError, FailMode, LeakyMode, MatchLevel, Partition, Rule,
    RuleIssue, RuleRef, RuleSet, RulesError, Selector,
};

/// The rules every check is matched against; swapped whole on reload, so a check sees
/// one rule set from start to end.
pub type SharedRules = Arc<ArcSwap<RuleSet>>;

/// The Envoy (envoyproxy/ratelimit YAML) configuration Envoy RLS checks are matched
/// against; empty unless the node was started with one. Swapped whole on reload.
pub type SharedEnvoy = Arc<ArcSwap<rules::envoy::EnvoyConfig>>;
