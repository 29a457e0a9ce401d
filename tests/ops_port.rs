//! Attack test: idle connections against the ops port (issue 26, point 6).
//!
//! Its own test target: it holds 2,000 sockets, and the count of closed ops connections
//! it waits on is process-wide.

mod common;

use std::time::{Duration, Instant};

use common::{http, metric_sum, start};
use ringlimit::node::NodeConfig;
use rlimit::Resource;
use tokio::net::TcpStream;

const IDLE: usize = 2_000;
const CLOSED: &str = "ringlimit_ops_connections_closed_total";

/// Closes: "1,500 idle TCP connections to the ops port leave `GET /metrics` timing out
/// while they are held", which marks a healthy node unready. With 2,000 idle
/// connections held, `/readyz` and `/metrics` still answer within 1 s: at the cap the
/// connection idle the longest is closed for the newest.
#[tokio::test]
async fn readyz_answers_within_a_second_while_2000_idle_connections_are_held() {
    // Starting a node raises the soft RLIMIT_NOFILE to the hard limit.
    let node = start(NodeConfig::for_test()).await;
    let (soft, _) = rlimit::getrlimit(Resource::NOFILE).unwrap();
    assert!(
        soft >= 2 * IDLE as u64 + 512,
        "this test needs {} file descriptors (soft RLIMIT_NOFILE is {soft})",
        2 * IDLE + 512
    );
    let addr = node.http_addr.expect("the test config serves the ops port");
    let before = metric_sum(CLOSED);
    let mut idle = Vec::with_capacity(IDLE);
    for _ in 0..IDLE {
        idle.push(TcpStream::connect(addr).await.expect("connects"));
    }
    // Every idle connection accepted (none left in the listen queue, where a new one
    // would wait behind them): all but the cap's worth have been closed by the node.
    let cap = ringlimit::node::MAX_OPS_CONNECTIONS as f64;
    let all_accepted = common::eventually(Duration::from_secs(60), || {
        metric_sum(CLOSED) - before >= IDLE as f64 - cap
    })
    .await;
    assert!(
        all_accepted,
        "the node closed {} of {IDLE} idle connections",
        metric_sum(CLOSED) - before
    );
    for path in ["/readyz", "/metrics"] {
        let started = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(1), http(addr, "GET", path, &[], ""))
            .await
            .unwrap_or_else(|_| panic!("{path} not answered within 1 s"));
        assert_eq!(answer.status, 200, "{path}: {}", answer.body);
        println!(
            "{path} answered in {:?} with {IDLE} idle connections held",
            started.elapsed()
        );
    }
    drop(idle);
    node.shutdown().await;
}
