//! The ops listener's bounds: what one client can make the ops port hold.
//!
//! The ops port serves `/readyz` to Kubernetes and `/metrics` to Prometheus, so a client
//! that opens connections and sends nothing must not starve them (1,500 such connections
//! used to leave `/metrics` timing out: the port waited for a free slot while idle
//! connections held every one). axum's server has neither a connection cap nor a header
//! timeout of its own, so the listener adds them:
//!
//! - [`OpsConnections`]: the pure admission policy. At most `max` connections are open;
//!   a new one at the cap closes the connection that has waited longest for a request
//!   head (idle keep-alive or header-less alike), so the newest caller is served. Only
//!   when every open connection is serving a request is the new one closed instead.
//! - [`BoundedListener`] / [`BoundedStream`]: the accept loop and the connection around
//!   that policy. A connection must complete a request head within the header timeout of
//!   opening or of its previous response, and lives at most the maximum age.
//!
//! Whether a request head is complete is read from the bytes themselves (the blank line
//! that ends an HTTP/1.1 head), so the policy holds whatever the server does inside.
//! On a TLS listener (the HTTP check face with `--tls-cert`) those are the bytes TLS
//! decrypted, and the handshake is part of the wait for the first head: a handshake
//! that stalls meets the header timeout and can be evicted at the cap like any
//! connection that has not sent a head.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use super::public_tls::{PublicAcceptor, ServerStream};

/// Most connections the ops port holds at once. Prometheus, probes and operators need a
/// handful; past it the connection that has waited longest for a request is closed.
pub const MAX_OPS_CONNECTIONS: usize = 128;

/// Longest life of one ops connection: requests are short, so a connection still open
/// after this is closed (a client that wants more reconnects). This bounds a request
/// that trickles in (a body a byte a minute) once its head is complete.
pub const MAX_OPS_CONNECTION_AGE: Duration = Duration::from_secs(30);

/// Time a connection has to send a complete request head, from opening or from its
/// previous response: probes and scrapers send theirs at once, so this also closes idle
/// keep-alive connections.
pub const OPS_HEADER_TIMEOUT: Duration = Duration::from_secs(5);

pub use super::config::MAX_HEAD_BYTES;

/// The bounds of the ops listener (and of the HTTP check face, which shares it).
#[derive(Debug, Clone, Copy)]
pub struct OpsBounds {
    /// Connections open at once.
    pub max_connections: usize,
    /// Life of one connection.
    pub max_age: Duration,
    /// Time to complete a request head.
    pub header_timeout: Duration,
    /// Bytes of one request head at most.
    pub max_head_bytes: usize,
    /// The counter of connections closed by these bounds, by `reason`.
    pub closed_metric: &'static str,
}

impl Default for OpsBounds {
    fn default() -> Self {
        OpsBounds {
            max_connections: MAX_OPS_CONNECTIONS,
            max_age: MAX_OPS_CONNECTION_AGE,
            header_timeout: OPS_HEADER_TIMEOUT,
            max_head_bytes: MAX_HEAD_BYTES,
            closed_metric: "ringlimit_ops_connections_closed_total",
        }
    }
}

/// What to do with a newly accepted connection.
#[derive(Debug, PartialEq, Eq)]
pub enum Admit {
    /// Serve it as connection `id`.
    Take(u64),
    /// Serve it as connection `id`, and close `victim`, the one that has waited longest
    /// for a request head.
    Evict {
        /// The new connection.
        id: u64,
        /// The connection to close.
        victim: u64,
    },
    /// Close it: every open connection is serving a request.
    Refuse,
}

/// The open ops connections and, for each, since when it has waited for a request head
/// (`None` while it is serving one). Pure: the listener reports events, this decides.
#[derive(Debug)]
pub struct OpsConnections {
    max: usize,
    next_id: u64,
    waiting_since: HashMap<u64, Option<Instant>>,
}

impl OpsConnections {
    /// A table of at most `max` (at least 1) connections.
    pub fn new(max: usize) -> Self {
        OpsConnections {
            max: max.max(1),
            next_id: 0,
            waiting_since: HashMap::new(),
        }
    }

