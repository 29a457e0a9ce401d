//! Token bucket with lazy refill, in exact integer arithmetic.
//!
//! The level is kept *scaled by the period*: one token is `period_ms` scaled units and the refill
//! adds exactly `refill` scaled units per elapsed millisecond, so `refill` tokens per `period`
//! needs no division and no float. The state stores the *deficit* (how far below full the bucket
//! is) so that `Default` (deficit 0) is a full bucket, as a fresh key must be.

use std::num::NonZeroU64;
use std::time::Duration;

use super::{
    clamp_millis, retry_from, whole_millis, Algorithm, AlgorithmError, Decision, Millis, NEVER,
};

/// Token bucket: `capacity` tokens, refilled at `refill` tokens per `period`, a request of cost
/// `n` takes `n` tokens.
///
/// Chosen where a deliberate burst is a feature: it is the only algorithm whose burst
/// (`capacity`) and sustained rate (`refill / period`) are separate knobs. From full, up to
/// `capacity + refill * T / period` units pass in any span `T`.
///
/// Decision fields (after the decision, with `now` clamped to the state's last update):
/// * `limit` = `capacity`.
/// * `remaining` = `floor(level)`, whole tokens left in the bucket.
/// * `reset_at_ms` = first instant at which the bucket is full again
///   (`now + ceil(deficit_scaled / refill)`).
/// * `retry_after_ms` = `ceil((cost * period - level_scaled) / refill)`, exact.
///
/// ```
/// use std::num::NonZeroU64;
/// use std::time::Duration;
/// use ringlimit::algorithms::{Algorithm, TokenBucket, TokenBucketState};
///
/// // 2 tokens, refilled at 1 token per second.
/// let tb = TokenBucket::new(NonZeroU64::new(2).unwrap(), NonZeroU64::MIN, Duration::from_secs(1))
///     .unwrap();
/// let mut s = TokenBucketState::default();
/// assert!(tb.check(&mut s, 0, NonZeroU64::MIN).allowed);
/// assert!(tb.check(&mut s, 0, NonZeroU64::MIN).allowed);
/// let d = tb.check(&mut s, 250, NonZeroU64::MIN);
/// assert!(!d.allowed);
/// assert_eq!(d.retry_after_ms, 750); // a quarter of a token has dripped in already
/// assert_eq!(d.reset_at_ms, 2_000);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBucket {
    pub(super) capacity: u64,
    pub(super) refill: u64,
    pub(super) period_ms: u64,
    /// `capacity * period_ms`: a full bucket in scaled units (validated to fit `u64`).
    pub(super) full: u64,
}

/// Per-key token bucket state: 16 bytes.
///
/// `Default` is a full bucket, so a key the store dropped (or never saw) starts with its whole
/// burst available, which is what clients of a bucket expect.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenBucketState {
    /// Scaled tokens missing from a full bucket (`0..=capacity * period_ms`).
    pub(super) deficit: u64,
    /// Highest `now` applied so far; refill is computed from here and never goes back.
    pub(super) last: Millis,
}

impl TokenBucket {
    /// Builds a bucket of `capacity` tokens refilled by `refill` tokens every `period`.
    ///
    /// Rejects a `period` under 1 ms or with a sub-millisecond part (the refill is counted per
    /// whole ms) and a `capacity * period_ms` beyond `u64` (the scaled level must fit the state).
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use std::time::Duration;
    /// use ringlimit::algorithms::TokenBucket;
    ///
    /// let hundred = NonZeroU64::new(100).unwrap();
    /// assert!(TokenBucket::new(hundred, hundred, Duration::from_secs(60)).is_ok());
    /// let err = TokenBucket::new(hundred, hundred, Duration::ZERO).unwrap_err();
    /// assert_eq!(err.to_string(), "period must be at least 1 ms");
    /// ```
    pub fn new(
        capacity: NonZeroU64,
        refill: NonZeroU64,
        period: Duration,
    ) -> Result<Self, AlgorithmError> {
        let period_ms = whole_millis(period, "period")?;
        let full = capacity
            .get()
            .checked_mul(period_ms)
            .ok_or(AlgorithmError::TooLarge {
                param: "capacity * period_ms",
                max: u64::MAX,
            })?;
        Ok(TokenBucket {
            capacity: capacity.get(),
            refill: refill.get(),
            period_ms,
            full,
        })
    }

