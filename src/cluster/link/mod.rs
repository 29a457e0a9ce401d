//! The peer link: this node's side of every call to a peer. Checks bound for their owner
//! travel batched on one framed connection per peer ([`frames`]; an HTTP/2 stream with
//! peer TLS or to an older build); refunds, handed-over state and rules calls go as
//! calls on one persistent HTTP/2 channel per peer.
//!
//! The link is built like quinn-proto's `Connection` or raft-rs's `Ready`: its protocol
//! lives in plain structs with no task, channel, socket or clock inside, fed events and
//! the current time and returning what to send and whom to answer; the async code around
//! them only moves events between sockets, timers and those structs. Time is a
//! `tokio::time::Instant` handed in by the caller, never read inside: a simulator
//! builds instants as one origin plus durations, with no runtime, and drives
//! [`batcher::Batcher`] and [`session::Session`] step by step.
//!
//! - [`batcher`]: checks queued for one peer, cut into batches (`max_batch`,
//!   `max_in_flight`, `flush_delay`), leaving out checks whose caller gave up.
//! - [`session`]: the batches sent and not answered yet: call numbers, the current
//!   `ForwardStream` (opened, aged, broken, replaced), answers (late ones ignored),
//!   deadlines, the switch to unary calls for a peer without the stream, shutdown.
//! - [`calls`]: refund, install and rules calls as request builders and answer readers.
//! - [`wire`]: the prost conversions of a forwarded check and its answer; [`item`]: the
//!   forwarded check as it travels, its strings slices rather than copies;
//!   [`key_state`]: a counter's state as it travels, likewise.
//! - [`signing`]: the call proof every peer call carries.
//! - [`frames`]: the lean transport's format: a stream's calls and answers as
//!   length-prefixed frames on a plain connection of their own, opened with the same
//!   proof, instead of HTTP/2 messages (used where the link has no TLS).
//! - `pool` and `stream` (private): the shell. [`PeerPool`] is what the router, handoff
//!   and rules sync hold; the stream shell runs one batcher task per peer and one driver
//!   task per stream, and nothing per batch.
//!
//! This module and `server::peer` are the only places that see the peer API's prost
//! types: the router hands over [`CheckItem`](crate::cluster::CheckItem)s and gets
//! [`Remote`](crate::cluster::Remote) answers back.
//!
//! Why batches and one stream: an idle link sends each check at once, and under load
//! (at most `max_in_flight` batches out, default 1) the checks that queue meanwhile
//! leave together, so batches grow with the load instead of every check paying for a
//! call of its own. On one long-lived `Peer/ForwardStream` the HTTP/2 headers, the
//! server task, the call's proof and its tower stack are paid once per stream, not
//! per batch. A stream is replaced after `stream_max_age` (the old one finishes the
//! batches it carries), so a server's connection age limit, which closes a connection
//! 30 s after its GOAWAY by default, never cuts a stream in the middle of a batch; a
//! broken stream fails the batches it carried (their checks fall back, as on any failed
//! call) and the next batch opens a new one. A peer that does not know the stream (an
//! older build answers `UNIMPLEMENTED`) gets unary `Peer/Forward` calls from then on;
//! the one batch that found out falls back.
//!
//! Every forward has a deadline. A check whose owner does not answer in time comes back
//! as [`ForwardError`]; the router then fails open (or closed, per rule). A batch
//! carries its most urgent check's deadline, and checks whose caller already gave up are
//! left out of the batch rather than charged on the owner. A batch still waiting at its
//! deadline gives its in-flight slot back, so an owner that stops answering without
//! closing the stream (paused, partitioned) holds up no later batch.

pub mod batcher;
pub mod budget;
pub mod calls;
pub mod frames;
pub mod item;
pub mod key_state;
mod pool;
pub mod session;
pub mod signing;
mod stream;
pub mod wire;

use std::net::IpAddr;
use std::time::Duration;

use crate::cluster::rules_edit::{Refusal, Written};
use crate::config::rules::{RulesSource, Stamp};
use crate::keyring::Keyring;

pub use pool::PeerPool;
pub use signing::Signed;
pub use wire::rule_hash;

