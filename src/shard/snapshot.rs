//! The counter snapshot's file format: encode, decode and verify, with no I/O.
//!
//! A node writes the states of the keys it decides for and of the replicas it keeps
//! to `--data-dir` every `--snapshot-interval-ms`, and loads them when it starts
//! (`node::snapshot` is the I/O shell and the policy: what is written, when, and
//! what a start does with it). This module only turns states into bytes and back,
//! and refuses bytes it cannot vouch for: a file is all or nothing, never half
//! loaded.
//!
//! ```text
//! magic     8 bytes   "RLSNAP\r\n" (a text-mode copy or a foreign file fails here)
//! version   u32 LE    FORMAT_VERSION
//! body_len  u64 LE    bytes between the header and the checksum
//! header    cluster id, node id (u16 LE length + UTF-8 each), taken_at_ms u64 LE,
//!           members (varint count, then node id + generation u64 LE each)
//! records   tag u8 (1 live, 2 replica, 0 end), then per record:
//!             placement u64 LE, disc u64 LE,
//!             fingerprint index (varint; the next unused index is followed by the
//!             fingerprint as u64 LE: the table is built as the records go),
//!             algorithm u8 (AlgorithmKind::ALL index), word count (varint),
//!             words (varint each)
//! counts    live records, replica records (varint each), after the end tag
//! checksum  xxh3-64 LE of every byte before it
//! ```
//!
//! Words are LEB128 varints because most of them are small (a fixed window's count,
//! a window index): a fixed-window key costs about 30 bytes. The checksum is for
//! corruption (a torn write, a bad sector, a truncated copy), not for an attacker: a
//! process that can write the data dir can also read the cluster key.

use std::collections::HashMap;

use crate::algorithms::{AlgorithmKind, KeyState, Millis};
use crate::shard::{Exported, KeyId};

/// The first bytes of every snapshot file.
pub const MAGIC: [u8; 8] = *b"RLSNAP\r\n";

/// The format this build writes and the only one it reads: a file of another version
/// is refused whole (its keys restart from what peers hold) rather than guessed at.
pub const FORMAT_VERSION: u32 = 1;

/// Bytes of the fixed part before the header: magic, version, body length.
const PREFIX: usize = 8 + 4 + 8;
/// Bytes of the checksum at the end.
const CHECKSUM: usize = 8;

const TAG_END: u8 = 0;
const TAG_LIVE: u8 = 1;
const TAG_REPLICA: u8 = 2;

/// Whose snapshot a file is and when it was taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The cluster that wrote it (`--cluster-id`).
    pub cluster_id: String,
    /// The node that wrote it (`--node-id`).
    pub node_id: String,
    /// Wall-clock ms when the copy was taken.
    pub taken_at: Millis,
    /// The members the node saw then, each with its generation: a node back from a
    /// crash of the whole cluster knows from them which incarnations its peers were,
    /// so a peer that lost its data dir is recognised as restarted and gets its keys'
    /// replicas back.
    pub members: Vec<(String, u64)>,
}

/// A decoded snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Whose and when.
    pub header: Header,
    /// States of the keys the node decided for.
    pub live: Vec<Exported>,
    /// Replicas the node kept for other owners.
    pub replicas: Vec<Exported>,
}

/// Why a file is not loaded: every reason refuses the whole file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    /// The file does not start with [`MAGIC`].
    #[error("not a ringlimit snapshot (bad magic)")]
    NotASnapshot,
    /// Written in another format version.
    #[error("snapshot format version {found}, this build reads only {FORMAT_VERSION}")]
    Version {
        /// The version the file says it is.
        found: u32,
    },
    /// Shorter than its header says: a torn write or a truncated copy.
    #[error("truncated snapshot: {have} bytes of {want}")]
    Truncated {
        /// Bytes in the file.
        have: usize,
        /// Bytes the header says it has.
        want: usize,
    },
    /// The checksum does not match the bytes.
    #[error("snapshot checksum mismatch (the file is corrupt)")]
    Checksum,
    /// Well formed but inconsistent: a record the format cannot hold.
    #[error("malformed snapshot: {0}")]
    Malformed(&'static str),
    /// Written by another node or another cluster.
    #[error("snapshot of node {node_id} in cluster {cluster_id}, not this node's")]
    Foreign {
        /// The cluster the file says wrote it.
        cluster_id: String,
        /// The node the file says wrote it.
        node_id: String,
    },
}

impl SnapshotError {
    /// A short label for the refusal metric.
    pub fn reason(&self) -> &'static str {
        match self {
            SnapshotError::NotASnapshot => "magic",
            SnapshotError::Version { .. } => "version",
            SnapshotError::Truncated { .. } => "truncated",
            SnapshotError::Checksum => "checksum",
            SnapshotError::Malformed(_) => "malformed",
            SnapshotError::Foreign { .. } => "foreign",
        }
    }
}

