//! Algorithm state as plain words, so it can travel to another node.
//!
//! When a key's owner changes while the old owner is alive (graceful leave, scale-out),
//! the old owner ships the key's state to the new one. The wire format is prost
//! messages; this module only flattens a [`KeyState`] into `u64` words and back, and
//! checks that state arriving from elsewhere is consistent with the receiving rule's
//! numbers before anything decides with it (a state the arithmetic was never built for
//! must be refused, not trusted to not overflow).
//!
//! Times inside a state are wall-clock Unix milliseconds, so they mean the same thing on
//! the receiving node; see `docs/ownership.md` for what clock skew between the two
//! owners does.

use std::collections::VecDeque;

use smallvec::SmallVec;

use super::{
    AlgorithmKind, FixedWindowState, GcraState, KeyState, Limiter, SlidingCounterState,
    SlidingLogState, TokenBucketState,
};

/// A state's words ([`KeyState::to_words`]): inline up to 4, enough for every algorithm
/// but a sliding log with entries.
pub type Words = SmallVec<[u64; 4]>;

impl KeyState {
    /// Which algorithm this state belongs to.
    pub fn kind(&self) -> AlgorithmKind {
        match self {
            KeyState::TokenBucket(_) => AlgorithmKind::TokenBucket,
            KeyState::LeakyBucket(_) => AlgorithmKind::LeakyBucket,
            KeyState::FixedWindow(_) => AlgorithmKind::FixedWindow,
            KeyState::SlidingWindowLog(_) => AlgorithmKind::SlidingWindowLog,
            KeyState::SlidingWindowCounter(_) => AlgorithmKind::SlidingWindowCounter,
        }
    }

    /// Heap bytes this state owns beyond its own size: a sliding log's entry buffer
    /// (its capacity, which is what the allocator holds), nothing for the others. The
    /// store counts it against its byte budget.
    pub fn heap_bytes(&self) -> usize {
        match self {
            KeyState::SlidingWindowLog(log) => {
                log.entries.capacity() * std::mem::size_of::<(super::Millis, u64)>()
            }
            _ => 0,
        }
    }

    /// A fresh state of the same algorithm.
    pub fn empty_like(state: &KeyState) -> KeyState {
        match state {
            KeyState::TokenBucket(_) => KeyState::TokenBucket(Default::default()),
            KeyState::LeakyBucket(_) => KeyState::LeakyBucket(Default::default()),
            KeyState::FixedWindow(_) => KeyState::FixedWindow(Default::default()),
            KeyState::SlidingWindowLog(_) => KeyState::SlidingWindowLog(Default::default()),
            KeyState::SlidingWindowCounter(_) => KeyState::SlidingWindowCounter(Default::default()),
        }
    }

    /// The state as words; [`KeyState::from_words`] with the same kind restores it. Up
    /// to 4 words (every algorithm's state but a sliding log's) are held inline: a
    /// replicated or handed-over state costs no allocation for them.
    pub fn to_words(&self) -> Words {
        match self {
            KeyState::TokenBucket(s) => Words::from_slice(&[s.deficit, s.last]),
            KeyState::LeakyBucket(s) => {
                Words::from_slice(&[(s.tat >> 64) as u64, s.tat as u64, s.last_admit])
            }
            KeyState::FixedWindow(s) => Words::from_slice(&[s.idx, s.count]),
            KeyState::SlidingWindowLog(s) => {
                let mut words = Words::with_capacity(2 + 2 * s.entries.len());
                words.extend([s.high, s.sum]);
                for &(at, cost) in &s.entries {
                    words.extend([at, cost]);
                }
                words
            }
            KeyState::SlidingWindowCounter(s) => Words::from_slice(&[s.idx, s.prev, s.curr]),
        }
    }

