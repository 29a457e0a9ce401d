//! The cluster wing: where each planned descriptor is decided, and how state follows
//! ownership when members come and go.
//!
//! - [`policy`]: routing policy as pure functions (which descriptors are decided here,
//!   answered from the deny cache or sent to their owner; fail-open and fail-closed
//!   answers; which admissions to refund where). Unit-tested without sockets.
//! - [`flight`]: a client check's flight (plan, owners, fail-over to the successor's
//!   replica, fallbacks, landing with refunds) as a state machine with no I/O inside.
//! - [`router`]: the async shell that drives a flight with this node's shards and the
//!   peer pool (and decides forwarded batches, leases, reservations).
//! - [`link`]: the peer client adapter (one batched HTTP/2 channel per peer): state
//!   machines with no I/O inside and a thin tonic shell around them. With the peer
//!   server adapter in `server::peer`, it is the only code here that sees prost types;
//!   everything else speaks the domain types below.
//! - [`handoff`]: pushes state to new owners on ring changes.
//! - [`replication`]: successor replicas (sends, restores, fail-over pushes); [`outbox`]:
//!   which replicas go now and which wait for their successor's batch in flight.
//! - [`budget`]: budget leases of hot counters, the entry's side (which checks a held
//!   lease decides, the returns of unused units); the router asks and spends them.
//! - [`deny_cache`]: "denied until T", answered without a hop.
//! - [`reservation`]: reservation ids and answers (`Reserve`/`Commit`); the router
//!   sends each to its key's owner (`router/reserve.rs`).
//! - [`rules`]: the rule set as cluster state: versioned, written through the API,
//!   copied between members over the peer face, persisted.
//! - [`rules_edit`]: a rules write as it travels (what `rules` applies and `link`
//!   carries), so neither of those two imports the other for it.
//!
//! Dependencies point down: `shard`, `membership`, `ring`, `config`, `clock`,
//! `algorithms`; nothing here knows a front end.

pub mod budget;
pub mod deny_cache;
pub mod flight;
pub mod handoff;
pub mod link;
pub mod outbox;
pub mod policy;
pub mod replica_batches;
pub mod replication;
pub mod reservation;
pub mod router;
pub mod rules;
pub mod rules_edit;

use std::num::NonZeroU64;
use std::sync::Arc;

use crate::algorithms::{AlgorithmKind, Decision, Millis};
use crate::config::route::Route;
use crate::config::rules::Rule;
use crate::membership::Member;
use crate::shard::{Charge, KeyId, Target};
pub use router::{Inherited, Router};

/// Who decided: stamped on every answer so a checker can audit the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decider {
    /// Stable node id.
    pub node_id: Arc<str>,
    /// Start time in ns: changes on every restart.
    pub generation: u64,
}

/// One validated descriptor with its matched rule, ready to be decided.
///
/// Its identity (`id`: the client key's ring placement and the counter's
/// discriminator) is computed once, when it is planned, and reused for the owner
/// lookup, the shard choice, the store and the deny cache. It is the [`KeyId`] of (rule
/// name, client key, route part), where the route part is empty unless the rule counts
/// per route (`per = "route"`), and then the normalised route (method + path, no query
/// string or fragment): see [`CountPer`](crate::config::rules::CountPer).
#[derive(Debug, Clone)]
pub struct CheckItem {
    /// The counter's identity under `rule`.
    pub id: KeyId,
    /// The rule that matched (name, numbers, algorithm).
    pub rule: Arc<Rule>,
    /// The client key followed by the route as sent, in one allocation (a check's only
    /// one for its strings): see [`CheckItem::client`] and [`CheckItem::route`].
    text: Arc<str>,
    /// Length of the client key, the prefix of `text`.
    client_len: usize,
    /// Length of the normalised route (method + path), a prefix of the route.
    normalised_len: usize,
    /// The tier the caller sent (the owner re-matches rules with it when forwarded).
    pub tier: Option<Arc<str>>,
    /// Units to consume.
    pub cost: NonZeroU64,
    /// Report, do not count (Envoy's `hits_addend = 0`): decided with a cost of 1 and
    /// that unit given back at once, like a sibling's refund.
    pub probe: bool,
    /// How the owner finds this item's rule when it is not matched by (key, route,
    /// tier): set for Envoy descriptors, whose rule comes from the Envoy configuration,
    /// and for Gubernator items, whose rule the request carried inline.
    pub named: Option<NamedRule>,
    /// Units to give back to the counter on its owner's shard just before this check is
    /// decided, in the same shard step (Gubernator's negative hits and
    /// `RESET_REMAINING`): see [`Charge::give_back`].
    pub give_back: Option<NonZeroU64>,
    /// On a denial, take what the counter still holds (Gubernator's
    /// `DRAIN_OVER_LIMIT`): see [`Charge::drain`].
    pub drain: bool,
    /// Report, change nothing: see [`Charge::peek`]. Unlike a [`probe`](Self::probe)
    /// there is nothing to give back afterwards.
    pub peek: bool,
    /// Answered by the owner only: never from this node's deny cache, and its denials
    /// are not cached. Set where a request can raise a counter's budget (a give-back,
    /// a reset) or change its numbers per call, so "denied until T" is not a fact.
    pub uncached: bool,
    /// Decide on the key's replica, for an owner that could not be reached: set by the
    /// entry node when it sends the check to the key's successor instead (see
    /// [`Charge::target`]).
    pub target: Target,
}

