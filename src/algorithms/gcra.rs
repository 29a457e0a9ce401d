//! Leaky bucket as GCRA (generic cell rate algorithm, virtual scheduling).
//!
//! Instead of a queue, one number: the *theoretical arrival time* (TAT), the instant at which the
//! schedule would next be idle. The emission interval is `T = period / limit`; to keep it exact
//! without floats, time is measured in *scaled units* of `1 / limit` ms, so one ms is `limit`
//! units and `T` is exactly `period_ms` units. Products are taken in `u128`.
//!
//! Both flavours admit a request of cost `n` iff `max(TAT, now) + n*T - now <= tau`, then set
//! `TAT = max(TAT, now) + n*T`:
//! * the **meter** (`tau = burst * T`) rejects early arrivals;
//! * the **shaper** (`tau = (queue_depth + 1) * T`) admits them and tells the caller to wait
//!   `max(TAT, now) - now` (rounded up to whole ms) before proceeding.

use std::num::NonZeroU64;
use std::time::Duration;

use super::{
    clamp_millis, retry_from, whole_millis, Algorithm, AlgorithmError, Decision, Millis, NEVER,
};

/// Whether early arrivals are rejected (meter) or delayed (shaper).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GcraMode {
    /// Policing: a request ahead of schedule by more than the burst tolerance is denied.
    Meter,
    /// Shaping: a request is admitted with `delay_ms` as long as the virtual queue has room.
    Shaper,
}

/// GCRA over `limit` units per `period`: the smooth-output counterpart of the token bucket.
///
/// Chosen where the downstream needs a steady stream rather than a bounded total (e.g. a
/// third-party API with a hard per-second cap). One `u128` of schedule replaces a real queue.
///
/// Decision fields (`wait = max(TAT, now) - now` *after* the decision, in scaled units):
/// * `limit` = `burst` (meter) or `queue_depth + 1` (shaper): the units a fresh state takes at once.
/// * `remaining` = `floor((tau - wait) / T)`: the largest cost admissible right now.
/// * `reset_at_ms` = `max(now, ceil(TAT))`: when the schedule is idle again.
/// * `retry_after_ms` = `ceil((TAT + n*T - tau) / limit) - now` (scaled units to ms), exact.
/// * `delay_ms` (shaper, admitted) = `ceil(wait_before / 1 ms)`: when the caller's turn starts.
///
/// GCRA needs no clamp for backwards clock steps: an earlier `now` only increases
/// `max(TAT, now) - now`, so a step back is stricter, never a fresh budget.
///
/// ```
/// use std::num::NonZeroU64;
/// use std::time::Duration;
/// use ringlimit::algorithms::{Algorithm, Gcra, GcraState};
///
/// // 100 per minute (T = 600 ms), bursts of 3.
/// let meter = Gcra::meter(NonZeroU64::new(100).unwrap(), Duration::from_secs(60),
///                         NonZeroU64::new(3).unwrap()).unwrap();
/// let mut s = GcraState::default();
/// for _ in 0..3 {
///     assert!(meter.check(&mut s, 0, NonZeroU64::MIN).allowed);
/// }
/// let d = meter.check(&mut s, 0, NonZeroU64::MIN);
/// assert!(!d.allowed);
/// assert_eq!(d.retry_after_ms, 600);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gcra {
    pub(super) mode: GcraMode,
    /// Units per period; also the number of scaled units per ms.
    pub(super) limit: u64,
    /// Emission interval `T` in scaled units (equal to the period in ms).
    pub(super) period_ms: u64,
    /// `burst` (meter) or `queue_depth + 1` (shaper).
    pub(super) capacity: u64,
}

/// Per-key GCRA state: the schedule plus the newest admission instant.
///
/// The TAT alone decides every check. `last_admit` exists only so [`Algorithm::refund`] can tell
/// whether a later admission may have been scheduled against the refunded slot (in which case
/// giving it back could over-refund, and nothing is given back).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcraState {
    /// Theoretical arrival time in scaled units (ms × limit).
    pub(super) tat: u128,
    /// Highest `now` at which a check was admitted.
    pub(super) last_admit: Millis,
}

