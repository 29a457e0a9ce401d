//! The prost side of a forwarded check: a [`CheckItem`] as a `ForwardItem`, a batch as a
//! `ForwardRequest`, and an owner's `ForwardAnswer` / `ForwardResponse` back as
//! [`Remote`] answers. Pure conversions; the state machines beside this module never
//! see a prost type.

use std::num::NonZeroU64;
use std::sync::Arc;

use crate::algorithms::{AlgorithmKind, Decision};
use crate::cluster::{CheckItem, Decider, InlineRule, NamedRule, Remote};
use crate::proto::peer::{
    ForwardAnswer, ForwardItem, ForwardOutcome, ForwardRequest, ForwardResponse,
};
use crate::text::Text;

use super::session::Answered;
use super::ForwardError;

impl Answered for ForwardResponse {
    fn outcomes(&self) -> usize {
        self.outcomes.len()
    }
}

/// What a compact forward sends for the rule it matched (see `ForwardItem.rule_hash`).
pub fn rule_hash(name: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(name.as_bytes())
}

/// How the numbers of an inline rule travel.
pub fn wire_inline(r: InlineRule) -> crate::proto::peer::InlineRule {
    crate::proto::peer::InlineRule {
        algorithm: r.kind.as_str().to_string(),
        limit: r.limit,
        window_ms: r.window_ms,
        burst: r.burst,
    }
}

/// How a rule found by name travels to the owner.
pub fn wire_named(named: &NamedRule) -> crate::proto::peer::NamedRule {
    let (override_limit, override_unit_seconds) = named.override_limit.unwrap_or((0, 0));
    crate::proto::peer::NamedRule {
        name: named.name.to_string(),
        override_limit,
        override_unit_seconds,
        inline: named.inline.map(wire_inline),
    }
}

/// One check as its owner receives it (one hop: the owner never forwards it again).
/// The key and route are slices of the item's own string (one small allocation for
/// sharing it, none per field), written into the call's body once, when it is sent.
pub fn forward_item(item: &CheckItem) -> ForwardItem {
    let (key, route) = item.texts();
    ForwardItem {
        key,
        route,
        tier: item.tier.clone().map(Text::shared),
        cost: item.cost.get(),
        hops: 1,
        named: item.named.as_ref().map(wire_named),
        give_back: item.give_back.map_or(0, NonZeroU64::get),
        drain: item.drain,
        peek: item.peek,
        rule_hash: rule_hash(&item.rule.name),
        failover: item.target.flags().0,
        failover_in_doubt: item.target.flags().1,
    }
}

/// A batch's request: its items in order, due at `deadline_ms` on the owner's clock
/// (wall-clock milliseconds; the owner refuses it after that, when no caller waits).
pub fn forward_request(items: Vec<ForwardItem>, deadline_ms: u64) -> ForwardRequest {
    ForwardRequest {
        // The call's proof (or its stream's) names the sender where the cluster has a
        // key; the owner reads no name from a batch, so none is copied into every one.
        from_node: String::new(),
        items,
        deadline_ms,
        compact: true,
    }
}

/// One answer read from a `ForwardStream`: its call number, and the response or why
/// there is none.
pub fn stream_answer(
    answer: ForwardAnswer,
    peer: &str,
) -> (u64, Result<ForwardResponse, ForwardError>) {
    let result = match answer.response {
        Some(response) if answer.code == 0 => Ok(response),
        _ if answer.code == 0 => Err(ForwardError::Unreachable(
            peer.to_string(),
            "an answer without a response".into(),
        )),
        _ => Err(ForwardError::from_status(
            peer,
            tonic::Code::from(answer.code as i32),
            answer.message,
        )),
    };
    (answer.call, result)
}

/// Who decided a batch. The owner is the peer the link was made for (unless a node with
/// another id took its address): its id is shared, not copied.
pub fn decider(response: &ForwardResponse, peer: &Arc<str>) -> Decider {
    let node_id = if *response.node_id == **peer {
        peer.clone()
    } else {
        Arc::from(response.node_id.as_str())
    };
    Decider {
        node_id,
        generation: response.generation,
    }
}

