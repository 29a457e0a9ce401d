//! Counter snapshots in `--data-dir`: the I/O shell around the pure format
//! (`shard::snapshot`) and the policy of what is written.
//!
//! Every `--snapshot-interval-ms` the node copies each shard's keys and replicas in
//! one step of that shard ([`Shards::freeze`]: a `memcpy` of its slots, a shard at a
//! time), encodes the copy off the shards, and writes `counters.snap` atomically:
//! a temporary file, `fsync`, rename, `fsync` of the directory. A crash mid-write
//! leaves the previous snapshot. At start, before it answers as owner, the node loads
//! the file: states of windows that have ended, of rules it no longer has or that
//! opted out, and implausible ones are dropped; the rest is installed, and the first
//! state a peer hands over for a loaded key is joined with it, not added (see
//! [`ShardCore::install_snapshot`](crate::shard::ShardCore::install_snapshot)). A
//! file that is corrupt, truncated, of another format version or of another node is
//! refused whole, with a log line and `ringlimit_snapshot_refused_total{reason}`.
//!
//! What is written ([`Policy`]): the counters of rules that do not say
//! `snapshot = false` and whose window (a token bucket: the time it takes to refill
//! from empty) is at least `--snapshot-min-window-ms` (default
//! [`DEFAULT_MIN_WINDOW`]). The defaults and their measurements are in
//! docs/ownership.md and bench/RESULTS.md.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::algorithms::Millis;
use crate::clock::Clock;
use crate::cluster::handoff;
use crate::config::rules::{AlgorithmSpec, Rule};
use crate::config::{SharedEnvoy, SharedRules};
use crate::membership::ClusterView;
use crate::shard::snapshot::{self as format, Encoder, Header, Section, SnapshotError};
use crate::shard::{Exported, Shards};

/// The snapshot's file name in `--data-dir`.
pub const FILE: &str = "counters.snap";

/// The default `--snapshot-interval-ms`: a crash of every node loses at most what was
/// admitted in the last interval. At a million keys a snapshot costs ~0.1 s of one
/// core and holds each shard ~2 ms (bench/RESULTS.md, "Counter snapshots"): every 5 s
/// that is 2 % of a core with checks' p99 unchanged, and 5 s of an hourly quota is
/// 0.14 % of its window.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);

/// The default `--snapshot-min-window-ms`: counters of shorter windows are not
/// written. Such a window has ended, or nearly, by the time a crashed node is back (a
/// process restart takes seconds, a rescheduled pod tens of seconds), so its state
/// would restore little; and per-second and per-minute rules are where most keys
/// are, so leaving them out keeps the file to the quotas a restart must not reset
/// (hourly, daily, monthly).
pub const DEFAULT_MIN_WINDOW: Duration = Duration::from_secs(60);

/// How long after a start the first state a peer hands over for a loaded key is
/// joined with it rather than added: longer than a restarted cluster takes to
/// converge and restore (the restore deadline, a few gossip rounds).
pub const JOIN_WINDOW: Duration = Duration::from_secs(60);

/// Which counters a snapshot keeps, by rule fingerprint.
#[derive(Debug, Default)]
pub struct Policy {
    keep: HashMap<u64, bool>,
}

impl Policy {
    /// The policy over `rules`: a fingerprint is kept if every rule with those numbers
    /// allows snapshots and its window is at least `min_window`. Counters of
    /// fingerprints no rule has (rules removed, Gubernator's inline rules, fail-open
    /// fallbacks) are not kept.
    pub fn new<'a>(rules: impl Iterator<Item = &'a Arc<Rule>>, min_window: Duration) -> Self {
        let mut keep: HashMap<u64, bool> = HashMap::new();
        for rule in rules {
            let wanted = rule.snapshot && !rule.is_node_local() && memory(&rule.spec) >= min_window;
            *keep.entry(rule.fingerprint).or_insert(true) &= wanted;
        }
        Self { keep }
    }

    /// Whether counters built under `fingerprint` are kept.
    pub fn keeps(&self, fingerprint: u64) -> bool {
        self.keep.get(&fingerprint).copied().unwrap_or(false)
    }
}

/// How long a counter of `spec` remembers an admission: its window, or for a token
/// bucket the time to refill from empty (a bucket of a day's capacity refilled every
/// second is a daily quota).
pub fn memory(spec: &AlgorithmSpec) -> Duration {
    match *spec {
        AlgorithmSpec::TokenBucket {
            capacity,
            refill,
            period,
        } => period.saturating_mul(
            u32::try_from(capacity.get().div_ceil(refill.get())).unwrap_or(u32::MAX),
        ),
        _ => spec.window(),
    }
}

