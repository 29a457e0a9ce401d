//! The ring-aware client: each check goes straight to its key's owner.
//!
//! It learns the members' public addresses and the ring's parameters from any node
//! (`RateLimiter/Topology`), places each key with the same stable hash the nodes use
//! (`ringlimit-ring`), and sends the check there, so the answer comes back with no hop.
//! It re-reads the topology every [`ClientConfig::refresh`] and at once after an owner
//! failed; until then a check whose owner moved goes to the old owner's address, which
//! forwards it (the node does exactly that for any client). When the owner does not
//! answer within the deadline, the check is sent once to another member (which
//! forwards it); when no node answers, the request's [`Unavailable`] choice applies:
//! fail closed (denied), or fail open on a local counter admitting the limit divided by
//! the number of members (the design reference's L/N). The answer's [`Source`] says
//! which of these happened.
//!
//! Denials are cached locally ("denied until T", measured on the monotonic clock; an
//! allowed answer is never cached), so a client hammering an exhausted key costs the
//! cluster one call per window, not one per request.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ringlimit_ring::Ring;
use tokio::sync::Notify;
use tonic::transport::{Channel, Endpoint};

use crate::contract::Quota;
use crate::proto;
use crate::proto::rate_limiter_client::RateLimiterClient;

/// How the client is set up.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Public gRPC addresses (`host:port`) of any nodes: the topology is learned from
    /// the first that answers.
    pub seeds: Vec<String>,
    /// How long one check may take, all attempts included, unless the request says.
    pub deadline: Duration,
    /// How often the topology is re-read (also at once after an owner failed).
    pub refresh: Duration,
    /// Most denials cached.
    pub deny_cache: usize,
    /// Send concurrent checks to one node together as `CheckBatch` calls (`None`: one
    /// `Check` call each).
    pub coalesce: Option<Coalesce>,
}

/// Coalescing of concurrent checks into `CheckBatch` calls, per node.
///
/// It never waits for company: a check is sent at once when fewer than `max_in_flight`
/// calls to its node are out; while that many are out, new checks queue and leave
/// together (up to `max_batch`) when one returns. So at low load every check is a batch
/// of one with no added latency, and under load batches grow with the load. A call
/// gives up at the latest deadline of its checks, so a node that stops answering holds
/// a call slot no longer than that.
///
/// One call out per node is the default: on 3 nodes at c=50 it made batches of ~9
/// checks instead of ~5 with two, for 10-15 % less server CPU per check and no worse
/// p99 (bench/RESULTS.md, 2026-12-04).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coalesce {
    /// Most checks in one batch (the server takes at most 1,000).
    pub max_batch: usize,
    /// Most calls out to one node at a time.
    pub max_in_flight: usize,
}

impl Default for Coalesce {
    fn default() -> Self {
        Self {
            max_batch: 64,
            max_in_flight: 1,
        }
    }
}

impl ClientConfig {
    /// Defaults for `seeds`: a 50 ms deadline, topology every 2 s, 100,000 cached
    /// denials.
    pub fn new(seeds: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            seeds: seeds.into_iter().map(Into::into).collect(),
            deadline: Duration::from_millis(50),
            refresh: Duration::from_secs(2),
            deny_cache: 100_000,
            coalesce: None,
        }
    }
}

/// What a check gets when no node answers in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unavailable {
    /// Denied (retry after 1 s): for limits that protect something that must not be
    /// overrun.
    Closed,
    /// Decided here on a local fixed-window counter of `limit / members` (at least 1)
    /// per `window`: each gateway admits its share, the cluster as a whole about the
    /// limit.
    Open {
        /// The rule's limit.
        limit: u64,
        /// The rule's window.
        window: Duration,
    },
}

/// One check.
#[derive(Debug, Clone)]
pub struct Check {
    /// Who is limited.
    pub key: String,
    /// What is called (`METHOD /path`).
    pub route: String,
    /// Optional tier for rule matching.
    pub tier: Option<String>,
    /// Units this request consumes (at least 1).
    pub cost: u64,
    /// What happens when no node answers.
    pub unavailable: Unavailable,
    /// This check's deadline (default: the client's).
    pub deadline: Option<Duration>,
}

