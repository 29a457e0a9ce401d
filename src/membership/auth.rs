//! Authenticated gossip: chitchat's UDP datagrams carry a keyed MAC made with the
//! cluster key, so a process without the key can neither join nor speak for a member.
//!
//! # Datagram format
//!
//! ```text
//! | chitchat envelope (chitchat's own encoding) | sent_at: u64 LE, Unix ms | tag: 32 bytes |
//! ```
//!
//! `tag = keyring.tag(Purpose::Gossip, [envelope, sent_at])`: a BLAKE3 keyed hash under
//! the first key of the ring (see [`crate::keyring`]). A receiver accepts a tag made
//! with any key of its ring, so a key is rotated without downtime (add the new key
//! second everywhere, move it first everywhere, drop the old one).
//!
//! # What a receiver drops
//!
//! Every dropped datagram is counted in `ringlimit_gossip_rejected_total{reason}` (and in
//! [`GossipAuthStats`]) and logged at warn with its source address, at most once per
//! second (the line says how many were dropped since the previous one):
//!
//! * `malformed`: shorter than the trailer plus one byte, or carrying a valid tag but no
//!   decodable chitchat envelope;
//! * `tag`: the tag verifies under no key of the ring (no key, a wrong key, a
//!   modified datagram);
//! * `stale`: a valid tag, but `sent_at` is more than [`CLOCK_ALLOWANCE`] (60 s) before
//!   or after the receiver's wall clock. This bounds how long a captured datagram can be
//!   replayed. Within the allowance a replay only re-delivers state chitchat already
//!   has: its key-value versions and heartbeats only move forward, so an old datagram
//!   changes nothing. Members' clocks must agree within the allowance (NTP); a node
//!   whose clock is off by more is refused by everyone, and says so in their logs.
//!
//! The tag is checked before the clock, so an unauthenticated datagram is always
//! counted as `tag`, never as `stale`.
//!
//! # Encoding through chitchat's own socket
//!
//! Chitchat 0.13 keeps the envelope's `serialize`/`deserialize` crate-private (the
//! `Serializable`/`Deserializable` traits are public, but not implemented for
//! `ChitchatEnvelope`), so a [`Transport`] outside chitchat cannot encode or decode an
//! envelope itself. Each socket therefore keeps a private *codec*: a chitchat
//! `UdpSocket` and a plain socket connected to it, both on `127.0.0.1:0`. To send, the
//! envelope goes through chitchat's socket to the plain one, which reads chitchat's
//! bytes; they are sealed and sent from the gossip socket. To receive, a datagram is
//! verified first and only then its payload is passed over loopback to chitchat's
//! socket, which decodes it. Loopback delivery is synchronous, so each hop is one
//! syscall pair; nothing unauthenticated reaches the decoder. Forking chitchat to make
//! the codec public would remove the hop.
//!
//! # Size
//!
//! Chitchat sizes its messages for [`MAX_DATAGRAM_LEN`] (65,507 bytes, the largest
//! IPv4 UDP payload: its private `MAX_UDP_DATAGRAM_PAYLOAD_SIZE`) and offers no MTU hook
//! through [`Transport`]/[`Socket`]: the delta of a SYN-ACK or ACK is cut to fit that
//! bound, and a SYN carries the whole digest. The 40-byte trailer cannot be reserved
//! inside chitchat, so an envelope longer than `MAX_DATAGRAM_LEN - TRAILER_LEN`
//! (65,467 bytes) cannot be sent: [`Socket::send`] then refuses it with an error
//! (chitchat logs a failed SYN and ignores a failed reply), counts it in
//! `ringlimit_gossip_oversize_total` and warns; one over 65,507 bytes already fails on
//! the codec's loopback hop (`EMSGSIZE`), as it would in chitchat's own UDP socket. An
//! envelope that long needs a delta of over 65 kB of
//! state the peer lacks, or a digest of thousands of nodes; a ringlimit node publishes
//! three short key-values (about 150 bytes of delta and 50 of digest per node), so
//! that happens only in clusters of hundreds of nodes, where chitchat's full-digest SYN
//! is the limit anyway. [`GossipAuthStats::largest_sent`] reports the largest datagram
//! sent so far.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use chitchat::transport::{RecvOutcome, SendOutcome, Socket, Transport, UdpSocket, UdpTransport};
use chitchat::ChitchatEnvelope;
use tonic::async_trait;
use tracing::warn;

