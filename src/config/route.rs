//! Request routes (`POST /v1/charges`) and the patterns rules use to select them.
//!
//! A [`Route`] is what a gateway sends with every check, so it is parsed on the hot path: it
//! borrows from the request, allocates nothing and is validated with a single byte scan. A
//! [`RoutePattern`] is what a rule names; it is parsed once when the rule file is loaded, so it
//! owns its text.
//!
//! Syntax, shared by both:
//!
//! ```text
//! route   = [METHOD " "] path          METHOD: 1..=16 letters A-Z; exactly one space
//! path    = "/" *visible-ascii         1..=256 bytes of 0x21..=0x7E (no spaces, no controls),
//!                                      query string and fragment included
//! pattern = "*"                        any route
//!         | ["*" " " | METHOD " "] path ["*"]        path without '?' or '#'
//! ```
//!
//! A route is normalised to its method and path: the path ends at the first `?` or `#`, so
//! `GET /v1/a?x=1` and `GET /v1/a#top` are the route `GET /v1/a`. That normalised route is
//! what patterns match and what a rule with `per = "route"` counts; the query string can
//! therefore never select another rule or open another budget. (The whole text as sent is
//! still validated and bounded, since it travels to the owner and back in the answer.)
//!
//! In a pattern a missing method or `*` means "any method", and a trailing `*` turns the path
//! into a prefix: `/v1/*` matches `/v1/users` and `/v1/` but not `/v1`. `*` anywhere else in a
//! pattern is rejected, so nobody mistakes patterns for globs; so are `?` and `#`, which no
//! normalised route contains. Paths are compared byte for byte: normalise case and
//! percent-encoding in the gateway before checking.

use std::fmt;

/// The route bounds, defined with every other input bound.
pub use super::bounds::{MAX_METHOD_LEN, MAX_PATH_LEN};

/// How much of an offending input an error quotes back; the input may be megabytes of junk.
const QUOTE_LIMIT: usize = 80;

/// A concrete request route: an optional HTTP method and a path, normalised (query string
/// and fragment stripped).
///
/// Borrowed and `Copy` because it is parsed once per check on the hot path and only ever
/// compared against rule patterns; the caller keeps the backing string alive. Two routes
/// are equal when their normalised forms are, whatever query string each was sent with.
#[derive(Debug, Clone, Copy)]
pub struct Route<'a> {
    method: Option<&'a str>,
    path: &'a str,
    /// The whole input, of which [`Route::as_str`] is a prefix.
    sent: &'a str,
}

impl PartialEq for Route<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for Route<'_> {}

impl std::hash::Hash for Route<'_> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl<'a> Route<'a> {
    /// Parses `METHOD /path` or `/path`, rejecting anything a rule could not match reliably.
    ///
    /// Strict on purpose: the route can be part of the counter key (`per = "route"`), so two
    /// spellings of one route (`get /x` and `GET /x`) must not silently become two
    /// independent budgets. A query string or fragment is accepted and stripped: the path
    /// ends at the first `?` or `#`.
    pub fn parse(input: &'a str) -> Result<Self, RouteError> {
        let (method, full) =
            split(input, false).map_err(|kind| RouteError::new(Subject::Route, input, kind))?;
        check_path(full, false).map_err(|kind| RouteError::new(Subject::Route, input, kind))?;
        let path = match full.find(['?', '#']) {
            Some(end) => &full[..end],
            None => full,
        };
        Ok(Route {
            method,
            path,
            sent: input,
        })
    }

    /// The method, or `None` when the caller checked a bare path; only method-agnostic
    /// patterns match a route without a method.
    pub fn method(&self) -> Option<&'a str> {
        self.method
    }

    /// The path, always starting with `/`, without query string or fragment.
    pub fn path(&self) -> &'a str {
        self.path
    }

    /// The normalised route, `METHOD /path` or `/path`: what a `per = "route"` rule counts.
    /// Borrowed from the input (it is a prefix of it), so it costs no allocation.
    pub fn as_str(&self) -> &'a str {
        let end = self.method.map_or(0, |m| m.len() + 1) + self.path.len();
        &self.sent[..end]
    }

    /// The route exactly as the caller sent it, query string and fragment included.
    pub fn sent(&self) -> &'a str {
        self.sent
    }
}

