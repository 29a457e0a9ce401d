//! Small hand-written histories for the checkers' unit tests: a builder of history
//! entries under the run's rules (fixed window 10 per 2 s, sliding log 8 per 2 s, token
//! bucket 10 per 2 s with burst 5, 2 s client deadline), a fixed-window model that fills
//! in correct answers, and helpers that find keys by their owner on a ring.

use std::collections::HashMap;

use ringlimit::ring::Ring;

use crate::history::{Entry, MemberView, RuleInfo};

use super::context::{Context, Parsed};
use super::Report;

pub const FW: &str = "GET /fw";
pub const LOG: &str = "GET /log";
pub const TB: &str = "GET /tb";
/// The fenced rule: fixed window, `FENCED_L` per W ms.
pub const FENCED: &str = "GET /fence";
pub const FENCED_L: u64 = 10;
/// The fixed window rule: L per W ms.
pub const L: u64 = 10;
pub const W: u64 = 2000;
/// The start of window 1000: tests run around here, far from window 0.
pub const T0: u64 = 1000 * W;
/// How long an answer takes unless a test says otherwise.
pub const LATENCY: u64 = 5;
/// A node that does not answer `Status` in a sampling round (paused or dead).
pub const DOWN: &str = "-";

/// An answer to record; `Hist::ok` fills in what it leaves open.
#[derive(Clone, Debug)]
pub struct Ans {
    allowed: bool,
    limit: u64,
    remaining: u64,
    decider: String,
    generation: u64,
    /// `None`: the window of the op's invoke time.
    window_id: Option<Option<u64>>,
    sequence: u64,
    degraded: bool,
    /// `None`: 0 if the decider is the node asked, else 1.
    hops: Option<u32>,
    leased: bool,
}

impl Ans {
    /// A decision of `decider`'s shard (generation 1, limit L).
    pub fn decided(decider: &str, sequence: u64, allowed: bool, remaining: u64) -> Ans {
        Ans {
            allowed,
            limit: L,
            remaining,
            decider: decider.into(),
            generation: 1,
            window_id: None,
            sequence,
            degraded: false,
            hops: None,
            leased: false,
        }
    }

    /// An admission the entry node decided from a lease `owner` granted (sequence 0,
    /// 0 hops, the owner named as decider).
    pub fn leased(owner: &str, remaining: u64) -> Ans {
        Ans {
            hops: Some(0),
            leased: true,
            ..Ans::decided(owner, 0, true, remaining)
        }
    }

    /// A fail-open fallback decision of entry node `node`'s own counter with `limit`.
    pub fn fallback(node: &str, sequence: u64, allowed: bool, remaining: u64, limit: u64) -> Ans {
        Ans {
            limit,
            degraded: true,
            hops: Some(0),
            ..Ans::decided(node, sequence, allowed, remaining)
        }
    }

    /// A fail-over decision of the key's successor `node` on its replica (degraded,
    /// the rule's own limit L).
    pub fn failover(node: &str, sequence: u64, allowed: bool, remaining: u64) -> Ans {
        Ans {
            degraded: true,
            ..Ans::decided(node, sequence, allowed, remaining)
        }
    }

    /// A deny-cache answer of entry node `node` (degraded, sequence 0).
    pub fn cached(node: &str) -> Ans {
        Ans {
            degraded: true,
            hops: Some(0),
            ..Ans::decided(node, 0, false, 0)
        }
    }

    pub fn generation(mut self, g: u64) -> Ans {
        self.generation = g;
        self
    }
    pub fn window(mut self, win: u64) -> Ans {
        self.window_id = Some(Some(win));
        self
    }
    pub fn no_window(mut self) -> Ans {
        self.window_id = Some(None);
        self
    }
    pub fn hops(mut self, hops: u32) -> Ans {
        self.hops = Some(hops);
        self
    }
    pub fn degraded(mut self) -> Ans {
        self.degraded = true;
        self
    }
}

