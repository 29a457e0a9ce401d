//! The peer client adapter: forwarding checks to their owner over one persistent
//! HTTP/2 channel per peer, with the checks bound for one peer coalesced into batches;
//! refunds and handed-over state go the same way.
//!
//! This file and `server::peer` are the only places that see the peer API's prost
//! types: the router hands over [`CheckItem`]s and gets [`Remote`] answers back.
//!
//! Each peer has a batcher task fed by a bounded channel. It takes whatever checks are
//! queued (up to `max_batch`), optionally waits `flush_delay` for more, and sends them
//! as one batch. At most `max_in_flight` batches (default 1) are out at once to one
//! peer; while that many are out, new checks queue and leave together when an answer
//! returns. So an idle link sends each check at once, and under load the batches grow
//! with the load instead of every check paying for a call of its own.
//!
//! Batches travel on one long-lived `Peer/ForwardStream` per peer (a `Session`): each
//! is one message out and one back, numbered so the answers can come in any order. A
//! unary call per batch would cost both nodes HTTP/2 headers, a new stream, a server
//! task, the call's proof and its tower stack every time; on a stream they are paid
//! once. The stream's driver task hands each answer straight to the callers of its
//! batch, so a batch costs no task or channel of its own either (the unary path spawns
//! one call per batch). A stream is replaced after `stream_max_age` (the old one finishes the
//! batches it carries), so a server's connection age limit, which closes a connection
//! 30 s after its GOAWAY by default, never cuts a stream in the middle of a batch; a
//! broken stream fails the batches it carried (their checks fall back, as on any
//! failed call) and the next batch opens a new one. A peer that does not know the
//! stream (an older build answers `UNIMPLEMENTED`) gets unary `Peer/Forward` calls from
//! then on; the one batch that found out falls back.
//!
//! Every forward has a deadline. A check whose owner does not answer in time comes
//! back as [`ForwardError`]; the router then fails open (or closed, per rule). A batch
//! carries its most urgent check's deadline, and checks whose caller already gave up
//! are left out of the batch rather than charged on the owner. A batch still waiting
//! at its deadline gives its in-flight slot back, so an owner that stops answering
//! without closing the stream (paused, partitioned) holds up no later batch.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dashmap::DashMap;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::transport::{Channel, Endpoint};

use crate::algorithms::{AlgorithmKind, Decision, Millis};
use crate::cluster::rules::{Refusal, RulesEdit, Written};
use crate::cluster::{CheckItem, Decider, InlineRule, InlineRules, NamedRule, Remote};
use crate::config::rules::{RulesSource, Stamp};
use crate::keyring::{Keyring, CALL_HEADER};
use crate::membership::Member;
use crate::proto::peer::peer_client::PeerClient;
use crate::proto::peer::{
    ForwardAnswer, ForwardCall, ForwardItem, ForwardOutcome, ForwardRequest, ForwardResponse,
    InstallRequest, KeyState as WireState, RefundItem as WireRefund, RefundRequest, RulesRequest,
    WriteRulesRequest,
};
use crate::shard::Exported;

/// How the numbers of an inline rule travel.
fn wire_inline(r: InlineRule) -> crate::proto::peer::InlineRule {
    crate::proto::peer::InlineRule {
        algorithm: r.kind.as_str().to_string(),
        limit: r.limit,
        window_ms: r.window_ms,
        burst: r.burst,
    }
}

/// How a rule found by name travels to the owner.
fn wire_named(named: &NamedRule) -> crate::proto::peer::NamedRule {
    let (override_limit, override_unit_seconds) = named.override_limit.unwrap_or((0, 0));
    crate::proto::peer::NamedRule {
        name: named.name.to_string(),
        override_limit,
        override_unit_seconds,
        inline: named.inline.map(wire_inline),
    }
}

/// Forwarding settings.
#[derive(Debug, Clone)]
pub struct ForwardConfig {
    /// How long a forwarded check may take before the receiving node gives up on the
    /// owner and falls back.
    pub timeout: Duration,
    /// How long a batcher waits for more checks once it has one (0: send what is queued).
    pub flush_delay: Duration,
    /// Most checks in one forwarded batch.
    pub max_batch: usize,
    /// Most `Forward` calls in flight to one peer (0: no limit). While the limit is
    /// reached, checks queue and leave together as the next batch when a call returns:
    /// under load batches grow with the load, and an idle link adds no wait.
    pub max_in_flight: usize,
    /// Checks queued per peer before new ones are failed over at once.
    pub queue: usize,
    /// A forward stream is replaced once it is this old (see the module doc): keep it
    /// well inside the grace a peer's server gives a connection's streams after its
    /// GOAWAY (30 s by default).
    pub stream_max_age: Duration,
    /// Forward on one `ForwardStream` per peer; `false`: a unary `Forward` call per batch
    /// (`--forward-unary`).
    pub stream: bool,
    /// Source IP for outbound peer connections (so partition rules that match a
    /// node's address also match its outbound traffic); `None` lets the OS choose.
    pub local_ip: Option<IpAddr>,
    /// The cluster key every peer call is signed with; `None` sends unsigned calls
    /// (a node whose peers accept them: `--insecure-cluster`, or a lone loopback node).
    pub keyring: Option<Keyring>,
    /// Mutual TLS to peers (`https`, this node's certificate, the cluster CA);
    /// `None`: plain HTTP/2.
    pub tls: Option<tonic::transport::ClientTlsConfig>,
}

impl Default for ForwardConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_millis(250),
            flush_delay: Duration::ZERO,
            max_batch: 1000,
            max_in_flight: 1,
            queue: 16_384,
            stream_max_age: Duration::from_secs(15),
            stream: true,
            local_ip: None,
            keyring: None,
            tls: None,
        }
    }
}

