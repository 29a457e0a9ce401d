//! An operator's view of one client's counters (`GET`/`DELETE /v1/counters`, `ringlimit
//! counters get|reset`) on a two-node cluster in one process: read on the key's owner
//! from any node, charging nothing; reset only with the admin token on the ops face and
//! only by a member on the peer face.

mod common;

use std::path::Path;

use ringlimit::cluster::link::Signed;
use ringlimit::keyring::Keyring;
use ringlimit::node::config::TEST_CLUSTER_SECRET;
use ringlimit::node::RunningNode;
use ringlimit::proto::peer::peer_client::PeerClient;
use ringlimit::proto::peer::CountersRequest;
use ringlimit::server::ops::AdminToken;

use common::{check, client, http, key_owned_by, member_config, rules_file, start, wait_converged};

const TOKEN: &str = "test-admin-token-0123456789";

/// 10 per hour on `GET /t` (one budget per client), 5 per hour per route on `POST /up/*`:
/// sliding logs, so no window boundary can fall inside a test.
const RULES: &str = r#"
[[rule]]
name = "t"
route = "GET /t"
algorithm = "sliding_window_log"
limit = 10
window = "1h"

[[rule]]
name = "uploads"
route = "POST /up/*"
per = "route"
algorithm = "sliding_window_log"
limit = 5
window = "1h"
"#;

/// Nodes "a" and "b" with the admin token, agreeing on a ring of both.
async fn two_nodes(rules: &Path) -> Vec<RunningNode> {
    let mut nodes: Vec<RunningNode> = Vec::new();
    for id in ["a", "b"] {
        let seeds: Vec<String> = nodes
            .first()
            .map(|n| n.gossip_addr.to_string())
            .into_iter()
            .collect();
        let config = ringlimit::node::NodeConfig {
            admin_token: Some(AdminToken::new(TOKEN).unwrap()),
            ..member_config(id, &seeds, Some(rules))
        };
        nodes.push(start(config).await);
    }
    wait_converged(&nodes, 2).await;
    nodes
}

