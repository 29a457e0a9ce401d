//! ringlimit: a self-contained clustered rate limiter.
//!
//! API gateways ask a ringlimit node over gRPC "may this request proceed?" and get a
//! verdict with the numbers a 429 needs (limit, remaining, retry-after, reset).
//!
//! # Floors, in the direction a check flows
//!
//! Each floor imports only floors below it; `tests/floors.rs` holds every module to the
//! arrows drawn here.
//!
//! ```text
//! main (binary)  clap → cli/<subcommand> → node::run; bench/ (load generator)
//! node           composition root: binds listeners, wires every subsystem, node config
//!   │
//! server         wire adapters: ringlimit.v1 (+ its wire codec), Envoy RLS, Gubernator V1
//!   │            (public), RESP (redis-cell's CL.THROTTLE), peer (cluster), ops (HTTP);
//!   │            Status at the edge
//!   │      prost types stop here and in cluster::link's adapter files (wire, calls, shell)
//! check          wire-independent: input → validate/plan (field paths) → Checker → Verdict;
//!   │            forwarded items are planned here by the same code as public ones
//! cluster        flight (a check's steps, no I/O) driven by the router's async shell;
//!   │            link (peer client: batcher and stream session as state machines, a
//!   │            thin tonic shell), handoff, deny cache, rules (the versioned cluster
//!   │            rule set); CheckItem (identity once)
//! shard          actor handles + tasks; the store; counter identity (KeyId)
//!   │
//! config  membership               rules, routes and every input bound (config::bounds);
//!   │                              gossip → ClusterView
//! clock  keyring                   time (clamped wall-clock ms); the cluster key (pure)
//!   │
//! algorithms  ring  text           pure: the five limiters; the consistent-hash ring;
//!                                  protobuf strings as shared slices (text::Text)
//! ```
//!
//! `proto` (generated wire types) sits beside the floors: only `server`, the link's
//! adapter files and the xDS client's (`node::xds`: wire, stream) use it, and its
//! generated services name `server`'s codec and the peer messages `cluster::link`
//! writes by hand (`item`, `key_state`: their strings are slices).
//!
//! # One result, one name per floor
//!
//! What a check's answer is called on each floor, bottom to top:
//!
//! ```text
//! algorithms::Decision        one algorithm's verdict and numbers on one counter
//! shard::Outcome              a Decision with the shard's facts (sequence, clock, fresh)
//! cluster::Remote             an owner's Outcome as the link decodes it from the wire
//! cluster::Answer             one descriptor's answer wherever it was decided (here, the
//!                             owner, the deny cache, a fallback): Decision + who, how
//! cluster::DescriptorOutcome  a planned item with its Answer (and whether refunded);
//! cluster::Decided            one check's DescriptorOutcomes
//! check::Verdict              the check's verdict: the overall numbers + every
//!                             DescriptorOutcome (one name, not two, for that)
//! check::domain::DomainVerdict, check::gubernator::RateLimitStatus,
//! check::throttle::ThrottleReply
//!                             the same Verdict in Envoy's, Gubernator's and
//!                             redis-cell's terms
//! server::ringlimit_v1::CheckAnswer, proto messages
//!                             the wire message a front end sends
//! ```
//!
//! - [`algorithms`]: the five limiters as pure state machines (`now` is an argument).
//! - [`ring`]: the consistent-hash ring that places keys on cluster members.
//! - [`clock`]: wall-clock milliseconds, clamped so they never run backwards.
//! - [`config`]: the rule document and route syntax (most specific rule wins), version
//!   stamps and the stored copy; the xDS subscription to Envoy domains as a state machine.
//! - [`keyring`]: the cluster key members prove on peer calls and gossip datagrams.
//! - [`membership`]: chitchat gossip publishing a watch of the cluster view.
//! - [`shard`]: the per-shard store and the actors that own it.
//! - [`cluster`]: where each descriptor is decided (here, one hop away, the deny cache,
//!   fail-open), and state handoff when ownership moves.
//! - [`check`]: the seam under every front end: [`check::Checker`].
//! - [`server`]: the gRPC front ends, one mapping file each, and their protobuf codec;
//!   the ops HTTP face.
//! - [`node`]: starts and stops a node as named steps, and wires its three faces
//!   (public gRPC, peer, ops HTTP) with their authentication, and the RESP face for
//!   Redis clients when asked for (`node::resp_listener`); `node::grpc` bounds what
//!   one client can make the gRPC listener hold; `node::xds` follows an xDS control
//!   plane's Envoy domains (`--envoy-xds`).
//! - [`proto`]: generated wire types, used only by `server`, `cluster::link`'s and
//!   `node::xds`'s adapter files and tools.
//!
//! What a gateway does with a verdict (the 429 contract, the ring-aware client) is the
//! `ringlimit-client` crate (`client/`); gateways and the CLI import it directly.

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
pub mod text;
