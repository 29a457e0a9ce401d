//! Where "now" comes from.
//!
//! Algorithms never read a clock: they take `now` as an argument. The shard actor reads
//! a [`Clock`] once per message and passes the value down, so tests drive time with a
//! [`ManualClock`] and production uses [`SystemClock`].
//!
//! The unit is wall-clock Unix milliseconds, not a process-local monotonic instant,
//! because state handed to another node (scale-out, graceful leave) must mean the same
//! thing there, and fixed windows must start at the same instant on every node. Wall
//! time can step backwards (NTP); [`Clamped`] makes the reading never decrease within a
//! shard, and every algorithm state clamps again per key, so a backward step freezes a
//! window instead of opening a fresh one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::algorithms::Millis;

/// A source of wall-clock time in Unix milliseconds, and of a monotonic reading.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current time. May go backwards; callers clamp.
    fn now_ms(&self) -> Millis;

    /// Milliseconds since an arbitrary origin of this process, never stepped by NTP or
    /// an operator: for waits measured on this node only (the deny cache's "denied for
    /// another 900 ms"), so a wall-clock step cannot stretch or cut them.
    fn monotonic_ms(&self) -> Millis;
}

/// The operating system's wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> Millis {
        // A clock before 1970 is a broken machine; reading 0 then clamps harmlessly.
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as Millis)
            .unwrap_or(0)
    }

    fn monotonic_ms(&self) -> Millis {
        static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        ORIGIN
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_millis() as Millis
    }
}

/// A clock that only moves when told to: tests step it forwards and backwards.
#[derive(Debug, Default, Clone)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock showing `start` until moved.
    pub fn new(start: Millis) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(start)),
        }
    }

    /// Set the time, including backwards (to test clamping).
    pub fn set(&self, now: Millis) {
        self.now.store(now, Ordering::SeqCst);
    }

    /// Move the time forwards by `ms`.
    pub fn advance(&self, ms: u64) {
        self.now.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> Millis {
        self.now.load(Ordering::SeqCst)
    }

    /// Moves with the wall reading (tests step both at once; a backward `set` is a
    /// test's own business).
    fn monotonic_ms(&self) -> Millis {
        self.now.load(Ordering::SeqCst)
    }
}

/// A per-shard high-water mark over a clock: readings never decrease.
///
/// Owned by exactly one shard actor, so it needs no synchronisation.
#[derive(Debug)]
pub struct Clamped {
    clock: Arc<dyn Clock>,
    high: Millis,
}

impl Clamped {
    /// Wrap `clock`; the first reading starts the high-water mark.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self { clock, high: 0 }
    }

    /// The clock's reading, or the highest reading seen so far if the clock stepped back.
    pub fn now_ms(&mut self) -> Millis {
        self.high = self.high.max(self.clock.now_ms());
        self.high
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clamped_clock_never_runs_backwards() {
        let manual = ManualClock::new(10_000);
        let mut clamped = Clamped::new(Arc::new(manual.clone()));
        assert_eq!(clamped.now_ms(), 10_000);
        manual.set(9_000);
        assert_eq!(clamped.now_ms(), 10_000, "a backward step freezes time");
        manual.set(10_500);
        assert_eq!(clamped.now_ms(), 10_500);
    }

    #[test]
    fn system_clock_reads_plausible_unix_millis() {
        // 2020-01-01 as a sanity floor: catches seconds-vs-millis mistakes.
        assert!(SystemClock.now_ms() > 1_577_836_800_000);
    }
}
