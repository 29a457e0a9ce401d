//! The node's rules at start and while it runs: which rules it starts with (file, stored
//! copy, seed or built-in), the watchers that follow `--rules` and `--envoy-config` (the
//! xDS client that follows `--envoy-xds` is `node::xds`), and the adverts that put this
//! node's rules in gossip.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio_util::sync::CancellationToken;

use super::{NodeConfig, NodeError};
use crate::cluster::rules::{ClusterRules, KEY_ENVOY, KEY_RULES};
use crate::config::rules::envoy::EnvoyConfig;
use crate::config::rules::{
    load_stored_capped, read_rules_file_capped, store, RuleFile, RuleSet, RulesSource,
};
use crate::config::{SharedEnvoy, SharedRules};

/// The rules a node starts with, and the shared handles every face reads them through.
pub struct StartRules {
    /// The rules authority: version, source, adverts, writes.
    pub cluster_rules: Arc<ClusterRules>,
    /// The live rule set.
    pub rules: SharedRules,
    /// The live Envoy domains.
    pub envoy: SharedEnvoy,
    /// File mode: the rule file as read at start, the watcher's baseline.
    pub rule_file: Option<RuleFile>,
}

/// Loads the rules and the Envoy domains and builds the rules authority over them.
///
/// File mode: the bytes parsed at start are the watcher's baseline (reading them again
/// inside the watcher task would miss an edit made between start and the task's first
/// run). Read once, never blocking (a FIFO or device is refused) and at most
/// `--max-rules-bytes`.
/// Cluster mode: the stored copy, else the seed, else the built-in default.
pub fn load(config: &NodeConfig) -> Result<StartRules, NodeError> {
    let (source, version, loaded, rule_file) = initial_rules(config)?;
    tracing::info!(
        rules = loaded.len(),
        source = %source.as_str(),
        version,
        digest = %crate::cluster::rules::hex(loaded.digest()),
        path = %config.rules_path.as_deref().or(config.rules_seed.as_deref()).map_or("-".into(), |p| p.display().to_string()),
        "rules loaded"
    );
    let rules: SharedRules = Arc::new(ArcSwap::from_pointee(RuleSet::builtin()));
    let data_dir = match source {
        RulesSource::Cluster => config.data_dir.clone(),
        RulesSource::File => {
            if let Some(dir) = &config.data_dir {
                tracing::info!(data_dir = %dir.display(), "file mode (--rules): the rule file is the truth, --data-dir holds only the counter snapshot");
            }
            None
        }
    };
    let envoy_file = envoy_file(config, &loaded)?;
    let envoy: SharedEnvoy = Arc::new(ArcSwap::from_pointee(EnvoyConfig::default()));
    let cluster_rules = ClusterRules::new(
        Arc::from(config.node_id.as_str()),
        source,
        data_dir,
        version,
        loaded,
        rules.clone(),
        envoy_file.is_none().then(|| envoy.clone()),
    );
    if let Some(file) = envoy_file {
        cluster_rules.envoy_file_loaded(file.digest());
        envoy.store(Arc::new(file));
    }
    Ok(StartRules {
        cluster_rules,
        rules,
        envoy,
        rule_file,
    })
}

/// Envoy's domains come from --envoy-config when given (read here, followed by the
/// watcher), or from --envoy-xds (none until the control plane sends a set: the node
/// starts with no domain, as envoyproxy/ratelimit does), else from the rule set's
/// [envoy] section, swapped in with the rules.
fn envoy_file(config: &NodeConfig, loaded: &RuleSet) -> Result<Option<EnvoyConfig>, NodeError> {
    if let Some(addr) = &config.envoy_xds {
        if loaded.doc().envoy.is_some() {
            tracing::warn!(%addr, "the rule set has an [envoy] section, but this node serves Envoy from --envoy-xds: the section is not served here");
        }
        let empty = EnvoyConfig::from_domains(Vec::new(), config.envoy_algorithm)
            .map_err(NodeError::Envoy)?;
        return Ok(Some(empty));
    }
    let Some(path) = &config.envoy_path else {
        return Ok(None);
    };
    let envoy = EnvoyConfig::load(path, config.envoy_algorithm).map_err(NodeError::Envoy)?;
    tracing::info!(path = %path.display(), domains = envoy.domains().count(), digest = %crate::cluster::rules::hex(envoy.digest()), "envoy config loaded");
    if loaded.doc().envoy.is_some() {
        tracing::warn!(path = %path.display(), "the rule set has an [envoy] section, but this node serves Envoy from --envoy-config: the section is not served here");
    }
    Ok(Some(envoy))
}

