//! A real node on port 0, asked over real gRPC.

mod common;

use std::time::Duration;

use common::{check, client, descriptor, start, start_manual};
use ringlimit::node::NodeConfig;
use ringlimit::proto::CheckBatchRequest;
use tonic::Code;

/// 2026-01-01T00:00:00Z, aligned to a minute so window arithmetic is easy to read.
const T0: u64 = 1_767_225_600_000;

#[tokio::test]
async fn default_rule_admits_100_then_denies_with_a_retry_after() {
    let (node, _clock) = start_manual(NodeConfig::for_test(), T0).await;
    let mut c = client(&node).await;
    for i in 1..=100u64 {
        let a = c
            .check(check("cust_42", "POST /v1/charges", None))
            .await
            .unwrap()
            .into_inner();
        assert!(a.allowed, "check {i} within the limit");
        assert_eq!(a.limit, 100);
        assert_eq!(a.remaining, 100 - i);
        assert_eq!(a.rule, "default");
        assert_eq!(a.window_id, Some(T0 / 60_000));
    }
    let denied = c
        .check(check("cust_42", "POST /v1/charges", None))
        .await
        .unwrap()
        .into_inner();
    assert!(!denied.allowed);
    assert_eq!(denied.remaining, 0);
    // 100 in the current window, none before: a slot frees once the estimate
    // 100*(1-f) drops to 99 in the next window, at f = 0.01 → 60 s + 600 ms.
    assert_eq!(denied.retry_after_ms, 60_600);
    let decider = denied.decider.unwrap();
    assert_eq!(decider.node_id, "test-node");
    assert!(decider.generation > 0);
    node.shutdown().await;
}

#[tokio::test]
async fn sequence_numbers_increase_with_every_decision() {
    let node = start(NodeConfig::for_test()).await;
    let mut c = client(&node).await;
    let mut last = 0;
    for _ in 0..20 {
        let a = c.check(check("k", "/x", None)).await.unwrap().into_inner();
        assert!(a.sequence > last);
        last = a.sequence;
    }
    node.shutdown().await;
}

#[tokio::test]
async fn bad_input_is_invalid_argument_naming_the_field_and_charges_nothing() {
    let (node, _clock) = start_manual(NodeConfig::for_test(), T0).await;
    let mut c = client(&node).await;
    let cases = [
        (check("", "/x", None), "key"),
        (check(&"k".repeat(257), "/x", None), "key"),
        (check("k", "/x", Some(0)), "cost"),
        (check("k", "/x", Some(-5)), "cost"),
        (check("k", "/x", Some(101)), "cost"),
        (check("k", "no-slash", None), "route"),
    ];
    for (request, field) in cases {
        let status = c.check(request).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(
            status.message().starts_with(field),
            "message {:?} names {field}",
            status.message()
        );
    }
    let mut too_many = check("k", "/x", None);
    too_many.descriptors = (0..8).map(|i| descriptor(&format!("ip{i}"))).collect();
    let status = c.check(too_many).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().starts_with("descriptors"));

    // None of the refused requests charged anything: the key still has its full 100.
    let a = c.check(check("k", "/x", None)).await.unwrap().into_inner();
    assert_eq!(a.remaining, 99);
    node.shutdown().await;
}

#[tokio::test]
async fn a_denied_descriptor_refunds_the_ones_that_allowed() {
    let (node, _clock) = start_manual(NodeConfig::for_test(), T0).await;
    let mut c = client(&node).await;
    // Exhaust the per-IP key with cost 100.
    let a = c
        .check(check("ip:10.0.0.1", "/x", Some(100)))
        .await
        .unwrap()
        .into_inner();
    assert!(a.allowed);
    // Now a request limited per client AND per IP: the IP denies.
    let mut both = check("cust_7", "/x", Some(10));
    both.descriptors = vec![descriptor("ip:10.0.0.1")];
    let a = c.check(both).await.unwrap().into_inner();
    assert!(!a.allowed);
    assert!(a.descriptors[0].allowed && a.descriptors[0].refunded);
    assert!(!a.descriptors[1].allowed);
    assert_eq!(a.retry_after_ms, a.descriptors[1].retry_after_ms);
    // The client's quota was given back: all 100 still there.
    let a = c
        .check(check("cust_7", "/x", Some(100)))
        .await
        .unwrap()
        .into_inner();
    assert!(a.allowed, "the refunded 10 are available again");
    node.shutdown().await;
}