/// A history under construction.
pub struct Hist {
    entries: Vec<Entry>,
    next_id: u64,
    round: u64,
    /// Ops invoked: id → (node asked, invoke time).
    invoked: HashMap<u64, (String, u64)>,
    /// Fixed window model: (decider, generation, key, window) → admitted cost.
    used: HashMap<(String, u64, String, u64), u64>,
    /// Last sequence number per (decider, generation).
    seqs: HashMap<(String, u64), u64>,
    /// Current generation per node for `fw` (1 unless `restart` said otherwise).
    generations: HashMap<String, u64>,
}

impl Default for Hist {
    fn default() -> Self {
        Hist::new()
    }
}

impl Hist {
    /// A history with only its meta line.
    pub fn new() -> Hist {
        let rule = |route: &str, algorithm: &str, limit, burst| RuleInfo {
            route: route.into(),
            algorithm: algorithm.into(),
            limit,
            window_ms: W,
            burst,
            fenced: route == FENCED,
        };
        let meta = Entry::Meta {
            t: T0 - 10_000,
            seed: 1,
            profile: "unit".into(),
            broken: false,
            deadline_ms: 2000,
            schedule: Vec::new(),
            rules: vec![
                rule(FW, "fixed_window", L, L),
                rule(LOG, "sliding_window_log", 8, 8),
                rule(TB, "token_bucket", 10, 5),
                rule(FENCED, "fixed_window", FENCED_L, FENCED_L),
            ],
        };
        Hist {
            entries: vec![meta],
            next_id: 1,
            round: 0,
            invoked: HashMap::new(),
            used: HashMap::new(),
            seqs: HashMap::new(),
            generations: HashMap::new(),
        }
    }

    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// One sampling round at `t`: each (node, members) answers with the ring over
    /// `members` (space-separated ids), or does not answer if members is `DOWN`.
    pub fn round(&mut self, t: u64, views: &[(&str, &str)]) -> &mut Hist {
        self.round += 1;
        for (node, members) in views {
            let (ok, members) = if *members == DOWN {
                (false, Vec::new())
            } else {
                (true, ids(members))
            };
            let digest = if ok {
                ring(&members.join(" ")).digest()
            } else {
                0
            };
            self.entries.push(Entry::Ring {
                t,
                round: self.round,
                node: node.to_string(),
                generation: self.generation(node),
                ok,
                members: members
                    .into_iter()
                    .map(|id| MemberView {
                        id,
                        generation: 1,
                        leaving: false,
                    })
                    .collect(),
                digest,
                error: String::new(),
            });
        }
        self
    }

    /// Sampling rounds every 200 ms from `from` while before `to`.
    pub fn rounds(&mut self, from: u64, to: u64, views: &[(&str, &str)]) -> &mut Hist {
        let mut t = from;
        while t < to {
            self.round(t, views);
            t += 200;
        }
        self
    }

    /// Record a raw entry (for what the helpers do not cover).
    pub fn push(&mut self, entry: Entry) -> &mut Hist {
        self.entries.push(entry);
        self
    }

