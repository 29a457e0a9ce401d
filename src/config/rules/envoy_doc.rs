//! One envoyproxy/ratelimit domain as written, before it is checked: what a YAML document
//! deserializes to and what an xDS `RateLimitConfig` converts to, so both sources reach
//! [`EnvoyConfig::from_domains`](super::envoy::EnvoyConfig::from_domains) as the same
//! value and a domain has one digest whichever way it came (the digest is over this
//! type's canonical JSON: field order and names here are part of it).

use serde::{Deserialize, Serialize};

/// A YAML document: `domain` and its `descriptors`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DomainDoc {
    /// `domain`.
    pub domain: String,
    /// `descriptors`.
    #[serde(default)]
    pub descriptors: Vec<DescriptorDoc>,
}

/// One entry of a `descriptors` list.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DescriptorDoc {
    /// `key`.
    pub key: String,
    /// `value`; `None`: a value-less key (each runtime value counted on its own).
    pub value: Option<String>,
    /// `rate_limit`.
    pub rate_limit: Option<RateLimitDoc>,
    /// `shadow_mode`.
    #[serde(default)]
    pub shadow_mode: bool,
    /// `quota_mode`: over its limit this descriptor reports OVER_LIMIT but denies the
    /// request only when every quota-mode descriptor of it is over (envoyproxy/ratelimit's
    /// semantics). Left out of the canonical form when false, so existing domains keep
    /// their digests.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub quota_mode: bool,
    /// `detailed_metric`: accepted, ringlimit's metrics are per rule whatever this says
    /// (it only counts in the digest).
    #[serde(default)]
    pub detailed_metric: bool,
    /// `share_threshold` (YAML only: the xDS resource has no such field).
    #[serde(default)]
    pub share_threshold: bool,
    /// Nested `descriptors`.
    #[serde(default)]
    pub descriptors: Vec<DescriptorDoc>,
}

/// A `rate_limit`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitDoc {
    /// `unit` as written (`second` … `week`).
    pub unit: Option<String>,
    /// `requests_per_unit`.
    pub requests_per_unit: Option<u64>,
    /// `unlimited`.
    #[serde(default)]
    pub unlimited: bool,
    /// `name`: the target of other limits' `replaces`.
    pub name: Option<String>,
    /// `replaces`.
    #[serde(default)]
    pub replaces: Vec<ReplaceDoc>,
    /// ringlimit's `algorithm` (YAML only).
    pub algorithm: Option<String>,
    /// ringlimit's `on_unavailable` (YAML only).
    pub on_unavailable: Option<String>,
    /// ringlimit's `partition` (YAML only): `fence` or `split`.
    #[serde(default)]
    pub partition: Option<String>,
}

/// One entry of `replaces`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReplaceDoc {
    /// The replaced limit's `rate_limit.name`.
    pub name: String,
}
