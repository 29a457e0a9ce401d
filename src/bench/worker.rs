//! One caller of the load: a loop that paces itself, sends a check through one API
//! (native, Envoy RLS, Gubernator, health, ring-aware client or Redis), times the call
//! into its histogram and adds to the run's counters.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use hdrhistogram::Histogram;

use ringlimit::proto::envoy::extensions::common::ratelimit::v3::{
    rate_limit_descriptor::Entry, RateLimitDescriptor,
};
use ringlimit::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use ringlimit::proto::gubernator::{
    GetRateLimitsReq, GetRateLimitsResp, RateLimitReq, Status as GubernatorStatus,
};
use ringlimit::proto::rate_limiter_client::RateLimiterClient;
use ringlimit::proto::{CheckBatchRequest, CheckBatchResponse, CheckRequest, CheckResponse};

use super::args::ClientKind;
use super::keys::Keys;
use super::{lean, redis};

/// An open-loop caller's schedule.
pub struct Pacing {
    /// Time between two calls of this caller.
    pub interval: Duration,
    /// When the next call is due.
    pub next: Instant,
}

/// One concurrent caller: its key sequence, pacing and what it sends, and the counters
/// of the run it adds to.
pub struct Worker {
    pub keys: Keys,
    pub rng: u64,
    pub pacing: Option<Pacing>,
    pub batch: usize,
    pub client: ClientKind,
    pub cost: i64,
    pub limit: u64,
    /// Send `ShouldRateLimit` in (domain, descriptor key) instead of `Check`.
    pub envoy: Option<(String, String)>,
    /// Send `GetRateLimits` instead of `Check`.
    pub gubernator: bool,
    /// Send tonic's `Health/Check` instead of `Check` (a call that decides nothing).
    pub health: bool,
    pub checks: Arc<AtomicU64>,
    pub allowed: Arc<AtomicU64>,
    pub errors: Arc<AtomicU64>,
    pub measuring: Arc<AtomicBool>,
    pub stop: Arc<AtomicBool>,
}

impl Worker {
    /// Wait for this caller's next call; returns the instant its latency counts from.
    async fn pace(&mut self) -> Instant {
        let Some(pacing) = self.pacing.as_mut() else {
            return Instant::now();
        };
        let scheduled = pacing.next;
        pacing.next += pacing.interval;
        if Instant::now() < scheduled {
            tokio::time::sleep_until(scheduled.into()).await;
            // On time: timed from the actual send, so the timer's own slack (up to a
            // millisecond) is not charged to the system under test.
            Instant::now()
        } else {
            // Late because the previous call was slow: the wait is the system's.
            scheduled
        }
    }

    /// Counts one answered call if the run is measuring.
    fn record(&self, latency: &mut Histogram<u64>, started: Instant, checks: u64, allowed: u64) {
        if self.measuring.load(Ordering::Relaxed) {
            let _ = latency.record(started.elapsed().as_micros().max(1) as u64);
            self.checks.fetch_add(checks, Ordering::Relaxed);
            self.allowed.fetch_add(allowed, Ordering::Relaxed);
        }
    }

