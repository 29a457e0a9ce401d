//! The cluster harness shared by `tests/cluster_process.rs` and
//! `tests/fencing_process.rs`: a cluster of `ringlimit serve` processes
//! (`common/process.rs`) in a temp dir of its own, started one after the other (the
//! first is every other's seed) until all of them see each other with equal rings and
//! answer `/readyz`; then signalled, crashed, restarted and asked for their rings.
//!
//! Included with `#[path]` beside `common/process.rs`, which the including target
//! declares as `mod process`.

// Each target uses a different subset (fencing_process: no restarts, no data dirs),
// so whatever one target leaves unused would otherwise be a dead-code error under
// clippy -D warnings.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ringlimit::proto::rate_limiter_client::RateLimiterClient;
use tonic::transport::Channel;

use crate::process::{self, lazy_channel, ring_status, tail, Process, Serve, Signal};

/// How long a cluster may take to converge (and its nodes to be ready).
pub const CONVERGE_TIMEOUT: Duration = Duration::from_secs(15);

/// How the nodes of a [`Cluster`] start.
pub struct Setup<'a> {
    /// The rule file's text.
    pub rules: &'a str,
    /// The arguments every node starts with.
    pub args: &'a [&'a str],
    /// Each node keeps `--data-dir <dir>/<id>.data` (counter snapshots) across
    /// restarts.
    pub data_dirs: bool,
    /// The address of each node, in the order of the ids started; empty: 127.0.0.1
    /// for every node.
    pub ips: &'a [IpAddr],
    /// The temp dir's name prefix.
    pub prefix: &'a str,
}

/// A cluster of node processes. Dropping it kills every process still running, so a
/// failing test never leaves nodes behind; when a test fails, the temp dir is kept and
/// the log paths (and their last lines) are printed.
pub struct Cluster {
    dir: Option<tempfile::TempDir>,
    rules: PathBuf,
    extra_args: Vec<String>,
    data_dirs: bool,
    pub nodes: Vec<Process>,
    /// Each node's address, by id.
    ips: Vec<(String, IpAddr)>,
    /// Restarts so far (each restarted process logs to a file of its own).
    restarts: usize,
}

