//! The rule file on disk: read it without ever blocking or reading without bound, and decide
//! what each poll of it means for the running rules.
//!
//! The file is operator input a node reads every second for as long as it runs, so a mistake
//! in it (or a hostile path) must cost one bounded error, never a stuck watcher:
//!
//! - only a regular file is read: a FIFO would block the reader until someone writes to it
//!   (and a blocked reader keeps the node from shutting down), `/dev/zero` never ends, a
//!   directory or socket is a wrong path. The check is made on the path before opening and
//!   again on the opened file, and the file is opened non-blocking, so a swap between the
//!   two cannot make the open or the read wait;
//! - at most `--max-rules-bytes` ([`MAX_RULES_FILE_BYTES`] unless the operator says
//!   otherwise) are read;
//! - [`RuleFile::observe`] turns one poll into "nothing new", "new rules" or "an error to
//!   report once", so a file that stays broken is logged and counted once, not every second.

use std::io::Read;
use std::path::{Path, PathBuf};

use super::{RuleSet, RulesError};

/// Default of `serve --max-rules-bytes`: the largest rule file, rules API document and
/// peer copy a node accepts, in bytes (16 MiB). A SaaS with one `[[rule]]` per customer
/// has 100,000 of them in about 7.4 MB (docs/rules.md, "Size"); a file far larger than
/// that is a mistake (a wrong path, a runaway generator) and is refused rather than read.
pub const MAX_RULES_FILE_BYTES: u64 = 16 * 1024 * 1024;

/// The flag that sets the cap, named by every "too large" message so an operator with a
/// genuinely larger rule set knows what to raise.
pub const MAX_RULES_BYTES_FLAG: &str = "--max-rules-bytes";

/// Cap on the node's own stored copy (`<data-dir>/rules.json`) for a node whose cap on
/// documents is `max_bytes`: that copy is pretty-printed JSON of a document accepted
/// under the cap, larger than the TOML it came from (about 1.5x for per-client rules;
/// at most about 3x for rules made of the shortest fields), so it gets four times the cap
/// plus room for its header. A document accepted by the file, the API or a peer is thus
/// always readable back after a restart.
pub fn stored_copy_cap(max_bytes: u64) -> u64 {
    max_bytes.saturating_mul(4).saturating_add(64 * 1024)
}

/// Reads the rule file at `path` with the default cap, [`MAX_RULES_FILE_BYTES`]
/// (see [`read_rules_file_capped`]).
pub fn read_rules_file(path: &Path) -> Result<Vec<u8>, RulesError> {
    read_rules_file_capped(path, MAX_RULES_FILE_BYTES)
}

/// Reads the rule file at `path`: a regular file (symlinks followed) of at most
/// `max_bytes`, without blocking on the open or on the read.
///
/// Refuses FIFOs, devices, directories and sockets with [`RulesError::NotAFile`] and larger
/// files with [`RulesError::TooLarge`]; never reads more than the cap plus one byte.
pub fn read_rules_file_capped(path: &Path, max_bytes: u64) -> Result<Vec<u8>, RulesError> {
    let io = |error| RulesError::Io {
        path: path.to_owned(),
        error,
    };
    // Before opening: opening a FIFO for reading blocks until a writer appears.
    check_metadata(path, &std::fs::metadata(path).map_err(io)?, max_bytes)?;
    let file = open_nonblocking(path).map_err(io)?;
    // The path may have been swapped between the check and the open: what counts is what
    // was opened. Non-blocking, so even an opened FIFO returns here instead of waiting.
    let meta = file.metadata().map_err(io)?;
    check_metadata(path, &meta, max_bytes)?;
    // Sized from the metadata (already checked against the cap), so a large file is not
    // copied through a series of doublings.
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(max_bytes.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > max_bytes {
        // Grew after the size check.
        return Err(RulesError::TooLarge {
            path: path.to_owned(),
            size: None,
            limit: max_bytes,
        });
    }
    Ok(bytes)
}

fn check_metadata(path: &Path, meta: &std::fs::Metadata, max_bytes: u64) -> Result<(), RulesError> {
    if !meta.is_file() {
        return Err(RulesError::NotAFile {
            path: path.to_owned(),
            kind: kind_of(&meta.file_type()),
        });
    }
    if meta.len() > max_bytes {
        return Err(RulesError::TooLarge {
            path: path.to_owned(),
            size: Some(meta.len()),
            limit: max_bytes,
        });
    }
    Ok(())
}

/// Names a file type that is not a regular file, for the error message.
fn kind_of(kind: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            return "a FIFO";
        }
        if kind.is_char_device() {
            return "a character device";
        }
        if kind.is_block_device() {
            return "a block device";
        }
        if kind.is_socket() {
            return "a socket";
        }
    }
    if kind.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

