//! The floors of `src/lib.rs`, held to: every `crate::` path in a module's code (its
//! tests aside) names only a floor that module may import. A new arrow upward (a shard
//! reaching for the router, a policy reaching for a prost type) fails here, so the map
//! in `lib.rs` stays the truth rather than a wish.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Each top-level module and the internal modules its code may name. `ring` is a crate
/// of its own (`ringlimit_ring`), so it never shows up as `crate::ring` below `lib.rs`'s
/// re-export; it is allowed wherever it is used.
const FLOORS: &[(&str, &[&str])] = &[
    ("algorithms", &[]),
    ("keyring", &[]),
    ("text", &[]),
    ("clock", &["algorithms"]),
    ("config", &["algorithms"]),
    ("membership", &["clock", "keyring", "ring"]),
    ("shard", &["algorithms", "clock", "config", "ring"]),
    (
        "cluster",
        &[
            "algorithms",
            "clock",
            "config",
            "keyring",
            "membership",
            "ring",
            "shard",
            "proto",
            "text",
        ],
    ),
    (
        "check",
        &[
            "algorithms",
            "clock",
            "cluster",
            "config",
            "membership",
            "ring",
            "shard",
        ],
    ),
    (
        "server",
        &[
            "algorithms",
            "check",
            "clock",
            "cluster",
            "config",
            "keyring",
            "membership",
            "proto",
            "ring",
            "shard",
            "text",
        ],
    ),
    // The generated code names the codec `build.rs` wires in, and its docs name the
    // answers that codec encodes: `proto` sits beside the floors, used by the adapters.
    // The peer messages hand-written for slices (`cluster::link::item`, `key_state`)
    // are re-exported under their proto names.
    ("proto", &["server", "cluster"]),
    // The composition root may name every floor; it is listed for its prost rule below.
    (
        "node",
        &[
            "algorithms",
            "check",
            "clock",
            "cluster",
            "config",
            "keyring",
            "membership",
            "proto",
            "ring",
            "server",
            "shard",
        ],
    ),
];

