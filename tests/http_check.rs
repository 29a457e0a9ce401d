//! The HTTP check face (`--check-http-listen`): JSON checks and forward-auth against
//! in-process nodes, and the attacks a client on the gateway network would try. Each
//! attack test names the bypass or exhaustion it closes.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use common::{http_raw_from, rules_file, start, start_cluster_with, HttpAnswer};
use ringlimit::node::config::CheckHttpConfig;
use ringlimit::node::NodeConfig;
use ringlimit::server::forward_auth::{ForwardAuthConfig, IpNet, KeySource};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A strict rule on one exact route and a looser one on everything else, both fixed
/// windows of an hour so nothing refills during a test.
const RULES: &str = r#"
[[rule]]
name = "login"
route = "/v1/login"
algorithm = "fixed_window"
limit = 3
window = "1h"

[[rule]]
name = "api"
route = "*"
algorithm = "fixed_window"
limit = 5
window = "1h"
"#;

fn loopback(last: u8) -> IpAddr {
    IpAddr::from([127, 0, 0, last])
}

/// `change` applied to a check face on port 0 of every node.
fn with_face(change: impl Fn(&mut CheckHttpConfig)) -> impl Fn(&mut NodeConfig) {
    move |config: &mut NodeConfig| {
        let mut face = CheckHttpConfig::on("127.0.0.1:0".parse().unwrap());
        change(&mut face);
        config.check_http = Some(face);
        // Exact counts hold on the owner: on a loaded machine a forward that timed out
        // would fail over to a replica that may lag one interval (a documented loss).
        config.forward.timeout = std::time::Duration::from_secs(5);
    }
}

fn keyed_by_header() -> ForwardAuthConfig {
    ForwardAuthConfig {
        key: KeySource::Header(http::HeaderName::from_static("x-api-key")),
        trusted_proxies: Vec::new(),
    }
}

async fn one_node(
    change: impl Fn(&mut CheckHttpConfig),
) -> (ringlimit::node::RunningNode, tempfile::TempDir) {
    let (dir, rules) = rules_file(RULES);
    let mut config = NodeConfig {
        rules_path: Some(rules),
        ..NodeConfig::for_test()
    };
    with_face(change)(&mut config);
    (start(config).await, dir)
}

fn face(node: &ringlimit::node::RunningNode) -> SocketAddr {
    node.check_http_addr.expect("the check face is served")
}

async fn post_check(addr: SocketAddr, json: &str) -> HttpAnswer {
    let request = format!(
        "POST /v1/check HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{json}",
        json.len()
    );
    http_raw_from(loopback(1), addr, &request).await
}

async fn forward_auth(
    from: IpAddr,
    addr: SocketAddr,
    uri: &str,
    headers: &[(&str, &str)],
) -> HttpAnswer {
    let mut request =
        String::from("GET /v1/forward-auth HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    request.push_str(&format!(
        "X-Forwarded-Uri: {uri}\r\nX-Forwarded-Method: GET\r\n"
    ));
    for (n, v) in headers {
        request.push_str(&format!("{n}: {v}\r\n"));
    }
    request.push_str("\r\n");
    http_raw_from(from, addr, &request).await
}

#[tokio::test]
async fn a_json_check_answers_the_v1_verdict_with_ratelimit_fields() {
    let (node, _dir) = one_node(|_| {}).await;
    let answer = post_check(
        face(&node),
        r#"{"key":"alice","route":"GET /v1/items","cost":2}"#,
    )
    .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let v = answer.json();
    assert_eq!(v["allowed"], true);
    assert_eq!(v["limit"], 5);
    assert_eq!(v["remaining"], 3);
    assert_eq!(v["rule"], "api");
    assert_eq!(v["window_ms"], 3_600_000);
    assert_eq!(v["decider"]["node_id"], "test-node");
    assert_eq!(v["descriptors"][0]["key"], "alice");
    assert_eq!(
        answer.header("ratelimit-policy"),
        Some("\"api\";q=5;w=3600")
    );
    let current = answer.header("ratelimit").expect("RateLimit");
    assert!(current.starts_with("\"api\";r=3;t="), "{current}");
    // Denied: still 200 (the call worked), allowed false, Retry-After.
    let denied = post_check(
        face(&node),
        r#"{"key":"alice","route":"/v1/items","cost":4}"#,
    )
    .await;
    assert_eq!(denied.status, 200);
    assert_eq!(denied.json()["allowed"], false);
    assert!(denied.header("retry-after").is_some());
}

