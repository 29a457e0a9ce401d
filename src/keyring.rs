//! The cluster key: what a member proves on every peer call and gossip datagram.
//!
//! A keyring holds one or more keys. The first signs what this node sends; every key
//! verifies what it receives. Rotation without downtime, as in hashicorp memberlist's
//! keyring: add the new key as a second line on every node, then move it to the first
//! line on every node, then drop the old one.
//!
//! The file holds one secret per line (blank lines and `#` comments are skipped), each
//! at least [`MIN_SECRET_LEN`] characters, e.g. `head -c 32 /dev/urandom | base64`. A
//! secret is turned into a 32-byte key with BLAKE3's key derivation, and tags are
//! BLAKE3 keyed hashes (a MAC) over a purpose string and the data, so a tag made for a
//! gossip datagram can never pass as a peer call's and the other way round.
//!
//! Pure: no I/O except [`Keyring::from_file`].

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

/// Shortest secret accepted, in characters: 32 characters of base64 carry 192 bits.
pub const MIN_SECRET_LEN: usize = 32;

/// Length of a tag in bytes.
pub const TAG_LEN: usize = 32;

/// What a tag is for: part of every tag, so one purpose's tags are useless for another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A gRPC call to a peer's `Peer` service.
    PeerCall,
    /// A gossip datagram.
    Gossip,
}

impl Purpose {
    fn context(self) -> &'static [u8] {
        match self {
            Purpose::PeerCall => b"ringlimit peer call v1\0",
            Purpose::Gossip => b"ringlimit gossip datagram v1\0",
        }
    }
}

/// Why a keyring could not be built.
#[derive(Debug, thiserror::Error)]
pub enum KeyringError {
    /// The file could not be read.
    #[error("cluster secret file {path}: {error}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        error: std::io::Error,
    },
    /// A secret is too short to be a key.
    #[error("cluster secret on line {line} is {len} characters; at least {MIN_SECRET_LEN} are required (e.g. `head -c 32 /dev/urandom | base64`)")]
    TooShort {
        /// 1-based line number.
        line: usize,
        /// Its length.
        len: usize,
    },
    /// The file holds no secret.
    #[error("the cluster secret file holds no secret")]
    Empty,
}

/// The keys of a cluster: the first signs, all verify.
#[derive(Clone)]
pub struct Keyring {
    keys: Vec<[u8; 32]>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        f.debug_struct("Keyring")
            .field("keys", &self.keys.len())
            .finish()
    }
}

impl Keyring {
    /// Read a keyring from a secret file (see the module docs for the format).
    pub fn from_file(path: &Path) -> Result<Keyring, KeyringError> {
        let text = std::fs::read_to_string(path).map_err(|error| KeyringError::Io {
            path: path.display().to_string(),
            error,
        })?;
        Keyring::from_text(&text)
    }

    /// A keyring from the text of a secret file.
    pub fn from_text(text: &str) -> Result<Keyring, KeyringError> {
        let mut keys = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let secret = line.trim();
            if secret.is_empty() || secret.starts_with('#') {
                continue;
            }
            if secret.chars().count() < MIN_SECRET_LEN {
                return Err(KeyringError::TooShort {
                    line: i + 1,
                    len: secret.chars().count(),
                });
            }
            keys.push(blake3::derive_key(
                "ringlimit cluster key v1",
                secret.as_bytes(),
            ));
        }
        if keys.is_empty() {
            return Err(KeyringError::Empty);
        }
        Ok(Keyring { keys })
    }

    /// Number of keys (the first signs).
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Always false: a keyring has at least one key.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The tag of `data` for `purpose`, with the signing key.
    pub fn tag(&self, purpose: Purpose, data: &[&[u8]]) -> [u8; TAG_LEN] {
        Self::tag_with(&self.keys[0], purpose, data)
    }

    /// Whether `tag` is the tag of `data` for `purpose` under any key of the ring
    /// (compared in constant time).
    pub fn verify(&self, purpose: Purpose, data: &[&[u8]], tag: &[u8]) -> bool {
        let Ok(tag) = <[u8; TAG_LEN]>::try_from(tag) else {
            return false;
        };
        let tag = blake3::Hash::from_bytes(tag);
        self.keys
            .iter()
            .any(|key| blake3::Hash::from_bytes(Self::tag_with(key, purpose, data)) == tag)
    }

    fn tag_with(key: &[u8; 32], purpose: Purpose, data: &[&[u8]]) -> [u8; TAG_LEN] {
        let mut mac = blake3::Hasher::new_keyed(key);
        mac.update(purpose.context());
        for part in data {
            // Length-prefixed, so moving bytes between parts changes the tag.
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        *mac.finalize().as_bytes()
    }
}

