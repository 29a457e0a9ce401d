//! Reservations as the cluster names them: the id a `Reserve` answers and a `Commit`
//! brings back, and what each returns.
//!
//! An id names the node that holds the reservation (its id and generation), the counter
//! (the client key's ring placement, the counter's discriminator, its rule's name and
//! fingerprint), what was reserved (amount, expiry) and the owner's ticket (serial and
//! tag: see [`crate::shard::reservations`]). Any node routes a commit by the placement
//! alone, to the key's current owner; that node applies it to its own record when the
//! id names it, and as a commit of a moved key otherwise (nothing given back, the excess
//! charged once), so a commit needs nothing but the id, wherever it arrives.
//!
//! A concurrency lease (`Acquire`) is named the same way, with the prefix `l1.`
//! ([`Hold::Lease`]); a `Release` is routed like a commit.
//!
//! The text is plain ASCII, `r1.` (or `l1.`) then ten dot-separated lowercase hex fields (names as
//! the hex of their bytes); [`ReservationId::parse`] accepts exactly what
//! [`ReservationId::encode`] writes and nothing else. Pure: no I/O.

use crate::algorithms::Millis;
use crate::cluster::{Answer, Decider};
use crate::config::bounds::{MAX_COST, MAX_RESERVATION_ID_BYTES};
use crate::shard::reservations::{Claim, Settled, Ticket};
use crate::shard::KeyId;

/// What an id holds: units of a counter (`Reserve`) or a place in flight (`Acquire`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// A reservation, settled by `Commit`.
    Reservation,
    /// A concurrency lease, ended by `Release`.
    Lease,
}

impl Hold {
    /// The id text's prefix (its kind and layout version).
    fn prefix(self) -> &'static str {
        match self {
            Hold::Reservation => "r1",
            Hold::Lease => "l1",
        }
    }
}

/// Longest node id or rule name an id carries (both are bounded to 64 bytes where they
/// are defined).
const MAX_NAME_BYTES: usize = 64;

/// A reservation's id, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationId {
    /// A reservation's or a lease's.
    pub hold: Hold,
    /// The node that made it.
    pub owner: String,
    /// That node's generation then: a restarted node is another owner.
    pub generation: u64,
    /// The name of the rule the amount was charged under.
    pub rule: String,
    /// What the owner's table knows it by.
    pub ticket: Ticket,
    /// What it charged, as the tag covers it.
    pub claim: Claim,
}

impl ReservationId {
    /// The client key's ring position: where a commit is routed.
    pub fn placement(&self) -> u64 {
        self.claim.counter.placement
    }

    /// Whether node `me` made this reservation.
    pub fn made_by(&self, me: &Decider) -> bool {
        *self.owner == *me.node_id && self.generation == me.generation
    }

    /// A hash of the whole id: how a node that did not make it remembers having
    /// applied its commit.
    pub fn hash(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(self.encode().as_bytes())
    }

    /// The id's text.
    pub fn encode(&self) -> String {
        let c = &self.claim;
        format!(
            "{}.{}.{:x}.{}.{:x}.{:x}.{:x}.{:x}.{:x}.{:x}.{:x}",
            self.hold.prefix(),
            hex(&self.owner),
            self.generation,
            hex(&self.rule),
            c.counter.placement,
            c.counter.disc,
            c.fingerprint,
            c.amount,
            c.expires_at,
            self.ticket.serial,
            self.ticket.tag,
        )
    }

    /// Read an id's text, or say what is wrong with it.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.is_empty() {
            return Err("must not be empty".into());
        }
        if text.len() > MAX_RESERVATION_ID_BYTES {
            return Err(format!(
                "{} bytes is over the limit of {MAX_RESERVATION_ID_BYTES}",
                text.len()
            ));
        }
        let malformed = || "not a reservation id this cluster made (malformed)".to_string();
        let parts: Vec<&str> = text.split('.').collect();
        let [prefix, owner, generation, rule, placement, disc, fingerprint, amount, expires_at, serial, tag] =
            parts[..]
        else {
            return Err(malformed());
        };
        let hold = [Hold::Reservation, Hold::Lease]
            .into_iter()
            .find(|h| h.prefix() == prefix)
            .ok_or_else(malformed)?;
        let name = |h: &str| unhex(h).filter(|n| (1..=MAX_NAME_BYTES).contains(&n.len()));
        let amount = number(amount)
            .filter(|a| (1..=MAX_COST as u64).contains(a))
            .ok_or_else(malformed)?;
        Ok(Self {
            hold,
            owner: name(owner).ok_or_else(malformed)?,
            generation: number(generation).ok_or_else(malformed)?,
            rule: name(rule).ok_or_else(malformed)?,
            ticket: Ticket {
                serial: number(serial).ok_or_else(malformed)?,
                tag: number(tag).ok_or_else(malformed)?,
            },
            claim: Claim {
                counter: KeyId {
                    placement: number(placement).ok_or_else(malformed)?,
                    disc: number(disc).ok_or_else(malformed)?,
                },
                fingerprint: number(fingerprint).ok_or_else(malformed)?,
                amount,
                expires_at: number(expires_at).ok_or_else(malformed)?,
            },
        })
    }
}

