//! A rules write as it travels: the edit the API expresses, what an accepted write did,
//! and the kinds of refusal. The rules state (`cluster::rules`) applies edits and the
//! peer link (`cluster::link`) carries them to the coordinator; both speak these types,
//! so neither imports the other's module for them.

use crate::config::rules::{DocEnvoy, RulesDoc, Stamp, TierLimit};

/// One change to the rule document, as the API expresses it. It travels to the
/// coordinator as an edit, not as a finished document, so it applies to the
/// coordinator's copy: two edits of different tiers made on two nodes both survive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RulesEdit {
    /// `PUT /v1/rules`: the whole document.
    Replace(RulesDoc),
    /// `PUT /v1/limits/{tier}`: create or replace one tier rule.
    PutTierLimit {
        /// The tier.
        tier: String,
        /// The rule.
        limit: TierLimit,
    },
    /// `DELETE /v1/limits/{tier}?route_pattern=…`.
    DeleteTierLimit {
        /// The tier.
        tier: String,
        /// The route pattern; `None`: the tier's rule without a route.
        route: Option<String>,
    },
    /// `PUT /v1/rules/envoy`: replace the `[envoy]` section (`None`: remove it), keeping
    /// every TOML rule as the coordinator has it.
    ReplaceEnvoy(Option<DocEnvoy>),
}

/// What an accepted write did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The version and digest in force after it (on the coordinator).
    pub stamp: Stamp,
    /// False when the document was already the one in force (nothing changed).
    pub changed: bool,
    /// For a tier rule written: its name.
    pub rule: Option<String>,
    /// The node that ordered the write.
    pub coordinator: String,
}

/// The kinds of refusal a write can get, wherever it was decided: what the edges map to
/// HTTP and gRPC codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The files are the truth.
    ReadOnly,
    /// `If-Match` names an old version.
    Stale,
    /// The resulting document is invalid.
    Invalid,
    /// No such tier rule.
    NotFound,
    /// The coordinator cannot take writes now, or did not answer (503).
    Unavailable,
    /// Persisting failed, or the version cannot grow.
    Internal,
}