#[cfg(unix)]
fn open_nonblocking(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    // O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer. It has
    // no effect on reads of a regular file, the only kind read after the second check.
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
}

#[cfg(not(unix))]
fn open_nonblocking(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::File::open(path)
}

/// What the watcher last saw at the path, so it reports each change once.
#[derive(Debug)]
enum Seen {
    /// These bytes (valid or not) were read and handled.
    Bytes(Vec<u8>),
    /// Reading failed with this message.
    Failed(String),
}

/// The rule file as a running node follows it: which bytes the current rules came from
/// and what the last poll saw. Pure: the caller reads ([`read_rules_file`]) and applies.
#[derive(Debug)]
pub struct RuleFile {
    path: PathBuf,
    /// The cap each poll reads with (`--max-rules-bytes`).
    max_bytes: u64,
    /// The bytes the rules in force were parsed from.
    applied: Vec<u8>,
    last: Seen,
}

impl RuleFile {
    /// Reads and parses the file at start. Any error refuses the start: a node never begins
    /// with rules it was not given.
    pub fn load(path: &Path) -> Result<(Self, RuleSet), RulesError> {
        Self::load_capped(path, MAX_RULES_FILE_BYTES)
    }

    /// [`RuleFile::load`] with the cap of `--max-rules-bytes`, kept for every later poll.
    pub fn load_capped(path: &Path, max_bytes: u64) -> Result<(Self, RuleSet), RulesError> {
        let bytes = read_rules_file_capped(path, max_bytes)?;
        let rules = RuleSet::from_file_bytes(path, &bytes)?;
        let mut file = Self::loaded(path, bytes);
        file.max_bytes = max_bytes;
        Ok((file, rules))
    }

    /// The state after the rules in force were parsed from `bytes`.
    pub fn loaded(path: &Path, bytes: Vec<u8>) -> Self {
        RuleFile {
            path: path.to_owned(),
            max_bytes: MAX_RULES_FILE_BYTES,
            applied: bytes.clone(),
            last: Seen::Bytes(bytes),
        }
    }

