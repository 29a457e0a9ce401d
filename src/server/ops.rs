//! The ops face: HTTP for operators and orchestrators (`--http-listen`, default
//! `127.0.0.1:7421`).
//!
//! | route | what |
//! |---|---|
//! | `GET /metrics` | Prometheus text |
//! | `GET /healthz` | 200 while the process serves (liveness) |
//! | `GET /readyz` | 200 once rules are loaded, no member holds newer ones, and, with seeds, another member is seen (readiness) |
//! | `GET /v1/cluster` | members, ring digest, each member's rules advert, drift, keys held |
//! | `GET /v1/owner?key=K` | which member owns K, charging nothing |
//! | `GET /v1/limits/{tier}` | that tier's rules as JSON |
//! | `PUT /v1/limits/{tier}` | create or replace the tier's rule for a route pattern |
//! | `DELETE /v1/limits/{tier}?route_pattern=P` | remove it |
//! | `GET /v1/rules` | the whole document, TOML (or JSON with `Accept: application/json`), `ETag` = version |
//! | `PUT /v1/rules` | replace it (TOML, or JSON with `Content-Type: application/json`), `If-Match` |
//! | `PUT /v1/rules/envoy` | replace only its `[envoy]` section (JSON; `null` removes it), `If-Match` |
//! | `GET /v1/counters?key=K[&route=R&tier=T]` | that client's counters, read on the key's owner, charging nothing |
//! | `DELETE /v1/counters?key=K[&route=R&tier=T]` | reset them (an admin write, audited in the log) |
//!
//! Writes need `Authorization: Bearer <token>` matching `--admin-token-file`; a node
//! without a token refuses every write (403), so a node started without one can never be
//! reconfigured by whoever reaches the port. A node following `--rules FILE` refuses
//! writes too (409): the file is the truth; so does a node following `--envoy-config`
//! for a write that changes the `[envoy]` section. A bad body is answered 400 with the messages
//! of `ringlimit rules check`, and nothing changes; a stale `If-Match` is answered 412.
//!
//! This adapter maps HTTP onto [`ClusterRules`] and the router's view; it decides nothing
//! itself.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::check::plan::MAX_KEY_BYTES;
use crate::cluster::link::{CountersError, ForwardError};
use crate::cluster::rules::{hex, ClusterRules, Refusal, RulesEdit, RulesWriteError, Written};
use crate::cluster::Router;
use crate::config::rules::Stamp;
use crate::config::rules::{DocEnvoy, RulesDoc, TierLimit, MAX_RULES_BYTES_FLAG};
use crate::ring::Ring;
use crate::server::peer::audit_list;
use crate::shard::counters::{ClientCounters, ClientQuery};

/// The admin token writes must present. Compared through blake3 hashes, so the
/// comparison takes the same time whatever the guess.
#[derive(Clone)]
pub struct AdminToken(blake3::Hash);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

/// Shortest admin token accepted: a token is a password nobody types, so 16 characters
/// of a generator's output is the least that resists guessing.
pub const MIN_ADMIN_TOKEN_CHARS: usize = 16;

impl AdminToken {
    /// A token from its text (surrounding whitespace ignored).
    pub fn new(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.chars().count() < MIN_ADMIN_TOKEN_CHARS {
            return Err(format!(
                "admin token must be at least {MIN_ADMIN_TOKEN_CHARS} characters"
            ));
        }
        if !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("admin token must be visible ASCII without spaces".into());
        }
        Ok(AdminToken(blake3::hash(text.as_bytes())))
    }

    /// The token in the first line of `path`.
    pub fn from_file(path: &std::path::Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("admin token file {}: {e}", path.display()))?;
        let first = text.lines().next().unwrap_or("");
        Self::new(first).map_err(|e| format!("admin token file {}: {e}", path.display()))
    }

    /// A short name of this token for audit lines: 8 hex digits of a hash of its hash,
    /// which tells tokens apart across a rotation without revealing anything usable.
    pub fn id(&self) -> String {
        let id = blake3::hash(self.0.as_bytes());
        id.to_hex()[..8].to_string()
    }

    fn matches(&self, given: &str) -> bool {
        // blake3::Hash equality is constant-time.
        blake3::hash(given.as_bytes()) == self.0
    }
}

