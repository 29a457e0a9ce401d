//! Shared helpers for integration tests: start a node on port 0, connect a client.
#![allow(dead_code)]

pub mod tls;

use std::sync::Arc;

use ringlimit::clock::{Clock, ManualClock, SystemClock};
use ringlimit::node::NodeConfig;
use ringlimit::node::{self, RunningNode};
use ringlimit::proto::rate_limiter_client::RateLimiterClient;
use ringlimit::proto::{CheckRequest, Descriptor};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// A node on loopback port 0 with the system clock.
pub async fn start(config: NodeConfig) -> RunningNode {
    start_with_clock(config, Arc::new(SystemClock)).await
}

/// A node on loopback port 0 reading time from `clock`.
pub async fn start_with_clock(config: NodeConfig, clock: Arc<dyn Clock>) -> RunningNode {
    node::start_with_clock(config, clock, CancellationToken::new())
        .await
        .expect("node starts")
}

/// A node whose time only moves when the returned clock is moved.
pub async fn start_manual(config: NodeConfig, start_ms: u64) -> (RunningNode, ManualClock) {
    let clock = ManualClock::new(start_ms);
    let node = start_with_clock(config, Arc::new(clock.clone())).await;
    (node, clock)
}

/// A connected gRPC client.
pub async fn client(node: &RunningNode) -> RateLimiterClient<Channel> {
    RateLimiterClient::connect(format!("http://{}", node.grpc_addr))
        .await
        .expect("client connects")
}

/// A check of `cost` for (key, route).
pub fn check(key: &str, route: &str, cost: Option<i64>) -> CheckRequest {
    CheckRequest {
        key: key.into(),
        route: route.into(),
        cost,
        tier: None,
        descriptors: Vec::new(),
    }
}

/// An extra descriptor for `key` inheriting the request's route, tier and cost.
pub fn descriptor(key: &str) -> Descriptor {
    Descriptor {
        key: key.into(),
        ..Default::default()
    }
}

/// Write `toml` to a rule file in a fresh temp dir (kept alive by the returned guard).
pub fn rules_file(toml: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("rules.toml");
    std::fs::write(&path, toml).expect("write rules");
    (dir, path)
}

/// A config for cluster member `id`, joining through `seeds`.
pub fn member_config(id: &str, seeds: &[String], rules: Option<&std::path::Path>) -> NodeConfig {
    NodeConfig {
        node_id: id.into(),
        seeds: seeds.to_vec(),
        rules_path: rules.map(|p| p.to_path_buf()),
        ..NodeConfig::for_test()
    }
}

/// Start `ids.len()` nodes, each joining through the first; waits until all agree.
pub async fn start_cluster(ids: &[&str], rules: Option<&std::path::Path>) -> Vec<RunningNode> {
    start_cluster_with(ids, rules, |_| {}).await
}

/// [`start_cluster`] with every member's config changed by `change` first.
pub async fn start_cluster_with(
    ids: &[&str],
    rules: Option<&std::path::Path>,
    change: impl Fn(&mut NodeConfig),
) -> Vec<RunningNode> {
    let mut nodes: Vec<RunningNode> = Vec::new();
    for id in ids {
        let seeds: Vec<String> = nodes
            .first()
            .map(|n| n.gossip_addr.to_string())
            .into_iter()
            .collect();
        let mut config = member_config(id, &seeds, rules);
        change(&mut config);
        nodes.push(start(config).await);
    }
    wait_converged(&nodes, ids.len()).await;
    nodes
}

/// Wait (at most 15 s) until every node's ring has `members` members, all rings are
/// equal and every node has restored (a node still restoring refuses forwarded checks,
/// whose entries then fail over to a replica: an exact count would see two deciders).
pub async fn wait_converged(nodes: &[RunningNode], members: usize) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let views: Vec<_> = nodes.iter().map(|n| n.view()).collect();
        let digest = views[0].ring.digest();
        if views
            .iter()
            .all(|v| v.ring.len() == members && v.ring.digest() == digest)
            && nodes.iter().all(RunningNode::restored)
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "cluster did not converge to {members} members: {:?}",
            views
                .iter()
                .map(|v| v.ring.members().to_vec())
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// A client key that the ring over `members` gives to `owner`, with a name prefix.
pub fn key_owned_by(owner: &str, members: &[&str], prefix: &str) -> String {
    let ring = ringlimit::ring::Ring::new(
        members.iter().copied(),
        ringlimit::ring::Ring::DEFAULT_VNODES,
    );
    (0..)
        .map(|i| format!("{prefix}{i}"))
        .find(|k| ring.owner(k.as_bytes()) == Some(owner))
        .expect("some key lands on every member")
}

/// Make a FIFO at `path` (the `mkfifo` tool; no unsafe code in tests).
pub fn mkfifo(path: &std::path::Path) {
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("mkfifo runs");
    assert!(status.success(), "mkfifo {}", path.display());
}

/// The value of the counter `name{labels}` in the process-wide metrics (0 when absent).
/// Nodes in one test process share the recorder, so compare before and after.
pub fn counter_value(name: &str, labels: &str) -> u64 {
    let text = ringlimit::node::metrics_handle().render();
    let series = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .map_or(0, |v| v.trim().parse::<f64>().expect("a number") as u64)
}

/// Poll `cond` every 20 ms for at most `within`; whether it became true.
pub async fn eventually(within: std::time::Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The sum of every sample of metric `name` (all label sets) in this process's
/// Prometheus recorder, which every in-process node shares.
pub fn metric_sum(name: &str) -> f64 {
    node::metrics_handle()
        .render()
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// An HTTP answer from a node's ops port.
#[derive(Debug)]
pub struct HttpAnswer {
    /// Status code.
    pub status: u16,
    /// Raw header block (lower-cased names).
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: String,
}

impl HttpAnswer {
    /// The header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// One HTTP/1.1 request to `addr` (`Connection: close`; the ops port answers with a
/// length, so the body is what follows the headers).
pub async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> HttpAnswer {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("ops port connects");
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await.unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("headers end");
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    HttpAnswer {
        status,
        headers,
        body: body.to_string(),
    }
}

/// One raw HTTP/1.1 request (`head_and_body` as sent: it should say
/// `Connection: close`) to `addr` from the loopback address `from` (any 127.0.0.x:
/// tests that stand for different clients or proxies bind their own), and its answer.
pub async fn http_raw_from(
    from: std::net::IpAddr,
    addr: std::net::SocketAddr,
    head_and_body: &str,
) -> HttpAnswer {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket
        .bind(std::net::SocketAddr::new(from, 0))
        .expect("bind a loopback address");
    let mut stream = socket.connect(addr).await.expect("connects");
    stream.write_all(head_and_body.as_bytes()).await.unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await.unwrap();
    parse_http_answer(&raw)
}

/// An HTTP/1.1 answer read to the end of its connection.
pub fn parse_http_answer(raw: &str) -> HttpAnswer {
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end in {raw:?}"));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    HttpAnswer {
        status,
        headers,
        body: body.to_string(),
    }
}