/// Why a forwarded check got no answer from its owner.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ForwardError {
    /// No answer within the deadline.
    #[error("owner {0} did not answer within the deadline")]
    Timeout(String),
    /// The call failed (connection refused, reset, owner shutting down).
    #[error("owner {0} unreachable: {1}")]
    Unreachable(String, String),
    /// The peer's queue is full.
    #[error("forward queue to {0} is full")]
    Overloaded(String),
}

/// The coordinator's answer to a rules write.
#[derive(Debug, Clone)]
pub struct WriteOutcome {
    /// What it wrote.
    pub written: Written,
    /// The document it now enforces, canonical JSON.
    pub document: String,
}

/// Why a rules write sent to the coordinator did not succeed.
#[derive(Debug)]
pub enum RemoteWriteError {
    /// The coordinator refused it (nothing changed there).
    Refused(Refusal, String),
    /// It could not be asked (or did not answer): nothing is known to have changed.
    Failed(ForwardError),
}

/// A peer's rule set as it sent it, not yet checked.
#[derive(Debug, Clone)]
pub struct PulledRules {
    /// Where the peer's rules come from (`None`: a source this node does not know).
    pub source: Option<RulesSource>,
    /// The stamp it claims.
    pub stamp: Stamp,
    /// The document, canonical JSON.
    pub document: String,
}

struct Pending {
    item: ForwardItem,
    /// The rule this node matched for the item: the owner matches the same one (same
    /// rules everywhere but during a reload), so its answer naming it costs no copy.
    rule: Arc<str>,
    /// When the caller stops waiting for this check.
    deadline: tokio::time::Instant,
    reply: oneshot::Sender<Result<Remote, ForwardError>>,
}

struct Link {
    generation: u64,
    addr: SocketAddr,
    queue: mpsc::Sender<Pending>,
    client: PeerClient<Signed>,
    created: std::time::Instant,
}

/// Batches queued for one stream's request body. At most `max_in_flight` are out, so
/// only an unlimited setting (0) can fill it; a batch that finds it full fails over.
const STREAM_FRAMES: usize = 64;

/// Where the answers of one peer's batches go.
///
/// Batches leave on the current [`Session`], a `ForwardStream`, replaced when it breaks
/// or ages, or as unary calls once the peer turned out not to know the stream. A batch
/// on a stream waits in `waiting` with its callers' reply channels; the stream's driver
/// task hands each answer straight to those callers, so a batch costs no task and no
/// channel of its own.
struct Streams {
    client: PeerClient<Signed>,
    peer: Arc<str>,
    max_age: Duration,
    state: Mutex<StreamState>,
    /// The peer answered `UNIMPLEMENTED`: send `Forward` calls.
    unary: AtomicBool,
    /// How long a stream may take to open, and how long a retired link's driver
    /// still waits for answers: the forward deadline, after which no caller waits.
    patience: Duration,
    /// The node's shutdown: ends every driver at once.
    cancel: CancellationToken,
    /// Cancelled when the link's batcher ends (the link was replaced): no batch will be
    /// sent any more, and the drivers end once what they carry is answered or due.
    retired: CancellationToken,
    /// Where the drivers and unary calls run, so the node's shutdown waits for them.
    tracker: TaskTracker,
    opened: metrics::Counter,
}

#[derive(Default)]
struct StreamState {
    current: Option<Session>,
    next_session: u64,
    next_call: u64,
    waiting: HashMap<u64, Waiting>,
}

/// One `ForwardStream`: its request body. The driver reading its answers holds the
/// [`Streams`] but not this sender, so once a session is replaced the request body
/// ends, the peer answers what it holds and ends its side, and the driver stops.
struct Session {
    id: u64,
    frames: mpsc::Sender<ForwardCall>,
    opened: std::time::Instant,
}

/// Per check of a batch, in order: the rule this node matched and the caller's reply.
type Replies = Vec<(Arc<str>, oneshot::Sender<Result<Remote, ForwardError>>)>;

/// A batch sent and not answered yet.
struct Waiting {
    session: u64,
    replies: Replies,
    deadline: tokio::time::Instant,
    /// The batch's in-flight slot, free again when it is answered, fails or expires.
    _slot: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Waiting {
    fn fail(self, error: &ForwardError) {
        for (_, reply) in self.replies {
            let _ = reply.send(Err(error.clone()));
        }
    }
}

impl Streams {
    fn lock(&self) -> std::sync::MutexGuard<'_, StreamState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Send `request` on the current stream (opened first if there is none, it broke or
    /// it aged); its answers go to `replies`. The batch fails over at once if the
    /// stream's queue is full.
    fn send(
        self: &Arc<Self>,
        request: ForwardRequest,
        replies: Replies,
        deadline: tokio::time::Instant,
        slot: Option<tokio::sync::OwnedSemaphorePermit>,
    ) {
        let mut state = self.lock();
        Self::expire_locked(&mut state, tokio::time::Instant::now(), &self.peer);
        let call = state.next_call;
        state.next_call += 1;
        let mut frame = ForwardCall {
            call,
            request: Some(request),
        };
        // A driver can end between two batches; nothing was sent on its stream then,
        // so the batch goes on a fresh one.
        for _ in 0..2 {
            let session = self.current_locked(&mut state);
            let id = session.id;
            match session.frames.try_send(frame) {
                Ok(()) => {
                    state.waiting.insert(
                        call,
                        Waiting {
                            session: id,
                            replies,
                            deadline,
                            _slot: slot,
                        },
                    );
                    return;
                }
                Err(mpsc::error::TrySendError::Full(_)) => {
                    drop(state);
                    let error = ForwardError::Overloaded(self.peer.to_string());
                    for (_, reply) in replies {
                        let _ = reply.send(Err(error.clone()));
                    }
                    return;
                }
                Err(mpsc::error::TrySendError::Closed(back)) => {
                    frame = back;
                    state.current = None;
                }
            }
        }
        drop(state);
        let error =
            ForwardError::Unreachable(self.peer.to_string(), "forward stream closed".into());
        for (_, reply) in replies {
            let _ = reply.send(Err(error.clone()));
        }
    }

