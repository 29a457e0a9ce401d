//! The one-shot peer calls (refund, install, rules pull, rules write) as pure request
//! builders and answer readers: the shell only makes the tonic call and bounds its time.

use std::time::Duration;

use crate::algorithms::Decision;
use crate::algorithms::Millis;
use crate::cluster::reservation::{Committed, Hold, ReservationError};
use crate::cluster::rules_edit::{Refusal, RulesEdit, Written};
use crate::cluster::{CheckItem, InlineRules};
use crate::config::rules::{RulesSource, Stamp};
use crate::membership::Member;
use crate::proto::peer::{
    CounterState, CountersRequest, CountersResponse, InstallRequest, KeyState as WireState,
    PeerCommitRequest, PeerCommitResponse, PeerReserveRequest, PeerReserveResponse,
    RefundItem as WireRefund, RefundRequest, RestoreRequest, RulesRequest, RulesResponse,
    WriteRulesRequest, WriteRulesResponse,
};
use crate::shard::counters::{ClientCounters, ClientQuery, CounterReading};
use crate::shard::reservations::Settled;
use crate::shard::Exported;
use crate::text::Text;

use super::wire::{wire_inline, wire_named};
use super::{CountersError, ForwardError, PulledRules, RemoteWriteError, WriteOutcome};

/// How long a handoff push or a rules write may take: not on a caller's path, so more
/// than a check.
pub fn install_deadline(timeout: Duration) -> Duration {
    timeout.max(Duration::from_secs(5))
}

/// How long a rules pull may take.
pub fn pull_deadline(timeout: Duration) -> Duration {
    timeout.max(Duration::from_secs(2))
}

/// A failed call to `peer` as the link reports it: `None` is a call that ran out of time.
pub fn call_error(peer: &str, status: Option<&tonic::Status>) -> ForwardError {
    match status {
        Some(status) => {
            ForwardError::from_status(peer, status.code(), status.message().to_string())
        }
        None => ForwardError::Timeout(peer.to_string()),
    }
}

/// Admitted checks given back, each quoting the owner's clock at its admission.
pub fn refund_request(items: &[(CheckItem, Millis)]) -> RefundRequest {
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
    RefundRequest { items }
}

/// Handed-over state from node `me` of keys it started from the receiver's own
/// replicas, for the receiver to join (see `ShardCore::export_back`).
pub fn hand_back_request(me: &str, states: &[Exported], inline: &InlineRules) -> InstallRequest {
    InstallRequest {
        joined: true,
        ..install_request(me, states, inline)
    }
}

/// Replicas from node `me`, as its batch `batch` of incarnation `generation` (see
/// `replication::ReplicaBatches`).
pub fn replicate_request(
    me: &str,
    states: &[Exported],
    inline: &InlineRules,
    (generation, batch): (u64, u64),
) -> InstallRequest {
    InstallRequest {
        sender_generation: generation,
        batch,
        ..install_request(me, states, inline)
    }
}

/// Handed-over state from node `me`; a counter of an inline rule carries its numbers.
pub fn install_request(me: &str, states: &[Exported], inline: &InlineRules) -> InstallRequest {
    InstallRequest {
        from_node: me.to_string(),
        states: states
            .iter()
            .map(|item| WireState {
                placement: item.id.placement,
                id: item.id.disc,
                fingerprint: item.fingerprint,
                algorithm: Text::from_static(item.state.kind().as_str()),
                words: item.state.to_words(),
                inline: inline.inline_of(item.fingerprint).map(wire_inline),
            })
            .collect(),
        joined: false,
        sender_generation: 0,
        batch: 0,
    }
}

/// A restore request: "push me the replicas of my keys".
pub fn restore_request(me: &Member) -> RestoreRequest {
    RestoreRequest {
        from_node: me.node_id.clone(),
        generation: me.generation,
        peer_addr: me.peer_addr.to_string(),
    }
}

/// The member a restore request comes from, as far as pushing to it goes: its id,
/// incarnation and peer address (`None`: the address does not parse). Its public and
/// gossip addresses are not in the request; they stand at the peer address.
pub fn restoring_member(request: &RestoreRequest) -> Option<Member> {
    let peer_addr = request.peer_addr.parse().ok()?;
    Some(Member {
        node_id: request.from_node.clone(),
        generation: request.generation,
        grpc_addr: peer_addr,
        peer_addr,
        gossip_addr: peer_addr,
        leaving: false,
    })
}

/// Node `me` asking for a peer's rule set.
pub fn rules_request(me: &str) -> RulesRequest {
    RulesRequest {
        from_node: me.to_string(),
    }
}

