//! Mutual TLS on the peer face (issue 10, "only members speak for the cluster"): two
//! nodes with certificates of one cluster CA forward to each other over TLS, and the
//! peer port refuses every connection that cannot show such a certificate: plain
//! HTTP/2, TLS without a client certificate, a certificate of another CA, and a member
//! certificate for another peer name. Certificates are made here with rcgen.

mod common;

use std::time::Duration;

use common::tls::Ca;
use common::{check, client, key_owned_by, member_config, start, wait_converged};
use ringlimit::keyring::Keyring;
use ringlimit::node::config::{PeerTls, TEST_CLUSTER_SECRET};
use ringlimit::proto::peer::peer_client::PeerClient;
use ringlimit::proto::peer::StatusRequest;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// `Peer/Status` on `addr` with `tls` (and the cluster key's proof): Ok or the error.
async fn status(addr: std::net::SocketAddr, tls: Option<ClientTlsConfig>) -> Result<(), String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).map_err(|e| e.to_string())?;
    }
    let channel = endpoint.connect().await.map_err(|e| format!("{e:?}"))?;
    let keyring = Keyring::from_text(TEST_CLUSTER_SECRET).unwrap();
    let mut peer = PeerClient::new(ringlimit::cluster::link::Signed::new(
        channel,
        Some(keyring),
        "test-cli".into(),
    ));
    peer.status(StatusRequest {})
        .await
        .map(|_| ())
        .map_err(|s| format!("{s:?}"))
}

fn client_tls(ca_pem: &str, identity: Option<(String, String)>, name: &str) -> ClientTlsConfig {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name(name);
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    tls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_with_certificates_of_the_cluster_ca_forward_over_tls_and_nobody_else_gets_in() {
    let ca = Ca::new();
    let mut a = member_config("a", &[], None);
    a.peer_tls = Some(ca.member());
    let a = start(a).await;
    let mut b = member_config("b", &[a.gossip_addr.to_string()], None);
    b.peer_tls = Some(ca.member());
    let b = start(b).await;
    let nodes = [a, b];
    wait_converged(&nodes, 2).await;
    let [a, b] = nodes;

    // A key b owns, checked at a: forwarded over TLS and decided by b.
    let key = key_owned_by("b", &["a", "b"], "tls-");
    let answer = client(&a)
        .await
        .check(check(&key, "GET /x", None))
        .await
        .unwrap()
        .into_inner();
    assert!(answer.allowed && !answer.degraded, "{answer:?}");
    assert_eq!(answer.descriptors[0].hops, 1);
    assert_eq!(answer.decider.unwrap().node_id, "b");

    // A client with a member certificate (what `cluster status` uses) is served.
    let member = ca.leaf(&[PeerTls::DEFAULT_SERVER_NAME]);
    let ok = status(
        b.peer_addr,
        Some(client_tls(
            &ca.pem,
            Some(member),
            PeerTls::DEFAULT_SERVER_NAME,
        )),
    )
    .await;
    assert_eq!(ok, Ok(()));

    // Plain HTTP/2 to the TLS listener.
    assert!(status(b.peer_addr, None).await.is_err());
    // TLS, but no client certificate.
    assert!(status(
        b.peer_addr,
        Some(client_tls(&ca.pem, None, PeerTls::DEFAULT_SERVER_NAME))
    )
    .await
    .is_err());
    // A client certificate of another CA.
    let other = Ca::new();
    let stranger = other.leaf(&[PeerTls::DEFAULT_SERVER_NAME]);
    assert!(status(
        b.peer_addr,
        Some(client_tls(
            &ca.pem,
            Some(stranger),
            PeerTls::DEFAULT_SERVER_NAME
        ))
    )
    .await
    .is_err());
    // The client side checks the server too: expecting another peer name fails.
    let member = ca.leaf(&[PeerTls::DEFAULT_SERVER_NAME]);
    assert!(status(
        b.peer_addr,
        Some(client_tls(&ca.pem, Some(member), "some-other-cluster"))
    )
    .await
    .is_err());

    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn a_node_with_unusable_tls_files_refuses_to_start_with_the_reason() {
    let ca = Ca::new();
    let mut tls = ca.member();
    tls.key_pem = b"-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n".to_vec();
    let mut config = member_config("a", &[], None);
    config.peer_tls = Some(tls);
    let error = match ringlimit::node::start(config).await {
        Ok(_) => panic!("a node with a broken key must not start"),
        Err(error) => error,
    };
    assert!(error.to_string().contains("peer TLS"), "{error}");

    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem");
    let plain = dir.path().join("plain.txt");
    std::fs::write(&plain, "hello").unwrap();
    let err = PeerTls::from_files(&missing, &plain, &plain, "x").unwrap_err();
    assert!(
        err.contains("--peer-tls-cert") && err.contains("missing.pem"),
        "{err}"
    );
    let cert = dir.path().join("cert.pem");
    std::fs::write(&cert, ca.leaf(&["x"]).0).unwrap();
    let err = PeerTls::from_files(&cert, &plain, &cert, "x").unwrap_err();
    assert!(
        err.contains("--peer-tls-key") && err.contains("not a PEM file"),
        "{err}"
    );
}
