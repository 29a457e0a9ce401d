//! The rules both chaos suites run under (the process suite in `tests/jepsen-like` and
//! the simulator in `tests/sim`, which includes this file by path), and the numbers the
//! checkers read from each: one definition, so the two suites test the same limits.

use crate::history::RuleInfo;

/// The rule file every node starts with: one rule per algorithm the checkers replay.
pub const RULES: &str = r#"
[[rule]]
name = "fw"
route = "GET /fw"
algorithm = "fixed_window"
limit = 10
window = "2s"

[[rule]]
name = "log"
route = "GET /log"
algorithm = "sliding_window_log"
limit = 8
window = "2s"

[[rule]]
name = "tb"
route = "GET /tb"
algorithm = "token_bucket"
limit = 10
window = "2s"
burst = 5

# Fail-closed, so fenced in partitions by default: FENCE holds it to L. Its share of
# the ops is small (10 %), so a low limit: hot keys reach it in most windows.
[[rule]]
name = "fence"
route = "GET /fence"
algorithm = "fixed_window"
limit = 3
window = "2s"
on_unavailable = "closed"
"#;

/// What the history records of each rule in [`RULES`], for the checkers.
pub fn rule_infos() -> Vec<RuleInfo> {
    let info = |route: &str, algorithm: &str, limit, burst| RuleInfo {
        route: route.into(),
        algorithm: algorithm.into(),
        limit,
        window_ms: 2000,
        burst,
        fenced: route == "GET /fence",
    };
    vec![
        info("GET /fw", "fixed_window", 10, 10),
        info("GET /log", "sliding_window_log", 8, 8),
        info("GET /tb", "token_bucket", 10, 5),
        info("GET /fence", "fixed_window", 3, 3),
    ]
}
