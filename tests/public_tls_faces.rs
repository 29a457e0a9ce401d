//! The public face's TLS on the HTTP check face and the RESP face: with `--tls-cert`
//! both speak TLS only, with the gRPC face's certificate, and with `--tls-client-ca`
//! both demand a client certificate of that CA. What an attacker on the callers'
//! network would try, and the bypass each test closes: no certificate, another CA's
//! certificate, plaintext to the TLS port (each refused at the handshake and charging
//! nothing), and a handshake that stalls (a slowloris of TLS, held to the face's first
//! deadline and its connection cap). Certificates are made here with rcgen
//! (`common::tls`); redis-cli, where installed, speaks `--tls` to a node.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::tls::Ca;
use common::{parse_http_answer, rules_file, start, HttpAnswer};
use ringlimit::node::config::{CheckHttpConfig, PublicTls};
use ringlimit::node::resp_listener::RespConfig;
use ringlimit::node::{NodeConfig, RunningNode};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// Longest wait for something that should happen at once; only a failing run waits it.
const GUARD: Duration = Duration::from_secs(20);

/// One rule for every route: 5 an hour, so nothing refills during a test.
const RULES: &str = r#"
[[rule]]
name = "api"
route = "*"
algorithm = "fixed_window"
limit = 5
window = "1h"
"#;

/// A node with `tls` on its public face, serving the check face and the RESP face;
/// `adjust` changes either before the start.
async fn tls_node(
    tls: PublicTls,
    adjust: impl FnOnce(&mut CheckHttpConfig, &mut RespConfig),
) -> (RunningNode, tempfile::TempDir) {
    let (dir, rules) = rules_file(RULES);
    let mut check = CheckHttpConfig::on("127.0.0.1:0".parse().unwrap());
    let mut resp = RespConfig::on("127.0.0.1:0".parse().unwrap());
    adjust(&mut check, &mut resp);
    let config = NodeConfig {
        rules_path: Some(rules),
        public_tls: Some(tls),
        check_http: Some(check),
        resp: Some(resp),
        ..NodeConfig::for_test()
    };
    (start(config).await, dir)
}

fn check_addr(node: &RunningNode) -> SocketAddr {
    node.check_http_addr.expect("the check face is served")
}

fn resp_addr(node: &RunningNode) -> SocketAddr {
    node.resp_addr.expect("the RESP face is served")
}

/// A TLS client trusting `ca`, expecting `localhost`, presenting `identity`, offering
/// `alpn`.
fn connector(
    ca: &Ca,
    identity: Option<&(String, String)>,
    alpn: &[&[u8]],
) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.pem.as_bytes()).unwrap())
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut config = match identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => builder
            .with_client_auth_cert(
                CertificateDer::pem_slice_iter(cert.as_bytes())
                    .collect::<Result<Vec<_>, _>>()
                    .unwrap(),
                PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
            )
            .unwrap(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// Writes `request` on `stream` and reads until the server closes it (EOF, an error, or
/// a TLS alert): the bytes read, or the error when there were none.
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    request: &[u8],
) -> Result<Vec<u8>, String> {
    stream
        .write_all(request)
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    let outcome = tokio::time::timeout(GUARD, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => return Err(e.to_string()),
            }
        }
    })
    .await
    .expect("the server answers or closes");
    match outcome {
        Err(e) if got.is_empty() => Err(e),
        _ => Ok(got),
    }
}

/// One HTTP/1.1 request over TLS with `tls`: the answer, or why there was none.
async fn https(
    addr: SocketAddr,
    tls: &tokio_rustls::TlsConnector,
    request: &str,
) -> Result<HttpAnswer, String> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    let stream = tls
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let raw = exchange(stream, request.as_bytes()).await?;
    let raw = String::from_utf8(raw).map_err(|e| e.to_string())?;
    Ok(parse_http_answer(&raw))
}

