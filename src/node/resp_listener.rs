//! The RESP face's listener (`--resp-listen`): accepts Redis clients up to the
//! connection cap and serves each on a task of its own
//! ([`crate::server::resp::serve_connection`]). A connection beyond
//! the cap is told `-ERR max number of clients reached` (what Redis says) and closed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::server::resp::{serve_connection, RespFace, RespLimits, RespToken};

/// The RESP face's settings (`serve --resp-listen` and its companions).
#[derive(Debug, Clone)]
pub struct RespConfig {
    /// Address to listen on (port 0 picks a free port).
    pub listen: SocketAddr,
    /// The password `AUTH` must present; `None`: every connection is served at once.
    pub token: Option<RespToken>,
    /// Per-connection and per-listener bounds.
    pub limits: RespLimits,
}

impl RespConfig {
    /// A face on `listen` with the default bounds and no token.
    pub fn on(listen: SocketAddr) -> Self {
        Self {
            listen,
            token: None,
            limits: RespLimits::default(),
        }
    }

    /// This face with the token in the first line of `path`.
    pub fn with_token_file(mut self, path: &std::path::Path) -> Result<Self, String> {
        self.token = Some(RespToken::from_file(path)?);
        Ok(self)
    }
}

/// How long open connections get to end after the node's stop begins.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Accept and serve Redis clients until `cancel` fires, then wait (at most
/// 5 s) for the connections to end.
pub async fn serve_resp(listener: TcpListener, face: RespFace, cancel: CancellationToken) {
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
        connections.spawn(
            async move {
                if let Err(end) = serve_connection(stream, &face, &cancel).await {
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
