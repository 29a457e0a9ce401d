//! Reserve and commit (`ringlimit.v1` `Reserve`/`Commit`) on a two-node cluster in one
//! process: reservations are exact on the key's owner whichever node they arrive at;
//! commits give back or charge the difference there; an uncommitted reservation stays
//! charged at its amount; bad, forged, repeated and late commits change nothing; the
//! peer calls behind them need the cluster key.

mod common;

use std::time::Duration;

use ringlimit::cluster::link::{ForwardConfig, Signed};
use ringlimit::keyring::Keyring;
use ringlimit::node::RunningNode;
use ringlimit::proto::peer::peer_client::PeerClient;
use ringlimit::proto::peer::{PeerCommitRequest, PeerReserveRequest};
use ringlimit::proto::{CommitRequest, CommitResponse, ReserveRequest, ReserveResponse};
use tonic::Code;

use common::{check, client, key_owned_by, member_config, rules_file, start, start_manual};

/// 1,000 tokens per hour per client on `POST /v1/chat`: a sliding log (exact, and no
/// window boundary inside a test); 10 per hour on `GET /small`.
const RULES: &str = r#"
[[rule]]
name = "tokens"
route = "POST /v1/chat"
algorithm = "sliding_window_log"
limit = 1000
window = "1h"

[[rule]]
name = "small"
route = "GET /small"
algorithm = "fixed_window"
limit = 10
window = "1h"
"#;

const CHAT: &str = "POST /v1/chat";

/// Nodes "a" and "b", agreeing on a ring of both. Forwards may take 5 s: a loaded
/// machine must not turn a forwarded reservation into an error.
async fn two_nodes(rules: &std::path::Path) -> Vec<RunningNode> {
    let mut nodes: Vec<RunningNode> = Vec::new();
    for id in ["a", "b"] {
        let seeds: Vec<String> = nodes
            .first()
            .map(|n| n.gossip_addr.to_string())
            .into_iter()
            .collect();
        let mut config = member_config(id, &seeds, Some(rules));
        // With successor replicas, as these tests were written (one shows a commit
        // landing on the successor's promoted replica).
        config.replicate_interval = Duration::from_millis(50);
        config.forward = ForwardConfig {
            timeout: Duration::from_secs(5),
            ..config.forward.clone()
        };
        nodes.push(start(config).await);
    }
    common::wait_converged(&nodes, 2).await;
    nodes
}

fn reserve_request(key: &str, amount: i64, ttl_ms: Option<i64>) -> ReserveRequest {
    ReserveRequest {
        key: key.into(),
        route: CHAT.into(),
        tier: None,
        amount: Some(amount),
        ttl_ms,
    }
}

async fn reserve(node: &RunningNode, key: &str, amount: i64) -> ReserveResponse {
    client(node)
        .await
        .reserve(reserve_request(key, amount, None))
        .await
        .unwrap()
        .into_inner()
}

async fn commit(
    node: &RunningNode,
    id: &str,
    actual: i64,
) -> Result<CommitResponse, tonic::Status> {
    client(node)
        .await
        .commit(CommitRequest {
            reservation_id: id.into(),
            actual,
        })
        .await
        .map(|r| r.into_inner())
}

/// What a one-unit check of `key` leaves (taking that unit).
async fn remaining_after_one(node: &RunningNode, key: &str) -> u64 {
    let answer = client(node)
        .await
        .check(check(key, CHAT, None))
        .await
        .unwrap()
        .into_inner();
    assert!(answer.allowed, "{answer:?}");
    answer.remaining
}

