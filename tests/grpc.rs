//! A real node on port 0, asked over real gRPC.

mod common;

use std::time::Duration;

use common::{
    check, client, counter_value, descriptor, eventually, mkfifo, rules_file, start, start_manual,
};
use ringlimit::config::rules::MAX_RULES_FILE_BYTES;
use ringlimit::node::{self, NodeConfig, RunningNode};
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
    let refused = |field: &str| {
        common::counter_value(
            "ringlimit_refused_total",
            &format!("reason=\"invalid_argument\",field=\"{field}\""),
        )
    };
    let (cost_before, key_before) = (refused("cost"), refused("key"));
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
    // Each refusal is counted by reason and field (other tests in this process may add
    // to the same series, never take from it).
    assert!(refused("cost") >= cost_before + 3, "cost refusals counted");
    assert!(refused("key") >= key_before + 2, "key refusals counted");

    // None of the refused requests charged anything: the key still has its full 100.
    let a = c.check(check("k", "/x", None)).await.unwrap().into_inner();
    assert_eq!(a.remaining, 99);
    node.shutdown().await;
}

/// The messages a caller reads are pinned: each starts with the field's path (a
/// batch's check and descriptor indices included), then says what is wrong.
#[tokio::test]
async fn refusals_name_the_field_path_then_the_bound() {
    let node = start(NodeConfig::for_test()).await;
    let mut c = client(&node).await;
    let status = c
        .check(check(&"k".repeat(257), "/x", None))
        .await
        .unwrap_err();
    assert_eq!(status.message(), "key: 257 bytes is over the limit of 256");
    let mut bad = check("k", "/x", None);
    bad.descriptors = vec![descriptor("ip"), descriptor("")];
    let checks = vec![check("a", "/x", None), check("b", "/x", None), bad];
    let status = c
        .check_batch(CheckBatchRequest { checks })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(
        status.message(),
        "checks[2].descriptors[1].key: must not be empty"
    );
    let mut tier = check("k", "/x", None);
    tier.tier = Some("t".repeat(65));
    let status = c.check(tier).await.unwrap_err();
    assert_eq!(status.message(), "tier: 65 bytes is over the limit of 64");
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

    let body = http_get(node.http_addr.unwrap(), "/metrics").await;
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
    let addr = node.http_addr.unwrap();
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

/// Bypass closed: the node-to-node `Peer` service used to be served on the public port,
/// where any client could refund its own spent budget (`Peer/Refund`), install counter
/// state (`Peer/Install`) or read the topology (`Peer/Status`). It now has a listener of
/// its own, and the public port neither serves nor advertises it.
#[tokio::test]
async fn the_public_port_neither_serves_nor_advertises_the_peer_service() {
    use ringlimit::proto::peer::peer_client::PeerClient;
    use ringlimit::proto::peer::{RefundItem, RefundRequest, StatusRequest};
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;

    let node = start(NodeConfig::for_test()).await;
    assert_ne!(node.peer_addr, node.grpc_addr);
    let mut public = PeerClient::connect(format!("http://{}", node.grpc_addr))
        .await
        .unwrap();
    let refund = RefundRequest {
        items: vec![RefundItem {
            key: "k".into(),
            route: "/x".into(),
            tier: None,
            cost: 100,
            at: 0,
            named: None,
        }],
    };
    let refused = public.refund(refund.clone()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unimplemented, "{refused:?}");
    let refused = public.status(StatusRequest {}).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unimplemented, "{refused:?}");

    // Reflection on the public port lists the public services only.
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", node.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut reflection = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter(vec![request]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("expected a service list, got {answer:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"ringlimit.v1.RateLimiter".to_string()),
        "{names:?}"
    );
    assert!(names.iter().all(|n| !n.contains("peer")), "{names:?}");

    // The peer service answers members on its own listener.
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", node.peer_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let key = ringlimit::keyring::Keyring::from_text(ringlimit::node::config::TEST_CLUSTER_SECRET)
        .unwrap();
    let mut peer = PeerClient::new(ringlimit::cluster::link::Signed::new(
        channel,
        Some(key),
        "member".into(),
    ));
    let status = peer.status(StatusRequest {}).await.unwrap().into_inner();
    assert_eq!(status.members[0].peer_addr, node.peer_addr.to_string());
    node.shutdown().await;
}

