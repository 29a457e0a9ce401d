//! The world: simulated time, one event queue, the network, the clients, the ring
//! sampler, and the faults. Single-threaded and driven only by its queue: events are
//! ordered by (time, sequence number), every random choice comes from the run's seed,
//! and every map that is iterated is a `BTreeMap`, so a seed replays byte for byte.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ringlimit::config::rules::RuleSet;

use crate::history::{Entry, MemberView};
use crate::node::{Addrs, Msg, Node, NodeConfig, Out, Timer};
use crate::rng::Rng;
use crate::workload::{Workload, Zipf};

/// Simulated time starts here (Unix ms, a multiple of every window).
pub const T0: u64 = 1_800_000_000_000;
/// The client deadline.
pub const DEADLINE_MS: u64 = 2000;
/// How often the sampler asks every node for its ring.
const SAMPLE_MS: u64 = 200;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Up,
    Paused,
    Down,
}

/// One node id: its current incarnation (if running) and what the world knows of it.
pub struct Slot {
    pub index: usize,
    pub node: Option<Node>,
    pub state: State,
    pub inc: u64,
    /// Events that arrived while the process was stopped, in arrival order.
    deferred: Vec<Ev>,
    /// Clients send to it (the harness's `serving`: set once its ring held every
    /// running node after a start).
    pub serving: bool,
}

#[derive(Debug)]
enum Ev {
    /// Something for a node: to incarnation `inc` (None: whoever runs at that address).
    Node {
        id: String,
        inc: Option<u64>,
        what: NodeEv,
    },
    ClientWake(u32),
    ClientDone {
        client: u32,
        op: u64,
        entry: Entry,
    },
    ClientDeadline {
        client: u32,
        op: u64,
    },
    Sample,
}

#[derive(Debug)]
enum NodeEv {
    Msg {
        from: String,
        from_inc: u64,
        msg: Msg,
    },
    Timer(Timer),
    Check {
        client: u32,
        op: u64,
        key: String,
        route: String,
        cost: u64,
    },
}

struct Scheduled {
    t: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, o: &Self) -> bool {
        (self.t, self.seq) == (o.t, o.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.t, self.seq).cmp(&(o.t, o.seq))
    }
}

/// Network conditions between nodes (clients always reach the node they ask).
#[derive(Default)]
pub struct Net {
    /// Partition side per node id (absent: 0): nodes on different sides do not hear
    /// each other.
    pub side: BTreeMap<String, u8>,
    /// Chance that a datagram is lost (a TCP segment is retransmitted instead: late).
    pub loss: f64,
    /// Extra one-way delay range (ms) on every node-to-node message.
    pub extra: Option<(u64, u64)>,
    /// TCP messages stuck behind a partition, delivered after the heal.
    held: Vec<(String, u64, String, Msg)>,
}

/// Bytes a node sent, per kind.
#[derive(Default, Clone, Copy, Debug)]
pub struct Bytes {
    pub gossip: u64,
    pub peer: u64,
}

struct Client {
    rng: Rng,
    pending: Option<(u64, String)>,
}

pub struct World {
    pub now: u64,
    time: Arc<AtomicU64>,
    seq: u64,
    queue: BinaryHeap<Reverse<Scheduled>>,
    pub rng: Rng,
    pub slots: BTreeMap<String, Slot>,
    pub net: Net,
    pub history: Vec<Entry>,
    rules: Arc<RuleSet>,
    pub cfg: NodeConfig,
    clients: Vec<Client>,
    clients_on: bool,
    workload: Option<(Workload, Zipf)>,
    next_op: u64,
    completed: u64,
    sampling: bool,
    round: u64,
    pub bytes: BTreeMap<String, Bytes>,
    /// Record ring samples and ops (off for the large measurement runs).
    pub record: bool,
    /// Ops answered (in part) by a key's successor: fail-over answers.
    pub failover_ops: BTreeSet<u64>,
}