    /// The session to send on, opening a new stream when needed.
    fn current_locked<'a>(self: &Arc<Self>, state: &'a mut StreamState) -> &'a Session {
        let fresh = state
            .current
            .as_ref()
            .is_some_and(|s| s.opened.elapsed() < self.max_age);
        if !fresh {
            let (frames, body) = mpsc::channel(STREAM_FRAMES);
            let id = state.next_session;
            state.next_session += 1;
            self.opened.increment(1);
            self.tracker
                .spawn(tracing::Instrument::in_current_span(drive(
                    self.clone(),
                    id,
                    body,
                )));
            state.current = Some(Session {
                id,
                frames,
                opened: std::time::Instant::now(),
            });
        }
        state.current.as_ref().expect("just set")
    }

    /// Hand an answer to the callers of its batch (a batch that expired is gone).
    fn deliver(&self, answer: ForwardAnswer) {
        let Some(waiting) = self.lock().waiting.remove(&answer.call) else {
            return;
        };
        let result = match answer.response {
            Some(response) if answer.code == 0 => Ok(response),
            _ if answer.code == 0 => Err(ForwardError::Unreachable(
                self.peer.to_string(),
                "an answer without a response".into(),
            )),
            _ => Err(ForwardError::Unreachable(
                self.peer.to_string(),
                answer.message,
            )),
        };
        answer_callers(result, waiting.replies, &self.peer);
    }

    /// Session `id` ended: fail its batches still waiting, and open a new stream for
    /// the next batch.
    fn close(&self, id: u64, error: &ForwardError) {
        let failed: Vec<Waiting> = {
            let mut state = self.lock();
            if state.current.as_ref().is_some_and(|s| s.id == id) {
                state.current = None;
            }
            let calls: Vec<u64> = state
                .waiting
                .iter()
                .filter(|(_, w)| w.session == id)
                .map(|(&call, _)| call)
                .collect();
            calls
                .into_iter()
                .filter_map(|call| state.waiting.remove(&call))
                .collect()
        };
        for waiting in failed {
            waiting.fail(error);
        }
    }

    /// Fail the batches past their deadline (their callers have stopped waiting), so
    /// their in-flight slots are free again even if the peer never answers.
    fn expire(&self, now: tokio::time::Instant) {
        Self::expire_locked(&mut self.lock(), now, &self.peer);
    }

    fn expire_locked(state: &mut StreamState, now: tokio::time::Instant, peer: &str) {
        if state.waiting.values().all(|w| w.deadline > now) {
            return;
        }
        let error = ForwardError::Timeout(peer.to_string());
        state.waiting.retain(|_, w| {
            if w.deadline > now {
                return true;
            }
            for (_, reply) in w.replies.drain(..) {
                let _ = reply.send(Err(error.clone()));
            }
            false
        });
    }

    /// When the most urgent waiting batch is due.
    fn next_deadline(&self) -> Option<tokio::time::Instant> {
        self.lock().waiting.values().map(|w| w.deadline).min()
    }
}

/// Open one `ForwardStream` with `body` as its request stream and hand each answer to
/// its batch until the stream ends, the link goes or the node stops; then fail what is
/// still waiting on it.
async fn drive(streams: Arc<Streams>, id: u64, body: mpsc::Receiver<ForwardCall>) {
    let read = async {
        let mut client = streams.client.clone();
        // An owner that accepted the connection but never answers the stream's headers
        // (paused, or the connection at its stream limit) must not keep the session
        // current: every batch on it would wait for its deadline.
        let opened = tokio::time::timeout(
            streams.patience,
            client.forward_stream(tokio_stream::wrappers::ReceiverStream::new(body)),
        )
        .await;
        let Ok(opened) = opened else {
            return "the forward stream did not open in time".to_string();
        };
        let mut answers = match opened {
            Ok(response) => response.into_inner(),
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                streams.unary.store(true, Ordering::Relaxed);
                tracing::info!(peer = %streams.peer, "peer does not stream forwards (an older build): using unary calls");
                return status.message().to_string();
            }
            Err(status) => return status.message().to_string(),
        };
        loop {
            match answers.message().await {
                Ok(Some(answer)) => streams.deliver(answer),
                Ok(None) => return "forward stream ended".to_string(),
                Err(status) => return status.message().to_string(),
            }
        }
    };
    let retired = async {
        streams.retired.cancelled().await;
        tokio::time::sleep(streams.patience).await;
    };
    let why = tokio::select! {
        why = read => why,
        _ = streams.cancel.cancelled() => "node shutting down".to_string(),
        _ = retired => "link replaced".to_string(),
    };
    streams.close(
        id,
        &ForwardError::Unreachable(streams.peer.to_string(), why),
    );
}

/// Answer each check of a batch from the owner's response (or fail them all).
fn answer_callers(
    result: Result<ForwardResponse, ForwardError>,
    replies: Replies,
    peer: &Arc<str>,
) {
    match result {
        Ok(response) if response.outcomes.len() == replies.len() => {
            // The owner is the peer this link was made for (unless a node with
            // another id took its address): its id is shared, not copied.
            let node_id = if *response.node_id == **peer {
                peer.clone()
            } else {
                Arc::from(response.node_id.as_str())
            };
            let decider = Decider {
                node_id,
                generation: response.generation,
            };
            for (outcome, (rule, reply)) in response.outcomes.into_iter().zip(replies) {
                let _ = reply.send(Ok(remote(outcome, &decider, rule)));
            }
        }
        Ok(response) => {
            let error = ForwardError::Unreachable(
                peer.to_string(),
                format!(
                    "{} answers for {} checks",
                    response.outcomes.len(),
                    replies.len()
                ),
            );
            for (_, reply) in replies {
                let _ = reply.send(Err(error.clone()));
            }
        }
        Err(error) => {
            for (_, reply) in replies {
                let _ = reply.send(Err(error.clone()));
            }
        }
    }
}

