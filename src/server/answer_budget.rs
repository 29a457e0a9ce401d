//! A node-wide bound on bulk answers that were decided but not yet taken by their
//! connection.
//!
//! A `CheckBatch` (or Gubernator `GetRateLimits`) answer of 1,000 items is ~400 kB of
//! response held in memory until hyper writes it, and hyper writes only as fast as the
//! client's HTTP/2 window lets it. A client that opens streams and never reads (a zero
//! receive window) therefore parks one answer per stream: up to the stream cap per
//! connection (256, ~100 MB), times every connection it opens. Neither tonic nor hyper
//! offers a per-connection send budget that would stop that.
//!
//! So every bulk call first takes one permit per item from a node-wide [`AnswerBudget`]
//! (`--max-unsent-answer-items`) and holds it until its answer's body has been handed to
//! the connection in full, or dropped (the stream or connection closed). When the budget
//! is spent the call is refused **before anything is decided**: `RESOURCE_EXHAUSTED`
//! with the `overloaded` reason, nothing charged, so a gateway tries again or applies
//! its failure mode. Unary checks take no permit: their answers are a few hundred bytes
//! and bounded by the stream cap alone.
//!
//! The permit travels from the handler to the body in the response's extensions
//! ([`HeldAnswer`]); [`HoldUntilSentLayer`], on the public server, moves it into the
//! body. Answers that are read promptly give their permits back within a round trip.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Default budget: 262,144 items, about 100 MB of unsent answers node-wide. An item is
/// one answered check or descriptor (a `CheckBatch` check with three descriptors is four
/// items), or one Gubernator request.
pub const DEFAULT_MAX_UNSENT_ANSWER_ITEMS: u32 = 262_144;

/// The most items one valid bulk call answers: a full `CheckBatch` whose every check
/// carries the most descriptors. A larger call is invalid and refused as such by the
/// check layer, so it never needs more than this; the budget must hold at least this.
pub const MAX_ITEMS_PER_CALL: usize =
    crate::config::bounds::MAX_BATCH * (1 + crate::config::bounds::MAX_DESCRIPTORS);

/// The node-wide budget of unsent bulk-answer items (module docs).
#[derive(Debug, Clone)]
pub struct AnswerBudget {
    items: Arc<Semaphore>,
}

/// Permits of one bulk answer, held until its body is sent or dropped.
#[derive(Debug, Clone)]
pub struct HeldAnswer(#[allow(dead_code)] Arc<OwnedSemaphorePermit>);

impl AnswerBudget {
    /// A budget of `items` unsent answer items.
    pub fn new(items: u32) -> Self {
        Self {
            items: Arc::new(Semaphore::new(items as usize)),
        }
    }

    /// Permits for an answer of `items` items (at least one, at most
    /// [`MAX_ITEMS_PER_CALL`]: a call claiming more is invalid, and is held at that much
    /// until the check layer refuses it as such), or `None` when the budget cannot spare
    /// them now.
    pub fn try_hold(&self, items: usize) -> Option<HeldAnswer> {
        let items = u32::try_from(items.clamp(1, MAX_ITEMS_PER_CALL)).ok()?;
        self.items
            .clone()
            .try_acquire_many_owned(items)
            .ok()
            .map(|permit| HeldAnswer(Arc::new(permit)))
    }

    /// Items that could be held now.
    pub fn available(&self) -> usize {
        self.items.available_permits()
    }
}

impl Default for AnswerBudget {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_UNSENT_ANSWER_ITEMS)
    }
}

/// The refusal of a bulk call over budget: nothing was decided.
pub fn over_budget(items: usize, budget: &AnswerBudget) -> tonic::Status {
    metrics::counter!("ringlimit_refused_total", "reason" => "overloaded", "field" => "answers")
        .increment(1);
    let mut status = tonic::Status::resource_exhausted(format!(
        "node overloaded: {items} answer items would exceed the unsent-answer budget ({} free); nothing was charged, retry",
        budget.available()
    ));
    status.metadata_mut().insert(
        super::REASON_METADATA,
        tonic::metadata::MetadataValue::from_static("overloaded"),
    );
    status
}

/// Moves a response's [`HeldAnswer`] into its body (module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct HoldUntilSentLayer;

impl<S> tower_layer::Layer<S> for HoldUntilSentLayer {
    type Service = HoldUntilSent<S>;

    fn layer(&self, inner: S) -> Self::Service {
        HoldUntilSent { inner }
    }
}

/// The service of [`HoldUntilSentLayer`].
#[derive(Debug, Clone)]
pub struct HoldUntilSent<S> {
    inner: S,
}

type Held<E> = fn(
    Result<http::Response<tonic::body::Body>, E>,
) -> Result<http::Response<tonic::body::Body>, E>;

impl<S, B> tonic::codegen::Service<http::Request<B>> for HoldUntilSent<S>
where
    S: tonic::codegen::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = futures_util::future::Map<S::Future, Held<S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        use futures_util::FutureExt;
        self.inner.call(request).map(hold as Held<S::Error>)
    }
}

fn hold<E>(
    response: Result<http::Response<tonic::body::Body>, E>,
) -> Result<http::Response<tonic::body::Body>, E> {
    let mut response = response?;
    let Some(held) = response.extensions_mut().remove::<HeldAnswer>() else {
        return Ok(response);
    };
    Ok(response.map(|inner| tonic::body::Body::new(Holding { inner, _held: held })))
}

/// A body that keeps its answer's permits until it is sent in full or dropped.
struct Holding {
    inner: tonic::body::Body,
    _held: HeldAnswer,
}

impl http_body::Body for Holding {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_come_back_when_the_answer_goes() {
        let budget = AnswerBudget::new(1000);
        let a = budget.try_hold(600).expect("600 of 1000");
        assert!(budget.try_hold(600).is_none(), "over budget");
        let b = budget.try_hold(400).expect("the rest");
        assert_eq!(budget.available(), 0);
        drop(a);
        assert_eq!(budget.available(), 600);
        drop(b);
        assert_eq!(budget.available(), 1000);
        // An empty batch still holds one item; more than the budget never fits.
        assert!(budget.try_hold(0).is_some());
        assert!(budget.try_hold(1001).is_none());
        // An invalid, oversized call holds at most one valid call's worth, so with the
        // smallest budget allowed it still reaches the check layer and is refused as
        // invalid rather than "overloaded".
        let smallest = AnswerBudget::new(MAX_ITEMS_PER_CALL as u32);
        assert!(smallest.try_hold(10 * MAX_ITEMS_PER_CALL).is_some());
    }
}
