//! A restarted node's restore: until it has asked the members it sees for their
//! replicas of its keys, it does not answer as owner ([`Restore`], the gate;
//! [`Restoring`], the steps; [`restore_from_peers`], their async shell).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::watch;

use super::Replicator;
use crate::algorithms::Millis;
use crate::membership::{ClusterView, Member};

/// Whether this node has restored its keys' replicas since it started: until then it
/// does not answer as owner (client checks wait; forwarded ones are refused, so their
/// entry nodes fail over to the keys' successors, which hold the replicas).
#[derive(Debug)]
pub struct Restore {
    done: watch::Sender<bool>,
}

impl Restore {
    /// Restored already (`done`), or to be restored.
    pub fn new(done: bool) -> Self {
        Self {
            done: watch::Sender::new(done),
        }
    }

    /// Whether the restore is over (done, or its deadline passed).
    pub fn is_done(&self) -> bool {
        *self.done.borrow()
    }

    /// The restore is over: answer as owner.
    pub fn finish(&self) {
        self.done.send_replace(true);
    }

    /// Wait until the restore is over.
    pub async fn wait(&self) {
        let mut rx = self.done.subscribe();
        let _ = rx.wait_for(|done| *done).await;
    }
}

/// How long the membership must stay unchanged before a restore counts as complete:
/// a restarted node first sees its seed, then the others within a gossip round or two.
pub const RESTORE_SETTLE: Duration = Duration::from_millis(500);

/// Where a restore stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for a view with another member.
    Waiting,
    /// Asked members; their answers are due.
    Asking,
    /// Every member asked answered and one knew an earlier incarnation of this node:
    /// waiting for the membership to stay still until `until` (or change: ask the
    /// new members).
    Settling { until: Millis },
    /// Over.
    Done,
}

/// A restarted node's restore as a state machine with no I/O inside: the views it
/// sees, the members' answers and its timer go in; whom to ask, when to wake and when
/// it is over come out ([`Step`]). The node's [`restore_from_peers`] and the
/// simulator drive the same machine.
///
/// It waits for a view with another member and asks each member it sees for its
/// replicas of this node's keys (each pushes them here, merged into whatever this node
/// decided since). If none of them knew an earlier incarnation of this node, it is a
/// new member and owns nothing yet: done. Otherwise it restarted before the cluster
/// noticed: it asks each member that appears later too, and is done once the
/// membership has been still for [`RESTORE_SETTLE`]. At the deadline it is done
/// whatever happened.
///
/// A member back after the cluster dropped it (or a new one) is not an earlier
/// incarnation to anyone: a member whose view does not hold it yet hands it its keys
/// there and then, before answering ([`super::RestoreAnswer::Joiner`]; so does one
/// whose view holds only its earlier incarnation, leaving:
/// [`super::RestoreAnswer::Rejoiner`]), and one whose view holds it has handed them
/// over on the ring change already; so it does not answer as owner from empty (or
/// from an older snapshot) while a key's count is on its way.
#[derive(Debug)]
pub struct Restoring {
    phase: Phase,
    asked: BTreeSet<String>,
    waiting: BTreeSet<String>,
    restarted: bool,
    /// Every member asked has answered so far.
    answered_all: bool,
    deadline: Millis,
}

/// What a [`Restoring`] asks of its driver next.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Ask each of `members` for its replicas, as `me` (feed each answer to
    /// [`Restoring::answered`]), then as for [`Step::Wait`].
    Ask {
        /// This node, as the requests name it.
        me: Member,
        /// The members to ask.
        members: Vec<Member>,
        /// When to call [`Restoring::timer`] if nothing else happens.
        wake: Millis,
    },
    /// Wait for an answer, a new view ([`Restoring::view`]) or `wake`
    /// ([`Restoring::timer`]).
    Wait {
        /// When to call [`Restoring::timer`] if nothing else happens.
        wake: Millis,
    },
    /// The restore is over ([`Restore::finish`]).
    Done {
        /// Every member asked answered before the deadline.
        complete: bool,
    },
}

impl Restoring {
    /// A restore that is over at `deadline` (on the driver's monotonic clock) at the
    /// latest.
    pub fn new(deadline: Millis) -> Self {
        Self {
            phase: Phase::Waiting,
            asked: BTreeSet::new(),
            waiting: BTreeSet::new(),
            restarted: false,
            answered_all: true,
            deadline,
        }
    }

