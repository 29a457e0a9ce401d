//! The RESP request decoder: bytes in, commands out, no I/O.
//!
//! A client sends a command as an array of bulk strings (`*2\r\n$4\r\nPING\r\n$2\r\nhi\r\n`)
//! or, typed by hand, as an inline line (`PING hi\r\n`). [`Decoder::decode`] takes what
//! has arrived so far and returns the next whole command, or `None` when more bytes are
//! needed. It is incremental: the state of a half-read command (how many arguments are
//! still due, how long the current one is) is kept between calls, and a line still
//! waiting for its `\n` is not scanned twice, so a sender that trickles one byte at a
//! time costs O(bytes), not O(bytes²).
//!
//! Every length is bounded before anything is allocated for it ([`Bounds`]): a client
//! announcing a 2 GB bulk string or a billion arguments is refused on the header, and
//! the connection is closed (as Redis does on a protocol error: what follows cannot be
//! framed any more).

use bytes::{Buf, Bytes, BytesMut};

/// What one command may carry. Redis's own bounds are far larger (512 MB bulk strings,
/// a million-argument array); a rate-limit check needs a few short arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Longest bulk string (one argument), in bytes.
    pub max_bulk: usize,
    /// Most arguments in one command, its name included.
    pub max_args: usize,
    /// Longest inline command line, in bytes.
    pub max_inline: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            // A key of up to 4096 bytes (the check layer's bound) and room to spare.
            max_bulk: 8 * 1024,
            // CL.THROTTLE has 6; HELLO 3 AUTH user pass SETNAME name has 7.
            max_args: 32,
            max_inline: 16 * 1024,
        }
    }
}

/// Longest `*N` or `$N` header line: a sign, 20 digits and `\r\n` fit well within it.
const MAX_HEADER: usize = 32;

/// Why the bytes a client sent are not RESP. Each is answered `-ERR Protocol error: …`
/// and closes the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RespError {
    /// An array element that is not a bulk string (a request carries only those).
    #[error("expected '$', got '{0}'")]
    ExpectedBulk(char),
    /// A `*N` count that is not a number, or negative other than the null array.
    #[error("invalid multibulk length")]
    BadArrayLength,
    /// A `$N` length that is not a non-negative number.
    #[error("invalid bulk length")]
    BadBulkLength,
    /// More arguments than [`Bounds::max_args`].
    #[error("{len} arguments in one command; at most {max} are accepted")]
    TooManyArgs {
        /// As announced.
        len: u64,
        /// The bound.
        max: usize,
    },
    /// A bulk string longer than [`Bounds::max_bulk`].
    #[error("bulk string of {len} bytes; at most {max} are accepted")]
    BulkTooLong {
        /// As announced.
        len: u64,
        /// The bound.
        max: usize,
    },
    /// A header or inline line without its end within the bound.
    #[error("line longer than {max} bytes")]
    LineTooLong {
        /// The bound.
        max: usize,
    },
    /// A bulk string not followed by `\r\n`.
    #[error("bulk string not followed by CRLF")]
    MissingCrlf,
    /// An inline line with a quote that is never closed.
    #[error("unbalanced quotes in request")]
    UnbalancedQuotes,
}

/// One command: its arguments, the name first. Empty for a blank inline line or an
/// empty array, which Redis ignores and so does the connection.
pub type Args = Vec<Bytes>;

/// Where the decoder is inside the command being read.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Between commands.
    Idle,
    /// Inside an array: arguments still due; the next one's length when its `$N`
    /// header has been read.
    Array { due: usize, bulk: Option<usize> },
}

/// The incremental RESP request decoder of one connection.
#[derive(Debug)]
pub struct Decoder {
    bounds: Bounds,
    state: State,
    args: Args,
    /// Bytes at the front of the buffer already searched for `\n` in vain.
    scanned: usize,
}

impl Decoder {
    /// A decoder for commands within `bounds`.
    pub fn new(bounds: Bounds) -> Self {
        Self {
            bounds,
            state: State::Idle,
            args: Vec::new(),
            scanned: 0,
        }
    }

    /// Whether a command has started but not been read whole (a client that stops
    /// here is sending slowly, not idling).
    pub fn in_command(&self) -> bool {
        self.state != State::Idle || self.scanned > 0
    }

