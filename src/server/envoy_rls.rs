//! The `envoy.service.ratelimit.v3.RateLimitService` front end: `ShouldRateLimit` mapped
//! onto [`Checker::check_domain`], and its [`DomainVerdict`] mapped back. Nothing else:
//! validation, matching, hits, overrides, replaces and refunds are the check layer's
//! (`check::domain`).
//!
//! Wire details that are this API's own:
//!
//! - `duration_until_reset` is rounded up to whole seconds: Envoy drops the nanos when it
//!   renders `X-RateLimit-Reset`, and a reset rounded down would invite an early retry;
//! - `limit_remaining` and `requests_per_unit` are uint32 on the wire: larger numbers are
//!   reported as `u32::MAX`;
//! - with [`EnvoyRlsService::with_headers`] (`serve --envoy-headers`), the response asks
//!   Envoy to add `Retry-After` (on OVER_LIMIT, seconds rounded up) and the IETF
//!   `RateLimit-Policy` / `RateLimit` fields in the latest draft's syntax
//!   (draft-ietf-httpapi-ratelimit-headers-11), which Envoy cannot render itself.

use tonic::{Request, Response, Status};

use super::front::Front;

use crate::check::{
    Checker, DomainInput, DomainStatus, DomainVerdict, EntriesInput, LimitOverride,
};
use crate::config::rules::envoy::EnvoyUnit;
use crate::proto::envoy::config::core::v3::HeaderValue;
use crate::proto::envoy::r#type::v3::RateLimitUnit;
use crate::proto::envoy::service::ratelimit::v3::{
    rate_limit_response::{rate_limit, Code, DescriptorStatus, RateLimit},
    rate_limit_service_server, RateLimitRequest, RateLimitResponse,
};

/// Envoy's rate limit service on the public face of a node.
#[derive(Debug, Clone)]
pub struct EnvoyRlsService {
    checker: Checker,
    headers: bool,
    front: Front,
}

impl EnvoyRlsService {
    /// A service deciding through `checker` (which must have the Envoy configuration:
    /// [`Checker::with_envoy`]).
    pub fn new(checker: Checker) -> Self {
        Self {
            checker,
            headers: false,
            front: Front::new("ringlimit_envoy_rls_duration_seconds"),
        }
    }

    /// Also answer `Retry-After`, `RateLimit-Policy` and `RateLimit` headers for Envoy to
    /// add to the response.
    pub fn with_headers(mut self, headers: bool) -> Self {
        self.headers = headers;
        self
    }
}

fn unit_of(wire: i32) -> Option<EnvoyUnit> {
    match RateLimitUnit::try_from(wire).ok()? {
        RateLimitUnit::Second => Some(EnvoyUnit::Second),
        RateLimitUnit::Minute => Some(EnvoyUnit::Minute),
        RateLimitUnit::Hour => Some(EnvoyUnit::Hour),
        RateLimitUnit::Day => Some(EnvoyUnit::Day),
        RateLimitUnit::Unknown | RateLimitUnit::Month | RateLimitUnit::Year => None,
    }
}

fn wire_unit(unit: EnvoyUnit) -> rate_limit::Unit {
    match unit {
        EnvoyUnit::Second => rate_limit::Unit::Second,
        EnvoyUnit::Minute => rate_limit::Unit::Minute,
        EnvoyUnit::Hour => rate_limit::Unit::Hour,
        EnvoyUnit::Day => rate_limit::Unit::Day,
        EnvoyUnit::Week => rate_limit::Unit::Week,
    }
}

/// The check input of one request, borrowed from it.
pub(super) fn input(request: &RateLimitRequest) -> DomainInput<'_> {
    DomainInput {
        domain: &request.domain,
        hits: request.hits_addend,
        descriptors: request
            .descriptors
            .iter()
            .map(|d| EntriesInput {
                entries: d
                    .entries
                    .iter()
                    .map(|e| (e.key.as_str(), e.value.as_str()))
                    .collect(),
                hits: d.hits_addend,
                limit: d.limit.as_ref().map(|o| LimitOverride {
                    requests_per_unit: o.requests_per_unit,
                    unit: unit_of(o.unit),
                }),
            })
            .collect(),
    }
}

