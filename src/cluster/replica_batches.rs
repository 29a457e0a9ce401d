//! Which replication batches a successor holds: only one later than every batch it
//! already held from the same sender (see [`ReplicaBatches`]).

use std::collections::HashMap;

/// The latest replication batch a successor held from each sender, as (incarnation,
/// batch number): a batch is held only if it is later than that. A node cut off by a
/// partition can time out its batches to a successor and send the next ones on a fresh
/// connection; after the heal the old connection may deliver the earlier batches,
/// seconds old, which would replace the replicas of a key at its limit with a state of
/// the window before, and a fail-over after the owner's death would admit again from
/// that. A batch refused so loses nothing: the sender marks the keys of a batch that
/// timed out as changed again, and later batches carry their newer states.
#[derive(Debug, Default)]
pub struct ReplicaBatches {
    last: std::sync::Mutex<HashMap<String, (u64, u64)>>,
}

impl ReplicaBatches {
    /// Whether batch `(generation, number)` from `from` is to be held: later than every
    /// batch held from it (remembered if so), or not numbered (`number` 0).
    pub fn admit(&self, from: &str, generation: u64, number: u64) -> bool {
        if number == 0 {
            return true;
        }
        let mut last = self.last.lock().expect("replica batches lock");
        match last.get_mut(from) {
            Some(held) if *held >= (generation, number) => false,
            Some(held) => {
                *held = (generation, number);
                true
            }
            None => {
                last.insert(from.to_string(), (generation, number));
                true
            }
        }
    }

    /// Forget the senders `keep` rejects (members gone for good).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.last
            .lock()
            .expect("replica batches lock")
            .retain(|id, _| keep(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replication_batch_older_than_one_held_is_refused() {
        let batches = ReplicaBatches::default();
        assert!(batches.admit("a", 5, 1));
        assert!(batches.admit("a", 5, 3), "a later batch");
        assert!(!batches.admit("a", 5, 2), "delivered after 3: refused");
        assert!(!batches.admit("a", 5, 3), "the same batch again");
        assert!(batches.admit("b", 1, 1), "each sender has its own numbers");
        assert!(batches.admit("a", 6, 1), "a restarted sender counts from 1");
        assert!(
            !batches.admit("a", 5, 9),
            "its earlier incarnation's late batch"
        );
        assert!(batches.admit("a", 5, 0), "an unnumbered batch is held");
        batches.retain(|id| id != "a");
        assert!(batches.admit("a", 5, 2), "a forgotten sender starts over");
    }
}
