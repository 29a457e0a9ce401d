//! The store's slot: one key's identity, packed state and metadata in 36 bytes, and the
//! metadata's bit layout (see the store's module doc, *Memory layout*).

use crate::algorithms::AlgorithmKind;
use crate::shard::identity::KeyId;

/// Metadata bits of a [`Slot`]: the interned fingerprint in the low bits, then the
/// algorithm and flags.
pub(super) const FP_BITS: u32 = 20;
pub(super) const FP_MASK: u32 = (1 << FP_BITS) - 1;
pub(super) const KIND_SHIFT: u32 = FP_BITS;
pub(super) const KIND_MASK: u32 = 0b111;
/// The state lives in `Store::overflow`, not in `words`.
pub(super) const OVERFLOW: u32 = 1 << 23;
/// The key was handed to a new owner; its record is in `Store::moved`.
pub(super) const MOVED: u32 = 1 << 24;
/// A node-local (fallback) counter: never exported.
pub(super) const LOCAL: u32 = 1 << 25;
/// The last decision left the key exhausted: a check of cost 1 would be denied. Slots
/// with it set are kept at the front of `Store::slots` (see *Least-harm eviction*).
pub(super) const DENIED: u32 = 1 << 26;
/// What losing the key would cost, as of its last decision: the bit length of the units
/// it had consumed (`limit - remaining`), saturated at 31. Eviction prefers low values.
pub(super) const HARM_SHIFT: u32 = 27;
pub(super) const HARM_MASK: u32 = 0b1_1111;

/// One key: identity, packed state and what the store needs to manage it. 36 bytes.
///
/// The 64-bit fields are kept as `u32` halves so the slot's alignment is 4 and nine
/// words pack without padding (with `u64` fields it would round up to 40). When the
/// state expires is not stored: it follows from the state and the rule's numbers,
/// which the interned fingerprint names (see
/// [`Store::expires_at`](super::Store::expires_at)).
#[derive(Debug, Clone, Copy)]
pub(super) struct Slot {
    /// [`KeyId::placement`] then [`KeyId::disc`], low half first.
    pub(super) id: [u32; 4],
    /// The state packed by
    /// [`KeyState::to_pair`](crate::algorithms::KeyState::to_pair) (unused when
    /// `OVERFLOW` is set).
    pub(super) words: [u32; 4],
    /// Interned fingerprint, algorithm, flags (see the constants above).
    pub(super) meta: u32,
}

const _: () = assert!(std::mem::size_of::<Slot>() == 36);

/// Two `u64`s as four `u32` halves, low half first.
pub(super) fn split(pair: [u64; 2]) -> [u32; 4] {
    [
        pair[0] as u32,
        (pair[0] >> 32) as u32,
        pair[1] as u32,
        (pair[1] >> 32) as u32,
    ]
}

/// The inverse of [`split`].
pub(super) fn join(halves: [u32; 4]) -> [u64; 2] {
    [
        u64::from(halves[0]) | (u64::from(halves[1]) << 32),
        u64::from(halves[2]) | (u64::from(halves[3]) << 32),
    ]
}

impl Slot {
    pub(super) fn new(id: KeyId, meta: u32) -> Self {
        Self {
            id: split([id.placement, id.disc]),
            words: [0; 4],
            meta,
        }
    }

    pub(super) fn id(&self) -> KeyId {
        let [placement, disc] = join(self.id);
        KeyId { placement, disc }
    }

    pub(super) fn words(&self) -> [u64; 2] {
        join(self.words)
    }

    pub(super) fn fingerprint_slot(&self) -> u32 {
        self.meta & FP_MASK
    }

    pub(super) fn kind(&self) -> AlgorithmKind {
        AlgorithmKind::ALL[((self.meta >> KIND_SHIFT) & KIND_MASK) as usize]
    }

    pub(super) fn has(&self, flag: u32) -> bool {
        self.meta & flag != 0
    }

    pub(super) fn set(&mut self, flag: u32, on: bool) {
        if on {
            self.meta |= flag;
        } else {
            self.meta &= !flag;
        }
    }

    pub(super) fn harm(&self) -> u32 {
        (self.meta >> HARM_SHIFT) & HARM_MASK
    }
}
