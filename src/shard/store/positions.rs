//! The store's index: which slot holds a key, found by the key's hash.
//!
//! An open-addressing table of bare `u32` buckets with Robin Hood linear probing and
//! backward-shift deletion. It replaces a `hashbrown::HashTable<u32>` for one reason,
//! memory: hashbrown spends 5 bytes per bucket (a control byte and the `u32`) and sizes
//! itself in powers of two, so at a given key count it runs anywhere between 7/16 and
//! 7/8 full: ~10.5 bytes per key at 500,000 keys. This table spends 4 bytes per bucket
//! and grows by a quarter at 4/5 full (any bucket count: the home bucket is found by a
//! multiply-shift, not a mask), so it stays between 64 % and 80 % full: 5 to 6.25 bytes
//! per key (5.3 at 500,000 keys).
//!
//! Each bucket packs three fields, widths chosen from the bucket count `n`:
//!
//! ```text
//!   [ tag | distance | position ]      position: enough bits for any value < n
//! ```
//!
//! - `position` is the slot's index in the store's dense vector. A position is always
//!   below `n` (the table is never full), so its field is never all ones and the
//!   all-ones word is free to mean "empty".
//! - `distance` (up to 6 bits) is how far the entry sits from its home bucket. It lets
//!   a lookup stop early (Robin Hood keeps every run sorted by distance, so meeting an
//!   entry closer to home than the probe means the key is absent) and lets deletion
//!   shift entries back without rehashing them. A distance too large for the field
//!   saturates; the rare saturated entry's true distance is recomputed from its key's
//!   hash, so the field's width bounds speed, never correctness.
//! - `tag` (whatever bits remain: 6 at 500,000 keys, 5 at a million) holds hash bits, so
//!   most non-matching entries are skipped without reading their slot.
//!
//! The table does not hash: callers pass a key's 64-bit hash (the store's secret-seeded
//! hasher, which is what keeps attacker-chosen keys from sharing a probe sequence) and
//! a way to get the hash of the key at a position, for growth and saturated entries.

/// A bucket holding no entry. Never a valid entry: see the module docs.
const EMPTY: u32 = u32::MAX;

/// Widest distance field: 63 steps from home is far beyond what a well-spread hash
/// produces at 4/5 load.
const DIST_BITS: u32 = 6;

/// Most buckets: below 2^31, so a position and a distance field always fit a `u32`.
const MAX_BUCKETS: usize = (1 << 31) - 1;

/// Most entries a table can hold (~1.7 billion): its maximum load of the largest table.
pub(super) const MAX_LEN: usize = MAX_BUCKETS / LOAD_DEN * LOAD_NUM;

/// The table grows before it is more than 4/5 full: linear probing's cost rises
/// steeply past that (an insert probes ~13 buckets on average at 4/5, ~32 at 7/8).
const LOAD_NUM: usize = 4;
const LOAD_DEN: usize = 5;

/// Buckets of the first allocation.
const MIN_BUCKETS: usize = 16;

/// Field widths for a table of `n` buckets, with the masks and shifts a probe uses
/// precomputed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    pos_bits: u32,
    dist_bits: u32,
    pos_mask: u32,
    /// The saturated (and largest) distance value; 0 when there is no distance field,
    /// which makes every entry saturated.
    dist_max: u32,
    /// The tag's bits within an entry (0 when there are none).
    tag_mask: u32,
}

impl Layout {
    fn for_buckets(n: usize) -> Self {
        // `n < 2^pos_bits`, so a position (< n) never fills its field; `n` stays below
        // 2^31, so every shift below is by less than 32.
        let pos_bits = (usize::BITS - n.leading_zeros()).clamp(1, 31);
        let dist_bits = DIST_BITS.min(32 - pos_bits);
        let low = pos_bits + dist_bits;
        Self {
            pos_bits,
            dist_bits,
            pos_mask: (1 << pos_bits) - 1,
            dist_max: (1 << dist_bits) - 1,
            tag_mask: (u64::from(u32::MAX) << low) as u32,
        }
    }

    #[cfg(test)]
    fn tag_bits(self) -> u32 {
        32 - self.pos_bits - self.dist_bits
    }

    /// The hash's tag bits, in place within an entry: the low half of the hash (the
    /// home bucket is taken from the high bits).
    #[inline]
    fn tag_of_hash(self, hash: u64) -> u32 {
        hash as u32 & self.tag_mask
    }