/// What one snapshot wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Written {
    /// Live keys written.
    pub live: u64,
    /// Replicas written.
    pub replicas: u64,
    /// Size of the file.
    pub bytes: u64,
    /// Most bytes the shard copies held at once.
    pub copy_bytes: u64,
}

/// What loading a snapshot did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Loaded {
    /// No snapshot in the data dir (a first start, or a lost volume).
    Absent,
    /// The file was refused whole.
    Refused(SnapshotError),
    /// The file could not be read (not a regular file, larger than the key cap allows,
    /// an I/O error): nothing of it loaded.
    Unreadable(String),
    /// Installed.
    Installed {
        /// Live keys installed.
        live: usize,
        /// Replicas held.
        replicas: usize,
        /// States dropped: ended windows, unknown or opted-out rules, implausible.
        dropped: usize,
        /// How old the snapshot was, in ms.
        age_ms: u64,
        /// The members the node saw when it wrote it (see [`Header::members`]).
        members: Vec<(String, u64)>,
    },
}

impl Loaded {
    /// The members the loaded snapshot names (none if nothing was loaded).
    pub fn members(self) -> Vec<(String, u64)> {
        match self {
            Loaded::Installed { members, .. } => members,
            _ => Vec::new(),
        }
    }
}

/// Why a snapshot could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotIoError {
    /// A file operation failed.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        error: std::io::Error,
    },
    /// A shard stopped (the node is shutting down).
    #[error("shard: {0}")]
    Shard(#[from] crate::shard::ShardError),
}

/// The node's snapshots: where, whose, of what.
#[derive(Clone)]
pub struct Snapshots {
    dir: PathBuf,
    cluster_id: String,
    node_id: String,
    shards: Shards,
    rules: SharedRules,
    envoy: SharedEnvoy,
    view: watch::Receiver<Arc<ClusterView>>,
    clock: Arc<dyn Clock>,
    min_window: Duration,
    /// Largest file read at start.
    max_bytes: u64,
}

