//! The framed peer transport: forwarded batches as length-prefixed protobuf frames on a
//! plain TCP connection to a peer's peer port, instead of messages of an HTTP/2 stream.
//!
//! Why: a forwarded batch on `Peer/ForwardStream` pays HTTP/2's framing, flow control
//! and stream bookkeeping, and two extra task hops on each side (the connection task
//! and the stream's), for a message that is a few hundred bytes. A frame is a 4-byte
//! length and the same `ForwardCall` / `ForwardAnswer` bytes; the link's driver task
//! writes and reads the socket itself, and on the owner one task per connection reads
//! calls, decides them and writes the answers.
//!
//! A connection, both directions:
//!
//! ```text
//! sender → owner:  MAGIC, frame(hello), frame(ForwardCall), frame(ForwardCall), ...
//! owner → sender:  frame(welcome: a ForwardAnswer), frame(ForwardAnswer), ...
//! frame(m):        u32 big-endian length of m, then m's protobuf bytes
//! ```
//!
//! - The hello is the call proof a `Peer` call carries in its header
//!   ([`Keyring::sign_call`](crate::keyring::Keyring::sign_call) over [`FRAMES_PATH`]),
//!   as UTF-8 bytes (empty without a cluster key). The owner checks it exactly as it
//!   checks a call's header (the same key ring, clock allowance and replay guard)
//!   before it reads anything else.
//! - The welcome is a `ForwardAnswer` with `call` 0 and no response: `code` 0 admits
//!   the connection; otherwise it is the status a call would have got
//!   (`UNAUTHENTICATED` and why) and the owner closes the connection.
//! - Every later frame is one call or one answer, with the meaning it has on
//!   `Peer/ForwardStream` (peer.proto): answers in any order, a refused batch answered
//!   with its status, the sender's end of writing ending the connection once answered.
//!
//! The owner's peer listener tells a framed connection from an HTTP/2 one by its first
//! byte (`R` against HTTP/2's `P`); a node with peer TLS does not serve frames at all
//! (mutual TLS stays with the HTTP/2 transport), and a node of an older build closes
//! the connection at the magic, which the sender takes as "use HTTP/2 with this peer"
//! ([`Session::not_framed`](super::session::Session::not_framed)).
//!
//! This module is the format only, with no socket: [`FrameReader`] cuts frames out of
//! the bytes read so far and refuses a length beyond its bound before buffering any of
//! it, [`put_frame`] writes one.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// What a framed connection starts with. Its first byte is neither HTTP/2's preface
/// (`P`) nor a TLS record (`0x16`), so one byte tells the listener which it is.
pub const MAGIC: &[u8; 8] = b"RLPF/1\r\n";

/// The path a framed connection's proof is signed over: a proof made for an HTTP/2
/// call does not open a framed connection, nor the other way round.
pub const FRAMES_PATH: &str = "/ringlimit.peer.v1.Peer/ForwardFrames";

/// Bytes of a frame's length prefix.
pub const PREFIX: usize = 4;

/// Most bytes of a hello (a proof is about 150): a connection that announces more is
/// not a member's.
pub const MAX_HELLO: usize = 1024;

/// Why the bytes of a connection are not frames this side accepts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The connection did not start with [`MAGIC`].
    #[error("not a ringlimit framed peer connection (bad magic)")]
    BadMagic,
    /// A length prefix beyond the bound: refused before any of it is buffered.
    #[error("frame of {len} bytes is larger than the {max} allowed")]
    TooLarge {
        /// The length announced.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// A frame whose bytes are not the message it must be.
    #[error("malformed frame: {0}")]
    Malformed(String),
}

/// Cuts frames out of a connection's bytes as they arrive: a plain struct fed the
/// read buffer, no socket inside.
#[derive(Debug, Clone)]
pub struct FrameReader {
    max: usize,
}

impl FrameReader {
    /// A reader refusing frames longer than `max` bytes.
    pub fn new(max: usize) -> Self {
        Self { max }
    }