use crate::keyring::{Keyring, Purpose, TAG_LEN};

/// Largest datagram sent or accepted: the largest IPv4 UDP payload, chitchat's bound.
pub const MAX_DATAGRAM_LEN: usize = 65_507;

/// Bytes appended to every envelope: the 8-byte sent-at time and the tag.
pub const TRAILER_LEN: usize = 8 + TAG_LEN;

/// How far a datagram's sent-at time may be from the receiver's clock, either way.
pub const CLOCK_ALLOWANCE: Duration = Duration::from_secs(60);

/// Receive buffer: one byte more than any acceptable datagram, so a longer one (only
/// possible over IPv6) is seen as too long rather than silently truncated.
const RECV_BUF_LEN: usize = MAX_DATAGRAM_LEN + 1;

/// Minimum gap between two warnings about dropped (or unsendable) datagrams.
const WARN_EVERY_MS: u64 = 1_000;

/// The gossip transport a node uses: authenticated UDP with the cluster key, or
/// chitchat's plain UDP when the operator runs an insecure cluster (`None`).
pub fn transport(keyring: Option<Keyring>) -> Box<dyn Transport> {
    match keyring {
        Some(keyring) => Box::new(AuthUdpTransport::new(keyring)),
        None => Box::new(UdpTransport),
    }
}

/// Why a received datagram was dropped: the `reason` label of
/// `ringlimit_gossip_rejected_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// The tag verifies under no key of the ring.
    Tag,
    /// Authentic, but sent more than [`CLOCK_ALLOWANCE`] away from our clock.
    Stale,
    /// Too short to hold a trailer, or no chitchat envelope inside a valid tag.
    Malformed,
}

impl Reject {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reject::Tag => "tag",
            Reject::Stale => "stale",
            Reject::Malformed => "malformed",
        }
    }
}

/// Appends the trailer (sent-at time, tag) to an encoded envelope.
pub fn seal(keyring: &Keyring, datagram: &mut Vec<u8>, now_ms: u64) {
    let sent_at = now_ms.to_le_bytes();
    let tag = keyring.tag(Purpose::Gossip, &[datagram, &sent_at]);
    datagram.extend_from_slice(&sent_at);
    datagram.extend_from_slice(&tag);
}

/// Checks a received datagram and returns the encoded envelope inside it.
pub fn open<'a>(keyring: &Keyring, datagram: &'a [u8], now_ms: u64) -> Result<&'a [u8], Reject> {
    if datagram.len() <= TRAILER_LEN || datagram.len() > MAX_DATAGRAM_LEN {
        return Err(Reject::Malformed);
    }
    let (payload, trailer) = datagram.split_at(datagram.len() - TRAILER_LEN);
    let (sent_at, tag) = trailer.split_at(8);
    if !keyring.verify(Purpose::Gossip, &[payload, sent_at], tag) {
        return Err(Reject::Tag);
    }
    let sent_at = u64::from_le_bytes(sent_at.try_into().map_err(|_| Reject::Malformed)?);
    if now_ms.abs_diff(sent_at) > CLOCK_ALLOWANCE.as_millis() as u64 {
        return Err(Reject::Stale);
    }
    Ok(payload)
}

/// Counts of what an [`AuthUdpTransport`] refused, shared by every socket it opens.
#[derive(Debug, Default)]
pub struct GossipAuthStats {
    tag: AtomicU64,
    stale: AtomicU64,
    malformed: AtomicU64,
    oversize: AtomicU64,
    codec_failures: AtomicU64,
    largest_sent: AtomicU64,
    /// Wall-clock ms of the last warning, and drops since then.
    last_warn_ms: AtomicU64,
    since_warn: AtomicU64,
}

impl GossipAuthStats {
    /// Received datagrams dropped for `reason`.
    pub fn rejected(&self, reason: Reject) -> u64 {
        self.counter(reason).load(Ordering::Relaxed)
    }

