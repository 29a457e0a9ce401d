//! What every public front end does around its mapping, written once: each decided
//! call is timed into the front end's latency histogram, and a bulk call holds room in
//! the node's unsent-answer budget ([`super::answer_budget`]) before anything of it is
//! decided.

use std::future::Future;
use std::time::Instant;

use metrics::Histogram;
use tonic::{Response, Status};

use super::answer_budget::{over_budget, AnswerBudget};

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

    /// Decide one call: `decide`'s time is recorded when it answers (a refusal is not
    /// a decision), and its answer is the response.
    pub async fn answer<T, E>(
        &self,
        decide: impl Future<Output = Result<T, E>>,
    ) -> Result<Response<T>, Status>
    where
        Status: From<E>,
    {
        let started = Instant::now();
        let answer = decide.await?;
        self.latency.record(started.elapsed().as_secs_f64());
        Ok(Response::new(answer))
    }

    /// Decide one bulk call answering `items` items: over budget, it is refused before
    /// anything is decided (nothing is charged); else as [`Front::answer`], the response
    /// holding its items until its body is sent.
    pub async fn bulk_answer<T, E>(
        &self,
        items: usize,
        decide: impl Future<Output = Result<T, E>>,
    ) -> Result<Response<T>, Status>
    where
        Status: From<E>,
    {
        let held = self
            .answers
            .try_hold(items)
            .ok_or_else(|| over_budget(items, &self.answers))?;
        let mut answer = self.answer(decide).await?;
        answer.extensions_mut().insert(held);
        Ok(answer)
    }
}