    /// A connection accepted at `now` (module doc). An evicted victim is forgotten here
    /// at once, so its slot is free before its socket is.
    pub fn admit(&mut self, now: Instant) -> Admit {
        let mut victim = None;
        if self.waiting_since.len() >= self.max {
            // Ties on the instant go to the older id: accepted first.
            let oldest = self
                .waiting_since
                .iter()
                .filter_map(|(id, since)| since.map(|s| (s, *id)))
                .min();
            match oldest {
                Some((_, id)) => {
                    self.waiting_since.remove(&id);
                    victim = Some(id);
                }
                None => return Admit::Refuse,
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting_since.insert(id, Some(now));
        match victim {
            Some(victim) => Admit::Evict { id, victim },
            None => Admit::Take(id),
        }
    }

    /// Connection `id` completed a request head: it is serving a request, never evicted.
    pub fn head_complete(&mut self, id: u64) {
        if let Some(since) = self.waiting_since.get_mut(&id) {
            *since = None;
        }
    }

    /// Connection `id` answered at `now`: it waits for its next request head from now.
    pub fn answered(&mut self, id: u64, now: Instant) {
        if let Some(since) = self.waiting_since.get_mut(&id) {
            *since = Some(now);
        }
    }

    /// Connection `id` is gone.
    pub fn closed(&mut self, id: u64) {
        self.waiting_since.remove(&id);
    }

    /// Connections open.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.waiting_since.len()
    }
}

/// Finds the end of an HTTP/1.1 request head (an empty line, `\r\n` or a bare `\n`)
/// in bytes that arrive in pieces.
#[derive(Debug, Default, Clone, Copy)]
pub struct HeadEnd {
    /// 0: inside a line; 1: at the start of a line; 2: a `\r` at the start of a line.
    state: u8,
}

impl HeadEnd {
    /// Feeds `bytes`; true once the head is complete (the rest is the body's).
    pub fn feed(&mut self, bytes: &[u8]) -> bool {
        for b in bytes {
            self.state = match (self.state, b) {
                (1 | 2, b'\n') => {
                    self.state = 0;
                    return true;
                }
                (_, b'\n') => 1,
                (1, b'\r') => 2,
                _ => 0,
            };
        }
        false
    }
}

/// The locked table of the listener and its connections.
type Table = Arc<Mutex<OpsConnections>>;

fn lock(table: &Table) -> std::sync::MutexGuard<'_, OpsConnections> {
    // The table stays consistent even if a holder panicked: every update is one call.
    table.lock().unwrap_or_else(|e| e.into_inner())
}

/// The ops listener with [`OpsBounds`] (module doc).
pub struct BoundedListener {
    inner: TcpListener,
    table: Table,
    /// The close signal of every connection still in the table.
    closers: Arc<Mutex<HashMap<u64, CancellationToken>>>,
    bounds: OpsBounds,
    /// TLS on every connection (the check face with `--tls-cert`); `None`: plaintext.
    tls: Option<PublicAcceptor>,
}

impl BoundedListener {
    /// Bounds `inner` by `bounds`.
    pub fn new(inner: TcpListener, bounds: OpsBounds) -> Self {
        BoundedListener {
            inner,
            table: Arc::new(Mutex::new(OpsConnections::new(bounds.max_connections))),
            closers: Arc::new(Mutex::new(HashMap::new())),
            bounds,
            tls: None,
        }
    }

    /// This listener speaking TLS only. The handshake runs inside the connection's
    /// bounds: it counts as waiting for a request head (the header timeout, eviction
    /// at the cap), and the accept loop never waits on it.
    pub fn with_tls(mut self, tls: Option<PublicAcceptor>) -> Self {
        self.tls = tls;
        self
    }
}

impl axum::serve::Listener for BoundedListener {
    type Io = BoundedStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            // axum's accept on a TcpListener retries errors (with a pause) itself.
            let (stream, addr) = axum::serve::Listener::accept(&mut self.inner).await;
            let now = Instant::now();
            let admitted = lock(&self.table).admit(now);
            let id = match admitted {
                Admit::Take(id) => id,
                Admit::Evict { id, victim } => {
                    let closer = self
                        .closers
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&victim);
                    if let Some(closer) = closer {
                        closer.cancel();
                    }
                    metrics::counter!(self.bounds.closed_metric, "reason" => "evicted")
                        .increment(1);
                    id
                }
                Admit::Refuse => {
                    metrics::counter!(self.bounds.closed_metric, "reason" => "refused")
                        .increment(1);
                    drop(stream);
                    continue;
                }
            };
            let close = CancellationToken::new();
            self.closers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, close.clone());
            let stream = BoundedStream {
                stream: match &self.tls {
                    Some(tls) => tls.stream(stream),
                    None => ServerStream::Plain(stream),
                },
                id,
                table: self.table.clone(),
                closers: self.closers.clone(),
                age: Box::pin(tokio::time::sleep(self.bounds.max_age)),
                head_deadline: Box::pin(tokio::time::sleep(self.bounds.header_timeout)),
                header_timeout: self.bounds.header_timeout,
                max_head_bytes: self.bounds.max_head_bytes,
                head_bytes: 0,
                closed_metric: self.bounds.closed_metric,
                evicted: Box::pin(close.cancelled_owned()),
                waiting: true,
                head: HeadEnd::default(),
            };
            return (stream, addr);
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// One ops connection: fails every read once it is older than the maximum age, once it
/// has waited longer than the header timeout for a request head, or once the listener
/// evicted it, which makes the server drop it; leaves the table when dropped.
pub struct BoundedStream {
    /// Plaintext, or TLS: the head is looked for in what TLS decrypted.
    stream: ServerStream,
    id: u64,
    table: Table,
    closers: Arc<Mutex<HashMap<u64, CancellationToken>>>,
    age: Pin<Box<Sleep>>,
    head_deadline: Pin<Box<Sleep>>,
    header_timeout: Duration,
    /// Bytes a request head may have, and those read of the current one.
    max_head_bytes: usize,
    head_bytes: usize,
    closed_metric: &'static str,
    evicted: Pin<Box<WaitForCancellationFutureOwned>>,
    /// Waiting for a request head (since opening or since the last answer).
    waiting: bool,
    head: HeadEnd,
}

