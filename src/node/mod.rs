//! The composition root: the one place that knows every subsystem.
//!
//! [`start`] runs the node's start as named steps: load the rules, bind the three
//! listeners, start membership, spawn the shards, build the peer link, router and
//! handoff, then serve three faces on three listeners: the public gRPC server, the peer
//! server (signed calls only) and the ops HTTP port (admin token for rules writes). It
//! returns a [`RunningNode`] with the bound addresses (tests start nodes on port 0).
//! [`run`] is what `ringlimit serve` calls: start, wait for the caller's shutdown
//! token, drain.
//!
//! - `config`: the node's settings; `snapshot`: counter snapshots in `--data-dir`;
//!   `grpc`: what one client can make a gRPC listener hold; `faces`: the three
//!   servers; `resp_listener`: the RESP face for Redis clients (`--resp-listen`, off
//!   by default); `public_tls`: the public face's TLS on the HTTP check and RESP
//!   listeners; `rules`: rules at start and their watchers; `exporter`: the
//!   Prometheus recorder and metric descriptions.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

pub mod config;
mod exporter;
mod faces;
pub mod grpc;
mod ops_listener;
mod public_tls;
pub mod resp_listener;
mod rules;
pub mod snapshot;
mod workers;
mod xds;

use crate::check::Checker;
use crate::clock::{Clock, SystemClock};
use crate::cluster::deny_cache::DenyCache;
use crate::cluster::handoff::Handoff;
use crate::cluster::link::{ForwardConfig, PeerPool};
use crate::cluster::replication::{self, Replicator, Restore};
use crate::cluster::rules::ClusterRules;
use crate::cluster::{Decider, Inherited, InlineRules, Router};
use crate::config::rules::envoy::EnvoyConfigError;
use crate::config::rules::{RuleFile, RulesError, StoreError};
use crate::config::{SharedEnvoy, SharedRules};
use crate::membership::{ClusterView, Membership};
use crate::server::{PeerService, RateLimitService};
use crate::shard::{ShardConfig, Shards};
pub use config::{GrpcLimits, NodeConfig, MAX_MESSAGE_BYTES};
pub use exporter::metrics_handle;
pub use ops_listener::{MAX_OPS_CONNECTIONS, MAX_OPS_CONNECTION_AGE, OPS_HEADER_TIMEOUT};
use rules::StartRules;
use workers::Workers;

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A setting is out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A listener could not bind.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The rule file is missing or invalid at start (a running node keeps its rules
    /// on a bad reload instead).
    #[error("rules: {0}")]
    Rules(RulesError),
    /// The Envoy configuration is missing or invalid at start.
    #[error("{0}")]
    Envoy(EnvoyConfigError),
    /// The stored cluster rule set in `--data-dir` is unreadable or invalid.
    #[error("stored rules: {0}")]
    StoredRules(StoreError),
    /// gRPC reflection could not read our descriptor set.
    #[error("reflection: {0}")]
    Reflection(String),
    /// Gossip membership could not start.
    #[error("membership: {0}")]
    Membership(String),
    /// Gossip stopped on its own while serving (its socket broke): the node stopped
    /// rather than decide by a cluster view nobody updates any more.
    #[error("gossip stopped unexpectedly; the node stopped (restart it)")]
    GossipStopped,
}

/// A started node.
pub struct RunningNode {
    /// The bound gRPC address.
    pub grpc_addr: SocketAddr,
    /// The bound peer service address (the cluster face).
    pub peer_addr: SocketAddr,
    /// The bound ops HTTP address (`/metrics`, health, the rules API), if any.
    pub http_addr: Option<SocketAddr>,
    /// The same address, by the name of its `/metrics` endpoint.
    pub metrics_addr: Option<SocketAddr>,
    /// The bound gossip address (give it to other nodes as a seed).
    pub gossip_addr: SocketAddr,
    /// The bound HTTP check face (`--check-http-listen`), if served.
    pub check_http_addr: Option<SocketAddr>,
    /// Who this node says decided.
    pub decider: Decider,
    /// The bound RESP address (`--resp-listen`), if the face is served.
    pub resp_addr: Option<SocketAddr>,
    /// The node's shard actors (tests inspect key counts through it).
    pub shards: Shards,
    /// The live rule set.
    pub rules: SharedRules,
    /// The rules authority: version, source, adverts, writes.
    pub cluster_rules: Arc<ClusterRules>,
    /// The routing layer (cluster view, forwarding).
    pub router: Arc<Router>,
    membership: Membership,
    handoff: Handoff,
    leave_settle: Duration,
    /// Counter snapshots in `--data-dir`, when written: a leave writes one last.
    snapshots: Option<snapshot::Snapshots>,
    /// The node's span: its background tasks run in it, and so does its leave.
    span: tracing::Span,
    cancel: CancellationToken,
    tracker: TaskTracker,
    /// The worker threads (thread-per-core); declared last, so they stop after
    /// everything above is dropped.
    workers: Workers,
}

