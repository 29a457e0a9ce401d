//! Generated protobuf and gRPC code for `proto/ringlimit.proto` (package `ringlimit.v1`).
//!
//! Kept apart from the decision core: the core never sees these types, so other wire
//! APIs (Envoy's `ShouldRateLimit`, Gubernator's `GetRateLimits`) can map onto it later.
#![allow(missing_docs, clippy::all)]

tonic::include_proto!("ringlimit.v1");

/// The public `ringlimit.v1` server as a node serves it: the same service, generated
/// server side only with the check answers mapped to
/// [`CheckAnswer`](crate::server::ringlimit_v1::CheckAnswer) and
/// [`BatchAnswer`](crate::server::ringlimit_v1::BatchAnswer), which encode the wire
/// messages straight from a verdict (see `build.rs`). Every other type is this module's.
pub mod v1_server {
    include!(concat!(env!("OUT_DIR"), "/v1_server/ringlimit.v1.rs"));
}

/// The node-to-node API (`proto/peer.proto`).
pub mod peer {
    tonic::include_proto!("ringlimit.peer.v1");

    /// Hand-written (strings as slices, words inline: see `build.rs`), under their
    /// proto names.
    pub use crate::cluster::link::{item::ForwardItem, key_state::KeyState};
}

/// Envoy's rate limit service and the types it uses: trimmed copies of the upstream
/// protos (`proto/envoy/`), same package names and field numbers, so every Envoy-based
/// gateway talks to a node unchanged. Only `server::envoy_rls` uses them.
pub mod envoy {
    /// `envoy.service.ratelimit.v3`.
    pub mod service {
        /// `envoy.service.ratelimit.v3`.
        pub mod ratelimit {
            /// `envoy.service.ratelimit.v3`.
            pub mod v3 {
                tonic::include_proto!("envoy.service.ratelimit.v3");
            }
        }
        /// `envoy.service.discovery.v3`: the aggregated discovery stream a node follows
        /// with `serve --envoy-xds`. Only `node::xds`'s adapter files use it.
        pub mod discovery {
            /// `envoy.service.discovery.v3`.
            pub mod v3 {
                tonic::include_proto!("envoy.service.discovery.v3");
            }
        }
    }
    /// `envoy.extensions.common.ratelimit.v3`.
    pub mod extensions {
        /// `envoy.extensions.common.ratelimit.v3`.
        pub mod common {
            /// `envoy.extensions.common.ratelimit.v3`.
            pub mod ratelimit {
                /// `envoy.extensions.common.ratelimit.v3`.
                pub mod v3 {
                    tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                }
            }
        }
    }
    /// `envoy.type.v3`.
    pub mod r#type {
        /// `envoy.type.v3`.
        pub mod v3 {
            tonic::include_proto!("envoy.r#type.v3");
        }
    }
    /// `envoy.config.core.v3`.
    pub mod config {
        /// `envoy.config.core.v3`.
        pub mod core {
            /// `envoy.config.core.v3`.
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
}

/// `google.rpc.Status`: the error a NACK carries (trimmed, `proto/google/rpc/`).
pub mod google {
    /// `google.rpc`.
    pub mod rpc {
        tonic::include_proto!("google.rpc");
    }
}

/// envoyproxy/ratelimit's configuration resource (`ratelimit.config.ratelimit.v3`,
/// `proto/ratelimit/`), as control planes send it over xDS. Only `node::xds`'s adapter
/// files use it.
pub mod ratelimit {
    /// `ratelimit.config.ratelimit.v3`.
    pub mod config {
        /// `ratelimit.config.ratelimit.v3`.
        pub mod ratelimit {
            /// `ratelimit.config.ratelimit.v3`.
            pub mod v3 {
                tonic::include_proto!("ratelimit.config.ratelimit.v3");
            }
        }
    }
}

/// Gubernator's V1 API (`pb.gubernator`): a trimmed copy of upstream's
/// `gubernator.proto` (`proto/gubernator/`), same package, field numbers and enum
/// values, so Gubernator's clients talk to a node unchanged. Only `server::gubernator`
/// uses it.
pub mod gubernator {
    tonic::include_proto!("pb.gubernator");
}

/// Encoded `FileDescriptorSet` of the public protos (not the peer API, not Gubernator's), for gRPC
/// server reflection on the public listener.
pub const PUBLIC_FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/public_descriptor.bin"));

/// Encoded `FileDescriptorSet` of Gubernator's V1 API, for reflection on a node that
/// serves it (`serve --gubernator`).
pub const GUBERNATOR_FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/gubernator_descriptor.bin"));
