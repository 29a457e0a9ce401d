//! The HTTP check face (`--check-http-listen`, off by default): checks over plain
//! HTTP/1.1 for scripts, services and the gateways that delegate decisions to an auth
//! service. It maps HTTP onto the [`Checker`] and the [`Verdict`] back, and nothing
//! else: validation, matching, refunds and the verdict are the check layer's.
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/check` | JSON in (`key`, `route`, `cost`, `tier`, `descriptors`: the `ringlimit.v1` `CheckRequest` fields), the verdict as JSON out (the `CheckResponse` fields), 200 whether allowed or not |
//! | any method `/v1/forward-auth` | a gateway's subrequest ([`super::forward_auth`]): 200 when allowed, else 429 (or `?deny_status=401`/`403`, for nginx) with `Retry-After` and an `application/problem+json` body of type `quota-exceeded` |
//!
//! Every answer to a decided check carries the IETF `RateLimit-Policy` and `RateLimit`
//! fields in the latest draft's syntax (`ringlimit_client::contract::ietf_fields`), the
//! policy named after the rule whose numbers they are. A denial's `Retry-After` is in
//! whole seconds, rounded up. A request that cannot be checked is answered with a
//! problem body (400 malformed, 401 no key header, 413 body too large, 408 body too
//! slow, 503 overloaded or the owner unreachable under a fail-closed rule) and charges
//! nothing. The listener's own bounds (connections, head size, timeouts) are set where
//! it is bound (`node::faces::serve_check_http`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use ringlimit_client::contract::{self, Quota};
use serde::Deserialize;

use super::forward_auth::{self, ForwardAuthConfig, KeySource};
use super::front::Front;
use super::ringlimit_v1::V1Names;
use crate::check::{CheckError, CheckInput, Checker, DescriptorInput, Descriptors, Verdict};

/// The TCP peer of a connection to the face: whom the forward-auth endpoint keys by
/// when no trusted proxy speaks for a client.
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub SocketAddr);

/// Largest request body `POST /v1/check` reads (64 KiB): a check with eight
/// full-size descriptors is under 4 KiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 << 10;

/// Time a request body has to arrive once its head has (a body sent a byte at a time
/// is answered 408 and the connection closed).
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(5);

/// What the face serves from.
#[derive(Debug, Clone)]
pub struct HttpCheckState {
    checker: Checker,
    forward_auth: Arc<ForwardAuthConfig>,
    max_body_bytes: usize,
    body_timeout: Duration,
    json: Front,
    auth: Front,
}

impl HttpCheckState {
    /// The face over `checker`, reading gateways' subrequests by `forward_auth`.
    pub fn new(checker: Checker, forward_auth: ForwardAuthConfig) -> Self {
        HttpCheckState {
            checker,
            forward_auth: Arc::new(forward_auth),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            json: Front::new("ringlimit_http_check_duration_seconds"),
            auth: Front::new("ringlimit_forward_auth_duration_seconds"),
        }
    }

    /// Bodies of at most `bytes`, arriving within `timeout`.
    pub fn with_body_bounds(mut self, bytes: usize, timeout: Duration) -> Self {
        self.max_body_bytes = bytes;
        self.body_timeout = timeout;
        self
    }
}

/// The face's routes (module doc).
pub fn routes(state: HttpCheckState) -> axum::Router {
    axum::Router::new()
        .route("/v1/check", post(check_json))
        .route("/v1/forward-auth", any(forward_auth_check))
        .fallback(|| async { problem(StatusCode::NOT_FOUND, "no such route on the check face") })
        .with_state(state)
}

/// One descriptor of a JSON check.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonDescriptor {
    key: String,
    #[serde(default)]
    route: String,
    #[serde(default)]
    cost: Option<i64>,
    #[serde(default)]
    tier: Option<String>,
}

/// A JSON check: `ringlimit.v1`'s `CheckRequest`. Unknown fields are refused, so a
/// misspelt `cost` is an error rather than a check of 1.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonCheck {
    key: String,
    route: String,
    #[serde(default)]
    cost: Option<i64>,
    #[serde(default)]
    tier: Option<String>,
    #[serde(default)]
    descriptors: Vec<JsonDescriptor>,
}

/// The check input of a JSON check: as `ringlimit.v1` maps its request, an extra
/// descriptor without a route, tier or cost inherits the request's.
fn json_input(request: &JsonCheck) -> CheckInput<'_> {
    let own = DescriptorInput {
        key: &request.key,
        route: &request.route,
        tier: request.tier.as_deref(),
        cost: request.cost,
    };
    let mut descriptors = Descriptors::with_capacity(1 + request.descriptors.len());
    descriptors.push(own);
    descriptors.extend(request.descriptors.iter().map(|d| DescriptorInput {
        key: &d.key,
        route: if d.route.is_empty() {
            own.route
        } else {
            &d.route
        },
        tier: d.tier.as_deref().or(own.tier),
        cost: d.cost.or(own.cost),
    }));
    CheckInput { descriptors }
}

async fn check_json(State(state): State<HttpCheckState>, request: Request<Body>) -> Response {
    let body = match read_body(&state, request).await {
        Ok(body) => body,
        Err(refusal) => return refusal,
    };
    let check: JsonCheck = match serde_json::from_slice(&body) {
        Ok(check) => check,
        Err(error) => {
            refused_count("invalid_argument", "body");
            return problem(StatusCode::BAD_REQUEST, &format!("body: {error}"));
        }
    };
    let timed = state.json.start();
    let input = json_input(&check);
    let decided = state.checker.check(&input, &V1Names).await;
    match decided {
        Ok(verdict) => {
            let body = verdict_json(&verdict).to_string();
            let mut response = timed.answered(body).into_inner().into_response();
            *response.headers_mut() = answer_headers(&verdict, "application/json");
            response
        }
        Err(error) => refusal(error),
    }
}

/// The body of a request, at most the face's bound and within its timeout.
async fn read_body(state: &HttpCheckState, request: Request<Body>) -> Result<Bytes, Response> {
    let too_large = || {
        refused_count("too_large", "body");
        problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("the body is larger than {} bytes", state.max_body_bytes),
        )
    };
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > state.max_body_bytes as u64) {
        // Refused before a byte of it is read.
        return Err(too_large());
    }
    let read = axum::body::to_bytes(request.into_body(), state.max_body_bytes);
    match tokio::time::timeout(state.body_timeout, read).await {
        Ok(Ok(body)) => Ok(body),
        Ok(Err(_)) => Err(too_large()),
        Err(_) => {
            refused_count("body_timeout", "body");
            let mut response = problem(
                StatusCode::REQUEST_TIMEOUT,
                &format!(
                    "the body did not arrive within {} ms",
                    state.body_timeout.as_millis()
                ),
            );
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            Err(response)
        }
    }
}

/// `X-Original-URI` (nginx), `X-Forwarded-Uri` (Caddy, Traefik) or `X-Original-URL`
/// (ingress-nginx, absolute-form).
const URI_HEADERS: [&str; 3] = ["x-original-uri", "x-forwarded-uri", "x-original-url"];
/// `X-Original-Method` (nginx) or `X-Forwarded-Method` (Caddy, Traefik).
const METHOD_HEADERS: [&str; 2] = ["x-original-method", "x-forwarded-method"];

fn first_header<'a>(headers: &'a HeaderMap, names: &[&str]) -> Option<&'a HeaderValue> {
    names.iter().find_map(|n| headers.get(*n))
}

/// Why a subrequest names no check, before anything is decided.
fn unreadable(status: StatusCode, reason: &'static str, detail: &str) -> Response {
    refused_count("invalid_argument", reason);
    problem(status, detail)
}

async fn forward_auth_check(
    State(state): State<HttpCheckState>,
    ConnectInfo(PeerAddr(peer)): ConnectInfo<PeerAddr>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let deny_status = match deny_status(uri.query()) {
        Ok(status) => status,
        Err(detail) => return unreadable(StatusCode::BAD_REQUEST, "deny_status", &detail),
    };
    let config = &state.forward_auth;
    let key = match &config.key {
        KeySource::Header(name) => match headers.get(name).map(HeaderValue::to_str) {
            Some(Ok(value)) if !value.trim().is_empty() => value.trim().to_string(),
            Some(Err(_)) => {
                return unreadable(
                    StatusCode::BAD_REQUEST,
                    "key",
                    &format!("{name}: not visible ASCII"),
                )
            }
            _ => {
                return unreadable(
                    StatusCode::UNAUTHORIZED,
                    "key",
                    &format!("the {name} header is missing: it names who is limited"),
                )
            }
        },
        KeySource::ClientAddress => {
            let forwarded: Vec<&str> = headers
                .get_all("x-forwarded-for")
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            let real_ip = headers.get("x-real-ip").and_then(|v| v.to_str().ok());
            config
                .client_address(peer.ip(), &forwarded, real_ip)
                .to_string()
        }
    };
    let Some(original_uri) = first_header(&headers, &URI_HEADERS) else {
        return unreadable(
            StatusCode::BAD_REQUEST,
            "route",
            "no X-Original-URI or X-Forwarded-Uri header: the gateway must pass the request's URI",
        );
    };
    let Ok(original_uri) = original_uri.to_str() else {
        return unreadable(
            StatusCode::BAD_REQUEST,
            "route",
            "the URI header is not visible ASCII",
        );
    };
    let original_method = match first_header(&headers, &METHOD_HEADERS) {
        Some(m) => match m.to_str() {
            Ok(m) => m.to_string(),
            Err(_) => {
                return unreadable(
                    StatusCode::BAD_REQUEST,
                    "route",
                    "the method header is not visible ASCII",
                )
            }
        },
        // nginx's subrequest keeps the original method when none is passed.
        None => method.as_str().to_string(),
    };
    let route = forward_auth::route(&original_method, original_uri);
    let input = CheckInput {
        descriptors: smallvec::smallvec![DescriptorInput {
            key: &key,
            route: &route,
            tier: None,
            cost: None,
        }],
    };
    let timed = state.auth.start();
    let verdict = match state.checker.check(&input, &ForwardAuthNames).await {
        Ok(verdict) => verdict,
        Err(error) => return refusal(error),
    };
    if verdict.allowed && verdict.delay_ms > 0 {
        // A shaper's admission: the request may go once the delay has passed, so the
        // answer that lets the gateway send it waits that long.
        tokio::time::sleep(Duration::from_millis(verdict.delay_ms)).await;
    }
    drop(timed.answered(()));
    let headers = answer_headers(&verdict, contract::PROBLEM_JSON);
    if verdict.allowed {
        let mut response = StatusCode::OK.into_response();
        let mut headers = headers;
        headers.remove(header::CONTENT_TYPE);
        *response.headers_mut() = headers;
        return response;
    }
    let body = contract::quota_exceeded_body(&verdict.rule, &verdict.quota(), verdict.window_ms);
    let mut response = (deny_status, body).into_response();
    *response.headers_mut() = headers;
    response
}

/// How the forward-auth endpoint names its one descriptor's fields in errors: after
/// the headers they came from.
struct ForwardAuthNames;

impl crate::check::FieldNames for ForwardAuthNames {
    fn field(&self, _at: crate::check::At, leaf: crate::check::Leaf) -> String {
        match leaf.as_str() {
            "key" => "key".into(),
            "route" => "X-Original-URI".into(),
            other => other.into(),
        }
    }

    fn descriptors(&self, _check: Option<usize>) -> String {
        "descriptors".into()
    }

    fn too_many_descriptors(&self, given: usize, max: usize) -> String {
        format!("{given} descriptors; at most {max}")
    }
}

/// The status a denial is answered with: 429 unless the gateway's auth URL asks for
/// 401 or 403 (`?deny_status=403`: nginx passes only those through, and its config
/// turns them into the client's 429).
fn deny_status(query: Option<&str>) -> Result<StatusCode, String> {
    let Some(query) = query else {
        return Ok(StatusCode::TOO_MANY_REQUESTS);
    };
    let mut status = StatusCode::TOO_MANY_REQUESTS;
    for pair in query.split('&') {
        if let Some(value) = pair.strip_prefix("deny_status=") {
            status = match value {
                "401" => StatusCode::UNAUTHORIZED,
                "403" => StatusCode::FORBIDDEN,
                "429" => StatusCode::TOO_MANY_REQUESTS,
                other => return Err(format!("deny_status={other:?}: use 401, 403 or 429")),
            };
        }
    }
    Ok(status)
}

/// The headers of an answer to a decided check: the IETF RateLimit fields, and on a
/// denial `Retry-After` (whole seconds, rounded up, at least 1).
fn answer_headers(verdict: &Verdict, content_type: &'static str) -> HeaderMap {
    let mut headers = HeaderMap::with_capacity(4);
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    let quota: Quota = verdict.quota();
    for (name, value) in contract::ietf_fields(&verdict.rule, &quota, verdict.window_ms, now_ms()) {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(HeaderName::from_static(lower(name)), value);
        }
    }
    if !verdict.allowed {
        let seconds = contract::ceil_secs(verdict.retry_after_ms).max(1);
        headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    headers
}

fn lower(name: &'static str) -> &'static str {
    match name {
        "RateLimit-Policy" => "ratelimit-policy",
        _ => "ratelimit",
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The verdict as JSON: `ringlimit.v1`'s `CheckResponse` fields under their proto
/// names, written as `ringlimit check --json` writes them: the identifiers that exceed
/// 2^53 (a decider's generation, a sequence number, a window id) as strings, so a
/// client that reads JSON numbers as doubles keeps them exact; the counts as numbers.
fn verdict_json(v: &Verdict) -> serde_json::Value {
    let descriptors: Vec<serde_json::Value> = v
        .descriptors
        .iter()
        .map(|d| {
            let (a, decision) = (&d.answer, &d.answer.decision);
            serde_json::json!({
                "key": d.item.client(),
                "route": d.item.route(),
                "allowed": decision.allowed,
                "limit": decision.limit,
                "remaining": decision.remaining,
                "retry_after_ms": decision.retry_after_ms,
                "reset_at": decision.reset_at_ms,
                "rule": &*a.rule,
                "algorithm": a.algorithm.as_str(),
                "window_id": decision.window_id.map(|w| w.to_string()),
                "sequence": a.sequence.to_string(),
                "decider": {"node_id": &*a.decider.node_id, "generation": a.decider.generation.to_string()},
                "degraded": a.degraded,
                "delay_ms": decision.delay_ms,
                "refunded": d.refunded,
                "hops": a.hops,
                "shadow_denied": d.shadow_denied(),
                "leased": d.leased(),
            })
        })
        .collect();
    serde_json::json!({
        "allowed": v.allowed,
        "limit": v.limit,
        "remaining": v.remaining,
        "retry_after_ms": v.retry_after_ms,
        "reset_at": v.reset_at_ms,
        "rule": &*v.rule,
        "decider": {"node_id": &*v.decider.node_id, "generation": v.decider.generation.to_string()},
        "window_id": v.window_id.map(|w| w.to_string()),
        "sequence": v.sequence.to_string(),
        "degraded": v.degraded,
        "delay_ms": v.delay_ms,
        "shadow_denied": v.shadow_denied,
        "window_ms": v.window_ms,
        "leased": v.leased(),
        "descriptors": descriptors,
    })
}

/// A refusal by the check layer: the gRPC edge's mapping (which counts it in
/// `ringlimit_refused_total{reason, field}`) said in HTTP.
fn refusal(error: CheckError) -> Response {
    let status: tonic::Status = error.into();
    let http = match status.code() {
        tonic::Code::InvalidArgument => StatusCode::BAD_REQUEST,
        tonic::Code::FailedPrecondition => StatusCode::CONFLICT,
        tonic::Code::ResourceExhausted | tonic::Code::Unavailable => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    problem(http, status.message())
}

/// A refusal this face makes before the check layer sees the request, counted with
/// the check layer's.
fn refused_count(reason: &'static str, field: &'static str) {
    metrics::counter!("ringlimit_refused_total", "reason" => reason, "field" => field).increment(1);
}

/// An RFC 9457 problem body with `status` and `detail`.
fn problem(status: StatusCode, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = (status, body.to_string()).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(contract::PROBLEM_JSON),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_denial_status_is_429_unless_the_auth_url_asks_for_401_or_403() {
        assert_eq!(deny_status(None), Ok(StatusCode::TOO_MANY_REQUESTS));
        assert_eq!(deny_status(Some("a=b")), Ok(StatusCode::TOO_MANY_REQUESTS));
        assert_eq!(
            deny_status(Some("deny_status=403")),
            Ok(StatusCode::FORBIDDEN)
        );
        assert_eq!(
            deny_status(Some("x=1&deny_status=401")),
            Ok(StatusCode::UNAUTHORIZED)
        );
        assert!(
            deny_status(Some("deny_status=200")).is_err(),
            "a denial is never a 2xx"
        );
    }

    #[test]
    fn an_extra_json_descriptor_inherits_what_it_leaves_out() {
        let check: JsonCheck = serde_json::from_str(
            r#"{"key":"a","route":"/x","cost":2,"tier":"gold","descriptors":[{"key":"b"}]}"#,
        )
        .unwrap();
        let input = json_input(&check);
        assert_eq!(input.descriptors.len(), 2);
        assert_eq!(input.descriptors[1].route, "/x");
        assert_eq!(input.descriptors[1].cost, Some(2));
        assert_eq!(input.descriptors[1].tier, Some("gold"));
        let misspelt = serde_json::from_str::<JsonCheck>(r#"{"key":"a","route":"/x","cots":2}"#);
        assert!(misspelt.unwrap_err().to_string().contains("cots"));
    }
}