/// Floors that may name `proto` only in some files: their adapters.
/// Inside `cluster`, only the peer client adapter's shell and wire files (the
/// hand-written messages among them) see prost types: the batcher, the session and every policy speak domain types. Inside `node`,
/// the faces register the generated services, and the xDS client's adapter (messages and
/// stream) converts to the session's types; its shell (`xds/mod.rs`) and the session
/// (`config::xds`) never see a prost type.
const PROTO_ADAPTERS: &[(&str, &[&str])] = &[
    (
        "cluster",
        &[
            "link/wire.rs",
            "link/item.rs",
            "link/key_state.rs",
            "link/calls.rs",
            "link/budget.rs",
            "link/stream.rs",
            "link/pool.rs",
        ],
    ),
    ("node", &["faces.rs", "xds/wire.rs", "xds/stream.rs"]),
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without its inline tests (tests may reach anywhere).
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

/// The top-level modules named by `crate::x` paths in `text`.
fn named(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (at, _) in text.match_indices("crate::") {
        // `ringlimit_ring::`-style paths end in "crate::" too only if preceded by an
        // identifier character; those are other crates.
        let before = text[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &text[at + "crate::".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_' || c.is_ascii_digit())
            .collect();
        if !name.is_empty() {
            out.insert(name);
        }
    }
    out
}

#[test]
fn every_floor_imports_only_the_floors_below_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut wrong = Vec::new();
    for (floor, allowed) in FLOORS {
        let mut files = Vec::new();
        let dir = src.join(floor);
        if dir.is_dir() {
            sources(&dir, &mut files);
        }
        let file = src.join(format!("{floor}.rs"));
        if file.is_file() {
            files.push(file);
        }
        assert!(!files.is_empty(), "no sources for floor {floor}");
        for path in files {
            for target in named(&code(&path)) {
                if target == *floor || allowed.contains(&target.as_str()) {
                    let relative = path.strip_prefix(src.join(floor)).unwrap_or(&path);
                    let adapters = PROTO_ADAPTERS.iter().find(|(f, _)| f == floor);
                    if let (Some((_, files)), "proto") = (adapters, target.as_str()) {
                        if !files.iter().any(|f| relative == Path::new(f)) {
                            wrong.push(format!(
                                "{}: prost types outside {floor}'s adapter files",
                                path.display()
                            ));
                        }
                    }
                    continue;
                }
                wrong.push(format!("{} -> crate::{target}", path.display()));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "arrows that src/lib.rs's floors do not allow:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_check_catches_an_upward_arrow() {
    // The scanner itself: an upward path is found, other crates' `crate::` are not.
    let found = named("use crate::cluster::Router;\nlet x = ringlimit_crate::y;\n");
    assert_eq!(found.into_iter().collect::<Vec<_>>(), vec!["cluster"]);
}

/// The sibling modules of `parent` (a module with a directory, `src/<parent>/`) that
/// `text`, the code of one of its children, names: `crate::<parent>::x`, `super::x`
/// (from a child's own file), or `self::x`/`super::super::x` are not used across
/// siblings here. Only names that are sibling files or directories count.
fn siblings_named(text: &str, parent: &str, siblings: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let prefixes = [format!("crate::{parent}::"), "super::".to_string()];
    for prefix in &prefixes {
        for (at, _) in text.match_indices(prefix.as_str()) {
            let before = text[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let rest = &text[at + prefix.len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_' || c.is_ascii_digit())
                .collect();
            if siblings.contains(&name) {
                out.insert(name);
            }
        }
    }
    out
}

/// A cycle in `graph`, as the modules along it, if there is one.
fn cycle(graph: &std::collections::BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &std::collections::BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut found = path[at..].to_vec();
            found.push(node.to_string());
            return Some(found);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, graph, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(found) = visit(node, graph, &mut Vec::new(), &mut done) {
            return Some(found);
        }
    }
    None
}

/// Every module with children, its children as a graph of who names whom: an arrow
/// both ways (or around a circle) means neither can be read, tested or moved without
/// the other, so one of them holds what both need and it belongs in a module of its
/// own (or in the parent).
fn sibling_graphs(
    src: &Path,
) -> Vec<(String, std::collections::BTreeMap<String, BTreeSet<String>>)> {
    let mut dirs = Vec::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path.clone());
                dirs.push(path);
            }
        }
    }
    dirs.sort();
    let mut graphs = Vec::new();
    for dir in dirs {
        let parent = dir
            .strip_prefix(src)
            .unwrap()
            .to_string_lossy()
            .replace('/', "::");
        let mut children: std::collections::BTreeMap<String, Vec<PathBuf>> = Default::default();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let stem = path.file_stem().unwrap().to_string_lossy().to_string();
            if stem == "mod" || stem == "tests" {
                continue;
            }
            let files = children.entry(stem).or_default();
            if path.is_dir() {
                sources(&path, files);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
        let names: BTreeSet<String> = children.keys().cloned().collect();
        let mut graph = std::collections::BTreeMap::new();
        for (child, files) in &children {
            let mut arrows = BTreeSet::new();
            for file in files {
                // `super::` means the parent only from the child's own file.
                let own = file.parent() == Some(dir.as_path());
                // Doc links name modules without importing them.
                let text: String = code(file)
                    .lines()
                    .filter(|l| !l.trim_start().starts_with("//"))
                    .collect::<Vec<_>>()
                    .join("\n");
                let text = if own {
                    text
                } else {
                    text.replace("super::", "")
                };
                arrows.extend(siblings_named(&text, &parent, &names));
            }
            arrows.remove(child);
            graph.insert(child.clone(), arrows);
        }
        graphs.push((parent, graph));
    }
    graphs
}

#[test]
fn sibling_modules_do_not_import_each_other_in_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let circles: Vec<String> = sibling_graphs(&src)
        .into_iter()
        .filter_map(|(parent, graph)| {
            cycle(&graph).map(|c| format!("{parent}: {}", c.join(" -> ")))
        })
        .collect();
    assert!(
        circles.is_empty(),
        "sibling modules in a circle:\n{}",
        circles.join("\n")
    );
}

#[test]
fn the_sibling_check_finds_a_circle() {
    let names: BTreeSet<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
    let a = siblings_named("use super::b::X;\nuse crate::m::c::Y;\n", "m", &names);
    assert_eq!(a.iter().cloned().collect::<Vec<_>>(), vec!["b", "c"]);
    let mut graph = std::collections::BTreeMap::new();
    graph.insert("a".to_string(), a);
    graph.insert("b".to_string(), BTreeSet::new());
    graph.insert("c".to_string(), ["a".to_string()].into_iter().collect());
    assert_eq!(cycle(&graph).unwrap(), vec!["a", "c", "a"]);
}
