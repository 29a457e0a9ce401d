//! Which limiters may lend a slice of their budget ahead of the checks that spend it
//! (budget leases, `docs/leases.md`), and for how long.
//!
//! A budget lease is units charged on the owner now and spent by an entry node later.
//! That is exact only where spending a unit later than it was charged cannot let more
//! through than the algorithm promises:
//!
//! - fixed window and sliding window counter: exact as long as every unit is spent in
//!   the window it was charged in, so a lease ends at that window's end;
//! - token bucket and GCRA meter: what the owner charges is exactly what its rule
//!   admits, and a spend comes at most one lease TTL after its charge;
//! - sliding window log: never. It promises `limit` in *any* window of length `W`,
//!   and does so by remembering the instant of every admission; a unit charged at `t`
//!   and spent at `t + d` would be forgotten by the log at `t + W` while the request it
//!   admitted is only `W - d` old, so the log would admit again too early;
//! - GCRA shaper: never. Its answer is a delay the caller must wait, computed from the
//!   schedule at the moment of the check; a lease spent later has no such schedule.

use super::{GcraMode, Limiter, Millis};

impl Limiter {
    /// When a lease of this limiter's budget, charged at `now` in window `window_id`
    /// (the charging decision's), must be spent by: `now + ttl_ms`, or the end of that
    /// window if sooner. `None` when this algorithm never leases (see the module).
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use std::time::Duration;
    /// use ringlimit::algorithms::{FixedWindow, Limiter};
    ///
    /// let fw = Limiter::FixedWindow(
    ///     FixedWindow::new(NonZeroU64::new(100).unwrap(), Duration::from_secs(60)).unwrap(),
    /// );
    /// assert_eq!(fw.lease_until(Some(0), 1_000, 1_000), Some(2_000));
    /// assert_eq!(fw.lease_until(Some(0), 59_500, 1_000), Some(60_000), "the window's end");
    /// ```
    pub fn lease_until(&self, window_id: Option<u64>, now: Millis, ttl_ms: u64) -> Option<Millis> {
        let by_ttl = now.saturating_add(ttl_ms);
        let window_ms = match self {
            Limiter::FixedWindow(a) => a.window_ms,
            Limiter::SlidingWindowCounter(a) => a.window_ms,
            Limiter::TokenBucket(_) => return Some(by_ttl),
            Limiter::LeakyBucket(a) if a.mode == GcraMode::Meter => return Some(by_ttl),
            Limiter::LeakyBucket(_) | Limiter::SlidingWindowLog(_) => return None,
        };
        let window = window_id.unwrap_or(now / window_ms);
        let end = window.saturating_add(1).saturating_mul(window_ms);
        Some(by_ttl.min(end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::{Gcra, SlidingCounter, SlidingLog, TokenBucket};
    use std::num::NonZeroU64;
    use std::time::Duration;

    fn n(v: u64) -> NonZeroU64 {
        NonZeroU64::new(v).unwrap()
    }

    #[test]
    fn window_algorithms_lease_until_the_window_ends_the_others_for_the_ttl_or_never() {
        let second = Duration::from_secs(1);
        let sc = Limiter::SlidingWindowCounter(SlidingCounter::new(n(10), second * 10).unwrap());
        assert_eq!(sc.lease_until(Some(2), 29_900, 1_000), Some(30_000));
        let tb = Limiter::TokenBucket(TokenBucket::new(n(10), n(10), second).unwrap());
        assert_eq!(tb.lease_until(None, 5, 1_000), Some(1_005));
        let meter = Limiter::LeakyBucket(Gcra::meter(n(10), second, n(5)).unwrap());
        assert_eq!(meter.lease_until(None, 5, 300), Some(305));
        let shaper = Limiter::LeakyBucket(Gcra::shaper(n(10), second, 5).unwrap());
        assert_eq!(shaper.lease_until(None, 5, 300), None);
        let log = Limiter::SlidingWindowLog(SlidingLog::new(n(10), second).unwrap());
        assert_eq!(log.lease_until(None, 5, 300), None);
    }
}
