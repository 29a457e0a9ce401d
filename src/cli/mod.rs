//! The rules and owner commands: clients of a node's ops HTTP port.

mod http;

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use ringlimit::algorithms::AlgorithmKind;
use ringlimit::config::rules::envoy::{
    domain_of, read_documents, EnvoyConfig, EnvoyConfigError, DEFAULT_SECTION_ALGORITHM,
};
use ringlimit::config::rules::{read_rules_file, DocEnvoy, DocRule, RuleSet, RulesDoc};

/// `ringlimit rules get`: the document with its version as a TOML comment (stdout stays a
/// valid rule file), or the JSON form.
pub async fn rules_get(addr: &str, json: bool) -> anyhow::Result<ExitCode> {
    let accept = if json {
        "application/json"
    } else {
        "application/toml"
    };
    let answer =
        http::request(addr, "GET", "/v1/rules", &[("Accept", accept.into())], None).await?;
    if answer.status != 200 {
        eprintln!("error: {} {}", answer.status, answer.error_message());
        return Ok(ExitCode::from(2));
    }
    let version = answer
        .header("etag")
        .unwrap_or("?")
        .trim_matches('"')
        .to_string();
    let digest = answer.header("x-ringlimit-rules-digest").unwrap_or("?");
    let source = answer.header("x-ringlimit-rules-source").unwrap_or("?");
    if json {
        print!("{}", answer.body);
    } else {
        println!("# rules version {version}, digest {digest}, source {source} (from {addr})");
        print!("{}", answer.body);
    }
    eprintln!("version {version} digest {digest} source {source}");
    Ok(ExitCode::SUCCESS)
}

/// `ringlimit rules put [FILE] [--envoy PATH]`: checked locally first (same messages as
/// `rules check` and `--envoy-config`), then sent; exits 0 when accepted, 1 when refused
/// (the node's message is printed).
///
/// FILE alone replaces the whole document; `--envoy PATH` (a YAML file or a directory of
/// them, one domain each) alone replaces only its `[envoy]` section, every TOML rule kept
/// as the cluster has it; both send FILE with its `[envoy]` section taken from PATH.
pub async fn rules_put(
    file: Option<&Path>,
    envoy: Option<(&Path, Option<AlgorithmKind>)>,
    drop_envoy: bool,
    addr: &str,
    token_file: Option<&Path>,
    mut if_match: Option<u64>,
) -> anyhow::Result<ExitCode> {
    let section = match envoy {
        None => None,
        Some((path, algorithm)) => match envoy_section(path, algorithm)? {
            Ok(section) => Some(section),
            Err(error) => {
                eprintln!("{}: invalid\n{error}", path.display());
                return Ok(ExitCode::from(1));
            }
        },
    };
    let (path, content_type, body) = match file {
        Some(file) => {
            let bytes = read_rules_file(file)?;
            let is_json = file.extension().is_some_and(|e| e == "json");
            let text = std::str::from_utf8(&bytes).context("the file is not UTF-8")?;
            let doc = if is_json {
                RulesDoc::from_json_str(text)
            } else {
                RulesDoc::from_toml_str(text)
            };
            let doc = match (doc, section) {
                (Ok(doc), Some(envoy)) => Ok(RulesDoc {
                    envoy: Some(envoy),
                    ..doc
                }),
                (doc, None) => doc,
                (Err(e), _) => Err(e),
            };
            let doc = match doc.and_then(|doc| RuleSet::from_doc(doc.clone()).map(|_| doc)) {
                Ok(doc) => doc,
                Err(error) => {
                    eprintln!("{}: invalid\n{error}", file.display());
                    return Ok(ExitCode::from(1));
                }
            };
            // A whole document replaces the cluster's, Envoy domains included: a rule
            // file written before the domains moved into the rule set would silently
            // switch those limits off. Refuse that unless asked for.
            if doc.envoy.is_none() && !drop_envoy {
                let (domains, version) = cluster_envoy_domains(addr).await?;
                // Put against the version just checked, so a section added meanwhile
                // makes the put fail (412) instead of being removed unseen.
                if_match = if_match.or(version);
                if let Some(domains) = domains {
                    eprintln!(
                        "refused: the cluster's rule set has an [envoy] section ({domains} domains) that {} does not have: putting it would remove them. Add them with --envoy DIR, or pass --drop-envoy to remove them. Nothing was sent.",
                        file.display()
                    );
                    return Ok(ExitCode::from(1));
                }
            }
            // Sent as the file was written unless a section was spliced in.
            match (envoy, is_json) {
                (None, true) => ("/v1/rules", "application/json", bytes),
                (None, false) => ("/v1/rules", "application/toml", bytes),
                (Some(_), _) => ("/v1/rules", "application/json", doc.to_json().into_bytes()),
            }
        }
        None => {
            let body = serde_json::to_vec(&section).expect("an envoy section serializes");
            ("/v1/rules/envoy", "application/json", body)
        }
    };
    let mut headers = vec![("Content-Type", content_type.to_string())];
    if let Some(path) = token_file {
        let token =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let token = token.lines().next().unwrap_or("").trim().to_string();
        headers.push(("Authorization", format!("Bearer {token}")));
    }
    if let Some(v) = if_match {
        headers.push(("If-Match", format!("\"{v}\"")));
    }
    let answer = http::request(addr, "PUT", path, &headers, Some(&body)).await?;
    if answer.status != 200 {
        eprintln!("refused: {} {}", answer.status, answer.error_message());
        return Ok(ExitCode::from(1));
    }
    let body: serde_json::Value = serde_json::from_str(&answer.body).unwrap_or_default();
    println!(
        "{}: version {} digest {}",
        if body["changed"].as_bool() == Some(true) {
            "accepted"
        } else {
            "unchanged"
        },
        body["version"],
        body["digest"].as_str().unwrap_or("?")
    );
    Ok(ExitCode::SUCCESS)
}

