//! Shard actors: where decisions are made, one key at a time, without locks.
//!
//! A node runs N shard tasks (default: one per core). Each owns a [`Store`] by value
//! and is fed by a bounded channel; a client key always hashes to the same shard, so
//! every check of one key is decided sequentially by one task. That sequential order
//! is what makes a decision atomic (the role the Lua script plays in the design
//! reference), and it is why no counter state is ever behind a lock.
//!
//! Data flows: server → [`Shards::check`] (groups items by shard, one message per
//! shard) → actor loop (drains its inbox in batches, reads the clock once per batch,
//! decides each item) → oneshot reply.
//!
//! A full inbox is an explicit [`ShardError::Overloaded`] answer, never an unbounded
//! queue: a limiter that queues without bound under overload stops protecting anything.

pub mod budget;
pub mod concurrency;
pub mod core;
pub mod counters;
pub mod identity;
pub mod replicas;
pub mod replication;
pub mod reservations;
pub mod snapshot;
pub mod store;
pub mod tickets;

use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use metrics::Gauge;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use self::core::{Exports, FrozenShard, ShardCore};

/// The tracing target of a debug line per state installed, replica held or promoted,
/// and per state pushed to a peer with why (`RUST_LOG=ringlimit::install_trace=debug`):
/// how a count that doubled got there (the chaos suite's S4 traces).
pub const INSTALL_TRACE: &str = "ringlimit::install_trace";
use crate::algorithms::{AlgorithmKind, Decision, Millis};
use crate::clock::{Clamped, Clock};
use crate::config::rules::Rule;
use crate::ring::Ring;
pub use identity::{KeyId, StateKey};
pub use store::{Churn, Counter, Exported, Store};

/// Seed for the shard-selection hash. Distinct from the ring's, so a node's keys
/// (which share ring ranges) still spread evenly over its shards.
const SHARD_SEED: u64 = 0x5348_4152_445f_7631; // "SHARD_v1"

/// Most commands one actor wake-up drains before deciding them.
const DRAIN_BATCH: usize = 256;

/// Settings of the shard set.
#[derive(Debug, Clone)]
pub struct ShardConfig {
    /// Number of shard actors.
    pub shards: usize,
    /// Commands an inbox holds before checks are answered `Overloaded`.
    pub inbox: usize,
    /// Keys the whole node holds at most; each shard gets an equal share.
    pub max_keys: usize,
    /// Bytes the whole node's side states (sliding logs, oversized schedules) may hold;
    /// each shard gets an equal share. `None`: [`DEFAULT_STATE_BYTES_PER_KEY`] ×
    /// `max_keys`.
    pub max_state_bytes: Option<usize>,
    /// How often each shard sweeps a slice of its keys for expired state.
    pub expiry_tick: Duration,
    /// Remember which keys changed, for their successor's replica
    /// ([`Shards::drain_replication`]): on when the node replicates.
    pub replicate: bool,
    /// Budget leases (`docs/leases.md`): checks per second of one remote counter
    /// that make this node ask its owner for a lease (default
    /// [`budget::DEFAULT_LEASE_THRESHOLD`]); 0: never.
    pub lease_threshold: u64,
    /// How this node grants budget leases as an owner.
    pub lease_policy: budget::LeasePolicy,
    /// Where ended leases' unused units go, to be returned to their owners.
    pub lease_returns: Option<mpsc::Sender<Vec<budget::entry::Returned>>>,
}

/// The default byte budget per key of `--max-keys`: 256 bytes, so a node at its key cap
/// of a million keys holds at most 256 MB of side state (every sliding log of up to ~14
/// entries fits it; longer logs are fine as long as not every key has one).
pub const DEFAULT_STATE_BYTES_PER_KEY: usize = 256;

impl ShardConfig {
    /// The node's byte budget for side states: `max_state_bytes`, or the default
    /// derived from `max_keys`.
    pub fn state_budget(&self) -> usize {
        self.max_state_bytes
            .unwrap_or_else(|| self.max_keys.saturating_mul(DEFAULT_STATE_BYTES_PER_KEY))
    }
}

impl Default for ShardConfig {
    fn default() -> Self {
        Self {
            shards: std::thread::available_parallelism().map_or(2, |n| n.get()),
            inbox: 4096,
            max_keys: 1_000_000,
            max_state_bytes: None,
            expiry_tick: Duration::from_millis(100),
            replicate: false,
            lease_threshold: budget::DEFAULT_LEASE_THRESHOLD,
            lease_policy: budget::LeasePolicy::default(),
            lease_returns: None,
        }
    }
}

