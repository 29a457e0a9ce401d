//! The peer server adapter: the node-to-node service `ringlimit.peer.v1.Peer`.
//!
//! Decodes forwarded checks, refunds and handed-over state into domain types, has the
//! check layer validate them and the cluster wing decide them, and encodes the answers.
//! With `cluster::link` (the client side), the only code that sees peer prost types.
//! Serving a `ForwardStream` (how much of it is taken on, and its answers as a response
//! body) is in `peer/stream.rs` ([`ForwardAnswers`], [`Intake`]); the same batches on a
//! framed connection (the lean transport) in [`frames`].

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::algorithms::Implausible;
use crate::algorithms::{AlgorithmKind, KeyState};
use crate::check::forwarded::{self, at_most, ForwardedInput, InlineInput, NamedInput, OwnerRules};
use crate::check::gubernator::inline_rule;
use crate::check::CheckError;
use crate::cluster::rules::{ClusterRules, Refusal, RulesEdit, RulesWriteError};
use crate::cluster::{link, policy, CheckItem, Router};
use crate::cluster::{InlineRule, InlineRules};
use crate::config::bounds::{MAX_FORWARD_ITEMS, MAX_INSTALL_STATES};
use crate::config::rules::envoy::EnvoyConfig;
use crate::config::rules::RuleSet;
use crate::config::rules::{DocEnvoy, RulesDoc, TierLimit};
use crate::config::{SharedEnvoy, SharedRules};
use crate::proto::peer::peer_server::Peer;
use crate::proto::peer::InlineRule as WireInline;
use crate::proto::peer::NamedRule as WireNamed;
use crate::proto::peer::{
    CountersRequest, CountersResponse, ForwardAnswer, ForwardCall, ForwardItem, ForwardOutcome,
    ForwardRequest, ForwardResponse, InstallRequest, InstallResponse, KeyState as WireState,
    MemberStatus, RefundItem, RefundRequest, RefundResponse, RestoreRequest, RestoreResponse,
    RulesRequest, RulesResponse, StatusRequest, StatusResponse, WriteRulesRequest,
    WriteRulesResponse,
};
use crate::shard::counters::{ClientQuery, CounterReading};
use crate::shard::{Exported, KeyId, Refund};
use crate::text::Text;

mod budget;
pub mod frames;
mod replicas;
mod reserve;
mod stream;
pub use budget::lease_response;
pub use stream::{ForwardAnswers, Intake, STREAM_IN_FLIGHT};

/// A rule named on the wire, as the check layer's input.
fn named_input(wire: &WireNamed) -> NamedInput<'_> {
    NamedInput {
        name: &wire.name,
        override_limit: wire.override_limit,
        override_unit_seconds: wire.override_unit_seconds,
        inline: wire.inline.as_ref().map(inline_input),
    }
}

/// The numbers of a wire inline rule, as the check layer's input.
fn inline_input(wire: &WireInline) -> InlineInput<'_> {
    InlineInput {
        algorithm: &wire.algorithm,
        limit: wire.limit,
        window_ms: wire.window_ms,
        burst: wire.burst,
    }
}

/// The numbers of a wire inline rule; `None` for an algorithm this node does not know.
fn decode_inline(wire: &WireInline) -> Option<InlineRule> {
    inline_input(wire).numbers()
}

/// A forwarded item as the check layer's input.
pub fn forwarded_input(item: &ForwardItem) -> ForwardedInput<'_> {
    ForwardedInput {
        key: item.key.as_str(),
        route: item.route.as_str(),
        tier: item.tier.as_ref().map(Text::as_str),
        cost: item.cost,
        named: item.named.as_ref().map(named_input),
        give_back: item.give_back,
        drain: item.drain,
        peek: item.peek,
        failover: item.failover,
        in_doubt: item.failover_in_doubt,
    }
}

/// A refunded item as the check layer's input, with the time of its admission.
pub fn refund_input(item: &RefundItem) -> (ForwardedInput<'_>, u64) {
    let input = ForwardedInput {
        key: &item.key,
        route: &item.route,
        tier: item.tier.as_deref(),
        cost: item.cost,
        named: item.named.as_ref().map(named_input),
        give_back: 0,
        drain: false,
        peek: false,
        failover: false,
        in_doubt: false,
    };
    (input, item.at)
}

