//! Real `ringlimit serve` processes, each on its own loopback address, plus what the
//! nemesis needs to hurt them (signals, iptables) and a guard that undoes everything.
//! Spawning, signals, status and metrics come from the process harness shared with
//! `tests/cluster_process.rs` (`tests/common/process.rs`); this file adds node
//! identities, fault states, iptables and the history.

#[path = "../common/process.rs"]
pub mod process;

use std::collections::{BTreeSet, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Scraped counters of one node incarnation: (resets, restarts, fail_open).
pub type Scraped = (u64, u64, u64);

use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::history::{now_ms, Entry, History, MemberView};
use process::{iptables, iptables_available, Process, Serve, Signal};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeState {
    /// Running, reachable.
    Up,
    /// SIGSTOPped.
    Paused,
    /// Cut off from the other nodes by iptables (clients still reach it).
    Partitioned,
    /// SIGTERM sent: leaving gracefully.
    Leaving,
    /// Killed or exited.
    Dead,
}

/// One incarnation of a node process.
pub struct NodeProc {
    pub id: String,
    pub ip: Ipv4Addr,
    /// The process; its ready line has the generation and addresses.
    pub process: Process,
    pub state: NodeState,
    /// Clients send checks to it (set once it has joined the cluster).
    pub serving: bool,
}

struct Inner {
    nodes: Vec<NodeProc>,
    next_host: u8,
    next_id: u32,
    /// iptables argument lists (after `-I`/`-D`) currently installed.
    rules: Vec<Vec<String>>,
}

/// The cluster under test. `cleanup()` (also run by [`Guard`] on drop, even on panic)
/// kills every process it started and removes every iptables rule it added.
pub struct Harness {
    pub dir: PathBuf,
    pub rules_file: PathBuf,
    pub extra_args: Vec<String>,
    pub ip_prefix: [u8; 3],
    pub history: Arc<History>,
    pub iptables_ok: bool,
    /// libfaketime, when the clock-offset nemesis can run: every node is started with
    /// it preloaded and its own offset file (`<dir>/<id>.faketime`, "+0s" at first).
    pub faketime: Option<PathBuf>,
    inner: Mutex<Inner>,
    channels: Mutex<HashMap<SocketAddr, Channel>>,
    /// Last scraped metrics per (id, generation): resets, restarts, fail_open.
    pub scraped: Mutex<HashMap<(String, u64), Scraped>>,
}

pub struct Guard(pub Arc<Harness>);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.cleanup();
    }
}

/// Debian's libfaketime (package `faketime`, installed by `.ci/deps`), the
/// multi-threaded variant; `None` if it is not installed.
pub fn faketime_library() -> Option<PathBuf> {
    [
        "/usr/lib/x86_64-linux-gnu/faketime",
        "/usr/lib/aarch64-linux-gnu/faketime",
        "/usr/lib/faketime",
    ]
    .iter()
    .map(|dir| PathBuf::from(dir).join("libfaketimeMT.so.1"))
    .find(|p| p.exists())
}

