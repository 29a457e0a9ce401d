//! The node's three faces, each a server on a listener of its own: the public gRPC face
//! (gateways; no authentication unless mutual TLS, optionally TLS, every per-client
//! bound set here), the cluster face
//! (the peer service only, every call proving the cluster key, optionally mutual TLS),
//! and the ops HTTP face (operators; rules writes need the admin token).

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::exporter::metrics_handle;
use super::ops_listener::OpsBounds;
use super::workers::relay::{relayed, RelayWakesLayer};
use super::{grpc, GrpcLimits, NodeConfig, NodeError, MAX_MESSAGE_BYTES};
use crate::check::Checker;
use crate::cluster::link::frames;
use crate::cluster::rules::ClusterRules;
use crate::cluster::Router;
use crate::proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use crate::proto::gubernator::v1_server::V1Server;
use crate::proto::peer::peer_server::PeerServer;
use crate::proto::v1_server::rate_limiter_server::RateLimiterServer;
use crate::server::answer_budget::{AnswerBudget, HoldUntilSentLayer};
use crate::server::ops::OpsState;
use crate::server::peer::frames::{serve_frames, FramesFace};
use crate::server::peer_auth::PeerAuthLayer;
use crate::server::{EnvoyRlsService, GubernatorService, PeerService, RateLimitService};

/// The services of the public face over one checker: `ringlimit.v1` and Gubernator
/// (when asked for) share one budget of unsent bulk answers; Envoy RLS answers one
/// request at a time.
pub fn public_services(config: &NodeConfig, checker: Checker) -> PublicServices {
    // One budget of unsent bulk answers for every bulk front end of the node.
    let answers = AnswerBudget::new(config.grpc.max_unsent_answer_items);
    let public = RateLimitService::new(checker.clone()).with_answer_budget(answers.clone());
    // Gubernator's face only on request: its callers choose their own limits.
    let gubernator = config
        .gubernator
        .then(|| GubernatorService::new(checker.clone()).with_answer_budget(answers));
    let envoy_rls = EnvoyRlsService::new(checker).with_headers(config.envoy_headers);
    PublicServices {
        public,
        envoy_rls,
        gubernator,
        tls: config.public_tls.as_ref().map(grpc::public_server_tls),
    }
}

/// The check services of the public face (cloned for each worker's listener: the
/// clones share one answer budget).
#[derive(Clone)]
pub struct PublicServices {
    /// `ringlimit.v1`.
    public: RateLimitService,
    /// Envoy's RLS v3.
    envoy_rls: EnvoyRlsService,
    /// Gubernator's V1, only when asked for (`--gubernator`).
    gubernator: Option<GubernatorService>,
    /// TLS for every one of them (`--tls-cert`, `--tls-key`), with client
    /// certificates required when `--tls-client-ca` is given; `None`: plaintext.
    tls: Option<tonic::transport::ServerTlsConfig>,
}

/// What the ops face serves from: the rules authority, the router's view, the admin
/// token and the metrics.
pub fn ops_state(
    config: &NodeConfig,
    cluster_rules: &Arc<ClusterRules>,
    router: &Arc<Router>,
) -> OpsState {
    OpsState {
        rules: cluster_rules.clone(),
        router: router.clone(),
        admin: config.admin_token.clone(),
        max_rules_bytes: config.max_rules_bytes,
        metrics: Arc::new(|| metrics_handle().render()),
        expects_peers: !config.seeds.is_empty(),
    }
}

