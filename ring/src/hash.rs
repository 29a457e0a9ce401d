//! The stable hash used for every placement decision on the ring.
//!
//! Everything here is XXH3-64 with **seed 0** (the XXH3 default secret), as
//! produced by `xxhash_rust::xxh3::xxh3_64`. The streaming hasher below feeds
//! every `Hasher::write*` call into one XXH3 stream, so the result is exactly
//! `xxh3_64(concatenation of all written bytes)`.
//!
//! Unlike the default `Hasher` methods, integer writes are encoded
//! **little-endian at a fixed width** (`usize`/`isize` are widened to 64 bits),
//! so the hash of a value is the same on every platform, process, and Rust
//! version. In particular `<[u8] as Hash>::hash` writes its length prefix via
//! `write_usize`, which becomes 8 little-endian bytes here.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;

use xxhash_rust::xxh3::Xxh3Default;

/// The XXH3 seed used for all ring hashing. `0` selects XXH3's default secret
/// (and lets us use the cheaper `Xxh3Default` streaming state).
///
/// Changing this re-homes every key in the cluster: never change it.
pub const HASH_SEED: u64 = 0;

/// A [`BuildHasher`] producing [`XxhHasher`]s: XXH3-64, seed [`HASH_SEED`].
///
/// It is stateless and deterministic, unlike `std`'s `RandomState`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct XxhBuildHasher;

impl BuildHasher for XxhBuildHasher {
    type Hasher = XxhHasher;

    #[inline]
    fn build_hasher(&self) -> XxhHasher {
        XxhHasher(Xxh3Default::new())
    }
}

/// Streaming XXH3-64 (seed [`HASH_SEED`]) with platform-independent integer
/// encoding (fixed-width little-endian; `usize`/`isize` as 64 bits).
#[derive(Clone)]
pub struct XxhHasher(Xxh3Default);

impl std::fmt::Debug for XxhHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XxhHasher").finish_non_exhaustive()
    }
}

macro_rules! le_writes {
    ($($name:ident: $ty:ty),* $(,)?) => {
        $(
            #[inline]
            fn $name(&mut self, i: $ty) {
                self.0.update(&i.to_le_bytes());
            }
        )*
    };
}

impl Hasher for XxhHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0.digest()
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    le_writes!(
        write_u8: u8, write_u16: u16, write_u32: u32, write_u64: u64, write_u128: u128,
        write_i8: i8, write_i16: i16, write_i32: i32, write_i64: i64, write_i128: i128,
    );

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }

    #[inline]
    fn write_isize(&mut self, i: isize) {
        self.write_i64(i as i64);
    }
}

/// One virtual node: replica `replica` of member `name`.
///
/// Its ring position is `xxh3_64(b"{name}#{replica}")` (seed 0), `replica`
/// in decimal without leading zeros, no length prefix and no terminator.
/// Because the replica suffix never contains `#`, distinct `(name, replica)`
/// pairs always hash distinct strings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct VNode {
    pub(crate) name: Arc<str>,
    pub(crate) replica: u32,
}

impl Hash for VNode {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(self.name.as_bytes());
        state.write(b"#");
        // Decimal digits of `replica`, without allocating.
        let mut buf = [0u8; 10];
        let mut at = buf.len();
        let mut n = self.replica;
        loop {
            at -= 1;
            buf[at] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        state.write(&buf[at..]);
    }
}
