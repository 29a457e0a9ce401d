//! Joining two states of the same counter that saw the same admissions at different
//! moments.
//!
//! A key's successor keeps a replica of the owner's state and, while the owner cannot
//! be reached, decides checks on it. The owner's next state replaces the replica; but a
//! state the owner built before it heard of those fail-over admissions (or of a check
//! whose forward timed out, which it may or may not have charged) would take them back.
//! Both states are lower bounds of what the counter has admitted: the owner's misses
//! the fail-over admissions, the replica misses what the owner admitted since it was
//! sent. [`Limiter::join`] keeps the stricter of the two, so neither is forgotten and
//! nothing is counted twice (unlike [`Limiter::merge`], which adds two nodes' separate
//! admissions).
//!
//! The rule for every algorithm: the joined state is **at least as strict as either
//! input** and, when one input is an earlier moment of the other's history (no
//! give-back between), it **is** the later one. So a replica joined with the owner's
//! newer state is exactly that state.

use super::merge::union_logs;
use super::{
    FixedWindowState, GcraState, KeyState, Limiter, SlidingCounterState, TokenBucket,
    TokenBucketState,
};

impl Limiter {
    /// Fold `other` (a state of the same counter, from the same history) into `into`,
    /// keeping the stricter of the two per component (see the module docs).
    ///
    /// As [`Limiter::merge`]: `other` is ignored unless this limiter accepts it, and
    /// `into` becomes `other` if it is not accepted itself.
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use std::time::Duration;
    /// use ringlimit::algorithms::{FixedWindow, Limiter};
    ///
    /// let limiter = Limiter::FixedWindow(
    ///     FixedWindow::new(NonZeroU64::new(5).unwrap(), Duration::from_secs(1)).unwrap());
    /// let mut older = limiter.new_state();
    /// limiter.check(&mut older, 100, NonZeroU64::new(2).unwrap());
    /// let mut newer = older.clone();
    /// limiter.check(&mut newer, 200, NonZeroU64::new(1).unwrap());
    /// limiter.join(&mut older, newer.clone());
    /// assert_eq!(older, newer); // 3 used, not 2 + 3
    /// ```
    pub fn join(&self, into: &mut KeyState, other: KeyState) {
        if !self.accepts(&other) {
            return;
        }
        if !self.accepts(into) {
            *into = other;
            return;
        }
        match (self, into, other) {
            (Limiter::FixedWindow(_), KeyState::FixedWindow(a), KeyState::FixedWindow(b)) => {
                join_fixed_window(a, b)
            }
            (
                Limiter::SlidingWindowCounter(_),
                KeyState::SlidingWindowCounter(a),
                KeyState::SlidingWindowCounter(b),
            ) => join_sliding_counter(a, b),
            (Limiter::TokenBucket(l), KeyState::TokenBucket(a), KeyState::TokenBucket(b)) => {
                join_token_bucket(l, a, b)
            }
            (Limiter::LeakyBucket(_), KeyState::LeakyBucket(a), KeyState::LeakyBucket(b)) => {
                join_gcra(a, b)
            }
            (
                Limiter::SlidingWindowLog(l),
                KeyState::SlidingWindowLog(a),
                KeyState::SlidingWindowLog(b),
            ) => union_logs(l, a, b, u64::max),
            // Unreachable: `accepts` held for both, so both match the limiter's algorithm.
            _ => {}
        }
    }
}

/// Fixed window: the later window wins; in the same window, the larger count.
fn join_fixed_window(a: &mut FixedWindowState, b: FixedWindowState) {
    if b.idx > a.idx || (b.idx == a.idx && b.count > a.count) {
        *a = b;
    }
}

/// Sliding window counter: both rolled to the later window (as their next check would
/// roll them), then the larger of each counter.
fn join_sliding_counter(a: &mut SlidingCounterState, b: SlidingCounterState) {
    let idx = a.idx.max(b.idx);
    let (pa, ca) = super::merge::roll_counter(a, idx);
    let (pb, cb) = super::merge::roll_counter(&b, idx);
    *a = SlidingCounterState {
        idx,
        prev: pa.max(pb),
        curr: ca.max(cb),
    };
}

