//! A counter's identity: (rule, client key, route part), computed once when a check is
//! planned and carried to the owner's store, the deny cache and a handoff.
//!
//! Every part is length-prefixed, so no two different triples encode alike, and the
//! hashes are seeded with fixed values, so every node computes the same identity for the
//! same counter: state handed to another node lands on the same entry there.

use ringlimit_ring::Ring;

/// Seed of [`KeyId::disc`]: fixed, so every node computes the same identity.
const DISC_SEED: u64 = 0x7269_6e67_6c69_6d74;

/// The identity of one counter: (rule, client key, route part), each part length-prefixed
/// so that no two different triples encode to the same bytes (`("ab","c")` vs `("a","bc")`).
///
/// The route part is empty for a rule counting per client (the default: one budget for
/// every route the rule matches) and the normalised route (method + path, no query) for a
/// rule with `per = "route"`; see `config::rules::CountPer`. An empty part still has its
/// length prefix, so it never collides with a route.
///
/// The store keeps only a [`KeyId`] derived from it; the encoding remains the key of
/// the deny cache and of [`KeyId::of`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StateKey(Box<[u8]>);

impl StateKey {
    /// Encode into `buf` (cleared first) so the hot path can reuse one allocation.
    pub fn encode_into(buf: &mut Vec<u8>, rule: &str, client: &[u8], route: &str) {
        buf.clear();
        for part in [rule.as_bytes(), client, route.as_bytes()] {
            // Parts are validated to be far below 4 GiB long; u32 keeps the prefix small.
            buf.extend_from_slice(&(part.len() as u32).to_le_bytes());
            buf.extend_from_slice(part);
        }
    }

    /// Build an owned key.
    pub fn new(rule: &str, client: &[u8], route: &str) -> Self {
        let mut buf = Vec::new();
        Self::encode_into(&mut buf, rule, client, route);
        Self(buf.into_boxed_slice())
    }

    /// The encoded bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Decode back into (rule, client, route); `None` if the bytes are not a valid encoding.
    pub fn decode(bytes: &[u8]) -> Option<(&str, &[u8], &str)> {
        let mut rest = bytes;
        let mut parts: [&[u8]; 3] = [&[]; 3];
        for part in &mut parts {
            let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
            *part = rest.get(4..4 + len)?;
            rest = &rest[4 + len..];
        }
        if !rest.is_empty() {
            return None;
        }
        Some((
            std::str::from_utf8(parts[0]).ok()?,
            parts[1],
            std::str::from_utf8(parts[2]).ok()?,
        ))
    }
}

/// A counter's identity as the store holds it and as it travels in a handoff.
///
/// `placement` is the client key's ring position ([`Ring::key_hash`]), so a node can
/// tell which keys a ring change moves without their bytes; `disc` tells apart the
/// counters of one client (rule, route). Both are deterministic across nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyId {
    /// The client key's position on the ring.
    pub placement: u64,
    /// xxh3-64 (fixed seed) of the encoded (rule, client, route).
    pub disc: u64,
}

impl KeyId {
    /// The identity of (rule, client, route part). Computed once per planned check; the
    /// encoding goes through a stack buffer, so the usual sizes allocate nothing.
    pub fn of(rule: &str, client: &[u8], route: &str) -> Self {
        const STACK: usize = 1024;
        let encoded = 12 + rule.len() + client.len() + route.len();
        let disc = if encoded <= STACK {
            let mut buf = [0u8; STACK];
            let mut at = 0;
            for part in [rule.as_bytes(), client, route.as_bytes()] {
                buf[at..at + 4].copy_from_slice(&(part.len() as u32).to_le_bytes());
                buf[at + 4..at + 4 + part.len()].copy_from_slice(part);
                at += 4 + part.len();
            }
            xxhash_rust::xxh3::xxh3_64_with_seed(&buf[..at], DISC_SEED)
        } else {
            let mut buf = Vec::with_capacity(encoded);
            StateKey::encode_into(&mut buf, rule, client, route);
            xxhash_rust::xxh3::xxh3_64_with_seed(&buf, DISC_SEED)
        };
        Self {
            placement: Ring::key_hash(client),
            disc,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_ids_hash_the_length_prefixed_encoding_whatever_its_size() {
        // `KeyId::of` encodes on the stack up to 1 KiB and on the heap beyond; both must
        // give the identity of `StateKey`'s encoding (it travels between nodes).
        for client_len in [0, 1, 255, 1000, 1020, 5000] {
            let client = vec![7u8; client_len];
            let key = StateKey::new("rule", &client, "POST /v1/charges");
            assert_eq!(
                KeyId::of("rule", &client, "POST /v1/charges").disc,
                xxhash_rust::xxh3::xxh3_64_with_seed(key.as_bytes(), DISC_SEED),
                "client of {client_len} bytes"
            );
        }
    }

    #[test]
    fn state_keys_with_shifted_boundaries_do_not_collide() {
        assert_ne!(
            StateKey::new("r", b"ab", "c"),
            StateKey::new("r", b"a", "bc")
        );
        assert_ne!(
            StateKey::new("ra", b"b", "c"),
            StateKey::new("r", b"ab", "c")
        );
        assert_ne!(StateKey::new("", b"", "x"), StateKey::new("", b"x", ""));
    }

    #[test]
    fn state_key_decodes_what_it_encoded() {
        let key = StateKey::new("rule-1", &[0xff, 0, 7], "POST /v1/charges");
        let (rule, client, route) = StateKey::decode(key.as_bytes()).unwrap();
        assert_eq!(rule, "rule-1");
        assert_eq!(client, &[0xff, 0, 7]);
        assert_eq!(route, "POST /v1/charges");
        assert!(StateKey::decode(&key.as_bytes()[..5]).is_none());
    }
}