impl Check {
    /// A check of cost 1 that fails closed.
    pub fn new(key: impl Into<String>, route: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            route: route.into(),
            tier: None,
            cost: 1,
            unavailable: Unavailable::Closed,
            deadline: None,
        }
    }

    /// With a tier.
    pub fn tier(mut self, tier: impl Into<String>) -> Self {
        self.tier = Some(tier.into());
        self
    }

    /// With a cost.
    pub fn cost(mut self, cost: u64) -> Self {
        self.cost = cost;
        self
    }

    /// Fail open on `limit` per `window` divided among the members.
    pub fn fail_open(mut self, limit: u64, window: Duration) -> Self {
        self.unavailable = Unavailable::Open { limit, window };
        self
    }

    /// With its own deadline.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }
}

/// Where an answer came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The key's owner decided (0 hops).
    Owner,
    /// A node decided after forwarding (the client's view was stale, or the owner did
    /// not answer and another member was asked).
    Forwarded,
    /// This client's deny cache: an earlier denial still holds.
    DenyCache,
    /// No node answered: decided on the local fail-open share.
    FailOpen,
    /// No node answered: denied (fail closed).
    FailClosed,
}

impl Source {
    /// A short name (`owner`, `forwarded`, `deny-cache`, `fail-open`, `fail-closed`).
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Owner => "owner",
            Source::Forwarded => "forwarded",
            Source::DenyCache => "deny-cache",
            Source::FailOpen => "fail-open",
            Source::FailClosed => "fail-closed",
        }
    }

    /// True when no node of the cluster decided this answer just now.
    pub fn degraded(self) -> bool {
        matches!(self, Source::FailOpen | Source::FailClosed)
    }
}

/// A check's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The numbers of the 429 contract.
    pub quota: Quota,
    /// The rule's window in ms (0 when unknown).
    pub window_ms: u64,
    /// Where it came from.
    pub source: Source,
    /// Not decided on the key's own counter by its owner: a local answer, or a node's
    /// fail-open stand-in or cached denial (the wire answer's `degraded`).
    pub degraded: bool,
    /// The node that decided (none for local answers).
    pub node: Option<String>,
    /// The rule that matched (empty for local answers).
    pub rule: String,
}

impl Answer {
    /// Allowed?
    pub fn allowed(&self) -> bool {
        self.quota.allowed
    }
}

/// Why a check has no answer at all.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ClientError {
    /// The cluster refused the check as malformed (empty or over-long key, bad cost):
    /// nothing was charged, and it never fails open.
    #[error("invalid check: {0}")]
    Invalid(String),
    /// The configuration cannot work (no seeds, an address that is not one).
    #[error("client configuration: {0}")]
    Config(String),
}

/// A ring-aware ringlimit client. Cheap to clone; one per process is enough.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("members", &self.members())
            .finish_non_exhaustive()
    }
}

struct Inner {
    config: ClientConfig,
    topology: Mutex<Arc<Topology>>,
    channels: Mutex<HashMap<String, RateLimiterClient<Channel>>>,
    batchers: Mutex<HashMap<String, tokio::sync::mpsc::Sender<Pending>>>,
    stats: Arc<Counters>,
    deny: Mutex<HashMap<CacheKey, Denial>>,
    fallback: Mutex<HashMap<CacheKey, (u64, u64)>>,
    stale: Arc<Notify>,
}

/// What the client knows of the cluster.
#[derive(Debug, Default)]
struct Topology {
    /// (node id, public address), by id.
    members: Vec<(String, String)>,
    /// The ring over the members, when this client knows the placement version.
    ring: Option<Ring>,
}

type CacheKey = (String, String, Option<String>);

#[derive(Debug, Clone)]
struct Denial {
    until: Instant,
    cost: u64,
    answer: Answer,
}

