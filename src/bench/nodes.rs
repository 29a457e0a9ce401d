//! The node processes a bench starts: this binary's `serve` on port 0, clustered under a
//! fresh key, with the benchmark rule.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;

use super::args::BenchArgs;

/// The benchmark rule as a rule file: `limit` per 60 s of `algorithm` for every key.
pub fn rule_toml(algorithm: &str, limit: u64) -> String {
    let extra = if algorithm == "leaky_bucket" {
        format!("burst = {limit}\n")
    } else {
        String::new()
    };
    format!("[default]\nalgorithm = \"{algorithm}\"\nlimit = {limit}\nwindow = \"60s\"\n{extra}")
}

/// A directory of this run for rule files and the cluster key.
pub fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = scratch_path();
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// This process's scratch directory (`bench::run` removes it when the run ends).
pub fn scratch_path() -> PathBuf {
    std::env::temp_dir().join(format!("ringlimit-bench-{}", std::process::id()))
}

/// A node process started by the bench.
pub struct LocalNode {
    /// The `serve` process.
    pub child: Child,
    /// Its public gRPC address.
    pub grpc: String,
    /// The peer service (the cluster face), where `Peer/Status` is answered.
    pub peer: String,
}

impl LocalNode {
    /// Kills the node and reaps it.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where [`start_nodes`] keeps the cluster key of the nodes it starts.
pub fn secret_path(dir: &Path) -> std::path::PathBuf {
    dir.join("cluster.secret")
}

impl Drop for LocalNode {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Start `count` node processes of this binary on port 0, clustered under a fresh
/// cluster key (in `dir`), with `rules`; `extra` are more `serve` flags.
pub fn start_nodes(
    count: usize,
    dir: &Path,
    rules: &str,
    extra: &[&str],
) -> anyhow::Result<Vec<LocalNode>> {
    let path = dir.join("rules.toml");
    std::fs::write(&path, rules)?;
    let secret = secret_path(dir);
    std::fs::write(&secret, ringlimit::keyring::generate_secret())?;
    let exe = std::env::current_exe()?;
    let mut nodes: Vec<LocalNode> = Vec::new();
    let mut seed: Option<String> = None;
    for i in 0..count.max(1) {
        let mut command = Command::new(&exe);
        command
            .args(["serve", "--node-id", &format!("bench-{}", i + 1)])
            .args([
                "--listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
                "--gossip-listen",
                "127.0.0.1:0",
                "--peer-listen",
                "127.0.0.1:0",
            ])
            .arg("--rules")
            .arg(&path)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(seed) = &seed {
            command.args(["--seed", seed]);
        }
        if !extra.contains(&"--insecure-cluster") {
            command.arg("--cluster-secret-file").arg(&secret);
        }
        let mut child = command.spawn().context("starting a ringlimit node")?;
        let stdout = child.stdout.take().context("node stdout")?;
        let line = std::io::BufRead::lines(std::io::BufReader::new(stdout))
            .next()
            .context("node exited before it was ready")??;
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{name}=")))
                .map(str::to_string)
                .with_context(|| format!("no {name}= in ready line {line:?}"))
        };
        let grpc = field("grpc")?;
        let peer = field("peer")?;
        seed.get_or_insert(field("gossip")?);
        nodes.push(LocalNode { child, grpc, peer });
    }
    if count > 1 {
        // Let gossip converge so checks are routed on the full ring.
        std::thread::sleep(Duration::from_secs(3));
    }
    Ok(nodes)
}

/// The local nodes a load run starts (`--nodes`), with the benchmark rule both as a
/// rule and as an Envoy domain, and the targets the load goes to: all of them, or all
/// but the last with `--kill-node-after` (the node to kill gets no load).
pub fn start_for_load(
    args: &BenchArgs,
    dir: &Path,
) -> anyhow::Result<(Vec<LocalNode>, Vec<String>)> {
    let insecure: &[&str] = if args.insecure_cluster {
        &["--insecure-cluster"]
    } else {
        &[]
    };
    // The same limit through Envoy RLS: one descriptor per client key.
    let envoy = dir.join("envoy.yaml");
    std::fs::write(
        &envoy,
        format!(
            "domain: {}\ndescriptors:\n  - key: {}\n    rate_limit: {{unit: minute, requests_per_unit: {}, algorithm: sliding_window_counter}}\n",
            args.domain, args.descriptor_key, args.limit
        ),
    )?;
    let envoy = envoy.to_string_lossy().into_owned();
    let mut extra: Vec<&str> = insecure.to_vec();
    extra.extend(["--envoy-config", envoy.as_str()]);
    if args.protocol.gubernator() {
        extra.push("--gubernator");
    }
    extra.extend(args.node_args.iter().map(String::as_str));
    let nodes = start_nodes(
        args.nodes,
        dir,
        &rule_toml("sliding_window_counter", args.limit),
        &extra,
    )?;
    let mut targets: Vec<String> = nodes.iter().map(|n| n.grpc.clone()).collect();
    if args.kill_node_after.is_some() {
        anyhow::ensure!(
            nodes.len() >= 2,
            "--kill-node-after needs --nodes 2 or more"
        );
        targets.pop();
    }
    Ok((nodes, targets))
}