async fn shutdown(nodes: Vec<RunningNode>) {
    for node in nodes {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_concurrent_reservations_against_ten_amounts_admit_exactly_ten() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = two_nodes(&rules).await;
    let key = key_owned_by("a", &["a", "b"], "llm-");
    let (a, b) = (client(&nodes[0]).await, client(&nodes[1]).await);
    // Half arrive at the owner, half at the other node (forwarded): one budget.
    let calls = (0..50).map(|i| {
        let mut c = if i % 2 == 0 { a.clone() } else { b.clone() };
        let request = reserve_request(&key, 100, None);
        tokio::spawn(async move { c.reserve(request).await.map(|r| r.into_inner()) })
    });
    let answers: Vec<ReserveResponse> = futures_util::future::join_all(calls)
        .await
        .into_iter()
        .map(|r| r.unwrap().expect("every reservation answered"))
        .collect();
    let allowed: Vec<&ReserveResponse> = answers
        .iter()
        .filter(|r| r.check.as_ref().unwrap().allowed)
        .collect();
    assert_eq!(allowed.len(), 10, "exactly the budget of 10 x 100");
    let mut ids: Vec<&str> = allowed.iter().map(|r| r.reservation_id.as_str()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 10, "ten distinct ids");
    for r in &answers {
        let check = r.check.as_ref().unwrap();
        assert_eq!(
            check.decider.as_ref().unwrap().node_id,
            "a",
            "decided by the owner"
        );
        if check.allowed {
            assert!(r.expires_at > 0);
        } else {
            assert!(r.reservation_id.is_empty() && r.expires_at == 0, "{r:?}");
            assert!(check.retry_after_ms > 0);
        }
    }
    // Spent: a one-unit check is denied.
    let denied = client(&nodes[1])
        .await
        .check(check(&key, CHAT, None))
        .await
        .unwrap()
        .into_inner();
    assert!(!denied.allowed);
    shutdown(nodes).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_commit_gives_back_the_difference_or_charges_the_excess_from_any_node() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = two_nodes(&rules).await;
    let key = key_owned_by("a", &["a", "b"], "diff-");
    // Reserved through the non-owner, committed through either.
    let r = reserve(&nodes[1], &key, 400).await;
    assert_eq!(r.check.as_ref().unwrap().remaining, 600);
    let done = commit(&nodes[1], &r.reservation_id, 150).await.unwrap();
    assert_eq!((done.returned, done.charged, done.uncharged), (250, 0, 0));
    assert!(!done.moved);
    assert_eq!(done.decider.unwrap().node_id, "a");
    assert_eq!(
        (done.limit, done.remaining, done.rule.as_str()),
        (1000, 850, "tokens")
    );
    assert_eq!(
        remaining_after_one(&nodes[0], &key).await,
        849,
        "a later check sees it"
    );

    let r = reserve(&nodes[0], &key, 100).await;
    let done = commit(&nodes[0], &r.reservation_id, 300).await.unwrap();
    assert_eq!((done.returned, done.charged, done.uncharged), (0, 200, 0));
    assert_eq!(done.remaining, 549);
    // An excess past what is left empties the counter and says what it could not charge.
    let r = reserve(&nodes[1], &key, 500).await;
    let done = commit(&nodes[1], &r.reservation_id, 700).await.unwrap();
    assert_eq!((done.charged, done.uncharged, done.remaining), (49, 151, 0));
    shutdown(nodes).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_uncommitted_reservation_stays_charged_at_its_amount_and_refuses_a_late_commit() {
    let (_dir, rules) = rules_file(RULES);
    let config = member_config("solo", &[], Some(&rules));
    let (node, clock) = start_manual(config, 1_800_000_000_000).await;
    let mut c = client(&node).await;
    let r = c
        .reserve(reserve_request("late", 300, Some(1_000)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.expires_at, 1_800_000_001_000);
    clock.advance(1_000);
    let late = commit(&node, &r.reservation_id, 0).await.unwrap_err();
    assert_eq!(late.code(), Code::FailedPrecondition, "{late:?}");
    assert_eq!(
        late.message(),
        "reservation_id: expired at 1800000001000 (Unix ms) before this commit, so it was \
         committed at its amount; nothing changed"
    );
    assert_eq!(remaining_after_one(&node, "late").await, 699);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_forged_and_repeated_commits_are_refused_and_change_nothing() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = two_nodes(&rules).await;
    let key = key_owned_by("a", &["a", "b"], "forge-");
    let r = reserve(&nodes[1], &key, 100).await;
    let id = r.reservation_id.clone();
    // Malformed: INVALID_ARGUMENT naming the field.
    for (bad, message) in [
        ("", "reservation_id: must not be empty"),
        (
            "hello",
            "reservation_id: not a reservation id this cluster made (malformed)",
        ),
    ] {
        let status = commit(&nodes[0], bad, 0).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), message);
    }
    let status = commit(&nodes[0], &id, -1).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().starts_with("actual: "), "{status:?}");
    // Forged: the tag (last field) changed, so the owner never made it.
    let (head, tag) = id.rsplit_once('.').unwrap();
    let flipped = if tag.ends_with('0') { "1" } else { "0" };
    let forged = format!("{head}.{}{flipped}", &tag[..tag.len() - 1]);
    let status = commit(&nodes[1], &forged, 0).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(
        status.message(),
        "reservation_id: no reservation with this id was made on its owner; nothing changed"
    );
    // The real one commits once.
    commit(&nodes[0], &id, 100).await.unwrap();
    for node in &nodes {
        let status = commit(node, &id, 0).await.unwrap_err();
        assert_eq!(status.code(), Code::FailedPrecondition);
        assert_eq!(
            status.message(),
            "reservation_id: already committed: a reservation is committed once; nothing changed"
        );
    }
    assert_eq!(
        remaining_after_one(&nodes[0], &key).await,
        899,
        "nothing given back"
    );
    shutdown(nodes).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_id_naming_a_gone_owner_is_applied_as_moved_giving_nothing_back_and_once() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = two_nodes(&rules).await;
    let key = key_owned_by("b", &["a", "b"], "moved-");
    let r = reserve(&nodes[0], &key, 100).await;
    assert_eq!(r.check.as_ref().unwrap().remaining, 900);
    // The same reservation as if node "b" had restarted since (another generation).
    let parts: Vec<&str> = r.reservation_id.split('.').collect();
    let mut moved = parts.clone();
    let generation = format!("{:x}", u64::from_str_radix(parts[2], 16).unwrap() + 1);
    moved[2] = &generation;
    let moved = moved.join(".");
    let done = commit(&nodes[0], &moved, 0).await.unwrap();
    assert!(done.moved);
    assert_eq!((done.returned, done.charged, done.remaining), (0, 0, 900));
    // Twice is refused; an excess on a fresh moved id is charged.
    let status = commit(&nodes[1], &moved, 0).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    moved_with_excess(&nodes, &parts).await;
    shutdown(nodes).await;
}