impl Client {
    /// A client for the cluster reachable through `config.seeds`. Reads the topology
    /// once (a cluster that is not up yet is fine: checks then fail open or closed, and
    /// the topology is read again every `refresh`), and keeps it fresh in a task on the
    /// current tokio runtime for as long as a clone of the client lives.
    pub async fn connect(config: ClientConfig) -> Result<Client, ClientError> {
        if config.seeds.is_empty() {
            return Err(ClientError::Config("no seed address".into()));
        }
        for seed in &config.seeds {
            Endpoint::from_shared(format!("http://{seed}"))
                .map_err(|e| ClientError::Config(format!("seed {seed:?}: {e}")))?;
        }
        let inner = Arc::new(Inner {
            config,
            topology: Mutex::new(Arc::new(Topology::default())),
            channels: Mutex::new(HashMap::new()),
            batchers: Mutex::new(HashMap::new()),
            stats: Arc::default(),
            deny: Mutex::new(HashMap::new()),
            fallback: Mutex::new(HashMap::new()),
            stale: Arc::new(Notify::new()),
        });
        inner.refresh().await;
        tokio::spawn(refresher(Arc::downgrade(&inner), inner.stale.clone()));
        Ok(Client { inner })
    }

    /// The members as last learned: (node id, public address).
    pub fn members(&self) -> Vec<(String, String)> {
        self.inner.topology().members.clone()
    }

    /// Which member owns `key`, by this client's view (None before the topology is
    /// known, or for an unknown placement version).
    pub fn owner(&self, key: &str) -> Option<String> {
        let topology = self.inner.topology();
        topology
            .ring
            .as_ref()
            .and_then(|ring| ring.owner(key.as_bytes()))
            .map(str::to_string)
    }

    /// How coalescing went so far (all zero without [`ClientConfig::coalesce`]).
    pub fn coalesce_stats(&self) -> CoalesceStats {
        CoalesceStats {
            calls: self.inner.stats.calls.load(Ordering::Relaxed),
            checks: self.inner.stats.batched.load(Ordering::Relaxed),
        }
    }

    /// Re-read the topology now.
    pub async fn refresh(&self) {
        self.inner.refresh().await;
    }

    /// Decide one check (see the module docs for the path it takes).
    pub async fn check(&self, check: &Check) -> Result<Answer, ClientError> {
        self.inner.check(check).await
    }
}

