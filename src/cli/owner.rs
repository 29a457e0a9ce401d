//! `ringlimit owner --key K`: which member owns a client key, asked on a node's ops port
//! (charges nothing).

use std::process::ExitCode;

use super::http;

/// `ringlimit owner --key K`.
pub async fn run(key: &str, addr: &str) -> anyhow::Result<ExitCode> {
    let answer = ask(addr, key).await?;
    if answer.status != 200 {
        eprintln!("error: {} {}", answer.status, answer.error_message());
        return Ok(ExitCode::from(2));
    }
    let v: serde_json::Value = serde_json::from_str(&answer.body)?;
    println!(
        "{} is owned by {}@{} (grpc {}), ring digest {}",
        key,
        v["owner"]["node_id"].as_str().unwrap_or("?"),
        v["owner"]["generation"].as_str().unwrap_or("?"),
        v["owner"]["grpc_addr"].as_str().unwrap_or("?"),
        v["ring_digest"].as_str().unwrap_or("?"),
    );
    Ok(ExitCode::SUCCESS)
}

/// `GET /v1/owner?key=…` from the ops port at `addr`, the key percent-encoded.
pub async fn ask(addr: &str, key: &str) -> anyhow::Result<http::OpsResponse> {
    let mut encoded = String::new();
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            encoded.push(b as char);
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    http::request(addr, "GET", &format!("/v1/owner?key={encoded}"), &[], None).await
}
