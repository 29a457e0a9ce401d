//! One connection's commands as a state machine with no I/O: a decoded command in, its
//! reply (or the `CL.THROTTLE` call the checker must decide) out. What a connection
//! remembers between commands is here: the protocol version `HELLO` chose and whether
//! `AUTH` succeeded.

use bytes::BytesMut;

use super::parse::Args;
use super::reply::{self, Protocol};
use super::RespToken;

/// Wrong `AUTH` attempts one connection may make before it is closed: a token is long,
/// and guessing it must cost a new connection (each counted against the cap) per few
/// tries.
pub const MAX_AUTH_FAILURES: u32 = 3;

/// What the connection does after a command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The reply is written; go on.
    Replied,
    /// A `CL.THROTTLE` call for the checker; its reply goes here in the order of
    /// commands.
    Throttle(ThrottleCall),
    /// The reply is written; close the connection after sending it.
    Close,
}

/// A `CL.THROTTLE` call's arguments, converted (the check layer validates their values).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThrottleCall {
    /// The key, as UTF-8.
    pub key: String,
    /// `max_burst`.
    pub max_burst: i64,
    /// `count` per period.
    pub count: i64,
    /// `period`, seconds.
    pub period: i64,
    /// `quantity` (default 1).
    pub quantity: i64,
}

/// The commands this face knows: (name, arity as `COMMAND` reports it, flags). A
/// negative arity is a minimum.
const COMMANDS: &[(&str, i64, &[&str])] = &[
    ("cl.throttle", -5, &["write", "fast"]),
    ("ping", -1, &["fast", "stale"]),
    ("echo", 2, &["fast"]),
    ("hello", -1, &["fast", "no_auth", "noscript"]),
    ("auth", -2, &["fast", "no_auth", "noscript"]),
    ("quit", -1, &["fast", "no_auth"]),
    ("command", -1, &["loading", "stale"]),
    ("client", -2, &["noscript"]),
    ("select", 2, &["fast", "loading"]),
];

/// A connection's state between commands.
#[derive(Debug)]
pub struct Session {
    protocol: Protocol,
    authenticated: bool,
    failed_auths: u32,
}

impl Session {
    /// A new connection: RESP2, authenticated when no token is set.
    pub fn new(token: Option<&RespToken>) -> Self {
        Self {
            protocol: Protocol::Resp2,
            authenticated: token.is_none(),
            failed_auths: 0,
        }
    }

    /// The protocol replies are written in.
    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// Run one command: its reply is written to `out`, unless it is a `CL.THROTTLE`
    /// call, which is returned for the checker.
    pub fn command(
        &mut self,
        args: &Args,
        token: Option<&RespToken>,
        out: &mut BytesMut,
    ) -> Action {
        let Some(name) = args.first() else {
            return Action::Replied;
        };
        let is = |n: &str| name.eq_ignore_ascii_case(n.as_bytes());
        if is("quit") {
            reply::simple(out, "OK");
            return Action::Close;
        }
        if is("auth") {
            return self.auth(&args[1..], token, out);
        }
        if is("hello") {
            return self.hello(&args[1..], token, out);
        }
        if !self.authenticated {
            reply::error(out, "NOAUTH Authentication required.");
            return Action::Replied;
        }
        if is("cl.throttle") {
            return match throttle_call(args) {
                Ok(call) => Action::Throttle(call),
                Err(message) => {
                    reply::error(out, &message);
                    Action::Replied
                }
            };
        }
        if is("ping") {
            match args.len() {
                1 => reply::simple(out, "PONG"),
                2 => reply::bulk(out, &args[1]),
                _ => reply::error(out, &arity("ping")),
            }
        } else if is("echo") {
            match args.len() {
                2 => reply::bulk(out, &args[1]),
                _ => reply::error(out, &arity("echo")),
            }
        } else if is("command") {
            self.command_info(&args[1..], out);
        } else if is("client") {
            self.client(&args[1..], out);
        } else if is("select") {
            match args.get(1).map(|a| a.as_ref()) {
                Some(b"0") if args.len() == 2 => reply::simple(out, "OK"),
                Some(_) if args.len() == 2 => reply::error(out, "ERR DB index is out of range"),
                _ => reply::error(out, &arity("select")),
            }
        } else {
            reply::error(out, &unknown(args));
        }
        Action::Replied
    }

