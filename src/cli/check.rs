//! `ringlimit check`: one check through the public gRPC face, printed as a line or JSON
//! (with the headers a gateway would send), or a dry run through the ops port.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use ringlimit::config::rules::{RuleSet, RulesDoc};
use ringlimit::node::config::{DEFAULT_HTTP_LISTEN, DEFAULT_LISTEN};
use ringlimit::proto::rate_limiter_client::RateLimiterClient;
use ringlimit::proto::{CheckRequest, CheckResponse};
use ringlimit_client::contract;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use super::{owner, rules};

/// The flags of `ringlimit check`.
#[derive(clap::Args)]
pub struct CheckArgs {
    /// Node to ask (host:port or http://host:port; with --tls-ca, https).
    #[arg(long, default_value = DEFAULT_LISTEN)]
    addr: String,
    /// Client key (who is limited).
    #[arg(long)]
    key: String,
    /// Route, e.g. "POST /v1/charges".
    #[arg(long)]
    route: String,
    /// Units to consume (the node refuses 0 and negatives).
    #[arg(long, allow_negative_numbers = true)]
    cost: Option<i64>,
    /// Tier for rule matching.
    #[arg(long)]
    tier: Option<String>,
    /// Print one JSON object instead of a line.
    #[arg(long)]
    json: bool,
    /// Also print the HTTP headers a gateway should send.
    #[arg(long)]
    headers: bool,
    /// Another client key checked in the same request (same route, tier and cost), to
    /// try composed limits (per-customer AND per-IP); repeat for several. The request is
    /// allowed only if every descriptor is.
    #[arg(long = "descriptor")]
    descriptors: Vec<String>,
    /// Charge nothing: fetch the cluster's rules and the key's owner from the ops port
    /// (--ops-addr) and print which rule would apply, with its numbers, and who decides.
    #[arg(long)]
    dry_run: bool,
    /// The ops HTTP address --dry-run asks.
    #[arg(long, default_value = DEFAULT_HTTP_LISTEN)]
    ops_addr: String,
    #[command(flatten)]
    tls: ClientTlsArgs,
}

/// TLS to a node serving its public face with `serve --tls-cert` (and, for
/// `--tls-client-ca`, a client certificate of that CA).
#[derive(clap::Args)]
struct ClientTlsArgs {
    /// Speak TLS, trusting this CA (PEM) for the node's certificate.
    #[arg(long, env = "RINGLIMIT_CHECK_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) to present, for a node started with --tls-client-ca.
    #[arg(long, env = "RINGLIMIT_CHECK_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "RINGLIMIT_CHECK_TLS_KEY", requires_all = ["tls_cert", "tls_ca"])]
    tls_key: Option<PathBuf>,
    /// The name the node's certificate must carry (default: the host of --addr).
    #[arg(long, requires = "tls_ca")]
    tls_server_name: Option<String>,
}

impl ClientTlsArgs {
    /// The client TLS configuration, or `None` for plaintext; an unreadable file is an
    /// error naming its flag.
    fn load(&self) -> anyhow::Result<Option<ClientTlsConfig>> {
        let Some(ca) = &self.tls_ca else {
            return Ok(None);
        };
        let read = |path: &PathBuf, flag: &str| {
            std::fs::read(path).with_context(|| format!("{flag} {}", path.display()))
        };
        let mut tls =
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(ca, "--tls-ca")?));
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            tls = tls.identity(Identity::from_pem(
                read(cert, "--tls-cert")?,
                read(key, "--tls-key")?,
            ));
        }
        if let Some(name) = &self.tls_server_name {
            tls = tls.domain_name(name.clone());
        }
        Ok(Some(tls))
    }
}

/// Asks the node; exits 0 when allowed, 1 when denied, 2 when refused or unreachable.
pub async fn run(args: CheckArgs) -> anyhow::Result<ExitCode> {
    if args.dry_run {
        let keys: Vec<&str> = std::iter::once(args.key.as_str())
            .chain(args.descriptors.iter().map(String::as_str))
            .collect();
        return dry_run(&args.ops_addr, &keys, &args.route, args.tier.as_deref()).await;
    }
    let tls = args.tls.load()?;
    if tls.is_none() && args.addr.starts_with("https://") {
        // Never fall back to plaintext for an address that asked for TLS.
        anyhow::bail!(
            "{}: TLS needs --tls-ca (the CA of the node's certificate)",
            args.addr
        );
    }
    let scheme = if tls.is_some() { "https" } else { "http" };
    let addr = match args.addr.split_once("://") {
        Some((_, rest)) => format!("{scheme}://{rest}"),
        None => format!("{scheme}://{}", args.addr),
    };
    let mut endpoint =
        Endpoint::from_shared(addr.clone()).with_context(|| format!("{addr} is not an address"))?;
    if let Some(tls) = tls {
        endpoint = endpoint
            .tls_config(tls)
            .context("the --tls-* files are not a usable TLS configuration")?;
    }
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
    let mut client = RateLimiterClient::new(channel);
    let request = CheckRequest {
        key: args.key,
        route: args.route,
        cost: args.cost,
        tier: args.tier,
        descriptors: args
            .descriptors
            .iter()
            .map(|key| ringlimit::proto::Descriptor {
                key: key.clone(),
                ..Default::default()
            })
            .collect(),
    };
    let answer = match client.check(request).await {
        Ok(answer) => answer.into_inner(),
        Err(status) => {
            eprintln!("refused ({:?}): {}", status.code(), status.message());
            return Ok(ExitCode::from(2));
        }
    };
    let now_ms = ringlimit::clock::Clock::now_ms(&ringlimit::clock::SystemClock);
    let code = if answer.allowed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&answer_json(&answer, now_ms, args.headers))?
        );
    } else {
        println!("{}", answer_line(&answer));
        if args.headers {
            for (name, value) in
                contract::headers(&quota(&answer), &answer.rule, answer.window_ms, now_ms)
            {
                println!("  {name}: {value}");
            }
        }
    }
    Ok(code)
}

