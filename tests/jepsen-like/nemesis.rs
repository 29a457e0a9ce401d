//! The nemesis: a schedule of faults generated from the seed, and its execution.

use std::sync::Arc;
use std::time::Duration;

use ringlimit::ring::Ring;

use crate::harness::process::{signal, Signal};
use crate::harness::{Harness, NodeState};
use crate::history::{now_ms, Entry};
use crate::workload::Rng;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// kill -9, then restart with the same id (new generation).
    KillRestart,
    /// kill -9, then start a node with a new id in its place.
    KillReplace,
    /// SIGSTOP, then SIGCONT.
    Pause,
    /// Start an extra node.
    Add,
    /// SIGTERM: graceful leave with state handoff.
    Leave,
    /// iptables DROP between one node and every other node, both directions.
    Partition,
    /// Step one node's wall clock forward or back (libfaketime), then back to real
    /// time: both directions in one step.
    ClockOffset,
    /// kill -9 a hot key's owner and its successor together (the replica dies with the
    /// owner: the documented loss, L × D), then restart both with their ids or replace
    /// both with new ones.
    KillBoth,
    /// Every running node in turn: SIGTERM (graceful leave), start again with its id,
    /// wait until the cluster converged, next. Long profile only.
    RollingRestart,
}

impl Kind {
    pub const ALL: [Kind; 8] = [
        Kind::KillRestart,
        Kind::KillReplace,
        Kind::Pause,
        Kind::Add,
        Kind::Leave,
        Kind::Partition,
        Kind::ClockOffset,
        Kind::KillBoth,
    ];
    /// What the long profile draws from: every kind of the short one, and a rolling
    /// restart of the whole cluster (long: it restarts every node).
    pub const LONG: [Kind; 9] = [
        Kind::KillRestart,
        Kind::KillReplace,
        Kind::Pause,
        Kind::Add,
        Kind::Leave,
        Kind::Partition,
        Kind::ClockOffset,
        Kind::KillBoth,
        Kind::RollingRestart,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Kind::KillRestart => "kill-restart",
            Kind::KillReplace => "kill-replace",
            Kind::Pause => "pause",
            Kind::Add => "add",
            Kind::Leave => "leave",
            Kind::Partition => "partition",
            Kind::ClockOffset => "clock-offset",
            Kind::KillBoth => "kill-both",
            Kind::RollingRestart => "rolling-restart",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Step {
    pub kind: Kind,
    /// Index (mod the number of candidates) of the victim among running nodes by id.
    pub victim_pick: u64,
    /// How long the fault lasts (down time, pause, partition) in ms.
    pub hold_ms: u64,
    /// Quiet time after the cluster converged again, in ms.
    pub settle_ms: u64,
    /// Clock offset in whole seconds (clock-offset only; never 0): within ±3 s, under
    /// the 5 s skew a handed-over state is vetted against.
    pub offset_s: i64,
}

impl Step {
    pub fn describe(&self) -> String {
        let offset = if self.kind == Kind::ClockOffset {
            format!(" offset={:+}s", self.offset_s)
        } else {
            String::new()
        };
        format!(
            "{}(victim#{} hold={}ms settle={}ms{offset})",
            self.kind.name(),
            self.victim_pick % 97,
            self.hold_ms,
            self.settle_ms
        )
    }
}

fn hold_for(kind: Kind, rng: &mut Rng, long: bool) -> u64 {
    let scale = if long { 2 } else { 1 };
    match kind {
        // Sometimes back before the failure detector notices (< ~1.1 s), sometimes after.
        Kind::KillRestart => rng.range(300, 3000 * scale),
        Kind::KillReplace => rng.range(1500, 3000 * scale),
        Kind::KillBoth => rng.range(300, 3000 * scale),
        Kind::Pause => rng.range(1500, 3500 * scale),
        Kind::Partition => rng.range(2500, 4000 * scale),
        Kind::ClockOffset => rng.range(2000, 4000 * scale),
        Kind::Add | Kind::Leave | Kind::RollingRestart => 0,
    }
}

/// Short profile: every kind once in a seeded order (an add before the leave, so
/// three nodes never shrink to two for long); long profile: a random mix of `events`
/// steps keeping between `min_live` and `max_live` members.
pub fn schedule(seed: u64, long: bool, initial: usize, events: usize) -> Vec<Step> {
    let mut rng = Rng::new(seed ^ 0x4E45_4D45_5349_5300);
    let mut steps = Vec::new();
    if !long {
        let mut kinds = Kind::ALL.to_vec();
        for i in (1..kinds.len()).rev() {
            let j = rng.range(0, i as u64) as usize;
            kinds.swap(i, j);
        }
        let add = kinds.iter().position(|k| *k == Kind::Add).unwrap();
        let leave = kinds.iter().position(|k| *k == Kind::Leave).unwrap();
        if leave < add {
            kinds.swap(add, leave);
        }
        for kind in kinds {
            steps.push(Step {
                kind,
                victim_pick: rng.next_u64(),
                hold_ms: hold_for(kind, &mut rng, false),
                settle_ms: rng.range(1000, 2000),
                offset_s: offset_for(&mut rng),
            });
        }
    } else {
        let (min_live, max_live) = (initial - 1, initial + 1);
        let mut live = initial;
        while steps.len() < events {
            let kind = *rng.pick(&Kind::LONG);
            match kind {
                Kind::Add if live >= max_live => continue,
                Kind::Leave if live <= min_live => continue,
                Kind::Add => live += 1,
                Kind::Leave => live -= 1,
                _ => {}
            }
            steps.push(Step {
                kind,
                victim_pick: rng.next_u64(),
                hold_ms: hold_for(kind, &mut rng, true),
                settle_ms: rng.range(1000, 4000),
                offset_s: offset_for(&mut rng),
            });
        }
    }
    steps
}

/// ±1..3 s.
fn offset_for(rng: &mut Rng) -> i64 {
    let magnitude = rng.range(1, 3) as i64;
    if rng.range(0, 1) == 0 {
        magnitude
    } else {
        -magnitude
    }
}

fn record(h: &Harness, n: u32, kind: Kind, victim: &str, edge: &str, detail: String) {
    eprintln!("[nemesis] #{n} {} {victim} {edge} {detail}", kind.name());
    h.history.record(&Entry::Nemesis {
        t: now_ms(),
        n,
        kind: kind.name().into(),
        victim: victim.into(),
        edge: edge.into(),
        detail,
    });
}

async fn scrape_all(h: &Harness) {
    for (id, _) in h.running() {
        let _ = h.scrape(&id).await;
    }
}

/// The hot keys of the workload (`hot-0` ..): the kill-both nemesis picks one.
const HOT_KEYS: u64 = 4;

/// The owner and the successor of hot key `hot-<pick % HOT_KEYS>` on the ring over the
/// running members (every node is up between steps), as the nodes place it.
fn owner_and_successor(h: &Harness, pick: u64) -> Result<(String, String, String), String> {
    let key = format!("hot-{}", pick % HOT_KEYS);
    let ring = Ring::new(h.expected_ring(), Ring::DEFAULT_VNODES);
    let owner = ring.owner(key.as_bytes()).ok_or("empty ring")?.to_string();
    let successor = ring
        .successor_of_hash(Ring::key_hash(key.as_bytes()))
        .ok_or("a ring of one member has no successor")?
        .to_string();
    Ok((key, owner, successor))
}

/// kill -9 a hot key's owner and successor (within a millisecond of each other: one
/// step for the checker), hold, then bring both back: with their ids (new generations)
/// or, on odd picks, as two new nodes.
async fn kill_both(h: &Arc<Harness>, n: u32, step: &Step) -> Result<String, String> {
    scrape_all(h).await;
    let (key, owner, successor) = owner_and_successor(h, step.victim_pick)?;
    let victims = [owner, successor];
    let ips: Vec<_> = victims.iter().map(|v| h.last_ip(v).unwrap()).collect();
    let gens: Vec<_> = victims.iter().map(|v| h.kill9(v)).collect();
    let label = victims.join("+");
    record(
        h,
        n,
        step.kind,
        &label,
        "start",
        format!("{key}: killed owner and successor, generations {gens:?}"),
    );
    tokio::time::sleep(Duration::from_millis(step.hold_ms)).await;
    let replace = (step.victim_pick >> 32) & 1 == 1;
    let mut back = Vec::new();
    for (victim, ip) in victims.iter().zip(ips) {
        if replace {
            let (id, ip) = h.new_identity();
            h.start_node(&id, ip).await?;
            back.push(format!("{victim} replaced by {id} on {ip}"));
        } else {
            h.start_node(victim, ip).await?;
            let gen = h.with_node(victim, |n| n.process.ready.generation);
            back.push(format!("{victim} restarted as generation {gen:?}"));
        }
    }
    record(h, n, step.kind, &label, "end", back.join(", "));
    Ok(label)
}

/// Restart every node of `order` in turn as an orchestrator's rolling update does:
/// SIGTERM (the node hands its keys over), start it again with its id on its address,
/// wait until every node sees the full ring, next.
async fn rolling_restart(
    h: &Arc<Harness>,
    n: u32,
    step: &Step,
    order: Vec<String>,
) -> Result<String, String> {
    scrape_all(h).await;
    // Every node is a victim in turn: named "a+b+…" as kill-both names its two, so the
    // availability checker expects no key to be untouched by the step.
    let label = order.join("+");
    record(
        h,
        n,
        step.kind,
        &label,
        "start",
        format!("SIGTERM, start, converge, in turn: {}", order.join(",")),
    );
    for node in &order {
        let ip = h.last_ip(node).ok_or("no address")?;
        let took = h.leave(node, Duration::from_secs(20)).await?;
        h.start_node(node, ip).await?;
        h.wait_converged(Duration::from_secs(15)).await?;
        let gen = h.with_node(node, |n| n.process.ready.generation);
        eprintln!(
            "[nemesis] #{n} rolling-restart: {node} left in {took:?}, back as generation {gen:?}"
        );
    }
    record(
        h,
        n,
        step.kind,
        &label,
        "end",
        "every node restarted".into(),
    );
    Ok(label)
}

/// Run one step: inject, hold, heal, then wait for convergence and settle.
pub async fn run_step(h: &Arc<Harness>, n: u32, step: &Step) -> Result<(), String> {
    let mut candidates: Vec<String> = h
        .running()
        .into_iter()
        .filter(|(_, s)| *s == NodeState::Up)
        .map(|(id, _)| id)
        .collect();
    candidates.sort();
    let mut victim = candidates[(step.victim_pick % candidates.len() as u64) as usize].clone();
    let hold = Duration::from_millis(step.hold_ms);
    match step.kind {
        Kind::KillRestart => {
            scrape_all(h).await;
            let ip = h.last_ip(&victim).unwrap();
            let gen = h.kill9(&victim);
            record(
                h,
                n,
                step.kind,
                &victim,
                "start",
                format!("killed generation {gen:?}"),
            );
            tokio::time::sleep(hold).await;
            h.start_node(&victim, ip).await?;
            let gen = h.with_node(&victim, |n| n.process.ready.generation);
            record(
                h,
                n,
                step.kind,
                &victim,
                "end",
                format!("restarted as generation {gen:?}"),
            );
        }
        Kind::KillReplace => {
            scrape_all(h).await;
            let gen = h.kill9(&victim);
            record(
                h,
                n,
                step.kind,
                &victim,
                "start",
                format!("killed generation {gen:?}"),
            );
            tokio::time::sleep(hold).await;
            let (id, ip) = h.new_identity();
            h.start_node(&id, ip).await?;
            record(
                h,
                n,
                step.kind,
                &victim,
                "end",
                format!("replaced by {id} on {ip}"),
            );
        }
        Kind::Pause => {
            let pid = h.pid(&victim).ok_or("victim gone")?;
            h.set_state(&victim, NodeState::Paused);
            // Returns once every thread is stopped, so the fault's start in the history
            // is when the node really stopped answering.
            signal(pid, Signal::Stop).await?;
            record(
                h,
                n,
                step.kind,
                &victim,
                "start",
                format!("SIGSTOP pid {pid}"),
            );
            tokio::time::sleep(hold).await;
            signal(pid, Signal::Cont).await?;
            h.set_state(&victim, NodeState::Up);
            record(
                h,
                n,
                step.kind,
                &victim,
                "end",
                format!("SIGCONT pid {pid}"),
            );
        }
        Kind::Add => {
            let (id, ip) = h.new_identity();
            record(
                h,
                n,
                step.kind,
                &id,
                "start",
                format!("starting {id} on {ip}"),
            );
            h.start_node(&id, ip).await?;
            record(h, n, step.kind, &id, "end", "joined".into());
        }
        Kind::Leave => {
            scrape_all(h).await;
            record(h, n, step.kind, &victim, "start", "SIGTERM".into());
            let took = h.leave(&victim, Duration::from_secs(20)).await;
            record(h, n, step.kind, &victim, "end", format!("exited: {took:?}"));
            took?;
        }
        Kind::Partition => {
            if !h.iptables_ok {
                eprintln!("[nemesis] iptables unavailable: the partition nemesis is SKIPPED");
                record(
                    h,
                    n,
                    step.kind,
                    &victim,
                    "skipped",
                    "iptables unavailable".into(),
                );
                return Ok(());
            }
            h.set_state(&victim, NodeState::Partitioned);
            let cutting = std::time::Instant::now();
            match h.partition(&victim) {
                Ok(rules) => {
                    // The first rule cut the victim off from one peer this long before
                    // the line: FENCE counts its replica lag from there.
                    record(
                        h,
                        n,
                        step.kind,
                        &victim,
                        "start",
                        format!(
                            "{rules} iptables DROP rules in {} ms",
                            cutting.elapsed().as_millis()
                        ),
                    );
                    tokio::time::sleep(hold).await;
                    h.heal_partitions();
                    h.set_state(&victim, NodeState::Up);
                    record(h, n, step.kind, &victim, "end", "rules removed".into());
                }
                Err(e) => {
                    h.set_state(&victim, NodeState::Up);
                    eprintln!("[nemesis] iptables failed ({e}): the partition nemesis is SKIPPED");
                    record(
                        h,
                        n,
                        step.kind,
                        &victim,
                        "skipped",
                        format!("iptables failed: {e}"),
                    );
                    return Ok(());
                }
            }
        }
        Kind::KillBoth => victim = kill_both(h, n, step).await?,
        Kind::RollingRestart => victim = rolling_restart(h, n, step, candidates).await?,
        Kind::ClockOffset => {
            if h.faketime.is_none() {
                eprintln!("[nemesis] libfaketime unavailable: the clock-offset nemesis is SKIPPED");
                record(
                    h,
                    n,
                    step.kind,
                    &victim,
                    "skipped",
                    "libfaketime unavailable".into(),
                );
                return Ok(());
            }
            h.set_clock_offset(&victim, step.offset_s)?;
            record(
                h,
                n,
                step.kind,
                &victim,
                "start",
                format!("wall clock {:+}s", step.offset_s),
            );
            tokio::time::sleep(hold).await;
            h.set_clock_offset(&victim, 0)?;
            record(h, n, step.kind, &victim, "end", "wall clock +0s".into());
        }
    }
    let converged = h.wait_converged(Duration::from_secs(15)).await;
    record(
        h,
        n,
        step.kind,
        &victim,
        "settled",
        format!("converged: {converged:?}"),
    );
    converged?;
    let mut settle = step.settle_ms;
    if step.kind == Kind::ClockOffset {
        // After a step back the node's clamped clock stands still until real time
        // catches up, and it reads the offset file up to a second late: settle past both.
        settle = settle.max(step.offset_s.unsigned_abs() * 1000 + 2000);
    }
    tokio::time::sleep(Duration::from_millis(settle)).await;
    Ok(())
}
