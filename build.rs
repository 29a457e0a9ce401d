//! Compiles `proto/` with the pure-Rust `protox` compiler, so building ringlimit
//! needs no `protoc` on the machine. The public protos' descriptor set is also
//! written out for gRPC server reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The public protos: ringlimit's own, Envoy's rate limit service and Gubernator's V1
    // (trimmed copies of the upstream files under proto/envoy/ and proto/gubernator/,
    // same packages and field numbers).
    let public_protos = [
        "proto/ringlimit.proto",
        "proto/envoy/service/ratelimit/v3/rls.proto",
        "proto/gubernator/gubernator.proto",
    ];
    let imported = [
        "proto/envoy/extensions/common/ratelimit/v3/ratelimit.proto",
        "proto/envoy/type/v3/ratelimit_unit.proto",
        "proto/envoy/config/core/v3/base.proto",
        "proto/envoy/service/discovery/v3/discovery.proto",
        "proto/google/rpc/status.proto",
    ];
    // The xDS client's protos (`serve --envoy-xds`): the aggregated discovery stream and
    // envoyproxy/ratelimit's RateLimitConfig resource. A node is their client, so they are
    // not in the public descriptor set; the generated server is what tests' control
    // planes serve.
    let protos = [
        public_protos[0],
        public_protos[1],
        public_protos[2],
        "proto/peer.proto",
        "proto/envoy/service/discovery/v3/ads.proto",
        "proto/ratelimit/config/ratelimit/v3/rls_conf.proto",
    ];
    for p in protos.iter().chain(&imported) {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // Reflection on the public listener describes the public services only: the peer
    // API is the cluster face and is not advertised to gateways.
    // The set includes the files they import (Envoy's, and google/protobuf's
    // duration and wrappers), so reflection clients can resolve every type.
    // Gubernator's face is served only on request (`serve --gubernator`), so its
    // descriptors are a set of their own, registered only when it is served.
    let public = protox::compile(&public_protos[..2], ["proto"])?;
    std::fs::write(
        out.join("public_descriptor.bin"),
        prost::Message::encode_to_vec(&public),
    )?;
    let gubernator = protox::compile(&public_protos[2..], ["proto"])?;
    std::fs::write(
        out.join("gubernator_descriptor.bin"),
        prost::Message::encode_to_vec(&gubernator),
    )?;
    // Every message implements `prost::Name`, so the server codec can name the message
    // a malformed request failed to decode as (`ringlimit.v1.CheckRequest: ...`).
    let mut prost_config = prost_build::Config::new();
    prost_config.enable_type_names();
    // A forwarded check's strings are slices, not `String`s, on both sides of the peer
    // link: the message is hand-written (see `cluster::link::item`).
    prost_config.extern_path(
        ".ringlimit.peer.v1.ForwardItem",
        "crate::cluster::link::item::ForwardItem",
    );
    // Likewise a replicated or handed-over counter's state (`cluster::link::key_state`).
    prost_config.extern_path(
        ".ringlimit.peer.v1.KeyState",
        "crate::cluster::link::key_state::KeyState",
    );
    tonic_prost_build::configure()
        .codec_path("crate::server::codec::NamedProstCodec")
        .compile_fds_with_config(fds, prost_config)?;

    // The public `ringlimit.v1` server a second time, server side only, with the check
    // answers mapped to types of `server::ringlimit_v1` that encode themselves straight
    // from the verdict (no per-field String copies: see `server::codec::AnswerCodec`),
    // and the check requests to types whose strings are slices of the received body.
    // Every other message is the one generated above (`crate::proto`), so clients and
    // the wire format are unchanged.
    let lean = out.join("v1_server");
    std::fs::create_dir_all(&lean)?;
    let mut lean_config = prost_build::Config::new();
    lean_config
        .extern_path(".ringlimit.v1", "crate::proto")
        .extern_path(
            ".ringlimit.v1.CheckResponse",
            "crate::server::ringlimit_v1::CheckAnswer",
        )
        .extern_path(
            ".ringlimit.v1.CheckBatchResponse",
            "crate::server::ringlimit_v1::BatchAnswer",
        )
        .extern_path(
            ".ringlimit.v1.CheckRequest",
            "crate::server::ringlimit_v1::V1Request",
        )
        .extern_path(
            ".ringlimit.v1.CheckBatchRequest",
            "crate::server::ringlimit_v1::V1BatchRequest",
        )
        .extern_path(
            ".ringlimit.v1.ReserveResponse",
            "crate::server::ringlimit_v1::ReserveAnswer",
        )
        // The same layout (check = 1, id = 2, expires_at = 3), written by the same type.
        .extern_path(
            ".ringlimit.v1.AcquireResponse",
            "crate::server::ringlimit_v1::ReserveAnswer",
        );
    tonic_prost_build::configure()
        .build_client(false)
        .out_dir(&lean)
        .codec_path("crate::server::codec::AnswerCodec")
        .compile_fds_with_config(
            protox::compile(["proto/ringlimit.proto"], ["proto"])?,
            lean_config,
        )?;
    Ok(())
}
