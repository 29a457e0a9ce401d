//! The 429 contract as a domain type: the numbers of an answer, and the HTTP a caller
//! should see for them.
//!
//! The design reference's rules: `Retry-After` in whole seconds, rounded **up**
//! (rounding down guarantees the first retry is also rejected); the IETF fields, in the
//! latest published draft's syntax (`RateLimit-Policy: "api";q=100;w=60`,
//! `RateLimit: "api";r=0;t=6`: [`ietf_fields`]) whose `t` is seconds remaining; the
//! older `X-RateLimit-*` family whose `Reset` is a Unix timestamp. Both are sent, on
//! allowed answers too, so a client can pace itself before it is blocked. A denial's
//! body is `application/problem+json` (RFC 9457) naming the limit, the window and the
//! wait.

/// What a caller needs for the 429 contract, from any answer that carries the numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// The check was allowed.
    pub allowed: bool,
    /// The limit.
    pub limit: u64,
    /// Units left.
    pub remaining: u64,
    /// The exact wait on a denial, in ms.
    pub retry_after_ms: u64,
    /// When the full limit is back (Unix ms).
    pub reset_at_ms: u64,
}

/// `ceil(ms / 1000)`: a wait in whole seconds that is never shorter than the real one.
pub fn ceil_secs(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// The response headers for `quota` under the rule `policy` (the policy's name in the
/// IETF fields; empty: `default`) at `now_ms` (Unix ms). `Retry-After` only on a denial;
/// the policy's `w` when the window is known (`window_ms > 0`).
pub fn headers(
    quota: &Quota,
    policy: &str,
    window_ms: u64,
    now_ms: u64,
) -> Vec<(&'static str, String)> {
    let reset_at = quota.reset_at_ms;
    let mut out = Vec::with_capacity(6);
    if !quota.allowed {
        out.push(("Retry-After", ceil_secs(quota.retry_after_ms).to_string()));
    }
    let policy = if policy.is_empty() { "default" } else { policy };
    out.extend(ietf_fields(policy, quota, window_ms, now_ms));
    out.extend([
        ("X-RateLimit-Limit", quota.limit.to_string()),
        ("X-RateLimit-Remaining", quota.remaining.to_string()),
        ("X-RateLimit-Reset", reset_at.div_ceil(1000).to_string()),
    ]);
    out
}

/// The IETF RateLimit header fields as the latest published draft writes them
/// (draft-ietf-httpapi-ratelimit-headers-11: both fields are Structured Field Lists of
/// Items named by a String policy identifier): `RateLimit-Policy: "default";q=100;w=60`
/// (the quota and its window in seconds, rounded up so a client never paces faster than
/// allowed; no `w` when the window is unknown) and `RateLimit: "default";r=50;t=30`
/// (units available, and seconds until the quota is back, rounded up).
pub fn ietf_fields(
    policy: &str,
    quota: &Quota,
    window_ms: u64,
    now_ms: u64,
) -> [(&'static str, String); 2] {
    let name = sf_string(policy);
    let window = if window_ms > 0 {
        format!(";w={}", ceil_secs(window_ms).max(1))
    } else {
        String::new()
    };
    let reset_in = ceil_secs(quota.reset_at_ms.saturating_sub(now_ms));
    [
        (
            "RateLimit-Policy",
            format!("{name};q={}{window}", quota.limit),
        ),
        (
            "RateLimit",
            format!("{name};r={};t={reset_in}", quota.remaining),
        ),
    ]
}

/// `text` as a Structured Field String (RFC 8941 3.3.3): quoted, `"` and `\` escaped,
/// and every byte outside printable ASCII (which a String cannot hold) written as `_`.
pub fn sf_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('_'),
        }
    }
    out.push('"');
    out
}

/// The draft's problem type for a denial (its section "Quota Exceeded").
pub const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// The body of a 429 in the draft's `quota-exceeded` problem type: the RFC 9457
/// members, the draft's `violated-policies`, and the numbers of [`problem_body`]
/// (`limit`, `window`, `retry_after` in seconds rounded up).
pub fn quota_exceeded_body(policy: &str, quota: &Quota, window_ms: u64) -> String {
    let mut body = serde_json::Map::new();
    body.insert("type".into(), QUOTA_EXCEEDED.into());
    body.insert(
        "title".into(),
        "Request cannot be satisfied as assigned quota has been exceeded".into(),
    );
    body.insert("status".into(), 429.into());
    body.insert("violated-policies".into(), vec![policy.to_string()].into());
    body.insert("limit".into(), quota.limit.into());
    if window_ms > 0 {
        body.insert("window".into(), window_text(window_ms).into());
    }
    body.insert("retry_after".into(), ceil_secs(quota.retry_after_ms).into());
    serde_json::Value::Object(body).to_string()
}

/// A window as a short human string: `60s`, or `1500ms` when not whole seconds.
pub fn window_text(window_ms: u64) -> String {
    if window_ms.is_multiple_of(1000) {
        format!("{}s", window_ms / 1000)
    } else {
        format!("{window_ms}ms")
    }
}

