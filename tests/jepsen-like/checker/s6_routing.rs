//! S6, routing: a check is decided by the node asked or forwarded once, never more.

use super::context::Context;
use super::Report;

/// S6: hops ≤ 1; 0 hops ⇔ the node asked decided (an owner, or a successor deciding a
/// fail-over check: forwarded once to the successor instead of the owner, or decided
/// by the entry node when it is the successor); a degraded admission only from the
/// entry node's own fail-open fallback or a successor's fail-over. A leased answer was
/// decided by the node asked from units another node (the owner it names) lent: 0 hops,
/// and never naming the node asked (a node does not lease from itself).
pub fn routing(ctx: &Context, report: &mut Report) {
    for op in ctx.ops {
        let Some(a) = op.ok() else { continue };
        if a.hops > 1 {
            report.violate("S6", format!("op {} answered after {} hops", op.id, a.hops));
        }
        if a.leased {
            if a.hops != 0 || a.decider == op.node {
                report.violate(
                    "S6",
                    format!(
                        "op {}: leased answer after {} hops naming {} (asked {})",
                        op.id, a.hops, a.decider, op.node
                    ),
                );
            }
        } else if a.decides() {
            if a.hops == 0 && a.decider != op.node {
                report.violate(
                    "S6",
                    format!(
                        "op {}: 0 hops but decided by {} (asked {})",
                        op.id, a.decider, op.node
                    ),
                );
            }
            if a.hops == 1 && a.decider == op.node {
                report.violate(
                    "S6",
                    format!(
                        "op {}: 1 hop but decided by the node asked ({})",
                        op.id, op.node
                    ),
                );
            }
        } else if a.allowed && !(a.fallback() && a.decider == op.node) {
            report.violate(
                "S6",
                format!(
                    "op {}: a degraded admission that is not the entry node's fail-open fallback",
                    op.id
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    fn s6(h: &Hist) -> Vec<String> {
        messages(&run(h, routing), "S6").to_vec()
    }

    #[test]
    fn local_forwarded_fallback_and_cached_answers_pass() {
        let mut h = Hist::new();
        h.fw(T0, "n1", "k", 1, "n1");
        h.fw(T0 + 10, "n2", "k", 1, "n1");
        h.check(
            T0 + 20,
            "n2",
            FW,
            "k",
            1,
            Ans::fallback("n2", 1, true, 2, 3),
        );
        h.check(T0 + 30, "n3", FW, "k", 1, Ans::cached("n3"));
        assert_eq!(s6(&h), Vec::<String>::new());
    }

    #[test]
    fn two_hops_fail() {
        let mut h = Hist::new();
        h.check(T0, "n1", FW, "k", 1, Ans::decided("n2", 1, true, 9).hops(2));
        assert_eq!(s6(&h), vec!["op 1 answered after 2 hops".to_string()]);
    }

    #[test]
    fn zero_hops_decided_by_another_node_fails() {
        let mut h = Hist::new();
        h.check(T0, "n1", FW, "k", 1, Ans::decided("n2", 1, true, 9).hops(0));
        assert!(s6(&h)[0].contains("0 hops but decided by n2"));
    }

    #[test]
    fn one_hop_decided_by_the_node_asked_fails() {
        let mut h = Hist::new();
        h.check(T0, "n1", FW, "k", 1, Ans::decided("n1", 1, true, 9).hops(1));
        assert!(s6(&h)[0].contains("1 hop but decided by the node asked"));
    }

    #[test]
    fn a_degraded_admission_not_from_the_entry_nodes_fallback_fails() {
        let mut h = Hist::new();
        // Another node's fallback, and an admission with no fallback sequence.
        h.check(T0, "n1", FW, "k", 1, Ans::fallback("n2", 1, true, 2, 3));
        h.check(
            T0,
            "n1",
            FW,
            "k",
            1,
            Ans::decided("n1", 0, true, 9).degraded(),
        );
        assert_eq!(s6(&h).len(), 2);
    }

    #[test]
    fn fail_over_answers_forwarded_once_or_decided_by_the_entry_node_pass() {
        // The successor n2 decides on its replica: asked directly (0 hops) or through
        // n1 (1 hop).
        let mut h = Hist::new();
        h.check(T0, "n1", FW, "k", 1, Ans::failover("n2", 1, true, 3));
        h.check(T0 + 10, "n2", FW, "k", 1, Ans::failover("n2", 2, true, 2));
        assert_eq!(s6(&h), Vec::<String>::new());
        // Counted as hops like an owner's answer.
        let mut h = Hist::new();
        h.check(
            T0,
            "n1",
            FW,
            "k",
            1,
            Ans::failover("n2", 1, true, 3).hops(0),
        );
        assert!(s6(&h)[0].contains("0 hops but decided by n2"));
    }
}
