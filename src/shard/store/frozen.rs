//! A copy of a store's keys taken in one shard step, for a snapshot on disk
//! (`node::snapshot`).
//!
//! The copy is the slot vector as it is (one `memcpy`, 36 bytes a key), the side
//! states that do not pack into a slot, and the interned fingerprints: no state is
//! unpacked and nothing is allocated per key while the shard waits. Unpacking
//! ([`Frozen::states`]) happens afterwards, off the shard, so a snapshot of a million
//! keys holds a shard for the time of a copy, not of an encoding.

use std::collections::HashMap;

use super::{Exported, Slot, Store, LOCAL, MOVED, OVERFLOW};
use crate::algorithms::KeyState;
use crate::shard::identity::KeyId;

/// A store's keys as of one instant; see the module docs.
#[derive(Debug, Default)]
pub struct Frozen {
    slots: Vec<Slot>,
    side: HashMap<KeyId, KeyState>,
    fingerprints: Vec<u64>,
}

impl Store {
    /// Copy every key this store decides for (neither handed away nor node-local) as
    /// of now; see [`Frozen`].
    pub fn freeze(&self) -> Frozen {
        let side = self
            .overflow
            .iter()
            .map(|(id, side)| (*id, side.state.clone()))
            .collect();
        Frozen {
            slots: self.slots.clone(),
            side,
            fingerprints: self.fingerprints.iter().map(|(fp, _)| *fp).collect(),
        }
    }
}

impl Frozen {
    /// Slots copied (handed-away and node-local ones included: [`Frozen::states`]
    /// skips them).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when nothing was copied.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Bytes the copy holds (what a snapshot costs in memory while it is written).
    pub fn bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>()
            + self
                .side
                .values()
                .map(|s| std::mem::size_of::<(KeyId, KeyState)>() + s.heap_bytes())
                .sum::<usize>()
    }

    /// Every copied key this node decides for, as it would travel to another node.
    pub fn states(&self) -> impl Iterator<Item = Exported> + '_ {
        self.slots
            .iter()
            .filter(|slot| !slot.has(MOVED) && !slot.has(LOCAL))
            .filter_map(|slot| {
                let id = slot.id();
                let state = if slot.has(OVERFLOW) {
                    self.side.get(&id)?.clone()
                } else {
                    KeyState::from_pair(slot.kind(), slot.words())?
                };
                Some(Exported {
                    id,
                    fingerprint: *self.fingerprints.get(slot.fingerprint_slot() as usize)?,
                    state,
                })
            })
    }
}
