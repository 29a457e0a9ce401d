//! The `ringlimit.v1` wire codec, hand-written for the hot path: requests decoded with
//! their strings as slices of the received body ([`Text`]), and answers written straight
//! from the verdicts they carry ([`CheckAnswer`], [`BatchAnswer`]), so a check costs no
//! per-field copy either way. Both are exactly prost's for the same messages: the
//! decoder accepts and refuses what prost's `proto::CheckRequest` does, with the same
//! error text (a proptest in `decode_fuzz` holds it to that), and the encoder writes
//! prost's bytes (the proptests below compare them). The adapter that maps these onto
//! the check layer is [`super::ringlimit_v1`].

use crate::check::Verdict;
use crate::cluster::DescriptorOutcome;
use wire::{Message as _, Sink as _};

pub use crate::text::Text;

/// `ringlimit.v1.CheckRequest` as the server decodes it: the same fields, strings as
/// [`Text`]. Decoding accepts and refuses exactly what prost's `proto::CheckRequest`
/// does, with the same error text (a proptest in `decode_fuzz` holds it to that).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct V1Request {
    /// Who is limited.
    pub key: Text,
    /// What is called.
    pub route: Text,
    /// Units this request consumes.
    pub cost: Option<i64>,
    /// Tier used for rule matching.
    pub tier: Option<Text>,
    /// Further descriptors.
    pub descriptors: Vec<V1Descriptor>,
}

/// `ringlimit.v1.Descriptor` as the server decodes it (see [`V1Request`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct V1Descriptor {
    /// Who is limited.
    pub key: Text,
    /// What is called; empty inherits the request's.
    pub route: Text,
    /// Tier; unset inherits the request's.
    pub tier: Option<Text>,
    /// Units; unset inherits the request's.
    pub cost: Option<i64>,
}

/// `ringlimit.v1.CheckBatchRequest` as the server decodes it (see [`V1Request`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct V1BatchRequest {
    /// The checks, in order.
    pub checks: Vec<V1Request>,
}

/// Hand-written prost messages for the request types above, field for field what
/// prost-derive generates for the proto, except that a string is merged as
/// [`Text`]: `bytes::merge` takes a slice of the body (tonic's decode buffer), then the
/// bytes are checked to be UTF-8.
mod request {
    use bytes::{Buf, BufMut};
    use prost::encoding::{self, DecodeContext, WireType};
    use prost::DecodeError;

    use super::{Text, V1BatchRequest, V1Descriptor, V1Request};
    use crate::text::{
        encode_optional_text, encode_text, field_error, merge_text, optional_text_len, text_len,
    };

    fn merge_int(
        value: &mut Option<i64>,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
        at: (&'static str, &'static str),
    ) -> Result<(), DecodeError> {
        encoding::int64::merge(wire_type, value.get_or_insert(0), buf, ctx)
            .map_err(field_error(at.0, at.1))
    }

    impl prost::Message for V1Descriptor {
        fn encode_raw(&self, buf: &mut impl BufMut) {
            encode_text(1, &self.key, buf);
            encode_text(2, &self.route, buf);
            encode_optional_text(3, self.tier.as_ref(), buf);
            if let Some(cost) = &self.cost {
                encoding::int64::encode(4, cost, buf);
            }
        }

        fn merge_field(
            &mut self,
            tag: u32,
            wire_type: WireType,
            buf: &mut impl Buf,
            ctx: DecodeContext,
        ) -> Result<(), DecodeError> {
            const NAME: &str = "Descriptor";
            match tag {
                1 => merge_text(&mut self.key, wire_type, buf, ctx, (NAME, "key")),
                2 => merge_text(&mut self.route, wire_type, buf, ctx, (NAME, "route")),
                3 => merge_text(
                    self.tier.get_or_insert_with(Text::default),
                    wire_type,
                    buf,
                    ctx,
                    (NAME, "tier"),
                ),
                4 => merge_int(&mut self.cost, wire_type, buf, ctx, (NAME, "cost")),
                _ => encoding::skip_field(wire_type, tag, buf, ctx),
            }
        }

        fn encoded_len(&self) -> usize {
            text_len(1, &self.key)
                + text_len(2, &self.route)
                + optional_text_len(3, self.tier.as_ref())
                + self
                    .cost
                    .as_ref()
                    .map_or(0, |c| encoding::int64::encoded_len(4, c))
        }

        fn clear(&mut self) {
            *self = Self::default();
        }
    }

