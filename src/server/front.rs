//! What every public front end does around its mapping, written once: each decided
//! call is timed into the front end's latency histogram, and a bulk call holds room in
//! the node's unsent-answer budget ([`super::answer_budget`]) before anything of it is
//! decided.

use std::time::Instant;

use metrics::Histogram;
use tonic::{Response, Status};

use super::answer_budget::{over_budget, AnswerBudget, HeldAnswer};

/// The shared part of a public front end: its latency histogram and the answer budget.
#[derive(Debug, Clone)]
pub struct Front {
    latency: Histogram,
    answers: AnswerBudget,
}

impl Front {
    /// A front end timing its calls into the histogram `latency`, with a budget of its
    /// own until [`Front::with_answer_budget`] shares the node's.
    pub fn new(latency: &'static str) -> Self {
        Self {
            latency: metrics::histogram!(latency),
            answers: AnswerBudget::default(),
        }
    }

    /// Share `answers`, the node-wide budget of unsent bulk answers, with the node's
    /// other bulk front ends.
    pub fn with_answer_budget(mut self, answers: AnswerBudget) -> Self {
        self.answers = answers;
        self
    }

    /// Start timing one call. The caller awaits its decision in its own body and hands
    /// the answer to [`Timed::answered`]: wrapping the decision's future instead would
    /// store it twice in the call's boxed future (~2 KB more allocated per call).
    pub fn start(&self) -> Timed<'_> {
        Timed {
            front: self,
            started: Instant::now(),
        }
    }

    /// Room for a bulk call answering `items` items in the unsent-answer budget, taken
    /// before anything is decided: over budget, the call is refused and nothing is charged.
    pub fn hold(&self, items: usize) -> Result<HeldAnswer, Status> {
        self.answers
            .try_hold(items)
            .ok_or_else(|| over_budget(items, &self.answers))
    }
}

/// One call being timed (see [`Front::start`]).
#[derive(Debug)]
pub struct Timed<'a> {
    front: &'a Front,
    started: Instant,
}

impl Timed<'_> {
    /// The call decided: its time is recorded (a refusal is not a decision, so a call
    /// that never gets here is not) and its answer becomes the response.
    pub fn answered<T>(self, answer: T) -> Response<T> {
        self.front
            .latency
            .record(self.started.elapsed().as_secs_f64());
        Response::new(answer)
    }

    /// As [`Timed::answered`], the response holding `held` until its body is sent.
    pub fn answered_holding<T>(self, answer: T, held: HeldAnswer) -> Response<T> {
        let mut response = self.answered(answer);
        response.extensions_mut().insert(held);
        response
    }
}