impl std::fmt::Debug for RunningNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningNode")
            .field("node_id", &self.decider.node_id)
            .field("grpc_addr", &self.grpc_addr)
            .field("peer_addr", &self.peer_addr)
            .field("gossip_addr", &self.gossip_addr)
            .field("workers", &self.workers.len())
            .finish()
    }
}

impl RunningNode {
    /// The public `ringlimit.v1` service over this node's router, for calling it
    /// in-process (the allocation benchmark) without a gRPC client.
    pub fn public_service(&self) -> RateLimitService {
        RateLimitService::new(self.checker())
    }

    /// The wire-independent check layer over this node's router and rules.
    pub fn checker(&self) -> Checker {
        Checker::new(self.router.clone(), self.rules.clone())
    }

    /// The current cluster view as this node sees it.
    pub fn view(&self) -> Arc<ClusterView> {
        self.router.view()
    }

    /// Whether this node answers as owner yet (its restore after a start with seeds is
    /// over; `/readyz` says the same).
    pub fn restored(&self) -> bool {
        self.router.restored()
    }

    /// Stop at once, without telling anyone: to the cluster this looks like a crash
    /// (its keys restart from empty on their new owners).
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.membership.shutdown().await;
        self.tracker.close();
        self.tracker.wait().await;
    }

    /// Leave gracefully: announce leaving (every ring drops this node, its own too),
    /// keep answering while the cluster converges, push the state of every key it
    /// holds to the key's new owner, then stop. Nothing is lost.
    pub async fn leave(self) {
        let span = self.span.clone();
        self.leave_in_span().instrument(span).await
    }

    async fn leave_in_span(self) {
        tracing::info!(node_id = %self.decider.node_id, "leaving: announcing and handing state over");
        // The newest counts on disk first: if every node is stopped at once (a
        // StatefulSet deleted), nobody is left to hand them to. What the handoff moves
        // meanwhile is joined with this copy after a restart, never added to it.
        if let Some(snapshots) = &self.snapshots {
            if let Err(error) = snapshots.write().await {
                tracing::warn!(%error, "last snapshot before leaving not written");
            }
        }
        self.membership.announce_leaving().await;
        // The handoff watcher pushes as soon as our own ring drops us; checks that
        // peers forward to us before they converge are still decided here, so push
        // once more after the settle time to catch the keys they touched.
        tokio::time::sleep(self.leave_settle).await;
        let view = self.router.view();
        let installed = self.handoff.push_away(&view).await;
        // Checks forwarded here during the settle time were decided on the handed-over
        // counts; their admissions go to the new owners as a last delta.
        let late = self.handoff.flush_once(&view).await;
        tracing::info!(node_id = %self.decider.node_id, installed, late, "left the cluster");
        self.shutdown().await;
    }

    /// Wait until `cancel` fires, then leave gracefully. If gossip stops on its own
    /// first, stop at once (like a crash: a leave cannot be announced without gossip)
    /// and say so.
    pub async fn serve_until(self, cancel: CancellationToken) -> Result<(), NodeError> {
        let gossip_stopped = self.membership.gossip_stopped();
        tokio::select! {
            _ = cancel.cancelled() => self.leave().await,
            _ = self.cancel.cancelled() => self.shutdown().await,
            _ = gossip_stopped.cancelled() => {
                tracing::error!(node_id = %self.decider.node_id, "gossip stopped unexpectedly: stopping this node");
                self.shutdown().await;
                return Err(NodeError::GossipStopped);
            }
        }
        Ok(())
    }
}

