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

/// Encoded `FileDescriptorSet` of our protos, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/ringlimit_descriptor.bin"));
