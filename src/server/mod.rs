//! Wire adapters: one file per API, each mapping its messages onto the layer below and
//! back, and nothing else.
//!
//! - [`ringlimit_v1`]: the public `ringlimit.v1.RateLimiter` (`Check`, `CheckBatch`),
//!   over the wire-independent [`crate::check::Checker`].
//! - [`envoy_rls`]: Envoy's `envoy.service.ratelimit.v3.RateLimitService`
//!   (`ShouldRateLimit`), over the same checker's domain checks.
//! - [`gubernator`]: Gubernator's `pb.gubernator.V1` (`GetRateLimits`, `HealthCheck`),
//!   over the same checker, with limits the requests carry (`serve --gubernator`).
//! - [`peer`]: the node-to-node `ringlimit.peer.v1.Peer` (forwarded checks, refunds,
//!   state handoff, status), over the cluster wing ([`crate::cluster`]).
//! - [`codec`]: the protobuf codec of every generated service, answering a malformed
//!   body `INVALID_ARGUMENT` rather than tonic-prost's `INTERNAL`.
//!
//! This is the edge: the one place an error becomes a `tonic::Status`, so the mapping
//! from "what went wrong" to "what the caller is told" is reviewed in one spot.

pub mod codec;
#[cfg(test)]
mod decode_fuzz;
pub mod envoy_rls;
pub mod gubernator;
pub mod peer;
pub mod peer_auth;
pub mod ringlimit_v1;

use crate::check::CheckError;
use crate::shard::ShardError;
pub use envoy_rls::EnvoyRlsService;
pub use gubernator::GubernatorService;
pub use peer::PeerService;
pub use ringlimit_v1::RateLimitService;

impl From<CheckError> for tonic::Status {
    fn from(error: CheckError) -> Self {
        match &error {
            CheckError::InvalidArgument { .. } => {
                tonic::Status::invalid_argument(error.to_string())
            }
            CheckError::Shard(ShardError::Overloaded(_)) => {
                tonic::Status::resource_exhausted(error.to_string())
            }
            CheckError::Unavailable { .. } => tonic::Status::unavailable(error.to_string()),
            CheckError::Shard(ShardError::Stopped(_)) => {
                tonic::Status::unavailable(error.to_string())
            }
        }
    }
}
