//! Pure rate-limiting algorithms: state in, decision out.
//!
//! Everything here is synchronous, allocation-light and free of I/O. The shard actor owns the
//! per-key states and calls [`Limiter::check`]; nothing in this module reads a clock, spawns a
//! task or knows about the network, so every behaviour below can be tested on a manual clock.
//!
//! # The five algorithms
//!
//! | kind | type | what it bounds | worst case at a boundary |
//! |---|---|---|---|
//! | `token_bucket` | [`TokenBucket`] | average rate, with a deliberate burst of `capacity` | `capacity + refill` per period |
//! | `leaky_bucket` | [`Gcra`] | the *shape*: one unit per emission interval `T = period / limit` | `burst` at once (meter) or a queue of `queue_depth` (shaper) |
//! | `fixed_window` | [`FixedWindow`] | `limit` per clock-aligned window | `2 * limit` back to back across a boundary |
//! | `sliding_window_log` | [`SlidingLog`] | `limit` in *any* window of length `W` (exact) | none |
//! | `sliding_window_counter` | [`SlidingCounter`] | weighted estimate of the trailing window | `2 * limit` in theory, paced in practice |
//!
//! * **Token bucket** – a bucket of `capacity` tokens refilled lazily at `refill / period`; a fresh
//!   key starts full, so the first `capacity` units may land in one millisecond.
//! * **Leaky bucket as GCRA** – virtual scheduling: one "theoretical arrival time" (TAT) replaces
//!   the queue. The *meter* rejects early arrivals, the *shaper* admits them with a delay.
//! * **Fixed window** – one counter per aligned window `now / W`. Cheapest; admits `2L` across a
//!   boundary, which the tests pin down with the reference's 12:00:59.700 example.
//! * **Sliding window log** – the exact one: remembers every *admitted* `(time, cost)` and
//!   counts the ones younger than `W`.
//! * **Sliding window counter** – two counters and the estimate
//!   `prev * (1 - f) + curr`, evaluated in integers as `prev * (W - e) + curr * W <= L * W`.
//!
//! # Shared contract
//!
//! * **Time is an argument.** Every call receives `now` as Unix milliseconds ([`Millis`]).
//!   The caller (the shard) reads its clock once per message.
//! * **Exact integer math.** No floats anywhere: fractions are kept exact by scaling (token
//!   levels are scaled by the period, GCRA time by the limit, the sliding estimate by `W`) and
//!   products are taken in `u128` or checked. Constructors reject parameters whose products
//!   could overflow, so no input (any `now`, any `cost`) can panic.
//! * **`retry_after_ms` is exact.** When denied, it is the smallest whole `d` for which the same
//!   request would be admitted at `now + d` if nothing else arrives; never rounded down. When no
//!   such `d` exists (a cost above [`Algorithm::max_cost`], or an instant beyond `u64::MAX`) it is
//!   [`NEVER`].
//! * **Time never runs backwards inside a state.** Each state keeps enough to clamp `now` to the
//!   highest time it has acted on (a window index, a `last` timestamp, a high-water mark). A wall
//!   clock stepping back across a window boundary therefore freezes the window instead of
//!   handing out a fresh budget. GCRA needs no extra field: its verdict is monotone in `now`, so
//!   an earlier `now` is only ever stricter.
//! * **A decision is data, not an error.** Denials are ordinary [`Decision`]s; only invalid
//!   *parameters* are errors ([`AlgorithmError`]).
//! * **Refunds never over-refund.** [`Algorithm::refund`] gives back at most what the state still
//!   remembers of the refunded check, so a refunded state is never more generous than one on
//!   which the check never happened. Window algorithms refund while the check's window (or log
//!   entry) is still held. The token bucket (while no later `now` was applied) and GCRA (while
//!   no later admission happened) refund exactly — the usual case: refund right after a sibling
//!   descriptor denied — and refund nothing after that, because an intervening refill or idle
//!   schedule may already have absorbed the refunded units.
//!
//! # State size per key
//!
//! | algorithm | state | bytes |
//! |---|---|---|
//! | token bucket | deficit (scaled tokens) + last update | 16 |
//! | GCRA (meter / shaper) | TAT (`u128`, ms × limit) + newest admission time | 32 (24 of data) |
//! | fixed window | window index + count | 16 |
//! | sliding window log | `VecDeque<(ms, cost)>` + running sum + high-water mark | 48 + 16 per distinct admitted ms (≤ `limit` entries) |
//! | sliding window counter | window index + previous + current count | 24 |

use std::fmt;
use std::num::NonZeroU64;
use std::str::FromStr;
use std::time::Duration;

mod fixed_window;
mod gcra;
mod join;
mod leasing;
mod merge;
mod portable;
mod sliding_counter;
mod sliding_log;
mod token_bucket;

pub use fixed_window::{FixedWindow, FixedWindowState};
pub use gcra::{Gcra, GcraMode, GcraState};
pub use portable::{Implausible, Words};
pub use sliding_counter::{SlidingCounter, SlidingCounterState};
pub use sliding_log::{SlidingLog, SlidingLogState, MAX_SLIDING_LOG_LIMIT};
pub use token_bucket::{TokenBucket, TokenBucketState};

/// Unix milliseconds (wall clock). Time always arrives as an argument; nothing here reads a
/// clock, which is what makes the algorithms testable on a manual clock.
pub type Millis = u64;

