//! Sliding window counter: two counters and an exact integer estimator.

use std::num::NonZeroU64;
use std::time::Duration;

use super::{
    clamp_millis, retry_from, whole_millis, Algorithm, AlgorithmError, Decision, Millis, NEVER,
};

/// Approximately `limit` units per trailing window of `W` ms, from two counters.
///
/// The estimator assumes the previous window's traffic was spread evenly and credits the part
/// of it the trailing window still overlaps: `est = prev * (1 - f) + curr` with `f = e / W` and
/// `e` the ms elapsed in the current window. Multiplying through by `W` makes it exact in
/// integers: a request of cost `n` is admitted iff
/// `prev * (W - e) + (curr + n) * W <= limit * W` (in `u128`).
///
/// The default for large tiered quotas (error ~ `1 / (2 sqrt(L))`); use [`super::SlidingLog`] for
/// small hard limits.
///
/// Decision fields (window `k`, elapsed `e`, counters *after* the decision):
/// * `limit` = `limit`.
/// * `remaining` = `floor((limit*W - prev*(W - e) - curr*W) / W)`, the largest cost admissible now.
/// * `reset_at_ms` = when both counters have aged out: `(k + 2) * W` if `curr > 0`, else
///   `(k + 1) * W` if `prev > 0`, else now.
/// * `retry_after_ms` = exact first instant the inequality holds, in this window (as `prev`'s
///   weight decays) or the next (where `prev' = curr`, `curr' = 0`), or `(k + 2) * W`.
/// * `window_id` = `Some(k)`.
///
/// The window index never decreases and a `now` before the current window counts as its first
/// millisecond, so a backwards clock step cannot zero the counters. Within a window an earlier
/// `now` is only stricter (the previous window weighs more).
///
/// ```
/// use std::num::NonZeroU64;
/// use std::time::Duration;
/// use ringlimit::algorithms::{Algorithm, SlidingCounter, SlidingCounterState};
///
/// let sc = SlidingCounter::new(NonZeroU64::new(10).unwrap(), Duration::from_secs(10)).unwrap();
/// let mut s = SlidingCounterState::default();
/// assert!(sc.check(&mut s, 5_000, NonZeroU64::new(10).unwrap()).allowed);
/// // 2.5 s into the next window, 75% of the previous 10 still count: 7.5 + 3 > 10.
/// let d = sc.check(&mut s, 12_500, NonZeroU64::new(3).unwrap());
/// assert_eq!((d.allowed, d.remaining, d.retry_after_ms), (false, 2, 500));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlidingCounter {
    pub(super) limit: u64,
    pub(super) window_ms: u64,
}

/// Per-key sliding counter state: 24 bytes. `Default` is window 0 with both counters empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingCounterState {
    /// Newest window index seen (never decreases).
    pub(super) idx: u64,
    /// Units admitted in window `idx - 1`.
    pub(super) prev: u64,
    /// Units admitted in window `idx` (`<= limit`).
    pub(super) curr: u64,
}

impl SlidingCounter {
    /// `limit` units per trailing `window`. Rejects a window under 1 ms or with a
    /// sub-millisecond part; all products are `u128`, so no other bound is needed.
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use std::time::Duration;
    /// use ringlimit::algorithms::SlidingCounter;
    ///
    /// let hundred = NonZeroU64::new(100).unwrap();
    /// assert!(SlidingCounter::new(hundred, Duration::from_secs(60)).is_ok());
    /// assert!(SlidingCounter::new(hundred, Duration::from_micros(60_500)).is_err());
    /// ```
    pub fn new(limit: NonZeroU64, window: Duration) -> Result<Self, AlgorithmError> {
        Ok(SlidingCounter {
            limit: limit.get(),
            window_ms: whole_millis(window, "window")?,
        })
    }

    fn start(&self, idx: u64) -> u128 {
        u128::from(idx) * u128::from(self.window_ms)
    }

    /// Earliest elapsed `e` in a window with previous count `prev` at which `prev * (W - e) <=
    /// head * W`, or `None` if only the window after it will do.
    fn first_fit(&self, prev: u64, head: u64) -> Option<u128> {
        let w = u128::from(self.window_ms);
        if prev == 0 {
            return Some(0);
        }
        let e = w.saturating_sub(u128::from(head) * w / u128::from(prev));
        (e < w).then_some(e)
    }

