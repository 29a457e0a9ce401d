//! Gateway-side helpers: turning an answer into the HTTP a caller should see.
//!
//! The design reference's 429 contract: `Retry-After` in whole seconds, rounded UP
//! (rounding down guarantees the first retry is also rejected); the IETF
//! `RateLimit-*` family whose `Reset` is seconds remaining; the older `X-RateLimit-*`
//! family whose `Reset` is a Unix timestamp. Both families are sent, on 200s too, so
//! a client can pace itself before it is blocked.

pub use crate::check::verdict::Quota;

/// `ceil(ms / 1000)`: a wait in whole seconds that is never shorter than the real one.
pub fn ceil_secs(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// The response headers a gateway should send for `answer` (a verdict's
/// [`crate::check::Verdict::quota`], or the same numbers from a wire answer), given the
/// current time `now_ms` (Unix ms). `Retry-After` is present only on a denial.
pub fn headers(answer: &Quota, now_ms: u64) -> Vec<(&'static str, String)> {
    let reset_at = answer.reset_at_ms;
    let reset_in = ceil_secs(reset_at.saturating_sub(now_ms));
    let mut out = Vec::with_capacity(7);
    if !answer.allowed {
        out.push(("Retry-After", ceil_secs(answer.retry_after_ms).to_string()));
    }
    out.extend([
        ("RateLimit-Limit", answer.limit.to_string()),
        ("RateLimit-Remaining", answer.remaining.to_string()),
        ("RateLimit-Reset", reset_in.to_string()),
        ("X-RateLimit-Limit", answer.limit.to_string()),
        ("X-RateLimit-Remaining", answer.remaining.to_string()),
        ("X-RateLimit-Reset", reset_at.div_ceil(1000).to_string()),
    ]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(ceil_secs(0), 0);
        assert_eq!(ceil_secs(1), 1);
        assert_eq!(
            ceil_secs(5_667),
            6,
            "the design reference's worked rejection"
        );
        assert_eq!(ceil_secs(6_000), 6);
        assert_eq!(ceil_secs(6_001), 7);
    }

    #[test]
    fn a_denial_renders_the_design_reference_example() {
        let answer = Quota {
            allowed: false,
            limit: 100,
            remaining: 0,
            retry_after_ms: 5_667,
            reset_at_ms: 1_738_368_060_000,
        };
        let headers = headers(&answer, 1_738_368_054_000);
        let get = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("Retry-After"), Some("6"));
        assert_eq!(get("RateLimit-Limit"), Some("100"));
        assert_eq!(get("RateLimit-Remaining"), Some("0"));
        assert_eq!(get("RateLimit-Reset"), Some("6"), "seconds remaining");
        assert_eq!(
            get("X-RateLimit-Reset"),
            Some("1738368060"),
            "unix timestamp"
        );
    }

    #[test]
    fn an_allowed_answer_carries_headers_but_no_retry_after() {
        let answer = Quota {
            allowed: true,
            limit: 100,
            remaining: 42,
            retry_after_ms: 0,
            reset_at_ms: 10_500,
        };
        let headers = headers(&answer, 10_000);
        assert!(headers.iter().all(|(n, _)| *n != "Retry-After"));
        assert!(headers.contains(&("RateLimit-Remaining", "42".into())));
        assert!(headers.contains(&("RateLimit-Reset", "1".into())));
    }
}
