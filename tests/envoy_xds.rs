//! `serve --envoy-xds`: a node following an xDS control plane written here (a small tonic
//! Aggregated Discovery Service on port 0 serving envoyproxy/ratelimit's
//! `RateLimitConfig`), checked through the node's Envoy RLS face: a set is applied and
//! ACKed, a bad one NACKed with its reason while the old one stays enforced, a control
//! plane that goes away (its port refusing connections, or hung: accepting and never
//! answering, found out by HTTP/2 keepalive) and comes back leaves the last good set in
//! force, and a domain sent over xDS has the digest of the same domain in a YAML file (no
//! drift reported).

mod common;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use ringlimit::config::xds::RATE_LIMIT_CONFIG_TYPE;
use ringlimit::node::NodeConfig;
use ringlimit::proto::envoy::extensions::common::ratelimit::v3::{
    rate_limit_descriptor::Entry, RateLimitDescriptor as RequestDescriptor,
};
use ringlimit::proto::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use ringlimit::proto::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use ringlimit::proto::envoy::service::ratelimit::v3::{
    rate_limit_response::Code, rate_limit_service_client::RateLimitServiceClient, RateLimitRequest,
};
use ringlimit::proto::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

/// Midnight UTC: every window starts here, so counts never straddle one.
const T0: u64 = 1_700_006_400_000;
/// The longest any step may take before the test fails (nothing waits this long when
/// the node works).
const PATIENCE: Duration = Duration::from_secs(20);

/// The service one incarnation of the control plane runs: sends the current set on every
/// stream (again whenever it changes) and records every request.
struct Ads {
    set: watch::Receiver<Option<DiscoveryResponse>>,
    requests: mpsc::UnboundedSender<DiscoveryRequest>,
    nonces: Arc<AtomicU64>,
    down: CancellationToken,
}

type ResponseStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = ResponseStream;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<ResponseStream>, Status> {
        let mut inbound = request.into_inner();
        let (out, rx) = mpsc::channel(4);
        let (mut set, requests, nonces, down) = (
            self.set.clone(),
            self.requests.clone(),
            self.nonces.clone(),
            self.down.clone(),
        );
        set.mark_changed();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = down.cancelled() => {
                        let _ = out.send(Err(Status::unavailable("control plane restarting"))).await;
                        return;
                    }
                    received = inbound.message() => match received {
                        Ok(Some(r)) => { let _ = requests.send(r); }
                        _ => return,
                    },
                    changed = set.changed() => {
                        if changed.is_err() { return; }
                        let current = set.borrow_and_update().clone();
                        if let Some(mut response) = current {
                            response.nonce = format!("n{}", nonces.fetch_add(1, Ordering::SeqCst));
                            if out.send(Ok(response)).await.is_err() { return; }
                        }
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// How a control plane is away.
#[derive(Debug, Clone, Copy)]
enum Away {
    /// Its port refuses connections (the process is gone).
    Refusing,
    /// Its port accepts connections that nothing ever answers (the process hangs).
    Silent,
}

/// The control plane's socket between incarnations.
enum Held {
    /// Listening: served, or (while `Silent`) connections wait in its backlog.
    Listening(std::net::TcpListener),
    /// Bound with SO_REUSEPORT but not listening: connections are refused, and no other
    /// process can take the port before the control plane listens on it again.
    Reserved(tokio::net::TcpSocket),
}

/// A control plane on a port of its own for the whole test: stopping it ends every
/// stream and stops serving, and it comes back at the same address.
struct ControlPlane {
    addr: SocketAddr,
    held: Option<Held>,
    set: watch::Sender<Option<DiscoveryResponse>>,
    requests: mpsc::UnboundedReceiver<DiscoveryRequest>,
    requests_tx: mpsc::UnboundedSender<DiscoveryRequest>,
    nonces: Arc<AtomicU64>,
    running: Option<(CancellationToken, tokio::task::JoinHandle<()>)>,
}

/// A socket that may share its port with the control plane's other sockets.
fn reusable() -> tokio::net::TcpSocket {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_reuseaddr(true).unwrap();
    socket.set_reuseport(true).unwrap();
    socket
}

impl ControlPlane {
    fn start() -> Self {
        let socket = reusable();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let (requests_tx, requests) = mpsc::unbounded_channel();
        let mut cp = ControlPlane {
            addr: socket.local_addr().unwrap(),
            held: Some(Held::Reserved(socket)),
            set: watch::channel(None).0,
            requests,
            requests_tx,
            nonces: Arc::new(AtomicU64::new(1)),
            running: None,
        };
        cp.serve();
        cp
    }

    /// Serves (again) at the same address.
    fn serve(&mut self) {
        let listener = match self.held.take().expect("a socket") {
            Held::Listening(listener) => listener,
            Held::Reserved(socket) => socket.listen(1024).unwrap().into_std().unwrap(),
        };
        let down = CancellationToken::new();
        let ads = Ads {
            set: self.set.subscribe(),
            requests: self.requests_tx.clone(),
            nonces: self.nonces.clone(),
            down: down.clone(),
        };
        let serving = tokio::net::TcpListener::from_std(listener.try_clone().unwrap()).unwrap();
        self.held = Some(Held::Listening(listener));
        let stop = down.clone();
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(AggregatedDiscoveryServiceServer::new(ads))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(serving),
                    stop.cancelled_owned(),
                )
                .await
                .unwrap();
        });
        self.running = Some((down, task));
    }

    /// Ends every stream with UNAVAILABLE and stops serving; the port then refuses
    /// connections or leaves them unanswered.
    async fn away(&mut self, how: Away) {
        if let Away::Refusing = how {
            let reserve = reusable();
            reserve.bind(self.addr).unwrap();
            // Dropping the listener closes it: the reserve holds the port, not listening.
            self.held = Some(Held::Reserved(reserve));
        }
        self.stop().await;
    }

    /// Ends every stream with UNAVAILABLE and stops serving (the socket stays held).
    async fn stop(&mut self) {
        let (down, task) = self.running.take().expect("running");
        down.cancel();
        tokio::time::timeout(PATIENCE, task)
            .await
            .expect("the server stops")
            .unwrap();
    }

    /// Serves `configs` as version `version` from now on (to every stream).
    fn push(&self, version: &str, configs: &[RateLimitConfig]) {
        self.set.send_replace(Some(DiscoveryResponse {
            version_info: version.into(),
            resources: configs
                .iter()
                .map(|c| prost_types::Any {
                    type_url: RATE_LIMIT_CONFIG_TYPE.into(),
                    value: c.encode_to_vec(),
                })
                .collect(),
            canary: false,
            type_url: RATE_LIMIT_CONFIG_TYPE.into(),
            nonce: String::new(),
        }));
    }

    /// The next request the node sent.
    async fn request(&mut self) -> DiscoveryRequest {
        tokio::time::timeout(PATIENCE, self.requests.recv())
            .await
            .expect("the node sends a request")
            .expect("open")
    }

    /// The node's answer to the response of `version`: skips subscriptions and answers
    /// to earlier versions.
    async fn answer_to(&mut self, version: &str) -> DiscoveryRequest {
        loop {
            let r = self.request().await;
            let answered = if r.error_detail.is_some() {
                // A NACK names the version still held; find the refused one by its nonce.
                !r.response_nonce.is_empty()
            } else {
                r.version_info == version && !r.response_nonce.is_empty()
            };
            if answered {
                return r;
            }
        }
    }
}

/// A domain `domain` limiting each `api` value to `requests` per `unit`.
fn config(name: &str, domain: &str, unit: RateLimitUnit, requests: u32) -> RateLimitConfig {
    RateLimitConfig {
        name: name.into(),
        domain: domain.into(),
        descriptors: vec![RateLimitDescriptor {
            key: "api".into(),
            rate_limit: Some(RateLimitPolicy {
                unit: unit as i32,
                requests_per_unit: requests,
                ..Default::default()
            }),
            ..Default::default()
        }],
    }
}

fn xds_node(cp: &ControlPlane, id: &str) -> NodeConfig {
    NodeConfig {
        node_id: id.into(),
        envoy_xds: Some(cp.addr.to_string()),
        ..NodeConfig::for_test()
    }
}

async fn rls(node: &ringlimit::node::RunningNode) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(format!("http://{}", node.grpc_addr))
        .await
        .unwrap()
}

/// How many of `n` requests for `api = value` in `domain` were OK.
async fn admitted(
    client: &mut RateLimitServiceClient<Channel>,
    domain: &str,
    value: &str,
    n: usize,
) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        let answer = client
            .should_rate_limit(RateLimitRequest {
                domain: domain.into(),
                descriptors: vec![RequestDescriptor {
                    entries: vec![Entry {
                        key: "api".into(),
                        value: value.into(),
                    }],
                    ..Default::default()
                }],
                hits_addend: 0,
            })
            .await
            .unwrap()
            .into_inner();
        ok += usize::from(answer.overall_code == Code::Ok as i32);
    }
    ok
}