impl Snapshots {
    /// Snapshots of this node's `shards` in `dir`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dir: PathBuf,
        cluster_id: String,
        node_id: String,
        shards: Shards,
        rules: SharedRules,
        envoy: SharedEnvoy,
        view: watch::Receiver<Arc<ClusterView>>,
        clock: Arc<dyn Clock>,
        min_window: Duration,
        max_bytes: u64,
    ) -> Self {
        Self {
            dir,
            cluster_id,
            node_id,
            shards,
            rules,
            envoy,
            view,
            clock,
            min_window,
            max_bytes,
        }
    }

    fn policy(&self) -> Policy {
        let (rules, envoy) = (self.rules.load(), self.envoy.load());
        Policy::new(rules.rules().iter().chain(envoy.rules()), self.min_window)
    }

    /// Take a snapshot and write it (see the module docs).
    pub async fn write(&self) -> Result<Written, SnapshotIoError> {
        let policy = Arc::new(self.policy());
        let header = Header {
            cluster_id: self.cluster_id.clone(),
            node_id: self.node_id.clone(),
            taken_at: self.clock.now_ms(),
            members: (self.view.borrow().members.iter())
                .map(|m| (m.node_id.clone(), m.generation))
                .collect(),
        };
        let mut encoder = Encoder::new(&header);
        let mut copy_bytes = 0;
        for shard in 0..self.shards.len() {
            let frozen = self.shards.freeze(shard).await?;
            copy_bytes = copy_bytes.max((frozen.live.bytes() + frozen.replicas.bytes()) as u64);
            let policy = policy.clone();
            // Encoding a shard's copy is CPU work: off the runtime the shards run on.
            encoder = tokio::task::spawn_blocking(move || {
                let mut encoder = encoder;
                let kept = |s: &Exported| policy.keeps(s.fingerprint);
                for state in frozen.live.states().filter(kept) {
                    encoder.push(Section::Live, &state);
                }
                for state in frozen.replicas.states().filter(kept) {
                    encoder.push(Section::Replica, &state);
                }
                encoder
            })
            .await
            .expect("the encoder does not panic");
        }
        let (live, replicas) = encoder.counts();
        let bytes = encoder.finish();
        let len = bytes.len() as u64;
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || write_atomic(&dir, &bytes))
            .await
            .expect("the writer does not panic")?;
        Ok(Written {
            live,
            replicas,
            bytes: len,
            copy_bytes,
        })
    }

    /// Write a snapshot every `every` until `cancel`.
    pub async fn run(self, every: Duration, cancel: CancellationToken) {
        let metrics = WriteMetrics::new();
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let started = Instant::now();
            match self.write().await {
                Ok(written) => {
                    metrics.record(&written, started.elapsed());
                    tracing::debug!(
                        live = written.live,
                        replicas = written.replicas,
                        bytes = written.bytes,
                        took_ms = started.elapsed().as_millis() as u64,
                        "snapshot written"
                    );
                }
                Err(SnapshotIoError::Shard(_)) => return,
                Err(error) => {
                    metrics.failed.increment(1);
                    tracing::warn!(%error, "snapshot not written: a crash now would lose counts back to the last one");
                }
            }
        }
    }

    /// Load the snapshot into the shards (see the module docs); logs and counts what
    /// happened. Never fails the start: a refused or unreadable file leaves the keys to
    /// what peers hold.
    pub async fn load(&self) -> Loaded {
        let loaded = self.load_inner().await;
        let result = match &loaded {
            Loaded::Absent => {
                tracing::info!(dir = %self.dir.display(), "no counter snapshot: keys start from what peers hold");
                "absent"
            }
            Loaded::Unreadable(error) => {
                metrics::counter!("ringlimit_snapshot_refused_total", "reason" => "unreadable")
                    .increment(1);
                tracing::error!(
                    path = %self.dir.join(FILE).display(),
                    reason = "unreadable",
                    %error,
                    "counter snapshot refused, nothing of it loaded: keys start from what peers hold"
                );
                "refused"
            }
            Loaded::Refused(error) => {
                metrics::counter!("ringlimit_snapshot_refused_total", "reason" => error.reason())
                    .increment(1);
                tracing::error!(
                    path = %self.dir.join(FILE).display(),
                    reason = error.reason(),
                    %error,
                    "counter snapshot refused, nothing of it loaded: keys start from what peers hold"
                );
                "refused"
            }
            Loaded::Installed {
                live,
                replicas,
                dropped,
                age_ms,
                ..
            } => {
                tracing::info!(live, replicas, dropped, age_ms, "counter snapshot loaded");
                "loaded"
            }
        };
        metrics::counter!("ringlimit_snapshot_loads_total", "result" => result).increment(1);
        loaded
    }

    async fn load_inner(&self) -> Loaded {
        let path = self.dir.join(FILE);
        let max = self.max_bytes;
        let read = tokio::task::spawn_blocking(move || read(&path, max))
            .await
            .expect("the reader does not panic");
        let bytes = match read {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return Loaded::Absent,
            Err(error) => return Loaded::Unreadable(error),
        };
        let snapshot = match format::decode(&bytes)
            .and_then(|s| s.belongs_to(&self.cluster_id, &self.node_id).map(|()| s))
        {
            Ok(snapshot) => snapshot,
            Err(error) => return Loaded::Refused(error),
        };
        let now = self.clock.now_ms();
        let policy = self.policy();
        let total = snapshot.live.len() + snapshot.replicas.len();
        let vet = |states: Vec<Exported>| {
            let (rules, envoy) = (self.rules.load(), self.envoy.load());
            let states = states
                .into_iter()
                .filter(|s| policy.keeps(s.fingerprint))
                .collect();
            let vetted =
                handoff::with_rule_list(states, rules.rules().iter().chain(envoy.rules()), now);
            vetted
                .items
                .into_iter()
                .filter(|(s, rule)| rule.limiter.expires_at(&s.state) > now)
                .collect::<Vec<_>>()
        };
        let (live, replicas) = (vet(snapshot.live), vet(snapshot.replicas));
        let until = now.saturating_add(JOIN_WINDOW.as_millis() as Millis);
        match self.shards.install_snapshot(live, replicas, until).await {
            Ok((live, replicas)) => Loaded::Installed {
                live,
                replicas,
                dropped: total - live - replicas,
                age_ms: now.saturating_sub(snapshot.header.taken_at),
                members: snapshot.header.members,
            },
            Err(_) => Loaded::Absent,
        }
    }
}

/// The snapshot write metrics.
struct WriteMetrics {
    written: metrics::Counter,
    failed: metrics::Counter,
    live: metrics::Gauge,
    replicas: metrics::Gauge,
    bytes: metrics::Gauge,
    seconds: metrics::Histogram,
}

