//! TLS on the public face (issue 26, point 6): `serve --tls-cert/--tls-key` makes every
//! public service speak TLS only, `--tls-client-ca` demands a client certificate of that
//! CA, and the listener's bounds (connection cap, stream cap, handshake deadline) hold
//! under TLS. Certificates are made here with rcgen (`common::tls`).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::tls::Ca;
use common::{check, start};
use ringlimit::node::config::PublicTls;
use ringlimit::node::{NodeConfig, RunningNode};
use ringlimit::proto::rate_limiter_client::RateLimiterClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::CertificateDer;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// Longest wait for something that should happen at once; only a failing run waits it.
const GUARD: Duration = Duration::from_secs(20);

/// A node serving its public face with `tls`.
async fn tls_node(tls: PublicTls, adjust: impl FnOnce(&mut NodeConfig)) -> RunningNode {
    let mut config = NodeConfig::for_test();
    config.public_tls = Some(tls);
    adjust(&mut config);
    start(config).await
}

/// Client TLS trusting `ca_pem`, expecting `localhost`, presenting `identity`.
fn client_tls(ca_pem: &str, identity: Option<(String, String)>) -> ClientTlsConfig {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name("localhost");
    match identity {
        Some((cert, key)) => tls.identity(Identity::from_pem(cert, key)),
        None => tls,
    }
}

/// One `ringlimit.v1` Check on `node`'s public face, with `tls` or in plaintext.
async fn check_over(node: &RunningNode, tls: Option<ClientTlsConfig>) -> Result<(), String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{}", node.grpc_addr))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).map_err(|e| e.to_string())?;
    }
    let channel = endpoint.connect().await.map_err(|e| format!("{e:?}"))?;
    RateLimiterClient::new(channel)
        .check(check("tls-key", "GET /x", None))
        .await
        .map(|answer| assert!(answer.into_inner().allowed))
        .map_err(|status| format!("{status:?}"))
}

/// Reads until the server closes the connection (EOF or reset).
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_trusting_the_ca_is_answered_over_tls_and_plaintext_is_refused() {
    let ca = Ca::new();
    let node = tls_node(ca.public(None), |_| {}).await;
    assert_eq!(
        check_over(&node, Some(client_tls(&ca.pem, None))).await,
        Ok(())
    );
    // Health on the same server, over the same TLS.
    let channel = Endpoint::from_shared(format!("https://{}", node.grpc_addr))
        .unwrap()
        .tls_config(client_tls(&ca.pem, None))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let health = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        health.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    // Plain HTTP/2 to the TLS listener.
    assert!(check_over(&node, None).await.is_err());
    // A client that does not trust the node's CA refuses the node.
    let other = Ca::new();
    assert!(check_over(&node, Some(client_tls(&other.pem, None)))
        .await
        .is_err());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_client_ca_only_certificates_that_ca_signed_are_answered() {
    let server_ca = Ca::new();
    let client_ca = Ca::new();
    let node = tls_node(server_ca.public(Some(&client_ca)), |_| {}).await;
    let signed = client_ca.leaf(&["gateway-1"]);
    assert_eq!(
        check_over(&node, Some(client_tls(&server_ca.pem, Some(signed)))).await,
        Ok(())
    );
    // TLS without a client certificate.
    assert!(check_over(&node, Some(client_tls(&server_ca.pem, None)))
        .await
        .is_err());
    // A client certificate of another CA (here: the server's own).
    let stranger = server_ca.leaf(&["gateway-1"]);
    assert!(
        check_over(&node, Some(client_tls(&server_ca.pem, Some(stranger))))
            .await
            .is_err()
    );
    // Plain HTTP/2.
    assert!(check_over(&node, None).await.is_err());

    // `ringlimit check` with the matching flags; without a certificate it is refused.
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let ca_file = write("ca.pem", &server_ca.pem);
    let (cert, key) = client_ca.leaf(&["gateway-2"]);
    let cert_file = write("client.pem", &cert);
    let key_file = write("client.key", &key);
    let addr = node.grpc_addr;
    let cli = move |with_cert: bool| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_ringlimit"));
        command.args(["check", "--key", "cli-key", "--route", "GET /x", "--addr"]);
        command.arg(addr.to_string());
        command.arg("--tls-ca").arg(&ca_file);
        command.args(["--tls-server-name", "localhost"]);
        if with_cert {
            command.arg("--tls-cert").arg(&cert_file);
            command.arg("--tls-key").arg(&key_file);
        }
        command.output().unwrap()
    };
    let out = tokio::task::spawn_blocking(move || (cli(true), cli(false)))
        .await
        .unwrap();
    let (with, without) = out;
    assert!(
        with.status.success(),
        "{}",
        String::from_utf8_lossy(&with.stderr)
    );
    assert!(String::from_utf8_lossy(&with.stdout).starts_with("allowed"));
    assert_eq!(
        without.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&without.stdout)
    );
    node.shutdown().await;
}

