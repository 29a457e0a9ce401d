//! envoyproxy/ratelimit's configuration over xDS, as Envoy Gateway and the AI Gateway send
//! it: a state-of-the-world subscription to `RateLimitConfig` resources, one domain each,
//! as a state machine. Fed what the control plane sent, it says what to enforce and what
//! to answer; it never touches a socket or a clock (`node::xds` is the shell around it,
//! and its adapter turns the wire messages into these types and back).
//!
//! The protocol, from the subscriber's side (data-plane-api's xDS protocol, "ACK/NACK and
//! resource type instance version"):
//!
//! - a stream opens with a request naming the type, the last version this node accepted
//!   (`""` before any) and no nonce;
//! - each response is the whole set (state of the world): it replaces every domain
//!   received before, and a set with no resource leaves no domain;
//! - a set that reads cleanly is swapped in, then acknowledged: the request echoes the
//!   response's `version_info` and `nonce` (an ACK);
//! - a set with any bad resource is refused whole and nothing of it is applied: the
//!   request carries the last accepted version, the response's nonce and an
//!   `error_detail` saying which resource and field is wrong (a NACK);
//! - the stream breaking changes nothing that is enforced: the node reconnects with
//!   backoff ([`Backoff`]) and subscribes again with the version it holds.
//!
//! Every set goes through [`EnvoyConfig::from_domains`], the checks the YAML files go
//! through, so a domain sent over xDS and the same domain in a YAML file have one digest
//! and are refused with the same messages.

use std::path::PathBuf;
use std::time::Duration;

use crate::algorithms::AlgorithmKind;
use crate::config::rules::envoy::{DomainDoc, EnvoyConfig};

/// The resource type a node subscribes to: envoyproxy/ratelimit's, so control planes
/// written for it (Envoy Gateway's) serve ringlimit unchanged.
pub const RATE_LIMIT_CONFIG_TYPE: &str =
    "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// `google.rpc.Code` of a NACK's `error_detail`: INVALID_ARGUMENT.
pub const NACK_CODE: i32 = 3;

/// What the node sends on the stream; the adapter adds the node's identity and
/// [`RATE_LIMIT_CONFIG_TYPE`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdsRequest {
    /// The last version accepted (`""` before any): on an ACK, the version just accepted.
    pub version_info: String,
    /// The nonce of the response answered; `""` on a new stream.
    pub response_nonce: String,
    /// A NACK's reason; `None` for a subscription or an ACK.
    pub error: Option<String>,
}

/// One resource of a response, as the adapter read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdsResource {
    /// `RateLimitConfig.name` (`""` when the resource could not be decoded).
    pub name: String,
    /// The domain it describes, or why it could not be read (wrong type, bad protobuf, a
    /// field ringlimit does not support).
    pub domain: Result<DomainDoc, String>,
}

/// A `DiscoveryResponse` in domain terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdsResponse {
    /// The control plane's version of this set.
    pub version_info: String,
    /// Echoed by the answer.
    pub nonce: String,
    /// The type of the set.
    pub type_url: String,
    /// Every resource of the set.
    pub resources: Vec<XdsResource>,
}

/// What to do with a response.
#[derive(Debug)]
pub enum XdsStep {
    /// A new set: swap it in, then send the ACK.
    Apply {
        /// The configuration to enforce.
        config: EnvoyConfig,
        /// The ACK.
        ack: XdsRequest,
    },
    /// A set that means what is already enforced (a new version of the same domains):
    /// send the ACK, keep the counters.
    Unchanged {
        /// The ACK.
        ack: XdsRequest,
    },
    /// A refused set: send the NACK; what is enforced stays.
    Reject {
        /// The NACK (its `error` is `message`).
        nack: XdsRequest,
        /// Why, naming the resource and the field.
        message: String,
    },
    /// A response of another type, which this node never subscribed to: answered with
    /// nothing (as Envoy does for an unwatched type).
    Ignore {
        /// The type it was.
        type_url: String,
    },
}

/// The subscription: the last version accepted and the digest of what it enforces.
#[derive(Debug, Clone)]
pub struct XdsSession {
    algorithm: AlgorithmKind,
    accepted_version: String,
    enforced: u64,
}

impl XdsSession {
    /// A session enforcing a configuration whose digest is `enforced` (the empty one at
    /// start); `algorithm` is what a `rate_limit` means (`--envoy-algorithm`).
    pub fn new(algorithm: AlgorithmKind, enforced: u64) -> Self {
        Self {
            algorithm,
            accepted_version: String::new(),
            enforced,
        }
    }

    /// The version last accepted (`""` before any).
    pub fn accepted_version(&self) -> &str {
        &self.accepted_version
    }

    /// The request that opens a stream: the type, the version held, no nonce. Sent on
    /// every (re)connection, so a control plane that restarted learns what the node has.
    pub fn subscribe(&self) -> XdsRequest {
        XdsRequest {
            version_info: self.accepted_version.clone(),
            response_nonce: String::new(),
            error: None,
        }
    }

