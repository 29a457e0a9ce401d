//! Concurrency limits (`ringlimit.v1` `Acquire`/`Release`, a rule's `concurrency = N`):
//! exact on the key's owner whichever node a call arrives at, a lease ends at its TTL,
//! bad / forged / repeated releases change nothing, and an owner restart loses the
//! leases it held (its successor starts with none in flight: documented, and pinned
//! here).

mod common;

use std::time::Duration;

use ringlimit::cluster::link::ForwardConfig;
use ringlimit::config::rules::RuleSet;
use ringlimit::node::RunningNode;
use ringlimit::proto::{AcquireRequest, AcquireResponse, ReleaseRequest, ReleaseResponse};
use tonic::Code;

use common::{client, key_owned_by, member_config, rules_file, start, start_manual};

/// At most 3 `POST /v1/jobs` in flight per client (and 1,000 per hour, not charged by
/// leases); `GET /plain` declares no concurrency limit.
const RULES: &str = r#"
[[rule]]
name = "jobs"
route = "POST /v1/jobs"
limit = 1000
window = "1h"
concurrency = 3

[[rule]]
name = "plain"
route = "GET /plain"
limit = 10
window = "1h"
"#;

const JOBS: &str = "POST /v1/jobs";

async fn two_nodes(rules: &std::path::Path) -> Vec<RunningNode> {
    let mut nodes: Vec<RunningNode> = Vec::new();
    for id in ["a", "b"] {
        let seeds: Vec<String> = nodes
            .first()
            .map(|n| n.gossip_addr.to_string())
            .into_iter()
            .collect();
        let mut config = member_config(id, &seeds, Some(rules));
        config.forward = ForwardConfig {
            timeout: Duration::from_secs(5),
            ..config.forward.clone()
        };
        nodes.push(start(config).await);
    }
    common::wait_converged(&nodes, 2).await;
    nodes
}

fn acquire_request(key: &str, route: &str, ttl_ms: Option<i64>) -> AcquireRequest {
    AcquireRequest {
        key: key.into(),
        route: route.into(),
        tier: None,
        ttl_ms,
    }
}

async fn acquire(node: &RunningNode, key: &str) -> AcquireResponse {
    client(node)
        .await
        .acquire(acquire_request(key, JOBS, None))
        .await
        .unwrap()
        .into_inner()
}

async fn release(node: &RunningNode, id: &str) -> Result<ReleaseResponse, tonic::Status> {
    client(node)
        .await
        .release(ReleaseRequest {
            lease_id: id.into(),
        })
        .await
        .map(|r| r.into_inner())
}

fn granted(r: &AcquireResponse) -> bool {
    r.check.as_ref().unwrap().allowed
}

