//! `ringlimit bench --memory`: bytes per key of a node filled with `--keys` keys, from
//! its resident memory before and after (and Redis's `used_memory` beside it).

use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::bail;
use tonic::transport::Channel;

use ringlimit::proto::peer::peer_client::PeerClient;
use ringlimit::proto::peer::{StatusRequest, StatusResponse};
use ringlimit::proto::rate_limiter_client::RateLimiterClient;
use ringlimit::proto::{CheckBatchRequest, CheckRequest};

use super::args::BenchArgs;
use super::nodes::{rule_toml, secret_path, start_nodes, tempfile_dir};
use super::procfs::rss_bytes;
use super::redis;

/// Bytes per key: fill a fresh node (or, with `--nodes N`, a fresh cluster: the keys
/// enter through the first node and are forwarded to their owners) with --keys keys of
/// --algorithm, RSS after minus before summed over the nodes, divided by keys (and
/// Redis used_memory per client with --compare-redis). `--node-arg` reaches the nodes,
/// so `--node-arg=--replicate-interval-ms=0` measures a cluster without replicas.
pub async fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let dir = tempfile_dir()?;
    // Each key gets one check. A limit of 100 per day keeps that check's trace alive
    // until it is measured for every algorithm (a token bucket refills one token in
    // 864 s); with a huge limit or a short window the state would equal a fresh one
    // within milliseconds and the store would rightly drop it, measuring nothing.
    let limit = 100;
    let rules = rule_toml(&args.algorithm, limit).replace("\"60s\"", "\"1d\"");
    // A key cap above --keys per node, replicas included: the shards' shares of the
    // keys are not exactly even, and an eviction would make the figure look better
    // than it is.
    let cap = (2 * args.keys + args.keys / 10).max(1_000).to_string();
    let mut extra = vec!["--max-keys", cap.as_str()];
    extra.extend(args.node_args.iter().map(String::as_str));
    let mut nodes = start_nodes(args.nodes, &dir, &rules, &extra)?;
    let pids: Vec<u32> = nodes.iter().map(|n| n.child.id()).collect();
    let mut client = RateLimiterClient::connect(format!("http://{}", nodes[0].grpc)).await?;
    // One check first, so connection buffers and lazily built structures are counted
    // in the baseline, not per key.
    client
        .check(CheckRequest {
            key: "warm".into(),
            route: "GET /m".into(),
            ..Default::default()
        })
        .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = total_rss(&pids)?;
    let started = Instant::now();
    fill(&mut client, args.keys).await?;
    settle(&client).await?;
    let after = total_rss(&pids)?;
    let (mut held, mut replicas) = (0, 0);
    for node in &nodes {
        let status = status(&node.peer, &dir).await?;
        held += status.keys;
        replicas += status.replicas;
    }
    // The warm-up key is held too.
    anyhow::ensure!(
        held > args.keys as u64,
        "the nodes hold {held} keys, not all {} filled: the figure would be wrong",
        args.keys
    );
    println!(
        "ringlimit {:<24} nodes {} keys {:>9} (held {held}, replicas {replicas})  RSS {:>7.1} MiB -> {:>7.1} MiB  bytes/key {:>6.1}  (filled in {:.1} s)",
        args.algorithm,
        nodes.len(),
        args.keys,
        before as f64 / 1048576.0,
        after as f64 / 1048576.0,
        after.saturating_sub(before) as f64 / args.keys as f64,
        started.elapsed().as_secs_f64()
    );
    for node in &mut nodes {
        node.stop();
    }
    if args.compare_redis {
        redis_memory(args).await?;
    }
    Ok(())
}

/// Resident bytes of every process in `pids` together.
fn total_rss(pids: &[u32]) -> anyhow::Result<u64> {
    pids.iter().map(|&pid| rss_bytes(pid)).sum()
}

/// One check on each of `keys` keys (`client_0`, ...), in batches of 1,000.
async fn fill(client: &mut RateLimiterClient<Channel>, keys: usize) -> anyhow::Result<()> {
    for chunk in 0..keys.div_ceil(1000) {
        let checks = (chunk * 1000..((chunk + 1) * 1000).min(keys))
            .map(|i| CheckRequest {
                key: format!("client_{i}"),
                route: "GET /m".into(),
                ..Default::default()
            })
            .collect();
        client.check_batch(CheckBatchRequest { checks }).await?;
    }
    Ok(())
}

/// Settle before measuring, with a trickle of checks on several tasks as a live node
/// would see: allocators may hand freed memory (outgrown copies of the tables, request
/// buffers) back to the OS only later, on further activity, and a figure taken before
/// that would count memory the node no longer uses.
async fn settle(client: &RateLimiterClient<Channel>) -> anyhow::Result<()> {
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let calls = (0..4).map(|_| {
            let mut client = client.clone();
            async move {
                client
                    .check(CheckRequest {
                        key: "warm".into(),
                        route: "GET /m".into(),
                        ..Default::default()
                    })
                    .await
            }
        });
        for answer in futures_util::future::join_all(calls).await {
            answer?;
        }
    }
    Ok(())
}

/// The status of the node whose peer face is at `peer` (`Peer/Status`, signed with
/// the key in `dir`): how many keys and replicas it holds.
async fn status(peer: &str, dir: &Path) -> anyhow::Result<StatusResponse> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{peer}"))?
        .connect()
        .await?;
    let keyring = ringlimit::keyring::Keyring::from_file(&secret_path(dir))?;
    Ok(PeerClient::new(ringlimit::cluster::link::Signed::new(
        channel,
        Some(keyring),
        "ringlimit-bench".into(),
    ))
    .status(StatusRequest {})
    .await?
    .into_inner())
}

/// Redis `used_memory` per client key after the same fill through the reference script.
async fn redis_memory(args: &BenchArgs) -> anyhow::Result<()> {
    let server = redis::start().await?;
    let sha = redis::load_script(&server.addr).await?;
    let before = redis::used_memory(&server.addr).await?;
    let mut conn = redis::Conn::connect(&server.addr).await?;
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
    for chunk in 0..args.keys.div_ceil(1000) {
        let range = chunk * 1000..((chunk + 1) * 1000).min(args.keys);
        let n = range.len();
        for i in range {
            redis::push_check(
                &mut conn,
                &sha,
                &format!("client_{i}"),
                "GET /m",
                1_000_000,
                60_000,
                now_ms,
            );
        }
        conn.flush().await?;
        for _ in 0..n {
            if let Err(e) = redis::admitted(&conn.read().await?) {
                bail!("redis script failed: {e}");
            }
        }
    }
    let after = redis::used_memory(&server.addr).await?;
    println!(
        "redis     sliding_window_counter   keys {:>9}  used_memory {:>7.1} MiB -> {:>7.1} MiB  bytes/key {:>6.1}  ({})",
        args.keys,
        before as f64 / 1048576.0,
        after as f64 / 1048576.0,
        after.saturating_sub(before) as f64 / args.keys as f64,
        redis::version()
    );
    Ok(())
}
