//! The RESP face: Redis clients (redis-cli, redis-py, any language's client) ask for
//! redis-cell's `CL.THROTTLE` and get its five integers, decided by the key's owner on
//! the cluster's GCRA like every other check ([`Checker::check_throttle`]). Served on a
//! listener of its own (`serve --resp-listen`), off by default: every call carries its
//! own limit, so serving it is the node's opt-in to caller-chosen limits, as
//! `--gubernator` is for Gubernator's.
//!
//! - [`parse`]: the incremental, bounded request decoder (pure);
//! - [`session`]: one connection's commands as a state machine (`AUTH`, `HELLO`,
//!   `PING`, `ECHO`, `QUIT`, `COMMAND`, `CLIENT`, `SELECT 0`, `CL.THROTTLE`);
//! - [`reply`]: RESP2 and RESP3 replies;
//! - [`serve_connection`]: the thin I/O loop around them.
//!
//! # Bounds on one connection
//!
//! Pipelining is served: every whole command already received is decided, up to
//! [`RespLimits::max_pipeline`] at a time, the `CL.THROTTLE` calls among them in one
//! batch for the router, and their replies are written in order before anything more is
//! read. A client that never reads its replies therefore stops being read (the socket's
//! buffers fill), and one that takes longer than [`RespLimits::request_timeout`] to
//! send a command it started, or to take its replies, is disconnected, as is one idle
//! for [`RespLimits::idle_timeout`]. Bad bytes (see [`parse::RespError`]) get
//! `-ERR Protocol error: …` and the connection is closed; nothing of a refused command
//! is ever charged.

pub mod parse;
pub mod reply;
pub mod session;

use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::check::throttle::{ThrottleInput, ThrottleReply};
use crate::check::{CheckError, Checker};
use session::{Action, Session, ThrottleCall};

/// What one client can make the RESP face hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RespLimits {
    /// Most open connections; one more is told `-ERR max number of clients reached`
    /// and closed (Redis's words).
    pub max_connections: usize,
    /// Most commands of one connection decided at a time (a pipeline is served in
    /// rounds of this many).
    pub max_pipeline: usize,
    /// A connection with no command under way for this long is closed.
    pub idle_timeout: Duration,
    /// Longest a client may take to finish sending a command it started, or to take
    /// the replies of one round.
    pub request_timeout: Duration,
    /// Bounds on one command.
    pub bounds: parse::Bounds,
}

impl Default for RespLimits {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            max_pipeline: 256,
            idle_timeout: Duration::from_secs(300),
            request_timeout: Duration::from_secs(10),
            bounds: parse::Bounds::default(),
        }
    }
}

impl RespLimits {
    /// Refuse settings that would leave the face unbounded or unusable.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_connections == 0 || self.max_pipeline == 0 {
            return Err("RESP max connections and max pipeline must be at least 1".into());
        }
        if self.max_pipeline > crate::check::throttle::MAX_CALLS {
            return Err(format!(
                "RESP max pipeline must be at most {}",
                crate::check::throttle::MAX_CALLS
            ));
        }
        if self.idle_timeout.is_zero() || self.request_timeout.is_zero() {
            return Err("RESP idle and request timeouts must be longer than zero".into());
        }
        Ok(())
    }
}

/// The password `AUTH` must present (`--resp-token-file`). Compared through blake3
/// hashes, so the comparison takes the same time whatever the guess.
#[derive(Clone)]
pub struct RespToken(blake3::Hash);

impl std::fmt::Debug for RespToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RespToken(..)")
    }
}

/// Shortest token accepted: a password nobody types, 16 characters of a generator's
/// output at least.
pub const MIN_TOKEN_CHARS: usize = 16;

impl RespToken {
    /// A token from its bytes (surrounding whitespace is the caller's to trim).
    pub fn new(text: &[u8]) -> Result<Self, String> {
        if text.len() < MIN_TOKEN_CHARS {
            return Err(format!(
                "RESP token must be at least {MIN_TOKEN_CHARS} characters"
            ));
        }
        if !text.iter().all(u8::is_ascii_graphic) {
            return Err("RESP token must be visible ASCII without spaces".into());
        }
        Ok(RespToken(blake3::hash(text)))
    }

    /// The token in the first line of `path`.
    pub fn from_file(path: &std::path::Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("RESP token file {}: {e}", path.display()))?;
        let first = text.lines().next().unwrap_or("").trim();
        Self::new(first.as_bytes()).map_err(|e| format!("RESP token file {}: {e}", path.display()))
    }

    fn matches(&self, given: &[u8]) -> bool {
        // blake3::Hash equality is constant-time.
        blake3::hash(given) == self.0
    }
}