/// Which part of a snapshot a state belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    /// A key the node decided for.
    Live,
    /// A replica kept for another owner.
    Replica,
}

/// Builds a snapshot's bytes a state at a time, so the caller never holds every
/// state decoded at once (a node copies one shard, encodes it, drops the copy).
#[derive(Debug)]
pub struct Encoder {
    buf: Vec<u8>,
    /// Fingerprints seen, by their index in the file.
    fingerprints: HashMap<u64, u64>,
    live: u64,
    replicas: u64,
}

impl Encoder {
    /// A snapshot of `header`'s node, with no state yet.
    pub fn new(header: &Header) -> Self {
        let mut buf = Vec::with_capacity(4096);
        buf.extend_from_slice(&MAGIC);
        buf.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        buf.extend_from_slice(&0u64.to_le_bytes()); // body_len, set by `finish`
        put_str(&mut buf, &header.cluster_id);
        put_str(&mut buf, &header.node_id);
        buf.extend_from_slice(&header.taken_at.to_le_bytes());
        put_varint(&mut buf, header.members.len() as u64);
        for (id, generation) in &header.members {
            put_str(&mut buf, id);
            buf.extend_from_slice(&generation.to_le_bytes());
        }
        Self {
            buf,
            fingerprints: HashMap::new(),
            live: 0,
            replicas: 0,
        }
    }

    /// Add one state.
    pub fn push(&mut self, section: Section, state: &Exported) {
        let (tag, count) = match section {
            Section::Live => (TAG_LIVE, &mut self.live),
            Section::Replica => (TAG_REPLICA, &mut self.replicas),
        };
        *count += 1;
        let buf = &mut self.buf;
        buf.push(tag);
        buf.extend_from_slice(&state.id.placement.to_le_bytes());
        buf.extend_from_slice(&state.id.disc.to_le_bytes());
        let next = self.fingerprints.len() as u64;
        let index = *self.fingerprints.entry(state.fingerprint).or_insert(next);
        put_varint(buf, index);
        if index == next {
            buf.extend_from_slice(&state.fingerprint.to_le_bytes());
        }
        buf.push(state.state.kind().index() as u8);
        let words = state.state.to_words();
        put_varint(buf, words.len() as u64);
        for word in words {
            put_varint(buf, word);
        }
    }

    /// Live states and replicas added so far.
    pub fn counts(&self) -> (u64, u64) {
        (self.live, self.replicas)
    }

    /// States added so far.
    pub fn len(&self) -> u64 {
        self.live + self.replicas
    }

    /// True when no state was added.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The file's bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.buf.push(TAG_END);
        put_varint(&mut self.buf, self.live);
        put_varint(&mut self.buf, self.replicas);
        let body_len = (self.buf.len() - PREFIX) as u64;
        self.buf[12..20].copy_from_slice(&body_len.to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&self.buf);
        self.buf.extend_from_slice(&sum.to_le_bytes());
        self.buf
    }
}

/// The bytes of `snapshot` (what [`Encoder`] builds from the same states).
pub fn encode(snapshot: &Snapshot) -> Vec<u8> {
    let mut encoder = Encoder::new(&snapshot.header);
    for state in &snapshot.live {
        encoder.push(Section::Live, state);
    }
    for state in &snapshot.replicas {
        encoder.push(Section::Replica, state);
    }
    encoder.finish()
}