/// The numbers of a rule a request carried itself (Gubernator's `limit`, `duration`,
/// `burst`): what a forwarded item carries so the owner builds the same rule, and
/// validates them like any input (`check::gubernator::inline_rule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InlineRule {
    /// `FixedWindow` or `TokenBucket`.
    pub kind: AlgorithmKind,
    /// Units per window (fixed window) or refilled per window (token bucket).
    pub limit: u64,
    /// The window (or refill period), in ms.
    pub window_ms: u64,
    /// Token bucket capacity (0 for a fixed window).
    pub burst: u64,
}

/// Most distinct inline rules (algorithm, limit, duration, burst) one node plans from
/// its callers in its lifetime. Every distinct set of numbers is a rule fingerprint that
/// a shard interns for good in a table of 2^20; a full table makes the shard drop every
/// key (TOML and Envoy counters included). Capped at each entry node, an owner sees at
/// most `nodes × MAX_INLINE_RULES` of them: under the table's size for up to 31 nodes.
pub const MAX_INLINE_RULES: usize = 32_768;

/// The inline rules a node knows, built once each: the ones its callers sent (at most
/// [`MAX_INLINE_RULES`]: see there) and the ones peers forwarded to it. One per node,
/// shared by its checker, its peer service and its peer pool, so a handed-over counter
/// can name the numbers of its rule ([`InlineRules::inline_of`]) and its new owner can
/// rebuild it.
#[derive(Debug, Default)]
pub struct InlineRules {
    known: std::sync::Mutex<InlineTable>,
}

#[derive(Debug, Default)]
struct InlineTable {
    rules: std::collections::HashMap<InlineRule, Arc<Rule>>,
    by_fingerprint: std::collections::HashMap<u64, InlineRule>,
    /// Rules a caller sent (the ones the cap counts).
    planned: usize,
}

impl InlineRules {
    fn table(&self) -> std::sync::MutexGuard<'_, InlineTable> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The rule for numbers a caller sent: `build` (which validates) the first time,
    /// then the same rule. A new one beyond [`MAX_INLINE_RULES`] is refused.
    pub fn rule(
        &self,
        inline: &InlineRule,
        build: impl FnOnce(&InlineRule) -> Result<Arc<Rule>, String>,
    ) -> Result<Arc<Rule>, String> {
        let mut table = self.table();
        if let Some(rule) = table.rules.get(inline) {
            return Ok(rule.clone());
        }
        let rule = build(inline)?;
        if table.planned >= MAX_INLINE_RULES {
            return Err(format!(
                "this node already counts {MAX_INLINE_RULES} distinct Gubernator limits \
                 (algorithm, limit, duration, burst); a new one is refused"
            ));
        }
        table.planned += 1;
        table.insert(*inline, rule.clone());
        Ok(rule)
    }

