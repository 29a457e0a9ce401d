//! Per-customer limits at scale (issue 26, point 6): 100,000 per-client rules, one
//! `[[rule]]` per customer id, load from a file, are accepted by the rules API, travel to
//! a peer and back from the data dir; a document over `--max-rules-bytes` is refused by
//! every path with a message naming the flag.

mod common;

use std::fmt::Write;
use std::time::{Duration, Instant};

use common::{check, client, http, member_config, start};
use ringlimit::config::rules::{load_stored_capped, MAX_RULES_FILE_BYTES};
use ringlimit::node::{self, NodeConfig};
use ringlimit::server::ops::AdminToken;

const CUSTOMERS: usize = 100_000;
const TOKEN: &str = "test-admin-token-0123456789";

/// A SaaS's rule file: a default, then one rule per customer id (about 7.7 MB).
fn per_client_rules(customers: usize) -> String {
    let mut text = String::with_capacity(customers * 80);
    text.push_str("[default]\nlimit = 100\nwindow = \"1m\"\n");
    for i in 0..customers {
        write!(
            text,
            "[[rule]]\nname = \"cust_{i:06}\"\nclient = \"cust_{i:06}\"\nlimit = {}\nwindow = \"1m\"\n",
            1_000 + i % 1_000
        )
        .unwrap();
    }
    text
}

async fn limit_of(node: &node::RunningNode, key: &str) -> u64 {
    let mut c = client(node).await;
    let answer = c
        .check(check(key, "GET /v1/things", None))
        .await
        .expect("check answered")
        .into_inner();
    answer.limit
}

#[tokio::test]
async fn a_node_loads_100k_per_client_rules_from_a_file_and_matches_each_client() {
    let text = per_client_rules(CUSTOMERS);
    assert!(text.len() as u64 > 7_000_000 && (text.len() as u64) < MAX_RULES_FILE_BYTES);
    let (_dir, path) = common::rules_file(&text);
    let started = Instant::now();
    let node = start(NodeConfig {
        rules_path: Some(path),
        ..NodeConfig::for_test()
    })
    .await;
    println!(
        "{CUSTOMERS} per-client rules ({} bytes) loaded and node started in {:?}",
        text.len(),
        started.elapsed()
    );
    assert_eq!(node.rules.load().len(), CUSTOMERS + 1);
    assert_eq!(limit_of(&node, "cust_000000").await, 1_000);
    assert_eq!(limit_of(&node, "cust_099999").await, 1_999);
    assert_eq!(
        limit_of(&node, "cust_100000").await,
        100,
        "no rule: the default"
    );
    node.shutdown().await;
}

#[tokio::test]
async fn a_rule_file_over_the_cap_is_refused_naming_the_flag() {
    let text = per_client_rules(1_000);
    let (_dir, path) = common::rules_file(&text);
    let cap = text.len() as u64 - 1;
    let started = node::start(NodeConfig {
        rules_path: Some(path),
        max_rules_bytes: cap,
        ..NodeConfig::for_test()
    })
    .await;
    let e = match started {
        Ok(_) => panic!("a node started on a rule file over its cap"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.ends_with(&format!(
            "is {} bytes, over the limit of {cap} bytes (--max-rules-bytes)",
            text.len()
        )),
        "{e}"
    );
    // One byte more of cap and the same file loads.
    let (_dir, path) = common::rules_file(&text);
    let node = start(NodeConfig {
        rules_path: Some(path),
        max_rules_bytes: cap + 1,
        ..NodeConfig::for_test()
    })
    .await;
    assert_eq!(node.rules.load().len(), 1_001);
    node.shutdown().await;
}

/// A document the file path accepts is accepted by the rules API and read back from the
/// data dir; one byte over the cap is refused by the API (413, naming the flag) and
/// changes nothing.
#[tokio::test]
async fn the_rules_api_and_the_data_dir_accept_what_the_file_accepts() {
    let text = per_client_rules(CUSTOMERS);
    let dir = tempfile::tempdir().unwrap();
    let node = start(NodeConfig {
        data_dir: Some(dir.path().to_path_buf()),
        admin_token: Some(AdminToken::new(TOKEN).unwrap()),
        ..NodeConfig::for_test()
    })
    .await;
    let ops = node.http_addr.unwrap();
    let bearer = format!("Bearer {TOKEN}");
    let started = Instant::now();
    let answer = http(
        ops,
        "PUT",
        "/v1/rules",
        &[("Authorization", &bearer)],
        &text,
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    println!(
        "PUT /v1/rules of {CUSTOMERS} per-client rules ({} bytes) answered in {:?}",
        text.len(),
        started.elapsed()
    );
    assert_eq!(node.rules.load().len(), CUSTOMERS + 1);
    assert_eq!(limit_of(&node, "cust_054321").await, 1_321);
    // The stored copy (pretty JSON, larger than the TOML) reads back under the same cap.
    let stored_bytes = std::fs::metadata(dir.path().join("rules.json"))
        .unwrap()
        .len();
    println!("stored copy: {stored_bytes} bytes");
    let (stamp, stored) = load_stored_capped(dir.path(), MAX_RULES_FILE_BYTES)
        .unwrap()
        .expect("stored");
    assert_eq!(stored.len(), CUSTOMERS + 1);
    // Over the cap: refused by the API, naming the flag, and nothing changes.
    let cap = usize::try_from(MAX_RULES_FILE_BYTES).unwrap();
    let mut over = text.clone();
    over.push('#');
    over.push_str(&"x".repeat(cap - over.len()));
    over.push('\n');
    assert_eq!(over.len(), cap + 1);
    let answer = http(
        ops,
        "PUT",
        "/v1/rules",
        &[("Authorization", &bearer)],
        &over,
    )
    .await;
    assert_eq!(answer.status, 413, "{}", answer.body);
    assert!(
        answer.body.contains(&format!(
            "over the limit of {cap} bytes (--max-rules-bytes)"
        )),
        "{}",
        answer.body
    );
    assert_eq!(
        node.cluster_rules.current().stamp(),
        stamp,
        "nothing changed"
    );
    node.shutdown().await;
}

/// A document the rules API accepts is copied to a peer over the peer face: about 8 MB
/// as JSON, so the peer client decodes answers up to `node::config::peer_message_cap`,
/// past tonic's 4 MiB default (a pull failed there before).
#[tokio::test]
async fn a_peer_copies_100k_per_client_rules() {
    let text = per_client_rules(CUSTOMERS);
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let config = |id: &str, seeds: &[String], dir: &std::path::Path| NodeConfig {
        data_dir: Some(dir.to_path_buf()),
        admin_token: Some(AdminToken::new(TOKEN).unwrap()),
        ..member_config(id, seeds, None)
    };
    let a = start(config("a", &[], dirs[0].path())).await;
    let b = start(config("b", &[a.gossip_addr.to_string()], dirs[1].path())).await;
    let nodes = vec![a, b];
    common::wait_converged(&nodes, 2).await;
    let ops = nodes[0].http_addr.unwrap();
    let bearer = format!("Bearer {TOKEN}");
    let answer = http(
        ops,
        "PUT",
        "/v1/rules",
        &[("Authorization", &bearer)],
        &text,
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    for node in &nodes {
        let copied = common::eventually(Duration::from_secs(30), || {
            node.rules.load().len() == CUSTOMERS + 1
        })
        .await;
        assert!(
            copied,
            "node {:?} has {} rules",
            node.decider,
            node.rules.load().len()
        );
        assert_eq!(limit_of(node, "cust_054321").await, 1_321);
    }
    for node in nodes {
        node.shutdown().await;
    }
}
