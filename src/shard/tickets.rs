//! The names an owner gives what it holds open for a caller: a reservation (`Reserve`,
//! settled by `Commit`) and a concurrency lease (`Acquire`, ended by `Release`). Both
//! tables ([`super::reservations`], [`super::concurrency`]) number their entries per
//! shard and tag each with a keyed hash of what it holds, so an id cannot be guessed and
//! one no longer open is told apart from one never made.

use crate::algorithms::Millis;

use super::KeyId;

/// One reservation or concurrency lease within its shard: what an id carries so the
/// owner finds it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket {
    /// Per-shard serial, never reused while the node runs.
    pub serial: u64,
    /// Keyed hash of the serial and of what the reservation charged.
    pub tag: u64,
}

/// What a reservation charged (or a lease holds), as its id states it: the part of an
/// id the tag covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// The counter charged.
    pub counter: KeyId,
    /// Fingerprint of the numbers of the rule it was charged under.
    pub fingerprint: u64,
    /// Units reserved.
    pub amount: u64,
    /// When an uncommitted reservation is committed at its amount (owner's Unix ms).
    pub expires_at: Millis,
}

/// Why a reservation was not opened (or a lease not granted): the shard's table is at
/// its cap; nothing was charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the key's owner holds {0} open reservations (or leases) on this key's shard, the most it \
     keeps; commit or release some, or let their TTLs end (nothing was charged)"
)]
pub struct Full(pub usize);