/// A link that timed out is replaced by a fresh connection, but at most this often.
///
/// After a partition heals, the old TCP connection can sit in retransmission back-off
/// for seconds (the RTO doubles with every lost segment) while a new connection would
/// work at once; without the reset, entry nodes keep failing open long after the
/// network is back.
const RECONNECT_AFTER: Duration = Duration::from_secs(1);

/// Connections to every peer this node has forwarded to.
#[derive(Clone)]
pub struct PeerPool {
    me: Arc<str>,
    /// The span the pool was made in (the node's): batchers are spawned from request
    /// contexts, and their logs should still name the node.
    span: tracing::Span,
    config: ForwardConfig,
    links: Arc<DashMap<String, Arc<Link>>>,
    tracker: TaskTracker,
    cancel: CancellationToken,
    /// The node's inline rules: handed-over state of one carries its numbers.
    inline: Arc<InlineRules>,
}

impl std::fmt::Debug for PeerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerPool")
            .field("me", &self.me)
            .field("peers", &self.links.len())
            .finish()
    }
}

impl PeerPool {
    /// A pool whose batcher tasks run on `tracker` until `cancel`.
    pub fn new(
        me: Arc<str>,
        config: ForwardConfig,
        tracker: TaskTracker,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            me,
            span: tracing::Span::current(),
            config,
            links: Arc::new(DashMap::new()),
            tracker,
            cancel,
            inline: Arc::default(),
        }
    }

    /// This pool naming the numbers of the node's inline rules in handed-over state.
    pub fn with_inline(mut self, inline: Arc<InlineRules>) -> Self {
        self.inline = inline;
        self
    }

    /// The forwarding settings.
    pub fn config(&self) -> &ForwardConfig {
        &self.config
    }

    /// Forward one check to `owner` and wait for its answer (batched with other checks
    /// for the same owner).
    pub async fn forward(&self, owner: &Member, item: &CheckItem) -> Result<Remote, ForwardError> {
        let link = self.link(owner);
        let item_rule = item.rule.name.clone();
        let item = ForwardItem {
            key: item.client().to_string(),
            route: item.route().to_string(),
            tier: item.tier.as_deref().map(str::to_string),
            cost: item.cost.get(),
            hops: 1,
            named: item.named.as_ref().map(wire_named),
            give_back: item.give_back.map_or(0, NonZeroU64::get),
            drain: item.drain,
            peek: item.peek,
            rule_hash: rule_hash(&item_rule),
        };
        let (reply, rx) = oneshot::channel();
        let deadline = tokio::time::Instant::now() + self.config.timeout;
        link.queue
            .try_send(Pending {
                item,
                rule: item_rule,
                deadline,
                reply,
            })
            .map_err(|_| ForwardError::Overloaded(owner.node_id.clone()))?;
        let result = match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(ForwardError::Unreachable(
                owner.node_id.clone(),
                "batcher stopped".into(),
            )),
            Err(_) => Err(ForwardError::Timeout(owner.node_id.clone())),
        };
        // A full queue says nothing about the connection; a timeout or a failed call may.
        let suspect = matches!(
            result,
            Err(ForwardError::Timeout(_) | ForwardError::Unreachable(..))
        );
        if suspect && link.created.elapsed() >= RECONNECT_AFTER {
            // Drop the link only if it is still the one that failed (not already
            // replaced by a concurrent caller); the next forward connects afresh.
            // Batches already on the old link's stream still get their answers: its
            // driver goes on until the owner has answered them (or they are due).
            self.links
                .remove_if(&owner.node_id, |_, current| current.created == link.created);
        }
        result
    }

    /// Give back admitted checks on `owner`. Best effort within the deadline: a refund
    /// that cannot be delivered leaves the owner's count higher than necessary, which
    /// can only cause a spurious deny, never an over-admission.
    /// Each item quotes the owner's clock at its admission.
    pub async fn refund(
        &self,
        owner: &Member,
        items: &[(CheckItem, Millis)],
    ) -> Result<(), ForwardError> {
        let mut client = self.link(owner).client.clone();
        let items = items
            .iter()
            .map(|(item, at)| WireRefund {
                key: item.client().to_string(),
                route: item.route().to_string(),
                tier: item.tier.as_deref().map(str::to_string),
                cost: item.cost.get(),
                at: *at,
                named: item.named.as_ref().map(wire_named),
            })
            .collect();
        match tokio::time::timeout(self.config.timeout, client.refund(RefundRequest { items }))
            .await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(status)) => Err(ForwardError::Unreachable(
                owner.node_id.clone(),
                status.message().to_string(),
            )),
            Err(_) => Err(ForwardError::Timeout(owner.node_id.clone())),
        }
    }

    /// Push handed-over state to `owner`; returns how many keys it installed.
    pub async fn install(&self, owner: &Member, states: &[Exported]) -> Result<u64, ForwardError> {
        let mut client = self.link(owner).client.clone();
        let request = InstallRequest {
            from_node: self.me.to_string(),
            states: states
                .iter()
                .map(|item| WireState {
                    placement: item.id.placement,
                    id: item.id.disc,
                    fingerprint: item.fingerprint,
                    algorithm: item.state.kind().as_str().to_string(),
                    words: item.state.to_words(),
                    inline: self.inline.inline_of(item.fingerprint).map(wire_inline),
                })
                .collect(),
        };
        // Handoff is not on a caller's path: give it more time than a check.
        let deadline = self.config.timeout.max(Duration::from_secs(5));
        match tokio::time::timeout(deadline, client.install(request)).await {
            Ok(Ok(response)) => Ok(response.into_inner().installed),
            Ok(Err(status)) => Err(ForwardError::Unreachable(
                owner.node_id.clone(),
                status.message().to_string(),
            )),
            Err(_) => Err(ForwardError::Timeout(owner.node_id.clone())),
        }
    }

    /// Fetch `peer`'s rule set (its document as canonical JSON and the stamp it claims),
    /// for a node that saw a newer stamp in gossip. Checking the document is the caller's
    /// job: nothing a peer sends is enforced unvalidated.
    pub async fn pull_rules(&self, peer: &Member) -> Result<PulledRules, ForwardError> {
        let mut client = self.link(peer).client.clone();
        let request = RulesRequest {
            from_node: self.me.to_string(),
        };
        let deadline = self.config.timeout.max(Duration::from_secs(2));
        match tokio::time::timeout(deadline, client.rules(request)).await {
            Ok(Ok(response)) => {
                let r = response.into_inner();
                Ok(PulledRules {
                    source: RulesSource::parse(&r.source),
                    stamp: Stamp {
                        version: r.version,
                        digest: r.digest,
                    },
                    document: r.document,
                })
            }
            Ok(Err(status)) => Err(ForwardError::Unreachable(
                peer.node_id.clone(),
                status.message().to_string(),
            )),
            Err(_) => Err(ForwardError::Timeout(peer.node_id.clone())),
        }
    }

    /// Send a rules write to the coordinator `peer` and wait for its answer: what it
    /// wrote and the document it now enforces, or its refusal.
    pub async fn write_rules(
        &self,
        peer: &Member,
        if_match: Option<u64>,
        edit: &RulesEdit,
    ) -> Result<WriteOutcome, RemoteWriteError> {
        let mut client = self.link(peer).client.clone();
        let (kind, tier, route_pattern, body) = match edit {
            RulesEdit::Replace(doc) => ("replace", String::new(), None, doc.to_json()),
            RulesEdit::ReplaceEnvoy(envoy) => (
                "replace_envoy",
                String::new(),
                None,
                serde_json::to_string(envoy).expect("an envoy section serializes"),
            ),
            RulesEdit::PutTierLimit { tier, limit } => (
                "put_tier_limit",
                tier.clone(),
                None,
                serde_json::to_string(limit).expect("a tier limit serializes"),
            ),
            RulesEdit::DeleteTierLimit { tier, route } => (
                "delete_tier_limit",
                tier.clone(),
                route.clone(),
                String::new(),
            ),
        };
        let request = WriteRulesRequest {
            from_node: self.me.to_string(),
            if_match,
            kind: kind.to_string(),
            tier,
            route_pattern,
            body,
        };
        let deadline = self.config.timeout.max(Duration::from_secs(5));
        match tokio::time::timeout(deadline, client.write_rules(request)).await {
            Ok(Ok(response)) => {
                let r = response.into_inner();
                Ok(WriteOutcome {
                    written: Written {
                        stamp: Stamp {
                            version: r.version,
                            digest: r.digest,
                        },
                        changed: r.changed,
                        rule: (!r.rule.is_empty()).then_some(r.rule),
                        coordinator: peer.node_id.clone(),
                    },
                    document: r.document,
                })
            }
            Ok(Err(status)) => {
                let kind = match status.code() {
                    tonic::Code::InvalidArgument => Some(Refusal::Invalid),
                    tonic::Code::FailedPrecondition => Some(Refusal::Stale),
                    tonic::Code::NotFound => Some(Refusal::NotFound),
                    tonic::Code::PermissionDenied => Some(Refusal::ReadOnly),
                    tonic::Code::Internal => Some(Refusal::Internal),
                    tonic::Code::Aborted => Some(Refusal::Unavailable),
                    _ => None,
                };
                Err(match kind {
                    Some(kind) => RemoteWriteError::Refused(kind, status.message().to_string()),
                    None => RemoteWriteError::Failed(ForwardError::Unreachable(
                        peer.node_id.clone(),
                        status.message().to_string(),
                    )),
                })
            }
            Err(_) => Err(RemoteWriteError::Failed(ForwardError::Timeout(
                peer.node_id.clone(),
            ))),
        }
    }

    /// The link to `owner`, created (or replaced, if the owner restarted or moved) on demand.
    fn link(&self, owner: &Member) -> Arc<Link> {
        if let Some(link) = self.links.get(&owner.node_id) {
            if link.generation == owner.generation && link.addr == owner.peer_addr {
                return link.clone();
            }
        }
        let scheme = if self.config.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{}", owner.peer_addr))
            .expect("a socket address is a valid URI")
            .connect_timeout(self.config.timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_while_idle(true);
        if let Some(ip) = self.config.local_ip {
            endpoint = endpoint.local_address(Some(ip));
        }
        if let Some(tls) = &self.config.tls {
            // Checked once at start (`node::grpc::client_tls`), so this cannot fail here;
            // if it ever did, the link stays plain and the peer refuses it: loud, not open.
            endpoint = match endpoint.clone().tls_config(tls.clone()) {
                Ok(with_tls) => with_tls,
                Err(error) => {
                    tracing::error!(%error, "peer TLS configuration refused; peer calls will fail");
                    endpoint
                }
            };
        }
        let client = PeerClient::new(Signed::new(
            endpoint.connect_lazy(),
            self.config.keyring.clone(),
            self.me.clone(),
        ));
        let (queue, rx) = mpsc::channel(self.config.queue.max(1));
        let link = Arc::new(Link {
            generation: owner.generation,
            addr: owner.peer_addr,
            queue,
            client: client.clone(),
            created: std::time::Instant::now(),
        });
        // Replacing the link drops the old sender, which ends the old batcher; its
        // `Retire` guard closes the old stream, whose driver ends once the owner has
        // answered what it carries (or that is due).
        self.links.insert(owner.node_id.clone(), link.clone());
        let peer: Arc<str> = Arc::from(owner.node_id.as_str());
        let streams = Arc::new(Streams {
            client,
            peer,
            max_age: self.config.stream_max_age,
            state: Mutex::default(),
            unary: AtomicBool::new(!self.config.stream),
            patience: self.config.timeout,
            cancel: self.cancel.clone(),
            retired: CancellationToken::new(),
            tracker: self.tracker.clone(),
            opened: metrics::counter!("ringlimit_forward_streams_opened_total"),
        });
        self.tracker.spawn(tracing::Instrument::instrument(
            batcher(rx, streams, self.config.clone(), self.cancel.clone()),
            self.span.clone(),
        ));
        link
    }
}

