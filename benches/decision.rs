//! Microbenchmarks: one in-shard decision per algorithm (the target is ≤ 50 ns), the
//! `governor` crate's GCRA as a reference point, and one shard round trip (handle →
//! bounded channel → actor → oneshot back).
//!
//! Run: `cargo bench --bench decision`. Time is injected, so every decision runs the
//! full algorithm on a live state with a moving clock, not a cached answer.

use std::num::NonZeroU64;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use divan::{black_box, Bencher};
use ringlimit::algorithms::{FixedWindow, Gcra, Limiter, SlidingCounter, SlidingLog, TokenBucket};
use ringlimit::clock::SystemClock;
use ringlimit::config::rules::RuleSet;
use ringlimit::shard::{Charge, KeyId, ShardConfig, Shards, Store};

fn main() {
    divan::main();
}

fn nz(n: u64) -> NonZeroU64 {
    NonZeroU64::new(n).unwrap()
}

fn limiters() -> Vec<(&'static str, Limiter)> {
    // Limits high enough that the benchmark mostly admits (the full update path).
    let w = Duration::from_secs(60);
    let big = nz(1_000_000_000);
    vec![
        (
            "token_bucket",
            Limiter::TokenBucket(TokenBucket::new(big, big, w).unwrap()),
        ),
        (
            "gcra_meter",
            Limiter::LeakyBucket(Gcra::meter(big, w, big).unwrap()),
        ),
        (
            "fixed_window",
            Limiter::FixedWindow(FixedWindow::new(big, w).unwrap()),
        ),
        (
            "sliding_window_log",
            Limiter::SlidingWindowLog(SlidingLog::new(nz(100_000), w).unwrap()),
        ),
        (
            "sliding_window_counter",
            Limiter::SlidingWindowCounter(SlidingCounter::new(big, w).unwrap()),
        ),
    ]
}

/// One decision on one key's state, the clock advancing 1 ms per call.
#[divan::bench(args = ["token_bucket", "gcra_meter", "fixed_window", "sliding_window_log", "sliding_window_counter"])]
fn algorithm_decision(bencher: Bencher, name: &str) {
    let limiter = limiters().into_iter().find(|(n, _)| *n == name).unwrap().1;
    let mut state = limiter.new_state();
    let mut now = 1_767_225_600_000u64;
    bencher.bench_local(|| {
        now += 1;
        black_box(limiter.check(&mut state, black_box(now), NonZeroU64::MIN))
    });
}

/// The `governor` crate's GCRA on a direct (single-key) limiter, for reference.
#[divan::bench]
fn governor_gcra_direct(bencher: Bencher) {
    use governor::{Quota, RateLimiter};
    let limiter = RateLimiter::direct(Quota::per_second(
        std::num::NonZeroU32::new(1_000_000_000).unwrap(),
    ));
    bencher.bench_local(|| black_box(limiter.check()));
}

/// A decision through the shard's store: hash lookup, algorithm, expiry bookkeeping
/// (10,000 keys, round robin). The counter's identity is computed when a check is
/// planned, not here: see `key_identity` for that part.
#[divan::bench]
fn store_decision_10k_keys(bencher: Bencher) {
    let rules = RuleSet::builtin();
    let rule = rules.default_rule().clone();
    let mut store = Store::new(1_000_000, 1);
    let ids: Vec<KeyId> = (0..10_000)
        .map(|i| KeyId::of(&rule.name, format!("client_{i}").as_bytes(), "GET /bench"))
        .collect();
    let mut i = 0;
    let mut now = 1_767_225_600_000u64;
    bencher.bench_local(|| {
        i = (i + 1) % ids.len();
        now += 1;
        let counter = ringlimit::shard::Counter {
            id: ids[i],
            fingerprint: rule.fingerprint,
            limiter: &rule.limiter,
            local: false,
        };
        black_box(store.check(counter, now, NonZeroU64::MIN))
    });
}

/// A decision for a never-seen key at a full store (10,000 keys, 5% of them exhausted):
/// the flood path, where every check evicts one key first.
#[divan::bench]
fn store_decision_at_cap_new_key(bencher: Bencher) {
    let rules = RuleSet::builtin();
    let rule = rules.default_rule().clone();
    let cap = 10_000u64;
    let mut store = Store::new(cap as usize, 1);
    let counter = |id: KeyId| ringlimit::shard::Counter {
        id,
        fingerprint: rule.fingerprint,
        limiter: &rule.limiter,
        local: false,
    };
    // Synthetic identities: deriving real ones is `key_identity`'s cost, not the store's.
    let id = |i: u64| KeyId {
        placement: i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        disc: i,
    };
    let now = 1_767_225_600_000u64;
    for i in 0..cap {
        let cost = if i % 20 == 0 {
            rule.limiter.max_cost()
        } else {
            1
        };
        store.check(counter(id(i)), now, nz(cost));
    }
    let mut i = cap;
    bencher.bench_local(|| {
        i += 1;
        black_box(store.check(counter(id(i)), now, NonZeroU64::MIN))
    });
}

