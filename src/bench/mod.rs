//! `ringlimit bench`: a gRPC load generator, and the same load against the reference
//! design (Redis + the design reference's Lua script) on the same machine.
//!
//! Tooling, not product: part of the binary, not the library, it reaches a node only
//! over the wire (and, in its tests, starts one through the library's public API), and
//! it may use `anyhow`. Latency is measured per call (a unary
//! check, or one `CheckBatch` / one pipelined round of EVALSHA) into an HDR histogram
//! in microseconds; throughput counts checks, not calls.
//!
//! - `args`: the flags; `nodes`: the local node processes; `keys`: the key sampler.
//! - `rounds` alternates the systems; `drive` measures one run; `worker` is one caller
//!   (`lean` its minimal gRPC client, `redis` the reference design); `report` prints.
//! - `memory`: bytes per key instead of load; `procfs`: CPU time and RSS of processes.
//! - `floor`: `--protocol floor`, the node beside a bare tonic server (`floor_server`,
//!   this binary's hidden `bench-floor-server`) and that server with each of our layers.

mod args;
mod drive;
mod floor;
pub mod floor_server;
mod keys;
mod lean;
mod memory;
mod nodes;
mod procfs;
mod redis;
mod report;
mod rounds;
mod worker;

use std::time::Duration;

pub use args::BenchArgs;
pub use floor_server::FloorServerArgs;

use keys::Keys;
use rounds::{Rounds, Systems};

/// Run `ringlimit bench`; the process's scratch directory (rules, cluster secret,
/// request files for h2load: [`nodes::tempfile_dir`]) is removed afterwards, whatever
/// the outcome.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let result = run_mode(args).await;
    let _ = std::fs::remove_dir_all(nodes::scratch_path());
    result
}

async fn run_mode(args: BenchArgs) -> anyhow::Result<()> {
    args.validate()?;
    if args.memory {
        return memory::run(&args).await;
    }
    if args.protocol == args::Protocol::Floor {
        return floor::run(&args, &Keys::new(&args)).await;
    }
    let rules_dir = nodes::tempfile_dir()?;
    let (mut nodes, targets) = if args.targets.is_empty() {
        nodes::start_for_load(&args, &rules_dir)?
    } else {
        (Vec::new(), args.targets.clone())
    };
    let redis = if args.compare_redis {
        let server = redis::start().await?;
        let sha = redis::load_script(&server.addr).await?;
        Some((server, sha))
    } else {
        None
    };
    print_header(&args, &targets, redis.is_some());
    let keys = Keys::new(&args);
    let mut pids: Vec<u32> = nodes.iter().map(|n| n.child.id()).collect();
    if nodes.is_empty() {
        pids = remote_pids(&targets);
    }
    let kill = match args.kill_node_after {
        Some(after) => {
            anyhow::ensure!(
                !nodes.is_empty(),
                "--kill-node-after needs local nodes (no --addr)"
            );
            let victim = pids.pop().expect("at least two nodes");
            Some((victim, Duration::from_secs(after)))
        }
        None => None,
    };
    let systems = Systems {
        targets: &targets,
        pids: &pids,
        redis: redis.as_ref(),
    };
    Rounds::run(&args, &keys, &systems, kill)
        .await?
        .print_summary();
    for node in &mut nodes {
        node.stop();
    }
    Ok(())
}

/// The run's settings, first line of the output.
fn print_header(args: &BenchArgs, targets: &[String], redis: bool) {
    println!(
        "bench: concurrency {}{} batch {} keys {} ({:?}) cost {} duration {} s, targets {:?}{}",
        args.concurrency,
        if args.rate > 0.0 {
            format!(" rate {} calls/s (open loop)", args.rate)
        } else {
            String::new()
        },
        args.batch,
        args.keys,
        args.distribution,
        args.cost,
        args.duration,
        targets,
        if redis {
            format!(", vs {}", redis::version())
        } else {
            String::new()
        }
    );
}

/// Servers at --addr: their CPU is measured when they listen on this machine (all of
/// them, or none).
fn remote_pids(targets: &[String]) -> Vec<u32> {
    let pids: Vec<u32> = targets
        .iter()
        .filter_map(|t| t.rsplit_once(':')?.1.parse::<u16>().ok())
        .filter_map(procfs::pid_listening_on)
        .collect();
    if pids.len() != targets.len() {
        println!(
            "bench: server CPU per check not measured: {} of {} targets' processes found on this machine",
            pids.len(),
            targets.len()
        );
        return Vec::new();
    }
    pids
}
