//! The replicator's outbox: which replicas go to their successors now, and which wait.
//!
//! One batch per successor is in flight at a time, and a successor's batch never waits
//! for another's. A successor that is paused or dead costs its own keys a timeout
//! (the peer link's 250 ms) per batch, and nothing else: the others keep getting their
//! replicas every interval. A round that waited for every successor would let one
//! stalled successor (or a fail-over push to an unreachable owner, which waits up to
//! the install deadline of 5 s) hold back every replica of the node, and an owner
//! killed then would lose far more than one interval.
//!
//! While a successor's batch is in flight, the keys changed for it wait here, newest
//! state per key (each is the key's whole state: a newer one replaces an older), with
//! the time the key first changed, so the replication lag is measured from there.
//! One batch per successor also keeps its replicas in order: an older state never
//! lands after a newer one. Pure bookkeeping, no I/O: the replicator does the sending.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::algorithms::Millis;
use crate::shard::{Exported, KeyId};

/// One successor's batch: each key's state, with when the key first changed.
pub type Batch = Vec<(Exported, Millis)>;

/// States for successors, waiting or in flight (see the module docs).
#[derive(Debug, Default)]
pub struct Outbox {
    waiting: HashMap<Arc<str>, HashMap<KeyId, (Exported, Millis)>>,
    busy: HashSet<Arc<str>>,
}

impl Outbox {
    /// Queue `state` for `successor`; `since`: when the key first changed after its
    /// last replication. A state already waiting for the key is replaced (the newer
    /// one holds everything it held), keeping the earlier `since`.
    pub fn add(&mut self, successor: &str, state: Exported, since: Millis) {
        let queue = match self.waiting.get_mut(successor) {
            Some(queue) => queue,
            None => self.waiting.entry(Arc::from(successor)).or_default(),
        };
        let since = queue.get(&state.id).map_or(since, |(_, s)| since.min(*s));
        queue.insert(state.id, (state, since));
    }

    /// The waiting states of every successor without a batch in flight, taken out, in
    /// successor and key order; those successors count as busy until [`Outbox::done`].
    pub fn ready(&mut self) -> Vec<(Arc<str>, Batch)> {
        let free: Vec<Arc<str>> = self
            .waiting
            .iter()
            .filter(|(successor, queue)| !queue.is_empty() && !self.busy.contains(*successor))
            .map(|(successor, _)| successor.clone())
            .collect();
        let mut ready: Vec<(Arc<str>, Batch)> = free
            .into_iter()
            .filter_map(|successor| {
                let queue = self.waiting.remove(&successor)?;
                self.busy.insert(successor.clone());
                let mut batch: Batch = queue.into_values().collect();
                batch.sort_unstable_by_key(|(state, _)| (state.id.placement, state.id.disc));
                Some((successor, batch))
            })
            .collect();
        // One order whatever the maps iterated in: a run replays (the simulator).
        ready.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        ready
    }

    /// `successor`'s batch is over (delivered or not).
    pub fn done(&mut self, successor: &str) {
        self.busy.remove(successor);
    }

    /// Every waiting state taken out, as the placements of their keys with when each
    /// first changed: the view changed, and their successors may have with it (the
    /// replicator marks them changed again, so they go where the new view says).
    pub fn take_waiting(&mut self) -> Vec<(u64, Millis)> {
        self.waiting
            .drain()
            .flat_map(|(_, queue)| {
                queue
                    .into_iter()
                    .map(|(id, (_, since))| (id.placement, since))
            })
            .collect()
    }

    /// States waiting (not in flight).
    pub fn waiting(&self) -> usize {
        self.waiting.values().map(HashMap::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU64;
    use std::time::Duration;

    use crate::algorithms::{FixedWindow, KeyState, Limiter};

    /// A fixed-window state with `count` admitted.
    fn counted(count: u64) -> KeyState {
        let limiter = Limiter::FixedWindow(
            FixedWindow::new(NonZeroU64::new(10).unwrap(), Duration::from_secs(1)).unwrap(),
        );
        let mut state = limiter.new_state();
        for _ in 0..count {
            limiter.check(&mut state, 1_000, NonZeroU64::MIN);
        }
        state
    }

    fn state(placement: u64, count: u64) -> Exported {
        Exported {
            id: KeyId {
                placement,
                disc: placement,
            },
            fingerprint: 1,
            state: counted(count),
        }
    }

    fn count(e: &Exported) -> u64 {
        (0..=10).find(|&n| counted(n) == e.state).unwrap()
    }

    #[test]
    fn a_busy_successor_waits_without_holding_back_another() {
        let mut outbox = Outbox::default();
        outbox.add("s1", state(1, 1), 100);
        outbox.add("s2", state(2, 1), 100);
        let mut first = outbox.ready();
        first.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(first.len(), 2);
        // s1's batch is still in flight (a paused successor); s2's came back.
        outbox.done("s2");
        outbox.add("s1", state(1, 2), 150);
        outbox.add("s2", state(2, 2), 150);
        let second = outbox.ready();
        assert_eq!(second.len(), 1, "only s2 is free");
        assert_eq!(&*second[0].0, "s2");
        assert_eq!(outbox.waiting(), 1, "s1's key waits for its batch");
        outbox.done("s1");
        let third = outbox.ready();
        assert_eq!(&*third[0].0, "s1");
        assert_eq!(count(&third[0].1[0].0), 2);
    }

    #[test]
    fn a_waiting_key_keeps_its_newest_state_and_its_first_change() {
        let mut outbox = Outbox::default();
        outbox.add("s1", state(1, 1), 100);
        let _in_flight = outbox.ready();
        outbox.add("s1", state(1, 3), 120);
        outbox.add("s1", state(1, 5), 170);
        outbox.done("s1");
        let batch = outbox.ready();
        assert_eq!(batch[0].1.len(), 1, "one state per key");
        let (newest, since) = &batch[0].1[0];
        assert_eq!((count(newest), *since), (5, 120));
    }

    #[test]
    fn a_view_change_takes_every_waiting_key_back_for_rerouting() {
        let mut outbox = Outbox::default();
        outbox.add("s1", state(1, 1), 100);
        let _in_flight = outbox.ready();
        outbox.add("s1", state(1, 2), 120);
        outbox.add("s1", state(3, 1), 120);
        let mut placements = outbox.take_waiting();
        placements.sort_unstable();
        assert_eq!(placements, vec![(1, 120), (3, 120)]);
        assert_eq!(outbox.waiting(), 0);
        outbox.done("s1");
        assert!(outbox.ready().is_empty());
    }
}
