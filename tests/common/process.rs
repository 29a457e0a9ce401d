//! The process harness shared by `tests/cluster_process.rs` and `tests/jepsen-like`:
//! spawn a real `ringlimit serve`, read its ready line, keep its stderr and stdout in
//! log files, signal it and wait until the kernel shows the signal's effect, ask a node
//! for its ring (`Peer/Status`) and scrape its `/metrics`.
//!
//! Faults are only as good as their timing: a check sent "after SIGSTOP" proves nothing
//! if the process was still running when it arrived. So every helper that changes a
//! process's state returns once that state is observable (`/proc/PID/task/*/stat`,
//! `waitpid`), never after a sleep.
//!
//! Included with `#[path]` by each target rather than through `common/mod.rs`, so the
//! in-process targets (grpc, cluster) do not compile it.

// Each target uses a different subset (cluster_process: stdout capture, single metric
// values; jepsen-like: summed labelled counters, pid-based signals), so whatever one
// target leaves unused would otherwise be a dead-code error under clippy -D warnings.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ringlimit::proto::peer::peer_client::PeerClient;
use ringlimit::proto::peer::StatusRequest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::{Channel, Endpoint};

/// The binary under test, built by cargo for this test target.
pub const BIN: &str = env!("CARGO_BIN_EXE_ringlimit");
/// How long a node may take from spawn to its ready line.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long the kernel may take to stop or continue a process after the signal.
pub const SIGNAL_EFFECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What one `ringlimit serve` should be started with.
pub struct Serve<'a> {
    pub id: &'a str,
    /// Address every listener binds (port 0 each) and outbound sockets use.
    pub ip: IpAddr,
    pub rules: &'a Path,
    pub seeds: &'a [SocketAddr],
    pub extra_args: &'a [String],
    /// Logs go to `<dir>/<log_name>.log` (stderr) and `<dir>/<log_name>.stdout.log`.
    pub dir: &'a Path,
    pub log_name: &'a str,
    /// Extra environment variables (the chaos harness preloads libfaketime).
    pub env: &'a [(String, String)],
}

/// The fields of `ringlimit ready node_id=ID generation=G grpc=A gossip=A metrics=A peer=A
/// http=A` (`metrics` and `http` are the same ops port; `http` is not read here).
#[derive(Clone, Copy, Debug)]
pub struct Ready {
    pub generation: u64,
    pub grpc: SocketAddr,
    pub gossip: SocketAddr,
    pub metrics: SocketAddr,
    /// The peer service (the cluster face), where `Peer/Status` is answered.
    pub peer: SocketAddr,
}

/// One running (or exited) node process. Dropping it kills and reaps the process, so
/// a failing test never leaves nodes behind.
pub struct Process {
    pub id: String,
    pub pid: u32,
    pub ready: Ready,
    /// stderr (the node's logs).
    pub log: PathBuf,
    /// Everything the node printed on stdout.
    pub stdout_log: PathBuf,
    child: Child,
    /// The thread copying stdout to `stdout_log` (ends when the process exits).
    reader: Option<std::thread::JoinHandle<()>>,
    /// Set once the process has been reaped.
    exit: Option<ExitStatus>,
}

