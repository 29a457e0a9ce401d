//! Past this machine: a 50-node cluster in the simulator, measuring how long the
//! rings take to agree after a join and after a kill, the share of keys that move,
//! and the bytes each node sends per second (gossip, and the peer protocol under a
//! light load). `docs/ownership.md` records the figures.
//!
//! Modelled, not measured on real processes: gossip (heartbeats every 200 ms to 3
//! peers, a 1-2.5 s timeout failure detector, digests of ~36 bytes + id per member;
//! chitchat's real encoding and phi-accrual detector are not run here), network delays
//! (1-3 ms), and the peer link's shell (`link.rs`). Real: the views and rings
//! (`build_view_after`, `Ring`), the handoff export and install, the peer link's
//! batcher and session, and the peer messages' encoded sizes.

use std::collections::BTreeSet;
use std::sync::Arc;

use ringlimit::config::rules::RuleSet;
use ringlimit::ring::Ring;

use crate::scenario::{node_config, RULES};
use crate::workload::Workload;
use crate::world::World;

/// What one 50-node run measured.
#[derive(Debug)]
pub struct Figures {
    pub nodes: usize,
    pub boot_ms: u64,
    pub join_ms: u64,
    pub kill_ms: u64,
    /// Share of the hash space that changed owner.
    pub join_moved: f64,
    pub kill_moved: f64,
    /// Share of 10,000 sample keys whose owner changed.
    pub join_keys_moved: f64,
    pub kill_keys_moved: f64,
    /// Counter states the old owners handed to the joiner.
    pub handed_over: u64,
    pub checks_per_s: f64,
    pub gossip_bytes_per_node_s: f64,
    pub peer_bytes_per_node_s: f64,
}

fn ring_of(w: &World, id: &str) -> Arc<Ring> {
    w.node(id).expect("running").view.ring.clone()
}

fn keys_moved(before: &Ring, after: &Ring) -> f64 {
    let moved = (0..10_000)
        .filter(|i| {
            let key = format!("key-{i}");
            before.owner(key.as_bytes()) != after.owner(key.as_bytes())
        })
        .count();
    moved as f64 / 10_000.0
}

pub fn measure(seed: u64, nodes: usize) -> Figures {
    let rules = Arc::new(RuleSet::from_toml_str(RULES).expect("the rules parse"));
    let ids: Vec<String> = (1..=nodes).map(|i| format!("n{i:02}")).collect();
    let mut w = World::new(seed, rules, node_config(false, ids[..3].to_vec()));
    w.record = false;
    for id in &ids {
        w.start(id);
        let gap = w.rng.range(0, 40);
        w.run_for(gap);
    }
    let boot_ms = w
        .run_while_not(60_000, World::converged)
        .expect("50 nodes converge");
    for id in &ids {
        w.serve(id);
    }
    // Many keys, so that a joiner's share of live counters is more than a handful.
    let workload = Workload {
        zipf_keys: 20_000,
        ..Workload::standard()
    };
    w.start_clients(25, workload);
    w.run_for(2000);
    let before = w.bytes.clone();
    let ops_before = w.ops_completed();
    let span = 5_000;
    w.run_for(span);
    let seconds = span as f64 / 1000.0;
    let (mut gossip, mut peer) = (0u64, 0u64);
    for (id, b) in &w.bytes {
        let old = before.get(id).copied().unwrap_or_default();
        gossip += b.gossip - old.gossip;
        peer += b.peer - old.peer;
    }
    let checks_per_s = (w.ops_completed() - ops_before) as f64 / seconds;

    let old = ring_of(&w, &ids[0]);
    let handed_before: u64 = w
        .slots
        .values()
        .filter_map(|s| s.node.as_ref())
        .map(|n| n.stats.handed_over)
        .sum();
    let joiner = format!("n{:02}", nodes + 1);
    w.start(&joiner);
    let join_ms = w
        .run_while_not(60_000, World::converged)
        .expect("the join converges");
    w.serve(&joiner);
    let new = ring_of(&w, &ids[0]);
    let join_moved = ringlimit::ring::diff(&old, &new).moved_fraction();
    let join_keys_moved = keys_moved(&old, &new);
    w.run_for(2000);
    let handed_over = w
        .slots
        .values()
        .filter_map(|s| s.node.as_ref())
        .map(|n| n.stats.handed_over)
        .sum::<u64>()
        - handed_before;

    let old = ring_of(&w, &ids[0]);
    let victim = ids[nodes / 2].clone();
    w.kill(&victim);
    let kill_ms = w
        .run_while_not(60_000, World::converged)
        .expect("the kill converges");
    let new = ring_of(&w, &ids[0]);
    let kill_moved = ringlimit::ring::diff(&old, &new).moved_fraction();
    let kill_keys_moved = keys_moved(&old, &new);
    let members: BTreeSet<&str> = new.members().iter().map(String::as_str).collect();
    assert!(!members.contains(victim.as_str()) && members.contains(joiner.as_str()));
    Figures {
        nodes,
        boot_ms,
        join_ms,
        kill_ms,
        join_moved,
        kill_moved,
        join_keys_moved,
        kill_keys_moved,
        handed_over,
        checks_per_s,
        gossip_bytes_per_node_s: gossip as f64 / nodes as f64 / seconds,
        peer_bytes_per_node_s: peer as f64 / nodes as f64 / seconds,
    }
}
