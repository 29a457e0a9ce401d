//! A `tower` layer that limits an HTTP service: a closure picks the key and route of
//! each request, the [`Client`] decides, and a denial is answered `429 Too Many
//! Requests` with the contract's headers and problem body without reaching the inner
//! service. Allowed responses get the same headers, so callers can pace themselves.
//! Every response also says where its answer came from (`X-RateLimit-Source`: owner,
//! forwarded, deny-cache, fail-open, fail-closed).
//!
//! A request the closure maps to `None` passes unlimited. A check the cluster refuses
//! as malformed (an over-long key, say) is answered `400` with a problem body: it was
//! not charged, and it is not let through either.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::{Either, Full};

use crate::client::{Answer, Check, Client, ClientError, Unavailable};
use crate::contract::{headers, problem_body, PROBLEM_JSON};

/// What a request is limited as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Who (API key, client IP).
    pub key: String,
    /// What (`METHOD /path`).
    pub route: String,
    /// Units it consumes.
    pub cost: u64,
}

impl Target {
    /// Cost 1.
    pub fn new(key: impl Into<String>, route: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            route: route.into(),
            cost: 1,
        }
    }
}

/// How the layer treats what it cannot ask about.
#[derive(Debug, Clone)]
pub struct LayerOptions {
    /// What a check gets when no node answers.
    pub unavailable: Unavailable,
    /// The `type` URI of the 429 problem body.
    pub problem_type: String,
    /// The deadline of one check (default: the client's).
    pub deadline: Option<Duration>,
}

impl Default for LayerOptions {
    fn default() -> Self {
        Self {
            unavailable: Unavailable::Closed,
            problem_type: "about:blank".into(),
            deadline: None,
        }
    }
}

/// The layer: wrap a service with [`RateLimitLayer::new`]`(client, |req| …)`.
#[derive(Clone)]
pub struct RateLimitLayer<F> {
    client: Client,
    extract: Arc<F>,
    options: Arc<LayerOptions>,
}

impl<F> RateLimitLayer<F> {
    /// Limit by what `extract` returns for each request.
    pub fn new(client: Client, extract: F) -> Self {
        Self::with_options(client, extract, LayerOptions::default())
    }

    /// With options.
    pub fn with_options(client: Client, extract: F, options: LayerOptions) -> Self {
        Self {
            client,
            extract: Arc::new(extract),
            options: Arc::new(options),
        }
    }
}

impl<S, F> tower_layer::Layer<S> for RateLimitLayer<F> {
    type Service = RateLimit<S, F>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit {
            inner,
            client: self.client.clone(),
            extract: self.extract.clone(),
            options: self.options.clone(),
        }
    }
}

/// The limited service.
#[derive(Clone)]
pub struct RateLimit<S, F> {
    inner: S,
    client: Client,
    extract: Arc<F>,
    options: Arc<LayerOptions>,
}

/// A response body: the inner service's, or the layer's own (429, 400).
pub type LimitedBody<B> = Either<B, Full<Bytes>>;

impl<S, F, B, ResBody> tower_service::Service<Request<B>> for RateLimit<S, F>
where
    S: tower_service::Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    F: Fn(&Request<B>) -> Option<Target> + Send + Sync + 'static,
    B: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<LimitedBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let target = (self.extract)(&request);
        // The clone-and-swap of tower services: the one that was polled ready serves.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let client = self.client.clone();
        let options = self.options.clone();
        Box::pin(async move {
            let Some(target) = target else {
                return Ok(inner.call(request).await?.map(Either::Left));
            };
            let mut check = Check::new(target.key, target.route).cost(target.cost);
            check.unavailable = options.unavailable;
            check.deadline = options.deadline;
            match client.check(&check).await {
                Ok(answer) if answer.allowed() => {
                    let mut response = inner.call(request).await?.map(Either::Left);
                    decorate(response.headers_mut(), &answer);
                    Ok(response)
                }
                Ok(answer) => Ok(too_many(&answer, &options.problem_type)),
                Err(error) => Ok(refused(&error)),
            }
        })
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The contract's headers and the answer's source on `headers`.
fn decorate(headers_out: &mut http::HeaderMap, answer: &Answer) {
    for (name, value) in headers(&answer.quota, &answer.rule, answer.window_ms, unix_ms()) {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers_out.insert(HeaderName::from_static(lower(name)), value);
        }
    }
    headers_out.insert(
        HeaderName::from_static("x-ratelimit-source"),
        HeaderValue::from_static(answer.source.as_str()),
    );
    if answer.degraded {
        headers_out.insert(
            HeaderName::from_static("x-ratelimit-degraded"),
            HeaderValue::from_static("1"),
        );
    }
}

/// HTTP/1 header names are case-insensitive; `http` wants them lower-case.
fn lower(name: &'static str) -> &'static str {
    match name {
        "Retry-After" => "retry-after",
        "RateLimit" => "ratelimit",
        "RateLimit-Policy" => "ratelimit-policy",
        "X-RateLimit-Limit" => "x-ratelimit-limit",
        "X-RateLimit-Remaining" => "x-ratelimit-remaining",
        "X-RateLimit-Reset" => "x-ratelimit-reset",
        _ => "x-ratelimit-unknown",
    }
}

fn too_many<B>(answer: &Answer, problem_type: &str) -> Response<LimitedBody<B>> {
    let body = problem_body(&answer.quota, answer.window_ms, problem_type);
    let mut response = Response::new(Either::Right(Full::new(Bytes::from(body))));
    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    decorate(response.headers_mut(), answer);
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(PROBLEM_JSON),
    );
    response
}

fn refused<B>(error: &ClientError) -> Response<LimitedBody<B>> {
    let mut body = serde_json::Map::new();
    body.insert("type".into(), "about:blank".into());
    body.insert("title".into(), "Bad Request".into());
    body.insert("detail".into(), error.to_string().into());
    let body = serde_json::Value::Object(body).to_string();
    let mut response = Response::new(Either::Right(Full::new(Bytes::from(body))));
    *response.status_mut() = StatusCode::BAD_REQUEST;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(PROBLEM_JSON),
    );
    response
}