impl Harness {
    pub fn new(
        run_dir: PathBuf,
        rules_toml: &str,
        extra_args: &[&str],
        ip_prefix: [u8; 3],
        history: Arc<History>,
        clock_faults: bool,
    ) -> Arc<Harness> {
        std::fs::create_dir_all(&run_dir).expect("run dir");
        let rules_file = run_dir.join("rules.toml");
        std::fs::write(&rules_file, rules_toml).expect("write rules");
        Arc::new(Harness {
            dir: run_dir,
            rules_file,
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            ip_prefix,
            history,
            iptables_ok: iptables_available(),
            faketime: if clock_faults {
                faketime_library()
            } else {
                None
            },
            inner: Mutex::new(Inner {
                nodes: Vec::new(),
                next_host: 10,
                next_id: 1,
                rules: Vec::new(),
            }),
            channels: Mutex::new(HashMap::new()),
            scraped: Mutex::new(HashMap::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A fresh node id with a fresh loopback address.
    pub fn new_identity(&self) -> (String, Ipv4Addr) {
        let mut inner = self.lock();
        let id = format!("n{}", inner.next_id);
        inner.next_id += 1;
        let host = inner.next_host;
        inner.next_host = inner.next_host.checked_add(1).expect("too many nodes");
        let [a, b, c] = self.ip_prefix;
        let _ = a;
        (id, Ipv4Addr::new(127, b, c, host))
    }

    /// Start a process for `id` on `ip`, seeded with up to two running nodes. Blocking:
    /// call through `spawn_blocking`.
    pub fn spawn_blocking(self: &Arc<Self>, id: &str, ip: Ipv4Addr) -> Result<(), String> {
        let seeds: Vec<SocketAddr> = {
            let inner = self.lock();
            inner
                .nodes
                .iter()
                .filter(|n| matches!(n.state, NodeState::Up))
                .map(|n| n.process.ready.gossip)
                .take(2)
                .collect()
        };
        let incarnation = {
            let inner = self.lock();
            inner.nodes.iter().filter(|n| n.id == id).count()
        };
        let mut env = self.faketime_env(id)?;
        // The owners' lease ledger (a line per grant and return), for the S4 checker.
        let log = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
        env.push((
            "RUST_LOG".into(),
            format!("{log},{}", crate::ledger::log_directive()),
        ));
        let process = Process::spawn(&Serve {
            id,
            ip: ip.into(),
            rules: &self.rules_file,
            seeds: &seeds,
            extra_args: &self.extra_args,
            dir: &self.dir,
            log_name: &format!("{id}.{incarnation}"),
            env: &env,
        })?;
        let (pid, generation, grpc) = (process.pid, process.ready.generation, process.ready.grpc);
        self.history.record(&Entry::Spawn {
            t: now_ms(),
            node: id.to_string(),
            generation,
            ip: ip.to_string(),
            grpc: grpc.to_string(),
            pid,
        });
        self.lock().nodes.push(NodeProc {
            id: id.to_string(),
            ip,
            process,
            state: NodeState::Up,
            serving: false,
        });
        Ok(())
    }

    fn offset_file(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.faketime"))
    }

    /// The environment that puts node `id` under libfaketime with its own offset file
    /// (created at "+0s"; a restarted node keeps the offset its id has).
    fn faketime_env(&self, id: &str) -> Result<Vec<(String, String)>, String> {
        let Some(lib) = &self.faketime else {
            return Ok(Vec::new());
        };
        let file = self.offset_file(id);
        if !file.exists() {
            std::fs::write(&file, "+0s\n").map_err(|e| format!("write {}: {e}", file.display()))?;
        }
        Ok(vec![
            ("LD_PRELOAD".into(), lib.display().to_string()),
            ("FAKETIME_TIMESTAMP_FILE".into(), file.display().to_string()),
            // Re-read the offset file at most once a second (the checker allows for it:
            // checker::clocks::LAG_MS).
            ("FAKETIME_CACHE_DURATION".into(), "1".into()),
            // Only the wall clock moves: timers, gossip failure detection and tokio
            // keep real monotonic time, as NTP stepping the wall clock would.
            ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
        ])
    }

    /// Set node `id`'s wall clock to real time + `offset_s` seconds: the `clock` line
    /// first, then the offset file (replaced atomically), which the node picks up
    /// within its cache time.
    pub fn set_clock_offset(&self, id: &str, offset_s: i64) -> Result<(), String> {
        self.history.record(&Entry::Clock {
            t: now_ms(),
            node: id.to_string(),
            offset_ms: offset_s * 1000,
        });
        let file = self.offset_file(id);
        let tmp = file.with_extension("faketime.tmp");
        std::fs::write(&tmp, format!("{offset_s:+}s\n")).map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, &file).map_err(|e| e.to_string())
    }

    /// Start a node and wait until it has joined (its ring holds every running node);
    /// then clients start sending to it.
    pub async fn start_node(self: &Arc<Self>, id: &str, ip: Ipv4Addr) -> Result<(), String> {
        let me = self.clone();
        let id2 = id.to_string();
        tokio::task::spawn_blocking(move || me.spawn_blocking(&id2, ip))
            .await
            .map_err(|e| e.to_string())??;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            if let Some((gen, expected)) = self
                .with_node(id, |n| n.process.ready.generation)
                .map(|g| (g, self.expected_ring()))
            {
                if let Ok(st) = self.status(id).await {
                    let ring: BTreeSet<String> =
                        st.1.iter()
                            .filter(|m| !m.leaving)
                            .map(|m| m.id.clone())
                            .collect();
                    if st.0 == gen && expected.iter().all(|e| ring.contains(e)) {
                        break;
                    }
                }
            }
            if tokio::time::Instant::now() > deadline {
                eprintln!("[harness] WARNING: {id} did not see every running node within 15 s; serving anyway");
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut inner = self.lock();
        if let Some(n) = inner.nodes.iter_mut().rev().find(|n| n.id == id) {
            n.serving = true;
        }
        Ok(())
    }

    pub fn with_node<T>(&self, id: &str, f: impl FnOnce(&mut NodeProc) -> T) -> Option<T> {
        let mut inner = self.lock();
        inner
            .nodes
            .iter_mut()
            .rev()
            .find(|n| n.id == id && n.state != NodeState::Dead)
            .map(f)
    }

    /// Node ids that should be on the ring: running and not leaving.
    pub fn expected_ring(&self) -> BTreeSet<String> {
        self.lock()
            .nodes
            .iter()
            .filter(|n| {
                matches!(
                    n.state,
                    NodeState::Up | NodeState::Paused | NodeState::Partitioned
                )
            })
            .map(|n| n.id.clone())
            .collect()
    }

    /// (id, state) of every running node.
    pub fn running(&self) -> Vec<(String, NodeState)> {
        self.lock()
            .nodes
            .iter()
            .filter(|n| n.state != NodeState::Dead)
            .map(|n| (n.id.clone(), n.state))
            .collect()
    }

    /// Where clients may send checks: (id, grpc address).
    pub fn targets(&self) -> Vec<(String, SocketAddr)> {
        self.lock()
            .nodes
            .iter()
            .filter(|n| {
                n.serving
                    && matches!(
                        n.state,
                        NodeState::Up | NodeState::Paused | NodeState::Partitioned
                    )
            })
            .map(|n| (n.id.clone(), n.process.ready.grpc))
            .collect()
    }

    pub fn channel(&self, addr: SocketAddr) -> Channel {
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        channels
            .entry(addr)
            .or_insert_with(|| process::lazy_channel(addr))
            .clone()
    }

    /// A node's view: (generation, members, digest).
    pub async fn status(&self, id: &str) -> Result<(u64, Vec<MemberView>, u64), String> {
        let addr = self
            .with_node(id, |n| n.process.ready.peer)
            .ok_or("not running")?;
        let status = process::ring_status(self.channel(addr), Duration::from_millis(400)).await?;
        let members = status
            .members
            .into_iter()
            .map(|m| MemberView {
                id: m.id,
                generation: m.generation,
                leaving: m.leaving,
            })
            .collect();
        Ok((status.generation, members, status.digest))
    }

    /// Wait until every running, unpaused node answers `/readyz` with 200 (see
    /// `process::wait_ready`).
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), String> {
        let addrs: Vec<SocketAddr> = self
            .lock()
            .nodes
            .iter()
            .filter(|n| n.state == NodeState::Up)
            .map(|n| n.process.ready.metrics)
            .collect();
        process::wait_ready(&addrs, timeout).await
    }

    /// Wait until every running, unpaused node reports the same digest, with exactly
    /// the expected ring members at their current generations.
    pub async fn wait_converged(&self, timeout: Duration) -> Result<Duration, String> {
        let start = tokio::time::Instant::now();
        let mut last = String::new();
        loop {
            let expected = self.expected_ring();
            let gens: HashMap<String, u64> = self
                .lock()
                .nodes
                .iter()
                .filter(|n| n.state != NodeState::Dead)
                .map(|n| (n.id.clone(), n.process.ready.generation))
                .collect();
            let asked: Vec<String> = self
                .running()
                .into_iter()
                .filter(|(_, s)| matches!(s, NodeState::Up | NodeState::Partitioned))
                .map(|(id, _)| id)
                .collect();
            let mut digests = BTreeSet::new();
            let mut ok = true;
            for id in &asked {
                match self.status(id).await {
                    Ok((_, members, digest)) => {
                        let ring: BTreeSet<String> = members
                            .iter()
                            .filter(|m| !m.leaving)
                            .map(|m| m.id.clone())
                            .collect();
                        let gens_ok = members
                            .iter()
                            .filter(|m| !m.leaving)
                            .all(|m| gens.get(&m.id) == Some(&m.generation));
                        if ring != expected || !gens_ok {
                            ok = false;
                            last = format!("{id} sees {ring:?} (expected {expected:?}, generations ok: {gens_ok})");
                        }
                        digests.insert(digest);
                    }
                    Err(e) => {
                        ok = false;
                        last = format!("{id}: {e}");
                    }
                }
            }
            if ok && digests.len() == 1 {
                return Ok(start.elapsed());
            }
            if start.elapsed() > timeout {
                return Err(format!("no convergence within {timeout:?}: {last}"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// kill -9 (the process is reaped; state Dead). The `exit` line's time is when
    /// SIGKILL was sent: no later than the death, which S3-replicated measures from.
    pub fn kill9(&self, id: &str) -> Option<u64> {
        let t = now_ms();
        let mut inner = self.lock();
        let node = inner
            .nodes
            .iter_mut()
            .rev()
            .find(|n| n.id == id && n.state != NodeState::Dead)?;
        node.process.kill();
        node.state = NodeState::Dead;
        node.serving = false;
        let generation = node.process.ready.generation;
        drop(inner);
        self.history.record(&Entry::Exit {
            t,
            node: id.to_string(),
            generation,
            how: "kill -9".into(),
        });
        Some(generation)
    }

    /// The address of the most recent incarnation of `id` (running or not).
    pub fn last_ip(&self, id: &str) -> Option<Ipv4Addr> {
        self.lock()
            .nodes
            .iter()
            .rev()
            .find(|n| n.id == id)
            .map(|n| n.ip)
    }

    pub fn set_state(&self, id: &str, state: NodeState) {
        self.with_node(id, |n| n.state = state);
    }

    pub fn pid(&self, id: &str) -> Option<u32> {
        self.with_node(id, |n| n.process.pid)
    }

    /// SIGTERM and wait (at most `timeout`) for a graceful exit; kill -9 after that.
    pub async fn leave(&self, id: &str, timeout: Duration) -> Result<Duration, String> {
        let pid = self.pid(id).ok_or("not running")?;
        self.with_node(id, |n| {
            n.state = NodeState::Leaving;
            n.serving = false;
        });
        process::signal(pid, Signal::Term).await?;
        let start = tokio::time::Instant::now();
        loop {
            let exited = self
                .with_node(id, |n| n.process.try_exit().is_some())
                .unwrap_or(true);
            if exited {
                let generation = self.with_node(id, |n| {
                    n.state = NodeState::Dead;
                    n.process.ready.generation
                });
                self.history.record(&Entry::Exit {
                    t: now_ms(),
                    node: id.to_string(),
                    generation: generation.unwrap_or(0),
                    how: "graceful leave".into(),
                });
                return Ok(start.elapsed());
            }
            if start.elapsed() > timeout {
                self.kill9(id);
                return Err(format!(
                    "{id} did not exit within {timeout:?} after SIGTERM; killed"
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Cut `id` off from every other running node (both directions). Err: iptables
    /// failed (the rules added so far are removed again).
    pub fn partition(&self, id: &str) -> Result<usize, String> {
        let (victim, others): (Ipv4Addr, Vec<Ipv4Addr>) = {
            let inner = self.lock();
            let victim = inner
                .nodes
                .iter()
                .rev()
                .find(|n| n.id == id && n.state != NodeState::Dead)
                .ok_or("not running")?
                .ip;
            let others = inner
                .nodes
                .iter()
                .filter(|n| n.state != NodeState::Dead && n.ip != victim)
                .map(|n| n.ip)
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            (victim, others)
        };
        let mut added = 0;
        for other in others {
            for (s, d) in [(victim, other), (other, victim)] {
                let spec: Vec<String> = vec![
                    "INPUT".into(),
                    "-s".into(),
                    s.to_string(),
                    "-d".into(),
                    d.to_string(),
                    "-j".into(),
                    "DROP".into(),
                ];
                let mut args = vec!["-I".to_string()];
                args.extend(spec.iter().cloned());
                if let Err(e) = iptables(&args) {
                    self.heal_partitions();
                    return Err(e);
                }
                self.lock().rules.push(spec);
                added += 1;
            }
        }
        Ok(added)
    }

    /// Remove every iptables rule this harness added.
    pub fn heal_partitions(&self) {
        let rules = std::mem::take(&mut self.lock().rules);
        for spec in rules {
            let mut args = vec!["-D".to_string()];
            args.extend(spec.iter().cloned());
            if let Err(e) = iptables(&args) {
                eprintln!("[harness] WARNING: could not remove iptables rule {spec:?}: {e}");
            }
        }
    }

    /// Kill every process, remove every rule. Idempotent.
    pub fn cleanup(&self) {
        self.heal_partitions();
        let mut inner = self.lock();
        for node in inner.nodes.iter_mut() {
            // SIGKILL also ends a SIGSTOPped process; a no-op for one already reaped.
            node.process.kill();
            node.state = NodeState::Dead;
        }
    }

    /// Scrape one node's counters and record them.
    pub async fn scrape(&self, id: &str) -> Option<(u64, u64, u64)> {
        let (addr, generation) = self.with_node(id, |n| {
            (n.process.ready.metrics, n.process.ready.generation)
        })?;
        let metrics = process::scrape(addr, Duration::from_secs(1)).await?;
        let sum = |name: &str, label: Option<&str>| metrics.sum(name, label) as u64;
        let values = (
            sum("ringlimit_ownership_resets_total", None),
            sum("ringlimit_member_restarts_total", None),
            sum("ringlimit_degraded_total", Some("reason=\"fail_open\"")),
        );
        self.history.record(&Entry::Metrics {
            t: now_ms(),
            node: id.to_string(),
            generation,
            resets: values.0,
            restarts: values.1,
            fail_open: values.2,
        });
        self.scraped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((id.to_string(), generation), values);
        Some(values)
    }

    /// The lease ledger of every incarnation's log (`ledger.rs`), as history entries.
    pub fn ledger(&self) -> Vec<Entry> {
        self.lock()
            .nodes
            .iter()
            .flat_map(|n| crate::ledger::read(&n.process.log, &n.id, n.process.ready.generation))
            .collect()
    }

    /// Log paths of every incarnation (for failure messages).
    pub fn logs(&self) -> Vec<PathBuf> {
        self.lock()
            .nodes
            .iter()
            .map(|n| n.process.log.clone())
            .collect()
    }
}

/// Every ~200 ms: every running node's members and digest, into the history.
pub fn spawn_sampler(h: Arc<Harness>, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut round = 0u64;
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            round += 1;
            let ids: Vec<(String, u64)> = h
                .running()
                .into_iter()
                .filter_map(|(id, _)| {
                    h.with_node(&id, |n| (n.id.clone(), n.process.ready.generation))
                })
                .collect();
            let futures = ids.into_iter().map(|(id, generation)| {
                let h = h.clone();
                async move {
                    let t0 = now_ms();
                    let res = h.status(&id).await;
                    let entry = match res {
                        Ok((g, members, digest)) => Entry::Ring {
                            t: t0,
                            round,
                            node: id,
                            generation: g,
                            ok: true,
                            members,
                            digest,
                            error: String::new(),
                        },
                        Err(e) => Entry::Ring {
                            t: t0,
                            round,
                            node: id,
                            generation,
                            ok: false,
                            members: Vec::new(),
                            digest: 0,
                            error: e,
                        },
                    };
                    h.history.record(&entry);
                }
            });
            futures_util::future::join_all(futures).await;
        }
    })
}