fn closed(why: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, why)
}

impl BoundedStream {
    /// Why the connection must close now, if it must; registers the wake-ups otherwise.
    fn must_close(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if self.age.as_mut().poll(cx).is_ready() {
            return Some(closed("ops connection reached its maximum age"));
        }
        if self.evicted.as_mut().poll(cx).is_ready() {
            return Some(closed(
                "ops connection closed for a newer one (at the connection cap)",
            ));
        }
        if self.waiting && self.head_deadline.as_mut().poll(cx).is_ready() {
            metrics::counter!(self.closed_metric, "reason" => "header_timeout").increment(1);
            return Some(closed("ops connection sent no request head in time"));
        }
        None
    }
}

impl Drop for BoundedStream {
    fn drop(&mut self) {
        lock(&self.table).closed(self.id);
        self.closers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
    }
}

impl AsyncRead for BoundedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(error) = self.must_close(cx) {
            return Poll::Ready(Err(error));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            let this = &mut *self;
            if this.waiting {
                let read = &buf.filled()[before..];
                if this.head.feed(read) {
                    this.waiting = false;
                    this.head_bytes = 0;
                    lock(&this.table).head_complete(this.id);
                } else {
                    this.head_bytes += read.len();
                    if this.head_bytes > this.max_head_bytes {
                        metrics::counter!(this.closed_metric, "reason" => "head_too_large")
                            .increment(1);
                        return Poll::Ready(Err(closed("request head too large")));
                    }
                }
            }
        }
        polled
    }
}

