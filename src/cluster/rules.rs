//! The rule set as cluster state: one versioned document, written on any node, copied
//! to every node, persisted on each (docs/rules.md, "Rules are cluster state").
//!
//! [`ClusterRules`] is a node's authority over the rules it enforces. It holds the
//! current (version, rule set), swaps the hot path's [`SharedRules`] when they change, and
//! publishes this node's [`Advert`] (source, version, digest) for gossip. Three things
//! change it:
//!
//! - a write through the API ([`ClusterRules::write`], cluster mode only), sent to the
//!   **rules coordinator** ([`coordinator`]: the ring owner of the fixed key
//!   `ringlimit/rules`) over the peer face, where it is validated, given the next
//!   version, persisted and swapped in; `If-Match` makes it conditional on the version
//!   the writer read, checked against the coordinator's copy. The receiving node then
//!   enforces the coordinator's answer at once;
//! - a newer copy on a peer ([`ClusterRules::sync`]): every member gossips its advert; a
//!   node that sees a greater stamp pulls the document over the authenticated peer face,
//!   validates it, checks its digest, persists it and swaps it in;
//! - a file reload ([`ClusterRules::reload_file`], file mode only).
//!
//! Swapping a rule set keeps the counters of every rule whose fingerprint is unchanged
//! (counters are keyed by rule name and checked against the fingerprint when used), as a
//! file reload always has.
//!
//! # Races
//!
//! With one coordinator, writes are ordered in one place: two writers racing without
//! `If-Match` both succeed, one after the other (versions N+1 and N+2, the later one in
//! force); two writers racing with the same `If-Match` get one success and one 412.
//! Only while rings disagree (a member joining or dying, a partition) can two nodes
//! each believe they coordinate, and each accept a write from the same version. Stamps
//! are ordered by version, then digest ([`Stamp`]), so of two versions N+1 the one with
//! the greater digest wins on every node, and the other is overwritten where it was
//! accepted, within the time gossip takes to carry the adverts (well under 2 s on
//! loopback).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::{watch, Mutex};
use tokio_util::sync::CancellationToken;

use crate::cluster::link::{PeerPool, PulledRules, RemoteWriteError};
pub use crate::cluster::rules_edit::{Refusal, RulesEdit, Written};
use crate::config::rules::envoy::EnvoyConfig;
use crate::config::rules::{
    best_source, store, Advert, DocEnvoy, EnvoyAdvert, RuleSet, RulesDoc, RulesError, RulesSource,
    Stamp, StoreError,
};
use crate::config::{SharedEnvoy, SharedRules};
use crate::membership::{ClusterView, Member, MemberValues};
use crate::ring::Ring;

/// The key whose ring owner coordinates rules writes.
pub const COORDINATOR_KEY: &[u8] = b"ringlimit/rules";

/// The member that orders rules writes in `view`: the ring owner of [`COORDINATOR_KEY`],
/// so every node that agrees on the ring agrees on it, and it moves like any key when
/// members come and go. `None` with an empty ring.
pub fn coordinator(view: &ClusterView) -> Option<&Member> {
    view.owner_of_placement(Ring::key_hash(COORDINATOR_KEY))
}

impl RulesEdit {
    /// The `[envoy]` section this edit sets, for the edits that set one.
    fn envoy_section(&self) -> Option<&Option<DocEnvoy>> {
        match self {
            RulesEdit::Replace(doc) => Some(&doc.envoy),
            RulesEdit::ReplaceEnvoy(envoy) => Some(envoy),
            RulesEdit::PutTierLimit { .. } | RulesEdit::DeleteTierLimit { .. } => None,
        }
    }

    /// The edited document and, for a tier rule written, its name.
    fn apply(self, doc: &RulesDoc) -> Result<(RulesDoc, Option<String>), RulesWriteError> {
        match self {
            RulesEdit::Replace(new) => Ok((new, None)),
            RulesEdit::ReplaceEnvoy(envoy) => Ok((
                RulesDoc {
                    envoy,
                    ..doc.clone()
                },
                None,
            )),
            RulesEdit::PutTierLimit { tier, limit } => {
                let mut doc = doc.clone();
                let name = doc.put_tier_limit(&tier, limit)?;
                Ok((doc, Some(name)))
            }
            RulesEdit::DeleteTierLimit { tier, route } => {
                let mut doc = doc.clone();
                if doc.delete_tier_limit(&tier, route.as_deref()) {
                    Ok((doc, None))
                } else {
                    Err(RulesWriteError::NotFound(format!(
                        "no rule for tier {tier:?} with {}",
                        route
                            .as_deref()
                            .map_or("no route_pattern".to_string(), |r| format!(
                                "route_pattern {r:?}"
                            ))
                    )))
                }
            }
        }
    }
}

/// The gossip key-value carrying a node's [`Advert`].
pub const KEY_RULES: &str = "rules";