impl Gcra {
    /// A policing meter: `limit` per `period`, tolerating bursts of `burst` units at once.
    ///
    /// Rejects a `period` under 1 ms or with a sub-millisecond part and `burst * period_ms`
    /// beyond `u64` (which keeps every scaled instant inside `u128`).
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use std::time::Duration;
    /// use ringlimit::algorithms::Gcra;
    ///
    /// let ten = NonZeroU64::new(10).unwrap();
    /// assert!(Gcra::meter(ten, Duration::from_secs(1), ten).is_ok());
    /// assert!(Gcra::meter(ten, Duration::from_micros(10), ten).is_err());
    /// ```
    pub fn meter(
        limit: NonZeroU64,
        period: Duration,
        burst: NonZeroU64,
    ) -> Result<Self, AlgorithmError> {
        Self::build(GcraMode::Meter, limit, period, burst.get())
    }

    /// A shaper: `limit` per `period`, admitting callers up to `queue_depth` emission intervals
    /// ahead of schedule and telling them how long to wait. `queue_depth = 0` only admits
    /// callers that need not wait.
    ///
    /// A request of cost `n` must fit the queue as a whole: it is admitted iff its wait is at
    /// most `(queue_depth + 1 - n) * T`; for `n = 1` that is the usual `wait <= queue_depth * T`.
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use std::time::Duration;
    /// use ringlimit::algorithms::{Algorithm, Gcra, GcraState};
    ///
    /// let shaper = Gcra::shaper(NonZeroU64::new(100).unwrap(), Duration::from_secs(60), 3).unwrap();
    /// let mut s = GcraState::default();
    /// let delays: Vec<u64> =
    ///     (0..4).map(|_| shaper.check(&mut s, 0, NonZeroU64::MIN).delay_ms).collect();
    /// assert_eq!(delays, [0, 600, 1200, 1800]);
    /// assert_eq!(shaper.check(&mut s, 0, NonZeroU64::MIN).retry_after_ms, 600);
    /// ```
    pub fn shaper(
        limit: NonZeroU64,
        period: Duration,
        queue_depth: u64,
    ) -> Result<Self, AlgorithmError> {
        let capacity = queue_depth.checked_add(1).ok_or(AlgorithmError::TooLarge {
            param: "queue_depth",
            max: u64::MAX - 1,
        })?;
        Self::build(GcraMode::Shaper, limit, period, capacity)
    }

    fn build(
        mode: GcraMode,
        limit: NonZeroU64,
        period: Duration,
        capacity: u64,
    ) -> Result<Self, AlgorithmError> {
        let period_ms = whole_millis(period, "period")?;
        // tau = capacity * T must fit u64 so that `now * limit + tau` fits u128.
        if capacity.checked_mul(period_ms).is_none() {
            return Err(AlgorithmError::TooLarge {
                param: match mode {
                    GcraMode::Meter => "burst * period_ms",
                    GcraMode::Shaper => "(queue_depth + 1) * period_ms",
                },
                max: u64::MAX,
            });
        }
        Ok(Gcra {
            mode,
            limit: limit.get(),
            period_ms,
            capacity,
        })
    }

    /// Meter or shaper.
    pub fn mode(&self) -> GcraMode {
        self.mode
    }

    /// Burst tolerance `tau` in scaled units.
    pub(super) fn tau(&self) -> u128 {
        u128::from(self.capacity) * u128::from(self.period_ms)
    }

    /// When the schedule of `state` is idle again (its TAT, rounded up to whole ms): a
    /// peek's reset, which takes nothing.
    pub fn idle_at(&self, state: &GcraState) -> Millis {
        clamp_millis(self.ceil_ms(state.tat))
    }

    /// A scaled instant rounded up to whole ms.
    fn ceil_ms(&self, scaled: u128) -> u128 {
        scaled.div_ceil(u128::from(self.limit))
    }
}

impl Algorithm for Gcra {
    type State = GcraState;