/// `retry_after_ms` value meaning "this request can never be admitted": its cost exceeds
/// [`Algorithm::max_cost`] (or the admitting instant would lie beyond `u64::MAX` ms). Callers
/// should treat it as invalid input rather than tell a client to wait 584 million years.
pub const NEVER: u64 = u64::MAX;

/// The outcome of one check: everything a gateway needs to answer and to render
/// `RateLimit-*` / `Retry-After` headers, so callers never have to re-derive algorithm internals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request may proceed (possibly after `delay_ms`, for the GCRA shaper).
    pub allowed: bool,
    /// Units a fresh (full) state admits at once: the rule limit; token bucket: capacity;
    /// GCRA meter: burst; GCRA shaper: `queue_depth + 1`.
    pub limit: u64,
    /// Units still admissible right now after this decision (`0..=limit`).
    pub remaining: u64,
    /// 0 when allowed; when denied, the smallest whole `d` such that the same request would be
    /// admitted at `now + d` if nothing else arrives ([`NEVER`] if no such `d`).
    pub retry_after_ms: u64,
    /// Instant at which the state is back to full (`limit` available again).
    pub reset_at_ms: Millis,
    /// Fixed window and sliding counter: the index of the window the decision was counted in
    /// (`now / window_ms`, clamped so it never decreases). `None` for the others.
    pub window_id: Option<u64>,
    /// GCRA shaper only: how long the admitted caller must wait before proceeding; else 0.
    pub delay_ms: u64,
}

impl Decision {
    /// `Retry-After` is specified in whole seconds; rounding up keeps a client that obeys it
    /// from arriving early and being denied again.
    ///
    /// ```
    /// # use ringlimit::algorithms::Decision;
    /// let d = Decision { allowed: false, limit: 100, remaining: 0, retry_after_ms: 5667,
    ///                    reset_at_ms: 0, window_id: None, delay_ms: 0 };
    /// assert_eq!(d.retry_after_secs(), 6);
    /// ```
    pub fn retry_after_secs(&self) -> u64 {
        self.retry_after_ms.div_ceil(1000)
    }
}

/// One rate-limiting algorithm: immutable parameters (`self`) applied to a small per-key state.
///
/// Splitting parameters from state keeps the per-key footprint to plain data the shard can
/// store, expire and (later) migrate, while the rule's parameters live once per rule.
pub trait Algorithm {
    /// Per-key state. `Default` is the state of a key never seen before, which is why the store
    /// may drop any state once [`Algorithm::expires_at`] has passed.
    type State: Default + Clone + fmt::Debug + PartialEq;

    /// Decides whether `cost` units may pass at `now`, updating `state` only when admitted
    /// (plus the clamping bookkeeping that keeps time from running backwards).
    fn check(&self, state: &mut Self::State, now: Millis, cost: NonZeroU64) -> Decision;

    /// Undo an admitted check (made at `at` with `cost`) because another descriptor of the same
    /// request denied. Must never over-refund: afterwards the state may never admit more than if
    /// the check had not happened. If the window has rolled past, refund what the state still
    /// remembers (possibly nothing).
    fn refund(&self, state: &mut Self::State, at: Millis, cost: NonZeroU64);

    /// Earliest instant from which `state` behaves exactly like `State::default()`, so the store
    /// may drop it (TTL expiry) without changing any future decision at or after that instant.
    fn expires_at(&self, state: &Self::State) -> Millis;

    /// Largest cost a single check can ever be admitted with; a larger cost can never succeed,
    /// so the server refuses it as invalid input instead of returning a misleading retry time.
    fn max_cost(&self) -> u64;
}

/// Stable names of the algorithms, used in configuration, metrics labels, logs and between
/// peers. The one table of names: [`AlgorithmKind::as_str`] spells each kind and parsing
/// (`str::parse` or [`AlgorithmKind::parse`]) reads it back, so a name is written once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AlgorithmKind {
    /// See [`TokenBucket`].
    TokenBucket,
    /// See [`Gcra`] (meter or shaper).
    LeakyBucket,
    /// See [`FixedWindow`].
    FixedWindow,
    /// See [`SlidingLog`].
    SlidingWindowLog,
    /// See [`SlidingCounter`].
    SlidingWindowCounter,
}

impl AlgorithmKind {
    /// Every kind, in a fixed order (metric handles are indexed by it).
    pub const ALL: [AlgorithmKind; 5] = [
        AlgorithmKind::TokenBucket,
        AlgorithmKind::LeakyBucket,
        AlgorithmKind::FixedWindow,
        AlgorithmKind::SlidingWindowLog,
        AlgorithmKind::SlidingWindowCounter,
    ];

    /// The kind named by [`AlgorithmKind::as_str`]'s spelling; `None` for anything else.
    /// Use `str::parse` instead where the caller should see which names exist.
    pub fn parse(name: &str) -> Option<AlgorithmKind> {
        Self::ALL.into_iter().find(|k| k.as_str() == name)
    }

