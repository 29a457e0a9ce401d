//! The peer client adapter: forwarding checks to their owner over one persistent
//! HTTP/2 channel per peer, with the checks bound for one peer coalesced into batches;
//! refunds and handed-over state go the same way.
//!
//! This file and `server::peer` are the only places that see the peer API's prost
//! types: the router hands over [`CheckItem`]s and gets [`Remote`] answers back.
//!
//! Each peer has a batcher task fed by a bounded channel. It takes whatever checks are
//! queued (up to `max_batch`), optionally waits `flush_delay` for more, and sends them
//! as one `Peer/Forward` call. At most `max_in_flight` calls (default 1) are out at once on
//! the one connection; while that many are out, new checks queue and leave together
//! when a call returns. So an idle link sends each check at once, and under load the
//! batches grow with the load instead of every check paying for a call of its own.
//!
//! Every forward has a deadline. A check whose owner does not answer in time comes
//! back as [`ForwardError`]; the router then fails open (or closed, per rule). A batch
//! carries its most urgent check's deadline, and checks whose caller already gave up
//! are left out of the batch rather than charged on the owner.

use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU64;
use std::sync::Arc;
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
    ForwardItem, ForwardOutcome, ForwardRequest, InstallRequest, KeyState as WireState,
    RefundItem as WireRefund, RefundRequest, RulesRequest, WriteRulesRequest,
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
            key: item.client.to_string(),
            route: item.route.to_string(),
            tier: item.tier.as_deref().map(str::to_string),
            cost: item.cost.get(),
            hops: 1,
            named: item.named.as_ref().map(wire_named),
            give_back: item.give_back.map_or(0, NonZeroU64::get),
            drain: item.drain,
            peek: item.peek,
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
        if result.is_err() && link.created.elapsed() >= RECONNECT_AFTER {
            // Drop the link only if it is still the one that failed (not already
            // replaced by a concurrent caller); the next forward connects afresh.
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
                key: item.client.to_string(),
                route: item.route.to_string(),
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
        // Replacing the link drops the old sender, which ends the old batcher.
        self.links.insert(owner.node_id.clone(), link.clone());
        self.tracker.spawn(tracing::Instrument::instrument(
            batcher(
                rx,
                client,
                self.me.clone(),
                Arc::from(owner.node_id.as_str()),
                self.config.clone(),
                self.cancel.clone(),
            ),
            self.span.clone(),
        ));
        link
    }
}

/// Coalesce queued checks for one peer into `Forward` calls.
async fn batcher(
    mut rx: mpsc::Receiver<Pending>,
    client: PeerClient<Signed>,
    me: Arc<str>,
    peer: Arc<str>,
    config: ForwardConfig,
    cancel: CancellationToken,
) {
    let max = config.max_batch.max(1);
    let batches = metrics::histogram!("ringlimit_forward_batch_size");
    let in_flight = (config.max_in_flight > 0)
        .then(|| Arc::new(tokio::sync::Semaphore::new(config.max_in_flight)));
    loop {
        let mut batch = Vec::with_capacity(64);
        tokio::select! {
            _ = cancel.cancelled() => return,
            received = rx.recv_many(&mut batch, max) => if received == 0 { return },
        }
        // Wait for a free call slot; checks that arrive meanwhile join this batch.
        let permit = match &in_flight {
            Some(slots) => tokio::select! {
                _ = cancel.cancelled() => return,
                permit = slots.clone().acquire_owned() => permit.ok(),
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
        tokio::spawn(tracing::Instrument::in_current_span(send(
            client.clone(),
            batch,
            me.clone(),
            peer.clone(),
            permit,
        )));
    }
}

async fn send(
    mut client: PeerClient<Signed>,
    batch: Vec<Pending>,
    me: Arc<str>,
    peer: Arc<str>,
    _slot: Option<tokio::sync::OwnedSemaphorePermit>,
) {
    // The batch is due when its most urgent check is: the owner refuses it after that
    // (see `deadline_ms`), and no caller is still waiting for it.
    let deadline = batch
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
        from_node: me.to_string(),
        items,
        deadline_ms,
    };
    let result = match tokio::time::timeout_at(deadline, client.forward(request)).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(ForwardError::Unreachable(
            peer.to_string(),
            status.message().to_string(),
        )),
        Err(_) => Err(ForwardError::Timeout(peer.to_string())),
    };
    match result {
        Ok(response) if response.outcomes.len() == replies.len() => {
            // The owner is the peer this link was made for (unless a node with
            // another id took its address): its id is shared, not copied.
            let node_id = if *response.node_id == *peer {
                peer
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
        rule: if *sent == *o.rule {
            sent
        } else {
            Arc::from(o.rule.as_str())
        },
        algorithm: AlgorithmKind::parse(&o.algorithm),
    }
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
