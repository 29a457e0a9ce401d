//! `ringlimit-client`: what a gateway needs to call a ringlimit cluster, and nothing of
//! the server.
//!
//! - [`Client`]: ring-aware routing (each check straight to its key's owner, learned
//!   from any node and kept fresh), a per-call deadline, a local deny cache, and fail
//!   open or fail closed per call, the answer saying which happened ([`Source`]).
//! - [`contract`]: the 429 contract as a domain type: `Retry-After` rounded up, both
//!   header families, `RateLimit-Policy`, the `application/problem+json` body.
//! - [`retry`]: full jitter and a retry budget, with the design reference's numbers.
//! - [`layer`]: a `tower` layer limiting an HTTP service by a key and route taken from
//!   each request, answering 429 itself.
//!
//! ```no_run
//! # async fn demo() -> Result<(), ringlimit_client::ClientError> {
//! use ringlimit_client::{Check, Client, ClientConfig};
//! let client = Client::connect(ClientConfig::new(["127.0.0.1:7420"])).await?;
//! let answer = client.check(&Check::new("cust_42", "POST /v1/charges")).await?;
//! if !answer.allowed() {
//!     let now_ms = 1_738_368_054_000;
//!     for (name, value) in ringlimit_client::contract::headers(&answer.quota, &answer.rule, answer.window_ms, now_ms) {
//!         println!("{name}: {value}");
//!     }
//! }
//! # Ok(()) }
//! ```

pub mod client;
pub mod contract;
pub mod layer;
pub mod retry;

/// The public API's generated types (client side).
#[allow(missing_docs, clippy::all)]
pub mod proto {
    tonic::include_proto!("ringlimit.v1");
}

pub use client::{
    Answer, Check, Client, ClientConfig, ClientError, Coalesce, CoalesceStats, Source, Unavailable,
};
pub use contract::Quota;
pub use layer::{RateLimitLayer, Target};
pub use retry::{Jitter, RetryBudget};