    /// Position in [`AlgorithmKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The snake_case name used in rule files and metric labels; `&'static` so labelling a
    /// metric never allocates.
    ///
    /// ```
    /// # use ringlimit::algorithms::AlgorithmKind;
    /// assert_eq!(AlgorithmKind::SlidingWindowCounter.as_str(), "sliding_window_counter");
    /// ```
    pub fn as_str(&self) -> &'static str {
        match self {
            AlgorithmKind::TokenBucket => "token_bucket",
            AlgorithmKind::LeakyBucket => "leaky_bucket",
            AlgorithmKind::FixedWindow => "fixed_window",
            AlgorithmKind::SlidingWindowLog => "sliding_window_log",
            AlgorithmKind::SlidingWindowCounter => "sliding_window_counter",
        }
    }
}

impl fmt::Display for AlgorithmKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AlgorithmKind {
    type Err = UnknownAlgorithm;

    /// The inverse of [`AlgorithmKind::as_str`]; exact, case-sensitive.
    ///
    /// ```
    /// # use ringlimit::algorithms::AlgorithmKind;
    /// assert_eq!("fixed_window".parse(), Ok(AlgorithmKind::FixedWindow));
    /// assert!("FixedWindow".parse::<AlgorithmKind>().is_err());
    /// ```
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        AlgorithmKind::parse(name).ok_or_else(|| UnknownAlgorithm {
            name: name.to_owned(),
        })
    }
}

/// A name that is not in [`AlgorithmKind::ALL`]. Its message lists the valid names, so a typo
/// in a rule file is answered with the choices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownAlgorithm {
    /// The name as given.
    pub name: String,
}

impl fmt::Display for UnknownAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} is not an algorithm (use one of ", self.name)?;
        for (i, kind) in AlgorithmKind::ALL.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(kind.as_str())?;
        }
        f.write_str(")")
    }
}

impl std::error::Error for UnknownAlgorithm {}

/// A configured algorithm for one rule. An enum rather than `Box<dyn Algorithm>` so the hot
/// path is a jump table, states stay `Clone + PartialEq`, and the set of algorithms is closed.
///
/// ```
/// use std::num::NonZeroU64;
/// use std::time::Duration;
/// use ringlimit::algorithms::{FixedWindow, Limiter};
///
/// let limiter = Limiter::FixedWindow(
///     FixedWindow::new(NonZeroU64::new(2).unwrap(), Duration::from_secs(1)).unwrap());
/// let mut state = limiter.new_state();
/// let one = NonZeroU64::MIN;
/// assert!(limiter.check(&mut state, 0, one).allowed);
/// assert!(limiter.check(&mut state, 1, one).allowed);
/// let denied = limiter.check(&mut state, 2, one);
/// assert!(!denied.allowed);
/// assert_eq!(denied.retry_after_ms, 998);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Limiter {
    /// Burst-friendly average rate.
    TokenBucket(TokenBucket),
    /// GCRA meter or shaper.
    LeakyBucket(Gcra),
    /// Clock-aligned counter.
    FixedWindow(FixedWindow),
    /// Exact sliding window.
    SlidingWindowLog(SlidingLog),
    /// Two-counter sliding estimate.
    SlidingWindowCounter(SlidingCounter),
}

/// Per-key state for whichever algorithm a [`Limiter`] runs. Kept as an enum so one store can
/// hold keys of every rule; a variant mismatch (a rule changed algorithm) is handled by the
/// limiter rather than by panicking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyState {
    /// State of a [`TokenBucket`].
    TokenBucket(TokenBucketState),
    /// State of a [`Gcra`].
    LeakyBucket(GcraState),
    /// State of a [`FixedWindow`].
    FixedWindow(FixedWindowState),
    /// State of a [`SlidingLog`].
    SlidingWindowLog(SlidingLogState),
    /// State of a [`SlidingCounter`].
    SlidingWindowCounter(SlidingCounterState),
}

impl Limiter {
    /// Which algorithm this is, for labels and logs.
    pub fn kind(&self) -> AlgorithmKind {
        match self {
            Limiter::TokenBucket(_) => AlgorithmKind::TokenBucket,
            Limiter::LeakyBucket(_) => AlgorithmKind::LeakyBucket,
            Limiter::FixedWindow(_) => AlgorithmKind::FixedWindow,
            Limiter::SlidingWindowLog(_) => AlgorithmKind::SlidingWindowLog,
            Limiter::SlidingWindowCounter(_) => AlgorithmKind::SlidingWindowCounter,
        }
    }

    /// The state of a key never seen before (a full budget).
    pub fn new_state(&self) -> KeyState {
        match self {
            Limiter::TokenBucket(_) => KeyState::TokenBucket(Default::default()),
            Limiter::LeakyBucket(_) => KeyState::LeakyBucket(Default::default()),
            Limiter::FixedWindow(_) => KeyState::FixedWindow(Default::default()),
            Limiter::SlidingWindowLog(_) => KeyState::SlidingWindowLog(Default::default()),
            Limiter::SlidingWindowCounter(_) => KeyState::SlidingWindowCounter(Default::default()),
        }
    }

