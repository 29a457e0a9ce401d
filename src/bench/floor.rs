//! `ringlimit bench --protocol floor`: the true floor of a unary gRPC call (issue 25,
//! point 0). A bare tonic server answering only health (`floor_server`, a child process
//! of this binary: same tonic, hyper and runtime settings as the node) is driven by the
//! same load generator as one node's health check, native `Check` and Envoy RLS, in
//! alternating rounds of one run, each system's CPU per call read from /proc for its
//! own process. Between them, the bare server with one piece of the node's public face
//! at a time, and with all of them, prices each piece.
//!
//! With h2load on the PATH (Debian's nghttp2-client) each round also drives the bare
//! server's health check, the node's and the node's `Check` with h2load (c =
//! `--concurrency`, one stream per connection, one thread): a second, independent load
//! generator. Without it that part is skipped with a message; nothing is installed.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use prost::Message;

use super::args::BenchArgs;
use super::drive::{drive, Target};
use super::floor_server::Layer;
use super::keys::Keys;
use super::nodes;
use super::procfs::cpu_seconds;
use super::report::{median, RunResult};

const HEALTH: &str = "/grpc.health.v1.Health/Check";
const CHECK: &str = "/ringlimit.v1.RateLimiter/Check";

/// A floor server process started by the bench.
struct FloorServer {
    name: &'static str,
    child: Child,
    addr: String,
}

impl FloorServer {
    /// Starts `bench-floor-server` with `layers` and the node's `--threads`, if given.
    fn start(name: &'static str, layers: &[Layer], threads: Option<&str>) -> anyhow::Result<Self> {
        let mut command = Command::new(std::env::current_exe()?);
        command.arg("bench-floor-server");
        if !layers.is_empty() {
            let names: Vec<&str> = layers.iter().map(|l| l.name()).collect();
            command.arg("--layers").arg(names.join(","));
        }
        if let Some(threads) = threads {
            command.args(["--threads", threads]);
        }
        let mut child = command
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the floor server")?;
        let stdout = child.stdout.take().context("floor server stdout")?;
        let line = std::io::BufReader::new(stdout)
            .lines()
            .next()
            .context("floor server exited before it was ready")??;
        let addr = line
            .strip_prefix("floor ready grpc=")
            .with_context(|| format!("unexpected ready line {line:?}"))?
            .to_string();
        Ok(Self { name, child, addr })
    }
}

impl Drop for FloorServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The node's `--threads` among `--node-arg`s (`--threads=N` or `--threads N`): the
/// floor servers get the same.
fn threads_arg(node_args: &[String]) -> Option<&str> {
    node_args.iter().enumerate().find_map(|(i, arg)| {
        arg.strip_prefix("--threads=")
            .or_else(|| (arg == "--threads").then(|| node_args.get(i + 1).map(String::as_str))?)
    })
}

/// Which call a series sends.
#[derive(Clone, Copy)]
enum Call {
    Health,
    Check,
    EnvoyRls,
}

/// One system of the run (a server and the call it is sent) and every measured run of
/// it, in round order.
struct Series {
    name: &'static str,
    addr: [String; 1],
    pid: u32,
    call: Call,
    runs: Vec<RunResult>,
}

impl Series {
    fn new(name: &'static str, addr: &str, pid: u32, call: Call) -> Self {
        Self {
            name,
            addr: [addr.to_string()],
            pid,
            call,
            runs: Vec::new(),
        }
    }

    /// One measured run, printed and kept.
    async fn measure(&mut self, args: &BenchArgs, keys: &Keys, round: usize) -> anyhow::Result<()> {
        println!("round {round}: {}", self.name);
        let target = match self.call {
            Call::Health => Target::Health(&self.addr),
            Call::Check => Target::Ringlimit(&self.addr),
            Call::EnvoyRls => Target::Envoy(&self.addr),
        };
        let mut result = drive(args, keys, target, &[self.pid], None).await?;
        result.system = self.name;
        result.print();
        self.runs.push(result);
        Ok(())
    }

    fn cpu(&self) -> Option<f64> {
        let c: Vec<f64> = self
            .runs
            .iter()
            .filter_map(RunResult::cpu_us_per_check)
            .collect();
        (!c.is_empty()).then(|| median(c))
    }

    fn rate(&self) -> f64 {
        median(self.runs.iter().map(RunResult::rate).collect())
    }
}

