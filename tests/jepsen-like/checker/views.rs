//! Ring views rebuilt from the samples: which node may have believed which ring when.
//! S3-owner asks whether a decider owned a key in some view around an op; availability
//! asks for the ring every node agreed on around a nemesis step.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ringlimit::ring::Ring;

use crate::history::MemberView;

use super::context::Sample;

/// How far (ms) around an op a ring view still counts for the ownership clause of S3:
/// the failure detection window (~1.3 s) plus gossip and sampling slack.
pub const VIEW_SLACK_MS: u64 = 3000;
/// Longest gap between two ring samples of one node (the sampler runs every ~200 ms).
const SAMPLE_GAP_MS: u64 = 400;
/// Most members that may change between two sampled views for the views in between to
/// be enumerated (2^n − 2 member sets).
const MAX_CHANGED_MEMBERS: usize = 6;

/// A run of identical ring samples of one node, valid over [lo, hi]: from the sample
/// before its first one until the next answered sample with another digest (a node
/// that stops answering, paused or dead, keeps believing what it last said).
pub struct ViewRun {
    pub node: String,
    pub lo: u64,
    pub hi: u64,
    pub digest: u64,
    pub members: BTreeSet<String>,
}

/// A member set a node may have passed through between two of its sampled views,
/// valid over [from, to].
pub struct Transition {
    pub from: u64,
    pub to: u64,
    pub ring: Ring,
}

pub struct Views {
    /// Per node, in time order.
    pub runs: Vec<ViewRun>,
    /// Digest → the ring rebuilt from the members sampled with it.
    pub rings: HashMap<u64, Ring>,
    pub transitions: Vec<Transition>,
    /// Rebuilt rings whose digest differs from the sampled one (a harness problem).
    pub warnings: Vec<String>,
}

/// The ring members of a sampled view: members not leaving.
pub fn ring_of(members: &[MemberView]) -> BTreeSet<String> {
    members
        .iter()
        .filter(|m| !m.leaving)
        .map(|m| m.id.clone())
        .collect()
}

impl Views {
    /// `samples` sorted by time.
    pub fn build(samples: &[Sample]) -> Views {
        let runs = view_runs(samples);
        let mut rings: HashMap<u64, Ring> = HashMap::new();
        let mut warnings = Vec::new();
        for run in &runs {
            let r = rings
                .entry(run.digest)
                .or_insert_with(|| Ring::new(run.members.iter().cloned(), Ring::DEFAULT_VNODES));
            if r.digest() != run.digest {
                warnings.push(format!(
                    "WARNING (harness): ring rebuilt from {}'s sampled members {:?} has digest {:016x}, node reported {:016x}",
                    run.node,
                    run.members,
                    r.digest(),
                    run.digest
                ));
            }
        }
        let transitions = transitions(&runs);
        Views {
            runs,
            rings,
            transitions,
            warnings,
        }
    }

    /// Whether `decider` owned `key` in some node's view (sampled, or passed through
    /// between two samples) within ±`VIEW_SLACK_MS` of [lo, hi].
    pub fn owned_by(&self, key: &str, decider: &str, lo: u64, hi: u64) -> bool {
        self.in_some_view(lo, hi, |ring| ring.owner(key.as_bytes()) == Some(decider))
    }

    /// Whether `decider` was `key`'s successor (the member that inherits it from its
    /// owner: where an entry node sends a fail-over check) in some node's view within
    /// ±`VIEW_SLACK_MS` of [lo, hi].
    pub fn succeeded_by(&self, key: &str, decider: &str, lo: u64, hi: u64) -> bool {
        let h = Ring::key_hash(key.as_bytes());
        self.in_some_view(lo, hi, |ring| ring.successor_of_hash(h) == Some(decider))
    }

    /// Whether `pred` holds for the ring of some node's view (sampled, or passed through
    /// between two samples) within ±`VIEW_SLACK_MS` of [lo, hi].
    fn in_some_view(&self, lo: u64, hi: u64, pred: impl Fn(&Ring) -> bool) -> bool {
        let overlaps = |from: u64, to: u64| {
            from.saturating_sub(VIEW_SLACK_MS) <= hi && lo <= to.saturating_add(VIEW_SLACK_MS)
        };
        self.runs
            .iter()
            .any(|run| overlaps(run.lo, run.hi) && pred(&self.rings[&run.digest]))
            || self
                .transitions
                .iter()
                .any(|tr| overlaps(tr.from, tr.to) && pred(&tr.ring))
    }

    /// The ring of the sampling round closest to `t` (the last one before it when
    /// `before`, else the first one after it, within 10 s) in which every sampled node
    /// answered with the same digest.
    pub fn agreed_ring_at<'s>(
        &'s self,
        samples: &[Sample],
        t: u64,
        before: bool,
    ) -> Option<&'s Ring> {
        let mut rounds: BTreeMap<u64, Vec<&Sample>> = BTreeMap::new();
        for s in samples.iter().filter(|s| {
            if before {
                s.t < t && s.t + 10_000 > t
            } else {
                s.t > t && s.t < t + 10_000
            }
        }) {
            rounds.entry(s.round).or_default().push(s);
        }
        let agreed =
            |round: &Vec<&Sample>| round.iter().all(|s| s.ok && s.digest == round[0].digest);
        let found = if before {
            rounds.values().rev().find(|r| agreed(r))
        } else {
            rounds.values().find(|r| agreed(r))
        };
        found.and_then(|r| self.rings.get(&r[0].digest))
    }
}

