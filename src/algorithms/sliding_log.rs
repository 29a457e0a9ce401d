//! Sliding window log: the exact algorithm.

use std::collections::VecDeque;
use std::num::NonZeroU64;
use std::time::Duration;

use super::{
    clamp_millis, retry_from, whole_millis, Algorithm, AlgorithmError, Decision, Millis, NEVER,
};

/// Largest accepted `limit` for [`SlidingLog`]: the log holds up to one entry per admitted unit,
/// so this caps a single key at ~16 MB and a denial's retry computation at a million steps.
pub const MAX_SLIDING_LOG_LIMIT: u64 = 1_000_000;

/// At most `limit` units in *any* span of `W` ms, wherever it starts.
///
/// The only exact algorithm: it remembers every admitted `(time, cost)` (equal timestamps
/// merged) and counts an entry at `a` while `now - a < W`. Only admissions are logged, so a
/// flood of denied requests cannot grow the state. Right for small hard limits (5 password
/// resets per hour), where the counter's approximation error is largest.
///
/// A running sum of live costs makes a check O(entries that expired), not O(log length). A
/// *denial* additionally walks the oldest entries that must age out to compute `retry_after`.
///
/// Decision fields (after the decision, with `now` clamped to the state's high-water mark):
/// * `limit` = `limit`; `remaining` = `limit - live`, where `live` sums entries younger than `W`.
/// * `reset_at_ms` = newest entry + `W` (or `now` when the log is empty).
/// * `retry_after_ms` = `a_k + W - now`, where `a_k` is the youngest of the oldest entries that
///   must age out to make room for `cost`. Exact.
///
/// ```
/// use std::num::NonZeroU64;
/// use std::time::Duration;
/// use ringlimit::algorithms::{Algorithm, SlidingLog, SlidingLogState};
///
/// let log = SlidingLog::new(NonZeroU64::new(2).unwrap(), Duration::from_secs(10)).unwrap();
/// let mut s = SlidingLogState::default();
/// assert!(log.check(&mut s, 1_000, NonZeroU64::MIN).allowed);
/// assert!(log.check(&mut s, 9_000, NonZeroU64::MIN).allowed);
/// let d = log.check(&mut s, 10_500, NonZeroU64::MIN);
/// assert_eq!((d.allowed, d.retry_after_ms), (false, 500)); // the 1 s entry frees up at 11 s
/// assert!(log.check(&mut s, 11_000, NonZeroU64::MIN).allowed);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlidingLog {
    pub(super) limit: u64,
    pub(super) window_ms: u64,
}

/// Per-key log: admitted `(ms, cost)` entries in strictly increasing time order, their running
/// sum, and the highest `now` seen (so pruned entries can never come back to life when the clock
/// steps backwards).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingLogState {
    pub(super) entries: VecDeque<(Millis, u64)>,
    /// Sum of the costs in `entries` (`<= limit`).
    pub(super) sum: u64,
    /// Highest `now` applied; checks run at `max(now, high)`.
    pub(super) high: Millis,
}

impl SlidingLog {
    /// `limit` units in any `window`. Rejects a window under 1 ms or with a sub-millisecond
    /// part, and `limit` above [`MAX_SLIDING_LOG_LIMIT`] (the log's memory is per unit).
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use std::time::Duration;
    /// use ringlimit::algorithms::SlidingLog;
    ///
    /// let hour = Duration::from_secs(3_600);
    /// assert!(SlidingLog::new(NonZeroU64::new(5).unwrap(), hour).is_ok());
    /// assert!(SlidingLog::new(NonZeroU64::new(2_000_000).unwrap(), hour).is_err());
    /// ```
    pub fn new(limit: NonZeroU64, window: Duration) -> Result<Self, AlgorithmError> {
        if limit.get() > MAX_SLIDING_LOG_LIMIT {
            return Err(AlgorithmError::TooLarge {
                param: "limit",
                max: MAX_SLIDING_LOG_LIMIT,
            });
        }
        Ok(SlidingLog {
            limit: limit.get(),
            window_ms: whole_millis(window, "window")?,
        })
    }

    /// Instant at which an entry made at `a` stops counting.
    fn ages_out(&self, a: Millis) -> u128 {
        u128::from(a) + u128::from(self.window_ms)
    }

    /// Earliest instant at which `cost` fits, if nothing else arrives: drop the oldest entries
    /// until the rest leaves room, then wait for the last dropped one to age out.
    fn admit_at(&self, state: &SlidingLogState, cost: u64) -> u128 {
        let room = self.limit - cost; // caller guarantees cost <= limit
        let mut left = state.sum;
        for &(a, c) in &state.entries {
            left -= c;
            if left <= room {
                return self.ages_out(a);
            }
        }
        // Unreachable for a denied cost <= limit (emptying the log always makes room).
        u128::from(state.high)
    }
}

