//! The rounds of a load run: each round drives every system asked for once, in a fixed
//! order, so alternating systems share the machine's drift; then medians and ratios.

use std::time::Duration;

use super::args::{BenchArgs, ClientKind, Entry, Protocol};
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
    /// `--entry owner`: every check sent to its key's owner.
    local: Vec<RunResult>,
    /// `--entry non-owner`: every check forwarded once.
    forwarded: Vec<RunResult>,
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
        if args.entry != Entry::Random {
            let (own, others) = entry_keys(keys, systems.targets).await?;
            for round in 1..=args.rounds.max(1) {
                rounds.by_entry(args, systems, round, &own, &others).await?;
            }
            return Ok(rounds);
        }
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
        self.redis_run(args, keys, systems, round).await
    }

    /// With `--compare-redis`, Redis + the reference script with the same callers.
    async fn redis_run(
        &mut self,
        args: &BenchArgs,
        keys: &Keys,
        systems: &Systems<'_>,
        round: usize,
    ) -> anyhow::Result<()> {
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

    /// An `--entry` round: to the owners, then to non-owners (as `--entry` says).
    async fn by_entry(
        &mut self,
        args: &BenchArgs,
        systems: &Systems<'_>,
        round: usize,
        own: &[Keys],
        others: &[Keys],
    ) -> anyhow::Result<()> {
        let (targets, pids) = (systems.targets, systems.pids);
        if matches!(args.entry, Entry::Owner | Entry::Both) {
            println!("round {round}: every check to its key's owner (local)");
            let mut result = drive(args, &own[0], Target::Pinned(targets, own), pids, None).await?;
            result.system = "local";
            result.print();
            self.local.push(result);
        }
        if matches!(args.entry, Entry::NonOwner | Entry::Both) {
            println!("round {round}: every check to a node that does not own its key (forwarded)");
            let target = Target::Pinned(targets, others);
            let mut result = drive(args, &others[0], target, pids, None).await?;
            result.system = "forwarded";
            result.print();
            self.forwarded.push(result);
        }
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
        self.redis_run(args, keys, systems, round).await
    }

    /// The medians and ratios across rounds (bench/run-all.sh parses these lines).
    pub fn print_summary(&self) {
        print_front_ratio("envoy-rls", &self.envoy, &self.ours);
        print_front_ratio("gubernator", &self.gubernator, &self.ours);
        print_front_ratio("health", &self.health, &self.ours);
        print_forwarded(&self.forwarded, &self.local);
        if !self.aware.is_empty() && !self.ours.is_empty() {
            self.print_ring_aware();
        }
        if !self.theirs.is_empty() {
            if self.aware.is_empty() {
                self.print_redis("ringlimit", &self.ours);
            } else {
                // The gateway path (issue 25, point 3): the ring-aware client against
                // Redis with the same callers; random entry is the line above.
                self.print_redis("ring-aware", &self.aware);
            }
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

    /// `ours` (named `name`) against Redis + the reference script (and the health
    /// check's floor), with the ratio of each round in brackets.
    fn print_redis(&self, name: &str, ours: &[RunResult]) {
        let theirs = &self.theirs;
        let rate_ours = median(ours.iter().map(RunResult::rate).collect());
        let rate_theirs = median(theirs.iter().map(RunResult::rate).collect());
        let p99_ours = median(ours.iter().map(|r| r.ms(0.99)).collect());
        let p99_theirs = median(theirs.iter().map(|r| r.ms(0.99)).collect());
        println!("median {name} checks/s {rate_ours:.0} p99 {p99_ours:.3} ms; redis checks/s {rate_theirs:.0} p99 {p99_theirs:.3} ms");
        let rounds = |f: &dyn Fn(&RunResult) -> Option<f64>| -> String {
            let per: Vec<String> = ours
                .iter()
                .zip(theirs)
                .filter_map(|(o, t)| Some(format!("{:.2}", f(o)? / f(t)?)))
                .collect();
            per.join(" ")
        };
        println!(
            "ratio {name}/redis checks_per_s: {:.2} (per round {})",
            rate_ours / rate_theirs,
            rounds(&|r| Some(r.rate()))
        );
        println!(
            "ratio {name}/redis p99: {:.2} (per round {})",
            p99_ours / p99_theirs,
            rounds(&|r| Some(r.ms(0.99)))
        );
        if let (Some(o), Some(t)) = (median_cpu(ours), median_cpu(theirs)) {
            println!("median server CPU per check: {name} {o:.1} µs, redis {t:.1} µs");
            println!(
                "ratio {name}/redis cpu_per_check: {:.2} (per round {})",
                o / t,
                rounds(&|r| r.cpu_us_per_check())
            );
            if let Some(h) = median_cpu(&self.health) {
                println!("ratio health/redis cpu_per_call: {:.2}", h / t);
            }
        }
    }
}

/// The forwarded check against the local one (issue 25: goal ≤ 1.5 in server CPU).
fn print_forwarded(forwarded: &[RunResult], local: &[RunResult]) {
    if forwarded.is_empty() || local.is_empty() {
        return;
    }
    let rate = |v: &[RunResult]| median(v.iter().map(RunResult::rate).collect());
    println!(
        "median forwarded checks/s {:.0}, local checks/s {:.0}, ratio {:.2}",
        rate(forwarded),
        rate(local),
        rate(forwarded) / rate(local)
    );
    if let (Some(f), Some(l)) = (median_cpu(forwarded), median_cpu(local)) {
        let per_round: Vec<String> = forwarded
            .iter()
            .zip(local)
            .filter_map(|(f, l)| {
                Some(format!(
                    "{:.2}",
                    f.cpu_us_per_check()? / l.cpu_us_per_check()?
                ))
            })
            .collect();
        println!("median server CPU per check: forwarded {f:.1} µs, local {l:.1} µs");
        println!(
            "ratio forwarded/local cpu_per_check: {:.2} (goal <= 1.5; per round {})",
            f / l,
            per_round.join(" ")
        );
    }
}

/// Per target, the run's keys it owns and the keys it does not, placed by the ring the
/// nodes publish (the ring-aware client's view of it).
async fn entry_keys(keys: &Keys, targets: &[String]) -> anyhow::Result<(Vec<Keys>, Vec<Keys>)> {
    let config = ringlimit_client::ClientConfig::new(targets.iter().cloned());
    let client = ringlimit_client::Client::connect(config).await?;
    let members = client.members();
    anyhow::ensure!(
        members.len() == targets.len(),
        "the nodes publish {members:?}, expected {} members",
        targets.len()
    );
    let bare = |a: &str| a.trim_start_matches("http://").to_string();
    let id_of = |target: &str| {
        members
            .iter()
            .find(|(_, addr)| bare(addr) == bare(target))
            .map(|(id, _)| id.clone())
            .ok_or_else(|| anyhow::anyhow!("{target} is not among the members {members:?}"))
    };
    let (mut own, mut others) = (Vec::new(), Vec::new());
    for target in targets {
        let id = id_of(target)?;
        let owner = |k: &str| client.owner(k).as_deref() == Some(id.as_str());
        own.push(keys.filtered(owner)?);
        others.push(keys.filtered(|k| !owner(k))?);
    }
    Ok((own, others))
}
