//! The two client-side pieces that keep a correct rejection from taking a service
//! down (design reference, "The retry storm, derived"):
//!
//! - **Full jitter.** Wait a uniformly random time in `[0, min(cap, base × 2^attempt))`
//!   instead of the delay itself. A hundred thousand clients rejected together then
//!   return spread over the whole delay instead of within the ~10 ms their timers
//!   differ by: 100× less peak for one line of code. Exponential backoff alone does
//!   nothing about a herd; the uniform draw is the point.
//! - **A retry budget.** Retries only in proportion to recent successes: each success
//!   deposits `ratio` tokens, a retry costs one, an empty budget refuses. With a 10 %
//!   ratio steady load tops out at 1.1× the request rate; during a total outage only
//!   the seed is spendable, so 100,000 failing requests with a seed of 10 cost at most
//!   100,010 calls: 1.0001×.

use std::time::Duration;

/// The design reference's defaults: 0.5 s base, 30 s cap.
pub const JITTER_BASE: Duration = Duration::from_millis(500);
/// See [`JITTER_BASE`].
pub const JITTER_CAP: Duration = Duration::from_secs(30);

/// Full jitter for retry `attempt` (0 for the first retry), given a uniform draw
/// `unit` in `[0, 1)`: `unit × min(cap, base × 2^attempt)`.
pub fn full_jitter(attempt: u32, base: Duration, cap: Duration, unit: f64) -> Duration {
    let ceiling = base
        .checked_mul(2u32.saturating_pow(attempt.min(31)))
        .unwrap_or(cap)
        .min(cap);
    ceiling.mul_f64(unit.clamp(0.0, 1.0))
}

/// A seeded source of full-jitter waits (xorshift64*: spread, not secrecy; seed it per
/// client, e.g. from the process id and time, so clients do not draw in step).
#[derive(Debug, Clone)]
pub struct Jitter {
    state: u64,
    base: Duration,
    cap: Duration,
}

impl Jitter {
    /// Waits with the design reference's base and cap, drawn from `seed`.
    pub fn new(seed: u64) -> Self {
        Self::with(seed, JITTER_BASE, JITTER_CAP)
    }

    /// Waits with `base` and `cap`, drawn from `seed`.
    pub fn with(seed: u64, base: Duration, cap: Duration) -> Self {
        Self {
            state: seed ^ 0x9E37_79B9_7F4A_7C15 | 1,
            base,
            cap,
        }
    }

    /// A uniform draw in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// How long to wait before retry `attempt` (0 for the first retry).
    pub fn delay(&mut self, attempt: u32) -> Duration {
        let unit = self.unit();
        full_jitter(attempt, self.base, self.cap, unit)
    }

    /// A wait for a denial that said "retry after `retry_after`": a uniform draw in
    /// `[retry_after, 2 × retry_after)`, so clients told the same thing at the same
    /// moment do not return together, and none returns before it may succeed.
    pub fn after(&mut self, retry_after: Duration) -> Duration {
        retry_after + retry_after.mul_f64(self.unit())
    }
}

/// Retries funded by successes (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct RetryBudget {
    ratio: f64,
    tokens: f64,
}

impl Default for RetryBudget {
    /// The design reference's numbers: 10 % of successes, a seed of 10.
    fn default() -> Self {
        Self::new(0.1, 10.0)
    }
}

impl RetryBudget {
    /// A budget depositing `ratio` per success, starting with `seed` tokens.
    pub fn new(ratio: f64, seed: f64) -> Self {
        Self {
            ratio: ratio.max(0.0),
            tokens: seed.max(0.0),
        }
    }

    /// A request succeeded: deposit `ratio`.
    pub fn record_success(&mut self) {
        self.tokens += self.ratio;
    }

    /// May this failure be retried? Costs one token when yes; an empty budget refuses
    /// and never goes negative.
    pub fn allow_retry(&mut self) -> bool {
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        true
    }

    /// Tokens left.
    pub fn tokens(&self) -> f64 {
        self.tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_jitter_is_a_uniform_draw_under_the_capped_exponential() {
        let (base, cap) = (JITTER_BASE, JITTER_CAP);
        assert_eq!(full_jitter(0, base, cap, 0.0), Duration::ZERO);
        assert_eq!(full_jitter(0, base, cap, 0.5), Duration::from_millis(250));
        assert_eq!(full_jitter(3, base, cap, 0.5), Duration::from_secs(2));
        // 0.5 × 2^6 = 32 s, capped at 30 s.
        assert_eq!(full_jitter(6, base, cap, 1.0), Duration::from_secs(30));
        assert_eq!(
            full_jitter(u32::MAX, base, cap, 0.5),
            Duration::from_secs(15)
        );
    }

    /// The design reference's retry storm: 100,000 clients told "retry after 1 s" whose
    /// timers fire within 10 ms land 100,000 in one 10 ms span (10,000,000/s); with full
    /// jitter over the second the busiest 10 ms span holds about 1,000 (100,000/s).
    #[test]
    fn full_jitter_spreads_a_herd_of_100000_over_the_whole_delay() {
        let mut buckets = vec![0u32; 100];
        for client in 0..100_000u64 {
            let mut jitter = Jitter::with(client, Duration::from_secs(1), Duration::from_secs(1));
            let wait = jitter.delay(0);
            assert!(wait < Duration::from_secs(1));
            buckets[(wait.as_millis() / 10) as usize] += 1;
        }
        let peak = *buckets.iter().max().unwrap();
        // Uniform: 1,000 per 10 ms on average; the busiest within a few percent.
        assert!((1_000..=1_150).contains(&peak), "peak {peak} per 10 ms");
        let amplification_removed = 100_000.0 / f64::from(peak);
        assert!(amplification_removed > 85.0, "{amplification_removed}");
    }

    #[test]
    fn waiting_after_a_denial_never_returns_early() {
        let mut jitter = Jitter::new(7);
        for _ in 0..1_000 {
            let wait = jitter.after(Duration::from_secs(6));
            assert!(wait >= Duration::from_secs(6) && wait < Duration::from_secs(12));
        }
    }

    /// Total outage: 100,000 requests, every one failing. Only the seed is spendable.
    #[test]
    fn a_retry_budget_of_10_percent_seed_10_costs_1_0001x_in_a_total_outage() {
        let mut budget = RetryBudget::default();
        let requests = 100_000u64;
        let mut calls = 0u64;
        for _ in 0..requests {
            calls += 1;
            // The call failed; retry while the budget allows (every retry fails too).
            while budget.allow_retry() {
                calls += 1;
            }
        }
        assert_eq!(calls, 100_010);
        assert_eq!(calls as f64 / requests as f64, 1.0001);
        assert_eq!(budget.tokens(), 0.0, "never negative");
    }

    /// Steady state: half the requests fail once; a retry, when funded, succeeds. The
    /// retries can never exceed a tenth of the successes, so load stays ≤ 1.1× (here
    /// about 1.056×: the retries fund themselves only a little).
    #[test]
    fn a_retry_budget_of_10_percent_tops_out_at_1_1x_load() {
        let mut budget = RetryBudget::new(0.1, 0.0);
        let requests = 100_000u64;
        let mut calls = 0u64;
        for i in 0..requests {
            calls += 1;
            if i % 2 == 0 {
                budget.record_success();
            } else if budget.allow_retry() {
                calls += 1;
                budget.record_success();
            }
        }
        let load = calls as f64 / requests as f64;
        assert!(load <= 1.1 + 1e-9 && load > 1.05, "load {load}");
    }
}