/// Closes: "a TLS handshake that never completes holds a connection slot for good".
/// The listener's raw-byte deadline is met by the first 24 bytes of a ClientHello, so
/// half a ClientHello is what the TLS handshake deadline must catch; a socket that
/// sends nothing is caught as on a plaintext listener. With a cap of one connection,
/// the slot is free again once the server closed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_handshake_that_never_completes_is_closed_at_the_handshake_timeout() {
    let ca = Ca::new();
    let timeout = Duration::from_millis(300);
    let node = tls_node(ca.public(None), |config| {
        config.grpc.handshake_timeout = timeout;
        config.grpc.max_connections = 1;
    })
    .await;

    // A TLS record header announcing a 512-byte ClientHello, then 100 bytes of it.
    let mut half_hello = vec![
        0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03,
    ];
    half_hello.resize(105, 0x2a);
    let began = Instant::now();
    let mut partial = TcpStream::connect(node.grpc_addr).await.unwrap();
    partial.write_all(&half_hello).await.unwrap();
    closed_by_server(&mut partial).await;
    assert!(
        began.elapsed() >= timeout,
        "closed before the handshake timeout"
    );

    let began = Instant::now();
    let mut silent = TcpStream::connect(node.grpc_addr).await.unwrap();
    closed_by_server(&mut silent).await;
    assert!(
        began.elapsed() >= timeout,
        "closed before the handshake timeout"
    );

    // The only slot is free again: a TLS client is served (retried until the server
    // has dropped the closed connection, bounded).
    tokio::time::timeout(GUARD, async {
        while check_over(&node, Some(client_tls(&ca.pem, None)))
            .await
            .is_err()
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("a freed slot admits a TLS client");
    node.shutdown().await;
}

/// The connection cap and the stream cap of the listener hold under TLS: the server's
/// HTTP/2 SETTINGS, read through TLS, carry the stream cap; with a cap of one
/// connection held by a TLS client, another TLS client is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_and_stream_caps_hold_on_a_tls_listener() {
    let ca = Ca::new();
    let node = tls_node(ca.public(None), |config| {
        config.grpc.max_connections = 1;
        config.grpc.max_concurrent_streams = 7;
    })
    .await;

    // A raw HTTP/2 client over rustls: one health check, then the server's SETTINGS.
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    let ca_der = CertificateDer::from_pem_slice(ca.pem.as_bytes()).unwrap();
    roots.add(ca_der).unwrap();
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut config = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(node.grpc_addr).await.unwrap();
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = connector.connect(name, tcp).await.unwrap();
    let (mut send, connection) = h2::client::handshake(tls).await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    // Drives the connection until told to stop, then reads the stream cap the
    // server's SETTINGS gave it.
    let driver = tokio::spawn(async move {
        let mut connection = connection;
        tokio::select! {
            _ = &mut connection => {}
            _ = stopped => {}
        }
        connection.max_concurrent_send_streams()
    });
    let request = http::Request::builder()
        .method("POST")
        .uri(format!(
            "https://{}/grpc.health.v1.Health/Check",
            node.grpc_addr
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut body) = send.send_request(request, false).unwrap();
    body.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true)
        .unwrap();
    let response = tokio::time::timeout(GUARD, response)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), 200);

    // The one slot is taken: a second TLS client is closed at once.
    assert!(check_over(&node, Some(client_tls(&ca.pem, None)))
        .await
        .is_err());

    stop.send(()).unwrap();
    assert_eq!(driver.await.unwrap(), 7);
    drop(send);
    node.shutdown().await;
}

