//! One measured run: spawn the callers, warm up, measure for `--duration` seconds (with
//! the server processes' CPU time), stop and merge the callers' histograms.

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use super::args::BenchArgs;
use super::keys::Keys;
use super::procfs::cpu_seconds;
use super::report::RunResult;
use super::worker::{Pacing, Worker};

/// The system one run drives.
pub enum Target<'a> {
    /// The native API on these nodes.
    Ringlimit(&'a [String]),
    /// One ring-aware client (seeded with every target) shared by the callers.
    RingAware(&'a [String]),
    /// Envoy RLS on these nodes.
    Envoy(&'a [String]),
    /// Gubernator V1 on these nodes.
    Gubernator(&'a [String]),
    /// tonic's health check on the nodes (no check at all).
    Health(&'a [String]),
    /// The native API on these nodes, caller i to node i mod n drawing from the i mod
    /// n-th key set (`--entry`: each node's own keys, or the keys it does not own).
    Pinned(&'a [String], &'a [Keys]),
    /// Redis at this address, with the script of this SHA.
    Redis(&'a str, &'a str),
}

/// The counters every caller of one run adds to, and the flags they watch.
#[derive(Clone, Default)]
struct Counters {
    checks: Arc<AtomicU64>,
    allowed: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    measuring: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

/// Drive one system for warmup + duration with the configured load.
pub async fn drive(
    args: &BenchArgs,
    keys: &Keys,
    target: Target<'_>,
    pids: &[u32],
    kill: Option<(u32, Duration)>,
) -> anyhow::Result<RunResult> {
    let counters = Counters::default();
    let ring_aware = ring_aware_client(args, &target).await?;
    let forwarded = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..args.concurrency)
        .map(|worker| {
            let keys = match &target {
                Target::Pinned(_, pinned) => &pinned[worker % pinned.len()],
                _ => keys,
            };
            let ctx = caller(args, keys, &target, worker, &counters);
            match &target {
                Target::Ringlimit(targets)
                | Target::Pinned(targets, _)
                | Target::Envoy(targets)
                | Target::Gubernator(targets)
                | Target::Health(targets) => {
                    let addr = format!("http://{}", targets[worker % targets.len()]);
                    tokio::spawn(ctx.ringlimit(addr))
                }
                Target::RingAware(_) => tokio::spawn(
                    ctx.ring_aware(ring_aware.clone().expect("built above"), forwarded.clone()),
                ),
                Target::Redis(addr, sha) => {
                    tokio::spawn(ctx.redis(addr.to_string(), sha.to_string()))
                }
            }
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(args.warmup)).await;
    counters.checks.store(0, Ordering::SeqCst);
    counters.allowed.store(0, Ordering::SeqCst);
    counters.errors.store(0, Ordering::SeqCst);
    counters.measuring.store(true, Ordering::SeqCst);
    let cpu_before = cpu_seconds(pids);
    let started = Instant::now();
    if let Some((pid, after)) = kill {
        tokio::spawn(kill_after(pid, after));
    }
    for second in 1..=args.duration {
        tokio::time::sleep_until((started + Duration::from_secs(second)).into()).await;
        eprintln!(
            "  {second:>3} s  {:>10.0} checks/s so far, errors {}",
            counters.checks.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64(),
            counters.errors.load(Ordering::Relaxed)
        );
    }
    counters.measuring.store(false, Ordering::SeqCst);
    let cpu_after = cpu_seconds(pids);
    let elapsed = started.elapsed();
    let total = counters.checks.load(Ordering::SeqCst);
    counters.stop.store(true, Ordering::SeqCst);
    let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    for worker in workers {
        latency.add(worker.await??)?;
    }
    if let Some(client) = &ring_aware {
        print_ring_aware(client, &forwarded, args.coalesce);
    }
    Ok(RunResult {
        system: match target {
            Target::Ringlimit(_) | Target::Pinned(..) => "ringlimit",
            Target::RingAware(_) => "ring-aware",
            Target::Envoy(_) => "envoy-rls",
            Target::Gubernator(_) => "gubernator",
            Target::Health(_) => "health",
            Target::Redis(..) => "redis",
        },
        server_cpu_s: match (cpu_before, cpu_after) {
            (Some(b), Some(a)) if !pids.is_empty() => Some(a - b),
            _ => None,
        },
        checks: total,
        allowed: counters.allowed.load(Ordering::SeqCst),
        errors: counters.errors.load(Ordering::SeqCst),
        elapsed,
        latency,
    })
}

/// The one ring-aware client the callers of a `RingAware` run share; `None` otherwise.
async fn ring_aware_client(
    args: &BenchArgs,
    target: &Target<'_>,
) -> anyhow::Result<Option<ringlimit_client::Client>> {
    let Target::RingAware(targets) = target else {
        return Ok(None);
    };
    let mut config = ringlimit_client::ClientConfig::new(targets.iter().cloned());
    // A bench measures the cluster: a check that misses a short gateway deadline
    // must be a slow answer, not a local fail-open one.
    config.deadline = Duration::from_secs(5);
    config.coalesce = args.coalesce.then(|| {
        let mut coalesce = ringlimit_client::Coalesce::default();
        if args.coalesce_in_flight > 0 {
            coalesce.max_in_flight = args.coalesce_in_flight;
        }
        coalesce
    });
    let client = ringlimit_client::Client::connect(config).await?;
    anyhow::ensure!(
        client.members().len() == targets.len(),
        "the ring-aware client learned {:?}, expected {} members",
        client.members(),
        targets.len()
    );
    Ok(Some(client))
}

/// Caller number `worker` of a run: its own key sequence and, in open loop, its slot
/// in the schedule.
fn caller(
    args: &BenchArgs,
    keys: &Keys,
    target: &Target<'_>,
    worker: usize,
    counters: &Counters,
) -> Worker {
    Worker {
        keys: keys.clone(),
        rng: args.seed ^ (worker as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        pacing: (args.rate > 0.0).then(|| {
            let interval = Duration::from_secs_f64(args.concurrency as f64 / args.rate);
            // Callers start staggered across one interval, not all at once.
            let offset = interval.mul_f64(worker as f64 / args.concurrency as f64);
            Pacing {
                interval,
                next: Instant::now() + offset,
            }
        }),
        batch: args.batch,
        client: args.client,
        cost: args.cost,
        limit: args.limit,
        envoy: matches!(target, Target::Envoy(_))
            .then(|| (args.domain.clone(), args.descriptor_key.clone())),
        gubernator: matches!(target, Target::Gubernator(_)),
        health: matches!(target, Target::Health(_)),
        checks: counters.checks.clone(),
        allowed: counters.allowed.clone(),
        errors: counters.errors.clone(),
        measuring: counters.measuring.clone(),
        stop: counters.stop.clone(),
    }
}

/// The owner-kill fault: `kill -9` of node `pid` once `after` has passed.
async fn kill_after(pid: u32, after: Duration) {
    tokio::time::sleep(after).await;
    let killed = Command::new("kill").args(["-9", &pid.to_string()]).status();
    eprintln!(
        "  killed node pid {pid} at {} s: {killed:?}",
        after.as_secs()
    );
}

/// How many ring-aware answers needed a forward, and what coalescing did.
fn print_ring_aware(client: &ringlimit_client::Client, forwarded: &AtomicU64, coalesce: bool) {
    let stats = client.coalesce_stats();
    println!(
        "ring-aware: {} answers came after a forward (stale view){}",
        forwarded.load(Ordering::SeqCst),
        if coalesce {
            format!(
                "; coalescing: {} checks in {} calls",
                stats.checks, stats.calls
            )
        } else {
            String::new()
        }
    );
}
