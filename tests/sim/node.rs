//! One simulated node: the real pure pieces of a ringlimit node, driven by events.
//!
//! What is real (called, not re-implemented): the shard [`Store`]s and the algorithms
//! inside them, the per-shard [`Clamped`] clock, the rule set and planning
//! (`check::plan::plan_check`; on the owner `check::forwarded::plan_batch` and
//! `plan_refunds`), the routing policy (`policy::plan`,
//! `remote_answer`, `denial`, `on_unreachable`, `combine`, `refunds`,
//! `arrived_too_late`), the [`DenyCache`], the verdict (`Verdict::combine`), the view
//! (`build_view_after`, so dedupe and generations are the node's), the ring and its
//! diff, and the handoff (`Store::export` / `drain_deltas`, `handoff::with_rules`
//! vetting, `Store::install` merging).
//!
//! The peer link's sender is the real `cluster::link` state machines, driven by
//! `link.rs`; refunds and installs are built by `cluster::link::calls`.
//!
//! A client's check is the production [`Flight`] (plan, budget leases, fail-over to the
//! successor, fallbacks, combining, refunds): this file only performs what it asks for.
//! A forwarded batch is refused as production's (`flight::owner_refuses`). The handoff
//! watcher is production's `handoff::Watcher` (which view changes hand keys over, to
//! whom, and where promoted keys go back), its pushes grouped by
//! `handoff::destinations`. Budget leases are `node/leases.rs`, replication
//! `node/replication.rs`. Fencing is production's `membership::Quorum`, fed the
//! heartbeats this node's gossip heard every `FENCE_TICK_MS` and on every view, and
//! its `Fence` is applied where the router applies it (`Flight::fence`,
//! `policy::fence_split`, `policy::recheck_fenced`, `Flight::fenced`).
//!
//! What is a model: the async shells around them (this file performs
//! `decide_forwarded`'s and the shard actor's calls on the shard cores, and the
//! phases of `Router::decide` in the order it awaits them), the peer link's shell
//! (`link.rs`), and gossip (heartbeats, a timeout failure detector, push-pull
//! dissemination: chitchat itself is exercised by the process suite,
//! `tests/jepsen-like`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use prost::Message;
use ringlimit::algorithms::{AlgorithmKind, KeyState, Millis};
use ringlimit::check::forwarded::{self, OwnerRules};
use ringlimit::check::plan::{plan_check, At, FieldNames, Leaf};
use ringlimit::check::verdict::Verdict;
use ringlimit::check::{CheckError, CheckInput, DescriptorInput};
use ringlimit::clock::{Clamped, Clock};
use ringlimit::cluster::deny_cache::DenyCache;
use ringlimit::cluster::flight::{self, FailOver, Flight, Rescue};
use ringlimit::cluster::handoff::{self, MAX_INSTALL_STATES};
use ringlimit::cluster::link::calls;
use ringlimit::cluster::policy::{self, Now, Origin, Routing};
use ringlimit::cluster::{Answer, Charged, CheckItem, Checks, Decider, InlineRules, Remote};
use ringlimit::config::rules::{Rule, RuleSet};
use ringlimit::membership::quorum::FENCE_TICK_MS;
use ringlimit::membership::{
    build_view_after, ClusterView, Fence, FenceConfig, LiveNode, Member, Quorum, KEY_GRPC_ADDR,
    KEY_LEAVING, KEY_PEER_ADDR,
};
use ringlimit::proto::peer::{
    ForwardAnswer, ForwardCall, ForwardResponse, InstallRequest, PeerLeaseRequest,
    PeerLeaseResponse, PeerReturnLeaseRequest, RefundRequest, RestoreRequest, RestoreResponse,
};
use ringlimit::server::peer::{forwarded_input, refund_input};
use ringlimit::shard::budget::gate::LeaseGate;
use ringlimit::shard::budget::{BudgetCore, LeasePolicy};
use ringlimit::shard::{Charge, Exported, KeyId, Outcome, ShardCore, ShardError};

use crate::history::Entry;
use crate::link::{Effects, Link, LinkConfig, Waiter};
use crate::rng::Rng;

mod leases;
mod replication;
pub use replication::ReplicationStats;
use replication::Restore;

/// Shards per node (the process suite's nodes run 2 on this machine).
const SHARDS: usize = 2;
/// The key cap of a shard: far above what a run touches (eviction is not modelled).
const SHARD_CAP: usize = 100_000;
/// Gossip peers per round (chitchat's fan-out).
const FANOUT: usize = 3;
/// Bytes of a gossip message before its digests: cluster id, sender, auth tag.
const GOSSIP_HEADER: usize = 64;
/// A gap this long between two runs of the membership driver means the process was
/// frozen (`membership::STALL`): removals are then held for `STALL_HOLD_MS`.
const STALL_MS: u64 = 1000;
const STALL_HOLD_MS: u64 = 1500;
/// Bytes of one node's key-values (grpc and peer address, leaving) in a gossip delta.
const GOSSIP_DELTA: usize = 96;

/// A node's wall clock: simulated time plus its offset (the clock-offset fault); the
/// monotonic reading is simulated time (no fault steps it).
#[derive(Debug)]
pub struct SimClock {
    time: Arc<AtomicU64>,
    offset: AtomicI64,
}

impl SimClock {
    pub fn new(time: Arc<AtomicU64>) -> SimClock {
        SimClock {
            time,
            offset: AtomicI64::new(0),
        }
    }
    pub fn set_offset(&self, ms: i64) {
        self.offset.store(ms, Ordering::SeqCst);
    }
}

impl Clock for SimClock {
    fn now_ms(&self) -> Millis {
        self.time
            .load(Ordering::SeqCst)
            .saturating_add_signed(self.offset.load(Ordering::SeqCst))
    }
    fn monotonic_ms(&self) -> Millis {
        self.time.load(Ordering::SeqCst)
    }
}

/// The three addresses a node advertises (fixed per node id, so a restart keeps them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Addrs {
    pub gossip: SocketAddr,
    pub grpc: SocketAddr,
    pub peer: SocketAddr,
}

impl Addrs {
    pub fn of_index(i: usize) -> Addrs {
        let ip = format!("10.{}.{}.{}", 1 + i / 65_536, (i / 256) % 256, i % 256);
        let at = |port: u16| format!("{ip}:{port}").parse().expect("an address");
        Addrs {
            gossip: at(7946),
            grpc: at(8081),
            peer: at(8082),
        }
    }
}