    /// Exact first instant at which `cost` (<= limit) is admitted if nothing else arrives.
    fn admit_at(&self, state: &SlidingCounterState, cost: u64) -> u128 {
        // In the current window, if the current count leaves room at all.
        if let Some(head) = self
            .limit
            .checked_sub(state.curr)
            .and_then(|h| h.checked_sub(cost))
        {
            if let Some(e) = self.first_fit(state.prev, head) {
                return self.start(state.idx) + e;
            }
        }
        // Next window: the current count becomes the decaying previous one.
        match self.first_fit(state.curr, self.limit - cost) {
            Some(e) => self.start(state.idx) + u128::from(self.window_ms) + e,
            None => self.start(state.idx) + 2 * u128::from(self.window_ms),
        }
    }
}

impl Algorithm for SlidingCounter {
    type State = SlidingCounterState;

    /// Roll the counters to the current window (never back), then evaluate the estimator.
    fn check(&self, state: &mut SlidingCounterState, now: Millis, cost: NonZeroU64) -> Decision {
        let k = now / self.window_ms;
        if k > state.idx {
            // Only the immediately preceding window still overlaps the trailing one.
            state.prev = if k == state.idx + 1 { state.curr } else { 0 };
            state.curr = 0;
            state.idx = k;
        }
        let w = u128::from(self.window_ms);
        // A `now` before the current window is treated as its first millisecond.
        let e = u128::from(now).saturating_sub(self.start(state.idx));
        let budget = u128::from(self.limit) * w;
        let used = |s: &SlidingCounterState| {
            (u128::from(s.prev) * (w - e)).saturating_add(u128::from(s.curr) * w)
        };
        let allowed = used(state).saturating_add(u128::from(cost.get()) * w) <= budget;
        if allowed {
            state.curr += cost.get();
        }
        let retry_after_ms = if allowed {
            0
        } else if cost.get() > self.limit {
            NEVER
        } else {
            retry_from(self.admit_at(state, cost.get()), now)
        };
        let reset = if state.curr > 0 {
            self.start(state.idx) + 2 * w
        } else if state.prev > 0 {
            self.start(state.idx) + w
        } else {
            self.start(state.idx) + e
        };
        Decision {
            allowed,
            limit: self.limit,
            remaining: clamp_millis(budget.saturating_sub(used(state)) / w),
            retry_after_ms,
            reset_at_ms: clamp_millis(reset),
            window_id: Some(state.idx),
            delay_ms: 0,
        }
    }

    /// Takes the units out of whichever counter still holds `at`'s window (the current or the
    /// previous one); older windows are forgotten, so nothing is refunded for them.
    fn refund(&self, state: &mut SlidingCounterState, at: Millis, cost: NonZeroU64) {
        let a = at / self.window_ms;
        if a == state.idx {
            state.curr = state.curr.saturating_sub(cost.get());
        } else if a.checked_add(1) == Some(state.idx) {
            state.prev = state.prev.saturating_sub(cost.get());
        }
    }

    /// When both counters have aged out (an empty state is fresh from its window's start).
    fn expires_at(&self, state: &SlidingCounterState) -> Millis {
        let windows = if state.curr > 0 {
            2
        } else if state.prev > 0 {
            1
        } else {
            0
        };
        clamp_millis(self.start(state.idx) + windows * u128::from(self.window_ms))
    }