/// The public face: `ringlimit.v1`, Envoy's RLS v3, Gubernator's V1 when asked for,
/// health, and reflection (v1 and v1alpha) of those services only, over TLS (and mutual
/// TLS) when configured. Returns the server task for the caller's tracker.
///
/// Every bound on what one client can make this server hold is set here (README
/// "Flags and metrics"); the accept loop, the connection cap and the handshake timeout
/// are in [`grpc::incoming`]. `slots` are the face's connection slots, shared by every
/// worker's listener.
pub async fn serve_public(
    listener: TcpListener,
    services: PublicServices,
    limits: &GrpcLimits,
    slots: Arc<Semaphore>,
    cancel: CancellationToken,
) -> Result<impl std::future::Future<Output = ()>, NodeError> {
    let PublicServices {
        public,
        envoy_rls,
        gubernator,
        tls,
    } = services;
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<RateLimiterServer<RateLimitService>>()
        .await;
    health
        .set_serving::<RateLimitServiceServer<EnvoyRlsService>>()
        .await;
    if gubernator.is_some() {
        health.set_serving::<V1Server<GubernatorService>>().await;
    }
    let served_gubernator = gubernator.is_some();
    // Both reflection versions: grpcurl and newer tools speak v1; the stock Python
    // client (grpcio-reflection), older grpcurl, Postman and grpcui only v1alpha.
    let reflection = || {
        let builder = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::PUBLIC_FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
        if served_gubernator {
            builder
                .register_encoded_file_descriptor_set(crate::proto::GUBERNATOR_FILE_DESCRIPTOR_SET)
        } else {
            builder
        }
    };
    let reflection_v1 = reflection()
        .build_v1()
        .map_err(|e| NodeError::Reflection(e.to_string()))?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(|e| NodeError::Reflection(e.to_string()))?;
    let max = MAX_MESSAGE_BYTES;
    let mut builder = grpc::limited(limits);
    if let Some(tls) = tls {
        // Validated at start (`NodeConfig::validate`); never serve the face in the
        // clear when TLS was asked for.
        builder = builder
            .tls_config(grpc::with_handshake_timeout(tls, limits))
            .map_err(|e| NodeError::Config(format!("public TLS: {e}")))?;
    }
    let server = builder
        // Outermost: a request on a multi-worker node is woken through its worker's
        // relay (`node::workers::relay`), whatever it waits for.
        .layer(RelayWakesLayer)
        .layer(grpc::StatusMappingLayer)
        .layer(HoldUntilSentLayer)
        .add_service(health_service.max_decoding_message_size(max))
        .add_service(reflection_v1.max_decoding_message_size(max))
        .add_service(reflection_v1alpha.max_decoding_message_size(max))
        .add_service(RateLimiterServer::new(public).max_decoding_message_size(max))
        .add_service(RateLimitServiceServer::new(envoy_rls).max_decoding_message_size(max))
        .add_optional_service(gubernator.map(|g| V1Server::new(g).max_decoding_message_size(max)))
        .serve_with_incoming_shutdown(
            grpc::incoming_sharing(listener, limits, slots),
            cancel.clone().cancelled_owned(),
        );
    let grace = limits.shutdown_grace;
    Ok(async move {
        if let Some(Err(error)) = within_grace(server, &cancel, grace, "public").await {
            tracing::error!(%error, "public gRPC server failed");
            cancel.cancel();
        }
    })
}

/// Runs a gRPC server whose graceful shutdown starts when `cancel` fires, until it ends
/// or `grace` after that, whichever is first (`None`: the grace ran out). tonic waits for
/// every connection to close, and one a client holds open (a stream whose answers it
/// never reads, so its last bytes never leave) would otherwise hold the node's stop
/// until that connection's maximum age. Connections still open are then no longer
/// waited for; they end with the process.
async fn within_grace<F: std::future::Future>(
    server: F,
    cancel: &CancellationToken,
    grace: Duration,
    face: &'static str,
) -> Option<F::Output> {
    let grace_over = async {
        cancel.cancelled().await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        done = server => Some(done),
        () = grace_over => {
            tracing::warn!(
                face,
                grace_ms = grace.as_millis() as u64,
                "connections still open after the shutdown grace; stopping without them"
            );
            None
        }
    }
}