/// The media type of [`problem_body`].
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The body of a 429 (RFC 9457 problem details), as in the design reference:
/// `{"type":…,"title":"Too Many Requests","limit":100,"window":"60s","retry_after":6}`.
/// `window` is left out when unknown (`window_ms == 0`).
pub fn problem_body(quota: &Quota, window_ms: u64, type_uri: &str) -> String {
    // Written in the design reference's field order (a JSON map would sort them).
    let window = if window_ms > 0 {
        format!(",\"window\":\"{}\"", window_text(window_ms))
    } else {
        String::new()
    };
    format!(
        "{{\"type\":{},\"title\":\"Too Many Requests\",\"limit\":{}{window},\"retry_after\":{}}}",
        serde_json::Value::from(type_uri),
        quota.limit,
        ceil_secs(quota.retry_after_ms)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The design reference's 429: limit 100 per 60 s, the worked sliding-counter
    /// rejection (5.67 s to wait), answered at 1738368054 with the window resetting
    /// at 1738368060.
    fn reference_denial() -> Quota {
        Quota {
            allowed: false,
            limit: 100,
            remaining: 0,
            retry_after_ms: 5_667,
            reset_at_ms: 1_738_368_060_000,
        }
    }

    fn get<'a>(headers: &'a [(&'static str, String)], name: &str) -> Option<&'a str> {
        headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

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
        let headers = headers(&reference_denial(), "api", 60_000, 1_738_368_054_000);
        assert_eq!(get(&headers, "Retry-After"), Some("6"));
        assert_eq!(
            get(&headers, "RateLimit"),
            Some("\"api\";r=0;t=6"),
            "t: seconds remaining"
        );
        assert_eq!(
            get(&headers, "RateLimit-Policy"),
            Some("\"api\";q=100;w=60")
        );
        for old in ["RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset"] {
            assert_eq!(get(&headers, old), None, "{old}: an older draft's field");
        }
        assert_eq!(get(&headers, "X-RateLimit-Limit"), Some("100"));
        assert_eq!(get(&headers, "X-RateLimit-Remaining"), Some("0"));
        assert_eq!(
            get(&headers, "X-RateLimit-Reset"),
            Some("1738368060"),
            "unix timestamp"
        );
    }

    #[test]
    fn the_problem_body_is_the_design_reference_example() {
        let body = problem_body(
            &reference_denial(),
            60_000,
            "https://api.example.com/errors/rate-limit",
        );
        assert!(body.starts_with(r#"{"type":"https://api.example.com/errors/rate-limit","title""#));
        let got: serde_json::Value = serde_json::from_str(&body).unwrap();
        let want: serde_json::Value = serde_json::from_str(
            r#"{"type":"https://api.example.com/errors/rate-limit",
                "title":"Too Many Requests","limit":100,"window":"60s","retry_after":6}"#,
        )
        .unwrap();
        assert_eq!(got, want);
        assert!(!problem_body(&reference_denial(), 0, "about:blank").contains("window"));
        assert_eq!(window_text(1_500), "1500ms");
    }

    #[test]
    fn ietf_fields_are_the_latest_drafts_lists_of_named_items() {
        let [policy, current] =
            ietf_fields("per_ip", &reference_denial(), 60_000, 1_738_368_054_000);
        assert_eq!(
            policy,
            ("RateLimit-Policy", "\"per_ip\";q=100;w=60".to_string())
        );
        assert_eq!(current, ("RateLimit", "\"per_ip\";r=0;t=6".to_string()));
        let [policy, _] = ietf_fields("x", &reference_denial(), 1_500, 0);
        assert_eq!(
            policy.1, "\"x\";q=100;w=2",
            "a window rounds up to whole seconds"
        );
        let [policy, _] = ietf_fields("x", &reference_denial(), 0, 0);
        assert_eq!(policy.1, "\"x\";q=100", "no window when it is unknown");
    }

    #[test]
    fn policy_names_become_valid_structured_field_strings() {
        assert_eq!(sf_string("plain"), "\"plain\"");
        assert_eq!(sf_string("a\"b\\c"), "\"a\\\"b\\\\c\"");
        assert_eq!(sf_string("tab\there é"), "\"tab_here _\"");
    }

    #[test]
    fn the_quota_exceeded_body_names_the_violated_policy_and_the_wait() {
        let body: serde_json::Value =
            serde_json::from_str(&quota_exceeded_body("per_ip", &reference_denial(), 60_000))
                .unwrap();
        assert_eq!(body["type"], QUOTA_EXCEEDED);
        assert_eq!(body["status"], 429);
        assert_eq!(body["violated-policies"][0], "per_ip");
        assert_eq!(body["retry_after"], 6);
        assert_eq!(body["window"], "60s");
    }

    #[test]
    fn allowed_answers_carry_both_families_without_retry_after() {
        let allowed = Quota {
            allowed: true,
            limit: 100,
            remaining: 41,
            retry_after_ms: 0,
            reset_at_ms: 1_738_368_060_000,
        };
        let headers = headers(&allowed, "", 0, 1_738_368_000_001);
        assert_eq!(get(&headers, "Retry-After"), None);
        assert_eq!(get(&headers, "RateLimit"), Some("\"default\";r=41;t=60"));
        assert_eq!(
            get(&headers, "RateLimit-Policy"),
            Some("\"default\";q=100"),
            "no window when it is unknown"
        );
        assert_eq!(get(&headers, "X-RateLimit-Reset"), Some("1738368060"));
    }
}