    /// The whole window's budget (a larger cost does not fit even with both counters empty).
    fn max_cost(&self) -> u64 {
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::testkit::{self, nz, Op};
    use proptest::prelude::*;

    fn counter(limit: u64, ms: u64) -> SlidingCounter {
        SlidingCounter::new(nz(limit), Duration::from_millis(ms)).unwrap()
    }

    #[test]
    fn reference_example_prev_90_curr_40_at_15_s_is_rejected_with_exact_retry() {
        let sc = counter(100, 60_000);
        let mut s = SlidingCounterState::default();
        for _ in 0..90 {
            assert!(sc.check(&mut s, 30_000, nz(1)).allowed); // previous window
        }
        // 40 more fit only once a third of the window has passed (90 * 2/3 + 40 = 100) ...
        for _ in 0..40 {
            assert!(sc.check(&mut s, 80_000, nz(1)).allowed);
        }
        assert_eq!(
            s,
            SlidingCounterState {
                idx: 1,
                prev: 90,
                curr: 40
            }
        );
        // ... so the reference's "15 s in" is reached by the clock stepping back within the window.
        let d = sc.check(&mut s, 75_000, nz(1));
        assert!(!d.allowed);
        // est = 90 * 0.75 + 40 = 107.5; the 41st fits once 90 * (1 - f) <= 59, i.e. at
        // e = 60000 - floor(59 * 60000 / 90) = 20667 ms.
        assert_eq!(d.retry_after_ms, 5_667);
        assert_eq!(d.retry_after_secs(), 6);
        assert_eq!(d.remaining, 0);
        assert_eq!(d.reset_at_ms, 180_000);
        assert!(!sc.check(&mut s.clone(), 80_666, nz(1)).allowed);
        assert!(sc.check(&mut s, 80_667, nz(1)).allowed);
    }

    #[test]
    fn retry_waits_into_the_next_window_when_the_current_count_is_full() {
        let sc = counter(10, 1_000);
        let mut s = SlidingCounterState::default();
        assert!(sc.check(&mut s, 1_000, nz(10)).allowed);
        // head < 0: wait for the next window, where 10 * (1000 - e) <= 7 * 1000 at e = 300.
        let d = sc.check(&mut s, 1_500, nz(3));
        assert_eq!((d.allowed, d.retry_after_ms), (false, 800));
        assert!(!sc.check(&mut s.clone(), 2_299, nz(3)).allowed);
        assert!(sc.check(&mut s, 2_300, nz(3)).allowed);
    }

    #[test]
    fn full_budget_returns_two_windows_later() {
        let sc = counter(10, 1_000);
        let mut s = SlidingCounterState::default();
        assert!(sc.check(&mut s, 1_000, nz(10)).allowed);
        let d = sc.check(&mut s, 1_000, nz(10));
        assert_eq!(
            (d.allowed, d.retry_after_ms, d.reset_at_ms),
            (false, 2_000, 3_000)
        );
    }

    #[test]
    fn backwards_clock_step_across_the_boundary_gives_no_fresh_budget() {
        let sc = counter(10, 1_000);
        let mut s = SlidingCounterState::default();
        assert!(sc.check(&mut s, 2_100, nz(10)).allowed);
        // Back into window 1 (and 0): the counters stay, the window index stays.
        for t in [1_900, 500] {
            let d = sc.check(&mut s, t, nz(1));
            assert!(!d.allowed);
            assert_eq!(d.window_id, Some(2));
            // Next window: 10 * (1000 - e) + 1 * 1000 <= 10 * 1000 from e = 100.
            assert_eq!(d.retry_after_ms, 3_100 - t);
        }
        assert_eq!(
            s,
            SlidingCounterState {
                idx: 2,
                prev: 0,
                curr: 10
            }
        );
    }

    #[test]
    fn gap_of_two_windows_zeroes_both_counters() {
        let sc = counter(10, 1_000);
        let mut s = SlidingCounterState::default();
        assert!(sc.check(&mut s, 1_000, nz(10)).allowed);
        let d = sc.check(&mut s, 3_000, nz(10));
        assert!(d.allowed);
        assert_eq!(
            s,
            SlidingCounterState {
                idx: 3,
                prev: 0,
                curr: 10
            }
        );
    }

    #[test]
    fn refund_restores_exactly_the_refunded_units() {
        let sc = counter(10, 1_000);
        let mut s = SlidingCounterState::default();
        assert!(sc.check(&mut s, 100, nz(4)).allowed);
        assert!(sc.check(&mut s, 200, nz(6)).allowed);
        sc.refund(&mut s, 200, nz(6));
        assert_eq!(sc.check(&mut s.clone(), 200, nz(1)).remaining, 5);
        // In the next window the refund hits the previous counter, never below zero.
        assert!(sc.check(&mut s, 1_000, nz(2)).allowed);
        sc.refund(&mut s, 100, nz(9));
        assert_eq!(
            s,
            SlidingCounterState {
                idx: 1,
                prev: 0,
                curr: 2
            }
        );
        // Two windows on, the units are forgotten and nothing comes back.
        assert!(sc.check(&mut s, 3_000, nz(10)).allowed);
        sc.refund(&mut s, 1_000, nz(2));
        assert_eq!(s.curr, 10);
    }

    #[test]
    fn cost_above_the_limit_is_never_admitted() {
        let d = counter(5, 1_000).check(&mut SlidingCounterState::default(), 0, nz(6));
        assert_eq!((d.allowed, d.retry_after_ms), (false, NEVER));
    }

    /// Brute-force model: every admitted `(clamped t, cost)` kept; both counters recounted from
    /// the history for each check, with the estimator evaluated over the rationals by
    /// cross-multiplication.
    #[derive(Default)]
    struct Model {
        high_idx: u64,
        admitted: Vec<(Millis, u64)>,
    }

    impl Model {
        fn in_window(&self, idx: Option<u64>, w: u64) -> u64 {
            self.admitted
                .iter()
                .filter(|a| Some(a.0 / w) == idx)
                .map(|a| a.1)
                .sum()
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn matches_brute_force_model(
            limit in 1u64..30, w in 1u64..2_000, start in 0u64..10_000_000,
            ops in testkit::ops(700, 25, 80)
        ) {
            let sc = counter(limit, w);
            let mut model = Model::default();
            let mut s = SlidingCounterState::default();
            let mut now = start;
            for op in &ops {
                now = op.advance(now);
                let d = sc.check(&mut s, now, nz(op.cost));
                model.high_idx = model.high_idx.max(now / w);
                let k = model.high_idx;
                let t = now.max(k * w);
                let f_num = t - k * w; // f = f_num / w
                let est = |m: &Model, extra: u64| {
                    // (prev * (1 - f) + curr + extra) * w, exactly
                    let prev = m.in_window(k.checked_sub(1), w);
                    let curr = m.in_window(Some(k), w);
                    prev * (w - f_num) + (curr + extra) * w
                };
                let allowed = est(&model, op.cost) <= limit * w;
                if allowed {
                    model.admitted.push((t, op.cost));
                }
                prop_assert_eq!(d.allowed, allowed, "at {} cost {}", t, op.cost);
                let remaining = (limit * w).saturating_sub(est(&model, 0)) / w;
                prop_assert_eq!(d.remaining, remaining);
                prop_assert_eq!(d.window_id, Some(k));
                // Never more than the limit per aligned window (what the counter promises).
                prop_assert!(model.in_window(Some(k), w) <= limit);
                testkit::assert_sane(&d, now)?;
                testkit::assert_retry_exact(&sc, &s, now, nz(op.cost), &d)?;
                // reset_at: the first instant with the full limit available again.
                let mut probe = s.clone();
                prop_assert!(sc.check(&mut probe, d.reset_at_ms, nz(limit)).allowed);
                if d.reset_at_ms > t {
                    let mut probe = s.clone();
                    prop_assert!(!sc.check(&mut probe, d.reset_at_ms - 1, nz(limit)).allowed);
                }
            }
        }

        #[test]
        fn expired_state_behaves_like_a_fresh_one(
            limit in 1u64..30, w in 1u64..2_000, start in 0u64..1_000_000,
            history in testkit::ops(700, 25, 30), probes in testkit::ops(700, 25, 20)
        ) {
            testkit::assert_expires_like_fresh(&counter(limit, w), start, &history, &probes)?;
        }

        #[test]
        fn refund_never_over_refunds(
            limit in 1u64..30, w in 1u64..2_000, start in 0u64..1_000_000,
            before in testkit::ops(700, 10, 20), step in 0u64..700, cost in 1u64..10,
            after in testkit::ops(700, 10, 10), probes in testkit::ops(700, 10, 10)
        ) {
            let sc = counter(limit, w);
            let refunded = Op { back: false, step, cost };
            testkit::assert_refund_never_over_refunds(&sc, start, &before, refunded, &after, &probes)?;
            testkit::assert_immediate_refund_is_exact(&sc, start, &before, refunded)?;
        }

        #[test]
        fn never_panics_on_any_input(
            l in testkit::wild_u64(), w in testkit::wild_u64(),
            calls in prop::collection::vec((testkit::wild_u64(), testkit::wild_u64(), any::<bool>()), 1..20)
        ) {
            if let Ok(sc) = SlidingCounter::new(nz(l.max(1)), Duration::from_millis(w)) {
                testkit::assert_total(&sc, &calls)?;
            }
        }
    }
}