    #[inline]
    fn pack(self, tag: u32, dist: u32, pos: u32) -> u32 {
        tag | (dist.min(self.dist_max) << self.pos_bits) | pos
    }

    #[inline]
    fn pos(self, entry: u32) -> u32 {
        entry & self.pos_mask
    }

    #[inline]
    fn dist(self, entry: u32) -> u32 {
        (entry >> self.pos_bits) & self.dist_max
    }

    #[inline]
    fn tag(self, entry: u32) -> u32 {
        entry & self.tag_mask
    }
}

/// Slot positions by key hash (see the module docs).
#[derive(Debug)]
pub(super) struct Positions {
    buckets: Box<[u32]>,
    len: usize,
    layout: Layout,
}

impl Default for Positions {
    fn default() -> Self {
        Self {
            buckets: Box::default(),
            len: 0,
            layout: Layout::for_buckets(0),
        }
    }
}

impl Positions {
    /// Drop every entry and the buckets.
    pub(super) fn clear(&mut self) {
        *self = Self::default();
    }

    /// The position of the key with hash `hash` for which `eq` holds.
    #[inline]
    pub(super) fn find(&self, hash: u64, eq: impl FnMut(u32) -> bool) -> Option<u32> {
        self.bucket_where(hash, eq)
            .map(|b| self.layout.pos(self.buckets[b]))
    }

    /// The bucket holding `pos`, an entry inserted with `hash`.
    pub(super) fn bucket_of(&self, hash: u64, pos: u32) -> Option<usize> {
        self.bucket_where(hash, |p| p == pos)
    }

    /// Point the entry in bucket `bucket` (from [`Positions::bucket_of`]) at `pos`
    /// instead: the key moved within the slot vector. `pos` must be below the number of
    /// buckets, as every position is.
    pub(super) fn set_pos(&mut self, bucket: usize, pos: u32) {
        debug_assert!((pos as usize) < self.buckets.len());
        let layout = self.layout;
        let entry = self.buckets[bucket];
        self.buckets[bucket] = layout.pack(layout.tag(entry), layout.dist(entry), pos);
    }

    /// Add `pos` for a key with hash `hash` that is not in the table. `hash_of` gives
    /// the hash of the key at any position already in the table.
    pub(super) fn insert(&mut self, hash: u64, pos: u32, hash_of: impl Fn(u32) -> u64) {
        if (self.len + 1) * LOAD_DEN > self.buckets.len() * LOAD_NUM {
            self.grow(&hash_of);
        }
        debug_assert!((pos as usize) < self.buckets.len());
        self.place(hash, pos, &hash_of);
        self.len += 1;
    }

    /// Remove the entry `pos` inserted with `hash`; false if there is none. `hash_of`
    /// as for [`Positions::insert`].
    pub(super) fn remove(&mut self, hash: u64, pos: u32, hash_of: impl Fn(u32) -> u64) -> bool {
        let Some(mut b) = self.bucket_of(hash, pos) else {
            return false;
        };
        let layout = self.layout;
        // Backward shift: pull each following entry one step towards its home until an
        // empty bucket or an entry already at home. No tombstones, so a table that sees
        // constant churn (expiry, eviction) stays as fast as a fresh one.
        loop {
            let next = self.next(b);
            let entry = self.buckets[next];
            if entry == EMPTY {
                break;
            }
            let dist = self.true_dist(next, entry, &hash_of);
            if dist == 0 {
                break;
            }
            self.buckets[b] = layout.pack(layout.tag(entry), dist - 1, layout.pos(entry));
            b = next;
        }
        self.buckets[b] = EMPTY;
        self.len -= 1;
        true
    }

    /// The bucket of the first entry on `hash`'s probe sequence whose tag matches and
    /// for whose position `eq` holds.
    #[inline]
    fn bucket_where(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let layout = self.layout;
        let tag = layout.tag_of_hash(hash);
        let dist_max = layout.dist_max;
        let mut b = self.home(hash);
        let mut d = 0u32;
        loop {
            let entry = self.buckets[b];
            if entry == EMPTY {
                return None;
            }
            let dist = layout.dist(entry);
            if dist < d && dist < dist_max {
                // An entry nearer its home than we are to ours: Robin Hood would have
                // placed the key here, so it is absent.
                return None;
            }
            if layout.tag(entry) == tag && eq(layout.pos(entry)) {
                return Some(b);
            }
            b = self.next(b);
            d = d.saturating_add(1);
        }
    }