fn post_check(key: &str) -> String {
    let json = format!(r#"{{"key":"{key}","route":"GET /v1/items"}}"#);
    format!(
        "POST /v1/check HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{json}",
        json.len()
    )
}

fn forward_auth(uri: &str) -> String {
    format!("GET /v1/forward-auth HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Forwarded-Uri: {uri}\r\nX-Forwarded-Method: GET\r\n\r\n")
}

/// What a JSON check over `tls` says is left of `key` after it (it spends one).
async fn remaining_after_one(
    node: &RunningNode,
    tls: &tokio_rustls::TlsConnector,
    key: &str,
) -> i64 {
    let answer = https(check_addr(node), tls, &post_check(key))
        .await
        .expect("an answer");
    assert_eq!(answer.status, 200, "{answer:?}");
    answer.json()["remaining"].as_i64().unwrap()
}

/// Reads until the server closes the connection (EOF, reset, or an alert).
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

/// A TLS record header announcing a 512-byte ClientHello, then 100 bytes of it: a
/// handshake that never completes.
fn half_client_hello() -> Vec<u8> {
    let mut half = vec![
        0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03,
    ];
    half.resize(105, 0x2a);
    half
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_checks_and_forward_auth_are_answered_and_plaintext_is_refused_without_charging() {
    let ca = Ca::new();
    let (node, _dir) = tls_node(ca.public(None), |_, _| {}).await;
    let tls = connector(&ca, None, &[b"http/1.1"]);

    let answer = https(check_addr(&node), &tls, &post_check("alice"))
        .await
        .unwrap();
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.json()["allowed"], true);
    assert_eq!(answer.json()["remaining"], 4);

    // Forward-auth keyed by the TCP peer (127.0.0.1), over the same TLS.
    let allowed = https(check_addr(&node), &tls, &forward_auth("/v1/items?a=1"))
        .await
        .unwrap();
    assert_eq!(allowed.status, 200, "{allowed:?}");
    assert_eq!(
        allowed.header("ratelimit-policy"),
        Some("\"api\";q=5;w=3600")
    );
    assert!(allowed.header("ratelimit").is_some(), "{allowed:?}");

    // Plaintext HTTP to the TLS port: the bytes are not a ClientHello, so no HTTP
    // answer ever comes, and nothing is charged.
    let mut plain = TcpStream::connect(check_addr(&node)).await.unwrap();
    let got = exchange(&mut plain, post_check("alice").as_bytes()).await;
    if let Ok(bytes) = &got {
        assert!(
            !bytes.starts_with(b"HTTP/"),
            "answered in the clear: {got:?}"
        );
    }
    // A client that does not trust the node's CA refuses the node.
    let stranger = Ca::new();
    let refused = https(
        check_addr(&node),
        &connector(&stranger, None, &[b"http/1.1"]),
        &post_check("alice"),
    )
    .await;
    assert!(refused.is_err(), "{refused:?}");

    assert_eq!(remaining_after_one(&node, &tls, "alice").await, 3);
    node.shutdown().await;
}

/// Closes: spending any client's budget through the check face without a certificate
/// of the client CA, while the gRPC face demands one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_client_ca_the_check_face_serves_only_signed_clients_and_the_others_charge_nothing()
{
    let server_ca = Ca::new();
    let client_ca = Ca::new();
    let (node, _dir) = tls_node(server_ca.public(Some(&client_ca)), |_, _| {}).await;
    let signed = client_ca.leaf(&["gateway-1"]);
    let with_cert = connector(&server_ca, Some(&signed), &[b"http/1.1"]);

    assert_eq!(remaining_after_one(&node, &with_cert, "bob").await, 4);

    // No client certificate, and a certificate of another CA (here the server's own):
    // refused during the handshake, whatever the request says.
    let stranger = server_ca.leaf(&["gateway-1"]);
    for refused in [
        connector(&server_ca, None, &[b"http/1.1"]),
        connector(&server_ca, Some(&stranger), &[b"http/1.1"]),
    ] {
        for request in [post_check("bob"), forward_auth("/v1/items")] {
            let answer = https(check_addr(&node), &refused, &request).await;
            assert!(answer.is_err(), "answered: {answer:?}");
        }
    }
    // Plaintext.
    let mut plain = TcpStream::connect(check_addr(&node)).await.unwrap();
    let got = exchange(&mut plain, post_check("bob").as_bytes()).await;
    if let Ok(bytes) = &got {
        assert!(
            !bytes.starts_with(b"HTTP/"),
            "answered in the clear: {got:?}"
        );
    }

    // Nothing of the refused requests was charged.
    assert_eq!(remaining_after_one(&node, &with_cert, "bob").await, 3);
    // Nor of the forward-auth ones (keyed by 127.0.0.1): the first allowed one sees 4.
    let answer = https(check_addr(&node), &with_cert, &forward_auth("/v1/items"))
        .await
        .unwrap();
    assert_eq!(answer.status, 200);
    assert!(
        answer.header("ratelimit").unwrap().contains(";r=4;"),
        "{answer:?}"
    );
    node.shutdown().await;
}

/// Closes: starving the check face with TLS handshakes that never finish. A stalled
/// handshake is a connection waiting for its request head: the header timeout closes
/// it, and at the connection cap a new caller closes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_handshake_on_the_check_face_meets_the_header_timeout_and_yields_its_slot() {
    let ca = Ca::new();
    let timeout = Duration::from_millis(300);
    let (node, _dir) = tls_node(ca.public(None), |check, _| {
        check.header_timeout = timeout;
    })
    .await;
    for stall in [half_client_hello(), Vec::new()] {
        let began = Instant::now();
        let mut staller = TcpStream::connect(check_addr(&node)).await.unwrap();
        staller.write_all(&stall).await.unwrap();
        closed_by_server(&mut staller).await;
        assert!(
            began.elapsed() >= timeout,
            "closed before the header timeout"
        );
    }
    node.shutdown().await;

    // One slot, a long header timeout: the staller holds the slot until a caller comes,
    // and the caller is served.
    let (node, _dir) = tls_node(ca.public(None), |check, _| {
        check.max_connections = 1;
        check.header_timeout = Duration::from_secs(60);
    })
    .await;
    let mut staller = TcpStream::connect(check_addr(&node)).await.unwrap();
    staller.write_all(&half_client_hello()).await.unwrap();
    let tls = connector(&ca, None, &[b"http/1.1"]);
    assert_eq!(remaining_after_one(&node, &tls, "carol").await, 4);
    closed_by_server(&mut staller).await;
    node.shutdown().await;
}