/// Re-read the topology every `refresh`, or at once when a call failed; ends with the
/// last client.
async fn refresher(inner: Weak<Inner>, stale: Arc<Notify>) {
    loop {
        let Some(period) = inner.upgrade().map(|i| i.config.refresh) else {
            return;
        };
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stale.notified() => {}
        }
        let Some(strong) = inner.upgrade() else {
            return;
        };
        strong.refresh().await;
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Inner {
    fn topology(&self) -> Arc<Topology> {
        self.topology
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn channel(&self, addr: &str) -> Option<RateLimiterClient<Channel>> {
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(client) = channels.get(addr) {
            return Some(client.clone());
        }
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .ok()?
            .tcp_nodelay(true)
            .connect_timeout(self.config.deadline.max(Duration::from_millis(100)));
        let client = RateLimiterClient::new(endpoint.connect_lazy());
        channels.insert(addr.to_string(), client.clone());
        Some(client)
    }

    /// Ask the known members, then the seeds, for the topology; keep the first answer.
    async fn refresh(&self) {
        let known: Vec<String> = self
            .topology()
            .members
            .iter()
            .map(|(_, addr)| addr.clone())
            .chain(self.config.seeds.iter().cloned())
            .collect();
        for addr in known {
            let Some(mut client) = self.channel(&addr) else {
                continue;
            };
            let mut request = tonic::Request::new(proto::TopologyRequest {});
            request.set_timeout(Duration::from_secs(1));
            let call = tokio::time::timeout(Duration::from_secs(1), client.topology(request));
            let Ok(Ok(answer)) = call.await else {
                continue;
            };
            let answer = answer.into_inner();
            if answer.members.is_empty() {
                continue;
            }
            let members: Vec<(String, String)> = answer
                .members
                .into_iter()
                .map(|m| (m.node_id, m.grpc_addr))
                .collect();
            let ring = (answer.placement_version == ringlimit_ring::PLACEMENT)
                .then(|| Ring::new(members.iter().map(|(id, _)| id.clone()), answer.vnodes));
            let topology = Arc::new(Topology { members, ring });
            *self.topology.lock().unwrap_or_else(|e| e.into_inner()) = topology;
            // Forget channels to addresses no member has any more.
            let live: Vec<String> = self
                .topology()
                .members
                .iter()
                .map(|(_, a)| a.clone())
                .collect();
            self.channels
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|addr, _| live.contains(addr) || self.config.seeds.contains(addr));
            return;
        }
    }

    /// The addresses to try, in order: the owner (by this client's ring), then one
    /// other member, else a seed.
    fn targets(&self, key: &str) -> Vec<String> {
        let topology = self.topology();
        let owner = topology
            .ring
            .as_ref()
            .and_then(|ring| ring.owner(key.as_bytes()))
            .and_then(|id| topology.members.iter().find(|(m, _)| m == id))
            .map(|(_, addr)| addr.clone());
        let mut out: Vec<String> = owner.into_iter().collect();
        // Another member, picked by the key so load spreads, as the second try.
        let n = topology.members.len();
        if n > 0 {
            let start = (Ring::key_hash(key.as_bytes()) % n as u64) as usize;
            for i in 0..n {
                let addr = &topology.members[(start + i) % n].1;
                if !out.contains(addr) {
                    out.push(addr.clone());
                    break;
                }
            }
        }
        if out.is_empty() {
            out.extend(self.config.seeds.iter().take(2).cloned());
        }
        out
    }

    async fn check(&self, check: &Check) -> Result<Answer, ClientError> {
        if check.cost == 0 {
            return Err(ClientError::Invalid("cost must be at least 1".into()));
        }
        let cache_key: CacheKey = (check.key.clone(), check.route.clone(), check.tier.clone());
        if let Some(answer) = self.cached(&cache_key, check.cost) {
            return Ok(answer);
        }
        let deadline = Instant::now() + check.deadline.unwrap_or(self.config.deadline);
        let request = proto::CheckRequest {
            key: check.key.clone(),
            route: check.route.clone(),
            cost: Some(i64::try_from(check.cost).unwrap_or(i64::MAX)),
            tier: check.tier.clone(),
            descriptors: Vec::new(),
        };
        let targets = self.targets(&check.key);
        for (attempt, addr) in targets.iter().enumerate() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let Some(mut client) = self.channel(addr) else {
                continue;
            };
            let sent = match self.config.coalesce {
                Some(coalesce) => self.batched(addr, client, coalesce, request.clone(), deadline),
                None => {
                    let mut call = tonic::Request::new(request.clone());
                    call.set_timeout(left);
                    Box::pin(async move { client.check(call).await.map(|r| r.into_inner()) })
                }
            };
            match tokio::time::timeout(left, sent).await {
                Ok(Ok(response)) => {
                    let answer = answer_of(response, attempt);
                    self.remember(cache_key, check.cost, &answer);
                    return Ok(answer);
                }
                Ok(Err(status)) if refuses_the_request(&status) => {
                    return Err(ClientError::Invalid(status.message().to_string()));
                }
                // Unreachable, timed out, overloaded: the view may be stale.
                Ok(Err(_)) | Err(_) => self.stale.notify_one(),
            }
        }
        Ok(self.unavailable(check, &cache_key))
    }

    /// Send `request` through `addr`'s batcher (started on first use).
    fn batched(
        &self,
        addr: &str,
        client: RateLimiterClient<Channel>,
        coalesce: Coalesce,
        request: proto::CheckRequest,
        deadline: Instant,
    ) -> CallFuture {
        let tx = {
            let mut batchers = self.batchers.lock().unwrap_or_else(|e| e.into_inner());
            batchers
                .entry(addr.to_string())
                .or_insert_with(|| {
                    let (tx, rx) = tokio::sync::mpsc::channel(coalesce.max_batch.max(1) * 64);
                    tokio::spawn(batcher(client, rx, coalesce, self.stats.clone()));
                    tx
                })
                .clone()
        };
        Box::pin(async move {
            let (reply, answer) = tokio::sync::oneshot::channel();
            tx.send(Pending {
                request,
                deadline,
                reply,
            })
            .await
            .map_err(|_| tonic::Status::unavailable("batcher gone"))?;
            answer
                .await
                .map_err(|_| tonic::Status::unavailable("batch dropped"))?
        })
    }

    fn cached(&self, key: &CacheKey, cost: u64) -> Option<Answer> {
        let mut deny = self.deny.lock().unwrap_or_else(|e| e.into_inner());
        let denial = deny.get(key)?;
        let now = Instant::now();
        if now >= denial.until {
            deny.remove(key);
            return None;
        }
        if cost < denial.cost {
            // A denial for cost c says nothing about a smaller cost.
            return None;
        }
        let mut answer = denial.answer.clone();
        answer.quota.retry_after_ms = (denial.until - now).as_millis() as u64;
        answer.source = Source::DenyCache;
        answer.degraded = true;
        Some(answer)
    }

    fn remember(&self, key: CacheKey, cost: u64, answer: &Answer) {
        let retry = answer.quota.retry_after_ms;
        if answer.quota.allowed || retry == 0 || answer.source.degraded() {
            return;
        }
        let mut deny = self.deny.lock().unwrap_or_else(|e| e.into_inner());
        if deny.len() >= self.config.deny_cache && !deny.contains_key(&key) {
            let now = Instant::now();
            deny.retain(|_, d| d.until > now);
            if deny.len() >= self.config.deny_cache {
                return;
            }
        }
        deny.insert(
            key,
            Denial {
                // Measured from after the answer arrived: never shorter than the owner's.
                until: Instant::now() + Duration::from_millis(retry),
                cost,
                answer: answer.clone(),
            },
        );
    }

    /// No node answered: fail closed, or decide on the local fail-open share.
    fn unavailable(&self, check: &Check, key: &CacheKey) -> Answer {
        let now = unix_ms();
        match check.unavailable {
            Unavailable::Closed => Answer {
                quota: Quota {
                    allowed: false,
                    limit: 0,
                    remaining: 0,
                    retry_after_ms: 1_000,
                    reset_at_ms: now + 1_000,
                },
                window_ms: 0,
                source: Source::FailClosed,
                degraded: true,
                node: None,
                rule: String::new(),
            },
            Unavailable::Open { limit, window } => {
                let members = self.topology().members.len().max(1) as u64;
                let share = (limit / members).max(1);
                let window_ms = (window.as_millis() as u64).max(1);
                let index = now / window_ms;
                let mut fallback = self.fallback.lock().unwrap_or_else(|e| e.into_inner());
                if fallback.len() > self.config.deny_cache {
                    fallback.retain(|_, (w, _)| *w == index);
                }
                let (w, used) = fallback.entry(key.clone()).or_insert((index, 0));
                if *w != index {
                    (*w, *used) = (index, 0);
                }
                let reset_at_ms = (index + 1) * window_ms;
                let allowed = *used + check.cost <= share;
                if allowed {
                    *used += check.cost;
                }
                Answer {
                    quota: Quota {
                        allowed,
                        limit: share,
                        remaining: share - *used,
                        retry_after_ms: if allowed { 0 } else { reset_at_ms - now },
                        reset_at_ms,
                    },
                    window_ms,
                    source: Source::FailOpen,
                    degraded: true,
                    node: None,
                    rule: String::new(),
                }
            }
        }
    }
}