impl fmt::Display for Route<'_> {
    /// Renders the normalised form, which parses back to the same route.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The path half of a pattern: an exact path, or a prefix (from a trailing `*`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum PathPattern {
    Exact(Box<str>),
    /// The prefix without the `*`; always starts with `/`, so `/*` matches every path.
    Prefix(Box<str>),
}

/// A route selector in a rule: method (or any) and exact path or path prefix.
///
/// Stored in canonical form, so `*`, `/*` and `* /*` are equal; that is what lets the rule
/// loader reject two rules with the same selector instead of silently shadowing one.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RoutePattern {
    method: Option<Box<str>>,
    path: PathPattern,
}

/// How narrowly a pattern selects routes; greater means more specific.
///
/// Ordered field by field: an exact path beats any prefix, then a longer literal path beats a
/// shorter one, then a named method beats any method. Between two distinct patterns that
/// match the same route this order never ties, which keeps "most specific wins" deterministic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Specificity {
    exact: bool,
    literal_len: u16,
    method: bool,
}

impl RoutePattern {
    /// Parses a pattern as written in a rule file (see the module doc for the syntax).
    ///
    /// Done once per rule load, so it may allocate; errors say what is wrong in terms the
    /// person editing the rule file can act on.
    pub fn parse(input: &str) -> Result<Self, RouteError> {
        let err = |kind| RouteError::new(Subject::Pattern, input, kind);
        if input == "*" {
            return Ok(Self::any());
        }
        let (method, path) = split(input, true).map_err(err)?;
        let prefix = check_path(path, true).map_err(err)?;
        let method = method.filter(|m| *m != "*").map(Box::from);
        let path = match prefix {
            true => PathPattern::Prefix(path[..path.len() - 1].into()),
            false => PathPattern::Exact(path.into()),
        };
        Ok(RoutePattern { method, path })
    }

    /// The pattern matching every route that has one; the canonical form of `*` and `/*`.
    pub fn any() -> Self {
        RoutePattern {
            method: None,
            path: PathPattern::Prefix("/".into()),
        }
    }

    /// Whether `route` falls under this pattern; called per candidate rule on the hot path,
    /// so it is two string comparisons and nothing else.
    pub fn matches(&self, route: &Route<'_>) -> bool {
        if let Some(m) = &self.method {
            if route.method != Some(&**m) {
                return false;
            }
        }
        match &self.path {
            PathPattern::Exact(p) => route.path == &**p,
            PathPattern::Prefix(p) => route.path.starts_with(&**p),
        }
    }

    /// The rank used to pick one rule when several patterns match at the same level.
    pub fn specificity(&self) -> Specificity {
        let (exact, literal) = match &self.path {
            PathPattern::Exact(p) => (true, p),
            PathPattern::Prefix(p) => (false, p),
        };
        Specificity {
            exact,
            // Paths are at most MAX_PATH_LEN (256) bytes, so this never saturates.
            literal_len: u16::try_from(literal.len()).unwrap_or(u16::MAX),
            method: self.method.is_some(),
        }
    }

    /// The method this pattern requires, or `None` for any method.
    pub fn method(&self) -> Option<&str> {
        self.method.as_deref()
    }

    /// The exact path this pattern requires, if it is not a prefix pattern; lets an index
    /// look exact patterns up by path instead of testing each one.
    pub fn exact_path(&self) -> Option<&str> {
        match &self.path {
            PathPattern::Exact(p) => Some(p),
            PathPattern::Prefix(_) => None,
        }
    }
}

impl fmt::Display for RoutePattern {
    /// Renders the canonical form (any method is omitted), which parses back to an equal
    /// pattern; used in error messages and logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(m) = &self.method {
            write!(f, "{m} ")?;
        }
        match &self.path {
            PathPattern::Exact(p) => f.write_str(p),
            PathPattern::Prefix(p) => write!(f, "{p}*"),
        }
    }
}