/// A peer's rule set as it sent it (checked by the caller, never enforced as is).
pub fn pulled_rules(r: RulesResponse) -> PulledRules {
    PulledRules {
        source: RulesSource::parse(&r.source),
        stamp: Stamp {
            version: r.version,
            digest: r.digest,
        },
        document: r.document,
    }
}

/// A rules write from node `me`, applied by the coordinator to its own copy.
pub fn write_request(me: &str, if_match: Option<u64>, edit: &RulesEdit) -> WriteRulesRequest {
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
    WriteRulesRequest {
        from_node: me.to_string(),
        if_match,
        kind: kind.to_string(),
        tier,
        route_pattern,
        body,
    }
}

/// What coordinator `peer` says it wrote.
pub fn write_outcome(peer: &str, r: WriteRulesResponse) -> WriteOutcome {
    WriteOutcome {
        written: Written {
            stamp: Stamp {
                version: r.version,
                digest: r.digest,
            },
            changed: r.changed,
            rule: (!r.rule.is_empty()).then_some(r.rule),
            coordinator: peer.to_string(),
        },
        document: r.document,
    }
}

/// A rules write that failed: the coordinator's refusal (the codes its edge maps
/// [`Refusal`]s to), or a call that failed (`None`: ran out of time) and changed
/// nothing known.
pub fn write_error(peer: &str, status: Option<&tonic::Status>) -> RemoteWriteError {
    let refusal = status.and_then(|status| match status.code() {
        tonic::Code::InvalidArgument => Some(Refusal::Invalid),
        tonic::Code::FailedPrecondition => Some(Refusal::Stale),
        tonic::Code::NotFound => Some(Refusal::NotFound),
        tonic::Code::PermissionDenied => Some(Refusal::ReadOnly),
        tonic::Code::Internal => Some(Refusal::Internal),
        tonic::Code::Aborted => Some(Refusal::Unavailable),
        _ => None,
    });
    match (refusal, status) {
        (Some(kind), Some(status)) => RemoteWriteError::Refused(kind, status.message().to_string()),
        _ => RemoteWriteError::Failed(call_error(peer, status)),
    }
}

/// Node `me` asking a key's owner for the client's counters (`reset`: dropping them),
/// on behalf of `by` (who the ops port authenticated, for the owner's audit line).
pub fn counters_request(me: &str, query: &ClientQuery, reset: bool, by: &str) -> CountersRequest {
    CountersRequest {
        from_node: me.to_string(),
        key: query.key().to_string(),
        route: query.route().map(str::to_string),
        tier: query.tier().map(str::to_string),
        reset,
        requested_by: by.to_string(),
    }
}

/// The counters an owner answered.
pub fn counters_answer(r: CountersResponse) -> ClientCounters {
    ClientCounters {
        owner: r.node_id,
        generation: r.generation,
        counters: r
            .counters
            .into_iter()
            .map(|c| CounterReading {
                rule: c.rule,
                algorithm: c.algorithm,
                route: c.route,
                limit: c.limit,
                remaining: c.remaining,
                reset_at_ms: c.reset_at,
            })
            .collect(),
    }
}

/// The wire form of an owner's answer (the server side of [`counters_answer`]).
pub fn counters_response(answer: &ClientCounters) -> CountersResponse {
    CountersResponse {
        node_id: answer.owner.clone(),
        generation: answer.generation,
        counters: answer
            .counters
            .iter()
            .map(|c| CounterState {
                rule: c.rule.clone(),
                algorithm: c.algorithm.clone(),
                route: c.route.clone(),
                limit: c.limit,
                remaining: c.remaining,
                reset_at: c.reset_at_ms,
            })
            .collect(),
    }
}

/// A counters call that failed: the owner refused the query (`INVALID_ARGUMENT`: it
/// read and changed nothing), or the call failed (`None`: ran out of time), and whether
/// a reset happened is unknown.
pub fn counters_error(peer: &str, status: Option<&tonic::Status>) -> CountersError {
    match status {
        Some(s) if s.code() == tonic::Code::InvalidArgument => {
            CountersError::Refused(s.message().to_string())
        }
        _ => CountersError::Failed(call_error(peer, status)),
    }
}

/// Node `me` asking a key's owner to reserve `item` (its cost is the amount), or to
/// grant a lease of it.
pub fn reserve_request(me: &str, item: &CheckItem, ttl_ms: u64, hold: Hold) -> PeerReserveRequest {
    PeerReserveRequest {
        lease: hold == Hold::Lease,
        from_node: me.to_string(),
        key: item.client().to_string(),
        route: item.route().to_string(),
        tier: item.tier.as_deref().map(str::to_string),
        amount: item.cost.get(),
        ttl_ms,
    }
}