#[tokio::test]
async fn a_node_with_unusable_public_tls_files_refuses_to_start_with_the_reason() {
    let ca = Ca::new();
    // A key that is not the certificate's.
    let mut mismatched = ca.public(None);
    mismatched.key_pem = ca.leaf(&["localhost"]).1.into_bytes();
    // A client CA file without a certificate in it.
    let mut no_ca = ca.public(None);
    no_ca.client_ca_pem = Some(ca.leaf(&["x"]).1.into_bytes());
    // The key given as the certificate.
    let mut swapped = ca.public(None);
    swapped.cert_pem = swapped.key_pem.clone();
    // A CA file whose certificate block does not parse.
    let mut broken_ca = ca.public(None);
    broken_ca.client_ca_pem =
        Some(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".to_vec());
    for (tls, expected) in [
        (mismatched, "--tls-key file is not the private key"),
        (no_ca, "--tls-client-ca file holds no CERTIFICATE"),
        (swapped, "--tls-cert file holds no CERTIFICATE"),
        (broken_ca, "--tls-client-ca"),
    ] {
        let mut config = NodeConfig::for_test();
        config.public_tls = Some(tls);
        let error = match ringlimit::node::start(config).await {
            Ok(_) => panic!("a node with unusable TLS files must not start"),
            Err(error) => error.to_string(),
        };
        assert!(
            error.contains("public TLS") && error.contains(expected),
            "{error}"
        );
    }

    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem");
    let plain = dir.path().join("plain.txt");
    std::fs::write(&plain, "hello").unwrap();
    let err = PublicTls::from_files(&missing, &plain, None).unwrap_err();
    assert!(
        err.contains("--tls-cert") && err.contains("missing.pem"),
        "{err}"
    );
    let cert = dir.path().join("cert.pem");
    std::fs::write(&cert, ca.leaf(&["x"]).0).unwrap();
    let err = PublicTls::from_files(&cert, &plain, None).unwrap_err();
    assert!(
        err.contains("--tls-key") && err.contains("not a PEM file"),
        "{err}"
    );
    let err = PublicTls::from_files(&cert, &cert, Some(&missing)).unwrap_err();
    assert!(err.contains("--tls-client-ca"), "{err}");
}

/// The flags' own rules, from the binary: a client CA without a certificate and key,
/// or a certificate without its key, is refused before anything starts; so is a
/// missing file, naming it.
#[tokio::test]
async fn serve_refuses_incomplete_or_missing_tls_flags() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem");
    let serve = |args: Vec<std::ffi::OsString>| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ringlimit"))
            .arg("serve")
            .args(["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"])
            .args([
                "--gossip-listen",
                "127.0.0.1:0",
                "--peer-listen",
                "127.0.0.1:0",
            ])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let m = missing.as_os_str().to_owned();
    let (code, stderr) = tokio::task::spawn_blocking({
        let m = m.clone();
        move || serve(vec!["--tls-client-ca".into(), m])
    })
    .await
    .unwrap();
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--tls-cert"), "{stderr}");
    let (code, stderr) = tokio::task::spawn_blocking({
        let m = m.clone();
        move || serve(vec!["--tls-cert".into(), m])
    })
    .await
    .unwrap();
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--tls-key"), "{stderr}");
    let (code, stderr) = tokio::task::spawn_blocking(move || {
        serve(vec!["--tls-cert".into(), m.clone(), "--tls-key".into(), m])
    })
    .await
    .unwrap();
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--tls-cert") && stderr.contains("missing.pem"),
        "{stderr}"
    );
}