/// Mirrors this node's rules and Envoy adverts into its gossip key-values.
pub async fn advertise_rules(
    rules: Arc<ClusterRules>,
    gossip: crate::membership::ValuePublisher,
    cancel: CancellationToken,
) {
    let (mut adverts, mut envoy) = (rules.adverts(), rules.envoy_adverts());
    // Each set is pushed to every peer at once: publish only what changed.
    let mut published: [Option<String>; 2] = [None, None];
    loop {
        let values = [
            (KEY_RULES, adverts.borrow_and_update().encode()),
            (KEY_ENVOY, envoy.borrow_and_update().encode()),
        ];
        for ((key, value), last) in values.into_iter().zip(&mut published) {
            if last.as_deref() != Some(value.as_str()) {
                gossip.set(key, value.clone()).await;
                *last = Some(value);
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            changed = adverts.changed() => if changed.is_err() { return },
            changed = envoy.changed() => if changed.is_err() { return },
        }
    }
}

/// The rules a node starts with: (source, version, rules, the file to follow).
///
/// File mode (`--rules`): the file, version 1, followed for changes. Cluster mode: the
/// copy stored in `--data-dir` (the rules this node last enforced, at their version),
/// else `--rules-seed` at version 1 (stored at once, so a restart keeps it), else the
/// built-in default at version 0; gossip then brings any newer version.
fn initial_rules(
    config: &NodeConfig,
) -> Result<(RulesSource, u64, RuleSet, Option<RuleFile>), NodeError> {
    if let Some(path) = &config.rules_path {
        let (file, rules) =
            RuleFile::load_capped(path, config.max_rules_bytes).map_err(NodeError::Rules)?;
        return Ok((RulesSource::File, 1, rules, Some(file)));
    }
    if let Some(dir) = &config.data_dir {
        if let Some((stamp, rules)) =
            load_stored_capped(dir, config.max_rules_bytes).map_err(NodeError::StoredRules)?
        {
            return Ok((RulesSource::Cluster, stamp.version, rules, None));
        }
    }
    match &config.rules_seed {
        Some(seed) => {
            let bytes =
                read_rules_file_capped(seed, config.max_rules_bytes).map_err(NodeError::Rules)?;
            let rules = RuleSet::from_file_bytes(seed, &bytes).map_err(NodeError::Rules)?;
            if let Some(dir) = &config.data_dir {
                store(dir, 1, &rules).map_err(NodeError::StoredRules)?;
            }
            Ok((RulesSource::Cluster, 1, rules, None))
        }
        None => Ok((RulesSource::Cluster, 0, RuleSet::builtin(), None)),
    }
}

/// Re-read the Envoy configuration every `every`; swap it in (and advertise its digest,
/// for drift) when what was read parses cleanly and means something else than what is
/// enforced. A broken edit is logged and counted once per distinct problem and the node
/// keeps its previous configuration (as for the rule file).
pub async fn watch_envoy(
    path: std::path::PathBuf,
    algorithm: crate::algorithms::AlgorithmKind,
    every: Duration,
    envoy: SharedEnvoy,
    rules: Arc<ClusterRules>,
    cancel: CancellationToken,
) {
    let mut applied = envoy.load().digest();
    let reloads = metrics::counter!("ringlimit_envoy_config_reloads_total", "result" => "ok");
    let failures = metrics::counter!("ringlimit_envoy_config_reloads_total", "result" => "error");
    let mut last_error = None;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let read_path = path.clone();
        let read = tokio::task::spawn_blocking(move || EnvoyConfig::load(&read_path, algorithm));
        let read = tokio::select! {
            _ = cancel.cancelled() => return,
            read = read => read,
        };
        match read {
            Ok(Ok(config)) => {
                last_error = None;
                let digest = config.digest();
                if digest != applied {
                    applied = digest;
                    tracing::info!(path = %path.display(), domains = config.domains().count(), digest = %crate::cluster::rules::hex(digest), "envoy config reloaded");
                    envoy.store(Arc::new(config));
                    rules.envoy_file_loaded(digest);
                    reloads.increment(1);
                }
            }
            Ok(Err(error)) => {
                let message = error.to_string();
                if last_error.as_ref() != Some(&message) {
                    tracing::error!(%error, "envoy config refused; keeping the current one");
                    failures.increment(1);
                    last_error = Some(message);
                }
            }
            Err(error) => tracing::error!(%error, "envoy config read task failed"),
        }
    }
}

/// Re-read the rule file every `every`; swap in a new rule set when its contents
/// change and parse cleanly. A broken edit, an empty or truncated file, or a path that
/// stops being a readable regular file is logged and counted once, and the node keeps
/// deciding with its previous rules: a typo must not turn limiting off.
///
/// The read never blocks (a FIFO is refused, not read) and still runs beside the
/// cancellation, so nothing in the file system can keep the node from stopping.
pub async fn watch_rules(
    mut file: RuleFile,
    every: Duration,
    rules: Arc<ClusterRules>,
    cancel: CancellationToken,
) {
    let reloads = metrics::counter!("ringlimit_rules_reloads_total", "result" => "ok");
    let failures = metrics::counter!("ringlimit_rules_reloads_total", "result" => "error");
    let path = file.path().to_owned();
    let max_bytes = file.max_bytes();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let read_path = path.clone();
        let read =
            tokio::task::spawn_blocking(move || read_rules_file_capped(&read_path, max_bytes));
        let read = tokio::select! {
            _ = cancel.cancelled() => return,
            read = read => read,
        };
        let read = match read {
            Ok(read) => read,
            Err(error) => {
                tracing::error!(path = %path.display(), %error, "rule file read task failed");
                continue;
            }
        };
        match file.observe(read) {
            None => {}
            Some(Ok(new)) => {
                tracing::info!(path = %path.display(), rules = new.len(), "rules reloaded");
                rules.reload_file(new).await;
                reloads.increment(1);
            }
            Some(Err(error)) => {
                tracing::error!(path = %path.display(), %error, "rule file refused; keeping current rules");
                failures.increment(1);
            }
        }
    }
}
