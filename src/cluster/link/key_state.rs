//! `ringlimit.peer.v1.KeyState`, hand-written so a replicated or handed-over counter
//! costs no allocation per field on either side: the sender names the algorithm with a
//! static string and writes at most 4 words from inline storage
//! ([`Words`]), and the receiver reads the name as a slice of the body (its codec
//! decodes `InstallRequest`s from the body's `Bytes`: see `server::codec`) and the words
//! into the same inline storage. A replication round sends every key changed in the
//! last 50 ms, so with prost's `String` and `Vec<u64>` these were 4 allocations per key
//! and round. `build.rs` maps the proto message onto this type.
//!
//! Field for field what prost-derive generates for the proto: the same bytes written,
//! the same accepted and refused, with the same error text (proptests in
//! `server::decode_fuzz` hold it to a prost-derived copy of the message).

use bytes::{Buf, BufMut};
use prost::encoding::{self, DecodeContext, WireType};
use prost::DecodeError;

use crate::algorithms::Words;
use crate::proto::peer::InlineRule;
use crate::text::{encode_text, field_error, merge_text, text_len, Text};

/// One counter's state as it travels: see `proto/peer.proto` for each field.
#[derive(Clone, PartialEq, Eq, Hash, Default, Debug)]
pub struct KeyState {
    /// The fingerprint of the rule the counter counts under.
    pub fingerprint: u64,
    /// The algorithm's name.
    pub algorithm: Text,
    /// The state as words (`algorithms::KeyState::to_words`).
    pub words: Words,
    /// Where the key sits on the ring.
    pub placement: u64,
    /// The rest of the key's identity.
    pub id: u64,
    /// A rule the request carried: its numbers.
    pub inline: Option<InlineRule>,
}

const NAME: &str = "KeyState";

/// prost's error for `field` of this message.
fn at(field: &'static str) -> impl Fn(DecodeError) -> DecodeError {
    field_error(NAME, field)
}

/// One `repeated uint64` field's occurrence, packed or not, into `words`: what prost's
/// `uint64::merge_repeated` does for a `Vec<u64>`, with the same errors.
fn merge_words(
    wire_type: WireType,
    words: &mut Words,
    buf: &mut impl Buf,
    ctx: DecodeContext,
) -> Result<(), DecodeError> {
    let one = |words: &mut Words, buf: &mut _, ctx| {
        let mut word = 0;
        encoding::uint64::merge(WireType::Varint, &mut word, buf, ctx)?;
        words.push(word);
        Ok(())
    };
    if wire_type == WireType::LengthDelimited {
        encoding::merge_loop(words, buf, ctx, one)
    } else {
        encoding::check_wire_type(WireType::Varint, wire_type)?;
        one(words, buf, ctx)
    }
}

impl prost::Message for KeyState {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if self.fingerprint != 0 {
            encoding::uint64::encode(2, &self.fingerprint, buf);
        }
        encode_text(3, &self.algorithm, buf);
        encoding::uint64::encode_packed(4, &self.words, buf);
        if self.placement != 0 {
            encoding::fixed64::encode(5, &self.placement, buf);
        }
        if self.id != 0 {
            encoding::fixed64::encode(6, &self.id, buf);
        }
        if let Some(inline) = &self.inline {
            encoding::message::encode(7, inline, buf);
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
            2 => encoding::uint64::merge(wire_type, &mut self.fingerprint, buf, ctx)
                .map_err(at("fingerprint")),
            3 => merge_text(
                &mut self.algorithm,
                wire_type,
                buf,
                ctx,
                (NAME, "algorithm"),
            ),
            4 => merge_words(wire_type, &mut self.words, buf, ctx).map_err(at("words")),
            5 => encoding::fixed64::merge(wire_type, &mut self.placement, buf, ctx)
                .map_err(at("placement")),
            6 => encoding::fixed64::merge(wire_type, &mut self.id, buf, ctx).map_err(at("id")),
            7 => encoding::message::merge(
                wire_type,
                self.inline.get_or_insert_with(InlineRule::default),
                buf,
                ctx,
            )
            .map_err(at("inline")),
            _ => encoding::skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let fixed = |tag, n: u64| {
            if n != 0 {
                encoding::fixed64::encoded_len(tag, &n)
            } else {
                0
            }
        };
        (if self.fingerprint != 0 {
            encoding::uint64::encoded_len(2, &self.fingerprint)
        } else {
            0
        }) + text_len(3, &self.algorithm)
            + encoding::uint64::encoded_len_packed(4, &self.words)
            + fixed(5, self.placement)
            + fixed(6, self.id)
            + self
                .inline
                .as_ref()
                .map_or(0, |i| encoding::message::encoded_len(7, i))
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

impl prost::Name for KeyState {
    const NAME: &'static str = NAME;
    const PACKAGE: &'static str = "ringlimit.peer.v1";
}