/// Start a node with the system clock, call `on_ready` once it serves (the binary
/// prints its ready line there); when `shutdown` is cancelled it leaves the cluster
/// gracefully (state handed over) and stops.
pub async fn run(
    config: NodeConfig,
    shutdown: CancellationToken,
    on_ready: impl FnOnce(&RunningNode),
) -> Result<(), NodeError> {
    // A serving process may hold up to --max-connections sockets: the default soft
    // limit (often 1024) would otherwise bound it first.
    if let Some(nofile) = grpc::raise_fd_limit() {
        // Beyond the connections: listeners, gossip, peer channels, the rule file.
        let needed = config.grpc.max_connections as u64 + 256;
        if nofile < needed {
            tracing::warn!(
                nofile,
                max_connections = config.grpc.max_connections,
                "file descriptor limit below --max-connections + 256: accepts will fail (and back off) before the connection cap is reached"
            );
        }
    }
    let node = start_with_clock(config, Arc::new(SystemClock), CancellationToken::new()).await?;
    on_ready(&node);
    tracing::info!(
        node_id = %node.decider.node_id,
        grpc = %node.grpc_addr,
        peer = %node.peer_addr,
        gossip = %node.gossip_addr,
        http = %node.http_addr.map_or("-".to_string(), |a| a.to_string()),
        "ringlimit node serving"
    );
    let served = node.serve_until(shutdown).await;
    tracing::info!("ringlimit node stopped");
    served
}

/// Start a node with the system clock.
pub async fn start(config: NodeConfig) -> Result<RunningNode, NodeError> {
    start_with_clock(config, Arc::new(SystemClock), CancellationToken::new()).await
}

/// Start a node reading time from `clock` (tests pass a `ManualClock`).
///
/// Everything the node runs in the background runs inside a `node{id=…}` span, so with
/// several nodes in one process (`dev-cluster`, tests) each log line says which node
/// logged it.
pub async fn start_with_clock(
    config: NodeConfig,
    clock: Arc<dyn Clock>,
    cancel: CancellationToken,
) -> Result<RunningNode, NodeError> {
    let span = tracing::info_span!("node", id = %config.node_id);
    start_in_span(config, clock, cancel).instrument(span).await
}

/// Refuse a configuration the node cannot run with: its values, then the public
/// face's certificate, key and CA, built once so that files that cannot be used stop
/// the node here rather than at the first handshake.
fn validate(config: &NodeConfig) -> Result<(), NodeError> {
    config.validate().map_err(NodeError::Config)?;
    if let Some(tls) = &config.public_tls {
        grpc::check_public_tls(tls).map_err(NodeError::Config)?;
    }
    Ok(())
}

