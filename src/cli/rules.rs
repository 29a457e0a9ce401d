//! `ringlimit rules check|get|put|diff`: validate a rule file locally; read, replace or
//! compare a cluster's rules through a node's ops port.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::Subcommand;
use ringlimit::algorithms::AlgorithmKind;
use ringlimit::config::rules::envoy::{
    domain_of, read_documents, EnvoyConfig, EnvoyConfigError, DEFAULT_SECTION_ALGORITHM,
};
use ringlimit::config::rules::{read_rules_file, DocEnvoy, DocRule, RuleSet, RulesDoc, RulesError};
use ringlimit::node::config::DEFAULT_HTTP_LISTEN;

use super::{block_on, http, parse_algorithm};

/// `ringlimit rules ...`.
#[derive(Subcommand)]
pub enum RulesCommand {
    /// Validate a rule file; prints every problem, naming rule and field.
    Check {
        /// The file.
        file: PathBuf,
    },
    /// Print a cluster's rules (TOML, or JSON with --json) with their version.
    Get {
        /// A node's ops HTTP address.
        #[arg(long, default_value = DEFAULT_HTTP_LISTEN)]
        addr: String,
        /// Print the JSON form.
        #[arg(long)]
        json: bool,
    },
    /// Replace a cluster's rules with a file (TOML, or JSON if it ends in .json).
    Put {
        /// The rule file (TOML, or JSON by its `.json` name): the whole document.
        #[arg(required_unless_present = "envoy")]
        file: Option<PathBuf>,
        /// envoyproxy/ratelimit YAML (a file, or a directory of `*.yaml` / `*.yml`, one
        /// domain each) for the `[envoy]` section: alone, it replaces only that section;
        /// with FILE, it replaces FILE's.
        #[arg(long)]
        envoy: Option<PathBuf>,
        /// The section's default algorithm (of a `rate_limit` without `algorithm`);
        /// default fixed_window.
        #[arg(long, value_parser = parse_algorithm, requires = "envoy")]
        envoy_algorithm: Option<ringlimit::algorithms::AlgorithmKind>,
        /// Let FILE (without an `[envoy]` section) remove the cluster's Envoy domains;
        /// without this flag such a put is refused and nothing is sent.
        #[arg(long, conflicts_with = "envoy", requires = "file")]
        drop_envoy: bool,
        /// A node's ops HTTP address.
        #[arg(long, default_value = DEFAULT_HTTP_LISTEN)]
        addr: String,
        /// The admin token file.
        #[arg(long, env = "RINGLIMIT_ADMIN_TOKEN_FILE")]
        admin_token_file: Option<PathBuf>,
        /// Only if the cluster's version is still this one (412 otherwise).
        #[arg(long)]
        if_match: Option<u64>,
    },
    /// Compare a file with a cluster's rules, rule by rule; exits 1 when they differ.
    Diff {
        /// The file.
        file: PathBuf,
        /// A node's ops HTTP address.
        #[arg(long, default_value = DEFAULT_HTTP_LISTEN)]
        addr: String,
    },
}

impl RulesCommand {
    /// Runs the subcommand.
    pub fn run(self) -> anyhow::Result<ExitCode> {
        match self {
            RulesCommand::Check { file } => check(&file),
            RulesCommand::Get { addr, json } => block_on(get(&addr, json)),
            RulesCommand::Put {
                file,
                envoy,
                envoy_algorithm,
                drop_envoy,
                addr,
                admin_token_file,
                if_match,
            } => block_on(put(
                file.as_deref(),
                envoy.as_deref().map(|p| (p, envoy_algorithm)),
                drop_envoy,
                &addr,
                admin_token_file.as_deref(),
                if_match,
            )),
            RulesCommand::Diff { file, addr } => block_on(diff_command(&file, &addr)),
        }
    }
}

