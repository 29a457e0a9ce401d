//! The key space of a run and its sampler: uniform or Zipf, seeded, one generator state
//! per caller.

use std::sync::Arc;

use super::args::{BenchArgs, Distribution};

/// The key space and its sampler.
#[derive(Clone)]
pub struct Keys {
    names: Arc<Vec<String>>,
    /// Cumulative Zipf weights; empty for uniform.
    cdf: Arc<Vec<f64>>,
}

impl Keys {
    /// `--keys` names, drawn as `--distribution` says.
    pub fn new(args: &BenchArgs) -> Self {
        let names = (0..args.keys).map(|i| format!("client_{i}")).collect();
        let cdf = match args.distribution {
            Distribution::Uniform => Vec::new(),
            Distribution::Zipf => {
                let mut total = 0.0;
                let mut cdf: Vec<f64> = (1..=args.keys)
                    .map(|rank| {
                        total += 1.0 / (rank as f64).powf(args.zipf_s);
                        total
                    })
                    .collect();
                for c in &mut cdf {
                    *c /= total;
                }
                cdf
            }
        };
        Self {
            names: Arc::new(names),
            cdf: Arc::new(cdf),
        }
    }

    /// The keys `keep` accepts, drawn uniformly (`--entry`: a node's own keys, or the
    /// others'). At least one key must be kept.
    pub fn filtered(&self, keep: impl Fn(&str) -> bool) -> anyhow::Result<Self> {
        let names: Vec<String> = self.names.iter().filter(|k| keep(k)).cloned().collect();
        anyhow::ensure!(
            !names.is_empty(),
            "no key of the run passes the entry filter"
        );
        Ok(Self {
            names: Arc::new(names),
            cdf: Arc::new(Vec::new()),
        })
    }

    /// The next key drawn with `rng`.
    pub fn next(&self, rng: &mut u64) -> &str {
        let r = splitmix(rng);
        let index = if self.cdf.is_empty() {
            (r % self.names.len() as u64) as usize
        } else {
            let u = (r >> 11) as f64 / (1u64 << 53) as f64;
            self.cdf
                .partition_point(|&c| c < u)
                .min(self.names.len() - 1)
        };
        &self.names[index]
    }
}

/// SplitMix64: a small, fast, seedable generator (one u64 of state per caller).
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(n: usize) -> Keys {
        Keys {
            names: Arc::new((0..n).map(|i| format!("client_{i}")).collect()),
            cdf: Arc::new(Vec::new()),
        }
    }

    #[test]
    fn a_filtered_key_set_draws_only_the_keys_it_kept() {
        let odd = keys(10)
            .filtered(|k| k.ends_with(['1', '3', '5', '7', '9']))
            .unwrap();
        let mut rng = 7;
        for _ in 0..100 {
            let k = odd.next(&mut rng);
            assert!(k.ends_with(['1', '3', '5', '7', '9']), "{k}");
        }
        assert!(
            keys(10).filtered(|_| false).is_err(),
            "an empty set is refused"
        );
    }
}
