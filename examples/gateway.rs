//! An example gateway: an HTTP server in front of a small upstream, every request
//! limited through a ringlimit cluster by `ringlimit-client`'s tower layer.
//!
//! ```text
//! cargo run --release --example gateway -- --listen 127.0.0.1:8080 --ringlimit 127.0.0.1:7420
//! curl -i -H 'X-Api-Key: cust_42' http://127.0.0.1:8080/v1/charges
//! ```
//!
//! - Who is limited: the `X-Api-Key` header, else the client's IP address.
//! - What: `METHOD /path` (the query string is not part of it).
//! - Allowed: the upstream's answer, with `RateLimit-*` and `X-RateLimit-*` headers.
//! - Denied: `429` with `Retry-After`, both header families and an
//!   `application/problem+json` body; the upstream is not called.
//! - `X-RateLimit-Source` says who decided (owner, forwarded, deny-cache, fail-open,
//!   fail-closed); `X-RateLimit-Degraded: 1` marks an answer not decided on the key's
//!   own counter by its owner.
//!
//! Flags: `--listen ADDR` (default `127.0.0.1:8080`), `--ringlimit ADDR` (a node's
//! public gRPC address; repeat for more seeds; default `127.0.0.1:7420`),
//! `--deadline-ms N` (per check, default 50), `--fail-open LIMIT/WINDOW_S` (when no node
//! answers, admit LIMIT per WINDOW_S divided among the members; default: fail closed).
//! The gateway prints `gateway listening on ADDR` on stdout once it serves.

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::http::Request;
use axum::routing::any;
use axum::Router;
use clap::Parser;
use ringlimit_client::layer::LayerOptions;
use ringlimit_client::{Client, ClientConfig, RateLimitLayer, Target, Unavailable};

#[derive(Parser)]
struct Args {
    /// Where the gateway listens.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// A ringlimit node's public gRPC address (repeat for more seeds).
    #[arg(long, default_value = "127.0.0.1:7420")]
    ringlimit: Vec<String>,
    /// Deadline of one check, in ms.
    #[arg(long, default_value_t = 50)]
    deadline_ms: u64,
    /// When no node answers: admit LIMIT per WINDOW_S seconds, divided among the
    /// members (e.g. `100/60`). Default: deny (fail closed).
    #[arg(long, value_parser = parse_fail_open)]
    fail_open: Option<(u64, u64)>,
}

fn parse_fail_open(text: &str) -> Result<(u64, u64), String> {
    let (limit, window) = text
        .split_once('/')
        .ok_or_else(|| format!("{text:?}: expected LIMIT/WINDOW_S, e.g. 100/60"))?;
    let number = |s: &str| {
        s.trim()
            .parse::<u64>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("{s:?} is not a positive whole number"))
    };
    Ok((number(limit)?, number(window)?))
}

/// The upstream: says what it was asked.
async fn upstream(request: Request<axum::body::Body>) -> String {
    format!(
        "{{\"upstream\":\"ok\",\"method\":\"{}\",\"path\":\"{}\"}}\n",
        request.method(),
        request.uri().path()
    )
}

/// Who and what a request is: the API key (else the client IP), and `METHOD /path`.
fn target<B>(request: &Request<B>) -> Option<Target> {
    let key = request
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| !k.is_empty())
        .map(str::to_string)
        .or_else(|| {
            request
                .extensions()
                .get::<ConnectInfo<SocketAddr>>()
                .map(|ConnectInfo(addr)| addr.ip().to_string())
        })?;
    let route = format!("{} {}", request.method(), request.uri().path());
    Some(Target::new(key, route))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let mut config = ClientConfig::new(args.ringlimit.clone());
    config.deadline = Duration::from_millis(args.deadline_ms);
    let client = Client::connect(config).await?;
    let options = LayerOptions {
        unavailable: match args.fail_open {
            Some((limit, window_s)) => Unavailable::Open {
                limit,
                window: Duration::from_secs(window_s),
            },
            None => Unavailable::Closed,
        },
        problem_type: "https://ringlimit.dev/errors/rate-limit".into(),
        deadline: None,
    };
    let app = Router::new()
        .fallback(any(upstream))
        .layer(RateLimitLayer::with_options(client, target, options));
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    println!("gateway listening on {}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