    /// The next whole command from the front of `buf`, consuming its bytes; `None`
    /// when `buf` ends inside one (what was read of it is kept here). After an error
    /// the decoder and the buffer are of no further use.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Args>, RespError> {
        loop {
            match self.state {
                State::Idle => {
                    let Some(&first) = buf.first() else {
                        return Ok(None);
                    };
                    if first != b'*' {
                        return self.inline(buf);
                    }
                    let Some(line) = self.line(buf, MAX_HEADER)? else {
                        return Ok(None);
                    };
                    let len = number(&line[1..]).ok_or(RespError::BadArrayLength)?;
                    if len <= 0 {
                        // `*0` and the null array `*-1` are no command.
                        if len < -1 {
                            return Err(RespError::BadArrayLength);
                        }
                        return Ok(Some(Vec::new()));
                    }
                    if len as u64 > self.bounds.max_args as u64 {
                        return Err(RespError::TooManyArgs {
                            len: len as u64,
                            max: self.bounds.max_args,
                        });
                    }
                    self.args = Vec::with_capacity(len as usize);
                    self.state = State::Array {
                        due: len as usize,
                        bulk: None,
                    };
                }
                State::Array { due, bulk: None } => {
                    let Some(&first) = buf.first() else {
                        return Ok(None);
                    };
                    if first != b'$' {
                        return Err(RespError::ExpectedBulk(char::from(first)));
                    }
                    let Some(line) = self.line(buf, MAX_HEADER)? else {
                        return Ok(None);
                    };
                    let len = number(&line[1..])
                        .filter(|&n| n >= 0)
                        .ok_or(RespError::BadBulkLength)?;
                    if len as u64 > self.bounds.max_bulk as u64 {
                        return Err(RespError::BulkTooLong {
                            len: len as u64,
                            max: self.bounds.max_bulk,
                        });
                    }
                    self.state = State::Array {
                        due,
                        bulk: Some(len as usize),
                    };
                }
                State::Array {
                    due,
                    bulk: Some(len),
                } => {
                    if buf.len() < len + 2 {
                        // Room for the rest of it, once: never more than the bound.
                        buf.reserve(len + 2 - buf.len());
                        return Ok(None);
                    }
                    if &buf[len..len + 2] != b"\r\n" {
                        return Err(RespError::MissingCrlf);
                    }
                    let arg = buf.split_to(len).freeze();
                    buf.advance(2);
                    self.args.push(arg);
                    if due == 1 {
                        self.state = State::Idle;
                        return Ok(Some(std::mem::take(&mut self.args)));
                    }
                    self.state = State::Array {
                        due: due - 1,
                        bulk: None,
                    };
                }
            }
        }
    }

    /// An inline command: one line split on spaces, with Redis's quoting
    /// (`"a b"`, `'a b'`, `\"` and `\xNN` inside double quotes).
    fn inline(&mut self, buf: &mut BytesMut) -> Result<Option<Args>, RespError> {
        let Some(line) = self.line(buf, self.bounds.max_inline)? else {
            return Ok(None);
        };
        let args = split_inline(&line)?;
        if args.len() > self.bounds.max_args {
            return Err(RespError::TooManyArgs {
                len: args.len() as u64,
                max: self.bounds.max_args,
            });
        }
        Ok(Some(args))
    }

    /// The next line (without its `\r\n` or `\n`), consumed from `buf`; `None` while
    /// its end has not arrived. A line longer than `max` is an error.
    fn line(&mut self, buf: &mut BytesMut, max: usize) -> Result<Option<Bytes>, RespError> {
        let from = self.scanned.min(buf.len());
        match buf[from..].iter().position(|&b| b == b'\n') {
            Some(at) => {
                let end = from + at;
                if end > max {
                    return Err(RespError::LineTooLong { max });
                }
                self.scanned = 0;
                let mut line = buf.split_to(end + 1);
                line.truncate(end);
                if line.last() == Some(&b'\r') {
                    line.truncate(end - 1);
                }
                Ok(Some(line.freeze()))
            }
            None if buf.len() > max => Err(RespError::LineTooLong { max }),
            None => {
                self.scanned = buf.len();
                Ok(None)
            }
        }
    }
}

/// A decimal `i64` (an optional `-`, then digits only), as a RESP length.
fn number(text: &[u8]) -> Option<i64> {
    let (negative, digits) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, text),
    };
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: i64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(if negative { -n } else { n })
}