/// [`start_with_clock`] inside the node's span: the start, step by step.
async fn start_in_span(
    config: NodeConfig,
    clock: Arc<dyn Clock>,
    cancel: CancellationToken,
) -> Result<RunningNode, NodeError> {
    validate(&config)?;
    // Install the recorder before any metric handle is created: handles made
    // earlier would be bound to the no-op recorder for good.
    metrics_handle();
    let StartRules {
        cluster_rules,
        rules,
        envoy,
        rule_file,
    } = rules::load(&config)?;
    // The public face's TLS on the listeners tonic does not serve, built before anything
    // starts (HTTP/1.1 by ALPN; Redis clients offer none).
    let check_http_tls = public_acceptor(&config, &[public_tls::ALPN_HTTP1])?;
    let resp_tls = public_acceptor(&config, &[])?;
    let workers = Workers::start(config.workers, &config.node_id)?;
    let listeners = Listeners::bind(&config, workers.len()).await?;
    let check_http = match &config.check_http {
        Some(face) => Some((bind(face.listen).await?, face.clone())),
        None => None,
    };
    let check_http_addr = check_http.as_ref().and_then(|(l, _)| l.local_addr().ok());
    let tracker = TaskTracker::new();
    let decider = Decider {
        node_id: Arc::from(config.node_id.as_str()),
        generation: crate::membership::generation_now(),
    };
    let membership = start_membership(&config, &decider, &listeners, &cancel).await?;
    let (shards, lease_returns) = spawn_shards(&config, &clock, &workers, &tracker, &cancel);
    // Before any face serves: the node answers as owner from its snapshot, not empty.
    let snapshots = snapshots(&config, &shards, &rules, &envoy, &membership, &clock);
    let seen = match &snapshots {
        Some(snapshots) => snapshots.load().await.members(),
        None => Vec::new(),
    };
    let (forward, peer_tls) = peer_link_settings(&config, listeners.peer_addr)?;
    // Gubernator's inline rules: one registry per node, for the checker (what callers
    // send), the peer service (what peers forward), the peer pool (handed-over counters).
    let inline_rules = Arc::new(InlineRules::default());
    let peers = PeerPool::new(
        decider.node_id.clone(),
        forward,
        tracker.clone(),
        cancel.clone(),
    )
    .with_inline(inline_rules.clone());
    spawn_rules_sync(&cluster_rules, &membership, &peers, &tracker, &cancel);
    let (router, handoff, replicator) =
        start_routing(&config, &decider, &shards, &membership, peers, clock);
    if let Some((replicator, _)) = &replicator {
        replicator.remember_members(&seen);
    }
    if let Some(snapshots) = &snapshots {
        let every = config.snapshot_interval;
        spawn_in_span(&tracker, snapshots.clone().run(every, cancel.clone()));
    }
    spawn_lease_returns(lease_returns, &router, &tracker, &cancel);
    spawn_handoff(&handoff, &membership, &tracker, &cancel);
    spawn_replication(&config, &replicator, &membership, &tracker, &cancel);
    spawn_watchers(
        &config,
        rule_file,
        &cluster_rules,
        &envoy,
        &tracker,
        &cancel,
    );

    // Three faces on three listeners: the security boundaries of the node.
    // The ops face: HTTP for operators and orchestrators; rules writes need the admin
    // token (none configured: refused).
    if let Some(listener) = listeners.http {
        let ops = faces::ops_state(&config, &cluster_rules, &router);
        spawn_in_span(&tracker, faces::serve_ops(listener, ops, cancel.clone()));
    }
    // The public face is what gateways reach: the check services, health and reflection
    // of those services only, with no authentication and every per-client bound.
    let checker = Checker::new(router.clone(), rules.clone())
        .with_envoy(envoy.clone())
        .with_inline(inline_rules.clone());
    // The HTTP check face: the same checks over HTTP/1.1 (JSON, and gateways'
    // forward-auth), on a listener of its own, never the ops port. It and the RESP face
    // speak the public face's TLS when the node has one (`public_tls`): one certificate
    // per node, and no face in the clear beside a mutual-TLS one.
    if let Some((listener, face)) = check_http {
        let served = faces::serve_check_http(
            listener,
            face,
            check_http_tls,
            checker.clone(),
            cancel.clone(),
        );
        spawn_in_span(&tracker, served);
    }
    // The RESP face, when asked for: Redis clients' CL.THROTTLE on the same seam.
    if let (Some(listener), Some(resp)) = (listeners.resp, &config.resp) {
        let face = crate::server::resp::RespFace {
            checker: checker.clone(),
            token: resp.token.clone(),
            limits: resp.limits.clone(),
        };
        spawn_in_span(
            &tracker,
            resp_listener::serve_resp(listener, face, resp_tls, cancel.clone()),
        );
    }
    let services = faces::public_services(&config, checker);
    spawn_public(
        listeners.grpc,
        services,
        &config,
        &workers,
        &tracker,
        &cancel,
    )
    .await?;
    // The cluster face is the peer service alone (forwarded checks, refunds, handoff,
    // status) on a listener of its own, so it can be bound to a private network; every
    // call proves the cluster key, and with peer TLS every connection a certificate.
    let peer_service = PeerService::new(router.clone(), rules.clone(), cluster_rules.clone())
        .with_envoy(envoy)
        .with_inline(inline_rules)
        .with_shutdown(cancel.clone())
        .with_replicator(replicator.map(|(replicator, _)| replicator));
    let peer_face = (peer_service, peer_tls);
    spawn_peer(
        listeners.peer,
        peer_face,
        &config,
        &workers,
        &tracker,
        &cancel,
    );

    Ok(RunningNode {
        grpc_addr: listeners.grpc_addr,
        peer_addr: listeners.peer_addr,
        http_addr: listeners.http_addr,
        metrics_addr: listeners.http_addr,
        check_http_addr,
        gossip_addr: membership.gossip_addr(),
        resp_addr: listeners.resp_addr,
        decider,
        shards,
        rules,
        cluster_rules,
        router,
        membership,
        handoff,
        leave_settle: config.leave_settle,
        snapshots,
        span: tracing::Span::current(),
        cancel,
        tracker,
        workers,
    })
}