impl WriteMetrics {
    fn new() -> Self {
        Self {
            written: metrics::counter!("ringlimit_snapshot_writes_total", "result" => "written"),
            failed: metrics::counter!("ringlimit_snapshot_writes_total", "result" => "failed"),
            live: metrics::gauge!("ringlimit_snapshot_states", "section" => "live"),
            replicas: metrics::gauge!("ringlimit_snapshot_states", "section" => "replica"),
            bytes: metrics::gauge!("ringlimit_snapshot_bytes"),
            seconds: metrics::histogram!("ringlimit_snapshot_write_seconds"),
        }
    }

    fn record(&self, written: &Written, took: Duration) {
        self.written.increment(1);
        self.live.set(written.live as f64);
        self.replicas.set(written.replicas as f64);
        self.bytes.set(written.bytes as f64);
        self.seconds.record(took.as_secs_f64());
    }
}

/// Write `bytes` as `dir/FILE` atomically: a temporary file, `fsync`, rename over the
/// last snapshot, `fsync` of the directory (the rename is durable once its entry is).
pub fn write_atomic(dir: &Path, bytes: &[u8]) -> Result<(), SnapshotIoError> {
    use std::io::Write;
    let io = |path: &Path| {
        let path = path.to_owned();
        move |error| SnapshotIoError::Io { path, error }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let (path, tmp) = (dir.join(FILE), dir.join(format!("{FILE}.tmp")));
    {
        let mut file = std::fs::File::create(&tmp).map_err(io(&tmp))?;
        file.write_all(bytes).map_err(io(&tmp))?;
        file.sync_all().map_err(io(&tmp))?;
    }
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))
}