    /// Checks `cost` units at `now`. If `state` belongs to another algorithm (the rule was
    /// reconfigured) it is replaced by a fresh state first: the old budget cannot be translated.
    pub fn check(&self, state: &mut KeyState, now: Millis, cost: NonZeroU64) -> Decision {
        loop {
            match (self, &mut *state) {
                (Limiter::TokenBucket(a), KeyState::TokenBucket(s)) => {
                    return a.check(s, now, cost)
                }
                (Limiter::LeakyBucket(a), KeyState::LeakyBucket(s)) => {
                    return a.check(s, now, cost)
                }
                (Limiter::FixedWindow(a), KeyState::FixedWindow(s)) => {
                    return a.check(s, now, cost)
                }
                (Limiter::SlidingWindowLog(a), KeyState::SlidingWindowLog(s)) => {
                    return a.check(s, now, cost)
                }
                (Limiter::SlidingWindowCounter(a), KeyState::SlidingWindowCounter(s)) => {
                    return a.check(s, now, cost)
                }
                // Mismatch: reset, then the next iteration necessarily matches.
                _ => *state = self.new_state(),
            }
        }
    }

    /// Refunds an admitted check; a variant mismatch means the state was reset since, so there is
    /// nothing to give back.
    pub fn refund(&self, state: &mut KeyState, at: Millis, cost: NonZeroU64) {
        match (self, state) {
            (Limiter::TokenBucket(a), KeyState::TokenBucket(s)) => a.refund(s, at, cost),
            (Limiter::LeakyBucket(a), KeyState::LeakyBucket(s)) => a.refund(s, at, cost),
            (Limiter::FixedWindow(a), KeyState::FixedWindow(s)) => a.refund(s, at, cost),
            (Limiter::SlidingWindowLog(a), KeyState::SlidingWindowLog(s)) => a.refund(s, at, cost),
            (Limiter::SlidingWindowCounter(a), KeyState::SlidingWindowCounter(s)) => {
                a.refund(s, at, cost)
            }
            _ => {}
        }
    }

    /// The numbers a check at `now` would report, taking nothing (Gubernator's and
    /// Envoy's "hits 0"): `allowed` says whether one more unit would be admitted,
    /// `remaining` is what is left now, and `reset_at_ms` when the full budget is back.
    ///
    /// Decided on a copy with a cost of 1; an admitted copy's unit is added back to
    /// `remaining`, and for the token bucket the reset is the state's own "full again"
    /// instant rather than the copy's (which would include the unit), and for GCRA the
    /// end of the state's own schedule. Exact for the fixed window, the token bucket and
    /// GCRA; for the sliding windows the reset includes that unit.
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use std::time::Duration;
    /// use ringlimit::algorithms::{Limiter, TokenBucket};
    ///
    /// // 10 tokens, 10 per second: one every 100 ms.
    /// let ten = NonZeroU64::new(10).unwrap();
    /// let tb = Limiter::TokenBucket(TokenBucket::new(ten, ten, Duration::from_secs(1)).unwrap());
    /// let mut s = tb.new_state();
    /// tb.check(&mut s, 0, ten);
    /// let d = tb.peek(&s, 250);
    /// assert!(d.allowed);
    /// assert_eq!((d.remaining, d.reset_at_ms), (2, 1_000));
    /// ```
    pub fn peek(&self, state: &KeyState, now: Millis) -> Decision {
        let mut copy = state.clone();
        let mut decision = self.check(&mut copy, now, NonZeroU64::MIN);
        if decision.allowed {
            decision.remaining = decision.remaining.saturating_add(1).min(decision.limit);
            match (self, state) {
                (Limiter::TokenBucket(a), KeyState::TokenBucket(s)) => {
                    decision.reset_at_ms = a.expires_at(s).max(now);
                }
                // The schedule's own end (redis-cell's reset for a quantity of 0).
                (Limiter::LeakyBucket(a), KeyState::LeakyBucket(s)) => {
                    decision.reset_at_ms = a.idle_at(s).max(now);
                }
                _ => {}
            }
        }
        decision
    }

    /// Gives `cost` units back now, whenever they were taken (a caller's negative hits;
    /// `NonZeroU64::MAX` makes the state as full as a fresh one). Never beyond full.
    ///
    /// Exact for the fixed window (the count of the newest window it has seen goes down,
    /// whatever the clock says now) and the token bucket (the level goes up, capped at
    /// capacity). The other algorithms give back as a refund at `now` would, which
    /// is what Gubernator's clients use none of.
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use std::time::Duration;
    /// use ringlimit::algorithms::{Limiter, FixedWindow};
    ///
    /// let fw = Limiter::FixedWindow(FixedWindow::new(NonZeroU64::new(5).unwrap(), Duration::from_secs(60)).unwrap());
    /// let mut s = fw.new_state();
    /// fw.check(&mut s, 1_000, NonZeroU64::new(5).unwrap());
    /// fw.give_back(&mut s, 2_000, NonZeroU64::new(2).unwrap());
    /// assert_eq!(fw.check(&mut s, 3_000, NonZeroU64::MIN).remaining, 1);
    /// fw.give_back(&mut s, 4_000, NonZeroU64::MAX);
    /// assert_eq!(fw.check(&mut s, 5_000, NonZeroU64::MIN).remaining, 4);
    /// ```
    pub fn give_back(&self, state: &mut KeyState, now: Millis, cost: NonZeroU64) {
        match (self, state) {
            (Limiter::TokenBucket(a), KeyState::TokenBucket(s)) => {
                let last = s.last;
                a.refund(s, last, cost)
            }
            // The state's own window, even if the clock stepped back since (the count is
            // kept in the newest window seen); a window already past is reset by the
            // next check anyway.
            (Limiter::FixedWindow(a), KeyState::FixedWindow(s)) => {
                let at = s.idx.saturating_mul(a.window_ms);
                a.refund(s, at, cost)
            }
            (limiter, state) => limiter.refund(state, now, cost),
        }
    }

