//! RESP replies, written into a connection's output buffer. RESP2 unless the client
//! asked for RESP3 with `HELLO 3`; the two differ only in nulls and maps among what
//! this face answers.

use std::fmt::Write;

use bytes::{BufMut, BytesMut};

/// The protocol a connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// RESP2: what every connection starts with.
    Resp2,
    /// RESP3, after `HELLO 3`.
    Resp3,
}

impl Protocol {
    /// The version number `HELLO` reports.
    pub fn version(self) -> i64 {
        match self {
            Protocol::Resp2 => 2,
            Protocol::Resp3 => 3,
        }
    }
}

/// `+text`: `text` must hold no CR or LF (every caller passes a constant).
pub fn simple(out: &mut BytesMut, text: &str) {
    out.put_u8(b'+');
    out.put_slice(text.as_bytes());
    out.put_slice(b"\r\n");
}

/// `-CODE message`: CR and LF in the message become spaces, so a reply that echoes a
/// caller's words can never frame a second reply.
pub fn error(out: &mut BytesMut, message: &str) {
    out.put_u8(b'-');
    out.extend(
        message
            .bytes()
            .map(|b| if b == b'\r' || b == b'\n' { b' ' } else { b }),
    );
    out.put_slice(b"\r\n");
}

/// `:n`.
pub fn integer(out: &mut BytesMut, n: i64) {
    // Formatted in place: no allocation per integer on the check's path.
    let _ = write!(out, ":{n}\r\n");
}

/// `$len\r\nbytes`.
pub fn bulk(out: &mut BytesMut, bytes: &[u8]) {
    let _ = write!(out, "${}\r\n", bytes.len());
    out.put_slice(bytes);
    out.put_slice(b"\r\n");
}

/// The null bulk string (RESP2) or null (RESP3).
pub fn null(out: &mut BytesMut, protocol: Protocol) {
    match protocol {
        Protocol::Resp2 => out.put_slice(b"$-1\r\n"),
        Protocol::Resp3 => out.put_slice(b"_\r\n"),
    }
}

/// An array header of `len` elements (the elements follow).
pub fn array(out: &mut BytesMut, len: usize) {
    let _ = write!(out, "*{len}\r\n");
}

/// A map header of `len` pairs: RESP3's `%`, or a flat array of `2 × len` in RESP2.
pub fn map(out: &mut BytesMut, len: usize, protocol: Protocol) {
    match protocol {
        Protocol::Resp2 => array(out, 2 * len),
        Protocol::Resp3 => {
            let _ = write!(out, "%{len}\r\n");
        }
    }
}

/// An array of integers (`CL.THROTTLE`'s reply).
pub fn integers(out: &mut BytesMut, values: &[i64]) {
    array(out, values.len());
    for &v in values {
        integer(out, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(f: impl FnOnce(&mut BytesMut)) -> Vec<u8> {
        let mut out = BytesMut::new();
        f(&mut out);
        out.to_vec()
    }

    #[test]
    fn replies_are_framed_as_resp() {
        assert_eq!(written(|o| simple(o, "PONG")), b"+PONG\r\n");
        assert_eq!(written(|o| integer(o, -1)), b":-1\r\n");
        assert_eq!(written(|o| bulk(o, b"a\r\nb")), b"$4\r\na\r\nb\r\n");
        assert_eq!(written(|o| null(o, Protocol::Resp2)), b"$-1\r\n");
        assert_eq!(written(|o| null(o, Protocol::Resp3)), b"_\r\n");
        assert_eq!(written(|o| map(o, 2, Protocol::Resp2)), b"*4\r\n");
        assert_eq!(written(|o| map(o, 2, Protocol::Resp3)), b"%2\r\n");
        assert_eq!(
            written(|o| integers(o, &[0, 16, 15, -1, 2])),
            b"*5\r\n:0\r\n:16\r\n:15\r\n:-1\r\n:2\r\n"
        );
    }

    #[test]
    fn an_error_never_frames_a_second_reply() {
        assert_eq!(
            written(|o| error(o, "ERR unknown 'a\r\n+OK'")),
            b"-ERR unknown 'a  +OK'\r\n"
        );
    }
}