/// One node's gossip about one incarnation.
#[derive(Clone, Debug)]
pub struct GossipEntry {
    pub id: Arc<str>,
    pub generation: u64,
    pub heartbeat: u64,
    pub addrs: Addrs,
    pub leaving: bool,
}

/// What travels between nodes.
#[derive(Debug)]
pub enum Msg {
    /// Gossip round opener: the sender's digests (UDP; one vector shared by the round's
    /// messages).
    GossipSyn(Arc<Vec<GossipEntry>>),
    /// Gossip reply: the receiver's digests (UDP).
    GossipAck(Arc<Vec<GossipEntry>>),
    /// A forwarded batch (TCP, on the sender's peer stream `stream`).
    Forward { stream: u64, call: ForwardCall },
    /// A request for a budget lease, numbered `ask` by the asking node (TCP).
    Lease {
        ask: u64,
        request: Box<PeerLeaseRequest>,
    },
    /// The owner's answer to request `ask`; `Err`: refused as a call (and why).
    Leased {
        ask: u64,
        answer: Result<Box<PeerLeaseResponse>, String>,
    },
    /// A lease's unused units, given back to the owner that granted it (TCP).
    ReturnLease(PeerReturnLeaseRequest),
    /// Its answer on that stream, for the sender incarnation `to_inc`; `Err`: the
    /// stream broke (the owner's process is gone) and why.
    Answer {
        to_inc: u64,
        stream: u64,
        answer: Result<ForwardAnswer, String>,
    },
    /// Refunds of admitted charges (TCP).
    Refund(RefundRequest),
    /// Handed-over state, or fail-over admissions for their owner (TCP).
    Install(InstallRequest),
    /// Replicas for the keys' successor, chunk `batch` of the sender's (TCP; a call that
    /// cannot be made in time fails, see `World::deliver`).
    Replicate { batch: u64, request: InstallRequest },
    /// The successor's answer to chunk `batch`, for the sender incarnation `to_inc`;
    /// `ok` false: the call failed (refused, or not made in time).
    Replicated { to_inc: u64, batch: u64, ok: bool },
    /// A restarted node asking for the replicas of its keys.
    Restore(RestoreRequest),
    /// The replicas pushed back (each an `Install` call, made before the answer) and
    /// the answer; `Err`: the call failed.
    Restored(Result<(Vec<InstallRequest>, RestoreResponse), String>),
}

impl Msg {
    /// Whether it rides TCP (held across a partition, retransmitted under loss) rather
    /// than UDP (dropped).
    pub fn tcp(&self) -> bool {
        !matches!(self, Msg::GossipSyn(_) | Msg::GossipAck(_))
    }
    /// Bytes on the wire: the peer API's encoded size (plus a gRPC frame header of 5
    /// and ~9 of HTTP/2 DATA framing), or the gossip model's digest size.
    pub fn bytes(&self) -> usize {
        let grpc = |len: usize| len + 5 + 9;
        match self {
            Msg::GossipSyn(e) | Msg::GossipAck(e) => {
                GOSSIP_HEADER + e.iter().map(|g| g.id.len() + 36).sum::<usize>()
            }
            Msg::Forward { call, .. } => grpc(call.encoded_len()),
            Msg::Answer { answer, .. } => answer.as_ref().map_or(0, |a| grpc(a.encoded_len())),
            Msg::Refund(r) => grpc(r.encoded_len()),
            Msg::Lease { request, .. } => grpc(request.encoded_len()),
            Msg::Leased { answer, .. } => answer.as_ref().map_or(0, |a| grpc(a.encoded_len())),
            Msg::ReturnLease(r) => grpc(r.encoded_len()),
            Msg::Install(r) | Msg::Replicate { request: r, .. } => grpc(r.encoded_len()),
            Msg::Replicated { .. } => grpc(2),
            Msg::Restore(r) => grpc(r.encoded_len()),
            Msg::Restored(r) => r.as_ref().map_or(0, |(installs, response)| {
                installs
                    .iter()
                    .map(|i| grpc(i.encoded_len()))
                    .sum::<usize>()
                    + grpc(response.encoded_len())
            }),
        }
    }
}

/// A node-local timer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timer {
    Gossip,
    Deltas,
    Link,
    /// The replicator's round (`--replicate-interval-ms`).
    Replicate,
    /// The restore's settle wait or its deadline.
    Restore,
    /// The membership driver's fence tick (`quorum::FENCE_TICK_MS`).
    Fence,
}

/// What a node asks the world to do.
#[derive(Debug)]
pub enum Out {
    Send {
        to: String,
        msg: Msg,
    },
    Timer {
        at: u64,
        timer: Timer,
    },
    /// A completed check for a client (`t` is filled in when the client gets it);
    /// `failover`: a descriptor was answered by the key's successor (the history
    /// cannot tell such an answer from a fail-open one: the simulator's own checks
    /// need to).
    Answer {
        client: u32,
        op: u64,
        entry: Entry,
        failover: bool,
    },
    /// Gossip bytes owed to this node for key-values it sent (see `GOSSIP_DELTA`).
    GossipDelta(usize),
}

/// Counts for the figures and the docs.
#[derive(Default, Debug, Clone)]
pub struct NodeStats {
    pub handed_over: u64,
    /// Of those, keys promoted here and handed back to be joined.
    pub handed_back: u64,
    pub handoff_lost: u64,
    pub installed: u64,
    pub refused_late: u64,
    /// Fenced rules' checks denied here undecided (no majority, or another live owner).
    pub fenced: u64,
}

struct Shard {
    /// The shard's real core: live keys, replicas and every decision on them.
    core: ShardCore,
    /// Its budget leases, both sides (the real lease stores).
    budget: BudgetCore,
    clock: Clamped,
}

/// A client's check in flight: the production [`Flight`] and the results the
/// simulated network has delivered for it so far.
struct Pending {
    client: u32,
    op: u64,
    flight: Flight,
    /// Results from the owners (the flight's `remote()` order), then from successors
    /// (`second`).
    results: Vec<Option<Result<Remote, ringlimit::cluster::link::ForwardError>>>,
    /// Results still due.
    waiting: usize,
    /// Fail-overs sent to successors: (position in `results`, descriptor, successor's
    /// index in the flight's view).
    second: Vec<(usize, usize, usize)>,
    /// The owners' answers are settled (`Flight::settle` ran).
    settled: bool,
    /// Fail-open stand-in charges to decide here at the end.
    open: Vec<(usize, Charge)>,
}

struct Known {
    heartbeat: u64,
    last_heard: u64,
    addrs: Addrs,
    leaving: bool,
}

