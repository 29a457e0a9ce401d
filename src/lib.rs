//! ringlimit: a self-contained clustered rate limiter.
//!
//! API gateways ask a ringlimit node over gRPC "may this request proceed?" and get a
//! verdict with the numbers a 429 needs (limit, remaining, retry-after, reset).
//!
//! # Map, in the direction a check flows
//!
//! ```text
//! gRPC (proto) ─▶ server ──validate, match rules (config)──▶ shard ──▶ algorithms
//!                   │                                         │  (one actor per shard,
//!                   ◀──────────── respond, refund ◀───────────┘   state owned by value)
//! node: composition root, starts everything; clock: injected time
//! ```
//!
//! - [`algorithms`]: the five limiters as pure state machines (`now` is an argument).
//! - [`clock`]: wall-clock milliseconds, clamped so they never run backwards.
//! - [`config`]: node settings and the rule file (most specific rule wins).
//! - [`shard`]: the per-shard store and the actors that own it.
//! - [`server`]: the gRPC service and the wire-independent [`server::Checker`].
//! - [`client`]: what a gateway does with an answer (429 headers).
//! - [`ring`]: the consistent-hash ring that places keys on cluster members.
//! - [`node`]: starts and stops a node.
//!
//! Dependencies point downwards only: `algorithms`, `ring` and `clock` depend on
//! nothing internal; `shard` on `algorithms` and `clock`; `server` on `shard`;
//! `node` on everything.

pub mod algorithms;
pub mod client;
pub mod clock;
pub mod config;
pub mod deny_cache;
pub mod error;
pub mod membership;
pub mod node;
pub mod proto;
pub mod ring;
pub mod server;
pub mod shard;