/// How coalescing went, for measuring it.
#[derive(Debug, Default)]
struct Counters {
    calls: AtomicU64,
    batched: AtomicU64,
}

/// Coalescing figures since the client started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CoalesceStats {
    /// Calls the batchers made (`Check` for a batch of one, else `CheckBatch`).
    pub calls: u64,
    /// Checks those calls carried.
    pub checks: u64,
}

type CallFuture = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<proto::CheckResponse, tonic::Status>> + Send>,
>;

/// A check waiting in a batcher, and where its answer goes.
struct Pending {
    request: proto::CheckRequest,
    /// When the caller stops waiting: the batch's call gives up at its latest.
    deadline: Instant,
    reply: tokio::sync::oneshot::Sender<Result<proto::CheckResponse, tonic::Status>>,
}

/// One node's batcher (see [`Coalesce`]): ends when the client drops its sender.
async fn batcher(
    client: RateLimiterClient<Channel>,
    mut rx: tokio::sync::mpsc::Receiver<Pending>,
    coalesce: Coalesce,
    stats: Arc<Counters>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(coalesce.max_in_flight.max(1)));
    let max = coalesce.max_batch.clamp(1, 1000);
    while let Some(first) = rx.recv().await {
        // Wait for a free call slot; what arrives meanwhile joins this batch.
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut batch = vec![first];
        while batch.len() < max {
            match rx.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        stats.calls.fetch_add(1, Ordering::Relaxed);
        stats
            .batched
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        let mut client = client.clone();
        tokio::spawn(async move {
            send_batch(&mut client, batch).await;
            drop(slot);
        });
    }
}