/// `ringlimit rules check FILE`: exits 0 when valid, 1 with every problem otherwise.
fn check(file: &std::path::Path) -> anyhow::Result<ExitCode> {
    match RuleSet::load(file) {
        Ok(rules) => {
            match rules.envoy().domains().count() {
                0 => println!("{}: ok, {} rules", file.display(), rules.len()),
                domains => println!(
                    "{}: ok, {} rules, {domains} envoy domains",
                    file.display(),
                    rules.len()
                ),
            }
            // Which rules stop deciding on a side of a partition without a majority:
            // an operator should know before a partition tells them.
            let fenced: Vec<&str> = rules
                .rules()
                .iter()
                .filter(|r| r.is_fenced())
                .map(|r| &*r.name)
                .collect();
            if !fenced.is_empty() {
                println!(
                    "fenced in partitions (denied where a node sees no majority): {}",
                    fenced.join(", ")
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(error) => {
            eprintln!("{}: invalid\n{error}", file.display());
            Ok(ExitCode::from(1))
        }
    }
}

/// `ringlimit rules get`: the document with its version as a TOML comment (stdout stays a
/// valid rule file), or the JSON form.
async fn get(addr: &str, json: bool) -> anyhow::Result<ExitCode> {
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
async fn put(
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
    let request = match file {
        Some(file) => match whole_document(file, section, drop_envoy, addr, &mut if_match).await? {
            Ok(request) => request,
            Err(code) => return Ok(code),
        },
        None => PutRequest {
            path: "/v1/rules/envoy",
            content_type: "application/json",
            body: serde_json::to_vec(&section).expect("an envoy section serializes"),
        },
    };
    send_put(addr, request, token_file, if_match).await
}

/// What `rules put` sends: where, and the body with its type.
struct PutRequest {
    path: &'static str,
    content_type: &'static str,
    body: Vec<u8>,
}

/// A rule file to put, with `section` (from `--envoy`) spliced in if given; checked
/// first. `Err(code)` when it must not be sent (the reason is printed).
async fn whole_document(
    file: &Path,
    section: Option<DocEnvoy>,
    drop_envoy: bool,
    addr: &str,
    if_match: &mut Option<u64>,
) -> anyhow::Result<Result<PutRequest, ExitCode>> {
    let spliced = section.is_some();
    let RuleFile {
        bytes,
        is_json,
        doc,
    } = read_doc(file)?;
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
            return Ok(Err(ExitCode::from(1)));
        }
    };
    // A whole document replaces the cluster's, Envoy domains included: a rule file
    // without an [envoy] section would silently switch those limits off. Refuse that
    // unless asked for.
    if doc.envoy.is_none() && !drop_envoy {
        let (domains, version) = cluster_envoy_domains(addr).await?;
        // Put against the version just checked, so a section added meanwhile makes the
        // put fail (412) instead of being removed unseen.
        *if_match = if_match.or(version);
        if let Some(domains) = domains {
            eprintln!(
                "refused: the cluster's rule set has an [envoy] section ({domains} domains) that {} does not have: putting it would remove them. Add them with --envoy DIR, or pass --drop-envoy to remove them. Nothing was sent.",
                file.display()
            );
            return Ok(Err(ExitCode::from(1)));
        }
    }
    // Sent as the file was written unless a section was spliced in.
    let (content_type, body) = match (spliced, is_json) {
        (false, true) => ("application/json", bytes),
        (false, false) => ("application/toml", bytes),
        (true, _) => ("application/json", doc.to_json().into_bytes()),
    };
    Ok(Ok(PutRequest {
        path: "/v1/rules",
        content_type,
        body,
    }))
}

/// Sends a put with the admin token and `If-Match`; prints whether it changed anything.
async fn send_put(
    addr: &str,
    request: PutRequest,
    token_file: Option<&Path>,
    if_match: Option<u64>,
) -> anyhow::Result<ExitCode> {
    let mut headers = vec![("Content-Type", request.content_type.to_string())];
    if let Some(path) = token_file {
        let token =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let token = token.lines().next().unwrap_or("").trim().to_string();
        headers.push(("Authorization", format!("Bearer {token}")));
    }
    if let Some(v) = if_match {
        headers.push(("If-Match", format!("\"{v}\"")));
    }
    let answer = http::request(addr, "PUT", request.path, &headers, Some(&request.body)).await?;
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

/// A rule file as read: its bytes, whether it is JSON (by its `.json` name) and the
/// document parsed from it.
struct RuleFile {
    bytes: Vec<u8>,
    is_json: bool,
    doc: Result<RulesDoc, RulesError>,
}

/// Reads a rule file; an unreadable or non-UTF-8 file is the outer error.
fn read_doc(file: &Path) -> anyhow::Result<RuleFile> {
    let bytes = read_rules_file(file)?;
    let is_json = file.extension().is_some_and(|e| e == "json");
    let text = std::str::from_utf8(&bytes).context("the file is not UTF-8")?;
    let doc = if is_json {
        RulesDoc::from_json_str(text)
    } else {
        RulesDoc::from_toml_str(text)
    };
    Ok(RuleFile {
        bytes,
        is_json,
        doc,
    })
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
pub async fn get_rules_json(addr: &str) -> anyhow::Result<http::OpsResponse> {
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
async fn diff_command(file: &Path, addr: &str) -> anyhow::Result<ExitCode> {
    let local = read_doc(file)?.doc?;
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

/// A value as one line of JSON.
fn compact(value: &impl serde::Serialize) -> String {
    serde_json::to_string(value).unwrap_or_default()
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
