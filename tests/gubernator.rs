//! Gubernator's V1 API (`pb.gubernator.V1`) on real nodes started with `--gubernator`:
//! the numbers of each algorithm on a manual clock, hits 0 / negative / too many, the
//! behaviours, per-item errors, Gregorian durations, and a three-node cluster where
//! the limit an item carries is decided by the key's owner whichever node it enters by.

mod common;

use std::sync::Arc;

use ringlimit::clock::ManualClock;
use ringlimit::node::{NodeConfig, RunningNode};
use ringlimit::proto::gubernator::{
    v1_client::V1Client, GetRateLimitsReq, HealthCheckReq, RateLimitReq, RateLimitResp, Status,
};
use tonic::transport::Channel;

/// Midnight UTC: every window of a minute, an hour or a day starts here.
const T0: u64 = 1_700_006_400_000;
const TOKEN: i32 = 0;
const LEAKY: i32 = 1;
const RESET_REMAINING: i32 = 8;
const DRAIN_OVER_LIMIT: i32 = 32;
const GREGORIAN: i32 = 4;
const UNDER: i32 = Status::UnderLimit as i32;
const OVER: i32 = Status::OverLimit as i32;

fn gub_config(id: &str, seeds: &[String]) -> NodeConfig {
    NodeConfig {
        gubernator: true,
        ..common::member_config(id, seeds, None)
    }
}

async fn client(node: &RunningNode) -> V1Client<Channel> {
    V1Client::connect(format!("http://{}", node.grpc_addr))
        .await
        .unwrap()
}

fn item(key: &str, algorithm: i32, hits: i64, limit: i64, duration: i64) -> RateLimitReq {
    RateLimitReq {
        name: "test".into(),
        unique_key: key.into(),
        hits,
        limit,
        duration,
        algorithm,
        ..Default::default()
    }
}

async fn one(c: &mut V1Client<Channel>, r: RateLimitReq) -> RateLimitResp {
    let mut answers = c
        .get_rate_limits(GetRateLimitsReq { requests: vec![r] })
        .await
        .unwrap()
        .into_inner()
        .responses;
    assert_eq!(answers.len(), 1);
    answers.pop().unwrap()
}

/// (status, remaining, reset_time) of an answer, asserting it has no error.
fn numbers(r: &RateLimitResp) -> (i32, i64, i64) {
    assert!(r.error.is_empty(), "unexpected error {:?}", r.error);
    (r.status, r.remaining, r.reset_time)
}

async fn single() -> (RunningNode, ManualClock, V1Client<Channel>) {
    let (node, clock) = common::start_manual(gub_config("solo", &[]), T0).await;
    let c = client(&node).await;
    (node, clock, c)
}

#[tokio::test]
async fn token_bucket_is_limit_hits_per_aligned_duration_and_a_denial_charges_nothing() {
    let (_node, clock, mut c) = single().await;
    let end = (T0 + 60_000) as i64;
    let tb = |hits| item("acct:1", TOKEN, hits, 5, 60_000);
    assert_eq!(numbers(&one(&mut c, tb(3)).await), (UNDER, 2, end));
    // More than what is left: OVER_LIMIT, and the remainder stays usable (Gubernator).
    assert_eq!(numbers(&one(&mut c, tb(3)).await), (OVER, 2, end));
    assert_eq!(numbers(&one(&mut c, tb(2)).await), (UNDER, 0, end));
    assert_eq!(numbers(&one(&mut c, tb(1)).await), (OVER, 0, end));
    // hits 0 reports, and counts nothing.
    assert_eq!(numbers(&one(&mut c, tb(0)).await), (OVER, 0, end));
    clock.advance(60_000);
    let end2 = end + 60_000;
    assert_eq!(numbers(&one(&mut c, tb(0)).await), (UNDER, 5, end2));
    assert_eq!(numbers(&one(&mut c, tb(1)).await), (UNDER, 4, end2));
    // More hits than the limit: OVER_LIMIT, nothing charged.
    let r = one(&mut c, tb(6)).await;
    assert_eq!(numbers(&r), (OVER, 4, end2));
    assert_eq!(r.limit, 5);
    assert!(!r.metadata["owner"].is_empty());
}

