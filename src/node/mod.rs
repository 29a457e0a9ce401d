//! The composition root: the one place that knows every subsystem.
//!
//! [`start`] binds the listeners, loads the rules, spawns the shard actors, the rules
//! authority (adverts in gossip, pulls from peers, the file watcher in file mode), and
//! three faces on three listeners: the public gRPC server, the peer server (signed
//! calls only) and the ops HTTP port (admin token for rules writes). It returns a
//! [`RunningNode`] with the bound addresses (tests start nodes on port 0). [`run`] is what `ringlimit serve`
//! calls: start, wait for the caller's shutdown token, drain.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use arc_swap::ArcSwap;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

pub mod config;
pub mod grpc;

use crate::check::Checker;
use crate::clock::{Clock, SystemClock};
use crate::cluster::deny_cache::DenyCache;
use crate::cluster::forward::PeerPool;
use crate::cluster::handoff::Handoff;
use crate::cluster::rules::{ClusterRules, KEY_ENVOY, KEY_RULES};
use crate::cluster::{Decider, Inherited, Router};
use crate::config::rules::envoy::{EnvoyConfig, EnvoyConfigError};
use crate::config::rules::{
    load_stored, read_rules_file, store, RuleFile, RuleSet, RulesError, RulesSource, StoreError,
};
use crate::config::{SharedEnvoy, SharedRules};
use crate::membership::{ClusterView, Membership};
use crate::proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use crate::proto::gubernator::v1_server::V1Server;
use crate::proto::peer::peer_server::PeerServer;
use crate::proto::v1_server::rate_limiter_server::RateLimiterServer;
use crate::server::answer_budget::{AnswerBudget, HoldUntilSentLayer};
use crate::server::ops::OpsState;
use crate::server::peer_auth::PeerAuthLayer;
use crate::server::{EnvoyRlsService, GubernatorService, PeerService, RateLimitService};
use crate::shard::Shards;
pub use config::{GrpcLimits, NodeConfig, MAX_MESSAGE_BYTES};

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
    /// The same address under its old name (the port used to serve only `/metrics`).
    pub metrics_addr: Option<SocketAddr>,
    /// The bound gossip address (give it to other nodes as a seed).
    pub gossip_addr: SocketAddr,
    /// Who this node says decided.
    pub decider: Decider,
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
    /// The node's span: its background tasks run in it, and so does its leave.
    span: tracing::Span,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

impl std::fmt::Debug for RunningNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningNode")
            .field("node_id", &self.decider.node_id)
            .field("grpc_addr", &self.grpc_addr)
            .field("peer_addr", &self.peer_addr)
            .field("gossip_addr", &self.gossip_addr)
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