/// The gossip key-value carrying a node's [`EnvoyAdvert`]. A key of its own rather than
/// a fourth field of `rules`: an older build reads `rules` strictly (three fields) and
/// would take a longer value for garbage, and it ignores a key it does not know.
pub const KEY_ENVOY: &str = "envoy";

/// How often the sync loop looks again without a gossip change (a failed pull is
/// retried then).
const RESYNC: Duration = Duration::from_millis(500);

/// The rules a node enforces now, with their version.
#[derive(Debug)]
pub struct Current {
    /// Cluster mode: the cluster's version. File mode: reloads since start (from 1).
    pub version: u64,
    /// The rule set (and its document and digest).
    pub rules: Arc<RuleSet>,
}

impl Current {
    /// Version and digest.
    pub fn stamp(&self) -> Stamp {
        Stamp {
            version: self.version,
            digest: self.rules.digest(),
        }
    }
}

/// Why a write was refused. Nothing changed in every case.
#[derive(Debug, thiserror::Error)]
pub enum RulesWriteError {
    /// File mode: the files are the truth.
    #[error("rules come from the --rules file on every node: the API is read-only (change the file instead)")]
    ReadOnly,
    /// The edit changes the `[envoy]` section, but this node serves Envoy from its own
    /// `--envoy-config` or `--envoy-xds`: the change would not apply here.
    #[error("this node serves Envoy domains from its --envoy-config files or --envoy-xds control plane, so the API does not change them here (change them there, or send the write to a node started without either)")]
    EnvoyReadOnly,
    /// `If-Match` named another version than the current one.
    #[error("If-Match names version {given}, but the current version is {current}: read the rules again and retry")]
    Stale {
        /// The version the writer read.
        given: u64,
        /// The version in force.
        current: u64,
    },
    /// The document that would result is invalid; the message names rule and field.
    #[error("{0}")]
    Invalid(#[from] RulesError),
    /// The edit names a rule that does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The version cannot grow any more (a member advertised the largest version there
    /// is): nothing a writer can fix, so it is said plainly rather than wrapped to 0.
    #[error("the rules version is at its maximum ({0}); no further version can be given out")]
    Exhausted(u64),
    /// The new rule set could not be persisted, so it was not applied.
    #[error("persisting the new rules failed, nothing changed: {0}")]
    Store(StoreError),
    /// The coordinator is still copying a newer version; nothing changed.
    #[error("the rules coordinator {node} cannot take writes now, nothing changed: {reason}")]
    Unavailable {
        /// The coordinator's node id.
        node: String,
        /// Why.
        reason: String,
    },
    /// The coordinator could not be asked or did not answer: the write may or may not
    /// have been applied there.
    #[error("the rules coordinator {node} did not answer ({reason}): the write may or may not have been applied; read GET /v1/rules before retrying (a retry with If-Match is always safe)")]
    Unknown {
        /// The coordinator's node id.
        node: String,
        /// What failed.
        reason: String,
    },
    /// The coordinator refused the write; its message says why.
    #[error("{message}")]
    Remote {
        /// The kind of refusal.
        kind: Refusal,
        /// The coordinator's message.
        message: String,
    },
}

impl RulesWriteError {
    /// The kind of refusal, for the edges' status codes.
    pub fn kind(&self) -> Refusal {
        match self {
            RulesWriteError::ReadOnly | RulesWriteError::EnvoyReadOnly => Refusal::ReadOnly,
            RulesWriteError::Stale { .. } => Refusal::Stale,
            RulesWriteError::Invalid(_) => Refusal::Invalid,
            RulesWriteError::NotFound(_) => Refusal::NotFound,
            RulesWriteError::Exhausted(_) | RulesWriteError::Store(_) => Refusal::Internal,
            RulesWriteError::Unavailable { .. } | RulesWriteError::Unknown { .. } => {
                Refusal::Unavailable
            }
            RulesWriteError::Remote { kind, .. } => *kind,
        }
    }
}

/// What the write path needs to reach the coordinator; set when [`ClusterRules::sync`]
/// starts.
struct Links {
    view: watch::Receiver<Arc<ClusterView>>,
    peers: PeerPool,
}

/// A node's authority over the rules it enforces (module doc).
pub struct ClusterRules {
    me: Arc<str>,
    source: RulesSource,
    data_dir: Option<PathBuf>,
    shared: SharedRules,
    /// `Some`: this node serves Envoy from the rule set's `[envoy]` section, swapped in
    /// with the rules. `None`: from its own `--envoy-config`.
    envoy: Option<SharedEnvoy>,
    current: ArcSwap<Current>,
    /// Serializes changes, so a version is given out once and persisted in order.
    changes: Mutex<()>,
    advert: watch::Sender<Advert>,
    peers: ArcSwap<BTreeMap<String, Advert>>,
    drift: Drifting<Advert>,
    envoy_advert: watch::Sender<EnvoyAdvert>,
    envoy_peers: ArcSwap<BTreeMap<String, EnvoyAdvert>>,
    envoy_drift: Drifting<EnvoyAdvert>,
    version_gauge: metrics::Gauge,
    links: std::sync::OnceLock<Links>,
}

/// What `cluster status` and `/v1/cluster` say about one member's rules, as this node
/// sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberRules {
    /// Its rules advert; `None` until the first one arrives.
    pub rules: Option<Advert>,
    /// Its rules differ from this node's ([`Advert::drifts_from`]).
    pub rules_drift: bool,
    /// Its Envoy advert; `None` until the first one arrives, or from an older build.
    pub envoy: Option<EnvoyAdvert>,
    /// Its Envoy domains differ from this node's ([`EnvoyAdvert::drifts_from`]).
    pub envoy_drift: bool,
}