/// Field names of the ringlimit.v1 `Check` message, for planning errors.
struct V1;

impl FieldNames for V1 {
    fn field(&self, _at: At, leaf: Leaf) -> String {
        leaf.as_str().to_string()
    }
    fn descriptors(&self, _check: Option<usize>) -> String {
        "descriptors".into()
    }
}

/// How a node is set up.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub gossip_ms: u64,
    /// Heartbeats unheard this long mark an incarnation dead.
    pub fd_timeout_ms: u64,
    pub delta_ms: u64,
    pub link: LinkConfig,
    pub broken: bool,
    /// Hold removals after a stall, as the membership driver does (off only to show
    /// what it prevents).
    pub stall_hold: bool,
    /// Ids gossiped with when the node knows too few live peers.
    pub seeds: Vec<String>,
    /// `--replicate-interval-ms`: 0, no replicas, no fail-over, no restore.
    pub replicate_ms: u64,
    /// `--restore-timeout-ms`.
    pub restore_timeout_ms: u64,
    /// `--lease-threshold` (0: no budget leases). Below
    /// `shard::budget::gate::SAMPLES_AT_THRESHOLD` the gate meters every check, so no
    /// sampling draw (the gate's own random one) enters a run.
    pub lease_threshold: u64,
    /// `--lease-ttl-ms` and `--lease-floor`.
    pub lease_policy: LeasePolicy,
}

pub struct Node {
    pub id: Arc<str>,
    pub generation: u64,
    pub addrs: Addrs,
    me: Decider,
    pub clock: Arc<SimClock>,
    shards: Vec<Shard>,
    sequence: u64,
    deny: DenyCache,
    pub view: Arc<ClusterView>,
    /// The handoff watcher (production's), fed every view this node publishes.
    watcher: handoff::Watcher,
    /// The latest replication batch held from each sender.
    held_batches: ringlimit::cluster::replication::ReplicaBatches,
    rules: Arc<RuleSet>,
    /// Inline (Gubernator) rules: none in the simulator's workload, but the owner's
    /// planning takes the registry.
    inline: InlineRules,
    routing: Routing,
    fallbacks: BTreeMap<(String, u64, u64), Arc<Rule>>,
    heartbeat: u64,
    /// Node id → generation → what this node heard of that incarnation.
    known: BTreeMap<Arc<str>, BTreeMap<u64, Known>>,
    /// A hash of the live set the view was last built from.
    live_key: u64,
    /// When the membership driver last ran, and until when removals are held after a
    /// stall (the real driver's `note_stall`).
    last_run: u64,
    hold_removals_until: Option<u64>,
    link: Link,
    pending: BTreeMap<u64, Pending>,
    next_check: u64,
    cfg: NodeConfig,
    rng: Rng,
    pub stats: NodeStats,
    pub repl: ReplicationStats,
    restore: Restore,
    /// What the replicator remembers of the members (production's).
    memory: ringlimit::cluster::replication::Memory,
    /// The replicator's sends in flight.
    replicas: replication::Sending,
    /// The node's lease gate, shared by its shards' lease stores.
    gate: Arc<LeaseGate>,
    /// Lease requests this node sent and has no answer to: (counter, when sent).
    lease_asks: BTreeMap<u64, (CheckItem, ringlimit::algorithms::Millis)>,
    next_ask: u64,
    /// Grants and returns since the world last took them (the owners' ledger).
    ledger: Vec<Entry>,
    /// The fencing tracker (production's), fed the heartbeats this node heard, and the
    /// fence it last published: what the router reads for fenced rules.
    quorum: Quorum,
    fence: Fence,
}

