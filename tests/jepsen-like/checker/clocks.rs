//! Each node's wall clock as the clock-offset nemesis set it, for the properties that
//! measure time on the decider's clock (S1-log, S1-tb) and for the windows a charge in
//! doubt may land in.
//!
//! A node's reading is real time plus the offset in effect, clamped so it never goes
//! back (ringlimit's `Clamped`). The offset is known only up to when the node picked
//! it up: from the `clock` line (written before the offset file) until [`LAG_MS`] after
//! it either the old or the new offset may be in effect. So each offset is a segment
//! `[set, next set + LAG_MS]`, and the bounds below take every segment that may apply.
//! A node the nemesis never touched reads real time exactly.

use std::collections::HashMap;

/// How long after a `clock` line the node may still read the old offset: libfaketime
/// re-reads the offset file once the whole seconds since its last read exceed its cache
/// duration (`FAKETIME_CACHE_DURATION=1`), so up to 2 s later; plus scheduling slack.
/// (A run found a node still on the old offset 1.5 s after the line.)
pub const LAG_MS: u64 = 3_000;

/// One offset and when it may be in effect (real Unix ms).
#[derive(Clone, Copy, Debug)]
struct Segment {
    from: u64,
    until: u64,
    offset: i64,
}

#[derive(Default, Debug)]
pub struct Clocks {
    /// Node id → its offsets in time order (before the first: offset 0).
    set: HashMap<String, Vec<(u64, i64)>>,
}

fn shift(t: u64, offset: i64) -> u64 {
    t.saturating_add_signed(offset)
}

impl Clocks {
    pub fn record(&mut self, node: &str, t: u64, offset_ms: i64) {
        self.set
            .entry(node.to_string())
            .or_default()
            .push((t, offset_ms));
    }

    fn segments(&self, node: &str) -> Vec<Segment> {
        let mut set = self.set.get(node).cloned().unwrap_or_default();
        set.sort_by_key(|&(t, _)| t);
        let mut out = Vec::with_capacity(set.len() + 1);
        let mut from = 0;
        let mut offset = 0;
        for &(t, next) in &set {
            out.push(Segment {
                from,
                until: t + LAG_MS,
                offset,
            });
            (from, offset) = (t, next);
        }
        out.push(Segment {
            from,
            until: u64::MAX,
            offset,
        });
        out
    }

    /// An upper bound on `node`'s (clamped) reading at real time `t`: the highest
    /// real time + offset it may have read up to then.
    pub fn high(&self, node: &str, t: u64) -> u64 {
        self.segments(node)
            .iter()
            .filter(|s| s.from <= t)
            .map(|s| shift(s.until.min(t), s.offset))
            .max()
            .unwrap_or(t)
    }

    /// A lower bound on `node`'s reading for a decision made within real `[a, b]`.
    pub fn low(&self, node: &str, a: u64, b: u64) -> u64 {
        self.segments(node)
            .iter()
            .filter(|s| s.from <= b && s.until >= a)
            .map(|s| s.offset)
            .min()
            .map_or(a, |offset| shift(a, offset))
    }

    /// At most how much `node`'s clock advanced between a decision made within
    /// `[invoke_i, complete_i]` and one made before `complete_j`.
    pub fn elapsed(&self, node: &str, invoke_i: u64, complete_i: u64, complete_j: u64) -> u64 {
        self.high(node, complete_j)
            .saturating_sub(self.low(node, invoke_i, complete_i))
    }

    /// The earliest any node's clock may have read during real `[a, b]` (at most `a`):
    /// for an op whose decider is unknown, or that may have been decided on state a
    /// node with another clock handed over.
    pub fn earliest(&self, a: u64, b: u64) -> u64 {
        self.set.keys().map(|n| self.low(n, a, b)).fold(a, u64::min)
    }

    /// The latest any node's clock may have read by real time `t` (at least `t`).
    pub fn latest(&self, t: u64) -> u64 {
        self.set.keys().map(|n| self.high(n, t)).fold(t, u64::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_untouched_node_reads_real_time() {
        let c = Clocks::default();
        assert_eq!(c.high("n1", 5_000), 5_000);
        assert_eq!(c.low("n1", 4_000, 4_500), 4_000);
        assert_eq!(c.elapsed("n1", 4_000, 4_100, 5_000), 1_000);
    }

    #[test]
    fn a_forward_step_lengthens_elapsed_time_by_the_offset() {
        let mut c = Clocks::default();
        c.record("n1", 10_000, 3_000);
        c.record("n1", 20_000, 0);
        // Both decisions well inside the +3 s segment: elapsed is real.
        assert_eq!(c.elapsed("n1", 14_000, 14_000, 15_000), 1_000);
        // Across the step: the later one may read 3 s ahead.
        assert_eq!(c.elapsed("n1", 9_000, 9_000, 12_000), 6_000);
        // After the heal the clamped clock stays at the +3 s high-water mark.
        assert_eq!(c.high("n1", 21_000), 24_000);
        assert_eq!(c.high("n1", 40_000), 40_000);
        assert_eq!(c.latest(12_000), 15_000);
        assert_eq!(c.earliest(12_000, 12_000), 12_000);
        // Far from any step, every clock reads real time: no widening.
        assert_eq!(
            (c.earliest(60_000, 61_000), c.latest(61_000)),
            (60_000, 61_000)
        );
    }

    #[test]
    fn a_backward_step_is_never_counted_as_time_passing() {
        let mut c = Clocks::default();
        c.record("n1", 10_000, -2_000);
        // The reading is clamped: a decision before the step bounds the later ones.
        assert_eq!(c.high("n1", 10_500), 10_500);
        assert_eq!(c.low("n1", 12_000, 12_000), 10_000);
        // A bound, not the reading (which is frozen at ~13 s throughout).
        assert_eq!(c.elapsed("n1", 12_000, 12_000, 13_000), 3_000);
        assert_eq!(c.earliest(10_000, 10_000), 8_000);
        assert_eq!(c.latest(12_000), 12_000);
    }
}