/// One `CheckBatch` call for `batch`. The server refuses a whole batch if any item is
/// invalid; then each item is sent alone, so one bad check fails only itself.
async fn send_batch(client: &mut RateLimiterClient<Channel>, batch: Vec<Pending>) {
    let latest = batch
        .iter()
        .map(|p| p.deadline)
        .max()
        .unwrap_or_else(Instant::now);
    if let [_] = batch.as_slice() {
        let one = batch.into_iter().next().expect("one");
        let result = client
            .check(until(latest, one.request))
            .await
            .map(|r| r.into_inner());
        let _ = one.reply.send(result);
        return;
    }
    let checks: Vec<proto::CheckRequest> = batch.iter().map(|p| p.request.clone()).collect();
    match client
        .check_batch(until(latest, proto::CheckBatchRequest { checks }))
        .await
        .map(|r| r.into_inner().results)
    {
        Ok(results) if results.len() == batch.len() => {
            for (pending, result) in batch.into_iter().zip(results) {
                let _ = pending.reply.send(Ok(result));
            }
        }
        Err(status) if status.code() == tonic::Code::InvalidArgument => {
            for pending in batch {
                let result = client
                    .check(until(pending.deadline, pending.request))
                    .await
                    .map(|r| r.into_inner());
                let _ = pending.reply.send(result);
            }
        }
        Ok(_) => {
            for pending in batch {
                let _ = pending.reply.send(Err(tonic::Status::internal(
                    "batch answer of the wrong length",
                )));
            }
        }
        Err(status) => {
            for pending in batch {
                let _ = pending.reply.send(Err(status.clone()));
            }
        }
    }
}

/// A call of `message` that gives up at `deadline` (the server sees it as grpc-timeout).
fn until<T>(deadline: Instant, message: T) -> tonic::Request<T> {
    let mut call = tonic::Request::new(message);
    call.set_timeout(deadline.saturating_duration_since(Instant::now()));
    call
}

/// The wire answer as an [`Answer`]; `attempt` > 0 means the owner did not answer and
/// another member decided (after forwarding).
fn answer_of(response: proto::CheckResponse, attempt: usize) -> Answer {
    let hops = response.descriptors.first().map_or(0, |d| d.hops);
    let source = if attempt == 0 && hops == 0 {
        Source::Owner
    } else {
        Source::Forwarded
    };
    Answer {
        quota: Quota {
            allowed: response.allowed,
            limit: response.limit,
            remaining: response.remaining,
            retry_after_ms: response.retry_after_ms,
            reset_at_ms: u64::try_from(response.reset_at).unwrap_or(0),
        },
        window_ms: response.window_ms,
        source,
        degraded: response.degraded,
        node: response.decider.map(|d| d.node_id),
        rule: response.rule,
    }
}

