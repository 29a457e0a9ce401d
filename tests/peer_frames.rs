//! The framed peer transport from the outside: a member's batches are decided and
//! answered on a framed connection, and everything else that reaches the peer port
//! with the frames magic (no proof, another key's proof, a replayed proof, a bad magic,
//! an oversized hello or frame, a malformed frame, a silent or slow sender) is closed
//! with a clear answer where one is due, and charges nothing.

mod common;

use std::time::Duration;

use bytes::BytesMut;
use common::start;
use ringlimit::cluster::link::frames::{self, FrameReader, FRAMES_PATH, MAGIC, MAX_HELLO};
use ringlimit::cluster::link::item::ForwardItem;
use ringlimit::keyring::Keyring;
use ringlimit::node::config::TEST_CLUSTER_SECRET;
use ringlimit::node::{NodeConfig, RunningNode};
use ringlimit::proto::peer::{ForwardAnswer, ForwardCall, ForwardRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Far beyond any bound a test waits for: a connection not closed by then never is.
const PATIENCE: Duration = Duration::from_secs(20);

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A proof of `secret` for a framed connection.
fn proof(secret: &str, nonce: u64) -> String {
    Keyring::from_text(secret)
        .unwrap()
        .sign_call(FRAMES_PATH, "member", now_ms(), nonce)
}

/// The magic and a hello carrying `proof`.
fn hello(proof: &str) -> BytesMut {
    let mut out = BytesMut::new();
    out.extend_from_slice(MAGIC);
    frames::put_raw_frame(proof.as_bytes(), &mut out);
    out
}

/// One call deciding `cost` units of `key` (a check of the built-in default rule).
fn call(number: u64, key: &str, cost: u64) -> BytesMut {
    let item = ForwardItem {
        key: key.into(),
        route: "GET /x".into(),
        cost,
        hops: 1,
        ..ForwardItem::default()
    };
    let call = ForwardCall {
        call: number,
        request: Some(ForwardRequest {
            from_node: String::new(),
            items: vec![item],
            deadline_ms: now_ms() + 60_000,
            compact: false,
        }),
    };
    let mut out = BytesMut::new();
    frames::put_frame(&call, &mut out);
    out
}

/// The next frame from `stream` as an answer; `None` once the node closed it.
async fn answer(stream: &mut TcpStream, buf: &mut BytesMut) -> Option<ForwardAnswer> {
    let reader = FrameReader::new(1 << 20);
    let read = async {
        loop {
            if let Some(frame) = reader.next(buf).expect("frames from the node") {
                return Some(frames::decode::<ForwardAnswer>(frame).expect("an answer"));
            }
            match stream.read_buf(buf).await {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(PATIENCE, read)
        .await
        .expect("the node answers or closes in time")
}

/// Whether the node closes `stream` (reads end) without sending another byte.
async fn closed_silently(stream: &mut TcpStream) -> bool {
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(PATIENCE, stream.read(&mut byte)).await;
    matches!(read.expect("closed in time"), Ok(0) | Err(_))
}

/// How many framed connections the node's process closed for `reason`
/// (`ringlimit_peer_frames_closed_total`; the recorder is process-wide, so other tests'
/// connections count too: compare before and after).
async fn closed_for(node: &RunningNode, reason: &str) -> u64 {
    let mut stream = TcpStream::connect(node.http_addr.expect("an ops port"))
        .await
        .unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).await.unwrap();
    let label = format!("reason=\"{reason}\"");
    body.lines()
        .filter(|l| l.starts_with("ringlimit_peer_frames_closed_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Wait until `reason`'s count is past `before` (the node counts a connection once it
/// has let go of it, just after the sender saw it closed); whether it got there.
async fn counted_past(node: &RunningNode, reason: &str, before: u64) -> bool {
    let until = std::time::Instant::now() + PATIENCE;
    while std::time::Instant::now() < until {
        if closed_for(node, reason).await > before {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// A framed connection to `node`, opened with `hello`.
async fn open(node: &RunningNode, hello: &[u8]) -> (TcpStream, BytesMut) {
    let mut stream = TcpStream::connect(node.peer_addr).await.unwrap();
    stream.write_all(hello).await.unwrap();
    (stream, BytesMut::new())
}

/// A member's connection, welcomed.
async fn member(node: &RunningNode, nonce: u64) -> (TcpStream, BytesMut) {
    let (mut stream, mut buf) = open(node, &hello(&proof(TEST_CLUSTER_SECRET, nonce))).await;
    let welcome = answer(&mut stream, &mut buf).await.expect("a welcome");
    assert_eq!((welcome.call, welcome.code), (0, 0), "{welcome:?}");
    (stream, buf)
}

/// What `key` has left, spending one unit as a member: how much earlier attempts
/// charged shows as a `remaining` below `limit - 1`.
async fn spend_one(node: &RunningNode, key: &str, nonce: u64) -> (u64, u64) {
    let (mut stream, mut buf) = member(node, nonce).await;
    stream.write_all(&call(9, key, 1)).await.unwrap();
    let answered = answer(&mut stream, &mut buf).await.expect("an answer");
    assert_eq!((answered.call, answered.code), (9, 0), "{answered:?}");
    let outcome = &answered.response.expect("a response").outcomes[0];
    (outcome.limit, outcome.remaining)
}

#[tokio::test]
async fn a_members_batches_are_decided_and_answered_on_a_framed_connection() {
    let node = start(NodeConfig::for_test()).await;
    let (mut stream, mut buf) = member(&node, 1).await;
    // Two calls in one write: both answered, each quoting its number.
    let mut both = call(1, "framed", 2);
    both.extend_from_slice(&call(2, "framed", 3));
    stream.write_all(&both).await.unwrap();
    let mut remaining = Vec::new();
    for _ in 0..2 {
        let a = answer(&mut stream, &mut buf).await.expect("an answer");
        assert_eq!(a.code, 0, "{a:?}");
        let response = a.response.unwrap();
        assert_eq!(response.node_id, node.decider.node_id.to_string());
        remaining.push((a.call, response.outcomes[0].remaining));
    }
    remaining.sort_unstable();
    let (limit, _) = spend_one(&node, "other", 2).await;
    // Decided in order on one shard: 2 then 3 units.
    assert_eq!(remaining, vec![(1, limit - 2), (2, limit - 5)]);
    // The sender ends writing: the node answers what it holds and closes.
    stream.shutdown().await.unwrap();
    assert!(answer(&mut stream, &mut buf).await.is_none());
    node.shutdown().await;
}

#[tokio::test]
async fn a_framed_connection_without_the_cluster_key_is_refused_and_charges_nothing() {
    let node = start(NodeConfig::for_test()).await;
    let other = "another-cluster-secret-of-enough-length-000";
    let captured = proof(TEST_CLUSTER_SECRET, 7);
    // The replayed proof is used once by its member first.
    let (mut first, mut buf) = open(&node, &hello(&captured)).await;
    let welcome = answer(&mut first, &mut buf).await.expect("a welcome");
    assert_eq!(welcome.code, 0, "the first use passes");
    drop(first);
    let misused = Keyring::from_text(TEST_CLUSTER_SECRET).unwrap().sign_call(
        "/ringlimit.peer.v1.Peer/Status",
        "member",
        now_ms(),
        8,
    );
    for (why, proof) in [
        ("no proof", String::new()),
        ("another key", proof(other, 1)),
        ("a replayed proof", captured),
        ("a proof for another call", misused),
    ] {
        let (mut stream, mut buf) = open(&node, &hello(&proof)).await;
        // Calls sent right behind the hello are never decided.
        stream.write_all(&call(1, "victim", 50)).await.unwrap();
        let refusal = answer(&mut stream, &mut buf).await.expect("a refusal");
        assert_eq!(
            refusal.code,
            tonic::Code::Unauthenticated as u32,
            "{why}: {refusal:?}"
        );
        assert!(!refusal.message.is_empty(), "{why}: says why");
        assert!(
            answer(&mut stream, &mut buf).await.is_none(),
            "{why}: closed"
        );
    }
    let (limit, remaining) = spend_one(&node, "victim", 2).await;
    assert_eq!(remaining, limit - 1, "nothing was charged");
    node.shutdown().await;
}

#[tokio::test]
async fn oversized_and_malformed_frames_close_the_connection_and_charge_nothing() {
    let node = start(NodeConfig::for_test()).await;

    // A huge length prefix after the welcome: closed, nothing buffered or decided.
    let too_large = closed_for(&node, "too_large").await;
    let (mut stream, _) = member(&node, 1).await;
    stream.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
    assert!(closed_silently(&mut stream).await);
    assert!(counted_past(&node, "too_large", too_large).await, "counted");

    // A frame that is not a call, then a real one behind it: neither is decided, and
    // the close is counted (not only logged at debug).
    let malformed = closed_for(&node, "malformed").await;
    let (mut stream, _) = member(&node, 2).await;
    let mut garbage = BytesMut::new();
    frames::put_raw_frame(&[0xff; 64], &mut garbage);
    garbage.extend_from_slice(&call(1, "victim", 50));
    stream.write_all(&garbage).await.unwrap();
    assert!(closed_silently(&mut stream).await);
    assert!(counted_past(&node, "malformed", malformed).await, "counted");

    // A hello larger than any proof.
    let too_large = closed_for(&node, "too_large").await;
    let mut big = BytesMut::new();
    big.extend_from_slice(MAGIC);
    frames::put_raw_frame(&vec![b'a'; MAX_HELLO + 1], &mut big);
    let (mut stream, _) = open(&node, &big).await;
    assert!(closed_silently(&mut stream).await);
    assert!(counted_past(&node, "too_large", too_large).await, "counted");

    // The magic's first byte, then something else: not ours, closed unanswered.
    let bad_magic = closed_for(&node, "bad_magic").await;
    let (mut stream, _) = open(&node, b"RLxx/1\r\n").await;
    assert!(closed_silently(&mut stream).await);
    assert!(counted_past(&node, "bad_magic", bad_magic).await, "counted");

    let (limit, remaining) = spend_one(&node, "victim", 3).await;
    assert_eq!(remaining, limit - 1, "nothing was charged");
    node.shutdown().await;
}

#[tokio::test]
async fn silent_and_slow_senders_are_cut_off() {
    let mut config = NodeConfig::for_test();
    config.grpc.handshake_timeout = Duration::from_millis(300);
    config.grpc.keepalive_interval = Duration::from_millis(200);
    config.grpc.keepalive_timeout = Duration::from_millis(100);
    let node = start(config).await;

    // Connects and sends nothing.
    let mut silent = TcpStream::connect(node.peer_addr).await.unwrap();
    assert!(closed_silently(&mut silent).await);
    // Half of the magic, then nothing.
    let (mut half, _) = open(&node, &MAGIC[..4]).await;
    assert!(closed_silently(&mut half).await);
    // The magic and half of a hello.
    let partial = hello(&proof(TEST_CLUSTER_SECRET, 1));
    let (mut slow, _) = open(&node, &partial[..partial.len() - 3]).await;
    assert!(closed_silently(&mut slow).await);
    // A member that starts a frame and never finishes it: cut at the idle bound.
    let (mut stream, mut buf) = member(&node, 2).await;
    let started = call(1, "victim", 50);
    stream
        .write_all(&started[..started.len() - 1])
        .await
        .unwrap();
    assert!(answer(&mut stream, &mut buf).await.is_none(), "closed");

    // The node still serves members, and the unfinished call charged nothing.
    let (limit, remaining) = spend_one(&node, "victim", 3).await;
    assert_eq!(remaining, limit - 1);
    node.shutdown().await;
}

#[tokio::test]
async fn http2_peer_calls_still_work_beside_frames_on_the_same_port() {
    use ringlimit::proto::peer::peer_client::PeerClient;
    use ringlimit::proto::peer::StatusRequest;
    let node = start(NodeConfig::for_test()).await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", node.peer_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut peer = PeerClient::new(ringlimit::cluster::link::Signed::new(
        channel,
        Some(Keyring::from_text(TEST_CLUSTER_SECRET).unwrap()),
        "member".into(),
    ));
    let status = peer.status(StatusRequest {}).await.unwrap().into_inner();
    assert_eq!(status.node_id, node.decider.node_id.to_string());
    let (_stream, _buf) = member(&node, 1).await;
    node.shutdown().await;
}

#[tokio::test]
async fn a_node_with_peer_tls_serves_no_frames_so_mutual_tls_cannot_be_bypassed() {
    let ca = common::tls::Ca::new();
    let mut config = NodeConfig::for_test();
    config.peer_tls = Some(ca.member());
    let node = start(config).await;
    // The cluster key's proof, in the clear: the TLS listener takes it for a bad TLS
    // record and closes the connection, with no welcome and nothing decided.
    let (mut stream, _) = open(&node, &hello(&proof(TEST_CLUSTER_SECRET, 1))).await;
    stream.write_all(&call(1, "victim", 50)).await.unwrap();
    let mut seen = Vec::new();
    let read = tokio::time::timeout(PATIENCE, stream.read_to_end(&mut seen)).await;
    assert!(read.is_ok(), "closed in time");
    let welcome_prefix = {
        let mut w = BytesMut::new();
        frames::put_frame(&ForwardAnswer::default(), &mut w);
        w
    };
    assert!(
        !seen.starts_with(&welcome_prefix),
        "no welcome over plain TCP: {seen:?}"
    );
    node.shutdown().await;
}

#[tokio::test]
async fn without_a_cluster_key_an_unsigned_framed_connection_outlives_the_preface_deadline() {
    let mut config = NodeConfig::for_test();
    config.cluster_key = None;
    config.grpc.handshake_timeout = Duration::from_millis(200);
    let node = start(config).await;
    // An empty hello: fewer bytes than an HTTP/2 preface, which must not matter.
    let (mut stream, mut buf) = open(&node, &hello("")).await;
    let welcome = answer(&mut stream, &mut buf).await.expect("a welcome");
    assert_eq!(welcome.code, 0, "{welcome:?}");
    // Quiet for longer than the handshake allows, then a call: still served.
    tokio::time::sleep(Duration::from_millis(600)).await;
    stream.write_all(&call(1, "quiet", 1)).await.unwrap();
    let answered = answer(&mut stream, &mut buf).await.expect("an answer");
    assert_eq!((answered.call, answered.code), (1, 0), "{answered:?}");
    node.shutdown().await;
}