/// An advert members are compared by (rules, Envoy configuration).
trait Compared: Copy + PartialEq {
    fn drifts_from(&self, theirs: &Self) -> bool;
    fn encode(&self) -> String;
}

impl Compared for Advert {
    fn drifts_from(&self, theirs: &Self) -> bool {
        Advert::drifts_from(self, theirs)
    }
    fn encode(&self) -> String {
        Advert::encode(self)
    }
}

impl Compared for EnvoyAdvert {
    fn drifts_from(&self, theirs: &Self) -> bool {
        EnvoyAdvert::drifts_from(self, theirs)
    }
    fn encode(&self) -> String {
        EnvoyAdvert::encode(self)
    }
}

/// The members whose advert of one kind drifts from this node's, and its gauge.
struct Drifting<A> {
    members: ArcSwap<Vec<(String, A)>>,
    gauge: metrics::Gauge,
}

impl<A: Compared> Drifting<A> {
    fn new(gauge: metrics::Gauge) -> Self {
        Drifting {
            members: ArcSwap::default(),
            gauge,
        }
    }

    /// Recomputes the drifting set; `Some` only when it changed, so the caller logs once
    /// per change: `Some(None)` once it is empty again, else `Some(Some(members))` with
    /// the members and their adverts as a log field (`id=advert, …`).
    fn update(&self, mine: &A, adverts: &BTreeMap<String, A>) -> Option<Option<String>> {
        let drift: Vec<(String, A)> = adverts
            .iter()
            .filter(|(_, a)| mine.drifts_from(a))
            .map(|(id, a)| (id.clone(), *a))
            .collect();
        if **self.members.load() == drift {
            return None;
        }
        self.gauge.set(drift.len() as f64);
        let nodes: Vec<String> = drift
            .iter()
            .map(|(id, a)| format!("{id}={}", a.encode()))
            .collect();
        self.members.store(Arc::new(drift));
        Some((!nodes.is_empty()).then(|| nodes.join(", ")))
    }
}

impl std::fmt::Debug for ClusterRules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterRules")
            .field("source", &self.source)
            .field("stamp", &self.current().stamp())
            .finish()
    }
}

impl ClusterRules {
    /// Starts enforcing `rules` at `version`: stores them in `shared` (the hot path's
    /// rules) and, with `envoy` (a node without `--envoy-config`), their `[envoy]`
    /// section in it, and advertises them. In cluster mode, `data_dir` is where every
    /// accepted rule set is persisted (none: only in memory; a restart then begins from
    /// the seed or the built-in default and catches up from peers).
    pub fn new(
        me: Arc<str>,
        source: RulesSource,
        data_dir: Option<PathBuf>,
        version: u64,
        rules: RuleSet,
        shared: SharedRules,
        envoy: Option<SharedEnvoy>,
    ) -> Arc<Self> {
        let rules = Arc::new(rules);
        shared.store(rules.clone());
        if let Some(envoy) = &envoy {
            envoy.store(rules.envoy().clone());
        }
        let current = Current { version, rules };
        let advert = Advert {
            source,
            stamp: current.stamp(),
        };
        let this = ClusterRules {
            me,
            source,
            data_dir,
            shared,
            envoy,
            current: ArcSwap::from_pointee(current),
            changes: Mutex::new(()),
            advert: watch::channel(advert).0,
            peers: ArcSwap::default(),
            drift: Drifting::new(metrics::gauge!("ringlimit_rules_drift_nodes")),
            envoy_advert: watch::channel(EnvoyAdvert::FromRules).0,
            envoy_peers: ArcSwap::default(),
            envoy_drift: Drifting::new(metrics::gauge!("ringlimit_envoy_config_drift_nodes")),
            version_gauge: metrics::gauge!("ringlimit_rules_version"),
            links: std::sync::OnceLock::new(),
        };
        this.version_gauge.set(version as f64);
        Arc::new(this)
    }

    /// The rules in force and their version.
    pub fn current(&self) -> Arc<Current> {
        self.current.load_full()
    }

    /// Where this node's rules come from.
    pub fn source(&self) -> RulesSource {
        self.source
    }

    /// This node's advert, as gossiped.
    pub fn advert(&self) -> Advert {
        *self.advert.borrow()
    }

    /// Watch of this node's advert: the node mirrors it into gossip.
    pub fn adverts(&self) -> watch::Receiver<Advert> {
        self.advert.subscribe()
    }