    /// The rule for numbers a peer sent (a forwarded check, a handed-over counter):
    /// `build` (which validates) unless known. Never refused for the cap (a forwarded
    /// batch is all or nothing); remembered while the table is under twice the cap.
    pub fn forwarded(
        &self,
        inline: &InlineRule,
        build: impl FnOnce(&InlineRule) -> Result<Arc<Rule>, String>,
    ) -> Result<Arc<Rule>, String> {
        let mut table = self.table();
        if let Some(rule) = table.rules.get(inline) {
            return Ok(rule.clone());
        }
        let rule = build(inline)?;
        if table.rules.len() < 2 * MAX_INLINE_RULES {
            table.insert(*inline, rule.clone());
        }
        Ok(rule)
    }

    /// The numbers of the known inline rule with this fingerprint, if any: what a
    /// handed-over counter carries so its new owner can rebuild its rule.
    pub fn inline_of(&self, fingerprint: u64) -> Option<InlineRule> {
        self.table().by_fingerprint.get(&fingerprint).copied()
    }

    /// How many distinct inline rules callers sent to this node.
    pub fn planned(&self) -> usize {
        self.table().planned
    }
}

impl InlineTable {
    fn insert(&mut self, inline: InlineRule, rule: Arc<Rule>) {
        self.by_fingerprint.insert(rule.fingerprint, inline);
        self.rules.insert(inline, rule);
    }
}

/// A rule found by name (in the Envoy configuration), possibly with a request's
/// override of its numbers: what a forwarded Envoy descriptor carries so its owner
/// decides under the same rule as its sender.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedRule {
    /// The configured rule's name.
    pub name: Arc<str>,
    /// A request's limit override (requests per unit, unit in seconds), if any.
    pub override_limit: Option<(u32, u64)>,
    /// A rule the request carried inline: the owner builds it from these numbers and
    /// looks nothing up by `name`.
    pub inline: Option<InlineRule>,
}

impl CheckItem {
    /// A planned item: the counter's identity is computed here, once.
    pub fn new(
        rule: Arc<Rule>,
        client: &str,
        route: Route<'_>,
        tier: Option<&str>,
        cost: NonZeroU64,
    ) -> Self {
        let normalised = route.as_str();
        // Joined on the stack and copied once into the `Arc` (from a `String`, `Arc::from`
        // would copy it again into an allocation of its own).
        let mut joined: smallvec::SmallVec<[u8; 192]> = smallvec::SmallVec::new();
        joined.extend_from_slice(client.as_bytes());
        joined.extend_from_slice(route.sent().as_bytes());
        let text = std::str::from_utf8(&joined).expect("two strings joined are a string");
        Self {
            id: KeyId::of(
                &rule.name,
                client.as_bytes(),
                rule.per.route_part(normalised),
            ),
            rule,
            text: Arc::from(text),
            client_len: client.len(),
            normalised_len: normalised.len(),
            tier: tier.map(Arc::from),
            cost,
            probe: false,
            named: None,
            give_back: None,
            drain: false,
            peek: false,
            uncached: false,
            target: Default::default(),
        }
    }

    /// This item as a probe: see [`CheckItem::probe`].
    pub fn probing(mut self, probe: bool) -> Self {
        self.probe = probe;
        self
    }

    /// This item with its rule found by name: see [`CheckItem::named`].
    pub fn named(mut self, named: NamedRule) -> Self {
        self.named = Some(named);
        self
    }

    /// The client key.
    pub fn client(&self) -> &str {
        &self.text[..self.client_len]
    }

    /// The client key and the route as sent, as [`Text`](crate::text::Text)s sharing
    /// this item's one string: what a forward writes, with no copy of either.
    pub fn texts(&self) -> (crate::text::Text, crate::text::Text) {
        crate::text::Text::shared(self.text.clone()).split_at(self.client_len)
    }

    /// The route as sent, query string included: echoed in the answer and forwarded to
    /// the owner, which plans it again and so normalises it the same way.
    pub fn route(&self) -> &str {
        &self.text[self.client_len..]
    }

    /// The route as counted by a `per = "route"` rule: method + path, without the query
    /// string or fragment it was sent with.
    pub fn normalised_route(&self) -> &str {
        &self.route()[..self.normalised_len]
    }

    /// What this node's shard needs to decide it: identity, rule and cost.
    pub fn charge(&self) -> Charge {
        Charge {
            id: self.id,
            rule: self.rule.clone(),
            cost: self.cost,
            give_back: self.give_back,
            drain: self.drain,
            peek: self.peek,
            target: self.target,
        }
    }