/// [`start_with_clock`] inside the node's span.
async fn start_in_span(
    config: NodeConfig,
    clock: Arc<dyn Clock>,
    cancel: CancellationToken,
) -> Result<RunningNode, NodeError> {
    config.validate().map_err(NodeError::Config)?;
    // Install the recorder before any metric handle is created: handles made
    // earlier would be bound to the no-op recorder for good.
    metrics_handle();
    // File mode: the bytes parsed at start are the watcher's baseline (reading them
    // again inside the watcher task would miss an edit made between start and the
    // task's first run). Read once, never blocking (a FIFO or device is refused) and at
    // most 1 MiB. Cluster mode: the stored copy, else the seed, else the built-in default.
    let (source, version, loaded, rule_file) = initial_rules(&config)?;
    tracing::info!(
        rules = loaded.len(),
        source = %source.as_str(),
        version,
        digest = %crate::cluster::rules::hex(loaded.digest()),
        path = %config.rules_path.as_deref().or(config.rules_seed.as_deref()).map_or("-".into(), |p| p.display().to_string()),
        "rules loaded"
    );
    let rules: SharedRules = Arc::new(ArcSwap::from_pointee(RuleSet::builtin()));
    let data_dir = match source {
        RulesSource::Cluster => config.data_dir.clone(),
        RulesSource::File => {
            if let Some(dir) = &config.data_dir {
                tracing::info!(data_dir = %dir.display(), "file mode (--rules): the rule file is the truth, --data-dir is not used");
            }
            None
        }
    };
    // Envoy's domains come from --envoy-config when given (read here, followed by the
    // watcher), else from the rule set's [envoy] section, swapped in with the rules.
    let envoy_file = match &config.envoy_path {
        Some(path) => {
            let envoy =
                EnvoyConfig::load(path, config.envoy_algorithm).map_err(NodeError::Envoy)?;
            tracing::info!(path = %path.display(), domains = envoy.domains().count(), digest = %crate::cluster::rules::hex(envoy.digest()), "envoy config loaded");
            if loaded.doc().envoy.is_some() {
                tracing::warn!(path = %path.display(), "the rule set has an [envoy] section, but this node serves Envoy from --envoy-config: the section is not served here");
            }
            Some(envoy)
        }
        None => None,
    };
    let envoy: SharedEnvoy = Arc::new(ArcSwap::from_pointee(EnvoyConfig::default()));
    let cluster_rules = ClusterRules::new(
        Arc::from(config.node_id.as_str()),
        source,
        data_dir,
        version,
        loaded,
        rules.clone(),
        envoy_file.is_none().then(|| envoy.clone()),
    );
    if let Some(file) = envoy_file {
        cluster_rules.envoy_file_loaded(file.digest());
        envoy.store(Arc::new(file));
    }

    let grpc_listener = bind(config.listen).await?;
    let grpc_addr = grpc_listener
        .local_addr()
        .map_err(|source| NodeError::Bind {
            addr: config.listen,
            source,
        })?;
    let advertise = config.advertise.unwrap_or(grpc_addr);
    if advertise.ip().is_unspecified() {
        return Err(NodeError::Config(format!(
            "listening on {grpc_addr}: set --advertise to the address peers should use"
        )));
    }
    let peer = bind(config.peer_listen).await?;
    let peer_addr = peer.local_addr().map_err(|source| NodeError::Bind {
        addr: config.peer_listen,
        source,
    })?;
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

    let tracker = TaskTracker::new();
    let generation = crate::membership::generation_now();
    let decider = Decider {
        node_id: Arc::from(config.node_id.as_str()),
        generation,
    };
    let membership = Membership::start(
        config.membership(generation, advertise, peer_advertise),
        &*crate::membership::transport(config.cluster_key.clone()),
        cancel.child_token(),
    )
    .await
    .map_err(|e| NodeError::Membership(e.to_string()))?;
    let gossip_addr = membership.gossip_addr();

    let shards = Shards::spawn(
        &config.shards,
        clock.clone(),
        Arc::new(AtomicU64::new(0)),
        &tracker,
        cancel.clone(),
    );
    if config.cluster_key.is_none() && config.insecure_cluster {
        tracing::warn!(
            "--insecure-cluster: peer calls are not authenticated; anyone who reaches the peer port can refund, install state or decide checks"
        );
    }
    let mut forward = config.forward.clone();
    forward.keyring = config.cluster_key.clone();
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
    // Gubernator's inline rules: one registry per node, shared by the checker (what
    // callers send), the peer service (what peers forward) and the peer pool (handed-over
    // counters name their rule's numbers).
    let inline_rules = Arc::new(crate::cluster::InlineRules::default());
    let peers = PeerPool::new(
        decider.node_id.clone(),
        forward,
        tracker.clone(),
        cancel.clone(),
    )
    .with_inline(inline_rules.clone());
    // Rules are cluster state: this node's advert (source, version, digest) rides in
    // gossip, and a newer advert on a peer is pulled over the peer face.
    spawn_in_span(
        &tracker,
        advertise_rules(
            cluster_rules.clone(),
            membership.publisher(),
            cancel.clone(),
        ),
    );
    spawn_in_span(
        &tracker,
        cluster_rules.clone().sync(
            membership.values(),
            membership.view(),
            peers.clone(),
            cancel.clone(),
        ),
    );
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
    let router = Arc::new(router);
    let handoff = Handoff::new(
        decider.node_id.clone(),
        shards.clone(),
        peers,
        inherited,
        clock,
    );
    spawn_in_span(
        &tracker,
        handoff.clone().watch(membership.view(), cancel.clone()),
    );
    spawn_in_span(
        &tracker,
        handoff.clone().flush_deltas(
            membership.view(),
            Duration::from_millis(100),
            cancel.clone(),
        ),
    );

    if let Some(rule_file) = rule_file {
        spawn_in_span(
            &tracker,
            watch_rules(
                rule_file,
                config.rules_poll,
                cluster_rules.clone(),
                cancel.clone(),
            ),
        );
    }
    if let Some(path) = &config.envoy_path {
        spawn_in_span(
            &tracker,
            watch_envoy(
                path.clone(),
                config.envoy_algorithm,
                config.rules_poll,
                envoy.clone(),
                cluster_rules.clone(),
                cancel.clone(),
            ),
        );
    }
    // The ops face: HTTP for operators and orchestrators; rules writes need the admin
    // token (none configured: refused).
    if let Some(listener) = http {
        let ops = OpsState {
            rules: cluster_rules.clone(),
            router: router.clone(),
            admin: config.admin_token.clone(),
            metrics: Arc::new(|| metrics_handle().render()),
            expects_peers: !config.seeds.is_empty(),
        };
        spawn_in_span(&tracker, serve_ops(listener, ops, cancel.clone()));
    }

    // Two faces, two listeners. The public face is what gateways reach: the check
    // services, health and reflection of those services only. The cluster face is the
    // peer service (forwarded checks, refunds, handoff, status) on a listener of its
    // own, so it can be bound to a private network and never answers on the public port.
    let checker = Checker::new(router.clone(), rules.clone())
        .with_envoy(envoy.clone())
        .with_inline(inline_rules.clone());
    // One budget of unsent bulk answers for every bulk front end of the node.
    let answers = AnswerBudget::new(config.grpc.max_unsent_answer_items);
    let public = RateLimitService::new(checker.clone()).with_answer_budget(answers.clone());
    // Gubernator's face only on request: its callers choose their own limits.
    let gubernator = config
        .gubernator
        .then(|| GubernatorService::new(checker.clone()).with_answer_budget(answers));
    let envoy_rls = EnvoyRlsService::new(checker).with_headers(config.envoy_headers);
    spawn_in_span(
        &tracker,
        serve_public(
            grpc_listener,
            public,
            envoy_rls,
            gubernator,
            &config.grpc,
            cancel.clone(),
        )
        .await?,
    );
    let peer_service = PeerService::new(router.clone(), rules.clone(), cluster_rules.clone())
        .with_envoy(envoy)
        .with_inline(inline_rules)
        .with_shutdown(cancel.clone());
    spawn_in_span(
        &tracker,
        serve_peer(
            peer,
            peer_service,
            PeerAuthLayer::new(config.cluster_key.clone()),
            peer_tls,
            config.grpc.clone(),
            cancel.clone(),
        ),
    );

    Ok(RunningNode {
        grpc_addr,
        peer_addr,
        http_addr,
        metrics_addr: http_addr,
        gossip_addr,
        decider,
        shards,
        rules,
        cluster_rules,
        router,
        membership,
        handoff,
        leave_settle: config.leave_settle,
        span: tracing::Span::current(),
        cancel,
        tracker,
    })
}

