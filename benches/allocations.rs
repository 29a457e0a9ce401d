//! Heap allocations per check, counted by a global allocator wrapper (not timed).
//!
//! `cargo bench --bench allocations` starts nodes in this process and calls the public
//! `ringlimit.v1` service directly (no HTTP/2 client, so the client's allocations are
//! not counted), then prints allocations and bytes per check for three paths:
//!
//! - local: a unary `Check` whose key this node owns;
//! - batch: `CheckBatch` of 32 local checks, per check;
//! - forwarded: a unary `Check` sent to a node that does not own the key, so it goes one
//!   hop over real HTTP/2 to its owner in the same process: entry and owner together.
//!
//! Everything the process does meanwhile is counted too (gossip rounds, expiry ticks);
//! over 20,000 checks that adds well under 0.1 per check.

use std::alloc::System;
use std::sync::Arc;
use std::time::Duration;

use ringlimit::node::NodeConfig;
use ringlimit::node::{self, RunningNode};
use ringlimit::proto::rate_limiter_server::RateLimiter;
use ringlimit::proto::{CheckBatchRequest, CheckRequest};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Checks measured per path.
const CHECKS: usize = 20_000;
/// Distinct keys, warmed before measuring (so no measured check creates a key).
const KEYS: usize = 500;

/// One million per hour: nothing measured is ever denied.
const RULES: &str = r#"
[default]
algorithm = "sliding_window_counter"
limit = 1000000
window = "1h"
"#;

fn request(key: &str) -> CheckRequest {
    CheckRequest {
        key: key.into(),
        route: "POST /v1/charges".into(),
        ..Default::default()
    }
}

/// The public service of `node`, called in-process.
fn service(node: &RunningNode) -> impl RateLimiter {
    node.public_service()
}

async fn per_check<F, Fut>(checks: usize, mut run: F) -> (f64, f64)
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = usize>,
{
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
        let config = |id: &str, seeds: Vec<String>| NodeConfig {
            node_id: id.into(),
            seeds,
            rules_path: Some(rules.clone()),
            http_listen: None,
            ..NodeConfig::for_test()
        };
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

        let (local, local_bytes) = per_check(CHECKS, |i| {
            let req = request(&local_keys[i % KEYS]);
            let svc = &svc;
            async move {
                svc.check(tonic::Request::new(req)).await.expect("check");
                1
            }
        })
        .await;
        let (batch, batch_bytes) = per_check(CHECKS, |i| {
            let checks = (0..32)
                .map(|j| request(&local_keys[(i * 32 + j) % KEYS]))
                .collect();
            let svc = &svc;
            async move {
                svc.check_batch(tonic::Request::new(CheckBatchRequest { checks }))
                    .await
                    .expect("batch");
                32
            }
        })
        .await;
        let (forwarded, forwarded_bytes) = per_check(CHECKS / 4, |i| {
            let req = request(&remote_keys[i % KEYS]);
            let svc = &svc;
            async move {
                let answer = svc.check(tonic::Request::new(req)).await.expect("check");
                assert_eq!(answer.get_ref().descriptors[0].hops, 1, "went one hop");
                1
            }
        })
        .await;
        println!("allocations per check (server side, in-process service calls):");
        println!("  local unary      {local:>7.1} allocs  {local_bytes:>8.0} bytes");
        println!("  local batch 32   {batch:>7.1} allocs  {batch_bytes:>8.0} bytes");
        println!("  forwarded unary  {forwarded:>7.1} allocs  {forwarded_bytes:>8.0} bytes  (entry + owner, peer HTTP/2 included)");
        b.shutdown().await;
        a.shutdown().await;
    });
}