    /// `AUTH [username] password`: the token, as the `default` user's password.
    fn auth(
        &mut self,
        args: &[bytes::Bytes],
        token: Option<&RespToken>,
        out: &mut BytesMut,
    ) -> Action {
        let (user, password) = match args {
            [password] => (None, password),
            [user, password] => (Some(user), password),
            _ => {
                reply::error(out, &arity("auth"));
                return Action::Replied;
            }
        };
        let Some(token) = token else {
            reply::error(
                out,
                "ERR AUTH <password> called without any password configured for the default \
                 user. Are you sure your configuration is correct?",
            );
            return Action::Replied;
        };
        self.check_auth(user.map(|u| u.as_ref()), password, token, out)
    }

    /// Check a user and password against the token; writes `+OK` or the refusal.
    fn check_auth(
        &mut self,
        user: Option<&[u8]>,
        password: &[u8],
        token: &RespToken,
        out: &mut BytesMut,
    ) -> Action {
        let user_ok = user.is_none_or(|u| u == b"default");
        // The token is compared whatever the user, so the time taken says nothing.
        if token.matches(password) && user_ok {
            self.authenticated = true;
            reply::simple(out, "OK");
            return Action::Replied;
        }
        self.failed_auths += 1;
        reply::error(
            out,
            "WRONGPASS invalid username-password pair or user is disabled.",
        );
        if self.failed_auths >= MAX_AUTH_FAILURES {
            return Action::Close;
        }
        Action::Replied
    }

    /// `HELLO [protover [AUTH username password] [SETNAME name]]`.
    fn hello(
        &mut self,
        args: &[bytes::Bytes],
        token: Option<&RespToken>,
        out: &mut BytesMut,
    ) -> Action {
        let mut protocol = self.protocol;
        let mut rest = args;
        if let Some((version, tail)) = rest.split_first() {
            protocol = match version.as_ref() {
                b"2" => Protocol::Resp2,
                b"3" => Protocol::Resp3,
                v if integer(v).is_some() => {
                    reply::error(out, "NOPROTO unsupported protocol version");
                    return Action::Replied;
                }
                _ => {
                    reply::error(
                        out,
                        "ERR Protocol version is not an integer or out of range",
                    );
                    return Action::Replied;
                }
            };
            rest = tail;
        }
        let mut credentials = None;
        while let Some((option, tail)) = rest.split_first() {
            if option.eq_ignore_ascii_case(b"auth") && tail.len() >= 2 {
                credentials = Some((tail[0].clone(), tail[1].clone()));
                rest = &tail[2..];
            } else if option.eq_ignore_ascii_case(b"setname") && !tail.is_empty() {
                rest = &tail[1..];
            } else {
                reply::error(
                    out,
                    &format!("ERR Syntax error in HELLO option '{}'", shown(option)),
                );
                return Action::Replied;
            }
        }
        if let Some((user, password)) = credentials {
            let Some(token) = token else {
                reply::error(
                    out,
                    "ERR AUTH <password> called without any password configured for the \
                     default user. Are you sure your configuration is correct?",
                );
                return Action::Replied;
            };
            // Authenticate first; `+OK` is replaced by HELLO's own reply.
            let mut scratch = BytesMut::new();
            match self.check_auth(Some(user.as_ref()), &password, token, &mut scratch) {
                Action::Replied if self.authenticated => {}
                action => {
                    out.extend_from_slice(&scratch);
                    return action;
                }
            }
        }
        if !self.authenticated {
            reply::error(
                out,
                "NOAUTH HELLO must be called with the client already authenticated, \
                 otherwise the HELLO <proto> AUTH <user> <pass> option can be used to \
                 authenticate the client and select the RESP protocol version at the same \
                 time",
            );
            return Action::Replied;
        }
        self.protocol = protocol;
        let p = self.protocol;
        reply::map(out, 7, p);
        reply::bulk(out, b"server");
        reply::bulk(out, b"ringlimit");
        reply::bulk(out, b"version");
        reply::bulk(out, env!("CARGO_PKG_VERSION").as_bytes());
        reply::bulk(out, b"proto");
        reply::integer(out, p.version());
        reply::bulk(out, b"id");
        reply::integer(out, 1);
        reply::bulk(out, b"mode");
        reply::bulk(out, b"standalone");
        reply::bulk(out, b"role");
        reply::bulk(out, b"master");
        reply::bulk(out, b"modules");
        reply::array(out, 0);
        Action::Replied
    }