/// One counter to charge: what a shard needs of a planned check, nothing more (the
/// client key and route are already folded into `id`).
#[derive(Debug, Clone)]
pub struct Charge {
    /// The counter's identity (computed once, when the check was planned).
    pub id: KeyId,
    /// The rule whose numbers and algorithm decide it.
    pub rule: Arc<Rule>,
    /// Units to consume.
    pub cost: NonZeroU64,
    /// Units to give back to the counter first, in the same shard step and at the
    /// shard's clock (a negative hit; `NonZeroU64::MAX` empties it, a reset). Exact for
    /// the fixed window and the token bucket (see [`Limiter::give_back`]). Ignored by
    /// refunds.
    ///
    /// [`Limiter::give_back`]: crate::algorithms::Limiter::give_back
    pub give_back: Option<NonZeroU64>,
    /// On a denial, take what the counter still holds (a second check of the remaining
    /// units, in the same shard step): the answer stays a denial, with nothing left.
    pub drain: bool,
    /// Report, change nothing (after any give-back): the numbers a check would see,
    /// taking nothing ([`Store::peek`](store::Store::peek)). Exact where a probe given
    /// back (Envoy's way) would report a reset one unit late.
    pub peek: bool,
    /// Which state decides it: the key's own, or its replica here (a fail-over).
    pub target: Target,
}

/// Which state of a key decides a check on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Target {
    /// The key's own state: this node decides as its owner.
    #[default]
    Owner,
    /// The key's replica: this node is the key's successor and its owner could not be
    /// reached (see [`replicas`]).
    Replica(Doubt),
}

/// Whether the owner a fail-over stands in for may have charged the check already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Doubt {
    /// The forward never reached it (refused connection, reset): what the replica
    /// admits is owed to the owner when it comes back.
    Owed,
    /// The forward timed out, so the owner may have charged it: decided on the replica
    /// like any fail-over but not owed (pushing it could charge it twice there).
    InDoubt,
}

impl Target {
    /// From the peer wire's two flags (`failover`, `failover_in_doubt`); the second
    /// means nothing without the first.
    pub fn from_flags(failover: bool, in_doubt: bool) -> Self {
        match (failover, in_doubt) {
            (false, _) => Target::Owner,
            (true, false) => Target::Replica(Doubt::Owed),
            (true, true) => Target::Replica(Doubt::InDoubt),
        }
    }

    /// The peer wire's two flags (`failover`, `failover_in_doubt`).
    pub fn flags(self) -> (bool, bool) {
        match self {
            Target::Owner => (false, false),
            Target::Replica(Doubt::Owed) => (true, false),
            Target::Replica(Doubt::InDoubt) => (true, true),
        }
    }

    /// Whether the replica decides.
    pub fn is_replica(self) -> bool {
        matches!(self, Target::Replica(_))
    }
}

impl Charge {
    /// The store's view of this charge: which counter, under which numbers.
    pub fn counter(&self) -> Counter<'_> {
        Counter {
            id: self.id,
            fingerprint: self.rule.fingerprint,
            limiter: &self.rule.limiter,
            local: self.rule.is_node_local(),
        }
    }
}

/// The shard's answer for one item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The algorithm's verdict and numbers.
    pub decision: Decision,
    /// Node-wide sequence number of this decision.
    pub sequence: u64,
    /// The (clamped) time the decision was made at; a refund must quote it.
    pub at: Millis,
    /// The key had no state here before this check (new key, or its state expired).
    pub fresh: bool,
}

/// The charges of one [`Shards::check`] call. Most checks carry one descriptor, kept
/// inline: a unary check reaches its shard and back without a vector on the heap.
pub type Charges = smallvec::SmallVec<[Charge; 1]>;

/// A shard's answers to [`Charges`], in the same order (inline for one, likewise).
pub type Outcomes = smallvec::SmallVec<[Outcome; 1]>;

/// An admitted charge to give back.
#[derive(Debug, Clone)]
pub struct Refund {
    /// The charge as it was made.
    pub charge: Charge,
    /// [`Outcome::at`] of its admission.
    pub at: Millis,
}

/// Why a shard could not answer.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShardError {
    /// The shard's inbox is full: the node is overloaded.
    #[error("shard {0} is overloaded (inbox full)")]
    Overloaded(usize),
    /// The shard has stopped (node shutting down).
    #[error("shard {0} has stopped")]
    Stopped(usize),
    /// The node restarted and is restoring its keys' replicas from their successors:
    /// it does not answer as owner yet (the sender fails over to the successor).
    #[error("this node is restoring its keys from their successors after a restart")]
    Restoring,
}