/// The public face on every worker's listener (thread-per-core), one connection cap
/// over all of them: the first here, the others moved to their workers.
async fn spawn_public(
    listeners: Vec<TcpListener>,
    services: faces::PublicServices,
    config: &NodeConfig,
    workers: &Workers,
    tracker: &TaskTracker,
    cancel: &CancellationToken,
) -> Result<(), NodeError> {
    let slots = grpc::connection_slots(&config.grpc);
    let mut public = listeners.into_iter();
    let here = public.next().expect("one listener per worker");
    let served = faces::serve_public(
        here,
        services.clone(),
        &config.grpc,
        slots.clone(),
        cancel.clone(),
    );
    spawn_in_span(tracker, served.await?);
    for (listener, runtime) in public.zip(&workers.handles()[1..]) {
        let (services, limits, slots, cancel) = (
            services.clone(),
            config.grpc.clone(),
            slots.clone(),
            cancel.clone(),
        );
        let face = on_worker(listener, cancel.clone(), move |listener| async move {
            match faces::serve_public(listener, services, &limits, slots, cancel.clone()).await {
                Ok(served) => served.await,
                Err(error) => {
                    tracing::error!(%error, "public face on a worker failed to start");
                    cancel.cancel();
                }
            }
        });
        tracker.spawn_on(face.in_current_span(), runtime);
    }
    Ok(())
}

/// The cluster face (the peer service and its TLS) on every worker's peer listener,
/// one connection cap over all of them.
fn spawn_peer(
    listeners: Vec<TcpListener>,
    (peer_service, peer_tls): (PeerService, Option<tonic::transport::ServerTlsConfig>),
    config: &NodeConfig,
    workers: &Workers,
    tracker: &TaskTracker,
    cancel: &CancellationToken,
) {
    let slots = grpc::connection_slots(&config.grpc);
    let mut peer = listeners.into_iter();
    let here = peer.next().expect("one listener per worker");
    let peer_face = faces::serve_peer(
        here,
        peer_service.clone(),
        peer_tls.clone(),
        config,
        slots.clone(),
        cancel.clone(),
    );
    spawn_in_span(tracker, peer_face);
    for (listener, runtime) in peer.zip(&workers.handles()[1..]) {
        let (peer_service, peer_tls, config, slots, cancel) = (
            peer_service.clone(),
            peer_tls.clone(),
            config.clone(),
            slots.clone(),
            cancel.clone(),
        );
        let face = on_worker(listener, cancel.clone(), move |listener| {
            faces::serve_peer(listener, peer_service, peer_tls, &config, slots, cancel)
        });
        tracker.spawn_on(face.in_current_span(), runtime);
    }
}

/// A face's server on another worker: the listener moves to that worker's runtime
/// (bound here, registered with the worker's reactor there), then `serve` runs on it.
fn on_worker<S, F>(
    listener: TcpListener,
    cancel: CancellationToken,
    serve: S,
) -> impl std::future::Future<Output = ()> + Send + 'static
where
    S: FnOnce(TcpListener) -> F + Send + 'static,
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let moved = listener.into_std();
    async move {
        match moved.and_then(TcpListener::from_std) {
            Ok(listener) => serve(listener).await,
            Err(error) => {
                tracing::error!(%error, "cannot move a listener to its worker");
                cancel.cancel();
            }
        }
    }
}

/// The node's three listeners, bound before anything runs (a taken port fails the
/// start), and the addresses peers are told.
struct Listeners {
    /// The public face: one listener per worker, all on one address.
    grpc: Vec<TcpListener>,
    grpc_addr: SocketAddr,
    /// The gRPC address peers and clients are told (`--advertise`).
    advertise: SocketAddr,
    /// The cluster face: one listener per worker, all on one address.
    peer: Vec<TcpListener>,
    peer_addr: SocketAddr,
    peer_advertise: SocketAddr,
    /// The ops face, unless disabled.
    http: Option<TcpListener>,
    http_addr: Option<SocketAddr>,
    /// The RESP face, when asked for.
    resp: Option<TcpListener>,
    resp_addr: Option<SocketAddr>,
}

