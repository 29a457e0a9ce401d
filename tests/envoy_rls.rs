//! Envoy's rate limit service (`envoy.service.ratelimit.v3.RateLimitService`) on a real
//! node: every example of envoyproxy/ratelimit's README ("Examples", 1–9) loaded as its
//! YAML and driven over gRPC, then the request semantics (hits, overrides, refunds,
//! bad input) and a two-node cluster (Envoy descriptors forwarded to their owner).

mod common;

use std::time::Duration;

use ringlimit::node::NodeConfig;
use ringlimit::proto::envoy::extensions::common::ratelimit::v3::{
    rate_limit_descriptor::{Entry, RateLimitOverride},
    RateLimitDescriptor,
};
use ringlimit::proto::envoy::service::ratelimit::v3::{
    rate_limit_response::{rate_limit::Unit, Code},
    rate_limit_service_client::RateLimitServiceClient,
    RateLimitRequest, RateLimitResponse,
};
use tonic::transport::Channel;

/// Midnight UTC: every unit's window starts here, so counts in a test never straddle one.
const T0: u64 = 1_700_006_400_000;

struct Node {
    _dir: tempfile::TempDir,
    node: ringlimit::node::RunningNode,
    clock: ringlimit::clock::ManualClock,
    client: RateLimitServiceClient<Channel>,
}

/// A node on port 0 with the YAML documents written as files of one directory.
async fn node_with(docs: &[&str]) -> Node {
    let dir = tempfile::tempdir().unwrap();
    for (i, doc) in docs.iter().enumerate() {
        std::fs::write(dir.path().join(format!("{i}.yaml")), doc).unwrap();
    }
    let config = NodeConfig {
        envoy_path: Some(dir.path().to_path_buf()),
        ..NodeConfig::for_test()
    };
    let (node, clock) = common::start_manual(config, T0).await;
    let client = RateLimitServiceClient::connect(format!("http://{}", node.grpc_addr))
        .await
        .unwrap();
    Node {
        _dir: dir,
        node,
        clock,
        client,
    }
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..Default::default()
    }
}

fn request(domain: &str, descriptors: &[&[(&str, &str)]]) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors: descriptors.iter().map(|d| descriptor(d)).collect(),
        hits_addend: 0,
    }
}

impl Node {
    async fn ask(&mut self, r: RateLimitRequest) -> RateLimitResponse {
        self.client.should_rate_limit(r).await.unwrap().into_inner()
    }

    /// Send `r` `n` times; how many were OK overall.
    async fn oks(&mut self, r: &RateLimitRequest, n: usize) -> usize {
        let mut ok = 0;
        for _ in 0..n {
            if self.ask(r.clone()).await.overall_code == Code::Ok as i32 {
                ok += 1;
            }
        }
        ok
    }
}

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

#[tokio::test]
async fn readme_example_1_two_values_of_one_key_each_get_500_per_second() {
    let mut n = node_with(&["domain: mongo_cps\ndescriptors:\n  - key: database\n    value: users\n    rate_limit:\n      unit: second\n      requests_per_unit: 500\n\n  - key: database\n    value: default\n    rate_limit:\n      unit: second\n      requests_per_unit: 500\n"]).await;
    let mut users = request("mongo_cps", &[&[("database", "users")]]);
    users.hits_addend = 500;
    let r = n.ask(users.clone()).await;
    assert_eq!(r.overall_code, OK);
    let s = &r.statuses[0];
    let limit = s.current_limit.as_ref().unwrap();
    assert_eq!(
        (limit.requests_per_unit, limit.unit),
        (500, Unit::Second as i32)
    );
    assert_eq!(s.limit_remaining, 0);
    assert_eq!(s.duration_until_reset.unwrap().seconds, 1);
    users.hits_addend = 1;
    assert_eq!(
        n.ask(users).await.overall_code,
        OVER,
        "the 501st in the second"
    );
    let default = request("mongo_cps", &[&[("database", "default")]]);
    assert_eq!(
        n.ask(default).await.statuses[0].limit_remaining,
        499,
        "its own counter"
    );
    let other = n
        .ask(request("mongo_cps", &[&[("database", "other")]]))
        .await;
    assert_eq!(other.overall_code, OK);
    assert!(
        other.statuses[0].current_limit.is_none(),
        "no limit for other values"
    );
    n.clock.advance(1_000);
    let users = request("mongo_cps", &[&[("database", "users")]]);
    assert_eq!(n.ask(users).await.overall_code, OK, "the next second");
}

