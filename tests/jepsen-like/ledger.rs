//! The owners' lease ledger (docs/leases.md), read from the nodes' logs into the history.
//!
//! A node started with `RUST_LOG=…,ringlimit::lease_ledger=debug` writes one line per
//! lease it grants and per return that gives units back, in the shard step that does
//! it, with that step's sequence number. After the run the harness reads each
//! incarnation's log (it knows the incarnation's generation) and appends a `lent` or
//! `returned` line to the history per ledger line, so the S4 checker can bound an
//! owner's denial by what it had lent and not had back (`checker/leases.rs`).

use std::path::Path;

use crate::history::{now_ms, Entry};

/// The `RUST_LOG` directive that turns the ledger on (`ringlimit::shard::budget::LEDGER`).
pub fn log_directive() -> String {
    format!("{}=debug", ringlimit::shard::budget::LEDGER)
}

/// The ledger lines of one incarnation's log (`node`, `generation`), as history entries.
pub fn read(log: &Path, node: &str, generation: u64) -> Vec<Entry> {
    let Ok(text) = std::fs::read_to_string(log) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|line| parse(line, node, generation))
        .collect()
}

/// One log line as a ledger entry, if it is one.
fn parse(line: &str, node: &str, generation: u64) -> Option<Entry> {
    let at = line.find(ringlimit::shard::budget::LEDGER)?;
    let rest = &line[at..];
    let fields = fields(&rest[rest.find("lease ledger")? + "lease ledger".len()..]);
    let get = |name: &str| {
        fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let num = |name: &str| get(name).and_then(|v| v.parse::<u64>().ok());
    match get("event")? {
        "grant" => Some(Entry::Lent {
            t: now_ms(),
            node: node.to_string(),
            generation,
            key: get("key")?.to_string(),
            route: get("route")?.to_string(),
            counter: num("counter")?,
            holder: get("holder")?.to_string(),
            serial: num("serial")?,
            units: num("units")?,
            window: num("window"),
            sequence: num("sequence")?,
        }),
        "return" => Some(Entry::Returned {
            t: now_ms(),
            node: node.to_string(),
            generation,
            counter: num("counter")?,
            serial: num("serial")?,
            units: num("units")?,
            sequence: num("sequence")?,
        }),
        _ => None,
    }
}

/// `name=value` pairs separated by spaces; a value is a bare word or a quoted string
/// (Rust's `Debug` escapes: `\"`, `\\`).
fn fields(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek() == Some(&' ') {
            chars.next();
        }
        let name: String = chars.by_ref().take_while(|&c| c != '=').collect();
        if name.is_empty() {
            return out;
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next()),
                    '"' => break,
                    c => value.push(c),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c == ' ' {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        out.push((name.trim().to_string(), value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_and_a_return_line_become_history_entries() {
        let grant = "2026-12-03T11:40:00.123456Z DEBUG node{id=n1}: ringlimit::lease_ledger: \
            lease ledger event=\"grant\" key=\"whale\" route=\"GET /fw\" rule=\"fw\" \
            counter=123 holder=\"n2\" serial=5 units=4 window=900000 sequence=77";
        match parse(grant, "n1", 3) {
            Some(Entry::Lent {
                node,
                generation,
                key,
                route,
                counter,
                holder,
                serial,
                units,
                window,
                sequence,
                ..
            }) => {
                assert_eq!((node.as_str(), generation), ("n1", 3));
                assert_eq!((key.as_str(), route.as_str()), ("whale", "GET /fw"));
                assert_eq!((counter, serial, units), (123, 5, 4));
                assert_eq!(
                    (holder.as_str(), window, sequence),
                    ("n2", Some(900000), 77)
                );
            }
            other => panic!("{other:?}"),
        }
        let back = "2026-12-03T11:40:01Z DEBUG ringlimit::lease_ledger: lease ledger \
            event=\"return\" counter=123 holder=\"n2\" serial=5 units=2 sequence=90";
        assert!(matches!(
            parse(back, "n1", 3),
            Some(Entry::Returned {
                counter: 123,
                serial: 5,
                units: 2,
                sequence: 90,
                ..
            })
        ));
    }

    #[test]
    fn a_token_bucket_grant_has_no_window_and_other_lines_are_not_the_ledger() {
        let grant = "x DEBUG ringlimit::lease_ledger: lease ledger event=\"grant\" \
            key=\"a \\\"b\\\"\" route=\"GET /tb\" rule=\"tb\" counter=1 holder=\"n3\" \
            serial=1 units=2 sequence=3";
        match parse(grant, "n1", 1) {
            Some(Entry::Lent { key, window, .. }) => {
                assert_eq!(key, "a \"b\"");
                assert_eq!(window, None);
            }
            other => panic!("{other:?}"),
        }
        assert!(parse("x INFO ringlimit::node: started", "n1", 1).is_none());
        assert!(parse(
            "x DEBUG ringlimit::lease_ledger: lease ledger event=\"grant\"",
            "n1",
            1
        )
        .is_none());
    }
}
