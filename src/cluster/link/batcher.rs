//! Checks queued for one peer, cut into batches: a plain struct with no task, channel or
//! clock inside. The shell fills its queue, asks [`Batcher::next`] what to do given the
//! time and how many batches are out, and sends what [`Batcher::take`] hands it.
//!
//! The rules: a batch leaves as soon as one check is queued and an in-flight slot is
//! free (an idle link adds no wait); while `max_in_flight` batches are out, checks queue
//! and leave together once a slot frees, so batches grow with the load; with a
//! `flush_delay`, a batch that is not full waits that long (from when it could leave)
//! for more; and a check whose caller already gave up is left out, since charging it on
//! the owner would count an admission nobody made.

use std::time::Duration;

use tokio::time::Instant;

/// What the batcher needs to know of a queued check.
pub trait Queued {
    /// When its caller stops waiting.
    fn deadline(&self) -> Instant;
    /// Whether its caller already gave up (answered from its fallback).
    fn gave_up(&self) -> bool;
}

/// What the shell should do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Nothing queued: wait for a check.
    Idle,
    /// Checks queued but every in-flight slot taken: wait for one to free (an answer, a
    /// failure or a batch's deadline), taking more checks meanwhile.
    WaitSlot,
    /// Wait for more checks until then (the flush delay), then send.
    FlushAt(Instant),
    /// Send now: call [`Batcher::take`].
    Send,
}

/// Checks queued for one peer, and when to cut them into a batch.
#[derive(Debug)]
pub struct Batcher<P> {
    /// One buffer for every batch: a queued check is a few hundred bytes, and a buffer
    /// per batch was the largest allocation of a forwarded check.
    queued: Vec<P>,
    max_batch: usize,
    max_in_flight: usize,
    flush_delay: Duration,
    /// When the batch being filled leaves at the latest (set once it could leave).
    flush_at: Option<Instant>,
}

impl<P: Queued> Batcher<P> {
    /// Batches of at most `max_batch` checks (at least 1), at most `max_in_flight` out
    /// at once (0: no limit), each waiting up to `flush_delay` for more checks.
    pub fn new(max_batch: usize, max_in_flight: usize, flush_delay: Duration) -> Self {
        Self {
            queued: Vec::with_capacity(64),
            max_batch: max_batch.max(1),
            max_in_flight,
            flush_delay,
            flush_at: None,
        }
    }

    /// How many more checks the next batch can take.
    pub fn room(&self) -> usize {
        self.max_batch.saturating_sub(self.queued.len())
    }

    /// The queue itself, for a shell that fills it in place (e.g. tokio's `recv_many`
    /// with [`Batcher::room`] as the limit): no copy per check.
    pub fn queue(&mut self) -> &mut Vec<P> {
        &mut self.queued
    }

    /// Queue one check; handed back when the batch is full.
    pub fn push(&mut self, check: P) -> Result<(), P> {
        if self.room() == 0 {
            return Err(check);
        }
        self.queued.push(check);
        Ok(())
    }

    /// What to do at `now` with `in_flight` batches out.
    pub fn next(&mut self, now: Instant, in_flight: usize) -> Next {
        if self.queued.is_empty() {
            self.flush_at = None;
            return Next::Idle;
        }
        if self.max_in_flight > 0 && in_flight >= self.max_in_flight {
            return Next::WaitSlot;
        }
        if self.flush_delay.is_zero() || self.room() == 0 {
            return Next::Send;
        }
        let at = *self.flush_at.get_or_insert(now + self.flush_delay);
        if now < at {
            Next::FlushAt(at)
        } else {
            Next::Send
        }
    }

