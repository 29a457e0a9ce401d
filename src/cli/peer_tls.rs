//! The peer-face mutual TLS flags, shared by `serve` and `cluster status`.

use std::path::PathBuf;

/// Mutual TLS on the peer face (docs/security.md): all three files, or none.
#[derive(clap::Args, Clone)]
pub struct PeerTlsArgs {
    /// Certificate (PEM) presented on the peer face and on peer calls, signed by
    /// --peer-tls-ca and carrying --peer-tls-server-name as a DNS name.
    #[arg(long, env = "RINGLIMIT_PEER_TLS_CERT", requires_all = ["peer_tls_key", "peer_tls_ca"])]
    peer_tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --peer-tls-cert.
    #[arg(long, env = "RINGLIMIT_PEER_TLS_KEY", requires_all = ["peer_tls_cert", "peer_tls_ca"])]
    peer_tls_key: Option<PathBuf>,
    /// The cluster CA (PEM): peers must present a certificate it signed.
    #[arg(long, env = "RINGLIMIT_PEER_TLS_CA", requires_all = ["peer_tls_cert", "peer_tls_key"])]
    peer_tls_ca: Option<PathBuf>,
    /// The name every member's certificate carries (peers are dialled by IP address).
    #[arg(long, default_value = ringlimit::node::config::PeerTls::DEFAULT_SERVER_NAME)]
    peer_tls_server_name: String,
}

impl PeerTlsArgs {
    /// The loaded certificates, or `None` when no TLS flag was given.
    pub fn load(&self) -> anyhow::Result<Option<ringlimit::node::config::PeerTls>> {
        let (Some(cert), Some(key), Some(ca)) =
            (&self.peer_tls_cert, &self.peer_tls_key, &self.peer_tls_ca)
        else {
            return Ok(None);
        };
        ringlimit::node::config::PeerTls::from_files(cert, key, ca, &self.peer_tls_server_name)
            .map(Some)
            .map_err(anyhow::Error::msg)
    }
}
