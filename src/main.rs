//! The `ringlimit` binary: clap → config → `node::run(config, shutdown)`. This file
//! parses and dispatches; each subcommand lives in `cli/`, the load generator in `bench/`.

mod bench;
mod cli;

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

use ringlimit::node::config::DEFAULT_HTTP_LISTEN;

// The global allocator is glibc's: its resident memory per key is steady from run to
// run, which the memory target needs (bench/journal/, mimalloc).

/// A self-contained clustered rate limiter.
#[derive(Parser)]
#[command(name = "ringlimit", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a node (defaults: gRPC on 127.0.0.1:7420, ops HTTP on 127.0.0.1:7421, gossip
    /// on 127.0.0.1:7422, peer service on 127.0.0.1:7423; built-in rule: sliding window
    /// counter, 100 per 60 s).
    Serve(Box<cli::serve::ServeArgs>),
    /// Ask a node whether one request may proceed. Exits 0 when allowed, 1 when denied,
    /// 2 when refused (bad input) or the node is unreachable.
    Check(cli::check::CheckArgs),
    /// Which member owns a client key (asks a node's ops port; charges nothing).
    Owner {
        /// The client key.
        #[arg(long)]
        key: String,
        /// The node's ops HTTP address.
        #[arg(long, default_value = DEFAULT_HTTP_LISTEN)]
        addr: String,
    },
    /// Rule tools: validate a file; read, replace or compare a cluster's rules.
    Rules {
        #[command(subcommand)]
        command: cli::rules::RulesCommand,
    },
    /// A client's counters: read them (charging nothing) or reset them (admin token),
    /// through any node's ops port.
    Counters {
        #[command(subcommand)]
        command: cli::counters::CountersCommand,
    },
    /// Cluster tools.
    Cluster {
        #[command(subcommand)]
        command: cli::status::ClusterCommand,
    },
    /// Start N nodes on loopback, one `serve` process each, to try a cluster (Ctrl-C
    /// stops them, each leaving gracefully).
    DevCluster(cli::dev_cluster::DevClusterArgs),
    /// Load generator: checks/s and latency percentiles, optionally side by side with
    /// Redis + the design reference's Lua script (--compare-redis).
    Bench(bench::BenchArgs),
    /// The bare tonic server `bench --protocol floor` measures beside the node.
    #[command(hide = true)]
    BenchFloorServer(bench::FloorServerArgs),
    /// Print the guide's command-line reference (docs/reference/cli.md), generated from
    /// these definitions.
    #[command(hide = true)]
    DocsReference,
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Serve(args) => cli::serve::run(*args),
        Command::Check(args) => cli::block_on(cli::check::run(args)),
        Command::Owner { key, addr } => cli::block_on(cli::owner::run(&key, &addr)),
        Command::Rules { command } => command.run(),
        Command::Counters { command } => command.run(),
        Command::Cluster { command } => command.run(),
        Command::DevCluster(args) => cli::dev_cluster::run(args),
        Command::Bench(args) => cli::block_on(bench::run(args)).map(|()| ExitCode::SUCCESS),
        Command::BenchFloorServer(args) => {
            bench::floor_server::run(args).map(|()| ExitCode::SUCCESS)
        }
        Command::DocsReference => {
            print!("{}", cli::reference::render(&Cli::command()));
            Ok(ExitCode::SUCCESS)
        }
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(2)
        }
    }
}
