//! What a gateway's forward-auth subrequest says about the request it stands for, as a
//! check's client key and route. Pure: no socket, no clock.
//!
//! nginx (`auth_request`), Caddy (`forward_auth`), Traefik (`ForwardAuth`) and
//! ingress-nginx (`auth-url`) ask an auth service about every request before serving it,
//! passing the original request's method and URI in headers and its client in
//! `X-Forwarded-For` / `X-Real-IP`. Everything in those headers can be written by the
//! client too, so each is believed only as far as it can be:
//!
//! - the client key is a header the gateway passes (an API key, [`KeySource::Header`]),
//!   or the client's address ([`KeySource::ClientAddress`]): the TCP peer itself unless
//!   the peer is a trusted proxy, and then the first address, right to left in
//!   `X-Forwarded-For`, that is not a trusted proxy (each proxy appends the address it
//!   saw; what a client wrote itself stays to the left of the first untrusted hop and is
//!   never read). A peer that is not trusted cannot choose its key by writing headers.
//! - the route is the method and normalised path of `X-Original-Method` /
//!   `X-Forwarded-Method` and `X-Original-URI` / `X-Forwarded-Uri`. Rules compare paths
//!   byte for byte (`config::route`), so the path is normalised here the way a server
//!   resolves it (percent-encoded unreserved characters decoded, dot segments and
//!   repeated slashes removed, query and fragment dropped): `/v1/%6Cogin`, `/v1//login`
//!   and `/v1/x/../login?a=1` are all `/v1/login`, and no spelling of a path selects a
//!   looser rule than the path it reaches.

use std::net::IpAddr;

use crate::config::route::MAX_PATH_LEN;

/// Where the forward-auth endpoint takes the client key from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// A request header the gateway passes on or sets (an API key, a user id): its
    /// value is the key. A request without it is answered 401 and charges nothing.
    Header(http::HeaderName),
    /// The client's address (module doc): the peer, or what trusted proxies report.
    ClientAddress,
}

/// A network in CIDR notation (`10.0.0.0/8`, `::1/128`; a bare address is a /32 or
/// /128): the unit of the trusted-proxy list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpNet {
    addr: IpAddr,
    prefix: u8,
}

impl IpNet {
    /// Parses `addr[/prefix]`; an error says what is wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let addr: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| format!("{text:?} is not an address or network (e.g. 10.0.0.0/8)"))?;
        let addr = addr.to_canonical();
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{text:?}: the prefix length must be 0..={max}"))?,
        };
        Ok(IpNet { addr, prefix })
    }

    /// Whether `ip` is inside this network (an IPv4-mapped IPv6 address counts as the
    /// IPv4 address it maps).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for IpNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// How the forward-auth endpoint reads a gateway's subrequest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardAuthConfig {
    /// Where the client key comes from.
    pub key: KeySource,
    /// Peers whose `X-Forwarded-For` / `X-Real-IP` are believed (gateways, load
    /// balancers). Empty: every client is keyed by its TCP peer address.
    pub trusted_proxies: Vec<IpNet>,
}

impl Default for ForwardAuthConfig {
    fn default() -> Self {
        ForwardAuthConfig {
            key: KeySource::ClientAddress,
            trusted_proxies: Vec::new(),
        }
    }
}

impl ForwardAuthConfig {
    fn trusted(&self, ip: IpAddr) -> bool {
        self.trusted_proxies.iter().any(|net| net.contains(ip))
    }

    /// The client's address for a request from `peer` carrying `forwarded_for` (every
    /// `X-Forwarded-For` value, in order) and `real_ip` (`X-Real-IP`): see the module
    /// doc. Never an address a peer that is not trusted wrote.
    pub fn client_address(
        &self,
        peer: IpAddr,
        forwarded_for: &[&str],
        real_ip: Option<&str>,
    ) -> IpAddr {
        let peer = peer.to_canonical();
        if !self.trusted(peer) {
            return peer;
        }
        let mut nearest = None;
        let hops = forwarded_for.iter().rev().flat_map(|v| v.rsplit(','));
        for hop in hops {
            // An entry no proxy would write (garbage, "unknown"): the client wrote it,
            // so the nearest trusted hop is the last address vouched for.
            let Some(ip) = parse_hop(hop) else {
                return nearest.unwrap_or(peer);
            };
            if !self.trusted(ip) {
                return ip;
            }
            nearest = Some(ip);
        }
        if let Some(ip) = nearest {
            // Every hop is a trusted proxy: the farthest one is the client.
            return ip;
        }
        real_ip.and_then(parse_hop).unwrap_or(peer)
    }
}

/// One `X-Forwarded-For` entry: an address, optionally with a port (`1.2.3.4:5`,
/// `[::1]:5`).
fn parse_hop(text: &str) -> Option<IpAddr> {
    let text = text.trim();
    text.parse::<IpAddr>()
        .or_else(|_| text.parse::<std::net::SocketAddr>().map(|s| s.ip()))
        .ok()
        .map(|ip| ip.to_canonical())
}

/// The route of a forwarded request: `METHOD /normalised/path` (module doc). `uri` may
/// be origin-form (`/a?b`) or absolute-form (`http://host/a?b`).
pub fn route(method: &str, uri: &str) -> String {
    let method = method.trim().to_ascii_uppercase();
    format!("{method} {}", normalise_path(uri))
}