    /// Received datagrams dropped for any reason.
    pub fn rejected_total(&self) -> u64 {
        [Reject::Tag, Reject::Stale, Reject::Malformed]
            .into_iter()
            .map(|r| self.rejected(r))
            .sum()
    }

    /// Envelopes too long to send with a trailer.
    pub fn oversize(&self) -> u64 {
        self.oversize.load(Ordering::Relaxed)
    }

    /// The largest datagram sent so far, trailer included, in bytes.
    pub fn largest_sent(&self) -> u64 {
        self.largest_sent.load(Ordering::Relaxed)
    }

    fn counter(&self, reason: Reject) -> &AtomicU64 {
        match reason {
            Reject::Tag => &self.tag,
            Reject::Stale => &self.stale,
            Reject::Malformed => &self.malformed,
        }
    }

    fn note_reject(&self, reason: Reject, from: SocketAddr, len: usize, now_ms: u64) {
        self.counter(reason).fetch_add(1, Ordering::Relaxed);
        metrics::counter!("ringlimit_gossip_rejected_total", "reason" => reason.as_str())
            .increment(1);
        if let Some(dropped) = self.may_warn(now_ms) {
            warn!(
                %from,
                reason = reason.as_str(),
                len,
                dropped_since_last_warning = dropped,
                "dropped a gossip datagram that failed authentication"
            );
        }
    }

    fn note_oversize(&self, to: SocketAddr, len: usize, now_ms: u64) {
        self.oversize.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("ringlimit_gossip_oversize_total").increment(1);
        if let Some(dropped) = self.may_warn(now_ms) {
            warn!(
                %to,
                len,
                max = MAX_DATAGRAM_LEN,
                dropped_since_last_warning = dropped,
                "gossip message too large to send with its authentication tag"
            );
        }
    }

    /// Authentic datagrams lost because the loopback codec failed (see the module docs).
    pub fn codec_failures(&self) -> u64 {
        self.codec_failures.load(Ordering::Relaxed)
    }

    fn note_codec_failure(&self, error: &anyhow::Error, now_ms: u64) {
        self.codec_failures.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("ringlimit_gossip_codec_failures_total").increment(1);
        if let Some(dropped) = self.may_warn(now_ms) {
            warn!(
                error = %format!("{error:#}"),
                dropped_since_last_warning = dropped,
                "gossip codec failed: datagram dropped, codec reopened"
            );
        }
    }

    /// Counts one event; `Some(events since the last warning)` if a warning is due now.
    fn may_warn(&self, now_ms: u64) -> Option<u64> {
        self.since_warn.fetch_add(1, Ordering::Relaxed);
        let last = self.last_warn_ms.load(Ordering::Relaxed);
        let due = last == 0 || now_ms.saturating_sub(last) >= WARN_EVERY_MS;
        if due
            && self
                .last_warn_ms
                .compare_exchange(last, now_ms.max(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            Some(self.since_warn.swap(0, Ordering::Relaxed))
        } else {
            None
        }
    }
}

/// Chitchat's UDP transport with every datagram authenticated by the cluster key
/// (module docs).
#[derive(Debug, Clone)]
pub struct AuthUdpTransport {
    keyring: Arc<Keyring>,
    stats: Arc<GossipAuthStats>,
}

impl AuthUdpTransport {
    /// A transport that signs with the first key of `keyring` and accepts any of its keys.
    pub fn new(keyring: Keyring) -> AuthUdpTransport {
        AuthUdpTransport {
            keyring: Arc::new(keyring),
            stats: Arc::default(),
        }
    }

