//! The README and the user guide (`docs/`, an mdBook) are tested like code:
//!
//! - every fenced `sh` block runs, page by page, against real nodes, in a fresh network
//!   namespace so that the default ports are free (a block that cannot run there is
//!   marked `sh,illustrative`);
//! - every `toml` block loads as a rule file and every `yaml` block parses, one with a
//!   top-level `domain` as envoyproxy/ratelimit configuration, through the node's own
//!   loaders (a fragment is marked `toml,illustrative` / `yaml,illustrative`);
//! - every relative link, and every `#anchor` into a Markdown page, resolves;
//! - the pages state no history (dates, commit hashes, issue numbers);
//! - the README's test command is the one CI runs.
//!
//! `docs/testing.md` describes the conventions for writers.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every Markdown page under docs/, sorted.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    let mut stack = vec![root().join("docs")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("reading docs/") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    pages.sort();
    pages
}

fn relative(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .to_string_lossy()
        .into_owned()
}

/// One fenced code block.
struct Block {
    /// The language: the info string's first word (`sh` of `sh,illustrative`).
    lang: String,
    illustrative: bool,
    /// 1-based line of the opening fence.
    line: usize,
    text: String,
}

/// The fenced blocks of a Markdown page (fences may be indented, as in a list item).
fn blocks(markdown: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<(Block, usize, String)> = None; // block, indent, fence
    for (index, line) in markdown.lines().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        match open.as_mut() {
            None => {
                let fence: String = trimmed.chars().take_while(|&c| c == '`').collect();
                if fence.len() >= 3 {
                    let info = trimmed[fence.len()..].trim();
                    let mut words = info.split([',', ' ']).filter(|w| !w.is_empty());
                    let lang = words.next().unwrap_or("").to_string();
                    let illustrative = info.split([',', ' ']).any(|w| w == "illustrative");
                    open = Some((
                        Block {
                            lang,
                            illustrative,
                            line: index + 1,
                            text: String::new(),
                        },
                        indent,
                        fence,
                    ));
                }
            }
            Some((block, indent_of_fence, fence)) => {
                if trimmed.starts_with(fence.as_str())
                    && trimmed.trim_end().chars().all(|c| c == '`')
                {
                    let (block, _, _) = open.take().expect("an open block");
                    out.push(block);
                } else {
                    let cut = (*indent_of_fence).min(indent);
                    block.text.push_str(&line[cut..]);
                    block.text.push('\n');
                }
            }
        }
    }
    assert!(open.is_none(), "a code fence is never closed");
    out
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn is_shell(lang: &str) -> bool {
    matches!(lang, "sh" | "bash" | "shell")
}

// ---------------------------------------------------------------- shell blocks

