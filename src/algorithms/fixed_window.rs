//! Fixed window: one counter per clock-aligned window.

use std::num::NonZeroU64;
use std::time::Duration;

use super::{
    clamp_millis, retry_from, whole_millis, Algorithm, AlgorithmError, Decision, Millis, NEVER,
};

/// At most `limit` units per aligned window `[k*W, (k+1)*W)`, with `k = now / W`.
///
/// The cheapest algorithm (16 bytes, no division beyond the index) and the loosest: a client
/// that knows where the boundary is gets `2 * limit` back to back across it. Right for runaway
/// loop protection ("10,000 calls per day"), wrong for capacity or abuse limits.
///
/// Decision fields (window `k` is the clamped current window):
/// * `limit` = `limit`; `remaining` = `limit - count(k)` after the decision.
/// * `reset_at_ms` = `(k + 1) * W`, the end of the current window.
/// * `retry_after_ms` (denied, `cost <= limit`) = `(k + 1) * W - now`.
/// * `window_id` = `Some(k)`.
///
/// The window index never decreases: a clock stepping back into an earlier window keeps
/// counting in the newest one instead of opening a fresh budget.
///
/// ```
/// use std::num::NonZeroU64;
/// use std::time::Duration;
/// use ringlimit::algorithms::{Algorithm, FixedWindow, FixedWindowState};
///
/// let fw = FixedWindow::new(NonZeroU64::new(1).unwrap(), Duration::from_secs(60)).unwrap();
/// let mut s = FixedWindowState::default();
/// assert!(fw.check(&mut s, 59_000, NonZeroU64::MIN).allowed);
/// let d = fw.check(&mut s, 59_500, NonZeroU64::MIN);
/// assert_eq!((d.allowed, d.retry_after_ms, d.window_id), (false, 500, Some(0)));
/// assert!(fw.check(&mut s, 60_000, NonZeroU64::MIN).allowed); // the boundary problem
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FixedWindow {
    pub(super) limit: u64,
    pub(super) window_ms: u64,
}

/// Per-key fixed window state: 16 bytes. `Default` is window 0 with nothing counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FixedWindowState {
    /// Newest window index seen (never decreases).
    pub(super) idx: u64,
    /// Units admitted in window `idx` (`<= limit`).
    pub(super) count: u64,
}

impl FixedWindow {
    /// `limit` units per aligned `window`. Rejects a window under 1 ms or with a
    /// sub-millisecond part, since windows are aligned on whole milliseconds.
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use std::time::Duration;
    /// use ringlimit::algorithms::FixedWindow;
    ///
    /// let five = NonZeroU64::new(5).unwrap();
    /// assert!(FixedWindow::new(five, Duration::from_secs(60)).is_ok());
    /// let err = FixedWindow::new(five, Duration::from_nanos(1)).unwrap_err();
    /// assert_eq!(err.to_string(), "window must be at least 1 ms");
    /// ```
    pub fn new(limit: NonZeroU64, window: Duration) -> Result<Self, AlgorithmError> {
        Ok(FixedWindow {
            limit: limit.get(),
            window_ms: whole_millis(window, "window")?,
        })
    }

    /// End of window `idx`, possibly beyond `u64`.
    fn window_end(&self, idx: u64) -> u128 {
        (u128::from(idx) + 1) * u128::from(self.window_ms)
    }
}

impl Algorithm for FixedWindow {
    type State = FixedWindowState;

    /// Rolls to the current window (never back), then compare-and-add.
    fn check(&self, state: &mut FixedWindowState, now: Millis, cost: NonZeroU64) -> Decision {
        let k = now / self.window_ms;
        // Only ever roll forward; `k < idx` (a clock stepped back) keeps counting in `idx`.
        if k > state.idx {
            state.idx = k;
            state.count = 0;
        }
        // u128: `count + cost` may exceed u64 for an absurd cost.
        let allowed = u128::from(state.count) + u128::from(cost.get()) <= u128::from(self.limit);
        if allowed {
            state.count += cost.get();
        }
        let end = self.window_end(state.idx);
        let retry_after_ms = if allowed {
            0
        } else if cost.get() > self.limit {
            NEVER
        } else {
            // Nothing changes inside the window; the next one starts empty.
            retry_from(end, now)
        };
        Decision {
            allowed,
            limit: self.limit,
            remaining: self.limit - state.count.min(self.limit),
            retry_after_ms,
            reset_at_ms: clamp_millis(end),
            window_id: Some(state.idx),
            delay_ms: 0,
        }
    }

