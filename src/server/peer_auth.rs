//! Only members speak for the cluster: every call to the peer service must carry a
//! proof made with the cluster key ([`crate::keyring::Keyring::sign_call`]), checked
//! here before any peer handler runs.
//!
//! A call without a valid proof (no header, a tag that does not verify under any key
//! of the ring, a timestamp more than [`crate::keyring::CALL_SKEW_MS`] from this
//! node's clock, or a replay of a proof already seen) is answered `UNAUTHENTICATED`
//! and counted in `ringlimit_peer_auth_refused_total{reason}`. Without a keyring (a lone
//! loopback node, or `--insecure-cluster`) every call passes, as before.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tonic::Status;

use crate::keyring::{CallRefused, Keyring, ReplayGuard, CALL_HEADER};

/// Calls remembered against replay (a member sends far fewer within the window).
const REPLAY_CAP: usize = 1 << 20;

/// The layer that checks peer calls' proofs.
#[derive(Clone)]
pub struct PeerAuthLayer {
    check: Option<Arc<Check>>,
}

struct Check {
    keyring: Keyring,
    guard: Mutex<ReplayGuard>,
    refused: [metrics::Counter; 5],
}

impl PeerAuthLayer {
    /// Check every call against `keyring`; `None` lets every call through.
    pub fn new(keyring: Option<Keyring>) -> Self {
        let counter = |reason: &'static str| metrics::counter!("ringlimit_peer_auth_refused_total", "reason" => reason);
        Self {
            check: keyring.map(|keyring| {
                Arc::new(Check {
                    keyring,
                    guard: Mutex::new(ReplayGuard::new(REPLAY_CAP)),
                    refused: ["missing", "malformed", "tag", "stale", "replay"].map(counter),
                })
            }),
        }
    }
}

impl PeerAuthLayer {
    /// Whether a connection or call to `path` proving itself with `proof` is admitted:
    /// the check every `Peer` call's header goes through, with the same replay guard
    /// and counters, for a framed connection's hello (`server::peer::frames`).
    pub fn admit(&self, path: &str, proof: Option<&str>) -> Result<(), CallRefused> {
        match &self.check {
            Some(check) => check.admit(path, proof),
            None => Ok(()),
        }
    }
}

/// Whether a call to `path` carrying proof `header` is admitted at `now_ms` (wall clock):
/// its proof verifies under `keyring` within the allowance and was not seen before
/// (`guard` remembers it). A pure function of its inputs: the layer passes the clock.
pub fn admit_call(
    keyring: &Keyring,
    guard: &mut ReplayGuard,
    path: &str,
    header: Option<&str>,
    now_ms: u64,
) -> Result<(), CallRefused> {
    let proof = keyring.verify_call(header, path, now_ms)?;
    guard.admit(&proof, now_ms)
}

/// Where a refusal is counted in `ringlimit_peer_auth_refused_total{reason}`.
fn reason_index(refused: &CallRefused) -> usize {
    match refused {
        CallRefused::Missing => 0,
        CallRefused::Malformed => 1,
        CallRefused::BadTag => 2,
        CallRefused::Stale { .. } => 3,
        CallRefused::Replayed => 4,
    }
}

impl Check {
    fn admit(&self, path: &str, header: Option<&str>) -> Result<(), CallRefused> {
        // The system clock, not the node's injected one, on purpose: a proof's window is
        // about real time between two processes (the caller signs with its own system
        // clock), while the injected clock is the decision clock that tests stop and
        // move; checking proofs against it would refuse every member in such a test.
        let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
        let mut guard = self.guard.lock().unwrap_or_else(|e| e.into_inner());
        let outcome = admit_call(&self.keyring, &mut guard, path, header, now);
        drop(guard);
        if let Err(refused) = &outcome {
            self.refused[reason_index(refused)].increment(1);
            tracing::debug!(%refused, path, "peer call refused");
        }
        outcome
    }
}

impl<S> tower_layer::Layer<S> for PeerAuthLayer {
    type Service = PeerAuth<S>;

    fn layer(&self, inner: S) -> Self::Service {
        PeerAuth {
            inner,
            check: self.check.clone(),
        }
    }
}

/// The service of [`PeerAuthLayer`].
#[derive(Clone)]
pub struct PeerAuth<S> {
    inner: S,
    check: Option<Arc<Check>>,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B, R> tonic::codegen::Service<http::Request<B>> for PeerAuth<S>
where
    S: tonic::codegen::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    R: Default + Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if let Some(check) = &self.check {
            let header = request
                .headers()
                .get(CALL_HEADER)
                .and_then(|v| v.to_str().ok());
            if let Err(refused) = check.admit(request.uri().path(), header) {
                let response = Status::unauthenticated(refused.to_string()).into_http();
                return Box::pin(async move { Ok(response) });
            }
        }
        Box::pin(self.inner.call(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyring() -> Keyring {
        Keyring::from_text(&crate::keyring::generate_secret()).unwrap()
    }

    const PATH: &str = "/ringlimit.peer.v1.Peer/Forward";

    #[test]
    fn a_signed_call_is_admitted_once_and_a_replay_is_refused() {
        let keys = keyring();
        let mut guard = ReplayGuard::new(16);
        let header = keys.sign_call(PATH, "node-a", 10_000, 1);
        assert_eq!(
            admit_call(&keys, &mut guard, PATH, Some(&header), 10_000),
            Ok(())
        );
        assert_eq!(
            admit_call(&keys, &mut guard, PATH, Some(&header), 10_001),
            Err(CallRefused::Replayed)
        );
    }

    #[test]
    fn calls_without_a_valid_proof_are_refused_for_their_reason() {
        let keys = keyring();
        let mut guard = ReplayGuard::new(16);
        let refused = |guard: &mut ReplayGuard, header: Option<&str>, now| {
            admit_call(&keys, guard, PATH, header, now).unwrap_err()
        };
        assert_eq!(refused(&mut guard, None, 0), CallRefused::Missing);
        assert_eq!(refused(&mut guard, Some("v1 x"), 0), CallRefused::Malformed);
        let other = keyring().sign_call(PATH, "node-a", 10_000, 2);
        assert_eq!(
            refused(&mut guard, Some(&other), 10_000),
            CallRefused::BadTag
        );
        let old = keys.sign_call(PATH, "node-a", 10_000, 3);
        let late = 10_000 + crate::keyring::CALL_SKEW_MS + 1;
        assert_eq!(
            refused(&mut guard, Some(&old), late),
            CallRefused::Stale { at: 10_000 }
        );
        let reasons = [
            CallRefused::Missing,
            CallRefused::Malformed,
            CallRefused::BadTag,
            CallRefused::Stale { at: 0 },
            CallRefused::Replayed,
        ];
        let indexes: Vec<usize> = reasons.iter().map(reason_index).collect();
        assert_eq!(indexes, vec![0, 1, 2, 3, 4], "one counter per reason");
    }
}