fn ops(node: &RunningNode) -> std::net::SocketAddr {
    node.http_addr.expect("ops port")
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// `remaining` of one check of `key` on `route` through `node`.
async fn remaining_after_check(node: &RunningNode, key: &str, route: &str) -> u64 {
    let answer = client(node)
        .await
        .check(check(key, route, None))
        .await
        .unwrap()
        .into_inner();
    assert!(answer.allowed, "{key} on {route}: {answer:?}");
    answer.remaining
}

/// The counter of rule `rule` in a counters answer.
fn counter<'a>(body: &'a serde_json::Value, rule: &str) -> Option<&'a serde_json::Value> {
    body["counters"]
        .as_array()
        .expect("a counters list")
        .iter()
        .find(|c| c["rule"] == rule)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_non_owner_shows_the_owners_numbers_and_charges_nothing() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = two_nodes(&rules).await;
    let key = key_owned_by("a", &["a", "b"], "cust-");
    // Checks on the owner itself: a forward that timed out on a loaded machine would be
    // decided on the fail-open fallback's counters instead.
    for _ in 0..3 {
        remaining_after_check(&nodes[0], &key, "GET /t").await;
    }
    let path = format!("/v1/counters?key={key}");
    for _ in 0..5 {
        let answer = http(ops(&nodes[1]), "GET", &path, &[], "").await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        let body = answer.json();
        assert_eq!(body["owner"]["node_id"], "a", "answered by the key's owner");
        let t = counter(&body, "t").expect("the rule's counter is listed");
        assert_eq!(t["algorithm"], "sliding_window_log");
        assert_eq!(t["limit"], 10);
        assert_eq!(t["used"], 3);
        assert_eq!(t["remaining"], 7);
        assert!(t["reset_at_ms"].as_u64().unwrap() > 0);
    }
    // Five reads later, the next check still finds 7 left (and takes one).
    assert_eq!(remaining_after_check(&nodes[0], &key, "GET /t").await, 6);
    // The owner answers the same for itself.
    let body = http(ops(&nodes[0]), "GET", &path, &[], "").await.json();
    assert_eq!(counter(&body, "t").unwrap()["used"], 4);
    // A client with no state has no counters to show.
    let unused = http(ops(&nodes[1]), "GET", "/v1/counters?key=nobody", &[], "").await;
    assert_eq!(unused.status, 200);
    assert_eq!(unused.json()["counters"], serde_json::json!([]));
    for node in nodes {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_per_route_counter_appears_only_with_its_route() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = two_nodes(&rules).await;
    let key = key_owned_by("b", &["a", "b"], "up-");
    remaining_after_check(&nodes[1], &key, "POST /up/photos").await;
    remaining_after_check(&nodes[1], &key, "POST /up/photos?size=2").await;
    remaining_after_check(&nodes[1], &key, "POST /up/videos").await;
    let without = http(
        ops(&nodes[0]),
        "GET",
        &format!("/v1/counters?key={key}"),
        &[],
        "",
    )
    .await;
    assert!(counter(&without.json(), "uploads").is_none());
    let with = http(
        ops(&nodes[0]),
        "GET",
        &format!("/v1/counters?key={key}&route=POST%20%2Fup%2Fphotos"),
        &[],
        "",
    )
    .await
    .json();
    let uploads = counter(&with, "uploads").expect("listed with its route");
    assert_eq!(uploads["route"], "POST /up/photos");
    assert_eq!(
        uploads["used"], 2,
        "the query string is not part of the route"
    );
    assert_eq!(uploads["algorithm"], "sliding_window_log");
    for node in nodes {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn reset_needs_the_admin_token_and_gives_the_full_limit_back() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = two_nodes(&rules).await;
    let key = key_owned_by("a", &["a", "b"], "reset-");
    for _ in 0..4 {
        remaining_after_check(&nodes[0], &key, "GET /t").await;
    }
    let path = format!("/v1/counters?key={key}");
    let refused = [
        (vec![], 401),
        (
            vec![("Authorization", bearer("wrong-token-0123456789"))],
            401,
        ),
        (vec![("Authorization", "Basic abc".to_string())], 401),
    ];
    for (headers, status) in refused {
        let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let answer = http(ops(&nodes[1]), "DELETE", &path, &headers, "").await;
        assert_eq!(answer.status, status, "{headers:?}: {}", answer.body);
    }
    let body = http(ops(&nodes[1]), "GET", &path, &[], "").await.json();
    assert_eq!(
        counter(&body, "t").unwrap()["used"],
        4,
        "a refused reset changed nothing"
    );

    let token = bearer(TOKEN);
    let answer = http(
        ops(&nodes[1]),
        "DELETE",
        &path,
        &[("Authorization", &token)],
        "",
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let body = answer.json();
    assert_eq!(body["reset"], true);
    assert_eq!(body["owner"]["node_id"], "a");
    assert_eq!(
        counter(&body, "t").unwrap()["used"],
        4,
        "the answer says what the reset took away"
    );
    let after = http(ops(&nodes[0]), "GET", &path, &[], "").await.json();
    assert_eq!(
        after["counters"],
        serde_json::json!([]),
        "as fresh as a new key"
    );
    assert_eq!(
        remaining_after_check(&nodes[0], &key, "GET /t").await,
        9,
        "the whole limit is back"
    );
    for node in nodes {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_without_an_admin_token_refuses_every_reset() {
    let (_dir, rules) = rules_file(RULES);
    let node = start(member_config("solo", &[], Some(&rules))).await;
    remaining_after_check(&node, "k", "GET /t").await;
    let answer = http(
        ops(&node),
        "DELETE",
        "/v1/counters?key=k",
        &[("Authorization", &bearer(TOKEN))],
        "",
    )
    .await;
    assert_eq!(answer.status, 403, "{}", answer.body);
    assert_eq!(remaining_after_check(&node, "k", "GET /t").await, 8);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_is_refused_with_the_field_named_and_touches_nothing() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = two_nodes(&rules).await;
    let key = key_owned_by("a", &["a", "b"], "bad-");
    remaining_after_check(&nodes[0], &key, "GET /t").await;
    let long = "k".repeat(ringlimit::config::bounds::MAX_KEY_BYTES + 1);
    let token = bearer(TOKEN);
    let cases = [
        ("/v1/counters".to_string(), "key: required"),
        ("/v1/counters?key=".to_string(), "key: must not be empty"),
        (format!("/v1/counters?key={long}"), "key: "),
        (format!("/v1/counters?key={key}&route=nopath"), "route: "),
        (format!("/v1/counters?key={key}&tier="), "tier: "),
        (format!("/v1/counters?key={key}%FF"), "key: not a valid"),
    ];
    for (path, message) in &cases {
        for method in ["GET", "DELETE"] {
            let answer = http(
                ops(&nodes[1]),
                method,
                path,
                &[("Authorization", &token)],
                "",
            )
            .await;
            assert_eq!(answer.status, 400, "{method} {path}: {}", answer.body);
            let error = answer.json()["error"].as_str().unwrap().to_string();
            assert!(error.starts_with(message), "{method} {path}: {error}");
        }
    }
    assert_eq!(
        remaining_after_check(&nodes[0], &key, "GET /t").await,
        8,
        "nothing was reset"
    );
    for node in nodes {
        node.shutdown().await;
    }
}

/// Bypass closed: a reset over the peer face needs no admin token, so the cluster key
/// is what guards it. A caller without the key's proof, or with another cluster's, is
/// refused `UNAUTHENTICATED` before the handler runs, and the counter keeps its count:
/// no outside input changes a counter except a check that pays for it.
#[tokio::test(flavor = "multi_thread")]
async fn a_peer_counters_call_without_the_cluster_key_is_refused_and_changes_nothing() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = two_nodes(&rules).await;
    let key = key_owned_by("a", &["a", "b"], "attack-");
    for _ in 0..10 {
        remaining_after_check(&nodes[0], &key, "GET /t").await;
    }
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", nodes[0].peer_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let reset = CountersRequest {
        from_node: "intruder".into(),
        key: key.clone(),
        route: None,
        tier: None,
        reset: true,
        requested_by: "intruder".into(),
    };
    let mut anonymous = PeerClient::new(channel.clone());
    let status = anonymous.counters(reset.clone()).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    let other = Keyring::from_text("another-cluster-secret-of-enough-length-000").unwrap();
    let mut outsider = PeerClient::new(Signed::new(channel.clone(), Some(other), "b".into()));
    let status = outsider.counters(reset.clone()).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    let denied = client(&nodes[0])
        .await
        .check(check(&key, "GET /t", None))
        .await
        .unwrap()
        .into_inner();
    assert!(!denied.allowed, "the exhausted budget stays exhausted");

    // A member (the cluster key) is served, and a bad key is refused there too.
    let keyring = Keyring::from_text(TEST_CLUSTER_SECRET).unwrap();
    let mut member = PeerClient::new(Signed::new(channel, Some(keyring), "b".into()));
    let status = member
        .counters(CountersRequest {
            key: String::new(),
            ..reset.clone()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    let read = member
        .counters(CountersRequest {
            reset: false,
            ..reset.clone()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(read.node_id, "a");
    assert_eq!(read.counters[0].remaining, 0);
    for node in nodes {
        node.shutdown().await;
    }
}

/// Runs the `ringlimit` binary with `args`; (exit code, stdout, stderr).
async fn cli(args: Vec<String>) -> (i32, String, String) {
    tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ringlimit"))
            .args(&args)
            .output()
            .expect("the binary runs");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_reads_and_resets_a_clients_counters() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = two_nodes(&rules).await;
    let key = key_owned_by("a", &["a", "b"], "cli-");
    for _ in 0..2 {
        remaining_after_check(&nodes[0], &key, "GET /t").await;
    }
    let addr = ops(&nodes[1]).to_string();
    let args = |words: &[&str]| -> Vec<String> { words.iter().map(|w| w.to_string()).collect() };

    let (code, out, err) = cli(args(&["counters", "get", "--key", &key, "--addr", &addr])).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("on a@"), "{out}");
    assert!(
        out.contains("t (sliding_window_log): used 2 of 10, remaining 8"),
        "{out}"
    );

    let (code, _, err) = cli(args(&["counters", "reset", "--key", &key, "--addr", &addr])).await;
    assert_eq!(code, 1, "refused without a token");
    assert!(err.contains("401"), "{err}");

    let token_dir = tempfile::tempdir().unwrap();
    let token_file = token_dir.path().join("admin.token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let (code, out, err) = cli(args(&[
        "counters",
        "reset",
        "--key",
        &key,
        "--addr",
        &addr,
        "--admin-token-file",
        token_file.to_str().unwrap(),
    ]))
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("reset on a@"), "{out}");
    assert!(out.contains("used 2 of 10"), "{out}");
    assert_eq!(remaining_after_check(&nodes[0], &key, "GET /t").await, 9);

    let (code, _, err) = cli(args(&["counters", "get", "--key", "", "--addr", &addr])).await;
    assert_eq!(code, 1, "an empty key is refused");
    assert!(
        err.contains("400") && err.contains("key: must not be empty"),
        "{err}"
    );
    for node in nodes {
        node.shutdown().await;
    }
}
