//! The node-to-node service `ringlimit.peer.v1.Peer`.

use std::collections::HashMap;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::algorithms::AlgorithmKind;
use crate::config::rules::Rule;
use crate::error::CheckError;
use crate::proto::peer::peer_server::Peer;
use crate::proto::peer::{
    ForwardOutcome, ForwardRequest, ForwardResponse, InstallRequest, InstallResponse, MemberStatus,
    RefundRequest, RefundResponse, StatusRequest, StatusResponse,
};
use crate::server::request::plan_forwarded;
use crate::server::router::Router;
use crate::server::SharedRules;
use crate::shard::{Exported, KeyId, RefundItem};

/// Serves forwarded checks, refunds, handed-over state and status to peers.
#[derive(Clone)]
pub struct PeerService {
    router: Arc<Router>,
    rules: SharedRules,
    not_owner: metrics::Counter,
    installed: metrics::Counter,
    stale: metrics::Counter,
}

impl PeerService {
    /// A peer service deciding on `router`'s shards.
    pub fn new(router: Arc<Router>, rules: SharedRules) -> Self {
        Self {
            router,
            rules,
            not_owner: metrics::counter!("ringlimit_forwarded_not_owner_total"),
            installed: metrics::counter!("ringlimit_handoff_installed_total"),
            stale: metrics::counter!("ringlimit_forwarded_stale_total"),
        }
    }
}

#[tonic::async_trait]
impl Peer for PeerService {
    async fn forward(
        &self,
        request: Request<ForwardRequest>,
    ) -> Result<Response<ForwardResponse>, Status> {
        let request = request.into_inner();
        if request.deadline_ms != 0 && self.router.now_ms() > request.deadline_ms {
            // The sender gave up on this batch and answered from its fallback; charging
            // it now (after a pause or a healed partition) would only deny later
            // requests for admissions nobody made.
            self.stale.increment(request.items.len() as u64);
            return Err(Status::deadline_exceeded(
                "forwarded batch arrived after its deadline",
            ));
        }
        let rules = self.rules.load();
        let items = request
            .items
            .iter()
            .enumerate()
            .map(|(i, item)| plan_forwarded(item, &rules, i))
            .collect::<Result<Vec<_>, CheckError>>()?;
        let view = self.router.view();
        let me = &self.router.me().node_id;
        let strays = items
            .iter()
            .filter(|i| {
                view.owner(i.client.as_bytes())
                    .is_some_and(|o| *o.node_id != **me)
            })
            .count();
        if strays > 0 {
            // The sender's ring and ours disagree (a membership change in flight). The
            // check is decided here anyway: forwarding it again could loop.
            self.not_owner.increment(strays as u64);
        }
        let answers = self
            .router
            .decide_here(items)
            .await
            .map_err(CheckError::from)?;
        let outcomes = answers
            .into_iter()
            .map(|a| ForwardOutcome {
                allowed: a.decision.allowed,
                limit: a.decision.limit,
                remaining: a.decision.remaining,
                retry_after_ms: a.decision.retry_after_ms,
                reset_at: a.decision.reset_at_ms,
                window_id: a.decision.window_id,
                delay_ms: a.decision.delay_ms,
                sequence: a.sequence,
                at: a.at,
                rule: a.rule.to_string(),
                algorithm: a.algorithm.to_string(),
            })
            .collect();
        let me = self.router.me();
        Ok(Response::new(ForwardResponse {
            node_id: me.node_id.to_string(),
            generation: me.generation,
            outcomes,
        }))
    }

    async fn refund(
        &self,
        request: Request<RefundRequest>,
    ) -> Result<Response<RefundResponse>, Status> {
        let rules = self.rules.load();
        let mut refunds = Vec::new();
        for (i, item) in request.into_inner().items.iter().enumerate() {
            let forward = crate::proto::peer::ForwardItem {
                key: item.key.clone(),
                route: item.route.clone(),
                tier: item.tier.clone(),
                cost: item.cost,
                hops: 1,
            };
            refunds.push(RefundItem {
                item: plan_forwarded(&forward, &rules, i)?,
                at: item.at,
            });
        }
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
        let rules = self.rules.load();
        let total = request.states.len() as u64;
        let mut items = Vec::with_capacity(request.states.len());
        // Any local rule with the same numbers decides identically: the counter's
        // identity (which includes the rule name) travels in the id, so the receiver
        // needs the rule only for its arithmetic. Fallback counters never travel.
        let by_fingerprint: HashMap<u64, &Arc<Rule>> = rules
            .rules()
            .iter()
            .map(|rule| (rule.fingerprint, rule))
            .collect();
        for state in request.states {
            let Some(rule) = by_fingerprint.get(&state.fingerprint) else {
                continue;
            };
            let Some(kind) = AlgorithmKind::parse(&state.algorithm) else {
                continue;
            };
            let Some(key_state) = crate::algorithms::KeyState::from_words(kind, &state.words)
            else {
                continue;
            };
            items.push((
                Exported {
                    id: KeyId {
                        placement: state.placement,
                        disc: state.id,
                    },
                    fingerprint: state.fingerprint,
                    state: key_state,
                },
                Arc::clone(rule),
            ));
        }
        let installed = self
            .router
            .shards()
            .install(items)
            .await
            .map_err(CheckError::from)? as u64;
        self.installed.increment(installed);
        tracing::info!(
            from = %request.from_node,
            installed,
            skipped = total - installed,
            "handoff received"
        );
        Ok(Response::new(InstallResponse {
            installed,
            skipped: total - installed,
        }))
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
            .map(|m| MemberStatus {
                node_id: m.node_id.clone(),
                generation: m.generation,
                grpc_addr: m.grpc_addr.to_string(),
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
        let me = self.router.me();
        Ok(Response::new(StatusResponse {
            node_id: me.node_id.to_string(),
            generation: me.generation,
            ring_digest: view.ring.digest(),
            members,
            keys,
        }))
    }
}
