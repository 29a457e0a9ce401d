//! The peer face's replication calls: replicas kept for their owners (`Replicate`),
//! replicas pushed back to an owner that restarted (`Restore`), and the vetting every
//! state from a peer goes through (shared with `Install`).

use tonic::Status;

use super::{decode_install_with, PeerService};
use crate::algorithms::Implausible;
use crate::check::CheckError;
use crate::cluster::handoff::{self, Vetted};
use crate::cluster::link::calls;
use crate::cluster::replication::{self, RestoreAnswer};
use crate::proto::peer::{
    InstallRequest, InstallResponse, KeyState as WireState, RestoreRequest, RestoreResponse,
};

impl PeerService {
    /// Decode states sent by `from` and keep only those a local rule (TOML, Envoy or
    /// inline) could have produced by now (see [`handoff::with_rule_list`]), counting
    /// the refused ones. `what` names them in the log.
    pub(super) fn vet_states(
        &self,
        states: Vec<WireState>,
        from: &str,
        what: &str,
    ) -> Result<Vetted, Status> {
        let (states, inline_rules) = decode_install_with(states, &self.inline)?;
        // Counters of Envoy descriptors travel too: their rules are found among the
        // Envoy configuration's (a request's limit override is not: it restarts); and
        // those of Gubernator's inline rules, rebuilt from the numbers they carry.
        let (rules, envoy) = (self.rules.load(), self.envoy.load());
        let vetted = handoff::with_rule_list(
            states,
            rules
                .rules()
                .iter()
                .chain(envoy.rules())
                .chain(&inline_rules),
            self.router.now_ms(),
        );
        for (counter, &n) in self.refused.iter().zip(&vetted.refused) {
            counter.increment(n);
        }
        let refused = vetted.refused_total();
        if refused > 0 {
            tracing::warn!(
                node_id = %self.router.me().node_id,
                from = %from,
                refused,
                algorithm = vetted.refused[Implausible::Algorithm.index()],
                count = vetted.refused[Implausible::Count.index()],
                future = vetted.refused[Implausible::Future.index()],
                "{what} states refused as implausible (see docs/ownership.md)"
            );
        }
        Ok(vetted)
    }

    /// Keep an owner's replicas (`Peer/Replicate`).
    pub(super) async fn hold_replicas(
        &self,
        request: InstallRequest,
    ) -> Result<InstallResponse, Status> {
        let total = request.states.len() as u64;
        let later = self.replicator.as_ref().is_none_or(|r| {
            r.admit_batch(&request.from_node, request.sender_generation, request.batch)
        });
        if !later {
            // Older than a batch already held from this sender: its states would
            // replace newer replicas (see `replication::ReplicaBatches`).
            tracing::debug!(from = %request.from_node, batch = request.batch, "late replication batch refused");
            return Ok(InstallResponse {
                installed: 0,
                skipped: total,
            });
        }
        let mut vetted = self.vet_states(request.states, &request.from_node, "replicated")?;
        let view = self.router.view();
        vetted.items.retain(|(item, _)| {
            replication::from_owner(&view, item.id.placement, &request.from_node)
        });
        let held = self
            .router
            .shards()
            .hold_replicas(vetted.items)
            .await
            .map_err(CheckError::from)? as u64;
        Ok(InstallResponse {
            installed: held,
            skipped: total - held,
        })
    }

    /// Push a restarted owner its replicas (`Peer/Restore`).
    pub(super) async fn send_replicas(
        &self,
        request: RestoreRequest,
    ) -> Result<RestoreResponse, Status> {
        let Some(replicator) = &self.replicator else {
            return Ok(RestoreResponse::default());
        };
        let view = self.router.view();
        let answer = replicator.restore_answer(&view, &request.from_node, request.generation);
        let mut to = match answer {
            RestoreAnswer::Nothing => return Ok(RestoreResponse::default()),
            RestoreAnswer::Joiner | RestoreAnswer::Rejoiner => {
                let Some(joiner) = calls::restoring_member(&request) else {
                    return Err(Status::invalid_argument("restore: bad peer address"));
                };
                let rejoining = answer == RestoreAnswer::Rejoiner;
                let (sent, installed) = replicator
                    .hand_over_to_joiner(&view, &joiner, rejoining)
                    .await;
                if sent > 0 {
                    tracing::info!(
                        node_id = %self.router.me().node_id,
                        to = %request.from_node,
                        sent,
                        installed,
                        "keys handed over to a restoring member this node's view does not hold yet"
                    );
                }
                // Back from a graceful leave, it is not new: other members hold its
                // keys too, so it asks those it sees later as well (see `Restoring`).
                return Ok(RestoreResponse {
                    sent,
                    installed,
                    earlier: rejoining,
                });
            }
            RestoreAnswer::Replicas => view
                .member(&request.from_node)
                .cloned()
                .expect("a member the view holds"),
        };
        // The sender may have restarted on new ports before this node's view noticed:
        // push where it says it is now.
        if let Ok(addr) = request.peer_addr.parse() {
            to.peer_addr = addr;
        }
        to.generation = request.generation;
        let (sent, installed) = replicator.send_replicas(&view, &to).await;
        tracing::info!(
            node_id = %self.router.me().node_id,
            to = %request.from_node,
            sent,
            installed,
            "replicas sent back to a restarted owner"
        );
        Ok(RestoreResponse {
            sent,
            installed,
            earlier: true,
        })
    }
}