impl Listeners {
    /// Binds the public, peer and ops listeners; the public and peer ones once per
    /// worker.
    async fn bind(config: &NodeConfig, workers: usize) -> Result<Self, NodeError> {
        let (grpc, grpc_addr) = bind_each(config.listen, workers).await?;
        let advertise = config.advertise.unwrap_or(grpc_addr);
        if advertise.ip().is_unspecified() {
            return Err(NodeError::Config(format!(
                "listening on {grpc_addr}: set --advertise to the address peers should use"
            )));
        }
        let (peer, peer_addr) = bind_each(config.peer_listen, workers).await?;
        let peer_advertise = match config.peer_advertise {
            Some(addr) => addr,
            // A wildcard peer listener is reached at the advertised gRPC IP.
            None if peer_addr.ip().is_unspecified() => {
                SocketAddr::new(advertise.ip(), peer_addr.port())
            }
            None => peer_addr,
        };
        let http = match config.http_listen {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        let http_addr = http.as_ref().and_then(|l| l.local_addr().ok());
        let resp = match &config.resp {
            Some(resp) => Some(bind(resp.listen).await?),
            None => None,
        };
        let resp_addr = resp.as_ref().and_then(|l| l.local_addr().ok());
        Ok(Listeners {
            grpc,
            grpc_addr,
            advertise,
            peer,
            peer_addr,
            peer_advertise,
            http,
            http_addr,
            resp,
            resp_addr,
        })
    }
}

/// Joins the cluster's gossip (signed with the cluster key when there is one),
/// advertising the bound addresses.
async fn start_membership(
    config: &NodeConfig,
    decider: &Decider,
    listeners: &Listeners,
    cancel: &CancellationToken,
) -> Result<Membership, NodeError> {
    Membership::start(
        config.membership(
            decider.generation,
            listeners.advertise,
            listeners.peer_advertise,
        ),
        &*crate::membership::transport(config.cluster_key.clone()),
        cancel.child_token(),
    )
    .await
    .map_err(|e| NodeError::Membership(e.to_string()))
}

/// The shard actors: each owns a share of the keys this node decides; they are dealt
/// out over the workers.
fn spawn_shards(
    config: &NodeConfig,
    clock: &Arc<dyn Clock>,
    workers: &Workers,
    tracker: &TaskTracker,
    cancel: &CancellationToken,
) -> (Shards, Option<LeaseReturns>) {
    // Budget leases (`--lease-threshold`): where ended leases' unused units queue.
    let (returns_tx, returns_rx) = if config.shards.lease_threshold > 0 {
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        (Some(tx), Some(rx))
    } else {
        (None, None)
    };
    let shards = ShardConfig {
        replicate: !config.replicate_interval.is_zero(),
        lease_returns: returns_tx,
        ..config.shards.clone()
    };
    let shards = Shards::spawn_across(
        &shards,
        clock.clone(),
        Arc::new(AtomicU64::new(0)),
        tracker,
        cancel.clone(),
        workers.handles(),
    );
    (shards, returns_rx)
}

/// Counter snapshots in `--data-dir` (`node::snapshot`), unless there is no data dir
/// or `--snapshot-interval-ms` is 0.
fn snapshots(
    config: &NodeConfig,
    shards: &Shards,
    rules: &SharedRules,
    envoy: &SharedEnvoy,
    membership: &Membership,
    clock: &Arc<dyn Clock>,
) -> Option<snapshot::Snapshots> {
    let dir = config.data_dir.as_ref()?;
    if config.snapshot_interval.is_zero() {
        return None;
    }
    // A file far beyond what the key cap and the byte budget can hold is not read.
    let max_bytes = (config.shards.max_keys as u64)
        .saturating_mul(64)
        .saturating_add((config.shards.state_budget() as u64).saturating_mul(2))
        .saturating_add(1 << 20);
    Some(snapshot::Snapshots::new(
        dir.clone(),
        config.cluster_id.clone(),
        config.node_id.clone(),
        shards.clone(),
        rules.clone(),
        envoy.clone(),
        membership.view(),
        clock.clone(),
        config.snapshot_min_window,
        max_bytes,
    ))
}

/// Budget leases: the unused units of leases this node held go back to their owners.
fn spawn_lease_returns(
    returns: Option<LeaseReturns>,
    router: &Arc<Router>,
    tracker: &TaskTracker,
    cancel: &CancellationToken,
) {
    if let Some(returns) = returns {
        let returner =
            crate::cluster::budget::return_leases(router.clone(), returns, cancel.clone());
        tracker.spawn(tracing::Instrument::in_current_span(returner));
    }
}

/// Ended budget leases' unused units, on their way back to their owners.
type LeaseReturns = tokio::sync::mpsc::Receiver<Vec<crate::shard::budget::entry::Returned>>;

/// The peer link's settings: calls signed with the cluster key, mutual TLS when
/// configured (with the server side of it for the cluster face), and outbound traffic
/// from this node's own peer address.
fn peer_link_settings(
    config: &NodeConfig,
    peer_addr: SocketAddr,
) -> Result<(ForwardConfig, Option<tonic::transport::ServerTlsConfig>), NodeError> {
    if config.cluster_key.is_none() && config.insecure_cluster {
        tracing::warn!(
            "--insecure-cluster: peer calls are not authenticated; anyone who reaches the peer port can refund, install state or decide checks"
        );
    }
    let mut forward = config.forward.clone();
    forward.keyring = config.cluster_key.clone();
    forward.max_message_bytes = crate::node::config::peer_message_cap(config.max_rules_bytes);
    let peer_tls = match &config.peer_tls {
        Some(tls) => {
            grpc::check_tls(tls).map_err(NodeError::Config)?;
            forward.tls = Some(grpc::client_tls(tls));
            Some(grpc::server_tls(tls))
        }
        None => None,
    };
    if forward.local_ip.is_none() && !peer_addr.ip().is_unspecified() {
        // Outbound peer traffic leaves from this node's own peer address, so
        // partition rules written against a node's address hold in both directions.
        forward.local_ip = Some(peer_addr.ip());
    }
    Ok((forward, peer_tls))
}

/// Rules are cluster state: this node's advert (source, version, digest) rides in
/// gossip, and a newer advert on a peer is pulled over the peer face.
fn spawn_rules_sync(
    cluster_rules: &Arc<ClusterRules>,
    membership: &Membership,
    peers: &PeerPool,
    tracker: &TaskTracker,
    cancel: &CancellationToken,
) {
    spawn_in_span(
        tracker,
        rules::advertise_rules(
            cluster_rules.clone(),
            membership.publisher(),
            cancel.clone(),
        ),
    );
    spawn_in_span(
        tracker,
        cluster_rules.clone().sync(
            membership.values(),
            membership.view(),
            peers.clone(),
            cancel.clone(),
        ),
    );
}

/// The router (where each check is decided: here, or one hop away on its owner) and
/// the handoff (state pushed to new owners when ownership moves), over one peer pool.
fn start_routing(
    config: &NodeConfig,
    decider: &Decider,
    shards: &Shards,
    membership: &Membership,
    peers: PeerPool,
    clock: Arc<dyn Clock>,
) -> (Arc<Router>, Handoff, Replication) {
    let inherited = Arc::new(Inherited::new(membership.view().borrow().ring.digest()));
    let mut router = Router::new(
        decider.clone(),
        shards.clone(),
        membership.view(),
        peers.clone(),
        DenyCache::new(config.deny_cache),
        clock.clone(),
        inherited.clone(),
    );
    if config.broken_decide_locally {
        router = router.break_decide_locally();
    }
    router = router
        .with_budget_leases(config.shards.lease_threshold > 0)
        .with_fence(membership.fence(), membership.fence_clock());
    let replicating = !config.replicate_interval.is_zero();
    // A node with seeds may be one that restarted (same id, empty memory): it answers
    // as owner once it has its keys' replicas back. One without seeds starts a cluster.
    let restore = Arc::new(Restore::new(!replicating || config.seeds.is_empty()));
    router = router.with_replication(replicating, restore.clone());
    let replicator = replicating.then(|| {
        let replicator = Replicator::new(
            decider.node_id.clone(),
            shards.clone(),
            peers.clone(),
            clock.clone(),
        );
        (Arc::new(replicator), restore)
    });
    let handoff = Handoff::new(
        decider.node_id.clone(),
        shards.clone(),
        peers,
        inherited,
        clock,
    );
    (Arc::new(router), handoff, replicator)
}

/// The replicator and the restore gate, when the node replicates.
type Replication = Option<(Arc<Replicator>, Arc<Restore>)>;

/// Successor replicas: every interval, changed keys to their successors; at start, the
/// restore of this node's keys from the members it sees (see `cluster::replication`).
fn spawn_replication(
    config: &NodeConfig,
    replicator: &Replication,
    membership: &Membership,
    tracker: &TaskTracker,
    cancel: &CancellationToken,
) {
    let Some((replicator, restore)) = replicator.clone() else {
        return;
    };
    if !restore.is_done() {
        let (replicator, views, deadline, restore) = (
            replicator.clone(),
            membership.view(),
            config.restore_timeout,
            restore.clone(),
        );
        spawn_in_span(tracker, async move {
            replication::restore_from_peers(&replicator, views, &restore, deadline).await;
        });
    }
    let (views, every, cancel) = (membership.view(), config.replicate_interval, cancel.clone());
    spawn_in_span(tracker, async move {
        replicator.run(views, every, restore, cancel).await;
    });
}

/// State handoff on ownership moves: push what moved away, and forward the deltas of
/// checks decided here on handed-over counts.
fn spawn_handoff(
    handoff: &Handoff,
    membership: &Membership,
    tracker: &TaskTracker,
    cancel: &CancellationToken,
) {
    spawn_in_span(
        tracker,
        handoff.clone().watch(membership.view(), cancel.clone()),
    );
    spawn_in_span(
        tracker,
        handoff.clone().flush_deltas(
            membership.view(),
            Duration::from_millis(100),
            cancel.clone(),
        ),
    );
}

/// File mode: follow the rule file; with `--envoy-config`: follow that file; with
/// `--envoy-xds`: follow that control plane.
fn spawn_watchers(
    config: &NodeConfig,
    rule_file: Option<RuleFile>,
    cluster_rules: &Arc<ClusterRules>,
    envoy: &SharedEnvoy,
    tracker: &TaskTracker,
    cancel: &CancellationToken,
) {
    if let Some(rule_file) = rule_file {
        spawn_in_span(
            tracker,
            rules::watch_rules(
                rule_file,
                config.rules_poll,
                cluster_rules.clone(),
                cancel.clone(),
            ),
        );
    }
    if let Some(path) = &config.envoy_path {
        spawn_in_span(
            tracker,
            rules::watch_envoy(
                path.clone(),
                config.envoy_algorithm,
                config.rules_poll,
                envoy.clone(),
                cluster_rules.clone(),
                cancel.clone(),
            ),
        );
    }
    if let Some(addr) = &config.envoy_xds {
        let target = xds::XdsTarget {
            endpoint: xds::endpoint(addr, config.xds_keepalive)
                .expect("checked by NodeConfig::validate"),
            identity: xds::Identity {
                node_id: config.node_id.clone(),
                cluster: config.cluster_id.clone(),
            },
            max_message_bytes: config.max_rules_bytes.try_into().unwrap_or(usize::MAX),
        };
        spawn_in_span(
            tracker,
            xds::follow(
                target,
                config.envoy_algorithm,
                config.xds_backoff,
                envoy.clone(),
                cluster_rules.clone(),
                cancel.clone(),
            ),
        );
    }
}

/// The public face's TLS (`--tls-cert`) for a listener speaking `alpn`; `None` when the
/// node has none.
fn public_acceptor(
    config: &NodeConfig,
    alpn: &[&[u8]],
) -> Result<Option<public_tls::PublicAcceptor>, NodeError> {
    config
        .public_tls
        .as_ref()
        .map(|tls| public_tls::PublicAcceptor::new(tls, alpn))
        .transpose()
        .map_err(NodeError::Config)
}

/// Spawns `task` on `tracker` in the current span (the node's: see [`start_with_clock`]).
fn spawn_in_span<F>(tracker: &TaskTracker, task: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    tracker.spawn(task.in_current_span());
}

/// Binds a TCP listener, naming the address when it cannot.
async fn bind(addr: SocketAddr) -> Result<TcpListener, NodeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| NodeError::Bind { addr, source })
}