impl Algorithm for SlidingLog {
    type State = SlidingLogState;

    /// Prune what aged out, compare the running sum, append when admitted.
    fn check(&self, state: &mut SlidingLogState, now: Millis, cost: NonZeroU64) -> Decision {
        // Clamp to the high-water mark: entries pruned at `high` must stay dead.
        let t = now.max(state.high);
        state.high = t;
        // Entries are in time order, so everything that aged out is at the front.
        while let Some(&(a, c)) = state.entries.front() {
            if t - a < self.window_ms {
                break;
            }
            state.entries.pop_front();
            state.sum -= c;
        }
        let cost = cost.get();
        let allowed = u128::from(state.sum) + u128::from(cost) <= u128::from(self.limit);
        if allowed {
            state.sum += cost;
            // Same millisecond as the newest entry: merge, so the log holds distinct instants.
            match state.entries.back_mut() {
                Some((a, c)) if *a == t => *c += cost,
                _ => state.entries.push_back((t, cost)),
            }
        }
        let retry_after_ms = if allowed {
            0
        } else if cost > self.limit {
            NEVER
        } else {
            retry_from(self.admit_at(state, cost), now)
        };
        // Full again once the newest entry has aged out.
        let reset = state
            .entries
            .back()
            .map_or(u128::from(t), |&(a, _)| self.ages_out(a));
        Decision {
            allowed,
            limit: self.limit,
            remaining: self.limit - state.sum.min(self.limit),
            retry_after_ms,
            reset_at_ms: clamp_millis(reset),
            window_id: None,
            delay_ms: 0,
        }
    }

    /// Takes the units out of the entry logged at `at`, if it is still there. An entry that aged
    /// out (or was logged at a clamped, later instant) is not refunded: safe, possibly stingy.
    fn refund(&self, state: &mut SlidingLogState, at: Millis, cost: NonZeroU64) {
        if let Ok(i) = state.entries.binary_search_by_key(&at, |e| e.0) {
            let entry = &mut state.entries[i];
            let back = entry.1.min(cost.get());
            entry.1 -= back;
            state.sum -= back;
            if entry.1 == 0 {
                state.entries.remove(i);
            }
        }
    }

    /// When the newest entry ages out (and the clock clamp no longer matters).
    fn expires_at(&self, state: &SlidingLogState) -> Millis {
        let newest = state.entries.back().map_or(0, |&(a, _)| self.ages_out(a));
        clamp_millis(newest).max(state.high)
    }

    /// The whole window's budget.
    fn max_cost(&self) -> u64 {
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::testkit::{self, nz, Op};
    use proptest::prelude::*;

    fn log(limit: u64, ms: u64) -> SlidingLog {
        SlidingLog::new(nz(limit), Duration::from_millis(ms)).unwrap()
    }

    #[test]
    fn no_window_of_length_w_ever_holds_more_than_the_limit() {
        let l = log(5, 60_000);
        let mut s = SlidingLogState::default();
        // The fixed window's boundary trick does not work here.
        for _ in 0..5 {
            assert!(l.check(&mut s, 59_700, nz(1)).allowed);
        }
        let d = l.check(&mut s, 60_100, nz(1));
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, 59_600); // 59.7 s + 60 s - 60.1 s
        assert_eq!(d.reset_at_ms, 119_700);
    }

    #[test]
    fn retry_after_is_exact_to_the_millisecond() {
        let l = log(3, 1_000);
        let mut s = SlidingLogState::default();
        assert!(l.check(&mut s, 0, nz(1)).allowed);
        assert!(l.check(&mut s, 10, nz(1)).allowed);
        assert!(l.check(&mut s, 20, nz(1)).allowed);
        // Two units need the two oldest entries gone: 10 + 1000 - 500.
        let d = l.check(&mut s, 500, nz(2));
        assert_eq!((d.allowed, d.retry_after_ms), (false, 510));
        assert!(!l.check(&mut s.clone(), 1_009, nz(2)).allowed);
        assert!(l.check(&mut s, 1_010, nz(2)).allowed);
    }

