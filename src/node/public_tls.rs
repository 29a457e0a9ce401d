//! The public face's TLS on the listeners tonic does not serve: the HTTP check face and
//! the RESP face.
//!
//! One [`PublicTls`] (`--tls-cert`, `--tls-key`, `--tls-client-ca`) is the node's
//! identity towards its callers, so every face that gateways and clients reach (gRPC,
//! HTTP check, RESP) presents the same certificate and, with a client CA, demands the
//! same client certificates. A face left in the clear beside a mutual-TLS one would
//! answer whoever the other refuses: the same budgets, spent without a certificate.
//! The ops face is not a caller's face and stays as it is.
//!
//! [`PublicAcceptor`] is built once at start from the files read at start, with the
//! rules of tonic's acceptor for the gRPC face: rustls on the ring provider, TLS 1.2
//! and 1.3, and, with a client CA, a client certificate that CA signed required before
//! a byte of the protocol. Like the gRPC face's, it is never reloaded: new files take a
//! restart. [`ServerStream`] is one accepted connection: plaintext, or TLS whose
//! handshake runs when the connection is first read or written. The face's own bounds
//! (its connection cap and its first deadline) therefore hold the handshake too, and
//! an accept loop never waits on a client's handshake.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::config::PublicTls;

/// The ALPN protocol the HTTP check face speaks (it serves HTTP/1.1 only).
pub const ALPN_HTTP1: &[u8] = b"http/1.1";

/// The server side of the public face's TLS for one protocol, built once.
#[derive(Clone)]
pub struct PublicAcceptor {
    acceptor: tokio_rustls::TlsAcceptor,
}

impl std::fmt::Debug for PublicAcceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("PublicAcceptor").finish_non_exhaustive()
    }
}

impl PublicAcceptor {
    /// The acceptor presenting `tls`'s certificate, requiring a client certificate of
    /// its client CA when it has one, and offering `alpn` (empty: none, as Redis
    /// clients send none). An error names the flag whose file cannot be used.
    pub fn new(tls: &PublicTls, alpn: &[&[u8]]) -> Result<Self, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let certs = CertificateDer::pem_slice_iter(&tls.cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("public TLS: the --tls-cert file: {e}"))?;
        if certs.is_empty() {
            return Err("public TLS: the --tls-cert file holds no CERTIFICATE block".into());
        }
        let key = PrivateKeyDer::from_pem_slice(&tls.key_pem)
            .map_err(|e| format!("public TLS: the --tls-key file: {e}"))?;
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("public TLS: {e}"))?;
        let builder = match &tls.client_ca_pem {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(ca) {
                    let cert =
                        cert.map_err(|e| format!("public TLS: the --tls-client-ca file: {e}"))?;
                    roots
                        .add(cert)
                        .map_err(|e| format!("public TLS: the --tls-client-ca file: {e}"))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    roots.into(),
                    provider,
                )
                .build()
                .map_err(|e| format!("public TLS: the --tls-client-ca file: {e}"))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_single_cert(certs, key).map_err(|e| {
            format!(
                "public TLS: the --tls-key file is not usable with the --tls-cert certificate: {e}"
            )
        })?;
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(PublicAcceptor {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        })
    }

    /// `tcp` as a connection of a face with this TLS: its handshake runs on first use.
    pub fn stream(&self, tcp: TcpStream) -> ServerStream {
        ServerStream::Handshaking(Box::new(self.acceptor.accept(tcp)))
    }

    /// The handshake on `tcp`, run to its end (the caller bounds it in time).
    pub async fn handshake(
        &self,
        tcp: TcpStream,
    ) -> io::Result<tokio_rustls::server::TlsStream<TcpStream>> {
        self.acceptor.accept(tcp).await
    }
}

/// One connection of a public face: plaintext, or TLS (module doc).
pub enum ServerStream {
    /// No TLS on this face.
    Plain(TcpStream),
    /// TLS, handshake under way.
    Handshaking(Box<tokio_rustls::Accept<TcpStream>>),
    /// TLS, handshake done.
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
    /// The handshake failed: every read and write fails.
    Failed,
}