impl World {
    pub fn new(seed: u64, rules: Arc<RuleSet>, cfg: NodeConfig) -> World {
        World {
            now: T0,
            time: Arc::new(AtomicU64::new(T0)),
            seq: 0,
            queue: BinaryHeap::new(),
            rng: Rng::new(seed),
            slots: BTreeMap::new(),
            net: Net::default(),
            history: Vec::new(),
            rules,
            cfg,
            clients: Vec::new(),
            clients_on: false,
            workload: None,
            next_op: 1,
            completed: 0,
            sampling: false,
            round: 0,
            bytes: BTreeMap::new(),
            record: true,
            failover_ops: BTreeSet::new(),
        }
    }

    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse(Scheduled {
            t: t.max(self.now),
            seq: self.seq,
            ev,
        }));
    }

    pub fn log(&mut self, entry: Entry) {
        if self.record {
            self.history.push(entry);
        }
    }

    /// Run every event due up to `until`, then stand at `until`.
    pub fn run_until(&mut self, until: u64) {
        while let Some(Reverse(next)) = self.queue.peek() {
            if next.t > until {
                break;
            }
            let Reverse(Scheduled { t, ev, .. }) = self.queue.pop().expect("peeked");
            self.set_now(t);
            self.handle(ev);
        }
        self.set_now(until);
    }

    pub fn run_for(&mut self, ms: u64) {
        self.run_until(self.now + ms);
    }

    /// Run until `done` holds (checked every 100 ms, like the harness's polling) or
    /// `timeout` ms pass; returns how long it took.
    pub fn run_while_not(&mut self, timeout: u64, done: impl Fn(&World) -> bool) -> Option<u64> {
        self.poll(100, timeout, done)
    }

    /// [`World::run_while_not`], checking every `every` ms.
    pub fn poll(&mut self, every: u64, timeout: u64, done: impl Fn(&World) -> bool) -> Option<u64> {
        let start = self.now;
        loop {
            if done(self) {
                return Some(self.now - start);
            }
            if self.now - start >= timeout {
                return None;
            }
            self.run_for(every);
        }
    }

    /// Start `id` as the harness does: wait (polling every 50 ms, at most 15 s) until
    /// its ring holds every running node, then let clients send to it.
    pub fn start_serving(&mut self, id: &str) {
        self.start(id);
        let joined = |w: &World| {
            let running = w.running();
            w.node(id).is_some_and(|n| {
                running
                    .iter()
                    .all(|r| n.view.members.iter().any(|m| m.node_id == *r && !m.leaving))
            })
        };
        self.poll(50, 15_000, joined);
        self.serve(id);
    }

    /// Let clients send to `id`.
    pub fn serve(&mut self, id: &str) {
        if let Some(s) = self.slots.get_mut(id) {
            s.serving = true;
        }
    }

    fn set_now(&mut self, t: u64) {
        self.now = t;
        self.time.store(t, Ordering::SeqCst);
    }

    // ---- nodes -------------------------------------------------------------------------

    /// Start (or restart, with a new generation and empty memory) node `id`.
    pub fn start(&mut self, id: &str) {
        let index = self.slots.get(id).map_or(self.slots.len(), |s| s.index);
        let inc = self.slots.get(id).map_or(1, |s| s.inc + 1);
        let generation = self.now * 1_000_000 + inc;
        let addrs = Addrs::of_index(index);
        let node_rng = self.rng.split(index as u64 * 1000 + inc);
        // Each process's failure detector settles on its own timeout: 1.0-1.4 s, around
        // the 1.08-1.31 s measured on loopback (docs/ownership.md).
        let mut cfg = self.cfg.clone();
        cfg.fd_timeout_ms += self.rng.range(0, 400);
        let mut node = Node::new(
            id,
            generation,
            addrs,
            self.time.clone(),
            self.rules.clone(),
            cfg,
            node_rng,
        );
        let outs = node.boot(self.now);
        self.slots.insert(
            id.to_string(),
            Slot {
                index,
                node: Some(node),
                state: State::Up,
                inc,
                deferred: Vec::new(),
                serving: false,
            },
        );
        self.log(Entry::Spawn {
            t: self.now,
            node: id.to_string(),
            generation,
            ip: addrs.grpc.ip().to_string(),
            grpc: addrs.grpc.to_string(),
            pid: 0,
        });
        self.apply(id, inc, outs);
    }

    /// kill -9: the process and its memory are gone; its peers' streams to it reset;
    /// clients waiting on it get a transport error.
    pub fn kill(&mut self, id: &str) -> u64 {
        let slot = self.slots.get_mut(id).expect("known node");
        let node = slot.node.take().expect("running");
        slot.state = State::Down;
        slot.deferred.clear();
        self.log(Entry::Exit {
            t: self.now,
            node: id.to_string(),
            generation: node.generation,
            how: "kill -9".into(),
        });
        for c in 0..self.clients.len() {
            if let Some((op, node_id)) = &self.clients[c].pending {
                if node_id == id {
                    let entry = Entry::Info {
                        id: *op,
                        t: 0,
                        error: "Unavailable: connection reset".into(),
                    };
                    let op = *op;
                    self.at(
                        self.now + 1,
                        Ev::ClientDone {
                            client: c as u32,
                            op,
                            entry,
                        },
                    );
                }
            }
        }
        let others: Vec<String> = self.running();
        for other in others {
            let outs = match self.slots.get_mut(&other) {
                Some(Slot {
                    node: Some(n),
                    state: State::Up,
                    ..
                }) => n.peer_reset(id),
                _ => continue,
            };
            let inc = self.slots[&other].inc;
            self.apply(&other, inc, outs);
        }
        node.generation
    }

    pub fn pause(&mut self, id: &str) {
        self.slots.get_mut(id).expect("known").state = State::Paused;
    }

    /// SIGCONT: everything that arrived meanwhile is handled now, in arrival order.
    pub fn resume(&mut self, id: &str) {
        let slot = self.slots.get_mut(id).expect("known");
        slot.state = State::Up;
        let deferred = std::mem::take(&mut slot.deferred);
        for ev in deferred {
            self.at(self.now, ev);
        }
    }

    pub fn set_offset(&mut self, id: &str, offset_ms: i64) {
        if let Some(n) = self.slots.get(id).and_then(|s| s.node.as_ref()) {
            n.clock.set_offset(offset_ms);
        }
        self.log(Entry::Clock {
            t: self.now,
            node: id.to_string(),
            offset_ms,
        });
    }

    /// Put `ids` on their own side of a partition.
    pub fn partition(&mut self, ids: &[String]) {
        for id in ids {
            self.net.side.insert(id.clone(), 1);
        }
    }

    /// Remove every partition; TCP segments held behind it arrive now.
    pub fn heal(&mut self) {
        self.net.side.clear();
        for (from, from_inc, to, msg) in std::mem::take(&mut self.net.held) {
            let d = self.rng.range(1, 50);
            self.deliver(from, from_inc, to, msg, d);
        }
    }

    /// Ids of running processes (up or paused), by id.
    pub fn running(&self) -> Vec<String> {
        self.slots
            .iter()
            .filter(|(_, s)| s.state != State::Down)
            .map(|(id, _)| id.clone())
            .collect()
    }

    pub fn node(&self, id: &str) -> Option<&Node> {
        self.slots.get(id).and_then(|s| s.node.as_ref())
    }

    /// The harness's convergence test: every up node's ring is the set of running ids,
    /// at their current generations.
    pub fn converged(&self) -> bool {
        let expected: BTreeSet<String> = self.running().into_iter().collect();
        let gens: BTreeMap<&str, u64> = self
            .slots
            .iter()
            .filter_map(|(id, s)| s.node.as_ref().map(|n| (id.as_str(), n.generation)))
            .collect();
        self.slots
            .values()
            .filter(|s| s.state == State::Up)
            .filter_map(|s| s.node.as_ref())
            .all(|n| {
                let ring: BTreeSet<String> = n
                    .view
                    .members
                    .iter()
                    .filter(|m| !m.leaving)
                    .map(|m| m.node_id.clone())
                    .collect();
                ring == expected
                    && n.view
                        .members
                        .iter()
                        .all(|m| gens.get(m.node_id.as_str()) == Some(&m.generation))
            })
    }

    // ---- events ------------------------------------------------------------------------

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Node { id, inc, what } => self.at_node(id, inc, what),
            Ev::ClientWake(c) => self.client_wake(c),
            Ev::ClientDone { client, op, entry } => self.client_done(client, op, entry),
            Ev::ClientDeadline { client, op } => {
                let entry = Entry::Info {
                    id: op,
                    t: 0,
                    error: "client deadline".into(),
                };
                self.client_done(client, op, entry);
            }
            Ev::Sample => self.sample(),
        }
    }

    fn at_node(&mut self, id: String, inc: Option<u64>, what: NodeEv) {
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        if slot.state == State::Down || inc.is_some_and(|i| i != slot.inc) {
            // A forward (or a restore) to a dead process: its kernel refuses the
            // connection, and the sender's stream driver ends (its call fails).
            if slot.state == State::Down {
                let refused = match what {
                    NodeEv::Msg {
                        from,
                        from_inc,
                        msg: Msg::Forward { stream, .. },
                    } => Some((
                        from,
                        Msg::Answer {
                            to_inc: from_inc,
                            stream,
                            answer: Err("connection refused".into()),
                        },
                    )),
                    NodeEv::Msg {
                        from,
                        msg: Msg::Restore(_),
                        ..
                    } => Some((from, Msg::Restored(Err("connection refused".into())))),
                    NodeEv::Msg {
                        from,
                        from_inc,
                        msg: Msg::Replicate { batch, .. },
                    } => Some((
                        from,
                        Msg::Replicated {
                            to_inc: from_inc,
                            batch,
                            ok: false,
                        },
                    )),
                    _ => None,
                };
                if let Some((from, msg)) = refused {
                    let d = self.rng.range(1, 3);
                    self.deliver(id, u64::MAX, from, msg, d);
                }
            }
            return;
        }
        if slot.state == State::Paused {
            slot.deferred.push(Ev::Node { id, inc, what });
            return;
        }
        let inc = slot.inc;
        let node = slot.node.as_mut().expect("up");
        let view_before = node.view.clone();
        let outs = match what {
            NodeEv::Timer(t) => node.on_timer(t),
            NodeEv::Check {
                client,
                op,
                key,
                route,
                cost,
            } => node.on_client_check(client, op, &key, &route, cost),
            NodeEv::Msg {
                from,
                from_inc,
                msg,
            } => {
                let mut outs = node.on_msg(&from, msg);
                for o in &mut outs {
                    if let Out::Send {
                        msg: Msg::Answer { to_inc, .. } | Msg::Replicated { to_inc, .. },
                        ..
                    } = o
                    {
                        *to_inc = from_inc;
                    }
                }
                outs
            }
        };
        let ledger = node.take_ledger();
        let changed = !Arc::ptr_eq(&view_before, &node.view);
        if changed && self.sampling {
            // Every view a node publishes is sampled (in the current round): the
            // process suite's 200 ms sampler can miss a short one, such as the view a
            // resumed node builds from its stale failure detector before it hears any
            // gossip.
            let entry = self.ring_entry(&id);
            self.log(entry);
        }
        let now = self.now;
        for mut line in ledger {
            if let Entry::Lent { t, .. } | Entry::Returned { t, .. } = &mut line {
                *t = now;
            }
            self.log(line);
        }
        self.apply(&id, inc, outs);
    }

    fn apply(&mut self, id: &str, inc: u64, outs: Vec<Out>) {
        for out in outs {
            match out {
                Out::Send { to, msg } => {
                    let b = msg.bytes() as u64;
                    let bytes = self.bytes.entry(id.to_string()).or_default();
                    if msg.tcp() {
                        bytes.peer += b;
                    } else {
                        bytes.gossip += b;
                    }
                    let d = self.rng.range(1, 3);
                    self.deliver(id.to_string(), inc, to, msg, d);
                }
                Out::GossipDelta(b) => {
                    self.bytes.entry(id.to_string()).or_default().gossip += b as u64;
                }
                Out::Timer { at, timer } => self.at(
                    at,
                    Ev::Node {
                        id: id.to_string(),
                        inc: Some(inc),
                        what: NodeEv::Timer(timer),
                    },
                ),
                Out::Answer {
                    client,
                    op,
                    entry,
                    failover,
                } => {
                    if failover {
                        self.failover_ops.insert(op);
                    }
                    let d = self.rng.range(0, 2);
                    self.at(self.now + d, Ev::ClientDone { client, op, entry });
                }
            }
        }
    }

    /// Replication chunk `batch` from `from` to `to` was not delivered: its sender's
    /// call fails at the peer link's timeout.
    fn call_failed(&mut self, from: String, from_inc: u64, to: String, batch: u64) {
        self.at(
            self.now + crate::link::LinkConfig::default().timeout_ms,
            Ev::Node {
                id: from,
                inc: Some(from_inc),
                what: NodeEv::Msg {
                    from: to,
                    from_inc: u64::MAX,
                    msg: Msg::Replicated {
                        to_inc: from_inc,
                        batch,
                        ok: false,
                    },
                },
            },
        );
    }

    /// Put a message on the simulated network with base delay `d`.
    fn deliver(&mut self, from: String, from_inc: u64, to: String, msg: Msg, d: u64) {
        let side = |id: &str| self.net.side.get(id).copied().unwrap_or(0);
        // A replication call that cannot arrive within the peer link's timeout fails
        // (the replicator sends its keys again next round): one held behind a
        // partition, or one whose segment is lost.
        let call = match &msg {
            Msg::Replicate { batch, .. } => Some(*batch),
            _ => None,
        };
        if side(&from) != side(&to) {
            match call {
                Some(batch) => self.call_failed(from, from_inc, to, batch),
                None if msg.tcp() => self.net.held.push((from, from_inc, to, msg)),
                None => {}
            }
            return;
        }
        let mut delay = d;
        if let Some((lo, hi)) = self.net.extra {
            delay += self.rng.range(lo, hi);
        }
        if self.net.loss > 0.0 && self.rng.chance(self.net.loss) {
            if let Some(batch) = call {
                self.call_failed(from, from_inc, to, batch);
                return;
            }
            if !msg.tcp() {
                return;
            }
            // TCP retransmits after its timeout.
            delay += self.rng.range(200, 600);
        }
        let inc = match &msg {
            Msg::Answer { to_inc, .. } | Msg::Replicated { to_inc, .. } => Some(*to_inc),
            _ => None,
        };
        self.at(
            self.now + delay,
            Ev::Node {
                id: to,
                inc,
                what: NodeEv::Msg {
                    from,
                    from_inc,
                    msg,
                },
            },
        );
    }

    // ---- clients -----------------------------------------------------------------------

    /// Start `n` clients running `workload`.
    pub fn start_clients(&mut self, n: u32, workload: Workload) {
        let zipf = Zipf::new(workload.zipf_keys, 1.1);
        self.workload = Some((workload, zipf));
        self.clients_on = true;
        for c in 0..n {
            let rng = self.rng.split(0xC11E_0000 + u64::from(c));
            self.clients.push(Client { rng, pending: None });
            let d = self.rng.range(0, 50);
            self.at(self.now + d, Ev::ClientWake(c));
        }
    }

    /// Clients start no new op; ops in flight still complete or time out.
    pub fn stop_clients(&mut self) {
        self.clients_on = false;
    }

    /// Ops completed so far (ok, fail or info).
    pub fn ops_completed(&self) -> u64 {
        self.completed
    }

    pub fn clients_idle(&self) -> bool {
        self.clients.iter().all(|c| c.pending.is_none())
    }

    fn client_wake(&mut self, c: u32) {
        if !self.clients_on {
            return;
        }
        let targets: Vec<String> = self
            .slots
            .iter()
            .filter(|(_, s)| s.state != State::Down && s.serving)
            .map(|(id, _)| id.clone())
            .collect();
        let (workload, zipf) = self.workload.as_ref().expect("started");
        let client = &mut self.clients[c as usize];
        if targets.is_empty() {
            let d = client.rng.range(30, 130);
            self.at(self.now + d, Ev::ClientWake(c));
            return;
        }
        let node = targets[client.rng.index(targets.len())].clone();
        let (route, key, cost) = workload.draw(&mut client.rng, zipf);
        let op = self.next_op;
        self.next_op += 1;
        client.pending = Some((op, node.clone()));
        let addr = Addrs::of_index(self.slots[&node].index).grpc.to_string();
        self.log(Entry::Invoke {
            id: op,
            client: c,
            t: self.now,
            key: key.clone(),
            route: route.clone(),
            cost,
            node: node.clone(),
            addr,
        });
        let d = self.rng.range(0, 2);
        self.at(
            self.now + d,
            Ev::Node {
                id: node,
                inc: None,
                what: NodeEv::Check {
                    client: c,
                    op,
                    key,
                    route,
                    cost,
                },
            },
        );
        self.at(self.now + DEADLINE_MS, Ev::ClientDeadline { client: c, op });
    }

    fn client_done(&mut self, c: u32, op: u64, mut entry: Entry) {
        let client = &mut self.clients[c as usize];
        if client.pending.as_ref().map(|p| p.0) != Some(op) {
            return;
        }
        client.pending = None;
        self.completed += 1;
        match &mut entry {
            Entry::Ok { t, .. } | Entry::Fail { t, .. } | Entry::Info { t, .. } => *t = self.now,
            _ => {}
        }
        self.log(entry);
        let (workload, _) = self.workload.as_ref().expect("started");
        let pause = workload.pause(&mut self.clients[c as usize].rng, self.now);
        self.at(self.now + pause, Ev::ClientWake(c));
    }

    // ---- ring samples ------------------------------------------------------------------

    pub fn start_sampler(&mut self) {
        self.sampling = true;
        self.at(self.now + SAMPLE_MS, Ev::Sample);
    }

    pub fn stop_sampler(&mut self) {
        self.sampling = false;
    }

    fn sample(&mut self) {
        if !self.sampling {
            return;
        }
        self.round += 1;
        let ids: Vec<String> = self
            .slots
            .iter()
            .filter(|(_, s)| s.node.is_some())
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            let entry = self.ring_entry(&id);
            self.log(entry);
        }
        self.at(self.now + SAMPLE_MS, Ev::Sample);
    }

    /// What `Status` on `id` says now (a paused node does not answer).
    fn ring_entry(&self, id: &str) -> Entry {
        let s = &self.slots[id];
        let n = s.node.as_ref().expect("running");
        let id = id.to_string();
        {
            if s.state == State::Up {
                Entry::Ring {
                    t: self.now,
                    round: self.round,
                    node: id,
                    generation: n.generation,
                    ok: true,
                    members: n
                        .view
                        .members
                        .iter()
                        .map(|m| MemberView {
                            id: m.node_id.clone(),
                            generation: m.generation,
                            leaving: m.leaving,
                        })
                        .collect(),
                    digest: n.view.ring.digest(),
                    error: String::new(),
                }
            } else {
                Entry::Ring {
                    t: self.now,
                    round: self.round,
                    node: id,
                    generation: n.generation,
                    ok: false,
                    members: Vec::new(),
                    digest: 0,
                    error: "status: deadline exceeded".into(),
                }
            }
        }
    }
}