/// How many Envoy domains the cluster's rule set at `addr` holds, if it has an
/// `[envoy]` section with any, and the version read (its ETag).
async fn cluster_envoy_domains(addr: &str) -> anyhow::Result<(Option<usize>, Option<u64>)> {
    let answer = get_rules_json(addr).await?;
    anyhow::ensure!(
        answer.status == 200,
        "reading the cluster's rules: {} {}",
        answer.status,
        answer.error_message()
    );
    let remote = RulesDoc::from_json_str(&answer.body)?;
    let version = answer
        .header("etag")
        .and_then(|v| v.trim_matches('"').parse().ok());
    let domains = remote
        .envoy
        .map(|section| section.domains.len())
        .filter(|n| *n > 0);
    Ok((domains, version))
}

/// `GET /v1/rules` as JSON from the node at `addr`.
async fn get_rules_json(addr: &str) -> anyhow::Result<http::Answer> {
    http::request(
        addr,
        "GET",
        "/v1/rules",
        &[("Accept", "application/json".into())],
        None,
    )
    .await
}

/// The `[envoy]` section of the YAML at `path`, checked with the `--envoy-config`
/// parser (errors name the file, key and line); the outer error is an unreadable path.
fn envoy_section(
    path: &Path,
    algorithm: Option<AlgorithmKind>,
) -> anyhow::Result<Result<DocEnvoy, EnvoyConfigError>> {
    let texts = match read_documents(path) {
        Ok(texts) => texts,
        Err(error) => return Ok(Err(error)),
    };
    let docs: Vec<(&Path, &str)> = texts
        .iter()
        .map(|(p, t)| (p.as_path(), t.as_str()))
        .collect();
    let default = algorithm.unwrap_or(DEFAULT_SECTION_ALGORITHM);
    if let Err(error) = EnvoyConfig::from_documents(&docs, default) {
        return Ok(Err(error));
    }
    Ok(Ok(DocEnvoy {
        algorithm: algorithm.map(|a| a.as_str().to_string()),
        domains: texts.into_iter().map(|(_, text)| text).collect(),
    }))
}

