//! The call proof every peer call carries: the proof header binds the method path, this
//! node's id, the time and a nonce ([`Keyring::sign_call`]). [`call_proof`] makes one
//! from values it is given; [`Signed`] is the tower service that stamps it on each call
//! with the system clock and the next nonce.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use tonic::transport::Channel;

use crate::keyring::{Keyring, CALL_HEADER};

/// The proof header of a call to `path` made by node `me` at `now_ms` (wall clock) with
/// `nonce`. `None` when `me` cannot travel in a header (node ids are validated to be
/// visible ASCII, so only a tool's own id can get there; the peer then refuses the
/// unsigned call).
pub fn call_proof(
    keyring: &Keyring,
    me: &str,
    path: &str,
    now_ms: u64,
    nonce: u64,
) -> Option<http::HeaderValue> {
    let proof = keyring.sign_call(path, me, now_ms, nonce);
    // From the String itself: its buffer becomes the header's, no copy.
    http::HeaderValue::try_from(proof).ok()
}

/// A channel to a peer that signs every call with the cluster key (see [`call_proof`]).
/// Tools that call a peer's `Peer` service (`cluster status`, test harnesses) use it too.
#[derive(Clone)]
pub struct Signed {
    inner: Channel,
    signer: Option<Arc<Signer>>,
}

struct Signer {
    keyring: Keyring,
    me: Arc<str>,
    nonce: AtomicU64,
}

impl Signed {
    /// Sign calls on `inner` as `me` with `keyring` (`None`: send them unsigned).
    pub fn new(inner: Channel, keyring: Option<Keyring>, me: Arc<str>) -> Self {
        use std::hash::{BuildHasher, Hasher};
        // Nonces start at a random point so two incarnations of one node id never
        // reuse a (node, nonce) pair within the replay window.
        let start = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        Self {
            inner,
            signer: keyring.map(|keyring| {
                Arc::new(Signer {
                    keyring,
                    me,
                    nonce: AtomicU64::new(start),
                })
            }),
        }
    }
}

impl Signed {
    /// A fresh proof for `path` (a framed connection's hello), `None` without a
    /// cluster key.
    pub fn proof(&self, path: &str) -> Option<String> {
        let signer = self.signer.as_ref()?;
        let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
        let nonce = signer
            .nonce
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(signer.keyring.sign_call(path, &signer.me, now, nonce))
    }
}

impl tonic::codegen::Service<http::Request<tonic::body::Body>> for Signed {
    type Response =
        <Channel as tonic::codegen::Service<http::Request<tonic::body::Body>>>::Response;
    type Error = <Channel as tonic::codegen::Service<http::Request<tonic::body::Body>>>::Error;
    type Future = <Channel as tonic::codegen::Service<http::Request<tonic::body::Body>>>::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<tonic::body::Body>) -> Self::Future {
        if let Some(signer) = &self.signer {
            // The system clock on purpose, as the verifier's (see `server::peer_auth`).
            let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
            let nonce = signer
                .nonce
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path = request.uri().path();
            match call_proof(&signer.keyring, &signer.me, path, now, nonce) {
                Some(value) => {
                    request.headers_mut().insert(CALL_HEADER, value);
                }
                None => tracing::error!(
                    me = %signer.me,
                    "this id cannot travel in a peer-call proof; the call goes unsigned"
                ),
            }
        }
        self.inner.call(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyring() -> Keyring {
        Keyring::from_text(&crate::keyring::generate_secret()).unwrap()
    }

    #[test]
    fn a_proof_verifies_for_its_path_and_time_only() {
        let keys = keyring();
        let value = call_proof(&keys, "node-a", "/ringlimit.peer.Peer/Forward", 1_000, 7)
            .expect("a visible id");
        let header = value.to_str().unwrap();
        let proof = keys
            .verify_call(Some(header), "/ringlimit.peer.Peer/Forward", 1_000)
            .expect("verifies");
        assert_eq!(&*proof.from, "node-a");
        assert!(keys
            .verify_call(Some(header), "/ringlimit.peer.Peer/Install", 1_000)
            .is_err());
        let later = 1_000 + crate::keyring::CALL_SKEW_MS + 1;
        assert!(keys
            .verify_call(Some(header), "/ringlimit.peer.Peer/Forward", later)
            .is_err());
    }

    #[test]
    fn an_id_that_cannot_travel_in_a_header_gives_no_proof() {
        assert!(call_proof(&keyring(), "bad\nid", "/p", 1, 1).is_none());
    }
}
