//! [`PeerPool`]: the links to every peer this node calls, made on demand, and the calls
//! themselves. Forwards go through the link's batcher (see `stream`); the one-shot calls
//! are a request built and an answer read by [`calls`](super::calls), around one tonic
//! call bounded in time.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::transport::Endpoint;

use crate::algorithms::Millis;
use crate::cluster::reservation::{Committed, Hold, ReservationError};
use crate::cluster::rules_edit::RulesEdit;
use crate::cluster::{CheckItem, InlineRules, Remote};
use crate::membership::Member;
use crate::proto::peer::peer_client::PeerClient;
use crate::shard::counters::{ClientCounters, ClientQuery};
use crate::shard::Exported;

use super::stream::{batcher, Dial, Pending, Streams};
use super::{calls, wire};
use super::{
    CountersError, ForwardConfig, ForwardError, PulledRules, RemoteWriteError, Signed, WriteOutcome,
};

/// A link that timed out is replaced by a fresh connection, but at most this often.
///
/// After a partition heals, the old TCP connection can sit in retransmission back-off
/// for seconds (the RTO doubles with every lost segment) while a new connection would
/// work at once; without the reset, entry nodes keep failing open long after the
/// network is back.
const RECONNECT_AFTER: Duration = Duration::from_secs(1);

/// Whether a forward's `result` on a link `age` old is a reason to connect afresh: a
/// timeout or a failed call may say something about the connection, a full queue does
/// not, and a young link is not replaced again.
pub fn reconnect_after<T>(result: &Result<T, ForwardError>, age: Duration) -> bool {
    let suspect = matches!(
        result,
        Err(ForwardError::Timeout(_) | ForwardError::Unreachable(..))
    );
    suspect && age >= RECONNECT_AFTER
}

struct Link {
    generation: u64,
    addr: SocketAddr,
    queue: mpsc::Sender<Pending>,
    client: PeerClient<Signed>,
    created: std::time::Instant,
}

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

