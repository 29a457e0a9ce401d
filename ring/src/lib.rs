//! Consistent-hash ring over the live cluster members.
//!
//! Every node builds a [`Ring`] from the current member ids and asks it which
//! member owns a client key ([`Ring::owner`]); a node that is not the owner
//! forwards the rate-limit check to the owner. Because every node must reach
//! the *same* answer, and must keep reaching it across restarts and upgrades,
//! all placement uses an explicitly stable hash:
//!
//! * **Hash:** XXH3-64 with seed [`HASH_SEED`] (`0`, the XXH3 default secret),
//!   through [`XxhBuildHasher`] — never `std`'s `DefaultHasher`/`RandomState`,
//!   whose output may differ between processes and Rust releases.
//!   * A key is placed at [`Ring::key_hash`]`(key)` =
//!     `xxh3_64(len(key) as u64 little-endian ‖ key)` — that is what
//!     `<&[u8] as Hash>::hash` feeds to our hasher (its length prefix is
//!     written through `write_usize`, which [`XxhHasher`] encodes as 8 LE bytes).
//!   * Virtual node `i` of member `id` sits at `xxh3_64(b"{id}#{i}")`.
//! * **Ring:** the [`hashring`] crate's `HashRing<VNode, XxhBuildHasher>`.
//!   A key belongs to the first vnode whose position is `>=` the key hash,
//!   wrapping to the lowest vnode; each vnode thus owns the half-open range
//!   `(previous position, its position]`. The ring places by member **id**
//!   only, so a restarted node (new generation, same id) keeps its ranges.
//! * **Virtual nodes:** `hashring` 0.3 has none built in, so each member gets
//!   [`Ring::DEFAULT_VNODES`] (128, configurable) entries `id#0 … id#127`.
//!   Measured over 100,000 keys (`cust_0` … `cust_99999`), the busiest member
//!   holds 1.133× the mean load with 3 members (`node-a..c`) and 1.059× with 5
//!   (`node-a..e`), within the 1.15× budget (the `balance_*` tests check
//!   this). With 128 vnodes a member's share has a relative standard
//!   deviation of about 1/√128 ≈ 9 %, so other id sets may land somewhat
//!   worse; raise the vnode count if tighter balance is needed (lookup cost
//!   grows only logarithmically). A join from 3 to 4 members moved 25.3 % of
//!   keys, all to the joiner; the reverse leave moved the same keys back.
//! * **Diff:** [`diff`] compares two rings (before/after a membership change)
//!   purely, without touching any key, and returns the hash ranges that
//!   changed owner ([`RingDiff`]). It serves state handoff: the old owner
//!   pushes each key for which [`RingDiff::moved`] returns `Some((me, to))`.
//!   On a join only ranges *to* the joiner move; on a leave only ranges *from*
//!   the leaver move — roughly `1/N` of the space either way.
//!
//! `hashring::HashRing::get_with_replicas` clones the whole ring on every
//! call and is never used here.

mod diff;
mod hash;
#[cfg(test)]
mod tests;

use std::fmt;
use std::hash::BuildHasher;
use std::sync::Arc;

use hashring::HashRing;

pub use diff::{diff, RangeMove, RingDiff};
pub use hash::{XxhBuildHasher, XxhHasher, HASH_SEED};

use hash::VNode;

/// Bumped whenever the placement algorithm changes, so that [`Ring::digest`]
/// of rings built by incompatible code never compares equal.
const PLACEMENT_VERSION: &[u8] = b"ringlimit.ring.v1\0";

/// The placement algorithm's number, published to clients (the `Topology` call): a
/// client that places keys itself must know this version, else it sends anywhere.
pub const PLACEMENT: u32 = 1;

/// Consistent-hash ring over a set of cluster members, identified by stable
/// string ids.
///
/// The ring places by id only, so a restarted node (new generation, same id)
/// keeps its ranges. Two rings built from the same set of ids with the same
/// vnode count are identical, whatever the order or duplication of the input
/// (see [`Ring::digest`]).
#[derive(Clone)]
pub struct Ring {
    /// Member ids, sorted and de-duplicated.
    members: Vec<String>,
    /// Virtual nodes per member (at least 1).
    vnodes: u32,
    /// The ring proper; answers [`Ring::owner`].
    ring: HashRing<VNode, XxhBuildHasher>,
    /// Sorted vnode positions: the same points as in `ring` (which does not
    /// expose them when a custom hasher is used); for diff and shares.
    positions: Vec<u64>,
    /// `owners[i]` is the index into `members` of the vnode at `positions[i]`.
    owners: Vec<u32>,
}