/// One RESP command over `stream`: the reply's lines, or why there was none.
async fn resp_call<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    args: &[&str],
) -> Result<Vec<String>, String> {
    let mut out = format!("*{}\r\n", args.len());
    for a in args {
        out.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    stream
        .write_all(out.as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    // A simple reply is one line; an array of N integers is N + 1.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).to_string();
        let lines: Vec<String> = text.split_terminator("\r\n").map(String::from).collect();
        let whole = text.ends_with("\r\n");
        if let Some(first) = lines.first().filter(|_| whole) {
            let need = match first.strip_prefix('*') {
                Some(n) => n.parse::<usize>().map_err(|e| e.to_string())? + 1,
                None => 1,
            };
            if lines.len() >= need {
                return Ok(lines);
            }
        }
        let n = tokio::time::timeout(GUARD, stream.read(&mut buf))
            .await
            .expect("a reply or a close")
            .map_err(|e| e.to_string())?;
        if n == 0 {
            return Err(format!("closed after {got:?}"));
        }
        got.extend_from_slice(&buf[..n]);
    }
}

/// A TLS connection to the RESP face with `tls` (the handshake may still be refused
/// by the server on the first read, as TLS 1.3 checks client certificates then).
async fn resp_tls(
    node: &RunningNode,
    tls: &tokio_rustls::TlsConnector,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, String> {
    let tcp = TcpStream::connect(resp_addr(node)).await.unwrap();
    tls.connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))
}

/// `CL.THROTTLE key 4 1 604800 quantity`: limit 5, a unit back per week.
async fn throttle<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    key: &str,
    quantity: &str,
) -> Result<Vec<String>, String> {
    resp_call(stream, &["CL.THROTTLE", key, "4", "1", "604800", quantity]).await
}

/// Closes: spending budgets over RESP without a certificate of the client CA, or in
/// the clear beside a TLS gRPC face.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resp_over_mutual_tls_serves_only_signed_clients_and_the_others_charge_nothing() {
    let server_ca = Ca::new();
    let client_ca = Ca::new();
    let (node, _dir) = tls_node(server_ca.public(Some(&client_ca)), |_, _| {}).await;
    let signed = client_ca.leaf(&["app-1"]);
    let with_cert = connector(&server_ca, Some(&signed), &[]);

    let mut client = resp_tls(&node, &with_cert).await.unwrap();
    assert_eq!(resp_call(&mut client, &["PING"]).await.unwrap(), ["+PONG"]);
    assert_eq!(
        throttle(&mut client, "dave", "1").await.unwrap(),
        ["*5", ":0", ":5", ":4", ":-1", ":604800"]
    );

    let stranger = server_ca.leaf(&["app-1"]);
    for refused in [
        connector(&server_ca, None, &[]),
        connector(&server_ca, Some(&stranger), &[]),
        connector(&Ca::new(), Some(&signed), &[]),
    ] {
        let answer = match resp_tls(&node, &refused).await {
            Ok(mut stream) => throttle(&mut stream, "dave", "1").await,
            Err(e) => Err(e),
        };
        assert!(answer.is_err(), "answered: {answer:?}");
    }
    // Plaintext RESP to the TLS port: no reply, ever.
    let mut plain = TcpStream::connect(resp_addr(&node)).await.unwrap();
    let answer = throttle(&mut plain, "dave", "1").await;
    assert!(answer.is_err(), "answered in the clear: {answer:?}");

    // Nothing of the refused calls was charged: a peek still sees 4 left.
    assert_eq!(throttle(&mut client, "dave", "0").await.unwrap()[3], ":4");
    node.shutdown().await;
}

