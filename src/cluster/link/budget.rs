//! Budget leases on the peer link (`docs/leases.md`): a request for a lease of a hot
//! counter and the return of a lease's unused units, as pure request builders and
//! answer readers, and the two one-shot calls around them.

use crate::cluster::budget::LeaseGrant;
use crate::cluster::{CheckItem, Decider};
use crate::membership::Member;
use crate::proto::peer::{
    PeerLeaseRequest, PeerLeaseResponse, PeerReturnLeaseRequest, PeerReturnLeaseResponse,
};
use crate::shard::budget::entry::Returned;

use super::{calls, wire, ForwardError, PeerPool};

/// Node `me` asking for a lease of `item`'s counter, seen at `rate` units per second.
pub fn lease_request(me: &str, item: &CheckItem, rate: u64) -> PeerLeaseRequest {
    PeerLeaseRequest {
        from_node: me.to_string(),
        item: Some(wire::forward_item(item)),
        rate,
    }
}

/// An owner's answer to a lease request. An answer without the counter's numbers is a
/// broken peer's, said as a failed call.
pub fn lease_answer(r: PeerLeaseResponse, item: &CheckItem) -> Result<LeaseGrant, ForwardError> {
    let owner = Decider {
        node_id: std::sync::Arc::from(r.node_id.as_str()),
        generation: r.generation,
    };
    let outcome = r.outcome.ok_or_else(|| {
        ForwardError::Unreachable(
            r.node_id.clone(),
            "a lease answer without its numbers".into(),
        )
    })?;
    let remote = wire::remote(outcome, &owner, item.rule.name.clone());
    Ok(LeaseGrant {
        owner,
        serial: r.serial,
        units: r.units,
        ttl_ms: r.ttl_ms,
        decision: remote.decision,
        sequence: remote.sequence,
    })
}

/// Node `me` giving back the unused units of a lease it held.
pub fn return_request(me: &str, returned: &Returned) -> PeerReturnLeaseRequest {
    PeerReturnLeaseRequest {
        from_node: me.to_string(),
        generation: returned.owner.1,
        serial: returned.serial,
        placement: returned.counter.placement,
        counter: returned.counter.disc,
        unused: returned.unused,
    }
}

impl PeerPool {
    /// Ask `owner` for a lease of `item`'s counter. Never retried: a grant whose answer
    /// was lost stays charged on the owner (units lost to an under-admission).
    pub async fn lease(
        &self,
        owner: &Member,
        item: &CheckItem,
        rate: u64,
    ) -> Result<LeaseGrant, ForwardError> {
        let mut client = self.client(owner);
        let request = lease_request(self.me(), item, rate);
        super::pool::bounded(self.config().timeout, client.lease(request))
            .await
            .map_err(|status| calls::call_error(&owner.node_id, status.as_ref()))
            .and_then(|answer| lease_answer(answer, item))
    }

    /// Give the unused units of a lease back to `owner`, the node that granted it;
    /// answers how many it gave back to the counter.
    pub async fn return_lease(
        &self,
        owner: &Member,
        returned: &Returned,
    ) -> Result<u64, ForwardError> {
        let mut client = self.client(owner);
        let request = return_request(self.me(), returned);
        super::pool::bounded(
            calls::pull_deadline(self.config().timeout),
            client.return_lease(request),
        )
        .await
        .map(|r: PeerReturnLeaseResponse| r.returned)
        .map_err(|status| calls::call_error(&owner.node_id, status.as_ref()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::policy::testkit;
    use crate::proto::peer::ForwardOutcome;
    use crate::shard::KeyId;

    #[test]
    fn a_lease_request_names_the_counter_like_a_forward_and_its_answer_reads_back() {
        let item = testkit::item("whale", "GET /x", 1);
        let request = lease_request("b", &item, 900);
        assert_eq!((request.from_node.as_str(), request.rate), ("b", 900));
        assert_eq!(request.item.as_ref().unwrap().key, "whale");
        let answer = PeerLeaseResponse {
            node_id: "a".into(),
            generation: 7,
            outcome: Some(ForwardOutcome {
                allowed: true,
                limit: 100,
                remaining: 40,
                ..ForwardOutcome::default()
            }),
            serial: 3,
            units: 20,
            ttl_ms: 800,
        };
        let grant = lease_answer(answer.clone(), &item).unwrap();
        assert_eq!((grant.serial, grant.units, grant.ttl_ms), (3, 20, 800));
        assert_eq!(grant.decision.remaining, 40);
        let held = grant.held(&item, 1_000).unwrap();
        assert_eq!((held.until, held.left), (1_800, 20));
        let refused = PeerLeaseResponse {
            units: 0,
            ..answer.clone()
        };
        assert!(lease_answer(refused, &item)
            .unwrap()
            .held(&item, 0)
            .is_none());
        let broken = PeerLeaseResponse {
            outcome: None,
            ..answer
        };
        assert!(lease_answer(broken, &item).is_err());
    }

    #[test]
    fn a_return_names_the_generation_that_granted_the_lease() {
        let counter = KeyId::of("r", b"k", "");
        let request = return_request(
            "b",
            &Returned {
                owner: ("a".into(), 9),
                serial: 4,
                counter,
                unused: 12,
            },
        );
        assert_eq!(
            (request.generation, request.serial, request.unused),
            (9, 4, 12)
        );
        assert_eq!(
            (request.placement, request.counter),
            (counter.placement, counter.disc)
        );
    }
}