/// A fresh random secret (64 hex characters) in the secret file format.
///
/// std's `RandomState` is seeded from the OS's randomness once per process and varied
/// per instance; several draws, the time and the pid are hashed together.
pub fn generate_secret() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut seed = Vec::with_capacity(16 * 8);
    for _ in 0..16 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.write_u32(std::process::id());
        seed.extend_from_slice(&h.finish().to_le_bytes());
    }
    hex(blake3::hash(&seed).as_bytes())
}

/// Metadata header carrying a peer call's proof.
pub const CALL_HEADER: &str = "x-ringlimit-peer-auth";

/// How far a call's timestamp may be from the receiver's clock, either way, in ms.
/// Members keep their clocks within the handoff's 5 s allowance; this is wider so a
/// call never fails on skew before a handoff would.
pub const CALL_SKEW_MS: u64 = 30_000;

/// Why a peer call's proof was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallRefused {
    /// No proof header at all.
    #[error("no {CALL_HEADER} header: peer calls need the cluster key")]
    Missing,
    /// The header is not `v1 <node> <ms> <nonce> <tag>`.
    #[error("malformed {CALL_HEADER} header")]
    Malformed,
    /// The tag does not verify under any key of the ring.
    #[error("the call's tag does not verify under the cluster key")]
    BadTag,
    /// The timestamp is outside the allowance.
    #[error("the call was signed at {at} ms, more than {CALL_SKEW_MS} ms from this node's clock")]
    Stale {
        /// The call's timestamp.
        at: u64,
    },
    /// The same (node, nonce) was seen within the allowance: a replay.
    #[error("replayed call")]
    Replayed,
}

/// What a verified call proves: who signed it, when, with which nonce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallProof {
    /// The signing member's node id (shared with the replay guard's two records).
    pub from: Arc<str>,
    /// Its clock when it signed, Unix ms.
    pub at: u64,
    /// Unique per call of that member.
    pub nonce: u64,
}

impl Keyring {
    /// The proof header value for a call to `path` by `from` at `at` with `nonce`.
    ///
    /// It binds the method path, the caller, the time and a nonce, not the message
    /// body: it keeps out anyone without the key and, with the receiver's replay
    /// cache, anyone replaying a captured call; an active attacker who can rewrite the
    /// peer network's TCP streams is out of its reach (docs/security.md).
    pub fn sign_call(&self, path: &str, from: &str, at: u64, nonce: u64) -> String {
        let tag = self.tag(
            Purpose::PeerCall,
            &[
                path.as_bytes(),
                from.as_bytes(),
                &at.to_le_bytes(),
                &nonce.to_le_bytes(),
            ],
        );
        // One allocation, sized up front: this runs on every forwarded batch.
        let mut header = String::with_capacity(4 + from.len() + 21 + 17 + 2 * TAG_LEN + 1);
        write!(header, "v1 {from} {at} {nonce:016x} ").expect("writing to a String");
        push_hex(&mut header, &tag);
        header
    }

    /// Check a call's proof header against `path` and this node's clock `now`.
    /// Replays are the caller's to catch ([`ReplayGuard`]).
    pub fn verify_call(
        &self,
        header: Option<&str>,
        path: &str,
        now: u64,
    ) -> Result<CallProof, CallRefused> {
        let header = header.ok_or(CallRefused::Missing)?;
        let mut parts = header.split(' ');
        let (Some("v1"), Some(from), Some(at), Some(nonce), Some(tag), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(CallRefused::Malformed);
        };
        let at: u64 = at.parse().map_err(|_| CallRefused::Malformed)?;
        let nonce = u64::from_str_radix(nonce, 16).map_err(|_| CallRefused::Malformed)?;
        let tag = unhex_tag(tag).ok_or(CallRefused::Malformed)?;
        let data: [&[u8]; 4] = [
            path.as_bytes(),
            from.as_bytes(),
            &at.to_le_bytes(),
            &nonce.to_le_bytes(),
        ];
        if !self.verify(Purpose::PeerCall, &data, &tag) {
            return Err(CallRefused::BadTag);
        }
        if at.abs_diff(now) > CALL_SKEW_MS {
            return Err(CallRefused::Stale { at });
        }
        Ok(CallProof {
            from: Arc::from(from),
            at,
            nonce,
        })
    }
}