fn view_runs(samples: &[Sample]) -> Vec<ViewRun> {
    let mut by_node: BTreeMap<&str, Vec<&Sample>> = BTreeMap::new();
    for s in samples {
        by_node.entry(s.node.as_str()).or_default().push(s);
    }
    let mut runs: Vec<ViewRun> = Vec::new();
    for (node, list) in by_node {
        let mut prev_t: Option<u64> = None;
        let mut current: Option<ViewRun> = None;
        for s in list {
            if s.ok {
                match &mut current {
                    Some(run) if run.digest == s.digest => run.hi = s.t,
                    _ => {
                        if let Some(mut run) = current.take() {
                            run.hi = s.t;
                            runs.push(run);
                        }
                        current = Some(ViewRun {
                            node: node.to_string(),
                            lo: prev_t.unwrap_or(s.t.saturating_sub(200)),
                            hi: s.t,
                            digest: s.digest,
                            members: ring_of(&s.members),
                        });
                    }
                }
            } else if let Some(run) = &mut current {
                // Not answering (paused, dead): it still believes what it last said.
                run.hi = s.t;
            }
            prev_t = Some(s.t);
        }
        if let Some(mut run) = current.take() {
            run.hi = u64::MAX / 2;
            runs.push(run);
        }
    }
    runs
}

/// Between two samples a node may pass through views nobody sampled: gossip reveals
/// members one at a time (a healed partition, a restart). Every member set between
/// the two sampled ones (common ⊆ S ⊆ union) is a view the node may have routed by.
fn transitions(runs: &[ViewRun]) -> Vec<Transition> {
    let mut transitions = Vec::new();
    for pair in runs.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if a.node != b.node {
            continue;
        }
        let common: BTreeSet<String> = a.members.intersection(&b.members).cloned().collect();
        let changed: Vec<String> = a
            .members
            .symmetric_difference(&b.members)
            .cloned()
            .collect();
        if changed.is_empty() || changed.len() > MAX_CHANGED_MEMBERS {
            continue;
        }
        // The proper, non-empty subsets of the changed members. The empty one (common)
        // and the full one (union) are left out: when one sampled view contains the
        // other, they are the two sampled views themselves.
        for mask in 1..(1u32 << changed.len()) - 1 {
            let mut members = common.clone();
            for (i, m) in changed.iter().enumerate() {
                if mask & (1 << i) != 0 {
                    members.insert(m.clone());
                }
            }
            transitions.push(Transition {
                from: a.hi.min(b.lo),
                to: b.lo.max(a.hi) + SAMPLE_GAP_MS,
                ring: Ring::new(members, Ring::DEFAULT_VNODES),
            });
        }
    }
    transitions
}

#[cfg(test)]
mod tests {
    use super::super::context::Parsed;
    use super::super::testkit::*;
    use super::*;
    use crate::history::Entry;

    fn views(h: &Hist) -> Views {
        Views::build(&Parsed::parse(h.entries()).samples)
    }

    #[test]
    fn a_node_that_stops_answering_keeps_its_last_view() {
        // A view counts from the sample before it until the next answered sample with
        // another digest; the last one forever.
        let mut h = Hist::new();
        h.rounds(T0, T0 + 1000, &[("n1", "n1 n2")]);
        h.rounds(T0 + 1000, T0 + 5000, &[("n1", DOWN)]);
        h.rounds(T0 + 5000, T0 + 5400, &[("n1", "n2")]);
        let v = views(&h);
        let spans: Vec<(u64, u64)> = v.runs.iter().map(|r| (r.lo, r.hi)).collect();
        assert_eq!(spans, [(T0 - 200, T0 + 5000), (T0 + 4800, u64::MAX / 2)]);
        assert!(v.warnings.is_empty());
    }

    #[test]
    fn every_member_set_between_two_sampled_views_is_a_transition() {
        // [n1] → [n1 n2 n3 n4]: {n1} plus each proper non-empty subset of 3 members.
        let mut h = Hist::new();
        h.round(T0, &[("n1", "n1")]);
        h.round(T0 + 200, &[("n1", "n1 n2 n3 n4")]);
        let v = views(&h);
        assert_eq!(v.transitions.len(), 6);
        let t = &v.transitions[0];
        assert_eq!((t.from, t.to), (T0, T0 + 200 + 400));
        // One member more: the sampled views are all there is.
        let mut h = Hist::new();
        h.round(T0, &[("n1", "n1 n2")]);
        h.round(T0 + 200, &[("n1", "n1 n2 n3")]);
        assert_eq!(views(&h).transitions.len(), 0);
    }

    #[test]
    fn more_than_six_changed_members_are_not_enumerated() {
        let mut h = Hist::new();
        h.round(T0, &[("n1", "n1 n2 n3 n4 n5 n6 n7")]);
        h.round(T0 + 200, &[("n1", "n1 n8")]);
        assert_eq!(views(&h).transitions.len(), 0);
        let mut h = Hist::new();
        h.round(T0, &[("n1", "n1 n2 n3 n4 n5 n6")]);
        h.round(T0 + 200, &[("n1", "n1 n7")]);
        assert_eq!(views(&h).transitions.len(), 62);
    }

    #[test]
    fn a_sampled_digest_that_is_not_the_members_ring_warns() {
        let mut h = Hist::new();
        h.push(Entry::Ring {
            t: T0,
            round: 1,
            node: "n1".into(),
            generation: 1,
            ok: true,
            members: Vec::new(),
            digest: 42,
            error: String::new(),
        });
        let v = views(&h);
        assert_eq!(v.warnings.len(), 1);
        assert!(v.warnings[0].starts_with("WARNING (harness): ring rebuilt from n1"));
    }

    #[test]
    fn leaving_members_are_not_on_the_ring() {
        let m = |id: &str, leaving| MemberView {
            id: id.into(),
            generation: 1,
            leaving,
        };
        let ring = ring_of(&[m("n1", false), m("n2", true)]);
        assert_eq!(ring.into_iter().collect::<Vec<_>>(), ["n1"]);
    }
}