    /// When the store may drop `state`. A mismatched state is worthless to this limiter (the next
    /// check replaces it), so it expires immediately.
    pub fn expires_at(&self, state: &KeyState) -> Millis {
        match (self, state) {
            (Limiter::TokenBucket(a), KeyState::TokenBucket(s)) => a.expires_at(s),
            (Limiter::LeakyBucket(a), KeyState::LeakyBucket(s)) => a.expires_at(s),
            (Limiter::FixedWindow(a), KeyState::FixedWindow(s)) => a.expires_at(s),
            (Limiter::SlidingWindowLog(a), KeyState::SlidingWindowLog(s)) => a.expires_at(s),
            (Limiter::SlidingWindowCounter(a), KeyState::SlidingWindowCounter(s)) => {
                a.expires_at(s)
            }
            _ => 0,
        }
    }

    /// Largest admissible single cost, so the server can reject impossible requests up front.
    pub fn max_cost(&self) -> u64 {
        match self {
            Limiter::TokenBucket(a) => a.max_cost(),
            Limiter::LeakyBucket(a) => a.max_cost(),
            Limiter::FixedWindow(a) => a.max_cost(),
            Limiter::SlidingWindowLog(a) => a.max_cost(),
            Limiter::SlidingWindowCounter(a) => a.max_cost(),
        }
    }
}

/// Invalid algorithm parameters. Rejected once when a rule is loaded so that no later check can
/// overflow or panic; each message names the offending parameter so a config error is
/// actionable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AlgorithmError {
    /// A duration shorter than one millisecond (time is counted in whole ms).
    TooShort {
        /// Parameter name, e.g. `"window"`.
        param: &'static str,
    },
    /// A duration with a sub-millisecond remainder, which whole-ms arithmetic cannot honour.
    SubMillisecond {
        /// Parameter name.
        param: &'static str,
    },
    /// A value (or a product of values) too large for the exact arithmetic.
    TooLarge {
        /// Parameter name or product, e.g. `"capacity * period"`.
        param: &'static str,
        /// The largest accepted value (in ms for durations).
        max: u64,
    },
}

impl fmt::Display for AlgorithmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AlgorithmError::TooShort { param } => write!(f, "{param} must be at least 1 ms"),
            AlgorithmError::SubMillisecond { param } => {
                write!(f, "{param} must be a whole number of milliseconds")
            }
            AlgorithmError::TooLarge { param, max } => {
                write!(f, "{param} is too large (at most {max})")
            }
        }
    }
}

impl std::error::Error for AlgorithmError {}

/// Converts a configured duration to whole milliseconds, rejecting what the integer math cannot
/// represent exactly.
fn whole_millis(d: Duration, param: &'static str) -> Result<u64, AlgorithmError> {
    if d < Duration::from_millis(1) {
        return Err(AlgorithmError::TooShort { param });
    }
    if !d.subsec_nanos().is_multiple_of(1_000_000) {
        return Err(AlgorithmError::SubMillisecond { param });
    }
    u64::try_from(d.as_millis()).map_err(|_| AlgorithmError::TooLarge {
        param,
        max: u64::MAX,
    })
}

/// Converts an absolute admission instant (possibly beyond `u64`) into a retry delay from `now`.
fn retry_from(admit_at: u128, now: Millis) -> u64 {
    match u64::try_from(admit_at) {
        Ok(t) => t.saturating_sub(now),
        Err(_) => NEVER,
    }
}