/// Remembers the (node, nonce) of every call verified within the last
/// [`CALL_SKEW_MS`], so a captured call cannot be sent again: older calls are refused
/// as stale anyway. Bounded: at most `cap` entries; when full, the oldest go first
/// (a flood of valid calls needs the key).
#[derive(Debug)]
pub struct ReplayGuard {
    seen: std::collections::HashSet<(Arc<str>, u64)>,
    order: std::collections::VecDeque<(u64, Arc<str>, u64)>,
    cap: usize,
}

impl ReplayGuard {
    /// A guard remembering at most `cap` calls.
    pub fn new(cap: usize) -> Self {
        Self {
            seen: Default::default(),
            order: Default::default(),
            cap: cap.max(1),
        }
    }

    /// Admit `proof` at `now` once; a second time within the allowance is a replay.
    pub fn admit(&mut self, proof: &CallProof, now: u64) -> Result<(), CallRefused> {
        while let Some((at, _, _)) = self.order.front() {
            if now.saturating_sub(*at) <= 2 * CALL_SKEW_MS && self.order.len() < self.cap {
                break;
            }
            if let Some((_, from, nonce)) = self.order.pop_front() {
                self.seen.remove(&(from, nonce));
            }
        }
        if !self.seen.insert((proof.from.clone(), proof.nonce)) {
            return Err(CallRefused::Replayed);
        }
        self.order.push_back((now, proof.from.clone(), proof.nonce));
        Ok(())
    }
}

fn hex(bytes: &[u8]) -> String {
    let mut text = String::with_capacity(2 * bytes.len());
    push_hex(&mut text, bytes);
    text
}

/// Append `bytes` as lowercase hex, without an allocation per byte.
fn push_hex(text: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        text.push(DIGITS[usize::from(b >> 4)] as char);
        text.push(DIGITS[usize::from(b & 0xf)] as char);
    }
}

