//! The cluster rule set on disk: `<data-dir>/rules.json`, written atomically, read back at
//! start.
//!
//! A node in cluster mode persists every rule set it accepts (from the API or from a peer)
//! before it swaps it in, so a restarted node starts from the rules it last enforced and
//! then catches up from its peers, instead of starting from the built-in default and
//! enforcing it until gossip finds a newer copy.
//!
//! The write is atomic: the new content goes to `rules.json.tmp`, is flushed to disk, and
//! is renamed over `rules.json`, then the directory is flushed. A crash leaves either the
//! old file or the new one, never half of one. The file carries its version and digest; on
//! load the document is validated again and its digest recomputed, so a damaged or
//! hand-edited copy is refused by name at start rather than enforced.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{stored_copy_cap, RuleSet, RulesDoc, RulesError, Stamp, MAX_RULES_FILE_BYTES};

/// File name of the stored rule set inside the data directory.
pub const STORED_FILE: &str = "rules.json";

/// The on-disk shape.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Stored {
    format: String,
    version: u64,
    digest: String,
    rules: RulesDoc,
}

const FORMAT: &str = "ringlimit.rules.v1";

/// Why the stored rule set could not be written or read back.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The file system refused.
    #[error("{}: {error}", path.display())]
    Io {
        /// The file or directory concerned.
        path: PathBuf,
        /// The OS error.
        error: std::io::Error,
    },
    /// The file is not what this node writes.
    #[error("{}: not a stored rule set: {message} (move it away to start from the cluster's copy)", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// Writes `rules` at `version` to `dir/rules.json` atomically (module doc).
pub fn store(dir: &Path, version: u64, rules: &RuleSet) -> Result<(), StoreError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |error| StoreError::Io { path, error }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let stored = Stored {
        format: FORMAT.into(),
        version,
        digest: format!("{:016x}", rules.digest()),
        rules: rules.doc().clone(),
    };
    let bytes = serde_json::to_vec_pretty(&stored).expect("a stored rule set serializes");
    let path = dir.join(STORED_FILE);
    let tmp = dir.join(format!("{STORED_FILE}.tmp"));
    {
        let mut file = std::fs::File::create(&tmp).map_err(io(&tmp))?;
        file.write_all(&bytes).map_err(io(&tmp))?;
        file.sync_all().map_err(io(&tmp))?;
    }
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    // The rename is durable once the directory entry is.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Reads `dir/rules.json`: `None` when there is none (a first start), the stamp and the
/// validated rules otherwise. A file that does not parse, fails validation or whose
/// digest does not match its content is an error naming the file.
pub fn load_stored(dir: &Path) -> Result<Option<(Stamp, RuleSet)>, StoreError> {
    load_stored_capped(dir, MAX_RULES_FILE_BYTES)
}

/// [`load_stored`] for a node whose documents are capped at `max_bytes`
/// (`--max-rules-bytes`): the stored copy, pretty JSON, may be larger than the document
/// it holds and is read with [`stored_copy_cap`] of it.
pub fn load_stored_capped(
    dir: &Path,
    max_bytes: u64,
) -> Result<Option<(Stamp, RuleSet)>, StoreError> {
    let path = dir.join(STORED_FILE);
    let cap = stored_copy_cap(max_bytes);
    let bytes = match super::read_rules_file_capped(&path, cap) {
        Ok(bytes) => bytes,
        Err(RulesError::Io { error, .. }) if error.kind() == std::io::ErrorKind::NotFound => {
            return Ok(None)
        }
        Err(e) => {
            return Err(StoreError::Corrupt {
                path,
                message: e.to_string(),
            })
        }
    };
    debug_assert!(bytes.len() as u64 <= cap);
    let corrupt = |message: String| StoreError::Corrupt {
        path: path.clone(),
        message,
    };
    let stored: Stored =
        serde_json::from_slice(&bytes).map_err(|e| corrupt(format!("JSON error: {e}")))?;
    if stored.format != FORMAT {
        return Err(corrupt(format!("unknown format {:?}", stored.format)));
    }
    let rules = RuleSet::from_doc(stored.rules).map_err(|e| corrupt(e.to_string()))?;
    let digest = format!("{:016x}", rules.digest());
    if digest != stored.digest {
        return Err(corrupt(format!(
            "digest {} does not match its rules ({digest})",
            stored.digest
        )));
    }
    Ok(Some((
        Stamp {
            version: stored.version,
            digest: rules.digest(),
        },
        rules,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: &str = "[[rule]]\nname = \"a\"\ntier = \"t\"\nlimit = 3\nwindow = \"1s\"\n";

    #[test]
    fn a_stored_rule_set_reads_back_with_its_stamp() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load_stored(dir.path()).unwrap().is_none(), "first start");
        let rules = RuleSet::from_toml_str(RULES).unwrap();
        store(dir.path(), 7, &rules).unwrap();
        let (stamp, back) = load_stored(dir.path()).unwrap().unwrap();
        assert_eq!(
            stamp,
            Stamp {
                version: 7,
                digest: rules.digest()
            }
        );
        assert_eq!(back.doc(), rules.doc());
        assert!(!dir.path().join("rules.json.tmp").exists(), "renamed away");
        // Overwritten by the next version.
        store(dir.path(), 8, &RuleSet::builtin()).unwrap();
        assert_eq!(load_stored(dir.path()).unwrap().unwrap().0.version, 8);
    }

    #[test]
    fn a_damaged_copy_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        store(dir.path(), 2, &RuleSet::from_toml_str(RULES).unwrap()).unwrap();
        let path = dir.path().join(STORED_FILE);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replace("\"limit\": 3", "\"limit\": 4")).unwrap();
        let e = load_stored(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("rules.json: not a stored rule set: digest"),
            "{e}"
        );
        std::fs::write(&path, "{").unwrap();
        let e = load_stored(dir.path()).unwrap_err().to_string();
        assert!(e.contains("JSON error"), "{e}");
        std::fs::write(&path, text.replace("\"limit\": 3", "\"limit\": 0")).unwrap();
        let e = load_stored(dir.path()).unwrap_err().to_string();
        assert!(e.contains("field \"limit\""), "{e}");
    }
}