/// The public `Topology` call (what a ring-aware client routes by) is the one piece of
/// cluster state the public port hands out. An attacker calling it learns what a gateway
/// needs and nothing more: node ids, public gRPC addresses, generations, the ring's shape
/// and digest; never a peer, gossip or ops address. And it changes nothing: a thousand
/// calls charge no counter.
#[tokio::test]
async fn the_public_topology_reveals_only_public_addresses_and_charges_nothing() {
    // A manual clock: no window boundary can fall between the two checks.
    let (node, _clock) = start_manual(NodeConfig::for_test(), T0).await;
    let mut c = client(&node).await;
    let a = c.check(check("k", "/x", None)).await.unwrap().into_inner();
    assert_eq!(a.remaining, 99);
    let mut last = None;
    for _ in 0..1000 {
        last = Some(
            c.topology(ringlimit::proto::TopologyRequest {})
                .await
                .unwrap()
                .into_inner(),
        );
    }
    let topology = last.unwrap();
    assert_eq!(topology.members.len(), 1);
    let member = &topology.members[0];
    assert_eq!(member.grpc_addr, node.grpc_addr.to_string());
    let rendered = format!("{topology:?}");
    for secret in [
        node.peer_addr.to_string(),
        node.gossip_addr.to_string(),
        node.http_addr.map(|a| a.to_string()).unwrap_or_default(),
    ] {
        if !secret.is_empty() {
            assert!(!rendered.contains(&secret), "{secret} leaked: {rendered}");
        }
    }
    // Nothing was charged by the topology calls.
    let a = c.check(check("k", "/x", None)).await.unwrap().into_inner();
    assert_eq!(a.remaining, 98);
    node.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Rule file attacks: a path or a write that would switch limiting off or stall the node.

const RELOADS: &str = "ringlimit_rules_reloads_total";
const ERROR: &str = "result=\"error\"";

fn charges_rules(limit: u32) -> String {
    format!(
        "[[rule]]\nname = \"charges\"\nroute = \"POST /v1/charges\"\nalgorithm = \"fixed_window\"\nlimit = {limit}\nwindow = \"1h\"\n"
    )
}

fn charges_limit(node: &ringlimit::node::RunningNode) -> Option<u64> {
    node.rules
        .load()
        .get("charges")
        .map(|r| r.limiter.max_cost())
}

async fn start_watching(limit: u32) -> (tempfile::TempDir, std::path::PathBuf, RunningNode) {
    let (dir, path) = rules_file(&charges_rules(limit));
    let node = start(NodeConfig {
        rules_path: Some(path.clone()),
        ..NodeConfig::for_test()
    })
    .await;
    assert_eq!(charges_limit(&node), Some(u64::from(limit)));
    (dir, path, node)
}

/// Refused at start, and quickly: a start must not block on the rule path either.
async fn start_error(path: &std::path::Path) -> String {
    let config = NodeConfig {
        rules_path: Some(path.to_path_buf()),
        ..NodeConfig::for_test()
    };
    let started = tokio::time::timeout(Duration::from_secs(5), node::start(config))
        .await
        .expect("start returns instead of blocking on the rule path");
    match started {
        Ok(_) => panic!("node started with rule path {}", path.display()),
        Err(e) => e.to_string(),
    }
}

/// Replace the file at `path` with a FIFO.
fn swap_in_fifo(path: &std::path::Path) {
    std::fs::remove_file(path).unwrap();
    mkfifo(path);
}

#[cfg(unix)]
#[tokio::test]
async fn a_fifo_rule_path_blocks_neither_reloads_nor_shutdown() {
    // Bypass closed: the watcher read a FIFO forever, so no later edit applied and
    // SIGTERM no longer stopped the node.
    let (_dir, path, node) = start_watching(2).await;
    let mut c = client(&node).await;
    let errors = counter_value(RELOADS, ERROR);
    swap_in_fifo(&path);
    assert!(
        eventually(Duration::from_secs(5), || counter_value(RELOADS, ERROR)
            > errors)
        .await,
        "the FIFO is refused and counted as a failed reload"
    );
    let a = c
        .check(check("a", "POST /v1/charges", None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (a.rule.as_str(), a.limit),
        ("charges", 2),
        "previous rules kept"
    );

    // A later edit still applies: the watcher is not stuck on the FIFO.
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, charges_rules(3)).unwrap();
    assert!(
        eventually(Duration::from_secs(5), || charges_limit(&node) == Some(3)).await,
        "the edit after the FIFO was picked up"
    );

    swap_in_fifo(&path);
    tokio::time::sleep(Duration::from_millis(200)).await;
    tokio::time::timeout(Duration::from_secs(5), node.shutdown())
        .await
        .expect("shutdown completes with a FIFO at the rule path");
}

#[cfg(unix)]
#[tokio::test]
async fn a_device_at_the_rule_path_is_refused_unread_and_leave_completes() {
    // Bypass closed: /dev/zero at the rule path was read until 2 GB.
    let (_dir, path, node) = start_watching(2).await;
    let errors = counter_value(RELOADS, ERROR);
    std::fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
    assert!(
        eventually(Duration::from_secs(5), || counter_value(RELOADS, ERROR)
            > errors)
        .await,
        "/dev/zero is refused and counted"
    );
    assert_eq!(charges_limit(&node), Some(2), "previous rules kept");
    tokio::time::timeout(Duration::from_secs(10), node.leave())
        .await
        .expect("leave completes with /dev/zero at the rule path");
}

#[tokio::test]
async fn an_empty_or_truncated_rule_file_keeps_the_previous_rules_and_counts_an_error() {
    // Bypass closed: an empty write was accepted as "ok, 1 rules", replacing every rule
    // with the built-in default.
    let (_dir, path, node) = start_watching(2).await;
    let mut c = client(&node).await;
    for broken in [
        "",
        "# rules\n",
        "[[rule]]\nname = \"charges\"\nroute = \"POST /v1/ch",
    ] {
        let errors = counter_value(RELOADS, ERROR);
        std::fs::write(&path, broken).unwrap();
        assert!(
            eventually(Duration::from_secs(5), || counter_value(RELOADS, ERROR)
                > errors)
            .await,
            "{broken:?} counted as a failed reload"
        );
        tokio::time::sleep(Duration::from_millis(150)).await;
        let a = c
            .check(check("a", "POST /v1/charges", None))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (a.rule.as_str(), a.limit),
            ("charges", 2),
            "{broken:?}: rules kept"
        );
    }
    // Only the default, said explicitly, is accepted.
    std::fs::write(&path, "[default]\nlimit = 7\nwindow = \"1m\"\n").unwrap();
    assert!(
        eventually(Duration::from_secs(5), || charges_limit(&node).is_none()).await,
        "an explicit [default] alone applies"
    );
    assert_eq!(node.rules.load().default_rule().limiter.max_cost(), 7);
    node.shutdown().await;
}

