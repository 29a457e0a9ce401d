//! Shared helpers for integration tests: start a node on port 0, connect a client.
#![allow(dead_code)]

use std::sync::Arc;

use ringlimit::clock::{Clock, ManualClock, SystemClock};
use ringlimit::config::node::NodeConfig;
use ringlimit::node::{self, RunningNode};
use ringlimit::proto::rate_limiter_client::RateLimiterClient;
use ringlimit::proto::{CheckRequest, Descriptor};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// A node on loopback port 0 with the system clock.
pub async fn start(config: NodeConfig) -> RunningNode {
    start_with_clock(config, Arc::new(SystemClock)).await
}

/// A node on loopback port 0 reading time from `clock`.
pub async fn start_with_clock(config: NodeConfig, clock: Arc<dyn Clock>) -> RunningNode {
    node::start_with_clock(config, clock, CancellationToken::new())
        .await
        .expect("node starts")
}

/// A node whose time only moves when the returned clock is moved.
pub async fn start_manual(config: NodeConfig, start_ms: u64) -> (RunningNode, ManualClock) {
    let clock = ManualClock::new(start_ms);
    let node = start_with_clock(config, Arc::new(clock.clone())).await;
    (node, clock)
}

/// A connected gRPC client.
pub async fn client(node: &RunningNode) -> RateLimiterClient<Channel> {
    RateLimiterClient::connect(format!("http://{}", node.grpc_addr))
        .await
        .expect("client connects")
}

/// A check of `cost` for (key, route).
pub fn check(key: &str, route: &str, cost: Option<i64>) -> CheckRequest {
    CheckRequest {
        key: key.into(),
        route: route.into(),
        cost,
        tier: None,
        descriptors: Vec::new(),
    }
}

/// An extra descriptor for `key` inheriting the request's route, tier and cost.
pub fn descriptor(key: &str) -> Descriptor {
    Descriptor {
        key: key.into(),
        ..Default::default()
    }
}
