//! The protobuf codec of every generated `ringlimit` service (wired in by `build.rs`
//! through `codec_path`).
//!
//! tonic-prost answers a request body that fails to decode (truncated, invalid UTF-8 in
//! a string, a wrong wire type) with `INTERNAL`, which a gateway may read as "limiter
//! down" and fail open on. A malformed body is the caller's fault: this codec answers
//! `INVALID_ARGUMENT` starting with the path of the field that failed, indices
//! included, like every other refusal: `checks[3].descriptors[1].key: invalid protobuf:
//! invalid string value: data is not UTF-8 encoded` (the message's name when no field
//! can be named). Encoding is tonic-prost's own.
//!
//! prost names the fields of a decode error but not the index of a repeated one, so the
//! indices are found again on the error path only ([`field_path`]): each field of the
//! failing message is decoded alone, wrapped in its parents, and the first that fails is
//! the one (its index counted among the fields of its number).
//!
//! The size limit is not checked here: tonic checks the length prefix before a codec
//! sees any byte (see `node::grpc` for how its answer is mapped).
//!
//! The generated clients share the codec, so a client that cannot decode an answer
//! reports `INVALID_ARGUMENT` too (the peer client treats every error alike).
//!
//! [`AnswerCodec`] is the public `ringlimit.v1` server's (`proto::v1_server`): requests
//! decode as above, answers are [`WireAnswer`]s that write their own encoding, so a
//! check's answer is encoded from the verdict it was decided as, without first being
//! copied field by field into a prost message.

use std::marker::PhantomData;

use bytes::Buf;
use prost::encoding::{self, DecodeContext, WireType};
use prost::{Message, Name};
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Status;
use tonic_prost::ProstEncoder;

/// tonic-prost's codec with decode errors answered as `INVALID_ARGUMENT`.
#[derive(Debug, Clone)]
pub struct NamedProstCodec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for NamedProstCodec<T, U> {
    fn default() -> Self {
        Self { _pd: PhantomData }
    }
}

impl<T, U> Codec for NamedProstCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Name + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = NamedProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        NamedProstDecoder { _pd: PhantomData }
    }
}

/// Decodes `U`; a malformed body is the sender's error, named after the message.
#[derive(Debug, Clone)]
pub struct NamedProstDecoder<U> {
    _pd: PhantomData<U>,
}

impl<U: Message + Name + Default> Decoder for NamedProstDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        let len = buf.remaining();
        if sliced::<U>() {
            return SlicingDecoder::<U>::default().decode(buf);
        }
        // tonic's decode buffer is contiguous: decoded in place, the body is still there
        // to name the field on an error.
        if buf.chunk().len() == len {
            let body = buf.chunk();
            let decoded = U::decode(body).map_err(|error| invalid::<U>(body, &error));
            buf.advance(len);
            return decoded.map(Some);
        }
        let body = buf.copy_to_bytes(len);
        U::decode(&body[..])
            .map(Some)
            .map_err(|error| invalid::<U>(&body, &error))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

/// Whether `U` holds forwarded checks or counters' states, whose strings are slices of
/// the body they came in ([`ForwardItem`](crate::proto::peer::ForwardItem),
/// [`KeyState`](crate::proto::peer::KeyState)): decoded from the body's `Bytes`
/// ([`SlicingDecoder`]), a check's key and route, or a state's algorithm, cost the
/// receiver no copy. Any other
/// message decodes in place: its strings are copied either way, and slicing the buffer
/// would cost it an allocation.
fn sliced<U: Name>() -> bool {
    U::PACKAGE == "ringlimit.peer.v1"
        && matches!(U::NAME, "ForwardCall" | "ForwardRequest" | "InstallRequest")
}

/// Decodes `U` from a slice of the received body (its `bytes` fields slices of it, not
/// copies: [`crate::text::Text`]); a malformed body as
/// [`NamedProstDecoder`] answers it.
#[derive(Debug, Clone)]
pub struct SlicingDecoder<U> {
    _pd: PhantomData<U>,
}

impl<U> Default for SlicingDecoder<U> {
    fn default() -> Self {
        Self { _pd: PhantomData }
    }
}

impl<U: Message + Name + Default> Decoder for SlicingDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        let body = buf.copy_to_bytes(buf.remaining());
        U::decode(body.clone())
            .map(Some)
            .map_err(|error| invalid::<U>(&body, &error))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