/// What the ops face serves from.
#[derive(Clone)]
pub struct OpsState {
    /// The rules authority.
    pub rules: Arc<ClusterRules>,
    /// The router: cluster view, this node's identity, the shards (keys held).
    pub router: Arc<Router>,
    /// `None`: writes refused.
    pub admin: Option<AdminToken>,
    /// Largest request body, in bytes (`--max-rules-bytes`): the cap of the rule file,
    /// so a document accepted from a file is accepted here too. Read only after the
    /// admin token is checked.
    pub max_rules_bytes: u64,
    /// Renders `/metrics`.
    pub metrics: Arc<dyn Fn() -> String + Send + Sync>,
    /// The node was given seeds: ready only once it sees another member.
    pub expects_peers: bool,
}

/// An answer that is not a success: a status and a message, sent as `{"error": "..."}`.
#[derive(Debug)]
struct OpsError(StatusCode, String);

impl IntoResponse for OpsError {
    fn into_response(self) -> Response {
        let mut response = json(self.0, serde_json::json!({ "error": self.1 }));
        if self.0 == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<RulesWriteError> for OpsError {
    fn from(error: RulesWriteError) -> Self {
        let status = match error.kind() {
            Refusal::ReadOnly => StatusCode::CONFLICT,
            Refusal::Stale => StatusCode::PRECONDITION_FAILED,
            Refusal::Invalid => StatusCode::BAD_REQUEST,
            Refusal::NotFound => StatusCode::NOT_FOUND,
            Refusal::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        };
        OpsError(status, error.to_string())
    }
}

fn json(status: StatusCode, value: serde_json::Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        format!("{value}\n"),
    )
        .into_response()
}

/// The ops routes over `state`.
pub fn routes(state: OpsState) -> axum::Router {
    axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/v1/cluster", get(cluster))
        .route("/v1/owner", get(owner))
        .route(
            "/v1/limits/{tier}",
            get(get_limits).put(put_limit).delete(delete_limit),
        )
        .route("/v1/rules", get(get_rules).put(put_rules))
        .route("/v1/rules/envoy", axum::routing::put(put_envoy))
        .route("/v1/counters", get(get_counters).delete(reset_counters))
        .with_state(state)
}

async fn metrics(State(s): State<OpsState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        (s.metrics)(),
    )
        .into_response()
}

async fn readyz(State(s): State<OpsState>) -> Response {
    let view = s.router.view();
    let joined = !s.expects_peers || view.members.len() > 1;
    let current = s.rules.current();
    // A node that knows a member holds newer rules enforces replaced ones: not ready
    // until its copy arrives (within a gossip round or two).
    let behind = s.rules.behind();
    let reason = match (&behind, joined) {
        (_, false) => Some("no other member seen yet (seeds given)".to_string()),
        _ if !s.router.restored() => Some(
            "restoring this node's keys from their successors' replicas (after a start with seeds)"
                .to_string(),
        ),
        (Some((id, advert)), true) => Some(format!(
            "catching up: {id} holds rules {}, this node {}",
            advert.stamp,
            current.stamp()
        )),
        (None, true) => None,
    };
    let ready = reason.is_none();
    let body = serde_json::json!({
        "ready": ready,
        "members": view.members.len(),
        "rules_version": current.version,
        "rules_digest": hex(current.rules.digest()),
        "reason": reason,
    });
    json(
        if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        },
        body,
    )
}

