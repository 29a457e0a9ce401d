//! The RESP face's listener (`--resp-listen`): accepts Redis clients up to the
//! connection cap and serves each on a task of its own
//! ([`crate::server::resp::serve_connection`]), over the public face's TLS when the
//! node has one (`--tls-cert`, `node::public_tls`). A connection beyond the cap is
//! told `-ERR max number of clients reached` (what Redis says) and closed; under TLS
//! it is closed without a word.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use super::public_tls::PublicAcceptor;
use crate::server::resp::{serve_connection, ConnectionEnd, RespFace};

pub use super::config::RespConfig;

/// How long open connections get to end after the node's stop begins.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Accept and serve Redis clients until `cancel` fires, then wait (at most
/// 5 s) for the connections to end. With `tls` (the public face's, `--tls-cert`)
/// every connection must finish its TLS handshake within the request timeout, on the
/// slot it took from the cap, before a byte of RESP is read.
pub async fn serve_resp(
    listener: TcpListener,
    face: RespFace,
    tls: Option<PublicAcceptor>,
    cancel: CancellationToken,
) {
    let face = Arc::new(face);
    let slots = Arc::new(Semaphore::new(face.limits.max_connections));
    let connections = TaskTracker::new();
    let refused = metrics::counter!("ringlimit_resp_connections_refused_total");
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = cancel.cancelled() => break,
        };
        let (mut stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of descriptors or similar: wait a little rather than spin.
                tracing::warn!(%error, "RESP accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            refused.increment(1);
            if tls.is_some() {
                // No plaintext words on a TLS port: the client sees the close.
                continue;
            }
            connections.spawn(async move {
                let _ = tokio::time::timeout(
                    Duration::from_secs(1),
                    stream.write_all(b"-ERR max number of clients reached\r\n"),
                )
                .await;
            });
            continue;
        };
        let _ = stream.set_nodelay(true);
        let face = face.clone();
        let cancel = cancel.clone();
        let tls = tls.clone();
        connections.spawn(
            async move {
                let served = match tls {
                    None => serve_connection(stream, &face, &cancel).await,
                    Some(tls) => match handshake(&tls, stream, &face, &cancel).await {
                        Ok(Some(stream)) => serve_connection(stream, &face, &cancel).await,
                        Ok(None) => Ok(()),
                        Err(end) => Err(end),
                    },
                };
                if let Err(end) = served {
                    tracing::debug!(%peer, %end, "RESP connection closed");
                }
                drop(slot);
            }
            .in_current_span(),
        );
    }
    connections.close();
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, connections.wait()).await;
}

/// The TLS handshake of a RESP connection, within the face's request timeout: a client
/// that stalls it (a slowloris of the handshake) holds its slot no longer than one that
/// stalls a command. A refused handshake (no client certificate of the client CA,
/// plaintext on the TLS port) ends the connection before any command is read.
/// `None`: the node is stopping.
async fn handshake(
    tls: &PublicAcceptor,
    stream: tokio::net::TcpStream,
    face: &RespFace,
    cancel: &CancellationToken,
) -> Result<Option<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>, ConnectionEnd> {
    let handshake = tokio::time::timeout(face.limits.request_timeout, tls.handshake(stream));
    tokio::select! {
        done = handshake => match done {
            Ok(Ok(stream)) => Ok(Some(stream)),
            Ok(Err(error)) => Err(ConnectionEnd::Io(error)),
            Err(_) => Err(ConnectionEnd::TimedOut("in the TLS handshake")),
        },
        () = cancel.cancelled() => Ok(None),
    }
}