/// Whether `tool` is on the PATH.
fn installed(tool: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The tools a page says it needs beyond the harness's own
/// (`<!-- docs-test: needs prometheus promtool -->`).
fn page_needs(markdown: &str) -> Vec<String> {
    markdown
        .lines()
        .filter_map(|l| l.trim().strip_prefix("<!-- docs-test: needs "))
        .flat_map(|rest| rest.trim_end_matches("-->").split_whitespace())
        .map(str::to_string)
        .collect()
}

/// Why the shell examples cannot run here, if they cannot.
fn cannot_run_shell_examples() -> Option<String> {
    let as_root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if !as_root {
        return Some("not root: a network namespace needs it".into());
    }
    ["unshare", "ip", "curl", "openssl"]
        .into_iter()
        .find(|tool| !installed(tool))
        .map(|tool| format!("{tool} is not installed"))
}

/// The script that runs a page's shell blocks: a node with default flags first unless
/// the page starts its own, then each block in order, announced by its line.
fn page_script(page: &str, markdown: &str, runnable: &[&Block]) -> String {
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_ringlimit"))
        .parent()
        .expect("the binary's directory")
        .display()
        .to_string();
    let mut script = format!(
        "set -eu\nip link set lo up\nexport PATH='{bin_dir}':\"$PATH\"\nexport NO_COLOR=1\n"
    );
    if !markdown.contains("<!-- docs-test: own-nodes -->") {
        script.push_str(
            "echo '== harness: ringlimit serve (default flags)'\n\
             ringlimit serve > default-node.out 2> default-node.err &\n\
             until grep -q '^ringlimit ready' default-node.out; do sleep 0.1; done\n",
        );
    }
    for block in runnable {
        script.push_str(&format!("echo '== {page}:{}'\n", block.line));
        script.push_str(&block.text);
    }
    script.push_str("echo '== done'\n");
    script
}

/// Runs `script` in a fresh network and PID namespace (every process it starts dies
/// with it), in an empty directory, for at most `limit`.
fn run_in_namespace(script: &str, limit: Duration) -> (bool, String) {
    let dir = tempfile::tempdir().expect("a scratch directory");
    let path = dir.path().join("page.sh");
    std::fs::write(&path, script).expect("writing the script");
    // Pages run "from the root of a checkout": what they read from it is there.
    for shared in ["deploy", "examples"] {
        std::os::unix::fs::symlink(root().join(shared), dir.path().join(shared))
            .expect("linking the checkout into the scratch directory");
    }
    let mut child = Command::new("unshare")
        .args(["--net", "--pid", "--fork", "--kill-child", "bash"])
        .arg(&path)
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting unshare");
    let mut stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let out = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let err = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the page") {
            break Some(status);
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = format!(
        "--- stdout\n{}--- stderr\n{}",
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default()
    );
    match status {
        Some(status) => (status.success(), output),
        None => (false, format!("timed out after {limit:?}\n{output}")),
    }
}

#[test]
fn shell_examples_run_against_real_nodes() {
    if let Some(reason) = cannot_run_shell_examples() {
        println!("SKIPPED: the guide's shell examples ({reason})");
        return;
    }
    let mut runs = Vec::new();
    for page in pages() {
        let markdown = read(&page);
        let all = blocks(&markdown);
        let runnable: Vec<&Block> = all
            .iter()
            .filter(|b| is_shell(&b.lang) && !b.illustrative)
            .collect();
        if runnable.is_empty() {
            continue;
        }
        let missing: Vec<String> = page_needs(&markdown)
            .into_iter()
            .filter(|tool| !installed(tool))
            .collect();
        if !missing.is_empty() {
            println!(
                "SKIPPED: {}'s shell examples ({} not installed)",
                relative(&page),
                missing.join(", ")
            );
            continue;
        }
        for block in &runnable {
            assert!(
                !block.text.contains("cargo "),
                "{}:{}: a runnable block must not run cargo (use `ringlimit`, or mark it sh,illustrative)",
                relative(&page),
                block.line
            );
        }
        let name = relative(&page);
        let script = page_script(&name, &markdown, &runnable);
        runs.push(std::thread::spawn(move || {
            let (ok, output) = run_in_namespace(&script, Duration::from_secs(240));
            (name, ok, output)
        }));
    }
    assert!(
        runs.len() >= 3,
        "only {} pages with shell examples",
        runs.len()
    );
    let mut failed = Vec::new();
    for run in runs {
        let (name, ok, output) = run.join().expect("a page's thread");
        if !ok {
            failed.push(format!("{name}: its shell examples failed\n{output}"));
        } else if std::env::var_os("RINGLIMIT_DOCS_SHOW").is_some() {
            println!("{name}: shell examples ran\n{output}");
        } else {
            println!("{name}: shell examples ran");
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
}

#[test]
fn a_failing_example_fails_the_page() {
    if let Some(reason) = cannot_run_shell_examples() {
        println!("SKIPPED: the guide's shell examples ({reason})");
        return;
    }
    let page = "```sh\nringlimit check --key \"\" --route /x\n```\n";
    let all = blocks(page);
    let runnable: Vec<&Block> = all.iter().collect();
    let script = page_script("planted.md", page, &runnable);
    let (ok, output) = run_in_namespace(&script, Duration::from_secs(60));
    assert!(
        !ok,
        "a refused check exits 2, which must fail the page:\n{output}"
    );
    assert!(output.contains("== planted.md:1"), "{output}");
}

#[test]
fn code_blocks_are_recognised() {
    let page = "text\n```sh,illustrative\na\n```\n- item\n\n  ```toml\n  x = 1\n  ```\n";
    let found = blocks(page);
    assert_eq!(found.len(), 2);
    assert_eq!(found[0].lang, "sh");
    assert!(found[0].illustrative);
    assert_eq!(found[1].lang, "toml");
    assert!(!found[1].illustrative);
    assert_eq!(found[1].text, "x = 1\n");
    assert_eq!(found[1].line, 7);
}

// ---------------------------------------------------------------- TOML and YAML

#[test]
fn toml_examples_load_as_rule_files() {
    let dir = tempfile::tempdir().expect("a scratch directory");
    let mut loaded = 0;
    for page in pages() {
        for block in blocks(&read(&page)) {
            if block.lang != "toml" || block.illustrative {
                continue;
            }
            let file = dir.path().join(format!("rules-{loaded}.toml"));
            std::fs::write(&file, &block.text).expect("writing the example");
            if let Err(error) = ringlimit::config::rules::RuleSet::load(&file) {
                panic!(
                    "{}:{}: the TOML example does not load as a rule file (mark a fragment toml,illustrative):\n{error}",
                    relative(&page),
                    block.line
                );
            }
            loaded += 1;
        }
    }
    assert!(loaded >= 2, "only {loaded} TOML examples");
}

#[test]
fn a_broken_toml_example_is_refused() {
    let dir = tempfile::tempdir().expect("a scratch directory");
    let file = dir.path().join("rules.toml");
    std::fs::write(
        &file,
        "[[rule]]\nname = \"x\"\nlimit = 0\nwindow = \"1m\"\n",
    )
    .expect("write");
    assert!(ringlimit::config::rules::RuleSet::load(&file).is_err());
}

#[test]
fn yaml_examples_parse_and_envoy_ones_load() {
    let mut parsed = 0;
    let mut envoy = 0;
    for page in pages() {
        for block in blocks(&read(&page)) {
            if block.lang != "yaml" || block.illustrative {
                continue;
            }
            let place = format!("{}:{}", relative(&page), block.line);
            for document in serde_norway::Deserializer::from_str(&block.text) {
                let value: serde_norway::Value = serde::Deserialize::deserialize(document)
                    .unwrap_or_else(|e| panic!("{place}: the YAML example does not parse: {e}"));
                parsed += 1;
                if value.get("domain").is_some() {
                    let text = serde_norway::to_string(&value).expect("re-encoding");
                    if let Err(error) = ringlimit::config::rules::envoy::EnvoyConfig::from_yaml_str(
                        &text,
                        ringlimit::algorithms::AlgorithmKind::FixedWindow,
                    ) {
                        panic!("{place}: not a valid envoyproxy/ratelimit configuration: {error}");
                    }
                    envoy += 1;
                }
            }
        }
    }
    assert!(parsed >= 5, "only {parsed} YAML documents");
    assert!(envoy >= 1, "only {envoy} Envoy configurations");
}

// ---------------------------------------------------------------- links

/// The anchor a heading gets (GitHub's and mdBook's rule): lower case, letters, digits,
/// `-` and `_` kept, spaces to `-`, everything else dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a page's headings (outside code blocks), with `-1`, `-2` for repeats.
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut in_code = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let text = heading.trim_start_matches('#');
        if !text.starts_with(' ') {
            continue;
        }
        let base = slug(text);
        let mut anchor = base.clone();
        let mut n = 1;
        while seen.contains(&anchor) {
            anchor = format!("{base}-{n}");
            n += 1;
        }
        seen.insert(anchor);
    }
    seen
}

/// Inline link targets `](target)` outside code blocks and code spans.
fn links(markdown: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut in_code = false;
    for (index, line) in markdown.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        // Drop code spans, then find `](`.
        let mut text = String::new();
        let mut in_span = false;
        for c in line.chars() {
            if c == '`' {
                in_span = !in_span;
            } else if !in_span {
                text.push(c);
            }
        }
        let mut rest = text.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push((index + 1, after[..end].trim().to_string()));
            rest = &after[end..];
        }
    }
    out
}