/// Saturates a `u128` instant into [`Millis`] (used for `reset_at` / `expires_at`, where "the end
/// of time" is an honest answer).
fn clamp_millis(t: u128) -> Millis {
    u64::try_from(t).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(v: u64) -> NonZeroU64 {
        NonZeroU64::new(v).unwrap()
    }

    #[test]
    fn retry_after_secs_rounds_up() {
        let mut d = Decision {
            allowed: false,
            limit: 1,
            remaining: 0,
            retry_after_ms: 0,
            reset_at_ms: 0,
            window_id: None,
            delay_ms: 0,
        };
        for (ms, s) in [
            (0, 0),
            (1, 1),
            (999, 1),
            (1000, 1),
            (1001, 2),
            (u64::MAX, 18446744073709552),
        ] {
            d.retry_after_ms = ms;
            assert_eq!(d.retry_after_secs(), s, "{ms} ms");
        }
    }

    #[test]
    fn durations_must_be_whole_positive_milliseconds() {
        assert_eq!(
            whole_millis(Duration::from_micros(999), "window"),
            Err(AlgorithmError::TooShort { param: "window" })
        );
        assert_eq!(
            whole_millis(Duration::from_micros(1500), "period"),
            Err(AlgorithmError::SubMillisecond { param: "period" })
        );
        assert!(whole_millis(Duration::MAX, "window").is_err());
        assert_eq!(whole_millis(Duration::from_secs(60), "window"), Ok(60_000));
        assert_eq!(
            AlgorithmError::TooShort { param: "window" }.to_string(),
            "window must be at least 1 ms"
        );
    }

    fn all_limiters() -> Vec<Limiter> {
        let l = n(5);
        let w = Duration::from_secs(1);
        vec![
            Limiter::TokenBucket(TokenBucket::new(l, n(5), w).unwrap()),
            Limiter::LeakyBucket(Gcra::meter(l, w, n(2)).unwrap()),
            Limiter::LeakyBucket(Gcra::shaper(l, w, 2).unwrap()),
            Limiter::FixedWindow(FixedWindow::new(l, w).unwrap()),
            Limiter::SlidingWindowLog(SlidingLog::new(l, w).unwrap()),
            Limiter::SlidingWindowCounter(SlidingCounter::new(l, w).unwrap()),
        ]
    }

    #[test]
    fn limiter_replaces_a_mismatched_state_before_checking() {
        let limiters = all_limiters();
        for a in &limiters {
            for b in &limiters {
                let mut state = b.new_state();
                b.check(&mut state, 10, n(1));
                // Refund and expiry on a foreign state are harmless no-ops.
                if a.kind() != b.kind() {
                    let before = state.clone();
                    a.refund(&mut state, 10, n(1));
                    assert_eq!(state, before);
                    assert_eq!(a.expires_at(&state), 0);
                }
                let d = a.check(&mut state, 20, n(1));
                assert!(d.allowed);
                assert_eq!(
                    std::mem::discriminant(&state),
                    std::mem::discriminant(&a.new_state())
                );
            }
        }
    }

    #[test]
    fn limiter_dispatch_matches_the_algorithm_directly() {
        let tb = TokenBucket::new(n(3), n(1), Duration::from_millis(100)).unwrap();
        let limiter = Limiter::TokenBucket(tb.clone());
        assert_eq!(limiter.kind().as_str(), "token_bucket");
        assert_eq!(limiter.max_cost(), 3);
        let mut direct = TokenBucketState::default();
        let mut wrapped = limiter.new_state();
        for t in [0, 1, 2, 3, 50, 150, 151] {
            let a = tb.check(&mut direct, t, n(1));
            let b = limiter.check(&mut wrapped, t, n(1));
            assert_eq!(a, b);
            assert_eq!(tb.expires_at(&direct), limiter.expires_at(&wrapped));
        }
        assert_eq!(wrapped, KeyState::TokenBucket(direct));
    }

    #[test]
    fn state_sizes_match_the_documented_table() {
        use std::mem::size_of;
        assert_eq!(size_of::<TokenBucketState>(), 16);
        assert_eq!(size_of::<GcraState>(), 32);
        assert_eq!(size_of::<FixedWindowState>(), 16);
        assert_eq!(size_of::<SlidingLogState>(), 48);
        assert_eq!(size_of::<SlidingCounterState>(), 24);
    }

    #[test]
    fn kind_names_are_stable() {
        let names: Vec<_> = all_limiters()
            .iter()
            .map(|l| l.kind().to_string())
            .collect();
        assert_eq!(
            names,
            [
                "token_bucket",
                "leaky_bucket",
                "leaky_bucket",
                "fixed_window",
                "sliding_window_log",
                "sliding_window_counter"
            ]
        );
    }

    #[test]
    fn every_kind_parses_back_from_its_name() {
        for (i, kind) in AlgorithmKind::ALL.into_iter().enumerate() {
            assert_eq!(kind.index(), i);
            assert_eq!(kind.as_str().parse(), Ok(kind));
            assert_eq!(AlgorithmKind::parse(kind.as_str()), Some(kind));
        }
        assert_eq!(AlgorithmKind::parse("gcra"), None);
        assert_eq!(AlgorithmKind::parse(" token_bucket"), None);
    }

    #[test]
    fn unknown_algorithm_lists_every_name() {
        let e = "tokenbucket".parse::<AlgorithmKind>().unwrap_err();
        assert_eq!(e.name, "tokenbucket");
        assert_eq!(
            e.to_string(),
            "\"tokenbucket\" is not an algorithm (use one of token_bucket, leaky_bucket, \
             fixed_window, sliding_window_log, sliding_window_counter)"
        );
    }

    proptest::proptest! {
        /// A peek changes nothing and says what a check of one unit would: admitted or
        /// not, what is left before it, and (fixed window, token bucket) the exact reset.
        /// A give-back never makes a counter more than full, and everything back is a
        /// fresh counter's numbers.
        #[test]
        fn peek_is_a_check_without_its_unit_and_give_back_stops_at_full(
            bucket in proptest::prelude::any::<bool>(),
            limit in 1u64..20, period in 1u64..5_000,
            history in testkit::ops(700, 25, 30),
            back in 1u64..30,
        ) {
            let limiter = if bucket {
                Limiter::TokenBucket(TokenBucket::new(n(limit), n(limit), std::time::Duration::from_millis(period)).unwrap())
            } else {
                Limiter::FixedWindow(FixedWindow::new(n(limit), std::time::Duration::from_millis(period)).unwrap())
            };
            let mut state = limiter.new_state();
            let mut now = 1_000_000;
            for op in &history {
                now = op.advance(now);
                limiter.check(&mut state, now, n(op.cost));
                let before = state.clone();
                let peek = limiter.peek(&state, now);
                proptest::prop_assert_eq!(&state, &before, "a peek changes nothing");
                let mut copy = state.clone();
                let check = limiter.check(&mut copy, now, NonZeroU64::MIN);
                proptest::prop_assert_eq!(peek.allowed, check.allowed);
                if check.allowed {
                    proptest::prop_assert_eq!(peek.remaining, check.remaining + 1);
                }
                let mut given = state.clone();
                limiter.give_back(&mut given, now, n(back));
                let after = limiter.peek(&given, now);
                proptest::prop_assert!(after.remaining <= limit);
                proptest::prop_assert!(after.remaining >= peek.remaining);
                limiter.give_back(&mut given, now, NonZeroU64::MAX);
                let full = limiter.peek(&given, now);
                let fresh = limiter.peek(&limiter.new_state(), now);
                proptest::prop_assert_eq!(full.remaining, limit);
                proptest::prop_assert_eq!(full.allowed, fresh.allowed);
            }
        }
    }
}

