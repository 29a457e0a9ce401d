//! `ringlimit dev-cluster`: N `ringlimit serve` processes on loopback, so each node has
//! its own metrics registry, logs (every line says `node{id=…}`) and failure domain, as in
//! production. Ctrl-C (or SIGTERM) makes every node leave gracefully.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;

use super::{init_logging, runtime, wait_for_signal, LogFormat};

/// The flags of `ringlimit dev-cluster`.
#[derive(clap::Args)]
pub struct DevClusterArgs {
    /// Number of nodes.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// First port: node i listens on base+4i (gRPC), base+4i+1 (ops HTTP), base+4i+2
    /// (gossip), base+4i+3 (peer service). 0: every listener on a free port.
    #[arg(long, default_value_t = 7420)]
    base_port: u16,
    /// Rule file for every node (file mode: the API is read-only).
    #[arg(long, conflicts_with = "rules_seed")]
    rules: Option<PathBuf>,
    /// Cluster mode: seed the cluster rule set with this file.
    #[arg(long)]
    rules_seed: Option<PathBuf>,
    /// Admin token file for the rules API of every node (without it, writes are refused).
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// Starts the nodes one after the other (each joins through the first), prints how to
/// reach them, and waits for Ctrl-C or SIGTERM.
pub fn run(args: DevClusterArgs) -> anyhow::Result<ExitCode> {
    init_logging(args.log_format);
    anyhow::ensure!((1..=20).contains(&args.nodes), "--nodes must be 1..=20");
    // One key for the nodes of this cluster, written where `cluster status` can read it
    // (mode 0600) and known to nothing else.
    let secret = ringlimit::keyring::generate_secret();
    let secret_path = std::env::temp_dir().join(format!(
        "ringlimit-dev-cluster-{}.secret",
        std::process::id()
    ));
    write_private(&secret_path, &secret)?;
    // Removed however dev-cluster ends (a node that fails to start included).
    let _secret_file = RemoveOnDrop(secret_path.clone());
    let exe = std::env::current_exe().context("finding this binary")?;
    let mut nodes = DevNodes(Vec::new());
    let mut seed: Option<String> = None;
    // The first node's gRPC and peer addresses, for the hints printed below.
    let mut first: Option<(String, String)> = None;
    for i in 0..args.nodes {
        let command = serve_command(&exe, &args, i, &secret_path, seed.as_deref())?;
        let ready = nodes.start(command, i)?;
        seed.get_or_insert(ready.field("gossip")?);
        if first.is_none() {
            first = Some((ready.field("grpc")?, ready.field("peer")?));
        }
        println!(
            "{}  grpc={}  ops=http://{}/  gossip={}  peer={}  pid={}",
            ready.id,
            ready.field("grpc")?,
            ready.field("http")?,
            ready.field("gossip")?,
            ready.field("peer")?,
            nodes.0.last().map_or(0, std::process::Child::id),
        );
    }
    let (grpc, peer) = first.unwrap_or_default();
    println!(
        "{} nodes running. Try: ringlimit check --addr {grpc} --key cust_42 --route \"GET /v1/users\"   (Ctrl-C stops them)",
        args.nodes,
    );
    println!(
        "cluster key: {}   (ringlimit cluster status --addr {peer} --cluster-secret-file {})",
        secret_path.display(),
        secret_path.display()
    );
    runtime()?.block_on(wait_for_signal());
    println!("stopping: each node leaves gracefully");
    nodes.leave();
    Ok(ExitCode::SUCCESS)
}

/// The id of node `i` (0-based): `node-1`, `node-2`, ...
fn node_id(i: usize) -> String {
    format!("node-{}", i + 1)
}

/// The `ringlimit serve` command line of node `i`, joining through `seed` if one runs.
fn serve_command(
    exe: &Path,
    args: &DevClusterArgs,
    i: usize,
    secret_path: &Path,
    seed: Option<&str>,
) -> anyhow::Result<std::process::Command> {
    let port = |offset: usize| -> anyhow::Result<String> {
        if args.base_port == 0 {
            // Every listener on a free port (scripts and tests read the table).
            return Ok("127.0.0.1:0".to_string());
        }
        let port = usize::from(args.base_port) + 4 * i + offset;
        let port = u16::try_from(port).context("--base-port too high")?;
        Ok(SocketAddr::from(([127, 0, 0, 1], port)).to_string())
    };
    let id = node_id(i);
    let mut command = std::process::Command::new(exe);
    command
        .args(["serve", "--node-id", &id])
        .args(["--listen", &port(0)?, "--http-listen", &port(1)?])
        .args(["--gossip-listen", &port(2)?, "--peer-listen", &port(3)?])
        .args(["--log-format", args.log_format.as_arg()])
        .arg("--cluster-secret-file")
        .arg(secret_path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit());
    if let Some(rules) = &args.rules {
        command.arg("--rules").arg(rules);
    }
    if let Some(seed_file) = &args.rules_seed {
        command.arg("--rules-seed").arg(seed_file);
    }
    if let Some(token) = &args.admin_token_file {
        command.arg("--admin-token-file").arg(token);
    }
    if let Some(seed) = seed {
        command.args(["--seed", seed]);
    }
    Ok(command)
}

/// A started node's ready line (see `serve`).
struct Ready {
    id: String,
    line: String,
}

impl Ready {
    /// The value of `name=` in the ready line.
    fn field(&self, name: &str) -> anyhow::Result<String> {
        self.line
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{name}=")))
            .map(str::to_string)
            .with_context(|| format!("no {name}= in the ready line {:?}", self.line))
    }
}

/// A file removed when this goes out of scope.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The node processes of `dev-cluster`; killed if dev-cluster fails before they leave.
struct DevNodes(Vec<std::process::Child>);

impl DevNodes {
    /// Spawns node `i` and waits for its ready line.
    fn start(&mut self, mut command: std::process::Command, i: usize) -> anyhow::Result<Ready> {
        let id = node_id(i);
        let mut child = command.spawn().with_context(|| format!("starting {id}"))?;
        let stdout = child.stdout.take().context("node stdout")?;
        self.0.push(child);
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
        let line = lines
            .next()
            .with_context(|| format!("{id} exited before it was ready (its log is above)"))??;
        // serve prints nothing else on stdout; drain it anyway so a node never blocks.
        std::thread::spawn(move || lines.for_each(drop));
        Ok(Ready { id, line })
    }

    /// SIGTERM every node (a graceful leave; a Ctrl-C in the terminal already reached
    /// them too), then wait up to 15 s for each before killing it.
    fn leave(&mut self) {
        for child in self.0.iter().rev() {
            // No libc call (unsafe is forbidden): the kill(1) tool sends the signal.
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
        }
        for mut child in self.0.drain(..).rev() {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
            while matches!(child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            if matches!(child.try_wait(), Ok(None)) {
                eprintln!("node pid {} did not leave within 15 s: killed", child.id());
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

impl Drop for DevNodes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Write `text` to a new file only its owner can read.
fn write_private(path: &std::path::Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    writeln!(file, "{text}")?;
    Ok(())
}
