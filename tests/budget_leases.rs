//! Budget leases (`--lease-threshold`, docs/leases.md) on a three-node cluster in one
//! process: a hot key checked through two nodes that do not own it is decided mostly
//! from leases its owner charged beforehand, and the limit stays exact.
//!
//! Every node reads one manual clock that the tests move themselves, so nothing here
//! depends on how fast the machine is: no window ends, no lease runs out on its own.

mod common;

use std::time::Duration;

use ringlimit::clock::ManualClock;
use ringlimit::node::{NodeConfig, RunningNode};
use ringlimit::proto::CheckResponse;

use common::{check, client, key_owned_by, member_config, rules_file, start_with_clock};

/// The start of an hour (a 1 h fixed window ends an hour later), in the past: a
/// forward's deadline is set on the sender's system clock and checked on the owner's
/// (manual) one, so the manual clock must not run ahead of the system's.
const T0: u64 = 1_699_999_200_000 + 1_000;

const RULES: &str = r#"
[[rule]]
name = "whale"
route = "GET /hot"
algorithm = "fixed_window"
limit = 3000
window = "1h"
"#;

const ROUTE: &str = "GET /hot";

/// Nodes "a", "b", "c" on one manual clock, with budget leases on.
async fn three_nodes(rules: &std::path::Path, clock: &ManualClock) -> Vec<RunningNode> {
    let mut nodes: Vec<RunningNode> = Vec::new();
    for id in ["a", "b", "c"] {
        let seeds: Vec<String> = nodes
            .first()
            .map(|n| n.gossip_addr.to_string())
            .into_iter()
            .collect();
        let config = leasing(member_config(id, &seeds, Some(rules)));
        nodes.push(start_with_clock(config, std::sync::Arc::new(clock.clone())).await);
    }
    common::wait_converged(&nodes, 3).await;
    nodes
}

/// `config` asking for a lease at 20 checks/s of a counter, forwards given 5 s (a
/// loaded machine must not turn a forward into a fail-open answer).
fn leasing(mut config: NodeConfig) -> NodeConfig {
    config.shards.lease_threshold = 20;
    config.forward.timeout = Duration::from_secs(5);
    config
}

/// `workers` concurrent callers of `node`, each making `each` one-unit checks of `key`.
async fn drive(node: &RunningNode, key: &str, workers: usize, each: usize) -> Vec<CheckResponse> {
    let calls = (0..workers).map(|_| {
        let (addr, key) = (node.grpc_addr, key.to_string());
        tokio::spawn(async move {
            let mut c = ringlimit::proto::rate_limiter_client::RateLimiterClient::connect(format!(
                "http://{addr}"
            ))
            .await
            .expect("client connects");
            let mut answers = Vec::with_capacity(each);
            for _ in 0..each {
                let answer = c.check(check(&key, ROUTE, None)).await.expect("answered");
                answers.push(answer.into_inner());
            }
            answers
        })
    });
    futures_util::future::join_all(calls)
        .await
        .into_iter()
        .flat_map(|r| r.expect("worker ends"))
        .collect()
}