    /// The item decided under another rule (a fail-open stand-in): a different counter,
    /// scoped the way that rule counts (a stand-in counts like the rule it stands in for).
    pub fn under(&self, rule: Arc<Rule>) -> Charge {
        let route = rule.per.route_part(self.normalised_route());
        Charge {
            id: KeyId::of(&rule.name, self.client().as_bytes(), route),
            rule,
            cost: self.cost,
            give_back: self.give_back,
            drain: self.drain,
            peek: self.peek,
            target: Default::default(),
        }
    }
}

/// One descriptor's answer, wherever it was decided.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The verdict and numbers.
    pub decision: Decision,
    /// The decider's sequence number (0 for answers that no decider made just now).
    pub sequence: u64,
    /// The decider's clock at the decision (quoted by a refund).
    pub at: Millis,
    /// Who decided.
    pub decider: Decider,
    /// Not decided by the key's owner: fail-open fallback, fail-closed, or deny cache.
    pub degraded: bool,
    /// Forward hops (0: decided here).
    pub hops: u32,
    /// Rule name as the decider reported it.
    pub rule: Arc<str>,
    /// The rule's algorithm.
    pub algorithm: AlgorithmKind,
    /// Where a refund of this answer must go.
    pub charged: Charged,
}

/// Where an admitted answer was charged, i.e. where to send its refund.
#[derive(Debug, Clone)]
pub enum Charged {
    /// Nothing was charged (denied, cached, fail-closed).
    Nothing,
    /// This node's shards, on this counter (the real one or its fail-open stand-in).
    Here(Charge),
    /// The owner, one hop away.
    Owner(Member),
    /// A budget lease this node holds, charged on the owner when it was granted
    /// (`budget.rs`): decided here, without a hop.
    Lease,
}

/// One descriptor of a decided check.
#[derive(Debug, Clone)]
pub struct DescriptorOutcome {
    /// The descriptor as planned.
    pub item: CheckItem,
    /// Its answer.
    pub answer: Answer,
    /// Admitted, then given back because another descriptor of the check denied.
    pub refunded: bool,
}

impl DescriptorOutcome {
    /// Denied by a rule in shadow mode: reported, but the check is not denied for it.
    pub fn shadow_denied(&self) -> bool {
        !self.answer.decision.allowed && self.item.rule.shadow
    }

    /// Decided from a budget lease this node holds (see [`Charged::Lease`]).
    pub fn leased(&self) -> bool {
        matches!(self.answer.charged, Charged::Lease)
    }

    /// Allowed as far as the check is concerned: admitted, or denied only in shadow mode.
    pub fn enforced_allowed(&self) -> bool {
        self.answer.decision.allowed || self.item.rule.shadow
    }
}

/// The planned descriptors of the checks of one call, one vector per check. Inline for
/// one check (a unary call), so a unary check costs no vector to hold its one vector.
pub type Checks = smallvec::SmallVec<[Items; 1]>;

/// One check's planned descriptors: inline for one, the common case.
pub type Items = smallvec::SmallVec<[CheckItem; 1]>;

/// One check's decided descriptors, in request order: inline for one, like [`Items`].
pub type DescriptorOutcomes = smallvec::SmallVec<[DescriptorOutcome; 1]>;

/// The decided checks of one call, in request order; inline for one, like [`Checks`].
pub type DecidedChecks = smallvec::SmallVec<[Decided; 1]>;

/// One check's descriptors with their answers after refunds (one vector per check:
/// the verdict keeps it as it is).
#[derive(Debug)]
pub struct Decided {
    /// In request order.
    pub descriptors: DescriptorOutcomes,
}

/// An owner's answer to one forwarded descriptor, as the peer client adapter decodes it.
#[derive(Debug, Clone)]
pub struct Remote {
    /// The owner's decision.
    pub decision: Decision,
    /// The owner's sequence number.
    pub sequence: u64,
    /// The owner's clock at the decision.
    pub at: Millis,
    /// The owner.
    pub decider: Decider,
    /// The rule the owner matched.
    pub rule: Arc<str>,
    /// The owner's algorithm, if it named one this node knows.
    pub algorithm: Option<AlgorithmKind>,
}
