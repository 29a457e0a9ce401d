//! Heap allocations per check, counted by a global allocator wrapper (not timed).
//!
//! `cargo bench --bench allocations` starts nodes in this process and prints
//! allocations and bytes per check, measured two ways.
//!
//! In-process service calls (the public `ringlimit.v1` service called directly: no
//! HTTP/2, no client; the request's two strings are built in the measured loop):
//!
//! - local: a unary `Check` whose key this node owns;
//! - batch: `CheckBatch` of 32 local checks, per check;
//! - forwarded: a unary `Check` sent to a node that does not own the key, so it goes one
//!   hop over the real peer link (a framed connection; an HTTP/2 stream with
//!   `RINGLIMIT_BENCH_FORWARD_HTTP2=1`) to its owner in the same process: entry and
//!   owner together.
//!
//! Over real HTTP/2 on loopback (issue 14's yardstick: a local check may cost at most 6
//! allocations more than tonic's own health check on the same server): the bench's lean
//! h2 client (`src/bench/lean.rs`, one connection, requests encoded from prebuilt
//! messages) calls `grpc.health.v1.Health/Check` and then a local `Check`. Both figures
//! include the client's allocations and the whole server stack (hyper, tonic, the
//! node's layers). The client does the same work for both calls except decoding the
//! answer, a check's being larger (its strings and descriptor list): that part is
//! measured alone (decoding the same answers, counted the same way) and taken out, so
//! the server's share of the difference is what the `ringlimit.v1` service costs above
//! tonic's floor.
//!
//! Everything the process does meanwhile is counted too. Gossip rounds and expiry ticks
//! add well under 0.1 per check over 20,000 checks; the nodes' successor replication
//! (on by default, every 50 ms) adds ~1.8 per local check, its rounds' encoding and peer
//! calls shared by the checks between them (bench/RESULTS.md, 2026-12-04).
//! `RINGLIMIT_BENCH_REPLICATE_MS=0` runs the nodes without replicas, to count the check
//! path alone (`=N`: every N ms).

use std::alloc::System;
use std::sync::Arc;
use std::time::Duration;

use ringlimit::node::NodeConfig;
use ringlimit::node::{self, RunningNode};
use ringlimit::proto::v1_server::rate_limiter_server::RateLimiter;
use ringlimit::proto::CheckRequest;
use ringlimit::server::ringlimit_v1::{V1BatchRequest, V1Request};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

/// The load generator's h2 client, shared with `ringlimit bench` (it lives in the
/// binary, not the library).
#[allow(dead_code, unused_imports)]
#[path = "../src/bench/lean.rs"]
mod lean;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Checks measured per path.
const CHECKS: usize = 20_000;
/// Distinct keys, warmed before measuring (so no measured check creates a key).
const KEYS: usize = 500;

const CHECK_PATH: &str = "/ringlimit.v1.RateLimiter/Check";
const HEALTH_PATH: &str = "/grpc.health.v1.Health/Check";

/// One million per hour: nothing measured is ever denied.
const RULES: &str = r#"
[default]
algorithm = "sliding_window_counter"
limit = 1000000
window = "1h"
"#;

/// A check as the service receives it in-process (its two strings built here, as a
/// decoded request's would be).
fn request(key: &str) -> V1Request {
    V1Request {
        key: key.into(),
        route: "POST /v1/charges".into(),
        ..Default::default()
    }
}

/// The same check as a client sends it.
fn wire_request(key: &str) -> CheckRequest {
    CheckRequest {
        key: key.into(),
        route: "POST /v1/charges".into(),
        ..Default::default()
    }
}

/// The nodes' `--replicate-interval-ms`: `RINGLIMIT_BENCH_REPLICATE_MS`, or the default.
fn replicate_interval() -> Duration {
    match std::env::var("RINGLIMIT_BENCH_REPLICATE_MS") {
        Ok(ms) => Duration::from_millis(
            ms.trim()
                .parse()
                .expect("RINGLIMIT_BENCH_REPLICATE_MS must be a whole number of ms (0: off)"),
        ),
        Err(_) => NodeConfig::default().replicate_interval,
    }
}

