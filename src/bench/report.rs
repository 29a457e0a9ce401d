//! What a measured run found, and the medians and ratios printed across rounds. The line
//! formats are parsed by bench/run-all.sh: change them together.

use std::time::Duration;

use hdrhistogram::Histogram;

/// The outcome of one measured run.
pub struct RunResult {
    /// "ringlimit" or "redis".
    pub system: &'static str,
    /// Checks decided.
    pub checks: u64,
    /// Allowed checks.
    pub allowed: u64,
    /// Failed calls.
    pub errors: u64,
    /// Measured time.
    pub elapsed: Duration,
    /// Per-call latency, µs.
    pub latency: Histogram<u64>,
    /// CPU seconds (user + system) the local node processes spent in the measured time.
    pub server_cpu_s: Option<f64>,
}

impl RunResult {
    /// Checks per second.
    pub fn rate(&self) -> f64 {
        self.checks as f64 / self.elapsed.as_secs_f64()
    }

    /// Latency quantile in ms.
    pub fn ms(&self, q: f64) -> f64 {
        self.latency.value_at_quantile(q) as f64 / 1000.0
    }

    /// Server CPU per check, µs (local nodes only).
    pub fn cpu_us_per_check(&self) -> Option<f64> {
        self.server_cpu_s
            .filter(|_| self.checks > 0)
            .map(|s| s * 1e6 / self.checks as f64)
    }

    /// The run's lines (bench/run-all.sh parses them).
    pub fn print(&self) {
        if let Some(us) = self.cpu_us_per_check() {
            println!("{:<10} server CPU {us:.1} µs/check", self.system);
        }
        println!(
            "{:<10} checks/s {:>10.0}  p50 {:>7.3} ms  p90 {:>7.3} ms  p99 {:>7.3} ms  p99.9 {:>7.3} ms  allowed {:>9}  denied {:>9}  errors {}",
            self.system,
            self.rate(),
            self.ms(0.50),
            self.ms(0.90),
            self.ms(0.99),
            self.ms(0.999),
            self.allowed,
            self.checks - self.allowed,
            self.errors
        );
    }
}

/// The median of `values` (not empty): for an even count the mean of the middle two, so
/// two rounds report their mean rather than the better or the worse of them.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    let mid = values.len() / 2;
    if values.len().is_multiple_of(2) {
        (values[mid - 1] + values[mid]) / 2.0
    } else {
        values[mid]
    }
}

/// The median server CPU per check of `runs` that measured it.
pub fn median_cpu(runs: &[RunResult]) -> Option<f64> {
    let c: Vec<f64> = runs
        .iter()
        .filter_map(RunResult::cpu_us_per_check)
        .collect();
    (!c.is_empty()).then(|| median(c))
}

/// Median checks/s and server CPU per check of a front end (`front`, e.g. Envoy RLS)
/// against the native `Check` rounds of the same run.
pub fn print_front_ratio(name: &str, front: &[RunResult], native: &[RunResult]) {
    if front.is_empty() || native.is_empty() {
        return;
    }
    let rate_front = median(front.iter().map(RunResult::rate).collect());
    let rate_native = median(native.iter().map(RunResult::rate).collect());
    println!(
        "median {name} checks/s {rate_front:.0}, native Check checks/s {rate_native:.0}, ratio {:.2}",
        rate_front / rate_native
    );
    if let (Some(f), Some(n)) = (median_cpu(front), median_cpu(native)) {
        println!(
            "median server CPU per check: {name} {f:.1} µs, native {n:.1} µs, ratio {name}/native {:.2}",
            f / n
        );
    }
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(vec![3.0]), 3.0);
        assert_eq!(median(vec![5.0, 1.0, 3.0]), 3.0);
        assert_eq!(median(vec![40_803.0, 39_953.0]), 40_378.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