impl Process {
    /// Spawn `ringlimit serve` and wait (at most [`READY_TIMEOUT`]) for its ready line.
    /// Blocking. On failure the process is killed and the error carries its log tails.
    pub fn spawn(serve: &Serve) -> Result<Process, String> {
        let id = serve.id;
        let log = serve.dir.join(format!("{}.log", serve.log_name));
        let stdout_log = serve.dir.join(format!("{}.stdout.log", serve.log_name));
        let stderr = std::fs::File::create(&log).map_err(|e| format!("create log: {e}"))?;
        let mut copy =
            std::fs::File::create(&stdout_log).map_err(|e| format!("create stdout log: {e}"))?;
        let ip = serve.ip;
        // Every harness node shares the test cluster key (the node refuses to join a
        // cluster without one).
        let secret = serve.dir.join("cluster.secret");
        if !secret.exists() {
            std::fs::write(&secret, ringlimit::node::config::TEST_CLUSTER_SECRET)
                .map_err(|e| format!("write cluster secret: {e}"))?;
        }
        let mut cmd = Command::new(BIN);
        cmd.arg("serve")
            .args(["--node-id", id])
            .args(["--listen", &SocketAddr::new(ip, 0).to_string()])
            .args(["--http-listen", &SocketAddr::new(ip, 0).to_string()])
            .args(["--gossip-listen", &SocketAddr::new(ip, 0).to_string()])
            .args(["--peer-listen", &SocketAddr::new(ip, 0).to_string()])
            .arg("--rules")
            .arg(serve.rules)
            .arg("--cluster-secret-file")
            .arg(&secret)
            .args(serve.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr));
        for seed in serve.seeds {
            cmd.args(["--seed", &seed.to_string()]);
        }
        cmd.envs(serve.env.iter().map(|(k, v)| (k, v)));
        if std::env::var_os("RUST_LOG").is_none() && !serve.env.iter().any(|(k, _)| k == "RUST_LOG")
        {
            cmd.env("RUST_LOG", "info");
        }
        let mut child = cmd.spawn().map_err(|e| format!("spawn {BIN}: {e}"))?;
        let pid = child.id();
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        // Every stdout line goes to the stdout log; the ready line is also handed over.
        // Lines other than the ready line break the stdout contract, which
        // `serve_prints_only_the_ready_line_on_stdout` checks; everything else only
        // needs the ready line, so tolerates them.
        let reader = std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = writeln!(copy, "{line}");
                if line.starts_with("ringlimit ready ") {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(line);
                    }
                }
            }
        });
        let ready = rx
            .recv_timeout(READY_TIMEOUT)
            .map_err(|e| format!("no ready line within {READY_TIMEOUT:?} ({e})"))
            .and_then(|line| parse_ready(&line, id));
        let ready = match ready {
            Ok(ready) => ready,
            Err(message) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "node {id}: {message}; log: {}\n{}\nstdout: {}\n{}",
                    log.display(),
                    tail(&log, 30),
                    stdout_log.display(),
                    tail(&stdout_log, 10)
                ));
            }
        };
        eprintln!(
            "[harness] {id} pid={pid} generation={} grpc={} gossip={} metrics={} log={}",
            ready.generation,
            ready.grpc,
            ready.gossip,
            ready.metrics,
            log.display()
        );
        Ok(Process {
            id: id.to_string(),
            pid,
            ready,
            log,
            stdout_log,
            child,
            reader: Some(reader),
            exit: None,
        })
    }

    /// Send `sig` and wait until its effect is observable (see [`signal`]).
    pub async fn signal(&self, sig: Signal) -> Result<(), String> {
        if self.exit.is_some() {
            return Err(format!("{}: already exited", self.id));
        }
        signal(self.pid, sig).await
    }

    /// SIGKILL (also ends a stopped process) and reap: when this returns the process
    /// is gone and its sockets are closed. Idempotent.
    pub fn kill(&mut self) -> ExitStatus {
        if let Some(status) = self.exit {
            return status;
        }
        let _ = self.child.kill();
        let status = self.child.wait().expect("wait for a killed node");
        self.exit = Some(status);
        status
    }

    /// The exit status if the process has exited (and reaps it); never blocks.
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() {
            self.exit = self.child.try_wait().expect("try_wait");
        }
        self.exit
    }

    /// Wait (at most `timeout`) for the process to exit on its own.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus, String> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.try_exit() {
                return Ok(status);
            }
            if started.elapsed() > timeout {
                return Err(format!(
                    "{} did not exit within {timeout:?}; log: {}",
                    self.id,
                    self.log.display()
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Everything the exited process printed on stdout (waits for the copying thread,
    /// which ends with the process).
    pub fn stdout(&mut self) -> String {
        assert!(self.exit.is_some(), "{}: stdout read before exit", self.id);
        if let Some(reader) = self.reader.take() {
            reader.join().expect("stdout reader");
        }
        std::fs::read_to_string(&self.stdout_log).expect("stdout log")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The signals the tests send, each with the state that shows it took effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// Stop: returns once every thread is in state `T`.
    Stop,
    /// Continue: returns once no thread is in state `T`.
    Cont,
    /// Graceful leave: its effect is the exit, see [`Process::wait_exit`].
    Term,
}

impl Signal {
    fn name(self) -> &'static str {
        match self {
            Signal::Stop => "STOP",
            Signal::Cont => "CONT",
            Signal::Term => "TERM",
        }
    }
}

/// Send `sig` to `pid` with `kill(1)`; for STOP and CONT, then wait (at most
/// [`SIGNAL_EFFECT_TIMEOUT`]) until `/proc` shows every thread stopped or none stopped.
/// `kill(2)` returns before the target is stopped: the target stops when each of its
/// threads next handles signals, which on a loaded machine can be after a test's
/// next request has been answered.
///
/// `pid` must be an unreaped child, so it cannot have been reused.
pub async fn signal(pid: u32, sig: Signal) -> Result<(), String> {
    let status = Command::new("kill")
        .arg(format!("-{}", sig.name()))
        .arg(pid.to_string())
        .status()
        .map_err(|e| format!("run kill: {e}"))?;
    if !status.success() {
        return Err(format!("kill -{} {pid} failed: {status}", sig.name()));
    }
    let stopped = match sig {
        Signal::Stop => true,
        Signal::Cont => false,
        Signal::Term => return Ok(()),
    };
    let started = Instant::now();
    loop {
        // A worker thread that ended (tokio retires idle blocking threads) shows `Z` or
        // `X` until the kernel has torn it down, which a stopped process delays: only
        // the leader's state says whether the process exited.
        let leader = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| stat_state(&stat));
        if matches!(leader, None | Some('Z' | 'X')) {
            return Err(format!(
                "pid {pid} exited before SIG{} took effect",
                sig.name()
            ));
        }
        let states = thread_states(pid).map_err(|e| format!("/proc/{pid}/task: {e}"))?;
        let states: Vec<char> = states
            .into_iter()
            .filter(|s| !matches!(s, 'Z' | 'X'))
            .collect();
        if states.iter().all(|s| (*s == 'T') == stopped) {
            return Ok(());
        }
        if started.elapsed() > SIGNAL_EFFECT_TIMEOUT {
            return Err(format!(
                "pid {pid}: thread states {states:?} {SIGNAL_EFFECT_TIMEOUT:?} after SIG{}",
                sig.name()
            ));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The scheduler state (`R`, `S`, `D`, `T`, `Z`, …) of every thread of `pid`. A group
/// stop reaches each thread separately, so the leader's `/proc/PID/stat` alone can
/// show `T` while a worker thread still answers requests.
pub fn thread_states(pid: u32) -> std::io::Result<Vec<char>> {
    let mut states = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        // A thread that exits between the listing and the read is simply gone.
        let Ok(stat) = std::fs::read_to_string(task?.path().join("stat")) else {
            continue;
        };
        if let Some(state) = stat_state(&stat) {
            states.push(state);
        }
    }
    Ok(states)
}

/// The state field of a `/proc/.../stat` line: the first field after the command
/// name, which is parenthesised and may itself contain spaces and `)`, hence the last
/// `)`.
pub fn stat_state(stat: &str) -> Option<char> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().next()?.chars().next()
}

/// The ready line's fields; `Err` if a field is missing or names another node.
pub fn parse_ready(line: &str, id: &str) -> Result<Ready, String> {
    let field = |name: &str| -> Result<&str, String> {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .ok_or_else(|| format!("ready line lacks {name}=: {line:?}"))
    };
    if field("node_id")? != id {
        return Err(format!("ready line names another node: {line:?}"));
    }
    let addr = |name: &str| -> Result<SocketAddr, String> {
        field(name)?
            .parse()
            .map_err(|e| format!("{name} in {line:?}: {e}"))
    };
    Ok(Ready {
        generation: field("generation")?
            .parse()
            .map_err(|e| format!("generation in {line:?}: {e}"))?,
        grpc: addr("grpc")?,
        gossip: addr("gossip")?,
        metrics: addr("metrics")?,
        peer: addr("peer")?,
    })
}

/// The last `lines` lines of a log file (empty if unreadable), for failure messages.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A channel that connects on first use (connect timeout 500 ms, no Nagle).
pub fn lazy_channel(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_timeout(Duration::from_millis(500))
        .tcp_nodelay(true)
        .connect_lazy()
}

/// One ring member as a node's `Peer/Status` reports it.
#[derive(Clone, Debug)]
pub struct Member {
    pub id: String,
    pub generation: u64,
    pub leaving: bool,
}

/// A node's own generation and its view of the ring.
#[derive(Clone, Debug)]
pub struct RingStatus {
    pub generation: u64,
    pub members: Vec<Member>,
    pub digest: u64,
}

impl RingStatus {
    /// Ids of the members that are not leaving.
    pub fn live(&self) -> std::collections::BTreeSet<String> {
        self.members
            .iter()
            .filter(|m| !m.leaving)
            .map(|m| m.id.clone())
            .collect()
    }
}

/// Ask a node's peer service for its ring over `channel`, within `timeout`, signed with
/// the test cluster key as a member would.
pub async fn ring_status(channel: Channel, timeout: Duration) -> Result<RingStatus, String> {
    let keyring =
        ringlimit::keyring::Keyring::from_text(ringlimit::node::config::TEST_CLUSTER_SECRET)
            .expect("a valid secret");
    let mut client = PeerClient::new(ringlimit::cluster::link::Signed::new(
        channel,
        Some(keyring),
        "test-harness".into(),
    ));
    let answer = tokio::time::timeout(timeout, client.status(StatusRequest {}))
        .await
        .map_err(|_| "status timed out".to_string())?
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    Ok(RingStatus {
        generation: answer.generation,
        members: answer
            .members
            .into_iter()
            .map(|m| Member {
                id: m.node_id,
                generation: m.generation,
                leaving: m.leaving,
            })
            .collect(),
        digest: answer.ring_digest,
    })
}

/// A node's `/metrics` text (Prometheus exposition format).
pub struct Metrics(pub String);

impl Metrics {
    /// The samples of series `name` (with any labels) whose line contains `label`.
    fn samples<'a>(
        &'a self,
        name: &'a str,
        label: Option<&'a str>,
    ) -> impl Iterator<Item = f64> + 'a {
        self.0
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter(move |l| {
                l.starts_with(name)
                    && matches!(l.as_bytes().get(name.len()), Some(b' ') | Some(b'{'))
                    && label.is_none_or(|lb| l.contains(lb))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
    }

    /// The first sample of `name` (the value of an unlabelled counter).
    pub fn value(&self, name: &str) -> Option<f64> {
        self.samples(name, None).next()
    }

    /// The sum of `name` over every label set whose line contains `label` (all if None).
    pub fn sum(&self, name: &str, label: Option<&str>) -> f64 {
        self.samples(name, label).sum()
    }
}

/// GET `path` from `addr` (raw HTTP/1.0) within `timeout`: the whole response.
async fn http_get(addr: SocketAddr, path: &str, timeout: Duration) -> Option<Vec<u8>> {
    let get = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(
                format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await?;
        let mut buf = Vec::new();
        stream.read_to_end(&mut buf).await?;
        std::io::Result::Ok(buf)
    };
    tokio::time::timeout(timeout, get).await.ok()?.ok()
}

/// Whether the node whose ops port is `addr` answers `/readyz` with 200 within `timeout`
/// (joined, its keys' replicas restored, its rules current).
pub async fn is_ready(addr: SocketAddr, timeout: Duration) -> bool {
    http_get(addr, "/readyz", timeout).await.is_some_and(|buf| {
        buf.split(|&b| b == b'\n')
            .next()
            .is_some_and(|status| status.windows(5).any(|w| w == b" 200 "))
    })
}

/// Wait (at most `timeout`) until every ops port of `addrs` answers `/readyz` with 200:
/// what a deployment's readiness probe waits for before sending traffic. A node that
/// starts with seeds refuses forwarded checks until it has restored its keys' replicas,
/// and its peers answer those degraded meanwhile.
pub async fn wait_ready(addrs: &[SocketAddr], timeout: Duration) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + timeout;
    for &addr in addrs {
        while !is_ready(addr, Duration::from_secs(1)).await {
            if tokio::time::Instant::now() >= deadline {
                return Err(format!("{addr}: /readyz not 200 within {timeout:?}"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(())
}

/// GET `/metrics` (raw HTTP/1.0) within `timeout`.
pub async fn scrape(addr: SocketAddr, timeout: Duration) -> Option<Metrics> {
    let text = String::from_utf8_lossy(&http_get(addr, "/metrics", timeout).await?).to_string();
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or(text);
    Some(Metrics(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_follows_the_last_paren_of_the_command_name() {
        let stat = "4242 (tokio-rt (w) 1) T 1 4242 4242 0 -1 4194624 163 0 0 0";
        assert_eq!(stat_state(stat), Some('T'));
        assert_eq!(stat_state("1 (ringlimit) S 0 1"), Some('S'));
        assert_eq!(stat_state("garbage"), None);
    }

    #[test]
    fn a_ready_line_for_another_node_is_refused() {
        let line = "ringlimit ready node_id=a generation=7 grpc=127.0.0.1:1 peer=127.0.0.1:4 \
                    gossip=127.0.0.1:2 metrics=127.0.0.1:3";
        let ready = parse_ready(line, "a").unwrap();
        assert_eq!((ready.generation, ready.grpc.port()), (7, 1));
        assert!(parse_ready(line, "b").is_err());
        assert!(parse_ready("ringlimit ready node_id=a", "a").is_err());
    }
}

/// Run `iptables -w ARGS`; Err: its stderr.
pub fn iptables(args: &[String]) -> Result<(), String> {
    let out = Command::new("iptables")
        .arg("-w")
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// Whether iptables works here (root, binary present): probes with a rule on a
/// reserved address and removes it again.
pub fn iptables_available() -> bool {
    let spec: Vec<String> = [
        "INPUT",
        "-s",
        "127.254.254.253",
        "-d",
        "127.254.254.254",
        "-j",
        "DROP",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut add = vec!["-I".to_string()];
    add.extend(spec.iter().cloned());
    if iptables(&add).is_err() {
        return false;
    }
    let mut del = vec!["-D".to_string()];
    del.extend(spec);
    iptables(&del).is_ok()
}

/// iptables rules that cut one address off from others, both directions, on INPUT (the
/// chaos nemesis's partition): every node binds an address of its own, so a rule names
/// exactly one pair of nodes. Dropping the value removes the rules it added.
#[derive(Debug, Default)]
pub struct Cut {
    rules: Vec<Vec<String>>,
}

impl Cut {
    /// Cut `victim` off from each of `others`. Err: iptables failed (the rules added so
    /// far are removed again).
    pub fn apart(victim: IpAddr, others: &[IpAddr]) -> Result<Cut, String> {
        let mut cut = Cut::default();
        for other in others {
            for (s, d) in [(victim, *other), (*other, victim)] {
                let spec: Vec<String> = [
                    "INPUT",
                    "-s",
                    &s.to_string(),
                    "-d",
                    &d.to_string(),
                    "-j",
                    "DROP",
                ]
                .iter()
                .map(|a| a.to_string())
                .collect();
                let mut args = vec!["-I".to_string()];
                args.extend(spec.iter().cloned());
                iptables(&args)?;
                cut.rules.push(spec);
            }
        }
        Ok(cut)
    }

    /// Remove every rule of this cut now.
    pub fn heal(&mut self) {
        for spec in std::mem::take(&mut self.rules) {
            let mut args = vec!["-D".to_string()];
            args.extend(spec);
            if let Err(e) = iptables(&args) {
                eprintln!("[harness] WARNING: could not remove iptables rule: {e}");
            }
        }
    }
}

impl Drop for Cut {
    fn drop(&mut self) {
        self.heal();
    }
}
