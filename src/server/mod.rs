//! Wire adapters: one file per API, each mapping its messages onto the layer below and
//! back, and nothing else.
//!
//! - [`ringlimit_v1`]: the public `ringlimit.v1.RateLimiter` (`Check`, `CheckBatch`),
//!   over the wire-independent [`crate::check::Checker`]; its hand-written wire codec is
//!   [`ringlimit_v1_wire`].
//! - [`envoy_rls`]: Envoy's `envoy.service.ratelimit.v3.RateLimitService`
//!   (`ShouldRateLimit`), over the same checker's domain checks.
//! - [`gubernator`]: Gubernator's `pb.gubernator.V1` (`GetRateLimits`, `HealthCheck`),
//!   over the same checker, with limits the requests carry (`serve --gubernator`).
//! - [`peer`]: the node-to-node `ringlimit.peer.v1.Peer` (forwarded checks, refunds,
//!   state handoff, status), over the cluster wing ([`crate::cluster`]).
//! - [`ops`]: the ops face, HTTP: metrics, health, readiness, cluster status, key
//!   owners and the rules API (admin token for writes).
//! - [`http_check`]: the HTTP check face (`--check-http-listen`): JSON checks and the
//!   forward-auth endpoint of nginx, Caddy, Traefik and ingress-nginx, whose
//!   subrequests [`forward_auth`] reads (client key, trusted proxies, route).
//! - [`resp`]: the RESP face for Redis clients (redis-cell's `CL.THROTTLE`), on a
//!   listener of its own (`serve --resp-listen`), over the same checker.
//! - [`front`]: what every public front end does around its mapping (timing, the
//!   answer budget).
//! - [`codec`]: the protobuf codec of every generated service, answering a malformed
//!   body `INVALID_ARGUMENT` rather than tonic-prost's `INTERNAL`.
//!
//! This is the edge: the one place an error becomes a `tonic::Status`, so the mapping
//! from "what went wrong" to "what the caller is told" is reviewed in one spot.

pub mod answer_budget;
pub mod codec;
#[cfg(test)]
mod decode_fuzz;
pub mod envoy_rls;
pub mod forward_auth;
pub mod front;
pub mod gubernator;
pub mod http_check;
pub mod ops;
pub mod peer;
pub mod peer_auth;
pub mod resp;
pub mod ringlimit_v1;
pub mod ringlimit_v1_wire;

use crate::check::CheckError;
use crate::shard::ShardError;
pub use envoy_rls::EnvoyRlsService;
pub use gubernator::GubernatorService;
pub use peer::PeerService;
pub use ringlimit_v1::RateLimitService;

/// The last segment of a field path, indices dropped: `checks[3].descriptors[0].key` →
/// `key`, `items` → `items`.
fn field_label(path: &str) -> String {
    let last = path.rsplit('.').next().unwrap_or(path);
    let name = last.split('[').next().unwrap_or(last);
    // Front ends build paths from their own field names; anything else is cut short.
    name.chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
        .take(32)
        .collect()
}

impl From<CheckError> for tonic::Status {
    /// Every refusal of every front end passes here, so this is where refusals are
    /// counted: `ringlimit_refused_total{reason, field}`, `field` being the name of the
    /// offending field without its path or indices (`descriptors[2].cost` → `cost`), a
    /// set fixed by the protos, so the label stays bounded whatever a client sends.
    fn from(error: CheckError) -> Self {
        let (reason, field) = match &error {
            CheckError::InvalidArgument { field, .. } => ("invalid_argument", field_label(field)),
            CheckError::Shard(ShardError::Overloaded(_)) => ("overloaded", String::new()),
            CheckError::Shard(ShardError::Stopped(_)) => ("unavailable", String::new()),
            CheckError::Shard(ShardError::Restoring) => ("restoring", String::new()),
            CheckError::Unavailable { .. } | CheckError::Unreachable(_) => {
                ("owner_unreachable", String::new())
            }
            CheckError::Refused { field, .. } => ("refused", field_label(field)),
            CheckError::Exhausted(_) => ("full", String::new()),
        };
        metrics::counter!("ringlimit_refused_total", "reason" => reason, "field" => field)
            .increment(1);
        let mut status = match &error {
            CheckError::InvalidArgument { .. } => {
                tonic::Status::invalid_argument(error.to_string())
            }
            CheckError::Shard(ShardError::Overloaded(_)) => {
                tonic::Status::resource_exhausted(error.to_string())
            }
            CheckError::Unavailable { .. } | CheckError::Unreachable(_) => {
                tonic::Status::unavailable(error.to_string())
            }
            CheckError::Refused { .. } => tonic::Status::failed_precondition(error.to_string()),
            CheckError::Exhausted(_) => tonic::Status::resource_exhausted(error.to_string()),
            CheckError::Shard(ShardError::Stopped(_) | ShardError::Restoring) => {
                tonic::Status::unavailable(error.to_string())
            }
        };
        // The same reason, machine-readable: a client tells "overloaded, try another
        // node" from "your request is wrong" (both can be RESOURCE_EXHAUSTED: an
        // over-size message is too) without parsing the message text.
        status.metadata_mut().insert(
            REASON_METADATA,
            tonic::metadata::MetadataValue::from_static(reason),
        );
        status
    }
}

/// The trailer every refusal carries: why, as in `ringlimit_refused_total{reason}`
/// (`invalid_argument`, `overloaded`, `unavailable`, `owner_unreachable`, `refused`,
/// `full`).
pub const REASON_METADATA: &str = "ringlimit-reason";

#[cfg(test)]
mod tests {
    #[test]
    fn refusal_labels_name_the_field_without_path_or_index() {
        assert_eq!(super::field_label("descriptors[2].cost"), "cost");
        assert_eq!(super::field_label("checks[3].descriptors[0].key"), "key");
        assert_eq!(super::field_label("items"), "items");
        assert_eq!(super::field_label("checks[12]"), "checks");
    }

    #[test]
    fn every_refusal_names_its_reason_in_a_trailer() {
        use crate::check::CheckError;
        let overloaded: tonic::Status =
            CheckError::Shard(crate::shard::ShardError::Overloaded(3)).into();
        assert_eq!(overloaded.code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            overloaded.metadata().get(super::REASON_METADATA).unwrap(),
            "overloaded"
        );
        let invalid: tonic::Status = CheckError::InvalidArgument {
            field: "key".into(),
            reason: "empty".into(),
        }
        .into();
        assert_eq!(
            invalid.metadata().get(super::REASON_METADATA).unwrap(),
            "invalid_argument"
        );
    }
}
