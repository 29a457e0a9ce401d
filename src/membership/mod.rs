//! Gossip membership: who is in the cluster, published as a `watch` of
//! [`ClusterView`] (live members + the consistent-hash ring over them).
//!
//! # How
//!
//! Each node runs one [`chitchat`] instance (gossip, scuttlebutt
//! reconciliation, phi-accrual failure detector) over the transport its caller
//! passes: in a node, UDP authenticated with the cluster key ([`auth`], picked by
//! [`transport`]; chitchat's plain `UdpTransport` only for an insecure cluster),
//! chitchat's in-memory `ChannelTransport` in tests, so a cluster forms with no socket.
//! Its identity is
//! `(node_id, generation, gossip address)`; the generation is the start time
//! in ns, so it grows on every restart. It publishes two key-values:
//! `grpc_addr` (its public gRPC advertise address), `peer_addr` (its peer
//! service, on a listener of its own) and, once it starts a graceful leave,
//! `leaving = "true"`. Other subsystems publish values of their own through a
//! [`ValuePublisher`] (the rules advert, `rules`), pushed to every live peer at
//! once, and read every member's values from [`Membership::values`].
//!
//! * **Source of truth: chitchat's live-nodes watch**
//!   (`Chitchat::live_nodes_watcher`), never `node_states()`, which also holds
//!   dead and not-yet-confirmed nodes. Chitchat recomputes that set at the end
//!   of every gossip round and sends on the watch whenever a node becomes live
//!   or dead *or a live node's max version changes* (see
//!   `Chitchat::update_nodes_liveness` in chitchat 0.13), i.e. on every
//!   key-value change of a live node. So the `leaving` flag needs no separate
//!   `subscribe_event` listener and no polling: one `watch::Receiver::changed`
//!   drives everything.
//! * **One address per node id, then highest generation wins**
//!   ([`build_view_after`]): a restarted node is a new chitchat identity while the
//!   old one still counts as live until the failure detector gives up on it. A
//!   restart on the same gossip address replaces it at once; a live incarnation from
//!   another address (an impostor, or a pod that moved) is refused and logged until
//!   the incumbent is no longer live. The ring places by node id only, so the
//!   restart does not move keys.
//! * **Lost members are knocked on** (`reconnect`): a member that vanished without
//!   a leave is gossiped to directly, once a second (every round while this node is
//!   alone), for ten minutes, so a healed partition rejoins in about a second however
//!   many dead identities chitchat's random picks would have to get past.
//! * **Pure core, thin shell:** [`build_view`] is a pure function; one driver
//!   task (a single `select!`: cancellation, live-set changes, commands) turns
//!   the watch into views and publishes a view only when the members changed.
//!
//! # Timings (the defaults of `MembershipConfig::new` and `for_test`)
//!
//! Chitchat's phi is `elapsed since last heartbeat / mean heartbeat
//! interval`, the mean smoothed with a prior of `initial_interval` weighted as
//! 5 samples; a node is dead once `phi > phi_threshold`, checked at the end
//! of every gossip round. Detection time is thus about
//! `phi_threshold × mean observed heartbeat interval + ≤ one gossip interval`.
//! With chitchat's defaults (phi 8, 5 s prior, the 1 s gossip interval of its
//! own default config) that is 6–10 s.
//!
//! | setting | value | why |
//! |---|---|---|
//! | `gossip_interval` | 200 ms | peers see a fresh heartbeat every ~110–140 ms (direct SYNs plus relayed digests); 5 UDP rounds/s per node is negligible load |
//! | `phi_threshold` | 8.0 | chitchat's default: a node is dead after a silence of 8 mean intervals (~1 s), so a scheduler hiccup of a few hundred ms on a busy 2-core box does not flap the ring |
//! | `heartbeat_initial_interval` (prior mean) | 200 ms | = gossip interval, so a freshly joined node is judged on the right scale (chitchat's 5 s prior would dominate the first samples) |
//! | `heartbeat_max_interval` | 2 s | a longer gap (a pause, a partition) is not fed into the mean, so one stall does not slow detection for minutes afterwards |
//! | `dead_node_grace_period` | 1 h | how long a dead identity's state is kept (and not re-admitted from stale gossip) before GC |
//!
//! What these settings give on loopback (detection after a kill, a graceful leave, a
//! restart at the same or a new address) is measured and recorded in
//! `docs/ownership.md` ("Membership and detection times");
//! `detection_time_of_a_killed_node` asserts the bound (≤ 3 s).

