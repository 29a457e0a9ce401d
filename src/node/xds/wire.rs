//! The xDS adapter: `DiscoveryResponse` and `RateLimitConfig` (prost) to the session's
//! domain types, and its requests back to `DiscoveryRequest`. Nothing is decided here: a
//! resource is converted field for field as envoyproxy/ratelimit's own provider converts
//! it to its YAML shape (`ConfigXdsProtoToYaml`), so [`EnvoyConfig::from_domains`]
//! checks it exactly as it checks a YAML file.
//!
//! [`EnvoyConfig::from_domains`]: crate::config::rules::envoy::EnvoyConfig::from_domains

use prost::Message;

use crate::config::rules::envoy::{DescriptorDoc, DomainDoc, RateLimitDoc, ReplaceDoc};
use crate::config::xds::{XdsRequest, XdsResource, XdsResponse, NACK_CODE, RATE_LIMIT_CONFIG_TYPE};
use crate::proto::envoy::config::core::v3::{node::UserAgentVersionType, Node};
use crate::proto::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use crate::proto::google::rpc::Status;
use crate::proto::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};

/// Who this node is to the control plane: `node.id` is the node id, `node.cluster` the
/// gossip cluster id (the nodes a control plane should configure alike).
#[derive(Debug, Clone)]
pub struct Identity {
    /// `--node-id`.
    pub node_id: String,
    /// `--cluster-id`.
    pub cluster: String,
}

/// The `DiscoveryRequest` for `request`.
pub fn request(request: &XdsRequest, identity: &Identity) -> DiscoveryRequest {
    DiscoveryRequest {
        version_info: request.version_info.clone(),
        node: Some(Node {
            id: identity.node_id.clone(),
            cluster: identity.cluster.clone(),
            user_agent_name: "ringlimit".into(),
            user_agent_version_type: Some(UserAgentVersionType::UserAgentVersion(
                env!("CARGO_PKG_VERSION").into(),
            )),
        }),
        resource_names: Vec::new(),
        type_url: RATE_LIMIT_CONFIG_TYPE.into(),
        response_nonce: request.response_nonce.clone(),
        error_detail: request.error.as_ref().map(|message| Status {
            code: NACK_CODE,
            message: message.clone(),
            details: Vec::new(),
        }),
    }
}

/// The session's view of `response`: each resource decoded, or why it could not be.
pub fn response(response: DiscoveryResponse) -> XdsResponse {
    XdsResponse {
        version_info: response.version_info,
        nonce: response.nonce,
        type_url: response.type_url,
        resources: response
            .resources
            .into_iter()
            .map(|any| {
                if any.type_url != RATE_LIMIT_CONFIG_TYPE {
                    return XdsResource {
                        name: String::new(),
                        domain: Err(format!(
                            "a {:?}, not a {RATE_LIMIT_CONFIG_TYPE:?}",
                            any.type_url
                        )),
                    };
                }
                match RateLimitConfig::decode(any.value.as_slice()) {
                    Ok(config) => XdsResource {
                        name: config.name.clone(),
                        domain: domain(config),
                    },
                    Err(error) => XdsResource {
                        name: String::new(),
                        domain: Err(format!("not a RateLimitConfig: {error}")),
                    },
                }
            })
            .collect(),
    }
}

/// One `RateLimitConfig` as the domain document the YAML file would hold.
pub fn domain(config: RateLimitConfig) -> Result<DomainDoc, String> {
    Ok(DomainDoc {
        domain: config.domain,
        descriptors: descriptors(config.descriptors, "descriptors")?,
    })
}

fn descriptors(list: Vec<RateLimitDescriptor>, at: &str) -> Result<Vec<DescriptorDoc>, String> {
    list.into_iter()
        .enumerate()
        .map(|(i, d)| descriptor(d, &format!("{at}[{i}]")))
        .collect()
}

fn descriptor(d: RateLimitDescriptor, at: &str) -> Result<DescriptorDoc, String> {
    Ok(DescriptorDoc {
        key: d.key,
        // proto3 has no absent string: "" is a value-less key, as for envoyproxy/ratelimit.
        value: (!d.value.is_empty()).then_some(d.value),
        rate_limit: d
            .rate_limit
            .map(|p| policy(p, &format!("{at}.rate_limit")))
            .transpose()?,
        shadow_mode: d.shadow_mode,
        quota_mode: d.quota_mode,
        detailed_metric: d.detailed_metric,
        share_threshold: false,
        descriptors: descriptors(d.descriptors, &format!("{at}.descriptors"))?,
    })
}

