//! Attack tests on the gRPC listener (issue 10, point 7): what one client on the
//! gateway network can make a node hold, and what it is answered for bytes that are
//! not a valid request. Each test names the bypass or exhaustion it closes.
//!
//! The stream tests speak raw HTTP/2 frames: a well-behaved client library (h2,
//! tonic) honours the server's SETTINGS by itself, an attacker does not.

mod common;

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use common::{check, client, metric_sum, start};
use prost::Message;
use ringlimit::node::{NodeConfig, MAX_MESSAGE_BYTES};
use ringlimit::proto::CheckRequest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::Code;

/// Upper bound for any wait on an observable state: a failure guard, never a pause.
const GUARD: Duration = Duration::from_secs(30);

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const ACK: u8 = 0x1;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const REFUSED_STREAM: u32 = 0x7;
const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;

fn frame(out: &mut BytesMut, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = u32::try_from(payload.len()).unwrap();
    out.put_slice(&len.to_be_bytes()[1..]);
    out.put_u8(kind);
    out.put_u8(flags);
    out.put_u32(stream);
    out.put_slice(payload);
}

/// An HPACK block of literal fields without indexing (no table state, no Huffman).
fn header_block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in fields {
        block.push(0x00);
        block.push(u8::try_from(name.len()).unwrap());
        block.extend_from_slice(name.as_bytes());
        block.push(u8::try_from(value.len()).unwrap());
        block.extend_from_slice(value.as_bytes());
    }
    block
}

fn grpc_headers(path: &str) -> Vec<u8> {
    header_block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ])
}

/// One frame read back: (type, flags, stream id, payload).
async fn read_frame(
    r: &mut (impl AsyncReadExt + Unpin),
) -> std::io::Result<(u8, u8, u32, Vec<u8>)> {
    let mut head = [0u8; 9];
    r.read_exact(&mut head).await?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    let mut payload = vec![0; len];
    r.read_exact(&mut payload).await?;
    Ok((head[3], head[4], stream, payload))
}

/// Connect and exchange SETTINGS; returns the stream and the server's SETTINGS.
async fn raw_h2(addr: std::net::SocketAddr) -> (TcpStream, Vec<(u16, u32)>) {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let mut out = BytesMut::from(PREFACE);
    frame(&mut out, SETTINGS, 0, 0, &[]);
    tcp.write_all(&out).await.unwrap();
    loop {
        let (kind, flags, _, payload) = read_frame(&mut tcp).await.unwrap();
        if kind == SETTINGS && flags & ACK == 0 {
            let settings = payload
                .chunks(6)
                .map(|c| {
                    (
                        u16::from_be_bytes([c[0], c[1]]),
                        u32::from_be_bytes([c[2], c[3], c[4], c[5]]),
                    )
                })
                .collect();
            let mut ack = BytesMut::new();
            frame(&mut ack, SETTINGS, ACK, 0, &[]);
            tcp.write_all(&ack).await.unwrap();
            return (tcp, settings);
        }
    }
}

/// Tests that measure this process's RSS, or allocate megabytes, run one at a time: a
/// neighbour's growth would be counted as the measuring test's.
static RSS_MEASURED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn vm_rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}