impl ServerStream {
    /// Drive the handshake, if one is under way, to its end.
    fn poll_handshake(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let ServerStream::Handshaking(accept) = self {
            match Pin::new(accept.as_mut()).poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(tls)) => *self = ServerStream::Tls(Box::new(tls)),
                Poll::Ready(Err(error)) => {
                    // A client without a certificate of the client CA, plaintext on a
                    // TLS port, a client that does not trust this node: its doing.
                    tracing::debug!(%error, "public TLS handshake refused");
                    *self = ServerStream::Failed;
                    return Poll::Ready(Err(error));
                }
            }
        }
        if let ServerStream::Failed = self {
            return Poll::Ready(Err(not_open()));
        }
        Poll::Ready(Ok(()))
    }
}

/// What a connection whose handshake failed answers every later read and write.
fn not_open() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "TLS handshake failed")
}

impl AsyncRead for ServerStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Err(error) = std::task::ready!(this.poll_handshake(cx)) {
            return Poll::Ready(Err(error));
        }
        match this {
            ServerStream::Plain(tcp) => Pin::new(tcp).poll_read(cx, buf),
            ServerStream::Tls(tls) => Pin::new(tls.as_mut()).poll_read(cx, buf),
            ServerStream::Handshaking(_) | ServerStream::Failed => Poll::Ready(Err(not_open())),
        }
    }
}

impl AsyncWrite for ServerStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Err(error) = std::task::ready!(this.poll_handshake(cx)) {
            return Poll::Ready(Err(error));
        }
        match this {
            ServerStream::Plain(tcp) => Pin::new(tcp).poll_write(cx, buf),
            ServerStream::Tls(tls) => Pin::new(tls.as_mut()).poll_write(cx, buf),
            ServerStream::Handshaking(_) | ServerStream::Failed => Poll::Ready(Err(not_open())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ServerStream::Plain(tcp) => Pin::new(tcp).poll_flush(cx),
            ServerStream::Tls(tls) => Pin::new(tls.as_mut()).poll_flush(cx),
            ServerStream::Handshaking(_) | ServerStream::Failed => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ServerStream::Plain(tcp) => Pin::new(tcp).poll_shutdown(cx),
            ServerStream::Tls(tls) => Pin::new(tls.as_mut()).poll_shutdown(cx),
            // Nothing of the protocol was said: closing the socket is the caller's drop.
            ServerStream::Handshaking(_) | ServerStream::Failed => Poll::Ready(Ok(())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate for `localhost` and its key, PEM.
    fn self_signed() -> (Vec<u8>, Vec<u8>) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (cert.pem().into_bytes(), key.serialize_pem().into_bytes())
    }

    #[test]
    fn the_acceptor_is_built_from_the_public_material_with_or_without_a_client_ca() {
        let (cert_pem, key_pem) = self_signed();
        let (ca_pem, _) = self_signed();
        for client_ca_pem in [None, Some(ca_pem)] {
            let tls = PublicTls {
                cert_pem: cert_pem.clone(),
                key_pem: key_pem.clone(),
                client_ca_pem,
            };
            for alpn in [&[ALPN_HTTP1][..], &[]] {
                let acceptor = PublicAcceptor::new(&tls, alpn).unwrap();
                assert_eq!(format!("{acceptor:?}"), "PublicAcceptor { .. }");
            }
        }
    }

    #[test]
    fn unusable_material_is_refused_naming_the_flag() {
        let (cert_pem, key_pem) = self_signed();
        let (_, other_key) = self_signed();
        let refused = |tls: PublicTls| PublicAcceptor::new(&tls, &[]).unwrap_err();
        let error = refused(PublicTls {
            cert_pem: cert_pem.clone(),
            key_pem: other_key,
            client_ca_pem: None,
        });
        assert!(error.contains("--tls-key"), "{error}");
        let error = refused(PublicTls {
            cert_pem: key_pem.clone(),
            key_pem: key_pem.clone(),
            client_ca_pem: None,
        });
        assert!(error.contains("--tls-cert"), "{error}");
        let error = refused(PublicTls {
            cert_pem: cert_pem.clone(),
            key_pem: cert_pem.clone(),
            client_ca_pem: None,
        });
        assert!(error.contains("--tls-key"), "{error}");
        // A client CA file without a certificate in it would trust nobody.
        let error = refused(PublicTls {
            cert_pem,
            key_pem: key_pem.clone(),
            client_ca_pem: Some(key_pem),
        });
        assert!(error.contains("--tls-client-ca"), "{error}");
    }
}