    /// The other members' adverts as last seen in gossip, by node id.
    pub fn peer_adverts(&self) -> Arc<BTreeMap<String, Advert>> {
        self.peers.load_full()
    }

    /// The member holding the newest version newer than this node's, if any: while there
    /// is one, this node enforces rules the cluster has replaced (a copy is in flight).
    pub fn behind(&self) -> Option<(String, Advert)> {
        let mine = self.advert();
        let peers = self.peer_adverts();
        best_source(&mine, peers.iter().map(|(id, a)| (id.as_str(), *a)))
            .map(|(id, a)| (id.to_string(), a))
    }

    /// Members whose rules drift from this node's ([`Advert::drifts_from`]).
    pub fn drift(&self) -> Arc<Vec<(String, Advert)>> {
        self.drift.members.load_full()
    }

    /// This node's Envoy advert, as gossiped.
    pub fn envoy_advert(&self) -> EnvoyAdvert {
        *self.envoy_advert.borrow()
    }

    /// Watch of this node's Envoy advert: the node mirrors it into gossip.
    pub fn envoy_adverts(&self) -> watch::Receiver<EnvoyAdvert> {
        self.envoy_advert.subscribe()
    }

    /// Members whose Envoy domains drift from this node's ([`EnvoyAdvert::drifts_from`]).
    pub fn envoy_drift(&self) -> Arc<Vec<(String, EnvoyAdvert)>> {
        self.envoy_drift.members.load_full()
    }

    /// `--envoy-config` was loaded (at start) or reloaded with content whose digest is
    /// `digest`: advertise it, counting reloads like a rule file's.
    pub fn envoy_file_loaded(&self, digest: u64) {
        self.envoy_advert.send_modify(|advert| {
            let version = match advert {
                EnvoyAdvert::File(stamp) => stamp.version.saturating_add(1),
                EnvoyAdvert::FromRules => 1,
            };
            *advert = EnvoyAdvert::File(Stamp { version, digest });
        });
    }

    /// What this node knows of `node_id`'s rules (its own when it is this node).
    pub fn member(&self, node_id: &str) -> MemberRules {
        let (mine, envoy_mine) = (self.advert(), self.envoy_advert());
        let (rules, envoy) = if node_id == &*self.me {
            (Some(mine), Some(envoy_mine))
        } else {
            (
                self.peers.load().get(node_id).copied(),
                self.envoy_peers.load().get(node_id).copied(),
            )
        };
        MemberRules {
            rules,
            rules_drift: rules.is_some_and(|a| mine.drifts_from(&a)),
            envoy,
            envoy_drift: envoy.is_some_and(|a| envoy_mine.drifts_from(&a)),
        }
    }

    /// Changes the cluster's rules (module doc): sent to the coordinator unless this node
    /// is it (or knows no peers yet), applied there, and the coordinator's answer enforced
    /// here at once. File mode refuses before anything is sent.
    pub async fn write(
        &self,
        if_match: Option<u64>,
        edit: RulesEdit,
    ) -> Result<Written, RulesWriteError> {
        if self.source == RulesSource::File {
            return Err(RulesWriteError::ReadOnly);
        }
        let current = self.current();
        let current_envoy = &current.rules.doc().envoy;
        if self.envoy.is_none() && edit.envoy_section().is_some_and(|e| e != current_envoy) {
            return Err(RulesWriteError::EnvoyReadOnly);
        }
        // A whole document, or an `[envoy]` section, is valid or not wherever it is
        // applied: say so without asking the coordinator (and even while it is
        // unreachable).
        match &edit {
            RulesEdit::Replace(doc) => drop(RuleSet::from_doc(doc.clone())?),
            RulesEdit::ReplaceEnvoy(Some(section)) => {
                EnvoyConfig::from_section(section).map_err(RulesError::Envoy)?;
            }
            _ => {}
        }
        let remote = self.links.get().and_then(|links| {
            let view = links.view.borrow().clone();
            coordinator(&view)
                .filter(|m| m.node_id != *self.me)
                .cloned()
                .map(|m| (m, links.peers.clone()))
        });
        let Some((member, peers)) = remote else {
            return self.write_local(if_match, edit).await;
        };
        let outcome = peers
            .write_rules(&member, if_match, &edit)
            .await
            .map_err(|e| match e {
                RemoteWriteError::Refused(kind, message) => {
                    RulesWriteError::Remote { kind, message }
                }
                RemoteWriteError::Failed(error) => RulesWriteError::Unknown {
                    node: member.node_id.clone(),
                    reason: error.to_string(),
                },
            })?;
        // Enforce what the coordinator now enforces, without waiting for gossip, so a
        // read on this node right after the write sees it.
        let pulled = PulledRules {
            source: Some(RulesSource::Cluster),
            stamp: outcome.written.stamp,
            document: outcome.document,
        };
        if let Err(error) = self.offer(&member.node_id, pulled).await {
            tracing::warn!(coordinator = %member.node_id, %error, "the coordinator's answer to a write could not be applied here; gossip will bring it");
        }
        Ok(outcome.written)
    }