enum Command {
    Check {
        items: Charges,
        reply: oneshot::Sender<Outcomes>,
    },
    Refund {
        items: Vec<Refund>,
    },
    Len {
        reply: oneshot::Sender<usize>,
    },
    Export {
        new_owner: NewOwner,
        earlier: Option<NewOwner>,
        reply: oneshot::Sender<Exports>,
    },
    DrainDeltas {
        reachable: Reachable,
        reply: oneshot::Sender<Vec<(Arc<str>, Exported)>>,
    },
    Freeze {
        reply: oneshot::Sender<FrozenShard>,
    },
    InstallSnapshot(Box<SnapshotItems>),
    Install {
        items: Vec<(Exported, Arc<Rule>)>,
        joined: bool,
        from_holder: bool,
        reply: oneshot::Sender<usize>,
    },
    Counters {
        items: Vec<counters::ClientCounter>,
        reset: bool,
        reply: oneshot::Sender<Vec<counters::CounterReading>>,
    },
    Replication(replication::Command),
    Reservation {
        op: reservations::Op,
        reply: oneshot::Sender<reservations::Reply>,
    },
    Budget(budget::Command),
}

/// A shard's part of a snapshot loaded at start (see [`ShardCore::install_snapshot`]).
struct SnapshotItems {
    live: Vec<(Exported, Arc<Rule>)>,
    replicas: Vec<(Exported, Arc<Rule>)>,
    until: Millis,
    reply: oneshot::Sender<(usize, usize)>,
}

/// For a key's ring placement ([`Ring::key_hash`] of the client key): the node it
/// must be handed to, or `None` if it stays here.
pub type NewOwner = Arc<dyn Fn(u64) -> Option<Recipient> + Send + Sync>;

/// Whether a new owner (node id, generation) can take its late deltas now (see
/// [`Shards::drain_deltas`]).
pub type Reachable = Arc<dyn Fn(&str, u64) -> bool + Send + Sync>;

/// Who a key is handed to: a member, as one incarnation of it.
///
/// The store remembers the incarnation with the handed-away key: when the member comes
/// back under a new one after the cluster dropped it, the keys handed to the earlier
/// incarnation are handed again (their count went with it) and those handed to the
/// new one are not (it holds them). Told apart by id alone, a key the handoff had just
/// handed to the new incarnation was handed to it a second time, and its count doubled
/// (a restarted node denied at 6 of 10: `core`'s
/// `a_key_handed_to_the_new_incarnation_already_is_not_handed_to_it_again`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recipient {
    /// The member's node id.
    pub id: Arc<str>,
    /// The incarnation's generation.
    pub generation: u64,
}

impl Recipient {
    /// `id` as its incarnation `generation`.
    pub fn new(id: impl Into<Arc<str>>, generation: u64) -> Self {
        Self {
            id: id.into(),
            generation,
        }
    }
}

/// Cloneable handle to every shard actor of a node.
#[derive(Clone, Debug)]
pub struct Shards {
    inboxes: Arc<[mpsc::Sender<Command>]>,
    /// Which checks of remote counters go to a shard's lease store (`budget/gate.rs`).
    gate: Arc<budget::gate::LeaseGate>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Command")
    }
}

impl Shards {
    /// Spawn the shard actors on `tracker`; they stop when `cancel` fires.
    ///
    /// `sequence` is the node-wide decision counter, shared so every answer of this
    /// node carries a distinct, increasing sequence number.
    pub fn spawn(
        config: &ShardConfig,
        clock: Arc<dyn Clock>,
        sequence: Arc<AtomicU64>,
        tracker: &TaskTracker,
        cancel: CancellationToken,
    ) -> Self {
        Self::spawn_across(config, clock, sequence, tracker, cancel, &[])
    }

