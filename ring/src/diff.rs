//! Pure comparison of two rings: which parts of the hash space changed owner.

use super::{arc_len, Ring, SPACE};

/// A range of the key-hash space (see [`Ring::key_hash`]) whose owner changed
/// from `from` to `to`.
///
/// The range is `(start, end]` on the 64-bit ring: `start` exclusive, `end`
/// inclusive. If `start >= end` the range wraps around through `u64::MAX` to
/// `0`; `start == end` means the whole space.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RangeMove {
    /// Exclusive lower bound.
    pub start: u64,
    /// Inclusive upper bound.
    pub end: u64,
    /// Owner in the old ring.
    pub from: String,
    /// Owner in the new ring.
    pub to: String,
}

impl RangeMove {
    /// `true` if key hash `h` lies in this range.
    pub fn contains(&self, h: u64) -> bool {
        if self.start < self.end {
            self.start < h && h <= self.end
        } else {
            h > self.start || h <= self.end
        }
    }

    /// Fraction of the whole hash space this range covers.
    pub fn fraction(&self) -> f64 {
        arc_len(self.start, self.end) as f64 / SPACE
    }
}

/// The difference between two rings: the parts of the hash space that changed
/// owner, as computed by [`diff`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RingDiff {
    /// Disjoint ranges that changed owner, sorted by `end`. Adjacent ranges
    /// with the same `(from, to)` are merged, so at most one range wraps
    /// (and, if present, it is first). [`RingDiff::moved`] relies on this
    /// order.
    pub moves: Vec<RangeMove>,
}

/// Computes which ranges of the hash space changed owner between `old` and
/// `new`. Pure: no key is looked at.
///
/// If either ring is empty the diff is empty: with no old owner nothing needs
/// handing off, and with no new owner there is nobody to hand off to.
pub fn diff(old: &Ring, new: &Ring) -> RingDiff {
    if old.is_empty() || new.is_empty() {
        return RingDiff::default();
    }

    // Every position of either ring is a boundary; between two consecutive
    // boundaries both rings have a constant owner: the owner of the upper
    // (inclusive) boundary.
    let mut bounds: Vec<u64> = Vec::with_capacity(old.positions().len() + new.positions().len());
    bounds.extend_from_slice(old.positions());
    bounds.extend_from_slice(new.positions());
    bounds.sort_unstable();
    bounds.dedup();

    let n = bounds.len();
    let mut moves: Vec<RangeMove> = Vec::new();
    // Segment k is (bounds[k-1], bounds[k]]; segment 0 wraps from the last
    // boundary. Walking k upward keeps `moves` sorted by `end`.
    for k in 0..n {
        let start = bounds[(k + n - 1) % n];
        let end = bounds[k];
        let from = old.owner_of_hash(end).expect("non-empty ring");
        let to = new.owner_of_hash(end).expect("non-empty ring");
        if from == to {
            continue;
        }
        match moves.last_mut() {
            Some(last) if last.end == start && last.from == from && last.to == to => {
                last.end = end;
            }
            _ => moves.push(RangeMove {
                start,
                end,
                from: from.to_owned(),
                to: to.to_owned(),
            }),
        }
    }

    // Close the circle: the last range may continue into the first.
    if moves.len() > 1 {
        let (first, last) = (&moves[0], &moves[moves.len() - 1]);
        if last.end == first.start && last.from == first.from && last.to == first.to {
            let last = moves.pop().expect("len > 1");
            moves[0].start = last.start;
        }
    }

    RingDiff { moves }
}

impl RingDiff {
    /// `Some((from, to))` if `key`'s owner changed from `from` (old ring) to
    /// `to` (new ring); `None` if it did not (or either ring was empty).
    pub fn moved(&self, key: &[u8]) -> Option<(&str, &str)> {
        self.moved_hash(Ring::key_hash(key))
    }

    /// Like [`RingDiff::moved`], for a key hash as given by
    /// [`Ring::key_hash`].
    pub fn moved_hash(&self, h: u64) -> Option<(&str, &str)> {
        let first = self.moves.first()?;
        let found = if first.start >= first.end && first.contains(h) {
            Some(first)
        } else {
            let i = self.moves.partition_point(|m| m.end < h);
            self.moves.get(i).filter(|m| m.contains(h))
        };
        found.map(|m| (m.from.as_str(), m.to.as_str()))
    }

    /// `true` if no part of the hash space changed owner.
    pub fn is_empty(&self) -> bool {
        self.moves.is_empty()
    }

    /// Fraction of the hash space (hence, expectedly, of keys) that changed
    /// owner, in `[0, 1]`.
    pub fn moved_fraction(&self) -> f64 {
        let total: u128 = self.moves.iter().map(|m| arc_len(m.start, m.end)).sum();
        total as f64 / SPACE
    }
}
