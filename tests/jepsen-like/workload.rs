//! The workload: a seeded PRNG, a few hot keys plus many Zipf-distributed keys (and a
//! whale key when budget leases are on), mixed
//! costs, requests bunched around window boundaries, spread over all serving nodes.

use std::sync::Arc;
use std::time::Duration;

use ringlimit::proto::rate_limiter_client::RateLimiterClient;
use ringlimit::proto::CheckRequest;
use tokio_util::sync::CancellationToken;

use crate::harness::Harness;
use crate::history::{now_ms, Entry};

/// splitmix64: tiny, seedable, good enough for test schedules.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [lo, hi] (inclusive).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.next_u64() as usize % items.len()]
    }
}

/// Zipf(s) over ranks 0..n by inverse CDF on a precomputed table.
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Zipf {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=n)
            .map(|k| {
                acc += 1.0 / (k as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }
    pub fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.f64();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

pub struct WorkloadConfig {
    pub clients: u32,
    pub hot_keys: usize,
    pub zipf_keys: usize,
    pub deadline: Duration,
    /// Window length used to bunch requests around boundaries.
    pub window_ms: u64,
    /// Share of the ops sent to the one key `whale` (0: none, and no draw for it, so a
    /// seed gives the workload it gave before).
    pub whale: f64,
    /// (route, weight).
    pub routes: Vec<(String, u32)>,
}

/// Start the client tasks; they stop when `stop` is cancelled (an op in flight still
/// completes or times out, so every invoke gets its completion).
pub fn spawn(
    h: Arc<Harness>,
    cfg: Arc<WorkloadConfig>,
    seed: u64,
    stop: CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    let zipf = Arc::new(Zipf::new(cfg.zipf_keys, 1.1));
    (0..cfg.clients)
        .map(|c| {
            let h = h.clone();
            let cfg = cfg.clone();
            let zipf = zipf.clone();
            let stop = stop.clone();
            let mut rng =
                Rng::new(seed ^ (0xC11E_0000 + u64::from(c)).wrapping_mul(0x2545_F491_4F6C_DD1D));
            tokio::spawn(async move {
                let total_weight: u32 = cfg.routes.iter().map(|r| r.1).sum();
                while !stop.is_cancelled() {
                    // Bunch requests around window boundaries.
                    let phase = now_ms() % cfg.window_ms;
                    let near = phase > cfg.window_ms - 150 || phase < 150;
                    let pause = if near {
                        rng.range(2, 10)
                    } else {
                        rng.range(30, 130)
                    };
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_millis(pause)) => {}
                    }
                    let targets = h.targets();
                    if targets.is_empty() {
                        continue;
                    }
                    let (node, addr) = rng.pick(&targets).clone();
                    let mut w = rng.range(0, u64::from(total_weight) - 1) as u32;
                    let mut route = cfg.routes[0].0.clone();
                    for (r, weight) in &cfg.routes {
                        if w < *weight {
                            route = r.clone();
                            break;
                        }
                        w -= weight;
                    }
                    let key = if cfg.whale > 0.0 && rng.f64() < cfg.whale {
                        "whale".to_string()
                    } else if rng.f64() < 0.4 {
                        format!("hot-{}", rng.range(0, cfg.hot_keys as u64 - 1))
                    } else {
                        format!("z-{}", zipf.sample(&mut rng))
                    };
                    let u = rng.f64();
                    let cost = if u < 0.6 {
                        1
                    } else if u < 0.85 {
                        2
                    } else {
                        3
                    };
                    let id = h.history.next_op_id();
                    h.history.record(&Entry::Invoke {
                        id,
                        client: c,
                        t: now_ms(),
                        key: key.clone(),
                        route: route.clone(),
                        cost,
                        node: node.clone(),
                        addr: addr.to_string(),
                    });
                    let mut client = RateLimiterClient::new(h.channel(addr));
                    let request = CheckRequest {
                        key,
                        route,
                        cost: Some(cost as i64),
                        tier: None,
                        descriptors: Vec::new(),
                    };
                    let result = tokio::time::timeout(cfg.deadline, client.check(request)).await;
                    let t = now_ms();
                    let entry = match result {
                        Err(_) => Entry::Info {
                            id,
                            t,
                            error: "client deadline".into(),
                        },
                        Ok(Ok(answer)) => {
                            let a = answer.into_inner();
                            let d = a.decider.clone().unwrap_or_default();
                            Entry::Ok {
                                id,
                                t,
                                allowed: a.allowed,
                                limit: a.limit,
                                // The top level says 0 on every denial (429 headers);
                                // the descriptor carries what is really left.
                                remaining: a
                                    .descriptors
                                    .first()
                                    .map_or(a.remaining, |d| d.remaining),
                                decider: d.node_id,
                                generation: d.generation,
                                window_id: a.window_id,
                                sequence: a.sequence,
                                degraded: a.degraded,
                                hops: a.descriptors.first().map(|d| d.hops).unwrap_or(0),
                                rule: a.rule,
                                retry_after_ms: a.retry_after_ms,
                                leased: a.leased,
                            }
                        }
                        Ok(Err(status)) => {
                            use tonic::Code;
                            let error = format!("{:?}: {}", status.code(), status.message());
                            match status.code() {
                                // Refused before anything was charged.
                                Code::InvalidArgument
                                | Code::ResourceExhausted
                                | Code::FailedPrecondition => Entry::Fail { id, t, error },
                                // Transport errors and resets: the outcome is unknown.
                                _ => Entry::Info { id, t, error },
                            }
                        }
                    };
                    h.history.record(&entry);
                }
            })
        })
        .collect()
}