    /// What the sockets of this transport refused so far.
    pub fn stats(&self) -> Arc<GossipAuthStats> {
        self.stats.clone()
    }
}

#[async_trait]
impl Transport for AuthUdpTransport {
    async fn open(&self, bind_addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>> {
        let socket = tokio::net::UdpSocket::bind(bind_addr)
            .await
            .with_context(|| format!("failed to bind to {bind_addr}/UDP for gossip"))?;
        Ok(Box::new(AuthUdpSocket {
            keyring: self.keyring.clone(),
            stats: self.stats.clone(),
            socket,
            codec: None,
            pending: None,
            codec_failing_since: None,
            buf: vec![0; RECV_BUF_LEN].into_boxed_slice(),
            datagram: Vec::with_capacity(MAX_DATAGRAM_LEN),
        }))
    }
}

/// How long the loopback codec may take to hand an envelope over. Loopback delivery
/// is synchronous, so this only expires for an authentic payload chitchat cannot
/// decode (chitchat's socket then logs it and keeps waiting) or a starved process.
const CODEC_TIMEOUT: Duration = Duration::from_secs(1);
/// How long the codec may fail on every use before the socket counts as broken.
const CODEC_GIVE_UP: Duration = Duration::from_secs(30);

/// Chitchat's envelope encoding, borrowed from chitchat itself.
///
/// Chitchat 0.13 keeps `ChitchatEnvelope::serialize`/`deserialize` crate-private, and
/// `Serializable`/`Deserializable` are not implemented for the envelope, so a
/// `Transport` outside chitchat cannot encode or decode one. Its own UDP socket can:
/// `codec` is a chitchat `UdpSocket` on `127.0.0.1:0` and `tap` a plain socket on
/// `127.0.0.1:0` connected to it (so it hears nothing but the codec). To encode, the
/// codec sends the envelope to the tap and the tap reads chitchat's bytes; to decode,
/// the tap sends a verified payload to the codec and the codec's `recv` decodes it.
/// Two loopback syscall pairs per datagram, a few per gossip round: negligible. No
/// unauthenticated byte ever reaches the codec, and a datagram reaching the codec from
/// anywhere but the tap is dropped.
struct Codec {
    codec: UdpSocket,
    tap: tokio::net::UdpSocket,
    tap_addr: SocketAddr,
}

impl Codec {
    async fn open() -> anyhow::Result<Codec> {
        let loopback: SocketAddr = ([127, 0, 0, 1], 0).into();
        let codec = UdpSocket::open(loopback).await?;
        let codec_addr = codec.local_addr()?;
        let tap = tokio::net::UdpSocket::bind(loopback).await?;
        tap.connect(codec_addr).await?;
        let tap_addr = tap.local_addr()?;
        Ok(Codec {
            codec,
            tap,
            tap_addr,
        })
    }
}

/// A verified payload handed to the codec, not yet decoded: where it came from, its
/// size on the wire, and until when the codec may take. Kept across a cancelled
/// `recv`, so the next call finishes it first and never pairs an envelope with the
/// wrong sender.
struct Pending {
    from_addr: SocketAddr,
    len: usize,
    deadline: tokio::time::Instant,
}

struct AuthUdpSocket {
    keyring: Arc<Keyring>,
    stats: Arc<GossipAuthStats>,
    socket: tokio::net::UdpSocket,
    /// Opened on first use; dropped (and reopened) after a timeout, so a late datagram
    /// in it can never be taken for a later one.
    codec: Option<Codec>,
    pending: Option<Pending>,
    /// Since when every use of the codec failed (`None` after a success).
    codec_failing_since: Option<tokio::time::Instant>,
    buf: Box<[u8]>,
    datagram: Vec<u8>,
}

/// Wall-clock Unix milliseconds (0 before 1970: a broken clock is refused by peers).
/// The system clock, not an injected one, on purpose: a datagram's freshness is about
/// real time between processes, not the decision clock tests stop and move.
fn now_ms() -> u64 {
    crate::clock::Clock::now_ms(&crate::clock::SystemClock)
}

/// Receive errors that do not mean the socket is broken: chitchat's own list, plus
/// the ICMP errors one unreachable peer can leave on a UDP socket (host or network
/// unreachable), which must not stop gossip with every other peer.
fn is_transient(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::OutOfMemory
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::HostUnreachable
            | std::io::ErrorKind::NetworkUnreachable
    )
}

/// The codec, opened on first use.
async fn ensure(codec: &mut Option<Codec>) -> anyhow::Result<&mut Codec> {
    if codec.is_none() {
        *codec = Some(Codec::open().await.context("gossip codec sockets")?);
    }
    Ok(codec.as_mut().expect("just opened"))
}

impl AuthUdpSocket {
    /// Drops the codec sockets (reopened on next use) and with them anything queued
    /// in them, including a pending payload, which is then lost like a dropped datagram.
    /// A codec failure: the datagram is lost and the codec reopened next time. Only
    /// once it has failed for [`CODEC_GIVE_UP`] without a single success is it an
    /// error of the socket, which ends gossip (and so the node: a codec that never
    /// works again would leave it deciding alone with a view nobody updates).
    fn codec_failed(&mut self, error: anyhow::Error, now_ms: u64) -> anyhow::Result<()> {
        self.reset_codec();
        self.stats.note_codec_failure(&error, now_ms);
        let now = tokio::time::Instant::now();
        let since = *self.codec_failing_since.get_or_insert(now);
        if now.saturating_duration_since(since) >= CODEC_GIVE_UP {
            return Err(error.context(format!(
                "gossip codec failed for {CODEC_GIVE_UP:?} without a success"
            )));
        }
        Ok(())
    }