/// An owner's answer to a reservation: its check, and the id when admitted. An answer
/// without its check is a broken peer's, said as a failed call.
pub fn reserve_answer(
    r: PeerReserveResponse,
    item: &CheckItem,
) -> Result<(crate::cluster::Remote, Option<(String, Millis)>), ReservationError> {
    let decider = crate::cluster::Decider {
        node_id: std::sync::Arc::from(r.node_id.as_str()),
        generation: r.generation,
    };
    let outcome = r.outcome.ok_or_else(|| {
        ReservationError::Unreachable(
            ForwardError::Unreachable(
                r.node_id.clone(),
                "a reservation answer without its check".into(),
            )
            .to_string(),
        )
    })?;
    let remote = super::wire::remote(outcome, &decider, item.rule.name.clone());
    let id = (!r.reservation_id.is_empty()).then_some((r.reservation_id, r.expires_at));
    Ok((remote, id))
}

/// Node `me` sending a commit to the current owner of the reservation's key.
pub fn commit_request(me: &str, id: &str, actual: u64) -> PeerCommitRequest {
    PeerCommitRequest {
        from_node: me.to_string(),
        reservation_id: id.to_string(),
        actual,
    }
}

/// What the owner did with a commit.
pub fn commit_answer(r: PeerCommitResponse) -> Committed {
    let after = r.limit.map(|limit| Decision {
        allowed: r.remaining > 0,
        limit,
        remaining: r.remaining,
        retry_after_ms: 0,
        reset_at_ms: 0,
        window_id: None,
        delay_ms: 0,
    });
    Committed {
        settled: Settled {
            returned: r.returned,
            charged: r.charged,
            uncharged: r.uncharged,
            moved: r.moved,
            after,
            sequence: r.sequence,
        },
        decider: crate::cluster::Decider {
            node_id: std::sync::Arc::from(r.node_id.as_str()),
            generation: r.generation,
        },
        rule: r.rule,
    }
}

/// The wire form of a commit's answer (the server side of [`commit_answer`]).
pub fn commit_response(c: &Committed) -> PeerCommitResponse {
    let s = &c.settled;
    PeerCommitResponse {
        node_id: c.decider.node_id.to_string(),
        generation: c.decider.generation,
        returned: s.returned,
        charged: s.charged,
        uncharged: s.uncharged,
        moved: s.moved,
        limit: s.after.map(|d| d.limit),
        remaining: s.after.map_or(0, |d| d.remaining),
        rule: c.rule.clone(),
        sequence: s.sequence,
    }
}