    /// Brings `state` up to `now` (clamped so it never moves back) and returns the clamped time.
    fn refill_to(&self, state: &mut TokenBucketState, now: Millis) -> Millis {
        // A backwards clock step refills nothing and keeps `last`: no free tokens from NTP.
        let now = now.max(state.last);
        let dripped = u128::from(now - state.last) * u128::from(self.refill);
        // `deficit <= full <= u64::MAX`, so the narrowing below cannot fail.
        state.deficit =
            u64::try_from(u128::from(state.deficit).saturating_sub(dripped)).unwrap_or(u64::MAX);
        state.last = now;
        now
    }

    /// Milliseconds until `deficit` scaled units have dripped back in.
    fn ms_to_drip(&self, deficit: u128) -> u128 {
        deficit.div_ceil(u128::from(self.refill))
    }
}

impl Algorithm for TokenBucket {
    type State = TokenBucketState;

    /// Lazy refill, then compare-and-subtract; denials leave the level untouched.
    fn check(&self, state: &mut TokenBucketState, now: Millis, cost: NonZeroU64) -> Decision {
        let t = self.refill_to(state, now);
        let need = u128::from(cost.get()) * u128::from(self.period_ms);
        let level = u128::from(self.full - state.deficit.min(self.full));
        let allowed = need <= level;
        let retry_after_ms = if allowed {
            0
        } else if cost.get() > self.capacity {
            NEVER
        } else {
            // Wait until the missing `need - level` scaled units have dripped in.
            retry_from(u128::from(t) + self.ms_to_drip(need - level), now)
        };
        if allowed {
            // need <= level <= full, so this stays within u64.
            state.deficit += u64::try_from(need).unwrap_or(0);
        }
        Decision {
            allowed,
            limit: self.capacity,
            remaining: (self.full - state.deficit) / self.period_ms,
            retry_after_ms,
            reset_at_ms: clamp_millis(u128::from(t) + self.ms_to_drip(state.deficit.into())),
            window_id: None,
            delay_ms: 0,
        }
    }

    /// Gives the scaled tokens back, but only while the state has not moved past `at`.
    ///
    /// Once time has advanced, the refill may have topped the bucket up to full in between (the
    /// cap then silently absorbed the refunded tokens) and a later check may have drawn the level
    /// down again; subtracting the cost then would hand out tokens twice. Without remembering
    /// every refill, the only safe answer after the clock moved on is to refund nothing.
    fn refund(&self, state: &mut TokenBucketState, at: Millis, cost: NonZeroU64) {
        if at != state.last {
            return;
        }
        let back = u128::from(cost.get()) * u128::from(self.period_ms);
        state.deficit = u64::try_from(u128::from(state.deficit).saturating_sub(back)).unwrap_or(0);
    }

    /// The instant the bucket has refilled completely; from then on it equals a fresh bucket.
    fn expires_at(&self, state: &TokenBucketState) -> Millis {
        clamp_millis(u128::from(state.last) + self.ms_to_drip(state.deficit.into()))
    }