/// The public face: `ringlimit.v1`, Envoy's RLS v3, Gubernator's V1 when asked for,
/// health, and reflection (v1 and v1alpha) of those services only. Returns the server task for the caller's tracker.
///
/// Every bound on what one client can make this server hold is set here (README
/// "Flags and metrics"); the accept loop, the connection cap and the handshake timeout
/// are in [`grpc::incoming`].
async fn serve_public(
    listener: TcpListener,
    public: RateLimitService,
    envoy_rls: EnvoyRlsService,
    gubernator: Option<GubernatorService>,
    limits: &GrpcLimits,
    cancel: CancellationToken,
) -> Result<impl std::future::Future<Output = ()>, NodeError> {
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
    let server = limited(limits)
        .layer(grpc::StatusMappingLayer)
        .layer(HoldUntilSentLayer)
        .add_service(health_service.max_decoding_message_size(max))
        .add_service(reflection_v1.max_decoding_message_size(max))
        .add_service(reflection_v1alpha.max_decoding_message_size(max))
        .add_service(RateLimiterServer::new(public).max_decoding_message_size(max))
        .add_service(RateLimitServiceServer::new(envoy_rls).max_decoding_message_size(max))
        .add_optional_service(gubernator.map(|g| V1Server::new(g).max_decoding_message_size(max)))
        .serve_with_incoming_shutdown(
            grpc::incoming(listener, limits),
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
async fn serve_peer(
    listener: TcpListener,
    peer: PeerService,
    auth: PeerAuthLayer,
    tls: Option<tonic::transport::ServerTlsConfig>,
    limits: GrpcLimits,
    cancel: CancellationToken,
) {
    let mut builder = limited(&limits);
    if let Some(tls) = tls {
        builder = match builder.tls_config(tls) {
            Ok(builder) => builder,
            Err(error) => {
                // Checked at start (`grpc::check_tls`); never serve the face in the clear.
                tracing::error!(%error, "peer TLS configuration refused; stopping");
                cancel.cancel();
                return;
            }
        };
    }
    let server = builder
        .layer(auth)
        .add_service(PeerServer::new(peer).max_decoding_message_size(MAX_MESSAGE_BYTES))
        .serve_with_incoming_shutdown(
            grpc::incoming(listener, &limits),
            cancel.clone().cancelled_owned(),
        );
    if let Some(Err(error)) = within_grace(server, &cancel, limits.shutdown_grace, "peer").await {
        tracing::error!(%error, "peer gRPC server failed");
        cancel.cancel();
    }
}

/// A gRPC server builder with the HTTP/2 limits of `limits`.
fn limited(limits: &GrpcLimits) -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .max_concurrent_streams(limits.max_concurrent_streams)
        .timeout(limits.request_timeout)
        .http2_keepalive_interval(Some(limits.keepalive_interval))
        .http2_keepalive_timeout(Some(limits.keepalive_timeout))
        .max_connection_age(limits.max_connection_age)
        .max_connection_age_grace(limits.max_connection_age_grace)
        .max_frame_size(limits.max_frame_size)
        .http2_max_header_list_size(limits.max_header_list_size)
        .initial_stream_window_size(limits.initial_stream_window)
        .initial_connection_window_size(limits.initial_connection_window)
}

/// Spawns `task` on `tracker` in the current span (the node's: see [`start_with_clock`]).
fn spawn_in_span<F>(tracker: &TaskTracker, task: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    tracker.spawn(task.in_current_span());
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, NodeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| NodeError::Bind { addr, source })
}