    /// Applies a write here, whoever coordinates: a write that arrives over the peer face
    /// is never sent on. The edit applies to this node's document, validated, given the
    /// next version, persisted and swapped in; with `if_match`, only if the current
    /// version is that one. A document equal to the current one changes nothing and keeps
    /// its version.
    pub async fn write_local(
        &self,
        if_match: Option<u64>,
        edit: RulesEdit,
    ) -> Result<Written, RulesWriteError> {
        if self.source == RulesSource::File {
            return Err(RulesWriteError::ReadOnly);
        }
        let _change = self.changes.lock().await;
        let current = self.current();
        // Never give out version N+1 while a member is known to hold more than N (this
        // node restarted without its data dir, or a pull is in flight): the write would
        // lose to that version on every node. The sync loop copies it within a gossip
        // round; the writer retries.
        if let Some((newer, advert)) = self.behind() {
            return Err(RulesWriteError::Unavailable {
                node: self.me.to_string(),
                reason: format!(
                    "catching up: {newer} holds {}, this node {}; retry in a moment",
                    advert.stamp,
                    current.stamp()
                ),
            });
        }
        if let Some(given) = if_match {
            if given != current.version {
                return Err(RulesWriteError::Stale {
                    given,
                    current: current.version,
                });
            }
        }
        let (doc, rule) = edit.apply(current.rules.doc())?;
        let rules = RuleSet::from_doc(doc)?;
        let written = |stamp, changed| Written {
            stamp,
            changed,
            rule: rule.clone(),
            coordinator: self.me.to_string(),
        };
        if rules.digest() == current.rules.digest() {
            return Ok(written(current.stamp(), false));
        }
        let version = current
            .version
            .checked_add(1)
            .ok_or(RulesWriteError::Exhausted(current.version))?;
        let rules = Arc::new(rules);
        self.persist(version, &rules)
            .await
            .map_err(RulesWriteError::Store)?;
        let new = self.apply(version, rules);
        metrics::counter!("ringlimit_rules_changes_total", "origin" => "api").increment(1);
        tracing::info!(node_id = %self.me, version, digest = %hex(new.rules.digest()), rules = new.rules.len(), "rules changed through the API");
        Ok(written(new.stamp(), true))
    }

    /// A peer's copy, pulled because its advert was newer: checked (source, validation,
    /// digest), then persisted and swapped in if it is still newer than ours. Returns
    /// whether it was applied; an error says why it was refused.
    pub async fn offer(&self, from: &str, pulled: PulledRules) -> Result<bool, String> {
        if self.source == RulesSource::File {
            return Ok(false);
        }
        if pulled.source != Some(RulesSource::Cluster) {
            return Err("the peer does not follow the cluster rule set".into());
        }
        let doc = RulesDoc::from_json_str(&pulled.document).map_err(|e| e.to_string())?;
        let rules = RuleSet::from_doc(doc).map_err(|e| e.to_string())?;
        if rules.digest() != pulled.stamp.digest {
            return Err(format!(
                "the document's digest is {}, not the {} it was sent as",
                hex(rules.digest()),
                hex(pulled.stamp.digest)
            ));
        }
        let _change = self.changes.lock().await;
        if pulled.stamp <= self.current().stamp() {
            return Ok(false);
        }
        let rules = Arc::new(rules);
        if let Err(error) = self.persist(pulled.stamp.version, &rules).await {
            // Enforcing the cluster's rules matters more than the local copy: apply
            // anyway, and say loudly that a restart would start from an older one.
            metrics::counter!("ringlimit_rules_persist_failures_total").increment(1);
            tracing::error!(%error, "could not persist the rules copied from a peer; enforcing them anyway");
        }
        self.apply(pulled.stamp.version, rules);
        metrics::counter!("ringlimit_rules_changes_total", "origin" => "peer").increment(1);
        tracing::info!(node_id = %self.me, from, version = pulled.stamp.version, digest = %hex(pulled.stamp.digest), "rules copied from a peer");
        Ok(true)
    }

    /// File mode: the file changed and parsed; enforce it as the next local version.
    pub async fn reload_file(&self, rules: RuleSet) {
        let _change = self.changes.lock().await;
        let version = self.current().version.saturating_add(1);
        self.apply(version, Arc::new(rules));
        metrics::counter!("ringlimit_rules_changes_total", "origin" => "file").increment(1);
    }

    async fn persist(&self, version: u64, rules: &Arc<RuleSet>) -> Result<(), StoreError> {
        let Some(dir) = self.data_dir.clone() else {
            return Ok(());
        };
        let rules = rules.clone();
        match tokio::task::spawn_blocking(move || store(&dir, version, &rules)).await {
            Ok(result) => result,
            Err(error) => Err(StoreError::Io {
                path: self.data_dir.clone().unwrap_or_default(),
                error: std::io::Error::other(error.to_string()),
            }),
        }
    }