/// The cluster face: the peer service alone, on its own listener, with the same
/// limits, every call checked for the cluster key's proof before it is served, and
/// with `tls` every connection for a certificate of the cluster CA before that.
/// Messages up to `peer_message_cap` bytes are decoded
/// ([`peer_message_cap`](super::config::peer_message_cap)): a forwarded rules write
/// carries a whole document. `slots` are the face's connection slots, shared by every
/// worker's listener.
pub fn serve_peer(
    listener: TcpListener,
    peer: PeerService,
    tls: Option<tonic::transport::ServerTlsConfig>,
    config: &NodeConfig,
    slots: Arc<Semaphore>,
    cancel: CancellationToken,
) -> impl std::future::Future<Output = ()> + use<> {
    let auth = PeerAuthLayer::new(config.cluster_key.clone());
    let cap = crate::node::config::peer_message_cap(config.max_rules_bytes);
    let limits = config.grpc.clone();
    serve_peer_with(listener, peer, auth, tls, limits, slots, cap, cancel)
}

#[allow(clippy::too_many_arguments)] // the pieces serve_peer takes apart
async fn serve_peer_with(
    listener: TcpListener,
    peer: PeerService,
    auth: PeerAuthLayer,
    tls: Option<tonic::transport::ServerTlsConfig>,
    limits: GrpcLimits,
    slots: Arc<Semaphore>,
    peer_message_cap: usize,
    cancel: CancellationToken,
) {
    let mut builder = grpc::limited(&limits);
    let tls_on = tls.is_some();
    if let Some(tls) = tls {
        builder = match builder.tls_config(grpc::with_handshake_timeout(tls, &limits)) {
            Ok(builder) => builder,
            Err(error) => {
                // Checked at start (`grpc::check_tls`); never serve the face in the clear.
                tracing::error!(%error, "peer TLS configuration refused; stopping");
                cancel.cancel();
                return;
            }
        };
    }
    let accepted = grpc::incoming_sharing(listener, &limits, slots);
    // Without peer TLS the face also serves framed connections (the lean transport of
    // forwarded batches, `server::peer::frames`), told apart by their first byte; with
    // it, every connection is TLS and HTTP/2, so mutual TLS is never bypassed.
    let incoming: std::pin::Pin<Box<dyn futures_util::Stream<Item = _> + Send>> = if tls_on {
        Box::pin(accepted)
    } else {
        let face = FramesFace {
            service: Arc::new(peer.clone()),
            auth: auth.clone(),
            max_frame: peer_message_cap,
            handshake: limits.handshake_timeout,
            idle: limits.keepalive_interval + limits.keepalive_timeout,
        };
        Box::pin(sort_peer_connections(accepted, face, cancel.clone()))
    };
    let server = builder
        .layer(RelayWakesLayer)
        .layer(auth)
        .add_service(PeerServer::new(peer).max_decoding_message_size(peer_message_cap))
        .serve_with_incoming_shutdown(incoming, cancel.clone().cancelled_owned());
    if let Some(Err(error)) = within_grace(server, &cancel, limits.shutdown_grace, "peer").await {
        tracing::error!(%error, "peer gRPC server failed");
        cancel.cancel();
    }
}