    fn reset_codec(&mut self) {
        self.codec = None;
        self.pending = None;
    }

    /// Chitchat's encoding of `envelope`, in `self.datagram`.
    async fn encode(&mut self, envelope: ChitchatEnvelope) -> anyhow::Result<()> {
        let codec = ensure(&mut self.codec).await?;
        let tap_addr = codec.tap_addr;
        let sent = codec.codec.send(tap_addr, envelope).await?.num_bytes_sent;
        let deadline = tokio::time::Instant::now() + CODEC_TIMEOUT;
        loop {
            let read = tokio::time::timeout_at(deadline, codec.tap.recv(&mut self.buf)).await;
            match read {
                Ok(Ok(len)) if len == sent => break,
                Ok(Ok(_)) => continue, // a leftover: cannot be ours
                Ok(Err(error)) if is_transient(&error) => continue,
                Ok(Err(error)) => {
                    self.reset_codec();
                    return Err(error).context("gossip codec: reading the encoding");
                }
                Err(_) => {
                    self.reset_codec();
                    anyhow::bail!("gossip codec: no encoding within {CODEC_TIMEOUT:?}");
                }
            }
        }
        self.codec_failing_since = None;
        self.datagram.clear();
        self.datagram.extend_from_slice(&self.buf[..sent]);
        Ok(())
    }

    /// Waits for the codec to decode the pending payload. `Ok(None)`: it could not
    /// (counted as malformed).
    async fn finish_pending(&mut self) -> anyhow::Result<Option<RecvOutcome>> {
        let Some(pending) = self.pending.as_ref() else {
            return Ok(None);
        };
        let (from_addr, len, deadline) = (pending.from_addr, pending.len, pending.deadline);
        let Some(codec) = self.codec.as_mut() else {
            // The codec was reset since the payload was handed over: it is gone.
            self.pending = None;
            return Ok(None);
        };
        let tap_addr = codec.tap_addr;
        loop {
            match tokio::time::timeout_at(deadline, codec.codec.recv()).await {
                Ok(Ok(outcome)) if outcome.from_addr == tap_addr => {
                    self.pending = None;
                    self.codec_failing_since = None;
                    return Ok(Some(RecvOutcome {
                        from_addr,
                        envelope: outcome.envelope,
                        num_bytes_received: len,
                    }));
                }
                Ok(Ok(_)) => continue, // not from our tap: never authenticated
                Ok(Err(error)) => {
                    // The codec's sockets failed, not the gossip socket: drop this
                    // datagram like a lost one and open a fresh codec for the next.
                    self.codec_failed(error, now_ms())?;
                    return Ok(None);
                }
                Err(_) => {
                    // Authentic, but chitchat could not decode it.
                    self.reset_codec();
                    self.stats
                        .note_reject(Reject::Malformed, from_addr, len, now_ms());
                    return Ok(None);
                }
            }
        }
    }
}

#[async_trait]
impl Socket for AuthUdpSocket {
    fn local_addr(&self) -> anyhow::Result<SocketAddr> {
        self.socket
            .local_addr()
            .context("failed to get UDP socket address")
    }