/// Coalesce queued checks for one peer into batches, sent on the peer's stream (or as
/// `Forward` calls to a peer without it).
async fn batcher(
    mut rx: mpsc::Receiver<Pending>,
    streams: Arc<Streams>,
    config: ForwardConfig,
    cancel: CancellationToken,
) {
    let _retire = Retire(streams.clone());
    let max = config.max_batch.max(1);
    let batches = metrics::histogram!("ringlimit_forward_batch_size");
    let in_flight = (config.max_in_flight > 0)
        .then(|| Arc::new(tokio::sync::Semaphore::new(config.max_in_flight)));
    // One buffer for every batch: a `Pending` is a few hundred bytes, and a buffer per
    // batch was the largest allocation of a forwarded check.
    let mut batch = Vec::with_capacity(64);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            received = rx.recv_many(&mut batch, max) => if received == 0 { return },
        }
        // Wait for a free slot; checks that arrive meanwhile join this batch. A batch
        // the peer never answers gives its slot back at its deadline.
        let permit = match &in_flight {
            Some(slots) => loop {
                let due = streams.next_deadline();
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    permit = slots.clone().acquire_owned() => break permit.ok(),
                    _ = sleep_until_some(due) => streams.expire(tokio::time::Instant::now()),
                }
            },
            None => None,
        };
        while batch.len() < max {
            match rx.try_recv() {
                Ok(pending) => batch.push(pending),
                Err(_) => break,
            }
        }
        if !config.flush_delay.is_zero() && batch.len() < max {
            let until = tokio::time::Instant::now() + config.flush_delay;
            while batch.len() < max {
                let room = max - batch.len();
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => break,
                    received = rx.recv_many(&mut batch, room) => if received == 0 { break },
                }
            }
        }
        // A caller that stopped waiting has answered from its fallback: charging its
        // check on the owner now would count an admission nobody made.
        batch.retain(|p| !p.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        batches.record(batch.len() as f64);
        let (request, replies, deadline) = request_of(batch.drain(..));
        if streams.unary.load(Ordering::Relaxed) {
            streams
                .tracker
                .spawn(tracing::Instrument::in_current_span(send_unary(
                    streams.clone(),
                    request,
                    replies,
                    deadline,
                    permit,
                )));
        } else {
            streams.send(request, replies, deadline, permit);
        }
    }
}