    /// [`Shards::spawn`], shard `i` on runtime `i % runtimes.len()` (the node's worker
    /// threads, one current-thread runtime each); none given: on the current runtime.
    /// A shard stays one actor on one thread; callers on other workers reach it
    /// through its inbox as before.
    pub fn spawn_across(
        config: &ShardConfig,
        clock: Arc<dyn Clock>,
        sequence: Arc<AtomicU64>,
        tracker: &TaskTracker,
        cancel: CancellationToken,
        runtimes: &[tokio::runtime::Handle],
    ) -> Self {
        let shards = config.shards.max(1);
        let per_shard_cap = config.max_keys.div_ceil(shards).max(1);
        let per_shard_bytes = config.state_budget().div_ceil(shards);
        let gate = Arc::new(budget::gate::LeaseGate::new(config.lease_threshold));
        let inboxes: Vec<_> = (0..shards)
            .map(|index| {
                let (tx, rx) = mpsc::channel(config.inbox.max(1));
                let actor = Actor {
                    index,
                    core: ShardCore::new(config.replicate, per_shard_cap, per_shard_bytes, index),
                    clock: Clamped::new(clock.clone()),
                    sequence: sequence.clone(),
                    metrics: ShardMetrics::new(index),
                    unlogged_evictions: 0,
                    unlogged_denied_evictions: 0,
                    last_eviction_log: 0,
                    reservations: reservations::ReservationShard::new(
                        index,
                        reservations::random_key(),
                    ),
                    budget: budget::BudgetShard::new(config, gate.clone()),
                };
                // In the spawning node's span, so eviction logs name the node.
                let run = tracing::Instrument::in_current_span(actor.run(
                    rx,
                    config.expiry_tick,
                    cancel.clone(),
                ));
                match runtimes {
                    [] => tracker.spawn(run),
                    _ => tracker.spawn_on(run, &runtimes[index % runtimes.len()]),
                };
                tx
            })
            .collect();
        Self {
            inboxes: inboxes.into(),
            gate,
        }
    }

    /// Number of shards.
    pub fn len(&self) -> usize {
        self.inboxes.len()
    }

    /// Always false: a node has at least one shard.
    pub fn is_empty(&self) -> bool {
        self.inboxes.is_empty()
    }

    /// The shard that owns `client`. Stable across restarts and processes, which
    /// matters once state is handed between nodes with equal shard counts.
    pub fn shard_of(&self, client: &[u8]) -> usize {
        self.shard_of_placement(Ring::key_hash(client))
    }

    /// The shard of a key at ring position `placement` ([`Ring::key_hash`] of its
    /// client key): handed-over state arrives with only that.
    pub fn shard_of_placement(&self, placement: u64) -> usize {
        // Remixed with a seed: the ring already sorted this node's keys by placement,
        // and the shard must not follow the ring's arcs.
        (xxhash_rust::xxh3::xxh3_64_with_seed(&placement.to_le_bytes(), SHARD_SEED)
            % self.inboxes.len() as u64) as usize
    }

    /// Decide `items`; answers come back in the same order.
    ///
    /// Items are grouped so each shard gets one message; shards decide concurrently.
    pub async fn check(&self, items: Charges) -> Result<Outcomes, ShardError> {
        if let [item] = items.as_slice() {
            // The common case: one descriptor, one shard, no regrouping.
            let shard = self.shard_of_placement(item.id.placement);
            return self.ask(shard, items).await;
        }
        let mut groups: Vec<(Vec<usize>, Charges)> = vec![Default::default(); self.len()];
        for (position, item) in items.into_iter().enumerate() {
            let group = &mut groups[self.shard_of_placement(item.id.placement)];
            group.0.push(position);
            group.1.push(item);
        }
        let total: usize = groups.iter().map(|g| g.0.len()).sum();
        let mut pending = Vec::new();
        for (shard, (positions, items)) in groups.into_iter().enumerate() {
            if !items.is_empty() {
                pending.push((positions, self.send_check(shard, items)?));
            }
        }
        let mut answers: Vec<Option<Outcome>> = vec![None; total];
        for (positions, (shard, reply)) in pending {
            let outcomes = reply.await.map_err(|_| ShardError::Stopped(shard))?;
            for (position, outcome) in positions.into_iter().zip(outcomes) {
                answers[position] = Some(outcome);
            }
        }
        Ok(answers
            .into_iter()
            .map(|a| a.expect("every item answered"))
            .collect())
    }

    /// Give back admitted items. Waits until each shard has queued the refund, so a
    /// refund is never silently dropped; it uses the blocking send because a refund
    /// must not be lost to a momentarily full inbox.
    pub async fn refund(&self, items: Vec<Refund>) -> Result<(), ShardError> {
        let mut groups: Vec<Vec<Refund>> = vec![Vec::new(); self.len()];
        for refund in items {
            groups[self.shard_of_placement(refund.charge.id.placement)].push(refund);
        }
        for (shard, items) in groups.into_iter().enumerate() {
            if !items.is_empty() {
                self.inboxes[shard]
                    .send(Command::Refund { items })
                    .await
                    .map_err(|_| ShardError::Stopped(shard))?;
            }
        }
        Ok(())
    }

    /// Keys held by every shard together.
    pub async fn keys(&self) -> Result<usize, ShardError> {
        let mut total = 0;
        for (shard, inbox) in self.inboxes.iter().enumerate() {
            let (reply, rx) = oneshot::channel();
            inbox
                .send(Command::Len { reply })
                .await
                .map_err(|_| ShardError::Stopped(shard))?;
            total += rx.await.map_err(|_| ShardError::Stopped(shard))?;
        }
        Ok(total)
    }