/// A reservation or commit call that failed: the owner's refusal as it said it
/// (`RESOURCE_EXHAUSTED`: its table or inbox is full, nothing charged;
/// `FAILED_PRECONDITION`: the commit changed nothing; `INVALID_ARGUMENT`: the input),
/// else a failed call whose effect is unknown.
pub fn reservation_error(peer: &str, status: Option<&tonic::Status>) -> ReservationError {
    match status.map(|s| (s.code(), s.message().to_string())) {
        Some((tonic::Code::ResourceExhausted, m)) => ReservationError::Full(m),
        Some((tonic::Code::FailedPrecondition, m)) => ReservationError::Refused(m),
        Some((tonic::Code::InvalidArgument, m)) => ReservationError::Invalid(m),
        _ => ReservationError::Unreachable(call_error(peer, status).to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::policy::testkit;
    use crate::config::rules::RulesDoc;

    #[test]
    fn deadlines_of_calls_off_the_callers_path_have_a_floor() {
        let short = Duration::from_millis(250);
        assert_eq!(install_deadline(short), Duration::from_secs(5));
        assert_eq!(pull_deadline(short), Duration::from_secs(2));
        let long = Duration::from_secs(9);
        assert_eq!((install_deadline(long), pull_deadline(long)), (long, long));
    }

    #[test]
    fn a_failed_call_is_unreachable_with_its_message_or_a_timeout() {
        let status = tonic::Status::unavailable("refused");
        assert_eq!(
            call_error("p", Some(&status)),
            ForwardError::Unreachable("p".into(), "refused".into())
        );
        assert_eq!(call_error("p", None), ForwardError::Timeout("p".into()));
    }

    #[test]
    fn a_counters_call_carries_the_query_and_its_answer_reads_back_what_the_owner_sent() {
        let query = ClientQuery::new("cust", Some("GET /x?y=1"), Some("gold")).unwrap();
        let request = counters_request("b", &query, true, "admin token 01234567");
        assert_eq!(
            (
                request.from_node.as_str(),
                request.key.as_str(),
                request.reset
            ),
            ("b", "cust", true)
        );
        assert_eq!(request.route.as_deref(), Some("GET /x?y=1"));
        assert_eq!(request.tier.as_deref(), Some("gold"));
        assert_eq!(request.requested_by, "admin token 01234567");
        let answer = ClientCounters {
            owner: "a".into(),
            generation: 7,
            counters: vec![CounterReading {
                rule: "t".into(),
                algorithm: "fixed_window".into(),
                route: "GET /x".into(),
                limit: 10,
                remaining: 4,
                reset_at_ms: 99,
            }],
        };
        assert_eq!(counters_answer(counters_response(&answer)), answer);
    }

    #[test]
    fn an_owner_refusing_a_counters_query_is_told_apart_from_a_failed_call() {
        let refused = tonic::Status::invalid_argument("key: must not be empty");
        assert!(matches!(
            counters_error("a", Some(&refused)),
            CountersError::Refused(m) if m == "key: must not be empty"
        ));
        let down = tonic::Status::unavailable("reset");
        assert!(matches!(
            counters_error("a", Some(&down)),
            CountersError::Failed(ForwardError::Unreachable(..))
        ));
        assert!(matches!(
            counters_error("a", None),
            CountersError::Failed(ForwardError::Timeout(_))
        ));
    }

    #[test]
    fn a_refund_quotes_each_admission_time() {
        let item = testkit::item("k", "GET /x", 2);
        let request = refund_request(&[(item, 1234)]);
        let wire = &request.items[0];
        assert_eq!((wire.key.as_str(), wire.route.as_str()), ("k", "GET /x"));
        assert_eq!((wire.cost, wire.at), (2, 1234));
    }

    #[test]
    fn an_install_names_its_sender() {
        let request = install_request("me", &[], &InlineRules::default());
        assert_eq!(request.from_node, "me");
        assert!(request.states.is_empty());
        assert_eq!(rules_request("me").from_node, "me");
    }

    #[test]
    fn a_pulled_rule_set_keeps_its_claimed_stamp_and_an_unknown_source_is_none() {
        let pulled = pulled_rules(RulesResponse {
            source: "no such source".into(),
            version: 3,
            digest: 9,
            document: "{}".into(),
        });
        assert!(pulled.source.is_none());
        assert_eq!((pulled.stamp.version, pulled.stamp.digest), (3, 9));
        assert_eq!(pulled.document, "{}");
    }

    #[test]
    fn each_edit_travels_as_its_kind() {
        let delete = RulesEdit::DeleteTierLimit {
            tier: "gold".into(),
            route: Some("GET /x".into()),
        };
        let r = write_request("me", Some(4), &delete);
        assert_eq!(
            (r.kind.as_str(), r.tier.as_str()),
            ("delete_tier_limit", "gold")
        );
        assert_eq!(
            (r.route_pattern.as_deref(), r.if_match),
            (Some("GET /x"), Some(4))
        );
        let replace = write_request("me", None, &RulesEdit::Replace(RulesDoc::default()));
        assert_eq!(replace.kind, "replace");
        assert_eq!(replace.body, RulesDoc::default().to_json());
        let envoy = write_request("me", None, &RulesEdit::ReplaceEnvoy(None));
        assert_eq!(
            (envoy.kind.as_str(), envoy.body.as_str()),
            ("replace_envoy", "null")
        );
    }

    #[test]
    fn a_write_answer_names_its_coordinator_and_an_empty_rule_is_none() {
        let outcome = write_outcome(
            "coord",
            WriteRulesResponse {
                version: 2,
                digest: 5,
                changed: true,
                rule: String::new(),
                document: "{}".into(),
            },
        );
        assert_eq!(outcome.written.coordinator, "coord");
        assert_eq!(outcome.written.rule, None);
        assert!(outcome.written.changed);
    }

    #[test]
    fn a_write_refusal_keeps_its_kind_and_other_failures_change_nothing_known() {
        let stale = tonic::Status::failed_precondition("old version");
        assert!(matches!(
            write_error("c", Some(&stale)),
            RemoteWriteError::Refused(Refusal::Stale, m) if m == "old version"
        ));
        let down = tonic::Status::unavailable("gone");
        assert!(matches!(
            write_error("c", Some(&down)),
            RemoteWriteError::Failed(ForwardError::Unreachable(..))
        ));
        assert!(matches!(
            write_error("c", None),
            RemoteWriteError::Failed(ForwardError::Timeout(_))
        ));
    }
}
