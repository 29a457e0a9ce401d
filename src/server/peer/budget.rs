//! The peer face's side of budget leases (`docs/leases.md`): a member asking this node,
//! the counter's owner, for a lease, and giving a lease's unused units back. A lease
//! request names its counter as a forwarded check does and is planned by the same code
//! (a member's numbers are still input); both are applied here, never sent on.

use std::sync::Arc;

use tonic::Status;

use crate::check::forwarded;
use crate::check::CheckError;
use crate::cluster::budget::LeaseGrant;
use crate::cluster::CheckItem;
use crate::proto::peer::{
    PeerLeaseRequest, PeerLeaseResponse, PeerReturnLeaseRequest, PeerReturnLeaseResponse,
};
use crate::shard::KeyId;

use super::{forward_outcome, forwarded_input, OwnerRules, PeerService};

/// The peer answer to a lease request for `item` that the owner's shard answered with
/// `grant`: the counter's numbers (never compact), and the lease if there is one.
pub fn lease_response(item: &CheckItem, grant: &LeaseGrant) -> PeerLeaseResponse {
    let answer = crate::cluster::policy::local_answer(
        item,
        &grant.owner,
        grant.decision,
        grant.sequence,
        0,
        item.charge(),
    );
    PeerLeaseResponse {
        node_id: grant.owner.node_id.to_string(),
        generation: grant.owner.generation,
        outcome: Some(forward_outcome(&answer, 0, false)),
        serial: grant.serial,
        units: grant.units,
        ttl_ms: grant.ttl_ms,
    }
}

impl PeerService {
    /// Grant (or refuse) a member a lease of a counter this node owns.
    pub(super) async fn lease_here(
        &self,
        r: PeerLeaseRequest,
    ) -> Result<PeerLeaseResponse, Status> {
        // The holder is who the units are lent to and who may give them back: a name
        // the cluster does not list gets nothing.
        if self.router.view().member(&r.from_node).is_none() {
            return Err(Status::permission_denied(format!(
                "from_node: {:?} is not a member of this node's cluster view; no lease",
                r.from_node
            )));
        }
        let item = r
            .item
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("item: a lease request names its counter"))?;
        let (rules, envoy) = (self.rules.load(), self.envoy.load());
        let owner = OwnerRules {
            rules: &rules,
            envoy: &envoy,
            known: &self.inline,
        };
        let planned = forwarded::plan_batch(std::iter::once(forwarded_input(item)), owner)?;
        let item = planned.into_iter().next().expect("one item planned");
        let grant = self
            .router
            .lease_here(&item, Arc::from(r.from_node.as_str()), r.rate)
            .await
            .map_err(CheckError::from)?;
        Ok(lease_response(&item, &grant))
    }

    /// Take back the unused units of a lease this node granted the sender.
    pub(super) async fn return_lease_here(
        &self,
        r: PeerReturnLeaseRequest,
    ) -> Result<PeerReturnLeaseResponse, Status> {
        let counter = KeyId {
            placement: r.placement,
            disc: r.counter,
        };
        let returned = self
            .router
            .return_lease_here(
                Arc::from(r.from_node.as_str()),
                r.generation,
                r.serial,
                counter,
                r.unused,
            )
            .await
            .map_err(CheckError::from)?;
        Ok(PeerReturnLeaseResponse { returned })
    }
}