    /// Hand over every key `new_owner` gives to another node, from every shard: a copy
    /// of each state with its destination (the entries stay, marked moved). With
    /// `earlier` (each placement's owner before this node), the keys handed back to
    /// the incarnation their promoted replica came from are set apart
    /// ([`ShardCore::export_back`]).
    pub async fn export(
        &self,
        new_owner: NewOwner,
        earlier: Option<NewOwner>,
    ) -> Result<Exports, ShardError> {
        let mut out = Exports::default();
        for (shard, inbox) in self.inboxes.iter().enumerate() {
            let (reply, rx) = oneshot::channel();
            inbox
                .send(Command::Export {
                    new_owner: new_owner.clone(),
                    earlier: earlier.clone(),
                    reply,
                })
                .await
                .map_err(|_| ShardError::Stopped(shard))?;
            let exports = rx.await.map_err(|_| ShardError::Stopped(shard))?;
            out.merged.extend(exports.merged);
            out.joined.extend(exports.joined);
        }
        Ok(out)
    }

    /// A copy of shard `shard`'s live keys and replicas as of one step of it (see
    /// [`Store::freeze`]): a snapshot asks the shards one at a time, so no two are
    /// held at once. Waits for room in the inbox: not on the hot path.
    pub async fn freeze(&self, shard: usize) -> Result<FrozenShard, ShardError> {
        let inbox = self.inboxes.get(shard).ok_or(ShardError::Stopped(shard))?;
        let (reply, rx) = oneshot::channel();
        inbox
            .send(Command::Freeze { reply })
            .await
            .map_err(|_| ShardError::Stopped(shard))?;
        rx.await.map_err(|_| ShardError::Stopped(shard))
    }

    /// Install what this node's snapshot held, each state with the local rule it
    /// belongs to: `live` as keys it decides for, `replicas` as replicas; until `until`
    /// the first state a peer hands over for a loaded key is joined with it, not added
    /// (see [`ShardCore::install_snapshot`]). Returns (installed, replicas held).
    pub async fn install_snapshot(
        &self,
        live: Vec<(Exported, Arc<Rule>)>,
        replicas: Vec<(Exported, Arc<Rule>)>,
        until: Millis,
    ) -> Result<(usize, usize), ShardError> {
        let mut groups: Vec<(Vec<_>, Vec<_>)> = vec![(Vec::new(), Vec::new()); self.len()];
        for item in live {
            groups[self.shard_of_placement(item.0.id.placement)]
                .0
                .push(item);
        }
        for item in replicas {
            groups[self.shard_of_placement(item.0.id.placement)]
                .1
                .push(item);
        }
        let (mut installed, mut held) = (0, 0);
        for (shard, (live, replicas)) in groups.into_iter().enumerate() {
            let (reply, rx) = oneshot::channel();
            self.inboxes[shard]
                .send(Command::InstallSnapshot(Box::new(SnapshotItems {
                    live,
                    replicas,
                    until,
                    reply,
                })))
                .await
                .map_err(|_| ShardError::Stopped(shard))?;
            let (i, h) = rx.await.map_err(|_| ShardError::Stopped(shard))?;
            installed += i;
            held += h;
        }
        Ok((installed, held))
    }

    /// Admissions made on handed-over keys since the last call, per destination, for
    /// the destinations `reachable` (the others stay for a later call).
    pub async fn drain_deltas(
        &self,
        reachable: Reachable,
    ) -> Result<Vec<(Arc<str>, Exported)>, ShardError> {
        let mut out = Vec::new();
        for (shard, inbox) in self.inboxes.iter().enumerate() {
            let (reply, rx) = oneshot::channel();
            let reachable = reachable.clone();
            inbox
                .send(Command::DrainDeltas { reachable, reply })
                .await
                .map_err(|_| ShardError::Stopped(shard))?;
            out.extend(rx.await.map_err(|_| ShardError::Stopped(shard))?);
        }
        Ok(out)
    }

    /// Install handed-over state, each item with the local rule it belongs to, merged
    /// with what a shard holds (joined with it when `joined`, and some from the sender
    /// that held them, `from_holder`: see [`ShardCore::install`]). Returns how many
    /// were installed.
    pub async fn install(
        &self,
        items: Vec<(Exported, Arc<Rule>)>,
        joined: bool,
        from_holder: bool,
    ) -> Result<usize, ShardError> {
        let mut groups: Vec<Vec<(Exported, Arc<Rule>)>> = vec![Vec::new(); self.len()];
        for item in items {
            let shard = self.shard_of_placement(item.0.id.placement);
            groups[shard].push(item);
        }
        let mut installed = 0;
        for (shard, items) in groups.into_iter().enumerate() {
            if items.is_empty() {
                continue;
            }
            let (reply, rx) = oneshot::channel();
            self.inboxes[shard]
                .send(Command::Install {
                    items,
                    joined,
                    from_holder,
                    reply,
                })
                .await
                .map_err(|_| ShardError::Stopped(shard))?;
            installed += rx.await.map_err(|_| ShardError::Stopped(shard))?;
        }
        Ok(installed)
    }