/// The process-wide Prometheus recorder. `metrics` has one global recorder, so nodes
/// started in one test process share it.
pub fn metrics_handle() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Suffix("_duration_seconds".into()),
                &[
                    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05,
                    0.1, 0.25, 1.0,
                ],
            )
            .expect("non-empty buckets");
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        // Fails only if another recorder is installed (an embedding program's): then
        // our handle renders nothing, which is that program's choice.
        let _ = metrics::set_global_recorder(recorder);
        describe_metrics();
        metrics::gauge!(
            "ringlimit_build_info",
            "version" => env!("CARGO_PKG_VERSION"),
        )
        .set(1.0);
        handle
    })
}

/// A `# HELP` line for every metric (README "Flags and metrics" has the longer story):
/// a dashboard author should not need the source to read `/metrics`.
fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(
        "ringlimit_build_info",
        "Always 1; the version label names the running build."
    );
    describe_counter!(
        "ringlimit_checks_total",
        "Decisions made here, by verdict, algorithm and rule (at most 256 rule series per shard, then rule=\"other\")."
    );
    describe_histogram!(
        "ringlimit_check_duration_seconds",
        "Time to handle one check request."
    );
    describe_counter!(
        "ringlimit_degraded_total",
        "Answers given without the owner (fail_open, fail_closed)."
    );
    describe_counter!(
        "ringlimit_deny_cache_hits_total",
        "Denials answered from the local deny cache, without a hop."
    );
    describe_counter!(
        "ringlimit_forwarded_total",
        "Checks forwarded to their owner."
    );
    describe_counter!(
        "ringlimit_forward_errors_total",
        "Forwards that failed or timed out."
    );
    describe_histogram!(
        "ringlimit_forward_batch_size",
        "Checks per forwarded batch."
    );
    describe_counter!(
        "ringlimit_forward_streams_opened_total",
        "Forward streams opened to peers (one per peer, renewed every 15 s; more means streams broke)."
    );
    describe_counter!(
        "ringlimit_forwarded_not_owner_total",
        "Forwarded checks decided here although this node's ring names another owner."
    );
    describe_counter!(
        "ringlimit_forwarded_stale_total",
        "Forwarded checks refused because their batch arrived after its deadline."
    );
    describe_counter!(
        "ringlimit_envoy_config_reloads_total",
        "Reloads of the Envoy (envoyproxy/ratelimit YAML) configuration, by result."
    );
    describe_histogram!(
        "ringlimit_envoy_rls_duration_seconds",
        "Time to answer one Envoy ShouldRateLimit call."
    );
    describe_counter!(
        "ringlimit_shadow_denials_total",
        "Checks a rule in shadow mode would have denied (they were allowed), by rule."
    );
    describe_gauge!("ringlimit_keys", "Keys held, per shard.");
    describe_gauge!(
        "ringlimit_state_bytes",
        "Bytes of per-key state kept beside the key table (sliding logs), per shard; bounded by --max-state-bytes."
    );
    describe_gauge!(
        "ringlimit_shard_queue_depth",
        "Commands waiting in a shard's inbox."
    );
    describe_counter!("ringlimit_evictions_total", "Keys dropped at the key cap (their counts were lost), by shard and kind (live, denied). Alert on any increase.");
    describe_counter!(
        "ringlimit_expired_keys_total",
        "Idle keys dropped because their state was back to fresh (harmless)."
    );
    describe_counter!(
        "ringlimit_ownership_resets_total",
        "Keys restarted from empty because their owner died or restarted."
    );
    describe_counter!(
        "ringlimit_member_restarts_total",
        "A peer came back with a new generation under the same id."
    );
    describe_counter!(
        "ringlimit_handoff_pushed_total",
        "Key states pushed to new owners on ownership moves."
    );
    describe_counter!(
        "ringlimit_handoff_installed_total",
        "Handed-over key states installed here."
    );
    describe_counter!(
        "ringlimit_handoff_failed_total",
        "Handoff pushes that failed."
    );
    describe_counter!(
        "ringlimit_handoff_deltas_total",
        "Admissions on handed-over keys pushed on to their new owners."
    );
    describe_counter!(
        "ringlimit_handoff_refused_total",
        "Handed-over states refused as implausible, by reason."
    );
    describe_counter!(
        "ringlimit_peer_auth_refused_total",
        "Peer calls refused UNAUTHENTICATED, by reason. Alert on any increase."
    );
    describe_counter!(
        "ringlimit_gossip_rejected_total",
        "Gossip datagrams dropped before chitchat saw them, by reason."
    );
    describe_counter!(
        "ringlimit_gossip_oversize_total",
        "Gossip envelopes too large to tag."
    );
    describe_counter!(
        "ringlimit_gossip_codec_failures_total",
        "Authentic gossip datagrams lost because the loopback codec failed (then reopened)."
    );
    describe_gauge!("ringlimit_grpc_connections", "Open gRPC connections.");
    describe_counter!(
        "ringlimit_connections_refused_total",
        "Connections closed at once because --max-connections were open."
    );
    describe_counter!(
        "ringlimit_accept_errors_total",
        "Failed accepts on a gRPC listener (e.g. at the file descriptor limit)."
    );
    describe_counter!(
        "ringlimit_refused_total",
        "Requests refused before anything was charged, by reason (invalid_argument, overloaded, unavailable) and field."
    );
    describe_counter!(
        "ringlimit_rules_reloads_total",
        "Rule file reloads, by result (ok, error)."
    );
    describe_gauge!("ringlimit_rules_version", "Version of the rules this node enforces (cluster mode: the cluster's version; file mode: reloads since start).");
    describe_gauge!("ringlimit_rules_drift_nodes", "Members whose rules differ from this node's (different files, or mixed file and cluster sources).");
    describe_gauge!("ringlimit_envoy_config_drift_nodes", "Members whose Envoy domains differ from this node's (different --envoy-config files or --envoy-algorithm, or --envoy-config on some nodes only).");
    describe_counter!(
        "ringlimit_rules_changes_total",
        "Rule sets swapped in, by origin (api, peer, file)."
    );
    describe_counter!(
        "ringlimit_rules_pull_failures_total",
        "Failed attempts to copy newer rules from a peer (retried every 500 ms)."
    );
    describe_counter!(
        "ringlimit_rules_persist_failures_total",
        "Rule sets copied from a peer that could not be written to --data-dir."
    );
}