    /// The path followed.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The cap a poll of the file reads with ([`read_rules_file_capped`]).
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Handles one poll's read: `None` when there is nothing new to apply or report,
    /// `Some(Ok(rules))` for new rules to swap in, `Some(Err(e))` for a new problem to log
    /// and count once (the rules in force stay). The same failure or the same bad bytes
    /// seen again report nothing; bytes equal to those in force apply nothing.
    pub fn observe(
        &mut self,
        read: Result<Vec<u8>, RulesError>,
    ) -> Option<Result<RuleSet, RulesError>> {
        match read {
            Err(error) => {
                let message = error.to_string();
                if matches!(&self.last, Seen::Failed(m) if *m == message) {
                    return None;
                }
                self.last = Seen::Failed(message);
                Some(Err(error))
            }
            Ok(bytes) => {
                if matches!(&self.last, Seen::Bytes(b) if *b == bytes) {
                    return None;
                }
                if bytes == self.applied {
                    // Back to the rules in force (a broken edit reverted, the file readable
                    // again): nothing to swap.
                    self.last = Seen::Bytes(bytes);
                    return None;
                }
                let parsed = RuleSet::from_file_bytes(&self.path, &bytes);
                if parsed.is_ok() {
                    self.applied = bytes.clone();
                }
                self.last = Seen::Bytes(bytes);
                Some(parsed)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE_RULE: &str = "[[rule]]\nname = \"a\"\ntier = \"t\"\nlimit = 1\nwindow = \"1s\"\n";
    const TWO_RULES: &str = "[[rule]]\nname = \"a\"\ntier = \"t\"\nlimit = 2\nwindow = \"1s\"\n";

    fn mkfifo(path: &Path) {
        let status = std::process::Command::new("mkfifo")
            .arg(path)
            .status()
            .expect("mkfifo runs");
        assert!(status.success());
    }

    #[test]
    fn reads_a_regular_file_and_follows_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rules.toml");
        std::fs::write(&path, ONE_RULE).unwrap();
        assert_eq!(read_rules_file(&path).unwrap(), ONE_RULE.as_bytes());
        #[cfg(unix)]
        {
            let link = dir.path().join("link.toml");
            std::os::unix::fs::symlink(&path, &link).unwrap();
            assert_eq!(read_rules_file(&link).unwrap(), ONE_RULE.as_bytes());
        }
    }

    #[cfg(unix)]
    #[test]
    fn a_fifo_is_refused_without_blocking() {
        // Bypass closed: a FIFO as the rule path blocked the reader forever.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rules.toml");
        mkfifo(&path);
        let (tx, rx) = std::sync::mpsc::channel();
        let p = path.clone();
        std::thread::spawn(move || tx.send(read_rules_file(&p).map(|_| ())).unwrap());
        let result = rx
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("reading a FIFO returns at once");
        let e = result.unwrap_err();
        assert!(
            matches!(e, RulesError::NotAFile { kind: "a FIFO", .. }),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            format!(
                "rules file {}: is a FIFO, not a regular file",
                path.display()
            )
        );
        assert!(matches!(
            RuleSet::load(&path),
            Err(RulesError::NotAFile { .. })
        ));
    }

    #[cfg(unix)]
    #[test]
    fn an_opened_fifo_is_refused_without_blocking() {
        // The check after opening, for a path swapped between the first check and the
        // open: a non-blocking open of a FIFO returns, and the opened file is refused.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fifo");
        mkfifo(&path);
        let file = open_nonblocking(&path).expect("non-blocking open returns");
        let e = check_metadata(&path, &file.metadata().unwrap(), MAX_RULES_FILE_BYTES).unwrap_err();
        assert!(
            matches!(e, RulesError::NotAFile { kind: "a FIFO", .. }),
            "{e}"
        );
    }

    #[cfg(unix)]
    #[test]
    fn dev_zero_is_refused_unread() {
        // Bypass closed: /dev/zero was read until 2 GB.
        let e = read_rules_file(Path::new("/dev/zero")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "rules file /dev/zero: is a character device, not a regular file"
        );
    }

    #[test]
    fn a_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let e = read_rules_file(dir.path()).unwrap_err();
        assert!(
            matches!(
                e,
                RulesError::NotAFile {
                    kind: "a directory",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_socket_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let e = read_rules_file(&path).unwrap_err();
        assert!(
            matches!(
                e,
                RulesError::NotAFile {
                    kind: "a socket",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn a_file_over_the_cap_is_refused_and_one_at_the_cap_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rules.toml");
        let cap = 1024 * 1024;
        std::fs::write(&path, vec![b'#'; cap + 1]).unwrap();
        let e = read_rules_file_capped(&path, cap as u64).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "rules file {}: is 1048577 bytes, over the limit of 1048576 bytes \
                 (--max-rules-bytes)",
                path.display()
            )
        );
        std::fs::write(&path, vec![b'#'; cap]).unwrap();
        assert_eq!(
            read_rules_file_capped(&path, cap as u64).unwrap().len(),
            cap
        );
        // The default cap reads it, and refuses one byte more than itself.
        assert_eq!(read_rules_file(&path).unwrap().len(), cap);
        let default = usize::try_from(MAX_RULES_FILE_BYTES).unwrap();
        std::fs::write(&path, vec![b'#'; default + 1]).unwrap();
        assert!(matches!(
            read_rules_file(&path),
            Err(RulesError::TooLarge { limit, .. }) if limit == MAX_RULES_FILE_BYTES
        ));
    }

    #[test]
    fn a_watched_file_keeps_its_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rules.toml");
        std::fs::write(&path, ONE_RULE).unwrap();
        let (file, _) = RuleFile::load_capped(&path, 4096).unwrap();
        assert_eq!(file.max_bytes(), 4096);
        let e = RuleFile::load_capped(&path, 10).unwrap_err();
        assert!(e.to_string().contains("over the limit of 10 bytes"), "{e}");
    }

    #[test]
    fn a_missing_file_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing.toml");
        let e = read_rules_file(&path).unwrap_err();
        assert!(matches!(e, RulesError::Io { .. }));
        assert!(e.to_string().contains("missing.toml"), "{e}");
    }

    fn watched() -> RuleFile {
        RuleFile::loaded(Path::new("rules.toml"), ONE_RULE.as_bytes().to_vec())
    }

    #[test]
    fn unchanged_bytes_apply_nothing_and_new_bytes_apply_once() {
        let mut f = watched();
        assert!(f.observe(Ok(ONE_RULE.into())).is_none());
        let rules = f.observe(Ok(TWO_RULES.into())).unwrap().unwrap();
        assert_eq!(rules.get("a").unwrap().limiter.max_cost(), 2);
        assert!(f.observe(Ok(TWO_RULES.into())).is_none());
    }

    #[test]
    fn an_empty_write_is_an_error_reported_once_and_keeps_the_rules() {
        // Bypass closed: an empty or truncated write became "ok, 1 rules" (built-in default).
        let mut f = watched();
        let e = f.observe(Ok(Vec::new())).unwrap().unwrap_err();
        assert_eq!(
            e.to_string(),
            "rules file rules.toml: defines no rules (empty or truncated?); to use only a \
             default limit, write a [default] section"
        );
        assert!(f.observe(Ok(Vec::new())).is_none(), "reported once");
        // Reverting to the rules in force applies nothing.
        assert!(f.observe(Ok(ONE_RULE.into())).is_none());
        // A later good edit applies.
        assert!(f.observe(Ok(TWO_RULES.into())).unwrap().is_ok());
    }

    #[test]
    fn a_read_failure_is_reported_once_per_distinct_error() {
        let mut f = watched();
        let fifo = || {
            Err(RulesError::NotAFile {
                path: "rules.toml".into(),
                kind: "a FIFO",
            })
        };
        assert!(f.observe(fifo()).unwrap().is_err());
        assert!(
            f.observe(fifo()).is_none(),
            "the same failure is not repeated"
        );
        let big = Err(RulesError::TooLarge {
            path: "rules.toml".into(),
            size: Some(2 << 20),
            limit: MAX_RULES_FILE_BYTES,
        });
        assert!(f.observe(big).unwrap().is_err(), "a different failure is");
        // The file back as it was: nothing to swap; a real edit applies.
        assert!(f.observe(Ok(ONE_RULE.into())).is_none());
        assert!(f.observe(Ok(TWO_RULES.into())).unwrap().is_ok());
    }

    #[test]
    fn bad_bytes_are_reported_once_and_a_fix_applies() {
        let mut f = watched();
        let bad = b"[[rule]]\nname = \"a\"\nlimit = 0\n".to_vec();
        assert!(f.observe(Ok(bad.clone())).unwrap().is_err());
        assert!(f.observe(Ok(bad)).is_none());
        let not_utf8 = vec![b'#', 0xff, b'\n'];
        let e = f.observe(Ok(not_utf8)).unwrap().unwrap_err();
        assert_eq!(
            e.to_string(),
            "rules file rules.toml: is not UTF-8 text (invalid byte at offset 1)"
        );
        assert!(f.observe(Ok(TWO_RULES.into())).unwrap().is_ok());
    }
}