    /// The next whole frame at the front of `buf` (taken out of it), `None` until one
    /// has arrived, or why the bytes cannot be frames. The length is checked as soon as
    /// its 4 bytes are in: an oversized frame is refused with nothing of it buffered.
    pub fn next(&self, buf: &mut BytesMut) -> Result<Option<Bytes>, FrameError> {
        if buf.len() < PREFIX {
            return Ok(None);
        }
        let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if len > self.max {
            return Err(FrameError::TooLarge { len, max: self.max });
        }
        if buf.len() < PREFIX + len {
            // Room for the rest, so the reads that follow fill this frame.
            buf.reserve(PREFIX + len - buf.len());
            return Ok(None);
        }
        buf.advance(PREFIX);
        Ok(Some(buf.split_to(len).freeze()))
    }
}

/// Whether `buf` starts with [`MAGIC`]: `Some(true)` once it does (the magic is taken
/// out), `Some(false)` as soon as a byte differs, `None` while too few have arrived.
pub fn take_magic(buf: &mut BytesMut) -> Option<bool> {
    let n = buf.len().min(MAGIC.len());
    if buf[..n] != MAGIC[..n] {
        return Some(false);
    }
    if n < MAGIC.len() {
        return None;
    }
    buf.advance(MAGIC.len());
    Some(true)
}

/// Append `message` to `buf` as one frame.
pub fn put_frame(message: &impl prost::Message, buf: &mut BytesMut) {
    let len = message.encoded_len();
    buf.reserve(PREFIX + len);
    buf.put_u32(len as u32);
    message
        .encode(buf)
        .expect("the buffer was reserved for the whole message");
}

/// Append raw `bytes` to `buf` as one frame (the hello).
pub fn put_raw_frame(bytes: &[u8], buf: &mut BytesMut) {
    buf.reserve(PREFIX + bytes.len());
    buf.put_u32(bytes.len() as u32);
    buf.put_slice(bytes);
}

/// Decode a frame as `M`.
pub fn decode<M: prost::Message + Default>(frame: Bytes) -> Result<M, FrameError> {
    M::decode(frame).map_err(|e| FrameError::Malformed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::peer::ForwardAnswer;

    #[test]
    fn frames_arriving_in_pieces_come_out_whole_and_in_order() {
        let mut wire = BytesMut::new();
        let first = ForwardAnswer {
            call: 7,
            message: "x".repeat(300),
            ..ForwardAnswer::default()
        };
        put_frame(&first, &mut wire);
        put_raw_frame(b"hello", &mut wire);
        let reader = FrameReader::new(1 << 20);
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        // One byte at a time: the worst a slow sender can do.
        for byte in wire.iter() {
            buf.put_u8(*byte);
            while let Some(frame) = reader.next(&mut buf).unwrap() {
                out.push(frame);
            }
        }
        assert_eq!(out.len(), 2);
        assert_eq!(decode::<ForwardAnswer>(out[0].clone()).unwrap(), first);
        assert_eq!(&out[1][..], b"hello");
        assert!(buf.is_empty());
    }

    #[test]
    fn a_huge_length_prefix_is_refused_before_any_of_it_is_buffered() {
        let reader = FrameReader::new(1000);
        let mut buf = BytesMut::from(&u32::MAX.to_be_bytes()[..]);
        assert_eq!(
            reader.next(&mut buf),
            Err(FrameError::TooLarge {
                len: u32::MAX as usize,
                max: 1000
            })
        );
        assert!(buf.capacity() < 1000, "nothing reserved for it");
        let mut just = BytesMut::from(&1000u32.to_be_bytes()[..]);
        assert_eq!(reader.next(&mut just), Ok(None), "the bound itself is fine");
    }

    #[test]
    fn the_magic_is_recognised_from_its_first_differing_byte() {
        let mut http2 = BytesMut::from(&b"PRI * HTTP/2.0"[..]);
        assert_eq!(take_magic(&mut http2), Some(false));
        let mut partial = BytesMut::from(&MAGIC[..3]);
        assert_eq!(take_magic(&mut partial), None);
        let mut whole = BytesMut::from(&MAGIC[..]);
        whole.put_slice(b"rest");
        assert_eq!(take_magic(&mut whole), Some(true));
        assert_eq!(&whole[..], b"rest");
        assert_ne!(MAGIC[0], b'P');
        assert_ne!(MAGIC[0], 0x16);
    }

    #[test]
    fn garbage_in_a_frame_is_malformed_not_a_panic() {
        let garbage = Bytes::from_static(&[0xff, 0xff, 0xff]);
        assert!(matches!(
            decode::<ForwardAnswer>(garbage),
            Err(FrameError::Malformed(_))
        ));
    }
}