fn policy(p: RateLimitPolicy, at: &str) -> Result<RateLimitDoc, String> {
    let unit = match RateLimitUnit::try_from(p.unit) {
        Ok(RateLimitUnit::Unknown) => None,
        // MONTH and YEAR pass through to be refused with the YAML parser's message.
        Ok(unit) => Some(unit.as_str_name().to_ascii_lowercase()),
        Err(_) => return Err(format!("{at}.unit: {} is not a RateLimitUnit", p.unit)),
    };
    // An unlimited policy leaves unit and count at their zero values; a YAML one omits
    // them. Anything else keeps its count, 0 included (deny all, as the reference).
    let requests_per_unit =
        (!(p.unlimited && p.requests_per_unit == 0)).then_some(u64::from(p.requests_per_unit));
    Ok(RateLimitDoc {
        unit,
        requests_per_unit,
        unlimited: p.unlimited,
        name: (!p.name.is_empty()).then_some(p.name),
        replaces: p
            .replaces
            .into_iter()
            .map(|r| ReplaceDoc { name: r.name })
            .collect(),
        algorithm: None,
        on_unavailable: None,
        partition: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::AlgorithmKind;
    use crate::config::rules::envoy::EnvoyConfig;
    use crate::proto::ratelimit::config::ratelimit::v3::RateLimitReplace;

    fn limit(unit: RateLimitUnit, requests: u32) -> Option<RateLimitPolicy> {
        Some(RateLimitPolicy {
            unit: unit as i32,
            requests_per_unit: requests,
            ..Default::default()
        })
    }

    fn node(key: &str, value: &str, rate_limit: Option<RateLimitPolicy>) -> RateLimitDescriptor {
        RateLimitDescriptor {
            key: key.into(),
            value: value.into(),
            rate_limit,
            ..Default::default()
        }
    }

    /// The README's kind of domain, every field ringlimit reads from a resource.
    fn resource() -> RateLimitConfig {
        let mut per_user = node("user", "", limit(RateLimitUnit::Minute, 10));
        per_user.shadow_mode = true;
        let mut named = limit(RateLimitUnit::Hour, 100);
        if let Some(p) = named.as_mut() {
            p.name = "per-path".into();
            p.replaces = vec![RateLimitReplace {
                name: "global".into(),
            }];
        }
        let mut path = node("path", "/api/*", named);
        path.detailed_metric = true;
        path.descriptors = vec![per_user];
        RateLimitConfig {
            name: "web-config".into(),
            domain: "web".into(),
            descriptors: vec![
                path,
                node("remote_address", "", limit(RateLimitUnit::Second, 5)),
                node(
                    "internal",
                    "true",
                    Some(RateLimitPolicy {
                        unlimited: true,
                        ..Default::default()
                    }),
                ),
                node("blocked", "yes", limit(RateLimitUnit::Day, 0)),
            ],
        }
    }

    const YAML: &str = r#"
domain: web
descriptors:
  - key: path
    value: /api/*
    detailed_metric: true
    rate_limit:
      unit: hour
      requests_per_unit: 100
      name: per-path
      replaces:
        - name: global
    descriptors:
      - key: user
        shadow_mode: true
        rate_limit: {unit: minute, requests_per_unit: 10}
  - key: remote_address
    rate_limit: {requests_per_unit: 5, unit: second}
  - key: internal
    value: "true"
    rate_limit: {unlimited: true}
  - key: blocked
    value: "yes"
    rate_limit: {unit: day, requests_per_unit: 0}
"#;

    #[test]
    fn a_resource_and_the_same_domain_in_yaml_have_one_digest() {
        for algorithm in [
            AlgorithmKind::FixedWindow,
            AlgorithmKind::SlidingWindowCounter,
        ] {
            let from_yaml = EnvoyConfig::from_yaml_str(YAML, algorithm).unwrap();
            let doc = domain(resource()).unwrap();
            let from_xds =
                EnvoyConfig::from_domains(vec![("resources[0]".into(), doc)], algorithm).unwrap();
            assert_eq!(from_xds.digest(), from_yaml.digest(), "{algorithm:?}");
        }
        // And a change in the resource is a change of digest.
        let mut other = resource();
        other.descriptors[1].rate_limit = limit(RateLimitUnit::Second, 6);
        let other = EnvoyConfig::from_domains(
            vec![("r".into(), domain(other).unwrap())],
            AlgorithmKind::FixedWindow,
        )
        .unwrap();
        let yaml = EnvoyConfig::from_yaml_str(YAML, AlgorithmKind::FixedWindow).unwrap();
        assert_ne!(other.digest(), yaml.digest());
    }

    #[test]
    fn a_response_decodes_every_resource_and_names_the_bad_ones() {
        let good = prost_types::Any {
            type_url: RATE_LIMIT_CONFIG_TYPE.into(),
            value: resource().encode_to_vec(),
        };
        let wrong_type = prost_types::Any {
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            value: vec![],
        };
        let garbage = prost_types::Any {
            type_url: RATE_LIMIT_CONFIG_TYPE.into(),
            value: vec![0xff, 0xff, 0xff],
        };
        let read = response(DiscoveryResponse {
            version_info: "7".into(),
            resources: vec![good, wrong_type, garbage],
            canary: false,
            type_url: RATE_LIMIT_CONFIG_TYPE.into(),
            nonce: "n".into(),
        });
        assert_eq!(
            (read.version_info.as_str(), read.nonce.as_str()),
            ("7", "n")
        );
        assert_eq!(read.resources[0].name, "web-config");
        assert_eq!(read.resources[0].domain, domain(resource()));
        let wrong = read.resources[1].domain.as_ref().unwrap_err();
        assert!(wrong.contains("envoy.config.cluster.v3.Cluster"), "{wrong}");
        let garbage = read.resources[2].domain.as_ref().unwrap_err();
        assert!(garbage.starts_with("not a RateLimitConfig"), "{garbage}");
    }

    #[test]
    fn quota_mode_is_carried_and_fields_ringlimit_cannot_honour_are_refused_with_their_path() {
        let mut quota = resource();
        quota.descriptors[0].descriptors[0].quota_mode = true;
        let doc = domain(quota).unwrap();
        assert!(
            doc.descriptors[0].descriptors[0].quota_mode,
            "quota_mode is carried to the domain"
        );
        let mut unit = resource();
        unit.descriptors[1].rate_limit.as_mut().unwrap().unit = 42;
        let e = domain(unit).unwrap_err();
        assert_eq!(
            e,
            "descriptors[1].rate_limit.unit: 42 is not a RateLimitUnit"
        );
        // MONTH converts, and is refused by the checks every YAML file goes through.
        let mut month = resource();
        month.descriptors[1].rate_limit = limit(RateLimitUnit::Month, 1);
        let e = EnvoyConfig::from_domains(
            vec![("r".into(), domain(month).unwrap())],
            AlgorithmKind::FixedWindow,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("descriptors[1].rate_limit.unit") && e.contains("at most 7 days"),
            "{e}"
        );
        // No unit on a counted limit: the YAML message for a missing unit.
        let mut unknown = resource();
        unknown.descriptors[1].rate_limit = limit(RateLimitUnit::Unknown, 1);
        let e = EnvoyConfig::from_domains(
            vec![("r".into(), domain(unknown).unwrap())],
            AlgorithmKind::FixedWindow,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("descriptors[1].rate_limit.unit: required"),
            "{e}"
        );
    }

    #[test]
    fn requests_carry_the_identity_the_type_and_a_nack_its_reason() {
        let who = Identity {
            node_id: "node-1".into(),
            cluster: "prod".into(),
        };
        let ack = request(
            &XdsRequest {
                version_info: "3".into(),
                response_nonce: "n3".into(),
                error: None,
            },
            &who,
        );
        let node = ack.node.as_ref().unwrap();
        assert_eq!(
            (node.id.as_str(), node.cluster.as_str()),
            ("node-1", "prod")
        );
        assert_eq!(ack.type_url, RATE_LIMIT_CONFIG_TYPE);
        assert!(ack.resource_names.is_empty(), "a wildcard subscription");
        assert_eq!(
            (ack.version_info.as_str(), ack.response_nonce.as_str()),
            ("3", "n3")
        );
        assert!(ack.error_detail.is_none());
        let nack = request(
            &XdsRequest {
                version_info: "3".into(),
                response_nonce: "n4".into(),
                error: Some("bad".into()),
            },
            &who,
        );
        let status = nack.error_detail.unwrap();
        assert_eq!((status.code, status.message.as_str()), (NACK_CODE, "bad"));
    }
}