#[tokio::test]
async fn leaky_bucket_is_a_token_bucket_of_burst_leaking_limit_per_duration() {
    let (_node, clock, mut c) = single().await;
    // 10 per second: one hit leaks back every 100 ms; burst 0 means 10.
    let lb = |hits| item("acct:2", LEAKY, hits, 10, 1_000);
    assert_eq!(
        numbers(&one(&mut c, lb(10)).await),
        (UNDER, 0, (T0 + 1_000) as i64)
    );
    assert_eq!(numbers(&one(&mut c, lb(1)).await).0, OVER);
    clock.advance(250);
    // 2.5 hits have leaked out: 2 whole ones are available.
    assert_eq!(
        numbers(&one(&mut c, lb(0)).await),
        (UNDER, 2, (T0 + 1_000) as i64)
    );
    // One taken: 1.5 left; full again after 8.5 × 100 ms.
    assert_eq!(
        numbers(&one(&mut c, lb(1)).await),
        (UNDER, 1, (T0 + 250 + 850) as i64)
    );
    // A burst above the rate: 5 at once, refilled at 1 per second.
    let burst = |hits| RateLimitReq {
        burst: 5,
        ..item("acct:3", LEAKY, hits, 1, 1_000)
    };
    assert_eq!(numbers(&one(&mut c, burst(5)).await).1, 0);
    assert_eq!(numbers(&one(&mut c, burst(1)).await).0, OVER);
    clock.advance(1_000);
    assert_eq!(
        numbers(&one(&mut c, burst(1)).await),
        (UNDER, 0, (T0 + 1_250 + 5_000) as i64)
    );
}

#[tokio::test]
async fn negative_hits_give_back_reset_refills_and_drain_empties() {
    let (_node, _clock, mut c) = single().await;
    let end = (T0 + 60_000) as i64;
    let tb = |key: &str, hits, behavior| RateLimitReq {
        behavior,
        ..item(key, TOKEN, hits, 5, 60_000)
    };
    assert_eq!(
        numbers(&one(&mut c, tb("neg", 4, 0)).await),
        (UNDER, 1, end)
    );
    assert_eq!(
        numbers(&one(&mut c, tb("neg", -2, 0)).await),
        (UNDER, 3, end)
    );
    // Never beyond a full counter (Gubernator would report 8).
    assert_eq!(
        numbers(&one(&mut c, tb("neg", -5, 0)).await),
        (UNDER, 5, end)
    );

    assert_eq!(
        numbers(&one(&mut c, tb("reset", 5, 0)).await),
        (UNDER, 0, end)
    );
    assert_eq!(numbers(&one(&mut c, tb("reset", 1, 0)).await).0, OVER);
    // The token bucket answers a reset with the whole budget, its hits not taken.
    let r = one(&mut c, tb("reset", 3, RESET_REMAINING)).await;
    assert_eq!(numbers(&r), (UNDER, 5, end));
    assert_eq!(
        numbers(&one(&mut c, tb("reset", 1, 0)).await),
        (UNDER, 4, end)
    );
    // The leaky bucket takes them after the reset.
    let lb = |hits, behavior| RateLimitReq {
        behavior,
        ..item("reset-lb", LEAKY, hits, 10, 60_000)
    };
    assert_eq!(numbers(&one(&mut c, lb(10, 0)).await).1, 0);
    assert_eq!(numbers(&one(&mut c, lb(3, RESET_REMAINING)).await).1, 7);

    assert_eq!(
        numbers(&one(&mut c, tb("drain", 3, 0)).await),
        (UNDER, 2, end)
    );
    let r = one(&mut c, tb("drain", 3, DRAIN_OVER_LIMIT)).await;
    assert_eq!(numbers(&r), (OVER, 0, end), "the 2 left are drained");
    assert_eq!(
        numbers(&one(&mut c, tb("drain", 1, 0)).await),
        (OVER, 0, end)
    );
    // More than the limit holds, draining: OVER_LIMIT with nothing left.
    let r = one(&mut c, tb("drain-all", 9, DRAIN_OVER_LIMIT)).await;
    assert_eq!(numbers(&r), (OVER, 0, end));
    assert_eq!(numbers(&one(&mut c, tb("drain-all", 1, 0)).await).0, OVER);
}