impl Cluster {
    /// Start `ids.len()` nodes as `setup` says (the first is every other node's seed)
    /// and wait until every node sees all of them with equal rings and is ready.
    pub async fn start(ids: &[&str], setup: &Setup<'_>) -> Cluster {
        let dir = tempfile::Builder::new()
            .prefix(setup.prefix)
            .tempdir()
            .expect("temp dir");
        let rules = dir.path().join("rules.toml");
        std::fs::write(&rules, setup.rules).expect("write rules");
        let ips = ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let ip = setup
                    .ips
                    .get(i)
                    .copied()
                    .unwrap_or(Ipv4Addr::LOCALHOST.into());
                (id.to_string(), ip)
            })
            .collect();
        let mut cluster = Cluster {
            dir: Some(dir),
            rules,
            extra_args: setup.args.iter().map(|s| s.to_string()).collect(),
            data_dirs: setup.data_dirs,
            nodes: Vec::new(),
            ips,
            restarts: 0,
        };
        for id in ids {
            let seeds: Vec<SocketAddr> = cluster
                .nodes
                .first()
                .map(|n| n.ready.gossip)
                .into_iter()
                .collect();
            let node = cluster.spawn(id, &seeds, id);
            cluster.nodes.push(node);
        }
        let started = Instant::now();
        cluster.wait_converged(ids).await;
        let ops: Vec<SocketAddr> = cluster.nodes.iter().map(|n| n.ready.metrics).collect();
        process::wait_ready(&ops, CONVERGE_TIMEOUT)
            .await
            .unwrap_or_else(|message| panic!("{message}"));
        eprintln!(
            "[harness] {} nodes converged {:?} after the last ready line (logs in {})",
            ids.len(),
            started.elapsed(),
            cluster.dir().display()
        );
        cluster
    }

    /// Spawn node `id` with `seeds`, logging to `<dir>/<log_name>.log`.
    fn spawn(&self, id: &str, seeds: &[SocketAddr], log_name: &str) -> Process {
        let args = self.args_of(id);
        Process::spawn(&Serve {
            id,
            ip: self.ip(id),
            rules: &self.rules,
            seeds,
            extra_args: &args,
            dir: self.dir(),
            log_name,
            env: &[],
        })
        .unwrap_or_else(|message| panic!("{message}"))
    }

    pub fn dir(&self) -> &Path {
        self.dir.as_ref().expect("dir kept until drop").path()
    }

    /// Node `id`'s data dir (when the cluster keeps them).
    pub fn data_dir(&self, id: &str) -> PathBuf {
        self.dir().join(format!("{id}.data"))
    }

    /// The arguments node `id` starts with: the cluster's, and its data dir.
    fn args_of(&self, id: &str) -> Vec<String> {
        let mut args = self.extra_args.clone();
        if self.data_dirs {
            args.push("--data-dir".into());
            args.push(self.data_dir(id).display().to_string());
        }
        args
    }

    /// Node `id`'s address.
    pub fn ip(&self, id: &str) -> IpAddr {
        self.ips
            .iter()
            .find(|(i, _)| i == id)
            .map(|(_, ip)| *ip)
            .unwrap_or_else(|| panic!("no node {id}"))
    }

    pub fn node(&self, id: &str) -> &Process {
        self.nodes
            .iter()
            .find(|n| n.id == id)
            .unwrap_or_else(|| panic!("no node {id}"))
    }

    pub fn node_mut(&mut self, id: &str) -> &mut Process {
        self.nodes
            .iter_mut()
            .find(|n| n.id == id)
            .unwrap_or_else(|| panic!("no node {id}"))
    }

    /// Send `sig` to node `id`; returns once the kernel shows its effect (STOP: every
    /// thread stopped; CONT: running again).
    pub async fn signal(&self, id: &str, sig: Signal) {
        let node = self.node(id);
        node.signal(sig)
            .await
            .unwrap_or_else(|e| panic!("SIG{sig:?} to {id} (pid {}): {e}", node.pid));
    }

    /// Start node `id` again (same id, empty memory, new ports), seeded with a live
    /// node's gossip address, as a supervisor restarting a crashed process would.
    pub fn restart(&mut self, id: &str) {
        let seeds: Vec<SocketAddr> = self
            .nodes
            .iter_mut()
            .filter(|n| n.id != id)
            .find_map(|n| n.try_exit().is_none().then_some(n))
            .map(|n| n.ready.gossip)
            .into_iter()
            .collect();
        let restarts = self.restarts;
        self.restarts += 1;
        let node = self.spawn(id, &seeds, &format!("{id}.restarted{restarts}"));
        let slot = self
            .nodes
            .iter()
            .position(|n| n.id == id)
            .expect("known node");
        self.nodes[slot] = node;
    }

    /// kill -9 node `id` and reap it.
    pub fn crash(&mut self, id: &str) {
        let status = self.node_mut(id).kill();
        eprintln!("[harness] {id} killed with SIGKILL: {status}");
    }

    /// Wait up to `timeout` for node `id` to exit; returns its exit status.
    pub async fn wait_exit(&mut self, id: &str, timeout: Duration) -> std::process::ExitStatus {
        self.node_mut(id)
            .wait_exit(timeout)
            .await
            .unwrap_or_else(|message| panic!("{message}"))
    }

    /// Poll every listed node's `Peer/Status` until each lists exactly `ids` as live
    /// (non-leaving) members and all report the same ring digest.
    pub async fn wait_converged(&self, ids: &[&str]) {
        let want: BTreeSet<String> = ids.iter().map(|s| s.to_string()).collect();
        let started = Instant::now();
        loop {
            let last = match self.ring_views(ids).await {
                Ok(views) => {
                    let digests: BTreeSet<u64> = views.iter().map(|(_, d, _)| *d).collect();
                    let all_match = views.iter().all(|(_, _, members)| *members == want);
                    if all_match && digests.len() == 1 {
                        return;
                    }
                    format!("{views:?}")
                }
                Err(error) => error,
            };
            assert!(
                started.elapsed() < CONVERGE_TIMEOUT,
                "cluster did not converge on {want:?} within {CONVERGE_TIMEOUT:?}; last views \
                 (node, digest, live members): {last}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// (node, ring digest, live members) as each of `ids` reports it.
    pub async fn ring_views(
        &self,
        ids: &[&str],
    ) -> Result<Vec<(String, u64, BTreeSet<String>)>, String> {
        let mut views = Vec::new();
        for id in ids {
            let channel = lazy_channel(self.node(id).ready.peer);
            let status = ring_status(channel, Duration::from_secs(2))
                .await
                .map_err(|e| format!("{id}: status: {e}"))?;
            views.push((id.to_string(), status.digest, status.live()));
        }
        Ok(views)
    }

    pub async fn client(&self, id: &str) -> RateLimiterClient<Channel> {
        RateLimiterClient::connect(format!("http://{}", self.node(id).ready.grpc))
            .await
            .unwrap_or_else(|e| panic!("connect to {id}: {e}"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let failed = std::thread::panicking();
        for node in &mut self.nodes {
            // SIGKILL also ends a SIGSTOPped process; a no-op for one already reaped.
            node.kill();
        }
        if failed {
            if let Some(dir) = self.dir.take() {
                let path = dir.keep();
                eprintln!(
                    "[harness] test failed; node logs kept in {}",
                    path.display()
                );
                for node in &self.nodes {
                    eprintln!(
                        "[harness] ---- {} log: {} (last lines; stdout in {}) ----\n{}",
                        node.id,
                        node.log.display(),
                        node.stdout_log.display(),
                        tail(&node.log, 25)
                    );
                    eprintln!(
                        "[harness] ---- {} stdout: {} (last lines) ----\n{}",
                        node.id,
                        node.stdout_log.display(),
                        tail(&node.stdout_log, 25)
                    );
                }
            }
        }
    }
}
