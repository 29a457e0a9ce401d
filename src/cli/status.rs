//! `ringlimit cluster status`: members, generations, ring shares, ring digest and rule
//! drift as one node sees them, asked on its peer face (a signed call).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Subcommand;

use ringlimit::node::config::DEFAULT_PEER_LISTEN;
use ringlimit::proto::peer::{MemberStatus, StatusResponse};

use super::peer_tls::PeerTlsArgs;

/// `ringlimit cluster ...`.
#[derive(Subcommand)]
pub enum ClusterCommand {
    /// Members, generations, ring shares and ring digest as one node sees them.
    Status {
        /// The node's peer service address (host:port or http://host:port): the
        /// cluster face, not the public gRPC port.
        #[arg(long, default_value = DEFAULT_PEER_LISTEN)]
        addr: String,
        /// Print JSON (64-bit numbers as strings).
        #[arg(long)]
        json: bool,
        /// The cluster's secret file: the peer service answers only signed calls.
        #[arg(long, env = "RINGLIMIT_CLUSTER_SECRET_FILE")]
        cluster_secret_file: Option<PathBuf>,
        /// A certificate of the cluster CA, when the peer face uses mutual TLS.
        #[command(flatten)]
        tls: PeerTlsArgs,
    },
}

impl ClusterCommand {
    /// Runs the subcommand.
    pub fn run(self) -> anyhow::Result<ExitCode> {
        match self {
            ClusterCommand::Status {
                addr,
                json,
                cluster_secret_file,
                tls,
            } => super::block_on(status(addr, json, cluster_secret_file, tls)),
        }
    }
}

/// Asks the node at `addr` for its view and prints it (a table, or JSON).
async fn status(
    addr: String,
    json: bool,
    secret: Option<PathBuf>,
    tls: PeerTlsArgs,
) -> anyhow::Result<ExitCode> {
    let tls = tls.load()?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let addr = if addr.contains("://") {
        addr
    } else {
        format!("{scheme}://{addr}")
    };
    let keyring = secret
        .as_deref()
        .map(ringlimit::keyring::Keyring::from_file)
        .transpose()?;
    let mut endpoint = tonic::transport::Endpoint::from_shared(addr.clone())?;
    if let Some(tls) = &tls {
        endpoint = endpoint.tls_config(ringlimit::node::grpc::client_tls(tls))?;
    }
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
    let mut client = ringlimit::proto::peer::peer_client::PeerClient::new(
        ringlimit::cluster::link::Signed::new(channel, keyring, "ringlimit-cli".into()),
    );
    let status = client
        .status(ringlimit::proto::peer::StatusRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("{}: {}", addr, s.message()))?
        .into_inner();
    if json {
        println!("{}", status_json(&status));
    } else {
        print_table(&addr, &status);
        print_drift(&status);
    }
    Ok(ExitCode::SUCCESS)
}

/// The JSON form (64-bit numbers as strings).
fn status_json(status: &StatusResponse) -> serde_json::Value {
    let members: Vec<_> = status
        .members
        .iter()
        .map(|m| {
            serde_json::json!({
                "node_id": m.node_id, "generation": m.generation.to_string(), "grpc_addr": m.grpc_addr,
                "peer_addr": m.peer_addr, "gossip_addr": m.gossip_addr, "leaving": m.leaving, "ring_share": m.ring_share,
                "rules": m.rules, "rules_drift": m.rules_drift,
                "envoy_config": m.envoy, "envoy_drift": m.envoy_drift,
            })
        })
        .collect();
    serde_json::json!({
        "node_id": status.node_id, "generation": status.generation.to_string(),
        "ring_digest": format!("{:016x}", status.ring_digest), "keys": status.keys,
        "rules": status.rules,
        "rules_drift": status.members.iter().any(|m| m.rules_drift),
        "envoy_config": status.envoy,
        "envoy_drift": status.members.iter().any(|m| m.envoy_drift),
        "members": members,
    })
}

/// The asked node's summary line, then one line per member.
fn print_table(addr: &str, status: &StatusResponse) {
    println!(
        "asked {} ({}@{}): ring digest {:016x}, {} keys held, rules {}, envoy {}",
        addr,
        status.node_id,
        status.generation,
        status.ring_digest,
        status.keys,
        status.rules,
        if status.envoy.is_empty() {
            "-"
        } else {
            &status.envoy
        }
    );
    println!(
        "{:<20} {:>20} {:<22} {:<22} {:<22} {:>7} {:<30} {:<25} {:<5} state",
        "node", "generation", "grpc", "peer", "gossip", "share", "rules", "envoy", "drift"
    );
    for m in &status.members {
        println!(
            "{:<20} {:>20} {:<22} {:<22} {:<22} {:>6.1}% {:<30} {:<25} {:<5} {}",
            m.node_id,
            m.generation,
            m.grpc_addr,
            m.peer_addr,
            m.gossip_addr,
            m.ring_share * 100.0,
            if m.rules.is_empty() { "-" } else { &m.rules },
            if m.envoy.is_empty() { "?" } else { &m.envoy },
            if m.rules_drift || m.envoy_drift {
                "DRIFT"
            } else {
                "-"
            },
            if m.leaving { "leaving" } else { "live" }
        );
    }
}

/// One line naming the members whose rules, or Envoy domains, differ from the asked node's.
fn print_drift(status: &StatusResponse) {
    let drifting = |drifts: fn(&MemberStatus) -> bool| -> Vec<&str> {
        status
            .members
            .iter()
            .filter(|m| drifts(m))
            .map(|m| m.node_id.as_str())
            .collect()
    };
    let summaries = [
        (drifting(|m| m.rules_drift), "rules drift: {nodes} {verb} different rules than {me} (different --rules files, or file and cluster sources mixed)"),
        (drifting(|m| m.envoy_drift), "envoy config drift: {nodes} {verb} different Envoy domains than {me} (different --envoy-config files, --envoy-xds sets or --envoy-algorithm, or those flags on some nodes only)"),
    ];
    for (nodes, line) in summaries {
        if !nodes.is_empty() {
            let verb = if nodes.len() == 1 {
                "enforces"
            } else {
                "enforce"
            };
            println!(
                "{}",
                line.replace("{nodes}", &nodes.join(", "))
                    .replace("{verb}", verb)
                    .replace("{me}", &status.node_id)
            );
        }
    }
}