    #[test]
    fn backwards_clock_step_does_not_revive_or_forget_entries() {
        let l = log(2, 1_000);
        let mut s = SlidingLogState::default();
        assert!(l.check(&mut s, 5_000, nz(2)).allowed);
        let d = l.check(&mut s, 4_000, nz(1));
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, 2_000); // measured from the stepped-back clock
    }

    #[test]
    fn refund_restores_exactly_the_refunded_units_while_logged() {
        let l = log(5, 1_000);
        let mut s = SlidingLogState::default();
        assert!(l.check(&mut s, 100, nz(2)).allowed);
        assert!(l.check(&mut s, 200, nz(3)).allowed);
        l.refund(&mut s, 200, nz(2));
        assert_eq!(l.check(&mut s.clone(), 200, nz(1)).remaining, 1);
        l.refund(&mut s, 200, nz(5)); // only the 1 unit still logged at 200 comes back
        assert_eq!(l.check(&mut s.clone(), 200, nz(1)).remaining, 2);
        l.refund(&mut s, 150, nz(5)); // nothing logged at 150
        assert_eq!(s.sum, 2);
        assert!(l.check(&mut s, 1_100, nz(5)).allowed); // the 100 ms entry aged out
        l.refund(&mut s, 100, nz(2)); // already gone: nothing to give back
        assert!(!l.check(&mut s, 1_100, nz(1)).allowed);
    }

    #[test]
    fn entries_at_the_same_millisecond_are_merged() {
        let l = log(1_000, 1_000);
        let mut s = SlidingLogState::default();
        for _ in 0..1_000 {
            assert!(l.check(&mut s, 7, nz(1)).allowed);
        }
        assert_eq!(s.entries.len(), 1);
    }

    #[test]
    fn cost_above_the_limit_is_never_admitted() {
        let d = log(5, 1_000).check(&mut SlidingLogState::default(), 0, nz(6));
        assert_eq!((d.allowed, d.retry_after_ms), (false, NEVER));
    }

    /// Brute-force model: every admitted `(t, cost)` kept forever and recounted per check.
    #[derive(Default)]
    struct Model {
        high: Millis,
        admitted: Vec<(Millis, u64)>,
    }

    impl Model {
        fn live(&self, t: Millis, w: u64) -> u64 {
            self.admitted
                .iter()
                .filter(|a| t - a.0 < w)
                .map(|a| a.1)
                .sum()
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn matches_brute_force_model_and_never_exceeds_the_limit_in_any_window(
            limit in 1u64..20, w in 1u64..2_000, start in 0u64..10_000_000,
            ops in testkit::ops(400, 25, 80)
        ) {
            let l = log(limit, w);
            let mut model = Model::default();
            let mut s = SlidingLogState::default();
            let mut now = start;
            for op in &ops {
                now = op.advance(now);
                let d = l.check(&mut s, now, nz(op.cost));
                model.high = model.high.max(now);
                let t = model.high;
                let allowed = model.live(t, w) + op.cost <= limit;
                if allowed {
                    model.admitted.push((t, op.cost));
                }
                prop_assert_eq!(d.allowed, allowed, "at {} cost {}", t, op.cost);
                prop_assert_eq!(d.remaining, limit - model.live(t, w));
                testkit::assert_sane(&d, now)?;
                testkit::assert_retry_exact(&l, &s, now, nz(op.cost), &d)?;
                prop_assert!(s.entries.len() as u64 <= limit);
            }
            // Every window [s, s + W) — it suffices to end them at each admission instant.
            for &(end, _) in &model.admitted {
                let inside: u64 = model
                    .admitted
                    .iter()
                    .filter(|a| a.0 <= end && end - a.0 < w)
                    .map(|a| a.1)
                    .sum();
                prop_assert!(inside <= limit, "{} units in the window ending at {}", inside, end);
            }
        }

        #[test]
        fn expired_state_behaves_like_a_fresh_one(
            limit in 1u64..20, w in 1u64..2_000, start in 0u64..1_000_000,
            history in testkit::ops(400, 25, 30), probes in testkit::ops(400, 25, 20)
        ) {
            testkit::assert_expires_like_fresh(&log(limit, w), start, &history, &probes)?;
        }

        #[test]
        fn refund_never_over_refunds(
            limit in 1u64..20, w in 1u64..2_000, start in 0u64..1_000_000,
            before in testkit::ops(400, 10, 20), step in 0u64..400, cost in 1u64..10,
            after in testkit::ops(400, 10, 10), probes in testkit::ops(400, 10, 10)
        ) {
            let l = log(limit, w);
            let refunded = Op { back: false, step, cost };
            testkit::assert_refund_never_over_refunds(&l, start, &before, refunded, &after, &probes)?;
            testkit::assert_immediate_refund_is_exact(&l, start, &before, refunded)?;
        }

        #[test]
        fn never_panics_on_any_input(
            l in prop_oneof![Just(MAX_SLIDING_LOG_LIMIT), 1u64..100, testkit::wild_u64()],
            w in testkit::wild_u64(),
            calls in prop::collection::vec((testkit::wild_u64(), testkit::wild_u64(), any::<bool>()), 1..20)
        ) {
            if let Ok(sl) = SlidingLog::new(nz(l.max(1)), Duration::from_millis(w)) {
                testkit::assert_total(&sl, &calls)?;
            }
        }
    }
}