    impl prost::Message for V1Request {
        fn encode_raw(&self, buf: &mut impl BufMut) {
            encode_text(1, &self.key, buf);
            encode_text(2, &self.route, buf);
            if let Some(cost) = &self.cost {
                encoding::int64::encode(3, cost, buf);
            }
            encode_optional_text(4, self.tier.as_ref(), buf);
            for d in &self.descriptors {
                encoding::message::encode(5, d, buf);
            }
        }

        fn merge_field(
            &mut self,
            tag: u32,
            wire_type: WireType,
            buf: &mut impl Buf,
            ctx: DecodeContext,
        ) -> Result<(), DecodeError> {
            const NAME: &str = "CheckRequest";
            match tag {
                1 => merge_text(&mut self.key, wire_type, buf, ctx, (NAME, "key")),
                2 => merge_text(&mut self.route, wire_type, buf, ctx, (NAME, "route")),
                3 => merge_int(&mut self.cost, wire_type, buf, ctx, (NAME, "cost")),
                4 => merge_text(
                    self.tier.get_or_insert_with(Text::default),
                    wire_type,
                    buf,
                    ctx,
                    (NAME, "tier"),
                ),
                5 => encoding::message::merge_repeated(wire_type, &mut self.descriptors, buf, ctx)
                    .map_err(field_error(NAME, "descriptors")),
                _ => encoding::skip_field(wire_type, tag, buf, ctx),
            }
        }

        fn encoded_len(&self) -> usize {
            text_len(1, &self.key)
                + text_len(2, &self.route)
                + self
                    .cost
                    .as_ref()
                    .map_or(0, |c| encoding::int64::encoded_len(3, c))
                + optional_text_len(4, self.tier.as_ref())
                + encoding::message::encoded_len_repeated(5, &self.descriptors)
        }

        fn clear(&mut self) {
            *self = Self::default();
        }
    }

    impl prost::Message for V1BatchRequest {
        fn encode_raw(&self, buf: &mut impl BufMut) {
            for check in &self.checks {
                encoding::message::encode(1, check, buf);
            }
        }

        fn merge_field(
            &mut self,
            tag: u32,
            wire_type: WireType,
            buf: &mut impl Buf,
            ctx: DecodeContext,
        ) -> Result<(), DecodeError> {
            match tag {
                1 => encoding::message::merge_repeated(wire_type, &mut self.checks, buf, ctx)
                    .map_err(field_error("CheckBatchRequest", "checks")),
                _ => encoding::skip_field(wire_type, tag, buf, ctx),
            }
        }

        fn encoded_len(&self) -> usize {
            encoding::message::encoded_len_repeated(1, &self.checks)
        }

        fn clear(&mut self) {
            *self = Self::default();
        }
    }

    impl prost::Name for V1Descriptor {
        const NAME: &'static str = "Descriptor";
        const PACKAGE: &'static str = "ringlimit.v1";
    }

    impl prost::Name for V1Request {
        const NAME: &'static str = "CheckRequest";
        const PACKAGE: &'static str = "ringlimit.v1";
    }

    impl prost::Name for V1BatchRequest {
        const NAME: &'static str = "CheckBatchRequest";
        const PACKAGE: &'static str = "ringlimit.v1";
    }
}

/// The answer to one `Check`: its verdict, written as a `CheckResponse`.
#[derive(Debug)]
pub struct CheckAnswer {
    pub(super) verdict: Verdict,
}

impl CheckAnswer {
    /// The verdict this answer carries.
    pub fn verdict(&self) -> &Verdict {
        &self.verdict
    }
}

/// The answer to one `CheckBatch`: one verdict per check, in request order, written as
/// a `CheckBatchResponse`.
#[derive(Debug)]
pub struct BatchAnswer {
    pub(super) verdicts: Vec<Verdict>,
}

impl BatchAnswer {
    /// The verdicts this answer carries.
    pub fn verdicts(&self) -> &[Verdict] {
        &self.verdicts
    }
}

impl super::codec::WireAnswer for CheckAnswer {
    fn encode_to(&self, buf: &mut impl bytes::BufMut) {
        WireResponse(&self.verdict).fields(&mut wire::Writer(buf));
    }
}

impl super::codec::WireAnswer for BatchAnswer {
    fn encode_to(&self, buf: &mut impl bytes::BufMut) {
        let mut writer = wire::Writer(buf);
        for verdict in &self.verdicts {
            writer.message(1, &WireResponse(verdict));
        }
    }
}