/// The numbers of a wire answer that the 429 contract is rendered from.
fn quota(a: &CheckResponse) -> contract::Quota {
    contract::Quota {
        allowed: a.allowed,
        limit: a.limit,
        remaining: a.remaining,
        retry_after_ms: a.retry_after_ms,
        reset_at_ms: u64::try_from(a.reset_at).unwrap_or(0),
    }
}

/// The one-line form of an answer.
fn answer_line(a: &CheckResponse) -> String {
    let decider = a
        .decider
        .as_ref()
        .map(|d| format!("{}@{}", d.node_id, d.generation))
        .unwrap_or_default();
    let verdict = if a.allowed { "allowed" } else { "denied " };
    let mut line = format!(
        "{verdict} limit={} remaining={} retry_after_ms={} reset_at={} rule={} decider={decider} seq={}",
        a.limit, a.remaining, a.retry_after_ms, a.reset_at, a.rule, a.sequence
    );
    if !a.allowed {
        line.push_str(&format!(
            " (Retry-After: {} s)",
            contract::ceil_secs(a.retry_after_ms)
        ));
    }
    if a.delay_ms > 0 {
        line.push_str(&format!(" delay_ms={}", a.delay_ms));
    }
    if a.leased {
        // Decided from a budget lease the asked node holds (docs/leases.md).
        line.push_str(" leased");
    }
    line
}

/// The JSON form of an answer; 64-bit ids as strings.
fn answer_json(a: &CheckResponse, now_ms: u64, with_headers: bool) -> serde_json::Value {
    let descriptors: Vec<_> = a
        .descriptors
        .iter()
        .map(|d| {
            serde_json::json!({
                "key": d.key, "route": d.route, "allowed": d.allowed, "limit": d.limit,
                "remaining": d.remaining, "retry_after_ms": d.retry_after_ms,
                "reset_at": d.reset_at, "rule": d.rule, "algorithm": d.algorithm,
                "window_id": d.window_id.map(|w| w.to_string()), "sequence": d.sequence.to_string(), "refunded": d.refunded,
                "delay_ms": d.delay_ms, "leased": d.leased,
            })
        })
        .collect();
    let mut value = serde_json::json!({
        "allowed": a.allowed,
        "limit": a.limit,
        "remaining": a.remaining,
        "retry_after_ms": a.retry_after_ms,
        "retry_after_s": contract::ceil_secs(a.retry_after_ms),
        "reset_at": a.reset_at,
        "rule": a.rule,
        // 64-bit ids as strings: jq and JavaScript read JSON numbers as doubles, which
        // lose precision above 2^53 (a generation is ~1.8e18).
        "decider": a.decider.as_ref().map(|d| serde_json::json!({"node_id": d.node_id, "generation": d.generation.to_string()})),
        "window_id": a.window_id.map(|w| w.to_string()),
        "sequence": a.sequence.to_string(),
        "degraded": a.degraded,
        "leased": a.leased,
        "delay_ms": a.delay_ms,
        "descriptors": descriptors,
    });
    if with_headers {
        let headers: serde_json::Map<_, _> =
            contract::headers(&quota(a), &a.rule, a.window_ms, now_ms)
                .into_iter()
                .map(|(k, v)| (k.to_string(), serde_json::Value::String(v)))
                .collect();
        value["headers"] = serde_json::Value::Object(headers);
    }
    value
}

/// `ringlimit check --dry-run`: which rule each key's check would match (matched here,
/// with the cluster's rules as the ops port serves them) and which member would decide it;
/// nothing is charged. Exits 0, or 2 when the node cannot be asked or the input is bad.
pub async fn dry_run(
    addr: &str,
    keys: &[&str],
    route: &str,
    tier: Option<&str>,
) -> anyhow::Result<ExitCode> {
    let parsed = match ringlimit::config::Route::parse(route) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("refused: route: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    let answer = rules::get_rules_json(addr).await?;
    if answer.status != 200 {
        eprintln!("error: {} {}", answer.status, answer.error_message());
        return Ok(ExitCode::from(2));
    }
    let version = answer
        .header("etag")
        .unwrap_or("?")
        .trim_matches('"')
        .to_string();
    let rules = RuleSet::from_doc(RulesDoc::from_json_str(&answer.body)?)?;
    println!("dry run against rules version {version} (nothing charged):");
    for key in keys {
        let rule = rules.matching(key, tier, Some(&parsed));
        let owner = owner::ask(addr, key).await?;
        let owner = if owner.status == 200 {
            let v: serde_json::Value = serde_json::from_str(&owner.body)?;
            v["owner"]["node_id"].as_str().unwrap_or("?").to_string()
        } else {
            format!("? ({})", owner.error_message())
        };
        println!(
            "  key={key} rule={} (matched at level {}) algorithm={} limit={} window_ms={} decided by {owner}",
            rule.name,
            level_name(rule.level()),
            rule.spec.algorithm_name(),
            rule.spec.limit(),
            rule.spec.window().as_millis(),
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The precedence levels as docs/rules.md names them.
fn level_name(level: ringlimit::config::MatchLevel) -> &'static str {
    use ringlimit::config::MatchLevel as L;
    match level {
        L::ClientRoute => "client+route",
        L::Client => "client",
        L::TierRoute => "tier+route",
        L::Tier => "tier",
        L::Route => "route",
        L::Default => "default",
    }
}
