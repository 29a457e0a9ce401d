//! The RESP face (`--resp-listen`) on real nodes: redis-cell's `CL.THROTTLE` numbers on
//! a manual clock, the exact count of a three-node cluster entered through two nodes,
//! and what an attacker on the client network would try: malformed RESP, huge
//! lengths, a 10,000-command pipeline, a slow sender, unknown commands, non-UTF-8 keys,
//! commands before AUTH, more connections than the cap. Each answer is a RESP error,
//! nothing is charged, and the connection stays bounded. redis-cli, where installed,
//! speaks to a node too.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use ringlimit::node::resp_listener::RespConfig;
use ringlimit::node::{NodeConfig, RunningNode};
use ringlimit::server::resp::RespToken;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A reply as a test reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Reply {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Vec<Reply>),
}

impl Reply {
    fn ints(&self) -> Vec<i64> {
        match self {
            Reply::Array(items) => items
                .iter()
                .map(|i| match i {
                    Reply::Int(n) => *n,
                    other => panic!("not an integer: {other:?}"),
                })
                .collect(),
            other => panic!("not an array: {other:?}"),
        }
    }

    fn error(&self) -> &str {
        match self {
            Reply::Error(e) => e,
            other => panic!("not an error: {other:?}"),
        }
    }
}

/// A bare RESP client over one connection.
struct Client {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Client {
    async fn connect(addr: SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).await.expect("RESP port connects");
        stream.set_nodelay(true).unwrap();
        Client {
            stream,
            buf: Vec::new(),
        }
    }