    /// Robin Hood insertion of an entry known to be absent (no growth check).
    fn place(&mut self, hash: u64, pos: u32, hash_of: &impl Fn(u32) -> u64) {
        let layout = self.layout;
        let (mut tag, mut pos, mut d) = (layout.tag_of_hash(hash), pos, 0u32);
        let mut b = self.home(hash);
        loop {
            let entry = self.buckets[b];
            if entry == EMPTY {
                self.buckets[b] = layout.pack(tag, d, pos);
                return;
            }
            let dist = self.true_dist(b, entry, hash_of);
            if dist < d {
                // Take from the rich (near home), give to the poor (far from home).
                self.buckets[b] = layout.pack(tag, d, pos);
                (tag, pos, d) = (layout.tag(entry), layout.pos(entry), dist);
            }
            b = self.next(b);
            d += 1;
        }
    }

    /// Rebuild with a quarter more buckets (at least [`MIN_BUCKETS`]).
    fn grow(&mut self, hash_of: &impl Fn(u32) -> u64) {
        let n = self.buckets.len();
        let target = (n + n / 4).clamp(MIN_BUCKETS, MAX_BUCKETS);
        let old = std::mem::replace(&mut self.buckets, vec![EMPTY; target].into_boxed_slice());
        let old_layout = std::mem::replace(&mut self.layout, Layout::for_buckets(target));
        for &entry in old.iter().filter(|&&e| e != EMPTY) {
            let pos = old_layout.pos(entry);
            self.place(hash_of(pos), pos, hash_of);
        }
    }

    /// The distance of `entry` (in bucket `b`) from its home, from its field or, when
    /// the field is saturated, from its key's hash.
    fn true_dist(&self, b: usize, entry: u32, hash_of: &impl Fn(u32) -> u64) -> u32 {
        let dist = self.layout.dist(entry);
        if dist < self.layout.dist_max {
            return dist;
        }
        let home = self.home(hash_of(self.layout.pos(entry)));
        let steps = if b >= home {
            b - home
        } else {
            b + self.buckets.len() - home
        };
        steps as u32
    }

    /// The first bucket `hash` probes: multiply-shift maps the hash onto any bucket
    /// count evenly, so the count need not be a power of two.
    #[inline]
    fn home(&self, hash: u64) -> usize {
        ((u128::from(hash) * self.buckets.len() as u128) >> 64) as usize
    }

    #[inline]
    fn next(&self, b: usize) -> usize {
        if b + 1 == self.buckets.len() {
            0
        } else {
            b + 1
        }
    }
}

#[cfg(test)]
impl Positions {
    /// Number of entries.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Bytes the buckets hold on the heap.
    pub(super) fn heap_bytes(&self) -> usize {
        self.buckets.len() * std::mem::size_of::<u32>()
    }

