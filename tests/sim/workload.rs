//! The clients' workload, as in the process suite (`tests/jepsen-like/workload.rs`):
//! a few hot keys plus Zipf-distributed ones (and a whale key with budget leases on), costs 1-3, three algorithms' routes, and
//! requests bunched around window boundaries.

use crate::rng::Rng;

/// Zipf(s) over ranks 0..n by inverse CDF on a precomputed table.
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Zipf {
        let weights: Vec<f64> = (1..=n).map(|k| 1.0 / (k as f64).powf(s)).collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cdf = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        Zipf { cdf }
    }

    pub fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.f64();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

/// What the clients ask for.
pub struct Workload {
    pub hot_keys: u64,
    pub zipf_keys: usize,
    pub window_ms: u64,
    /// (route, weight).
    pub routes: Vec<(String, u64)>,
    /// Share of the ops sent to the one key `whale` (0: none, and no draw for it): with
    /// budget leases on, a key hot at every entry node, so its owner lends it all the
    /// time (the process suite's `whale`).
    pub whale: f64,
}

impl Workload {
    /// The process suite's mix: `GET /fw` 60, `GET /log` 25, `GET /tb` 15, and the
    /// fenced rule `GET /fence` 10.
    pub fn standard() -> Workload {
        Workload {
            hot_keys: 4,
            zipf_keys: 200,
            window_ms: 2000,
            whale: 0.0,
            routes: vec![
                ("GET /fw".into(), 60),
                ("GET /log".into(), 25),
                ("GET /tb".into(), 15),
                ("GET /fence".into(), 10),
            ],
        }
    }

    /// The next op: (route, key, cost).
    pub fn draw(&self, rng: &mut Rng, zipf: &Zipf) -> (String, String, u64) {
        let total: u64 = self.routes.iter().map(|r| r.1).sum();
        let mut w = rng.range(0, total - 1);
        let mut route = self.routes[0].0.clone();
        for (r, weight) in &self.routes {
            if w < *weight {
                route = r.clone();
                break;
            }
            w -= weight;
        }
        let key = if self.whale > 0.0 && rng.f64() < self.whale {
            "whale".to_string()
        } else if rng.chance(0.4) {
            format!("hot-{}", rng.range(0, self.hot_keys - 1))
        } else {
            format!("z-{}", zipf.sample(rng))
        };
        let u = rng.f64();
        let cost = if u < 0.6 {
            1
        } else if u < 0.85 {
            2
        } else {
            3
        };
        (route, key, cost)
    }

    /// The pause before a client's next op: short near a window boundary.
    pub fn pause(&self, rng: &mut Rng, now: u64) -> u64 {
        let phase = now % self.window_ms;
        if phase > self.window_ms - 150 || phase < 150 {
            rng.range(2, 10)
        } else {
            rng.range(30, 130)
        }
    }
}
