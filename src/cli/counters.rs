//! `ringlimit counters get|reset --key K [--route R] [--tier T]`: one client's counters,
//! read or reset through a node's ops port (any node: it asks the key's owner). A read
//! charges nothing; a reset needs the admin token.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Subcommand};
use ringlimit::node::config::DEFAULT_HTTP_LISTEN;

use super::{block_on, http};

/// `ringlimit counters ...`.
#[derive(Subcommand)]
pub enum CountersCommand {
    /// Print a client's counters: rule, algorithm, used, remaining, reset time, owner
    /// (charges nothing).
    Get(Client),
    /// Reset a client's counters to the state of a new key (an admin write, logged on
    /// the node asked and on the owner); prints what they held before.
    Reset {
        #[command(flatten)]
        client: Client,
        /// The admin token file.
        #[arg(long, env = "RINGLIMIT_ADMIN_TOKEN_FILE")]
        admin_token_file: Option<PathBuf>,
    },
}

/// Which client, and which node to ask.
#[derive(Args)]
pub struct Client {
    /// The client key.
    #[arg(long)]
    key: String,
    /// A route its checks carry (`METHOD /path`): needed to see per-route counters.
    #[arg(long)]
    route: Option<String>,
    /// Its tier: only that tier's rules (and those without a tier).
    #[arg(long)]
    tier: Option<String>,
    /// A node's ops HTTP address.
    #[arg(long, default_value = DEFAULT_HTTP_LISTEN)]
    addr: String,
    /// Print the JSON answer as is.
    #[arg(long)]
    json: bool,
}

impl CountersCommand {
    /// Runs the subcommand: exits 0 on success, 1 when the node refused (bad input, no or
    /// wrong token), 2 when it could not be reached.
    pub fn run(self) -> anyhow::Result<ExitCode> {
        match self {
            CountersCommand::Get(client) => block_on(send(&client, "GET", Vec::new())),
            CountersCommand::Reset {
                client,
                admin_token_file,
            } => {
                let mut headers = Vec::new();
                if let Some(path) = admin_token_file {
                    let token = std::fs::read_to_string(&path)
                        .with_context(|| format!("reading {}", path.display()))?;
                    let token = token.lines().next().unwrap_or("").trim().to_string();
                    headers.push(("Authorization", format!("Bearer {token}")));
                }
                block_on(send(&client, "DELETE", headers))
            }
        }
    }
}

/// The ops path of a counters request, every value percent-encoded.
pub fn path(key: &str, route: Option<&str>, tier: Option<&str>) -> String {
    let mut path = format!("/v1/counters?key={}", encode(key));
    if let Some(route) = route {
        path.push_str(&format!("&route={}", encode(route)));
    }
    if let Some(tier) = tier {
        path.push_str(&format!("&tier={}", encode(tier)));
    }
    path
}

fn encode(value: &str) -> String {
    let mut out = String::new();
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

async fn send(
    client: &Client,
    method: &str,
    headers: Vec<(&str, String)>,
) -> anyhow::Result<ExitCode> {
    let path = path(&client.key, client.route.as_deref(), client.tier.as_deref());
    let answer = http::request(&client.addr, method, &path, &headers, None).await?;
    if answer.status != 200 {
        eprintln!("refused: {} {}", answer.status, answer.error_message());
        return Ok(ExitCode::from(1));
    }
    if client.json {
        println!("{}", answer.body.trim_end());
        return Ok(ExitCode::SUCCESS);
    }
    let v: serde_json::Value = serde_json::from_str(&answer.body)?;
    let counters = v["counters"].as_array().cloned().unwrap_or_default();
    println!(
        "{} {} on {}@{}: {} counter{}{}",
        client.key,
        if method == "DELETE" { "reset" } else { "read" },
        v["owner"]["node_id"].as_str().unwrap_or("?"),
        v["owner"]["generation"].as_str().unwrap_or("?"),
        counters.len(),
        if counters.len() == 1 { "" } else { "s" },
        if method == "DELETE" && !counters.is_empty() {
            " (numbers from just before the reset)"
        } else {
            ""
        },
    );
    for c in counters {
        let route = c["route"]
            .as_str()
            .map_or(String::new(), |r| format!(" [{r}]"));
        println!(
            "  {}{route} ({}): used {} of {}, remaining {}, full again at {} ms",
            c["rule"].as_str().unwrap_or("?"),
            c["algorithm"].as_str().unwrap_or("?"),
            c["used"],
            c["limit"],
            c["remaining"],
            c["reset_at_ms"],
        );
    }
    Ok(ExitCode::SUCCESS)
}
