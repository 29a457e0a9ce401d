//! `ringlimit.peer.v1.ForwardItem`, hand-written so a forwarded check's strings are
//! [`Text`]: the entry node writes the key and route straight from the check's own
//! string (a slice of it, no copy), and the owner reads them as slices of the body it
//! received (its codec decodes forward calls from the body's `Bytes`: see
//! `server::codec`). `build.rs` maps the proto message onto this type, so every
//! generated message holding one (`ForwardRequest`, `PeerLeaseRequest`) holds this.
//!
//! Field for field what prost-derive generates for the proto, strings aside: the same
//! bytes written, the same accepted and refused, with the same error text (proptests in
//! `server::decode_fuzz` hold it to a prost-derived copy of the message).

use bytes::{Buf, BufMut};
use prost::encoding::{self, DecodeContext, WireType};
use prost::DecodeError;

use crate::proto::peer::NamedRule;
use crate::text::{
    encode_optional_text, encode_text, field_error, merge_text, optional_text_len, text_len, Text,
};

/// One forwarded check: see `proto/peer.proto` for what each field means.
#[derive(Clone, PartialEq, Eq, Hash, Default, Debug)]
pub struct ForwardItem {
    /// The client key (or, with `named`, the counter key).
    pub key: Text,
    /// The route as sent.
    pub route: Text,
    /// The tier the caller sent.
    pub tier: Option<Text>,
    /// Units to consume.
    pub cost: u64,
    /// Hops taken, this one included (always 1).
    pub hops: u32,
    /// The rule by name, for an Envoy descriptor or an inline rule.
    pub named: Option<NamedRule>,
    /// Units to give back just before deciding (0: none).
    pub give_back: u64,
    /// On a denial, take what the counter still holds.
    pub drain: bool,
    /// Report, change nothing.
    pub peek: bool,
    /// xxh3-64 of the name of the rule the sender matched.
    pub rule_hash: u64,
    /// Decide on the receiver's replica (a fail-over decision).
    pub failover: bool,
    /// With `failover`: the owner may have charged it already.
    pub failover_in_doubt: bool,
}

const NAME: &str = "ForwardItem";

/// prost's error for `field` of this message.
fn at(field: &'static str) -> impl Fn(DecodeError) -> DecodeError {
    field_error(NAME, field)
}

impl prost::Message for ForwardItem {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        encode_text(1, &self.key, buf);
        encode_text(2, &self.route, buf);
        encode_optional_text(3, self.tier.as_ref(), buf);
        if self.cost != 0 {
            encoding::uint64::encode(4, &self.cost, buf);
        }
        if self.hops != 0 {
            encoding::uint32::encode(5, &self.hops, buf);
        }
        if let Some(named) = &self.named {
            encoding::message::encode(6, named, buf);
        }
        if self.give_back != 0 {
            encoding::uint64::encode(7, &self.give_back, buf);
        }
        for (tag, flag) in [(8, self.drain), (9, self.peek)] {
            if flag {
                encoding::bool::encode(tag, &flag, buf);
            }
        }
        if self.rule_hash != 0 {
            encoding::fixed64::encode(10, &self.rule_hash, buf);
        }
        for (tag, flag) in [(11, self.failover), (12, self.failover_in_doubt)] {
            if flag {
                encoding::bool::encode(tag, &flag, buf);
            }
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
            1 => merge_text(&mut self.key, wire_type, buf, ctx, (NAME, "key")),
            2 => merge_text(&mut self.route, wire_type, buf, ctx, (NAME, "route")),
            3 => merge_text(
                self.tier.get_or_insert_with(Text::default),
                wire_type,
                buf,
                ctx,
                (NAME, "tier"),
            ),
            4 => encoding::uint64::merge(wire_type, &mut self.cost, buf, ctx).map_err(at("cost")),
            5 => encoding::uint32::merge(wire_type, &mut self.hops, buf, ctx).map_err(at("hops")),
            6 => encoding::message::merge(
                wire_type,
                self.named.get_or_insert_with(NamedRule::default),
                buf,
                ctx,
            )
            .map_err(at("named")),
            7 => encoding::uint64::merge(wire_type, &mut self.give_back, buf, ctx)
                .map_err(at("give_back")),
            8 => encoding::bool::merge(wire_type, &mut self.drain, buf, ctx).map_err(at("drain")),
            9 => encoding::bool::merge(wire_type, &mut self.peek, buf, ctx).map_err(at("peek")),
            10 => encoding::fixed64::merge(wire_type, &mut self.rule_hash, buf, ctx)
                .map_err(at("rule_hash")),
            11 => encoding::bool::merge(wire_type, &mut self.failover, buf, ctx)
                .map_err(at("failover")),
            12 => encoding::bool::merge(wire_type, &mut self.failover_in_doubt, buf, ctx)
                .map_err(at("failover_in_doubt")),
            _ => encoding::skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let flag = |tag, on: bool| {
            if on {
                encoding::bool::encoded_len(tag, &on)
            } else {
                0
            }
        };
        let uint = |tag, n: u64| {
            if n != 0 {
                encoding::uint64::encoded_len(tag, &n)
            } else {
                0
            }
        };
        text_len(1, &self.key)
            + text_len(2, &self.route)
            + optional_text_len(3, self.tier.as_ref())
            + uint(4, self.cost)
            + uint(5, u64::from(self.hops))
            + self
                .named
                .as_ref()
                .map_or(0, |n| encoding::message::encoded_len(6, n))
            + uint(7, self.give_back)
            + flag(8, self.drain)
            + flag(9, self.peek)
            + if self.rule_hash != 0 {
                encoding::fixed64::encoded_len(10, &self.rule_hash)
            } else {
                0
            }
            + flag(11, self.failover)
            + flag(12, self.failover_in_doubt)
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

impl prost::Name for ForwardItem {
    const NAME: &'static str = NAME;
    const PACKAGE: &'static str = "ringlimit.peer.v1";
}
