//! A cluster of real nodes in one process: real gRPC and real gossip over loopback,
//! every listener on port 0.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{
    check, client, key_owned_by, member_config, rules_file, start, start_cluster, wait_converged,
};

/// 20 per hour: no window rolls over during a test. `GET /closed` fails closed.
const RULES: &str = r#"
[[rule]]
name = "t"
route = "GET /t"
algorithm = "fixed_window"
limit = 20
window = "1h"

[[rule]]
name = "closed"
route = "GET /closed"
algorithm = "sliding_window_log"
limit = 5
window = "1h"
on_unavailable = "closed"
"#;

const LIMIT: usize = 20;

#[tokio::test(flavor = "multi_thread")]
async fn checks_sent_round_robin_to_three_nodes_admit_exactly_the_limit_with_one_decider() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = start_cluster(&["a", "b", "c"], Some(&rules)).await;
    let mut clients = Vec::new();
    for node in &nodes {
        clients.push(client(node).await);
    }
    for key in ["k1", "k2", "k3", "k4"] {
        let mut admitted = 0;
        let mut deciders = HashSet::new();
        for i in 0..(3 * LIMIT) {
            let answer = clients[i % 3]
                .check(check(key, "GET /t", None))
                .await
                .unwrap()
                .into_inner();
            admitted += usize::from(answer.allowed);
            // Once the key is exhausted, entry nodes answer from their deny cache
            // (flagged degraded); nothing degraded may ever admit.
            assert!(!(answer.degraded && answer.allowed));
            assert!(
                answer.descriptors.iter().all(|d| d.hops <= 1),
                "at most one hop"
            );
            if !answer.degraded {
                deciders.insert(answer.decider.unwrap().node_id);
            }
        }
        assert_eq!(
            admitted, LIMIT,
            "key {key}: exactly the limit across three entry nodes"
        );
        assert_eq!(
            deciders.len(),
            1,
            "key {key}: one decider, got {deciders:?}"
        );
    }
    for node in nodes {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hot_denied_key_costs_its_owner_one_check_per_retry_period_per_node() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = start_cluster(&["a", "b", "c"], Some(&rules)).await;
    let key = key_owned_by("c", &["a", "b", "c"], "hot");
    let mut via_a = client(&nodes[0]).await;
    for _ in 0..LIMIT {
        assert!(
            via_a
                .check(check(&key, "GET /t", None))
                .await
                .unwrap()
                .into_inner()
                .allowed
        );
    }
    let mut owner_answers = 0;
    let mut cached_answers = 0;
    for _ in 0..200 {
        let answer = via_a
            .check(check(&key, "GET /t", None))
            .await
            .unwrap()
            .into_inner();
        assert!(!answer.allowed, "the deny cache never admits");
        assert!(answer.retry_after_ms > 0);
        if answer.degraded {
            cached_answers += 1;
            assert_eq!(
                answer.decider.unwrap().node_id,
                "c",
                "a cached denial names the owner"
            );
        } else {
            owner_answers += 1;
        }
    }
    assert_eq!(
        owner_answers, 1,
        "only the first denial costs the owner a check"
    );
    assert_eq!(cached_answers, 199);
    for node in nodes {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_graceful_leave_hands_exhausted_keys_to_their_new_owners() {
    let (_dir, rules) = rules_file(RULES);
    let mut nodes = start_cluster(&["a", "b", "c"], Some(&rules)).await;
    let keys: Vec<String> = (0..5)
        .map(|i| key_owned_by("c", &["a", "b", "c"], &format!("leave{i}-")))
        .collect();
    let mut via_a = client(&nodes[0]).await;
    for key in &keys {
        for _ in 0..LIMIT {
            assert!(
                via_a
                    .check(check(key, "GET /t", None))
                    .await
                    .unwrap()
                    .into_inner()
                    .allowed
            );
        }
    }
    let leaver = nodes.pop().unwrap();
    leaver.leave().await;
    wait_converged(&nodes, 2).await;
    let mut via_b = client(&nodes[1]).await;
    for key in &keys {
        for c in [&mut via_a, &mut via_b] {
            let answer = c
                .check(check(key, "GET /t", None))
                .await
                .unwrap()
                .into_inner();
            assert!(
                !answer.allowed,
                "key {key} stays exhausted after its owner left"
            );
            assert!(!answer.degraded);
            let decider = answer.decider.unwrap().node_id;
            assert!(decider == "a" || decider == "b", "decided by {decider}");
        }
    }
    for node in nodes {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn keys_that_move_to_a_joining_node_keep_their_counts() {
    let (_dir, rules) = rules_file(RULES);
    let mut nodes = start_cluster(&["a", "b"], Some(&rules)).await;
    // Keys the 3-node ring will give to the joiner "c": today they live on a or b.
    let keys: Vec<String> = (0..6)
        .map(|i| key_owned_by("c", &["a", "b", "c"], &format!("join{i}-")))
        .collect();
    let mut via_a = client(&nodes[0]).await;
    for key in &keys {
        for _ in 0..LIMIT - 1 {
            assert!(
                via_a
                    .check(check(key, "GET /t", None))
                    .await
                    .unwrap()
                    .into_inner()
                    .allowed
            );
        }
    }
    let seed = nodes[0].gossip_addr.to_string();
    nodes.push(start(member_config("c", &[seed], Some(&rules))).await);
    wait_converged(&nodes, 3).await;
    // Let the old owners notice the new ring and push the moved keys.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut via_c = client(&nodes[2]).await;
    for key in &keys {
        let answer = via_c
            .check(check(key, "GET /t", None))
            .await
            .unwrap()
            .into_inner();
        assert!(answer.allowed, "one unit was left");
        assert_eq!(
            answer.decider.unwrap().node_id,
            "c",
            "the joiner owns {key} now"
        );
        assert_eq!(answer.remaining, 0, "the count moved with the key");
        let answer = via_a
            .check(check(key, "GET /t", None))
            .await
            .unwrap()
            .into_inner();
        assert!(
            !answer.allowed,
            "key {key}: zero over-admission after the move"
        );
    }
    for node in nodes {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forwarded_check_is_decided_by_its_receiver_even_if_its_ring_disagrees() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = start_cluster(&["a", "b", "c"], Some(&rules)).await;
    let key = key_owned_by("c", &["a", "b", "c"], "stray");
    // Forward straight to b, which does not own the key: b decides, no second hop.
    let mut peer = ringlimit::proto::peer::peer_client::PeerClient::connect(format!(
        "http://{}",
        nodes[1].peer_addr
    ))
    .await
    .unwrap();
    let forward_one = |deadline_ms: u64| ringlimit::proto::peer::ForwardRequest {
        from_node: "a".into(),
        items: vec![ringlimit::proto::peer::ForwardItem {
            key: key.clone(),
            route: "GET /t".into(),
            tier: None,
            cost: 1,
            hops: 1,
        }],
        deadline_ms,
    };
    let response = peer.forward(forward_one(0)).await.unwrap().into_inner();
    assert_eq!(response.node_id, "b");
    assert!(response.outcomes[0].allowed);
    assert_eq!(response.outcomes[0].remaining, (LIMIT - 1) as u64);

    // A batch that arrives after its sender gave up (a paused owner waking up) is
    // refused, not charged.
    let stale = peer.forward(forward_one(1)).await.unwrap_err();
    assert_eq!(stale.code(), tonic::Code::DeadlineExceeded);
    let again = peer.forward(forward_one(0)).await.unwrap().into_inner();
    assert_eq!(
        again.outcomes[0].remaining,
        (LIMIT - 2) as u64,
        "the stale batch charged nothing"
    );
    for node in nodes {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_owner_fails_open_or_closed_per_rule() {
    let (_dir, rules) = rules_file(RULES);
    let mut nodes = start_cluster(&["a", "b", "c"], Some(&rules)).await;
    let key = key_owned_by("c", &["a", "b", "c"], "gone");
    // Crash c; a and b still have it on their rings until failure detection (~1.2 s),
    // so their forwards fail and they decide without the owner.
    nodes.pop().unwrap().shutdown().await;
    let mut via_a = client(&nodes[0]).await;
    let open = via_a
        .check(check(&key, "GET /t", None))
        .await
        .unwrap()
        .into_inner();
    assert!(open.allowed && open.degraded, "fail-open: {open:?}");
    assert_eq!(open.limit, 6, "fallback limit: 20 / 3 nodes");
    assert_eq!(open.decider.unwrap().node_id, "a");
    let closed = via_a
        .check(check(&key, "GET /closed", None))
        .await
        .unwrap()
        .into_inner();
    assert!(
        !closed.allowed && closed.degraded,
        "fail-closed: {closed:?}"
    );
    assert!(closed.retry_after_ms > 0);
    for node in nodes {
        node.shutdown().await;
    }
}

/// Both sides of a forward compute the same counter identity: the entry node sends the
/// route as received and the owner normalises it again, so query strings and paths sent
/// through different entry nodes still spend one budget on the owner.
#[tokio::test(flavor = "multi_thread")]
async fn forwarded_checks_with_varying_paths_and_queries_share_the_owners_budget() {
    let (_dir, rules) = rules_file(
        r#"
[[rule]]
name = "v1"
route = "/v1/*"
algorithm = "fixed_window"
limit = 3
window = "1h"

[[rule]]
name = "each"
route = "/each/*"
per = "route"
algorithm = "fixed_window"
limit = 1
window = "1h"
"#,
    );
    let nodes = start_cluster(&["a", "b"], Some(&rules)).await;
    let key = key_owned_by("b", &["a", "b"], "scope");
    let mut via_a = client(&nodes[0]).await;
    let mut via_b = client(&nodes[1]).await;
    let mut admitted = 0;
    for (i, route) in [
        "GET /v1/a",
        "GET /v1/a?x=1",
        "GET /v1/b",
        "GET /v1/c?n=2",
        "/v1/a#f",
    ]
    .iter()
    .enumerate()
    {
        let c = if i % 2 == 0 { &mut via_a } else { &mut via_b };
        let answer = c
            .check(check(&key, route, None))
            .await
            .unwrap()
            .into_inner();
        assert!(!(answer.degraded && answer.allowed));
        if !answer.degraded {
            assert_eq!(answer.decider.unwrap().node_id, "b", "the owner decides");
        }
        admitted += usize::from(answer.allowed);
    }
    assert_eq!(
        admitted, 3,
        "one budget of 3 across paths, queries and entry nodes"
    );

    // per = "route": the query never separates, the path does.
    let forwarded = via_a
        .check(check(&key, "GET /each/a?x=1", None))
        .await
        .unwrap()
        .into_inner();
    assert!(forwarded.allowed && forwarded.descriptors[0].hops == 1);
    let local = via_b
        .check(check(&key, "GET /each/a", None))
        .await
        .unwrap()
        .into_inner();
    assert!(
        !local.allowed,
        "same normalised route as the forwarded check"
    );
    let other = via_a
        .check(check(&key, "GET /each/b?x=1", None))
        .await
        .unwrap()
        .into_inner();
    assert!(other.allowed, "another path has its own budget");
    for node in nodes {
        node.shutdown().await;
    }
}