    /// Read (or, with `reset`, read then drop) one client's counters, in one step of
    /// the shard that holds them (they share the client key's placement): no lock, and
    /// no check runs between the reading and the reset. Answers only the counters that
    /// hold state; a reset answers their numbers from just before. Charges nothing.
    /// Waits for room in the inbox: an operator's call is not on the hot path.
    pub async fn counters(
        &self,
        placement: u64,
        items: Vec<counters::ClientCounter>,
        reset: bool,
    ) -> Result<Vec<counters::CounterReading>, ShardError> {
        let shard = self.shard_of_placement(placement);
        let (reply, rx) = oneshot::channel();
        self.inboxes[shard]
            .send(Command::Counters {
                items,
                reset,
                reply,
            })
            .await
            .map_err(|_| ShardError::Stopped(shard))?;
        rx.await.map_err(|_| ShardError::Stopped(shard))
    }

    async fn ask(&self, shard: usize, items: Charges) -> Result<Outcomes, ShardError> {
        let (_, reply) = self.send_check(shard, items)?;
        reply.await.map_err(|_| ShardError::Stopped(shard))
    }

    fn send_check(
        &self,
        shard: usize,
        items: Charges,
    ) -> Result<(usize, oneshot::Receiver<Outcomes>), ShardError> {
        let (reply, rx) = oneshot::channel();
        self.inboxes[shard]
            .try_send(Command::Check { items, reply })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => ShardError::Overloaded(shard),
                mpsc::error::TrySendError::Closed(_) => ShardError::Stopped(shard),
            })?;
        Ok((shard, rx))
    }
}

/// Pre-registered metric handles: resolving a labelled metric by name on every check
/// would cost a registry lookup on the hot path.
struct ShardMetrics {
    /// [allowed, denied] per (rule name, algorithm index), created on first use.
    checks: RuleCounters,
    keys: Gauge,
    state_bytes: Gauge,
    queue_depth: Gauge,
    /// Evictions of keys that still had budget (`kind="live"`).
    evictions: metrics::Counter,
    /// Evictions of exhausted keys (`kind="denied"`): only when every key was denied.
    denied_evictions: metrics::Counter,
    /// Replicas dropped for live keys' room (`kind="replica"`): by design, not an alert.
    replica_evictions: metrics::Counter,
    expired: metrics::Counter,
}

impl ShardMetrics {
    fn new(index: usize) -> Self {
        let shard = index.to_string();
        Self {
            checks: RuleCounters::default(),
            keys: metrics::gauge!("ringlimit_keys", "shard" => shard.clone()),
            state_bytes: metrics::gauge!("ringlimit_state_bytes", "shard" => shard.clone()),
            queue_depth: metrics::gauge!("ringlimit_shard_queue_depth", "shard" => shard.clone()),
            evictions: metrics::counter!(
                "ringlimit_evictions_total", "shard" => shard.clone(), "kind" => "live"
            ),
            denied_evictions: metrics::counter!(
                "ringlimit_evictions_total", "shard" => shard.clone(), "kind" => "denied"
            ),
            replica_evictions: metrics::counter!(
                "ringlimit_evictions_total", "shard" => shard.clone(), "kind" => "replica"
            ),
            expired: metrics::counter!("ringlimit_expired_keys_total", "shard" => shard),
        }
    }
}

/// Most distinct (rule, algorithm) label pairs one shard gives a series of its own in
/// `ringlimit_checks_total`; later ones share `rule="other"`. A label per rule is what a
/// dashboard wants, and a rule file is operator input: a generated file with a million
/// rules must not become a million series.
pub const MAX_RULE_LABELS: usize = 256;

/// The check counters of one shard, by rule: owned by the shard's actor (no lock), so a
/// decision costs one hash lookup of the rule name.
#[derive(Default)]
struct RuleCounters {
    by_rule:
        hashbrown::HashMap<(Arc<str>, usize), [metrics::Counter; 2], foldhash::fast::RandomState>,
    other: hashbrown::HashMap<usize, [metrics::Counter; 2], foldhash::fast::RandomState>,
}