impl Node {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: &str,
        generation: u64,
        addrs: Addrs,
        time: Arc<AtomicU64>,
        rules: Arc<RuleSet>,
        cfg: NodeConfig,
        rng: Rng,
    ) -> Node {
        let time_now = time.load(Ordering::SeqCst);
        let cfg_seeded = !cfg.seeds.is_empty();
        let clock = Arc::new(SimClock::new(time));
        let replicate = cfg.replicate_ms > 0;
        let gate = Arc::new(LeaseGate::new(cfg.lease_threshold));
        assert_eq!(
            gate.sample(),
            1,
            "a sampling gate would draw outside the seed"
        );
        let shards = (0..SHARDS)
            .map(|index| Shard {
                core: ShardCore::new(
                    replicate,
                    SHARD_CAP,
                    SHARD_CAP * ringlimit::shard::DEFAULT_STATE_BYTES_PER_KEY,
                    index,
                ),
                budget: BudgetCore::new(cfg.lease_threshold, gate.clone(), cfg.lease_policy),
                clock: Clamped::new(clock.clone()),
            })
            .collect();
        let me_member = Member {
            node_id: id.to_string(),
            generation,
            grpc_addr: addrs.grpc,
            peer_addr: addrs.peer,
            gossip_addr: addrs.gossip,
            leaving: false,
        };
        let first = Arc::new(ClusterView::single(me_member));
        let mut node = Node {
            id: Arc::from(id),
            generation,
            addrs,
            me: Decider {
                node_id: Arc::from(id),
                generation,
            },
            clock,
            shards,
            sequence: 0,
            deny: DenyCache::new(100_000),
            view: first.clone(),
            watcher: handoff::Watcher::new(Arc::from(id), first),
            held_batches: Default::default(),
            rules,
            inline: InlineRules::default(),
            routing: Routing {
                broken_decide_locally: cfg.broken,
            },
            fallbacks: BTreeMap::new(),
            heartbeat: 0,
            known: BTreeMap::new(),
            live_key: 0,
            last_run: 0,
            hold_removals_until: None,
            link: Link::new(cfg.link),
            pending: BTreeMap::new(),
            next_check: 1,
            restore: Restore::new(
                cfg.replicate_ms > 0 && cfg.seeds.iter().any(|s| **s != *id),
                time_now + cfg.restore_timeout_ms,
            ),
            cfg,
            rng,
            stats: NodeStats::default(),
            repl: ReplicationStats::default(),
            memory: ringlimit::cluster::replication::Memory::default(),
            replicas: replication::Sending::default(),
            gate,
            lease_asks: BTreeMap::new(),
            next_ask: 0,
            ledger: Vec::new(),
            quorum: Quorum::new(FenceConfig::new(None, cfg_seeded), id, time_now),
            fence: Fence::closed(id),
        };
        // `Replicator::run` starts from the node's first view.
        let first = node.view.clone();
        node.memory.first_view(&first, node.clock.now_ms());
        node
    }

    /// The timers a fresh incarnation starts with.
    pub fn boot(&mut self, now: u64) -> Vec<Out> {
        self.last_run = now;
        let phase = self.rng.range(1, self.cfg.gossip_ms);
        let mut out = vec![
            Out::Timer {
                at: now + phase,
                timer: Timer::Gossip,
            },
            Out::Timer {
                at: now + self.cfg.delta_ms,
                timer: Timer::Deltas,
            },
            Out::Timer {
                at: now + FENCE_TICK_MS,
                timer: Timer::Fence,
            },
        ];
        if self.replicating() {
            out.push(Out::Timer {
                at: now + self.cfg.replicate_ms,
                timer: Timer::Replicate,
            });
        }
        if self.restoring() {
            out.push(Out::Timer {
                at: now + self.cfg.restore_timeout_ms,
                timer: Timer::Restore,
            });
        }
        out
    }

    fn now(&self) -> Now {
        Now::of(&*self.clock)
    }

    pub fn on_timer(&mut self, timer: Timer) -> Vec<Out> {
        match timer {
            Timer::Gossip => self.gossip_round(),
            Timer::Deltas => {
                // The shard actors' expiry tick (every 100 ms, a sixteenth of the keys
                // and at least 1024 per tick), then `Handoff::flush_deltas` (every
                // 100 ms, push late admissions).
                for shard in &mut self.shards {
                    let now = shard.clock.now_ms();
                    shard.core.expire(now);
                }
                let mut out = self.expire_leases();
                out.extend(self.flush_deltas());
                out.push(Out::Timer {
                    at: self.clock.monotonic_ms() + self.cfg.delta_ms,
                    timer: Timer::Deltas,
                });
                out
            }
            Timer::Link => {
                let fx = self.link.on_tick(self.now());
                self.link_effects(fx)
            }
            Timer::Replicate => self.replicate_round(),
            Timer::Restore => self.restore_step(false),
            Timer::Fence => {
                self.measure_fence();
                vec![Out::Timer {
                    at: self.clock.monotonic_ms() + FENCE_TICK_MS,
                    timer: Timer::Fence,
                }]
            }
        }
    }

    pub fn on_msg(&mut self, from: &str, msg: Msg) -> Vec<Out> {
        match msg {
            Msg::GossipSyn(entries) => {
                let (mut out, revived) = self.merge(&entries);
                out.push(Out::Send {
                    to: from.to_string(),
                    msg: Msg::GossipAck(Arc::new(self.digests())),
                });
                if revived {
                    out.extend(self.refresh_view());
                }
                out
            }
            Msg::GossipAck(entries) => {
                let (mut out, revived) = self.merge(&entries);
                if revived {
                    out.extend(self.refresh_view());
                }
                out
            }
            Msg::Forward { stream, call } => self.on_forward(from, stream, call),
            Msg::Answer { stream, answer, .. } => {
                let fx = self.link.on_answer(self.now(), from, stream, answer);
                self.link_effects(fx)
            }
            Msg::Refund(request) => {
                self.on_refund(request);
                Vec::new()
            }
            Msg::Lease { ask, request } => self.on_lease(from, ask, *request),
            Msg::Leased { ask, answer } => {
                self.on_leased(ask, answer);
                Vec::new()
            }
            Msg::ReturnLease(request) => {
                self.on_return(request);
                Vec::new()
            }
            Msg::Install(request) => {
                self.on_install(request);
                Vec::new()
            }
            Msg::Replicate { batch, request } => {
                self.on_replicate(request);
                vec![Out::Send {
                    to: from.to_string(),
                    msg: Msg::Replicated {
                        to_inc: u64::MAX,
                        batch,
                        ok: true,
                    },
                }]
            }
            Msg::Replicated { batch, ok, .. } => {
                self.on_replicated(batch, ok);
                Vec::new()
            }
            Msg::Restore(request) => self.on_restore(from, request),
            Msg::Restored(answer) => self.on_restored(from, answer),
        }
    }

    /// A peer's process died: its stream broke.
    pub fn peer_reset(&mut self, peer: &str) -> Vec<Out> {
        let fx = self.link.reset(self.now(), peer);
        self.link_effects(fx)
    }

    // ---- the shard actor -------------------------------------------------------------

    fn shard_of(placement: u64) -> usize {
        (xxhash_rust::xxh3::xxh3_64_with_seed(&placement.to_le_bytes(), 0x0053_4841_5244)
            % SHARDS as u64) as usize
    }

    /// The shard actor's `Command::Check` for one charge, at the shard's clamped clock:
    /// the real `ShardCore::check`.
    fn shard_check(&mut self, item: &Charge) -> Outcome {
        let shard = &mut self.shards[Self::shard_of(item.id.placement)];
        let now = shard.clock.now_ms();
        let sequence = &mut self.sequence;
        let (outcomes, _) = shard.core.check(std::slice::from_ref(item), now, |_, _| {
            *sequence += 1;
            *sequence
        });
        outcomes[0]
    }

    /// `Router::decide_forwarded`'s decisions: fenced keys this node may not decide
    /// denied ([`policy::fence_split`]), the rest decided here and re-checked against
    /// the fence; answers in `refs` order.
    fn decide_forwarded_here(&mut self, refs: &[&CheckItem], local: &[usize]) -> Vec<Answer> {
        let (decide, denied) = policy::fence_split(refs, local, &self.me, &self.fence, self.now());
        self.stats.fenced += denied.len() as u64;
        let items: Vec<&CheckItem> = decide.iter().map(|&i| refs[i]).collect();
        let mut decided = self.decide_here(&items);
        self.recheck_fenced(&items, &mut decided);
        let mut answers: Vec<Option<Answer>> = vec![None; refs.len()];
        for (i, denial) in denied {
            answers[i] = Some(denial);
        }
        for (&i, answer) in decide.iter().zip(decided) {
            answers[i] = Some(answer);
        }
        local
            .iter()
            .map(|&i| answers[i].take().expect("every position answered"))
            .collect()
    }

    /// `Router::recheck_fenced`: admissions on fenced keys the fence no longer allows
    /// become denials and are given back here. Whether any did.
    fn recheck_fenced(&mut self, items: &[&CheckItem], answers: &mut [Answer]) -> bool {
        let late = policy::recheck_fenced(
            items.iter().copied(),
            answers,
            &self.me,
            &self.fence,
            self.now(),
        );
        for r in &late.refunds {
            let shard = &mut self.shards[Self::shard_of(r.charge.id.placement)];
            let now = shard.clock.now_ms();
            shard.core.refund(r, now);
        }
        self.stats.fenced += late.denied as u64;
        late.denied > 0
    }

    /// The membership driver's `measure`: every incarnation's heartbeat as this node
    /// knows it, read into the tracker, and the fence published.
    fn measure_fence(&mut self) {
        let now = self.clock.monotonic_ms();
        let readings: Vec<(&str, u64, u64)> = self
            .known
            .iter()
            .flat_map(|(id, gens)| gens.iter().map(move |(g, k)| (&**id, *g, k.heartbeat)))
            .collect();
        self.quorum.heartbeats(readings, now);
        self.publish_fence(now);
    }

    /// The membership driver's `publish_fence`: the fence as of `now` for the view.
    fn publish_fence(&mut self, now: u64) {
        self.fence = self.quorum.observe(&self.view, now);
    }

    /// `Router::decide_here`: each item on its own counter, answered as this node.
    fn decide_here(&mut self, items: &[&CheckItem]) -> Vec<Answer> {
        items
            .iter()
            .map(|item| {
                let charge = item.charge();
                let o = self.shard_check(&charge);
                policy::local_answer(item, &self.me, o.decision, o.sequence, o.at, charge)
            })
            .collect()
    }

    // ---- a client's check (`Checker::check` + `Router::decide`) -------------------------

    pub fn on_client_check(
        &mut self,
        client: u32,
        op: u64,
        key: &str,
        route: &str,
        cost: u64,
    ) -> Vec<Out> {
        if self.restoring() {
            // `Router::decide` waits for the restore.
            self.restore
                .queued
                .push((client, op, key.to_string(), route.to_string(), cost));
            return Vec::new();
        }
        let input = CheckInput {
            descriptors: smallvec::smallvec![DescriptorInput {
                key,
                route,
                tier: None,
                cost: Some(cost as i64),
            }],
        };
        let items = match plan_check(&input, &self.rules, None, &V1) {
            Ok(items) => items,
            Err(e) => {
                return vec![Out::Answer {
                    client,
                    op,
                    failover: false,
                    entry: Entry::Fail {
                        id: op,
                        t: 0,
                        error: format!("InvalidArgument: {e}"),
                    },
                }]
            }
        };
        let checks: Checks = smallvec::smallvec![items];
        let failover = if self.replicating() {
            FailOver::ToSuccessor
        } else {
            FailOver::Off
        };
        let now = self.now();
        let mut flight = Flight::plan(
            checks,
            self.view.clone(),
            &self.me.node_id,
            &self.deny,
            now,
            self.routing,
            failover,
        );
        let fenced = flight.local().any(|item| item.rule.is_fenced());
        if fenced {
            flight.fence(&self.me, &self.fence, now);
        }
        let mut out = self.spend_leases(&mut flight);
        let local: Vec<&CheckItem> = flight.local().collect();
        let mut answers = self.decide_here(&local);
        if fenced {
            self.recheck_fenced(&local, &mut answers);
        }
        flight.answer_here(answers);
        let id = self.next_check;
        self.next_check += 1;
        let n = flight.remote_len();
        let mut fx = Effects::default();
        for (pos, (i, owner)) in flight.remote().enumerate() {
            let step = self
                .link
                .forward(now, owner, flight.item(i), Waiter { check: id, pos });
            fx.send.extend(step.send);
            fx.done.extend(step.done);
        }
        self.pending.insert(
            id,
            Pending {
                client,
                op,
                flight,
                results: (0..n).map(|_| None).collect(),
                waiting: n,
                second: Vec::new(),
                settled: false,
                open: Vec::new(),
            },
        );
        if n == 0 {
            out.extend(self.finish(id));
        } else {
            out.extend(self.link_effects(fx));
        }
        out
    }

    /// Apply what the link did: send its calls, hand answers to their checks, and keep a
    /// timer at its next deadline.
    fn link_effects(&mut self, fx: Effects) -> Vec<Out> {
        let mut out = Vec::new();
        for frame in fx.send {
            out.push(Out::Send {
                to: frame.owner.node_id.clone(),
                msg: Msg::Forward {
                    stream: frame.stream,
                    call: frame.call,
                },
            });
        }
        for (waiter, result) in fx.done {
            let Some(p) = self.pending.get_mut(&waiter.check) else {
                continue;
            };
            // A caller answered already (it gave up at its deadline) takes nothing more.
            if p.results[waiter.pos].is_some() {
                continue;
            }
            p.results[waiter.pos] = Some(result);
            p.waiting -= 1;
            if p.waiting == 0 {
                out.extend(self.finish(waiter.check));
            }
        }
        if let Some(at) = self.link.next_deadline() {
            out.push(Out::Timer {
                at,
                timer: Timer::Link,
            });
        }
        out
    }

    /// The rest of the flight once every owner answered or failed: settle, rescue
    /// (which may wait for successors' answers), the fail-open stand-ins, land, refund,
    /// then the verdict.
    fn finish(&mut self, id: u64) -> Vec<Out> {
        let mut p = self.pending.remove(&id).expect("pending");
        if !p.settled {
            p.settled = true;
            let owners = p.flight.remote_len();
            let results: Vec<_> = p.results[..owners]
                .iter_mut()
                .map(|r| r.take().expect("every result in"))
                .collect();
            let rescues = p.flight.settle(&self.me.node_id, results, &self.deny);
            let fx = self.rescue(id, rescues, &mut p);
            if p.waiting > 0 {
                self.pending.insert(id, p);
                return self.link_effects(fx);
            }
        } else {
            for (k, i, successor) in std::mem::take(&mut p.second) {
                let result = p.results[k].take().expect("every result in");
                if !p.flight.replica_answered(i, successor, result) {
                    self.fall_back(i, &mut p);
                }
            }
        }
        for (i, charge) in std::mem::take(&mut p.open) {
            let o = self.shard_check(&charge);
            p.flight.opened(i, &self.me, charge, o);
        }
        let Pending {
            client, op, flight, ..
        } = p;
        let tally = flight.tally();
        self.repl.failed_over += tally.failed_over;
        self.repl.failover_failed += tally.failover_failed;
        self.stats.fenced += tally.fenced;
        let mut decided = flight.land();
        // refund
        let refunds = policy::refunds(&decided);
        let mut out = Vec::new();
        for r in refunds.here {
            let shard = &mut self.shards[Self::shard_of(r.charge.id.placement)];
            let now = shard.clock.now_ms();
            shard.core.refund(&r, now);
        }
        for (owner, items) in refunds.remote {
            out.push(Out::Send {
                to: owner.node_id.clone(),
                msg: Msg::Refund(calls::refund_request(&items)),
            });
        }
        let v = Verdict::combine(decided.pop().expect("one check"));
        let first = &v.descriptors[0].answer;
        out.push(Out::Answer {
            client,
            op,
            failover: tally.failed_over > 0,
            entry: Entry::Ok {
                id: op,
                t: 0,
                allowed: v.allowed,
                limit: v.limit,
                remaining: first.decision.remaining,
                decider: v.decider.node_id.to_string(),
                generation: v.decider.generation,
                window_id: v.window_id,
                sequence: v.sequence,
                degraded: v.degraded,
                hops: first.hops,
                rule: v.rule.to_string(),
                retry_after_ms: v.retry_after_ms,
                leased: matches!(first.charged, Charged::Lease),
            },
        });
        out
    }

    /// Perform each rescue the flight asked for: a replica here is decided at once, one
    /// at the successor is forwarded (its answer is due in `p.results`), and the rest
    /// get their fallback.
    fn rescue(&mut self, check: u64, rescues: Vec<(usize, Rescue)>, p: &mut Pending) -> Effects {
        let mut fx = Effects::default();
        for (i, rescue) in rescues {
            match rescue {
                Rescue::ReplicaHere(item) => {
                    let now = self.now();
                    if policy::fence_check(&item, &self.fence, now).is_err() {
                        p.flight.fenced(i, &self.me, now.wall);
                        continue;
                    }
                    let charge = item.charge();
                    let o = self.shard_check(&charge);
                    let mut answer = [policy::local_answer(
                        &item,
                        &self.me,
                        o.decision,
                        o.sequence,
                        o.at,
                        charge.clone(),
                    )];
                    if self.recheck_fenced(&[&item], &mut answer) {
                        p.flight.fenced(i, &self.me, answer[0].at);
                        continue;
                    }
                    p.flight.replica_decided_here(i, &self.me, charge, o);
                }
                Rescue::Replica(successor, item) => {
                    let waiter = Waiter {
                        check,
                        pos: p.results.len(),
                    };
                    p.second.push((p.results.len(), i, successor));
                    p.results.push(None);
                    p.waiting += 1;
                    let member = p.flight.member(successor);
                    let step = self.link.forward(self.now(), member, &item, waiter);
                    fx.send.extend(step.send);
                    fx.done.extend(step.done);
                }
                Rescue::Fallback => self.fall_back(i, p),
            }
        }
        fx
    }

    /// Descriptor `i`'s fallback: answered now (fail-closed) or a stand-in charge
    /// decided at the end (fail-open).
    fn fall_back(&mut self, i: usize, p: &mut Pending) {
        if let Some(nodes) = p.flight.fall_back(i, &self.me) {
            let item = p.flight.item(i);
            let rule = self.fallback_rule(item, nodes);
            p.open.push((i, item.under(rule)));
        }
    }

    /// `Router::fallback_rule`: the fail-open stand-in, built once per (rule, ring size).
    fn fallback_rule(&mut self, item: &CheckItem, nodes: u64) -> Arc<Rule> {
        self.fallbacks
            .entry((item.rule.name.to_string(), item.rule.fingerprint, nodes))
            .or_insert_with(|| Arc::new(policy::fallback_rule(&item.rule, nodes)))
            .clone()
    }

    // ---- the peer service --------------------------------------------------------------

    /// `PeerService::forward_batch` + `Router::decide_forwarded`.
    fn on_forward(&mut self, from: &str, stream: u64, call: ForwardCall) -> Vec<Out> {
        let refuse = |code: u32, message: String| ForwardAnswer {
            call: call.call,
            response: None,
            code,
            message,
        };
        let answer = match &call.request {
            None => refuse(3, "request: a call must carry a batch".into()),
            Some(request) if policy::arrived_too_late(request.deadline_ms, self.clock.now_ms()) => {
                self.stats.refused_late += request.items.len() as u64;
                refuse(4, "forwarded batch arrived after its deadline".into())
            }
            Some(request) => {
                // `PeerService::forward_batch`: the owner's one planning path.
                let planned = forwarded::plan_batch(
                    request.items.iter().map(forwarded_input),
                    self.owner_rules(),
                )
                .map_err(|e| e.to_string());
                // `Router::decide_forwarded`: not an owner until restored (the sender
                // fails over to the successor).
                let refused = planned.as_ref().is_ok_and(|items| {
                    let replicas = items.iter().map(|i| i.target.is_replica());
                    flight::owner_refuses(!self.restoring(), replicas)
                });
                match planned {
                    Err(e) => refuse(3, e),
                    Ok(_) if refused => {
                        let status = tonic::Status::from(CheckError::from(ShardError::Restoring));
                        refuse(status.code() as u32, status.message().to_string())
                    }
                    Ok(items) => {
                        let view = self.view.clone();
                        let refs: Vec<&CheckItem> = items.iter().collect();
                        let plan = policy::plan(
                            &refs,
                            &view,
                            &self.me.node_id,
                            &self.deny,
                            self.now(),
                            Origin::Peer,
                            self.routing,
                        );
                        assert!(plan.remote.is_empty() && plan.cached == 0);
                        let answers = self.decide_forwarded_here(&refs, &plan.local);
                        let outcomes = request
                            .items
                            .iter()
                            .zip(answers)
                            .map(|(item, a)| {
                                ringlimit::server::peer::forward_outcome(
                                    &a,
                                    item.rule_hash,
                                    request.compact,
                                )
                            })
                            .collect();
                        ForwardAnswer {
                            call: call.call,
                            response: Some(ForwardResponse {
                                node_id: self.me.node_id.to_string(),
                                generation: self.me.generation,
                                outcomes,
                            }),
                            code: 0,
                            message: String::new(),
                        }
                    }
                }
            }
        };
        vec![Out::Send {
            to: from.to_string(),
            msg: Msg::Answer {
                to_inc: u64::MAX,
                stream,
                answer: Ok(answer),
            },
        }]
    }

    /// `Peer/Refund`: each item planned like a forwarded one (`forwarded::plan_refunds`),
    /// refunded at its time; an invalid call refunds nothing.
    fn on_refund(&mut self, request: RefundRequest) {
        let Ok(refunds) =
            forwarded::plan_refunds(request.items.iter().map(refund_input), self.owner_rules())
        else {
            return;
        };
        for r in refunds {
            let shard = &mut self.shards[Self::shard_of(r.charge.id.placement)];
            let now = shard.clock.now_ms();
            shard.core.refund(&r, now);
        }
    }

    /// What this node plans forwarded items against.
    fn owner_rules(&self) -> OwnerRules<'_> {
        OwnerRules {
            rules: &self.rules,
            envoy: self.rules.envoy(),
            known: &self.inline,
        }
    }

    /// `Peer/Install`: decode, vet against this node's rules and clock
    /// (`handoff::with_rules`), install (merging with what is held).
    fn on_install(&mut self, request: InstallRequest) {
        self.stats.installed += self.install(request);
    }

    /// Vet and install (merge) `request`'s states; returns how many were installed.
    fn install(&mut self, request: InstallRequest) -> u64 {
        let mut installed = 0;
        let joined = request.joined;
        // As `PeerService::install`.
        let leaving = self
            .view
            .member(&request.from_node)
            .is_some_and(|m| m.leaving);
        let from = request.from_node.clone();
        for (item, rule) in self.vet(request) {
            let from_holder =
                leaving || self.view.ring.owner_of_hash(item.id.placement) == Some(&*from);
            let shard = &mut self.shards[Self::shard_of(item.id.placement)];
            let now = shard.clock.now_ms();
            installed += shard
                .core
                .install(vec![(item, rule)], joined, from_holder, now)
                as u64;
        }
        installed
    }

    /// `PeerService::vet_states`: decode the states, keep those a local rule could
    /// have produced by now.
    fn vet(&self, request: InstallRequest) -> Vec<(Exported, Arc<Rule>)> {
        let states: Vec<Exported> = request
            .states
            .into_iter()
            .filter_map(|s| {
                let kind = AlgorithmKind::parse(s.algorithm.as_str())?;
                Some(Exported {
                    id: KeyId {
                        placement: s.placement,
                        disc: s.id,
                    },
                    fingerprint: s.fingerprint,
                    state: KeyState::from_words(kind, &s.words)?,
                })
            })
            .collect();
        handoff::with_rules(states, &self.rules, self.clock.now_ms()).items
    }

    // ---- handoff -----------------------------------------------------------------------

    /// `Handoff::apply`: if the ring moved anything away from this node (production's
    /// `Watcher` says), export it and push it to its new owners.
    fn view_changed(&mut self, step: handoff::ViewStep) -> Vec<Out> {
        let mut out = Vec::new();
        if let Some(view) = &step.hand_on {
            // `Handoff::push_away`.
            let new_owner = handoff::new_owners(view, self.id.clone());
            let mut merged = Vec::new();
            for shard in &mut self.shards {
                let now = shard.clock.now_ms();
                merged.extend(shard.core.export(now, |p| new_owner(p)));
            }
            out.extend(self.push(view, merged));
        }
        let Some(handoff::RingStep {
            view,
            hand_over: Some(earlier),
            ..
        }) = step.ring
        else {
            return out;
        };
        let new_owner = handoff::new_owners(&view, self.id.clone());
        let (mut merged, mut joined) = (Vec::new(), Vec::new());
        for shard in &mut self.shards {
            let now = shard.clock.now_ms();
            let exports = shard.core.export_back(now, &*new_owner, &*earlier);
            merged.extend(exports.merged);
            joined.extend(exports.joined);
        }
        out.extend(self.push(&view, merged));
        out.extend(self.push_as(&view, joined, true));
        out
    }

    /// `Handoff::flush_once`.
    fn flush_deltas(&mut self) -> Vec<Out> {
        let mut deltas = Vec::new();
        let reachable = handoff::reachable(&self.view);
        for shard in &mut self.shards {
            deltas.extend(shard.core.drain_deltas(|to, g| reachable(to, g)));
        }
        if deltas.is_empty() {
            return Vec::new();
        }
        let view = self.view.clone();
        self.push(&view, deltas)
    }

    /// `Handoff::push`: per destination, in chunks of `MAX_INSTALL_STATES`.
    fn push(&mut self, view: &ClusterView, items: Vec<(Arc<str>, Exported)>) -> Vec<Out> {
        self.push_as(view, items, false)
    }

    /// [`Node::push`]; `joined`: keys promoted here, handed back to be joined.
    fn push_as(
        &mut self,
        view: &ClusterView,
        items: Vec<(Arc<str>, Exported)>,
        joined: bool,
    ) -> Vec<Out> {
        let routed = handoff::destinations(view, items);
        self.stats.handoff_lost += routed.gone.iter().map(|(_, n)| *n as u64).sum::<u64>();
        let mut out = Vec::new();
        for (owner, states) in routed.to {
            self.stats.handed_over += states.len() as u64;
            if joined {
                self.stats.handed_back += states.len() as u64;
            }
            for chunk in states.chunks(MAX_INSTALL_STATES) {
                out.push(Out::Send {
                    to: owner.node_id.clone(),
                    msg: Msg::Install(if joined {
                        calls::hand_back_request(&self.id, chunk, &self.inline)
                    } else {
                        calls::install_request(&self.id, chunk, &self.inline)
                    }),
                });
            }
        }
        out
    }

    // ---- membership --------------------------------------------------------------------

    fn own_entry(&self) -> GossipEntry {
        GossipEntry {
            id: self.id.clone(),
            generation: self.generation,
            heartbeat: self.heartbeat,
            addrs: self.addrs,
            leaving: false,
        }
    }

    fn digests(&self) -> Vec<GossipEntry> {
        let mut all = vec![self.own_entry()];
        for (id, gens) in &self.known {
            all.extend(gens.iter().map(|(generation, k)| GossipEntry {
                id: id.clone(),
                generation: *generation,
                heartbeat: k.heartbeat,
                addrs: k.addrs,
                leaving: k.leaving,
            }));
        }
        all
    }

    fn live(&self, k: &Known) -> bool {
        self.clock.monotonic_ms().saturating_sub(k.last_heard) < self.cfg.fd_timeout_ms
    }

    /// Take every newer heartbeat (a heartbeat heard second-hand counts: that is how
    /// chitchat's failure detector hears a node it does not gossip with). Also says
    /// whether the live set may have changed (an incarnation new, revived or leaving);
    /// one dying is noticed at the next round.
    fn merge(&mut self, entries: &[GossipEntry]) -> (Vec<Out>, bool) {
        let now = self.clock.monotonic_ms();
        let fd = self.cfg.fd_timeout_ms;
        let mut new_kvs = 0;
        let mut revived = false;
        for e in entries {
            if *e.id == *self.id {
                continue;
            }
            let found = self
                .known
                .get_mut(&*e.id)
                .and_then(|gens| gens.get_mut(&e.generation));
            match found {
                Some(k) => {
                    if e.heartbeat > k.heartbeat {
                        revived |= now.saturating_sub(k.last_heard) >= fd;
                        k.heartbeat = e.heartbeat;
                        k.last_heard = now;
                    }
                    if e.leaving != k.leaving {
                        k.leaving = e.leaving;
                        new_kvs += 1;
                        revived = true;
                    }
                }
                None => {
                    new_kvs += 1;
                    revived = true;
                    self.known.entry(e.id.clone()).or_default().insert(
                        e.generation,
                        Known {
                            heartbeat: e.heartbeat,
                            last_heard: now,
                            addrs: e.addrs,
                            leaving: e.leaving,
                        },
                    );
                }
            }
        }
        let out = if new_kvs > 0 {
            vec![Out::GossipDelta(new_kvs * GOSSIP_DELTA)]
        } else {
            Vec::new()
        };
        (out, revived)
    }

    /// One gossip round: beat, pick peers (live ones, sometimes a dead one or a seed),
    /// send them this node's digests, re-run failure detection.
    fn gossip_round(&mut self) -> Vec<Out> {
        self.heartbeat += 1;
        // The membership driver's tick: notice a stall, end a hold that is over.
        self.note_stall();
        let now = self.clock.monotonic_ms();
        if self.hold_removals_until.is_some_and(|until| now >= until) {
            self.hold_removals_until = None;
            self.live_key = 0;
        }
        let mut live: BTreeSet<Arc<str>> = BTreeSet::new();
        let mut dead: BTreeSet<Arc<str>> = BTreeSet::new();
        for (id, gens) in &self.known {
            if gens.values().any(|k| self.live(k)) {
                live.insert(id.clone());
            } else {
                dead.insert(id.clone());
            }
        }
        let dead: Vec<Arc<str>> = dead.difference(&live).cloned().collect();
        let mut live: Vec<Arc<str>> = live.into_iter().collect();
        let mut targets: Vec<Arc<str>> = Vec::new();
        while targets.len() < FANOUT && !live.is_empty() {
            let i = self.rng.index(live.len());
            targets.push(live.swap_remove(i));
        }
        let live_n = targets.len() + live.len();
        if !dead.is_empty() && self.rng.chance(dead.len() as f64 / (live_n + 1) as f64) {
            targets.push(dead[self.rng.index(dead.len())].clone());
        }
        let seeds: Vec<Arc<str>> = self
            .cfg
            .seeds
            .iter()
            .filter(|s| ***s != *self.id && !targets.iter().any(|t| **t == ***s))
            .map(|s| Arc::from(s.as_str()))
            .collect();
        if !seeds.is_empty()
            && (live_n < self.cfg.seeds.len()
                || self
                    .rng
                    .chance(self.cfg.seeds.len() as f64 / (live_n + dead.len() + 1) as f64))
        {
            targets.push(seeds[self.rng.index(seeds.len())].clone());
        }
        let digests = Arc::new(self.digests());
        let mut out: Vec<Out> = targets
            .into_iter()
            .map(|to| Out::Send {
                to: to.to_string(),
                msg: Msg::GossipSyn(digests.clone()),
            })
            .collect();
        out.extend(self.refresh_view());
        out.push(Out::Timer {
            at: self.clock.monotonic_ms() + self.cfg.gossip_ms,
            timer: Timer::Gossip,
        });
        out
    }

    /// The membership driver's `note_stall`: a gap of `STALL_MS` since it last ran
    /// means this process was frozen; hold removals for a while.
    fn note_stall(&mut self) {
        let now = self.clock.monotonic_ms();
        if self.cfg.stall_hold && now.saturating_sub(self.last_run) >= STALL_MS {
            self.hold_removals_until = Some(now + STALL_HOLD_MS);
        }
        self.last_run = now;
    }

    /// The membership driver's `publish`: rebuild the view from the live incarnations
    /// (with the node's own `build_view_after`) when the live set changed, keeping
    /// vanished members while removals are held; hand state over if the ring moved.
    fn refresh_view(&mut self) -> Vec<Out> {
        self.note_stall();
        let mut hasher = xxhash_rust::xxh3::Xxh3Default::new();
        for (id, gens) in &self.known {
            for (g, k) in gens.iter().filter(|(_, k)| self.live(k)) {
                hasher.update(id.as_bytes());
                hasher.update(&[0, u8::from(k.leaving)]);
                hasher.update(&g.to_le_bytes());
            }
        }
        let key = hasher.digest() | 1;
        if key == self.live_key {
            return Vec::new();
        }
        self.live_key = key;
        let kvs = |a: &Addrs, leaving: bool| {
            let mut kvs = BTreeMap::new();
            kvs.insert(KEY_GRPC_ADDR.to_string(), a.grpc.to_string());
            kvs.insert(KEY_PEER_ADDR.to_string(), a.peer.to_string());
            if leaving {
                kvs.insert(KEY_LEAVING.to_string(), "true".to_string());
            }
            kvs
        };
        let mut live = vec![LiveNode {
            node_id: self.id.to_string(),
            generation: self.generation,
            gossip_addr: self.addrs.gossip,
            kvs: kvs(&self.addrs, false),
        }];
        for (id, gens) in &self.known {
            for (generation, k) in gens.iter().filter(|(_, k)| self.live(k)) {
                live.push(LiveNode {
                    node_id: id.to_string(),
                    generation: *generation,
                    gossip_addr: k.addrs.gossip,
                    kvs: kvs(&k.addrs, k.leaving),
                });
            }
        }
        let now = self.clock.monotonic_ms();
        if self.hold_removals_until.is_some_and(|until| now < until) {
            for old in &self.view.members {
                if !live.iter().any(|n| n.node_id == old.node_id) {
                    live.push(LiveNode {
                        node_id: old.node_id.clone(),
                        generation: old.generation,
                        gossip_addr: old.gossip_addr,
                        kvs: kvs(
                            &Addrs {
                                gossip: old.gossip_addr,
                                grpc: old.grpc_addr,
                                peer: old.peer_addr,
                            },
                            old.leaving,
                        ),
                    });
                }
            }
        }
        let new = build_view_after(Some(&self.view), live);
        if new == *self.view {
            return Vec::new();
        }
        let old = std::mem::replace(&mut self.view, Arc::new(new));
        let new = self.view.clone();
        self.publish_fence(self.clock.monotonic_ms());
        let step = self.watcher.next(new.clone());
        let mut out = self.successors_changed(&old, &new);
        out.extend(self.view_changed(step));
        out.extend(self.restore_step(true));
        out
    }
}