/// A forwarded batch as checks ready for the owner's shards, planned by the check layer
/// ([`forwarded::plan_batch`]): any invalid item refuses the whole batch.
pub(crate) fn plan_forward(
    request: &ForwardRequest,
    rules: &RuleSet,
    envoy: &EnvoyConfig,
    known: &InlineRules,
) -> Result<Vec<CheckItem>, CheckError> {
    let owner = OwnerRules {
        rules,
        envoy,
        known,
    };
    forwarded::plan_batch(request.items.iter().map(forwarded_input), owner)
}

/// A refund call as refunds for the shards, with the same bounds as [`plan_forward`].
pub(crate) fn plan_refund(
    request: &RefundRequest,
    rules: &RuleSet,
    envoy: &EnvoyConfig,
    known: &InlineRules,
) -> Result<Vec<Refund>, CheckError> {
    let owner = OwnerRules {
        rules,
        envoy,
        known,
    };
    forwarded::plan_refunds(request.items.iter().map(refund_input), owner)
}

/// Handed-over states as domain values: at most [`MAX_INSTALL_STATES`] per call.
/// States this node cannot decode (an algorithm or a word layout it does not know) are
/// skipped, like states of rules it does not have; whether the rest are plausible is
/// [`handoff::with_rules`]' question.
#[cfg(test)]
pub(crate) fn decode_install(states: Vec<WireState>) -> Result<Vec<Exported>, CheckError> {
    Ok(decode_install_with(states, &InlineRules::default())?.0)
}

/// `decode_install`, and the rules of the states that name an inline rule's numbers,
/// rebuilt (bounded like any input) and kept only where their fingerprint is the
/// state's: a peer cannot attach other numbers to a counter.
pub(crate) fn decode_install_with(
    states: Vec<WireState>,
    known: &InlineRules,
) -> Result<(Vec<Exported>, Vec<Arc<crate::config::rules::Rule>>), CheckError> {
    at_most("states", states.len(), MAX_INSTALL_STATES)?;
    let mut inline_rules: Vec<Arc<crate::config::rules::Rule>> = Vec::new();
    for state in &states {
        let Some(inline) = state.inline.as_ref().and_then(decode_inline) else {
            continue;
        };
        if let Ok(rule) = known.forwarded(&inline, inline_rule) {
            if rule.fingerprint == state.fingerprint
                && !inline_rules
                    .iter()
                    .any(|r| r.fingerprint == rule.fingerprint)
            {
                inline_rules.push(rule);
            }
        }
    }
    let exported = states
        .into_iter()
        .filter_map(|state| {
            let kind = AlgorithmKind::parse(state.algorithm.as_str())?;
            Some(Exported {
                id: KeyId {
                    placement: state.placement,
                    disc: state.id,
                },
                fingerprint: state.fingerprint,
                state: KeyState::from_words(kind, &state.words)?,
            })
        })
        .collect();
    Ok((exported, inline_rules))
}

/// A rules write as the domain edit it carries; a body that does not decode is
/// `INVALID_ARGUMENT` naming the field.
fn decode_edit(request: &WriteRulesRequest) -> Result<RulesEdit, Status> {
    let invalid = |e: String| Status::invalid_argument(format!("body: {e}"));
    match request.kind.as_str() {
        "replace" => RulesDoc::from_json_str(&request.body)
            .map(RulesEdit::Replace)
            .map_err(|e| invalid(e.to_string())),
        "put_tier_limit" => serde_json::from_str::<TierLimit>(&request.body)
            .map(|limit| RulesEdit::PutTierLimit {
                tier: request.tier.clone(),
                limit,
            })
            .map_err(|e| invalid(e.to_string())),
        "replace_envoy" => serde_json::from_str::<Option<DocEnvoy>>(&request.body)
            .map(RulesEdit::ReplaceEnvoy)
            .map_err(|e| invalid(e.to_string())),
        "delete_tier_limit" => Ok(RulesEdit::DeleteTierLimit {
            tier: request.tier.clone(),
            route: request.route_pattern.clone(),
        }),
        other => Err(Status::invalid_argument(format!(
            "kind: {other:?} is not a rules edit (replace, replace_envoy, put_tier_limit, delete_tier_limit)"
        ))),
    }
}