    /// Every entry is reachable from its hash, distances are exact or saturated, and
    /// runs are in Robin Hood order.
    pub(super) fn assert_consistent(&self, hash_of: impl Fn(u32) -> u64) {
        let layout = self.layout;
        let live = self.buckets.iter().filter(|&&e| e != EMPTY).count();
        assert_eq!(live, self.len);
        for (b, &entry) in self.buckets.iter().enumerate() {
            if entry == EMPTY {
                continue;
            }
            let pos = layout.pos(entry);
            let hash = hash_of(pos);
            assert_eq!(layout.tag(entry), layout.tag_of_hash(hash));
            let dist = self.true_dist(b, entry, &hash_of);
            assert_eq!(layout.dist(entry), dist.min(layout.dist_max), "bucket {b}");
            assert_eq!(self.bucket_of(hash, pos), Some(b));
            let next = self.buckets[self.next(b)];
            if next != EMPTY {
                assert!(self.true_dist(self.next(b), next, &hash_of) <= dist + 1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// Keys live in a dense vector like the store's slots; `spread` picks how the test
    /// hashes them: well spread, a few values (long shared runs), or one value.
    struct Model {
        keys: Vec<u64>,
        table: Positions,
        reference: HashMap<u64, u32>,
        spread: u8,
    }

    fn mix(key: u64) -> u64 {
        // splitmix64's finaliser: a decent stand-in for the store's seeded hasher.
        let mut z = key.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn hash_for(spread: u8, key: u64) -> u64 {
        match spread {
            0 => mix(key),
            1 => mix(key % 5),
            _ => 0x1234_5678_9abc_def0,
        }
    }

    impl Model {
        fn new(spread: u8) -> Self {
            Self {
                keys: Vec::new(),
                table: Positions::default(),
                reference: HashMap::new(),
                spread,
            }
        }

        fn hash(&self, key: u64) -> u64 {
            hash_for(self.spread, key)
        }

        fn find(&self, key: u64) -> Option<u32> {
            self.table
                .find(self.hash(key), |pos| self.keys[pos as usize] == key)
        }

        fn insert(&mut self, key: u64) {
            if self.reference.contains_key(&key) {
                return;
            }
            let pos = self.keys.len() as u32;
            self.keys.push(key);
            let Self { keys, table, .. } = self;
            let spread = self.spread;
            let hash_of = |p: u32| hash_for(spread, keys[p as usize]);
            table.insert(hash_for(spread, key), pos, hash_of);
            self.reference.insert(key, pos);
        }

        /// Remove like the store does: the last key takes the freed position.
        fn remove(&mut self, key: u64) {
            let Some(pos) = self.reference.remove(&key) else {
                assert!(!self.table.remove(self.hash(key), u32::MAX >> 8, |_| 0));
                return;
            };
            let spread = self.spread;
            let keys = &self.keys;
            assert!(self
                .table
                .remove(self.hash(key), pos, |p| hash_for(spread, keys[p as usize])));
            let last = self.keys.len() - 1;
            if pos as usize != last {
                let moving = self.keys[last];
                let bucket = self
                    .table
                    .bucket_of(self.hash(moving), last as u32)
                    .unwrap();
                self.table.set_pos(bucket, pos);
                self.reference.insert(moving, pos);
            }
            self.keys.swap_remove(pos as usize);
        }

        fn check(&self) {
            assert_eq!(self.table.len(), self.reference.len());
            for (&key, &pos) in &self.reference {
                assert_eq!(self.find(key), Some(pos), "key {key}");
            }
            let spread = self.spread;
            self.table
                .assert_consistent(|p| hash_for(spread, self.keys[p as usize]));
        }
    }

    proptest! {
        /// The table finds exactly what a `HashMap` reference holds, through inserts,
        /// growth, swap-removes and absent lookups, with well-spread hashes, heavy
        /// collisions and one hash for every key (every distance saturates).
        #[test]
        fn positions_agree_with_a_hashmap(
            spread in 0u8..3,
            ops in proptest::collection::vec((any::<bool>(), 0u64..300), 1..600),
        ) {
            let mut model = Model::new(spread);
            for (insert, key) in ops {
                if insert {
                    model.insert(key);
                } else {
                    model.remove(key);
                }
                prop_assert_eq!(model.find(key), model.reference.get(&key).copied());
                prop_assert_eq!(model.find(key + 1_000), None);
            }
            model.check();
        }
    }

    #[test]
    fn a_table_grows_by_a_quarter_and_stays_at_least_64_percent_full_once_grown() {
        let mut model = Model::new(0);
        for key in 0..200_000 {
            model.insert(key);
            let n = model.table.buckets.len();
            assert!(model.table.len() * LOAD_DEN <= n * LOAD_NUM);
            if n > 1_000 {
                assert!(
                    model.table.len() * 100 >= n * 63,
                    "{} in {n}",
                    model.table.len()
                );
            }
        }
        model.check();
        for key in (0..200_000).step_by(3) {
            model.remove(key);
        }
        model.check();
    }

    #[test]
    fn layouts_keep_positions_distinct_from_empty_up_to_the_largest_table() {
        for n in [16usize, 1_000, 1 << 20, (1 << 26) - 1, 1 << 26, MAX_BUCKETS] {
            let layout = Layout::for_buckets(n);
            assert_eq!(layout.pos_bits + layout.dist_bits + layout.tag_bits(), 32);
            let pos = (n - 1) as u32;
            for dist in [0, 1, layout.dist_max, 1_000] {
                let tag = layout.tag_of_hash(u64::MAX);
                let entry = layout.pack(tag, dist, pos);
                assert_ne!(entry, EMPTY, "n {n}");
                assert_eq!(layout.pos(entry), pos);
                assert_eq!(layout.dist(entry), dist.min(layout.dist_max));
                assert_eq!(layout.tag(entry), tag);
            }
        }
        assert_eq!(Layout::for_buckets(1 << 20).tag_bits(), 5);
        assert_eq!(Layout::for_buckets(600_000).tag_bits(), 6);
    }
}