/// `path` with `.` and `..` resolved, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[test]
fn relative_links_and_anchors_resolve() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let markdown = read(&page);
        for (line, target) in links(&markdown) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let file = if path.is_empty() {
                page.clone()
            } else {
                page.parent().expect("a page's directory").join(path)
            };
            let place = format!("{}:{line}: {target}", relative(&page));
            // The book is built from docs/ alone: a link out of it is a dead link there.
            let docs = root().join("docs");
            if page.starts_with(&docs) && !normalize(&file).starts_with(&docs) {
                broken.push(format!(
                    "{place} (leaves docs/: the built book has no such page; name the file as code)"
                ));
                continue;
            }
            if !file.exists() {
                broken.push(format!("{place} (no such file)"));
                continue;
            }
            if let Some(anchor) = anchor {
                if file.extension().is_some_and(|e| e == "md")
                    && !anchors(&read(&file)).contains(anchor)
                {
                    broken.push(format!("{place} (no such heading)"));
                }
            }
        }
    }
    assert!(checked > 50, "only {checked} links checked");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn a_broken_link_is_found() {
    let page = "# Title\n\n## Two words\n\nSee [x](#two-words), [y](#nowhere) and `[z](#code)`.\n";
    let found = links(page);
    assert_eq!(
        found,
        vec![(5, "#two-words".to_string()), (5, "#nowhere".to_string())]
    );
    let known = anchors(page);
    assert!(known.contains("two-words"));
    assert!(!known.contains("nowhere"));
    assert_eq!(
        slug("Matching (as envoyproxy/ratelimit)"),
        "matching-as-envoyproxyratelimit"
    );
}

