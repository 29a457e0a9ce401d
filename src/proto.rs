//! Generated protobuf and gRPC code for `proto/ringlimit.proto` (package `ringlimit.v1`).
//!
//! Kept apart from the decision core: the core never sees these types, so other wire
//! APIs (Envoy's `ShouldRateLimit`, Gubernator's `GetRateLimits`) can map onto it later.
#![allow(missing_docs, clippy::all)]

tonic::include_proto!("ringlimit.v1");

/// The node-to-node API (`proto/peer.proto`).
pub mod peer {
    tonic::include_proto!("ringlimit.peer.v1");
}

/// Encoded `FileDescriptorSet` of the public protos (not the peer API), for gRPC
/// server reflection on the public listener.
pub const PUBLIC_FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/public_descriptor.bin"));