async fn serve_ops(listener: TcpListener, state: OpsState, cancel: CancellationToken) {
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
        crate::server::ops::BoundedListener::new(
            listener,
            crate::server::ops::MAX_OPS_CONNECTIONS,
            crate::server::ops::MAX_OPS_CONNECTION_AGE,
        ),
        app,
    )
    .with_graceful_shutdown(cancel.clone().cancelled_owned());
    let (result, ()) = tokio::join!(server, upkeep);
    if let Err(error) = result {
        tracing::error!(%error, "ops HTTP server failed");
    }
}

/// Mirrors this node's rules and Envoy adverts into its gossip key-values.
async fn advertise_rules(
    rules: Arc<ClusterRules>,
    gossip: crate::membership::ValuePublisher,
    cancel: CancellationToken,
) {
    let (mut adverts, mut envoy) = (rules.adverts(), rules.envoy_adverts());
    // Each set is pushed to every peer at once: publish only what changed.
    let mut published: [Option<String>; 2] = [None, None];
    loop {
        let values = [
            (KEY_RULES, adverts.borrow_and_update().encode()),
            (KEY_ENVOY, envoy.borrow_and_update().encode()),
        ];
        for ((key, value), last) in values.into_iter().zip(&mut published) {
            if last.as_deref() != Some(value.as_str()) {
                gossip.set(key, value.clone()).await;
                *last = Some(value);
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            changed = adverts.changed() => if changed.is_err() { return },
            changed = envoy.changed() => if changed.is_err() { return },
        }
    }
}

/// The rules a node starts with: (source, version, rules, the file to follow).
///
/// File mode (`--rules`): the file, version 1, followed for changes. Cluster mode: the
/// copy stored in `--data-dir` (the rules this node last enforced, at their version),
/// else `--rules-seed` at version 1 (stored at once, so a restart keeps it), else the
/// built-in default at version 0; gossip then brings any newer version.
fn initial_rules(
    config: &NodeConfig,
) -> Result<(RulesSource, u64, RuleSet, Option<RuleFile>), NodeError> {
    if let Some(path) = &config.rules_path {
        let (file, rules) = RuleFile::load(path).map_err(NodeError::Rules)?;
        return Ok((RulesSource::File, 1, rules, Some(file)));
    }
    if let Some(dir) = &config.data_dir {
        if let Some((stamp, rules)) = load_stored(dir).map_err(NodeError::StoredRules)? {
            return Ok((RulesSource::Cluster, stamp.version, rules, None));
        }
    }
    match &config.rules_seed {
        Some(seed) => {
            let rules = RuleSet::load(seed).map_err(NodeError::Rules)?;
            if let Some(dir) = &config.data_dir {
                store(dir, 1, &rules).map_err(NodeError::StoredRules)?;
            }
            Ok((RulesSource::Cluster, 1, rules, None))
        }
        None => Ok((RulesSource::Cluster, 0, RuleSet::builtin(), None)),
    }
}

/// Re-read the Envoy configuration every `every`; swap it in (and advertise its digest,
/// for drift) when what was read parses cleanly and means something else than what is
/// enforced. A broken edit is logged and counted once per distinct problem and the node
/// keeps its previous configuration (as for the rule file).
async fn watch_envoy(
    path: std::path::PathBuf,
    algorithm: crate::algorithms::AlgorithmKind,
    every: Duration,
    envoy: SharedEnvoy,
    rules: Arc<ClusterRules>,
    cancel: CancellationToken,
) {
    let mut applied = envoy.load().digest();
    let reloads = metrics::counter!("ringlimit_envoy_config_reloads_total", "result" => "ok");
    let failures = metrics::counter!("ringlimit_envoy_config_reloads_total", "result" => "error");
    let mut last_error = None;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let read_path = path.clone();
        let read = tokio::task::spawn_blocking(move || EnvoyConfig::load(&read_path, algorithm));
        let read = tokio::select! {
            _ = cancel.cancelled() => return,
            read = read => read,
        };
        match read {
            Ok(Ok(config)) => {
                last_error = None;
                let digest = config.digest();
                if digest != applied {
                    applied = digest;
                    tracing::info!(path = %path.display(), domains = config.domains().count(), digest = %crate::cluster::rules::hex(digest), "envoy config reloaded");
                    envoy.store(Arc::new(config));
                    rules.envoy_file_loaded(digest);
                    reloads.increment(1);
                }
            }
            Ok(Err(error)) => {
                let message = error.to_string();
                if last_error.as_ref() != Some(&message) {
                    tracing::error!(%error, "envoy config refused; keeping the current one");
                    failures.increment(1);
                    last_error = Some(message);
                }
            }
            Err(error) => tracing::error!(%error, "envoy config read task failed"),
        }
    }
}

