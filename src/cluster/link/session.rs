//! The batches sent to one peer and not answered yet: a plain struct with no task,
//! channel, socket or clock inside (the client side of `Peer/ForwardStream`).
//!
//! Each batch gets a call number and waits with its callers' reply handles (`R`) until
//! its answer comes back, the stream it travelled on closes, or its deadline passes;
//! whichever comes first decides its callers' answers, and whatever comes later for it
//! is ignored. Every batch waiting holds one in-flight slot ([`Session::in_flight`]).
//!
//! Batches go on the current stream, replaced when it broke or is older than
//! `max_age` (the old one still delivers what it carries), or as unary calls once the
//! peer turned out not to know the stream. The shell owns the streams themselves: when
//! [`Session::send`] says `open`, it opens stream `stream` and sends on it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::ForwardError;

/// An owner's answer to a batch, as far as the session needs to know it.
pub trait Answered {
    /// How many outcomes it carries (one per check, in order, or the batch fails).
    fn outcomes(&self) -> usize;
}

/// Where a batch goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// As its own unary call, numbered `call`.
    Unary {
        /// The batch's number, for [`Session::answer`].
        call: u64,
    },
    /// On stream `stream` as call `call`; `open`: the shell must open that stream first
    /// (dropping its sender to the previous one, which then ends once answered).
    Stream {
        /// The stream's number, for [`Session::close`].
        stream: u64,
        /// The batch's number on it.
        call: u64,
        /// A new stream.
        open: bool,
    },
}

/// What one batch's callers get.
#[derive(Debug)]
pub enum Delivery<R, A> {
    /// The owner's answer, one outcome per reply in order.
    Answer {
        /// The batch's callers.
        replies: Vec<R>,
        /// The answer.
        answer: A,
    },
    /// No answer: every caller gets `error`.
    Fail {
        /// The batch's callers.
        replies: Vec<R>,
        /// Why.
        error: ForwardError,
    },
}

/// Batches that failed together (a stream closed, deadlines passed, shutdown), in the
/// order they were sent.
#[derive(Debug)]
pub struct Failed<R> {
    /// Every caller of these batches gets it.
    pub error: ForwardError,
    /// Each failed batch's callers.
    pub batches: Vec<Vec<R>>,
}

#[derive(Debug)]
struct Open {
    id: u64,
    opened: Instant,
}

#[derive(Debug)]
struct Waiting<R> {
    /// The stream it went on (`None`: a unary call).
    stream: Option<u64>,
    replies: Vec<R>,
    deadline: Instant,
}

/// One peer's batches in flight and the stream they go on.
#[derive(Debug)]
pub struct Session<R> {
    peer: Arc<str>,
    max_age: Duration,
    /// The peer does not know the stream: every batch is a unary call.
    unary: bool,
    /// Streams are carried as framed connections (`link::frames`) rather than HTTP/2
    /// streams, until the peer turns out not to speak them.
    framed: bool,
    current: Option<Open>,
    next_stream: u64,
    next_call: u64,
    waiting: HashMap<u64, Waiting<R>>,
}

impl<R> Session<R> {
    /// The session of the link to `peer`, whose streams are replaced at `max_age`;
    /// `unary`: send unary calls from the start (`--forward-unary`).
    pub fn new(peer: Arc<str>, max_age: Duration, unary: bool) -> Self {
        Self {
            peer,
            max_age,
            unary,
            framed: false,
            current: None,
            next_stream: 0,
            next_call: 0,
            waiting: HashMap::new(),
        }
    }

    /// The peer's node id, as the link names it in errors.
    pub fn peer(&self) -> &Arc<str> {
        &self.peer
    }

    /// Whether batches go as unary calls.
    pub fn is_unary(&self) -> bool {
        self.unary
    }

    /// This session carrying its streams as framed connections (`link::frames`) while
    /// the peer speaks them; `false` keeps HTTP/2 streams.
    pub fn with_frames(mut self, framed: bool) -> Self {
        self.framed = framed;
        self
    }

    /// Whether the stream to open next is a framed connection (else an HTTP/2 stream).
    pub fn is_framed(&self) -> bool {
        self.framed
    }