#[tokio::test]
async fn readme_example_2_marketing_5_a_day_per_number_and_100_a_day_to_any_number() {
    let mut n = node_with(&["domain: messaging\ndescriptors:\n  - key: message_type\n    value: marketing\n    descriptors:\n      - key: to_number\n        rate_limit:\n          unit: day\n          requests_per_unit: 5\n  - key: to_number\n    rate_limit:\n      unit: day\n      requests_per_unit: 100\n"]).await;
    // The README's combined request: both descriptors in one call.
    let both = |number: &'static str| {
        request(
            "messaging",
            &[
                &[("message_type", "marketing"), ("to_number", number)],
                &[("to_number", number)],
            ],
        )
    };
    assert_eq!(
        n.oks(&both("2061111111"), 6).await,
        5,
        "5 marketing messages a day"
    );
    let r = n.ask(both("2061111111")).await;
    assert_eq!(r.statuses[0].code, OVER);
    assert_eq!(r.statuses[1].code, OK);
    // The denied requests were refunded on the 100-a-day limit: 5 counted, not 7.
    let plain = n
        .ask(request("messaging", &[&[("to_number", "2061111111")]]))
        .await;
    assert_eq!(plain.statuses[0].limit_remaining, 100 - 5 - 1);
    assert_eq!(
        plain.statuses[0].current_limit.as_ref().unwrap().unit,
        Unit::Day as i32
    );
    assert_eq!(
        n.oks(&both("2062222222"), 5).await,
        5,
        "each number its own 5"
    );
    assert_eq!(
        n.oks(
            &request("messaging", &[&[("to_number", "2063333333")]]),
            101
        )
        .await,
        100,
        "100 a day to any one number"
    );
}

#[tokio::test]
async fn readme_example_3_an_exact_value_beats_the_key_and_zero_blocks() {
    let mut n = node_with(&["domain: edge_proxy_per_ip\ndescriptors:\n  - key: remote_address\n    rate_limit:\n      unit: second\n      requests_per_unit: 10\n\n  # Black list IP\n  - key: remote_address\n    value: 50.0.0.5\n    rate_limit:\n      unit: second\n      requests_per_unit: 0\n"]).await;
    let ip = |a: &str| request("edge_proxy_per_ip", &[&[("remote_address", a)]]);
    assert_eq!(n.oks(&ip("50.0.0.1"), 11).await, 10);
    assert_eq!(n.oks(&ip("50.0.0.2"), 10).await, 10, "every IP its own 10");
    let r = n.ask(ip("50.0.0.5")).await;
    assert_eq!(r.overall_code, OVER, "black-listed");
    assert_eq!(
        r.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        0
    );
}

#[tokio::test]
async fn readme_example_4_a_limit_applies_only_at_the_depth_of_the_request() {
    let shallow = "domain: example4\ndescriptors:\n  - key: key\n    value: value\n    rate_limit:\n      requests_per_unit: 300\n      unit: second\n";
    let nested = "domain: example4\ndescriptors:\n  - key: key\n    value: value\n    descriptors:\n      - key: subkey\n        rate_limit:\n          requests_per_unit: 300\n          unit: second\n";
    let two = request("example4", &[&[("key", "value"), ("subkey", "subvalue")]]);
    let mut n = node_with(&[shallow]).await;
    let r = n.ask(two.clone()).await;
    assert_eq!(r.overall_code, OK);
    assert!(
        r.statuses[0].current_limit.is_none(),
        "does not match the shallow config"
    );
    let mut n = node_with(&[nested]).await;
    let r = n.ask(two).await;
    assert_eq!(
        r.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        300
    );
    assert_eq!(r.statuses[0].limit_remaining, 299);
}

