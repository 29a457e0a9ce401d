//! Merging two states of the same counter, kept by two nodes.
//!
//! When a key's owner changes while the old owner is alive, the old owner ships the key's state
//! to the new one (see the `portable` module). During the gossip window both nodes may have decided
//! for the key, so the receiver may already hold a state of its own. Keeping either state alone
//! forgets the other node's admissions; [`Limiter::merge`] folds both into one state that accounts
//! for the admissions recorded in each.
//!
//! The rule for every algorithm: the merged state is **never more generous than either input**.
//! At any instant at or after the newest time either state has seen, it admits a request only if
//! both inputs would have admitted it, and it has at most as many units left as either of them.
//! Counts are capped at what the state can hold (`accepts` bounds them by the rule's limit); a
//! capped count is still at least each input's count, so the cap never makes the result more
//! generous than an input.
//!
//! Everything is checked or saturating: no pair of accepted states (whatever their times) can
//! make a merge panic or produce a state the limiter would refuse.

use std::collections::VecDeque;

use super::{
    FixedWindow, FixedWindowState, Gcra, GcraState, KeyState, Limiter, SlidingCounter,
    SlidingCounterState, SlidingLog, SlidingLogState, TokenBucket, TokenBucketState,
};

impl Limiter {
    /// Fold `other` (state of the same counter from another node) into `into`.
    ///
    /// Both should be states this limiter [`accepts`](Limiter::accepts). If `other` is of
    /// another algorithm — or inconsistent with this rule's numbers, so that nothing in it can
    /// be trusted — `into` is kept unchanged. If `into` is of another algorithm (or
    /// inconsistent), it becomes `other`. Otherwise the two are merged per algorithm (see the
    /// private `merge_*` functions for each rule and why it is conservative). Whenever `other` is
    /// accepted, the result satisfies `self.accepts(&result)`.
    ///
    /// The merge is symmetric: `merge(a, b)` and `merge(b, a)` produce the same state.
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use std::time::Duration;
    /// use ringlimit::algorithms::{FixedWindow, Limiter};
    ///
    /// let limiter = Limiter::FixedWindow(
    ///     FixedWindow::new(NonZeroU64::new(5).unwrap(), Duration::from_secs(1)).unwrap());
    /// let (mut a, mut b) = (limiter.new_state(), limiter.new_state());
    /// assert!(limiter.check(&mut a, 100, NonZeroU64::new(3).unwrap()).allowed);
    /// assert!(limiter.check(&mut b, 200, NonZeroU64::new(2).unwrap()).allowed);
    /// limiter.merge(&mut a, b);
    /// assert!(!limiter.check(&mut a, 300, NonZeroU64::MIN).allowed); // 3 + 2 = 5 used
    /// ```
    pub fn merge(&self, into: &mut KeyState, other: KeyState) {
        // Foreign or inconsistent state from another node is never folded in (the same rule as
        // installing shipped state: only if `accepts`).
        if !self.accepts(&other) {
            return;
        }
        // Our own state is of another algorithm (the rule was reconfigured) or inconsistent:
        // its budget cannot be translated, so the shipped state is all there is.
        if !self.accepts(into) {
            *into = other;
            return;
        }
        match (self, into, other) {
            (Limiter::FixedWindow(l), KeyState::FixedWindow(a), KeyState::FixedWindow(b)) => {
                merge_fixed_window(l, a, b)
            }
            (
                Limiter::SlidingWindowCounter(l),
                KeyState::SlidingWindowCounter(a),
                KeyState::SlidingWindowCounter(b),
            ) => merge_sliding_counter(l, a, b),
            (Limiter::TokenBucket(l), KeyState::TokenBucket(a), KeyState::TokenBucket(b)) => {
                merge_token_bucket(l, a, b)
            }
            (Limiter::LeakyBucket(l), KeyState::LeakyBucket(a), KeyState::LeakyBucket(b)) => {
                merge_gcra(l, a, b)
            }
            (
                Limiter::SlidingWindowLog(l),
                KeyState::SlidingWindowLog(a),
                KeyState::SlidingWindowLog(b),
            ) => merge_sliding_log(l, a, b),
            // Unreachable: `accepts` held for both, so both match the limiter's algorithm.
            _ => {}
        }
    }
}

/// Fixed window.
///
/// * Same window index: both counts were admitted in the same window, so the window has used
///   `a + b`; capped at `limit` (a full window denies everything either way, and `accepts`
///   requires `count <= limit`).
/// * Different indices: the state with the later window wins. Checks never look at an earlier
///   window again (the index never decreases), so the earlier window's count no longer
///   influences any decision; the older state would itself roll to an empty window on its next
///   check at or after the later window.
fn merge_fixed_window(l: &FixedWindow, a: &mut FixedWindowState, b: FixedWindowState) {
    if a.idx == b.idx {
        a.count = a.count.saturating_add(b.count).min(l.limit);
    } else if b.idx > a.idx {
        *a = b;
    }
}