    /// `COMMAND`, `COMMAND COUNT`, `COMMAND INFO name…`, `COMMAND DOCS [name…]`: what
    /// redis-cli and client libraries ask on connecting.
    fn command_info(&self, args: &[bytes::Bytes], out: &mut BytesMut) {
        let entry = |out: &mut BytesMut, (name, arity, flags): &(&str, i64, &[&str])| {
            let key = i64::from(*name == "cl.throttle");
            reply::array(out, 6);
            reply::bulk(out, name.as_bytes());
            reply::integer(out, *arity);
            reply::array(out, flags.len());
            for f in *flags {
                reply::simple(out, f);
            }
            reply::integer(out, key);
            reply::integer(out, key);
            reply::integer(out, key);
        };
        let Some((sub, names)) = args.split_first() else {
            reply::array(out, COMMANDS.len());
            for c in COMMANDS {
                entry(out, c);
            }
            return;
        };
        if sub.eq_ignore_ascii_case(b"count") && names.is_empty() {
            reply::integer(out, COMMANDS.len() as i64);
        } else if sub.eq_ignore_ascii_case(b"info") {
            reply::array(out, names.len());
            for n in names {
                match COMMANDS
                    .iter()
                    .find(|c| n.eq_ignore_ascii_case(c.0.as_bytes()))
                {
                    Some(c) => entry(out, c),
                    None => reply::null(out, self.protocol),
                }
            }
        } else if sub.eq_ignore_ascii_case(b"docs") {
            // No documentation to offer: an empty map, which redis-cli takes as "no hints".
            reply::map(out, 0, self.protocol);
        } else {
            reply::error(
                out,
                &format!("ERR unknown subcommand '{}'. Try COMMAND HELP.", shown(sub)),
            );
        }
    }

    /// `CLIENT SETINFO|SETNAME …` (client libraries send them on connecting: accepted,
    /// kept nowhere), `CLIENT GETNAME`, `CLIENT ID`.
    fn client(&self, args: &[bytes::Bytes], out: &mut BytesMut) {
        let Some(sub) = args.first() else {
            reply::error(out, &arity("client"));
            return;
        };
        if sub.eq_ignore_ascii_case(b"setinfo") || sub.eq_ignore_ascii_case(b"setname") {
            reply::simple(out, "OK");
        } else if sub.eq_ignore_ascii_case(b"getname") {
            reply::null(out, self.protocol);
        } else if sub.eq_ignore_ascii_case(b"id") {
            reply::integer(out, 1);
        } else {
            reply::error(
                out,
                &format!("ERR unknown subcommand '{}'. Try CLIENT HELP.", shown(sub)),
            );
        }
    }
}

/// A `CL.THROTTLE key max_burst count period [quantity]` call, or the error reply.
fn throttle_call(args: &Args) -> Result<ThrottleCall, String> {
    if !(5..=6).contains(&args.len()) {
        return Err(arity("cl.throttle"));
    }
    let key = std::str::from_utf8(&args[1])
        .map_err(|_| "ERR key: must be valid UTF-8".to_string())?
        .to_string();
    let number = |i: usize| {
        integer(&args[i]).ok_or_else(|| "ERR value is not an integer or out of range".to_string())
    };
    Ok(ThrottleCall {
        key,
        max_burst: number(2)?,
        count: number(3)?,
        period: number(4)?,
        quantity: if args.len() == 6 { number(5)? } else { 1 },
    })
}