async fn cluster(State(s): State<OpsState>) -> Result<Response, OpsError> {
    let view = s.router.view();
    let shares = view.ring.shares();
    let me = s.router.me();
    let mine = s.rules.advert();
    let members: Vec<_> = view
        .members
        .iter()
        .map(|m| {
            let rules = s.rules.member(&m.node_id);
            let advert = rules.rules;
            serde_json::json!({
                "node_id": m.node_id,
                "generation": m.generation.to_string(),
                "grpc_addr": m.grpc_addr.to_string(),
                "peer_addr": m.peer_addr.to_string(),
                "gossip_addr": m.gossip_addr.to_string(),
                "leaving": m.leaving,
                "ring_share": shares.iter().find(|(id, _)| *id == m.node_id).map_or(0.0, |(_, s)| *s),
                "rules_source": advert.map(|a| a.source.as_str()),
                "rules_version": advert.map(|a| a.stamp.version),
                "rules_digest": advert.map(|a| hex(a.stamp.digest)),
                "rules_drift": rules.rules_drift,
                "envoy_config": rules.envoy.map(|a| a.encode()),
                "envoy_drift": rules.envoy_drift,
            })
        })
        .collect();
    let keys = s
        .router
        .shards()
        .keys()
        .await
        .map_err(|e| OpsError(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
    Ok(json(
        StatusCode::OK,
        serde_json::json!({
            "node_id": &*me.node_id,
            "generation": me.generation.to_string(),
            "ring_digest": format!("{:016x}", view.ring.digest()),
            "keys": keys,
            "rules": {
                "source": mine.source.as_str(),
                "version": mine.stamp.version,
                "digest": hex(mine.stamp.digest),
            },
            "rules_drift": !s.rules.drift().is_empty(),
            "envoy_config": s.rules.envoy_advert().encode(),
            "envoy_drift": !s.rules.envoy_drift().is_empty(),
            "members": members,
        }),
    ))
}

async fn owner(State(s): State<OpsState>, uri: Uri) -> Result<Response, OpsError> {
    let key = query_param(&uri, "key")?
        .ok_or_else(|| bad("key: required (GET /v1/owner?key=K)".into()))?;
    if key.is_empty() || key.len() > MAX_KEY_BYTES {
        return Err(bad(format!(
            "key: must be 1..={MAX_KEY_BYTES} bytes (got {})",
            key.len()
        )));
    }
    let placement = Ring::key_hash(key.as_bytes());
    let view = s.router.view();
    let owner = view
        .owner_of_placement(placement)
        .ok_or_else(|| OpsError(StatusCode::SERVICE_UNAVAILABLE, "the ring is empty".into()))?;
    Ok(json(
        StatusCode::OK,
        serde_json::json!({
            "key": key,
            "placement": format!("{placement:016x}"),
            "owner": {
                "node_id": owner.node_id,
                "generation": owner.generation.to_string(),
                "grpc_addr": owner.grpc_addr.to_string(),
            },
            "ring_digest": format!("{:016x}", view.ring.digest()),
        }),
    ))
}

/// The client a counters request names: its key and optional route and tier, held to a
/// check's bounds (400 naming the field, before anything is read or changed).
fn counters_query(uri: &Uri) -> Result<ClientQuery, OpsError> {
    let key = query_param(uri, "key")?
        .ok_or_else(|| bad("key: required (/v1/counters?key=K[&route=R&tier=T])".into()))?;
    let route = query_param(uri, "route")?;
    let tier = query_param(uri, "tier")?;
    ClientQuery::new(&key, route.as_deref(), tier.as_deref()).map_err(bad)
}

/// A counters answer: the client, the owner that answered, and each counter holding
/// state (a counter without state is as fresh as a new key: nothing used).
fn counters_body(query: &ClientQuery, answer: &ClientCounters, reset: bool) -> serde_json::Value {
    let counters: Vec<_> = answer
        .counters
        .iter()
        .map(|c| {
            serde_json::json!({
                "rule": c.rule,
                "algorithm": c.algorithm,
                "route": (!c.route.is_empty()).then_some(&c.route),
                "limit": c.limit,
                "used": c.used(),
                "remaining": c.remaining,
                "reset_at_ms": c.reset_at_ms,
            })
        })
        .collect();
    serde_json::json!({
        "key": query.key(),
        "route": query.route(),
        "tier": query.tier(),
        "owner": {
            "node_id": answer.owner,
            "generation": answer.generation.to_string(),
        },
        "reset": reset,
        "counters": counters,
    })
}

fn counters_error(error: CountersError) -> OpsError {
    let status = match &error {
        CountersError::Refused(_) => StatusCode::BAD_REQUEST,
        CountersError::Failed(ForwardError::Timeout(_)) => StatusCode::GATEWAY_TIMEOUT,
        CountersError::Failed(_) => StatusCode::BAD_GATEWAY,
        CountersError::Shard(_) | CountersError::NoOwner => StatusCode::SERVICE_UNAVAILABLE,
    };
    OpsError(status, error.to_string())
}

/// `GET /v1/counters`: read on the key's owner; charges nothing.
async fn get_counters(State(s): State<OpsState>, uri: Uri) -> Result<Response, OpsError> {
    let query = counters_query(&uri)?;
    let rules = s.rules.current().rules.clone();
    let answer = s
        .router
        .counters(&rules, &query, false, "")
        .await
        .map_err(counters_error)?;
    Ok(json(StatusCode::OK, counters_body(&query, &answer, false)))
}

/// `DELETE /v1/counters`: an admin write. The token is checked before the query is even
/// read; the reset happens in one step of the owner's shard, and the log keeps who did
/// it and what each counter held just before.
async fn reset_counters(
    State(s): State<OpsState>,
    headers: HeaderMap,
    uri: Uri,
) -> Result<Response, OpsError> {
    authorize(&s, &headers)?;
    let query = counters_query(&uri)?;
    let by = s
        .admin
        .as_ref()
        .map_or_else(String::new, |token| format!("admin token {}", token.id()));
    let rules = s.rules.current().rules.clone();
    let result = s.router.counters(&rules, &query, true, &by).await;
    let answer = result.map_err(|error| {
        tracing::warn!(
            target: "ringlimit::audit",
            node_id = %s.router.me().node_id,
            by = %by,
            key = %query.key(),
            route = query.route(),
            tier = query.tier(),
            %error,
            "counters reset failed (it may or may not have happened on the owner)"
        );
        counters_error(error)
    })?;
    tracing::warn!(
        target: "ringlimit::audit",
        node_id = %s.router.me().node_id,
        by = %by,
        user_agent = headers.get(header::USER_AGENT).and_then(|v| v.to_str().ok()),
        key = %query.key(),
        route = query.route(),
        tier = query.tier(),
        owner = %answer.owner,
        counters = %audit_list(&answer.counters),
        "counters reset"
    );
    Ok(json(StatusCode::OK, counters_body(&query, &answer, true)))
}

fn bad(message: String) -> OpsError {
    OpsError(StatusCode::BAD_REQUEST, message)
}

/// The headers every rules answer carries: the version as the entity tag (what
/// `If-Match` names), the digest and the source.
fn with_rules_headers(mut response: Response, stamp: Stamp, rules: &ClusterRules) -> Response {
    let h = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&format!("\"{}\"", stamp.version)) {
        h.insert(header::ETAG, v);
    }
    if let Ok(v) = HeaderValue::from_str(&hex(stamp.digest)) {
        h.insert("x-ringlimit-rules-digest", v);
    }
    h.insert(
        "x-ringlimit-rules-source",
        HeaderValue::from_static(rules.source().as_str()),
    );
    response
}

async fn get_limits(State(s): State<OpsState>, Path(tier): Path<String>) -> Response {
    let current = s.rules.current();
    let rules: Vec<serde_json::Value> = current
        .rules
        .doc()
        .tier_rules(&tier)
        .into_iter()
        .map(|r| {
            let mut v = serde_json::to_value(r).expect("a rule serializes");
            v["route_pattern"] = serde_json::json!(r.route);
            v
        })
        .collect();
    let body = serde_json::json!({
        "tier": tier,
        "version": current.version,
        "digest": hex(current.rules.digest()),
        "rules": rules,
    });
    with_rules_headers(json(StatusCode::OK, body), current.stamp(), &s.rules)
}

async fn put_limit(
    State(s): State<OpsState>,
    Path(tier): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpsError> {
    authorize(&s, &headers)?;
    let if_match = if_match(&headers)?;
    let limit: TierLimit = json_body(&bounded(&s, body).await?)?;
    let written = s
        .rules
        .write(if_match, RulesEdit::PutTierLimit { tier, limit })
        .await?;
    Ok(answer_written(&s, &written))
}

async fn delete_limit(
    State(s): State<OpsState>,
    Path(tier): Path<String>,
    headers: HeaderMap,
    uri: Uri,
) -> Result<Response, OpsError> {
    authorize(&s, &headers)?;
    let if_match = if_match(&headers)?;
    let route = query_param(&uri, "route_pattern")?;
    let written = s
        .rules
        .write(if_match, RulesEdit::DeleteTierLimit { tier, route })
        .await?;
    Ok(answer_written(&s, &written))
}

async fn get_rules(State(s): State<OpsState>, headers: HeaderMap) -> Response {
    let current = s.rules.current();
    let response = if wants_json(&headers, header::ACCEPT) {
        (
            [(header::CONTENT_TYPE, "application/json")],
            format!("{}\n", current.rules.doc().to_json()),
        )
            .into_response()
    } else {
        (
            [(header::CONTENT_TYPE, "application/toml")],
            current.rules.doc().to_toml(),
        )
            .into_response()
    };
    with_rules_headers(response, current.stamp(), &s.rules)
}

async fn put_rules(
    State(s): State<OpsState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpsError> {
    authorize(&s, &headers)?;
    let if_match = if_match(&headers)?;
    let body = bounded(&s, body).await?;
    let text = utf8(&body)?;
    let doc = if wants_json(&headers, header::CONTENT_TYPE) {
        RulesDoc::from_json_str(text)
    } else {
        RulesDoc::from_toml_str(text)
    }
    .map_err(|e| bad(e.to_string()))?;
    let written = s.rules.write(if_match, RulesEdit::Replace(doc)).await?;
    Ok(answer_written(&s, &written))
}

/// `PUT /v1/rules/envoy`: the `[envoy]` section alone, as JSON
/// (`{"algorithm": "fixed_window", "domains": ["domain: gw\n…"]}`, or `null` to remove
/// it); every TOML rule stays as the coordinator has it.
async fn put_envoy(
    State(s): State<OpsState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpsError> {
    authorize(&s, &headers)?;
    let if_match = if_match(&headers)?;
    let section: Option<DocEnvoy> = json_body(&bounded(&s, body).await?)?;
    let written = s
        .rules
        .write(if_match, RulesEdit::ReplaceEnvoy(section))
        .await?;
    Ok(answer_written(&s, &written))
}

/// A JSON body (already [`bounded`]); a bad one is 400 naming line and column.
fn json_body<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, OpsError> {
    serde_json::from_slice(body).map_err(|e| {
        bad(format!(
            "body: JSON error at line {}, column {}: {e}",
            e.line(),
            e.column()
        ))
    })
}

fn utf8(body: &Bytes) -> Result<&str, OpsError> {
    std::str::from_utf8(body).map_err(|e| {
        bad(format!(
            "body: not UTF-8 (invalid byte at offset {})",
            e.valid_up_to()
        ))
    })
}

fn answer_written(s: &OpsState, written: &Written) -> Response {
    let mut body = serde_json::json!({
        "version": written.stamp.version,
        "digest": hex(written.stamp.digest),
        "changed": written.changed,
        "coordinator": written.coordinator,
    });
    if let Some(rule) = &written.rule {
        body["rule"] = serde_json::json!(rule);
    }
    with_rules_headers(json(StatusCode::OK, body), written.stamp, &s.rules)
}

fn authorize(s: &OpsState, headers: &HeaderMap) -> Result<(), OpsError> {
    let Some(token) = &s.admin else {
        return Err(OpsError(
            StatusCode::FORBIDDEN,
            "writes are disabled: this node was started without --admin-token-file".into(),
        ));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| {
            OpsError(
                StatusCode::UNAUTHORIZED,
                "writes need Authorization: Bearer <admin token>".into(),
            )
        })?;
    if !token.matches(given.trim()) {
        return Err(OpsError(
            StatusCode::UNAUTHORIZED,
            "the admin token does not match".into(),
        ));
    }
    Ok(())
}

/// `If-Match: "7"` (or `7`, `W/"7"`) → `Some(7)`; `*` or absent → `None` (unconditional).
fn if_match(headers: &HeaderMap) -> Result<Option<u64>, OpsError> {
    let Some(value) = headers.get(header::IF_MATCH) else {
        return Ok(None);
    };
    let text = value.to_str().unwrap_or("").trim();
    if text == "*" {
        return Ok(None);
    }
    let tag = text.strip_prefix("W/").unwrap_or(text);
    let tag = tag
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .unwrap_or(tag);
    tag.parse().map(Some).map_err(|_| {
        bad(format!(
            "If-Match: {text:?} is not a rules version (the ETag of GET /v1/rules, e.g. \"7\")"
        ))
    })
}

/// The request body, read up to the node's rules cap (`--max-rules-bytes`, the cap of the
/// rule file too): one byte more is 413 naming the flag, and nothing past the cap is
/// buffered.
async fn bounded(s: &OpsState, body: Body) -> Result<Bytes, OpsError> {
    use futures_util::StreamExt;
    let cap = s.max_rules_bytes;
    let too_large = || {
        OpsError(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("body: over the limit of {cap} bytes ({MAX_RULES_BYTES_FLAG})"),
        )
    };
    let mut stream = body.into_data_stream();
    let mut read = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| bad(format!("body: {e}")))?;
        if (read.len() + chunk.len()) as u64 > cap {
            return Err(too_large());
        }
        read.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(read))
}

fn wants_json(headers: &HeaderMap, name: header::HeaderName) -> bool {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/json"))
}

/// One query parameter, percent-decoded (`+` is a space); `None` when absent.
fn query_param(uri: &Uri, name: &str) -> Result<Option<String>, OpsError> {
    let Some(query) = uri.query() else {
        return Ok(None);
    };
    for pair in query.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k == name {
            return percent_decode(v)
                .map(Some)
                .ok_or_else(|| bad(format!("{name}: not a valid percent-encoded UTF-8 value")));
        }
    }
    Ok(None)
}

fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = text.get(i + 1..i + 3)?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding_handles_spaces_slashes_and_garbage() {
        assert_eq!(
            percent_decode("POST+%2Fv1%2Fcharges").unwrap(),
            "POST /v1/charges"
        );
        assert_eq!(percent_decode("a%20b").unwrap(), "a b");
        assert!(percent_decode("%zz").is_none());
        assert!(percent_decode("%f").is_none());
        assert!(percent_decode("%ff").is_none(), "not UTF-8");
    }

    #[test]
    fn if_match_accepts_entity_tags_and_refuses_garbage() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::IF_MATCH, HeaderValue::from_str(v).unwrap());
            m
        };
        assert_eq!(if_match(&HeaderMap::new()).unwrap(), None);
        assert_eq!(if_match(&h("*")).unwrap(), None);
        assert_eq!(if_match(&h("\"7\"")).unwrap(), Some(7));
        assert_eq!(if_match(&h("W/\"7\"")).unwrap(), Some(7));
        assert_eq!(if_match(&h("7")).unwrap(), Some(7));
        assert!(if_match(&h("\"abc\"")).is_err());
    }

    #[test]
    fn admin_tokens_are_long_and_compared_by_value() {
        assert!(AdminToken::new("short").is_err());
        assert!(AdminToken::new("has a space in it, long enough").is_err());
        let t = AdminToken::new("  0123456789abcdef\n").unwrap();
        assert!(t.matches("0123456789abcdef"));
        assert!(!t.matches("0123456789abcdeg"));
        assert!(!format!("{t:?}").contains("0123"), "never logged");
    }

    #[test]
    fn an_admin_token_id_is_stable_per_token_and_reveals_nothing_of_it() {
        let token = "test-admin-token-0123456789";
        let id = AdminToken::new(token).unwrap().id();
        assert_eq!(id.len(), 8);
        assert_eq!(AdminToken::new(token).unwrap().id(), id);
        assert_ne!(
            AdminToken::new("another-admin-token-0123").unwrap().id(),
            id
        );
        assert!(!token.contains(&id) && !blake3::hash(token.as_bytes()).to_hex().contains(&*id));
    }
}