    /// A request can never take more than a full bucket.
    fn max_cost(&self) -> u64 {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::testkit::{self, nz, Op};
    use proptest::prelude::*;

    fn bucket(capacity: u64, refill: u64, period_ms: u64) -> TokenBucket {
        TokenBucket::new(nz(capacity), nz(refill), Duration::from_millis(period_ms)).unwrap()
    }

    #[test]
    fn full_bucket_admits_capacity_within_one_millisecond_then_denies() {
        let tb = bucket(100, 100, 60_000);
        let mut s = TokenBucketState::default();
        for i in 0..100 {
            let d = tb.check(&mut s, i % 2, nz(1)); // t = 0 and t = 1 only
            assert!(d.allowed, "request {i}");
            assert_eq!(d.remaining, 99 - i);
        }
        let d = tb.check(&mut s, 1, nz(1));
        assert!(!d.allowed);
        // 1 token = 600 ms of refill; 1 ms has already dripped 100/60000 of a token.
        assert_eq!(d.retry_after_ms, 599);
    }

    #[test]
    fn continuous_traffic_admits_exactly_two_hundred_in_the_first_minute() {
        let tb = bucket(100, 100, 60_000);
        let mut s = TokenBucketState::default();
        let mut admitted = 0;
        for t in 0..=60_000 {
            // Send continuously: keep asking every millisecond until denied.
            while tb.check(&mut s, t, nz(1)).allowed {
                admitted += 1;
            }
        }
        assert_eq!(admitted, 200);
    }

    #[test]
    fn backwards_clock_step_refills_nothing() {
        let tb = bucket(10, 10, 1_000);
        let mut s = TokenBucketState::default();
        assert!(tb.check(&mut s, 5_000, nz(10)).allowed);
        let snapshot = s.clone();
        // Stepping back 4 s must neither refill nor move `last` back.
        let d = tb.check(&mut s, 1_000, nz(1));
        assert!(!d.allowed);
        assert_eq!(s, snapshot);
        // Retry is measured from the caller's (earlier) clock: 4 s back + 100 ms of refill.
        assert_eq!(d.retry_after_ms, 4_100);
        assert!(tb.check(&mut s, 5_100, nz(1)).allowed);
    }

    #[test]
    fn refund_restores_exactly_the_refunded_tokens() {
        let tb = bucket(10, 1, 1_000);
        let mut s = TokenBucketState::default();
        assert!(tb.check(&mut s, 0, nz(6)).allowed);
        assert!(tb.check(&mut s, 0, nz(3)).allowed);
        tb.refund(&mut s, 0, nz(3));
        assert_eq!(tb.check(&mut s.clone(), 0, nz(1)).remaining, 3);
        assert!(!tb.check(&mut s.clone(), 0, nz(5)).allowed);
    }

    #[test]
    fn refund_never_fills_beyond_capacity() {
        let tb = bucket(10, 1, 1_000);
        let mut s = TokenBucketState::default();
        assert!(tb.check(&mut s, 0, nz(4)).allowed);
        tb.refund(&mut s, 0, nz(4));
        tb.refund(&mut s, 0, nz(4));
        assert_eq!(
            s,
            TokenBucketState {
                deficit: 0,
                last: 0
            }
        );
        assert!(!tb.check(&mut s, 0, nz(11)).allowed);
    }

    #[test]
    fn refund_after_the_clock_moved_on_gives_nothing_back() {
        // The refill topped the bucket up to full between A and B, absorbing A's tokens: giving
        // A's 4 tokens back now would leave 10 - 7 + 4 = 7 instead of the 3 without A.
        let tb = bucket(10, 1, 1_000);
        let mut s = TokenBucketState::default();
        assert!(tb.check(&mut s, 0, nz(4)).allowed);
        assert!(tb.check(&mut s, 5_000, nz(7)).allowed);
        let before = s.clone();
        tb.refund(&mut s, 0, nz(4));
        assert_eq!(s, before);
    }

    #[test]
    fn cost_above_capacity_is_never_admitted() {
        let tb = bucket(5, 1, 10);
        let mut s = TokenBucketState::default();
        let d = tb.check(&mut s, 1_000_000, nz(6));
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, NEVER);
        assert_eq!(d.remaining, 5);
        assert_eq!(tb.max_cost(), 5);
    }

    #[test]
    fn rejects_parameters_the_integer_math_cannot_hold() {
        let e = TokenBucket::new(nz(u64::MAX), nz(1), Duration::from_millis(2)).unwrap_err();
        assert!(e.to_string().contains("capacity * period_ms"));
        assert!(TokenBucket::new(nz(1), nz(1), Duration::from_micros(1_500)).is_err());
        assert!(TokenBucket::new(nz(u64::MAX), nz(u64::MAX), Duration::from_millis(1)).is_ok());
    }