/// Token bucket: both refilled to the later instant, then the larger deficit.
fn join_token_bucket(l: &TokenBucket, a: &mut TokenBucketState, b: TokenBucketState) {
    let t = a.last.max(b.last);
    let deficit = super::merge::deficit_at(l, a, t).max(super::merge::deficit_at(l, &b, t));
    *a = TokenBucketState {
        // Each deficit is at most `full` (a u64): so is the larger.
        deficit: u64::try_from(deficit).unwrap_or(l.full),
        last: t,
    };
}

/// GCRA: the later theoretical arrival time and the later admission.
fn join_gcra(a: &mut GcraState, b: GcraState) {
    a.tat = a.tat.max(b.tat);
    a.last_admit = a.last_admit.max(b.last_admit);
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU64;
    use std::time::Duration;

    use proptest::prelude::*;

    use crate::algorithms::testkit::nz;
    use crate::algorithms::{FixedWindow, Gcra, Limiter, SlidingCounter, SlidingLog};

    fn limiters() -> Vec<Limiter> {
        let ms = Duration::from_millis;
        vec![
            Limiter::FixedWindow(FixedWindow::new(nz(10), ms(1000)).unwrap()),
            Limiter::SlidingWindowCounter(SlidingCounter::new(nz(10), ms(1000)).unwrap()),
            Limiter::TokenBucket(super::TokenBucket::new(nz(10), nz(5), ms(1000)).unwrap()),
            Limiter::LeakyBucket(Gcra::meter(nz(10), ms(1000), nz(4)).unwrap()),
            Limiter::SlidingWindowLog(SlidingLog::new(nz(10), ms(1000)).unwrap()),
        ]
    }

    proptest! {
        /// An earlier moment of a history joined with a later one (either way round) is
        /// the later one: a replica joined with the owner's newer state is that state.
        #[test]
        fn an_earlier_state_joined_with_a_later_one_is_the_later_one(
            steps in prop::collection::vec((0u64..400, 1u64..4), 1..40),
            cut in 0usize..40,
        ) {
            for limiter in limiters() {
                let mut state = limiter.new_state();
                let mut now = 1_000_000;
                let mut earlier = state.clone();
                for (i, &(step, cost)) in steps.iter().enumerate() {
                    if i == cut.min(steps.len() - 1) {
                        earlier = state.clone();
                    }
                    now += step;
                    limiter.check(&mut state, now, NonZeroU64::new(cost).unwrap());
                }
                let mut joined = earlier.clone();
                limiter.join(&mut joined, state.clone());
                prop_assert_eq!(&joined, &state, "{:?}", limiter);
                let mut joined = state.clone();
                limiter.join(&mut joined, earlier);
                prop_assert_eq!(&joined, &state, "{:?}", limiter);
            }
        }

        /// Two histories from one state (the owner's and the successor's fail-over
        /// admissions): the join leaves at most as many units as either.
        #[test]
        fn a_join_is_at_least_as_strict_as_either_side(
            common in prop::collection::vec((0u64..300, 1u64..4), 0..10),
            left in prop::collection::vec((0u64..300, 1u64..4), 0..10),
            right in prop::collection::vec((0u64..300, 1u64..4), 0..10),
            later in 0u64..3000,
        ) {
            for limiter in limiters() {
                let run = |state: &mut crate::algorithms::KeyState, from: u64, steps: &[(u64, u64)]| {
                    let mut now = from;
                    for &(step, cost) in steps {
                        now += step;
                        limiter.check(state, now, NonZeroU64::new(cost).unwrap());
                    }
                    now
                };
                let mut base = limiter.new_state();
                let t0 = run(&mut base, 1_000_000, &common);
                let (mut a, mut b) = (base.clone(), base);
                let ta = run(&mut a, t0, &left);
                let tb = run(&mut b, t0, &right);
                let mut joined = a.clone();
                limiter.join(&mut joined, b.clone());
                prop_assert!(limiter.accepts(&joined));
                let at = ta.max(tb) + later;
                let r = limiter.peek(&joined, at).remaining;
                prop_assert!(r <= limiter.peek(&a, at).remaining, "{:?}", limiter);
                prop_assert!(r <= limiter.peek(&b, at).remaining, "{:?}", limiter);
            }
        }
    }
}