    /// Batches sent and not answered, failed or due yet: the slots they hold.
    pub fn in_flight(&self) -> usize {
        self.waiting.len()
    }

    /// When the most urgent waiting batch is due: the timer to arm.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.waiting.values().map(|w| w.deadline).min()
    }

    /// Number a batch whose callers are `replies` and say where it goes; it waits until
    /// answered, failed or `deadline`.
    pub fn send(&mut self, now: Instant, replies: Vec<R>, deadline: Instant) -> Route {
        let call = self.next_call;
        self.next_call += 1;
        if self.unary {
            self.wait(call, None, replies, deadline);
            return Route::Unary { call };
        }
        let (stream, open) = self.stream_at(now);
        self.wait(call, Some(stream), replies, deadline);
        Route::Stream { stream, call, open }
    }

    fn wait(&mut self, call: u64, stream: Option<u64>, replies: Vec<R>, deadline: Instant) {
        let waiting = Waiting {
            stream,
            replies,
            deadline,
        };
        self.waiting.insert(call, waiting);
    }

    /// The stream to send on at `now`, and whether it is a new one.
    fn stream_at(&mut self, now: Instant) -> (u64, bool) {
        if let Some(open) = &self.current {
            if now.saturating_duration_since(open.opened) < self.max_age {
                return (open.id, false);
            }
        }
        let id = self.next_stream;
        self.next_stream += 1;
        self.current = Some(Open { id, opened: now });
        (id, true)
    }

    /// Batch `call`'s stream turned out closed before the batch went out (its driver
    /// ended between two batches): nothing was sent, so it goes on a fresh stream.
    /// `None` for a call not waiting on a stream.
    pub fn reroute(&mut self, call: u64, now: Instant) -> Option<Route> {
        let stream = self.waiting.get(&call)?.stream?;
        if self.current.as_ref().is_some_and(|o| o.id == stream) {
            self.current = None;
        }
        let (stream, open) = self.stream_at(now);
        self.waiting.get_mut(&call)?.stream = Some(stream);
        Some(Route::Stream { stream, call, open })
    }

    /// Batch `call` could not be sent (the stream's queue is full, or it is closed
    /// again): its callers, to fail with the shell's reason. Its slot is free.
    pub fn unsent(&mut self, call: u64) -> Option<Vec<R>> {
        self.waiting.remove(&call).map(|w| w.replies)
    }

    /// The owner answered batch `call` (or its unary call failed): what its callers get.
    /// `None` for a call no longer waiting (late: failed or due already) or unknown.
    /// An answer whose number of outcomes is not the batch's fails the batch.
    pub fn answer<A: Answered>(
        &mut self,
        call: u64,
        result: Result<A, ForwardError>,
    ) -> Option<Delivery<R, A>> {
        let replies = self.waiting.remove(&call)?.replies;
        Some(match result {
            Ok(answer) if answer.outcomes() == replies.len() => {
                Delivery::Answer { replies, answer }
            }
            Ok(answer) => Delivery::Fail {
                error: ForwardError::Unreachable(
                    self.peer.to_string(),
                    format!("{} answers for {} checks", answer.outcomes(), replies.len()),
                ),
                replies,
            },
            Err(error) => Delivery::Fail { replies, error },
        })
    }

    /// Stream `stream` ended (broke, was refused, the owner ended it, it did not open in
    /// time, or the link was replaced and its patience ran out): its batches fail with
    /// `why`, and the next batch opens a new stream.
    pub fn close(&mut self, stream: u64, why: &str) -> Option<Failed<R>> {
        if self.current.as_ref().is_some_and(|o| o.id == stream) {
            self.current = None;
        }
        self.fail_where(
            |w| w.stream == Some(stream),
            |peer| ForwardError::Unreachable(peer.to_string(), why.to_string()),
        )
    }

    /// The peer refused stream `stream` as unknown (`UNIMPLEMENTED`: an older build):
    /// batches go as unary calls from now on; the batches on it fail (their checks fall
    /// back), as on any closed stream.
    pub fn not_streamed(&mut self, stream: u64, why: &str) -> Option<Failed<R>> {
        self.unary = true;
        self.close(stream, why)
    }

    /// The peer closed framed connection `stream` before welcoming it (an older build
    /// that does not know frames): streams are HTTP/2 streams from now on; the batches
    /// on it fail (their checks fall back), as on any closed stream.
    pub fn not_framed(&mut self, stream: u64, why: &str) -> Option<Failed<R>> {
        self.framed = false;
        self.close(stream, why)
    }

    /// Fail the batches due at `now` (their callers have stopped waiting), so their
    /// in-flight slots are free even if the peer never answers.
    pub fn expire(&mut self, now: Instant) -> Option<Failed<R>> {
        self.fail_where(
            |w| w.deadline <= now,
            |peer| ForwardError::Timeout(peer.to_string()),
        )
    }

    /// The link was replaced: no batch goes on its current stream any more. What is in
    /// flight still gets its answers (the old streams keep delivering until the shell
    /// closes them).
    pub fn retire(&mut self) {
        self.current = None;
    }

    /// The node is stopping: every waiting batch fails.
    pub fn shutdown(&mut self) -> Option<Failed<R>> {
        self.current = None;
        self.fail_where(
            |_| true,
            |peer| ForwardError::Unreachable(peer.to_string(), "node shutting down".into()),
        )
    }

    /// Remove the batches `which` picks, oldest call first, failing them with `error`.
    fn fail_where(
        &mut self,
        which: impl Fn(&Waiting<R>) -> bool,
        error: impl FnOnce(&str) -> ForwardError,
    ) -> Option<Failed<R>> {
        if !self.waiting.values().any(&which) {
            return None;
        }
        let mut failed = Vec::new();
        self.waiting.retain(|&call, w| {
            if which(w) {
                failed.push((call, std::mem::take(&mut w.replies)));
                return false;
            }
            true
        });
        failed.sort_unstable_by_key(|(call, _)| *call);
        Some(Failed {
            error: error(&self.peer),
            batches: failed.into_iter().map(|(_, replies)| replies).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer with this many outcomes.
    #[derive(Debug)]
    struct Outcomes(usize);

    impl Answered for Outcomes {
        fn outcomes(&self) -> usize {
            self.0
        }
    }

    fn ms(t: Instant, ms: u64) -> Instant {
        t + Duration::from_millis(ms)
    }

    fn session() -> Session<&'static str> {
        Session::new("owner".into(), Duration::from_secs(15), false)
    }

    fn call_of(route: Route) -> u64 {
        match route {
            Route::Unary { call } | Route::Stream { call, .. } => call,
        }
    }

    #[test]
    fn the_first_batch_opens_a_stream_and_later_ones_share_it_with_new_numbers() {
        let t = Instant::now();
        let mut s = session();
        let first = s.send(t, vec!["a"], ms(t, 250));
        assert_eq!(
            first,
            Route::Stream {
                stream: 0,
                call: 0,
                open: true
            }
        );
        let second = s.send(ms(t, 1), vec!["b"], ms(t, 251));
        assert_eq!(
            second,
            Route::Stream {
                stream: 0,
                call: 1,
                open: false
            }
        );
        assert_eq!(s.in_flight(), 2);
        assert_eq!(s.next_deadline(), Some(ms(t, 250)));
    }

    #[test]
    fn a_stream_is_replaced_at_its_max_age_and_the_old_one_still_delivers() {
        let t = Instant::now();
        let mut s = Session::new("owner".into(), Duration::from_millis(20), false);
        let old = call_of(s.send(t, vec!["a"], ms(t, 250)));
        let next = s.send(ms(t, 20), vec!["b"], ms(t, 270));
        assert_eq!(
            next,
            Route::Stream {
                stream: 1,
                call: 1,
                open: true
            }
        );
        match s.answer(old, Ok(Outcomes(1))) {
            Some(Delivery::Answer { replies, .. }) => assert_eq!(replies, vec!["a"]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_answer_goes_to_its_batch_and_a_late_or_unknown_one_is_ignored() {
        let t = Instant::now();
        let mut s = session();
        let a = call_of(s.send(t, vec!["a1", "a2"], ms(t, 250)));
        let b = call_of(s.send(t, vec!["b"], ms(t, 250)));
        match s.answer(b, Ok(Outcomes(1))) {
            Some(Delivery::Answer { replies, answer }) => {
                assert_eq!(replies, vec!["b"]);
                assert_eq!(answer.0, 1);
            }
            other => panic!("{other:?}"),
        }
        assert!(s.answer(b, Ok(Outcomes(1))).is_none(), "answered already");
        assert!(s.answer(99, Ok(Outcomes(1))).is_none(), "never sent");
        assert_eq!(s.in_flight(), 1);
        assert!(s.expire(ms(t, 250)).is_some());
        assert!(s.answer(a, Ok(Outcomes(2))).is_none(), "due already");
        assert_eq!(s.in_flight(), 0);
    }

    #[test]
    fn a_wrong_number_of_outcomes_fails_the_batch() {
        let t = Instant::now();
        let mut s = session();
        let a = call_of(s.send(t, vec!["a1", "a2"], ms(t, 250)));
        match s.answer(a, Ok(Outcomes(1))) {
            Some(Delivery::Fail { replies, error }) => {
                assert_eq!(replies, vec!["a1", "a2"]);
                assert_eq!(
                    error,
                    ForwardError::Unreachable("owner".into(), "1 answers for 2 checks".into())
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(s.in_flight(), 0, "its slot is free");
    }

    #[test]
    fn a_failed_call_fails_its_batch_with_its_error() {
        let t = Instant::now();
        let mut s = session();
        let a = call_of(s.send(t, vec!["a"], ms(t, 250)));
        let error = ForwardError::Timeout("owner".into());
        match s.answer::<Outcomes>(a, Err(error.clone())) {
            Some(Delivery::Fail { replies, error: e }) => {
                assert_eq!((replies, e), (vec!["a"], error));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_closed_stream_fails_its_batches_only_and_the_next_batch_opens_a_new_one() {
        let t = Instant::now();
        let mut s = Session::new("owner".into(), Duration::from_millis(20), false);
        let old = call_of(s.send(t, vec!["old"], ms(t, 250)));
        s.send(ms(t, 20), vec!["b1"], ms(t, 250));
        s.send(ms(t, 21), vec!["b2"], ms(t, 250));
        let failed = s
            .close(1, "forward stream ended")
            .expect("two batches on it");
        assert_eq!(
            failed.batches,
            vec![vec!["b1"], vec!["b2"]],
            "in call order"
        );
        assert_eq!(
            failed.error,
            ForwardError::Unreachable("owner".into(), "forward stream ended".into())
        );
        assert_eq!(s.in_flight(), 1, "the old stream's batch still waits");
        assert!(s.close(1, "again").is_none());
        let next = s.send(ms(t, 22), vec!["c"], ms(t, 250));
        assert_eq!(
            next,
            Route::Stream {
                stream: 2,
                call: 3,
                open: true
            }
        );
        assert!(matches!(
            s.answer(old, Ok(Outcomes(1))),
            Some(Delivery::Answer { .. })
        ));
    }

    #[test]
    fn closing_an_old_stream_keeps_the_current_one() {
        let t = Instant::now();
        let mut s = Session::new("owner".into(), Duration::from_millis(20), false);
        s.send(t, vec!["a"], ms(t, 250));
        s.send(ms(t, 20), vec!["b"], ms(t, 250));
        assert_eq!(
            s.close(0, "forward stream ended").unwrap().batches,
            vec![vec!["a"]]
        );
        let next = s.send(ms(t, 21), vec!["c"], ms(t, 250));
        assert_eq!(
            next,
            Route::Stream {
                stream: 1,
                call: 2,
                open: false
            }
        );
    }

    #[test]
    fn batches_past_their_deadline_fail_and_free_their_slots() {
        let t = Instant::now();
        let mut s = session();
        s.send(t, vec!["a"], ms(t, 100));
        s.send(t, vec!["b"], ms(t, 200));
        assert!(s.expire(ms(t, 99)).is_none());
        let failed = s.expire(ms(t, 100)).expect("one due");
        assert_eq!(failed.batches, vec![vec!["a"]]);
        assert_eq!(failed.error, ForwardError::Timeout("owner".into()));
        assert_eq!(s.in_flight(), 1);
        assert_eq!(s.next_deadline(), Some(ms(t, 200)));
        assert!(s.expire(ms(t, 500)).is_some());
        assert_eq!(s.next_deadline(), None);
    }

    #[test]
    fn a_peer_without_the_stream_gets_unary_calls_after_the_batch_that_found_out() {
        let t = Instant::now();
        let mut s = session();
        s.send(t, vec!["a"], ms(t, 250));
        let failed = s.not_streamed(0, "not in this build").unwrap();
        assert_eq!(failed.batches, vec![vec!["a"]]);
        assert!(s.is_unary());
        let next = s.send(t, vec!["b"], ms(t, 250));
        assert_eq!(next, Route::Unary { call: 1 });
        assert_eq!(s.in_flight(), 1, "a unary call holds a slot too");
        assert!(matches!(
            s.answer(1, Ok(Outcomes(1))),
            Some(Delivery::Answer { .. })
        ));
    }

    #[test]
    fn a_peer_without_frames_gets_http2_streams_after_the_batch_that_found_out() {
        let t = Instant::now();
        let mut s = session().with_frames(true);
        assert!(s.is_framed());
        let first = s.send(t, vec!["a"], ms(t, 250));
        let failed = s
            .not_framed(0, "closed at the magic")
            .expect("the batch fails");
        assert_eq!(failed.batches, vec![vec!["a"]]);
        assert!(!s.is_framed() && !s.is_unary());
        let second = s.send(ms(t, 1), vec!["b"], ms(t, 251));
        assert_eq!(
            second,
            Route::Stream {
                stream: 1,
                call: call_of(first) + 1,
                open: true
            },
            "a new stream, now an HTTP/2 one"
        );
    }

    #[test]
    fn a_unary_session_never_opens_a_stream() {
        let t = Instant::now();
        let mut s: Session<&str> = Session::new("owner".into(), Duration::from_secs(1), true);
        assert_eq!(s.send(t, vec!["a"], ms(t, 1)), Route::Unary { call: 0 });
        assert!(s.reroute(0, t).is_none(), "a unary call has no stream");
    }

    #[test]
    fn a_batch_whose_stream_closed_before_sending_goes_on_a_fresh_one() {
        let t = Instant::now();
        let mut s = session();
        s.send(t, vec!["a"], ms(t, 250));
        let rerouted = s.reroute(0, t).unwrap();
        assert_eq!(
            rerouted,
            Route::Stream {
                stream: 1,
                call: 0,
                open: true
            }
        );
        assert!(
            s.close(0, "ended").is_none(),
            "it no longer waits on stream 0"
        );
        assert_eq!(s.close(1, "ended").unwrap().batches, vec![vec!["a"]]);
    }

    #[test]
    fn a_batch_that_cannot_be_sent_gives_its_callers_back_and_frees_its_slot() {
        let t = Instant::now();
        let mut s = session();
        s.send(t, vec!["a"], ms(t, 250));
        assert_eq!(s.unsent(0), Some(vec!["a"]));
        assert_eq!(s.in_flight(), 0);
        assert_eq!(s.unsent(0), None);
    }

    #[test]
    fn a_retired_session_opens_a_new_stream_but_still_delivers_the_old_ones_answers() {
        let t = Instant::now();
        let mut s = session();
        s.send(t, vec!["a"], ms(t, 250));
        s.retire();
        assert!(matches!(
            s.answer(0, Ok(Outcomes(1))),
            Some(Delivery::Answer { .. })
        ));
        let next = s.send(t, vec!["b"], ms(t, 250));
        assert_eq!(
            next,
            Route::Stream {
                stream: 1,
                call: 1,
                open: true
            }
        );
    }

    #[test]
    fn shutdown_fails_every_batch_streamed_or_unary() {
        let t = Instant::now();
        let mut s = session();
        s.send(t, vec!["a"], ms(t, 250));
        s.not_streamed(0, "old build");
        s.send(t, vec!["b"], ms(t, 250));
        s.send(t, vec!["c"], ms(t, 250));
        let failed = s.shutdown().unwrap();
        assert_eq!(failed.batches, vec![vec!["b"], vec!["c"]]);
        assert_eq!(
            failed.error,
            ForwardError::Unreachable("owner".into(), "node shutting down".into())
        );
        assert_eq!(s.in_flight(), 0);
        assert!(s.shutdown().is_none());
    }
}