    /// The batch to send: the queued checks whose caller still waits, and its deadline
    /// (its most urgent check's). `None` if every caller gave up.
    pub fn take(&mut self) -> Option<(Instant, std::vec::Drain<'_, P>)> {
        self.flush_at = None;
        self.queued.retain(|p| !p.gave_up());
        let deadline = self.queued.iter().map(Queued::deadline).min()?;
        Some((deadline, self.queued.drain(..)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A queued check: its deadline and whether its caller gave up.
    #[derive(Debug, Clone, Copy, PartialEq)]
    struct Check(Instant, bool);

    impl Queued for Check {
        fn deadline(&self) -> Instant {
            self.0
        }
        fn gave_up(&self) -> bool {
            self.1
        }
    }

    fn at(ms: u64, origin: Instant) -> Instant {
        origin + Duration::from_millis(ms)
    }

    #[test]
    fn an_idle_link_sends_a_check_at_once() {
        let t = Instant::now();
        let mut b = Batcher::new(10, 1, Duration::ZERO);
        assert_eq!(b.next(t, 0), Next::Idle);
        b.push(Check(at(250, t), false)).unwrap();
        assert_eq!(b.next(t, 0), Next::Send);
        let (deadline, batch) = b.take().unwrap();
        assert_eq!(deadline, at(250, t));
        assert_eq!(batch.count(), 1);
        assert_eq!(b.next(t, 1), Next::Idle);
    }

    #[test]
    fn checks_wait_for_a_slot_and_then_leave_together() {
        let t = Instant::now();
        let mut b = Batcher::new(10, 2, Duration::ZERO);
        for i in 0..3 {
            b.push(Check(at(100 + i, t), false)).unwrap();
        }
        assert_eq!(b.next(t, 2), Next::WaitSlot);
        b.push(Check(at(50, t), false)).unwrap();
        assert_eq!(b.next(t, 1), Next::Send, "a slot freed");
        let (deadline, batch) = b.take().unwrap();
        assert_eq!(deadline, at(50, t), "the most urgent check's deadline");
        assert_eq!(batch.count(), 4);
    }

    #[test]
    fn no_in_flight_limit_never_waits_for_a_slot() {
        let t = Instant::now();
        let mut b = Batcher::new(10, 0, Duration::ZERO);
        b.push(Check(at(1, t), false)).unwrap();
        assert_eq!(b.next(t, 1_000), Next::Send);
    }

    #[test]
    fn a_full_batch_takes_no_more_checks_and_leaves_without_its_flush_delay() {
        let t = Instant::now();
        let mut b = Batcher::new(2, 1, Duration::from_millis(5));
        b.push(Check(at(9, t), false)).unwrap();
        assert_eq!(b.room(), 1);
        b.push(Check(at(9, t), false)).unwrap();
        assert_eq!(b.room(), 0);
        assert!(b.push(Check(at(9, t), false)).is_err());
        assert_eq!(b.next(t, 0), Next::Send);
    }

    #[test]
    fn the_flush_delay_starts_when_a_slot_is_free_and_ends_in_a_send() {
        let t = Instant::now();
        let mut b = Batcher::new(10, 1, Duration::from_millis(5));
        b.push(Check(at(100, t), false)).unwrap();
        assert_eq!(b.next(t, 1), Next::WaitSlot, "no flush timer while blocked");
        let free = at(20, t);
        assert_eq!(b.next(free, 0), Next::FlushAt(at(25, t)));
        b.push(Check(at(100, t), false)).unwrap();
        assert_eq!(b.next(at(22, t), 0), Next::FlushAt(at(25, t)), "same timer");
        assert_eq!(b.next(at(25, t), 0), Next::Send);
        assert_eq!(b.take().unwrap().1.count(), 2);
        b.push(Check(at(100, t), false)).unwrap();
        assert_eq!(
            b.next(at(30, t), 0),
            Next::FlushAt(at(35, t)),
            "a new batch, a new timer"
        );
    }

    #[test]
    fn checks_whose_caller_gave_up_are_left_out_of_the_batch() {
        let t = Instant::now();
        let mut b = Batcher::new(10, 1, Duration::ZERO);
        b.push(Check(at(10, t), true)).unwrap();
        b.push(Check(at(30, t), false)).unwrap();
        let (deadline, batch) = b.take().unwrap();
        assert_eq!(deadline, at(30, t), "the given-up check does not set it");
        assert_eq!(batch.collect::<Vec<_>>(), vec![Check(at(30, t), false)]);
        b.push(Check(at(10, t), true)).unwrap();
        assert!(b.take().is_none(), "nothing left to send");
        assert_eq!(b.next(t, 0), Next::Idle);
    }
}
