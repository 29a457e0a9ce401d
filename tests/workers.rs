//! Thread-per-core (`NodeConfig::workers`, `ringlimit serve --threads N`): a node whose
//! public and peer faces are served by several workers, each on a listener of its own
//! sharing one port (`SO_REUSEPORT`), with the shards dealt out over them.
//!
//! The kernel picks the listener of each new connection by a hash of its addresses, so
//! these tests open many connections: with 16 of them, the chance that every one lands
//! on the same one of two listeners is 2^-15.

mod common;

use std::time::Duration;

use common::{check, client, key_owned_by, metric_sum, rules_file, start, start_cluster_with};
use ringlimit::cluster::link::Signed;
use ringlimit::keyring::Keyring;
use ringlimit::node::config::TEST_CLUSTER_SECRET;
use ringlimit::node::NodeConfig;
use ringlimit::proto::peer::peer_client::PeerClient;
use ringlimit::proto::peer::StatusRequest;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// 20 per hour: no window rolls over during a test.
const RULES: &str = r#"
[[rule]]
name = "t"
route = "GET /t"
algorithm = "fixed_window"
limit = 20
window = "1h"
"#;

const CONNECTIONS: usize = 16;

/// A connection over the cap is closed as soon as it is accepted; this bounds the wait.
const REFUSED_WITHIN: Duration = Duration::from_secs(10);

fn on_workers(workers: usize) -> NodeConfig {
    NodeConfig {
        workers,
        shards: ringlimit::shard::ShardConfig {
            shards: 4,
            ..ringlimit::shard::ShardConfig::default()
        },
        ..NodeConfig::for_test()
    }
}

/// Closes: "a key decided on two threads at once". Checks of one key arrive on
/// connections spread over both workers; the key's one shard actor decides them all,
/// so exactly the limit is admitted, however they interleave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_on_every_worker_s_connections_share_one_exact_budget() {
    let (_dir, rules) = rules_file(RULES);
    let node = start(NodeConfig {
        rules_path: Some(rules),
        ..on_workers(2)
    })
    .await;
    let mut calls = Vec::new();
    for c in 0..CONNECTIONS {
        let mut client = client(&node).await;
        calls.push(tokio::spawn(async move {
            let mut allowed = 0;
            for _ in 0..4 {
                let answer = client
                    .check(check("shared", "GET /t", None))
                    .await
                    .unwrap_or_else(|s| panic!("connection {c}: {s:?}"))
                    .into_inner();
                allowed += u32::from(answer.allowed);
            }
            allowed
        }));
    }
    let mut allowed = 0;
    for call in calls {
        allowed += call.await.unwrap();
    }
    assert_eq!(allowed, 20, "64 checks of one key with limit 20");
    node.shutdown().await;
}

/// Closes: "the connection cap is per worker" (N workers holding N × the cap). With a
/// cap of 2 on two workers, the two admitted clients hold both slots and every further
/// connection is closed at once, whichever worker's listener the kernel gave it.
#[tokio::test]
async fn the_connection_cap_holds_over_all_workers() {
    let mut config = on_workers(2);
    config.grpc.max_connections = 2;
    // A connection held over the cap would be closed by the handshake deadline too:
    // keep that far beyond the wait for a refusal, which is immediate.
    config.grpc.handshake_timeout = Duration::from_secs(120);
    let node = start(config).await;
    let refused_before = metric_sum("ringlimit_connections_refused_total");
    let mut first = client(&node).await;
    first.check(check("a", "/x", None)).await.unwrap();
    let mut second = client(&node).await;
    second.check(check("b", "/x", None)).await.unwrap();
    for _ in 0..CONNECTIONS {
        let mut extra = TcpStream::connect(node.grpc_addr).await.unwrap();
        let mut buf = [0u8; 256];
        let closed = tokio::time::timeout(REFUSED_WITHIN, async {
            loop {
                match extra.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "a connection over the cap was held open");
    }
    assert!(
        metric_sum("ringlimit_connections_refused_total") >= refused_before + CONNECTIONS as f64
    );
    first.check(check("a", "/x", None)).await.unwrap();
    second.check(check("b", "/x", None)).await.unwrap();
    node.shutdown().await;
}

/// Closes: "a worker's peer listener serves without the cluster key". Every
/// connection to the peer port, whichever worker accepts it, must prove the key.
#[tokio::test]
async fn every_worker_s_peer_listener_demands_the_cluster_key() {
    let node = start(on_workers(2)).await;
    let endpoint =
        tonic::transport::Endpoint::from_shared(format!("http://{}", node.peer_addr)).unwrap();
    for _ in 0..CONNECTIONS {
        let channel = endpoint.connect().await.unwrap();
        let status = PeerClient::new(channel.clone())
            .status(StatusRequest::default())
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
        let other = Keyring::from_text("another-cluster-secret-of-enough-length-000").unwrap();
        let status = PeerClient::new(Signed::new(channel.clone(), Some(other), "x".into()))
            .status(StatusRequest::default())
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
        let key = Keyring::from_text(TEST_CLUSTER_SECRET).unwrap();
        PeerClient::new(Signed::new(channel, Some(key), "x".into()))
            .status(StatusRequest::default())
            .await
            .expect("a member's call is served");
    }
    node.shutdown().await;
}

/// Two nodes on two workers each: checks entering at the node that does not own the
/// key are forwarded (from whichever worker took the connection, to whichever of the
/// owner's peer listeners the link reached) and decided once, on the owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_of_multi_worker_nodes_forwards_and_decides_exactly() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = start_cluster_with(&["a", "b"], Some(&rules), |config| {
        config.workers = 2;
        config.shards.shards = 4;
    })
    .await;
    let key = key_owned_by("b", &["a", "b"], "fwd-");
    let mut calls = Vec::new();
    for _ in 0..CONNECTIONS {
        let mut via_a = client(&nodes[0]).await;
        let key = key.clone();
        calls.push(tokio::spawn(async move {
            let mut allowed = 0;
            for _ in 0..2 {
                let answer = via_a
                    .check(check(&key, "GET /t", None))
                    .await
                    .unwrap()
                    .into_inner();
                // A denial may come from the entry's deny cache (flagged degraded);
                // an admission only from the owner.
                assert!(!answer.allowed || !answer.degraded, "{answer:?}");
                let decider = answer.decider.clone().expect("a decider");
                assert_eq!(decider.node_id, "b", "{answer:?}");
                allowed += u32::from(answer.allowed);
            }
            allowed
        }));
    }
    let mut allowed = 0;
    for call in calls {
        allowed += call.await.unwrap();
    }
    assert_eq!(allowed, 20, "32 checks of one key with limit 20");
    for node in nodes {
        node.shutdown().await;
    }
}

/// Closes: "a second process joins a multi-worker node's port" (with `SO_REUSEPORT`
/// the kernel would deal it part of the node's connections). A node started on the
/// public or peer port of a running two-worker node is refused, on one worker or two.
#[tokio::test]
async fn a_node_on_a_multi_worker_node_s_port_is_refused() {
    let node = start(on_workers(2)).await;
    for workers in [1, 2] {
        for taken in [node.grpc_addr, node.peer_addr] {
            let mut config = on_workers(workers);
            if taken == node.grpc_addr {
                config.listen = taken;
            } else {
                config.peer_listen = taken;
            }
            let refused = ringlimit::node::start(config).await.unwrap_err();
            assert!(
                matches!(refused, ringlimit::node::NodeError::Bind { addr, .. } if addr == taken),
                "{refused}"
            );
        }
    }
    node.shutdown().await;
}
