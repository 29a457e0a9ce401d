//! Serving one `Peer/ForwardStream`: the answers as the stream's response body.
//!
//! How much of a stream the node takes on is a plain struct, [`Intake`]: calls are read
//! while fewer than [`STREAM_IN_FLIGHT`] are being decided, and not at all once the
//! sender closed its side, the stream broke or the node is stopping; the body ends once
//! nothing more is read and every call taken is answered. [`ForwardAnswers`] is the
//! shell that polls the calls, the decisions and the shutdown and asks it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::stream::{FuturesUnordered, StreamExt};
use tonic::Status;

use super::PeerService;
use crate::proto::peer::{ForwardAnswer, ForwardCall};

/// Calls of one `ForwardStream` decided at once. A member keeps at most its
/// `--forward-max-in-flight` batches out per peer (default 1), so this only bounds what
/// a misbehaving sender can make the node hold. With a sender that reads no answers, the
/// decided calls are these plus the answers tonic encodes into one body chunk (it stops
/// at 32 KiB) before flow control stops the stream: then the body is not polled, no
/// call is read, and nothing more is charged.
pub const STREAM_IN_FLIGHT: usize = 16;

/// How much of one stream is taken on: whether its calls are still read, and how many
/// taken calls are not answered yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Intake {
    reading: bool,
    deciding: usize,
    max: usize,
}

impl Intake {
    /// A new stream, deciding at most `max` calls at once (at least 1).
    pub fn new(max: usize) -> Self {
        Self {
            reading: true,
            deciding: 0,
            max: max.max(1),
        }
    }

    /// Whether to read the next call now: the stream is open and a decision slot free.
    /// While this is false the stream is not read, and HTTP/2 flow control holds its
    /// sender.
    pub fn may_read(&self) -> bool {
        self.reading && self.deciding < self.max
    }

    /// Whether calls are still read at all.
    pub fn is_reading(&self) -> bool {
        self.reading
    }

    /// A call was read: it is being decided.
    pub fn took(&mut self) {
        self.deciding += 1;
    }

    /// A call was answered: its slot is free.
    pub fn answered(&mut self) {
        self.deciding = self.deciding.saturating_sub(1);
    }

    /// No more calls are read: the sender closed its side, the stream broke, or the
    /// node is stopping. The calls taken are still answered.
    pub fn stop(&mut self) {
        self.reading = false;
    }

    /// Whether the body is over: nothing more is read and every call taken answered.
    pub fn finished(&self) -> bool {
        !self.reading && self.deciding == 0
    }
}

/// The answers of one `ForwardStream`, as its response body: polling it reads the
/// calls, decides them (as [`Intake`] allows) and yields each answer as soon as it is
/// ready. The body is polled by the server's own task for the stream, so a batch costs
/// no task or channel of ours.
///
/// `C` is where the calls come from: the HTTP/2 stream's messages, or a framed
/// connection's frames (`peer::frames`); an error from it ends the reading, like a
/// broken stream.
pub struct ForwardAnswers<C = tonic::Streaming<ForwardCall>> {
    service: Arc<PeerService>,
    calls: C,
    pending: FuturesUnordered<Pin<Box<dyn Future<Output = ForwardAnswer> + Send>>>,
    intake: Intake,
    shutdown: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
}

impl<C> ForwardAnswers<C> {
    /// The body answering `calls` with `service`, ending early on the service's shutdown.
    pub(super) fn new(service: Arc<PeerService>, calls: C) -> Self {
        let shutdown = Box::pin(service.shutdown.clone().cancelled_owned());
        Self {
            service,
            calls,
            pending: FuturesUnordered::new(),
            intake: Intake::new(STREAM_IN_FLIGHT),
            shutdown,
        }
    }
}

impl<C, E> futures_util::Stream for ForwardAnswers<C>
where
    C: futures_util::Stream<Item = Result<ForwardCall, E>> + Unpin,
{
    type Item = Result<ForwardAnswer, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.intake.is_reading() && this.shutdown.as_mut().poll(cx).is_ready() {
            this.intake.stop();
        }
        while this.intake.may_read() {
            match Pin::new(&mut this.calls).poll_next(cx) {
                Poll::Ready(Some(Ok(call))) => {
                    let service = this.service.clone();
                    this.pending.push(Box::pin(service.answer(call)));
                    this.intake.took();
                }
                // The sender closed its side, or the stream broke.
                Poll::Ready(Some(Err(_)) | None) => this.intake.stop(),
                Poll::Pending => break,
            }
        }
        match this.pending.poll_next_unpin(cx) {
            Poll::Ready(Some(answer)) => {
                this.intake.answered();
                Poll::Ready(Some(Ok(answer)))
            }
            Poll::Ready(None) if this.intake.finished() => Poll::Ready(None),
            // Nothing pending, and the calls (or the shutdown) will wake us.
            Poll::Ready(None) | Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sender_that_reads_no_answers_gets_at_most_the_bound_decided() {
        let mut intake = Intake::new(STREAM_IN_FLIGHT);
        let mut taken = 0;
        while intake.may_read() {
            intake.took();
            taken += 1;
        }
        assert_eq!(taken, STREAM_IN_FLIGHT);
        intake.answered();
        assert!(intake.may_read(), "an answer frees one slot");
        intake.took();
        assert!(!intake.may_read());
    }

    #[test]
    fn a_closed_stream_reads_nothing_more_and_ends_once_every_call_taken_is_answered() {
        let mut intake = Intake::new(4);
        intake.took();
        intake.took();
        intake.stop();
        assert!(!intake.may_read() && !intake.is_reading());
        assert!(!intake.finished(), "two calls still being decided");
        intake.answered();
        assert!(!intake.finished());
        intake.answered();
        assert!(intake.finished());
    }

    #[test]
    fn an_idle_open_stream_is_not_finished_and_a_zero_bound_still_reads_one() {
        let intake = Intake::new(0);
        assert!(intake.may_read());
        assert!(!intake.finished());
    }
}