/// Verify and decode a snapshot file: its magic, version, length and checksum first,
/// then every record; any fault refuses the whole file.
pub fn decode(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
    if bytes.len() < MAGIC.len() || bytes[..MAGIC.len()] != MAGIC {
        return Err(SnapshotError::NotASnapshot);
    }
    if bytes.len() < PREFIX {
        return Err(SnapshotError::Truncated {
            have: bytes.len(),
            want: PREFIX + CHECKSUM,
        });
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(SnapshotError::Version { found: version });
    }
    let body_len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    let want = usize::try_from(body_len)
        .ok()
        .and_then(|b| b.checked_add(PREFIX + CHECKSUM))
        .ok_or(SnapshotError::Malformed("body length"))?;
    if bytes.len() < want {
        return Err(SnapshotError::Truncated {
            have: bytes.len(),
            want,
        });
    }
    if bytes.len() > want {
        return Err(SnapshotError::Malformed("bytes after the checksum"));
    }
    let (covered, sum) = bytes.split_at(want - CHECKSUM);
    if xxhash_rust::xxh3::xxh3_64(covered).to_le_bytes() != sum {
        return Err(SnapshotError::Checksum);
    }
    let mut r = Reader {
        bytes: &covered[PREFIX..],
    };
    let (cluster_id, node_id, taken_at) = (r.string()?, r.string()?, r.u64()?);
    let count = r.varint()?;
    // Each member takes at least 10 bytes: a count beyond that is a lie.
    if count > (r.bytes.len() / 10) as u64 {
        return Err(SnapshotError::Malformed("member count"));
    }
    let mut members = Vec::with_capacity(count as usize);
    for _ in 0..count {
        members.push((r.string()?, r.u64()?));
    }
    let header = Header {
        cluster_id,
        node_id,
        taken_at,
        members,
    };
    let (mut live, mut replicas) = (Vec::new(), Vec::new());
    let mut fingerprints: Vec<u64> = Vec::new();
    loop {
        let into = match r.u8()? {
            TAG_END => break,
            TAG_LIVE => &mut live,
            TAG_REPLICA => &mut replicas,
            _ => return Err(SnapshotError::Malformed("record tag")),
        };
        let id = KeyId {
            placement: r.u64()?,
            disc: r.u64()?,
        };
        let index = r.varint()?;
        let fingerprint = if index == fingerprints.len() as u64 {
            let fp = r.u64()?;
            fingerprints.push(fp);
            fp
        } else {
            *usize::try_from(index)
                .ok()
                .and_then(|i| fingerprints.get(i))
                .ok_or(SnapshotError::Malformed("fingerprint index"))?
        };
        let kind = *AlgorithmKind::ALL
            .get(usize::from(r.u8()?))
            .ok_or(SnapshotError::Malformed("algorithm"))?;
        let count = r.varint()?;
        // Every word takes at least a byte: a count beyond what is left is a lie, and
        // must not size an allocation.
        if count > r.bytes.len() as u64 {
            return Err(SnapshotError::Malformed("word count"));
        }
        let mut words = Vec::with_capacity(count as usize);
        for _ in 0..count {
            words.push(r.varint()?);
        }
        let state =
            KeyState::from_words(kind, &words).ok_or(SnapshotError::Malformed("state words"))?;
        into.push(Exported {
            id,
            fingerprint,
            state,
        });
    }
    if r.varint()? != live.len() as u64 || r.varint()? != replicas.len() as u64 {
        return Err(SnapshotError::Malformed("record counts"));
    }
    if !r.bytes.is_empty() {
        return Err(SnapshotError::Malformed("bytes after the counts"));
    }
    Ok(Snapshot {
        header,
        live,
        replicas,
    })
}

impl Snapshot {
    /// Refuse a snapshot another node or another cluster wrote: its keys are not this
    /// node's to decide (a data dir copied from a neighbour, a volume attached to the
    /// wrong pod).
    pub fn belongs_to(&self, cluster_id: &str, node_id: &str) -> Result<(), SnapshotError> {
        if self.header.cluster_id == cluster_id && self.header.node_id == node_id {
            Ok(())
        } else {
            Err(SnapshotError::Foreign {
                cluster_id: self.header.cluster_id.clone(),
                node_id: self.header.node_id.clone(),
            })
        }
    }
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    // Ids are short (validated at start); a longer one is cut at a char boundary
    // rather than written with a length that wraps.
    let mut end = s.len().min(usize::from(u16::MAX));
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    buf.extend_from_slice(&(end as u16).to_le_bytes());
    buf.extend_from_slice(&s.as_bytes()[..end]);
}

fn put_varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