// ---------------------------------------------------------------- history

/// Words before "session" that make it a session of work rather than a protocol's.
const WHEN: &[&str] = &[
    "previous", "this", "last", "next", "earlier", "later", "that", "same", "one", "work", "each",
    "every", "another", "helper",
];

/// Words that date a page: `2026-12-04`, `issue 23`, `at 56fbe96`, `previous session`. (Another
/// project's `issue #1060` is a reference, not history.)
fn history_in(line: &str) -> Option<String> {
    let lower = line.to_lowercase();
    for (at, _) in lower.match_indices("issue ") {
        if lower[at + 6..].starts_with(|c: char| c.is_ascii_digit()) {
            return Some(format!(
                "an issue number ({})",
                &line[at..(at + 9).min(line.len())]
            ));
        }
    }
    let words: Vec<&str> = line
        .split(|c: char| !c.is_alphanumeric() && c != '-')
        .filter(|w| !w.is_empty())
        .collect();
    for (i, word) in words.iter().enumerate() {
        let parts: Vec<&str> = word.split('-').collect();
        if parts.len() == 3
            && parts[0].len() == 4
            && parts[1].len() == 2
            && parts[2].len() == 2
            && parts.iter().all(|p| p.chars().all(|c| c.is_ascii_digit()))
        {
            return Some(format!("a date ({word})"));
        }
        let previous = if i > 0 { words[i - 1] } else { "" };
        let hexlike = (7..=12).contains(&word.len())
            && word
                .chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
            && word.chars().any(|c| c.is_ascii_digit())
            && word.chars().any(|c| c.is_ascii_alphabetic());
        if hexlike
            && matches!(
                previous,
                "at" | "of" | "commit" | "build" | "against" | "and"
            )
        {
            return Some(format!("a commit hash ({previous} {word})"));
        }
        // A session of work ("the previous session"), not the peer link's `session`
        // module: only a word that places it in time makes it history.
        if (word.eq_ignore_ascii_case("session") || word.eq_ignore_ascii_case("sessions"))
            && WHEN.contains(&previous.to_lowercase().as_str())
        {
            return Some("a work session".into());
        }
    }
    None
}

#[test]
fn readme_and_guide_state_no_history() {
    let mut found = Vec::new();
    for page in pages() {
        let name = relative(&page);
        for (index, line) in read(&page).lines().enumerate() {
            if let Some(what) = history_in(line) {
                found.push(format!("{name}:{}: {what}", index + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "history belongs in git, figures in bench/RESULTS.md:\n{}",
        found.join("\n")
    );
}

#[test]
fn history_is_recognised() {
    assert!(history_in("measured 2026-12-04 on the machine").is_some());
    assert!(history_in("the chaos tests of issue 4").is_some());
    assert!(history_in("passed at 56fbe96, idle").is_some());
    assert!(history_in("a release build of c534e6b").is_some());
    assert!(history_in("digest 60931fee3a8856fa, source cluster").is_none());
    assert!(history_in("its issue #1060").is_none());
    assert!(history_in("done in the previous session").is_some());
    assert!(history_in("left for a later session, see").is_some());
    assert!(history_in("the peer link's batcher and session, handoff").is_none());
    assert!(history_in("limit 1000000 per day").is_none());
}

// ---------------------------------------------------------------- the two commands

#[test]
fn the_readme_test_command_is_the_one_ci_runs() {
    let command = "cargo test --no-fail-fast";
    let readme = read(&root().join("README.md"));
    let ci = read(&root().join(".ci/run"));
    let top: String = readme.lines().take(15).collect::<Vec<_>>().join("\n");
    assert!(
        top.contains(command),
        "README's first lines lack `{command}`"
    );
    assert!(
        top.contains("-- serve"),
        "README's first lines lack the command that runs a node"
    );
    assert!(
        ci.lines().any(|l| l.trim() == command),
        ".ci/run does not run `{command}`"
    );
    assert!(readme.lines().count() <= 200, "README.md is over 200 lines");
}