/// The refusal of a body that is not a `U`: the failing field's path first.
#[cold]
fn invalid<U: Message + Name + Default>(body: &[u8], error: &prost::DecodeError) -> Status {
    let (names, description) = stack(error);
    let path = if names.is_empty() {
        U::full_name()
    } else {
        field_path::<U>(body, &names)
    };
    Status::invalid_argument(format!("{path}: invalid protobuf: {description}"))
}

/// prost's (message, field) stack of an error, outermost field first, and its cause.
/// prost shows the stack only in its text (`failed to decode Protobuf message: Inner.f:
/// Outer.g: cause`, innermost first), so it is read back from there.
fn stack(error: &prost::DecodeError) -> (Vec<String>, String) {
    let text = error.to_string();
    let mut rest = text
        .strip_prefix("failed to decode Protobuf message: ")
        .unwrap_or(&text);
    let mut names = Vec::new();
    while let Some((segment, after)) = rest.split_once(": ") {
        let Some((message, field)) = segment.split_once('.') else {
            break;
        };
        let ident =
            |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !ident(message) || !ident(field) {
            break;
        }
        names.push(field.to_string());
        rest = after;
    }
    names.reverse();
    (names, rest.to_string())
}

/// One field of an encoded message.
struct Field<'a> {
    tag: u32,
    /// How many fields of the same number came before it: its index if repeated.
    index: usize,
    /// Its key and value, as encoded.
    raw: &'a [u8],
    /// The content of a length-delimited field (a nested message, a string).
    content: Option<&'a [u8]>,
}

/// The fields of one encoded message, in order, as far as they can be split (a field
/// that cannot be, e.g. truncated, is the last and has no content).
fn fields(body: &[u8]) -> Vec<Field<'_>> {
    let mut out: Vec<Field<'_>> = Vec::new();
    let mut seen: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
    let mut rest = body;
    while !rest.is_empty() {
        let start = rest;
        let Ok((tag, wire_type)) = encoding::decode_key(&mut rest) else {
            break;
        };
        let count = seen.entry(tag).or_default();
        let index = *count;
        *count += 1;
        let value = rest;
        let skipped = encoding::skip_field(wire_type, tag, &mut rest, DecodeContext::default());
        let raw = &start[..start.len() - rest.len()];
        if skipped.is_err() {
            out.push(Field {
                tag,
                index,
                raw: start,
                content: None,
            });
            break;
        }
        let content = (wire_type == WireType::LengthDelimited).then(|| {
            let mut value = value;
            let len = encoding::decode_varint(&mut value).unwrap_or(0) as usize;
            &value[..len.min(value.len())]
        });
        out.push(Field {
            tag,
            index,
            raw,
            content,
        });
    }
    out
}

/// `raw` (fields of the innermost message) wrapped in the messages of `parents` (field
/// numbers, outermost first): a `U` holding only them.
fn wrapped(raw: &[u8], parents: &[u32]) -> Vec<u8> {
    let mut bytes = raw.to_vec();
    for &tag in parents.iter().rev() {
        let mut outer = Vec::with_capacity(bytes.len() + 12);
        encoding::encode_key(tag, WireType::LengthDelimited, &mut outer);
        encoding::encode_varint(bytes.len() as u64, &mut outer);
        outer.extend_from_slice(&bytes);
        bytes = outer;
    }
    bytes
}

/// Whether field `tag` of the message at `parents` is repeated: two empty values stay
/// two (a singular message merges them into one; a singular string drops an empty one).
fn repeated<U: Message + Default>(tag: u32, parents: &[u32]) -> bool {
    let mut one = Vec::new();
    encoding::encode_key(tag, WireType::LengthDelimited, &mut one);
    one.push(0);
    let two = [one.as_slice(), one.as_slice()].concat();
    U::decode(&wrapped(&two, parents)[..])
        .is_ok_and(|m| m.encoded_len() > wrapped(&one, parents).len())
}