#[tokio::test]
async fn readme_example_5_unlimited_is_ok_with_max_remaining_and_azure_gets_100() {
    let mut n = node_with(&["domain: internal\ndescriptors:\n  - key: ldap\n    rate_limit:\n      unlimited: true\n\n  - key: azure\n    rate_limit:\n      unit: minute\n      requests_per_unit: 100\n"]).await;
    let ldap = request("internal", &[&[("ldap", "x")]]);
    assert_eq!(n.oks(&ldap, 200).await, 200);
    let r = n.ask(ldap).await;
    assert_eq!(r.statuses[0].limit_remaining, u32::MAX);
    assert!(r.statuses[0].current_limit.is_none());
    assert_eq!(
        n.oks(&request("internal", &[&[("azure", "x")]]), 101).await,
        100
    );
}

#[tokio::test]
async fn readme_example_6_shadow_mode_counts_but_allows() {
    let before = common::counter_value(
        "ringlimit_shadow_denials_total",
        "rule=\"example6.service.user_user-a\"",
    );
    let mut n = node_with(&["domain: example6\ndescriptors:\n  - key: service\n    descriptors:\n      - key: user\n        value: user-a\n        rate_limit:\n          requests_per_unit: 10\n          unit: second\n        shadow_mode: true\n      - key: user\n        value: user-b\n        rate_limit:\n          requests_per_unit: 20\n          unit: second\n"]).await;
    let a = request(
        "example6",
        &[&[("service", "auth-service"), ("user", "user-a")]],
    );
    assert_eq!(n.oks(&a, 15).await, 15, "user-a is never limited");
    let after = common::counter_value(
        "ringlimit_shadow_denials_total",
        "rule=\"example6.service.user_user-a\"",
    );
    assert_eq!(after - before, 5, "but its breaches are counted");
    let b = request(
        "example6",
        &[&[("service", "auth-service"), ("user", "user-b")]],
    );
    assert_eq!(n.oks(&b, 21).await, 20, "user-b is limited to 20");
}

#[tokio::test]
async fn readme_example_7_replaces_drops_the_named_limit_for_that_request_only() {
    let mut n = node_with(&["domain: example7\ndescriptors:\n  - key: key_1\n    value: value_1\n    descriptors:\n      - key: user\n        value: bkthomps\n        rate_limit:\n          name: specific_limit\n          requests_per_unit: 5\n          unit: second\n  - key: key_2\n    value: value_2\n    descriptors:\n      - key: user\n        value: bkthomps\n        rate_limit:\n          replaces:\n            - name: specific_limit\n          requests_per_unit: 10\n          unit: second\n"]).await;
    let one = [("key_1", "value_1"), ("user", "bkthomps")];
    let two = [("key_2", "value_2"), ("user", "bkthomps")];
    let both = request("example7", &[&one, &two]);
    let r = n.ask(both.clone()).await;
    assert!(
        r.statuses[0].current_limit.is_none(),
        "specific_limit was replaced"
    );
    assert_eq!(
        r.statuses[1]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        10
    );
    assert_eq!(n.oks(&both, 10).await, 9, "10 / sec in all");
    assert_eq!(
        n.oks(&request("example7", &[&one]), 6).await,
        5,
        "the 5 / sec limit was not affected"
    );
}

#[tokio::test]
async fn readme_example_8_detailed_metric_is_accepted_and_values_count_apart() {
    let mut n = node_with(&["domain: example8\ndescriptors:\n  - key: key1\n    detailed_metric: true\n    rate_limit:\n      unit: minute\n      requests_per_unit: 10\n  - key: key1\n    value: value1\n    rate_limit:\n      unit: minute\n      requests_per_unit: 20\n"]).await;
    let v = |value: &'static str| request("example8", &[&[("key1", value)]]);
    assert_eq!(n.oks(&v("unspecified_value"), 11).await, 10);
    assert_eq!(n.oks(&v("unspecified_value2"), 11).await, 10);
    assert_eq!(n.oks(&v("value1"), 21).await, 20);
}

#[tokio::test]
async fn readme_example_9_a_wildcard_value_gives_each_matching_value_20() {
    let mut n = node_with(&["domain: example9\ndescriptors:\n  - key: key1\n    value: value*\n    rate_limit:\n      unit: minute\n      requests_per_unit: 20\n"]).await;
    let v = |value: &'static str| request("example9", &[&[("key1", value)]]);
    assert_eq!(n.oks(&v("value_1"), 21).await, 20);
    assert_eq!(n.oks(&v("value_2"), 21).await, 20);
    let r = n.ask(v("other")).await;
    assert!(r.statuses[0].current_limit.is_none());
}