    /// Whether it is over.
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// The view `view` of this node `me`: the first one, and every change.
    pub fn view(&mut self, me: &str, view: &ClusterView, now: Millis) -> Step {
        if let Some(step) = self.over(now) {
            return step;
        }
        if self.phase == Phase::Asking || view.members.len() <= 1 {
            return self.wait();
        }
        let Some(me) = view.member(me).cloned() else {
            return self.wait();
        };
        let members: Vec<Member> = view
            .members
            .iter()
            .filter(|m| m.node_id != me.node_id && !self.asked.contains(&m.node_id))
            .cloned()
            .collect();
        if members.is_empty() {
            // Only after a change of view while settling: wait again.
            return self.settle(now);
        }
        for m in &members {
            self.asked.insert(m.node_id.clone());
            self.waiting.insert(m.node_id.clone());
        }
        self.phase = Phase::Asking;
        Step::Ask {
            me,
            members,
            wake: self.deadline,
        }
    }

    /// `from`'s answer: whether it knew an earlier incarnation of this node, or `None`
    /// when it did not answer.
    pub fn answered(&mut self, from: &str, earlier: Option<bool>, now: Millis) -> Step {
        if let Some(step) = self.over(now) {
            return step;
        }
        match earlier {
            Some(earlier) => self.restarted |= earlier,
            None => self.answered_all = false,
        }
        if self.phase != Phase::Asking || !self.waiting.remove(from) || !self.waiting.is_empty() {
            return self.wait();
        }
        if !self.restarted {
            return self.finish(true);
        }
        self.settle(now)
    }

    /// The timer a [`Step`] asked for.
    pub fn timer(&mut self, now: Millis) -> Step {
        if let Some(step) = self.over(now) {
            return step;
        }
        match self.phase {
            Phase::Settling { until } if now >= until => self.finish(true),
            _ => self.wait(),
        }
    }

    /// Done already, or the deadline passed.
    fn over(&mut self, now: Millis) -> Option<Step> {
        match self.phase {
            Phase::Done => Some(Step::Done { complete: false }),
            _ if now >= self.deadline => Some(self.finish(false)),
            _ => None,
        }
    }

    fn settle(&mut self, now: Millis) -> Step {
        let until = now + RESTORE_SETTLE.as_millis() as Millis;
        self.phase = Phase::Settling { until };
        self.wait()
    }

    fn wait(&self) -> Step {
        let wake = match self.phase {
            Phase::Settling { until } => until.min(self.deadline),
            _ => self.deadline,
        };
        Step::Wait { wake }
    }

    fn finish(&mut self, in_time: bool) -> Step {
        self.phase = Phase::Done;
        Step::Done {
            complete: in_time && self.answered_all && !self.asked.is_empty(),
        }
    }
}