    /// Reads one response: the whole set is checked as the YAML files are, and either
    /// enforced and ACKed, or refused whole and NACKed with the first problem found.
    pub fn on_response(&mut self, response: XdsResponse) -> XdsStep {
        if response.type_url != RATE_LIMIT_CONFIG_TYPE {
            return XdsStep::Ignore {
                type_url: response.type_url,
            };
        }
        let mut domains = Vec::with_capacity(response.resources.len());
        for (i, resource) in response.resources.into_iter().enumerate() {
            let at = if resource.name.is_empty() {
                format!("resources[{i}]")
            } else {
                format!("resources[{i}] (name {:?})", resource.name)
            };
            match resource.domain {
                Ok(domain) => domains.push((PathBuf::from(at), domain)),
                Err(message) => {
                    return self.reject(&response.version_info, response.nonce, at, &message)
                }
            }
        }
        match EnvoyConfig::from_domains(domains, self.algorithm) {
            Ok(config) => {
                let ack = XdsRequest {
                    version_info: response.version_info.clone(),
                    response_nonce: response.nonce,
                    error: None,
                };
                self.accepted_version = response.version_info;
                if config.digest() == self.enforced {
                    return XdsStep::Unchanged { ack };
                }
                self.enforced = config.digest();
                XdsStep::Apply { config, ack }
            }
            Err(error) => {
                let at = error.path.display().to_string();
                self.reject(&response.version_info, response.nonce, at, &error.message)
            }
        }
    }

    fn reject(&self, version: &str, nonce: String, at: String, message: &str) -> XdsStep {
        let message = format!("RateLimitConfig version {version:?} refused: {at}: {message}");
        XdsStep::Reject {
            nack: XdsRequest {
                version_info: self.accepted_version.clone(),
                response_nonce: nonce,
                error: Some(message.clone()),
            },
            message,
        }
    }
}

/// How long to wait before connecting again after `failures` failed attempts in a row:
/// doubling from `initial` up to `max`, each wait scaled by a per-node factor in
/// [0.5, 1.0) so that nodes that lost one control plane together do not all return at
/// the same instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The first wait.
    pub initial: Duration,
    /// The longest wait.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(250),
            max: Duration::from_secs(10),
        }
    }
}