/// A refused rules write as the status the sending node maps back (peer.proto).
/// The counters of an audit line: `rule[route] used/limit`, comma-separated, so the log
/// says what a reset took away.
pub fn audit_list(counters: &[CounterReading]) -> String {
    if counters.is_empty() {
        return "none".into();
    }
    counters
        .iter()
        .map(|c| {
            let route = if c.route.is_empty() {
                String::new()
            } else {
                format!("[{}]", c.route)
            };
            format!("{}{route} {}/{}", c.rule, c.used(), c.limit)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn write_status(error: RulesWriteError) -> Status {
    let message = error.to_string();
    match error.kind() {
        Refusal::Invalid => Status::invalid_argument(message),
        Refusal::Stale => Status::failed_precondition(message),
        Refusal::NotFound => Status::not_found(message),
        Refusal::ReadOnly => Status::permission_denied(message),
        // ABORTED, not UNAVAILABLE: the sender must tell "refused, nothing changed" from a
        // transport failure (whose outcome is unknown), which tonic reports as UNAVAILABLE.
        Refusal::Unavailable => Status::aborted(message),
        Refusal::Internal => Status::internal(message),
    }
}

/// Serves forwarded checks, refunds, handed-over state and status to peers.
#[derive(Clone)]
pub struct PeerService {
    router: Arc<Router>,
    rules: SharedRules,
    envoy: SharedEnvoy,
    cluster_rules: Arc<ClusterRules>,
    inline: Arc<InlineRules>,
    installed: metrics::Counter,
    /// Per [`Implausible`] reason: handed-over states refused, never merged.
    refused: [metrics::Counter; Implausible::ALL.len()],
    stale: metrics::Counter,
    shutdown: CancellationToken,
    /// Sends replicas back to a restarted owner; `None` when this node does not replicate.
    replicator: Option<Arc<crate::cluster::replication::Replicator>>,
}

impl PeerService {
    /// A peer service deciding on `router`'s shards, serving `cluster_rules` to peers
    /// that pull them.
    pub fn new(router: Arc<Router>, rules: SharedRules, cluster_rules: Arc<ClusterRules>) -> Self {
        Self {
            router,
            rules,
            envoy: SharedEnvoy::default(),
            cluster_rules,
            inline: Arc::default(),
            installed: metrics::counter!("ringlimit_handoff_installed_total"),
            refused: Implausible::ALL.map(|reason| {
                metrics::counter!("ringlimit_handoff_refused_total", "reason" => reason.as_str())
            }),
            stale: metrics::counter!("ringlimit_forwarded_stale_total"),
            shutdown: CancellationToken::new(),
            replicator: None,
        }
    }

    /// This service answering `Restore` with `replicator`'s replicas.
    pub fn with_replicator(
        mut self,
        replicator: Option<Arc<crate::cluster::replication::Replicator>>,
    ) -> Self {
        self.replicator = replicator;
        self
    }

    /// This service keeping the inline rules peers forward in `inline` (the node's one
    /// registry: see [`InlineRules`]).
    pub fn with_inline(mut self, inline: Arc<InlineRules>) -> Self {
        self.inline = inline;
        self
    }

    /// This service taking the named rules of forwarded Envoy descriptors from `envoy`.
    pub fn with_envoy(mut self, envoy: SharedEnvoy) -> Self {
        self.envoy = envoy;
        self
    }

    /// This service ending its forward streams when `shutdown` is cancelled (the node's
    /// token): a graceful shutdown waits for open streams, and a peer keeps its stream
    /// open for as long as it forwards.
    pub fn with_shutdown(mut self, shutdown: CancellationToken) -> Self {
        self.shutdown = shutdown;
        self
    }

    /// Decide one forwarded batch: the work of a `Forward` call and of each call on a
    /// `ForwardStream`. The batch is refused whole (nothing decided) if it breaks a
    /// bound or arrives after its deadline.
    async fn forward_batch(&self, request: ForwardRequest) -> Result<ForwardResponse, Status> {
        // The bounds first: an oversized batch is refused whenever it arrives.
        at_most("items", request.items.len(), MAX_FORWARD_ITEMS)?;
        if policy::arrived_too_late(request.deadline_ms, self.router.now_ms()) {
            self.stale.increment(request.items.len() as u64);
            return Err(Status::deadline_exceeded(
                "forwarded batch arrived after its deadline",
            ));
        }
        let items = plan_forward(
            &request,
            &self.rules.load(),
            &self.envoy.load(),
            &self.inline,
        )?;
        // A compact answer names neither the rule the sender matched too nor the
        // algorithm: two allocations per item on each side saved.
        let mut sent = request.items.iter();
        let outcomes = self
            .router
            .decide_forwarded(&items, |a| {
                let item = sent.next().expect("one answer per item");
                forward_outcome(&a, item.rule_hash, request.compact)
            })
            .await
            .map_err(CheckError::from)?;
        let me = self.router.me();
        Ok(ForwardResponse {
            node_id: me.node_id.to_string(),
            generation: me.generation,
            outcomes,
        })
    }

    /// The answer to one call of a `ForwardStream`: what `Forward` would have answered.
    async fn answer(self: Arc<Self>, call: ForwardCall) -> ForwardAnswer {
        let result = match call.request {
            Some(request) => self.forward_batch(request).await,
            None => Err(Status::invalid_argument(
                "request: a call must carry a batch",
            )),
        };
        match result {
            Ok(response) => ForwardAnswer {
                call: call.call,
                response: Some(response),
                code: 0,
                message: String::new(),
            },
            Err(status) => ForwardAnswer {
                call: call.call,
                response: None,
                code: status.code() as u32,
                message: status.message().to_string(),
            },
        }
    }
}

#[tonic::async_trait]
impl Peer for PeerService {
    async fn forward(
        &self,
        request: Request<ForwardRequest>,
    ) -> Result<Response<ForwardResponse>, Status> {
        self.forward_batch(request.into_inner())
            .await
            .map(Response::new)
    }

    type ForwardStreamStream = ForwardAnswers;

    async fn forward_stream(
        &self,
        request: Request<tonic::Streaming<ForwardCall>>,
    ) -> Result<Response<Self::ForwardStreamStream>, Status> {
        Ok(Response::new(ForwardAnswers::new(
            Arc::new(self.clone()),
            request.into_inner(),
        )))
    }

    async fn refund(
        &self,
        request: Request<RefundRequest>,
    ) -> Result<Response<RefundResponse>, Status> {
        let refunds = plan_refund(
            &request.into_inner(),
            &self.rules.load(),
            &self.envoy.load(),
            &self.inline,
        )?;
        self.router
            .shards()
            .refund(refunds)
            .await
            .map_err(CheckError::from)?;
        Ok(Response::new(RefundResponse {}))
    }

    async fn install(
        &self,
        request: Request<InstallRequest>,
    ) -> Result<Response<InstallResponse>, Status> {
        let request = request.into_inner();
        let total = request.states.len() as u64;
        let vetted = self.vet_states(request.states, &request.from_node, "handed-over")?;
        let refused = vetted.refused_total();
        // States of keys the sender held as its own until now: it leaves, or this
        // node's view still gives it the key (the sender's view moved the key here
        // first). See `ShardCore::install`.
        let view = self.router.view();
        let leaving = view.member(&request.from_node).is_some_and(|m| m.leaving);
        let (held, other): (Vec<_>, Vec<_>) = vetted.items.into_iter().partition(|(item, _)| {
            leaving || view.ring.owner_of_hash(item.id.placement) == Some(&*request.from_node)
        });
        let mut installed = 0;
        for (items, from_holder) in [(held, true), (other, false)] {
            if !items.is_empty() {
                installed += self
                    .router
                    .shards()
                    .install(items, request.joined, from_holder)
                    .await
                    .map_err(CheckError::from)? as u64;
            }
        }
        self.installed.increment(installed);
        tracing::info!(
            node_id = %self.router.me().node_id,
            from = %request.from_node,
            joined = request.joined,
            installed,
            skipped = total - installed,
            refused,
            "handoff received"
        );
        Ok(Response::new(InstallResponse {
            installed,
            skipped: total - installed,
        }))
    }

    async fn replicate(
        &self,
        request: Request<InstallRequest>,
    ) -> Result<Response<InstallResponse>, Status> {
        self.hold_replicas(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn restore(
        &self,
        request: Request<RestoreRequest>,
    ) -> Result<Response<RestoreResponse>, Status> {
        self.send_replicas(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn status(
        &self,
        _request: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        let view = self.router.view();
        let shares = view.ring.shares();
        let members = view
            .members
            .iter()
            .map(|m| (m, self.cluster_rules.member(&m.node_id)))
            .map(|(m, rules)| MemberStatus {
                rules: rules.rules.map(|a| a.encode()).unwrap_or_default(),
                rules_drift: rules.rules_drift,
                envoy: rules.envoy.map(|a| a.encode()).unwrap_or_default(),
                envoy_drift: rules.envoy_drift,
                node_id: m.node_id.clone(),
                generation: m.generation,
                grpc_addr: m.grpc_addr.to_string(),
                peer_addr: m.peer_addr.to_string(),
                gossip_addr: m.gossip_addr.to_string(),
                leaving: m.leaving,
                ring_share: shares
                    .iter()
                    .find(|(id, _)| *id == m.node_id)
                    .map_or(0.0, |(_, share)| *share),
            })
            .collect();
        let keys = self
            .router
            .shards()
            .keys()
            .await
            .map_err(CheckError::from)? as u64;
        let replicas = self
            .router
            .shards()
            .replicas_held()
            .await
            .map_err(CheckError::from)? as u64;
        let me = self.router.me();
        Ok(Response::new(StatusResponse {
            node_id: me.node_id.to_string(),
            generation: me.generation,
            ring_digest: view.ring.digest(),
            members,
            keys,
            rules: self.cluster_rules.advert().encode(),
            envoy: self.cluster_rules.envoy_advert().encode(),
            replicas,
        }))
    }

    async fn write_rules(
        &self,
        request: Request<WriteRulesRequest>,
    ) -> Result<Response<WriteRulesResponse>, Status> {
        let request = request.into_inner();
        let edit = decode_edit(&request)?;
        // Applied here, whoever this node thinks coordinates: never sent on.
        let written = self
            .cluster_rules
            .write_local(request.if_match, edit)
            .await
            .map_err(write_status)?;
        tracing::info!(node_id = %self.router.me().node_id, from = %request.from_node, version = written.stamp.version, changed = written.changed, "rules write coordinated for a peer");
        let current = self.cluster_rules.current();
        Ok(Response::new(WriteRulesResponse {
            version: written.stamp.version,
            digest: written.stamp.digest,
            changed: written.changed,
            rule: written.rule.unwrap_or_default(),
            document: current.rules.doc().to_json(),
        }))
    }

    async fn counters(
        &self,
        request: Request<CountersRequest>,
    ) -> Result<Response<CountersResponse>, Status> {
        let request = request.into_inner();
        let query = ClientQuery::new(
            &request.key,
            request.route.as_deref(),
            request.tier.as_deref(),
        )
        .map_err(Status::invalid_argument)?;
        // Answered here, whoever this node thinks owns the key: never sent on.
        let answer = self
            .router
            .counters_here(&self.rules.load(), &query, request.reset)
            .await
            .map_err(CheckError::from)?;
        if request.reset {
            tracing::warn!(
                target: "ringlimit::audit",
                node_id = %self.router.me().node_id,
                from = %request.from_node,
                by = %request.requested_by,
                key = %query.key(),
                route = query.route(),
                tier = query.tier(),
                counters = %audit_list(&answer.counters),
                "counters reset for a peer's operator"
            );
        }
        Ok(Response::new(link::calls::counters_response(&answer)))
    }

    async fn reserve(
        &self,
        request: Request<crate::proto::peer::PeerReserveRequest>,
    ) -> Result<Response<crate::proto::peer::PeerReserveResponse>, Status> {
        Ok(Response::new(
            self.reserve_here(request.into_inner()).await?,
        ))
    }

    async fn commit(
        &self,
        request: Request<crate::proto::peer::PeerCommitRequest>,
    ) -> Result<Response<crate::proto::peer::PeerCommitResponse>, Status> {
        Ok(Response::new(self.commit_here(request.into_inner()).await?))
    }

    async fn lease(
        &self,
        request: Request<crate::proto::peer::PeerLeaseRequest>,
    ) -> Result<Response<crate::proto::peer::PeerLeaseResponse>, Status> {
        Ok(Response::new(self.lease_here(request.into_inner()).await?))
    }

    async fn return_lease(
        &self,
        request: Request<crate::proto::peer::PeerReturnLeaseRequest>,
    ) -> Result<Response<crate::proto::peer::PeerReturnLeaseResponse>, Status> {
        Ok(Response::new(
            self.return_lease_here(request.into_inner()).await?,
        ))
    }

    async fn rules(
        &self,
        request: Request<RulesRequest>,
    ) -> Result<Response<RulesResponse>, Status> {
        let current = self.cluster_rules.current();
        tracing::debug!(from = %request.get_ref().from_node, version = current.version, "rules pulled");
        Ok(Response::new(RulesResponse {
            source: self.cluster_rules.source().as_str().to_string(),
            version: current.version,
            digest: current.rules.digest(),
            document: current.rules.doc().to_json(),
        }))
    }
}

/// The wire outcome of one forwarded item the owner decided. With `compact`, a rule the
/// sender named by the same hash (`sent_rule_hash`) and the algorithm travel as a flag and
/// an index instead of their names. The one encoding of an owner's answer: the peer
/// service and the simulator's owners both use it.
pub fn forward_outcome(
    a: &crate::cluster::Answer,
    sent_rule_hash: u64,
    compact: bool,
) -> ForwardOutcome {
    let same_rule = compact && sent_rule_hash != 0 && sent_rule_hash == link::rule_hash(&a.rule);
    ForwardOutcome {
        allowed: a.decision.allowed,
        limit: a.decision.limit,
        remaining: a.decision.remaining,
        retry_after_ms: a.decision.retry_after_ms,
        reset_at: a.decision.reset_at_ms,
        window_id: a.decision.window_id,
        delay_ms: a.decision.delay_ms,
        sequence: a.sequence,
        at: a.at,
        rule: if same_rule {
            String::new()
        } else {
            a.rule.to_string()
        },
        algorithm: if compact {
            String::new()
        } else {
            a.algorithm.as_str().to_string()
        },
        same_rule,
        algorithm_index: if compact {
            a.algorithm.index() as u32 + 1
        } else {
            0
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::bounds::{MAX_BATCH, MAX_KEY_BYTES, MAX_TIER_BYTES};

    fn item(key: &str, tier: Option<&str>) -> ForwardItem {
        ForwardItem {
            key: key.into(),
            route: "GET /t".into(),
            tier: tier.map(Into::into),
            cost: 1,
            hops: 1,
            named: None,
            give_back: 0,
            drain: false,
            peek: false,
            rule_hash: 0,
            failover: false,
            failover_in_doubt: false,
        }
    }

    fn forward(items: Vec<ForwardItem>) -> ForwardRequest {
        ForwardRequest {
            from_node: "a".into(),
            items,
            deadline_ms: 0,
            compact: false,
        }
    }

    fn field<T: std::fmt::Debug>(result: Result<T, CheckError>) -> (String, String) {
        match result {
            Err(CheckError::InvalidArgument { field, reason }) => (field, reason),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn a_forward_of_more_than_the_batch_maximum_is_refused_naming_items_and_the_limit() {
        let rules = RuleSet::builtin();
        let full = forward(vec![item("k", None); MAX_BATCH]);
        assert_eq!(
            plan_forward(
                &full,
                &rules,
                &EnvoyConfig::default(),
                &InlineRules::default()
            )
            .unwrap()
            .len(),
            MAX_BATCH
        );
        let over = forward(vec![item("k", None); MAX_BATCH + 1]);
        let (field, reason) = field(plan_forward(
            &over,
            &rules,
            &EnvoyConfig::default(),
            &InlineRules::default(),
        ));
        assert_eq!(field, "items");
        assert!(reason.contains("at most 1000"), "{reason}");
    }

    #[test]
    fn a_handed_over_counter_rebuilds_its_inline_rule_only_with_matching_numbers() {
        let known = InlineRules::default();
        let numbers = WireInline {
            algorithm: "token_bucket".into(),
            limit: 10,
            window_ms: 1_000,
            burst: 10,
        };
        let rule = inline_rule(&decode_inline(&numbers).unwrap()).unwrap();
        let state = |fingerprint, inline: WireInline| WireState {
            fingerprint,
            algorithm: "token_bucket".into(),
            words: [0, 0][..].into(),
            placement: 2,
            id: 3,
            inline: Some(inline),
        };
        let (states, rules) =
            decode_install_with(vec![state(rule.fingerprint, numbers.clone())], &known).unwrap();
        assert_eq!(states.len(), 1);
        assert_eq!(rules, vec![rule.clone()]);
        // Numbers that are not the counter's, or out of bounds, give no rule: the state
        // then finds none and is dropped, never installed under the wrong numbers.
        let (_, rules) = decode_install_with(vec![state(12_345, numbers.clone())], &known).unwrap();
        assert!(rules.is_empty());
        let huge = WireInline {
            limit: u64::MAX,
            ..numbers
        };
        let (_, rules) = decode_install_with(vec![state(rule.fingerprint, huge)], &known).unwrap();
        assert!(rules.is_empty());
    }

    #[test]
    fn a_forwarded_inline_rule_is_rebuilt_and_bounded_on_the_owner() {
        let rules = RuleSet::builtin();
        let envoy = EnvoyConfig::default();
        let inline = |algorithm: &str, limit, window_ms, burst| ForwardItem {
            key: "4:test3:key".into(),
            route: "/gubernator".into(),
            named: Some(WireNamed {
                name: "gubernator~leaky_bucket".into(),
                inline: Some(WireInline {
                    algorithm: algorithm.into(),
                    limit,
                    window_ms,
                    burst,
                }),
                ..Default::default()
            }),
            ..item("k", None)
        };
        let ok = plan_forward(
            &forward(vec![inline("token_bucket", 10, 1_000, 20)]),
            &rules,
            &envoy,
            &InlineRules::default(),
        )
        .unwrap();
        assert_eq!(ok[0].rule.limiter.max_cost(), 20);
        assert!(
            ok[0].uncached,
            "the owner keeps it out of its deny cache too"
        );
        // Numbers no client could have sent are refused whoever forwards them.
        for (bad, want) in [
            (
                inline("token_bucket", 0, 1_000, 20),
                "items[0].named.inline",
            ),
            (inline("token_bucket", 10, 0, 20), "items[0].named.inline"),
            (
                inline("token_bucket", 10, u64::MAX, 20),
                "items[0].named.inline",
            ),
            (
                inline("token_bucket", 10, 1_000, u64::MAX),
                "items[0].named.inline",
            ),
            (
                inline("sliding_window_log", 10, 1_000, 0),
                "items[0].named.inline",
            ),
            (
                inline("nope", 10, 1_000, 0),
                "items[0].named.inline.algorithm",
            ),
            (
                ForwardItem {
                    cost: 21,
                    ..inline("token_bucket", 10, 1_000, 20)
                },
                "items[0].cost",
            ),
        ] {
            let (field, _) = field(plan_forward(
                &forward(vec![bad]),
                &rules,
                &envoy,
                &InlineRules::default(),
            ));
            assert_eq!(field, want);
        }
        // A give-back or drain of a configured rule's counter is refused: only a rule
        // the request carried may be changed beyond a check. (A peek changes nothing and
        // is accepted: `check::forwarded`.)
        for bad in [
            ForwardItem {
                give_back: u64::MAX,
                ..item("k", None)
            },
            ForwardItem {
                drain: true,
                ..item("k", None)
            },
        ] {
            let (field, _) = field(plan_forward(
                &forward(vec![bad]),
                &rules,
                &envoy,
                &InlineRules::default(),
            ));
            assert_eq!(field, "items[0].give_back");
        }
    }

    #[test]
    fn forwarded_items_are_validated_like_a_clients_naming_the_item() {
        let rules = RuleSet::builtin();
        let long_tier = "t".repeat(MAX_TIER_BYTES + 1);
        let long_key = "k".repeat(MAX_KEY_BYTES + 1);
        let cases = [
            (item("k", Some(&long_tier)), "items[1].tier"),
            (item("k", Some("")), "items[1].tier"),
            (item(&long_key, None), "items[1].key"),
            (item("", None), "items[1].key"),
            (
                ForwardItem {
                    route: "not a route".into(),
                    ..item("k", None)
                },
                "items[1].route",
            ),
            (
                ForwardItem {
                    cost: 0,
                    ..item("k", None)
                },
                "items[1].cost",
            ),
            (
                ForwardItem {
                    cost: u64::MAX,
                    ..item("k", None)
                },
                "items[1].cost",
            ),
        ];
        for (bad, want) in cases {
            let request = forward(vec![item("ok", None), bad.clone()]);
            assert_eq!(
                field(plan_forward(
                    &request,
                    &rules,
                    &EnvoyConfig::default(),
                    &InlineRules::default()
                ))
                .0,
                want,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn refunds_have_the_same_bounds_as_forwards() {
        let rules = RuleSet::builtin();
        let refund = |key: &str, tier: Option<&str>| RefundItem {
            key: key.into(),
            route: "GET /t".into(),
            tier: tier.map(Into::into),
            cost: 1,
            at: 0,
            named: None,
        };
        let over = RefundRequest {
            items: vec![refund("k", None); MAX_BATCH + 1],
        };
        assert_eq!(
            field(plan_refund(
                &over,
                &rules,
                &EnvoyConfig::default(),
                &InlineRules::default()
            ))
            .0,
            "items"
        );
        let long_tier = "t".repeat(MAX_TIER_BYTES + 1);
        let bad = RefundRequest {
            items: vec![refund("k", None), refund("k", Some(&long_tier))],
        };
        assert_eq!(
            field(plan_refund(
                &bad,
                &rules,
                &EnvoyConfig::default(),
                &InlineRules::default()
            ))
            .0,
            "items[1].tier"
        );
        let ok = RefundRequest {
            items: vec![refund("k", None); MAX_BATCH],
        };
        assert_eq!(
            plan_refund(
                &ok,
                &rules,
                &EnvoyConfig::default(),
                &InlineRules::default()
            )
            .unwrap()
            .len(),
            MAX_BATCH
        );
    }

    #[test]
    fn an_install_of_more_than_the_cap_is_refused_and_undecodable_states_are_skipped() {
        let state = |algorithm: &str, words: Vec<u64>| WireState {
            fingerprint: 1,
            algorithm: algorithm.into(),
            words: words.into(),
            placement: 2,
            id: 3,
            inline: None,
        };
        let over = vec![state("fixed_window", vec![0, 0]); MAX_INSTALL_STATES + 1];
        let (field, reason) = field(decode_install(over));
        assert_eq!(field, "states");
        assert!(reason.contains("at most 1000"), "{reason}");
        let decoded = decode_install(vec![
            state("fixed_window", vec![7, 1]),
            state("no_such_algorithm", vec![7, 1]),
            state("fixed_window", vec![7]),
        ])
        .unwrap();
        assert_eq!(decoded.len(), 1);
        assert_eq!(
            decoded[0].id,
            KeyId {
                placement: 2,
                disc: 3
            }
        );
    }

    #[test]
    fn an_audit_line_names_each_counter_with_what_it_had_used() {
        let reading = |rule: &str, route: &str, remaining| CounterReading {
            rule: rule.into(),
            algorithm: "fixed_window".into(),
            route: route.into(),
            limit: 10,
            remaining,
            reset_at_ms: 0,
        };
        assert_eq!(audit_list(&[]), "none");
        assert_eq!(
            audit_list(&[reading("t", "", 7), reading("up", "POST /up", 0)]),
            "t 3/10, up[POST /up] 10/10"
        );
    }
}