/// Run a one-shot call to `peer` for at most `deadline`: its answer, or the status it
/// failed with (`None`: it ran out of time).
pub(super) async fn bounded<T>(
    deadline: Duration,
    call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, Option<tonic::Status>> {
    match tokio::time::timeout(deadline, call).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(Some(status)),
        Err(_) => Err(None),
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
        let (reply, rx) = oneshot::channel();
        let deadline = tokio::time::Instant::now() + self.config.timeout;
        link.queue
            .try_send(Pending {
                item: wire::forward_item(item),
                rule: item.rule.name.clone(),
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
        if reconnect_after(&result, link.created.elapsed()) {
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
        let request = calls::refund_request(items);
        bounded(self.config.timeout, client.refund(request))
            .await
            .map(drop)
            .map_err(|status| calls::call_error(&owner.node_id, status.as_ref()))
    }

    /// Push handed-over state to `owner` (`why`: which path, for the install trace);
    /// returns how many keys it installed.
    pub async fn install(
        &self,
        owner: &Member,
        states: &[Exported],
        why: &'static str,
    ) -> Result<u64, ForwardError> {
        self.push_states(owner, states, why, false).await
    }

    /// Push `owner` the states of keys this node started from `owner`'s own replicas,
    /// for it to join (see `InstallRequest.joined`); returns how many it installed.
    pub async fn hand_back(
        &self,
        owner: &Member,
        states: &[Exported],
    ) -> Result<u64, ForwardError> {
        self.push_states(owner, states, "hand back", true).await
    }

    async fn push_states(
        &self,
        owner: &Member,
        states: &[Exported],
        why: &'static str,
        joined: bool,
    ) -> Result<u64, ForwardError> {
        for s in states {
            tracing::debug!(
                target: crate::shard::INSTALL_TRACE,
                to = %owner.node_id,
                generation = owner.generation,
                why,
                placement = s.id.placement,
                disc = s.id.disc,
                state = ?s.state,
                "pushing"
            );
        }
        let mut client = self.link(owner).client.clone();
        let request = if joined {
            calls::hand_back_request(&self.me, states, &self.inline)
        } else {
            calls::install_request(&self.me, states, &self.inline)
        };
        bounded(
            calls::install_deadline(self.config.timeout),
            client.install(request),
        )
        .await
        .map(|response| response.installed)
        .map_err(|status| calls::call_error(&owner.node_id, status.as_ref()))
    }

    /// Send replicas to the keys' successor `to`, as batch `stamp` (this incarnation's
    /// generation, the batch's number); returns how many it holds and the bytes of the
    /// request (for the replication metrics).
    pub async fn replicate(
        &self,
        to: &Member,
        states: &[Exported],
        stamp: (u64, u64),
    ) -> Result<(u64, usize), ForwardError> {
        let mut client = self.link(to).client.clone();
        let request = calls::replicate_request(&self.me, states, &self.inline, stamp);
        let bytes = prost::Message::encoded_len(&request);
        bounded(self.config.timeout, client.replicate(request))
            .await
            .map(|response| (response.installed, bytes))
            .map_err(|status| calls::call_error(&to.node_id, status.as_ref()))
    }

    /// Ask `peer` to push this node (`me`: this incarnation) the replicas it holds of
    /// keys its ring gives this node (an owner restoring after a restart); returns
    /// (sent, installed, whether `peer` knew an earlier incarnation of this node).
    pub async fn restore(
        &self,
        peer: &Member,
        me: &Member,
        deadline: Duration,
    ) -> Result<(u64, u64, bool), ForwardError> {
        let mut client = self.link(peer).client.clone();
        let request = calls::restore_request(me);
        bounded(deadline, client.restore(request))
            .await
            .map(|response| (response.sent, response.installed, response.earlier))
            .map_err(|status| calls::call_error(&peer.node_id, status.as_ref()))
    }

    /// Fetch `peer`'s rule set (its document as canonical JSON and the stamp it claims),
    /// for a node that saw a newer stamp in gossip. Checking the document is the caller's
    /// job: nothing a peer sends is enforced unvalidated.
    pub async fn pull_rules(&self, peer: &Member) -> Result<PulledRules, ForwardError> {
        let mut client = self.link(peer).client.clone();
        let request = calls::rules_request(&self.me);
        bounded(
            calls::pull_deadline(self.config.timeout),
            client.rules(request),
        )
        .await
        .map(calls::pulled_rules)
        .map_err(|status| calls::call_error(&peer.node_id, status.as_ref()))
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
        let request = calls::write_request(&self.me, if_match, edit);
        let deadline = calls::install_deadline(self.config.timeout);
        bounded(deadline, client.write_rules(request))
            .await
            .map(|response| calls::write_outcome(&peer.node_id, response))
            .map_err(|status| calls::write_error(&peer.node_id, status.as_ref()))
    }

    /// Ask `owner` for one client's counters (`reset`: drop them there), on behalf of
    /// `by`. Never batched, never retried: a reset that timed out is read again by the
    /// operator, not repeated blindly.
    pub async fn counters(
        &self,
        owner: &Member,
        query: &ClientQuery,
        reset: bool,
        by: &str,
    ) -> Result<ClientCounters, CountersError> {
        let mut client = self.link(owner).client.clone();
        let request = calls::counters_request(&self.me, query, reset, by);
        bounded(
            calls::pull_deadline(self.config.timeout),
            client.counters(request),
        )
        .await
        .map(calls::counters_answer)
        .map_err(|status| calls::counters_error(&owner.node_id, status.as_ref()))
    }

    /// Ask `owner` to reserve `item` for `ttl_ms` (or to grant a lease of it): its
    /// check, and the id when admitted. Never batched, never retried: a reservation or
    /// lease whose answer was lost ends at its TTL on the owner.
    pub async fn reserve(
        &self,
        owner: &Member,
        item: &CheckItem,
        ttl_ms: u64,
        hold: Hold,
    ) -> Result<(Remote, Option<(String, Millis)>), ReservationError> {
        let mut client = self.link(owner).client.clone();
        let request = calls::reserve_request(&self.me, item, ttl_ms, hold);
        bounded(self.config.timeout, client.reserve(request))
            .await
            .map_err(|status| calls::reservation_error(&owner.node_id, status.as_ref()))
            .and_then(|answer| calls::reserve_answer(answer, item))
    }

    /// Send a commit of reservation `id` to `owner`, the current owner of its key.
    /// Not on a caller's hot path (the work is done), so it may take longer than a check.
    pub async fn commit(
        &self,
        owner: &Member,
        id: &str,
        actual: u64,
    ) -> Result<Committed, ReservationError> {
        let mut client = self.link(owner).client.clone();
        let request = calls::commit_request(&self.me, id, actual);
        bounded(
            calls::pull_deadline(self.config.timeout),
            client.commit(request),
        )
        .await
        .map(calls::commit_answer)
        .map_err(|status| calls::reservation_error(&owner.node_id, status.as_ref()))
    }

    /// This node's id, as its calls name it.
    pub(super) fn me(&self) -> &str {
        &self.me
    }

    /// A client of the link to `owner`, for a one-shot call.
    pub(super) fn client(&self, owner: &Member) -> PeerClient<Signed> {
        self.link(owner).client.clone()
    }

    /// The link to `owner`, created (or replaced, if the owner restarted or moved) on demand.
    fn link(&self, owner: &Member) -> Arc<Link> {
        if let Some(link) = self.links.get(&owner.node_id) {
            if link.generation == owner.generation && link.addr == owner.peer_addr {
                return link.clone();
            }
        }
        let signed = Signed::new(
            self.endpoint(owner.peer_addr).connect_lazy(),
            self.config.keyring.clone(),
            self.me.clone(),
        );
        let dial = Dial {
            addr: owner.peer_addr,
            local_ip: self.config.local_ip,
            signer: signed.clone(),
            max_frame: self.config.max_message_bytes,
        };
        let client =
            PeerClient::new(signed).max_decoding_message_size(self.config.max_message_bytes);
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
        let streams = Arc::new(Streams::new(
            (client, Some(dial)),
            peer,
            &self.config,
            self.cancel.clone(),
            self.tracker.clone(),
        ));
        self.tracker.spawn(tracing::Instrument::instrument(
            batcher(rx, streams, self.config.clone(), self.cancel.clone()),
            self.span.clone(),
        ));
        link
    }

    /// The HTTP/2 endpoint of a peer at `addr`, with this node's source address and TLS.
    fn endpoint(&self, addr: SocketAddr) -> Endpoint {
        let scheme = if self.config.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
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
        endpoint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_failed_or_timed_out_forward_on_an_old_enough_link_reconnects() {
        let old = RECONNECT_AFTER;
        let young = RECONNECT_AFTER - Duration::from_millis(1);
        let timeout: Result<(), _> = Err(ForwardError::Timeout("p".into()));
        let failed: Result<(), _> = Err(ForwardError::Unreachable("p".into(), "reset".into()));
        let full: Result<(), _> = Err(ForwardError::Overloaded("p".into()));
        assert!(reconnect_after(&timeout, old));
        assert!(reconnect_after(&failed, old));
        assert!(!reconnect_after(&timeout, young), "a young link is kept");
        assert!(
            !reconnect_after(&full, old),
            "a full queue says nothing of the link"
        );
        assert!(!reconnect_after(&Ok(()), old));
    }
}