/// Closes: "20,000 bodiless streams on one connection held +172 MB". A client that
/// ignores SETTINGS_MAX_CONCURRENT_STREAMS opens 20,000 streams and never sends a
/// body: the server advertises 256, refuses the streams beyond it (REFUSED_STREAM, and
/// GOAWAY once the refusals pile up), and its memory stays flat.
#[tokio::test]
async fn twenty_thousand_streams_on_one_connection_are_capped() {
    let mut config = NodeConfig::for_test();
    // Accepted streams stay open for the whole test: the count refused is then exact.
    config.grpc.request_timeout = Duration::from_secs(600);
    let _alone = RSS_MEASURED.lock().await;
    let node = start(config).await;
    // Warm up the server path once so the baseline includes it.
    client(&node)
        .await
        .check(check("warm", "/x", None))
        .await
        .unwrap();
    let before = vm_rss_kb();

    let (tcp, settings) = raw_h2(node.grpc_addr).await;
    assert!(
        settings.contains(&(SETTINGS_MAX_CONCURRENT_STREAMS, 256)),
        "server SETTINGS {settings:?} advertise 256 streams"
    );
    let (mut r, mut w) = tcp.into_split();
    let reader = tokio::spawn(async move {
        let (mut refused, mut goaway, mut pinged) = (0u32, None, false);
        while let Ok((kind, flags, _stream, payload)) = read_frame(&mut r).await {
            match kind {
                RST_STREAM if payload[..] == REFUSED_STREAM.to_be_bytes() => refused += 1,
                GOAWAY => goaway = Some(payload),
                PING if flags & ACK != 0 && payload == b"ringlimt" => {
                    pinged = true;
                    break;
                }
                _ => {}
            }
        }
        (refused, goaway, pinged)
    });

    const STREAMS: u32 = 20_000;
    let block = grpc_headers("/ringlimit.v1.RateLimiter/Check");
    let mut buf = BytesMut::new();
    let mut written_all = true;
    for i in 0..STREAMS {
        frame(&mut buf, HEADERS, END_HEADERS, 2 * i + 1, &block);
        if buf.len() > 64 * 1024 || i + 1 == STREAMS {
            if w.write_all(&buf).await.is_err() {
                // The server closed the connection on us: the cap at work.
                written_all = false;
                break;
            }
            buf.clear();
        }
    }
    if written_all {
        // Frames are handled in order: the PING's ACK says every HEADERS was seen.
        let mut ping = BytesMut::new();
        frame(&mut ping, PING, 0, 0, b"ringlimt");
        let _ = w.write_all(&ping).await;
    }
    let (refused, goaway, pinged) = tokio::time::timeout(GUARD, reader)
        .await
        .expect("the server answered or closed")
        .unwrap();
    assert!(
        refused > 0 || goaway.is_some(),
        "streams beyond the cap refused (refused {refused}, goaway {goaway:?})"
    );
    if goaway.is_none() {
        assert!(pinged);
        assert!(
            STREAMS - refused <= 256,
            "{} streams accepted at once",
            STREAMS - refused
        );
    }
    let grown_kb = vm_rss_kb().saturating_sub(before);
    eprintln!(
        "{STREAMS} streams attempted: {refused} refused, goaway {:?}, RSS +{grown_kb} kB",
        goaway.as_deref().map(|g| &g[..8.min(g.len())])
    );
    assert!(
        grown_kb < 50 * 1024,
        "RSS grew {grown_kb} kB for {STREAMS} attempted streams"
    );
    drop(w);

    // The node still answers everyone else.
    let a = client(&node)
        .await
        .check(check("after", "/x", None))
        .await
        .unwrap()
        .into_inner();
    assert!(a.allowed);
    node.shutdown().await;
}

/// One gRPC call over raw h2 with `body` as the whole request body; returns
/// (grpc-status, grpc-message).
async fn call_raw(addr: std::net::SocketAddr, path: &str, body: Bytes) -> (String, String) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut send, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let head = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut out) = send.send_request(head, false).unwrap();
    out.send_data(body, true).unwrap();
    let response = tokio::time::timeout(GUARD, response)
        .await
        .expect("an answer")
        .unwrap();
    let (head, mut body) = response.into_parts();
    let mut headers = head.headers;
    if !headers.contains_key("grpc-status") {
        while let Some(chunk) = body.data().await {
            let _ = chunk;
        }
        headers = body.trailers().await.unwrap().expect("trailers");
    }
    let get = |name: &str| {
        headers
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default()
    };
    (get("grpc-status"), get("grpc-message"))
}

fn framed(payload: &[u8]) -> Bytes {
    let mut b = BytesMut::new();
    b.put_u8(0);
    b.put_u32(u32::try_from(payload.len()).unwrap());
    b.put_slice(payload);
    b.freeze()
}

