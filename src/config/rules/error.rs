//! What can go wrong loading a rule set, and how it is told: every message names the
//! rule and the field, and quotes at most a bounded excerpt of the input, so a hostile or
//! broken file costs one bounded log line.

use std::fmt;
use std::path::{Path, PathBuf};

/// Most characters of input an error message quotes (a bad line, a bad value), so a
/// megabyte-long line costs one bounded log line, not a megabyte of logs.
pub const MAX_QUOTE_CHARS: usize = 120;

/// Most characters of a TOML parser message shown; serde messages echo keys and values
/// taken from the file, so they are bounded too.
const MAX_MESSAGE_CHARS: usize = 240;

/// Most validation problems listed; the rest are counted. Enough to fix a file in a few
/// rounds, few enough that a generated file with a million mistakes logs a screenful.
pub const MAX_ISSUES_SHOWN: usize = 50;

/// Everything that can go wrong loading a rule set.
///
/// No variant has an error `source`: each message already says everything, so a report
/// that prints the chain (`{:#}`) does not print it twice.
#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    /// The file could not be read.
    #[error("reading rules file {}: {error}", path.display())]
    Io {
        /// The file that was being read.
        path: PathBuf,
        /// The underlying error.
        error: std::io::Error,
    },
    /// The path names a FIFO, a device, a directory or a socket: reading it could block
    /// forever or never end, so it is refused before it is opened.
    #[error("rules file {}: is {kind}, not a regular file", path.display())]
    NotAFile {
        /// The path given.
        path: PathBuf,
        /// What it is instead ("a FIFO", "a directory", ...).
        kind: &'static str,
    },
    /// The file is larger than [`MAX_RULES_FILE_BYTES`](super::MAX_RULES_FILE_BYTES).
    #[error(
        "rules file {}: {} the limit of {limit} bytes ({flag})",
        path.display(),
        size.map_or_else(|| "is over".to_string(), |s| format!("is {s} bytes, over")),
        flag = super::file::MAX_RULES_BYTES_FLAG
    )]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size, when the file system reported one.
        size: Option<u64>,
        /// The cap.
        limit: u64,
    },
    /// The bytes are not UTF-8 text.
    #[error(
        "{}is not UTF-8 text (invalid byte at offset {offset})",
        file_prefix(path)
    )]
    NotUtf8 {
        /// The file, when loaded from one.
        path: Option<PathBuf>,
        /// Byte offset of the first invalid sequence.
        offset: usize,
    },
    /// The text is not TOML or does not have the rule-file shape (unknown field, wrong
    /// type); the message carries line and column and a bounded excerpt of the line.
    #[error("{}{error}", file_prefix(path))]
    Toml {
        /// The file, when loaded from one.
        path: Option<PathBuf>,
        /// The parser's error, bounded.
        error: SyntaxError,
    },
    /// The text is not JSON or does not have the rule document's shape (an API body).
    #[error("JSON error at line {line}, column {column}: {message}")]
    Json {
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The parser's message, bounded.
        message: String,
    },
    /// Valid TOML without a `[default]` section or a single `[[rule]]`: an empty or
    /// truncated write, which must not silently replace every rule with the built-in
    /// default.
    #[error(
        "{}defines no rules (empty or truncated?); to use only a default limit, write a \
         [default] section",
        file_prefix(path)
    )]
    NoRules {
        /// The file, when loaded from one.
        path: Option<PathBuf>,
    },
    /// Well-formed TOML with invalid rules; every problem found, in file order.
    #[error("{}", join_lines(.0))]
    Invalid(Vec<RuleIssue>),
    /// The `[envoy]` section is invalid: the domain, and the key and line, as the
    /// `--envoy-config` parser reports them.
    #[error("{0}")]
    Envoy(super::envoy::EnvoyConfigError),
}

impl RulesError {
    /// Names `path` in errors that came from its text.
    pub(super) fn in_file(self, path: &Path) -> Self {
        let path = Some(path.to_owned());
        match self {
            RulesError::Toml { path: None, error } => RulesError::Toml { path, error },
            RulesError::NotUtf8 { path: None, offset } => RulesError::NotUtf8 { path, offset },
            RulesError::NoRules { path: None } => RulesError::NoRules { path },
            other => other,
        }
    }
}

fn file_prefix(path: &Option<PathBuf>) -> String {
    path.as_ref()
        .map(|p| format!("rules file {}: ", p.display()))
        .unwrap_or_default()
}

fn join_lines(issues: &[RuleIssue]) -> String {
    let mut lines: Vec<String> = issues
        .iter()
        .take(MAX_ISSUES_SHOWN)
        .map(ToString::to_string)
        .collect();
    if issues.len() > MAX_ISSUES_SHOWN {
        lines.push(format!(
            "... and {} more problems",
            issues.len() - MAX_ISSUES_SHOWN
        ));
    }
    lines.join("\n")
}