pub mod auth;
pub mod quorum;
mod reconnect;
mod view;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chitchat::transport::Transport;
use chitchat::{
    spawn_chitchat, Chitchat, ChitchatConfig, ChitchatHandle, ChitchatId, FailureDetectorConfig,
    NodeState, ProtocolVersion,
};
use tokio::sync::{mpsc, oneshot, watch, Mutex};
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{debug, error, info, warn};

pub use auth::{transport, AuthUdpTransport, GossipAuthStats};
pub use quorum::{Fence, FenceConfig, Fenced, Quorum};
pub use view::{
    build_view, build_view_after, ClusterView, LiveNode, Member, KEY_GRPC_ADDR, KEY_LEAVING,
    KEY_PEER_ADDR,
};

/// Binds of a probed gossip port tried before giving up (module `resolve_listen_addr`).
const BIND_ATTEMPTS: u32 = 5;
/// Default gossip round period; see the module docs for the reasoning.
pub const DEFAULT_GOSSIP_INTERVAL: Duration = Duration::from_millis(200);
/// Default phi above which a peer is declared dead.
pub const DEFAULT_PHI_THRESHOLD: f64 = 8.0;
/// Default prior mean heartbeat interval of the failure detector.
pub const DEFAULT_HEARTBEAT_INITIAL_INTERVAL: Duration = Duration::from_millis(200);
/// Default longest heartbeat gap still fed into the failure detector's mean.
pub const DEFAULT_HEARTBEAT_MAX_INTERVAL: Duration = Duration::from_secs(2);
/// Default time a dead identity is remembered before it is garbage collected.
pub const DEFAULT_DEAD_NODE_GRACE_PERIOD: Duration = Duration::from_secs(3600);
/// Default cluster id; nodes only gossip with nodes of the same cluster id.
pub const DEFAULT_CLUSTER_ID: &str = "ringlimit";

/// Heartbeat samples the failure detector averages over (chitchat's default).
const SAMPLING_WINDOW_SIZE: usize = 1_000;
/// We never delete key-values, but chitchat wants a tombstone retention.
const TOMBSTONE_GRACE_PERIOD: Duration = Duration::from_secs(3600);