    /// A client asks `node` at `t`; returns the op id.
    pub fn invoke(&mut self, t: u64, node: &str, route: &str, key: &str, cost: u64) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.invoked.insert(id, (node.to_string(), t));
        self.entries.push(Entry::Invoke {
            id,
            client: 0,
            t,
            key: key.into(),
            route: route.into(),
            cost,
            node: node.into(),
            addr: String::new(),
        });
        id
    }

    /// Op `id` answered at `t`.
    pub fn ok(&mut self, id: u64, t: u64, a: Ans) -> &mut Hist {
        let (node, invoke) = self.invoked[&id].clone();
        let hops = a.hops.unwrap_or(u32::from(a.decider != node));
        self.entries.push(Entry::Ok {
            id,
            t,
            allowed: a.allowed,
            limit: a.limit,
            remaining: a.remaining,
            decider: a.decider,
            generation: a.generation,
            window_id: a.window_id.unwrap_or(Some(invoke / W)),
            sequence: a.sequence,
            degraded: a.degraded,
            hops,
            rule: String::new(),
            retry_after_ms: 0,
            leased: a.leased,
        });
        self
    }

    /// Invoke and answer in one step, `LATENCY` ms later; returns the op id.
    pub fn check(&mut self, t: u64, node: &str, route: &str, key: &str, cost: u64, a: Ans) -> u64 {
        let id = self.invoke(t, node, route, key, cost);
        self.ok(id, t + LATENCY, a);
        id
    }

    pub fn fail(&mut self, id: u64, t: u64) -> &mut Hist {
        self.entries.push(Entry::Fail {
            id,
            t,
            error: "unavailable".into(),
        });
        self
    }

    /// Outcome unknown (client deadline, connection reset).
    pub fn info(&mut self, id: u64, t: u64) -> &mut Hist {
        self.entries.push(Entry::Info {
            id,
            t,
            error: "deadline".into(),
        });
        self
    }

    /// The next sequence number of `decider`'s generation `g`.
    pub fn seq(&mut self, decider: &str, g: u64) -> u64 {
        let s = self.seqs.entry((decider.to_string(), g)).or_insert(0);
        *s += 1;
        *s
    }

    /// The generation `fw` decides with for `node`.
    pub fn generation(&self, node: &str) -> u64 {
        self.generations.get(node).copied().unwrap_or(1)
    }

    /// `node` restarted as generation `g`: its counters start from empty.
    pub fn restart(&mut self, node: &str, g: u64) -> &mut Hist {
        self.generations.insert(node.to_string(), g);
        self
    }

    /// A fixed-window check through `node` at `t`, decided by `decider`'s current
    /// generation as the exact model says (its own count per key and window); returns
    /// the op id.
    pub fn fw(&mut self, t: u64, node: &str, key: &str, cost: u64, decider: &str) -> u64 {
        let g = self.generation(decider);
        let used = self
            .used
            .entry((decider.to_string(), g, key.to_string(), t / W))
            .or_insert(0);
        let allowed = *used + cost <= L;
        if allowed {
            *used += cost;
        }
        let remaining = L - *used;
        let seq = self.seq(decider, g);
        self.check(
            t,
            node,
            FW,
            key,
            cost,
            Ans::decided(decider, seq, allowed, remaining).generation(g),
        )
    }

    /// `n` fixed-window checks of cost 1 through `node`, 10 ms apart from `t`.
    pub fn fw_many(&mut self, n: u64, t: u64, node: &str, key: &str, decider: &str) -> Vec<u64> {
        (0..n)
            .map(|i| self.fw(t + 10 * i, node, key, 1, decider))
            .collect()
    }

    /// A phase (start and end lines).
    pub fn phase(&mut self, name: &str, start: u64, end: u64, faults: bool) -> &mut Hist {
        for (t, edge) in [(start, "start"), (end, "end")] {
            self.entries.push(Entry::Phase {
                t,
                name: name.into(),
                edge: edge.into(),
                faults,
            });
        }
        self
    }

    /// Nemesis step `n`: injected at `start`, healed at `end`, rings agreed at `settled`.
    pub fn nemesis(
        &mut self,
        n: u32,
        kind: &str,
        victim: &str,
        start: u64,
        end: u64,
        settled: u64,
    ) -> &mut Hist {
        for (t, edge) in [(start, "start"), (end, "end"), (settled, "settled")] {
            self.entries.push(Entry::Nemesis {
                t,
                n,
                kind: kind.into(),
                victim: victim.into(),
                edge: edge.into(),
                detail: String::new(),
            });
        }
        self
    }

    /// Nemesis step `n` whose start line carries `detail`.
    #[allow(clippy::too_many_arguments)]
    pub fn nemesis_with(
        &mut self,
        n: u32,
        kind: &str,
        victim: &str,
        start: u64,
        end: u64,
        settled: u64,
        detail: &str,
    ) -> &mut Hist {
        self.nemesis(n, kind, victim, start, end, settled);
        for entry in &mut self.entries {
            if let Entry::Nemesis {
                n: m,
                edge,
                detail: d,
                ..
            } = entry
            {
                if *m == n && edge == "start" {
                    *d = detail.to_string();
                }
            }
        }
        self
    }

    /// A check of the fenced rule through `node` at `t`, answered by `decider`
    /// (`allowed` or not), in the window of `t`.
    pub fn fenced_op(
        &mut self,
        t: u64,
        node: &str,
        key: &str,
        decider: &str,
        allowed: bool,
    ) -> u64 {
        let g = self.generation(decider);
        let sequence = self.seq(decider, g);
        let id = self.invoke(t, node, FENCED, key, 1);
        self.entries.push(Entry::Ok {
            id,
            t: t + LATENCY,
            allowed,
            limit: FENCED_L,
            remaining: 0,
            decider: decider.into(),
            generation: g,
            window_id: Some(t / W),
            sequence,
            degraded: false,
            hops: u32::from(decider != node),
            rule: String::new(),
            retry_after_ms: 0,
            leased: false,
        });
        id
    }

    /// Nemesis step `n` that could not run (e.g. no iptables).
    pub fn skipped(&mut self, n: u32, kind: &str, victim: &str, t: u64) -> &mut Hist {
        for edge in ["start", "skipped"] {
            self.entries.push(Entry::Nemesis {
                t,
                n,
                kind: kind.into(),
                victim: victim.into(),
                edge: edge.into(),
                detail: String::new(),
            });
        }
        self
    }

    /// Incarnation `g` of `node` exited (`how`: "kill -9", "sigterm").
    pub fn exit(&mut self, t: u64, node: &str, g: u64, how: &str) -> &mut Hist {
        self.entries.push(Entry::Exit {
            t,
            node: node.into(),
            generation: g,
            how: how.into(),
        });
        self
    }

    /// A metric scrape of incarnation `g` of `node`.
    pub fn metrics(&mut self, t: u64, node: &str, g: u64, resets: u64, restarts: u64) -> &mut Hist {
        self.entries.push(Entry::Metrics {
            t,
            node: node.into(),
            generation: g,
            resets,
            restarts,
            fail_open: 0,
        });
        self
    }
}

