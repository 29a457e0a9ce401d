//! The subcommands of the `ringlimit` binary, one file each (`main.rs` only parses and
//! dispatches), and what they share: the async runtime, logging, the stop signal.

pub mod check;
pub mod check_http;
pub mod counters;
pub mod dev_cluster;
mod http;
pub mod owner;
pub mod peer_tls;
pub mod reference;
pub mod resp;
pub mod rules;
pub mod serve;
pub mod status;

use std::future::Future;

use anyhow::Context;

/// Log line format of `serve` and `dev-cluster`.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum LogFormat {
    // No doc comments here: clap would print them beside the values in --help.
    Text,
    Json,
}

impl LogFormat {
    /// The flag value that selects this format (dev-cluster passes it to its nodes).
    pub fn as_arg(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

/// Runs one async subcommand on a runtime of its own.
pub fn block_on<T>(work: impl Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    runtime()?.block_on(work)
}

/// The async runtime with tokio's default number of workers.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    runtime_with(None)
}

/// The async runtime, with `threads` workers (default: tokio's, the usable cores). One
/// thread is tokio's current-thread scheduler: every task, the shard actors and the
/// connections that use them, on the thread that runs the node, with no hand-over
/// between a main thread and one worker (bench/journal/).
pub fn runtime_with(threads: Option<usize>) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = match threads {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(threads) => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(threads);
            builder
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    builder
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// An algorithm flag's value, with the list of valid names in the refusal.
pub fn parse_algorithm(text: &str) -> Result<ringlimit::algorithms::AlgorithmKind, String> {
    ringlimit::algorithms::AlgorithmKind::parse(text).ok_or_else(|| {
        format!("{text:?} is not an algorithm (token_bucket, leaky_bucket, fixed_window, sliding_window_log, sliding_window_counter)")
    })
}

/// Resolves on Ctrl-C or SIGTERM: the signals that make a node leave gracefully.
pub async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Logs to stderr in `format`, filtered by `RUST_LOG` (default `info`).
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Logs go to stderr: stdout carries only the machine-readable ready line (serve)
    // and command output, so scripts can read it.
    // No ANSI colour codes unless stderr is a terminal: a log file or a collector
    // (journald, docker logs) should get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