/// Whether a node refused the request itself (invalid, too large), so no other node
/// would take it, as opposed to being unable to decide it now (overloaded, owner
/// unreachable). Nodes name the reason in the `ringlimit-reason` trailer; an older node
/// without it is told apart by its message.
fn refuses_the_request(status: &tonic::Status) -> bool {
    if !matches!(
        status.code(),
        tonic::Code::InvalidArgument | tonic::Code::ResourceExhausted
    ) {
        return false;
    }
    match status.metadata().get("ringlimit-reason") {
        Some(reason) => reason != "overloaded",
        None => !status.message().contains("overloaded"),
    }
}

#[cfg(test)]
mod tests {
    use super::refuses_the_request;

    fn with_reason(
        code: tonic::Code,
        message: &str,
        reason: Option<&'static str>,
    ) -> tonic::Status {
        let mut status = tonic::Status::new(code, message);
        if let Some(reason) = reason {
            status.metadata_mut().insert(
                "ringlimit-reason",
                tonic::metadata::MetadataValue::from_static(reason),
            );
        }
        status
    }

    #[test]
    fn the_reason_trailer_tells_an_overloaded_node_from_a_bad_request() {
        use tonic::Code::{InvalidArgument, ResourceExhausted, Unavailable};
        // By the trailer, whatever the message says.
        assert!(!refuses_the_request(&with_reason(
            ResourceExhausted,
            "busy",
            Some("overloaded")
        )));
        assert!(refuses_the_request(&with_reason(
            InvalidArgument,
            "overloaded key",
            Some("invalid_argument")
        )));
        // An over-size message (tonic's own refusal, no trailer) is the request's fault.
        assert!(refuses_the_request(&with_reason(
            ResourceExhausted,
            "message too large",
            None
        )));
        // An older node without the trailer: by its message.
        assert!(!refuses_the_request(&with_reason(
            ResourceExhausted,
            "shard 3 overloaded",
            None
        )));
        // Unavailable is never the request's fault.
        assert!(!refuses_the_request(&with_reason(
            Unavailable,
            "owner unreachable",
            Some("owner_unreachable")
        )));
    }

    /// A node that takes the connection and never answers: each coalesced call gives up
    /// at its checks' deadline, and its slot goes to the next batch (with one slot, a
    /// call that never ended would starve every later check to that node).
    #[tokio::test]
    async fn a_batch_call_without_an_answer_ends_at_its_deadline_and_frees_its_slot() {
        use super::{batcher, Coalesce, Counters, Pending, RateLimiterClient};
        use std::time::{Duration, Instant};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_lazy();
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        let coalesce = Coalesce {
            max_batch: 64,
            max_in_flight: 1,
        };
        let counters = std::sync::Arc::new(Counters::default());
        tokio::spawn(batcher(
            RateLimiterClient::new(channel),
            rx,
            coalesce,
            counters,
        ));
        for call in 0..2 {
            let (reply, answer) = tokio::sync::oneshot::channel();
            let request = crate::proto::CheckRequest {
                key: format!("k{call}"),
                route: "GET /x".into(),
                ..Default::default()
            };
            let deadline = Instant::now() + Duration::from_millis(100);
            tx.send(Pending {
                request,
                deadline,
                reply,
            })
            .await
            .unwrap();
            let result = tokio::time::timeout(Duration::from_secs(10), answer)
                .await
                .unwrap_or_else(|_| panic!("call {call} still out 10 s after its 100 ms deadline"))
                .expect("the batcher answers");
            let status = result.expect_err("nothing answered");
            assert!(
                matches!(
                    status.code(),
                    tonic::Code::Cancelled | tonic::Code::DeadlineExceeded
                ),
                "call {call}: {status:?}"
            );
        }
    }
}
