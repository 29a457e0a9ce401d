//! The history: every operation as `invoke` then `ok` / `fail` / `info`, ring samples,
//! nemesis events, phase markers and metric scrapes, written as JSON lines as they happen
//! so that a failed run can be read and re-checked offline (`RINGLIMIT_CHAOS_RECHECK`).

use std::io::{BufRead, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Wall-clock Unix milliseconds (the nodes use the same clock for their windows).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// One rule of the run, as the checkers need it.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct RuleInfo {
    pub route: String,
    pub algorithm: String,
    pub limit: u64,
    pub window_ms: u64,
    pub burst: u64,
    /// `partition = "fence"` (a fail-closed rule's default): FENCE holds it to L.
    #[serde(default)]
    pub fenced: bool,
}

/// One member as a node's Status reported it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct MemberView {
    pub id: String,
    pub generation: u64,
    pub leaving: bool,
}

/// One line of the history.
#[derive(Serialize, Deserialize, Clone, Debug)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Entry {
    Meta {
        t: u64,
        seed: u64,
        profile: String,
        broken: bool,
        deadline_ms: u64,
        schedule: Vec<String>,
        rules: Vec<RuleInfo>,
    },
    Invoke {
        id: u64,
        client: u32,
        t: u64,
        key: String,
        route: String,
        cost: u64,
        node: String,
        addr: String,
    },
    Ok {
        id: u64,
        t: u64,
        allowed: bool,
        limit: u64,
        remaining: u64,
        decider: String,
        generation: u64,
        window_id: Option<u64>,
        sequence: u64,
        degraded: bool,
        hops: u32,
        rule: String,
        retry_after_ms: u64,
        /// Decided by the entry node from a budget lease (docs/leases.md): `decider` is
        /// the owner that charged the units when it granted the lease, `hops` 0,
        /// `sequence` 0. Absent (false) in histories from before leases.
        #[serde(default)]
        leased: bool,
    },
    Fail {
        id: u64,
        t: u64,
        error: String,
    },
    Info {
        id: u64,
        t: u64,
        error: String,
    },
    Ring {
        t: u64,
        round: u64,
        node: String,
        generation: u64,
        ok: bool,
        members: Vec<MemberView>,
        digest: u64,
        error: String,
    },
    Nemesis {
        t: u64,
        n: u32,
        kind: String,
        victim: String,
        edge: String,
        detail: String,
    },
    /// The clock-offset nemesis set `node`'s wall clock to real time + `offset_ms`
    /// (written before the offset file changes; the node reads it within its cache time).
    Clock {
        t: u64,
        node: String,
        offset_ms: i64,
    },
    Phase {
        t: u64,
        name: String,
        edge: String,
        faults: bool,
    },
    Spawn {
        t: u64,
        node: String,
        generation: u64,
        ip: String,
        grpc: String,
        pid: u32,
    },
    Exit {
        t: u64,
        node: String,
        generation: u64,
        how: String,
    },
    Metrics {
        t: u64,
        node: String,
        generation: u64,
        resets: u64,
        restarts: u64,
        fail_open: u64,
    },
    /// Every node of the run was started with `--replicate-interval-ms interval_ms`
    /// (0: replication off). A history without this line did not replicate (it predates
    /// successor replicas, or comes from a simulator that does not model them), so the
    /// S3-replicated property is not asserted on it.
    Replication {
        t: u64,
        interval_ms: u64,
    },
    /// Every node of the run was started with `--lease-threshold threshold` (budget
    /// leases, docs/leases.md) and leases last at most `ttl_ms`. A history without this
    /// line ran without leases (the nodes' default): no answer can be leased, and no
    /// owner's count moves by a grant the history does not show.
    Leases {
        t: u64,
        threshold: u64,
        ttl_ms: u64,
        /// The history has every grant and every return of the run (`lent` and
        /// `returned` lines, from the nodes' lease ledger). Absent (false) in histories
        /// from before the ledger: the checkers then only know which counters may have
        /// been lent.
        #[serde(default)]
        ledger: bool,
    },
    /// An owner's ledger line (`ringlimit::lease_ledger`, docs/leases.md): node
    /// `node` (generation `generation`) granted `units` of (`key`, `route`)'s counter
    /// (`counter`: its identity's hash) to `holder` as lease `serial`, charged in
    /// `window` (none for algorithms without windows), in its decision numbered
    /// `sequence`. Written after the run from the nodes' logs (`t`: when read).
    Lent {
        t: u64,
        node: String,
        generation: u64,
        key: String,
        route: String,
        counter: u64,
        holder: String,
        serial: u64,
        units: u64,
        window: Option<u64>,
        sequence: u64,
    },
    /// An owner's ledger line: the return of lease `serial` of `counter` gave `units`
    /// back to the counter (as a refund at the grant's instant) in the step numbered
    /// `sequence` of node `node` (generation `generation`).
    Returned {
        t: u64,
        node: String,
        generation: u64,
        counter: u64,
        serial: u64,
        units: u64,
        sequence: u64,
    },
}

/// The history file, appended to by every task of a run.
pub struct History {
    file: Mutex<BufWriter<std::fs::File>>,
    next_id: AtomicU64,
}

impl History {
    pub fn create(path: PathBuf) -> History {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("history dir");
        }
        let file = std::fs::File::create(&path).expect("create history file");
        History {
            file: Mutex::new(BufWriter::new(file)),
            next_id: AtomicU64::new(1),
        }
    }

    pub fn next_op_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn record(&self, entry: &Entry) {
        let line = serde_json::to_string(entry).expect("history entry serializes");
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(file, "{line}");
    }

    pub fn flush(&self) {
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        let _ = file.flush();
    }
}

/// Read a history file back (the checkers read nothing else).
pub fn load(path: &Path) -> Vec<Entry> {
    let file = std::fs::File::open(path)
        .unwrap_or_else(|e| panic!("open history {}: {e}", path.display()));
    std::io::BufReader::new(file)
        .lines()
        .enumerate()
        .filter_map(|(i, line)| {
            let line = line.ok()?;
            if line.trim().is_empty() {
                return None;
            }
            match serde_json::from_str(&line) {
                Ok(entry) => Some(entry),
                Err(e) => {
                    eprintln!(
                        "[history] {}:{}: unreadable line ({e})",
                        path.display(),
                        i + 1
                    );
                    None
                }
            }
        })
        .collect()
}
