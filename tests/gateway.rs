//! The example gateway (`examples/gateway.rs`) against real `ringlimit serve` processes,
//! spoken to with plain HTTP/1.1 as curl would (issue 13): the 101st request for one key
//! is a 429 with `Retry-After`, both header families and the problem+json body; allowed
//! answers carry the headers; a query string shares the budget; and with the key's owner
//! killed (kill -9) the gateway still answers within its deadline, marked degraded.

mod common;
#[path = "common/process.rs"]
mod process;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use process::{Process, Serve};

// The sliding log: exact, with no window boundary, so the remaining counts below hold
// whenever the test runs.
const RULES: &str = r#"
[default]
algorithm = "sliding_window_log"
limit = 100
window = "60s"
"#;

/// The example binary cargo built next to this test (`target/<profile>/examples/`).
fn gateway_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    let profile_dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    profile_dir.join("examples").join("gateway")
}

/// The gateway process; killed on drop.
struct Gateway {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_gateway(seeds: &[SocketAddr], deadline_ms: u64) -> Gateway {
    let mut cmd = Command::new(gateway_bin());
    cmd.args(["--listen", "127.0.0.1:0"])
        .args(["--deadline-ms", &deadline_ms.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for seed in seeds {
        cmd.args(["--ringlimit", &seed.to_string()]);
    }
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", gateway_bin().display()));
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("gateway listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .parse()
        .unwrap();
    Gateway { child, addr }
}

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: HashMap<String, String>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
    /// The integer parameter `param` of the one-item Structured Field `name`
    /// (`RateLimit: "default";r=41;t=60`).
    fn param(&self, name: &str, param: &str) -> u64 {
        let value = self
            .header(name)
            .unwrap_or_else(|| panic!("no {name} in {:?}", self.headers));
        value
            .split(';')
            .find_map(|p| p.strip_prefix(&format!("{param}=")))
            .unwrap_or_else(|| panic!("no {param} in {name}: {value}"))
            .parse()
            .unwrap()
    }
    fn number(&self, name: &str) -> u64 {
        self.header(name)
            .unwrap_or_else(|| panic!("no {name} in {:?}", self.headers))
            .parse()
            .unwrap()
    }
}

/// One HTTP/1.1 GET on a fresh connection, as curl sends it.
async fn get(addr: SocketAddr, path: &str, api_key: &str) -> Reply {
    let answer = common::http(addr, "GET", path, &[("X-Api-Key", api_key)], "").await;
    Reply {
        status: answer.status,
        headers: answer.headers.into_iter().collect(),
        body: answer.body,
    }
}

fn unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Until every node's public `Topology` lists `members` members.
async fn wait_for_members(nodes: &[SocketAddr], members: usize) {
    use ringlimit::proto::rate_limiter_client::RateLimiterClient;
    let deadline = Instant::now() + Duration::from_secs(15);
    for addr in nodes {
        let mut client = RateLimiterClient::new(process::lazy_channel(*addr));
        loop {
            let listed = client
                .topology(ringlimit::proto::TopologyRequest {})
                .await
                .map(|t| t.into_inner().members.len())
                .map_err(|s| s.to_string());
            if listed == Ok(members) {
                break;
            }
            assert!(Instant::now() < deadline, "{addr} lists {listed:?} members");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn spawn_node(
    dir: &std::path::Path,
    rules: &std::path::Path,
    id: &str,
    seeds: &[SocketAddr],
) -> Process {
    Process::spawn(&Serve {
        id,
        ip: Ipv4Addr::LOCALHOST.into(),
        rules,
        seeds,
        extra_args: &[],
        dir,
        log_name: id,
        env: &[],
    })
    .unwrap_or_else(|message| panic!("{message}"))
}

#[tokio::test]
async fn the_101st_request_is_a_429_with_the_contract_and_allowed_answers_carry_the_headers() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.toml");
    std::fs::write(&rules, RULES).unwrap();
    let node = spawn_node(dir.path(), &rules, "n1", &[]);
    let gateway = start_gateway(&[node.ready.grpc], 2_000);

    for i in 1..=100u64 {
        let reply = get(gateway.addr, "/v1/charges", "cust_42").await;
        assert_eq!(reply.status, 200, "request {i}: {reply:?}");
        assert!(reply.body.contains("\"upstream\":\"ok\""), "{reply:?}");
        assert_eq!(reply.param("ratelimit-policy", "q"), 100);
        assert_eq!(reply.param("ratelimit", "r"), 100 - i, "request {i}");
        assert_eq!(
            reply.header("ratelimit-policy"),
            Some("\"default\";q=100;w=60")
        );
        assert!(reply.number("x-ratelimit-reset") >= unix_s());
        assert!(reply.header("retry-after").is_none());
        assert_eq!(reply.header("x-ratelimit-source"), Some("owner"));
    }

    let denied = get(gateway.addr, "/v1/charges", "cust_42").await;
    assert_eq!(denied.status, 429, "{denied:?}");
    let retry_after = denied.number("retry-after");
    assert!((1..=60).contains(&retry_after), "{denied:?}");
    assert_eq!(denied.param("ratelimit-policy", "q"), 100);
    assert_eq!(denied.param("ratelimit", "r"), 0);
    assert!(denied.param("ratelimit", "t") <= 60);
    assert_eq!(denied.number("x-ratelimit-limit"), 100);
    assert_eq!(denied.number("x-ratelimit-remaining"), 0);
    let reset_at = denied.number("x-ratelimit-reset");
    assert!(
        reset_at > unix_s() && reset_at <= unix_s() + 61,
        "{denied:?}"
    );
    assert_eq!(
        denied.header("content-type"),
        Some("application/problem+json")
    );
    let body: serde_json::Value = serde_json::from_str(&denied.body).unwrap();
    assert_eq!(body["title"], "Too Many Requests");
    assert_eq!(body["limit"], 100);
    assert_eq!(body["window"], "60s");
    assert_eq!(body["retry_after"], retry_after);
    assert_eq!(body["type"], "https://ringlimit.dev/errors/rate-limit");

    // The next one is answered by the gateway's deny cache: no call at all.
    let cached = get(gateway.addr, "/v1/charges?nonce=1", "cust_42").await;
    assert_eq!(
        cached.status, 429,
        "a query string shares the budget: {cached:?}"
    );
    // Another client is not affected.
    let other = get(gateway.addr, "/v1/charges", "cust_43").await;
    assert_eq!(other.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_keys_owner_killed_the_gateway_answers_within_its_deadline_degraded() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.toml");
    std::fs::write(&rules, RULES).unwrap();
    let a = spawn_node(dir.path(), &rules, "a", &[]);
    let mut b = spawn_node(dir.path(), &rules, "b", &[a.ready.gossip]);
    let key = {
        let ring = ringlimit::ring::Ring::new(["a", "b"], ringlimit::ring::Ring::DEFAULT_VNODES);
        (0..)
            .map(|i| format!("cust_{i}"))
            .find(|k| ring.owner(k.as_bytes()) == Some("b"))
            .unwrap()
    };
    wait_for_members(&[a.ready.grpc, b.ready.grpc], 2).await;
    // Seeded with a only: the gateway learns b from the topology and goes to b direct.
    let deadline_ms = 500;
    let gateway = start_gateway(&[a.ready.grpc], deadline_ms);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let reply = get(gateway.addr, "/x", &key).await;
        assert_eq!(reply.status, 200, "{reply:?}");
        if reply.header("x-ratelimit-source") == Some("owner") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never routed to the owner: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    b.kill();
    let started = Instant::now();
    let reply = get(gateway.addr, "/x", &key).await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(deadline_ms + 500),
        "answered after {took:?}: {reply:?}"
    );
    // a's fallback for an unreachable owner (the rule fails open), or the gateway's own.
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.header("x-ratelimit-degraded"), Some("1"), "{reply:?}");
    eprintln!(
        "owner killed: answered in {took:?}, source {:?}",
        reply.header("x-ratelimit-source")
    );
}