fn seconds_up(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

fn u32_sat(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn status(s: &DomainStatus) -> DescriptorStatus {
    DescriptorStatus {
        code: if s.ok { Code::Ok } else { Code::OverLimit } as i32,
        current_limit: s.limit.as_ref().map(|l| RateLimit {
            name: l.name.to_string(),
            requests_per_unit: l.requests_per_unit,
            unit: wire_unit(l.unit) as i32,
        }),
        limit_remaining: if s.limit.is_some() || s.unlimited {
            u32_sat(s.remaining)
        } else {
            0
        },
        duration_until_reset: s.limit.as_ref().map(|_| prost_types::Duration {
            seconds: seconds_up(s.reset_after_ms).min(i64::MAX as u64) as i64,
            nanos: 0,
        }),
    }
}

/// The headers of the most restrictive limited status: the denying one with the longest
/// wait, else the one with the least remaining.
fn headers(verdict: &DomainVerdict) -> Vec<HeaderValue> {
    let limited = verdict.statuses.iter().filter(|s| s.limit.is_some());
    let top = if verdict.ok {
        limited.min_by_key(|s| s.remaining)
    } else {
        limited.filter(|s| !s.ok).max_by_key(|s| s.retry_after_ms)
    };
    let Some(top) = top else {
        return Vec::new();
    };
    let limit = top.limit.as_ref().expect("filtered on a limit");
    let header = |key: &str, value: String| HeaderValue {
        key: key.into(),
        value,
        raw_value: Vec::new(),
    };
    // The latest draft's syntax, as every face renders it
    // (`ringlimit_client::contract::ietf_fields`): the policy is a Structured Field String.
    let name = ringlimit_client::contract::sf_string(&limit.name);
    let mut out = vec![
        header(
            "ratelimit-policy",
            format!(
                "{name};q={};w={}",
                limit.requests_per_unit,
                limit.unit.window().as_secs()
            ),
        ),
        header(
            "ratelimit",
            format!(
                "{name};r={};t={}",
                top.remaining,
                seconds_up(top.reset_after_ms)
            ),
        ),
    ];
    if !verdict.ok {
        out.push(header(
            "retry-after",
            seconds_up(top.retry_after_ms).max(1).to_string(),
        ));
    }
    out
}

/// The wire answer for a verdict.
pub(super) fn response(verdict: &DomainVerdict, with_headers: bool) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: if verdict.ok {
            Code::Ok
        } else {
            Code::OverLimit
        } as i32,
        statuses: verdict.statuses.iter().map(status).collect(),
        response_headers_to_add: if with_headers {
            headers(verdict)
        } else {
            Vec::new()
        },
        request_headers_to_add: Vec::new(),
        raw_body: Vec::new(),
    }
}

#[tonic::async_trait]
impl rate_limit_service_server::RateLimitService for EnvoyRlsService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let timed = self.front.start();
        let request = request.into_inner();
        let verdict = self.checker.check_domain(&input(&request)).await?;
        Ok(timed.answered(response(&verdict, self.headers)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::domain::plan_domain;
    use crate::check::CheckError;
    use crate::config::rules::envoy::EnvoyConfig;
    use crate::proto::envoy::extensions::common::ratelimit::v3::{
        rate_limit_descriptor::{Entry, RateLimitOverride},
        RateLimitDescriptor,
    };

    fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: k.to_string(),
                    value: v.to_string(),
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn an_undefined_month_or_unknown_override_unit_is_refused_by_field() {
        let config = EnvoyConfig::default();
        for unit in [0, 5, 6, 99] {
            let mut d = descriptor(&[("k", "v")]);
            d.limit = Some(RateLimitOverride {
                requests_per_unit: 1,
                unit,
            });
            let request = RateLimitRequest {
                domain: "d".into(),
                descriptors: vec![d],
                hits_addend: 0,
            };
            let planned = plan_domain(&input(&request), &config);
            match planned {
                Err(CheckError::InvalidArgument { field, .. }) => {
                    assert_eq!(field, "descriptors[0].limit.unit", "unit {unit}")
                }
                other => panic!("unit {unit}: {other:?}"),
            }
        }
    }

    #[test]
    fn resets_round_up_to_whole_seconds_and_numbers_saturate() {
        assert_eq!(seconds_up(0), 0);
        assert_eq!(seconds_up(1), 1);
        assert_eq!(seconds_up(1000), 1);
        assert_eq!(seconds_up(1001), 2);
        assert_eq!(u32_sat(u64::MAX), u32::MAX);
    }

    #[test]
    fn an_unmatched_descriptor_has_no_current_limit_and_headers_follow_the_tightest() {
        let limit = crate::config::rules::envoy::EnvoyLimit {
            rule: None,
            requests_per_unit: 10,
            unit: EnvoyUnit::Minute,
            name: "per_ip".into(),
            configured_name: None,
            replaces: vec![],
            shadow: false,
            quota: false,
        };
        let open = DomainStatus {
            ok: true,
            limit: None,
            remaining: 0,
            reset_after_ms: 0,
            retry_after_ms: 0,
            shadow_denied: false,
            unlimited: false,
            degraded: false,
        };
        let denied = DomainStatus {
            ok: false,
            limit: Some(limit),
            remaining: 0,
            reset_after_ms: 1_500,
            retry_after_ms: 1_200,
            ..open.clone()
        };
        let verdict = DomainVerdict {
            ok: false,
            statuses: vec![open, denied],
        };
        let r = response(&verdict, true);
        assert_eq!(r.overall_code, Code::OverLimit as i32);
        assert!(r.statuses[0].current_limit.is_none());
        assert_eq!(r.statuses[0].code, Code::Ok as i32);
        assert_eq!(r.statuses[1].duration_until_reset.unwrap().seconds, 2);
        let h: Vec<(String, String)> = r
            .response_headers_to_add
            .iter()
            .map(|h| (h.key.clone(), h.value.clone()))
            .collect();
        assert!(h.contains(&("retry-after".into(), "2".into())), "{h:?}");
        assert!(h.contains(&("ratelimit-policy".into(), "\"per_ip\";q=10;w=60".into())));
        assert!(h.contains(&("ratelimit".into(), "\"per_ip\";r=0;t=2".into())));
        assert!(response(&verdict, false).response_headers_to_add.is_empty());
    }
}