/// The `(prev, curr)` counters of `s` as seen from window `to >= s.idx`, exactly as a check in
/// window `to` would roll them: one window behind, the current count becomes the previous one;
/// two or more behind, both have aged out.
pub(super) fn roll_counter(s: &SlidingCounterState, to: u64) -> (u64, u64) {
    if to == s.idx {
        (s.prev, s.curr)
    } else if s.idx.checked_add(1) == Some(to) {
        (s.curr, 0)
    } else {
        (0, 0)
    }
}

/// Sliding window counter.
///
/// Both states are first brought to the later window index, rolling the older one exactly as
/// its own next check would (so the merge changes nothing about *when* counts age out). Then the
/// two nodes' admissions in each window add up: `prev = min(prev_a + prev_b, limit)`,
/// `curr = min(curr_a + curr_b, limit)`. The estimator is monotone in both counters, so sums
/// (each at least either input's count) are never more generous than either input; the cap keeps
/// `accepts` (`<= limit`) and is itself at least each input's count.
fn merge_sliding_counter(l: &SlidingCounter, a: &mut SlidingCounterState, b: SlidingCounterState) {
    let idx = a.idx.max(b.idx);
    let (pa, ca) = roll_counter(a, idx);
    let (pb, cb) = roll_counter(&b, idx);
    *a = SlidingCounterState {
        idx,
        prev: pa.saturating_add(pb).min(l.limit),
        curr: ca.saturating_add(cb).min(l.limit),
    };
}

/// The deficit of `s` refilled up to `t >= s.last`, as the bucket's own lazy refill would leave
/// it: it shrinks by `refill` scaled units per elapsed ms and saturates at 0 (a full bucket).
pub(super) fn deficit_at(l: &TokenBucket, s: &TokenBucketState, t: u64) -> u128 {
    let dripped = u128::from(t.saturating_sub(s.last)) * u128::from(l.refill);
    u128::from(s.deficit).saturating_sub(dripped)
}

/// Token bucket.
///
/// Both buckets are advanced to `t = max(last_a, last_b)` by their own refill (exactly what the
/// older bucket's next check at `t` would do, so no time runs backwards and `last` stays the
/// newest instant either node applied). The tokens taken on each node are then both missing from
/// the one bucket: `deficit = min(deficit_a + deficit_b, full)`. That is at least each input's
/// deficit at `t`, so the merged bucket never holds more tokens than either; the cap at `full`
/// (an empty bucket) keeps `accepts` and is still at least each deficit.
fn merge_token_bucket(l: &TokenBucket, a: &mut TokenBucketState, b: TokenBucketState) {
    let t = a.last.max(b.last);
    let sum = deficit_at(l, a, t).saturating_add(deficit_at(l, &b, t));
    *a = TokenBucketState {
        // `full` is a u64, so the minimum always fits.
        deficit: u64::try_from(sum.min(u128::from(l.full))).unwrap_or(l.full),
        last: t,
    };
}

/// GCRA (leaky bucket, meter and shaper).
///
/// The two TATs are two independent schedules. Measured from `t = max(last_admit_a,
/// last_admit_b)` (in scaled units, `ms × limit`), each node still has `backlog_x = max(tat_x -
/// t, 0)` of emission time booked ahead. One schedule serving both nodes' admissions must book
/// both backlogs back to back: `tat = t + backlog_a + backlog_b`. That is at least each input's
/// TAT (`tat_x <= t + backlog_x`), and every GCRA verdict is monotone in the TAT, so the merged
/// schedule is never more generous than either input. The sum saturates and is capped at
/// `t + tau`: no admission ever books the schedule further than `tau` ahead of its own instant,
/// so every state a check produced has `tat <= last_admit + tau`, which is at most `t + tau`, and
/// the cap is still at least each such input's TAT (a state booked `tau` ahead denies every
/// request until it is back within `tau`, like a full window). The cap keeps a merged state
/// plausible when the key moves on again (see `Limiter::validate_imported`); it is also at most
/// `u64::MAX × limit`, the largest TAT `accepts` allows. `last_admit = max` keeps the refund
/// guard pointing at the newest admission of either.
fn merge_gcra(l: &Gcra, a: &mut GcraState, b: GcraState) {
    let t = a.last_admit.max(b.last_admit);
    let ts = u128::from(t) * u128::from(l.limit); // < 2^128: both factors are u64
    let cap = ts
        .saturating_add(l.tau())
        .min(u128::from(u64::MAX) * u128::from(l.limit));
    let backlog_a = a.tat.saturating_sub(ts);
    let backlog_b = b.tat.saturating_sub(ts);
    *a = GcraState {
        tat: ts
            .saturating_add(backlog_a)
            .saturating_add(backlog_b)
            .min(cap),
        last_admit: t,
    };
}