    /// Brute-force model: the level after the last admission is the minimum over every admitted
    /// event `k` of `full + refill*(t - t_k) - period*(cost admitted since k)`, capped at full.
    /// It re-derives the level from the whole history instead of updating it incrementally.
    struct Model {
        tb: TokenBucket,
        high: Millis,
        admitted: Vec<(Millis, u64)>,
    }

    impl Model {
        fn level(&self, t: Millis) -> i128 {
            let full = i128::from(self.tb.full);
            let mut level = full;
            let mut spent_since = 0i128;
            for &(tk, c) in self.admitted.iter().rev() {
                spent_since += i128::from(c);
                let drip = i128::from(self.tb.refill) * i128::from(t - tk);
                level = level.min(full + drip - spent_since * i128::from(self.tb.period_ms));
            }
            level
        }

        fn check(&mut self, now: Millis, cost: u64) -> (bool, u64) {
            self.high = self.high.max(now);
            let t = self.high;
            let p = i128::from(self.tb.period_ms);
            let allowed = self.level(t) >= i128::from(cost) * p;
            if allowed {
                self.admitted.push((t, cost));
            }
            (allowed, u64::try_from(self.level(t) / p).unwrap())
        }
    }

    fn small_bucket() -> impl Strategy<Value = TokenBucket> {
        (1u64..20, 1u64..20, 1u64..3_000).prop_map(|(c, r, p)| bucket(c, r, p))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn matches_brute_force_model(
            tb in small_bucket(), start in 0u64..10_000_000, ops in testkit::ops(500, 25, 60)
        ) {
            let mut model = Model { tb: tb.clone(), high: 0, admitted: Vec::new() };
            let mut s = TokenBucketState::default();
            let mut now = start;
            for op in &ops {
                now = op.advance(now);
                let d = tb.check(&mut s, now, nz(op.cost));
                let (allowed, remaining) = model.check(now, op.cost);
                prop_assert_eq!(d.allowed, allowed, "at {} cost {}", now, op.cost);
                prop_assert_eq!(d.remaining, remaining);
                testkit::assert_sane(&d, now)?;
                testkit::assert_retry_exact(&tb, &s, now, nz(op.cost), &d)?;
                // reset_at is the first instant the model's bucket is full again.
                let r = d.reset_at_ms;
                prop_assert_eq!(model.level(r), i128::from(tb.full));
                if r > model.high {
                    prop_assert!(model.level(r - 1) < i128::from(tb.full));
                }
            }
        }

        #[test]
        fn expired_state_behaves_like_a_fresh_one(
            tb in small_bucket(), start in 0u64..1_000_000,
            history in testkit::ops(300, 25, 30), probes in testkit::ops(300, 25, 20)
        ) {
            testkit::assert_expires_like_fresh(&tb, start, &history, &probes)?;
        }

        #[test]
        fn refund_never_over_refunds(
            tb in small_bucket(), start in 0u64..1_000_000,
            before in testkit::ops(300, 10, 20), step in 0u64..300, cost in 1u64..10,
            after in testkit::ops(300, 10, 10), probes in testkit::ops(300, 10, 10)
        ) {
            let refunded = Op { back: false, step, cost };
            testkit::assert_refund_never_over_refunds(&tb, start, &before, refunded, &after, &probes)?;
            testkit::assert_immediate_refund_is_exact(&tb, start, &before, refunded)?;
        }

        #[test]
        fn never_panics_on_any_input(
            c in testkit::wild_u64(), r in testkit::wild_u64(), p in testkit::wild_u64(),
            calls in prop::collection::vec((testkit::wild_u64(), testkit::wild_u64(), any::<bool>()), 1..20)
        ) {
            let built = TokenBucket::new(
                nz(c.max(1)), nz(r.max(1)), Duration::from_millis(p));
            if let Ok(tb) = built {
                testkit::assert_total(&tb, &calls)?;
            }
        }
    }
}