/// What every connection of the face shares.
#[derive(Debug, Clone)]
pub struct RespFace {
    /// The check seam.
    pub checker: Checker,
    /// `None`: no `AUTH` needed.
    pub token: Option<RespToken>,
    /// Per-connection bounds.
    pub limits: RespLimits,
}

/// Why a connection ended early (logged at debug: a client's doing, not the node's).
#[derive(Debug, thiserror::Error)]
pub enum ConnectionEnd {
    /// The socket failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// Bytes that are not RESP (answered before closing).
    #[error("protocol error: {0}")]
    Protocol(#[from] parse::RespError),
    /// Idle, or too slow to send a command or to read replies.
    #[error("timed out {0}")]
    TimedOut(&'static str),
}

/// How much is read from the socket at once.
const READ_CHUNK: usize = 16 * 1024;

/// Serve one client until it quits, misbehaves, times out, or `cancel` fires.
pub async fn serve_connection<S>(
    mut stream: S,
    face: &RespFace,
    cancel: &CancellationToken,
) -> Result<(), ConnectionEnd>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let limits = &face.limits;
    let mut decoder = parse::Decoder::new(limits.bounds);
    let mut session = Session::new(face.token.as_ref());
    let mut input = BytesMut::with_capacity(READ_CHUNK);
    let mut round = Round::default();
    // When the command now under way started arriving: it must be whole within the
    // request timeout of that, however its bytes trickle in.
    let mut started: Option<tokio::time::Instant> = None;
    loop {
        // Every whole command already here, up to the round's bound.
        let mut commands = 0;
        let mut close = false;
        while commands < limits.max_pipeline {
            let args = match decoder.decode(&mut input) {
                Ok(Some(args)) => args,
                Ok(None) => break,
                Err(error) => {
                    round.error(&format!("ERR Protocol error: {error}"));
                    flush(&mut stream, face, &mut round, limits).await?;
                    metrics::counter!("ringlimit_resp_protocol_errors_total").increment(1);
                    linger(&mut stream).await;
                    return Err(error.into());
                }
            };
            started = None;
            if args.is_empty() {
                continue;
            }
            commands += 1;
            match session.command(&args, face.token.as_ref(), &mut round.out) {
                Action::Replied => {}
                Action::Throttle(call) => round.throttle(call),
                Action::Close => {
                    close = true;
                    break;
                }
            }
        }
        if commands > 0 {
            flush(&mut stream, face, &mut round, limits).await?;
        }
        if close {
            linger(&mut stream).await;
            return Ok(());
        }
        if commands == limits.max_pipeline {
            continue; // More may be buffered already: another round before reading.
        }
        let now = tokio::time::Instant::now();
        let (deadline, waiting) = if decoder.in_command() {
            let since = *started.get_or_insert(now);
            (since + limits.request_timeout, "sending a command")
        } else {
            started = None;
            (now + limits.idle_timeout, "idle")
        };
        input.reserve(READ_CHUNK);
        let read = tokio::select! {
            read = tokio::time::timeout_at(deadline, stream.read_buf(&mut input)) => read,
            () = cancel.cancelled() => return Ok(()),
        };
        match read {
            Err(_) => return Err(ConnectionEnd::TimedOut(waiting)),
            Ok(Ok(0)) => return Ok(()),
            Ok(Ok(_)) => {}
            Ok(Err(error)) => return Err(error.into()),
        }
    }
}

/// After a protocol error: stop sending, and read (and drop) what the client still
/// sends for a moment, so that closing with unread bytes does not reset the
/// connection before the client has read the error. Bounded in time and bytes.
async fn linger<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S) {
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 4096];
    let mut left: usize = 1 << 20;
    let drain = async {
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(500), drain).await;
}

/// The replies of one round of commands, in order: those written as each command ran,
/// and the places the `CL.THROTTLE` replies go once the checker has decided them.
#[derive(Debug, Default)]
struct Round {
    out: BytesMut,
    /// (offset in `out`, call) of each `CL.THROTTLE`, in order.
    calls: Vec<(usize, ThrottleCall)>,
}

impl Round {
    fn throttle(&mut self, call: ThrottleCall) {
        self.calls.push((self.out.len(), call));
    }