/// A tag in hex, decoded in place: `None` unless exactly [`TAG_LEN`] bytes of hex.
fn unhex_tag(text: &str) -> Option<[u8; TAG_LEN]> {
    let text = text.as_bytes();
    if text.len() != 2 * TAG_LEN {
        return None;
    }
    let digit = |c: u8| char::from(c).to_digit(16).map(|d| d as u8);
    let mut tag = [0; TAG_LEN];
    for (byte, pair) in tag.iter_mut().zip(text.chunks_exact(2)) {
        *byte = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(tag)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signed_call_verifies_once_for_its_path_and_within_the_allowance() {
        let ring = Keyring::from_text(A).unwrap();
        let path = "/ringlimit.peer.v1.Peer/Refund";
        let header = ring.sign_call(path, "node-a", 1_000_000, 7);
        let proof = ring.verify_call(Some(&header), path, 1_000_500).unwrap();
        assert_eq!(
            (&*proof.from, proof.at, proof.nonce),
            ("node-a", 1_000_000, 7)
        );
        let mut guard = ReplayGuard::new(100);
        assert_eq!(guard.admit(&proof, 1_000_500), Ok(()));
        assert_eq!(guard.admit(&proof, 1_000_600), Err(CallRefused::Replayed));

        assert_eq!(
            ring.verify_call(Some(&header), "/ringlimit.peer.v1.Peer/Install", 1_000_500),
            Err(CallRefused::BadTag),
            "a proof for one method is useless for another"
        );
        assert_eq!(
            ring.verify_call(Some(&header), path, 1_000_000 + CALL_SKEW_MS + 1),
            Err(CallRefused::Stale { at: 1_000_000 })
        );
        assert_eq!(ring.verify_call(None, path, 0), Err(CallRefused::Missing));
        assert_eq!(
            ring.verify_call(Some("v1 a b c d"), path, 0),
            Err(CallRefused::Malformed)
        );
        let forged = header.replace("node-a", "node-b");
        assert_eq!(
            ring.verify_call(Some(&forged), path, 1_000_000),
            Err(CallRefused::BadTag),
            "the caller's id is bound"
        );
        let other = Keyring::from_text(B).unwrap();
        assert_eq!(
            other.verify_call(Some(&header), path, 1_000_000),
            Err(CallRefused::BadTag)
        );
    }

    #[test]
    fn the_replay_guard_forgets_calls_older_than_the_allowance_and_stays_bounded() {
        let proof = |nonce| CallProof {
            from: "a".into(),
            at: 0,
            nonce,
        };
        let mut guard = ReplayGuard::new(3);
        for nonce in 0..10 {
            guard.admit(&proof(nonce), 0).unwrap();
        }
        assert!(guard.order.len() <= 3 && guard.seen.len() <= 3);
        let mut guard = ReplayGuard::new(100);
        guard.admit(&proof(1), 0).unwrap();
        assert!(
            guard.admit(&proof(1), 3 * CALL_SKEW_MS).is_ok(),
            "forgotten, and stale anyway"
        );
    }

    #[test]
    fn a_tag_travels_as_64_hex_digits_and_nothing_else_decodes() {
        let tag: [u8; TAG_LEN] = std::array::from_fn(|i| (i * 37) as u8);
        let text = hex(&tag);
        assert_eq!(text.len(), 2 * TAG_LEN);
        assert_eq!(&text[..6], "00254a");
        assert_eq!(unhex_tag(&text), Some(tag));
        assert_eq!(unhex_tag(&text.to_uppercase()), Some(tag));
        assert_eq!(unhex_tag(&text[2..]), None, "too short");
        assert_eq!(unhex_tag(&format!("{text}00")), None, "too long");
        assert_eq!(unhex_tag(&text.replacen('0', "g", 1)), None, "not hex");
        assert_eq!(
            unhex_tag(&text.replacen("00", "+0", 1)),
            None,
            "a sign is not a digit"
        );
    }

    const A: &str = "0123456789abcdefghijklmnopqrstuvwxyz";
    const B: &str = "ZYXWVUTSRQPONMLKJIHGFEDCBA9876543210";

    #[test]
    fn a_tag_verifies_under_its_key_and_purpose_only() {
        let ring = Keyring::from_text(A).unwrap();
        let tag = ring.tag(
            Purpose::PeerCall,
            &[b"/ringlimit.peer.v1.Peer/Forward", b"a"],
        );
        assert!(ring.verify(
            Purpose::PeerCall,
            &[b"/ringlimit.peer.v1.Peer/Forward", b"a"],
            &tag
        ));
        assert!(!ring.verify(
            Purpose::Gossip,
            &[b"/ringlimit.peer.v1.Peer/Forward", b"a"],
            &tag
        ));
        assert!(!ring.verify(
            Purpose::PeerCall,
            &[b"/ringlimit.peer.v1.Peer/Refund", b"a"],
            &tag
        ));
        assert!(!ring.verify(
            Purpose::PeerCall,
            &[b"/ringlimit.peer.v1.Peer/Forwar", b"da"],
            &tag
        ));
        let other = Keyring::from_text(B).unwrap();
        assert!(!other.verify(
            Purpose::PeerCall,
            &[b"/ringlimit.peer.v1.Peer/Forward", b"a"],
            &tag
        ));
        assert!(!ring.verify(Purpose::PeerCall, &[b"x"], &tag[..31]));
    }

    #[test]
    fn a_rotated_ring_accepts_both_keys_and_signs_with_the_first() {
        let old = Keyring::from_text(A).unwrap();
        let rotating = Keyring::from_text(&format!("# new first\n{B}\n\n{A}\n")).unwrap();
        assert_eq!(rotating.len(), 2);
        let from_old = old.tag(Purpose::Gossip, &[b"d"]);
        assert!(rotating.verify(Purpose::Gossip, &[b"d"], &from_old));
        let from_new = rotating.tag(Purpose::Gossip, &[b"d"]);
        assert!(!old.verify(Purpose::Gossip, &[b"d"], &from_new));
    }

    #[test]
    fn short_or_missing_secrets_are_refused() {
        assert!(matches!(
            Keyring::from_text("short"),
            Err(KeyringError::TooShort { line: 1, len: 5 })
        ));
        assert!(matches!(
            Keyring::from_text("# only\n\n"),
            Err(KeyringError::Empty)
        ));
    }

    #[test]
    fn generated_rings_differ_and_never_print_their_keys() {
        let ring = || Keyring::from_text(&generate_secret()).unwrap();
        let (a, b) = (ring(), ring());
        let tag = a.tag(Purpose::PeerCall, &[b"x"]);
        assert!(!b.verify(Purpose::PeerCall, &[b"x"], &tag));
        assert_eq!(format!("{a:?}"), "Keyring { keys: 1 }");
    }
}
