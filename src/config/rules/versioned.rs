//! Which rule set is newer, and what a node tells the cluster about its own: pure.
//!
//! Every node gossips an [`Advert`]: where its rules come from ([`RulesSource`]) and their
//! [`Stamp`] (version, digest). In cluster mode the stamps are totally ordered, version
//! first and the digest breaking ties, so two writers that raced each other without
//! `If-Match` (both produced version N+1 on different nodes) leave one winner that every
//! node picks alike: the higher digest. In file mode the file is the truth on every node
//! and versions only count local reloads; nodes compare digests, and any difference is
//! drift (docs/rules.md).

use std::fmt;

/// A rule set's place in the cluster's history: its version and its content digest.
///
/// Ordered by version, then digest: the deterministic winner of a race.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Stamp {
    /// Grows by one with every accepted change (cluster mode) or reload (file mode).
    pub version: u64,
    /// [`RulesDoc::digest`](super::RulesDoc::digest) of the document.
    pub digest: u64,
}

impl fmt::Display for Stamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{} ({:016x})", self.version, self.digest)
    }
}

/// Where a node's rules come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RulesSource {
    /// `--rules FILE`: the file on every node is the truth; the API is read-only.
    File,
    /// The cluster's versioned rule set, written through the API and copied between nodes.
    Cluster,
}

impl RulesSource {
    /// The name used in gossip, JSON and `cluster status`.
    pub fn as_str(self) -> &'static str {
        match self {
            RulesSource::File => "file",
            RulesSource::Cluster => "cluster",
        }
    }

    /// The inverse of [`RulesSource::as_str`].
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "file" => Some(RulesSource::File),
            "cluster" => Some(RulesSource::Cluster),
            _ => None,
        }
    }
}

/// What a node gossips about its rules (key-value `rules`): `cluster 7 00000000deadbeef`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Advert {
    /// Where its rules come from.
    pub source: RulesSource,
    /// Their version and digest.
    pub stamp: Stamp,
}

impl Advert {
    /// The gossip value.
    pub fn encode(&self) -> String {
        format!(
            "{} {} {:016x}",
            self.source.as_str(),
            self.stamp.version,
            self.stamp.digest
        )
    }

    /// Reads a gossip value; `None` for anything else (a newer node's format, garbage).
    pub fn parse(text: &str) -> Option<Self> {
        let mut parts = text.split(' ');
        let source = RulesSource::parse(parts.next()?)?;
        let version = parts.next()?.parse().ok()?;
        let digest = u64::from_str_radix(parts.next()?, 16).ok()?;
        if parts.next().is_some() {
            return None;
        }
        Some(Advert {
            source,
            stamp: Stamp { version, digest },
        })
    }

    /// Whether a node with this advert should copy `theirs`: only in cluster mode, only
    /// from a cluster-mode peer, only a strictly greater stamp.
    pub fn should_pull(&self, theirs: &Advert) -> bool {
        self.source == RulesSource::Cluster
            && theirs.source == RulesSource::Cluster
            && theirs.stamp > self.stamp
    }

    /// Whether `theirs` is drift from this node's point of view: a different source
    /// (some nodes follow a file, others the cluster), or, in file mode, a different
    /// digest (two files differ). In cluster mode a different stamp is a copy in flight,
    /// not drift: the lower one pulls the higher one.
    pub fn drifts_from(&self, theirs: &Advert) -> bool {
        self.source != theirs.source
            || (self.source == RulesSource::File && self.stamp.digest != theirs.stamp.digest)
    }
}

/// What a node gossips about its Envoy configuration (key-value `envoy`), beside its
/// [`Advert`]: `file 3 00000000deadbeef` (reloads since start, and
/// [`EnvoyConfig::digest`](super::envoy::EnvoyConfig::digest)) for a node following its
/// own `--envoy-config`, or `-` for one whose Envoy domains are its rule set's (the
/// rules advert already covers those). A member that publishes no `envoy` key runs an
/// older build and is not compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EnvoyAdvert {
    /// No `--envoy-config`: the Envoy domains come with the rules.
    FromRules,
    /// `--envoy-config`: reloads since start and the digest of what is enforced.
    File(Stamp),
}

impl EnvoyAdvert {
    /// The gossip value.
    pub fn encode(&self) -> String {
        match self {
            EnvoyAdvert::FromRules => "-".to_string(),
            EnvoyAdvert::File(stamp) => format!("file {} {:016x}", stamp.version, stamp.digest),
        }
    }

    /// Reads a gossip value; `None` for anything else.
    pub fn parse(text: &str) -> Option<Self> {
        if text == "-" {
            return Some(EnvoyAdvert::FromRules);
        }
        match Advert::parse(text)? {
            Advert {
                source: RulesSource::File,
                stamp,
            } => Some(EnvoyAdvert::File(stamp)),
            _ => None,
        }
    }

    /// Whether `theirs` enforces other Envoy domains than this node: two files with
    /// different digests, or one node following a file and the other not (its domains
    /// come from its rule set, so the two can only agree by accident). Two nodes without
    /// a file are compared by their rules adverts instead.
    pub fn drifts_from(&self, theirs: &EnvoyAdvert) -> bool {
        match (self, theirs) {
            (EnvoyAdvert::FromRules, EnvoyAdvert::FromRules) => false,
            (EnvoyAdvert::File(a), EnvoyAdvert::File(b)) => a.digest != b.digest,
            _ => true,
        }
    }
}