/// Run one property over a history: its report (violations and warnings).
pub fn run<T>(h: &Hist, property: impl FnOnce(&Context, &mut Report) -> T) -> Report {
    run_with(h, property).1
}

/// Run one property over a history: what it returns, and its report.
pub fn run_with<T>(h: &Hist, property: impl FnOnce(&Context, &mut Report) -> T) -> (T, Report) {
    let parsed = Parsed::parse(h.entries());
    let ctx = Context::new(&parsed);
    let mut report = Report::default();
    let out = property(&ctx, &mut report);
    (out, report)
}

/// The violation messages of `property`.
pub fn messages<'r>(report: &'r Report, property: &str) -> &'r [String] {
    report.violations.get(property).map_or(&[], Vec::as_slice)
}

fn ids(members: &str) -> Vec<String> {
    members.split_whitespace().map(str::to_string).collect()
}

/// The ring over space-separated `members`.
pub fn ring(members: &str) -> Ring {
    Ring::new(ids(members), Ring::DEFAULT_VNODES)
}

/// The owner of `key` on the ring over `members`.
pub fn owner_on(members: &str, key: &str) -> String {
    ring(members)
        .owner(key.as_bytes())
        .expect("a ring with members")
        .to_string()
}

/// The first key `k0`, `k1`, ... that `owner` owns on the ring over `members` and for
/// which `also` holds.
pub fn key_owned_by(members: &str, owner: &str, also: impl Fn(&str) -> bool) -> String {
    let ring = ring(members);
    (0..100_000)
        .map(|i| format!("k{i}"))
        .find(|k| ring.owner(k.as_bytes()) == Some(owner) && also(k))
        .expect("such a key among the first 100000")
}