/// The answer to one `Reserve`: its check's verdict and, when allowed, the reservation,
/// written as a `ReserveResponse` (the check as its `CheckResponse`, encoded like
/// `Check`'s answer).
#[derive(Debug)]
pub struct ReserveAnswer {
    pub(super) reserved: crate::check::reserve::ReserveVerdict,
}

impl ReserveAnswer {
    /// The reservation's verdict.
    pub fn reserved(&self) -> &crate::check::reserve::ReserveVerdict {
        &self.reserved
    }
}

impl super::codec::WireAnswer for ReserveAnswer {
    fn encode_to(&self, buf: &mut impl bytes::BufMut) {
        use wire::Sink;
        let r = &self.reserved;
        let mut writer = wire::Writer(buf);
        writer.message(1, &WireResponse(&r.verdict));
        writer.text(2, r.reservation_id.as_deref().unwrap_or(""));
        writer.int(3, reset_at(r.expires_at));
    }
}

/// A `reset_at` on the wire is an `int64`; a later time than it can say is clamped.
fn reset_at(ms: u64) -> i64 {
    ms.min(i64::MAX as u64) as i64
}

/// `ringlimit.v1.Decider`.
struct WireDecider<'a>(&'a crate::cluster::Decider);

impl wire::Message for WireDecider<'_> {
    fn fields<S: wire::Sink>(&self, s: &mut S) {
        s.text(1, &self.0.node_id);
        s.uint(2, self.0.generation);
    }
}

/// `ringlimit.v1.DescriptorResult`: the key and route are the planned item's, which
/// hold the text exactly as the request sent it (an inherited route included).
struct WireDescriptor<'a>(&'a DescriptorOutcome);

impl wire::Message for WireDescriptor<'_> {
    fn fields<S: wire::Sink>(&self, s: &mut S) {
        let d = self.0;
        let (a, decision) = (&d.answer, &d.answer.decision);
        s.text(1, d.item.client());
        s.text(2, d.item.route());
        s.flag(3, decision.allowed);
        s.uint(4, decision.limit);
        s.uint(5, decision.remaining);
        s.uint(6, decision.retry_after_ms);
        s.int(7, reset_at(decision.reset_at_ms));
        s.text(8, &a.rule);
        s.text(9, a.algorithm.as_str());
        s.optional(10, decision.window_id);
        s.uint(11, a.sequence);
        s.message(12, &WireDecider(&a.decider));
        s.flag(13, a.degraded);
        s.uint(14, decision.delay_ms);
        s.flag(15, d.refunded);
        s.uint(16, u64::from(a.hops));
        s.flag(17, d.shadow_denied());
        s.flag(18, d.leased());
    }
}

/// `ringlimit.v1.CheckResponse`, fields in the order prost writes them: by field number
/// (the proto declares `shadow_denied = 13` before `descriptors = 12`).
struct WireResponse<'a>(&'a Verdict);

impl wire::Message for WireResponse<'_> {
    fn fields<S: wire::Sink>(&self, s: &mut S) {
        let v = self.0;
        s.flag(1, v.allowed);
        s.uint(2, v.limit);
        s.uint(3, v.remaining);
        s.uint(4, v.retry_after_ms);
        s.int(5, reset_at(v.reset_at_ms));
        s.text(6, &v.rule);
        s.message(7, &WireDecider(&v.decider));
        s.optional(8, v.window_id);
        s.uint(9, v.sequence);
        s.flag(10, v.degraded);
        s.uint(11, v.delay_ms);
        for d in &v.descriptors {
            s.message(12, &WireDescriptor(d));
        }
        s.flag(13, v.shadow_denied);
        s.uint(14, v.window_ms);
        s.flag(15, v.leased());
    }
}