    async fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }

    async fn send(&mut self, args: &[&[u8]]) {
        self.send_raw(&encode(args)).await;
    }

    async fn call(&mut self, args: &[&str]) -> Reply {
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        self.send(&args).await;
        self.reply().await.expect("a reply")
    }

    /// The next reply; `None` when the server closed the connection first.
    async fn reply(&mut self) -> Option<Reply> {
        loop {
            if let Some((reply, used)) = parse(&self.buf) {
                self.buf.drain(..used);
                return Some(reply);
            }
            let mut chunk = [0u8; 65536];
            let n = tokio::time::timeout(Duration::from_secs(10), self.stream.read(&mut chunk))
                .await
                .expect("a reply within 10 s")
                .unwrap_or(0);
            if n == 0 {
                return None;
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Whether the server has closed the connection (within 5 s), replies aside.
    async fn closed(&mut self) -> bool {
        let mut chunk = [0u8; 4096];
        loop {
            match tokio::time::timeout(Duration::from_secs(5), self.stream.read(&mut chunk)).await {
                Err(_) => return false,
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => {}
            }
        }
    }
}

fn encode(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// One reply from the front of `buf` and the bytes it took.
fn parse(buf: &[u8]) -> Option<(Reply, usize)> {
    let end = buf.windows(2).position(|w| w == b"\r\n")?;
    let line = std::str::from_utf8(&buf[1..end]).expect("header is text");
    let next = end + 2;
    match buf.first()? {
        b'+' => Some((Reply::Simple(line.into()), next)),
        b'-' => Some((Reply::Error(line.into()), next)),
        b':' => Some((Reply::Int(line.parse().unwrap()), next)),
        b'$' => {
            let len: i64 = line.parse().unwrap();
            if len < 0 {
                return Some((Reply::Bulk(None), next));
            }
            let len = len as usize;
            (buf.len() >= next + len + 2).then(|| {
                (
                    Reply::Bulk(Some(buf[next..next + len].to_vec())),
                    next + len + 2,
                )
            })
        }
        b'*' => {
            let len: usize = line.parse().unwrap();
            let mut items = Vec::with_capacity(len);
            let mut at = next;
            for _ in 0..len {
                let (item, used) = parse(&buf[at..])?;
                items.push(item);
                at += used;
            }
            Some((Reply::Array(items), at))
        }
        other => panic!("unexpected reply type {:?}", *other as char),
    }
}

fn resp_config(id: &str, seeds: &[String]) -> NodeConfig {
    NodeConfig {
        resp: Some(RespConfig::on("127.0.0.1:0".parse().unwrap())),
        ..common::member_config(id, seeds, None)
    }
}

fn resp_addr(node: &RunningNode) -> SocketAddr {
    node.resp_addr.expect("the RESP face is served")
}

/// A `CL.THROTTLE` key the ring over `members` gives to `owner` (the ring places its
/// counter key, `len:key`).
fn key_owned_by(owner: &str, members: &[&str]) -> String {
    let ring = ringlimit::ring::Ring::new(
        members.iter().copied(),
        ringlimit::ring::Ring::DEFAULT_VNODES,
    );
    (0..)
        .map(|i| format!("resp-exact-{i}"))
        .find(|k| ring.owner(format!("{}:{k}", k.len()).as_bytes()) == Some(owner))
        .expect("some key lands on every member")
}

/// Limit 60 (max_burst 59), one more unit per week: nothing refills during a test.
const WEEK: &str = "604800";

/// What a peek (quantity 0) says is left of `key` under limit 60 per week.
async fn left(c: &mut Client, key: &str) -> i64 {
    c.call(&["CL.THROTTLE", key, "59", "1", WEEK, "0"])
        .await
        .ints()[2]
}

#[tokio::test]
async fn the_face_is_off_by_default() {
    let node = common::start(NodeConfig::for_test()).await;
    assert!(node.resp_addr.is_none());
}

/// redis-cell's own worked example (its `it_rate_limits` table: limit 5, one per
/// second), over the wire on a manual clock: the same five integers at each step.
#[tokio::test]
async fn cl_throttle_answers_redis_cells_numbers() {
    let t0 = 1_700_000_000_000;
    let (node, clock) = common::start_manual(resp_config("solo", &[]), t0).await;
    let mut c = Client::connect(resp_addr(&node)).await;
    // (ms since t0, quantity, [limited, limit, remaining, retry_after, reset_after])
    let steps: [(u64, &str, [i64; 5]); 15] = [
        (0, "6", [1, 5, 5, -1, 0]),
        (0, "1", [0, 5, 4, -1, 1]),
        (0, "1", [0, 5, 3, -1, 2]),
        (0, "1", [0, 5, 2, -1, 3]),
        (0, "1", [0, 5, 1, -1, 4]),
        (0, "1", [0, 5, 0, -1, 5]),
        (0, "1", [1, 5, 0, 1, 5]),
        (3000, "1", [0, 5, 2, -1, 3]),
        (3100, "1", [0, 5, 1, -1, 4]),
        (4000, "1", [0, 5, 1, -1, 4]),
        (8000, "1", [0, 5, 4, -1, 1]),
        (9500, "1", [0, 5, 4, -1, 1]),
        (9500, "0", [0, 5, 4, -1, 1]),
        (9500, "2", [0, 5, 2, -1, 3]),
        (9500, "5", [1, 5, 2, 3, 3]),
    ];
    let mut now = 0;
    for (i, (at, quantity, expected)) in steps.into_iter().enumerate() {
        clock.advance(at - now);
        now = at;
        let r = c
            .call(&["CL.THROTTLE", "foo", "4", "1", "1", quantity])
            .await;
        assert_eq!(r.ints(), expected, "step {i}");
    }
    // The README's call: 16 at once, 30 per minute.
    let r = c.call(&["cl.throttle", "user123", "15", "30", "60"]).await;
    assert_eq!(r.ints(), [0, 16, 15, -1, 2]);
}

/// 100 calls through two entry nodes of a three-node cluster, for keys owned by each
/// member, at a limit of 60: exactly 60 admitted per key, each decided by its owner.
#[tokio::test]
async fn a_three_node_cluster_admits_exactly_the_limit_through_two_entry_nodes() {
    let nodes = common::start_cluster_with(&["a", "b", "c"], None, |c| {
        c.resp = Some(RespConfig::on("127.0.0.1:0".parse().unwrap()));
        // Exact counts hold on the owner: on a loaded machine a forward that timed out
        // would fail over to a replica that may lag one interval (a documented loss).
        c.forward.timeout = std::time::Duration::from_secs(5);
    })
    .await;
    let members = ["a", "b", "c"];
    let mut via_b = Client::connect(resp_addr(&nodes[1])).await;
    let mut via_c = Client::connect(resp_addr(&nodes[2])).await;
    for owner in members {
        let key = key_owned_by(owner, &members);
        let mut admitted = 0;
        let mut last_remaining = 60;
        for i in 0..100 {
            let c = if i % 2 == 0 { &mut via_b } else { &mut via_c };
            let r = c.call(&["CL.THROTTLE", &key, "59", "1", WEEK]).await.ints();
            assert_eq!(r[1], 60, "limit = max_burst + 1");
            if r[0] == 0 {
                admitted += 1;
                assert_eq!(r[2], last_remaining - 1, "remaining counts down");
                assert_eq!(r[3], -1);
                last_remaining = r[2];
            } else {
                assert_eq!(r[2], 0);
                assert!(r[3] > 0, "a limited call says when to retry: {r:?}");
            }
        }
        assert_eq!(admitted, 60, "key owned by {owner}");
    }
}

/// A pipeline of 10,000 commands on one connection: every reply, in order, and
/// exactly the limit admitted; interleaved PINGs keep their places.
#[tokio::test]
async fn a_pipeline_of_ten_thousand_commands_is_answered_in_order_and_exactly() {
    let node = common::start(resp_config("solo", &[])).await;
    let mut c = Client::connect(resp_addr(&node)).await;
    let mut wire = Vec::new();
    for i in 0..10_000 {
        if i % 100 == 99 {
            wire.extend_from_slice(&encode(&[b"PING", format!("{i}").as_bytes()]));
        } else {
            wire.extend_from_slice(&encode(&[
                b"CL.THROTTLE",
                b"piped",
                b"999",
                b"1",
                WEEK.as_bytes(),
            ]));
        }
    }
    // Written while the replies are read: the node stops reading a client that does
    // not read its replies, so writing everything first could stall both sides.
    let (mut read, mut write) = c.stream.split();
    let writer = async move { write.write_all(&wire).await.unwrap() };
    let reader = async {
        let mut buf = Vec::new();
        let mut replies = Vec::with_capacity(10_000);
        while replies.len() < 10_000 {
            let mut chunk = [0u8; 65536];
            let n = read.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed after {} replies", replies.len());
            buf.extend_from_slice(&chunk[..n]);
            let mut at = 0;
            while let Some((r, used)) = parse(&buf[at..]) {
                replies.push(r);
                at += used;
            }
            buf.drain(..at);
        }
        replies
    };
    let ((), replies) = tokio::join!(writer, reader);
    let mut admitted = 0;
    for (i, r) in replies.iter().enumerate() {
        if i % 100 == 99 {
            assert_eq!(
                r,
                &Reply::Bulk(Some(format!("{i}").into_bytes())),
                "reply {i}"
            );
        } else if r.ints()[0] == 0 {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 1000, "limit 1000 (max_burst 999)");
}

/// Bytes that are not RESP: `-ERR Protocol error`, the connection closed, and the
/// command they were part of never charged.
#[tokio::test]
async fn malformed_resp_is_an_error_that_closes_the_connection_and_charges_nothing() {
    let node = common::start(resp_config("solo", &[])).await;
    let addr = resp_addr(&node);
    let cases: [&[u8]; 6] = [
        b"*2\r\n:1\r\n$3\r\nkey\r\n",
        b"*x\r\n",
        b"*6\r\n$11\r\nCL.THROTTLE\r\n$4\r\nmal1\r\n$2\r\n59\r\n$1\r\n1\r\n$6\r\n604800\r\n$1\r\n1XX",
        b"*1\r\n$-5\r\n",
        b"CL.THROTTLE \"mal1 59 1 604800\r\n",
        b"*-7\r\n",
    ];
    for raw in cases {
        let mut c = Client::connect(addr).await;
        c.send_raw(raw).await;
        let r = c.reply().await.expect("an error before closing");
        assert!(
            r.error().starts_with("ERR Protocol error"),
            "{:?}: {r:?}",
            String::from_utf8_lossy(raw)
        );
        assert!(
            c.closed().await,
            "closed after {:?}",
            String::from_utf8_lossy(raw)
        );
    }
    let mut c = Client::connect(addr).await;
    assert_eq!(left(&mut c, "mal1").await, 60, "nothing charged");
}

/// A client announcing a 2 GB argument or a billion of them is refused on the header:
/// nothing is allocated for them, the connection is closed at once.
#[tokio::test]
async fn huge_bulk_lengths_and_array_counts_are_refused_on_the_header() {
    let node = common::start(resp_config("solo", &[])).await;
    let addr = resp_addr(&node);
    for raw in [
        &b"*2\r\n$11\r\nCL.THROTTLE\r\n$2147483648\r\n"[..],
        b"*1000000000\r\n",
        b"*1\r\n$99999999999999999999\r\n",
    ] {
        let mut c = Client::connect(addr).await;
        c.send_raw(raw).await;
        let r = c.reply().await.expect("an error");
        assert!(r.error().starts_with("ERR Protocol error"), "{r:?}");
        assert!(c.closed().await);
    }
    // A line without an end, beyond the inline bound: refused, not buffered for ever.
    let mut c = Client::connect(addr).await;
    c.send_raw(&vec![b'a'; 64 * 1024]).await;
    let r = c.reply().await.expect("an error");
    assert!(r.error().contains("line longer than"), "{r:?}");
    assert!(c.closed().await);
}

/// A sender that trickles a command slower than the request timeout is disconnected,
/// and the command is never charged; an idle connection is closed after the idle
/// timeout.
#[tokio::test]
async fn slow_senders_and_idle_connections_are_disconnected() {
    let mut config = resp_config("solo", &[]);
    let resp = config.resp.as_mut().unwrap();
    resp.limits.request_timeout = Duration::from_millis(300);
    resp.limits.idle_timeout = Duration::from_millis(600);
    let node = common::start(config).await;
    let addr = resp_addr(&node);
    let command = encode(&[b"CL.THROTTLE", b"slow", b"59", b"1", WEEK.as_bytes()]);
    let mut c = Client::connect(addr).await;
    let started = tokio::time::Instant::now();
    let mut cut = false;
    for byte in &command[..command.len() - 1] {
        if c.stream.write_all(&[*byte]).await.is_err() {
            cut = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        if started.elapsed() > Duration::from_secs(3) {
            break;
        }
    }
    assert!(cut || c.closed().await, "a trickling sender is cut off");
    assert!(started.elapsed() < Duration::from_secs(3));
    let mut idle = Client::connect(addr).await;
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert!(idle.closed().await, "an idle connection is closed");
    let mut c = Client::connect(addr).await;
    assert_eq!(left(&mut c, "slow").await, 60, "nothing charged");
}

/// Unknown commands, wrong arities, bad numbers and non-UTF-8 keys: an error each,
/// the connection still serves, and nothing is charged.
#[tokio::test]
async fn bad_commands_are_errors_that_charge_nothing_and_keep_the_connection() {
    let node = common::start(resp_config("solo", &[])).await;
    let mut c = Client::connect(resp_addr(&node)).await;
    let r = c.call(&["SET", "bad1", "x"]).await;
    assert!(r.error().starts_with("ERR unknown command 'SET'"), "{r:?}");
    let r = c.call(&["CL.THROTTLE", "bad1", "59", "1"]).await;
    assert!(r.error().contains("wrong number of arguments"), "{r:?}");
    let r = c.call(&["CL.THROTTLE", "bad1", "59", "one", WEEK]).await;
    assert!(r.error().contains("not an integer"), "{r:?}");
    for (args, field) in [
        (["CL.THROTTLE", "bad1", "-1", "1", WEEK, "1"], "max_burst"),
        (["CL.THROTTLE", "bad1", "59", "0", WEEK, "1"], "count"),
        (["CL.THROTTLE", "bad1", "59", "1", "0", "1"], "period"),
        (["CL.THROTTLE", "bad1", "59", "1", "604801", "1"], "period"),
        (["CL.THROTTLE", "bad1", "59", "1", WEEK, "-3"], "quantity"),
        (["CL.THROTTLE", "", "59", "1", WEEK, "1"], "key"),
    ] {
        let r = c.call(&args).await;
        assert!(
            r.error().starts_with(&format!("ERR {field}:")),
            "{args:?}: {r:?}"
        );
    }
    c.send(&[b"CL.THROTTLE", b"bad1\xff", b"59", b"1", WEEK.as_bytes()])
        .await;
    let r = c.reply().await.unwrap();
    assert!(r.error().contains("UTF-8"), "{r:?}");
    // A quantity above the burst is limited and takes nothing (redis-cell's).
    let r = c
        .call(&["CL.THROTTLE", "bad1", "59", "1", WEEK, "61"])
        .await;
    assert_eq!(r.ints(), [1, 60, 60, -1, 0]);
    assert_eq!(left(&mut c, "bad1").await, 60, "nothing charged");
    assert_eq!(c.call(&["PING"]).await, Reply::Simple("PONG".into()));
}

/// With a token, nothing but AUTH, HELLO and QUIT is served until AUTH succeeds: a
/// CL.THROTTLE before it is refused and charges nothing; wrong guesses close the
/// connection.
#[tokio::test]
async fn with_a_token_every_command_waits_for_auth() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("resp.token");
    let secret = "resp-token-for-tests-0123456789";
    std::fs::write(&path, format!("{secret}\n")).unwrap();
    let mut config = resp_config("solo", &[]);
    config.resp = Some(
        RespConfig::on("127.0.0.1:0".parse().unwrap())
            .with_token_file(&path)
            .unwrap(),
    );
    let node = common::start(config).await;
    let addr = resp_addr(&node);
    let mut c = Client::connect(addr).await;
    let r = c.call(&["CL.THROTTLE", "authk", "59", "1", WEEK]).await;
    assert_eq!(r.error(), "NOAUTH Authentication required.");
    assert!(c.call(&["PING"]).await.error().starts_with("NOAUTH"));
    assert_eq!(c.call(&["AUTH", secret]).await, Reply::Simple("OK".into()));
    assert_eq!(
        left(&mut c, "authk").await,
        60,
        "the refused call charged nothing"
    );
    // HELLO 3 with AUTH on a new connection: authenticated and on RESP3 at once.
    let mut c3 = Client::connect(addr).await;
    c3.send_raw(b"HELLO 3 AUTH default resp-token-for-tests-0123456789\r\n")
        .await;
    let mut head = [0u8; 2];
    c3.stream.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"%7", "a RESP3 map");
    // Three wrong guesses: the connection is closed.
    let mut g = Client::connect(addr).await;
    for _ in 0..3 {
        assert!(g
            .call(&["AUTH", "guess-guess-guess-1"])
            .await
            .error()
            .starts_with("WRONGPASS"));
    }
    assert!(g.closed().await);
    assert!(RespToken::new(b"short").is_err());
}

/// Typed commands (inline, as `nc` sends them) are served; QUIT answers, then closes.
#[tokio::test]
async fn inline_commands_are_served_and_quit_closes() {
    let node = common::start(resp_config("solo", &[])).await;
    let mut c = Client::connect(resp_addr(&node)).await;
    c.send_raw(b"PING\r\nCL.THROTTLE inline-key 4 1 60\r\nECHO \"a b\"\r\nQUIT\r\n")
        .await;
    assert_eq!(c.reply().await, Some(Reply::Simple("PONG".into())));
    assert_eq!(c.reply().await.unwrap().ints(), [0, 5, 4, -1, 60]);
    assert_eq!(c.reply().await, Some(Reply::Bulk(Some(b"a b".to_vec()))));
    assert_eq!(c.reply().await, Some(Reply::Simple("OK".into())));
    assert!(c.closed().await);
}

/// Beyond the connection cap a client is told so, in Redis's words, and closed; the
/// ones already open keep being served.
#[tokio::test]
async fn connections_beyond_the_cap_are_refused() {
    let mut config = resp_config("solo", &[]);
    config.resp.as_mut().unwrap().limits.max_connections = 2;
    let node = common::start(config).await;
    let addr = resp_addr(&node);
    let mut a = Client::connect(addr).await;
    let mut b = Client::connect(addr).await;
    assert_eq!(a.call(&["PING"]).await, Reply::Simple("PONG".into()));
    assert_eq!(b.call(&["PING"]).await, Reply::Simple("PONG".into()));
    let mut extra = Client::connect(addr).await;
    let r = extra.reply().await.expect("told why");
    assert_eq!(r.error(), "ERR max number of clients reached");
    assert!(extra.closed().await);
    assert_eq!(a.call(&["PING"]).await, Reply::Simple("PONG".into()));
    drop(b);
    // Its slot is free again once the node sees it closed.
    let mut ok = false;
    for _ in 0..50 {
        let mut c = Client::connect(addr).await;
        c.send(&[b"PING"]).await;
        if c.reply().await == Some(Reply::Simple("PONG".into())) {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ok, "a freed slot serves a new client");
}

/// redis-cli, the stock client, against a node: PING, CL.THROTTLE's five integers,
/// AUTH with -a, and an unknown command's error. SKIPPED where redis-cli is missing
/// (.ci/deps installs Debian's redis-tools).
#[tokio::test]
async fn redis_cli_gets_redis_cell_answers() {
    if std::process::Command::new("redis-cli")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("SKIPPED: redis-cli not installed (Debian package redis-tools)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("resp.token");
    let secret = "redis-cli-token-0123456789";
    std::fs::write(&path, secret).unwrap();
    let mut config = resp_config("solo", &[]);
    config.resp = Some(
        RespConfig::on("127.0.0.1:0".parse().unwrap())
            .with_token_file(&path)
            .unwrap(),
    );
    let node = common::start(config).await;
    let port = resp_addr(&node).port().to_string();
    let cli = |args: &[&str]| {
        let port = port.clone();
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        // On a blocking thread: the node answering it runs on this test's runtime.
        async move {
            let out = tokio::task::spawn_blocking(move || {
                std::process::Command::new("redis-cli")
                    .args(["-h", "127.0.0.1", "-p", &port, "--no-auth-warning"])
                    .args(&args)
                    .output()
                    .expect("redis-cli runs")
            })
            .await
            .unwrap();
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        }
    };
    assert!(cli(&["PING"]).await.contains("NOAUTH"));
    let auth = ["-a", secret];
    assert_eq!(cli(&[&auth[..], &["PING"]].concat()).await, "PONG");
    let throttle = [&auth[..], &["CL.THROTTLE", "cli-key", "15", "30", "60"]].concat();
    assert_eq!(cli(&throttle).await, "0\n16\n15\n-1\n2");
    // Two units taken: full again 4 s after the first, less what passed between calls
    // (whole seconds, rounded up).
    let second = cli(&throttle).await;
    assert!(
        ["0\n16\n14\n-1\n4", "0\n16\n14\n-1\n3"].contains(&second.as_str()),
        "{second:?}"
    );
    let out = cli(&[&auth[..], &["NOPE"]].concat()).await;
    assert!(out.contains("unknown command 'NOPE'"), "{out}");
    let out = cli(&[&auth[..], &["COMMAND", "COUNT"]].concat()).await;
    assert!(out.parse::<u32>().is_ok(), "{out}");
}