    /// Rebuild a state from words; `None` when the words cannot be a state of `kind`.
    pub fn from_words(kind: AlgorithmKind, words: &[u64]) -> Option<KeyState> {
        Some(match (kind, words) {
            (AlgorithmKind::TokenBucket, &[deficit, last]) => {
                KeyState::TokenBucket(TokenBucketState { deficit, last })
            }
            (AlgorithmKind::LeakyBucket, &[high, low, last_admit]) => {
                KeyState::LeakyBucket(GcraState {
                    tat: (u128::from(high) << 64) | u128::from(low),
                    last_admit,
                })
            }
            (AlgorithmKind::FixedWindow, &[idx, count]) => {
                KeyState::FixedWindow(FixedWindowState { idx, count })
            }
            (AlgorithmKind::SlidingWindowLog, [high, sum, rest @ ..]) if rest.len() % 2 == 0 => {
                let entries: VecDeque<(u64, u64)> =
                    rest.chunks_exact(2).map(|p| (p[0], p[1])).collect();
                KeyState::SlidingWindowLog(SlidingLogState {
                    entries,
                    sum: *sum,
                    high: *high,
                })
            }
            (AlgorithmKind::SlidingWindowCounter, &[idx, prev, curr]) => {
                KeyState::SlidingWindowCounter(SlidingCounterState { idx, prev, curr })
            }
            _ => return None,
        })
    }
}

impl KeyState {
    /// The state in two words, the store's compact in-memory form; `None` when it does
    /// not fit (always for the sliding log; for GCRA when the schedule is beyond `u64`
    /// scaled units; for the sliding counter when a count is beyond `u32`). The store
    /// keeps such states whole, on the side.
    ///
    /// Why two words: at a million keys the state is most of a key's memory, and
    /// every fixed-size state fits two words with room to spare in practice (a GCRA
    /// schedule of `u64` scaled units covers limits up to ~10^7 per ms-period today;
    /// sliding-counter counts are bounded by the limit).
    pub fn to_pair(&self) -> Option<[u64; 2]> {
        match self {
            KeyState::TokenBucket(s) => Some([s.deficit, s.last]),
            KeyState::LeakyBucket(s) => Some([u64::try_from(s.tat).ok()?, s.last_admit]),
            KeyState::FixedWindow(s) => Some([s.idx, s.count]),
            KeyState::SlidingWindowLog(_) => None,
            KeyState::SlidingWindowCounter(s) => {
                let prev = u32::try_from(s.prev).ok()?;
                let curr = u32::try_from(s.curr).ok()?;
                Some([s.idx, (u64::from(prev) << 32) | u64::from(curr)])
            }
        }
    }

    /// Rebuild a state packed by [`KeyState::to_pair`]; `None` for the sliding log,
    /// which never packs.
    pub fn from_pair(kind: AlgorithmKind, [a, b]: [u64; 2]) -> Option<KeyState> {
        Some(match kind {
            AlgorithmKind::TokenBucket => KeyState::TokenBucket(TokenBucketState {
                deficit: a,
                last: b,
            }),
            AlgorithmKind::LeakyBucket => KeyState::LeakyBucket(GcraState {
                tat: u128::from(a),
                last_admit: b,
            }),
            AlgorithmKind::FixedWindow => {
                KeyState::FixedWindow(FixedWindowState { idx: a, count: b })
            }
            AlgorithmKind::SlidingWindowLog => return None,
            AlgorithmKind::SlidingWindowCounter => {
                KeyState::SlidingWindowCounter(SlidingCounterState {
                    idx: a,
                    prev: b >> 32,
                    curr: b & u64::from(u32::MAX),
                })
            }
        })
    }
}