/// Protobuf writing for answers that are views of domain types: each message lists its
/// fields once ([`Message::fields`]), against a [`Sink`] that either counts the bytes
/// ([`Length`], for a nested message's length prefix) or writes them ([`Writer`]), so
/// a length and its bytes cannot disagree. Proto3 rules: a scalar or string at its
/// default is not written; an `optional` scalar and a present message always are.
mod wire {
    use bytes::BufMut;
    use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};

    /// A message's fields, written in order to a sink.
    pub(super) trait Message {
        fn fields<S: Sink>(&self, s: &mut S);
    }

    /// Where fields go.
    pub(super) trait Sink: Sized {
        /// A varint field (`uint64`, `uint32`, `bool`, and `int64` as two's complement).
        fn varint(&mut self, tag: u32, value: u64);
        /// A length-delimited field of `len` bytes, `body` writing them.
        fn delimited(&mut self, tag: u32, len: usize, body: impl FnOnce(&mut Self));
        /// Raw bytes inside a length-delimited field.
        fn bytes(&mut self, bytes: &[u8]);

        fn uint(&mut self, tag: u32, value: u64) {
            if value != 0 {
                self.varint(tag, value);
            }
        }
        fn int(&mut self, tag: u32, value: i64) {
            self.uint(tag, value as u64);
        }
        fn flag(&mut self, tag: u32, value: bool) {
            self.uint(tag, u64::from(value));
        }
        fn optional(&mut self, tag: u32, value: Option<u64>) {
            if let Some(value) = value {
                self.varint(tag, value);
            }
        }
        fn text(&mut self, tag: u32, value: &str) {
            if !value.is_empty() {
                self.delimited(tag, value.len(), |s| s.bytes(value.as_bytes()));
            }
        }
        fn message(&mut self, tag: u32, message: &impl Message) {
            let mut length = Length(0);
            message.fields(&mut length);
            self.delimited(tag, length.0, |s| message.fields(s));
        }
    }

    /// Counts the bytes a message's fields take.
    pub(super) struct Length(pub usize);

    impl Sink for Length {
        fn varint(&mut self, tag: u32, value: u64) {
            self.0 += key_len(tag) + encoded_len_varint(value);
        }
        fn delimited(&mut self, tag: u32, len: usize, _body: impl FnOnce(&mut Self)) {
            self.0 += key_len(tag) + encoded_len_varint(len as u64) + len;
        }
        fn bytes(&mut self, bytes: &[u8]) {
            self.0 += bytes.len();
        }
    }

    /// Writes a message's fields.
    pub(super) struct Writer<B>(pub B);

    impl<B: BufMut> Sink for Writer<B> {
        fn varint(&mut self, tag: u32, value: u64) {
            encode_key(tag, WireType::Varint, &mut self.0);
            encode_varint(value, &mut self.0);
        }
        fn delimited(&mut self, tag: u32, len: usize, body: impl FnOnce(&mut Self)) {
            encode_key(tag, WireType::LengthDelimited, &mut self.0);
            encode_varint(len as u64, &mut self.0);
            body(self);
        }
        fn bytes(&mut self, bytes: &[u8]) {
            self.0.put_slice(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU64;
    use std::sync::Arc;

    use proptest::prelude::*;
    use prost::Message as _;

    use super::*;
    use crate::algorithms::{AlgorithmKind, Decision};
    use crate::check::plan::MAX_DESCRIPTORS;
    use crate::cluster::{Answer, Charged, CheckItem};
    use crate::config::route::Route;
    use crate::config::rules::RuleSet;
    use crate::proto;
    use crate::server::codec::WireAnswer;

    /// The answer as prost would write it, built field by field from the verdict: the
    /// reference the encoder is held to.
    fn reference(verdict: &Verdict) -> proto::CheckResponse {
        let wire_decider = |d: &crate::cluster::Decider| proto::Decider {
            node_id: d.node_id.to_string(),
            generation: d.generation,
        };
        proto::CheckResponse {
            allowed: verdict.allowed,
            limit: verdict.limit,
            remaining: verdict.remaining,
            retry_after_ms: verdict.retry_after_ms,
            reset_at: reset_at(verdict.reset_at_ms),
            rule: verdict.rule.to_string(),
            decider: Some(wire_decider(&verdict.decider)),
            window_id: verdict.window_id,
            sequence: verdict.sequence,
            degraded: verdict.degraded,
            delay_ms: verdict.delay_ms,
            window_ms: verdict.window_ms,
            shadow_denied: verdict.shadow_denied,
            leased: verdict.leased(),
            descriptors: verdict
                .descriptors
                .iter()
                .map(|d| {
                    let (a, decision) = (&d.answer, &d.answer.decision);
                    proto::DescriptorResult {
                        key: d.item.client().to_string(),
                        route: d.item.route().to_string(),
                        allowed: decision.allowed,
                        limit: decision.limit,
                        remaining: decision.remaining,
                        retry_after_ms: decision.retry_after_ms,
                        reset_at: reset_at(decision.reset_at_ms),
                        rule: a.rule.to_string(),
                        algorithm: a.algorithm.as_str().to_string(),
                        window_id: decision.window_id,
                        sequence: a.sequence,
                        decider: Some(wire_decider(&a.decider)),
                        degraded: a.degraded,
                        delay_ms: decision.delay_ms,
                        refunded: d.refunded,
                        hops: a.hops,
                        shadow_denied: d.shadow_denied(),
                        leased: d.leased(),
                    }
                })
                .collect(),
        }
    }

    fn encoded(answer: &impl WireAnswer) -> Vec<u8> {
        let mut buf = Vec::new();
        answer.encode_to(&mut buf);
        buf
    }

    /// Zero (not written on the wire) as often as anything else.
    fn number() -> impl Strategy<Value = u64> {
        prop_oneof![Just(0), 1..300u64, Just(u64::MAX), any::<u64>()]
    }

    fn decider() -> impl Strategy<Value = crate::cluster::Decider> {
        ("[a-z0-9-]{0,12}", number()).prop_map(|(id, generation)| crate::cluster::Decider {
            node_id: Arc::from(id.as_str()),
            generation,
        })
    }

    fn decision() -> impl Strategy<Value = Decision> {
        (
            any::<bool>(),
            (number(), number(), number(), number()),
            proptest::option::of(number()),
            number(),
        )
            .prop_map(
                |(
                    allowed,
                    (limit, remaining, retry_after_ms, reset_at_ms),
                    window_id,
                    delay_ms,
                )| {
                    Decision {
                        allowed,
                        limit,
                        remaining,
                        retry_after_ms,
                        reset_at_ms,
                        window_id,
                        delay_ms,
                    }
                },
            )
    }

    prop_compose! {
        fn outcome()(
            key in "[a-zA-Z0-9:_é☃]{1,24}",
            route in prop::sample::select(vec!["/x", "GET /a/b?q=1#f", "POST /v1/charges", "/%C3%BC"]),
            shadow in any::<bool>(),
            decision in decision(),
            (sequence, hops) in (number(), any::<u32>()),
            decider in decider(),
            rule in "[a-z_.]{0,16}",
            algorithm in prop::sample::select(AlgorithmKind::ALL.to_vec()),
            (degraded, refunded) in (any::<bool>(), any::<bool>()),
        ) -> DescriptorOutcome {
            let mut matched = (**RuleSet::builtin().default_rule()).clone();
            matched.shadow = shadow;
            DescriptorOutcome {
                item: CheckItem::new(
                    Arc::new(matched),
                    &key,
                    Route::parse(route).unwrap(),
                    None,
                    NonZeroU64::MIN,
                ),
                answer: Answer {
                    decision,
                    sequence,
                    at: 0,
                    decider,
                    degraded,
                    hops,
                    rule: Arc::from(rule.as_str()),
                    algorithm,
                    charged: Charged::Nothing,
                },
                refunded,
            }
        }
    }

    prop_compose! {
        fn verdict()(
            descriptors in prop::collection::vec(outcome(), 1..=MAX_DESCRIPTORS),
            top in decision(),
            (sequence, window_ms) in (number(), number()),
            decider in decider(),
            rule in "[a-z_]{0,16}",
            (degraded, shadow_denied) in (any::<bool>(), any::<bool>()),
        ) -> Verdict {
            Verdict {
                allowed: top.allowed,
                limit: top.limit,
                remaining: top.remaining,
                retry_after_ms: top.retry_after_ms,
                reset_at_ms: top.reset_at_ms,
                rule: Arc::from(rule.as_str()),
                decider,
                window_id: top.window_id,
                sequence,
                degraded,
                delay_ms: top.delay_ms,
                window_ms,
                shadow_denied,
                descriptors: descriptors.into(),
            }
        }
    }

    proptest! {
        /// Clients see exactly the bytes prost would have written for the same answer.
        #[test]
        fn a_check_answer_is_encoded_byte_for_byte_as_prost_would(verdict in verdict()) {
            let expected = reference(&verdict).encode_to_vec();
            prop_assert_eq!(encoded(&CheckAnswer { verdict }), expected);
        }

        #[test]
        fn a_batch_answer_is_encoded_byte_for_byte_as_prost_would(
            verdicts in prop::collection::vec(verdict(), 0..4),
        ) {
            let expected = proto::CheckBatchResponse {
                results: verdicts.iter().map(reference).collect(),
            }
            .encode_to_vec();
            prop_assert_eq!(encoded(&BatchAnswer { verdicts }), expected);
        }
    }
}