impl Backoff {
    /// The wait after `failures` failed attempts in a row (0: the stream just broke),
    /// jittered by `node_id` and `failures` (the same inputs give the same wait).
    pub fn delay(&self, failures: u32, node_id: &str) -> Duration {
        let full = self
            .initial
            .saturating_mul(1u32 << failures.min(20))
            .min(self.max);
        let mut seed = Vec::with_capacity(node_id.len() + 4);
        seed.extend_from_slice(node_id.as_bytes());
        seed.extend_from_slice(&failures.to_le_bytes());
        // Top 16 bits of the hash: a factor of 0.5 + k / 2^17, k < 2^16.
        let k = xxhash_rust::xxh3::xxh3_64(&seed) >> 48;
        full / 2 + full.mul_f64(k as f64 / f64::from(1u32 << 17))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::rules::envoy::{DescriptorDoc, RateLimitDoc};

    fn domain(name: &str, unit: &str, requests: u64) -> DomainDoc {
        DomainDoc {
            domain: name.into(),
            descriptors: vec![DescriptorDoc {
                key: "api".into(),
                value: None,
                rate_limit: Some(RateLimitDoc {
                    unit: Some(unit.into()),
                    requests_per_unit: Some(requests),
                    unlimited: false,
                    name: None,
                    replaces: vec![],
                    algorithm: None,
                    on_unavailable: None,
                    partition: None,
                }),
                shadow_mode: false,
                detailed_metric: false,
                share_threshold: false,
                quota_mode: false,
                descriptors: vec![],
            }],
        }
    }

    fn response(
        version: &str,
        nonce: &str,
        domains: Vec<Result<DomainDoc, String>>,
    ) -> XdsResponse {
        XdsResponse {
            version_info: version.into(),
            nonce: nonce.into(),
            type_url: RATE_LIMIT_CONFIG_TYPE.into(),
            resources: domains
                .into_iter()
                .enumerate()
                .map(|(i, domain)| XdsResource {
                    name: format!("config-{i}"),
                    domain,
                })
                .collect(),
        }
    }

    fn session() -> XdsSession {
        XdsSession::new(AlgorithmKind::FixedWindow, EnvoyConfig::default().digest())
    }

    #[test]
    fn a_new_stream_subscribes_with_the_version_held_and_no_nonce() {
        let mut s = session();
        assert_eq!(
            s.subscribe(),
            XdsRequest {
                version_info: String::new(),
                response_nonce: String::new(),
                error: None
            }
        );
        let XdsStep::Apply { .. } =
            s.on_response(response("v1", "n1", vec![Ok(domain("web", "minute", 3))]))
        else {
            panic!("applied")
        };
        assert_eq!(
            s.subscribe().version_info,
            "v1",
            "a reconnection names what is held"
        );
        assert_eq!(s.subscribe().response_nonce, "");
    }

    #[test]
    fn a_good_set_is_applied_then_acked_with_its_version_and_nonce() {
        let mut s = session();
        let step = s.on_response(response("v1", "n1", vec![Ok(domain("web", "minute", 3))]));
        let XdsStep::Apply { config, ack } = step else {
            panic!("applied: {step:?}")
        };
        assert_eq!(config.domains().collect::<Vec<_>>(), vec!["web"]);
        assert_eq!(
            ack,
            XdsRequest {
                version_info: "v1".into(),
                response_nonce: "n1".into(),
                error: None
            }
        );
        assert_eq!(s.accepted_version(), "v1");
    }

    #[test]
    fn a_bad_set_is_nacked_with_the_last_good_version_and_nothing_applied() {
        let mut s = session();
        s.on_response(response("v1", "n1", vec![Ok(domain("web", "minute", 3))]));
        // One good domain and one bad: the whole set is refused.
        let step = s.on_response(response(
            "v2",
            "n2",
            vec![
                Ok(domain("web", "minute", 5)),
                Ok(domain("api", "month", 1)),
            ],
        ));
        let XdsStep::Reject { nack, message } = step else {
            panic!("refused: {step:?}")
        };
        assert_eq!(nack.version_info, "v1", "the version still enforced");
        assert_eq!(nack.response_nonce, "n2", "the response refused");
        assert_eq!(nack.error.as_deref(), Some(message.as_str()));
        assert!(
            message.contains("version \"v2\"")
                && message.contains("resources[1] (name \"config-1\")")
                && message.contains("descriptors[0].rate_limit.unit")
                && message.contains("at most 7 days"),
            "{message}"
        );
        assert_eq!(s.accepted_version(), "v1");
        // The next good set is compared with what is enforced (v1's), not the refused one.
        let again = s.on_response(response("v3", "n3", vec![Ok(domain("web", "minute", 3))]));
        assert!(matches!(again, XdsStep::Unchanged { .. }), "{again:?}");
    }

    #[test]
    fn unreadable_resources_and_duplicate_domains_are_refused_naming_them() {
        let mut s = session();
        let step = s.on_response(response(
            "v1",
            "n1",
            vec![
                Ok(domain("web", "minute", 3)),
                Err("descriptors[0].quota_mode: not supported".into()),
            ],
        ));
        let XdsStep::Reject { message, nack } = step else {
            panic!("refused: {step:?}")
        };
        assert!(
            message.contains("resources[1] (name \"config-1\"): descriptors[0].quota_mode"),
            "{message}"
        );
        assert_eq!(nack.version_info, "", "nothing accepted yet");
        let step = s.on_response(response(
            "v2",
            "n2",
            vec![
                Ok(domain("web", "minute", 3)),
                Ok(domain("web", "second", 1)),
            ],
        ));
        let XdsStep::Reject { message, .. } = step else {
            panic!("refused: {step:?}")
        };
        assert!(
            message.contains("domain \"web\" is defined twice"),
            "{message}"
        );
    }

    #[test]
    fn the_same_domains_under_a_new_version_are_acked_without_a_swap() {
        let mut s = session();
        s.on_response(response("v1", "n1", vec![Ok(domain("web", "minute", 3))]));
        let step = s.on_response(response("v2", "n2", vec![Ok(domain("web", "minute", 3))]));
        let XdsStep::Unchanged { ack } = step else {
            panic!("unchanged: {step:?}")
        };
        assert_eq!(
            (ack.version_info.as_str(), ack.response_nonce.as_str()),
            ("v2", "n2")
        );
        assert_eq!(s.accepted_version(), "v2");
    }

    #[test]
    fn an_empty_set_replaces_every_domain() {
        let mut s = session();
        s.on_response(response("v1", "n1", vec![Ok(domain("web", "minute", 3))]));
        let XdsStep::Apply { config, .. } = s.on_response(response("v2", "n2", vec![])) else {
            panic!("applied")
        };
        assert_eq!(config.domains().count(), 0);
    }

    #[test]
    fn another_type_is_ignored_and_changes_nothing() {
        let mut s = session();
        let mut other = response("v9", "n9", vec![]);
        other.type_url = "type.googleapis.com/envoy.config.cluster.v3.Cluster".into();
        assert!(matches!(s.on_response(other), XdsStep::Ignore { .. }));
        assert_eq!(s.accepted_version(), "");
    }

    #[test]
    fn backoff_doubles_to_its_cap_with_a_per_node_jitter_of_at_most_half() {
        let b = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(2),
        };
        for failures in 0..40 {
            let full = Duration::from_millis(100 << failures.min(5)).min(Duration::from_secs(2));
            let d = b.delay(failures, "node-a");
            assert!(d >= full / 2 && d < full, "{failures}: {d:?} of {full:?}");
            assert_eq!(d, b.delay(failures, "node-a"), "deterministic");
        }
        assert_ne!(
            b.delay(3, "node-a"),
            b.delay(3, "node-b"),
            "nodes spread out"
        );
    }
}
