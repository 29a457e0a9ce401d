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
