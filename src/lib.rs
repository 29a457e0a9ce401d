//! ringlimit: a self-contained clustered rate limiter.
//!
//! API gateways ask a ringlimit node over gRPC "may this request proceed?" and get a
//! verdict with the numbers a 429 needs (limit, remaining, retry-after, reset).
//!
//! # Floors, in the direction a check flows
//!
//! Each floor imports only floors below it; the arrows are the only ones there are.
//!
//! ```text
//! main (binary)  clap → cli/<subcommand> → node::run; bench/ (load generator)
//! node           composition root: binds listeners, wires every subsystem, node config
//!   │
//! server         wire adapters: ringlimit.v1, Envoy RLS, Gubernator V1 (public), peer
//!   │            (cluster), ops (HTTP); Status at the edge
//!   │      prost types stop here and in cluster::forward
//! check          wire-independent: input → validate/plan (field paths) → Checker → Verdict
//!   │
//! cluster        router = pure policy + one async step; forward (peer client adapter),
//!   │            handoff, deny cache, rules (the versioned cluster rule set); Decider,
//!   │            Answer, CheckItem (identity computed once)
//! shard          actor handles + tasks; the store; counter identity (KeyId)
//!   │
//! config  membership  clock        rules and routes; gossip → ClusterView; time
//!   │     keyring                  the cluster key (pure)
//!   │
//! algorithms  ring                 pure: the five limiters; the consistent-hash ring
//! ```
//!
//! - [`algorithms`]: the five limiters as pure state machines (`now` is an argument).
//! - [`ring`]: the consistent-hash ring that places keys on cluster members.
//! - [`clock`]: wall-clock milliseconds, clamped so they never run backwards.
//! - [`config`]: the rule document and route syntax (most specific rule wins), version
//!   stamps and the stored copy.
//! - [`keyring`]: the cluster key members prove on peer calls and gossip datagrams.
//! - [`membership`]: chitchat gossip publishing a watch of the cluster view.
//! - [`shard`]: the per-shard store and the actors that own it.
//! - [`cluster`]: where each descriptor is decided (here, one hop away, the deny cache,
//!   fail-open), and state handoff when ownership moves.
//! - [`check`]: the seam under every front end: [`check::Checker`].
//! - [`server`]: the gRPC front ends, one mapping file each, and their protobuf codec;
//!   the ops HTTP face.
//! - [`node`]: starts and stops a node as named steps, and wires its three faces
//!   (public gRPC, peer, ops HTTP) with their authentication; `node::grpc` bounds what
//!   one client can make the gRPC listener hold.
//! - [`proto`]: generated wire types, used only by `server`, `cluster::forward` and
//!   tools.
//!
//! What a gateway does with a verdict (the 429 contract, the ring-aware client) is the
//! `ringlimit-client` crate (`client/`); gateways and the CLI import it directly.
//!
//! `proto` sits beside the floors: nothing in `algorithms`, `ring`, `shard`,
//! `membership`, `config`, `clock`, `check` or the routing core imports it.

pub mod algorithms;
pub mod check;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod keyring;
pub mod membership;
pub mod node;
pub mod proto;
/// The consistent-hash ring, a crate of its own so the ring-aware client computes the
/// same owners (`ring/`).
pub use ringlimit_ring as ring;
pub mod server;
pub mod shard;
