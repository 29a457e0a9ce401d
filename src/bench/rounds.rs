//! The rounds of a load run: each round drives every system asked for once, in a fixed
//! order, so alternating systems share the machine's drift; then medians and ratios.

use std::time::Duration;

use super::args::{BenchArgs, ClientKind, Protocol};
use super::drive::{drive, Target};
use super::keys::Keys;
use super::redis;
use super::report::{median, median_cpu, print_front_ratio, RunResult};

/// Where a run's load goes and what it measures.
pub struct Systems<'a> {
    /// The nodes' gRPC addresses.
    pub targets: &'a [String],
    /// The node processes whose CPU is measured (empty: not measured).
    pub pids: &'a [u32],
    /// Redis and the reference script's SHA, with `--compare-redis`.
    pub redis: Option<&'a (redis::Server, String)>,
}

/// Every measured run, by system.
#[derive(Default)]
pub struct Rounds {
    /// The native `Check` (or the random-entry baseline of a ring-aware run).
    ours: Vec<RunResult>,
    /// Redis + the reference script.
    theirs: Vec<RunResult>,
    envoy: Vec<RunResult>,
    gubernator: Vec<RunResult>,
    health: Vec<RunResult>,
    /// The ring-aware client.
    aware: Vec<RunResult>,
}

impl Rounds {
    /// Runs `--rounds` rounds; `kill` (the owner-kill fault) goes to the first run.
    pub async fn run(
        args: &BenchArgs,
        keys: &Keys,
        systems: &Systems<'_>,
        mut kill: Option<(u32, Duration)>,
    ) -> anyhow::Result<Self> {
        let mut rounds = Rounds::default();
        for round in 1..=args.rounds.max(1) {
            if args.client == ClientKind::RingAware {
                rounds
                    .ring_aware(args, keys, systems, round, &mut kill)
                    .await?;
            } else {
                rounds
                    .by_protocol(args, keys, systems, round, &mut kill)
                    .await?;
            }
        }
        Ok(rounds)
    }

    /// A ring-aware round: the random-entry baseline (the lean client, one connection
    /// per caller to a random node), then the ring-aware client.
    async fn ring_aware(
        &mut self,
        args: &BenchArgs,
        keys: &Keys,
        systems: &Systems<'_>,
        round: usize,
        kill: &mut Option<(u32, Duration)>,
    ) -> anyhow::Result<()> {
        let (targets, pids) = (systems.targets, systems.pids);
        let random_entry = BenchArgs {
            client: ClientKind::Lean,
            ..args.clone()
        };
        println!("round {round}: random entry (lean client, random node)");
        let result = drive(
            &random_entry,
            keys,
            Target::Ringlimit(targets),
            pids,
            kill.take(),
        )
        .await?;
        result.print();
        self.ours.push(result);
        println!(
            "round {round}: ring-aware (ringlimit-client{})",
            if args.coalesce { ", coalescing" } else { "" }
        );
        let result = drive(args, keys, Target::RingAware(targets), pids, None).await?;
        result.print();
        self.aware.push(result);
        Ok(())
    }

    /// A round of the front ends `--protocol` names, then the native `Check`, then Redis.
    async fn by_protocol(
        &mut self,
        args: &BenchArgs,
        keys: &Keys,
        systems: &Systems<'_>,
        round: usize,
        kill: &mut Option<(u32, Duration)>,
    ) -> anyhow::Result<()> {
        let (targets, pids) = (systems.targets, systems.pids);
        if args.protocol.envoy() {
            println!("round {round}: ringlimit via envoy-rls");
            let result = drive(args, keys, Target::Envoy(targets), pids, kill.take()).await?;
            result.print();
            self.envoy.push(result);
        }
        if args.protocol.gubernator() {
            println!("round {round}: ringlimit via gubernator");
            let result = drive(args, keys, Target::Gubernator(targets), pids, kill.take()).await?;
            result.print();
            self.gubernator.push(result);
        }
        if args.protocol == Protocol::Health {
            println!("round {round}: tonic health check");
            let result = drive(args, keys, Target::Health(targets), pids, None).await?;
            result.print();
            self.health.push(result);
        }
        if !args.protocol.native() {
            return Ok(());
        }
        println!("round {round}: ringlimit");
        let result = drive(args, keys, Target::Ringlimit(targets), pids, kill.take()).await?;
        result.print();
        self.ours.push(result);
        if let Some((server, sha)) = systems.redis {
            println!("round {round}: redis");
            let redis_pid = [server.pid()];
            let target = Target::Redis(&server.addr, sha);
            let result = drive(args, keys, target, &redis_pid, None).await?;
            result.print();
            self.theirs.push(result);
        }
        Ok(())
    }

    /// The medians and ratios across rounds (bench/run-all.sh parses these lines).
    pub fn print_summary(&self) {
        print_front_ratio("envoy-rls", &self.envoy, &self.ours);
        print_front_ratio("gubernator", &self.gubernator, &self.ours);
        print_front_ratio("health", &self.health, &self.ours);
        if !self.aware.is_empty() && !self.ours.is_empty() {
            self.print_ring_aware();
        }
        if !self.theirs.is_empty() {
            self.print_redis();
        }
    }

    /// Ring-aware against random entry.
    fn print_ring_aware(&self) {
        let (aware, ours) = (&self.aware, &self.ours);
        let rate = |v: &[RunResult]| median(v.iter().map(RunResult::rate).collect());
        let p99 = |v: &[RunResult]| median(v.iter().map(|r| r.ms(0.99)).collect());
        let (ra, rr) = (rate(aware), rate(ours));
        println!(
            "median ring-aware checks/s {ra:.0} p99 {:.3} ms; random-entry checks/s {rr:.0} p99 {:.3} ms; ratio ring-aware/random-entry {:.2}",
            p99(aware),
            p99(ours),
            ra / rr
        );
        if let (Some(a), Some(r)) = (median_cpu(aware), median_cpu(ours)) {
            println!(
                "median server CPU per check: ring-aware {a:.1} µs, random-entry {r:.1} µs, ratio {:.2}",
                a / r
            );
        }
    }

    /// ringlimit against Redis + the reference script (and the health check's floor).
    fn print_redis(&self) {
        let (ours, theirs) = (&self.ours, &self.theirs);
        let rate_ours = median(ours.iter().map(RunResult::rate).collect());
        let rate_theirs = median(theirs.iter().map(RunResult::rate).collect());
        let p99_ours = median(ours.iter().map(|r| r.ms(0.99)).collect());
        let p99_theirs = median(theirs.iter().map(|r| r.ms(0.99)).collect());
        println!("median ringlimit checks/s {rate_ours:.0} p99 {p99_ours:.3} ms; redis checks/s {rate_theirs:.0} p99 {p99_theirs:.3} ms");
        println!(
            "ratio ringlimit/redis checks_per_s: {:.2}",
            rate_ours / rate_theirs
        );
        println!("ratio ringlimit/redis p99: {:.2}", p99_ours / p99_theirs);
        if let (Some(o), Some(t)) = (median_cpu(ours), median_cpu(theirs)) {
            println!("median server CPU per check: ringlimit {o:.1} µs, redis {t:.1} µs");
            println!("ratio ringlimit/redis cpu_per_check: {:.2}", o / t);
            if let Some(h) = median_cpu(&self.health) {
                println!("ratio health/redis cpu_per_call: {:.2}", h / t);
            }
        }
    }
}