impl RuleCounters {
    /// The [allowed, denied] counters of `rule` (fail-open stand-ins count under their
    /// rule's name: `x~fallback/3` is `x`, and the degraded counter says they were).
    fn of(&mut self, rule: &Rule) -> &[metrics::Counter; 2] {
        let kind = rule.limiter.kind();
        let key = (rule.name.clone(), kind.index());
        if !self.by_rule.contains_key(&key) {
            if self.by_rule.len() >= MAX_RULE_LABELS {
                return self
                    .other
                    .entry(kind.index())
                    .or_insert_with(|| Self::counters("other", kind));
            }
            let name = rule.base_name().to_string();
            self.by_rule
                .insert(key.clone(), Self::counters(&name, kind));
        }
        &self.by_rule[&key]
    }

    fn counters(rule: &str, kind: AlgorithmKind) -> [metrics::Counter; 2] {
        ["allowed", "denied"].map(|verdict| {
            metrics::counter!(
                "ringlimit_checks_total",
                "verdict" => verdict,
                "algorithm" => kind.as_str(),
                "rule" => rule.to_string()
            )
        })
    }
}

struct Actor {
    index: usize,
    /// The keys, the replicas and every decision on them.
    core: ShardCore,
    clock: Clamped,
    sequence: Arc<AtomicU64>,
    metrics: ShardMetrics,
    /// Evictions not yet logged (all kinds, and of them the denied ones), and when the
    /// last eviction line was written: one warning per second per shard, however fast
    /// keys are evicted.
    unlogged_evictions: u64,
    unlogged_denied_evictions: u64,
    last_eviction_log: Millis,
    /// Open reservations and concurrency leases of this shard's keys
    /// (`reservations.rs`, `concurrency.rs`).
    reservations: reservations::ReservationShard,
    /// Budget leases this shard granted as owner and holds as entry (`budget.rs`).
    budget: budget::BudgetShard,
}