/// Retires a link's [`Streams`] when its batcher ends, however it ends: the current
/// stream's request body closes (the owner answers what it holds, then ends its side).
struct Retire(Arc<Streams>);

impl Drop for Retire {
    fn drop(&mut self) {
        self.0.lock().current = None;
        self.0.retired.cancel();
    }
}

/// Sleep until `due`, or forever without one.
async fn sleep_until_some(due: Option<tokio::time::Instant>) {
    match due {
        Some(due) => tokio::time::sleep_until(due).await,
        None => std::future::pending().await,
    }
}

/// The `Forward` request of a batch, its callers' replies, and when it is due.
fn request_of(
    batch: std::vec::Drain<'_, Pending>,
) -> (ForwardRequest, Replies, tokio::time::Instant) {
    // The batch is due when its most urgent check is: the owner refuses it after that
    // (see `deadline_ms`), and no caller is still waiting for it.
    let deadline = batch
        .as_slice()
        .iter()
        .map(|p| p.deadline)
        .min()
        .expect("batches are not empty");
    let mut items = Vec::with_capacity(batch.len());
    let mut replies = Vec::with_capacity(batch.len());
    for p in batch {
        items.push(p.item);
        replies.push((p.rule, p.reply));
    }
    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
    let deadline_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| (d + left).as_millis() as u64);
    let request = ForwardRequest {
        // The call's proof (or its stream's) names the sender where the cluster has a
        // key; the owner reads no name from a batch, so none is copied into every one.
        from_node: String::new(),
        items,
        deadline_ms,
        compact: true,
    };
    (request, replies, deadline)
}

/// A batch as one unary `Forward` call (a peer without the stream, `--forward-unary`).
async fn send_unary(
    streams: Arc<Streams>,
    request: ForwardRequest,
    replies: Replies,
    deadline: tokio::time::Instant,
    _slot: Option<tokio::sync::OwnedSemaphorePermit>,
) {
    let peer = &streams.peer;
    let mut client = streams.client.clone();
    let result = match tokio::time::timeout_at(deadline, client.forward(request)).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(ForwardError::Unreachable(
            peer.to_string(),
            status.message().to_string(),
        )),
        Err(_) => Err(ForwardError::Timeout(peer.to_string())),
    };
    answer_callers(result, replies, peer);
}