fn percent_decoded(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
            out.push(u8::from_str_radix(hex, 16).unwrap());
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Closes: "malformed protobuf is answered INTERNAL, which a gateway may treat as
/// limiter down, fail open". Invalid UTF-8 in a string, a truncated field and a wrong
/// wire type are the caller's error: INVALID_ARGUMENT starting with the field's path.
#[tokio::test]
async fn malformed_request_bodies_are_invalid_argument_naming_the_field() {
    let node = start(NodeConfig::for_test()).await;
    let cases: [(&str, &[u8]); 3] = [
        // field 1 (key), length 2, bytes that are not UTF-8
        ("invalid UTF-8", &[0x0a, 0x02, 0xff, 0xfe]),
        // field 1, length 10, only one byte follows
        ("truncated", &[0x0a, 0x0a, b'k']),
        // field 1 sent as a varint although it is a string
        ("wrong wire type", &[0x08, 0x01]),
    ];
    // Each case breaks field 1: a check's key, a batch's first check.
    for (path, field) in [
        ("/ringlimit.v1.RateLimiter/Check", "key"),
        ("/ringlimit.v1.RateLimiter/CheckBatch", "checks[0]"),
    ] {
        for (what, payload) in cases {
            let (status, text) = call_raw(node.grpc_addr, path, framed(payload)).await;
            let text = percent_decoded(&text);
            assert_eq!(
                status, "3",
                "{path} {what}: INVALID_ARGUMENT, got {status} {text}"
            );
            assert!(
                text.starts_with(&format!("{field}: invalid protobuf: ")),
                "{path} {what}: {text}"
            );
        }
    }
    // A service without our codec (health) is mapped the same way by the layer.
    let (status, text) = call_raw(
        node.grpc_addr,
        "/grpc.health.v1.Health/Check",
        framed(&[0x0a, 0x02, 0xff, 0xfe]),
    )
    .await;
    assert_eq!(status, "3", "health: INVALID_ARGUMENT, got {status} {text}");
    assert!(
        percent_decoded(&text).starts_with("invalid protobuf: "),
        "{text}"
    );
    // Nothing was charged: the node still answers a valid request normally.
    let a = client(&node)
        .await
        .check(check("k", "/x", None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(a.remaining, 99);
    node.shutdown().await;
}

/// Closes: "over-size messages get OUT_OF_RANGE instead of RESOURCE_EXHAUSTED". A
/// message over the limit is refused from its length prefix (its body is never
/// buffered) with RESOURCE_EXHAUSTED naming the limit; a real over-size request sent
/// by a stock tonic client gets the same.
#[tokio::test]
async fn over_size_messages_are_resource_exhausted_naming_the_limit() {
    // Its 4 MiB request would show up in a neighbour's RSS measurement.
    let _alone = RSS_MEASURED.lock().await;
    let node = start(NodeConfig::for_test()).await;
    // A length prefix claiming 4 GiB - 1, and no body at all.
    let mut prefix = BytesMut::new();
    prefix.put_u8(0);
    prefix.put_u32(u32::MAX);
    let (status, text) = call_raw(
        node.grpc_addr,
        "/ringlimit.v1.RateLimiter/Check",
        prefix.freeze(),
    )
    .await;
    let text = percent_decoded(&text);
    assert_eq!(status, "8", "RESOURCE_EXHAUSTED, got {status} {text}");
    assert!(text.contains(&MAX_MESSAGE_BYTES.to_string()), "{text}");

    let mut c = client(&node).await;
    let huge = CheckRequest {
        key: "k".repeat(MAX_MESSAGE_BYTES + 1),
        route: "/x".into(),
        ..Default::default()
    };
    assert!(huge.encoded_len() > MAX_MESSAGE_BYTES);
    let status = c.check(huge).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains(&MAX_MESSAGE_BYTES.to_string()),
        "{}",
        status.message()
    );
    node.shutdown().await;
}

/// Wait until the server closes `tcp` (EOF or reset); bytes it sends first are read and
/// dropped.
async fn closed_by_server(tcp: &mut TcpStream) {
    let mut buf = [0u8; 4096];
    tokio::time::timeout(GUARD, async {
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .expect("the server closed the connection");
}

/// Closes: "connections are never capped" (every socket a client opens costs the node
/// a descriptor and a task). With a cap of 2, connection 3 is closed at once and
/// counted; once one of the two goes, a new connection is served again.
#[tokio::test]
async fn the_connection_cap_closes_the_connection_over_it() {
    let mut config = NodeConfig::for_test();
    config.grpc.max_connections = 2;
    let node = start(config).await;
    let refused_before = metric_sum("ringlimit_connections_refused_total");
    let mut first = client(&node).await;
    first.check(check("a", "/x", None)).await.unwrap();
    let mut second = client(&node).await;
    second.check(check("b", "/x", None)).await.unwrap();

    let mut third = TcpStream::connect(node.grpc_addr).await.unwrap();
    closed_by_server(&mut third).await;
    assert!(metric_sum("ringlimit_connections_refused_total") >= refused_before + 1.0);
    // The two admitted connections are untouched.
    first.check(check("a", "/x", None)).await.unwrap();
    second.check(check("b", "/x", None)).await.unwrap();

    // Free a slot: the server sees the close, drops the connection and its slot; a new
    // client is served as soon as that happened (retried until then, bounded).
    drop(first);
    tokio::time::timeout(GUARD, async {
        loop {
            if let Ok(mut c) = ringlimit::proto::rate_limiter_client::RateLimiterClient::connect(
                format!("http://{}", node.grpc_addr),
            )
            .await
            {
                if c.check(check("c", "/x", None)).await.is_ok() {
                    return;
                }
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("a freed slot admits a new connection");
    node.shutdown().await;
}

/// Closes: "half-open connections are never closed". A socket that never sends the
/// HTTP/2 preface is closed after the handshake timeout (it would otherwise hold a
/// connection slot for good).
#[tokio::test]
async fn a_connection_that_never_speaks_http2_is_closed() {
    let mut config = NodeConfig::for_test();
    config.grpc.handshake_timeout = Duration::from_millis(200);
    let node = start(config).await;
    let mut silent = TcpStream::connect(node.grpc_addr).await.unwrap();
    closed_by_server(&mut silent).await;
    // Half a preface is no better.
    let mut partial = TcpStream::connect(node.grpc_addr).await.unwrap();
    partial.write_all(&PREFACE[..10]).await.unwrap();
    closed_by_server(&mut partial).await;
    node.shutdown().await;
}

/// Closes: "idle or half-open connections are never closed" for a peer that completed
/// the handshake and then went silent (crashed, partitioned): HTTP/2 keepalive PINGs
/// go unanswered and the server closes the connection.
#[tokio::test]
async fn a_peer_that_stops_answering_pings_is_disconnected() {
    let mut config = NodeConfig::for_test();
    config.grpc.keepalive_interval = Duration::from_millis(100);
    config.grpc.keepalive_timeout = Duration::from_millis(100);
    let node = start(config).await;
    let (mut tcp, _) = raw_h2(node.grpc_addr).await;
    // Read (and never answer) until the server gives up on us.
    let mut saw_ping = false;
    tokio::time::timeout(GUARD, async {
        while let Ok((kind, flags, _, _)) = read_frame(&mut tcp).await {
            saw_ping |= kind == PING && flags & ACK == 0;
        }
    })
    .await
    .expect("the server closed the silent connection");
    assert!(saw_ping, "the server probed with a PING first");
    node.shutdown().await;
}

/// Closes: "streams whose request never finishes are held forever". A stream that
/// sends its headers and never its body is answered (and freed) after the request
/// timeout.
#[tokio::test]
async fn a_request_that_never_finishes_is_cut_at_the_request_timeout() {
    let mut config = NodeConfig::for_test();
    config.grpc.request_timeout = Duration::from_millis(200);
    let node = start(config).await;
    let (tcp, _) = raw_h2(node.grpc_addr).await;
    let (mut r, mut w) = tcp.into_split();
    let mut out = BytesMut::new();
    frame(
        &mut out,
        HEADERS,
        END_HEADERS,
        1,
        &grpc_headers("/ringlimit.v1.RateLimiter/Check"),
    );
    // Half a message: a length prefix of 100 bytes, 3 of them sent, no END_STREAM.
    frame(&mut out, DATA, 0, 1, &[0, 0, 0, 0, 100, 1, 2, 3]);
    w.write_all(&out).await.unwrap();
    let ended = tokio::time::timeout(GUARD, async {
        while let Ok((kind, flags, stream, _)) = read_frame(&mut r).await {
            let ends = (kind == HEADERS && flags & END_STREAM != 0) || kind == RST_STREAM;
            if stream == 1 && ends {
                return true;
            }
        }
        false
    })
    .await
    .expect("the stream was answered");
    assert!(ended, "stream 1 ended by the server");
    // A graceful shutdown waits for open connections; this one answers no PING.
    drop((r, w));
    node.shutdown().await;
}

/// An HTTP/2 client of `addr` that reads no answer: it advertises a receive window of
/// zero (and does not count resets), its connection driven by a task of its own.
async fn zero_window_client(
    addr: std::net::SocketAddr,
) -> (
    h2::client::SendRequest<Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (send, connection) = h2::client::Builder::new()
        .initial_window_size(0)
        .max_concurrent_reset_streams(0)
        .handshake::<_, Bytes>(tcp)
        .await
        .unwrap();
    (send, tokio::spawn(connection))
}

/// Opens one `CheckBatch` stream on `send` with the framed request `body`.
fn send_batch(
    send: &h2::client::SendRequest<Bytes>,
    addr: std::net::SocketAddr,
    body: &Bytes,
) -> (h2::client::ResponseFuture, h2::SendStream<Bytes>) {
    let head = http::Request::post(format!("http://{addr}/ringlimit.v1.RateLimiter/CheckBatch"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut out) = send.clone().send_request(head, false).unwrap();
    out.send_data(body.clone(), true).unwrap();
    (response, out)
}

/// "600 CheckBatch streams whose responses are never read held +174 MB": a client
/// advertising a zero receive window reads no answer; the node holds at most 256 such
/// answers per connection (the stream cap), and the rest of the client's 600 streams
/// never reach it. Across connections the unsent-answer budget bounds them (next test).
#[tokio::test]
async fn unread_batch_answers_are_held_at_most_for_the_stream_cap() {
    const STREAMS: usize = 600;
    let _alone = RSS_MEASURED.lock().await;
    let node = start(NodeConfig::for_test()).await;
    client(&node)
        .await
        .check(check("warm", "/x", None))
        .await
        .unwrap();
    let before = vm_rss_kb();
    let (send, conn) = zero_window_client(node.grpc_addr).await;
    let batch = ringlimit::proto::CheckBatchRequest {
        checks: (0..1000)
            .map(|i| check(&format!("unread-{i}"), "/x", None))
            .collect(),
    };
    let body = framed(&batch.encode_to_vec());
    let mut responses = Vec::new();
    let mut streams = Vec::new();
    for _ in 0..STREAMS {
        let (response, out) = send_batch(&send, node.grpc_addr, &body);
        responses.push(response);
        streams.push(out);
    }
    // The first 256 are answered (headers are not flow-controlled); their bodies wait.
    let mut answered = Vec::new();
    for response in responses.drain(..256) {
        let response = tokio::time::timeout(GUARD, response)
            .await
            .expect("an answer's headers")
            .unwrap();
        answered.push(response);
    }
    let grown_kb = vm_rss_kb().saturating_sub(before);
    eprintln!("{STREAMS} unread CheckBatch streams: RSS +{grown_kb} kB");
    assert!(
        grown_kb < 200 * 1024,
        "RSS grew {grown_kb} kB for {STREAMS} unread CheckBatch answers"
    );
    drop((answered, responses, streams, send));
    conn.abort();
    node.shutdown().await;
}

/// Closes "600 CheckBatch streams whose responses are never read held +174 MB" for good:
/// answers decided but not yet read count against one node-wide budget of items
/// (`--max-unsent-answer-items`). A client that never reads spends it and then gets
/// `RESOURCE_EXHAUSTED` (reason `overloaded`) at once, before anything is decided, so
/// nothing more is held or charged; once it goes away the budget is whole again.
#[tokio::test]
async fn unread_batch_answers_spend_a_node_wide_budget_and_then_are_refused_uncharged() {
    const STREAMS: usize = 40;
    const ITEMS: usize = 1000;
    const BUDGET: u32 = 10_000;
    // Not while another test measures this process' RSS.
    let _alone = RSS_MEASURED.lock().await;
    let mut config = NodeConfig::for_test();
    config.grpc.max_unsent_answer_items = BUDGET;
    let (node, _clock) = common::start_manual(config, 1_767_225_600_000).await;
    let (send, conn) = zero_window_client(node.grpc_addr).await;
    let batch = ringlimit::proto::CheckBatchRequest {
        checks: (0..ITEMS)
            .map(|i| check(&format!("unread-{i}"), "/x", None))
            .collect(),
    };
    let body = framed(&batch.encode_to_vec());
    let mut streams = Vec::new();
    let mut answered = Vec::new();
    for _ in 0..STREAMS {
        let (response, out) = send_batch(&send, node.grpc_addr, &body);
        streams.push(out);
        // One at a time, so which calls fit the budget is not a race.
        let response = tokio::time::timeout(GUARD, response)
            .await
            .expect("an answer's headers")
            .unwrap();
        answered.push(response);
    }
    // Ten answers fit the budget (headers 200, bodies waiting on the zero window); the
    // other thirty were refused with a trailers-only RESOURCE_EXHAUSTED.
    let status = |r: &http::Response<h2::RecvStream>| {
        r.headers()
            .get("grpc-status")
            .map(|v| v.to_str().unwrap().to_string())
    };
    let held = answered.iter().filter(|r| status(r).is_none()).count();
    let refused: Vec<_> = answered
        .iter()
        .filter(|r| status(r).as_deref() == Some("8"))
        .collect();
    assert_eq!((held, refused.len()), (10, STREAMS - 10));
    assert_eq!(
        refused[0].headers().get("ringlimit-reason").unwrap(),
        "overloaded"
    );
    // Another client's batch is refused too while the budget is spent; a unary check is not.
    let mut c = client(&node).await;
    let small = ringlimit::proto::CheckBatchRequest {
        checks: vec![check("unread-0", "/x", None)],
    };
    let refused = c.check_batch(small.clone()).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    let a = c
        .check(check("unread-1", "/x", None))
        .await
        .unwrap()
        .into_inner();
    // Charged by the ten held batches only (and this check): 100 - 10 - 1.
    assert_eq!(a.remaining, 89, "refused batches charged nothing");
    // The reader goes away: its answers are dropped and the budget is whole again.
    drop((answered, streams, send));
    conn.abort();
    let deadline = tokio::time::Instant::now() + GUARD;
    loop {
        match c.check_batch(small.clone()).await {
            Ok(answer) => {
                // unread-0: ten held batches and this one.
                assert_eq!(answer.into_inner().results[0].remaining, 89);
                break;
            }
            Err(status) if status.code() == Code::ResourceExhausted => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "budget never came back"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    }
    node.shutdown().await;
}

/// A client that holds a stream open with an answer it never reads (a zero receive
/// window) does not hold the node's stop: its servers wait for open connections at most
/// `shutdown_grace`, then stop without them. Before, tonic waited for every connection,
/// so such a client held the stop until its connection's maximum age (30 min).
#[tokio::test]
async fn a_client_that_never_reads_its_answer_does_not_hold_the_node_s_stop() {
    let mut config = NodeConfig::for_test();
    config.grpc.shutdown_grace = Duration::from_millis(300);
    let node = start(config).await;
    let (send, conn) = zero_window_client(node.grpc_addr).await;
    let batch = ringlimit::proto::CheckBatchRequest {
        checks: (0..100)
            .map(|i| check(&format!("held-{i}"), "/x", None))
            .collect(),
    };
    let (response, _out) = send_batch(&send, node.grpc_addr, &framed(&batch.encode_to_vec()));
    let _headers = tokio::time::timeout(GUARD, response)
        .await
        .expect("the answer's headers")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), node.shutdown())
        .await
        .expect("the node stops within its shutdown grace");
    conn.abort();
}