/// Restore this node's keys from the members it sees (the shell of [`Restoring`]):
/// asks in parallel, each call bounded by `deadline`, the whole restore too. When it
/// is over, this node answers as owner ([`Restore::finish`]). Returns whether every
/// member asked answered.
pub async fn restore_from_peers(
    replicator: &Replicator,
    mut views: watch::Receiver<Arc<ClusterView>>,
    restore: &Restore,
    deadline: Duration,
) -> bool {
    let start = tokio::time::Instant::now();
    let now = || start.elapsed().as_millis() as Millis;
    let mut machine = Restoring::new(deadline.as_millis() as Millis);
    let mut asks = FuturesUnordered::new();
    let (mut sent, mut installed) = (0, 0);
    let first = views.borrow_and_update().clone();
    let mut step = machine.view(&replicator.me, &first, now());
    let complete = loop {
        let wake = match step {
            Step::Done { complete } => break complete,
            Step::Wait { wake } => wake,
            Step::Ask { me, members, wake } => {
                for member in members {
                    let me = me.clone();
                    asks.push(async move {
                        let answer = replicator.peers.restore(&member, &me, deadline).await;
                        (member.node_id, answer)
                    });
                }
                wake
            }
        };
        let at = start + Duration::from_millis(wake);
        step = tokio::select! {
            Some((from, answer)) = asks.next(), if !asks.is_empty() => {
                let earlier = match answer {
                    Ok((s, i, earlier)) => {
                        sent += s;
                        installed += i;
                        Some(earlier)
                    }
                    Err(error) => {
                        tracing::warn!(peer = %from, %error, "restore: a member did not answer");
                        None
                    }
                };
                machine.answered(&from, earlier, now())
            }
            changed = views.changed() => match changed {
                Ok(()) => {
                    let view = views.borrow_and_update().clone();
                    machine.view(&replicator.me, &view, now())
                }
                // The node is stopping.
                Err(_) => break false,
            },
            _ = tokio::time::sleep_until(at) => machine.timer(now()),
        };
    };
    tracing::info!(
        asked = machine.asked.len(),
        restarted = machine.restarted,
        sent,
        installed,
        complete,
        "restored replicas of this node's keys; answering as owner"
    );
    let result = if complete { "done" } else { "incomplete" };
    metrics::counter!("ringlimit_restores_total", "result" => result).increment(1);
    if now() >= machine.deadline {
        tracing::warn!(
            deadline_ms = deadline.as_millis() as u64,
            "restore deadline passed: answering as owner with what was restored"
        );
    }
    restore.finish();
    complete
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::cluster::policy::testkit::view;

    const SETTLE: Millis = RESTORE_SETTLE.as_millis() as Millis;

    fn asked(step: Step) -> Vec<String> {
        match step {
            Step::Ask { members, .. } => members.into_iter().map(|m| m.node_id).collect(),
            other => panic!("expected an ask, got {other:?}"),
        }
    }

    #[test]
    fn a_new_member_is_done_once_everyone_it_sees_answered() {
        let mut r = Restoring::new(10_000);
        assert_eq!(r.view("a", &view(&["a"]), 0), Step::Wait { wake: 10_000 });
        assert_eq!(asked(r.view("a", &view(&["a", "b", "c"]), 5)), ["b", "c"]);
        assert_eq!(r.answered("b", Some(false), 6), Step::Wait { wake: 10_000 });
        assert_eq!(
            r.answered("c", Some(false), 7),
            Step::Done { complete: true }
        );
        assert!(r.is_done());
    }

    #[test]
    fn a_restarted_member_settles_and_asks_those_who_appear_meanwhile() {
        let mut r = Restoring::new(10_000);
        assert_eq!(asked(r.view("a", &view(&["a", "b"]), 0)), ["b"]);
        assert_eq!(
            r.answered("b", Some(true), 10),
            Step::Wait { wake: 10 + SETTLE }
        );
        assert_eq!(asked(r.view("a", &view(&["a", "b", "c"]), 20)), ["c"]);
        assert_eq!(
            r.timer(10 + SETTLE),
            Step::Wait { wake: 10_000 },
            "c is due"
        );
        assert_eq!(
            r.answered("c", Some(false), 30),
            Step::Wait { wake: 30 + SETTLE }
        );
        // A change with nobody new: the settle starts again.
        assert_eq!(
            r.view("a", &view(&["a", "b", "c"]), 40),
            Step::Wait { wake: 40 + SETTLE }
        );
        assert_eq!(r.timer(40 + SETTLE - 1), Step::Wait { wake: 40 + SETTLE });
        assert_eq!(r.timer(40 + SETTLE), Step::Done { complete: true });
    }

    #[test]
    fn the_deadline_ends_a_restore_incomplete_and_a_silent_member_makes_it_so() {
        let mut r = Restoring::new(1_000);
        asked(r.view("a", &view(&["a", "b"]), 0));
        assert_eq!(r.timer(1_000), Step::Done { complete: false });
        assert_eq!(
            r.answered("b", Some(true), 1_001),
            Step::Done { complete: false }
        );

        let mut r = Restoring::new(1_000);
        asked(r.view("a", &view(&["a", "b", "c"]), 0));
        r.answered("b", None, 1);
        assert_eq!(
            r.answered("c", Some(false), 2),
            Step::Done { complete: false }
        );

        let mut alone = Restoring::new(1_000);
        alone.view("a", &view(&["a"]), 0);
        assert_eq!(
            alone.timer(1_000),
            Step::Done { complete: false },
            "nobody asked"
        );
    }
}