#[tokio::test]
async fn an_oversize_rule_file_is_refused_and_keeps_the_previous_rules() {
    let (_dir, path, node) = start_watching(2).await;
    let errors = counter_value(RELOADS, ERROR);
    let cap = usize::try_from(MAX_RULES_FILE_BYTES).unwrap();
    // Valid rules followed by a comment that takes the file past the cap.
    let mut big = charges_rules(9).into_bytes();
    big.push(b'#');
    big.resize(cap + 1, b'x');
    std::fs::write(&path, &big).unwrap();
    assert!(
        eventually(Duration::from_secs(5), || counter_value(RELOADS, ERROR)
            > errors)
        .await,
        "the oversize file is counted as a failed reload"
    );
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(charges_limit(&node), Some(2), "previous rules kept");
    node.shutdown().await;
}

#[cfg(unix)]
#[tokio::test]
async fn a_node_refuses_to_start_on_a_fifo_a_device_an_oversize_or_an_empty_rule_file() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.toml");
    mkfifo(&fifo);
    let e = start_error(&fifo).await;
    assert_eq!(
        e,
        format!(
            "rules: rules file {}: is a FIFO, not a regular file",
            fifo.display()
        )
    );
    let e = start_error(std::path::Path::new("/dev/zero")).await;
    assert_eq!(
        e,
        "rules: rules file /dev/zero: is a character device, not a regular file"
    );
    let big = dir.path().join("big.toml");
    let cap = usize::try_from(MAX_RULES_FILE_BYTES).unwrap();
    std::fs::write(&big, vec![b'#'; cap + 1]).unwrap();
    let e = start_error(&big).await;
    assert!(
        e.ends_with(&format!(
            "is {} bytes, over the limit of {cap} bytes (--max-rules-bytes)",
            cap + 1
        )),
        "{e}"
    );
    let empty = dir.path().join("empty.toml");
    std::fs::write(&empty, "").unwrap();
    let e = start_error(&empty).await;
    assert!(e.contains("defines no rules"), "{e}");
    let e = start_error(dir.path()).await;
    assert!(e.ends_with("is a directory, not a regular file"), "{e}");
}

