//! Configuration: how a node starts ([`node`]) and which limit applies to which check
//! ([`rules`], loaded from a TOML rule file; [`route`] is the route syntax both share).

pub mod node;
pub mod route;
pub mod rules;

pub use route::{Route, RouteError, RouteErrorKind, RoutePattern, Specificity};
pub use rules::{
    parse_duration, AlgorithmSpec, DurationError, FailMode, LeakyMode, MatchLevel, Rule, RuleIssue,
    RuleRef, RuleSet, RulesError, Selector,
};
