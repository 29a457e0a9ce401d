//! [`Text`]: a protobuf `string` field held as a slice of the bytes it arrived in (or of
//! the string it was sent from) instead of a `String` of its own, and the prost helpers
//! that merge and write one. The public `ringlimit.v1` requests decode their strings as
//! `Text` (`server::ringlimit_v1`), and so does a forwarded check on both sides of the
//! peer link (`cluster::link::wire`): a check's key and route cost no copy per hop.

use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes};
use prost::encoding::{self, DecodeContext, WireType};
use prost::DecodeError;

/// A string field kept as a slice of shared bytes rather than copied into a `String`:
/// decoding one costs no allocation. Always UTF-8: a decoded `Text` is checked when it is
/// merged (as prost checks a `string`), and one built from a `str` is one.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Text(Bytes);

/// An `Arc<str>` as the owner of a [`Bytes`], so a [`Text`] can share its allocation.
struct SharedStr(Arc<str>);

impl AsRef<[u8]> for SharedStr {
    fn as_ref(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl Text {
    /// The text.
    pub fn as_str(&self) -> &str {
        // Every `Text` holds UTF-8 (see the type's doc): this never falls back.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }

    /// No text (an unset field).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// A static string: no allocation, no copy.
    pub fn from_static(text: &'static str) -> Self {
        Self(Bytes::from_static(text.as_bytes()))
    }

    /// `text`, sharing its allocation: one small allocation for the shared owner, then
    /// every [`split_at`](Self::split_at) of it is free.
    pub fn shared(text: Arc<str>) -> Self {
        Self(Bytes::from_owner(SharedStr(text)))
    }

    /// The text before `mid` and the text from it, both sharing this one's bytes.
    ///
    /// # Panics
    /// If `mid` is not on a character boundary (a `Text` is always UTF-8).
    pub fn split_at(&self, mid: usize) -> (Self, Self) {
        assert!(
            self.as_str().is_char_boundary(mid),
            "split inside a character"
        );
        (Self(self.0.slice(..mid)), Self(self.0.slice(mid..)))
    }
}

impl std::fmt::Debug for Text {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_str().fmt(f)
    }
}

impl From<String> for Text {
    fn from(text: String) -> Self {
        Self(Bytes::from(text))
    }
}

impl PartialEq<&str> for Text {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl From<&str> for Text {
    fn from(text: &str) -> Self {
        Self(Bytes::copy_from_slice(text.as_bytes()))
    }
}

/// Merge one `string` field into `text`; `at` (message, field) names it in an error.
/// `bytes::merge` takes a slice of `buf` when it is a `Bytes` (tonic's decode buffer
/// handed over by a slicing decoder), a copy otherwise; then the bytes are checked to be
/// UTF-8, with prost's own error for a `string` that is not.
pub(crate) fn merge_text(
    text: &mut Text,
    wire_type: WireType,
    buf: &mut impl Buf,
    ctx: DecodeContext,
    at: (&'static str, &'static str),
) -> Result<(), DecodeError> {
    let named = field_error(at.0, at.1);
    encoding::bytes::merge(wire_type, &mut text.0, buf, ctx).map_err(&named)?;
    if std::str::from_utf8(&text.0).is_err() {
        return Err(named(not_utf8(&text.0)));
    }
    Ok(())
}

/// prost's error for `field` of `message`, named as prost-derive names it (the
/// hand-written messages' decoders push the same path as generated code).
pub(crate) fn field_error(
    message: &'static str,
    field: &'static str,
) -> impl Fn(DecodeError) -> DecodeError {
    move |mut error| {
        error.push(message, field);
        error
    }
}

/// prost's own error for a `string` field holding `bytes`, so a refusal reads the same as
/// it does when prost decodes the message.
#[cold]
fn not_utf8(bytes: &[u8]) -> DecodeError {
    let mut framed = Vec::with_capacity(bytes.len() + 10);
    encoding::encode_varint(bytes.len() as u64, &mut framed);
    framed.extend_from_slice(bytes);
    match encoding::string::merge(
        WireType::LengthDelimited,
        &mut String::new(),
        &mut &framed[..],
        DecodeContext::default(),
    ) {
        Err(error) => error,
        Ok(()) => unreachable!("bytes that are not UTF-8 decode as a string"),
    }
}

/// The encoded length of a proto3 `string` field (nothing when empty).
pub(crate) fn text_len(tag: u32, text: &Text) -> usize {
    if text.is_empty() {
        0
    } else {
        encoding::bytes::encoded_len(tag, &text.0)
    }
}

/// Write a proto3 `string` field (nothing when empty).
pub(crate) fn encode_text(tag: u32, text: &Text, buf: &mut impl BufMut) {
    if !text.is_empty() {
        encoding::bytes::encode(tag, &text.0, buf);
    }
}

/// The encoded length of an `optional string` field (written even when empty).
pub(crate) fn optional_text_len(tag: u32, text: Option<&Text>) -> usize {
    text.map_or(0, |t| encoding::bytes::encoded_len(tag, &t.0))
}

/// Write an `optional string` field (written even when empty).
pub(crate) fn encode_optional_text(tag: u32, text: Option<&Text>, buf: &mut impl BufMut) {
    if let Some(t) = text {
        encoding::bytes::encode(tag, &t.0, buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_text_splits_without_copying_and_stays_text() {
        let joined: Arc<str> = Arc::from("clé/GET /x");
        let whole = Text::shared(joined.clone());
        let (key, route) = whole.split_at("clé".len());
        assert_eq!((key.as_str(), route.as_str()), ("clé", "/GET /x"));
        assert_eq!(key.0.as_ptr(), joined.as_ptr(), "a slice of the same bytes");
    }

    #[test]
    #[should_panic(expected = "split inside a character")]
    fn a_split_inside_a_character_is_refused() {
        let _ = Text::shared(Arc::from("é")).split_at(1);
    }
}