/// Closes: holding the RESP face's connection slots with TLS handshakes that never
/// finish. A handshake has the request timeout, on the slot it took from the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_handshake_on_the_resp_face_holds_its_slot_no_longer_than_the_request_timeout() {
    let ca = Ca::new();
    let timeout = Duration::from_millis(300);
    let tls = connector(&ca, None, &[]);
    for stall in [half_client_hello(), Vec::new()] {
        // A node each: the slot is free when the staller comes.
        let (node, _dir) = tls_node(ca.public(None), |_, resp| {
            resp.limits.request_timeout = timeout;
            resp.limits.max_connections = 1;
        })
        .await;
        let began = Instant::now();
        let mut staller = TcpStream::connect(resp_addr(&node)).await.unwrap();
        staller.write_all(&stall).await.unwrap();
        // The staller holds the only slot: a TLS client now is closed at once.
        let refused = match resp_tls(&node, &tls).await {
            Ok(mut stream) => resp_call(&mut stream, &["PING"]).await,
            Err(e) => Err(e),
        };
        assert!(refused.is_err(), "served beyond the cap: {refused:?}");
        closed_by_server(&mut staller).await;
        assert!(
            began.elapsed() >= timeout,
            "closed before the request timeout"
        );
        // The slot is free again once the server has dropped the staller (bounded).
        let served = tokio::time::timeout(GUARD, async {
            loop {
                if let Ok(mut stream) = resp_tls(&node, &tls).await {
                    if let Ok(pong) = resp_call(&mut stream, &["PING"]).await {
                        return pong;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("a freed slot admits a TLS client");
        assert_eq!(served, ["+PONG"]);
        node.shutdown().await;
    }
}

/// redis-cli, the stock client, with `--tls` and a client certificate: PING and
/// CL.THROTTLE's five integers; without the certificate, no answer. SKIPPED where
/// redis-cli is missing (.ci/deps installs Debian's redis-tools, built with TLS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cli_speaks_tls_with_a_client_certificate() {
    if std::process::Command::new("redis-cli")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("SKIPPED: redis-cli not installed (Debian package redis-tools)");
        return;
    }
    let server_ca = Ca::new();
    let client_ca = Ca::new();
    let (node, _dir) = tls_node(server_ca.public(Some(&client_ca)), |_, _| {}).await;
    let files = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = files.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let ca_file = write("ca.pem", &server_ca.pem);
    let (cert, key) = client_ca.leaf(&["app-1"]);
    let cert_file = write("app.pem", &cert);
    let key_file = write("app.key", &key);
    let port = resp_addr(&node).port().to_string();
    let cli = |tls_args: Vec<String>, args: &[&str]| {
        let port = port.clone();
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        // On a blocking thread: the node answering it runs on this test's runtime.
        async move {
            let out = tokio::task::spawn_blocking(move || {
                std::process::Command::new("redis-cli")
                    .args(["-h", "127.0.0.1", "-p", &port, "--tls"])
                    .args(&tls_args)
                    .args(&args)
                    .output()
                    .expect("redis-cli runs")
            })
            .await
            .unwrap();
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            )
        }
    };
    let full = vec![
        "--cacert".to_string(),
        ca_file.clone(),
        "--cert".into(),
        cert_file,
        "--key".into(),
        key_file,
    ];
    assert_eq!(cli(full.clone(), &["PING"]).await, "PONG");
    let throttle = ["CL.THROTTLE", "cli-tls", "15", "30", "60"];
    assert_eq!(cli(full.clone(), &throttle).await, "0\n16\n15\n-1\n2");
    let without = cli(vec!["--cacert".into(), ca_file], &throttle).await;
    assert!(!without.starts_with('0'), "answered: {without}");
    // Nothing charged by the refused call: the peek sees the 15 the first left.
    let peek = ["CL.THROTTLE", "cli-tls", "15", "30", "60", "0"];
    let left = cli(full, &peek).await;
    assert!(left.starts_with("0\n16\n15\n"), "{left}");
    node.shutdown().await;
}