#[tokio::test]
async fn check_batch_decides_each_check_and_refuses_oversized_or_invalid_batches() {
    let node = start(NodeConfig::for_test()).await;
    let mut c = client(&node).await;
    let checks = (0..10)
        .map(|i| check(&format!("k{}", i % 2), "/x", Some(30)))
        .collect();
    let results = c
        .check_batch(CheckBatchRequest { checks })
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!(results.len(), 10);
    // Each key gets cost 30 five times against a limit of 100: three admitted.
    let admitted = |key: usize| {
        results
            .iter()
            .enumerate()
            .filter(|(i, r)| i % 2 == key && r.allowed)
            .count()
    };
    assert_eq!((admitted(0), admitted(1)), (3, 3));

    let too_big = (0..1001).map(|_| check("k", "/x", None)).collect();
    let status = c
        .check_batch(CheckBatchRequest { checks: too_big })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().starts_with("checks:"),
        "{}",
        status.message()
    );

    let mixed = vec![check("fresh", "/x", None), check("fresh", "/x", Some(0))];
    let status = c
        .check_batch(CheckBatchRequest { checks: mixed })
        .await
        .unwrap_err();
    assert!(
        status.message().starts_with("checks[1].cost"),
        "{}",
        status.message()
    );
    let a = c
        .check(check("fresh", "/x", None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(a.remaining, 99, "the refused batch charged nothing");
    node.shutdown().await;
}

#[tokio::test]
async fn many_concurrent_clients_on_one_key_get_exactly_the_limit() {
    let (node, _clock) = start_manual(NodeConfig::for_test(), T0).await;
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let mut c = client(&node).await;
        tasks.push(tokio::spawn(async move {
            let mut admitted = 0;
            for _ in 0..25 {
                if c.check(check("hot", "/x", None))
                    .await
                    .unwrap()
                    .into_inner()
                    .allowed
                {
                    admitted += 1;
                }
            }
            admitted
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    assert_eq!(total, 100, "400 concurrent checks, limit 100");
    node.shutdown().await;
}

#[tokio::test]
async fn a_rule_file_edit_is_picked_up_without_restart_and_a_broken_edit_keeps_old_rules() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rules.toml");
    let rules = |limit: u32| {
        format!(
            "[[rule]]\nname = \"charges\"\nroute = \"POST /v1/charges\"\nalgorithm = \"fixed_window\"\nlimit = {limit}\nwindow = \"1h\"\n\n[[rule]]\nname = \"other\"\nroute = \"GET /v1/*\"\nalgorithm = \"fixed_window\"\nlimit = 5\nwindow = \"1h\"\n"
        )
    };
    std::fs::write(&path, rules(2)).unwrap();
    let config = NodeConfig {
        rules_path: Some(path.clone()),
        ..NodeConfig::for_test()
    };
    let (node, _clock) = start_manual(config, T0).await;
    let mut c = client(&node).await;
    let charge = check("a", "POST /v1/charges", None);
    let get = check("a", "GET /v1/users", None);
    assert_eq!(c.check(charge.clone()).await.unwrap().into_inner().limit, 2);
    assert_eq!(
        c.check(get.clone()).await.unwrap().into_inner().remaining,
        4
    );

    std::fs::write(&path, rules(3)).unwrap();
    let mut reloaded = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if node
            .rules
            .load()
            .rules()
            .iter()
            .any(|r| r.name.as_ref() == "charges" && r.limiter.max_cost() == 3)
        {
            reloaded = true;
            break;
        }
    }
    assert!(reloaded, "the edit was picked up");
    let a = c.check(charge.clone()).await.unwrap().into_inner();
    assert_eq!(
        (a.limit, a.remaining),
        (3, 2),
        "changed rule restarts its counter"
    );
    let a = c.check(get.clone()).await.unwrap().into_inner();
    assert_eq!(a.remaining, 3, "unchanged rule kept its counter");

    std::fs::write(&path, "[[rule]]\nname = \"charges\"\nlimit = 0\n").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let a = c.check(charge).await.unwrap().into_inner();
    assert_eq!(
        (a.rule.as_str(), a.limit),
        ("charges", 3),
        "broken file: old rules stay"
    );
    node.shutdown().await;
}

/// Issue 10, "Flooding unique keys evicts exhausted counters": a client exhausted a
/// key, then sent enough distinct keys to push it out of the key cap and was admitted
/// again. Eviction now takes keys that still have budget first, never a denied one.
#[tokio::test]
async fn a_flood_of_unique_keys_does_not_free_an_exhausted_key() {
    const MAX_KEYS: usize = 200;
    let mut config = NodeConfig::for_test();
    config.shards.max_keys = MAX_KEYS;
    let (node, clock) = start_manual(config, T0).await;
    let mut c = client(&node).await;
    let victim = check("victim", "POST /v1/charges", Some(100));
    assert!(c.check(victim.clone()).await.unwrap().into_inner().allowed);
    let denied = c
        .check(check("victim", "POST /v1/charges", None))
        .await
        .unwrap();
    assert!(!denied.into_inner().allowed, "the limit of 100 is spent");

    // 20 times the cap in unique single-hit keys, through CheckBatch.
    clock.advance(10);
    for batch in 0..20 * MAX_KEYS / 1000 {
        let checks = (0..1000)
            .map(|i| check(&format!("flood-{batch}-{i}"), "POST /v1/charges", None))
            .collect();
        let results = c
            .check_batch(CheckBatchRequest { checks })
            .await
            .unwrap()
            .into_inner()
            .results;
        assert!(results.iter().all(|r| r.allowed));
    }
    assert!(
        node.shards.keys().await.unwrap() <= MAX_KEYS,
        "the cap held"
    );

    let after = c
        .check(check("victim", "POST /v1/charges", None))
        .await
        .unwrap()
        .into_inner();
    assert!(!after.allowed, "still denied after the flood: {after:?}");
    assert_eq!(after.remaining, 0);

    let body = http_get(node.metrics_addr.unwrap(), "/metrics").await;
    let evictions = |kind: &str| -> f64 {
        body.lines()
            .filter(|l| l.starts_with("ringlimit_evictions_total{"))
            .filter(|l| l.contains(&format!("kind=\"{kind}\"")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert!(evictions("live") > 0.0, "{body}");
    assert_eq!(evictions("denied"), 0.0, "{body}");
    node.shutdown().await;
}

#[tokio::test]
async fn metrics_port_serves_prometheus_text() {
    let node = start(NodeConfig::for_test()).await;
    let mut c = client(&node).await;
    c.check(check("m", "/x", None)).await.unwrap();
    let addr = node.metrics_addr.unwrap();
    let body = http_get(addr, "/metrics").await;
    assert!(body.contains("ringlimit_checks_total"), "{body}");
    assert!(body.contains("algorithm=\"sliding_window_counter\""));
    assert!(body.contains("ringlimit_keys"));
    assert!(body.contains("ringlimit_check_duration_seconds_bucket"));
    node.shutdown().await;
}

#[tokio::test]
async fn health_and_reflection_are_served() {
    let node = start(NodeConfig::for_test()).await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", node.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "ringlimit.v1.RateLimiter".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        status.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    node.shutdown().await;
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).await.unwrap();
    body
}