/// Sliding window log.
///
/// The log is the exact history, so the merge is the union of both nodes' admissions: entries
/// in time order, entries at the same millisecond combined into one (the log holds distinct
/// instants), `high = max` (the clamp must cover every instant either node acted on). Entries
/// already aged out at the new `high` are dropped, as the next check would do anyway.
///
/// If the union's sum exceeds `limit` (both nodes admitted within one window), the state cannot
/// hold it (`accepts` requires `sum <= limit`), so the OLDEST units are dropped (whole entries,
/// then part of the oldest remaining one) until `sum == limit`. Keeping the newest is the most
/// restrictive choice: at any later instant, either no dropped unit would still be live (the
/// live count equals the union's) or every kept unit is live and the window is full — in both
/// cases at least as full as either input's.
fn merge_sliding_log(l: &SlidingLog, a: &mut SlidingLogState, b: SlidingLogState) {
    union_logs(l, a, b, u64::saturating_add);
}

/// The union of two logs at the later `high`, entries at the same millisecond combined
/// by `same` (a merge adds two nodes' admissions; a join keeps the larger of two views
/// of one node's), the oldest units trimmed until the sum fits the limit.
pub(super) fn union_logs(
    l: &SlidingLog,
    a: &mut SlidingLogState,
    b: SlidingLogState,
    same: fn(u64, u64) -> u64,
) {
    let high = a.high.max(b.high);
    let live = |at: u64| high.saturating_sub(at) < l.window_ms;
    let mine = std::mem::take(&mut a.entries);
    let mut entries = VecDeque::with_capacity(mine.len().max(b.entries.len()));
    let mut xs = mine.into_iter().filter(|&(at, _)| live(at)).peekable();
    let mut ys = b.entries.into_iter().filter(|&(at, _)| live(at)).peekable();
    let mut sum = 0u64;
    loop {
        let next = match (xs.peek().copied(), ys.peek().copied()) {
            (Some(x), Some(y)) if x.0 == y.0 => {
                xs.next();
                ys.next();
                (x.0, same(x.1, y.1))
            }
            (Some(x), Some(y)) if x.0 < y.0 => {
                xs.next();
                x
            }
            (_, Some(y)) => {
                ys.next();
                y
            }
            (Some(x), None) => {
                xs.next();
                x
            }
            (None, None) => break,
        };
        sum = sum.saturating_add(next.1);
        entries.push_back(next);
    }
    // Trim the oldest units until the union fits the limit.
    while sum > l.limit {
        let excess = sum - l.limit;
        match entries.front_mut() {
            Some((_, cost)) if *cost > excess => {
                *cost -= excess;
                sum = l.limit;
            }
            Some(&mut (_, cost)) => {
                entries.pop_front();
                sum = sum.saturating_sub(cost);
            }
            // Unreachable: a non-zero sum comes from some entry.
            None => sum = 0,
        }
    }
    *a = SlidingLogState { entries, sum, high };
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::num::NonZeroU64;
    use std::time::Duration;

    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    use super::*;
    use crate::algorithms::testkit::{nz, wild_u64};
    use crate::algorithms::{AlgorithmKind, Millis};

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn fixed(limit: u64, window: u64) -> Limiter {
        Limiter::FixedWindow(FixedWindow::new(nz(limit), ms(window)).unwrap())
    }

    fn counter(limit: u64, window: u64) -> Limiter {
        Limiter::SlidingWindowCounter(SlidingCounter::new(nz(limit), ms(window)).unwrap())
    }

    fn bucket(capacity: u64, refill: u64, period: u64) -> Limiter {
        Limiter::TokenBucket(TokenBucket::new(nz(capacity), nz(refill), ms(period)).unwrap())
    }

    fn meter(limit: u64, period: u64, burst: u64) -> Limiter {
        Limiter::LeakyBucket(Gcra::meter(nz(limit), ms(period), nz(burst)).unwrap())
    }

    fn shaper(limit: u64, period: u64, queue: u64) -> Limiter {
        Limiter::LeakyBucket(Gcra::shaper(nz(limit), ms(period), queue).unwrap())
    }

    fn log(limit: u64, window: u64) -> Limiter {
        Limiter::SlidingWindowLog(SlidingLog::new(nz(limit), ms(window)).unwrap())
    }

    /// Applies `(at, cost)` checks to a fresh state, asserting each is admitted.
    fn admitted(limiter: &Limiter, checks: &[(Millis, u64)]) -> KeyState {
        let mut s = limiter.new_state();
        for &(at, cost) in checks {
            assert!(limiter.check(&mut s, at, nz(cost)).allowed, "{at} {cost}");
        }
        s
    }

    fn merged(limiter: &Limiter, a: &KeyState, b: &KeyState) -> KeyState {
        let mut m = a.clone();
        limiter.merge(&mut m, b.clone());
        assert!(limiter.accepts(&m), "{m:?}");
        m
    }

    #[test]
    fn fixed_window_three_on_a_and_two_on_b_in_one_window_deny_the_sixth() {
        let fw = fixed(5, 1_000);
        let a = admitted(&fw, &[(100, 1), (150, 2)]);
        let b = admitted(&fw, &[(200, 2)]);
        let mut m = merged(&fw, &a, &b);
        assert_eq!(
            m,
            KeyState::FixedWindow(FixedWindowState { idx: 0, count: 5 })
        );
        let d = fw.check(&mut m, 300, nz(1));
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, 700);
        // The next window starts empty, as it would on one node.
        assert!(fw.check(&mut m, 1_000, nz(5)).allowed);
    }

    #[test]
    fn fixed_window_later_window_wins_and_counts_are_capped() {
        let fw = fixed(5, 1_000);
        let old = admitted(&fw, &[(100, 5)]);
        let new = admitted(&fw, &[(1_100, 1)]);
        let want = KeyState::FixedWindow(FixedWindowState { idx: 1, count: 1 });
        assert_eq!(merged(&fw, &old, &new), want);
        assert_eq!(merged(&fw, &new, &old), want);
        let four = admitted(&fw, &[(100, 4)]);
        let three = admitted(&fw, &[(200, 3)]);
        let capped = KeyState::FixedWindow(FixedWindowState { idx: 0, count: 5 });
        assert_eq!(merged(&fw, &four, &three), capped);
    }

    #[test]
    fn sliding_counter_rolls_the_older_state_then_adds_both_windows() {
        let sc = counter(10, 1_000);
        let a = admitted(&sc, &[(500, 6)]); // window 0
        let b = admitted(&sc, &[(1_200, 3)]); // window 1
        let m = merged(&sc, &a, &b);
        let want = SlidingCounterState {
            idx: 1,
            prev: 6,
            curr: 3,
        };
        assert_eq!(m, KeyState::SlidingWindowCounter(want));
        // At 1.5 s half of the previous 6 still counts: 3 + 3 = 6 used, 4 left.
        assert!(sc.check(&mut m.clone(), 1_500, nz(4)).allowed);
        assert!(!sc.check(&mut m.clone(), 1_500, nz(5)).allowed);
        // Two or more windows behind: the older state's counts have aged out entirely.
        let c = admitted(&sc, &[(2_100, 1)]);
        let want = SlidingCounterState {
            idx: 2,
            prev: 0,
            curr: 1,
        };
        assert_eq!(merged(&sc, &a, &c), KeyState::SlidingWindowCounter(want));
    }

    #[test]
    fn sliding_counter_sums_are_capped_at_the_limit() {
        let sc = counter(10, 1_000);
        let a = admitted(&sc, &[(500, 8)]);
        let b = admitted(&sc, &[(600, 7)]);
        let mut m = merged(&sc, &a, &b);
        let want = SlidingCounterState {
            idx: 0,
            prev: 0,
            curr: 10,
        };
        assert_eq!(m, KeyState::SlidingWindowCounter(want));
        assert!(!sc.check(&mut m, 900, nz(1)).allowed);
        // Half way through the next window the full previous window weighs 5.
        assert_eq!(sc.check(&mut m, 1_500, nz(5)).remaining, 0);
    }

    #[test]
    fn token_bucket_advances_both_to_the_newer_instant_then_adds_deficits() {
        let tb = bucket(10, 1, 100); // one token per 100 ms
        let a = admitted(&tb, &[(0, 6)]); // 3 tokens back by 300 ms
        let b = admitted(&tb, &[(300, 5)]);
        let m = merged(&tb, &a, &b);
        let want = TokenBucketState {
            deficit: 8 * 100,
            last: 300,
        };
        assert_eq!(m, KeyState::TokenBucket(want));
        assert!(tb.check(&mut m.clone(), 300, nz(2)).allowed);
        let d = tb.check(&mut m.clone(), 300, nz(3));
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, 100);
        // Both emptied the bucket: the merged one is empty, not "more than empty".
        let full = admitted(&tb, &[(0, 10)]);
        let m = merged(&tb, &full, &full);
        let want = TokenBucketState {
            deficit: 1_000,
            last: 0,
        };
        assert_eq!(m, KeyState::TokenBucket(want));
    }

    #[test]
    fn gcra_books_both_backlogs_back_to_back() {
        let g = meter(10, 1_000, 5); // T = 100 ms, tau = 500 ms
        let a = admitted(&g, &[(0, 3)]); // schedule busy until 300 ms
        let b = admitted(&g, &[(100, 2)]); // busy until 300 ms
        let mut m = merged(&g, &a, &b);
        // From t = 100 ms: 200 ms of backlog each -> busy until 500 ms.
        let want = GcraState {
            tat: 500 * 10,
            last_admit: 100,
        };
        assert_eq!(m, KeyState::LeakyBucket(want));
        let d = g.check(&mut m, 100, nz(1));
        assert!(d.allowed);
        assert_eq!(d.remaining, 0);
        let d = g.check(&mut m, 100, nz(1));
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, 100);
    }

    #[test]
    fn gcra_idle_schedule_adds_no_backlog() {
        let g = shaper(10, 1_000, 3);
        let a = admitted(&g, &[(0, 1)]); // idle again from 100 ms
        let b = admitted(&g, &[(1_000, 2)]); // busy until 1200 ms
        let want = GcraState {
            tat: 1_200 * 10,
            last_admit: 1_000,
        };
        assert_eq!(merged(&g, &a, &b), KeyState::LeakyBucket(want));
    }

    #[test]
    fn sliding_log_unions_entries_and_keeps_the_newest_units() {
        let sl = log(5, 1_000);
        let a = admitted(&sl, &[(100, 2), (300, 1)]);
        let b = admitted(&sl, &[(100, 1), (400, 2)]);
        let mut m = merged(&sl, &a, &b);
        // Union (100, 3) (300, 1) (400, 2) sums to 6: one unit of the oldest entry goes.
        let want = SlidingLogState {
            entries: [(100, 2), (300, 1), (400, 2)].into(),
            sum: 5,
            high: 400,
        };
        assert_eq!(m, KeyState::SlidingWindowLog(want));
        let d = sl.check(&mut m, 500, nz(1));
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, 600); // the 100 ms entry ages out at 1100 ms
        let d = sl.check(&mut m, 1_100, nz(1));
        assert!(d.allowed);
        assert_eq!(d.remaining, 1);
    }

    #[test]
    fn sliding_log_drops_entries_dead_at_the_newer_high_water_mark() {
        let sl = log(5, 1_000);
        let a = admitted(&sl, &[(100, 5)]);
        let b = admitted(&sl, &[(1_100, 1), (1_200, 1)]);
        let want = SlidingLogState {
            entries: [(1_100, 1), (1_200, 1)].into(),
            sum: 2,
            high: 1_200,
        };
        assert_eq!(merged(&sl, &a, &b), KeyState::SlidingWindowLog(want));
    }

    #[test]
    fn foreign_or_inconsistent_states_are_not_merged() {
        let fw = fixed(5, 1_000);
        let tb = bucket(5, 5, 1_000);
        let mine = admitted(&fw, &[(100, 3)]);
        // `other` of another algorithm: kept unchanged.
        let mut into = mine.clone();
        fw.merge(&mut into, admitted(&tb, &[(100, 1)]));
        assert_eq!(into, mine);
        // `other` inconsistent with the rule (count above the limit): kept unchanged.
        let six = KeyState::from_words(AlgorithmKind::FixedWindow, &[0, 6]).unwrap();
        fw.merge(&mut into, six);
        assert_eq!(into, mine);
        // `into` of another algorithm: becomes `other`.
        let mut into = admitted(&tb, &[(100, 1)]);
        fw.merge(&mut into, mine.clone());
        assert_eq!(into, mine);
    }

    /// Two nodes' checks (absolute instants, in time order), a series of later probes.
    #[derive(Debug, Clone)]
    struct Scenario {
        a: Vec<(Millis, u64)>,
        b: Vec<(Millis, u64)>,
        probes: Vec<(u64, u64)>,
    }

    /// 2023-11-14T22:13:20Z: realistic Unix milliseconds.
    const BASE: Millis = 1_700_000_000_000;

    /// Both nodes check on forward-moving clocks over the same span of `3 * span` ms (so their
    /// histories interleave and often end in the same window; bursts on one ms are common);
    /// probes then move forward by up to half a span at a time, through the decay afterwards.
    fn scenario(span: u64, max_cost: u64) -> impl Strategy<Value = Scenario> {
        let checks = move || {
            let at = prop_oneof![1 => Just(span), 3 => 0..=3 * span];
            prop::collection::vec((at, 1..=max_cost), 0..24).prop_map(|mut v| {
                v.sort_by_key(|c| c.0);
                v.into_iter().map(|(at, c)| (BASE + at, c)).collect()
            })
        };
        (
            checks(),
            checks(),
            prop::collection::vec((0..=span / 2 + 1, 1..=max_cost), 1..16),
        )
            .prop_map(|(a, b, probes)| Scenario { a, b, probes })
    }

    /// Runs `checks` on a fresh state; returns it, the final clock and the admitted checks.
    fn run(limiter: &Limiter, checks: &[(Millis, u64)]) -> (KeyState, Millis, Vec<(Millis, u64)>) {
        let mut state = limiter.new_state();
        let mut admitted = Vec::new();
        for &(now, cost) in checks {
            if limiter.check(&mut state, now, nz(cost)).allowed {
                admitted.push((now, cost));
            }
        }
        let end = checks.last().map_or(BASE, |c| c.0);
        (state, end, admitted)
    }

    /// Units admissible right now (a cost-1 probe on a clone: `remaining` before it).
    fn available(limiter: &Limiter, s: &KeyState, t: Millis) -> u64 {
        let d = limiter.check(&mut s.clone(), t, NonZeroU64::MIN);
        d.remaining + u64::from(d.allowed)
    }

    /// Force-admit reference: would one node that admitted all of `admitted` admit `cost` at
    /// `t`? Only for the exact (window) algorithms, whose merge it must match decision for
    /// decision.
    type Reference = fn(&Limiter, &[(Millis, u64)], Millis, u64) -> bool;

    fn fixed_reference(
        limiter: &Limiter,
        admitted: &[(Millis, u64)],
        t: Millis,
        cost: u64,
    ) -> bool {
        let Limiter::FixedWindow(l) = limiter else {
            unreachable!()
        };
        let k = t / l.window_ms;
        let used: u64 = admitted
            .iter()
            .filter(|&&(at, _)| at / l.window_ms == k)
            .map(|&(_, c)| c)
            .sum();
        used + cost <= l.limit
    }

    fn log_reference(limiter: &Limiter, admitted: &[(Millis, u64)], t: Millis, cost: u64) -> bool {
        let Limiter::SlidingWindowLog(l) = limiter else {
            unreachable!()
        };
        let live: u64 = admitted
            .iter()
            .filter(|&&(at, _)| t - at < l.window_ms)
            .map(|&(_, c)| c)
            .sum();
        live + cost <= l.limit
    }

    /// The merge contract on one scenario: the merge is accepted and symmetric; at every probe
    /// it never has more units available than either input and never admits what either input
    /// denies (nor, with a reference, decides differently from one node that saw everything);
    /// merging with a fresh state, either way round, decides exactly like the state itself.
    fn assert_merge_contract(
        limiter: &Limiter,
        sc: &Scenario,
        reference: Option<Reference>,
    ) -> Result<(), TestCaseError> {
        let (a, end_a, adm_a) = run(limiter, &sc.a);
        let (b, end_b, adm_b) = run(limiter, &sc.b);
        prop_assert!(limiter.accepts(&a) && limiter.accepts(&b));
        let mut m = a.clone();
        limiter.merge(&mut m, b.clone());
        prop_assert!(limiter.accepts(&m), "not accepted: {:?}", m);
        let mut rev = b.clone();
        limiter.merge(&mut rev, a.clone());
        prop_assert_eq!(&m, &rev, "merge is not symmetric");
        let fresh = limiter.new_state();
        let with_fresh = |x: &KeyState| {
            let mut x_f = x.clone();
            limiter.merge(&mut x_f, fresh.clone());
            let mut f_x = fresh.clone();
            limiter.merge(&mut f_x, x.clone());
            (x_f, f_x)
        };
        let (a_f, f_a) = with_fresh(&a);
        let (b_f, f_b) = with_fresh(&b);
        let all: Vec<_> = adm_a.iter().chain(&adm_b).copied().collect();
        let mut t = end_a.max(end_b);
        // At the merge instant the merged state has used up what both inputs used (up to one
        // unit of rounding), unless it is simply full: it forgot neither node's admissions.
        let (avail_m, avail_a, avail_b) = (
            available(limiter, &m, t),
            available(limiter, &a, t),
            available(limiter, &b, t),
        );
        let full = limiter.check(&mut fresh.clone(), t, NonZeroU64::MIN).limit;
        if avail_m > 0 && !prev_capped(limiter, &a, &b) {
            prop_assert!(
                avail_m + full <= avail_a + avail_b + 1,
                "at {}: merged has {} of {} left, a {} and b {}: admissions were lost",
                t,
                avail_m,
                full,
                avail_a,
                avail_b
            );
        }
        for &(step, cost) in &sc.probes {
            t += step;
            let (avail_m, avail_a, avail_b) = (
                available(limiter, &m, t),
                available(limiter, &a, t),
                available(limiter, &b, t),
            );
            prop_assert!(
                avail_m <= avail_a && avail_m <= avail_b,
                "at {}: merged has {} left, a {} and b {}",
                t,
                avail_m,
                avail_a,
                avail_b
            );
            let decide = |s: &KeyState| limiter.check(&mut s.clone(), t, nz(cost));
            let (dm, da, db) = (decide(&m), decide(&a), decide(&b));
            prop_assert!(
                !dm.allowed || (da.allowed && db.allowed),
                "at {} cost {}: merged admits, a {:?}, b {:?}",
                t,
                cost,
                da,
                db
            );
            if let Some(reference) = reference {
                prop_assert_eq!(
                    dm.allowed,
                    reference(limiter, &all, t, cost),
                    "at {} cost {}: merged differs from one node that saw everything",
                    t,
                    cost
                );
            }
            prop_assert_eq!(decide(&a_f), da, "merge(a, fresh) at {}", t);
            prop_assert_eq!(decide(&f_a), da, "merge(fresh, a) at {}", t);
            prop_assert_eq!(decide(&b_f), db, "merge(b, fresh) at {}", t);
            prop_assert_eq!(decide(&f_b), db, "merge(fresh, b) at {}", t);
        }
        Ok(())
    }

    /// Sliding counter: the previous windows' sum exceeded the limit and was capped; GCRA: the
    /// two backlogs together were booked beyond the burst tolerance and capped there. Either
    /// legitimately leaves the merged state less full than the sum of both inputs (it is
    /// still at least as full as each).
    fn prev_capped(limiter: &Limiter, a: &KeyState, b: &KeyState) -> bool {
        match (limiter, a, b) {
            (Limiter::LeakyBucket(l), KeyState::LeakyBucket(a), KeyState::LeakyBucket(b)) => {
                let ts = u128::from(a.last_admit.max(b.last_admit)) * u128::from(l.limit);
                a.tat.saturating_sub(ts) + b.tat.saturating_sub(ts) > l.tau()
            }
            (
                Limiter::SlidingWindowCounter(l),
                KeyState::SlidingWindowCounter(a),
                KeyState::SlidingWindowCounter(b),
            ) => {
                let idx = a.idx.max(b.idx);
                roll_counter(a, idx).0 + roll_counter(b, idx).0 > l.limit
            }
            _ => false,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// Fixed window merge is never more generous than either node, and decides exactly
        /// like one node that admitted everything both did.
        #[test]
        fn fixed_window_merge_is_never_more_generous(
            (limiter, sc) in (1u64..=8, 1u64..=1_000)
                .prop_flat_map(|(l, w)| (Just(fixed(l, w)), scenario(w, l)))
        ) {
            assert_merge_contract(&limiter, &sc, Some(fixed_reference))?;
        }

        /// Sliding counter merge is never more generous than either node.
        #[test]
        fn sliding_counter_merge_is_never_more_generous(
            (limiter, sc) in (1u64..=8, 1u64..=1_000)
                .prop_flat_map(|(l, w)| (Just(counter(l, w)), scenario(w, l)))
        ) {
            assert_merge_contract(&limiter, &sc, None)?;
        }

        /// Token bucket merge is never more generous than either node.
        #[test]
        fn token_bucket_merge_is_never_more_generous(
            (limiter, sc) in (1u64..=8, 1u64..=8, 1u64..=1_000)
                .prop_flat_map(|(c, r, p)| (Just(bucket(c, r, p)), scenario(p, c)))
        ) {
            assert_merge_contract(&limiter, &sc, None)?;
        }

        /// GCRA merge (meter and shaper) is never more generous than either node.
        #[test]
        fn gcra_merge_is_never_more_generous(
            (limiter, sc) in (any::<bool>(), 1u64..=8, 1u64..=1_000, 1u64..=8)
                .prop_flat_map(|(is_meter, l, p, cap)| {
                    let g = if is_meter { meter(l, p, cap) } else { shaper(l, p, cap - 1) };
                    (Just(g), scenario(p, cap))
                })
        ) {
            assert_merge_contract(&limiter, &sc, None)?;
        }

        /// Sliding log merge is never more generous than either node, and decides exactly
        /// like one node that admitted everything both did.
        #[test]
        fn sliding_log_merge_is_never_more_generous(
            (limiter, sc) in (1u64..=8, 1u64..=1_000)
                .prop_flat_map(|(l, w)| (Just(log(l, w)), scenario(w, l)))
        ) {
            assert_merge_contract(&limiter, &sc, Some(log_reference))?;
        }

        /// Any two accepted states, with extreme times and counts, merge without panicking into
        /// an accepted state; arbitrary (mostly refused) words never panic and a refused
        /// `other` leaves `into` alone.
        #[test]
        fn merged_state_is_always_accepted(
            wa in prop::array::uniform8(wild_u64()),
            wb in prop::array::uniform8(wild_u64()),
        ) {
            for limiter in extreme_limiters() {
                let (a, b) = (fit(&limiter, &wa), fit(&limiter, &wb));
                prop_assert!(limiter.accepts(&a) && limiter.accepts(&b));
                let mut m = a.clone();
                limiter.merge(&mut m, b.clone());
                prop_assert!(limiter.accepts(&m), "{:?} + {:?} = {:?}", a, b, m);
                limiter.check(&mut m, wa[0], NonZeroU64::MIN);
                for kind in AlgorithmKind::ALL {
                    for raw in [raw_state(kind, &wa), raw_state(kind, &wb)].into_iter().flatten() {
                        let mut into = a.clone();
                        limiter.merge(&mut into, raw.clone());
                        if limiter.accepts(&raw) {
                            prop_assert!(limiter.accepts(&into));
                        } else {
                            prop_assert_eq!(&into, &a);
                        }
                        let mut into = raw.clone();
                        limiter.merge(&mut into, b.clone());
                        prop_assert!(limiter.accepts(&into));
                    }
                }
            }
        }
    }

    /// Ordinary rules and rules at the edges of what the constructors accept.
    fn extreme_limiters() -> Vec<Limiter> {
        let max = u64::MAX;
        vec![
            fixed(5, 1_000),
            fixed(max, 1),
            counter(5, 1_000),
            counter(max, max),
            bucket(5, 5, 1_000),
            bucket(max, max, 1),
            bucket(1, 1, max),
            meter(5, 1_000, 3),
            meter(max, 1, 1),
            shaper(max, max, 0),
            log(5, 1_000),
            log(crate::algorithms::MAX_SLIDING_LOG_LIMIT, max),
        ]
    }

    /// Words as given, in the shape `kind` expects (usually refused by `accepts`).
    fn raw_state(kind: AlgorithmKind, w: &[u64; 8]) -> Option<KeyState> {
        let len = match kind {
            AlgorithmKind::TokenBucket | AlgorithmKind::FixedWindow => 2,
            AlgorithmKind::LeakyBucket | AlgorithmKind::SlidingWindowCounter => 3,
            AlgorithmKind::SlidingWindowLog => 6,
        };
        KeyState::from_words(kind, &w[..len])
    }

    /// An accepted state of `limiter` built from arbitrary words (counts clamped to the rule).
    fn fit(limiter: &Limiter, w: &[u64; 8]) -> KeyState {
        match limiter {
            Limiter::FixedWindow(l) => KeyState::FixedWindow(FixedWindowState {
                idx: w[0],
                count: w[1].min(l.limit),
            }),
            Limiter::SlidingWindowCounter(l) => {
                KeyState::SlidingWindowCounter(SlidingCounterState {
                    idx: w[0],
                    prev: w[1].min(l.limit),
                    curr: w[2].min(l.limit),
                })
            }
            Limiter::TokenBucket(l) => KeyState::TokenBucket(TokenBucketState {
                deficit: w[1].min(l.full),
                last: w[0],
            }),
            Limiter::LeakyBucket(l) => KeyState::LeakyBucket(GcraState {
                tat: ((u128::from(w[1]) << 64) | u128::from(w[2]))
                    .min(u128::from(u64::MAX) * u128::from(l.limit)),
                last_admit: w[0],
            }),
            Limiter::SlidingWindowLog(l) => {
                // Distinct instants with costs 1 or 2, oldest dropped until the sum fits.
                let mut by_time = BTreeMap::new();
                for (i, &at) in w[3..].iter().enumerate() {
                    *by_time.entry(at).or_insert(0) += 1 + i as u64 % 2;
                }
                let mut entries: VecDeque<_> = by_time.into_iter().collect();
                let mut sum: u64 = entries.iter().map(|e| e.1).sum();
                while sum > l.limit {
                    sum -= entries.pop_front().map_or(0, |e| e.1);
                }
                let newest = entries.back().map_or(0, |e| e.0);
                KeyState::SlidingWindowLog(SlidingLogState {
                    entries,
                    sum,
                    high: w[0].max(newest),
                })
            }
        }
    }
}
