//! `ringlimit-client` against an in-process cluster: it learns the ring from one seed,
//! sends every check straight to its key's owner (answers with no hop), follows a join
//! and a leave, and fails open on its L/N share or closed when no node answers.

mod common;

use std::time::Duration;

use common::{member_config, start, start_cluster, wait_converged};
use ringlimit_client::{Check, Client, ClientConfig, Source};

fn config(seed: std::net::SocketAddr) -> ClientConfig {
    let mut config = ClientConfig::new([seed.to_string()]);
    // Generous for a loaded CI machine; the routing, not the speed, is under test.
    config.deadline = Duration::from_secs(2);
    config.refresh = Duration::from_millis(200);
    config
}

/// Check keys until every member has decided some, all straight at their owner.
async fn every_check_goes_to_its_owner(client: &Client, members: &[&str], prefix: &str) {
    let ring = ringlimit::ring::Ring::new(
        members.iter().copied(),
        ringlimit::ring::Ring::DEFAULT_VNODES,
    );
    let mut decided_by = std::collections::BTreeSet::new();
    for i in 0..60 {
        let key = format!("{prefix}{i}");
        let answer = client.check(&Check::new(&key, "GET /x")).await.unwrap();
        let owner = ring.owner(key.as_bytes()).unwrap();
        assert_eq!(
            client.owner(&key).as_deref(),
            Some(owner),
            "the client's ring"
        );
        assert!(answer.allowed(), "{answer:?}");
        assert_eq!(answer.source, Source::Owner, "{key}: {answer:?}");
        assert_eq!(answer.node.as_deref(), Some(owner), "{key}");
        decided_by.insert(owner.to_string());
    }
    assert_eq!(decided_by.len(), members.len(), "{decided_by:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_sends_each_check_to_its_owner_and_follows_a_join_and_a_leave() {
    let nodes = start_cluster(&["a", "b", "c"], None).await;
    let client = Client::connect(config(nodes[0].grpc_addr)).await.unwrap();
    assert_eq!(client.members().len(), 3, "learned from one seed");
    every_check_goes_to_its_owner(&client, &["a", "b", "c"], "k").await;

    // A join: once the client has re-read the topology, d's keys go to d directly.
    let d = start(member_config(
        "d",
        &[nodes[0].gossip_addr.to_string()],
        None,
    ))
    .await;
    let mut all = nodes;
    all.push(d);
    wait_converged(&all, 4).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while client.members().len() != 4 {
        assert!(tokio::time::Instant::now() < deadline, "never saw d join");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    every_check_goes_to_its_owner(&client, &["a", "b", "c", "d"], "j").await;

    // A graceful leave of b: its keys go to their new owners.
    let b = all.remove(1);
    b.shutdown().await;
    wait_converged(&all, 3).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while client.members().len() != 3 {
        assert!(tokio::time::Instant::now() < deadline, "never saw b leave");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    every_check_goes_to_its_owner(&client, &["a", "c", "d"], "l").await;
    for node in all {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_node_answering_a_check_fails_open_on_its_share_or_closed() {
    let node = start(member_config("solo", &[], None)).await;
    let client = Client::connect(config(node.grpc_addr)).await.unwrap();
    assert_eq!(client.members().len(), 1);
    node.shutdown().await;

    let closed = client
        .check(&Check::new("k", "GET /x").deadline(Duration::from_millis(300)))
        .await
        .unwrap();
    assert!(!closed.allowed());
    assert_eq!(closed.source, Source::FailClosed);
    assert!(closed.degraded && closed.quota.retry_after_ms > 0);

    // Fail open: the limit divided by the members the client knew (1 here): 3 per
    // minute, then denied with the wait to the window's end.
    let open = Check::new("k", "GET /x")
        .deadline(Duration::from_millis(300))
        .fail_open(3, Duration::from_secs(60));
    let mut per_window: std::collections::BTreeMap<u64, u32> = Default::default();
    for _ in 0..5 {
        let answer = client.check(&open).await.unwrap();
        assert_eq!(answer.source, Source::FailOpen);
        assert_eq!(answer.quota.limit, 3);
        // Per local window (they end at `reset_at`): 3 admitted, then denied.
        let admitted = per_window.entry(answer.quota.reset_at_ms).or_default();
        assert_eq!(answer.allowed(), *admitted < 3, "{answer:?}");
        *admitted += u32::from(answer.allowed());
    }
}

#[tokio::test]
async fn a_malformed_check_is_an_error_and_never_fails_open() {
    let node = start(member_config("v", &[], None)).await;
    let client = Client::connect(config(node.grpc_addr)).await.unwrap();
    let too_long = "k".repeat(300);
    let error = client
        .check(&Check::new(too_long, "GET /x").fail_open(100, Duration::from_secs(60)))
        .await
        .unwrap_err();
    assert!(
        matches!(error, ringlimit_client::ClientError::Invalid(_)),
        "{error:?}"
    );
    assert!(client
        .check(&Check::new("k", "GET /x").cost(0))
        .await
        .is_err());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_checks_share_batch_calls_and_a_bad_one_fails_alone() {
    let node = start(member_config("solo", &[], None)).await;
    let mut config = config(node.grpc_addr);
    config.coalesce = Some(ringlimit_client::Coalesce {
        max_batch: 64,
        max_in_flight: 1,
    });
    let client = Client::connect(config).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..400 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let key = if i == 77 {
                "x".repeat(300)
            } else {
                format!("c{i}")
            };
            client.check(&Check::new(key, "GET /x")).await
        }));
    }
    let mut allowed = 0;
    for (i, task) in tasks.into_iter().enumerate() {
        match task.await.unwrap() {
            Ok(answer) => {
                assert!(
                    answer.allowed() && answer.source == Source::Owner,
                    "{answer:?}"
                );
                allowed += 1;
            }
            Err(error) => assert_eq!(i, 77, "only the over-long key fails: {error:?}"),
        }
    }
    assert_eq!(allowed, 399);
    let stats = client.coalesce_stats();
    eprintln!(
        "400 concurrent checks: {} calls, {} checks",
        stats.calls, stats.checks
    );
    assert_eq!(stats.checks, 400);
    assert!(stats.calls < 400, "some checks shared a call: {stats:?}");
    node.shutdown().await;
}