/// Property-test helpers shared by the algorithm files: the generic halves of the contract
/// (exact retry, expiry, refunds, no panics) are written once and applied to every algorithm.
#[cfg(test)]
pub(crate) mod testkit {
    use super::{Algorithm, Decision, Millis, NEVER};
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;
    use std::num::NonZeroU64;

    /// Non-zero shorthand for tests.
    pub fn nz(v: u64) -> NonZeroU64 {
        NonZeroU64::new(v).expect("test cost must be non-zero")
    }

    /// One step of a manual clock: how far to move (backwards when `back`) and the cost to check.
    #[derive(Debug, Clone, Copy)]
    pub struct Op {
        pub back: bool,
        pub step: u64,
        pub cost: u64,
    }

    impl Op {
        /// Moves a manual clock, saturating at both ends.
        pub fn advance(&self, now: Millis) -> Millis {
            if self.back {
                now.saturating_sub(self.step)
            } else {
                now.saturating_add(self.step)
            }
        }
    }

    /// Random clock steps (about one in eight backwards) with costs in `1..=max_cost`.
    pub fn ops(max_step: u64, max_cost: u64, len: usize) -> impl Strategy<Value = Vec<Op>> {
        // A quarter of the steps stay on the same millisecond (bursts, merged log entries).
        let step = prop_oneof![1 => Just(0), 3 => 0..=max_step];
        prop::collection::vec(
            (0u8..8, step, 1..=max_cost).prop_map(|(k, step, cost)| Op {
                back: k == 0,
                step,
                cost,
            }),
            1..len,
        )
    }

    /// Invariants every decision satisfies, whatever the algorithm.
    pub fn assert_sane(d: &Decision, now: Millis) -> Result<(), TestCaseError> {
        prop_assert!(d.remaining <= d.limit, "{d:?}");
        if d.allowed {
            prop_assert_eq!(d.retry_after_ms, 0);
        } else {
            prop_assert!(d.retry_after_ms >= 1, "denied with zero retry: {d:?}");
            prop_assert_eq!(d.delay_ms, 0);
        }
        if d.remaining < d.limit {
            prop_assert!(
                d.reset_at_ms > now || d.reset_at_ms == u64::MAX,
                "{d:?} at {now}"
            );
        }
        Ok(())
    }

    /// `retry_after` is exact: the same request is still denied one ms earlier and admitted at
    /// `now + retry_after`, on clones of the state as left by the denied check.
    pub fn assert_retry_exact<A: Algorithm>(
        alg: &A,
        state: &A::State,
        now: Millis,
        cost: NonZeroU64,
        d: &Decision,
    ) -> Result<(), TestCaseError> {
        if d.allowed {
            return Ok(());
        }
        if d.retry_after_ms == NEVER {
            // Only legitimate for impossible costs or the end of time.
            let mut s = state.clone();
            prop_assert!(
                cost.get() > alg.max_cost() || !alg.check(&mut s, u64::MAX, cost).allowed,
                "NEVER for an admissible request"
            );
            return Ok(());
        }
        prop_assert!(cost.get() <= alg.max_cost());
        let at = now.checked_add(d.retry_after_ms);
        prop_assert!(at.is_some(), "retry beyond the end of time: {d:?}");
        let at = at.unwrap_or(u64::MAX);
        let mut early = state.clone();
        let e = alg.check(&mut early, at - 1, cost);
        prop_assert!(
            !e.allowed,
            "admitted 1 ms before retry_after: {d:?} / {e:?}"
        );
        let mut on_time = state.clone();
        let o = alg.check(&mut on_time, at, cost);
        prop_assert!(o.allowed, "still denied at retry_after: {d:?} / {o:?}");
        Ok(())
    }

    /// Drives `ops` from `start`, returning the final clock; checks sanity and retry exactness.
    pub fn drive<A: Algorithm>(
        alg: &A,
        state: &mut A::State,
        start: Millis,
        ops: &[Op],
    ) -> Result<Millis, TestCaseError> {
        let mut now = start;
        for op in ops {
            now = op.advance(now);
            let cost = nz(op.cost);
            let d = alg.check(state, now, cost);
            assert_sane(&d, now)?;
            assert_retry_exact(alg, state, now, cost, &d)?;
        }
        Ok(now)
    }