/// Which kind of input failed, so the message says "route" or "route pattern".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Subject {
    Route,
    Pattern,
}

/// A route or route pattern that does not follow the syntax.
///
/// Carries a bounded quote of the input and a [`RouteErrorKind`] so callers can both show a
/// precise message (gRPC INVALID_ARGUMENT, rule-file errors) and branch on the cause in tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteError {
    subject: Subject,
    quoted: String,
    kind: RouteErrorKind,
}

/// What exactly is wrong with a route; each variant's message tells the user how to fix it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RouteErrorKind {
    /// The input was empty.
    Empty,
    /// The input started with a space, so there is no method before it.
    LeadingSpace,
    /// The method contains something other than `A`–`Z`.
    MethodNotUppercase,
    /// The method is longer than [`MAX_METHOD_LEN`].
    MethodTooLong,
    /// A method with nothing after it.
    MissingPath,
    /// More than one space between method and path.
    ExtraSpace,
    /// Neither a method nor a path starting with `/`.
    NotARoute,
    /// The path does not start with `/`.
    PathNotAbsolute,
    /// The path is longer than [`MAX_PATH_LEN`] bytes.
    PathTooLong {
        /// Length of the offending path in bytes.
        len: usize,
    },
    /// The path contains a byte outside visible ASCII.
    BadPathByte {
        /// The offending byte.
        byte: u8,
        /// Its offset within the path.
        offset: usize,
    },
    /// A `*` in a pattern somewhere other than the last character of the path.
    MisplacedWildcard,
    /// A `?` or `#` in a pattern: routes are matched without their query string or
    /// fragment, so such a pattern could never match.
    QueryInPattern,
}

impl RouteError {
    fn new(subject: Subject, input: &str, kind: RouteErrorKind) -> Self {
        let mut end = input.len().min(QUOTE_LIMIT);
        while !input.is_char_boundary(end) {
            end -= 1;
        }
        let mut quoted = format!("{:?}", &input[..end]);
        if end < input.len() {
            quoted.push('…');
        }
        RouteError {
            subject,
            quoted,
            kind,
        }
    }

    /// The cause, for callers that branch on it.
    pub fn kind(&self) -> RouteErrorKind {
        self.kind
    }
}

impl fmt::Display for RouteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let subject = match self.subject {
            Subject::Route => "route",
            Subject::Pattern => "route pattern",
        };
        write!(f, "{subject} {}: {}", self.quoted, self.kind)
    }
}

impl std::error::Error for RouteError {}

impl fmt::Display for RouteErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use RouteErrorKind::*;
        match *self {
            Empty => f.write_str("empty (expected \"METHOD /path\" or \"/path\")"),
            LeadingSpace => f.write_str("leading space (expected \"METHOD /path\" or \"/path\")"),
            MethodNotUppercase => f.write_str("method must be uppercase letters A-Z"),
            MethodTooLong => write!(f, "method is longer than {MAX_METHOD_LEN} letters"),
            MissingPath => f.write_str("missing path starting with '/'"),
            ExtraSpace => f.write_str("method and path must be separated by exactly one space"),
            NotARoute => f.write_str("expected \"METHOD /path\" or \"/path\""),
            PathNotAbsolute => f.write_str("path must start with '/'"),
            PathTooLong { len } => {
                write!(
                    f,
                    "path is {len} bytes long; at most {MAX_PATH_LEN} allowed"
                )
            }
            BadPathByte { byte: b' ', offset } => write!(
                f,
                "path contains a space at byte {offset} (only one space, between method and path)"
            ),
            BadPathByte { byte, offset } if byte.is_ascii_control() => write!(
                f,
                "path contains control character {byte:#04x} at byte {offset}"
            ),
            BadPathByte { byte, offset } => write!(
                f,
                "path contains non-ASCII byte {byte:#04x} at byte {offset} (percent-encode it)"
            ),
            MisplacedWildcard => {
                f.write_str("'*' is only allowed as the last character of a path pattern")
            }
            QueryInPattern => f.write_str(
                "'?' and '#' are not allowed in a route pattern: requests are matched by their \
                 path alone (query string and fragment stripped), so it could never match",
            ),
        }
    }
}

