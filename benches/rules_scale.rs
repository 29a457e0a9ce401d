//! Matching a check to its rule with 10 and with 100,000 per-client rules (issue 26,
//! point 6): rules are grouped by client key in a hash map, so the cost must not grow
//! with the number of customers. Also the one-off cost of building such a rule set.
//!
//! Run: `cargo bench --bench rules_scale`. Each matching iteration looks up the next
//! client of a fixed list of 10,000 (hits on rules of the big set, spread over it), with a
//! route, as a check's planning does.

use std::fmt::Write;

use divan::{black_box, Bencher};
use ringlimit::config::route::Route;
use ringlimit::config::rules::RuleSet;

fn main() {
    divan::main();
}

/// One `[[rule]]` per customer id, plus a tier rule and a route rule beside them.
fn per_client_rules(customers: usize) -> String {
    let mut text = String::with_capacity(customers * 80 + 256);
    text.push_str("[default]\nlimit = 100\nwindow = \"1m\"\n");
    text.push_str("[[rule]]\nname = \"free\"\ntier = \"free\"\nlimit = 10\nwindow = \"1m\"\n");
    text.push_str(
        "[[rule]]\nname = \"uploads\"\nroute = \"POST /v1/uploads/*\"\nlimit = 5\nwindow = \"1m\"\n",
    );
    for i in 0..customers {
        write!(
            text,
            "[[rule]]\nname = \"cust_{i:06}\"\nclient = \"cust_{i:06}\"\nlimit = {}\nwindow = \"1m\"\n",
            1_000 + i % 1_000
        )
        .unwrap();
    }
    text
}

/// Which rule governs a check: client, tier and route as planning passes them.
#[divan::bench(args = [10, 100_000])]
fn match_client_rule(bencher: Bencher, customers: usize) {
    let rules = RuleSet::from_toml_str(&per_client_rules(customers)).unwrap();
    // 10,000 client keys spread over the customers (each has a rule).
    let clients: Vec<String> = (0..10_000)
        .map(|i| format!("cust_{:06}", (i * 7_919) % customers))
        .collect();
    let route = Route::parse("GET /v1/things/42").unwrap();
    let mut i = 0;
    bencher.bench_local(|| {
        i = (i + 1) % clients.len();
        black_box(rules.matching(black_box(&clients[i]), Some("free"), Some(&route)))
    });
}

/// A client without a rule of its own falls through to its tier: the miss path.
#[divan::bench(args = [10, 100_000])]
fn match_unlisted_client(bencher: Bencher, customers: usize) {
    let rules = RuleSet::from_toml_str(&per_client_rules(customers)).unwrap();
    let clients: Vec<String> = (0..10_000).map(|i| format!("other_{i}")).collect();
    let route = Route::parse("GET /v1/things/42").unwrap();
    let mut i = 0;
    bencher.bench_local(|| {
        i = (i + 1) % clients.len();
        black_box(rules.matching(black_box(&clients[i]), Some("free"), Some(&route)))
    });
}

/// Parsing, validating and indexing the whole document: what a node pays at start and
/// on every reload of its rule file.
#[divan::bench(args = [10, 100_000], sample_count = 5, sample_size = 1)]
fn build_rule_set(bencher: Bencher, customers: usize) {
    let text = per_client_rules(customers);
    bencher.bench_local(|| black_box(RuleSet::from_toml_str(black_box(&text)).unwrap()));
}