    /// After `expires_at`, the state and a fresh one answer every probe identically.
    pub fn assert_expires_like_fresh<A: Algorithm>(
        alg: &A,
        start: Millis,
        history: &[Op],
        probes: &[Op],
    ) -> Result<(), TestCaseError> {
        let mut state = A::State::default();
        drive(alg, &mut state, start, history)?;
        let expiry = alg.expires_at(&state);
        let mut fresh = A::State::default();
        prop_assert_eq!(alg.expires_at(&fresh), 0);
        // Probes wander around but never before the expiry instant.
        let mut now = expiry;
        for p in probes {
            now = p.advance(now).max(expiry);
            let a = alg.check(&mut state, now, nz(p.cost));
            let b = alg.check(&mut fresh, now, nz(p.cost));
            prop_assert_eq!(a, b, "expired state diverged from a fresh one at {}", now);
        }
        Ok(())
    }

    /// Refund safety: with a check `A` admitted, further identical traffic, then `A` refunded,
    /// the state is never more generous than a twin on which `A` never happened.
    pub fn assert_refund_never_over_refunds<A: Algorithm>(
        alg: &A,
        start: Millis,
        before: &[Op],
        refunded: Op,
        after: &[Op],
        probes: &[Op],
    ) -> Result<(), TestCaseError> {
        let mut with = A::State::default();
        let now = drive(alg, &mut with, start, before)?;
        let mut without = with.clone();
        let at = refunded.advance(now);
        let cost = nz(refunded.cost);
        if !alg.check(&mut with, at, cost).allowed {
            return Ok(()); // nothing to refund
        }
        // Show `without` the same instant (a denied, impossible cost only moves its clock), so
        // the twins differ in A alone.
        let tick = alg.check(&mut without, at, NonZeroU64::MAX);
        prop_assert!(!tick.allowed);
        let mut now = at;
        for op in after {
            now = op.advance(now);
            let a = alg.check(&mut with, now, nz(op.cost));
            let b = alg.check(&mut without, now, nz(op.cost));
            if a.allowed != b.allowed {
                // `without` took something `with` could not: the twins no longer share a history.
                prop_assert!(b.allowed, "state with an extra admission admitted more");
                return Ok(());
            }
        }
        alg.refund(&mut with, at, cost);
        for p in probes {
            let t = p.advance(now);
            let (mut w, mut wo) = (with.clone(), without.clone());
            let a = alg.check(&mut w, t, nz(p.cost));
            let b = alg.check(&mut wo, t, nz(p.cost));
            prop_assert!(
                !a.allowed || b.allowed,
                "over-refund at {t}: {a:?} vs {b:?}"
            );
            if a.allowed == b.allowed {
                // Same outcome, so `remaining` is comparable (before or after the same cost).
                prop_assert!(
                    a.remaining <= b.remaining,
                    "over-refund at {t}: {a:?} vs {b:?}"
                );
            }
        }
        Ok(())
    }

    /// Right after an admitted check, refunding it gives back exactly the refunded units.
    pub fn assert_immediate_refund_is_exact<A: Algorithm>(
        alg: &A,
        start: Millis,
        before: &[Op],
        refunded: Op,
    ) -> Result<(), TestCaseError> {
        let mut state = A::State::default();
        drive(alg, &mut state, start, before)?;
        // "Immediately" means at (or after) the newest instant the state has seen.
        let high = before
            .iter()
            .scan(start, |t, op| {
                *t = op.advance(*t);
                Some(*t)
            })
            .fold(start, u64::max);
        let at = refunded.advance(high).max(high);
        let cost = nz(refunded.cost);
        // Probe the untouched state at `at` first so both copies have seen the same clock.
        let mut untouched = state.clone();
        let baseline = alg.check(&mut untouched.clone(), at, nz(1));
        let d = alg.check(&mut state, at, cost);
        if !d.allowed {
            return Ok(());
        }
        alg.refund(&mut state, at, cost);
        let after = alg.check(&mut state.clone(), at, nz(1));
        prop_assert_eq!(after.remaining, baseline.remaining);
        prop_assert_eq!(after.allowed, baseline.allowed);
        // And the same request is admitted again, exactly as before.
        let again = alg.check(&mut untouched, at, cost);
        prop_assert_eq!(alg.check(&mut state, at, cost), again);
        Ok(())
    }

    /// Arbitrary `now`/`cost` never panic and costs above `max_cost` are always denied with
    /// [`NEVER`].
    pub fn assert_total<A: Algorithm>(
        alg: &A,
        calls: &[(u64, u64, bool)],
    ) -> Result<(), TestCaseError> {
        let mut state = A::State::default();
        for &(now, cost, refund) in calls {
            let cost = NonZeroU64::new(cost).unwrap_or(NonZeroU64::MIN);
            if refund {
                alg.refund(&mut state, now, cost);
                continue;
            }
            let d = alg.check(&mut state, now, cost);
            prop_assert!(d.remaining <= d.limit);
            if cost.get() > alg.max_cost() {
                prop_assert!(!d.allowed);
                prop_assert_eq!(d.retry_after_ms, NEVER);
            }
            let _ = alg.expires_at(&state);
            let _ = d.retry_after_secs();
        }
        Ok(())
    }

    /// Extreme `u64` values mixed with ordinary ones, so boundaries are actually hit.
    pub fn wild_u64() -> impl Strategy<Value = u64> {
        prop_oneof![
            Just(0u64),
            Just(1u64),
            Just(u64::MAX),
            Just(u64::MAX - 1),
            (u64::MAX - 100_000..=u64::MAX),
            0u64..100_000,
            any::<u64>(),
        ]
    }
}