/// Splits off and validates the method; the path half is validated by [`check_path`].
fn split(input: &str, wildcard: bool) -> Result<(Option<&str>, &str), RouteErrorKind> {
    if input.is_empty() {
        return Err(RouteErrorKind::Empty);
    }
    if input.starts_with('/') {
        return Ok((None, input));
    }
    let (method, rest) = match input.split_once(' ') {
        Some((m, r)) => (m, Some(r)),
        None => (input, None),
    };
    if method.is_empty() {
        return Err(RouteErrorKind::LeadingSpace);
    }
    let is_token = method.bytes().all(|b| b.is_ascii_uppercase());
    let is_any = wildcard && method == "*";
    if !is_token && !is_any {
        // "v1/users" is a forgotten slash, not a bad method: say so.
        return Err(match rest {
            None if method.contains('/') => RouteErrorKind::NotARoute,
            _ => RouteErrorKind::MethodNotUppercase,
        });
    }
    if method.len() > MAX_METHOD_LEN {
        return Err(RouteErrorKind::MethodTooLong);
    }
    match rest {
        None | Some("") => Err(RouteErrorKind::MissingPath),
        Some(r) if r.starts_with(' ') => Err(RouteErrorKind::ExtraSpace),
        Some(r) if !r.starts_with('/') => Err(RouteErrorKind::PathNotAbsolute),
        Some(r) => Ok((Some(method), r)),
    }
}