/// Runs the floor mode (validated: one local node, unary, the lean client).
pub async fn run(args: &BenchArgs, keys: &Keys) -> anyhow::Result<()> {
    let dir = nodes::tempfile_dir()?;
    let (mut node, targets) = nodes::start_for_load(args, &dir)?;
    let (node_pid, node_addr) = (node[0].child.id(), targets[0].as_str());
    let threads = threads_arg(&args.node_args);
    let mut floors = vec![FloorServer::start("bare", &[], threads)?];
    for layer in Layer::EACH {
        floors.push(FloorServer::start(layer.label(), &[layer], threads)?);
    }
    floors.push(FloorServer::start("bare+all", &Layer::ALL, threads)?);
    println!(
        "bench floor: concurrency {} duration {} s, {} rounds, node {node_addr} (pid {node_pid}), node args {:?}; floor servers: {}",
        args.concurrency,
        args.duration,
        args.rounds.max(1),
        args.node_args,
        floors
            .iter()
            .map(|f| format!("{} {}", f.name, f.addr))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let h2load = H2load::find(args);
    let mut series: Vec<Series> = floors
        .iter()
        .map(|f| Series::new(f.name, &f.addr, f.child.id(), Call::Health))
        .collect();
    let floor_count = series.len();
    series.push(Series::new(
        "node-health",
        node_addr,
        node_pid,
        Call::Health,
    ));
    series.push(Series::new("node-check", node_addr, node_pid, Call::Check));
    series.push(Series::new(
        "node-envoy-rls",
        node_addr,
        node_pid,
        Call::EnvoyRls,
    ));
    let mut h2 = H2Figures::default();
    // The node's own CPU while the floor servers take the load: its background work
    // (timers, gossip, the ops face), CPU seconds per second.
    let mut idle = Vec::new();
    for round in 1..=args.rounds.max(1) {
        let (idle_cpu, idle_from) = (cpu_seconds(&[node_pid]), Instant::now());
        for s in &mut series[..floor_count] {
            s.measure(args, keys, round).await?;
        }
        if let (Some(before), Some(after)) = (idle_cpu, cpu_seconds(&[node_pid])) {
            idle.push((after - before) / idle_from.elapsed().as_secs_f64());
        }
        for s in &mut series[floor_count..] {
            s.measure(args, keys, round).await?;
        }
        if let Some(h2load) = &h2load {
            let bare = &floors[0];
            let runs = [
                ("bare", bare.addr.as_str(), HEALTH, bare.child.id()),
                ("node-health", node_addr, HEALTH, node_pid),
                ("node-check", node_addr, CHECK, node_pid),
            ];
            for (i, (name, addr, path, pid)) in runs.into_iter().enumerate() {
                h2.runs[i].push(h2load.run(name, addr, path, pid).await?);
            }
        }
    }
    print_summary(&series, args);
    if !idle.is_empty() {
        let per_s = median(idle);
        println!(
            "floor node idle CPU (while the floor servers are driven) {:.2} ms/s, i.e. {:.2} µs/call at node-health's calls/s",
            per_s * 1e3,
            per_s * 1e6 / series[floor_count].rate()
        );
    }
    h2.print(h2load.is_some());
    drop(floors);
    node[0].stop();
    Ok(())
}

/// The medians per system, what each layer adds to the bare server, and the ratios of
/// issue 25's table (bench/run-all.sh keeps the `floor` and `ratio` lines).
fn print_summary(series: &[Series], args: &BenchArgs) {
    let bare = &series[0];
    let Some(bare_cpu) = bare.cpu() else {
        println!("floor: server CPU not measured (no /proc?)");
        return;
    };
    for s in series {
        let cpu = s.cpu().unwrap_or(f64::NAN);
        // The same round's difference, whose median drifts less than two medians.
        let paired: Vec<f64> = s
            .runs
            .iter()
            .zip(&bare.runs)
            .filter_map(|(x, y)| Some(x.cpu_us_per_check()? - y.cpu_us_per_check()?))
            .collect();
        let paired = if paired.is_empty() {
            f64::NAN
        } else {
            median(paired)
        };
        println!(
            "floor {:<15} median server CPU {cpu:.1} µs/call (x{:.3} of bare; over bare in the same round: median {paired:+.1} µs), calls/s {:.0}",
            s.name,
            cpu / bare_cpu,
            s.rate()
        );
    }
    let find = |name: &str| series.iter().find(|s| s.name == name).expect("named above");
    let check_goal = if threads_arg(&args.node_args) == Some("1") {
        "1.05"
    } else {
        "1.15"
    };
    for (name, over, goal) in [
        ("node-health", "bare", "1.05"),
        ("node-check", "bare", check_goal),
        ("node-envoy-rls", "bare", "-"),
        ("bare+all", "bare", "-"),
        ("node-health", "bare+all", "-"),
    ] {
        let (s, b) = (find(name), find(over));
        let per_round: Vec<String> = s
            .runs
            .iter()
            .zip(&b.runs)
            .filter_map(|(x, y)| {
                Some(format!(
                    "{:.2}",
                    x.cpu_us_per_check()? / y.cpu_us_per_check()?
                ))
            })
            .collect();
        if let (Some(x), Some(y)) = (s.cpu(), b.cpu()) {
            println!(
                "ratio {name}/{over} cpu_per_call: {:.2} (goal {}; per round {})",
                x / y,
                if goal == "-" {
                    "none".to_string()
                } else {
                    format!("<= {goal}")
                },
                per_round.join(" ")
            );
        }
    }
}

/// h2load runs of the bare server's health check, the node's and the node's `Check`,
/// one per round: (server CPU µs per call, calls/s).
#[derive(Default)]
struct H2Figures {
    runs: [Vec<(f64, f64)>; 3],
}

impl H2Figures {
    fn print(&self, ran: bool) {
        if !ran {
            return;
        }
        let cpu = |v: &[(f64, f64)]| median(v.iter().map(|r| r.0).collect());
        let rate = |v: &[(f64, f64)]| median(v.iter().map(|r| r.1).collect());
        let bare = cpu(&self.runs[0]);
        for (name, runs) in ["bare", "node-health", "node-check"].iter().zip(&self.runs) {
            println!(
                "floor h2load {name:<11} median server CPU {:.1} µs/call (x{:.3} of bare), calls/s {:.0}",
                cpu(runs),
                cpu(runs) / bare,
                rate(runs)
            );
        }
        println!(
            "ratio h2load node-health/bare cpu_per_call: {:.2} (goal <= 1.05)",
            cpu(&self.runs[1]) / bare
        );
        println!(
            "ratio h2load node-check/bare cpu_per_call: {:.2}",
            cpu(&self.runs[2]) / bare
        );
    }
}

/// h2load, found on the PATH, and the request bodies it sends (files in the run's dir).
struct H2load {
    concurrency: usize,
    duration: u64,
    health_body: std::path::PathBuf,
    check_body: std::path::PathBuf,
}

impl H2load {
    /// `None` (with a message) when h2load is not installed.
    fn find(args: &BenchArgs) -> Option<Self> {
        let found = Command::new("h2load")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            println!("floor: h2load not found (Debian's nghttp2-client); its rounds are skipped");
            return None;
        }
        let dir = nodes::tempfile_dir().ok()?;
        let frame = |message: &[u8]| {
            let mut body = vec![0u8];
            body.extend_from_slice(&(message.len() as u32).to_be_bytes());
            body.extend_from_slice(message);
            body
        };
        // h2load sends one body: every Check is for the same key.
        let check = ringlimit::proto::CheckRequest {
            key: "h2load".into(),
            route: "GET /bench".into(),
            cost: Some(args.cost),
            tier: None,
            descriptors: Vec::new(),
        };
        let health_body = dir.join("health.grpc");
        let check_body = dir.join("check.grpc");
        std::fs::write(&health_body, frame(&[])).ok()?;
        std::fs::write(&check_body, frame(&check.encode_to_vec())).ok()?;
        Some(Self {
            concurrency: args.concurrency,
            duration: args.duration,
            health_body,
            check_body,
        })
    }

    /// One h2load run of `path` at `addr`: (server CPU µs per succeeded call, calls/s).
    async fn run(
        &self,
        name: &str,
        addr: &str,
        path: &str,
        pid: u32,
    ) -> anyhow::Result<(f64, f64)> {
        let body = if path == CHECK {
            &self.check_body
        } else {
            &self.health_body
        };
        let mut command = Command::new("h2load");
        command
            .args(["-c", &self.concurrency.to_string(), "-m", "1", "-t", "1"])
            .args(["-D", &self.duration.to_string()])
            .args(["-H", "content-type: application/grpc", "-H", "te: trailers"])
            .arg("-d")
            .arg(body)
            .arg(format!("http://{addr}{path}"));
        let before = cpu_seconds(&[pid]);
        let output = tokio::task::spawn_blocking(move || command.output()).await??;
        let after = cpu_seconds(&[pid]);
        let text = String::from_utf8_lossy(&output.stdout);
        let succeeded = parse_succeeded(&text).with_context(|| format!("h2load output: {text}"))?;
        let cpu = after.zip(before).map_or(f64::NAN, |(a, b)| a - b);
        let per_call = cpu * 1e6 / succeeded.max(1) as f64;
        let rate = succeeded as f64 / self.duration as f64;
        println!("h2load {name:<11} server CPU {per_call:.1} µs/call, calls/s {rate:.0}");
        tokio::time::sleep(Duration::from_millis(200)).await;
        Ok((per_call, rate))
    }
}

/// The succeeded count of h2load's `requests: N total, N started, N done, N succeeded, …`.
fn parse_succeeded(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("requests:"))?;
    line.split(',')
        .find_map(|part| part.trim().strip_suffix(" succeeded")?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threads_flag_is_found_in_either_spelling() {
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(threads_arg(&args(&["--threads=1"])), Some("1"));
        assert_eq!(threads_arg(&args(&["--x", "--threads", "2"])), Some("2"));
        assert_eq!(threads_arg(&args(&["--shards=2"])), None);
    }

    #[test]
    fn h2loads_succeeded_count_is_read() {
        let out = "finished in 5.00s, 100.00 req/s\nrequests: 500 total, 510 started, 500 done, 498 succeeded, 2 failed, 0 errored, 0 timeout\n";
        assert_eq!(parse_succeeded(out), Some(498));
    }
}
