//! A restarted node's restore: until it has asked the members it sees for their
//! replicas of its keys, it does not answer as owner ([`Restore`],
//! [`restore_from_peers`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::Replicator;
use crate::membership::ClusterView;

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

    /// The restore is over.
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

/// Restore this node's keys from the members it sees: wait (until `deadline`) for a
/// view with another member, ask each member for its replicas of this node's keys (it
/// pushes them here, merged into whatever this node decided since). If none of them
/// knew an earlier incarnation of this node, it is a new member and owns nothing yet:
/// done. Otherwise it restarted before the cluster noticed: ask each member that
/// appears later too, and finish once the membership has been still for
/// [`RESTORE_SETTLE`]. `restore` finishes at the deadline whatever happened. Returns
/// whether every member seen answered.
///
/// A member back after the cluster dropped it (or a new one) is not an earlier
/// incarnation to anyone: a member whose view does not hold it yet hands it its keys
/// there and then, before answering ([`Replicator::hand_over_to_joiner`]), and one
/// whose view holds it has handed them over on the ring change already; so it does
/// not answer as owner from empty while a key's count is on its way.
pub async fn restore_from_peers(
    replicator: &Replicator,
    mut views: watch::Receiver<Arc<ClusterView>>,
    restore: &Restore,
    deadline: Duration,
) -> bool {
    let mut asked: Vec<String> = Vec::new();
    let mut complete = true;
    let (mut sent, mut installed, mut restarted) = (0, 0, false);
    let outcome = tokio::time::timeout(deadline, async {
        loop {
            let view = match views.wait_for(|v| v.members.len() > 1).await {
                Ok(view) => view.clone(),
                Err(_) => return,
            };
            let Some(me) = view.member(&replicator.me).cloned() else {
                return;
            };
            for member in &view.members {
                if member.node_id == me.node_id || asked.contains(&member.node_id) {
                    continue;
                }
                asked.push(member.node_id.clone());
                match replicator.peers.restore(member, &me, deadline).await {
                    Ok((s, i, earlier)) => {
                        sent += s;
                        installed += i;
                        restarted |= earlier;
                    }
                    Err(error) => {
                        complete = false;
                        tracing::warn!(peer = %member.node_id, %error, "restore: a member did not answer");
                    }
                }
            }
            if !restarted {
                return;
            }
            views.borrow_and_update();
            if tokio::time::timeout(RESTORE_SETTLE, views.changed()).await.is_err() {
                return;
            }
        }
    })
    .await;
    let timed_out = outcome.is_err();
    let complete = complete && !timed_out && !asked.is_empty();
    tracing::info!(
        asked = asked.len(),
        restarted,
        sent,
        installed,
        complete,
        "restored replicas of this node's keys; answering as owner"
    );
    let result = if complete { "done" } else { "incomplete" };
    metrics::counter!("ringlimit_restores_total", "result" => result).increment(1);
    if timed_out {
        tracing::warn!(
            deadline_ms = deadline.as_millis() as u64,
            "restore deadline passed: answering as owner with what was restored"
        );
    }
    restore.finish();
    complete
}