async fn shutdown(nodes: Vec<RunningNode>) {
    for node in nodes {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hot_key_through_two_entries_is_decided_from_leases_and_stays_within_its_limit() {
    let (_dir, rules) = rules_file(RULES);
    let clock = ManualClock::new(T0);
    let nodes = three_nodes(&rules, &clock).await;
    let key = key_owned_by("a", &["a", "b", "c"], "whale-");
    // 4,000 checks for a budget of 3,000, half through each non-owner, concurrently.
    let (b, c) = tokio::join!(
        drive(&nodes[1], &key, 4, 500),
        drive(&nodes[2], &key, 4, 500)
    );
    let answers: Vec<&CheckResponse> = b.iter().chain(&c).collect();
    let admitted = answers.iter().filter(|a| a.allowed).count();
    let leased = answers.iter().filter(|a| a.leased).count();
    println!(
        "{} checks: {admitted} admitted, {leased} decided from leases",
        answers.len()
    );
    assert!(admitted <= 3_000, "over the limit: {admitted}");
    assert!(admitted >= 2_850, "too few admitted: {admitted}");
    assert!(
        leased * 2 > answers.len(),
        "most checks are decided from leases: {leased} of {}",
        answers.len()
    );
    for a in answers.iter().filter(|a| a.leased) {
        assert!(a.allowed && a.descriptors[0].leased, "{a:?}");
        assert_eq!(
            a.decider.as_ref().unwrap().node_id,
            "a",
            "the owner charged it"
        );
        assert_eq!(a.descriptors[0].hops, 0, "no hop");
        assert!(a.remaining < 3_000);
    }
    // The owner's count agrees: what is left is what nobody was admitted.
    let last = client(&nodes[0])
        .await
        .check(check(&key, ROUTE, None))
        .await
        .unwrap()
        .into_inner();
    let held = 3_000 - admitted as u64;
    assert!(
        !last.allowed || last.remaining < held,
        "the owner has no more than the unspent units: {last:?}"
    );
    shutdown(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ended_lease_gives_its_unused_units_back_to_the_owner() {
    let (_dir, rules) = rules_file(RULES);
    let clock = ManualClock::new(T0);
    let nodes = three_nodes(&rules, &clock).await;
    let key = key_owned_by("a", &["a", "b", "c"], "returns-");
    // Hot through "b" until a check is decided from a lease.
    let mut from_lease = false;
    let mut admitted = 0;
    let mut c = client(&nodes[1]).await;
    for _ in 0..2_000 {
        let answer = c
            .check(check(&key, ROUTE, None))
            .await
            .unwrap()
            .into_inner();
        admitted += u64::from(answer.allowed);
        if answer.leased {
            from_lease = true;
            break;
        }
        // The request for a lease is in flight: let it land.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(from_lease, "a lease was granted");
    let owner_left = |answer: CheckResponse| answer.remaining;
    let mut owner = client(&nodes[0]).await;
    let during = owner_left(
        owner
            .check(check(&key, ROUTE, None))
            .await
            .unwrap()
            .into_inner(),
    );
    assert!(
        during < 3_000 - admitted - 1,
        "the lease's units are charged on the owner: {during} left"
    );
    // The lease ends (1 s TTL) and "b" returns what it did not spend, at its next
    // expiry tick: each probe of the owner takes one unit.
    clock.advance(1_500);
    let (mut after, mut probes) = (during, 1);
    for _ in 0..400 {
        after = owner_left(
            owner
                .check(check(&key, ROUTE, None))
                .await
                .unwrap()
                .into_inner(),
        );
        probes += 1;
        if after + 1 > during {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Exactly the units nobody spent come back: all but b's admissions and the probes.
    assert_eq!(after, 3_000 - admitted - probes, "during: {during}");
    shutdown(nodes).await;
}

/// The peer calls behind budget leases are the cluster face's: without the cluster key
/// a lease request or a return is refused before anything is charged or given back
/// (closes "take a lease, or return units never lent, from the gateway network"); with
/// the key but under a name the owner's view does not list, no lease either; and a
/// return of a lease never granted gives nothing back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_calls_need_the_cluster_key_and_a_member_name() {
    use ringlimit::cluster::link::Signed;
    use ringlimit::keyring::Keyring;
    use ringlimit::proto::peer::peer_client::PeerClient;
    use ringlimit::proto::peer::{ForwardItem, PeerLeaseRequest, PeerReturnLeaseRequest};
    use tonic::Code;

    let (_dir, rules) = rules_file(RULES);
    let clock = ManualClock::new(T0);
    let nodes = three_nodes(&rules, &clock).await;
    let key = key_owned_by("a", &["a", "b", "c"], "attack-");
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", nodes[0].peer_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let lease = |from: &str| PeerLeaseRequest {
        from_node: from.into(),
        item: Some(ForwardItem {
            key: key.clone().into(),
            route: ROUTE.into(),
            cost: 1,
            hops: 1,
            ..ForwardItem::default()
        }),
        rate: 1_000_000,
    };
    let give_back = PeerReturnLeaseRequest {
        from_node: "b".into(),
        generation: 0,
        serial: 1,
        placement: 0,
        counter: 0,
        unused: 1_000,
    };
    let other = Keyring::from_text("another-cluster-secret-of-enough-length-000").unwrap();
    let mut anonymous = PeerClient::new(channel.clone());
    let mut outsider = PeerClient::new(Signed::new(channel.clone(), Some(other), "b".into()));
    let refused = [
        anonymous.lease(lease("b")).await.unwrap_err(),
        anonymous.return_lease(give_back.clone()).await.unwrap_err(),
        outsider.lease(lease("b")).await.unwrap_err(),
        outsider.return_lease(give_back.clone()).await.unwrap_err(),
    ];
    for status in refused {
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    }
    let keyring = Keyring::from_text(ringlimit::node::config::TEST_CLUSTER_SECRET).unwrap();
    let mut member = PeerClient::new(Signed::new(channel, Some(keyring), "test".into()));
    let stranger = member.lease(lease("intruder")).await.unwrap_err();
    assert_eq!(stranger.code(), Code::PermissionDenied, "{stranger:?}");
    let nothing = member.return_lease(give_back).await.unwrap().into_inner();
    assert_eq!(nothing.returned, 0, "no lease of that name was granted");
    let answer = client(&nodes[0])
        .await
        .check(check(&key, ROUTE, None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        answer.remaining, 2_999,
        "nothing charged, nothing given back"
    );
    shutdown(nodes).await;
}

/// A key that the ring of `before` gives to `owner` and the ring of `after` (the same
/// members but `owner`) gives to `heir`.
fn key_moving(owner: &str, heir: &str, before: &[&str], after: &[&str]) -> String {
    use ringlimit::ring::Ring;
    let (old, new) = (
        Ring::new(before.iter().copied(), Ring::DEFAULT_VNODES),
        Ring::new(after.iter().copied(), Ring::DEFAULT_VNODES),
    );
    (0..)
        .map(|i| format!("heir-{i}"))
        .find(|k| old.owner(k.as_bytes()) == Some(owner) && new.owner(k.as_bytes()) == Some(heir))
        .expect("some key moves from owner to heir")
}

/// The owner crashes while an entry holds a lease: the entry spends what it holds and
/// nothing more from leases (its lease's units were admitted by the dead owner), then
/// its checks go to the key's new owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn when_the_owner_dies_a_holder_spends_what_it_holds_and_nothing_more() {
    let (_dir, rules) = rules_file(RULES);
    let clock = ManualClock::new(T0);
    let mut nodes = three_nodes(&rules, &clock).await;
    let key = key_moving("a", "c", &["a", "b", "c"], &["b", "c"]);
    let mut via_b = client(&nodes[1]).await;
    let mut admitted = 0;
    let mut leased = false;
    for _ in 0..2_000 {
        let answer = via_b
            .check(check(&key, ROUTE, None))
            .await
            .unwrap()
            .into_inner();
        admitted += u64::from(answer.allowed);
        if answer.leased {
            leased = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(leased, "a lease was granted");
    // What b holds, from the owner's count, once no grant is in flight any more: two
    // probes a second apart that differ by the first probe's unit alone.
    let mut owner = client(&nodes[0]).await;
    let (mut probes, mut left, mut before) = (0, 0, u64::MAX);
    for _ in 0..20 {
        left = owner
            .check(check(&key, ROUTE, None))
            .await
            .unwrap()
            .into_inner()
            .remaining;
        probes += 1;
        if left + 1 == before {
            break;
        }
        before = left;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let held = 3_000 - admitted - probes - left;
    assert!(
        held >= 1,
        "b holds units: admitted {admitted}, probes {probes}, left {left}"
    );
    // The owner crashes; b's ring drops it.
    let a = nodes.remove(0);
    a.shutdown().await;
    let dropped =
        common::eventually(Duration::from_secs(30), || nodes[0].view().ring.len() == 2).await;
    assert!(dropped, "b's ring dropped the dead owner");
    // b spends the units the dead owner lent it; a lease the new owner grants (it
    // starts the key afresh: the ownership-change bound of docs/ownership.md) is not
    // the dead owner's.
    let mut spent = 0;
    let mut next = None;
    for _ in 0..held + 10 {
        let answer = via_b
            .check(check(&key, ROUTE, None))
            .await
            .unwrap()
            .into_inner();
        let decider = answer.decider.as_ref().map(|d| d.node_id.clone());
        if !(answer.leased && decider.as_deref() == Some("a")) {
            next = Some(answer);
            break;
        }
        spent += 1;
    }
    assert!(
        (1..=held).contains(&spent),
        "spent {spent} from the dead owner's leases, held {held}"
    );
    let next = next.expect("the dead owner's lease ran out");
    assert_eq!(
        next.decider.as_ref().map(|d| d.node_id.as_str()),
        Some("c"),
        "then decided by (or from a lease of) the key's new owner: {next:?}"
    );
    shutdown(nodes).await;
}