/// The path of `uri` as a server resolves it (module doc), at most
/// [`MAX_PATH_LEN`] bytes, every byte visible ASCII.
pub fn normalise_path(uri: &str) -> String {
    let uri = uri.trim();
    // Absolute-form: drop the scheme and authority.
    let uri = match uri.find("://") {
        Some(at) if !uri[..at].contains('/') => {
            let rest = &uri[at + 3..];
            rest.find('/').map_or("/", |p| &rest[p..])
        }
        _ => uri,
    };
    let path = uri.split(['?', '#']).next().unwrap_or("");
    let decoded = decode_unreserved(path);
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(decoded.len() + 1);
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if out.is_empty() || (decoded.ends_with('/') && !segments.is_empty()) {
        out.push('/');
    }
    if out.len() > MAX_PATH_LEN {
        // Whole characters: the text is ASCII after decoding.
        out.truncate(MAX_PATH_LEN);
    }
    out
}

/// Percent-escapes of unreserved characters (RFC 3986 2.3) decoded, every other escape
/// upper-cased, and any byte that is not visible ASCII escaped: one spelling per path.
fn decode_unreserved(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                let c = h * 16 + l;
                if c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~') {
                    out.push(char::from(c));
                } else {
                    out.push_str(&format!("%{c:02X}"));
                }
                i += 3;
                continue;
            }
        }
        if (0x21..=0x7e).contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
        i += 1;
    }
    out
}

fn hex(b: u8) -> Option<u8> {
    char::from(b).to_digit(16).map(|d| d as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn behind(proxies: &[&str]) -> ForwardAuthConfig {
        ForwardAuthConfig {
            key: KeySource::ClientAddress,
            trusted_proxies: proxies.iter().map(|p| IpNet::parse(p).unwrap()).collect(),
        }
    }

    #[test]
    fn networks_parse_and_contain_their_addresses_only() {
        let net = IpNet::parse("10.0.0.0/8").unwrap();
        assert!(net.contains(ip("10.255.1.2")));
        assert!(!net.contains(ip("11.0.0.1")));
        assert!(net.contains(ip("::ffff:10.1.1.1")), "IPv4-mapped");
        let host = IpNet::parse("127.0.0.1").unwrap();
        assert!(host.contains(ip("127.0.0.1")) && !host.contains(ip("127.0.0.2")));
        assert!(IpNet::parse("0.0.0.0/0").unwrap().contains(ip("8.8.8.8")));
        assert!(IpNet::parse("fd00::/8").unwrap().contains(ip("fd12::1")));
        assert!(!IpNet::parse("fd00::/8").unwrap().contains(ip("10.0.0.1")));
        for bad in ["10.0.0.0/33", "nonsense", "10.0.0.0/x", "::/129"] {
            assert!(IpNet::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_untrusted_peer_is_its_own_key_whatever_it_writes() {
        // The bypass closed: a client talking to the face directly (or through a proxy
        // not on the list) cannot pick a fresh key per request by writing headers.
        let config = behind(&["10.0.0.0/8"]);
        let peer = ip("203.0.113.7");
        assert_eq!(
            config.client_address(peer, &["1.2.3.4"], Some("5.6.7.8")),
            peer
        );
        assert_eq!(behind(&[]).client_address(peer, &["1.2.3.4"], None), peer);
    }

    #[test]
    fn behind_trusted_proxies_the_first_untrusted_hop_from_the_right_is_the_client() {
        let config = behind(&["10.0.0.0/8"]);
        let proxy = ip("10.0.0.2");
        // The client wrote "6.6.6.6" itself; the edge proxy appended what it saw.
        assert_eq!(
            config.client_address(proxy, &["6.6.6.6, 198.51.100.4, 10.0.0.9"], None),
            ip("198.51.100.4")
        );
        // Several header lines are one list, in order.
        assert_eq!(
            config.client_address(proxy, &["6.6.6.6", "198.51.100.4:4431"], None),
            ip("198.51.100.4")
        );
        // Garbage to the right of every real hop: the nearest vouched-for address.
        assert_eq!(
            config.client_address(proxy, &["198.51.100.4, nonsense, 10.0.0.9"], None),
            ip("10.0.0.9")
        );
        assert_eq!(config.client_address(proxy, &["junk"], None), proxy);
        // All trusted: the farthest. No header: X-Real-IP, else the peer.
        assert_eq!(
            config.client_address(proxy, &["10.1.1.1, 10.0.0.9"], None),
            ip("10.1.1.1")
        );
        assert_eq!(
            config.client_address(proxy, &[], Some("198.51.100.8")),
            ip("198.51.100.8")
        );
        assert_eq!(config.client_address(proxy, &[], Some("bad")), proxy);
    }

    #[test]
    fn every_spelling_of_a_path_is_one_route() {
        for spelling in [
            "/v1/login",
            "/v1/login?x=1",
            "/v1/login#top",
            "/v1//login",
            "/v1/./login",
            "/v1/x/../login",
            "/v1/%6Cogin",
            "/v1/%6cogin?a=%2F",
            "http://example.com/v1/login?q",
            "/../v1/login",
        ] {
            assert_eq!(route("get", spelling), "GET /v1/login", "{spelling}");
        }
        assert_eq!(normalise_path("/a/%2f"), "/a/%2F", "reserved stays escaped");
        assert_eq!(normalise_path("/dir/"), "/dir/", "a trailing slash is kept");
        assert_eq!(normalise_path(""), "/");
        assert_eq!(normalise_path("?only=query"), "/");
        assert_eq!(normalise_path("/ä b"), "/%C3%A4%20b", "visible ASCII only");
        assert_eq!(normalise_path("/%"), "/%", "a stray percent stays");
        assert_eq!(
            normalise_path(&format!("/{}", "a".repeat(1000))).len(),
            MAX_PATH_LEN
        );
    }
}