impl Ring {
    /// Default number of virtual nodes per member; see the module docs for the
    /// balance it achieves.
    pub const DEFAULT_VNODES: u32 = 128;

    /// Builds the ring over `members` with `vnodes` virtual nodes per member.
    ///
    /// Duplicate ids are ignored and order is irrelevant: the same set of ids
    /// always yields an identical ring. `vnodes == 0` is treated as 1.
    ///
    /// Should two vnodes ever hash to the same position (probability about
    /// `(members·vnodes)² / 2⁶⁵`), the one of the lexicographically smallest
    /// id wins and the other is dropped, so the result stays deterministic.
    pub fn new<I: IntoIterator<Item = S>, S: Into<String>>(members: I, vnodes: u32) -> Ring {
        let mut members: Vec<String> = members.into_iter().map(Into::into).collect();
        members.sort_unstable();
        members.dedup();
        assert!(
            members.len() <= u32::MAX as usize,
            "too many ring members: {}",
            members.len()
        );
        let vnodes = vnodes.max(1);
        let names: Vec<Arc<str>> = members.iter().map(|m| Arc::from(m.as_str())).collect();

        // (position, member index, replica), sorted by position then member.
        let mut placed: Vec<(u64, u32, u32)> = Vec::with_capacity(members.len() * vnodes as usize);
        for (m, name) in names.iter().enumerate() {
            for replica in 0..vnodes {
                let vnode = VNode {
                    name: Arc::clone(name),
                    replica,
                };
                placed.push((XxhBuildHasher.hash_one(&vnode), m as u32, replica));
            }
        }
        placed.sort_unstable();
        placed.dedup_by_key(|p| p.0);

        let mut ring = HashRing::with_hasher(XxhBuildHasher);
        ring.batch_add(
            placed
                .iter()
                .map(|&(_, m, replica)| VNode {
                    name: Arc::clone(&names[m as usize]),
                    replica,
                })
                .collect(),
        );
        debug_assert_eq!(ring.len(), placed.len());

        Ring {
            members,
            vnodes,
            ring,
            positions: placed.iter().map(|p| p.0).collect(),
            owners: placed.iter().map(|p| p.1).collect(),
        }
    }

    /// The member that owns `key`, or `None` only if the ring is empty.
    ///
    /// This is `hashring`'s lookup of `key` (placed at [`Ring::key_hash`]):
    /// the first vnode at or after the key's hash, wrapping around. It does
    /// not allocate.
    ///
    /// ```
    /// use ringlimit_ring::Ring;
    ///
    /// let ring = Ring::new(["node-a", "node-b", "node-c"], Ring::DEFAULT_VNODES);
    /// let owner = ring.owner(b"cust_42").unwrap();
    /// assert!(ring.contains(owner));
    /// // Every node computes the same owner, whatever order it lists members in.
    /// let same = Ring::new(["node-c", "node-a", "node-b"], Ring::DEFAULT_VNODES);
    /// assert_eq!(same.owner(b"cust_42"), Some(owner));
    ///
    /// let empty = Ring::new(Vec::<String>::new(), Ring::DEFAULT_VNODES);
    /// assert_eq!(empty.owner(b"cust_42"), None);
    /// ```
    #[inline]
    pub fn owner(&self, key: &[u8]) -> Option<&str> {
        self.ring.get(&key).map(|v| &*v.name)
    }