    /// Gives the units back only while their window is still the current one; once it has
    /// rolled past, the count that held them is gone and there is nothing to refund.
    fn refund(&self, state: &mut FixedWindowState, at: Millis, cost: NonZeroU64) {
        if at / self.window_ms == state.idx {
            state.count = state.count.saturating_sub(cost.get());
        }
    }

    /// End of the current window; an empty window is already as good as fresh from its start.
    fn expires_at(&self, state: &FixedWindowState) -> Millis {
        if state.count == 0 {
            clamp_millis(u128::from(state.idx) * u128::from(self.window_ms))
        } else {
            clamp_millis(self.window_end(state.idx))
        }
    }

    /// One window's whole budget.
    fn max_cost(&self) -> u64 {
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::testkit::{self, nz, Op};
    use proptest::prelude::*;

    fn window(limit: u64, ms: u64) -> FixedWindow {
        FixedWindow::new(nz(limit), Duration::from_millis(ms)).unwrap()
    }

    /// 2024-01-01T12:00:00Z in Unix ms.
    const NOON: Millis = 1_704_110_400_000;

    #[test]
    fn admits_ten_within_400_ms_across_the_boundary_and_denies_the_sixth_in_each_window() {
        let fw = window(5, 60_000);
        let mut s = FixedWindowState::default();
        let before = NOON + 59_700; // 12:00:59.700
        let after = NOON + 60_100; // 12:01:00.100
        for i in 0..5 {
            let d = fw.check(&mut s, before, nz(1));
            assert!(d.allowed, "request {}", i + 1);
            assert_eq!(d.remaining, 4 - i);
        }
        let sixth = fw.check(&mut s, before, nz(1));
        assert!(!sixth.allowed);
        assert_eq!(sixth.retry_after_ms, 300);
        assert_eq!(sixth.reset_at_ms, NOON + 60_000);
        for _ in 0..5 {
            assert!(fw.check(&mut s, after, nz(1)).allowed);
        }
        let sixth = fw.check(&mut s, after, nz(1));
        assert!(!sixth.allowed);
        assert_eq!(sixth.retry_after_ms, 59_900);
        assert_eq!(sixth.window_id, Some((NOON + 60_000) / 60_000));
    }

    #[test]
    fn backwards_clock_step_across_the_boundary_gives_no_fresh_budget() {
        let fw = window(5, 60_000);
        let mut s = FixedWindowState::default();
        assert!(fw.check(&mut s, NOON + 60_100, nz(5)).allowed);
        // NTP steps the clock back into the previous minute, whose counter is long gone.
        let d = fw.check(&mut s, NOON + 59_000, nz(1));
        assert!(!d.allowed);
        assert_eq!(d.window_id, Some((NOON + 60_000) / 60_000));
        assert_eq!(d.retry_after_ms, 61_000);
        assert_eq!(d.reset_at_ms, NOON + 120_000);
    }

    #[test]
    fn refund_restores_exactly_the_refunded_units_in_the_current_window_only() {
        let fw = window(5, 1_000);
        let mut s = FixedWindowState::default();
        assert!(fw.check(&mut s, 100, nz(3)).allowed);
        assert!(fw.check(&mut s, 200, nz(2)).allowed);
        fw.refund(&mut s, 200, nz(2));
        assert_eq!(fw.check(&mut s.clone(), 300, nz(1)).remaining, 1);
        fw.refund(&mut s, 100, nz(9)); // never below zero
        assert_eq!(fw.check(&mut s.clone(), 300, nz(5)).remaining, 0);
        // After the window rolled, the old units are not refundable any more.
        assert!(fw.check(&mut s, 1_100, nz(5)).allowed);
        fw.refund(&mut s, 900, nz(5));
        assert!(!fw.check(&mut s, 1_200, nz(1)).allowed);
    }

    #[test]
    fn cost_above_the_limit_is_never_admitted() {
        let d = window(5, 1_000).check(&mut FixedWindowState::default(), 0, nz(6));
        assert_eq!(
            (d.allowed, d.retry_after_ms, d.remaining),
            (false, NEVER, 5)
        );
    }

    #[test]
    fn last_window_before_the_end_of_time_never_reopens() {
        let fw = window(1, 1_000);
        let mut s = FixedWindowState::default();
        assert!(fw.check(&mut s, u64::MAX - 10, nz(1)).allowed);
        let d = fw.check(&mut s, u64::MAX, nz(1));
        assert_eq!(
            (d.allowed, d.retry_after_ms, d.reset_at_ms),
            (false, NEVER, u64::MAX)
        );
    }

    /// Brute-force model: every admitted `(window, cost)` kept and re-summed per check.
    #[derive(Default)]
    struct Model {
        high_idx: u64,
        admitted: Vec<(u64, u64)>,
    }

    impl Model {
        fn count(&self, idx: u64) -> u64 {
            self.admitted
                .iter()
                .filter(|a| a.0 == idx)
                .map(|a| a.1)
                .sum()
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn matches_brute_force_model(
            limit in 1u64..20, w in 1u64..2_000, start in 0u64..10_000_000,
            ops in testkit::ops(700, 25, 80)
        ) {
            let fw = window(limit, w);
            let mut model = Model::default();
            let mut s = FixedWindowState::default();
            let mut now = start;
            for op in &ops {
                now = op.advance(now);
                let d = fw.check(&mut s, now, nz(op.cost));
                model.high_idx = model.high_idx.max(now / w);
                let allowed = model.count(model.high_idx) + op.cost <= limit;
                if allowed {
                    model.admitted.push((model.high_idx, op.cost));
                }
                prop_assert_eq!(d.allowed, allowed);
                prop_assert_eq!(d.remaining, limit - model.count(model.high_idx));
                prop_assert_eq!(d.window_id, Some(model.high_idx));
                prop_assert_eq!(d.reset_at_ms, (model.high_idx + 1) * w);
                prop_assert!(model.count(model.high_idx) <= limit);
                testkit::assert_sane(&d, now)?;
                testkit::assert_retry_exact(&fw, &s, now, nz(op.cost), &d)?;
            }
        }

        #[test]
        fn expired_state_behaves_like_a_fresh_one(
            limit in 1u64..20, w in 1u64..2_000, start in 0u64..1_000_000,
            history in testkit::ops(700, 25, 30), probes in testkit::ops(700, 25, 20)
        ) {
            testkit::assert_expires_like_fresh(&window(limit, w), start, &history, &probes)?;
        }

        #[test]
        fn refund_never_over_refunds(
            limit in 1u64..20, w in 1u64..2_000, start in 0u64..1_000_000,
            before in testkit::ops(700, 10, 20), step in 0u64..700, cost in 1u64..10,
            after in testkit::ops(700, 10, 10), probes in testkit::ops(700, 10, 10)
        ) {
            let fw = window(limit, w);
            let refunded = Op { back: false, step, cost };
            testkit::assert_refund_never_over_refunds(&fw, start, &before, refunded, &after, &probes)?;
            testkit::assert_immediate_refund_is_exact(&fw, start, &before, refunded)?;
        }

        #[test]
        fn never_panics_on_any_input(
            l in testkit::wild_u64(), w in testkit::wild_u64(),
            calls in prop::collection::vec((testkit::wild_u64(), testkit::wild_u64(), any::<bool>()), 1..20)
        ) {
            if let Ok(fw) = FixedWindow::new(nz(l.max(1)), Duration::from_millis(w)) {
                testkit::assert_total(&fw, &calls)?;
            }
        }
    }
}