/// A cursor over the checked bytes; running out is malformed (the length and the
/// checksum already matched, so the writer wrote it that way).
struct Reader<'a> {
    bytes: &'a [u8],
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], SnapshotError> {
        if self.bytes.len() < n {
            return Err(SnapshotError::Malformed("record cut short"));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, SnapshotError> {
        Ok(self.take(1)?[0])
    }

    fn u64(&mut self) -> Result<u64, SnapshotError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn string(&mut self) -> Result<String, SnapshotError> {
        let len = u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes"));
        let bytes = self.take(usize::from(len))?;
        String::from_utf8(bytes.to_vec()).map_err(|_| SnapshotError::Malformed("id not UTF-8"))
    }

    fn varint(&mut self) -> Result<u64, SnapshotError> {
        let mut v: u64 = 0;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            let bits = u64::from(b & 0x7f);
            if shift == 63 && bits > 1 {
                return Err(SnapshotError::Malformed("varint overflow"));
            }
            v |= bits << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(SnapshotError::Malformed("varint too long"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header() -> Header {
        Header {
            cluster_id: "ringlimit".into(),
            node_id: "node-a".into(),
            taken_at: 1_800_000_000_000,
            members: vec![("node-a".into(), 7), ("node-b".into(), 9)],
        }
    }

    /// Any state of any algorithm, as words the algorithm can hold.
    fn state() -> impl Strategy<Value = KeyState> {
        let kind = 0..AlgorithmKind::ALL.len();
        (kind, proptest::collection::vec(any::<u64>(), 0..9)).prop_map(|(k, mut words)| {
            let kind = AlgorithmKind::ALL[k];
            let need = match kind {
                AlgorithmKind::TokenBucket | AlgorithmKind::FixedWindow => 2,
                AlgorithmKind::LeakyBucket | AlgorithmKind::SlidingWindowCounter => 3,
                AlgorithmKind::SlidingWindowLog => 2 + (words.len().saturating_sub(2) & !1),
            };
            words.resize(need, 7);
            KeyState::from_words(kind, &words).expect("sized for the kind")
        })
    }

    fn exported() -> impl Strategy<Value = Exported> {
        // Few fingerprints, so the table's back references are exercised.
        (any::<u64>(), any::<u64>(), 0u64..4, state()).prop_map(|(p, d, fp, state)| Exported {
            id: KeyId {
                placement: p,
                disc: d,
            },
            fingerprint: fp.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            state,
        })
    }

    fn snapshot() -> impl Strategy<Value = Snapshot> {
        (
            proptest::collection::vec(exported(), 0..20),
            proptest::collection::vec(exported(), 0..20),
            "[a-z0-9é-]{0,12}",
            any::<u64>(),
            proptest::collection::vec(("[a-z-]{1,8}", any::<u64>()), 0..4),
        )
            .prop_map(|(live, replicas, node_id, taken_at, members)| Snapshot {
                header: Header {
                    cluster_id: "c".into(),
                    node_id,
                    taken_at,
                    members,
                },
                live,
                replicas,
            })
    }

    proptest! {
        #[test]
        fn decode_reads_back_what_encode_wrote(s in snapshot()) {
            prop_assert_eq!(decode(&encode(&s)), Ok(s));
        }

        #[test]
        fn any_flipped_byte_refuses_the_whole_file(
            s in snapshot(), at in any::<prop::sample::Index>(), bit in 0u8..8,
        ) {
            let mut bytes = encode(&s);
            let i = at.index(bytes.len());
            bytes[i] ^= 1 << bit;
            prop_assert!(decode(&bytes).is_err(), "byte {} bit {} flipped", i, bit);
        }

        #[test]
        fn any_truncation_or_extension_refuses_the_whole_file(
            s in snapshot(), at in any::<prop::sample::Index>(), extra in 1usize..4,
        ) {
            let bytes = encode(&s);
            let cut = at.index(bytes.len());
            prop_assert!(decode(&bytes[..cut]).is_err(), "cut at {}", cut);
            let mut longer = bytes.clone();
            longer.extend(std::iter::repeat_n(0u8, extra));
            prop_assert!(decode(&longer).is_err());
        }
    }

    #[test]
    fn each_fault_is_named() {
        let s = Snapshot {
            header: header(),
            live: vec![],
            replicas: vec![],
        };
        let bytes = encode(&s);
        assert_eq!(decode(b"{\"rules\": 1}"), Err(SnapshotError::NotASnapshot));
        let mut v2 = bytes.clone();
        v2[8] = 2;
        assert_eq!(decode(&v2), Err(SnapshotError::Version { found: 2 }));
        assert!(matches!(
            decode(&bytes[..bytes.len() - 1]),
            Err(SnapshotError::Truncated { .. })
        ));
        let mut flipped = bytes.clone();
        let last = flipped.len() - 9;
        flipped[last] ^= 1;
        assert_eq!(decode(&flipped), Err(SnapshotError::Checksum));
        let decoded = decode(&bytes).expect("valid");
        assert_eq!(decoded.belongs_to("ringlimit", "node-a"), Ok(()));
        assert_eq!(
            decoded
                .belongs_to("ringlimit", "node-b")
                .map_err(|e| e.reason()),
            Err("foreign")
        );
        assert_eq!(
            decoded
                .belongs_to("other", "node-a")
                .map_err(|e| e.reason()),
            Err("foreign")
        );
    }

    #[test]
    fn a_fixed_window_key_costs_about_thirty_bytes() {
        let state = |i: u64| Exported {
            id: KeyId {
                placement: i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                disc: i,
            },
            fingerprint: 42,
            state: KeyState::from_words(AlgorithmKind::FixedWindow, &[500_000, 17])
                .expect("a fixed window's two words"),
        };
        let s = Snapshot {
            header: header(),
            live: (0..1000).map(state).collect(),
            replicas: vec![],
        };
        let per_key = encode(&s).len() / 1000;
        assert!((20..=32).contains(&per_key), "{per_key} bytes a key");
    }
}