    fn apply(&self, version: u64, rules: Arc<RuleSet>) -> Arc<Current> {
        self.shared.store(rules.clone());
        if let Some(envoy) = &self.envoy {
            // Unchanged Envoy limits keep their counters: they are keyed by rule name
            // and checked against the fingerprint, as TOML rules are.
            envoy.store(rules.envoy().clone());
        }
        let current = Arc::new(Current { version, rules });
        self.current.store(current.clone());
        self.version_gauge.set(version as f64);
        self.advert.send_replace(Advert {
            source: self.source,
            stamp: current.stamp(),
        });
        current
    }

    /// Follows the other members' adverts: records them, reports drift, and in cluster
    /// mode pulls a newer rule set from the member that has the greatest one. Runs until
    /// `cancel`; reacts to every gossip change and looks again every 500 ms (a failed
    /// pull is retried then).
    pub async fn sync(
        self: Arc<Self>,
        mut values: watch::Receiver<Arc<MemberValues>>,
        view: watch::Receiver<Arc<ClusterView>>,
        peers: PeerPool,
        cancel: CancellationToken,
    ) {
        let _ = self.links.set(Links {
            view: view.clone(),
            peers: peers.clone(),
        });
        let pull_failures = metrics::counter!("ringlimit_rules_pull_failures_total");
        let mut tick = tokio::time::interval(RESYNC);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_failure: Option<(String, Stamp)> = None;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                changed = values.changed() => if changed.is_err() { return },
                _ = tick.tick() => {}
            }
            let (adverts, envoy) = {
                let values = values.borrow_and_update();
                let others = || values.iter().filter(|(id, _)| **id != *self.me);
                let adverts: BTreeMap<String, Advert> = others()
                    .filter_map(|(id, kvs)| Some((id.clone(), Advert::parse(kvs.get(KEY_RULES)?)?)))
                    .collect();
                let envoy: BTreeMap<String, EnvoyAdvert> = others()
                    .filter_map(|(id, kvs)| {
                        Some((id.clone(), EnvoyAdvert::parse(kvs.get(KEY_ENVOY)?)?))
                    })
                    .collect();
                (adverts, envoy)
            };
            self.note_drift(&adverts);
            self.note_envoy_drift(&envoy);
            self.envoy_peers.store(Arc::new(envoy));
            let mine = self.advert();
            let best = best_source(&mine, adverts.iter().map(|(id, a)| (id.as_str(), *a)))
                .map(|(id, a)| (id.to_string(), a));
            self.peers.store(Arc::new(adverts));
            let Some((id, advert)) = best else { continue };
            let Some(member) = view.borrow().member(&id).cloned() else {
                continue;
            };
            let outcome = match peers.pull_rules(&member).await {
                Ok(pulled) => self.offer(&id, pulled).await,
                Err(error) => Err(error.to_string()),
            };
            if let Err(error) = outcome {
                pull_failures.increment(1);
                // Once per (peer, stamp): a peer that stays unreachable is retried
                // every 500 ms without a log line each time.
                let failure = (id.clone(), advert.stamp);
                if last_failure.as_ref() != Some(&failure) {
                    tracing::warn!(from = %id, wanted = %advert.stamp, %error, "could not copy newer rules from a peer; will retry");
                    last_failure = Some(failure);
                }
            }
        }
    }

    /// Records the members whose rules drift; logs when the set changes.
    fn note_drift(&self, adverts: &BTreeMap<String, Advert>) {
        let mine = self.advert();
        match self.drift.update(&mine, adverts) {
            None => {}
            Some(None) => {
                tracing::info!(node_id = %self.me, rules = %mine.encode(), "rules drift resolved: every member enforces the same rules");
            }
            Some(Some(drifting)) => tracing::warn!(
                node_id = %self.me,
                rules = %mine.encode(),
                %drifting,
                "rules drift: these members enforce different rules than this node (different --rules files, or file and cluster sources mixed)"
            ),
        }
    }

    /// Records the members whose Envoy domains drift; logs when the set changes.
    fn note_envoy_drift(&self, adverts: &BTreeMap<String, EnvoyAdvert>) {
        let mine = self.envoy_advert();
        match self.envoy_drift.update(&mine, adverts) {
            None => {}
            Some(None) => {
                tracing::info!(node_id = %self.me, envoy = %mine.encode(), "envoy config drift resolved: every member enforces the same Envoy domains");
            }
            Some(Some(drifting)) => tracing::warn!(
                node_id = %self.me,
                envoy = %mine.encode(),
                %drifting,
                "envoy config drift: these members enforce different Envoy domains than this node (different --envoy-config files, --envoy-xds sets or --envoy-algorithm, or those flags on some nodes only)"
            ),
        }
    }
}