/// The path of the field named by `names` (outermost first) that fails to decode in
/// `body`, with the index of every repeated field on the way: `checks[3].key`. A level
/// whose failing field cannot be found is named without an index.
pub fn field_path<U: Message + Default>(body: &[u8], names: &[String]) -> String {
    let mut path = String::new();
    let mut parents: Vec<u32> = Vec::new();
    let mut current = Some(body);
    for name in names {
        if !path.is_empty() {
            path.push('.');
        }
        path.push_str(name);
        let Some(message) = current else {
            continue;
        };
        let failing = fields(message)
            .into_iter()
            .find(|f| U::decode(&wrapped(f.raw, &parents)[..]).is_err());
        current = None;
        if let Some(field) = failing {
            if repeated::<U>(field.tag, &parents) {
                path.push_str(&format!("[{}]", field.index));
            }
            parents.push(field.tag);
            current = field.content;
        }
    }
    path
}

/// An answer that encodes itself as the protobuf message its method returns.
pub trait WireAnswer {
    /// Append the message's encoding (without a length prefix) to `buf`.
    fn encode_to(&self, buf: &mut impl bytes::BufMut);
}

/// A prost message answers as prost encodes it (`Topology`'s answer).
impl WireAnswer for crate::proto::TopologyResponse {
    fn encode_to(&self, buf: &mut impl bytes::BufMut) {
        self.encode_raw(buf);
    }
}

/// A prost message answers as prost encodes it (`Commit`'s answer).
impl WireAnswer for crate::proto::CommitResponse {
    fn encode_to(&self, buf: &mut impl bytes::BufMut) {
        self.encode_raw(buf);
    }
}

/// A prost message answers as prost encodes it (`Release`'s answer).
impl WireAnswer for crate::proto::ReleaseResponse {
    fn encode_to(&self, buf: &mut impl bytes::BufMut) {
        self.encode_raw(buf);
    }
}

/// The codec of `proto::v1_server`: [`SlicingDecoder`] for requests, answers
/// encoded by their [`WireAnswer`] implementation.
#[derive(Debug, Clone)]
pub struct AnswerCodec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for AnswerCodec<T, U> {
    fn default() -> Self {
        Self { _pd: PhantomData }
    }
}

impl<T, U> Codec for AnswerCodec<T, U>
where
    T: WireAnswer + Send + 'static,
    U: Message + Name + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = AnswerEncoder<T>;
    type Decoder = SlicingDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        AnswerEncoder { _pd: PhantomData }
    }

    fn decoder(&mut self) -> Self::Decoder {
        SlicingDecoder { _pd: PhantomData }
    }
}

/// Encodes a [`WireAnswer`].
#[derive(Debug, Clone)]
pub struct AnswerEncoder<T> {
    _pd: PhantomData<T>,
}

