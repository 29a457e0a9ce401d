//! Every bound on what a request may carry, defined once, below every floor that reads
//! a request: the public front ends, the peer face, the rule parser and the handoff all
//! take their bounds from here, so no two of them can drift apart.
//!
//! Bounds keep one caller from spending a node's memory, hashing time or answer bytes:
//! each text a request carries is part of a counter's identity or echoed in an answer,
//! and each list is decided (and answered) item by item. [`text`] is the one check of a
//! bounded text, whatever front end it arrives through.

/// Longest client key accepted, in bytes (a rule's `client` too).
pub const MAX_KEY_BYTES: usize = 256;
/// Longest tier name accepted, in bytes (a rule's `tier` too: a longer one could never
/// match).
pub const MAX_TIER_BYTES: usize = 64;
/// Longest method token in a route: real HTTP methods are at most 7 letters, custom ones
/// rarely longer.
pub const MAX_METHOD_LEN: usize = 16;
/// Longest path in a route, in bytes, query string included. The route as sent travels
/// to the key's owner and back in the answer, and a `per = "route"` rule counts by its
/// path.
pub const MAX_PATH_LEN: usize = 256;
/// Largest cost accepted at all (a rule may admit less: see `Limiter::max_cost`).
pub const MAX_COST: i64 = 1_000_000_000;
/// Descriptors per check, the request's own (key, route) included.
pub const MAX_DESCRIPTORS: usize = 8;
/// Checks per batch call (`ringlimit.v1` `CheckBatch`).
pub const MAX_BATCH: usize = 1000;
/// Longest a reservation (`Reserve`) waits for its commit, in ms: one hour, longer than
/// any model response a gateway waits for. A reservation holds a slot of its owner's
/// bounded table until it is committed or its TTL ends.
pub const MAX_RESERVATION_TTL_MS: i64 = 3_600_000;
/// A reservation's TTL when the request sets none, in ms.
pub const DEFAULT_RESERVATION_TTL_MS: u64 = 60_000;
/// Longest reservation id accepted, in bytes (an id this node makes is at most ~440).
pub const MAX_RESERVATION_ID_BYTES: usize = 512;
/// Largest concurrency limit a rule may declare (`concurrency = N`: requests in flight).
pub const MAX_CONCURRENCY: u64 = 1_000_000;
/// Items per forwarded batch or refund call between members: a sender batches at most
/// what a client's batch could hold.
pub const MAX_FORWARD_ITEMS: usize = MAX_BATCH;
/// Counter states per install call (state handoff), chunked by the sender.
pub const MAX_INSTALL_STATES: usize = MAX_BATCH;
/// Items per Gubernator `GetRateLimits` call (Gubernator's own bound).
pub const MAX_GUBERNATOR_ITEMS: usize = 1000;
/// Longest Envoy domain in a request, in bytes (a configuration's too).
pub const MAX_DOMAIN_BYTES: usize = 256;
/// Longest Envoy entry key or value, or Gubernator name or unique key, in bytes.
pub const MAX_ENTRY_BYTES: usize = 4096;
/// Most entries in one Envoy descriptor (deeper than any configuration can nest).
pub const MAX_ENTRIES: usize = 16;
/// Counter keys longer than this are replaced by a 128-bit hash of themselves, so a
/// forwarded counter key is never longer.
pub const MAX_COUNTER_KEY: usize = 1024;

/// A kind of bounded text a request carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Text {
    /// A client key ([`MAX_KEY_BYTES`]).
    Key,
    /// A tier name ([`MAX_TIER_BYTES`]).
    Tier,
    /// An Envoy domain ([`MAX_DOMAIN_BYTES`]).
    Domain,
    /// An Envoy entry key or value, a Gubernator name or unique key
    /// ([`MAX_ENTRY_BYTES`]).
    Entry,
    /// A counter key a peer forwards ([`MAX_COUNTER_KEY`]).
    CounterKey,
}

impl Text {
    /// The longest text of this kind accepted, in bytes.
    pub const fn max_bytes(self) -> usize {
        match self {
            Text::Key => MAX_KEY_BYTES,
            Text::Tier => MAX_TIER_BYTES,
            Text::Domain => MAX_DOMAIN_BYTES,
            Text::Entry => MAX_ENTRY_BYTES,
            Text::CounterKey => MAX_COUNTER_KEY,
        }
    }
}

/// Why a text is refused, in words a caller can act on (the caller prefixes the field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TextError {
    /// Empty: every bounded text names something.
    #[error("must not be empty")]
    Empty,
    /// Longer than its kind allows.
    #[error("{len} bytes is over the limit of {max}")]
    TooLong {
        /// Its length, in bytes.
        len: usize,
        /// The bound, in bytes.
        max: usize,
    },
}

/// Check one text of kind `kind`: non-empty and at most its bound.
pub fn text(kind: Text, value: &str) -> Result<(), TextError> {
    let max = kind.max_bytes();
    if value.is_empty() {
        Err(TextError::Empty)
    } else if value.len() > max {
        Err(TextError::TooLong {
            len: value.len(),
            max,
        })
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_is_refused_empty_or_one_byte_over_its_bound() {
        for kind in [
            Text::Key,
            Text::Tier,
            Text::Domain,
            Text::Entry,
            Text::CounterKey,
        ] {
            let max = kind.max_bytes();
            assert_eq!(text(kind, ""), Err(TextError::Empty));
            assert_eq!(text(kind, &"k".repeat(max)), Ok(()));
            let err = text(kind, &"k".repeat(max + 1)).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("{} bytes is over the limit of {max}", max + 1)
            );
        }
    }
}
