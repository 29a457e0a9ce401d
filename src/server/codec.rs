//! The protobuf codec of every generated `ringlimit` service (wired in by `build.rs`
//! through `codec_path`).
//!
//! tonic-prost answers a request body that fails to decode (truncated, invalid UTF-8 in
//! a string, a wrong wire type) with `INTERNAL`, which a gateway may read as "limiter
//! down" and fail open on. A malformed body is the caller's fault: this codec answers
//! `INVALID_ARGUMENT` naming the message, e.g. `ringlimit.v1.CheckRequest: invalid
//! protobuf: ...`. Encoding is tonic-prost's own.
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
        U::decode(buf)
            .map(Some)
            .map_err(|error| invalid::<U>(&error))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

fn invalid<U: Name>(error: &prost::DecodeError) -> Status {
    Status::invalid_argument(format!("{}: invalid protobuf: {error}", U::full_name()))
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

/// The codec of `proto::v1_server`: [`NamedProstDecoder`] for requests, answers
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
    type Decoder = NamedProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        AnswerEncoder { _pd: PhantomData }
    }

    fn decoder(&mut self) -> Self::Decoder {
        NamedProstDecoder { _pd: PhantomData }
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