impl AsyncWrite for BoundedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.age.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(closed("ops connection reached its maximum age")));
        }
        let polled = Pin::new(&mut self.stream).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            // The answer has started: the connection now waits for its next request.
            // An interim `100 Continue` is not the answer: the body is still coming.
            let interim = buf.starts_with(b"HTTP/1.1 100 ");
            if n > 0 && !self.waiting && !interim {
                let this = &mut *self;
                let now = Instant::now();
                this.waiting = true;
                this.head = HeadEnd::default();
                this.head_bytes = 0;
                this.head_deadline.as_mut().reset(now + this.header_timeout);
                lock(&this.table).answered(this.id, now);
            }
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpStream;

    #[test]
    fn a_request_head_ends_at_the_first_empty_line_in_any_split() {
        let head = b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\nbody";
        for split in 0..head.len() {
            let mut end = HeadEnd::default();
            let first = end.feed(&head[..split]);
            let second = end.feed(&head[split..]);
            assert!(first ^ second, "split at {split}");
            assert_eq!(first, split >= 33, "split at {split}");
        }
        assert!(HeadEnd::default().feed(b"GET / HTTP/1.1\nHost: x\n\n"));
        assert!(!HeadEnd::default().feed(b"GET / HTTP/1.1\r\nHost: x\r\n"));
        assert!(!HeadEnd::default().feed(b"GET / HTTP/1.1\r\nHost: \rx\r\n"));
    }

    #[test]
    fn at_the_cap_the_connection_waiting_longest_is_closed_first() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut table = OpsConnections::new(3);
        assert_eq!(table.admit(at(0)), Admit::Take(0));
        assert_eq!(table.admit(at(1)), Admit::Take(1));
        assert_eq!(table.admit(at(2)), Admit::Take(2));
        // 0 is serving a request; 1 answered one at 5 and waits again.
        table.head_complete(0);
        table.head_complete(1);
        table.answered(1, at(5));
        // 2 (header-less since 2) goes first, then 1 (idle since 5); never 0.
        assert_eq!(table.admit(at(6)), Admit::Evict { id: 3, victim: 2 });
        assert_eq!(table.admit(at(7)), Admit::Evict { id: 4, victim: 1 });
        assert_eq!(table.len(), 3);
        assert_eq!(table.admit(at(8)), Admit::Evict { id: 5, victim: 3 });
    }

    #[test]
    fn at_the_cap_with_every_connection_serving_the_new_one_is_refused() {
        let now = Instant::now();
        let mut table = OpsConnections::new(2);
        assert_eq!(table.admit(now), Admit::Take(0));
        assert_eq!(table.admit(now), Admit::Take(1));
        table.head_complete(0);
        table.head_complete(1);
        assert_eq!(table.admit(now), Admit::Refuse);
        assert_eq!(table.len(), 2);
        // A slot freed by a close is taken without evicting anyone.
        table.closed(0);
        assert_eq!(table.admit(now), Admit::Take(2));
        // An evicted connection's late events change nothing.
        table.closed(7);
        table.answered(7, now);
        assert_eq!(table.len(), 2);
    }

    async fn serve(bounds: OpsBounds, app: axum::Router) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(BoundedListener::new(listener, bounds), app)
                .await
                .unwrap();
        });
        addr
    }

    const GUARD: Duration = Duration::from_secs(10);

    async fn get(stream: &mut TcpStream) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        tokio::time::timeout(GUARD, stream.read_to_string(&mut answer))
            .await
            .expect("answered")
            .unwrap();
        answer
    }

    /// The server closed `stream`: a read ends (EOF or reset) instead of waiting.
    async fn closed_by_server(stream: &mut TcpStream) -> bool {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 16];
        matches!(
            tokio::time::timeout(GUARD, stream.read(&mut buf)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    fn ok_app() -> axum::Router {
        axum::Router::new().route("/", axum::routing::get(|| async { "ok" }))
    }

    /// Bypass closed: idle connections held every slot of the ops port, and a probe
    /// waited for one (up to the maximum age). Now the probe is served at once and
    /// the connection idle the longest is closed for it.
    #[tokio::test]
    async fn a_new_request_at_the_cap_closes_the_oldest_idle_connection() {
        let bounds = OpsBounds {
            max_connections: 2,
            max_age: Duration::from_secs(3600),
            header_timeout: Duration::from_secs(3600),
            ..OpsBounds::default()
        };
        let addr = serve(bounds, ok_app()).await;
        let mut oldest = TcpStream::connect(addr).await.unwrap();
        let newer = TcpStream::connect(addr).await.unwrap();
        let mut probe = TcpStream::connect(addr).await.unwrap();
        let answer = get(&mut probe).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(closed_by_server(&mut oldest).await);
        // Accepted after the oldest, so not chosen: still open (nothing to read).
        let mut buf = [0u8; 1];
        let e = newer.try_read(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
    }

    #[tokio::test]
    async fn a_connection_without_a_request_head_is_closed_at_the_header_timeout() {
        use tokio::io::AsyncWriteExt;
        let timeout = Duration::from_millis(200);
        let bounds = OpsBounds {
            max_connections: 8,
            max_age: Duration::from_secs(3600),
            header_timeout: timeout,
            ..OpsBounds::default()
        };
        let addr = serve(bounds, ok_app()).await;
        let started = std::time::Instant::now();
        let mut slow = TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        assert!(closed_by_server(&mut slow).await);
        assert!(started.elapsed() >= timeout, "not before the timeout");
        // A complete request is served.
        let mut client = TcpStream::connect(addr).await.unwrap();
        assert!(get(&mut client).await.ends_with("ok"));
    }

    /// Bypass closed: a client that opens a connection and sends nothing held the ops
    /// port (a task and a socket) for ever; the maximum age ends even a connection in
    /// the middle of a request.
    #[tokio::test]
    async fn a_connection_in_the_middle_of_a_request_is_closed_at_its_age() {
        use tokio::io::AsyncWriteExt;
        let bounds = OpsBounds {
            max_connections: 1,
            max_age: Duration::from_millis(200),
            header_timeout: Duration::from_secs(3600),
            ..OpsBounds::default()
        };
        let app = axum::Router::new().route(
            "/",
            axum::routing::put(|_body: axum::body::Bytes| async { "ok" }),
        );
        let addr = serve(bounds, app).await;
        // A head completed, a body promised and never sent: serving, not evictable.
        let mut stuck = TcpStream::connect(addr).await.unwrap();
        stuck
            .write_all(b"PUT / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
            .await
            .unwrap();
        assert!(closed_by_server(&mut stuck).await, "closed at its age");
    }
}