async fn moved_with_excess(nodes: &[RunningNode], parts: &[&str]) {
    let mut other = parts.to_vec();
    let generation = format!("{:x}", u64::from_str_radix(parts[2], 16).unwrap() + 2);
    other[2] = &generation;
    let done = commit(&nodes[1], &other.join("."), 130).await.unwrap();
    assert!(done.moved);
    assert_eq!((done.returned, done.charged, done.remaining), (0, 30, 870));
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_reservations_are_refused_and_charge_nothing() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = two_nodes(&rules).await;
    let key = key_owned_by("a", &["a", "b"], "bad-");
    let cases = [
        (reserve_request(&key, 0, None), "amount: must be a positive integer (got 0); a cost of 0 would admit for ever and a negative one would refund"),
        (reserve_request(&key, -100, None), "amount: must be a positive integer (got -100); a cost of 0 would admit for ever and a negative one would refund"),
        (reserve_request(&key, i64::MAX, None), "amount: 9223372036854775807 is over the limit of 1000000000"),
        (reserve_request(&key, 1001, None), "amount: cost 1001 can never be admitted: rule \"tokens\" admits at most 1000 at once"),
        (reserve_request(&key, 1, Some(0)), "ttl_ms: must be a positive number of milliseconds (got 0)"),
        (reserve_request(&key, 1, Some(-5)), "ttl_ms: must be a positive number of milliseconds (got -5)"),
        (reserve_request(&key, 1, Some(i64::MAX)), "ttl_ms: 9223372036854775807 is over the limit of 3600000 (one hour)"),
        (ReserveRequest { amount: None, ..reserve_request(&key, 1, None) }, "amount: required: the units to reserve"),
        (ReserveRequest { key: String::new(), ..reserve_request(&key, 1, None) }, "key: must not be empty"),
    ];
    for node in &nodes {
        for (request, message) in &cases {
            let status = client(node)
                .await
                .reserve(request.clone())
                .await
                .unwrap_err();
            assert_eq!(status.code(), Code::InvalidArgument, "{request:?}");
            assert_eq!(status.message(), *message);
        }
    }
    assert_eq!(
        remaining_after_one(&nodes[0], &key).await,
        999,
        "nothing was charged"
    );
    shutdown(nodes).await;
}