    async fn send(
        &mut self,
        to: SocketAddr,
        envelope: ChitchatEnvelope,
    ) -> anyhow::Result<SendOutcome> {
        // Fails (EMSGSIZE on the loopback hop) for an envelope no UDP socket could send.
        self.encode(envelope).await?;
        let now = now_ms();
        let len = self.datagram.len() + TRAILER_LEN;
        if len > MAX_DATAGRAM_LEN {
            self.stats.note_oversize(to, len, now);
            anyhow::bail!(
                "gossip datagram to {to} would be {len} bytes with its tag, over {MAX_DATAGRAM_LEN}"
            );
        }
        seal(&self.keyring, &mut self.datagram, now);
        let num_bytes_sent = self
            .socket
            .send_to(&self.datagram, to)
            .await
            .context("failed to send chitchat message to peer")?;
        self.stats
            .largest_sent
            .fetch_max(num_bytes_sent as u64, Ordering::Relaxed);
        Ok(SendOutcome { num_bytes_sent })
    }

    /// Cancellable: a payload handed to the codec is remembered in `pending` and
    /// finished by the next call.
    async fn recv(&mut self) -> anyhow::Result<RecvOutcome> {
        loop {
            if self.pending.is_some() {
                if let Some(outcome) = self.finish_pending().await? {
                    return Ok(outcome);
                }
                continue;
            }
            let (len, from_addr) = match self.socket.recv_from(&mut self.buf).await {
                Ok(received) => received,
                Err(error) if is_transient(&error) => {
                    warn!(%error, "transient UDP recv error");
                    continue;
                }
                Err(error) => return Err(error).context("fatal UDP recv error"),
            };
            let now = now_ms();
            let payload = match open(&self.keyring, &self.buf[..len], now) {
                Ok(payload) => payload,
                Err(reason) => {
                    self.stats.note_reject(reason, from_addr, len, now);
                    continue;
                }
            };
            if !looks_like_an_envelope(payload) {
                self.stats
                    .note_reject(Reject::Malformed, from_addr, len, now);
                continue;
            }
            // A codec failure (no socket to open: the descriptor limit) loses this
            // datagram, like the network could, and is retried on the next one; only
            // the gossip socket itself failing stops gossip.
            let handed = match ensure(&mut self.codec).await {
                Ok(codec) => codec
                    .tap
                    .send(payload)
                    .await
                    .context("gossip codec: handing a payload over"),
                Err(error) => Err(error),
            };
            if let Err(error) = handed {
                self.codec_failed(error, now)?;
                continue;
            }
            // Loopback delivery is synchronous: the payload is queued at the codec.
            self.pending = Some(Pending {
                from_addr,
                len,
                deadline: tokio::time::Instant::now() + CODEC_TIMEOUT,
            });
        }
    }
}

/// Chitchat's envelope header: magic number 45,139 (LE), protocol version 0 or 1,
/// message type 0–3. Checked before the codec sees a payload, so the common ways a
/// member's payload can be undecodable are refused at once instead of by timeout.
fn looks_like_an_envelope(payload: &[u8]) -> bool {
    matches!(payload, [lo, hi, version, kind, ..]
        if u16::from_le_bytes([*lo, *hi]) == 45_139 && *version <= 1 && *kind <= 3)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chitchat::transport::UdpSocket as PlainUdpSocket;
    use chitchat::ChitchatMessage;
    use chitchat::ProtocolVersion;

    const A: &str = "0123456789abcdefghijklmnopqrstuvwxyz";
    const B: &str = "ZYXWVUTSRQPONMLKJIHGFEDCBA9876543210";
    const NOW: u64 = 1_800_000_000_000;

    fn ring(text: &str) -> Keyring {
        Keyring::from_text(text).unwrap()
    }

    fn sealed(keyring: &Keyring, payload: &[u8], at: u64) -> Vec<u8> {
        let mut d = payload.to_vec();
        seal(keyring, &mut d, at);
        d
    }

    /// Chitchat's own encoding of `envelope`, captured off a plain chitchat socket.
    async fn encoding(envelope: ChitchatEnvelope) -> Vec<u8> {
        let local: SocketAddr = ([127, 0, 0, 1], 0).into();
        let mut plain = PlainUdpSocket::open(local).await.unwrap();
        let raw = tokio::net::UdpSocket::bind(local).await.unwrap();
        plain
            .send(raw.local_addr().unwrap(), envelope)
            .await
            .unwrap();
        let mut buf = vec![0; RECV_BUF_LEN];
        let len = raw.recv(&mut buf).await.unwrap();
        buf.truncate(len);
        buf
    }

    fn bad_cluster() -> ChitchatEnvelope {
        ChitchatEnvelope {
            version: ProtocolVersion::V0,
            message: ChitchatMessage::BadCluster,
        }
    }

    fn syn(cluster_id: &str) -> ChitchatEnvelope {
        ChitchatEnvelope {
            version: ProtocolVersion::V0,
            message: ChitchatMessage::Syn {
                cluster_id: cluster_id.to_string(),
                digest: Default::default(),
            },
        }
    }

    #[test]
    fn a_sealed_datagram_opens_to_its_payload_under_any_key_of_the_ring() {
        let d = sealed(&ring(A), b"envelope", NOW);
        assert_eq!(d.len(), 8 + TRAILER_LEN);
        assert_eq!(open(&ring(A), &d, NOW), Ok(&b"envelope"[..]));
        let rotating = ring(&format!("{B}\n{A}"));
        assert_eq!(open(&rotating, &d, NOW), Ok(&b"envelope"[..]));
        // The rotating ring signs with B, which the old ring does not know.
        let from_rotating = sealed(&rotating, b"envelope", NOW);
        assert_eq!(open(&ring(A), &from_rotating, NOW), Err(Reject::Tag));
        assert_eq!(open(&ring(B), &from_rotating, NOW), Ok(&b"envelope"[..]));
    }

    /// Bypass closed: forging or altering gossip without the cluster key.
    #[test]
    fn a_wrong_key_or_any_changed_byte_is_refused_as_tag() {
        let d = sealed(&ring(A), b"envelope", NOW);
        assert_eq!(open(&ring(B), &d, NOW), Err(Reject::Tag));
        for i in 0..d.len() {
            let mut changed = d.clone();
            changed[i] ^= 0x01;
            assert_eq!(open(&ring(A), &changed, NOW), Err(Reject::Tag), "byte {i}");
        }
        // Moving the time into the payload (or the other way) changes the tag.
        let mut shifted = d.clone();
        shifted.insert(0, b'x');
        assert_eq!(open(&ring(A), &shifted, NOW), Err(Reject::Tag));
    }

    /// Bypass closed: replaying a captured datagram long after it was sent.
    #[test]
    fn a_datagram_outside_the_clock_allowance_is_stale() {
        let allowance = CLOCK_ALLOWANCE.as_millis() as u64;
        let k = ring(A);
        assert!(open(&k, &sealed(&k, b"e", NOW - allowance), NOW).is_ok());
        assert!(open(&k, &sealed(&k, b"e", NOW + allowance), NOW).is_ok());
        assert_eq!(
            open(&k, &sealed(&k, b"e", NOW - allowance - 1), NOW),
            Err(Reject::Stale)
        );
        assert_eq!(
            open(&k, &sealed(&k, b"e", NOW + allowance + 1), NOW),
            Err(Reject::Stale)
        );
        // The tag comes first: an unauthenticated old datagram is `tag`, not `stale`.
        assert_eq!(open(&ring(B), &sealed(&k, b"e", 0), NOW), Err(Reject::Tag));
    }

    #[test]
    fn short_or_oversize_datagrams_are_malformed() {
        let k = ring(A);
        for len in [0, 1, TRAILER_LEN] {
            assert_eq!(open(&k, &vec![0; len], NOW), Err(Reject::Malformed));
        }
        let big = sealed(&k, &vec![0; MAX_DATAGRAM_LEN - TRAILER_LEN + 1], NOW);
        assert_eq!(open(&k, &big, NOW), Err(Reject::Malformed));
        let largest = sealed(&k, &vec![0; MAX_DATAGRAM_LEN - TRAILER_LEN], NOW);
        assert!(open(&k, &largest, NOW).is_ok());
    }

    #[test]
    fn warnings_are_rate_limited_to_one_per_second() {
        let stats = GossipAuthStats::default();
        assert_eq!(stats.may_warn(NOW), Some(1));
        assert_eq!(stats.may_warn(NOW + 1), None);
        assert_eq!(stats.may_warn(NOW + 999), None);
        assert_eq!(stats.may_warn(NOW + 1_000), Some(3));
        assert_eq!(stats.may_warn(NOW + 1_001), None);
    }

    /// Over real sockets: a sealed envelope arrives; junk, a plain chitchat datagram
    /// and one under another key are dropped and counted, and `recv` keeps waiting.
    #[tokio::test]
    async fn sockets_deliver_authentic_envelopes_and_count_the_rest() {
        let local: SocketAddr = ([127, 0, 0, 1], 0).into();
        let ours = AuthUdpTransport::new(ring(A));
        let theirs = AuthUdpTransport::new(ring(B));
        let mut rx = ours.open(local).await.unwrap();
        let to = rx.local_addr().unwrap();
        let mut tx = ours.open(local).await.unwrap();
        let mut outsider = theirs.open(local).await.unwrap();
        let plain = PlainUdpSocket::open(local).await.unwrap();
        let mut plain: Box<dyn Socket> = Box::new(plain);
        let raw = tokio::net::UdpSocket::bind(local).await.unwrap();

        raw.send_to(b"junk", to).await.unwrap();
        plain.send(to, syn(&"p".repeat(64))).await.unwrap();
        outsider.send(to, bad_cluster()).await.unwrap();
        let mut authentic_but_junk = b"not an envelope".to_vec();
        seal(&ring(A), &mut authentic_but_junk, now_ms());
        raw.send_to(&authentic_but_junk, to).await.unwrap();
        // A valid header with a truncated body: only chitchat's decoder can tell.
        let mut truncated = encoding(syn("c")).await;
        truncated.truncate(truncated.len() - 1);
        seal(&ring(A), &mut truncated, now_ms());
        raw.send_to(&truncated, to).await.unwrap();
        let mut stale = encoding(bad_cluster()).await;
        seal(&ring(A), &mut stale, now_ms() - 61_000);
        raw.send_to(&stale, to).await.unwrap();
        let sent = tx.send(to, bad_cluster()).await.unwrap();

        let got = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("the authentic datagram arrives")
            .unwrap();
        assert_eq!(got.envelope, bad_cluster());
        assert_eq!(got.from_addr, tx.local_addr().unwrap());
        assert_eq!(got.num_bytes_received, sent.num_bytes_sent);
        assert_eq!(
            sent.num_bytes_sent,
            encoding(bad_cluster()).await.len() + TRAILER_LEN
        );
        let stats = ours.stats();
        assert_eq!(
            stats.rejected(Reject::Malformed),
            3,
            "junk, authentic junk, authentic truncated"
        );
        assert_eq!(stats.rejected(Reject::Tag), 2, "plain chitchat, other key");
        assert_eq!(stats.rejected(Reject::Stale), 1);
        assert_eq!(stats.rejected_total(), 6);

        // The codec was reset after the undecodable one; gossip goes on.
        tx.send(to, syn("again")).await.unwrap();
        let got = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("still delivering")
            .unwrap();
        assert_eq!(got.envelope, syn("again"));
        assert_eq!(theirs.stats().rejected_total(), 0);
    }

    #[tokio::test]
    async fn an_envelope_too_long_for_its_tag_is_refused_at_send() {
        let local: SocketAddr = ([127, 0, 0, 1], 0).into();
        let t = AuthUdpTransport::new(ring(A));
        let mut tx = t.open(local).await.unwrap();
        let to = tx.local_addr().unwrap();
        // A SYN's cluster id is sent as is; make the envelope just too long.
        let fits = |extra: usize| syn(&"x".repeat(extra));
        let overhead = encoding(fits(0)).await.len();
        let limit = MAX_DATAGRAM_LEN - TRAILER_LEN - overhead;
        let sent = tx.send(to, fits(limit)).await.unwrap();
        assert_eq!(sent.num_bytes_sent, MAX_DATAGRAM_LEN);
        assert!(tx.send(to, fits(limit + 1)).await.is_err());
        // Longer than chitchat's own bound: the loopback hop already refuses it.
        assert!(tx.send(to, fits(MAX_DATAGRAM_LEN)).await.is_err());
        assert_eq!(t.stats().oversize(), 1);
        assert_eq!(t.stats().largest_sent(), MAX_DATAGRAM_LEN as u64);
    }
}