/// Decode one owner's answer; `sent` is the rule this node matched, shared when the
/// owner names the same.
pub fn remote(o: ForwardOutcome, decider: &Decider, sent: Arc<str>) -> Remote {
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
        rule: if o.same_rule || *sent == *o.rule {
            sent
        } else {
            Arc::from(o.rule.as_str())
        },
        algorithm: match o.algorithm_index {
            0 => AlgorithmKind::parse(&o.algorithm),
            i => AlgorithmKind::ALL.get(i as usize - 1).copied(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::policy::testkit;

    #[test]
    fn a_check_travels_as_one_hop_naming_its_rule_by_hash() {
        let item = testkit::item("k", "GET /x", 3);
        let wire = forward_item(&item);
        assert_eq!((wire.key.as_str(), wire.route.as_str()), ("k", "GET /x"));
        assert_eq!((wire.cost, wire.hops, wire.give_back), (3, 1, 0));
        assert_eq!(wire.rule_hash, rule_hash(&item.rule.name));
        assert_ne!(rule_hash("a"), rule_hash("b"));
        let request = forward_request(vec![wire], 77);
        assert!(request.compact && request.from_node.is_empty());
        assert_eq!(request.deadline_ms, 77);
    }

    #[test]
    fn a_stream_answer_is_its_response_or_the_reason_there_is_none() {
        let ok = ForwardAnswer {
            call: 4,
            response: Some(ForwardResponse::default()),
            code: 0,
            message: String::new(),
        };
        assert!(matches!(stream_answer(ok, "p"), (4, Ok(_))));
        let empty = ForwardAnswer {
            call: 5,
            ..ForwardAnswer::default()
        };
        assert_eq!(
            stream_answer(empty, "p").1.unwrap_err(),
            ForwardError::Unreachable("p".into(), "an answer without a response".into())
        );
        let refused = ForwardAnswer {
            call: 6,
            response: None,
            code: tonic::Code::DeadlineExceeded as u32,
            message: "late".into(),
        };
        let refusal = stream_answer(refused, "p").1.unwrap_err();
        assert_eq!(refusal, ForwardError::Refused("p".into(), "late".into()));
        assert!(
            !refusal.owner_unreachable(),
            "an owner that refuses is alive"
        );
        let restoring = ForwardAnswer {
            call: 7,
            response: None,
            code: tonic::Code::Unavailable as u32,
            message: "restoring".into(),
        };
        assert!(stream_answer(restoring, "p")
            .1
            .unwrap_err()
            .owner_unreachable());
    }

    #[test]
    fn an_outcome_shares_the_peer_id_and_the_sent_rule_when_they_match() {
        let peer: Arc<str> = "owner".into();
        let response = ForwardResponse {
            node_id: "owner".into(),
            generation: 7,
            outcomes: vec![],
        };
        let d = decider(&response, &peer);
        assert!(Arc::ptr_eq(&d.node_id, &peer));
        assert_eq!(d.generation, 7);
        let other = decider(
            &ForwardResponse {
                node_id: "usurper".into(),
                ..response
            },
            &peer,
        );
        assert_eq!(&*other.node_id, "usurper");

        let sent: Arc<str> = "default".into();
        let compact = ForwardOutcome {
            allowed: true,
            remaining: 4,
            same_rule: true,
            algorithm_index: AlgorithmKind::ALL[0].index() as u32 + 1,
            ..Default::default()
        };
        let r = remote(compact, &d, sent.clone());
        assert!(Arc::ptr_eq(&r.rule, &sent));
        assert_eq!(r.algorithm, Some(AlgorithmKind::ALL[0]));
        assert_eq!((r.decision.allowed, r.decision.remaining), (true, 4));

        let named = ForwardOutcome {
            rule: "other".into(),
            algorithm: "token_bucket".into(),
            ..Default::default()
        };
        let r = remote(named, &d, sent);
        assert_eq!(&*r.rule, "other");
        assert_eq!(r.algorithm, AlgorithmKind::parse("token_bucket"));
    }
}
