//! `serve --envoy-xds ADDR`: Envoy domains from an xDS control plane (Envoy Gateway's, or
//! any serving envoyproxy/ratelimit's `RateLimitConfig`) instead of YAML files.
//!
//! The shell around [`XdsSession`]: connect, subscribe, feed every response to the
//! session, do what it says (swap the configuration in, then ACK; or NACK), and when the
//! control plane is away, reconnect with [`Backoff`] while the node keeps enforcing the
//! last configuration it accepted. Nothing here clears a domain: only a set the control
//! plane sends does. `wire` converts the messages, `stream` holds the tonic stream.

mod stream;
mod wire;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tonic::transport::Endpoint;

pub use stream::XdsTarget;
pub use wire::Identity;

use crate::cluster::rules::{hex, ClusterRules};
use crate::config::xds::{Backoff, XdsSession, XdsStep};
use crate::config::SharedEnvoy;
use stream::XdsConnection;

/// Why a stream to the control plane ended (the node reconnects after each).
#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    /// The address is not one a node can connect to.
    #[error("--envoy-xds {addr:?}: {reason}")]
    Address {
        /// As given.
        addr: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No connection (refused, unreachable, timed out).
    #[error("cannot connect: {0}")]
    Connect(String),
    /// Connected, but the stream was refused.
    #[error("the control plane refused the stream: {0}")]
    Refused(tonic::Status),
    /// The stream broke (connection lost, keepalive timed out, an error status).
    #[error("the stream broke: {0}")]
    Broken(tonic::Status),
    /// The control plane ended the stream.
    #[error("the control plane closed the stream")]
    Closed,
}

/// The endpoint of `addr` (`host:port`, or `http://host:port`): plaintext HTTP/2 with
/// keepalives, so a control plane that vanished without closing its connections is
/// noticed within `keepalive` plus its timeout.
pub fn endpoint(addr: &str, keepalive: Duration) -> Result<Endpoint, XdsError> {
    let bad = |reason: String| XdsError::Address {
        addr: addr.to_string(),
        reason,
    };
    let uri = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    if !uri.starts_with("http://") {
        return Err(bad(
            "only plaintext control planes (http://) are supported: TLS to the control plane is not implemented yet".into(),
        ));
    }
    Ok(Endpoint::from_shared(uri)
        .map_err(|e| bad(e.to_string()))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(keepalive)
        .keep_alive_timeout(keepalive)
        .keep_alive_while_idle(true))
}

/// Follows the control plane until `cancel`: every accepted set is stored in `envoy` and
/// advertised (digest and drift, as a reloaded `--envoy-config`), every refused one is
/// NACKed and leaves `envoy` as it was.
pub async fn follow(
    target: XdsTarget,
    algorithm: crate::algorithms::AlgorithmKind,
    backoff: Backoff,
    envoy: SharedEnvoy,
    rules: Arc<ClusterRules>,
    cancel: CancellationToken,
) {
    let mut session = XdsSession::new(algorithm, envoy.load().digest());
    let connected = metrics::gauge!("ringlimit_envoy_xds_connected");
    let failures_total = metrics::counter!("ringlimit_envoy_xds_stream_failures_total");
    let mut failures: u32 = 0;
    loop {
        let ended = tokio::select! {
            _ = cancel.cancelled() => return,
            ended = run_stream(&target, &mut session, &envoy, &rules, &mut failures) => ended,
        };
        connected.set(0.0);
        failures_total.increment(1);
        let wait = backoff.delay(failures, &target.identity.node_id);
        failures = failures.saturating_add(1);
        tracing::warn!(error = %ended, failures, retry_in_ms = wait.as_millis() as u64, version = %session.accepted_version(), "xDS control plane away; keeping the Envoy domains enforced");
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// One stream, from connecting to its end; `failures` is reset by the first response
/// (the control plane is back).
async fn run_stream(
    target: &XdsTarget,
    session: &mut XdsSession,
    envoy: &SharedEnvoy,
    rules: &ClusterRules,
    failures: &mut u32,
) -> XdsError {
    let connection = match XdsConnection::connect(target).await {
        Ok(connection) => connection,
        Err(error) => return error,
    };
    metrics::gauge!("ringlimit_envoy_xds_connected").set(1.0);
    let mut stream = match connection.subscribe(&session.subscribe()).await {
        Ok(stream) => stream,
        Err(error) => return error,
    };
    tracing::info!(version = %session.accepted_version(), "subscribed to the xDS control plane");
    loop {
        let response = match stream.recv().await {
            Ok(response) => response,
            Err(error) => return error,
        };
        *failures = 0;
        let answer = match session.on_response(response) {
            XdsStep::Apply { config, ack } => {
                let digest = config.digest();
                tracing::info!(version = %ack.version_info, domains = config.domains().count(), digest = %hex(digest), "envoy config received over xDS, applied");
                envoy.store(Arc::new(config));
                rules.envoy_file_loaded(digest);
                metrics::counter!("ringlimit_envoy_config_reloads_total", "result" => "ok")
                    .increment(1);
                updates("accepted");
                ack
            }
            XdsStep::Unchanged { ack } => {
                tracing::info!(version = %ack.version_info, "envoy config received over xDS, same domains as enforced");
                updates("accepted");
                ack
            }
            XdsStep::Reject { nack, message } => {
                tracing::error!(error = %message, "envoy config over xDS refused (NACK); keeping the current one");
                metrics::counter!("ringlimit_envoy_config_reloads_total", "result" => "error")
                    .increment(1);
                updates("rejected");
                nack
            }
            XdsStep::Ignore { type_url } => {
                tracing::warn!(%type_url, "xDS response of a type this node did not subscribe to; ignored");
                continue;
            }
        };
        if let Err(error) = stream.send(&answer).await {
            return error;
        }
    }
}

fn updates(result: &'static str) {
    metrics::counter!("ringlimit_envoy_xds_updates_total", "result" => result).increment(1);
}