    fn error(&mut self, message: &str) {
        reply::error(&mut self.out, message);
    }
}

/// Decide the round's calls in one batch, write every reply in order, and send them
/// within the request timeout.
async fn flush<S: AsyncWrite + Unpin>(
    stream: &mut S,
    face: &RespFace,
    round: &mut Round,
    limits: &RespLimits,
) -> Result<(), ConnectionEnd> {
    let wire = if round.calls.is_empty() {
        round.out.split()
    } else {
        let answers = decide(&face.checker, &round.calls).await;
        let mut wire = BytesMut::with_capacity(round.out.len() + 48 * answers.len());
        let mut from = 0;
        for ((at, _), answer) in round.calls.iter().zip(answers) {
            wire.extend_from_slice(&round.out[from..*at]);
            from = *at;
            match answer {
                Ok(r) => reply::integers(
                    &mut wire,
                    &[
                        r.limited,
                        r.limit,
                        r.remaining,
                        r.retry_after,
                        r.reset_after,
                    ],
                ),
                Err(message) => reply::error(&mut wire, &message),
            }
        }
        wire.extend_from_slice(&round.out[from..]);
        round.out.clear();
        round.calls.clear();
        wire
    };
    tokio::time::timeout(limits.request_timeout, stream.write_all(&wire))
        .await
        .map_err(|_| ConnectionEnd::TimedOut("taking replies"))??;
    Ok(())
}

/// The checker's answers to a round's calls, one per call: the reply, or the error
/// to send for a call that was not decided (nothing was charged for it).
async fn decide(
    checker: &Checker,
    calls: &[(usize, ThrottleCall)],
) -> Vec<Result<ThrottleReply, String>> {
    let inputs: Vec<ThrottleInput<'_>> = calls
        .iter()
        .map(|(_, c)| ThrottleInput {
            key: &c.key,
            max_burst: c.max_burst,
            count: c.count,
            period: c.period,
            quantity: c.quantity,
        })
        .collect();
    match checker.check_throttle(&inputs).await {
        Ok(answers) => answers
            .into_iter()
            .map(|a| a.map_err(|e| error_reply(&e)))
            .collect(),
        // The whole round could not be decided (overload): each call says so.
        Err(error) => {
            let message = error_reply(&error);
            vec![Err(message); calls.len()]
        }
    }
}

/// The RESP error of a call that was not decided: `ERR` for what the caller must fix,
/// `TRYAGAIN` for what may pass on a retry.
fn error_reply(error: &CheckError) -> String {
    match error {
        CheckError::InvalidArgument { field, reason } => format!("ERR {field}: {reason}"),
        CheckError::Unavailable { .. } => {
            "TRYAGAIN the owner of this key is unreachable; nothing was charged".into()
        }
        other => format!("TRYAGAIN {other}; nothing was charged"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_that_would_leave_the_face_unbounded_or_unusable_are_refused() {
        assert!(RespLimits::default().validate().is_ok());
        for bad in [
            RespLimits {
                max_connections: 0,
                ..RespLimits::default()
            },
            RespLimits {
                max_pipeline: 0,
                ..RespLimits::default()
            },
            RespLimits {
                max_pipeline: crate::check::throttle::MAX_CALLS + 1,
                ..RespLimits::default()
            },
            RespLimits {
                idle_timeout: Duration::ZERO,
                ..RespLimits::default()
            },
            RespLimits {
                request_timeout: Duration::ZERO,
                ..RespLimits::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_token_is_long_visible_ascii_and_matches_only_itself() {
        assert!(RespToken::new(b"too-short").is_err());
        assert!(RespToken::new(b"has a space in it, 16+").is_err());
        let t = RespToken::new(b"0123456789abcdef").unwrap();
        assert!(t.matches(b"0123456789abcdef"));
        assert!(!t.matches(b"0123456789abcdeF"));
        assert_eq!(format!("{t:?}"), "RespToken(..)", "never printed");
    }

    #[test]
    fn errors_say_whether_to_fix_the_call_or_retry_it() {
        assert_eq!(
            error_reply(&CheckError::invalid("count", "must be 1..=1000000000")),
            "ERR count: must be 1..=1000000000"
        );
        let unavailable = CheckError::Unavailable {
            descriptor: 0,
            rule: "redis~cl.throttle".into(),
        };
        assert!(error_reply(&unavailable).starts_with("TRYAGAIN"));
        assert!(error_reply(&CheckError::Exhausted("full".into())).starts_with("TRYAGAIN"));
    }
}