    /// The member ids, sorted and de-duplicated.
    pub fn members(&self) -> &[String] {
        &self.members
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// `true` if the ring has no members (then [`Ring::owner`] is `None`).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// `true` if `node` is a member.
    pub fn contains(&self, node: &str) -> bool {
        self.members
            .binary_search_by(|m| m.as_str().cmp(node))
            .is_ok()
    }

    /// Virtual nodes per member actually used (`vnodes` given to
    /// [`Ring::new`], at least 1).
    pub fn vnodes(&self) -> u32 {
        self.vnodes
    }

    /// Stable hash of (sorted members, vnodes, placement version).
    ///
    /// Two nodes reporting equal digests have identical rings, so nodes can
    /// cheaply check that they agree on membership. Stable across processes
    /// and platforms: XXH3-64 (seed [`HASH_SEED`]) of
    /// `b"ringlimit.ring.v1\0" ‖ vnodes as u64 LE ‖ member count as u64 LE ‖
    /// for each sorted member: (len as u64 LE ‖ UTF-8 bytes)`.
    pub fn digest(&self) -> u64 {
        use std::hash::Hasher;
        let mut h = XxhBuildHasher.build_hasher();
        h.write(PLACEMENT_VERSION);
        h.write_u64(u64::from(self.vnodes));
        h.write_u64(self.members.len() as u64);
        for m in &self.members {
            h.write_u64(m.len() as u64);
            h.write(m.as_bytes());
        }
        h.finish()
    }

    /// Each member's fraction of the 64-bit key-hash space, in member order.
    ///
    /// The fractions sum to 1.0 (up to floating-point rounding); empty for an
    /// empty ring. With uniformly hashed keys this is each member's expected
    /// share of keys.
    pub fn shares(&self) -> Vec<(String, f64)> {
        let mut owned = vec![0u128; self.members.len()];
        let n = self.positions.len();
        for i in 0..n {
            let prev = self.positions[(i + n - 1) % n];
            owned[self.owners[i] as usize] += arc_len(prev, self.positions[i]);
        }
        self.members
            .iter()
            .zip(owned)
            .map(|(m, o)| (m.clone(), o as f64 / SPACE))
            .collect()
    }

    /// The stable hash that places `key` on the ring.
    ///
    /// XXH3-64, seed [`HASH_SEED`] (0), of the bytes
    /// `key.len() as u64 (little-endian) ‖ key` — exactly what `hashring`
    /// hashes for [`Ring::owner`] (`<&[u8] as Hash>` writes a length prefix,
    /// which [`XxhHasher`] encodes as 8 little-endian bytes).
    #[inline]
    pub fn key_hash(key: &[u8]) -> u64 {
        XxhBuildHasher.hash_one(key)
    }

    /// Index into `members` of the owner of key hash `h`; `None` if empty.
    /// Mirrors `hashring`'s lookup on the position table.
    pub(crate) fn owner_index_of_hash(&self, h: u64) -> Option<u32> {
        if self.positions.is_empty() {
            return None;
        }
        let i = self.positions.partition_point(|&p| p < h);
        Some(self.owners[if i == self.positions.len() { 0 } else { i }])
    }

    /// Owner id of key hash `h`; `None` if empty.
    pub fn owner_of_hash(&self, h: u64) -> Option<&str> {
        self.owner_index_of_hash(h)
            .map(|i| self.members[i as usize].as_str())
    }

    /// The successor of key hash `h`: the member that would own it if its owner were
    /// gone (the first vnode clockwise from `h` of a member other than the owner).
    /// Removing a member leaves every other vnode where it was, so this is exactly
    /// the owner on the ring without the owner: where the key's replica lives, and
    /// who inherits the key when its owner dies. `None` with fewer than two members.
    ///
    /// ```
    /// use ringlimit_ring::Ring;
    ///
    /// let ring = Ring::new(["a", "b", "c"], Ring::DEFAULT_VNODES);
    /// let h = Ring::key_hash(b"cust_42");
    /// let owner = ring.owner_of_hash(h).unwrap();
    /// let successor = ring.successor_of_hash(h).unwrap();
    /// assert_ne!(owner, successor);
    /// let without: Vec<&str> = ["a", "b", "c"].into_iter().filter(|m| *m != owner).collect();
    /// assert_eq!(Ring::new(without, Ring::DEFAULT_VNODES).owner_of_hash(h), Some(successor));
    /// ```
    pub fn successor_of_hash(&self, h: u64) -> Option<&str> {
        if self.members.len() < 2 {
            return None;
        }
        let n = self.positions.len();
        let start = self.positions.partition_point(|&p| p < h);
        let owner = self.owners[start % n];
        (1..n)
            .map(|step| self.owners[(start + step) % n])
            .find(|&m| m != owner)
            .map(|m| self.members[m as usize].as_str())
    }

    /// Sorted vnode positions.
    pub(crate) fn positions(&self) -> &[u64] {
        &self.positions
    }
}

impl fmt::Debug for Ring {
    /// Summarises the ring (members, vnodes, digest) rather than dumping
    /// every virtual node.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ring")
            .field("members", &self.members)
            .field("vnodes", &self.vnodes)
            .field("digest", &format_args!("{:#018x}", self.digest()))
            .finish()
    }
}

/// Size of the key-hash space, 2⁶⁴, as `f64`.
const SPACE: f64 = 18_446_744_073_709_551_616.0;

/// Number of hashes in the ring arc `(start, end]`; `start == end` is the
/// whole space.
fn arc_len(start: u64, end: u64) -> u128 {
    if start == end {
        1u128 << 64
    } else {
        u128::from(end.wrapping_sub(start))
    }
}