/// `count` listeners on `addr` (port 0: one free port for all of them) and the bound
/// address. More than one share the address with `SO_REUSEPORT`, and the kernel deals
/// each new connection to one of them: each worker accepts its own.
///
/// A port in use fails the start as with one listener: the address is first bound by a
/// plain socket (`SO_REUSEADDR` only), which a listener on the port refuses, whatever
/// its options, so a second node started on a multi-worker node's port does not join
/// its group and split its traffic. (A process of the same user that sets
/// `SO_REUSEPORT` itself could still join; it could as well read the node's memory.)
async fn bind_each(
    addr: SocketAddr,
    count: usize,
) -> Result<(Vec<TcpListener>, SocketAddr), NodeError> {
    let failed = |source| NodeError::Bind { addr, source };
    if count <= 1 {
        let listener = bind(addr).await?;
        let bound = listener.local_addr().map_err(failed)?;
        return Ok((vec![listener], bound));
    }
    let free = exclusive_probe(addr).map_err(failed)?;
    let first = reuse_port(free).map_err(failed)?;
    let bound = first.local_addr().map_err(failed)?;
    let mut listeners = vec![first];
    for _ in 1..count {
        listeners.push(reuse_port(bound).map_err(failed)?);
    }
    Ok((listeners, bound))
}

/// Binds `addr` without `SO_REUSEPORT` and lets it go: fails as a plain listener's bind
/// would when the port is taken; the address it got (port 0: a free port) otherwise.
fn exclusive_probe(addr: SocketAddr) -> std::io::Result<SocketAddr> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.local_addr()
}

/// One listener of a `SO_REUSEPORT` group.
#[cfg(unix)]
fn reuse_port(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Without `SO_REUSEPORT` a node runs on one worker.
#[cfg(not(unix))]
fn reuse_port(_: SocketAddr) -> std::io::Result<TcpListener> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "more than one worker needs SO_REUSEPORT (unix)",
    ))
}