/// Forwarding settings.
#[derive(Debug, Clone)]
pub struct ForwardConfig {
    /// How long a forwarded check may take before the receiving node gives up on the
    /// owner and falls back.
    pub timeout: Duration,
    /// How long a batcher waits for more checks once it has one (0: send what is queued).
    pub flush_delay: Duration,
    /// Most checks in one forwarded batch.
    pub max_batch: usize,
    /// Most `Forward` calls in flight to one peer (0: no limit). While the limit is
    /// reached, checks queue and leave together as the next batch when a call returns:
    /// under load batches grow with the load, and an idle link adds no wait.
    pub max_in_flight: usize,
    /// Checks queued per peer before new ones are failed over at once.
    pub queue: usize,
    /// A forward stream is replaced once it is this old (see the module doc): keep it
    /// well inside the grace a peer's server gives a connection's streams after its
    /// GOAWAY (30 s by default).
    pub stream_max_age: Duration,
    /// Forward on one `ForwardStream` per peer; `false`: a unary `Forward` call per batch
    /// (`--forward-unary`).
    pub stream: bool,
    /// Carry that stream as a framed connection ([`frames`]) where the link has no TLS
    /// and the peer speaks frames (`--forward-frames`); `false`: an HTTP/2 stream.
    pub frames: bool,
    /// Source IP for outbound peer connections (so partition rules that match a
    /// node's address also match its outbound traffic); `None` lets the OS choose.
    pub local_ip: Option<IpAddr>,
    /// The cluster key every peer call is signed with; `None` sends unsigned calls
    /// (a node whose peers accept them: `--insecure-cluster`, or a lone loopback node).
    pub keyring: Option<Keyring>,
    /// Mutual TLS to peers (`https`, this node's certificate, the cluster CA);
    /// `None`: plain HTTP/2.
    pub tls: Option<tonic::transport::ClientTlsConfig>,
    /// Largest answer this node decodes from a peer: a pulled rule set, or a rules write
    /// answered with the whole document, is as large as the node's rule cap allows
    /// (`--max-rules-bytes`), well past tonic's 4 MiB default.
    pub max_message_bytes: usize,
}

/// tonic's own default decoding limit: enough for every peer answer but a rules
/// document of tens of thousands of rules.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

impl Default for ForwardConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_millis(250),
            flush_delay: Duration::ZERO,
            max_batch: 1000,
            max_in_flight: 1,
            queue: 16_384,
            stream_max_age: Duration::from_secs(15),
            stream: true,
            frames: true,
            local_ip: None,
            keyring: None,
            tls: None,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

/// Why a forwarded check got no answer from its owner.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ForwardError {
    /// No answer within the deadline.
    #[error("owner {0} did not answer within the deadline")]
    Timeout(String),
    /// The call failed (connection refused, reset, owner shutting down).
    #[error("owner {0} unreachable: {1}")]
    Unreachable(String, String),
    /// The peer's queue is full.
    #[error("forward queue to {0} is full")]
    Overloaded(String),
    /// The owner answered and refused the batch: it is alive (a stale batch, an
    /// overloaded owner, input it would not take). Nothing was decided; the entry node
    /// falls back without sending the checks to the key's successor, which would make a
    /// second decider beside a live owner.
    #[error("owner {0} refused the batch: {1}")]
    Refused(String, String),
}

impl ForwardError {
    /// The error for a status `peer` answered with: a refusal when the code says the
    /// peer decided to refuse, unreachable when it says the call did not get through
    /// (tonic reports transport failures as UNAVAILABLE, UNKNOWN or CANCELLED, and a
    /// restarting owner refuses with UNAVAILABLE so its checks fail over).
    pub fn from_status(peer: &str, code: tonic::Code, message: String) -> Self {
        use tonic::Code;
        match code {
            Code::Unavailable
            | Code::Unknown
            | Code::Cancelled
            | Code::Internal
            | Code::DataLoss => ForwardError::Unreachable(peer.to_string(), message),
            _ => ForwardError::Refused(peer.to_string(), message),
        }
    }

    /// Whether the owner may be down or cut off (no answer, or a call that did not get
    /// through): then the key's successor may decide for it.
    pub fn owner_unreachable(&self) -> bool {
        matches!(
            self,
            ForwardError::Timeout(_) | ForwardError::Unreachable(..)
        )
    }

    /// Whether the owner may have decided (and charged) the check although no answer
    /// came back: the call timed out, so it may have arrived. A call that did not get
    /// through (refused, reset, a restoring owner's refusal) charged nothing there.
    /// (A reset can cut a call the owner already decided; an owner that died with it
    /// lost that charge, so counting it on the successor again is what it should be.)
    pub fn may_have_charged(&self) -> bool {
        matches!(self, ForwardError::Timeout(_))
    }
}

/// The coordinator's answer to a rules write.
#[derive(Debug, Clone)]
pub struct WriteOutcome {
    /// What it wrote.
    pub written: Written,
    /// The document it now enforces, canonical JSON.
    pub document: String,
}