#[tokio::test]
async fn a_set_is_acked_and_enforced_and_a_bad_one_is_nacked_with_its_reason_and_changes_nothing() {
    let mut cp = ControlPlane::start();
    cp.push(
        "1",
        &[config("web-config", "web", RateLimitUnit::Minute, 3)],
    );
    let (node, _clock) = common::start_manual(xds_node(&cp, "xds-a"), T0).await;

    let subscribe = cp.request().await;
    assert_eq!(subscribe.type_url, RATE_LIMIT_CONFIG_TYPE);
    assert_eq!(
        (
            subscribe.version_info.as_str(),
            subscribe.response_nonce.as_str()
        ),
        ("", "")
    );
    let who = subscribe.node.as_ref().expect("the node says who it is");
    assert_eq!(
        (who.id.as_str(), who.cluster.as_str()),
        ("xds-a", "ringlimit")
    );
    assert!(subscribe.resource_names.is_empty(), "every RateLimitConfig");

    let ack = cp.answer_to("1").await;
    assert!(ack.error_detail.is_none(), "{:?}", ack.error_detail);
    assert!(ack.response_nonce.starts_with('n'));
    // ACKed after the swap: the set is already enforced.
    let mut client = rls(&node).await;
    assert_eq!(admitted(&mut client, "web", "a", 5).await, 3);

    // A bad set (MONTH: windows are at most 7 days) beside a good one: refused whole.
    cp.push(
        "2",
        &[
            config("web-config", "web", RateLimitUnit::Minute, 10),
            config("billing-config", "billing", RateLimitUnit::Month, 1),
        ],
    );
    let nack = cp.answer_to("2").await;
    let detail = nack.error_detail.expect("a NACK says why");
    assert_eq!(nack.version_info, "1", "the version still held");
    assert_eq!(detail.code, 3, "INVALID_ARGUMENT");
    assert!(
        detail.message.contains("version \"2\"")
            && detail
                .message
                .contains("resources[1] (name \"billing-config\")")
            && detail.message.contains("descriptors[0].rate_limit.unit")
            && detail.message.contains("at most 7 days"),
        "{}",
        detail.message
    );
    assert_eq!(
        admitted(&mut client, "web", "b", 5).await,
        3,
        "still version 1"
    );
    assert_eq!(
        admitted(&mut client, "billing", "b", 2).await,
        2,
        "no billing domain"
    );

    // The next good set replaces the whole set (state of the world).
    cp.push(
        "3",
        &[config("billing-config", "billing", RateLimitUnit::Hour, 1)],
    );
    let ack = cp.answer_to("3").await;
    assert!(ack.error_detail.is_none());
    assert_eq!(admitted(&mut client, "billing", "c", 3).await, 1);
    assert_eq!(admitted(&mut client, "web", "c", 5).await, 5, "web is gone");
    node.shutdown().await;
}

/// The control plane goes `how` away and comes back with a new set.
async fn away_and_back(how: Away, id: &str) {
    let mut cp = ControlPlane::start();
    cp.push(
        "1",
        &[config("web-config", "web", RateLimitUnit::Minute, 3)],
    );
    let (node, _clock) = common::start_manual(xds_node(&cp, id), T0).await;
    cp.answer_to("1").await;
    let mut client = rls(&node).await;
    assert_eq!(admitted(&mut client, "web", "a", 5).await, 3);

    // Away: every stream ends; the node retries (with a 20-200 ms backoff in tests) and
    // meanwhile enforces what it had.
    // (The counter is shared by every node of this test process, so it can only tell
    // that at least this many happened.)
    let failures = || common::metric_sum("ringlimit_envoy_xds_stream_failures_total");
    let before = failures();
    cp.away(how).await;
    let knock = std::net::TcpStream::connect(cp.addr);
    match how {
        Away::Refusing => assert_eq!(
            knock.unwrap_err().kind(),
            std::io::ErrorKind::ConnectionRefused
        ),
        Away::Silent => drop(knock.expect("the backlog takes it")),
    }
    assert_eq!(
        admitted(&mut client, "web", "b", 5).await,
        3,
        "still enforced"
    );
    assert!(
        common::eventually(PATIENCE, || failures() >= before + 2.0).await,
        "the stream's end and a failed attempt are counted"
    );
    assert_eq!(
        admitted(&mut client, "web", "c", 5).await,
        3,
        "still enforced"
    );

    // Back, with a new set: the node subscribes naming the version it holds.
    cp.push(
        "2",
        &[config("web-config", "web", RateLimitUnit::Minute, 4)],
    );
    cp.serve();
    let resubscribe = loop {
        let r = cp.request().await;
        if r.response_nonce.is_empty() {
            break r;
        }
    };
    assert_eq!(resubscribe.version_info, "1");
    let ack = cp.answer_to("2").await;
    assert!(ack.error_detail.is_none());
    assert_eq!(admitted(&mut client, "web", "d", 6).await, 4);
    node.shutdown().await;
}