/// Split an inline line into arguments as Redis's `sdssplitargs` does: runs of spaces
/// (and tabs) separate, double quotes allow `\n`, `\r`, `\t`, `\\`, `\"` and `\xNN`
/// escapes, single quotes allow `\'`; a closing quote must be followed by a space or
/// the end.
fn split_inline(line: &[u8]) -> Result<Args, RespError> {
    let mut args = Vec::new();
    let mut i = 0;
    let blank = |b: u8| b == b' ' || b == b'\t';
    loop {
        while i < line.len() && blank(line[i]) {
            i += 1;
        }
        if i == line.len() {
            return Ok(args);
        }
        let mut arg = Vec::new();
        match line[i] {
            q @ (b'"' | b'\'') => {
                i += 1;
                loop {
                    let Some(&b) = line.get(i) else {
                        return Err(RespError::UnbalancedQuotes);
                    };
                    if b == q {
                        i += 1;
                        if i < line.len() && !blank(line[i]) {
                            return Err(RespError::UnbalancedQuotes);
                        }
                        break;
                    }
                    if b == b'\\' && i + 1 < line.len() {
                        let next = line[i + 1];
                        if q == b'"' {
                            let hex = line
                                .get(i + 2..i + 4)
                                .filter(|_| next == b'x')
                                .and_then(|h| std::str::from_utf8(h).ok())
                                .and_then(|h| u8::from_str_radix(h, 16).ok());
                            if let Some(byte) = hex {
                                arg.push(byte);
                                i += 4;
                                continue;
                            }
                            arg.push(match next {
                                b'n' => b'\n',
                                b'r' => b'\r',
                                b't' => b'\t',
                                b'b' => 8,
                                b'a' => 7,
                                other => other,
                            });
                            i += 2;
                            continue;
                        }
                        if next == b'\'' {
                            arg.push(b'\'');
                            i += 2;
                            continue;
                        }
                    }
                    arg.push(b);
                    i += 1;
                }
            }
            _ => {
                while i < line.len() && !blank(line[i]) {
                    arg.push(line[i]);
                    i += 1;
                }
            }
        }
        args.push(Bytes::from(arg));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn decode_all(input: &[u8]) -> Result<Vec<Args>, RespError> {
        let mut d = Decoder::new(Bounds::default());
        let mut buf = BytesMut::from(input);
        let mut out = Vec::new();
        while let Some(args) = d.decode(&mut buf)? {
            out.push(args);
        }
        Ok(out)
    }

    fn strs(args: &Args) -> Vec<&[u8]> {
        args.iter().map(|a| a.as_ref()).collect()
    }

    #[test]
    fn arrays_of_bulk_strings_and_inline_lines_are_commands() {
        let got = decode_all(b"*2\r\n$4\r\nPING\r\n$2\r\nhi\r\nPING\r\nECHO  a\tb \n").unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(strs(&got[0]), [&b"PING"[..], b"hi"]);
        assert_eq!(strs(&got[1]), [&b"PING"[..]]);
        assert_eq!(strs(&got[2]), [&b"ECHO"[..], b"a", b"b"]);
        // Blank lines and empty or null arrays are no command.
        let got = decode_all(b"\r\n*0\r\n*-1\r\n").unwrap();
        assert!(got.iter().all(Vec::is_empty));
        // A bulk string may hold any bytes, CRLF included.
        let got = decode_all(b"*1\r\n$4\r\n\r\n\xff\x00\r\n").unwrap();
        assert_eq!(strs(&got[0]), [&b"\r\n\xff\x00"[..]]);
    }

    #[test]
    fn inline_quotes_follow_redis() {
        let got = decode_all(b"SET \"a b\" 'c d' \"\\x41\\n\" 'it\\'s'\r\n").unwrap();
        assert_eq!(
            strs(&got[0]),
            [&b"SET"[..], b"a b", b"c d", b"A\n", b"it's"]
        );
        assert_eq!(
            decode_all(b"SET \"a b\r\n"),
            Err(RespError::UnbalancedQuotes)
        );
        assert_eq!(
            decode_all(b"SET \"a\"b\r\n"),
            Err(RespError::UnbalancedQuotes)
        );
    }

    #[test]
    fn malformed_requests_are_named() {
        assert_eq!(decode_all(b"*x\r\n"), Err(RespError::BadArrayLength));
        assert_eq!(decode_all(b"*-2\r\n"), Err(RespError::BadArrayLength));
        assert_eq!(
            decode_all(b"*1\r\n:1\r\n"),
            Err(RespError::ExpectedBulk(':'))
        );
        assert_eq!(decode_all(b"*1\r\n$-1\r\n"), Err(RespError::BadBulkLength));
        assert_eq!(decode_all(b"*1\r\n$1x\r\n"), Err(RespError::BadBulkLength));
        assert_eq!(
            decode_all(b"*1\r\n$1\r\nab\r\n"),
            Err(RespError::MissingCrlf)
        );
        assert_eq!(
            decode_all(b"*99999999999999999999\r\n"),
            Err(RespError::BadArrayLength)
        );
    }

    #[test]
    fn huge_lengths_are_refused_on_the_header_before_any_allocation() {
        let max = Bounds::default();
        assert_eq!(
            decode_all(b"*1\r\n$2147483648\r\n"),
            Err(RespError::BulkTooLong {
                len: 2_147_483_648,
                max: max.max_bulk
            })
        );
        assert_eq!(
            decode_all(b"*1000000000\r\n"),
            Err(RespError::TooManyArgs {
                len: 1_000_000_000,
                max: max.max_args
            })
        );
        let endless_header = [b'*'; 64];
        assert_eq!(
            decode_all(&endless_header),
            Err(RespError::LineTooLong { max: MAX_HEADER })
        );
        let endless_inline = vec![b'a'; max.max_inline + 1];
        assert_eq!(
            decode_all(&endless_inline),
            Err(RespError::LineTooLong {
                max: max.max_inline
            })
        );
        let many = format!("{}\r\n", vec!["a"; max.max_args + 1].join(" "));
        assert!(matches!(
            decode_all(many.as_bytes()),
            Err(RespError::TooManyArgs { .. })
        ));
    }

    #[test]
    fn a_command_split_anywhere_decodes_once_whole() {
        let input = b"*3\r\n$11\r\nCL.THROTTLE\r\n$3\r\nkey\r\n$2\r\n15\r\nPING x\r\n";
        for cut in 0..=input.len() {
            let mut d = Decoder::new(Bounds::default());
            let mut buf = BytesMut::from(&input[..cut]);
            let mut out = Vec::new();
            while let Some(a) = d.decode(&mut buf).unwrap() {
                out.push(a);
            }
            buf.extend_from_slice(&input[cut..]);
            while let Some(a) = d.decode(&mut buf).unwrap() {
                out.push(a);
            }
            assert_eq!(out.len(), 2, "cut at {cut}");
            assert_eq!(strs(&out[0]), [&b"CL.THROTTLE"[..], b"key", b"15"]);
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn a_trickled_line_is_scanned_once() {
        let mut d = Decoder::new(Bounds::default());
        let mut buf = BytesMut::new();
        for _ in 0..100 {
            buf.extend_from_slice(b"a");
            assert_eq!(d.decode(&mut buf).unwrap(), None);
            assert!(d.in_command());
            assert_eq!(d.scanned, buf.len());
        }
        buf.extend_from_slice(b"\r\n");
        assert_eq!(d.decode(&mut buf).unwrap().unwrap().len(), 1);
        assert!(!d.in_command());
    }

    /// A command encoded as a client would.
    fn encode(args: &[Vec<u8>]) -> Vec<u8> {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
        out
    }

    proptest! {
        /// Any sequence of valid commands, delivered in any chunks, decodes to exactly
        /// those commands.
        #[test]
        fn valid_commands_in_any_chunks_decode_exactly(
            commands in proptest::collection::vec(
                proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 1..8),
                1..6,
            ),
            chunk in 1usize..50,
        ) {
            let wire: Vec<u8> = commands.iter().flat_map(|c| encode(c)).collect();
            let mut d = Decoder::new(Bounds::default());
            let mut buf = BytesMut::new();
            let mut out = Vec::new();
            for piece in wire.chunks(chunk) {
                buf.extend_from_slice(piece);
                while let Some(a) = d.decode(&mut buf).unwrap() {
                    out.push(a.iter().map(|b| b.to_vec()).collect::<Vec<_>>());
                }
            }
            prop_assert_eq!(out, commands);
            prop_assert!(buf.is_empty());
        }

        /// Any bytes at all: never a panic, and the buffered data stays within the
        /// bounds (the decoder never asks for more room than one bulk string).
        #[test]
        fn any_bytes_decode_or_fail_without_panic(
            input in proptest::collection::vec(any::<u8>(), 0..300),
            chunk in 1usize..40,
        ) {
            let mut d = Decoder::new(Bounds { max_bulk: 64, max_args: 4, max_inline: 64 });
            let mut buf = BytesMut::new();
            'feed: for piece in input.chunks(chunk) {
                buf.extend_from_slice(piece);
                loop {
                    match d.decode(&mut buf) {
                        Ok(Some(args)) => {
                            prop_assert!(args.len() <= 4);
                            prop_assert!(args.iter().all(|a| a.len() <= 64));
                        }
                        Ok(None) => break,
                        Err(_) => break 'feed,
                    }
                }
                prop_assert!(buf.len() <= 64 + 2 + chunk + MAX_HEADER);
            }
        }
    }
}