/// The public service of `node`, called in-process.
fn service(node: &RunningNode) -> impl RateLimiter {
    node.public_service()
}

/// Allocations and bytes per check while `run(i)` (returning how many checks it made)
/// is called until `checks` are done.
async fn per_check(checks: usize, mut run: impl AsyncFnMut(usize) -> usize) -> (f64, f64) {
    let region = Region::new(GLOBAL);
    let mut done = 0;
    let mut i = 0;
    while done < checks {
        done += run(i).await;
        i += 1;
    }
    let change = region.change();
    (
        change.allocations as f64 / done as f64,
        change.bytes_allocated as f64 / done as f64,
    )
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let rules = dir.path().join("rules.toml");
        std::fs::write(&rules, RULES).expect("write rules");
        let replicate = replicate_interval();
        // `RINGLIMIT_BENCH_FORWARD_HTTP2=1`: forwards on an HTTP/2 stream instead of
        // the framed connection (`--forward-frames` on a node), to compare the two.
        let http2 = std::env::var("RINGLIMIT_BENCH_FORWARD_HTTP2").is_ok_and(|v| v == "1");
        let config = |id: &str, seeds: Vec<String>| {
            let mut config = NodeConfig {
                node_id: id.into(),
                seeds,
                rules_path: Some(rules.clone()),
                http_listen: None,
                replicate_interval: replicate,
                ..NodeConfig::for_test()
            };
            config.forward.frames = !http2;
            config
        };
        println!(
            "nodes replicate every {} ms (0: off; RINGLIMIT_BENCH_REPLICATE_MS); forwards on {}",
            replicate.as_millis(),
            if http2 { "an HTTP/2 stream" } else { "a framed connection" }
        );
        let a = node::start(config("a", Vec::new())).await.expect("a starts");
        let b = node::start(config("b", vec![a.gossip_addr.to_string()]))
            .await
            .expect("b starts");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while a.view().ring.len() < 2 || b.view().ring.len() < 2 {
            assert!(tokio::time::Instant::now() < deadline, "no 2-node ring");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let ring = ringlimit::ring::Ring::new(["a", "b"], ringlimit::ring::Ring::DEFAULT_VNODES);
        let owned_by = |owner: &str| -> Vec<String> {
            (0..)
                .map(|i| format!("cust_{i}"))
                .filter(|k| ring.owner(k.as_bytes()) == Some(owner))
                .take(KEYS)
                .collect()
        };
        let local_keys = Arc::new(owned_by("a"));
        let remote_keys = Arc::new(owned_by("b"));
        let svc = service(&a);

        // Warm every key (and the peer link) so measured checks find their state.
        for key in local_keys.iter().chain(remote_keys.iter()) {
            svc.check(tonic::Request::new(request(key)))
                .await
                .expect("warm check");
        }

        let (local, local_bytes) = per_check(CHECKS, |i: usize| {
            let req = request(&local_keys[i % KEYS]);
            let svc = &svc;
            async move {
                svc.check(tonic::Request::new(req)).await.expect("check");
                1
            }
        })
        .await;
        let (batch, batch_bytes) = per_check(CHECKS, |i: usize| {
            let checks = (0..32)
                .map(|j| request(&local_keys[(i * 32 + j) % KEYS]))
                .collect();
            let svc = &svc;
            async move {
                svc.check_batch(tonic::Request::new(V1BatchRequest { checks }))
                    .await
                    .expect("batch");
                32
            }
        })
        .await;
        let (forwarded, forwarded_bytes) = per_check(CHECKS / 4, |i: usize| {
            let req = request(&remote_keys[i % KEYS]);
            let svc = &svc;
            async move {
                let answer = svc.check(tonic::Request::new(req)).await.expect("check");
                assert_eq!(
                    answer.get_ref().verdict().descriptors[0].answer.hops,
                    1,
                    "went one hop"
                );
                1
            }
        })
        .await;

        // Over HTTP/2: the same client, one connection, for both calls.
        let (mut client, connection) = lean::LeanClient::connect(&a.grpc_addr.to_string())
            .await
            .expect("connect");
        tokio::spawn(connection);
        let health_request = tonic_health::pb::HealthCheckRequest::default();
        let check_requests: Vec<CheckRequest> =
            local_keys.iter().map(|k| wire_request(k)).collect();
        for r in check_requests.iter().take(50) {
            let _: ringlimit::proto::CheckResponse = client
                .unary(CHECK_PATH, r)
                .await
                .expect("warm check over h2");
        }
        let (health, health_bytes) = per_check(CHECKS, async |_| {
            let answer: tonic_health::pb::HealthCheckResponse = client
                .unary(HEALTH_PATH, &health_request)
                .await
                .expect("health check");
            assert_eq!(answer.status, 1, "SERVING");
            1
        })
        .await;
        let (h2_local, h2_local_bytes) = per_check(CHECKS, async |i| {
            let answer: ringlimit::proto::CheckResponse = client
                .unary(CHECK_PATH, &check_requests[i % KEYS])
                .await
                .expect("check over h2");
            assert_eq!(answer.descriptors[0].hops, 0, "decided here");
            1
        })
        .await;

        // The client decodes a larger answer for a check than for a health check (its
        // strings and descriptor list): that part of the difference is the client's.
        // Decoding the same answers alone, counted the same way, separates it out.
        let check_answers: Vec<Vec<u8>> = {
            use prost::Message;
            let mut answers = Vec::with_capacity(KEYS);
            for r in check_requests.iter() {
                let answer: ringlimit::proto::CheckResponse =
                    client.unary(CHECK_PATH, r).await.expect("check over h2");
                answers.push(answer.encode_to_vec());
            }
            answers
        };
        let health_answer = {
            use prost::Message;
            tonic_health::pb::HealthCheckResponse { status: 1 }.encode_to_vec()
        };
        let (check_decode, _) = per_check(CHECKS, async |i| {
            use prost::Message;
            let answer = ringlimit::proto::CheckResponse::decode(&check_answers[i % KEYS][..])
                .expect("decodes");
            std::hint::black_box(answer);
            1
        })
        .await;
        let (health_decode, _) = per_check(CHECKS, async |_| {
            use prost::Message;
            let answer = tonic_health::pb::HealthCheckResponse::decode(&health_answer[..])
                .expect("decodes");
            std::hint::black_box(answer);
            1
        })
        .await;
        let client_share = check_decode - health_decode;

        println!("allocations per check, in-process service calls (server side only):");
        println!("  local unary      {local:>7.1} allocs  {local_bytes:>8.0} bytes");
        println!("  local batch 32   {batch:>7.1} allocs  {batch_bytes:>8.0} bytes");
        println!("  forwarded unary  {forwarded:>7.1} allocs  {forwarded_bytes:>8.0} bytes  (entry + owner, the peer link included)");
        println!("allocations per call over HTTP/2 on loopback (lean client + whole server):");
        println!("  health check     {health:>7.1} allocs  {health_bytes:>8.0} bytes  (tonic's floor)");
        println!("  local unary      {h2_local:>7.1} allocs  {h2_local_bytes:>8.0} bytes");
        println!(
            "  difference       {:>7.1} allocs  {:>8.0} bytes",
            h2_local - health,
            h2_local_bytes - health_bytes
        );
        println!(
            "    of which the client decoding the larger answer {client_share:>5.1} allocs"
        );
        println!(
            "  server's share   {:>7.1} allocs  (target: at most 6)",
            h2_local - health - client_share
        );
        b.shutdown().await;
        a.shutdown().await;
    });
}