#[tokio::test]
async fn a_control_plane_gone_leaves_the_last_good_set_in_force_and_is_resubscribed_with_it() {
    away_and_back(Away::Refusing, "xds-refused").await;
}

#[tokio::test]
async fn a_control_plane_hung_leaves_the_last_good_set_in_force_and_is_resubscribed_with_it() {
    away_and_back(Away::Silent, "xds-silent").await;
}

#[tokio::test]
async fn a_domain_over_xds_and_the_same_domain_in_yaml_have_one_digest_and_no_drift() {
    let mut cp = ControlPlane::start();
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("web.yaml");
    std::fs::write(
        &yaml,
        "domain: web\ndescriptors:\n  - key: api\n    rate_limit:\n      unit: minute\n      requests_per_unit: 3\n",
    )
    .unwrap();
    let file_node = common::start(NodeConfig {
        envoy_path: Some(yaml),
        ..common::member_config("yaml-node", &[], None)
    })
    .await;
    let xds = common::start(NodeConfig {
        envoy_xds: Some(cp.addr.to_string()),
        ..common::member_config("xds-node", &[file_node.gossip_addr.to_string()], None)
    })
    .await;
    let nodes = [file_node, xds];
    common::wait_converged(&nodes, 2).await;
    let digest = |n: &ringlimit::node::RunningNode| n.cluster_rules.envoy_advert().encode();

    // Before any set the xDS node serves no domain: a drift, reported.
    assert!(
        common::eventually(PATIENCE, || !nodes[1]
            .cluster_rules
            .envoy_drift()
            .is_empty())
        .await,
        "drift before the first set"
    );
    cp.push(
        "1",
        &[config("web-config", "web", RateLimitUnit::Minute, 3)],
    );
    cp.answer_to("1").await;
    let yaml_digest = digest(&nodes[0]).rsplit(' ').next().unwrap().to_string();
    assert!(
        digest(&nodes[1]).ends_with(&yaml_digest),
        "{} vs {yaml_digest}",
        digest(&nodes[1])
    );
    assert!(
        common::eventually(PATIENCE, || nodes
            .iter()
            .all(|n| n.cluster_rules.envoy_drift().is_empty()))
        .await,
        "the same domains: no drift"
    );
    // Another set: a drift again.
    cp.push(
        "2",
        &[config("web-config", "web", RateLimitUnit::Minute, 4)],
    );
    cp.answer_to("2").await;
    assert!(
        common::eventually(PATIENCE, || !nodes[0]
            .cluster_rules
            .envoy_drift()
            .is_empty())
        .await,
        "the YAML node sees the xDS node differ"
    );
    for node in nodes {
        node.shutdown().await;
    }
}

#[test]
fn envoy_xds_and_envoy_config_are_one_or_the_other() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ringlimit"))
        .args([
            "serve",
            "--envoy-config",
            "limits.yaml",
            "--envoy-xds",
            "127.0.0.1:18000",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "a usage error");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--envoy-xds <ADDR>") && stderr.contains("cannot be used with"),
        "{stderr}"
    );
    let both = NodeConfig {
        envoy_path: Some("limits.yaml".into()),
        envoy_xds: Some("127.0.0.1:18000".into()),
        ..NodeConfig::for_test()
    };
    assert!(both.validate().unwrap_err().contains("not both"));
    let tls = NodeConfig {
        envoy_xds: Some("https://cp.example:18000".into()),
        ..NodeConfig::for_test()
    };
    assert!(tls.validate().unwrap_err().contains("plaintext"));
}

#[tokio::test]
async fn the_rules_api_does_not_change_the_envoy_domains_of_an_xds_node() {
    const TOKEN: &str = "xds-test-admin-token-0123456789";
    let cp = ControlPlane::start();
    let node = common::start(NodeConfig {
        admin_token: Some(ringlimit::server::ops::AdminToken::new(TOKEN).unwrap()),
        ..xds_node(&cp, "xds-api")
    })
    .await;
    let put = common::http(
        node.http_addr.expect("ops port"),
        "PUT",
        "/v1/rules/envoy",
        &[
            ("Authorization", &format!("Bearer {TOKEN}")),
            ("If-Match", "\"0\""),
        ],
        r#"{"domains": ["domain: web\ndescriptors:\n  - key: api\n"]}"#,
    )
    .await;
    assert_eq!(put.status, 409, "{}", put.body);
    assert!(put.body.contains("--envoy-xds"), "{}", put.body);
    node.shutdown().await;
}