/// Decode one owner's answer; `sent` is the rule this node matched, shared when the
/// owner names the same.
fn remote(o: ForwardOutcome, decider: &Decider, sent: Arc<str>) -> Remote {
    Remote {
        decision: Decision {
            allowed: o.allowed,
            limit: o.limit,
            remaining: o.remaining,
            retry_after_ms: o.retry_after_ms,
            reset_at_ms: o.reset_at,
            window_id: o.window_id,
            delay_ms: o.delay_ms,
        },
        sequence: o.sequence,
        at: o.at,
        decider: decider.clone(),
        rule: if o.same_rule || *sent == *o.rule {
            sent
        } else {
            Arc::from(o.rule.as_str())
        },
        algorithm: match o.algorithm_index {
            0 => AlgorithmKind::parse(&o.algorithm),
            i => AlgorithmKind::ALL.get(i as usize - 1).copied(),
        },
    }
}

/// What a compact forward sends for the rule it matched (see `ForwardItem.rule_hash`).
pub fn rule_hash(name: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(name.as_bytes())
}

/// A channel to a peer that signs every call with the cluster key: the proof header
/// binds the method path, this node's id, the time and a nonce ([`Keyring::sign_call`]).
/// Tools that call a peer's `Peer` service (`cluster status`, test harnesses) use it too.
#[derive(Clone)]
pub struct Signed {
    inner: Channel,
    signer: Option<Arc<Signer>>,
}

struct Signer {
    keyring: Keyring,
    me: Arc<str>,
    nonce: std::sync::atomic::AtomicU64,
}

impl Signed {
    /// Sign calls on `inner` as `me` with `keyring` (`None`: send them unsigned).
    pub fn new(inner: Channel, keyring: Option<Keyring>, me: Arc<str>) -> Self {
        use std::hash::{BuildHasher, Hasher};
        // Nonces start at a random point so two incarnations of one node id never
        // reuse a (node, nonce) pair within the replay window.
        let start = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        Self {
            inner,
            signer: keyring.map(|keyring| {
                Arc::new(Signer {
                    keyring,
                    me,
                    nonce: std::sync::atomic::AtomicU64::new(start),
                })
            }),
        }
    }
}