#[cfg(unix)]
#[test]
fn rules_check_refuses_what_a_node_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.toml");
    mkfifo(&fifo);
    let empty = dir.path().join("empty.toml");
    std::fs::write(&empty, "").unwrap();
    let long = dir.path().join("long.toml");
    std::fs::write(&long, format!("name = \"{}\n", "x".repeat(500_000))).unwrap();
    let default_only = dir.path().join("default.toml");
    std::fs::write(&default_only, "[default]\nlimit = 5\nwindow = \"1s\"\n").unwrap();
    let run = |path: &std::path::Path| {
        let (tx, rx) = std::sync::mpsc::channel();
        let path = path.to_path_buf();
        std::thread::spawn(move || {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_ringlimit"))
                .args(["rules", "check"])
                .arg(&path)
                .output()
                .unwrap();
            tx.send(out).unwrap();
        });
        let out = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("rules check returns");
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.code(), text)
    };
    let (code, text) = run(&fifo);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("is a FIFO, not a regular file"), "{text}");
    let (code, text) = run(std::path::Path::new("/dev/zero"));
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("is a character device"), "{text}");
    let (code, text) = run(&empty);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("defines no rules"), "{text}");
    let (code, text) = run(&long);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.len() < 1_500, "bounded: {} bytes", text.len());
    let (code, text) = run(&default_only);
    assert_eq!(code, Some(0), "{text}");
}
/// The bypass closed here: counters used to be keyed by the concrete route string, so a
/// wildcard rule gave every path its own budget and `?nonce=N` a fresh one on every call.
const SCOPES: &str = r#"
[[rule]]
name = "v1"
route = "/v1/*"
algorithm = "fixed_window"
limit = 2
window = "1h"

[[rule]]
name = "vip"
client = "vip"
algorithm = "fixed_window"
limit = 2
window = "1h"

[[rule]]
name = "each"
route = "/each/*"
per = "route"
algorithm = "fixed_window"
limit = 2
window = "1h"
"#;