/// Validates a path that is known to start with `/`; with `wildcard`, returns whether it ends
/// in the prefix marker `*` (which is then the only `*` allowed).
fn check_path(path: &str, wildcard: bool) -> Result<bool, RouteErrorKind> {
    if path.len() > MAX_PATH_LEN {
        return Err(RouteErrorKind::PathTooLong { len: path.len() });
    }
    let bytes = path.as_bytes();
    if let Some(offset) = bytes.iter().position(|b| !(0x21..=0x7E).contains(b)) {
        return Err(RouteErrorKind::BadPathByte {
            byte: bytes[offset],
            offset,
        });
    }
    if !wildcard {
        return Ok(false);
    }
    let prefix = path.ends_with('*');
    let body = if prefix {
        &path[..path.len() - 1]
    } else {
        path
    };
    if body.contains('*') {
        return Err(RouteErrorKind::MisplacedWildcard);
    }
    if body.contains(['?', '#']) {
        return Err(RouteErrorKind::QueryInPattern);
    }
    Ok(prefix)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn route(s: &str) -> Route<'_> {
        Route::parse(s).unwrap()
    }

    fn pat(s: &str) -> RoutePattern {
        RoutePattern::parse(s).unwrap()
    }

    fn route_err(s: &str) -> String {
        Route::parse(s).unwrap_err().to_string()
    }

    #[test]
    fn parses_method_and_path() {
        let r = route("POST /v1/charges");
        assert_eq!(r.method(), Some("POST"));
        assert_eq!(r.path(), "/v1/charges");
        assert_eq!(r.to_string(), "POST /v1/charges");
    }

    #[test]
    fn parses_bare_path_without_method() {
        let r = route("/v1/charges");
        assert_eq!(r.method(), None);
        assert_eq!(r.path(), "/v1/charges");
    }

    #[test]
    fn accepts_custom_methods_and_edge_lengths() {
        assert!(Route::parse("PURGE /").is_ok());
        assert!(Route::parse(&format!("{} /", "A".repeat(16))).is_ok());
        assert!(Route::parse(&format!("/{}", "a".repeat(255))).is_ok());
        assert!(Route::parse("/a?b=c&d=%20").is_ok());
    }

    #[test]
    fn query_string_and_fragment_are_accepted_and_stripped_from_the_route() {
        let r = route("GET /v1/a?x=1&y=%20");
        assert_eq!(r.method(), Some("GET"));
        assert_eq!(r.path(), "/v1/a");
        assert_eq!(r.as_str(), "GET /v1/a");
        assert_eq!(r.sent(), "GET /v1/a?x=1&y=%20");
        assert_eq!(r.to_string(), "GET /v1/a");
        assert_eq!(
            r,
            route("GET /v1/a"),
            "equal to the route without its query"
        );
        assert_eq!(route("GET /v1/a#top"), route("GET /v1/a"));
        assert_eq!(route("/v1/a?x#y").as_str(), "/v1/a");
        assert_eq!(route("/?").path(), "/");
        assert_ne!(route("GET /v1/a?x=1"), route("GET /v1/b?x=1"));
        // The text as sent is still validated: no spaces or controls in the query either.
        assert!(route_err("GET /a?x=1 2").contains("space at byte 6"));
        assert!(route_err("/?\n").contains("control character"));
        assert!(route_err(&format!("/a?{}", "q".repeat(300))).contains("bytes long"));
    }

    #[test]
    fn patterns_match_a_route_by_its_path_whatever_its_query() {
        assert!(pat("GET /v1/a").matches(&route("GET /v1/a?x=1")));
        assert!(pat("/v1/*").matches(&route("GET /v1/b#frag")));
        assert!(
            !pat("/v1/a*").matches(&route("GET /v1?/a")),
            "the path is /v1"
        );
    }

    #[test]
    fn patterns_with_a_query_string_or_fragment_are_refused() {
        for p in ["/v1/a?x=1", "GET /v1/a#top", "/v1?*", "/?"] {
            let e = RoutePattern::parse(p).unwrap_err();
            assert_eq!(e.kind(), RouteErrorKind::QueryInPattern, "{p}");
            assert!(e.to_string().contains("could never match"), "{e}");
        }
    }

    #[test]
    fn rejects_empty_route() {
        assert_eq!(
            route_err(""),
            "route \"\": empty (expected \"METHOD /path\" or \"/path\")"
        );
    }

    #[test]
    fn rejects_lowercase_method() {
        assert_eq!(
            route_err("get /x"),
            "route \"get /x\": method must be uppercase letters A-Z"
        );
        assert!(route_err("Get /x").contains("uppercase"));
    }

    #[test]
    fn rejects_method_without_path() {
        assert_eq!(
            route_err("POST"),
            "route \"POST\": missing path starting with '/'"
        );
        assert!(route_err("POST ").contains("missing path"));
    }

    #[test]
    fn rejects_two_spaces_between_method_and_path() {
        assert!(route_err("GET  /x").contains("exactly one space"));
    }

    #[test]
    fn rejects_leading_space() {
        assert!(route_err(" /x").contains("leading space"));
    }

    #[test]
    fn rejects_path_without_slash() {
        assert!(route_err("GET x").contains("path must start with '/'"));
        assert!(route_err("v1/users").contains("expected \"METHOD /path\""));
    }

    #[test]
    fn rejects_spaces_inside_path() {
        assert!(route_err("GET /a b").contains("space at byte 2"));
        assert!(route_err("/x ").contains("space at byte 2"));
    }

    #[test]
    fn rejects_control_characters() {
        let e = route_err("GET /a\nb");
        assert!(e.contains("control character 0x0a at byte 2"), "{e}");
        assert!(e.starts_with("route \"GET /a\\nb\""), "quoted escaped: {e}");
        assert!(route_err("/\t").contains("control character 0x09"));
        assert!(route_err("/\x7f").contains("control character 0x7f"));
    }

    #[test]
    fn rejects_non_ascii() {
        assert!(route_err("GET /café").contains("non-ASCII byte 0xc3 at byte 4"));
        assert!(route_err("GÉT /x").contains("uppercase"));
    }

    #[test]
    fn rejects_too_long_method_and_path() {
        assert!(route_err(&format!("{} /", "A".repeat(17))).contains("longer than 16"));
        let long = format!("/{}", "a".repeat(256));
        let e = route_err(&long);
        assert!(e.contains("257 bytes long; at most 256"), "{e}");
        assert!(e.len() < 200, "error quotes a bounded prefix: {e}");
    }

    #[test]
    fn rejects_wildcards_in_routes() {
        // '*' is a visible byte and legal in a concrete path, but a route never has a method '*'.
        assert!(Route::parse("/a*").is_ok());
        assert!(route_err("* /a").contains("uppercase"));
    }

    #[test]
    fn pattern_forms_parse_to_canonical_shapes() {
        assert_eq!(pat("*"), RoutePattern::any());
        assert_eq!(pat("/*"), RoutePattern::any());
        assert_eq!(pat("* /*"), RoutePattern::any());
        assert_eq!(pat("* /v1/x"), pat("/v1/x"));
        assert_eq!(pat("POST /v1/*").to_string(), "POST /v1/*");
        assert_eq!(pat("* /v1/charges").to_string(), "/v1/charges");
        assert_eq!(pat("GET /x").exact_path(), Some("/x"));
        assert_eq!(pat("GET /x*").exact_path(), None);
    }

    #[test]
    fn pattern_rejects_bad_syntax() {
        let e = RoutePattern::parse("/v1/*/users").unwrap_err().to_string();
        assert!(e.starts_with("route pattern \"/v1/*/users\""), "{e}");
        assert!(e.contains("only allowed as the last character"), "{e}");
        assert!(RoutePattern::parse("get /x").is_err());
        assert!(RoutePattern::parse("GET *").is_err());
        assert!(RoutePattern::parse("**").is_err());
        assert!(RoutePattern::parse("").is_err());
        assert!(RoutePattern::parse("/**").is_err());
    }

    #[test]
    fn exact_pattern_matches_only_that_path() {
        let p = pat("/v1/charges");
        assert!(p.matches(&route("POST /v1/charges")));
        assert!(p.matches(&route("/v1/charges")));
        assert!(!p.matches(&route("POST /v1/charges/1")));
        assert!(!p.matches(&route("POST /v1/charge")));
    }

    #[test]
    fn prefix_pattern_matches_paths_below_it() {
        let p = pat("/v1/*");
        assert!(p.matches(&route("GET /v1/users")));
        assert!(p.matches(&route("GET /v1/")));
        assert!(!p.matches(&route("GET /v1")));
        assert!(!p.matches(&route("GET /v2/users")));
        assert!(pat("*").matches(&route("/")));
        assert!(pat("/*").matches(&route("DELETE /anything/at/all")));
    }

    #[test]
    fn method_pattern_requires_that_method() {
        let p = pat("POST /v1/*");
        assert!(p.matches(&route("POST /v1/charges")));
        assert!(!p.matches(&route("GET /v1/charges")));
        assert!(!p.matches(&route("/v1/charges")), "a route without method");
    }

    #[test]
    fn exact_path_beats_prefix() {
        assert!(pat("/v1/charges").specificity() > pat("POST /v1/charges*").specificity());
        assert!(pat("/v1/charges").specificity() > pat("POST /v1/*").specificity());
    }

    #[test]
    fn longer_prefix_beats_shorter_prefix() {
        assert!(pat("/v1/*").specificity() > pat("/*").specificity());
        assert!(pat("/v1/charges/*").specificity() > pat("POST /v1/*").specificity());
    }

    #[test]
    fn specific_method_beats_any_method() {
        assert!(pat("POST /v1/charges").specificity() > pat("/v1/charges").specificity());
        assert!(pat("POST /v1/*").specificity() > pat("* /v1/*").specificity());
    }

    proptest! {
        #[test]
        fn route_parse_never_panics(s in any::<String>()) {
            let _ = Route::parse(&s);
            let _ = RoutePattern::parse(&s);
        }

        #[test]
        fn route_parse_never_panics_on_near_routes(s in "[A-Za-z* ]{0,3}[ /*a-z\\x00-\\x7f\u{e9}]{0,12}") {
            if let Ok(r) = Route::parse(&s) {
                let shown = r.to_string();
                prop_assert_eq!(Route::parse(&shown).unwrap(), r);
            }
            if let Ok(p) = RoutePattern::parse(&s) {
                prop_assert_eq!(RoutePattern::parse(&p.to_string()).unwrap(), p);
            }
        }
    }
}