    /// Checks through the shared ring-aware client until told to stop. Answers decided
    /// without a node (fail-open, fail-closed) count as errors: the bench measures the
    /// cluster.
    pub async fn ring_aware(
        mut self,
        client: ringlimit_client::Client,
        forwarded: Arc<AtomicU64>,
    ) -> anyhow::Result<Histogram<u64>> {
        let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
        while !self.stop.load(Ordering::Relaxed) {
            let started = self.pace().await;
            let key = self.keys.next(&mut self.rng);
            let check = ringlimit_client::Check::new(key, "GET /bench")
                .cost(u64::try_from(self.cost).unwrap_or(1));
            match client.check(&check).await {
                Ok(a) if !a.source.degraded() => {
                    if a.source == ringlimit_client::Source::Forwarded
                        && self.measuring.load(Ordering::Relaxed)
                    {
                        forwarded.fetch_add(1, Ordering::Relaxed);
                    }
                    self.record(&mut latency, started, 1, u64::from(a.allowed()));
                }
                _ => {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Ok(latency)
    }

    /// Calls the node at `addr` until told to stop, reconnecting when the node closes
    /// the connection.
    pub async fn ringlimit(mut self, addr: String) -> anyhow::Result<Histogram<u64>> {
        match self.client {
            ClientKind::Tonic => self.ringlimit_tonic(addr).await,
            ClientKind::RingAware => unreachable!("ring-aware callers share one client"),
            ClientKind::Lean => {
                let target = addr.trim_start_matches("http://").to_string();
                let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
                while !self.stop.load(Ordering::Relaxed) {
                    let (client, connection) = lean::LeanClient::connect(&target).await?;
                    // The connection is polled in this worker's task, not a task of its own.
                    let closed = tokio::select! {
                        result = connection => Some(result),
                        () = self.ringlimit_lean(client, &mut latency) => None,
                    };
                    if let Some(result) = closed {
                        // The node closed or broke the connection: count it, reconnect.
                        tracing::debug!(?result, %target, "bench connection ended");
                        self.errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                Ok(latency)
            }
        }
    }

    /// Calls on `client` until told to stop; failed calls are counted.
    async fn ringlimit_lean(&mut self, mut client: lean::LeanClient, latency: &mut Histogram<u64>) {
        const CHECK: &str = "/ringlimit.v1.RateLimiter/Check";
        const CHECK_BATCH: &str = "/ringlimit.v1.RateLimiter/CheckBatch";
        const RLS: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
        const GUBERNATOR: &str = "/pb.gubernator.V1/GetRateLimits";
        const HEALTH: &str = "/grpc.health.v1.Health/Check";
        while !self.stop.load(Ordering::Relaxed) {
            let started = self.pace().await;
            if self.health {
                let request = tonic_health::pb::HealthCheckRequest::default();
                match client
                    .unary::<_, tonic_health::pb::HealthCheckResponse>(HEALTH, &request)
                    .await
                {
                    // A serving node "allows"; any other status counts as a denial.
                    Ok(a) => {
                        let serving =
                            tonic_health::pb::health_check_response::ServingStatus::Serving;
                        self.record(latency, started, 1, u64::from(a.status == serving as i32));
                    }
                    Err(_) => {
                        self.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else if self.gubernator {
                let request = self.gubernator_request();
                match client
                    .unary::<_, GetRateLimitsResp>(GUBERNATOR, &request)
                    .await
                {
                    Ok(a) if a.responses.len() == 1 && a.responses[0].error.is_empty() => {
                        let under = a.responses[0].status == GubernatorStatus::UnderLimit as i32;
                        self.record(latency, started, 1, u64::from(under));
                    }
                    _ => {
                        self.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else if let Some(request) = self.envoy_request() {
                match client.unary::<_, RateLimitResponse>(RLS, &request).await {
                    Ok(a) => self.record(latency, started, 1, u64::from(a.overall_code == 1)),
                    Err(_) => {
                        self.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else if self.batch == 1 {
                let key = self.keys.next(&mut self.rng);
                let request = self.request(key);
                match client.unary::<_, CheckResponse>(CHECK, &request).await {
                    Ok(a) => self.record(latency, started, 1, u64::from(a.allowed)),
                    Err(_) => {
                        self.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else {
                let request = self.batch_request();
                match client
                    .unary::<_, CheckBatchResponse>(CHECK_BATCH, &request)
                    .await
                {
                    Ok(a) => self.record_batch(latency, started, &a.results),
                    Err(_) => {
                        self.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    }

    /// `ringlimit_lean` over tonic's generated client.
    async fn ringlimit_tonic(mut self, addr: String) -> anyhow::Result<Histogram<u64>> {
        let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
        let mut client = RateLimiterClient::connect(addr.clone())
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        while !self.stop.load(Ordering::Relaxed) {
            let started = self.pace().await;
            if self.batch == 1 {
                let key = self.keys.next(&mut self.rng);
                match client.check(self.request(key)).await {
                    Ok(a) => {
                        self.record(&mut latency, started, 1, u64::from(a.into_inner().allowed))
                    }
                    Err(_) => {
                        self.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else {
                match client.check_batch(self.batch_request()).await {
                    Ok(a) => self.record_batch(&mut latency, started, &a.into_inner().results),
                    Err(_) => {
                        self.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        Ok(latency)
    }

    /// A `CheckBatch` of `--batch` checks on the next keys.
    fn batch_request(&mut self) -> CheckBatchRequest {
        let checks = (0..self.batch)
            .map(|_| {
                let key = self.keys.next(&mut self.rng);
                self.request(key)
            })
            .collect();
        CheckBatchRequest { checks }
    }

    /// Counts one answered `CheckBatch`.
    fn record_batch(
        &self,
        latency: &mut Histogram<u64>,
        started: Instant,
        results: &[CheckResponse],
    ) {
        let allowed = results.iter().filter(|r| r.allowed).count() as u64;
        self.record(latency, started, results.len() as u64, allowed);
    }

    /// The next key as one RLS descriptor, when the load goes through Envoy's API.
    fn envoy_request(&mut self) -> Option<RateLimitRequest> {
        let (domain, descriptor_key) = self.envoy.clone()?;
        let key = self.keys.next(&mut self.rng).to_string();
        Some(RateLimitRequest {
            domain,
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: descriptor_key,
                    value: key,
                }],
                ..Default::default()
            }],
            hits_addend: u32::try_from(self.cost).unwrap_or(1),
        })
    }

    /// The next key as one Gubernator request: `--limit` per minute, token bucket
    /// (Gubernator's default algorithm), `--cost` hits.
    fn gubernator_request(&mut self) -> GetRateLimitsReq {
        let key = self.keys.next(&mut self.rng).to_string();
        GetRateLimitsReq {
            requests: vec![RateLimitReq {
                name: "bench".into(),
                unique_key: key,
                hits: self.cost,
                limit: i64::try_from(self.limit).unwrap_or(i64::MAX),
                duration: 60_000,
                ..Default::default()
            }],
        }
    }

    /// One native check of `key`.
    fn request(&self, key: &str) -> CheckRequest {
        CheckRequest {
            key: key.to_string(),
            route: "GET /bench".into(),
            cost: Some(self.cost),
            tier: None,
            descriptors: Vec::new(),
        }
    }

    /// The same load against Redis + the reference script: `--batch` checks pipelined per
    /// call.
    pub async fn redis(mut self, addr: String, sha: String) -> anyhow::Result<Histogram<u64>> {
        let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
        let mut conn = redis::Conn::connect(&addr).await?;
        while !self.stop.load(Ordering::Relaxed) {
            let started = self.pace().await;
            let now_ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
            for _ in 0..self.batch {
                let key = self.keys.next(&mut self.rng);
                redis::push_check(
                    &mut conn,
                    &sha,
                    key,
                    "GET /bench",
                    self.limit,
                    60_000,
                    now_ms,
                );
            }
            conn.flush().await?;
            let mut allowed = 0;
            let mut failed = false;
            for _ in 0..self.batch {
                match redis::admitted(&conn.read().await?) {
                    Ok(a) => allowed += u64::from(a),
                    Err(_) => failed = true,
                }
            }
            if failed {
                self.errors.fetch_add(1, Ordering::Relaxed);
            } else {
                self.record(&mut latency, started, self.batch as u64, allowed);
            }
        }
        Ok(latency)
    }
}