/// The peer to copy rules from: the one with the greatest stamp greater than ours (ties
/// between peers holding the same stamp go to the first, by node id order of `peers`).
pub fn best_source<'a>(
    me: &Advert,
    peers: impl IntoIterator<Item = (&'a str, Advert)>,
) -> Option<(&'a str, Advert)> {
    peers
        .into_iter()
        .filter(|(_, advert)| me.should_pull(advert))
        .fold(None, |best: Option<(&str, Advert)>, candidate| match best {
            Some(b) if b.1.stamp >= candidate.1.stamp => Some(b),
            _ => Some(candidate),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn advert(source: RulesSource, version: u64, digest: u64) -> Advert {
        Advert {
            source,
            stamp: Stamp { version, digest },
        }
    }

    #[test]
    fn adverts_round_trip_and_garbage_is_refused() {
        let a = advert(RulesSource::Cluster, 7, 0xdead_beef);
        assert_eq!(a.encode(), "cluster 7 00000000deadbeef");
        assert_eq!(Advert::parse(&a.encode()), Some(a));
        for bad in [
            "",
            "cluster",
            "cluster 7",
            "x 7 00",
            "cluster -1 00",
            "cluster 7 zz",
            "file 1 0 extra",
        ] {
            assert_eq!(Advert::parse(bad), None, "{bad:?}");
        }
    }

    proptest::proptest! {
        /// A gossip value is input from any member's build: parsing never panics, and
        /// what parses encodes back to itself.
        #[test]
        fn parsing_any_gossip_value_is_total(text in ".{0,40}") {
            if let Some(advert) = Advert::parse(&text) {
                proptest::prop_assert_eq!(Advert::parse(&advert.encode()), Some(advert));
            }
        }
    }

    #[test]
    fn a_race_without_if_match_has_one_winner_whoever_looks() {
        // Two nodes at version 4 accepted different writes: both made version 5.
        let a = advert(RulesSource::Cluster, 5, 0x1111);
        let b = advert(RulesSource::Cluster, 5, 0x9999);
        assert!(a.should_pull(&b), "the lower digest copies the higher");
        assert!(!b.should_pull(&a), "the winner keeps its own");
        // A later version beats any digest.
        let c = advert(RulesSource::Cluster, 6, 0x0001);
        assert!(b.should_pull(&c));
        assert!(!c.should_pull(&b));
    }

    #[test]
    fn file_mode_never_pulls_and_reports_differing_files() {
        let mine = advert(RulesSource::File, 1, 0x1);
        let other_file = advert(RulesSource::File, 9, 0x2);
        let same_file = advert(RulesSource::File, 3, 0x1);
        let cluster = advert(RulesSource::Cluster, 9, 0x1);
        assert!(!mine.should_pull(&other_file));
        assert!(!mine.should_pull(&cluster));
        assert!(mine.drifts_from(&other_file));
        assert!(
            !mine.drifts_from(&same_file),
            "reload counts differ, content does not"
        );
        assert!(mine.drifts_from(&cluster), "mixed sources are drift");
        // A cluster-mode node behind its peers is catching up, not drifting.
        let behind = advert(RulesSource::Cluster, 2, 0x5);
        assert!(!behind.drifts_from(&cluster));
        assert!(!cluster.should_pull(&mine), "never copies a file-mode node");
    }

    #[test]
    fn envoy_adverts_round_trip_and_differing_files_drift() {
        let file = |version, digest| EnvoyAdvert::File(Stamp { version, digest });
        for a in [EnvoyAdvert::FromRules, file(3, 0xdead_beef)] {
            assert_eq!(EnvoyAdvert::parse(&a.encode()), Some(a));
        }
        assert_eq!(file(3, 0xdead_beef).encode(), "file 3 00000000deadbeef");
        for bad in ["", "cluster 1 00", "file 1", "--", "file 1 00 x"] {
            assert_eq!(EnvoyAdvert::parse(bad), None, "{bad:?}");
        }
        assert!(
            !file(1, 7).drifts_from(&file(9, 7)),
            "reload counts differ, content does not"
        );
        assert!(file(1, 7).drifts_from(&file(1, 8)));
        assert!(
            file(1, 7).drifts_from(&EnvoyAdvert::FromRules),
            "a file and none"
        );
        assert!(EnvoyAdvert::FromRules.drifts_from(&file(1, 7)));
        assert!(!EnvoyAdvert::FromRules.drifts_from(&EnvoyAdvert::FromRules));
    }

    #[test]
    fn the_best_source_is_the_greatest_newer_stamp() {
        let me = advert(RulesSource::Cluster, 3, 0x5);
        let peers = [
            ("a", advert(RulesSource::Cluster, 2, 0x9)),
            ("b", advert(RulesSource::Cluster, 4, 0x1)),
            ("c", advert(RulesSource::Cluster, 4, 0x7)),
            ("d", advert(RulesSource::File, 9, 0x7)),
        ];
        assert_eq!(best_source(&me, peers).map(|(id, _)| id), Some("c"));
        assert_eq!(
            best_source(&advert(RulesSource::Cluster, 4, 0x7), peers),
            None
        );
    }
}
