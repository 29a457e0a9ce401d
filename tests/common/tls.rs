//! Certificates for the TLS tests (peer face and public face), made with rcgen.

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use ringlimit::node::config::{PeerTls, PublicTls};

/// A CA and what it signs.
pub struct Ca {
    /// The CA's certificate, PEM.
    pub pem: String,
    issuer: Issuer<'static, KeyPair>,
}

#[allow(clippy::new_without_default)]
impl Ca {
    /// A fresh self-signed CA.
    pub fn new() -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // A name of its own: rcgen's default is every certificate's, and OpenSSL
        // (redis-cli, nginx) takes a leaf named like its issuer for self-signed.
        params
            .distinguished_name
            .push(DnType::CommonName, "ringlimit test CA");
        let key = KeyPair::generate().unwrap();
        let pem = params.self_signed(&key).unwrap().pem();
        Ca {
            pem,
            issuer: Issuer::new(params, key),
        }
    }

    /// A leaf certificate for `names`, as (cert PEM, key PEM).
    pub fn leaf(&self, names: &[&str]) -> (String, String) {
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, names.first().copied().unwrap_or("leaf"));
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// Peer-face TLS material of one member of this CA's cluster.
    pub fn member(&self) -> PeerTls {
        let (cert, key) = self.leaf(&[PeerTls::DEFAULT_SERVER_NAME]);
        PeerTls {
            cert_pem: cert.into_bytes(),
            key_pem: key.into_bytes(),
            ca_pem: self.pem.clone().into_bytes(),
            server_name: PeerTls::DEFAULT_SERVER_NAME.into(),
        }
    }
}

impl Ca {
    /// Public-face TLS material: a server certificate of this CA for `localhost` and
    /// 127.0.0.1, and with `client_ca` mutual TLS against that CA.
    pub fn public(&self, client_ca: Option<&Ca>) -> PublicTls {
        let (cert, key) = self.leaf(&["localhost", "127.0.0.1"]);
        PublicTls {
            cert_pem: cert.into_bytes(),
            key_pem: key.into_bytes(),
            client_ca_pem: client_ca.map(|ca| ca.pem.clone().into_bytes()),
        }
    }
}