impl Actor {
    /// The actor loop: the only `select!` of the shard (inbox, expiry tick, cancellation).
    async fn run(
        mut self,
        mut inbox: mpsc::Receiver<Command>,
        expiry_tick: Duration,
        cancel: CancellationToken,
    ) {
        let mut batch = Vec::with_capacity(DRAIN_BATCH);
        let mut tick = tokio::time::interval(expiry_tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                received = inbox.recv_many(&mut batch, DRAIN_BATCH) => {
                    if received == 0 {
                        break;
                    }
                    self.metrics.queue_depth.set(inbox.len() as f64);
                    // One clock read per drained batch: every item in it was waiting at
                    // the same moment, and the read is not free.
                    let now = self.clock.now_ms();
                    for command in batch.drain(..) {
                        self.handle(command, now);
                    }
                }
                _ = tick.tick() => self.expire(),
            }
        }
        tracing::debug!(
            shard = self.index,
            keys = self.core.store().len(),
            "shard stopped"
        );
    }

    fn handle(&mut self, command: Command, now: Millis) {
        match command {
            Command::Check { items, reply } => {
                let outcomes = self.check(&items, now);
                // The caller may have given up (deadline); its answer is simply dropped.
                let _ = reply.send(outcomes);
            }
            Command::Refund { items } => {
                for refund in &items {
                    self.core.refund(refund, now);
                }
            }
            Command::Len { reply } => {
                let _ = reply.send(self.core.store().len());
            }
            Command::Export {
                new_owner,
                earlier,
                reply,
            } => {
                let exported = match earlier {
                    Some(earlier) => self.core.export_back(now, &*new_owner, &*earlier),
                    None => Exports {
                        merged: self.core.export(now, |placement| new_owner(placement)),
                        joined: Vec::new(),
                    },
                };
                self.metrics.keys.set(self.core.store().len() as f64);
                let _ = reply.send(exported);
            }
            Command::DrainDeltas { reachable, reply } => {
                let _ = reply.send(self.core.drain_deltas(|to, g| reachable(to, g)));
            }
            Command::Freeze { reply } => {
                let _ = reply.send(self.core.freeze());
            }
            Command::InstallSnapshot(items) => {
                let SnapshotItems {
                    live,
                    replicas,
                    until,
                    reply,
                } = *items;
                let (installed, held, churn) =
                    self.core.install_snapshot(live, replicas, until, now);
                self.record_churn(churn);
                let _ = reply.send((installed, held));
            }
            Command::Install {
                items,
                joined,
                from_holder,
                reply,
            } => {
                let installed = self.core.install(items, joined, from_holder, now);
                self.metrics.keys.set(self.core.store().len() as f64);
                let _ = reply.send(installed);
            }
            Command::Counters {
                items,
                reset,
                reply,
            } => {
                let readings = self.core.counters(items, reset, now);
                if reset {
                    self.metrics.keys.set(self.core.store().len() as f64);
                }
                let _ = reply.send(readings);
            }
            Command::Replication(command) => {
                let churn = self.core.replication(command, now);
                self.record_churn(churn);
            }
            Command::Reservation { op, reply } => {
                let _ = reply.send(self.reservation(op, now));
            }
            Command::Budget(command) => self.budget(command, now),
        }
    }

    /// Decide one message's charges, in order (see [`ShardCore::check`]).
    fn check(&mut self, items: &Charges, now: Millis) -> Outcomes {
        let (checks, sequence) = (&mut self.metrics.checks, &self.sequence);
        let (outcomes, churn) = self.core.check(items, now, |item, decision| {
            checks.of(&item.rule)[usize::from(!decision.allowed)].increment(1);
            sequence.fetch_add(1, Ordering::Relaxed) + 1
        });
        self.record_churn(churn);
        outcomes
    }

    fn expire(&mut self) {
        let now = self.clock.now_ms();
        let expired = self.core.expire(now);
        self.reservations.expire(now);
        self.expire_budget(now);
        self.record_churn(Churn {
            expired,
            ..Churn::default()
        });
    }

    fn record_churn(&mut self, churn: Churn) {
        if churn.expired > 0 {
            self.metrics.expired.increment(churn.expired);
        }
        if churn.evicted_replicas > 0 {
            self.metrics
                .replica_evictions
                .increment(churn.evicted_replicas);
        }
        if churn.evicted > 0 {
            self.metrics.evictions.increment(churn.evicted);
            self.unlogged_evictions += churn.evicted;
        }
        if churn.evicted_denied > 0 {
            self.metrics
                .denied_evictions
                .increment(churn.evicted_denied);
            self.unlogged_evictions += churn.evicted_denied;
            self.unlogged_denied_evictions += churn.evicted_denied;
        }
        if self.unlogged_evictions > 0
            && self.clock.now_ms().saturating_sub(self.last_eviction_log) >= 1_000
        {
            // Eviction loses live counts: loud on purpose (design reference, Failure modes).
            if self.unlogged_denied_evictions > 0 {
                tracing::warn!(
                    shard = self.index,
                    evicted = self.unlogged_evictions,
                    denied = self.unlogged_denied_evictions,
                    cap = self.core.store().cap(),
                    "key cap or state byte budget reached with every key denied: evicted {} \
                     exhausted keys, whose \
                     clients are admitted early; raise --max-keys or --max-state-bytes",
                    self.unlogged_denied_evictions
                );
            } else {
                tracing::warn!(
                    shard = self.index,
                    evicted = self.unlogged_evictions,
                    denied = 0,
                    cap = self.core.store().cap(),
                    "key cap or state byte budget reached: evicted live rate-limit state \
                     (no denied key); raise --max-keys or --max-state-bytes"
                );
            }
            self.unlogged_evictions = 0;
            self.unlogged_denied_evictions = 0;
            self.last_eviction_log = self.clock.now_ms();
        }
        self.metrics.keys.set(self.core.store().len() as f64);
        self.metrics
            .state_bytes
            .set(self.core.store().side_bytes() as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::rules::RuleSet;

    /// Every inbox message is as large as the largest kind, and every check's future
    /// holds one (the `send` of its refund, whether or not anything is refunded): a
    /// large payload of a rare message goes in a box. 152 bytes with a budget lease
    /// inline added 112 bytes to every check's future.
    #[test]
    fn an_inbox_message_is_no_larger_than_a_reservation_message() {
        assert!(
            std::mem::size_of::<Command>() <= 96,
            "{} bytes",
            std::mem::size_of::<Command>()
        );
    }

    #[test]
    fn check_counters_get_a_rule_label_for_at_most_max_rule_labels_rules() {
        let text: String = (0..=MAX_RULE_LABELS)
            .map(|i| {
                format!("[[rule]]\nname = \"r{i}\"\ntier = \"t{i}\"\nlimit = 1\nwindow = \"1s\"\n")
            })
            .collect();
        let rules = RuleSet::from_toml_str(&text).unwrap();
        let mut counters = RuleCounters::default();
        for rule in rules.rules() {
            counters.of(rule);
            // The fail-open stand-in shares its rule's series.
            counters.of(&rule.fallback(3));
        }
        assert_eq!(counters.by_rule.len(), MAX_RULE_LABELS);
        assert_eq!(counters.other.len(), 1, "the rest share rule=\"other\"");
    }
}
