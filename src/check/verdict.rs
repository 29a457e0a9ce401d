//! One verdict from a check's descriptor answers. Pure.
//!
//! The overall numbers are the most restrictive descriptor's: when denied, the denying
//! descriptor with the longest wait (so a caller that honours `retry_after_ms` is not
//! denied again by another descriptor); when allowed, the one with the least remaining.
//! A denied check reports remaining 0 overall (the descriptors carry their own
//! numbers), and a shaper's delay is the largest any descriptor asks for.

use std::sync::Arc;

use crate::algorithms::Millis;
use crate::cluster::{Decided, Decider, DescriptorOutcome};

/// The answer to one check.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// Every descriptor allowed.
    pub allowed: bool,
    /// The chosen descriptor's limit.
    pub limit: u64,
    /// The chosen descriptor's remaining units; 0 when denied.
    pub remaining: u64,
    /// How long to wait before the same check can be admitted (exact, never rounded
    /// down); 0 when allowed.
    pub retry_after_ms: u64,
    /// When the chosen descriptor's full limit is back (Unix ms).
    pub reset_at_ms: Millis,
    /// The chosen descriptor's rule.
    pub rule: Arc<str>,
    /// The chosen descriptor's decider.
    pub decider: Decider,
    /// The chosen descriptor's window, for the window algorithms.
    pub window_id: Option<u64>,
    /// The chosen descriptor's sequence number.
    pub sequence: u64,
    /// Any descriptor was answered without its owner.
    pub degraded: bool,
    /// The longest shaper delay of any descriptor when allowed; 0 when denied.
    pub delay_ms: u64,
    /// The window (buckets: the refill period) of the rule whose numbers these are.
    pub window_ms: u64,
    /// A rule in shadow mode would have denied a descriptor (the check is not denied for
    /// it): see [`Rule::shadow`](crate::config::rules::Rule::shadow).
    pub shadow_denied: bool,
    /// Every descriptor, in request order.
    pub descriptors: crate::cluster::DescriptorOutcomes,
}

/// What a caller needs for the 429 contract (headers): the client crate's type, so a
/// verdict and a wire answer render the same way.
pub use ringlimit_client::Quota;

impl Verdict {
    /// Combine one check's descriptor answers.
    pub fn combine(decided: Decided) -> Verdict {
        let descriptors = decided.descriptors;
        let allowed = descriptors.iter().all(|d| d.enforced_allowed());
        let top_item = &descriptors[chosen(&descriptors)];
        let top = &top_item.answer;
        let window_ms = top_item.item.rule.spec.window().as_millis() as u64;
        Verdict {
            allowed,
            limit: top.decision.limit,
            remaining: if allowed { top.decision.remaining } else { 0 },
            // A shadow denial (allowed, least remaining) must not ask the caller to wait.
            retry_after_ms: if allowed {
                0
            } else {
                top.decision.retry_after_ms
            },
            reset_at_ms: top.decision.reset_at_ms,
            rule: top.rule.clone(),
            decider: top.decider.clone(),
            window_id: top.decision.window_id,
            sequence: top.sequence,
            degraded: descriptors.iter().any(|d| d.answer.degraded),
            window_ms,
            shadow_denied: descriptors.iter().any(|d| d.shadow_denied()),
            delay_ms: if allowed {
                descriptors
                    .iter()
                    .map(|d| d.answer.decision.delay_ms)
                    .max()
                    .unwrap_or(0)
            } else {
                0
            },
            descriptors,
        }
    }

    /// Any descriptor was decided from a budget lease (no hop to its owner).
    pub fn leased(&self) -> bool {
        self.descriptors.iter().any(|d| d.leased())
    }

    /// The numbers the 429 contract is rendered from.
    pub fn quota(&self) -> Quota {
        Quota {
            allowed: self.allowed,
            limit: self.limit,
            remaining: self.remaining,
            retry_after_ms: self.retry_after_ms,
            reset_at_ms: self.reset_at_ms,
        }
    }
}

/// The most restrictive answer: the longest wait among denials, else the least
/// remaining (the first such, for ties). A shadow denial is not a denial here.
fn chosen(descriptors: &[DescriptorOutcome]) -> usize {
    let decision = |i: usize| &descriptors[i].answer.decision;
    if descriptors.iter().all(|d| d.enforced_allowed()) {
        (0..descriptors.len()).min_by_key(|&i| decision(i).remaining)
    } else {
        (0..descriptors.len())
            .filter(|&i| !descriptors[i].enforced_allowed())
            .max_by_key(|&i| decision(i).retry_after_ms)
    }
    .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::{AlgorithmKind, Decision};
    use crate::cluster::CheckItem;
    use crate::cluster::{Answer, Charged};
    use crate::config::rules::RuleSet;
    use std::num::NonZeroU64;

    fn answer(allowed: bool, remaining: u64, retry: u64, delay: u64, node: &str) -> Answer {
        Answer {
            decision: Decision {
                allowed,
                limit: 100,
                remaining,
                retry_after_ms: retry,
                reset_at_ms: 60_000,
                window_id: Some(1),
                delay_ms: delay,
            },
            sequence: 7,
            at: 1_000,
            decider: Decider {
                node_id: Arc::from(node),
                generation: 1,
            },
            degraded: node == "cache",
            hops: 0,
            rule: Arc::from("default"),
            algorithm: AlgorithmKind::SlidingWindowCounter,
            charged: Charged::Nothing,
        }
    }

    fn decided(answers: Vec<Answer>) -> Decided {
        let rule = RuleSet::builtin().default_rule().clone();
        let descriptors = answers
            .into_iter()
            .enumerate()
            .map(|(i, answer)| DescriptorOutcome {
                item: CheckItem::new(
                    rule.clone(),
                    &format!("k{i}"),
                    crate::config::route::Route::parse("/x").unwrap(),
                    None,
                    NonZeroU64::MIN,
                ),
                answer,
                refunded: false,
            })
            .collect();
        Decided { descriptors }
    }

    #[test]
    fn an_allowed_check_reports_the_descriptor_with_least_remaining_and_largest_delay() {
        let v = Verdict::combine(decided(vec![
            answer(true, 50, 0, 0, "a"),
            answer(true, 3, 0, 600, "b"),
            answer(true, 9, 0, 1200, "c"),
        ]));
        assert!(v.allowed);
        assert_eq!(v.remaining, 3);
        assert_eq!(&*v.decider.node_id, "b");
        assert_eq!(v.delay_ms, 1200, "the longest shaper delay");
    }

    #[test]
    fn a_denied_check_reports_the_longest_wait_remaining_zero_and_no_delay() {
        let v = Verdict::combine(decided(vec![
            answer(true, 50, 0, 600, "a"),
            answer(false, 0, 2_000, 0, "b"),
            answer(false, 4, 9_000, 0, "c"),
        ]));
        assert!(!v.allowed);
        assert_eq!(v.retry_after_ms, 9_000);
        assert_eq!(&*v.decider.node_id, "c");
        assert_eq!(v.remaining, 0, "remaining is 0 overall on a denial");
        assert_eq!(v.delay_ms, 0);
        assert_eq!(
            v.descriptors[2].answer.decision.remaining, 4,
            "descriptors keep theirs"
        );
    }

    #[test]
    fn any_degraded_descriptor_makes_the_verdict_degraded() {
        let v = Verdict::combine(decided(vec![
            answer(true, 50, 0, 0, "a"),
            answer(false, 0, 1, 0, "cache"),
        ]));
        assert!(v.degraded);
        let quota = v.quota();
        assert_eq!((quota.allowed, quota.retry_after_ms), (false, 1));
    }
}