/// Bad input charges nothing: cost 0, a negative cost, malformed or misspelt JSON, an
/// empty key, too many descriptors are each answered 400 with what is wrong, and the
/// budget afterwards is whole.
#[tokio::test]
async fn bad_json_checks_are_refused_by_field_and_charge_nothing() {
    let (node, _dir) = one_node(|_| {}).await;
    let addr = face(&node);
    let nine: Vec<String> = (0..9).map(|i| format!(r#"{{"key":"d{i}"}}"#)).collect();
    let too_many = format!(
        r#"{{"key":"bob","route":"/x","descriptors":[{}]}}"#,
        nine.join(",")
    );
    for (body, says) in [
        (r#"{"key":"bob","route":"/x","cost":0}"#, "cost"),
        (r#"{"key":"bob","route":"/x","cost":-3}"#, "cost"),
        (r#"{"key":"bob","route":"/x","cots":1}"#, "cots"),
        (r#"{"key":"bob","route":"/x""#, "body"),
        (r#"not json at all"#, "body"),
        (r#"{"key":"","route":"/x"}"#, "key"),
        (r#"{"key":"bob","route":"no-slash"}"#, "route"),
        (
            r#"{"key":"bob","route":"/x","cost":99999999999999999999}"#,
            "body",
        ),
        (too_many.as_str(), "descriptors"),
    ] {
        let answer = post_check(addr, body).await;
        assert_eq!(answer.status, 400, "{body}: {answer:?}");
        assert_eq!(
            answer.header("content-type"),
            Some("application/problem+json")
        );
        let detail = answer.json()["detail"].as_str().unwrap().to_string();
        assert!(detail.contains(says), "{body}: {detail}");
    }
    let ok = post_check(addr, r#"{"key":"bob","route":"/x"}"#).await;
    assert_eq!(ok.json()["remaining"], 4, "nothing was charged before");
}

/// Exhaustion closed: a body larger than the bound is refused before it is read (by
/// its Content-Length) or once the bound is passed (chunked), and a body that trickles
/// in is answered 408 at the body timeout.
#[tokio::test]
async fn oversized_and_trickled_bodies_are_refused_without_charging() {
    let (node, _dir) = one_node(|f| f.body_timeout = Duration::from_millis(300)).await;
    let addr = face(&node);
    let declared = http_raw_from(
        loopback(1),
        addr,
        "POST /v1/check HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 10000000\r\n\r\n",
    )
    .await;
    assert_eq!(declared.status, 413);
    let chunk = "a".repeat(100_000);
    let chunked = format!(
        "POST /v1/check HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n",
        chunk.len()
    );
    assert_eq!(http_raw_from(loopback(1), addr, &chunked).await.status, 413);
    // Slow body: the head promises 100 bytes, 10 come.
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            b"POST /v1/check HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"key\":\"c\"",
        )
        .await
        .unwrap();
    let mut raw = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut raw))
        .await
        .expect("answered and closed within the body timeout")
        .unwrap();
    assert!(raw.starts_with("HTTP/1.1 408"), "{raw}");
    let ok = post_check(addr, r#"{"key":"c","route":"/x"}"#).await;
    assert_eq!(ok.json()["remaining"], 4);
}

/// Exhaustion closed: a head that never ends (slowloris) is closed at the header
/// timeout, a head past the size cap at once; the face keeps serving others.
#[tokio::test]
async fn endless_and_oversized_request_heads_are_closed() {
    let (node, _dir) = one_node(|f| {
        f.header_timeout = Duration::from_millis(300);
        f.max_head_bytes = 4096;
    })
    .await;
    let addr = face(&node);
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /v1/forward-auth HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut buf)).await;
    assert!(closed.is_ok(), "a head that never ends is closed");
    let mut big = tokio::net::TcpStream::connect(addr).await.unwrap();
    let header = format!("X-Filler: {}\r\n", "f".repeat(1000));
    let mut sent = String::from("GET /v1/forward-auth HTTP/1.1\r\nHost: x\r\n");
    for _ in 0..20 {
        sent.push_str(&header);
    }
    // The face closes the connection once 4 KiB have come without a head's end: the
    // rest of the write may fail, which is the point.
    let _ = big.write_all(sent.as_bytes()).await;
    let mut buf = Vec::new();
    let answered = tokio::time::timeout(Duration::from_secs(5), big.read_to_end(&mut buf)).await;
    assert!(answered.is_ok(), "an oversized head is closed");
    assert!(!String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 200"));
    let ok = post_check(addr, r#"{"key":"d","route":"/x"}"#).await;
    assert_eq!(ok.status, 200);
}

/// Exhaustion closed: idle connections at the cap do not lock out a new caller; the
/// one that waited longest for a request goes.
#[tokio::test]
async fn at_the_connection_cap_a_new_caller_is_served() {
    let (node, _dir) = one_node(|f| f.max_connections = 2).await;
    let addr = face(&node);
    let _idle_a = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _idle_b = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let answer = post_check(addr, r#"{"key":"e","route":"/x"}"#).await;
    assert_eq!(answer.status, 200);
}

/// Forward-auth across a 3-node cluster, keyed by an API key header: exactly the
/// limit admitted through any node, then 429 with Retry-After, the RateLimit fields and
/// a quota-exceeded problem; every spelling of the login path (percent-encoding, dot
/// segments, double slashes, query strings) is the strict login rule's one budget.
#[tokio::test]
async fn forward_auth_admits_the_limit_across_nodes_and_every_path_spelling_is_one_budget() {
    let (_dir, rules) = rules_file(RULES);
    let nodes = start_cluster_with(
        &["a", "b", "c"],
        Some(&rules),
        with_face(|f| f.forward_auth = keyed_by_header()),
    )
    .await;
    let spellings = [
        "/v1/login",
        "/v1/login?attempt=2",
        "/v1//login",
        "/v1/%6Cogin",
        "/v1/x/../login#frag",
        "/v1/./login?b",
    ];
    let mut admitted = 0;
    for (i, uri) in spellings.iter().enumerate() {
        let node = &nodes[i % 3];
        let answer = forward_auth(loopback(1), face(node), uri, &[("X-Api-Key", "mallory")]).await;
        match answer.status {
            200 => {
                admitted += 1;
                assert_eq!(
                    answer.header("ratelimit-policy"),
                    Some("\"login\";q=3;w=3600")
                );
            }
            429 => {
                assert!(
                    answer
                        .header("retry-after")
                        .unwrap()
                        .parse::<u64>()
                        .unwrap()
                        >= 1
                );
                assert_eq!(
                    answer.header("ratelimit-policy"),
                    Some("\"login\";q=3;w=3600")
                );
                assert!(answer
                    .header("ratelimit")
                    .unwrap()
                    .starts_with("\"login\";r=0;t="));
                assert_eq!(
                    answer.header("content-type"),
                    Some("application/problem+json")
                );
                let problem = answer.json();
                assert_eq!(
                    problem["type"],
                    "https://iana.org/assignments/http-problem-types#quota-exceeded"
                );
                assert_eq!(problem["violated-policies"][0], "login");
            }
            other => panic!("{uri}: status {other}: {answer:?}"),
        }
    }
    assert_eq!(
        admitted, 3,
        "one budget for every spelling of the login path"
    );
    // Another client is not affected; nginx's auth URL asks for 403 on a denial.
    let other = forward_auth(
        loopback(1),
        face(&nodes[1]),
        "/v1/login",
        &[("X-Api-Key", "alice")],
    )
    .await;
    assert_eq!(other.status, 200);
    let mut request = String::from("GET /v1/forward-auth?deny_status=403 HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Original-URI: /v1/login\r\nX-Original-Method: POST\r\nX-Api-Key: mallory\r\n\r\n");
    let nginx = http_raw_from(loopback(1), face(&nodes[2]), &request).await;
    assert_eq!(nginx.status, 403);
    assert!(nginx.header("retry-after").is_some());
    // No key header: 401, nothing charged; no URI header: 400.
    let keyless = forward_auth(loopback(1), face(&nodes[0]), "/v1/login", &[]).await;
    assert_eq!(keyless.status, 401, "{keyless:?}");
    request = String::from(
        "GET /v1/forward-auth HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Api-Key: alice\r\n\r\n",
    );
    assert_eq!(
        http_raw_from(loopback(1), face(&nodes[0]), &request)
            .await
            .status,
        400
    );
    let alice = forward_auth(
        loopback(1),
        face(&nodes[0]),
        "/v1/login",
        &[("X-Api-Key", "alice")],
    )
    .await;
    let current = alice.header("ratelimit").unwrap();
    assert!(
        current.starts_with("\"login\";r=1;"),
        "alice spent 2 of 3: {current}"
    );
}

/// Bypass closed: a client that reaches the face from an address that is not a
/// trusted proxy cannot choose its key by writing X-Forwarded-For or X-Real-IP: every
/// request it sends counts against its own address. A trusted proxy's report is
/// believed, and only as far as the first hop it did not vouch for.
#[tokio::test]
async fn a_spoofed_forwarded_for_from_an_untrusted_peer_does_not_pick_the_key() {
    let (node, _dir) = one_node(|f| {
        f.forward_auth = ForwardAuthConfig {
            key: KeySource::ClientAddress,
            trusted_proxies: vec![IpNet::parse("127.0.0.2").unwrap()],
        }
    })
    .await;
    let addr = face(&node);
    let mut admitted = 0;
    for i in 0..8 {
        let spoof = format!("198.51.100.{i}");
        let answer = forward_auth(
            loopback(3),
            addr,
            "/v1/items",
            &[("X-Forwarded-For", &spoof), ("X-Real-IP", &spoof)],
        )
        .await;
        if answer.status == 200 {
            admitted += 1;
        } else {
            assert_eq!(answer.status, 429);
        }
    }
    assert_eq!(
        admitted, 5,
        "the untrusted peer's own budget, whatever it wrote"
    );
    // Through the trusted proxy: the client it reports (not what that client wrote
    // to the left of it) is the key, with a budget of its own.
    for _ in 0..5 {
        let answer = forward_auth(
            loopback(2),
            addr,
            "/v1/items",
            &[("X-Forwarded-For", "6.6.6.6, 203.0.113.9")],
        )
        .await;
        assert_eq!(answer.status, 200);
    }
    let sixth = forward_auth(
        loopback(2),
        addr,
        "/v1/items",
        &[("X-Forwarded-For", "7.7.7.7, 203.0.113.9")],
    )
    .await;
    assert_eq!(
        sixth.status, 429,
        "a new left-hand entry does not make a new key"
    );
}

/// The face is off unless asked for, and the ops port never answers checks.
#[tokio::test]
async fn the_check_face_is_off_by_default_and_never_the_ops_port() {
    let node = start(NodeConfig::for_test()).await;
    assert!(node.check_http_addr.is_none());
    let ops = node.http_addr.unwrap();
    let answer = common::http(ops, "POST", "/v1/check", &[], r#"{"key":"a","route":"/x"}"#).await;
    assert!(answer.status == 404 || answer.status == 405, "{answer:?}");
    let answer = common::http(
        ops,
        "GET",
        "/v1/forward-auth",
        &[("X-Forwarded-Uri", "/x")],
        "",
    )
    .await;
    assert_eq!(answer.status, 404, "{answer:?}");
}