/// A decimal `i64` as Redis reads one: an optional `-`, digits, nothing else.
fn integer(text: &[u8]) -> Option<i64> {
    let s = std::str::from_utf8(text).ok()?;
    let digits = s.strip_prefix('-').unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn arity(command: &str) -> String {
    format!("ERR wrong number of arguments for '{command}' command")
}

/// A caller's bytes as shown in an error: lossy UTF-8, at most 32 characters.
fn shown(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).chars().take(32).collect()
}

/// Redis's answer to a command it does not know, naming it and its first arguments.
fn unknown(args: &Args) -> String {
    let mut message = format!(
        "ERR unknown command '{}', with args beginning with: ",
        shown(&args[0])
    );
    for a in args.iter().skip(1).take(3) {
        message.push_str(&format!("'{}' ", shown(a)));
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn args(words: &[&str]) -> Args {
        words.iter().map(|w| Bytes::from(w.to_string())).collect()
    }

    fn run(s: &mut Session, token: Option<&RespToken>, words: &[&str]) -> (Action, String) {
        let mut out = BytesMut::new();
        let action = s.command(&args(words), token, &mut out);
        (action, String::from_utf8_lossy(&out).into_owned())
    }

    fn token() -> RespToken {
        RespToken::new(b"0123456789abcdef-resp").unwrap()
    }

    #[test]
    fn throttle_calls_are_converted_and_bad_ones_answered() {
        let mut s = Session::new(None);
        let (a, out) = run(&mut s, None, &["cl.throttle", "user123", "15", "30", "60"]);
        assert!(out.is_empty());
        assert_eq!(
            a,
            Action::Throttle(ThrottleCall {
                key: "user123".into(),
                max_burst: 15,
                count: 30,
                period: 60,
                quantity: 1
            })
        );
        let (_, out) = run(&mut s, None, &["CL.THROTTLE", "k", "1", "2"]);
        assert_eq!(
            out,
            "-ERR wrong number of arguments for 'cl.throttle' command\r\n"
        );
        let (_, out) = run(&mut s, None, &["CL.THROTTLE", "k", "1", "2", "x"]);
        assert_eq!(out, "-ERR value is not an integer or out of range\r\n");
        let (_, out) = run(&mut s, None, &["CL.THROTTLE", "k", "1", "2", "3", "+4"]);
        assert_eq!(out, "-ERR value is not an integer or out of range\r\n");
        let mut bad = args(&["CL.THROTTLE", "k", "1", "2", "3"]);
        bad[1] = Bytes::from_static(b"\xff\xfe");
        let mut out = BytesMut::new();
        assert_eq!(s.command(&bad, None, &mut out), Action::Replied);
        assert_eq!(&out[..], b"-ERR key: must be valid UTF-8\r\n");
    }

    #[test]
    fn ping_echo_select_quit_and_unknown_commands() {
        let mut s = Session::new(None);
        assert_eq!(run(&mut s, None, &["PING"]).1, "+PONG\r\n");
        assert_eq!(run(&mut s, None, &["ping", "hi"]).1, "$2\r\nhi\r\n");
        assert_eq!(run(&mut s, None, &["echo", "x"]).1, "$1\r\nx\r\n");
        assert_eq!(run(&mut s, None, &["select", "0"]).1, "+OK\r\n");
        assert!(run(&mut s, None, &["select", "1"])
            .1
            .starts_with("-ERR DB index"));
        assert_eq!(
            run(&mut s, None, &["GET", "a", "b"]).1,
            "-ERR unknown command 'GET', with args beginning with: 'a' 'b' \r\n"
        );
        assert_eq!(
            run(&mut s, None, &["quit"]),
            (Action::Close, "+OK\r\n".into())
        );
    }

    #[test]
    fn with_a_token_nothing_but_auth_hello_and_quit_is_served_before_auth() {
        let t = token();
        let mut s = Session::new(Some(&t));
        for words in [
            &["PING"][..],
            &["CL.THROTTLE", "k", "1", "1", "1"],
            &["COMMAND"],
            &["CLIENT", "SETNAME", "x"],
        ] {
            assert_eq!(
                run(&mut s, Some(&t), words),
                (
                    Action::Replied,
                    "-NOAUTH Authentication required.\r\n".into()
                ),
                "{words:?}"
            );
        }
        assert!(run(&mut s, Some(&t), &["HELLO", "3"])
            .1
            .starts_with("-NOAUTH"));
        assert!(run(&mut s, Some(&t), &["AUTH", "wrong"])
            .1
            .starts_with("-WRONGPASS"));
        assert!(
            run(&mut s, Some(&t), &["AUTH", "bob", "0123456789abcdef-resp"])
                .1
                .starts_with("-WRONGPASS")
        );
        assert_eq!(
            run(
                &mut s,
                Some(&t),
                &["AUTH", "default", "0123456789abcdef-resp"]
            )
            .1,
            "+OK\r\n"
        );
        assert_eq!(run(&mut s, Some(&t), &["PING"]).1, "+PONG\r\n");
    }

    #[test]
    fn guessing_the_token_costs_the_connection() {
        let t = token();
        let mut s = Session::new(Some(&t));
        for _ in 1..MAX_AUTH_FAILURES {
            assert_eq!(run(&mut s, Some(&t), &["AUTH", "guess"]).0, Action::Replied);
        }
        assert_eq!(run(&mut s, Some(&t), &["AUTH", "guess"]).0, Action::Close);
    }

    #[test]
    fn auth_without_a_token_set_says_so() {
        let mut s = Session::new(None);
        assert!(run(&mut s, None, &["AUTH", "x"])
            .1
            .contains("without any password"));
    }

    #[test]
    fn hello_3_switches_to_resp3_and_can_authenticate() {
        let t = token();
        let mut s = Session::new(Some(&t));
        let (_, out) = run(
            &mut s,
            Some(&t),
            &[
                "HELLO",
                "3",
                "AUTH",
                "default",
                "0123456789abcdef-resp",
                "SETNAME",
                "me",
            ],
        );
        assert!(
            out.starts_with("%7\r\n$6\r\nserver\r\n$9\r\nringlimit\r\n"),
            "{out}"
        );
        assert!(out.contains("$5\r\nproto\r\n:3\r\n"), "{out}");
        assert_eq!(s.protocol(), Protocol::Resp3);
        assert_eq!(run(&mut s, Some(&t), &["CLIENT", "GETNAME"]).1, "_\r\n");
        let (_, out) = run(&mut s, Some(&t), &["HELLO", "2"]);
        assert!(out.starts_with("*14\r\n"), "{out}");
        assert_eq!(
            run(&mut s, Some(&t), &["HELLO", "4"]).1,
            "-NOPROTO unsupported protocol version\r\n"
        );
        assert!(run(&mut s, Some(&t), &["HELLO", "3", "BOGUS"])
            .1
            .starts_with("-ERR Syntax"));
        assert_eq!(
            s.protocol(),
            Protocol::Resp2,
            "a refused HELLO changes nothing"
        );
    }

    #[test]
    fn command_answers_what_redis_cli_asks() {
        let mut s = Session::new(None);
        let (_, out) = run(&mut s, None, &["COMMAND", "COUNT"]);
        assert_eq!(out, format!(":{}\r\n", COMMANDS.len()));
        let (_, out) = run(&mut s, None, &["COMMAND", "DOCS"]);
        assert_eq!(out, "*0\r\n");
        let (_, out) = run(&mut s, None, &["COMMAND", "INFO", "cl.throttle", "get"]);
        assert!(
            out.starts_with("*2\r\n*6\r\n$11\r\ncl.throttle\r\n:-5\r\n"),
            "{out}"
        );
        assert!(out.ends_with("$-1\r\n"), "{out}");
        let (_, out) = run(&mut s, None, &["COMMAND"]);
        assert!(out.starts_with(&format!("*{}\r\n", COMMANDS.len())));
    }
}