/// Quotes `text` for an error message: Debug-escaped (no raw control characters reach a
/// log) and at most [`MAX_QUOTE_CHARS`] characters, with `…` when cut.
pub(crate) fn quote(text: &str) -> String {
    match text.char_indices().nth(MAX_QUOTE_CHARS) {
        None => format!("{text:?}"),
        Some((end, _)) => format!("{:?}…", &text[..end]),
    }
}

/// Replaces control characters so a message or excerpt stays on its own line(s) in a log,
/// one character for one character (the caret under an excerpt stays aligned).
fn printable(c: char) -> char {
    match c {
        '\t' => ' ',
        c if c.is_control() => '\u{FFFD}',
        c => c,
    }
}

/// A parser's message cut to 240 characters, control characters replaced.
pub(super) fn bounded_message(text: &str) -> String {
    bounded_text(text.trim_end(), MAX_MESSAGE_CHARS)
}

/// Cuts `text` to `max` characters (plus `…`), control characters replaced.
fn bounded_text(text: &str, max: usize) -> String {
    let mut out: String = text.chars().take(max).map(printable).collect();
    if text.chars().nth(max).is_some() {
        out.push('…');
    }
    out
}

/// A TOML syntax or shape error, rendered without echoing unbounded input: the position,
/// the parser's message (at most 240 characters) and at most [`MAX_QUOTE_CHARS`]
/// characters of the offending line around the error, with a caret under it.
///
/// The `toml` crate's own rendering prints the whole line (and a caret per byte of the
/// span), so one bad 50 MB line would become a 50 MB log record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntaxError {
    /// 1-based line of the error, when the parser reported a position.
    pub line: Option<usize>,
    /// 1-based column (in characters) of the error.
    pub column: Option<usize>,
    /// The parser's message, bounded.
    pub message: String,
    /// A bounded excerpt of the line and the caret's offset in it.
    excerpt: Option<(String, usize)>,
}

impl SyntaxError {
    pub(super) fn new(text: &str, error: &toml::de::Error) -> Self {
        let message = bounded_text(error.message().trim_end(), MAX_MESSAGE_CHARS);
        let Some(span) = error.span() else {
            return SyntaxError {
                line: None,
                column: None,
                message,
                excerpt: None,
            };
        };
        let mut at = span.start.min(text.len());
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
        let line_end = text[at..].find('\n').map_or(text.len(), |i| at + i);
        let line_text = text[line_start..line_end].trim_end_matches('\r');
        let line = text[..line_start].bytes().filter(|b| *b == b'\n').count() + 1;
        let column = text[line_start..at].chars().count();

        // A window of the line that keeps the error position in view.
        let skip = column.saturating_sub(MAX_QUOTE_CHARS / 2);
        let mut shown = String::new();
        if skip > 0 {
            shown.push('…');
        }
        let mut rest = line_text.chars().skip(skip);
        shown.extend(rest.by_ref().take(MAX_QUOTE_CHARS).map(printable));
        if rest.next().is_some() {
            shown.push('…');
        }
        let caret = column - skip + usize::from(skip > 0);
        SyntaxError {
            line: Some(line),
            column: Some(column + 1),
            message,
            excerpt: Some((shown, caret)),
        }
    }
}

impl fmt::Display for SyntaxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let (Some(line), Some(column)) = (self.line, self.column) {
            write!(f, "TOML error at line {line}, column {column}: ")?;
        } else {
            f.write_str("TOML error: ")?;
        }
        f.write_str(&self.message)?;
        if let Some((shown, caret)) = &self.excerpt {
            write!(f, "\n  | {shown}\n  | {:caret$}^", "")?;
        }
        Ok(())
    }
}

impl std::error::Error for SyntaxError {}

/// One validation problem: which rule, which field, what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleIssue {
    /// The rule it concerns.
    pub rule: RuleRef,
    /// The field, when the problem is about one field.
    pub field: Option<&'static str>,
    /// What is wrong and, where possible, how to fix it.
    pub message: String,
}

impl fmt::Display for RuleIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.rule)?;
        if let Some(field) = self.field {
            write!(f, "field \"{field}\": ")?;
        }
        f.write_str(&self.message)
    }
}

/// How an issue names its rule: by name when it has a usable one, else by position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleRef {
    /// The `[default]` section.
    Default,
    /// A `[[rule]]` with a valid name.
    Named(String),
    /// A `[[rule]]` without a usable name; 1-based position in the file.
    Index(usize),
}

impl fmt::Display for RuleRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuleRef::Default => f.write_str("[default]"),
            RuleRef::Named(n) => write!(f, "rule \"{n}\""),
            RuleRef::Index(i) => write!(f, "rule #{i} (unnamed)"),
        }
    }
}