#[tokio::test]
async fn gregorian_durations_are_calendar_units_and_longer_ones_are_refused() {
    let (_node, clock, mut c) = single().await;
    clock.advance(90_000);
    let g = |duration| RateLimitReq {
        behavior: GREGORIAN,
        ..item("greg", TOKEN, 1, 10, duration)
    };
    assert_eq!(
        numbers(&one(&mut c, g(0)).await).2,
        (T0 + 120_000) as i64,
        "minute"
    );
    assert_eq!(
        numbers(&one(&mut c, g(1)).await).2,
        (T0 + 3_600_000) as i64,
        "hour"
    );
    assert_eq!(
        numbers(&one(&mut c, g(2)).await).2,
        (T0 + 86_400_000) as i64,
        "day"
    );
    for unit in [3, 4, 5] {
        let r = one(&mut c, g(unit)).await;
        assert!(r.error.starts_with("duration:"), "{unit}: {:?}", r.error);
    }
}

#[tokio::test]
async fn one_bad_item_is_its_own_error_and_the_rest_are_decided() {
    let (_node, _clock, mut c) = single().await;
    let good = item("batch", TOKEN, 1, 2, 60_000);
    let requests = vec![
        good.clone(),
        RateLimitReq {
            unique_key: String::new(),
            ..good.clone()
        },
        RateLimitReq {
            duration: 0,
            ..good.clone()
        },
        RateLimitReq {
            limit: 0,
            ..good.clone()
        },
        RateLimitReq {
            algorithm: 7,
            ..good.clone()
        },
        good.clone(),
    ];
    let answers = c
        .get_rate_limits(GetRateLimitsReq { requests })
        .await
        .unwrap()
        .into_inner()
        .responses;
    let errors: Vec<&str> = answers.iter().map(|r| r.error.as_str()).collect();
    assert_eq!(errors[0], "");
    assert_eq!(errors[1], "unique_key: must not be empty");
    assert!(errors[2].starts_with("duration:"), "{errors:?}");
    assert!(errors[3].starts_with("limit:"), "{errors:?}");
    assert!(errors[4].starts_with("algorithm:"), "{errors:?}");
    assert_eq!(errors[5], "");
    // The two good ones were decided in order, on one counter; the bad ones charged nothing.
    assert_eq!((answers[0].remaining, answers[5].remaining), (1, 0));

    let too_many = GetRateLimitsReq {
        requests: vec![good; 1001],
    };
    let status = c.get_rate_limits(too_many).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("at most 1000"),
        "{}",
        status.message()
    );
}

#[tokio::test]
async fn the_face_is_served_only_with_gubernator_on() {
    let node = common::start(NodeConfig::for_test()).await;
    let status = client(&node)
        .await
        .health_check(HealthCheckReq {})
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unimplemented);
}

#[tokio::test]
async fn reflection_lists_the_gubernator_service_only_when_it_is_served() {
    use tonic_reflection::pb::v1::{
        server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
        ServerReflectionRequest,
    };
    async fn services(node: &RunningNode) -> Vec<String> {
        let channel = Channel::from_shared(format!("http://{}", node.grpc_addr))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut answers = ServerReflectionClient::new(channel)
            .server_reflection_info(tokio_stream::iter(vec![request]))
            .await
            .unwrap()
            .into_inner();
        let answer = answers.message().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
            panic!("expected a service list, got {answer:?}");
        };
        list.service.into_iter().map(|s| s.name).collect()
    }
    let (on, _clock, _c) = single().await;
    assert!(services(&on)
        .await
        .contains(&"pb.gubernator.V1".to_string()));
    let off = common::start(NodeConfig::for_test()).await;
    let listed = services(&off).await;
    assert!(
        !listed.iter().any(|s| s.starts_with("pb.gubernator")),
        "{listed:?}"
    );
    assert!(listed.contains(&"ringlimit.v1.RateLimiter".to_string()));
}