/// The peer face's accepted connections for tonic, with the framed ones taken out and
/// served by a task each: a connection whose first byte is the frames magic's goes to
/// [`serve_frames`]; any other to tonic; one that sends nothing within the handshake
/// timeout is closed. Sorting runs per connection, so a silent one holds up no other.
fn sort_peer_connections(
    accepted: impl futures_util::Stream<Item = Result<grpc::Conn, std::io::Error>> + Send + 'static,
    face: FramesFace,
    cancel: CancellationToken,
) -> impl futures_util::Stream<Item = Result<grpc::Conn, std::io::Error>> + Send + 'static {
    use futures_util::StreamExt;
    let (to_tonic, for_tonic) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let mut accepted = std::pin::pin!(accepted);
        loop {
            let conn = tokio::select! {
                _ = cancel.cancelled() => return,
                conn = accepted.next() => match conn {
                    Some(Ok(conn)) => conn,
                    Some(Err(_)) => continue,
                    None => return,
                },
            };
            let (to_tonic, face) = (to_tonic.clone(), face.clone());
            tokio::spawn(async move {
                let first = tokio::time::timeout(face.handshake, conn.peek_first()).await;
                match first {
                    Ok(Ok(Some(byte))) if byte == frames::MAGIC[0] => {
                        let conn = conn.without_preface_deadline();
                        let ended = relayed(serve_frames(conn, face)).await;
                        tracing::debug!(%ended, "framed peer connection ended");
                    }
                    Ok(Ok(Some(_))) => {
                        let _ = to_tonic.send(Ok(conn)).await;
                    }
                    // Closed, failed or silent: dropping it closes it and frees its slot.
                    _ => {}
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(for_tonic)
}

/// The ops face: `/metrics`, health, the cluster and owner views and the rules API over
/// HTTP, bounded by [`OpsBounds`] (a connection cap that closes the connection waiting
/// longest for a request first, a header timeout, a maximum age: `node::ops_listener`);
/// the exporter's upkeep runs beside it.
pub async fn serve_ops(listener: TcpListener, state: OpsState, cancel: CancellationToken) {
    let handle = metrics_handle();
    let app = crate::server::ops::routes(state);
    let upkeep = {
        let cancel = cancel.clone();
        async move {
            // The exporter's histograms need periodic upkeep to drain their buffers.
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tick.tick() => handle.run_upkeep(),
                }
            }
        }
    };
    let server = axum::serve(
        super::ops_listener::BoundedListener::new(listener, OpsBounds::default()),
        app,
    )
    .with_graceful_shutdown(cancel.clone().cancelled_owned());
    let (result, ()) = tokio::join!(server, upkeep);
    if let Err(error) = result {
        tracing::error!(%error, "ops HTTP server failed");
    }
}

/// The HTTP check face (`server::http_check`): JSON checks and gateways' forward-auth
/// on a listener of its own, with no authentication unless mutual TLS (like the public
/// gRPC face, and with its TLS: `tls`) and the ops listener's bounds at this face's
/// values: a connection cap that closes the connection waiting longest for a request
/// first, a head size cap, a header timeout (which a TLS handshake is held to as well)
/// and a maximum age; the body bound and timeout are the adapter's.
pub async fn serve_check_http(
    listener: TcpListener,
    config: super::config::CheckHttpConfig,
    tls: Option<super::public_tls::PublicAcceptor>,
    checker: Checker,
    cancel: CancellationToken,
) {
    let state = crate::server::http_check::HttpCheckState::new(checker, config.forward_auth)
        .with_body_bounds(config.max_body_bytes, config.body_timeout);
    let app = crate::server::http_check::routes(state)
        .into_make_service_with_connect_info::<crate::server::http_check::PeerAddr>();
    let bounds = OpsBounds {
        max_connections: config.max_connections,
        max_age: config.max_connection_age,
        header_timeout: config.header_timeout,
        max_head_bytes: config.max_head_bytes,
        closed_metric: "ringlimit_http_check_connections_closed_total",
    };
    let server = axum::serve(
        super::ops_listener::BoundedListener::new(listener, bounds).with_tls(tls),
        app,
    )
    .with_graceful_shutdown(cancel.cancelled_owned());
    if let Err(error) = server.await {
        tracing::error!(%error, "check HTTP server failed");
    }
}

impl
    axum::extract::connect_info::Connected<
        axum::serve::IncomingStream<'_, super::ops_listener::BoundedListener>,
    > for crate::server::http_check::PeerAddr
{
    fn connect_info(
        stream: axum::serve::IncomingStream<'_, super::ops_listener::BoundedListener>,
    ) -> Self {
        crate::server::http_check::PeerAddr(*stream.remote_addr())
    }
}