    /// Virtual scheduling: compare how far ahead of `now` the schedule would end with this
    /// request against the tolerance `tau`.
    fn check(&self, state: &mut GcraState, now: Millis, cost: NonZeroU64) -> Decision {
        let u = u128::from(now) * u128::from(self.limit);
        let tau = self.tau();
        let base = state.tat.max(u);
        let wait = base - u;
        let need = u128::from(cost.get()) * u128::from(self.period_ms);
        let allowed = wait.saturating_add(need) <= tau;
        let (retry_after_ms, delay_ms) = if allowed {
            state.tat = base + need;
            state.last_admit = state.last_admit.max(now);
            let delay = match self.mode {
                GcraMode::Meter => 0,
                GcraMode::Shaper => clamp_millis(self.ceil_ms(wait)),
            };
            (0, delay)
        } else if cost.get() > self.capacity {
            (NEVER, 0)
        } else {
            // Earliest t with TAT + n*T - t*limit <= tau (TAT is ahead of t there, since n*T <= tau).
            let admit = self.ceil_ms(state.tat + need - tau);
            (retry_from(admit, now), 0)
        };
        let wait_after = state.tat.max(u) - u;
        let remaining = (tau - wait_after.min(tau)) / u128::from(self.period_ms);
        Decision {
            allowed,
            limit: self.capacity,
            remaining: clamp_millis(remaining), // <= capacity, so never actually clamped
            retry_after_ms,
            reset_at_ms: now.max(clamp_millis(self.ceil_ms(state.tat))),
            window_id: None,
            delay_ms,
        }
    }

    /// Moves the schedule back by `n*T`, but only while no admission at a *later* instant than
    /// `at` has happened: such an admission may have been scheduled from an idle point that the
    /// refunded slot no longer influences, and pulling the TAT back would then hand out time that
    /// was never lent. In that case nothing is refunded (safe, possibly stingy).
    fn refund(&self, state: &mut GcraState, at: Millis, cost: NonZeroU64) {
        if at != state.last_admit {
            return;
        }
        let back = u128::from(cost.get()) * u128::from(self.period_ms);
        state.tat = state.tat.saturating_sub(back);
    }

    /// Once the schedule is idle (and the refund bookkeeping is in the past) the state is
    /// indistinguishable from a fresh one.
    fn expires_at(&self, state: &GcraState) -> Millis {
        clamp_millis(self.ceil_ms(state.tat)).max(state.last_admit)
    }

    /// A request larger than the tolerance can never fit, however long it waits.
    fn max_cost(&self) -> u64 {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::testkit::{self, nz, Op};
    use proptest::prelude::*;

    fn meter(limit: u64, period_ms: u64, burst: u64) -> Gcra {
        Gcra::meter(nz(limit), Duration::from_millis(period_ms), nz(burst)).unwrap()
    }

    fn shaper(limit: u64, period_ms: u64, queue: u64) -> Gcra {
        Gcra::shaper(nz(limit), Duration::from_millis(period_ms), queue).unwrap()
    }

    #[test]
    fn meter_admits_the_burst_then_rejects_with_one_emission_interval() {
        let g = meter(100, 60_000, 3); // T = 600 ms
        let mut s = GcraState::default();
        for (i, remaining) in [2, 1, 0].into_iter().enumerate() {
            let d = g.check(&mut s, 0, nz(1));
            assert!(d.allowed, "request {i}");
            assert_eq!((d.limit, d.remaining, d.delay_ms), (3, remaining, 0));
        }
        let d = g.check(&mut s, 0, nz(1));
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, 600);
        assert_eq!(d.reset_at_ms, 1_800);
        // Exactly on schedule afterwards: one every 600 ms.
        assert!(!g.check(&mut s, 599, nz(1)).allowed);
        assert!(g.check(&mut s, 600, nz(1)).allowed);
        assert_eq!(g.check(&mut s, 600, nz(1)).retry_after_ms, 600);
    }