#[tokio::test(flavor = "multi_thread")]
async fn ten_concurrent_acquires_through_two_nodes_hold_exactly_the_limit() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = two_nodes(&rules).await;
    let key = key_owned_by("a", &["a", "b"], "jobs-");
    let (a, b) = (client(&nodes[0]).await, client(&nodes[1]).await);
    let calls = (0..10).map(|i| {
        let mut c = if i % 2 == 0 { a.clone() } else { b.clone() };
        let request = acquire_request(&key, JOBS, None);
        tokio::spawn(async move { c.acquire(request).await.map(|r| r.into_inner()) })
    });
    let answers: Vec<AcquireResponse> = futures_util::future::join_all(calls)
        .await
        .into_iter()
        .map(|r| r.unwrap().expect("answered"))
        .collect();
    let held: Vec<&AcquireResponse> = answers.iter().filter(|r| granted(r)).collect();
    assert_eq!(held.len(), 3, "exactly the concurrency limit");
    for r in &answers {
        let check = r.check.as_ref().unwrap();
        assert_eq!(check.limit, 3);
        assert_eq!(check.decider.as_ref().unwrap().node_id, "a");
        assert_eq!(granted(r), !r.lease_id.is_empty());
    }
    // A release through the other node frees one place, for one acquire.
    let done = release(&nodes[1], &held[0].lease_id).await.unwrap();
    assert!(done.released && !done.moved);
    assert_eq!(
        (done.limit, done.remaining, done.rule.as_str()),
        (3, 1, "jobs")
    );
    let again = acquire(&nodes[1], &key).await;
    assert!(granted(&again));
    assert_eq!(again.check.as_ref().unwrap().remaining, 0);
    assert!(!granted(&acquire(&nodes[0], &key).await));
    // Another client has its own places.
    assert!(granted(&acquire(&nodes[0], "someone-else").await));
    for node in nodes {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lease_not_released_ends_at_its_ttl() {
    let (_dir, rules) = rules_file(RULES);
    let config = member_config("solo", &[], Some(&rules));
    let (node, clock) = start_manual(config, 1_800_000_000_000).await;
    let mut c = client(&node).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let r = c
            .acquire(acquire_request("slow", JOBS, Some(1_000)))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.expires_at, 1_800_000_001_000);
        ids.push(r.lease_id);
    }
    assert!(!granted(&acquire(&node, "slow").await));
    clock.advance(1_000);
    let r = acquire(&node, "slow").await;
    assert!(granted(&r), "the three leases ended at their TTL");
    let late = release(&node, &ids[0]).await.unwrap_err();
    assert_eq!(late.code(), Code::FailedPrecondition);
    assert_eq!(
        late.message(),
        "lease_id: expired at 1800000001000 (Unix ms) before this release, so it was released \
         then; nothing changed"
    );
    assert_eq!(
        r.check.unwrap().remaining,
        2,
        "the late release freed nothing"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_acquires_and_forged_repeated_or_misdirected_releases_change_nothing() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = two_nodes(&rules).await;
    let key = key_owned_by("b", &["a", "b"], "bad-");
    let status = client(&nodes[0])
        .await
        .acquire(acquire_request(&key, "GET /plain", None))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(
        status.message(),
        "key: the rule that applies (\"plain\") declares no concurrency limit: add \
         `concurrency = N` to it, or to a more specific rule for this key, route or tier"
    );
    for (ttl, message) in [
        (
            0,
            "ttl_ms: must be a positive number of milliseconds (got 0)",
        ),
        (
            3_600_001,
            "ttl_ms: 3600001 is over the limit of 3600000 (one hour)",
        ),
    ] {
        let status = client(&nodes[0])
            .await
            .acquire(acquire_request(&key, JOBS, Some(ttl)))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), message);
    }
    let held = acquire(&nodes[0], &key).await;
    let (head, tag) = held.lease_id.rsplit_once('.').unwrap();
    let flipped = if tag.ends_with('0') { "1" } else { "0" };
    let forged = format!("{head}.{}{flipped}", &tag[..tag.len() - 1]);
    let status = release(&nodes[0], &forged).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(
        status.message(),
        "lease_id: no lease with this id was granted on its owner; nothing changed"
    );
    let status = release(&nodes[0], "hello").await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(
        status.message(),
        "lease_id: not a reservation id this cluster made (malformed)"
    );
    // A lease id is not a reservation id, and the other way round.
    let as_commit = client(&nodes[0])
        .await
        .commit(ringlimit::proto::CommitRequest {
            reservation_id: held.lease_id.clone(),
            actual: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(as_commit.code(), Code::InvalidArgument);
    assert_eq!(
        as_commit.message(),
        "reservation_id: a lease id, not a reservation id: end it with Release"
    );
    release(&nodes[1], &held.lease_id).await.unwrap();
    let again = release(&nodes[0], &held.lease_id).await.unwrap_err();
    assert_eq!(again.code(), Code::FailedPrecondition);
    assert_eq!(
        again.message(),
        "lease_id: already released: a lease is released once; nothing changed"
    );
    for _ in 0..3 {
        assert!(
            granted(&acquire(&nodes[1], &key).await),
            "nothing was held twice"
        );
    }
    assert!(!granted(&acquire(&nodes[1], &key).await));
    for node in nodes {
        node.shutdown().await;
    }
}

/// What an owner crash or restart does to held leases: they are lost with it. Its
/// successor (here the same node id, restarted: a new generation) starts with none in
/// flight, so up to the limit more are granted while the old ones may still run; a
/// release of an old lease is answered `moved` and ends nothing.
#[tokio::test(flavor = "multi_thread")]
async fn an_owner_restart_loses_its_leases_and_old_releases_end_nothing() {
    let (_dir, rules) = rules_file(RULES);
    let before = start(member_config("solo", &[], Some(&rules))).await;
    let mut old = Vec::new();
    for _ in 0..3 {
        let r = acquire(&before, "crash").await;
        assert!(granted(&r));
        old.push(r.lease_id);
    }
    assert!(!granted(&acquire(&before, "crash").await));
    before.shutdown().await;

    let after = start(member_config("solo", &[], Some(&rules))).await;
    for _ in 0..3 {
        assert!(
            granted(&acquire(&after, "crash").await),
            "in flight restarted at 0"
        );
    }
    let done = release(&after, &old[0]).await.unwrap();
    assert!(done.moved && !done.released, "{done:?}");
    assert!(
        !granted(&acquire(&after, "crash").await),
        "the old release freed nothing"
    );
    after.shutdown().await;
}

#[test]
fn a_concurrency_limit_is_validated_like_every_rule_field() {
    let rule = |value: &str| {
        format!("[[rule]]\nname = \"jobs\"\nroute = \"/j\"\nlimit = 5\nwindow = \"1m\"\nconcurrency = {value}\n")
    };
    let set = RuleSet::from_toml_str(&rule("7")).unwrap();
    assert_eq!(set.get("jobs").unwrap().concurrency, Some(7));
    for (value, message) in [
        ("0", "must be an integer >= 1 (got 0)"),
        ("-3", "must be an integer >= 1 (got -3)"),
        ("1000001", "must be at most 1000000 (got 1000001)"),
    ] {
        let error = RuleSet::from_toml_str(&rule(value))
            .unwrap_err()
            .to_string();
        assert_eq!(
            error,
            format!("rule \"jobs\": field \"concurrency\": {message}")
        );
    }
    let error = RuleSet::from_toml_str("[default]\nlimit = 5\nwindow = \"1m\"\nconcurrency = 2\n")
        .unwrap_err()
        .to_string();
    assert!(error.contains("unknown field `concurrency`"), "{error}");
}
