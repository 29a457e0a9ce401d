//! The peer face's side of reservations: a `Reserve` forwarded by a node that does not
//! own the key, and a `Commit` sent to the key's current owner. Both are planned by the
//! check layer with the same code as a client's (a member's numbers are still input)
//! and applied here, never sent on.

use tonic::Status;

use crate::check::reserve::{
    plan_acquire, plan_commit, plan_reserve, AcquireInput, CommitInput, ReserveInput,
};
use crate::check::CheckError;
use crate::cluster::link;
use crate::cluster::reservation::Hold;
use crate::proto::peer::{
    PeerCommitRequest, PeerCommitResponse, PeerReserveRequest, PeerReserveResponse,
};

use super::{forward_outcome, PeerService};

/// A wire number as the signed input the check layer bounds (anything past `i64` is
/// past every bound).
fn signed(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl PeerService {
    /// Reserve (or acquire a lease) on this node for a peer: its check, and the id when
    /// admitted.
    pub(super) async fn reserve_here(
        &self,
        r: PeerReserveRequest,
    ) -> Result<PeerReserveResponse, Status> {
        let input = ReserveInput {
            key: &r.key,
            route: &r.route,
            tier: r.tier.as_deref(),
            amount: Some(signed(r.amount)),
            ttl_ms: Some(signed(r.ttl_ms)),
        };
        let rules = self.rules.load();
        let (planned, hold) = if r.lease {
            let acquire = AcquireInput {
                key: input.key,
                route: input.route,
                tier: input.tier,
                ttl_ms: input.ttl_ms,
            };
            (plan_acquire(&acquire, &rules)?, Hold::Lease)
        } else {
            (plan_reserve(&input, &rules)?, Hold::Reservation)
        };
        let reservation = self
            .router
            .reserve_here(&planned.item, planned.ttl_ms, hold)
            .await
            .map_err(CheckError::from)?;
        let me = self.router.me();
        let (reservation_id, expires_at) = reservation.id.unwrap_or_default();
        Ok(PeerReserveResponse {
            node_id: me.node_id.to_string(),
            generation: me.generation,
            outcome: Some(forward_outcome(&reservation.answer, 0, false)),
            reservation_id,
            expires_at,
        })
    }

    /// Commit (or release) on this node for a peer that found it the key's owner.
    pub(super) async fn commit_here(
        &self,
        r: PeerCommitRequest,
    ) -> Result<PeerCommitResponse, Status> {
        let input = CommitInput {
            reservation_id: &r.reservation_id,
            actual: signed(r.actual),
        };
        let (id, actual) = plan_commit(&input)?;
        let committed = self
            .router
            .commit_here(&self.rules.load(), &id, actual)
            .await
            .map_err(CheckError::from)?;
        Ok(link::calls::commit_response(&committed))
    }
}