impl tonic::codegen::Service<http::Request<tonic::body::Body>> for Signed {
    type Response =
        <Channel as tonic::codegen::Service<http::Request<tonic::body::Body>>>::Response;
    type Error = <Channel as tonic::codegen::Service<http::Request<tonic::body::Body>>>::Error;
    type Future = <Channel as tonic::codegen::Service<http::Request<tonic::body::Body>>>::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<tonic::body::Body>) -> Self::Future {
        if let Some(signer) = &self.signer {
            // The system clock on purpose, as the verifier's (see `server::peer_auth`).
            let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
            let nonce = signer
                .nonce
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let proof = signer
                .keyring
                .sign_call(request.uri().path(), &signer.me, now, nonce);
            // From the String itself: its buffer becomes the header's, no copy.
            match http::HeaderValue::try_from(proof) {
                Ok(value) => {
                    request.headers_mut().insert(CALL_HEADER, value);
                }
                // Node ids are validated to be visible ASCII: only a tool's own id can
                // get here, and the peer will refuse the unsigned call; say why.
                Err(_) => tracing::error!(
                    me = %signer.me,
                    "this id cannot travel in a peer-call proof; the call goes unsigned"
                ),
            }
        }
        self.inner.call(request)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
    use tonic::{Request, Response, Status};

    use super::*;
    use crate::cluster::policy::testkit;
    use crate::proto::peer::peer_server::{Peer, PeerServer};
    use crate::proto::peer::{
        InstallResponse, RefundResponse, RulesResponse, StatusRequest, StatusResponse,
        WriteRulesResponse,
    };

    /// A peer that answers every item admitted, counting how it was asked; `streams`
    /// false plays an older build without `ForwardStream`.
    #[derive(Clone, Default)]
    struct FakePeer {
        streams: bool,
        /// Take stream calls and never answer them (a paused owner).
        silent: bool,
        /// Never answer a stream's headers (an owner paused after accepting).
        hang_open: bool,
        unary_calls: Arc<AtomicUsize>,
        streams_opened: Arc<AtomicUsize>,
        streams_ended: Arc<AtomicUsize>,
        stream_calls: Arc<AtomicUsize>,
    }

    fn answer(request: &ForwardRequest) -> ForwardResponse {
        ForwardResponse {
            node_id: "owner".into(),
            generation: 1,
            outcomes: request
                .items
                .iter()
                .map(|_| ForwardOutcome {
                    allowed: true,
                    limit: 100,
                    remaining: 99,
                    rule: "default".into(),
                    algorithm: "token_bucket".into(),
                    ..Default::default()
                })
                .collect(),
        }
    }

    #[tonic::async_trait]
    impl Peer for FakePeer {
        async fn forward(
            &self,
            request: Request<ForwardRequest>,
        ) -> Result<Response<ForwardResponse>, Status> {
            self.unary_calls.fetch_add(1, Ordering::SeqCst);
            Ok(Response::new(answer(request.get_ref())))
        }

        type ForwardStreamStream = ReceiverStream<Result<ForwardAnswer, Status>>;

        async fn forward_stream(
            &self,
            request: Request<tonic::Streaming<ForwardCall>>,
        ) -> Result<Response<Self::ForwardStreamStream>, Status> {
            if !self.streams {
                return Err(Status::unimplemented("not in this build"));
            }
            self.streams_opened.fetch_add(1, Ordering::SeqCst);
            if self.hang_open {
                std::future::pending::<()>().await;
            }
            let mut calls = request.into_inner();
            let (tx, rx) = mpsc::channel(4);
            let me = self.clone();
            tokio::spawn(async move {
                while let Ok(Some(call)) = calls.message().await {
                    me.stream_calls.fetch_add(1, Ordering::SeqCst);
                    if me.silent {
                        continue;
                    }
                    let response = call.request.as_ref().map(answer);
                    let sent = tx.send(Ok(ForwardAnswer {
                        call: call.call,
                        response,
                        code: 0,
                        message: String::new(),
                    }));
                    if sent.await.is_err() {
                        break;
                    }
                }
                me.streams_ended.fetch_add(1, Ordering::SeqCst);
            });
            Ok(Response::new(ReceiverStream::new(rx)))
        }

        async fn refund(
            &self,
            _: Request<RefundRequest>,
        ) -> Result<Response<RefundResponse>, Status> {
            Err(Status::unimplemented(""))
        }

        async fn install(
            &self,
            _: Request<InstallRequest>,
        ) -> Result<Response<InstallResponse>, Status> {
            Err(Status::unimplemented(""))
        }

        async fn status(
            &self,
            _: Request<StatusRequest>,
        ) -> Result<Response<StatusResponse>, Status> {
            Err(Status::unimplemented(""))
        }

        async fn rules(&self, _: Request<RulesRequest>) -> Result<Response<RulesResponse>, Status> {
            Err(Status::unimplemented(""))
        }

        async fn write_rules(
            &self,
            _: Request<WriteRulesRequest>,
        ) -> Result<Response<WriteRulesResponse>, Status> {
            Err(Status::unimplemented(""))
        }
    }

    /// Serve `peer` on a loopback port; the member to forward to it.
    async fn serve(peer: FakePeer) -> Member {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(PeerServer::new(peer))
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        testkit::member("owner", port)
    }

    fn pool(config: ForwardConfig) -> PeerPool {
        PeerPool::new(
            "entry".into(),
            ForwardConfig {
                // Generous: a loaded test machine must not turn these into timeouts.
                timeout: Duration::from_secs(5),
                ..config
            },
            TaskTracker::new(),
            CancellationToken::new(),
        )
    }

    /// A pool whose forwards give up after 100 ms, for owners that never answer.
    fn impatient_pool() -> PeerPool {
        PeerPool::new(
            "entry".into(),
            ForwardConfig {
                timeout: Duration::from_millis(100),
                ..ForwardConfig::default()
            },
            TaskTracker::new(),
            CancellationToken::new(),
        )
    }

    #[tokio::test]
    async fn a_batch_the_owner_never_answers_frees_its_slot_at_its_deadline() {
        let peer = FakePeer {
            streams: true,
            silent: true,
            ..FakePeer::default()
        };
        let owner = serve(peer.clone()).await;
        // One batch in flight at a time (the default): a batch that kept its slot
        // would hold every later one back.
        let pool = impatient_pool();
        let item = testkit::item("k", "GET /x", 1);
        for _ in 0..3 {
            let answer = pool.forward(&owner, &item).await;
            assert!(
                matches!(answer, Err(ForwardError::Timeout(_))),
                "{answer:?}"
            );
        }
        // Each batch reached the owner: none waited behind an unanswered one.
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while peer.stream_calls.load(Ordering::SeqCst) < 3 && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(peer.stream_calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_stream_that_never_opens_is_given_up_at_the_forward_deadline() {
        let peer = FakePeer {
            streams: true,
            hang_open: true,
            ..FakePeer::default()
        };
        let owner = serve(peer.clone()).await;
        let pool = impatient_pool();
        let item = testkit::item("k", "GET /x", 1);
        let first = pool.forward(&owner, &item).await;
        assert!(matches!(first, Err(ForwardError::Timeout(_))), "{first:?}");
        // Once the open is given up, the next batch tries a new stream instead of
        // queueing on the dead one for the stream's whole age (15 s).
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while peer.streams_opened.load(Ordering::SeqCst) < 2 && std::time::Instant::now() < until {
            let _ = pool.forward(&owner, &item).await;
        }
        assert!(peer.streams_opened.load(Ordering::SeqCst) >= 2);
    }

    #[tokio::test]
    async fn an_older_peer_without_the_stream_gets_unary_forwards_after_one_failed_batch() {
        let peer = FakePeer::default();
        let owner = serve(peer.clone()).await;
        let pool = pool(ForwardConfig::default());
        let item = testkit::item("k", "GET /x", 1);
        let first = pool.forward(&owner, &item).await;
        assert!(
            matches!(first, Err(ForwardError::Unreachable(..))),
            "the batch that finds out falls back: {first:?}"
        );
        for _ in 0..3 {
            let answer = pool.forward(&owner, &item).await.expect("a unary forward");
            assert!(answer.decision.allowed);
            assert_eq!(answer.decider.node_id.as_ref(), "owner");
        }
        assert_eq!(peer.unary_calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn batches_travel_on_one_stream_which_is_renewed_by_age_without_losing_a_batch() {
        let peer = FakePeer {
            streams: true,
            ..FakePeer::default()
        };
        let owner = serve(peer.clone()).await;
        let pool = pool(ForwardConfig {
            stream_max_age: Duration::from_millis(20),
            ..ForwardConfig::default()
        });
        let item = testkit::item("k", "GET /x", 1);
        let started = std::time::Instant::now();
        let mut answered = 0;
        while started.elapsed() < Duration::from_millis(300) {
            let answer = pool
                .forward(&owner, &item)
                .await
                .expect("every batch answered");
            assert_eq!(answer.decision.remaining, 99);
            answered += 1;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(peer.unary_calls.load(Ordering::SeqCst), 0, "no unary call");
        assert_eq!(peer.stream_calls.load(Ordering::SeqCst), answered);
        let opened = peer.streams_opened.load(Ordering::SeqCst);
        assert!(opened >= 2, "300 ms of 20 ms streams opened only {opened}");
        // Every replaced stream ends (its sender let go): none is left open but the
        // current one.
        let ended = || peer.streams_ended.load(Ordering::SeqCst);
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while ended() + 1 < opened && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(ended() + 1, opened, "replaced streams were closed");
    }
}