/// Re-read the rule file every `every`; swap in a new rule set when its contents
/// change and parse cleanly. A broken edit, an empty or truncated file, or a path that
/// stops being a readable regular file is logged and counted once, and the node keeps
/// deciding with its previous rules: a typo must not turn limiting off.
///
/// The read never blocks (a FIFO is refused, not read) and still runs beside the
/// cancellation, so nothing in the file system can keep the node from stopping.
async fn watch_rules(
    mut file: RuleFile,
    every: Duration,
    rules: Arc<ClusterRules>,
    cancel: CancellationToken,
) {
    let reloads = metrics::counter!("ringlimit_rules_reloads_total", "result" => "ok");
    let failures = metrics::counter!("ringlimit_rules_reloads_total", "result" => "error");
    let path = file.path().to_owned();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let read_path = path.clone();
        let read = tokio::task::spawn_blocking(move || read_rules_file(&read_path));
        let read = tokio::select! {
            _ = cancel.cancelled() => return,
            read = read => read,
        };
        let read = match read {
            Ok(read) => read,
            Err(error) => {
                tracing::error!(path = %path.display(), %error, "rule file read task failed");
                continue;
            }
        };
        match file.observe(read) {
            None => {}
            Some(Ok(new)) => {
                tracing::info!(path = %path.display(), rules = new.len(), "rules reloaded");
                rules.reload_file(new).await;
                reloads.increment(1);
            }
            Some(Err(error)) => {
                tracing::error!(path = %path.display(), %error, "rule file refused; keeping current rules");
                failures.increment(1);
            }
        }
    }
}
