//! The peer server adapter: the node-to-node service `ringlimit.peer.v1.Peer`.
//!
//! Decodes forwarded checks, refunds and handed-over state into domain types, has the
//! check layer validate them and the cluster wing decide them, and encodes the answers.
//! With `cluster::forward` (the client side), the only code that sees peer prost types.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::algorithms::{AlgorithmKind, KeyState};
use crate::check::plan::plan_forwarded;
use crate::check::{CheckError, DescriptorInput, Leaf};
use crate::cluster::{handoff, policy, CheckItem, Router};
use crate::config::SharedRules;
use crate::proto::peer::peer_server::Peer;
use crate::proto::peer::{
    ForwardOutcome, ForwardRequest, ForwardResponse, InstallRequest, InstallResponse, MemberStatus,
    RefundRequest, RefundResponse, StatusRequest, StatusResponse,
};
use crate::shard::{Exported, KeyId, Refund};

/// Plan one forwarded (or refunded) item, named `items[i]` in errors.
fn plan_item(
    key: &str,
    route: &str,
    tier: Option<&str>,
    cost: u64,
    rules: &crate::config::rules::RuleSet,
    index: usize,
) -> Result<CheckItem, CheckError> {
    let input = DescriptorInput {
        key,
        route,
        tier,
        // A cost beyond i64 is beyond any limit too: refused the same way.
        cost: Some(i64::try_from(cost).unwrap_or(i64::MAX)),
    };
    plan_forwarded(&input, rules, |leaf: Leaf| {
        format!("items[{index}].{}", leaf.as_str())
    })
}

/// Serves forwarded checks, refunds, handed-over state and status to peers.
#[derive(Clone)]
pub struct PeerService {
    router: Arc<Router>,
    rules: SharedRules,
    installed: metrics::Counter,
    stale: metrics::Counter,
}

impl PeerService {
    /// A peer service deciding on `router`'s shards.
    pub fn new(router: Arc<Router>, rules: SharedRules) -> Self {
        Self {
            router,
            rules,
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
        if policy::arrived_too_late(request.deadline_ms, self.router.now_ms()) {
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
            .map(|(i, item)| {
                plan_item(
                    &item.key,
                    &item.route,
                    item.tier.as_deref(),
                    item.cost,
                    &rules,
                    i,
                )
            })
            .collect::<Result<Vec<_>, CheckError>>()?;
        let answers = self
            .router
            .decide_forwarded(&items)
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
                algorithm: a.algorithm.as_str().to_string(),
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
        let refunds = request
            .into_inner()
            .items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let planned = plan_item(
                    &item.key,
                    &item.route,
                    item.tier.as_deref(),
                    item.cost,
                    &rules,
                    i,
                )?;
                Ok(Refund {
                    charge: planned.charge(),
                    at: item.at,
                })
            })
            .collect::<Result<Vec<_>, CheckError>>()?;
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
        // Undecodable states (an algorithm or a word layout this node does not know)
        // are skipped, like states of rules this node does not have.
        let states: Vec<Exported> = request
            .states
            .into_iter()
            .filter_map(|state| {
                let kind = AlgorithmKind::parse(&state.algorithm)?;
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
        let items = handoff::with_rules(states, &self.rules.load());
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