impl Limiter {
    /// True when `state` could have been produced by this limiter: right algorithm and
    /// counts within its numbers. State received from another node is installed only
    /// if this holds.
    pub fn accepts(&self, state: &KeyState) -> bool {
        match (self, state) {
            (Limiter::TokenBucket(l), KeyState::TokenBucket(s)) => s.deficit <= l.full,
            (Limiter::LeakyBucket(l), KeyState::LeakyBucket(s)) => {
                s.tat <= u128::from(u64::MAX) * u128::from(l.limit)
            }
            (Limiter::FixedWindow(l), KeyState::FixedWindow(s)) => s.count <= l.limit,
            (Limiter::SlidingWindowLog(l), KeyState::SlidingWindowLog(s)) => {
                let sorted = s
                    .entries
                    .iter()
                    .zip(s.entries.iter().skip(1))
                    .all(|(a, b)| a.0 < b.0);
                let sum = s
                    .entries
                    .iter()
                    .try_fold(0u64, |acc, &(_, cost)| acc.checked_add(cost));
                sorted
                    && sum == Some(s.sum)
                    && s.sum <= l.limit
                    && s.entries.iter().all(|&(at, cost)| cost > 0 && at <= s.high)
            }
            (Limiter::SlidingWindowCounter(l), KeyState::SlidingWindowCounter(s)) => {
                s.prev <= l.limit && s.curr <= l.limit
            }
            _ => false,
        }
    }
}

/// Why a state handed over by another node was refused: it is not one this node's rule
/// could have produced by now. Each kind is a metric label (`reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Implausible {
    /// A state of another algorithm than the rule's.
    Algorithm,
    /// Counts beyond what the rule can admit (a window count above the limit, a token
    /// deficit beyond the capacity, a log whose entries disagree with its sum or exceed the
    /// limit), or a schedule booked further ahead than the burst tolerance.
    Count,
    /// A window id or timestamp beyond the receiver's clock plus the skew allowance.
    Future,
}

impl Implausible {
    /// Every reason, in a fixed order (metric handles are indexed by it).
    pub const ALL: [Implausible; 3] = [
        Implausible::Algorithm,
        Implausible::Count,
        Implausible::Future,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Implausible::Algorithm => "algorithm",
            Implausible::Count => "count",
            Implausible::Future => "future",
        }
    }

    /// Position in [`Implausible::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for Implausible {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Implausible::Algorithm => "state of another algorithm than the rule's",
            Implausible::Count => "counts beyond what the rule can admit",
            Implausible::Future => "a window or timestamp beyond now plus the clock-skew allowance",
        })
    }
}

impl std::error::Error for Implausible {}