/// A digest as 16 hex digits, the form every message and API uses.
pub fn hex(digest: u64) -> String {
    format!("{digest:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::rules::TierLimit;

    const A: &str = "[[rule]]\nname = \"a\"\ntier = \"free\"\nlimit = 5\nwindow = \"1m\"\n";

    fn node(source: RulesSource, dir: Option<PathBuf>) -> (Arc<ClusterRules>, SharedRules) {
        let shared: SharedRules = Arc::new(ArcSwap::from_pointee(RuleSet::builtin()));
        let rules = ClusterRules::new(
            "n1".into(),
            source,
            dir,
            0,
            RuleSet::builtin(),
            shared.clone(),
            Some(SharedEnvoy::default()),
        );
        (rules, shared)
    }

    fn replace_with(text: &str) -> RulesEdit {
        RulesEdit::Replace(RulesDoc::from_toml_str(text).unwrap())
    }

    #[tokio::test]
    async fn a_write_gets_the_next_version_is_persisted_and_enforced() {
        let dir = tempfile::tempdir().unwrap();
        let (rules, shared) = node(RulesSource::Cluster, Some(dir.path().to_owned()));
        let new = rules.write(Some(0), replace_with(A)).await.unwrap();
        assert!(new.changed);
        assert_eq!(new.stamp.version, 1);
        assert_eq!(new.coordinator, "n1", "alone, a node coordinates itself");
        assert_eq!(shared.load().get("a").unwrap().spec.limit().get(), 5);
        assert_eq!(rules.advert().stamp, new.stamp);
        let (stamp, _) = crate::config::rules::load_stored(dir.path())
            .unwrap()
            .unwrap();
        assert_eq!(stamp, new.stamp);
        // The same document again changes nothing.
        let same = rules.write(None, replace_with(A)).await.unwrap();
        assert!(!same.changed);
        assert_eq!(same.stamp.version, 1);
    }

    #[tokio::test]
    async fn a_stale_if_match_or_an_invalid_document_changes_nothing() {
        let (rules, shared) = node(RulesSource::Cluster, None);
        rules.write(None, replace_with(A)).await.unwrap();
        let e = rules.write(Some(0), replace_with(A)).await.unwrap_err();
        assert!(
            matches!(
                e,
                RulesWriteError::Stale {
                    given: 0,
                    current: 1
                }
            ),
            "{e}"
        );
        let bad = RulesEdit::PutTierLimit {
            tier: "free".into(),
            limit: TierLimit {
                name: Some("a".into()),
                limit: Some(0),
                window: Some("1m".into()),
                ..TierLimit::default()
            },
        };
        let e = rules.write(Some(1), bad).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "rule \"a\": field \"limit\": must be an integer >= 1 (got 0)"
        );
        assert_eq!(e.kind(), Refusal::Invalid);
        let missing = RulesEdit::DeleteTierLimit {
            tier: "pro".into(),
            route: None,
        };
        let e = rules.write(Some(1), missing).await.unwrap_err();
        assert_eq!(e.kind(), Refusal::NotFound);
        assert_eq!(rules.current().version, 1);
        assert_eq!(shared.load().get("a").unwrap().spec.limit().get(), 5);
    }

    #[tokio::test]
    async fn a_node_that_knows_of_a_newer_version_refuses_to_give_out_an_older_one() {
        let (rules, _) = node(RulesSource::Cluster, None);
        let newer = Advert {
            source: RulesSource::Cluster,
            stamp: Stamp {
                version: 5,
                digest: 1,
            },
        };
        rules
            .peers
            .store(Arc::new(BTreeMap::from([("n2".to_string(), newer)])));
        assert_eq!(rules.behind().map(|(id, _)| id).as_deref(), Some("n2"));
        let e = rules.write(None, replace_with(A)).await.unwrap_err();
        assert_eq!(e.kind(), Refusal::Unavailable);
        assert!(e.to_string().contains("catching up: n2 holds v5"), "{e}");
        assert_eq!(rules.current().version, 0, "nothing changed");
    }

    #[tokio::test]
    async fn a_write_whose_coordinator_does_not_answer_says_its_outcome_is_unknown() {
        use crate::cluster::link::ForwardConfig;
        use crate::membership::Member;
        let member = |id: &str, port: u16| Member {
            node_id: id.to_string(),
            generation: 1,
            grpc_addr: ([127, 0, 0, 1], port).into(),
            // Port 1 on loopback: nothing listens, the call is refused at once.
            peer_addr: ([127, 0, 0, 1], 1).into(),
            gossip_addr: ([127, 0, 0, 1], port).into(),
            leaving: false,
        };
        // A peer id the ring makes coordinator (n1 is this node).
        let peer = (0..)
            .map(|i| format!("p{i}"))
            .find(|id| {
                let view = ClusterView::from_members(vec![member("n1", 2), member(id, 3)]);
                coordinator(&view).is_some_and(|m| m.node_id == *id)
            })
            .unwrap();
        let view = ClusterView::from_members(vec![member("n1", 2), member(&peer, 3)]);
        let (_tx, view) = watch::channel(Arc::new(view));
        let tracker = tokio_util::task::TaskTracker::new();
        let cancel = CancellationToken::new();
        let pool = PeerPool::new(
            "n1".into(),
            ForwardConfig::default(),
            tracker,
            cancel.clone(),
        );
        let (rules, _) = node(RulesSource::Cluster, None);
        assert!(rules.links.set(Links { view, peers: pool }).is_ok());

        let e = rules.write(Some(0), replace_with(A)).await.unwrap_err();
        assert_eq!(e.kind(), Refusal::Unavailable);
        assert!(
            matches!(&e, RulesWriteError::Unknown { node, .. } if *node == peer),
            "{e}"
        );
        assert!(
            e.to_string().contains("may or may not have been applied"),
            "{e}"
        );
        assert_eq!(rules.current().version, 0, "nothing was applied here");
        // A bad document is refused before anything is sent, coordinator or not.
        let e = rules
            .write(None, RulesEdit::Replace(RulesDoc::default()))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), Refusal::Invalid);
        cancel.cancel();
    }

    fn section(requests: u32) -> DocEnvoy {
        DocEnvoy {
            algorithm: None,
            domains: vec![format!(
                "domain: gw\ndescriptors:\n  - key: ip\n    rate_limit: {{unit: minute, requests_per_unit: {requests}}}\n"
            )],
        }
    }

    #[tokio::test]
    async fn an_envoy_section_edit_keeps_the_toml_rules_and_swaps_the_envoy_domains() {
        let envoy = SharedEnvoy::default();
        let shared: SharedRules = Arc::new(ArcSwap::from_pointee(RuleSet::builtin()));
        let rules = ClusterRules::new(
            "n1".into(),
            RulesSource::Cluster,
            None,
            0,
            RuleSet::builtin(),
            shared.clone(),
            Some(envoy.clone()),
        );
        rules.write(None, replace_with(A)).await.unwrap();
        let written = rules
            .write(Some(1), RulesEdit::ReplaceEnvoy(Some(section(5))))
            .await
            .unwrap();
        assert_eq!(written.stamp.version, 2);
        assert_eq!(
            shared.load().get("a").unwrap().spec.limit().get(),
            5,
            "kept"
        );
        assert_eq!(envoy.load().domains().collect::<Vec<_>>(), ["gw"]);
        // A bad section is refused before anything is sent or changed.
        let mut bad = section(5);
        bad.domains[0].push_str("    burst: 1\n");
        let e = rules
            .write(None, RulesEdit::ReplaceEnvoy(Some(bad)))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), Refusal::Invalid);
        assert!(e.to_string().contains("unknown field `burst`"), "{e}");
        // Removing the section removes the domains.
        rules
            .write(Some(2), RulesEdit::ReplaceEnvoy(None))
            .await
            .unwrap();
        assert_eq!(envoy.load().domains().count(), 0);
        assert_eq!(rules.current().version, 3);
    }

    #[tokio::test]
    async fn a_node_following_envoy_config_refuses_only_writes_that_change_the_envoy_section() {
        let shared: SharedRules = Arc::new(ArcSwap::from_pointee(RuleSet::builtin()));
        let rules = ClusterRules::new(
            "n1".into(),
            RulesSource::Cluster,
            None,
            0,
            RuleSet::builtin(),
            shared,
            None,
        );
        let e = rules
            .write(None, RulesEdit::ReplaceEnvoy(Some(section(5))))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), Refusal::ReadOnly);
        assert!(e.to_string().contains("--envoy-config"), "{e}");
        let with_section = RulesDoc {
            envoy: Some(section(5)),
            ..RulesDoc::from_toml_str(A).unwrap()
        };
        let e = rules
            .write(None, RulesEdit::Replace(with_section))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), Refusal::ReadOnly);
        // A document without one (as before) is a TOML change: accepted.
        assert!(rules.write(None, replace_with(A)).await.unwrap().changed);
    }

    #[tokio::test]
    async fn file_mode_refuses_writes() {
        let (rules, _) = node(RulesSource::File, None);
        let e = rules.write(None, replace_with(A)).await.unwrap_err();
        assert!(matches!(e, RulesWriteError::ReadOnly));
    }

    #[tokio::test]
    async fn a_peer_copy_is_applied_only_when_newer_and_genuine() {
        let (rules, shared) = node(RulesSource::Cluster, None);
        let doc = RulesDoc::from_toml_str(A).unwrap();
        let pulled = |version, digest| PulledRules {
            source: Some(RulesSource::Cluster),
            stamp: Stamp { version, digest },
            document: doc.to_json(),
        };
        let e = rules.offer("n2", pulled(3, 42)).await.unwrap_err();
        assert!(e.contains("digest"), "{e}");
        assert!(rules.offer("n2", pulled(3, doc.digest())).await.unwrap());
        assert_eq!(rules.current().version, 3);
        assert_eq!(shared.load().digest(), doc.digest());
        assert!(
            !rules.offer("n2", pulled(2, doc.digest())).await.unwrap(),
            "older"
        );
        let mut bad = pulled(9, 0);
        bad.document = "{\"rule\": [{\"name\": \"x\"}]}".into();
        assert!(rules.offer("n2", bad).await.is_err());
        assert_eq!(rules.current().version, 3);
    }
}