/// Three nodes on one manual clock.
async fn cluster() -> (Vec<RunningNode>, ManualClock) {
    let clock = ManualClock::new(T0);
    let mut nodes = Vec::new();
    let mut seeds: Vec<String> = Vec::new();
    for id in ["a", "b", "c"] {
        let node = common::start_with_clock(gub_config(id, &seeds), Arc::new(clock.clone())).await;
        seeds = vec![node.gossip_addr.to_string()];
        nodes.push(node);
    }
    common::wait_converged(&nodes, 3).await;
    (nodes, clock)
}

#[tokio::test]
async fn inline_limits_survive_forwarding_and_the_owner_decides_whichever_node_is_asked() {
    let (nodes, _clock) = cluster().await;
    let mut clients = Vec::new();
    for n in &nodes {
        clients.push(client(n).await);
    }
    let health = clients[0]
        .health_check(HealthCheckReq {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!((health.status.as_str(), health.peer_count), ("healthy", 3));

    let before = common::metric_sum("ringlimit_forwarded_total");
    let end = (T0 + 60_000) as i64;
    let mut not_a = 0;
    for k in 0..8 {
        let key = format!("user:{k}");
        // A limit no node is configured with: 3 per minute, carried by each item.
        let tb = |hits, behavior| RateLimitReq {
            behavior,
            ..item(&key, TOKEN, hits, 3, 60_000)
        };
        let probe = one(&mut clients[0], tb(0, 0)).await;
        let owner = probe.metadata["owner"].clone();
        not_a += usize::from(owner != "a");
        for (i, c) in clients.iter_mut().enumerate() {
            let r = one(c, tb(1, 0)).await;
            assert_eq!(
                numbers(&r),
                (UNDER, 2 - i as i64, end),
                "{key} via node {i}"
            );
            assert_eq!(r.metadata["owner"], owner, "{key}: one decider");
        }
        for c in clients.iter_mut() {
            assert_eq!(numbers(&one(c, tb(1, 0)).await).0, OVER, "{key}");
        }
        // A reset through one node is seen by the next hit through another: no node
        // answers a Gubernator item from a deny cache.
        assert_eq!(
            numbers(&one(&mut clients[1], tb(0, RESET_REMAINING)).await).1,
            3
        );
        assert_eq!(
            numbers(&one(&mut clients[2], tb(1, 0)).await),
            (UNDER, 2, end)
        );
        // A give-back through a non-owner reaches the owner's counter.
        assert_eq!(numbers(&one(&mut clients[0], tb(-1, 0)).await).1, 3);
        // Drain through any node.
        assert_eq!(numbers(&one(&mut clients[1], tb(2, 0)).await).1, 1);
        assert_eq!(
            numbers(&one(&mut clients[2], tb(2, DRAIN_OVER_LIMIT)).await),
            (OVER, 0, end)
        );
        assert_eq!(
            numbers(&one(&mut clients[0], tb(0, 0)).await),
            (OVER, 0, end)
        );
    }
    assert!(not_a > 0, "some keys are owned elsewhere than node a");
    assert!(common::metric_sum("ringlimit_forwarded_total") > before);
}

#[tokio::test]
async fn a_graceful_leave_hands_gubernator_counters_to_their_new_owner() {
    // Real clocks: a week-long window (aligned to the epoch) and a leaky bucket that
    // leaks one hit per day do not move within the test.
    const WEEK: i64 = 7 * 24 * 3600 * 1000;
    let mut nodes = Vec::new();
    let mut seeds: Vec<String> = Vec::new();
    for id in ["a", "b", "c"] {
        let node = common::start(gub_config(id, &seeds)).await;
        seeds = vec![node.gossip_addr.to_string()];
        nodes.push(node);
    }
    common::wait_converged(&nodes, 3).await;
    let mut via_a = client(&nodes[0]).await;
    let token = |key: &str, hits| item(key, TOKEN, hits, 3, WEEK);
    let leaky = |key: &str, hits| item(key, LEAKY, hits, 3, 3 * 24 * 3600 * 1000);
    // Keys that node c owns, found by reporting (nothing charged).
    let mut owned_by_c = Vec::new();
    for k in 0.. {
        let key = format!("leaving:{k}");
        if one(&mut via_a, token(&key, 0)).await.metadata["owner"] == "c" {
            owned_by_c.push(key);
        }
        if owned_by_c.len() == 4 {
            break;
        }
    }
    for key in &owned_by_c {
        assert_eq!(numbers(&one(&mut via_a, token(key, 3)).await).1, 0);
        let lb = format!("{key}-lb");
        let r = one(&mut via_a, leaky(&lb, 3)).await;
        assert_eq!(numbers(&r).1, 0, "{lb}");
    }
    nodes.pop().unwrap().leave().await;
    common::wait_converged(&nodes, 2).await;
    for key in &owned_by_c {
        let r = one(&mut via_a, token(key, 1)).await;
        assert_eq!(
            numbers(&r).0,
            OVER,
            "{key} stays exhausted after its owner left"
        );
        assert_ne!(r.metadata["owner"], "c");
        let lb = format!("{key}-lb");
        let r = one(&mut via_a, leaky(&lb, 1)).await;
        assert_eq!(numbers(&r).0, OVER, "{lb} stays empty after its owner left");
    }
}

#[tokio::test]
async fn an_unreachable_owner_is_an_error_of_its_items_only() {
    let mut nodes = Vec::new();
    let mut seeds: Vec<String> = Vec::new();
    for id in ["a", "b", "c"] {
        // Without replicas: with them the key's successor would answer for the owner.
        let config = NodeConfig {
            replicate_interval: std::time::Duration::ZERO,
            ..gub_config(id, &seeds)
        };
        let node = common::start(config).await;
        seeds = vec![node.gossip_addr.to_string()];
        nodes.push(node);
    }
    common::wait_converged(&nodes, 3).await;
    let mut via_a = client(&nodes[0]).await;
    let tb = |key: &str| item(key, TOKEN, 1, 10, 7 * 24 * 3600 * 1000);
    let (mut on_a, mut on_c) = (None, None);
    for k in 0.. {
        let key = format!("crash:{k}");
        let owner = one(
            &mut via_a,
            RateLimitReq {
                hits: 0,
                ..tb(&key)
            },
        )
        .await
        .metadata["owner"]
            .clone();
        match owner.as_str() {
            "a" if on_a.is_none() => on_a = Some(key),
            "c" if on_c.is_none() => on_c = Some(key),
            _ => {}
        }
        if on_a.is_some() && on_c.is_some() {
            break;
        }
    }
    let (on_a, on_c) = (on_a.unwrap(), on_c.unwrap());
    // Crash c: a still has it on its ring until failure detection.
    nodes.pop().unwrap().shutdown().await;
    let answers = via_a
        .get_rate_limits(GetRateLimitsReq {
            requests: vec![tb(&on_c), tb(&on_a)],
        })
        .await
        .unwrap()
        .into_inner()
        .responses;
    assert!(
        answers[0]
            .error
            .starts_with("requests[0]: the owner of this rate limit is unreachable"),
        "{:?}",
        answers[0]
    );
    assert_eq!(numbers(&answers[1]), (UNDER, 9, answers[1].reset_time));
    assert_eq!(answers[1].metadata["owner"], "a");
}
