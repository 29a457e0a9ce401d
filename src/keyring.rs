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

use std::path::Path;

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

    /// A fresh random single-key keyring, for a cluster started in one process
    /// (`dev-cluster`, tests): its members share it and nothing else knows it.
    pub fn generate() -> Keyring {
        use std::hash::{BuildHasher, Hasher};
        // std's RandomState is seeded from the OS's randomness once per process and
        // varied per instance; 16 draws hashed together make the secret.
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
        Keyring {
            keys: vec![blake3::derive_key(
                "ringlimit generated cluster key v1",
                &seed,
            )],
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let (a, b) = (Keyring::generate(), Keyring::generate());
        let tag = a.tag(Purpose::PeerCall, &[b"x"]);
        assert!(!b.verify(Purpose::PeerCall, &[b"x"], &tag));
        assert_eq!(format!("{a:?}"), "Keyring { keys: 1 }");
    }
}