/// `ringlimit rules diff FILE`: rule by rule, what the cluster has that the file has not
/// (`-`), what the file would add (`+`) and what it would change (`~`); exits 0 when
/// equal, 1 when they differ.
pub async fn rules_diff(file: &Path, addr: &str) -> anyhow::Result<ExitCode> {
    let bytes = read_rules_file(file)?;
    let text = std::str::from_utf8(&bytes).context("the file is not UTF-8")?;
    let local = if file.extension().is_some_and(|e| e == "json") {
        RulesDoc::from_json_str(text)?
    } else {
        RulesDoc::from_toml_str(text)?
    };
    let answer = get_rules_json(addr).await?;
    if answer.status != 200 {
        eprintln!("error: {} {}", answer.status, answer.error_message());
        return Ok(ExitCode::from(2));
    }
    let remote = RulesDoc::from_json_str(&answer.body)?;
    let lines = diff(&remote, &local);
    let version = answer
        .header("etag")
        .unwrap_or("?")
        .trim_matches('"')
        .to_string();
    if lines.is_empty() {
        println!(
            "{} matches the cluster's rules (version {version})",
            file.display()
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!("cluster (version {version}) → {}:", file.display());
    for line in lines {
        println!("{line}");
    }
    Ok(ExitCode::from(1))
}

/// The differences between two documents, by rule name and field, and by Envoy domain.
fn diff(from: &RulesDoc, to: &RulesDoc) -> Vec<String> {
    let mut out = Vec::new();
    changed(&mut out, "[default]", &from.default, &to.default);
    let rules = |doc: &RulesDoc| -> Vec<(String, DocRule)> {
        doc.rule
            .iter()
            .map(|r| (r.name.clone().unwrap_or_default(), r.clone()))
            .collect()
    };
    keyed_diff(&mut out, "rule", &rules(from), &rules(to));
    let none = DocEnvoy::default();
    let (from, to) = (
        from.envoy.as_ref().unwrap_or(&none),
        to.envoy.as_ref().unwrap_or(&none),
    );
    changed(
        &mut out,
        "[envoy] algorithm",
        &from.algorithm,
        &to.algorithm,
    );
    // Domains are named by their `domain` (a text that names none, by its place).
    let domains = |section: &DocEnvoy| -> Vec<(String, String)> {
        section
            .domains
            .iter()
            .enumerate()
            .map(|(i, t)| (domain_of(t).unwrap_or_else(|| format!("#{i}")), t.clone()))
            .collect()
    };
    keyed_diff(&mut out, "envoy domain", &domains(from), &domains(to));
    out
}

/// `~ what: old → new` when the two differ.
fn changed<T: PartialEq + serde::Serialize>(out: &mut Vec<String>, what: &str, from: &T, to: &T) {
    if from != to {
        out.push(format!("~ {what}: {} → {}", compact(from), compact(to)));
    }
}

/// Named items matched by name: `- what "name": old`, `~ … old → new`, `+ … new`.
fn keyed_diff<T: PartialEq + serde::Serialize>(
    out: &mut Vec<String>,
    what: &str,
    from: &[(String, T)],
    to: &[(String, T)],
) {
    for (name, old) in from {
        match to.iter().find(|(n, _)| n == name) {
            None => out.push(format!("- {what} {name:?}: {}", compact(old))),
            Some((_, new)) => changed(out, &format!("{what} {name:?}"), old, new),
        }
    }
    for (name, new) in to {
        if !from.iter().any(|(n, _)| n == name) {
            out.push(format!("+ {what} {name:?}: {}", compact(new)));
        }
    }
}

fn compact(value: &impl serde::Serialize) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

/// `ringlimit owner --key K`.
pub async fn owner(key: &str, addr: &str) -> anyhow::Result<ExitCode> {
    let mut encoded = String::new();
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            encoded.push(b as char);
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    let answer = http::request(addr, "GET", &format!("/v1/owner?key={encoded}"), &[], None).await?;
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
    let answer = http::request(
        addr,
        "GET",
        "/v1/rules",
        &[("Accept", "application/json".into())],
        None,
    )
    .await?;
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
        let mut encoded = String::new();
        for b in key.bytes() {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                encoded.push(b as char);
            } else {
                encoded.push_str(&format!("%{b:02X}"));
            }
        }
        let owner =
            http::request(addr, "GET", &format!("/v1/owner?key={encoded}"), &[], None).await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diff_names_removed_added_and_changed_rules() {
        let a = RulesDoc::from_toml_str("[[rule]]\nname = \"x\"\ntier = \"t\"\nlimit = 1\nwindow = \"1s\"\n[[rule]]\nname = \"y\"\ntier = \"u\"\nlimit = 1\nwindow = \"1s\"\n").unwrap();
        let b = RulesDoc::from_toml_str("[[rule]]\nname = \"x\"\ntier = \"t\"\nlimit = 2\nwindow = \"1s\"\n[[rule]]\nname = \"z\"\ntier = \"v\"\nlimit = 1\nwindow = \"1s\"\n").unwrap();
        let lines = diff(&a, &b);
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(lines[0].starts_with("~ rule \"x\""));
        assert!(lines[1].starts_with("- rule \"y\""));
        assert!(lines[2].starts_with("+ rule \"z\""));
        assert!(diff(&a, &a).is_empty());
    }
}