/// The snapshot file's bytes, `None` when there is none. Read like the rule file: a
/// regular file only (a FIFO would block the start), at most `max_bytes`.
pub fn read(path: &Path, max_bytes: u64) -> Result<Option<Vec<u8>>, String> {
    use crate::config::rules::{read_rules_file_capped, RulesError};
    match read_rules_file_capped(path, max_bytes) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(RulesError::Io { error, .. }) if error.kind() == std::io::ErrorKind::NotFound => {
            Ok(None)
        }
        Err(error) => Err(error.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::rules::RuleSet;

    fn rules(toml: &str) -> RuleSet {
        RuleSet::from_toml_str(toml).expect("valid rules")
    }

    #[test]
    fn short_windows_and_opted_out_rules_are_not_kept() {
        let set = rules(
            r#"
[[rule]]
name = "hourly"
route = "GET /h"
algorithm = "fixed_window"
limit = 10
window = "1h"

[[rule]]
name = "per-second"
route = "GET /s"
algorithm = "fixed_window"
limit = 11
window = "1s"

[[rule]]
name = "private"
route = "GET /p"
algorithm = "fixed_window"
limit = 12
window = "1h"
snapshot = false

[[rule]]
name = "daily-bucket"
route = "GET /d"
algorithm = "token_bucket"
limit = 1
window = "1s"
burst = 86400
"#,
        );
        let policy = Policy::new(set.rules().iter(), DEFAULT_MIN_WINDOW);
        let fp = |name: &str| {
            set.rules()
                .iter()
                .find(|r| &*r.name == name)
                .expect("rule")
                .fingerprint
        };
        assert!(policy.keeps(fp("hourly")));
        assert!(!policy.keeps(fp("per-second")), "a 1 s window is skipped");
        assert!(!policy.keeps(fp("private")), "snapshot = false");
        assert!(policy.keeps(fp("daily-bucket")), "a day to refill");
        assert!(!policy.keeps(12345), "no rule has it");
        let everything = Policy::new(set.rules().iter(), Duration::ZERO);
        assert!(everything.keeps(fp("per-second")));
    }

    #[test]
    fn a_write_replaces_the_file_whole_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().expect("temp dir");
        write_atomic(dir.path(), b"first").expect("write");
        write_atomic(dir.path(), b"second").expect("write");
        assert_eq!(
            read(&dir.path().join(FILE), 1 << 20).expect("read"),
            Some(b"second".to_vec())
        );
        assert!(!dir.path().join(format!("{FILE}.tmp")).exists());
        assert_eq!(read(&dir.path().join("none"), 1 << 20), Ok(None));
    }

    /// Shards of one node on `clock`, and its snapshots in `dir` under `rules`.
    fn node(
        dir: &Path,
        rules: &RuleSet,
        clock: &crate::clock::ManualClock,
        tracker: &tokio_util::task::TaskTracker,
        cancel: &CancellationToken,
    ) -> (Shards, Snapshots) {
        let clock: Arc<dyn Clock> = Arc::new(clock.clone());
        let shards = Shards::spawn(
            &crate::shard::ShardConfig {
                shards: 2,
                ..Default::default()
            },
            clock.clone(),
            Arc::new(std::sync::atomic::AtomicU64::new(0)),
            tracker,
            cancel.clone(),
        );
        let (tx, view) = watch::channel(Arc::new(crate::cluster::policy::testkit::view(&[
            "node-a", "node-b",
        ])));
        std::mem::forget(tx);
        let snapshots = Snapshots::new(
            dir.to_owned(),
            "ringlimit".into(),
            "node-a".into(),
            shards.clone(),
            Arc::new(arc_swap::ArcSwap::from_pointee(rules.clone())),
            Arc::new(arc_swap::ArcSwap::from_pointee(
                crate::config::rules::envoy::EnvoyConfig::default(),
            )),
            view,
            clock,
            DEFAULT_MIN_WINDOW,
            1 << 20,
        );
        (shards, snapshots)
    }

    #[tokio::test]
    async fn a_restarted_node_loads_its_counts_drops_ended_windows_and_refuses_a_bad_file() {
        let set = rules(
            "[[rule]]\nname = \"hourly\"\nroute = \"GET /h\"\nalgorithm = \"fixed_window\"\nlimit = 10\nwindow = \"1h\"\n",
        );
        let rule = set
            .rules()
            .iter()
            .find(|r| &*r.name == "hourly")
            .unwrap()
            .clone();
        let dir = tempfile::tempdir().unwrap();
        let (tracker, cancel) = (
            tokio_util::task::TaskTracker::new(),
            CancellationToken::new(),
        );
        // Early in an hour, so the window is still open a minute later.
        let clock =
            crate::clock::ManualClock::new(1_800_000_000_000 / 3_600_000 * 3_600_000 + 1_000);
        let charge = |key: &str| crate::shard::Charge {
            id: crate::shard::KeyId::of("hourly", key.as_bytes(), ""),
            rule: rule.clone(),
            cost: std::num::NonZeroU64::MIN,
            give_back: None,
            drain: false,
            peek: false,
            target: Default::default(),
        };
        let (before, snapshots) = node(dir.path(), &set, &clock, &tracker, &cancel);
        for _ in 0..7 {
            before
                .check(smallvec::smallvec![charge("k")])
                .await
                .unwrap();
        }
        let written = snapshots.write().await.unwrap();
        assert_eq!((written.live, written.replicas), (1, 0));

        // A minute later: the count is back, before any check.
        clock.advance(60_000);
        let (after, snapshots) = node(dir.path(), &set, &clock, &tracker, &cancel);
        let loaded = snapshots.load().await;
        assert!(
            matches!(loaded, Loaded::Installed { live: 1, dropped: 0, ref members, .. } if members.len() == 2),
            "{loaded:?}"
        );
        let peek = crate::shard::Charge {
            peek: true,
            ..charge("k")
        };
        let answer = after
            .check(smallvec::smallvec![peek.clone()])
            .await
            .unwrap();
        assert_eq!(answer[0].decision.remaining, 3, "7 of 10 used");

        // The next hour: the window has ended, nothing is installed.
        clock.advance(3_600_000);
        let (later, snapshots) = node(dir.path(), &set, &clock, &tracker, &cancel);
        assert!(matches!(
            snapshots.load().await,
            Loaded::Installed {
                live: 0,
                dropped: 1,
                ..
            }
        ),);
        assert_eq!(later.keys().await.unwrap(), 0);

        // One flipped byte: refused whole, nothing installed.
        let path = dir.path().join(FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();
        clock.advance(1);
        let (damaged, snapshots) = node(dir.path(), &set, &clock, &tracker, &cancel);
        assert_eq!(
            snapshots.load().await,
            Loaded::Refused(SnapshotError::Checksum)
        );
        assert_eq!(damaged.keys().await.unwrap(), 0);

        // Another node's file is not this node's to load.
        let foreign = format::encode(&format::Snapshot {
            header: Header {
                cluster_id: "ringlimit".into(),
                node_id: "node-b".into(),
                taken_at: 0,
                members: vec![],
            },
            live: vec![],
            replicas: vec![],
        });
        write_atomic(dir.path(), &foreign).unwrap();
        let (_, snapshots) = node(dir.path(), &set, &clock, &tracker, &cancel);
        assert!(matches!(
            snapshots.load().await,
            Loaded::Refused(SnapshotError::Foreign { .. })
        ));
        cancel.cancel();
    }
}