/// The expiry walk over live keys (100,000 of them, none due): what the shard's tick
/// pays per examined entry (it examines a sixteenth of its keys per tick). One
/// iteration examines 1,024 entries; divide by that.
#[divan::bench]
fn store_expire_walk_1024_of_100k_live_keys(bencher: Bencher) {
    let rules = RuleSet::builtin();
    let rule = rules.default_rule().clone();
    let mut store = Store::new(1_000_000, 1);
    let now = 1_767_225_600_000u64;
    for i in 0..100_000u64 {
        let id = KeyId {
            placement: i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            disc: i,
        };
        let counter = ringlimit::shard::Counter {
            id,
            fingerprint: rule.fingerprint,
            limiter: &rule.limiter,
            local: false,
        };
        store.check(counter, now, NonZeroU64::MIN);
    }
    bencher.bench_local(|| black_box(store.expire(black_box(now), 1_024)));
}

/// A counter's identity (ring placement + discriminator), computed once per planned
/// descriptor: the part of a decision that used to run inside the store.
#[divan::bench]
fn key_identity(bencher: Bencher) {
    let keys: Vec<String> = (0..10_000).map(|i| format!("client_{i}")).collect();
    let mut i = 0;
    bencher.bench_local(|| {
        i = (i + 1) % keys.len();
        black_box(KeyId::of("default", keys[i].as_bytes(), "GET /bench"))
    });
}

/// One shard actor (`lease_threshold` as configured) on a current-thread runtime; cancel
/// the token to stop it.
fn one_shard(
    lease_threshold: u64,
) -> (
    tokio::runtime::Runtime,
    tokio_util::sync::CancellationToken,
    Shards,
) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let tracker = tokio_util::task::TaskTracker::new();
    let cancel = tokio_util::sync::CancellationToken::new();
    let shards = runtime.block_on(async {
        Shards::spawn(
            &ShardConfig {
                shards: 1,
                lease_threshold,
                ..ShardConfig::default()
            },
            Arc::new(SystemClock),
            Arc::new(AtomicU64::new(0)),
            &tracker,
            cancel.clone(),
        )
    });
    (runtime, cancel, shards)
}

/// One shard round trip on a current-thread runtime: send, actor decides, reply.
#[divan::bench]
fn shard_round_trip(bencher: Bencher) {
    let (runtime, cancel, shards) = one_shard(ShardConfig::default().lease_threshold);
    let rules = RuleSet::builtin();
    let rule = rules.default_rule().clone();
    let item = Charge {
        id: KeyId::of(&rule.name, b"client_1", "GET /bench"),
        rule,
        cost: NonZeroU64::MIN,
        give_back: None,
        drain: false,
        peek: false,
        target: Default::default(),
    };
    bencher.bench_local(|| {
        runtime
            .block_on(shards.check(smallvec::smallvec![item.clone()]))
            .unwrap()
    });
    cancel.cancel();
}

/// Budget leases on an entry node (`docs/leases.md`, *What it costs*): what one check of
/// a remote counter that is never hot pays before it is forwarded, over 10,000 uniform
/// counters at a threshold of 100 checks/s. `shard`: every check makes the round trip
/// to its shard's lease store (as before the gate); `gate`: the gate sends one check in
/// `threshold / 16` there, weighted, and forwards the rest at once.
#[divan::bench(args = ["shard", "gate"])]
fn lease_check_of_a_cold_remote_counter(bencher: Bencher, path: &str) {
    use ringlimit::shard::budget::entry::SpendAsk;
    use ringlimit::shard::budget::gate::Gated;
    let (runtime, cancel, shards) = one_shard(100);
    let counters: Vec<KeyId> = (0..10_000)
        .map(|i| KeyId::of("default", format!("client_{i}").as_bytes(), "GET /bench"))
        .collect();
    let gated = path == "gate";
    let mut i = 0;
    bencher.bench_local(|| {
        i = (i + 1) % counters.len();
        let weight = if gated {
            match shards.lease_gate().route(counters[i], false) {
                Gated::Shard(weight) => weight,
                Gated::Forward => return None,
            }
        } else {
            1
        };
        let spend = SpendAsk {
            counter: counters[i],
            fingerprint: 7,
            cost: 1,
            held_only: false,
            weight,
        };
        Some(runtime.block_on(shards.spend(spend)).unwrap())
    });
    cancel.cancel();
}