impl<T: WireAnswer> Encoder for AnswerEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode_to(buf);
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto;
    use crate::proto::envoy::extensions::common::ratelimit::v3::{
        rate_limit_descriptor::Entry, RateLimitDescriptor,
    };
    use crate::server::ringlimit_v1::{V1BatchRequest, V1Request};

    const NOT_UTF8: &str = "invalid protobuf: invalid string value: data is not UTF-8 encoded";

    /// `message` encoded, its one `@@` made bytes that are not UTF-8.
    fn poisoned(message: &impl Message) -> Vec<u8> {
        let mut bytes = message.encode_to_vec();
        let at = bytes.windows(2).position(|w| w == b"@@").expect("a marker");
        bytes[at..at + 2].copy_from_slice(&[0xff, 0xfe]);
        bytes
    }

    /// The refusal of `body` decoded as a `U`, as the server answers it.
    fn refusal<U: Message + Name + Default + std::fmt::Debug>(body: &[u8]) -> String {
        let error = U::decode(body).expect_err("a malformed body");
        let status = invalid::<U>(body, &error);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        status.message().to_string()
    }

    fn check(key: &str) -> proto::CheckRequest {
        proto::CheckRequest {
            key: key.into(),
            route: "/x".into(),
            ..Default::default()
        }
    }

    fn descriptor(key: &str) -> proto::Descriptor {
        proto::Descriptor {
            key: key.into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_malformed_ringlimit_v1_field_is_named_by_its_path_with_indices() {
        let body = poisoned(&check("@@"));
        assert_eq!(refusal::<V1Request>(&body), format!("key: {NOT_UTF8}"));
        let mut inner = check("k");
        inner.tier = Some("gold".into());
        inner.descriptors = vec![descriptor("a"), descriptor("@@")];
        let body = poisoned(&inner);
        assert_eq!(
            refusal::<V1Request>(&body),
            format!("descriptors[1].key: {NOT_UTF8}")
        );
        let batch = proto::CheckBatchRequest {
            checks: vec![check("a"), check("b"), check("c"), inner],
        };
        let body = poisoned(&batch);
        let expected = format!("checks[3].descriptors[1].key: {NOT_UTF8}");
        assert_eq!(refusal::<V1BatchRequest>(&body), expected);
        assert_eq!(
            refusal::<proto::CheckBatchRequest>(&body),
            expected,
            "prost's decoding of the same message is named the same"
        );
    }

    #[test]
    fn a_truncated_element_or_a_wrong_wire_type_is_named_by_its_element() {
        let batch = proto::CheckBatchRequest {
            checks: vec![check("a"), check("b")],
        };
        let mut body = batch.encode_to_vec();
        body.truncate(body.len() - 1);
        let text = refusal::<V1BatchRequest>(&body);
        assert!(text.starts_with("checks[1]"), "{text}");
        // Field 1 (key) sent as a varint: the key, not the message, is named.
        let text = refusal::<V1Request>(&[0x08, 0x01]);
        assert!(text.starts_with("key: invalid protobuf: "), "{text}");
        // Garbage with no field to name: the message is named instead.
        let text = refusal::<V1Request>(&[0xff]);
        assert!(
            text.starts_with("ringlimit.v1.CheckRequest: invalid protobuf: "),
            "{text}"
        );
    }

    #[test]
    fn malformed_envoy_gubernator_and_peer_fields_are_named_by_their_paths() {
        let entry = |key: &str, value: &str| Entry {
            key: key.into(),
            value: value.into(),
        };
        let envoy = proto::envoy::service::ratelimit::v3::RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![
                RateLimitDescriptor {
                    entries: vec![entry("a", "1")],
                    ..Default::default()
                },
                RateLimitDescriptor {
                    entries: vec![entry("a", "1"), entry("b", "@@")],
                    ..Default::default()
                },
            ],
            hits_addend: 0,
        };
        assert_eq!(
            refusal::<proto::envoy::service::ratelimit::v3::RateLimitRequest>(&poisoned(&envoy)),
            format!("descriptors[1].entries[1].value: {NOT_UTF8}")
        );
        let item = |key: &str| proto::gubernator::RateLimitReq {
            name: "n".into(),
            unique_key: key.into(),
            limit: 1,
            duration: 1000,
            ..Default::default()
        };
        let gubernator = proto::gubernator::GetRateLimitsReq {
            requests: vec![item("a"), item("b"), item("@@")],
        };
        assert_eq!(
            refusal::<proto::gubernator::GetRateLimitsReq>(&poisoned(&gubernator)),
            format!("requests[2].unique_key: {NOT_UTF8}")
        );
        let forwarded = |key: &str| proto::peer::ForwardItem {
            key: key.into(),
            route: "/x".into(),
            cost: 1,
            ..Default::default()
        };
        let peer = proto::peer::ForwardRequest {
            from_node: "a".into(),
            items: vec![forwarded("a"), forwarded("@@")],
            ..Default::default()
        };
        assert_eq!(
            refusal::<proto::peer::ForwardRequest>(&poisoned(&peer)),
            format!("items[1].key: {NOT_UTF8}")
        );
    }

    /// `checks[3].descriptors[1].key`: names, each with an optional index.
    fn is_path(path: &str) -> bool {
        path.split('.').all(|part| {
            let (name, index) = part.split_once('[').unwrap_or((part, "]"));
            let index = index.strip_suffix(']');
            !name.is_empty()
                && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
                && index.is_some_and(|i| i.is_empty() || i.parse::<usize>().is_ok())
        })
    }

    proptest::proptest! {
        /// Whatever the bytes, a refusal starts with a field path or the message's name.
        #[test]
        fn any_malformed_body_is_named_by_a_path_or_its_message(
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..48),
        ) {
            if V1BatchRequest::decode(&body[..]).is_err() {
                let text = refusal::<V1BatchRequest>(&body);
                let (path, _) = text.split_once(": invalid protobuf: ").expect("the form");
                proptest::prop_assert!(
                    path == "ringlimit.v1.CheckBatchRequest" || is_path(path),
                    "{}", text
                );
            }
        }
    }
}