/// Errors starting membership. Once started, membership does not fail: a
/// broken gossip socket is logged and the last view stays published.
#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    /// The configuration is unusable; says which field and why.
    #[error("invalid membership config: {0}")]
    InvalidConfig(String),
    /// Probing for a free gossip port (listen port 0) failed.
    #[error("cannot bind gossip socket on {addr}: {source}")]
    Bind {
        /// The address we tried to bind.
        addr: SocketAddr,
        /// The transport's error (for UDP, the OS error).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Chitchat failed to start (typically: the gossip port is taken).
    #[error("cannot start chitchat: {0}")]
    Start(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Everything membership needs to join a cluster.
///
/// Built with [`MembershipConfig::new`] (tuned production defaults) or
/// [`MembershipConfig::for_test`], then adjusted field by field; checked once
/// by [`MembershipConfig::validate`] when [`Membership::start`] runs.
#[derive(Clone, Debug)]
pub struct MembershipConfig {
    /// Stable identity of this node; the ring places keys by it.
    pub node_id: String,
    /// Incarnation number, start time in ns since the Unix epoch
    /// ([`generation_now`]); must grow on every restart of the same node id.
    pub generation: u64,
    /// Nodes only gossip within the same cluster id.
    pub cluster_id: String,
    /// Address to gossip on (UDP in a node). Port 0 picks a free port on that IP.
    pub gossip_listen: SocketAddr,
    /// Gossip address other nodes should use; default: the resolved listen
    /// address (which must then not be a wildcard IP). Port 0 here means "the
    /// resolved listen port".
    pub gossip_advertise: Option<SocketAddr>,
    /// The gRPC address published as the `grpc_addr` key-value.
    pub grpc_advertise: SocketAddr,
    /// The peer service address published as the `peer_addr` key-value.
    pub peer_advertise: SocketAddr,
    /// `host:port` gossip addresses of other nodes to join through.
    pub seeds: Vec<String>,
    /// Gossip round period; also how often liveness is re-evaluated.
    pub gossip_interval: Duration,
    /// Failure-detector phi above which a peer is dead.
    pub phi_threshold: f64,
    /// Prior mean heartbeat interval, used until real samples dominate.
    pub heartbeat_initial_interval: Duration,
    /// Heartbeat gaps longer than this are not fed into the mean.
    pub heartbeat_max_interval: Duration,
    /// How long a dead identity's state is kept before it is forgotten.
    pub dead_node_grace_period: Duration,
    /// `--cluster-size`: fenced rules are decided only by a node that hears a majority
    /// of this many members; `None`: of the largest view it held ([`quorum`]).
    pub cluster_size: Option<std::num::NonZeroUsize>,
    /// The clock fencing measures silences on (its monotonic reading): the node's, so
    /// the router compares a lease with the same clock it was made on.
    pub clock: Arc<dyn crate::clock::Clock>,
}

impl MembershipConfig {
    /// A config with the tuned defaults (module docs), a fresh generation,
    /// gossip on `0.0.0.0:7946` and no seeds. The peer address defaults to the
    /// gRPC one; a node sets its own.
    pub fn new(node_id: &str, grpc_advertise: SocketAddr) -> Self {
        MembershipConfig {
            node_id: node_id.to_string(),
            generation: generation_now(),
            cluster_id: DEFAULT_CLUSTER_ID.to_string(),
            gossip_listen: SocketAddr::from(([0, 0, 0, 0], 7946)),
            gossip_advertise: None,
            grpc_advertise,
            peer_advertise: grpc_advertise,
            seeds: Vec::new(),
            gossip_interval: DEFAULT_GOSSIP_INTERVAL,
            phi_threshold: DEFAULT_PHI_THRESHOLD,
            heartbeat_initial_interval: DEFAULT_HEARTBEAT_INITIAL_INTERVAL,
            heartbeat_max_interval: DEFAULT_HEARTBEAT_MAX_INTERVAL,
            dead_node_grace_period: DEFAULT_DEAD_NODE_GRACE_PERIOD,
            cluster_size: None,
            clock: Arc::new(crate::clock::SystemClock),
        }
    }

    /// For in-process tests: gossip on `127.0.0.1:0` (a free port, so tests
    /// run in parallel) with the same tuned timings as production, so that
    /// tests measure what production gets.
    pub fn for_test(node_id: &str, grpc_advertise: SocketAddr) -> Self {
        MembershipConfig {
            gossip_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            ..MembershipConfig::new(node_id, grpc_advertise)
        }
    }

    /// Rejects configs that would start but never work (empty ids, zero or
    /// non-finite timings).
    pub fn validate(&self) -> Result<(), MembershipError> {
        let bad = |msg: &str| Err(MembershipError::InvalidConfig(msg.to_string()));
        if self.node_id.is_empty() {
            return bad("node_id must not be empty");
        }
        if self.cluster_id.is_empty() {
            return bad("cluster_id must not be empty");
        }
        if self.gossip_interval.is_zero() {
            return bad("gossip_interval must be > 0");
        }
        if !(self.phi_threshold.is_finite() && self.phi_threshold > 0.0) {
            return bad("phi_threshold must be a positive number");
        }
        if self.heartbeat_initial_interval.is_zero() {
            return bad("heartbeat_initial_interval must be > 0");
        }
        if self.heartbeat_max_interval < self.gossip_interval {
            return bad("heartbeat_max_interval must be >= gossip_interval");
        }
        Ok(())
    }
}

/// Current time in ns since the Unix epoch: the generation of a node that
/// starts now. Grows across restarts as long as the wall clock does.
pub fn generation_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// A running membership: a chitchat instance plus the task that turns its
/// live-node watch into [`ClusterView`]s.
///
/// Dropping it (or cancelling the token given to [`Membership::start`]) stops
/// gossip in the background; [`Membership::shutdown`] does the same and waits.
pub struct Membership {
    view: watch::Receiver<Arc<ClusterView>>,
    fence: watch::Receiver<Arc<Fence>>,
    fence_clock: Arc<dyn crate::clock::Clock>,
    values: watch::Receiver<Arc<MemberValues>>,
    gossip_addr: SocketAddr,
    commands: mpsc::Sender<Command>,
    stop: DropGuard,
    driver: JoinHandle<()>,
    gossip_stopped: CancellationToken,
}

/// Requests to the driver task, which owns all writes to chitchat state.
#[derive(Debug)]
enum Command {
    /// Set `leaving = "true"`, publish the local view, then acknowledge.
    AnnounceLeaving(oneshot::Sender<()>),
    /// Set one of this node's key-values (not an address or `leaving`).
    Set(String, String),
}

/// Publishes key-values of this node ([`Membership::publisher`]).
#[derive(Clone, Debug)]
pub struct ValuePublisher(mpsc::Sender<Command>);

impl ValuePublisher {
    /// Publishes `key = value` for this node (gossiped from the next round on).
    /// Reserved keys (addresses, `leaving`) are refused: they are membership's own.
    pub async fn set(&self, key: &str, value: String) {
        if [KEY_GRPC_ADDR, KEY_PEER_ADDR, KEY_LEAVING].contains(&key) {
            warn!(key, "refusing to overwrite a membership key-value");
            return;
        }
        if self
            .0
            .send(Command::Set(key.to_string(), value))
            .await
            .is_err()
        {
            debug!(key, "publishing a key-value after membership stopped");
        }
    }
}

/// Each view member's gossiped key-values, by node id: what other subsystems publish
/// beside the addresses (the rules advert). Only the incarnation the view chose counts.
pub type MemberValues = BTreeMap<String, BTreeMap<String, String>>;

impl Membership {
    /// Starts gossiping over `transport` and returns once its socket is bound.
    ///
    /// The transport is the caller's choice so that the composition root
    /// picks the network (`UdpTransport`) and tests can pass chitchat's
    /// in-memory `ChannelTransport`; membership itself opens no socket of its
    /// own.
    ///
    /// The first published view is [`ClusterView::single`] of this node, so
    /// the node can serve immediately; peers appear as gossip finds them.
    /// Cancelling `cancel` stops gossip (without announcing a leave).
    pub async fn start(
        config: MembershipConfig,
        transport: &dyn Transport,
        cancel: CancellationToken,
    ) -> Result<Membership, MembershipError> {
        config.validate()?;
        // Port 0 is resolved by a probe socket that is closed before chitchat binds
        // the port (see `resolve_listen_addr`); another process may take it in
        // between. Then chitchat cannot bind: probe a new port and try again.
        let mut attempt = 1;
        loop {
            match Self::start_once(&config, transport, cancel.clone()).await {
                Err(MembershipError::Start(error))
                    if config.gossip_listen.port() == 0 && attempt < BIND_ATTEMPTS =>
                {
                    debug!(%error, attempt, "gossip port taken before chitchat bound it; probing another");
                    attempt += 1;
                }
                started => return started,
            }
        }
    }

    async fn start_once(
        config: &MembershipConfig,
        transport: &dyn Transport,
        cancel: CancellationToken,
    ) -> Result<Membership, MembershipError> {
        let listen_addr = resolve_listen_addr(transport, config.gossip_listen).await?;
        let mut gossip_addr = config.gossip_advertise.unwrap_or(listen_addr);
        if gossip_addr.port() == 0 {
            gossip_addr.set_port(listen_addr.port());
        }
        if gossip_addr.ip().is_unspecified() {
            return Err(MembershipError::InvalidConfig(format!(
                "gossip advertise address {gossip_addr} is a wildcard; set gossip_advertise"
            )));
        }

        let chitchat_id = ChitchatId::new(config.node_id.clone(), config.generation, gossip_addr);
        let self_member = Member {
            node_id: config.node_id.clone(),
            generation: config.generation,
            grpc_addr: config.grpc_advertise,
            peer_addr: config.peer_advertise,
            gossip_addr,
            leaving: false,
        };
        let chitchat_config = ChitchatConfig {
            chitchat_id: chitchat_id.clone(),
            cluster_id: config.cluster_id.clone(),
            gossip_interval: config.gossip_interval,
            listen_addr,
            seed_nodes: config.seeds.clone(),
            failure_detector_config: FailureDetectorConfig {
                phi_threshold: config.phi_threshold,
                sampling_window_size: SAMPLING_WINDOW_SIZE,
                max_interval: config.heartbeat_max_interval,
                initial_interval: config.heartbeat_initial_interval,
                dead_node_grace_period: config.dead_node_grace_period,
            },
            marked_for_deletion_grace_period: TOMBSTONE_GRACE_PERIOD,
            catchup_callback: None,
            extra_liveness_predicate: None,
            // V0 is readable by every chitchat release; digest compression
            // (V1) only pays off in clusters far larger than ours.
            protocol_version: ProtocolVersion::V0,
        };
        let initial_kvs = vec![
            (KEY_GRPC_ADDR.to_string(), config.grpc_advertise.to_string()),
            (KEY_PEER_ADDR.to_string(), config.peer_advertise.to_string()),
        ];
        let handle = spawn_chitchat(chitchat_config, initial_kvs, transport)
            .await
            .map_err(|e| MembershipError::Start(e.into()))?;
        info!(
            node_id = %config.node_id,
            generation = config.generation,
            %gossip_addr,
            grpc_addr = %config.grpc_advertise,
            peer_addr = %config.peer_advertise,
            seeds = %if config.seeds.is_empty() { "-".to_string() } else { config.seeds.join(",") },
            "membership started"
        );

        let chitchat = handle.chitchat();
        let live = chitchat.lock().await.live_nodes_watcher();
        let (view_tx, view_rx) = watch::channel(Arc::new(ClusterView::single(self_member.clone())));
        let (values_tx, values_rx) = watch::channel(Arc::new(MemberValues::new()));
        let fence_config = FenceConfig::new(config.cluster_size, !config.seeds.is_empty());
        let quorum = Quorum::new(fence_config, &config.node_id, config.clock.monotonic_ms());
        let (fence_tx, fence_rx) = watch::channel(Arc::new(Fence::closed(&config.node_id)));
        let (commands_tx, commands_rx) = mpsc::channel(4);
        let stop = cancel.child_token();
        let gossip_stopped = CancellationToken::new();
        let driver = Driver {
            chitchat,
            self_id: chitchat_id,
            self_member,
            leaving: false,
            live,
            view_tx,
            values_tx,
            last_run: std::time::Instant::now(),
            hold_removals_until: None,
            lost: reconnect::Lost::default(),
            warned_alone: None,
            gossip_stopped: gossip_stopped.clone(),
            quorum,
            fence_tx,
            clock: config.clock.clone(),
        };
        // In the caller's span (a node's), so view changes name the node that saw them.
        let driver = tokio::spawn(tracing::Instrument::in_current_span(driver.run(
            handle,
            commands_rx,
            stop.clone(),
        )));
        Ok(Membership {
            view: view_rx,
            fence: fence_rx,
            fence_clock: config.clock.clone(),
            values: values_rx,
            gossip_addr,
            commands: commands_tx,
            stop: stop.drop_guard(),
            driver,
            gossip_stopped,
        })
    }

    /// The current cluster view, updated whenever the live member set, a
    /// member's address, generation or `leaving` flag changes.
    pub fn view(&self) -> watch::Receiver<Arc<ClusterView>> {
        self.view.clone()
    }

    /// Whether this node may decide fenced rules' keys ([`quorum`]): a new snapshot
    /// every [`quorum::FENCE_TICK_MS`] and on every view change.
    pub fn fence(&self) -> watch::Receiver<Arc<Fence>> {
        self.fence.clone()
    }

    /// The clock whose monotonic reading the fence's leases are instants of.
    pub fn fence_clock(&self) -> Arc<dyn crate::clock::Clock> {
        self.fence_clock.clone()
    }

    /// Every view member's key-values, updated whenever one changes.
    pub fn values(&self) -> watch::Receiver<Arc<MemberValues>> {
        self.values.clone()
    }

    /// A handle that publishes this node's own key-values (the rules advert), for a task
    /// that outlives a borrow of the membership.
    pub fn publisher(&self) -> ValuePublisher {
        ValuePublisher(self.commands.clone())
    }

    /// Cancelled if gossip stopped on its own (its socket broke). The view is frozen
    /// from then on: this node would go on deciding by a ring nobody else has, and
    /// nobody would learn that it left, so its owner should stop it (a node exits) and
    /// let its supervisor start a fresh incarnation.
    pub fn gossip_stopped(&self) -> CancellationToken {
        self.gossip_stopped.clone()
    }

    /// The advertised gossip address: give it to other nodes as a seed.
    pub fn gossip_addr(&self) -> SocketAddr {
        self.gossip_addr
    }

    /// Starts a graceful leave: publishes `leaving = "true"`, so every node
    /// (this one first, before this returns) drops this node from its ring
    /// while it is still alive to hand its keys over. Irreversible for this
    /// generation.
    pub async fn announce_leaving(&self) {
        let (ack_tx, ack_rx) = oneshot::channel();
        if self
            .commands
            .send(Command::AnnounceLeaving(ack_tx))
            .await
            .is_err()
            || ack_rx.await.is_err()
        {
            warn!("announce_leaving after membership stopped; nothing announced");
        }
    }

    /// Stops gossip (without announcing a leave: call
    /// [`Membership::announce_leaving`] first for a graceful exit) and waits
    /// until the chitchat server has stopped. Peers then detect the node as
    /// dead after the failure-detection time.
    pub async fn shutdown(self) {
        let Membership { stop, driver, .. } = self;
        stop.disarm().cancel();
        if let Err(error) = driver.await {
            error!(%error, "membership driver task failed");
        }
    }
}

/// Picks the concrete gossip listen address: port 0 becomes a free port on
/// the same IP, found by opening and dropping a probe socket on `transport`
/// (chitchat's identity carries the address, so it must be known before
/// chitchat opens its own socket). Another process could grab the port in
/// between; chitchat then fails to bind and we report it.
async fn resolve_listen_addr(
    transport: &dyn Transport,
    listen: SocketAddr,
) -> Result<SocketAddr, MembershipError> {
    if listen.port() != 0 {
        return Ok(listen);
    }
    // The probe is dropped at the end of the arm, freeing the port again.
    let probed = match transport.open(listen).await {
        Ok(probe) => probe.local_addr(),
        Err(error) => Err(error),
    };
    probed.map_err(|source| MembershipError::Bind {
        addr: listen,
        source: source.into(),
    })
}

/// The task behind a [`Membership`]: owns the chitchat handle and the view
/// sender; the only place views are computed and published.
struct Driver {
    chitchat: Arc<Mutex<Chitchat>>,
    self_id: ChitchatId,
    self_member: Member,
    /// Set once we announced a leave; forces our own `leaving` flag in the
    /// local view until chitchat's watch catches up with the key-value.
    leaving: bool,
    live: watch::Receiver<BTreeMap<ChitchatId, NodeState>>,
    view_tx: watch::Sender<Arc<ClusterView>>,
    values_tx: watch::Sender<Arc<MemberValues>>,
    /// When this task last ran (a tick every gossip interval keeps it fresh).
    last_run: std::time::Instant,
    /// After this process was stalled (SIGSTOP, a starved machine), removals are held
    /// until then; see [`STALL`].
    hold_removals_until: Option<std::time::Instant>,
    /// Members lost without a leave, gossiped to directly until they are back
    /// (see [`reconnect`]).
    lost: reconnect::Lost,
    /// When this node last warned that it is alone in its view while it remembers
    /// lost members.
    warned_alone: Option<tokio::time::Instant>,
    /// Cancelled when chitchat's gossip loop ended on its own.
    gossip_stopped: CancellationToken,
    /// Heartbeats heard and when, for fencing.
    quorum: Quorum,
    fence_tx: watch::Sender<Arc<Fence>>,
    clock: Arc<dyn crate::clock::Clock>,
}

/// A gap this long between two runs of the driver means the process itself was frozen.
///
/// On waking up, chitchat's failure detector sees every peer silent for the whole pause
/// and declares them all dead for a gossip round, until their heartbeats arrive again.
/// Published, that view says "I own every key", and the node would decide keys it
/// never owned. So after a stall, members are only added, never removed, for
/// [`STALL_HOLD`]: long enough for gossip to refresh, short against failure detection.
const STALL: std::time::Duration = std::time::Duration::from_secs(1);
/// How often a node alone in its view says so while it knocks on lost members.
const ALONE_WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
/// How long removals are held after a stall.
const STALL_HOLD: std::time::Duration = std::time::Duration::from_millis(1500);

impl Driver {
    async fn run(
        mut self,
        handle: ChitchatHandle,
        mut commands: mpsc::Receiver<Command>,
        stop: CancellationToken,
    ) {
        let terminated = handle.termination_watcher();
        tokio::pin!(terminated);
        let mut gossip_running = true;
        let mut tick = tokio::time::interval(DEFAULT_GOSSIP_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut fence_tick = tokio::time::interval(Duration::from_millis(quorum::FENCE_TICK_MS));
        fence_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = fence_tick.tick() => self.measure().await,
                _ = tick.tick() => {
                    self.note_stall();
                    if self
                        .hold_removals_until
                        .is_some_and(|until| std::time::Instant::now() >= until)
                    {
                        self.hold_removals_until = None;
                        info!(node_id = %self.self_id.node_id, "stall hold over: publishing removals again");
                        self.publish();
                    }
                    self.reconnect(&handle);
                }
                result = &mut terminated, if gossip_running => {
                    // The gossip loop only ends on its own if its socket broke.
                    error!(?result, "chitchat stopped unexpectedly; cluster view frozen");
                    gossip_running = false;
                    self.gossip_stopped.cancel();
                }
                changed = self.live.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    self.publish();
                }
                Some(command) = commands.recv() => match command {
                    Command::AnnounceLeaving(ack) => {
                        self.chitchat
                            .lock()
                            .await
                            .self_node_state()
                            .set(KEY_LEAVING, "true");
                        self.leaving = true;
                        info!(node_id = %self.self_id.node_id, "announced graceful leave");
                        self.publish();
                        // Push the news now rather than at the next gossip
                        // round: saves up to one interval on every peer.
                        self.gossip_now(&handle);
                        let _ = ack.send(());
                    }
                    Command::Set(key, value) => {
                        self.chitchat.lock().await.self_node_state().set(key, value);
                        // Our own change shows in the live set after the next round;
                        // publishing now keeps local readers current.
                        self.publish();
                        // Push it now rather than at the next round (up to 200 ms, and
                        // more for peers a round does not pick): these values (the
                        // rules advert) are rare and others act on them.
                        self.gossip_now(&handle);
                    }
                },
            }
        }
        if let Err(error) = handle.shutdown().await {
            warn!(%error, "chitchat shutdown reported an error");
        }
        info!(node_id = %self.self_id.node_id, "membership stopped");
    }

    /// Read every incarnation's heartbeat into the fencing tracker and publish what
    /// this node may decide now.
    async fn measure(&mut self) {
        let now = self.clock.monotonic_ms();
        {
            let chitchat = self.chitchat.lock().await;
            self.quorum.heartbeats(
                chitchat.node_states().iter().map(|(id, state)| {
                    (&*id.node_id, id.generation_id, u64::from(state.heartbeat()))
                }),
                now,
            );
        }
        self.publish_fence(now);
    }

    /// The fence as of `now` for the current view.
    fn publish_fence(&mut self, now: u64) {
        let view = self.view_tx.borrow().clone();
        let fence = self.quorum.observe(&view, now);
        let majority = fence.holds_majority(now);
        if majority != self.fence_tx.borrow().holds_majority(now) {
            if majority {
                info!(node_id = %self.self_id.node_id, basis = ?fence.basis, "fence: a majority is heard; fenced rules are decided here again");
            } else {
                warn!(node_id = %self.self_id.node_id, basis = ?fence.basis, "fence: no majority heard; fenced rules are denied here (degraded)");
            }
        }
        metrics::gauge!("ringlimit_fence_majority").set(if majority { 1.0 } else { 0.0 });
        self.fence_tx.send_replace(Arc::new(fence));
    }

    /// Gossips with every live peer at once instead of waiting for the next round.
    fn gossip_now(&self, handle: &ChitchatHandle) {
        let peers: Vec<SocketAddr> = self
            .live
            .borrow()
            .keys()
            .filter(|id| **id != self.self_id)
            .map(|id| id.gossip_advertise_addr)
            .collect();
        for peer in peers {
            if let Err(error) = handle.gossip(peer) {
                debug!(%peer, %error, "immediate gossip failed");
            }
        }
    }

    /// Gossips directly to the members lost without a leave that are due (see
    /// [`reconnect`]), instead of waiting for chitchat's random picks to find them.
    fn reconnect(&mut self, handle: &ChitchatHandle) {
        let now = tokio::time::Instant::now();
        let alone = self.view_tx.borrow().members.len() <= 1;
        let due = self.lost.due(now, alone);
        if alone && !due.is_empty() {
            let warn_due = self
                .warned_alone
                .is_none_or(|at| now.saturating_duration_since(at) >= ALONE_WARN_EVERY);
            if warn_due {
                self.warned_alone = Some(now);
                warn!(
                    node_id = %self.self_id.node_id,
                    lost = due.len(),
                    "alone in the cluster view: gossiping to every member lost without a leave"
                );
            }
        }
        for peer in due {
            if let Err(error) = handle.gossip(peer) {
                debug!(%peer, %error, "reconnect gossip failed");
            }
        }
    }

    /// Notice whether this task was frozen since it last ran; if so, hold removals.
    fn note_stall(&mut self) {
        let now = std::time::Instant::now();
        let gap = now.duration_since(self.last_run);
        self.last_run = now;
        if gap >= STALL {
            warn!(
                node_id = %self.self_id.node_id,
                gap_ms = gap.as_millis() as u64,
                "this process was stalled: holding member removals while gossip catches up"
            );
            self.hold_removals_until = Some(now + STALL_HOLD);
        }
    }

    /// Recomputes the view from the latest live set and publishes it if the
    /// members changed.
    fn publish(&mut self) {
        self.note_stall();
        let view = {
            let live = self.live.borrow_and_update();
            let mut nodes: Vec<LiveNode> = live.iter().map(|(id, s)| live_node(id, s)).collect();
            // Chitchat always lists itself once it ran a round; before that the
            // set is empty, and we must never vanish from our own view.
            if !live.contains_key(&self.self_id) {
                nodes.push(LiveNode {
                    node_id: self.self_member.node_id.clone(),
                    generation: self.self_member.generation,
                    gossip_addr: self.self_member.gossip_addr,
                    kvs: BTreeMap::from([
                        (
                            KEY_GRPC_ADDR.to_string(),
                            self.self_member.grpc_addr.to_string(),
                        ),
                        (
                            KEY_PEER_ADDR.to_string(),
                            self.self_member.peer_addr.to_string(),
                        ),
                    ]),
                });
            }
            if self.leaving {
                for node in &mut nodes {
                    if node.node_id == *self.self_id.node_id
                        && node.generation == self.self_id.generation_id
                    {
                        node.kvs.insert(KEY_LEAVING.to_string(), "true".to_string());
                    }
                }
            }
            let view = build_view_after(Some(&self.view_tx.borrow()), nodes.iter().cloned());
            let values: MemberValues = view
                .members
                .iter()
                .filter_map(|m| {
                    let node = nodes
                        .iter()
                        .find(|n| n.node_id == m.node_id && n.generation == m.generation)?;
                    Some((m.node_id.clone(), node.kvs.clone()))
                })
                .collect();
            self.values_tx.send_if_modified(|current| {
                if **current == values {
                    return false;
                }
                *current = Arc::new(values);
                true
            });
            view
        };
        let view = match self.hold_removals_until {
            Some(until) if std::time::Instant::now() < until => {
                // Keep members that vanished only because we were frozen.
                let current = self.view_tx.borrow().clone();
                let mut members = view.members.clone();
                for old in &current.members {
                    if view.member(&old.node_id).is_none() {
                        members.push(old.clone());
                    }
                }
                ClusterView::from_members(members)
            }
            _ => view,
        };
        let now = tokio::time::Instant::now();
        let lost = &mut self.lost;
        let changed = self.view_tx.send_if_modified(|current| {
            if **current == view {
                return false;
            }
            lost.note_views(current, &view, now);
            *current = Arc::new(view);
            true
        });
        if changed {
            // Members added to the view take ranges away at once (the fence's ring).
            self.publish_fence(self.clock.monotonic_ms());
            let view = self.view_tx.borrow();
            info!(
                node_id = %self.self_id.node_id,
                members = %view
                    .members
                    .iter()
                    .map(|m| if m.leaving { format!("{} (leaving)", m.node_id) } else { m.node_id.clone() })
                    .collect::<Vec<_>>()
                    .join(","),
                ring = %view.ring.members().join(","),
                ring_digest = format_args!("{:#018x}", view.ring.digest()),
                "cluster view changed"
            );
        } else {
            debug!(node_id = %self.self_id.node_id, "live set changed, view unchanged");
        }
    }
}

/// Copies one chitchat live node into plain data for [`build_view`].
fn live_node(id: &ChitchatId, state: &NodeState) -> LiveNode {
    LiveNode {
        node_id: id.node_id.to_string(),
        generation: id.generation_id,
        gossip_addr: id.gossip_advertise_addr,
        kvs: state
            .key_values()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}