const SEMANTICS: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit:\n      unit: minute\n      requests_per_unit: 10\n      name: per_user\n  - key: ip\n    rate_limit:\n      unit: minute\n      requests_per_unit: 3\n  - key: path\n    value: /v1/*\n    share_threshold: true\n    rate_limit:\n      unit: minute\n      requests_per_unit: 2\n  - key: sliding\n    rate_limit:\n      unit: second\n      requests_per_unit: 4\n      algorithm: sliding_window_counter\n";

#[tokio::test]
async fn hits_addend_defaults_to_one_descriptors_override_it_and_zero_only_reports() {
    let mut n = node_with(&[SEMANTICS]).await;
    let mut r = request("api", &[&[("user", "a")]]);
    r.hits_addend = 4;
    assert_eq!(n.ask(r.clone()).await.statuses[0].limit_remaining, 6);
    r.descriptors[0].hits_addend = Some(0);
    for _ in 0..3 {
        let s = &n.ask(r.clone()).await.statuses[0];
        assert_eq!(
            (s.code, s.limit_remaining),
            (OK, 6),
            "reported, not counted"
        );
    }
    r.descriptors[0].hits_addend = Some(6);
    assert_eq!(
        n.ask(r.clone()).await.statuses[0].limit_remaining,
        0,
        "the descriptor's own"
    );
    r.descriptors[0].hits_addend = Some(0);
    assert_eq!(
        n.ask(r.clone()).await.overall_code,
        OVER,
        "a spent budget reports OVER_LIMIT"
    );
    // A large addend is valid: denied, and nothing counted.
    let mut big = request("api", &[&[("user", "b")]]);
    big.descriptors[0].hits_addend = Some(u64::MAX);
    assert_eq!(n.ask(big).await.overall_code, OVER);
    assert_eq!(
        n.ask(request("api", &[&[("user", "b")]])).await.statuses[0].limit_remaining,
        9
    );
}

#[tokio::test]
async fn an_override_replaces_the_limit_and_denials_refund_the_descriptors_that_allowed() {
    let mut n = node_with(&[SEMANTICS]).await;
    let mut r = request("api", &[&[("user", "o")]]);
    r.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 2,
        unit: 1, // SECOND
    });
    let s = n.ask(r.clone()).await.statuses[0].clone();
    let limit = s.current_limit.unwrap();
    assert_eq!(
        (limit.requests_per_unit, limit.unit, s.limit_remaining),
        (2, Unit::Second as i32, 1)
    );
    assert_eq!(n.oks(&r, 2).await, 1);
    // user (10/min) and ip (3/min): once ip denies, user is refunded every time.
    let both = request("api", &[&[("user", "r")], &[("ip", "1.2.3.4")]]);
    assert_eq!(n.oks(&both, 8).await, 3);
    let user = n.ask(request("api", &[&[("user", "r")]])).await;
    assert_eq!(
        user.statuses[0].limit_remaining,
        10 - 3 - 1,
        "5 denied requests cost nothing"
    );
    assert_eq!(
        user.statuses[0].current_limit.as_ref().unwrap().name,
        "per_user"
    );
}

#[tokio::test]
async fn share_threshold_makes_matching_values_share_one_counter_and_resets_round_up() {
    let mut n = node_with(&[SEMANTICS]).await;
    assert_eq!(
        n.ask(request("api", &[&[("path", "/v1/a")]]))
            .await
            .overall_code,
        OK
    );
    assert_eq!(
        n.ask(request("api", &[&[("path", "/v1/b")]]))
            .await
            .overall_code,
        OK
    );
    assert_eq!(
        n.ask(request("api", &[&[("path", "/v1/c")]]))
            .await
            .overall_code,
        OVER
    );
    n.clock.advance(100);
    let r = n.ask(request("api", &[&[("ip", "9.9.9.9")]])).await;
    let reset = r.statuses[0].duration_until_reset.unwrap();
    assert_eq!((reset.seconds, reset.nanos), (60, 0), "59.9 s rounded up");
    // A per-rule algorithm: the sliding window counter.
    assert_eq!(n.oks(&request("api", &[&[("sliding", "s")]]), 5).await, 4);
}

#[tokio::test]
async fn bad_requests_are_invalid_argument_naming_the_field_and_charge_nothing() {
    let mut n = node_with(&[SEMANTICS]).await;
    let cases: Vec<(RateLimitRequest, &str)> = vec![
        (request("", &[&[("user", "x")]]), "domain"),
        (request("api", &[]), "descriptors"),
        (request("api", &[&[]]), "descriptors[0].entries"),
        (
            request("api", &[&[("user", "x")], &[("", "x")]]),
            "descriptors[1].entries[0].key",
        ),
        (
            request("api", &[&[("user", "x"), ("ip", "")]]),
            "descriptors[0].entries[1].value",
        ),
        (
            {
                let mut r = request("api", &[&[("user", "x")]]);
                r.descriptors[0].limit = Some(RateLimitOverride {
                    requests_per_unit: 1,
                    unit: 5,
                });
                r
            },
            "descriptors[0].limit.unit",
        ),
    ];
    for (r, field) in cases {
        let status = n.client.should_rate_limit(r).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(
            status.message().starts_with(&format!("{field}: ")),
            "{field}: {}",
            status.message()
        );
    }
    let r = n.ask(request("api", &[&[("user", "x")]])).await;
    assert_eq!(r.statuses[0].limit_remaining, 9, "nothing was charged");
}

#[tokio::test]
async fn the_config_is_reloaded_when_it_changes_and_a_broken_edit_keeps_the_old_one() {
    let mut n = node_with(&["domain: r\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n"]).await;
    let k = request("r", &[&[("k", "v")]]);
    assert_eq!(
        n.ask(k.clone()).await.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        1
    );
    let path = n._dir.path().join("0.yaml");
    std::fs::write(&path, "domain: r\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 7}\n").unwrap();
    let mut seen = 0;
    for _ in 0..100 {
        seen = n.ask(k.clone()).await.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit;
        if seen == 7 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(seen, 7, "reloaded");
    std::fs::write(
        &path,
        "domain: r\ndescriptors:\n  - key: k\n    rate_limt: {}\n",
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = n.ask(k).await;
    assert_eq!(
        r.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        7,
        "kept"
    );
    let _ = &n.node;
}

#[tokio::test]
async fn a_node_refuses_to_start_with_a_bad_envoy_config_naming_key_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.yaml");
    std::fs::write(&path, "domain: d\ndescriptors:\n  - key: k\n    valu: x\n").unwrap();
    let config = NodeConfig {
        envoy_path: Some(path),
        ..NodeConfig::for_test()
    };
    let error = match ringlimit::node::start(config).await {
        Ok(_) => panic!("a bad envoy config must refuse the start"),
        Err(error) => error.to_string(),
    };
    assert!(
        error.contains("unknown field `valu`") && error.contains("line 4"),
        "{error}"
    );
}

#[tokio::test]
async fn envoy_descriptors_owned_by_another_node_are_forwarded_and_decided_there() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ip.yaml");
    std::fs::write(&path, "domain: ips\ndescriptors:\n  - key: ip\n    rate_limit: {unit: hour, requests_per_unit: 2}\n").unwrap();
    let mut nodes = Vec::new();
    let mut seeds: Vec<String> = Vec::new();
    for id in ["a", "b"] {
        let config = NodeConfig {
            envoy_path: Some(path.clone()),
            ..common::member_config(id, &seeds, None)
        };
        let node = common::start(config).await;
        seeds = vec![node.gossip_addr.to_string()];
        nodes.push(node);
    }
    common::wait_converged(&nodes, 2).await;
    let before = common::metric_sum("ringlimit_forwarded_total");
    let mut a = RateLimitServiceClient::connect(format!("http://{}", nodes[0].grpc_addr))
        .await
        .unwrap();
    let mut b = RateLimitServiceClient::connect(format!("http://{}", nodes[1].grpc_addr))
        .await
        .unwrap();
    for i in 0..16 {
        let ip = format!("10.0.0.{i}");
        let r = request("ips", &[&[("ip", ip.as_str())]]);
        // Two through one node, then the third through the other: one counter.
        for _ in 0..2 {
            let answer = a.should_rate_limit(r.clone()).await.unwrap().into_inner();
            assert_eq!(answer.overall_code, OK, "{ip}");
        }
        let third = b.should_rate_limit(r).await.unwrap().into_inner();
        assert_eq!(
            third.overall_code, OVER,
            "{ip}: the owner counted all three"
        );
    }
    assert!(
        common::metric_sum("ringlimit_forwarded_total") > before,
        "some were forwarded"
    );
}

#[tokio::test]
async fn reflection_v1_and_v1alpha_list_the_public_services_only() {
    let n = node_with(&[SEMANTICS]).await;
    let channel = Channel::from_shared(format!("http://{}", n.node.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let v1 = {
        use tonic_reflection::pb::v1::{
            server_reflection_client::ServerReflectionClient,
            server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
            ServerReflectionRequest,
        };
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut answers = ServerReflectionClient::new(channel.clone())
            .server_reflection_info(tokio_stream::iter(vec![request]))
            .await
            .unwrap()
            .into_inner();
        let answer = answers.message().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
            panic!("v1: expected a service list, got {answer:?}");
        };
        let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        names.sort();
        names
    };
    let v1alpha = {
        use tonic_reflection::pb::v1alpha::{
            server_reflection_client::ServerReflectionClient,
            server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
            ServerReflectionRequest,
        };
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
            panic!("v1alpha: expected a service list, got {answer:?}");
        };
        let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        names.sort();
        names
    };
    let public = [
        "envoy.service.ratelimit.v3.RateLimitService",
        "grpc.health.v1.Health",
        "ringlimit.v1.RateLimiter",
    ];
    let without = |names: &[String], reflection: &str| {
        assert!(names.iter().any(|n| n == reflection), "{names:?}");
        names
            .iter()
            .filter(|n| !n.starts_with("grpc.reflection."))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(without(&v1, "grpc.reflection.v1.ServerReflection"), public);
    assert_eq!(
        without(&v1alpha, "grpc.reflection.v1alpha.ServerReflection"),
        public,
        "both versions list the same public services, never the peer API"
    );
}

/// The counter key of a one-entry descriptor (`check::domain`'s length-prefixed
/// encoding of domain, key, value): what the ring places.
fn counter_key(domain: &str, key: &str, value: &str) -> String {
    [domain, key, value]
        .iter()
        .map(|p| format!("{}:{p}", p.len()))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_owner_fails_open_degraded_or_answers_unavailable_per_rule() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.yaml");
    std::fs::write(&path, "domain: f\ndescriptors:\n  - key: open\n    rate_limit: {unit: hour, requests_per_unit: 30}\n  - key: closed\n    rate_limit: {unit: hour, requests_per_unit: 30, on_unavailable: closed}\n  - key: local\n    rate_limit: {unit: hour, requests_per_unit: 30}\n").unwrap();
    let ids = ["a", "b", "c"];
    let mut nodes = Vec::new();
    let mut seeds: Vec<String> = Vec::new();
    for id in ids {
        let config = NodeConfig {
            envoy_path: Some(path.clone()),
            // The entry node's own fallback: without replicas (with them the key's
            // successor decides first, as tests/cluster.rs shows).
            replicate_interval: std::time::Duration::ZERO,
            ..common::member_config(id, &seeds, None)
        };
        let node = common::start(config).await;
        seeds = vec![node.gossip_addr.to_string()];
        nodes.push(node);
    }
    common::wait_converged(&nodes, 3).await;
    let ring =
        ringlimit::ring::Ring::new(ids.iter().copied(), ringlimit::ring::Ring::DEFAULT_VNODES);
    let on = |owner: &str, key: &str| {
        (0..)
            .map(|i| format!("v{i}"))
            .find(|v| ring.owner(counter_key("f", key, v).as_bytes()) == Some(owner))
            .unwrap()
    };
    let (open_v, closed_v, local_v) = (on("c", "open"), on("c", "closed"), on("a", "local"));
    // Crash c: a still has it on its ring until failure detection.
    nodes.pop().unwrap().shutdown().await;
    let mut via_a = RateLimitServiceClient::connect(format!("http://{}", nodes[0].grpc_addr))
        .await
        .unwrap();
    let open = via_a
        .should_rate_limit(request("f", &[&[("open", open_v.as_str())]]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(open.overall_code, OK, "fail-open: decided on a, degraded");
    assert_eq!(
        open.statuses[0].limit_remaining,
        30 / 3 - 1,
        "on the per-node share"
    );
    let status = via_a
        .should_rate_limit(request(
            "f",
            &[
                &[("local", local_v.as_str())],
                &[("closed", closed_v.as_str())],
            ],
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status.message().starts_with("descriptors[1]: "),
        "{}",
        status.message()
    );
    let local = via_a
        .should_rate_limit(request("f", &[&[("local", local_v.as_str())]]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        local.statuses[0].limit_remaining, 29,
        "the sibling was refunded"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_graceful_leave_hands_envoy_counters_to_their_new_owner() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.yaml");
    // An Envoy rule whose numbers no TOML rule shares: found by the Envoy configuration.
    std::fs::write(&path, "domain: h\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 3, algorithm: sliding_window_log}\n").unwrap();
    let ids = ["a", "b", "c"];
    let mut nodes = Vec::new();
    let mut seeds: Vec<String> = Vec::new();
    for id in ids {
        let config = NodeConfig {
            envoy_path: Some(path.clone()),
            ..common::member_config(id, &seeds, None)
        };
        let node = common::start(config).await;
        seeds = vec![node.gossip_addr.to_string()];
        nodes.push(node);
    }
    common::wait_converged(&nodes, 3).await;
    let ring =
        ringlimit::ring::Ring::new(ids.iter().copied(), ringlimit::ring::Ring::DEFAULT_VNODES);
    let values: Vec<String> = (0..)
        .map(|i| format!("u{i}"))
        .filter(|v| ring.owner(counter_key("h", "user", v).as_bytes()) == Some("c"))
        .take(4)
        .collect();
    let mut via_a = RateLimitServiceClient::connect(format!("http://{}", nodes[0].grpc_addr))
        .await
        .unwrap();
    for v in &values {
        for _ in 0..3 {
            let r = via_a
                .should_rate_limit(request("h", &[&[("user", v.as_str())]]))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.overall_code, OK);
        }
    }
    nodes.pop().unwrap().leave().await;
    common::wait_converged(&nodes, 2).await;
    for v in &values {
        let r = via_a
            .should_rate_limit(request("h", &[&[("user", v.as_str())]]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.overall_code, OVER,
            "{v} stays exhausted after its owner left"
        );
    }
}

/// envoyproxy/ratelimit's `quota_mode`: two quota buckets (a model's two backends,
/// say) of 2 per minute each. Each request is counted against both; once one is over
/// it says OVER_LIMIT in its own status while the request stays OK, and only when both
/// are over is the request OVER_LIMIT. A plain limit beside them still denies alone.
#[tokio::test]
async fn quota_mode_is_over_limit_only_when_every_quota_descriptor_is_over() {
    let mut n = node_with(&["domain: ai\ndescriptors:\n  - key: backend\n    value: a\n    quota_mode: true\n    rate_limit: {unit: minute, requests_per_unit: 2}\n  - key: backend\n    value: b\n    quota_mode: true\n    rate_limit: {unit: minute, requests_per_unit: 3}\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 10}\n"]).await;
    let r = request(
        "ai",
        &[&[("backend", "a")], &[("backend", "b")], &[("user", "u1")]],
    );
    let codes =
        |resp: &RateLimitResponse| -> Vec<i32> { resp.statuses.iter().map(|s| s.code).collect() };
    for _ in 0..2 {
        let resp = n.ask(r.clone()).await;
        assert_eq!((resp.overall_code, codes(&resp)), (OK, vec![OK, OK, OK]));
    }
    // a is over, b still has one: OK, a's own status says so.
    let resp = n.ask(r.clone()).await;
    assert_eq!((resp.overall_code, codes(&resp)), (OK, vec![OVER, OK, OK]));
    // Both over: the request is.
    let resp = n.ask(r.clone()).await;
    assert_eq!(
        (resp.overall_code, codes(&resp)),
        (OVER, vec![OVER, OVER, OK])
    );
    // The plain limit alone: 10 per minute for u2, whatever the quota buckets say.
    let alone = request("ai", &[&[("user", "u2")]]);
    assert_eq!(n.oks(&alone, 12).await, 10);
    drop(n.clock);
    n.node.shutdown().await;
}