    #[test]
    fn shaper_delays_by_the_queue_position_then_rejects() {
        let g = shaper(100, 60_000, 3);
        let mut s = GcraState::default();
        for expected in [0, 600, 1_200, 1_800] {
            let d = g.check(&mut s, 0, nz(1));
            assert!(d.allowed);
            assert_eq!(d.delay_ms, expected);
            assert_eq!(d.limit, 4);
        }
        let d = g.check(&mut s, 0, nz(1));
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, 600);
        // At 600 ms one slot has drained: admitted with a 1800 ms wait.
        let d = g.check(&mut s, 600, nz(1));
        assert_eq!((d.allowed, d.delay_ms, d.remaining), (true, 1_800, 0));
    }

    #[test]
    fn shaper_with_zero_queue_only_admits_callers_on_schedule() {
        let g = shaper(2, 1_000, 0); // T = 500 ms
        let mut s = GcraState::default();
        assert!(g.check(&mut s, 0, nz(1)).allowed);
        let d = g.check(&mut s, 100, nz(1));
        assert_eq!((d.allowed, d.retry_after_ms), (false, 400));
        assert_eq!(g.check(&mut s, 500, nz(1)).delay_ms, 0);
    }

    #[test]
    fn fractional_emission_interval_is_exact() {
        let g = meter(3, 1_000, 3); // T = 333.33... ms
        let mut s = GcraState::default();
        for _ in 0..3 {
            assert!(g.check(&mut s, 0, nz(1)).allowed); // TAT = 1000 ms exactly
        }
        // Thirds of a second, each rounded up, never drifting: 334, 667, 1000.
        for (t, retry) in [(334, 334), (667, 333), (1_000, 333)] {
            let prev = t - retry;
            assert_eq!(g.check(&mut s, prev, nz(1)).retry_after_ms, retry);
            assert!(!g.check(&mut s, t - 1, nz(1)).allowed);
            assert!(g.check(&mut s, t, nz(1)).allowed);
        }
    }

    #[test]
    fn backwards_clock_step_is_only_stricter() {
        let g = meter(10, 1_000, 2); // T = 100 ms
        let mut s = GcraState::default();
        assert!(g.check(&mut s, 10_000, nz(2)).allowed);
        let d = g.check(&mut s, 5_000, nz(1));
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, 5_100);
    }

    #[test]
    fn refund_right_after_the_check_restores_exactly_the_refunded_units() {
        let g = meter(10, 1_000, 5);
        let mut s = GcraState::default();
        assert!(g.check(&mut s, 0, nz(2)).allowed);
        assert!(g.check(&mut s, 0, nz(3)).allowed);
        g.refund(&mut s, 0, nz(3));
        assert_eq!(g.check(&mut s.clone(), 0, nz(1)).remaining, 2);
        assert!(!g.check(&mut s.clone(), 0, nz(4)).allowed);
        assert!(g.check(&mut s, 0, nz(3)).allowed);
    }

    #[test]
    fn refund_after_a_later_admission_gives_nothing_back() {
        // Without the guard this would over-refund: B at 100 ms was scheduled behind A, but
        // without A it would have started at 100 ms anyway.
        let g = meter(10, 1_000, 5); // T = 100 ms
        let mut s = GcraState::default();
        assert!(g.check(&mut s, 0, nz(2)).allowed); // TAT 200
        assert!(g.check(&mut s, 100, nz(1)).allowed); // TAT 300
        let before = s.clone();
        g.refund(&mut s, 0, nz(2));
        assert_eq!(s, before);
    }

    #[test]
    fn cost_above_the_tolerance_is_never_admitted() {
        let g = meter(10, 1_000, 3);
        let d = g.check(&mut GcraState::default(), 0, nz(4));
        assert_eq!(
            (d.allowed, d.retry_after_ms, d.remaining),
            (false, NEVER, 3)
        );
        assert_eq!(shaper(10, 1_000, 3).max_cost(), 4);
    }

    #[test]
    fn rejects_parameters_the_integer_math_cannot_hold() {
        assert!(Gcra::shaper(nz(1), Duration::from_millis(1), u64::MAX).is_err());
        let e = Gcra::meter(nz(1), Duration::from_millis(3), nz(u64::MAX)).unwrap_err();
        assert!(e.to_string().contains("burst"));
        assert!(Gcra::meter(nz(u64::MAX), Duration::from_millis(1), nz(u64::MAX)).is_ok());
    }

    /// Brute-force model: the TAT unrolled over the whole admitted history,
    /// `TAT = max_k (t_k * limit + T * sum of costs admitted since k)`, recomputed every time.
    struct Model {
        g: Gcra,
        admitted: Vec<(Millis, u64)>,
    }

    impl Model {
        fn tat(&self) -> u128 {
            let mut tat = 0u128;
            let mut since = 0u128;
            for &(t, c) in self.admitted.iter().rev() {
                since += u128::from(c);
                let end =
                    u128::from(t) * u128::from(self.g.limit) + since * u128::from(self.g.period_ms);
                tat = tat.max(end);
            }
            tat
        }

        /// (allowed, remaining, delay_ms)
        fn check(&mut self, now: Millis, cost: u64) -> (bool, u64, u64) {
            let u = u128::from(now) * u128::from(self.g.limit);
            let t = u128::from(self.g.period_ms);
            let wait = self.tat().saturating_sub(u);
            let allowed = wait + u128::from(cost) * t <= u128::from(self.g.capacity) * t;
            if allowed {
                self.admitted.push((now, cost));
            }
            let wait_after = self.tat().saturating_sub(u);
            let remaining = (u128::from(self.g.capacity) * t).saturating_sub(wait_after) / t;
            let delay = match (allowed, self.g.mode) {
                (true, GcraMode::Shaper) => wait.div_ceil(u128::from(self.g.limit)),
                _ => 0,
            };
            (allowed, remaining as u64, delay as u64)
        }
    }

    fn small_gcra() -> impl Strategy<Value = Gcra> {
        (any::<bool>(), 1u64..50, 1u64..5_000, 0u64..8).prop_map(|(m, l, p, b)| {
            if m {
                meter(l, p, b + 1)
            } else {
                shaper(l, p, b)
            }
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn matches_brute_force_model(
            g in small_gcra(), start in 0u64..10_000_000, ops in testkit::ops(400, 10, 60)
        ) {
            let mut model = Model { g: g.clone(), admitted: Vec::new() };
            let mut s = GcraState::default();
            let mut now = start;
            for op in &ops {
                now = op.advance(now);
                let d = g.check(&mut s, now, nz(op.cost));
                let (allowed, remaining, delay) = model.check(now, op.cost);
                prop_assert_eq!((d.allowed, d.remaining, d.delay_ms), (allowed, remaining, delay),
                    "at {} cost {}", now, op.cost);
                testkit::assert_sane(&d, now)?;
                testkit::assert_retry_exact(&g, &s, now, nz(op.cost), &d)?;
                // reset_at: the first instant from which a full `limit` is admissible.
                let mut probe = s.clone();
                prop_assert_eq!(g.check(&mut probe, d.reset_at_ms, nz(g.capacity)).allowed, true);
                if d.reset_at_ms > now {
                    let mut probe = s.clone();
                    prop_assert!(!g.check(&mut probe, d.reset_at_ms - 1, nz(g.capacity)).allowed);
                }
            }
        }

        #[test]
        fn expired_state_behaves_like_a_fresh_one(
            g in small_gcra(), start in 0u64..1_000_000,
            history in testkit::ops(300, 8, 30), probes in testkit::ops(300, 8, 20)
        ) {
            testkit::assert_expires_like_fresh(&g, start, &history, &probes)?;
        }

        #[test]
        fn refund_never_over_refunds(
            g in small_gcra(), start in 0u64..1_000_000,
            before in testkit::ops(300, 5, 20), step in 0u64..300, cost in 1u64..5,
            after in testkit::ops(300, 5, 10), probes in testkit::ops(300, 5, 10)
        ) {
            let refunded = Op { back: false, step, cost };
            testkit::assert_refund_never_over_refunds(&g, start, &before, refunded, &after, &probes)?;
            testkit::assert_immediate_refund_is_exact(&g, start, &before, refunded)?;
        }

        #[test]
        fn never_panics_on_any_input(
            shaping in any::<bool>(),
            l in testkit::wild_u64(), p in testkit::wild_u64(), b in testkit::wild_u64(),
            calls in prop::collection::vec((testkit::wild_u64(), testkit::wild_u64(), any::<bool>()), 1..20)
        ) {
            let period = Duration::from_millis(p);
            let built = if shaping {
                Gcra::shaper(nz(l.max(1)), period, b)
            } else {
                Gcra::meter(nz(l.max(1)), period, nz(b.max(1)))
            };
            if let Ok(g) = built {
                testkit::assert_total(&g, &calls)?;
            }
        }
    }
}