fn hex(text: &str) -> String {
    text.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex(h: &str) -> Option<String> {
    if !h.len().is_multiple_of(2) || !h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..h.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&h[i..i + 2], 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

/// A number as `encode` writes it: lowercase hex, no sign, no leading zeros (0 is `0`).
fn number(h: &str) -> Option<u64> {
    let canonical = !h.is_empty()
        && h.len() <= 16
        && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        && (h == "0" || !h.starts_with('0'));
    canonical.then(|| u64::from_str_radix(h, 16).ok()).flatten()
}

/// A reservation's check, wherever its key's owner is.
#[derive(Debug, Clone)]
pub struct Reservation {
    /// The check of the amount, as a check's answer.
    pub answer: Answer,
    /// When admitted: the id's text and when the reservation expires (owner's Unix ms).
    pub id: Option<(String, Millis)>,
}

/// What a commit did, and who applied it.
#[derive(Debug, Clone)]
pub struct Committed {
    /// The owner's account of it.
    pub settled: Settled,
    /// The node that applied it.
    pub decider: Decider,
    /// The counter's rule name there (empty when the rule is gone or changed).
    pub rule: String,
}

/// Why a reservation or a commit got no answer of its own.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReservationError {
    /// The owner's table is full; nothing was charged.
    #[error("{0}")]
    Full(String),
    /// The owner refused the commit (unknown, already committed, expired); nothing
    /// changed.
    #[error("{0}")]
    Refused(String),
    /// The owner refused the input (`field: reason`, as its check layer said it).
    #[error("{0}")]
    Invalid(String),
    /// The owner could not be asked, or did not answer in time (a reservation may have
    /// been made there, and then expires at its TTL; a commit may have been applied):
    /// what the failed call said.
    #[error("{0}")]
    Unreachable(String),
    /// This node's shard could not answer.
    #[error(transparent)]
    Shard(#[from] crate::shard::ShardError),
    /// The ring is empty: no node owns the key.
    #[error("no member owns the key (the ring is empty)")]
    NoOwner,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> ReservationId {
        ReservationId {
            hold: Hold::Reservation,
            owner: "node-1".into(),
            generation: 1_796_000_000_123_456_789,
            rule: "llm tokens".into(),
            ticket: Ticket {
                serial: 7,
                tag: 0xdead_beef_0000_0001,
            },
            claim: Claim {
                counter: KeyId::of("llm tokens", b"cust", ""),
                fingerprint: 42,
                amount: 4_000,
                expires_at: 1_796_000_060_000,
            },
        }
    }

    #[test]
    fn an_id_reads_back_as_written_and_names_its_owner() {
        let id = sample();
        let text = id.encode();
        assert!(text.starts_with("r1.6e6f64652d31."), "{text}");
        assert_eq!(ReservationId::parse(&text), Ok(id.clone()));
        let me = Decider {
            node_id: "node-1".into(),
            generation: id.generation,
        };
        assert!(id.made_by(&me));
        let restarted = Decider {
            generation: id.generation + 1,
            ..me
        };
        assert!(!id.made_by(&restarted), "a restarted node is another owner");
    }

    #[test]
    fn the_longest_id_fits_the_bound() {
        let id = ReservationId {
            hold: Hold::Lease,
            owner: "n".repeat(MAX_NAME_BYTES),
            generation: u64::MAX,
            rule: "r".repeat(MAX_NAME_BYTES),
            ticket: Ticket {
                serial: u64::MAX,
                tag: u64::MAX,
            },
            claim: Claim {
                counter: KeyId {
                    placement: u64::MAX,
                    disc: u64::MAX,
                },
                fingerprint: u64::MAX,
                amount: MAX_COST as u64,
                expires_at: u64::MAX,
            },
        };
        let text = id.encode();
        assert!(text.len() <= MAX_RESERVATION_ID_BYTES, "{}", text.len());
        assert_eq!(ReservationId::parse(&text), Ok(id));
    }

    #[test]
    fn malformed_ids_are_refused_with_a_reason() {
        let good = sample().encode();
        let long = "r".repeat(MAX_RESERVATION_ID_BYTES + 1);
        let cases = [
            String::new(),
            long.clone(),
            "hello".into(),
            good.replacen("r1.", "r2.", 1),
            format!("{good}.0"),
            good.replacen(".7.", ".07.", 1),
            good.replacen(".7.", ".7G.", 1),
            good.replacen(".7.", ".-7.", 1),
            good.to_uppercase(),
            good.replacen("6e6f64652d31", "6e6f64652d3", 1),
            good.replacen("6e6f64652d31", "", 1),
            good.replacen("6e6f64652d31", "ff", 1),
            good.replacen(".fa0.", ".0.", 1),
            good.replacen(".fa0.", ".3b9aca01.", 1),
            format!("{}.11111111111111111", &good[..good.rfind('.').unwrap()]),
        ];
        for text in cases {
            let error = ReservationId::parse(&text).expect_err(&text);
            assert!(!error.is_empty());
        }
        assert_eq!(ReservationId::parse("").unwrap_err(), "must not be empty");
        assert_eq!(
            ReservationId::parse(&long).unwrap_err(),
            "513 bytes is over the limit of 512"
        );
        assert_eq!(
            ReservationId::parse("r1.x").unwrap_err(),
            "not a reservation id this cluster made (malformed)"
        );
    }

    proptest! {
        #[test]
        fn any_text_parses_or_is_refused_without_panicking(text in ".{0,600}") {
            if let Ok(id) = ReservationId::parse(&text) {
                prop_assert_eq!(id.encode(), text, "only the canonical form is accepted");
            }
        }

        #[test]
        fn every_id_reads_back(
            owner in "[a-z0-9.-]{1,64}", rule in "\\PC{1,16}", generation: u64, serial: u64,
            tag: u64, placement: u64, disc: u64, fingerprint: u64,
            amount in 1u64..=1_000_000_000, expires_at: u64, lease: bool,
        ) {
            let id = ReservationId {
                hold: if lease { Hold::Lease } else { Hold::Reservation },
                owner,
                generation,
                rule,
                ticket: Ticket { serial, tag },
                claim: Claim { counter: KeyId { placement, disc }, fingerprint, amount, expires_at },
            };
            prop_assert_eq!(ReservationId::parse(&id.encode()), Ok(id));
        }
    }
}