/// Why a rules write sent to the coordinator did not succeed.
#[derive(Debug)]
pub enum RemoteWriteError {
    /// The coordinator refused it (nothing changed there).
    Refused(Refusal, String),
    /// It could not be asked (or did not answer): nothing is known to have changed.
    Failed(ForwardError),
}

/// Why one client's counters could not be read or reset.
#[derive(Debug, thiserror::Error)]
pub enum CountersError {
    /// The owner refused the query (a key, route or tier outside a check's bounds):
    /// nothing was read or changed.
    #[error("refused by the owner: {0}")]
    Refused(String),
    /// The owner could not be asked, or did not answer in time (a reset may or may not
    /// have happened: read the counters again).
    #[error("{0}")]
    Failed(ForwardError),
    /// This node's shard could not answer (shutting down).
    #[error("{0}")]
    Shard(#[from] crate::shard::ShardError),
    /// The ring is empty: no node owns the key.
    #[error("no member owns the key (the ring is empty)")]
    NoOwner,
}

/// A peer's rule set as it sent it, not yet checked.
#[derive(Debug, Clone)]
pub struct PulledRules {
    /// Where the peer's rules come from (`None`: a source this node does not know).
    pub source: Option<RulesSource>,
    /// The stamp it claims.
    pub stamp: Stamp,
    /// The document, canonical JSON.
    pub document: String,
}

#[cfg(test)]
mod tests {
    //! The batcher and the session driven together, as the shell (or a simulator) does.

    use tokio::time::Instant;

    use super::batcher::{Batcher, Next, Queued};
    use super::session::{Answered, Delivery, Route, Session};
    use super::*;

    /// A queued check: its caller's name and deadline.
    #[derive(Debug, Clone, Copy, PartialEq)]
    struct Check(&'static str, Instant);

    impl Queued for Check {
        fn deadline(&self) -> Instant {
            self.1
        }
        fn gave_up(&self) -> bool {
            false
        }
    }

    /// An answer with one outcome per check.
    #[derive(Debug)]
    struct Answer(usize);

    impl Answered for Answer {
        fn outcomes(&self) -> usize {
            self.0
        }
    }

    /// Cut a batch and hand it to the session: its route and its callers.
    fn send(b: &mut Batcher<Check>, s: &mut Session<&'static str>, now: Instant) -> Route {
        let (deadline, batch) = b.take().expect("a batch");
        let replies: Vec<&'static str> = batch.map(|c| c.0).collect();
        s.send(now, replies, deadline)
    }

    #[test]
    fn an_owner_that_never_answers_holds_up_the_next_batch_only_until_the_deadline() {
        let t = Instant::now();
        let timeout = Duration::from_millis(250);
        let mut b = Batcher::new(100, 1, Duration::ZERO);
        let mut s = Session::new("owner".into(), Duration::from_secs(15), false);

        b.push(Check("a", t + timeout)).unwrap();
        assert_eq!(b.next(t, s.in_flight()), Next::Send);
        let first = send(&mut b, &mut s, t);
        assert!(matches!(
            first,
            Route::Stream {
                call: 0,
                open: true,
                ..
            }
        ));

        // Two more checks queue behind the unanswered batch.
        let later = t + Duration::from_millis(10);
        b.push(Check("b", later + timeout)).unwrap();
        b.push(Check("c", later + timeout)).unwrap();
        assert_eq!(b.next(later, s.in_flight()), Next::WaitSlot);
        assert_eq!(s.next_deadline(), Some(t + timeout), "the timer to arm");

        // At the deadline the first batch fails and its slot is free: the two queued
        // checks leave together on the same stream.
        let due = t + timeout;
        let failed = s.expire(due).expect("the first batch is due");
        assert_eq!(failed.batches, vec![vec!["a"]]);
        assert_eq!(failed.error, ForwardError::Timeout("owner".into()));
        assert_eq!(b.next(due, s.in_flight()), Next::Send);
        let second = send(&mut b, &mut s, due);
        assert_eq!(
            second,
            Route::Stream {
                stream: 0,
                call: 1,
                open: false
            }
        );

        // The first batch's answer arrives late and is ignored; the second's is delivered.
        assert!(s.answer(0, Ok(Answer(1))).is_none());
        match s.answer(1, Ok(Answer(2))) {
            Some(Delivery::Answer { replies, .. }) => assert_eq!(replies, vec!["b", "c"]),
            other => panic!("{other:?}"),
        }
        assert_eq!(b.next(due, s.in_flight()), Next::Idle);
    }
}