#[tokio::test]
async fn varying_the_path_or_query_string_never_opens_a_fresh_budget() {
    let (_dir, path) = common::rules_file(SCOPES);
    let config = NodeConfig {
        rules_path: Some(path),
        ..NodeConfig::for_test()
    };
    let (node, _clock) = start_manual(config, T0).await;
    let mut c = client(&node).await;
    let mut ask = async |key: &str, route: &str| {
        let a = c.check(check(key, route, None)).await.unwrap().into_inner();
        (a.rule, a.allowed, a.remaining)
    };

    // A wildcard rule is one budget for every route it matches, query strings included.
    assert_eq!(ask("c", "GET /v1/a").await, ("v1".into(), true, 1));
    assert_eq!(ask("c", "GET /v1/b").await, ("v1".into(), true, 0));
    assert_eq!(ask("c", "GET /v1/a?x=1").await, ("v1".into(), false, 0));
    for nonce in 0..5 {
        let (_, allowed, _) = ask("c", &format!("POST /v1/c/1?nonce={nonce}")).await;
        assert!(!allowed, "?nonce={nonce} is the same budget");
    }
    assert!(
        ask("other", "GET /v1/a").await.1,
        "another client has its own"
    );

    // A client rule without a route: one budget across all routes.
    assert_eq!(ask("vip", "GET /a").await, ("vip".into(), true, 1));
    assert_eq!(ask("vip", "POST /b?x=1").await, ("vip".into(), true, 0));
    assert_eq!(ask("vip", "GET /c").await, ("vip".into(), false, 0));

    // per = "route": each normalised route (method + path, no query) has its own budget.
    assert_eq!(ask("c", "GET /each/a").await, ("each".into(), true, 1));
    assert_eq!(ask("c", "GET /each/a?x=1").await, ("each".into(), true, 0));
    assert_eq!(ask("c", "GET /each/a#top").await, ("each".into(), false, 0));
    assert_eq!(ask("c", "GET /each/b").await, ("each".into(), true, 1));
    assert_eq!(ask("c", "POST /each/a").await, ("each".into(), true, 1));

    // The answer echoes the route as sent.
    let a = c
        .check(check("d", "GET /v1/z?q=1", None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(a.descriptors[0].route, "GET /v1/z?q=1");
    node.shutdown().await;
}

/// Bypass closed: only members speak for the cluster. A peer call without the cluster
/// key's proof, with another key's proof, or replaying a captured proof is refused
/// `UNAUTHENTICATED` before any peer handler runs, so nobody outside the cluster can
/// refund a spent budget, install counter state or decide checks on a node's counters.
#[tokio::test]
async fn peer_calls_without_the_cluster_key_are_unauthenticated() {
    use ringlimit::keyring::{Keyring, CALL_HEADER};
    use ringlimit::node::config::TEST_CLUSTER_SECRET;
    use ringlimit::proto::peer::peer_client::PeerClient;
    use ringlimit::proto::peer::{RefundItem, RefundRequest, RulesRequest, StatusRequest};

    let node = start(NodeConfig::for_test()).await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", node.peer_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let refund = RefundRequest {
        items: vec![RefundItem {
            key: "k".into(),
            route: "/x".into(),
            tier: None,
            cost: 100,
            at: 0,
            named: None,
        }],
    };
    fn unauthenticated<T>(result: Result<T, tonic::Status>) {
        match result {
            Err(status) => assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}"),
            Ok(_) => panic!("a peer call without a valid proof was served"),
        }
    }

    // No proof at all.
    let mut anonymous = PeerClient::new(channel.clone());
    unauthenticated(anonymous.refund(refund.clone()).await);
    unauthenticated(anonymous.status(StatusRequest {}).await);
    // The rule document is cluster state: only members may read it, or write it (a
    // write over the peer face needs no admin token, so the cluster key is what guards it).
    unauthenticated(
        anonymous
            .rules(RulesRequest {
                from_node: "intruder".into(),
            })
            .await,
    );
    let takeover = ringlimit::proto::peer::WriteRulesRequest {
        from_node: "intruder".into(),
        if_match: None,
        kind: "replace".into(),
        tier: String::new(),
        route_pattern: None,
        body: r#"{"default": {"limit": 1000000000, "window": "1s"}}"#.into(),
    };
    unauthenticated(anonymous.write_rules(takeover.clone()).await);
    // A forward stream is one call: refused whole before any batch on it is read.
    let forwards = || {
        tokio_stream::iter(vec![ringlimit::proto::peer::ForwardCall {
            call: 1,
            request: Some(ringlimit::proto::peer::ForwardRequest {
                from_node: "intruder".into(),
                items: vec![],
                deadline_ms: 0,
                compact: false,
            }),
        }])
    };
    unauthenticated(anonymous.forward_stream(forwards()).await);

    // A proof made with another key.
    let other = Keyring::from_text("another-cluster-secret-of-enough-length-000").unwrap();
    let mut outsider = PeerClient::new(ringlimit::cluster::link::Signed::new(
        channel.clone(),
        Some(other),
        "intruder".into(),
    ));
    unauthenticated(outsider.refund(refund.clone()).await);
    unauthenticated(
        outsider
            .rules(RulesRequest {
                from_node: "intruder".into(),
            })
            .await,
    );
    unauthenticated(outsider.write_rules(takeover.clone()).await);
    unauthenticated(outsider.forward_stream(forwards()).await);

    // A member's captured proof, sent again.
    let key = Keyring::from_text(TEST_CLUSTER_SECRET).unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let captured: tonic::metadata::MetadataValue<_> = key
        .sign_call("/ringlimit.peer.v1.Peer/Status", "member", now, 42)
        .parse()
        .unwrap();
    let mut replayer =
        PeerClient::with_interceptor(channel.clone(), move |mut r: tonic::Request<()>| {
            r.metadata_mut().insert(CALL_HEADER, captured.clone());
            Ok(r)
        });
    assert!(
        replayer.status(StatusRequest {}).await.is_ok(),
        "the first use passes"
    );
    unauthenticated(replayer.status(StatusRequest {}).await);
    // ... and a fresh proof made for Status is useless for Refund, on its first use.
    let for_status: tonic::metadata::MetadataValue<_> = key
        .sign_call("/ringlimit.peer.v1.Peer/Status", "member", now, 43)
        .parse()
        .unwrap();
    let mut misused =
        PeerClient::with_interceptor(channel.clone(), move |mut r: tonic::Request<()>| {
            r.metadata_mut().insert(CALL_HEADER, for_status.clone());
            Ok(r)
        });
    unauthenticated(misused.refund(refund.clone()).await);

    // A member's own signed calls are served.
    let mut member = PeerClient::new(ringlimit::cluster::link::Signed::new(
        channel,
        Some(key),
        "member".into(),
    ));
    assert!(member.status(StatusRequest {}).await.is_ok());
    let rules = member
        .rules(RulesRequest {
            from_node: "member".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((rules.source.as_str(), rules.version), ("cluster", 0));
    assert_eq!(
        node.cluster_rules.current().version,
        0,
        "no unauthenticated write got through"
    );
    node.shutdown().await;
}

#[tokio::test]
async fn a_shadow_rule_counts_and_reports_its_denials_but_allows_and_refunds_nothing() {
    let (_dir, path) = rules_file(
        "[[rule]]\nname = \"dark-launch\"\ntier = \"shadow\"\nlimit = 2\nwindow = \"1m\"\nmode = \"shadow\"\n\n[[rule]]\nname = \"ip-enforced\"\nclient = \"ip:1\"\nlimit = 10\nwindow = \"1m\"\n",
    );
    let config = NodeConfig {
        rules_path: Some(path),
        ..NodeConfig::for_test()
    };
    let (node, _clock) = start_manual(config, T0).await;
    let mut c = client(&node).await;
    let before = counter_value("ringlimit_shadow_denials_total", "rule=\"dark-launch\"");
    let mut req = check("cust_7", "/x", None);
    req.tier = Some("shadow".into());
    req.descriptors = vec![descriptor("ip:1")];
    for i in 1..=4u64 {
        let a = c.check(req.clone()).await.unwrap().into_inner();
        assert!(a.allowed, "check {i}: shadow mode never denies");
        assert_eq!(a.retry_after_ms, 0);
        let shadow = &a.descriptors[0];
        assert_eq!(shadow.rule, "dark-launch");
        assert_eq!(a.shadow_denied, i > 2, "check {i}");
        assert_eq!(shadow.shadow_denied, i > 2);
        assert_eq!(shadow.allowed, i <= 2, "the would-be answer is reported");
        let ip = &a.descriptors[1];
        assert!(
            ip.allowed && !ip.refunded,
            "a shadow denial refunds no sibling"
        );
        assert_eq!(ip.remaining, 10 - i);
    }
    let after = counter_value("ringlimit_shadow_denials_total", "rule=\"dark-launch\"");
    assert_eq!(after - before, 2);
    node.shutdown().await;
}