impl Limiter {
    /// Whether `state`, received from another node, is one this limiter could have produced
    /// on a node whose clock reads at most `now + skew_ms`: right algorithm, counts within
    /// the rule ([`Limiter::accepts`]), and no window or instant beyond that horizon. A state
    /// that fails is refused, never merged: a window id from the far future would freeze the
    /// key (every check clamps to it) and a later window would replace the current count.
    ///
    /// Per algorithm, with `h = now + skew_ms`:
    /// * fixed window, sliding counter: window index `<= h / window`;
    /// * token bucket: `last <= h` (the deficit is bounded by the capacity already);
    /// * GCRA: `last_admit <= h` and `TAT <= h + tau` (no admission books the schedule
    ///   more than the burst tolerance ahead of its own instant);
    /// * sliding log: high-water mark `<= h` (every entry is at or before it, at most
    ///   `limit` units in all).
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use std::time::Duration;
    /// use ringlimit::algorithms::{AlgorithmKind, FixedWindow, Implausible, KeyState, Limiter};
    ///
    /// let limiter = Limiter::FixedWindow(
    ///     FixedWindow::new(NonZeroU64::new(5).unwrap(), Duration::from_secs(60)).unwrap());
    /// let now = 120_000; // window 2
    /// let current = KeyState::from_words(AlgorithmKind::FixedWindow, &[2, 5]).unwrap();
    /// assert_eq!(limiter.validate_imported(&current, now, 5_000), Ok(()));
    /// let far = KeyState::from_words(AlgorithmKind::FixedWindow, &[1_000_000_000_000, 1]).unwrap();
    /// assert_eq!(limiter.validate_imported(&far, now, 5_000), Err(Implausible::Future));
    /// ```
    pub fn validate_imported(
        &self,
        state: &KeyState,
        now: super::Millis,
        skew_ms: u64,
    ) -> Result<(), Implausible> {
        if self.kind() != state.kind() {
            return Err(Implausible::Algorithm);
        }
        if !self.accepts(state) {
            return Err(Implausible::Count);
        }
        let h = now.saturating_add(skew_ms);
        let in_time = match (self, state) {
            (Limiter::TokenBucket(_), KeyState::TokenBucket(s)) => s.last <= h,
            (Limiter::LeakyBucket(l), KeyState::LeakyBucket(s)) => {
                if s.last_admit > h {
                    return Err(Implausible::Future);
                }
                // Scaled instants: ms × limit. The schedule is booked from the newest
                // admission, which is itself at most `h`.
                let booked = u128::from(s.last_admit) * u128::from(l.limit) + l.tau();
                return if s.tat <= booked {
                    Ok(())
                } else if s.tat <= u128::from(h) * u128::from(l.limit) + l.tau() {
                    Err(Implausible::Count)
                } else {
                    Err(Implausible::Future)
                };
            }
            (Limiter::FixedWindow(l), KeyState::FixedWindow(s)) => s.idx <= h / l.window_ms,
            (Limiter::SlidingWindowLog(_), KeyState::SlidingWindowLog(s)) => s.high <= h,
            (Limiter::SlidingWindowCounter(l), KeyState::SlidingWindowCounter(s)) => {
                s.idx <= h / l.window_ms
            }
            // Unreachable: the kinds were compared above.
            _ => return Err(Implausible::Algorithm),
        };
        if in_time {
            Ok(())
        } else {
            Err(Implausible::Future)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU64;
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;
    use crate::algorithms::{FixedWindow, Gcra, SlidingCounter, SlidingLog, TokenBucket};

    fn nz(n: u64) -> NonZeroU64 {
        NonZeroU64::new(n).unwrap()
    }

    fn limiters() -> Vec<Limiter> {
        let w = Duration::from_secs(10);
        vec![
            Limiter::TokenBucket(TokenBucket::new(nz(5), nz(5), w).unwrap()),
            Limiter::LeakyBucket(Gcra::meter(nz(5), w, nz(3)).unwrap()),
            Limiter::LeakyBucket(Gcra::shaper(nz(5), w, 3).unwrap()),
            Limiter::FixedWindow(FixedWindow::new(nz(5), w).unwrap()),
            Limiter::SlidingWindowLog(SlidingLog::new(nz(5), w).unwrap()),
            Limiter::SlidingWindowCounter(SlidingCounter::new(nz(5), w).unwrap()),
        ]
    }

    /// The state after each (step ms, cost) check from a fresh one, with the time,
    /// step and cost of that check.
    fn states_along(limiter: &Limiter, steps: &[(u64, u64)]) -> Vec<(KeyState, u64, u64, u64)> {
        let mut state = limiter.new_state();
        let mut now = 1_000_000;
        steps
            .iter()
            .map(|&(step, cost)| {
                now += step;
                limiter.check(&mut state, now, nz(cost));
                (state.clone(), now, step, cost)
            })
            .collect()
    }

    proptest! {
        /// A state shipped as words and rebuilt decides exactly like the original:
        /// handing a key to another node loses nothing.
        #[test]
        fn state_survives_the_trip_and_decides_identically(
            steps in proptest::collection::vec((0u64..4_000, 1u64..3), 1..40),
        ) {
            for limiter in limiters() {
                for (state, now, step, cost) in states_along(&limiter, &steps) {
                    let words = state.to_words();
                    let mut copy = KeyState::from_words(state.kind(), &words).unwrap();
                    prop_assert!(limiter.accepts(&copy));
                    prop_assert_eq!(&copy, &state);
                    let mut original = state.clone();
                    let later = now + step / 2;
                    prop_assert_eq!(
                        limiter.check(&mut copy, later, nz(cost)),
                        limiter.check(&mut original, later, nz(cost))
                    );
                }
            }
        }

        /// Packing into two words is lossless whenever it succeeds, and it succeeds
        /// for every state but the log's under ordinary numbers.
        #[test]
        fn pairs_round_trip_exactly(
            steps in proptest::collection::vec((0u64..4_000, 1u64..3), 1..40),
        ) {
            for limiter in limiters() {
                for (state, ..) in states_along(&limiter, &steps) {
                    match state.to_pair() {
                        Some(pair) => prop_assert_eq!(
                            KeyState::from_pair(state.kind(), pair),
                            Some(state.clone())
                        ),
                        None => prop_assert_eq!(state.kind(), AlgorithmKind::SlidingWindowLog),
                    }
                }
            }
        }

        /// Garbage words never panic: they are refused or produce some state, and a
        /// produced state is only accepted when consistent.
        #[test]
        fn arbitrary_words_never_panic(words in proptest::collection::vec(any::<u64>(), 0..8)) {
            for limiter in limiters() {
                if let Some(mut state) = KeyState::from_words(limiter.kind(), &words) {
                    if limiter.accepts(&state) {
                        limiter.check(&mut state, 5_000_000, nz(1));
                    }
                }
            }
        }
    }

    #[test]
    fn counts_beyond_the_rule_are_refused() {
        let fixed = Limiter::FixedWindow(FixedWindow::new(nz(5), Duration::from_secs(1)).unwrap());
        let six = KeyState::from_words(AlgorithmKind::FixedWindow, &[1, 6]).unwrap();
        assert!(!fixed.accepts(&six));
        let five = KeyState::from_words(AlgorithmKind::FixedWindow, &[1, 5]).unwrap();
        assert!(fixed.accepts(&five));
        let log = KeyState::from_words(AlgorithmKind::SlidingWindowLog, &[10, 2, 5, 1]).unwrap();
        let sliding_log =
            Limiter::SlidingWindowLog(SlidingLog::new(nz(5), Duration::from_secs(1)).unwrap());
        assert!(!sliding_log.accepts(&log), "sum disagrees with the entries");
    }

    #[test]
    fn states_beyond_two_words_do_not_pack() {
        let big_tat = KeyState::from_words(AlgorithmKind::LeakyBucket, &[1, 0, 5]).unwrap();
        assert_eq!(big_tat.to_pair(), None);
        let big_count =
            KeyState::from_words(AlgorithmKind::SlidingWindowCounter, &[3, 1 << 32, 1]).unwrap();
        assert_eq!(big_count.to_pair(), None);
        let fits = KeyState::from_words(
            AlgorithmKind::SlidingWindowCounter,
            &[3, u64::from(u32::MAX), 7],
        )
        .unwrap();
        let pair = fits.to_pair().unwrap();
        assert_eq!(
            KeyState::from_pair(AlgorithmKind::SlidingWindowCounter, pair),
            Some(fits)
        );
    }

    /// The receiver's clock in the validation tests, and its skew allowance.
    const NOW: u64 = 1_000_000_000;
    const SKEW: u64 = 5_000;

    fn words(kind: AlgorithmKind, words: &[u64]) -> KeyState {
        KeyState::from_words(kind, words).unwrap()
    }

    fn validate(limiter: &Limiter, kind: AlgorithmKind, w: &[u64]) -> Result<(), Implausible> {
        limiter.validate_imported(&words(kind, w), NOW, SKEW)
    }

    #[test]
    fn fixed_window_imports_are_refused_beyond_the_skew_or_the_limit() {
        let w = 60_000;
        let l = Limiter::FixedWindow(FixedWindow::new(nz(5), Duration::from_millis(w)).unwrap());
        let k = AlgorithmKind::FixedWindow;
        let current = NOW / w;
        assert_eq!(validate(&l, k, &[current, 5]), Ok(()));
        assert_eq!(
            validate(&l, k, &[0, 5]),
            Ok(()),
            "an old window is harmless"
        );
        // The next window is plausible only once now + skew has reached it.
        let next_start = (current + 1) * w;
        assert_eq!(validate(&l, k, &[current + 1, 1]), Err(Implausible::Future));
        assert_eq!(
            l.validate_imported(&words(k, &[current + 1, 1]), next_start - SKEW, SKEW),
            Ok(())
        );
        assert_eq!(
            l.validate_imported(&words(k, &[current + 1, 1]), next_start - SKEW - 1, SKEW),
            Err(Implausible::Future)
        );
        assert_eq!(
            validate(&l, k, &[1_000_000_000_000, 1]),
            Err(Implausible::Future)
        );
        assert_eq!(validate(&l, k, &[u64::MAX, 0]), Err(Implausible::Future));
        assert_eq!(validate(&l, k, &[current, 6]), Err(Implausible::Count));
    }

    #[test]
    fn sliding_counter_imports_are_refused_beyond_the_skew_or_the_limit() {
        let w = 60_000;
        let l = Limiter::SlidingWindowCounter(
            SlidingCounter::new(nz(5), Duration::from_millis(w)).unwrap(),
        );
        let k = AlgorithmKind::SlidingWindowCounter;
        let current = NOW / w;
        assert_eq!(validate(&l, k, &[current, 5, 5]), Ok(()));
        assert_eq!(
            validate(&l, k, &[current + 1, 0, 1]),
            Err(Implausible::Future)
        );
        assert_eq!(
            validate(&l, k, &[1_000_000_000_000, 0, 1]),
            Err(Implausible::Future)
        );
        assert_eq!(validate(&l, k, &[current, 6, 0]), Err(Implausible::Count));
        assert_eq!(validate(&l, k, &[current, 0, 6]), Err(Implausible::Count));
    }

    #[test]
    fn token_bucket_imports_are_refused_from_the_future_or_beyond_capacity() {
        // 5 tokens per 10 s: a full bucket is 5 * 10_000 scaled units.
        let l =
            Limiter::TokenBucket(TokenBucket::new(nz(5), nz(5), Duration::from_secs(10)).unwrap());
        let k = AlgorithmKind::TokenBucket;
        assert_eq!(validate(&l, k, &[50_000, NOW]), Ok(()));
        assert_eq!(validate(&l, k, &[50_000, NOW + SKEW]), Ok(()));
        assert_eq!(
            validate(&l, k, &[1, NOW + SKEW + 1]),
            Err(Implausible::Future)
        );
        assert_eq!(validate(&l, k, &[50_001, NOW]), Err(Implausible::Count));
        assert_eq!(validate(&l, k, &[u64::MAX, NOW]), Err(Implausible::Count));
    }

    #[test]
    fn gcra_imports_are_refused_when_booked_beyond_the_burst_tolerance() {
        // 5 per 10 s, burst 3: T = 10_000 scaled units, tau = 30_000 (3 s of ms × 5).
        let l = Limiter::LeakyBucket(Gcra::meter(nz(5), Duration::from_secs(10), nz(3)).unwrap());
        let k = AlgorithmKind::LeakyBucket;
        let scaled = |ms: u64| u128::from(ms) * 5;
        let state = |tat: u128, last: u64| [(tat >> 64) as u64, tat as u64, last];
        let tau = 30_000u128;
        assert_eq!(validate(&l, k, &state(scaled(NOW) + tau, NOW)), Ok(()));
        assert_eq!(
            validate(&l, k, &state(scaled(NOW) + tau + 1, NOW)),
            Err(Implausible::Count),
            "booked further ahead of its newest admission than any check books"
        );
        assert_eq!(
            validate(&l, k, &state(scaled(NOW + SKEW) + tau, NOW + SKEW)),
            Ok(()),
            "an owner whose clock is ahead within the allowance"
        );
        assert_eq!(
            validate(&l, k, &state(scaled(NOW + SKEW + 1), NOW + SKEW + 1)),
            Err(Implausible::Future)
        );
        assert_eq!(
            validate(&l, k, &state(scaled(NOW) * 1_000, NOW + SKEW + 1)),
            Err(Implausible::Future),
            "a schedule a thousand years ahead"
        );
        assert_eq!(
            validate(&l, k, &state(scaled(NOW) * 1_000, NOW)),
            Err(Implausible::Future),
            "booked far beyond now + skew + tau"
        );
        assert_eq!(
            validate(&l, k, &[u64::MAX, u64::MAX, 0]),
            Err(Implausible::Count),
            "beyond any schedule the arithmetic holds"
        );
    }

    #[test]
    fn sliding_log_imports_are_refused_with_future_entries_or_too_many_units() {
        let l = Limiter::SlidingWindowLog(SlidingLog::new(nz(3), Duration::from_secs(60)).unwrap());
        let k = AlgorithmKind::SlidingWindowLog;
        assert_eq!(validate(&l, k, &[NOW, 3, NOW - 10, 1, NOW, 2]), Ok(()));
        assert_eq!(
            validate(&l, k, &[NOW + SKEW + 1, 1, NOW + SKEW + 1, 1]),
            Err(Implausible::Future)
        );
        assert_eq!(
            validate(&l, k, &[NOW, 1, NOW + 1, 1]),
            Err(Implausible::Count),
            "an entry after the high-water mark"
        );
        assert_eq!(
            validate(&l, k, &[NOW, 4, NOW - 3, 1, NOW - 2, 1, NOW - 1, 1, NOW, 1]),
            Err(Implausible::Count),
            "more entries than the limit"
        );
        assert_eq!(
            validate(&l, k, &[NOW, 0, NOW - 1, 0]),
            Err(Implausible::Count),
            "an entry of cost zero"
        );
    }

    #[test]
    fn a_state_of_another_algorithm_is_refused_as_such() {
        let l = Limiter::FixedWindow(FixedWindow::new(nz(5), Duration::from_secs(1)).unwrap());
        let other = words(AlgorithmKind::TokenBucket, &[0, 0]);
        assert_eq!(
            l.validate_imported(&other, NOW, SKEW),
            Err(Implausible::Algorithm)
        );
        let labels: Vec<_> = Implausible::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(labels, ["algorithm", "count", "future"]);
    }

    proptest! {
        /// Whatever checks a node made up to its own `now`, and whatever two such states
        /// merge into, the state is plausible to a receiver whose clock is behind by at
        /// most the allowance: legitimate handoffs always install.
        #[test]
        fn states_made_by_checks_are_always_plausible_within_the_skew(
            steps in proptest::collection::vec((0u64..4_000, 1u64..4), 1..40),
            other in proptest::collection::vec((0u64..4_000, 1u64..4), 1..40),
            behind in 0u64..=SKEW,
        ) {
            for limiter in limiters() {
                let mut a = limiter.new_state();
                let mut b = limiter.new_state();
                let (mut ta, mut tb) = (NOW, NOW + 500);
                for &(step, cost) in &steps {
                    ta += step;
                    limiter.check(&mut a, ta, nz(cost));
                }
                for &(step, cost) in &other {
                    tb += step;
                    limiter.check(&mut b, tb, nz(cost));
                }
                let sender_now = ta.max(tb);
                let receiver_now = sender_now - behind;
                prop_assert_eq!(limiter.validate_imported(&a, receiver_now, SKEW), Ok(()));
                prop_assert_eq!(limiter.validate_imported(&b, receiver_now, SKEW), Ok(()));
                let mut merged = a.clone();
                limiter.merge(&mut merged, b.clone());
                prop_assert_eq!(
                    limiter.validate_imported(&merged, receiver_now, SKEW),
                    Ok(()),
                    "{:?} + {:?} = {:?}", a, b, merged
                );
            }
        }

        /// Arbitrary words never panic the validation.
        #[test]
        fn validating_arbitrary_words_never_panics(
            words in proptest::collection::vec(any::<u64>(), 0..8),
            now in any::<u64>(),
            skew in any::<u64>(),
        ) {
            for limiter in limiters() {
                for kind in AlgorithmKind::ALL {
                    if let Some(state) = KeyState::from_words(kind, &words) {
                        let _ = limiter.validate_imported(&state, now, skew);
                    }
                }
            }
        }
    }

    #[test]
    fn words_of_another_shape_are_refused() {
        assert!(KeyState::from_words(AlgorithmKind::TokenBucket, &[1]).is_none());
        assert!(KeyState::from_words(AlgorithmKind::SlidingWindowLog, &[1, 1, 1]).is_none());
    }
}