/// The peer calls behind a forwarded reservation and commit are the cluster face's: a
/// caller without the cluster key is refused before anything is charged or given back
/// (closes "reserve or refund on a member's behalf from the gateway network").
#[tokio::test(flavor = "multi_thread")]
async fn peer_reserve_and_commit_without_the_cluster_key_are_refused() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = two_nodes(&rules).await;
    let key = key_owned_by("a", &["a", "b"], "peer-");
    let r = reserve(&nodes[0], &key, 100).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", nodes[0].peer_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let reserve_call = PeerReserveRequest {
        from_node: "intruder".into(),
        key: key.clone(),
        route: CHAT.into(),
        tier: None,
        amount: 900,
        ttl_ms: 1_000,
        lease: false,
    };
    let commit_call = PeerCommitRequest {
        from_node: "intruder".into(),
        reservation_id: r.reservation_id.clone(),
        actual: 0,
    };
    let other = Keyring::from_text("another-cluster-secret-of-enough-length-000").unwrap();
    let mut anonymous = PeerClient::new(channel.clone());
    let mut outsider = PeerClient::new(Signed::new(channel, Some(other), "b".into()));
    let refused = [
        anonymous.reserve(reserve_call.clone()).await.unwrap_err(),
        anonymous.commit(commit_call.clone()).await.unwrap_err(),
        outsider.reserve(reserve_call).await.unwrap_err(),
        outsider.commit(commit_call).await.unwrap_err(),
    ];
    for status in refused {
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    }
    assert_eq!(
        remaining_after_one(&nodes[0], &key).await,
        899,
        "neither charged nor given back"
    );
    shutdown(nodes).await;
}

/// The replicas `node` holds for keys whose successor it is (`Peer/Status`, signed).
async fn replicas_held(node: &RunningNode) -> u64 {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", node.peer_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let keyring = Keyring::from_text(ringlimit::node::config::TEST_CLUSTER_SECRET).unwrap();
    let mut peer = PeerClient::new(Signed::new(channel, Some(keyring), "test".into()));
    let status = peer.status(ringlimit::proto::peer::StatusRequest {}).await;
    status.unwrap().into_inner().replicas
}

/// A reservation's charge is replicated like a check's; when its owner crashes, the
/// commit arrives at the key's new owner (the successor, which promotes its replica):
/// applied as moved, nothing given back, and the count goes on from the reservation.
#[tokio::test(flavor = "multi_thread")]
async fn after_the_owner_crashes_a_commit_is_applied_on_the_successors_promoted_count() {
    let (_dir, rules) = rules_file(RULES);
    let mut nodes = two_nodes(&rules).await;
    let key = key_owned_by("a", &["a", "b"], "crash-");
    let r = reserve(&nodes[1], &key, 400).await;
    assert_eq!(r.check.as_ref().unwrap().remaining, 600);
    // Polled, not slept: the successor holds the replica within a few intervals.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while replicas_held(&nodes[1]).await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no replica reached b"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    nodes.remove(0).shutdown().await;
    common::wait_converged(&nodes, 1).await;
    let done = commit(&nodes[0], &r.reservation_id, 100).await.unwrap();
    assert!(done.moved, "{done:?}");
    assert_eq!(done.decider.unwrap().node_id, "b");
    assert_eq!((done.returned, done.charged, done.remaining), (0, 0, 600));
    let status = commit(&nodes[0], &r.reservation_id, 100).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "once");
    assert_eq!(remaining_after_one(&nodes[0], &key).await, 599);
    shutdown(nodes).await;
}
